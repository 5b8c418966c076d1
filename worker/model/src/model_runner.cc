// ModelRunner: the engine loop and the cache-manager glue (admission, decode slots,
// copy-on-write, KDA restore, export / import). The math is in forward.cc.
#include "kvpool/worker/model/model_runner.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"
#include "kvpool/kernels/mla.h"
#include "runner_internal.h"

namespace kvpool::model {
namespace {

// Ids of the cache manager's internal import requests: the top bit keeps them apart
// from sequence ids.
constexpr uint64_t kImportIdBit = uint64_t{1} << 63;

// The shapes the kernels' launchers take (kernels/src/backend.cc: CheckGqaKv,
// CheckMlaKv, CheckPool). Checked at Create so that a spec the kernels refuse never
// reaches a forward pass.
absl::Status CheckKernelSupport(const ModelSpec& spec) {
  auto bad = [&spec](absl::string_view field, int value, absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", spec.name, "': ", field, "=", value, " ", why));
  };
  if (spec.HasKind(AttentionKind::kGqa)) {
    if (spec.gqa.head_dim != 64 && spec.gqa.head_dim != 128) {
      return bad("gqa.head_dim", spec.gqa.head_dim, "but the GQA kernels support 64 or 128");
    }
    if (spec.block_tokens != 1 && spec.block_tokens != 16 && spec.block_tokens != 64) {
      return bad("block_tokens", spec.block_tokens,
                 "but the GQA kernels support pages of 1, 16 or 64 tokens");
    }
  }
  if (spec.HasKind(AttentionKind::kMla)) {
    if (spec.block_tokens != kernels::kMlaPageSize) {
      return bad("block_tokens", spec.block_tokens,
                 absl::StrCat("but the MLA kernels need pages of ", kernels::kMlaPageSize,
                              " tokens"));
    }
    if (spec.mla.kv_lora_rank != 512) {
      return bad("mla.kv_lora_rank", spec.mla.kv_lora_rank, "but the MLA kernels need 512");
    }
    if (spec.mla.rope_dim != 64) {
      return bad("mla.rope_dim", spec.mla.rope_dim, "but the MLA kernels need 64");
    }
  }
  if (spec.HasKind(AttentionKind::kKda)) {
    if (spec.kda.head_k_dim < 1 || spec.kda.head_k_dim > 256) {
      return bad("kda.head_k_dim", spec.kda.head_k_dim, "but the KDA kernels need [1, 256]");
    }
    if (spec.kda.head_v_dim < 1 || spec.kda.head_v_dim > 256) {
      return bad("kda.head_v_dim", spec.kda.head_v_dim, "but the KDA kernels need [1, 256]");
    }
  }
  return absl::OkStatus();
}

}  // namespace

ModelRunner::ModelRunner(ModelSpec spec, RunnerOptions options, ModelWeights weights)
    : spec_(std::move(spec)),
      options_(std::move(options)),
      weights_(std::move(weights)),
      hasher_(*BlockHasher::Create(HashOptions{.cluster_secret = options_.cluster_secret,
                                               .model_id = spec_.name,
                                               .block_tokens = static_cast<uint32_t>(
                                                   spec_.block_tokens)})) {}

ModelRunner::~ModelRunner() = default;

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(const ModelSpec& spec,
                                                                 RunnerOptions options) {
  if (options.max_model_len <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_model_len=", options.max_model_len, " must be > 0; e.g. 2048"));
  }
  if (options.max_running <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_running=", options.max_running, " must be > 0; e.g. 32"));
  }
  if (spec.name.empty()) {
    return absl::InvalidArgumentError("spec.name is empty; block hashes need the model id");
  }
  ASSIGN_OR_RETURN(ModelWeights weights, ModelWeights::Generate(spec, options.weight_seed));
  RETURN_IF_ERROR(CheckKernelSupport(spec));
  // Validate hashing options before the constructor dereferences them.
  RETURN_IF_ERROR(BlockHasher::Create(HashOptions{
                      .cluster_secret = options.cluster_secret,
                      .model_id = spec.name,
                      .block_tokens = static_cast<uint32_t>(spec.block_tokens)})
                      .status());
  std::unique_ptr<ModelRunner> r(new ModelRunner(spec, std::move(options), std::move(weights)));
  ASSIGN_OR_RETURN(r->arena_, KvArena::Create(r->spec_, r->options_.num_blocks));
  ASSIGN_OR_RETURN(cache::CacheLayout layout, cache::CacheLayout::FromModelSpec(r->spec_));
  cache::CacheConfig config;
  config.num_blocks = r->options_.num_blocks;
  config.layout = layout;
  config.enable_prefix_caching = r->options_.enable_prefix_caching;
  config.hybrid_mode = r->options_.hybrid_mode;
  config.hash_options = r->hasher_.options();
  config.source_id = r->options_.source_id;
  config.event_sink = r->options_.event_sink;
  if (layout.state_pages != r->arena_->state_pages()) {
    return absl::InternalError(absl::StrCat("cache layout has ", layout.state_pages,
                                            " state pages, the arena ",
                                            r->arena_->state_pages()));
  }
  ASSIGN_OR_RETURN(r->cache_, cache::KvCacheManager::Create(std::move(config)));
  ASSIGN_OR_RETURN(r->backend_,
                   kernels::CreateBackend(r->options_.backend,
                                          {.num_threads = r->options_.num_threads}));
  if (r->backend_->memory_space() != kernels::MemorySpace::kHost) {
    return absl::UnimplementedError(absl::StrCat(
        "backend ", kernels::BackendName(r->options_.backend),
        " takes device memory but the runner's arena is host memory; use cpu_optimized "
        "or cpu_reference"));
  }
  int32_t slots = 0;
  if (r->spec_.IsHybrid()) {
    // Each running hybrid sequence holds its live state's pages, so no more than
    // (num_blocks - 1) / state_pages of them can run: size the scratch for that, not
    // for a max_running far above it.
    slots = std::min<int32_t>(
        r->options_.max_running,
        std::max<int32_t>(1, (r->options_.num_blocks - 1) / r->arena_->state_pages()));
    r->kda_scratch_.assign(
        static_cast<size_t>(r->arena_->state_bytes() / sizeof(float)) * static_cast<size_t>(slots),
        0.f);
  }
  r->num_state_slots_ = slots;
  for (int32_t s = slots - 1; s >= 0; --s) r->free_state_slots_.push_back(s);
  return r;
}

absl::StatusOr<SequenceId> ModelRunner::AddSequence(GenerateRequest request) {
  RETURN_IF_ERROR(CheckSequence(request.prompt_tokens, request.max_new_tokens));
  const int64_t n = static_cast<int64_t>(request.prompt_tokens.size());
  auto seq = std::make_unique<Sequence>();
  seq->id = next_id_++;
  seq->tokens = request.prompt_tokens;
  seq->request = std::move(request);
  seq->result.prompt_tokens = n;
  seq->reserved_pages = PagesNeeded(n, seq->request.max_new_tokens);
  const SequenceId id = seq->id;
  waiting_.push_back(std::move(seq));
  return id;
}

bool ModelRunner::HasRoomFor(int64_t prompt_tokens, int64_t max_new_tokens) const {
  if (running_.empty() && waiting_.empty()) return true;  // a lone sequence always starts (or fails alone)
  if (running_.size() + waiting_.size() >= static_cast<size_t>(options_.max_running)) return false;
  if (spec_.IsHybrid() && free_state_slots_.size() <= waiting_.size()) return false;
  int64_t reserved = reserved_pages_;
  for (const auto& seq : waiting_) reserved += seq->reserved_pages;
  return reserved + PagesNeeded(prompt_tokens, max_new_tokens) <= options_.num_blocks - 1;
}

absl::Status ModelRunner::CheckSequence(std::span<const TokenId> prompt, int64_t max_new_tokens) const {
  RETURN_IF_ERROR(CheckUsable());
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (n == 0) {
    return absl::InvalidArgumentError(
        "prompt_tokens is empty; a request needs at least one prompt token");
  }
  for (int64_t i = 0; i < n; ++i) {
    const TokenId t = prompt[static_cast<size_t>(i)];
    if (t >= static_cast<TokenId>(spec_.vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt_tokens[", i, "]=", t, " is out of range: model '", spec_.name,
          "' has vocab_size=", spec_.vocab_size, "; use ids 0..", spec_.vocab_size - 1));
    }
  }
  if (max_new_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens=", max_new_tokens, " must be >= 0 (0: prefill only)"));
  }
  if (max_new_tokens > options_.max_model_len - n) {  // not n + max_new_tokens: it may overflow
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt_tokens (", n, ") + max_new_tokens (", max_new_tokens, ") exceeds max_model_len=",
        options_.max_model_len, "; shorten the prompt or lower max_new_tokens"));
  }
  const int64_t need = PagesNeeded(n, max_new_tokens);
  if (need > options_.num_blocks - 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt_tokens (", n, ") + max_new_tokens (", max_new_tokens, ") need ", need,
        " pages but the arena has ", options_.num_blocks - 1,
        "; raise num_blocks or shorten the request"));
  }
  return absl::OkStatus();
}

