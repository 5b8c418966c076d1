// kvpool-node end to end over real loopback gRPC and UCX: the client library's puts and
// gets through each tier, the wire errors, health, metrics and router events.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "absl/synchronization/notification.h"
#include "kvpool/pool_node/client.h"
#include "kvpool/pool_node/node_server.h"
#include "kvpool/transport/transport.h"
#include "kvpool/v1/pool.grpc.pb.h"
#include "kvpool/v1/router.grpc.pb.h"
#include "pool_service.h"
#include "test_util.h"

namespace kvpool::pool_node {
namespace {

using testing::Bytes;
using testing::H;
using testing::Pattern;

constexpr uint64_t kNodePage = 64 << 10;
constexpr uint64_t kLocalPage = 32 << 10;  // differs from the node's on purpose

// Appends an ATTN_KV entry (no parent) to a raw Reserve request.
v1::ReserveEntry* AddKvEntry(v1::ReserveRequest& req, BlockHash h, uint64_t length) {
  v1::ReserveEntry* e = req.add_entries();
  e->set_block_hash(h.ToBytes());
  e->set_kind(v1::STATE_KIND_ATTN_KV);
  e->set_length(length);
  return e;
}

// A real gRPC router endpoint that records what the node publishes.
class RecordingRouter final : public v1::Router::Service {
 public:
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* req, v1::RegisterResponse* resp) override {
    absl::MutexLock l(&mu_);
    ++registrations_;
    kind_ = req->kind();
    source_ids_.push_back(req->source_id());
    resp->set_heartbeat_interval_ms(100);
    resp->set_next_sequence(1);
    return grpc::Status::OK;
  }
  grpc::Status PublishEvents(grpc::ServerContext*, grpc::ServerReader<v1::EventBatch>* reader,
                             v1::PublishEventsResponse*) override {
    v1::EventBatch b;
    while (reader->Read(&b)) {
      absl::MutexLock l(&mu_);
      batches_.push_back(b);
    }
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*, v1::HeartbeatResponse* resp) override {
    absl::MutexLock l(&mu_);
    if (ask_dump_) {
      resp->set_full_dump_requested(true);
      ask_dump_ = false;
    }
    return grpc::Status::OK;
  }
  void AskForDump() {
    absl::MutexLock l(&mu_);
    ask_dump_ = true;
  }
  // Waits (bounded) until `pred` holds over the batches received so far.
  bool WaitFor(const std::function<bool(const std::vector<v1::EventBatch>&)>& pred) {
    absl::MutexLock l(&mu_);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pred(batches_); };
    return mu_.AwaitWithTimeout(absl::Condition(&cond), absl::Seconds(30));
  }
  std::vector<v1::EventBatch> batches() {
    absl::MutexLock l(&mu_);
    return batches_;
  }
  int registrations() {
    absl::MutexLock l(&mu_);
    return registrations_;
  }
  // Waits (bounded) until some source registered; returns the source ids so far.
  std::vector<std::string> WaitForRegistration() {
    absl::MutexLock l(&mu_);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !source_ids_.empty(); };
    mu_.AwaitWithTimeout(absl::Condition(&cond), absl::Seconds(30));
    return source_ids_;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::EventBatch> batches_ ABSL_GUARDED_BY(mu_);
  int registrations_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> source_ids_ ABSL_GUARDED_BY(mu_);
  v1::SourceKind kind_ ABSL_GUARDED_BY(mu_) = v1::SOURCE_KIND_UNSPECIFIED;
  bool ask_dump_ ABSL_GUARDED_BY(mu_) = false;
};

// A UCX worker and an arena of `pages` local pages registered with it.
void NewWorkerAndArena(uint64_t pages, std::unique_ptr<transport::Worker>* worker,
                       std::shared_ptr<transport::Arena>* arena, transport::WorkerOptions wo = {}) {
  auto ctx = transport::Context::Create();
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  auto w = transport::Worker::Create(*ctx, wo);
  ASSERT_TRUE(w.ok()) << w.status();
  auto a = (*w)->AllocateArena(pages * kLocalPage, kLocalPage);
  ASSERT_TRUE(a.ok()) << a.status();
  *worker = std::move(*w);
  *arena = std::move(*a);
}

// A node of 16 DRAM pages on a free loopback port, no metrics, no background thread.
NodeConfig SmallNode() {
  NodeConfig cfg;
  cfg.listen = "127.0.0.1:0";
  cfg.metrics_port = -1;
  cfg.pool.page_bytes = kNodePage;
  cfg.pool.dram_bytes = 16 * kNodePage;
  cfg.pool.background = false;
  return cfg;
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder rb;
    rb.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &router_port_);
    rb.RegisterService(&router_);
    router_server_ = rb.BuildAndStart();
    ASSERT_NE(router_server_, nullptr);

    NodeConfig cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.router = "127.0.0.1:" + std::to_string(router_port_);
    cfg.metrics_port = 0;
    cfg.pool.node_id = "node-test";
    cfg.pool.page_bytes = kNodePage;
    cfg.pool.dram_bytes = 64 * kNodePage;  // 4 MiB
    cfg.pool.nvme_dir = dir_.path();
    cfg.pool.nvme_bytes = 256 * kNodePage;
    cfg.pool.background = false;  // the test demotes explicitly
    auto node = NodeServer::Start(cfg);
    ASSERT_TRUE(node.ok()) << node.status();
    node_ = std::move(*node);
    address_ = "127.0.0.1:" + std::to_string(node_->port());

    ASSERT_NO_FATAL_FAILURE(NewWorkerAndArena(256, &worker_, &arena_));
    auto client = PoolClient::Connect({address_, "test-client", worker_.get(), arena_});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    stub_ = v1::PoolNode::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    client_.reset();
    node_.reset();
    if (router_server_) router_server_->Shutdown();
  }

  // Writes Pattern(seed) into local pages [first, first + n) of `base` (default: the
  // fixture's arena) and returns them.
  std::vector<uint64_t> Stage(uint64_t seed, uint64_t length, uint64_t first, std::byte* base = nullptr) {
    if (base == nullptr) base = arena_->base();
    const std::string bytes = Pattern(seed, length);
    std::vector<uint64_t> pages;
    for (uint64_t off = 0, p = first; off < length; off += kLocalPage, ++p) {
      std::memcpy(base + p * kLocalPage, bytes.data() + off, std::min(kLocalPage, length - off));
      pages.push_back(p);
    }
    return pages;
  }
  // Local destination pages for each of the lease's objects, from page `first` of `base`
  // (default: the fixture's arena), filled with 0xCD.
  std::vector<std::vector<uint64_t>> Destinations(const PoolLease& lease, uint64_t first,
                                                  std::byte* base = nullptr) {
    if (base == nullptr) base = arena_->base();
    std::vector<std::vector<uint64_t>> dst;
    for (const RemoteObject& obj : lease.objects) {
      std::vector<uint64_t> pages;
      for (uint64_t off = 0; off < obj.length; off += kLocalPage) pages.push_back(first++);
      for (uint64_t q : pages) std::memset(base + q * kLocalPage, 0xCD, kLocalPage);
      dst.push_back(pages);
    }
    return dst;
  }
  // A parent-linked chain staged from local page 0 of `base`: item i holds
  // Pattern(seed + i, lengths[i]) and is keyed H(key + i).
  // A second client on this fixture's worker and arena, cutting Puts into pieces of
  // `pipeline_bytes`.
  std::unique_ptr<PoolClient> ConnectPipelined(const std::string& client_id, uint64_t pipeline_bytes) {
    PoolClientOptions o = ClientOptions(client_id);
    o.put_pipeline_bytes = pipeline_bytes;
    return ConnectWith(o);
  }
  // Options of another client on this fixture's worker and arena, and its connection.
  PoolClientOptions ClientOptions(const std::string& client_id) {
    PoolClientOptions o;
    o.node_address = address_;
    o.client_id = client_id;
    o.worker = worker_.get();
    o.local_arena = arena_;
    return o;
  }
  std::unique_ptr<PoolClient> ConnectWith(const PoolClientOptions& o) {
    auto client = PoolClient::Connect(o);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  std::vector<PutItem> StageChain(uint64_t seed, uint64_t key, const std::vector<uint64_t>& lengths,
                                  std::byte* base = nullptr) {
    std::vector<PutItem> items;
    std::optional<BlockHash> parent;
    uint64_t next = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      auto pages = Stage(seed + i, lengths[i], next, base);
      next += pages.size();
      items.push_back(PutItem{H(key + i), parent, StateKind::kAttnKv, pages, lengths[i]});
      parent = H(key + i);
    }
    return items;
  }
  std::string LocalBytes(const std::vector<uint64_t>& pages, uint64_t length, std::byte* base = nullptr) {
    if (base == nullptr) base = arena_->base();
    std::string out;
    for (uint64_t p : pages) {
      const uint64_t n = std::min(kLocalPage, length - out.size());
      out.append(reinterpret_cast<const char*>(base + p * kLocalPage), n);
    }
    return out;
  }

  testing::TempDir dir_;
  RecordingRouter router_;
  int router_port_ = 0;
  std::unique_ptr<grpc::Server> router_server_;
  std::unique_ptr<NodeServer> node_;
  std::string address_;
  std::unique_ptr<transport::Worker> worker_;
  std::shared_ptr<transport::Arena> arena_;
  std::unique_ptr<PoolClient> client_;
  std::unique_ptr<v1::PoolNode::Stub> stub_;
};

