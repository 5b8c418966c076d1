// RouterCore end to end without I/O: events -> index -> policies -> decisions, with an
// injected clock.
#include "kvpool/router/router_core.h"

#include <algorithm>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

namespace kvpool::router {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1'000'000);

RouteInput In(std::string model, std::vector<BlockHash> h) {
  RouteInput in;
  in.model = std::move(model);
  in.hashes = std::move(h);
  return in;
}

SourceInfo Info(std::string id, SourceKind kind, std::string model, bool events = true) {
  SourceInfo s;
  s.id = id;
  s.kind = kind;
  s.address = id + (kind == SourceKind::kWorker ? ":1" : ":2");
  s.model = std::move(model);
  s.publishes_events = events;
  return s;
}

InstanceLoad Load(uint32_t running, uint64_t queued_tokens) {
  InstanceLoad l;
  l.running_requests = running;
  l.queued_prefill_tokens = queued_tokens;
  return l;
}

std::vector<TokenId> Tokens(uint32_t n, uint32_t salt) {
  std::vector<TokenId> t(n);
  for (uint32_t i = 0; i < n; ++i) t[i] = salt * 7919 + i;
  return t;
}

class RouterCoreTest : public ::testing::Test {
 protected:
  void Make(RouterOptions o) {
    auto c = RouterCore::Create(std::move(o));
    ASSERT_TRUE(c.ok()) << c.status();
    core_ = std::move(*c);
  }
  // Predictions that live an hour, in an index of at most max_index_entries (0: default).
  void MakeApprox(uint64_t max_index_entries = 0) {
    RouterOptions o;
    o.models = {"llama-3.3-70b"};
    o.approx_ttl = absl::Hours(1);
    if (max_index_entries != 0) o.max_index_entries = max_index_entries;
    Make(o);
  }
  void MakeDefault(PolicyKind policy, std::vector<std::string> models = {"llama-3.3-70b"}) {
    RouterOptions o;
    o.models = std::move(models);
    o.policy = policy;
    Make(o);
  }
  void Worker(const std::string& id, const std::string& model = "llama-3.3-70b", bool events = true,
              absl::Time now = kT0) {
    ASSERT_TRUE(core_->Register(Info(id, SourceKind::kWorker, model, events), now).ok());
  }
  void PoolNode(const std::string& id) {
    ASSERT_TRUE(core_->Register(Info(id, SourceKind::kPoolNode, ""), kT0).ok());
  }
  std::vector<BlockHash> Hash(const std::vector<TokenId>& tokens, const std::string& model = "llama-3.3-70b") {
    auto m = core_->FindModel(model, 0);
    EXPECT_TRUE(m.ok());
    return core_->HashTokens(**m, tokens, "", {});
  }
  // Publishes `hashes[0..n)` as one stored event with the source's next sequence.
  void Store(const std::string& id, const std::vector<BlockHash>& hashes, size_t n, Tier tier = Tier::kGpu,
             StateKind kind = StateKind::kAttnKv, size_t first = 0) {
    EventBatch b;
    b.events.push_back(KvEvent::Stored(++seq_[id], first == 0 ? BlockHash{} : hashes[first - 1],
                                       {hashes.begin() + static_cast<ptrdiff_t>(first),
                                        hashes.begin() + static_cast<ptrdiff_t>(first + n)},
                                       tier, kind));
    auto r = core_->ApplyEvents(id, b, kT0);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->apply.applied, 1u);
  }
  RouteDecision Route(const std::vector<BlockHash>& h, absl::Time now = kT0, std::string policy = "",
                      std::string model = "llama-3.3-70b") {
    RouteInput in = In(model, h);
    in.policy = policy;
    auto d = core_->Route(in, now);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? *d : RouteDecision{};
  }

  std::unique_ptr<RouterCore> core_;
  std::map<std::string, uint64_t> seq_;
};

TEST_F(RouterCoreTest, CacheAwareFollowsPublishedEvents) {
  MakeDefault(PolicyKind::kCacheAware);
  Worker("w0");
  Worker("w1");
  Worker("w2");
  auto h = Hash(Tokens(16 * 10, 1));
  Store("w1", h, 8);
  RouteDecision d = Route(h);
  EXPECT_EQ(d.instance_id, "w1");
  EXPECT_EQ(d.instance_address, "w1:1");
  EXPECT_EQ(d.gpu_hit_blocks, 8u);
  EXPECT_EQ(d.total_blocks, 10u);
  EXPECT_GT(d.decision_id, 0u);
  EXPECT_EQ(core_->load().Inflight(core_->SlotOf("w1")), 1u);
  EXPECT_EQ(core_->Stats(kT0).decisions_by_policy[static_cast<int>(PolicyKind::kCacheAware)], 1u);
}

TEST_F(RouterCoreTest, TtftCountsPoolHitBeyondGpuHitWithLocations) {
  MakeDefault(PolicyKind::kTtft);
  Worker("w0");
  Worker("w1");
  PoolNode("p0");
  PoolNode("p1");
  auto h = Hash(Tokens(16 * 20, 2));
  Store("w0", h, 2);
  Store("p0", h, 5, Tier::kDram);
  Store("p1", h, 3, Tier::kNvme, StateKind::kAttnKv, 5);
  RouteDecision d = Route(h);
  EXPECT_EQ(d.instance_id, "w0");
  EXPECT_EQ(d.gpu_hit_blocks, 2u);
  EXPECT_EQ(d.pool_hit_blocks, 6u);
  ASSERT_EQ(d.pool_locations.size(), 2u);
  EXPECT_EQ(d.pool_locations[0].holder_id, "p0");
  EXPECT_EQ(d.pool_locations[0].tier, Tier::kDram);
  EXPECT_EQ(d.pool_locations[0].first_block, 2u);
  EXPECT_EQ(d.pool_locations[0].num_blocks, 3u);
  EXPECT_EQ(d.pool_locations[1].holder_id, "p1");
  EXPECT_EQ(d.pool_locations[1].tier, Tier::kNvme);
  EXPECT_EQ(d.pool_locations[1].first_block, 5u);
  EXPECT_EQ(d.pool_locations[1].num_blocks, 3u);
  // The estimate is queue (0) + transfer + prefill of the 12 blocks nobody has.
  const CostModel cost;
  auto spec = GetPreset("llama-3.3-70b");
  const double prefill_rest = cost.PrefillSeconds(*spec, 12 * 16);
  EXPECT_GT(d.estimated_ttft_s, prefill_rest);
  EXPECT_LT(d.estimated_ttft_s, cost.PrefillSeconds(*spec, 18 * 16));
}

