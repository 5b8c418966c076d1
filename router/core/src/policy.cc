#include "kvpool/router/policy.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvpool::router {

namespace {
constexpr PolicyKind kAll[] = {PolicyKind::kRandom,     PolicyKind::kRoundRobin, PolicyKind::kLeastLoad,
                               PolicyKind::kPowerOfTwo, PolicyKind::kSession,    PolicyKind::kCacheAware,
                               PolicyKind::kTtft};

// a is better than b on load: fewer requests, then fewer queued tokens. Candidates equal
// on both are tied; Policy::Best breaks ties at random (seeded), not by slot.
bool LessLoaded(const Candidate& a, const Candidate& b) {
  if (a.load != b.load) return a.load < b.load;
  return a.queued_tokens < b.queued_tokens;
}
}  // namespace

absl::string_view PolicyName(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kRandom: return "random";
    case PolicyKind::kRoundRobin: return "round_robin";
    case PolicyKind::kLeastLoad: return "least_load";
    case PolicyKind::kPowerOfTwo: return "power_of_two";
    case PolicyKind::kSession: return "session";
    case PolicyKind::kCacheAware: return "cache_aware";
    case PolicyKind::kTtft: return "ttft";
  }
  return "unknown";
}

std::vector<std::string> PolicyNames() {
  std::vector<std::string> names;
  for (PolicyKind k : kAll) names.emplace_back(PolicyName(k));
  return names;
}

absl::StatusOr<PolicyKind> ParsePolicy(absl::string_view name) {
  for (PolicyKind k : kAll) {
    if (PolicyName(k) == name) return k;
  }
  // Clipped: a client's megabyte of junk must not come back as a status too large to send.
  return absl::InvalidArgumentError(absl::StrCat("policy=\"", name.substr(0, 64), "\" is not a policy; use one of ",
                                                 absl::StrJoin(PolicyNames(), ", ")));
}

template <typename Better, typename Eligible>
size_t Policy::Best(std::span<const Candidate> c, const Better& better, const Eligible& eligible) {
  // One pass finds the best eligible candidate and counts those tied with it (neither is
  // better than the other); with several, one rng draw picks the k-th of them. Ties under
  // equal load are the common case on an idle cluster, and a fixed order (lowest slot)
  // would pile every such request onto the first instances.
  size_t best = c.size(), ties = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    if (!eligible(i)) continue;
    if (best == c.size() || better(i, best)) {
      best = i;
      ties = 1;
    } else if (!better(best, i)) {
      ++ties;
    }
  }
  if (ties <= 1) return best;
  size_t k = std::uniform_int_distribution<size_t>(0, ties - 1)(rng_);
  for (size_t i = best; i < c.size(); ++i) {  // the tied ones are at or after `best`
    if (i == best || (eligible(i) && !better(i, best) && !better(best, i))) {
      if (k == 0) return i;
      --k;
    }
  }
  return best;
}

size_t Policy::LeastLoad(std::span<const Candidate> c) {
  return Best(
      c, [&c](size_t a, size_t b) { return LessLoaded(c[a], c[b]); }, [](size_t) { return true; });
}

size_t Policy::Random(std::span<const Candidate> c) {
  return std::uniform_int_distribution<size_t>(0, c.size() - 1)(rng_);
}

size_t Policy::PowerOfTwo(std::span<const Candidate> c) {
  if (c.size() == 1) return 0;
  const size_t a = std::uniform_int_distribution<size_t>(0, c.size() - 1)(rng_);
  size_t b = std::uniform_int_distribution<size_t>(0, c.size() - 2)(rng_);
  if (b >= a) ++b;
  return LessLoaded(c[b], c[a]) ? b : a;  // a tie goes to the first draw: uniform
}

size_t Policy::CacheAware(std::span<const Candidate> c, uint32_t total_blocks) {
  double mean = 0, max_load = 0;
  for (const Candidate& x : c) {
    mean += x.load;
    max_load = std::max(max_load, x.load);
  }
  mean /= static_cast<double>(c.size());
  // The herding cap: an instance may take this request only if its load stays near the
  // mean. When every candidate is above it (cannot happen for the least loaded one, whose
  // load is <= mean), all are eligible.
  const double cap = mean * params_.balance_rel + params_.balance_abs;
  const double total = std::max<uint32_t>(total_blocks, 1);
  const double load_norm = std::max(max_load, 1.0);
  scores_.resize(c.size());
  for (size_t i = 0; i < c.size(); ++i) {
    scores_[i] = params_.overlap_weight * (c[i].gpu_blocks / total) - params_.load_weight * (c[i].load / load_norm);
  }
  const size_t best = Best(
      c,
      [&](size_t a, size_t b) {
        if (scores_[a] != scores_[b]) return scores_[a] > scores_[b];
        return LessLoaded(c[a], c[b]);
      },
      [&](size_t i) { return !(c[i].load + 1.0 > cap); });
  return best == c.size() ? LeastLoad(c) : best;
}

size_t Policy::Ttft(std::span<const Candidate> c) {
  return Best(
      c,
      [&c](size_t a, size_t b) {
        if (c[a].est_ttft_s != c[b].est_ttft_s) return c[a].est_ttft_s < c[b].est_ttft_s;
        return LessLoaded(c[a], c[b]);
      },
      [](size_t) { return true; });
}

size_t Policy::RoundRobin(uint32_t group, std::span<const Candidate> c) {
  if (group >= rr_.size()) rr_.resize(size_t{group} + 1, 0);
  return rr_[group]++ % c.size();
}

void Policy::RememberSession(uint32_t group, absl::string_view session_id, std::string instance_id) {
  if (num_sessions_ >= params_.max_sessions && num_sessions_ > 0) {
    // Drop the older half: O(n) once per max_sessions/2 new sessions.
    std::vector<uint64_t> uses;
    uses.reserve(num_sessions_);
    for (const auto& m : sessions_) {
      for (const auto& [k, v] : m) uses.push_back(v.last_use);
    }
    std::nth_element(uses.begin(), uses.begin() + static_cast<ptrdiff_t>(uses.size() / 2), uses.end());
    const uint64_t median = uses[uses.size() / 2];
    num_sessions_ = 0;
    for (auto& m : sessions_) {
      absl::erase_if(m, [&](const auto& kv) { return kv.second.last_use < median; });
      num_sessions_ += m.size();
    }
  }
  const bool fresh =
      sessions_[group].insert_or_assign(std::string(session_id), Sticky{std::move(instance_id), ++session_clock_}).second;
  if (fresh) ++num_sessions_;
}

}  // namespace kvpool::router
