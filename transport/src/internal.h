// Private to transport/: the worker's progress thread, endpoints and batches.
//
// Threading model: the ucp_worker_h (UCS_THREAD_MODE_SERIALIZED) and every ucp_ep_h /
// ucp_rkey_h made on it are used only under WorkerImpl::ucx_mu_. A submitting thread
// validates its batch without the lock, then takes it to start the batch itself (no
// hand-off to another thread: on CMA the bytes move inside the call); the progress
// thread takes it around each ucp_worker_progress round and sleeps in epoll without it.
// UCX callbacks run under the lock and never block; user callbacks are queued and run
// after the lock is released (so they may submit again).
#pragma once

#include <ucp/api/ucp.h>

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvpool/common/clock.h"
#include "kvpool/common/status.h"
#include "kvpool/transport/transport.h"

namespace kvpool::transport {

// The transport's clock is kvpool::MonotonicNow (kvpool/common/clock.h): batch
// deadlines, peer checks and the progress hand-off follow it, so a wall-clock step (NTP,
// `date -s`) neither fails every batch in flight at once nor stretches a deadline by the
// step. MonoNanos: the same in nanoseconds.
inline int64_t MonoNanos() { return absl::ToUnixNanos(MonotonicNow()); }

// Worker address bytes: our framing around the UCX address (see worker.cc).
std::string WrapAddress(absl::string_view ucx);
// *same_host: the peer runs on this host (and PID namespace), in this process or another;
// *same_host_pid: its pid when it is another process on this host, else 0.
void UnwrapAddress(absl::string_view in, std::string* ucx, pid_t* same_host_pid,
                   bool* same_host);

// ucs_status_t -> absl::Status, once, where UCX hands it to us.
absl::Status FromUcs(ucs_status_t status, absl::string_view what);

// Active-message ids (the owner serves 1 and 3; the initiator handles 2 and 4).
enum AmId : unsigned {
  kAmPut = 1,      // header: AmHeader + segments; payload: the bytes
  kAmPutAck = 2,   // header: AmHeader (status)
  kAmGetReq = 3,   // header: AmHeader + segments
  kAmGetResp = 4,  // header: AmHeader (status); payload: the bytes
};

struct AmHeader {
  uint64_t batch_id;
  uint32_t part;     // message index within the batch (a batch may need several)
  uint32_t status;   // absl::StatusCode for acks/responses
  uint32_t num_segs; // followed by num_segs WireSeg
  // kAmPut: the batch's number of messages when the owner answers the batch once (> 1):
  // one kAmPutAck with part == num_parts after every message landed, or one refusal
  // naming the first part refused. 0: a kAmPutAck per message.
  // kAmGetReq: the messages asked for (> 1: parts part .. part + num_parts - 1, and the
  // segments are followed by num_parts uint32 segment counts, one per message), each
  // answered by its own kAmGetResp. 0: one message.
  uint32_t num_parts;
};
// A refusal (an ack or get response with status != 0) carries the owner's reason as
// its payload, at most this many bytes, and in num_segs the refused segment's index + 1
// within its message (0: not one segment). Initiators that predate this ignore both.
inline constexpr size_t kMaxRefusalBytes = 512;
// The most messages a batch answered once may have (the owner tracks each one).
inline constexpr uint32_t kMaxPartsPerBatch = 1u << 20;
// The most segments in one message's (or one get request's) header.
inline constexpr uint32_t kMaxSegsPerMsg = 64;
// Messages with at most this many payload bytes are sent eagerly (UCP_AM_SEND_FLAG_EAGER)
// rather than by rendezvous: no RTS/RTR round trip per message; the receiver copies the
// payload out of UCX's buffer while it is in cache.
inline constexpr uint64_t kEagerMaxBytes = 1048576;
// UCP_AM_SEND_FLAG_EAGER for a message of these pieces when it is small enough, else 0.
inline uint32_t EagerFlagFor(const std::vector<ucp_dt_iov_t>& iov) {
  uint64_t bytes = 0;
  for (const ucp_dt_iov_t& v : iov) bytes += v.length;
  return bytes <= kEagerMaxBytes ? UCP_AM_SEND_FLAG_EAGER : 0;
}
struct WireSeg {
  uint32_t arena_id;
  uint32_t pad;
  uint64_t offset;  // byte offset in the owner's arena
  uint64_t len;
};

// One contiguous piece of a transfer: local bytes <-> remote bytes.
struct Segment {
  std::byte* local;
  void* memh;  // ucp_mem_h of the local arena
  uint32_t remote_arena;
  uint64_t remote_offset;
  uint64_t len;
  uint32_t op = 0;        // index of the TransferOp (pieces merge across ops only
                          // when nobody observes the bytes)
  bool observed = false;  // ByteObserver already saw it (copied one-sided)
  std::byte* remote_mapped = nullptr;  // the remote bytes mapped here (MapSegments)
};

enum class Direction : uint8_t { kPut, kGet };

class EndpointImpl;
class WorkerImpl;
struct OwnerOp;

// One import of a remote arena: its descriptor and, once unpacked, its rkey. A re-import
// (ImportArena again for the same arena id) makes a new RemoteKey; batches keep the one
// they were validated against, so their offsets always go with that import's base and
// rkey, and the rkey lives as long as any batch (hence any UCX request) still uses it.
// The last reference is dropped under WorkerImpl::ucx_mu_ only (see WorkerImpl::retired_
// and SweepRkeys): ucp_rkey_destroy is a call on the worker.
// Same-host arenas (AllocateArena): a SysV segment mapped at a 2 MiB boundary, so that
// the kernel can map it with 2 MiB pages (see MakeHugeMapped). Null on failure.
std::byte* AttachShared(int shm_id, uint64_t size);
void DetachShared(std::byte* p);
// What /proc/self/maps says of the mapping that holds `p`: the bytes from p to its end
// (with the mappings that continue the same file right after it; 0 if nothing is mapped
// at p), whether it is shared, its inode (0: anonymous) and p's offset in that object.
struct MappedObject {
  uint64_t bytes = 0;
  bool shared = false;
  uint64_t inode = 0;
  uint64_t offset = 0;
};
MappedObject MappedObjectAt(const void* p);

struct RemoteKey {
  explicit RemoteKey(RemoteArena d) : desc(std::move(d)) {}
  ~RemoteKey() {
    Destroy();
    if (mapped != nullptr) DetachShared(mapped);
  }
  RemoteKey(const RemoteKey&) = delete;
  RemoteKey& operator=(const RemoteKey&) = delete;
  void Destroy() {  // under ucx_mu_, before the worker is destroyed
    if (rkey != nullptr) ucp_rkey_destroy(rkey);
    rkey = nullptr;
  }
  const RemoteArena desc;     // immutable
  ucp_rkey_h rkey = nullptr;  // under the worker's ucx_mu_ (unpacked at import or first use)
  // The owner's SysV segment (desc.shm_id) mapped here by this worker, or null (then a
  // same-host copy goes through UCX's own mapping, ucp_rkey_ptr). Set with the rkey.
  std::byte* mapped = nullptr;
  // Set with the rkey when the import cannot be used (RkeyFor then returns null): why,
  // for the batches that name it. Under ucx_mu_.
  std::string refused;
};

// A batch in flight. Owned by WorkerImpl::batches_ (a mapped shared-memory batch never
// enters it: its submitter runs it without the lock); touched under ucx_mu_, by whichever
// thread holds it (a submitter starting it, the progress thread, a caller driving
// progress).
struct Batch {
  WorkerImpl* worker = nullptr;
  uint64_t id = 0;
  Direction dir = Direction::kPut;
  std::shared_ptr<EndpointImpl> ep;
  BatchCallback done;
  ByteObserver observe;  // optional
  ByteCopier copy;       // optional, with observe
  std::vector<std::shared_ptr<Arena>> hold;  // local arenas stay registered meanwhile
  std::vector<Segment> segs;
  // The imports the segments were validated against (by arena id; usually one).
  std::vector<std::shared_ptr<RemoteKey>> remote;
  RemoteKey* Import(uint32_t arena_id) const {
    for (const auto& k : remote) {
      if (k->desc.arena_id == arena_id) return k.get();
    }
    return nullptr;
  }
  uint64_t bytes = 0;
  absl::Time deadline;
  // Operations (UCX requests + expected AM replies) not yet completed. The batch is
  // freed when it is finished and nothing is outstanding.
  int outstanding = 0;
  // AM: the replies (acks, get responses) among `outstanding` not yet received. Zeroed
  // (and taken out of `outstanding`) when the endpoint fails or closes: they cannot
  // arrive any more, and a late one is then ignored.
  int replies_awaited = 0;
  bool finished = false;
  absl::Status status;  // first error
  // `done` has been handed to ready_. Normally when the batch is freed (finished and
  // nothing outstanding: UCX no longer writes into or reads from the caller's pages);
  // early only for an endpoint UCX cannot cancel (see CheckDeadlines).
  bool delivered = false;
  // AM: per message, its reply arrived (a duplicate must not count down another's). A put
  // of several messages awaits one reply for the batch (one_reply, AmHeader::num_parts):
  // then answered has one entry.
  std::vector<bool> answered;
  bool one_reply = false;
  // AM: per-message local iovs and headers (alive until the message completes).
  std::vector<std::vector<ucp_dt_iov_t>> iovs;
  std::vector<size_t> msg_first_seg;  // AM: each message's first index in segs
  std::vector<std::string> headers;
};

class EndpointImpl : public std::enable_shared_from_this<EndpointImpl> {
 public:
  EndpointImpl(std::weak_ptr<WorkerImpl> worker, std::string name)
      : worker_(std::move(worker)), name_(std::move(name)) {}

