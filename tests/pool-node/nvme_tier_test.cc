// The NVMe tier: demotion, promotion, restart recovery, on-disk corruption.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <thread>

#include <xxhash.h>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/pool_node/pool_core.h"
#include "test_util.h"

namespace kvpool::pool_node {
namespace {

using testing::H;
using testing::Pattern;
using testing::Put;
using testing::PutChain;

constexpr uint64_t kPage = 4096;

class NvmeTierTest : public ::testing::Test {
 protected:
  // `extra` with this fixture's pages, tiers, directory and clock, no background thread.
  PoolOptions Options(uint64_t dram_pages, uint64_t nvme_pages, PoolOptions extra = {}) {
    extra.page_bytes = kPage;
    extra.dram_bytes = dram_pages * kPage;
    extra.nvme_dir = dir_.path();
    extra.nvme_bytes = nvme_pages * kPage;
    extra.background = false;
    extra.clock = &clock_;
    return extra;
  }
  std::unique_ptr<PoolCore> Make(uint64_t dram_pages, uint64_t nvme_pages, PoolOptions extra = {}) {
    auto core = PoolCore::Create(Options(dram_pages, nvme_pages, std::move(extra)));
    EXPECT_TRUE(core.ok()) << core.status();
    return core.ok() ? std::move(*core) : nullptr;
  }
  // Overwrites one page of the data file with garbage, through O_DIRECT like the tier.
  void CorruptNvmePage(const std::string& path, uint32_t page) {
    int fd = ::open(path.c_str(), O_WRONLY | O_DIRECT);
    ASSERT_GE(fd, 0);
    void* buf = nullptr;
    ASSERT_EQ(posix_memalign(&buf, 4096, kPage), 0);
    std::memset(buf, 0xEE, kPage);
    ASSERT_EQ(::pwrite(fd, buf, kPage, static_cast<off_t>(page) * kPage), static_cast<ssize_t>(kPage));
    std::free(buf);
    ::close(fd);
  }
  // Looks up H(first)..H(first+n-1): one prefix of n blocks, each PutChain's bytes.
  void ExpectChainReadsBack(PoolCore& core, uint64_t first, uint64_t n, size_t bytes) {
    LookupSpec spec;
    for (uint64_t i = first; i < first + n; ++i) spec.hashes.push_back(H(i));
    auto ans = core.Lookup(spec);
    ASSERT_TRUE(ans.ok()) << ans.status();
    ASSERT_EQ(ans->prefix_blocks, n);
    for (uint64_t i = first; i < first + n; ++i) {
      auto b = core.ReadObject(ans->lease_id, {H(i), StateKind::kAttnKv});
      ASSERT_TRUE(b.ok()) << i;
      EXPECT_TRUE(*b == Pattern(i, bytes)) << i;
    }
  }
  testing::TempDir dir_;
  ManualClock clock_;
};

// The leaf sets and per-tier child counts the core keeps incrementally match a full walk
// after every operation of a random run over a branching forest: puts of children before
// their parents, DRAM eviction by Reserves, demotions, NVMe eviction, promotions by
// Lookup, lease releases.
TEST_F(NvmeTierTest, IncrementalLeafBookkeepingMatchesAFullWalk) {
  auto core = Make(24, 48);
  ASSERT_NE(core, nullptr);
  std::mt19937 rng(12345);
  constexpr uint64_t kHashes = 80;
  // parent[i] < i, or none: a forest in which many blocks share a parent.
  std::vector<std::optional<uint64_t>> parent(kHashes);
  for (uint64_t i = 1; i < kHashes; ++i) {
    if (rng() % 5 != 0) {
      parent[i] = rng() % std::min<uint64_t>(i, 12);
    }
  }
  auto chain_to = [&](uint64_t i) {
    std::vector<BlockHash> c;
    for (std::optional<uint64_t> at = i; at; at = parent[*at]) c.insert(c.begin(), H(*at));
    return c;
  };
  for (int step = 0; step < 600; ++step) {
    const uint64_t i = rng() % kHashes;
    const int op = static_cast<int>(rng() % 10);
    if (op < 6) {  // a put (of one or two pages; refused when nothing can be evicted)
      const size_t bytes = (1 + rng() % 2) * kPage;
      Put(*core, H(i), parent[i] ? std::optional<BlockHash>(H(*parent[i])) : std::nullopt, Pattern(i, bytes))
          .IgnoreError();
    } else if (op < 8) {
      core->Demote(1 + rng() % 6);
    } else {  // a lookup (promoting NVMe hits), released at once or left to expire
      LookupSpec spec;
      spec.hashes = chain_to(i);
      spec.lease_ms = 100;
      auto a = core->Lookup(spec);
      if (a.ok() && a->lease_id != 0 && rng() % 2 == 0) {
        ASSERT_TRUE(core->Release(a->lease_id).ok());
      }
      clock_.AdvanceMs(40);
      core->RunMaintenance();
    }
    const absl::Status st = core->CheckIndex();
    ASSERT_TRUE(st.ok()) << "step " << step << " (op " << op << ", hash " << i << "): " << st;
  }
  const PoolStatsSnapshot s = core->Stats();
  EXPECT_GT(s.tiers[static_cast<int>(Tier::kNvme)].objects, 0u) << "the run never reached the NVMe tier";
  EXPECT_GT(s.tiers[static_cast<int>(Tier::kDram)].evictions + s.tiers[static_cast<int>(Tier::kNvme)].evictions, 0u)
      << "the run never evicted";
}

TEST_F(NvmeTierTest, DemotionThenPromotionIsByteExact) {
  auto core = Make(32, 64);
  const std::vector<size_t> sizes = {100, 4096, 3 * 4096 + 5, 9000};
  std::optional<BlockHash> parent;
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_TRUE(Put(*core, H(i), parent, Pattern(i, sizes[i])).ok());
    parent = H(i);
  }
  EXPECT_EQ(core->Demote(100), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto info = core->Inspect({H(i), StateKind::kAttnKv});
    ASSERT_TRUE(info);
    EXPECT_FALSE(info->in_dram);
    EXPECT_TRUE(info->on_nvme);
  }
  EXPECT_EQ(core->Stats().tiers[0].used_bytes, 0u);
  // Scribble over the freed DRAM so a promotion that did not read the disk would show.
  ReserveEntrySpec e{H(100), std::nullopt, StateKind::kAttnKv, 32 * kPage};
  auto r = core->Reserve({&e, 1});
  ASSERT_TRUE(r.ok());
  std::string junk(32 * kPage, 'J');
  core->CopyToRun(r->slots[0].run, testing::Bytes(junk));
  ASSERT_TRUE(core->Commit(r->id, {}).ok());  // names nothing: abandons the entry, frees its pages

  LookupSpec spec;
  for (size_t i = 0; i < sizes.size(); ++i) spec.hashes.push_back(H(i));
  auto ans = core->Lookup(spec);
  ASSERT_TRUE(ans.ok()) << ans.status();
  ASSERT_EQ(ans->prefix_blocks, sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(ans->objects[i].found_in, Tier::kNvme);
    auto bytes = core->ReadObject(ans->lease_id, ans->objects[i].key);
    ASSERT_TRUE(bytes.ok());
    EXPECT_TRUE(*bytes == Pattern(i, sizes[i])) << i;
    auto info = core->Inspect(ans->objects[i].key);
    EXPECT_TRUE(info->in_dram && info->on_nvme);  // promotion copies; NVMe copy stays
  }
  EXPECT_EQ(core->Stats().promotions, sizes.size());
  // A second lookup hits DRAM.
  auto again = core->Lookup({.hashes = {H(0)}});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->objects[0].found_in, Tier::kDram);
}

// never_block (what the gRPC reactor asks first): an answer that needs NVMe reads is
// UNAVAILABLE and changes nothing; DRAM-only answers come back as usual.
TEST_F(NvmeTierTest, NeverBlockRefusesNvmeHitsAndChangesNothing) {
  auto core = Make(32, 64);
  ASSERT_TRUE(Put(*core, H(0), std::nullopt, Pattern(0, 5000)).ok());
  ASSERT_TRUE(Put(*core, H(1), H(0), Pattern(1, 5000)).ok());
  ASSERT_EQ(core->Demote(1), 1u);  // leaves first: H(1) goes, H(0) (its parent) stays
  ASSERT_FALSE(core->Inspect({H(1), StateKind::kAttnKv})->in_dram);

  auto dram_only = core->Lookup({.hashes = {H(0)}, .never_block = true});
  ASSERT_TRUE(dram_only.ok()) << dram_only.status();
  EXPECT_EQ(dram_only->prefix_blocks, 1u);
  ASSERT_TRUE(core->Release(dram_only->lease_id).ok());

  auto refused = core->Lookup({.hashes = {H(0), H(1)}, .never_block = true});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_EQ(core->Stats().active_leases, 0u);
  EXPECT_EQ(core->Stats().promotions, 0u);
  auto info = core->Inspect({H(1), StateKind::kAttnKv});
  EXPECT_FALSE(info->in_dram);
  EXPECT_EQ(info->leases, 0u);
  EXPECT_EQ(core->Inspect({H(0), StateKind::kAttnKv})->leases, 0u);

  auto blocking = core->Lookup({.hashes = {H(0), H(1)}});
  ASSERT_TRUE(blocking.ok()) << blocking.status();
  EXPECT_EQ(blocking->prefix_blocks, 2u);
  EXPECT_EQ(blocking->objects[1].found_in, Tier::kNvme);
}

