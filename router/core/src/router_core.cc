#include "kvpool/router/router_core.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "kvpool/common/host_port.h"
#include "kvpool/common/status.h"

namespace kvpool::router {

namespace {
// A client's string echoed in an error: at most 64 bytes (a 100 KB model name echoed in
// full made the status too large to send, and the call ended with none).
std::string Clipped(absl::string_view s) {
  return s.size() <= 64 ? std::string(s) : absl::StrCat(s.substr(0, 64), "...(", s.size(), " bytes)");
}
}  // namespace

namespace {

absl::Status ValidateEvent(absl::string_view source_id, SourceKind kind, const KvEvent& e, size_t i) {
  if (e.type == KvEvent::Type::kCleared) return absl::OkStatus();
  const char* what = e.type == KvEvent::Type::kStored ? "stored" : "removed";
  if (e.hashes.empty() || e.hashes.size() > kMaxEventHashes) {
    return absl::InvalidArgumentError(absl::StrCat("events[", i, "].", what, ".block_hashes has ",
                                                   e.hashes.size(), " entries; send 1..", kMaxEventHashes));
  }
  if (e.type == KvEvent::Type::kStored && !(e.parent == BlockHash{}) &&
      std::find(e.hashes.begin(), e.hashes.end(), e.parent) != e.hashes.end()) {
    // A chain that contains its own parent is a cycle: its entries would never be leaves,
    // so pruning could not take them.
    return absl::InvalidArgumentError(absl::StrCat("events[", i, "].stored.parent_hash is one of its own "
                                                   "block_hashes; a chain cannot contain its parent"));
  }
  if (kind == SourceKind::kPoolNode && e.tier == Tier::kGpu) {
    return absl::InvalidArgumentError(absl::StrCat("events[", i, "].", what, ".tier=GPU from pool node \"",
                                                   source_id, "\"; pool nodes hold TIER_DRAM or TIER_NVME"));
  }
  // A worker's DRAM or NVMe copy would be routed as a pool hit that no worker can fetch
  // (workers fetch from pool nodes only).
  if (kind == SourceKind::kWorker && e.tier != Tier::kGpu) {
    return absl::InvalidArgumentError(absl::StrCat("events[", i, "].", what, ".tier=",
                                                   e.tier == Tier::kDram ? "DRAM" : "NVME", " from worker \"", source_id,
                                                   "\"; workers publish TIER_GPU (their paged KV pool); "
                                                   "TIER_DRAM and TIER_NVME are pool nodes' tiers"));
  }
  if (e.type == KvEvent::Type::kStored && e.hashes.size() > 1) {
    // A block repeated in one chain links it to itself through the blocks between: a
    // cycle, as with a chain containing its parent.
    thread_local absl::flat_hash_map<BlockHash, size_t> seen;  // kept between calls: no allocation per event
    seen.clear();
    for (size_t j = 0; j < e.hashes.size(); ++j) {
      if (auto [it, fresh] = seen.try_emplace(e.hashes[j], j); !fresh) {
        return absl::InvalidArgumentError(absl::StrCat("events[", i, "].stored.block_hashes[", j, "] repeats block_hashes[",
                                                       it->second, "]; a chain holds each block once"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HybridMode> ParseHybridMode(absl::string_view name) {
  if (name == "strict") return HybridMode::kStrict;
  if (name == "replay") return HybridMode::kReplay;
  return absl::InvalidArgumentError(
      absl::StrCat("hybrid mode \"", name, "\" is unknown; use strict or replay"));
}

absl::string_view HybridModeName(HybridMode mode) {
  return mode == HybridMode::kStrict ? "strict" : "replay";
}

RouterCore::RouterCore(RouterOptions options)
    : options_(std::move(options)),
      index_(KvIndex::Options{.max_entries = options_.max_index_entries}),
      load_(options_.decision_timeout),
      policy_(options_.policy_params, options_.seed) {
  // Not from options_.seed: two routers started with the same seed must not number alike.
  std::random_device rd;
  const uint64_t r = (uint64_t{rd()} << 32) ^ rd();
  registrations_ = (uint64_t{1} << 40) + r % ((uint64_t{1} << 62) - (uint64_t{1} << 40));
}

absl::StatusOr<std::unique_ptr<RouterCore>> RouterCore::Create(RouterOptions options) {
  if (options.models.empty()) {
    return absl::InvalidArgumentError("models: empty; name at least one model (e.g. --models=tiny-gqa)");
  }
  if (options.max_index_entries == 0) {
    return absl::InvalidArgumentError("max_index_entries=0; set --max-index-entries to a positive count");
  }
  if (options.ttft_slo_s < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ttft_slo_s=", options.ttft_slo_s,
                                                   " is negative; use 0 (off) or a positive value"));
  }
  if (!std::isfinite(options.ttft_decode_weight) || options.ttft_decode_weight < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ttft_decode_weight=", options.ttft_decode_weight,
                                                   " must be a finite number >= 0 (0 leaves decoding out)"));
  }
  if (options.heartbeat_timeout <= absl::ZeroDuration() || options.decision_timeout <= absl::ZeroDuration() ||
      options.approx_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("heartbeat timeout, decision timeout and approx TTL must be > 0");
  }
  auto core = std::unique_ptr<RouterCore>(new RouterCore(options));
  for (const std::string& name : core->options_.models) {
    auto spec = ResolveModelSpec(name);
    if (!spec.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("models: ", spec.status().message()));
    }
    if (core->options_.block_tokens != 0) spec->block_tokens = static_cast<int>(core->options_.block_tokens);
    if (absl::Status s = spec->Validate(); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("model ", spec->name, " with block_tokens=",
                                                     spec->block_tokens, ": ", s.message()));
    }
    for (const Model& m : core->models_) {
      if (m.spec.name == spec->name) {
        return absl::InvalidArgumentError(absl::StrCat("models: ", spec->name, " is listed twice"));
      }
    }
    ASSIGN_OR_RETURN(BlockHasher hasher,
                     BlockHasher::Create(HashOptions{.cluster_secret = core->options_.cluster_secret,
                                                     .model_id = spec->name,
                                                     .block_tokens = static_cast<uint32_t>(spec->block_tokens)}));
    const uint32_t bt = static_cast<uint32_t>(spec->block_tokens);
    core->models_.push_back(Model{std::move(*spec), bt, std::move(hasher)});
  }
  core->workers_by_model_.resize(core->models_.size());
  return core;
}

absl::StatusOr<const RouterCore::Model*> RouterCore::FindModel(absl::string_view name, uint32_t block_tokens,
                                                               absl::string_view field) const {
  if (name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".name: empty; name the model (e.g. \"",
                                                   models_.front().spec.name, "\")"));
  }
  for (const Model& m : models_) {
    if (m.spec.name != name) continue;
    if (block_tokens != 0 && block_tokens != m.block_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".block_tokens=", block_tokens, " but model ", name, " uses ", m.block_tokens,
          " tokens per block on this router; set block_tokens=", m.block_tokens, " or 0"));
    }
    return &m;
  }
  std::string known;
  for (const Model& m : models_) absl::StrAppend(&known, known.empty() ? "" : ", ", m.spec.name);
  return absl::InvalidArgumentError(
      absl::StrCat(field, ".name=\"", Clipped(name), "\" is not served by this router; it serves: ", known));
}

