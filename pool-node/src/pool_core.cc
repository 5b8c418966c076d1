#include "kvpool/pool_node/pool_core.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core_impl.h"
#include "kvpool/common/clock.h"
#include "kvpool/common/status.h"
#include "kvpool/common/units.h"
#include "spdlog/spdlog.h"

namespace kvpool::pool_node {
namespace {

constexpr int kD = static_cast<int>(Tier::kDram);
constexpr int kN = static_cast<int>(Tier::kNvme);
constexpr size_t kMaxBatch = 4096;
// NVMe reads of one copy that may fail in a row before the copy is dropped, counted at
// most once per kFailedReadSpacingMs: a burst of errors (or a bad page next to the copy's,
// read in the same request) drops nothing at once.
constexpr uint8_t kMaxFailedReads = 3;
constexpr int64_t kFailedReadSpacingMs = 1000;
constexpr int64_t kMaxReserveTimeoutMs = 86'400'000;  // a day: expiry sums stay far from overflow

class SystemClockImpl : public Clock {
 public:
  int64_t NowMs() const override { return absl::ToUnixMillis(MonotonicNow()); }
};

// ReserveSlot::status for an entry whose (hash, kind) the node holds at another length.
absl::Status OtherLengthError(const ReserveEntrySpec& e, uint64_t stored_length) {
  return absl::AlreadyExistsError(absl::StrCat(
      "block ", e.hash.ToHex(), " (", StateKindName(e.kind), ") is stored here with length ", stored_length,
      ", not ", e.length, " (another model or layout under the same name?); objects are immutable, so it was not "
      "replaced and nothing was reserved for it: Lookups with object_length=", e.length, " miss it until it is evicted"));
}

}  // namespace

Clock* SystemClock() {
  static SystemClockImpl clock;
  return &clock;
}

PoolCore::PoolCore(PoolOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<PoolCore>> PoolCore::Create(PoolOptions options) {
  const uint64_t pb = options.page_bytes;
  if (pb < 4096 || pb > (64ull << 20) || (pb & (pb - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--page-bytes=", pb, " must be a power of two between 4096 and 64 MiB (O_DIRECT and "
        "UCX registration work in whole 4 KiB pages); e.g. --page-bytes=65536"));
  }
  if (options.dram_bytes / pb == 0 || options.dram_bytes / pb > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--dram=", options.dram_bytes, " holds ",
                                                   options.dram_bytes / pb, " pages of ", pb,
                                                   " bytes; give 1..2^32-1 pages"));
  }
  if (!options.nvme_dir.empty() && options.nvme_bytes < pb) {
    return absl::InvalidArgumentError(absl::StrCat("--nvme=", options.nvme_bytes,
                                                   " is smaller than one page (--page-bytes=", pb,
                                                   "); give --nvme a size or drop --nvme-dir"));
  }
  if (options.nvme_dir.empty() && options.nvme_bytes > 0) {
    return absl::InvalidArgumentError("--nvme given without --nvme-dir; set --nvme-dir=DIR");
  }
  if (!(options.demote_low_watermark > 0 && options.demote_low_watermark < options.demote_high_watermark &&
        options.demote_high_watermark <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "demotion watermarks low=", options.demote_low_watermark, " high=",
        options.demote_high_watermark, " must satisfy 0 < low < high <= 1"));
  }
  if (options.reserve_timeout_ms <= 0 || options.reserve_timeout_ms > kMaxReserveTimeoutMs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--reserve-timeout-ms=", options.reserve_timeout_ms, " must be in 1..", kMaxReserveTimeoutMs,
        " (a reservation must outlive its writes; its pages stay pinned that long); e.g. "
        "--reserve-timeout-ms=30000"));
  }
  for (int k = 0; k < kNumKinds; ++k) {
    const uint64_t q = options.dram_quota_bytes[k];
    if (q != 0 && q < pb) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--quota-", k == 0 ? "attn-kv" : "linear-state", "=", q, " is smaller than one page (--page-bytes=", pb,
          "): no object of that kind could be stored; give at least ", pb, " or 0 for no quota"));
    }
  }
  if (options.max_client_pinned_bytes != 0 && options.max_client_pinned_bytes < pb) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-client-pinned=", options.max_client_pinned_bytes, " is smaller than one page (--page-bytes=", pb,
        "): no client could lease or reserve anything; give at least ", pb, " or 0 for no cap"));
  }
  if (options.default_lease_ms == 0 || options.default_lease_ms > options.max_lease_ms) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--lease-ms=", options.default_lease_ms, " must be in 1..", options.max_lease_ms,
        " (the longest lease a Lookup may ask for); e.g. --lease-ms=30000"));
  }
  if (options.io_queue_depth < 32) {
    return absl::InvalidArgumentError(absl::StrCat("io_queue_depth=", options.io_queue_depth,
                                                   " is below 32; NVMe needs deep queues"));
  }
  std::unique_ptr<PoolCore> core(new PoolCore(std::move(options)));
  const PoolOptions& o = core->options_;
  core->page_bytes_ = pb;
  core->dram_pages_ = static_cast<uint32_t>(o.dram_bytes / pb);
  if (o.arena_memory != nullptr) {
    if (reinterpret_cast<uintptr_t>(o.arena_memory) % 4096 != 0) {
      return absl::InvalidArgumentError("arena_memory must be 4096-aligned");
    }
    core->arena_ = o.arena_memory;
  } else {
    void* mem = mmap(nullptr, core->arena_bytes(), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot map --dram=", core->arena_bytes(),
                                                       " bytes: ", std::strerror(errno)));
    }
    madvise(mem, core->arena_bytes(), MADV_HUGEPAGE);
    core->arena_ = static_cast<std::byte*>(mem);
    core->owns_arena_ = true;
  }
  core->impl_ = std::make_unique<Impl>(core.get(), core->options_);
  Impl& im = *core->impl_;
  std::vector<NvmeRecord> recovered;
  if (!o.nvme_dir.empty()) {
    ASSIGN_OR_RETURN(im.nvme_, NvmeStore::Open(o.nvme_dir, o.nvme_bytes, pb, o.io_queue_depth,
                                               {core->arena_, core->arena_bytes()}, &recovered));
    if (o.journal_write_fault) im.nvme_->SetWriteFault(o.journal_write_fault);
  }
  {
    absl::MutexLock l(&im.mu_);
    im.alloc_[kD] = std::make_unique<PageAllocator>(core->dram_pages_);
    im.alloc_[kN] = std::make_unique<PageAllocator>(im.nvme_ ? im.nvme_->num_pages() : 0);
    size_t bad = 0;
    for (NvmeRecord& r : recovered) {
      if (r.length == 0 || r.length > kMaxObjectBytes || r.pages.size() != im.PagesFor(r.length) ||
          im.Find(r.key) != nullptr ||
          !im.alloc_[kN]->MarkUsed(r.pages)) {
        ++bad;
        continue;
      }
      auto obj = std::make_unique<Object>();
      obj->key = r.key;
      obj->parent = r.parent;
      obj->length = r.length;
      obj->checksum = r.checksum;
      Object* p = im.Insert(std::move(obj));
      im.AddCopy(*p, kN, std::move(r.pages));
    }
    if (!recovered.empty()) {
      spdlog::info("NVMe tier: recovered {} objects from the journal in {} ({} inconsistent records dropped)",
                   recovered.size() - bad, o.nvme_dir, bad);
    }
  }
  if (o.background) im.bg_ = std::thread([p = &im] { p->BackgroundLoop(); });
  return core;
}