TEST_F(RouterCoreTest, TtftAvoidsLongQueueDespiteHit) {
  MakeDefault(PolicyKind::kTtft);
  Worker("w0");
  Worker("w1");
  auto h = Hash(Tokens(16 * 8, 3));
  Store("w0", h, 8);
  core_->Heartbeat("w0", Load(4, 200000), {}, kT0);
  EXPECT_EQ(Route(h).instance_id, "w1");
  core_->Heartbeat("w0", InstanceLoad{}, {}, kT0);
  EXPECT_EQ(Route(h).instance_id, "w0");
}

// The step that prefills a request also decodes a token of every sequence its worker is
// running: w0 holds the whole prompt but runs 64 sequences, more than the 32 tokens a miss
// on idle w1 computes. Before, the estimate had no decode term and w0 looked idle.
TEST_F(RouterCoreTest, TtftCountsTheDecodeOfRunningSequences) {
  const double per_token = CostModel{}.PrefillSeconds(*ResolveModelSpec("llama-3.3-70b"), 1);
  for (double weight : {1.0, 0.0}) {
    RouterOptions o;
    o.models = {"llama-3.3-70b"};
    o.policy = PolicyKind::kTtft;
    o.ttft_decode_weight = weight;
    Make(o);
    seq_.clear();
    Worker("w0");
    Worker("w1");
    auto h = Hash(Tokens(16 * 2, 9));
    Store("w0", h, 2);
    core_->Heartbeat("w0", Load(64, 0), {}, kT0);
    RouteDecision d = Route(h);
    EXPECT_EQ(d.instance_id, weight > 0 ? "w1" : "w0") << "weight " << weight;
    core_->CompleteDecision(d.decision_id);
    core_->Heartbeat("w0", Load(8, 0), {}, kT0);
    core_->Heartbeat("w1", Load(64, 0), {}, kT0);
    d = Route(h);
    EXPECT_EQ(d.instance_id, "w0") << "weight " << weight;
    EXPECT_NEAR(d.estimated_ttft_s, (1 + weight * 8) * per_token, 1e-9) << "weight " << weight;
  }
  RouterOptions bad;
  bad.ttft_decode_weight = -1;
  auto c = RouterCore::Create(bad);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("ttft_decode_weight"), absl::string_view::npos) << c.status();
}

// Applied events keep a source alive like heartbeats: a publisher writing a long dump
// sends no heartbeat meanwhile (one thread does both). Before, it was dropped 10 s after
// its last heartbeat in the middle of the dump, to register and dump again from zero.
TEST_F(RouterCoreTest, AppliedEventsKeepASourceAlive) {
  MakeDefault(PolicyKind::kCacheAware);
  Worker("w0");  // registered (and last heard from) at kT0; timeout 10 s
  auto h = Hash(Tokens(16 * 4, 6));
  for (int s : {4, 8}) {
    EventBatch b;
    b.events.push_back(KvEvent::Stored(++seq_["w0"], s == 4 ? BlockHash{} : h[0],
                                       {h.begin() + (s == 4 ? 0 : 1), h.begin() + (s == 4 ? 1 : 2)}, Tier::kGpu));
    auto r = core_->ApplyEvents("w0", b, kT0 + absl::Seconds(s));
    ASSERT_TRUE(r.ok()) << r.status();
  }
  EXPECT_TRUE(core_->Tick(kT0 + absl::Seconds(15)).empty()) << "dropped 7 s after its last applied batch";
  EXPECT_EQ(core_->Tick(kT0 + absl::Seconds(19)), std::vector<std::string>{"w0"});
}

TEST_F(RouterCoreTest, TtftSloRejectsWithResourceExhausted) {
  RouterOptions o;
  o.models = {"llama-3.3-70b"};
  o.policy = PolicyKind::kTtft;
  o.ttft_slo_s = 0.5;
  Make(o);
  Worker("w0");
  core_->Heartbeat("w0", Load(0, 10'000'000), {}, kT0);
  auto d = core_->Route(In("llama-3.3-70b", Hash(Tokens(64, 4))), kT0);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(d.status().message().find("--ttft-slo"), absl::string_view::npos);
  EXPECT_EQ(core_->load().decisions(), 0u);
}

TEST_F(RouterCoreTest, HybridStrictStopsAtCheckpointReplayPaysTheGap) {
  for (HybridMode mode : {HybridMode::kStrict, HybridMode::kReplay}) {
    RouterOptions o;
    o.models = {"tiny-hybrid"};  // 64-token blocks, checkpoint every 256 tokens = 4 blocks
    o.policy = PolicyKind::kTtft;
    o.hybrid_mode = mode;
    Make(o);
    seq_.clear();
    Worker("w0", "tiny-hybrid");
    auto h = Hash(Tokens(64 * 8, 5), "tiny-hybrid");
    Store("w0", h, 6);
    // No checkpoint yet: strict reuses nothing.
    RouteDecision d = Route(h, kT0, "", "tiny-hybrid");
    EXPECT_EQ(d.gpu_hit_blocks, mode == HybridMode::kStrict ? 0u : 6u) << HybridModeName(mode);
    Store("w0", h, 1, Tier::kGpu, StateKind::kLinearState, 3);  // checkpoint at block 4's boundary
    RouteDecision d2 = Route(h, kT0, "", "tiny-hybrid");
    EXPECT_EQ(d2.gpu_hit_blocks, mode == HybridMode::kStrict ? 4u : 6u) << HybridModeName(mode);
    if (mode == HybridMode::kReplay) {
      EXPECT_LT(d2.estimated_ttft_s, d.estimated_ttft_s);
    }
  }
}

