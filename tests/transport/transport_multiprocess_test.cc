// Two processes: this test is the initiator (a worker), transport_peer the owner (a pool
// node) or another initiator. Covers page runs verified byte for byte across processes,
// an owner killed mid-batch (error, and the initiator keeps serving with another owner),
// and an initiator killed mid-stream (the owner keeps serving others).
#include <gtest/gtest.h>

#include <signal.h>

#include <atomic>
#include <iostream>
#include <chrono>
#include <numeric>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "kvpool/transport/transport.h"
#include "test_util.h"
#include "transport_test_util.h"

namespace kvpool::transport {
namespace {

using testing::Await;
using testing::Child;
using testing::FillPattern;
using testing::FirstMismatch;
using testing::SpansOf;
using testing::FromHex;

constexpr uint64_t kPage = 16384;
constexpr uint64_t kPages = 256;  // 4 MiB owner arena

struct Mode {
  const char* name;
  const char* tls;
};

struct Owner {
  Child child;
  std::string address;
  RemoteArena arena;
};

// Spawns an owner whose arena holds pattern `seed` at arena offsets.
::testing::AssertionResult StartOwner(Owner& o, const char* tls, uint64_t seed) {
  if (!o.child.Start({KVPOOL_TRANSPORT_PEER, "owner", std::to_string(kPages),
                      std::to_string(kPage), std::to_string(seed), tls, "auto"})) {
    return ::testing::AssertionFailure() << "cannot spawn " << KVPOOL_TRANSPORT_PEER;
  }
  std::string a = o.child.ReadLine(), r = o.child.ReadLine();
  if (!absl::StartsWith(a, "ADDR ") || !absl::StartsWith(r, "ARENA ")) {
    return ::testing::AssertionFailure() << "owner did not start: '" << a << "' '" << r << "'";
  }
  o.address = FromHex(a.substr(5));
  auto parsed = RemoteArena::Parse(FromHex(r.substr(6)));
  if (!parsed.ok()) return ::testing::AssertionFailure() << parsed.status();
  o.arena = *parsed;
  return ::testing::AssertionSuccess();
}

class MultiProcessTest : public ::testing::TestWithParam<Mode> {
 protected:
  void SetUp() override {
    ContextOptions co;
    co.ucx_config.push_back({"TLS", GetParam().tls});
    WorkerOptions wo;
    wo.batch_timeout = absl::Seconds(3);
    auto ctx = Context::Create(co);
    ASSERT_TRUE(ctx.ok()) << ctx.status();
    auto w = Worker::Create(*ctx, wo);
    ASSERT_TRUE(w.ok()) << w.status();
    worker_ = std::move(*w);
    auto a = worker_->AllocateArena(64 * kPage, kPage);
    ASSERT_TRUE(a.ok()) << a.status();
    local_ = *a;
  }

  std::shared_ptr<Endpoint> ConnectTo(const Owner& o) {
    auto ep = worker_->Connect(o.address, "owner");
    EXPECT_TRUE(ep.ok()) << ep.status();
    if (!ep.ok()) return nullptr;
    EXPECT_TRUE((*ep)->ImportArena(o.arena).ok());
    return *ep;
  }

