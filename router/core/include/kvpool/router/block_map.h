// BlockMap: the router index's hash table, block hash -> V, built for FindMatches.
//
// Open addressing with linear probing over 64-byte slots that hold the key and its value
// together, so a hit reads one cache line (absl::flat_hash_map reads a control group and
// then the slot: two lines and ~3x the instructions per probe). Block hashes are uniform
// already; the slot index is the top bits of lo * 2^64/phi, which also spreads
// hand-made small hashes.
//
//   slots:  [key | value ............. state]  one cache line each, 2 MiB aligned
//   state:  kEmpty (ends a probe) or kFull
//
// Erase shifts the rest of the probe run back into the hole (no tombstones, so a table
// with as many erases as inserts, the index's steady state, never needs sweeping); it
// may move other slots, so scans that erase go through EraseIf. Inserting may grow the
// table and invalidates every iterator and pointer. At most half the slots are full: a
// probe for a present key reads ~1.5 slots on average, and short probes keep the
// branches predictable (at 70% lookups measured ~45% slower). Memory: 64 bytes per slot,
// 2-4 slots per key, on huge pages (common/huge_page_allocator.h).
//
// Requirements on V: default-constructible, movable, and a public `uint8_t slot_state`
// member the map owns, 0 in a default V (V's padding usually has room for it);
// sizeof(BlockHash) + sizeof(V) <= 64. Thread safety: none, as absl's containers.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <new>
#include <type_traits>
#include <utility>

#include "kvpool/common/hash.h"
#include "kvpool/common/huge_page_allocator.h"

namespace kvpool::router {

template <typename V>
class BlockMap {
 public:
  enum : uint8_t { kEmpty = 0, kFull = 1 };
  // `first` / `second` as in std::pair, so `auto& [key, value] : map` reads as it does
  // for the standard maps.
  struct alignas(64) Slot {
    BlockHash first;
    V second;
  };
  static_assert(sizeof(Slot) == 64, "key + value must fit one cache line");

  template <bool kConst>
  class Iter {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = Slot;
    using difference_type = std::ptrdiff_t;
    using pointer = std::conditional_t<kConst, const Slot*, Slot*>;
    using reference = std::conditional_t<kConst, const Slot&, Slot&>;

    Iter() = default;
    Iter(pointer s, pointer end) : s_(s), end_(end) { Skip(); }
    operator Iter<true>() const { return Iter<true>(s_, end_); }  // NOLINT: as std iterators
    reference operator*() const { return *s_; }
    pointer operator->() const { return s_; }
    Iter& operator++() {
      ++s_;
      Skip();
      return *this;
    }
    Iter operator++(int) {
      Iter r = *this;
      ++*this;
      return r;
    }
    friend bool operator==(const Iter& a, const Iter& b) { return a.s_ == b.s_; }

   private:
    friend class BlockMap;
    void Skip() {
      while (s_ != end_ && s_->second.slot_state != kFull) ++s_;
    }
    pointer s_ = nullptr;
    pointer end_ = nullptr;
  };
  using iterator = Iter<false>;
  using const_iterator = Iter<true>;

  BlockMap() { Allocate(kMinCapacity); }
  ~BlockMap() { Free(); }
  BlockMap(const BlockMap&) = delete;
  BlockMap& operator=(const BlockMap&) = delete;

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t capacity() const { return mask_ + 1; }

  iterator begin() { return iterator(slots_, slots_ + capacity()); }
  iterator end() { return iterator(slots_ + capacity(), slots_ + capacity()); }
  const_iterator begin() const { return const_iterator(slots_, slots_ + capacity()); }
  const_iterator end() const { return const_iterator(slots_ + capacity(), slots_ + capacity()); }

  // The value of `key`, or nullptr: the hot path of FindMatches.
  V* FindValue(const BlockHash& key) {
    for (size_t i = Home(key);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.second.slot_state == kEmpty) return nullptr;
      if (s.first == key) return &s.second;
    }
  }
  const V* FindValue(const BlockHash& key) const { return const_cast<BlockMap*>(this)->FindValue(key); }

  iterator find(const BlockHash& key) {
    const size_t i = FindIndex(key);
    return i == capacity() ? end() : iterator(&slots_[i], slots_ + capacity());
  }
  const_iterator find(const BlockHash& key) const { return const_cast<BlockMap*>(this)->find(key); }
  bool contains(const BlockHash& key) const { return FindValue(key) != nullptr; }