// A pool node's checkpoint at or before the worker's own KV hit is not one the worker
// fetches (it fetches checkpoints among the blocks it fetches), so it does not lengthen
// the hit: w0 holds KV blocks 0..9 and its own checkpoint at 4, the pool one at 8; the
// strict hit is 4 blocks (it read 8 before, with no transfer).
TEST_F(RouterCoreTest, HybridStrictHitIgnoresAPoolCheckpointInsideTheGpuRun) {
  RouterOptions o;
  o.models = {"tiny-hybrid"};  // 64-token blocks, a checkpoint every 4 blocks
  o.policy = PolicyKind::kTtft;
  o.hybrid_mode = HybridMode::kStrict;
  Make(o);
  Worker("w0", "tiny-hybrid");
  PoolNode("p0");
  auto h = Hash(Tokens(64 * 12, 7), "tiny-hybrid");
  Store("w0", h, 10);
  Store("w0", h, 1, Tier::kGpu, StateKind::kLinearState, 3);  // its checkpoint at block 4
  Store("p0", h, 1, Tier::kDram, StateKind::kLinearState, 7);  // the pool's at block 8
  RouteDecision d = Route(h, kT0, "", "tiny-hybrid");
  EXPECT_EQ(d.gpu_hit_blocks, 4u);
  EXPECT_EQ(d.pool_hit_blocks, 0u);
}

// Strict mode when the pool's blocks are not worth fetching: the checkpoint that made
// the KV hit usable was the pool's, so without the fetch the GPU run alone (2 blocks, no
// checkpoint at or below it) is no hit at all.
TEST_F(RouterCoreTest, HybridStrictHitEndsAtACheckpointEvenWithoutTheFetch) {
  RouterOptions o;
  o.models = {"tiny-hybrid"};  // 64-token blocks, a checkpoint every 4 blocks
  o.policy = PolicyKind::kTtft;
  o.hybrid_mode = HybridMode::kStrict;
  o.pool_dram_bandwidth = 1e3;  // 1 KB/s: fetching always loses to recomputing
  Make(o);
  Worker("w0", "tiny-hybrid");
  PoolNode("p0");
  auto h = Hash(Tokens(64 * 8, 5), "tiny-hybrid");
  Store("w0", h, 2);
  Store("p0", h, 8, Tier::kDram);
  Store("p0", h, 1, Tier::kDram, StateKind::kLinearState, 3);  // the pool's checkpoint at block 4
  RouteDecision d = Route(h, kT0, "", "tiny-hybrid");
  EXPECT_EQ(d.pool_hit_blocks, 0u);
  EXPECT_EQ(d.gpu_hit_blocks, 0u);
  // With its own checkpoint at block 4 (and its KV up to there) the worker has a hit.
  Store("w0", h, 4);
  Store("w0", h, 1, Tier::kGpu, StateKind::kLinearState, 3);
  d = Route(h, kT0, "", "tiny-hybrid");
  EXPECT_EQ(d.gpu_hit_blocks, 4u);
  EXPECT_EQ(d.pool_hit_blocks, 0u);
}

// One shared system prompt, 8 instances that publish what they cache: cache_aware must
// not herd. Completions arrive at random, as from real workers.
double MaxOverMeanAfterHerd(RouterCore& core, std::mt19937_64& rng, bool check, int* violations) {
  std::vector<std::string> ids;
  for (int i = 0; i < 8; ++i) ids.push_back("w" + std::to_string(i));
  auto m = core.FindModel("llama-3.3-70b", 0);
  std::vector<TokenId> prompt = Tokens(16 * 32, 99);  // shared prefix: 32 blocks
  std::map<std::string, uint64_t> seq;
  std::vector<uint64_t> inflight;
  double worst = 0;
  for (int r = 0; r < 2000; ++r) {
    std::vector<TokenId> tokens = prompt;
    for (int i = 0; i < 64; ++i) tokens.push_back(1'000'000 + r * 64 + i);  // unique 4-block suffix
    const auto h = core.HashTokens(**m, tokens, "", {});
    auto d = core.Route(In("llama-3.3-70b", h), kT0);
    if (!d.ok()) return -1;
    inflight.push_back(d->decision_id);
    EventBatch b;
    b.events.push_back(KvEvent::Stored(++seq[d->instance_id], {}, h));
    if (!core.ApplyEvents(d->instance_id, b, kT0).ok()) return -1;
    // Each step about one request completes (a random one), so load hovers ~ 30.
    if (inflight.size() > 30 || (std::uniform_int_distribution<int>(0, 1)(rng) == 0 && !inflight.empty())) {
      const size_t k = std::uniform_int_distribution<size_t>(0, inflight.size() - 1)(rng);
      core.CompleteDecision(inflight[k]);
      inflight.erase(inflight.begin() + static_cast<ptrdiff_t>(k));
    }
    double sum = 0, mx = 0;
    for (const auto& id : ids) {
      const double l = core.load().Requests(static_cast<SourceSlot>(core.SlotOf(id)));
      sum += l;
      mx = std::max(mx, l);
    }
    const double mean = sum / 8;
    if (mean >= 2) {
      worst = std::max(worst, mx / mean);
      if (check && mx > 1.5 * mean) ++*violations;
    }
  }
  return worst;
}

TEST_F(RouterCoreTest, CacheAwareDoesNotHerdOnSharedPrefix) {
  MakeDefault(PolicyKind::kCacheAware);
  for (int i = 0; i < 8; ++i) Worker("w" + std::to_string(i));
  std::mt19937_64 rng(5);
  int violations = 0;
  const double worst = MaxOverMeanAfterHerd(*core_, rng, true, &violations);
  EXPECT_EQ(violations, 0) << "max/mean load reached " << worst;
  EXPECT_LE(worst, 1.5);
  EXPECT_GT(worst, 0);
  // Every instance served some of the traffic.
  for (int i = 0; i < 8; ++i) {
    EXPECT_GT(core_->index().source_entries(static_cast<SourceSlot>(core_->SlotOf("w" + std::to_string(i)))), 0u);
  }
}

TEST_F(RouterCoreTest, WithoutGuardsTheSameWorkloadHerds) {
  // The control for the test above: overlap only, no load term, no cap.
  RouterOptions o;
  o.models = {"llama-3.3-70b"};
  o.policy = PolicyKind::kCacheAware;
  o.policy_params.load_weight = 0;
  o.policy_params.balance_rel = 1e9;
  Make(o);
  for (int i = 0; i < 8; ++i) Worker("w" + std::to_string(i));
  std::mt19937_64 rng(5);
  int violations = 0;
  EXPECT_GT(MaxOverMeanAfterHerd(*core_, rng, false, &violations), 1.5);
}

