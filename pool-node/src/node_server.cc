#include "kvpool/pool_node/node_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvpool/common/cli_flags.h"
#include "kvpool/common/service_main.h"
#include "kvpool/common/host_port.h"
#include "kvpool/common/status.h"
#include "kvpool/common/units.h"
#include "kvpool/metrics/metrics.h"
#include "kvpool/transport/transport.h"
#include "pool_service.h"
#include "router_publisher.h"
#include "spdlog/spdlog.h"

namespace kvpool::pool_node {

namespace {
// The first number in `path` (0 when unreadable), times `unit`.
uint64_t ReadNumber(const char* path, const char* key, uint64_t unit) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (key != nullptr && line.rfind(key, 0) != 0) continue;
    const size_t at = line.find_first_of("0123456789");
    if (at == std::string::npos) return 0;
    uint64_t v = 0;
    try {
      v = std::stoull(line.substr(at));
    } catch (...) {
      return 0;
    }
    return v > UINT64_MAX / unit ? UINT64_MAX : v * unit;
  }
  return 0;
}
}  // namespace

HostMemory ReadHostMemory() {
  HostMemory h;
  h.mem_total = ReadNumber("/proc/meminfo", "MemTotal:", 1024);  // "MemTotal: N kB"
  const uint64_t shmmax = ReadNumber("/proc/sys/kernel/shmmax", nullptr, 1);
  const uint64_t shmall = ReadNumber("/proc/sys/kernel/shmall", nullptr, static_cast<uint64_t>(sysconf(_SC_PAGESIZE)));
  h.sysv_max = std::min(shmmax, shmall);
  struct statvfs vfs;
  if (statvfs("/dev/shm", &vfs) == 0) h.shm_free = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  return h;
}

absl::Status CheckDramFitsHost(uint64_t dram_bytes, const HostMemory& host) {
  if (host.mem_total != 0 && dram_bytes > host.mem_total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--dram=", dram_bytes, " (", FormatBytes(static_cast<double>(dram_bytes)),
        ") exceeds this host's memory, MemTotal=", host.mem_total, " (",
        FormatBytes(static_cast<double>(host.mem_total)), "); give a smaller --dram"));
  }
  // Above the sysv limit UCX falls back to a file in /dev/shm, which must then hold it.
  if (dram_bytes > host.sysv_max && host.shm_free && dram_bytes > *host.shm_free) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--dram=", dram_bytes, " (", FormatBytes(static_cast<double>(dram_bytes)),
        ") exceeds the sysv shared-memory limit (", host.sysv_max,
        " bytes, kernel.shmmax/shmall) and the free space of /dev/shm (", *host.shm_free, " bytes, ",
        FormatBytes(static_cast<double>(*host.shm_free)),
        "); give a smaller --dram, or raise kernel.shmmax and kernel.shmall"));
  }
  return absl::OkStatus();
}

