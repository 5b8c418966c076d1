// kvpool::sim: the pool tier, simulator determinism, accounting invariants, and the
// policy ordering on a small generated trace.
#include "kvpool/router/sim.h"

#include <random>

#include <gtest/gtest.h>

#include "kvpool/router/sim_pool.h"

namespace kvpool::sim {
namespace {

BlockHash H(uint64_t i) { return BlockHash{i, 0x5eed}; }

// ---- PoolTier ----------------------------------------------------------------------------

TEST(PoolTier, StoresChainsAndReportsEvents) {
  PoolTier pool(8);
  uint64_t seq = 1;
  std::vector<router::KvEvent> ev;
  const std::vector<BlockHash> a = {H(1), H(2), H(3)};
  pool.Put(a, &seq, &ev);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].type, router::KvEvent::Type::kStored);
  EXPECT_EQ(ev[0].sequence, 1u);
  EXPECT_TRUE(ev[0].parent.IsZero());
  EXPECT_EQ(ev[0].hashes, a);
  EXPECT_EQ(ev[0].tier, router::Tier::kDram);
  EXPECT_EQ(pool.RunFrom(a, 0, 10), 3u);
  EXPECT_EQ(pool.RunFrom(a, 1, 10), 2u);
  EXPECT_EQ(pool.RunFrom(a, 0, 2), 2u);

  // Extending the chain stores only the new tail, with its parent.
  ev.clear();
  const std::vector<BlockHash> b = {H(1), H(2), H(3), H(4)};
  pool.Put(b, &seq, &ev);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].sequence, 2u);
  EXPECT_EQ(ev[0].parent, H(3));
  EXPECT_EQ(ev[0].hashes, std::vector<BlockHash>{H(4)});
  // Root most recently used: leaves go first.
  EXPECT_EQ(pool.LruOrder(), (std::vector<BlockHash>{H(1), H(2), H(3), H(4)}));
}

TEST(PoolTier, EvictsLeastRecentlyUsedLeavesFirst) {
  PoolTier pool(5);
  uint64_t seq = 1;
  std::vector<router::KvEvent> ev;
  pool.Put(std::vector<BlockHash>{H(1), H(2), H(3)}, &seq, &ev);  // older chain
  pool.Put(std::vector<BlockHash>{H(10), H(11)}, &seq, &ev);
  ev.clear();
  pool.Put(std::vector<BlockHash>{H(20), H(21)}, &seq, &ev);  // needs 2: evicts 3, then 2
  EXPECT_EQ(pool.size(), 5);
  EXPECT_TRUE(pool.Contains(H(1)));
  EXPECT_FALSE(pool.Contains(H(2)));
  EXPECT_FALSE(pool.Contains(H(3)));
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].type, router::KvEvent::Type::kRemoved);
  EXPECT_EQ(ev[0].hashes, (std::vector<BlockHash>{H(3), H(2)}));
  EXPECT_EQ(ev[1].type, router::KvEvent::Type::kStored);
  EXPECT_EQ(pool.evicted(), 2u);
}

TEST(PoolTier, NeverEvictsTheChainItIsStoring) {
  PoolTier pool(4);
  uint64_t seq = 1;
  std::vector<router::KvEvent> ev;
  pool.Put(std::vector<BlockHash>{H(1), H(2)}, &seq, &ev);  // LRU end holds the old root
  pool.Put(std::vector<BlockHash>{H(7), H(8)}, &seq, &ev);
  ev.clear();
  pool.Put(std::vector<BlockHash>{H(1), H(2), H(3)}, &seq, &ev);  // refreshes 1, 2; evicts 8
  EXPECT_TRUE(pool.Contains(H(1)) && pool.Contains(H(2)) && pool.Contains(H(3)));
  EXPECT_FALSE(pool.Contains(H(8)));
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].hashes, std::vector<BlockHash>{H(8)});
  EXPECT_EQ(ev[1].hashes, std::vector<BlockHash>{H(3)});
  // A chain longer than the pool keeps its first blocks.
  pool.Put(std::vector<BlockHash>{H(30), H(31), H(32), H(33), H(34), H(35)}, &seq, &ev);
  EXPECT_EQ(pool.size(), 4);
  EXPECT_TRUE(pool.Contains(H(30)) && pool.Contains(H(33)));
  EXPECT_FALSE(pool.Contains(H(34)));
}

// ---- the simulator ---------------------------------------------------------------------------

