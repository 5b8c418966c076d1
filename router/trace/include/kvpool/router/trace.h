// Mooncake-format request traces: parsing, block-size mapping, token synthesis and
// the analysis every load test reports next to its own figures.
//
// A trace is JSONL, one request per line (../shared/data/traces/README.md):
//
//   {"timestamp": 277, "input_length": 32140, "output_length": 92, "hash_ids": [198, ...]}
//
//   timestamp      arrival, ms from trace start (>= 0)
//   input_length   prompt tokens (>= 1)
//   output_length  generated tokens (>= 0)
//   hash_ids       one id per trace block of `trace_block_tokens` (512) prompt tokens,
//                  ceil(input_length / 512) of them; equal ids at equal positions =
//                  the same prefix, i.e. reusable KV
//
// Each line is validated; a bad line is reported (line number + reason) and skipped, or
// is fatal in strict mode. A last line without a newline that does not parse is reported
// as truncated (a trace cut off mid-write).
//
// Block-size mapping. The cache's block (16 tokens for GQA, 64 for MLA) differs from the
// trace's (512). A request becomes tokens: token p is a pure function of
// (hash_ids[p / 512], p % 512), so equal hash ids give equal tokens and the cache's own
// chained hashing (common/hash.h) yields equal block hashes exactly where the trace
// shares a prefix. A cache block is reusable only when every token in it lies in the
// shared trace prefix, i.e. trace blocks map onto *whole* cache blocks:
//
//   trace blocks (512):  [ id 7 ......................... ][ id 9 .......... ]
//   cache blocks (16):   [b0][b1] ... [b31]                 [b32] ... [b63]
//   a hit of k trace blocks = floor(min(k*512, L) / 16) cache blocks
//
// Analysis (AnalyzeTrace) computes, from the trace alone, the infinite-cache upper bound
// of the prefix hit rate (every block ever seen stays cached) and the same after
// dropping duplicated prompts, which inflate the hit rate without saying anything about
// prefix sharing.
//
// Example:
//   ASSIGN_OR_RETURN(trace::Trace t, trace::LoadTrace(path, {.trace_block_tokens = 512}));
//   for (const auto& issue : t.issues) std::cerr << "line " << issue.line << ": " << issue.reason;
//   ASSIGN_OR_RETURN(auto map, trace::BlockMapping::Create(512, 16));
//   trace::TraceAnalysis a = trace::AnalyzeTrace(t.requests, map);
//
// Thread safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <istream>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvpool/common/hash.h"

namespace kvpool::trace {

inline constexpr int64_t kDefaultTraceBlockTokens = 512;
// Largest --trace-block-tokens accepted (Mooncake traces use 512).
inline constexpr int64_t kMaxTraceBlockTokens = int64_t{1} << 20;
// Largest input_length accepted: the router's limit on a Route's token ids
// (kvpool.v1.RouteRequest.tokens: 1..2^24). A longer prompt could never be routed, and
// synthesizing its tokens (SynthesizeTokens) would allocate without bound.
inline constexpr int64_t kMaxTraceInputTokens = int64_t{1} << 24;
// Generated tokens per request, and arrival times (ms, about 31 years), a trace may give:
// beyond these a replay's max_new_tokens would wrap and a simulation's clock overflow.
inline constexpr int64_t kMaxTraceOutputTokens = int64_t{1} << 24;
inline constexpr double kMaxTraceTimestampMs = 1e12;

struct TraceRequest {
  int64_t line = 0;          // 1-based line in the file
  double timestamp_ms = 0;   // arrival, ms from trace start
  int64_t input_length = 0;  // prompt tokens, >= 1
  int64_t output_length = 0; // generated tokens, >= 0
  std::vector<uint64_t> hash_ids;  // ceil(input_length / trace_block_tokens) entries
};

// A line that was skipped.
struct TraceIssue {
  int64_t line = 0;
  std::string reason;
};

struct ParseOptions {
  int64_t trace_block_tokens = kDefaultTraceBlockTokens;  // 1..kMaxTraceBlockTokens
  bool strict = false;  // the first bad line fails the parse (INVALID_ARGUMENT, with its line)
  size_t limit = 0;     // keep the first this many valid lines in file order (then sorted); 0 = all
};

struct Trace {
  std::vector<TraceRequest> requests;  // ascending by timestamp (stable)
  std::vector<TraceIssue> issues;      // skipped lines, in file order
  int64_t lines = 0;                   // lines read (blank ones included)
  int64_t trace_block_tokens = kDefaultTraceBlockTokens;
  bool limited = false;  // reading stopped at ParseOptions::limit with lines left unread
};

// Parses one line (without its newline). INVALID_ARGUMENT names the field and the fix:
// input_length must be 1..kMaxTraceInputTokens, trace_block_tokens 1..kMaxTraceBlockTokens.
absl::StatusOr<TraceRequest> ParseTraceLine(absl::string_view line, int64_t line_no,
                                            int64_t trace_block_tokens);
// Parses a whole stream. Only strict mode (or bad options) makes this fail; otherwise
// bad lines land in Trace::issues.
absl::StatusOr<Trace> ParseTrace(std::istream& in, const ParseOptions& options);
// NOT_FOUND when the file cannot be opened.
absl::StatusOr<Trace> LoadTrace(const std::string& path, const ParseOptions& options);

// Trace blocks -> whole cache blocks (see the header comment).
class BlockMapping {
 public:
  // trace_block_tokens in 1..kMaxTraceBlockTokens, cache_block_tokens > 0;
  // INVALID_ARGUMENT names the flag otherwise.
  static absl::StatusOr<BlockMapping> Create(int64_t trace_block_tokens, int64_t cache_block_tokens);

