// EventPublisher against a fake kvpool.v1.Router (a real loopback gRPC server, sync API)
// whose faults the test sets: failing heartbeats, dump requests, a stream it never reads.
#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "kvpool/router/event_publisher.h"
#include "kvpool/v1/router.grpc.pb.h"

namespace kvpool::router {
namespace {

// Waits (bounded) are for progress of the publisher thread, never assertions on speed.
constexpr absl::Duration kWait = absl::Seconds(30);

class FakeRouter final : public v1::Router::Service {
 public:
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest*, v1::RegisterResponse* resp) override {
    absl::MutexLock l(&mu);
    ++registers;
    resp->set_heartbeat_interval_ms(20);  // heartbeats every 10 ms: the tests run fast
    resp->set_next_sequence(1);
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req, v1::HeartbeatResponse* resp) override {
    absl::MutexLock l(&mu);
    ++heartbeats;
    if (fail_heartbeats == 0) {
      completed += req->completed_decisions_size();
      most_completed = std::max(most_completed, req->completed_decisions_size());
    }
    if (fail_heartbeats > 0) {
      --fail_heartbeats;
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "injected: heartbeat timed out");
    }
    if (request_dump_at_heartbeat == heartbeats) resp->set_full_dump_requested(true);
    return grpc::Status::OK;
  }

  grpc::Status PublishEvents(grpc::ServerContext* ctx, grpc::ServerReader<v1::EventBatch>* reader,
                             v1::PublishEventsResponse*) override {
    {
      absl::MutexLock l(&mu);
      ++streams;
    }
    if (refuse_streams) {  // a router at its --max-streams, as RouterHost::OpenStream answers
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "injected: too many event streams open");
    }
    if (stop_reading) {  // a hung router: the client's writes fill the HTTP/2 window
      while (!release.WaitForNotificationWithTimeout(absl::Milliseconds(50))) {
        if (ctx->IsCancelled()) break;
      }
      return grpc::Status::OK;
    }
    v1::EventBatch b;
    while (reader->Read(&b)) {
      absl::MutexLock l(&mu);
      full_dumps += b.full_dump();
      events += b.events_size();
      ++batches;
      largest_batch = std::max(largest_batch, b.ByteSizeLong());
    }
    return grpc::Status::OK;
  }

  absl::Mutex mu;
  int registers ABSL_GUARDED_BY(mu) = 0;
  int heartbeats ABSL_GUARDED_BY(mu) = 0;
  int completed ABSL_GUARDED_BY(mu) = 0;       // completed decisions of accepted heartbeats
  int most_completed ABSL_GUARDED_BY(mu) = 0;  // in one of them
  int streams ABSL_GUARDED_BY(mu) = 0;
  int full_dumps ABSL_GUARDED_BY(mu) = 0;
  int events ABSL_GUARDED_BY(mu) = 0;
  int batches ABSL_GUARDED_BY(mu) = 0;
  size_t largest_batch ABSL_GUARDED_BY(mu) = 0;  // encoded bytes
  int fail_heartbeats ABSL_GUARDED_BY(mu) = 0;            // the next N heartbeats fail
  int request_dump_at_heartbeat ABSL_GUARDED_BY(mu) = 0;  // that heartbeat asks for a dump
  bool stop_reading = false;                              // set before the server starts
  bool refuse_streams = false;                            // same
  absl::Notification release;                             // lets a stop_reading stream end
};

