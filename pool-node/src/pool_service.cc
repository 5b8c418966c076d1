#include "pool_service.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"
#include "kvpool/proto/grpc_status.h"

namespace kvpool::pool_node {

v1::StateKind ToProto(StateKind k) {
  return k == StateKind::kAttnKv ? v1::STATE_KIND_ATTN_KV : v1::STATE_KIND_LINEAR_STATE;
}
v1::Tier ToProto(Tier t) { return t == Tier::kDram ? v1::TIER_DRAM : v1::TIER_NVME; }

absl::StatusOr<StateKind> FromProto(v1::StateKind k, absl::string_view field) {
  switch (k) {
    case v1::STATE_KIND_ATTN_KV: return StateKind::kAttnKv;
    case v1::STATE_KIND_LINEAR_STATE: return StateKind::kLinearState;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, "=", static_cast<int>(k), " is not a state kind; set STATE_KIND_ATTN_KV or STATE_KIND_LINEAR_STATE"));
  }
}

void FillStats(const PoolStatsSnapshot& s, v1::PoolStats* out) {
  out->set_node_id(s.node_id);
  for (int t = 0; t < (s.has_nvme ? kNumTiers : 1); ++t) {
    const auto& ts = s.tiers[t];
    v1::TierStats* p = out->add_tiers();
    p->set_tier(ToProto(static_cast<Tier>(t)));
    p->set_capacity_bytes(ts.capacity_bytes);
    p->set_used_bytes(ts.used_bytes);
    p->set_objects(ts.objects);
    p->set_evictions(ts.evictions);
    for (int k = 0; k < kNumKinds; ++k) {
      (*p->mutable_bytes_by_kind())[std::string(StateKindName(static_cast<StateKind>(k)))] = ts.bytes_by_kind[k];
    }
  }
  out->set_active_leases(s.active_leases);
  out->set_pending_reservations(s.pending_reservations);
  out->set_checksum_failures(s.checksum_failures);
  out->set_demotions(s.demotions);
  out->set_promotions(s.promotions);
  out->set_reclaimed_reservations(s.reclaimed_reservations);
  out->set_expired_leases(s.expired_leases);
  out->set_reserved_bytes(s.reserved_bytes);
  out->set_nvme_held_back_bytes(s.nvme_held_back_bytes);
  out->set_dram_held_back_bytes(s.dram_held_back_bytes);
}

namespace {
constexpr const char* kMethodNames[] = {"Connect", "Lookup", "Reserve", "Commit", "Release", "GetStats"};
constexpr const char* kRpcsTotal = "kvpool_pool_rpcs_total";
constexpr const char* kRpcsTotalHelp = "PoolNode RPCs by method and code";
}  // namespace

BlockingPool::BlockingPool(int threads) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] {
      for (;;) {
        std::function<void()> fn;
        {
          absl::MutexLock l(&mu_);
          mu_.Await(absl::Condition(this, &BlockingPool::HasWorkOrStop));
          if (queue_.empty()) return;  // stopping, nothing left
          fn = std::move(queue_.front());
          queue_.pop_front();
        }
        fn();
      }
    });
  }
}

BlockingPool::~BlockingPool() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

bool BlockingPool::TryRun(std::function<void()> fn, size_t max_queued) {
  absl::MutexLock l(&mu_);
  if (queue_.size() >= max_queued) return false;
  queue_.push_back(std::move(fn));
  return true;
}

PoolNodeService::PoolNodeService(PoolCore* core, ConnectInfo info, MetricsRegistry* metrics)
    : core_(core), info_(std::move(info)), node_id_(info_.node_id), node_id_final_(info_.node_id_final),
      metrics_(metrics), blocking_(std::make_unique<BlockingPool>(4)) {
  lookup_seconds_ = &metrics_->GetHistogram("kvpool_pool_lookup_seconds", "Lookup handling time",
                                            Histogram::ExponentialBounds(1e-5, 2, 20));
  for (int m = 0; m < kNumMethods; ++m) {
    ok_calls_[m] = &metrics_->GetCounter(kRpcsTotal, kRpcsTotalHelp,
                                         {{"method", kMethodNames[m]}, {"code", "OK"}});
  }
}