  // The slot of `key`, with a default value when it was absent (then true).
  std::pair<iterator, bool> try_emplace(const BlockHash& key) {
    if ((size_ + 1) * 2 > capacity()) {
      if (const size_t i = FindIndex(key); i != capacity()) return {iterator(&slots_[i], slots_ + capacity()), false};
      Rehash(capacity() * 2);
    }
    size_t i = Home(key);
    for (; slots_[i].second.slot_state == kFull; i = (i + 1) & mask_) {
      if (slots_[i].first == key) return {iterator(&slots_[i], slots_ + capacity()), false};
    }
    Slot& s = slots_[i];
    s.first = key;
    s.second.slot_state = kFull;  // an empty slot holds a default V already
    ++size_;
    return {iterator(&s, slots_ + capacity()), true};
  }

  // Removes it; later slots of its probe run may move (back-shift).
  void erase(iterator it) { EraseAt(static_cast<size_t>(it.s_ - slots_)); }

  // Calls pred(key, value&) once for every entry (pred may change the value) and erases
  // those it returns true for. O(capacity).
  template <typename Pred>
  void EraseIf(Pred&& pred) {
    if (size_ == 0) return;
    // Start after an empty slot: a probe run never crosses one, so what a back-shift
    // moves into slot i comes from later in the same run, not yet visited.
    size_t start = 0;
    while (slots_[start].second.slot_state == kFull) ++start;
    size_t i = (start + 1) & mask_;
    for (size_t visited = 0; visited < capacity();) {
      Slot& s = slots_[i];
      if (s.second.slot_state == kFull && pred(std::as_const(s.first), s.second)) {
        EraseAt(i);  // slot i may now hold a later entry of the run: look at it again
        continue;
      }
      i = (i + 1) & mask_;
      ++visited;
    }
  }

 private:
  static constexpr size_t kMinCapacity = 16;

  size_t Home(const BlockHash& key) const {
    return static_cast<size_t>((key.lo * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  // The slot of `key`, or capacity() when absent. (find does not step back from
  // FindValue's V* to its Slot: offsetof on a Slot that is not standard-layout, as
  // KvIndex's is, is only conditionally supported, and clang's -Winvalid-offsetof fails
  // the build.)
  size_t FindIndex(const BlockHash& key) const {
    for (size_t i = Home(key);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.second.slot_state == kEmpty) return capacity();
      if (s.first == key) return i;
    }
  }

  void EraseAt(size_t hole) {
    // Back-shift: an entry later in the run moves into the hole unless its home lies in
    // (hole, j], where it would no longer be found from its home.
    for (size_t j = (hole + 1) & mask_; slots_[j].second.slot_state == kFull; j = (j + 1) & mask_) {
      if (((j - Home(slots_[j].first)) & mask_) >= ((j - hole) & mask_)) {
        slots_[hole].first = slots_[j].first;
        slots_[hole].second = std::move(slots_[j].second);
        hole = j;
      }
    }
    slots_[hole].first = BlockHash{};
    slots_[hole].second = V{};  // slot_state = kEmpty
    --size_;
  }

  void Allocate(size_t capacity) {
    slots_ = HugePageAllocator<Slot>().allocate(capacity);
    for (size_t i = 0; i < capacity; ++i) new (&slots_[i]) Slot{};  // kEmpty
    mask_ = capacity - 1;
    shift_ = 64 - std::countr_zero(capacity);
    size_ = 0;
  }
  void Free() {
    for (size_t i = 0; i <= mask_; ++i) slots_[i].~Slot();
    HugePageAllocator<Slot>().deallocate(slots_, mask_ + 1);
  }
  void Rehash(size_t new_capacity) {
    const size_t old_capacity = capacity();
    Slot* old = slots_;
    Allocate(new_capacity);
    for (size_t i = 0; i < old_capacity; ++i) {
      if (old[i].second.slot_state == kFull) {
        size_t j = Home(old[i].first);
        while (slots_[j].second.slot_state == kFull) j = (j + 1) & mask_;
        slots_[j].first = old[i].first;
        slots_[j].second = std::move(old[i].second);
        ++size_;
      }
      old[i].~Slot();
    }
    HugePageAllocator<Slot>().deallocate(old, old_capacity);
  }

  Slot* slots_ = nullptr;
  size_t mask_ = 0;
  int shift_ = 64;
  size_t size_ = 0;
};

}  // namespace kvpool::router