TEST_F(NvmeTierTest, BackgroundDemotionRunsBetweenWatermarks) {
  auto core = Make(20, 64, {.demote_high_watermark = 0.8, .demote_low_watermark = 0.5});
  PutChain(*core, 0, 16, kPage);  // 80%: not above the high watermark yet
  core->RunMaintenance();
  EXPECT_EQ(core->Stats().demotions, 0u);
  PutChain(*core, 16, 2, kPage, H(15));  // 90%
  core->RunMaintenance();
  auto st = core->Stats();
  EXPECT_EQ(st.tiers[0].used_bytes, 10 * kPage);  // down to the low watermark
  EXPECT_EQ(st.demotions, 8u);
  // Leaf-first: the chain's tail went to NVMe, its head stayed in DRAM.
  EXPECT_TRUE(core->Inspect({H(0), StateKind::kAttnKv})->in_dram);
  EXPECT_FALSE(core->Inspect({H(17), StateKind::kAttnKv})->in_dram);
  EXPECT_TRUE(core->Inspect({H(17), StateKind::kAttnKv})->on_nvme);
  // The whole chain is still one prefix.
  ExpectChainReadsBack(*core, 0, 18, kPage);
}

TEST_F(NvmeTierTest, RestartRecoversTheNvmeTier) {
  {
    auto core = Make(16, 64);
    PutChain(*core, 0, 6, 5000);
    ASSERT_TRUE(Put(*core, H(5), std::nullopt, Pattern(77, 700), StateKind::kLinearState).ok());
    EXPECT_EQ(core->Demote(100), 7u);
    PutChain(*core, 50, 1, 100);  // DRAM-only: gone after the restart
  }
  auto core = Make(16, 64);
  for (uint64_t i = 0; i < 6; ++i) {
    auto info = core->Inspect({H(i), StateKind::kAttnKv});
    ASSERT_TRUE(info) << i;
    EXPECT_TRUE(info->on_nvme);
  }
  EXPECT_FALSE(core->Inspect({H(50), StateKind::kAttnKv}));
  EXPECT_TRUE(core->Inspect({H(5), StateKind::kLinearState})->visible);
  LookupSpec spec;
  for (uint64_t i = 0; i < 6; ++i) spec.hashes.push_back(H(i));
  auto ans = core->Lookup(spec);
  ASSERT_TRUE(ans.ok());
  ASSERT_EQ(ans->prefix_blocks, 6u);
  for (uint64_t i = 0; i < 6; ++i) {
    auto b = core->ReadObject(ans->lease_id, {H(i), StateKind::kAttnKv});
    ASSERT_TRUE(b.ok());
    EXPECT_TRUE(*b == Pattern(i, 5000)) << i;
  }
  auto lin = core->Lookup({.hashes = {H(5)}, .kind = StateKind::kLinearState});
  ASSERT_TRUE(lin.ok());
  ASSERT_EQ(lin->prefix_blocks, 1u);
  EXPECT_TRUE(*core->ReadObject(lin->lease_id, {H(5), StateKind::kLinearState}) == Pattern(77, 700));
  ASSERT_TRUE(core->Release(ans->lease_id).ok());
  ASSERT_TRUE(core->Release(lin->lease_id).ok());
  // New objects do not land on recovered pages.
  PutChain(*core, 60, 4, 5000);
  core->Demote(100);
  for (uint64_t i = 60; i < 64; ++i) EXPECT_TRUE(core->Inspect({H(i), StateKind::kAttnKv})->on_nvme);
  auto all = core->Lookup({.hashes = {H(0), H(1), H(2), H(3), H(4), H(5)}});
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->prefix_blocks, 6u);
  EXPECT_TRUE(*core->ReadObject(all->lease_id, {H(3), StateKind::kAttnKv}) == Pattern(3, 5000));
}

// A second node on a directory in use is refused before it touches the journal. Before,
// it replayed the journal and renamed a fresh one over it: the running node went on
// appending to an unlinked file, and what it demoted afterwards was lost at its restart.
TEST_F(NvmeTierTest, ASecondNodeOnADirectoryInUseIsRefused) {
  {
    auto core = Make(8, 16);
    PutChain(*core, 0, 4, kPage);
    EXPECT_EQ(core->Demote(100), 4u);
    auto second = PoolCore::Create(Options(8, 16));
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
    EXPECT_NE(second.status().message().find("--nvme-dir"), absl::string_view::npos) << second.status();
    EXPECT_NE(second.status().message().find(absl::StrCat("pid ", ::getpid())), absl::string_view::npos)
        << second.status();
    PutChain(*core, 100, 2, kPage);
    EXPECT_EQ(core->Demote(100), 2u);
  }
  auto core = Make(8, 16);  // the lock went with the first
  ExpectChainReadsBack(*core, 0, 4, kPage);
  ExpectChainReadsBack(*core, 100, 2, kPage);
}

TEST_F(NvmeTierTest, RestartWithOtherPageBytesIsRefusedNamingTheFlag) {
  { auto core = Make(16, 64); }
  PoolOptions o;
  o.page_bytes = 8192;
  o.dram_bytes = 16 * 8192;
  o.nvme_dir = dir_.path();
  o.nvme_bytes = 64 * kPage;
  o.background = false;
  auto core = PoolCore::Create(o);
  EXPECT_EQ(core.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(core.status().message()), ::testing::HasSubstr("--page-bytes=4096"));
}

TEST_F(NvmeTierTest, CorruptionOnDiskIsDetectedAndNeverServed) {
  auto core = Make(16, 64);
  PutChain(*core, 0, 3, 2 * kPage);
  ASSERT_EQ(core->Demote(100), 3u);
  auto info = core->Inspect({H(1), StateKind::kAttnKv});
  ASSERT_TRUE(info && info->on_nvme);
  CorruptNvmePage(core->nvme_data_path(), info->nvme_pages[1]);
  auto ans = core->Lookup({.hashes = {H(0), H(1), H(2)}});
  ASSERT_TRUE(ans.ok());
  EXPECT_EQ(ans->prefix_blocks, 1u);  // H(1) failed its checksum: the prefix ends there
  ASSERT_EQ(ans->objects.size(), 1u);
  EXPECT_EQ(ans->objects[0].key.hash, H(0));
  EXPECT_EQ(core->Stats().checksum_failures, 1u);
  EXPECT_FALSE(core->Inspect({H(1), StateKind::kAttnKv}));  // dropped
  auto again = core->Lookup({.hashes = {H(1)}});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->prefix_blocks, 0u);
}

// Many unrelated objects: demotion runs two rounds at a time and still moves exactly
// what it was asked to; promotion reads them in several groups (verified as each group
// lands), and a corrupt object in a later group is caught and dropped alone.
TEST_F(NvmeTierTest, ManyObjectsDemoteInPipelinedRoundsAndPromoteInVerifiedGroups) {
  constexpr uint64_t kObjects = 300, kBytes = 16 * kPage;  // 300 x 64 KiB: 3 read groups
  auto core = Make(kObjects * 16 + 64, kObjects * 16 + 64);
  for (uint64_t i = 0; i < kObjects; ++i) {
    ASSERT_TRUE(Put(*core, H(i), std::nullopt, Pattern(i, kBytes)).ok()) << i;
  }
  EXPECT_EQ(core->Demote(100), 100u);
  EXPECT_EQ(core->Stats().demotions, 100u);
  EXPECT_EQ(core->Demote(1000), kObjects - 100);
  EXPECT_EQ(core->Stats().tiers[0].used_bytes, 0u);
  auto info = core->Inspect({H(290), StateKind::kAttnKv});
  ASSERT_TRUE(info && info->on_nvme);
  CorruptNvmePage(core->nvme_data_path(), info->nvme_pages[3]);

  LookupSpec spec;
  spec.allow_gaps = true;
  for (uint64_t i = 0; i < kObjects; ++i) spec.hashes.push_back(H(i));
  auto ans = core->Lookup(spec);
  ASSERT_TRUE(ans.ok()) << ans.status();
  ASSERT_EQ(ans->objects.size(), kObjects - 1);
  EXPECT_EQ(core->Stats().checksum_failures, 1u);
  EXPECT_EQ(core->Stats().promotions, kObjects - 1);
  EXPECT_FALSE(core->Inspect({H(290), StateKind::kAttnKv}));
  for (const auto& o : ans->objects) {
    EXPECT_EQ(o.found_in, Tier::kNvme);
    auto bytes = core->ReadObject(ans->lease_id, o.key);
    ASSERT_TRUE(bytes.ok());
    const uint64_t i = o.key.hash.lo - H(0).lo;
    EXPECT_TRUE(*bytes == Pattern(i, kBytes)) << i;
  }
}