int64_t ModelRunner::PagesNeeded(int64_t prompt_tokens, int64_t max_new_tokens) const {
  const int64_t total = prompt_tokens + max_new_tokens;
  // Blocks of the whole sequence (its last sampled token is never written).
  const int64_t b = spec_.block_tokens;
  // Hybrids also hold their live KDA state and each checkpoint they save.
  const int64_t checkpoints =
      spec_.IsHybrid() && options_.enable_prefix_caching ? total / spec_.checkpoint_tokens : 0;
  return (std::max<int64_t>(total - 1, prompt_tokens) + b - 1) / b +
         (spec_.IsHybrid() ? (1 + checkpoints) * arena_->state_pages() : 0);
}

absl::Status ModelRunner::ApplyAllocation(Sequence& seq, const cache::SlotAllocation& alloc,
                                          Segment& segment, PendingPages& pending) {
  const cache::BlockPool& pool = cache_->block_pool();
  const std::span<const cache::BlockId> table = cache_->BlockTable(seq.id);
  for (int32_t i = 0; i < alloc.num_new_blocks; ++i) {
    pending.insert(table[static_cast<size_t>(alloc.first_new_block + i)]);
  }
  for (const cache::CopyOp& op : alloc.copies) pending.insert(op.dst);
  for (const cache::CheckpointSave& save : alloc.checkpoint_saves) pending.insert(save.pages_head);
  for (const cache::CopyOp& op : alloc.copies) {
    if (op.num_pages == 1) {
      arena_->CopyPage(op.src, op.dst);
    } else {
      const std::vector<cache::BlockId> src = pool.RunPages(op.src), dst = pool.RunPages(op.dst);
      for (size_t i = 0; i < src.size() && i < dst.size(); ++i) arena_->CopyPage(src[i], dst[i]);
    }
  }
  if (alloc.live_state != cache::kNoBlock) {
    seq.live_state = alloc.live_state;
    const std::vector<cache::BlockId> live = pool.RunPages(alloc.live_state);
    if (alloc.restore.src != cache::kNoBlock) {
      // Restore: the checkpoint's pages into the live state, bit for bit.
      const std::vector<cache::BlockId> src = pool.RunPages(alloc.restore.src);
      if (src.size() != live.size()) {
        return absl::InternalError("checkpoint and live state runs differ in length");
      }
      for (size_t i = 0; i < src.size(); ++i) arena_->CopyPage(src[i], live[i]);
    } else {
      std::vector<std::byte> zeros(static_cast<size_t>(arena_->state_bytes()));
      arena_->WriteState(live, 0, zeros);
    }
  }
  segment.saves = alloc.checkpoint_saves;
  return absl::OkStatus();
}

