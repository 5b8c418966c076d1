// NvmeStore: the NVMe tier's files under --nvme-dir.
//
//   kvpool-nvme.data     capacity_pages * page_bytes, opened O_DIRECT; page p lives at
//                        offset p * page_bytes. Written and read through UringEngine.
//   kvpool-nvme.journal  append-only index: a header (page_bytes, capacity_pages), then
//                        ADD (key, parent, length, checksum, pages) and DEL (key)
//                        records, each with an XXH3-64 of its bytes. Replayed at Open
//                        (stopping at a torn tail) and rewritten compacted, at Open and
//                        while running once it outgrows its live records.
//
// The store knows nothing of leases or eviction: the tier (PoolCore) decides which pages
// an object uses and writes an ADD only after the object's data write completed, so a
// replayed ADD always names written pages. Checksums are verified by the reader.
//
// Durability: journal records reach the page cache before the call returns (a node
// process that crashes or restarts recovers them); they are not fsync'ed per record.
//
// Thread safety: Transfer may run concurrently from many threads. Journal calls are
// serialized by an internal mutex (callers may hold their own lock: the journal does
// buffered write(2), never an io_uring wait; but while a rewrite holds the journal lock
// through its writes and fsync, after the previous one was dropped for its backlog, see
// BeginRewrite, an append waits for that fsync, and so does the caller's lock).
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvpool/pool_node/types.h"
#include "uring_engine.h"

namespace kvpool::pool_node {

struct NvmeRecord {
  ObjectKey key;
  std::optional<BlockHash> parent;
  uint64_t length = 0;
  uint64_t checksum = 0;
  std::vector<uint32_t> pages;
};

class NvmeStore {
 public:
  // Opens (creating if needed) the files in `dir`; fills `recovered` with the objects
  // the journal says the data file holds. `fixed`: memory to register with io_uring.
  static absl::StatusOr<std::unique_ptr<NvmeStore>> Open(const std::string& dir,
                                                         uint64_t capacity_bytes,
                                                         uint64_t page_bytes,
                                                         unsigned queue_depth,
                                                         std::span<std::byte> fixed,
                                                         std::vector<NvmeRecord>* recovered);
  ~NvmeStore();

  uint32_t num_pages() const { return num_pages_; }
  uint64_t page_bytes() const { return page_bytes_; }
  const std::string& data_path() const { return data_path_; }
  bool registered_buffers() const { return engine_->registered_buffers(); }
  unsigned queue_depth() const { return engine_->queue_depth(); }
  // Journal records dropped at Open: an unknown state kind, pages that do not fit the
  // length or the file, or pages claimed by two records.
  uint64_t dropped_records() const { return dropped_records_; }

  // Moves whole pages between memory and the data file: nvme_pages[i] <-> memory[i]
  // (each page_bytes long, 4096-aligned). Neighbouring pages coalesce into one op.
  // `page_status`, when given, gets one status per page (that of the op moving it).
  absl::Status Transfer(bool write, std::span<const uint32_t> nvme_pages,
                        std::span<std::byte* const> memory,
                        std::vector<absl::Status>* page_status = nullptr);
  // Transfer in two halves (UringEngine::Submit/Wait): StartTransfer queues the ops and
  // returns; FinishTransfer waits for them, with Transfer's result. Every started
  // transfer must be finished.
  struct PendingTransfer {
    UringEngine::Batch batch;
    std::vector<size_t> op_of_page;
    std::vector<absl::Status> op_status;
  };
  std::unique_ptr<PendingTransfer> StartTransfer(bool write, std::span<const uint32_t> nvme_pages,
                                                 std::span<std::byte* const> memory);
  absl::Status FinishTransfer(PendingTransfer& t, std::vector<absl::Status>* page_status = nullptr);

  // Fault injection (tests): called before each journal append and each rewrite after
  // Open; an error fails that write.
  void SetWriteFault(std::function<absl::Status(JournalWrite)> fault) { write_fault_ = std::move(fault); }