std::vector<BlockHash> RouterCore::HashTokens(const Model& model, std::span<const TokenId> tokens,
                                              absl::string_view tenant_salt,
                                              std::span<const uint64_t> extra_keys) const {
  // BlockHasher memcpy's from extra_keys.data() and tenant_salt.data() even when they are
  // empty, and memcpy from a null pointer is undefined (UBSan stops on it): never pass a
  // null empty range. (Reported for common/src/hash.cc.)
  static constexpr uint64_t kNoKeys[1] = {0};
  static constexpr char kNoSalt[1] = {0};
  if (extra_keys.empty()) extra_keys = std::span<const uint64_t>(kNoKeys, 0);
  if (tenant_salt.empty()) tenant_salt = absl::string_view(kNoSalt, 0);
  return model.hasher.HashPrefix(tokens, tenant_salt, extra_keys);
}

int64_t RouterCore::SlotOf(absl::string_view id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? -1 : static_cast<int64_t>(it->second);
}

std::pair<size_t, size_t> RouterCore::ApproxSizes(absl::string_view id) const {
  const int64_t slot = SlotOf(id);
  if (slot < 0) return {0, 0};
  const Source& s = sources_[static_cast<size_t>(slot)];
  return {s.approx.size(), s.approx_order.size()};
}

