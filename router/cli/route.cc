// kvctl route / kvctl status: ask a running kvpool-router for a decision, or for its
// instances, load and index size.
#include <iomanip>
#include <sstream>

#include <CLI/CLI.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvctl.h"
#include "kvpool/common/hash.h"
#include "kvpool/common/host_port.h"
#include "kvpool/router/router_client.h"
#include "nlohmann/json.hpp"

namespace kvpool::kvctl {
namespace {

using nlohmann::ordered_json;

absl::string_view TierName(v1::Tier t) {
  switch (t) {
    case v1::TIER_GPU: return "gpu";
    case v1::TIER_DRAM: return "dram";
    case v1::TIER_NVME: return "nvme";
    default: return "unspecified";
  }
}

// "1,2,3" or ranges "0-1023" (inclusive), mixed: "5,10-12". At most 2^24 tokens in
// all (a RouteRequest's limit), counted before any is built.
absl::Status ParseTokens(const std::vector<std::string>& items, v1::RouteRequest* req) {
  constexpr uint64_t kMaxTokens = uint64_t{1} << 24;
  uint64_t total = 0;
  for (const std::string& item : items) {
    std::vector<std::string> ab = absl::StrSplit(item, '-');
    uint32_t a = 0, b = 0;
    const bool one = ab.size() == 1 && absl::SimpleAtoi(ab[0], &a);
    const bool range = ab.size() == 2 && absl::SimpleAtoi(ab[0], &a) && absl::SimpleAtoi(ab[1], &b) && a <= b;
    if (!one && !range) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tokens: \"", item, "\" is not a token id or a range A-B (A <= B) of uint32 ids"));
    }
    total += range ? uint64_t{b} - a + 1 : 1;
    if (total > kMaxTokens) {
      return absl::InvalidArgumentError(absl::StrCat("--tokens: more than 2^24 (", kMaxTokens,
                                                     ") tokens in all, a route request's limit; give fewer"));
    }
    if (one) {
      req->add_tokens(a);
    } else {
      for (uint64_t t = a; t <= b; ++t) req->add_tokens(static_cast<uint32_t>(t));
    }
  }
  return absl::OkStatus();
}

struct RouteArgs {
  std::string router;
  std::string model = "tiny-gqa";
  uint32_t block_tokens = 0;
  std::vector<std::string> tokens;
  std::vector<std::string> hashes;
  std::string session;
  std::string policy;
  std::string tenant_salt;
  uint64_t prompt_tokens = 0;
  bool json = false;
};

