// RouterCore: the whole router without I/O — sources, index, load, policies, decisions.
//
// The gRPC service converts protos to these structs and calls one method per RPC; the
// simulator (`kvctl simulate`) calls the same methods with its own clock. Nothing here
// reads a clock, a socket or a file: time is the `now` argument of every call that
// needs it, randomness comes from RouterOptions::seed.
//
// Pipeline of one Route:
//
//   hashes ─► KvIndex::FindMatches ─► per worker of the model:
//               gpu hit g, pool run p beyond g  ─► hybrid limit (strict | replay)
//               ─► fetch-vs-recompute on p ─► est TTFT = queue + decode + transfer + prefill
//             ─► Policy::Choose ─► SLO check ─► LoadTracker::AddDecision
//             ─► (approximate-mode instance) predicted blocks stored with a TTL
//
// Tick(now) does the periodic work: drops sources that missed heartbeats (with their
// index entries), releases timed-out decisions, expires approximate-mode predictions.
//
// Example:
//   ASSIGN_OR_RETURN(auto core, RouterCore::Create(options));
//   core->Register({.id = "w0", .kind = SourceKind::kWorker, .model = "tiny-gqa"}, now);
//   core->ApplyEvents("w0", batch, now);
//   ASSIGN_OR_RETURN(RouteDecision d, core->Route({.model = "tiny-gqa", .hashes = h}, now));
//
// Thread safety: none, except the const model/hashing methods (FindModel, HashTokens),
// which only read state fixed at Create and may run concurrently with anything. The
// service serialises the rest behind one absl::Mutex.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvpool/common/cost_model.h"
#include "kvpool/common/hash.h"
#include "kvpool/common/model_spec.h"
#include "kvpool/router/events.h"
#include "kvpool/router/kv_index.h"
#include "kvpool/router/load_tracker.h"
#include "kvpool/router/policy.h"