  std::unique_ptr<Worker> worker_;
  std::shared_ptr<Arena> local_;
};

TEST_P(MultiProcessTest, PageRunsMoveBothWaysByteForByte) {
  Owner o;
  ASSERT_TRUE(StartOwner(o, GetParam().tls, 77));
  auto ep = ConnectTo(o);
  ASSERT_NE(ep, nullptr);
  // Get: scattered owner pages into local pages in another order.
  const std::vector<uint64_t> rp = {200, 3, 150, 151, 152, 9, 255, 0};
  std::vector<uint64_t> lp(rp.size());
  std::iota(lp.rbegin(), lp.rend(), 10);
  ASSERT_TRUE(Await(ep->Get({{{local_->id(), lp, 0}, {o.arena.arena_id, rp, 0}}})).ok());
  for (size_t k = 0; k < rp.size(); ++k) {
    ASSERT_EQ(FirstMismatch(local_->Page(lp[k]), 77, rp[k] * kPage), -1) << "page " << k;
  }
  // Put: an object of 5.5 pages (pattern 5 at object offsets) into scattered pages, plus
  // a second object in the same batch; the owner checks its own memory.
  const uint64_t bytes = 5 * kPage + kPage / 2;
  const std::vector<uint64_t> src = {30, 31, 40, 41, 42, 50};
  const std::vector<uint64_t> dst = {17, 90, 91, 4, 120, 121};
  uint64_t off = 0;
  for (auto s : testing::SpansOf(*local_, {local_->id(), src, bytes})) {
    FillPattern(s, 5, off);
    off += s.size();
  }
  FillPattern(local_->Page(60), 6, 0);
  ASSERT_TRUE(Await(ep->Put({{{local_->id(), src, bytes}, {o.arena.arena_id, dst, bytes}},
                             {{local_->id(), {60}, 0}, {o.arena.arena_id, {199}, 0}}}))
                  .ok());
  // Only the first bytes of the last page were written: check the full pages + the
  // object's half page separately through the owner's check (whole pages), so check the
  // five full pages here and the single-page object.
  ASSERT_TRUE(o.child.WriteLine(absl::StrCat("check 5 ", absl::StrJoin(std::vector<uint64_t>(dst.begin(), dst.end() - 1), " "))));
  EXPECT_EQ(o.child.ReadLine(), "ok");
  ASSERT_TRUE(o.child.WriteLine("check 6 199"));
  EXPECT_EQ(o.child.ReadLine(), "ok");
  // The tail page: get it back and compare the written half and the untouched half.
  ASSERT_TRUE(Await(ep->Get({{{local_->id(), {61}, 0}, {o.arena.arena_id, {121}, 0}}})).ok());
  EXPECT_EQ(FirstMismatch(local_->Page(61).first(kPage / 2), 5, 5 * kPage), -1);
  EXPECT_EQ(FirstMismatch(local_->Page(61).subspan(kPage / 2), 77, 121 * kPage + kPage / 2), -1);
  o.child.WriteLine("quit");
  EXPECT_EQ(o.child.Wait(), 0);
}

// The owner dies while a batch is in flight: that batch (or, if it won the race, the
// next one) fails within the batch timeout; the initiator keeps working with another
// owner.
TEST_P(MultiProcessTest, OwnerKilledMidBatchFailsAndOthersStillServe) {
  Owner a, b;
  ASSERT_TRUE(StartOwner(a, GetParam().tls, 1));
  ASSERT_TRUE(StartOwner(b, GetParam().tls, 2));
  auto ea = ConnectTo(a);
  auto eb = ConnectTo(b);
  ASSERT_NE(ea, nullptr);
  ASSERT_NE(eb, nullptr);
  std::vector<uint64_t> pages(64);
  std::iota(pages.begin(), pages.end(), 0);
  const TransferOp big{{local_->id(), pages, 0}, {a.arena.arena_id, pages, 0}};
  ASSERT_TRUE(Await(ea->Get({big})).ok());
  std::vector<std::future<absl::Status>> inflight;
  for (int i = 0; i < 4; ++i) inflight.push_back(ea->Get({big}));
  a.child.Kill();
  int failed = 0;
  for (auto& f : inflight) failed += !Await(std::move(f)).ok();
  // Over shared memory the owner's pid is looked at most once a millisecond: a batch
  // may still complete just after the death (its bytes land in the mapped segment), so
  // keep going until one fails, within a bound.
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (failed == 0 && absl::Now() < end) failed += !Await(ea->Get({big})).ok();
  EXPECT_GT(failed, 0) << "no batch failed after the owner was killed";
  EXPECT_FALSE(ea->health().ok());
  // The survivor serves the other owner.
  const TransferOp other{{local_->id(), pages, 0}, {b.arena.arena_id, pages, 0}};
  ASSERT_TRUE(Await(eb->Get({other})).ok());
  for (uint64_t p = 0; p < 64; ++p) ASSERT_EQ(FirstMismatch(local_->Page(p), 2, p * kPage), -1);
  b.child.WriteLine("quit");
  EXPECT_EQ(b.child.Wait(), 0);
}

// An initiator dies mid-stream: the owner keeps serving other initiators.
TEST_P(MultiProcessTest, InitiatorKilledOwnerKeepsServing) {
  Owner o;
  ASSERT_TRUE(StartOwner(o, GetParam().tls, 3));
  Child client;
  ASSERT_TRUE(client.Start({KVPOOL_TRANSPORT_PEER, "client", GetParam().tls, "auto",
                            testing::ToHex(o.address), testing::ToHex(o.arena.Serialize())}));
  ASSERT_EQ(client.ReadLine(), "running");
  client.Kill();  // in the middle of its put/get loop
  auto ep = ConnectTo(o);
  ASSERT_NE(ep, nullptr);
  FillPattern(local_->Page(0), 8, 0);
  ASSERT_TRUE(Await(ep->Put({{{local_->id(), {0}, 0}, {o.arena.arena_id, {250}, 0}}})).ok());
  ASSERT_TRUE(o.child.WriteLine("check 8 250"));
  EXPECT_EQ(o.child.ReadLine(), "ok");
  ASSERT_TRUE(Await(ep->Get({{{local_->id(), {1}, 0}, {o.arena.arena_id, {251}, 0}}})).ok());
  EXPECT_EQ(FirstMismatch(local_->Page(1), 3, 251 * kPage), -1);
  o.child.WriteLine("quit");
  EXPECT_EQ(o.child.Wait(), 0);
}

// An owner that stalls in the middle of a get, on an endpoint UCX cannot force-close
// (active messages over same-host shared memory: no peer failure detection): the batch
// fails at its deadline, and once the owner resumes nothing more lands in the caller's
// pages, which it may have reused. Before, a reply over 1 MiB came by rendezvous, received
// straight into the pages by a request UCX cannot cancel: the rest of it landed after the
// failure. Skips only when UCX gives these lanes peer failure detection, or when the owner
// could not be stopped mid-transfer in five tries.
TEST(MultiProcessStall, AGetThatTimedOutWritesNothingAfterwards) {
  ContextOptions co;
  co.ucx_config.push_back({"TLS", "posix,sysv,self"});
  WorkerOptions wo;
  wo.protocol = Protocol::kActiveMessage;
  wo.batch_timeout = absl::Seconds(1);
  auto ctx = Context::Create(co);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  auto worker = Worker::Create(*ctx, wo);
  ASSERT_TRUE(worker.ok()) << worker.status();
  // One 64 MiB page (cut into messages), and 1,024 pages of 48 KiB taken in reverse
  // order (no two adjacent: each its own segment, gathered into messages).
  struct Layout {
    uint64_t pages, page_bytes;
  };
  int layouts_stalled = 0;
  for (const Layout& l : {Layout{1, uint64_t{64} << 20}, Layout{1024, 48 << 10}}) {
    SCOPED_TRACE(absl::StrCat(l.pages, " pages of ", l.page_bytes, " bytes"));
    const uint64_t total = l.pages * l.page_bytes;
    auto local = (*worker)->AllocateArena(total, l.page_bytes);
    ASSERT_TRUE(local.ok()) << local.status();
    const std::span<std::byte> all((*local)->base(), total);
    std::vector<uint64_t> local_pages(l.pages), remote_pages(l.pages);
    std::iota(local_pages.begin(), local_pages.end(), 0);
    for (uint64_t k = 0; k < l.pages; ++k) remote_pages[k] = l.pages - 1 - k;
    bool stalled = false;
    for (int attempt = 0; attempt < 5 && !stalled; ++attempt) {
      Owner o;
      ASSERT_TRUE(o.child.Start({KVPOOL_TRANSPORT_PEER, "owner", std::to_string(l.pages),
                                 std::to_string(l.page_bytes), "5", "posix,sysv,self", "am"}));
      const std::string a = o.child.ReadLine(), r = o.child.ReadLine();
      ASSERT_TRUE(absl::StartsWith(a, "ADDR ") && absl::StartsWith(r, "ARENA ")) << a << " " << r;
      auto arena = RemoteArena::Parse(FromHex(r.substr(6)));
      ASSERT_TRUE(arena.ok()) << arena.status();
      auto ep = (*worker)->Connect(FromHex(a.substr(5)), "owner");
      ASSERT_TRUE(ep.ok()) << ep.status();
      ASSERT_TRUE((*ep)->ImportArena(*arena).ok());
      ASSERT_EQ((*ep)->protocol(), Protocol::kActiveMessage);
      if ((*ep)->peer_failure_detection()) GTEST_SKIP() << "UCX detects peer failure on these lanes: it can cancel";
      FillPattern(all, 9, 0);
      std::future<absl::Status> f =
          (*ep)->Get({{{(*local)->id(), local_pages, 0}, {arena->arena_id, remote_pages, 0}}});
      // Stop the owner once the first bytes landed; let what it already sent drain.
      const absl::Time give_up = absl::Now() + absl::Seconds(5);
      while (FirstMismatch(all.subspan(0, 64), 9, 0) < 0 && absl::Now() < give_up &&
             f.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
        std::atomic_thread_fence(std::memory_order_acquire);
      }
      kill(o.child.pid(), SIGSTOP);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      std::atomic_thread_fence(std::memory_order_acquire);
      const bool partial = FirstMismatch(all.subspan(total - 64), 9, total - 64) < 0;  // the tail not yet
      if (!partial || f.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
        kill(o.child.pid(), SIGCONT);
        (void)Await(std::move(f));
        o.child.WriteLine("quit");
        o.child.Wait();
        continue;  // it all landed before the stop: try again
      }
      stalled = true;
      EXPECT_FALSE(Await(std::move(f)).ok()) << "the stalled get succeeded";
      FillPattern(all, 11, 0);  // the caller reuses its pages
      kill(o.child.pid(), SIGCONT);
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the owner sends the rest
      std::atomic_thread_fence(std::memory_order_acquire);
      EXPECT_EQ(FirstMismatch(all, 11, 0), -1) << "bytes of the failed get landed after it failed";
      o.child.Kill();
    }
    if (stalled) {
      ++layouts_stalled;
    } else {
      std::cout << "[ NOTE ] " << l.pages << " pages of " << l.page_bytes
                << " bytes: the get finished before the owner could be stopped, 5 times\n";
    }
  }
  if (layouts_stalled == 0) GTEST_SKIP() << "no get could be stopped mid-transfer (5 tries per layout)";
}

INSTANTIATE_TEST_SUITE_P(Transports, MultiProcessTest,
                         ::testing::Values(Mode{"Shm", "sm,self"}, Mode{"Tcp", "tcp"}),
                         [](const ::testing::TestParamInfo<Mode>& i) {
                           return std::string(i.param.name);
                         });

}  // namespace
}  // namespace kvpool::transport
