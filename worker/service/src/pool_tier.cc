#include "pool_tier.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "kvpool/common/clock.h"
#include "kvpool/common/status.h"
#include "kvpool/common/units.h"
#include "kvpool/transport/transport.h"
#include "kvpool/v1/pool.pb.h"
#include "spdlog/spdlog.h"

namespace kvpool::worker {
namespace {
// The node (or the way to it) failed, as opposed to refusing this request.
bool IsNodeFailure(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsInternal(s) || absl::IsUnknown(s) ||
         absl::IsAborted(s);
}
}  // namespace

absl::StatusOr<std::unique_ptr<PoolTier>> PoolTier::Create(PoolTierOptions options,
                                                           std::span<std::byte> arena_memory,
                                                           uint64_t page_bytes) {
  if (options.node_addresses.empty()) {
    return absl::InvalidArgumentError("--pool-nodes is empty; give host:port[,host:port...]");
  }
  for (size_t i = 0; i < options.node_addresses.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (options.node_addresses[i] == options.node_addresses[j]) {
        return absl::InvalidArgumentError(absl::StrCat("--pool-nodes lists ", options.node_addresses[i],
                                                       " twice; list each pool node once"));
      }
    }
  }
  std::unique_ptr<PoolTier> t(new PoolTier());
  t->opts_ = std::move(options);
  t->ring_ = RendezvousRing(t->opts_.node_addresses);
  ASSIGN_OR_RETURN(t->ucx_, transport::Context::Create());
  transport::WorkerOptions wo;
  wo.batch_timeout = t->opts_.transfer_timeout;
  ASSIGN_OR_RETURN(t->worker_, transport::Worker::Create(t->ucx_, wo));
  ASSIGN_OR_RETURN(t->arena_, t->worker_->RegisterArena(arena_memory, page_bytes));
  for (const std::string& a : t->opts_.node_addresses) {
    Node n;
    n.address = a;
    t->nodes_.push_back(std::move(n));
  }
  for (size_t i = 0; i < t->nodes_.size(); ++i) {
    t->Client(i);  // connect what answers now
    if (!t->nodes_[i].alias_of.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--pool-nodes: ", t->nodes_[i].address, " and ", t->nodes_[i].alias_of,
          " reach the same pool node; list each node once, spelled the same on every worker "
          "(placement hashes the addresses as given)"));
    }
  }
  return t;
}

PoolTier::~PoolTier() {
  for (Node& n : nodes_) {  // before the worker and the arena
    n.client.reset();
    n.retired.reset();
  }
  reaping_.clear();
}

pool_node::PoolClient* PoolTier::Client(size_t node) {
  Node& n = nodes_[node];
  if (n.client) {
    // A broken endpoint never carries a byte again (the node process or its UCX worker is
    // gone; gRPC may reach a process restarted at the address). Without this, every
    // Lookup took leases and every Put a reservation (evicting for it) that the transfer
    // then failed.
    const absl::Status health = n.client->transport_health();
    if (health.ok()) return n.client.get();
    MarkDown(node, health);
    return nullptr;
  }
  if (MonotonicNow() < n.down_until) return nullptr;
  pool_node::PoolClientOptions o;
  o.node_address = n.address;
  o.client_id = opts_.client_id;
  o.worker = worker_.get();
  o.local_arena = arena_;
  o.rpc_timeout_ms = opts_.rpc_timeout_ms;
  absl::StatusOr<std::unique_ptr<pool_node::PoolClient>> c = pool_node::PoolClient::Connect(o);
  if (!c.ok()) {
    MarkDown(node, c.status());
    return nullptr;
  }
  // Two spellings of one node (localhost / 127.0.0.1) would give it two places in the
  // placement ring, and workers spelling it differently would disagree on owners.
  for (const Node& other : nodes_) {
    if (other.client && other.client->node_worker_address() == (*c)->node_worker_address()) {
      if (n.alias_of.empty()) {  // once: MarkDown's warning may have gone to an earlier error
        spdlog::error("pool node {} is the same node process as {}: list it once in --pool-nodes, spelled "
                      "the same on every worker; the blocks placed on {} are recomputed until then",
                      n.address, other.address, n.address);
      }
      n.alias_of = other.address;
      MarkDown(node, absl::FailedPreconditionError(absl::StrCat("the same pool node as ", other.address,
                                                                "; list it once in --pool-nodes")));
      return nullptr;
    }
  }
  spdlog::info("pool node {} connected: {} ({} pages of {})", n.address, (*c)->node_id(), (*c)->node_pages(),
               FormatBytes((*c)->node_page_bytes()));
  n.client = *std::move(c);
  n.last_error.clear();
  // next_retry stays: a Connect proves gRPC, not the transport (a node whose UCX address
  // workers cannot reach connects every time); a transfer that works resets it.
  return n.client.get();
}

