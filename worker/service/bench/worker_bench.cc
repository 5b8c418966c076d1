// worker_bench: what a pool hit is worth on this machine. In one process: two pool nodes
// (UCX, DRAM tier), worker A computes prompts and writes their blocks through to the
// pool, then the same prompts go to worker B (fetches from the pool: --fetch always) and
// worker C (no pool: recomputes). Reports TTFT of each and the ratio recompute / fetch,
// per prompt length, and checks the outputs are identical (the invariant).
//
//   worker_bench [--model tiny-gqa] [--lengths 512,1024,2048] [--reps 3] [--json]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <random>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "kvpool/common/cli_flags.h"
#include "kvpool/common/service_main.h"
#include "kvpool/pool_node/node_server.h"
#include "kvpool/v1/worker.grpc.pb.h"
#include "kvpool/worker/service/worker_server.h"
#include "nlohmann/json.hpp"

namespace kvpool::worker {
namespace {

struct Run {
  double ttft_s = 0, fetch_s = 0, recompute_s = 0;
  uint32_t pool_tokens = 0, recomputed = 0;
  std::string digest;
};

absl::StatusOr<Run> Generate(v1::Worker::Stub& stub, const std::vector<uint32_t>& prompt) {
  v1::GenerateRequest req;
  for (uint32_t t : prompt) req.add_tokens(t);
  req.set_max_new_tokens(1);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  grpc::Status s = stub.Generate(&ctx, req, &resp);
  if (!s.ok()) return absl::UnknownError(s.error_message());
  return Run{resp.ttft().total_s(), resp.ttft().pool_fetch_s(), resp.ttft().recompute_s(),
             resp.pool_hit_tokens(), resp.recomputed_tokens(), resp.hidden_digest()};
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main(int argc, char** argv) {
  std::string model = "tiny-gqa";
  std::vector<int> lengths = {512, 1024, 2048};
  int reps = 3;
  bool json = false;
  CLI::App app{"worker_bench: TTFT with the prefix fetched from a pool node vs recomputed"};
  app.add_option("--model", model, "tiny-gqa, tiny-mla or tiny-hybrid");
  app.add_option("--lengths", lengths, "prompt lengths, tokens")->delimiter(',');
  app.add_option("--reps", reps, "prompts per length")->check(CLI::Range(1, 100));
  app.add_flag("--json", json, "print JSON");
  kvpool::RequireDecimalIntegers(app);
  CLI11_PARSE(app, argc, argv);

  std::vector<std::unique_ptr<pool_node::NodeServer>> nodes;
  std::vector<std::string> addrs;
  for (const char* id : {"bench-pool-a", "bench-pool-b"}) {
    pool_node::NodeConfig c;
    c.listen = "127.0.0.1:0";
    c.metrics_port = -1;
    c.pool.node_id = id;
    c.pool.dram_bytes = 512ull << 20;
    auto n = pool_node::NodeServer::Start(c);
    if (!n.ok()) {
      std::cerr << "worker_bench: " << n.status() << "\n";
      return 1;
    }
    addrs.push_back(absl::StrCat("127.0.0.1:", (*n)->port()));
    nodes.push_back(*std::move(n));
  }
  const int max_len = *std::max_element(lengths.begin(), lengths.end());
  auto start = [&](const std::string& id, bool pool, const std::string& fetch) {
    WorkerConfig c;
    c.listen = "127.0.0.1:0";
    c.instance_id = id;
    c.model = model;
    c.max_model_len = max_len + 8;
    c.num_blocks = 2048;
    if (pool) c.pool_nodes = addrs;
    c.fetch = fetch;
    return WorkerServer::Start(c);
  };
  auto a = start("bench-a", true, "auto");
  auto b = start("bench-b", true, "always");
  auto c = start("bench-c", false, "never");
  if (!a.ok() || !b.ok() || !c.ok()) {
    std::cerr << "worker_bench: cannot start the workers\n";
    return 1;
  }
  auto stub = [](int port) {
    return v1::Worker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  };
  auto sa = stub((*a)->port()), sb = stub((*b)->port()), sc = stub((*c)->port());
  std::mt19937 rng(1);
  nlohmann::ordered_json out;
  out["model"] = model;
  out["what"] = "TTFT of a prompt whose full blocks come from a pool node (worker B) vs recomputed (worker C)";
  bool identical = true;
  for (int len : lengths) {
    std::vector<double> fetch_ttft, recompute_ttft, fetch_only;
    uint32_t pool_tokens = 0;
    for (int r = 0; r < reps; ++r) {
      std::vector<uint32_t> prompt(static_cast<size_t>(len));
      for (auto& t : prompt) t = rng() % 512;
      auto wa = Generate(*sa, prompt);  // computes and writes through
      auto wb = Generate(*sb, prompt);  // fetches
      auto wc = Generate(*sc, prompt);  // recomputes
      if (!wa.ok() || !wb.ok() || !wc.ok()) {
        std::cerr << "worker_bench: a request failed\n";
        return 1;
      }
      identical = identical && wb->digest == wc->digest && wa->digest == wc->digest;
      fetch_ttft.push_back(wb->ttft_s);
      fetch_only.push_back(wb->fetch_s);
      recompute_ttft.push_back(wc->ttft_s);
      pool_tokens = wb->pool_tokens;
    }
    const double f = Median(fetch_ttft), rc = Median(recompute_ttft);
    out["points"].push_back({{"prompt_tokens", len}, {"pool_hit_tokens", pool_tokens},
                             {"ttft_fetch_s", f}, {"pool_fetch_s", Median(fetch_only)},
                             {"ttft_recompute_s", rc}, {"recompute_over_fetch", rc / f}});
    if (!json) {
      std::cout << len << " tokens: TTFT fetched " << f * 1e3 << " ms (pool fetch " << Median(fetch_only) * 1e3
                << " ms, " << pool_tokens << " tokens from the pool) vs recomputed " << rc * 1e3 << " ms: "
                << rc / f << "x\n";
    }
  }
  out["outputs_identical"] = identical;
  if (json) std::cout << out.dump(2) << "\n";
  if (!json) std::cout << "outputs identical: " << (identical ? "yes" : "NO") << "\n";
  return identical ? 0 : 1;
}

}  // namespace
}  // namespace kvpool::worker

int main(int argc, char** argv) {
  kvpool::InitProcess();
  return kvpool::worker::Main(argc, argv);
}
