// PoolCore: the DRAM tier, leases, reservations, eviction order, quotas, co-presence.
#include "kvpool/pool_node/pool_core.h"

#include <limits>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_util.h"

namespace kvpool::pool_node {
namespace {

using testing::H;
using testing::Pattern;
using testing::Put;
using testing::PutChain;

constexpr uint64_t kPage = 4096;

class RecordingSink : public EventSink {
 public:
  void OnStored(const ObjectKey& key, const std::optional<BlockHash>&, Tier tier) override {
    events.push_back({true, key, tier});
  }
  void OnRemoved(const ObjectKey& key, Tier tier) override { events.push_back({false, key, tier}); }
  struct E {
    bool stored;
    ObjectKey key;
    Tier tier;
    bool operator==(const E&) const = default;
  };
  std::vector<E> events;
};

class PoolCoreTest : public ::testing::Test {
 protected:
  std::unique_ptr<PoolCore> Make(uint64_t dram_pages, PoolOptions extra = {}) {
    extra.page_bytes = kPage;
    extra.dram_bytes = dram_pages * kPage;
    extra.background = false;
    extra.clock = &clock_;
    extra.events = &sink_;
    auto core = PoolCore::Create(extra);
    EXPECT_TRUE(core.ok()) << core.status();
    return core.ok() ? std::move(*core) : nullptr;
  }
  // H(1), one page, and its child H(2), two pages (Pattern(1) and Pattern(2) bytes).
  static std::vector<ReserveEntrySpec> TwoBlocks() {
    return {{H(1), std::nullopt, StateKind::kAttnKv, kPage}, {H(2), H(1), StateKind::kAttnKv, 2 * kPage}};
  }
  // Reserves TwoBlocks() in one reservation, writes H(1) and commits it alone (a partial
  // Commit): H(2) stays reserved.
  absl::StatusOr<Reservation> ReserveTwoCommitTheFirst(PoolCore& core) {
    const std::vector<ReserveEntrySpec> specs = TwoBlocks();
    auto r = core.Reserve(specs);
    if (!r.ok()) return r.status();
    const std::string a = Pattern(1, kPage);
    core.CopyToRun(r->slots[0].run, testing::Bytes(a));
    const CommitEntrySpec ca{H(1), Checksum64(testing::Bytes(a))};
    auto c = core.Commit(r->id, {&ca, 1}, /*partial=*/true);
    if (!c.ok()) return c.status();
    if (!(*c)[0].status.ok()) return (*c)[0].status;
    return r;
  }
  ManualClock clock_;
  RecordingSink sink_;
};

TEST_F(PoolCoreTest, PutLookupGetRoundTripIsByteExact) {
  auto core = Make(64);
  // Sizes that do and do not fill their last page.
  const std::vector<size_t> sizes = {1, 4095, 4096, 4097, 3 * 4096 + 17};
  std::optional<BlockHash> parent;
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_TRUE(Put(*core, H(i), parent, Pattern(i, sizes[i])).ok());
    parent = H(i);
  }
  LookupSpec spec;
  for (size_t i = 0; i < sizes.size(); ++i) spec.hashes.push_back(H(i));
  auto ans = core->Lookup(spec);
  ASSERT_TRUE(ans.ok()) << ans.status();
  EXPECT_EQ(ans->prefix_blocks, sizes.size());
  ASSERT_EQ(ans->objects.size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(ans->objects[i].run.length, sizes[i]);
    EXPECT_EQ(ans->objects[i].found_in, Tier::kDram);
    EXPECT_EQ(ans->objects[i].checksum, Checksum64(testing::Bytes(Pattern(i, sizes[i]))));
    auto bytes = core->ReadObject(ans->lease_id, ans->objects[i].key);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_TRUE(*bytes == Pattern(i, sizes[i])) << "object " << i << " differs";
  }
  EXPECT_TRUE(core->Release(ans->lease_id).ok());
}

TEST_F(PoolCoreTest, UnknownHashesArePerEntryMisses) {
  auto core = Make(16);
  PutChain(*core, 0, 2, 100);
  ASSERT_TRUE(Put(*core, H(3), H(2), Pattern(3, 100)).ok());
  auto ans = core->Lookup({.hashes = {H(0), H(1), H(2), H(3)}});
  ASSERT_TRUE(ans.ok());
  EXPECT_EQ(ans->prefix_blocks, 2u);
  EXPECT_EQ(ans->objects.size(), 2u);
  auto gaps = core->Lookup({.hashes = {H(0), H(1), H(2), H(3)}, .allow_gaps = true});
  ASSERT_TRUE(gaps.ok());
  EXPECT_EQ(gaps->prefix_blocks, 2u);
  ASSERT_EQ(gaps->objects.size(), 3u);
  EXPECT_EQ(gaps->objects[2].key.hash, H(3));
  auto none = core->Lookup({.hashes = {H(99)}});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->prefix_blocks, 0u);
  EXPECT_EQ(none->lease_id, 0u);
  // Kinds are separate namespaces.
  auto lin = core->Lookup({.hashes = {H(0)}, .kind = StateKind::kLinearState});
  ASSERT_TRUE(lin.ok());
  EXPECT_EQ(lin->prefix_blocks, 0u);
}

TEST_F(PoolCoreTest, CommittedObjectsAreImmutableAndReReserveSaysPresent) {
  auto core = Make(16);
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, 5000)).ok());
  ReserveEntrySpec e{H(1), std::nullopt, StateKind::kAttnKv, 5000};
  auto r = core->Reserve({&e, 1});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->slots[0].already_present);
  EXPECT_TRUE(r->slots[0].run.pages.empty());
}

TEST_F(PoolCoreTest, ChecksumMismatchAtCommitIsDataLossAndHoldsItsPagesBack) {
  auto core = Make(8);
  const std::string bytes = Pattern(7, 3 * kPage);
  ReserveEntrySpec e{H(7), std::nullopt, StateKind::kAttnKv, bytes.size()};
  auto r = core->Reserve({&e, 1});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(core->Stats().reserved_bytes, 3 * kPage);
  core->CopyToRun(r->slots[0].run, testing::Bytes(bytes));
  CommitEntrySpec c{H(7), Checksum64(testing::Bytes(bytes)) ^ 1};
  auto out = core->Commit(r->id, {&c, 1});
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)[0].status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string((*out)[0].status.message()), ::testing::HasSubstr("checksum"));
  auto st = core->Stats();
  EXPECT_EQ(st.tiers[0].used_bytes, 0u);
  EXPECT_EQ(st.reserved_bytes, 0u);
  EXPECT_EQ(st.checksum_failures, 1u);
  EXPECT_FALSE(core->Inspect({H(7), StateKind::kAttnKv}));
  // Wrong bytes may be a write still under way: the pages are held back for one reserve
  // timeout (no new object gets them meanwhile), then free: the whole arena can be
  // reserved again.
  EXPECT_EQ(st.dram_held_back_bytes, 3 * kPage);
  ReserveEntrySpec all{H(8), std::nullopt, StateKind::kAttnKv, 8 * kPage};
  EXPECT_EQ(core->Reserve({&all, 1}).status().code(), absl::StatusCode::kResourceExhausted);
  clock_.AdvanceMs(PoolOptions{}.reserve_timeout_ms);
  EXPECT_TRUE(core->Reserve({&all, 1}).ok());
  EXPECT_EQ(core->Stats().dram_held_back_bytes, 0u);
}