// A Put larger than put_pipeline_bytes goes out as several Reserve / transfer / Commit
// pieces; every item lands byte-exact, a repeat finds them present, and ReleaseAsync
// ends the lease (the client waits for it when destroyed).
TEST_F(ServiceTest, PipelinedPutAcrossPiecesAndAsyncReleaseAreByteExact) {
  auto client = ConnectPipelined("pipelined", 100'000);  // a piece every one or two items
  ASSERT_NE(client, nullptr);
  const std::vector<uint64_t> lengths = {65'536, 1, 150'001, 99'999, 131'072, 7, 200'000, 40'000};
  const std::vector<PutItem> items = StageChain(100, 500, lengths);
  auto put = client->Put(items);
  ASSERT_TRUE(put.ok()) << put.status();
  ASSERT_EQ(put->size(), items.size());
  for (const auto& s : *put) EXPECT_TRUE(s.ok()) << s;
  auto again = client->Put(items);
  ASSERT_TRUE(again.ok()) << again.status();
  for (const auto& s : *again) EXPECT_TRUE(s.ok()) << s;
  // Both calls are in the phase timings, and the phases are parts of the calls' time.
  const PutPhases ph = client->put_phases();
  EXPECT_EQ(ph.calls, 2u);
  EXPECT_GT(ph.transfer_s, 0.0);
  EXPECT_GT(ph.rpc_send_s, 0.0);
  EXPECT_LE(ph.transfer_s + ph.reserve_wait_s + ph.rpc_send_s + ph.final_wait_s, ph.total_s);

  std::vector<BlockHash> chain;
  for (size_t i = 0; i < lengths.size(); ++i) chain.push_back(H(500 + i));
  auto lease = client->Lookup(chain);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->prefix_blocks, lengths.size());
  const std::vector<std::vector<uint64_t>> dst = Destinations(*lease, 128);
  ASSERT_TRUE(client->Get(*lease, dst).ok());
  for (size_t i = 0; i < lengths.size(); ++i) {
    EXPECT_TRUE(LocalBytes(dst[i], lengths[i]) == Pattern(100 + i, lengths[i])) << "item " << i;
  }
  client->ReleaseAsync(lease->lease_id);
  client.reset();  // waits for the release's answer
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->active_leases(), 0u);
  EXPECT_EQ(stats->pending_reservations(), 0u);
}

// ReleaseAsync's request leaves at once, from the calling thread: the node ends the lease
// while the client makes no further call (nothing in the client polls for its answer).
TEST_F(ServiceTest, AsyncReleaseReachesTheNodeWhileTheClientIsIdle) {
  const BlockHash h{0x5eed, 0xa11};
  auto put = client_->Put({{PutItem{h, std::nullopt, StateKind::kAttnKv, Stage(9, 5000, 0), 5000}}});
  ASSERT_TRUE(put.ok()) << put.status();
  ASSERT_TRUE((*put)[0].ok()) << (*put)[0];
  const std::vector<BlockHash> chain = {h};
  auto lease = client_->Lookup(chain);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(node_->core().Stats().active_leases, 1u);
  client_->ReleaseAsync(lease->lease_id);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (node_->core().Stats().active_leases != 0 && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(node_->core().Stats().active_leases, 0u);
}

// A Put of a block the node holds at another length (another model or layout under the
// same name) is told so for that block, ALREADY_EXISTS, and writes nothing; the other
// blocks of the Put are stored. Before, the node answered already_present and the Put
// reported the block stored, though a Lookup at its length missed it.
TEST_F(ServiceTest, PutOfABlockHeldAtAnotherLengthSaysSo) {
  const BlockHash h{0x1e47, 0xa11};
  auto first = client_->Put({{PutItem{h, std::nullopt, StateKind::kAttnKv, Stage(9, 5000, 0), 5000}}});
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*first)[0].ok()) << (*first)[0];
  const BlockHash other{0x1e47, 0xb22};
  auto put = client_->Put({{PutItem{h, std::nullopt, StateKind::kAttnKv, Stage(10, 7000, 0), 7000},
                            PutItem{other, h, StateKind::kAttnKv, Stage(11, 3000, 2), 3000}}});
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ((*put)[0].code(), absl::StatusCode::kAlreadyExists) << (*put)[0];
  EXPECT_THAT(std::string((*put)[0].message()), ::testing::HasSubstr("stored here with length 5000, not 7000"));
  EXPECT_TRUE((*put)[1].ok()) << (*put)[1];
  EXPECT_EQ(node_->core().Inspect({h, StateKind::kAttnKv})->length, 5000u);
  EXPECT_EQ(node_->core().Stats().reserved_bytes, 0u);
  EXPECT_EQ(node_->core().Stats().pending_reservations, 0u);
}