TEST_F(RouterCoreTest, DeadInstanceIsDroppedWithItsEntries) {
  MakeDefault(PolicyKind::kCacheAware);
  Worker("w0");
  Worker("w1");
  auto h = Hash(Tokens(16 * 4, 6));
  Store("w0", h, 4);
  EXPECT_EQ(core_->index().entries(), 4u);
  core_->Heartbeat("w1", {}, {}, kT0 + absl::Seconds(8));
  EXPECT_TRUE(core_->Tick(kT0 + absl::Seconds(9)).empty());
  const auto dropped = core_->Tick(kT0 + absl::Seconds(11));
  ASSERT_EQ(dropped.size(), 1u);
  EXPECT_EQ(dropped[0], "w0");
  EXPECT_EQ(core_->index().entries(), 0u);
  EXPECT_EQ(core_->SlotOf("w0"), -1);
  EXPECT_EQ(Route(h, kT0 + absl::Seconds(11)).instance_id, "w1");
  EXPECT_TRUE(core_->Heartbeat("w0", {}, {}, kT0 + absl::Seconds(12)).unknown_source);
  // Its slot is reused by the next registration without inheriting anything.
  Worker("w2", "llama-3.3-70b", true, kT0 + absl::Seconds(12));
  EXPECT_EQ(core_->index().source_entries(static_cast<SourceSlot>(core_->SlotOf("w2"))), 0u);
  EXPECT_EQ(core_->Stats(kT0 + absl::Seconds(12)).dropped_sources, 1u);
}

TEST_F(RouterCoreTest, ApproximateModePredictsFromDecisionsUntilTtl) {
  RouterOptions o;
  o.models = {"llama-3.3-70b"};
  o.policy = PolicyKind::kCacheAware;
  o.approx_ttl = absl::Seconds(5);
  Make(o);
  Worker("a0", "llama-3.3-70b", /*events=*/false);
  Worker("w1");
  auto h = Hash(Tokens(16 * 6, 7));
  // w1 reports a queue so the first decision goes to a0 (ties are broken at random).
  core_->Heartbeat("w1", Load(0, 100000), {}, kT0);
  RouteDecision first = Route(h);
  EXPECT_EQ(first.instance_id, "a0");
  EXPECT_EQ(first.gpu_hit_blocks, 0u);
  core_->CompleteDecision(first.decision_id);
  RouteDecision second = Route(h, kT0 + absl::Seconds(3));
  EXPECT_EQ(second.instance_id, "a0");
  EXPECT_EQ(second.gpu_hit_blocks, 6u);  // predicted from the first decision
  core_->CompleteDecision(second.decision_id);
  // The second decision refreshed the TTL to t0+8s.
  for (int s : {4, 6, 9}) {
    core_->Heartbeat("a0", {}, {}, kT0 + absl::Seconds(s));
    core_->Heartbeat("w1", {}, {}, kT0 + absl::Seconds(s));
    core_->Tick(kT0 + absl::Seconds(s));
    const uint64_t held = core_->index().source_entries(static_cast<SourceSlot>(core_->SlotOf("a0")));
    EXPECT_EQ(held, s < 8 ? 6u : 0u) << "at t0+" << s << "s";
  }
  EXPECT_EQ(core_->index().entries(), 0u);
}

// An approximate-mode hybrid worker is predicted to hold the KDA checkpoints of what it
// was routed, with the blocks they sit at: a strict router saw no hit on it before (no
// checkpoint was ever predicted), a replay router priced the whole hit as KDA replay.
TEST_F(RouterCoreTest, ApproximateModePredictsHybridCheckpoints) {
  for (HybridMode mode : {HybridMode::kStrict, HybridMode::kReplay}) {
    RouterOptions o;
    o.models = {"tiny-hybrid"};  // 64-token blocks, a checkpoint every 4 blocks
    o.policy = PolicyKind::kCacheAware;
    o.hybrid_mode = mode;
    o.approx_ttl = absl::Seconds(5);
    Make(o);
    Worker("a0", "tiny-hybrid", /*events=*/false);
    auto h = Hash(Tokens(64 * 10, 3), "tiny-hybrid");  // 10 blocks: checkpoints at 4 and 8
    RouteDecision first = Route(h, kT0, "", "tiny-hybrid");
    core_->CompleteDecision(first.decision_id);
    const SourceSlot a0 = static_cast<SourceSlot>(core_->SlotOf("a0"));
    EXPECT_TRUE(core_->index().HasState(h[3], a0)) << HybridModeName(mode);
    EXPECT_TRUE(core_->index().HasState(h[7], a0)) << HybridModeName(mode);
    EXPECT_FALSE(core_->index().HasState(h[5], a0)) << HybridModeName(mode);
    RouteDecision second = Route(h, kT0 + absl::Seconds(1), "", "tiny-hybrid");
    EXPECT_EQ(second.gpu_hit_blocks, mode == HybridMode::kStrict ? 8u : 10u) << HybridModeName(mode);
    core_->CompleteDecision(second.decision_id);
    // The checkpoints expire with their blocks.
    core_->Heartbeat("a0", {}, {}, kT0 + absl::Seconds(7));
    core_->Tick(kT0 + absl::Seconds(7));
    EXPECT_FALSE(core_->index().HasState(h[7], a0)) << HybridModeName(mode);
    EXPECT_EQ(core_->index().entries(), 0u) << HybridModeName(mode);
  }
}

// Routing one prompt again and again refreshes its predictions: the expiry queue is
// rebuilt rather than grow by the prompt's length per decision until the TTL; a worker
// that gave no capacity gets the index's bound on its predictions.
// A source registered with publishes_events=false (its blocks are predicted from its
// routes) may not publish: its events would add to and remove from the predictions.
// Before, they were applied.
TEST_F(RouterCoreTest, ApproximateModeSourceMayNotPublish) {
  MakeDefault(PolicyKind::kCacheAware);
  Worker("a0", "llama-3.3-70b", /*events=*/false);
  auto h = Hash(Tokens(16 * 3, 9));
  EventBatch b;
  b.events.push_back(KvEvent::Stored(1, {}, h));
  auto r = core_->ApplyEvents("a0", b, kT0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("publishes_events=false"), std::string::npos) << r.status();
  EXPECT_EQ(Route(h).gpu_hit_blocks, 0u);
}