// One Reserve, committed piece by piece: the final Commit may overtake the partial ones
// (a node verifies Commits on several threads); it says how many there are, so the
// reservation ends after the last of them, whatever their order.
TEST_F(PoolCoreTest, PartialCommitsInAnyOrderUnderOneReservation) {
  auto core = Make(8);
  std::vector<std::string> bytes;
  std::vector<ReserveEntrySpec> specs;
  for (int i = 0; i < 4; ++i) {
    bytes.push_back(Pattern(i, kPage + 10 * i));
    specs.push_back({H(i), i == 0 ? std::nullopt : std::optional<BlockHash>(H(i - 1)), StateKind::kAttnKv,
                     bytes.back().size()});
  }
  auto r = core->Reserve(specs);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int i = 0; i < 4; ++i) core->CopyToRun(r->slots[i].run, testing::Bytes(bytes[i]));
  auto entry = [&](int i) { return CommitEntrySpec{H(i), Checksum64(testing::Bytes(bytes[i]))}; };
  // Three Commits: {3} final (commits = 3) first, then {0, 1} and {2} partial.
  const CommitEntrySpec last = entry(3);
  auto out = core->Commit(r->id, {&last, 1}, /*partial=*/false, /*commits=*/3);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
  EXPECT_EQ(core->Stats().pending_reservations, 1u);
  const std::vector<CommitEntrySpec> first = {entry(0), entry(1)};
  out = core->Commit(r->id, first, /*partial=*/true);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE((*out)[0].status.ok() && (*out)[1].status.ok());
  // Named twice (already committed by the Commit before): a per-entry error.
  const std::vector<CommitEntrySpec> again = {entry(2), entry(1)};
  out = core->Commit(r->id, again, /*partial=*/true);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE((*out)[0].status.ok()) << (*out)[0].status;
  EXPECT_EQ((*out)[1].status.code(), absl::StatusCode::kInvalidArgument);
  // The third Commit ended the reservation.
  auto st = core->Stats();
  EXPECT_EQ(st.pending_reservations, 0u);
  EXPECT_EQ(st.reserved_bytes, 0u);
  EXPECT_EQ(core->Commit(r->id, {}, /*partial=*/true).status().code(), absl::StatusCode::kNotFound);
  auto ans = core->Lookup({.hashes = {H(0), H(1), H(2), H(3)}});
  ASSERT_TRUE(ans.ok()) << ans.status();
  ASSERT_EQ(ans->prefix_blocks, 4u);
  for (int i = 0; i < 4; ++i) {
    auto got = core->ReadObject(ans->lease_id, ans->objects[i].key);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == bytes[i]) << "object " << i << " differs";
  }
}

// A final Commit (here an empty one, as a client sends after a failed transfer) ends the
// reservation once the Commits it counts are done; entries none of them named are freed.
// A final Commit counting a partial one that never comes leaves the rest to the timeout.
TEST_F(PoolCoreTest, FinalCommitFreesWhatNoCommitNamedAndAMissingOneTimesOut) {
  auto core = Make(8, {.reserve_timeout_ms = 1000});
  const std::vector<ReserveEntrySpec> specs = TwoBlocks();
  auto r = ReserveTwoCommitTheFirst(*core);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(core->Stats().reserved_bytes, 2 * kPage);  // H(2)'s pages stay reserved
  ASSERT_TRUE(core->Commit(r->id, {}, /*partial=*/false, /*commits=*/2).ok());
  auto st = core->Stats();
  EXPECT_EQ(st.pending_reservations, 0u);
  EXPECT_EQ(st.reserved_bytes, 0u);
  EXPECT_EQ(st.tiers[0].used_bytes, kPage);
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv}));
  EXPECT_FALSE(core->Inspect({H(2), StateKind::kAttnKv}));

  // Counted three Commits; only two come: the reservation waits, then times out.
  auto r2 = core->Reserve(specs);  // H(1) (present) and H(2)
  ASSERT_TRUE(r2.ok()) << r2.status();
  ASSERT_TRUE(core->Commit(r2->id, {}, /*partial=*/false, /*commits=*/3).ok());
  const CommitEntrySpec present{H(1), 0};  // already present: nothing to verify
  ASSERT_TRUE(core->Commit(r2->id, {&present, 1}, /*partial=*/true).ok());
  EXPECT_EQ(core->Stats().pending_reservations, 1u);
  // A second final Commit is refused: the reservation has one end.
  EXPECT_EQ(core->Commit(r2->id, {}, /*partial=*/false).status().code(), absl::StatusCode::kNotFound);
  clock_.AdvanceMs(1001);
  core->RunMaintenance();
  st = core->Stats();
  EXPECT_EQ(st.pending_reservations, 0u);
  EXPECT_EQ(st.reserved_bytes, 0u);
  EXPECT_EQ(st.reclaimed_reservations, 1u);
}

// CommitRequest.commits: counted by a final Commit only, and at most one Commit per
// entry plus a final empty one; otherwise the reservation would wait for Commits that
// never come, holding its pages until the reserve timeout. Refusals change nothing.
TEST_F(PoolCoreTest, CommitCountsThatCannotBeRightAreRefused) {
  auto core = Make(8);
  auto r = ReserveTwoCommitTheFirst(*core);
  ASSERT_TRUE(r.ok()) << r.status();
  auto partial_counted = core->Commit(r->id, {}, /*partial=*/true, /*commits=*/5);
  EXPECT_EQ(partial_counted.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(partial_counted.status().message()), ::testing::HasSubstr("commits=5"));
  auto end_now_counted = core->Commit(r->id, {}, /*partial=*/false, /*commits=*/5, /*end_now=*/true);
  EXPECT_EQ(end_now_counted.status().code(), absl::StatusCode::kInvalidArgument);
  auto too_many = core->Commit(r->id, {}, /*partial=*/false, /*commits=*/1000);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_many.status().message()), ::testing::HasSubstr("at most 3"));
  EXPECT_EQ(core->Commit(r->id, {}, /*partial=*/true).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core->Stats().pending_reservations, 1u);
  // Two entries: up to three Commits (one each, then an empty final one).
  const std::string b = Pattern(2, 2 * kPage);
  core->CopyToRun(r->slots[1].run, testing::Bytes(b));
  const CommitEntrySpec cb{H(2), Checksum64(testing::Bytes(b))};
  ASSERT_TRUE(core->Commit(r->id, {&cb, 1}, /*partial=*/true).ok());
  ASSERT_TRUE(core->Commit(r->id, {}, /*partial=*/false, /*commits=*/3).ok());
  EXPECT_EQ(core->Stats().pending_reservations, 0u);
  EXPECT_TRUE(core->Inspect({H(2), StateKind::kAttnKv}));
}

// end_now: a client whose Commit was lost on the way ends the reservation without
// waiting for it, even after a final Commit counted it. A Commit that comes after is
// refused, and end_now needs a final Commit.
TEST_F(PoolCoreTest, EndNowEndsAReservationThatWaitsForALostCommit) {
  auto core = Make(8, {.reserve_timeout_ms = 1000});
  auto r = ReserveTwoCommitTheFirst(*core);
  ASSERT_TRUE(r.ok()) << r.status();
  // The final Commit counts three: the one for H(2) is lost.
  ASSERT_TRUE(core->Commit(r->id, {}, /*partial=*/false, /*commits=*/3).ok());
  EXPECT_EQ(core->Stats().pending_reservations, 1u);
  EXPECT_EQ(core->Commit(r->id, {}, /*partial=*/true, 1, /*end_now=*/true).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core->Stats().pending_reservations, 1u);  // a refused request changes nothing
  ASSERT_TRUE(core->Commit(r->id, {}, /*partial=*/false, 1, /*end_now=*/true).ok());
  auto st = core->Stats();
  EXPECT_EQ(st.pending_reservations, 0u);
  EXPECT_EQ(st.reserved_bytes, 0u);
  // H(2)'s pages: held back one reserve timeout (a write the client gave up on may land).
  EXPECT_EQ(st.dram_held_back_bytes, 2 * kPage);
  EXPECT_EQ(st.tiers[0].used_bytes, kPage);
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv}));
  // The lost Commit turns up late: the reservation is gone.
  const std::string b = Pattern(2, 2 * kPage);
  const CommitEntrySpec cb{H(2), Checksum64(testing::Bytes(b))};
  EXPECT_EQ(core->Commit(r->id, {&cb, 1}, /*partial=*/true).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(core->Inspect({H(2), StateKind::kAttnKv}));
  clock_.AdvanceMs(1001);
  core->RunMaintenance();
  EXPECT_EQ(core->Stats().dram_held_back_bytes, 0u);
}

