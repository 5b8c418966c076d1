#include "kvpool/pool_node/page_allocator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/container/flat_hash_set.h"

namespace kvpool::pool_node {

PageAllocator::PageAllocator(uint32_t num_pages) : num_pages_(num_pages), free_pages_(num_pages) {
  if (num_pages > 0) extents_.emplace(0, num_pages);
}

std::optional<std::vector<uint32_t>> PageAllocator::Allocate(uint32_t n) {
  if (n == 0 || n > free_pages_) return std::nullopt;
  std::vector<uint32_t> run;
  run.reserve(n);
  // Best fit: the smallest extent that holds the whole run keeps big extents for big runs.
  auto best = extents_.end();
  for (auto it = extents_.begin(); it != extents_.end(); ++it) {
    if (it->second >= n && (best == extents_.end() || it->second < best->second)) {
      best = it;
      if (it->second == n) break;
    }
  }
  if (best != extents_.end()) {
    const uint32_t start = best->first, len = best->second;
    extents_.erase(best);
    if (len > n) extents_.emplace(start + n, len - n);
    for (uint32_t i = 0; i < n; ++i) run.push_back(start + i);
  } else {
    // Gather from extents in address order (fewest, longest pieces first would also do;
    // address order keeps neighbouring pages together for coalesced I/O).
    uint32_t need = n;
    auto it = extents_.begin();
    while (need > 0) {
      const uint32_t start = it->first, len = it->second;
      const uint32_t take = std::min(len, need);
      it = extents_.erase(it);
      if (len > take) it = extents_.emplace(start + take, len - take).first;
      for (uint32_t i = 0; i < take; ++i) run.push_back(start + i);
      need -= take;
    }
  }
  free_pages_ -= n;
  return run;
}

void PageAllocator::FreeOne(uint32_t page) {
  if (page >= num_pages_ || IsFree(page)) {
    std::fprintf(stderr, "PageAllocator: freeing page %u that is not allocated (of %u)\n", page,
                 num_pages_);
    std::abort();
  }
  uint32_t start = page, len = 1;
  auto next = extents_.lower_bound(page);
  if (next != extents_.end() && next->first == page + 1) {
    len += next->second;
    next = extents_.erase(next);
  }
  if (next != extents_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == page) {
      start = prev->first;
      len += prev->second;
      extents_.erase(prev);
    }
  }
  extents_.emplace(start, len);
  ++free_pages_;
}

void PageAllocator::Free(std::span<const uint32_t> pages) {
  for (uint32_t p : pages) FreeOne(p);
}

bool PageAllocator::IsFree(uint32_t page) const {
  auto it = extents_.upper_bound(page);
  if (it == extents_.begin()) return false;
  --it;
  return page < it->first + it->second;
}

bool PageAllocator::MarkUsed(std::span<const uint32_t> pages) {
  absl::flat_hash_set<uint32_t> seen;
  for (uint32_t p : pages) {
    if (p >= num_pages_ || !IsFree(p) || !seen.insert(p).second) return false;
  }
  for (uint32_t p : pages) {
    auto it = std::prev(extents_.upper_bound(p));
    const uint32_t start = it->first, len = it->second;
    extents_.erase(it);
    if (p > start) extents_.emplace(start, p - start);
    if (p + 1 < start + len) extents_.emplace(p + 1, start + len - p - 1);
    --free_pages_;
  }
  return true;
}

}  // namespace kvpool::pool_node