// ---- sources -------------------------------------------------------------------------

absl::Status RouterCore::Register(const SourceInfo& info, absl::Time now) {
  if (!ValidSourceId(info.id)) {
    return absl::InvalidArgumentError(absl::StrCat("source_id=\"", info.id.substr(0, 64),
                                                   "\" must be 1..128 bytes of [A-Za-z0-9._:-]"));
  }
  int model = -1;
  if (info.kind == SourceKind::kWorker) {
    ASSIGN_OR_RETURN(const Model* m, FindModel(info.model, info.block_tokens, "model"));
    model = static_cast<int>(m - models_.data());
  }
  if (auto it = by_id_.find(info.id); it != by_id_.end()) {
    DropSource(it->second);
  } else if (by_id_.size() >= options_.max_sources) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the router has ", by_id_.size(), " sources registered (max_sources); source_id=\"",
        info.id.substr(0, 64), "\" is refused until one leaves (Unregister, or missed heartbeats)"));
  }
  SourceSlot slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<SourceSlot>(sources_.size());
    sources_.emplace_back();
  }
  index_.ResetSource(slot);
  load_.Reset(slot, now);
  Source& s = sources_[slot];
  s.live = true;
  s.registration = ++registrations_;
  s.dump_asked = absl::InfinitePast();
  s.info = info;
  s.model = model;
  by_id_[info.id] = slot;
  if (model >= 0) {
    auto& w = workers_by_model_[static_cast<size_t>(model)];
    w.insert(std::upper_bound(w.begin(), w.end(), slot), slot);
  }
  return absl::OkStatus();
}

absl::Status RouterCore::Deregister(absl::string_view id) {
  auto it = by_id_.find(id);
  if (it == by_id_.end()) {
    return absl::NotFoundError(absl::StrCat("source_id=\"", id, "\" is not registered"));
  }
  DropSource(it->second);
  return absl::OkStatus();
}

void RouterCore::DropSource(SourceSlot slot) {
  Source& s = sources_[slot];
  index_.RemoveSource(slot);
  load_.Remove(slot);
  if (s.model >= 0) {
    auto& w = workers_by_model_[static_cast<size_t>(s.model)];
    w.erase(std::remove(w.begin(), w.end(), slot), w.end());
  }
  by_id_.erase(s.info.id);
  s = Source{};
  free_slots_.push_back(slot);
}

absl::StatusOr<RouterCore::Registration> RouterCore::FindRegistration(absl::string_view source_id) const {
  auto it = by_id_.find(source_id);
  if (it == by_id_.end()) {
    return absl::NotFoundError(absl::StrCat("source_id=\"", Clipped(source_id),
                                            "\" is not registered; call Register first"));
  }
  const Source& s = sources_[it->second];
  return Registration{s.registration, s.info.kind, s.info.publishes_events};
}

bool RouterCore::StreamLost(absl::string_view source_id, uint64_t registration) {
  auto it = by_id_.find(source_id);
  if (it == by_id_.end()) return false;
  const Source& s = sources_[it->second];
  if (s.registration != registration || !s.info.publishes_events) return false;
  if (!index_.MarkStale(it->second)) return false;
  ++full_dumps_requested_;
  return true;
}