TEST_F(PoolCoreTest, ZombieReserveIsReclaimedAfterTimeout) {
  auto core = Make(8, {.reserve_timeout_ms = 1000});
  ReserveEntrySpec e{H(1), std::nullopt, StateKind::kAttnKv, 8 * kPage};
  auto r = core->Reserve({&e, 1});
  ASSERT_TRUE(r.ok());
  ReserveEntrySpec other{H(2), std::nullopt, StateKind::kAttnKv, kPage};
  // Reserved pages are never evicted to make room.
  EXPECT_EQ(core->Reserve({&other, 1}).status().code(), absl::StatusCode::kResourceExhausted);
  clock_.AdvanceMs(999);
  core->RunMaintenance();
  EXPECT_EQ(core->Stats().pending_reservations, 1u);
  clock_.AdvanceMs(2);
  core->RunMaintenance();
  auto st = core->Stats();
  EXPECT_EQ(st.pending_reservations, 0u);
  EXPECT_EQ(st.reclaimed_reservations, 1u);
  EXPECT_EQ(st.reserved_bytes, 0u);
  CommitEntrySpec c{H(1), 0};
  EXPECT_EQ(core->Commit(r->id, {&c, 1}).status().code(), absl::StatusCode::kNotFound);
  // Its pages stay unused for one more timeout: the late client may still be writing.
  EXPECT_EQ(st.dram_held_back_bytes, 8 * kPage);
  EXPECT_EQ(st.tiers[0].used_bytes, 0u);
  const absl::Status held = core->Reserve({&other, 1}).status();
  EXPECT_EQ(held.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(held.message()), ::testing::HasSubstr("8 pages are held back from timed-out, failed or early-ended reservations"));
  clock_.AdvanceMs(999);
  core->RunMaintenance();
  EXPECT_EQ(core->Stats().dram_held_back_bytes, 8 * kPage);
  clock_.AdvanceMs(2);
  core->RunMaintenance();
  EXPECT_EQ(core->Stats().dram_held_back_bytes, 0u);
  EXPECT_TRUE(core->Reserve({&other, 1}).ok());
}

TEST_F(PoolCoreTest, ReservationsExpireInDeadlineOrderAndPartlyCommittedOnesKeepWhatCame) {
  auto core = Make(16, {.reserve_timeout_ms = 1000});
  // Three reservations 300 ms apart; the second has one of its two entries committed.
  ReserveEntrySpec a{H(1), std::nullopt, StateKind::kAttnKv, kPage};
  std::vector<ReserveEntrySpec> b = {{H(2), std::nullopt, StateKind::kAttnKv, kPage},
                                     {H(3), H(2), StateKind::kAttnKv, kPage}};
  ReserveEntrySpec c{H(4), std::nullopt, StateKind::kAttnKv, kPage};
  auto ra = core->Reserve({&a, 1});
  ASSERT_TRUE(ra.ok());
  clock_.AdvanceMs(300);
  auto rb = core->Reserve(b);
  ASSERT_TRUE(rb.ok());
  const std::string bytes = Pattern(2, kPage);
  core->CopyToRun(rb->slots[0].run, testing::Bytes(bytes));
  CommitEntrySpec cb{H(2), Checksum64(testing::Bytes(bytes))};
  auto partial = core->Commit(rb->id, {&cb, 1}, /*partial=*/true);
  ASSERT_TRUE(partial.ok());
  ASSERT_TRUE((*partial)[0].status.ok());
  clock_.AdvanceMs(300);
  ASSERT_TRUE(core->Reserve({&c, 1}).ok());
  const uint64_t expected_pending[] = {3, 2, 1, 0};
  const uint64_t expected_reclaimed[] = {0, 1, 2, 3};
  // At 600 ms nothing is due; then one reservation per step, oldest first.
  for (int step = 0; step < 4; ++step) {
    clock_.AdvanceMs(step == 0 ? 0 : (step == 1 ? 400 : 300));  // a is due at 1000 ms, b 1300, c 1600
    core->RunMaintenance();
    const auto st = core->Stats();
    EXPECT_EQ(st.pending_reservations, expected_pending[step]) << step;
    EXPECT_EQ(st.reclaimed_reservations, expected_reclaimed[step]) << step;
  }
  // The committed entry of b stays; its uncommitted one was reclaimed.
  EXPECT_TRUE(core->Inspect({H(2), StateKind::kAttnKv}));
  EXPECT_FALSE(core->Inspect({H(3), StateKind::kAttnKv}));
  EXPECT_EQ(core->Stats().reserved_bytes, 0u);
}

TEST_F(PoolCoreTest, CapacityExhaustionIsResourceExhausted) {
  auto core = Make(4);
  ReserveEntrySpec big{H(1), std::nullopt, StateKind::kAttnKv, 5 * kPage};
  auto r = core->Reserve({&big, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("5 pages"));
  // All-or-nothing: a batch that does not fit reserves nothing.
  std::vector<ReserveEntrySpec> batch = {{H(2), std::nullopt, StateKind::kAttnKv, 3 * kPage},
                                         {H(3), std::nullopt, StateKind::kAttnKv, 2 * kPage}};
  EXPECT_EQ(core->Reserve(batch).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(core->Stats().reserved_bytes, 0u);
}

TEST_F(PoolCoreTest, EvictionMakesRoomButNeverTakesLeasedObjects) {
  auto core = Make(4);
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(Put(*core, H(i), std::nullopt, Pattern(i, kPage)).ok());
  auto lease = core->Lookup({.hashes = {H(0)}});  // H(0) is the LRU object, and leased
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->prefix_blocks, 1u);
  // Three more objects fit only by evicting H(1..3); H(0) must survive.
  for (uint64_t i = 10; i < 13; ++i) ASSERT_TRUE(Put(*core, H(i), std::nullopt, Pattern(i, kPage)).ok());
  EXPECT_TRUE(core->Inspect({H(0), StateKind::kAttnKv}));
  for (uint64_t i = 1; i < 4; ++i) EXPECT_FALSE(core->Inspect({H(i), StateKind::kAttnKv})) << i;
  // Nothing evictable but leased H(0) and three unleased: lease those too, then a
  // Reserve cannot make room.
  auto lease2 = core->Lookup({.hashes = {H(10), H(11), H(12)}, .allow_gaps = true});
  ASSERT_TRUE(lease2.ok());
  ReserveEntrySpec e{H(20), std::nullopt, StateKind::kAttnKv, kPage};
  EXPECT_EQ(core->Reserve({&e, 1}).status().code(), absl::StatusCode::kResourceExhausted);
  auto bytes = core->ReadObject(lease->lease_id, {H(0), StateKind::kAttnKv});
  ASSERT_TRUE(bytes.ok());
  EXPECT_TRUE(*bytes == Pattern(0, kPage));
  ASSERT_TRUE(core->Release(lease->lease_id).ok());
  EXPECT_TRUE(core->Reserve({&e, 1}).ok());  // H(0) is evictable again
  EXPECT_FALSE(core->Inspect({H(0), StateKind::kAttnKv}));
}

TEST_F(PoolCoreTest, ReadAfterLeaseExpiryFailsCleanly) {
  auto core = Make(4);
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, 100)).ok());
  auto ans = core->Lookup({.hashes = {H(1)}, .lease_ms = 500});
  ASSERT_TRUE(ans.ok());
  EXPECT_TRUE(core->ReadObject(ans->lease_id, {H(1), StateKind::kAttnKv}).ok());
  clock_.AdvanceMs(501);
  auto late = core->ReadObject(ans->lease_id, {H(1), StateKind::kAttnKv});
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(late.status().message()), ::testing::HasSubstr("Lookup again"));
  EXPECT_EQ(core->Release(ans->lease_id).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(core->Stats().expired_leases, 1u);
  EXPECT_EQ(core->Lookup({.hashes = {H(1)}, .lease_ms = 700'000}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(PoolCoreTest, EvictsLeavesFirstThenLeastRecentlyUsed) {
  auto core = Make(5);
  // Chain A(0) -> B(1) -> C(2), then an unrelated D(3); A is the least recently used.
  PutChain(*core, 0, 3, kPage);
  ASSERT_TRUE(Put(*core, H(3), std::nullopt, Pattern(3, kPage)).ok());
  auto touch = core->Lookup({.hashes = {H(3)}});
  ASSERT_TRUE(touch.ok());
  ASSERT_TRUE(core->Release(touch->lease_id).ok());
  // LRU order: A, B, C, D. Pure LRU would evict A; leaf-first evicts C, then B, then A.
  std::vector<uint64_t> evicted;
  auto present = [&](uint64_t i) { return core->Inspect({H(i), StateKind::kAttnKv}).has_value(); };
  for (uint64_t n = 0; n < 4; ++n) {
    // One page more than is free forces exactly one (one-page) eviction.
    const auto st = core->Stats();
    const uint64_t free_bytes = st.tiers[0].capacity_bytes - st.tiers[0].used_bytes;
    ReserveEntrySpec e{H(100 + n), std::nullopt, StateKind::kAttnKv, free_bytes + kPage};
    auto r = core->Reserve({&e, 1});
    ASSERT_TRUE(r.ok()) << r.status();
    for (uint64_t i = 0; i < 4; ++i) {
      if (!present(i) && std::find(evicted.begin(), evicted.end(), i) == evicted.end()) evicted.push_back(i);
    }
    ASSERT_TRUE(core->Commit(r->id, {}).ok());  // names nothing: abandons the entry, frees its pages
  }
  EXPECT_EQ(evicted, (std::vector<uint64_t>{2, 1, 0, 3}));
  EXPECT_EQ(core->Stats().tiers[0].evictions, 4u);
}

// A refused Reserve changes nothing, not even the eviction order: an entry it named as
// already present was made most recently used before the room check refused the call,
// so it outlived colder objects.
TEST_F(PoolCoreTest, RefusedReserveLeavesTheEvictionOrderAlone) {
  auto core = Make(4);
  ASSERT_TRUE(Put(*core, H(0), std::nullopt, Pattern(0, kPage)).ok());  // least recently used
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, kPage)).ok());
  std::vector<ReserveEntrySpec> refused = {{H(0), std::nullopt, StateKind::kAttnKv, kPage},
                                           {H(50), std::nullopt, StateKind::kAttnKv, 4 * kPage}};
  // The whole arena: it fits an empty node, but not beside H(0), which the call holds.
  auto r = core->Reserve(refused);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  // One page more than is free: one eviction, of the least recently used of H(0), H(1).
  const auto st = core->Stats();
  ReserveEntrySpec e{H(60), std::nullopt, StateKind::kAttnKv, st.tiers[0].capacity_bytes - st.tiers[0].used_bytes + kPage};
  r = core->Reserve({&e, 1});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(core->Inspect({H(0), StateKind::kAttnKv}).has_value()) << "the refused Reserve made H(0) recent";
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv}).has_value());
  // A granted Reserve does touch what it finds present.
  ASSERT_TRUE(core->Commit(r->id, {}).ok());
  ASSERT_TRUE(Put(*core, H(2), std::nullopt, Pattern(2, kPage)).ok());  // LRU: H(1), H(2)
  ReserveEntrySpec present{H(1), std::nullopt, StateKind::kAttnKv, kPage};
  r = core->Reserve({&present, 1});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(core->Commit(r->id, {}).ok());  // LRU: H(2), H(1)
  const auto st2 = core->Stats();
  e.hash = H(61);
  e.length = st2.tiers[0].capacity_bytes - st2.tiers[0].used_bytes + kPage;
  r = core->Reserve({&e, 1});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(core->Inspect({H(2), StateKind::kAttnKv}).has_value());
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv}).has_value());
  ASSERT_TRUE(core->Commit(r->id, {}).ok());
}

