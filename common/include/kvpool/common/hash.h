// Chained block hashing: the identity of a block of KV.
//
// KV is a pure function of the prefix tokens, so a block is named by a hash of every
// token before and in it. kvpool hashes block by block, chaining:
//
//   h_0 = XXH3-128( "kvpool/v2" | model id | tenant salt , seed = cluster secret )
//   h_i = XXH3-128( h_{i-1} | token count | tokens of block i | extra key count | extra keys ,
//                   seed = cluster secret )
//
// Every variable-length field is length-prefixed, so no two inputs share an encoding
// (v1 wrote the tokens without their count: a block of b tokens and one of b - 2 tokens
// plus an extra key could hash alike). v2 names the encoding: v1 hashes (e.g. in an
// older node's NVMe journal) are never matched, only missed.
//
//   tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]
//   hashes:     h_1        h_2        (none: a partial block has no hash)
//
// A hit is prefix-only and block-granular: block i is reusable iff h_i matches, which
// implies blocks 1..i all match. Requests with different tenant salts never share a
// block because the salt is in h_0. Values are stable across runs, processes and
// hosts (little-endian byte encoding, fixed seed): workers and the router compute
// the same hashes independently.
//
// Thread safety: BlockHasher is immutable after construction; share it freely.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"

namespace kvpool {

using TokenId = uint32_t;

// A 128-bit block hash. Wire form: 16 bytes, `lo` first, each half little-endian.
struct BlockHash {
  uint64_t lo = 0;
  uint64_t hi = 0;

  static constexpr size_t kBytes = 16;

  friend bool operator==(const BlockHash&, const BlockHash&) = default;
  friend auto operator<=>(const BlockHash&, const BlockHash&) = default;

  bool IsZero() const { return lo == 0 && hi == 0; }
  // 32 lowercase hex digits, `hi` first (reads as one 128-bit number).
  std::string ToHex() const;
  // The 16-byte wire form.
  std::string ToBytes() const;
  static absl::StatusOr<BlockHash> FromHex(absl::string_view hex);
  // `field` names the offending field in the error (e.g. "block_hashes[3]").
  static absl::StatusOr<BlockHash> FromBytes(absl::string_view bytes,
                                             absl::string_view field = "block_hash");

  template <typename H>
  friend H AbslHashValue(H h, const BlockHash& b) {
    return H::combine(std::move(h), b.lo, b.hi);
  }
};

// For std containers. The hash is already uniform, so its low half is a fine bucket key.
struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const { return static_cast<size_t>(h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull)); }
};

struct HashOptions {
  // Per-cluster secret: every worker and router of one cluster must use the same value.
  uint64_t cluster_secret = 0x6b76706f6f6c2d31ull;  // "kvpool-1"
  // Model id (preset or spec name): KV of different models never collides.
  std::string model_id;
  // Tokens per block, > 0.
  uint32_t block_tokens = 16;
};

class BlockHasher {
 public:
  // Validates `options` (block_tokens > 0, model_id non-empty).
  static absl::StatusOr<BlockHasher> Create(HashOptions options);

  uint32_t block_tokens() const { return options_.block_tokens; }
  const HashOptions& options() const { return options_; }

  // h_0 for a tenant: the parent of the first block.
  BlockHash Root(absl::string_view tenant_salt = {}) const;

  // h_i from its parent and the tokens of block i. REQUIRES: tokens.size() == block_tokens.
  BlockHash Chain(const BlockHash& parent, std::span<const TokenId> tokens,
                  std::span<const uint64_t> extra_keys = {}) const;

  // Hashes of every full block of `tokens`, chained from Root(tenant_salt).
  std::vector<BlockHash> HashPrefix(std::span<const TokenId> tokens,
                                    absl::string_view tenant_salt = {},
                                    std::span<const uint64_t> extra_keys = {}) const;

  // Appends hashes for the full blocks of `tokens` not yet in `hashes` (incremental
  // hashing as a request grows during decode).
  void ExtendHashes(std::span<const TokenId> tokens, absl::string_view tenant_salt,
                    std::span<const uint64_t> extra_keys, std::vector<BlockHash>& hashes) const;

 private:
  explicit BlockHasher(HashOptions options) : options_(std::move(options)) {}
  HashOptions options_;
};

// XXH3-64 of a byte range: the object checksum pool nodes verify at Commit.
uint64_t Checksum64(std::span<const std::byte> bytes);

// XXH3-128 of a byte range (digests, e.g. of a hidden state).
BlockHash Digest128(std::span<const std::byte> bytes);

// splitmix64's step as a mixing function: Mix64(x) is the output that follows state x.
// For synthetic ids and test data (not a block identity).
constexpr uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace kvpool

template <>
struct std::hash<kvpool::BlockHash> : kvpool::BlockHashHasher {};