absl::Status RouterCore::CheckPublishes(absl::string_view source_id, const Registration& reg) {
  if (reg.publishes_events) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "source_id=\"", Clipped(source_id), "\" registered with publishes_events=false (the router predicts its ",
      "blocks from its routes); register with publishes_events=true to publish events"));
}

absl::Status RouterCore::ValidateEvents(absl::string_view source_id, SourceKind kind,
                                        std::span<const KvEvent> events) {
  for (size_t i = 0; i < events.size(); ++i) {
    RETURN_IF_ERROR(ValidateEvent(source_id, kind, events[i], i));
  }
  return absl::OkStatus();
}

absl::Status RouterCore::ValidateBatch(absl::string_view source_id, const EventBatch& batch) const {
  ASSIGN_OR_RETURN(const Registration reg, FindRegistration(source_id));
  RETURN_IF_ERROR(CheckPublishes(source_id, reg));
  return ValidateEvents(source_id, reg.kind, batch.events);
}

absl::StatusOr<EventsResult> RouterCore::ApplyEvents(absl::string_view source_id, const EventBatch& batch,
                                                     absl::Time now) {
  RETURN_IF_ERROR(ValidateBatch(source_id, batch));
  const SourceSlot slot = by_id_.find(source_id)->second;
  load_.Seen(slot, now);
  return ApplyRange(slot, batch, 0, batch.events.size());
}

absl::StatusOr<EventsResult> RouterCore::ApplyPart(absl::string_view source_id, const EventBatch& batch,
                                                   size_t begin, size_t end, absl::Time now) {
  if (begin > end || end > batch.events.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ApplyPart: events [", begin, ", ", end, ") of a batch of ",
                                                   batch.events.size(), " events; pass begin <= end <= ",
                                                   batch.events.size()));
  }
  auto it = by_id_.find(source_id);
  if (it == by_id_.end()) return FindRegistration(source_id).status();  // NOT_FOUND, naming it
  load_.Seen(it->second, now);
  return ApplyRange(it->second, batch, begin, end);
}

EventsResult RouterCore::ApplyRange(SourceSlot slot, const EventBatch& batch, size_t begin, size_t end) {
  EventsResult r;
  if (batch.full_dump) {
    if (begin == 0) sources_[slot].dump_asked = absl::InfinitePast();  // the dump asked for is landing
    r.apply = index_.ApplyDumpPart(slot, batch, begin, end);
  } else {
    r.apply = index_.ApplyInOrder(slot, std::span<const KvEvent>(batch.events).subspan(begin, end - begin));
  }
  events_applied_ += r.apply.applied;
  if (r.apply.gap) ++full_dumps_requested_;
  r.full_dump_requested = r.apply.full_dump_requested;
  return r;
}

HeartbeatResult RouterCore::Heartbeat(absl::string_view source_id, const InstanceLoad& load,
                                      std::span<const uint64_t> completed, absl::Time now) {
  HeartbeatResult r;
  auto it = by_id_.find(source_id);
  if (it == by_id_.end()) {
    r.unknown_source = true;
    return r;
  }
  load_.Heartbeat(it->second, load, now);
  for (uint64_t id : completed) load_.Complete(id, it->second);
  // A stale source is asked for one dump per heartbeat_timeout, not at every heartbeat:
  // one sent after the last ask may still be queued here (the applier behind), and each
  // extra ask queued another whole dump behind it.
  Source& s = sources_[it->second];
  if (index_.stale(it->second) && now - s.dump_asked >= options_.heartbeat_timeout) {
    r.full_dump_requested = true;
    s.dump_asked = now;
  }
  return r;
}

