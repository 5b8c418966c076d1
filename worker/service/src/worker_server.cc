#include "kvpool/worker/service/worker_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <atomic>
#include <unistd.h>

#include <future>
#include <iostream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "engine.h"
#include "kvpool/common/cli_flags.h"
#include "kvpool/common/service_main.h"
#include "kvpool/common/host_port.h"
#include "kvpool/common/status.h"
#include "kvpool/metrics/metrics.h"
#include "kvpool/proto/grpc_status.h"
#include "kvpool/router/event_publisher.h"
#include "kvpool/v1/worker.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace kvpool::worker {
namespace {

constexpr size_t kMaxPromptTokens = size_t{1} << 20;
constexpr uint32_t kMaxNewTokens = 4096;

// kvpool.v1.Worker: validates each request (errors name the field), hands it to the
// engine and waits for the engine's answer.
class WorkerService final : public v1::Worker::Service {
 public:
  WorkerService(Engine* engine, const WorkerConfig& cfg) : engine_(engine), cfg_(cfg) {}

  grpc::Status Prefill(grpc::ServerContext* ctx, const v1::PrefillRequest* req, v1::GenerateResponse* resp) override {
    return Run(ctx, req->request_id(), req->tokens(), 1, req->tenant_salt(), req->router_decision_id(), resp,
               /*prefill=*/true);
  }
  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req, v1::GenerateResponse* resp) override {
    if (req->max_new_tokens() > kMaxNewTokens) {
      engine_->ReleaseRefusedDecision(req->router_decision_id());
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "max_new_tokens=", req->max_new_tokens(), " is above ", kMaxNewTokens, "; ask for fewer")));
    }
    return Run(ctx, req->request_id(), req->tokens(), static_cast<int32_t>(req->max_new_tokens()), req->tenant_salt(),
               req->router_decision_id(), resp, /*prefill=*/false);
  }
  grpc::Status GetStats(grpc::ServerContext*, const v1::GetWorkerStatsRequest*, v1::WorkerStats* resp) override {
    *resp = engine_->Stats();
    return grpc::Status::OK;
  }

 private:
  // `prefill`: a Prefill call, whose one generated token is implied (it has no
  // max_new_tokens field to name).
  absl::Status Validate(const std::string& request_id, const google::protobuf::RepeatedField<uint32_t>& tokens,
                        int32_t max_new_tokens, const std::string& salt, bool prefill) const {
    if (request_id.size() > 128) {
      return absl::InvalidArgumentError(absl::StrCat("request_id has ", request_id.size(), " bytes; at most 128"));
    }
    if (tokens.empty()) return absl::InvalidArgumentError("tokens is empty; send at least one prompt token");
    if (static_cast<size_t>(tokens.size()) > kMaxPromptTokens) {
      return absl::InvalidArgumentError(absl::StrCat("tokens has ", tokens.size(), " ids; at most ", kMaxPromptTokens));
    }
    const int vocab = engine_->spec().vocab_size;
    for (int i = 0; i < tokens.size(); ++i) {
      if (tokens[i] >= static_cast<uint32_t>(vocab)) {
        return absl::InvalidArgumentError(absl::StrCat("tokens[", i, "]=", tokens[i], " is not below model '",
                                                       engine_->spec().name, "' vocab size ", vocab));
      }
    }
    if (prefill && static_cast<int64_t>(tokens.size()) + 1 > cfg_.max_model_len) {
      return absl::InvalidArgumentError(absl::StrCat("tokens (", tokens.size(),
                                                     ") + the one token Prefill generates exceeds this worker's "
                                                     "--max-model-len=", cfg_.max_model_len, "; shorten the prompt"));
    }
    if (static_cast<int64_t>(tokens.size()) + max_new_tokens > cfg_.max_model_len) {
      return absl::InvalidArgumentError(absl::StrCat("tokens (", tokens.size(), ") + max_new_tokens (", max_new_tokens,
                                                     ") exceeds this worker's --max-model-len=", cfg_.max_model_len,
                                                     "; shorten the prompt or ask for fewer tokens"));
    }
    // A request that could never fit the arena fails here, naming its own fields (the
    // engine would refuse it in its terms, or answer RESOURCE_EXHAUSTED as if a retry
    // could help).
    const int64_t need = engine_->PagesNeeded(tokens.size(), max_new_tokens);
    if (need > engine_->num_blocks() - 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          prefill ? absl::StrCat("tokens (", tokens.size(), ") and the one token Prefill generates")
                  : absl::StrCat("tokens (", tokens.size(), ") + max_new_tokens (", max_new_tokens, ")"),
          " need ", need, " KV pages but this worker has ", engine_->num_blocks() - 1, " (--num-blocks=",
          engine_->num_blocks(), " less the null page); shorten the prompt",
          prefill ? "" : " or ask for fewer tokens", ", or raise --num-blocks"));
    }
    if (salt.size() > 256) {
      return absl::InvalidArgumentError(absl::StrCat("tenant_salt has ", salt.size(), " bytes; at most 256"));
    }
    return absl::OkStatus();
  }

  grpc::Status Run(grpc::ServerContext* ctx, const std::string& request_id,
                   const google::protobuf::RepeatedField<uint32_t>& tokens, int32_t max_new_tokens,
                   const std::string& salt, uint64_t decision_id, v1::GenerateResponse* resp, bool prefill) {
    if (absl::Status s = Validate(request_id, tokens, max_new_tokens, salt, prefill); !s.ok()) {
      engine_->ReleaseRefusedDecision(decision_id);  // or the router counts it as load until its timeout
      return ToGrpcStatus(s);
    }
    EngineRequest er;
    er.request_id = request_id.empty() ? absl::StrCat(cfg_.instance_id, "-", next_id_.fetch_add(1)) : request_id;
    er.tokens.assign(tokens.begin(), tokens.end());
    er.max_new_tokens = max_new_tokens;
    er.tenant_salt = salt;
    er.decision_id = decision_id;
    // Relaxed: the flag publishes nothing else; the engine reads it once per iteration.
    auto cancelled = std::make_shared<std::atomic<bool>>(false);
    er.cancelled = cancelled;
    auto promise = std::make_shared<std::promise<absl::StatusOr<v1::GenerateResponse>>>();
    std::future<absl::StatusOr<v1::GenerateResponse>> done = promise->get_future();
    absl::Status s = engine_->Submit(std::move(er), [promise](absl::StatusOr<v1::GenerateResponse> r) {
      promise->set_value(std::move(r));
    });
    if (!s.ok()) {  // refused without an answer from the engine (stopped, or invalid)
      engine_->ReleaseRefusedDecision(decision_id);
      return ToGrpcStatus(s);
    }
    // The engine always answers (Stop fails what is left). A cancelled client (or one
    // past its deadline) stops waiting and tells the engine, which drops the request at
    // its next iteration (freeing its pages and running slot) and answers CANCELLED to
    // the callback, which owns the promise.
    while (done.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready) {
      if (ctx->IsCancelled()) {
        cancelled->store(true, std::memory_order_relaxed);
        return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
      }
    }
    absl::StatusOr<v1::GenerateResponse> r = done.get();
    if (!r.ok()) return ToGrpcStatus(r.status());
    *resp = *std::move(r);
    return grpc::Status::OK;
  }

  Engine* engine_;
  const WorkerConfig& cfg_;
  std::atomic<uint64_t> next_id_{1};
};

}  // namespace