  std::weak_ptr<WorkerImpl> worker_;
  std::string name_;
  Protocol protocol_ = Protocol::kAuto;
  std::string describe_;
  bool peer_failure_detection_ = true;  // UCP_ERR_HANDLING_MODE_PEER in effect
  pid_t peer_pid_ = 0;                   // same-host peer process, 0 when unknown
  // pidfd of peer_pid_ (-1: none, or a kernel without pidfd_open): readable once the
  // peer exited. A poll on it costs ~60% of kill(pid, 0) (no LSM/audit hooks, measured
  // ~360 vs ~600 ns once; ~1.2 us on a VM whose every system call costs ~1 us) and is
  // immune to pid reuse.
  int peer_pidfd_ = -1;
  ~EndpointImpl();
  bool shm_lanes_ = false;               // some lane moves bytes through shared memory
  // True when UCX cannot watch the peer and its (same-host) process has exited. Asks the
  // kernel at most once per kPeerCheckIntervalNs (any thread); in between it answers from
  // the last look, so a batch that completes less than that after the peer's exit may
  // still succeed (its bytes did land in the mapped segment). Once gone, always gone.
  bool PeerProcessGone() const;
  static constexpr int64_t kPeerCheckIntervalNs = 1'000'000;  // 1 ms
  mutable std::atomic<int64_t> peer_checked_ns_{0};
  mutable std::atomic<bool> peer_gone_{false};

