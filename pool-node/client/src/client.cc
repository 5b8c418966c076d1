#include "kvpool/pool_node/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kvpool/common/checksum.h"
#include "kvpool/common/status.h"
#include "kvpool/proto/grpc_status.h"
#include "kvpool/transport/transport.h"
#include "kvpool/v1/pool.grpc.pb.h"

namespace kvpool::pool_node {

struct PoolClient::State {
  PoolClientOptions opt;
  std::unique_ptr<v1::PoolNode::Stub> stub;
  std::shared_ptr<transport::Endpoint> ep;
  transport::RemoteArena remote;
  std::string node_id;
  std::string node_worker_address;
  // ReleaseAsync calls in flight. Their completions land on release_cq, which no thread
  // waits on: they are reaped by later calls (ReapReleases) and by the destructor. The
  // client starts no gRPC callback threads (see the README: a poller thread of their
  // own turned every synchronous call into a hand-off between threads).
  grpc::CompletionQueue release_cq;
  // Relaxed: only a count; the destructor runs after every other call has returned.
  std::atomic<int> releases_in_flight{0};
  // PutPhases, in nanoseconds (relaxed: counters).
  std::atomic<uint64_t> put_calls{0}, put_total_ns{0}, put_transfer_ns{0}, put_reserve_wait_ns{0},
      put_rpc_send_ns{0}, put_final_wait_ns{0};
};

namespace {
v1::StateKind KindToProto(StateKind k) {
  return k == StateKind::kAttnKv ? v1::STATE_KIND_ATTN_KV : v1::STATE_KIND_LINEAR_STATE;
}
int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

// The end of a reservation or lease on this process's monotonic clock: its ttl counted
// from when the request left (no clock shared with the node), less a margin for the
// node's whole-millisecond clock (max(2 ms, ttl / 20), at most the ttl).
std::chrono::steady_clock::time_point UsableUntil(std::chrono::steady_clock::time_point sent, int64_t ttl_ms) {
  const int64_t margin_ms = std::min(ttl_ms, std::max<int64_t>(2, ttl_ms / 20));
  return sent + std::chrono::milliseconds(ttl_ms - margin_ms);
}

// One checksum (XXH3-64) per object. Where this process copies (one-sided shared
// memory) the transport's ByteCopier copies and checksums each piece in one pass; bytes
// that UCX moves reach the ByteObserver once they are in place (or, for a put, as sent).
class Digests {
 public:
  explicit Digests(size_t n) : streams_(n) {}
  // Op i of the batch they see is digest first + i.
  transport::ByteObserver Observer(size_t first = 0) {
    return [this, first](size_t op, std::span<const std::byte> bytes) { streams_[first + op].Update(bytes); };
  }
  transport::ByteCopier Copier(size_t first = 0) {
    return [this, first](size_t op, std::byte* dst, const std::byte* src, size_t n, bool stream) {
      streams_[first + op].CopyUpdate(dst, src, n, stream);
    };
  }
  uint64_t Value(size_t i) const { return streams_[i].Digest(); }

