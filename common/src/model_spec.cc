#include "kvpool/common/model_spec.h"

#include <cmath>
#include <exception>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvpool/common/status.h"
#include "nlohmann/json.hpp"

namespace kvpool {

absl::string_view AttentionKindName(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::kGqa: return "gqa";
    case AttentionKind::kMla: return "mla";
    case AttentionKind::kKda: return "kda";
  }
  return "?";
}

absl::string_view StateKindName(StateKind kind) {
  return kind == StateKind::kAttnKv ? "attn_kv" : "linear_state";
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFp32: return "fp32";
    case DType::kBf16: return "bf16";
    case DType::kFp16: return "fp16";
    case DType::kFp8: return "fp8";
  }
  return "?";
}

size_t DTypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kFp32: return 4;
    case DType::kBf16: return 2;
    case DType::kFp16: return 2;
    case DType::kFp8: return 1;
  }
  return 0;
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "fp32" || n == "float32" || n == "f32") return DType::kFp32;
  if (n == "bf16" || n == "bfloat16") return DType::kBf16;
  if (n == "fp16" || n == "float16" || n == "f16" || n == "half") return DType::kFp16;
  if (n == "fp8" || n == "fp8_e4m3" || n == "float8") return DType::kFp8;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "'; use one of fp32, bf16, fp16, fp8"));
}

int ModelSpec::NumLayers(AttentionKind kind) const {
  int n = 0;
  for (AttentionKind k : layers) n += (k == kind);
  return n;
}

int64_t ModelSpec::KvBytesPerTokenPerLayer(AttentionKind kind) const {
  const int64_t e = static_cast<int64_t>(DTypeBytes(kv_dtype));
  switch (kind) {
    case AttentionKind::kGqa: return 2 * int64_t{gqa.num_kv_heads} * gqa.head_dim * e;  // K and V
    case AttentionKind::kMla: return int64_t{mla.EntryDim()} * e;  // one shared latent+rope entry
    case AttentionKind::kKda: return 0;  // fixed-size state, not per token
  }
  return 0;
}

int64_t ModelSpec::KvBytesPerToken() const {
  int64_t total = 0;
  for (AttentionKind k : layers) total += KvBytesPerTokenPerLayer(k);
  return total;
}

int64_t ModelSpec::StateBytesPerLayer() const {
  if (!HasKind(AttentionKind::kKda)) return 0;
  return int64_t{kda.num_heads} * kda.head_k_dim * kda.head_v_dim *
         static_cast<int64_t>(DTypeBytes(state_dtype));
}

int64_t ModelSpec::FixedStateBytes() const {
  return StateBytesPerLayer() * NumLayers(AttentionKind::kKda);
}

double ModelSpec::CrossoverTokens() const {
  const int64_t per_token = KvBytesPerToken();
  if (!IsHybrid() || per_token == 0) return 0;
  return static_cast<double>(FixedStateBytes()) / static_cast<double>(per_token);
}