absl::Status ModelRunner::Admit(Sequence& seq, std::vector<Segment>& segments,
                                PendingPages& pending, bool* fits) {
  *fits = true;
  cache::RequestSpec rs;
  rs.id = seq.id;
  rs.prompt_tokens = seq.tokens;
  rs.tenant_salt = seq.request.tenant_salt;
  RETURN_IF_ERROR(cache_->AddRequest(std::move(rs)));
  seq.in_cache = true;
  ASSIGN_OR_RETURN(cache::PrefixHit hit, cache_->GetComputedBlocks(seq.id));
  // A hit on pages this step is still filling (another sequence's prefill or decode)
  // waits for the next step, when their bytes exist.
  bool waits = hit.checkpoint != cache::kNoBlock && pending.contains(hit.checkpoint);
  for (cache::BlockId b : hit.blocks) waits = waits || pending.contains(b);
  if (waits) {
    RETURN_IF_ERROR(cache_->Free(seq.id));
    seq.in_cache = false;
    *fits = false;
    return absl::OkStatus();
  }
  const int64_t n = static_cast<int64_t>(seq.tokens.size());
  absl::StatusOr<cache::SlotAllocation> alloc =
      cache_->AllocateSlots(seq.id, n - hit.num_tokens, &hit);
  if (!alloc.ok()) {
    RETURN_IF_ERROR(cache_->Free(seq.id));
    seq.in_cache = false;
    if (absl::IsResourceExhausted(alloc.status())) {
      *fits = false;
      return absl::OkStatus();
    }
    return alloc.status();
  }
  Segment seg;
  seg.seq = &seq;
  seg.start = spec_.IsHybrid() ? hit.checkpoint_tokens : hit.num_tokens;
  seg.replay_end = hit.num_tokens;
  seg.end = n;
  RETURN_IF_ERROR(ApplyAllocation(seq, *alloc, seg, pending));
  seq.result.hit_tokens = hit.num_tokens;
  seq.result.checkpoint_tokens = hit.checkpoint_tokens;
  seq.result.replayed_tokens = hit.num_tokens - seg.start;
  seq.result.recomputed_tokens = n - hit.num_tokens;
  segments.push_back(std::move(seg));
  return absl::OkStatus();
}

