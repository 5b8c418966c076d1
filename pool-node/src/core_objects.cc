// PoolCore::Impl bookkeeping: copies, leaves, visibility, eviction, expiry, demotion.

#include <cstring>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core_impl.h"
#include "kvpool/common/checksum.h"
#include "spdlog/spdlog.h"

namespace kvpool::pool_node {

PoolCore::Impl::Impl(PoolCore* core, const PoolOptions& o)
    : core_(core), opt_(o), clock_(o.clock ? o.clock : SystemClock()), page_bytes_(o.page_bytes), node_id_(o.node_id) {
  std::random_device rd;
  id_gen_.seed((uint64_t{rd()} << 32) ^ rd());
}

uint64_t PoolCore::Impl::NewId() {
  for (;;) {
    const uint64_t id = id_gen_();
    if (id != 0 && !reservations_.contains(id) && !leases_.contains(id)) return id;
  }
}

Object* PoolCore::Impl::Find(const ObjectKey& k) {
  auto it = objects_.find(k);
  return it == objects_.end() ? nullptr : it->second.get();
}

size_t PoolCore::Impl::CountChildrenIn(const Object& o, int t) {
  auto it = children_.find(o.key);
  if (it == children_.end()) return 0;
  size_t n = 0;
  for (const BlockHash& c : it->second) {
    const Object* child = Find(ObjectKey{c, o.key.kind});
    n += child != nullptr && child->copy[t];
  }
  return n;
}

void PoolCore::Impl::CountInParent(const Object& child, int t, int delta) {
  if (!child.parent) return;
  Object* p = Find(ObjectKey{*child.parent, child.key.kind});
  if (p == nullptr) return;
  p->kids_in[t] += static_cast<uint64_t>(static_cast<int64_t>(delta));
}

void PoolCore::Impl::RefreshLeaf(Object& o, int t) {
  const bool want = o.copy[t] && !HasChildIn(o, t);
  if (want == o.in_leaves[t]) return;
  if (want) leaves_[t].emplace(o.tick, o.key);
  else leaves_[t].erase({o.tick, o.key});
  o.in_leaves[t] = want;
}

void PoolCore::Impl::RefreshParent(const Object& o) {
  if (!o.parent) return;
  Object* p = Find(ObjectKey{*o.parent, o.key.kind});
  if (p == nullptr) return;
  for (int t = 0; t < kNumTiers; ++t) RefreshLeaf(*p, t);
}

void PoolCore::Impl::Touch(Object& o) {
  for (int t = 0; t < kNumTiers; ++t) {
    if (o.in_leaves[t]) leaves_[t].erase({o.tick, o.key});
  }
  o.tick = ++tick_;
  for (int t = 0; t < kNumTiers; ++t) {
    if (o.in_leaves[t]) leaves_[t].emplace(o.tick, o.key);
  }
}

Object* PoolCore::Impl::Insert(std::unique_ptr<Object> o) {
  Object* p = o.get();
  p->tick = ++tick_;
  if (p->parent) {
    // Invariant 6: a parent link that leads back to this hash (A->B->A, written by a
    // client or found in an old journal) would make every object of the cycle a child
    // of another, so none would ever be a leaf, evicted or demoted. Existing chains are
    // acyclic, so the walk ends at a chain start, a missing parent or this hash; the
    // bound only guards against cycles recovered from a journal written before this
    // check existed. A cycle through this hash needs a child of it (or a link to itself):
    // without one (a chain growing at its tail) there is no walk, which made a chain of
    // L blocks O(L^2).
    BlockHash at = *p->parent;
    const bool has_children = children_.contains(p->key) || *p->parent == p->key.hash;
    for (size_t steps = 0; has_children && steps <= objects_.size(); ++steps) {
      if (at == p->key.hash) {
        spdlog::warn("block {} ({}): parent {} leads back to it; storing it as a chain start",
                     p->key.hash.ToHex(), std::string(StateKindName(p->key.kind)),
                     p->parent->ToHex());
        p->parent.reset();
        break;
      }
      const Object* a = Find(ObjectKey{at, p->key.kind});
      if (a == nullptr || !a->parent) break;
      at = *a->parent;
    }
  }
  if (p->parent) children_[ObjectKey{*p->parent, p->key.kind}].insert(p->key.hash);
  // Children stored before this object (their parent link named it already) count now;
  // the new object itself has no copy yet, so its parent's counts stay as they are.
  for (int t = 0; t < kNumTiers; ++t) p->kids_in[t] = CountChildrenIn(*p, t);
  objects_.emplace(p->key, std::move(o));
  if (p->key.kind == StateKind::kLinearState) p->announced = KvPrefixPresent(p->key.hash);
  return p;
}

void PoolCore::Impl::AddCopy(Object& o, int t, std::vector<uint32_t> pages) {
  const bool first_copy = !o.copy[0] && !o.copy[1];
  if (!o.copy[t]) CountInParent(o, t, +1);
  o.copy[t] = true;
  used_by_kind_[t][KindIndex(o.key.kind)] += pages.size();
  o.pages[t] = std::move(pages);
  ++objects_in_[t];
  SyncHeld(o);
  RefreshLeaf(o, t);
  RefreshParent(o);
  if (Visible(o) && opt_.events != nullptr) opt_.events->OnStored(o.key, o.parent, static_cast<Tier>(t));
  if (first_copy && o.key.kind == StateKind::kAttnKv) AnnounceBelow(o.key.hash);
}

void PoolCore::Impl::DropCopy(Object& o, int t) {
  if (!o.copy[t]) return;
  if (Visible(o) && opt_.events != nullptr) opt_.events->OnRemoved(o.key, static_cast<Tier>(t));
  if (o.in_leaves[t]) leaves_[t].erase({o.tick, o.key});
  o.in_leaves[t] = false;
  o.copy[t] = false;
  CountInParent(o, t, -1);
  absl::Status journal;
  if (t == static_cast<int>(Tier::kNvme)) journal = nvme_->JournalRemove({&o.key, 1});
  if (journal.ok()) {
    alloc_[t]->Free(o.pages[t]);
  } else {  // a restart would find the object's ADD: its pages must keep its bytes
    spdlog::error("NVMe journal: {}; its {} pages stay unused until the journal is compacted",
                  std::string(journal.message()), o.pages[t].size());
    nvme_quarantine_.insert(nvme_quarantine_.end(), o.pages[t].begin(), o.pages[t].end());
  }
  used_by_kind_[t][KindIndex(o.key.kind)] -= o.pages[t].size();
  o.pages[t].clear();
  --objects_in_[t];
  SyncHeld(o);
  RefreshParent(o);
  if (o.copy[0] || o.copy[1]) return;
  // Last copy gone: erase the object.
  const ObjectKey key = o.key;
  const std::optional<BlockHash> parent = o.parent;
  if (parent) {
    auto it = children_.find(ObjectKey{*parent, key.kind});
    if (it != children_.end()) {
      it->second.erase(key.hash);
      if (it->second.empty()) children_.erase(it);
    }
  }
  objects_.erase(key);
  if (key.kind == StateKind::kAttnKv) UnannounceBelow(key.hash);
}

bool PoolCore::Impl::KvPrefixPresent(const BlockHash& h) {
  const Object* o = Find(ObjectKey{h, StateKind::kAttnKv});
  for (size_t steps = 0; o != nullptr && steps <= objects_.size(); ++steps) {
    if (!o->parent) return true;
    o = Find(ObjectKey{*o->parent, StateKind::kAttnKv});
  }
  return false;
}

void PoolCore::Impl::PinKvPrefix(const BlockHash& h, std::vector<ObjectKey>& pinned,
                                 absl::flat_hash_set<BlockHash>& seen) {
  constexpr int kD = static_cast<int>(Tier::kDram);
  Object* o = Find(ObjectKey{h, StateKind::kAttnKv});
  for (size_t steps = 0; o != nullptr && steps <= objects_.size() && seen.insert(o->key.hash).second; ++steps) {
    if (o->copy[kD]) {
      Pin(*o);
      pinned.push_back(o->key);
    }
    if (!o->parent) break;
    o = Find(ObjectKey{*o->parent, StateKind::kAttnKv});
  }
}

void PoolCore::Impl::Announce(Object& lin, bool on) {
  if (lin.announced == on) return;
  if (!on && opt_.events != nullptr) {
    for (int t = 0; t < kNumTiers; ++t) {
      if (lin.copy[t]) opt_.events->OnRemoved(lin.key, static_cast<Tier>(t));
    }
  }
  lin.announced = on;
  if (on && opt_.events != nullptr) {
    for (int t = 0; t < kNumTiers; ++t) {
      if (lin.copy[t]) opt_.events->OnStored(lin.key, lin.parent, static_cast<Tier>(t));
    }
  }
}

// A KV object appeared: checkpoints at it and below it whose chain is now complete
// become visible.
void PoolCore::Impl::AnnounceBelow(const BlockHash& h) {
  // Nothing at or below h to announce (a chain growing at its tail, the common case):
  // skip the walk to the chain start, which made a chain of L blocks cost O(L^2).
  if (Find(ObjectKey{h, StateKind::kLinearState}) == nullptr && !children_.contains(ObjectKey{h, StateKind::kAttnKv})) {
    return;
  }
  if (!KvPrefixPresent(h)) return;
  std::vector<BlockHash> stack = {h};
  while (!stack.empty()) {
    const BlockHash d = stack.back();
    stack.pop_back();
    if (Object* lin = Find(ObjectKey{d, StateKind::kLinearState})) Announce(*lin, true);
    auto it = children_.find(ObjectKey{d, StateKind::kAttnKv});
    if (it == children_.end()) continue;
    for (const BlockHash& c : it->second) {
      if (Find(ObjectKey{c, StateKind::kAttnKv}) != nullptr) stack.push_back(c);
    }
  }
}

// A KV object vanished: checkpoints at it and below it lose their prefix.
void PoolCore::Impl::UnannounceBelow(const BlockHash& h) {
  std::vector<BlockHash> stack = {h};
  bool first = true;
  while (!stack.empty()) {
    const BlockHash d = stack.back();
    stack.pop_back();
    if (!first && Find(ObjectKey{d, StateKind::kAttnKv}) == nullptr) continue;
    first = false;
    if (Object* lin = Find(ObjectKey{d, StateKind::kLinearState})) Announce(*lin, false);
    auto it = children_.find(ObjectKey{d, StateKind::kAttnKv});
    if (it == children_.end()) continue;
    for (const BlockHash& c : it->second) stack.push_back(c);
  }
}

bool PoolCore::Impl::Evictable(const Object& o, int t) const {
  if (t == static_cast<int>(Tier::kDram)) {
    return o.leases == 0 && o.pins == 0 && !o.demoting && o.promotion == nullptr;
  }
  return !o.nvme_busy;
}

void PoolCore::Impl::SyncHeld(Object& o) {
  constexpr int kD = static_cast<int>(Tier::kDram);
  const uint64_t want = o.copy[kD] && !Evictable(o, kD) ? o.pages[kD].size() : 0;
  uint64_t& held = held_by_kind_[KindIndex(o.key.kind)];
  held = held - o.held_pages + want;
  o.held_pages = want;
}

void PoolCore::Impl::Pin(Object& o) {
  ++o.pins;
  SyncHeld(o);
}

void PoolCore::Impl::Unpin(Object& o) {
  --o.pins;
  SyncHeld(o);
}

uint64_t PoolCore::Impl::EvictableDramPages(int kind) {
  constexpr int kD = static_cast<int>(Tier::kDram);
  uint64_t n = 0;
  for (int k = 0; k < kNumKinds; ++k) {
    if (kind < 0 || kind == k) n += used_by_kind_[kD][k] - held_by_kind_[k];
  }
  return n;
}

bool PoolCore::Impl::Evict(int t, uint64_t free_pages) {
  if (alloc_[t]->free_pages() >= free_pages) return true;
  // Evicting cannot help when even every unheld DRAM copy would not make room: fail
  // before planning (an upper bound, see EvictableDramPages).
  if (t == static_cast<int>(Tier::kDram) && alloc_[t]->free_pages() + EvictableDramPages(-1) < free_pages) {
    return false;
  }
  // While pages are held back the journal is failing: an evicted copy's pages would be
  // held back too (a restart brings it back, but this node would serve it no more).
  if (t == static_cast<int>(Tier::kNvme) && !nvme_quarantine_.empty()) return false;
  EvictionPlan plan;
  plan.tier = t;
  return PlanVictims(plan, std::nullopt, free_pages - alloc_[t]->free_pages()) && DropVictims(plan);
}

PoolCore::Impl::RoomPlan PoolCore::Impl::PlanDramRoom(EvictionPlan& plan, const uint64_t (&need_kind)[kNumKinds],
                                                       uint64_t need) {
  constexpr int kD = static_cast<int>(Tier::kDram);
  // Each limit is checked before any planning: a request that cannot fit must not plan
  // (or, for the caller, drop) anything on its way to failing.
  for (int k = 0; k < kNumKinds; ++k) {
    if (opt_.dram_quota_bytes[k] == 0 || need_kind[k] == 0) continue;
    const uint64_t quota = opt_.dram_quota_bytes[k] / page_bytes_;
    if (need_kind[k] + reserved_by_kind_[k] + promoting_by_kind_[k] + held_by_kind_[k] > quota) {
      return {RoomShort::kQuota, k};
    }
  }
  const uint64_t dram_free = alloc_[kD]->free_pages();
  if (need > dram_free && need > dram_free + EvictableDramPages(-1)) return {RoomShort::kTier, -1};
  for (int k = 0; k < kNumKinds; ++k) {
    if (opt_.dram_quota_bytes[k] == 0 || need_kind[k] == 0) continue;
    const uint64_t quota = opt_.dram_quota_bytes[k] / page_bytes_;
    const uint64_t limit = quota - need_kind[k] - reserved_by_kind_[k] - promoting_by_kind_[k];  // fits: above
    const uint64_t used = used_by_kind_[kD][k];
    if (used > limit && !PlanVictims(plan, static_cast<StateKind>(k), used - limit)) return {RoomShort::kQuotaHeld, k};
  }
  const uint64_t room = dram_free + plan.pages;
  if (need > room && !PlanVictims(plan, std::nullopt, need - room)) return {RoomShort::kTierHeld, -1};
  return {};
}

bool PoolCore::Impl::PlanVictims(EvictionPlan& plan, std::optional<StateKind> kind, uint64_t pages) {
  const int t = plan.tier;
  auto eligible = [&](const ObjectKey& k) { return (!kind || k.kind == *kind) && !plan.chosen.contains(k); };
  // Passes over a strand while the plan may spare more (EvictionPlan::spared).
  auto spared = [&](uint64_t tick, const ObjectKey& k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (plan.spared_keys.contains(k)) return true;  // spared by an earlier call on this plan
    if (plan.spared.size() >= EvictionPlan::kMaxSpared || !Strands(*Find(k), t)) return false;
    plan.spared.emplace_back(tick, k);
    plan.spared_keys.insert(k);
    return true;
  };
  // Leaves of the tier do not change while planning, and one passed over (held, of
  // another kind, chosen, spared) stays so: one forward walk. Exposed parents join in
  // tick order; spared ones leave `exposed` for `spared`.
  auto leaf = leaves_[t].begin();
  uint64_t got = 0;
  while (got < pages) {
    while (leaf != leaves_[t].end() &&
           !(eligible(leaf->second) && Evictable(*Find(leaf->second), t) && !spared(leaf->first, leaf->second))) {
      ++leaf;
    }
    auto parent = plan.exposed.begin();
    while (parent != plan.exposed.end() && !eligible(parent->second)) ++parent;
    if (parent != plan.exposed.end() && spared(parent->first, parent->second)) {
      plan.exposed.erase(parent);
      continue;  // look again: the leaf walk has not moved
    }
    const bool from_leaves =
        leaf != leaves_[t].end() && (parent == plan.exposed.end() || *leaf < *parent);
    ObjectKey key;
    if (from_leaves) {
      key = (leaf++)->second;
    } else if (parent != plan.exposed.end()) {
      key = parent->second;
      plan.exposed.erase(parent);
    } else {
      // Nothing else is left: the spared strands, least recently used first.
      auto last = std::min_element(plan.spared.begin(), plan.spared.end(), [&](const auto& a, const auto& b) {
        return std::pair(!eligible(a.second), a.first) < std::pair(!eligible(b.second), b.first);
      });
      if (last == plan.spared.end() || !eligible(last->second)) return false;
      key = last->second;
      plan.spared.erase(last);  // stays in spared_keys: chosen now, so never eligible again
    }
    const Object& o = *Find(key);
    plan.victims.push_back(key);
    plan.chosen.insert(key);
    got += o.pages[t].size();
    plan.pages += o.pages[t].size();
    if (!o.parent) continue;
    const ObjectKey pk{*o.parent, key.kind};
    const Object* p = Find(pk);
    if (p == nullptr || !p->copy[t]) continue;
    auto [left, fresh] = plan.children_left.try_emplace(pk, 0);
    if (fresh) left->second = ChildrenIn(*p, t);
    if (--left->second == 0 && Evictable(*p, t)) plan.exposed.emplace(p->tick, pk);
  }
  return true;
}

bool PoolCore::Impl::DropVictims(const EvictionPlan& plan) {
  for (const ObjectKey& k : plan.victims) {
    const size_t held_back = nvme_quarantine_.size();
    DropCopy(*Find(k), plan.tier);  // its children in the tier went before it
    ++evictions_[plan.tier];
    if (nvme_quarantine_.size() != held_back) return false;
  }
  return true;
}

void PoolCore::Impl::EndLease(uint64_t id) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return;
  for (const ObjectKey& k : it->second.keys) {
    if (Object* o = Find(k)) {  // leased objects keep their DRAM copy (inv. 3)
      --o->leases;
      SyncHeld(*o);
    }
  }
  UnpinnedByClient(it->second.client, it->second.pages);
  lease_expiry_.erase({it->second.expires_ms, id});
  leases_.erase(it);
}

