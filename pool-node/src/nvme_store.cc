#include "nvme_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"
#include "spdlog/spdlog.h"

namespace kvpool::pool_node {
namespace {

constexpr uint64_t kMagic = 0x314c4e524a50564bull;  // "KVPJRNL1"
constexpr uint8_t kHeader = 0, kAdd = 1, kDel = 2;
constexpr uint32_t kMaxOpBytes = 1u << 20;

void Put64(std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }
void Put32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }

// [u32 body length][body = u8 type + payload][u64 XXH3-64 of body]
std::string Frame(uint8_t type, const std::string& payload) {
  std::string body(1, static_cast<char>(type));
  body += payload;
  std::string out;
  Put32(out, static_cast<uint32_t>(body.size()));
  out += body;
  Put64(out, XXH3_64bits(body.data(), body.size()));
  return out;
}

std::string AddRecord(const NvmeRecord& r) {
  std::string p;
  Put64(p, r.key.hash.lo);
  Put64(p, r.key.hash.hi);
  p.push_back(static_cast<char>(r.key.kind));
  p.push_back(r.parent ? 1 : 0);
  Put64(p, r.parent ? r.parent->lo : 0);
  Put64(p, r.parent ? r.parent->hi : 0);
  Put64(p, r.length);
  Put64(p, r.checksum);
  Put32(p, static_cast<uint32_t>(r.pages.size()));
  for (uint32_t pg : r.pages) Put32(p, pg);
  return Frame(kAdd, p);
}

std::string DelRecord(const ObjectKey& k) {
  std::string p;
  Put64(p, k.hash.lo);
  Put64(p, k.hash.hi);
  p.push_back(static_cast<char>(k.kind));
  return Frame(kDel, p);
}

std::string HeaderRecord(uint64_t page_bytes, uint64_t num_pages) {
  std::string p;
  Put64(p, kMagic);
  Put64(p, page_bytes);
  Put64(p, num_pages);
  return Frame(kHeader, p);
}

struct Reader {
  const char* p;
  const char* end;
  bool ok = true;
  uint64_t U64() { uint64_t v = 0; if (end - p < 8) { ok = false; return 0; } std::memcpy(&v, p, 8); p += 8; return v; }
  uint32_t U32() { uint32_t v = 0; if (end - p < 4) { ok = false; return 0; } std::memcpy(&v, p, 4); p += 4; return v; }
  uint8_t U8() { if (end - p < 1) { ok = false; return 0; } return static_cast<uint8_t>(*p++); }
};

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

absl::Status WriteAll(int fd, const std::string& bytes, const std::string& path) {
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Errno("write", path);
    off += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Checks that `dir` takes O_DIRECT I/O of `page_bytes` (some filesystems refuse it at
// open, some only at the first read or write).
absl::Status ProbeDirectIo(const std::string& dir, uint64_t page_bytes) {
  const std::string path = dir + "/.kvpool-odirect-probe";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  int err = fd < 0 ? errno : 0;
  if (fd >= 0) {
    void* buf = nullptr;
    if (posix_memalign(&buf, 4096, page_bytes) != 0) {
      ::close(fd);
      return absl::ResourceExhaustedError("posix_memalign for the O_DIRECT probe failed");
    }
    std::memset(buf, 0x5a, page_bytes);
    if (::pwrite(fd, buf, page_bytes, 0) != static_cast<ssize_t>(page_bytes)) err = errno ? errno : EIO;
    else if (::pread(fd, buf, page_bytes, 0) != static_cast<ssize_t>(page_bytes)) err = errno ? errno : EIO;
    std::free(buf);
    ::close(fd);
  }
  ::unlink(path.c_str());
  if (err == EINVAL) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--nvme-dir=", dir, " does not support O_DIRECT I/O (EINVAL); put the NVMe tier on a "
        "filesystem that does, e.g. ext4 or xfs on the NVMe device"));
  }
  if (err != 0) {
    return absl::FailedPreconditionError(absl::StrCat("--nvme-dir=", dir, ": O_DIRECT probe failed: ",
                                                      std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<NvmeStore>> NvmeStore::Open(const std::string& dir,
                                                           uint64_t capacity_bytes,
                                                           uint64_t page_bytes,
                                                           unsigned queue_depth,
                                                           std::span<std::byte> fixed,
                                                           std::vector<NvmeRecord>* recovered) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("--nvme-dir=", dir, " cannot be created: ", ec.message()));
  }
  std::unique_ptr<NvmeStore> s(new NvmeStore());
  // One store per directory: a second one replayed the journal and renamed a fresh one
  // over it, leaving the running node appending to an unlinked file (its records lost
  // at its next start), and both wrote the same data file. The lock goes with the
  // process (closed at exit, however it ends).
  {
    const std::string lock_path = dir + "/kvpool-nvme.lock";
    s->lock_fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (s->lock_fd_ < 0) return Errno("open", lock_path);
    if (::flock(s->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK) return Errno("flock", lock_path);
      char pid[32] = {};
      const ssize_t n = ::pread(s->lock_fd_, pid, sizeof(pid) - 1, 0);
      return absl::FailedPreconditionError(absl::StrCat(
          "--nvme-dir=", dir, " is in use by another kvpool-node (pid ", n > 0 ? absl::StripAsciiWhitespace(pid) : "unknown",
          ", holding ", lock_path, "); give each node its own --nvme-dir, or stop that one first"));
    }
    const std::string me = absl::StrCat(::getpid(), "\n");
    if (::ftruncate(s->lock_fd_, 0) != 0 || ::pwrite(s->lock_fd_, me.data(), me.size(), 0) < 0) {
      spdlog::warn("could not write the pid into {}: {}", lock_path, std::strerror(errno));  // the lock holds anyway
    }
  }
  RETURN_IF_ERROR(ProbeDirectIo(dir, page_bytes));
  s->page_bytes_ = page_bytes;
  const uint64_t pages = capacity_bytes / page_bytes;
  if (pages == 0 || pages > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--nvme=", capacity_bytes, " holds ", pages,
                                                   " pages of --page-bytes=", page_bytes,
                                                   "; give 1..2^32-1 pages"));
  }
  s->num_pages_ = static_cast<uint32_t>(pages);
  s->data_path_ = dir + "/kvpool-nvme.data";
  const std::string journal_path = dir + "/kvpool-nvme.journal";

  // Replay the journal.
  absl::flat_hash_map<ObjectKey, NvmeRecord> live;
  uint64_t skipped_bytes = 0;  // of frames that fail their checksum before the tail
  {
    // Only "no journal yet" starts empty: any other failure to read it must not lead to
    // the rewrite below replacing it with an empty one.
    int jfd = ::open(journal_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (jfd < 0 && errno != ENOENT) return Errno("open", journal_path);
    if (jfd >= 0) {
      std::string data;
      char buf[1 << 16];
      for (;;) {
        const ssize_t n = ::read(jfd, buf, sizeof(buf));
        if (n > 0) {
          data.append(buf, static_cast<size_t>(n));
        } else if (n == 0) {
          break;
        } else if (errno != EINTR) {
          const int err = errno;
          ::close(jfd);
          errno = err;
          return Errno("read", journal_path);
        }
      }
      ::close(jfd);
      const char* p = data.data();
      const char* end = p + data.size();
      // A whole frame at `at` that passes its checksum (its length, or 0 if none). No
      // record is longer than an ADD of the largest object: a longer length field is not
      // hashed (a resync over damage would otherwise hash up to the file's size at every
      // offset).
      const uint64_t max_len = 128 + 4 * (kMaxObjectBytes / page_bytes + 1);
      auto frame_at = [&](const char* at) -> uint32_t {
        if (end - at < 4) return 0;
        uint32_t len;
        std::memcpy(&len, at, 4);
        if (len == 0 || len > max_len || static_cast<uint64_t>(end - at) < 4ull + len + 8) return 0;
        uint64_t sum;
        std::memcpy(&sum, at + 4 + len, 8);
        return XXH3_64bits(at + 4, len) == sum ? len : 0;
      };
      bool first = true;
      while (end - p >= 4) {
        uint32_t len = frame_at(p);
        if (len == 0) {
          // A torn tail (the last append, cut short by a crash) ends the journal. Bytes
          // that fail their checksum with whole frames after them are damage: skip to
          // the next frame that passes its own (XXH3: a false match is ~2^-64 per
          // offset), so one bad record does not take every later one with it.
          const char* next = p + 1;
          while (end - next >= 4 && frame_at(next) == 0) ++next;
          if (end - next < 4) break;
          if (first) {
            return absl::DataLossError(absl::StrCat(
                journal_path, ": its header fails its checksum, so what it records cannot be "
                "trusted; move it (and kvpool-nvme.data) away to start with an empty NVMe tier"));
          }
          skipped_bytes += static_cast<uint64_t>(next - p);
          p = next;
          len = frame_at(p);
        }
        const char* body = p + 4;
        p = body + len + 8;
        Reader r{body + 1, body + len};
        const uint8_t type = static_cast<uint8_t>(body[0]);
        if (first) {
          first = false;
          if (type != kHeader || r.U64() != kMagic) {
            return absl::FailedPreconditionError(absl::StrCat(
                journal_path, " is not a kvpool NVMe journal; point --nvme-dir at an empty or "
                "kvpool-owned directory"));
          }
          const uint64_t jpage = r.U64(), jpages = r.U64();
          if (jpage != page_bytes || jpages != pages) {
            return absl::FailedPreconditionError(absl::StrCat(
                "--nvme-dir=", dir, " was written with --page-bytes=", jpage, " and ", jpages,
                " pages (--nvme=", jpage * jpages, "); restart with those values or use an "
                "empty --nvme-dir"));
          }
          continue;
        }
        if (type == kAdd) {
          NvmeRecord rec;
          rec.key.hash.lo = r.U64();
          rec.key.hash.hi = r.U64();
          const uint8_t kind = r.U8();
          rec.key.kind = static_cast<StateKind>(kind);
          const bool has_parent = r.U8() != 0;
          BlockHash parent{r.U64(), 0};
          parent.hi = r.U64();
          if (has_parent) rec.parent = parent;
          rec.length = r.U64();
          rec.checksum = r.U64();
          const uint32_t np = r.U32();
          for (uint32_t i = 0; i < np && r.ok; ++i) rec.pages.push_back(r.U32());
          if (r.ok && kind < kNumKinds) live[rec.key] = std::move(rec);
          else if (r.ok) ++s->dropped_records_;
        } else if (type == kDel) {
          ObjectKey k;
          k.hash.lo = r.U64();
          k.hash.hi = r.U64();
          k.kind = static_cast<StateKind>(r.U8());
          if (r.ok) live.erase(k);
        }
      }
    }
  }

  // Data file.
  s->data_fd_ = ::open(s->data_path_.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
  if (s->data_fd_ < 0) {
    if (errno == EINVAL) {
      return absl::FailedPreconditionError(absl::StrCat("--nvme-dir=", dir,
                                                        " does not support O_DIRECT (EINVAL)"));
    }
    return Errno("open", s->data_path_);
  }
  const off_t want = static_cast<off_t>(pages * page_bytes);
  struct stat st{};
  if (::fstat(s->data_fd_, &st) != 0) return Errno("stat", s->data_path_);
  if (st.st_size < want && ::fallocate(s->data_fd_, 0, 0, want) != 0) {
    // Only a file system without fallocate gets a sparse file: on ENOSPC (or any other
    // error) the tier would advertise room the disk does not have.
    if (errno != EOPNOTSUPP) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot reserve --nvme=", want, " bytes for ", s->data_path_, ": ", std::strerror(errno),
          "; free space under --nvme-dir or lower --nvme"));
    }
    if (::ftruncate(s->data_fd_, want) != 0) return Errno("size", s->data_path_);
  }

  // Records that cannot be right are dropped before the compacted journal is written, so
  // they do not outlive this start (their pages are free from now on): a page count that
  // does not fit the length, a page past the file, a page one record lists twice, or a
  // page two records claim (both go:
  // which one wrote last is not known; a checksum would catch it, but the other object's
  // pages would be handed out again while it is still listed).
  {
    absl::flat_hash_map<uint32_t, ObjectKey> owner;
    absl::flat_hash_set<ObjectKey> bad;
    for (const auto& [key, rec] : live) {
      // (A length beyond kMaxObjectBytes, e.g. one near 2^64, wrapped the page count to 0.)
      const bool length_ok = rec.length > 0 && rec.length <= kMaxObjectBytes;
      bool ok = length_ok && rec.pages.size() == (rec.length + page_bytes - 1) / page_bytes;
      for (uint32_t pg : rec.pages) {
        if (pg >= pages) {
          ok = false;
          continue;
        }
        auto [it, fresh] = owner.try_emplace(pg, key);
        if (!fresh) {  // another record's page, or one this record lists twice
          if (!(it->second == key)) bad.insert(it->second);
          ok = false;
        }
      }
      if (!ok) bad.insert(key);
    }
    for (const ObjectKey& k : bad) live.erase(k);
    s->dropped_records_ += bad.size();
  }
  if (skipped_bytes > 0) {
    // The damaged journal is kept for inspection under a second name (a link: the
    // journal itself stays in place until the rewrite below replaces it, so a failed
    // rewrite or a crash here leaves it as it was).
    const std::string kept = journal_path + ".damaged";
    ::unlink(kept.c_str());
    const bool saved = ::link(journal_path.c_str(), kept.c_str()) == 0;
    ++s->dropped_records_;  // at least one record (maybe more) is in the skipped bytes
    spdlog::error("NVMe journal {}: {} bytes fail their checksum before its end; skipped to the "
                  "records after them (a record lost there may be an object's ADD or DEL){}",
                  journal_path, skipped_bytes, saved ? absl::StrCat("; the damaged journal is kept as ", kept) : "");
  }
  if (s->dropped_records_ > 0) {
    spdlog::warn("NVMe journal {}: dropped {} records that cannot be right (damaged, unknown kind, "
                 "pages that do not fit, or pages claimed twice); their pages are free",
                 journal_path, s->dropped_records_);
  }

  recovered->clear();
  for (auto& [key, rec] : live) recovered->push_back(std::move(rec));
  s->journal_path_ = journal_path;
  (void)s->BeginRewrite();  // nothing else runs yet
  RETURN_IF_ERROR(s->FinishRewrite(*recovered));
  ASSIGN_OR_RETURN(s->engine_, UringEngine::Create(s->data_fd_, queue_depth, fixed));
  return s;
}