absl::StatusOr<WorkerConfig> ParseWorkerFlags(int argc, char** argv) {
  WorkerConfig cfg;
  CLI::App app{"kvpool-worker: runs a model over the paged KV cache, with pool nodes as lower tiers"};
  std::string pools;
  bool no_prefix_cache = false;
  app.add_option("--listen", cfg.listen, "gRPC listen address host:port (default 127.0.0.1:50071)");
  app.add_option("--advertise", cfg.advertise, "address announced to the router (default --listen)");
  app.add_option("--instance-id", cfg.instance_id, "instance id (default worker-<port>)");
  app.add_option("--model", cfg.model, "preset (tiny-gqa, tiny-mla, tiny-hybrid, llama-3.3-70b, ...) or JSON spec path");
  app.add_option("--num-blocks", cfg.num_blocks, "KV blocks (pages) of the GPU tier, including the null block")
      ->check(CLI::Range(2, 1 << 24));
  app.add_option("--max-running", cfg.max_running, "sequences decoding at once")->check(CLI::Range(1, 4096));
  app.add_option("--max-model-len", cfg.max_model_len, "prompt + new tokens, at most")->check(CLI::Range(1, 1 << 22));
  app.add_flag("--no-prefix-cache", no_prefix_cache, "disable prefix caching (every prompt recomputed)");
  app.add_option("--hybrid-mode", cfg.hybrid_mode, "hybrid hits: replay (replay KDA from the checkpoint) or strict");
  app.add_option("--router", cfg.router, "router host:port: register, publish KV events, heartbeats (optional)");
  app.add_option("--pool-nodes", pools, "pool node gRPC addresses, comma-separated (optional)");
  app.add_option("--offload", cfg.offload, "write-through (as blocks fill), write-back (on eviction) or off");
  app.add_option("--fetch", cfg.fetch, "auto (cost model with measured rates), always or never");
  app.add_option("--pool-timeout-ms", cfg.pool_rpc_timeout_ms, "pool node RPC timeout, ms")->check(CLI::Range(50, 600000));
  app.add_option("--pool-transfer-timeout-ms", cfg.pool_transfer_timeout_ms,
                 "a pool transfer (one step's fetch or offload) still running after this fails, and its blocks "
                 "are recomputed, ms")
      ->check(CLI::Range(100, 600000));
  app.add_option("--metrics-port", cfg.metrics_port, "Prometheus /metrics port (0: any, -1: off)");
  app.add_option("--threads", cfg.threads, "kernel threads (results do not depend on it)")->check(CLI::Range(1, 256));
  app.add_option("--max-queued-requests", cfg.max_queued_requests,
                 "requests queued or running at once; more get RESOURCE_EXHAUSTED")
      // At most the waiting_requests a router accepts in a heartbeat's load (1,000,000):
      // beyond it every heartbeat was refused and the worker re-registered in a loop.
      ->check(CLI::Range(int64_t{1}, int64_t{1'000'000}));
  app.add_option("--max-queued-tokens", cfg.max_queued_tokens,
                 "prompt tokens of the requests queued or running; more get RESOURCE_EXHAUSTED")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 36));
  app.add_option("--drain-timeout-ms", cfg.drain_timeout_ms,
                 "at shutdown, requests already in the worker may finish for this long (new ones get UNAVAILABLE)")
      ->check(CLI::Range(0, 3'600'000));
  kvpool::RequireDecimalIntegers(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return absl::CancelledError("help");
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(absl::StrCat(e.what(), "; see --help"));
  }
  cfg.prefix_caching = !no_prefix_cache;
  for (absl::string_view p : absl::StrSplit(pools, ',', absl::SkipWhitespace())) {
    // "a:1, b:2": placement hashes the addresses as written, so " b:2" would be a
    // different node from other workers' "b:2".
    p = absl::StripAsciiWhitespace(p);
    RETURN_IF_ERROR(CheckDialTarget("--pool-nodes", p));
    cfg.pool_nodes.emplace_back(p);
  }
  if (cfg.pool_nodes.empty()) {
    if (app.count("--offload") > 0 && cfg.offload != "off") {
      return absl::InvalidArgumentError(absl::StrCat("--offload=", cfg.offload,
                                                     " needs --pool-nodes (where blocks are offloaded to)"));
    }
    if (app.count("--fetch") > 0 && cfg.fetch == "always") {
      return absl::InvalidArgumentError("--fetch=always needs --pool-nodes (where blocks are fetched from)");
    }
  }
  return cfg;
}

