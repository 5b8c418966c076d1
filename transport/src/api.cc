// Public classes (Worker, Endpoint) and batch validation: every descriptor is checked
// on the caller's thread, before anything reaches UCX.
#include <sys/mman.h>

#include <future>

#include "absl/strings/str_cat.h"
#include "internal.h"

namespace kvpool::transport {
namespace {

struct Extent {
  uint64_t offset;
  uint64_t len;
};

// (offset, len) of each page of `run` in an arena of num_pages pages of page_bytes.
absl::Status RunExtents(uint64_t page_bytes, uint64_t num_pages, const PageRun& run,
                        absl::string_view side, size_t op, std::vector<Extent>* out,
                        uint64_t* total) {
  const uint64_t full = run.pages.size() * page_bytes;
  const uint64_t bytes = run.bytes == 0 ? full : run.bytes;
  if (run.pages.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("ops[", op, "].", side, ": no pages"));
  }
  if (bytes > full || full - bytes >= page_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ops[", op, "].", side, ": bytes=", run.bytes, " does not fit ", run.pages.size(),
        " pages of ", page_bytes, " (the last page must hold at least one byte)"));
  }
  out->clear();
  uint64_t left = bytes;
  for (uint64_t p : run.pages) {
    if (p >= num_pages) {
      return absl::InvalidArgumentError(absl::StrCat("ops[", op, "].", side, ": page ", p,
                                                     " out of range; arena ", run.arena_id,
                                                     " has ", num_pages, " pages"));
    }
    const uint64_t n = std::min(left, page_bytes);
    out->push_back({p * page_bytes, n});
    left -= n;
  }
  *total = bytes;
  return absl::OkStatus();
}

}  // namespace

absl::Status WorkerImpl::Submit(const std::shared_ptr<EndpointImpl>& ep, Direction dir,
                                std::vector<TransferOp> ops, BatchCallback done,
                                ByteObserver observe, ByteCopier copy) {
  RETURN_IF_ERROR(ep->health());
  if (copy && !observe) {
    return absl::InvalidArgumentError(
        "a batch has a ByteCopier but no ByteObserver; pass the observer the copier feeds "
        "(it sees the bytes the transport does not copy itself)");
  }
  auto b = std::make_unique<Batch>();
  b->dir = dir;
  b->ep = ep;
  b->done = std::move(done);
  b->observe = std::move(observe);
  b->copy = std::move(copy);
  b->deadline = MonotonicNow() + options_.batch_timeout;
  std::vector<Extent> lx, rx;
  for (size_t i = 0; i < ops.size(); ++i) {
    const TransferOp& op = ops[i];
    std::shared_ptr<Arena> local;
    for (auto& h : b->hold) {
      if (h->id() == op.local.arena_id) local = h;
    }
    if (!local) {
      local = FindArena(op.local.arena_id);
      if (!local) {
        return absl::InvalidArgumentError(
            absl::StrCat("ops[", i, "].local: arena ", op.local.arena_id,
                         " is not registered on this worker; use Worker::RegisterArena"));
      }
      b->hold.push_back(local);
    }
    uint64_t lbytes = 0, rbytes = 0;
    RETURN_IF_ERROR(RunExtents(local->page_bytes(), local->num_pages(), op.local, "local", i,
                               &lx, &lbytes));
    // The batch keeps the import it is validated against, one per remote arena (all its
    // ops see the same one): StartRma pairs these offsets with that import's base and
    // rkey even if the arena is imported again before (or while) the batch runs.
    std::shared_ptr<RemoteKey> key;
    for (const auto& k : b->remote) {
      if (k->desc.arena_id == op.remote.arena_id) key = k;
    }
    if (!key) {
      absl::MutexLock l(&ep->mu_);
      auto it = ep->imported_.find(op.remote.arena_id);
      if (it == ep->imported_.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("ops[", i, "].remote: arena ", op.remote.arena_id,
                         " was not imported on this endpoint; call Endpoint::ImportArena"));
      }
      key = it->second;
      b->remote.push_back(key);
    }
    RETURN_IF_ERROR(RunExtents(key->desc.page_bytes, key->desc.num_pages(), op.remote,
                               "remote", i, &rx, &rbytes));
    if (lbytes != rbytes) {
      return absl::InvalidArgumentError(absl::StrCat("ops[", i, "]: local run has ", lbytes,
                                                     " bytes but remote run has ", rbytes,
                                                     "; both sides must match"));
    }
    // Walk both sides, cutting at either side's page boundary; merge contiguous pieces.
    size_t li = 0, ri = 0;
    uint64_t lo = 0, ro = 0;  // consumed within the current extents
    while (li < lx.size() && ri < rx.size()) {
      const uint64_t n = std::min(lx[li].len - lo, rx[ri].len - ro);
      std::byte* lp = local->base() + lx[li].offset + lo;
      const uint64_t roff = rx[ri].offset + ro;
      Segment* prev = b->segs.empty() ? nullptr : &b->segs.back();
      if (prev != nullptr && prev->local + prev->len == lp &&
          prev->remote_arena == op.remote.arena_id && prev->remote_offset + prev->len == roff &&
          prev->memh == local->memh_ && (!b->observe || prev->op == i)) {
        prev->len += n;
      } else {
        b->segs.push_back({lp, local->memh_, op.remote.arena_id, roff, n,
                           static_cast<uint32_t>(i)});
      }
      b->bytes += n;
      lo += n;
      ro += n;
      if (lo == lx[li].len) ++li, lo = 0;
      if (ro == rx[ri].len) ++ri, ro = 0;
    }
  }
  std::vector<std::pair<BatchCallback, absl::Status>> ready;
  bool mapped = false;
  {
    CallerLock l(this);
    if (closed_) return absl::UnavailableError("transport worker is shut down");
    mapped = MapSegments(*b);
    if (mapped) mapped_copies_.fetch_add(1, std::memory_order_relaxed);  // under ucx_mu_, see Shutdown
    if (!mapped) {
      const uint64_t id = next_batch_;
      StartBatch(std::move(b));
      // Work is left in flight: a progress thread asleep in epoll must wake for it (see
      // progress_asleep_); one that polls, or waits out a polling caller, finds it.
      if (batches_.contains(id)) {
        submitted_.fetch_add(1);
        if (progress_asleep_.load()) ucp_worker_signal(worker_);
      }
    }
    ready.swap(ready_);  // what finished (this batch, inline on shared memory), run below
  }
  if (mapped) {
    // Every byte is mapped here: a memcpy on this thread, outside the lock. The batch
    // holds the arenas and imports (and so the mappings) until it is destroyed here.
    absl::Status st;
    {
      // Counted down however the copy ends (a copier or observer may throw): the
      // mappings may go once it is over.
      struct Done {
        std::atomic<int>& n;
        ~Done() { n.fetch_sub(1, std::memory_order_release); }
      } done{mapped_copies_};
      st = RunMapped(*b);
    }
    if (b->done) b->done(std::move(st));
  }
  for (auto& [fn, status] : ready) fn(std::move(status));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------