// A round takes a leaf's parents along once all their DRAM children are in the round
// (a long chain leaves DRAM in one write, not one round per block), still leaf-first: a
// parent with a child outside the round stays, and so does a leased block's prefix.
TEST_F(NvmeTierTest, DemotionTakesParentsAlongOnlyWhenAllTheirChildrenGo) {
  auto core = Make(64, 64);
  // H(0) <- H(1) <- H(2), and H(1) <- H(10): H(1) has two children.
  PutChain(*core, 0, 3, kPage);
  ASSERT_TRUE(Put(*core, H(10), H(1), Pattern(10, kPage)).ok());
  EXPECT_EQ(core->Demote(2), 2u);  // the two leaves; H(1) would need a third slot
  for (uint64_t i : {2, 10}) EXPECT_FALSE(core->Inspect({H(i), StateKind::kAttnKv})->in_dram) << i;
  for (uint64_t i : {0, 1}) EXPECT_TRUE(core->Inspect({H(i), StateKind::kAttnKv})->in_dram) << i;
  EXPECT_EQ(core->Demote(1), 1u);  // now H(1) is a leaf
  EXPECT_FALSE(core->Inspect({H(1), StateKind::kAttnKv})->in_dram);
  EXPECT_TRUE(core->Inspect({H(0), StateKind::kAttnKv})->in_dram);

  // A chain of 30 whose first 11 blocks are leased: the other 19 go, tail first, and the
  // leased prefix stays whole in DRAM.
  PutChain(*core, 100, 30, kPage);
  LookupSpec spec;
  for (uint64_t i = 100; i <= 110; ++i) spec.hashes.push_back(H(i));
  auto lease = core->Lookup(spec);
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->prefix_blocks, 11u);
  EXPECT_EQ(core->Demote(1000), 19u + 1u);  // and H(0), now a leaf
  for (uint64_t i = 100; i < 130; ++i) {
    auto info = core->Inspect({H(i), StateKind::kAttnKv});
    ASSERT_TRUE(info);
    EXPECT_EQ(info->in_dram, i <= 110) << i;
    EXPECT_EQ(info->on_nvme, i > 110) << i;
  }
  ASSERT_TRUE(core->Release(lease->lease_id).ok());
  ExpectChainReadsBack(*core, 100, 30, kPage);
}

TEST_F(NvmeTierTest, CorruptionAfterRestartIsDetectedToo) {
  uint32_t page;
  std::string path;
  {
    auto core = Make(16, 64);
    PutChain(*core, 0, 2, kPage);
    ASSERT_EQ(core->Demote(100), 2u);
    page = core->Inspect({H(1), StateKind::kAttnKv})->nvme_pages[0];
    path = core->nvme_data_path();
  }
  CorruptNvmePage(path, page);
  auto core = Make(16, 64);
  auto ans = core->Lookup({.hashes = {H(0), H(1)}});
  ASSERT_TRUE(ans.ok());
  EXPECT_EQ(ans->prefix_blocks, 1u);
  EXPECT_EQ(core->Stats().checksum_failures, 1u);
  // The drop was journaled: a further restart does not bring it back.
  core.reset();
  core = Make(16, 64);
  EXPECT_FALSE(core->Inspect({H(1), StateKind::kAttnKv}));
  EXPECT_TRUE(core->Inspect({H(0), StateKind::kAttnKv}));
}

// A journal ADD record as NvmeStore writes it: [u32 len][u8 type=1 + payload][u64 XXH3].
std::string ForgedAdd(BlockHash h, uint8_t kind, uint64_t length, std::vector<uint32_t> pages,
                      std::optional<BlockHash> parent = std::nullopt) {
  std::string body(1, '\x01');
  auto put = [&](uint64_t v, int n) { body.append(reinterpret_cast<const char*>(&v), n); };
  put(h.lo, 8);
  put(h.hi, 8);
  put(kind, 1);
  put(parent ? 1 : 0, 1);
  put(parent ? parent->lo : 0, 8);
  put(parent ? parent->hi : 0, 8);
  put(length, 8);
  put(0, 8);  // checksum
  put(pages.size(), 4);
  for (uint32_t p : pages) put(p, 4);
  std::string out;
  const uint32_t len = static_cast<uint32_t>(body.size());
  out.append(reinterpret_cast<const char*>(&len), 4);
  out += body;
  const uint64_t sum = XXH3_64bits(body.data(), body.size());
  out.append(reinterpret_cast<const char*>(&sum), 8);
  return out;
}