void PoolTier::MarkDown(size_t node, const absl::Status& why) {
  Node& n = nodes_[node];
  ++rpc_failures_;
  // A node that fails after a transfer to it worked, or long after its last failure,
  // waits retry_after; one that fails again before one works (refusing Connect, or
  // connecting and failing) waits twice as long each time, up to max_retry_after.
  const absl::Time now = MonotonicNow();
  if (n.next_retry <= absl::ZeroDuration() ||
      now - n.last_failure > 2 * std::max(opts_.retry_after, opts_.max_retry_after)) {
    n.next_retry = opts_.retry_after;
  }
  n.last_failure = now;
  const absl::Duration wait = std::min(n.next_retry, std::max(opts_.retry_after, opts_.max_retry_after));
  n.next_retry = std::min(wait * 2, std::max(opts_.retry_after, opts_.max_retry_after));
  if (n.client || n.last_error.empty()) {
    spdlog::warn("pool node {} unavailable ({}); its blocks are recomputed, retry in {} (longer while it stays down, "
                 "up to {})",
                 n.address, std::string(why.message()), absl::FormatDuration(wait),
                 absl::FormatDuration(std::max(opts_.retry_after, opts_.max_retry_after)));
  }
  if (n.client) {
    if (n.retired && n.retired->PendingReleases() > 0) reaping_.push_back(std::move(n.retired));
    // Kept for its gRPC channel only: an open endpoint would keep a same-host node's
    // arena (a shared-memory segment the size of its DRAM tier) mapped here after that
    // node died, next to its restarted process's.
    n.client->CloseTransport();
    n.retired = std::move(n.client);
  }
  std::erase_if(reaping_, [](const std::unique_ptr<pool_node::PoolClient>& c) { return c->PendingReleases() == 0; });
  n.last_error = std::string(why.message());
  n.down_until = now + wait;
}

pool_node::PoolClient* PoolTier::ReleaseClient(size_t node) {
  Node& n = nodes_[node];
  return n.client ? n.client.get() : n.retired.get();
}

void PoolTier::ForgetNode(PoolLookup& out, size_t node) {
  std::vector<size_t> new_index(out.leases.size(), SIZE_MAX);
  size_t kept = 0;
  for (size_t i = 0; i < out.leases.size(); ++i) {
    if (out.lease_nodes[i] == node) {
      if (pool_node::PoolClient* c = ReleaseClient(node)) c->ReleaseAsync(out.leases[i].lease_id);
      continue;
    }
    new_index[i] = kept;
    if (kept != i) {
      out.leases[kept] = std::move(out.leases[i]);
      out.lease_nodes[kept] = out.lease_nodes[i];
    }
    ++kept;
  }
  out.leases.resize(kept);
  out.lease_nodes.resize(kept);
  for (std::optional<PoolFound>& f : out.found) {
    if (!f) continue;
    if (f->node == node) {
      f.reset();
    } else if (f->lease < new_index.size()) {
      f->lease = new_index[f->lease];
    }
  }
}

bool PoolTier::Quarantined(size_t node, const pool_node::ObjectKey& key) {
  if (quarantined_.empty()) return false;
  const auto it = quarantined_.find(std::make_pair(node, key));
  if (it == quarantined_.end()) return false;
  if (MonotonicNow() < it->second) return true;
  quarantined_.erase(it);
  return false;
}

size_t PoolTier::live_nodes() const {
  size_t live = 0;
  for (const Node& n : nodes_) live += n.client != nullptr;
  return live;
}