// A leased leaf keeps its whole chain: its unleased parents can never become leaves,
// so they are no room. A Reserve that needs them fails before evicting anything (the
// count of unleased pages, an upper bound, once let it evict the unrelated object and
// then fail).
TEST_F(PoolCoreTest, ReserveThatCannotFitEvictsNothingWhenALeasedLeafHoldsItsChain) {
  auto core = Make(8);
  PutChain(*core, 1, 3, kPage);  // H(1) -> H(2) -> H(3)
  ASSERT_TRUE(Put(*core, H(50), std::nullopt, Pattern(50, kPage)).ok());
  auto lease = core->Lookup({.hashes = {H(3)}, .allow_gaps = true});  // holds the leaf H(3) only
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->objects.size(), 1u);
  // 4 pages free, 3 unleased (H(1), H(2), H(50)), but only H(50) can go: 5 of 7.
  ReserveEntrySpec e{H(100), std::nullopt, StateKind::kAttnKv, 7 * kPage};
  auto r = core->Reserve({&e, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("nothing was evicted"));
  EXPECT_EQ(core->Stats().tiers[0].objects, 4u);
  EXPECT_EQ(core->Stats().tiers[0].evictions, 0u);
  for (uint64_t i : {1, 2, 3, 50}) EXPECT_TRUE(core->Inspect({H(i), StateKind::kAttnKv})) << i;
  // What eviction can free is still used: 5 pages take H(50).
  e.length = 5 * kPage;
  r = core->Reserve({&e, 1});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(core->Inspect({H(50), StateKind::kAttnKv}));
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv}));
  // Once the lease ends the chain goes too, leaf first.
  ASSERT_TRUE(core->Release(lease->lease_id).ok());
  ReserveEntrySpec e2{H(101), std::nullopt, StateKind::kAttnKv, 3 * kPage};
  ASSERT_TRUE(core->Reserve({&e2, 1}).ok());
  for (uint64_t i : {1, 2, 3}) EXPECT_FALSE(core->Inspect({H(i), StateKind::kAttnKv})) << i;
  EXPECT_EQ(core->Stats().tiers[0].evictions, 4u);
}

// The same through a kind's quota: a leased checkpoint chain's parents are no room for
// the quota either, and the unrelated checkpoint stays.
TEST_F(PoolCoreTest, QuotaReserveThatCannotFitEvictsNothing) {
  auto core = Make(16, {.dram_quota_bytes = {0, 6 * kPage}});
  const StateKind lin = StateKind::kLinearState;
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, kPage), lin).ok());
  ASSERT_TRUE(Put(*core, H(2), H(1), Pattern(2, kPage), lin).ok());
  ASSERT_TRUE(Put(*core, H(3), H(2), Pattern(3, kPage), lin).ok());
  ASSERT_TRUE(Put(*core, H(50), std::nullopt, Pattern(50, kPage), lin).ok());
  // Checkpoints are looked up only while their KV prefix is present: give H(3) one.
  PutChain(*core, 1, 3, kPage);
  auto lease = core->Lookup({.hashes = {H(3)}, .kind = lin, .allow_gaps = true});
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->objects.size(), 1u);
  ReserveEntrySpec e{H(100), std::nullopt, lin, 5 * kPage};  // 2 free in the quota + H(50) only
  auto r = core->Reserve({&e, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("quota for linear_state"));
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("nothing was evicted"));
  for (uint64_t i : {1, 2, 3, 50}) EXPECT_TRUE(core->Inspect({H(i), lin})) << i;
  EXPECT_EQ(core->Stats().tiers[0].evictions, 0u);
  ASSERT_TRUE(core->Release(lease->lease_id).ok());
}