// A small conversation-like trace: `sessions` sessions, each a long private document
// (shared by its turns) plus a shared system prompt; turns extend their session's prefix.
std::vector<trace::TraceRequest> GeneratedTrace(int sessions, int turns, double rate_per_s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(rate_per_s);
  std::vector<trace::TraceRequest> out;
  uint64_t next_id = 1000;
  std::vector<std::vector<uint64_t>> prefix(static_cast<size_t>(sessions));
  for (int s = 0; s < sessions; ++s) {
    prefix[static_cast<size_t>(s)] = {0, 1};  // shared system prompt: 2 trace blocks
    const int doc = 4 + static_cast<int>(rng() % 6);
    for (int b = 0; b < doc; ++b) prefix[static_cast<size_t>(s)].push_back(next_id++);
  }
  std::vector<int> turn(static_cast<size_t>(sessions), 0);
  double t = 0;
  for (int k = 0; k < sessions * turns; ++k) {
    int s = static_cast<int>(rng() % static_cast<uint64_t>(sessions));
    while (turn[static_cast<size_t>(s)] >= turns) s = (s + 1) % sessions;
    ++turn[static_cast<size_t>(s)];
    auto& p = prefix[static_cast<size_t>(s)];
    p.push_back(next_id++);  // the new user message
    t += gap(rng) * 1000;
    trace::TraceRequest r;
    r.timestamp_ms = t;
    r.hash_ids = p;
    r.input_length = static_cast<int64_t>(p.size()) * 512 - 100;
    r.output_length = 50;
    out.push_back(r);
  }
  return out;
}

Workload BuildOrDie(const std::vector<trace::TraceRequest>& reqs, const std::string& model) {
  auto w = Workload::Build(reqs, 512, model);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : Workload{};
}

TEST(Simulate, DeterministicForASeed) {
  const Workload w = BuildOrDie(GeneratedTrace(24, 4, 4.0, 7), "llama-3.3-70b");
  SimOptions o{.instances = 4, .gpu_blocks = 2048, .pool_blocks = 4096, .policy = "random", .seed = 42};
  auto a = Simulate(w, o);
  auto b = Simulate(w, o);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->instance_requests, b->instance_requests);
  EXPECT_EQ(a->gpu_hit_tokens, b->gpu_hit_tokens);
  EXPECT_EQ(a->pool_hit_tokens, b->pool_hit_tokens);
  EXPECT_DOUBLE_EQ(a->ttft_mean_s, b->ttft_mean_s);
  EXPECT_DOUBLE_EQ(a->ttft_p99_s, b->ttft_p99_s);
  EXPECT_EQ(a->kv_events, b->kv_events);
  // Another seed routes `random` differently.
  o.seed = 43;
  auto c = Simulate(w, o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NE(a->instance_requests, c->instance_requests);
}

TEST(Simulate, AccountingInvariants) {
  const Workload w = BuildOrDie(GeneratedTrace(20, 5, 3.0, 3), "llama-3.3-70b");
  for (const char* policy : {"random", "least_load", "cache_aware", "ttft"}) {
    for (int64_t pool : {int64_t{0}, int64_t{1} << 16}) {
      SimOptions o{.instances = 3, .gpu_blocks = 1024, .pool_blocks = pool, .policy = policy};
      auto r = Simulate(w, o);
      ASSERT_TRUE(r.ok()) << r.status();
      SCOPED_TRACE(std::string(policy) + " pool=" + std::to_string(pool));
      EXPECT_EQ(r->requests, w.requests.size());
      uint64_t sum = 0;
      for (uint64_t n : r->instance_requests) sum += n;
      EXPECT_EQ(sum, r->requests);
      EXPECT_LE(r->hit_rate, r->upper_bound + 1e-12);
      EXPECT_GE(r->gpu_hit_rate, 0.0);
      if (pool == 0) {
        EXPECT_EQ(r->pool_hit_tokens, 0);
      }
      EXPECT_GE(r->ttft_p99_s, r->ttft_p50_s);
      EXPECT_GT(r->ttft_mean_s, 0.0);
      EXPECT_GT(r->kv_events, 0u);
      EXPECT_NEAR(r->ttft_mean_s, r->queue_mean_s + r->transfer_mean_s + r->prefill_mean_s, 1e-9);
    }
  }
}