std::vector<std::string> RouterCore::Tick(absl::Time now) {
  load_.ExpireDecisions(now);
  std::vector<SourceSlot> expired;
  for (SourceSlot slot = 0; slot < sources_.size(); ++slot) {
    Source& s = sources_[slot];
    if (!s.live) continue;
    // A source whose events are being applied is alive even when its heartbeats wait: a
    // publisher writes a long dump (or a backlog the applier holds back) on the thread
    // that heartbeats, and was dropped in the middle of it, to register and dump again.
    if (now - load_.last_seen(slot) > options_.heartbeat_timeout) {
      expired.push_back(slot);
      continue;
    }
    if (!s.approx_order.empty()) ExpirePredictions(s, slot, now);
  }
  // Their index entries go in one pass over the table (DropSource then finds none).
  index_.ClearSources(expired);
  std::vector<std::string> dropped;
  for (SourceSlot slot : expired) {
    dropped.push_back(sources_[slot].info.id);
    DropSource(slot);
    ++dropped_sources_;
  }
  return dropped;
}

// ---- approximate mode ----------------------------------------------------------------

uint32_t RouterCore::CheckpointBlocks(const Model& m) {
  return m.spec.IsHybrid() && m.spec.checkpoint_tokens > 0
             ? static_cast<uint32_t>(m.spec.checkpoint_tokens) / m.block_tokens
             : 0;
}

void RouterCore::PredictBlocks(SourceSlot slot, std::span<const BlockHash> hashes, absl::Time now) {
  Source& s = sources_[slot];
  ExpirePredictions(s, slot, now);
  index_.Store(slot, BlockHash{}, hashes, Tier::kGpu);
  // A hybrid worker also keeps the KDA checkpoints at the boundaries it computed: without
  // them a strict router never saw a hit on it (and replay priced the whole hit as KDA
  // replay). Each lives and goes with its boundary block's prediction (DropPrediction).
  const uint32_t ckpt = CheckpointBlocks(models_[static_cast<size_t>(s.model)]);
  for (size_t k = ckpt; ckpt > 0 && k <= hashes.size(); k += ckpt) {
    index_.Store(slot, BlockHash{}, hashes.subspan(k - 1, 1), Tier::kGpu, StateKind::kLinearState);
  }
  const absl::Time expiry = now + options_.approx_ttl;
  // Tail first: capacity eviction then drops a prediction's tail before its head (a head
  // dropped first left a tail that no prefix could match, held until its TTL).
  for (size_t i = hashes.size(); i-- > 0;) {
    const std::pair<absl::Time, uint64_t> stamp{expiry, s.approx_seq++};
    s.approx[hashes[i]] = stamp;
    s.approx_order.emplace_back(stamp, hashes[i]);
  }
  // A refreshed prediction leaves its old (expiry, hash) behind in the queue: routing
  // one prompt again and again would grow it by the prompt's length each time until
  // those expire. Past twice the live predictions it is rebuilt from them (amortized
  // O(log n) per prediction).
  if (s.approx_order.size() > 2 * s.approx.size() + 1024) {
    s.approx_order.clear();
    for (const auto& [h, t] : s.approx) s.approx_order.emplace_back(t, h);
    std::sort(s.approx_order.begin(), s.approx_order.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });  // stamps are unique
  }
  // Capacity: drop the predictions that would expire first (the least recently routed).
  // A worker that did not say how many blocks it holds gets the index's own bound, and
  // so does one that says more (capacity_blocks is the worker's word: 2^64 - 1 let its
  // predictions grow without bound).
  const uint64_t cap = s.info.capacity_blocks != 0 ? std::min(s.info.capacity_blocks, options_.max_index_entries)
                                                   : options_.max_index_entries;
  while (cap > 0 && s.approx.size() > cap && !s.approx_order.empty()) {
    const auto [t, h] = s.approx_order.front();
    s.approx_order.pop_front();
    auto it = s.approx.find(h);
    if (it != s.approx.end() && it->second == t) {
      s.approx.erase(it);
      DropPrediction(slot, h);
    }
  }
}

void RouterCore::DropPrediction(SourceSlot slot, const BlockHash& h) {
  index_.Remove(slot, std::span<const BlockHash>(&h, 1), Tier::kGpu);
  // The checkpoint predicted at this block, if it is a boundary (a no-op otherwise).
  if (CheckpointBlocks(models_[static_cast<size_t>(sources_[slot].model)]) > 0) {
    index_.Remove(slot, std::span<const BlockHash>(&h, 1), Tier::kGpu, StateKind::kLinearState);
  }
}

