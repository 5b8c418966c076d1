#include "kvpool/router/load_tracker.h"

#include <algorithm>

namespace kvpool::router {

LoadTracker::PerSource& LoadTracker::At(SourceSlot slot) {
  if (slot >= sources_.size()) sources_.resize(slot + 1);
  return sources_[slot];
}

void LoadTracker::Reset(SourceSlot slot, absl::Time now) {
  Remove(slot);
  At(slot).last_heartbeat = now;
}

void LoadTracker::Remove(SourceSlot slot) {
  if (At(slot).inflight > 0) {
    for (auto it = decisions_.begin(); it != decisions_.end();) {
      auto cur = it++;
      if (cur->second.slot == slot) decisions_.erase(cur);
    }
  }
  sources_[slot] = PerSource{};
}

void LoadTracker::Heartbeat(SourceSlot slot, const InstanceLoad& load, absl::Time now) {
  PerSource& s = At(slot);
  s.reported = load;
  s.last_heartbeat = now;
}

uint64_t LoadTracker::AddDecision(SourceSlot slot, uint64_t prefill_tokens, absl::Time now) {
  const uint64_t id = next_id_++;
  PerSource& s = At(slot);
  ++s.inflight;
  s.inflight_tokens += prefill_tokens;
  const absl::Time deadline = now + decision_timeout_;
  decisions_.emplace(id, Decision{slot, prefill_tokens, deadline});
  by_deadline_.emplace_back(deadline, id);
  return id;
}

bool LoadTracker::Complete(uint64_t decision_id, SourceSlot slot) {
  auto it = decisions_.find(decision_id);
  if (it == decisions_.end()) return false;
  // Ids come back from workers, which got them from clients: one reported by another
  // source is not this source's to release.
  if (slot != kAnySlot && it->second.slot != slot) return false;
  PerSource& s = At(it->second.slot);
  --s.inflight;
  s.inflight_tokens -= it->second.tokens;
  decisions_.erase(it);
  return true;
}

size_t LoadTracker::ExpireDecisions(absl::Time now) {
  size_t n = 0;
  // Deadlines are pushed in the order of `now`; a caller whose clock steps back only
  // delays expiry.
  while (!by_deadline_.empty() && by_deadline_.front().first <= now) {
    if (Complete(by_deadline_.front().second)) ++n;
    by_deadline_.pop_front();
  }
  // Ids released by completion stay in the deque until their deadline; bound it.
  if (by_deadline_.size() > 4 * decisions_.size() + 1024) {
    std::deque<std::pair<absl::Time, uint64_t>> live;
    for (const auto& d : by_deadline_) {
      if (decisions_.contains(d.second)) live.push_back(d);
    }
    by_deadline_.swap(live);
  }
  return n;
}

double LoadTracker::Requests(SourceSlot slot) const {
  if (slot >= sources_.size()) return 0;
  const PerSource& s = sources_[slot];
  return static_cast<double>(s.reported.running_requests) + s.reported.waiting_requests +
         static_cast<double>(s.inflight);
}

uint64_t LoadTracker::QueuedTokens(SourceSlot slot) const {
  if (slot >= sources_.size()) return 0;
  return sources_[slot].reported.queued_prefill_tokens + sources_[slot].inflight_tokens;
}

uint64_t LoadTracker::Inflight(SourceSlot slot) const {
  return slot < sources_.size() ? sources_[slot].inflight : 0;
}

const InstanceLoad& LoadTracker::Reported(SourceSlot slot) const {
  static const InstanceLoad kNone;
  return slot < sources_.size() ? sources_[slot].reported : kNone;
}

void LoadTracker::Seen(SourceSlot slot, absl::Time now) {
  PerSource& s = At(slot);
  s.last_event = std::max(s.last_event, now);
}

absl::Time LoadTracker::last_seen(SourceSlot slot) const {
  return slot < sources_.size() ? std::max(sources_[slot].last_heartbeat, sources_[slot].last_event)
                                : absl::InfinitePast();
}

absl::Time LoadTracker::last_heartbeat(SourceSlot slot) const {
  return slot < sources_.size() ? sources_[slot].last_heartbeat : absl::InfinitePast();
}

}  // namespace kvpool::router
