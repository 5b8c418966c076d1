// transport_bench: put/get bandwidth of kvpool::transport between two processes, each
// figure next to a baseline measured in the same run.
//
//   transport_bench [--json] [--tls "sm,cma,self;tcp"] [--arena-mib 1024] [--seconds 0.4]
//                   [--rounds 3] [--cases 1MiB,16x64KiB] [--dirs put,get] [--window N]
//   (--dirs runs the directions in the order named)
//
// For each UCX_TLS setting the bench spawns itself as the owner (`--serve`, the pool node
// side, UCX_TLS in its environment) and drives it as the initiator, polling with
// Worker::Progress while its window is full (as ucx_perftest polls):
//   4KiB, 64KiB, 1MiB     one message per batch, the same buffer every time, a window of
//                         batches in flight            vs ucx_perftest, same size
//   16x64KiB              a page run of 16 scattered 64 KiB pages, same pages every time
//                         vs ucx_perftest: 1 MiB messages over shared memory (the same
//                         2 MiB footprint), 64 KiB messages over tcp (one per page)
//   256x4KiB              a batch of 256 scattered 4 KiB pages   vs ucx_perftest, 4 KiB
//                         (absolute target: >= 4 GB/s over shared memory)
//   16x64KiB_dram         page runs at random places in arenas larger than the caches
//                                                      vs memcpy of the same pages
// Baselines: ucx_perftest (ucp_put_bw / ucp_get over shared memory, ucp_am_bw over tcp,
// where UCX has no native get) runs as two processes with the same UCX_TLS, reuses one
// buffer as the rows it is compared with do, keeps as many bytes in flight (-O) and runs
// about as long, with the same error-handling mode as the transport's endpoint: over tcp
// the endpoint runs in PEER mode (a dead peer must fail its batches), so perftest gets `-e`
// and its mode-NONE figure is reported beside it (`ratio_vs_mode_none`); shared memory has
// no PEER mode in UCX 1.13, so both run without it. Each row and its baseline are
// measured `--rounds` times, alternately,
// and the best of each is kept (the least disturbed run on a shared machine).
// KVPOOL_BENCH_DEBUG=1 prints CPU seconds per measurement (both processes, both tools).
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvpool/common/service_main.h"
#include "kvpool/transport/transport.h"
#include "nlohmann/json.hpp"

namespace kvpool::transport {
namespace {

constexpr uint64_t kBig = 64 << 10;   // big arena page
constexpr uint64_t kSmall = 4 << 10;  // small arena page
constexpr uint64_t kSmallArena = 32 << 20;

std::string Hex(absl::string_view s) { return absl::BytesToHexString(s); }

// KVPOOL_BENCH_DEBUG=1: CPU seconds spent per measurement, to tell a slow path from a
// starved one on a shared machine.
bool Debug() { return getenv("KVPOOL_BENCH_DEBUG") != nullptr; }
pid_t g_owner_pid = 0;
double ProcessCpu(pid_t pid) {  // user + system seconds of a live process, all threads
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = fopen(path, "r");
  if (f == nullptr) return 0;
  char buf[1024] = {};
  const size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  const char* p = strrchr(buf, ')');  // fields after the command name
  if (p == nullptr || n == 0) return 0;
  unsigned long long utime = 0, stime = 0;
  // state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
  if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime,
             &stime) != 2) {
    return 0;
  }
  return static_cast<double>(utime + stime) / sysconf(_SC_CLK_TCK);
}

