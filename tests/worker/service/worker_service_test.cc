// kvpool-worker over real gRPC, real pool nodes (UCX, io_uring NVMe tier) and a real
// router, all in this process on loopback. The invariant under test: a request's output
// tokens and hidden digest are bit-identical whether its prefix came from the local
// cache, a pool node's DRAM or NVMe, or full recompute — for GQA, MLA and hybrid models.
#include <atomic>
#include <grpcpp/grpcpp.h>
#include <httplib.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <random>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kvpool/pool_node/node_server.h"
#include "kvpool/router/router_client.h"
#include "kvpool/router/router_server.h"
#include "kvpool/v1/pool.grpc.pb.h"
#include "kvpool/v1/worker.grpc.pb.h"
#include "kvpool/worker/service/worker_server.h"
#include "../../../worker/service/src/engine.h"  // SplitPrefixHit

namespace kvpool::worker {
namespace {

using Tokens = std::vector<uint32_t>;

struct Answer {
  Tokens output;
  std::string digest;
  v1::GenerateResponse resp;
};

// A stub to the worker listening on `port`.
std::unique_ptr<v1::Worker::Stub> WorkerStub(int port) {
  return v1::Worker::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
}

// The status of a Prefill, or of a Generate of `max_new_tokens`, of `n` tokens (id 1).
grpc::Status PrefillOfLength(v1::Worker::Stub& stub, int n) {
  v1::PrefillRequest req;
  for (int i = 0; i < n; ++i) req.add_tokens(1);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  return stub.Prefill(&ctx, req, &resp);
}
grpc::Status GenerateOfLength(v1::Worker::Stub& stub, int n, uint32_t max_new_tokens) {
  v1::GenerateRequest req;
  for (int i = 0; i < n; ++i) req.add_tokens(1);
  req.set_max_new_tokens(max_new_tokens);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  return stub.Generate(&ctx, req, &resp);
}

class Client {
 public:
  explicit Client(int port) : stub_(WorkerStub(port)) {}
  absl::StatusOr<Answer> Generate(const Tokens& prompt, uint32_t new_tokens, const std::string& salt = "") {
    v1::GenerateRequest req;
    for (uint32_t t : prompt) req.add_tokens(t);
    req.set_max_new_tokens(new_tokens);
    req.set_tenant_salt(salt);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    v1::GenerateResponse resp;
    grpc::Status s = stub_->Generate(&ctx, req, &resp);
    if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    return Answer{Tokens(resp.output_tokens().begin(), resp.output_tokens().end()), resp.hidden_digest(), resp};
  }
  grpc::Status Raw(const v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    return stub_->Generate(&ctx, req, &resp);
  }
  v1::WorkerStats Stats() {
    grpc::ClientContext ctx;
    v1::WorkerStats st;
    EXPECT_TRUE(stub_->GetStats(&ctx, v1::GetWorkerStatsRequest(), &st).ok());
    return st;
  }

