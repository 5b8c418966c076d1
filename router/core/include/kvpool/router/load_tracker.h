// LoadTracker: what each instance is busy with, as reported and as the router predicts.
//
// An instance's load = its last heartbeat (running + waiting requests, queued prefill
// tokens) + the router's own decisions for it that the instance has not yet confirmed
// (optimistic in-flight). A decision is released when a heartbeat lists it as completed,
// or after `decision_timeout` (the instance died or dropped the request), so a lost
// completion cannot inflate load forever.
//
//   Route -> AddDecision(w1, 900 tokens)        load(w1) = hb + 1 request, +900 tokens
//   Heartbeat(w1, completed=[id])               load(w1) = hb
//
// Time is a parameter (`now`): the service passes MonotonicNow (kvpool/common/clock.h:
// wall-clock steps move no timeout), the simulator its own.
//
// Thread safety: none; owned by RouterCore, whose owner serialises calls.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "kvpool/router/events.h"
#include "kvpool/router/kv_index.h"

namespace kvpool::router {

class LoadTracker {
 public:
  explicit LoadTracker(absl::Duration decision_timeout) : decision_timeout_(decision_timeout) {}

  // Starts tracking `slot` (drops what a previous owner of the slot left).
  void Reset(SourceSlot slot, absl::Time now);
  // Stops tracking `slot` and forgets its decisions. O(decisions).
  void Remove(SourceSlot slot);

  void Heartbeat(SourceSlot slot, const InstanceLoad& load, absl::Time now);
  // Records a decision for `slot` whose prefill computes `prefill_tokens`; returns its id (> 0).
  uint64_t AddDecision(SourceSlot slot, uint64_t prefill_tokens, absl::Time now);
  // Releases a decision made for `slot` (kAnySlot: whichever); false when unknown
  // (already released or timed out) or made for another slot.
  static constexpr SourceSlot kAnySlot = ~SourceSlot{0};
  bool Complete(uint64_t decision_id, SourceSlot slot = kAnySlot);
  // Releases decisions older than decision_timeout; returns how many.
  size_t ExpireDecisions(absl::Time now);

  // running + waiting + in-flight decisions.
  double Requests(SourceSlot slot) const;
  // Queued prefill tokens reported + prefill tokens of in-flight decisions.
  uint64_t QueuedTokens(SourceSlot slot) const;
  uint64_t Inflight(SourceSlot slot) const;
  const InstanceLoad& Reported(SourceSlot slot) const;
  absl::Time last_heartbeat(SourceSlot slot) const;
  // A sign of life other than a heartbeat (an applied event batch).
  void Seen(SourceSlot slot, absl::Time now);
  // The later of the last heartbeat and the last Seen: what the heartbeat timeout counts
  // from.
  absl::Time last_seen(SourceSlot slot) const;
  size_t decisions() const { return decisions_.size(); }

 private:
  struct PerSource {
    InstanceLoad reported;
    absl::Time last_heartbeat = absl::InfinitePast();
    absl::Time last_event = absl::InfinitePast();
    uint64_t inflight = 0;
    uint64_t inflight_tokens = 0;
  };
  struct Decision {
    SourceSlot slot;
    uint64_t tokens;
    absl::Time deadline;
  };
  PerSource& At(SourceSlot slot);

  absl::Duration decision_timeout_;
  std::vector<PerSource> sources_;
  absl::flat_hash_map<uint64_t, Decision> decisions_;
  std::deque<std::pair<absl::Time, uint64_t>> by_deadline_;  // (deadline, id), oldest first
  uint64_t next_id_ = 1;
};

}  // namespace kvpool::router
