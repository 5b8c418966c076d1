// RouterHost without gRPC: batches queued under an older registration of a source, and
// full dumps applied in slices. The host's clock is the only seam: the applier reads it
// before each slice, outside the core lock, and the tests pause it there to call the
// host from the test thread between two slices (a hand-shake, no sleeps).
#include "kvpool/router/router_host.h"

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "kvpool/metrics/metrics.h"

namespace kvpool::router {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1'000'000);

// Distinct non-zero hashes (zero means "no parent"); the index spreads small ones itself.
BlockHash H(uint64_t x) { return BlockHash{x + 1, 0x6b76}; }

std::vector<BlockHash> Chain(uint64_t base, size_t n) {
  std::vector<BlockHash> c;
  for (size_t i = 0; i < n; ++i) c.push_back(H(base + i));
  return c;
}

EventBatch Batch(std::vector<KvEvent> events, bool full_dump = false, uint64_t dump_sequence = 0) {
  EventBatch b;
  b.full_dump = full_dump;
  b.dump_sequence = dump_sequence;
  b.events = std::move(events);
  return b;
}

// A full dump of `chain`, one stored event per block (as a source that dumps object by
// object sends it), sequences 1..n.
EventBatch DumpOf(const std::vector<BlockHash>& chain, uint64_t dump_sequence = 0) {
  std::vector<KvEvent> events;
  for (size_t i = 0; i < chain.size(); ++i) {
    events.push_back(KvEvent::Stored(i + 1, i == 0 ? BlockHash{} : chain[i - 1], {chain[i]}));
  }
  return Batch(std::move(events), /*full_dump=*/true, dump_sequence);
}

// The host's clock. While armed, each read on the applier thread pauses it until the test
// thread resumes it, so the test can call the host between two of the applier's core
// lock holds. The test thread's own reads (Route, Register, Enqueue) never pause.
class ApplierPauses {
 public:
  absl::Time Now() {
    if (std::this_thread::get_id() == test_thread_) return kT0;
    absl::MutexLock l(&mu_);
    if (!armed_) return kT0;
    const uint64_t n = ++pauses_;
    auto resumed = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !armed_ || resumes_ >= n; };
    // Bounded: were the clock read under core_mu_, the test thread's call into the host
    // would wait for this thread forever. Then the batch completes first, and the test
    // fails on what it saw instead of hanging.
    mu_.AwaitWithTimeout(absl::Condition(&resumed), absl::Seconds(10));
    return kT0;
  }
  void Arm() {
    absl::MutexLock l(&mu_);
    armed_ = true;
  }
  void Disarm() {  // from the batch's done callback: the applier must not pause after it
    absl::MutexLock l(&mu_);
    armed_ = false;
  }
  // True once the applier is paused; false when the batch is done instead.
  bool NextPause() {
    absl::MutexLock l(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !armed_ || pauses_ > resumes_; };
    mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(30));
    return armed_ && pauses_ > resumes_;
  }
  void Resume() {
    absl::MutexLock l(&mu_);
    ++resumes_;
  }

 private:
  const std::thread::id test_thread_ = std::this_thread::get_id();
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t pauses_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t resumes_ ABSL_GUARDED_BY(mu_) = 0;
};

class RouterHostTest : public ::testing::Test {
 protected:
  struct Answer {
    absl::Notification done;
    absl::StatusOr<EventsResult> result;
  };

  void Make(size_t slice_events, size_t slice_hashes = 16384) {
    RouterHostOptions o;
    o.core.models = {"tiny-gqa"};
    o.apply_slice_events = slice_events;
    o.apply_slice_hashes = slice_hashes;
    o.tick_interval = absl::Hours(1);  // no maintenance in the middle of a test
    auto h = RouterHost::Create(o, &metrics_, [this] { return clock_.Now(); });
    ASSERT_TRUE(h.ok()) << h.status();
    host_ = std::move(*h);
  }

  void Register(const std::string& id) {
    SourceInfo s;
    s.id = id;
    s.kind = SourceKind::kWorker;
    s.model = "tiny-gqa";
    ASSERT_TRUE(host_->Register(s).ok());
  }

