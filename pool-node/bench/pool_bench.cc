// pool_bench: kvpool-node throughput and latency, each against a baseline measured in the
// same run (see pool-node/README.md for what each figure means).
//
//   put/get 1 MiB objects through the whole node path (Reserve/Lookup RPC + UCX + Commit/
//     Release) over shared memory   vs  memcpy of the same bytes spread over the arenas
//   the same over TCP loopback      vs  ucx_perftest -t ucp_am_bw (UCX_TLS=tcp)
//   NVMe tier write (demotion) and read (promotion + checksum)
//                                   vs  fio, O_DIRECT, io_uring, QD 32, same dir and bs
//   Lookup of 128 hashes over loopback gRPC: p50 / p99
//
// Node-path figures move kBatch (64) objects per Put / Lookup+Get call, as a worker does
// with a whole request's blocks; rounds are interleaved with the memcpy baseline and
// the best of each is kept (every round is printed).
//
// Usage: pool_bench [--json] [--dir /tmp] [--mib 512] [--skip-tcp] [--skip-fio]
//                   [--put-pipeline-mib 8]
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "kvpool/pool_node/client.h"
#include "kvpool/pool_node/node_server.h"
#include "kvpool/transport/transport.h"
#include "kvpool/v1/pool.grpc.pb.h"
#include <grpcpp/grpcpp.h>
#include <xxhash.h>
#include <xxh_x86dispatch.h>
#include "nlohmann/json.hpp"