PoolCore::~PoolCore() {
  if (impl_) {
    StopBackground();
    impl_.reset();
  }
  if (owns_arena_) munmap(arena_, arena_bytes());
}

void PoolCore::StopBackground() {
  {
    absl::MutexLock l(&impl_->bg_mu_);
    impl_->stop_ = true;
  }
  RequestStop();
  if (impl_->bg_.joinable()) impl_->bg_.join();
  impl_->stopping_ = false;  // the core stays usable (e.g. for the router's last dump)
}

void PoolCore::RequestStop() { impl_->stopping_ = true; }

uint32_t PoolCore::nvme_pages() const { return impl_->nvme_ ? impl_->nvme_->num_pages() : 0; }
std::string PoolCore::nvme_data_path() const { return impl_->nvme_ ? impl_->nvme_->data_path() : ""; }

void PoolCore::CopyToRun(const PageRunDesc& run, std::span<const std::byte> bytes) const {
  uint64_t off = 0;
  for (uint32_t p : run.pages) {
    const uint64_t n = std::min<uint64_t>(page_bytes_, bytes.size() - off);
    std::memcpy(arena_ + uint64_t{p} * page_bytes_, bytes.data() + off, n);
    off += n;
  }
}

void PoolCore::CopyFromRun(const PageRunDesc& run, std::span<std::byte> bytes) const {
  uint64_t off = 0;
  for (uint32_t p : run.pages) {
    const uint64_t n = std::min<uint64_t>(page_bytes_, bytes.size() - off);
    std::memcpy(bytes.data() + off, arena_ + uint64_t{p} * page_bytes_, n);
    off += n;
  }
}

uint64_t PoolCore::RunChecksum(const PageRunDesc& run) const {
  return impl_->Checksum(run.pages, run.length);
}