struct WorkerServer::State {
  WorkerConfig cfg;
  MetricsRegistry metrics;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<router::EventPublisher> publisher;
  std::unique_ptr<WorkerService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<MetricsHttpServer> http;
  std::string describe;
  int port = 0;
  bool shut_down = false;

  // See WorkerServer::Shutdown. Before, the server stopped first: gRPC cancelled every
  // call still running after its 2 s grace (the client saw CANCELLED, not UNAVAILABLE).
  void Shutdown() {
    if (shut_down) return;
    shut_down = true;
    if (engine) engine->RefuseNew();  // before NOT_SERVING: whoever sees it is refused
    if (server) server->GetHealthCheckService()->SetServingStatus(false);
    if (publisher) publisher->RequestStop();  // unregisters on its own thread
    if (engine) {
      engine->Drain(absl::Milliseconds(cfg.drain_timeout_ms));
      engine->Stop();  // answers what is left (UNAVAILABLE)
    }
    if (server) server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }

  ~State() {
    Shutdown();
    http.reset();
    publisher.reset();
    server.reset();
    engine.reset();
  }
};

WorkerServer::WorkerServer() : s_(std::make_unique<State>()) {}
WorkerServer::~WorkerServer() = default;

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Start(WorkerConfig config) {
  std::unique_ptr<WorkerServer> w(new WorkerServer());
  State& s = *w->s_;
  s.cfg = std::move(config);
  RETURN_IF_ERROR(CheckServiceFlags({.listen = s.cfg.listen,
                                     .advertise = s.cfg.advertise,
                                     .router = s.cfg.router,
                                     .id_flag = "--instance-id",
                                     .id = s.cfg.instance_id,
                                     .metrics_port = s.cfg.metrics_port}));
  if (s.cfg.drain_timeout_ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--drain-timeout-ms=", s.cfg.drain_timeout_ms,
                                                   " must be >= 0 (0: answer what is in the worker at once)"));
  }
  ASSIGN_OR_RETURN(ModelSpec spec, ResolveModelSpec(s.cfg.model));
  ASSIGN_OR_RETURN(OffloadMode offload, ParseOffloadMode(s.cfg.offload));
  ASSIGN_OR_RETURN(FetchMode fetch, ParseFetchMode(s.cfg.fetch));
  ASSIGN_OR_RETURN(cache::HybridHitMode hybrid, cache::ParseHybridHitMode(s.cfg.hybrid_mode));

  // Listen first: the port is part of the instance's identity.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(s.cfg.listen, grpc::InsecureServerCredentials(), &s.port);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(64 << 20);

  EngineConfig ec;
  ec.spec = spec;
  ec.runner.num_blocks = s.cfg.num_blocks;
  ec.runner.forward_fault = s.cfg.forward_fault;
  ec.before_write_back = s.cfg.before_write_back;
  ec.runner.max_running = s.cfg.max_running;
  ec.runner.max_model_len = s.cfg.max_model_len;
  ec.runner.enable_prefix_caching = s.cfg.prefix_caching;
  ec.runner.hybrid_mode = hybrid;
  ec.runner.num_threads = s.cfg.threads;
  ec.pool_nodes = s.cfg.pool_nodes;
  ec.offload = offload;
  ec.fetch = fetch;
  ec.pool_rpc_timeout_ms = s.cfg.pool_rpc_timeout_ms;
  ec.pool_transfer_timeout_ms = s.cfg.pool_transfer_timeout_ms;
  ec.max_queued_requests = s.cfg.max_queued_requests;
  ec.max_queued_prompt_tokens = s.cfg.max_queued_tokens;
  // The instance id needs the port when it is defaulted; parse it from --listen.
  if (s.cfg.instance_id.empty()) {
    const size_t c = s.cfg.listen.rfind(':');
    const std::string port = c == std::string::npos ? s.cfg.listen : s.cfg.listen.substr(c + 1);
    const bool no_port = port == "0" || IsUnixSocketAddress(s.cfg.listen);
    s.cfg.instance_id = absl::StrCat("worker-", no_port ? absl::StrCat("pid", getpid()) : port);
  }
  ec.instance_id = s.cfg.instance_id;
  ASSIGN_OR_RETURN(s.engine, Engine::Create(std::move(ec), &s.metrics));
  // Describe() talks to the pool nodes, which only the engine thread may do once it runs.
  s.describe = absl::StrCat("kvpool-worker ", s.cfg.instance_id, "\n", s.engine->Describe());
  s.engine->Start();  // before the server: no request finds it not running
  s.service = std::make_unique<WorkerService>(s.engine.get(), s.cfg);
  builder.RegisterService(s.service.get());
  s.server = builder.BuildAndStart();
  if (s.server == nullptr || s.port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on --listen=", s.cfg.listen, "; is the port in use?"));
  }
  const std::string advertise = AdvertiseAddress(s.cfg.listen, s.cfg.advertise, s.port);
  if (!s.cfg.router.empty()) {
    router::EventPublisherOptions po;
    po.router_address = s.cfg.router;
    po.registration.set_source_id(s.cfg.instance_id);
    po.registration.set_kind(v1::SOURCE_KIND_WORKER);
    po.registration.set_address(advertise);
    po.registration.mutable_model()->set_name(spec.name);
    po.registration.mutable_model()->set_block_tokens(static_cast<uint32_t>(spec.block_tokens));
    po.registration.set_capacity_blocks(static_cast<uint64_t>(s.cfg.num_blocks - 1));
    po.registration.set_publishes_events(true);
    Engine* engine = s.engine.get();
    po.dump = [engine] { return engine->DumpEvents(); };
    po.load = [engine] { return engine->Load(); };
    s.publisher = std::make_unique<router::EventPublisher>(std::move(po));
    s.engine->SetPublisher(s.publisher.get());
  }
  // Metrics before the registration: a port that cannot be bound fails the start before
  // the router has counted this worker.
  if (s.cfg.metrics_port >= 0) {
    ASSIGN_OR_RETURN(s.http, MetricsHttpServer::Start(&s.metrics, "0.0.0.0", s.cfg.metrics_port));
  }
  if (s.publisher) s.publisher->Start();
  // A failed engine step leaves the worker unable to serve (see Engine): health says so
  // and the publisher unregisters from the router and stops (on its own thread: the
  // engine thread does not wait for the router), so traffic goes elsewhere.
  grpc::Server* server = s.server.get();
  router::EventPublisher* publisher = s.publisher.get();
  const std::string id = s.cfg.instance_id;
  s.engine->SetOutOfServiceHandler([server, publisher, id](const absl::Status& why) {
    spdlog::error("worker {} is out of service: {}; health NOT_SERVING{}", id, std::string(why.message()),
                  publisher != nullptr ? ", unregistered from the router" : "");
    server->GetHealthCheckService()->SetServingStatus(false);
    if (publisher != nullptr) publisher->RequestStop();
  });
  absl::StrAppend(&s.describe, "  router         ", s.cfg.router.empty() ? "none" : s.cfg.router, "\n");
  absl::StrAppend(&s.describe, "  gRPC           ", s.cfg.listen, " (port ", s.port, "), kvpool.v1.Worker + health\n");
  absl::StrAppend(&s.describe, "  metrics        ",
                  s.http ? absl::StrCat("http://0.0.0.0:", s.http->port(), "/metrics") : std::string("off"), "\n");
  return w;
}

int WorkerServer::port() const { return s_->port; }
int WorkerServer::metrics_port() const { return s_->http ? s_->http->port() : -1; }
std::string WorkerServer::DescribeConfig() const { return s_->describe; }
void WorkerServer::Shutdown() { s_->Shutdown(); }

int WorkerMain(int argc, char** argv) {
  return RunServiceMain("kvpool-worker", ParseWorkerFlags(argc, argv), &WorkerServer::Start);
}

}  // namespace kvpool::worker