grpc::Status PoolNodeService::Done(Method method, const absl::Status& s) {
  if (s.ok()) {
    ok_calls_[method]->Increment();
    return grpc::Status::OK;
  }
  metrics_
      ->GetCounter(kRpcsTotal, kRpcsTotalHelp,
                   {{"method", kMethodNames[method]}, {"code", absl::StatusCodeToString(s.code())}})
      .Increment();
  return ToGrpcStatus(s);
}

namespace {
// The *_unix_ms display fields, on this host's wall clock (what a client would compare
// them with): now + the time left. The node's own expiries run on its monotonic clock,
// which a wall-clock step after start leaves behind.
int64_t WallMsPlus(int64_t ms) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
             .count() +
         ms;
}
// client_id as Connect's (1..128 bytes) on Lookup, Reserve, Commit and Release: leases
// and reservations belong to the client that took them.
absl::Status CheckClientId(const std::string& client_id) {
  if (client_id.empty() || client_id.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "client_id is ", client_id.size(), " bytes; give 1..128: the client's id, the same on Connect, Lookup, "
        "Reserve, Commit and Release (leases and reservations belong to it)"));
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* ctx, grpc::Status s) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(std::move(s));
  return r;
}
}  // namespace

grpc::ServerUnaryReactor* PoolNodeService::Connect(grpc::CallbackServerContext* ctx,
                                                   const v1::ConnectRequest* req,
                                                   v1::ConnectResponse* resp) {
  return Answer(ctx, DoConnect(req, resp));
}

grpc::Status PoolNodeService::DoConnect(const v1::ConnectRequest* req, v1::ConnectResponse* resp) {
  if (absl::Status s = CheckClientId(req->client_id()); !s.ok()) return Done(kConnect, s);
  if (req->ucx_worker_address().empty() || req->ucx_worker_address().size() > (64u << 10)) {
    return Done(kConnect, absl::InvalidArgumentError(absl::StrCat(
                              "ucx_worker_address is ", req->ucx_worker_address().size(),
                              " bytes; pass the client's UCX worker address (1 byte..64 KiB)")));
  }
  {
    absl::MutexLock l(&node_id_mu_);
    if (!node_id_final_) {
      return Done(kConnect, absl::UnavailableError("the pool node is starting (its id is set once its port is bound); retry"));
    }
    resp->set_node_id(node_id_);
  }
  resp->set_ucx_worker_address(info_.ucx_worker_address);
  resp->set_arena_rkey(info_.arena_rkey);
  resp->set_arena_descriptor(info_.arena_descriptor);
  resp->set_arena_base(info_.arena_base);
  resp->set_page_bytes(core_->page_bytes());
  resp->set_num_pages(core_->dram_pages());
  return Done(kConnect, absl::OkStatus());
}

namespace {
constexpr int kMaxEntries = 4096;  // PoolCore's limit per call, checked before parsing

absl::Status CheckRequest(const std::string& client_id, int entries, absl::string_view field) {
  RETURN_IF_ERROR(CheckClientId(client_id));
  if (entries > kMaxEntries) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", entries, " entries; send at most ",
                                                   kMaxEntries, " per call"));
  }
  return absl::OkStatus();
}

absl::Status ParseHashes(const google::protobuf::RepeatedPtrField<std::string>& in,
                         std::vector<BlockHash>* out) {
  out->reserve(in.size());
  for (int i = 0; i < in.size(); ++i) {
    // The field name is built only on error: no allocation per hash.
    absl::StatusOr<BlockHash> h = BlockHash::FromBytes(in[i], "block_hashes[]");
    if (!h.ok()) return BlockHash::FromBytes(in[i], absl::StrCat("block_hashes[", i, "]")).status();
    out->push_back(*h);
  }
  return absl::OkStatus();
}

// Field `field` of entries[i]: a block hash, or a state kind. The entry's field name is
// formatted only on error (no allocation per entry of a request that is right).
absl::StatusOr<BlockHash> EntryHash(const std::string& bytes, int i, absl::string_view field) {
  absl::StatusOr<BlockHash> h = BlockHash::FromBytes(bytes, field);
  if (h.ok()) return h;
  return BlockHash::FromBytes(bytes, absl::StrCat("entries[", i, "].", field)).status();
}
absl::StatusOr<StateKind> EntryKind(v1::StateKind k, int i) {
  absl::StatusOr<StateKind> kind = FromProto(k, "kind");
  if (kind.ok()) return kind;
  return FromProto(k, absl::StrCat("entries[", i, "].kind")).status();
}