absl::StatusOr<Reservation> PoolCore::Reserve(std::span<const ReserveEntrySpec> entries, absl::string_view client) {
  if (entries.empty() || entries.size() > kMaxBatch) {
    return absl::InvalidArgumentError(absl::StrCat("entries: ", entries.size(),
                                                   " given; send 1..4096 per Reserve"));
  }
  absl::flat_hash_set<BlockHash> seen;
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    if (e.length == 0 || e.length > kMaxObjectBytes) {
      return absl::InvalidArgumentError(absl::StrCat("entries[", i, "].length=", e.length,
                                                     " must be 1..2^32 bytes"));
    }
    // One that no eviction could ever fit: said so, naming the entry (not "retry later").
    const uint64_t pages = (e.length + page_bytes_ - 1) / page_bytes_;
    const uint64_t quota = options_.dram_quota_bytes[KindIndex(e.kind)] / page_bytes_;
    if (pages > dram_pages_ || (quota != 0 && pages > quota)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "entries[", i, "].length=", e.length, " needs ", pages, " pages of ", page_bytes_, " bytes, but this node's ",
          pages > dram_pages_ ? absl::StrCat("DRAM tier has ", dram_pages_)
                              : absl::StrCat("DRAM quota for ", StateKindName(e.kind), " is ", quota),
          " pages: it can never fit here, and nothing was evicted; store it on a node with more room, or in "
          "smaller objects"));
    }
    if (e.parent && *e.parent == e.hash) {
      // A self-parent would make the object its own child: never a leaf, so never
      // evicted or demoted.
      return absl::InvalidArgumentError(absl::StrCat(
          "entries[", i, "].parent_hash equals block_hash ", e.hash.ToHex(),
          "; a chain start has no parent: leave parent_hash empty"));
    }
    if (!seen.insert(e.hash).second) {
      return absl::InvalidArgumentError(absl::StrCat("entries[", i, "].block_hash ",
                                                     e.hash.ToHex(),
                                                     " appears twice; reserve each block once (one Reserve per "
                                                     "state kind: a Commit names its entries by hash alone)"));
    }
  }
  Impl& im = *impl_;
  absl::MutexLock l(&im.mu_);
  const int64_t now = im.clock_->NowMs();
  im.ExpireLocked(now);
  ReservationState rs;
  rs.client = std::string(client);
  rs.expires_ms = now + options_.reserve_timeout_ms;
  uint64_t need = 0;
  uint64_t need_kind[kNumKinds] = {0, 0};
  // Entries answered already_present are pinned until the pages of the others are
  // allocated: evicting one of them to make room would tell the client a block is
  // stored that this very call dropped (or, for a checkpoint, hid by evicting a link of
  // its KV prefix: those are pinned too). So are the parents of new entries (and a new
  // checkpoint's KV block), for the reservation's life: evicting one would store a child
  // no prefix Lookup reaches (a checkpoint nobody sees). A pinned parent keeps its own
  // ancestors (not leaves).
  std::vector<ObjectKey> pinned;
  absl::flat_hash_set<BlockHash> kv_seen;
  // The objects the new entries hang from stay pinned until the reservation ends
  // (ReservationState::held_parents), not just through this call: evicted before the
  // Commit, they would leave it the same orphan.
  std::vector<ObjectKey> parents;
  auto pin_parent = [&](const ObjectKey& k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(im.mu_) {
    if (Object* p = im.Find(k); p != nullptr && p->copy[kD]) {
      im.Pin(*p);
      parents.push_back(k);
    }
  };
  auto unpin = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(im.mu_) {
    for (const ObjectKey& k : pinned) {
      if (Object* o = im.Find(k)) im.Unpin(*o);  // pinned: never evicted, but be safe
    }
  };
  auto unpin_parents = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(im.mu_) {
    for (const ObjectKey& k : parents) {
      if (Object* o = im.Find(k)) im.Unpin(*o);
    }
  };
  std::vector<ObjectKey> touched;  // present entries: most recently used once granted
  for (const auto& e : entries) {
    ReservedEntry re;
    re.spec = e;
    if (Object* o = im.Find(ObjectKey{e.hash, e.kind}); o != nullptr && o->length != e.length) {
      // Immutable: it stays as it is, untouched (it ages out; Lookups of this length
      // miss it too), and the caller is told its bytes were not taken.
      re.refused = OtherLengthError(e, o->length);
    } else if (o != nullptr) {
      re.already_present = true;
      touched.push_back(o->key);  // touched once the Reserve is granted (a refused one changes nothing)
      im.Pin(*o);
      pinned.push_back(o->key);
      if (e.kind == StateKind::kLinearState) im.PinKvPrefix(e.hash, pinned, kv_seen);
    } else {
      need += im.PagesFor(e.length);
      need_kind[KindIndex(e.kind)] += im.PagesFor(e.length);
      if (e.parent) pin_parent(ObjectKey{*e.parent, e.kind});
      // A checkpoint is seen while its KV prefix is present: its own KV block stays (and,
      // being a child, keeps the blocks before it off the leaf lists).
      if (e.kind == StateKind::kLinearState) pin_parent(ObjectKey{e.hash, StateKind::kAttnKv});
    }
    rs.entries.push_back(std::move(re));
  }
  if (absl::Status room = im.CheckClientRoom(rs.client, need, "Reserve"); !room.ok()) {
    unpin();
    unpin_parents();
    return room;
  }
  // Decide whether eviction can make room before evicting anything: a Reserve that
  // cannot fit must not empty the cache on its way to RESOURCE_EXHAUSTED. The held
  // pages (leased, pinned, in flight) stay whatever is evicted; reserved pages too.
  // Every victim is chosen before any is dropped: first what each kind's quota needs,
  // then what the tier still needs beyond the room those make. DRAM-only parents of
  // NVMe chains go last (EvictionPlan::spared).
  EvictionPlan plan;
  plan.tier = kD;
  const uint64_t dram_free = im.alloc_[kD]->free_pages();
  const Impl::RoomPlan room = im.PlanDramRoom(plan, need_kind, need);
  if (room.shortfall != Impl::RoomShort::kNone) {
    unpin();
    unpin_parents();
    const auto quota_text = [&] {
      return absl::StrCat("the DRAM quota for ", StateKindName(static_cast<StateKind>(room.kind)), " (",
                          options_.dram_quota_bytes[room.kind], " bytes) cannot fit ",
                          need_kind[room.kind] * page_bytes_, " more bytes");
    };
    const auto tier_text = [&] {
      return absl::StrCat("Reserve needs ", need, " pages (", need * page_bytes_, " bytes) but the DRAM tier has ",
                          dram_free, " of ", dram_pages_, " pages free and ");
    };
    switch (room.shortfall) {
      case Impl::RoomShort::kQuota:
        return absl::ResourceExhaustedError(absl::StrCat(
            quota_text(), " after evicting every unleased object of that kind (leased ones, and those being "
            "reserved or promoted from NVMe, hold the rest); retry later or raise the quota"));
      case Impl::RoomShort::kQuotaHeld:
        return absl::ResourceExhaustedError(absl::StrCat(
            quota_text(), ": leased objects (or the chains above them) hold the rest; nothing was evicted; "
            "retry later or raise the quota"));
      case Impl::RoomShort::kTier:
        return absl::ResourceExhaustedError(absl::StrCat(
            tier_text(), "at most ", im.EvictableDramPages(-1), " more unleased", im.HeldBackNote(),
            "; nothing was evicted; retry later, release leases or add --dram"));
      default:
        return absl::ResourceExhaustedError(absl::StrCat(
            tier_text(), "eviction could free only ", plan.pages,
            " more: leased objects (or the chains above them) hold the rest", im.HeldBackNote(),
            "; nothing was evicted; retry later, release leases or add --dram"));
    }
  }
  im.DropVictims(plan);  // DRAM copies: their pages are freed (no journal)
  for (const ObjectKey& k : touched) {
    if (Object* o = im.Find(k)) im.Touch(*o);  // pinned above: still present
  }
  Reservation out;
  out.id = im.NewId();
  out.expires_unix_ms = rs.expires_ms;
  out.ttl_ms = options_.reserve_timeout_ms;
  for (ReservedEntry& re : rs.entries) {
    ReserveSlot slot;
    slot.hash = re.spec.hash;
    slot.already_present = re.already_present;
    slot.status = re.refused;
    if (!re.already_present && re.refused.ok()) {
      auto pages = im.alloc_[kD]->Allocate(static_cast<uint32_t>(im.PagesFor(re.spec.length)));
      re.pages = std::move(*pages);  // fits: checked above
      im.reserved_by_kind_[KindIndex(re.spec.kind)] += re.pages.size();
      rs.pages += re.pages.size();
      slot.run = PageRunDesc{re.pages, re.spec.length};
    }
    out.slots.push_back(std::move(slot));
  }
  unpin();
  rs.held_parents = std::move(parents);
  rs.by_hash.reserve(rs.entries.size());
  for (uint32_t j = 0; j < rs.entries.size(); ++j) rs.by_hash.emplace(rs.entries[j].spec.hash, j);
  // A chain put in pieces: an entry stored by an early Commit stays pinned while its
  // child in this reservation is still to come (see Commit).
  for (const ReservedEntry& e : rs.entries) {
    if (!e.spec.parent || e.pages.empty()) continue;
    if (auto p = rs.by_hash.find(*e.spec.parent); p != rs.by_hash.end() && rs.entries[p->second].spec.kind == e.spec.kind) {
      ++rs.entries[p->second].children_pending;
    }
  }
  im.ExpiryOn(out.id, rs);
  im.PinnedByClient(rs.client, rs.pages);
  im.reservations_.emplace(out.id, std::move(rs));
  return out;
}