// ---- owner side --------------------------------------------------------------------
int Serve(uint64_t arena_mib) {
  auto ctx = Context::Create();
  if (!ctx.ok()) { std::cerr << ctx.status() << "\n"; return 2; }
  auto w = Worker::Create(*ctx);
  if (!w.ok()) { std::cerr << w.status() << "\n"; return 2; }
  auto big = (*w)->AllocateArena(arena_mib << 20, kBig);
  auto small = (*w)->AllocateArena(kSmallArena, kSmall);
  if (!big.ok() || !small.ok()) { std::cerr << "arena allocation failed\n"; return 2; }
  std::memset((*big)->base(), 1, (*big)->size());  // fault in: DRAM-resident, not zero pages
  std::memset((*small)->base(), 2, (*small)->size());
  std::cout << "ADDR " << Hex((*w)->address()) << "\nBIG " << Hex((*big)->descriptor().Serialize())
            << "\nSMALL " << Hex((*small)->descriptor().Serialize()) << std::endl;
  std::string line;
  while (std::getline(std::cin, line) && line != "quit") {
  }
  return 0;
}

// ---- helpers -----------------------------------------------------------------------
struct Proc {
  pid_t pid = -1;
  FILE* out = nullptr;
  FILE* in = nullptr;
};

Proc Spawn(const std::vector<std::string>& argv) {
  int to[2], from[2];
  Proc p;
  if (pipe(to) != 0 || pipe(from) != 0) return p;
  p.pid = fork();
  if (p.pid == 0) {
    dup2(to[0], 0);
    dup2(from[1], 1);
    close(to[1]);
    close(from[0]);
    std::vector<char*> a;
    for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    execvp(a[0], a.data());
    _exit(127);
  }
  close(to[0]);
  close(from[1]);
  p.in = fdopen(to[1], "w");
  p.out = fdopen(from[0], "r");
  return p;
}

std::string ReadLine(FILE* f) {
  char buf[1 << 16];
  while (fgets(buf, sizeof(buf), f) != nullptr) {
    std::string s(buf);
    if (!s.empty() && s.back() == '\n') s.pop_back();
    if (s.find(" UCX ") != std::string::npos) continue;  // UCX logs to stdout
    return s;
  }
  return "";
}

void Reap(Proc& p) {
  if (p.in) fclose(p.in);
  if (p.out) fclose(p.out);
  if (p.pid > 0) {
    int st;
    waitpid(p.pid, &st, 0);
  }
  p = Proc();
}

// ucx_perftest between two processes with the current UCX_TLS; GB/s (1e9) or -1.
// `outstanding`: its send window (-O), set to the bytes in flight of the row it is compared
// with. `seconds_hint` and `gbps_hint` size the run to last about as long as that row's
// measurement (an equal exposure to a noisy machine), within [200, 200000] iterations.
// `peer_mode`: endpoints with error handling (`-e`, UCP_ERR_HANDLING_MODE_PEER), as the
// transport's own endpoints are wherever UCX supports it.
double Perftest(const std::string& test, uint64_t size, int outstanding, int port,
                double seconds_hint, double gbps_hint, bool peer_mode) {
  uint64_t iters = (1ull << 30) / size;
  if (gbps_hint > 0) iters = static_cast<uint64_t>(seconds_hint * gbps_hint * 1e9 / size);
  iters = std::max<uint64_t>(200, std::min<uint64_t>(200000, iters));
  Proc server = Spawn({"ucx_perftest", "-p", std::to_string(port)});
  usleep(300 * 1000);
  std::vector<std::string> args = {"ucx_perftest", "-p", std::to_string(port), "-t", test, "-s",
                                   std::to_string(size), "-n", std::to_string(iters), "-w",
                                   std::to_string(iters / 4), "-O", std::to_string(outstanding)};
  if (peer_mode) args.push_back("-e");
  args.push_back("localhost");
  Proc client = Spawn(args);
  double mib_s = -1;
  char buf[4096];
  while (fgets(buf, sizeof(buf), client.out) != nullptr) {
    if (std::strncmp(buf, "Final:", 6) != 0) continue;
    std::vector<std::string> f = absl::StrSplit(buf, ' ', absl::SkipWhitespace());
    if (f.size() >= 7) (void)absl::SimpleAtod(f[6], &mib_s);  // overall bandwidth, MB/s
  }
  if (Debug() && mib_s > 0) {
    const double c = ProcessCpu(client.pid), sv = ProcessCpu(server.pid);
    const double gb = static_cast<double>(iters + iters / 4) * size / 1e9;  // + warm-up
    std::cerr << absl::StrFormat(
        "  perftest: %.2f GB at %.2f GB/s; cpu-s (whole run, setup included): client %.2f, "
        "server %.2f; %.2f cpu-s per GB\n",
        gb, mib_s * (1 << 20) / 1e9, c, sv, (c + sv) / gb);
  }
  Reap(client);
  kill(server.pid, SIGTERM);
  Reap(server);
  return mib_s < 0 ? -1 : mib_s * (1 << 20) / 1e9;  // perftest's MB is 2^20 bytes
}