 private:
  std::unique_ptr<v1::Worker::Stub> stub_;
};

Tokens RandomTokens(std::mt19937& rng, size_t n, uint32_t vocab) {
  Tokens t(n);
  for (auto& x : t) x = rng() % vocab;
  return t;
}

Tokens Concat(const Tokens& a, const Tokens& b) {
  Tokens out = a;
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

// A forward_fault that counts forward passes and holds each one while `hold` is set,
// then returns `result` (a step the test keeps running, or fails, when it wants).
std::function<absl::Status()> HeldForward(std::atomic<bool>& hold, std::atomic<int>& forwards,
                                          absl::Status result = absl::OkStatus()) {
  return [&hold, &forwards, result]() -> absl::Status {
    ++forwards;
    while (hold) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return result;
  };
}

struct Hits {
  uint64_t gpu = 0;   // prompt tokens reused from the worker's own cache
  uint64_t pool = 0;  // prompt tokens fetched from pool nodes
};

// Sends prompts[from, to) to `w` and expects every answer (tokens and hidden digest) to
// equal want[i] bit for bit. Returns the hits the answers report.
Hits ExpectSameAsOracle(Client& w, const std::vector<Tokens>& prompts, const std::vector<Answer>& want,
                        uint32_t new_tokens, size_t from = 0, size_t to = SIZE_MAX) {
  Hits hits;
  for (size_t i = from; i < std::min(to, prompts.size()); ++i) {
    absl::StatusOr<Answer> r = w.Generate(prompts[i], new_tokens);
    if (!r.ok()) {
      ADD_FAILURE() << "prompt " << i << ": " << r.status();
      continue;
    }
    EXPECT_EQ(r->output, want[i].output) << "prompt " << i;
    EXPECT_EQ(r->digest, want[i].digest) << "prompt " << i;
    hits.gpu += r->resp.gpu_hit_tokens();
    hits.pool += r->resp.pool_hit_tokens();
  }
  return hits;
}

class Cluster {
 public:
  explicit Cluster(const std::string& name) {
    dir_ = std::filesystem::temp_directory_path() / absl::StrCat("kvpool-worker-test-", name, "-", getpid());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  ~Cluster() {
    workers_.clear();
    nodes_.clear();
    router_.reset();
    std::filesystem::remove_all(dir_);
  }

  void StartRouter(const std::string& model, absl::Duration heartbeat_timeout = absl::Seconds(10)) {
    router::RouterServerOptions o;
    o.host.core.heartbeat_timeout = heartbeat_timeout;
    o.listen = "127.0.0.1:0";
    o.metrics_port = -1;
    o.host.core.models = {model};
    // Far beyond any test: a decision still in flight was not released by the worker.
    o.host.core.decision_timeout = absl::Minutes(10);
    auto r = router::RouterServer::Start(o);
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = *std::move(r);
  }
  std::string router_address() const { return router_ ? absl::StrCat("127.0.0.1:", router_->port()) : ""; }

  // DRAM small enough that objects demote to the NVMe tier.
  std::string StartNode(const std::string& id, uint64_t dram_bytes, uint64_t nvme_bytes) {
    pool_node::NodeConfig c;
    c.listen = "127.0.0.1:0";
    c.metrics_port = -1;
    c.router = router_address();
    c.pool.node_id = id;
    c.pool.dram_bytes = dram_bytes;
    c.pool.page_bytes = 65536;
    if (nvme_bytes > 0) {
      c.pool.nvme_dir = (dir_ / id).string();
      std::filesystem::create_directories(c.pool.nvme_dir);
      c.pool.nvme_bytes = nvme_bytes;
    }
    auto n = pool_node::NodeServer::Start(c);
    EXPECT_TRUE(n.ok()) << n.status();
    if (!n.ok()) return "";
    std::string addr = absl::StrCat("127.0.0.1:", (*n)->port());
    nodes_.push_back(*std::move(n));
    return addr;
  }
  void KillNode(size_t i) { nodes_[i].reset(); }
  pool_node::NodeServer& node(size_t i) { return *nodes_[i]; }

  int StartWorker(WorkerConfig c) {
    c.listen = "127.0.0.1:0";
    if (c.router.empty()) c.router = router_address();
    auto w = WorkerServer::Start(c);
    EXPECT_TRUE(w.ok()) << w.status();
    if (!w.ok()) return 0;
    const int port = (*w)->port();
    workers_.push_back(*std::move(w));
    return port;
  }
  router::RouterServer* router() { return router_.get(); }
  int worker_port(size_t i) const { return workers_[i]->port(); }
  WorkerServer& worker(size_t i) { return *workers_[i]; }
  void StopWorkers() { workers_.clear(); }

 private:
  std::filesystem::path dir_;
  std::unique_ptr<router::RouterServer> router_;
  std::vector<std::unique_ptr<pool_node::NodeServer>> nodes_;
  std::vector<std::unique_ptr<WorkerServer>> workers_;
};

struct ModelCase {
  std::string model;
  int block_tokens;
  uint32_t vocab;
};

void PrintTo(const ModelCase& mc, std::ostream* os) { *os << mc.model; }

class InvariantTest : public ::testing::TestWithParam<ModelCase> {};

// Ten prompts over five shared prefixes, through: a recompute-only worker (the oracle);
// worker A (GPU hits, write-through offload); worker B with a tiny GPU cache, which
// gets the prefixes from the pool (DRAM, then NVMe after demotion). Every answer must
// equal the oracle's, bit for bit.
TEST_P(InvariantTest, OutputsEqualRecomputeWhateverTheTier) {
  const ModelCase mc = GetParam();
  Cluster cl(mc.model);
  // DRAM for every object (the NVMe path has its own test): nothing is evicted.
  const std::string a = cl.StartNode("pool-a", 32 << 20, 64 << 20);
  const std::string b = cl.StartNode("pool-b", 32 << 20, 64 << 20);
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());

  WorkerConfig oracle_cfg;
  oracle_cfg.model = mc.model;
  oracle_cfg.prefix_caching = false;
  oracle_cfg.instance_id = "oracle";
  Client oracle(cl.StartWorker(oracle_cfg));

  WorkerConfig wa;
  wa.model = mc.model;
  wa.instance_id = "worker-a";
  wa.pool_nodes = {a, b};
  wa.num_blocks = 256;
  Client worker_a(cl.StartWorker(wa));

  WorkerConfig wb = wa;
  wb.instance_id = "worker-b";
  wb.num_blocks = 24;  // one request's worth: everything else comes from the pool
  wb.fetch = "always";
  Client worker_b(cl.StartWorker(wb));

  std::mt19937 rng(7);
  // Hybrid: 5 blocks of 64 cross the KDA checkpoint at 256 tokens, so the pool holds
  // a checkpoint too and worker B restores it (then replays 64 tokens).
  const bool hybrid = mc.model == "tiny-hybrid";
  const size_t prefix_len = static_cast<size_t>(mc.block_tokens) * (hybrid ? 5 : 3);
  std::vector<Tokens> prompts;
  for (int p = 0; p < 5; ++p) {
    const Tokens prefix = RandomTokens(rng, prefix_len, mc.vocab);
    for (int s = 0; s < 2; ++s) prompts.push_back(Concat(prefix, RandomTokens(rng, 5 + s, mc.vocab)));
  }
  std::vector<Answer> want;
  for (const Tokens& p : prompts) {
    auto r = oracle.Generate(p, 3);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->resp.gpu_hit_tokens() + r->resp.pool_hit_tokens(), 0u);
    want.push_back(*r);
  }
  // Worker A: the second prompt of each prefix hits its GPU cache.
  EXPECT_GT(ExpectSameAsOracle(worker_a, prompts, want, 3).gpu, 0u);
  EXPECT_GT(worker_a.Stats().bytes_moved_by_tier().at("offloaded"), 0u);
  // Worker B never saw these prompts: their prefixes come from the pool.
  const uint64_t pool_hits = ExpectSameAsOracle(worker_b, prompts, want, 3).pool;
  EXPECT_GT(pool_hits, 0u);
  const v1::WorkerStats sb = worker_b.Stats();
  EXPECT_GT(sb.bytes_moved_by_tier().at("fetched_dram") + sb.bytes_moved_by_tier().at("fetched_nvme"), 0u);
  EXPECT_EQ(sb.prefix_hits_pool_tokens(), pool_hits);
  if (hybrid) {
    // Bytes beyond the blocks' own: KDA checkpoints (96 KiB each) came from the pool.
    const uint64_t block_bytes = pool_hits / 64 * 72 * 1024;
    EXPECT_GT(sb.bytes_moved_by_tier().at("fetched_dram") + sb.bytes_moved_by_tier().at("fetched_nvme"), block_bytes);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, InvariantTest,
                         ::testing::Values(ModelCase{"tiny-gqa", 16, 512}, ModelCase{"tiny-mla", 64, 512},
                                           ModelCase{"tiny-hybrid", 64, 512}),
                         [](const auto& info) {
                           std::string n = info.param.model;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });


// Prompts from `n` distinct prefixes of `blocks` blocks each (plus a short suffix).
std::vector<Tokens> PrefixFamily(std::mt19937& rng, int n, int blocks, int block_tokens, uint32_t vocab) {
  std::vector<Tokens> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(Concat(RandomTokens(rng, static_cast<size_t>(blocks * block_tokens), vocab), RandomTokens(rng, 3, vocab)));
  }
  return out;
}

std::vector<Answer> Oracle(Cluster& cl, const std::string& model, const std::vector<Tokens>& prompts) {
  WorkerConfig c;
  c.model = model;
  c.prefix_caching = false;
  c.instance_id = "oracle";
  Client oracle(cl.StartWorker(c));
  std::vector<Answer> want;
  for (const Tokens& p : prompts) {
    auto r = oracle.Generate(p, 2);
    EXPECT_TRUE(r.ok()) << r.status();
    want.push_back(r.ok() ? *r : Answer{});
  }
  return want;
}

// Pool DRAM of 16 pages per node: most offloaded blocks are demoted to the NVMe tier
// (io_uring, O_DIRECT) and come back from there, promoted by the Lookup.
TEST(WorkerService, PrefixesComeBackFromNvme) {
  Cluster cl("nvme");
  const std::string a = cl.StartNode("pool-a", 1 << 20, 64 << 20);
  const std::string b = cl.StartNode("pool-b", 1 << 20, 64 << 20);
  std::mt19937 rng(11);
  const std::vector<Tokens> prompts = PrefixFamily(rng, 16, 4, 16, 512);
  const std::vector<Answer> want = Oracle(cl, "tiny-gqa", prompts);
  WorkerConfig wa;
  wa.instance_id = "worker-a";
  wa.pool_nodes = {a, b};
  Client worker_a(cl.StartWorker(wa));
  for (const Tokens& p : prompts) ASSERT_TRUE(worker_a.Generate(p, 2).ok());
  WorkerConfig wb = wa;
  wb.instance_id = "worker-b";
  wb.num_blocks = 16;
  wb.fetch = "always";
  Client worker_b(cl.StartWorker(wb));
  ExpectSameAsOracle(worker_b, prompts, want, 2);
  const v1::WorkerStats sb = worker_b.Stats();
  EXPECT_GT(sb.bytes_moved_by_tier().at("fetched_nvme"), 0u);
  EXPECT_GT(sb.prefix_hits_pool_tokens(), 0u);
}

// Write-back: blocks reach the pool only when worker A evicts them; worker B then
// fetches them. A pool node killed midway: its blocks are recomputed, answers unchanged.
TEST(WorkerService, WriteBackThenNodeLoss) {
  Cluster cl("wb");
  const std::string a = cl.StartNode("pool-a", 8 << 20, 0);
  const std::string b = cl.StartNode("pool-b", 8 << 20, 0);
  std::mt19937 rng(5);
  const std::vector<Tokens> prompts = PrefixFamily(rng, 8, 4, 16, 512);
  const std::vector<Answer> want = Oracle(cl, "tiny-gqa", prompts);
  WorkerConfig wa;
  wa.instance_id = "worker-a";
  wa.pool_nodes = {a, b};
  wa.offload = "write-back";
  wa.num_blocks = 12;  // two prompts' worth: the rest is evicted, hence written back
  wa.pool_rpc_timeout_ms = 500;
  Client worker_a(cl.StartWorker(wa));
  for (const Tokens& p : prompts) ASSERT_TRUE(worker_a.Generate(p, 2).ok());
  EXPECT_GT(worker_a.Stats().bytes_moved_by_tier().at("offloaded"), 0u);
  WorkerConfig wb = wa;
  wb.instance_id = "worker-b";
  wb.fetch = "always";
  Client worker_b(cl.StartWorker(wb));
  EXPECT_GT(ExpectSameAsOracle(worker_b, prompts, want, 2, 0, 4).pool, 0u);
  cl.KillNode(0);
  ExpectSameAsOracle(worker_b, prompts, want, 2, 4);
}

// Write-back Puts run inside the step whose allocation evicted their blocks. That time is
// the pool's, not prefill's: a slow pool node (each Put held 1 s here) must not show as
// the request's recompute_s, nor slow the measured prefill rate --fetch=auto weighs a
// fetch against (before, the step's whole time counted as recompute: recompute_s >= 1 s).
TEST(WorkerService, WriteBackTimeIsNotCountedAsRecompute) {
  Cluster cl("wbtime");
  const std::string a = cl.StartNode("pool-a", 8 << 20, 0);
  ASSERT_FALSE(a.empty());
  std::atomic<int> puts{0};
  WorkerConfig wc;
  wc.instance_id = "worker-wbtime";
  wc.pool_nodes = {a};
  wc.offload = "write-back";
  wc.num_blocks = 12;  // two prompts' worth: later prompts evict, hence write back
  wc.before_write_back = [&puts] {
    ++puts;
    std::this_thread::sleep_for(std::chrono::seconds(1));
  };
  Client w(cl.StartWorker(wc));
  std::mt19937 rng(11);
  int checked = 0;
  for (int i = 0; i < 6; ++i) {
    const int before = puts.load();
    auto got = w.Generate(RandomTokens(rng, 64, 512), 1);
    ASSERT_TRUE(got.ok()) << got.status();
    if (puts.load() == before) continue;  // this request's step evicted nothing
    ++checked;
    const v1::TtftBreakdown& t = got->resp.ttft();
    // The sleep happened during this request (its total holds it), outside its prefill.
    EXPECT_GE(t.total_s(), 1.0) << i;
    EXPECT_LT(t.recompute_s(), 1.0) << i << ": the write-back Put counted as prefill";
  }
  EXPECT_GT(checked, 0) << "no request's step wrote anything back";
}

// One pool node listed twice, or under two spellings (placement would give it two
// places in the ring, and workers spelling it differently would disagree on owners): the
// worker refuses to start, naming both entries.
TEST(WorkerService, PoolNodeListedTwiceIsRefused) {
  Cluster cl("alias");
  const std::string a = cl.StartNode("pool-a", 8 << 20, 0);
  ASSERT_FALSE(a.empty());
  auto start = [](std::vector<std::string> nodes) {
    WorkerConfig wc;
    wc.listen = "127.0.0.1:0";
    wc.instance_id = "worker-alias";
    wc.pool_nodes = std::move(nodes);
    return WorkerServer::Start(wc);
  };
  auto twice = start({a, a});
  ASSERT_FALSE(twice.ok());
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(twice.status().message()).find("twice"), std::string::npos) << twice.status();
  const std::string alias = "localhost" + a.substr(a.rfind(':'));
  auto aliased = start({a, alias});
  ASSERT_FALSE(aliased.ok());
  EXPECT_EQ(aliased.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(aliased.status().message()).find("reach the same pool node"), std::string::npos)
      << aliased.status();
  auto one = start({a});
  EXPECT_TRUE(one.ok()) << one.status();
}

// A step whose forward pass fails (injected, as a kernel failure) has already cached the
// pages it allocated: the request fails, and none of those pages may be offloaded (they
// would reach the pool with a valid checksum over bytes nobody computed).
TEST(WorkerService, FailedStepOffloadsNothing) {
  Cluster cl("fault");
  const std::string a = cl.StartNode("pool-a", 8 << 20, 0);
  std::atomic<int> forwards{0};
  WorkerConfig wc;
  wc.instance_id = "worker-f";
  wc.pool_nodes = {a};
  wc.forward_fault = [&forwards]() -> absl::Status {
    return ++forwards == 1 ? absl::InternalError("injected kernel failure") : absl::OkStatus();
  };
  Client w(cl.StartWorker(wc));
  std::mt19937 rng(9);
  // The prefill step allocates (and caches) 3 full blocks of 16, then its forward pass
  // fails.
  auto first = w.Generate(RandomTokens(rng, 3 * 16 + 2, 512), 3);
  ASSERT_FALSE(first.ok());
  EXPECT_NE(std::string(first.status().message()).find("injected kernel failure"), std::string::npos)
      << first.status();
  // The worker refuses further work (its runner is broken); nothing reached the pool.
  EXPECT_FALSE(w.Generate(RandomTokens(rng, 4 * 16 + 2, 512), 1).ok());
  size_t stored = 0;
  cl.node(0).core().ForEachVisible([&](const pool_node::ObjectKey&, const std::optional<BlockHash>&, auto) { ++stored; });
  EXPECT_EQ(stored, 0u);
  EXPECT_EQ(w.Stats().bytes_moved_by_tier().at("offloaded"), 0u);
}

// After a failed step the runner refuses all further work: the worker says so where
// clients and health checkers look (health NOT_SERVING; UNAVAILABLE naming why, so a
// client tries elsewhere) and unregisters from the router. It used to stay
// SERVING and answer FAILED_PRECONDITION to every request.
TEST(WorkerService, AFailedStepTakesTheWorkerOutOfService) {
  Cluster cl("out-of-service");
  cl.StartRouter("tiny-gqa", /*heartbeat_timeout=*/absl::Minutes(10));  // only Unregister drops it
  std::atomic<int> forwards{0};
  WorkerConfig wc;
  wc.instance_id = "worker-o";
  wc.forward_fault = [&forwards]() -> absl::Status {
    return ++forwards == 2 ? absl::InternalError("injected kernel failure") : absl::OkStatus();
  };
  const int port = cl.StartWorker(wc);
  Client w(port);
  auto health = [port] {
    auto stub = grpc::health::v1::Health::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckResponse resp;
    const grpc::Status st = stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return resp.status();
  };
  std::mt19937 rng(11);
  ASSERT_TRUE(w.Generate(RandomTokens(rng, 20, 512), 1).ok());  // forward 1
  EXPECT_EQ(health(), grpc::health::v1::HealthCheckResponse::SERVING);
  auto failed = w.Generate(RandomTokens(rng, 20, 512), 1);  // forward 2 fails
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("injected kernel failure"), absl::string_view::npos) << failed.status();
  EXPECT_EQ(health(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  auto after = w.Generate(RandomTokens(rng, 20, 512), 1);
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
  EXPECT_NE(after.status().message().find("out of service"), absl::string_view::npos) << after.status();
  EXPECT_NE(after.status().message().find("injected kernel failure"), absl::string_view::npos) << after.status();
  // The worker unregistered from the router (on the publisher's thread: a bounded wait,
  // not a timing assertion).
  auto registered = [&] {
    for (const auto& src : cl.router()->host().Stats().sources) {
      if (src.id == "worker-o") return true;
    }
    return false;
  };
  for (int i = 0; i < 3000 && registered(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_FALSE(registered()) << "the router still routes to the out-of-service worker";
}

// A failed step answers the requests that took part in it with its error, and those that
// waited behind it (never run) UNAVAILABLE naming the out-of-service worker, as a request
// sent afterwards gets. Before, the waiting ones got the step's own error too (here
// INTERNAL; a RESOURCE_EXHAUSTED one tells clients to retry this worker).
TEST(WorkerService, RequestsWaitingBehindAFailedStepAreToldToGoElsewhere) {
  Cluster cl("failed-step-queue");
  std::atomic<bool> hold{true};
  std::atomic<int> forwards{0};
  WorkerConfig wc;
  wc.instance_id = "worker-q";
  wc.forward_fault = HeldForward(hold, forwards, absl::InternalError("injected kernel failure"));
  Client w(cl.StartWorker(wc));
  std::mt19937 rng(21);
  const Tokens p1 = RandomTokens(rng, 20, 512), p2 = RandomTokens(rng, 20, 512);
  absl::StatusOr<Answer> first, second;
  std::thread t1([&] { first = w.Generate(p1, 1); });
  while (forwards == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::thread t2([&] { second = w.Generate(p2, 1); });
  // The second request queues while the first one's step is held. Had it not arrived
  // within this time, Submit answers it the same way after the failure: no flake, only
  // a run that does not exercise the queue.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  hold = false;
  t1.join();
  t2.join();
  ASSERT_FALSE(first.ok());
  EXPECT_EQ(first.status().code(), absl::StatusCode::kInternal) << first.status();
  EXPECT_NE(first.status().message().find("injected kernel failure"), absl::string_view::npos) << first.status();
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status().message();
  EXPECT_NE(second.status().message().find("worker-q is out of service"), absl::string_view::npos) << second.status();
  EXPECT_EQ(forwards.load(), 1) << "the waiting request never ran";
}

// The load a worker reports counts a waiting request's prompt less the prefix cached
// there (queued_prefill_tokens: tokens still to be prefilled). The router counts its own
// decisions net of the hit; before, the full prompt was reported, so the heartbeat that
// replaced a decision made the worker holding the prefix look the busiest.
TEST(WorkerService, QueuedPrefillTokensLeaveOutTheCachedPrefix) {
  Cluster cl("queued-net");
  std::atomic<bool> slow{false};
  WorkerConfig wc;
  wc.instance_id = "worker-n";
  wc.max_running = 1;  // a second request waits while the first decodes
  wc.forward_fault = [&slow]() -> absl::Status {
    if (slow) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return absl::OkStatus();
  };
  Client w(cl.StartWorker(wc));
  std::mt19937 rng(31);
  const Tokens prefix = RandomTokens(rng, 16 * 8, 512);     // 8 blocks of tiny-gqa
  ASSERT_TRUE(w.Generate(Concat(prefix, {7}), 1).ok());       // caches them
  const Tokens waiting = Concat(prefix, RandomTokens(rng, 40, 512));  // 168 tokens, 128 cached
  slow = true;
  absl::StatusOr<Answer> first, second;
  std::thread t1([&] { first = w.Generate(RandomTokens(rng, 20, 512), 400); });
  for (int i = 0; i < 5000 && w.Stats().load().running_requests() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::thread t2([&] { second = w.Generate(waiting, 1); });
  // Bounded wait for the engine to take the second request in (it counts whole while it is
  // still in the arrival queue): 40 tokens from then on, 168 before the fix.
  bool saw_net = false;
  uint64_t last = 0;  // queued_prefill_tokens last seen while the request waited
  for (int i = 0; i < 5000 && !saw_net; ++i) {
    const v1::WorkerStats st = w.Stats();
    if (st.load().waiting_requests() == 1 && st.load().running_requests() == 1) {  // behind the first
      last = st.load().queued_prefill_tokens();
      saw_net = last == 40;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(saw_net) << "queued_prefill_tokens while it waited: " << last << " (want 40: 168 less 128 cached)";
  slow = false;
  t1.join();
  t2.join();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->resp.gpu_hit_tokens(), 128u);
}

// Shutdown lets a request already in the worker finish (drain), turns new ones away
// UNAVAILABLE and says NOT_SERVING first. Before, the gRPC server stopped first and
// cancelled every call still running after 2 s: this 3 s request got CANCELLED.
TEST(WorkerService, ShutdownDrainsRequestsInFlight) {
  Cluster cl("drain");
  std::atomic<bool> hold{true};
  std::atomic<int> forwards{0};
  WorkerConfig wc;
  wc.forward_fault = HeldForward(hold, forwards);
  wc.drain_timeout_ms = 60'000;
  const int port = cl.StartWorker(wc);
  Client w(port);
  std::mt19937 rng(31);
  absl::StatusOr<Answer> first;
  std::thread t([&] { first = w.Generate(RandomTokens(rng, 20, 512), 2); });
  while (forwards == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::thread stopper([&] { cl.worker(0).Shutdown(); });
  // Once health says NOT_SERVING the worker takes no new request.
  auto health_stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::health::v1::HealthCheckResponse::ServingStatus status = grpc::health::v1::HealthCheckResponse::SERVING;
  for (int i = 0; i < 5000 && status == grpc::health::v1::HealthCheckResponse::SERVING; ++i) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckResponse resp;
    if (health_stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok()) status = resp.status();
    if (status == grpc::health::v1::HealthCheckResponse::SERVING) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(status, grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  auto refused = w.Generate(RandomTokens(rng, 20, 512), 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  std::this_thread::sleep_for(std::chrono::seconds(3));  // past the server's 2 s grace
  hold = false;
  t.join();
  stopper.join();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->output.size(), 2u);
}

// Requests beyond --max-queued-requests (queued or running) are refused
// RESOURCE_EXHAUSTED at once, and served again once the worker has room; a prompt larger
// than --max-queued-tokens can never be queued: INVALID_ARGUMENT naming tokens.
TEST(WorkerService, RequestsBeyondTheQueueBoundAreRefused) {
  Cluster cl("queue-bound");
  std::atomic<bool> hold{true};
  std::atomic<int> forwards{0};
  WorkerConfig wc;
  wc.max_queued_requests = 1;
  wc.max_queued_tokens = 64;
  wc.forward_fault = HeldForward(hold, forwards);  // the first request runs long
  Client w(cl.StartWorker(wc));
  std::mt19937 rng(5);
  absl::StatusOr<Answer> first;
  std::thread t([&] { first = w.Generate(RandomTokens(rng, 20, 512), 1); });
  while (forwards == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::mt19937 rng2(6);
  auto refused = w.Generate(RandomTokens(rng2, 20, 512), 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("--max-queued-requests"), absl::string_view::npos) << refused.status();
  hold = false;
  t.join();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(w.Generate(RandomTokens(rng2, 20, 512), 1).ok());  // room again
  auto too_long = w.Generate(RandomTokens(rng2, 100, 512), 1);
  ASSERT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument) << too_long.status();
  EXPECT_NE(too_long.status().message().find("tokens"), absl::string_view::npos) << too_long.status();
}

TEST(WorkerService, BadRequestsNameTheField) {
  Cluster cl("bad");
  WorkerConfig c;
  c.max_model_len = 256;
  Client w(cl.StartWorker(c));
  v1::GenerateRequest req;
  grpc::Status s = w.Raw(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("tokens"), std::string::npos) << s.error_message();
  req.add_tokens(1);
  req.add_tokens(512);
  s = w.Raw(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("tokens[1]=512"), std::string::npos) << s.error_message();
  req.set_tokens(1, 2);
  req.set_max_new_tokens(5000);
  s = w.Raw(req);
  EXPECT_NE(s.error_message().find("max_new_tokens"), std::string::npos) << s.error_message();
  req.set_max_new_tokens(255);
  s = w.Raw(req);
  EXPECT_NE(s.error_message().find("--max-model-len"), std::string::npos) << s.error_message();
  req.set_max_new_tokens(2);
  req.set_tenant_salt(std::string(300, 'x'));
  s = w.Raw(req);
  EXPECT_NE(s.error_message().find("tenant_salt"), std::string::npos) << s.error_message();
  // The worker still serves.
  req.clear_tenant_salt();
  EXPECT_TRUE(w.Raw(req).ok());
  WorkerConfig unknown;
  unknown.listen = "127.0.0.1:0";
  unknown.model = "no-such-model";
  EXPECT_FALSE(WorkerServer::Start(unknown).ok());
  WorkerConfig bad;
  bad.listen = "127.0.0.1:0";
  bad.offload = "sometimes";
  auto st = WorkerServer::Start(bad);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("--offload"), absl::string_view::npos);
}

// Real-shape presets run in accounting mode: hits and cost-model times, no tokens.
TEST(WorkerService, AccountingModeForRealPresets) {
  Cluster cl("acct");
  WorkerConfig c;
  c.model = "llama-3.3-70b";
  c.num_blocks = 4096;
  c.max_model_len = 65536;
  Client w(cl.StartWorker(c));
  std::mt19937 rng(3);
  const Tokens prompt = RandomTokens(rng, 8192, 128000);
  auto first = w.Generate(prompt, 4);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->resp.recomputed_tokens(), 8192u);
  EXPECT_GT(first->resp.ttft().recompute_s(), 0);
  auto second = w.Generate(prompt, 4);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->resp.gpu_hit_tokens(), 8192u - 16u);  // the last block holds the last token
  EXPECT_LT(second->resp.ttft().recompute_s(), first->resp.ttft().recompute_s());
  EXPECT_TRUE(second->output.empty());
}

// The worker registers with the router, publishes what it caches, and the router
// sends a request with the same prefix back to it.
TEST(WorkerService, RouterSeesTheWorkersCache) {
  Cluster cl("router");
  cl.StartRouter("tiny-gqa");
  WorkerConfig c;
  c.instance_id = "worker-r";
  Client w(cl.StartWorker(c));
  std::mt19937 rng(9);
  const Tokens prompt = RandomTokens(rng, 100, 512);
  ASSERT_TRUE(w.Generate(prompt, 2).ok());
  auto rc = router::RouterClient::Connect(cl.router_address());
  ASSERT_TRUE(rc.ok());
  // Events flow asynchronously: poll (bounded) until the index has the blocks.
  v1::RouteResponse route;
  for (int i = 0; i < 100; ++i) {
    v1::RouteRequest req;
    req.mutable_model()->set_name("tiny-gqa");
    for (uint32_t t : prompt) req.add_tokens(t);
    auto r = (*rc)->Route(req);
    ASSERT_TRUE(r.ok()) << r.status();
    route = *r;
    if (route.gpu_hit_blocks() > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(route.instance_id(), "worker-r");
  EXPECT_EQ(route.gpu_hit_blocks(), 6u);  // 100 tokens: 6 full blocks of 16

  // A stopped worker unregisters: the router has no worker until the restarted one
  // (same id, new port, empty cache) registers; its full dump replaces what the router
  // knew, so the prefix is no longer predicted there.
  cl.StopWorkers();
  {
    v1::RouteRequest req;
    req.mutable_model()->set_name("tiny-gqa");
    for (uint32_t t : prompt) req.add_tokens(t);
    auto r = (*rc)->Route(req);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << "routed to a stopped worker";
  }
  const int port2 = cl.StartWorker(c);
  ASSERT_NE(port2, 0);
  for (int i = 0; i < 100; ++i) {
    v1::RouteRequest req;
    req.mutable_model()->set_name("tiny-gqa");
    for (uint32_t t : prompt) req.add_tokens(t);
    auto r = (*rc)->Route(req);
    if (absl::IsUnavailable(r.status())) {  // not registered yet
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    ASSERT_TRUE(r.ok()) << r.status();
    route = *r;
    if (route.instance_address() == absl::StrCat("127.0.0.1:", port2) && route.gpu_hit_blocks() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(route.instance_address(), absl::StrCat("127.0.0.1:", port2));
  EXPECT_EQ(route.gpu_hit_blocks(), 0u);
  Client w2(port2);
  auto again = w2.Generate(prompt, 2);
  ASSERT_TRUE(again.ok()) << again.status();
}


// Concurrent requests are batched into shared engine steps; each answer still equals
// the request run alone. The Prometheus endpoint reports what happened.
TEST(WorkerService, ConcurrentRequestsBatchAndMatchAlone) {
  Cluster cl("batch");
  std::mt19937 rng(21);
  std::vector<Tokens> prompts = PrefixFamily(rng, 4, 2, 16, 512);
  const std::vector<Tokens> more = PrefixFamily(rng, 4, 1, 16, 512);
  prompts.insert(prompts.end(), more.begin(), more.end());
  const std::vector<Answer> want = Oracle(cl, "tiny-gqa", prompts);
  WorkerConfig c;
  c.instance_id = "worker-batch";
  c.metrics_port = 0;
  auto server = WorkerServer::Start([&] {
    c.listen = "127.0.0.1:0";
    return c;
  }());
  ASSERT_TRUE(server.ok()) << server.status();
  Client w((*server)->port());
  std::vector<absl::StatusOr<Answer>> got(prompts.size(), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i) {
    threads.emplace_back([&, i] { got[i] = w.Generate(prompts[i], 2); });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    EXPECT_EQ(got[i]->output, want[i].output) << "prompt " << i;
    EXPECT_EQ(got[i]->digest, want[i].digest) << "prompt " << i;
    EXPECT_GE(got[i]->resp.ttft().total_s(), got[i]->resp.ttft().recompute_s());
  }
  httplib::Client http("127.0.0.1", (*server)->metrics_port());
  auto res = http.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_NE(res->body.find("kvpool_worker_requests_total{status=\"ok\"} 8"), std::string::npos) << res->body;
  EXPECT_NE(res->body.find("kvpool_worker_kv_cache_usage_perc"), std::string::npos);
  EXPECT_NE(res->body.find("kvpool_worker_prefix_cache_queries_total"), std::string::npos);
}

// Write-back with duplicate copies of a block. A prompt of exactly two blocks, sent
// twice: the second hits block 0 and recomputes block 1 (its last token must be
// computed) into a second copy. Filler prompts then reuse the older copy's page (no
// event: the newer copy keeps the hash) and finally the newer one (the removed event).
// The pool must get the newer copy's bytes: worker B fetches both blocks and must
// answer exactly like a recompute-only worker.
TEST(WorkerService, WriteBackPutsTheLastCopyOfADuplicatedBlock) {
  Cluster cl("dup");
  const std::string a = cl.StartNode("pool-a", 8 << 20, 0);
  ASSERT_FALSE(a.empty());
  std::mt19937 rng(7);
  const Tokens p = RandomTokens(rng, 32, 512);  // 2 full blocks of 16
  const Tokens probe = Concat(p, RandomTokens(rng, 3, 512));
  const std::vector<Answer> want = Oracle(cl, "tiny-gqa", {probe});

  WorkerConfig wa;
  wa.instance_id = "worker-a";
  wa.pool_nodes = {a};
  wa.offload = "write-back";
  wa.num_blocks = 12;
  Client worker_a(cl.StartWorker(wa));
  ASSERT_TRUE(worker_a.Generate(p, 1).ok());
  auto second = worker_a.Generate(p, 1);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->resp.gpu_hit_tokens(), 16u);  // block 1 now has two copies
  ASSERT_EQ(second->resp.recomputed_tokens(), 16u);
  for (int i = 0; i < 16; ++i) ASSERT_TRUE(worker_a.Generate(RandomTokens(rng, 16, 512), 1).ok());

  WorkerConfig wb = wa;
  wb.instance_id = "worker-b";
  wb.fetch = "always";
  wb.num_blocks = 64;
  Client worker_b(cl.StartWorker(wb));
  auto got = worker_b.Generate(probe, 2);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->resp.pool_hit_tokens(), 32u);
  EXPECT_EQ(got->output, want[0].output);
  EXPECT_EQ(got->digest, want[0].digest);
}

// Hybrid + write-back: a KDA checkpoint shares its hash with the KV block ending at its
// boundary. The block must still reach the pool with its parent (the pool evicts
// leaf-first and the router rebuilds chains from parents).
TEST(WorkerService, WriteBackKeepsTheParentOfCheckpointBoundaryBlocks) {
  Cluster cl("hybrid-wb");
  const std::string a = cl.StartNode("pool-a", 64 << 20, 0);
  ASSERT_FALSE(a.empty());
  WorkerConfig wa;
  wa.model = "tiny-hybrid";
  wa.instance_id = "worker-a";
  wa.pool_nodes = {a};
  wa.offload = "write-back";
  wa.num_blocks = 24;
  Client worker_a(cl.StartWorker(wa));
  std::mt19937 rng(13);
  // 5 blocks of 64: the checkpoint at 256 tokens sits on block 3.
  ASSERT_TRUE(worker_a.Generate(RandomTokens(rng, 5 * 64 + 5, 512), 2).ok());
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(worker_a.Generate(RandomTokens(rng, 4 * 64 + 3, 512), 1).ok());

  absl::flat_hash_map<BlockHash, std::optional<BlockHash>> attn;
  absl::flat_hash_set<BlockHash> checkpoints;
  cl.node(0).core().ForEachVisible([&](const pool_node::ObjectKey& k, const std::optional<BlockHash>& parent, auto) {
    if (k.kind == StateKind::kAttnKv) attn[k.hash] = parent;
    else checkpoints.insert(k.hash);
  });
  int boundary_blocks = 0;
  for (const BlockHash& h : checkpoints) {
    auto it = attn.find(h);
    if (it == attn.end()) continue;
    ++boundary_blocks;
    EXPECT_TRUE(it->second.has_value()) << "block " << h.ToHex() << " at a checkpoint lost its parent";
  }
  EXPECT_GT(boundary_blocks, 0);
}

// A client that gives up (deadline) ends its request on the worker: the running slot
// and pages are freed instead of decoding all 4096 tokens for nobody.
TEST(WorkerService, CancelledClientAbortsItsRequest) {
  Cluster cl("cancel");
  WorkerConfig c;
  c.instance_id = "worker-c";
  c.max_model_len = 8192;
  c.metrics_port = 0;
  Client w(cl.StartWorker(c));
  std::mt19937 rng(17);
  auto stub = WorkerStub(cl.worker_port(0));
  v1::GenerateRequest req;
  for (uint32_t t : RandomTokens(rng, 40, 512)) req.add_tokens(t);
  req.set_max_new_tokens(4096);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  v1::GenerateResponse resp;
  ASSERT_EQ(stub->Generate(&ctx, req, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // Bounded poll: the engine notices at its next iteration.
  v1::WorkerStats st;
  for (int i = 0; i < 600; ++i) {
    st = w.Stats();
    if (st.load().running_requests() == 0 && st.load().waiting_requests() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(st.load().running_requests(), 0u);
  EXPECT_EQ(st.load().waiting_requests(), 0u);
  // Dropped, not run to completion (a completed request counts its prompt here).
  EXPECT_EQ(st.prefix_queries_tokens(), 0u);
  // Usable blocks: --num-blocks less the null block, as registered with the router.
  EXPECT_EQ(st.num_gpu_blocks(), static_cast<uint64_t>(c.num_blocks - 1));
  // Counted as cancelled by its client, not as a worker error.
  httplib::Client http("127.0.0.1", cl.worker(0).metrics_port());
  auto res = http.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_NE(res->body.find("kvpool_worker_requests_total{status=\"cancelled\"} 1"), std::string::npos) << res->body;
  EXPECT_NE(res->body.find("kvpool_worker_requests_total{status=\"error\"} 0"), std::string::npos) << res->body;
  // The worker still serves.
  EXPECT_TRUE(w.Generate(RandomTokens(rng, 20, 512), 2).ok());
}

// A request that must wait behind a running one (max_running 1) is fetched from the
// pool when it can start, not when it arrives: blocks fetched at arrival sat in the
// cache as free blocks, the running request's decode took their pages, and the
// request recomputed what it had fetched.
TEST(WorkerService, APoolFetchWaitsUntilItsRequestCanStart) {
  Cluster cl("fetch-when-runnable");
  const std::string a = cl.StartNode("pool-a", 32 << 20, 0);
  ASSERT_FALSE(a.empty());
  std::mt19937 rng(23);
  const Tokens prompt = Concat(RandomTokens(rng, 64, 512), RandomTokens(rng, 3, 512));  // 4 blocks + 3
  WorkerConfig wa;
  wa.instance_id = "worker-a";
  wa.pool_nodes = {a};
  Client worker_a(cl.StartWorker(wa));
  const absl::StatusOr<Answer> want = worker_a.Generate(prompt, 2);  // write-through: 4 blocks in the pool
  ASSERT_TRUE(want.ok()) << want.status();

  WorkerConfig wb = wa;
  wb.instance_id = "worker-b";
  wb.max_running = 1;
  // 66 pages: the long request below reserves 64, so 4 fetched blocks left as free
  // cache beside it would lose 2 pages to its decode.
  wb.num_blocks = 67;
  wb.fetch = "always";
  Client worker_b(cl.StartWorker(wb));
  absl::StatusOr<Answer> long_answer = absl::UnknownError("not run");
  std::thread long_request([&] { long_answer = worker_b.Generate(RandomTokens(rng, 16, 512), 1000); });
  for (int i = 0; i < 2000 && worker_b.Stats().load().running_requests() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  const absl::StatusOr<Answer> got = worker_b.Generate(prompt, 2);
  long_request.join();
  ASSERT_TRUE(long_answer.ok()) << long_answer.status();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->output, want->output);
  EXPECT_EQ(got->digest, want->digest);
  EXPECT_EQ(got->resp.pool_hit_tokens(), 64u) << "fetched blocks were evicted before the request started";
  EXPECT_EQ(got->resp.recomputed_tokens(), 3u);
}

// A hybrid prompt whose blocks are all cached here but whose KDA checkpoint is not (an
// import fills only the checkpoint it fetched: the one at 512 tokens, not the one at 256)
// fetches the pool's checkpoint at 256 tokens: strict mode computes 138 prompt tokens
// instead of all 394, replay mode fetches the 96 KiB state instead of replaying 256
// tokens. Before, nothing was looked up once the local hit covered every usable block.
TEST(WorkerService, APoolCheckpointBeforeTheLocalHitIsFetched) {
  Cluster cl("ckpt-before-hit");
  const std::string a = cl.StartNode("pool-a", 32 << 20, 0);
  ASSERT_FALSE(a.empty());
  std::mt19937 rng(29);
  const Tokens blocks9 = RandomTokens(rng, 9 * 64, 512);
  const Tokens first = Concat(blocks9, RandomTokens(rng, 5, 512));
  const Tokens second = Concat(blocks9, RandomTokens(rng, 7, 512));
  const Tokens third = Concat(Tokens(blocks9.begin(), blocks9.begin() + 6 * 64), RandomTokens(rng, 10, 512));
  const std::vector<Answer> want = Oracle(cl, "tiny-hybrid", {third});

  WorkerConfig wa;
  wa.model = "tiny-hybrid";
  wa.instance_id = "worker-a";
  wa.pool_nodes = {a};
  Client worker_a(cl.StartWorker(wa));
  // Write-through: 9 blocks and the checkpoints at 256 and 512 tokens are in the pool.
  ASSERT_TRUE(worker_a.Generate(first, 2).ok());

  for (const std::string mode : {"strict", "replay"}) {
    SCOPED_TRACE(mode);
    WorkerConfig wb = wa;
    wb.instance_id = "worker-b-" + mode;
    wb.hybrid_mode = mode;
    wb.fetch = "always";
    wb.num_blocks = 64;
    std::atomic<bool> hold{false};
    std::atomic<int> forwards{0};
    wb.forward_fault = HeldForward(hold, forwards);
    Client worker_b(cl.StartWorker(wb));
    // Fetches the blocks and the checkpoint at 512 tokens; the one at 256 is not filled.
    auto s = worker_b.Generate(second, 2);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_GT(s->resp.pool_hit_tokens(), 0u);
    const auto fetched = [&] {
      const v1::WorkerStats st = worker_b.Stats();
      return st.bytes_moved_by_tier().at("fetched_dram") + st.bytes_moved_by_tier().at("fetched_nvme");
    };
    const uint64_t before = fetched();
    // 6 blocks cached here, no checkpoint among them. While its prefill step is held, the
    // load counts what it computes after the fetch: strict 394 - 256 (it counted all 394,
    // the fetched checkpoint left out), replay 394 - 384.
    hold = true;
    const int forwards_before = forwards;
    absl::StatusOr<Answer> t;
    std::thread third_request([&] { t = worker_b.Generate(third, 2); });
    for (int i = 0; i < 30000 && forwards == forwards_before; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_GT(forwards, forwards_before) << "its step never started";
    EXPECT_EQ(worker_b.Stats().load().queued_prefill_tokens(), mode == "strict" ? 138u : 10u);
    hold = false;
    third_request.join();
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->output, want[0].output);
    EXPECT_EQ(t->digest, want[0].digest);
    EXPECT_EQ(fetched() - before, 96u * 1024) << "the checkpoint at 256 tokens was not fetched";
    if (mode == "strict") {
      EXPECT_EQ(t->resp.recomputed_tokens(), 394u - 256u);
    }
  }
}

// Polls the router until its in-flight decisions for `instance` reach `want`.
uint64_t WaitInflight(router::RouterClient& rc, const std::string& instance, uint64_t want) {
  uint64_t n = UINT64_MAX;
  for (int i = 0; i < 400; ++i) {
    auto st = rc.GetStats();
    if (st.ok()) {
      for (const v1::InstanceStats& is : st->instances()) {
        if (is.source_id() == instance) n = is.inflight_decisions();
      }
    }
    if (n == want) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return n;
}

// Routes `prompt` (tiny-gqa) until the router answers with `instance` (once the worker
// has registered; bounded), and returns that answer (an empty one if it never came).
v1::RouteResponse RouteOnceRegistered(router::RouterClient& rc, const Tokens& prompt, const std::string& instance) {
  for (int i = 0; i < 100; ++i) {
    v1::RouteRequest req;
    req.mutable_model()->set_name("tiny-gqa");
    for (uint32_t t : prompt) req.add_tokens(t);
    auto r = rc.Route(req);
    if (r.ok() && r->instance_id() == instance) return *r;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return {};
}

// Starts worker `c` (tiny-gqa) in `cl`, whose router must be up, and routes a random
// prompt of `prompt_tokens` (seed `seed`) to it once it registered: the router then
// counts that one decision in flight.
struct Routed {
  std::unique_ptr<router::RouterClient> rc;
  Tokens prompt;
  v1::RouteResponse route;
  std::unique_ptr<v1::Worker::Stub> worker;
};
Routed StartAndRouteTo(Cluster& cl, const WorkerConfig& c, uint32_t seed, size_t prompt_tokens) {
  Routed out;
  out.worker = WorkerStub(cl.StartWorker(c));
  std::mt19937 rng(seed);
  out.prompt = RandomTokens(rng, prompt_tokens, 512);
  auto rc = router::RouterClient::Connect(cl.router_address());
  EXPECT_TRUE(rc.ok()) << rc.status();
  if (!rc.ok()) return out;
  out.rc = *std::move(rc);
  out.route = RouteOnceRegistered(*out.rc, out.prompt, c.instance_id);
  EXPECT_EQ(out.route.instance_id(), c.instance_id);
  EXPECT_NE(out.route.decision_id(), 0u);
  EXPECT_EQ(WaitInflight(*out.rc, c.instance_id, 1), 1u);
  return out;
}

// The Generate of a routed `prompt` (its decision id set).
v1::GenerateRequest RoutedGenerate(const Tokens& prompt, uint32_t max_new_tokens, uint64_t decision_id) {
  v1::GenerateRequest req;
  for (uint32_t t : prompt) req.add_tokens(t);
  req.set_max_new_tokens(max_new_tokens);
  req.set_router_decision_id(decision_id);
  return req;
}

// A routed request that fails on the worker (it cannot fit even alone) releases the
// router's decision, so the router stops counting phantom load on the worker.
TEST(WorkerService, FailedRoutedRequestReleasesItsDecision) {
  Cluster cl("decision");
  cl.StartRouter("tiny-gqa");
  WorkerConfig c;
  c.instance_id = "worker-d";
  c.num_blocks = 4;  // 3 pages of 16 tokens
  Routed r = StartAndRouteTo(cl, c, 19, 100);
  ASSERT_NE(r.rc, nullptr);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  EXPECT_FALSE(r.worker->Generate(&ctx, RoutedGenerate(r.prompt, 2, r.route.decision_id()), &resp).ok());  // 3 pages
  EXPECT_EQ(WaitInflight(*r.rc, "worker-d", 0), 0u);
}

// A routed request is counted once by the router: its decision is released by the
// heartbeat whose load counts the request, while the request is still in prefill (here
// held in its forward pass). Before, the decision was released only once prefill was
// done, and meanwhile the router counted the request in the load and in flight.
TEST(WorkerService, ARoutedRequestIsCountedOnceWhileItsPrefillRuns) {
  Cluster cl("decision-once");
  cl.StartRouter("tiny-gqa");
  std::atomic<bool> hold{true};
  std::atomic<int> forwards{0};
  WorkerConfig c;
  c.instance_id = "worker-once";
  c.forward_fault = HeldForward(hold, forwards);
  Routed r = StartAndRouteTo(cl, c, 23, 40);
  ASSERT_NE(r.rc, nullptr);
  grpc::Status status;
  std::thread t([&] {
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    status = r.worker->Generate(&ctx, RoutedGenerate(r.prompt, 1, r.route.decision_id()), &resp);
  });
  while (forwards == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // Prefill is held: the heartbeats report the request as running and release the decision.
  const uint64_t inflight = WaitInflight(*r.rc, "worker-once", 0);
  hold = false;
  t.join();
  EXPECT_EQ(inflight, 0u) << "the decision stayed in flight while the load already counted its request";
  EXPECT_TRUE(status.ok()) << status.error_message();
}

// Prefill has no max_new_tokens field: its length error must not name one.
TEST(WorkerService, PrefillLengthErrorNamesItsOwnFields) {
  Cluster cl("prefill-len");
  WorkerConfig c;
  c.max_model_len = 64;
  cl.StartWorker(c);
  auto stub = WorkerStub(cl.worker_port(0));
  const grpc::Status s = PrefillOfLength(*stub, 64);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message().find("max_new_tokens"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("--max-model-len=64"), std::string::npos) << s.error_message();
}

// A request that could never fit the worker's arena is refused up front, naming its own
// fields and --num-blocks: it used to fail on the engine thread in the runner's terms
// (prompt_tokens, num_blocks; max_new_tokens even for a Prefill), or, on a real-shape
// preset (accounting), as RESOURCE_EXHAUSTED, as if a retry could help.
TEST(WorkerService, RequestLargerThanTheArenaNamesItsFields) {
  for (const std::string model : {"tiny-gqa", "llama-3.3-70b"}) {
    SCOPED_TRACE(model);
    Cluster cl("arena-" + model);
    WorkerConfig c;
    c.model = model;
    c.num_blocks = 4;  // 3 pages of 16 (tiny-gqa) or llama's block tokens
    cl.StartWorker(c);
    auto stub = WorkerStub(cl.worker_port(0));
    grpc::Status s = PrefillOfLength(*stub, 1000);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_EQ(s.error_message().find("max_new_tokens"), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("tokens (1000)"), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("--num-blocks=4"), std::string::npos) << s.error_message();
    s = GenerateOfLength(*stub, 1000, 2);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find("max_new_tokens (2)"), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("--num-blocks=4"), std::string::npos) << s.error_message();
    s = GenerateOfLength(*stub, 8, 2);  // one that fits still runs
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
}

// A hybrid real-shape preset (accounting mode) counts its KDA state pages too: a prompt
// whose blocks fit the arena but not with its state is refused up front (it used to pass
// and fail as RESOURCE_EXHAUSTED on the engine thread); one that fits with it runs.
TEST(WorkerService, HybridPromptCountsItsStatePages) {
  Cluster cl("arena-hybrid");
  WorkerConfig c;
  c.model = "kimi-k3";  // 64-token blocks; one KDA state is 123 pages
  c.num_blocks = 127;   // 126 pages: 123 for the state, 3 blocks
  cl.StartWorker(c);
  auto stub = WorkerStub(cl.worker_port(0));
  const grpc::Status too_long = PrefillOfLength(*stub, 4 * 64);
  EXPECT_EQ(too_long.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << too_long.error_message();
  EXPECT_NE(too_long.error_message().find("--num-blocks=127"), std::string::npos) << too_long.error_message();
  const grpc::Status fits = PrefillOfLength(*stub, 3 * 64);
  EXPECT_TRUE(fits.ok()) << fits.error_message();
}

// Flags that used to be taken and fail later (a registration the router refuses
// forever, pool connections refused forever, metrics quietly off) are refused naming
// the flag; --pool-nodes entries are trimmed (placement hashes them as written).
TEST(WorkerFlags, RefusedNamingTheFlag) {
  auto parse = [](std::vector<std::string> args) {
    args.insert(args.begin(), "kvpool-worker");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return ParseWorkerFlags(static_cast<int>(argv.size()), argv.data());
  };
  auto cfg = parse({"--pool-nodes", "10.0.0.1:50061, 10.0.0.2:50061 ,"});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->pool_nodes, (std::vector<std::string>{"10.0.0.1:50061", "10.0.0.2:50061"}));
  for (const auto& [args, flag] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--pool-nodes", "10.0.0.1:50061,pool-b"}, "--pool-nodes"},
           {{"--offload", "write-back"}, "--offload"},
           {{"--fetch", "always"}, "--fetch"},
           {{"--max-queued-requests", "1000001"}, "--max-queued-requests"}}) {
    auto bad = parse(args);
    ASSERT_FALSE(bad.ok()) << flag;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find(flag), absl::string_view::npos) << bad.status();
  }
  EXPECT_TRUE(parse({"--offload", "off"}).ok());

  auto refused_at_start = [](WorkerConfig c, const std::string& flag) {
    c.listen = "127.0.0.1:0";
    c.model = "tiny-gqa";
    auto w = WorkerServer::Start(c);
    ASSERT_FALSE(w.ok()) << flag;
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << w.status();
    EXPECT_NE(w.status().message().find(flag), absl::string_view::npos) << w.status();
  };
  WorkerConfig c;
  c.metrics_port = -1;
  c.instance_id = "worker 1";
  refused_at_start(c, "--instance-id");
  c.instance_id = std::string(200, 'w');
  refused_at_start(c, "--instance-id");
  c.instance_id = "";
  c.router = "127.0.0.1:1";
  c.advertise = "worker-host";
  refused_at_start(c, "--advertise");
  c.router = "";
  c.advertise = "";
  c.metrics_port = -7;
  refused_at_start(c, "--metrics-port");
  c.metrics_port = -1;
  c.drain_timeout_ms = -1;
  refused_at_start(c, "--drain-timeout-ms");
  EXPECT_FALSE(parse({"--drain-timeout-ms", "-5"}).ok());
}

// A request's prefix hit splits into local and pool tokens by position: the local
// prefix at admission first, then the blocks fetched after it. When fetched blocks are
// evicted before the prefill step the hit is shorter from its end, and the pool share
// shrinks (before, min(fetched, hit) counted the local prefix as fetched).
TEST(SplitPrefixHit, ByPositionInThePrefix) {
  auto split = [](int64_t hit, int64_t local, int64_t fetched) {
    const HitSplit s = SplitPrefixHit(hit, local, fetched);
    return std::pair{s.gpu_tokens, s.pool_tokens};
  };
  EXPECT_EQ(split(80, 32, 48), (std::pair<int64_t, int64_t>{32, 48}));   // as fetched
  EXPECT_EQ(split(64, 32, 48), (std::pair<int64_t, int64_t>{32, 32}));   // the last fetched block evicted
  EXPECT_EQ(split(16, 32, 48), (std::pair<int64_t, int64_t>{16, 0}));    // a local block evicted
  EXPECT_EQ(split(112, 32, 48), (std::pair<int64_t, int64_t>{64, 48}));  // longer: cached by others meanwhile
  EXPECT_EQ(split(48, 48, 0), (std::pair<int64_t, int64_t>{48, 0}));     // nothing fetched
  EXPECT_EQ(split(0, 0, 0), (std::pair<int64_t, int64_t>{0, 0}));
}

}  // namespace
}  // namespace kvpool::worker