  // Under the worker's ucx_mu_ (like every ucp_ep_h).
  ucp_ep_h ep_ = nullptr;

  absl::Status health() const {
    absl::MutexLock l(&mu_);
    return health_;
  }
  void SetHealth(absl::Status s) {
    absl::MutexLock l(&mu_);
    if (health_.ok()) health_ = std::move(s);
  }

  mutable absl::Mutex mu_;
  absl::Status health_ ABSL_GUARDED_BY(mu_);
  // The current import of each remote arena: descriptors for validation (any thread)
  // and rkeys (unpacked under the worker's ucx_mu_). Never null.
  absl::flat_hash_map<uint32_t, std::shared_ptr<RemoteKey>> imported_ ABSL_GUARDED_BY(mu_);
  // Imports replaced by a re-import; moved to WorkerImpl::retired_ under ucx_mu_ (batches
  // may still use their rkeys).
  std::vector<std::shared_ptr<RemoteKey>> stale_keys_ ABSL_GUARDED_BY(mu_);
};

class WorkerImpl : public std::enable_shared_from_this<WorkerImpl> {
 public:
  WorkerImpl(std::shared_ptr<Context> context, WorkerOptions options)
      : context_(std::move(context)), options_(options) {}
  ~WorkerImpl();

  absl::Status Start();  // creates the ucp worker + thread
  void Shutdown();       // idempotent; joins the thread

  // Runs fn on the progress thread (returns false when shut down).
  bool Post(std::function<void()> fn);
  // Runs fn on the calling thread under ucx_mu_ (the progress thread backs off meanwhile),
  // then the callbacks of batches that completed (BatchCallback).
  absl::Status RunSync(std::function<absl::Status()> fn);

  absl::StatusOr<std::shared_ptr<Arena>> Register(std::byte* base, uint64_t size,
                                                  uint64_t page_bytes, bool owns);
  void Forget(uint32_t id);
  absl::StatusOr<std::shared_ptr<EndpointImpl>> Connect(absl::string_view address,
                                                    absl::string_view name);
  absl::Status Submit(const std::shared_ptr<EndpointImpl>& ep, Direction dir,
                      std::vector<TransferOp> ops, BatchCallback done,
                      ByteObserver observe = nullptr, ByteCopier copy = nullptr);
  void CloseEndpoint(std::shared_ptr<EndpointImpl> ep);