void FillRun(const PageRunDesc& run, v1::PageRun* out) {
  out->mutable_pages()->Reserve(run.pages.size());
  for (uint32_t p : run.pages) out->add_pages(p);
  out->set_length(run.length);
}
}  // namespace

grpc::ServerUnaryReactor* PoolNodeService::Lookup(grpc::CallbackServerContext* ctx,
                                                  const v1::LookupRequest* req,
                                                  v1::LookupResponse* resp) {
  const auto start = std::chrono::steady_clock::now();
  LookupSpec spec;
  absl::Status s = CheckRequest(req->client_id(), req->block_hashes_size(), "block_hashes");
  if (s.ok()) s = ParseHashes(req->block_hashes(), &spec.hashes);
  if (s.ok()) {
    auto kind = FromProto(req->kind(), "kind");
    if (!kind.ok()) s = kind.status();
    else spec.kind = *kind;
  }
  if (!s.ok()) return Answer(ctx, Done(kLookup, s));
  spec.lease_ms = req->lease_ms();
  spec.allow_gaps = req->allow_gaps();
  spec.object_length = req->object_length();
  spec.client = req->client_id();
  spec.never_block = true;
  absl::StatusOr<LookupAnswer> ans = core_->Lookup(spec);
  if (absl::IsUnavailable(ans.status())) {  // needs NVMe reads: not on this thread
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    spec.never_block = false;
    // Bounded: each waiting Lookup holds its reactor and up to 4096 hashes, and a flood
    // of them would only wait longer and longer.
    constexpr size_t kMaxQueuedNvmeLookups = 1024;
    const bool queued = blocking_->TryRun([this, ctx, r, resp, start, spec = std::move(spec)] {
      // Queued behind other NVMe Lookups, the caller may have gone (its deadline passed):
      // then no promotion, and no lease pinning objects for an answer nobody reads.
      if (ctx->IsCancelled()) {
        r->Finish(Done(kLookup, absl::CancelledError("the caller went away before the Lookup ran")));
        return;
      }
      absl::StatusOr<LookupAnswer> answer = core_->Lookup(spec);
      if (answer.ok() && answer->lease_id != 0 && ctx->IsCancelled()) {
        (void)core_->Release(answer->lease_id, spec.client);
        r->Finish(Done(kLookup, absl::CancelledError("the caller went away during the Lookup")));
        return;
      }
      r->Finish(FinishLookup(std::move(answer), resp, start));
    }, kMaxQueuedNvmeLookups);
    if (!queued) {
      r->Finish(Done(kLookup, absl::ResourceExhaustedError(absl::StrCat(
                                  kMaxQueuedNvmeLookups, " Lookups that need NVMe reads are waiting already (at most ",
                                  kMaxQueuedNvmeLookups, "); retry later"))));
    }
    return r;
  }
  return Answer(ctx, FinishLookup(std::move(ans), resp, start));
}

grpc::Status PoolNodeService::FinishLookup(absl::StatusOr<LookupAnswer> ans, v1::LookupResponse* resp,
                                           std::chrono::steady_clock::time_point start) {
  if (!ans.ok()) return Done(kLookup, ans.status());
  resp->set_prefix_blocks(ans->prefix_blocks);
  resp->set_lease_id(ans->lease_id);
  resp->set_lease_expires_unix_ms(ans->lease_id != 0 ? WallMsPlus(ans->lease_ttl_ms) : 0);
  resp->set_lease_ttl_ms(ans->lease_ttl_ms);
  resp->set_other_length(ans->other_length);
  resp->mutable_objects()->Reserve(ans->objects.size());
  for (const ObjectDesc& d : ans->objects) {
    v1::ObjectDescriptor* o = resp->add_objects();
    o->set_block_hash(d.key.hash.ToBytes());
    o->set_kind(ToProto(d.key.kind));
    o->set_found_in(ToProto(d.found_in));
    FillRun(d.run, o->mutable_run());
    o->set_checksum(d.checksum);
  }
  lookup_seconds_->Observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return Done(kLookup, absl::OkStatus());
}