absl::StatusOr<NodeConfig> ParseNodeFlags(int argc, char** argv) {
  NodeConfig cfg;
  CLI::App app{"kvpool-node: a pool node (DRAM + NVMe tiers over UCX, gRPC control plane)"};
  std::string dram, page = "65536", nvme = "0", quota_kv = "0", quota_lin = "0", client_cap = "0";
  app.add_option("--listen", cfg.listen, "gRPC listen address host:port");
  app.add_option("--advertise", cfg.advertise, "address announced to the router (default --listen)");
  app.add_option("--node-id", cfg.pool.node_id, "node id (default: pool-<port>)");
  app.add_option("--dram", dram, "DRAM tier size, e.g. 64GiB")->required();
  app.add_option("--page-bytes", page, "page size, a power of two >= 4096");
  app.add_option("--nvme-dir", cfg.pool.nvme_dir, "directory of the NVMe tier (O_DIRECT)");
  app.add_option("--nvme", nvme, "NVMe tier size, e.g. 1TiB");
  app.add_option("--router", cfg.router, "router host:port (optional)");
  app.add_option("--metrics-port", cfg.metrics_port, "Prometheus /metrics port (0: any, -1: off)");
  app.add_option("--lease-ms", cfg.pool.default_lease_ms, "default Lookup lease, ms");
  app.add_option("--reserve-timeout-ms", cfg.pool.reserve_timeout_ms, "reclaim uncommitted reserves after, ms");
  app.add_option("--demote-high", cfg.pool.demote_high_watermark, "start demotion above this DRAM fraction");
  app.add_option("--demote-low", cfg.pool.demote_low_watermark, "stop demotion at this DRAM fraction");
  app.add_option("--io-depth", cfg.pool.io_queue_depth, "io_uring queue depth (>= 32)");
  app.add_option("--quota-attn-kv", quota_kv, "DRAM quota for ATTN_KV objects (0: none)");
  app.add_option("--quota-linear-state", quota_lin, "DRAM quota for LINEAR_STATE objects (0: none)");
  app.add_option("--max-client-pinned", client_cap,
                 "DRAM one client may hold under leases and reservations, e.g. 8GiB (0: no cap)");
  kvpool::RequireDecimalIntegers(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return absl::CancelledError("help");
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(absl::StrCat(e.what(), "; see --help"));
  }
  cfg.node_id_given = app.count("--node-id") > 0;
  ASSIGN_OR_RETURN(cfg.pool.dram_bytes, ParseBytes(dram, "--dram"));
  RETURN_IF_ERROR(CheckDramFitsHost(cfg.pool.dram_bytes, ReadHostMemory()));
  ASSIGN_OR_RETURN(cfg.pool.page_bytes, ParseBytes(page, "--page-bytes"));
  ASSIGN_OR_RETURN(cfg.pool.nvme_bytes, ParseBytes(nvme, "--nvme"));
  ASSIGN_OR_RETURN(cfg.pool.dram_quota_bytes[0], ParseBytes(quota_kv, "--quota-attn-kv"));
  ASSIGN_OR_RETURN(cfg.pool.dram_quota_bytes[1], ParseBytes(quota_lin, "--quota-linear-state"));
  ASSIGN_OR_RETURN(cfg.pool.max_client_pinned_bytes, ParseBytes(client_cap, "--max-client-pinned"));
  if (!cfg.pool.nvme_dir.empty() && cfg.pool.nvme_bytes == 0) {
    return absl::InvalidArgumentError("--nvme-dir given without --nvme; set the NVMe tier size, e.g. --nvme=100GiB");
  }
  return cfg;
}

struct NodeServer::State {
  NodeConfig cfg;
  std::shared_ptr<transport::Context> ucx;
  std::unique_ptr<transport::Worker> worker;
  std::shared_ptr<transport::Arena> arena;
  std::unique_ptr<RouterPublisher> publisher;
  std::unique_ptr<PoolCore> core;
  MetricsRegistry metrics;
  uint64_t scrape_hook = 0;  // reads the core: removed before it goes
  std::unique_ptr<MetricsHttpServer> http;
  std::unique_ptr<PoolNodeService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::atomic<bool> shut{false};

  ~State() {
    if (core) core->RequestStop();  // a demotion pass ends while the server drains
    if (server) server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    if (service) service->Drain();  // Lookups waiting for NVMe use the core: before it goes
    http.reset();
    if (scrape_hook != 0) metrics.RemoveScrapeHook(scrape_hook);
    // The core's background thread calls the publisher (OnStored/OnRemoved from
    // demotion) and the publisher's thread reads the core (full dumps): stop the core's
    // thread first, so nothing calls the publisher once it goes, then the publisher,
    // whose thread may still read the (idle) core, then the core.
    if (core) core->StopBackground();
    publisher.reset();
    core.reset();  // lives in arena's memory
    arena.reset();
    worker.reset();
  }
};