absl::Status ModelRunner::PrepareDecode(Sequence& seq, std::vector<Segment>& segments,
                                        PendingPages& pending) {
  const TokenId last = seq.result.output_tokens.back();
  seq.tokens.push_back(last);
  RETURN_IF_ERROR(cache_->AppendTokens(seq.id, std::span<const TokenId>(&last, 1)));
  ASSIGN_OR_RETURN(cache::SlotAllocation alloc, cache_->AllocateSlots(seq.id, 1));
  Segment seg;
  seg.seq = &seq;
  seg.start = seq.computed;
  seg.replay_end = seq.computed;
  seg.end = seq.computed + 1;
  RETURN_IF_ERROR(ApplyAllocation(seq, alloc, seg, pending));
  // The block taking this token may become a cached hit now, one slot short.
  pending.insert(cache_->BlockTable(seq.id)[static_cast<size_t>(seq.computed /
                                                                spec_.block_tokens)]);
  segments.push_back(std::move(seg));
  return absl::OkStatus();
}

void ModelRunner::Finish(Sequence& seq, absl::Status status) {
  if (seq.in_cache) {
    // Free only fails for an unknown id, which in_cache rules out.
    cache_->Free(seq.id).IgnoreError();
    seq.in_cache = false;
  }
  if (seq.state_slot >= 0) {
    free_state_slots_.push_back(seq.state_slot);
    seq.state_slot = -1;
  }
  if (seq.state == Sequence::State::kRunning) reserved_pages_ -= seq.reserved_pages;
  seq.status = std::move(status);
  seq.state = Sequence::State::kFinished;
}

absl::Status ModelRunner::CheckUsable() const {
  if (broken_.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "model runner is unusable after a failed step (", broken_.ToString(),
      "); create a new runner"));
}