TEST_F(ServiceTest, PutLookupGetThroughDramAndNvmeIsByteExact) {
  constexpr int kBlocks = 6;
  const std::vector<uint64_t> lengths = {200'000, 65'536, 1, 150'001, 131'072, 99'999};
  std::vector<PutItem> items;
  std::optional<BlockHash> parent;
  uint64_t next = 0;
  for (int i = 0; i < kBlocks; ++i) {
    auto pages = Stage(i, lengths[i], next);
    next += pages.size();
    items.push_back(PutItem{H(i), parent, StateKind::kAttnKv, pages, lengths[i]});
    parent = H(i);
  }
  uint64_t moved = 0, total = 0;
  for (uint64_t l : lengths) total += l;
  auto put = client_->Put(items, &moved);
  ASSERT_TRUE(put.ok()) << put.status();
  for (const auto& s : *put) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(moved, total);
  // Putting again: already present, nothing moves (what PoolTier's back-off relies on).
  auto again = client_->Put(items, &moved);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(moved, 0u);

  std::vector<BlockHash> chain;
  for (int i = 0; i < kBlocks; ++i) chain.push_back(H(i));
  chain.push_back(H(999));  // unknown: a miss, not an error
  for (Tier expect : {Tier::kDram, Tier::kNvme}) {
    if (expect == Tier::kNvme) {
      ASSERT_EQ(node_->core().Demote(100), static_cast<size_t>(kBlocks));
    }
    auto lease = client_->Lookup(chain);
    ASSERT_TRUE(lease.ok()) << lease.status();
    ASSERT_EQ(lease->prefix_blocks, static_cast<uint32_t>(kBlocks));
    std::vector<std::vector<uint64_t>> dst;
    uint64_t p = 128;
    for (const RemoteObject& o : lease->objects) {
      EXPECT_EQ(o.found_in, expect);
      std::vector<uint64_t> pages;
      for (uint64_t off = 0; off < o.length; off += kLocalPage) pages.push_back(p++);
      // Poison the destination so stale bytes cannot pass.
      for (uint64_t q : pages) std::memset(arena_->base() + q * kLocalPage, 0xCD, kLocalPage);
      dst.push_back(pages);
    }
    ASSERT_TRUE(client_->Get(*lease, dst).ok());
    for (int i = 0; i < kBlocks; ++i) {
      EXPECT_TRUE(LocalBytes(dst[i], lengths[i]) == Pattern(i, lengths[i])) << "block " << i;
    }
    EXPECT_TRUE(client_->Release(lease->lease_id).ok());
  }
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->promotions(), static_cast<uint64_t>(kBlocks));
  EXPECT_EQ(stats->demotions(), static_cast<uint64_t>(kBlocks));
  EXPECT_EQ(stats->tiers_size(), 2);

  // The router saw a full dump, then every change with sequence 1, 2, 3, ...
  ASSERT_TRUE(router_.WaitFor([&](const std::vector<v1::EventBatch>& bs) {
    size_t n = 0;
    for (const auto& b : bs) n += b.events_size();
    return n >= static_cast<size_t>(kBlocks) * 4;  // stored DRAM, stored NVMe, removed DRAM, stored DRAM
  }));
  auto bs = router_.batches();
  ASSERT_FALSE(bs.empty());
  EXPECT_TRUE(bs[0].full_dump());
  uint64_t seq = 0;
  int nvme_stored = 0;
  for (const auto& b : bs) {
    EXPECT_EQ(b.source_id(), "node-test");
    for (const auto& e : b.events()) {
      EXPECT_EQ(e.sequence(), ++seq);
      if (e.has_stored() && e.stored().tier() == v1::TIER_NVME) ++nvme_stored;
    }
  }
  EXPECT_EQ(nvme_stored, kBlocks);

  // Asked for a dump, the node sends everything it holds on the open stream (registering
  // again would make the router forget the node until the dump lands).
  router_.AskForDump();
  ASSERT_TRUE(router_.WaitFor([](const std::vector<v1::EventBatch>& b) {
    int dumps = 0;
    for (const auto& x : b) dumps += x.full_dump();
    return dumps >= 2;
  }));
  const auto all = router_.batches();
  size_t last_dump = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].full_dump()) last_dump = i;
  }
  ASSERT_GT(last_dump, 0u);
  // Every block is in DRAM (promoted) and on NVMe: 2 copies each.
  EXPECT_EQ(all[last_dump].events_size(), 2 * kBlocks);
  // The dump continues the stream's sequence.
  uint64_t before = 0;
  for (size_t i = 0; i < last_dump; ++i) {
    if (all[i].events_size() > 0) before = all[i].events(all[i].events_size() - 1).sequence();
  }
  EXPECT_EQ(all[last_dump].events(0).sequence(), before + 1);
  EXPECT_EQ(router_.registrations(), 1);
}

TEST_F(ServiceTest, WireErrorsNameFieldsAndCodes) {
  grpc::ClientContext c1;
  v1::LookupRequest lreq;
  lreq.set_client_id("raw");
  lreq.add_block_hashes("short");
  lreq.set_kind(v1::STATE_KIND_ATTN_KV);
  v1::LookupResponse lresp;
  grpc::Status s = stub_->Lookup(&c1, lreq, &lresp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("block_hashes[0]"));

  grpc::ClientContext c2;
  v1::ReserveRequest rreq;
  rreq.set_client_id("raw");
  auto* e = AddKvEntry(rreq, H(1), 65 * kNodePage);  // more than the whole DRAM tier
  v1::ReserveResponse rresp;
  s = stub_->Reserve(&c2, rreq, &rresp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  grpc::ClientContext c3;
  e->set_length(1000);
  e->set_kind(v1::STATE_KIND_UNSPECIFIED);
  s = stub_->Reserve(&c3, rreq, &rresp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("entries[0].kind"));

  // A malformed hash is named by its entry and field, in Reserve and in Commit.
  {
    v1::ReserveRequest bad;
    bad.set_client_id("raw");
    for (int i = 0; i < 3; ++i) AddKvEntry(bad, H(200 + i), 1000);
    bad.mutable_entries(1)->set_block_hash("short");
    grpc::ClientContext cb1;
    s = stub_->Reserve(&cb1, bad, &rresp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("entries[1].block_hash"));
    bad.mutable_entries(1)->set_block_hash(H(201).ToBytes());
    bad.mutable_entries(2)->set_parent_hash(std::string(17, 'x'));
    grpc::ClientContext cb2;
    s = stub_->Reserve(&cb2, bad, &rresp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("entries[2].parent_hash"));
    v1::CommitRequest bad_commit;
    bad_commit.set_reservation_id(12345);
    bad_commit.set_client_id("raw");
    bad_commit.add_entries()->set_block_hash(H(1).ToBytes());
    bad_commit.add_entries()->set_block_hash("");
    v1::CommitResponse cresp;
    grpc::ClientContext cb3;
    s = stub_->Commit(&cb3, bad_commit, &cresp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("entries[1].block_hash"));
  }

  // Checksum mismatch: DATA_LOSS for that entry, pages freed.
  grpc::ClientContext c4;
  e->set_kind(v1::STATE_KIND_ATTN_KV);
  s = stub_->Reserve(&c4, rreq, &rresp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  grpc::ClientContext c5;
  v1::CommitRequest creq;
  creq.set_reservation_id(rresp.reservation_id());
  auto* ce = creq.add_entries();
  ce->set_block_hash(H(1).ToBytes());
  ce->set_checksum(12345);
  v1::CommitResponse cresp;
  {
    // Another client's Commit of it is refused and settles nothing.
    grpc::ClientContext other;
    creq.set_client_id("other");
    s = stub_->Commit(&other, creq, &cresp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("client_id \"other\""));
    creq.set_client_id("raw");
  }
  s = stub_->Commit(&c5, creq, &cresp);
  ASSERT_TRUE(s.ok());
  ASSERT_EQ(cresp.results_size(), 1);
  EXPECT_EQ(cresp.results(0).code(), static_cast<int>(grpc::StatusCode::DATA_LOSS));
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->checksum_failures(), 1u);
  EXPECT_EQ(stats->reserved_bytes(), 0u);
  EXPECT_EQ(stats->tiers(0).used_bytes(), 0u);

  grpc::ClientContext c6;
  v1::ReleaseRequest rel;
  rel.set_lease_id(777);
  rel.set_client_id("raw");
  v1::ReleaseResponse relr;
  EXPECT_EQ(stub_->Release(&c6, rel, &relr).error_code(), grpc::StatusCode::NOT_FOUND);

  // Fields checked before anything else is parsed, each named with its fix.
  auto expect_invalid = [](grpc::Status st, const char* field) {
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr(field));
  };
  grpc::ClientContext c7;
  v1::ConnectRequest conn;
  conn.set_client_id("no-address");
  v1::ConnectResponse connr;
  expect_invalid(stub_->Connect(&c7, conn, &connr), "ucx_worker_address is 0 bytes");
  grpc::ClientContext c8;
  v1::CommitRequest zero;
  expect_invalid(stub_->Commit(&c8, zero, &cresp), "reservation_id=0");
  // client_id is required wherever a lease or reservation is made or settled.
  auto anonymous = [](auto req) {
    req.clear_client_id();
    return req;
  };
  grpc::ClientContext c8a, c8b, c8c, c8d;
  expect_invalid(stub_->Lookup(&c8a, anonymous(lreq), &lresp), "client_id is 0 bytes");
  expect_invalid(stub_->Reserve(&c8b, anonymous(rreq), &rresp), "client_id is 0 bytes");
  expect_invalid(stub_->Commit(&c8c, anonymous(creq), &cresp), "client_id is 0 bytes");
  expect_invalid(stub_->Release(&c8d, anonymous(rel), &relr), "client_id is 0 bytes");
  grpc::ClientContext c9;
  v1::LookupRequest many;
  many.set_client_id("raw");
  for (int i = 0; i < 4097; ++i) many.add_block_hashes(H(i).ToBytes());
  expect_invalid(stub_->Lookup(&c9, many, &lresp), "block_hashes has 4097 entries");
  grpc::ClientContext c10;
  v1::ReserveRequest named;
  named.set_client_id(std::string(129, 'c'));
  *named.add_entries() = rreq.entries(0);
  expect_invalid(stub_->Reserve(&c10, named, &rresp), "client_id is 129 bytes");
  grpc::ClientContext c11;
  v1::ReserveRequest self;
  self.set_client_id("raw");
  auto* se = self.add_entries();
  se->set_block_hash(H(9).ToBytes());
  se->set_parent_hash(H(9).ToBytes());
  se->set_kind(v1::STATE_KIND_ATTN_KV);
  se->set_length(1000);
  expect_invalid(stub_->Reserve(&c11, self, &rresp), "entries[0].parent_hash equals block_hash");
}