TEST_F(NvmeTierTest, JournalRecordsThatCannotBeRightAreDroppedAtRestart) {
  uint32_t page;
  {
    auto core = Make(16, 64);
    PutChain(*core, 0, 2, kPage);
    ASSERT_EQ(core->Demote(100), 2u);
    page = core->Inspect({H(1), StateKind::kAttnKv})->nvme_pages[0];
  }
  {  // Records a bug or another version could leave: intact frames, impossible contents.
    const std::string journal = dir_.path() + "/kvpool-nvme.journal";
    int fd = ::open(journal.c_str(), O_WRONLY | O_APPEND);
    ASSERT_GE(fd, 0);
    const std::string forged = ForgedAdd(H(50), 1, kPage, {page}) +    // H(1)'s page again
                               ForgedAdd(H(51), 7, kPage, {40}) +      // no such state kind
                               ForgedAdd(H(52), 0, 3 * kPage, {41}) +  // 1 page for 3 pages
                               ForgedAdd(H(53), 0, kPage, {64}) +      // past the file
                               // A length near 2^64 and no page: the page count wrapped to 0
                               // and the record came back as an object with nothing to serve.
                               ForgedAdd(H(54), 0, ~uint64_t{0} - 10, {}) +
                               ForgedAdd(H(55), 0, 2 * kPage, {42, 42});  // one page twice
    ASSERT_EQ(::write(fd, forged.data(), forged.size()), static_cast<ssize_t>(forged.size()));
    ::close(fd);
  }
  auto core = Make(16, 64);
  // Both claimants of the shared page go (which wrote last is unknown); H(0) stays.
  EXPECT_TRUE(core->Inspect({H(0), StateKind::kAttnKv}));
  EXPECT_FALSE(core->Inspect({H(1), StateKind::kAttnKv}));
  for (uint64_t i : {50, 52, 53, 54, 55}) EXPECT_FALSE(core->Inspect({H(i), StateKind::kAttnKv})) << i;
  EXPECT_FALSE(core->Inspect({H(51), StateKind::kLinearState}));
  EXPECT_EQ(core->Stats().tiers[1].objects, 1u);
  // None is in the compacted journal (H(55)'s record once was: its page 42, free from
  // then on, could go to a new object that the next restart then dropped with it).
  {
    std::ifstream in(dir_.path() + "/kvpool-nvme.journal", std::ios::binary);
    const std::string journal((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (uint64_t i : {50, 51, 52, 53, 54, 55}) {
      std::string key(16, '\0');
      const BlockHash h = H(i);
      std::memcpy(key.data(), &h.lo, 8);
      std::memcpy(key.data() + 8, &h.hi, 8);
      EXPECT_EQ(journal.find(key), std::string::npos) << "H(" << i << ") still journaled";
    }
  }
  // The compacted journal no longer holds them: the next start agrees.
  core.reset();
  core = Make(16, 64);
  EXPECT_EQ(core->Stats().tiers[1].objects, 1u);
  EXPECT_TRUE(core->Inspect({H(0), StateKind::kAttnKv}));
}

// A journal record naming its own hash as parent (Reserve refuses such a link, so only a
// damaged or hand-made journal has one) is recovered as a chain start: counted as its own
// child, it would never be a leaf, so never evicted.
TEST_F(NvmeTierTest, ASelfParentInTheJournalIsRecoveredAsAChainStart) {
  {
    auto core = Make(16, 64);
    PutChain(*core, 0, 1, kPage);
    ASSERT_EQ(core->Demote(100), 1u);
  }
  {
    const std::string journal = dir_.path() + "/kvpool-nvme.journal";
    int fd = ::open(journal.c_str(), O_WRONLY | O_APPEND);
    ASSERT_GE(fd, 0);
    const std::string forged = ForgedAdd(H(60), 0, kPage, {50}, H(60));
    ASSERT_EQ(::write(fd, forged.data(), forged.size()), static_cast<ssize_t>(forged.size()));
    ::close(fd);
  }
  auto core = Make(16, 64);
  ASSERT_TRUE(core->Inspect({H(60), StateKind::kAttnKv}).has_value());
  int seen = 0;
  core->ForEachVisible([&](const ObjectKey& k, const std::optional<BlockHash>& parent, Tier) {
    if (k.hash != H(60)) return;
    ++seen;
    EXPECT_FALSE(parent.has_value()) << "the self link was kept";
  });
  EXPECT_EQ(seen, 1);
  EXPECT_TRUE(core->CheckIndex().ok());
}

// A journal damaged in the middle (a flipped bit in one record) loses that record only:
// restart skips to the next record that passes its checksum, keeps the damaged file, and
// counts the loss. Before, replay stopped at the damage and the rewrite dropped every
// record after it for good, without a word.
TEST_F(NvmeTierTest, ADamagedJournalRecordLosesOnlyItself) {
  {
    auto core = Make(16, 64);
    PutChain(*core, 0, 3, kPage);
    ASSERT_EQ(core->Demote(100), 3u);
  }
  const std::string journal = dir_.path() + "/kvpool-nvme.journal";
  uint64_t damaged = 0;
  {
    std::fstream f(journal, std::ios::in | std::ios::out | std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    // The damaged record is the middle one of the three ADDs. Frames: u32 length, the
    // body (type byte, then the block hash), u64 checksum.
    std::vector<std::pair<size_t, uint64_t>> adds;  // (hash offset, i of H(i))
    for (size_t pos = 0; pos + 4 <= bytes.size();) {
      uint32_t len;
      std::memcpy(&len, bytes.data() + pos, 4);
      ASSERT_LE(pos + 4 + len + 8, bytes.size());
      if (bytes[pos + 4] == 1) {  // an ADD
        BlockHash h;
        std::memcpy(&h.lo, bytes.data() + pos + 5, 8);
        std::memcpy(&h.hi, bytes.data() + pos + 13, 8);
        for (uint64_t i = 0; i < 3; ++i) {
          if (h == H(i)) adds.emplace_back(pos + 5, i);
        }
      }
      pos += 4 + len + 8;
    }
    ASSERT_EQ(adds.size(), 3u);
    damaged = adds[1].second;
    const size_t at = adds[1].first;
    f.seekp(static_cast<std::streamoff>(at + 3));
    f.put(static_cast<char>(bytes[at + 3] ^ 0x10));
  }
  auto core = Make(16, 64);
  ASSERT_NE(core, nullptr);
  for (uint64_t i = 0; i < 3; ++i) EXPECT_EQ(core->Inspect({H(i), StateKind::kAttnKv}).has_value(), i != damaged) << i;
  EXPECT_EQ(core->Stats().tiers[1].objects, 2u);
  EXPECT_TRUE(std::filesystem::exists(journal + ".damaged"));
}

// A journal that exists but cannot be read (here a directory in its place) stops the
// start: it is not taken for "no journal yet" and replaced by an empty one.
TEST_F(NvmeTierTest, AJournalThatCannotBeReadStopsTheStart) {
  std::filesystem::create_directory(dir_.path() + "/kvpool-nvme.journal");
  auto core = PoolCore::Create(Options(16, 64));
  ASSERT_FALSE(core.ok());
  EXPECT_NE(std::string(core.status().message()).find("kvpool-nvme.journal"), std::string::npos) << core.status();
  EXPECT_TRUE(std::filesystem::is_directory(dir_.path() + "/kvpool-nvme.journal"));
}

// An io_uring that cannot be set up (here a queue depth the kernel refuses) fails the
// start and closes nothing it does not own: the engine's teardown used to close the
// uninitialised ring's fd field, 0, which is the process's stdin.
TEST_F(NvmeTierTest, AnIoUringThatCannotBeSetUpClosesNothingItDoesNotOwn) {
  if (::fcntl(0, F_GETFD) == -1) GTEST_SKIP() << "fd 0 is not open in this process: nothing to observe";
  auto core = PoolCore::Create(Options(16, 64, {.io_queue_depth = 1u << 20}));  // beyond IORING_MAX_ENTRIES
  ASSERT_FALSE(core.ok());
  EXPECT_NE(std::string(core.status().message()).find("io_uring_queue_init"), std::string::npos) << core.status();
  EXPECT_NE(::fcntl(0, F_GETFD), -1) << "fd 0 was closed";
}

// Journal appends that fail (injected): a demotion whose ADD cannot be written keeps the
// DRAM copy (a restart would not know the NVMe copy); an NVMe eviction whose DEL cannot
// be written keeps the evicted copy's pages unused (a restart finds its ADD and reads
// them), and no further NVMe eviction runs until a compaction rewrote the journal.
TEST_F(NvmeTierTest, FailedJournalWritesLoseNothingAndCorruptNothing) {
  std::atomic<bool> fail{false};
  PoolOptions o;
  o.journal_write_fault = [&](JournalWrite w) {
    return fail && w == JournalWrite::kAppend ? absl::InternalError("injected journal write error")
                                              : absl::OkStatus();
  };
  auto core = Make(8, 5, o);
  PutChain(*core, 0, 4, kPage);  // one chain: H(3) is the NVMe tier's first leaf to go
  ASSERT_EQ(core->Demote(4), 4u);
  ASSERT_TRUE(Put(*core, H(1000), std::nullopt, Pattern(1000, kPage)).ok());
  auto in = [&](uint64_t i) { return core->Inspect({H(i), StateKind::kAttnKv}); };

  fail = true;  // ADD fails: the object stays in DRAM only
  EXPECT_EQ(core->Demote(1), 0u);
  ASSERT_TRUE(in(1000));
  EXPECT_TRUE(in(1000)->in_dram);
  EXPECT_FALSE(in(1000)->on_nvme);
  fail = false;
  ASSERT_EQ(core->Demote(1), 1u);  // into the fifth (free) page
  ASSERT_TRUE(in(1000)->on_nvme);

  ASSERT_TRUE(Put(*core, H(1001), std::nullopt, Pattern(1001, kPage)).ok());
  fail = true;  // making room evicts H(3) from NVMe, and its DEL fails
  EXPECT_EQ(core->Demote(1), 0u);
  EXPECT_FALSE(in(3));
  EXPECT_TRUE(in(1001)->in_dram);
  EXPECT_EQ(core->Stats().tiers[1].used_bytes, 4 * kPage);
  EXPECT_EQ(core->Stats().nvme_held_back_bytes, kPage);
  EXPECT_EQ(core->Stats().tiers[1].evictions, 1u);
  fail = false;  // H(3)'s page is held back, and nothing else is evicted meanwhile
  EXPECT_EQ(core->Demote(1), 0u);
  EXPECT_EQ(core->Stats().tiers[1].evictions, 1u);
  EXPECT_EQ(core->Stats().tiers[1].objects, 4u);

  // A restart reads the journal: H(3)'s ADD was never undone and its page kept its
  // bytes, so it comes back intact, with everything else the journal recorded.
  core.reset();
  core = Make(8, 5, o);
  ExpectChainReadsBack(*core, 0, 4, kPage);
  ExpectChainReadsBack(*core, 1000, 1, kPage);

  // Held-back pages come back with a compaction, which maintenance runs when some are.
  ASSERT_TRUE(Put(*core, H(2000), std::nullopt, Pattern(2000, kPage)).ok());
  fail = true;
  EXPECT_EQ(core->Demote(1), 0u);  // evicts one NVMe leaf; its DEL fails
  fail = false;
  EXPECT_EQ(core->Demote(1), 0u);
  const uint64_t evictions = core->Stats().tiers[1].evictions;
  EXPECT_EQ(core->Stats().nvme_held_back_bytes, kPage);
  core->RunMaintenance();
  EXPECT_EQ(core->Stats().nvme_held_back_bytes, 0u);
  ASSERT_EQ(core->Demote(1), 1u);  // into the page the compaction gave back
  EXPECT_EQ(core->Stats().tiers[1].evictions, evictions);
  ExpectChainReadsBack(*core, 2000, 1, kPage);
}

// An ADD append that fails after its bytes reached the journal, and that cannot be cut
// back off: a restart before the next compaction replays that ADD, so the NVMe pages it
// names keep their bytes (held back) instead of going to the next demotion. Before, they
// were freed: the next object demoted into them, and after a restart the stale ADD won
// the page (the newer object was dropped as inconsistent) and read back as garbage.
TEST_F(NvmeTierTest, AFailedAddThatStaysInTheJournalHoldsItsPagesBack) {
  // Appends are numbered from 0 (the journal serializes them); the one numbered
  // `fail_append` lands and then fails, and cannot be cut back off.
  std::atomic<int> appends{0}, current{-1}, fail_append{-1};
  PoolOptions o;
  o.journal_write_fault = [&](JournalWrite w) {
    if (w == JournalWrite::kAppend) current = appends++;
    const bool injected = current == fail_append &&
                          (w == JournalWrite::kAppendLanded || w == JournalWrite::kTruncate);
    return injected ? absl::InternalError("injected journal write error") : absl::OkStatus();
  };
  auto core = Make(8, 5, o);
  PutChain(*core, 0, 4, kPage);
  ASSERT_EQ(core->Demote(4), 4u);  // one NVMe page left
  ASSERT_TRUE(Put(*core, H(1000), std::nullopt, Pattern(1000, kPage)).ok());
  auto in = [&](uint64_t i) { return core->Inspect({H(i), StateKind::kAttnKv}); };

  fail_append = appends.load();  // H(1000)'s data is written, its ADD lands but reports failure
  EXPECT_EQ(core->Demote(1), 0u);
  ASSERT_TRUE(in(1000));
  EXPECT_TRUE(in(1000)->in_dram);
  EXPECT_FALSE(in(1000)->on_nvme);
  EXPECT_EQ(core->Stats().nvme_held_back_bytes, kPage);

  // A newer object is the next to go; the held-back page is not its to take.
  ASSERT_TRUE(Put(*core, H(2000), std::nullopt, Pattern(2000, kPage)).ok());
  auto touch = core->Lookup({.hashes = {H(1000)}});
  ASSERT_TRUE(touch.ok());
  ASSERT_TRUE(core->Release(touch->lease_id).ok());
  EXPECT_EQ(core->Demote(1), 0u);
  EXPECT_TRUE(in(2000)->in_dram);

  // A restart now: everything the journal names reads back intact, H(1000) included
  // (its page kept the bytes its ADD describes).
  core.reset();
  core = Make(8, 5, o);
  ExpectChainReadsBack(*core, 0, 4, kPage);
  ExpectChainReadsBack(*core, 1000, 1, kPage);

  // Without a restart the pages come back with the next compaction. The NVMe tier is
  // full: the demotion's eviction appends a DEL (which works), then its ADD fails.
  ASSERT_TRUE(Put(*core, H(3000), std::nullopt, Pattern(3000, kPage)).ok());
  fail_append = appends.load() + 1;
  EXPECT_EQ(core->Demote(1), 0u);
  EXPECT_EQ(core->Stats().tiers[1].evictions, 1u);
  EXPECT_EQ(core->Stats().nvme_held_back_bytes, kPage);
  core->RunMaintenance();
  EXPECT_EQ(core->Stats().nvme_held_back_bytes, 0u);
  ASSERT_EQ(core->Demote(1), 1u);  // into the page the compaction gave back
  core.reset();
  core = Make(8, 5, o);
  ExpectChainReadsBack(*core, 3000, 1, kPage);
}

TEST_F(NvmeTierTest, FailedCompactionKeepsPagesHeldBackAndRetriesLater) {
  std::atomic<bool> fail_append{false}, fail_rewrite{false};
  std::atomic<int> rewrites{0};
  PoolOptions o;
  o.journal_write_fault = [&](JournalWrite w) {
    if (w == JournalWrite::kRewrite) {
      ++rewrites;
      if (fail_rewrite) return absl::InternalError("injected journal rewrite error");
    }
    if (w == JournalWrite::kAppend && fail_append) return absl::InternalError("injected journal write error");
    return absl::OkStatus();
  };
  auto core = Make(8, 5, o);
  PutChain(*core, 0, 4, kPage);  // H(3) is the NVMe tier's first leaf to go
  ASSERT_EQ(core->Demote(4), 4u);
  ASSERT_TRUE(Put(*core, H(1000), std::nullopt, Pattern(1000, kPage)).ok());
  ASSERT_EQ(core->Demote(1), 1u);  // the NVMe tier is full
  ASSERT_TRUE(Put(*core, H(1001), std::nullopt, Pattern(1001, kPage)).ok());
  fail_append = true;  // making room evicts H(3); its DEL fails, so its page is held back
  EXPECT_EQ(core->Demote(1), 0u);
  fail_append = false;
  ASSERT_EQ(core->Stats().nvme_held_back_bytes, kPage);

  // The compaction that would give the page back fails: the old journal stays (it still
  // names H(3)'s page) and so does the hold, and no other object is evicted meanwhile.
  fail_rewrite = true;
  core->RunMaintenance();
  EXPECT_EQ(rewrites.load(), 1);
  EXPECT_EQ(core->Stats().nvme_held_back_bytes, kPage);
  EXPECT_EQ(core->Demote(1), 0u);
  EXPECT_EQ(core->Stats().tiers[1].objects, 4u);
  EXPECT_TRUE(core->Inspect({H(1001), StateKind::kAttnKv})->in_dram);
  // A failing journal is retried every 10 s, not at every maintenance tick.
  core->RunMaintenance();
  clock_.AdvanceMs(9'000);
  core->RunMaintenance();
  EXPECT_EQ(rewrites.load(), 1);
  clock_.AdvanceMs(1'001);
  fail_rewrite = false;
  core->RunMaintenance();
  EXPECT_EQ(rewrites.load(), 2);
  EXPECT_EQ(core->Stats().nvme_held_back_bytes, 0u);
  ASSERT_EQ(core->Demote(1), 1u);  // into the page the compaction gave back

  // A restart reads the rewritten journal: H(3) is gone, the rest comes back intact.
  core.reset();
  core = Make(8, 5, o);
  EXPECT_FALSE(core->Inspect({H(3), StateKind::kAttnKv}));
  EXPECT_EQ(core->Stats().tiers[1].objects, 5u);
  ExpectChainReadsBack(*core, 0, 3, kPage);
  ExpectChainReadsBack(*core, 1000, 2, kPage);
}

// A node told to stop ends a demotion pass after the rounds under way (it used to
// write up to 64K objects to NVMe first, past a pod's grace period).
TEST_F(NvmeTierTest, AStopEndsADemotionPassAfterItsCurrentRounds) {
  PoolCore* target = nullptr;
  std::atomic<bool> asked{false};
  PoolOptions o;
  o.journal_write_fault = [&](JournalWrite w) {
    // The first round's ADD: the node is told to stop while the pass runs.
    if (w == JournalWrite::kAppend && target != nullptr && !asked.exchange(true)) target->RequestStop();
    return absl::OkStatus();
  };
  constexpr uint64_t kObjects = 1024;
  auto core = Make(kObjects + 8, kObjects + 8, o);
  for (uint64_t i = 0; i < kObjects; ++i) {
    ASSERT_TRUE(Put(*core, H(i), std::nullopt, Pattern(i, kPage)).ok());
  }
  target = core.get();
  const size_t moved = core->Demote(kObjects);
  EXPECT_TRUE(asked);
  EXPECT_GT(moved, 0u);
  EXPECT_LE(moved, 2 * 64u) << "rounds of 64, two in flight, none started after the stop";
  EXPECT_EQ(core->Stats().demotions, moved);
}

TEST_F(NvmeTierTest, EvictionDuringACompactionLandsInTheRewrittenJournal) {
  std::atomic<bool> fail_append{false}, hold_rewrite{false};
  std::atomic<bool> in_rewrite{false}, release{false};
  PoolOptions o;
  o.journal_write_fault = [&](JournalWrite w) {
    if (w == JournalWrite::kRewrite && hold_rewrite.exchange(false)) {
      in_rewrite = true;  // the rewrite holds the journal; the test lets it go on
      while (!release) std::this_thread::yield();
    }
    if (w == JournalWrite::kAppend && fail_append) return absl::InternalError("injected journal write error");
    return absl::OkStatus();
  };
  auto core = Make(8, 6, o);
  PutChain(*core, 0, 4, kPage);
  ASSERT_EQ(core->Demote(4), 4u);
  ASSERT_TRUE(Put(*core, H(1000), std::nullopt, Pattern(1000, kPage)).ok());
  ASSERT_EQ(core->Demote(1), 1u);  // one NVMe page left
  // A failed ADD makes a rewrite due (the object stays in DRAM, nothing is held back).
  ASSERT_TRUE(Put(*core, H(1001), std::nullopt, Pattern(1001, kPage)).ok());
  fail_append = true;
  EXPECT_EQ(core->Demote(1), 0u);
  fail_append = false;
  ASSERT_TRUE(Put(*core, H(1002), std::nullopt, Pattern(1002, kPage)).ok());
  ASSERT_EQ(core->Stats().nvme_held_back_bytes, 0u);

  // The rewrite starts from a snapshot that still holds the NVMe leaf the next demotion
  // evicts; that eviction's DEL must land in the rewritten journal, after the snapshot's
  // ADD, or a restart would bring the evicted object back over reused pages.
  hold_rewrite = true;
  std::thread maintenance([&] { core->RunMaintenance(); });
  while (!in_rewrite) std::this_thread::yield();
  // The demotion (an eviction's DEL, then two ADDs) runs to its end while the rewrite is
  // held: the rewrite's writes and fsyncs keep no lock the node's other calls need.
  // (The bound only turns a deadlock into a failure; nothing here is timed.)
  std::atomic<bool> demotion_done{false};
  size_t demoted = 0;
  std::thread demoter([&] {
    demoted = core->Demote(2);
    demotion_done = true;
  });
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!demotion_done && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(demotion_done) << "the demotion waited for the journal rewrite";
  if (demotion_done) {
    EXPECT_TRUE(core->Lookup({.hashes = {H(1001)}}).ok());  // and so does a Lookup
  }
  release = true;
  maintenance.join();
  demoter.join();
  EXPECT_EQ(demoted, 2u);  // H(1001) and H(1002), evicting one NVMe leaf
  EXPECT_EQ(core->Stats().nvme_held_back_bytes, 0u);
  std::vector<uint64_t> gone;
  for (uint64_t i : {0, 1, 2, 3, 1000}) {
    if (!core->Inspect({H(i), StateKind::kAttnKv})) gone.push_back(i);
  }
  ASSERT_EQ(gone.size(), 1u);

  core.reset();
  core = Make(8, 6, o);
  EXPECT_EQ(core->Stats().tiers[1].objects, 6u);
  for (uint64_t i : gone) EXPECT_FALSE(core->Inspect({H(i), StateKind::kAttnKv})) << i;
  ExpectChainReadsBack(*core, 1001, 2, kPage);
  for (uint64_t i : {0, 1, 2, 3, 1000}) {
    if (std::find(gone.begin(), gone.end(), i) != gone.end()) continue;
    auto a = core->Lookup({.hashes = {H(i)}, .allow_gaps = true});
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_EQ(a->objects.size(), 1u) << i;
    auto b = core->ReadObject(a->lease_id, {H(i), StateKind::kAttnKv});
    ASSERT_TRUE(b.ok()) << i;
    EXPECT_TRUE(*b == Pattern(i, kPage)) << i;
  }
}

TEST_F(NvmeTierTest, ReadErrorIsAMissThatKeepsTheNvmeCopy) {
  auto core = Make(8, 16);
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, kPage)).ok());
  ASSERT_TRUE(Put(*core, H(2), H(1), Pattern(2, kPage)).ok());
  ASSERT_EQ(core->Demote(2), 2u);
  const uint32_t p1 = core->Inspect({H(1), StateKind::kAttnKv})->nvme_pages[0];
  const uint32_t p2 = core->Inspect({H(2), StateKind::kAttnKv})->nvme_pages[0];
  // The file ends right after the lower page: reading the higher one fails (short read).
  const off_t full = static_cast<off_t>(16 * kPage);
  ASSERT_EQ(::truncate(core->nvme_data_path().c_str(), (std::min(p1, p2) + 1) * kPage), 0);
  auto a = core->Lookup({.hashes = {H(1), H(2)}, .allow_gaps = true});
  ASSERT_TRUE(a.ok()) << a.status();
  if (a->lease_id != 0) {
    ASSERT_TRUE(core->Release(a->lease_id).ok());
  }
  // An I/O error is not a checksum failure: nothing dropped, nothing counted.
  EXPECT_EQ(core->Stats().checksum_failures, 0u);
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv})->on_nvme);
  EXPECT_TRUE(core->Inspect({H(2), StateKind::kAttnKv})->on_nvme);
  // The disk answers again, with zeros where the higher page was: that object fails its
  // checksum and goes; the other is served byte-exact.
  ASSERT_EQ(::truncate(core->nvme_data_path().c_str(), full), 0);
  const uint64_t lost = p1 > p2 ? 1 : 2, kept = 3 - lost;
  auto b = core->Lookup({.hashes = {H(kept)}});
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->prefix_blocks, 1u);
  auto bytes = core->ReadObject(b->lease_id, {H(kept), StateKind::kAttnKv});
  ASSERT_TRUE(bytes.ok());
  EXPECT_TRUE(*bytes == Pattern(kept, kPage));
  ASSERT_TRUE(core->Release(b->lease_id).ok());
  auto c = core->Lookup({.hashes = {H(lost)}});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->prefix_blocks, 0u);
  EXPECT_EQ(core->Stats().checksum_failures, 1u);
  EXPECT_FALSE(core->Inspect({H(lost), StateKind::kAttnKv}));
}

