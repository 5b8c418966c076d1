// kvpool.v1.Router over a real loopback gRPC server: registration, event streams with
// gaps and dumps, routing, bad input, health, /metrics, and kvctl route/status; plus
// kvpool-router's flag checks.
#include <algorithm>
#include <atomic>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "kvctl.h"
#include "kvpool/common/hash.h"
#include "kvpool/router/event_publisher.h"
#include "kvpool/router/router_client.h"
#include "kvpool/router/router_server.h"
#include "nlohmann/json.hpp"

namespace kvpool::router {
namespace {

class RouterServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RouterServerOptions o;
    o.listen = "127.0.0.1:0";
    o.metrics_host = "127.0.0.1";
    o.metrics_port = 0;
    o.host.core.models = {"tiny-gqa", "tiny-mla"};
    o.host.core.policy = PolicyKind::kCacheAware;
    o.host.apply_slice_events = 8;  // small slices: the flood test interleaves Route
    auto s = RouterServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    addr_ = "127.0.0.1:" + std::to_string(server_->port());
    auto c = RouterClient::Connect(addr_);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    auto h = BlockHasher::Create(HashOptions{.model_id = "tiny-gqa", .block_tokens = 16});
    ASSERT_TRUE(h.ok());
    hasher_ = std::make_unique<BlockHasher>(*h);
  }

  void RegisterWorker(const std::string& id, bool events = true, uint64_t* registration = nullptr) {
    v1::RegisterRequest r;
    r.set_source_id(id);
    r.set_kind(v1::SOURCE_KIND_WORKER);
    r.set_address(id + ".local:7000");
    r.mutable_model()->set_name("tiny-gqa");
    r.set_publishes_events(events);
    auto resp = client_->Register(r);
    ASSERT_TRUE(resp.ok()) << resp.status();
    EXPECT_EQ(resp->next_sequence(), 1u);
    EXPECT_GT(resp->heartbeat_interval_ms(), 0u);
    EXPECT_NE(resp->registration(), 0u);
    if (registration != nullptr) *registration = resp->registration();
  }

  // A stub of its own, for streams the tests drive batch by batch (RouterClient sends a
  // whole PublishEvents call at once).
  std::unique_ptr<v1::Router::Stub> RawStub() {
    return v1::Router::NewStub(grpc::CreateChannel(addr_, grpc::InsecureChannelCredentials()));
  }

  static std::vector<uint32_t> Tokens(uint32_t n, uint32_t salt) {
    std::vector<uint32_t> t(n);
    for (uint32_t i = 0; i < n; ++i) t[i] = salt * 100003 + i;
    return t;
  }

  static v1::EventBatch Stored(const std::string& source, uint64_t seq, const std::vector<BlockHash>& hashes,
                               size_t n, bool dump = false) {
    v1::EventBatch b;
    b.set_source_id(source);
    b.set_full_dump(dump);
    v1::KvEvent* e = b.add_events();
    e->set_sequence(seq);
    for (size_t i = 0; i < n; ++i) e->mutable_stored()->add_block_hashes(hashes[i].ToBytes());
    e->mutable_stored()->set_kind(v1::STATE_KIND_ATTN_KV);
    e->mutable_stored()->set_tier(v1::TIER_GPU);
    return b;
  }

  // An EventPublisher for worker w0 of this router; its dump is `hashes` as one stored
  // event per block (as a worker dumps object by object).
  EventPublisherOptions PublisherOptions(const std::vector<BlockHash>& hashes, absl::Duration retry_interval) {
    EventPublisherOptions o;
    o.router_address = addr_;
    o.registration.set_source_id("w0");
    o.registration.set_kind(v1::SOURCE_KIND_WORKER);
    o.registration.set_address("w0.local:7000");
    o.registration.mutable_model()->set_name("tiny-gqa");
    o.dump = [hashes] {
      std::vector<v1::KvEvent> d(hashes.size());
      for (size_t i = 0; i < hashes.size(); ++i) {
        v1::BlockStored* s = d[i].mutable_stored();
        if (i > 0) s->set_parent_hash(hashes[i - 1].ToBytes());
        s->add_block_hashes(hashes[i].ToBytes());
        s->set_kind(v1::STATE_KIND_ATTN_KV);
        s->set_tier(v1::TIER_GPU);
      }
      return d;
    };
    o.retry_interval = retry_interval;
    return o;
  }

  static v1::KvEvent StoredEvent(const BlockHash& h) {
    v1::KvEvent e;
    e.mutable_stored()->add_block_hashes(h.ToBytes());
    e.mutable_stored()->set_kind(v1::STATE_KIND_ATTN_KV);
    e.mutable_stored()->set_tier(v1::TIER_GPU);
    return e;
  }

  // Polls `cond` until it holds; false after 30 s. A bound on progress of the publisher
  // thread, not an assertion on its speed.
  static bool Eventually(const std::function<bool()>& cond) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (!cond()) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return true;
  }

  // Blocks the router's index attributes to `id` (0 when it is not registered).
  uint64_t IndexBlocksOf(const std::string& id) {
    for (const SourceStats& s : server_->host().Stats().sources) {
      if (s.id == id) return s.index_blocks;
    }
    return 0;
  }

  v1::RouteRequest TokensRequest(const std::vector<uint32_t>& tokens, const std::string& model = "tiny-gqa") {
    v1::RouteRequest r;
    r.mutable_model()->set_name(model);
    for (uint32_t t : tokens) r.add_tokens(t);
    return r;
  }

  std::unique_ptr<RouterServer> server_;
  std::string addr_;
  std::unique_ptr<RouterClient> client_;
  std::unique_ptr<BlockHasher> hasher_;
};