// Commit's partial / commits fields reach the core: a final Commit that overtakes the
// partial one it counts leaves the reservation open for it.
TEST_F(ServiceTest, FinalCommitSentFirstWaitsForThePartialOneItCounts) {
  grpc::ClientContext c1;
  v1::ReserveRequest rreq;
  rreq.set_client_id("raw");
  for (int i = 0; i < 2; ++i) AddKvEntry(rreq, H(40 + i), 1000);
  v1::ReserveResponse rresp;
  ASSERT_TRUE(stub_->Reserve(&c1, rreq, &rresp).ok());
  auto commit = [&](int block, bool partial, uint32_t commits) {
    grpc::ClientContext ctx;
    v1::CommitRequest creq;
    creq.set_reservation_id(rresp.reservation_id());
    creq.set_client_id("raw");
    creq.set_partial(partial);
    creq.set_commits(commits);
    auto* ce = creq.add_entries();
    ce->set_block_hash(H(block).ToBytes());
    ce->set_checksum(1);  // nothing was written: DATA_LOSS per entry, pages freed
    v1::CommitResponse cresp;
    grpc::Status st = stub_->Commit(&ctx, creq, &cresp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(cresp.results_size(), 1);
    EXPECT_EQ(cresp.results(0).code(), static_cast<int>(grpc::StatusCode::DATA_LOSS));
  };
  commit(41, /*partial=*/false, /*commits=*/2);
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pending_reservations(), 1u);
  commit(40, /*partial=*/true, 0);
  stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pending_reservations(), 0u);
  EXPECT_EQ(stats->reserved_bytes(), 0u);
}

TEST_F(ServiceTest, HealthAndMetricsAreServed) {
  grpc::GenericStub generic(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  grpc::ByteBuffer req, resp;  // HealthCheckRequest{service: ""} is empty on the wire
  grpc::Slice empty("");
  req = grpc::ByteBuffer(&empty, 1);
  std::promise<grpc::Status> done;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                    [&](grpc::Status s) { done.set_value(s); });
  grpc::Status s = done.get_future().get();
  ASSERT_TRUE(s.ok()) << s.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(resp.Dump(&slices).ok());
  std::string bytes;
  for (auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));  // status: SERVING

  httplib::Client http("127.0.0.1", node_->metrics_port());
  auto r = http.Get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_THAT(r->body, ::testing::HasSubstr("kvpool_pool_capacity_bytes{tier=\"dram\"} 4194304"));
  EXPECT_THAT(r->body, ::testing::HasSubstr("kvpool_pool_rpcs_total"));
}

// A client whose endpoint uses active messages (as over TCP): transfers complete after
// PutAsync/GetAsync return, with two pipelined pieces in flight and their checksums taken
// on the transport's progress thread. Byte-exact across pieces; bytes changed on the
// node are caught by Get (DATA_LOSS naming the object).
TEST_F(ServiceTest, PipelinedPutAndGetOverActiveMessagesAreByteExactAndChecked) {
  transport::WorkerOptions wo;
  wo.protocol = transport::Protocol::kActiveMessage;
  std::unique_ptr<transport::Worker> worker;
  std::shared_ptr<transport::Arena> arena;
  ASSERT_NO_FATAL_FAILURE(NewWorkerAndArena(256, &worker, &arena, wo));
  PoolClientOptions o;
  o.node_address = address_;
  o.client_id = "am-client";
  o.worker = worker.get();
  o.local_arena = arena;
  o.put_pipeline_bytes = 100'000;  // a Reserve/Commit piece every one or two items
  auto client = PoolClient::Connect(o);
  ASSERT_TRUE(client.ok()) << client.status();
  std::byte* local = arena->base();
  const std::vector<uint64_t> lengths = {65'536, 1, 150'001, 99'999, 131'072, 7, 200'000, 40'000};
  const std::vector<PutItem> items = StageChain(700, 700, lengths, local);
  std::vector<BlockHash> chain;
  for (const PutItem& it : items) chain.push_back(it.hash);
  auto put = (*client)->Put(items);
  ASSERT_TRUE(put.ok()) << put.status();
  for (const auto& st : *put) EXPECT_TRUE(st.ok()) << st;

  auto lease = (*client)->Lookup(chain);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->prefix_blocks, lengths.size());
  for (size_t i = 0; i < lease->objects.size(); ++i) {
    const RemoteObject& obj = lease->objects[i];
    EXPECT_EQ(obj.checksum, Checksum64(Bytes(Pattern(700 + i, obj.length))));
  }
  const std::vector<std::vector<uint64_t>> dst = Destinations(*lease, 128, local);
  absl::Status got = (*client)->Get(*lease, dst);
  ASSERT_TRUE(got.ok()) << got;
  for (size_t i = 0; i < lengths.size(); ++i) {
    EXPECT_TRUE(LocalBytes(dst[i], lengths[i], local) == Pattern(700 + i, lengths[i])) << "item " << i;
  }

  // One byte of object 6 changes on the node: that Get fails, naming it.
  node_->core().arena_base()[uint64_t{lease->objects[6].pages[0]} * kNodePage + 17] ^= std::byte{1};
  got = (*client)->Get(*lease, dst);
  EXPECT_EQ(got.code(), absl::StatusCode::kDataLoss) << got;
  EXPECT_THAT(std::string(got.message()), ::testing::HasSubstr("object 6"));
  EXPECT_TRUE((*client)->Release(lease->lease_id).ok());
}

