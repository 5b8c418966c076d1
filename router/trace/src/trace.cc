#include "kvpool/router/trace.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "kvpool/common/hash.h"
#include "nlohmann/json.hpp"

namespace kvpool::trace {
namespace {

using nlohmann::json;

absl::Status Bad(absl::string_view reason) { return absl::InvalidArgumentError(reason); }

absl::Status CheckTraceBlockTokens(int64_t trace_block_tokens) {
  if (trace_block_tokens <= 0 || trace_block_tokens > kMaxTraceBlockTokens) {
    return absl::InvalidArgumentError(absl::StrCat("--trace-block-tokens=", trace_block_tokens,
                                                   " must be in 1..", kMaxTraceBlockTokens,
                                                   " (Mooncake traces use 512)"));
  }
  return absl::OkStatus();
}

// A JSON number that is a whole, non-negative value that fits int64 (3 and 3.0 both do).
bool AsCount(const json& v, int64_t* out) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    *out = v.get<int64_t>();
    return *out >= 0;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d < 0 || d != std::floor(d) || d > 9e18) return false;
    *out = static_cast<int64_t>(d);
    return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<TraceRequest> ParseTraceLine(absl::string_view line, int64_t line_no,
                                            int64_t trace_block_tokens) {
  if (absl::Status s = CheckTraceBlockTokens(trace_block_tokens); !s.ok()) return s;
  json j;
  try {
    j = json::parse(line.begin(), line.end());
  } catch (const json::exception& e) {  // parse_error, and out_of_range for 1e999
    return Bad(absl::StrCat("not valid JSON (", e.what(), ")"));
  }
  if (!j.is_object()) return Bad("not a JSON object; each line must be one request {\"timestamp\": ...}");
  TraceRequest r;
  r.line = line_no;
  auto ts = j.find("timestamp");
  if (ts == j.end()) return Bad("missing field timestamp (arrival in ms)");
  if (!ts->is_number() || !std::isfinite(ts->get<double>()) || ts->get<double>() < 0 ||
      ts->get<double>() > kMaxTraceTimestampMs) {
    return Bad(absl::StrCat("timestamp=", ts->dump(), " must be a number of ms in 0..", kMaxTraceTimestampMs));
  }
  r.timestamp_ms = ts->get<double>();
  auto in = j.find("input_length");
  if (in == j.end()) return Bad("missing field input_length (prompt tokens)");
  if (!AsCount(*in, &r.input_length) || r.input_length < 1) {
    return Bad(absl::StrCat("input_length=", in->dump(), " must be an integer >= 1"));
  }
  if (r.input_length > kMaxTraceInputTokens) {
    return Bad(absl::StrCat("input_length=", r.input_length, " is above the router's limit of ",
                            kMaxTraceInputTokens, " prompt tokens per request; split or drop this request"));
  }
  auto out = j.find("output_length");
  if (out == j.end()) return Bad("missing field output_length (generated tokens)");
  if (!AsCount(*out, &r.output_length) || r.output_length > kMaxTraceOutputTokens) {
    return Bad(absl::StrCat("output_length=", out->dump(), " must be an integer in 0..", kMaxTraceOutputTokens));
  }
  auto ids = j.find("hash_ids");
  if (ids == j.end()) return Bad("missing field hash_ids (one id per trace block)");
  if (!ids->is_array()) return Bad("hash_ids must be an array of non-negative integers");
  r.hash_ids.reserve(ids->size());
  for (size_t i = 0; i < ids->size(); ++i) {
    const json& id = (*ids)[i];
    int64_t v = 0;
    if (id.is_number_unsigned()) {  // the whole 64-bit range (ids may be hashes)
      r.hash_ids.push_back(id.get<uint64_t>());
    } else if (AsCount(id, &v)) {
      r.hash_ids.push_back(static_cast<uint64_t>(v));
    } else {
      return Bad(absl::StrCat("hash_ids[", i, "]=", id.dump(), " must be an integer in 0..2^64-1"));
    }
  }
  // ceil without forming input_length + trace_block_tokens - 1 (no overflow for any sizes).
  const int64_t want = r.input_length / trace_block_tokens + (r.input_length % trace_block_tokens != 0 ? 1 : 0);
  if (static_cast<int64_t>(r.hash_ids.size()) != want) {
    return Bad(absl::StrCat("hash_ids has ", r.hash_ids.size(), " entries but input_length=", r.input_length,
                            " needs ceil(", r.input_length, "/", trace_block_tokens, ")=", want,
                            "; check --trace-block-tokens"));
  }
  return r;
}

absl::StatusOr<Trace> ParseTrace(std::istream& in, const ParseOptions& options) {
  if (absl::Status s = CheckTraceBlockTokens(options.trace_block_tokens); !s.ok()) return s;
  Trace t;
  t.trace_block_tokens = options.trace_block_tokens;
  std::string line;
  while (std::getline(in, line)) {
    ++t.lines;
    const bool last_without_newline = in.eof();
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    auto r = ParseTraceLine(line, t.lines, options.trace_block_tokens);
    if (!r.ok()) {
      std::string reason(r.status().message());
      if (last_without_newline) reason = absl::StrCat("truncated last line (no newline at end of file): ", reason);
      if (options.strict) {
        return absl::InvalidArgumentError(absl::StrCat("line ", t.lines, ": ", reason,
                                                       " (--strict; drop --strict to skip bad lines)"));
      }
      t.issues.push_back({t.lines, std::move(reason)});
      continue;
    }
    t.requests.push_back(*std::move(r));
    if (options.limit != 0 && t.requests.size() >= options.limit) {
      in >> std::ws;  // blank lines after the last request are not "more"
      t.limited = in.peek() != std::char_traits<char>::eof();
      break;
    }
  }
  std::stable_sort(t.requests.begin(), t.requests.end(),
                   [](const TraceRequest& a, const TraceRequest& b) { return a.timestamp_ms < b.timestamp_ms; });
  return t;
}

absl::StatusOr<Trace> LoadTrace(const std::string& path, const ParseOptions& options) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("--trace=", path, ": cannot open the file"));
  return ParseTrace(f, options);
}