// A worker that caches a prompt of more blocks than the router takes in one event
// (4096 hashes) publishes it as one cache event: the publisher cuts it into chained
// events the router accepts, and the whole run is indexed (the engine's single event was
// refused with INVALID_ARGUMENT, and the stream ended, on every such prompt).
TEST_F(RouterServiceTest, PublisherSplitsEventsLongerThanTheRoutersLimit) {
  const std::vector<BlockHash> hashes = hasher_->HashPrefix(Tokens(16 * 9000, 41));  // 9000 blocks
  ASSERT_EQ(hashes.size(), 9000u);
  EventPublisher pub(PublisherOptions({}, absl::Milliseconds(20)));
  pub.Start();
  ASSERT_TRUE(Eventually([&] { return pub.connected(); }));
  v1::KvEvent stored;
  for (const BlockHash& h : hashes) stored.mutable_stored()->add_block_hashes(h.ToBytes());
  stored.mutable_stored()->set_kind(v1::STATE_KIND_ATTN_KV);
  stored.mutable_stored()->set_tier(v1::TIER_GPU);
  pub.Publish(stored);
  ASSERT_TRUE(Eventually([&] { return IndexBlocksOf("w0") == 9000; })) << IndexBlocksOf("w0");
  EXPECT_EQ(pub.registrations(), 1u) << "the stream broke";
  v1::RouteRequest by_hash;
  by_hash.mutable_model()->set_name("tiny-gqa");
  for (const auto& h : hashes) by_hash.add_block_hashes(h.ToBytes());
  auto r = client_->Route(by_hash);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->gpu_hit_blocks(), 9000u);
  // Removing them all goes in parts too.
  v1::KvEvent removed;
  *removed.mutable_removed()->mutable_block_hashes() = stored.stored().block_hashes();
  removed.mutable_removed()->set_kind(v1::STATE_KIND_ATTN_KV);
  removed.mutable_removed()->set_tier(v1::TIER_GPU);
  pub.Publish(removed);
  ASSERT_TRUE(Eventually([&] { return IndexBlocksOf("w0") == 0; })) << IndexBlocksOf("w0");
  EXPECT_EQ(pub.registrations(), 1u);
}

// A batch's source_id is checked as Register checks it: an id no source could have
// registered is named as such (before, only an empty one was; a multi-megabyte id came
// back whole in the error of a later batch, too large to send).
TEST_F(RouterServiceTest, PublishedBatchWithAnImpossibleSourceIdIsRefused) {
  RegisterWorker("w0");
  const auto hashes = hasher_->HashPrefix(Tokens(16 * 2, 1));
  auto pub = client_->PublishEvents({Stored(std::string(300, 'x'), 1, hashes, 1)});
  EXPECT_EQ(pub.status().code(), absl::StatusCode::kInvalidArgument) << pub.status();
  EXPECT_NE(pub.status().message().find("source_id"), absl::string_view::npos) << pub.status();
  EXPECT_LT(pub.status().message().size(), 400u);
  pub = client_->PublishEvents({Stored("w 0", 1, hashes, 1)});
  EXPECT_EQ(pub.status().code(), absl::StatusCode::kInvalidArgument) << pub.status();
}

TEST_F(RouterServiceTest, RoutesToTheInstanceThatPublishedThePrefix) {
  RegisterWorker("w0");
  RegisterWorker("w1");
  const auto tokens = Tokens(16 * 8, 1);
  const auto hashes = hasher_->HashPrefix(tokens);
  auto pub = client_->PublishEvents({Stored("w1", 1, hashes, 6)});
  ASSERT_TRUE(pub.ok()) << pub.status();
  EXPECT_EQ(pub->events_applied(), 1u);
  EXPECT_EQ(pub->last_sequence(), 1u);
  EXPECT_FALSE(pub->full_dump_requested());

  auto r = client_->Route(TokensRequest(tokens));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->instance_id(), "w1");
  EXPECT_EQ(r->instance_address(), "w1.local:7000");
  EXPECT_EQ(r->gpu_hit_blocks(), 6u);
  EXPECT_EQ(r->total_blocks(), 8u);
  EXPECT_EQ(r->policy(), "cache_aware");

  // The same request by hashes gives the same hit.
  v1::RouteRequest by_hash;
  by_hash.mutable_model()->set_name("tiny-gqa");
  for (const auto& h : hashes) by_hash.add_block_hashes(h.ToBytes());
  by_hash.set_policy("ttft");
  auto r2 = client_->Route(by_hash);
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(r2->gpu_hit_blocks(), 6u);
  EXPECT_EQ(r2->policy(), "ttft");

  auto st = client_->GetStats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->instances_size(), 2);
  EXPECT_EQ(st->index_entries(), 6u);
  EXPECT_GT(st->index_bytes(), 0u);
  EXPECT_EQ(st->decisions_by_policy().at("cache_aware"), 1u);
  EXPECT_EQ(st->decisions_by_policy().at("ttft"), 1u);

  // Completion through the heartbeat releases the optimistic load.
  v1::HeartbeatRequest hb;
  hb.set_source_id("w1");
  hb.add_completed_decisions(r->decision_id());
  hb.add_completed_decisions(r2->decision_id());
  ASSERT_TRUE(client_->Heartbeat(hb).ok());
  st = client_->GetStats();
  for (const auto& i : st->instances()) EXPECT_EQ(i.inflight_decisions(), 0u) << i.source_id();
}

TEST_F(RouterServiceTest, GapRequestsDumpAndDumpRestores) {
  RegisterWorker("w0");
  const auto hashes = hasher_->HashPrefix(Tokens(16 * 4, 2));
  auto pub = client_->PublishEvents({Stored("w0", 1, hashes, 1), Stored("w0", 3, hashes, 2)});
  ASSERT_TRUE(pub.ok()) << pub.status();
  EXPECT_TRUE(pub->full_dump_requested());
  EXPECT_EQ(pub->last_sequence(), 1u);
  v1::HeartbeatRequest hb;
  hb.set_source_id("w0");
  auto h = client_->Heartbeat(hb);
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(h->full_dump_requested());
  v1::EventBatch dump = Stored("w0", 1, hashes, 4, /*dump=*/true);
  dump.set_dump_sequence(3);
  pub = client_->PublishEvents({dump, Stored("w0", 4, hashes, 4)});
  ASSERT_TRUE(pub.ok()) << pub.status();
  EXPECT_FALSE(pub->full_dump_requested());
  EXPECT_EQ(pub->last_sequence(), 4u);
  h = client_->Heartbeat(hb);
  EXPECT_FALSE(h->full_dump_requested());
  auto r = client_->Route(TokensRequest(Tokens(16 * 4, 2)));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->gpu_hit_blocks(), 4u);
}