grpc::Status PoolNodeService::Reserve(grpc::ServerContext*, const v1::ReserveRequest* req,
                                      v1::ReserveResponse* resp) {
  if (absl::Status s = CheckRequest(req->client_id(), req->entries_size(), "entries"); !s.ok()) {
    return Done(kReserve, s);
  }
  std::vector<ReserveEntrySpec> entries;
  entries.reserve(req->entries_size());
  for (int i = 0; i < req->entries_size(); ++i) {
    const v1::ReserveEntry& e = req->entries(i);
    ReserveEntrySpec spec;
    auto h = EntryHash(e.block_hash(), i, "block_hash");
    if (!h.ok()) return Done(kReserve, h.status());
    spec.hash = *h;
    if (!e.parent_hash().empty()) {
      auto p = EntryHash(e.parent_hash(), i, "parent_hash");
      if (!p.ok()) return Done(kReserve, p.status());
      spec.parent = *p;
    }
    auto kind = EntryKind(e.kind(), i);
    if (!kind.ok()) return Done(kReserve, kind.status());
    spec.kind = *kind;
    spec.length = e.length();
    entries.push_back(spec);
  }
  auto r = core_->Reserve(entries, req->client_id());
  if (!r.ok()) return Done(kReserve, r.status());
  resp->set_reservation_id(r->id);
  resp->set_expires_unix_ms(WallMsPlus(r->ttl_ms));
  resp->set_ttl_ms(r->ttl_ms);
  for (const ReserveSlot& slot : r->slots) {
    v1::ReserveResult* o = resp->add_results();
    o->set_block_hash(slot.hash.ToBytes());
    o->set_already_present(slot.already_present);
    if (!slot.status.ok()) {
      o->set_code(static_cast<int32_t>(slot.status.code()));
      o->set_message(std::string(slot.status.message()));
    } else if (!slot.already_present) {
      FillRun(slot.run, o->mutable_run());
    }
  }
  return Done(kReserve, absl::OkStatus());
}

grpc::Status PoolNodeService::Commit(grpc::ServerContext*, const v1::CommitRequest* req,
                                     v1::CommitResponse* resp) {
  if (req->reservation_id() == 0) {
    return Done(kCommit, absl::InvalidArgumentError(
                             "reservation_id=0 names no reservation; pass ReserveResponse.reservation_id"));
  }
  if (absl::Status s = CheckRequest(req->client_id(), req->entries_size(), "entries"); !s.ok()) {
    return Done(kCommit, s);
  }
  std::vector<CommitEntrySpec> entries;
  entries.reserve(req->entries_size());
  for (int i = 0; i < req->entries_size(); ++i) {
    auto h = EntryHash(req->entries(i).block_hash(), i, "block_hash");
    if (!h.ok()) return Done(kCommit, h.status());
    entries.push_back({*h, req->entries(i).checksum()});
  }
  auto out = core_->Commit(req->reservation_id(), entries, req->partial(), req->commits(), req->end_now(),
                           req->client_id());
  if (!out.ok()) return Done(kCommit, out.status());
  for (const CommitOutcome& o : *out) {
    v1::CommitResult* r = resp->add_results();
    r->set_block_hash(o.hash.ToBytes());
    r->set_code(static_cast<int32_t>(o.status.code()));
    r->set_message(std::string(o.status.message()));
  }
  return Done(kCommit, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolNodeService::Release(grpc::CallbackServerContext* ctx,
                                                   const v1::ReleaseRequest* req, v1::ReleaseResponse*) {
  if (req->lease_id() == 0) {
    return Answer(ctx, Done(kRelease, absl::InvalidArgumentError(
                                          "lease_id=0 names no lease; pass LookupResponse.lease_id")));
  }
  if (absl::Status s = CheckClientId(req->client_id()); !s.ok()) return Answer(ctx, Done(kRelease, s));
  return Answer(ctx, Done(kRelease, core_->Release(req->lease_id(), req->client_id())));
}

grpc::ServerUnaryReactor* PoolNodeService::GetStats(grpc::CallbackServerContext* ctx,
                                                    const v1::GetPoolStatsRequest*, v1::PoolStats* resp) {
  FillStats(core_->Stats(), resp);
  return Answer(ctx, Done(kGetStats, absl::OkStatus()));
}

}  // namespace kvpool::pool_node
