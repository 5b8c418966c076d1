// A real multi-process kvpool cluster on loopback: kvpool-router, two kvpool-node pool
// nodes (small DRAM, an NVMe tier in a temp dir, so blocks demote) and two kvpool-worker
// instances with few GPU blocks (so blocks are evicted and come back from the pool).
//
//   (a) a separate recompute-only worker (--no-prefix-cache, no pool) answers every
//       request: the reference output tokens and hidden digests;
//   (b) the cluster answers the same requests (Route -> instance_address -> Generate):
//       every output equals the reference, and hits were seen on GPU, DRAM and NVMe;
//   (c) a worker is SIGKILLed mid-run and restarted with the same id and port: it
//       rejoins (the router lists it) and requests routed to it are answered correctly;
//   (d) a pool node is SIGKILLed mid-run: later requests still equal the reference.
//
// The binaries are started with fork/exec on ports picked free at run time; every
// process gets PR_SET_PDEATHSIG and is stopped in TearDown (TERM, bounded wait, KILL).
// Waits are bounded polls; nothing asserts on time.
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kvpool/v1/pool.grpc.pb.h"
#include "kvpool/v1/router.grpc.pb.h"
#include "kvpool/v1/worker.grpc.pb.h"

namespace kvpool {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr char kModel[] = "tiny-gqa";
constexpr uint32_t kVocab = 512;      // tiny-gqa
constexpr int kPrefixes = 10;         // shared prefixes ...
constexpr int kSuffixes = 10;         // ... times distinct suffixes = 100 requests
constexpr int kPrefixTokens = 256;    // 16 blocks of 16 tokens
constexpr int kSuffixTokens = 48;     // 3 blocks
constexpr uint32_t kMaxNewTokens = 4;
constexpr int kWorkerBlocks = 64;     // ~3 prompts: older prefixes leave the GPU
constexpr char kPoolDram[] = "2MiB";  // 64 pages of 32 KiB per node: demotion to NVMe
constexpr char kPoolNvme[] = "64MiB";
constexpr char kPageBytes[] = "32768";  // tiny-gqa block bytes
constexpr auto kStartWait = std::chrono::seconds(90);
constexpr auto kRpcDeadline = std::chrono::seconds(300);

// ---- processes ---------------------------------------------------------------------------

class Child {
 public:
  Child(std::string name, std::string binary, std::vector<std::string> args, std::string log)
      : name_(std::move(name)), binary_(std::move(binary)), args_(std::move(args)), log_(std::move(log)) {}
  ~Child() { Stop(); }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  const std::string& name() const { return name_; }
  const std::string& log() const { return log_; }
  pid_t pid() const { return pid_; }

  // fork + exec; stdout and stderr append to the log. Only async-signal-safe calls
  // between fork and exec (the test process has gRPC threads).
  ::testing::AssertionResult Start() {
    if (pid_ > 0) return ::testing::AssertionFailure() << name_ << " already running";
    std::vector<std::string> argv_s = {binary_};
    argv_s.insert(argv_s.end(), args_.begin(), args_.end());
    std::vector<char*> argv;
    for (auto& s : argv_s) argv.push_back(s.data());
    argv.push_back(nullptr);
    {
      std::ofstream f(log_, std::ios::app);
      f << "# " << absl::StrJoin(argv_s, " ") << "\n";
    }
    const int fd = ::open(log_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return ::testing::AssertionFailure() << "cannot open " << log_;
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      ::close(fd);
      return ::testing::AssertionFailure() << "fork failed for " << name_;
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test
      if (::getppid() != parent) ::_exit(127);
      const int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) ::dup2(devnull, 0);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::setpgid(0, 0);  // a terminal's Ctrl-C reaches the test, whose TearDown stops us
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(fd);
    pid_ = pid;
    exited_ = false;
    return ::testing::AssertionSuccess();
  }

  bool Alive() {
    if (pid_ <= 0 || exited_) return false;
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exited_ = true;
      exit_status_ = status;
      return false;
    }
    return r == 0;
  }

  std::string ExitDescription() const {
    if (!exited_) return "running";
    if (WIFEXITED(exit_status_)) return absl::StrCat("exited with code ", WEXITSTATUS(exit_status_));
    if (WIFSIGNALED(exit_status_)) return absl::StrCat("killed by signal ", WTERMSIG(exit_status_));
    return "ended";
  }