absl::StatusOr<std::vector<CommitOutcome>> PoolCore::Commit(uint64_t reservation_id,
                                                            std::span<const CommitEntrySpec> entries,
                                                            bool partial, uint32_t commits, bool end_now,
                                                            absl::string_view client) {
  if (entries.size() > kMaxBatch) {
    return absl::InvalidArgumentError(absl::StrCat("entries: ", entries.size(), " given; at most 4096"));
  }
  if (end_now && partial) {
    return absl::InvalidArgumentError(
        "end_now=true with partial=true: end_now ends the reservation, so the Commit must be final (partial=false)");
  }
  if (commits > 1 && (partial || end_now)) {  // 0 and 1 both mean just this one
    return absl::InvalidArgumentError(absl::StrCat(
        "commits=", commits, " with ", partial ? "partial" : "end_now",
        "=true: only a final Commit counts the Commits sent; leave commits 0 on this one"));
  }
  Impl& im = *impl_;
  // Phase 1: claim the named entries; while any Commit of it verifies, expiry leaves the
  // reservation alone, and a final Commit's end waits for the others.
  struct Claim {
    int slot = -1;  // index in the reservation's entries; -1: not reserved or named twice
    bool verify = false;
    std::vector<uint32_t> pages;  // a copy: the pages stay in the reservation meanwhile
    uint64_t length = 0;
  };
  std::vector<Claim> claims(entries.size());
  {
    absl::MutexLock l(&im.mu_);
    im.ExpireLocked(im.clock_->NowMs());
    auto it = im.reservations_.find(reservation_id);
    if (it == im.reservations_.end() || (it->second.last != 0 && it->second.claimed >= it->second.last) ||
        (!partial && !end_now && it->second.last != 0)) {
      return absl::NotFoundError(absl::StrCat(
          "reservation_id=", reservation_id, " is unknown: it was committed already (a Commit without "
          "partial ends it) or reclaimed after ", options_.reserve_timeout_ms, " ms; Reserve again"));
    }
    ReservationState& rs = it->second;
    if (rs.client != client) {
      return absl::PermissionDeniedError(absl::StrCat(
          "reservation_id=", reservation_id, " was not made by client_id \"", client.substr(0, 128),
          "\"; Commit only the reservation_id your own Reserve returned (nothing was committed)"));
    }
    if (partial && entries.empty()) {
      return absl::InvalidArgumentError(
          "entries is empty on a partial Commit, which would publish nothing; name the entries "
          "written, or send the final Commit (partial=false)");
    }
    // Each Commit but a final empty one names an entry of its own: more than that many
    // would keep the reservation (and its pages) waiting for Commits that never come.
    if (!partial && !end_now && commits > rs.entries.size() + 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "commits=", commits, " is more Commits than reservation ", reservation_id, " of ",
          rs.entries.size(), " entries can have (at most ", rs.entries.size() + 1,
          "); count the Commits sent for it, this one included"));
    }
    // end_now: no Commit that has not come yet is waited for (this one is the last).
    if (end_now) {
      rs.last = rs.claimed + 1;
      rs.ended_early = true;
    } else if (!partial) {
      rs.last = std::max<uint32_t>(commits, rs.claimed + 1);
    }
    ++rs.claimed;
    for (size_t i = 0; i < entries.size(); ++i) {
      auto found = rs.by_hash.find(entries[i].hash);
      if (found == rs.by_hash.end()) continue;
      ReservedEntry& re = rs.entries[found->second];
      if (re.claimed) continue;  // named twice
      re.claimed = true;
      claims[i].slot = static_cast<int>(found->second);
      claims[i].verify = !re.already_present && re.refused.ok();
      claims[i].pages = re.pages;
      claims[i].length = re.spec.length;
    }
    if (rs.committing++ == 0) im.ExpiryOff(reservation_id, rs);
  }
  // Phase 2: checksums of the written bytes, without the lock (pages owned by the
  // reservation, which cannot end or expire while this Commit counts in `committing`).
  std::vector<CommitOutcome> out(entries.size());
  std::vector<uint64_t> actual(entries.size(), 0);
  for (size_t i = 0; i < entries.size(); ++i) {
    out[i].hash = entries[i].hash;
    if (claims[i].verify) actual[i] = im.Checksum(claims[i].pages, claims[i].length);
  }
  // Phase 3: publish.
  absl::MutexLock l(&im.mu_);
  auto it = im.reservations_.find(reservation_id);
  ReservationState& rs = it->second;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (claims[i].slot < 0) {
      out[i].status = absl::InvalidArgumentError(absl::StrCat(
          "entries[", i, "].block_hash ", entries[i].hash.ToHex(),
          " was not reserved in reservation ", reservation_id, " (or is named twice)"));
      continue;
    }
    ReservedEntry& re = rs.entries[claims[i].slot];
    if (!re.refused.ok()) {
      out[i].status = re.refused;
      continue;
    }
    if (re.already_present) continue;
    const ObjectKey key{re.spec.hash, re.spec.kind};
    if (actual[i] != entries[i].checksum) {
      out[i].status = absl::DataLossError(absl::StrFormat(
          "entries[%d] block %s: checksum %016x does not match the %d bytes written (%016x); "
          "Reserve and write it again",
          i, re.spec.hash.ToHex(), entries[i].checksum, re.spec.length, actual[i]));
      ++im.checksum_failures_;
      // Wrong bytes may be a write still under way: its pages are held back like a
      // timed-out reservation's, not handed to the next object at once.
      std::vector<uint32_t> held;
      im.FreeReservedEntry(rs, re, &held);
      im.HoldBack(std::move(held), im.clock_->NowMs(), rs.client);
      continue;
    }
    if (Object* existing = im.Find(key)) {  // committed meanwhile by another client
      if (existing->length != re.spec.length) {
        out[i].status = OtherLengthError(re.spec, existing->length);
      } else {
        im.Touch(*existing);
        if (re.children_pending > 0 && existing->copy[kD]) {  // as below
          im.Pin(*existing);
          re.pinned_for_children = true;
        }
      }
      im.FreeReservedEntry(rs, re);
      im.ChildStored(rs, re);
      continue;
    }
    auto obj = std::make_unique<Object>();
    obj->key = key;
    obj->parent = re.spec.parent;
    obj->length = re.spec.length;
    obj->checksum = actual[i];
    Object* p = im.Insert(std::move(obj));
    im.reserved_by_kind_[KindIndex(key.kind)] -= re.pages.size();
    rs.pages -= re.pages.size();
    im.UnpinnedByClient(rs.client, re.pages.size());
    im.AddCopy(*p, kD, std::move(re.pages));
    re.pages.clear();
    // A Put commits a chain piece by piece: the next piece's first entry hangs from this
    // one, which stays pinned until it is stored (evicted meanwhile, the child would be
    // stored where no prefix Lookup reaches it).
    if (re.children_pending > 0) {
      im.Pin(*p);
      re.pinned_for_children = true;
    }
    im.ChildStored(rs, re);
  }
  // The reservation ends with its last Commit, as counted by the final one.
  if (--rs.committing == 0) im.ExpiryOn(reservation_id, rs);
  ++rs.done;
  if (rs.last != 0 && rs.done >= rs.last && rs.committing == 0) {
    // A client ends a reservation early when a Put failed, maybe in a transfer it gave
    // up on (one-sided: it may still land): the pages no Commit named are held back one
    // reserve timeout, as a timed-out reservation's are.
    std::vector<uint32_t> held;
    im.FreeReservation(rs, rs.ended_early ? &held : nullptr);
    im.HoldBack(std::move(held), im.clock_->NowMs(), rs.client);
    im.ExpiryOff(reservation_id, rs);
    im.reservations_.erase(it);
  }
  return out;
}