void PoolCore::Impl::FreeReservedEntry(ReservationState& r, ReservedEntry& e, std::vector<uint32_t>* held) {
  if (e.pages.empty()) return;
  if (held != nullptr) {
    held->insert(held->end(), e.pages.begin(), e.pages.end());
  } else {
    alloc_[0]->Free(e.pages);
  }
  reserved_by_kind_[KindIndex(e.spec.kind)] -= e.pages.size();
  r.pages -= e.pages.size();
  UnpinnedByClient(r.client, e.pages.size());
  e.pages.clear();
}

void PoolCore::Impl::FreeReservation(ReservationState& r, std::vector<uint32_t>* held) {
  for (ReservedEntry& e : r.entries) FreeReservedEntry(r, e, held);
  for (const ObjectKey& k : r.held_parents) {
    if (Object* o = Find(k)) Unpin(*o);
  }
  r.held_parents.clear();
  for (ReservedEntry& e : r.entries) {
    if (!e.pinned_for_children) continue;
    if (Object* o = Find(ObjectKey{e.spec.hash, e.spec.kind})) Unpin(*o);
    e.pinned_for_children = false;
  }
}

void PoolCore::Impl::ChildStored(ReservationState& r, const ReservedEntry& child) {
  if (!child.spec.parent) return;
  auto it = r.by_hash.find(*child.spec.parent);
  if (it == r.by_hash.end()) return;
  ReservedEntry& parent = r.entries[it->second];
  if (parent.spec.kind != child.spec.kind || parent.children_pending == 0) return;
  if (--parent.children_pending == 0 && parent.pinned_for_children) {
    if (Object* o = Find(ObjectKey{parent.spec.hash, parent.spec.kind})) Unpin(*o);
    parent.pinned_for_children = false;
  }
}