NvmeStore::~NvmeStore() {
  engine_.reset();
  if (data_fd_ >= 0) ::close(data_fd_);
  {
    absl::MutexLock l(&journal_mu_);
    if (journal_fd_ >= 0) ::close(journal_fd_);
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);  // last: the files are closed
}

absl::Status NvmeStore::Transfer(bool write, std::span<const uint32_t> nvme_pages,
                                 std::span<std::byte* const> memory,
                                 std::vector<absl::Status>* page_status) {
  return FinishTransfer(*StartTransfer(write, nvme_pages, memory), page_status);
}

std::unique_ptr<NvmeStore::PendingTransfer> NvmeStore::StartTransfer(
    bool write, std::span<const uint32_t> nvme_pages, std::span<std::byte* const> memory) {
  auto t = std::make_unique<PendingTransfer>();
  std::vector<IoOp> ops;
  t->op_of_page.resize(nvme_pages.size());
  for (size_t i = 0; i < nvme_pages.size(); ++i) {
    const uint64_t off = static_cast<uint64_t>(nvme_pages[i]) * page_bytes_;
    if (!ops.empty()) {
      IoOp& last = ops.back();
      if (last.file_offset + last.bytes == off && last.buffer + last.bytes == memory[i] &&
          last.bytes + page_bytes_ <= kMaxOpBytes) {
        last.bytes += static_cast<uint32_t>(page_bytes_);
        t->op_of_page[i] = ops.size() - 1;
        continue;
      }
    }
    t->op_of_page[i] = ops.size();
    ops.push_back(IoOp{write, off, memory[i], static_cast<uint32_t>(page_bytes_)});
  }
  engine_->Submit(t->batch, ops, &t->op_status);
  return t;
}

