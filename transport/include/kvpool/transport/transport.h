// kvpool::transport: the UCX data plane between workers and pool nodes.
//
// Vocabulary:
//   Context   one UCX context per process (reads UCX_TLS, UCX_NET_DEVICES, ... from the
//             environment exactly as any UCX program does).
//   Worker    one UCX worker plus its progress thread. Submitting threads start their
//             batches themselves (UCX calls are serialized by a worker lock, no hand-off
//             to another thread); the progress thread drives what is left in flight and
//             serves peers' active messages, and sleeps in epoll (ucp_worker_arm) when
//             nothing is in flight.
//   Arena     memory registered with UCX once (a pool node's DRAM tier, a worker's KV
//             pool), cut into fixed-size pages. Never registered per transfer.
//   PageRun   an object: a list of page indices in one arena (+ optional byte count
//             when the object does not fill its last page).
//   Endpoint  a connection to a peer worker, made from the peer's opaque address bytes.
//             Remote arenas are imported into an endpoint from their descriptor bytes.
//
// Two roles, one API:
//
//   Owner (pool node): owns the arena, serves transfers, initiates nothing.
//     ASSIGN_OR_RETURN(auto ctx, Context::Create());
//     ASSIGN_OR_RETURN(auto worker, Worker::Create(ctx));
//     ASSIGN_OR_RETURN(auto arena, worker->AllocateArena(64 << 30, 64 << 10));
//     // gRPC Connect reply carries worker->address() and arena->descriptor().Serialize().
//     // Nothing else: RMA is one-sided, and active-message requests (TCP) are served by
//     // the worker's progress thread against any arena registered on it.
//
//   Initiator (worker): connects, imports the remote arena, moves page runs.
//     ASSIGN_OR_RETURN(auto ctx, Context::Create());
//     ASSIGN_OR_RETURN(auto worker, Worker::Create(ctx));
//     ASSIGN_OR_RETURN(auto kv, worker->AllocateArena(kv_pool_bytes, kv_page_bytes));
//     ASSIGN_OR_RETURN(auto ep, worker->Connect(node_address));
//     ASSIGN_OR_RETURN(auto remote, RemoteArena::Parse(node_arena_descriptor_bytes));
//     RETURN_IF_ERROR(ep->ImportArena(remote));
//     std::vector<TransferOp> ops = {{.local = {kv->id(), {7, 3}},
//                                     .remote = {remote.arena_id, {1024, 1025}}}};
//     absl::Status s = ep->Get(std::move(ops)).get();   // or GetAsync(ops, callback)
//
// Protocol (per endpoint, chosen at Connect): one-sided RMA (ucp_put_nbx/ucp_get_nbx,
// then a flush) when the lanes UCX picked for the peer can do zero-copy RMA (cma / knem /
// xpmem on one host, rc / dc verbs across hosts); active messages with rendezvous
// otherwise (tcp: UCX 1.13 emulates get over tcp very slowly). With AM, a put is one AM
// whose payload is the gathered local pages and whose header names the remote pages;
// the owner receives it straight into its pages (ucp_am_recv_data_nbx with an iov) and
// acknowledges. A get is a small request AM; the owner answers with one AM whose payload
// is its pages, received in place on the initiator. WorkerOptions::protocol forces one.
//
// Failures: endpoints use UCP_ERR_HANDLING_MODE_PEER where a transport supports it (tcp,
// verbs; not UCX 1.13 shared memory, where a same-host peer's exit is noticed through its
// pid). A peer that dies fails every batch in flight on its endpoint with UNAVAILABLE;
// a batch that does not finish within
// WorkerOptions::batch_timeout fails with DEADLINE_EXCEEDED (the bound holds even when
// UCX cannot detect the death). Bad descriptors (unknown arena, page out of range,
// size mismatch between the two sides) are refused with INVALID_ARGUMENT before any byte
// moves. An endpoint that failed stays failed (UNAVAILABLE): connect again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvpool::transport {

class WorkerImpl;
class EndpointImpl;

// ---------------------------------------------------------------------------------------
// Context: the UCX context (ucp_context_h). Thread safety: immutable after Create; share
// it between workers through the shared_ptr.
struct ContextOptions {
  // UCX configuration overrides, applied after the environment is read (an entry here
  // wins over the UCX_* variable). Keys without the UCX_ prefix, e.g. {"TLS", "tcp"}.
  // Empty: the environment alone, as UCX users expect.
  std::vector<std::pair<std::string, std::string>> ucx_config;
  // Keepalive interval used when the environment does not set UCX_KEEPALIVE_INTERVAL;
  // bounds how long a silent peer death takes to surface as an endpoint error.
  absl::Duration keepalive_interval = absl::Seconds(1);
  // UCX_TCP_RX_SEG_SIZE used when the environment does not set it (empty: UCX's default,
  // 64 KiB): the most a tcp endpoint reads from its socket per recv. KV objects move in
  // 64 KiB-1 MiB messages, and on the VMs measured every system call costs ~1 us: 1 MiB
  // moved pool-node puts over tcp loopback from 1.75-2.01 to 2.39-2.82 GB/s and gets
  // from 2.76-3.00 to 3.53-3.88 (transport/README.md, "tcp receive segments"). Memory:
  // one such buffer per tcp connection receiving at the moment.
  std::string tcp_rx_seg_size = "1m";
};

