#include "convert.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kvpool/common/host_port.h"
#include "kvpool/common/status.h"

namespace kvpool::router {

namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// An enum field's value for an error: its UNSPECIFIED name for 0, else the number (a
// value this build does not know was reported as UNSPECIFIED).
template <typename E>
std::string EnumName(E value, absl::string_view unspecified, absl::string_view type) {
  const int v = static_cast<int>(value);
  return v == 0 ? std::string(unspecified) : absl::StrCat(v, ", which is not a ", type);
}

constexpr uint64_t kMaxSequence = uint64_t{1} << 63;

absl::StatusOr<Tier> TierFromProto(v1::Tier t, absl::string_view field) {
  switch (t) {
    case v1::TIER_GPU: return Tier::kGpu;
    case v1::TIER_DRAM: return Tier::kDram;
    case v1::TIER_NVME: return Tier::kNvme;
    default: return Invalid(field, absl::StrCat(EnumName(t, "TIER_UNSPECIFIED", "Tier"), "; set TIER_GPU, TIER_DRAM or TIER_NVME"));
  }
}

v1::Tier TierToProto(Tier t) {
  switch (t) {
    case Tier::kGpu: return v1::TIER_GPU;
    case Tier::kDram: return v1::TIER_DRAM;
    case Tier::kNvme: return v1::TIER_NVME;
  }
  return v1::TIER_UNSPECIFIED;
}

absl::StatusOr<StateKind> KindFromProto(v1::StateKind k, absl::string_view field) {
  switch (k) {
    case v1::STATE_KIND_ATTN_KV: return StateKind::kAttnKv;
    case v1::STATE_KIND_LINEAR_STATE: return StateKind::kLinearState;
    default:
      return Invalid(field, absl::StrCat(EnumName(k, "STATE_KIND_UNSPECIFIED", "StateKind"),
                                         "; set STATE_KIND_ATTN_KV or STATE_KIND_LINEAR_STATE"));
  }
}

template <typename Repeated>
absl::StatusOr<std::vector<BlockHash>> HashesFromProto(const Repeated& bytes, absl::string_view field) {
  std::vector<BlockHash> out;
  out.reserve(static_cast<size_t>(bytes.size()));
  for (int i = 0; i < bytes.size(); ++i) {
    ASSIGN_OR_RETURN(BlockHash h, BlockHash::FromBytes(bytes[i], absl::StrCat(field, "[", i, "]")));
    out.push_back(h);
  }
  return out;
}

}  // namespace

absl::StatusOr<SourceInfo> SourceFromProto(const v1::RegisterRequest& req) {
  SourceInfo s;
  s.id = req.source_id();
  s.address = req.address();
  s.capacity_blocks = req.capacity_blocks();
  s.publishes_events = req.publishes_events();
  switch (req.kind()) {
    case v1::SOURCE_KIND_WORKER:
      s.kind = SourceKind::kWorker;
      s.model = req.model().name();
      s.block_tokens = req.model().block_tokens();
      break;
    case v1::SOURCE_KIND_POOL_NODE:
      if (req.has_model()) {  // refused, not dropped: the caller meant something by it
        return Invalid("model", "set for a pool node, which holds blocks of every model; leave it unset "
                                "(it names a worker's model)");
      }
      s.kind = SourceKind::kPoolNode;
      s.publishes_events = true;  // a pool node is only useful through its events
      break;
    default:
      return Invalid("kind", absl::StrCat(EnumName(req.kind(), "SOURCE_KIND_UNSPECIFIED", "SourceKind"),
                                          "; set SOURCE_KIND_WORKER or SOURCE_KIND_POOL_NODE"));
  }
  if (s.address.size() > 256) return Invalid("address", "longer than 256 bytes");
  if (const std::string why = HostPortProblem(s.address, HostPortUse::kDial); !why.empty()) {
    return Invalid("address", absl::StrCat("'", s.address, "' ", why,
                                           "; give the host:port the source serves on, e.g. 10.0.0.7:50062"));
  }
  return s;
}