  // Registers w0 and applies `events` as one batch of its stream, calling at_pause() at
  // every pause of the applier (each of its clock reads: one per slice, one after).
  std::shared_ptr<Answer> ApplyPausing(std::vector<KvEvent> events, const std::function<void()>& at_pause) {
    Register("w0");
    const uint64_t stream = StreamRegistration("w0");
    clock_.Arm();
    auto batch = Queue("w0", stream, Batch(std::move(events)), [this] { clock_.Disarm(); });
    while (clock_.NextPause()) {
      at_pause();
      clock_.Resume();
    }
    batch->done.WaitForNotification();
    return batch;
  }

  // What a PublishEvents stream does with its first batch: it takes the source's current
  // registration, and passes it with every batch it queues.
  uint64_t StreamRegistration(const std::string& id) { return host_->RegistrationOf(id); }

  // Queues `b` as a stream of `registration` would; `then` runs on the applier thread
  // after the answer is recorded.
  std::shared_ptr<Answer> Queue(const std::string& id, uint64_t registration, EventBatch b,
                                std::function<void()> then = nullptr) {
    auto a = std::make_shared<Answer>();
    host_->Enqueue(id, registration, std::move(b), [a, then](absl::StatusOr<EventsResult> r) {
      a->result = std::move(r);
      if (then) then();
      a->done.Notify();
    });
    return a;
  }
  absl::StatusOr<EventsResult> Apply(const std::string& id, uint64_t registration, EventBatch b) {
    auto a = Queue(id, registration, std::move(b));
    a->done.WaitForNotification();
    return a->result;
  }

  // Leading blocks of `chain` the router believes w0 (the only worker) holds on GPU.
  uint32_t GpuHit(const std::vector<BlockHash>& chain) {
    RouteInput in;
    in.model = "tiny-gqa";
    in.hashes = chain;
    auto d = host_->Route(in);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? d->gpu_hit_blocks : 0;
  }

  SourceStats StatsOf(const std::string& id) {
    for (SourceStats& s : host_->Stats().sources) {
      if (s.id == id) return s;
    }
    ADD_FAILURE() << id << " is not registered";
    return {};
  }

  ApplierPauses clock_;
  MetricsRegistry metrics_;  // declared before host_: outlives it
  std::unique_ptr<RouterHost> host_;
};

// The registry outlives the host (as here): a scrape after the host went renders what is
// left and does not call into it. Before, its hook stayed registered (ASan: use after free).
TEST_F(RouterHostTest, AScrapeAfterTheHostWentDoesNotCallIntoIt) {
  Make(256);
  EXPECT_NE(metrics_.Render().find("kvpool_router_decisions_total"), std::string::npos);
  host_.reset();
  EXPECT_NE(metrics_.Render().find("kvpool_router_decisions_total"), std::string::npos);
}

// A batch the old stream had queued when its source registered again belongs to the old
// incarnation: applied to the new one it took sequence 1 from it, so the new stream's
// real first event was skipped as a duplicate and the old block stayed in the view.
TEST_F(RouterHostTest, BatchQueuedBeforeTheSourceRegistersAgainIsDropped) {
  Make(256);
  Register("w0");
  const uint64_t old_stream = StreamRegistration("w0");
  // Hold the applier in a done callback, so the next batches queue up behind it.
  absl::Notification entered, release;
  Queue("w0", old_stream, Batch({}), [&] {
    entered.Notify();
    release.WaitForNotification();
  });
  entered.WaitForNotification();
  auto old_batch = Queue("w0", old_stream, Batch({KvEvent::Stored(1, {}, {H(100)})}));
  Register("w0");  // the source restarted: a new registration, a new stream
  const uint64_t new_stream = StreamRegistration("w0");
  EXPECT_NE(new_stream, old_stream);
  auto new_batch = Queue("w0", new_stream, Batch({KvEvent::Stored(1, {}, {H(200)})}));
  release.Notify();
  old_batch->done.WaitForNotification();
  new_batch->done.WaitForNotification();

  ASSERT_FALSE(old_batch->result.ok()) << "the old registration's batch was applied to the new one";
  EXPECT_EQ(old_batch->result.status().code(), absl::StatusCode::kAborted) << old_batch->result.status();
  EXPECT_NE(old_batch->result.status().message().find("registered again"), absl::string_view::npos)
      << old_batch->result.status();
  ASSERT_TRUE(new_batch->result.ok()) << new_batch->result.status();
  EXPECT_EQ(new_batch->result->apply.applied, 1u);
  EXPECT_EQ(new_batch->result->apply.duplicates, 0u);
  EXPECT_EQ(GpuHit({H(100)}), 0u);
  EXPECT_EQ(GpuHit({H(200)}), 1u);
}