absl::Status PoolCore::Impl::CheckClientRoom(const std::string& client, uint64_t pages,
                                             absl::string_view what) const {
  const uint64_t cap = opt_.max_client_pinned_bytes / page_bytes_;
  if (cap == 0) return absl::OkStatus();
  auto it = pinned_by_client_.find(client);
  const uint64_t held = it == pinned_by_client_.end() ? 0 : it->second;
  if (held + pages <= cap) return absl::OkStatus();
  const std::string head = absl::StrCat("client_id \"", client, "\" holds ", held,
                                        " DRAM pages under leases and reservations (held-back pages of its reservations included) and this ", what, " would pin ",
                                        pages, " more, above its cap of ", cap, " pages (--max-client-pinned=",
                                        opt_.max_client_pinned_bytes, " bytes); nothing was ",
                                        what == "Lookup" ? "leased" : "reserved", ": ");
  if (pages > cap) {
    return absl::ResourceExhaustedError(
        absl::StrCat(head, "it can never fit alone; send fewer blocks per ", what));
  }
  return absl::ResourceExhaustedError(absl::StrCat(head, "release leases or finish puts, then retry"));
}

void PoolCore::Impl::PinnedByClient(const std::string& client, uint64_t pages) {
  if (pages != 0) pinned_by_client_[client] += pages;
}