absl::StatusOr<std::vector<SequenceId>> ModelRunner::Step() {
  RETURN_IF_ERROR(CheckUsable());
  absl::StatusOr<std::vector<SequenceId>> done = StepOnce();
  if (done.ok()) return done;
  // The step may have left sequences half-advanced (a token appended with no K/V,
  // admitted with no output) and pages cached under hashes whose bytes were never
  // written: fail every sequence and refuse further work rather than compute on that.
  broken_ = done.status();
  for (auto* list : {&running_, &waiting_}) {
    for (auto& seq : *list) {
      Finish(*seq, absl::Status(broken_.code(), absl::StrCat("sequence ", seq->id,
                                                             " failed: engine step failed: ",
                                                             broken_.message())));
      finished_.emplace(seq->id, std::move(seq));
    }
    list->clear();
  }
  return done;
}

absl::StatusOr<std::vector<SequenceId>> ModelRunner::StepOnce() {
  last_step_tokens_ = 0;
  std::vector<SequenceId> done;
  std::vector<Segment> segments;
  segments.reserve(running_.size() + waiting_.size());
  PendingPages pending;
  // 1. Decode slots for the running sequences.
  for (auto& seq : running_) {
    absl::Status s = PrepareDecode(*seq, segments, pending);
    if (!s.ok()) {
      if (!absl::IsResourceExhausted(s)) return s;
      Finish(*seq, absl::ResourceExhaustedError(absl::StrCat(
                       "sequence ", seq->id, " ran out of KV pages while decoding (", s.message(),
                       "); raise num_blocks or lower max_running")));
    }
  }
  // 2. Admit waiting sequences, FIFO, while pages and slots last.
  while (!waiting_.empty() &&
         static_cast<int32_t>(running_.size()) < options_.max_running &&
         !(spec_.IsHybrid() && free_state_slots_.empty())) {
    Sequence& seq = *waiting_.front();
    // Admission reserves every page the sequence may need (prompt + max_new_tokens),
    // so a running sequence never runs out of pages mid-decode (there is no
    // preemption). Pages shared through prefix hits make this conservative.
    if (!running_.empty() && reserved_pages_ + seq.reserved_pages > options_.num_blocks - 1) {
      break;  // retry when running sequences have finished
    }
    bool fits = false;
    RETURN_IF_ERROR(Admit(seq, segments, pending, &fits));
    if (!fits) {
      const bool alone = segments.empty() && running_.empty();
      if (!alone) break;  // retry when running sequences have freed their pages
      Finish(seq, absl::ResourceExhaustedError(absl::StrCat(
                      "sequence ", seq.id, " does not fit in the KV arena even alone (",
                      options_.num_blocks - 1, " pages); raise num_blocks")));
    } else {
      seq.state = Sequence::State::kRunning;
      reserved_pages_ += seq.reserved_pages;
      if (spec_.IsHybrid()) {
        seq.state_slot = free_state_slots_.back();
        free_state_slots_.pop_back();
      }
    }
    running_.push_back(std::move(waiting_.front()));
    waiting_.erase(waiting_.begin());
  }
  // 3. One batched forward pass.
  if (!segments.empty()) {
    if (options_.forward_fault) RETURN_IF_ERROR(options_.forward_fault());
    // The pass's own buffers (activations, block tables) are heap vectors: running out
    // of memory fails the step (as a kernel's scratch does), not the process.
    absl::Status forward;
    try {
      forward = RunForward(segments);
    } catch (const std::bad_alloc&) {
      int64_t tokens = 0;
      for (const Segment& seg : segments) tokens += seg.end - seg.start;
      forward = absl::ResourceExhaustedError(absl::StrCat(
          "out of host memory in a forward pass of ", tokens, " positions over ", segments.size(), " sequences"));
    }
    RETURN_IF_ERROR(forward);
    for (const Segment& seg : segments) last_step_tokens_ += seg.end - seg.start;
  }
  for (Segment& seg : segments) {
    Sequence& seq = *seg.seq;
    seq.computed = seg.end;
    if (seq.request.max_new_tokens > 0) seq.result.output_tokens.push_back(seg.next_token);
    seq.result.hidden_digest = seg.hidden_digest;
    if (static_cast<int32_t>(seq.result.output_tokens.size()) >= seq.request.max_new_tokens) {
      Finish(seq, absl::OkStatus());
    }
  }
  // 4. Retire finished sequences.
  for (auto it = running_.begin(); it != running_.end();) {
    if ((*it)->state == Sequence::State::kFinished) {
      done.push_back((*it)->id);
      finished_.emplace((*it)->id, std::move(*it));
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
  return done;
}

int ModelRunner::NumUnfinished() const {
  return static_cast<int>(waiting_.size() + running_.size());
}

int ModelRunner::NumWaiting() const { return static_cast<int>(waiting_.size()); }

bool ModelRunner::Started(SequenceId id) const {
  if (finished_.contains(id)) return true;
  for (const auto& s : running_) {
    if (s->id == id) return true;
  }
  return false;
}

absl::StatusOr<GenerateResult> ModelRunner::TakeResult(SequenceId id) {
  auto it = finished_.find(id);
  if (it == finished_.end()) {
    for (const auto* list : {&waiting_, &running_}) {
      for (const auto& s : *list) {
        if (s->id == id) {
          return absl::FailedPreconditionError(absl::StrCat(
              "sequence ", id, " has not finished; call Step() until it is returned"));
        }
      }
    }
    return absl::NotFoundError(absl::StrCat("sequence ", id, " is unknown (or already taken)"));
  }
  std::unique_ptr<Sequence> seq = std::move(it->second);
  finished_.erase(it);
  if (!seq->status.ok()) return seq->status;
  return std::move(seq->result);
}

absl::Status ModelRunner::Abort(SequenceId id) {
  for (auto* list : {&waiting_, &running_}) {
    for (auto it = list->begin(); it != list->end(); ++it) {
      if ((*it)->id == id) {
        Finish(**it, absl::CancelledError(absl::StrCat("sequence ", id, " was aborted")));
        list->erase(it);
        return absl::OkStatus();
      }
    }
  }
  if (finished_.erase(id) > 0) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("sequence ", id, " is unknown"));
}

absl::StatusOr<GenerateResult> ModelRunner::Generate(GenerateRequest request) {
  ASSIGN_OR_RETURN(SequenceId id, AddSequence(std::move(request)));
  for (;;) {
    absl::StatusOr<std::vector<SequenceId>> done = Step();
    if (!done.ok()) {
      Abort(id).IgnoreError();  // forget the failed sequence; nobody will take it
      return done.status();
    }
    if (std::find(done->begin(), done->end(), id) != done->end()) return TakeResult(id);
  }
}

// --- pool integration --------------------------------------------------------------

std::vector<BlockHash> ModelRunner::HashPrompt(std::span<const TokenId> tokens,
                                               absl::string_view tenant_salt) const {
  // Same call the cache manager makes (no extra keys).
  static constexpr uint64_t kNone = 0;
  return hasher_.HashPrefix(tokens, tenant_salt, std::span<const uint64_t>(&kNone, 0));
}

absl::StatusOr<std::vector<std::byte>> ModelRunner::ExportBlock(const BlockHash& hash) const {
  RETURN_IF_ERROR(CheckUsable());
  const cache::BlockId id = cache_->block_pool().GetCachedBlock(hash);
  if (id == cache::kNoBlock) {
    return absl::NotFoundError(absl::StrCat("block ", hash.ToHex(), " is not cached here"));
  }
  const std::span<std::byte> page = arena_->Page(id);
  return std::vector<std::byte>(page.begin(), page.end());
}

absl::StatusOr<std::vector<std::byte>> ModelRunner::ExportCheckpoint(
    const BlockHash& hash) const {
  RETURN_IF_ERROR(CheckUsable());
  const cache::BlockId head = cache_->block_pool().GetCachedCheckpoint(hash);
  if (head == cache::kNoBlock) {
    return absl::NotFoundError(
        absl::StrCat("no KDA checkpoint is cached here under ", hash.ToHex()));
  }
  std::vector<std::byte> out(static_cast<size_t>(arena_->state_bytes()));
  arena_->ReadState(cache_->block_pool().RunPages(head), 0, out);
  return out;
}

absl::StatusOr<ImportPlan> ModelRunner::BeginImport(std::span<const BlockHash> chain,
                                                    std::span<const bool> have_bytes,
                                                    std::span<const BlockHash> checkpoints) {
  RETURN_IF_ERROR(CheckUsable());
  const size_t k = chain.size();
  if (have_bytes.size() != k) {
    return absl::InvalidArgumentError(absl::StrCat(
        "have_bytes has ", have_bytes.size(), " entries but chain has ", k,
        "; give one flag per chain hash"));
  }
  if (!checkpoints.empty() && !spec_.IsHybrid()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoints given but model '", spec_.name, "' has no KDA layers"));
  }
  ImportPlan plan;
  if (k == 0) return plan;
  const cache::BlockPool& pool = cache_->block_pool();
  // Blocks without bytes must be cached here now; snapshot them, since allocating the
  // import may take a free cached copy (a hybrid strict hit stops at the checkpoint,
  // so later cached blocks get fresh copies).
  std::vector<std::vector<std::byte>> local(k);
  for (size_t i = 0; i < k; ++i) {
    if (have_bytes[i]) continue;
    const cache::BlockId id = pool.GetCachedBlock(chain[i]);
    if (id == cache::kNoBlock) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", i, " (", chain[i].ToHex(), ") is not cached here and has no bytes to import"));
    }
    const std::span<std::byte> page = arena_->Page(id);
    local[i].assign(page.begin(), page.end());
  }
  const int64_t b = spec_.block_tokens;
  const cache::RequestId rid = kImportIdBit | next_import_id_++;
  cache::RequestSpec rs;
  rs.id = rid;
  // One token past the chain so the hit may cover every block.
  rs.num_prompt_tokens = static_cast<int64_t>(k) * b + 1;
  rs.block_hashes.assign(chain.begin(), chain.end());
  // Saves only the checkpoints the caller brings bytes for (others would take state runs,
  // evicting cached blocks, only to be evicted again; under page pressure they could push
  // the wanted one out), and no live KDA state.
  rs.import_checkpoints.emplace(checkpoints.begin(), checkpoints.end());
  RETURN_IF_ERROR(cache_->AddRequest(std::move(rs)));
  absl::StatusOr<cache::PrefixHit> hit = cache_->GetComputedBlocks(rid);
  absl::StatusOr<cache::SlotAllocation> alloc =
      hit.ok() ? cache_->AllocateSlots(rid, static_cast<int64_t>(k) * b - hit->num_tokens, &*hit)
               : absl::StatusOr<cache::SlotAllocation>(hit.status());
  if (!alloc.ok()) {
    cache_->Free(rid).IgnoreError();
    return alloc.status();
  }
  plan.request = rid;
  plan.stats.blocks_present = static_cast<int32_t>(hit->blocks.size());
  const std::span<const cache::BlockId> table = cache_->BlockTable(rid);
  for (size_t i = static_cast<size_t>(alloc->first_new_block); i < table.size(); ++i) {
    if (have_bytes[i]) {
      plan.blocks.push_back({static_cast<int32_t>(i), table[i]});
    } else {
      std::memcpy(arena_->PageAddress(table[i]), local[i].data(), local[i].size());
    }
    ++plan.stats.blocks_imported;
  }
  for (const cache::CheckpointSave& save : alloc->checkpoint_saves) {
    plan.cached_checkpoints.push_back(save.hash);
    bool given = false;
    for (const BlockHash& h : checkpoints) given = given || h == save.hash;
    if (given) {
      plan.checkpoints.push_back({save.hash, pool.RunPages(save.pages_head)});
    } else {
      plan.unfilled.push_back(save.hash);
    }
  }
  plan.stats.checkpoints_imported = static_cast<int32_t>(plan.checkpoints.size());
  plan.stats.checkpoints_skipped =
      static_cast<int32_t>(checkpoints.size()) - plan.stats.checkpoints_imported;
  return plan;
}