absl::StatusOr<LookupAnswer> PoolCore::Lookup(const LookupSpec& spec) {
  if (spec.hashes.empty() || spec.hashes.size() > kMaxBatch) {
    return absl::InvalidArgumentError(absl::StrCat("block_hashes: ", spec.hashes.size(),
                                                   " given; send 1..4096 per Lookup"));
  }
  if (spec.lease_ms > options_.max_lease_ms) {
    return absl::InvalidArgumentError(absl::StrCat("lease_ms=", spec.lease_ms, " exceeds ",
                                                   options_.max_lease_ms, "; ask for less"));
  }
  Impl& im = *impl_;
  struct Promo {
    ObjectKey key;
    std::vector<uint32_t> nvme_pages;
    std::vector<uint32_t> dram_pages;
    std::shared_ptr<absl::Notification> done;
    uint64_t length = 0, checksum = 0;  // the object's (immutable once committed)
  };
  std::vector<ObjectKey> pinned;
  std::vector<Promo> promos;
  std::vector<std::shared_ptr<absl::Notification>> waits;
  auto visible = [&](const Object* o) {
    return o != nullptr && im.Visible(*o) && (spec.object_length == 0 || o->length == spec.object_length);
  };
  uint32_t other_length = 0;
  {
    absl::MutexLock l(&im.mu_);
    im.ExpireLocked(im.clock_->NowMs());
    // The visible blocks of the answer, in chain order (up to the first miss, or all
    // hits with allow_gaps).
    std::vector<ObjectKey> chain;
    for (const BlockHash& h : spec.hashes) {
      const ObjectKey key{h, spec.kind};
      const Object* o = im.Find(key);
      if (!visible(o)) {
        other_length += o != nullptr && im.Visible(*o);
        if (spec.allow_gaps) continue;
        break;
      }
      chain.push_back(key);
    }
    if (options_.max_client_pinned_bytes != 0) {  // the lease's pages, as if every hit lands
      uint64_t pages = 0;
      for (const ObjectKey& key : chain) pages += im.PagesFor(im.Find(key)->length);
      RETURN_IF_ERROR(im.CheckClientRoom(spec.client, pages, "Lookup"));
    }
    if (spec.never_block) {  // changing nothing
      for (const ObjectKey& key : chain) {
        const Object* o = im.Find(key);
        if (!o->copy[kD] && (o->promotion != nullptr || !o->nvme_busy)) {
          return absl::UnavailableError(absl::StrCat(
              "block ", key.hash.ToHex(), " must be read from NVMe first; Lookup again without never_block"));
        }
      }
    }
    // Pin every DRAM hit first: making room for an NVMe hit must not evict a hit later
    // in the same chain (the answer would lose a block that was there all along), nor,
    // for checkpoints, a link of the KV prefix that makes one visible.
    absl::flat_hash_set<BlockHash> kv_seen;
    for (const ObjectKey& key : chain) {
      Object* o = im.Find(key);
      if (o->copy[kD]) {
        im.Pin(*o);
        pinned.push_back(key);
      }
      if (key.kind == StateKind::kLinearState) im.PinKvPrefix(key.hash, pinned, kv_seen);
    }
    for (const ObjectKey& key : chain) {
      Object* o = im.Find(key);  // pinned, or NVMe-only (DRAM eviction leaves it)
      if (o == nullptr) {
        if (spec.allow_gaps) continue;
        break;
      }
      if (o->copy[kD]) {
        // pinned above
      } else if (o->promotion != nullptr) {
        waits.push_back(o->promotion);
      } else if (!o->nvme_busy) {
        const uint64_t n = o->pages[kN].size();
        std::optional<std::vector<uint32_t>> pages;
        // Room as a Reserve makes it: within the kind's DRAM quota, evicting leaves.
        uint64_t need_kind[kNumKinds] = {};
        need_kind[KindIndex(key.kind)] = n;
        EvictionPlan plan;
        plan.tier = kD;
        if (im.PlanDramRoom(plan, need_kind, n).shortfall == Impl::RoomShort::kNone && im.DropVictims(plan)) {
          pages = im.alloc_[kD]->Allocate(static_cast<uint32_t>(n));
        }
        o = im.Find(key);  // eviction never takes NVMe-only objects' only copy, but re-find
        if (!pages || o == nullptr) {
          if (pages) im.alloc_[kD]->Free(*pages);
          if (spec.allow_gaps) continue;
          break;
        }
        o->nvme_busy = true;
        im.promoting_by_kind_[KindIndex(key.kind)] += n;
        o->promotion = std::make_shared<absl::Notification>();
        im.SyncHeld(*o);
        promos.push_back(Promo{key, o->pages[kN], std::move(*pages), o->promotion, o->length, o->checksum});
      }
    }
  }
  // Promotions: read NVMe -> DRAM and verify, without the lock.
  std::vector<absl::Status> results(promos.size());
  std::vector<char> io_failed(promos.size(), 0);  // a read error, not a checksum mismatch
  if (!promos.empty()) {
    // Reads go out in groups of about kVerifyGroupBytes, all queued at once; each group
    // is verified while the later ones are still being read.
    constexpr uint64_t kVerifyGroupBytes = 8 << 20;
    struct Group {
      size_t first, end;  // promos[first, end)
      std::unique_ptr<NvmeStore::PendingTransfer> io;
    };
    std::vector<Group> groups;
    for (size_t i = 0; i < promos.size();) {
      Group g{i, i, nullptr};
      std::vector<uint32_t> nvme_pages;
      std::vector<std::byte*> memory;
      uint64_t bytes = 0;
      while (g.end < promos.size() && (g.end == g.first || bytes < kVerifyGroupBytes)) {
        const Promo& p = promos[g.end++];
        nvme_pages.insert(nvme_pages.end(), p.nvme_pages.begin(), p.nvme_pages.end());
        auto a = im.Addresses(p.dram_pages);
        memory.insert(memory.end(), a.begin(), a.end());
        bytes += p.length;
      }
      g.io = im.nvme_->StartTransfer(/*write=*/false, nvme_pages, memory);
      groups.push_back(std::move(g));
      i = groups.back().end;
    }
    for (Group& g : groups) {
      // Per page: a read error fails only the objects it touches (their NVMe copies stay:
      // the disk may answer next time); the others are checked as usual.
      std::vector<absl::Status> page_status;
      (void)im.nvme_->FinishTransfer(*g.io, &page_status);
      size_t first_page = 0;
      for (size_t i = g.first; i < g.end; ++i) {
        for (size_t j = 0; j < promos[i].nvme_pages.size() && io_failed[i] == 0; ++j) {
          if (!page_status[first_page + j].ok()) {
            results[i] = page_status[first_page + j];
            io_failed[i] = 1;
          }
        }
        first_page += promos[i].nvme_pages.size();
        if (io_failed[i]) continue;
        const uint64_t got = im.Checksum(promos[i].dram_pages, promos[i].length);
        if (got != promos[i].checksum) {
          results[i] = absl::DataLossError(absl::StrFormat(
              "NVMe copy of %s failed its checksum (%016x, expected %016x)",
              promos[i].key.hash.ToHex(), got, promos[i].checksum));
        }
      }
    }
    absl::MutexLock l(&im.mu_);
    const int64_t now_ms = im.clock_->NowMs();
    for (size_t i = 0; i < promos.size(); ++i) {
      Promo& p = promos[i];
      Object* o = im.Find(p.key);  // nvme_busy kept its NVMe copy, so it still exists
      if (io_failed[i] && (o->failed_reads == 0 || now_ms - o->last_failed_read_ms >= kFailedReadSpacingMs)) {
        ++o->failed_reads;
        o->last_failed_read_ms = now_ms;
      }
      o->nvme_busy = false;
      o->promotion.reset();
      im.promoting_by_kind_[KindIndex(p.key.kind)] -= p.dram_pages.size();
      if (results[i].ok()) {
        o->failed_reads = 0;
        im.AddCopy(*o, kD, std::move(p.dram_pages));
        ++im.promotions_;
        im.Pin(*o);
        pinned.push_back(p.key);
      } else if (io_failed[i] && o->failed_reads < kMaxFailedReads) {
        // A miss this time; the NVMe copy stays (the disk may answer next time).
        im.alloc_[kD]->Free(p.dram_pages);
        spdlog::error("reading {} from NVMe: {}", p.key.hash.ToHex(), std::string(results[i].message()));
      } else if (io_failed[i]) {
        // A copy that keeps failing goes: kept, it stayed "present" (a Reserve of it
        // answered already_present and touched it, so it was never evicted either) and
        // unreadable, ending every prefix through it, for good.
        im.alloc_[kD]->Free(p.dram_pages);
        spdlog::error("dropping {}: its NVMe read failed {} times in a row, at least {} ms apart, the last: {}",
                      p.key.hash.ToHex(), kMaxFailedReads, kFailedReadSpacingMs, std::string(results[i].message()));
        im.DropCopy(*o, kN);
      } else {
        im.alloc_[kD]->Free(p.dram_pages);
        ++im.checksum_failures_;
        spdlog::error("dropping {}: {}", p.key.hash.ToHex(), std::string(results[i].message()));
        im.DropCopy(*o, kN);
      }
      p.done->Notify();
    }
  }
  for (auto& w : waits) w->WaitForNotification();
  if (options_.lookup_between_locks) options_.lookup_between_locks();
  // Final answer: the prefix (or hits) now in DRAM, under one lease.
  LookupAnswer ans;
  ans.other_length = other_length;
  absl::MutexLock l(&im.mu_);
  const int64_t now = im.clock_->NowMs();
  if (options_.max_client_pinned_bytes != 0) {
    // Again, on what is leased below: the lock was let go since the first check, and
    // other calls of the same client may have pinned pages meanwhile.
    uint64_t pages = 0;
    for (const BlockHash& h : spec.hashes) {
      const Object* o = im.Find(ObjectKey{h, spec.kind});
      if (!visible(o) || !o->copy[kD]) {
        if (spec.allow_gaps) continue;
        break;
      }
      pages += o->pages[kD].size();
    }
    if (absl::Status room = im.CheckClientRoom(spec.client, pages, "Lookup"); !room.ok()) {
      for (const ObjectKey& k : pinned) {
        if (Object* o = im.Find(k)) im.Unpin(*o);
      }
      return room;
    }
  }
  LeaseState lease;
  lease.expires_ms = now + (spec.lease_ms ? spec.lease_ms : options_.default_lease_ms);
  bool in_prefix = true;
  // Promoted by this Lookup: answered as found on NVMe (a set: a 4096-block answer all
  // from NVMe compared every block with every promotion, 16.7M comparisons under mu_).
  absl::flat_hash_set<ObjectKey> promoted;
  promoted.reserve(promos.size());
  for (const Promo& p : promos) promoted.insert(p.key);
  for (const BlockHash& h : spec.hashes) {
    const ObjectKey key{h, spec.kind};
    Object* o = im.Find(key);
    if (!visible(o) || !o->copy[kD]) {
      in_prefix = false;
      if (spec.allow_gaps) continue;
      break;
    }
    if (in_prefix) ++ans.prefix_blocks;
    lease.pages += o->pages[kD].size();
    ++o->leases;
    im.SyncHeld(*o);
    im.Touch(*o);
    lease.keys.push_back(key);
    ans.objects.push_back(ObjectDesc{key, promoted.contains(key) ? Tier::kNvme : Tier::kDram,
                                     PageRunDesc{o->pages[kD], o->length}, o->checksum});
  }
  for (const ObjectKey& k : pinned) {
    if (Object* o = im.Find(k)) im.Unpin(*o);
  }
  if (!lease.keys.empty()) {
    ans.lease_id = im.NewId();
    lease.client = spec.client;
    im.PinnedByClient(lease.client, lease.pages);
    ans.lease_expires_unix_ms = lease.expires_ms;
    ans.lease_ttl_ms = lease.expires_ms - now;
    im.lease_expiry_.emplace(lease.expires_ms, ans.lease_id);
    im.leases_.emplace(ans.lease_id, std::move(lease));
  }
  return ans;
}