class EventPublisherTest : public ::testing::Test {
 protected:
  // max_receive_bytes: the fake's largest message (gRPC's default, 4 MiB, when -1).
  void StartServer(int max_receive_bytes = -1) {
    grpc::ServerBuilder b;
    if (max_receive_bytes > 0) b.SetMaxReceiveMessageSize(max_receive_bytes);
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(&fake_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }

  void TearDown() override {
    if (!fake_.release.HasBeenNotified()) fake_.release.Notify();
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  EventPublisherOptions Options(size_t dump_events) {
    EventPublisherOptions o;
    o.router_address = "127.0.0.1:" + std::to_string(port_);
    o.registration.set_source_id("w0");
    o.registration.set_kind(v1::SOURCE_KIND_WORKER);
    o.dump = [dump_events] {
      std::vector<v1::KvEvent> d(dump_events);
      for (size_t i = 0; i < dump_events; ++i) {
        v1::BlockStored* s = d[i].mutable_stored();
        for (int k = 0; k < 4; ++k) s->add_block_hashes(std::string(16, static_cast<char>('a' + (i + k) % 26)));
        s->set_kind(v1::STATE_KIND_ATTN_KV);
        s->set_tier(v1::TIER_GPU);
      }
      return d;
    };
    o.retry_interval = absl::Milliseconds(20);
    return o;
  }

  // Waits (bounded) until `cond` holds on the fake's state.
  bool AwaitFake(bool (*cond)(FakeRouter&)) {
    absl::MutexLock l(&fake_.mu);
    auto c = [this, cond]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(fake_.mu) { return cond(fake_); };
    return fake_.mu.AwaitWithTimeout(absl::Condition(&c), kWait);
  }

  FakeRouter fake_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// One heartbeat timing out must not re-register: the router would drop the source's
// index entries and in-flight decisions until the dump lands.
TEST_F(EventPublisherTest, OneFailedHeartbeatDoesNotRegisterAgain) {
  {
    absl::MutexLock l(&fake_.mu);
    fake_.fail_heartbeats = 1;  // the first heartbeat, right after Register
  }
  StartServer();
  EventPublisher pub(Options(10));
  pub.Start();
  ASSERT_TRUE(AwaitFake([](FakeRouter& f) ABSL_NO_THREAD_SAFETY_ANALYSIS { return f.heartbeats >= 6; }));
  absl::MutexLock l(&fake_.mu);
  EXPECT_EQ(fake_.registers, 1);
  EXPECT_EQ(fake_.streams, 1);
  EXPECT_EQ(pub.registrations(), 1u);
  EXPECT_EQ(pub.dumps_sent(), 1u);
}

// More completed decisions than one heartbeat may carry (the router refuses over 65,536)
// go out over the following heartbeats, none lost. Before, those beyond 65,536 were
// dropped without a word and waited in the router for its decision timeout.
TEST_F(EventPublisherTest, CompletedDecisionsBeyondOneHeartbeatGoInTheNextOnes) {
  StartServer();
  EventPublisher pub(Options(10));
  for (uint64_t d = 1; d <= 70'000; ++d) pub.CompleteDecision(d);
  pub.Start();
  ASSERT_TRUE(AwaitFake([](FakeRouter& f) ABSL_NO_THREAD_SAFETY_ANALYSIS { return f.completed >= 70'000; }))
      << "completed decisions were lost";
  absl::MutexLock l(&fake_.mu);
  EXPECT_EQ(fake_.completed, 70'000);
  EXPECT_LE(fake_.most_completed, 65'536);
}

// A router that stays unreachable for heartbeats is given up on: register + dump again.
TEST_F(EventPublisherTest, RepeatedHeartbeatFailuresRegisterAgain) {
  {
    absl::MutexLock l(&fake_.mu);
    fake_.fail_heartbeats = 3;
  }
  StartServer();
  EventPublisherOptions o = Options(10);
  o.max_heartbeat_failures = 3;
  EventPublisher pub(std::move(o));
  pub.Start();
  ASSERT_TRUE(AwaitFake([](FakeRouter& f) ABSL_NO_THREAD_SAFETY_ANALYSIS { return f.registers >= 2; }));
  ASSERT_TRUE(AwaitFake([](FakeRouter& f) ABSL_NO_THREAD_SAFETY_ANALYSIS { return f.heartbeats >= 6; }));
  absl::MutexLock l(&fake_.mu);
  EXPECT_EQ(fake_.registers, 2);  // once at start, once after the 3 failures
}

// full_dump_requested is answered with a full_dump batch on the open stream.
TEST_F(EventPublisherTest, DumpRequestIsAnsweredOnTheOpenStream) {
  {
    absl::MutexLock l(&fake_.mu);
    fake_.request_dump_at_heartbeat = 3;
  }
  StartServer();
  EventPublisher pub(Options(10));
  pub.Start();
  ASSERT_TRUE(AwaitFake([](FakeRouter& f) ABSL_NO_THREAD_SAFETY_ANALYSIS { return f.full_dumps >= 2; }));
  ASSERT_TRUE(AwaitFake([](FakeRouter& f) ABSL_NO_THREAD_SAFETY_ANALYSIS { return f.heartbeats >= 6; }));
  absl::MutexLock l(&fake_.mu);
  EXPECT_EQ(fake_.registers, 1);
  EXPECT_EQ(fake_.streams, 1);
  EXPECT_EQ(fake_.full_dumps, 2);
  EXPECT_EQ(fake_.events, 20);
  EXPECT_EQ(pub.dumps_sent(), 2u);
}

// A router at its --max-streams refuses the event stream (RESOURCE_EXHAUSTED) of a source
// its Register accepted. The publisher sees it at a write, and registers again only after
// retry_interval. Before, it registered again at once: every batch of events cost the
// router a Register, a stream and a full dump (here up to one per batch: 3 to 9+ of
// each in three runs of the old code).
TEST_F(EventPublisherTest, RefusedStreamWaitsBeforeRegisteringAgain) {
  fake_.refuse_streams = true;
  StartServer();
  EventPublisherOptions o = Options(10);
  o.retry_interval = absl::Seconds(60);  // longer than the test: one Register at most
  EventPublisher pub(std::move(o));
  pub.Start();
  ASSERT_TRUE(AwaitFake([](FakeRouter& f) ABSL_NO_THREAD_SAFETY_ANALYSIS { return f.streams >= 1; }));
  for (int i = 0; i < 40; ++i) {  // a worker storing blocks: a batch every few ms
    v1::KvEvent e;
    e.mutable_stored()->add_block_hashes(std::string(16, static_cast<char>('a' + i % 26)));
    e.mutable_stored()->set_kind(v1::STATE_KIND_ATTN_KV);
    e.mutable_stored()->set_tier(v1::TIER_GPU);
    pub.Publish(std::move(e));
    absl::SleepFor(absl::Milliseconds(5));  // pacing only: each event its own write
  }
  absl::MutexLock l(&fake_.mu);
  EXPECT_EQ(fake_.registers, 1);
  EXPECT_EQ(fake_.streams, 1);
  EXPECT_FALSE(pub.connected());
}

// Batches end at max_batch_bytes, so a dump and a burst of events larger than the
// router's largest message land whole in one registration. Before, a batch ended only at
// 65536 events: this dump (~560 KB) was one message over the router's 256 KiB, the stream
// broke, and every re-registration re-sent the same oversized dump.
TEST_F(EventPublisherTest, BatchesStayUnderTheRoutersLargestMessage) {
  StartServer(/*max_receive_bytes=*/256 << 10);
  EventPublisherOptions o = Options(7000);  // ~80 B per event
  o.max_batch_bytes = 64 << 10;
  EventPublisher pub(std::move(o));
  pub.Start();
  ASSERT_TRUE(AwaitFake([](FakeRouter& f) ABSL_NO_THREAD_SAFETY_ANALYSIS { return f.events >= 7000; }));
  // Then a burst queued at once: 300 events of 256 hashes (~4.2 KB each, ~1.3 MB).
  for (int i = 0; i < 300; ++i) {
    v1::KvEvent e;
    v1::BlockStored* s = e.mutable_stored();
    for (int k = 0; k < 256; ++k) s->add_block_hashes(std::string(16, static_cast<char>('A' + (i + k) % 26)));
    s->set_kind(v1::STATE_KIND_ATTN_KV);
    s->set_tier(v1::TIER_GPU);
    pub.Publish(std::move(e));
  }
  ASSERT_TRUE(AwaitFake([](FakeRouter& f) ABSL_NO_THREAD_SAFETY_ANALYSIS { return f.events >= 7300; }));
  absl::MutexLock l(&fake_.mu);
  EXPECT_EQ(fake_.registers, 1);
  EXPECT_EQ(fake_.streams, 1);
  EXPECT_EQ(fake_.full_dumps, 1);
  EXPECT_EQ(fake_.events, 7300);
  EXPECT_GE(fake_.batches, 2 + 1300 * 1000 / (64 << 10));
  EXPECT_LE(fake_.largest_batch, size_t{64} << 10);
}

// A router that stops reading while a dump far larger than the HTTP/2 window is being
// written: the publisher thread is stuck in Write, and destroying the publisher must
// still return (worker shutdown must not hang on the router).
TEST_F(EventPublisherTest, DestructorReturnsWhileWriteIsBlockedOnAStalledRouter) {
  fake_.stop_reading = true;
  StartServer();
  auto pub = std::make_unique<EventPublisher>(Options(200000));  // ~17 MB of dump
  pub->Start();
  ASSERT_TRUE(AwaitFake([](FakeRouter& f) ABSL_NO_THREAD_SAFETY_ANALYSIS { return f.streams >= 1; }));
  absl::Notification destroyed;
  std::thread t([&] {
    pub.reset();
    destroyed.Notify();
  });
  const bool returned = destroyed.WaitForNotificationWithTimeout(kWait);
  fake_.release.Notify();  // unblocks a publisher that did not return, so the test ends
  t.join();
  EXPECT_TRUE(returned) << "~EventPublisher waited on a router that stopped reading";
}

}  // namespace
}  // namespace kvpool::router
