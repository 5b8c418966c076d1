#include "kvpool/common/hash.h"

#include <numeric>
#include <unordered_set>

#include <gtest/gtest.h>

namespace kvpool {
namespace {

BlockHasher MakeHasher(uint32_t block_tokens = 16, std::string model = "tiny-gqa") {
  auto h = BlockHasher::Create({.model_id = std::move(model), .block_tokens = block_tokens});
  EXPECT_TRUE(h.ok()) << h.status();
  return *h;
}

std::vector<TokenId> Iota(size_t n, TokenId start = 0) {
  std::vector<TokenId> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(BlockHasherTest, PartialTrailingBlockHasNoHash) {
  BlockHasher h = MakeHasher(16);
  EXPECT_EQ(h.HashPrefix(Iota(15)).size(), 0u);
  EXPECT_EQ(h.HashPrefix(Iota(16)).size(), 1u);
  EXPECT_EQ(h.HashPrefix(Iota(41)).size(), 2u);
  EXPECT_EQ(h.HashPrefix(Iota(8000)).size(), 500u);
}

TEST(BlockHasherTest, ChainsEveryBlockOnItsParent) {
  BlockHasher h = MakeHasher(4);
  auto tokens = Iota(12);
  auto hashes = h.HashPrefix(tokens);
  ASSERT_EQ(hashes.size(), 3u);
  EXPECT_EQ(hashes[0], h.Chain(h.Root(), std::span(tokens).subspan(0, 4)));
  EXPECT_EQ(hashes[1], h.Chain(hashes[0], std::span(tokens).subspan(4, 4)));
  EXPECT_EQ(hashes[2], h.Chain(hashes[1], std::span(tokens).subspan(8, 4)));
}

TEST(BlockHasherTest, PrefixOnlyDivergenceChangesEveryLaterBlock) {
  BlockHasher h = MakeHasher(4);
  auto a = Iota(16);
  auto b = a;
  b[5] = 999;  // block 1 differs
  auto ha = h.HashPrefix(a);
  auto hb = h.HashPrefix(b);
  EXPECT_EQ(ha[0], hb[0]);
  // Block 2 and 3 have identical tokens but a different parent: no reuse.
  EXPECT_NE(ha[1], hb[1]);
  EXPECT_NE(ha[2], hb[2]);
  EXPECT_NE(ha[3], hb[3]);
}

TEST(BlockHasherTest, TenantSaltIsolatesFromTheFirstBlock) {
  BlockHasher h = MakeHasher(4);
  auto t = Iota(8);
  auto a = h.HashPrefix(t, "tenant-a");
  auto b = h.HashPrefix(t, "tenant-b");
  auto none = h.HashPrefix(t);
  EXPECT_NE(a[0], b[0]);
  EXPECT_NE(a[0], none[0]);
  EXPECT_EQ(a, h.HashPrefix(t, "tenant-a"));
}

TEST(BlockHasherTest, ModelAndExtraKeysAndSecretChangeTheHash) {
  auto t = Iota(16);
  BlockHasher a = MakeHasher(16, "tiny-gqa");
  BlockHasher b = MakeHasher(16, "tiny-mla");
  EXPECT_NE(a.HashPrefix(t), b.HashPrefix(t));
  const uint64_t lora[] = {7};
  EXPECT_NE(a.HashPrefix(t, "", lora), a.HashPrefix(t));
  auto c = BlockHasher::Create({.cluster_secret = 42, .model_id = "tiny-gqa", .block_tokens = 16});
  ASSERT_TRUE(c.ok());
  EXPECT_NE(c->HashPrefix(t), a.HashPrefix(t));
}

TEST(BlockHasherTest, ExtendHashesMatchesHashPrefix) {
  BlockHasher h = MakeHasher(16);
  auto t = Iota(100);
  std::vector<BlockHash> inc;
  for (size_t n = 0; n <= t.size(); ++n) h.ExtendHashes(std::span(t).first(n), "s", {}, inc);
  EXPECT_EQ(inc, h.HashPrefix(t, "s"));
}

// Values must not change across runs, processes or releases: the router and workers
// compute them independently, and pool nodes persist them in their NVMe journal.
TEST(BlockHasherTest, ValuesAreStable) {
  BlockHasher h = MakeHasher(16, "tiny-gqa");
  auto hashes = h.HashPrefix(Iota(32));
  ASSERT_EQ(hashes.size(), 2u);
  // v2 (token counts in the encoding) since 2026-12-01.
  EXPECT_EQ(h.Root().ToHex(), "2da1dbdfe972c7da438b9656d82025c9");
  EXPECT_EQ(hashes[0].ToHex(), "a997d1b5ac361b168a5a19d4bca42424");
  EXPECT_EQ(hashes[1].ToHex(), "e35915863cf7fed5813143c8c385bad2");
}

// Blocks of different sizes and extra keys never share an encoding: b = 10 tokens
// [t1..t8, 1, 0] with no extra key and b = 8 tokens [t1..t8] with extra_keys = {0} wrote
// the same bytes (the token run had no length), hence the same hash.
TEST(BlockHasherTest, TokenRunsAreLengthPrefixed) {
  BlockHasher ten = MakeHasher(10, "m"), eight = MakeHasher(8, "m");
  std::vector<TokenId> a = Iota(8), b = Iota(8);
  a.push_back(1);
  a.push_back(0);
  const uint64_t zero = 0;
  EXPECT_NE(ten.HashPrefix(a)[0], eight.HashPrefix(b, "", {&zero, 1})[0]);
}

TEST(BlockHasherTest, NoCollisionsOverManyBlocks) {
  BlockHasher h = MakeHasher(1);
  std::unordered_set<BlockHash> seen;
  auto hashes = h.HashPrefix(Iota(100000));
  for (const auto& x : hashes) EXPECT_TRUE(seen.insert(x).second);
}

TEST(BlockHasherTest, RejectsBadOptions) {
  auto zero = BlockHasher::Create({.model_id = "m", .block_tokens = 0});
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("block_tokens"), absl::string_view::npos);
  auto nomodel = BlockHasher::Create({.model_id = "", .block_tokens = 16});
  EXPECT_NE(nomodel.status().message().find("model_id"), absl::string_view::npos);
}

TEST(BlockHashTest, BytesAndHexRoundTrip) {
  BlockHash x{0x0123456789abcdefull, 0xfedcba9876543210ull};
  EXPECT_EQ(x.ToHex(), "fedcba98765432100123456789abcdef");
  EXPECT_EQ(*BlockHash::FromHex(x.ToHex()), x);
  EXPECT_EQ(*BlockHash::FromBytes(x.ToBytes()), x);
  EXPECT_EQ(x.ToBytes()[0], '\xef');  // lo first, little-endian
  auto bad = BlockHash::FromBytes("short", "block_hashes[3]");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("block_hashes[3]"), absl::string_view::npos);
  EXPECT_FALSE(BlockHash::FromHex("xyz").ok());
  EXPECT_FALSE(BlockHash::FromHex(std::string(32, 'g')).ok());
}

TEST(ChecksumTest, DetectsAFlippedBit) {
  std::vector<std::byte> data(4096, std::byte{7});
  const uint64_t a = Checksum64(data);
  data[1000] ^= std::byte{1};
  EXPECT_NE(a, Checksum64(data));
}

}  // namespace
}  // namespace kvpool
