// The router's vocabulary without wire types: sources, tiers, KV events and load.
//
// Workers and pool nodes publish the same events. The service converts the
// kvpool.v1 protos into these structs once, at the RPC boundary; the simulator builds
// them directly.
//
//   source "w0" (worker):     stored {parent=h1, [h2 h3], GPU}   seq 7
//   source "p0" (pool node):  stored {parent=0,  [h1 h2], DRAM}  seq 3
//
// Thread safety: plain values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "kvpool/common/hash.h"
#include "kvpool/common/model_spec.h"

namespace kvpool::router {

// Hashes per stored or removed event (router.proto: 1..4096); sources split longer runs
// (EventPublisher::Publish does).
inline constexpr size_t kMaxEventHashes = 4096;

enum class Tier : uint8_t { kGpu = 0, kDram = 1, kNvme = 2 };
inline constexpr int kNumTiers = 3;
absl::string_view TierName(Tier tier);  // "gpu", "dram", "nvme"

enum class SourceKind : uint8_t { kWorker, kPoolNode };

// One event of a source's stream.
struct KvEvent {
  enum class Type : uint8_t { kStored, kRemoved, kCleared };
  // Per-source sequence: the first event after Register is 1, each next one more.
  uint64_t sequence = 0;
  Type type = Type::kStored;
  // kStored: hash preceding hashes[0] in its chain; zero for a chain start.
  BlockHash parent;
  // kStored: consecutive blocks of one chain. kRemoved: any blocks. kCleared: empty.
  std::vector<BlockHash> hashes;
  StateKind kind = StateKind::kAttnKv;
  Tier tier = Tier::kGpu;

  static KvEvent Stored(uint64_t seq, BlockHash parent, std::vector<BlockHash> hashes,
                        Tier tier = Tier::kGpu, StateKind kind = StateKind::kAttnKv);
  static KvEvent Removed(uint64_t seq, std::vector<BlockHash> hashes, Tier tier = Tier::kGpu,
                         StateKind kind = StateKind::kAttnKv);
  static KvEvent Cleared(uint64_t seq);
};

// Events of one source, in sequence order.
struct EventBatch {
  // True: replaces everything the router knows about the source.
  bool full_dump = false;
  // For a full dump: the sequence of the source's last event before the dump was taken;
  // the router expects dump_sequence + 1 next. 0 = the last event's sequence in the dump.
  uint64_t dump_sequence = 0;
  std::vector<KvEvent> events;
};

// What an instance reports in its heartbeats.
struct InstanceLoad {
  uint32_t running_requests = 0;
  uint32_t waiting_requests = 0;
  uint64_t queued_prefill_tokens = 0;
  double kv_usage = 0;  // [0, 1]
};

}  // namespace kvpool::router
