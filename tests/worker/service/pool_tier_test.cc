// PoolTier (the worker's side of the pool nodes) against a real kvpool-node over gRPC and
// UCX: lookups longer than one node call allows, objects of another length, checksum
// quarantine, a node restarted at its address, and, against fake PoolNode services
// (loopback gRPC, real UCX workers) that inject faults, back-off and a node failing
// partway through a lookup.
#include "pool_tier.h"

#include <sys/shm.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvpool/common/hash.h"
#include "kvpool/pool_node/node_server.h"
#include "kvpool/transport/transport.h"
#include "kvpool/v1/pool.grpc.pb.h"
#include <grpcpp/grpcpp.h>

namespace kvpool::worker {
namespace {

constexpr uint64_t kPage = 4096;

BlockHash Hash(uint64_t i) { return BlockHash{0x5000 + i, 0x77 ^ (i * 104729)}; }

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};

// A node of `node_pages` pages and a tier over a local arena of `arena_pages` pages
// (filled with 0x3C).
struct SmallPool {
  std::unique_ptr<pool_node::NodeServer> node;
  std::unique_ptr<std::byte, FreeDeleter> arena;
  std::unique_ptr<PoolTier> tier;
};

void StartSmallPool(const std::string& name, SmallPool& p, PoolTierOptions o = {}, uint64_t node_pages = 64,
                    uint64_t arena_pages = 8) {
  pool_node::NodeConfig c;
  c.listen = "127.0.0.1:0";
  c.metrics_port = -1;
  c.pool.node_id = name;
  c.pool.page_bytes = kPage;
  c.pool.dram_bytes = node_pages * kPage;
  auto node = pool_node::NodeServer::Start(c);
  ASSERT_TRUE(node.ok()) << node.status();
  p.node = *std::move(node);
  void* mem = nullptr;
  ASSERT_EQ(posix_memalign(&mem, kPage, arena_pages * kPage), 0);
  p.arena.reset(static_cast<std::byte*>(mem));
  std::memset(p.arena.get(), 0x3C, arena_pages * kPage);
  o.node_addresses = {absl::StrCat("127.0.0.1:", p.node->port())};
  o.client_id = name;
  auto tier = PoolTier::Create(o, {p.arena.get(), arena_pages * kPage}, kPage);
  ASSERT_TRUE(tier.ok()) << tier.status();
  p.tier = *std::move(tier);
}

// A prompt of more blocks than one Lookup call may name (PoolClient::kMaxLookupHashes)
// is looked up in several calls: every stored block is found and reads back intact, and
// every lease is released.
TEST(PoolTierTest, LookupsLongerThanOneCallFindEveryBlock) {
  constexpr size_t kBlocks = pool_node::PoolClient::kMaxLookupHashes * 2 + 100;
  PoolTierOptions o;
  // Generous: 8K objects on a loaded 2-core machine (or under ASan) take seconds, and a
  // timed-out call would mark the node down (what is tested here is the split).
  o.rpc_timeout_ms = 120'000;
  o.transfer_timeout = absl::Seconds(30);  // within twice the node's 30 s reserve timeout (PoolClient::Put)
  // Local arena: kBlocks pages to put from (a pattern), kBlocks pages to get into (zeros).
  SmallPool p;
  ASSERT_NO_FATAL_FAILURE(StartSmallPool("pool-tier-test", p, o, kBlocks + 1024, 2 * kBlocks));
  std::byte* arena = p.arena.get();
  for (uint64_t i = 0; i < 2 * kBlocks * kPage / 8; ++i) {
    const uint64_t v = i < kBlocks * kPage / 8 ? i * 0x9E3779B97F4A7C15ull + 1 : 0;
    std::memcpy(arena + i * 8, &v, 8);
  }

  std::vector<BlockHash> hashes;
  std::vector<PoolPut> puts;
  for (size_t i = 0; i < kBlocks; ++i) {
    hashes.push_back(Hash(i));
    PoolPut put;
    put.hash = Hash(i);
    if (i > 0) put.parent = Hash(i - 1);
    put.local_pages = {i};
    put.length = kPage;
    puts.push_back(std::move(put));
  }
  EXPECT_EQ(p.tier->Put(puts), kBlocks * kPage);
  ASSERT_EQ(p.tier->rpc_failures(), 0u);

  PoolLookup found = p.tier->Lookup(hashes, StateKind::kAttnKv, kPage);
  EXPECT_EQ(p.tier->rpc_failures(), 0u);
  ASSERT_EQ(found.found.size(), kBlocks);
  std::vector<size_t> which;
  std::vector<std::vector<uint64_t>> dst;
  for (size_t i = 0; i < kBlocks; ++i) {
    ASSERT_TRUE(found.found[i].has_value()) << "block " << i;
    which.push_back(i);
    dst.push_back({kBlocks + i});
  }
  EXPECT_EQ(found.leases.size(), 3u);  // one per call
  ASSERT_TRUE(p.tier->Get(found, which, dst).ok());
  EXPECT_EQ(std::memcmp(arena, arena + kBlocks * kPage, kBlocks * kPage), 0);

  p.tier->Release(found);
  EXPECT_TRUE(found.leases.empty());
  // The releases are asynchronous: the node's lease count drops to zero once they land.
  // (Bounded only to turn a lost release into a failure; nothing here is timed.)
  uint64_t leases = 1;
  for (int i = 0; i < 2000 && leases != 0; ++i) {
    leases = p.node->core().Stats().active_leases;
    if (leases != 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(leases, 0u);
}

// Puts a chain of n blocks from local pages 0..n-1, block i of lengths[i] bytes.
std::vector<BlockHash> PutChain(PoolTier& tier, uint64_t first, const std::vector<uint64_t>& lengths) {
  std::vector<BlockHash> hashes;
  std::vector<PoolPut> puts;
  for (size_t i = 0; i < lengths.size(); ++i) {
    hashes.push_back(Hash(first + i));
    PoolPut p;
    p.hash = hashes.back();
    if (i > 0) p.parent = hashes[i - 1];
    p.local_pages = {i};
    p.length = lengths[i];
    puts.push_back(std::move(p));
  }
  uint64_t total = 0;
  for (uint64_t l : lengths) total += l;
  EXPECT_EQ(tier.Put(puts), total);
  return hashes;
}

// An object of another length than the worker's block is a miss: filling part of a page
// with it would cache the rest of the page (stale bytes) as KV of that hash. Before, the
// half-page object below was found, and a Get of it landed 2 KiB in a 4 KiB block; and the
// node leased it (and made it more recent) on every Lookup.
TEST(PoolTierTest, ObjectsOfAnotherLengthAreMisses) {
  SmallPool p;
  ASSERT_NO_FATAL_FAILURE(StartSmallPool("pool-tier-length", p));
  const std::vector<BlockHash> hashes = PutChain(*p.tier, 100, {kPage, kPage / 2, kPage});  // block 1: half a page
  PoolLookup found = p.tier->Lookup(hashes, StateKind::kAttnKv, kPage);
  ASSERT_EQ(found.found.size(), 3u);
  EXPECT_TRUE(found.found[0].has_value());
  EXPECT_FALSE(found.found[1].has_value()) << "a half-page object was found for a 4 KiB block";
  EXPECT_TRUE(found.found[2].has_value());
  // The node was told the length (LookupRequest.object_length): it leased only the others.
  EXPECT_EQ(p.node->core().Inspect({hashes[1], StateKind::kAttnKv})->leases, 0u);
  EXPECT_EQ(p.node->core().Inspect({hashes[2], StateKind::kAttnKv})->leases, 1u);
  p.tier->Release(found);
}

// An object whose bytes on the node no longer match its checksum fails the Get, and is
// a miss on later Lookups (for mismatch_quarantine), while its neighbours are still
// found. Before, every request found it again, fetched it and threw the fetch away.
TEST(PoolTierTest, AnObjectThatFailedItsChecksumIsAMissAfterwards) {
  SmallPool p;
  PoolTierOptions o;
  o.mismatch_quarantine = absl::Hours(1);
  ASSERT_NO_FATAL_FAILURE(StartSmallPool("pool-tier-mismatch", p, o));
  const std::vector<BlockHash> hashes = PutChain(*p.tier, 200, {kPage, kPage, kPage});
  PoolLookup found = p.tier->Lookup(hashes, StateKind::kAttnKv, kPage);
  ASSERT_EQ(found.found.size(), 3u);
  for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(found.found[i].has_value()) << i;
  // Block 1's bytes change on the node after its Commit.
  ASSERT_EQ(found.found[1]->object.pages.size(), 1u);
  p.node->core().arena_base()[uint64_t{found.found[1]->object.pages[0]} * kPage + 17] ^= std::byte{0xFF};
  const std::vector<size_t> which = {0, 1, 2};
  const std::vector<std::vector<uint64_t>> dst = {{4}, {5}, {6}};
  const absl::Status got = p.tier->Get(found, which, dst);
  EXPECT_TRUE(absl::IsDataLoss(got)) << got;
  EXPECT_EQ(p.tier->mismatched_objects(), 1u);
  p.tier->Release(found);

  PoolLookup again = p.tier->Lookup(hashes, StateKind::kAttnKv, kPage);
  ASSERT_EQ(again.found.size(), 3u);
  EXPECT_TRUE(again.found[0].has_value());
  EXPECT_FALSE(again.found[1].has_value()) << "the object that failed its checksum was found again";
  EXPECT_TRUE(again.found[2].has_value());
  // The others still read back intact.
  const std::vector<size_t> good = {0, 2};
  const std::vector<std::vector<uint64_t>> good_dst = {{4}, {6}};
  EXPECT_TRUE(p.tier->Get(again, good, good_dst).ok());
  p.tier->Release(again);
}

// Sets an environment variable for one test and puts back its old value at the end.
// Declared before the test's UCX objects (so it outlives them): UCX reads UCX_* when a
// context is created.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Polls (bounded) until the node holds no lease; returns the last count seen. Only to
// turn a lost release into a failure: nothing here is timed.
uint64_t AwaitNoLeases(pool_node::NodeServer& node) {
  uint64_t leases = 1;
  for (int i = 0; i < 2000 && leases != 0; ++i) {
    leases = node.core().Stats().active_leases;
    if (leases != 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return leases;
}

// A node restarted at the same address: the worker's gRPC channel reaches the new process
// at once, its transport endpoint still points at the old one, and never works again.
// Either the tier sees the broken endpoint before the Lookup (and sends none), or the
// Lookup leases objects on the new node, the Get through the stale endpoint fails and
// marks the node down, and the Release still reaches the new node (its gRPC works).
// Which one depends on when UCX notices the old worker is gone; both end with no lease
// left. Before, the Lookup went out whatever the endpoint's state, and a node marked
// down had no client to release with: the lease pinned the objects (unevictable, and
// counted against this worker's pinned bytes) until it expired, 30 s later.
// Over tcp: both nodes live in this process, where a shared-memory endpoint to the old
// one could still read its (unmapped, maybe reused) arena address; tcp notices the old
// worker is gone, as a restarted process would be on any transport.
TEST(PoolTierTest, ANodeRestartedAtItsAddressKeepsNoLeaseOfThisWorker) {
  const ScopedEnv tcp("UCX_TLS", "tcp");  // before any UCX context of this test
  SmallPool p;
  PoolTierOptions o;
  o.retry_after = absl::Hours(1);  // the tier does not reconnect during the test
  o.max_retry_after = absl::Hours(1);
  ASSERT_NO_FATAL_FAILURE(StartSmallPool("pool-tier-restart", p, o));
  const int port = p.node->port();
  ASSERT_EQ(PutChain(*p.tier, 300, {kPage, kPage}).size(), 2u);  // connected, the endpoint used
  p.node->Shutdown();
  p.node.reset();
  // The new process at the same address, given the same objects by another worker.
  pool_node::NodeConfig c;
  c.listen = absl::StrCat("127.0.0.1:", port);
  c.metrics_port = -1;
  c.pool.node_id = "pool-tier-restart-2";
  c.pool.page_bytes = kPage;
  c.pool.dram_bytes = 64 * kPage;
  auto node2 = pool_node::NodeServer::Start(c);
  ASSERT_TRUE(node2.ok()) << node2.status();
  void* mem = nullptr;
  ASSERT_EQ(posix_memalign(&mem, kPage, 8 * kPage), 0);
  std::unique_ptr<std::byte, FreeDeleter> arena2(static_cast<std::byte*>(mem));
  std::memset(arena2.get(), 0x3C, 8 * kPage);
  PoolTierOptions o2;
  o2.node_addresses = {c.listen};
  o2.client_id = "pool-tier-restart-other";
  auto other = PoolTier::Create(o2, {arena2.get(), 8 * kPage}, kPage);
  ASSERT_TRUE(other.ok()) << other.status();
  const std::vector<BlockHash> hashes = PutChain(**other, 300, {kPage, kPage});

  PoolLookup found = p.tier->Lookup(hashes, StateKind::kAttnKv, kPage);
  if (!found.leases.empty()) {  // the endpoint looked fine then: leased on the new node
    ASSERT_TRUE(found.found[0].has_value());
    EXPECT_EQ((*node2)->core().Stats().active_leases, 1u);
    const std::vector<size_t> which = {0, 1};
    const std::vector<std::vector<uint64_t>> dst = {{4}, {5}};
    const absl::Status got = p.tier->Get(found, which, dst);
    EXPECT_FALSE(got.ok()) << "a Get through the old process's endpoint succeeded";
  } else {
    EXPECT_FALSE(found.found[0].has_value());
  }
  std::printf("the Lookup %s\n", found.leases.empty() ? "was not sent (broken endpoint seen first)"
                                                        : "leased on the new node; its Get failed");
  EXPECT_EQ(p.tier->live_nodes(), 0u);  // marked down
  p.tier->Release(found);
  EXPECT_EQ(AwaitNoLeases(**node2), 0u) << "this worker's lease on the restarted node was not released";
}

// The SysV segment id of the shared mapping holding `addr` in this process (from
// /proc/self/maps: a SysV mapping's inode is its shmid); -1 when none.
int ShmIdAt(const void* addr) {
  std::FILE* f = std::fopen("/proc/self/maps", "r");
  if (f == nullptr) return -1;
  const auto a = reinterpret_cast<uintptr_t>(addr);
  char line[512];
  int id = -1;
  while (id < 0 && std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long lo = 0, hi = 0, inode = 0;
    char name[256] = "";
    if (std::sscanf(line, "%lx-%lx %*s %*s %*s %lu %255s", &lo, &hi, &inode, name) == 4 && a >= lo && a < hi &&
        std::strncmp(name, "/SYSV", 5) == 0) {
      id = static_cast<int>(inode);
    }
  }
  std::fclose(f);
  return id;
}

// A same-host node that died: the tier marks it down (its gRPC is gone) and keeps the old
// client only to send Releases, with its transport closed, so this process no longer
// maps the dead node's arena (a shared-memory segment the size of its DRAM tier) and the
// segment goes. Kept open, the retired client held it mapped until the node's next
// MarkDown, next to the restarted node's own arena.
TEST(PoolTierTest, ANodeMarkedDownIsNoLongerMappedHere) {
  SmallPool p;
  PoolTierOptions o;
  o.retry_after = absl::Hours(1);
  o.max_retry_after = absl::Hours(1);
  ASSERT_NO_FATAL_FAILURE(StartSmallPool("pool-tier-unmap", p, o));
  const std::vector<BlockHash> hashes = PutChain(*p.tier, 400, {kPage, kPage});  // maps the arena here
  const int shmid = ShmIdAt(p.node->core().arena_base());
  shmid_ds ds{};
  if (shmid < 0 || shmctl(shmid, IPC_STAT, &ds) != 0 || ds.shm_nattch < 2) {
    GTEST_SKIP() << "the tier does not map the node's arena here (UCX_TLS without shared-memory lanes)";
  }
  p.node->Shutdown();
  p.node.reset();
  ASSERT_EQ(shmctl(shmid, IPC_STAT, &ds), 0) << "the segment went with the node: this client did not hold it";
  EXPECT_EQ(ds.shm_nattch, 1u);  // this tier's client
  PoolLookup l = p.tier->Lookup(hashes, StateKind::kAttnKv, kPage);  // the node is gone: marked down
  EXPECT_FALSE(l.found[0].has_value());
  EXPECT_EQ(p.tier->live_nodes(), 0u);
  bool gone = false;  // the endpoint closes on the transport's thread: bounded wait, not timed
  for (int i = 0; i < 2000 && !gone; ++i) {
    gone = shmctl(shmid, IPC_STAT, &ds) != 0;
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(gone) << "the dead node's arena is still mapped here (" << ds.shm_nattch << " attached)";
}

// A node that stays down is retried after longer and longer waits (retry_after doubling
// up to max_retry_after): each retry reconnects on the engine thread and may wait out an
// RPC timeout there. Before, it was retried every retry_after for good.
// A tier over a 4-page arena whose one node, at `address`, is skipped 20 ms after a
// failure, doubling up to 320 ms: it looks one hash up every ~2 ms for 2 s, calling
// `before` ahead of each Lookup. Returns the tier's RPC failures; *lookups: Lookups made.
uint64_t LookUpFor2s(const std::string& address, const std::string& client_id,
                     const std::function<void()>& before, int* lookups) {
  void* mem = nullptr;
  EXPECT_EQ(posix_memalign(&mem, kPage, 4 * kPage), 0);
  std::unique_ptr<std::byte, FreeDeleter> arena(static_cast<std::byte*>(mem));
  PoolTierOptions o;
  o.node_addresses = {address};
  o.client_id = client_id;
  o.rpc_timeout_ms = 500;
  o.retry_after = absl::Milliseconds(20);
  o.max_retry_after = absl::Milliseconds(320);
  auto tier = PoolTier::Create(o, {arena.get(), 4 * kPage}, kPage);
  EXPECT_TRUE(tier.ok()) << tier.status();
  if (!tier.ok()) return 0;
  const std::vector<BlockHash> hashes = {Hash(1)};
  const absl::Time end = absl::Now() + absl::Seconds(2);
  *lookups = 0;
  while (absl::Now() < end) {
    before();
    PoolLookup l = (*tier)->Lookup(hashes, StateKind::kAttnKv, kPage);
    EXPECT_FALSE(l.found[0].has_value());
    (*tier)->Release(l);
    ++*lookups;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return (*tier)->rpc_failures();  // the tier goes before its arena
}

TEST(PoolTierTest, ANodeThatStaysDownIsRetriedLessAndLessOften) {
  int lookups = 0;
  // Nothing listens at port 1: refused at once.
  const uint64_t attempts = LookUpFor2s("127.0.0.1:1", "pool-tier-backoff", [] {}, &lookups);
  // Waits of 20, 40, 80, 160, then 320 ms: at most ~10 attempts in 2 s however fast
  // the machine (each one is a refused connect); a fixed 20 ms wait allowed ~90.
  EXPECT_GE(attempts, 1u);
  EXPECT_LE(attempts, 12u) << lookups << " lookups";
}

// Serves a fake node's service on a loopback port of its own (*port).
std::unique_ptr<grpc::Server> ServeOnLoopback(grpc::Service* service, int* port) {
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  b.RegisterService(service);
  return b.BuildAndStart();
}

// A node whose gRPC answers but whose transport fails soon after every Connect (as one
// whose UCX port a firewall drops, or that advertises an interface workers cannot
// reach): each Connect gets a fresh UCX worker of this fake, which the test destroys
// (DropWorkers). Lookups find nothing.
class FlakyDataPlaneNode final : public v1::PoolNode::Service {
 public:
  explicit FlakyDataPlaneNode(std::shared_ptr<transport::Context> ucx) : ucx_(std::move(ucx)) {}
  grpc::Status Connect(grpc::ServerContext*, const v1::ConnectRequest*, v1::ConnectResponse* resp) override {
    auto w = transport::Worker::Create(ucx_);
    if (!w.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, std::string(w.status().message()));
    auto a = (*w)->AllocateArena(16 * kPage, kPage);
    if (!a.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, std::string(a.status().message()));
    resp->set_node_id("flaky-data-plane");
    resp->set_ucx_worker_address((*w)->address());
    resp->set_arena_descriptor((*a)->descriptor().Serialize());
    std::lock_guard<std::mutex> l(mu_);
    arenas_.push_back(*std::move(a));
    workers_.push_back(*std::move(w));
    ++connects_;
    return grpc::Status::OK;
  }
  grpc::Status Lookup(grpc::ServerContext*, const v1::LookupRequest*, v1::LookupResponse*) override {
    return grpc::Status::OK;
  }
  void DropWorkers() {
    std::lock_guard<std::mutex> l(mu_);
    arenas_.clear();
    workers_.clear();
  }
  int connects() {
    std::lock_guard<std::mutex> l(mu_);
    return connects_;
  }

 private:
  std::shared_ptr<transport::Context> ucx_;
  std::mutex mu_;
  std::vector<std::shared_ptr<transport::Arena>> arenas_;
  std::vector<std::unique_ptr<transport::Worker>> workers_;
  int connects_ = 0;
};

// Such a node connects every time and fails each time its transport does. The waits
// between its Connects grow (retry_after doubling up to max_retry_after) as for a node
// that refuses gRPC: only a Get or Put that worked resets them. Before, every Connect that
// succeeded reset the wait, so the node was dialled every retry_after for good, each
// time a Connect RPC on the engine thread (and on a network that drops packets, a
// transfer waiting out its timeout).
TEST(PoolTierTest, ANodeWhoseTransportKeepsFailingIsRetriedLessAndLessOften) {
  const ScopedEnv tcp("UCX_TLS", "tcp");  // tcp endpoints watch their peer
  auto ucx = transport::Context::Create();
  ASSERT_TRUE(ucx.ok()) << ucx.status();
  FlakyDataPlaneNode fake(*ucx);
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(&fake, &port);
  ASSERT_NE(server, nullptr);
  int lookups = 0;
  // Before each Lookup, whatever endpoint the tier holds starts failing.
  const uint64_t failures = LookUpFor2s(absl::StrCat("127.0.0.1:", port), "pool-tier-flaky-data-plane",
                                        [&fake] { fake.DropWorkers(); }, &lookups);
  const int connects = fake.connects();
  std::printf("%d connects, %llu failures, %d lookups in 2 s\n", connects, static_cast<unsigned long long>(failures),
              lookups);
  // Waits of 20, 40, 80, 160, then 320 ms: ~10 connects in 2 s however fast the endpoint
  // fails; a wait reset at every Connect gave one per 20 ms plus the time to notice.
  EXPECT_GE(connects, 2) << "no endpoint failed: the test shows nothing";
  EXPECT_LE(connects, 12);
  server->Shutdown();
}

// A node that answers the first Lookup call of a long prompt (every hash found, under
// lease 77) and fails the second with UNAVAILABLE, as a node dying between the two
// would. Its transport is a live UCX worker of this fake; Releases are recorded.
class FailsSecondLookupNode final : public v1::PoolNode::Service {
 public:
  explicit FailsSecondLookupNode(std::shared_ptr<transport::Context> ucx) {
    auto w = transport::Worker::Create(std::move(ucx));
    EXPECT_TRUE(w.ok()) << w.status();
    worker_ = *std::move(w);
    auto a = worker_->AllocateArena(16 * kPage, kPage);
    EXPECT_TRUE(a.ok()) << a.status();
    arena_ = *std::move(a);
  }
  grpc::Status Connect(grpc::ServerContext*, const v1::ConnectRequest*, v1::ConnectResponse* resp) override {
    resp->set_node_id("fails-second-lookup");
    resp->set_ucx_worker_address(worker_->address());
    resp->set_arena_descriptor(arena_->descriptor().Serialize());
    return grpc::Status::OK;
  }
  grpc::Status Lookup(grpc::ServerContext*, const v1::LookupRequest* req, v1::LookupResponse* resp) override {
    if (lookups.fetch_add(1) > 0) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "injected: node went away");
    for (const std::string& h : req->block_hashes()) {
      v1::ObjectDescriptor* d = resp->add_objects();
      d->set_block_hash(h);
      d->mutable_run()->add_pages(0);
      d->mutable_run()->set_length(req->object_length());
    }
    resp->set_prefix_blocks(static_cast<uint32_t>(req->block_hashes_size()));
    resp->set_lease_id(77);
    resp->set_lease_ttl_ms(30'000);
    return grpc::Status::OK;
  }
  grpc::Status Release(grpc::ServerContext*, const v1::ReleaseRequest* req, v1::ReleaseResponse*) override {
    if (req->lease_id() == 77) released.fetch_add(1);
    return grpc::Status::OK;
  }
  std::atomic<int> lookups{0}, released{0};

 private:
  std::unique_ptr<transport::Worker> worker_;
  std::shared_ptr<transport::Arena> arena_;
};

// A node that fails partway through the Lookup calls of one prompt (more hashes than one
// call may name) leaves nothing of its earlier calls in the answer: their objects are
// misses and their lease is released (through the client kept for that, its gRPC
// working). Before, the first call's objects stayed found, and the Get of the whole
// prefix then failed on the node marked down ("went away"), the other nodes' blocks
// with it.
TEST(PoolTierTest, ANodeFailingPartwayThroughALookupLeavesNothingOfItsEarlierCalls) {
  auto ucx = transport::Context::Create();
  ASSERT_TRUE(ucx.ok()) << ucx.status();
  FailsSecondLookupNode fake(*ucx);
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(&fake, &port);
  ASSERT_NE(server, nullptr);
  {
    void* mem = nullptr;
    ASSERT_EQ(posix_memalign(&mem, kPage, 4 * kPage), 0);
    std::unique_ptr<std::byte, FreeDeleter> arena(static_cast<std::byte*>(mem));
    PoolTierOptions o;
    o.node_addresses = {absl::StrCat("127.0.0.1:", port)};
    o.client_id = "pool-tier-partway";
    o.retry_after = absl::Hours(1);
    o.max_retry_after = absl::Hours(1);
    auto tier = PoolTier::Create(o, {arena.get(), 4 * kPage}, kPage);
    ASSERT_TRUE(tier.ok()) << tier.status();
    std::vector<BlockHash> hashes;
    for (size_t i = 0; i < pool_node::PoolClient::kMaxLookupHashes + 10; ++i) hashes.push_back(Hash(5000 + i));
    PoolLookup l = (*tier)->Lookup(hashes, StateKind::kAttnKv, kPage);
    EXPECT_EQ(fake.lookups.load(), 2);
    size_t found = 0;
    for (const auto& f : l.found) found += f.has_value();
    EXPECT_EQ(found, 0u) << "objects of the node's first call stayed found after its second failed";
    EXPECT_TRUE(l.leases.empty());
    EXPECT_EQ((*tier)->live_nodes(), 0u);
    (*tier)->Release(l);  // nothing left to release
    for (int i = 0; i < 2000 && fake.released.load() == 0; ++i) {  // bounded, not timed
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_EQ(fake.released.load(), 1) << "the first call's lease was not released exactly once";
  }
  server->Shutdown();
}

}  // namespace
}  // namespace kvpool::worker