 private:
  std::vector<ChecksumStream> streams_;
};

// One transfer batch, waited for; its op i feeds digest first + i. The digests are not
// fed after this returns.
absl::Status Transfer(transport::Endpoint& ep, bool put, std::vector<transport::TransferOp> ops,
                      Digests& digests, size_t first = 0) {
  auto p = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> f = p->get_future();
  auto done = [p](absl::Status st) { p->set_value(std::move(st)); };
  RETURN_IF_ERROR(put ? ep.PutAsync(std::move(ops), std::move(done), digests.Observer(first), digests.Copier(first))
                      : ep.GetAsync(std::move(ops), std::move(done), digests.Observer(first), digests.Copier(first)));
  return f.get();
}

// The same, as two batches at once: the first half of the ops from a helper thread
// started for the call, the rest from this one. On shared memory each batch is a copy
// (and checksum) by the thread that submits it, so the two run on two cores.
absl::Status TransferTwoWays(transport::Endpoint& ep, bool put, std::vector<transport::TransferOp> ops,
                             Digests& digests) {
  const size_t half = ops.size() / 2;
  if (half == 0) return Transfer(ep, put, std::move(ops), digests);
  std::vector<transport::TransferOp> first(std::make_move_iterator(ops.begin()),
                                           std::make_move_iterator(ops.begin() + half));
  ops.erase(ops.begin(), ops.begin() + half);
  auto helper = std::async(std::launch::async, [&] { return Transfer(ep, put, std::move(first), digests); });
  absl::Status b = Transfer(ep, put, std::move(ops), digests, half);
  absl::Status a = helper.get();
  return a.ok() ? b : a;
}

// A unary RPC in flight on a CompletionQueue driven by the calling thread; its tag is
// &finished. All calls started on a queue are waited for (Drain) before it goes.
template <typename Req, typename Resp>
struct Call {
  grpc::ClientContext ctx;
  Req req;
  Resp resp;
  grpc::Status status;
  bool finished = false;
  std::unique_ptr<grpc::ClientAsyncResponseReader<Resp>> reader;
};
using ReserveCall = Call<v1::ReserveRequest, v1::ReserveResponse>;
using CommitCall = Call<v1::CommitRequest, v1::CommitResponse>;
using ReleaseCall = Call<v1::ReleaseRequest, v1::ReleaseResponse>;

// Polls `cq` (this thread does the RPCs' I/O meanwhile) until *finished is set.
void WaitFor(grpc::CompletionQueue& cq, const bool& finished) {
  void* tag;
  bool ok;
  while (!finished && cq.Next(&tag, &ok)) *static_cast<bool*>(tag) = true;
}

// Lets `cq` do the I/O that is ready, without blocking. gRPC writes a request started
// on a completion queue only when some thread polls that queue: a Commit started just
// before the next piece's copy reached the node only after that copy (traced: 1-1.5 ms
// late per 8 MiB piece), so the node verified piece k while piece k+2 was copied.
void Kick(grpc::CompletionQueue& cq) {
  void* tag;
  bool ok;
  while (cq.AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC)) == grpc::CompletionQueue::GOT_EVENT) {
    *static_cast<bool*>(tag) = true;
  }
}

// Waits for `in_flight` calls on `cq` to finish.
void WaitForCalls(grpc::CompletionQueue& cq, size_t in_flight) {
  void* tag;
  bool ok;
  for (; in_flight > 0 && cq.Next(&tag, &ok); --in_flight) *static_cast<bool*>(tag) = true;
}

// Waits for every call still on `cq`, then shuts it down.
void Drain(grpc::CompletionQueue& cq, size_t in_flight) {
  void* tag;
  bool ok;
  WaitForCalls(cq, in_flight);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

constexpr size_t kMaxEntriesPerRpc = 4096;  // the node's limit per Reserve / Commit

// After a failed Put, and once every RPC of it has answered: a reservation whose final
// Commit was never sent (the Put stopped before it), or one of whose Commits failed on
// the way (the node may never have got it, and a final Commit then waits for it), gets an
// empty Commit with end_now. Otherwise it would pin its pages until reserve_timeout, and
// reserving them may have evicted other objects. No write of this Put is in flight any
// more (the transfers ended before the final wait). Best effort: its answers are dropped
// (NOT_FOUND when the reservation had ended after all).
void EndOpenReservations(v1::PoolNode::Stub& stub, int64_t rpc_timeout_ms, grpc::CompletionQueue& cq,
                         const std::vector<std::pair<size_t, size_t>>& groups,
                         const std::vector<std::unique_ptr<ReserveCall>>& reserves,
                         const std::vector<std::unique_ptr<CommitCall>>& commits) {
  std::vector<std::unique_ptr<CommitCall>> ends;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!reserves[g] || !reserves[g]->status.ok()) continue;  // nothing was reserved
    bool open = !commits[groups[g].second - 1];
    for (size_t k = groups[g].first; k < groups[g].second; ++k) open |= commits[k] && !commits[k]->status.ok();
    if (!open) continue;
    auto c = std::make_unique<CommitCall>();
    c->req.set_reservation_id(reserves[g]->resp.reservation_id());
    c->req.set_client_id(reserves[g]->req.client_id());
    c->req.set_end_now(true);
    c->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(rpc_timeout_ms));
    c->reader = stub.PrepareAsyncCommit(&c->ctx, c->req, &cq);
    c->reader->StartCall();
    c->reader->Finish(&c->resp, &c->status, &c->finished);
    ends.push_back(std::move(c));
  }
  WaitForCalls(cq, ends.size());
}

// Adds the time from its construction to its end to `sum` (nanoseconds).
class PhaseTimer {
 public:
  explicit PhaseTimer(std::atomic<uint64_t>& sum) : sum_(sum), t0_(std::chrono::steady_clock::now()) {}
  ~PhaseTimer() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_);
    sum_.fetch_add(static_cast<uint64_t>(ns.count()), std::memory_order_relaxed);
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

 private:
  std::atomic<uint64_t>& sum_;
  const std::chrono::steady_clock::time_point t0_;
};

}  // namespace