absl::Status ModelRunner::FinishImport(ImportPlan& plan, bool filled) {
  if (plan.request == 0) return absl::OkStatus();
  const cache::RequestId rid = plan.request;
  plan.request = 0;
  absl::Status first = cache_->Free(rid);
  // Checkpoint runs the manager set aside without bytes to put in them must not be
  // hits; on failure neither may the pages the caller was to fill. Only those pages go:
  // the blocks the import copied from this cache hold good bytes, and so do other copies
  // of a hash (evicting by hash dropped the local copies the import was made from).
  // Every eviction is tried even after one fails (a hit left behind serves bytes nobody
  // wrote), and a hash or page that is gone already (NOT_FOUND: an unfilled checkpoint is
  // also in cached_checkpoints) is what eviction wants.
  auto keep_first = [&](const absl::Status& st) {
    if (!st.ok() && !absl::IsNotFound(st) && first.ok()) first = st;
  };
  for (const BlockHash& h : plan.unfilled) keep_first(cache_->EvictCached(h, StateKind::kLinearState).status());
  if (!filled) {
    for (const BlockHash& h : plan.cached_checkpoints) {
      keep_first(cache_->EvictCached(h, StateKind::kLinearState).status());
    }
    for (const ImportPlan::BlockSlot& slot : plan.blocks) keep_first(cache_->EvictCachedBlock(slot.page));
  }
  return first;
}