NodeServer::NodeServer() : s_(std::make_unique<State>()) {}
NodeServer::~NodeServer() = default;

absl::StatusOr<std::unique_ptr<NodeServer>> NodeServer::Start(NodeConfig config) {
  std::unique_ptr<NodeServer> n(new NodeServer());
  State& s = *n->s_;
  s.cfg = std::move(config);
  PoolOptions& po = s.cfg.pool;
  // Without --node-id the node is named pool-<port> once the port is bound (below).
  const bool default_id = po.node_id.empty() || (!s.cfg.node_id_given && po.node_id == PoolOptions{}.node_id);
  RETURN_IF_ERROR(CheckServiceFlags({.listen = s.cfg.listen,
                                     .advertise = s.cfg.advertise,
                                     .router = s.cfg.router,
                                     .id_flag = "--node-id",
                                     .id = default_id ? "" : po.node_id,
                                     .metrics_port = s.cfg.metrics_port}));
  if (po.page_bytes < 4096 || (po.page_bytes & (po.page_bytes - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--page-bytes=", po.page_bytes,
                                                   " must be a power of two >= 4096"));
  }
  const uint64_t arena_bytes = po.dram_bytes / po.page_bytes * po.page_bytes;
  if (arena_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("--dram=", po.dram_bytes, " holds no page of --page-bytes=",
                                                   po.page_bytes));
  }
  ASSIGN_OR_RETURN(s.ucx, transport::Context::Create());
  ASSIGN_OR_RETURN(s.worker, transport::Worker::Create(s.ucx));
  ASSIGN_OR_RETURN(s.arena, s.worker->AllocateArena(arena_bytes, po.page_bytes));
  po.arena_memory = s.arena->base();

  // gRPC first: the port is part of the node's identity.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(s.cfg.listen, grpc::InsecureServerCredentials(), &s.port);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(64 << 20);
  // Reserve and Commit run on the sync server's threads. With gRPC's defaults (1..2
  // pollers) a Reserve arriving while a Commit hashes starts a thread that exits again
  // when both are done, i.e. thread churn during every pipelined Put.
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 2);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 4);
  if (!s.cfg.router.empty()) {
    // The advertised port is filled in once the server has bound it (--listen=host:0).
    s.publisher = std::make_unique<RouterPublisher>(s.cfg.router, po.node_id, s.cfg.advertise,
                                                    arena_bytes / po.page_bytes);
    po.events = s.publisher.get();
  }
  ASSIGN_OR_RETURN(s.core, PoolCore::Create(po));
  const transport::RemoteArena& desc = s.arena->descriptor();
  ConnectInfo info{po.node_id, s.worker->address(), desc.rkey, desc.Serialize(), desc.base, !default_id};
  s.service = std::make_unique<PoolNodeService>(s.core.get(), std::move(info), &s.metrics);
  builder.RegisterService(s.service.get());
  s.server = builder.BuildAndStart();
  if (s.server == nullptr || s.port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on --listen=", s.cfg.listen,
                                               "; is the port in use?"));
  }
  if (default_id) {
    po.node_id = absl::StrCat("pool-", s.port);
    s.core->SetNodeId(po.node_id);
    s.service->SetNodeId(po.node_id);
  }
  if (s.publisher) {
    s.publisher->Start(s.core.get(), AdvertiseAddress(s.cfg.listen, s.cfg.advertise, s.port), po.node_id);
  }
  PoolCore* core = s.core.get();
  MetricsRegistry* reg = &s.metrics;
  s.scrape_hook = s.metrics.AddScrapeHook([core, reg] {
    const PoolStatsSnapshot st = core->Stats();
    for (int t = 0; t < (st.has_nvme ? kNumTiers : 1); ++t) {
      const MetricLabels tier = {{"tier", t == 0 ? "dram" : "nvme"}};
      reg->GetGauge("kvpool_pool_capacity_bytes", "Tier capacity", tier).Set(st.tiers[t].capacity_bytes);
      reg->GetGauge("kvpool_pool_used_bytes", "Tier bytes in use", tier).Set(st.tiers[t].used_bytes);
      reg->GetGauge("kvpool_pool_objects", "Objects with a copy in the tier", tier).Set(st.tiers[t].objects);
      reg->GetGauge("kvpool_pool_evictions", "Evictions from the tier since start", tier).Set(st.tiers[t].evictions);
      for (int k = 0; k < kNumKinds; ++k) {
        reg->GetGauge("kvpool_pool_kind_bytes", "Tier bytes per state kind",
                      {{"tier", t == 0 ? "dram" : "nvme"}, {"kind", std::string(StateKindName(static_cast<StateKind>(k)))}})
            .Set(st.tiers[t].bytes_by_kind[k]);
      }
    }
    reg->GetGauge("kvpool_pool_active_leases", "Leases held").Set(st.active_leases);
    reg->GetGauge("kvpool_pool_pending_reservations", "Reservations not yet committed").Set(st.pending_reservations);
    reg->GetGauge("kvpool_pool_checksum_failures", "Checksum failures (Commit and NVMe read-back)").Set(st.checksum_failures);
    reg->GetGauge("kvpool_pool_demotions", "Objects demoted DRAM -> NVMe").Set(st.demotions);
    reg->GetGauge("kvpool_pool_promotions", "Objects promoted NVMe -> DRAM").Set(st.promotions);
    reg->GetGauge("kvpool_pool_nvme_held_back_bytes",
                  "NVMe bytes kept unused after a failed journal write, until the journal is rewritten")
        .Set(st.nvme_held_back_bytes);
    reg->GetGauge("kvpool_pool_dram_held_back_bytes",
                  "DRAM bytes of timed-out reservations kept unused for one more reserve timeout")
        .Set(st.dram_held_back_bytes);
  });
  if (s.cfg.metrics_port >= 0) {
    ASSIGN_OR_RETURN(s.http, MetricsHttpServer::Start(&s.metrics, "0.0.0.0", s.cfg.metrics_port));
  }
  return n;
}

