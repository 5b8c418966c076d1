// Two UCX workers in one process moving page runs: every protocol the transport can pick
// (RMA over shared memory / CMA, active messages over shared memory and over TCP),
// verified byte for byte and through each page view.
#include "kvpool/transport/transport.h"

#include <gtest/gtest.h>

#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/utsname.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <numeric>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "../clock_step.h"  // g_realtime_offset_ns
#include "../../transport/src/internal.h"  // AmHeader, kAm*, WrapAddress: the wire format
#include "kvpool/transport/page_view.h"
#include "test_util.h"
#include "transport_test_util.h"

// Sees what UCX answers to every endpoint close in this binary (the transport library is
// linked in statically, so its calls resolve here first), then forwards to UCX.
namespace {
std::atomic<int> g_ep_close_errors{0};
}  // namespace
extern "C" ucs_status_ptr_t ucp_ep_close_nbx(ucp_ep_h ep, const ucp_request_param_t* param) {
  using Fn = ucs_status_ptr_t (*)(ucp_ep_h, const ucp_request_param_t*);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "ucp_ep_close_nbx"));
  ucs_status_ptr_t r = real(ep, param);
  if (UCS_PTR_IS_ERR(r)) g_ep_close_errors.fetch_add(1);
  return r;
}

// Fails every shmget while set: an arena allocated meanwhile falls back to UCX's own
// allocation (UCX's SysV allocator fails too, so its POSIX one serves), which peers on
// this host reach through UCX's mapping of its rkey.
std::atomic<bool> g_fail_shmget{false};
extern "C" int shmget(key_t key, size_t size, int flags) {
  using Fn = int (*)(key_t, size_t, int);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "shmget"));
  if (g_fail_shmget.load()) {
    errno = ENOSPC;
    return -1;
  }
  return real(key, size, flags);
}

// Fails the n-th send of active message g_fail_send_id from now (1-based; 0: none) at
// once, as UCX does when it cannot even start a send.
std::atomic<int> g_fail_send{0};
std::atomic<unsigned> g_fail_send_id{0};
extern "C" ucs_status_ptr_t ucp_am_send_nbx(ucp_ep_h ep, unsigned id, const void* header,
                                            size_t header_length, const void* buffer,
                                            size_t count, const ucp_request_param_t* param) {
  using Fn = ucs_status_ptr_t (*)(ucp_ep_h, unsigned, const void*, size_t, const void*, size_t,
                                  const ucp_request_param_t*);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "ucp_am_send_nbx"));
  if (id == g_fail_send_id.load() && g_fail_send.load() > 0 && g_fail_send.fetch_sub(1) == 1) {
    return UCS_STATUS_PTR(UCS_ERR_NO_RESOURCE);
  }
  return real(ep, id, header, header_length, buffer, count, param);
}

// Makes the n-th rendezvous receive started from now (1-based; 0: none) fail: the bytes
// are received, but its completion reports UCS_ERR_NO_MEMORY (or, when UCX completes it at
// once, the call returns that error), as a receive that fails on the owner's side while
// the initiator is alive. Counts those it failed.
std::atomic<int> g_fail_recv{0};
std::atomic<int> g_recv_failed{0};
namespace {
struct FailedRecv {
  ucp_am_recv_data_nbx_callback_t cb;
  void* user_data;
};
void FailRecvCb(void* request, ucs_status_t /*status*/, size_t length, void* user_data) {
  auto* f = static_cast<FailedRecv*>(user_data);
  const FailedRecv orig = *f;
  delete f;
  g_recv_failed.fetch_add(1);
  orig.cb(request, UCS_ERR_NO_MEMORY, length, orig.user_data);
}
}  // namespace
extern "C" ucs_status_ptr_t ucp_am_recv_data_nbx(ucp_worker_h worker, void* data_desc,
                                                 void* buffer, size_t count,
                                                 const ucp_request_param_t* param) {
  using Fn = ucs_status_ptr_t (*)(ucp_worker_h, void*, void*, size_t, const ucp_request_param_t*);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "ucp_am_recv_data_nbx"));
  if (g_fail_recv.load() <= 0 || g_fail_recv.fetch_sub(1) != 1 ||
      !(param->op_attr_mask & UCP_OP_ATTR_FIELD_CALLBACK)) {
    return real(worker, data_desc, buffer, count, param);
  }
  ucp_request_param_t p = *param;
  auto* f = new FailedRecv{param->cb.recv_am, param->user_data};
  p.cb.recv_am = &FailRecvCb;
  p.user_data = f;
  ucs_status_ptr_t r = real(worker, data_desc, buffer, count, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    delete f;
    if (r == nullptr) {
      g_recv_failed.fetch_add(1);
      return UCS_STATUS_PTR(UCS_ERR_NO_MEMORY);
    }
  }
  return r;
}

namespace kvpool::transport {
namespace {

using testing::Await;
using testing::FillPattern;
using testing::FirstMismatch;
using testing::SpansOf;

struct Mode {
  const char* name;
  const char* tls;
  Protocol protocol;
  Protocol expected;  // what the endpoint must end up using
};

constexpr uint64_t kOwnerPage = 4096;
constexpr uint64_t kOwnerPages = 512;
constexpr uint64_t kClientPage = 8192;
constexpr uint64_t kClientPages = 64;

class TransportTest : public ::testing::TestWithParam<Mode> {
 protected:
  void SetUp() override {
    ContextOptions co;
    co.ucx_config.push_back({"TLS", GetParam().tls});
    WorkerOptions wo;
    wo.protocol = GetParam().protocol;
    wo.batch_timeout = absl::Seconds(3);
    // Shared-memory batches of two client pages or more are copied with streaming stores
    // (a get's observer then reads a bounce piece), smaller ones with memcpy: the suite
    // runs both copy paths.
    wo.stream_copy_min_bytes = 2 * kClientPage;
    auto oc = Context::Create(co);
    ASSERT_TRUE(oc.ok()) << oc.status();
    auto cc = Context::Create(co);
    ASSERT_TRUE(cc.ok()) << cc.status();
    auto ow = Worker::Create(*oc, wo);
    ASSERT_TRUE(ow.ok()) << ow.status();
    auto cw = Worker::Create(*cc, wo);
    ASSERT_TRUE(cw.ok()) << cw.status();
    owner_ = std::move(*ow);
    client_ = std::move(*cw);
    auto oa = owner_->AllocateArena(kOwnerPages * kOwnerPage, kOwnerPage);
    ASSERT_TRUE(oa.ok()) << oa.status();
    owner_arena_ = *oa;
    client_mem_.resize(kClientPages * kClientPage);
    auto ca = client_->RegisterArena(client_mem_, kClientPage);
    ASSERT_TRUE(ca.ok()) << ca.status();
    client_arena_ = *ca;
    // The descriptor travels as bytes, as it would inside a gRPC message.
    auto remote = RemoteArena::Parse(owner_arena_->descriptor().Serialize());
    ASSERT_TRUE(remote.ok()) << remote.status();
    remote_ = *remote;
    auto ep = client_->Connect(owner_->address(), "owner");
    ASSERT_TRUE(ep.ok()) << ep.status();
    ep_ = *ep;
    ASSERT_TRUE(ep_->ImportArena(remote_).ok());
  }

  void TearDown() override {
    ep_.reset();
    client_.reset();
    owner_.reset();
  }

  PageRun Local(std::vector<uint64_t> pages, uint64_t bytes = 0) {
    return {client_arena_->id(), std::move(pages), bytes};
  }
  PageRun Remote(std::vector<uint64_t> pages, uint64_t bytes = 0) {
    return {remote_.arena_id, std::move(pages), bytes};
  }
  // The object's bytes, gathered from its pages.
  static std::vector<std::byte> Gather(const Arena& a, const PageRun& run) {
    std::vector<std::byte> out;
    auto spans = a.Spans(run);
    EXPECT_TRUE(spans.ok()) << spans.status();
    if (!spans.ok()) return out;
    for (auto s : *spans) out.insert(out.end(), s.begin(), s.end());
    return out;
  }