// Keeps `window` batches in flight for `seconds`; GB/s.
double Run(Worker& worker, Endpoint& ep, bool put, const std::function<std::vector<TransferOp>(uint64_t)>& make,
           uint64_t bytes_per_batch, int window, double seconds) {
  struct Window {
    int inflight = 0;
    int max = 0;
    bool HasRoom() const { return inflight < max; }
    bool Empty() const { return inflight == 0; }
  };
  absl::Mutex mu;
  Window win{0, window};
  absl::Status err;
  auto phase = [&](absl::Duration d) -> std::pair<uint64_t, absl::Duration> {
    uint64_t n = 0;
    const absl::Time start = absl::Now(), end = start + d;
    while (absl::Now() < end) {
      {
        // Poll like ucx_perftest does (one thread drives each side).
        while (true) {
          {
            absl::MutexLock l(&mu);
            if (win.HasRoom()) break;
          }
          worker.Progress();
        }
        absl::MutexLock l(&mu);
        if (!err.ok()) break;
        ++win.inflight;
      }
      auto done = [&](absl::Status s) {
        absl::MutexLock l(&mu);
        --win.inflight;
        if (!s.ok() && err.ok()) err = s;
      };
      absl::Status s = put ? ep.PutAsync(make(n), done) : ep.GetAsync(make(n), done);
      if (!s.ok()) {
        absl::MutexLock l(&mu);
        --win.inflight;
        err = s;
        break;
      }
      ++n;
    }
    while (true) {
      {
        absl::MutexLock l(&mu);
        if (win.Empty()) break;
      }
      worker.Progress();
    }
    return {n, absl::Now() - start};
  };
  phase(absl::Seconds(seconds / 4));  // warm up
  rusage r0{}, r1{};
  getrusage(RUSAGE_THREAD, &r0);
  timespec c0{}, c1{}, p0{}, p1{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &p0);
  const double o0 = g_owner_pid > 0 ? ProcessCpu(g_owner_pid) : 0;
  auto [n, t] = phase(absl::Seconds(seconds));
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &p1);
  getrusage(RUSAGE_THREAD, &r1);
  if (Debug()) {
    std::cerr << absl::StrFormat("  caller thread: %d voluntary / %d involuntary switches, %d minor faults\n",
                                 r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw,
                                 r1.ru_minflt - r0.ru_minflt);
    auto secs = [](timespec a, timespec b) {
      return (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9;
    };
    const double gb = static_cast<double>(n) * bytes_per_batch / 1e9;
    const double owner = g_owner_pid > 0 ? ProcessCpu(g_owner_pid) - o0 : 0;
    std::cerr << absl::StrFormat(
        "  kvpool: %.2f GB in %.2f s; cpu-s: caller thread %.2f, initiator process %.2f, "
        "owner %.2f; %.2f cpu-s per GB\n",
        gb, absl::ToDoubleSeconds(t), secs(c0, c1), secs(p0, p1), owner,
        (secs(p0, p1) + owner) / gb);
  }
  absl::MutexLock l(&mu);
  if (!err.ok()) {
    std::cerr << "transfer failed: " << err << "\n";
    return -1;
  }
  return static_cast<double>(n) * bytes_per_batch / absl::ToDoubleSeconds(t) / 1e9;
}