absl::Status NvmeStore::FinishTransfer(PendingTransfer& t, std::vector<absl::Status>* page_status) {
  absl::Status st = engine_->Wait(t.batch);
  if (page_status != nullptr) {
    page_status->resize(t.op_of_page.size());
    for (size_t i = 0; i < t.op_of_page.size(); ++i) (*page_status)[i] = t.op_status[t.op_of_page[i]];
  }
  return st;
}

// Compacted journal: header + one ADD per live object, written beside the journal and
// renamed over it (a crash leaves the old or the new one, both complete).
bool NvmeStore::BeginRewrite() {
  absl::MutexLock l(&journal_mu_);
  if (rewriting_) return false;
  rewriting_ = true;
  appended_while_rewriting_.clear();
  failed_while_rewriting_ = false;
  backlog_overflowed_ = false;
  return true;
}

absl::Status NvmeStore::FinishRewrite(std::span<const NvmeRecord> live) {
  std::string compact = HeaderRecord(page_bytes_, num_pages_);
  for (const NvmeRecord& rec : live) compact += AddRecord(rec);
  const std::string tmp = journal_path_ + ".tmp";
  // Opened for appending from the start: after the rename this descriptor is the
  // journal (no reopen that could fail and leave appends going to the old file).
  int tfd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
  absl::Status ws = tfd < 0 ? Errno("open", tmp) : absl::OkStatus();
  if (ws.ok() && write_fault_) ws = write_fault_(JournalWrite::kRewrite);
  // The bulk of the work (the snapshot's records and their fsync) runs unlocked: appends
  // meanwhile go to the current journal and are remembered. After a rewrite was dropped
  // for its backlog, this one holds the journal lock through its writes and fsync
  // instead (appends wait for it), so that compaction completes on a disk too slow for
  // the other way.
  absl::ReleasableMutexLock hold(&journal_mu_);
  const bool hold_through = hold_next_rewrite_;
  if (!hold_through) hold.Release();
  if (ws.ok()) ws = WriteAll(tfd, compact, tmp);
  // A rewrite dropped for its backlog meanwhile skips the fsync (the slow disk's cost).
  if (ws.ok() && (hold_through || !RewriteDropped()) && ::fsync(tfd) != 0) ws = Errno("fsync", tmp);
  uint64_t tail = 0;
  {
    std::optional<absl::MutexLock> l;
    if (!hold_through) l.emplace(&journal_mu_);
    // The records appended since the snapshot follow it in the new journal (they are in
    // the old one too, so a crash before the rename loses none), then the rename.
    if (ws.ok() && backlog_overflowed_) {
      hold_next_rewrite_ = true;
      ws = absl::ResourceExhaustedError(absl::StrCat(
          "more than ", rewrite_backlog_limit_, " bytes of journal records were appended while ", tmp,
          " was written and synced (a slow disk); the rewrite is dropped and the journal kept as it is "
          "(the next one holds the journal's appends back until it is done)"));
    }
    if (ws.ok()) ws = WriteAll(tfd, appended_while_rewriting_, tmp);
    if (ws.ok() && ::rename(tmp.c_str(), journal_path_.c_str()) != 0) ws = Errno("rename", tmp);
    if (ws.ok()) {
      if (journal_fd_ >= 0) ::close(journal_fd_);
      journal_fd_ = tfd;
      tail = appended_while_rewriting_.size();
      compacted_bytes_ = compact.size();
      journal_bytes_ = compact.size() + tail;
      // An append that failed meanwhile may have held pages back: the next rewrite gives
      // them back.
      rewrite_due_ = failed_while_rewriting_;
      hold_next_rewrite_ = false;
    }
    rewriting_ = false;
    appended_while_rewriting_.clear();
    appended_while_rewriting_.shrink_to_fit();
  }
  if (hold_through) hold.Release();
  if (!ws.ok()) {  // the current journal stays as it was
    if (tfd >= 0) ::close(tfd);
    ::unlink(tmp.c_str());
    return ws;
  }
  // The rename reaches the disk with the directory: without this a power loss could bring
  // back the old journal, naming pages the new one gave back. (A failure here is logged:
  // the new journal is in place for this process either way.)
  const std::string dir = std::filesystem::path(journal_path_).parent_path().string();
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || ::fsync(dfd) != 0) {
    spdlog::warn("fsync of {} after rewriting its NVMe journal: {}", dir, std::strerror(errno));
  }
  if (dfd >= 0) ::close(dfd);
  return absl::OkStatus();
}