absl::StatusOr<EventBatch> BatchFromProto(const v1::EventBatch& in, std::string* source_id) {
  if (in.source_id().empty()) return Invalid("source_id", "empty; set the id the source registered with");
  if (!ValidSourceId(in.source_id())) {  // Register refuses such ids: none is registered
    return Invalid("source_id", absl::StrCat("\"", in.source_id().substr(0, 64),
                                             "\" is not 1..128 bytes of [A-Za-z0-9._:-]; set the id the source "
                                             "registered with"));
  }
  *source_id = in.source_id();
  if (static_cast<size_t>(in.events_size()) > kMaxBatchEvents) {
    return Invalid("events", absl::StrCat(in.events_size(), " events; send at most ", kMaxBatchEvents, " per batch"));
  }
  if (in.dump_sequence() != 0 && !in.full_dump()) {
    return Invalid("dump_sequence", absl::StrCat(in.dump_sequence(),
                                                 " set on a batch that is not a full dump; it says where a full "
                                                 "dump's sequence stands: leave it 0 here"));
  }
  if (in.dump_sequence() > kMaxSequence) {
    return Invalid("dump_sequence", absl::StrCat(in.dump_sequence(), " is above 2^63; sequences are 1..2^63"));
  }
  EventBatch b;
  b.full_dump = in.full_dump();
  b.dump_sequence = in.dump_sequence();
  b.events.reserve(static_cast<size_t>(in.events_size()));
  for (int i = 0; i < in.events_size(); ++i) {
    const v1::KvEvent& e = in.events(i);
    const std::string at = absl::StrCat("events[", i, "]");
    if (e.sequence() == 0) return Invalid(absl::StrCat(at, ".sequence"), "0; sequences start at 1");
    if (e.sequence() > kMaxSequence) {
      return Invalid(absl::StrCat(at, ".sequence"), absl::StrCat(e.sequence(), " is above 2^63; sequences are 1..2^63"));
    }
    KvEvent out;
    out.sequence = e.sequence();
    switch (e.event_case()) {
      case v1::KvEvent::kStored: {
        out.type = KvEvent::Type::kStored;
        const auto& s = e.stored();
        if (!s.parent_hash().empty()) {
          ASSIGN_OR_RETURN(out.parent, BlockHash::FromBytes(s.parent_hash(), at + ".stored.parent_hash"));
        }
        ASSIGN_OR_RETURN(out.hashes, HashesFromProto(s.block_hashes(), at + ".stored.block_hashes"));
        ASSIGN_OR_RETURN(out.kind, KindFromProto(s.kind(), at + ".stored.kind"));
        ASSIGN_OR_RETURN(out.tier, TierFromProto(s.tier(), at + ".stored.tier"));
        break;
      }
      case v1::KvEvent::kRemoved: {
        out.type = KvEvent::Type::kRemoved;
        const auto& r = e.removed();
        ASSIGN_OR_RETURN(out.hashes, HashesFromProto(r.block_hashes(), at + ".removed.block_hashes"));
        ASSIGN_OR_RETURN(out.kind, KindFromProto(r.kind(), at + ".removed.kind"));
        ASSIGN_OR_RETURN(out.tier, TierFromProto(r.tier(), at + ".removed.tier"));
        break;
      }
      case v1::KvEvent::kCleared:
        out.type = KvEvent::Type::kCleared;
        break;
      default:
        return Invalid(at, "no event set; set one of stored, removed, cleared");
    }
    b.events.push_back(std::move(out));
  }
  return b;
}

absl::StatusOr<RouteInput> RouteFromProto(const v1::RouteRequest& req, const RouterCore& core) {
  ASSIGN_OR_RETURN(const RouterCore::Model* model,
                   core.FindModel(req.model().name(), req.model().block_tokens(), "model"));
  const bool has_tokens = req.tokens_size() > 0, has_hashes = req.block_hashes_size() > 0;
  if (has_tokens == has_hashes) {
    return Invalid("tokens/block_hashes", has_tokens ? "both are set; set exactly one"
                                                     : "the request is empty; set tokens or block_hashes");
  }
  if (req.tenant_salt().size() > 256) return Invalid("tenant_salt", "longer than 256 bytes");
  if (req.extra_keys_size() > 16) return Invalid("extra_keys", "more than 16 entries");
  if (req.session_id().size() > 256) return Invalid("session_id", "longer than 256 bytes");
  // Fields the request's form would ignore are refused, not dropped: a client that set them
  // expects them to count.
  if (has_hashes && !req.tenant_salt().empty()) {
    return Invalid("tenant_salt", "set with block_hashes, which carry the salt already (it is mixed in when they are "
                                  "hashed); leave it empty, or send tokens");
  }
  if (has_hashes && req.extra_keys_size() > 0) {
    return Invalid("extra_keys", "set with block_hashes, which carry the keys already (they are mixed in when they "
                                 "are hashed); leave it empty, or send tokens");
  }
  if (has_tokens && req.prompt_tokens() != 0 && req.prompt_tokens() != static_cast<uint64_t>(req.tokens_size())) {
    return Invalid("prompt_tokens", absl::StrCat(req.prompt_tokens(), " but tokens has ", req.tokens_size(),
                                                 "; leave it 0 when sending tokens"));
  }
  RouteInput in;
  in.model = model->spec.name;
  in.block_tokens = model->block_tokens;
  in.session_id = req.session_id();
  in.policy = req.policy();
  if (has_tokens) {
    if (static_cast<size_t>(req.tokens_size()) > kMaxRouteTokens) {
      return Invalid("tokens", absl::StrCat(req.tokens_size(), " tokens; at most ", kMaxRouteTokens));
    }
    in.hashes = core.HashTokens(*model, std::span<const TokenId>(req.tokens().data(), req.tokens().size()),
                                req.tenant_salt(),
                                std::span<const uint64_t>(req.extra_keys().data(), req.extra_keys().size()));
    in.prompt_tokens = static_cast<uint64_t>(req.tokens_size());
  } else {
    if (static_cast<size_t>(req.block_hashes_size()) > kMaxRouteHashes) {
      return Invalid("block_hashes", absl::StrCat(req.block_hashes_size(), " entries; at most ", kMaxRouteHashes));
    }
    ASSIGN_OR_RETURN(in.hashes, HashesFromProto(req.block_hashes(), "block_hashes"));
    // A chain holds each block once (chained hashes cannot repeat); a repeat would link
    // the worker's predicted blocks into a cycle.
    thread_local absl::flat_hash_map<BlockHash, size_t> seen;  // kept between calls: no allocation per Route
    seen.clear();
    for (size_t j = 0; j < in.hashes.size(); ++j) {
      if (auto [it, fresh] = seen.try_emplace(in.hashes[j], j); !fresh) {
        return Invalid(absl::StrCat("block_hashes[", j, "]"),
                       absl::StrCat("repeats block_hashes[", it->second,
                                    "]; a prompt's chained block hashes are all distinct"));
      }
    }
    in.prompt_tokens = req.prompt_tokens();
  }
  return in;
}