namespace kvpool::router {

// How a hybrid (KDA) model's hit counts: KDA state exists only at checkpoints.
enum class HybridMode : uint8_t {
  kStrict,  // the hit ends at the last checkpoint <= the KV hit
  kReplay,  // the whole KV hit counts; the gap after the last checkpoint is replayed
            // through the KDA layers (costed as that fraction of a prefill)
};
absl::StatusOr<HybridMode> ParseHybridMode(absl::string_view name);  // "strict", "replay"
absl::string_view HybridModeName(HybridMode mode);

struct RouterOptions {
  std::vector<std::string> models = {"tiny-gqa"};  // preset names or JSON spec paths
  uint32_t block_tokens = 0;         // 0 = each model's default; else applies to every model
  PolicyKind policy = PolicyKind::kCacheAware;
  PolicyParams policy_params;
  size_t max_index_entries = 1u << 24;
  // Registered sources at most: Register of a new id beyond it is RESOURCE_EXHAUSTED
  // (each source costs per-slot state in the index and the load table).
  size_t max_sources = 65536;
  double ttft_slo_s = 0;             // > 0: Route answers RESOURCE_EXHAUSTED above it
  // ttft: the step that prefills a request also decodes one token of each sequence its
  // worker is running (reported running_requests), costed as that many prefill tokens
  // times this weight (compute only: the marginal cost of those tokens in the step).
  // 0 leaves decoding out (an instance busy decoding looked idle).
  double ttft_decode_weight = 1.0;
  HybridMode hybrid_mode = HybridMode::kStrict;
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration heartbeat_timeout = absl::Seconds(10);  // missed for this long: dropped
  absl::Duration decision_timeout = absl::Seconds(30);   // in-flight decision released
  absl::Duration approx_ttl = absl::Seconds(120);        // approximate-mode prediction life
  CostModel cost;
  double pool_dram_bandwidth = DefaultBandwidth(FetchTier::kRdma);  // remote DRAM, bytes/s
  double pool_nvme_bandwidth = DefaultBandwidth(FetchTier::kNvme);
  uint64_t seed = 1;
  uint64_t cluster_secret = HashOptions{}.cluster_secret;
};

struct SourceInfo {
  std::string id;          // 1..128 bytes of [A-Za-z0-9._:-]
  SourceKind kind = SourceKind::kWorker;
  std::string address;     // host:port, informational
  std::string model;       // workers: a configured model; pool nodes: empty
  uint32_t block_tokens = 0;  // 0 = the model's
  uint64_t capacity_blocks = 0;
  bool publishes_events = true;  // false: approximate mode
};

// Largest prompt a Route accepts (tokens): decisions sum their prefill tokens per worker.
inline constexpr uint64_t kMaxPromptTokens = uint64_t{1} << 32;

struct RouteInput {
  std::string model;
  uint32_t block_tokens = 0;        // 0 = the model's
  std::vector<BlockHash> hashes;    // the request's chain (empty for a prompt under one block)
  uint64_t prompt_tokens = 0;       // 0 = hashes.size() * block_tokens; one of the two is > 0
  std::string session_id;
  std::string policy;               // "" = RouterOptions::policy
};

struct Location {
  std::string holder_id;
  Tier tier;
  uint32_t first_block;
  uint32_t num_blocks;
};

struct RouteDecision {
  std::string instance_id;
  std::string instance_address;
  SourceSlot slot = 0;
  uint32_t gpu_hit_blocks = 0;
  uint32_t pool_hit_blocks = 0;
  std::vector<Location> pool_locations;
  double estimated_ttft_s = 0;
  PolicyKind policy = PolicyKind::kCacheAware;
  uint64_t decision_id = 0;
  uint32_t total_blocks = 0;
};

struct EventsResult {
  ApplyResult apply;
  bool full_dump_requested = false;
};

struct HeartbeatResult {
  bool full_dump_requested = false;
  bool unknown_source = false;
};

struct SourceStats {
  std::string id;
  SourceKind kind;
  std::string address;
  std::string model;
  InstanceLoad load;
  uint64_t inflight_decisions = 0;
  uint64_t index_blocks = 0;
  bool stale = false;
  bool publishes_events = true;
  uint64_t last_sequence = 0;
  double last_heartbeat_age_s = 0;
};

struct RouterStatsSnapshot {
  std::vector<SourceStats> sources;
  uint64_t index_entries = 0;
  uint64_t index_bytes = 0;
  uint64_t decisions_by_policy[kNumPolicies] = {};
  uint64_t events_applied = 0;
  uint64_t full_dumps_requested = 0;
  uint64_t pruned_entries = 0;
  uint64_t dropped_sources = 0;
};

class RouterCore {
 public:
  struct Model {
    ModelSpec spec;
    uint32_t block_tokens;
    BlockHasher hasher;
  };

  // Resolves the models (INVALID_ARGUMENT naming the model when unknown) and validates
  // the options.
  static absl::StatusOr<std::unique_ptr<RouterCore>> Create(RouterOptions options);

  const RouterOptions& options() const { return options_; }
  // The model `name` with `block_tokens` (0 = its own); INVALID_ARGUMENT names `field`.
  // Thread-safe.
  absl::StatusOr<const Model*> FindModel(absl::string_view name, uint32_t block_tokens,
                                         absl::string_view field = "model") const;
  // Hashes `tokens` like the workers do. Thread-safe.
  std::vector<BlockHash> HashTokens(const Model& model, std::span<const TokenId> tokens,
                                    absl::string_view tenant_salt,
                                    std::span<const uint64_t> extra_keys) const;

