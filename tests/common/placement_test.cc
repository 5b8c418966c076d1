#include "kvpool/common/placement.h"

#include <map>

#include <gtest/gtest.h>

namespace kvpool {
namespace {

std::vector<BlockHash> Hashes(size_t n) {
  auto h = *BlockHasher::Create({.model_id = "m", .block_tokens = 1});
  std::vector<TokenId> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<TokenId>(i);
  return h.HashPrefix(t);
}

TEST(RendezvousRingTest, SpreadsBlocksEvenly) {
  RendezvousRing ring({"a", "b", "c", "d"});
  std::map<size_t, int> count;
  for (const auto& h : Hashes(40000)) ++count[ring.Owner(h)];
  for (const auto& [node, n] : count) EXPECT_NEAR(n, 10000, 600) << node;
}

TEST(RendezvousRingTest, OnlyTheLeavingNodesBlocksMove) {
  RendezvousRing four({"a", "b", "c", "d"});
  RendezvousRing three({"a", "b", "d"});  // "c" left
  for (const auto& h : Hashes(5000)) {
    const std::string before = four.node_ids()[four.Owner(h)];
    const std::string after = three.node_ids()[three.Owner(h)];
    if (before != "c") {
      EXPECT_EQ(before, after);
    }
  }
}

TEST(RendezvousRingTest, ReplicasAreDistinctAndStartWithTheOwner) {
  RendezvousRing ring({"a", "b", "c"});
  for (const auto& h : Hashes(100)) {
    auto owners = ring.Owners(h, 2);
    ASSERT_EQ(owners.size(), 2u);
    EXPECT_EQ(owners[0], ring.Owner(h));
    EXPECT_NE(owners[0], owners[1]);
  }
  EXPECT_EQ(ring.Owners(Hashes(1)[0], 10).size(), 3u);
}

}  // namespace
}  // namespace kvpool