PoolLookup PoolTier::Lookup(std::span<const BlockHash> hashes, StateKind kind, uint64_t length) {
  PoolLookup out;
  out.found.resize(hashes.size());
  std::vector<std::vector<size_t>> by_node(nodes_.size());
  for (size_t i = 0; i < hashes.size(); ++i) by_node[ring_.Owner(hashes[i])].push_back(i);
  for (size_t node = 0; node < nodes_.size(); ++node) {
    // A node answers at most kMaxLookupHashes per call: longer prompts take several
    // (gaps are allowed, so each part stands alone).
    const std::vector<size_t>& all = by_node[node];
    for (size_t begin = 0; begin < all.size(); begin += pool_node::PoolClient::kMaxLookupHashes) {
      pool_node::PoolClient* c = Client(node);
      if (c == nullptr) {  // down, or marked down since the last call (its endpoint broke)
        ForgetNode(out, node);
        break;
      }
      const size_t end = std::min(all.size(), begin + pool_node::PoolClient::kMaxLookupHashes);
      std::vector<BlockHash> mine;
      mine.reserve(end - begin);
      for (size_t k = begin; k < end; ++k) mine.push_back(hashes[all[k]]);
      // The node leaves objects of another length out (unleased, not made more recent, so
      // they age out); the check below is for a node that predates object_length.
      absl::StatusOr<pool_node::PoolLease> lease = c->Lookup(mine, kind, 0, /*allow_gaps=*/true, length);
      if (!lease.ok()) {
        if (IsNodeFailure(lease.status())) {
          MarkDown(node, lease.status());
          ForgetNode(out, node);  // what its earlier calls found
          break;
        }
        ++rpc_failures_;
        spdlog::warn("pool node {}: Lookup refused: {}", nodes_[node].address, std::string(lease.status().message()));
        continue;
      }
      // Objects come back in chain order; match them to our indices by hash.
      const size_t lease_index = lease->lease_id != 0 ? out.leases.size() : SIZE_MAX;
      size_t j = 0, misfits = lease->other_length;
      for (const pool_node::RemoteObject& obj : lease->objects) {
        while (j < mine.size() && !(mine[j] == obj.key.hash)) ++j;
        if (j == mine.size()) break;
        if (obj.length == length) {
          if (!Quarantined(node, obj.key)) out.found[all[begin + j]] = PoolFound{node, obj, lease_index};
        } else {
          ++misfits;
        }
        ++j;
      }
      if (misfits > 0 && !nodes_[node].warned_length) {
        nodes_[node].warned_length = true;  // once per node: it would come with every Lookup
        spdlog::warn("pool node {}: {} of the {} hashes looked up are held with another length than the {} bytes of "
                     "this model's {}: misses (is a worker with another model of the same name writing to this "
                     "pool?)",
                     nodes_[node].address, misfits, mine.size(), length,
                     kind == StateKind::kAttnKv ? "blocks" : "states");
      }
      if (lease->lease_id != 0) {
        out.leases.push_back(*std::move(lease));
        out.lease_nodes.push_back(node);
      }
    }
  }
  return out;
}

absl::Status PoolTier::Get(const PoolLookup& lookup, std::span<const size_t> which,
                           std::span<const std::vector<uint64_t>> dst) {
  for (size_t node = 0; node < nodes_.size(); ++node) {
    pool_node::PoolLease part;
    std::vector<std::vector<uint64_t>> part_dst;
    for (size_t k = 0; k < which.size(); ++k) {
      const std::optional<PoolFound>& f = lookup.found[which[k]];
      if (!f || f->node != node) continue;
      part.objects.push_back(f->object);
      part_dst.push_back(dst[k]);
      // The part is usable while every lease its objects came under is.
      if (f->lease < lookup.leases.size()) {
        const pool_node::PoolLease& l = lookup.leases[f->lease];
        if (part.lease_id == 0 || l.expires_unix_ms < part.expires_unix_ms) {
          part.lease_id = l.lease_id;  // the lease that ends first speaks for the part
          part.expires_unix_ms = l.expires_unix_ms;
        }
        if (l.usable_until && (!part.usable_until || *l.usable_until < *part.usable_until)) {
          part.usable_until = l.usable_until;
        }
      }
    }
    if (part.objects.empty()) continue;
    part.prefix_blocks = static_cast<uint32_t>(part.objects.size());
    pool_node::PoolClient* c = nodes_[node].client.get();
    if (c == nullptr) return absl::UnavailableError(absl::StrCat("pool node ", nodes_[node].address, " went away"));
    std::vector<size_t> mismatched;
    absl::Status s = c->Get(part, part_dst, &mismatched);
    if (!s.ok()) {
      if (IsNodeFailure(s)) MarkDown(node, s);
      // Only while the lease held: after it, the node may have reused the pages (the
      // objects themselves may be intact, e.g. demoted to NVMe).
      const bool lease_held = !part.usable_until || std::chrono::steady_clock::now() < *part.usable_until;
      if (!mismatched.empty() && lease_held) {
        mismatched_objects_ += mismatched.size();
        const absl::Time until = MonotonicNow() + opts_.mismatch_quarantine;
        if (quarantined_.size() + mismatched.size() > kMaxQuarantined) {
          absl::erase_if(quarantined_, [now = MonotonicNow()](const auto& e) { return e.second <= now; });
        }
        for (size_t i : mismatched) {
          if (quarantined_.size() < kMaxQuarantined) quarantined_[{node, part.objects[i].key}] = until;
        }
        spdlog::warn("pool node {}: {} objects arrived with other bytes than their checksums (first {}); they "
                     "are misses for {}",
                     nodes_[node].address, mismatched.size(), part.objects[mismatched.front()].key.hash.ToHex(),
                     absl::FormatDuration(opts_.mismatch_quarantine));
      }
      return s;
    }
    nodes_[node].next_retry = absl::ZeroDuration();  // its transport works
  }
  return absl::OkStatus();
}