// On shared memory a large Get is copied and checksummed by two threads (the caller and a
// helper, half the objects each): byte-exact, and a changed byte is found in either half,
// naming its object.
TEST_F(ServiceTest, GetByTwoThreadsIsByteExactAndChecksBothHalves) {
  PoolClientOptions o = ClientOptions("two-threads");
  o.get_two_threads_min_bytes = 1;  // every Get of two objects or more
  auto client = ConnectWith(o);
  ASSERT_NE(client, nullptr);
  const std::vector<uint64_t> lengths = {65'536, 1, 150'001, 99'999, 131'072, 7, 200'000, 40'000};
  const std::vector<PutItem> items = StageChain(900, 900, lengths);
  std::vector<BlockHash> chain;
  for (const PutItem& it : items) chain.push_back(it.hash);
  auto put = client->Put(items);
  ASSERT_TRUE(put.ok()) << put.status();
  auto lease = client->Lookup(chain);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->prefix_blocks, lengths.size());
  const std::vector<std::vector<uint64_t>> dst = Destinations(*lease, 128);
  absl::Status got = client->Get(*lease, dst);
  ASSERT_TRUE(got.ok()) << got;
  for (size_t i = 0; i < lengths.size(); ++i) {
    EXPECT_TRUE(LocalBytes(dst[i], lengths[i]) == Pattern(900 + i, lengths[i])) << "item " << i;
  }
  for (const size_t bad : {size_t{2}, size_t{6}}) {  // the helper's half, then the caller's
    std::byte& b = node_->core().arena_base()[uint64_t{lease->objects[bad].pages[0]} * kNodePage + 5];
    b ^= std::byte{1};
    got = client->Get(*lease, dst);
    EXPECT_EQ(got.code(), absl::StatusCode::kDataLoss) << got;
    EXPECT_THAT(std::string(got.message()), ::testing::HasSubstr(absl::StrCat("object ", bad, " ")));
    b ^= std::byte{1};
  }
  EXPECT_TRUE(client->Get(*lease, dst).ok());
  EXPECT_TRUE(client->Release(lease->lease_id).ok());
}

// What a pipelined Put does on the wire: the next piece is reserved before the previous
// one is committed. A piece whose bytes do not match its checksum is refused (DATA_LOSS)
// and its pages freed, while the piece committed before it stays stored and visible.
TEST_F(ServiceTest, CorruptedPieceOfAPipelinedPutIsDroppedAndItsPagesFreed) {
  auto reserve = [&](BlockHash h, uint64_t length) {
    grpc::ClientContext ctx;
    v1::ReserveRequest req;
    req.set_client_id("raw");
    AddKvEntry(req, h, length);
    v1::ReserveResponse resp;
    EXPECT_TRUE(stub_->Reserve(&ctx, req, &resp).ok());
    return resp;
  };
  auto write = [&](const v1::ReserveResponse& r, const std::string& bytes) {
    uint64_t off = 0;
    for (uint32_t page : r.results(0).run().pages()) {
      const uint64_t n = std::min<uint64_t>(kNodePage, bytes.size() - off);
      std::memcpy(node_->core().arena_base() + uint64_t{page} * kNodePage, bytes.data() + off, n);
      off += n;
    }
  };
  auto commit = [&](const v1::ReserveResponse& r, BlockHash h, uint64_t checksum) {
    grpc::ClientContext ctx;
    v1::CommitRequest req;
    req.set_reservation_id(r.reservation_id());
    req.set_client_id("raw");
    auto* ce = req.add_entries();
    ce->set_block_hash(h.ToBytes());
    ce->set_checksum(checksum);
    v1::CommitResponse resp;
    EXPECT_TRUE(stub_->Commit(&ctx, req, &resp).ok());
    return resp.results_size() == 1 ? resp.results(0).code() : -1;
  };
  const std::string a = Pattern(60, 100'000), b = Pattern(61, 70'000);
  const v1::ReserveResponse ra = reserve(H(60), a.size());
  const v1::ReserveResponse rb = reserve(H(61), b.size());  // reserved ahead, as Put does
  ASSERT_EQ(ra.results_size(), 1);
  ASSERT_EQ(rb.results_size(), 1);
  write(ra, a);
  std::string bad = b;
  bad[12'345] ^= 1;  // the second piece lands with one byte changed
  write(rb, bad);
  EXPECT_EQ(commit(ra, H(60), Checksum64(Bytes(a))), 0);
  EXPECT_EQ(commit(rb, H(61), Checksum64(Bytes(b))), static_cast<int>(grpc::StatusCode::DATA_LOSS));

  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->checksum_failures(), 1u);
  EXPECT_EQ(stats->reserved_bytes(), 0u);
  EXPECT_EQ(stats->pending_reservations(), 0u);
  EXPECT_EQ(stats->tiers(0).used_bytes(), 2 * kNodePage);  // only the first piece's pages
  auto first = client_->Lookup(std::vector<BlockHash>{H(60)});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->prefix_blocks, 1u);
  auto second = client_->Lookup(std::vector<BlockHash>{H(61)});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->prefix_blocks, 0u);
  if (first->lease_id != 0) {
    EXPECT_TRUE(client_->Release(first->lease_id).ok());
  }
}

// A pipelined Put whose second piece cannot be reserved (larger than the node's whole
// DRAM tier) fails; the piece reserved ahead of it (a Reserve per piece here) is ended by
// the client at once (an empty Commit with end_now), not left pinned until
// reserve_timeout (30 s here, far beyond the test).
TEST_F(ServiceTest, FailedPipelinedPutEndsTheReservationsItMadeAhead) {
  PoolClientOptions o = ClientOptions("failing-put");
  o.put_pipeline_bytes = 100'000;       // one piece per item
  o.put_reserve_group_bytes = 100'000;  // and one Reserve per piece
  auto client = ConnectWith(o);
  ASSERT_NE(client, nullptr);
  const uint64_t too_big = 80 * kNodePage;  // the node holds 64 pages
  const std::vector<PutItem> items = StageChain(700, 700, {100'000, too_big, 100'000, 100'000});
  auto put = client->Put(items);
  EXPECT_FALSE(put.ok());

  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->pending_reservations(), 0u);
  EXPECT_EQ(stats->reserved_bytes(), 0u);
  EXPECT_EQ(node_->core().Stats().pending_reservations, 0u);
}

// A partial Commit lost on the way (the node never gets it) fails the Put, and the
// client then ends the reservation (an empty Commit with end_now): the final Commit,
// which counted the lost one, would otherwise keep it, and the pages the lost Commit
// named, until reserve_timeout (30 s here, far beyond the test), then hold them back for
// another. The pages are held back one timeout instead; the items whose Commits arrived
// stay stored.
TEST_F(ServiceTest, LostPartialCommitFailsThePutAndTheClientEndsItsReservation) {
  PoolClientOptions o = ClientOptions("losing-commit");
  o.put_pipeline_bytes = 100'000;  // two pieces ([0, 2) and [2, 4)), under one Reserve
  o.lose_commit = [](size_t piece) { return piece == 0; };  // a partial one
  auto client = ConnectWith(o);
  ASSERT_NE(client, nullptr);
  const std::vector<PutItem> items = StageChain(720, 720, {100'000, 100'000, 100'000, 100'000});
  auto put = client->Put(items);
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), absl::StatusCode::kUnavailable) << put.status();

  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->pending_reservations(), 0u);
  EXPECT_EQ(stats->reserved_bytes(), 0u);
  EXPECT_GT(stats->dram_held_back_bytes(), 0u);  // the lost Commit's items' pages
  // The first item went with the lost Commit; the last with the final one, which came.
  EXPECT_FALSE(node_->core().Inspect({H(720), StateKind::kAttnKv}));
  EXPECT_TRUE(node_->core().Inspect({H(723), StateKind::kAttnKv}));
}

