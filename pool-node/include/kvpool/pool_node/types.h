// Vocabulary of the pool node's core: object keys, tiers, page runs and descriptors.
// No gRPC or UCX types: the service converts these to and from kvpool.v1 messages.
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <vector>

#include "kvpool/common/hash.h"
#include "kvpool/common/model_spec.h"

namespace kvpool::pool_node {

// An object is named by the block hash it belongs to and the kind of state it holds: the
// ATTN_KV block h_i and the LINEAR_STATE checkpoint at h_i are two objects.
struct ObjectKey {
  BlockHash hash;
  StateKind kind = StateKind::kAttnKv;

  friend bool operator==(const ObjectKey&, const ObjectKey&) = default;
  friend auto operator<=>(const ObjectKey&, const ObjectKey&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const ObjectKey& k) {
    return H::combine(std::move(h), k.hash, static_cast<uint8_t>(k.kind));
  }
};

enum class Tier : uint8_t { kDram = 0, kNvme = 1 };

// A write to the NVMe tier's journal (fault injection in tests names which one fails).
enum class JournalWrite : uint8_t {
  kAppend,        // ADD / DEL records appended as objects come and go (before any byte)
  kRewrite,       // the compacted journal written to a new file and renamed over the old
  kAppendLanded,  // after an append's bytes were written: an error = a write that failed
                  // once its bytes (or some) had reached the file
  kTruncate,      // cutting a failed append back off: an error = the cut failed
};

inline constexpr int kNumTiers = 2;
inline constexpr int kNumKinds = 2;
// An object's length is 1..kMaxObjectBytes (Reserve refuses others; journal replay drops them).
inline constexpr uint64_t kMaxObjectBytes = uint64_t{1} << 32;
inline int KindIndex(StateKind k) { return static_cast<int>(k); }

// An object's bytes in the DRAM arena: pages in object order, `length` bytes in all
// (the last page may be partly used).
struct PageRunDesc {
  std::vector<uint32_t> pages;
  uint64_t length = 0;
};

// One hit of a Lookup.
struct ObjectDesc {
  ObjectKey key;
  Tier found_in = Tier::kDram;  // kNvme: promoted into DRAM by this Lookup
  PageRunDesc run;              // DRAM pages (valid while the lease lasts)
  uint64_t checksum = 0;        // XXH3-64 of the object's bytes
};

}  // namespace kvpool::pool_node