class Context {
 public:
  static absl::StatusOr<std::shared_ptr<Context>> Create(ContextOptions options = {});
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // The UCX transports this context may use, as UCX reports them (for logs).
  std::string Describe() const;
  // ucp_context_h, for code that needs raw UCX (tests, benchmarks).
  void* raw() const { return handle_; }
  // Whether some enabled transport supports UCX peer-failure handling (tcp, verbs).
  // UCX 1.13's shared-memory transports do not: see Endpoint::peer_failure_detection.
  bool peer_failure_capable() const { return peer_failure_capable_; }
  // Whether some enabled transport moves bytes through shared memory on one host
  // (sysv, posix, cma, knem, xpmem): same-host peers then connect over it.
  bool shared_memory_capable() const { return shared_memory_capable_; }

 private:
  explicit Context(void* handle) : handle_(handle) {}
  void* handle_;  // ucp_context_h
  bool peer_failure_capable_ = false;
  bool shared_memory_capable_ = false;
};

// ---------------------------------------------------------------------------------------
// Descriptors exchanged between peers as opaque bytes (carried by gRPC, never parsed
// by it).

// What a peer needs to reach an arena: id, remote base address, sizes, packed rkey.
struct RemoteArena {
  uint32_t arena_id = 0;   // unique per owning Worker
  uint64_t base = 0;       // virtual address of page 0 in the owner's process
  uint64_t size = 0;       // bytes, a multiple of page_bytes
  uint64_t page_bytes = 0;
  std::string rkey;        // ucp_rkey_pack output, opaque
  // Same-host export (AllocateArena): the SysV shared-memory segment holding the arena,
  // the owner's pid and the host + IPC namespace it belongs to. A peer on the same host
  // maps the segment itself at a 2 MiB boundary (huge-page mapped, see AllocateArena);
  // shm_id -1: none (registered memory, or the UCX-allocated fallback).
  int64_t shm_id = -1;
  uint32_t owner_pid = 0;
  std::string shm_host;

  uint64_t num_pages() const { return page_bytes == 0 ? 0 : size / page_bytes; }
  // Versioned little-endian wire form.
  std::string Serialize() const;
  static absl::StatusOr<RemoteArena> Parse(absl::string_view bytes);
};

// An object in an arena: its pages in order. The object's bytes are page 0's bytes,
// then page 1's, ...; `bytes` (0 = all pages full) cuts the last page short.
struct PageRun {
  uint32_t arena_id = 0;
  std::vector<uint64_t> pages;
  uint64_t bytes = 0;  // 0: pages.size() * page_bytes
};

// One object moved by a batch: local pages <-> remote pages. Both sides must describe
// the same number of bytes; their page sizes may differ (scatter-gather on both sides).
struct TransferOp {
  PageRun local;
  PageRun remote;
};

// Called exactly once per batch: on the worker's progress thread, or on the submitting
// thread before PutAsync/GetAsync returns when the batch completes inline (CMA moves the
// bytes inside the call). A thread that drives the worker itself runs the callbacks of
// batches that completed meanwhile, whichever thread submitted them: Worker::Progress,
// Connect, ImportArena, and destroying an Endpoint (which fails its batches) do. Never
// with a transport lock held, so it may submit again; keep it short (it delays other
// completions) and do not take a lock that a thread holds around any of these calls.
using BatchCallback = std::function<void(absl::Status)>;

// Optional: sees the local bytes of each op of a batch (for Put the source, for Get the
// destination once they arrived), as consecutive pieces in order, while they are still
// in cache: right after each piece is copied (one-sided shared memory), else once the
// batch has completed, just before `done`. Lets a caller checksum what it moved without
// a second pass over DRAM. Called on one thread at a time per batch: on the one-sided
// copy path inside PutAsync/GetAsync on the submitting thread (a batch whose every byte
// is mapped here is copied without the worker's lock, so batches submitted from several
// threads copy at once; one partly moved by UCX holds it), else on the thread that runs
// `done`, right before it. It must not call into the transport; keep it to reading the
// bytes. If the batch fails, `done` gets the
// error and what was observed means nothing.
using ByteObserver = std::function<void(size_t op, std::span<const std::byte> bytes)>;