absl::Status PoolCore::Release(uint64_t lease_id, absl::string_view client) {
  Impl& im = *impl_;
  absl::MutexLock l(&im.mu_);
  im.ExpireLocked(im.clock_->NowMs());
  auto it = im.leases_.find(lease_id);
  if (it == im.leases_.end()) {
    return absl::NotFoundError(absl::StrCat("lease_id=", lease_id,
                                            " is unknown: it expired or was released already"));
  }
  if (it->second.client != client) {
    return absl::PermissionDeniedError(absl::StrCat(
        "lease_id=", lease_id, " was not taken by client_id \"", client.substr(0, 128),
        "\"; Release only the lease_id your own Lookup returned (the lease stays)"));
  }
  im.EndLease(lease_id);
  return absl::OkStatus();
}

absl::StatusOr<std::string> PoolCore::ReadObject(uint64_t lease_id, const ObjectKey& key) {
  Impl& im = *impl_;
  absl::MutexLock l(&im.mu_);
  im.ExpireLocked(im.clock_->NowMs());
  auto it = im.leases_.find(lease_id);
  if (it == im.leases_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "lease_id=", lease_id, " expired or was released; its pages may hold other objects now. "
        "Lookup again"));
  }
  if (std::find(it->second.keys.begin(), it->second.keys.end(), key) == it->second.keys.end()) {
    return absl::InvalidArgumentError(absl::StrCat("block ", key.hash.ToHex(), " is not under lease ", lease_id));
  }
  const Object* o = im.Find(key);
  std::string out(o->length, '\0');
  CopyFromRun(PageRunDesc{o->pages[kD], o->length},
              {reinterpret_cast<std::byte*>(out.data()), out.size()});
  return out;
}