  int64_t trace_block_tokens() const { return trace_; }
  int64_t cache_block_tokens() const { return cache_; }
  // Full cache blocks of a prompt of `input_length` tokens.
  int64_t FullCacheBlocks(int64_t input_length) const { return input_length / cache_; }
  // Cache blocks reusable when the first `trace_blocks` trace blocks of a prompt of
  // `input_length` tokens hit: the whole cache blocks inside that prefix.
  int64_t CacheBlocksForTraceHit(int64_t trace_blocks, int64_t input_length) const;
  // The most cache blocks a cache manager may reuse: the last prompt token is always
  // recomputed (it produces the first output token), so floor((L - 1) / block).
  int64_t MaxReusableCacheBlocks(int64_t input_length) const { return (input_length - 1) / cache_; }

 private:
  BlockMapping(int64_t trace, int64_t cache) : trace_(trace), cache_(cache) {}
  int64_t trace_;
  int64_t cache_;
};

// Token `offset` (0-based, < trace_block_tokens) of the trace block named `hash_id`:
// a mix of both, reduced modulo `vocab_size` (> 0).
TokenId SyntheticToken(uint64_t hash_id, int64_t offset, uint32_t vocab_size);
// The request's `input_length` prompt tokens: token p = SyntheticToken(hash_ids[p / T], p % T).
// REQUIRES: request.input_length <= kMaxTraceInputTokens (ParseTrace guarantees it); one
// vector of that many tokens is allocated.
std::vector<TokenId> SynthesizeTokens(const TraceRequest& request, int64_t trace_block_tokens,
                                      uint32_t vocab_size);
// The cache's chained block hashes of the synthesized prompt (full cache blocks only).
std::vector<BlockHash> CacheBlockHashes(const TraceRequest& request, int64_t trace_block_tokens,
                                        uint32_t vocab_size, const BlockHasher& hasher);

struct TraceAnalysis {
  size_t requests = 0;
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;
  double duration_s = 0;             // last arrival - first arrival
  int64_t trace_blocks = 0;          // sum of hash_ids.size()
  int64_t unique_trace_blocks = 0;   // distinct prefixes (trie nodes)
  // Infinite cache, prefix-only, in trace blocks (every block counted, as Mooncake does).
  int64_t trace_hit_blocks = 0;
  double upper_bound_trace_blocks = 0;
  // The same in tokens at cache-block granularity: only tokens an earlier request had
  // count (a prompt's partial last trace block covers fewer than 512), rounded down to
  // whole cache blocks and capped like a cache manager caps its hits
  // (MaxReusableCacheBlocks): the bound a simulation's token hit rate is held to.
  int64_t hit_tokens = 0;
  double upper_bound = 0;            // hit_tokens / prompt_tokens
  // Prompts identical (input_length and hash_ids) to an earlier one.
  size_t duplicate_requests = 0;
  std::vector<bool> duplicate;       // [requests]
  std::vector<int64_t> request_hit_tokens;  // [requests]: infinite-cache hit of each request
  double dedup_upper_bound = 0;      // upper_bound over the requests that are not duplicates
};

TraceAnalysis AnalyzeTrace(std::span<const TraceRequest> requests, const BlockMapping& mapping);

}  // namespace kvpool::trace
