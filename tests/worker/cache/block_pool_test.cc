// BlockPool on its own: the free queue, lazy eviction, duplicates, runs, events.
#include "kvpool/worker/cache/block_pool.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_util.h"

namespace kvpool::cache {
namespace {

using ::testing::ElementsAre;

BlockHash H(uint64_t v) { return BlockHash{v, v * 31 + 7}; }

TEST(BlockPoolTest, NullBlockIsNeverHandedOut) {
  BlockPool pool({.num_blocks = 4});
  EXPECT_EQ(pool.num_free_blocks(), 3);
  EXPECT_THAT(pool.FreeQueueOrder(), ElementsAre(1, 2, 3));
  EXPECT_EQ(pool.GetNewBlock(), 1);
  EXPECT_EQ(pool.GetNewBlock(), 2);
  EXPECT_EQ(pool.GetNewBlock(), 3);
  EXPECT_EQ(pool.num_free_blocks(), 0);
  EXPECT_EQ(pool.num_used_blocks(), 3);
}

TEST(BlockPoolTest, UncachedFreesGoToHeadCachedToTail) {
  BlockPool pool({.num_blocks = 6});
  const BlockId a = pool.GetNewBlock(), b = pool.GetNewBlock(), c = pool.GetNewBlock();
  pool.CacheFullBlocks(std::vector<BlockId>{a, b}, std::vector<BlockHash>{H(1), H(2)},
                       std::nullopt);
  // Reverse order, as Free does: c (partial), b, a.
  pool.FreeBlock(c);
  pool.FreeBlock(b);
  pool.FreeBlock(a);
  EXPECT_THAT(pool.FreeQueueOrder(), ElementsAre(c, 4, 5, b, a));
  // Lazy: the hashes stay findable while the blocks are free.
  EXPECT_EQ(pool.GetCachedBlock(H(1)), a);
  EXPECT_EQ(pool.GetCachedBlock(H(2)), b);
}

TEST(BlockPoolTest, TouchTakesAFreeBlockOffTheQueue) {
  BlockPool pool({.num_blocks = 4});
  const BlockId a = pool.GetNewBlock();
  pool.CacheFullBlocks(std::vector<BlockId>{a}, std::vector<BlockHash>{H(1)}, std::nullopt);
  pool.FreeBlock(a);
  EXPECT_EQ(pool.num_free_blocks(), 3);
  pool.Touch(a);
  EXPECT_EQ(pool.block(a).ref_cnt, 1);
  EXPECT_EQ(pool.num_free_blocks(), 2);
  EXPECT_THAT(pool.FreeQueueOrder(), ElementsAre(2, 3));
  pool.Touch(a);  // a second holder: no queue change
  EXPECT_EQ(pool.block(a).ref_cnt, 2);
  pool.FreeBlock(a);
  EXPECT_EQ(pool.num_free_blocks(), 2);
  pool.FreeBlock(a);
  EXPECT_THAT(pool.FreeQueueOrder(), ElementsAre(2, 3, a));
}

TEST(BlockPoolTest, ReusedBlockLosesItsHashAndReportsRemoval) {
  RecordingEventSink sink;
  BlockPool pool({.num_blocks = 2, .source_id = "w0", .event_sink = &sink});
  const BlockId a = pool.GetNewBlock();
  pool.CacheFullBlocks(std::vector<BlockId>{a}, std::vector<BlockHash>{H(9)}, std::nullopt);
  pool.FreeBlock(a);
  EXPECT_EQ(pool.GetNewBlock(), a);  // the only block: reused
  pool.FlushEvents();
  EXPECT_EQ(pool.GetCachedBlock(H(9)), kNoBlock);
  EXPECT_FALSE(pool.block(a).is_cached);
  ASSERT_EQ(sink.events().size(), 2u);
  EXPECT_EQ(sink.events()[0].type, KvEvent::Type::kStored);
  EXPECT_EQ(sink.events()[1].type, KvEvent::Type::kRemoved);
  EXPECT_THAT(sink.events()[1].hashes, ElementsAre(H(9)));
  EXPECT_EQ(sink.events()[1].sequence, 2u);
  EXPECT_EQ(sink.source_ids()[1], "w0");
  EXPECT_EQ(pool.stats().evicted_blocks, 1u);
}

TEST(BlockPoolTest, DuplicateHashStaysCachedUntilLastCopyGoes) {
  RecordingEventSink sink;
  BlockPool pool({.num_blocks = 3, .event_sink = &sink});
  const BlockId a = pool.GetNewBlock(), b = pool.GetNewBlock();
  pool.CacheFullBlocks(std::vector<BlockId>{a}, std::vector<BlockHash>{H(5)}, std::nullopt);
  pool.CacheFullBlocks(std::vector<BlockId>{b}, std::vector<BlockHash>{H(5)}, std::nullopt);
  EXPECT_EQ(sink.events().size(), 1u) << "a hash is announced once";
  pool.FreeBlock(a);
  pool.FreeBlock(b);
  EXPECT_EQ(pool.GetNewBlock(), a);
  pool.FlushEvents();
  EXPECT_TRUE(pool.IsCached(H(5), StateKind::kAttnKv));
  EXPECT_EQ(pool.GetCachedBlock(H(5)), b);
  EXPECT_EQ(sink.events().size(), 1u);
  EXPECT_EQ(pool.GetNewBlock(), b);
  pool.FlushEvents();
  EXPECT_FALSE(pool.IsCached(H(5), StateKind::kAttnKv));
  ASSERT_EQ(sink.events().size(), 2u);
  EXPECT_EQ(sink.events()[1].type, KvEvent::Type::kRemoved);
}

// A hit shares a copy in use rather than taking a free one off the queue: here the newer
// copy (the chain head) was freed while the older one is still held.
TEST(BlockPoolTest, CachedLookupPrefersACopyInUse) {
  BlockPool pool({.num_blocks = 4});
  const BlockId a = pool.GetNewBlock(), b = pool.GetNewBlock();
  pool.CacheFullBlocks(std::vector<BlockId>{a}, std::vector<BlockHash>{H(5)}, std::nullopt);
  pool.CacheFullBlocks(std::vector<BlockId>{b}, std::vector<BlockHash>{H(5)}, std::nullopt);
  EXPECT_EQ(pool.GetCachedBlock(H(5)), b);  // both in use: the newest
  pool.FreeBlock(b);
  EXPECT_EQ(pool.GetCachedBlock(H(5)), a) << "the free copy would cost a page";
  const int free_before = pool.num_free_blocks();
  pool.Touch(pool.GetCachedBlock(H(5)));
  EXPECT_EQ(pool.num_free_blocks(), free_before);
  pool.FreeBlock(a);
  pool.FreeBlock(a);
  EXPECT_EQ(pool.GetCachedBlock(H(5)), b) << "none in use: the newest";
}

// The removed event names the page that held the last copy: a write-back tier copies
// the bytes from there (the first copy's page may hold another block by then).
TEST(BlockPoolTest, RemovedEventNamesThePageOfTheLastCopy) {
  for (bool first_copy_goes_first : {true, false}) {
    RecordingEventSink sink;
    BlockPool pool({.num_blocks = 4, .event_sink = &sink});
    const BlockId a = pool.GetNewBlock(), b = pool.GetNewBlock(), c = pool.GetNewBlock();
    pool.CacheFullBlocks(std::vector<BlockId>{a}, std::vector<BlockHash>{H(5)}, std::nullopt);
    pool.CacheFullBlocks(std::vector<BlockId>{b}, std::vector<BlockHash>{H(5)}, std::nullopt);
    pool.CacheFullBlocks(std::vector<BlockId>{c}, std::vector<BlockHash>{H(6)}, H(5));
    const BlockId goes_first = first_copy_goes_first ? a : b, goes_last = first_copy_goes_first ? b : a;
    pool.FreeBlock(goes_first);
    pool.FreeBlock(goes_last);
    pool.FreeBlock(c);
    EXPECT_EQ(pool.GetNewBlock(), goes_first);
    pool.FlushEvents();
    EXPECT_EQ(sink.events().size(), 2u) << "no event while a copy remains";
    EXPECT_EQ(pool.GetNewBlock(), goes_last);
    EXPECT_EQ(pool.GetNewBlock(), c);
    pool.FlushEvents();
    ASSERT_EQ(sink.events().size(), 3u);
    const KvEvent& e = sink.events()[2];
    EXPECT_EQ(e.type, KvEvent::Type::kRemoved);
    EXPECT_THAT(e.hashes, ElementsAre(H(5), H(6)));
    EXPECT_THAT(e.pages, ElementsAre(goes_last, c));
    EXPECT_TRUE(sink.events()[0].pages.empty()) << "stored events carry no pages";
  }
}

TEST(BlockPoolTest, CheckpointRunIsEvictedAsAUnit) {
  RecordingEventSink sink;
  BlockPool pool({.num_blocks = 6, .event_sink = &sink});
  const BlockId head = pool.GetNewRun(3);
  EXPECT_EQ(pool.num_free_blocks(), 2);
  pool.CacheCheckpoint(head, H(77), H(76));
  const std::vector<BlockId> pages = pool.RunPages(head);
  ASSERT_EQ(pages.size(), 3u);
  pool.FreeRun(head);
  EXPECT_EQ(pool.num_free_blocks(), 5);
  // Two never-used blocks first, then the run's pages.
  EXPECT_EQ(pool.GetNewBlock(), 4);
  EXPECT_EQ(pool.GetNewBlock(), 5);
  EXPECT_EQ(pool.GetCachedCheckpoint(H(77)), head);
  // Reusing one page of the run drops the checkpoint; its other pages become plain free
  // blocks at the head of the queue.
  const BlockId taken = pool.GetNewBlock();
  pool.FlushEvents();
  EXPECT_EQ(taken, pages[0]);
  EXPECT_EQ(pool.GetCachedCheckpoint(H(77)), kNoBlock);
  EXPECT_EQ(pool.num_free_blocks(), 2);
  for (BlockId p : pool.FreeQueueOrder()) {
    EXPECT_FALSE(pool.block(p).is_cached);
    EXPECT_EQ(pool.block(p).kind, StateKind::kAttnKv);
  }
  ASSERT_EQ(sink.events().size(), 2u);
  EXPECT_EQ(sink.events()[0].kind, StateKind::kLinearState);
  EXPECT_EQ(sink.events()[0].parent, H(76));
  EXPECT_EQ(sink.events()[1].type, KvEvent::Type::kRemoved);
  EXPECT_EQ(sink.events()[1].kind, StateKind::kLinearState);
  EXPECT_EQ(pool.stats().evicted_checkpoints, 1u);
}

TEST(BlockPoolTest, UncachedRunDissolvesIntoFreeBlocks) {
  BlockPool pool({.num_blocks = 5});
  const BlockId head = pool.GetNewRun(2);
  pool.FreeRun(head);
  EXPECT_EQ(pool.num_free_blocks(), 4);
  for (BlockId p = 1; p < 5; ++p) EXPECT_EQ(pool.block(p).run_head, kNoBlock);
}

TEST(BlockPoolTest, EvictCachedDropsOnlyFreeCopies) {
  BlockPool pool({.num_blocks = 4});
  const BlockId a = pool.GetNewBlock(), b = pool.GetNewBlock();
  pool.CacheFullBlocks(std::vector<BlockId>{a}, std::vector<BlockHash>{H(3)}, std::nullopt);
  EXPECT_EQ(pool.EvictCached(H(3), StateKind::kAttnKv).status().code(),
            absl::StatusCode::kFailedPrecondition);
  pool.CacheFullBlocks(std::vector<BlockId>{b}, std::vector<BlockHash>{H(3)}, std::nullopt);
  pool.FreeBlock(b);
  auto dropped = pool.EvictCached(H(3), StateKind::kAttnKv);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(*dropped, 1);
  EXPECT_EQ(pool.GetCachedBlock(H(3)), a);
  EXPECT_EQ(pool.FreeQueueOrder().front(), b);
  EXPECT_EQ(pool.EvictCached(H(4), StateKind::kAttnKv).status().code(),
            absl::StatusCode::kNotFound);
}

// EvictCachedBlock drops one copy, whichever it is in the hash's duplicate chain; the
// other copies keep the hash cached (no `removed` event until the last one goes).
TEST(BlockPoolTest, EvictCachedBlockDropsOneCopy) {
  RecordingEventSink sink;
  BlockPool pool({.num_blocks = 5, .event_sink = &sink});
  const BlockId a = pool.GetNewBlock(), b = pool.GetNewBlock(), c = pool.GetNewBlock();
  for (BlockId id : {a, b, c}) {
    pool.CacheFullBlocks(std::vector<BlockId>{id}, std::vector<BlockHash>{H(3)}, std::nullopt);
  }
  EXPECT_EQ(pool.EvictCachedBlock(b).code(), absl::StatusCode::kFailedPrecondition);  // in use
  pool.FreeBlock(b);
  pool.FreeBlock(c);
  ASSERT_TRUE(pool.EvictCachedBlock(b).ok());  // the middle of the chain
  EXPECT_FALSE(pool.block(b).is_cached);
  EXPECT_TRUE(pool.block(a).is_cached);
  EXPECT_TRUE(pool.block(c).is_cached);
  EXPECT_EQ(pool.FreeQueueOrder().front(), b);
  ASSERT_TRUE(pool.EvictCachedBlock(c).ok());
  EXPECT_EQ(pool.GetCachedBlock(H(3)), a);
  EXPECT_EQ(pool.EvictCachedBlock(c).code(), absl::StatusCode::kNotFound);  // not cached any more
  EXPECT_EQ(pool.EvictCachedBlock(0).code(), absl::StatusCode::kNotFound);  // the null block
  EXPECT_EQ(pool.EvictCachedBlock(99).code(), absl::StatusCode::kNotFound);
  size_t removed = 0;
  for (const auto& e : sink.events()) removed += e.type == KvEvent::Type::kRemoved;
  EXPECT_EQ(removed, 0u);  // a is still cached under H(3)
  pool.FreeBlock(a);
  ASSERT_TRUE(pool.EvictCachedBlock(a).ok());
  EXPECT_EQ(pool.GetCachedBlock(H(3)), kNoBlock);
  ASSERT_FALSE(sink.events().empty());
  EXPECT_EQ(sink.events().back().type, KvEvent::Type::kRemoved);
}

TEST(BlockPoolTest, ResetRefusesWhileInUse) {
  RecordingEventSink sink;
  BlockPool pool({.num_blocks = 3, .event_sink = &sink});
  const BlockId a = pool.GetNewBlock();
  pool.CacheFullBlocks(std::vector<BlockId>{a}, std::vector<BlockHash>{H(1)}, std::nullopt);
  absl::Status s = pool.ResetPrefixCache();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(pool.IsCached(H(1), StateKind::kAttnKv));
  pool.FreeBlock(a);
  ASSERT_TRUE(pool.ResetPrefixCache().ok());
  EXPECT_FALSE(pool.IsCached(H(1), StateKind::kAttnKv));
  EXPECT_EQ(sink.events().back().type, KvEvent::Type::kCleared);
}

}  // namespace
}  // namespace kvpool::cache
