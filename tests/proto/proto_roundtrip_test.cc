// The wire contracts serialize and parse back unchanged, and block hashes keep their
// 16-byte form through them.
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include "kvpool/common/hash.h"
#include "kvpool/proto/grpc_status.h"
#include "kvpool/v1/pool.grpc.pb.h"
#include "kvpool/v1/router.grpc.pb.h"
#include "kvpool/v1/worker.grpc.pb.h"

namespace kvpool {
namespace {

using google::protobuf::util::MessageDifferencer;

template <typename M>
M RoundTrip(const M& m) {
  std::string wire;
  EXPECT_TRUE(m.SerializeToString(&wire));
  M back;
  EXPECT_TRUE(back.ParseFromString(wire));
  return back;
}

std::vector<BlockHash> SomeHashes() {
  auto h = *BlockHasher::Create({.model_id = "tiny-gqa", .block_tokens = 16});
  std::vector<TokenId> t(64);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<TokenId>(i);
  return h.HashPrefix(t);
}

TEST(ProtoRoundTripTest, EventBatchKeepsHashesAndSequences) {
  v1::EventBatch batch;
  batch.set_source_id("worker-0");
  auto hashes = SomeHashes();
  auto* ev = batch.add_events();
  ev->set_sequence(1);
  auto* stored = ev->mutable_stored();
  stored->set_kind(v1::STATE_KIND_ATTN_KV);
  stored->set_tier(v1::TIER_GPU);
  for (const auto& h : hashes) stored->add_block_hashes(h.ToBytes());
  auto* ev2 = batch.add_events();
  ev2->set_sequence(2);
  ev2->mutable_removed()->add_block_hashes(hashes.back().ToBytes());
  batch.add_events()->mutable_cleared();

  v1::EventBatch back = RoundTrip(batch);
  EXPECT_TRUE(MessageDifferencer::Equals(batch, back));
  ASSERT_EQ(back.events(0).stored().block_hashes_size(), 4);
  for (int i = 0; i < 4; ++i) {
    auto h = BlockHash::FromBytes(back.events(0).stored().block_hashes(i));
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(*h, hashes[static_cast<size_t>(i)]);
  }
  EXPECT_EQ(back.events(1).event_case(), v1::KvEvent::kRemoved);
  EXPECT_EQ(back.events(2).event_case(), v1::KvEvent::kCleared);
}

TEST(ProtoRoundTripTest, RouteAndPoolAndWorkerMessages) {
  v1::RouteRequest route;
  route.mutable_model()->set_name("llama-3.3-70b");
  route.mutable_model()->set_block_tokens(16);
  for (uint32_t t = 0; t < 100; ++t) route.add_tokens(t);
  route.set_tenant_salt("tenant");
  route.set_session_id("s1");
  EXPECT_TRUE(MessageDifferencer::Equals(route, RoundTrip(route)));

  v1::LookupResponse lookup;
  lookup.set_prefix_blocks(2);
  lookup.set_lease_id(99);
  auto* obj = lookup.add_objects();
  obj->set_block_hash(SomeHashes()[0].ToBytes());
  obj->set_kind(v1::STATE_KIND_LINEAR_STATE);
  obj->set_found_in(v1::TIER_NVME);
  obj->mutable_run()->add_pages(3);
  obj->mutable_run()->add_pages(17);
  obj->mutable_run()->set_length(100000);
  obj->set_checksum(0xdeadbeef);
  EXPECT_TRUE(MessageDifferencer::Equals(lookup, RoundTrip(lookup)));

  v1::GenerateResponse gen;
  gen.add_output_tokens(5);
  gen.set_hidden_digest(SomeHashes()[1].ToBytes());
  gen.mutable_ttft()->set_pool_fetch_s(0.25);
  gen.mutable_ttft()->set_total_s(1.0);
  EXPECT_TRUE(MessageDifferencer::Equals(gen, RoundTrip(gen)));

  v1::RouterStats stats;
  (*stats.mutable_decisions_by_policy())["cache_aware"] = 12;
  stats.add_instances()->mutable_load()->set_kv_usage(0.5);
  EXPECT_TRUE(MessageDifferencer::Equals(stats, RoundTrip(stats)));
}

TEST(ProtoRoundTripTest, UnknownFieldsSurviveForForwardCompatibility) {
  v1::Load load;
  load.set_running_requests(3);
  std::string wire = load.SerializeAsString();
  wire += std::string("\xa0\x06\x01", 3);  // field 100, varint 1: a future field
  v1::Load back;
  ASSERT_TRUE(back.ParseFromString(wire));
  EXPECT_EQ(back.running_requests(), 3u);
  EXPECT_EQ(back.SerializeAsString(), wire);
}

TEST(GrpcStatusTest, ConvertsBothWaysKeepingCodeAndMessage) {
  absl::Status s = absl::ResourceExhaustedError("no free blocks; free some or add capacity");
  grpc::Status g = ToGrpcStatus(s);
  EXPECT_EQ(g.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(g.error_message(), s.message());
  EXPECT_EQ(FromGrpcStatus(g), s);
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::DATA_LOSS, "x")).code(),
            absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace kvpool