// A stream reads its next batch only once the previous one applied, so an old stream can
// deliver a batch after the new registration's dump. Its sequence (2) continues the new
// dump's (1) and looked valid.
TEST_F(RouterHostTest, OldStreamCannotWriteIntoTheNewRegistration) {
  Make(256);
  Register("w0");
  const uint64_t old_stream = StreamRegistration("w0");
  ASSERT_TRUE(Apply("w0", old_stream, DumpOf({H(1)})).ok());
  Register("w0");
  const uint64_t new_stream = StreamRegistration("w0");
  auto dump = Apply("w0", new_stream, DumpOf({H(2)}));
  ASSERT_TRUE(dump.ok()) << dump.status();
  EXPECT_EQ(dump->apply.last_sequence, 1u);

  auto late = Apply("w0", old_stream, Batch({KvEvent::Stored(2, H(1), {H(3)})}));
  ASSERT_FALSE(late.ok()) << "an event of the old registration was applied to the new one";
  EXPECT_EQ(late.status().code(), absl::StatusCode::kAborted) << late.status();
  EXPECT_EQ(GpuHit({H(3)}), 0u);
  EXPECT_EQ(StatsOf("w0").last_sequence, 1u);
  // The new stream goes on at 2.
  auto next = Apply("w0", new_stream, Batch({KvEvent::Stored(2, H(2), {H(4)})}));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->apply.applied, 1u);
  EXPECT_EQ(GpuHit({H(2), H(4)}), 2u);

  // A stream whose source was not registered when it began gets NOT_FOUND, as before.
  auto ghost = Apply("ghost", StreamRegistration("ghost"), Batch({KvEvent::Stored(1, {}, {H(5)})}));
  EXPECT_EQ(ghost.status().code(), absl::StatusCode::kNotFound) << ghost.status();
}

// A large full dump applies in slices of apply_slice_events with core_mu_ released in
// between: Route runs between two slices (it waited for the whole dump before). Between
// slices the source holds the part of the dump applied so far, and a heartbeat does not
// ask for another dump.
TEST_F(RouterHostTest, FullDumpAppliesInSlicesAndRouteRunsBetweenThem) {
  Make(16);
  Register("w0");
  const uint64_t stream = StreamRegistration("w0");
  // The source is stale (a gap) with an old block, and the router waits for its dump.
  auto gap = Apply("w0", stream, Batch({KvEvent::Stored(1, {}, {H(900)}), KvEvent::Stored(3, {}, {H(901)})}));
  ASSERT_TRUE(gap.ok()) << gap.status();
  ASSERT_TRUE(gap->full_dump_requested);
  const std::vector<BlockHash> chain = Chain(1000, 64);

  clock_.Arm();
  auto dump = Queue("w0", stream, DumpOf(chain), [this] { clock_.Disarm(); });
  std::vector<uint32_t> seen;  // w0's hit on the chain at each pause with part of the dump in
  while (clock_.NextPause()) {
    const uint32_t hit = GpuHit(chain);
    if (hit > 0 && hit < chain.size()) {
      seen.push_back(hit);
      EXPECT_FALSE(host_->Heartbeat("w0", InstanceLoad{}, {}).full_dump_requested)
          << "a heartbeat during the dump asked for another one";
      EXPECT_EQ(GpuHit({H(900)}), 0u) << "the old entries outlived the dump's first slice";
    }
    clock_.Resume();
  }
  dump->done.WaitForNotification();
  ASSERT_TRUE(dump->result.ok()) << dump->result.status();
  EXPECT_EQ(seen, (std::vector<uint32_t>{16, 32, 48}))
      << "Route did not run between the dump's slices: core_mu_ was held for the whole dump";
  EXPECT_EQ(dump->result->apply.applied, 64u);
  EXPECT_EQ(dump->result->apply.last_sequence, 64u);
  EXPECT_FALSE(dump->result->full_dump_requested);
  EXPECT_EQ(GpuHit(chain), 64u);
  const SourceStats s = StatsOf("w0");
  EXPECT_FALSE(s.stale);
  EXPECT_EQ(s.last_sequence, 64u);
  EXPECT_EQ(s.index_blocks, 64u);
}

