// A real kvpool-router on loopback (port 0, cache_aware, model tiny-gqa) with simulated
// worker instances that register and keep heartbeating: the fixture of the kvctl tests
// that drive a router without workers (kvctl replay, kvctl load).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "kvpool/router/router_client.h"
#include "kvpool/router/router_server.h"

namespace kvpool::testing {

class SimRouterTest : public ::testing::Test {
 protected:
  // Starts the router and registers `instances` (publishing events, 4,096 blocks each).
  void StartRouter(std::vector<std::string> instances) {
    router::RouterServerOptions o;
    o.listen = "127.0.0.1:0";
    o.metrics_port = -1;
    o.host.core.models = {"tiny-gqa"};
    o.host.core.policy = router::PolicyKind::kCacheAware;
    auto s = router::RouterServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    addr_ = "127.0.0.1:" + std::to_string(server_->port());
    auto c = router::RouterClient::Connect(addr_);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    for (const std::string& id : instances) {
      v1::RegisterRequest r;
      r.set_source_id(id);
      r.set_kind(v1::SOURCE_KIND_WORKER);
      r.set_address(id + ".local:7000");
      r.mutable_model()->set_name("tiny-gqa");
      r.set_capacity_blocks(4096);
      r.set_publishes_events(true);
      ASSERT_TRUE(client_->Register(r).ok());
    }
    heartbeats_ = std::thread([this, instances] {
      while (!stop_.load()) {
        for (const std::string& id : instances) {
          v1::HeartbeatRequest h;
          h.set_source_id(id);
          (void)client_->Heartbeat(h);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  }
  void TearDown() override {
    stop_ = true;
    if (heartbeats_.joinable()) heartbeats_.join();
    if (server_) server_->Shutdown();
  }

  std::unique_ptr<router::RouterServer> server_;
  std::unique_ptr<router::RouterClient> client_;
  std::string addr_;
  std::thread heartbeats_;
  std::atomic<bool> stop_{false};
};

}  // namespace kvpool::testing