// A Put whose reservation runs out before a piece is written writes no more: it fails
// with DEADLINE_EXCEEDED, the pieces before stay stored, and the node keeps the pages it
// took back unused for one more reserve timeout (a write under way must not land in
// another object).
TEST(ReserveTimeout, PutStopsWritingOnceItsReservationRanOut) {
  testing::TempDir dir;
  ManualClock clock;  // the node's: its expiries move only when the test says
  NodeConfig cfg = SmallNode();
  cfg.pool.reserve_timeout_ms = 100;
  cfg.pool.clock = &clock;
  auto node = NodeServer::Start(cfg);
  ASSERT_TRUE(node.ok()) << node.status();
  PoolCore& core = (*node)->core();
  std::unique_ptr<transport::Worker> worker;
  std::shared_ptr<transport::Arena> arena;
  // A transfer bound within the node's 100 ms (a piece must be able to end before the
  // node reuses its pages: ReserveTimeout.ShorterThanTheTransferTimeoutStartsNoPiece).
  transport::WorkerOptions wo;
  wo.batch_timeout = absl::Milliseconds(50);
  ASSERT_NO_FATAL_FAILURE(NewWorkerAndArena(16, &worker, &arena, wo));
  PoolClientOptions o;
  o.node_address = "127.0.0.1:" + std::to_string((*node)->port());
  o.client_id = "late-writer";
  o.worker = worker.get();
  o.local_arena = arena;
  o.put_pipeline_bytes = 40'000;  // one piece per item (pieces end at or after 45, 135, 225 kB)
  // Before the second piece, a slow client: once the first piece is stored, the node's
  // clock passes the reservation's end, and so does the client's (it counts the 100 ms
  // ttl on its own steady clock).
  bool first_stored = false;
  o.before_piece_transfer = [&](size_t k) {
    if (k != 1) return;
    for (int i = 0; i < 1000 && core.Stats().tiers[0].used_bytes < 2 * kNodePage; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    first_stored = core.Stats().tiers[0].used_bytes == 2 * kNodePage;
    clock.AdvanceMs(101);
    std::this_thread::sleep_for(std::chrono::milliseconds(120));
  };
  auto client = PoolClient::Connect(o);
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<PutItem> items;
  std::optional<BlockHash> parent;
  for (uint64_t i = 0; i < 3; ++i) {
    const std::string bytes = Pattern(900 + i, 100'000);
    std::vector<uint64_t> pages;
    for (uint64_t off = 0, p = i * 4; off < bytes.size(); off += kLocalPage, ++p) {
      std::memcpy(arena->base() + p * kLocalPage, bytes.data() + off,
                  std::min<uint64_t>(kLocalPage, bytes.size() - off));
      pages.push_back(p);
    }
    items.push_back(PutItem{H(900 + i), parent, StateKind::kAttnKv, pages, bytes.size()});
    parent = H(900 + i);
  }
  auto put = (*client)->Put(items);
  ASSERT_TRUE(first_stored) << "the first piece's Commit never reached the node";
  ASSERT_FALSE(put.ok());
  // Not DEADLINE_EXCEEDED: a worker would take that for a failed node.
  EXPECT_EQ(put.status().code(), absl::StatusCode::kFailedPrecondition) << put.status();
  EXPECT_THAT(std::string(put.status().message()), ::testing::HasSubstr("--reserve-timeout-ms"));

  const PoolStatsSnapshot st = core.Stats();
  EXPECT_EQ(st.pending_reservations, 0u);
  EXPECT_EQ(st.reclaimed_reservations, 1u);
  EXPECT_EQ(st.tiers[0].used_bytes, 2 * kNodePage);   // the first piece, stored
  EXPECT_EQ(st.dram_held_back_bytes, 4 * kNodePage);  // the other two: held back
  auto lease = (*client)->Lookup(std::vector<BlockHash>{H(900), H(901), H(902)});
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->prefix_blocks, 1u);
  if (lease->lease_id != 0) {
    EXPECT_TRUE((*client)->Release(lease->lease_id).ok());
  }
  auto stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->dram_held_back_bytes(), 4 * kNodePage);

  // One more timeout later the pages are free again.
  clock.AdvanceMs(99);
  core.RunMaintenance();
  EXPECT_EQ(core.Stats().dram_held_back_bytes, 4 * kNodePage);
  clock.AdvanceMs(1);
  core.RunMaintenance();
  EXPECT_EQ(core.Stats().dram_held_back_bytes, 0u);
  client->reset();
  node->reset();
}

// A node reserve timeout too short for the client's transfer timeout: a piece could still
// be writing when the node gives its pages (held back one more timeout after the
// reservation's end) to another object. The Put starts no piece and says which flags to
// change; nothing is stored and the node ends the reservation. Before, the piece was
// written and stored.
TEST(ReserveTimeout, ShorterThanTheTransferTimeoutStartsNoPiece) {
  NodeConfig cfg = SmallNode();
  cfg.pool.reserve_timeout_ms = 2000;
  auto node = NodeServer::Start(cfg);
  ASSERT_TRUE(node.ok()) << node.status();
  std::unique_ptr<transport::Worker> worker;
  std::shared_ptr<transport::Arena> arena;
  transport::WorkerOptions wo;
  wo.batch_timeout = absl::Seconds(5);  // > 2 x 2000 ms
  ASSERT_NO_FATAL_FAILURE(NewWorkerAndArena(16, &worker, &arena, wo));
  PoolClientOptions o;
  o.node_address = "127.0.0.1:" + std::to_string((*node)->port());
  o.client_id = "slow-link";
  o.worker = worker.get();
  o.local_arena = arena;
  auto client = PoolClient::Connect(o);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::string bytes = Pattern(950, 3 * kLocalPage);
  std::memcpy(arena->base(), bytes.data(), bytes.size());
  const std::vector<PutItem> items = {PutItem{H(950), std::nullopt, StateKind::kAttnKv, {0, 1, 2}, bytes.size()}};
  auto put = (*client)->Put(items);
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), absl::StatusCode::kFailedPrecondition) << put.status();
  EXPECT_THAT(std::string(put.status().message()), ::testing::HasSubstr("--reserve-timeout-ms")) << put.status();
  EXPECT_THAT(std::string(put.status().message()), ::testing::HasSubstr("--pool-transfer-timeout-ms")) << put.status();
  const PoolStatsSnapshot st = (*node)->core().Stats();
  EXPECT_EQ(st.pending_reservations, 0u);
  EXPECT_EQ(st.tiers[0].used_bytes, 0u);
  // Within the bound, the same Put goes through.
  client->reset();
  arena.reset();
  worker.reset();
  wo.batch_timeout = absl::Seconds(1);
  ASSERT_NO_FATAL_FAILURE(NewWorkerAndArena(16, &worker, &arena, wo));
  std::memcpy(arena->base(), bytes.data(), bytes.size());
  o.worker = worker.get();
  o.local_arena = arena;
  client = PoolClient::Connect(o);
  ASSERT_TRUE(client.ok()) << client.status();
  auto again = (*client)->Put(items);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->size(), 1u);
  EXPECT_TRUE((*again)[0].ok()) << (*again)[0];
  client->reset();
  node->reset();
}

