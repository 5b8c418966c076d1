// Each policy's choice on constructed candidate sets.
#include "kvpool/router/policy.h"

#include <algorithm>
#include <map>
#include <set>

#include <gtest/gtest.h>

namespace kvpool::router {
namespace {

Candidate C(SourceSlot slot, uint32_t gpu, double load, double ttft = 1.0, uint64_t queued = 0) {
  Candidate c;
  c.slot = slot;
  c.gpu_blocks = gpu;
  c.load = load;
  c.est_ttft_s = ttft;
  c.queued_tokens = queued;
  return c;
}

std::string Id(SourceSlot s) { return "w" + std::to_string(s); }

size_t Pick(Policy& p, PolicyKind k, const std::vector<Candidate>& c, uint32_t total = 10,
            absl::string_view session = "", uint32_t group = 0) {
  return p.Choose(k, group, c, total, session, Id);
}

TEST(PolicyTest, NamesRoundTrip) {
  for (const std::string& n : PolicyNames()) {
    auto k = ParsePolicy(n);
    ASSERT_TRUE(k.ok()) << n;
    EXPECT_EQ(PolicyName(*k), n);
  }
  auto bad = ParsePolicy("fastest");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("cache_aware"), absl::string_view::npos);
}

TEST(PolicyTest, LeastLoadPicksFewestRequestsThenFewestTokens) {
  Policy p({}, 1);
  EXPECT_EQ(Pick(p, PolicyKind::kLeastLoad, {C(0, 9, 3), C(1, 0, 1), C(2, 0, 2)}), 1u);
  EXPECT_EQ(Pick(p, PolicyKind::kLeastLoad, {C(0, 0, 1, 1, 500), C(1, 0, 1, 1, 100)}), 1u);
}

TEST(PolicyTest, RoundRobinCycles) {
  Policy p({}, 1);
  std::vector<Candidate> c = {C(0, 0, 0), C(1, 0, 0), C(2, 0, 0)};
  EXPECT_EQ(Pick(p, PolicyKind::kRoundRobin, c), 0u);
  EXPECT_EQ(Pick(p, PolicyKind::kRoundRobin, c), 1u);
  EXPECT_EQ(Pick(p, PolicyKind::kRoundRobin, c), 2u);
  EXPECT_EQ(Pick(p, PolicyKind::kRoundRobin, c), 0u);
}

// Two models' requests alternate: each model's workers still take turns (one shared turn
// sent every request of a model to the same worker), and a session id used on both
// models sticks on each.
TEST(PolicyTest, RoundRobinAndSessionsArePerGroup) {
  Policy p({}, 1);
  std::vector<Candidate> a = {C(0, 0, 0), C(1, 0, 0)}, b = {C(2, 0, 0), C(3, 0, 0)};
  std::map<size_t, int> a_picks, b_picks;
  for (int i = 0; i < 4; ++i) {
    ++a_picks[Pick(p, PolicyKind::kRoundRobin, a, 10, "", 0)];
    ++b_picks[Pick(p, PolicyKind::kRoundRobin, b, 10, "", 1)];
  }
  EXPECT_EQ(a_picks, (std::map<size_t, int>{{0, 2}, {1, 2}}));
  EXPECT_EQ(b_picks, (std::map<size_t, int>{{0, 2}, {1, 2}}));

  a = {C(0, 0, 2), C(1, 0, 1)};
  b = {C(2, 0, 2), C(3, 0, 1)};
  EXPECT_EQ(Pick(p, PolicyKind::kSession, a, 10, "s", 0), 1u);
  EXPECT_EQ(Pick(p, PolicyKind::kSession, b, 10, "s", 1), 1u);
  a = {C(0, 0, 0), C(1, 0, 5)};  // w1 now busiest: still sticky
  b = {C(2, 0, 0), C(3, 0, 5)};
  EXPECT_EQ(Pick(p, PolicyKind::kSession, a, 10, "s", 0), 1u);
  EXPECT_EQ(Pick(p, PolicyKind::kSession, b, 10, "s", 1), 1u);
  EXPECT_EQ(p.sessions(), 2u);
}

TEST(PolicyTest, RandomCoversAllAndIsSeeded) {
  Policy a({}, 7), b({}, 7);
  std::vector<Candidate> c = {C(0, 0, 0), C(1, 0, 0), C(2, 0, 0), C(3, 0, 0)};
  std::set<size_t> seen;
  for (int i = 0; i < 200; ++i) {
    const size_t x = Pick(a, PolicyKind::kRandom, c);
    EXPECT_EQ(x, Pick(b, PolicyKind::kRandom, c));
    seen.insert(x);
  }
  EXPECT_EQ(seen.size(), 4u);
}

TEST(PolicyTest, PowerOfTwoNeverPicksTheMostLoadedOfTwo) {
  Policy p({}, 3);
  std::vector<Candidate> two = {C(0, 0, 5), C(1, 0, 2)};
  for (int i = 0; i < 50; ++i) EXPECT_EQ(Pick(p, PolicyKind::kPowerOfTwo, two), 1u);
  std::vector<Candidate> many = {C(0, 0, 9), C(1, 0, 1), C(2, 0, 4), C(3, 0, 7)};
  for (int i = 0; i < 200; ++i) EXPECT_NE(Pick(p, PolicyKind::kPowerOfTwo, many), 0u);
}

TEST(PolicyTest, SessionIsStickyAndFallsBackToLeastLoad) {
  Policy p({}, 1);
  std::vector<Candidate> c = {C(0, 0, 4), C(1, 0, 1), C(2, 0, 3)};
  EXPECT_EQ(Pick(p, PolicyKind::kSession, c, 10, "s1"), 1u);  // new: least load
  c[1].load = 10;                                              // now the busiest
  EXPECT_EQ(Pick(p, PolicyKind::kSession, c, 10, "s1"), 1u);  // sticky anyway
  EXPECT_EQ(Pick(p, PolicyKind::kSession, c, 10, "s2"), 2u);  // another session: least load
  std::vector<Candidate> without1 = {C(0, 0, 4), C(2, 0, 5)};  // w1 died
  EXPECT_EQ(Pick(p, PolicyKind::kSession, without1, 10, "s1"), 0u);
  EXPECT_EQ(Pick(p, PolicyKind::kSession, without1, 10, "s1"), 0u);  // re-stuck to w0
  EXPECT_EQ(Pick(p, PolicyKind::kSession, c, 10, ""), 2u);           // no session: least load
}

TEST(PolicyTest, CacheAwareTradesOverlapAgainstLoad) {
  Policy p({}, 1);
  // Equal load: the larger overlap wins.
  EXPECT_EQ(Pick(p, PolicyKind::kCacheAware, {C(0, 2, 2), C(1, 8, 2), C(2, 0, 2)}), 1u);
  // Small overlap gain, large load gap: the idle one wins (0.1 - 1.0 < 0 - 0.0).
  EXPECT_EQ(Pick(p, PolicyKind::kCacheAware, {C(0, 1, 4), C(1, 0, 0), C(2, 0, 1)}), 1u);
  // Full overlap at a moderate load beats none at a lower one: 1 - 3/4 > 0 - 2/4.
  EXPECT_EQ(Pick(p, PolicyKind::kCacheAware, {C(0, 10, 3), C(1, 0, 2), C(2, 0, 4)}), 0u);
}

TEST(PolicyTest, CacheAwareHerdingCapExcludesOverloadedOverlap) {
  Policy p({}, 1);
  // w0 holds the whole prefix but is far above the mean: not eligible.
  EXPECT_EQ(Pick(p, PolicyKind::kCacheAware, {C(0, 10, 12), C(1, 0, 2), C(2, 0, 3), C(3, 0, 3)}), 1u);
}

TEST(PolicyTest, TtftPicksLowestEstimateThenLowerLoad) {
  Policy p({}, 1);
  EXPECT_EQ(Pick(p, PolicyKind::kTtft, {C(0, 0, 0, 0.5), C(1, 0, 9, 0.2), C(2, 0, 0, 0.3)}), 1u);
  EXPECT_EQ(Pick(p, PolicyKind::kTtft, {C(0, 0, 3, 0.2), C(1, 0, 1, 0.2)}), 1u);
}

// Equal load (an idle or evenly loaded cluster): ties are spread over every tied
// candidate at random, not given to the lowest slot, and the spread is the same for a seed.
TEST(PolicyTest, TiesUnderEqualLoadAreSpreadAndSeeded) {
  constexpr int kInstances = 1024, kPicks = 20 * kInstances;
  std::vector<Candidate> c;
  for (int i = 0; i < kInstances; ++i) c.push_back(C(static_cast<SourceSlot>(i), 0, 3, 0.5, 100));
  for (PolicyKind k : {PolicyKind::kLeastLoad, PolicyKind::kCacheAware, PolicyKind::kTtft, PolicyKind::kSession}) {
    Policy a({}, 11), b({}, 11);
    std::vector<int> count(kInstances, 0);
    for (int i = 0; i < kPicks; ++i) {
      const size_t x = Pick(a, k, c);
      const size_t y = Pick(b, k, c);
      EXPECT_EQ(x, y) << PolicyName(k);
      if (x < c.size()) {
        ++count[x];
      } else {
        ADD_FAILURE() << PolicyName(k) << " picked " << x;
      }
    }
    const int distinct = static_cast<int>(std::count_if(count.begin(), count.end(), [](int n) { return n > 0; }));
    const int busiest = *std::max_element(count.begin(), count.end());
    // Uniform: 20 per instance on average; the old lowest-slot rule gave slot 0 all of them.
    EXPECT_EQ(distinct, kInstances) << PolicyName(k);
    EXPECT_LE(busiest, 3 * kPicks / kInstances) << PolicyName(k);
  }
  // Only exact ties are randomised: a strictly better candidate still always wins.
  Policy p({}, 5);
  c[700].queued_tokens = 99;
  for (int i = 0; i < 100; ++i) EXPECT_EQ(Pick(p, PolicyKind::kLeastLoad, c), 700u);
  c[700].queued_tokens = 100;
  c[900].gpu_blocks = 1;
  for (int i = 0; i < 100; ++i) EXPECT_EQ(Pick(p, PolicyKind::kCacheAware, c), 900u);
  c[300].est_ttft_s = 0.25;
  for (int i = 0; i < 100; ++i) EXPECT_EQ(Pick(p, PolicyKind::kTtft, c), 300u);
}

// Ties among a subset: only the tied best ones are picked, each of them sometimes.
TEST(PolicyTest, TiesPickOnlyAmongTheBest) {
  Policy p({}, 2);
  std::vector<Candidate> c = {C(0, 0, 5), C(1, 0, 1), C(2, 0, 3), C(3, 0, 1), C(4, 0, 1), C(5, 0, 2)};
  std::map<size_t, int> seen;
  for (int i = 0; i < 300; ++i) ++seen[Pick(p, PolicyKind::kLeastLoad, c)];
  EXPECT_EQ(seen.size(), 3u);
  for (size_t want : {1u, 3u, 4u}) EXPECT_GT(seen[want], 0) << want;
}

}  // namespace
}  // namespace kvpool::router