TEST_F(PoolCoreTest, CheckpointVisibleOnlyWhileItsKvPrefixIsPresent) {
  auto core = Make(16);
  const ObjectKey ckpt{H(2), StateKind::kLinearState};
  // The checkpoint at H(2) arrives before its ATTN_KV prefix H(0) -> H(1) -> H(2).
  ASSERT_TRUE(Put(*core, H(2), std::nullopt, Pattern(50, 3000), StateKind::kLinearState).ok());
  auto lin = core->Lookup({.hashes = {H(2)}, .kind = StateKind::kLinearState});
  ASSERT_TRUE(lin.ok());
  EXPECT_EQ(lin->prefix_blocks, 0u) << "announced without its MLA prefix";
  PutChain(*core, 0, 2, 1000);  // H(0), H(1): still missing H(2)
  EXPECT_FALSE(core->Inspect(ckpt)->visible);
  ASSERT_TRUE(Put(*core, H(2), H(1), Pattern(2, 1000)).ok());
  EXPECT_TRUE(core->Inspect(ckpt)->visible);
  lin = core->Lookup({.hashes = {H(2)}, .kind = StateKind::kLinearState});
  ASSERT_TRUE(lin.ok());
  EXPECT_EQ(lin->prefix_blocks, 1u);
  ASSERT_TRUE(core->Release(lin->lease_id).ok());
  // Events: the checkpoint is announced right after the block that completed its prefix.
  const RecordingSink::E kv2{true, {H(2), StateKind::kAttnKv}, Tier::kDram};
  const RecordingSink::E ck{true, ckpt, Tier::kDram};
  auto it = std::find(sink_.events.begin(), sink_.events.end(), kv2);
  ASSERT_NE(it, sink_.events.end());
  ASSERT_NE(it + 1, sink_.events.end());
  EXPECT_EQ(*(it + 1), ck);
  EXPECT_EQ(std::count(sink_.events.begin(), sink_.events.end(), ck), 1);
  // Losing H(1) (its middle) hides the checkpoint again: fill DRAM so eviction takes the
  // KV chain leaf-first while the checkpoint itself stays.
  auto keep = core->Lookup({.hashes = {H(2)}, .kind = StateKind::kLinearState});
  ASSERT_TRUE(keep.ok());
  ReserveEntrySpec e{H(90), std::nullopt, StateKind::kAttnKv, 15 * kPage};
  ASSERT_TRUE(core->Reserve({&e, 1}).ok());
  EXPECT_FALSE(core->Inspect({H(1), StateKind::kAttnKv}));
  ASSERT_TRUE(core->Inspect(ckpt));
  EXPECT_FALSE(core->Inspect(ckpt)->visible);
  // Removing the chain's tail H(2) (leaf-first) is what hid the checkpoint.
  const RecordingSink::E gone2{false, {H(2), StateKind::kAttnKv}, Tier::kDram};
  auto g = std::find(sink_.events.begin(), sink_.events.end(), gone2);
  ASSERT_NE(g, sink_.events.end());
  ASSERT_NE(g + 1, sink_.events.end());
  EXPECT_EQ(*(g + 1), (RecordingSink::E{false, ckpt, Tier::kDram}));
  ASSERT_TRUE(core->Release(keep->lease_id).ok());
  lin = core->Lookup({.hashes = {H(2)}, .kind = StateKind::kLinearState});
  ASSERT_TRUE(lin.ok());
  EXPECT_EQ(lin->prefix_blocks, 0u);
}

TEST_F(PoolCoreTest, QuotaPerStateKind) {
  auto core = Make(16, {.dram_quota_bytes = {0, 4 * kPage}});
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, 3 * kPage), StateKind::kLinearState).ok());
  PutChain(*core, 10, 4, kPage);  // ATTN_KV is not limited
  // A second 3-page checkpoint exceeds the 4-page quota: the first one is evicted.
  ASSERT_TRUE(Put(*core, H(2), std::nullopt, Pattern(2, 3 * kPage), StateKind::kLinearState).ok());
  EXPECT_FALSE(core->Inspect({H(1), StateKind::kLinearState}));
  for (uint64_t i = 10; i < 14; ++i) EXPECT_TRUE(core->Inspect({H(i), StateKind::kAttnKv}));
  auto st = core->Stats();
  EXPECT_EQ(st.tiers[0].bytes_by_kind[KindIndex(StateKind::kLinearState)], 3 * kPage);
  EXPECT_EQ(st.tiers[0].bytes_by_kind[KindIndex(StateKind::kAttnKv)], 4 * kPage);
  ReserveEntrySpec too_big{H(3), std::nullopt, StateKind::kLinearState, 5 * kPage};
  auto r = core->Reserve({&too_big, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("quota for linear_state"));
}

TEST_F(PoolCoreTest, ValidationNamesTheField) {
  PoolOptions bad;
  bad.page_bytes = 1000;
  bad.dram_bytes = 1 << 20;
  auto c = PoolCore::Create(bad);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), ::testing::HasSubstr("--page-bytes=1000"));
  bad.page_bytes = 4096;
  bad.dram_bytes = 100;
  EXPECT_THAT(std::string(PoolCore::Create(bad).status().message()), ::testing::HasSubstr("--dram"));
  // Timeouts that would end every reservation or lease at once (a reservation reclaimed
  // by its own Commit: every Put NOT_FOUND), or a default lease longer than the longest.
  bad.dram_bytes = 1 << 20;
  bad.background = false;
  bad.reserve_timeout_ms = 0;
  EXPECT_THAT(std::string(PoolCore::Create(bad).status().message()), ::testing::HasSubstr("--reserve-timeout-ms=0"));
  // One whose expiry sum would overflow (every reservation then looked expired at once).
  bad.reserve_timeout_ms = std::numeric_limits<int64_t>::max() / 2 + 1;
  EXPECT_THAT(std::string(PoolCore::Create(bad).status().message()),
              ::testing::HasSubstr("--reserve-timeout-ms=" + std::to_string(bad.reserve_timeout_ms)));
  bad.reserve_timeout_ms = 86'400'000;  // the longest: a day
  EXPECT_TRUE(PoolCore::Create(bad).ok());
  bad.reserve_timeout_ms = 1000;
  // A quota below one page would refuse every Reserve of its kind.
  bad.dram_quota_bytes = {1000, 0};
  EXPECT_THAT(std::string(PoolCore::Create(bad).status().message()), ::testing::HasSubstr("--quota-attn-kv=1000"));
  bad.dram_quota_bytes = {0, 4095};
  EXPECT_THAT(std::string(PoolCore::Create(bad).status().message()),
              ::testing::HasSubstr("--quota-linear-state=4095"));
  bad.dram_quota_bytes = {4096, 0};
  EXPECT_TRUE(PoolCore::Create(bad).ok());
  bad.dram_quota_bytes = {0, 0};
  // So would a per-client cap below one page, every Lookup and Reserve.
  bad.max_client_pinned_bytes = 4095;
  EXPECT_THAT(std::string(PoolCore::Create(bad).status().message()),
              ::testing::HasSubstr("--max-client-pinned=4095"));
  bad.max_client_pinned_bytes = 0;
  for (uint32_t lease : {0u, bad.max_lease_ms + 1}) {
    bad.default_lease_ms = lease;
    const absl::Status st = PoolCore::Create(bad).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << lease;
    EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("--lease-ms=" + std::to_string(lease)));
  }
  bad.default_lease_ms = bad.max_lease_ms;
  EXPECT_TRUE(PoolCore::Create(bad).ok());

  auto core = Make(8);
  ReserveEntrySpec zero{H(1), std::nullopt, StateKind::kAttnKv, 0};
  auto r = core->Reserve({&zero, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("entries[0].length"));
  std::vector<ReserveEntrySpec> dup = {{H(1), std::nullopt, StateKind::kAttnKv, 1},
                                       {H(1), std::nullopt, StateKind::kAttnKv, 1}};
  EXPECT_THAT(std::string(core->Reserve(dup).status().message()),
              ::testing::HasSubstr("entries[1].block_hash"));
  EXPECT_EQ(core->Lookup({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core->Commit(12345, {}).status().code(), absl::StatusCode::kNotFound);
  // A commit entry that was not reserved is a per-entry error.
  ReserveEntrySpec ok{H(2), std::nullopt, StateKind::kAttnKv, 10};
  auto rr = core->Reserve({&ok, 1});
  ASSERT_TRUE(rr.ok());
  std::vector<CommitEntrySpec> ce = {{H(3), 0}};
  auto out = core->Commit(rr->id, ce);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)[0].status.code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(PoolCoreTest, ReserveNeverEvictsAnEntryItAnswersAlreadyPresent) {
  auto core = Make(4);
  ASSERT_TRUE(Put(*core, H(1), std::nullopt, Pattern(1, kPage)).ok());
  // H(1) is the only (and LRU) evictable object; the new entry needs the whole arena.
  // (Not H(1)'s child: a parent stays pinned for the reservation's life, see
  // AReservationKeepsItsEntriesParentsUntilItEnds.)
  std::vector<ReserveEntrySpec> es = {{H(1), std::nullopt, StateKind::kAttnKv, kPage},
                                      {H(2), std::nullopt, StateKind::kAttnKv, 4 * kPage}};
  auto r = core->Reserve(es);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv}).has_value());
  // When the rest fits, H(1) is answered present and stays present.
  es[1].length = 3 * kPage;
  r = core->Reserve(es);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->slots[0].already_present);
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv}).has_value())
      << "the Reserve that answered already_present=true evicted it";
  // The pin ended with that Reserve: the last free page comes from evicting H(1).
  ReserveEntrySpec next{H(3), std::nullopt, StateKind::kAttnKv, kPage};
  EXPECT_TRUE(core->Reserve({&next, 1}).ok());
  EXPECT_FALSE(core->Inspect({H(1), StateKind::kAttnKv}).has_value());
}

