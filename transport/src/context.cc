// Context, RemoteArena wire form, Arena spans, ucs_status_t conversion.
#include <sys/mman.h>
#include <sys/shm.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "internal.h"

namespace kvpool::transport {

absl::Status FromUcs(ucs_status_t status, absl::string_view what) {
  if (status == UCS_OK || status == UCS_INPROGRESS) return absl::OkStatus();
  std::string msg = absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(msg);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
    case UCS_ERR_MESSAGE_TRUNCATED:
      return absl::InvalidArgumentError(msg);
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_NO_DEVICE:
      return absl::FailedPreconditionError(
          absl::StrCat(msg, " (check UCX_TLS / UCX_NET_DEVICES on both peers)"));
    case UCS_ERR_CANCELED:
      return absl::CancelledError(msg);
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT:
      return absl::DeadlineExceededError(msg);
    default:
      // Connection reset, peer failure, I/O errors: the peer is gone; reconnect.
      return absl::UnavailableError(msg);
  }
}

absl::string_view ProtocolName(Protocol p) {
  switch (p) {
    case Protocol::kAuto: return "auto";
    case Protocol::kRma: return "rma";
    case Protocol::kActiveMessage: return "am";
  }
  return "?";
}

namespace {
// Whether the transport list (UCX_TLS, or a "TLS" override) may enable tcp: UCX warns
// about a transport key that no enabled transport takes.
bool TlsMayIncludeTcp(const ContextOptions& options) {
  const char* env = std::getenv("UCX_TLS");
  std::string tls = env != nullptr ? env : "";
  for (const auto& [k, v] : options.ucx_config) {
    if (k == "TLS") tls = v;
  }
  if (tls.empty()) return true;
  bool named = false;
  const bool exclude = tls[0] == '^';
  for (absl::string_view t : absl::StrSplit(absl::string_view(tls).substr(exclude ? 1 : 0), ',')) {
    if (t == "tcp" || t == "all") named = true;
  }
  return exclude ? !named : named;
}
}  // namespace

absl::StatusOr<std::shared_ptr<Context>> Context::Create(ContextOptions options) {
  ucp_config_t* config = nullptr;
  RETURN_IF_ERROR(FromUcs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read"));
  absl::Status st;
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    const std::string us = absl::StrCat(absl::ToInt64Microseconds(options.keepalive_interval), "us");
    st.Update(FromUcs(ucp_config_modify(config, "KEEPALIVE_INTERVAL", us.c_str()),
                      "UCX KEEPALIVE_INTERVAL"));
  }
  // UCX 1.13 keeps keys that are not UCP's and applies them to each transport's
  // configuration by the field's own name, without the transport's prefix
  // ("TCP_RX_SEG_SIZE" is reported as invalid and ignored); tcp is the only transport
  // with a field of this name.
  if (std::getenv("UCX_TCP_RX_SEG_SIZE") == nullptr && !options.tcp_rx_seg_size.empty() &&
      TlsMayIncludeTcp(options)) {
    st.Update(FromUcs(ucp_config_modify(config, "RX_SEG_SIZE", options.tcp_rx_seg_size.c_str()),
                      absl::StrCat("UCX TCP_RX_SEG_SIZE=", options.tcp_rx_seg_size)));
  }
  for (const auto& [k, v] : options.ucx_config) {
    st.Update(FromUcs(ucp_config_modify(config, k.c_str(), v.c_str()),
                      absl::StrCat("ucx_config ", k, "=", v)));
  }
  if (!st.ok()) {
    ucp_config_release(config);
    return st;
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;
  params.name = "kvpool";
  ucp_context_h ctx = nullptr;
  ucs_status_t s = ucp_init(&params, config, &ctx);
  ucp_config_release(config);
  RETURN_IF_ERROR(FromUcs(s, "ucp_init (check UCX_TLS / UCX_NET_DEVICES)"));
  auto context = std::shared_ptr<Context>(new Context(ctx));
  // Transports whose endpoints support UCP_ERR_HANDLING_MODE_PEER in UCX 1.13.
  const std::string info = context->Describe();
  for (absl::string_view tl : {"tcp/", "rc_verbs/", "rc_mlx5/", "dc_mlx5/", "ud_verbs/",
                               "ud_mlx5/"}) {
    if (absl::StrContains(info, absl::StrCat("-- ", tl))) context->peer_failure_capable_ = true;
  }
  for (absl::string_view tl : {"sysv/", "posix/", "cma/", "knem/", "xpmem/"}) {
    if (absl::StrContains(info, absl::StrCat("-- ", tl))) context->shared_memory_capable_ = true;
  }
  return context;
}

Context::~Context() { ucp_cleanup(static_cast<ucp_context_h>(handle_)); }

std::string Context::Describe() const {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return "";
  ucp_context_print_info(static_cast<ucp_context_h>(handle_), f);
  std::fclose(f);
  std::string out(buf, len);
  std::free(buf);
  return out;
}

// ---- RemoteArena wire form: "KVA1" u32 id, u64 base, u64 size, u64 page, u32 rkey_len,
// rkey bytes; all little-endian (x86 / arm64 hosts).
namespace {
constexpr char kMagic[4] = {'K', 'V', 'A', '1'};
// Version 2 appends the same-host export: i64 shm_id, u32 owner_pid, u16 len + shm_host.
constexpr char kMagic2[4] = {'K', 'V', 'A', '2'};
template <typename T>
void Put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(v));
}
template <typename T>
bool Take(absl::string_view& s, T* v) {
  if (s.size() < sizeof(T)) return false;
  std::memcpy(v, s.data(), sizeof(T));
  s.remove_prefix(sizeof(T));
  return true;
}
}  // namespace