absl::Status ModelSpec::Validate() const {
  auto bad = [this](absl::string_view field, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("model '", name, "': ", field, " ", why));
  };
  if (name.empty()) return absl::InvalidArgumentError("model spec has no name; set \"name\"");
  if (layers.empty()) return bad("layers", "is empty; list at least one layer");
  if (!(active_params > 0)) return bad("active_params", "must be > 0 (parameters per token)");
  if (!std::isfinite(active_params)) return bad("active_params", "must be finite");
  // Caps keep every size derived from a spec inside int64: BlockBytes is at most
  // 2^12 layers x 2 (K, V) x 2^13 heads x 2^16 dims x 4 B x 2^16 tokens = 2^60, and
  // FixedStateBytes 2^12 layers x 2^13 heads x 2^16 x 2^16 x 4 B = 2^59.
  auto in_range = [&bad](absl::string_view field, int64_t v, int64_t hi) {
    return v > 0 && v <= hi
               ? absl::OkStatus()
               : bad(field, absl::StrCat("=", v, " must be in [1, ", hi, "]"));
  };
  if (static_cast<int64_t>(layers.size()) > kMaxSpecLayers) {
    return bad("layers", absl::StrCat("has ", layers.size(), " entries; at most ",
                                      kMaxSpecLayers));
  }
  RETURN_IF_ERROR(in_range("hidden_size", hidden_size, kMaxSpecDim));
  RETURN_IF_ERROR(in_range("vocab_size", vocab_size, kMaxSpecVocab));
  RETURN_IF_ERROR(in_range("block_tokens", block_tokens, kMaxSpecBlockTokens));
  if (HasKind(AttentionKind::kGqa)) {
    if (gqa.num_q_heads <= 0 || gqa.num_kv_heads <= 0 || gqa.head_dim <= 0)
      return bad("gqa", "needs num_q_heads, num_kv_heads and head_dim > 0");
    RETURN_IF_ERROR(in_range("gqa.num_q_heads", gqa.num_q_heads, kMaxSpecHeads));
    RETURN_IF_ERROR(in_range("gqa.num_kv_heads", gqa.num_kv_heads, kMaxSpecHeads));
    RETURN_IF_ERROR(in_range("gqa.head_dim", gqa.head_dim, kMaxSpecDim));
    if (gqa.num_q_heads % gqa.num_kv_heads != 0)
      return bad("gqa.num_q_heads", "must be a multiple of gqa.num_kv_heads");
  }
  if (HasKind(AttentionKind::kMla)) {
    if (mla.num_heads <= 0 || mla.kv_lora_rank <= 0 || mla.rope_dim <= 0 ||
        mla.qk_nope_dim <= 0 || mla.v_head_dim <= 0)
      return bad("mla", "needs num_heads, kv_lora_rank, rope_dim, qk_nope_dim, v_head_dim > 0");
    RETURN_IF_ERROR(in_range("mla.num_heads", mla.num_heads, kMaxSpecHeads));
    RETURN_IF_ERROR(in_range("mla.kv_lora_rank", mla.kv_lora_rank, kMaxSpecDim));
    RETURN_IF_ERROR(in_range("mla.rope_dim", mla.rope_dim, kMaxSpecDim));
    RETURN_IF_ERROR(in_range("mla.qk_nope_dim", mla.qk_nope_dim, kMaxSpecDim));
    RETURN_IF_ERROR(in_range("mla.v_head_dim", mla.v_head_dim, kMaxSpecDim));
  }
  if (HasKind(AttentionKind::kKda)) {
    if (kda.num_heads <= 0 || kda.head_k_dim <= 0 || kda.head_v_dim <= 0)
      return bad("kda", "needs num_heads, head_k_dim and head_v_dim > 0");
    RETURN_IF_ERROR(in_range("kda.num_heads", kda.num_heads, kMaxSpecHeads));
    RETURN_IF_ERROR(in_range("kda.head_k_dim", kda.head_k_dim, kMaxSpecDim));
    RETURN_IF_ERROR(in_range("kda.head_v_dim", kda.head_v_dim, kMaxSpecDim));
    if (checkpoint_tokens <= 0 || checkpoint_tokens % block_tokens != 0)
      return bad("checkpoint_tokens",
                 absl::StrCat("=", checkpoint_tokens, " must be a positive multiple of block_tokens=",
                              block_tokens));
  }
  return absl::OkStatus();
}