// A new entry's parent is not evicted to make room for it (nor, for a new checkpoint, its
// KV prefix): the child would be stored where no prefix Lookup reaches it (the checkpoint
// stored invisible), and its Put answered OK. Before, the LRU leaf H(2) went.
TEST_F(PoolCoreTest, ReserveNeverEvictsTheParentOfAnEntryItReserves) {
  for (StateKind kind : {StateKind::kAttnKv, StateKind::kLinearState}) {
    auto core = Make(4);
    PutChain(*core, 1, 2, kPage);  // H(1) -> H(2), H(2) the oldest leaf
    ASSERT_TRUE(Put(*core, H(10), std::nullopt, Pattern(10, kPage)).ok());
    ASSERT_TRUE(Put(*core, H(11), std::nullopt, Pattern(11, kPage)).ok());  // full
    if (kind == StateKind::kAttnKv) {
      ASSERT_TRUE(Put(*core, H(3), H(2), Pattern(3, kPage)).ok());
      auto ans = core->Lookup({.hashes = {H(1), H(2), H(3)}});
      ASSERT_TRUE(ans.ok()) << ans.status();
      EXPECT_EQ(ans->prefix_blocks, 3u);
      EXPECT_TRUE(core->Release(ans->lease_id).ok());
    } else {
      // The checkpoint at H(2): its KV prefix H(1), H(2) stays.
      ASSERT_TRUE(Put(*core, H(2), std::nullopt, Pattern(2, kPage), StateKind::kLinearState).ok());
      auto info = core->Inspect({H(2), StateKind::kLinearState});
      ASSERT_TRUE(info.has_value());
      EXPECT_TRUE(info->visible);
    }
    EXPECT_TRUE(core->Inspect({H(2), StateKind::kAttnKv}).has_value()) << StateKindName(kind);
    EXPECT_FALSE(core->Inspect({H(10), StateKind::kAttnKv}).has_value()) << StateKindName(kind);
    EXPECT_TRUE(core->CheckIndex().ok()) << core->CheckIndex();
  }
}

// A chain put in pieces (partial Commits): an entry committed early stays while a later
// entry of the same reservation, its child, is still to come. Before, H(1), committed
// first and the LRU leaf, was evicted by another client's Put and H(2) stored an orphan.
TEST_F(PoolCoreTest, AnEntryCommittedEarlyStaysForItsChildInTheSameReservation) {
  auto core = Make(4);
  const std::vector<ReserveEntrySpec> specs = {{H(1), std::nullopt, StateKind::kAttnKv, kPage},
                                               {H(2), H(1), StateKind::kAttnKv, kPage}};
  auto r = core->Reserve(specs);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string a = Pattern(1, kPage), b = Pattern(2, kPage);
  core->CopyToRun(r->slots[0].run, testing::Bytes(a));
  const CommitEntrySpec ca{H(1), Checksum64(testing::Bytes(a))};
  auto c1 = core->Commit(r->id, {&ca, 1}, /*partial=*/true);
  ASSERT_TRUE(c1.ok()) << c1.status();
  ASSERT_TRUE((*c1)[0].status.ok());
  ASSERT_TRUE(Put(*core, H(10), std::nullopt, Pattern(10, kPage)).ok());
  ASSERT_TRUE(Put(*core, H(11), std::nullopt, Pattern(11, kPage)).ok());  // full; H(1) the LRU leaf
  ASSERT_TRUE(Put(*core, H(12), std::nullopt, Pattern(12, kPage)).ok());
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv}).has_value()) << "evicted before its child came";
  EXPECT_FALSE(core->Inspect({H(10), StateKind::kAttnKv}).has_value());
  core->CopyToRun(r->slots[1].run, testing::Bytes(b));
  const CommitEntrySpec cb{H(2), Checksum64(testing::Bytes(b))};
  auto c2 = core->Commit(r->id, {&cb, 1});
  ASSERT_TRUE(c2.ok()) << c2.status();
  ASSERT_TRUE((*c2)[0].status.ok());
  auto ans = core->Lookup({.hashes = {H(1), H(2)}});
  ASSERT_TRUE(ans.ok()) << ans.status();
  EXPECT_EQ(ans->prefix_blocks, 2u);
  EXPECT_TRUE(core->Release(ans->lease_id).ok());
  // The reservation is over: nothing of it stays pinned.
  for (uint64_t i = 20; i < 24; ++i) ASSERT_TRUE(Put(*core, H(i), std::nullopt, Pattern(i, kPage)).ok()) << i;
  EXPECT_FALSE(core->Inspect({H(1), StateKind::kAttnKv}).has_value());
  EXPECT_TRUE(core->CheckIndex().ok()) << core->CheckIndex();
}

// ... nor by another Reserve while the reservation waits for its Commit: the parent stays
// pinned until the reservation ends (committed, ended or timed out), then is evictable
// again. Before, the pin ended with the Reserve call.
TEST_F(PoolCoreTest, AReservationKeepsItsEntriesParentsUntilItEnds) {
  auto core = Make(4, {.reserve_timeout_ms = 1000});
  PutChain(*core, 1, 2, kPage);  // H(1) -> H(2), H(2) the oldest leaf
  ASSERT_TRUE(Put(*core, H(10), std::nullopt, Pattern(10, kPage)).ok());
  ReserveEntrySpec child{H(3), H(2), StateKind::kAttnKv, kPage};
  auto r = core->Reserve({&child, 1});  // takes the last free page
  ASSERT_TRUE(r.ok()) << r.status();
  // Another client needs a page: the LRU leaf is H(2), pinned for the reservation.
  ASSERT_TRUE(Put(*core, H(20), std::nullopt, Pattern(20, kPage)).ok());
  EXPECT_TRUE(core->Inspect({H(2), StateKind::kAttnKv}).has_value()) << "the parent went before its child's Commit";
  EXPECT_FALSE(core->Inspect({H(10), StateKind::kAttnKv}).has_value());
  const std::string bytes = Pattern(3, kPage);
  core->CopyToRun(r->slots[0].run, testing::Bytes(bytes));
  const CommitEntrySpec c{H(3), Checksum64(testing::Bytes(bytes))};
  auto done = core->Commit(r->id, {&c, 1});
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_TRUE((*done)[0].status.ok()) << (*done)[0].status;
  auto ans = core->Lookup({.hashes = {H(1), H(2), H(3)}});
  ASSERT_TRUE(ans.ok()) << ans.status();
  EXPECT_EQ(ans->prefix_blocks, 3u);
  EXPECT_TRUE(core->Release(ans->lease_id).ok());
  // The pin ended with the reservation: a timed-out one leaves nothing pinned either.
  ReserveEntrySpec other{H(4), H(3), StateKind::kAttnKv, kPage};
  auto r2 = core->Reserve({&other, 1});
  ASSERT_TRUE(r2.ok()) << r2.status();
  clock_.AdvanceMs(2001);  // its timeout and the hold-back after it
  core->RunMaintenance();
  EXPECT_EQ(core->Stats().pending_reservations, 0u);
  EXPECT_TRUE(core->CheckIndex().ok()) << core->CheckIndex();
  for (uint64_t i = 30; i < 34; ++i) ASSERT_TRUE(Put(*core, H(i), std::nullopt, Pattern(i, kPage)).ok()) << i;
  for (uint64_t i : {1, 2, 3, 20}) {
    EXPECT_FALSE(core->Inspect({H(i), StateKind::kAttnKv}).has_value()) << "H(" << i << ") still pinned";
  }
}