int NodeServer::port() const { return s_->port; }
int NodeServer::metrics_port() const { return s_->http ? s_->http->port() : -1; }
PoolCore& NodeServer::core() { return *s_->core; }

std::string NodeServer::DescribeConfig() const {
  std::string out = s_->core->DescribeConfig();
  absl::StrAppend(&out, "  gRPC         ", s_->cfg.listen, " (port ", s_->port, "), health service on\n");
  absl::StrAppend(&out, "  metrics      ", metrics_port() >= 0 ? absl::StrCat("http://0.0.0.0:", metrics_port(), "/metrics") : "off", "\n");
  absl::StrAppend(&out, "  router       ", s_->cfg.router.empty() ? "none" : s_->cfg.router, "\n");
  // UCX's context dump is long; keep its transport/device list ("tcp/lo, cma/memory, ...").
  std::string tls;
  for (absl::string_view line : absl::StrSplit(s_->ucx->Describe(), '\n')) {
    const size_t at = line.find("flags -- ");
    if (line.find("resource") == absl::string_view::npos || at == absl::string_view::npos) continue;
    absl::StrAppend(&tls, tls.empty() ? "" : ", ", absl::StripAsciiWhitespace(line.substr(at + 9)));
  }
  absl::StrAppend(&out, "  UCX          ", tls.empty() ? "(no transports listed)" : tls,
                  "; DRAM arena registered once\n");
  return out;
}

void NodeServer::Wait() {
  while (!s_->shut.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

void NodeServer::Shutdown() { s_->shut.store(true); }

int NodeMain(int argc, char** argv) {
  return RunServiceMain("kvpool-node", ParseNodeFlags(argc, argv), &NodeServer::Start);
}

}  // namespace kvpool::pool_node