// Optional, beside a ByteObserver: on the one-sided copy path the transport hands it
// each piece to copy instead of copying the piece itself and showing it to the observer,
// so that the copy and the observation are one pass over the bytes (the pool client's
// ChecksumStream::CopyUpdate). `dst` and `src` are the copy's (for a put `src` is the op's
// local bytes, for a get `dst`); `stream` says whether the transport would have used
// streaming stores (StreamCopy; it fences after the batch). It must store src's n bytes
// at dst and observe, for op, exactly the bytes it stored, as the observer would have
// seen them. Bytes the transport does not copy itself (UCX moves them) still go to the
// ByteObserver. Same threads and rules as the observer.
using ByteCopier =
    std::function<void(size_t op, std::byte* dst, const std::byte* src, size_t n, bool stream)>;

enum class Protocol : uint8_t {
  kAuto,           // RMA when the endpoint's lanes can do zero-copy RMA, else AM
  kRma,            // ucp_put_nbx / ucp_get_nbx + flush
  kActiveMessage,  // AM + rendezvous, served by the owner's progress thread
};
absl::string_view ProtocolName(Protocol p);  // "auto", "rma", "am"

// ---------------------------------------------------------------------------------------
// Arena: registered memory. Thread safety: immutable after creation; the bytes it
// covers are the caller's to synchronize (the transport writes pages only while a
// batch naming them is in flight). Deregisters on destruction; destroy only when no
// batch names it (the Worker keeps a reference while batches are in flight).
class Arena {
 public:
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  uint32_t id() const { return id_; }
  std::byte* base() const { return base_; }
  uint64_t size() const { return size_; }
  uint64_t page_bytes() const { return page_bytes_; }
  uint64_t num_pages() const { return size_ / page_bytes_; }
  std::span<std::byte> Page(uint64_t index) const {
    return {base_ + index * page_bytes_, page_bytes_};
  }
  // What peers import (rkey packed once at registration).
  const RemoteArena& descriptor() const { return descriptor_; }
  // Byte spans of a run of this arena (validated); for page views.
  absl::StatusOr<std::vector<std::span<std::byte>>> Spans(const PageRun& run) const;

 private:
  friend class WorkerImpl;
  Arena() = default;
  uint32_t id_ = 0;
  std::byte* base_ = nullptr;
  uint64_t size_ = 0;
  uint64_t page_bytes_ = 0;
  RemoteArena descriptor_;
  std::shared_ptr<Context> context_;  // outlives the registration
  void* memh_ = nullptr;              // ucp_mem_h
  bool owns_memory_ = false; // AllocateArena: munmap on destruction
  int shm_id_ = -1;           // AllocateArena's own SysV segment: shmdt on destruction
};

// ---------------------------------------------------------------------------------------
struct WorkerOptions {
  Protocol protocol = Protocol::kAuto;
  // A batch still running after this long fails with DEADLINE_EXCEEDED (its endpoint is
  // then closed: UCX cannot cancel a started RMA).
  absl::Duration batch_timeout = absl::Seconds(30);
  // The progress thread polls without sleeping while transfers are in flight (until
  // 20 ms pass without an event) and for this long after the last event, then sleeps in
  // epoll. 0: no polling, always sleep between events.
  absl::Duration spin = absl::Microseconds(200);
  // Shared-memory batches of at least this many bytes are copied with streaming
  // (non-temporal) stores (kvpool/common/stream_copy.h). 0: always; UINT64_MAX: never,
  // the default: since arenas are mapped with 2 MiB pages, glibc's memcpy was as fast or
  // faster here, and a streamed get copies twice (through a cache-resident bounce piece
  // for its observer). Try 4 MiB where stores into memory beyond the caches are slow.
  uint64_t stream_copy_min_bytes = UINT64_MAX;
};

struct WorkerStats {
  uint64_t batches_ok = 0;
  uint64_t batches_failed = 0;
  uint64_t bytes_put = 0;         // initiated by this worker
  uint64_t bytes_get = 0;
  uint64_t am_requests_served = 0;  // answers sent as the owner (AM protocol; one per put batch)
  uint64_t am_requests_refused = 0;
  // Batches submitted and not yet released: UCX requests or awaited replies of theirs
  // are outstanding (a failed batch stays until UCX lets go of its buffers).
  uint64_t batches_in_flight = 0;
};

class Endpoint;