void PoolCore::Impl::UnpinnedByClient(const std::string& client, uint64_t pages) {
  if (pages == 0) return;
  auto it = pinned_by_client_.find(client);
  it->second -= pages;  // present: PinnedByClient counted at least this many
  if (it->second == 0) pinned_by_client_.erase(it);
}

void PoolCore::Impl::ExpireLocked(int64_t now) {
  while (!lease_expiry_.empty() && lease_expiry_.begin()->first <= now) {
    const uint64_t id = lease_expiry_.begin()->second;
    EndLease(id);
    ++expired_leases_;
  }
  while (!dram_quarantine_.empty() && dram_quarantine_.front().release_ms <= now) {
    HeldBack& h = dram_quarantine_.front();
    alloc_[0]->Free(h.pages);
    dram_quarantined_pages_ -= h.pages.size();
    UnpinnedByClient(h.client, h.pages.size());
    dram_quarantine_.pop_front();
  }
  while (!reservation_expiry_.empty() && reservation_expiry_.begin()->first <= now) {
    const uint64_t id = reservation_expiry_.begin()->second;
    reservation_expiry_.erase(reservation_expiry_.begin());
    auto it = reservations_.find(id);
    if (it == reservations_.end()) continue;  // not reached: ended ones leave the index
    // Not freed yet: a client that missed the deadline may still write into them.
    std::vector<uint32_t> held;
    FreeReservation(it->second, &held);
    HoldBack(std::move(held), now, it->second.client);
    ++reclaimed_;
    reservations_.erase(it);
  }
}

