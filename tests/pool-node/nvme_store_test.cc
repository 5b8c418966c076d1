// NvmeStore's journal: online compaction when records keep coming while it runs.
#include "nvme_store.h"

#include <algorithm>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "test_util.h"

namespace kvpool::pool_node {
namespace {

using testing::H;
using testing::TempDir;

constexpr uint64_t kPage = 4096;
constexpr uint64_t kPages = 64;

NvmeRecord Record(uint32_t i) {
  return NvmeRecord{ObjectKey{H(i), StateKind::kAttnKv}, std::nullopt, kPage, 0x1234 + i, {i}};
}

std::unique_ptr<NvmeStore> Open(const TempDir& dir, std::vector<NvmeRecord>* recovered) {
  auto s = NvmeStore::Open(dir.path(), kPages * kPage, kPage, 32, {}, recovered);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

std::vector<uint32_t> FirstPages(const std::vector<NvmeRecord>& recs) {
  std::vector<uint32_t> out;
  for (const NvmeRecord& r : recs) out.push_back(r.pages.at(0));
  std::sort(out.begin(), out.end());
  return out;
}

// Records appended while a compaction writes its snapshot land in the new journal; past
// the backlog bound the compaction is dropped instead, and the journal keeps them all;
// the one after a dropped compaction holds appends back and so always lands.
TEST(NvmeStoreTest, RecordsAppendedDuringARewriteAreKeptWhetherOrNotItsBacklogFits) {
  TempDir dir;
  std::vector<NvmeRecord> recovered;
  auto store = Open(dir, &recovered);
  ASSERT_NE(store, nullptr);
  std::vector<NvmeRecord> live = {Record(0), Record(1)};
  ASSERT_TRUE(store->JournalAdd(live).ok());

  // Within the bound: the rewrite lands, with the later records after its snapshot.
  ASSERT_TRUE(store->BeginRewrite());
  ASSERT_TRUE(store->JournalAdd(std::vector<NvmeRecord>{Record(2)}).ok());
  ASSERT_TRUE(store->FinishRewrite(live).ok());

  // Past it: FinishRewrite fails, and nothing appended meanwhile is lost.
  store->SetRewriteBacklogLimitForTest(256);
  live.push_back(Record(2));
  ASSERT_TRUE(store->BeginRewrite());
  for (uint32_t i = 3; i < 12; ++i) ASSERT_TRUE(store->JournalAdd(std::vector<NvmeRecord>{Record(i)}).ok());
  const absl::Status dropped = store->FinishRewrite(live);
  EXPECT_EQ(dropped.code(), absl::StatusCode::kResourceExhausted) << dropped;
  EXPECT_NE(dropped.message().find("more than 256 bytes"), std::string::npos) << dropped;
  // The next rewrite holds the journal's appends back through its fsync: whatever came
  // in before it took the lock is kept however large, and it lands.
  for (uint32_t i = 3; i < 12; ++i) live.push_back(Record(i));
  ASSERT_TRUE(store->BeginRewrite());
  for (uint32_t i = 12; i < 21; ++i) ASSERT_TRUE(store->JournalAdd(std::vector<NvmeRecord>{Record(i)}).ok());
  ASSERT_TRUE(store->FinishRewrite(live).ok());
  // Then the bound applies again.
  for (uint32_t i = 12; i < 21; ++i) live.push_back(Record(i));
  ASSERT_TRUE(store->BeginRewrite());
  for (uint32_t i = 21; i < 30; ++i) ASSERT_TRUE(store->JournalAdd(std::vector<NvmeRecord>{Record(i)}).ok());
  EXPECT_EQ(store->FinishRewrite(live).code(), absl::StatusCode::kResourceExhausted);
  store.reset();

  std::vector<uint32_t> want;
  for (uint32_t i = 0; i < 30; ++i) want.push_back(i);
  store = Open(dir, &recovered);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(FirstPages(recovered), want);
  EXPECT_EQ(store->dropped_records(), 0u);
}

}  // namespace
}  // namespace kvpool::pool_node