TEST_F(RouterCoreTest, ApproximateModeRepeatsDoNotGrowItsQueue) {
  MakeApprox(64);
  Worker("a0", "llama-3.3-70b", /*events=*/false);
  const auto h = Hash(Tokens(16 * 40, 9));  // 40 blocks
  for (int i = 0; i < 1000; ++i) {
    RouteDecision d = Route(h, kT0 + absl::Milliseconds(i));
    core_->CompleteDecision(d.decision_id);
  }
  auto [live, queued] = core_->ApproxSizes("a0");
  EXPECT_EQ(live, 40u);
  EXPECT_LE(queued, 2 * 40u + 1024 + 40);  // was 40 per decision: 40000
  // 100 prompts of 40 other blocks each: at most max_index_entries predictions stay.
  for (uint32_t p = 0; p < 100; ++p) {
    RouteDecision d = Route(Hash(Tokens(16 * 40, 100 + p)), kT0 + absl::Seconds(2));
    core_->CompleteDecision(d.decision_id);
  }
  EXPECT_LE(core_->ApproxSizes("a0").first, 64u);
}

// A worker's capacity_blocks above the index's bound counts as that bound: before, 2^64 - 1
// let its predictions grow without bound (here past max_index_entries).
TEST_F(RouterCoreTest, ApproximateModeCapacityIsBoundedByTheIndex) {
  MakeApprox(64);
  SourceInfo a0 = Info("a0", SourceKind::kWorker, "llama-3.3-70b", /*events=*/false);
  a0.capacity_blocks = UINT64_MAX;
  ASSERT_TRUE(core_->Register(a0, kT0).ok());
  for (uint32_t p = 0; p < 10; ++p) {
    RouteDecision d = Route(Hash(Tokens(16 * 40, 300 + p)), kT0 + absl::Seconds(p));
    core_->CompleteDecision(d.decision_id);
  }
  EXPECT_LE(core_->ApproxSizes("a0").first, 64u);
}

// A prediction larger than the worker's capacity keeps its head: the blocks dropped to
// fit are its tail (dropping the head first left blocks no prefix could match).
TEST_F(RouterCoreTest, ApproximateModeOverCapacityKeepsThePrefix) {
  MakeApprox();
  SourceInfo a0 = Info("a0", SourceKind::kWorker, "llama-3.3-70b", /*events=*/false);
  a0.capacity_blocks = 2;
  ASSERT_TRUE(core_->Register(a0, kT0).ok());
  const auto h = Hash(Tokens(16 * 4, 11));  // 4 blocks
  RouteDecision first = Route(h);
  core_->CompleteDecision(first.decision_id);
  EXPECT_EQ(core_->ApproxSizes("a0").first, 2u);
  RouteDecision second = Route(h, kT0 + absl::Seconds(1));
  EXPECT_EQ(second.gpu_hit_blocks, 2u);  // was 0: the last two blocks were kept
}

// A fully cached prompt still costs its worker the last token's prefill, so each
// decision counts as queued work there: before, it added 0 tokens and the ttft policy
// sent every such request to the holder until its next heartbeat.
TEST_F(RouterCoreTest, AFullyCachedPromptStillCountsAsQueuedWork) {
  MakeDefault(PolicyKind::kTtft);
  Worker("w0");
  auto h = Hash(Tokens(16 * 4, 9));
  Store("w0", h, 4);
  const SourceSlot w0 = static_cast<SourceSlot>(core_->SlotOf("w0"));
  RouteDecision a = Route(h);
  EXPECT_EQ(a.instance_id, "w0");
  EXPECT_EQ(core_->load().QueuedTokens(w0), 1u);
  EXPECT_GT(a.estimated_ttft_s, 0.0);
  RouteDecision b = Route(h);
  EXPECT_EQ(core_->load().QueuedTokens(w0), 2u);
  EXPECT_GT(b.estimated_ttft_s, a.estimated_ttft_s) << "the first decision's work did not count";
}

// Sources that time out together leave together (their entries in one pass over the
// index); the one that kept heartbeating keeps its entries and its hits.
TEST_F(RouterCoreTest, SourcesThatTimeOutTogetherAreDroppedInOneTick) {
  MakeDefault(PolicyKind::kCacheAware);
  for (const char* w : {"w0", "w1", "w2"}) Worker(w);
  PoolNode("p0");
  auto h = Hash(Tokens(16 * 6, 12));
  Store("w0", h, 6);
  Store("w1", h, 4);
  Store("w2", h, 2);
  Store("p0", h, 6, Tier::kDram);
  core_->Heartbeat("w2", {}, {}, kT0 + absl::Seconds(8));
  auto dropped = core_->Tick(kT0 + absl::Seconds(11));
  std::sort(dropped.begin(), dropped.end());
  EXPECT_EQ(dropped, (std::vector<std::string>{"p0", "w0", "w1"}));
  EXPECT_EQ(core_->index().entries(), 2u);
  const RouteDecision d = Route(h, kT0 + absl::Seconds(11));
  EXPECT_EQ(d.instance_id, "w2");
  EXPECT_EQ(d.gpu_hit_blocks, 2u);
  EXPECT_EQ(d.pool_hit_blocks, 0u);
}

TEST_F(RouterCoreTest, DecisionsReleaseOnCompletionOrTimeout) {
  MakeDefault(PolicyKind::kLeastLoad);
  Worker("w0");
  auto h = Hash(Tokens(32, 8));
  RouteDecision a = Route(h);
  RouteDecision b = Route(h, kT0 + absl::Seconds(1));
  const SourceSlot w0 = static_cast<SourceSlot>(core_->SlotOf("w0"));
  EXPECT_EQ(core_->load().Inflight(w0), 2u);
  EXPECT_EQ(core_->load().QueuedTokens(w0), 64u);
  const uint64_t done[] = {a.decision_id};
  core_->Heartbeat("w0", {}, done, kT0 + absl::Seconds(2));
  EXPECT_EQ(core_->load().Inflight(w0), 1u);
  core_->Heartbeat("w0", {}, {}, kT0 + absl::Seconds(31));
  core_->Tick(kT0 + absl::Seconds(31));  // b was decided at t0+1s; timeout 30 s
  EXPECT_EQ(core_->load().Inflight(w0), 0u);
  EXPECT_FALSE(core_->CompleteDecision(b.decision_id));
}