PoolClient::PoolClient() : s_(std::make_unique<State>()) {}
PoolClient::~PoolClient() {
  void* tag;
  bool ok;
  for (int left = s_->releases_in_flight.load(std::memory_order_relaxed);
       left > 0 && s_->release_cq.Next(&tag, &ok); --left) {
    delete static_cast<ReleaseCall*>(tag);
  }
  s_->release_cq.Shutdown();
  while (s_->release_cq.Next(&tag, &ok)) delete static_cast<ReleaseCall*>(tag);
}

void PoolClient::ReapReleases() {
  void* tag;
  bool ok;
  while (s_->release_cq.AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC)) ==
         grpc::CompletionQueue::GOT_EVENT) {
    delete static_cast<ReleaseCall*>(tag);  // errors dropped: the lease expires on its own
    s_->releases_in_flight.fetch_sub(1, std::memory_order_relaxed);
  }
}

absl::StatusOr<std::unique_ptr<PoolClient>> PoolClient::Connect(PoolClientOptions options) {
  if (options.worker == nullptr || options.local_arena == nullptr) {
    return absl::InvalidArgumentError("PoolClientOptions: worker and local_arena are required");
  }
  std::unique_ptr<PoolClient> c(new PoolClient());
  State& s = *c->s_;
  s.opt = std::move(options);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  s.stub = v1::PoolNode::NewStub(
      grpc::CreateCustomChannel(s.opt.node_address, grpc::InsecureChannelCredentials(), args));
  v1::ConnectRequest req;
  req.set_client_id(s.opt.client_id);
  req.set_ucx_worker_address(s.opt.worker->address());
  v1::ConnectResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(s.opt.rpc_timeout_ms));
  RETURN_IF_ERROR(FromGrpcStatus(s.stub->Connect(&ctx, req, &resp)));
  if (resp.arena_descriptor().empty()) {
    return absl::FailedPreconditionError(absl::StrCat("node at ", s.opt.node_address,
                                                      " sent no arena_descriptor; upgrade it"));
  }
  ASSIGN_OR_RETURN(s.remote, transport::RemoteArena::Parse(resp.arena_descriptor()));
  ASSIGN_OR_RETURN(s.ep, s.opt.worker->Connect(resp.ucx_worker_address(), resp.node_id()));
  RETURN_IF_ERROR(s.ep->ImportArena(s.remote));
  s.node_id = resp.node_id();
  s.node_worker_address = resp.ucx_worker_address();
  return c;
}

const std::string& PoolClient::node_id() const { return s_->node_id; }
const std::string& PoolClient::node_worker_address() const { return s_->node_worker_address; }
uint64_t PoolClient::node_page_bytes() const { return s_->remote.page_bytes; }
uint64_t PoolClient::node_pages() const { return s_->remote.num_pages(); }

uint64_t PoolClient::LocalChecksum(std::span<const uint64_t> pages, uint64_t length) const {
  ChecksumStream sum;
  const uint64_t pb = s_->opt.local_arena->page_bytes();
  uint64_t left = length;
  for (uint64_t p : pages) {
    const uint64_t n = std::min(left, pb);
    sum.Update(std::span<const std::byte>(s_->opt.local_arena->base() + p * pb, n));
    left -= n;
  }
  return sum.Digest();
}