// A source that registers again starts a new incarnation; the stream it had open before
// belongs to the old one and ends with ABORTED at its next batch instead of writing into
// the new view (RouterHostTest covers the queued cases).
TEST_F(RouterServiceTest, StreamOfAnEarlierRegistrationEndsWithAborted) {
  RegisterWorker("w0");
  const auto hashes = hasher_->HashPrefix(Tokens(16 * 4, 12));
  auto stub = RawStub();
  grpc::ClientContext ctx;
  v1::PublishEventsResponse resp;
  auto old_stream = stub->PublishEvents(&ctx, &resp);
  ASSERT_TRUE(old_stream->Write(Stored("w0", 1, hashes, 1)));
  // The stream is bound to the registration by its first batch: wait until it applied.
  bool applied = false;
  for (int i = 0; i < 2000 && !applied; ++i) {
    auto st = client_->GetStats();
    ASSERT_TRUE(st.ok());
    applied = st->instances_size() == 1 && st->instances(0).last_sequence() == 1;
    if (!applied) absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(applied) << "the old stream's first batch never applied";
  RegisterWorker("w0");
  ASSERT_TRUE(client_->PublishEvents({Stored("w0", 1, hashes, 1, /*dump=*/true)}).ok());
  old_stream->Write(Stored("w0", 2, hashes, 3));  // seq 2 follows the new dump's 1
  old_stream->WritesDone();
  const grpc::Status s = old_stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_NE(s.error_message().find("registered again"), std::string::npos) << s.error_message();
  auto r = client_->Route(TokensRequest(Tokens(16 * 4, 12)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->gpu_hit_blocks(), 1u) << "the old stream's blocks reached the new registration";
}

// A stream that breaks may have lost batches its client already wrote (a Write succeeds
// once gRPC has the message), and no later sequence number need ever show the gap: the
// router marks its source stale when such a stream ends, so the source's next heartbeat
// asks for a full dump. So does a stream the router ended with an error. A stream its
// client half-closed lost nothing: its source is not asked.
TEST_F(RouterServiceTest, BrokenStreamAsksItsSourceForADump) {
  RegisterWorker("w0");
  RegisterWorker("w1");
  RegisterWorker("w2");
  RegisterWorker("w3");
  const auto hashes = hasher_->HashPrefix(Tokens(16 * 4, 31));
  auto stub = RawStub();
  auto heartbeat = [&](const std::string& id) {
    v1::HeartbeatRequest hb;
    hb.set_source_id(id);
    auto r = client_->Heartbeat(hb);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() && r->full_dump_requested();
  };

  grpc::ClientContext cut_ctx;
  v1::PublishEventsResponse cut_resp;
  auto cut = stub->PublishEvents(&cut_ctx, &cut_resp);
  ASSERT_TRUE(cut->Write(Stored("w0", 1, hashes, 4)));
  ASSERT_TRUE(Eventually([&] { return IndexBlocksOf("w0") == 4; }));
  cut_ctx.TryCancel();
  EXPECT_EQ(cut->Finish().error_code(), grpc::StatusCode::CANCELLED);

  grpc::ClientContext bad_ctx;
  v1::PublishEventsResponse bad_resp;
  auto bad = stub->PublishEvents(&bad_ctx, &bad_resp);
  ASSERT_TRUE(bad->Write(Stored("w1", 1, hashes, 2)));
  ASSERT_TRUE(Eventually([&] { return IndexBlocksOf("w1") == 2; }));
  v1::EventBatch refused = Stored("w1", 2, hashes, 1);
  refused.mutable_events(0)->mutable_stored()->set_block_hashes(0, "short");
  bad->Write(refused);
  bad->WritesDone();
  EXPECT_EQ(bad->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  ASSERT_TRUE(client_->PublishEvents({Stored("w2", 1, hashes, 3)}).ok());  // half-closed

  // A stream whose first batch is refused: the source (named, registered) had sent
  // nothing else on it, and may send nothing more for long.
  grpc::ClientContext first_ctx;
  v1::PublishEventsResponse first_resp;
  auto first = stub->PublishEvents(&first_ctx, &first_resp);
  v1::EventBatch bad_first = Stored("w3", 1, hashes, 1);
  bad_first.mutable_events(0)->mutable_stored()->set_block_hashes(0, "short");
  first->Write(bad_first);
  first->WritesDone();
  EXPECT_EQ(first->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  ASSERT_TRUE(Eventually([&] { return heartbeat("w0"); })) << "a cancelled stream's source was not asked";
  ASSERT_TRUE(Eventually([&] { return heartbeat("w1"); })) << "a refused stream's source was not asked";
  ASSERT_TRUE(Eventually([&] { return heartbeat("w3"); })) << "a stream refused at its first batch did not ask";
  EXPECT_FALSE(heartbeat("w2"));
  EXPECT_EQ(IndexBlocksOf("w0"), 4u);  // kept until the dump lands

  v1::EventBatch dump = Stored("w0", 1, hashes, 2, /*dump=*/true);
  dump.set_dump_sequence(1);
  ASSERT_TRUE(client_->PublishEvents({dump}).ok());
  EXPECT_FALSE(heartbeat("w0"));
  EXPECT_EQ(IndexBlocksOf("w0"), 2u);
}

// A stream that names its registration is judged by it, not by when the router reads
// its first batch: one read only after the source registered again is still refused.
TEST_F(RouterServiceTest, StreamNamingAnOlderRegistrationIsRefusedHoweverLateItIsRead) {
  uint64_t first = 0, second = 0;
  RegisterWorker("w0", true, &first);
  RegisterWorker("w0", true, &second);
  ASSERT_NE(first, second);
  const auto hashes = hasher_->HashPrefix(Tokens(16 * 4, 13));
  auto stub = RawStub();
  {
    grpc::ClientContext ctx;
    v1::PublishEventsResponse resp;
    auto old_stream = stub->PublishEvents(&ctx, &resp);
    v1::EventBatch b = Stored("w0", 1, hashes, 2, /*dump=*/true);
    b.set_registration(first);
    old_stream->Write(b);
    old_stream->WritesDone();
    const grpc::Status s = old_stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  }
  auto r = client_->Route(TokensRequest(Tokens(16 * 4, 13)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->gpu_hit_blocks(), 0u) << "a stream of the first registration reached the second";
  {
    grpc::ClientContext ctx;
    v1::PublishEventsResponse resp;
    auto stream = stub->PublishEvents(&ctx, &resp);
    v1::EventBatch b = Stored("w0", 1, hashes, 2, /*dump=*/true);
    b.set_registration(second);
    ASSERT_TRUE(stream->Write(b));
    b = Stored("w0", 3, hashes, 3);
    b.set_registration(first);  // a stream keeps the registration its first batch named
    stream->Write(b);
    stream->WritesDone();
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find("registration="), std::string::npos) << s.error_message();
  }
  r = client_->Route(TokensRequest(Tokens(16 * 4, 13)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->gpu_hit_blocks(), 2u) << "the current registration's dump did not apply";
  {
    // One the source was never given (ids only grow) is named as such, INVALID_ARGUMENT
    // (before: ABORTED, "registered again after this stream began").
    grpc::ClientContext ctx;
    v1::PublishEventsResponse resp;
    auto stream = stub->PublishEvents(&ctx, &resp);
    v1::EventBatch b = Stored("w0", 1, hashes, 2, /*dump=*/true);
    b.set_registration(second + 1000);
    stream->Write(b);
    stream->WritesDone();
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find("is not one source_id=\"w0\" was given"), std::string::npos)
        << s.error_message();
  }
}

// EventPublisher on a stream the router ends with ABORTED (its source id was registered
// again elsewhere): after retry_interval it registers again, opens a new stream and sends
// a full dump there, which the router applies under the new registration.
TEST_F(RouterServiceTest, PublisherWhoseStreamIsAbortedRegistersAgainAndDumps) {
  const auto tokens = Tokens(16 * 4, 31);
  const auto hashes = hasher_->HashPrefix(tokens);
  EventPublisher pub(PublisherOptions(hashes, absl::Milliseconds(20)));
  pub.Start();
  ASSERT_TRUE(Eventually([&] { return pub.dumps_sent() == 1 && IndexBlocksOf("w0") == 4; }))
      << "the publisher's first dump never landed";
  const uint64_t first = server_->host().RegistrationOf("w0");

  uint64_t other = 0;
  RegisterWorker("w0", true, &other);  // another process with the same id
  ASSERT_GT(other, first);
  ASSERT_EQ(IndexBlocksOf("w0"), 0u);
  // The publisher learns it at its next write: the router ends the stream with ABORTED.
  // (A block of the dump: one that lands on the new stream changes nothing.)
  ASSERT_TRUE(Eventually([&] {
    pub.Publish(StoredEvent(hashes[0]));
    return pub.registrations() == 2;
  })) << "the publisher did not register again after its stream ended with ABORTED";
  ASSERT_TRUE(Eventually([&] { return pub.dumps_sent() == 2 && IndexBlocksOf("w0") == 4; }))
      << "no new dump after the stream ended with ABORTED";

  EXPECT_EQ(pub.registrations(), 2u) << "one Register at start, one after ABORTED";
  EXPECT_GT(server_->host().RegistrationOf("w0"), other) << "the publisher's Register did not follow the other's";
  EXPECT_TRUE(pub.connected());
  auto r = client_->Route(TokensRequest(tokens));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->instance_id(), "w0");
  EXPECT_EQ(r->gpu_hit_blocks(), 4u) << "the new dump is not in the router's view";
}

// Two publishers with one source id take the registration from each other. The one whose
// stream ends with ABORTED waits retry_interval (here longer than the test) before it
// registers again: while the other publishes, nobody registers, instead of a Register
// (and a dump) per write on both sides.
TEST_F(RouterServiceTest, PublisherWhoseStreamIsAbortedWaitsBeforeRegisteringAgain) {
  const auto hashes = hasher_->HashPrefix(Tokens(16 * 4, 33));
  EventPublisher first(PublisherOptions(hashes, absl::Hours(1)));
  first.Start();
  ASSERT_TRUE(Eventually([&] { return first.dumps_sent() == 1 && IndexBlocksOf("w0") == 4; }));
  EventPublisher second(PublisherOptions(hashes, absl::Hours(1)));
  second.Start();
  ASSERT_TRUE(Eventually([&] { return second.dumps_sent() == 1 && IndexBlocksOf("w0") == 4; }));
  const uint64_t current = server_->host().RegistrationOf("w0");

  const auto extra = hasher_->HashPrefix(Tokens(16 * 200, 34));
  ASSERT_TRUE(Eventually([&] {
    first.Publish(StoredEvent(extra[0]));
    return !first.connected() || first.registrations() > 1;
  })) << "the first publisher's stream (an older registration) never ended";
  ASSERT_EQ(first.registrations(), 1u) << "the first publisher registered again as soon as its stream ended";
  // A window of writes by the second: a first publisher that registered again at once
  // would end the second's stream, and so on.
  for (size_t i = 1; i < extra.size(); ++i) {
    second.Publish(StoredEvent(extra[i]));
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_TRUE(Eventually([&] { return IndexBlocksOf("w0") == 4 + extra.size() - 1; }))
      << "the second publisher's events did not all land: " << IndexBlocksOf("w0") << " blocks";

  EXPECT_EQ(server_->host().RegistrationOf("w0"), current) << "someone registered w0 again during the window";
  EXPECT_EQ(first.registrations(), 1u);
  EXPECT_EQ(second.registrations(), 1u);
  EXPECT_EQ(second.dumps_sent(), 1u);
  EXPECT_FALSE(first.connected());
  EXPECT_TRUE(second.connected());
}

TEST_F(RouterServiceTest, BadInputGetsClearErrorsAndOthersAreStillServed) {
  RegisterWorker("w0");
  auto expect = [](const absl::Status& s, absl::StatusCode code, absl::string_view needle) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(needle), absl::string_view::npos) << s.message() << " lacks " << needle;
  };
  v1::RouteRequest empty;
  empty.mutable_model()->set_name("tiny-gqa");
  expect(client_->Route(empty).status(), absl::StatusCode::kInvalidArgument, "tokens/block_hashes");
  v1::RouteRequest no_model = TokensRequest(Tokens(32, 3));
  no_model.mutable_model()->clear_name();
  expect(client_->Route(no_model).status(), absl::StatusCode::kInvalidArgument, "model.name");
  v1::RouteRequest unknown = TokensRequest(Tokens(32, 3), "llama-9");
  expect(client_->Route(unknown).status(), absl::StatusCode::kInvalidArgument, "model.name=\"llama-9\"");
  // A 200 KB name: echoed clipped (in full, the status was too large to send at all).
  v1::RouteRequest long_name = TokensRequest(Tokens(32, 3), std::string(200'000, 'm'));
  expect(client_->Route(long_name).status(), absl::StatusCode::kInvalidArgument, "...(200000 bytes)");
  // A 200 KB policy: echoed clipped too.
  v1::RouteRequest long_policy = TokensRequest(Tokens(32, 3));
  long_policy.set_policy(std::string(200'000, 'p'));
  expect(client_->Route(long_policy).status(), absl::StatusCode::kInvalidArgument, "is not a policy");
  // A heartbeat's source_id is checked as Register's is.
  v1::HeartbeatRequest bad_source;
  bad_source.set_source_id("bad id!");
  expect(client_->Heartbeat(bad_source).status(), absl::StatusCode::kInvalidArgument, "source_id=\"bad id!\"");
  v1::RouteRequest bs = TokensRequest(Tokens(32, 3));
  bs.mutable_model()->set_block_tokens(64);
  expect(client_->Route(bs).status(), absl::StatusCode::kInvalidArgument, "model.block_tokens=64");
  v1::RouteRequest bad_hash;
  bad_hash.mutable_model()->set_name("tiny-gqa");
  bad_hash.add_block_hashes(std::string(16, 'a'));
  bad_hash.add_block_hashes(std::string(15, 'b'));
  expect(client_->Route(bad_hash).status(), absl::StatusCode::kInvalidArgument, "block_hashes[1]");
  v1::RouteRequest both = TokensRequest(Tokens(32, 3));
  both.add_block_hashes(std::string(16, 'a'));
  expect(client_->Route(both).status(), absl::StatusCode::kInvalidArgument, "exactly one");
  // Fields the request's form would ignore are refused (before, they were dropped).
  v1::RouteRequest salted_hashes;
  salted_hashes.mutable_model()->set_name("tiny-gqa");
  salted_hashes.add_block_hashes(std::string(16, 'a'));
  salted_hashes.set_tenant_salt("tenant-1");
  expect(client_->Route(salted_hashes).status(), absl::StatusCode::kInvalidArgument, "tenant_salt");
  salted_hashes.clear_tenant_salt();
  salted_hashes.add_extra_keys(7);
  expect(client_->Route(salted_hashes).status(), absl::StatusCode::kInvalidArgument, "extra_keys");
  v1::RouteRequest counted = TokensRequest(Tokens(32, 3));
  counted.set_prompt_tokens(33);
  expect(client_->Route(counted).status(), absl::StatusCode::kInvalidArgument, "prompt_tokens");
  counted.set_prompt_tokens(32);  // the same count: fine
  EXPECT_TRUE(client_->Route(counted).ok());
  // A chain repeating a block would link the worker's predicted blocks into a cycle.
  v1::RouteRequest repeated_hash;
  repeated_hash.mutable_model()->set_name("tiny-gqa");
  for (const char c : {'a', 'b', 'a'}) repeated_hash.add_block_hashes(std::string(16, c));
  expect(client_->Route(repeated_hash).status(), absl::StatusCode::kInvalidArgument, "block_hashes[2]: repeats block_hashes[0]");
  v1::RouteRequest no_worker = TokensRequest(Tokens(64, 3), "tiny-mla");
  expect(client_->Route(no_worker).status(), absl::StatusCode::kUnavailable, "tiny-mla");

  const auto hashes = hasher_->HashPrefix(Tokens(32, 4));
  expect(client_->PublishEvents({Stored("ghost", 1, hashes, 2)}).status(), absl::StatusCode::kNotFound,
         "source_id=\"ghost\"");
  v1::EventBatch malformed = Stored("w0", 1, hashes, 2);
  malformed.mutable_events(0)->mutable_stored()->set_block_hashes(1, "short");
  expect(client_->PublishEvents({malformed}).status(), absl::StatusCode::kInvalidArgument,
         "events[0].stored.block_hashes[1]");
  v1::EventBatch no_tier = Stored("w0", 1, hashes, 2);
  no_tier.mutable_events(0)->mutable_stored()->set_tier(v1::TIER_UNSPECIFIED);
  expect(client_->PublishEvents({no_tier}).status(), absl::StatusCode::kInvalidArgument, "events[0].stored.tier");
  v1::EventBatch future_tier = Stored("w0", 1, hashes, 2);  // a value this build does not know
  future_tier.mutable_events(0)->mutable_stored()->set_tier(static_cast<v1::Tier>(9));
  expect(client_->PublishEvents({future_tier}).status(), absl::StatusCode::kInvalidArgument,
         "events[0].stored.tier: 9, which is not a Tier");
  // Workers publish their GPU pool; a DRAM copy of a worker would be routed as a pool
  // hit no worker can fetch.
  v1::EventBatch worker_dram = Stored("w0", 1, hashes, 2);
  worker_dram.mutable_events(0)->mutable_stored()->set_tier(v1::TIER_DRAM);
  expect(client_->PublishEvents({worker_dram}).status(), absl::StatusCode::kInvalidArgument,
         "events[0].stored.tier=DRAM from worker \"w0\"; workers publish TIER_GPU");
  v1::EventBatch repeated = Stored("w0", 1, hashes, 2);  // blocks 0, 1, 0: a cycle
  repeated.mutable_events(0)->mutable_stored()->add_block_hashes(hashes[0].ToBytes());
  expect(client_->PublishEvents({repeated}).status(), absl::StatusCode::kInvalidArgument,
         "events[0].stored.block_hashes[2] repeats block_hashes[0]");
  v1::EventBatch stray_dump_sequence = Stored("w0", 1, hashes, 2);  // not a full dump
  stray_dump_sequence.set_dump_sequence(1000);
  expect(client_->PublishEvents({stray_dump_sequence}).status(), absl::StatusCode::kInvalidArgument,
         "dump_sequence: 1000 set on a batch that is not a full dump");
  // Sequences are 1..2^63: one far above would freeze the source's index (every later
  // event a duplicate).
  v1::EventBatch huge_sequence = Stored("w0", (uint64_t{1} << 63) + 1, hashes, 2);
  expect(client_->PublishEvents({huge_sequence}).status(), absl::StatusCode::kInvalidArgument,
         "events[0].sequence");
  v1::EventBatch huge_dump;
  huge_dump.set_source_id("w0");
  huge_dump.set_full_dump(true);
  huge_dump.set_dump_sequence(~uint64_t{0});
  expect(client_->PublishEvents({huge_dump}).status(), absl::StatusCode::kInvalidArgument, "dump_sequence");
  v1::RegisterRequest bad_reg;
  bad_reg.set_source_id("w9");
  expect(client_->Register(bad_reg).status(), absl::StatusCode::kInvalidArgument, "kind");
  bad_reg.set_kind(v1::SOURCE_KIND_WORKER);
  bad_reg.mutable_model()->set_name("tiny-gqa");
  // An address the router would hand to callers must be one they can dial.
  for (const char* a : {"", "w9.local", "w9.local:0", "w9.local:70000", ":7000", "::1:7000", "w9.local:7x",
                        "[::1:7000"}) {
    bad_reg.set_address(a);
    expect(client_->Register(bad_reg).status(), absl::StatusCode::kInvalidArgument,
           absl::StrCat("address: '", a, "'"));
  }
  bad_reg.set_address("[::1]:7000");
  v1::RegisterRequest pool_with_model = bad_reg;  // a model names a worker's; refused, not dropped
  pool_with_model.set_kind(v1::SOURCE_KIND_POOL_NODE);
  expect(client_->Register(pool_with_model).status(), absl::StatusCode::kInvalidArgument,
         "model: set for a pool node");
  bad_reg.mutable_model()->set_block_tokens(32);
  expect(client_->Register(bad_reg).status(), absl::StatusCode::kInvalidArgument, "model.block_tokens=32");
  v1::HeartbeatRequest hb;
  hb.set_source_id("w0");
  hb.mutable_load()->set_kv_usage(1.5);
  expect(client_->Heartbeat(hb).status(), absl::StatusCode::kInvalidArgument, "load.kv_usage");
  hb.set_source_id("nobody");
  hb.mutable_load()->set_kv_usage(0.5);
  auto unknown_hb = client_->Heartbeat(hb);
  ASSERT_TRUE(unknown_hb.ok());
  EXPECT_TRUE(unknown_hb->unknown_source());

  // After all that, the router still serves good requests and good events. The refused
  // batches' streams ended in errors, so w0 is asked for a full dump (events written after
  // a refused batch are never read), and its dump is applied.
  hb.set_source_id("w0");
  auto stale = client_->Heartbeat(hb);
  ASSERT_TRUE(stale.ok()) << stale.status();
  EXPECT_TRUE(stale->full_dump_requested());
  v1::EventBatch dump = Stored("w0", 1, hashes, 2, /*dump=*/true);
  dump.set_dump_sequence(1);
  ASSERT_TRUE(client_->PublishEvents({dump}).ok());
  auto r = client_->Route(TokensRequest(Tokens(32, 4)));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->gpu_hit_blocks(), 2u);
}

TEST_F(RouterServiceTest, EventFloodDoesNotStopRoute) {
  RegisterWorker("w0");
  RegisterWorker("w1");
  // One source streams 200 batches of 64 events while another thread routes.
  std::vector<v1::EventBatch> flood;
  uint64_t seq = 0;
  for (int b = 0; b < 200; ++b) {
    v1::EventBatch batch;
    batch.set_source_id("w0");
    for (int e = 0; e < 64; ++e) {
      const auto hashes = hasher_->HashPrefix(Tokens(16 * 2, static_cast<uint32_t>(1000 + b * 64 + e)));
      v1::KvEvent* ev = batch.add_events();
      ev->set_sequence(++seq);
      for (const auto& h : hashes) ev->mutable_stored()->add_block_hashes(h.ToBytes());
      ev->mutable_stored()->set_kind(v1::STATE_KIND_ATTN_KV);
      ev->mutable_stored()->set_tier(v1::TIER_GPU);
    }
    flood.push_back(std::move(batch));
  }
  std::atomic<bool> flooding{true};
  std::atomic<int> routed{0}, failed{0};
  std::thread router([&] {
    for (int i = 0; flooding.load() || i < 50; ++i) {
      auto r = client_->Route(TokensRequest(Tokens(64, 7)));
      (r.ok() ? routed : failed).fetch_add(1);
    }
  });
  auto pub = client_->PublishEvents(flood);
  flooding = false;
  router.join();
  ASSERT_TRUE(pub.ok()) << pub.status();
  EXPECT_EQ(pub->events_applied(), 200u * 64);
  EXPECT_EQ(pub->last_sequence(), seq);
  EXPECT_EQ(failed.load(), 0);
  EXPECT_GE(routed.load(), 50);
  auto st = client_->GetStats();
  EXPECT_EQ(st->index_entries(), 200u * 64 * 2);
}

// Unregister drops a source at once (it used to stay routable until its heartbeats were
// missed); a stale registration number or an unknown id drops nothing (NOT_FOUND), a bad
// id is INVALID_ARGUMENT. An EventPublisher unregisters its source when it stops.
TEST_F(RouterServiceTest, UnregisterDropsTheSourceAtOnce) {
  auto registered = [&](const std::string& id) {
    for (const SourceStats& st : server_->host().Stats().sources) {
      if (st.id == id) return true;
    }
    return false;
  };
  uint64_t first = 0, second = 0;
  RegisterWorker("w1", true, &first);
  RegisterWorker("w1", true, &second);  // registered again: `first` is stale
  auto stub = RawStub();
  auto unregister = [&](const std::string& id, uint64_t registration) {
    v1::UnregisterRequest req;
    req.set_source_id(id);
    req.set_registration(registration);
    v1::UnregisterResponse resp;
    grpc::ClientContext ctx;
    return stub->Unregister(&ctx, req, &resp);
  };
  grpc::Status st = unregister("w1", first);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  EXPECT_TRUE(registered("w1"));
  st = unregister("w 1", 0);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("source_id"), std::string::npos) << st.error_message();
  EXPECT_TRUE(unregister("w1", second).ok());
  EXPECT_FALSE(registered("w1"));
  EXPECT_EQ(unregister("w1", 0).error_code(), grpc::StatusCode::NOT_FOUND);
  auto routed = client_->Route(TokensRequest(Tokens(64, 1)));
  EXPECT_EQ(routed.status().code(), absl::StatusCode::kUnavailable) << routed.status();

  auto publisher = std::make_unique<EventPublisher>(PublisherOptions({}, absl::Milliseconds(50)));
  publisher->Start();
  ASSERT_TRUE(Eventually([&] { return registered("w0"); }));
  publisher->Stop();
  EXPECT_FALSE(registered("w0")) << "a stopped publisher's source stays routable";
  publisher.reset();  // Stop again: nothing left to unregister
}

TEST_F(RouterServiceTest, HealthServiceAndMetricsEndpoint) {
  RegisterWorker("w0");
  ASSERT_TRUE(client_->Route(TokensRequest(Tokens(64, 9))).ok());
  // grpc.health.v1.Health/Check {service: "kvpool.v1.Router"} -> {status: SERVING (1)}.
  auto channel = grpc::CreateChannel(addr_, grpc::InsecureChannelCredentials());
  grpc::GenericStub generic(channel);
  const std::string service = "kvpool.v1.Router";
  std::string req_bytes = std::string("\x0a", 1) + static_cast<char>(service.size()) + service;
  grpc::Slice slice(req_bytes);
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::ClientContext ctx;
  absl::Notification done;
  grpc::Status status;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp, [&](grpc::Status s) {
    status = s;
    done.Notify();
  });
  done.WaitForNotification();
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(resp.Dump(&slices).ok());
  std::string out;
  for (const auto& s : slices) out += std::string(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_EQ(out, std::string("\x08\x01", 2));

  httplib::Client http("127.0.0.1", server_->metrics_port());
  auto res = http.Get("/metrics");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  EXPECT_NE(res->body.find("kvpool_router_decisions_total{policy=\"cache_aware\"} 1"), std::string::npos)
      << res->body;
  EXPECT_NE(res->body.find("kvpool_router_index_entries"), std::string::npos);
  EXPECT_NE(res->body.find("kvpool_router_index_bytes_per_entry"), std::string::npos);
  EXPECT_NE(res->body.find("kvpool_router_event_lag_seconds"), std::string::npos);
  EXPECT_NE(res->body.find("kvpool_router_predicted_hit_blocks_total{tier=\"gpu\"}"), std::string::npos);
}

TEST_F(RouterServiceTest, KvctlRouteAndStatus) {
  RegisterWorker("w0");
  RegisterWorker("a1", /*events=*/false);
  auto run = [](std::vector<std::string> args) {
    args.insert(args.begin(), "kvctl");
    std::ostringstream out, err;
    const int code = kvctl::RunKvctl(args, out, err);
    return std::make_tuple(code, out.str(), err.str());
  };
  auto [code, out, err] = run({"route", "--router", addr_, "--model", "tiny-gqa", "--tokens", "0-63", "--json"});
  ASSERT_EQ(code, 0) << err;
  auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["total_blocks"], 4);
  const std::string first = j["instance_id"];
  // Approximate mode: a1 (if chosen) now predicts the prefix; a session sticks.
  auto [c2, out2, err2] = run({"route", "--router", addr_, "--model", "tiny-gqa", "--tokens", "0-63", "--session",
                               "s1", "--policy", "session", "--json"});
  ASSERT_EQ(c2, 0) << err2;
  const std::string sticky = nlohmann::json::parse(out2)["instance_id"];
  for (int i = 0; i < 3; ++i) {
    auto [c3, out3, err3] = run({"route", "--router", addr_, "--model", "tiny-gqa", "--tokens", "5,6,7", "--session",
                                 "s1", "--policy", "session", "--json"});
    ASSERT_EQ(c3, 0) << err3;
    EXPECT_EQ(nlohmann::json::parse(out3)["instance_id"], sticky);
  }
  auto h = hasher_->HashPrefix(Tokens(32, 5));
  auto [c4, out4, err4] =
      run({"route", "--router", addr_, "--model", "tiny-gqa", "--hashes", h[0].ToHex() + "," + h[1].ToHex()});
  ASSERT_EQ(c4, 0) << err4;
  EXPECT_NE(out4.find("route -> "), std::string::npos);

  auto [c5, out5, err5] = run({"status", "--router", addr_, "--json"});
  ASSERT_EQ(c5, 0) << err5;
  auto s = nlohmann::json::parse(out5);
  EXPECT_EQ(s["instances"].size(), 2u);
  EXPECT_EQ(s["decisions_by_policy"]["session"], 4);
  auto [c6, out6, err6] = run({"status", "--router", addr_});
  ASSERT_EQ(c6, 0) << err6;
  EXPECT_NE(out6.find("approximate"), std::string::npos);

  // Errors name the flag or carry the router's message.
  auto [c7, o7, e7] = run({"route", "--router", addr_, "--model", "tiny-gqa"});
  EXPECT_EQ(c7, 2);
  EXPECT_NE(e7.find("--tokens"), std::string::npos);
  auto [c8, o8, e8] = run({"route", "--router", addr_, "--model", "nope", "--tokens", "1-40"});
  EXPECT_EQ(c8, 2);  // the router refused the arguments: kvctl's "bad arguments" code
  EXPECT_NE(e8.find("INVALID_ARGUMENT"), std::string::npos);
  auto [c9, o9, e9] = run({"route", "--router", addr_, "--hashes", "xyz"});
  EXPECT_EQ(c9, 2);
  EXPECT_NE(e9.find("--hashes[0]"), std::string::npos);
}

// A 10M-entry list would be released under core_mu_ and stall every Route.
TEST_F(RouterServiceTest, HeartbeatWithTooManyCompletedDecisionsIsRefused) {
  RegisterWorker("w0");
  v1::HeartbeatRequest hb;
  hb.set_source_id("w0");
  for (uint64_t i = 1; i <= 65536; ++i) hb.add_completed_decisions(i);
  auto ok = client_->Heartbeat(hb);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(ok->unknown_source());

  hb.add_completed_decisions(65537);
  auto r = client_->Heartbeat(hb);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("completed_decisions: 65537 entries; send at most 65536 per heartbeat"),
            absl::string_view::npos)
      << r.status();
}

// Runs kvpool-router's main with `args`; returns its exit code and stderr. Every call
// here also passes --max-streams 0 (unless `args` names it), so a config the other flag
// checks let through fails there instead of serving forever; --listen and --metrics-port
// get loopback defaults unless `args` names them.
std::pair<int, std::string> RunRouterMainWith(std::vector<std::string> args) {
  for (auto [flag, value] : {std::pair{"--listen", "127.0.0.1:0"}, std::pair{"--metrics-port", "-1"},
                             std::pair{"--max-streams", "0"}}) {
    if (std::find(args.begin(), args.end(), flag) == args.end()) {
      args.push_back(flag);
      args.push_back(value);
    }
  }
  args.insert(args.begin(), "kvpool-router");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  testing::internal::CaptureStderr();
  const int rc = RunRouterMain(static_cast<int>(argv.size()), argv.data());
  return {rc, testing::internal::GetCapturedStderr()};
}

// Flag values that used to start a router that misbehaves: a port gRPC takes modulo
// 65536, NaN or negative policy weights, an infinite timeout or SLO. Each is refused
// with exit 2, naming the flag.
TEST(RouterMainTest, NonsenseFlagValuesAreRefusedNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--listen", "127.0.0.1:99999"}, "--listen='127.0.0.1:99999' has no port in 0..65535"},
      {{"--listen", "a b:5"}, "--listen='a b:5' has a host with characters"},
      {{"--overlap-weight", "nan"}, "--overlap-weight=nan must be a finite number >= 0"},
      {{"--load-weight", "-3"}, "--load-weight=-3 must be a finite number >= 0"},
      {{"--balance-abs", "inf"}, "--balance-abs=inf must be a finite number >= 0"},
      {{"--ttft-slo", "nan"}, "--ttft-slo=nan must be a finite number"},
      {{"--heartbeat-timeout", "inf"}, "--heartbeat-timeout=inf must be in (0, 86400] seconds"},
      {{"--metrics-port", "-5"}, "--metrics-port=-5 must be -1 (off)"},
      {{"--pool-dram-bandwidth", "1e-320"}, "--pool-dram-bandwidth='1e-320' is outside 1000..1e+15 bytes/s"},
      {{"--pool-nvme-bandwidth", "0"}, "--pool-nvme-bandwidth='0' must be > 0"},
      {{"--flops", "1e-300"}, "--flops='1e-300' is outside 1e+06..1e+21 FLOP/s"},
      {{"--flops", "12abc"}, "--flops='12abc' has an unknown suffix"},
      {{"--max-message-bytes", "1MiB"}, "--max-message-bytes='1MiB' is outside 8388608..2146435072 bytes"},
      {{"--max-message-bytes", "4GiB"}, "--max-message-bytes='4GiB' is outside 8388608..2146435072 bytes"},
      {{"--max-message-bytes", "lots"}, "--max-message-bytes"},
  };
  for (const auto& [args, want] : cases) {
    auto [rc, err] = RunRouterMainWith(args);
    EXPECT_EQ(rc, 2) << args[0] << " " << args[1];
    EXPECT_NE(err.find(want), std::string::npos) << err;
  }
}

TEST(RouterMainTest, StartRefusesAMessageBoundBelowASourcesBatch) {
  RouterServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_port = -1;
  o.max_message_bytes = 1 << 20;
  auto s = RouterServer::Start(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("--max-message-bytes=1048576 is below 8 MiB"), absl::string_view::npos)
      << s.status();
}

TEST(RouterMainTest, HeartbeatTimeoutShorterThanTwoIntervalsIsRefused) {
  // The default --heartbeat-timeout (10 s) with a 60 s interval: every source dropped.
  auto [rc, err] = RunRouterMainWith({"--heartbeat-interval-ms", "60000"});
  EXPECT_EQ(rc, 2);
  EXPECT_NE(err.find("--heartbeat-timeout=10 s is shorter than 2 x --heartbeat-interval-ms=60000 ms"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("at least 120 s"), std::string::npos) << err;

  std::tie(rc, err) = RunRouterMainWith({"--heartbeat-interval-ms", "1000", "--heartbeat-timeout", "1.5"});
  EXPECT_EQ(rc, 2);
  EXPECT_NE(err.find("--heartbeat-timeout"), std::string::npos) << err;
}

TEST(RouterMainTest, HeartbeatTimeoutOfTwoIntervalsIsAccepted) {
  // Gets past the heartbeat check and stops at --max-streams 0.
  auto [rc, err] = RunRouterMainWith({"--heartbeat-interval-ms", "60000", "--heartbeat-timeout", "120"});
  EXPECT_EQ(rc, 2);
  EXPECT_EQ(err.find("--heartbeat-timeout"), std::string::npos) << err;
  EXPECT_NE(err.find("--max-streams"), std::string::npos) << err;
}

}  // namespace
}  // namespace kvpool::router