TEST_F(PoolCoreTest, SelfParentIsRefusedNamingTheField) {
  auto core = Make(4);
  ReserveEntrySpec e{H(1), H(1), StateKind::kAttnKv, kPage};
  auto r = core->Reserve({&e, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              ::testing::HasSubstr("entries[0].parent_hash equals block_hash"));
  EXPECT_EQ(core->Stats().pending_reservations, 0u);
}

TEST_F(PoolCoreTest, ParentCycleIsBrokenSoItsObjectsStayEvictable) {
  auto core = Make(4);
  ASSERT_TRUE(Put(*core, H(1), H(2), Pattern(1, 2 * kPage)).ok());
  ASSERT_TRUE(Put(*core, H(2), H(1), Pattern(2, 2 * kPage)).ok());  // would close H1->H2->H1
  // DRAM is full of unleased objects: a Reserve must be able to evict them.
  ASSERT_TRUE(Put(*core, H(3), std::nullopt, Pattern(3, 4 * kPage)).ok());
  EXPECT_FALSE(core->Inspect({H(1), StateKind::kAttnKv}).has_value());
  EXPECT_FALSE(core->Inspect({H(2), StateKind::kAttnKv}).has_value());
  // The link that closed the cycle was dropped: H(2) was stored as a chain start.
  bool stored_h2_without_parent = false;
  for (const auto& ev : sink_.events) {
    if (ev.stored && ev.key.hash == H(2)) stored_h2_without_parent = true;
  }
  EXPECT_TRUE(stored_h2_without_parent);
}

TEST_F(PoolCoreTest, ReserveThatCannotFitEvictsNothing) {
  auto core = Make(8);
  PutChain(*core, 1, 4, kPage);
  ReserveEntrySpec e{H(100), std::nullopt, StateKind::kAttnKv, 100 * kPage};  // > the arena
  auto r = core->Reserve({&e, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(core->Stats().tiers[0].objects, 4u) << "a request that could never fit evicted the cache";
  // Leased objects stay whatever is evicted: 2 leased + 2 unleased + 4 free < 7.
  auto lease = core->Lookup({.hashes = {H(1), H(2)}});
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->prefix_blocks, 2u);
  e.length = 7 * kPage;
  r = core->Reserve({&e, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("nothing was evicted"));
  EXPECT_EQ(core->Stats().tiers[0].objects, 4u);
  // 6 pages fit by evicting the two unleased ones.
  e.length = 6 * kPage;
  EXPECT_TRUE(core->Reserve({&e, 1}).ok());
  EXPECT_EQ(core->Stats().tiers[0].objects, 2u);
  EXPECT_TRUE(core->Release(lease->lease_id).ok());
}

TEST_F(PoolCoreTest, QuotaThatCannotFitEvictsNothing) {
  PoolOptions o;
  o.dram_quota_bytes[KindIndex(StateKind::kAttnKv)] = 4 * kPage;
  auto core = Make(16, o);
  PutChain(*core, 1, 4, kPage);
  auto lease = core->Lookup({.hashes = {H(1), H(2)}});
  ASSERT_TRUE(lease.ok());
  ReserveEntrySpec e{H(100), std::nullopt, StateKind::kAttnKv, 3 * kPage};  // 2 leased + 3 > 4
  auto r = core->Reserve({&e, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(core->Stats().tiers[0].objects, 4u);
  EXPECT_TRUE(core->Release(lease->lease_id).ok());
}

// A Lookup that names the object length its caller can use treats an object of another
// length (put by a writer with another model of the same name) as a miss: not answered,
// not leased, not made more recent, so it ages out; the answer counts it. A Reserve of
// the same hash at the caller's length leaves it as it is without making it more recent,
// and says so: ALREADY_EXISTS naming both lengths, nothing reserved, and a Commit naming
// the entry gets the same (before: already_present, which a client took for "stored").
// Before that, the misfit was leased and made the most recent by every such Lookup.
TEST_F(PoolCoreTest, LookupTreatsAnObjectOfAnotherLengthAsAMiss) {
  auto core = Make(4);
  PutChain(*core, 1, 2, kPage);                                         // H1 -> H2, a page each
  ASSERT_TRUE(Put(*core, H(3), H(2), Pattern(3, 100)).ok());            // H3: 100 bytes, a misfit
  ASSERT_TRUE(Put(*core, H(9), std::nullopt, Pattern(9, kPage)).ok());  // DRAM full
  auto a = core->Lookup({.hashes = {H(1), H(2), H(3)}, .object_length = kPage});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->prefix_blocks, 2u);
  ASSERT_EQ(a->objects.size(), 2u);
  EXPECT_EQ(a->other_length, 1u);
  EXPECT_EQ(core->Inspect({H(3), StateKind::kAttnKv})->leases, 0u);
  ASSERT_TRUE(core->Release(a->lease_id).ok());
  const ReserveEntrySpec same{H(3), H(2), StateKind::kAttnKv, kPage};
  auto r = core->Reserve({&same, 1});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->slots[0].already_present);
  EXPECT_EQ(r->slots[0].status.code(), absl::StatusCode::kAlreadyExists) << r->slots[0].status;
  EXPECT_THAT(std::string(r->slots[0].status.message()), ::testing::HasSubstr("stored here with length 100, not 4096"));
  EXPECT_TRUE(r->slots[0].run.pages.empty());
  EXPECT_EQ(core->Stats().reserved_bytes, 0u);
  const CommitEntrySpec named{H(3), 0};
  auto c = core->Commit(r->id, {&named, 1});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)[0].status.code(), absl::StatusCode::kAlreadyExists) << (*c)[0].status;
  EXPECT_EQ(core->Inspect({H(3), StateKind::kAttnKv})->length, 100u);
  // Untouched, H3 is still the least recently used DRAM leaf (H2 is not a leaf): it goes.
  ASSERT_TRUE(Put(*core, H(20), std::nullopt, Pattern(20, kPage)).ok());
  EXPECT_FALSE(core->Inspect({H(3), StateKind::kAttnKv}).has_value());
  EXPECT_TRUE(core->Inspect({H(9), StateKind::kAttnKv}).has_value());
  // Without object_length, any length is a hit.
  auto any = core->Lookup({.hashes = {H(1), H(2)}});
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_EQ(any->prefix_blocks, 2u);
  ASSERT_TRUE(core->Release(any->lease_id).ok());
}

// Another client commits the hash at another length while this reservation is open: this
// Commit's bytes are not taken (objects are immutable), and it says so with
// ALREADY_EXISTS (before: OK, as if they were stored). The pages are freed.
TEST_F(PoolCoreTest, ACommitRacedByTheSameHashAtAnotherLengthSaysSo) {
  auto core = Make(8);
  const ReserveEntrySpec e{H(5), std::nullopt, StateKind::kAttnKv, kPage};
  auto r = core->Reserve({&e, 1}, "a");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->slots[0].status.ok()) << r->slots[0].status;
  const std::string bytes = Pattern(5, kPage);
  core->CopyToRun(r->slots[0].run, testing::Bytes(bytes));
  ASSERT_TRUE(Put(*core, H(5), std::nullopt, Pattern(6, 100)).ok());  // another client, 100 bytes
  const CommitEntrySpec c{H(5), Checksum64(testing::Bytes(bytes))};
  auto out = core->Commit(r->id, {&c, 1}, false, 1, false, "a");
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].status.code(), absl::StatusCode::kAlreadyExists) << (*out)[0].status;
  EXPECT_EQ(core->Inspect({H(5), StateKind::kAttnKv})->length, 100u);
  EXPECT_EQ(core->Stats().reserved_bytes, 0u);
  EXPECT_EQ(core->Stats().tiers[static_cast<int>(Tier::kDram)].used_bytes, kPage);  // the 100-byte object's page only
  EXPECT_TRUE(core->CheckIndex().ok());
}

// Reservations and leases belong to the client that made them: a Commit or Release naming
// another client's id is PERMISSION_DENIED and changes nothing (before: it settled the
// other client's reservation or ended its lease). Ids are not handed out in sequence.
TEST_F(PoolCoreTest, ReservationsAndLeasesBelongToTheirClient) {
  auto core = Make(8);
  PutChain(*core, 1, 2, kPage);
  const ReserveEntrySpec e{H(5), std::nullopt, StateKind::kAttnKv, kPage};
  auto r = core->Reserve({&e, 1}, "a");
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string bytes = Pattern(5, kPage);
  core->CopyToRun(r->slots[0].run, testing::Bytes(bytes));
  const CommitEntrySpec c{H(5), Checksum64(testing::Bytes(bytes))};
  auto stolen = core->Commit(r->id, {&c, 1}, false, 1, false, "b");
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kPermissionDenied) << stolen.status();
  EXPECT_THAT(std::string(stolen.status().message()), ::testing::HasSubstr("client_id \"b\""));
  EXPECT_FALSE(core->Inspect({H(5), StateKind::kAttnKv}).has_value());
  EXPECT_EQ(core->Stats().pending_reservations, 1u);
  auto mine = core->Commit(r->id, {&c, 1}, false, 1, false, "a");
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_TRUE((*mine)[0].status.ok()) << (*mine)[0].status;

  auto lease = core->Lookup({.hashes = {H(1), H(2)}, .client = "a"});
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_NE(lease->lease_id, 0u);
  EXPECT_NE(lease->lease_id, r->id + 1);  // not the next number
  EXPECT_EQ(core->Release(lease->lease_id, "b").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(core->Inspect({H(1), StateKind::kAttnKv})->leases, 1u);
  EXPECT_TRUE(core->Release(lease->lease_id, "a").ok());
  EXPECT_EQ(core->Inspect({H(1), StateKind::kAttnKv})->leases, 0u);
}

