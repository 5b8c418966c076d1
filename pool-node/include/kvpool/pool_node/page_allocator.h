// PageAllocator: hands out page runs from a fixed set of equally sized pages.
//
// Pages are indices 0..num_pages-1 (the caller maps them to arena or file offsets). A
// run is the list of pages that hold one object, in object order. The allocator prefers
// one contiguous extent (the smallest free extent that fits: best fit), and only when no
// extent is large enough gathers the run from several extents in address order, so a
// fragmented pool still fills completely.
//
//   free extents: [0..3] [8..8] [12..19]      Allocate(5) -> 12 13 14 15 16
//                                             Allocate(6) -> 0 1 2 3 8 12 (scattered)
//
// Costs: Allocate and Free are O(free extents + pages in the run).
//
// Thread safety: none; the owner (a tier) guards it with its own mutex.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <vector>

namespace kvpool::pool_node {

class PageAllocator {
 public:
  explicit PageAllocator(uint32_t num_pages);

  uint32_t num_pages() const { return num_pages_; }
  uint32_t free_pages() const { return free_pages_; }
  uint32_t used_pages() const { return num_pages_ - free_pages_; }

  // A run of `n` pages (n > 0), or nullopt when fewer than n pages are free.
  std::optional<std::vector<uint32_t>> Allocate(uint32_t n);
  // Returns pages to the pool. REQUIRES: each page is allocated (checked; a double free
  // or an out-of-range page aborts, because it means the tier's books are wrong).
  void Free(std::span<const uint32_t> pages);
  // Marks specific pages used (journal recovery). False, changing nothing, when any page
  // is out of range, already used, or repeated.
  bool MarkUsed(std::span<const uint32_t> pages);
  // True when `page` is free (tests).
  bool IsFree(uint32_t page) const;

 private:
  void FreeOne(uint32_t page);
  uint32_t num_pages_;
  uint32_t free_pages_;
  std::map<uint32_t, uint32_t> extents_;  // start -> length of each free extent, disjoint, coalesced
};

}  // namespace kvpool::pool_node