// ---- block mapping and tokens ---------------------------------------------------------

absl::StatusOr<BlockMapping> BlockMapping::Create(int64_t trace_block_tokens, int64_t cache_block_tokens) {
  if (absl::Status s = CheckTraceBlockTokens(trace_block_tokens); !s.ok()) return s;
  if (cache_block_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("cache block_tokens=", cache_block_tokens, " must be > 0"));
  }
  return BlockMapping(trace_block_tokens, cache_block_tokens);
}

int64_t BlockMapping::CacheBlocksForTraceHit(int64_t trace_blocks, int64_t input_length) const {
  return std::min(trace_blocks * trace_, input_length) / cache_;
}

TokenId SyntheticToken(uint64_t hash_id, int64_t offset, uint32_t vocab_size) {
  const uint64_t x = Mix64(hash_id * 0x100000001B3ull ^ Mix64(static_cast<uint64_t>(offset)));
  return static_cast<TokenId>(x % vocab_size);
}

std::vector<TokenId> SynthesizeTokens(const TraceRequest& request, int64_t trace_block_tokens,
                                      uint32_t vocab_size) {
  std::vector<TokenId> tokens(static_cast<size_t>(request.input_length));
  for (int64_t p = 0; p < request.input_length; ++p) {
    const size_t b = static_cast<size_t>(p / trace_block_tokens);
    const uint64_t id = b < request.hash_ids.size() ? request.hash_ids[b] : ~uint64_t{0} - b;
    tokens[static_cast<size_t>(p)] = SyntheticToken(id, p % trace_block_tokens, vocab_size);
  }
  return tokens;
}

