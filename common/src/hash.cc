#include "kvpool/common/hash.h"

#include <bit>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "xxhash.h"

namespace kvpool {
namespace {

static_assert(std::endian::native == std::endian::little,
              "kvpool's hash encoding assumes a little-endian host");

BlockHash FromXxh(XXH128_hash_t h) { return BlockHash{h.low64, h.high64}; }

// Appends the raw bytes of trivially copyable values to a buffer that lives on the
// stack for the common block sizes and spills to the heap for very large blocks.
class ByteWriter {
 public:
  template <typename T>
  void Put(const T& v) {
    Append(reinterpret_cast<const uint8_t*>(&v), sizeof(T));
  }
  template <typename T>
  void PutSpan(std::span<const T> s) {
    Append(reinterpret_cast<const uint8_t*>(s.data()), s.size_bytes());
  }
  void PutString(absl::string_view s) {
    Put(static_cast<uint64_t>(s.size()));  // length-prefixed: "ab"+"c" != "a"+"bc"
    Append(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
  BlockHash Hash(uint64_t seed) const {
    const uint8_t* data = heap_.empty() ? stack_.data() : heap_.data();
    return FromXxh(XXH3_128bits_withSeed(data, size_, seed));
  }

 private:
  void Append(const uint8_t* p, size_t n) {
    if (n == 0) return;  // an empty span may carry a null pointer: never memcpy from it
    if (heap_.empty() && size_ + n <= stack_.size()) {
      std::memcpy(stack_.data() + size_, p, n);
    } else {
      if (heap_.empty()) heap_.assign(stack_.data(), stack_.data() + size_);
      heap_.insert(heap_.end(), p, p + n);
    }
    size_ += n;
  }

  std::array<uint8_t, 1024> stack_;
  std::vector<uint8_t> heap_;
  size_t size_ = 0;
};

}  // namespace

std::string BlockHash::ToHex() const {
  char out[33];
  std::snprintf(out, sizeof(out), "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return std::string(out, 32);
}

std::string BlockHash::ToBytes() const {
  std::string out(kBytes, '\0');
  std::memcpy(out.data(), &lo, 8);
  std::memcpy(out.data() + 8, &hi, 8);
  return out;
}

absl::StatusOr<BlockHash> BlockHash::FromHex(absl::string_view hex) {
  if (hex.size() != 32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block hash '", hex, "' has ", hex.size(), " characters; expected 32 hex digits"));
  }
  BlockHash h;
  for (size_t i = 0; i < 32; ++i) {
    const char c = hex[i];
    uint64_t d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else
      return absl::InvalidArgumentError(
          absl::StrCat("block hash '", hex, "' has a non-hex character at position ", i));
    uint64_t& half = i < 16 ? h.hi : h.lo;
    half = (half << 4) | d;
  }
  return h;
}

absl::StatusOr<BlockHash> BlockHash::FromBytes(absl::string_view bytes, absl::string_view field) {
  if (bytes.size() != kBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " has ", bytes.size(), " bytes; a block hash is exactly 16 bytes"));
  }
  BlockHash h;
  std::memcpy(&h.lo, bytes.data(), 8);
  std::memcpy(&h.hi, bytes.data() + 8, 8);
  return h;
}

absl::StatusOr<BlockHasher> BlockHasher::Create(HashOptions options) {
  if (options.block_tokens == 0) {
    return absl::InvalidArgumentError("block_tokens=0; a block holds at least one token");
  }
  if (options.model_id.empty()) {
    return absl::InvalidArgumentError("model_id is empty; name the model the KV belongs to");
  }
  return BlockHasher(std::move(options));
}

BlockHash BlockHasher::Root(absl::string_view tenant_salt) const {
  ByteWriter w;
  w.PutString("kvpool/v2");
  w.PutString(options_.model_id);
  w.PutString(tenant_salt);
  return w.Hash(options_.cluster_secret);
}

BlockHash BlockHasher::Chain(const BlockHash& parent, std::span<const TokenId> tokens,
                             std::span<const uint64_t> extra_keys) const {
  ByteWriter w;
  w.Put(parent.lo);
  w.Put(parent.hi);
  // Length-prefixed like every other field: without it, the same bytes were a block of
  // b tokens with no extra key and one of b - 2 tokens with one extra key (hashers of two
  // block sizes, or extra keys that look like tokens), i.e. one hash for two prefixes.
  w.Put(static_cast<uint64_t>(tokens.size()));
  w.PutSpan(tokens);
  w.Put(static_cast<uint64_t>(extra_keys.size()));
  w.PutSpan(extra_keys);
  return w.Hash(options_.cluster_secret);
}

std::vector<BlockHash> BlockHasher::HashPrefix(std::span<const TokenId> tokens,
                                               absl::string_view tenant_salt,
                                               std::span<const uint64_t> extra_keys) const {
  std::vector<BlockHash> hashes;
  hashes.reserve(tokens.size() / options_.block_tokens);
  ExtendHashes(tokens, tenant_salt, extra_keys, hashes);
  return hashes;
}

void BlockHasher::ExtendHashes(std::span<const TokenId> tokens, absl::string_view tenant_salt,
                               std::span<const uint64_t> extra_keys,
                               std::vector<BlockHash>& hashes) const {
  const size_t b = options_.block_tokens;
  const size_t full = tokens.size() / b;
  BlockHash parent = hashes.empty() ? Root(tenant_salt) : hashes.back();
  for (size_t i = hashes.size(); i < full; ++i) {
    parent = Chain(parent, tokens.subspan(i * b, b), extra_keys);
    hashes.push_back(parent);
  }
}

uint64_t Checksum64(std::span<const std::byte> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

BlockHash Digest128(std::span<const std::byte> bytes) {
  return FromXxh(XXH3_128bits(bytes.data(), bytes.size()));
}

}  // namespace kvpool
