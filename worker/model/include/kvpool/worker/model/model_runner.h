// ModelRunner: runs a tiny-* model for real over the paged KV arena, with the cache
// manager deciding which pages hold which tokens. A continuous-batching engine:
//
//   id = AddSequence({prompt, max_new_tokens, tenant_salt})   validate + queue
//   loop: Step()     admit waiting sequences (prefix hit, allocate, copy-on-write,
//                    KDA restore, prefill of the missing tokens) and decode one token
//                    for every running sequence, all in one batched forward pass
//   TakeResult(id)   output tokens, hidden digest, hit / replay / recompute counts
//   Generate(req)    = AddSequence + Step until done + TakeResult
//
// One step of one sequence, with the cache manager's vocabulary:
//
//   prompt:  [ hit blocks (GetComputedBlocks) | new tokens ..................... ]
//   hybrid:  [ ckpt c ][ replay (KDA layers only) ][ new tokens .................. ]
//            restore the checkpoint into the live state, replay m - c tokens through
//            the layers up to the last KDA layer (no K/V written: the blocks are
//            cached), then compute the new tokens through every layer.
//
// THE INVARIANT: a request's output tokens and hidden digest are bit-identical
// whether its prefix came from the local cache, from pages imported with ImportPrefix
// (a pool fetch), or from recompute. It holds because every token's computation is a
// function of its position and the cached bytes only, never of how the context was
// split into cached / new / decoded:
//   - projections, norms, MLP and LM head are per-token matvecs with a fixed
//     accumulation order;
//   - attention for every token (prompt or decode) uses the *decode* kernels
//     (GqaDecode / MlaDecodeAbsorbed) with one batch row per token, seq_len = pos + 1,
//     reading its own K/V back from the page; their split-K chunks depend only on the
//     sequence length (kernels/README.md "Determinism"), so a prompt token computes
//     exactly what it would as a decode step. The prefill launchers (GqaPrefill,
//     MlaMaterialized) are not used: a different kernel for prompt tokens would make
//     blocks written by decode steps differ from the same blocks recomputed as a
//     prompt (multi-turn hits), and MlaMaterialized equals absorbed only to rounding.
//   - KDA runs the recurrence (KdaDecode) token by token for prompts too, so states at
//     any boundary — checkpoints saved during prefill or decode — equal the
//     uninterrupted run; checkpoints are fp32 copies, restored bit for bit.
//
// Errors: INVALID_ARGUMENT names the field (prompt_tokens[i], max_new_tokens,
// tenant_salt ...); RESOURCE_EXHAUSTED when the arena cannot hold a sequence at all.
//
// Thread safety: not thread-safe; the owner serializes every call (the worker service
// runs Step() from one engine thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/common/hash.h"
#include "kvpool/common/model_spec.h"
#include "kvpool/kernels/backend.h"
#include "kvpool/worker/cache/kv_cache_manager.h"
#include "kvpool/worker/model/kv_arena.h"
#include "kvpool/worker/model/weights.h"