// Worker

Worker::Worker(std::shared_ptr<WorkerImpl> impl) : impl_(std::move(impl)) {}
Worker::~Worker() { impl_->Shutdown(); }

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(std::shared_ptr<Context> context,
                                                       WorkerOptions options) {
  if (context == nullptr) return absl::InvalidArgumentError("context is null");
  auto impl = std::make_shared<WorkerImpl>(std::move(context), options);
  RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<Worker>(new Worker(std::move(impl)));
}

const std::string& Worker::address() const { return impl_->address_; }
const WorkerOptions& Worker::options() const { return impl_->options_; }

WorkerStats Worker::stats() const {
  absl::MutexLock l(&impl_->mu_);
  return impl_->stats_;
}

absl::StatusOr<std::shared_ptr<Arena>> Worker::RegisterArena(std::span<std::byte> memory,
                                                             uint64_t page_bytes) {
  return impl_->Register(memory.data(), memory.size(), page_bytes, /*owns=*/false);
}

absl::StatusOr<std::shared_ptr<Arena>> Worker::AllocateArena(uint64_t size,
                                                             uint64_t page_bytes) {
  if (size == 0) return absl::InvalidArgumentError("arena size is 0");
  return impl_->Register(nullptr, size, page_bytes, /*owns=*/true);
}

void Worker::ForgetArena(uint32_t arena_id) { impl_->Forget(arena_id); }

bool Worker::Progress() { return impl_->ProgressFromCaller(); }

absl::StatusOr<std::shared_ptr<Endpoint>> Worker::Connect(absl::string_view peer_address,
                                                          absl::string_view name) {
  ASSIGN_OR_RETURN(auto ep, impl_->Connect(peer_address, name));
  return std::shared_ptr<Endpoint>(new Endpoint(std::move(ep)));
}

// ---------------------------------------------------------------------------------------
// Endpoint