std::string RemoteArena::Serialize() const {
  const bool shm = shm_id >= 0;
  std::string s(shm ? kMagic2 : kMagic, 4);
  Put(s, arena_id);
  Put(s, base);
  Put(s, size);
  Put(s, page_bytes);
  Put(s, static_cast<uint32_t>(rkey.size()));
  s += rkey;
  if (shm) {
    Put(s, shm_id);
    Put(s, owner_pid);
    const std::string host = shm_host.substr(0, UINT16_MAX);
    Put(s, static_cast<uint16_t>(host.size()));
    s += host;
  }
  return s;
}

absl::StatusOr<RemoteArena> RemoteArena::Parse(absl::string_view bytes) {
  const bool v2 = bytes.size() >= 4 && std::memcmp(bytes.data(), kMagic2, 4) == 0;
  if (bytes.size() < 4 || (!v2 && std::memcmp(bytes.data(), kMagic, 4) != 0)) {
    return absl::InvalidArgumentError(
        "arena descriptor: bad magic; pass the bytes of RemoteArena::Serialize() unchanged");
  }
  bytes.remove_prefix(4);
  RemoteArena r;
  uint32_t rkey_len = 0;
  if (!Take(bytes, &r.arena_id) || !Take(bytes, &r.base) || !Take(bytes, &r.size) ||
      !Take(bytes, &r.page_bytes) || !Take(bytes, &rkey_len) || bytes.size() < rkey_len) {
    return absl::InvalidArgumentError("arena descriptor: truncated or trailing bytes");
  }
  absl::string_view rkey = bytes.substr(0, rkey_len);
  bytes.remove_prefix(rkey_len);
  if (v2) {
    uint16_t host_len = 0;
    if (!Take(bytes, &r.shm_id) || !Take(bytes, &r.owner_pid) || !Take(bytes, &host_len) ||
        bytes.size() < host_len) {
      return absl::InvalidArgumentError("arena descriptor: truncated or trailing bytes");
    }
    r.shm_host = std::string(bytes.substr(0, host_len));
    bytes.remove_prefix(host_len);
  }
  if (!bytes.empty()) return absl::InvalidArgumentError("arena descriptor: truncated or trailing bytes");
  if (r.page_bytes == 0 || r.size == 0 || r.size % r.page_bytes != 0 || rkey_len == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "arena descriptor: size=", r.size, " page_bytes=", r.page_bytes, " rkey=", rkey_len,
        " bytes; size must be a positive multiple of page_bytes and the rkey non-empty"));
  }
  r.rkey = std::string(rkey);
  return r;
}

// ---- Arena
Arena::~Arena() {
  if (memh_ != nullptr) {
    ucp_mem_unmap(static_cast<ucp_context_h>(context_->raw()), static_cast<ucp_mem_h>(memh_));
  }
  if (shm_id_ >= 0) {
    shmdt(base_);  // the segment goes with its last mapping (marked IPC_RMID at creation)
  } else if (owns_memory_) {
    munmap(base_, size_);
  }
}

absl::StatusOr<std::vector<std::span<std::byte>>> Arena::Spans(const PageRun& run) const {
  if (run.arena_id != id_) {
    return absl::InvalidArgumentError(
        absl::StrCat("page run names arena ", run.arena_id, " but this is arena ", id_));
  }
  const uint64_t full = run.pages.size() * page_bytes_;
  const uint64_t bytes = run.bytes == 0 ? full : run.bytes;
  if (bytes > full || (bytes > 0 && full - bytes >= page_bytes_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page run: bytes=", run.bytes, " does not fit ", run.pages.size(), " pages of ",
        page_bytes_, " (the last page must hold at least one byte)"));
  }
  std::vector<std::span<std::byte>> out;
  out.reserve(run.pages.size());
  uint64_t left = bytes;
  for (uint64_t p : run.pages) {
    if (p >= num_pages()) {
      return absl::InvalidArgumentError(absl::StrCat("page ", p, " out of range: arena ", id_,
                                                     " has ", num_pages(), " pages"));
    }
    const uint64_t n = std::min(left, page_bytes_);
    out.emplace_back(base_ + p * page_bytes_, n);
    left -= n;
  }
  return out;
}

}  // namespace kvpool::transport