namespace {

std::vector<AttentionKind> Repeat(std::vector<AttentionKind> pattern, int times) {
  std::vector<AttentionKind> out;
  for (int i = 0; i < times; ++i) out.insert(out.end(), pattern.begin(), pattern.end());
  return out;
}

ModelSpec Llama33_70b() {
  ModelSpec s;
  s.name = "llama-3.3-70b";
  s.active_params = 70.7e9;
  s.hidden_size = 8192;
  s.vocab_size = 128256;
  s.layers = Repeat({AttentionKind::kGqa}, 80);
  s.gqa = {.num_q_heads = 64, .num_kv_heads = 8, .head_dim = 128};
  s.kv_dtype = DType::kBf16;
  s.block_tokens = 16;
  return s;
}

ModelSpec DeepSeekV3() {
  ModelSpec s;
  s.name = "deepseek-v3";
  s.active_params = 37e9;  // 671B total, 37B activated per token
  s.hidden_size = 7168;
  s.vocab_size = 129280;
  s.layers = Repeat({AttentionKind::kMla}, 61);
  s.mla = {.num_heads = 128, .kv_lora_rank = 512, .rope_dim = 64, .qk_nope_dim = 128,
           .v_head_dim = 128};
  s.kv_dtype = DType::kBf16;
  s.block_tokens = 64;  // FlashMLA's page size
  return s;
}

// Kimi K3-style hybrid: 3 KDA layers then 1 MLA layer (1-based positions 4, 8, ..., 92),
// and a final MLA layer (93): 24 MLA + 69 KDA.
ModelSpec KimiK3() {
  ModelSpec s;
  s.name = "kimi-k3";
  s.active_params = 32e9;
  s.hidden_size = 7168;
  s.vocab_size = 163840;
  s.layers = Repeat({AttentionKind::kKda, AttentionKind::kKda, AttentionKind::kKda,
                     AttentionKind::kMla}, 23);
  s.layers.push_back(AttentionKind::kMla);
  s.mla = {.num_heads = 64, .kv_lora_rank = 512, .rope_dim = 64, .qk_nope_dim = 128,
           .v_head_dim = 128};
  s.kda = {.num_heads = 96, .head_k_dim = 128, .head_v_dim = 128};
  s.kv_dtype = DType::kBf16;
  s.state_dtype = DType::kBf16;
  s.block_tokens = 64;
  s.checkpoint_tokens = 6144;
  return s;
}

ModelSpec TinyGqa() {
  ModelSpec s;
  s.name = "tiny-gqa";
  s.hidden_size = 256;
  s.vocab_size = 512;
  s.layers = Repeat({AttentionKind::kGqa}, 4);
  s.gqa = {.num_q_heads = 4, .num_kv_heads = 2, .head_dim = 64};
  // Attention projections + MLP (4x) per layer, plus the LM head.
  s.active_params = 4.0 * (12.0 * 256 * 256) + 256.0 * 512;
  s.kv_dtype = DType::kBf16;
  s.block_tokens = 16;
  s.computable = true;
  return s;
}

ModelSpec TinyMla() {
  ModelSpec s;
  s.name = "tiny-mla";
  s.hidden_size = 256;
  s.vocab_size = 512;
  s.layers = Repeat({AttentionKind::kMla}, 2);
  s.mla = {.num_heads = 4, .kv_lora_rank = 512, .rope_dim = 64, .qk_nope_dim = 32,
           .v_head_dim = 32};
  s.active_params = 2.0 * (12.0 * 256 * 256) + 256.0 * 512;
  s.kv_dtype = DType::kBf16;
  s.block_tokens = 64;
  s.computable = true;
  return s;
}

ModelSpec TinyHybrid() {
  ModelSpec s;
  s.name = "tiny-hybrid";
  s.hidden_size = 256;
  s.vocab_size = 512;
  s.layers = {AttentionKind::kKda, AttentionKind::kKda, AttentionKind::kKda,
              AttentionKind::kMla};
  s.mla = {.num_heads = 4, .kv_lora_rank = 512, .rope_dim = 64, .qk_nope_dim = 32,
           .v_head_dim = 32};
  s.kda = {.num_heads = 2, .head_k_dim = 64, .head_v_dim = 64};
  s.active_params = 4.0 * (12.0 * 256 * 256) + 256.0 * 512;
  s.kv_dtype = DType::kBf16;
  s.state_dtype = DType::kFp32;  // checkpoints restore bit-exactly
  s.block_tokens = 64;
  s.checkpoint_tokens = 256;
  s.computable = true;
  return s;
}

struct Preset {
  absl::string_view name;
  ModelSpec (*make)();
};
constexpr Preset kPresets[] = {
    {"llama-3.3-70b", Llama33_70b}, {"deepseek-v3", DeepSeekV3}, {"kimi-k3", KimiK3},
    {"tiny-gqa", TinyGqa},          {"tiny-mla", TinyMla},       {"tiny-hybrid", TinyHybrid},
};

absl::StatusOr<AttentionKind> ParseKind(absl::string_view s) {
  const std::string n = absl::AsciiStrToLower(s);
  if (n == "gqa" || n == "mha") return AttentionKind::kGqa;
  if (n == "mla") return AttentionKind::kMla;
  if (n == "kda" || n == "linear") return AttentionKind::kKda;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown layer kind '", s, "'; use gqa, mla or kda"));
}

template <typename T>
void GetIf(const nlohmann::json& j, const char* key, T& out) {
  if (j.contains(key)) out = j.at(key).get<T>();
}

// An integer field: a JSON integer, or a number with an integral value (16.0), within
// [lo, hi]. get<int>() would wrap 4294967552 to 256 and truncate 16.9 to 16.
absl::Status GetIntIf(const nlohmann::json& j, const char* key, absl::string_view field,
                      int64_t lo, int64_t hi, int64_t& out) {
  if (!j.contains(key)) return absl::OkStatus();
  const nlohmann::json& v = j.at(key);
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("model spec field ", field, "=", v.dump(), " ", why));
  };
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi)) return bad(absl::StrCat("is out of range [", lo, ", ", hi, "]"));
    out = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    out = v.get<int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    // Range first: the cast below is only defined for values that fit.
    if (!(d >= static_cast<double>(lo) && d <= static_cast<double>(hi))) {
      return bad(absl::StrCat("is out of range [", lo, ", ", hi, "]"));
    }
    if (d != std::floor(d)) return bad("is not an integer");
    out = static_cast<int64_t>(d);
  } else {
    return bad("is not a number");
  }
  if (out < lo || out > hi) return bad(absl::StrCat("is out of range [", lo, ", ", hi, "]"));
  return absl::OkStatus();
}