void PoolCore::RunMaintenance() {
  Impl& im = *impl_;
  uint64_t used, high, low;
  bool may_compact = false, quarantine_due = false;
  {
    absl::MutexLock l(&im.mu_);
    const int64_t now = im.clock_->NowMs();
    im.ExpireLocked(now);
    used = im.alloc_[kD]->used_pages() - im.dram_quarantined_pages_;  // those come back on their own
    high = static_cast<uint64_t>(options_.demote_high_watermark * dram_pages_);
    low = static_cast<uint64_t>(options_.demote_low_watermark * dram_pages_);
    // Pages held back after a failed journal DEL come back with a compaction (retried
    // every kCompactionRetryMs while the journal keeps failing).
    may_compact = now >= im.next_compaction_ms_;
    quarantine_due = may_compact && !im.nvme_quarantine_.empty();
  }
  if (im.nvme_ != nullptr && may_compact &&
      (quarantine_due || im.nvme_->JournalWantsCompaction(options_.journal_compact_min_bytes))) {
    im.CompactJournal();
  }
  if (im.nvme_ == nullptr || used <= high) return;
  (void)im.DemotePipelined(64 * 1024, low);
}

size_t PoolCore::Demote(size_t max_objects) { return impl_->DemotePipelined(max_objects, 0); }

PoolStatsSnapshot PoolCore::Stats() const {
  Impl& im = *impl_;
  absl::MutexLock l(&im.mu_);
  PoolStatsSnapshot s;
  s.node_id = im.node_id_;
  s.has_nvme = im.nvme_ != nullptr;
  for (int t = 0; t < kNumTiers; ++t) {
    auto& ts = s.tiers[t];
    ts.capacity_bytes = uint64_t{im.alloc_[t]->num_pages()} * page_bytes_;
    ts.objects = im.objects_in_[t];
    ts.evictions = im.evictions_[t];
    for (int k = 0; k < kNumKinds; ++k) {
      ts.bytes_by_kind[k] = im.used_by_kind_[t][k] * page_bytes_;
      ts.used_bytes += ts.bytes_by_kind[k];
    }
  }
  for (int k = 0; k < kNumKinds; ++k) s.reserved_bytes += im.reserved_by_kind_[k] * page_bytes_;
  s.active_leases = im.leases_.size();
  s.pending_reservations = im.reservations_.size();
  s.checksum_failures = im.checksum_failures_;
  s.nvme_held_back_bytes = im.nvme_quarantine_.size() * page_bytes_;
  s.dram_held_back_bytes = im.dram_quarantined_pages_ * page_bytes_;
  s.demotions = im.demotions_;
  s.promotions = im.promotions_;
  s.reclaimed_reservations = im.reclaimed_;
  s.expired_leases = im.expired_leases_;
  return s;
}