void RouterCore::ExpirePredictions(Source& s, SourceSlot slot, absl::Time now) {
  while (!s.approx_order.empty() && s.approx_order.front().first.first <= now) {
    const auto [t, h] = s.approx_order.front();
    s.approx_order.pop_front();
    auto it = s.approx.find(h);
    if (it != s.approx.end() && it->second == t) {  // not refreshed since
      s.approx.erase(it);
      DropPrediction(slot, h);
    }
  }
}

// ---- routing -------------------------------------------------------------------------

void RouterCore::ScoreCandidates(const Model& model, std::span<const BlockHash> hashes,
                                 uint64_t prompt_tokens) {
  const ModelSpec& spec = model.spec;
  const double bt = model.block_tokens;
  index_.FindMatches(hashes, &match_);
  const uint32_t walked = match_.walked_blocks;
  // pool_run_end_[i]: first block >= i not resident in DRAM/NVMe (walked at most).
  // nvme_only_[i]: blocks < i whose only pool copies are on NVMe.
  pool_run_end_.assign(walked + 1, walked);
  std::vector<uint32_t>& nvme_only = nvme_only_;
  nvme_only.assign(walked + 1, 0);
  for (uint32_t i = walked; i-- > 0;) {
    pool_run_end_[i] = match_.in_pool[i] ? pool_run_end_[i + 1] : i;
  }
  const uint8_t dram_bit = 1u << static_cast<int>(Tier::kDram);
  for (uint32_t i = 0; i < walked; ++i) {
    nvme_only[i + 1] = nvme_only[i] + ((match_.in_pool[i] != 0 && !(match_.in_pool[i] & dram_bit)) ? 1 : 0);
  }
  const uint32_t ckpt = CheckpointBlocks(model);
  const bool hybrid = ckpt > 0;
  const double kda_fraction =
      hybrid ? static_cast<double>(spec.NumLayers(AttentionKind::kKda)) / spec.NumLayers() : 0;
  const double bytes_per_token = static_cast<double>(spec.KvBytesPerToken());
  const double fixed_state = static_cast<double>(spec.FixedStateBytes());

  if (hybrid) {
    const uint32_t boundaries = walked / ckpt;
    state_below_.assign(boundaries + 1, 0);
    pool_state_.assign(boundaries + 1, 0);
    for (uint32_t k = 1; k <= boundaries; ++k) {
      const BlockHash& h = hashes[k * ckpt - 1];
      state_below_[k] = index_.AnyHasState(h) ? k : state_below_[k - 1];
      pool_state_[k] = state_below_[k] == k && index_.PoolHasState(h);
    }
  }
  const auto& workers = workers_by_model_[static_cast<size_t>(&model - models_.data())];
  cands_.clear();
  size_t gi = 0;  // match_.gpu and workers are both ascending by slot
  for (SourceSlot slot : workers) {
    while (gi < match_.gpu.size() && match_.gpu[gi].source < slot) ++gi;
    const uint32_t g_raw = (gi < match_.gpu.size() && match_.gpu[gi].source == slot) ? match_.gpu[gi].blocks : 0;
    uint32_t g = g_raw;
    uint32_t p = pool_run_end_[g] - g;
    // Last block boundary <= b (a multiple of ckpt) with a KDA checkpoint on this worker
    // or on a pool node past block `fetched_from`: a worker fetches checkpoints only
    // among the blocks it fetches (engine FetchFromPool), so a pool's checkpoint at or
    // before its own hit is no use to it (counting one made a strict hit look 8 blocks
    // long where the worker reuses 4).
    auto last_checkpoint = [&](uint32_t b, uint32_t fetched_from) {
      uint32_t k = state_below_[b / ckpt];
      while (k > 0 && !(pool_state_[k] && k * ckpt > fetched_from) && !index_.HasState(hashes[k * ckpt - 1], slot)) {
        k = state_below_[k - 1];
      }
      return k * ckpt;
    };
    const bool strict = hybrid && options_.hybrid_mode == HybridMode::kStrict;
    if (strict) {
      const uint32_t b = last_checkpoint(g + p, g);
      g = std::min(g, b);
      p = b - g;
    }
    double transfer_s = 0;
    if (p > 0) {
      const double nvme = nvme_only[g + p] - nvme_only[g];
      const double dram = p - nvme;
      transfer_s = dram * bt * bytes_per_token / options_.pool_dram_bandwidth +
                   nvme * bt * bytes_per_token / options_.pool_nvme_bandwidth +
                   (hybrid ? fixed_state / options_.pool_dram_bandwidth : 0);
      // Fetch only when it beats recomputing those blocks.
      if (transfer_s >= options_.cost.PrefillSeconds(spec, p * bt)) {
        p = 0;
        transfer_s = 0;
        // Strict: the hit must still end at a checkpoint, now one this worker holds
        // (the GPU run alone may stop between two).
        if (strict) g = last_checkpoint(g, /*fetched_from=*/g);
      }
    }
    double replay_s = 0;
    if (hybrid && options_.hybrid_mode == HybridMode::kReplay && g + p > 0) {
      const uint32_t c = last_checkpoint(g + p, /*fetched_from=*/p > 0 ? g : g + p);
      replay_s = options_.cost.PrefillSeconds(spec, (g + p - c) * bt) * kda_fraction;
    }
    // A worker computes the last prompt token whatever it holds (its logits give the
    // first output token): a fully cached prompt still costs it one token of prefill.
    const double hit_tokens = std::min<double>((g + p) * bt, static_cast<double>(prompt_tokens) - 1);
    Candidate c;
    c.slot = slot;
    c.gpu_blocks = g;
    c.pool_blocks = p;
    c.load = load_.Requests(slot);
    c.queued_tokens = load_.QueuedTokens(slot);
    const double queue_s = options_.cost.PrefillSeconds(spec, static_cast<double>(c.queued_tokens));
    const double decode_s = options_.ttft_decode_weight *
                            options_.cost.PrefillSeconds(spec, load_.Reported(slot).running_requests);
    c.est_ttft_s = queue_s + decode_s + transfer_s + replay_s +
                   options_.cost.PrefillSeconds(spec, static_cast<double>(prompt_tokens) - hit_tokens);
    cands_.push_back(c);
  }
}

