// KV-cache events: how a cache tells the router (and the pool) what it holds.
//
// Every change to the set of cached hashes is announced, in order, with a per-source
// sequence number that starts at 1 and grows by exactly one per event, so a consumer
// detects a gap and asks for a full dump (proto/kvpool/v1/router.proto, KvEvent):
//
//   seq 1  stored   parent=none  hashes=[h1 h2 h3]  kind=attn_kv       tier=gpu
//   seq 2  stored   parent=h2    hashes=[h4]        kind=attn_kv       tier=gpu
//   seq 3  stored   parent=h2    hashes=[h3]        kind=linear_state  tier=gpu  (checkpoint at h3's end)
//   seq 4  removed               hashes=[h4]        kind=attn_kv       tier=gpu
//   seq 5  cleared
//
// Invariant the tests check: replaying the stream (stored adds, removed deletes, cleared
// empties) yields exactly the set of (hash, kind) the cache holds. A hash is announced
// once when its first copy is cached and removed once when its last copy goes.
//
// Thread safety: KvEventSink implementations are called synchronously from the cache
// manager's (serialized) calls; RecordingEventSink is not thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "kvpool/common/hash.h"
#include "kvpool/common/model_spec.h"

namespace kvpool::cache {

// Where a cached object lives. Same values as proto kvpool.v1.Tier.
enum class Tier : uint8_t { kGpu = 1, kDram = 2, kNvme = 3 };
absl::string_view TierName(Tier tier);  // "gpu", "dram", "nvme"

struct KvEvent {
  enum class Type : uint8_t { kStored, kRemoved, kCleared };

  Type type = Type::kStored;
  // Per source: 1 for the first event, then exactly +1 per event.
  uint64_t sequence = 0;
  StateKind kind = StateKind::kAttnKv;  // stored / removed
  Tier tier = Tier::kGpu;               // stored / removed
  // stored: the hash of the block before hashes[0] in its chain; nullopt at a chain start.
  std::optional<BlockHash> parent;
  // stored: consecutive blocks of one chain (a checkpoint: its one boundary hash);
  // removed: hashes that are no longer held; cleared: empty.
  std::vector<BlockHash> hashes;
  // removed, kAttnKv: pages[i] is the block that held the last copy of hashes[i] (a
  // hash may have had several copies; earlier ones went silently). The page still holds
  // that copy's bytes while the sink runs: it is only rewritten after the cache call
  // that published the event returns. A write-back tier copies it out from there.
  // Empty for every other event.
  std::vector<int32_t> pages;
};

absl::string_view EventTypeName(KvEvent::Type type);  // "stored", "removed", "cleared"

// Receives events. Called synchronously, inside the manager call that caused the event;
// an implementation must not call back into the manager.
class KvEventSink {
 public:
  virtual ~KvEventSink() = default;
  virtual void Publish(absl::string_view source_id, const KvEvent& event) = 0;
};

// Keeps every event in memory (tests, the simulator, and dumps).
class RecordingEventSink : public KvEventSink {
 public:
  void Publish(absl::string_view source_id, const KvEvent& event) override {
    source_ids_.emplace_back(source_id.data(), source_id.size());
    events_.push_back(event);
  }
  const std::vector<KvEvent>& events() const { return events_; }
  const std::vector<std::string>& source_ids() const { return source_ids_; }
  void Clear() {
    events_.clear();
    source_ids_.clear();
  }

 private:
  std::vector<KvEvent> events_;
  std::vector<std::string> source_ids_;
};

}  // namespace kvpool::cache