void PoolCore::Impl::HoldBack(std::vector<uint32_t> pages, int64_t now, const std::string& client) {
  if (pages.empty()) return;
  dram_quarantined_pages_ += pages.size();
  PinnedByClient(client, pages.size());
  dram_quarantine_.push_back(HeldBack{now + opt_.reserve_timeout_ms, std::move(pages), client});
}

std::string PoolCore::Impl::HeldBackNote() const {
  if (dram_quarantine_.empty()) return "";
  return absl::StrCat(", and ", dram_quarantined_pages_, " pages are held back from timed-out, failed or early-ended reservations (free again within ",
                      opt_.reserve_timeout_ms, " ms)");
}

std::vector<std::byte*> PoolCore::Impl::Addresses(const std::vector<uint32_t>& pages) const {
  std::vector<std::byte*> out;
  out.reserve(pages.size());
  for (uint32_t p : pages) out.push_back(core_->arena_ + uint64_t{p} * page_bytes_);
  return out;
}

uint64_t PoolCore::Impl::Checksum(const std::vector<uint32_t>& pages, uint64_t length) const {
  ChecksumStream sum;  // the client's checksum, computed the same way
  uint64_t left = length;
  for (uint32_t p : pages) {
    const uint64_t n = std::min(left, page_bytes_);
    sum.Update(std::span<const std::byte>(core_->arena_ + uint64_t{p} * page_bytes_, n));
    left -= n;
  }
  return sum.Digest();
}

