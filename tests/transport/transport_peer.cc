// A second process for the multi-process transport tests.
//
//   transport_peer owner <pages> <page_bytes> <seed> <tls|-> <protocol>
//     Allocates an arena filled with pattern <seed> at arena offsets, prints
//     "ADDR <hex>" and "ARENA <hex>", then serves and answers stdin commands:
//       check <seed> <page>...   -> "ok" | "bad <page index> <byte>"   (pattern at object
//                                   offsets: page k of the list holds bytes k*page_bytes..)
//       quit                     -> exits 0 (EOF too)
//   transport_peer client <tls|-> <protocol> <addr hex> <arena hex>
//     Connects to an owner and puts + gets 16 pages in a loop, printing "running" after
//     the first round trip; runs until killed, or until a batch fails ("failed <msg>").
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kvpool/transport/transport.h"
#include "test_util.h"

using namespace kvpool::transport;
using namespace kvpool::transport::testing;

namespace {

ContextOptions Ctx(const std::string& tls) {
  ContextOptions o;
  if (tls != "-") o.ucx_config.push_back({"TLS", tls});
  return o;
}

WorkerOptions Opts(const std::string& protocol) {
  WorkerOptions o;
  o.protocol = protocol == "rma" ? Protocol::kRma
               : protocol == "am" ? Protocol::kActiveMessage
                                  : Protocol::kAuto;
  o.batch_timeout = absl::Seconds(10);
  return o;
}

int Owner(uint64_t pages, uint64_t page_bytes, uint64_t seed, const std::string& tls,
          const std::string& protocol) {
  auto ctx = Context::Create(Ctx(tls));
  if (!ctx.ok()) { std::cerr << ctx.status() << "\n"; return 2; }
  auto w = Worker::Create(*ctx, Opts(protocol));
  if (!w.ok()) { std::cerr << w.status() << "\n"; return 2; }
  auto arena = (*w)->AllocateArena(pages * page_bytes, page_bytes);
  if (!arena.ok()) { std::cerr << arena.status() << "\n"; return 2; }
  FillPattern({(*arena)->base(), (*arena)->size()}, seed, 0);
  std::cout << "ADDR " << ToHex((*w)->address()) << "\n"
            << "ARENA " << ToHex((*arena)->descriptor().Serialize()) << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.empty()) continue;
    if (f[0] == "quit") break;
    if (f[0] == "check" && f.size() >= 2) {
      uint64_t s = 0;
      (void)absl::SimpleAtoi(f[1], &s);
      std::string answer = "ok";
      for (size_t k = 2; k < f.size(); ++k) {
        uint64_t p = 0;
        if (!absl::SimpleAtoi(f[k], &p) || p >= (*arena)->num_pages()) {
          answer = "bad page";
          break;
        }
        const int64_t m = FirstMismatch((*arena)->Page(p), s, (k - 2) * page_bytes);
        if (m >= 0) {
          answer = "bad " + std::to_string(k - 2) + " " + std::to_string(m);
          break;
        }
      }
      std::cout << answer << std::endl;
    }
  }
  return 0;
}

int Client(const std::string& tls, const std::string& protocol, const std::string& addr,
           const std::string& arena_hex) {
  auto ctx = Context::Create(Ctx(tls));
  if (!ctx.ok()) { std::cerr << ctx.status() << "\n"; return 2; }
  auto w = Worker::Create(*ctx, Opts(protocol));
  if (!w.ok()) { std::cerr << w.status() << "\n"; return 2; }
  auto remote = RemoteArena::Parse(FromHex(arena_hex));
  if (!remote.ok()) { std::cerr << remote.status() << "\n"; return 2; }
  auto local = (*w)->AllocateArena(16 * remote->page_bytes, remote->page_bytes);
  if (!local.ok()) { std::cerr << local.status() << "\n"; return 2; }
  auto ep = (*w)->Connect(FromHex(addr), "owner");
  if (!ep.ok()) { std::cerr << ep.status() << "\n"; return 2; }
  if (auto s = (*ep)->ImportArena(*remote); !s.ok()) { std::cerr << s << "\n"; return 2; }
  TransferOp op;
  for (uint64_t i = 0; i < 16; ++i) {
    op.local.pages.push_back(i);
    op.remote.pages.push_back(i % remote->num_pages());
  }
  op.local.arena_id = (*local)->id();
  op.remote.arena_id = remote->arena_id;
  for (uint64_t round = 0;; ++round) {
    absl::Status s = (*ep)->Put({op}).get();
    if (s.ok()) s = (*ep)->Get({op}).get();
    if (!s.ok()) {
      std::cout << "failed " << s << std::endl;
      return 1;
    }
    if (round == 0) std::cout << "running" << std::endl;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> a(argv + 1, argv + argc);
  if (a.size() == 6 && a[0] == "owner") {
    uint64_t pages = 0, pb = 0, seed = 0;
    if (!absl::SimpleAtoi(a[1], &pages) || !absl::SimpleAtoi(a[2], &pb) ||
        !absl::SimpleAtoi(a[3], &seed)) {
      return 64;
    }
    return Owner(pages, pb, seed, a[4], a[5]);
  }
  if (a.size() == 5 && a[0] == "client") return Client(a[1], a[2], a[3], a[4]);
  std::cerr << "usage: see the comment at the top of transport_peer.cc\n";
  return 64;
}