absl::Status GetIntIf(const nlohmann::json& j, const char* key, absl::string_view field,
                      int& out) {
  int64_t v = out;
  RETURN_IF_ERROR(GetIntIf(j, key, field, std::numeric_limits<int>::min(),
                           std::numeric_limits<int>::max(), v));
  out = static_cast<int>(v);
  return absl::OkStatus();
}

absl::StatusOr<ModelSpec> ParseSpecJson(const nlohmann::json& j) {
  ModelSpec s;
  GetIf(j, "name", s.name);
  GetIf(j, "active_params", s.active_params);
  RETURN_IF_ERROR(GetIntIf(j, "hidden_size", "hidden_size", s.hidden_size));
  RETURN_IF_ERROR(GetIntIf(j, "vocab_size", "vocab_size", s.vocab_size));
  RETURN_IF_ERROR(GetIntIf(j, "block_tokens", "block_tokens", s.block_tokens));
  RETURN_IF_ERROR(GetIntIf(j, "checkpoint_tokens", "checkpoint_tokens", s.checkpoint_tokens));
  GetIf(j, "computable", s.computable);
  if (j.contains("kv_dtype")) {
    ASSIGN_OR_RETURN(s.kv_dtype, ParseDType(j.at("kv_dtype").get<std::string>()));
  }
  if (j.contains("state_dtype")) {
    ASSIGN_OR_RETURN(s.state_dtype, ParseDType(j.at("state_dtype").get<std::string>()));
  }
  if (!j.contains("layers")) {
    return absl::InvalidArgumentError("model spec has no \"layers\"; list the layer kinds");
  }
  const auto& layers = j.at("layers");
  std::vector<std::string> pattern;
  int64_t repeat = 1;
  if (layers.is_array()) {
    pattern = layers.get<std::vector<std::string>>();
  } else {
    pattern = layers.at("pattern").get<std::vector<std::string>>();
    RETURN_IF_ERROR(GetIntIf(layers, "repeat", "layers.repeat", 1, kMaxSpecLayers, repeat));
  }
  // Checked before building the list: a huge repeat would otherwise allocate first.
  if (static_cast<int64_t>(pattern.size()) * repeat > kMaxSpecLayers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model spec layers: ", pattern.size(), " kinds x repeat ", repeat, " is more than ",
        kMaxSpecLayers, " layers"));
  }
  for (int r = 0; r < repeat; ++r) {
    for (const auto& k : pattern) {
      ASSIGN_OR_RETURN(AttentionKind kind, ParseKind(k));
      s.layers.push_back(kind);
    }
  }
  if (j.contains("gqa")) {
    const auto& g = j.at("gqa");
    RETURN_IF_ERROR(GetIntIf(g, "num_q_heads", "gqa.num_q_heads", s.gqa.num_q_heads));
    RETURN_IF_ERROR(GetIntIf(g, "num_kv_heads", "gqa.num_kv_heads", s.gqa.num_kv_heads));
    RETURN_IF_ERROR(GetIntIf(g, "head_dim", "gqa.head_dim", s.gqa.head_dim));
  }
  if (j.contains("mla")) {
    const auto& m = j.at("mla");
    RETURN_IF_ERROR(GetIntIf(m, "num_heads", "mla.num_heads", s.mla.num_heads));
    RETURN_IF_ERROR(GetIntIf(m, "kv_lora_rank", "mla.kv_lora_rank", s.mla.kv_lora_rank));
    RETURN_IF_ERROR(GetIntIf(m, "rope_dim", "mla.rope_dim", s.mla.rope_dim));
    RETURN_IF_ERROR(GetIntIf(m, "qk_nope_dim", "mla.qk_nope_dim", s.mla.qk_nope_dim));
    RETURN_IF_ERROR(GetIntIf(m, "v_head_dim", "mla.v_head_dim", s.mla.v_head_dim));
  }
  if (j.contains("kda")) {
    const auto& k = j.at("kda");
    RETURN_IF_ERROR(GetIntIf(k, "num_heads", "kda.num_heads", s.kda.num_heads));
    RETURN_IF_ERROR(GetIntIf(k, "head_k_dim", "kda.head_k_dim", s.kda.head_k_dim));
    RETURN_IF_ERROR(GetIntIf(k, "head_v_dim", "kda.head_v_dim", s.kda.head_v_dim));
  }
  return s;
}

}  // namespace

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.emplace_back(p.name);
  return names;
}