// A --dram the host cannot back is refused up front, naming --dram and the limit; it
// used to hang startup while UCX filled a file in /dev/shm.
TEST(DramCheck, RefusesWhatTheHostCannotBack) {
  constexpr uint64_t G = uint64_t{1} << 30;
  const HostMemory host{/*mem_total=*/23 * G, /*sysv_max=*/8 * G, /*shm_free=*/12 * G};
  EXPECT_TRUE(CheckDramFitsHost(4 * G, host).ok());
  EXPECT_TRUE(CheckDramFitsHost(8 * G, host).ok());   // sysv holds it
  EXPECT_TRUE(CheckDramFitsHost(12 * G, host).ok());  // the /dev/shm fallback holds it
  const absl::Status over_shm = CheckDramFitsHost(16 * G, host);
  EXPECT_EQ(over_shm.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(over_shm.message()), ::testing::HasSubstr("--dram="));
  EXPECT_THAT(std::string(over_shm.message()), ::testing::HasSubstr("/dev/shm"));
  const absl::Status over_ram = CheckDramFitsHost(64 * G, host);
  EXPECT_EQ(over_ram.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(over_ram.message()), ::testing::HasSubstr("MemTotal"));
  // sysv large enough: /dev/shm does not matter, MemTotal still does.
  const HostMemory big_sysv{23 * G, UINT64_MAX, 1 * G};
  EXPECT_TRUE(CheckDramFitsHost(16 * G, big_sysv).ok());
  EXPECT_FALSE(CheckDramFitsHost(24 * G, big_sysv).ok());
}

TEST(DramCheck, FlagParsingRefusesAnAbsurdDram) {
  std::vector<std::string> args = {"kvpool-node", "--dram=4096TiB"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  auto cfg = ParseNodeFlags(static_cast<int>(argv.size()), argv.data());
  ASSERT_FALSE(cfg.ok());
  EXPECT_EQ(cfg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(cfg.status().message()), ::testing::HasSubstr("--dram="));
  EXPECT_THAT(std::string(cfg.status().message()), ::testing::HasSubstr("MemTotal"));
  EXPECT_GT(ReadHostMemory().mem_total, 0u);
}

// Without a node id a node is named pool-<its bound port> (as --help says), in its
// GetStats and Connect answers and in its router registration: two such nodes on one
// router no longer share the name "pool-node".
TEST(NodeIdDefault, IsPoolDashBoundPort) {
  testing::TempDir dir;
  RecordingRouter router;
  int router_port = 0;
  grpc::ServerBuilder rb;
  rb.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &router_port);
  rb.RegisterService(&router);
  std::unique_ptr<grpc::Server> router_server = rb.BuildAndStart();
  ASSERT_NE(router_server, nullptr);

  NodeConfig cfg = SmallNode();
  cfg.router = "127.0.0.1:" + std::to_string(router_port);
  auto node = NodeServer::Start(cfg);
  ASSERT_TRUE(node.ok()) << node.status();
  const std::string want = "pool-" + std::to_string((*node)->port());
  EXPECT_EQ((*node)->core().Stats().node_id, want);
  EXPECT_THAT((*node)->DescribeConfig(), ::testing::HasSubstr("kvpool-node " + want + "\n"));

  std::unique_ptr<transport::Worker> worker;
  std::shared_ptr<transport::Arena> arena;
  ASSERT_NO_FATAL_FAILURE(NewWorkerAndArena(4, &worker, &arena));
  auto client = PoolClient::Connect({"127.0.0.1:" + std::to_string((*node)->port()), "id-test", worker.get(), arena});
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->node_id(), want);  // Connect's answer
  auto stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->node_id(), want);
  const std::vector<std::string> ids = router.WaitForRegistration();
  ASSERT_FALSE(ids.empty());
  for (const std::string& id : ids) EXPECT_EQ(id, want);
  client->reset();
  node->reset();
  router_server->Shutdown();
}

// Flags the router would refuse at registration (forever, with only a warning) are
// refused at start, naming the flag; an explicit --node-id is used as given, even when it
// is the default name.
TEST(NodeFlags, RefusedAtStartOrKeptAsGiven) {
  auto parse = [](std::vector<std::string> args) {
    args.insert(args.begin(), "kvpool-node");
    args.push_back("--dram=1MiB");
    args.push_back("--page-bytes=4096");
    args.push_back("--metrics-port=-1");
    args.push_back("--listen=127.0.0.1:0");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return ParseNodeFlags(static_cast<int>(argv.size()), argv.data());
  };
  auto refused = [&](std::vector<std::string> args, const std::string& flag) {
    auto cfg = parse(std::move(args));
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    auto node = NodeServer::Start(*cfg);
    ASSERT_FALSE(node.ok()) << flag;
    EXPECT_EQ(node.status().code(), absl::StatusCode::kInvalidArgument) << node.status();
    EXPECT_THAT(std::string(node.status().message()), ::testing::HasSubstr(flag));
  };
  refused({"--router=127.0.0.1:1", "--advertise=pool-a"}, "--advertise");
  refused({"--router=router-without-port"}, "--router");
  refused({"--node-id=a/b"}, "--node-id");
  refused({"--node-id=" + std::string(129, 'n')}, "--node-id");
  auto quiet_metrics = parse({});
  ASSERT_TRUE(quiet_metrics.ok()) << quiet_metrics.status();
  quiet_metrics->metrics_port = -5;  // used to turn metrics off without a word
  auto no_node = NodeServer::Start(*quiet_metrics);
  ASSERT_FALSE(no_node.ok());
  EXPECT_THAT(std::string(no_node.status().message()), ::testing::HasSubstr("--metrics-port"));

  auto cfg = parse({"--node-id=pool-node"});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_TRUE(cfg->node_id_given);
  auto node = NodeServer::Start(*cfg);
  ASSERT_TRUE(node.ok()) << node.status();
  EXPECT_EQ((*node)->core().Stats().node_id, "pool-node");
}