Endpoint::Endpoint(std::shared_ptr<EndpointImpl> impl) : impl_(std::move(impl)) {}

Endpoint::~Endpoint() {
  if (auto w = impl_->worker_.lock()) w->CloseEndpoint(impl_);
}

absl::Status Endpoint::ImportArena(const RemoteArena& remote) {
  const char* bad = remote.page_bytes == 0                 ? "page_bytes is 0"
                    : remote.size == 0                      ? "size is 0"
                    : remote.size % remote.page_bytes != 0  ? "size is not a multiple of page_bytes"
                    : remote.rkey.empty()                   ? "rkey is empty"
                                                            : nullptr;
  if (bad != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "remote arena ", remote.arena_id, " (size ", remote.size, ", page_bytes ", remote.page_bytes, "): ", bad,
        "; pass RemoteArena::Parse() of the owner's descriptor bytes"));
  }
  auto key = std::make_shared<RemoteKey>(remote);
  {
    absl::MutexLock l(&impl_->mu_);
    auto& slot = impl_->imported_[remote.arena_id];
    // Batches validated against the previous import may still be using its rkey: it is
    // retired, not destroyed (see WorkerImpl::SweepRkeys).
    if (slot != nullptr) impl_->stale_keys_.push_back(std::move(slot));
    slot = key;
  }
  // Shared memory: unpack now rather than in the first batch, which maps the arena and
  // fills its page tables once (see RkeyFor). A failure here is reported by the first
  // batch that names the arena. Other transports unpack at first use (an early unpack on
  // a tcp endpoint still wiring up trips a UCX 1.13 assertion when the peer vanishes).
  if (!impl_->shm_lanes_) return absl::OkStatus();
  if (auto w = impl_->worker_.lock()) {
    w->RunSync([&]() -> absl::Status {
       w->RkeyFor(*impl_, *key);
       return absl::OkStatus();
     }).IgnoreError();
  }
  return absl::OkStatus();
}

namespace {
absl::Status SubmitVia(const std::shared_ptr<EndpointImpl>& ep, Direction dir,
                       std::vector<TransferOp> ops, BatchCallback done,
                       ByteObserver observe = nullptr, ByteCopier copy = nullptr) {
  auto w = ep->worker_.lock();
  if (!w) return absl::UnavailableError("transport worker is gone");
  return w->Submit(ep, dir, std::move(ops), std::move(done), std::move(observe), std::move(copy));
}

std::future<absl::Status> AsFuture(const std::shared_ptr<EndpointImpl>& ep, Direction dir,
                                   std::vector<TransferOp> ops) {
  auto p = std::make_shared<std::promise<absl::Status>>();
  auto f = p->get_future();
  absl::Status s = SubmitVia(ep, dir, std::move(ops), [p](absl::Status st) {
    p->set_value(std::move(st));
  });
  if (!s.ok()) p->set_value(std::move(s));
  return f;
}
}  // namespace

absl::Status Endpoint::PutAsync(std::vector<TransferOp> ops, BatchCallback done) {
  return SubmitVia(impl_, Direction::kPut, std::move(ops), std::move(done));
}
absl::Status Endpoint::GetAsync(std::vector<TransferOp> ops, BatchCallback done) {
  return SubmitVia(impl_, Direction::kGet, std::move(ops), std::move(done));
}
absl::Status Endpoint::PutAsync(std::vector<TransferOp> ops, BatchCallback done,
                                ByteObserver observe, ByteCopier copy) {
  return SubmitVia(impl_, Direction::kPut, std::move(ops), std::move(done), std::move(observe),
                   std::move(copy));
}
absl::Status Endpoint::GetAsync(std::vector<TransferOp> ops, BatchCallback done,
                                ByteObserver observe, ByteCopier copy) {
  return SubmitVia(impl_, Direction::kGet, std::move(ops), std::move(done), std::move(observe),
                   std::move(copy));
}
std::future<absl::Status> Endpoint::Put(std::vector<TransferOp> ops) {
  return AsFuture(impl_, Direction::kPut, std::move(ops));
}
std::future<absl::Status> Endpoint::Get(std::vector<TransferOp> ops) {
  return AsFuture(impl_, Direction::kGet, std::move(ops));
}

Protocol Endpoint::protocol() const { return impl_->protocol_; }
bool Endpoint::peer_failure_detection() const { return impl_->peer_failure_detection_; }
absl::Status Endpoint::health() const { return impl_->health(); }
std::string Endpoint::Describe() const { return impl_->describe_; }

}  // namespace kvpool::transport