void PoolCore::Impl::CompactJournal() {
  constexpr int kN = static_cast<int>(Tier::kNvme);
  std::vector<NvmeRecord> live;
  std::vector<uint32_t> quarantine;  // free once the rewritten journal no longer names them
  {
    // Journal records are appended under mu_ (AddCopy / DropCopy of the NVMe tier), so
    // this snapshot is the journal's live set; the rewrite begins before mu_ is
    // released, so every later record also lands in the rewritten journal.
    absl::MutexLock l(&mu_);
    if (!nvme_->BeginRewrite()) return;  // another thread is rewriting it
    live.reserve(objects_in_[kN]);
    for (const auto& [key, o] : objects_) {
      if (o->copy[kN]) live.push_back(NvmeRecord{o->key, o->parent, o->length, o->checksum, o->pages[kN]});
    }
    quarantine.swap(nvme_quarantine_);
  }
  absl::Status st = nvme_->FinishRewrite(live);
  {
    absl::MutexLock l(&mu_);
    if (st.ok()) {
      alloc_[kN]->Free(quarantine);
      next_compaction_ms_ = 0;
    } else {
      nvme_quarantine_.insert(nvme_quarantine_.end(), quarantine.begin(), quarantine.end());
      next_compaction_ms_ = clock_->NowMs() + kCompactionRetryMs;
    }
  }
  if (!st.ok()) {
    spdlog::error("NVMe journal compaction: {}", std::string(st.message()));
  } else {
    spdlog::info("NVMe journal compacted to {} live records ({} bytes)", live.size(), nvme_->journal_bytes());
  }
}