  // Callbacks from UCX: they run under ucx_mu_, on whichever thread drives progress.
  void OnOpDone(Batch* b, ucs_status_t status);
  void OwnerOpDone(bool ok);
  void OwnerPutReceived(OwnerOp* op, ucs_status_t status);
  std::shared_ptr<Arena> FindArena(uint32_t id);
  void OnEpError(EndpointImpl* ep, ucs_status_t status);
  // The unpacked rkey of an import (unpacked on first use; null when it cannot be);
  // holds ucx_mu_.
  ucp_rkey_h RkeyFor(EndpointImpl& ep, RemoteKey& key);
  ucs_status_t OnAm(unsigned id, const void* header, size_t header_len, void* data,
                    size_t len, const ucp_am_recv_param_t* param);

  std::shared_ptr<Context> context_;
  WorkerOptions options_;
  std::string address_;
  ucp_worker_h worker_ = nullptr;  // calls on it hold ucx_mu_

  // Serializes every UCX call on worker_, its endpoints and rkeys, and guards the batch
  // state below. Held briefly: by the progress thread around one progress round, by a
  // submitter around starting its batch. Never held while a user callback runs.
  absl::Mutex ucx_mu_;
  bool closed_ ABSL_GUARDED_BY(ucx_mu_) = false;
  // Submit's copies into or out of mapped peer memory, running outside ucx_mu_: counted
  // up under it (while !closed_), down when the copy is done. Shutdown waits for none to
  // be left before it destroys rkeys: a fallback arena's mapping is UCX's, released with
  // its rkey, so a copy still running would read or write unmapped memory.
  std::atomic<int> mapped_copies_{0};
  // Finished batches' callbacks, run by RunCallbacks after ucx_mu_ is released.
  std::vector<std::pair<BatchCallback, absl::Status>> ready_ ABSL_GUARDED_BY(ucx_mu_);
  void RunCallbacks();
  bool ProgressFromCaller();
  // When a caller last drove progress (Worker::Progress), MonoNanos;
  // relaxed: a hint for the progress thread to back off, nothing is published through it.
  std::atomic<int64_t> external_progress_ns_{0};
  // Callers inside Worker::Progress now (the progress thread stays out meanwhile).
  std::atomic<int> callers_progressing_{0};
  // The progress thread leaves UCX to a caller that polled within this many ns, and
  // sleeps meanwhile until that much time has passed since the caller's last call.
  static constexpr int64_t kCallerProgressNs = 2'000'000;
  // How long the caller's window still lasts (the whole window while a caller is inside
  // Progress); <= 0: no caller drives progress.
  int64_t CallerWindowLeftNs() const;
  bool CallerDrivesProgress() const { return CallerWindowLeftNs() > 0; }
  // Whether a submitter must wake the progress thread (ucp_worker_signal: a write(2) on
  // UCX's event fd) for a batch it leaves in flight. Only a thread asleep in epoll needs
  // it: one that polls, or that sleeps between rounds while a caller drives progress,
  // finds the batch by itself. Submitters count their batches in `submitted_`, then read
  // `progress_asleep_`; the progress thread sets `progress_asleep_`, then compares
  // `submitted_` with what its last round saw and does not sleep if it moved (both
  // seq_cst: one of the two sees the other's write). Measured, 4 KiB puts over tcp: one
  // write per batch besides the sendmsg, ~86,000 a second.
  std::atomic<uint64_t> submitted_{0};
  std::atomic<bool> progress_asleep_{false};
  // Threads other than the progress thread waiting for ucx_mu_ (Submit, Progress).
  // absl::Mutex does not hand the lock over, so a progress thread that polls while work
  // is in flight would re-take it at once and starve them: it lets them in first.
  // Relaxed: a hint; the mutex orders everything it guards.
  std::atomic<int> ucx_waiters_{0};

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  // Signalled when work is posted or the worker stops: ends the progress thread's wait
  // while a caller drives progress (a CondVar, so that the many other unlocks of mu_ do
  // not evaluate a wait condition).
  absl::CondVar posted_cv_;
  absl::flat_hash_map<uint32_t, std::weak_ptr<Arena>> arenas_ ABSL_GUARDED_BY(mu_);
  WorkerStats stats_ ABSL_GUARDED_BY(mu_);

