// The gRPC part of router_bench: a real RouterServer on 127.0.0.1:0, 16 registered
// instances with published prefixes, and Route calls from many client connections
// (callback API): an open loop at a fixed rate (latency measured from each call's
// scheduled start, so a stall counts against it) and a closed loop for peak throughput.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <iostream>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "bench.h"
#include "kvpool/common/hash.h"
#include "kvpool/router/router_client.h"
#include "kvpool/router/router_server.h"

namespace kvpool::router::bench {

using Clock = std::chrono::steady_clock;
using nlohmann::ordered_json;

namespace {

struct Call {
  grpc::ClientContext ctx;
  v1::RouteResponse resp;
  Clock::time_point scheduled;
  size_t index;
};

std::vector<std::unique_ptr<v1::Router::Stub>> MakeStubs(const std::string& addr, int n) {
  std::vector<std::unique_ptr<v1::Router::Stub>> stubs;
  for (int i = 0; i < n; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // one TCP connection per channel
    args.SetInt("kvpool.bench.channel", i);
    auto ch = grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args);
    ch->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(5));
    stubs.push_back(v1::Router::NewStub(ch));
  }
  return stubs;
}

}  // namespace

ordered_json RunGrpcBench(const GrpcBenchOptions& o) {
  ordered_json j;
  RouterServerOptions so;
  so.listen = "127.0.0.1:0";
  so.metrics_port = -1;
  so.host.core.models = {"tiny-gqa"};
  so.host.core.policy = PolicyKind::kCacheAware;
  so.host.core.decision_timeout = absl::Seconds(2);  // in-flight load stays bounded
  auto server = RouterServer::Start(so);
  if (!server.ok()) {
    j["error"] = std::string(server.status().message());
    return j;
  }
  const std::string addr = "127.0.0.1:" + std::to_string((*server)->port());
  auto client = RouterClient::Connect(addr);
  if (!client.ok()) {
    j["error"] = std::string(client.status().message());
    return j;
  }
  auto hasher = BlockHasher::Create(HashOptions{.model_id = "tiny-gqa", .block_tokens = 16});
  // 256 distinct prompts in 16 families sharing half their blocks; each family's prefix is
  // published by one instance.
  const int tokens_per_prompt = o.prompt_blocks * 16;
  std::vector<v1::RouteRequest> reqs(256);
  for (int r = 0; r < 256; ++r) {
    reqs[r].mutable_model()->set_name("tiny-gqa");
    for (int t = 0; t < tokens_per_prompt; ++t) {
      const bool shared = t < tokens_per_prompt / 2;
      reqs[r].add_tokens(static_cast<uint32_t>(shared ? (r % 16) * 1'000'000 + t : 50'000'000 + r * 100'000 + t));
    }
  }
  for (int i = 0; i < o.instances; ++i) {
    v1::RegisterRequest reg;
    reg.set_source_id("w" + std::to_string(i));
    reg.set_kind(v1::SOURCE_KIND_WORKER);
    reg.set_address("10.0.0." + std::to_string(i) + ":7000");
    reg.mutable_model()->set_name("tiny-gqa");
    reg.set_publishes_events(true);
    (void)(*client)->Register(reg);
    std::vector<TokenId> toks(reqs[i % 256].tokens().begin(), reqs[i % 256].tokens().end());
    const auto hashes = hasher->HashPrefix(toks);
    v1::EventBatch b;
    b.set_source_id(reg.source_id());
    v1::KvEvent* e = b.add_events();
    e->set_sequence(1);
    for (size_t k = 0; k < hashes.size() / 2; ++k) e->mutable_stored()->add_block_hashes(hashes[k].ToBytes());
    e->mutable_stored()->set_kind(v1::STATE_KIND_ATTN_KV);
    e->mutable_stored()->set_tier(v1::TIER_GPU);
    (void)(*client)->PublishEvents({b});
  }
  // Heartbeats keep the instances alive during the run.
  std::atomic<bool> stop{false};
  std::thread heart([&] {
    while (!stop.load()) {
      for (int i = 0; i < o.instances; ++i) {
        v1::HeartbeatRequest hb;
        hb.set_source_id("w" + std::to_string(i));
        (void)(*client)->Heartbeat(hb);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  auto stubs = MakeStubs(addr, o.channels);

  // ---- open loop -----------------------------------------------------------------------
  const size_t n = static_cast<size_t>(o.rate * o.seconds);
  std::vector<double> lat_us(n, -1);
  std::atomic<size_t> pending{0}, errors{0};
  const auto start = Clock::now() + std::chrono::milliseconds(50);
  for (size_t i = 0; i < n; ++i) {
    const auto target = start + std::chrono::nanoseconds(static_cast<int64_t>(static_cast<double>(i) * 1e9 / o.rate));
    std::this_thread::sleep_until(target);
    auto* call = new Call;
    call->scheduled = target;
    call->index = i;
    call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pending.fetch_add(1);
    stubs[i % stubs.size()]->async()->Route(&call->ctx, &reqs[i % reqs.size()], &call->resp,
                                            [call, &lat_us, &pending, &errors](grpc::Status s) {
                                              lat_us[call->index] =
                                                  std::chrono::duration<double, std::micro>(Clock::now() - call->scheduled).count();
                                              if (!s.ok()) errors.fetch_add(1);
                                              delete call;
                                              pending.fetch_sub(1);
                                            });
  }
  const auto issued_end = Clock::now();
  while (pending.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const double open_secs = std::chrono::duration<double>(Clock::now() - start).count();
  ordered_json open;
  open["target_rate_per_s"] = o.rate;
  open["requests"] = n;
  open["errors"] = errors.load();
  open["channels"] = o.channels;
  open["prompt_tokens"] = tokens_per_prompt;
  open["achieved_rate_per_s"] = static_cast<double>(n) / open_secs;
  open["issue_lag_ms"] = std::chrono::duration<double, std::milli>(issued_end - start).count() - o.seconds * 1e3;
  open["p50_us"] = Percentile(lat_us, 0.50);
  open["p99_us"] = Percentile(lat_us, 0.99);
  open["p999_us"] = Percentile(lat_us, 0.999);
  j["open_loop"] = open;

  // ---- closed loop ---------------------------------------------------------------------
  absl::Mutex mu;
  std::vector<double> closed_lat;
  std::atomic<size_t> done{0}, cerrors{0}, live{0};
  const auto cend = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.seconds * 1e3));
  std::function<void(size_t)> issue = [&](size_t k) {
    auto* call = new Call;
    call->scheduled = Clock::now();
    call->index = k;
    call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    stubs[k % stubs.size()]->async()->Route(&call->ctx, &reqs[(k * 7) % reqs.size()], &call->resp,
                                            [&, call](grpc::Status s) {
                                              const auto now = Clock::now();
                                              {
                                                absl::MutexLock l(&mu);
                                                closed_lat.push_back(
                                                    std::chrono::duration<double, std::micro>(now - call->scheduled).count());
                                              }
                                              if (!s.ok()) cerrors.fetch_add(1);
                                              const size_t next = call->index + static_cast<size_t>(o.outstanding);
                                              delete call;
                                              done.fetch_add(1);
                                              if (now < cend) {
                                                issue(next);
                                              } else {
                                                live.fetch_sub(1);
                                              }
                                            });
  };
  const auto c0 = Clock::now();
  live.store(static_cast<size_t>(o.outstanding));
  for (int k = 0; k < o.outstanding; ++k) issue(static_cast<size_t>(k));
  while (live.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const double csecs = std::chrono::duration<double>(Clock::now() - c0).count();
  ordered_json closed;
  closed["outstanding"] = o.outstanding;
  closed["requests"] = done.load();
  closed["errors"] = cerrors.load();
  closed["throughput_per_s"] = static_cast<double>(done.load()) / csecs;
  {
    absl::MutexLock l(&mu);
    closed["p50_us"] = Percentile(closed_lat, 0.50);
    closed["p99_us"] = Percentile(closed_lat, 0.99);
  }
  j["closed_loop"] = closed;
  stop = true;
  heart.join();
  auto st = (*client)->GetStats();
  if (st.ok()) j["decisions"] = st->decisions_by_policy().count("cache_aware") ? st->decisions_by_policy().at("cache_aware") : 0;
  (*server)->Shutdown();
  return j;
}

}  // namespace kvpool::router::bench