// One round of demotion: writes up to `max_objects` DRAM objects to NVMe (one io_uring
// batch): the coldest leaves, each with the parents that become leaves once it leaves;
// then drops their DRAM copies, children first. Stops choosing once DRAM uses at most
// `stop_at_used_pages`. Returns how many objects left DRAM.
size_t PoolCore::Impl::DemoteBatch(size_t max_objects, uint64_t stop_at_used_pages) {
  if (nvme_ == nullptr) return 0;
  constexpr int kD = static_cast<int>(Tier::kDram), kN = static_cast<int>(Tier::kNvme);
  struct Move {
    ObjectKey key;
    std::vector<uint32_t> nvme_pages;
    std::vector<uint32_t> dram_pages;
  };
  std::vector<Move> moves;
  size_t moved = 0;
  // What happens after the write, in candidate order (children before parents): a move
  // (index into moves) or a clean parent (-1) whose DRAM children leave first. Clean
  // parents count in demoting_pages_ until then.
  std::vector<std::pair<ObjectKey, int>> after;
  uint64_t clean_pages = 0;
  {
    absl::MutexLock l(&mu_);
    uint64_t planned = 0;
    std::vector<ObjectKey> candidates;  // children before their parents
    absl::flat_hash_set<ObjectKey> chosen;
    // Pages another round is writing out leave DRAM too (DemotePipelined).
    auto above_target = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      // Held-back pages of timed-out reservations come back on their own.
      return alloc_[kD]->used_pages() - dram_quarantined_pages_ > stop_at_used_pages + planned + demoting_pages_;
    };
    auto choose = [&](const Object& o) {
      planned += o.pages[kD].size();
      candidates.push_back(o.key);
      chosen.insert(o.key);
    };
    // A parent becomes a leaf once its DRAM children leave: it may go in the same round
    // if every child it has in DRAM was chosen (so a long chain is one round, not one
    // round per block).
    auto only_chosen_children = [&](const Object& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto it = children_.find(p.key);
      if (it == children_.end()) return true;
      for (const BlockHash& c : it->second) {
        const Object* child = Find(ObjectKey{c, p.key.kind});
        if (child != nullptr && child->copy[kD] && !chosen.contains(child->key)) return false;
      }
      return true;
    };
    for (const auto& [tick, key] : leaves_[kD]) {
      if (candidates.size() >= max_objects) break;
      const Object* o = Find(key);
      if (!Evictable(*o, kD)) continue;
      if (!above_target()) break;
      choose(*o);
      for (const Object* p = o; p->parent && candidates.size() < max_objects && above_target();) {
        p = Find(ObjectKey{*p->parent, key.kind});
        if (p == nullptr || !p->copy[kD] || !Evictable(*p, kD) || chosen.contains(p->key) ||
            !only_chosen_children(*p)) {
          break;
        }
        choose(*p);
      }
    }
    for (const ObjectKey& key : candidates) {
      Object* o = Find(key);
      if (o == nullptr || !Evictable(*o, kD) || !o->copy[kD]) continue;
      if (o->copy[kN]) {  // clean: the NVMe copy is already there
        if (HasChildIn(*o, kD)) {
          after.emplace_back(key, -1);
          clean_pages += o->pages[kD].size();
          continue;
        }
        DropCopy(*o, kD);
        ++demotions_;
        ++moved;
        continue;
      }
      const uint64_t n = o->pages[kD].size();
      if (alloc_[kN]->free_pages() < n && !Evict(kN, n)) break;
      auto pages = alloc_[kN]->Allocate(static_cast<uint32_t>(n));
      if (!pages) break;
      o->demoting = true;
      demoting_pages_ += n;
      Pin(*o);
      after.emplace_back(key, static_cast<int>(moves.size()));
      moves.push_back(Move{key, std::move(*pages), o->pages[kD]});
    }
    demoting_pages_ += clean_pages;
  }
  std::vector<uint32_t> nvme_pages;
  std::vector<std::byte*> memory;
  for (const Move& m : moves) {
    nvme_pages.insert(nvme_pages.end(), m.nvme_pages.begin(), m.nvme_pages.end());
    auto a = Addresses(m.dram_pages);
    memory.insert(memory.end(), a.begin(), a.end());
  }
  absl::Status io = moves.empty() ? absl::OkStatus() : nvme_->Transfer(/*write=*/true, nvme_pages, memory);
  if (!io.ok()) spdlog::error("NVMe demotion write failed: {}", std::string(io.message()));
  absl::MutexLock l(&mu_);
  demoting_pages_ -= clean_pages;
  std::vector<NvmeRecord> records;
  for (Move& m : moves) {
    Object* o = Find(m.key);  // pinned: still present with its DRAM copy
    o->demoting = false;
    demoting_pages_ -= m.dram_pages.size();
    Unpin(*o);
    if (io.ok()) records.push_back(NvmeRecord{o->key, o->parent, o->length, o->checksum, m.nvme_pages});
  }
  bool may_be_recorded = false;
  if (io.ok() && !records.empty()) {
    // Without its journal record a restart would not know the NVMe copy: keep the
    // DRAM copies and give the NVMe pages back, as after a failed write.
    io = nvme_->JournalAdd(records, &may_be_recorded);
    if (!io.ok()) spdlog::error("NVMe journal: {}", std::string(io.message()));
  }
  if (!io.ok()) {
    // ADD records the journal could not cut back off would, after a restart, name these
    // pages: they keep their bytes until a compaction rewrote the journal without them.
    for (Move& m : moves) {
      if (may_be_recorded) {
        nvme_quarantine_.insert(nvme_quarantine_.end(), m.nvme_pages.begin(), m.nvme_pages.end());
      } else {
        alloc_[kN]->Free(m.nvme_pages);
      }
    }
  }
  for (const auto& [key, move] : after) {
    Object* o = Find(key);  // a move's is pinned until above; a clean parent's may be gone
    if (o == nullptr) continue;
    if (move >= 0 && io.ok()) AddCopy(*o, kN, std::move(moves[move].nvme_pages));
    // Leaf-first: a copy goes only once no child has one in DRAM (a child leased
    // meanwhile stays, and so do its parents, clean now for a later round).
    if (o->copy[kD] && o->copy[kN] && Evictable(*o, kD) && !HasChildIn(*o, kD)) {
      DropCopy(*o, kD);
      ++demotions_;
      ++moved;
    }
  }
  return moved;
}

