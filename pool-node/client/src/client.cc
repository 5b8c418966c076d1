#include "kvpool/pool_node/client.h"

#include <grpcpp/grpcpp.h>
#include <xxhash.h>

#include <chrono>

#include "absl/strings/str_cat.h"
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
};

namespace {
v1::StateKind KindToProto(StateKind k) {
  return k == StateKind::kAttnKv ? v1::STATE_KIND_ATTN_KV : v1::STATE_KIND_LINEAR_STATE;
}
int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace

PoolClient::PoolClient() : s_(std::make_unique<State>()) {}
PoolClient::~PoolClient() = default;

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
  return c;
}

const std::string& PoolClient::node_id() const { return s_->node_id; }
uint64_t PoolClient::node_page_bytes() const { return s_->remote.page_bytes; }
uint64_t PoolClient::node_pages() const { return s_->remote.num_pages(); }

uint64_t PoolClient::LocalChecksum(std::span<const uint64_t> pages, uint64_t length) const {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  const uint64_t pb = s_->opt.local_arena->page_bytes();
  uint64_t left = length;
  for (uint64_t p : pages) {
    const uint64_t n = std::min(left, pb);
    XXH3_64bits_update(st, s_->opt.local_arena->base() + p * pb, n);
    left -= n;
  }
  const uint64_t sum = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return sum;
}

absl::StatusOr<PoolLease> PoolClient::Lookup(std::span<const BlockHash> chain, StateKind kind,
                                             uint32_t lease_ms, bool allow_gaps) {
  v1::LookupRequest req;
  req.set_client_id(s_->opt.client_id);
  for (const BlockHash& h : chain) req.add_block_hashes(h.ToBytes());
  req.set_kind(KindToProto(kind));
  req.set_lease_ms(lease_ms);
  req.set_allow_gaps(allow_gaps);
  v1::LookupResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(s_->opt.rpc_timeout_ms));
  RETURN_IF_ERROR(FromGrpcStatus(s_->stub->Lookup(&ctx, req, &resp)));
  PoolLease lease;
  lease.prefix_blocks = resp.prefix_blocks();
  lease.lease_id = resp.lease_id();
  lease.expires_unix_ms = resp.lease_expires_unix_ms();
  for (const v1::ObjectDescriptor& d : resp.objects()) {
    RemoteObject o;
    ASSIGN_OR_RETURN(o.key.hash, BlockHash::FromBytes(d.block_hash(), "objects[].block_hash"));
    o.key.kind = kind;
    o.found_in = d.found_in() == v1::TIER_NVME ? Tier::kNvme : Tier::kDram;
    o.pages.assign(d.run().pages().begin(), d.run().pages().end());
    o.length = d.run().length();
    o.checksum = d.checksum();
    lease.objects.push_back(std::move(o));
  }
  return lease;
}

absl::Status PoolClient::Get(const PoolLease& lease, std::span<const std::vector<uint64_t>> dst) {
  if (dst.size() != lease.objects.size()) {
    return absl::InvalidArgumentError(absl::StrCat("dst names ", dst.size(), " page lists for ",
                                                   lease.objects.size(), " objects; give one per object"));
  }
  if (lease.objects.empty()) return absl::OkStatus();
  if (NowMs() >= lease.expires_unix_ms) {
    return absl::FailedPreconditionError(absl::StrCat("lease ", lease.lease_id,
                                                      " expired; its pages may hold other objects now. Lookup again"));
  }
  std::vector<transport::TransferOp> ops;
  ops.reserve(dst.size());
  for (size_t i = 0; i < dst.size(); ++i) {
    const RemoteObject& o = lease.objects[i];
    transport::TransferOp op;
    op.local = transport::PageRun{s_->opt.local_arena->id(), dst[i], o.length};
    op.remote.arena_id = s_->remote.arena_id;
    op.remote.pages.assign(o.pages.begin(), o.pages.end());
    op.remote.bytes = o.length;
    ops.push_back(std::move(op));
  }
  RETURN_IF_ERROR(s_->ep->Get(std::move(ops)).get());
  for (size_t i = 0; i < dst.size(); ++i) {
    const RemoteObject& o = lease.objects[i];
    if (LocalChecksum(dst[i], o.length) != o.checksum) {
      return absl::DataLossError(absl::StrCat("object ", i, " (", o.key.hash.ToHex(),
                                              ") arrived with other bytes than its checksum; its lease ",
                                              lease.lease_id, " may have run out: Lookup again"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<absl::Status>> PoolClient::Put(std::span<const PutItem> items) {
  v1::ReserveRequest rreq;
  rreq.set_client_id(s_->opt.client_id);
  for (const PutItem& it : items) {
    v1::ReserveEntry* e = rreq.add_entries();
    e->set_block_hash(it.hash.ToBytes());
    if (it.parent) e->set_parent_hash(it.parent->ToBytes());
    e->set_kind(KindToProto(it.kind));
    e->set_length(it.length);
  }
  v1::ReserveResponse rresp;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(s_->opt.rpc_timeout_ms));
    RETURN_IF_ERROR(FromGrpcStatus(s_->stub->Reserve(&ctx, rreq, &rresp)));
  }
  std::vector<transport::TransferOp> ops;
  v1::CommitRequest creq;
  creq.set_reservation_id(rresp.reservation_id());
  std::vector<absl::Status> out(items.size());
  std::vector<int> commit_index(items.size(), -1);
  for (size_t i = 0; i < items.size(); ++i) {
    const v1::ReserveResult& r = rresp.results(static_cast<int>(i));
    if (r.already_present()) continue;
    transport::TransferOp op;
    op.local = transport::PageRun{s_->opt.local_arena->id(), items[i].local_pages, items[i].length};
    op.remote.arena_id = s_->remote.arena_id;
    op.remote.pages.assign(r.run().pages().begin(), r.run().pages().end());
    op.remote.bytes = items[i].length;
    ops.push_back(std::move(op));
    v1::CommitEntry* ce = creq.add_entries();
    ce->set_block_hash(items[i].hash.ToBytes());
    ce->set_checksum(LocalChecksum(items[i].local_pages, items[i].length));
    commit_index[i] = creq.entries_size() - 1;
  }
  if (ops.empty()) return out;
  // On a failed transfer the reservation is simply not committed; the node reclaims it.
  RETURN_IF_ERROR(s_->ep->Put(std::move(ops)).get());
  v1::CommitResponse cresp;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(s_->opt.rpc_timeout_ms));
    RETURN_IF_ERROR(FromGrpcStatus(s_->stub->Commit(&ctx, creq, &cresp)));
  }
  for (size_t i = 0; i < items.size(); ++i) {
    if (commit_index[i] < 0) continue;
    const v1::CommitResult& r = cresp.results(commit_index[i]);
    out[i] = absl::Status(static_cast<absl::StatusCode>(r.code()), r.message());
  }
  return out;
}

absl::Status PoolClient::Release(uint64_t lease_id) {
  v1::ReleaseRequest req;
  req.set_lease_id(lease_id);
  v1::ReleaseResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(s_->opt.rpc_timeout_ms));
  return FromGrpcStatus(s_->stub->Release(&ctx, req, &resp));
}

absl::StatusOr<v1::PoolStats> PoolClient::GetStats() {
  v1::GetPoolStatsRequest req;
  v1::PoolStats resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(s_->opt.rpc_timeout_ms));
  RETURN_IF_ERROR(FromGrpcStatus(s_->stub->GetStats(&ctx, req, &resp)));
  return resp;
}

}  // namespace kvpool::pool_node
