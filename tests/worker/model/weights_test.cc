// Deterministic weights and the arena's block layout.
#include "kvpool/worker/model/weights.h"

#include <cstring>

#include "gtest/gtest.h"
#include "kvpool/worker/model/kv_arena.h"

namespace kvpool::model {
namespace {

TEST(SplitMix64Test, MatchesTheReferenceSequence) {
  // Reference values of splitmix64.c (Vigna) seeded with 0.
  SplitMix64 rng(0);
  EXPECT_EQ(rng.Next(), 0xe220a8397b1dcdafull);
  EXPECT_EQ(rng.Next(), 0x6e789e6aa1b965f4ull);
  EXPECT_EQ(rng.Next(), 0x06c45d188009454full);
}

TEST(WeightsTest, SameSeedSameWeightsOtherSeedOtherWeights) {
  for (const char* name : {"tiny-gqa", "tiny-mla", "tiny-hybrid"}) {
    SCOPED_TRACE(name);
    auto spec = GetPreset(name);
    ASSERT_TRUE(spec.ok());
    auto a = ModelWeights::Generate(*spec, 7);
    auto b = ModelWeights::Generate(*spec, 7);
    auto c = ModelWeights::Generate(*spec, 8);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    EXPECT_EQ(a->Fingerprint(), b->Fingerprint());
    EXPECT_EQ(a->embedding, b->embedding);
    EXPECT_EQ(a->lm_head.w, b->lm_head.w);
    EXPECT_NE(a->Fingerprint(), c->Fingerprint());
    EXPECT_EQ(a->layers.size(), spec->layers.size());
    EXPECT_GT(a->NumParameters(), int64_t{spec->hidden_size} * spec->vocab_size);
  }
}

TEST(WeightsTest, DefaultSeedFingerprintsArePinned) {
  // Every worker process must build these exact weights (the pool shares K/V between
  // them). Generation uses only integer ops and exactly rounded float ops, so the
  // values are the same on every host; a change here is a cluster-wide format change.
  struct Case {
    const char* name;
    uint64_t fingerprint;
  };
  for (const Case& c : {Case{"tiny-gqa", 0x30566e03c5e980f7ull},
                        Case{"tiny-mla", 0x3fd21bc09ea02b56ull},
                        Case{"tiny-hybrid", 0x28f51d35d3258735ull}}) {
    auto spec = GetPreset(c.name);
    ASSERT_TRUE(spec.ok());
    auto w = ModelWeights::Generate(*spec, 0x6b76706f6f6cull);
    ASSERT_TRUE(w.ok());
    EXPECT_EQ(w->Fingerprint(), c.fingerprint) << c.name << std::hex << " 0x" << w->Fingerprint();
  }
}

TEST(WeightsTest, RealShapePresetsAreNotComputed) {
  auto spec = GetPreset("llama-3.3-70b");
  ASSERT_TRUE(spec.ok());
  auto w = ModelWeights::Generate(*spec, 1);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(w.status().message().find("accounting mode"), absl::string_view::npos);
}

TEST(KvArenaTest, BlockLayoutOfTheTinyPresets) {
  struct Case {
    const char* name;
    int64_t page_bytes;
    size_t sections;
    int64_t section_bytes;
    int32_t pages_per_block;
    int32_t state_pages;
  };
  for (const Case& c : {Case{"tiny-gqa", 32768, 4, 8192, 8, 0},
                        Case{"tiny-mla", 147456, 2, 73728, 2, 0},
                        Case{"tiny-hybrid", 73728, 1, 73728, 1, 2}}) {
    SCOPED_TRACE(c.name);
    auto spec = GetPreset(c.name);
    ASSERT_TRUE(spec.ok());
    auto arena = KvArena::Create(*spec, 8);
    ASSERT_TRUE(arena.ok()) << arena.status();
    const KvArena& a = **arena;
    EXPECT_EQ(a.page_bytes(), c.page_bytes);
    EXPECT_EQ(a.page_bytes(), spec->BlockBytes());
    EXPECT_EQ(a.sections().size(), c.sections);
    int64_t offset = 0;
    for (const PagedLayerSection& s : a.sections()) {
      EXPECT_EQ(s.offset, offset);
      EXPECT_EQ(s.bytes, c.section_bytes);
      EXPECT_EQ(s.pages_per_block, c.pages_per_block);
      offset += s.bytes;
    }
    EXPECT_EQ(a.state_pages(), c.state_pages);
    EXPECT_EQ(a.PageAddress(3), a.base() + 3 * a.page_bytes());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.base()) % 4096, 0u);
  }
}

TEST(KvArenaTest, KernelViewAddressesTheBlockSection) {
  auto spec = GetPreset("tiny-gqa");
  ASSERT_TRUE(spec.ok());
  auto arena = KvArena::Create(*spec, 8);
  ASSERT_TRUE(arena.ok());
  const KvArena& a = **arena;
  const PagedLayerSection& s = a.sections()[2];  // layer 2
  const kernels::GqaPagedKv v = a.GqaView(s);
  // Kernel page b * R of the view is block b's layer-2 K; V follows K.
  const auto* k = static_cast<const std::byte*>(v.k) + 5 * s.pages_per_block * s.kernel_page_bytes;
  EXPECT_EQ(k, a.GqaK(5, s, 0));
  EXPECT_EQ(a.GqaV(5, s, 0), a.GqaK(5, s, 0) + s.kernel_page_bytes);
  EXPECT_EQ(a.GqaK(5, s, 1) - a.GqaK(5, s, 0), 2 * 64 * 2);
  EXPECT_LE((v.num_pages - 1 + 1) * s.kernel_page_bytes + s.offset, a.size_bytes());
}

TEST(KvArenaTest, StateRunsSpanPagesInOrder) {
  auto spec = GetPreset("tiny-hybrid");
  ASSERT_TRUE(spec.ok());
  auto arena = KvArena::Create(*spec, 8);
  ASSERT_TRUE(arena.ok());
  const KvArena& a = **arena;
  std::vector<std::byte> in(static_cast<size_t>(a.state_bytes()));
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::byte>(i * 31 + 7);
  const std::vector<int32_t> run = {6, 2};  // a run need not be contiguous
  a.WriteState(run, 0, in);
  EXPECT_EQ(std::memcmp(a.PageAddress(6), in.data(), static_cast<size_t>(a.page_bytes())), 0);
  EXPECT_EQ(std::memcmp(a.PageAddress(2), in.data() + a.page_bytes(),
                        in.size() - static_cast<size_t>(a.page_bytes())),
            0);
  std::vector<std::byte> out(in.size());
  a.ReadState(run, 0, out);
  EXPECT_EQ(in, out);
}

TEST(KvArenaTest, RefusesBadInput) {
  auto spec = GetPreset("tiny-gqa");
  ASSERT_TRUE(spec.ok());
  auto a = KvArena::Create(*spec, 1);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("num_blocks"), absl::string_view::npos);
}

}  // namespace
}  // namespace kvpool::model