absl::StatusOr<PoolLease> PoolClient::Lookup(std::span<const BlockHash> chain, StateKind kind,
                                             uint32_t lease_ms, bool allow_gaps, uint64_t object_length) {
  ReapReleases();
  // Request and response on one arena: a 128-hash answer is ~400 small messages and
  // repeated fields, which the heap allocator otherwise serves one by one.
  google::protobuf::Arena arena;
  auto* req = google::protobuf::Arena::CreateMessage<v1::LookupRequest>(&arena);
  auto* resp = google::protobuf::Arena::CreateMessage<v1::LookupResponse>(&arena);
  req->set_client_id(s_->opt.client_id);
  req->mutable_block_hashes()->Reserve(static_cast<int>(chain.size()));
  for (const BlockHash& h : chain) req->add_block_hashes(h.ToBytes());
  req->set_kind(KindToProto(kind));
  req->set_lease_ms(lease_ms);
  req->set_allow_gaps(allow_gaps);
  req->set_object_length(object_length);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(s_->opt.rpc_timeout_ms));
  const auto sent = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(FromGrpcStatus(s_->stub->Lookup(&ctx, *req, resp)));
  PoolLease lease;
  lease.prefix_blocks = resp->prefix_blocks();
  lease.lease_id = resp->lease_id();
  lease.expires_unix_ms = resp->lease_expires_unix_ms();
  lease.other_length = resp->other_length();
  if (resp->lease_ttl_ms() > 0) lease.usable_until = UsableUntil(sent, resp->lease_ttl_ms());
  lease.objects.reserve(resp->objects_size());
  for (const v1::ObjectDescriptor& d : resp->objects()) {
    RemoteObject o;
    absl::StatusOr<BlockHash> hash = BlockHash::FromBytes(d.block_hash(), "objects[].block_hash");
    if (!hash.ok()) {  // an answer this client cannot use: its lease would pin the objects
      if (lease.lease_id != 0) ReleaseAsync(lease.lease_id);
      return absl::InternalError(absl::StrCat("pool node ", s_->opt.node_address,
                                              " sent a Lookup answer that does not parse: ",
                                              hash.status().message()));
    }
    o.key.hash = *hash;
    o.key.kind = kind;
    o.found_in = d.found_in() == v1::TIER_NVME ? Tier::kNvme : Tier::kDram;
    o.pages.assign(d.run().pages().begin(), d.run().pages().end());
    o.length = d.run().length();
    o.checksum = d.checksum();
    lease.objects.push_back(std::move(o));
  }
  return lease;
}