namespace kvpool::pool_node {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kObject = 1 << 20;
constexpr uint64_t kPage = 64 << 10;
constexpr uint64_t kPagesPerObject = kObject / kPage;
// Objects per Put / Lookup / Get call: a worker stores and fetches a whole request's
// blocks in one call (e.g. 4096 tokens in 64-token blocks), so the bench does the same.
constexpr int kBatch = 64;
constexpr int kRounds = 3;  // node path and memcpy each measured kRounds times, best kept

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

BlockHash Hash(uint64_t round, uint64_t i) { return BlockHash{i * 0x9E3779B97F4A7C15ull + 1, round + 0x5151}; }

std::string Run(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  pclose(p);
  return out;
}

struct Node {
  std::unique_ptr<NodeServer> server;
  std::unique_ptr<transport::Worker> worker;
  std::shared_ptr<transport::Arena> arena;
  std::unique_ptr<PoolClient> client;
};

uint64_t g_put_pipeline_bytes = PoolClientOptions{}.put_pipeline_bytes;

Node StartNode(uint64_t dram, const std::string& nvme_dir, uint64_t nvme, uint64_t client_bytes) {
  Node n;
  NodeConfig cfg;
  cfg.listen = "127.0.0.1:0";
  cfg.metrics_port = -1;
  cfg.pool.page_bytes = kPage;
  cfg.pool.dram_bytes = dram;
  cfg.pool.nvme_dir = nvme_dir;
  cfg.pool.nvme_bytes = nvme;
  cfg.pool.background = false;
  auto s = NodeServer::Start(cfg);
  if (!s.ok()) {
    std::cerr << "node: " << s.status() << "\n";
    std::exit(1);
  }
  n.server = std::move(*s);
  auto ctx = transport::Context::Create();
  auto w = transport::Worker::Create(*ctx);
  n.worker = std::move(*w);
  n.arena = *n.worker->AllocateArena(client_bytes, kPage);
  std::memset(n.arena->base(), 0x3c, client_bytes);
  for (uint64_t i = 0; i < client_bytes; i += 4096) n.arena->base()[i] = std::byte(i >> 12);
  PoolClientOptions co;
  co.node_address = "127.0.0.1:" + std::to_string(n.server->port());
  co.client_id = "bench";
  co.worker = n.worker.get();
  co.local_arena = n.arena;
  co.put_pipeline_bytes = g_put_pipeline_bytes;
  auto c = PoolClient::Connect(co);
  if (!c.ok()) {
    std::cerr << "connect: " << c.status() << "\n";
    std::exit(1);
  }
  n.client = std::move(*c);
  return n;
}

// Puts then gets `objects` 1 MiB objects through the node; returns {put GB/s, get GB/s}.
std::pair<double, double> NodePath(Node& n, uint64_t objects, uint64_t round) {
  const uint64_t local_objects = n.arena->size() / kObject;
  auto local_pages = [&](uint64_t i) {
    std::vector<uint64_t> p;
    const uint64_t first = (i % local_objects) * kPagesPerObject;
    for (uint64_t k = 0; k < kPagesPerObject; ++k) p.push_back(first + k);
    return p;
  };
  const auto t0 = Clock::now();
  for (uint64_t i = 0; i < objects; i += kBatch) {
    std::vector<PutItem> items;
    for (uint64_t j = i; j < std::min(objects, i + kBatch); ++j) {
      items.push_back(PutItem{Hash(round, j), std::nullopt, StateKind::kAttnKv, local_pages(j), kObject});
    }
    auto st = n.client->Put(items);
    if (!st.ok()) {
      std::cerr << "put: " << st.status() << "\n";
      std::exit(1);
    }
  }
  const auto t1 = Clock::now();
  for (uint64_t i = 0; i < objects; i += kBatch) {
    std::vector<BlockHash> chain;
    std::vector<std::vector<uint64_t>> dst;
    for (uint64_t j = i; j < std::min(objects, i + kBatch); ++j) {
      chain.push_back(Hash(round, j));
      dst.push_back(local_pages(j + 7));
    }
    auto lease = n.client->Lookup(chain, StateKind::kAttnKv, 0, /*allow_gaps=*/true);
    if (!lease.ok() || lease->objects.size() != chain.size()) {
      std::cerr << "lookup: " << (lease.ok() ? "missing objects" : lease.status().ToString()) << "\n";
      std::exit(1);
    }
    absl::Status g = n.client->Get(*lease, dst);
    if (!g.ok()) {
      std::cerr << "get: " << g << "\n";
      std::exit(1);
    }
    n.client->ReleaseAsync(lease->lease_id);  // what a worker does: no need to wait
  }
  const auto t2 = Clock::now();
  const double bytes = static_cast<double>(objects * kObject);
  return {bytes / Seconds(t0, t1) / 1e9, bytes / Seconds(t1, t2) / 1e9};
}

// memcpy of the same bytes between the two arenas, object by object, spread like NodePath.
double Memcpy(Node& n, uint64_t objects) {
  std::byte* dst = n.server->core().arena_base();
  const uint64_t dst_objects = n.server->core().arena_bytes() / kObject;
  const uint64_t src_objects = n.arena->size() / kObject;
  static int rep = 0;
  ++rep;
  const auto t0 = Clock::now();
  for (uint64_t i = 0; i < objects; ++i) {
    std::memcpy(dst + ((i * 7 + rep) % dst_objects) * kObject, n.arena->base() + (i % src_objects) * kObject, kObject);
  }
  return 1.0 * objects * kObject / Seconds(t0, Clock::now()) / 1e9;
}

double UcxPerftestAmBw(int port) {
  const std::string env = "UCX_TLS=tcp UCX_NET_DEVICES=lo ";
  const std::string server = env + "ucx_perftest -p " + std::to_string(port) + " >/dev/null 2>&1 &";
  std::system(server.c_str());
  usleep(700000);
  const std::string out = Run(env + "ucx_perftest 127.0.0.1 -p " + std::to_string(port) +
                              " -t ucp_am_bw -s 1048576 -n 2000 -w 100 2>&1");
  // "Final:  iters  typ-lat avg-lat overh  bw-typ  bw-avg(MB/s) msgrate..."
  std::smatch m;
  std::regex final_re(R"(Final:\s+\S+\s+\S+\s+\S+\s+\S+\s+\S+\s+(\S+)\s+(\S+))");
  if (std::regex_search(out, m, final_re)) return std::stod(m[1]) * 1048576.0 / 1e9;  // bw-avg, MB/s = MiB/s
  std::cerr << "ucx_perftest output not understood:\n" << out << "\n";
  return 0;
}

double FioBandwidth(const std::string& dir, const std::string& rw, uint64_t mib) {
  const std::string cmd = absl::StrFormat(
      "fio --name=kvpool --directory=%s --rw=%s --bs=1M --direct=1 --ioengine=io_uring "
      "--iodepth=32 --size=%dM --numjobs=1 --output-format=json 2>/dev/null",
      dir, rw, mib);
  const std::string out = Run(cmd);
  try {
    auto j = nlohmann::json::parse(out.substr(out.find('{')));
    const auto& job = j["jobs"][0][rw == "write" ? "write" : "read"];
    return job["bw_bytes"].get<double>() / 1e9;
  } catch (...) {
    std::cerr << "fio output not understood:\n" << out << "\n";
    return 0;
  }
}

// NVMe tier write (demotion of DRAM objects) and read (Lookup promotion incl. checksum).
std::pair<double, double> NvmeTier(Node& n, uint64_t objects) {
  PoolCore& core = n.server->core();
  for (uint64_t i = 0; i < objects; i += kBatch) {
    std::vector<PutItem> items;
    for (uint64_t j = i; j < std::min(objects, i + kBatch); ++j) {
      std::vector<uint64_t> p;
      for (uint64_t k = 0; k < kPagesPerObject; ++k) p.push_back(((j * kPagesPerObject) + k) % n.arena->num_pages());
      items.push_back(PutItem{Hash(77, j), std::nullopt, StateKind::kAttnKv, p, kObject});
    }
    if (!n.client->Put(items).ok()) std::exit(1);
  }
  const auto t0 = Clock::now();
  const size_t moved = core.Demote(objects + 64);
  const auto t1 = Clock::now();
  if (moved != objects) std::cerr << "demoted " << moved << " of " << objects << "\n";
  // Promotion: 32 objects per Lookup, so 32 MiB per io_uring batch.
  for (uint64_t i = 0; i < objects; i += 32) {
    LookupSpec spec;
    spec.allow_gaps = true;
    for (uint64_t j = i; j < std::min(objects, i + 32); ++j) spec.hashes.push_back(Hash(77, j));
    auto a = core.Lookup(spec);
    if (!a.ok() || a->objects.size() != spec.hashes.size()) {
      std::cerr << "promotion lookup failed\n";
      std::exit(1);
    }
    (void)core.Release(a->lease_id);
  }
  const auto t2 = Clock::now();
  const double bytes = static_cast<double>(moved * kObject);
  return {bytes / Seconds(t0, t1) / 1e9, bytes / Seconds(t1, t2) / 1e9};
}

// Where the node path's time goes: the same 1 MiB page runs moved by the transport alone
// (no RPC, no checksum), and XXH3 over the same bytes.
nlohmann::json Breakdown(Node& n, uint64_t objects) {
  auto stub = kvpool::v1::PoolNode::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(n.server->port()), grpc::InsecureChannelCredentials()));
  kvpool::v1::ConnectRequest req;
  req.set_client_id("bench-raw");
  req.set_ucx_worker_address(n.worker->address());
  kvpool::v1::ConnectResponse resp;
  grpc::ClientContext ctx;
  if (!stub->Connect(&ctx, req, &resp).ok()) return {};
  auto remote = transport::RemoteArena::Parse(resp.arena_descriptor());
  auto ep = n.worker->Connect(resp.ucx_worker_address(), "raw");
  if (!remote.ok() || !ep.ok() || !(*ep)->ImportArena(*remote).ok()) return {};
  const uint64_t local_objects = n.arena->size() / kObject;
  const uint64_t remote_objects = remote->num_pages() / kPagesPerObject;
  auto ops_for = [&](uint64_t i) {
    std::vector<transport::TransferOp> ops;
    for (uint64_t j = i; j < std::min(objects, i + kBatch); ++j) {
      transport::TransferOp op;
      op.local.arena_id = n.arena->id();
      op.remote.arena_id = remote->arena_id;
      for (uint64_t k = 0; k < kPagesPerObject; ++k) {
        op.local.pages.push_back((j % local_objects) * kPagesPerObject + k);
        op.remote.pages.push_back(((j * 3) % remote_objects) * kPagesPerObject + k);
      }
      ops.push_back(std::move(op));
    }
    return ops;
  };
  const auto t0 = Clock::now();
  for (uint64_t i = 0; i < objects; i += kBatch) (void)(*ep)->Put(ops_for(i)).get();
  const auto t1 = Clock::now();
  for (uint64_t i = 0; i < objects; i += kBatch) (void)(*ep)->Get(ops_for(i)).get();
  const auto t2 = Clock::now();
  uint64_t sink = 0;
  for (uint64_t i = 0; i < objects; ++i) sink ^= XXH3_64bits_dispatch(n.arena->base() + (i % local_objects) * kObject, kObject);
  const auto t3 = Clock::now();
  const double bytes = static_cast<double>(objects * kObject);
  return {{"transport_only_put_GBps", bytes / Seconds(t0, t1) / 1e9},
          {"transport_only_get_GBps", bytes / Seconds(t1, t2) / 1e9},
          {"xxh3_GBps", bytes / Seconds(t2, t3) / 1e9 + (sink == 42 ? 1e-12 : 0)},
          {"protocol", std::string(transport::ProtocolName((*ep)->protocol()))},
          {"lanes", (*ep)->Describe()}};
}