absl::StatusOr<InstanceLoad> LoadFromProto(const v1::Load& l, absl::string_view field) {
  if (!(l.kv_usage() >= 0 && l.kv_usage() <= 1)) {
    return Invalid(absl::StrCat(field, ".kv_usage"), absl::StrCat(l.kv_usage(), " is outside [0, 1]"));
  }
  if (l.running_requests() > 1'000'000) {
    return Invalid(absl::StrCat(field, ".running_requests"), absl::StrCat(l.running_requests(), " is above 1e6"));
  }
  if (l.waiting_requests() > 1'000'000) {
    return Invalid(absl::StrCat(field, ".waiting_requests"), absl::StrCat(l.waiting_requests(), " is above 1e6"));
  }
  if (l.queued_prefill_tokens() > (uint64_t{1} << 40)) {
    return Invalid(absl::StrCat(field, ".queued_prefill_tokens"), "above 2^40");
  }
  InstanceLoad out;
  out.running_requests = l.running_requests();
  out.waiting_requests = l.waiting_requests();
  out.queued_prefill_tokens = l.queued_prefill_tokens();
  out.kv_usage = l.kv_usage();
  return out;
}

void DecisionToProto(const RouteDecision& d, v1::RouteResponse* out) {
  out->set_instance_id(d.instance_id);
  out->set_instance_address(d.instance_address);
  out->set_gpu_hit_blocks(d.gpu_hit_blocks);
  out->set_pool_hit_blocks(d.pool_hit_blocks);
  for (const Location& l : d.pool_locations) {
    v1::BlockLocation* p = out->add_pool_locations();
    p->set_holder_id(l.holder_id);
    p->set_tier(TierToProto(l.tier));
    p->set_first_block(l.first_block);
    p->set_num_blocks(l.num_blocks);
  }
  out->set_estimated_ttft_s(d.estimated_ttft_s);
  out->set_policy(std::string(PolicyName(d.policy)));
  out->set_decision_id(d.decision_id);
  out->set_total_blocks(d.total_blocks);
}

void StatsToProto(const RouterStatsSnapshot& s, const RouterOptions& options, v1::RouterStats* out) {
  for (const SourceStats& x : s.sources) {
    v1::InstanceStats* i = out->add_instances();
    i->set_source_id(x.id);
    i->set_kind(x.kind == SourceKind::kWorker ? v1::SOURCE_KIND_WORKER : v1::SOURCE_KIND_POOL_NODE);
    i->set_address(x.address);
    i->mutable_load()->set_running_requests(x.load.running_requests);
    i->mutable_load()->set_waiting_requests(x.load.waiting_requests);
    i->mutable_load()->set_queued_prefill_tokens(x.load.queued_prefill_tokens);
    i->mutable_load()->set_kv_usage(x.load.kv_usage);
    i->set_inflight_decisions(x.inflight_decisions);
    i->set_index_blocks(x.index_blocks);
    i->set_stale(x.stale);
    i->set_last_sequence(x.last_sequence);
    i->set_last_heartbeat_age_s(x.last_heartbeat_age_s);
    i->set_model(x.model);
    i->set_publishes_events(x.publishes_events);
  }
  out->set_index_entries(s.index_entries);
  out->set_index_bytes(s.index_bytes);
  for (int k = 0; k < kNumPolicies; ++k) {
    if (s.decisions_by_policy[k] > 0) {
      (*out->mutable_decisions_by_policy())[std::string(PolicyName(static_cast<PolicyKind>(k)))] =
          s.decisions_by_policy[k];
    }
  }
  out->set_events_applied(s.events_applied);
  out->set_full_dumps_requested(s.full_dumps_requested);
  out->set_pruned_entries(s.pruned_entries);
  out->set_dropped_sources(s.dropped_sources);
  out->set_max_index_entries(options.max_index_entries);
  out->set_policy(std::string(PolicyName(options.policy)));
}

}  // namespace kvpool::router