absl::StatusOr<RouteDecision> RouterCore::Route(const RouteInput& in, absl::Time now) {
  ASSIGN_OR_RETURN(const Model* model, FindModel(in.model, in.block_tokens, "model"));
  if (in.hashes.empty() && in.prompt_tokens == 0) {
    return absl::InvalidArgumentError("tokens/block_hashes: the request is empty; send its tokens or block hashes");
  }
  if (in.prompt_tokens > kMaxPromptTokens) {
    // Decisions add their prefill tokens to a worker's queued tokens: bounded, so the
    // sums cannot wrap and make the busiest worker look idle.
    return absl::InvalidArgumentError(absl::StrCat("prompt_tokens=", in.prompt_tokens, " exceeds ",
                                                   kMaxPromptTokens, "; split the request"));
  }
  const uint64_t min_tokens = in.hashes.size() * model->block_tokens;
  if (in.prompt_tokens != 0 && in.prompt_tokens < min_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_tokens=", in.prompt_tokens, " is less than ",
                                                   in.hashes.size(), " blocks x ", model->block_tokens,
                                                   " tokens; set it to >= ", min_tokens, " or 0"));
  }
  const uint64_t prompt = in.prompt_tokens != 0 ? in.prompt_tokens : min_tokens;
  if (prompt > kMaxPromptTokens) {  // hashes only: 2^20 hashes of up to 2^16 tokens each
    return absl::InvalidArgumentError(absl::StrCat("block_hashes: ", in.hashes.size(), " blocks x ",
                                                   model->block_tokens, " tokens exceed ", kMaxPromptTokens,
                                                   " prompt tokens; split the request"));
  }
  PolicyKind kind = options_.policy;
  if (!in.policy.empty()) {
    ASSIGN_OR_RETURN(kind, ParsePolicy(in.policy));
  }
  if (workers_by_model_[static_cast<size_t>(model - models_.data())].empty()) {
    return absl::UnavailableError(absl::StrCat("no worker is registered for model ", model->spec.name,
                                               "; start one or retry later"));
  }
  ScoreCandidates(*model, in.hashes, prompt);
  if (options_.ttft_slo_s > 0) {
    double best = cands_.front().est_ttft_s;
    for (const Candidate& c : cands_) best = std::min(best, c.est_ttft_s);
    if (best > options_.ttft_slo_s) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "best estimated TTFT ", best, " s exceeds --ttft-slo=", options_.ttft_slo_s,
          " s on all ", cands_.size(), " instances; retry later or add instances"));
    }
  }
  const size_t i = policy_.Choose(kind, static_cast<uint32_t>(model - models_.data()), cands_,
                                  static_cast<uint32_t>(in.hashes.size()), in.session_id,
                                  [this](SourceSlot s) -> const std::string& { return sources_[s].info.id; });
  const Candidate& c = cands_[i];
  const Source& s = sources_[c.slot];
  RouteDecision d;
  d.instance_id = s.info.id;
  d.instance_address = s.info.address;
  d.slot = c.slot;
  d.gpu_hit_blocks = c.gpu_blocks;
  d.pool_hit_blocks = c.pool_blocks;
  d.estimated_ttft_s = c.est_ttft_s;
  d.policy = kind;
  d.total_blocks = static_cast<uint32_t>(in.hashes.size());
  if (c.pool_blocks > 0) {
    for (const PoolRun& r : index_.PoolLocations(in.hashes, c.gpu_blocks, c.pool_blocks)) {
      d.pool_locations.push_back(Location{sources_[r.holder].info.id, r.tier, r.first_block, r.num_blocks});
    }
  }
  // At least the last prompt token is computed (as in ScoreCandidates): a decision always
  // counts as queued work, or the ttft policy sent every fully cached request to one
  // worker until its next heartbeat.
  const uint64_t hit_tokens =
      std::min<uint64_t>(uint64_t{c.gpu_blocks + c.pool_blocks} * model->block_tokens, prompt - 1);
  d.decision_id = load_.AddDecision(c.slot, prompt - hit_tokens, now);
  ++decisions_by_policy_[static_cast<int>(kind)];
  if (!s.info.publishes_events) PredictBlocks(c.slot, in.hashes, now);
  return d;
}