  // Adds a source, or restarts it (entries, sequence and decisions reset).
  absl::Status Register(const SourceInfo& info, absl::Time now);
  // One registration of a source. Register numbers each one, never reusing a number (slots
  // are reused; numbers of different router processes start far apart at random), so
  // work queued for a source can tell whether the source has registered again since:
  // events of the previous incarnation must not apply to the new one.
  struct Registration {
    uint64_t id = 0;  // > 0
    SourceKind kind = SourceKind::kWorker;
    bool publishes_events = true;
  };
  // The current registration of `source_id`; NOT_FOUND when it is not registered.
  absl::StatusOr<Registration> FindRegistration(absl::string_view source_id) const;
  // FAILED_PRECONDITION for a source registered with publishes_events=false (approximate
  // mode): the router predicts its blocks, and its events would mix with the predictions.
  static absl::Status CheckPublishes(absl::string_view source_id, const Registration& reg);
  // Drops a source with its entries. NOT_FOUND when unknown.
  absl::Status Deregister(absl::string_view id);
  // An event stream of `source_id`'s registration `registration` broke (cancelled, cut,
  // or refused a batch): events written to it may never have arrived, and no later
  // sequence number may show the gap. Marks the source stale, so its next heartbeat asks
  // for a full dump; its entries stay until the dump lands. Nothing happens when the
  // source is unknown, has registered again since, or does not publish events. Returns
  // whether the source became stale.
  bool StreamLost(absl::string_view source_id, uint64_t registration);
  // Validates the whole batch (nothing applies when one event is bad), then applies it.
  // NOT_FOUND for an unregistered source; INVALID_ARGUMENT naming the event and field.
  absl::StatusOr<EventsResult> ApplyEvents(absl::string_view source_id, const EventBatch& batch,
                                           absl::Time now);
  // The checks ApplyEvents makes before applying anything (callers that apply a large
  // batch in slices validate it whole first).
  absl::Status ValidateBatch(absl::string_view source_id, const EventBatch& batch) const;
  // ValidateBatch's checks of each event, for a source `source_id` of `kind`. Reads no
  // core state, so a caller may run it without the core's lock (RouterHost does, on a
  // large batch, with the kind from FindRegistration). Errors name events[i].
  static absl::Status ValidateEvents(absl::string_view source_id, SourceKind kind,
                                     std::span<const KvEvent> events);
  // Applies events [begin, end) of `batch`, a full dump (KvIndex::ApplyDumpPart) or not
  // (KvIndex::ApplyInOrder), without validating them: RouterHost validates a large batch
  // whole, off its lock, then applies it in parts and releases its lock in between, so
  // Route does not wait for the whole batch. ApplyEvents is ValidateBatch and the one
  // part [0, size). INVALID_ARGUMENT for a range outside the batch; NOT_FOUND for an
  // unregistered source.
  // REQUIRES: parts in order; ValidateEvents(source_id, kind, batch.events) passed before
  // the first part, with `kind` from the source's registration, and the source has not
  // registered again since (the checks read nothing else, so checking again per part
  // would repeat the same answer; RouterHost checks the registration at every part).
  absl::StatusOr<EventsResult> ApplyPart(absl::string_view source_id, const EventBatch& batch, size_t begin,
                                         size_t end, absl::Time now);
  HeartbeatResult Heartbeat(absl::string_view source_id, const InstanceLoad& load,
                            std::span<const uint64_t> completed_decisions, absl::Time now);
  // Releases one decision's optimistic load (the simulator's completion path).
  bool CompleteDecision(uint64_t decision_id) { return load_.Complete(decision_id); }
  absl::StatusOr<RouteDecision> Route(const RouteInput& in, absl::Time now);
  // Periodic maintenance; returns the ids of sources dropped for missed heartbeats.
  std::vector<std::string> Tick(absl::Time now);

  RouterStatsSnapshot Stats(absl::Time now) const;  // O(index blocks): computes bytes
  const KvIndex& index() const { return index_; }
  const LoadTracker& load() const { return load_; }
  size_t num_sources() const { return by_id_.size(); }
  // Slot of a registered source, or -1.
  int64_t SlotOf(absl::string_view id) const;
  // Approximate mode: the source's live predictions and its queued expiries (refreshed
  // predictions leave stale ones until the queue is rebuilt); {0, 0} when unknown.
  std::pair<size_t, size_t> ApproxSizes(absl::string_view id) const;