  std::unique_ptr<Worker> owner_, client_;
  std::shared_ptr<Arena> owner_arena_, client_arena_;
  std::vector<std::byte> client_mem_;
  RemoteArena remote_;
  std::shared_ptr<Endpoint> ep_;
};

TEST_P(TransportTest, PicksTheProtocolForTheTransport) {
  EXPECT_EQ(ep_->protocol(), GetParam().expected) << ep_->Describe();
}

// An MLA block written on the client lands in scattered owner pages of another size,
// comes back into other client pages, and reads identically through all three views.
TEST_P(TransportTest, PageRunsRoundTripThroughEveryView) {
  using Mla = MlaBlockView<uint16_t>;
  const Mla::Shape mla{.layers = 2, .tokens = 8, .entry_dim = 576};
  const uint64_t bytes = Mla::Bytes(mla);  // 18432: 2.25 client pages, 4.5 owner pages
  const PageRun src = Local({9, 2, 5}, bytes);
  const PageRun dst = Remote({40, 3, 17, 8, 22}, bytes);
  {
    auto spans = client_arena_->Spans(src);
    ASSERT_TRUE(spans.ok());
    auto v = Mla::Create(PagedBytes(*spans), mla);
    ASSERT_TRUE(v.ok()) << v.status();
    for (int l = 0; l < 2; ++l)
      for (int t = 0; t < 8; ++t)
        for (int i = 0; i < 576; ++i) v->At(l, t, i) = static_cast<uint16_t>(l * 7919 + t * 577 + i);
  }
  const std::vector<std::byte> object = Gather(*client_arena_, src);
  ASSERT_TRUE(Await(ep_->Put({{src, dst}})).ok());
  ASSERT_EQ(Gather(*owner_arena_, {owner_arena_->id(), dst.pages, bytes}), object);

  const PageRun back = Local({31, 0, 63}, bytes);
  std::memset(client_mem_.data(), 0, client_mem_.size());
  ASSERT_TRUE(Await(ep_->Get({{back, dst}})).ok());
  ASSERT_EQ(Gather(*client_arena_, back), object);

  auto spans = client_arena_->Spans(back);
  ASSERT_TRUE(spans.ok());
  PagedBytes paged(*spans);
  auto ref = [&](uint64_t elem) {
    uint16_t v;
    std::memcpy(&v, object.data() + elem * 2, 2);
    return v;
  };
  auto mv = Mla::Create(paged, mla);
  ASSERT_TRUE(mv.ok());
  for (int l = 0; l < 2; ++l)
    for (int t = 0; t < 8; ++t)
      for (int i = 0; i < 576; ++i) {
        ASSERT_EQ(mv->At(l, t, i), static_cast<uint16_t>(l * 7919 + t * 577 + i));
      }
  // The same 18432 bytes as a GQA block: 2 layers x 8 tokens x 2 heads x 144, K then V.
  auto gv = GqaBlockView<uint16_t>::Create(paged, {.layers = 2, .tokens = 8, .kv_heads = 2, .head_dim = 144});
  ASSERT_TRUE(gv.ok()) << gv.status();
  for (int l = 0; l < 2; ++l)
    for (int t = 0; t < 8; ++t)
      for (int h = 0; h < 2; ++h)
        for (int d = 0; d < 144; ++d) {
          const uint64_t e = ((l * 8 + t) * 2 + h) * 144 + d;
          ASSERT_EQ(gv->K(l, t, h, d), ref(e));
          ASSERT_EQ(gv->V(l, t, h, d), ref(4608 + e));
        }
  // ... and as a KDA checkpoint: 2 layers x 2 heads x 48 x 48.
  auto kv = KdaCheckpointView<uint16_t>::Create(paged, {.layers = 2, .heads = 2, .d_k = 48, .d_v = 48});
  ASSERT_TRUE(kv.ok()) << kv.status();
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 48; ++k)
        for (int d = 0; d < 48; ++d) {
          ASSERT_EQ(kv->At(l, h, k, d), ref(((l * 2 + h) * 48 + k) * 48 + d));
        }
}

// One batch, objects of many sizes: a single byte, partial pages, whole pages, runs that
// cross pages of both sizes; then gets of them into fresh places.
TEST_P(TransportTest, MixedSizeBatchPutThenGet) {
  struct Obj { std::vector<uint64_t> lp, rp; uint64_t bytes; };
  const std::vector<Obj> objs = {
      {{0}, {100}, 1},
      {{1}, {101, 102}, 5000},
      {{2}, {103, 104}, 0},              // 8192 = two owner pages exactly
      {{3, 4, 5}, {110, 111, 112, 113, 114, 115}, 0},
      {{6, 7}, {200, 120, 300, 130}, 16000},
      {{8}, {499}, 4096},
      {{9}, {511}, 100}};
  std::vector<TransferOp> puts, gets;
  uint64_t seed = 11;
  for (const Obj& o : objs) {
    TransferOp op{Local(o.lp, o.bytes), Remote(o.rp, o.bytes)};
    uint64_t off = 0;
    for (auto s : testing::SpansOf(*client_arena_, op.local)) {
      FillPattern(s, seed, off);
      off += s.size();
    }
    puts.push_back(op);
    std::vector<uint64_t> lp2;
    for (uint64_t p : o.lp) lp2.push_back(p + 32);
    gets.push_back({Local(lp2, o.bytes), op.remote});
    ++seed;
  }
  ASSERT_TRUE(Await(ep_->Put(puts)).ok());
  ASSERT_TRUE(Await(ep_->Get(gets)).ok());
  seed = 11;
  for (const TransferOp& op : gets) {
    uint64_t off = 0;
    for (auto s : testing::SpansOf(*owner_arena_, {owner_arena_->id(), op.remote.pages, op.remote.bytes})) {
      ASSERT_EQ(FirstMismatch(s, seed, off), -1) << "owner, object seed " << seed;
      off += s.size();
    }
    off = 0;
    for (auto s : testing::SpansOf(*client_arena_, op.local)) {
      ASSERT_EQ(FirstMismatch(s, seed, off), -1) << "client, object seed " << seed;
      off += s.size();
    }
    ++seed;
  }
  const WorkerStats st = client_->stats();
  EXPECT_EQ(st.batches_ok, 2u);
  EXPECT_EQ(st.batches_failed, 0u);
}

// Hundreds of single 4 KiB pages in a random order: several AM messages per batch, no
// coalescing possible, into a second local arena (a worker may register several).
TEST_P(TransportTest, ScatteredFourKiBPages) {
  constexpr uint64_t kN = 200;
  std::vector<std::byte> mem(kN * kOwnerPage);
  auto small = client_->RegisterArena(mem, kOwnerPage);
  ASSERT_TRUE(small.ok()) << small.status();
  std::vector<uint64_t> order(kOwnerPages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(42));
  FillPattern({owner_arena_->base(), owner_arena_->size()}, 5, 0);
  std::vector<TransferOp> ops;
  for (uint64_t i = 0; i < kN; ++i) ops.push_back({{(*small)->id(), {kN - 1 - i}, 0}, Remote({order[i]})});
  ASSERT_TRUE(Await(ep_->Get(ops)).ok());
  for (uint64_t i = 0; i < kN; ++i) {
    ASSERT_EQ(FirstMismatch((*small)->Page(kN - 1 - i), 5, order[i] * kOwnerPage), -1) << "op " << i;
  }
  // And back, shifted by one owner page.
  for (uint64_t i = 0; i < kN; ++i) ops[i].remote.pages[0] = (order[i] + 1) % kOwnerPages;
  ASSERT_TRUE(Await(ep_->Put(ops)).ok());
  for (uint64_t i = 0; i < kN; ++i) {
    ASSERT_EQ(FirstMismatch(owner_arena_->Page((order[i] + 1) % kOwnerPages), 5, order[i] * kOwnerPage), -1);
  }
}

TEST_P(TransportTest, RefusesBadDescriptorsBeforeMovingBytes) {
  FillPattern({owner_arena_->base(), owner_arena_->size()}, 3, 0);
  std::atomic<int> callbacks{0};
  auto cb = [&](absl::Status) { callbacks++; };
  const std::vector<std::pair<const char*, TransferOp>> bad = {
      {"unknown local arena", {{9999, {0}, 0}, Remote({0, 1})}},
      {"unknown remote arena", {Local({0}), {9999, {0, 1}, 0}}},
      {"local page out of range", {Local({kClientPages}), Remote({0, 1})}},
      {"remote page out of range", {Local({0}), Remote({0, kOwnerPages})}},
      {"sizes differ", {Local({0}), Remote({0})}},
      {"bytes beyond pages", {Local({0}, kClientPage + 1), Remote({0, 1, 2}, kClientPage + 1)}},
      {"empty last page", {Local({0, 1}, 100), Remote({0}, 100)}},
      {"no pages", {Local({}), Remote({})}}};
  for (const auto& [what, op] : bad) {
    // A good op first: the whole batch must be refused, not just the bad op.
    std::vector<TransferOp> ops = {{Local({10}), Remote({20, 21})}, op};
    absl::Status s = ep_->PutAsync(ops, cb);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << ": " << s;
    s = ep_->GetAsync(ops, cb);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << ": " << s;
  }
  // A batch that is accepted runs after the refused ones; when it is done, nothing that
  // was refused can still be pending.
  ASSERT_TRUE(Await(ep_->Get({{Local({0}), Remote({0, 1})}})).ok());
  EXPECT_EQ(callbacks.load(), 0);
  EXPECT_EQ(FirstMismatch({owner_arena_->base(), owner_arena_->size()}, 3, 0), -1);
}

// The owner counts a refusal when its reply's send completes, which can come after the
// initiator has the reply (seen under load: 0 counted right after the batch failed).
// Likewise for a served request (counted when the answer's send completes).
uint64_t CountEventually(const Worker& owner, uint64_t WorkerStats::*count, uint64_t want) {
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (owner.stats().*count < want && absl::Now() < end) absl::SleepFor(absl::Milliseconds(1));
  return owner.stats().*count;
}
uint64_t RefusedEventually(const Worker& owner, uint64_t want) {
  return CountEventually(owner, &WorkerStats::am_requests_refused, want);
}
uint64_t ServedEventually(const Worker& owner, uint64_t want) {
  return CountEventually(owner, &WorkerStats::am_requests_served, want);
}

// The owner checks what it is asked for: an initiator with a forged descriptor (a larger
// arena than the owner registered) is refused by the owner (AM) and the endpoint keeps
// working. RMA has no owner-side code, so the initiator-side check is the guard there.
TEST_P(TransportTest, OwnerRefusesSegmentsOutsideItsArena) {
  if (ep_->protocol() != Protocol::kActiveMessage) GTEST_SKIP() << "owner-side check is AM only";
  RemoteArena forged = remote_;
  forged.size *= 4;
  ASSERT_TRUE(ep_->ImportArena(forged).ok());
  absl::Status s = Await(ep_->Get({{Local({0}), Remote({kOwnerPages + 10, kOwnerPages + 11})}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = Await(ep_->Put({{Local({0}), Remote({kOwnerPages * 3, 1})}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // The refusal names the owner's reason and the op it refers to: here ops[2] of a get
  // whose three ops (an observer keeps their segments apart) travel in one message.
  auto refused = std::make_shared<std::promise<absl::Status>>();
  ASSERT_TRUE(ep_->GetAsync({{Local({0}), Remote({2, 3})}, {Local({1}), Remote({4, 5})},
                             {Local({2}), Remote({kOwnerPages + 20, kOwnerPages + 21})}},
                            [refused](absl::Status st) { refused->set_value(std::move(st)); },
                            [](size_t, std::span<const std::byte>) {})
                  .ok());
  s = Await(refused->get_future());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "ops[2]")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat("is outside arena ", remote_.arena_id))) << s;
  EXPECT_TRUE(ep_->health().ok());
  FillPattern(owner_arena_->Page(7), 9, 0);
  FillPattern(owner_arena_->Page(8), 9, kOwnerPage);
  ASSERT_TRUE(Await(ep_->Get({{Local({1}), Remote({7, 8})}})).ok());
  EXPECT_EQ(FirstMismatch(client_arena_->Page(1), 9, 0), -1);
  EXPECT_GE(RefusedEventually(*owner_, 2), 2u);
}

// A batch of several AM messages whose first message is refused fails at once and is
// released once its other messages are sent (before, the acks of those messages were
// dropped and the batch stayed in flight for good; a put of several messages is now
// answered once, by that refusal).
TEST_P(TransportTest, RefusedMessageReleasesItsBatchOnceTheOthersAnswer) {
  if (ep_->protocol() != Protocol::kActiveMessage) GTEST_SKIP() << "owner-side check is AM only";
  RemoteArena forged = remote_;
  forged.size *= 4;
  ASSERT_TRUE(ep_->ImportArena(forged).ok());
  // One 4 KiB segment outside the owner's arena, then 80 valid ones that touch no
  // neighbour (every other page): more segments than one message carries.
  constexpr uint64_t kSegs = 81;
  std::vector<uint64_t> rpages = {kOwnerPages * 2};
  for (uint64_t i = 0; i + 1 < kSegs; ++i) rpages.push_back(2 * i);
  std::vector<uint64_t> lpages;
  for (uint64_t i = 0; i * kClientPage < kSegs * kOwnerPage; ++i) lpages.push_back(i);
  const uint64_t bytes = kSegs * kOwnerPage;
  absl::Status s = Await(ep_->Put({{Local(lpages, bytes), Remote(rpages, bytes)}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(ep_->health().ok());
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (client_->stats().batches_in_flight != 0 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(client_->stats().batches_in_flight, 0u);
  // The endpoint still serves.
  FillPattern(client_arena_->Page(1), 21, 0);
  ASSERT_TRUE(Await(ep_->Put({{Local({1}), Remote({300, 301})}})).ok());
  EXPECT_EQ(client_->stats().batches_in_flight, 0u);
}

// A put of several AM messages is answered once (AmHeader::num_parts), after its last
// message landed: one ack for eight 64 KiB messages, every byte in place when the batch
// completes, nothing written between the segments; a put with two messages outside the
// arena is refused once, and the endpoint keeps serving.
TEST_P(TransportTest, PutOfSeveralMessagesIsAnsweredOnce) {
  if (ep_->protocol() != Protocol::kActiveMessage) GTEST_SKIP() << "this endpoint moves bytes one-sided (RMA): the owner sends no acks to count";
  constexpr uint64_t kMsgs = 8, kSeg = 64 << 10, kStride = 32;  // owner pages per message slot
  std::vector<uint64_t> lp(kClientPages), rp;
  std::iota(lp.begin(), lp.end(), 0);
  for (uint64_t m = 0; m < kMsgs; ++m) {
    for (uint64_t i = 0; i < kSeg / kOwnerPage; ++i) rp.push_back(kStride * m + i);
  }
  FillPattern({client_mem_.data(), client_mem_.size()}, 41, 0);
  std::memset(owner_arena_->base(), 0, owner_arena_->size());
  const uint64_t served = owner_->stats().am_requests_served;
  ASSERT_TRUE(Await(ep_->Put({{Local(lp), Remote(rp)}})).ok());
  for (uint64_t m = 0; m < kMsgs; ++m) {
    std::byte* at = owner_arena_->Page(kStride * m).data();
    EXPECT_EQ(FirstMismatch({at, kSeg}, 41, m * kSeg), -1) << "message " << m;
    EXPECT_EQ(std::count(at + kSeg, at + kStride * kOwnerPage, std::byte{0}),
              static_cast<std::ptrdiff_t>(kStride * kOwnerPage - kSeg))
        << "after message " << m;
  }
  EXPECT_EQ(ServedEventually(*owner_, served + 1), served + 1);

  RemoteArena forged = remote_;
  forged.size *= 4;
  ASSERT_TRUE(ep_->ImportArena(forged).ok());
  std::vector<uint64_t> bad = rp;
  for (uint64_t m : {2, 5}) {
    for (uint64_t i = 0; i < kSeg / kOwnerPage; ++i) bad[m * (kSeg / kOwnerPage) + i] = 2 * kOwnerPages + kStride * m + i;
  }
  const uint64_t refused = owner_->stats().am_requests_refused;
  absl::Status s = Await(ep_->Put({{Local(lp), Remote(bad)}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (client_->stats().batches_in_flight != 0 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(client_->stats().batches_in_flight, 0u);
  EXPECT_EQ(RefusedEventually(*owner_, refused + 1), refused + 1);
  EXPECT_EQ(owner_->stats().am_requests_served, served + 1);
  EXPECT_TRUE(ep_->health().ok()) << ep_->health();
  ASSERT_TRUE(Await(ep_->Put({{Local(lp), Remote(rp)}})).ok());
  EXPECT_EQ(ServedEventually(*owner_, served + 2), served + 2);
}

// A get whose second message is refused (the owner stopped serving that arena) fails,
// but the first message's 4 MiB may still be arriving into the caller's pages: the
// callback must come only once UCX no longer writes there, since a caller told "failed"
// reuses its pages at once (before, the bytes landed after the callback, ~19/20 rounds).
TEST_P(TransportTest, FailedBatchCallbackRunsAfterTheLastByteLands) {
  if (ep_->protocol() != Protocol::kActiveMessage) GTEST_SKIP() << "owner-side refusal is AM only";
  constexpr uint64_t kPage = 4096, kPages = 1024;  // 4 MiB: rendezvous, several fragments
  std::vector<std::byte> amem(kPages * kPage, std::byte{0x11}), bmem(4 * kPage);
  std::vector<std::byte> cmem(kPages * kPage);
  auto a = owner_->RegisterArena(amem, kPage);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = owner_->RegisterArena(bmem, kPage);
  ASSERT_TRUE(b.ok()) << b.status();
  auto c = client_->RegisterArena(cmem, kPage);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(ep_->ImportArena((*a)->descriptor()).ok());
  ASSERT_TRUE(ep_->ImportArena((*b)->descriptor()).ok());
  owner_->ForgetArena((*b)->id());  // its segments are refused from now on
  std::vector<uint64_t> pages(kPages);
  std::iota(pages.begin(), pages.end(), 0);
  int late_rounds = 0;
  for (int round = 0; round < 8; ++round) {
    std::memset(cmem.data(), 0, cmem.size());
    std::promise<absl::Status> p;
    std::future<absl::Status> f = p.get_future();
    const absl::Status st = ep_->GetAsync(
        {{{(*c)->id(), pages, 0}, {(*a)->id(), pages, 0}}, {{(*c)->id(), {0}, 0}, {(*b)->id(), {0}, 0}}},
        [&](absl::Status s) {
          std::memset(cmem.data(), 0xAA, cmem.size());  // "failed": the caller reuses its pages
          p.set_value(std::move(s));
        });
    ASSERT_TRUE(st.ok()) << st;
    const absl::Status s = Await(std::move(f));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    const absl::Time end = absl::Now() + absl::Seconds(20);
    while (client_->stats().batches_in_flight != 0 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(1));
    EXPECT_EQ(client_->stats().batches_in_flight, 0u);
    late_rounds += std::count(cmem.begin(), cmem.end(), std::byte{0x11}) != 0;
  }
  EXPECT_EQ(late_rounds, 0) << "bytes landed after the failure callback";
  EXPECT_TRUE(ep_->health().ok());
}

// A bare UCX worker speaking the AM wire format by hand: it records get requests and
// sends whatever replies a test wants, from whichever endpoint it wants.
class RawAmPeer {
 public:
  RawAmPeer() {
    ucp_config_t* cfg = nullptr;
    EXPECT_EQ(ucp_config_read(nullptr, nullptr, &cfg), UCS_OK);
    ucp_config_modify(cfg, "TLS", "tcp");
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_AM;
    EXPECT_EQ(ucp_init(&p, cfg, &ctx_), UCS_OK);
    ucp_config_release(cfg);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    EXPECT_EQ(ucp_worker_create(ctx_, &wp, &worker_), UCS_OK);
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = kAmGetReq;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.arg = this;
    hp.cb = [](void* arg, const void* header, size_t header_len, void*, size_t,
               const ucp_am_recv_param_t* param) -> ucs_status_t {
      auto* self = static_cast<RawAmPeer*>(arg);
      AmHeader h{};
      if (header_len >= sizeof(h) && (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
        std::memcpy(&h, header, sizeof(h));
        self->requests_.push_back({param->reply_ep, h});
      }
      return UCS_OK;
    };
    EXPECT_EQ(ucp_worker_set_am_recv_handler(worker_, &hp), UCS_OK);
    // As an initiator: the answers of a kvpool owner (small payloads only: eager).
    hp.id = kAmGetResp;
    hp.cb = [](void* arg, const void* header, size_t header_len, void*, size_t len,
               const ucp_am_recv_param_t*) -> ucs_status_t {
      AmHeader h{};
      if (header_len >= sizeof(h)) {
        std::memcpy(&h, header, sizeof(h));
        static_cast<RawAmPeer*>(arg)->responses_.push_back({h, len});
      }
      return UCS_OK;
    };
    EXPECT_EQ(ucp_worker_set_am_recv_handler(worker_, &hp), UCS_OK);
    hp.id = kAmPutAck;  // recorded with the get responses
    EXPECT_EQ(ucp_worker_set_am_recv_handler(worker_, &hp), UCS_OK);
    ucp_address_t* a = nullptr;
    size_t len = 0;
    EXPECT_EQ(ucp_worker_get_address(worker_, &a, &len), UCS_OK);
    address_ = WrapAddress(absl::string_view(reinterpret_cast<const char*>(a), len));
    ucp_worker_release_address(worker_, a);
  }
  ~RawAmPeer() {
    for (ucp_ep_h ep : eps_) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      Wait(ucp_ep_close_nbx(ep, &p));
    }
    ucp_worker_destroy(worker_);
    ucp_cleanup(ctx_);
  }
  // An endpoint of its own to a kvpool worker (not the one that worker's batches use).
  ucp_ep_h Connect(const std::string& wrapped) {
    std::string ucx;
    pid_t pid = 0;
    bool same_host = false;
    UnwrapAddress(wrapped, &ucx, &pid, &same_host);
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.address = reinterpret_cast<const ucp_address_t*>(ucx.data());
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ucp_ep_h ep = nullptr;
    EXPECT_EQ(ucp_ep_create(worker_, &p, &ep), UCS_OK);
    eps_.push_back(ep);
    return ep;
  }
  // A reply as an owner sends it: kAmGetResp with the bytes, or (id = kAmPutAck) an ack.
  void Reply(ucp_ep_h ep, uint64_t batch_id, uint32_t part, std::vector<std::byte> payload,
             unsigned id = kAmGetResp) {
    AmHeader h{};
    h.batch_id = batch_id;
    h.part = part;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    Wait(ucp_am_send_nbx(ep, id, &h, sizeof(h), payload.data(), payload.size(), &p));
  }
  void Progress(absl::Duration d) {
    const absl::Time end = absl::Now() + d;
    while (absl::Now() < end) ucp_worker_progress(worker_);
  }
  // Progresses until f is ready (or 10 s pass).
  absl::Status Await(std::future<absl::Status>& f) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (f.wait_for(std::chrono::seconds(0)) != std::future_status::ready && absl::Now() < end) {
      ucp_worker_progress(worker_);
    }
    if (f.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      return absl::DeadlineExceededError("hang guard");
    }
    return f.get();
  }
  void Wait(ucs_status_ptr_t r) {
    if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
    while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker_);
    ucp_request_free(r);
  }
  // Sends a kAmGetReq as an initiator would (header: AmHeader, segments, counts).
  void Request(ucp_ep_h ep, AmHeader h, const std::vector<WireSeg>& segs,
               const std::vector<uint32_t>& counts) {
    std::string hdr(sizeof(h) + segs.size() * sizeof(WireSeg) + counts.size() * sizeof(uint32_t), '\0');
    std::memcpy(hdr.data(), &h, sizeof(h));
    std::memcpy(hdr.data() + sizeof(h), segs.data(), segs.size() * sizeof(WireSeg));
    std::memcpy(hdr.data() + sizeof(h) + segs.size() * sizeof(WireSeg), counts.data(),
                counts.size() * sizeof(uint32_t));
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    Wait(ucp_am_send_nbx(ep, kAmGetReq, hdr.data(), hdr.size(), nullptr, 0, &p));
  }
  // Sends a kAmPut as an initiator would (header: AmHeader, segments; then the bytes).
  void Put(ucp_ep_h ep, AmHeader h, const std::vector<WireSeg>& segs, std::vector<std::byte> payload) {
    h.num_segs = static_cast<uint32_t>(segs.size());
    std::string hdr(sizeof(h) + segs.size() * sizeof(WireSeg), '\0');
    std::memcpy(hdr.data(), &h, sizeof(h));
    // (No memcpy from an empty vector's data(), which may be null: UBSan flags it.)
    if (!segs.empty()) std::memcpy(hdr.data() + sizeof(h), segs.data(), segs.size() * sizeof(WireSeg));
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    Wait(ucp_am_send_nbx(ep, kAmPut, hdr.data(), hdr.size(), payload.data(), payload.size(), &p));
  }
  // Opens `n` puts of `parts` messages each (batch ids first_batch, first_batch + 1, ...)
  // by sending only their first message, header-only: a record each on the owner.
  void OpenPuts(ucp_ep_h ep, int n, uint64_t first_batch, uint32_t parts) {
    for (int i = 0; i < n; ++i) {
      AmHeader h{};
      h.batch_id = first_batch + static_cast<uint64_t>(i);
      h.num_parts = parts;
      Put(ep, h, {}, {});
    }
  }
  // The second (last) message of a put OpenPuts opened with parts = 2: it lands, and its
  // record goes.
  void FinishOpenPut(ucp_ep_h ep, uint64_t batch) {
    AmHeader h{};
    h.batch_id = batch;
    h.num_parts = 2;
    h.part = 1;
    Put(ep, h, {}, {});
  }
  // Expects response i to answer `batch` with `code`.
  void ExpectResponse(size_t i, uint64_t batch, absl::StatusCode code) const {
    ASSERT_LT(i, responses_.size());
    EXPECT_EQ(responses_[i].first.batch_id, batch) << "response " << i;
    EXPECT_EQ(responses_[i].first.status, static_cast<uint32_t>(code)) << "response " << i << " (batch " << batch << ")";
  }
  // Message `part` of a put of three (batch `batch`): 64 bytes of `fill` to the start of
  // owner page part + 1.
  void PutOneOfThree(ucp_ep_h ep, uint64_t batch, uint32_t part, uint32_t arena_id, uint64_t page_bytes,
                     std::byte fill) {
    AmHeader h{};
    h.batch_id = batch;
    h.num_parts = 3;
    h.part = part;
    Put(ep, h, {WireSeg{arena_id, 0, (part + 1) * page_bytes, 64}}, std::vector<std::byte>(64, fill));
  }
  // Sends a one-message put (batch `batch`, 8 bytes of 1 to the start of page 0) after
  // whatever came before on `ep`: its ack comes once the owner handled those (in order).
  // Progresses until `want` responses in all; false if they did not come.
  bool PutMarker(ucp_ep_h ep, uint64_t batch, uint32_t arena_id, size_t want) {
    AmHeader marker{};
    marker.batch_id = batch;
    Put(ep, marker, {WireSeg{arena_id, 0, 0, 8}}, std::vector<std::byte>(8, std::byte{1}));
    for (int i = 0; i < 10000 && responses_.size() < want; ++i) Progress(absl::Milliseconds(1));
    return responses_.size() == want;
  }
  const std::string& address() const { return address_; }
  std::vector<std::pair<ucp_ep_h, AmHeader>> requests_;
  std::vector<std::pair<AmHeader, size_t>> responses_;  // header, payload bytes

 private:
  ucp_context_h ctx_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  std::vector<ucp_ep_h> eps_;
};

// Batch deadlines follow the monotonic clock: the wall clock stepped back two minutes
// under a batch to a peer that never answers still fails it after batch_timeout (3 s
// here), not two minutes later.
// (The raw UCX test peer connects over tcp: this suite runs the tcp mode only.)
using TcpTransportTest = TransportTest;
TEST_P(TcpTransportTest, WallClockStepBackDoesNotStretchADeadline) {
  RawAmPeer peer;
  auto ep = client_->Connect(peer.address(), "raw-clock");
  ASSERT_TRUE(ep.ok()) << ep.status();
  ASSERT_TRUE((*ep)->ImportArena(remote_).ok());
  std::promise<absl::Status> p;
  std::future<absl::Status> f = p.get_future();
  ASSERT_TRUE((*ep)->GetAsync({{Local({0}), Remote({0, 1})}}, [&](absl::Status s) { p.set_value(std::move(s)); }).ok());
  g_realtime_offset_ns.store(int64_t{-120} * 1'000'000'000);
  // The peer records the request and never answers; 30 s is a guard, ten times the timeout.
  const auto guard = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (f.wait_for(std::chrono::seconds(0)) != std::future_status::ready && std::chrono::steady_clock::now() < guard) {
    peer.Progress(absl::Milliseconds(1));
  }
  g_realtime_offset_ns.store(0);
  ASSERT_EQ(f.wait_for(std::chrono::seconds(0)), std::future_status::ready)
      << "the batch outlived its 3 s timeout by 30 s once the wall clock went back";
  EXPECT_EQ(f.get().code(), absl::StatusCode::kDeadlineExceeded);
}

// Replies count only from the endpoint the batch went out on, once per message: batch ids
// are sequential, so any peer could otherwise complete (and fill the pages of) another
// peer's batch, and a duplicate reply would stand in for a missing one.
TEST_P(TransportTest, RepliesCountOnlyFromTheBatchsPeerAndOncePerMessage) {
  if (std::string(GetParam().tls) != "tcp") GTEST_SKIP() << "the raw UCX test peer connects over tcp; this mode's workers have shared memory only";
  RawAmPeer peer;
  // Each case on an endpoint of its own to the raw peer, with no request recorded yet.
  auto fresh_endpoint = [&](const char* name) -> std::shared_ptr<Endpoint> {
    auto conn = client_->Connect(peer.address(), name);
    EXPECT_TRUE(conn.ok()) << conn.status();
    if (!conn.ok() || !(*conn)->ImportArena(remote_).ok()) return nullptr;
    peer.requests_.clear();
    return *conn;
  };
  // Progresses the peer until it has recorded exactly one request.
  auto one_request = [&] {
    for (int i = 0; i < 2000 && peer.requests_.empty(); ++i) peer.Progress(absl::Milliseconds(1));
    return peer.requests_.size() == 1;
  };
  std::shared_ptr<Endpoint> ep = fresh_endpoint("raw");
  ASSERT_NE(ep, nullptr);
  ASSERT_EQ(ep->protocol(), Protocol::kActiveMessage);

  // 1. A reply from another peer (a forger that guessed the batch id) is ignored. (Another
  // endpoint of the batch's own peer worker would not do: UCX pairs it with the batch's.)
  std::memset(client_mem_.data(), 0, client_mem_.size());
  std::promise<absl::Status> p1;
  std::future<absl::Status> f1 = p1.get_future();
  ASSERT_TRUE(ep->GetAsync({{Local({0}), Remote({0, 1})}},
                           [&](absl::Status s) { p1.set_value(std::move(s)); }).ok());
  ASSERT_TRUE(one_request());
  const AmHeader req = peer.requests_[0].second;
  RawAmPeer forger;
  forger.Reply(forger.Connect(client_->address()), req.batch_id, req.part,
               std::vector<std::byte>(kClientPage, std::byte{0x5A}));
  absl::Status s = peer.Await(f1);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(std::count(client_mem_.begin(), client_mem_.begin() + kClientPage, std::byte{0x5A}), 0);

  // 2. A duplicate reply from the right endpoint does not stand in for another message.
  ep = fresh_endpoint("raw2");
  ASSERT_NE(ep, nullptr);
  std::promise<absl::Status> p2;
  std::future<absl::Status> f2 = p2.get_future();
  // Two 64 KiB segments (local pages 0-7 and 8-15, remote 0-15 and 32-47): two messages,
  // asked for in one request.
  std::vector<uint64_t> l0(8), l1(8), r0(16), r1(16);
  std::iota(l0.begin(), l0.end(), 0);
  std::iota(l1.begin(), l1.end(), 8);
  std::iota(r0.begin(), r0.end(), 0);
  std::iota(r1.begin(), r1.end(), 32);
  ASSERT_TRUE(ep->GetAsync({{Local(l0), Remote(r0)}, {Local(l1), Remote(r1)}},
                           [&](absl::Status s) { p2.set_value(std::move(s)); }).ok());
  ASSERT_TRUE(one_request());
  const auto [reply_ep, h0] = peer.requests_[0];
  ASSERT_EQ(h0.num_parts, 2u);
  for (int i = 0; i < 2; ++i) {
    peer.Reply(reply_ep, h0.batch_id, h0.part, std::vector<std::byte>(8 * kClientPage, std::byte{0x33}));
  }
  s = peer.Await(f2);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;

  // 3. A reply of the other direction from the right endpoint does not count: a put ack
  // to a get completed it OK with no byte landed.
  ep = fresh_endpoint("raw3");
  ASSERT_NE(ep, nullptr);
  std::promise<absl::Status> p3;
  std::future<absl::Status> f3 = p3.get_future();
  ASSERT_TRUE(ep->GetAsync({{Local({0}), Remote({0, 1})}},
                           [&](absl::Status s) { p3.set_value(std::move(s)); }).ok());
  ASSERT_TRUE(one_request());
  const auto [reply_ep3, h3] = peer.requests_[0];
  peer.Reply(reply_ep3, h3.batch_id, h3.part, {}, kAmPutAck);
  s = peer.Await(f3);
  EXPECT_FALSE(s.ok()) << "a get completed by a put ack";
}

// An owner keeps a record per put answered once (AmHeader::num_parts > 1) until its last
// message lands, with a bit per message: their sum is bounded. A peer sending
// header-only messages that each name 2^20 parts used to grow the owner by 128 KiB per
// 24-byte message for five minutes; past the bound such a put is refused
// RESOURCE_EXHAUSTED, and puts answered per message are still served.
TEST_P(TransportTest, OwnerBoundsTheRecordsOfPutsUnderWay) {
  if (std::string(GetParam().tls) != "tcp") GTEST_SKIP() << "the raw UCX test peer connects over tcp; this mode's workers have shared memory only";
  RawAmPeer peer;
  ucp_ep_h ep = peer.Connect(owner_->address());
  constexpr uint32_t kParts = 1u << 20;  // the most one batch may have
  constexpr int kFit = (1 << 24) / kParts;  // records the bound holds
  auto responses = [&](size_t want) {
    for (int i = 0; i < 5000 && peer.responses_.size() < want; ++i) peer.Progress(absl::Milliseconds(1));
    return peer.responses_.size();
  };
  peer.OpenPuts(ep, kFit, 1000, kParts);
  // A put of three messages past the bound: refused once, and none of its bytes land.
  std::byte* owner_bytes = owner_arena_->base();
  std::memset(owner_bytes, 0, 4 * kOwnerPage);
  for (uint32_t part = 0; part < 3; ++part) {
    peer.PutOneOfThree(ep, 5000, part, remote_.arena_id, kOwnerPage, std::byte{0x24});
  }
  ASSERT_EQ(responses(1), 1u) << "the put past the bound is answered (the others wait for their messages)";
  EXPECT_EQ(peer.responses_[0].first.batch_id, 5000u);
  EXPECT_EQ(peer.responses_[0].first.status, static_cast<uint32_t>(absl::StatusCode::kResourceExhausted));
  // A one-message put (no record) still lands and is acknowledged.
  peer.responses_.clear();
  AmHeader one{};
  one.batch_id = 6000;
  one.part = 0;
  peer.Put(ep, one, {WireSeg{remote_.arena_id, 0, 0, 64}}, std::vector<std::byte>(64, std::byte{0x42}));
  ASSERT_EQ(responses(1), 1u) << "one answer: the ack (the refused put's later messages got none)";
  EXPECT_EQ(peer.responses_[0].first.batch_id, 6000u);
  EXPECT_EQ(peer.responses_[0].first.status, 0u);
  EXPECT_EQ(std::count(owner_bytes, owner_bytes + 64, std::byte{0x42}), 64);
  EXPECT_EQ(std::count(owner_bytes, owner_bytes + 4 * kOwnerPage, std::byte{0x24}), 0);
}

// A put refused because the owner already tracks 2^16 puts under way keeps a tombstone,
// so its later messages are dropped even when other puts landed in between and made
// room. Before, the refused batch kept no record: its later messages, arriving once a
// record was free, were written into the arena although the initiator was told it failed.
TEST_P(TransportTest, LaterMessagesOfAPutRefusedAtTheRecordBoundAreDropped) {
  if (std::string(GetParam().tls) != "tcp") GTEST_SKIP() << "the raw UCX test peer connects over tcp; this mode's workers have shared memory only";
  RawAmPeer peer;
  ucp_ep_h ep = peer.Connect(owner_->address());
  constexpr int kRecords = 1 << 16;  // WorkerImpl::kMaxPendingPutRecords
  // 2^16 puts of two header-only messages, each with its first message only: a record each.
  peer.OpenPuts(ep, kRecords, 100000, 2);
  std::byte* owner_bytes = owner_arena_->base();
  std::memset(owner_bytes, 0, 4 * kOwnerPage);
  auto put_over = [&](uint32_t part) {
    peer.PutOneOfThree(ep, 5000, part, remote_.arena_id, kOwnerPage, std::byte{0x24});
  };
  put_over(0);  // refused: no record left
  peer.FinishOpenPut(ep, 100000);  // the first put's record goes
  put_over(1);
  put_over(2);
  ASSERT_TRUE(peer.PutMarker(ep, 6000, remote_.arena_id, 3)) << peer.responses_.size();
  peer.ExpectResponse(0, 5000, absl::StatusCode::kResourceExhausted);
  peer.ExpectResponse(1, 100000, absl::StatusCode::kOk);
  peer.ExpectResponse(2, 6000, absl::StatusCode::kOk);
  EXPECT_EQ(std::count(owner_bytes, owner_bytes + 4 * kOwnerPage, std::byte{0x24}), 0)
      << "a message of the refused put was written into the arena";
}

// Tombstones (records of refused puts, kept only to drop their later messages) do not
// count toward the 2^16 records that admit a put: with 2^16 - 1 puts under way and one
// tombstone, a new put of three messages lands and is acked. Before, it was refused
// RESOURCE_EXHAUSTED: tombstones whose later messages never come (an initiator that died)
// kept puts out for kPendingPutTtl (5 minutes).
TEST_P(TransportTest, TombstonesDoNotCountTowardTheRecordBound) {
  if (std::string(GetParam().tls) != "tcp") GTEST_SKIP() << "the raw UCX test peer connects over tcp; this mode's workers have shared memory only";
  RawAmPeer peer;
  ucp_ep_h ep = peer.Connect(owner_->address());
  constexpr int kRecords = 1 << 16;  // WorkerImpl::kMaxPendingPutRecords
  peer.OpenPuts(ep, kRecords, 100000, 2);  // a record each
  peer.OpenPuts(ep, 1, 300000, 2);         // refused: a tombstone (its second message never comes)
  peer.FinishOpenPut(ep, 100000);  // the first put's record goes
  std::byte* owner_bytes = owner_arena_->base();
  std::memset(owner_bytes, 0, 4 * kOwnerPage);
  for (uint32_t part = 0; part < 3; ++part) {
    peer.PutOneOfThree(ep, 5000, part, remote_.arena_id, kOwnerPage, std::byte{0x24});
  }
  ASSERT_TRUE(peer.PutMarker(ep, 6000, remote_.arena_id, 4)) << peer.responses_.size();
  peer.ExpectResponse(0, 300000, absl::StatusCode::kResourceExhausted);
  peer.ExpectResponse(1, 100000, absl::StatusCode::kOk);
  peer.ExpectResponse(2, 5000, absl::StatusCode::kOk);  // before: refused, a tombstone took a live record's place
  EXPECT_EQ(peer.responses_[2].first.part, 3u);  // the batch's one ack
  peer.ExpectResponse(3, 6000, absl::StatusCode::kOk);
  EXPECT_EQ(std::count(owner_bytes + kOwnerPage, owner_bytes + 4 * kOwnerPage, std::byte{0x24}), 3 * 64);
}

// A message that repeats a part of its batch is refused before its bytes move: the
// owner's arena keeps the first message's bytes. Before, the duplicate was written into
// the arena and only then refused.
TEST_P(TransportTest, ADuplicateMessageOfAPutIsRefusedBeforeItsBytesMove) {
  if (std::string(GetParam().tls) != "tcp") GTEST_SKIP() << "the raw UCX test peer connects over tcp; this mode's workers have shared memory only";
  RawAmPeer peer;
  ucp_ep_h ep = peer.Connect(owner_->address());
  std::byte* owner_bytes = owner_arena_->base();
  std::memset(owner_bytes, 0, 4 * kOwnerPage);
  peer.PutOneOfThree(ep, 8000, 0, remote_.arena_id, kOwnerPage, std::byte{0x11});  // page 1
  peer.PutOneOfThree(ep, 8000, 0, remote_.arena_id, kOwnerPage, std::byte{0x99});  // page 1 again
  ASSERT_TRUE(peer.PutMarker(ep, 8001, remote_.arena_id, 2)) << peer.responses_.size();
  EXPECT_EQ(peer.responses_[0].first.batch_id, 8000u);
  EXPECT_EQ(peer.responses_[0].first.status, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(peer.responses_[1].first.batch_id, 8001u);
  EXPECT_EQ(std::count(owner_bytes + kOwnerPage, owner_bytes + kOwnerPage + 64, std::byte{0x11}), 64);
  EXPECT_EQ(std::count(owner_bytes, owner_bytes + 4 * kOwnerPage, std::byte{0x99}), 0)
      << "the duplicate's bytes were written into the arena";
}

// Once a put answered once is refused (its initiator told the batch failed), its later
// messages are received and dropped: none of their bytes reach the owner's arena.
TEST_P(TransportTest, LaterMessagesOfARefusedPutAreDropped) {
  if (std::string(GetParam().tls) != "tcp") GTEST_SKIP() << "the raw UCX test peer connects over tcp; this mode's workers have shared memory only";
  RawAmPeer peer;
  ucp_ep_h ep = peer.Connect(owner_->address());
  std::byte* owner_bytes = owner_arena_->base();
  std::memset(owner_bytes, 0, 2 * kOwnerPage);
  AmHeader h{};
  h.batch_id = 7000;
  h.num_parts = 3;
  h.part = 0;  // names a segment far outside the arena: refused
  peer.Put(ep, h, {WireSeg{remote_.arena_id, 0, uint64_t{1} << 40, 64}}, std::vector<std::byte>(64, std::byte{0x77}));
  for (uint32_t part : {1u, 2u}) {  // valid segments: pages 0 and 1
    h.part = part;
    peer.Put(ep, h, {WireSeg{remote_.arena_id, 0, (part - 1) * kOwnerPage, 64}},
             std::vector<std::byte>(64, std::byte{0x77}));
  }
  ASSERT_TRUE(peer.PutMarker(ep, 7001, remote_.arena_id, 2)) << peer.responses_.size();
  EXPECT_EQ(peer.responses_[0].first.batch_id, 7000u);
  EXPECT_EQ(peer.responses_[0].first.part, 0u);
  EXPECT_NE(peer.responses_[0].first.status, 0u);
  EXPECT_EQ(peer.responses_[1].first.batch_id, 7001u);
  EXPECT_EQ(peer.responses_[1].first.status, 0u);
  EXPECT_EQ(std::count(owner_bytes, owner_bytes + 2 * kOwnerPage, std::byte{0x77}), 0);
}

// A get request that asks for several messages is answered per message; one whose
// segment counts do not add up, or name an empty message, is refused for every message
// it names (with the reason as the payload), and nothing is sent from the arena.
TEST_P(TransportTest, OwnerChecksTheMessagesOfAGetRequest) {
  if (std::string(GetParam().tls) != "tcp") GTEST_SKIP() << "the raw UCX test peer connects over tcp; this mode's workers have shared memory only";
  RawAmPeer peer;
  ucp_ep_h ep = peer.Connect(owner_->address());
  std::vector<WireSeg> segs(3);
  for (uint64_t i = 0; i < 3; ++i) segs[i] = {remote_.arena_id, 0, 2 * i * kOwnerPage, kOwnerPage};
  struct Case {
    const char* what;
    std::vector<uint32_t> counts;
    bool ok;
  };
  const Case cases[] = {{"1 + 2 segments", {1, 2}, true},
                        {"counts add up to 2 of 3", {1, 1}, false},
                        {"an empty message", {3, 0}, false}};
  uint64_t batch = 100;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    peer.responses_.clear();
    AmHeader h{};
    h.batch_id = ++batch;
    h.part = 5;
    h.num_segs = 3;
    h.num_parts = static_cast<uint32_t>(c.counts.size());
    peer.Request(ep, h, segs, c.counts);
    for (int i = 0; i < 5000 && peer.responses_.size() < 2; ++i) peer.Progress(absl::Milliseconds(1));
    ASSERT_EQ(peer.responses_.size(), 2u);
    for (uint32_t m = 0; m < 2; ++m) {
      const auto& [rh, len] = peer.responses_[m];
      EXPECT_EQ(rh.batch_id, batch);
      EXPECT_EQ(rh.part, 5 + m);
      if (c.ok) {
        EXPECT_EQ(rh.status, 0u);
        EXPECT_EQ(len, c.counts[m] * kOwnerPage);
      } else {
        EXPECT_EQ(rh.status, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
        // Only the owner's reason (kMaxRefusalBytes at most), no arena bytes.
        EXPECT_GT(len, 0u);
        EXPECT_LE(len, kMaxRefusalBytes);
      }
    }
  }
}

// Closing an endpoint never leaves UCX's answer unread: UCX 1.13 refuses to force-close
// an endpoint without PEER error handling (the same-host shared-memory ones) and keeps
// it, so such endpoints are flushed instead (before, every close of one failed with
// INVALID_PARAM, ignored, and the ucp_ep leaked).
TEST_P(TransportTest, ClosingAnEndpointIsAcceptedByUcx) {
  ASSERT_TRUE(Await(ep_->Get({{Local({0}), Remote({0, 1})}})).ok());
  const int before = g_ep_close_errors.load();
  for (int i = 0; i < 3; ++i) {
    auto ep = client_->Connect(owner_->address(), "again");
    ASSERT_TRUE(ep.ok()) << ep.status();
    ASSERT_TRUE((*ep)->ImportArena(remote_).ok());
    ASSERT_TRUE(Await((*ep)->Get({{Local({1}), Remote({2, 3})}})).ok());
    ep->reset();  // closes it
  }
  ep_.reset();
  client_.reset();  // drains: every close has been made and answered
  EXPECT_EQ(g_ep_close_errors.load() - before, 0) << GetParam().name;
}

// A message whose send fails at once gets no reply: the batch must not wait for one. It
// fails at once and is released when the other messages are answered (before, the reply
// stayed counted: the batch was held until the deadline closed its endpoint). A get of
// two requests whose second cannot be sent, and a put of two messages (answered once,
// so the owner never sends that answer) whose second cannot be sent.
TEST_P(TransportTest, MessageThatCannotBeSentIsNotAwaited) {
  if (ep_->protocol() != Protocol::kActiveMessage) GTEST_SKIP() << "this endpoint moves bytes one-sided (RMA): it sends no messages that could fail";
  // Get: 64 segments of 4 KiB (every other owner page: one gathered message, a request
  // of its own at kMaxSegsPerMsg segments) then one of 64 KiB: two requests.
  std::vector<uint64_t> lg(40), rg;
  std::iota(lg.begin(), lg.end(), 0);
  for (uint64_t i = 0; i < 64; ++i) rg.push_back(2 * i);
  for (uint64_t i = 0; i < 16; ++i) rg.push_back(200 + i);
  // Put: two 64 KiB segments, two messages.
  std::vector<uint64_t> l0(8), l1(8), r0(16), r1(16);
  std::iota(l0.begin(), l0.end(), 0);
  std::iota(l1.begin(), l1.end(), 8);
  std::iota(r0.begin(), r0.end(), 0);
  std::iota(r1.begin(), r1.end(), 32);
  for (const bool put : {false, true}) {
    SCOPED_TRACE(put ? "put" : "get");
    g_fail_send_id.store(put ? kAmPut : kAmGetReq);
    g_fail_send.store(2);
    const absl::Time start = absl::Now();
    absl::Status s = put ? Await(ep_->Put({{Local(l0), Remote(r0)}, {Local(l1), Remote(r1)}}))
                         : Await(ep_->Get({{Local(lg), Remote(rg)}}));
    const int left = g_fail_send.exchange(0);
    EXPECT_EQ(left, 0) << "the second send was not made";
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;  // UCS_ERR_NO_RESOURCE
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (client_->stats().batches_in_flight != 0 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(1));
    EXPECT_EQ(client_->stats().batches_in_flight, 0u);
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));  // well before the 3 s deadline
    EXPECT_TRUE(ep_->health().ok()) << ep_->health();
  }
}

// The owner fails to receive a put (ucp_am_recv_data_nbx fails) while the initiator is
// alive: it refuses the message with the error, so the initiator's batch fails at once
// and the endpoint keeps serving (before, the owner did not answer: the batch waited for
// the whole batch_timeout, failed with DEADLINE_EXCEEDED and its endpoint was closed).
TEST_P(TransportTest, PutTheOwnerFailsToReceiveIsAnsweredAtOnce) {
  if (ep_->protocol() != Protocol::kActiveMessage) GTEST_SKIP() << "this endpoint moves bytes one-sided (RMA): the owner receives no put messages";
  // The whole owner arena (2 MiB) from one contiguous client buffer: one message larger
  // than kEagerMaxBytes, received by rendezvous.
  static_assert(kOwnerPages * kOwnerPage > kEagerMaxBytes);
  std::vector<std::byte> mem(kOwnerPages * kOwnerPage);
  auto big = client_->RegisterArena(mem, kOwnerPage);
  ASSERT_TRUE(big.ok()) << big.status();
  std::vector<uint64_t> pages(kOwnerPages);
  std::iota(pages.begin(), pages.end(), 0);
  const TransferOp op{{(*big)->id(), pages, 0}, Remote(pages)};
  FillPattern({mem.data(), mem.size()}, 31, 0);
  const int failed_before = g_recv_failed.load();
  g_fail_recv.store(1);
  const absl::Time start = absl::Now();
  absl::Status s = Await(ep_->Put({op}));
  const absl::Duration took = absl::Now() - start;
  const bool fired = g_fail_recv.exchange(0) <= 0 && g_recv_failed.load() > failed_before;
  if (!fired) GTEST_SKIP() << "the put was not received by rendezvous here: " << s;
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;  // UCS_ERR_NO_MEMORY
  EXPECT_LT(took, absl::Seconds(2));  // well before the 3 s deadline
  EXPECT_TRUE(ep_->health().ok()) << ep_->health();
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (client_->stats().batches_in_flight != 0 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(client_->stats().batches_in_flight, 0u);
  EXPECT_GE(RefusedEventually(*owner_, 1), 1u);
  // The endpoint still serves the same put.
  std::memset(owner_arena_->base(), 0, owner_arena_->size());
  ASSERT_TRUE(Await(ep_->Put({op})).ok());
  EXPECT_EQ(FirstMismatch({owner_arena_->base(), mem.size()}, 31, 0), -1);
}

TEST_P(TransportTest, ConcurrentBatchesFromManyThreads) {
  constexpr int kThreads = 4, kRounds = 20;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        const uint64_t lp = t * 8 + r % 8;
        const uint64_t rp = 2 * (t * 40 + r);
        FillPattern(client_arena_->Page(lp), 1000 + t * 100 + r, 0);
        TransferOp op{Local({lp}), Remote({rp, rp + 1})};
        if (!Await(ep_->Put({op})).ok()) failures++;
        std::memset(client_arena_->Page(lp).data(), 0, kClientPage);
        if (!Await(ep_->Get({op})).ok()) failures++;
        if (FirstMismatch(client_arena_->Page(lp), 1000 + t * 100 + r, 0) != -1) failures++;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

// The owner's worker goes away: batches to it fail (never hang), and the client's
// worker keeps running.
TEST_P(TransportTest, PeerGoneFailsBatchesWithinTheTimeout) {
  if (ep_->protocol() == Protocol::kRma && !ep_->peer_failure_detection()) {
    // One-sided shared memory in one process: the arena stays mapped and nobody needs
    // the owner's worker; the multi-process tests cover a dead owner process.
    GTEST_SKIP() << "shared-memory RMA needs no owner worker";
  }
  ASSERT_TRUE(Await(ep_->Get({{Local({0}), Remote({0, 1})}})).ok());
  owner_.reset();  // closes its UCX worker: the peer is gone
  absl::Status s;
  for (int i = 0; i < 100 && s.ok(); ++i) s = Await(ep_->Get({{Local({0}), Remote({0, 1})}}));
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable ||
              s.code() == absl::StatusCode::kDeadlineExceeded ||
              s.code() == absl::StatusCode::kCancelled) << s;
  EXPECT_FALSE(ep_->health().ok());
  EXPECT_EQ(ep_->PutAsync({{Local({0}), Remote({0, 1})}}, [](absl::Status) {}).code(),
            absl::StatusCode::kUnavailable);
  // The failed batches are released once UCX lets go of their requests: replies still
  // awaited from the dead peer no longer hold them.
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (client_->stats().batches_in_flight != 0 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(client_->stats().batches_in_flight, 0u);
}

// A ByteObserver sees each op's local bytes exactly once, in order, whatever the path
// (one-sided copy, RMA, active messages), and all of them before the batch's callback;
// with a ByteCopier, the pieces this process copies go through the copier instead (one-
// sided shared memory: all of them), the rest through the observer, and the bytes land
// all the same.
TEST_P(TransportTest, ObserverSeesEachOpsBytesInOrderBeforeDone) {
  const uint64_t b0 = 3 * kClientPage - 100, b1 = 5000;
  const PageRun src0 = Local({7, 2, 11}, b0), src1 = Local({20}, b1);
  const PageRun dst0 = Remote({50, 3, 60, 61, 62, 9}, b0), dst1 = Remote({100, 101}, b1);
  for (size_t i = 0; i < client_mem_.size(); ++i) client_mem_[i] = static_cast<std::byte>(i * 131 + 7);
  auto as_string = [](const std::vector<std::byte>& v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size());
  };
  const std::string obj0 = as_string(Gather(*client_arena_, src0));
  const std::string obj1 = as_string(Gather(*client_arena_, src1));

  int copier_calls = 0;
  auto run = [&](bool put, const PageRun& l0, const PageRun& l1, bool with_copier) {
    std::vector<std::string> seen(2);
    bool complete_at_done = false;
    int bad_op = 0;
    std::promise<absl::Status> p;
    std::future<absl::Status> f = p.get_future();
    auto done = [&](absl::Status st) {
      complete_at_done = seen[0].size() == b0 && seen[1].size() == b1;
      p.set_value(std::move(st));
    };
    auto observe = [&](size_t op, std::span<const std::byte> bytes) {
      if (op >= seen.size()) {
        ++bad_op;
        return;
      }
      seen[op].append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    };
    ByteCopier copier = nullptr;
    if (with_copier) {
      copier = [&](size_t op, std::byte* dst, const std::byte* src, size_t n, bool /*stream*/) {
        ++copier_calls;
        std::memcpy(dst, src, n);
        observe(op, std::span<const std::byte>(dst, n));
      };
    }
    std::vector<TransferOp> ops = {{l0, dst0}, {l1, dst1}};
    const absl::Status s = put ? ep_->PutAsync(ops, done, observe, copier)
                               : ep_->GetAsync(ops, done, observe, copier);
    EXPECT_TRUE(s.ok()) << s;
    if (s.ok()) {
      EXPECT_TRUE(Await(std::move(f)).ok());
    }
    EXPECT_TRUE(complete_at_done);
    EXPECT_EQ(bad_op, 0);
    return seen;
  };

  for (const bool with_copier : {false, true}) {
    SCOPED_TRACE(with_copier ? "with a ByteCopier" : "observer only");
    for (size_t i = 0; i < client_mem_.size(); ++i) client_mem_[i] = static_cast<std::byte>(i * 131 + 7);
    FillPattern({owner_arena_->base(), owner_arena_->size()}, 5, 0);
    auto seen = run(/*put=*/true, src0, src1, with_copier);
    EXPECT_TRUE(seen[0] == obj0);
    EXPECT_TRUE(seen[1] == obj1);
    std::memset(client_mem_.data(), 0, client_mem_.size());
    const PageRun back0 = Local({30, 31, 32}, b0), back1 = Local({40}, b1);
    seen = run(/*put=*/false, back0, back1, with_copier);
    EXPECT_TRUE(seen[0] == obj0);
    EXPECT_TRUE(seen[1] == obj1);
    EXPECT_TRUE(as_string(Gather(*client_arena_, back0)) == obj0);
    EXPECT_TRUE(as_string(Gather(*client_arena_, back1)) == obj1);
  }
  // One-sided shared memory: this process copies every piece, so the copier did.
  if (ep_->protocol() == Protocol::kRma && GetParam().expected == Protocol::kRma) {
    EXPECT_GT(copier_calls, 0);
  }
  // A copier needs its observer (it sees what UCX moves): refused, nothing moves.
  const absl::Status refused = ep_->PutAsync(
      {{src0, dst0}}, [](absl::Status) { ADD_FAILURE() << "a refused batch calls back"; }, nullptr,
      [](size_t, std::byte*, const std::byte*, size_t, bool) {});
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(std::string(refused.message()).find("ByteObserver"), std::string::npos) << refused;
}

// A get of several messages (64 KiB segments travel alone over AM, where each is shown
// to the observer as it lands): every op's bytes in order, once, before the callback.
TEST_P(TransportTest, ObserverSeesAGetOfManyMessagesInOrder) {
  constexpr uint64_t kSegPages = (64 << 10) / kOwnerPage;
  auto remote_pages = [](std::initializer_list<uint64_t> starts) {
    std::vector<uint64_t> r;
    for (uint64_t s : starts) {
      for (uint64_t i = 0; i < kSegPages; ++i) r.push_back(s + i);
    }
    return r;
  };
  const std::vector<uint64_t> r0 = remote_pages({80, 0, 40}), r1 = remote_pages({160, 120});
  std::vector<uint64_t> l0(24), l1(16);
  std::iota(l0.begin(), l0.end(), 0);
  std::iota(l1.begin(), l1.end(), 24);
  FillPattern({owner_arena_->base(), owner_arena_->size()}, 77, 0);
  std::memset(client_mem_.data(), 0, client_mem_.size());
  auto expected = [&](const std::vector<uint64_t>& pages) {
    std::string e;
    for (uint64_t p : pages) e.append(reinterpret_cast<const char*>(owner_arena_->Page(p).data()), kOwnerPage);
    return e;
  };
  std::vector<std::string> seen(2);
  bool complete_at_done = false;
  std::promise<absl::Status> p;
  std::future<absl::Status> f = p.get_future();
  const absl::Status s = ep_->GetAsync(
      {{Local(l0), Remote(r0)}, {Local(l1), Remote(r1)}},
      [&](absl::Status st) {
        complete_at_done = seen[0].size() == r0.size() * kOwnerPage && seen[1].size() == r1.size() * kOwnerPage;
        p.set_value(std::move(st));
      },
      [&](size_t op, std::span<const std::byte> bytes) {
        if (op < seen.size()) seen[op].append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      });
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(Await(std::move(f)).ok());
  EXPECT_TRUE(complete_at_done);
  EXPECT_TRUE(seen[0] == expected(r0));
  EXPECT_TRUE(seen[1] == expected(r1));
  EXPECT_TRUE(std::string(reinterpret_cast<const char*>(client_mem_.data()), seen[0].size()) == seen[0]);
}

// Worker::Progress from the caller's thread: batches it polls for complete (their
// callbacks run on the polling thread or the progress thread); once the caller stops
// polling, the progress thread takes over the batches still in flight and new ones (it
// stays out only for a couple of milliseconds after the caller's last call). Then every
// byte is checked with gets that nobody polls for.
TEST_P(TransportTest, CallerPollsThenStopsAndTheProgressThreadTakesOver) {
  constexpr int kBatches = 16;  // one client page each, to owner pages 2i and 2i+1
  for (int i = 0; i < kBatches; ++i) {
    FillPattern(std::span<std::byte>(client_mem_.data() + i * kClientPage, kClientPage), 77, i * kClientPage);
  }
  std::vector<std::promise<absl::Status>> done(kBatches);
  std::vector<std::future<absl::Status>> futures;
  for (auto& d : done) futures.push_back(d.get_future());
  auto put = [&](int i) {
    const absl::Status s = ep_->PutAsync(
        {{Local({static_cast<uint64_t>(i)}), Remote({2ull * i, 2ull * i + 1})}},
        [&done, i](absl::Status st) { done[i].set_value(std::move(st)); });
    ASSERT_TRUE(s.ok()) << s;
  };
  auto ready = [&](int i) { return futures[i].wait_for(std::chrono::seconds(0)) == std::future_status::ready; };
  // The first half: submitted and polled for by this thread until all are done (a bound
  // of 60 s as the hang guard).
  for (int i = 0; i < kBatches / 2; ++i) put(i);
  const absl::Time end = absl::Now() + absl::Seconds(60);
  for (int i = 0; i < kBatches / 2; ++i) {
    while (!ready(i) && absl::Now() < end) client_->Progress();
    ASSERT_TRUE(ready(i)) << "batch " << i << " not done after 60 s of Worker::Progress";
  }
  // The second half: submitted right after the last poll, then nobody polls.
  for (int i = kBatches / 2; i < kBatches; ++i) put(i);
  for (int i = 0; i < kBatches; ++i) ASSERT_TRUE(Await(std::move(futures[i])).ok()) << "batch " << i;
  std::memset(client_mem_.data(), 0, client_mem_.size());
  for (int i = 0; i < kBatches; ++i) {
    ASSERT_TRUE(Await(ep_->Get({{Local({static_cast<uint64_t>(kBatches + i)}),
                                 Remote({2ull * i, 2ull * i + 1})}}))
                    .ok());
    EXPECT_EQ(FirstMismatch(std::span<const std::byte>(client_mem_.data() + (kBatches + i) * kClientPage,
                                                       kClientPage),
                            77, i * kClientPage),
              -1)
        << "batch " << i;
  }
}

// A caller may drop its local Arena while a batch on it is in flight (the worker holds
// it meanwhile). The observer of bytes UCX moved runs just before `done`, after the
// batch is freed: it must still find the arena alive (it read the pages of a destroyed,
// detached arena before). The observer only checks, it does not touch the bytes.
TEST_P(TransportTest, ObserverRunsWhileTheDroppedLocalArenaIsStillHeld) {
  for (const bool put : {false, true}) {
    SCOPED_TRACE(put ? "put" : "get");
    absl::StatusOr<std::shared_ptr<Arena>> made = client_->AllocateArena(kClientPages * kClientPage, kClientPage);
    ASSERT_TRUE(made.ok()) << made.status();
    std::shared_ptr<Arena> arena = *std::move(made);  // the caller's only reference
    const std::weak_ptr<Arena> w = arena;
    std::atomic<bool> alive{true};
    std::atomic<int> seen{0};
    auto p = std::make_shared<std::promise<absl::Status>>();
    std::future<absl::Status> f = p->get_future();
    std::vector<TransferOp> ops = {{{arena->id(), {0, 1}, 0}, Remote({0, 1, 2, 3})}};
    auto done = [p](absl::Status s) { p->set_value(std::move(s)); };
    auto observe = [&](size_t, std::span<const std::byte>) {
      ++seen;
      alive = alive && !w.expired();
    };
    ASSERT_TRUE((put ? ep_->PutAsync(std::move(ops), done, observe) : ep_->GetAsync(std::move(ops), done, observe)).ok());
    arena.reset();
    ASSERT_TRUE(f.get().ok());
    EXPECT_GT(seen.load(), 0);
    EXPECT_TRUE(alive.load());
  }
}

INSTANTIATE_TEST_SUITE_P(Tcp, TcpTransportTest,
                         ::testing::Values(Mode{"TcpAuto", "tcp", Protocol::kAuto, Protocol::kActiveMessage}),
                         [](const ::testing::TestParamInfo<Mode>& i) { return std::string(i.param.name); });

INSTANTIATE_TEST_SUITE_P(
    Protocols, TransportTest,
    ::testing::Values(Mode{"ShmAuto", "sm,self", Protocol::kAuto, Protocol::kRma},
                      Mode{"ShmAm", "sm,self", Protocol::kActiveMessage, Protocol::kActiveMessage},
                      Mode{"TcpAuto", "tcp", Protocol::kAuto, Protocol::kActiveMessage}),
    [](const ::testing::TestParamInfo<Mode>& i) { return std::string(i.param.name); });

// An owner whose arena fell back to UCX's own allocation (a failing shmget, see
// g_fail_shmget; mapped by UCX, not by this code) and a client connected to it over
// shared memory, with a registered arena of 4 pages of 0x5A.
class FallbackArena : public ::testing::Test {
 protected:
  void SetUp() override {
    ContextOptions co;
    co.ucx_config.push_back({"TLS", "sm,self"});
    auto oc = Context::Create(co);
    ASSERT_TRUE(oc.ok()) << oc.status();
    auto cc = Context::Create(co);
    ASSERT_TRUE(cc.ok()) << cc.status();
    oc_ = *oc;
    cc_ = *cc;
    auto owner = Worker::Create(oc_, {});
    ASSERT_TRUE(owner.ok()) << owner.status();
    owner_ = *std::move(owner);
    auto client = Worker::Create(cc_, {});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    g_fail_shmget.store(true);
    auto oa = owner_->AllocateArena(16 * kOwnerPage, kOwnerPage);
    g_fail_shmget.store(false);
    ASSERT_TRUE(oa.ok()) << oa.status();
    oa_ = *oa;
    ASSERT_EQ(oa_->descriptor().shm_id, -1) << "the arena did not fall back to UCX's allocation";
    auto ca = client_->RegisterArena(mem_, kClientPage);
    ASSERT_TRUE(ca.ok()) << ca.status();
    ca_ = *ca;
    auto ep = client_->Connect(owner_->address(), "owner");
    ASSERT_TRUE(ep.ok()) << ep.status();
    ep_ = *ep;
  }
  // Destroyed in reverse: the endpoint and arenas before the workers and contexts.
  std::shared_ptr<Context> oc_, cc_;
  std::unique_ptr<Worker> owner_, client_;
  std::shared_ptr<Arena> oa_;
  std::vector<std::byte> mem_ = std::vector<std::byte>(4 * kClientPage, std::byte{0x5A});
  std::shared_ptr<Arena> ca_;
  std::shared_ptr<Endpoint> ep_;
};

// A client Worker destroyed while one of its threads copies into an owner's fallback
// arena (mapped by UCX, not by this code) waits for that copy: the mapping goes with the
// rkey, which Shutdown used to destroy under the running memcpy (a fault, or bytes
// landing in whatever was mapped there next).
TEST_F(FallbackArena, WorkerDestroyedDuringAMappedCopyKeepsTheMappingUntilItEnds) {
  ASSERT_TRUE(ep_->ImportArena(oa_->descriptor()).ok());
  ASSERT_EQ(ep_->protocol(), Protocol::kRma);

  std::promise<void> entered;
  std::atomic<bool> destroying{false};
  std::atomic<int> copies{0}, unmapped{0};
  ByteCopier copier = [&](size_t, std::byte* dst, const std::byte* src, size_t n, bool) {
    if (copies.fetch_add(1) == 0) {
      entered.set_value();
      while (!destroying.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      // Time for a Shutdown that does not wait to get as far as destroying the rkeys.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    unsigned char v;
    auto* page = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(dst) & ~uintptr_t{4095});
    if (mincore(page, 4096, &v) != 0) {  // ENOMEM: nothing is mapped there any more
      unmapped.fetch_add(1);
      return;
    }
    std::memcpy(dst, src, n);
  };
  std::promise<absl::Status> done;
  std::thread submitter([&] {
    std::vector<TransferOp> ops(1);
    ops[0].local = PageRun{ca_->id(), {0, 1}, 2 * kClientPage};
    ops[0].remote = PageRun{oa_->descriptor().arena_id, {0, 1, 2, 3}, 2 * kClientPage};
    absl::Status st = ep_->PutAsync(
        std::move(ops), [&](absl::Status s) { done.set_value(std::move(s)); },
        [](size_t, std::span<const std::byte>) {}, copier);
    if (!st.ok()) done.set_value(st);
  });
  std::future<absl::Status> result = done.get_future();
  if (entered.get_future().wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    destroying.store(true);
    submitter.join();
    FAIL() << "the put was not copied by this process: " << result.get();
  }
  destroying.store(true);
  ep_.reset();
  client_.reset();  // waits for the copy above
  submitter.join();
  EXPECT_EQ(unmapped.load(), 0);
  EXPECT_TRUE(result.get().ok());
}

// A descriptor of a fallback arena that claims more bytes than the owner allocated
// (forged, or another arena's size), or another base, is refused by the batches that
// name it: UCX maps the owner's allocation, ucp_rkey_ptr only adds offsets, so a page
// past its end (or off a wrong base) would be copied outside the mapping (a fault, or
// bytes in whatever is mapped there). The descriptor's own pages within the real size
// are refused too: the import is unusable.
TEST_F(FallbackArena, ADescriptorThatDoesNotMatchTheMappingIsRefused) {
  RemoteArena forged = oa_->descriptor();
  forged.size += uint64_t{1} << 30;  // 1 GiB more than UCX allocated and mapped
  ASSERT_TRUE(ep_->ImportArena(forged).ok());
  ASSERT_EQ(ep_->protocol(), Protocol::kRma);
  const uint64_t far_page = forged.num_pages() - 2;  // well past the owner's 16 pages
  for (const uint64_t page : {far_page, uint64_t{0}}) {
    SCOPED_TRACE(page);
    std::vector<TransferOp> ops(1);
    ops[0].local = PageRun{ca_->id(), {0}, kOwnerPage};
    ops[0].remote = PageRun{forged.arena_id, {page}, kOwnerPage};
    absl::Status st = Await(ep_->Put(std::move(ops)));
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), "does not describe the owner's arena")) << st;
  }
  // A base that is not the segment's: a page into it (with the size cut to fit), or far
  // below it (somewhere else in this process, or nowhere).
  for (const int64_t shift : {int64_t{4096}, -(int64_t{1} << 30)}) {
    SCOPED_TRACE(shift);
    RemoteArena moved = oa_->descriptor();
    moved.base += static_cast<uint64_t>(shift);
    if (shift > 0) moved.size -= kOwnerPage;
    ASSERT_TRUE(ep_->ImportArena(moved).ok());
    std::vector<TransferOp> ops(1);
    ops[0].local = PageRun{ca_->id(), {0}, kOwnerPage};
    ops[0].remote = PageRun{moved.arena_id, {0}, kOwnerPage};
    absl::Status st = Await(ep_->Put(std::move(ops)));
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), "does not describe the owner's arena")) << st;
  }
  // The owner's own descriptor, imported again, works.
  ASSERT_TRUE(ep_->ImportArena(oa_->descriptor()).ok());
  std::vector<TransferOp> ops(1);
  ops[0].local = PageRun{ca_->id(), {0}, kOwnerPage};
  ops[0].remote = PageRun{forged.arena_id, {15}, kOwnerPage};
  EXPECT_TRUE(Await(ep_->Put(std::move(ops))).ok());
  EXPECT_EQ(oa_->base()[15 * kOwnerPage], std::byte{0x5A});
}

// An arena imported again (same arena id, another descriptor) while a large RMA put to
// the first import is in flight: that put still goes to the first import's memory with
// its rkey, which stays alive until the put is done (before, the next batch destroyed
// the replaced rkey under the put's UCX requests, and a batch validated before a
// re-import could pair its offsets with the new base). Owner memory is registered, not
// allocated, so UCX moves it with requests the owner answers (not an inline memcpy).
class ReimportTest : public ::testing::TestWithParam<const char*> {};

TEST_P(ReimportTest, ReimportWhileAPutIsInFlightKeepsTheFirstImport) {
  constexpr uint64_t kPage = 4096, kPages = 1024;  // 4 MiB
  ContextOptions co;
  co.ucx_config.push_back({"TLS", GetParam()});
  WorkerOptions wo;
  wo.protocol = Protocol::kRma;
  auto oc = Context::Create(co);
  ASSERT_TRUE(oc.ok()) << oc.status();
  auto cc = Context::Create(co);
  ASSERT_TRUE(cc.ok()) << cc.status();
  auto owner = Worker::Create(*oc, wo);
  ASSERT_TRUE(owner.ok()) << owner.status();
  auto client = Worker::Create(*cc, wo);
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<std::byte> amem(kPages * kPage), bmem(kPages * kPage), cmem(kPages * kPage);
  auto a = (*owner)->RegisterArena(amem, kPage);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = (*owner)->RegisterArena(bmem, kPage);
  ASSERT_TRUE(b.ok()) << b.status();
  auto c = (*client)->RegisterArena(cmem, kPage);
  ASSERT_TRUE(c.ok()) << c.status();
  auto ep = (*client)->Connect((*owner)->address(), "owner");
  ASSERT_TRUE(ep.ok()) << ep.status();
  ASSERT_EQ((*ep)->protocol(), Protocol::kRma);
  const RemoteArena first = (*a)->descriptor();
  RemoteArena second = (*b)->descriptor();
  second.arena_id = first.arena_id;  // the same arena id, imported again elsewhere
  std::vector<uint64_t> all(kPages);
  std::iota(all.begin(), all.end(), 0);
  FillPattern({cmem.data(), cmem.size()}, 41, 0);
  for (int round = 0; round < 4; ++round) {
    std::memset(amem.data(), 0, amem.size());
    std::memset(bmem.data(), 0, bmem.size());
    ASSERT_TRUE((*ep)->ImportArena(first).ok());
    auto big = (*ep)->Put({{{(*c)->id(), all, 0}, {first.arena_id, all, 0}}});
    const bool in_flight = (*client)->stats().batches_in_flight > 0;
    // Re-imported while the put runs, then a batch on the new import (the old code
    // destroyed the replaced rkey here) and another re-import.
    ASSERT_TRUE((*ep)->ImportArena(second).ok());
    auto small = (*ep)->Put({{{(*c)->id(), {3}, 0}, {first.arena_id, {7}, 0}}});
    ASSERT_TRUE((*ep)->ImportArena(first).ok());
    ASSERT_TRUE(Await(std::move(big)).ok()) << "round " << round;
    ASSERT_TRUE(Await(std::move(small)).ok()) << "round " << round;
    EXPECT_EQ(FirstMismatch({amem.data(), amem.size()}, 41, 0), -1) << "round " << round;
    EXPECT_EQ(FirstMismatch({bmem.data() + 7 * kPage, kPage}, 41, 3 * kPage), -1) << "round " << round;
    auto zero = [](std::byte x) { return x == std::byte{0}; };
    EXPECT_TRUE(std::all_of(bmem.begin(), bmem.begin() + 7 * kPage, zero) &&
                std::all_of(bmem.begin() + 8 * kPage, bmem.end(), zero))
        << "round " << round;
    if (round == 0) std::printf("first put in flight at the re-import: %d\n", in_flight ? 1 : 0);
  }
  ep->reset();
}

INSTANTIATE_TEST_SUITE_P(Transports, ReimportTest, ::testing::Values("tcp", "sm,self"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           return std::string(i.param[0] == 't' ? "Tcp" : "Shm");
                         });

// The context's tcp receive segment (ContextOptions::tcp_rx_seg_size) reaches UCX's tcp
// transport, and contexts without tcp do not get it (UCX warns about a transport key no
// enabled transport takes): a worker made from each prints no "invalid configuration",
// while a value tcp cannot parse does.
TEST(ContextTest, TcpReceiveSegmentReachesTcpOnly) {
  // A UCX_TCP_RX_SEG_SIZE in the environment wins over the option: the test runs without
  // it and puts it back after.
  struct EnvGuard {
    const char* saved = std::getenv("UCX_TCP_RX_SEG_SIZE");
    std::string value = saved != nullptr ? saved : "";
    EnvGuard() { unsetenv("UCX_TCP_RX_SEG_SIZE"); }
    ~EnvGuard() {
      if (saved != nullptr) setenv("UCX_TCP_RX_SEG_SIZE", value.c_str(), 1);
    }
  } env_guard;
  auto warnings = [](const std::string& tls, const std::string& seg) {
    ContextOptions co;
    co.ucx_config = {{"TLS", tls}};
    co.tcp_rx_seg_size = seg;
    // UCX logs to stdout unless UCX_LOG_FILE says otherwise.
    std::fflush(stdout);
    ::testing::internal::CaptureStdout();
    ::testing::internal::CaptureStderr();
    auto c = Context::Create(co);
    absl::StatusOr<std::shared_ptr<Worker>> w = absl::UnknownError("no context");
    if (c.ok()) w = Worker::Create(*c);
    std::fflush(stdout);
    const std::string err =
        ::testing::internal::GetCapturedStderr() + ::testing::internal::GetCapturedStdout();
    EXPECT_TRUE(c.ok()) << tls << ": " << c.status();
    EXPECT_TRUE(w.ok()) << tls << ": " << w.status();
    return err;
  };
  for (const std::string tls : {"tcp", "sm,cma,self", "^tcp", "self,tcp"}) {
    const std::string err = warnings(tls, "1m");
    EXPECT_EQ(err.find("invalid configuration"), std::string::npos) << tls << ": " << err;
  }
  // The control: tcp does read the key (and rejects what it cannot parse).
  const std::string err = warnings("tcp", "not-a-size");
  EXPECT_NE(err.find("RX_SEG_SIZE"), std::string::npos) << err;
}

// With UCX's default (every transport enabled), two workers on one host talk over shared
// memory, not tcp loopback (PEER error handling would restrict UCX to tcp).
TEST(SameHostTest, DefaultTransportsUseSharedMemory) {
  if (std::getenv("UCX_TLS") != nullptr) GTEST_SKIP() << "UCX_TLS is set in the environment";
  auto oc = Context::Create();
  ASSERT_TRUE(oc.ok()) << oc.status();
  auto cc = Context::Create();
  ASSERT_TRUE(cc.ok()) << cc.status();
  if (!(*cc)->shared_memory_capable()) GTEST_SKIP() << "no shared-memory transport here";
  auto ow = Worker::Create(*oc);
  ASSERT_TRUE(ow.ok()) << ow.status();
  auto cw = Worker::Create(*cc);
  ASSERT_TRUE(cw.ok()) << cw.status();
  auto oa = (*ow)->AllocateArena(16 * 4096, 4096);
  ASSERT_TRUE(oa.ok()) << oa.status();
  auto ca = (*cw)->AllocateArena(16 * 4096, 4096);
  ASSERT_TRUE(ca.ok()) << ca.status();
  auto ep = (*cw)->Connect((*ow)->address(), "owner");
  ASSERT_TRUE(ep.ok()) << ep.status();
  ASSERT_TRUE((*ep)->ImportArena((*oa)->descriptor()).ok());
  const std::string lanes = (*ep)->Describe();
  EXPECT_EQ(lanes.find("tcp/"), std::string::npos) << lanes;
  const bool shm = lanes.find("sysv/") != std::string::npos ||
                   lanes.find("posix/") != std::string::npos ||
                   lanes.find("cma/") != std::string::npos;
  EXPECT_TRUE(shm) << lanes;
  for (int i = 0; i < 4096; ++i) (*ca)->base()[4096 + i] = static_cast<std::byte>(i * 7 + 1);
  const TransferOp op{{(*ca)->id(), {1}, 0}, {(*oa)->id(), {5}, 0}};
  ASSERT_TRUE(Await((*ep)->Put({op})).ok());
  EXPECT_EQ(std::memcmp((*oa)->base() + 5 * 4096, (*ca)->base() + 4096, 4096), 0);
  const TransferOp back{{(*ca)->id(), {9}, 0}, {(*oa)->id(), {5}, 0}};
  ASSERT_TRUE(Await((*ep)->Get({back})).ok());
  EXPECT_EQ(std::memcmp((*ca)->base() + 9 * 4096, (*ca)->base() + 4096, 4096), 0);
  ep->reset();
}

// /proc/self/smaps: per mapping of SysV segment `shm_id` (its inode there), the kB its
// "ShmemPmdMapped" line gives (mapped with 2 MiB pages).
std::vector<uint64_t> SegmentMappings(int64_t shm_id) {
  std::ifstream in("/proc/self/smaps");
  std::vector<uint64_t> out;
  bool in_segment = false;
  for (std::string line; std::getline(in, line);) {
    char range[64], perms[8], dev[16], path[64] = "";
    unsigned long long offset = 0, inode = 0;
    if (std::sscanf(line.c_str(), "%63s %7s %llx %15s %llu %63s", range, perms, &offset, dev, &inode, path) >= 5 &&
        std::strchr(range, '-') != nullptr) {
      in_segment = std::strncmp(path, "/SYSV", 5) == 0 && inode == static_cast<uint64_t>(shm_id);
      if (in_segment) out.push_back(0);
      continue;
    }
    unsigned long long kb = 0;
    if (in_segment && std::sscanf(line.c_str(), "ShmemPmdMapped: %llu kB", &kb) == 1) out.back() = kb;
  }
  return out;
}

// AllocateArena makes a SysV segment of its own, mapped at a 2 MiB boundary with 2 MiB
// pages where the kernel can collapse them (on this project's VMs, 4 KiB-page mappings
// made scattered copies ~10x slower); a same-host peer maps it the same way; it is gone
// once the last mapping is.
TEST(SameHostTest, AllocatedArenaIsAHugePageSegmentGoneWithItsLastMapping) {
  if (std::getenv("UCX_TLS") != nullptr) GTEST_SKIP() << "UCX_TLS is set in the environment";
  auto oc = Context::Create();
  ASSERT_TRUE(oc.ok()) << oc.status();
  if (!(*oc)->shared_memory_capable()) GTEST_SKIP() << "no shared-memory transport here";
  auto ow = Worker::Create(*oc);
  ASSERT_TRUE(ow.ok()) << ow.status();
  auto cw = Worker::Create(*oc);
  ASSERT_TRUE(cw.ok()) << cw.status();
  constexpr uint64_t kSize = 8 << 20, kPage = 64 << 10;
  auto oa = (*ow)->AllocateArena(kSize, kPage);
  ASSERT_TRUE(oa.ok()) << oa.status();
  const RemoteArena d = (*oa)->descriptor();  // a copy: the arena goes before the end
  if (d.shm_id < 0) GTEST_SKIP() << "no SysV shared memory here (UCX allocated the arena)";
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*oa)->base()) % (2 << 20), 0u);
  EXPECT_EQ(d.owner_pid, static_cast<uint32_t>(getpid()));
  EXPECT_FALSE(d.shm_host.empty());
  auto ca = (*cw)->AllocateArena(kSize, kPage);
  ASSERT_TRUE(ca.ok()) << ca.status();
  {
    auto ep = (*cw)->Connect((*ow)->address(), "owner");
    ASSERT_TRUE(ep.ok()) << ep.status();
    ASSERT_TRUE((*ep)->ImportArena(d).ok());
    for (uint64_t i = 0; i < kSize; ++i) (*ca)->base()[i] = static_cast<std::byte>(i * 13 + 5);
    const TransferOp op{{(*ca)->id(), {3, 9, 100}, 0}, {(*oa)->id(), {120, 7, 64}, 0}};
    ASSERT_TRUE(Await((*ep)->Put({op})).ok());
    EXPECT_EQ(std::memcmp((*oa)->base() + 120 * kPage, (*ca)->base() + 3 * kPage, kPage), 0);
    EXPECT_EQ(std::memcmp((*oa)->base() + 7 * kPage, (*ca)->base() + 9 * kPage, kPage), 0);
    EXPECT_EQ(std::memcmp((*oa)->base() + 64 * kPage, (*ca)->base() + 100 * kPage, kPage), 0);
    // A contiguous run of 37 pages (2.3 MiB) moves as one segment, copied in 256 KiB
    // pieces with a short last one: every byte lands and none past the run.
    std::vector<uint64_t> src(37), dst(37);
    std::iota(src.begin(), src.end(), 10);
    std::iota(dst.begin(), dst.end(), 80);
    ASSERT_TRUE(Await((*ep)->Put({{{(*ca)->id(), src, 0}, {(*oa)->id(), dst, 0}}})).ok());
    EXPECT_EQ(std::memcmp((*oa)->base() + 80 * kPage, (*ca)->base() + 10 * kPage, 37 * kPage), 0);
    const std::vector<std::byte> zeros(kPage);
    EXPECT_EQ(std::memcmp((*oa)->base() + 117 * kPage, zeros.data(), kPage), 0) << "bytes past the run";
    for (uint64_t i = 0; i < 37 * kPage; ++i) (*oa)->base()[80 * kPage + i] = static_cast<std::byte>(i * 7 + 1);
    const std::vector<std::byte> after((*ca)->base() + 47 * kPage, (*ca)->base() + 48 * kPage);
    ASSERT_TRUE(Await((*ep)->Get({{{(*ca)->id(), src, 0}, {(*oa)->id(), dst, 0}}})).ok());
    EXPECT_EQ(std::memcmp((*ca)->base() + 10 * kPage, (*oa)->base() + 80 * kPage, 37 * kPage), 0);
    EXPECT_EQ(std::memcmp((*ca)->base() + 47 * kPage, after.data(), kPage), 0) << "bytes past the run";
    // The owner's mapping and the peer's own (this process plays both).
    const std::vector<uint64_t> maps = SegmentMappings(d.shm_id);
    ASSERT_EQ(maps.size(), 2u);
    struct utsname u {};
    uname(&u);
    int major = 0, minor = 0;
    std::sscanf(u.release, "%d.%d", &major, &minor);
    if (major > 6 || (major == 6 && minor >= 1)) {  // MADV_COLLAPSE
      EXPECT_GT(maps[0], 0u) << "owner's mapping has no 2 MiB pages";
      EXPECT_GT(maps[1], 0u) << "peer's mapping has no 2 MiB pages";
    }
    ep->reset();
  }
  cw->reset();  // the peer's import (and its mapping) goes with its worker
  EXPECT_EQ(SegmentMappings(d.shm_id).size(), 1u);
  oa->reset();
  EXPECT_TRUE(SegmentMappings(d.shm_id).empty());
  struct shmid_ds ds {};
  EXPECT_NE(shmctl(static_cast<int>(d.shm_id), IPC_STAT, &ds), 0) << "segment left behind";
}

TEST(RemoteArenaTest, SerializeParseRoundTripAndRejectsGarbage) {
  RemoteArena a{.arena_id = 7, .base = 0x7f0000001000, .size = 1 << 20, .page_bytes = 4096,
                .rkey = std::string("\x01\x02\x00\x03", 4), .shm_id = -1, .owner_pid = 0,
                .shm_host = ""};
  auto b = RemoteArena::Parse(a.Serialize());
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->arena_id, 7u);
  EXPECT_EQ(b->base, a.base);
  EXPECT_EQ(b->size, a.size);
  EXPECT_EQ(b->page_bytes, a.page_bytes);
  EXPECT_EQ(b->rkey, a.rkey);
  std::string s = a.Serialize();
  EXPECT_FALSE(RemoteArena::Parse(s.substr(0, s.size() - 1)).ok());
  EXPECT_FALSE(RemoteArena::Parse(s + "x").ok());
  EXPECT_FALSE(RemoteArena::Parse("nope").ok());
  RemoteArena odd = a;
  odd.size = 4097;
  EXPECT_FALSE(RemoteArena::Parse(odd.Serialize()).ok());
  // With a same-host export (version 2): the segment id, owner and host come back.
  RemoteArena shm = a;
  shm.shm_id = 123456;
  shm.owner_pid = 4321;
  shm.shm_host = "host/4026531836/ipc:4026531839";
  const std::string s2 = shm.Serialize();
  auto c = RemoteArena::Parse(s2);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->shm_id, 123456);
  EXPECT_EQ(c->owner_pid, 4321u);
  EXPECT_EQ(c->shm_host, shm.shm_host);
  EXPECT_EQ(c->rkey, a.rkey);
  EXPECT_FALSE(RemoteArena::Parse(s2.substr(0, s2.size() - 1)).ok());
  EXPECT_FALSE(RemoteArena::Parse(s2 + "x").ok());
  // Without one, the version-1 form, as before.
  EXPECT_EQ(s.substr(0, 4), "KVA1");
  EXPECT_EQ(s2.substr(0, 4), "KVA2");
}

}  // namespace
}  // namespace kvpool::transport