// ---- stats ---------------------------------------------------------------------------

RouterStatsSnapshot RouterCore::Stats(absl::Time now) const {
  RouterStatsSnapshot st;
  for (SourceSlot slot = 0; slot < sources_.size(); ++slot) {
    const Source& s = sources_[slot];
    if (!s.live) continue;
    SourceStats x;
    x.id = s.info.id;
    x.kind = s.info.kind;
    x.address = s.info.address;
    x.model = s.info.model;
    x.load = load_.Reported(slot);
    x.inflight_decisions = load_.Inflight(slot);
    x.index_blocks = index_.source_entries(slot);
    x.stale = index_.stale(slot);
    x.publishes_events = s.info.publishes_events;
    x.last_sequence = index_.last_sequence(slot);
    x.last_heartbeat_age_s = absl::ToDoubleSeconds(now - load_.last_heartbeat(slot));
    st.sources.push_back(std::move(x));
  }
  st.index_entries = index_.entries();
  st.index_bytes = index_.MemoryBytes();
  std::copy(std::begin(decisions_by_policy_), std::end(decisions_by_policy_), st.decisions_by_policy);
  st.events_applied = events_applied_;
  st.full_dumps_requested = full_dumps_requested_;
  st.pruned_entries = index_.pruned_entries();
  st.dropped_sources = dropped_sources_;
  return st;
}

}  // namespace kvpool::router