absl::StatusOr<ModelSpec> GetPreset(absl::string_view name) {
  for (const auto& p : kPresets) {
    if (p.name == name) return p.make();
  }
  return absl::NotFoundError(absl::StrCat("unknown model '", name, "'; known presets: ",
                                          absl::StrJoin(PresetNames(), ", "),
                                          " (or pass a path to a JSON spec)"));
}

absl::StatusOr<ModelSpec> LoadModelSpecFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot open model spec file '", path, "'"));
  }
  std::stringstream buf;
  buf << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(buf.str());
    ASSIGN_OR_RETURN(ModelSpec spec, ParseSpecJson(j));
    RETURN_IF_ERROR(spec.Validate());
    return spec;
  } catch (const std::exception& e) {  // nlohmann's errors, and bad_alloc on huge input
    return absl::InvalidArgumentError(
        absl::StrCat("model spec file '", path, "' is not valid: ", e.what()));
  }
}

absl::StatusOr<ModelSpec> ResolveModelSpec(absl::string_view name_or_path) {
  if (name_or_path.find('/') != absl::string_view::npos ||
      absl::EndsWith(name_or_path, ".json")) {
    return LoadModelSpecFile(std::string(name_or_path));
  }
  return GetPreset(name_or_path);
}

}  // namespace kvpool