// A copy whose read keeps failing is dropped after three failures in a row, a second or
// more apart: kept, it
// stayed present and unreadable for good (a Reserve of it answered already_present, so
// a worker could never store it again, and touched it, so it was never evicted).
TEST_F(NvmeTierTest, ACopyWhoseReadKeepsFailingIsDropped) {
  auto core = Make(8, 16);
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, kPage)).ok());
  ASSERT_TRUE(Put(*core, H(2), std::nullopt, Pattern(2, kPage)).ok());
  ASSERT_EQ(core->Demote(2), 2u);
  const uint32_t p1 = core->Inspect({H(1), StateKind::kAttnKv})->nvme_pages[0];
  const uint32_t p2 = core->Inspect({H(2), StateKind::kAttnKv})->nvme_pages[0];
  const uint64_t bad = p1 > p2 ? 1 : 2;  // its page is past the file's end: short reads
  ASSERT_EQ(::truncate(core->nvme_data_path().c_str(), (std::min(p1, p2) + 1) * kPage), 0);
  // A burst counts once: five failures within a second drop nothing.
  for (int attempt = 1; attempt <= 5; ++attempt) {
    auto a = core->Lookup({.hashes = {H(bad)}});
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->prefix_blocks, 0u);
  }
  EXPECT_TRUE(core->Inspect({H(bad), StateKind::kAttnKv}).has_value());
  for (int attempt = 2; attempt <= 3; ++attempt) {
    clock_.AdvanceMs(1000);
    auto a = core->Lookup({.hashes = {H(bad)}});
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->prefix_blocks, 0u);
    EXPECT_EQ(core->Inspect({H(bad), StateKind::kAttnKv}).has_value(), attempt < 3) << "after " << attempt;
  }
  ReserveEntrySpec e{H(bad), std::nullopt, StateKind::kAttnKv, kPage};
  auto r = core->Reserve({&e, 1});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->slots[0].already_present) << "the unreadable copy still counted as stored";
  EXPECT_EQ(core->Stats().checksum_failures, 0u);
  EXPECT_TRUE(core->CheckIndex().ok()) << core->CheckIndex();
  // The other copy is untouched.
  ExpectChainReadsBack(*core, 3 - bad, 1, kPage);
}