absl::Status PoolClient::Get(const PoolLease& lease, std::span<const std::vector<uint64_t>> dst,
                             std::vector<size_t>* mismatched) {
  if (mismatched != nullptr) mismatched->clear();
  if (s_->ep == nullptr) return transport_health();  // closed (CloseTransport)
  if (dst.size() != lease.objects.size()) {
    return absl::InvalidArgumentError(absl::StrCat("dst names ", dst.size(), " page lists for ",
                                                   lease.objects.size(), " objects; give one per object"));
  }
  const auto ran_out = [&] {
    return lease.usable_until ? std::chrono::steady_clock::now() >= *lease.usable_until
                              : NowMs() >= lease.expires_unix_ms;
  };
  // Batches [begin, end) of objects, each up to get_batch_bytes (an object larger alone).
  const uint64_t batch_bytes = std::max<uint64_t>(1, s_->opt.get_batch_bytes);
  size_t begin = 0;
  for (size_t batch = 0; begin < dst.size(); ++batch) {
    size_t end = begin + 1;
    uint64_t bytes = lease.objects[begin].length;
    while (end < dst.size() && bytes + lease.objects[end].length <= batch_bytes) bytes += lease.objects[end++].length;
    if (s_->opt.before_get_batch) s_->opt.before_get_batch(batch);
    if (ran_out()) {
      return absl::FailedPreconditionError(
          begin == 0 ? absl::StrCat("lease ", lease.lease_id,
                                    " expired; its pages may hold other objects now. Lookup again")
                     : absl::StrCat("lease ", lease.lease_id, " ran out after ", begin, " of ", dst.size(),
                                    " objects had arrived (those are in place and intact); its pages may hold "
                                    "other objects now. Lookup again for the rest"));
    }
    std::vector<transport::TransferOp> ops;
    ops.reserve(end - begin);
    for (size_t i = begin; i < end; ++i) {
      const RemoteObject& o = lease.objects[i];
      transport::TransferOp op;
      op.local = transport::PageRun{s_->opt.local_arena->id(), dst[i], o.length};
      op.remote.arena_id = s_->remote.arena_id;
      op.remote.pages.assign(o.pages.begin(), o.pages.end());
      op.remote.bytes = o.length;
      ops.push_back(std::move(op));
    }
    Digests digests(ops.size());
    // One-sided (shared memory: copies by the submitting thread): two threads copy and
    // checksum at once. A Put keeps one: there the node's verification of each piece runs
    // on the other core meanwhile (tried: 2 threads lowered put from 0.47-0.48 to
    // 0.42-0.47 of memcpy while get rose from 0.58-0.66 to 1.03-1.13, 2 pairs).
    const bool two = s_->ep->protocol() == transport::Protocol::kRma &&
                     bytes >= s_->opt.get_two_threads_min_bytes;
    RETURN_IF_ERROR(two ? TransferTwoWays(*s_->ep, /*put=*/false, std::move(ops), digests)
                        : Transfer(*s_->ep, /*put=*/false, std::move(ops), digests));
    std::optional<size_t> first_bad;
    for (size_t i = begin; i < end; ++i) {
      if (digests.Value(i - begin) == lease.objects[i].checksum) continue;
      if (!first_bad) first_bad = i;
      if (mismatched != nullptr) mismatched->push_back(i);
    }
    if (first_bad) {
      return absl::DataLossError(absl::StrCat("object ", *first_bad, " (", lease.objects[*first_bad].key.hash.ToHex(),
                                              ") arrived with other bytes than its checksum; its lease ",
                                              lease.lease_id, " may have run out: Lookup again"));
    }
    begin = end;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<absl::Status>> PoolClient::Put(std::span<const PutItem> items, uint64_t* moved) {
  if (moved != nullptr) *moved = 0;
  if (s_->ep == nullptr) return transport_health();  // closed (CloseTransport): reserve nothing
  s_->put_calls.fetch_add(1, std::memory_order_relaxed);
  const PhaseTimer total_timer(s_->put_total_ns);
  // Pieces of about put_pipeline_bytes, the unit of transfer and Commit; groups of
  // pieces of about put_reserve_group_bytes, the unit of Reserve. The next group's Reserve is
  // in flight while a group's pieces are copied, and the Commit of piece k (the node
  // checksums it) while piece k+1 is copied; each group's last Commit is final.
  std::vector<std::pair<size_t, size_t>> pieces;  // [begin, end) of items
  {
    // Where pieces end, in bytes from the start: as many pieces as put_pipeline_bytes
    // gives, the last two a half and a quarter of it (the Put waits for the node to
    // verify its last piece: a small one is verified sooner), the others sharing the rest.
    uint64_t total = 0;
    for (const PutItem& it : items) total += it.length;
    const uint64_t pb = std::max<uint64_t>(1, s_->opt.put_pipeline_bytes);
    const uint64_t n = std::max<uint64_t>(1, (total + pb - 1) / pb);
    std::vector<uint64_t> ends;
    if (n >= 3) {
      const uint64_t body = total - pb / 2 - pb / 4;
      for (uint64_t k = 1; k <= n - 2; ++k) {
        ends.push_back(static_cast<uint64_t>(static_cast<unsigned __int128>(body) * k / (n - 2)));
      }
      ends.push_back(total - pb / 4);
    } else {
      for (uint64_t k = 1; k < n; ++k) ends.push_back(k * pb);
    }
    size_t begin = 0, next_end = 0;
    uint64_t bytes = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      bytes += items[i].length;
      const bool at_end = next_end < ends.size() && bytes >= ends[next_end];
      while (next_end < ends.size() && ends[next_end] <= bytes) ++next_end;
      if (at_end || i + 1 - begin == kMaxEntriesPerRpc || i + 1 == items.size()) {
        pieces.emplace_back(begin, i + 1);
        begin = i + 1;
      }
    }
    if (pieces.empty()) pieces.emplace_back(0, 0);  // the node names what is wrong
  }
  // groups[g] = [first piece, end piece); group_of[k] = g.
  std::vector<std::pair<size_t, size_t>> groups;
  std::vector<size_t> group_of(pieces.size());
  {
    size_t first = 0;
    uint64_t bytes = 0;
    for (size_t k = 0; k < pieces.size(); ++k) {
      for (size_t i = pieces[k].first; i < pieces[k].second; ++i) bytes += items[i].length;
      group_of[k] = groups.size();
      if (k + 1 == pieces.size() || bytes >= s_->opt.put_reserve_group_bytes ||
          pieces[k + 1].second - pieces[first].first > kMaxEntriesPerRpc) {
        groups.emplace_back(first, k + 1);
        first = k + 1;
        bytes = 0;
      }
    }
  }
  const auto deadline = [&] {
    return std::chrono::system_clock::now() + std::chrono::milliseconds(s_->opt.rpc_timeout_ms);
  };
  grpc::CompletionQueue cq;  // this Put's RPCs; polled by this thread while it waits
  size_t started = 0;
  std::vector<std::unique_ptr<ReserveCall>> reserves(groups.size());
  std::vector<std::chrono::steady_clock::time_point> reserve_sent(groups.size());
  std::vector<uint32_t> group_commits(groups.size(), 0);  // Commits sent per group
  std::vector<std::unique_ptr<CommitCall>> commits(pieces.size());
  std::vector<std::vector<int>> commit_index(pieces.size());
  auto start_reserve = [&](size_t g) {
    const PhaseTimer t(s_->put_rpc_send_ns);
    auto c = std::make_unique<ReserveCall>();
    c->req.set_client_id(s_->opt.client_id);
    for (size_t i = pieces[groups[g].first].first; i < pieces[groups[g].second - 1].second; ++i) {
      const PutItem& it = items[i];
      v1::ReserveEntry* e = c->req.add_entries();
      e->set_block_hash(it.hash.ToBytes());
      if (it.parent) e->set_parent_hash(it.parent->ToBytes());
      e->set_kind(KindToProto(it.kind));
      e->set_length(it.length);
    }
    c->ctx.set_deadline(deadline());
    reserve_sent[g] = std::chrono::steady_clock::now();
    c->reader = s_->stub->PrepareAsyncReserve(&c->ctx, c->req, &cq);
    c->reader->StartCall();
    c->reader->Finish(&c->resp, &c->status, &c->finished);
    ++started;
    Kick(cq);  // the request leaves now, not after the next copy
    reserves[g] = std::move(c);
  };

  // A piece's transfer, from its start until its Commit is sent. Up to two are in flight:
  // where the transport copies inside PutAsync (one-sided shared memory) each is done
  // when started and is committed at once; where it completes later (TCP, RDMA) the
  // next piece starts moving before this one is committed, so the link never idles
  // between pieces.
  struct PieceTransfer {
    std::unique_ptr<Digests> digests;  // fed by the transfer's ByteCopier / ByteObserver
    std::vector<size_t> op_item;       // item index per transfer op
    std::future<absl::Status> done;    // valid while a transfer is in flight
    uint64_t bytes = 0;                // moved by it once done is OK
  };
  std::vector<PieceTransfer> tx(pieces.size());
  std::vector<absl::Status> refused(items.size());  // per item: the Reserve's answer for it, when not OK
  auto start_transfer = [&](size_t k) -> absl::Status {
    const size_t g = group_of[k];
    {
      const PhaseTimer t(s_->put_reserve_wait_ns);
      WaitFor(cq, reserves[g]->finished);
    }
    RETURN_IF_ERROR(FromGrpcStatus(reserves[g]->status));
    const v1::ReserveResponse& rresp = reserves[g]->resp;
    const size_t group_first = pieces[groups[g].first].first;
    const size_t group_n = pieces[groups[g].second - 1].second - group_first;
    if (static_cast<size_t>(rresp.results_size()) != group_n) {
      return absl::InternalError(absl::StrCat("node answered ", rresp.results_size(),
                                              " reserve results for ", group_n, " entries"));
    }
    if (s_->opt.before_piece_transfer) s_->opt.before_piece_transfer(k);
    // Counted from when the Reserve left (no clock shared with the node), less a margin
    // for the node's whole-millisecond clock. After it the node may give the pages to
    // another object: a write now could corrupt that one (the node keeps them unused for
    // one more timeout, for writes already under way). Not DEADLINE_EXCEEDED: the node
    // is fine (a worker would take that for a failed node), this Put was too slow.
    if (rresp.ttl_ms() > 0) {
      const auto now = std::chrono::steady_clock::now();
      // A piece's writes can last until the transport's batch timeout; the node reuses the
      // pages one more timeout after the reservation's end. A piece that could still be
      // writing then is not started (a node timeout shorter than the transfer timeout
      // made every slow piece a risk to whatever object got those pages next).
      const absl::Duration transfer_limit = s_->opt.worker->options().batch_timeout;
      if (now + absl::ToChronoNanoseconds(transfer_limit) > UsableUntil(reserve_sent[g], 2 * static_cast<int64_t>(rresp.ttl_ms())) &&
          now < UsableUntil(reserve_sent[g], rresp.ttl_ms())) {
        return absl::FailedPreconditionError(absl::StrCat(
            "reservation ", rresp.reservation_id(), ": the node's reserve timeout (", rresp.ttl_ms(),
            " ms) leaves too little time for this client's transfer timeout (", absl::ToInt64Milliseconds(transfer_limit),
            " ms): a piece started now could still be writing when the node gives its pages to another object; "
            "raise the node's --reserve-timeout-ms above the transfer timeout, or lower the worker's "
            "--pool-transfer-timeout-ms; nothing more was written"));
      }
      if (now >= UsableUntil(reserve_sent[g], rresp.ttl_ms())) {
        return absl::FailedPreconditionError(absl::StrCat(
            "reservation ", rresp.reservation_id(), " ran out (the node's reserve timeout is ", rresp.ttl_ms(),
            " ms) before this Put had written all its objects; it wrote nothing more. Objects whose Commit "
            "the node answered are stored (Lookup tells which); Put the others again, or raise the node's "
            "--reserve-timeout-ms"));
      }
    }
    const size_t first = pieces[k].first, n = pieces[k].second - first;
    std::vector<transport::TransferOp> ops;
    for (size_t j = 0; j < n; ++j) {
      const v1::ReserveResult& r = rresp.results(static_cast<int>(first - group_first + j));
      if (r.code() != 0) {  // e.g. ALREADY_EXISTS at another length: nothing reserved, nothing to write
        refused[first + j] = absl::Status(static_cast<absl::StatusCode>(r.code()), r.message());
        continue;
      }
      if (r.already_present()) continue;
      const PutItem& it = items[first + j];
      transport::TransferOp op;
      op.local = transport::PageRun{s_->opt.local_arena->id(), it.local_pages, it.length};
      op.remote.arena_id = s_->remote.arena_id;
      op.remote.pages.assign(r.run().pages().begin(), r.run().pages().end());
      op.remote.bytes = it.length;
      ops.push_back(std::move(op));
      tx[k].op_item.push_back(first + j);
      tx[k].bytes += it.length;
    }
    // The checksums are taken in the same pass as the copy (ChecksumStream::CopyUpdate).
    // On a failed transfer the reservation is ended by an empty Commit (see Put's end).
    // All present: nothing moves (and the Commit names nothing).
    tx[k].digests = std::make_unique<Digests>(ops.size());
    if (ops.empty()) return absl::OkStatus();
    auto p = std::make_shared<std::promise<absl::Status>>();
    std::future<absl::Status> f = p->get_future();
    const PhaseTimer t(s_->put_transfer_ns);  // on shared memory: the copy
    RETURN_IF_ERROR(s_->ep->PutAsync(std::move(ops), [p](absl::Status st) { p->set_value(std::move(st)); },
                                     tx[k].digests->Observer(), tx[k].digests->Copier()));
    tx[k].done = std::move(f);
    return absl::OkStatus();
  };
  auto commit = [&](size_t k) -> absl::Status {
    if (tx[k].done.valid()) {
      const PhaseTimer t(s_->put_transfer_ns);
      RETURN_IF_ERROR(tx[k].done.get());
      if (moved != nullptr) *moved += tx[k].bytes;
    }
    const PhaseTimer t(s_->put_rpc_send_ns);
    const size_t first = pieces[k].first, n = pieces[k].second - first;
    const size_t g = group_of[k];
    const bool partial = k + 1 != groups[g].second;  // the group's last Commit ends it
    commit_index[k].assign(n, -1);
    if (partial && tx[k].op_item.empty()) return absl::OkStatus();  // nothing to name
    auto c = std::make_unique<CommitCall>();
    c->req.set_reservation_id(reserves[g]->resp.reservation_id());
    c->req.set_client_id(s_->opt.client_id);
    c->req.set_partial(partial);
    if (!partial) c->req.set_commits(group_commits[g] + 1);
    ++group_commits[g];
    for (size_t o = 0; o < tx[k].op_item.size(); ++o) {
      v1::CommitEntry* ce = c->req.add_entries();
      ce->set_block_hash(items[tx[k].op_item[o]].hash.ToBytes());
      ce->set_checksum(tx[k].digests->Value(o));
      commit_index[k][tx[k].op_item[o] - first] = static_cast<int>(o);
    }
    ++started;
    if (s_->opt.lose_commit && s_->opt.lose_commit(k)) {
      c->status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "Commit lost (PoolClientOptions::lose_commit)");
      c->finished = true;
      commits[k] = std::move(c);
      return absl::OkStatus();
    }
    c->ctx.set_deadline(deadline());
    c->reader = s_->stub->PrepareAsyncCommit(&c->ctx, c->req, &cq);
    c->reader->StartCall();
    c->reader->Finish(&c->resp, &c->status, &c->finished);
    Kick(cq);  // the node verifies piece k while this thread copies piece k+1
    commits[k] = std::move(c);
    return absl::OkStatus();
  };
  auto ready = [&](size_t k) {
    return !tx[k].done.valid() ||
           tx[k].done.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  };

  absl::Status err;
  size_t reserved = 0;  // groups whose Reserve was sent
  std::optional<size_t> pending;  // a piece moved (or moving) but not committed yet
  for (size_t k = 0; k < pieces.size(); ++k) {
    while (reserved < groups.size() && reserved <= group_of[k] + 1) start_reserve(reserved++);
    err = start_transfer(k);
    if (pending) {  // moved before piece k failed, if it did: still worth storing
      absl::Status c = commit(*std::exchange(pending, std::nullopt));
      if (err.ok()) err = c;
    }
    if (!err.ok()) break;
    if (ready(k)) {
      err = commit(k);
      if (!err.ok()) break;  // a failed transfer: the next start_transfer would hide it
    } else {
      pending = k;
    }
  }
  if (err.ok() && pending) err = commit(*pending);
  // Transfers still in flight feed digests that live in this frame (and write into
  // reserved pages: they end before any reservation does, below).
  {
    const PhaseTimer t(s_->put_transfer_ns);
    for (PieceTransfer& pt : tx) {
      if (pt.done.valid()) pt.done.wait();
    }
  }
  // Every RPC started is waited for (they point into this frame).
  size_t finished = 0;
  for (const auto& c : reserves) finished += c && c->finished;
  for (const auto& c : commits) finished += c && c->finished;
  {
    const PhaseTimer t(s_->put_final_wait_ns);
    WaitForCalls(cq, started - finished);
  }
  std::vector<absl::Status> out = std::move(refused);
  for (size_t k = 0; k < pieces.size(); ++k) {
    if (!commits[k]) continue;
    absl::Status cs = FromGrpcStatus(commits[k]->status);
    if (!cs.ok()) {
      if (err.ok()) err = cs;
      continue;
    }
    const v1::CommitResponse& cresp = commits[k]->resp;
    for (size_t j = 0; j < commit_index[k].size(); ++j) {
      const int ci = commit_index[k][j];
      if (ci < 0) continue;
      if (ci >= cresp.results_size()) {
        if (err.ok()) err = absl::InternalError("node answered fewer commit results than entries");
        break;
      }
      const v1::CommitResult& r = cresp.results(ci);
      out[pieces[k].first + j] = absl::Status(static_cast<absl::StatusCode>(r.code()), r.message());
    }
  }
  // Not after a Reserve or Commit RPC ran out of time: a node too slow to answer would
  // make the failed Put wait out another RPC timeout (its reservations time out there).
  auto timed_out = [](const auto& calls) {
    return std::any_of(calls.begin(), calls.end(), [](const auto& c) {
      return c && c->finished && c->status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    });
  };
  if (!err.ok() && !timed_out(reserves) && !timed_out(commits)) {
    EndOpenReservations(*s_->stub, s_->opt.rpc_timeout_ms, cq, groups, reserves, commits);
  }
  Drain(cq, 0);
  if (!err.ok()) return err;
  return out;
}