// Decision ids reach workers through clients: a heartbeat of one worker must not
// release a decision made for another (its optimistic load guards against herding).
TEST_F(RouterCoreTest, HeartbeatReleasesOnlyItsOwnDecisions) {
  MakeDefault(PolicyKind::kLeastLoad);
  Worker("w0");
  Worker("w1");
  RouteDecision d = Route(Hash(Tokens(32, 9)), kT0, "round_robin");
  const std::string other = d.instance_id == "w0" ? "w1" : "w0";
  ASSERT_EQ(core_->load().Inflight(d.slot), 1u);
  const uint64_t ids[] = {d.decision_id};
  core_->Heartbeat(other, {}, ids, kT0);
  EXPECT_EQ(core_->load().Inflight(d.slot), 1u) << other << " released a decision made for " << d.instance_id;
  core_->Heartbeat(d.instance_id, {}, ids, kT0);
  EXPECT_EQ(core_->load().Inflight(d.slot), 0u);
}

// prompt_tokens is summed per worker: a huge one is refused rather than wrap the sum.
TEST_F(RouterCoreTest, HugePromptIsRefusedNamingTheField) {
  MakeDefault(PolicyKind::kTtft);
  Worker("w0");
  RouteInput in;
  in.model = "llama-3.3-70b";
  in.prompt_tokens = uint64_t{1} << 63;
  auto d = core_->Route(in, kT0);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(d.status().message()).find("prompt_tokens=9223372036854775808 exceeds"),
            std::string::npos)
      << d.status();
}

TEST_F(RouterCoreTest, GapInEventsRequestsDumpThroughHeartbeat) {
  MakeDefault(PolicyKind::kCacheAware);
  Worker("w0");
  auto h = Hash(Tokens(16 * 3, 9));
  EventBatch b;
  b.events.push_back(KvEvent::Stored(2, {}, {h[0]}));
  auto r = core_->ApplyEvents("w0", b, kT0);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->full_dump_requested);
  EXPECT_TRUE(core_->Heartbeat("w0", {}, {}, kT0).full_dump_requested);
  EXPECT_EQ(core_->Stats(kT0).full_dumps_requested, 1u);
  EventBatch dump;
  dump.full_dump = true;
  dump.dump_sequence = 2;
  dump.events.push_back(KvEvent::Stored(1, {}, h));
  ASSERT_TRUE(core_->ApplyEvents("w0", dump, kT0).ok());
  EXPECT_FALSE(core_->Heartbeat("w0", {}, {}, kT0).full_dump_requested);
  EXPECT_EQ(Route(h).gpu_hit_blocks, 3u);
}

// A stale source is asked for a full dump by one heartbeat, and again only
// heartbeat_timeout later while none has landed: the publisher writes the dump before its
// next heartbeat, and the dump may wait behind other batches to be applied. Before, every
// heartbeat in that wait asked again, and each ask queued another whole dump (a backlog
// that fed itself). Once a dump's first part applied, the next gap is asked about at once.
TEST_F(RouterCoreTest, StaleSourceIsAskedForOneDumpPerHeartbeatTimeout) {
  RouterOptions o;
  o.models = {"llama-3.3-70b"};
  o.policy = PolicyKind::kCacheAware;
  o.heartbeat_interval = absl::Seconds(1);
  o.heartbeat_timeout = absl::Seconds(10);
  Make(o);
  Worker("w0");
  const auto h = Hash(Tokens(16 * 3, 31));
  EventBatch gap;
  gap.events.push_back(KvEvent::Stored(2, {}, {h[0]}));
  ASSERT_TRUE(core_->ApplyEvents("w0", gap, kT0).ok());
  EXPECT_TRUE(core_->Heartbeat("w0", {}, {}, kT0).full_dump_requested);
  for (int s = 1; s < 10; ++s) {
    EXPECT_FALSE(core_->Heartbeat("w0", {}, {}, kT0 + absl::Seconds(s)).full_dump_requested) << "at +" << s << " s";
  }
  EXPECT_TRUE(core_->Stats(kT0 + absl::Seconds(9)).sources.at(0).stale);
  // No dump within heartbeat_timeout (the answer may have been lost): asked again.
  EXPECT_TRUE(core_->Heartbeat("w0", {}, {}, kT0 + absl::Seconds(10)).full_dump_requested);
  EXPECT_FALSE(core_->Heartbeat("w0", {}, {}, kT0 + absl::Seconds(11)).full_dump_requested);

  EventBatch dump;
  dump.full_dump = true;
  dump.dump_sequence = 2;
  dump.events.push_back(KvEvent::Stored(1, {}, {h[0]}));
  ASSERT_TRUE(core_->ApplyEvents("w0", dump, kT0 + absl::Seconds(12)).ok());
  EXPECT_FALSE(core_->Heartbeat("w0", {}, {}, kT0 + absl::Seconds(12)).full_dump_requested);
  EventBatch gap2;  // sequence 3 is missing
  gap2.events.push_back(KvEvent::Stored(4, {}, {h[1]}));
  ASSERT_TRUE(core_->ApplyEvents("w0", gap2, kT0 + absl::Seconds(13)).ok());
  EXPECT_TRUE(core_->Heartbeat("w0", {}, {}, kT0 + absl::Seconds(13)).full_dump_requested);
}