 private:
  struct Source {
    bool live = false;
    uint64_t registration = 0;  // Registration::id; 0 for a free slot
    SourceInfo info;
    int model = -1;  // index into models_, -1 for pool nodes
    // When a heartbeat last asked this (stale) source for a full dump; InfinitePast once
    // a dump's first part applied, and at Register. Heartbeats ask again only
    // heartbeat_timeout later: the dump is on its way (the publisher writes it before
    // its next heartbeat) and may wait behind other batches to be applied.
    absl::Time dump_asked = absl::InfinitePast();
    // Approximate mode: each predicted block's stamp (expiry, then order of prediction:
    // a prediction's blocks are stamped tail first, so among equal expiries a chain's
    // tail goes before its head, leaf-first), and the stamps in the order they go.
    absl::flat_hash_map<BlockHash, std::pair<absl::Time, uint64_t>, BlockHashHasher> approx;
    std::deque<std::pair<std::pair<absl::Time, uint64_t>, BlockHash>> approx_order;
    uint64_t approx_seq = 0;
  };

  explicit RouterCore(RouterOptions options);
  // ApplyPart once the source is found and the range checked.
  EventsResult ApplyRange(SourceSlot slot, const EventBatch& batch, size_t begin, size_t end);
  void DropSource(SourceSlot slot);
  void PredictBlocks(SourceSlot slot, std::span<const BlockHash> hashes, absl::Time now);
  void ExpirePredictions(Source& s, SourceSlot slot, absl::Time now);
  // Removes one predicted block of `slot`, and the checkpoint predicted at it if any.
  void DropPrediction(SourceSlot slot, const BlockHash& h);
  // Blocks per KDA checkpoint interval; 0 for a model without checkpoints.
  static uint32_t CheckpointBlocks(const Model& m);
  // Fills cands_ (one per live worker of `model`) from one index walk.
  void ScoreCandidates(const Model& model, std::span<const BlockHash> hashes, uint64_t prompt_tokens);

  RouterOptions options_;
  std::vector<Model> models_;
  KvIndex index_;
  LoadTracker load_;
  Policy policy_;
  std::vector<Source> sources_;  // by slot
  std::vector<SourceSlot> free_slots_;
  absl::flat_hash_map<std::string, SourceSlot> by_id_;
  std::vector<std::vector<SourceSlot>> workers_by_model_;  // [model] -> live worker slots
  uint64_t decisions_by_policy_[kNumPolicies] = {};
  uint64_t events_applied_ = 0;
  uint64_t full_dumps_requested_ = 0;
  uint64_t dropped_sources_ = 0;
  // The last Registration::id given out. Starts at a random point in [2^40, 2^62) per
  // router process, so that a number from an earlier process (an Unregister or a stream
  // that outlived a router restart) does not name a registration of this one.
  uint64_t registrations_ = 0;
  // Scratch reused across Route calls (no allocation in the steady state).
  MatchResult match_;
  std::vector<Candidate> cands_;
  std::vector<uint32_t> pool_run_end_;  // [walked + 1]: first block >= i not in the pool
  std::vector<uint32_t> nvme_only_;     // [walked + 1]: blocks < i held only on NVMe
  // Hybrids, per checkpoint boundary k (block k * interval) up to the walked blocks:
  // the last boundary <= k where any source holds the KDA state (0: none), and whether
  // a pool node holds it there. Built once per Route, so each worker's search for its
  // last usable checkpoint skips the boundaries nobody holds (it probed every one, per
  // worker: 64 workers x 512 boundaries of a long pool-resident prefix per Route).
  std::vector<uint32_t> state_below_;
  std::vector<char> pool_state_;
};

}  // namespace kvpool::router