std::pair<double, double> LookupLatency(Node& n, int iterations) {
  std::vector<PutItem> items;
  std::vector<BlockHash> chain;
  std::optional<BlockHash> parent;
  for (uint64_t i = 0; i < 128; ++i) {
    chain.push_back(Hash(99, i));
    items.push_back(PutItem{chain.back(), parent, StateKind::kAttnKv, {i % n.arena->num_pages()}, 4096});
    parent = chain.back();
  }
  for (size_t i = 0; i < items.size(); i += 32) {
    if (!n.client->Put(std::span(items).subspan(i, 32)).ok()) std::exit(1);
  }
  std::vector<double> us;
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = Clock::now();
    auto lease = n.client->Lookup(chain);
    const auto t1 = Clock::now();
    if (!lease.ok() || lease->prefix_blocks != 128) std::exit(1);
    us.push_back(Seconds(t0, t1) * 1e6);
    (void)n.client->Release(lease->lease_id);
  }
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[us.size() * 99 / 100]};
}

}  // namespace
}  // namespace kvpool::pool_node

int main(int argc, char** argv) {
  using namespace kvpool::pool_node;
  CLI::App app{"pool_bench"};
  bool json = false, skip_tcp = false, skip_fio = false;
  std::string dir = "/tmp";
  uint64_t mib = 512;
  app.add_flag("--json", json, "print one JSON object");
  app.add_option("--dir", dir, "directory for the NVMe tier and fio (O_DIRECT)");
  app.add_option("--mib", mib, "MiB moved per measurement");
  app.add_flag("--skip-tcp", skip_tcp, "skip the TCP loopback comparison");
  app.add_flag("--skip-fio", skip_fio, "skip the NVMe comparison");
  uint64_t pipeline_mib = g_put_pipeline_bytes >> 20;
  app.add_option("--put-pipeline-mib", pipeline_mib, "PoolClientOptions::put_pipeline_bytes, MiB");
  CLI11_PARSE(app, argc, argv);
  g_put_pipeline_bytes = pipeline_mib << 20;
  nlohmann::json out;
  const std::string nvme_dir = dir + "/kvpool-bench-" + std::to_string(getpid());
  std::filesystem::create_directories(nvme_dir);
  const uint64_t dram = 2 * mib << 20, client = std::min<uint64_t>(mib, 512) << 20;
  {
    Node n = StartNode(dram, "", 0, client);
    // Interleaved, so that both see the same machine load; best of kRounds each.
    double put = 0, get = 0, mc = 0;
    nlohmann::json rounds = nlohmann::json::array();
    for (int r = 0; r < kRounds; ++r) {
      auto [p, g] = NodePath(n, mib, 1 + r);
      const double m = Memcpy(n, mib);
      rounds.push_back({{"put_GBps", p}, {"get_GBps", g}, {"memcpy_GBps", m}});
      put = std::max(put, p);
      get = std::max(get, g);
      mc = std::max(mc, m);
    }
    out["shm"] = {{"object_bytes", kObject}, {"objects", mib}, {"objects_per_call", kBatch},
                  {"put_pipeline_bytes", g_put_pipeline_bytes},
                  {"put_GBps", put}, {"get_GBps", get}, {"memcpy_GBps", mc},
                  {"put_vs_memcpy", put / mc}, {"get_vs_memcpy", get / mc}, {"rounds", rounds},
                  {"method", "whole node path per call of objects_per_call objects: put = Reserve + "
                             "copy with XXH3 + Commit (node verifies XXH3), pipelined in put_pipeline_bytes pieces; "
                             "get = Lookup + copy with XXH3 check + async Release. Baseline: memcpy of the "
                             "same bytes between the same arenas, same process, interleaved with the "
                             "rounds; best of each"},
                  {"ucx_transports", "UCX_TLS as set in the environment (default: all; sm/cma on one host)"}};
    out["shm"]["breakdown"] = Breakdown(n, mib);
    auto [lp50, lp99] = LookupLatency(n, 2000);
    out["lookup_128"] = {{"p50_us", lp50}, {"p99_us", lp99}, {"iterations", 2000}};
  }
  if (!skip_fio) {
    // A fresh node whose DRAM holds exactly the objects: Demote moves all of them.
    Node n = StartNode((mib + 16) << 20, nvme_dir + "/node", (mib + 64) << 20, client);
    auto [w, r] = NvmeTier(n, mib);
    const double fw = FioBandwidth(nvme_dir, "write", mib);
    const double fr = FioBandwidth(nvme_dir, "read", mib);
    out["nvme"] = {{"dir", nvme_dir}, {"block_bytes", kObject}, {"queue_depth", 32},
                   {"tier_write_GBps", w}, {"tier_read_GBps", r}, {"fio_write_GBps", fw},
                   {"fio_read_GBps", fr}, {"write_vs_fio", fw > 0 ? w / fw : 0},
                   {"read_vs_fio", fr > 0 ? r / fr : 0},
                   {"promotions", n.server->core().Stats().promotions}};
  }
  if (!skip_tcp) {
    setenv("UCX_TLS", "tcp", 1);
    setenv("UCX_NET_DEVICES", "lo", 1);
    const uint64_t objs = std::min<uint64_t>(mib, 256);
    Node n = StartNode(dram, "", 0, client);
    double put = 0, get = 0;
    for (int r = 0; r < 2; ++r) {
      auto [p, g] = NodePath(n, objs, 10 + r);
      put = std::max(put, p);
      get = std::max(get, g);
    }
    out["tcp_breakdown"] = Breakdown(n, objs);
    double am = 0;
    for (int r = 0; r < 2; ++r) am = std::max(am, UcxPerftestAmBw(13337 + getpid() % 1000 + r));
    out["tcp"] = {{"objects", objs}, {"objects_per_call", kBatch}, {"put_GBps", put}, {"get_GBps", get},
                  {"ucx_perftest_am_bw_GBps", am},
                  {"put_vs_perftest", am > 0 ? put / am : 0}, {"get_vs_perftest", am > 0 ? get / am : 0}};
  }
  std::filesystem::remove_all(nvme_dir);
  if (json) {
    std::cout << out.dump(2) << "\n";
  } else {
    std::cout << out.dump(2) << "\n";
  }
  return 0;
}