TEST_F(NvmeTierTest, JournalIsCompactedWhileRunningAndStillRecovers) {
  PoolOptions o;
  o.journal_compact_min_bytes = 4096;
  const std::string journal = dir_.path() + "/kvpool-nvme.journal";
  auto size = [&] { return std::filesystem::file_size(journal); };
  uint64_t on_nvme = 0;
  {
    auto core = Make(8, 4, o);
    // Churn: every round demotes 2 new objects into a 4-page NVMe tier, which evicts
    // the previous 2 (an ADD and a DEL record each).
    for (uint64_t round = 0; round < 60; ++round) {
      ASSERT_TRUE(Put(*core, H(2 * round), std::nullopt, Pattern(2 * round, kPage)).ok());
      ASSERT_TRUE(Put(*core, H(2 * round + 1), std::nullopt, Pattern(2 * round + 1, kPage)).ok());
      ASSERT_EQ(core->Demote(2), 2u) << round;
    }
    const uint64_t grown = size();
    core->RunMaintenance();
    EXPECT_LT(size(), grown / 4) << "the journal kept every record since the start";
    // Records after the rewrite land in the new journal.
    ASSERT_TRUE(Put(*core, H(500), std::nullopt, Pattern(500, kPage)).ok());
    ASSERT_EQ(core->Demote(1), 1u);
    on_nvme = core->Stats().tiers[1].objects;
  }
  auto core = Make(8, 4, o);
  EXPECT_EQ(core->Stats().tiers[1].objects, on_nvme);
  auto a = core->Lookup({.hashes = {H(500)}});
  ASSERT_TRUE(a.ok());
  ASSERT_EQ(a->prefix_blocks, 1u);
  auto bytes = core->ReadObject(a->lease_id, {H(500), StateKind::kAttnKv});
  ASSERT_TRUE(bytes.ok());
  EXPECT_TRUE(*bytes == Pattern(500, kPage));
}

