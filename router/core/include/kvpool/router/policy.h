// Routing policies: pick one candidate instance for a request.
//
// RouterCore fills one Candidate per live worker of the request's model (GPU hit, pool
// hit beyond it, load, estimated TTFT) and asks a Policy for an index into them.
//
//   random        uniform
//   round_robin   in turn
//   least_load    fewest requests (running + waiting + in flight), then fewest queued tokens
//   power_of_two  two distinct random candidates, the less loaded
//   session       sticky by session id; a new or orphaned session goes to least_load
//   cache_aware   argmax w1 * gpu_hit/total_blocks - w2 * load/max_load, among
//                 candidates below the herding cap (see PolicyParams)
//   ttft          argmin estimated TTFT = queue + decode (the worker's running sequences
//                 in the same step) + transfer(pool part) + prefill(rest)
//
// Ties go to the lower load, then the fewer queued tokens; candidates still tied (equal
// score, load and queued tokens: every idle instance on a quiet cluster) are picked
// uniformly at random with the policy's seeded rng, so results are deterministic for a
// seed without piling ties onto the lowest slots.
//
// Thread safety: none (round_robin's counter, the rng, the scratch and the session map mutate).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvpool/router/kv_index.h"

namespace kvpool::router {

enum class PolicyKind : uint8_t {
  kRandom,
  kRoundRobin,
  kLeastLoad,
  kPowerOfTwo,
  kSession,
  kCacheAware,
  kTtft,
};
inline constexpr int kNumPolicies = 7;

absl::string_view PolicyName(PolicyKind kind);
// INVALID_ARGUMENT listing the known names.
absl::StatusOr<PolicyKind> ParsePolicy(absl::string_view name);
std::vector<std::string> PolicyNames();

struct Candidate {
  SourceSlot slot = 0;
  uint32_t gpu_blocks = 0;   // effective prefix blocks on the instance's GPU
  uint32_t pool_blocks = 0;  // further prefix blocks fetched from DRAM/NVMe
  double load = 0;           // requests: running + waiting + in flight
  uint64_t queued_tokens = 0;
  double est_ttft_s = 0;     // queue + decode + transfer + prefill (+ KDA replay)
};

struct PolicyParams {
  double overlap_weight = 1.0;  // w1
  double load_weight = 1.0;     // w2
  // Anti-herding: cache_aware only considers candidates whose load after taking this
  // request stays <= balance_rel * mean_load + balance_abs. A shared system prompt makes
  // every instance with it score the same overlap; without the cap the first to cache it
  // takes every request until its load term outweighs a full overlap.
  double balance_rel = 1.25;
  double balance_abs = 1.0;
  size_t max_sessions = 1 << 20;  // session map bound; the oldest half is dropped beyond it
};

class Policy {
 public:
  Policy(PolicyParams params, uint64_t seed) : params_(params), rng_(seed) {}

  // Index into `candidates` of the chosen one. REQUIRES: !candidates.empty().
  // `group` names the candidate set (the router's model index): round-robin turns and
  // sessions are kept per group, so one model's requests do not move another's turn, and
  // a session id reused on two models sticks on each. `instance_id(slot)` names a slot
  // (for the session map, which outlives slots).
  template <typename IdOf>
  size_t Choose(PolicyKind kind, uint32_t group, std::span<const Candidate> candidates,
                uint32_t total_blocks, absl::string_view session_id, const IdOf& instance_id);

  size_t LeastLoad(std::span<const Candidate> c);
  size_t CacheAware(std::span<const Candidate> c, uint32_t total_blocks);
  size_t Ttft(std::span<const Candidate> c);
  size_t Random(std::span<const Candidate> c);
  size_t RoundRobin(uint32_t group, std::span<const Candidate> c);
  size_t PowerOfTwo(std::span<const Candidate> c);
  size_t sessions() const { return num_sessions_; }

 private:
  void RememberSession(uint32_t group, absl::string_view session_id, std::string instance_id);
  // The best eligible candidate under the strict order `better(i, j)`; ties (neither
  // better) are broken uniformly with rng_. c.size() when none is eligible.
  template <typename Better, typename Eligible>
  size_t Best(std::span<const Candidate> c, const Better& better, const Eligible& eligible);

  PolicyParams params_;
  std::mt19937_64 rng_;
  std::vector<uint64_t> rr_;  // next turn per group
  std::vector<double> scores_;  // cache_aware scratch, reused
  struct Sticky {
    std::string instance_id;
    uint64_t last_use;
  };
  // Per group: session id -> its instance (looked up by string_view, no allocation).
  std::vector<absl::flat_hash_map<std::string, Sticky>> sessions_;
  size_t num_sessions_ = 0;  // over all groups, at most max_sessions
  uint64_t session_clock_ = 0;
};

template <typename IdOf>
size_t Policy::Choose(PolicyKind kind, uint32_t group, std::span<const Candidate> c,
                      uint32_t total_blocks, absl::string_view session_id, const IdOf& instance_id) {
  switch (kind) {
    case PolicyKind::kRandom: return Random(c);
    case PolicyKind::kRoundRobin: return RoundRobin(group, c);
    case PolicyKind::kLeastLoad: return LeastLoad(c);
    case PolicyKind::kPowerOfTwo: return PowerOfTwo(c);
    case PolicyKind::kCacheAware: return CacheAware(c, total_blocks);
    case PolicyKind::kTtft: return Ttft(c);
    case PolicyKind::kSession: {
      if (session_id.empty()) return LeastLoad(c);
      if (group >= sessions_.size()) sessions_.resize(size_t{group} + 1);
      auto& mine = sessions_[group];
      auto it = mine.find(session_id);
      if (it != mine.end()) {
        it->second.last_use = ++session_clock_;
        for (size_t i = 0; i < c.size(); ++i) {
          if (instance_id(c[i].slot) == it->second.instance_id) return i;
        }
      }
      const size_t i = LeastLoad(c);  // new session, or its instance is gone
      RememberSession(group, session_id, std::string(instance_id(c[i].slot)));
      return i;
    }
  }
  return 0;
}

}  // namespace kvpool::router
