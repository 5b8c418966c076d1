// Private to worker/model: the per-sequence state of ModelRunner and the unit of work
// of one forward pass.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kvpool/worker/cache/cache_manager.h"
#include "kvpool/worker/model/model_runner.h"

namespace kvpool::model {

struct ModelRunner::Sequence {
  enum class State : uint8_t { kWaiting, kRunning, kFinished };

  SequenceId id = 0;
  GenerateRequest request;
  std::vector<TokenId> tokens;  // prompt + generated tokens fed back so far
  State state = State::kWaiting;
  bool in_cache = false;        // AddRequest done, Free pending
  int64_t computed = 0;         // positions [0, computed) have K/V (and KDA state)
  int32_t state_slot = -1;      // KDA scratch slot while running
  // Pages the whole sequence may hold (prompt + max_new_tokens, KDA state runs); counted
  // in ModelRunner::reserved_pages_ while running.
  int64_t reserved_pages = 0;
  cache::BlockId live_state = cache::kNoBlock;
  GenerateResult result;
  absl::Status status;
};

// Positions [start, end) of one sequence computed in this pass: [start, replay_end)
// run through the layers up to the last KDA layer only (hybrid replay; their K/V is
// cached), [replay_end, end) through every layer, writing K/V into the pages.
struct ModelRunner::Segment {
  Sequence* seq = nullptr;
  int64_t start = 0;
  int64_t replay_end = 0;
  int64_t end = 0;
  std::vector<cache::CheckpointSave> saves;  // copy the KDA state out at these
  std::vector<cache::BlockId> blocks;        // the block table, copied for the pass
  // Outputs: the token sampled from position end - 1 and its final hidden digest.
  TokenId next_token = 0;
  BlockHash hidden_digest;
};

}  // namespace kvpool::model