TEST_F(NvmeTierTest, LeasedObjectsAreNeitherDemotedNorMoved) {
  auto core = Make(8, 16);
  ASSERT_TRUE(Put(*core, H(0), std::nullopt, Pattern(0, kPage)).ok());
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, kPage)).ok());
  auto lease = core->Lookup({.hashes = {H(0)}});
  ASSERT_TRUE(lease.ok());
  const auto before = core->Inspect({H(0), StateKind::kAttnKv})->dram_pages;
  EXPECT_EQ(core->Demote(100), 1u);  // only H(1)
  auto info = core->Inspect({H(0), StateKind::kAttnKv});
  EXPECT_TRUE(info->in_dram);
  EXPECT_EQ(info->dram_pages, before);  // the descriptors handed out stay valid
  EXPECT_FALSE(core->Inspect({H(1), StateKind::kAttnKv})->in_dram);
  ASSERT_TRUE(core->Release(lease->lease_id).ok());
  EXPECT_EQ(core->Demote(100), 1u);
  EXPECT_FALSE(core->Inspect({H(0), StateKind::kAttnKv})->in_dram);
}

TEST_F(NvmeTierTest, NvmeFullEvictsNvmeLeavesFirst) {
  auto core = Make(8, 4);
  PutChain(*core, 0, 4, kPage);
  ASSERT_EQ(core->Demote(100), 4u);  // NVMe full: H(0..3)
  PutChain(*core, 10, 2, kPage);
  ASSERT_EQ(core->Demote(100), 2u);  // evicts H(3) then H(2) from NVMe (leaf-first)
  EXPECT_FALSE(core->Inspect({H(3), StateKind::kAttnKv}));
  EXPECT_FALSE(core->Inspect({H(2), StateKind::kAttnKv}));
  EXPECT_TRUE(core->Inspect({H(0), StateKind::kAttnKv}));
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv}));
  EXPECT_EQ(core->Stats().tiers[1].evictions, 2u);
}

TEST_F(NvmeTierTest, PromotionNeverEvictsALaterHitOfTheSameLookup) {
  auto core = Make(3, 16);
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, kPage)).ok());
  ASSERT_EQ(core->Demote(1), 1u);  // H(1) on NVMe only
  ASSERT_TRUE(Put(*core, H(2), H(1), Pattern(2, kPage)).ok());
  ASSERT_TRUE(Put(*core, H(3), H(2), Pattern(3, kPage)).ok());
  ASSERT_TRUE(Put(*core, H(9), std::nullopt, Pattern(9, kPage)).ok());  // DRAM full
  {  // H(9) most recently used: H(3) is the LRU DRAM leaf
    auto a = core->Lookup({.hashes = {H(9)}});
    ASSERT_TRUE(a.ok());
    ASSERT_TRUE(core->Release(a->lease_id).ok());
  }
  auto a = core->Lookup({.hashes = {H(1), H(2), H(3)}});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->prefix_blocks, 3u) << "all 3 blocks were present before the Lookup";
  EXPECT_TRUE(core->Inspect({H(3), StateKind::kAttnKv}).has_value()) << "the Lookup evicted its own hit";
  EXPECT_FALSE(core->Inspect({H(9), StateKind::kAttnKv}).has_value()) << "H(9) made room instead";
  for (uint64_t i = 1; i <= 3; ++i) {
    auto b = core->ReadObject(a->lease_id, {H(i), StateKind::kAttnKv});
    ASSERT_TRUE(b.ok()) << i;
    EXPECT_TRUE(*b == Pattern(i, kPage)) << i;
  }
  ASSERT_TRUE(core->Release(a->lease_id).ok());
}

TEST_F(NvmeTierTest, StopBackgroundEndsMaintenance) {
  // A node stops the core's thread before destroying its EventSink (the router
  // publisher): afterwards no demotion may run, hence no OnStored/OnRemoved.
  PoolOptions o;
  o.page_bytes = kPage;
  o.dram_bytes = 8 * kPage;
  o.nvme_dir = dir_.path();
  o.nvme_bytes = 64 * kPage;
  o.clock = &clock_;
  o.demote_high_watermark = 0.5;
  o.demote_low_watermark = 0.25;
  o.maintenance_interval_ms = 1;
  o.background = true;
  auto created = PoolCore::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<PoolCore> core = std::move(*created);
  core->StopBackground();
  core->StopBackground();  // idempotent; the destructor calls it again
  PutChain(*core, 0, 8, kPage);  // 100% > the high watermark
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(core->Stats().demotions, 0u);
  core->RunMaintenance();  // the core itself stays usable
  EXPECT_GT(core->Stats().demotions, 0u);
}

// A checkpoint (LINEAR_STATE) is visible only while its ATTN_KV prefix is present. A
// Lookup of checkpoints that promotes one from NVMe makes room in DRAM without evicting
// a link of that prefix: that would hide the very checkpoint it promotes (the answer
// used to come back empty although everything was stored when it started).
TEST_F(NvmeTierTest, CheckpointLookupDoesNotEvictItsOwnKvPrefix) {
  auto core = Make(4, 16);  // objects of one page each
  ASSERT_TRUE(Put(*core, H(2), std::nullopt, Pattern(50, kPage), StateKind::kLinearState).ok());
  PutChain(*core, 1, 2, kPage);  // KV H1 -> H2: the checkpoint at H2 becomes visible
  ASSERT_TRUE(core->Inspect({H(2), StateKind::kLinearState})->visible);
  ASSERT_EQ(core->Demote(1), 1u);  // the coldest leaf, the checkpoint, to NVMe
  ASSERT_FALSE(core->Inspect({H(2), StateKind::kLinearState})->in_dram);
  PutChain(*core, 10, 2, kPage);  // DRAM full; KV H2 is its least recently used leaf
  auto ans = core->Lookup({.hashes = {H(2)}, .kind = StateKind::kLinearState});
  ASSERT_TRUE(ans.ok()) << ans.status();
  ASSERT_EQ(ans->objects.size(), 1u);
  EXPECT_EQ(ans->objects[0].found_in, Tier::kNvme);
  auto bytes = core->ReadObject(ans->lease_id, {H(2), StateKind::kLinearState});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_TRUE(*bytes == Pattern(50, kPage));
  EXPECT_TRUE(core->Inspect({H(2), StateKind::kAttnKv}).has_value());
  EXPECT_FALSE(core->Inspect({H(11), StateKind::kAttnKv}).has_value());  // the victim instead
}

// The same for a Reserve of checkpoints that names one already stored: the room it makes
// for the new ones does not come from that one's KV prefix.
TEST_F(NvmeTierTest, CheckpointReserveDoesNotEvictAPresentOnesKvPrefix) {
  auto core = Make(4, 16);
  PutChain(*core, 1, 2, kPage);  // KV H1 -> H2
  ASSERT_TRUE(Put(*core, H(2), std::nullopt, Pattern(50, kPage), StateKind::kLinearState).ok());
  PutChain(*core, 20, 1, kPage);  // DRAM full; KV H2 is its least recently used leaf
  const std::vector<ReserveEntrySpec> entries = {{H(2), std::nullopt, StateKind::kLinearState, kPage},
                                                 {H(30), std::nullopt, StateKind::kLinearState, kPage}};
  auto r = core->Reserve(entries);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->slots[0].already_present);
  EXPECT_TRUE(core->Inspect({H(2), StateKind::kLinearState})->visible);
  EXPECT_TRUE(core->Inspect({H(2), StateKind::kAttnKv}).has_value());
  EXPECT_FALSE(core->Inspect({H(20), StateKind::kAttnKv}).has_value());  // the victim instead
}