absl::StatusOr<ImportStats> ModelRunner::ImportPrefix(const PrefixImport& import) {
  const size_t k = import.chain.size();
  if (import.blocks.size() != k) {
    return absl::InvalidArgumentError(absl::StrCat(
        "blocks has ", import.blocks.size(), " entries but chain has ", k,
        "; give one (possibly empty) byte span per chain hash"));
  }
  for (size_t i = 0; i < k; ++i) {
    const size_t n = import.blocks[i].size();
    if (n != 0 && n != static_cast<size_t>(arena_->page_bytes())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "blocks[", i, "] has ", n, " bytes but a block of model '", spec_.name, "' has ",
          arena_->page_bytes()));
    }
  }
  std::vector<BlockHash> ckpt_hashes;
  for (size_t i = 0; i < import.checkpoints.size(); ++i) {
    if (import.checkpoints[i].bytes.size() != static_cast<size_t>(arena_->state_bytes()) ||
        !spec_.IsHybrid()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoints[", i, "] has ", import.checkpoints[i].bytes.size(),
          " bytes but model '", spec_.name, "' has KDA states of ", arena_->state_bytes()));
    }
    ckpt_hashes.push_back(import.checkpoints[i].hash);
  }
  std::unique_ptr<bool[]> have(new bool[k]);
  for (size_t i = 0; i < k; ++i) have[i] = !import.blocks[i].empty();
  ASSIGN_OR_RETURN(ImportPlan plan,
                   BeginImport(import.chain, std::span<const bool>(have.get(), k), ckpt_hashes));
  for (const ImportPlan::BlockSlot& slot : plan.blocks) {
    const std::span<const std::byte> src = import.blocks[static_cast<size_t>(slot.chain_index)];
    std::memcpy(arena_->PageAddress(slot.page), src.data(), src.size());
  }
  for (const ImportPlan::CheckpointSlot& slot : plan.checkpoints) {
    for (const auto& c : import.checkpoints) {
      if (c.hash == slot.hash) arena_->WriteState(slot.pages, 0, c.bytes);
    }
  }
  const ImportStats stats = plan.stats;
  RETURN_IF_ERROR(FinishImport(plan, /*filled=*/true));
  return stats;
}

}  // namespace kvpool::model