// A broken event stream (RouterHost reports it) may have lost events with no later
// sequence number to show the gap: the source's current registration turns stale, keeps
// its entries, and its heartbeats ask for a dump (once per heartbeat_timeout) until one
// lands. An older registration's
// stream, an unknown source and an approximate-mode source change nothing.
TEST_F(RouterCoreTest, LostStreamRequestsADumpOfTheCurrentRegistrationOnly) {
  MakeDefault(PolicyKind::kCacheAware);
  Worker("w0");
  Worker("a0", "llama-3.3-70b", /*events=*/false);
  const auto h = Hash(Tokens(16 * 3, 21));
  Store("w0", h, 3);
  const uint64_t old_reg = core_->FindRegistration("w0")->id;
  Worker("w0");  // a new incarnation: its view starts empty, its stream is another
  seq_["w0"] = 0;
  Store("w0", h, 3);
  const uint64_t reg = core_->FindRegistration("w0")->id;
  ASSERT_NE(reg, old_reg);

  EXPECT_FALSE(core_->StreamLost("w0", old_reg));
  EXPECT_FALSE(core_->StreamLost("nobody", reg));
  EXPECT_FALSE(core_->StreamLost("a0", core_->FindRegistration("a0")->id));
  EXPECT_FALSE(core_->Heartbeat("w0", {}, {}, kT0).full_dump_requested);
  EXPECT_FALSE(core_->Heartbeat("a0", {}, {}, kT0).full_dump_requested);
  EXPECT_EQ(core_->Stats(kT0).full_dumps_requested, 0u);

  EXPECT_TRUE(core_->StreamLost("w0", reg));
  EXPECT_FALSE(core_->StreamLost("w0", reg));  // already waiting for a dump
  EXPECT_TRUE(core_->Heartbeat("w0", {}, {}, kT0).full_dump_requested);
  EXPECT_EQ(core_->Stats(kT0).full_dumps_requested, 1u);
  const auto w0 = static_cast<SourceSlot>(core_->SlotOf("w0"));
  EXPECT_EQ(core_->index().source_entries(w0), 3u);  // entries stay until the dump

  EventBatch dump;
  dump.full_dump = true;
  dump.dump_sequence = 1;
  dump.events.push_back(KvEvent::Stored(1, {}, {h[0]}));
  ASSERT_TRUE(core_->ApplyEvents("w0", dump, kT0).ok());
  EXPECT_FALSE(core_->Heartbeat("w0", {}, {}, kT0).full_dump_requested);
  EXPECT_EQ(core_->index().source_entries(w0), 1u);
}

// RouterHost applies a large dump in parts, releasing its lock in between: the first part
// ends the wait for a dump (no heartbeat asks for another), the last sets the sequence.
TEST_F(RouterCoreTest, DumpInPartsEndsTheWaitFirstAndSetsTheSequenceLast) {
  MakeDefault(PolicyKind::kCacheAware);
  Worker("w0");
  PoolNode("p0");
  auto h = Hash(Tokens(16 * 6, 12));
  EventBatch gap;
  gap.events.push_back(KvEvent::Stored(2, {}, {h[0]}));
  ASSERT_TRUE(core_->ApplyEvents("w0", gap, kT0).ok());
  ASSERT_TRUE(core_->Heartbeat("w0", {}, {}, kT0).full_dump_requested);
  EventBatch dump;
  dump.full_dump = true;
  for (size_t i = 0; i < h.size(); ++i) {
    dump.events.push_back(KvEvent::Stored(i + 1, i ? h[i - 1] : BlockHash{}, {h[i]}));
  }
  const SourceSlot w0 = static_cast<SourceSlot>(core_->SlotOf("w0"));

  ASSERT_TRUE(core_->ValidateBatch("w0", dump).ok());  // what the caller does first
  auto first = core_->ApplyPart("w0", dump, 0, 2, kT0);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->apply.applied, 2u);
  EXPECT_FALSE(first->full_dump_requested);
  EXPECT_FALSE(core_->Heartbeat("w0", {}, {}, kT0).full_dump_requested);
  EXPECT_EQ(Route(h).gpu_hit_blocks, 2u);
  EXPECT_EQ(core_->index().last_sequence(w0), 0u);

  auto backwards = core_->ApplyPart("w0", dump, 4, 2, kT0);
  EXPECT_EQ(backwards.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(backwards.status().message().find("events [4, 2) of a batch of 6 events"), absl::string_view::npos)
      << backwards.status();
  EXPECT_EQ(core_->ApplyPart("w0", dump, 2, 7, kT0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->ApplyPart("ghost", dump, 2, 4, kT0).status().code(), absl::StatusCode::kNotFound);
  auto rest = core_->ApplyPart("w0", dump, 2, h.size(), kT0);
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(rest->apply.applied, 4u);
  EXPECT_EQ(rest->apply.last_sequence, 6u);
  EXPECT_EQ(Route(h).gpu_hit_blocks, 6u);
  EXPECT_EQ(core_->Stats(kT0).events_applied, 6u);  // the gap batch applied nothing

  // Parts are not validated (the caller validated the whole batch first, off its lock):
  // the whole-batch check names the bad event by its place in the batch.
  EventBatch pool_dump = dump;
  for (KvEvent& e : pool_dump.events) e.tier = Tier::kDram;
  pool_dump.events[3].tier = Tier::kGpu;
  const absl::Status bad = core_->ValidateBatch("p0", pool_dump);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("events[3].stored.tier=GPU"), absl::string_view::npos) << bad;
}

// A batch that is not a dump applies in parts as in one call: sequence order across the
// parts, duplicates skipped, and a gap in one part ignores the rest of the batch.
TEST_F(RouterCoreTest, BatchInPartsEndsLikeTheBatchInOneCall) {
  MakeDefault(PolicyKind::kCacheAware);
  Worker("w0");
  Worker("w1");
  auto h = Hash(Tokens(16 * 8, 13));
  EventBatch b;
  for (uint64_t seq : {1, 2, 2, 3, 4, 6, 7, 8}) {  // 2 twice; 5 missing
    b.events.push_back(KvEvent::Stored(seq, seq > 1 ? h[seq - 2] : BlockHash{}, {h[seq - 1]}));
  }
  auto whole = core_->ApplyEvents("w1", b, kT0);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EventsResult sum;
  for (size_t begin = 0; begin < b.events.size(); begin += 3) {
    auto r = core_->ApplyPart("w0", b, begin, std::min(b.events.size(), begin + 3), kT0);
    ASSERT_TRUE(r.ok()) << r.status();
    sum.apply.applied += r->apply.applied;
    sum.apply.duplicates += r->apply.duplicates;
    sum.apply.ignored += r->apply.ignored;
    sum.apply.gap |= r->apply.gap;
    sum.full_dump_requested = r->full_dump_requested;
  }
  EXPECT_EQ(sum.apply.applied, whole->apply.applied);
  EXPECT_EQ(sum.apply.applied, 4u);
  EXPECT_EQ(sum.apply.duplicates, 1u);
  EXPECT_EQ(sum.apply.ignored, whole->apply.ignored);
  EXPECT_EQ(sum.apply.ignored, 3u);
  EXPECT_TRUE(sum.apply.gap);
  EXPECT_TRUE(sum.full_dump_requested);
  const auto w0 = static_cast<SourceSlot>(core_->SlotOf("w0"));
  const auto w1 = static_cast<SourceSlot>(core_->SlotOf("w1"));
  EXPECT_EQ(core_->index().last_sequence(w0), 4u);
  EXPECT_EQ(core_->index().source_entries(w0), core_->index().source_entries(w1));
  EXPECT_TRUE(core_->index().stale(w0));
  EXPECT_EQ(core_->Stats(kT0).full_dumps_requested, 2u);  // one gap per source
}