namespace kvpool::model {

using SequenceId = uint64_t;

struct RunnerOptions {
  uint64_t weight_seed = 0x6b76706f6f6cull;  // "kvpool": every process must agree
  int32_t num_blocks = 128;         // arena pages, including the null page 0
  int64_t max_model_len = 2048;     // prompt + max_new_tokens, at most
  int32_t max_running = 32;         // sequences decoding at once
  bool enable_prefix_caching = true;
  cache::HybridHitMode hybrid_mode = cache::HybridHitMode::kReplay;
  kernels::Backend backend = kernels::Backend::kCpuOptimized;
  int num_threads = 1;              // kernel threads (results do not depend on it)
  uint64_t cluster_secret = HashOptions{}.cluster_secret;  // block hashing
  // Events of the cache manager (not owned; may be null) and their source id.
  cache::KvEventSink* event_sink = nullptr;
  std::string source_id = "worker";
  // Fault injection (tests): called before each batched forward pass; an error fails
  // that step as a kernel failure would (after the step allocated and cached its pages).
  std::function<absl::Status()> forward_fault;
  // Entries of the attention block table a forward pass builds at once (one row per
  // position computed, as wide as its longest row): a long prefill's attention runs in
  // as many chunks of rows as this bound needs (one row per chunk at least). Results do
  // not depend on it; tests lower it to make chunks.
  int64_t max_table_entries = int64_t{1} << 22;
};

struct GenerateRequest {
  std::vector<TokenId> prompt_tokens;  // 1..max_model_len ids, each < vocab_size
  int32_t max_new_tokens = 16;         // >= 0 (0: prefill only)
  std::string tenant_salt;             // caches of different salts are never shared
};

struct GenerateResult {
  std::vector<TokenId> output_tokens;  // greedy, max_new_tokens of them
  // Digest128 of the final hidden state (after the final norm, fp32) of the last
  // position computed: the one whose logits gave the last output token (the last
  // prompt token when max_new_tokens == 0).
  BlockHash hidden_digest;
  int64_t prompt_tokens = 0;
  int64_t hit_tokens = 0;         // prompt tokens whose KV came from the cache
  int64_t checkpoint_tokens = 0;  // hybrid: where the restored KDA state stood
  int64_t replayed_tokens = 0;    // hybrid replay: tokens run through KDA layers only
  int64_t recomputed_tokens = 0;  // prompt tokens computed through every layer
};

// Pool fetch: the bytes of a run of prefix blocks (and KDA checkpoints) to land in
// this runner's pages. `chain` is the request's block hashes h_1..h_k (BlockHasher::
// HashPrefix / HashPrompt); blocks[i] holds block i's bytes (BlockBytes() each) or is
// empty when block i is already cached here. Checkpoints are keyed by the hash of the
// block ending at their boundary (chain[boundary / block_tokens - 1]).
struct PrefixImport {
  std::vector<BlockHash> chain;
  std::vector<std::span<const std::byte>> blocks;  // [chain.size()]
  struct Checkpoint {
    BlockHash hash;
    std::span<const std::byte> bytes;  // state_bytes()
  };
  std::vector<Checkpoint> checkpoints;
};

struct ImportStats {
  int32_t blocks_imported = 0;      // written into fresh pages and cached
  int32_t blocks_present = 0;       // already cached here, left as they were
  int32_t checkpoints_imported = 0;
  int32_t checkpoints_skipped = 0;  // already cached, or outside the imported range
};

// An import whose bytes the caller lands in the arena itself (a transport Get straight
// into the pages: no staging copy). BeginImport allocates and caches; the caller fills
// `blocks[i].page` with the block bytes of chain[blocks[i].chain_index] and each
// checkpoint run with its state bytes; FinishImport(filled) releases the pages to the
// cache (filled) or evicts the pages the caller was to fill and the checkpoints (the fetch
// failed); blocks the import copied from this cache stay cached.
struct ImportPlan {
  struct BlockSlot {
    int32_t chain_index = 0;
    int32_t page = 0;  // arena page to fill (page_bytes)
  };
  struct CheckpointSlot {
    BlockHash hash;
    std::vector<int32_t> pages;  // the state run, head first (state byte layout)
  };
  std::vector<BlockSlot> blocks;
  std::vector<CheckpointSlot> checkpoints;
  ImportStats stats;
  // Internal: the import's cache request and what it cached.
  uint64_t request = 0;
  std::vector<BlockHash> cached_checkpoints, unfilled;
};

class ModelRunner {
 public:
  // FAILED_PRECONDITION for a spec that is not computable (real-shape presets run in
  // accounting mode, which belongs to the service); INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(const ModelSpec& spec,
                                                             RunnerOptions options = {});
  ~ModelRunner();

  // --- the engine ------------------------------------------------------------------
  // Validates and queues a request; nothing is computed until Step().
  absl::StatusOr<SequenceId> AddSequence(GenerateRequest request);
  // AddSequence's checks alone (the same errors), without queueing anything.
  absl::Status CheckSequence(std::span<const TokenId> prompt, int64_t max_new_tokens) const;
  // Whether a sequence of this request, added now, would start at the next Step as far
  // as running slots, KDA state slots and page reservations go (the sequences already
  // waiting ahead of it counted): a caller that imports a prefix for it first (a pool
  // fetch) waits until then, since imported blocks are free cached blocks that the
  // running sequences' allocations may evict while it waits. True when nothing runs or
  // waits (a lone sequence is always tried).
  bool HasRoomFor(int64_t prompt_tokens, int64_t max_new_tokens) const;
  // One engine step: admits waiting sequences (FIFO while max_running allows and the
  // pages every admitted sequence may need for prompt + max_new_tokens fit together)
  // and decodes one token for every running one, in one batched forward pass. Returns
  // the sequences that finished in this step (TakeResult them). A sequence that cannot
  // get pages even alone finishes with RESOURCE_EXHAUSTED; an error returned by Step
  // itself (a kernel failure) leaves the runner unusable: every queued and running
  // sequence finishes with that error, and later calls (Step, AddSequence, export,
  // import) return FAILED_PRECONDITION.
  absl::StatusOr<std::vector<SequenceId>> Step();
  // Tokens the last Step's batched forward pass computed: prompt (and, hybrid, replayed)
  // tokens of the sequences it admitted plus one per decoding sequence. The engine's
  // measure of prefill throughput is this over the step's time.
  int64_t last_step_tokens() const { return last_step_tokens_; }
  // Sequences queued or running.
  int NumUnfinished() const;
  int NumWaiting() const;  // queued, not admitted yet
  // True once the sequence was admitted (its prompt computed, first token sampled) —
  // running or finished; false while it waits or for an unknown id.
  bool Started(SequenceId id) const;
  // The result of a finished sequence (and forgets it). NOT_FOUND for an unknown id,
  // FAILED_PRECONDITION while it runs.
  absl::StatusOr<GenerateResult> TakeResult(SequenceId id);
  // Drops a queued or running sequence, releasing its pages.
  absl::Status Abort(SequenceId id);
  // AddSequence + Step() until it finishes + TakeResult (other queued sequences
  // advance too).
  absl::StatusOr<GenerateResult> Generate(GenerateRequest request);

