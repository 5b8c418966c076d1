// Model specs: the attention layout of a model, enough to size its KV cache, cost its
// prefill and (for the tiny presets) run it for real.
//
// A spec is a list of layers, each GQA, MLA or KDA, with shared per-kind dimensions:
//
//   llama-3.3-70b  80 x GQA (8 KV heads x 128, bf16)           = 327,680 B/token
//   deepseek-v3    61 x MLA (latent 512 + rope 64, bf16 | fp8)  = 70,272 | 35,136 B/token
//   kimi-k3        24 x MLA + 69 x KDA (96 heads of 128x128)    = 27,648 B/token
//                                                                + 3 MiB/layer fixed state
//   tiny-gqa / tiny-mla / tiny-hybrid: the same structures with small dims, for tests.
//
// Per-token state (GQA K/V, MLA latent+rope) is paged in blocks of `block_tokens`;
// fixed state (KDA, d_k x d_v per head) is per request and checkpointed every
// `checkpoint_tokens`.
//
// Specs also load from a JSON file (see LoadModelSpecFile for the fields).
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvpool {

enum class AttentionKind : uint8_t { kGqa, kMla, kKda };
enum class StateKind : uint8_t { kAttnKv, kLinearState };
enum class DType : uint8_t { kFp32, kBf16, kFp16, kFp8 };

absl::string_view AttentionKindName(AttentionKind kind);
absl::string_view StateKindName(StateKind kind);  // "attn_kv", "linear_state"
absl::string_view DTypeName(DType dtype);         // "fp32", "bf16", "fp16", "fp8"
size_t DTypeBytes(DType dtype);
// Accepts the names above (and "float32", "bfloat16", "float16", "fp8_e4m3").
absl::StatusOr<DType> ParseDType(absl::string_view name);

// Bounds Validate (and the JSON loader) enforce, so that every byte count derived
// from a spec fits in int64 (see Validate).
inline constexpr int64_t kMaxSpecLayers = 4096;
inline constexpr int64_t kMaxSpecHeads = 8192;        // per kind
inline constexpr int64_t kMaxSpecDim = 65536;         // hidden_size and per-head dims
inline constexpr int64_t kMaxSpecBlockTokens = 65536;
inline constexpr int64_t kMaxSpecVocab = int64_t{1} << 24;

struct GqaDims {
  int num_q_heads = 0;   // query heads, a multiple of num_kv_heads
  int num_kv_heads = 0;  // K/V heads
  int head_dim = 0;      // 64 or 128 for the kernels
};

struct MlaDims {
  int num_heads = 0;       // query heads (all share the one latent entry per token)
  int kv_lora_rank = 512;  // latent dim (absorbed value dim)
  int rope_dim = 64;       // decoupled rope key dim
  int qk_nope_dim = 128;   // per-head non-rope query/key dim before absorption
  int v_head_dim = 128;    // per-head value dim (materialized mode)
  int EntryDim() const { return kv_lora_rank + rope_dim; }  // 576 for DeepSeek-V3
};

struct KdaDims {
  int num_heads = 0;
  int head_k_dim = 0;  // d_k
  int head_v_dim = 0;  // d_v
};

struct ModelSpec {
  std::string name;
  // Parameters touched per token (active parameters for MoE): prefill FLOPs = 2*P*L.
  double active_params = 0;
  int hidden_size = 0;
  int vocab_size = 0;
  std::vector<AttentionKind> layers;  // in model order
  GqaDims gqa;
  MlaDims mla;
  KdaDims kda;
  DType kv_dtype = DType::kBf16;     // per-token cache dtype
  DType state_dtype = DType::kBf16;  // dtype of stored KDA checkpoints / state
  int block_tokens = 16;             // tokens per KV block (page size)
  int checkpoint_tokens = 0;         // KDA checkpoint interval; 0 when no KDA layers
  // True for specs small enough to run for real (tiny-*); real-shape presets run in
  // accounting mode (bytes and time from the cost model, no math).
  bool computable = false;

  int NumLayers(AttentionKind kind) const;
  int NumLayers() const { return static_cast<int>(layers.size()); }
  bool HasKind(AttentionKind kind) const { return NumLayers(kind) > 0; }
  bool IsHybrid() const { return HasKind(AttentionKind::kKda); }

  // Bytes one token adds to the cache in one layer of `kind` (0 for KDA).
  int64_t KvBytesPerTokenPerLayer(AttentionKind kind) const;
  // Bytes one token adds across all layers.
  int64_t KvBytesPerToken() const;
  // Bytes of fixed (KDA) state in one KDA layer, and across all KDA layers.
  int64_t StateBytesPerLayer() const;
  int64_t FixedStateBytes() const;
  // Bytes of one KV block across all paged layers.
  int64_t BlockBytes() const { return KvBytesPerToken() * block_tokens; }
  // Context at which the fixed state equals the per-token cache; 0 when not hybrid.
  double CrossoverTokens() const;

  // Checks internal consistency and the kMaxSpec* bounds; errors name the field.
  absl::Status Validate() const;
};

// Names of the built-in presets.
std::vector<std::string> PresetNames();
// A built-in preset. NOT_FOUND lists the known names.
absl::StatusOr<ModelSpec> GetPreset(absl::string_view name);
// Loads a spec from a JSON file:
//   {"name": "...", "active_params": 7e9, "hidden_size": 4096, "vocab_size": 32000,
//    "layers": ["gqa", ...] | {"pattern": ["gqa"], "repeat": 32},
//    "gqa": {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128},
//    "mla": {...}, "kda": {...}, "kv_dtype": "bf16", "state_dtype": "bf16",
//    "block_tokens": 16, "checkpoint_tokens": 0}
// Integer fields must hold integral values that fit (16.9 or 4294967552 are errors,
// not 16 or 256); every error is INVALID_ARGUMENT naming the field.
absl::StatusOr<ModelSpec> LoadModelSpecFile(const std::string& path);
// A preset name, or a path to a JSON spec (anything containing '/' or ending in .json).
absl::StatusOr<ModelSpec> ResolveModelSpec(absl::string_view name_or_path);

}  // namespace kvpool