TEST_F(RouterCoreTest, BadInputIsRejectedNamingTheField) {
  MakeDefault(PolicyKind::kCacheAware, {"llama-3.3-70b", "deepseek-v3"});
  auto h = Hash(Tokens(32, 10));
  auto unavailable = core_->Route(In("llama-3.3-70b", h), kT0);
  EXPECT_EQ(unavailable.status().code(), absl::StatusCode::kUnavailable);
  Worker("w0");
  PoolNode("p0");

  auto unknown = core_->Route(In("gpt-5", h), kT0);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("model.name=\"gpt-5\""), absl::string_view::npos);
  RouteInput bad_bs = In("llama-3.3-70b", h);
  bad_bs.block_tokens = 64;
  auto bs = core_->Route(bad_bs, kT0);
  EXPECT_EQ(bs.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bs.status().message().find("model.block_tokens=64"), absl::string_view::npos);
  auto empty = core_->Route(In("llama-3.3-70b", {}), kT0);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  RouteInput short_in = In("llama-3.3-70b", h);
  short_in.prompt_tokens = 5;
  auto short_prompt = core_->Route(short_in, kT0);
  EXPECT_NE(short_prompt.status().message().find("prompt_tokens=5"), absl::string_view::npos);
  RouteInput bad_policy = In("llama-3.3-70b", h);
  bad_policy.policy = "best";
  auto policy = core_->Route(bad_policy, kT0);
  EXPECT_NE(policy.status().message().find("policy=\"best\""), absl::string_view::npos);
  auto no_workers = core_->Route(In("deepseek-v3", h), kT0);
  EXPECT_EQ(no_workers.status().code(), absl::StatusCode::kUnavailable);

  EventBatch b;
  b.events.push_back(KvEvent::Stored(1, {}, {h[0]}));
  auto unreg = core_->ApplyEvents("ghost", b, kT0);
  EXPECT_EQ(unreg.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unreg.status().message().find("source_id=\"ghost\""), absl::string_view::npos);
  auto gpu_on_pool = core_->ApplyEvents("p0", b, kT0);
  EXPECT_EQ(gpu_on_pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(gpu_on_pool.status().message().find("events[0].stored.tier"), absl::string_view::npos);
  EventBatch empty_event;
  empty_event.events.push_back(KvEvent::Removed(1, {}));
  EXPECT_NE(core_->ApplyEvents("w0", empty_event, kT0).status().message().find("events[0].removed.block_hashes"),
            absl::string_view::npos);
  EventBatch cycle;
  cycle.events.push_back(KvEvent::Stored(1, h[1], {h[0], h[1]}));
  EXPECT_NE(core_->ApplyEvents("w0", cycle, kT0).status().message().find("events[0].stored.parent_hash"),
            absl::string_view::npos);
  EXPECT_EQ(core_->Register(Info("bad id!", SourceKind::kWorker, "llama-3.3-70b"), kT0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->Register(Info("w9", SourceKind::kWorker, "nope"), kT0).code(), absl::StatusCode::kInvalidArgument);
  // The router still serves the good ones.
  EXPECT_EQ(Route(h).instance_id, "w0");
}

// Registered sources are bounded (max_sources): a new id beyond it is refused
// RESOURCE_EXHAUSTED; an id already registered may register again, and a source that
// leaves makes room.
TEST_F(RouterCoreTest, RegisteredSourcesAreBounded) {
  RouterOptions o;
  o.models = {"llama-3.3-70b"};
  o.max_sources = 2;
  Make(o);
  Worker("w0");
  PoolNode("p0");
  const absl::Status over = core_->Register(Info("w1", SourceKind::kWorker, "llama-3.3-70b", true), kT0);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_NE(over.message().find("max_sources"), absl::string_view::npos) << over;
  Worker("w0");  // again: not a new source
  ASSERT_TRUE(core_->Deregister("p0").ok());
  Worker("w1");
}

TEST_F(RouterCoreTest, ReRegisterResetsEntriesAndSequence) {
  MakeDefault(PolicyKind::kCacheAware);
  Worker("w0");
  auto h = Hash(Tokens(32, 11));
  Store("w0", h, 2);
  const auto before = core_->FindRegistration("w0");
  Worker("w0");
  EXPECT_EQ(core_->index().entries(), 0u);
  EXPECT_EQ(core_->index().last_sequence(static_cast<SourceSlot>(core_->SlotOf("w0"))), 0u);
  // Same slot, new registration: work queued for the old one can tell.
  const auto after = core_->FindRegistration("w0");
  ASSERT_TRUE(before.ok() && after.ok());
  EXPECT_NE(after->id, before->id);
  EXPECT_EQ(core_->FindRegistration("w1").status().code(), absl::StatusCode::kNotFound);
}

// A router that restarts numbers its registrations afresh: a number a source got from
// the previous process (kept by a late Unregister) must not name its new registration.
TEST_F(RouterCoreTest, RegistrationNumbersOfTwoRouterProcessesDiffer) {
  MakeDefault(PolicyKind::kCacheAware);
  Worker("w0");
  const auto first = core_->FindRegistration("w0");
  MakeDefault(PolicyKind::kCacheAware);  // the same options: a restarted router
  Worker("w0");
  const auto second = core_->FindRegistration("w0");
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_NE(first->id, second->id);
  EXPECT_GE(first->id, uint64_t{1} << 40);
}

TEST(RouterCoreCreateTest, RejectsUnknownModelsAndBadOptions) {
  RouterOptions o;
  o.models = {"nope"};
  EXPECT_EQ(RouterCore::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.models = {"deepseek-v3"};
  o.block_tokens = 48;  // fine for MLA? checkpoint-free, so yes
  EXPECT_TRUE(RouterCore::Create(o).ok());
  o.models = {"tiny-hybrid"};
  o.block_tokens = 100;  // 256-token checkpoints are not a multiple of 100
  EXPECT_EQ(RouterCore::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.models = {};
  EXPECT_FALSE(RouterCore::Create(o).ok());
}

}  // namespace
}  // namespace kvpool::router