void RunRoute(const RouteArgs& a, Io& io) {
  v1::RouteRequest req;
  req.mutable_model()->set_name(a.model);
  req.mutable_model()->set_block_tokens(a.block_tokens);
  if (a.tokens.empty() == a.hashes.empty()) {
    *io.err << "kvctl route: give exactly one of --tokens and --hashes\n";
    io.exit_code = 2;
    return;
  }
  if (absl::Status s = ParseTokens(a.tokens, &req); !s.ok()) {
    *io.err << s.message() << "\n";
    io.exit_code = 2;
    return;
  }
  for (size_t i = 0; i < a.hashes.size(); ++i) {
    auto h = BlockHash::FromHex(a.hashes[i]);
    if (!h.ok()) {
      *io.err << "--hashes[" << i << "]: " << h.status().message() << "\n";
      io.exit_code = 2;
      return;
    }
    req.add_block_hashes(h->ToBytes());
  }
  req.set_session_id(a.session);
  req.set_policy(a.policy);
  req.set_tenant_salt(a.tenant_salt);
  req.set_prompt_tokens(a.prompt_tokens);
  // A malformed --router is a bad argument (2); an unreachable router is not (1).
  if (absl::Status bad = CheckDialTarget("--router", a.router); !bad.ok()) {
    *io.err << "kvctl route: " << bad.message() << "\n";
    io.exit_code = 2;
    return;
  }
  auto client = router::RouterClient::Connect(a.router);
  if (!client.ok()) {
    *io.err << "kvctl route: " << client.status().message() << "\n";
    io.exit_code = 1;
    return;
  }
  auto r = (*client)->Route(req);
  if (!r.ok()) {
    *io.err << "kvctl route: " << absl::StatusCodeToString(r.status().code()) << ": " << r.status().message()
            << "\n";
    // The router refused the request itself (bad model, block size, policy...): a bad argument.
    io.exit_code = r.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    return;
  }
  ordered_json j;
  j["instance_id"] = r->instance_id();
  j["instance_address"] = r->instance_address();
  j["policy"] = r->policy();
  j["total_blocks"] = r->total_blocks();
  j["gpu_hit_blocks"] = r->gpu_hit_blocks();
  j["pool_hit_blocks"] = r->pool_hit_blocks();
  j["estimated_ttft_s"] = r->estimated_ttft_s();
  j["decision_id"] = r->decision_id();
  ordered_json locs = ordered_json::array();
  for (const auto& l : r->pool_locations()) {
    locs.push_back({{"holder_id", l.holder_id()},
                    {"tier", std::string(TierName(l.tier()))},
                    {"first_block", l.first_block()},
                    {"num_blocks", l.num_blocks()}});
  }
  j["pool_locations"] = locs;
  if (a.json) {
    *io.out << j.dump(2) << "\n";
    return;
  }
  *io.out << "route -> " << r->instance_id() << " (" << r->instance_address() << ") by " << r->policy() << "\n"
          << "  blocks           " << r->total_blocks() << "\n"
          << "  gpu hit          " << r->gpu_hit_blocks() << " blocks\n"
          << "  pool hit         " << r->pool_hit_blocks() << " blocks\n";
  for (const auto& l : r->pool_locations()) {
    *io.out << "    " << l.holder_id() << " " << TierName(l.tier()) << " blocks [" << l.first_block() << ", "
            << l.first_block() + l.num_blocks() << ")\n";
  }
  *io.out << "  estimated TTFT   " << r->estimated_ttft_s() * 1e3 << " ms\n"
          << "  decision id      " << r->decision_id() << "\n";
}

struct StatusArgs {
  std::string router;
  bool json = false;
};