  // SIGKILL and reap (a crash, as the scenario wants it).
  void Kill() {
    if (!Alive()) return;
    ::kill(pid_, SIGKILL);
    Reap();
  }

  // SIGTERM, up to 15 s for a clean exit, then SIGKILL.
  void Stop() {
    if (!Alive()) {
      pid_ = -1;
      return;
    }
    ::kill(pid_, SIGTERM);
    const auto deadline = Clock::now() + std::chrono::seconds(15);
    while (Clock::now() < deadline && Alive()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (Alive()) {
      std::fprintf(stderr, "[cluster_test] %s ignored SIGTERM for 15 s; SIGKILL\n", name_.c_str());
      ::kill(pid_, SIGKILL);
    }
    Reap();
  }

  std::string LogTail(size_t lines) const {
    std::ifstream f(log_);
    std::deque<std::string> tail;
    std::string line;
    while (std::getline(f, line)) {
      tail.push_back(line);
      if (tail.size() > lines) tail.pop_front();
    }
    std::string out;
    for (const auto& l : tail) absl::StrAppend(&out, "    ", l, "\n");
    return out;
  }

 private:
  void Reap() {
    if (pid_ > 0 && !exited_) {
      int status = 0;
      if (::waitpid(pid_, &status, 0) == pid_) exit_status_ = status;
      exited_ = true;
    }
    pid_ = -1;
  }

  std::string name_, binary_;
  std::vector<std::string> args_;
  std::string log_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int exit_status_ = 0;
};

// A port nothing listens on now (bind to :0, read it back, close). Ports already handed
// out in this process are never handed out again.
int PickFreePort() {
  static std::vector<int> used;
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) return -1;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof(a);
    int port = -1;
    if (::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
        ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port = ntohs(a.sin_port);
    }
    ::close(s);
    if (port > 0 && std::find(used.begin(), used.end(), port) == used.end()) {
      used.push_back(port);
      return port;
    }
  }
  return -1;
}

std::shared_ptr<grpc::Channel> Channel(const std::string& addr) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  return grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args);
}

template <typename T>
void SetDeadline(grpc::ClientContext& ctx, T d) {
  ctx.set_deadline(std::chrono::system_clock::now() + d);
}

// ---- the workload --------------------------------------------------------------------------

struct Request {
  int prefix = 0, suffix = 0;
  std::vector<uint32_t> tokens;
  std::string id() const { return absl::StrCat("p", prefix, "-s", suffix); }
};

struct Output {
  std::vector<uint32_t> tokens;
  std::string digest;
  bool operator==(const Output&) const = default;
};

std::string Describe(const Output& o) {
  return absl::StrCat("tokens [", absl::StrJoin(o.tokens, ","), "] digest ", absl::BytesToHexString(o.digest));
}