void PoolTier::Release(PoolLookup& lookup) {
  for (size_t i = 0; i < lookup.leases.size(); ++i) {
    // Off the engine thread; leases also expire. A node marked down since is sent it by
    // its retired client: a transport failure leaves gRPC working (a node restarted at
    // the same address has a new transport worker), and an unreleased lease pins its
    // objects and counts against this worker's pinned bytes there until it expires.
    if (pool_node::PoolClient* c = ReleaseClient(lookup.lease_nodes[i])) c->ReleaseAsync(lookup.leases[i].lease_id);
  }
  lookup.leases.clear();
  lookup.lease_nodes.clear();
}

uint64_t PoolTier::Put(std::span<const PoolPut> items) {
  // One Reserve/Commit per (node, kind): within a reservation objects are named by hash
  // alone, and a KDA checkpoint shares its hash with the block ending at its boundary.
  std::vector<std::vector<pool_node::PutItem>> groups(nodes_.size() * 2);
  for (const PoolPut& p : items) {
    const size_t owner = ring_.Owner(p.hash);
    // A parent placed on another node is not named: on each node a chain is a run of
    // locally linked segments, so the node's leaf-first eviction and its rule that a
    // KDA checkpoint is visible only while its KV prefix is present both work on what
    // the node holds (the worker checks the whole prefix before using a checkpoint).
    std::optional<BlockHash> parent = p.parent;
    if (parent && ring_.Owner(*parent) != owner) parent.reset();
    const size_t g = owner * 2 + (p.kind == StateKind::kLinearState ? 1 : 0);
    groups[g].push_back(pool_node::PutItem{p.hash, parent, p.kind, p.local_pages, p.length});
  }
  uint64_t written = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].empty()) continue;
    const size_t node = g / 2;
    pool_node::PoolClient* c = Client(node);
    if (c == nullptr) continue;
    uint64_t moved = 0;
    absl::StatusOr<std::vector<absl::Status>> r = c->Put(groups[g], &moved);
    if (!r.ok()) {
      if (IsNodeFailure(r.status())) {
        MarkDown(node, r.status());
      } else {
        ++rpc_failures_;
        spdlog::warn("pool node {}: Put of {} objects refused: {}", nodes_[node].address, groups[g].size(),
                     std::string(r.status().message()));
      }
      continue;
    }
    for (size_t i = 0; i < r->size(); ++i) {
      if ((*r)[i].ok()) written += groups[g][i].length;
    }
    if (moved > 0) nodes_[node].next_retry = absl::ZeroDuration();  // its transport works
  }
  return written;
}

std::string PoolTier::Describe() {
  std::string out;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    pool_node::PoolClient* c = Client(i);
    if (c == nullptr) {
      absl::StrAppend(&out, "    ", nodes_[i].address, "  unreachable now (", nodes_[i].last_error,
                      "); retried on use\n");
      continue;
    }
    absl::StrAppend(&out, "    ", nodes_[i].address, "  ", c->node_id(), "  DRAM ",
                    FormatBytes(c->node_pages() * c->node_page_bytes()));
    absl::StatusOr<v1::PoolStats> st = c->GetStats();
    if (st.ok()) {
      for (const v1::TierStats& t : st->tiers()) {
        if (t.tier() == v1::TIER_NVME) absl::StrAppend(&out, ", NVMe ", FormatBytes(t.capacity_bytes()));
      }
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

}  // namespace kvpool::worker