  // On failure `*may_be_recorded` (when given) says whether the records may still be in
  // the journal (the failed append could not be cut back off): a restart before the next
  // compaction would then find them, so the pages they name must keep their bytes.
  absl::Status JournalAdd(std::span<const NvmeRecord> records, bool* may_be_recorded = nullptr);
  absl::Status JournalRemove(std::span<const ObjectKey> keys);

  // Online compaction (the journal otherwise grows with every demotion and NVMe eviction
  // until the next start). True once the journal holds more than `min_bytes` and 4x
  // what its last compaction wrote (so rewriting costs O(1) per record appended), or
  // when an append failed since the last rewrite (it may have left a torn tail).
  bool JournalWantsCompaction(uint64_t min_bytes);
  // The caller takes a snapshot of the live records under the same lock as its journal
  // calls and calls BeginRewrite before releasing that lock; then, without it,
  // FinishRewrite with the snapshot. Records appended in between go to the current
  // journal as usual (no caller waits for the rewrite's writes and fsyncs) and are
  // copied into the new one before it is renamed over the old. False from BeginRewrite:
  // another rewrite is under way (skip this one).
  // The records appended meanwhile are kept in memory up to kMaxRewriteBacklog bytes
  // (a rewrite whose fsync stalls while the node keeps demoting must not grow the heap
  // without bound): past that the rewrite is dropped (FinishRewrite fails, the current
  // journal stays as it is and keeps every record) and tried again later. That next
  // rewrite holds the journal lock through its writes and fsync, as all of them did
  // before 2026-12-02 (appends, and the node calls that make them, wait), so a disk too
  // slow for the unlocked way still gets its journal compacted.
  bool BeginRewrite();
  absl::Status FinishRewrite(std::span<const NvmeRecord> live);
  bool RewriteDropped() {
    absl::MutexLock l(&journal_mu_);
    return backlog_overflowed_;
  }
  static constexpr uint64_t kMaxRewriteBacklog = 64ull << 20;
  void SetRewriteBacklogLimitForTest(uint64_t bytes) {
    absl::MutexLock l(&journal_mu_);
    rewrite_backlog_limit_ = bytes;
  }
  uint64_t journal_bytes() {
    absl::MutexLock l(&journal_mu_);
    return journal_bytes_;
  }

 private:
  NvmeStore() = default;
  absl::Status Append(const std::string& bytes, bool* may_be_recorded = nullptr);

  uint64_t page_bytes_ = 0;
  uint32_t num_pages_ = 0;
  uint64_t dropped_records_ = 0;
  std::string data_path_;
  int data_fd_ = -1;
  // kvpool-nvme.lock, flock()ed for the store's life: one process per directory.
  int lock_fd_ = -1;
  std::unique_ptr<UringEngine> engine_;


  std::function<absl::Status(JournalWrite)> write_fault_;
  std::string journal_path_;
  absl::Mutex journal_mu_;
  int journal_fd_ ABSL_GUARDED_BY(journal_mu_) = -1;
  uint64_t journal_bytes_ ABSL_GUARDED_BY(journal_mu_) = 0;    // file size
  uint64_t compacted_bytes_ ABSL_GUARDED_BY(journal_mu_) = 0;  // size after the last rewrite
  bool rewrite_due_ ABSL_GUARDED_BY(journal_mu_) = false;      // an append failed since
  // Between BeginRewrite and the end of FinishRewrite: the bytes appended meanwhile
  // (they go into the new journal too), and whether an append failed meanwhile.
  bool rewriting_ ABSL_GUARDED_BY(journal_mu_) = false;
  std::string appended_while_rewriting_ ABSL_GUARDED_BY(journal_mu_);
  bool failed_while_rewriting_ ABSL_GUARDED_BY(journal_mu_) = false;
  bool backlog_overflowed_ ABSL_GUARDED_BY(journal_mu_) = false;  // this rewrite is dropped
  bool hold_next_rewrite_ ABSL_GUARDED_BY(journal_mu_) = false;   // the last one was dropped
  uint64_t rewrite_backlog_limit_ ABSL_GUARDED_BY(journal_mu_) = kMaxRewriteBacklog;
};

}  // namespace kvpool::pool_node