// 10 shared prefixes x 10 suffixes from a fixed seed. Order: pairs of requests on the same
// prefix (the second one hits the GPU copy the first left), prefixes in rotation (so by
// the next pair on a prefix its blocks left the worker's 64 GPU blocks and come back from
// the pool, some from NVMe).
std::vector<Request> MakeWorkload() {
  std::mt19937_64 rng(0x6b7670'6f6f6cULL);  // "kvpool"
  auto draw = [&rng](int n) {
    std::vector<uint32_t> v(static_cast<size_t>(n));
    for (auto& t : v) t = static_cast<uint32_t>(rng() % kVocab);
    return v;
  };
  std::vector<std::vector<uint32_t>> prefixes;
  for (int p = 0; p < kPrefixes; ++p) prefixes.push_back(draw(kPrefixTokens));
  std::vector<std::vector<std::vector<uint32_t>>> suffixes(kPrefixes);
  for (int p = 0; p < kPrefixes; ++p) {
    for (int s = 0; s < kSuffixes; ++s) suffixes[static_cast<size_t>(p)].push_back(draw(kSuffixTokens));
  }
  std::vector<Request> out;
  for (int round = 0; round < kSuffixes / 2; ++round) {
    for (int p = 0; p < kPrefixes; ++p) {
      for (int k = 0; k < 2; ++k) {
        Request r;
        r.prefix = p;
        r.suffix = 2 * round + k;
        r.tokens = prefixes[static_cast<size_t>(p)];
        const auto& suf = suffixes[static_cast<size_t>(p)][static_cast<size_t>(r.suffix)];
        r.tokens.insert(r.tokens.end(), suf.begin(), suf.end());
        out.push_back(std::move(r));
      }
    }
  }
  return out;
}

// ---- the fixture ---------------------------------------------------------------------------

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = absl::StrCat((tmp != nullptr && *tmp != '\0') ? tmp : "/tmp", "/kvpool-cluster-test-XXXXXX");
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << "mkdtemp " << tmpl;
    dir_ = tmpl;
    std::fprintf(stderr, "[cluster_test] run dir %s\n", dir_.c_str());
    ASSERT_TRUE(fs::exists(KVPOOL_ROUTER_BIN)) << KVPOOL_ROUTER_BIN;
    ASSERT_TRUE(fs::exists(KVPOOL_NODE_BIN)) << KVPOOL_NODE_BIN;
    ASSERT_TRUE(fs::exists(KVPOOL_WORKER_BIN)) << KVPOOL_WORKER_BIN;
  }

  void TearDown() override {
    // Reverse start order: workers, pool nodes, router.
    for (auto it = children_.rbegin(); it != children_.rend(); ++it) (*it)->Stop();
    if (HasFailure()) {
      for (const auto& c : children_) {
        std::fprintf(stderr, "[cluster_test] ---- %s (%s) last lines ----\n%s", c->name().c_str(), c->log().c_str(),
                     c->LogTail(25).c_str());
      }
      std::fprintf(stderr, "[cluster_test] logs kept in %s\n", dir_.c_str());
    } else if (!dir_.empty()) {
      std::error_code ec;
      fs::remove_all(dir_, ec);
    }
    children_.clear();
  }

  Child* Spawn(const std::string& name, const std::string& binary, std::vector<std::string> args) {
    children_.push_back(std::make_unique<Child>(name, binary, std::move(args), absl::StrCat(dir_, "/", name, ".log")));
    return children_.back().get();
  }

  // Bounded wait for SERVING on the standard health service; fails early (with the log
  // tail) when the process exits.
  ::testing::AssertionResult WaitServing(Child* c, const std::string& addr) {
    auto stub = grpc::health::v1::Health::NewStub(Channel(addr));
    const auto deadline = Clock::now() + kStartWait;
    std::string last = "no answer";
    while (Clock::now() < deadline) {
      if (!c->Alive()) {
        return ::testing::AssertionFailure() << c->name() << " " << c->ExitDescription() << " during start-up; log:\n"
                                             << c->LogTail(30);
      }
      grpc::ClientContext ctx;
      SetDeadline(ctx, std::chrono::seconds(1));
      grpc::health::v1::HealthCheckRequest req;
      grpc::health::v1::HealthCheckResponse resp;
      const grpc::Status st = stub->Check(&ctx, req, &resp);
      if (st.ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
        return ::testing::AssertionSuccess();
      }
      last = st.ok() ? absl::StrCat("status ", resp.status()) : st.error_message();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return ::testing::AssertionFailure() << c->name() << " not SERVING on " << addr << " (last: " << last
                                         << "); log:\n"
                                         << c->LogTail(30);
  }

  ::testing::AssertionResult StartAndWait(Child* c, const std::string& addr) {
    auto r = c->Start();
    if (!r) return r;
    return WaitServing(c, addr);
  }

  static std::vector<std::string> WorkerArgs(const std::string& id, const std::string& addr, int blocks) {
    return {"--listen",        addr,
            "--instance-id",   id,
            "--model",         kModel,
            "--num-blocks",    std::to_string(blocks),
            "--max-running",   "4",
            "--max-model-len", "1024",
            "--metrics-port",  "-1",
            "--threads",       "1"};
  }

  v1::Worker::Stub* WorkerStub(const std::string& addr) {
    auto& s = worker_stubs_[addr];
    if (!s) s = v1::Worker::NewStub(Channel(addr));
    return s.get();
  }

  static grpc::Status Generate(v1::Worker::Stub* stub, const Request& r, uint64_t decision, Output* out,
                               v1::GenerateResponse* resp) {
    v1::GenerateRequest g;
    g.set_request_id(r.id());
    g.mutable_tokens()->Add(r.tokens.begin(), r.tokens.end());
    g.set_max_new_tokens(kMaxNewTokens);
    g.set_router_decision_id(decision);
    grpc::ClientContext ctx;
    SetDeadline(ctx, kRpcDeadline);
    const grpc::Status st = stub->Generate(&ctx, g, resp);
    if (st.ok()) {
      out->tokens.assign(resp->output_tokens().begin(), resp->output_tokens().end());
      out->digest = resp->hidden_digest();
    }
    return st;
  }

  std::string dir_;
  std::vector<std::unique_ptr<Child>> children_;
  std::map<std::string, std::unique_ptr<v1::Worker::Stub>> worker_stubs_;
};