// Making room in DRAM passes over a DRAM-only parent whose child went to NVMe: dropping
// it would leave the NVMe chain below it out of reach of every prefix Lookup. It goes
// only when nothing else can make the room.
TEST_F(NvmeTierTest, DramEvictionSparesTheParentOfAnNvmeChain) {
  auto core = Make(4, 16);  // objects of one page each
  PutChain(*core, 1, 3, kPage);  // H1 -> H2 -> H3
  ASSERT_EQ(core->Demote(1), 1u);  // the leaf H3 to NVMe; H2 stays, DRAM only
  ASSERT_FALSE(core->Inspect({H(3), StateKind::kAttnKv})->in_dram);
  ASSERT_FALSE(core->Inspect({H(2), StateKind::kAttnKv})->on_nvme);
  ASSERT_TRUE(Put(*core, H(10), std::nullopt, Pattern(10, kPage)).ok());
  ASSERT_TRUE(Put(*core, H(11), std::nullopt, Pattern(11, kPage)).ok());  // DRAM full
  // H2 is the least recently used DRAM leaf; H10 goes instead.
  ASSERT_TRUE(Put(*core, H(20), std::nullopt, Pattern(20, kPage)).ok());
  EXPECT_FALSE(core->Inspect({H(10), StateKind::kAttnKv}).has_value());
  EXPECT_TRUE(core->Inspect({H(2), StateKind::kAttnKv}).has_value());
  ExpectChainReadsBack(*core, 1, 3, kPage);
}

// The mirror case: NVMe eviction passes over an NVMe-only parent whose child is in DRAM
// only. Here the room is for that very child's demotion; before, the parent went (it was
// the least recently used NVMe leaf), and the child landed on NVMe out of reach of every
// prefix Lookup.
TEST_F(NvmeTierTest, NvmeEvictionSparesTheParentOfADramChain) {
  auto core = Make(8, 2);  // objects of one page each
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, kPage)).ok());
  ASSERT_EQ(core->Demote(1), 1u);  // H1 to NVMe only
  ASSERT_TRUE(Put(*core, H(10), std::nullopt, Pattern(10, kPage)).ok());
  ASSERT_EQ(core->Demote(1), 1u);  // H10 too: NVMe full, H1 its least recently used leaf
  ASSERT_TRUE(Put(*core, H(2), H(1), Pattern(2, kPage)).ok());  // H1 -> H2, H2 in DRAM only
  ASSERT_EQ(core->Demote(1), 1u);  // H2 needs an NVMe page: H10 makes it, not H2's parent
  EXPECT_FALSE(core->Inspect({H(10), StateKind::kAttnKv}).has_value());
  ASSERT_TRUE(core->Inspect({H(1), StateKind::kAttnKv}).has_value()) << "H2's parent was evicted";
  EXPECT_TRUE(core->Inspect({H(2), StateKind::kAttnKv})->on_nvme);
  EXPECT_TRUE(core->CheckIndex().ok());
  ExpectChainReadsBack(*core, 1, 2, kPage);
}

// A promotion into DRAM keeps to its kind's DRAM quota as a Reserve does: the kind's
// least recently used DRAM leaf makes room, and the kind never goes over. Before, the
// promotion took a free page and the kind held 3 pages under a quota of 2.
TEST_F(NvmeTierTest, PromotionKeepsToTheKindsDramQuota) {
  auto core = Make(16, 16, {.dram_quota_bytes = {2 * kPage, 0}});
  const int kv = KindIndex(StateKind::kAttnKv);
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, kPage)).ok());
  ASSERT_EQ(core->Demote(1), 1u);  // H1 on NVMe only
  ASSERT_TRUE(Put(*core, H(3), std::nullopt, Pattern(3, kPage)).ok());
  ASSERT_TRUE(Put(*core, H(4), std::nullopt, Pattern(4, kPage)).ok());  // the quota is full: H3, H4
  ASSERT_EQ(core->Stats().tiers[0].bytes_by_kind[kv], 2 * kPage);
  auto a = core->Lookup({.hashes = {H(1)}});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->prefix_blocks, 1u);
  EXPECT_EQ(a->objects[0].found_in, Tier::kNvme);
  EXPECT_EQ(core->Stats().tiers[0].bytes_by_kind[kv], 2 * kPage) << "the promotion went over the quota";
  EXPECT_FALSE(core->Inspect({H(3), StateKind::kAttnKv}).has_value());  // the kind's LRU leaf
  EXPECT_TRUE(core->Inspect({H(4), StateKind::kAttnKv}).has_value());
  auto b = core->ReadObject(a->lease_id, {H(1), StateKind::kAttnKv});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(*b == Pattern(1, kPage));
  ASSERT_TRUE(core->Release(a->lease_id).ok());
  EXPECT_TRUE(core->CheckIndex().ok());
}

// With the kind's quota all leased, a promotion is a miss (its NVMe copy stays), as a
// Reserve would be refused.
TEST_F(NvmeTierTest, PromotionPastALeasedQuotaIsAMiss) {
  auto core = Make(16, 16, {.dram_quota_bytes = {2 * kPage, 0}});
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, kPage)).ok());
  ASSERT_EQ(core->Demote(1), 1u);
  PutChain(*core, 3, 2, kPage);  // H3 -> H4: the quota is full
  auto held = core->Lookup({.hashes = {H(3), H(4)}});
  ASSERT_TRUE(held.ok()) << held.status();
  auto a = core->Lookup({.hashes = {H(1)}});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->prefix_blocks, 0u);
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv})->on_nvme);
  EXPECT_FALSE(core->Inspect({H(1), StateKind::kAttnKv})->in_dram);
  ASSERT_TRUE(core->Release(held->lease_id).ok());
  auto again = core->Lookup({.hashes = {H(1)}});  // now the quota can make room
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->prefix_blocks, 1u);
  if (a->lease_id != 0) {
    ASSERT_TRUE(core->Release(a->lease_id).ok());
  }
  ASSERT_TRUE(core->Release(again->lease_id).ok());
  EXPECT_TRUE(core->CheckIndex().ok());
}

// When the room needs them, the parents of NVMe chains go after every other leaf, and
// then least recently used first: one chain is cut, not two.
TEST_F(NvmeTierTest, ParentsOfNvmeChainsGoLastAndOnlyAsManyAsTheRoomNeeds) {
  auto core = Make(4, 16);
  PutChain(*core, 1, 2, kPage);  // H1 -> H2
  ASSERT_EQ(core->Demote(1), 1u);  // H2 to NVMe
  PutChain(*core, 3, 2, kPage);  // H3 -> H4
  auto used = core->Lookup({.hashes = {H(1)}});  // H1 is now more recent than H3 and H4
  ASSERT_TRUE(used.ok()) << used.status();
  ASSERT_TRUE(core->Release(used->lease_id).ok());
  ASSERT_EQ(core->Demote(1), 1u);  // the coldest leaf, H4, to NVMe
  ASSERT_FALSE(core->Inspect({H(4), StateKind::kAttnKv})->in_dram);
  ASSERT_TRUE(Put(*core, H(10), std::nullopt, Pattern(10, kPage)).ok());
  ASSERT_TRUE(Put(*core, H(11), std::nullopt, Pattern(11, kPage)).ok());  // DRAM full: H1 H3 H10 H11
  ASSERT_TRUE(Put(*core, H(20), std::nullopt, Pattern(20, 3 * kPage)).ok());  // three pages
  EXPECT_FALSE(core->Inspect({H(10), StateKind::kAttnKv}).has_value());
  EXPECT_FALSE(core->Inspect({H(11), StateKind::kAttnKv}).has_value());
  EXPECT_FALSE(core->Inspect({H(3), StateKind::kAttnKv}).has_value());  // the older of the two
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv}).has_value());
}

TEST_F(NvmeTierTest, AParentOfAnNvmeChainStillMakesRoomWhenNothingElseCan) {
  auto core = Make(2, 16);
  PutChain(*core, 1, 2, kPage);  // H1 -> H2
  ASSERT_EQ(core->Demote(1), 1u);  // H2 to NVMe; H1, DRAM only, is all DRAM holds
  ASSERT_TRUE(Put(*core, H(20), std::nullopt, Pattern(20, 2 * kPage)).ok());
  EXPECT_FALSE(core->Inspect({H(1), StateKind::kAttnKv}).has_value());
  EXPECT_TRUE(core->Inspect({H(2), StateKind::kAttnKv})->on_nvme);
}

}  // namespace
}  // namespace kvpool::pool_node