absl::Status PoolCore::CheckIndex() const {
  Impl& im = *impl_;
  absl::MutexLock l(&im.mu_);
  size_t leaves[kNumTiers] = {0, 0};
  for (const auto& [key, o] : im.objects_) {
    const std::string what = absl::StrCat(key.hash.ToHex(), " (", StateKindName(key.kind), ")");
    if (!o->copy[0] && !o->copy[1]) return absl::InternalError(absl::StrCat(what, " has no copy"));
    for (int t = 0; t < kNumTiers; ++t) {
      const size_t kids = im.CountChildrenIn(*o, t);
      if (o->kids_in[t] != kids) {
        return absl::InternalError(absl::StrCat(what, " counts ", o->kids_in[t], " children in tier ", t, "; it has ", kids));
      }
      const bool leaf = o->copy[t] && kids == 0;
      if (o->in_leaves[t] != leaf || (leaf && !im.leaves_[t].contains({o->tick, key}))) {
        return absl::InternalError(absl::StrCat(what, " is ", leaf ? "" : "not ", "a leaf of tier ", t,
                                                " but the leaf set says otherwise"));
      }
      leaves[t] += leaf;
    }
  }
  uint64_t promoting[kNumKinds] = {};
  for (const auto& [key, o] : im.objects_) {
    if (o->promotion != nullptr) promoting[KindIndex(key.kind)] += o->pages[kN].size();
  }
  for (int k = 0; k < kNumKinds; ++k) {
    if (promoting[k] != im.promoting_by_kind_[k]) {
      return absl::InternalError(absl::StrCat("promotions under way of kind ", k, " hold ", promoting[k],
                                              " DRAM pages; promoting_by_kind_ says ", im.promoting_by_kind_[k]));
    }
  }
  for (int t = 0; t < kNumTiers; ++t) {
    if (im.leaves_[t].size() != leaves[t]) {
      return absl::InternalError(absl::StrCat("tier ", t, " leaf set holds ", im.leaves_[t].size(), " entries for ",
                                              leaves[t], " leaves"));
    }
  }
  absl::flat_hash_map<std::string, uint64_t> by_client;
  for (const auto& [id, lease] : im.leases_) by_client[lease.client] += lease.pages;
  for (const auto& [id, r] : im.reservations_) {
    uint64_t pages = 0;
    for (const ReservedEntry& e : r.entries) pages += e.pages.size();
    if (pages != r.pages) {
      return absl::InternalError(absl::StrCat("reservation ", id, " holds ", pages, " pages; it counts ", r.pages));
    }
    by_client[r.client] += r.pages;
  }
  for (const Impl::HeldBack& h : im.dram_quarantine_) by_client[h.client] += h.pages.size();
  absl::erase_if(by_client, [](const auto& e) { return e.second == 0; });
  if (by_client != im.pinned_by_client_) {
    return absl::InternalError(absl::StrCat("leases and reservations hold pages of ", by_client.size(),
                                            " clients; pinned_by_client_ counts ", im.pinned_by_client_.size(),
                                            " clients, or other page counts"));
  }
  return absl::OkStatus();
}

std::optional<ObjectInfo> PoolCore::Inspect(const ObjectKey& key) const {
  Impl& im = *impl_;
  absl::MutexLock l(&im.mu_);
  const Object* o = im.Find(key);
  if (o == nullptr) return std::nullopt;
  return ObjectInfo{o->copy[kD], o->copy[kN], o->pages[kD], o->pages[kN], o->leases,
                    im.Visible(*o), o->length, o->checksum};
}

void PoolCore::ForEachVisible(
    const std::function<void(const ObjectKey&, const std::optional<BlockHash>&, Tier)>& fn) const {
  Impl& im = *impl_;
  absl::MutexLock l(&im.mu_);
  for (const auto& [key, o] : im.objects_) {
    if (!im.Visible(*o)) continue;
    for (int t = 0; t < kNumTiers; ++t) {
      if (o->copy[t]) fn(key, o->parent, static_cast<Tier>(t));
    }
  }
}

void PoolCore::SetNodeId(std::string node_id) {
  absl::MutexLock l(&impl_->mu_);
  impl_->node_id_ = std::move(node_id);
}

std::string PoolCore::DescribeConfig() const {
  std::string node_id;
  {
    absl::MutexLock l(&impl_->mu_);
    node_id = impl_->node_id_;
  }
  std::string s = absl::StrCat("kvpool-node ", node_id, "\n");
  absl::StrAppend(&s, "  page bytes   ", page_bytes_, "\n");
  absl::StrAppend(&s, "  DRAM tier    ", dram_pages_, " pages = ", arena_bytes(), " bytes (",
                  FormatBytes(static_cast<double>(arena_bytes())), ")\n");
  if (impl_->nvme_) {
    const uint64_t nb = uint64_t{impl_->nvme_->num_pages()} * page_bytes_;
    absl::StrAppend(&s, "  NVMe tier    ", impl_->nvme_->num_pages(), " pages = ", nb, " bytes (",
                    FormatBytes(static_cast<double>(nb)), ") in ", options_.nvme_dir,
                    " (O_DIRECT, io_uring QD ", impl_->nvme_->queue_depth(),
                    impl_->nvme_->registered_buffers() ? ", registered buffers" : ", unregistered buffers",
                    ")\n");
  } else {
    absl::StrAppend(&s, "  NVMe tier    none (no --nvme-dir)\n");
  }
  absl::StrAppend(&s, "  demotion     above ", options_.demote_high_watermark * 100, "% down to ",
                  options_.demote_low_watermark * 100, "% of DRAM\n");
  absl::StrAppend(&s, "  leases       default ", options_.default_lease_ms, " ms; reserves expire after ",
                  options_.reserve_timeout_ms, " ms\n");
  for (int k = 0; k < kNumKinds; ++k) {
    if (options_.dram_quota_bytes[k] != 0) {
      absl::StrAppend(&s, "  DRAM quota   ", StateKindName(static_cast<StateKind>(k)), " ",
                      options_.dram_quota_bytes[k], " bytes\n");
    }
  }
  if (options_.max_client_pinned_bytes != 0) {
    absl::StrAppend(&s, "  per client   at most ", options_.max_client_pinned_bytes / page_bytes_,
                    " DRAM pages under leases and reservations\n");
  }
  return s;
}

}  // namespace kvpool::pool_node