// Worker: a UCX worker and its progress thread. Thread safety: every method may be
// called from any thread; UCX calls are serialized by an internal lock held only for
// short sections (never across a user callback).
class Worker {
 public:
  static absl::StatusOr<std::unique_ptr<Worker>> Create(std::shared_ptr<Context> context,
                                                        WorkerOptions options = {});
  // Stops the progress thread; fails batches still in flight with CANCELLED; closes
  // endpoints. Arenas outlive it only as memory (their registration ends with the
  // context).
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // This worker's UCX address, opaque bytes for peers' Connect.
  const std::string& address() const;

  // Registers caller-owned memory [base, base+size) cut into pages of page_bytes.
  // REQUIRES: size a positive multiple of page_bytes; memory outlives the Arena.
  absl::StatusOr<std::shared_ptr<Arena>> RegisterArena(std::span<std::byte> memory,
                                                       uint64_t page_bytes);
  // Allocates the arena as a SysV shared-memory segment of its own (2 MiB pages where
  // the kernel can; see README "2 MiB pages") and registers it, falling back to UCX's
  // allocation. Prefer it to RegisterArena: peers on the same host then map the arena and put/get
  // are one-sided memcpy; for registered caller memory UCX 1.13 emulates shared-memory
  // RMA with messages the owner must answer (orders of magnitude slower).
  absl::StatusOr<std::shared_ptr<Arena>> AllocateArena(uint64_t size, uint64_t page_bytes);
  // Arenas are served to peers (AM protocol) while registered here and alive. Forget
  // stops serving `arena_id` (RMA peers holding its rkey can still reach it until the
  // Arena is destroyed).
  void ForgetArena(uint32_t arena_id);

  // Connects to a peer worker by its address(). Does not wait for the peer.
  absl::StatusOr<std::shared_ptr<Endpoint>> Connect(absl::string_view peer_address,
                                                    absl::string_view name = "");

  // Drives UCX from the calling thread once (callbacks of batches it completes run here)
  // and returns whether anything happened. Optional: the progress thread does this on
  // its own. A latency-critical caller that polls while its batches are in flight skips
  // the thread hand-off; the progress thread backs off while someone polls.
  bool Progress();

  WorkerStats stats() const;
  const WorkerOptions& options() const;

 private:
  explicit Worker(std::shared_ptr<WorkerImpl> impl);
  std::shared_ptr<WorkerImpl> impl_;
};

// Endpoint: a connection to one peer. Thread safety: all methods may be called from any
// thread. Batches on one endpoint complete in any order.
class Endpoint {
 public:
  ~Endpoint();  // closes the UCX endpoint (in-flight batches fail with CANCELLED)
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // Makes a peer's arena addressable through this endpoint (unpacks its rkey once).
  // Importing the same id again replaces it.
  absl::Status ImportArena(const RemoteArena& remote);

  // Asynchronous batches. Validation errors (INVALID_ARGUMENT: unknown arena, page out of
  // range, byte counts that disagree; UNAVAILABLE: endpoint failed) are returned here and
  // the callback is not called. Otherwise `done` is called exactly once: OK when every
  // byte has landed (for Put: visible in the remote arena), or the batch's error.
  absl::Status PutAsync(std::vector<TransferOp> ops, BatchCallback done);
  absl::Status GetAsync(std::vector<TransferOp> ops, BatchCallback done);
  // The same, with `observe` shown every op's bytes (see ByteObserver), and `copy`, if
  // given, copying and observing at once where this process copies (see ByteCopier; it
  // needs `observe`).
  absl::Status PutAsync(std::vector<TransferOp> ops, BatchCallback done, ByteObserver observe,
                        ByteCopier copy = nullptr);
  absl::Status GetAsync(std::vector<TransferOp> ops, BatchCallback done, ByteObserver observe,
                        ByteCopier copy = nullptr);
  // Future forms: a refused batch yields its refusal as the future's value.
  std::future<absl::Status> Put(std::vector<TransferOp> ops);
  std::future<absl::Status> Get(std::vector<TransferOp> ops);

  // The protocol chosen for this endpoint (never kAuto).
  Protocol protocol() const;
  // True when UCX watches the peer (UCP_ERR_HANDLING_MODE_PEER). False where no lane
  // supports it (UCX 1.13 shared memory: UCX_TLS=sm,cma,self): a dead peer then fails
  // a batch through a transport error (cma) or WorkerOptions::batch_timeout.
  bool peer_failure_detection() const;
  // OK while usable; the error that broke it otherwise.
  absl::Status health() const;
  // UCX's description of the lanes (transports) used for this peer.
  std::string Describe() const;

 private:
  friend class Worker;
  explicit Endpoint(std::shared_ptr<EndpointImpl> impl);
  std::shared_ptr<EndpointImpl> impl_;
};

}  // namespace kvpool::transport