PutPhases PoolClient::put_phases() const {
  auto sec = [](const std::atomic<uint64_t>& ns) { return static_cast<double>(ns.load(std::memory_order_relaxed)) * 1e-9; };
  return {s_->put_calls.load(std::memory_order_relaxed), sec(s_->put_total_ns), sec(s_->put_transfer_ns),
          sec(s_->put_reserve_wait_ns), sec(s_->put_rpc_send_ns), sec(s_->put_final_wait_ns)};
}

absl::Status PoolClient::Release(uint64_t lease_id) {
  v1::ReleaseRequest req;
  req.set_lease_id(lease_id);
  req.set_client_id(s_->opt.client_id);
  v1::ReleaseResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(s_->opt.rpc_timeout_ms));
  return FromGrpcStatus(s_->stub->Release(&ctx, req, &resp));
}

void PoolClient::ReleaseAsync(uint64_t lease_id) {
  ReapReleases();
  auto* c = new ReleaseCall();
  c->req.set_lease_id(lease_id);
  c->req.set_client_id(s_->opt.client_id);
  c->ctx.set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(s_->opt.rpc_timeout_ms));
  s_->releases_in_flight.fetch_add(1, std::memory_order_relaxed);
  // The request leaves now (gRPC writes it from this thread); the answer is reaped later.
  c->reader = s_->stub->PrepareAsyncRelease(&c->ctx, c->req, &s_->release_cq);
  c->reader->StartCall();
  c->reader->Finish(&c->resp, &c->status, c);
}

int PoolClient::PendingReleases() {
  ReapReleases();
  return s_->releases_in_flight.load(std::memory_order_relaxed);
}

absl::Status PoolClient::transport_health() const {
  if (s_->ep == nullptr) return absl::FailedPreconditionError("the transport to this node was closed (CloseTransport)");
  return s_->ep->health();
}

void PoolClient::CloseTransport() { s_->ep.reset(); }

absl::StatusOr<v1::PoolStats> PoolClient::GetStats() {
  v1::GetPoolStatsRequest req;
  v1::PoolStats resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(s_->opt.rpc_timeout_ms));
  RETURN_IF_ERROR(FromGrpcStatus(s_->stub->GetStats(&ctx, req, &resp)));
  return resp;
}

}  // namespace kvpool::pool_node
