// PoolTier (the worker's side of the pool nodes) against a real kvpool-node over gRPC and
// UCX: lookups longer than one node call allows.
#include "pool_tier.h"

#include <cstdlib>
#include <cstring>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvpool/common/hash.h"
#include "kvpool/pool_node/node_server.h"

namespace kvpool::worker {
namespace {

constexpr uint64_t kPage = 4096;

BlockHash Hash(uint64_t i) { return BlockHash{0x5000 + i, 0x77 ^ (i * 104729)}; }

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};

// A prompt of more blocks than one Lookup call may name (PoolClient::kMaxLookupHashes)
// is looked up in several calls: every stored block is found and reads back intact, and
// every lease is released.
TEST(PoolTierTest, LookupsLongerThanOneCallFindEveryBlock) {
  constexpr size_t kBlocks = pool_node::PoolClient::kMaxLookupHashes * 2 + 100;
  pool_node::NodeConfig c;
  c.listen = "127.0.0.1:0";
  c.metrics_port = -1;
  c.pool.node_id = "pool-tier-test";
  c.pool.page_bytes = kPage;
  c.pool.dram_bytes = (kBlocks + 1024) * kPage;
  auto node = pool_node::NodeServer::Start(c);
  ASSERT_TRUE(node.ok()) << node.status();

  // Local arena: kBlocks pages to put from, kBlocks pages to get into.
  const uint64_t arena_bytes = 2 * kBlocks * kPage;
  void* mem = nullptr;
  ASSERT_EQ(posix_memalign(&mem, kPage, arena_bytes), 0);
  std::unique_ptr<std::byte, FreeDeleter> arena(static_cast<std::byte*>(mem));
  for (uint64_t i = 0; i < arena_bytes / 8; ++i) {
    const uint64_t v = i < kBlocks * kPage / 8 ? i * 0x9E3779B97F4A7C15ull + 1 : 0;
    std::memcpy(arena.get() + i * 8, &v, 8);
  }
  PoolTierOptions o;
  o.node_addresses = {absl::StrCat("127.0.0.1:", (*node)->port())};
  o.client_id = "pool-tier-test";
  // Generous: 8K objects on a loaded 2-core machine (or under ASan) take seconds, and a
  // timed-out call would mark the node down (what is tested here is the split).
  o.rpc_timeout_ms = 120'000;
  o.transfer_timeout = absl::Seconds(120);
  auto tier = PoolTier::Create(o, {arena.get(), arena_bytes}, kPage);
  ASSERT_TRUE(tier.ok()) << tier.status();

  std::vector<BlockHash> hashes;
  std::vector<PoolPut> puts;
  for (size_t i = 0; i < kBlocks; ++i) {
    hashes.push_back(Hash(i));
    PoolPut p;
    p.hash = Hash(i);
    if (i > 0) p.parent = Hash(i - 1);
    p.local_pages = {i};
    p.length = kPage;
    puts.push_back(std::move(p));
  }
  EXPECT_EQ((*tier)->Put(puts), kBlocks * kPage);
  ASSERT_EQ((*tier)->rpc_failures(), 0u);

  PoolLookup found = (*tier)->Lookup(hashes, StateKind::kAttnKv, kPage);
  EXPECT_EQ((*tier)->rpc_failures(), 0u);
  ASSERT_EQ(found.found.size(), kBlocks);
  std::vector<size_t> which;
  std::vector<std::vector<uint64_t>> dst;
  for (size_t i = 0; i < kBlocks; ++i) {
    ASSERT_TRUE(found.found[i].has_value()) << "block " << i;
    which.push_back(i);
    dst.push_back({kBlocks + i});
  }
  EXPECT_EQ(found.leases.size(), 3u);  // one per call
  ASSERT_TRUE((*tier)->Get(found, which, dst).ok());
  EXPECT_EQ(std::memcmp(arena.get(), arena.get() + kBlocks * kPage, kBlocks * kPage), 0);

  (*tier)->Release(found);
  EXPECT_TRUE(found.leases.empty());
  // The releases are asynchronous: the node's lease count drops to zero once they land.
  // (Bounded only to turn a lost release into a failure; nothing here is timed.)
  uint64_t leases = 1;
  for (int i = 0; i < 2000 && leases != 0; ++i) {
    leases = (*node)->core().Stats().active_leases;
    if (leases != 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(leases, 0u);
}

// An object of another length than the worker's block is a miss: filling part of a page
// with it would cache the rest of the page (stale bytes) as KV of that hash. Before, the
// half-page object below was found, and a Get of it landed 2 KiB in a 4 KiB block.
TEST(PoolTierTest, ObjectsOfAnotherLengthAreMisses) {
  pool_node::NodeConfig c;
  c.listen = "127.0.0.1:0";
  c.metrics_port = -1;
  c.pool.node_id = "pool-tier-length";
  c.pool.page_bytes = kPage;
  c.pool.dram_bytes = 64 * kPage;
  auto node = pool_node::NodeServer::Start(c);
  ASSERT_TRUE(node.ok()) << node.status();
  void* mem = nullptr;
  ASSERT_EQ(posix_memalign(&mem, kPage, 8 * kPage), 0);
  std::unique_ptr<std::byte, FreeDeleter> arena(static_cast<std::byte*>(mem));
  std::memset(arena.get(), 0x3C, 8 * kPage);
  PoolTierOptions o;
  o.node_addresses = {absl::StrCat("127.0.0.1:", (*node)->port())};
  o.client_id = "pool-tier-length";
  auto tier = PoolTier::Create(o, {arena.get(), 8 * kPage}, kPage);
  ASSERT_TRUE(tier.ok()) << tier.status();
  std::vector<BlockHash> hashes;
  std::vector<PoolPut> puts;
  for (size_t i = 0; i < 3; ++i) {  // block 1 is half a page
    hashes.push_back(Hash(100 + i));
    PoolPut p;
    p.hash = hashes.back();
    if (i > 0) p.parent = hashes[i - 1];
    p.local_pages = {i};
    p.length = i == 1 ? kPage / 2 : kPage;
    puts.push_back(std::move(p));
  }
  EXPECT_EQ((*tier)->Put(puts), 5 * kPage / 2);
  PoolLookup found = (*tier)->Lookup(hashes, StateKind::kAttnKv, kPage);
  ASSERT_EQ(found.found.size(), 3u);
  EXPECT_TRUE(found.found[0].has_value());
  EXPECT_FALSE(found.found[1].has_value()) << "a half-page object was found for a 4 KiB block";
  EXPECT_TRUE(found.found[2].has_value());
  (*tier)->Release(found);
}

// A node that stays down is retried after longer and longer waits (retry_after doubling
// up to max_retry_after): each retry reconnects on the engine thread and may wait out an
// RPC timeout there. Before, it was retried every retry_after for good.
TEST(PoolTierTest, ANodeThatStaysDownIsRetriedLessAndLessOften) {
  void* mem = nullptr;
  ASSERT_EQ(posix_memalign(&mem, kPage, 4 * kPage), 0);
  std::unique_ptr<std::byte, FreeDeleter> arena(static_cast<std::byte*>(mem));
  PoolTierOptions o;
  o.node_addresses = {"127.0.0.1:1"};  // nothing listens there: refused at once
  o.client_id = "pool-tier-backoff";
  o.rpc_timeout_ms = 500;
  o.retry_after = absl::Milliseconds(20);
  o.max_retry_after = absl::Milliseconds(320);
  auto tier = PoolTier::Create(o, {arena.get(), 4 * kPage}, kPage);
  ASSERT_TRUE(tier.ok()) << tier.status();
  const std::vector<BlockHash> hashes = {Hash(1)};
  const absl::Time end = absl::Now() + absl::Seconds(2);
  int lookups = 0;
  while (absl::Now() < end) {
    PoolLookup l = (*tier)->Lookup(hashes, StateKind::kAttnKv, kPage);
    EXPECT_FALSE(l.found[0].has_value());
    ++lookups;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // Waits of 20, 40, 80, 160, then 320 ms: at most ~10 attempts in 2 s however fast
  // the machine (each one is a refused connect); a fixed 20 ms wait allowed ~90.
  const uint64_t attempts = (*tier)->rpc_failures();
  EXPECT_GE(attempts, 1u);
  EXPECT_LE(attempts, 12u) << lookups << " lookups";
}

}  // namespace
}  // namespace kvpool::worker