struct Row {
  std::string tls, name, dir;
  uint64_t bytes_per_batch;
  double gbps;
  std::string baseline;  // what it is compared with
  double baseline_gbps;
  double target_ratio;   // 0: reported only
  double target_gbps;    // absolute target, 0: none
  // Over transports with peer-failure support (tcp): perftest without error handling
  // (mode NONE), reported next to the like-for-like PEER-mode baseline; 0: not run.
  double none_gbps = 0;
  // Each round's figure, where the row keeps them (the DRAM page runs); empty: not kept.
  std::vector<double> rounds_gbps = {}, rounds_baseline_gbps = {};
};

}  // namespace

int Main(int argc, char** argv) {
  bool json = false;
  WorkerOptions wopts;
  std::string tls_list = "sm,cma,self;tcp";
  uint64_t arena_mib = 1024;
  double seconds = 0.4;
  std::string only_cases, only_dirs;  // comma-separated filters, empty: all
  int window_override = 0;             // 0: each case's own window
  int rounds = 3;                      // measurements of each row and its baseline
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--json") json = true;
    else if (a == "--tls" && i + 1 < argc) tls_list = argv[++i];
    else if (a == "--protocol" && i + 1 < argc) {
      const std::string p = argv[++i];
      wopts.protocol = p == "rma" ? Protocol::kRma : p == "am" ? Protocol::kActiveMessage : Protocol::kAuto;
    }
    else if (a == "--arena-mib" && i + 1 < argc) (void)absl::SimpleAtoi(argv[++i], &arena_mib);
    else if (a == "--seconds" && i + 1 < argc) (void)absl::SimpleAtod(argv[++i], &seconds);
    else if (a == "--cases" && i + 1 < argc) only_cases = argv[++i];
    else if (a == "--dirs" && i + 1 < argc) only_dirs = argv[++i];
    else if (a == "--window" && i + 1 < argc) (void)absl::SimpleAtoi(argv[++i], &window_override);
    else if (a == "--rounds" && i + 1 < argc) (void)absl::SimpleAtoi(argv[++i], &rounds);
    else if (a == "--serve" && i + 1 < argc) {
      uint64_t m = 0;
      (void)absl::SimpleAtoi(argv[++i], &m);
      return Serve(m);
    } else {
      std::cerr << "usage: transport_bench [--json] [--tls 'sm,cma,self;tcp'] [--arena-mib N]"
                   " [--seconds S] [--rounds N] [--cases 1MiB,16x64KiB,...]\n"
                   "                       [--dirs put,get] [--window N]\n";
      return 64;
    }
  }
  rounds = std::max(1, rounds);
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 2;
  self[n] = 0;

  auto selected = [](const std::string& filter, absl::string_view name) {
    if (filter.empty()) return true;
    for (absl::string_view f : absl::StrSplit(filter, ',')) {
      if (f == name) return true;
    }
    return false;
  };
  std::vector<Row> rows;
  int port = 14000 + getpid() % 1000;
  for (absl::string_view tls_sv : absl::StrSplit(tls_list, ';', absl::SkipEmpty())) {
    const std::string tls(tls_sv);
    const bool shm = !absl::StrContains(tls, "tcp");
    setenv("UCX_TLS", tls.c_str(), 1);
    Proc owner = Spawn({self, "--serve", std::to_string(arena_mib)});
    g_owner_pid = owner.pid;
    std::string addr = ReadLine(owner.out), big = ReadLine(owner.out), small = ReadLine(owner.out);
    if (!absl::StartsWith(addr, "ADDR ") || !absl::StartsWith(big, "BIG ") ||
        !absl::StartsWith(small, "SMALL ")) {
      std::cerr << "owner failed to start for UCX_TLS=" << tls << "\n";
      return 2;
    }
    auto rbig = RemoteArena::Parse(absl::HexStringToBytes(big.substr(4)));
    auto rsmall = RemoteArena::Parse(absl::HexStringToBytes(small.substr(6)));
    auto ctx = Context::Create();
    auto w = Worker::Create(*ctx, wopts);
    if (!rbig.ok() || !rsmall.ok() || !ctx.ok() || !w.ok()) {
      std::cerr << "setup failed\n";
      return 2;
    }
    auto lbig = (*w)->AllocateArena(arena_mib << 20, kBig);
    auto lsmall = (*w)->AllocateArena(kSmallArena, kSmall);
    if (!lbig.ok() || !lsmall.ok()) return 2;
    std::memset((*lbig)->base(), 3, (*lbig)->size());
    std::memset((*lsmall)->base(), 4, (*lsmall)->size());
    auto ep = (*w)->Connect(absl::HexStringToBytes(addr.substr(5)), "owner");
    if (!ep.ok()) { std::cerr << ep.status() << "\n"; return 2; }
    (void)(*ep)->ImportArena(*rbig);
    (void)(*ep)->ImportArena(*rsmall);
    const uint32_t LB = (*lbig)->id(), LS = (*lsmall)->id(), RB = rbig->arena_id,
                   RS = rsmall->arena_id;
    const std::string proto(ProtocolName((*ep)->protocol()));

    // Baselines: the same UCX_TLS, two processes.
    // Where the endpoint runs in PEER mode (tcp; the issue asks for peer failure errors),
    // the baseline is perftest in PEER mode too (`-e`): in UCX 1.13 that mode takes tcp's
    // zero-copy rendezvous lanes away from both. perftest in mode NONE is reported beside it.
    const bool peer_mode = (*ep)->peer_failure_detection();
    auto pf = [&](bool put, uint64_t size, int outstanding, double gbps_hint, bool peer) {
      const std::string t = !shm ? "ucp_am_bw" : put ? "ucp_put_bw" : "ucp_get";
      return std::make_pair(t, Perftest(t, size, outstanding, port++, seconds, gbps_hint, peer));
    };

    std::mt19937_64 rng(7);
    const uint64_t big_pages = (arena_mib << 20) / kBig;
    std::vector<uint64_t> scattered16, scattered256;
    for (uint64_t i = 0; i < 16; ++i) scattered16.push_back(i * 37 % 512);
    for (uint64_t i = 0; i < 256; ++i) scattered256.push_back(i * 61 % (kSmallArena / kSmall));

    // Directions in the order --dirs names them (default: put, then get).
    std::vector<bool> dirs;
    for (absl::string_view d : absl::StrSplit(only_dirs.empty() ? "put,get" : only_dirs, ',')) {
      if (d == "put" || d == "get") dirs.push_back(d == "put");
    }
    for (bool put : dirs) {
      const std::string dir = put ? "put" : "get";
      struct Case {
        std::string name;
        uint64_t bytes;
        int window;
        uint64_t perf_size;
        std::function<std::vector<TransferOp>(uint64_t)> make;
        double target_ratio, target_gbps;
      };
      std::vector<uint64_t> seq16(16);
      for (uint64_t i = 0; i < 16; ++i) seq16[i] = i;
      std::vector<Case> cases = {
          {"4KiB", kSmall, 32, kSmall,
           [&](uint64_t) { return std::vector<TransferOp>{{{LS, {0}, 0}, {RS, {0}, 0}}}; }, 0, 0},
          {"64KiB", kBig, 16, kBig,
           [&](uint64_t) { return std::vector<TransferOp>{{{LB, {0}, 0}, {RB, {0}, 0}}}; }, 0, 0},
          // tcp: perftest streams 1 MiB messages at its best only with >= 16 in flight (at
          // -O 4 it runs at a third of that, at 3x the CPU), so both keep 16 MiB in flight.
          {"1MiB", 16 * kBig, shm ? 4 : 16, 16 * kBig,
           [&](uint64_t) { return std::vector<TransferOp>{{{LB, seq16, 0}, {RB, seq16, 0}}}; },
           0.9, 0},
          // Shared memory moves a page run as one memcpy per page: what sets its speed is
          // the 2 MiB both sides touch, so the baseline is perftest moving the same 1 MiB
          // per message (its single 64 KiB buffer would stay in L2, a cache comparison
          // rather than a transport one). Over tcp each page travels as its own 64 KiB
          // message, so perftest sends 64 KiB messages.
          {"16x64KiB", 16 * kBig, 4, shm ? 16 * kBig : kBig,
           [&](uint64_t) {
             return std::vector<TransferOp>{{{LB, scattered16, 0}, {RB, seq16, 0}}};
           },
           0.9, 0},
          {"256x4KiB", 256 * kSmall, 2, kSmall,
           [&](uint64_t) {
             std::vector<TransferOp> ops;
             ops.reserve(256);
             for (uint64_t i = 0; i < 256; ++i) ops.push_back({{LS, {i}, 0}, {RS, {scattered256[i]}, 0}});
             return ops;
           },
           0, shm ? 4.0 : 0},
      };
      for (const Case& c : cases) {
        if (!selected(only_cases, c.name)) continue;
        const int window = window_override > 0 ? window_override : c.window;
        // perftest keeps as many bytes in flight as the transport does here.
        const int outstanding =
            static_cast<int>(std::max<uint64_t>(1, window * c.bytes / c.perf_size));
        // Alternate the two, `rounds` times, and keep the best of each: on a shared
        // machine the best run is the least disturbed one, for either side.
        double g = -1, b = -1, none = 0;
        std::string t;
        for (int r = 0; r < rounds; ++r) {
          const double gr = Run(**w, **ep, put, c.make, c.bytes, window, seconds);
          auto [tr, br] = pf(put, c.perf_size, outstanding, gr, peer_mode);
          g = std::max(g, gr);
          b = std::max(b, br);
          t = tr;
          if (peer_mode) none = std::max(none, pf(put, c.perf_size, outstanding, gr, false).second);
        }
        Row row{tls, c.name, dir, c.bytes, g,
                absl::StrCat("ucx_perftest ", t, " -s ", c.perf_size, " -O ", outstanding,
                             peer_mode ? " -e" : ""),
                b, c.target_ratio, c.target_gbps};
        row.none_gbps = none;
        rows.push_back(row);
      }
      // DRAM-resident page runs vs memcpy of the same pages, in this process.
      if (!selected(only_cases, "16x64KiB_dram")) continue;
      std::vector<std::vector<uint64_t>> lruns(4096), rruns(4096);
      for (size_t r = 0; r < lruns.size(); ++r) {
        for (int i = 0; i < 16; ++i) {
          lruns[r].push_back(rng() % big_pages);
          rruns[r].push_back(rng() % big_pages);
        }
      }
      // memcpy baseline: the same page lists, local arena -> a second arena allocated the
      // same way (a fresh heap buffer measured 2-4x slower here than an arena: its pages
      // are newly backed, and random 64 KiB copies into them walk cold page tables).
      auto dst_arena = (*w)->AllocateArena(arena_mib << 20, kBig);
      if (!dst_arena.ok()) return 2;
      std::byte* const dst = (*dst_arena)->base();
      std::memset(dst, 5, (*dst_arena)->size());
      auto memcpy_run = [&] {
        uint64_t copied = 0, it = 0;
        const absl::Time start = absl::Now(), end = start + absl::Seconds(seconds);
        while (absl::Now() < end) {
          const auto& l = lruns[it % lruns.size()];
          const auto& r = rruns[it % rruns.size()];
          for (int i = 0; i < 16; ++i) {
            std::memcpy(dst + r[i] * kBig, (*lbig)->base() + l[i] * kBig, kBig);
          }
          copied += 16 * kBig;
          ++it;
        }
        return copied / absl::ToDoubleSeconds(absl::Now() - start) / 1e9;
      };
      // Alternated, `rounds` times, best of each, as for the rows above (a single run of
      // each, as before, let one disturbed second decide the row).
      double g = -1, mc = -1;
      std::vector<double> g_rounds, mc_rounds;
      for (int r = 0; r < rounds; ++r) {
        g_rounds.push_back(Run(
            **w, **ep, put,
            [&](uint64_t i) {
              return std::vector<TransferOp>{{{LB, lruns[i % lruns.size()], 0},
                                              {RB, rruns[i % rruns.size()], 0}}};
            },
            16 * kBig, 4, seconds));
        mc_rounds.push_back(memcpy_run());
        g = std::max(g, g_rounds.back());
        mc = std::max(mc, mc_rounds.back());
      }
      Row row{tls, "16x64KiB_dram", dir, 16 * kBig, g,
              absl::StrCat("memcpy of the same pages (", arena_mib, " MiB arenas)"), mc,
              shm ? 0.8 : 0, 0};
      row.rounds_gbps = std::move(g_rounds);
      row.rounds_baseline_gbps = std::move(mc_rounds);
      rows.push_back(std::move(row));
    }
    if (!json) std::cerr << "UCX_TLS=" << tls << ": endpoint protocol " << proto << "\n";
    if (getenv("KVPOOL_BENCH_DEBUG")) std::cerr << (*ep)->Describe() << "\n";
    ep->reset();
    fprintf(owner.in, "quit\n");
    fflush(owner.in);
    Reap(owner);
  }

  nlohmann::json out = nlohmann::json::array();
  for (const Row& r : rows) {
    const double ratio = r.baseline_gbps > 0 ? r.gbps / r.baseline_gbps : 0;
    nlohmann::json j = {{"ucx_tls", r.tls},      {"case", r.name},
                        {"dir", r.dir},          {"bytes_per_batch", r.bytes_per_batch},
                        {"gbps", r.gbps},        {"baseline", r.baseline},
                        {"baseline_gbps", r.baseline_gbps}, {"ratio", ratio}};
    if (!r.rounds_gbps.empty()) {
      j["rounds_gbps"] = r.rounds_gbps;
      j["rounds_baseline_gbps"] = r.rounds_baseline_gbps;
    }
    if (r.none_gbps > 0) {
      j["baseline_mode_none_gbps"] = r.none_gbps;
      j["ratio_vs_mode_none"] = r.gbps / r.none_gbps;
    }
    if (r.target_ratio > 0) {
      j["target_ratio"] = r.target_ratio;
      j["meets_ratio"] = ratio >= r.target_ratio;
    }
    if (r.target_gbps > 0) {
      j["target_gbps"] = r.target_gbps;
      j["meets_gbps"] = r.gbps >= r.target_gbps;
    }
    out.push_back(j);
  }
  if (json) {
    std::cout << nlohmann::json{{"bench", "transport_bench"}, {"unit", "GB/s (1e9 B/s)"},
                                {"rounds", rounds}, {"seconds", seconds},
                                {"results", out}}
                     .dump(2)
              << std::endl;
  } else {
    std::cout << absl::StrFormat("%-13s %-14s %-4s %9s %9s %7s %9s  %s\n", "UCX_TLS", "case",
                                 "dir", "GB/s", "base", "ratio", "vs NONE", "baseline");
    for (const Row& r : rows) {
      std::cout << absl::StrFormat("%-13s %-14s %-4s %9.2f %9.2f %7.2f %9s  %s\n", r.tls, r.name,
                                   r.dir, r.gbps, r.baseline_gbps,
                                   r.baseline_gbps > 0 ? r.gbps / r.baseline_gbps : 0,
                                   r.none_gbps > 0 ? absl::StrFormat("%.2f", r.gbps / r.none_gbps)
                                                   : std::string("-"),
                                   r.baseline);
    }
  }
  return 0;
}

}  // namespace kvpool::transport

int main(int argc, char** argv) {
  kvpool::InitProcess();
  return kvpool::transport::Main(argc, argv);
}