 private:
  void Loop();
  void RunQueue();
  friend class EndpointImpl;
  void StartBatch(std::unique_ptr<Batch> b);
  void Track(Batch& b, ucs_status_ptr_t r, absl::string_view what);
  void StartRma(Batch& b);
  // Shared-memory batches whose every segment is mapped here (same-host arenas): set
  // each Segment::remote_mapped (under ucx_mu_; false if any is not mapped), then
  // RunMapped copies them on the calling thread without the lock, so callers on several
  // threads copy at once.
  bool MapSegments(Batch& b);
  absl::Status RunMapped(Batch& b);
  // OK, or UNAVAILABLE (and the endpoint marked broken) if the same-host peer exited.
  absl::Status CheckPeerAlive(Batch& b);
  // A finished batch in stats_ (ok: batches and bytes; else batches_failed).
  void CountFinished(const Batch& b, const absl::Status& s);
  static void CopyMapped(const Batch& b, Segment& s, std::byte* rp, bool stream);
  void StartAm(Batch& b);
  void Finish(Batch& b, absl::Status s);
  void Deliver(Batch& b);
  void MaybeFree(uint64_t id);
  void FailEndpointBatches(EndpointImpl* ep, const absl::Status& s);
  void CheckDeadlines();
  void ReapClosedEndpoints();
  // Destroys retired_ rkeys no batch holds any more; under ucx_mu_.
  void SweepRkeys();
  // `bad_seg` (optional): set to the index of the segment refused, if one was.
  absl::Status ResolveOwnerSegments(const WireSeg* segs, uint32_t n, uint64_t total,
                                    std::vector<ucp_dt_iov_t>* iov,
                                    std::vector<std::shared_ptr<Arena>>* hold,
                                    std::optional<uint32_t>* bad_seg = nullptr);
  // A refusal (status not OK) carries its message as the payload (at most
  // kMaxRefusalBytes) and, in AmHeader::num_segs, bad_seg + 1 when one segment was
  // refused (0: the message as a whole).
  void SendOwnerReply(ucp_ep_h reply_ep, unsigned id, uint64_t batch_id, uint32_t part,
                      absl::Status status, std::vector<ucp_dt_iov_t> iov,
                      std::vector<std::shared_ptr<Arena>> hold,
                      std::optional<uint32_t> bad_seg = std::nullopt);
  // Owner: answers a kAmGetReq, one kAmGetResp per message it asks for.
  void ServeGet(ucp_ep_h reply_ep, const AmHeader& h, const void* header, size_t header_len);
  ucs_status_t OnInitiatorReply(unsigned id, const AmHeader& h, void* data, size_t len,
                                bool rndv, ucp_ep_h reply_ep);
  // Owner side of a put answered once (AmHeader::num_parts > 1): one message of it has
  // landed (status OK), was refused (the first refusal is answered, later ones are not),
  // or its initiator's endpoint failed (reply false: nothing is answered any more).
  // After the last message, an OK batch gets its one kAmPutAck.
  void PutPartDone(ucp_ep_h reply_ep, const AmHeader& h, const absl::Status& status,
                   bool reply = true, std::optional<uint32_t> bad_seg = std::nullopt);
  // Drops the records of puts whose messages stopped coming (a dead or timed-out
  // initiator) after kPendingPutTtl without one.
  void SweepPendingPuts();