  // --- pool integration ------------------------------------------------------------
  // The request's block hashes, as the cache manager (and the router) compute them.
  std::vector<BlockHash> HashPrompt(std::span<const TokenId> tokens,
                                    absl::string_view tenant_salt) const;
  // Bytes of the block cached under `hash` (arena().page_bytes() bytes, the block byte
  // layout of kv_arena.h). NOT_FOUND when not cached here.
  absl::StatusOr<std::vector<std::byte>> ExportBlock(const BlockHash& hash) const;
  // Bytes of the KDA checkpoint cached under `hash` (arena().state_bytes()).
  absl::StatusOr<std::vector<std::byte>> ExportCheckpoint(const BlockHash& hash) const;
  // Lands fetched blocks and checkpoints in fresh pages and caches them under their
  // hashes (they become ordinary free cached blocks: a following request hits them;
  // like any free cached block they may be evicted by later allocations, so import
  // right before AddSequence + Step). INVALID_ARGUMENT for sizes or a missing block;
  // RESOURCE_EXHAUSTED when the pages are not there (nothing changes then).
  absl::StatusOr<ImportStats> ImportPrefix(const PrefixImport& import);
  // The in-place form of ImportPrefix: chain as there; have_bytes[i] says whether the
  // caller will fill block i (false: it must be cached here now); checkpoints: hashes
  // whose state bytes the caller will fill. Nothing else may run on the runner between
  // BeginImport and FinishImport.
  absl::StatusOr<ImportPlan> BeginImport(std::span<const BlockHash> chain,
                                         std::span<const bool> have_bytes,
                                         std::span<const BlockHash> checkpoints);
  absl::Status FinishImport(ImportPlan& plan, bool filled);

  // --- introspection ---------------------------------------------------------------
  const ModelSpec& spec() const { return spec_; }
  const ModelWeights& weights() const { return weights_; }
  const KvArena& arena() const { return *arena_; }
  const cache::KvCacheManager& cache() const { return *cache_; }
  const RunnerOptions& options() const { return options_; }

  // Pages a sequence may hold over its life: blocks of prompt + max_new_tokens - 1
  // tokens, and for hybrids its live KDA state and the checkpoints it saves. A request
  // needing more than num_blocks - 1 is refused.
  int64_t PagesNeeded(int64_t prompt_tokens, int64_t max_new_tokens) const;

 private:
  struct Sequence;
  struct Segment;

  ModelRunner(ModelSpec spec, RunnerOptions options, ModelWeights weights);
  // Pages allocated in the current step: their bytes are written by this step's
  // forward pass, so no other sequence may take them as a hit before it ends.
  using PendingPages = absl::flat_hash_set<cache::BlockId>;
  absl::Status Admit(Sequence& seq, std::vector<Segment>& segments, PendingPages& pending,
                     bool* fits);
  absl::Status PrepareDecode(Sequence& seq, std::vector<Segment>& segments,
                             PendingPages& pending);
  absl::Status ApplyAllocation(Sequence& seq, const cache::SlotAllocation& alloc,
                               Segment& segment, PendingPages& pending);
  void Finish(Sequence& seq, absl::Status status);
  // Step without the failure handling.
  absl::StatusOr<std::vector<SequenceId>> StepOnce();
  // FAILED_PRECONDITION once a step has failed.
  absl::Status CheckUsable() const;
  absl::Status RunForward(std::vector<Segment>& segments);

  ModelSpec spec_;
  RunnerOptions options_;
  ModelWeights weights_;
  std::unique_ptr<KvArena> arena_;
  std::unique_ptr<cache::KvCacheManager> cache_;
  std::unique_ptr<kernels::KernelBackend> backend_;
  BlockHasher hasher_;
  std::vector<std::unique_ptr<Sequence>> waiting_;   // FIFO
  std::vector<std::unique_ptr<Sequence>> running_;
  absl::flat_hash_map<SequenceId, std::unique_ptr<Sequence>> finished_;
  std::vector<int32_t> free_state_slots_;            // KDA scratch slots
  // KDA scratch slots: min(max_running, hybrid sequences the arena's pages can hold).
  int32_t num_state_slots_ = 0;
  std::vector<float> kda_scratch_;   // [num_state_slots_][kda_layers][heads][d_k][d_v]
  int64_t reserved_pages_ = 0;  // sum of reserved_pages of the running sequences
  absl::Status broken_;  // the error of the step that failed; OK while usable
  int64_t last_step_tokens_ = 0;
  SequenceId next_id_ = 1;
  uint64_t next_import_id_ = 1;
};

}  // namespace kvpool::model