TEST(Simulate, InfiniteCachesReachTheUpperBound) {
  // One instance with room for everything sees every earlier prefix: hit == bound.
  const Workload w = BuildOrDie(GeneratedTrace(10, 3, 1.0, 5), "llama-3.3-70b");
  auto r = Simulate(w, {.instances = 1, .gpu_blocks = 1 << 16, .policy = "round_robin"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->hit_rate, r->upper_bound, 1e-12);
  EXPECT_GT(r->upper_bound, 0.3);
}

TEST(Simulate, PoolTierRaisesTheHitRate) {
  const Workload w = BuildOrDie(GeneratedTrace(40, 4, 4.0, 11), "llama-3.3-70b");
  auto gpu_only = Simulate(w, {.instances = 8, .gpu_blocks = 1024, .policy = "least_load"});
  auto pooled = Simulate(w, {.instances = 8, .gpu_blocks = 1024, .pool_blocks = 1 << 18, .policy = "least_load"});
  ASSERT_TRUE(gpu_only.ok()) << gpu_only.status();
  ASSERT_TRUE(pooled.ok()) << pooled.status();
  EXPECT_GT(pooled->pool_hit_tokens, 0);
  EXPECT_GT(pooled->hit_rate, gpu_only->hit_rate + 0.1);
  EXPECT_LE(pooled->hit_rate, pooled->upper_bound + 1e-12);
  EXPECT_LT(pooled->ttft_mean_s, gpu_only->ttft_mean_s);
}

TEST(Simulate, PolicyOrderingOnAGeneratedTrace) {
  // Busy enough that placement matters (about 70% of the cluster's prefill capacity
  // without reuse), caches too small to hold every session everywhere.
  const Workload w = BuildOrDie(GeneratedTrace(64, 6, 2.2, 1), "llama-3.3-70b");
  std::map<std::string, SimResult> r;
  for (const char* policy : {"random", "least_load", "cache_aware", "ttft"}) {
    auto s = Simulate(w, {.instances = 8, .gpu_blocks = 4096, .policy = policy, .seed = 1});
    ASSERT_TRUE(s.ok()) << s.status();
    r[policy] = *s;
  }
  for (const auto& [p, s] : r) {
    std::printf("%-12s ttft mean %.2f s  hit %.3f  busy max/mean %.2f\n", p.c_str(), s.ttft_mean_s, s.hit_rate,
                s.busy_max_s / s.busy_mean_s);
  }
  EXPECT_GT(r["random"].ttft_mean_s, r["least_load"].ttft_mean_s);
  EXPECT_GT(r["least_load"].ttft_mean_s, r["cache_aware"].ttft_mean_s);
  EXPECT_LE(r["ttft"].ttft_mean_s, r["cache_aware"].ttft_mean_s * 1.05);
  EXPECT_GT(r["cache_aware"].hit_rate, r["least_load"].hit_rate);
}

// The router sees what each busy instance has left of its running prefill at the moment
// it routes. r0 (20 blocks) starts on one instance at 0, r1 (16 blocks) on the other at
// 0.5 T0, r2 (1 block) arrives at 0.9 T0, when the first has 0.1 T0 left and the second
// 0.4 T0: ttft sends it to the first. Before, each was last reported when it started (its
// whole prefill still to do: 20 blocks against 16), and r2 went to the second.
TEST(Simulate, RouterSeesTheRunningPrefillLeftWhenItRoutes) {
  const double t0 = CostModel{}.PrefillSeconds(*ResolveModelSpec("llama-3.3-70b"), 20 * 512);
  std::vector<trace::TraceRequest> reqs;
  uint64_t id = 1;
  for (auto [at, blocks] : {std::pair{0.0, 20}, std::pair{0.5, 16}, std::pair{0.9, 1}}) {
    trace::TraceRequest r;
    r.timestamp_ms = at * t0 * 1000;
    for (int b = 0; b < blocks; ++b) r.hash_ids.push_back(id++);
    r.input_length = blocks * 512;
    r.output_length = 1;
    reqs.push_back(r);
  }
  const Workload w = BuildOrDie(reqs, "llama-3.3-70b");
  SimOptions o{.instances = 2, .gpu_blocks = 4096, .policy = "ttft", .time_scale = 1.0};
  auto r = Simulate(w, o);
  ASSERT_TRUE(r.ok()) << r.status();
  // r2 waits 0.1 T0 (0.4 T0 on the other instance): a mean of 0.033 T0 (0.133 T0).
  EXPECT_NEAR(r->queue_mean_s, 0.1 * t0 / 3, 0.01 * t0);
}

TEST(Simulate, RejectsBadOptions) {
  const Workload w = BuildOrDie(GeneratedTrace(2, 1, 1.0, 1), "tiny-gqa");
  EXPECT_FALSE(Simulate(w, {.instances = 0}).ok());
  EXPECT_FALSE(Simulate(w, {.gpu_blocks = 0}).ok());
  EXPECT_FALSE(Simulate(w, {.policy = "fastest"}).ok());
  EXPECT_FALSE(Simulate(w, {.time_scale = 0}).ok());
  EXPECT_FALSE(Workload::Build({}, 512, "no-such-model").ok());
}

}  // namespace
}  // namespace kvpool::sim