uint64_t Bytes(const v1::WorkerStats& s, const std::string& key) {
  auto it = s.bytes_moved_by_tier().find(key);
  return it == s.bytes_moved_by_tier().end() ? 0 : it->second;
}

TEST_F(ClusterTest, OutputsMatchRecomputeThroughTiersRestartAndNodeLoss) {
  const std::vector<Request> reqs = MakeWorkload();
  ASSERT_EQ(reqs.size(), static_cast<size_t>(kPrefixes * kSuffixes));

  // ---- (a) baseline: recompute only ------------------------------------------------------
  std::vector<Output> want(reqs.size());
  {
    const std::string addr = absl::StrCat("127.0.0.1:", PickFreePort());
    auto args = WorkerArgs("baseline", addr, 256);
    args.insert(args.end(), {"--no-prefix-cache", "--offload", "off"});
    Child* base = Spawn("baseline", KVPOOL_WORKER_BIN, args);
    ASSERT_TRUE(StartAndWait(base, addr));
    v1::Worker::Stub* stub = WorkerStub(addr);
    uint64_t recomputed = 0, hits = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      v1::GenerateResponse resp;
      const grpc::Status st = Generate(stub, reqs[i], 0, &want[i], &resp);
      ASSERT_TRUE(st.ok()) << "baseline " << reqs[i].id() << ": " << st.error_message();
      ASSERT_EQ(want[i].tokens.size(), kMaxNewTokens) << reqs[i].id();
      ASSERT_EQ(want[i].digest.size(), 16u) << reqs[i].id();
      recomputed += resp.recomputed_tokens();
      hits += resp.gpu_hit_tokens() + resp.pool_hit_tokens();
    }
    EXPECT_EQ(hits, 0u) << "--no-prefix-cache must recompute every prompt token";
    EXPECT_GT(recomputed, 0u);
    base->Stop();  // frees the CPU for the cluster
    worker_stubs_.erase(addr);
  }
  // Different prompts give different answers (the comparison below means something).
  EXPECT_NE(want[0].digest, want[1].digest);

  // ---- (b) the cluster ---------------------------------------------------------------------
  const std::string router_addr = absl::StrCat("127.0.0.1:", PickFreePort());
  Child* router = Spawn("router", KVPOOL_ROUTER_BIN,
                        {"--listen", router_addr, "--models", kModel, "--policy", "cache_aware", "--metrics-port",
                         "-1", "--heartbeat-interval-ms", "200"});
  ASSERT_TRUE(StartAndWait(router, router_addr));

  struct Node {
    std::string id, addr;
    Child* child = nullptr;
  };
  std::vector<Node> nodes = {{"pool-a", absl::StrCat("127.0.0.1:", PickFreePort())},
                             {"pool-b", absl::StrCat("127.0.0.1:", PickFreePort())}};
  for (auto& n : nodes) {
    const std::string nvme = absl::StrCat(dir_, "/nvme-", n.id);
    fs::create_directories(nvme);
    n.child = Spawn(n.id, KVPOOL_NODE_BIN,
                    {"--listen", n.addr, "--node-id", n.id, "--dram", kPoolDram, "--page-bytes", kPageBytes,
                     "--nvme-dir", nvme, "--nvme", kPoolNvme, "--router", router_addr, "--metrics-port", "-1"});
    ASSERT_TRUE(n.child->Start());
  }
  for (auto& n : nodes) ASSERT_TRUE(WaitServing(n.child, n.addr));
  const std::string pool_list = absl::StrCat(nodes[0].addr, ",", nodes[1].addr);

  struct Worker {
    std::string id, addr;
    std::vector<std::string> args;
    Child* child = nullptr;
  };
  std::vector<Worker> workers;
  for (int w = 0; w < 2; ++w) {
    Worker wk;
    wk.id = absl::StrCat("worker-", w);
    wk.addr = absl::StrCat("127.0.0.1:", PickFreePort());
    wk.args = WorkerArgs(wk.id, wk.addr, kWorkerBlocks);
    wk.args.insert(wk.args.end(), {"--router", router_addr, "--pool-nodes", pool_list});
    wk.child = Spawn(wk.id, KVPOOL_WORKER_BIN, wk.args);
    ASSERT_TRUE(wk.child->Start());
    workers.push_back(std::move(wk));
  }
  for (auto& wk : workers) ASSERT_TRUE(WaitServing(wk.child, wk.addr));

  auto router_stub = v1::Router::NewStub(Channel(router_addr));
  auto router_stats = [&](v1::RouterStats* out) {
    grpc::ClientContext ctx;
    SetDeadline(ctx, std::chrono::seconds(10));
    return router_stub->GetStats(&ctx, v1::GetRouterStatsRequest(), out);
  };
  // Bounded wait until the router lists `id` (registered, not stale, at `addr`).
  auto wait_listed = [&](const std::string& id, const std::string& addr) -> ::testing::AssertionResult {
    const auto deadline = Clock::now() + kStartWait;
    std::string seen;
    while (Clock::now() < deadline) {
      v1::RouterStats rs;
      if (router_stats(&rs).ok()) {
        seen.clear();
        for (const auto& in : rs.instances()) {
          absl::StrAppend(&seen, in.source_id(), "@", in.address(), in.stale() ? "(stale) " : " ");
          if (in.source_id() == id && in.address() == addr && !in.stale()) return ::testing::AssertionSuccess();
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return ::testing::AssertionFailure() << "router does not list " << id << " at " << addr << "; it lists: " << seen;
  };
  for (const auto& wk : workers) ASSERT_TRUE(wait_listed(wk.id, wk.addr));
  for (const auto& n : nodes) ASSERT_TRUE(wait_listed(n.id, n.addr));

  uint64_t gpu_hit_tokens = 0, pool_hit_tokens = 0;
  std::map<std::string, int> served;  // instance id -> requests answered
  // Route, Generate on the chosen instance, compare with the baseline.
  auto send = [&](size_t i, const std::string& policy, std::string* instance) -> ::testing::AssertionResult {
    const Request& r = reqs[i];
    v1::RouteRequest rq;
    rq.mutable_model()->set_name(kModel);
    rq.mutable_tokens()->Add(r.tokens.begin(), r.tokens.end());
    rq.set_policy(policy);
    v1::RouteResponse route;
    grpc::ClientContext ctx;
    SetDeadline(ctx, std::chrono::seconds(30));
    const grpc::Status rs = router_stub->Route(&ctx, rq, &route);
    if (!rs.ok()) return ::testing::AssertionFailure() << r.id() << ": Route: " << rs.error_message();
    Output got;
    v1::GenerateResponse resp;
    const grpc::Status gs = Generate(WorkerStub(route.instance_address()), r, route.decision_id(), &got, &resp);
    if (!gs.ok()) {
      return ::testing::AssertionFailure() << r.id() << ": Generate on " << route.instance_id() << " ("
                                           << route.instance_address() << "): " << gs.error_message();
    }
    if (!(got == want[i])) {
      return ::testing::AssertionFailure() << r.id() << " on " << route.instance_id() << " (gpu hit "
                                           << resp.gpu_hit_tokens() << ", pool hit " << resp.pool_hit_tokens()
                                           << ", recomputed " << resp.recomputed_tokens() << "): got " << Describe(got)
                                           << ", recompute-only baseline " << Describe(want[i]);
    }
    gpu_hit_tokens += resp.gpu_hit_tokens();
    pool_hit_tokens += resp.pool_hit_tokens();
    ++served[route.instance_id()];
    if (instance != nullptr) *instance = route.instance_id();
    return ::testing::AssertionSuccess();
  };
  auto worker_stats = [&](const Worker& wk, v1::WorkerStats* out) {
    grpc::ClientContext ctx;
    SetDeadline(ctx, std::chrono::seconds(30));
    return WorkerStub(wk.addr)->GetStats(&ctx, v1::GetWorkerStatsRequest(), out);
  };
  auto pool_stats = [&](const Node& n, v1::PoolStats* out) {
    auto stub = v1::PoolNode::NewStub(Channel(n.addr));
    grpc::ClientContext ctx;
    SetDeadline(ctx, std::chrono::seconds(30));
    return stub->GetStats(&ctx, v1::GetPoolStatsRequest(), out);
  };
  // Counters of processes the scenario kills, taken just before.
  uint64_t fetched_dram = 0, fetched_nvme = 0, offloaded = 0, promotions = 0, demotions = 0;
  auto add_worker = [&](const v1::WorkerStats& s) {
    fetched_dram += Bytes(s, "fetched_dram");
    fetched_nvme += Bytes(s, "fetched_nvme");
    offloaded += Bytes(s, "offloaded");
  };
  auto add_pool = [&](const v1::PoolStats& s) {
    promotions += s.promotions();
    demotions += s.demotions();
  };

  const size_t kill_worker_at = 40, restarted_checks = 10, kill_node_at = 70;
  for (size_t i = 0; i < kill_worker_at; ++i) ASSERT_TRUE(send(i, "", nullptr));

  // ---- (c) a worker crashes and comes back -------------------------------------------------
  Worker& victim = workers[1];
  {
    v1::WorkerStats s;
    ASSERT_TRUE(worker_stats(victim, &s).ok());
    add_worker(s);
  }
  victim.child->Kill();
  worker_stubs_.erase(victim.addr);  // a fresh channel to the new process
  victim.child = Spawn(victim.id + "-restarted", KVPOOL_WORKER_BIN, victim.args);
  ASSERT_TRUE(StartAndWait(victim.child, victim.addr));
  ASSERT_TRUE(wait_listed(victim.id, victim.addr));
  // Round robin so some requests must go to the restarted worker whatever its cache.
  int to_victim = 0;
  for (size_t i = kill_worker_at; i < kill_worker_at + restarted_checks; ++i) {
    std::string instance;
    ASSERT_TRUE(send(i, "round_robin", &instance));
    if (instance == victim.id) ++to_victim;
  }
  EXPECT_GT(to_victim, 0) << "no request reached the restarted " << victim.id;
  for (size_t i = kill_worker_at + restarted_checks; i < kill_node_at; ++i) ASSERT_TRUE(send(i, "", nullptr));

  // ---- (d) a pool node crashes: workers recompute what it held -----------------------------
  Node& lost = nodes[1];
  {
    v1::PoolStats s;
    ASSERT_TRUE(pool_stats(lost, &s).ok());
    add_pool(s);
  }
  lost.child->Kill();
  for (size_t i = kill_node_at; i < reqs.size(); ++i) ASSERT_TRUE(send(i, "", nullptr));

  // ---- where the hits came from --------------------------------------------------------------
  for (const auto& wk : workers) {
    v1::WorkerStats s;
    ASSERT_TRUE(worker_stats(wk, &s).ok()) << wk.id;
    add_worker(s);
  }
  {
    v1::PoolStats s;
    ASSERT_TRUE(pool_stats(nodes[0], &s).ok());
    add_pool(s);
  }
  std::string per_instance;
  for (const auto& [id, n] : served) absl::StrAppend(&per_instance, " ", id, "=", n);
  std::fprintf(stderr,
               "[cluster_test] %zu requests equal to recompute; served:%s; gpu hit tokens %llu, pool hit tokens %llu; "
               "bytes fetched DRAM %llu NVMe %llu, offloaded %llu; pool demotions %llu promotions %llu\n",
               reqs.size(), per_instance.c_str(), static_cast<unsigned long long>(gpu_hit_tokens),
               static_cast<unsigned long long>(pool_hit_tokens), static_cast<unsigned long long>(fetched_dram),
               static_cast<unsigned long long>(fetched_nvme), static_cast<unsigned long long>(offloaded),
               static_cast<unsigned long long>(demotions), static_cast<unsigned long long>(promotions));
  EXPECT_GT(gpu_hit_tokens, 0u) << "no GPU (local prefix cache) hit";
  EXPECT_GT(offloaded, 0u) << "nothing was offloaded to the pool nodes";
  EXPECT_GT(fetched_dram, 0u) << "no block came back from a pool node's DRAM";
  EXPECT_GT(demotions, 0u) << "the pool nodes never demoted to NVMe (DRAM " << kPoolDram << ")";
  EXPECT_TRUE(fetched_nvme > 0 || promotions > 0) << "no block came back from NVMe";
  EXPECT_TRUE(router->Alive()) << "the router " << router->ExitDescription();
  EXPECT_TRUE(nodes[0].child->Alive()) << "pool-a " << nodes[0].child->ExitDescription();
  for (const auto& wk : workers) EXPECT_TRUE(wk.child->Alive()) << wk.id << " " << wk.child->ExitDescription();
}

}  // namespace
}  // namespace kvpool