  std::thread thread_;
  int epfd_ = -1;
  int efd_ = -1;
  std::atomic<bool> stop_{false};  // relaxed: polled by the loop, set once
  uint64_t next_batch_ = 1;        // under ucx_mu_
  // Under ucx_mu_ (submitters add their batches, progress completes them).
  absl::flat_hash_map<uint64_t, std::unique_ptr<Batch>> batches_;
  // Of batches_, those delivered (their caller answered) but kept because UCX still
  // holds requests of theirs (an abandoned transfer to a dead shared-memory peer): no
  // work in flight for the progress thread's polling, which they could otherwise keep
  // at 1 ms epoll rounds for good.
  size_t delivered_in_table_ = 0;
  std::vector<std::shared_ptr<EndpointImpl>> endpoints_;
  // Endpoint closes in progress, with the EndpointImpl they were created for (UCX's
  // error handler argument: it must outlive the ucp_ep).
  struct Closing {
    void* req;
    std::shared_ptr<EndpointImpl> ep;
    absl::Time since;  // a flush to a dead shared-memory peer may never end: counted as
                       // work for the progress thread's polling for batch_timeout only
  };
  std::vector<Closing> closing_reqs_;
  // Endpoints whose close had not ended when the worker shut down: kept until
  // ucp_worker_destroy (their error handler's argument).
  std::vector<std::shared_ptr<EndpointImpl>> unclosed_;
  void CloseUcpEp(const std::shared_ptr<EndpointImpl>& ep);
  // Whether a close younger than batch_timeout is waiting: work for the progress
  // thread's polling (older ones are still reaped, at its idle pace).
  bool ClosingUnderWay() const;
  std::vector<std::shared_ptr<EndpointImpl>> to_close_;
  int owner_inflight_ = 0;  // owner-side AM receives/sends not yet complete
  // When one of them last started or ended. They count as work (the progress thread's
  // polling, the shutdown drain) for batch_timeout after that only: UCX neither ends nor
  // fails an op to a dead same-host initiator reached without peer failure handling
  // (shared memory without cma: error mode NONE), which kept the progress thread in 1 ms
  // rounds for good and every shutdown waiting 2 s. Its OwnerOp stays until UCX lets go.
  absl::Time owner_last_event_ = absl::InfinitePast();
  void OwnerInflight(int delta) {
    owner_inflight_ += delta;
    owner_last_event_ = MonotonicNow();
  }
  bool OwnerOpsUnderWay() const {
    return owner_inflight_ > 0 && MonotonicNow() - owner_last_event_ <= options_.batch_timeout;
  }
  // Owner side: puts answered once whose messages have not all landed, by (the
  // initiator's reply endpoint, its batch id). Batch ids start at a random value per
  // worker, so another initiator that gets a dead one's endpoint address does not meet
  // its records.
  struct PendingPut {
    uint32_t parts = 0;     // the batch's messages (AmHeader::num_parts)
    uint32_t landed = 0;    // messages landed or refused
    bool refused = false;   // answered with a refusal (or the initiator is gone)
    absl::Time last;        // the last message
    // Per message (size: parts); empty for a batch refused past kMaxPendingPutParts (a
    // tombstone: `landed` counts its messages, which are dropped).
    std::vector<bool> seen;
  };
  absl::flat_hash_map<std::pair<ucp_ep_h, uint64_t>, PendingPut> pending_puts_;
  absl::Time next_pending_sweep_ = absl::InfinitePast();
  static constexpr absl::Duration kPendingPutTtl = absl::Minutes(5);
  // Messages (bits of `seen`) of all pending_puts_ together, and their bound (2 MiB of
  // bits; a put past it is refused RESOURCE_EXHAUSTED).
  uint64_t pending_put_parts_ = 0;
  static constexpr uint64_t kMaxPendingPutParts = uint64_t{1} << 24;
  // Live records at most (~100 bytes each), and how many more records tombstones (the
  // records without bits of refused batches, whichever bound refused them) may add.
  // Tombstones do not count toward the first bound: those of puts whose later messages
  // never come (an initiator that died or gave up) would keep new puts out for
  // kPendingPutTtl. Past both together, a refused batch keeps no record.
  static constexpr size_t kMaxPendingPutRecords = size_t{1} << 16;
  static constexpr size_t kMaxPendingPutTombstones = size_t{1} << 16;
  size_t pending_put_tombstones_ = 0;  // of pending_puts_, those whose `seen` is empty
  // Imports replaced by a re-import or of closed endpoints, under ucx_mu_ (like every
  // rkey). Only batches can hold another reference to them, and batches are freed under
  // ucx_mu_ too: one whose use_count() is 1 is unused and is destroyed by SweepRkeys.
  std::vector<std::shared_ptr<RemoteKey>> retired_;
  uint32_t next_arena_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::Time last_deadline_check_ = absl::InfinitePast();
};

// Holds WorkerImpl::ucx_mu_ on a caller's thread (Submit, Progress, RunSync), counted in
// ucx_waiters_ while it waits so that a polling progress thread lets it in.
class ABSL_SCOPED_LOCKABLE CallerLock {
 public:
  explicit CallerLock(WorkerImpl* w) ABSL_EXCLUSIVE_LOCK_FUNCTION(w->ucx_mu_) : w_(w) {
    w_->ucx_waiters_.fetch_add(1, std::memory_order_relaxed);
    w_->ucx_mu_.Lock();
    w_->ucx_waiters_.fetch_sub(1, std::memory_order_relaxed);
  }
  ~CallerLock() ABSL_UNLOCK_FUNCTION() { w_->ucx_mu_.Unlock(); }
  CallerLock(const CallerLock&) = delete;
  CallerLock& operator=(const CallerLock&) = delete;

 private:
  WorkerImpl* const w_;
};

}  // namespace kvpool::transport