// Slices are bounded by hashes too: 8 events of 16 hashes with a 32-hash bound apply as
// 4 slices of 2 events, and Route runs between them (one slice of 256 events could carry
// 1M hashes).
TEST_F(RouterHostTest, SlicesAreBoundedByHashesAsWellAsEvents) {
  Make(256, 32);
  const std::vector<BlockHash> chain = Chain(3000, 128);
  std::vector<KvEvent> events;
  for (size_t e = 0; e < 8; ++e) {
    const BlockHash parent = e == 0 ? BlockHash{} : chain[e * 16 - 1];
    events.push_back(KvEvent::Stored(e + 1, parent, std::vector<BlockHash>(chain.begin() + e * 16, chain.begin() + (e + 1) * 16)));
  }
  std::vector<uint32_t> seen;
  auto batch = ApplyPausing(std::move(events), [&] {
    const uint32_t hit = GpuHit(chain);
    if (hit > 0 && hit < chain.size()) seen.push_back(hit);
  });
  ASSERT_TRUE(batch->result.ok()) << batch->result.status();
  EXPECT_EQ(seen, (std::vector<uint32_t>{32, 64, 96}));
  EXPECT_EQ(batch->result->apply.applied, 8u);
  EXPECT_EQ(GpuHit(chain), 128u);
}

// A `cleared` event scans the whole index though it carries no hash: it takes a slice of
// its own, so a batch alternating stored and cleared events cannot put many scans in one
// core lock hold. Before, 3 stored events of 16 hashes and 2 cleared ones went in 2
// slices under a 32-hash bound; now in 5.
TEST_F(RouterHostTest, AClearedEventTakesASliceOfItsOwn) {
  Make(256, 32);
  const std::vector<BlockHash> chain = Chain(4000, 16);
  std::vector<KvEvent> events;
  for (uint64_t e = 0; e < 5; ++e) {
    events.push_back(e % 2 == 0 ? KvEvent::Stored(e + 1, BlockHash{}, chain) : KvEvent::Cleared(e + 1));
  }
  int pauses = 0;  // one per slice, and one read after the batch (its lag metric)
  auto batch = ApplyPausing(std::move(events), [&] { ++pauses; });
  ASSERT_TRUE(batch->result.ok()) << batch->result.status();
  EXPECT_EQ(batch->result->apply.applied, 5u);
  EXPECT_GE(pauses, 5) << "stored and cleared events shared core lock holds";
  EXPECT_EQ(GpuHit(chain), 16u);
}

// The registration is checked at every slice: a source that registers again in the
// middle of its dump gets nothing of the rest of it.
TEST_F(RouterHostTest, RegisteringAgainDuringADumpDropsItsRemainingSlices) {
  Make(16);
  Register("w0");
  const uint64_t stream = StreamRegistration("w0");
  const std::vector<BlockHash> chain = Chain(2000, 64);
  clock_.Arm();
  auto dump = Queue("w0", stream, DumpOf(chain), [this] { clock_.Disarm(); });
  bool registered_again = false;
  while (clock_.NextPause()) {
    if (!registered_again && GpuHit(chain) > 0) {
      Register("w0");
      registered_again = true;
    }
    clock_.Resume();
  }
  dump->done.WaitForNotification();
  ASSERT_TRUE(registered_again) << "no pause between two slices of the dump";
  ASSERT_FALSE(dump->result.ok()) << "the rest of the dump was applied to the new registration";
  EXPECT_EQ(dump->result.status().code(), absl::StatusCode::kAborted) << dump->result.status();
  EXPECT_EQ(GpuHit(chain), 0u);
  EXPECT_EQ(StatsOf("w0").index_blocks, 0u);
  EXPECT_EQ(StatsOf("w0").last_sequence, 0u);
  // The slices that landed before the abort count in /metrics as in the core's stats.
  const uint64_t applied = host_->Stats().events_applied;
  EXPECT_GT(applied, 0u);
  EXPECT_EQ(metrics_.GetCounter("kvpool_router_events_applied_total", "").value(), static_cast<double>(applied));
}