bool NvmeStore::JournalWantsCompaction(uint64_t min_bytes) {
  absl::MutexLock l(&journal_mu_);
  return rewrite_due_ || (journal_bytes_ > min_bytes && journal_bytes_ > 4 * compacted_bytes_);
}

absl::Status NvmeStore::Append(const std::string& bytes, bool* may_be_recorded) {
  if (may_be_recorded != nullptr) *may_be_recorded = false;
  absl::MutexLock l(&journal_mu_);
  const off_t end = ::lseek(journal_fd_, 0, SEEK_END);
  auto fault = [&](JournalWrite w) { return write_fault_ ? write_fault_(w) : absl::OkStatus(); };
  absl::Status st = fault(JournalWrite::kAppend);
  bool wrote = false;  // some of the bytes may be in the file
  if (st.ok()) {
    wrote = true;
    st = WriteAll(journal_fd_, bytes, "NVMe journal");
    if (st.ok()) st = fault(JournalWrite::kAppendLanded);
  }
  // A frame cut short mid-journal would end the replay there and lose every later
  // record: cut the file back to where this append began.
  if (!st.ok() && wrote) {
    absl::Status cut = end < 0 ? absl::InternalError(absl::StrCat("lseek: ", std::strerror(errno)))
                               : fault(JournalWrite::kTruncate);
    if (cut.ok() && ::ftruncate(journal_fd_, end) != 0) {
      cut = absl::InternalError(absl::StrCat("ftruncate: ", std::strerror(errno)));
    }
    if (!cut.ok()) {
      st = absl::InternalError(absl::StrCat(st.message(), "; and cutting the failed append back off failed: ",
                                            cut.message()));
      if (may_be_recorded != nullptr) *may_be_recorded = true;
    }
  }
  // A failed append may have left a torn or partial tail: rewrite the journal soon.
  if (!st.ok()) rewrite_due_ = true;
  if (st.ok()) journal_bytes_ += bytes.size();
  if (rewriting_ && !backlog_overflowed_) {
    if (!st.ok()) {
      failed_while_rewriting_ = true;
    } else if (!hold_next_rewrite_ && appended_while_rewriting_.size() + bytes.size() > rewrite_backlog_limit_) {
      backlog_overflowed_ = true;  // FinishRewrite drops the rewrite
      appended_while_rewriting_.clear();
      appended_while_rewriting_.shrink_to_fit();
    } else {
      appended_while_rewriting_ += bytes;
    }
  }
  return st;
}

absl::Status NvmeStore::JournalAdd(std::span<const NvmeRecord> records, bool* may_be_recorded) {
  if (may_be_recorded != nullptr) *may_be_recorded = false;
  std::string out;
  for (const auto& r : records) out += AddRecord(r);
  return out.empty() ? absl::OkStatus() : Append(out, may_be_recorded);
}

absl::Status NvmeStore::JournalRemove(std::span<const ObjectKey> keys) {
  std::string out;
  for (const auto& k : keys) out += DelRecord(k);
  return out.empty() ? absl::OkStatus() : Append(out);
}

}  // namespace kvpool::pool_node