size_t PoolCore::Impl::DemotePipelined(size_t max_objects, uint64_t stop_at_used_pages) {
  if (nvme_ == nullptr || max_objects == 0) return 0;
  constexpr size_t kRound = 64;
  absl::Mutex m;
  size_t taken = 0;  // moved, plus what rounds in flight may move
  size_t moved = 0;
  // A round that moves nothing ends its thread only: the other round may hold the
  // objects this one would have found (and its parents become leaves once it is done).
  auto rounds = [&] {
    for (;;) {
      size_t want;
      {
        absl::MutexLock l(&m);
        if (taken >= max_objects || stopping_.load()) return;
        want = std::min(kRound, max_objects - taken);
        taken += want;
      }
      const size_t n = DemoteBatch(want, stop_at_used_pages);
      absl::MutexLock l(&m);
      taken -= want - std::min(n, want);
      moved += n;
      if (n == 0) return;
    }
  };
  // One round's worth is done by the calling thread alone.
  std::optional<std::thread> second;
  if (max_objects > kRound) second.emplace(rounds);
  rounds();
  if (second) second->join();
  return moved;
}

void PoolCore::Impl::BackgroundLoop() {
  for (;;) {
    {
      absl::MutexLock l(&bg_mu_);
      bg_mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(opt_.maintenance_interval_ms));
      if (stop_) return;
    }
    core_->RunMaintenance();
  }
}

}  // namespace kvpool::pool_node