// As for sliced event batches, the whole dump is validated before its first slice.
TEST_F(RouterHostTest, BadEventLateInASlicedDumpAppliesNothing) {
  Make(16);
  Register("w0");
  const uint64_t stream = StreamRegistration("w0");
  ASSERT_TRUE(Apply("w0", stream, Batch({KvEvent::Stored(1, {}, {H(1), H(2)})})).ok());
  EventBatch dump = DumpOf(Chain(3000, 64));
  dump.events[60].parent = dump.events[60].hashes[0];  // a chain that contains its parent
  auto r = Apply("w0", stream, dump);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("events[60]"), absl::string_view::npos) << r.status();
  EXPECT_EQ(GpuHit({H(1), H(2)}), 2u);
  EXPECT_EQ(GpuHit(Chain(3000, 64)), 0u);
  EXPECT_EQ(StatsOf("w0").last_sequence, 1u);
}

// A dump in slices ends where the same dump in one core call does: entries, sequence,
// staleness and lookups, for dumps with removed and cleared events and dump_sequence.
TEST_F(RouterHostTest, SlicedDumpEndsLikeTheDumpInOneCall) {
  Make(8);
  RouterOptions o;
  o.models = {"tiny-gqa"};
  auto core = RouterCore::Create(o);
  ASSERT_TRUE(core.ok()) << core.status();
  SourceInfo info;
  info.id = "w0";
  info.model = "tiny-gqa";
  ASSERT_TRUE((*core)->Register(info, kT0).ok());
  Register("w0");
  const uint64_t stream = StreamRegistration("w0");

  const std::vector<BlockHash> a = Chain(4000, 40), b = Chain(5000, 21);
  std::vector<EventBatch> dumps;
  dumps.push_back(DumpOf(a));
  dumps.push_back(DumpOf(b, /*dump_sequence=*/77));
  EventBatch mixed = DumpOf(a);
  mixed.events[12] = KvEvent::Cleared(13);
  mixed.events[30] = KvEvent::Removed(31, {a[20], a[25]});
  dumps.push_back(mixed);
  dumps.push_back(Batch({}, /*full_dump=*/true, /*dump_sequence=*/9));  // empty, one slice
  for (size_t i = 0; i < dumps.size(); ++i) {
    SCOPED_TRACE("dump " + std::to_string(i));
    auto want = (*core)->ApplyEvents("w0", dumps[i], kT0);
    auto got = Apply("w0", stream, dumps[i]);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->apply.applied, want->apply.applied);
    EXPECT_EQ(got->apply.last_sequence, want->apply.last_sequence);
    EXPECT_EQ(got->full_dump_requested, want->full_dump_requested);
    const RouterStatsSnapshot st = host_->Stats(), ref = (*core)->Stats(kT0);
    EXPECT_EQ(st.index_entries, ref.index_entries);
    EXPECT_EQ(st.events_applied, ref.events_applied);
    ASSERT_EQ(st.sources.size(), 1u);
    EXPECT_EQ(st.sources[0].last_sequence, ref.sources[0].last_sequence);
    EXPECT_EQ(st.sources[0].index_blocks, ref.sources[0].index_blocks);
    EXPECT_EQ(st.sources[0].stale, ref.sources[0].stale);
    for (const auto* c : {&a, &b}) {
      RouteInput in;
      in.model = "tiny-gqa";
      in.hashes = *c;
      auto d = (*core)->Route(in, kT0);
      ASSERT_TRUE(d.ok());
      EXPECT_EQ(GpuHit(*c), d->gpu_hit_blocks);
    }
    // Events after the dump continue its sequence the same way on both.
    EventBatch after = Batch({KvEvent::Stored(want->apply.last_sequence + 1, {}, {H(9000 + i)})});
    auto want_after = (*core)->ApplyEvents("w0", after, kT0);
    auto got_after = Apply("w0", stream, after);
    ASSERT_TRUE(want_after.ok() && got_after.ok());
    EXPECT_EQ(got_after->apply.applied, want_after->apply.applied);
    EXPECT_EQ(got_after->apply.applied, 1u);
  }
}

}  // namespace
}  // namespace kvpool::router