TEST_F(ServiceTest, GetAfterLeaseExpiryFailsCleanly) {
  auto pages = Stage(5, 70'000, 0);
  auto put = client_->Put(std::vector<PutItem>{{H(5), std::nullopt, StateKind::kAttnKv, pages, 70'000}});
  ASSERT_TRUE(put.ok() && (*put)[0].ok());
  auto lease = client_->Lookup(std::vector<BlockHash>{H(5)}, StateKind::kAttnKv, /*lease_ms=*/1);
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->prefix_blocks, 1u);
  // Wait until the lease's end has passed (a precondition, not a timing assertion).
  while (std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count() <= lease->expires_unix_ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::vector<std::vector<uint64_t>> dst = {{100, 101, 102}};
  EXPECT_EQ(client_->Get(*lease, dst).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client_->Release(lease->lease_id).code(), absl::StatusCode::kNotFound);
}

// A Get larger than get_batch_bytes moves in batches (an object larger than that alone),
// one after another, each with its own transport timeout; every object lands byte-exact.
TEST_F(ServiceTest, GetMovesALargeLeaseInBatches) {
  PoolClientOptions o = ClientOptions("batched-get");
  o.get_batch_bytes = 150'000;
  std::vector<size_t> batches;
  o.before_get_batch = [&](size_t b) { batches.push_back(b); };
  auto client = ConnectWith(o);
  ASSERT_NE(client, nullptr);
  const std::vector<uint64_t> lengths = {70'000, 70'000, 70'000, 200'000, 10'000};
  const std::vector<PutItem> items = StageChain(1200, 1200, lengths);
  auto put = client->Put(items);
  ASSERT_TRUE(put.ok()) << put.status();
  for (const absl::Status& st : *put) ASSERT_TRUE(st.ok()) << st;
  std::vector<BlockHash> chain;
  for (const PutItem& it : items) chain.push_back(it.hash);
  auto lease = client->Lookup(chain);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->prefix_blocks, lengths.size());
  const auto dst = Destinations(*lease, 100);
  ASSERT_TRUE(client->Get(*lease, dst).ok());
  // {0, 1} (140 kB), {2} (+200 kB would pass 150 kB), {3} (200 kB, alone), {4}.
  EXPECT_THAT(batches, ::testing::ElementsAre(0, 1, 2, 3));
  for (size_t i = 0; i < lengths.size(); ++i) {
    EXPECT_TRUE(LocalBytes(dst[i], lengths[i]) == Pattern(1200 + i, lengths[i])) << "object " << i;
  }
  EXPECT_TRUE(client->Release(lease->lease_id).ok());
}

// A lease that runs out between two batches stops the Get there: FAILED_PRECONDITION that
// says how many objects arrived; those are intact, and nothing more is read.
TEST_F(ServiceTest, GetStopsAtTheBatchWhereItsLeaseRanOut) {
  PoolClientOptions o = ClientOptions("lease-runs-out");
  o.get_batch_bytes = 1;  // one object per batch
  const PoolLease* watched = nullptr;
  o.before_get_batch = [&](size_t b) {
    // Wait until the lease's end has passed on this process's clock (a precondition,
    // not a timing assertion).
    while (b == 1 && std::chrono::steady_clock::now() < *watched->usable_until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  auto client = ConnectWith(o);
  ASSERT_NE(client, nullptr);
  const std::vector<PutItem> items = StageChain(1300, 1300, {70'000, 70'000});
  auto put = client->Put(items);
  ASSERT_TRUE(put.ok() && (*put)[0].ok() && (*put)[1].ok());
  auto lease = client->Lookup(std::vector<BlockHash>{items[0].hash, items[1].hash}, StateKind::kAttnKv,
                              /*lease_ms=*/2000);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->prefix_blocks, 2u);
  ASSERT_TRUE(lease->usable_until.has_value());
  watched = &*lease;
  const auto dst = Destinations(*lease, 100);
  const absl::Status st = client->Get(*lease, dst);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("ran out after 1 of 2 objects"));
  EXPECT_TRUE(LocalBytes(dst[0], 70'000) == Pattern(1300, 70'000));
  EXPECT_TRUE(LocalBytes(dst[1], 70'000) == std::string(70'000, static_cast<char>(0xCD)));  // not read
}

// A lease is timed on the client's own monotonic clock, from its ttl: a node whose wall
// clock is years behind the client's still serves Gets (the client used to compare the
// node's expiry with its own wall clock and refuse them all), and one whose clock is an
// hour ahead does not make the client read past the lease's end.
TEST(LeaseTime, CountedOnTheClientsClockWhateverTheNodesSays) {
  ManualClock clock;  // the node's: 2023, years behind this host
  NodeConfig cfg = SmallNode();
  cfg.pool.clock = &clock;
  auto node = NodeServer::Start(cfg);
  ASSERT_TRUE(node.ok()) << node.status();
  std::unique_ptr<transport::Worker> worker;
  std::shared_ptr<transport::Arena> arena;
  ASSERT_NO_FATAL_FAILURE(NewWorkerAndArena(16, &worker, &arena));
  auto client = PoolClient::Connect({"127.0.0.1:" + std::to_string((*node)->port()), "skewed", worker.get(), arena});
  ASSERT_TRUE(client.ok()) << client.status();
  const std::string bytes = Pattern(1400, 50'000);
  std::memcpy(arena->base(), bytes.data(), kLocalPage);
  std::memcpy(arena->base() + kLocalPage, bytes.data() + kLocalPage, bytes.size() - kLocalPage);
  auto put = (*client)->Put(std::vector<PutItem>{{H(1400), std::nullopt, StateKind::kAttnKv, {0, 1}, bytes.size()}});
  ASSERT_TRUE(put.ok() && (*put)[0].ok());

  auto lease = (*client)->Lookup(std::vector<BlockHash>{H(1400)}, StateKind::kAttnKv, /*lease_ms=*/60'000);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->prefix_blocks, 1u);
  std::vector<std::vector<uint64_t>> dst = {{4, 5}};
  ASSERT_TRUE((*client)->Get(*lease, dst).ok());
  EXPECT_TRUE(std::string(reinterpret_cast<const char*>(arena->base() + 4 * kLocalPage), bytes.size()) == bytes);
  ASSERT_TRUE((*client)->Release(lease->lease_id).ok());

  // Now an hour ahead of this host; a 1 ms lease has run out once 1 ms has passed here.
  const int64_t wall_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::system_clock::now().time_since_epoch()).count();
  clock.AdvanceMs(wall_ms + 3'600'000 - clock.NowMs());
  lease = (*client)->Lookup(std::vector<BlockHash>{H(1400)}, StateKind::kAttnKv, /*lease_ms=*/1);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->prefix_blocks, 1u);
  // Its display field is on this host's wall clock, whatever the node's clock says.
  EXPECT_LT(lease->expires_unix_ms, wall_ms + 600'000);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ((*client)->Get(*lease, dst).code(), absl::StatusCode::kFailedPrecondition);
}

// The pool that runs NVMe-bound Lookups queues a bounded number: past it a call is
// refused (the service answers RESOURCE_EXHAUSTED), and every queued one still runs.
TEST(BlockingPoolTest, QueuesAtMostMaxQueued) {
  absl::Notification release;
  std::atomic<int> ran{0};
  {
    BlockingPool pool(1);
    absl::Notification started;
    ASSERT_TRUE(pool.TryRun(
        [&] {
          started.Notify();
          release.WaitForNotification();
          ++ran;
        },
        2));
    started.WaitForNotification();  // the one thread is busy: later ones queue
    EXPECT_TRUE(pool.TryRun([&] { ++ran; }, 2));
    EXPECT_TRUE(pool.TryRun([&] { ++ran; }, 2));
    EXPECT_FALSE(pool.TryRun([&] { ++ran; }, 2));
    release.Notify();
  }  // the destructor runs what is queued, then joins
  EXPECT_EQ(ran.load(), 3);
}

}  // namespace
}  // namespace kvpool::pool_node