// With a per-client cap (max_client_pinned_bytes), one client cannot pin the tier: a
// Lookup or Reserve that would take its leased and reserved pages past the cap is
// RESOURCE_EXHAUSTED naming the client, and pins nothing; other clients are served, and
// the client is again once its leases end. Before, one client could lease every object.
TEST_F(PoolCoreTest, OneClientCannotPinMoreThanItsCap) {
  auto core = Make(8, {.max_client_pinned_bytes = 4 * kPage});
  PutChain(*core, 1, 6, kPage);
  auto a = core->Lookup({.hashes = {H(1), H(2), H(3), H(4)}, .client = "a"});
  ASSERT_TRUE(a.ok()) << a.status();
  auto more = core->Lookup({.hashes = {H(5)}, .client = "a"});
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted) << more.status();
  EXPECT_THAT(std::string(more.status().message()), ::testing::HasSubstr("client_id \"a\" holds 4 DRAM pages"));
  EXPECT_EQ(core->Inspect({H(5), StateKind::kAttnKv})->leases, 0u);
  const ReserveEntrySpec e{H(7), std::nullopt, StateKind::kAttnKv, kPage};
  auto r = core->Reserve({&e, 1}, "a");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(core->Stats().pending_reservations, 0u);

  auto b = core->Lookup({.hashes = {H(5), H(6)}, .client = "b"});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->objects.size(), 2u);
  auto whole = core->Lookup({.hashes = {H(1), H(2), H(3), H(4), H(5)}, .client = "c"});
  EXPECT_EQ(whole.status().code(), absl::StatusCode::kResourceExhausted) << whole.status();
  EXPECT_THAT(std::string(whole.status().message()), ::testing::HasSubstr("can never fit alone"));
  EXPECT_TRUE(core->CheckIndex().ok()) << core->CheckIndex();

  ASSERT_TRUE(core->Release(a->lease_id, "a").ok());
  auto again = core->Reserve({&e, 1}, "a");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(core->CheckIndex().ok()) << core->CheckIndex();
  const std::string bytes = Pattern(7, kPage);
  core->CopyToRun(again->slots[0].run, testing::Bytes(bytes));
  const CommitEntrySpec c{H(7), Checksum64(testing::Bytes(bytes))};
  auto done = core->Commit(again->id, {&c, 1}, false, 1, false, "a");
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE((*done)[0].status.ok()) << (*done)[0].status;
  ASSERT_TRUE(core->Release(b->lease_id, "b").ok());
  EXPECT_TRUE(core->CheckIndex().ok()) << core->CheckIndex();
}

// Two Lookups of one client that both pass the cap's first check (each before the other
// leased anything) cannot both lease: the cap is checked again where the lease is made.
// Before, the second check did not exist, and the client held twice its cap.
TEST_F(PoolCoreTest, ConcurrentLookupsOfOneClientStayWithinItsCap) {
  PoolCore* self = nullptr;
  bool nested = false;
  absl::StatusOr<LookupAnswer> inner = absl::UnknownError("not run");
  PoolOptions o{.max_client_pinned_bytes = 4 * kPage};
  o.lookup_between_locks = [&] {
    if (nested) return;
    nested = true;  // one Lookup of the same client runs here, between the outer one's locks
    inner = self->Lookup({.hashes = {H(5), H(6), H(7), H(8)}, .client = "a"});
  };
  auto core = Make(8, o);
  self = core.get();
  PutChain(*core, 1, 8, kPage);  // no Lookup: the hook has not run
  ASSERT_FALSE(nested);
  auto outer = core->Lookup({.hashes = {H(1), H(2), H(3), H(4)}, .client = "a"});
  ASSERT_TRUE(nested);
  ASSERT_TRUE(inner.ok()) << inner.status();
  EXPECT_EQ(outer.status().code(), absl::StatusCode::kResourceExhausted) << outer.status();
  EXPECT_EQ(core->Inspect({H(1), StateKind::kAttnKv})->leases, 0u);
  EXPECT_TRUE(core->CheckIndex().ok()) << core->CheckIndex();
  ASSERT_TRUE(core->Release(inner->lease_id, "a").ok());
  EXPECT_TRUE(core->CheckIndex().ok()) << core->CheckIndex();
}

// Pages held back from a client's lapsed or failed reservation (one more reserve
// timeout: a late write may still land) stay charged to that client until they are
// freed: a client that lets its reservations lapse cannot reserve its cap again
// meanwhile and so keep twice its cap out of use.
TEST_F(PoolCoreTest, HeldBackPagesStayChargedToTheirClient) {
  auto core = Make(16, {.reserve_timeout_ms = 1000, .max_client_pinned_bytes = 4 * kPage});
  const ReserveEntrySpec four{H(1), std::nullopt, StateKind::kAttnKv, 4 * kPage};
  ASSERT_TRUE(core->Reserve({&four, 1}, "a").ok());
  clock_.AdvanceMs(1001);  // reclaimed: its 4 pages are held back
  const ReserveEntrySpec one{H(2), std::nullopt, StateKind::kAttnKv, kPage};
  auto r = core->Reserve({&one, 1}, "a");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(core->Stats().dram_held_back_bytes, 4 * kPage);
  EXPECT_TRUE(core->CheckIndex().ok()) << core->CheckIndex();
  // A failed checksum holds another client's pages back the same way.
  auto b = core->Reserve({&one, 1}, "b");
  ASSERT_TRUE(b.ok()) << b.status();
  const CommitEntrySpec wrong{H(2), 1};
  auto c = core->Commit(b->id, {&wrong, 1}, false, 1, false, "b");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)[0].status.code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(core->CheckIndex().ok()) << core->CheckIndex();
  clock_.AdvanceMs(1001);  // both hold-backs end
  auto again = core->Reserve({&four, 1}, "a");
  EXPECT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(core->Stats().dram_held_back_bytes, 0u);
  EXPECT_TRUE(core->CheckIndex().ok()) << core->CheckIndex();
}

// A Reserve entry that no eviction could ever fit (larger than the DRAM tier, or than its
// kind's quota) is refused naming the entry and saying it can never fit (before: "retry
// later", naming no entry), and nothing stored is touched.
TEST_F(PoolCoreTest, AnEntryLargerThanTheTierOrItsQuotaIsNamed) {
  auto core = Make(8, {.dram_quota_bytes = {0, 2 * kPage}});
  PutChain(*core, 1, 2, kPage);
  const ReserveEntrySpec too_big[] = {{H(5), std::nullopt, StateKind::kAttnKv, kPage},
                                      {H(6), std::nullopt, StateKind::kAttnKv, 9 * kPage}};
  auto r = core->Reserve(too_big);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("entries[1].length=36864"));
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("can never fit"));
  const ReserveEntrySpec over_quota{H(7), std::nullopt, StateKind::kLinearState, 3 * kPage};
  auto q = core->Reserve({&over_quota, 1});
  EXPECT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted) << q.status();
  EXPECT_THAT(std::string(q.status().message()), ::testing::HasSubstr("quota for linear_state is 2 pages"));
  EXPECT_TRUE(core->Inspect({H(1), StateKind::kAttnKv}).has_value());
  EXPECT_TRUE(core->Inspect({H(2), StateKind::kAttnKv}).has_value());
  EXPECT_EQ(core->Stats().tiers[0].used_bytes, 2 * kPage);
}

}  // namespace
}  // namespace kvpool::pool_node