void RunStatus(const StatusArgs& a, Io& io) {
  auto client = router::RouterClient::Connect(a.router);
  if (!client.ok()) {
    *io.err << "kvctl status: " << client.status().message() << "\n";
    io.exit_code = 1;
    return;
  }
  auto st = (*client)->GetStats();
  if (!st.ok()) {
    *io.err << "kvctl status: " << st.status().message() << "\n";
    io.exit_code = 1;
    return;
  }
  ordered_json j;
  j["policy"] = st->policy();
  j["index_entries"] = st->index_entries();
  j["index_bytes"] = st->index_bytes();
  j["index_bytes_per_entry"] =
      st->index_entries() > 0 ? static_cast<double>(st->index_bytes()) / static_cast<double>(st->index_entries()) : 0.0;
  j["max_index_entries"] = st->max_index_entries();
  j["pruned_entries"] = st->pruned_entries();
  j["events_applied"] = st->events_applied();
  j["full_dumps_requested"] = st->full_dumps_requested();
  j["dropped_sources"] = st->dropped_sources();
  ordered_json dec = ordered_json::object();
  std::map<std::string, uint64_t> sorted(st->decisions_by_policy().begin(), st->decisions_by_policy().end());
  for (const auto& [k, v] : sorted) dec[k] = v;
  j["decisions_by_policy"] = dec;
  ordered_json inst = ordered_json::array();
  for (const auto& i : st->instances()) {
    inst.push_back({{"source_id", i.source_id()},
                    {"kind", i.kind() == v1::SOURCE_KIND_WORKER ? "worker" : "pool_node"},
                    {"model", i.model()},
                    {"address", i.address()},
                    {"running_requests", i.load().running_requests()},
                    {"waiting_requests", i.load().waiting_requests()},
                    {"queued_prefill_tokens", i.load().queued_prefill_tokens()},
                    {"kv_usage", i.load().kv_usage()},
                    {"inflight_decisions", i.inflight_decisions()},
                    {"index_blocks", i.index_blocks()},
                    {"stale", i.stale()},
                    {"publishes_events", i.publishes_events()},
                    {"last_sequence", i.last_sequence()},
                    {"last_heartbeat_age_s", i.last_heartbeat_age_s()}});
  }
  j["instances"] = inst;
  if (a.json) {
    *io.out << j.dump(2) << "\n";
    return;
  }
  std::ostream& o = *io.out;
  o << "router " << a.router << "  policy " << st->policy() << "\n"
    << "  index            " << st->index_entries() << " entries, " << st->index_bytes() << " bytes ("
    << std::fixed << std::setprecision(1) << j["index_bytes_per_entry"].get<double>() << " B/entry), max "
    << st->max_index_entries() << ", pruned " << st->pruned_entries() << "\n"
    << "  events applied   " << st->events_applied() << ", full dumps requested " << st->full_dumps_requested()
    << ", sources dropped " << st->dropped_sources() << "\n"
    << "  decisions        ";
  for (const auto& [k, v] : sorted) o << k << "=" << v << " ";
  o << "\n\n";
  o << std::left << std::setw(20) << "SOURCE" << std::setw(10) << "KIND" << std::setw(16) << "MODEL" << std::setw(22)
    << "ADDRESS" << std::right << std::setw(8) << "RUN" << std::setw(8) << "WAIT" << std::setw(12) << "QUEUED_TOK"
    << std::setw(7) << "KV%" << std::setw(9) << "INFLIGHT" << std::setw(10) << "BLOCKS" << std::setw(8) << "SEQ"
    << std::setw(8) << "HB_AGE" << "  FLAGS\n";
  for (const auto& i : st->instances()) {
    o << std::left << std::setw(20) << i.source_id() << std::setw(10)
      << (i.kind() == v1::SOURCE_KIND_WORKER ? "worker" : "pool") << std::setw(16) << i.model() << std::setw(22)
      << i.address() << std::right << std::setw(8) << i.load().running_requests() << std::setw(8)
      << i.load().waiting_requests() << std::setw(12) << i.load().queued_prefill_tokens() << std::setw(7)
      << std::setprecision(0) << i.load().kv_usage() * 100 << std::setw(9) << i.inflight_decisions() << std::setw(10)
      << i.index_blocks() << std::setw(8) << i.last_sequence() << std::setw(7) << std::setprecision(1)
      << i.last_heartbeat_age_s() << "s  " << (i.stale() ? "stale " : "")
      << (i.publishes_events() ? "" : "approximate") << "\n";
  }
}

}  // namespace

void AddRouteCommands(CLI::App& app, Io& io) {
  auto route_args = std::make_shared<RouteArgs>();
  CLI::App* route = app.add_subcommand("route", "Ask a router which instance should serve a request");
  route->add_option("--router", route_args->router, "router address host:port")->required();
  route->add_option("--model", route_args->model, "model name")->capture_default_str();
  route->add_option("--block-tokens", route_args->block_tokens, "tokens per block (0 = the model's)");
  route->add_option("--tokens", route_args->tokens, "token ids: 1,2,3 or ranges 0-1023")->delimiter(',');
  route->add_option("--hashes", route_args->hashes, "block hashes, 32 hex digits each, comma-separated")
      ->delimiter(',');
  route->add_option("--session", route_args->session, "session id (sticky routing)");
  route->add_option("--policy", route_args->policy, "override the router's policy for this request");
  route->add_option("--tenant-salt", route_args->tenant_salt, "tenant salt mixed into the hashes");
  route->add_option("--prompt-tokens", route_args->prompt_tokens, "prompt length with --hashes (0 = blocks x block size)");
  route->add_flag("--json", route_args->json, "print JSON");
  route->callback([route_args, &io] { RunRoute(*route_args, io); });

  auto status_args = std::make_shared<StatusArgs>();
  CLI::App* status = app.add_subcommand("status", "Show a router's instances, load and index size");
  status->add_option("--router", status_args->router, "router address host:port")->required();
  status->add_flag("--json", status_args->json, "print JSON");
  status->callback([status_args, &io] { RunStatus(*status_args, io); });
}

}  // namespace kvpool::kvctl