std::vector<BlockHash> CacheBlockHashes(const TraceRequest& request, int64_t trace_block_tokens,
                                        uint32_t vocab_size, const BlockHasher& hasher) {
  const std::vector<TokenId> tokens = SynthesizeTokens(request, trace_block_tokens, vocab_size);
  return hasher.HashPrefix(tokens);
}

// ---- analysis -------------------------------------------------------------------------

TraceAnalysis AnalyzeTrace(std::span<const TraceRequest> requests, const BlockMapping& mapping) {
  TraceAnalysis a;
  a.requests = requests.size();
  a.duplicate.assign(requests.size(), false);
  a.request_hit_tokens.assign(requests.size(), 0);
  if (!requests.empty()) {
    a.duration_s = (requests.back().timestamp_ms - requests.front().timestamp_ms) / 1000.0;
  }
  // A prefix trie keyed by (parent node, hash id): node ids are dense, 0 is the root.
  // Mooncake's ids already name prefixes, but the trie keeps "prefix-only" exact for any
  // trace (the same id after a different prefix is a different block).
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, uint64_t> trie;
  // covered[node - 1]: the most tokens of that trace block any request so far had (the
  // last block of a prompt is partial; a later prompt reusing its id past that point
  // would find those tokens never computed).
  std::vector<int64_t> covered;
  const int64_t T = mapping.trace_block_tokens();
  absl::flat_hash_set<std::pair<int64_t, uint64_t>> prompts;  // (input_length, leaf node)
  int64_t dedup_hit = 0, dedup_tokens = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const TraceRequest& r = requests[i];
    a.prompt_tokens += r.input_length;
    a.output_tokens += r.output_length;
    a.trace_blocks += static_cast<int64_t>(r.hash_ids.size());
    uint64_t node = 0;
    int64_t hit = 0;          // trace blocks
    int64_t hit_prefix = 0;   // tokens of the prompt computed before (see `covered`)
    bool missed = false, stopped = false;
    for (size_t b = 0; b < r.hash_ids.size(); ++b) {
      const int64_t len = std::min(T, r.input_length - static_cast<int64_t>(b) * T);  // this block's tokens
      auto [it, inserted] = trie.try_emplace(std::make_pair(node, r.hash_ids[b]), trie.size() + 1);
      if (inserted) {
        missed = true;
        covered.push_back(0);
      }
      int64_t& cov = covered[it->second - 1];
      if (!missed) ++hit;
      if (!missed && !stopped) {
        hit_prefix += std::min(cov, len);
        stopped = cov < len;  // tokens past a partial block were never computed
      } else {
        stopped = true;
      }
      cov = std::max(cov, len);
      node = it->second;
    }
    a.trace_hit_blocks += hit;
    const int64_t cache_hit = std::min(hit_prefix / mapping.cache_block_tokens(),
                                       mapping.MaxReusableCacheBlocks(r.input_length));
    const int64_t hit_tokens = cache_hit * mapping.cache_block_tokens();
    a.request_hit_tokens[i] = hit_tokens;
    a.hit_tokens += hit_tokens;
    if (!prompts.insert({r.input_length, node}).second) {
      a.duplicate[i] = true;
      ++a.duplicate_requests;
    } else {
      dedup_hit += hit_tokens;
      dedup_tokens += r.input_length;
    }
  }
  a.unique_trace_blocks = static_cast<int64_t>(trie.size());
  if (a.trace_blocks > 0) a.upper_bound_trace_blocks = static_cast<double>(a.trace_hit_blocks) / a.trace_blocks;
  if (a.prompt_tokens > 0) a.upper_bound = static_cast<double>(a.hit_tokens) / a.prompt_tokens;
  if (dedup_tokens > 0) a.dedup_upper_bound = static_cast<double>(dedup_hit) / dedup_tokens;
  return a;
}

}  // namespace kvpool::trace
