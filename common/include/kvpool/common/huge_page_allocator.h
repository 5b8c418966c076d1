// HugePageAllocator: a std allocator whose large blocks are backed by transparent huge pages.
//
//   absl::flat_hash_map<K, V, H, std::equal_to<K>, HugePageAllocator<std::pair<const K, V>>>
//
// Hash tables of millions of entries are probed at random places: with 4 KiB pages every
// probe of a large table also misses the TLB (a two-level walk under a hypervisor). A block
// of at least kHugePageBytes is mapped on its own, 2 MiB aligned, and madvised
// MADV_HUGEPAGE (the kernel's THP mode "madvise", Debian's default, honours that); smaller
// blocks come from operator new. Where the kernel has no THP the madvise fails and the
// mapping stays an ordinary one: same behaviour, only slower.
//
// Stateless: every instance is interchangeable (equal), as the standard containers expect.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>

namespace kvpool {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

namespace internal {
inline size_t RoundUpToHugePage(size_t bytes) { return (bytes + kHugePageBytes - 1) & ~(kHugePageBytes - 1); }

// `bytes` rounded up to 2 MiB, 2 MiB aligned; nullptr when mmap fails.
inline void* MapHugePages(size_t bytes) {
  const size_t size = RoundUpToHugePage(bytes);
  // Map one huge page more and trim, so the kept range starts on a 2 MiB boundary.
  void* raw = mmap(nullptr, size + kHugePageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (begin + kHugePageBytes - 1) & ~(uintptr_t{kHugePageBytes} - 1);
  if (aligned > begin) munmap(raw, aligned - begin);
  const uintptr_t end = begin + size + kHugePageBytes;
  if (end > aligned + size) munmap(reinterpret_cast<void*>(aligned + size), end - (aligned + size));
  void* p = reinterpret_cast<void*>(aligned);
  (void)madvise(p, size, MADV_HUGEPAGE);  // best effort: EINVAL where THP is compiled out
  return p;
}
}  // namespace internal

template <typename T>
class HugePageAllocator {
 public:
  using value_type = T;

  HugePageAllocator() noexcept = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}  // NOLINT: rebinding is implicit

  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_array_new_length();
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePageBytes) return static_cast<T*>(::operator new(bytes, std::align_val_t{alignof(T)}));
    void* p = internal::MapHugePages(bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }

  void deallocate(T* p, size_t n) noexcept {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePageBytes) {
      ::operator delete(p, std::align_val_t{alignof(T)});
    } else {
      munmap(p, internal::RoundUpToHugePage(bytes));
    }
  }

  template <typename U>
  friend bool operator==(const HugePageAllocator&, const HugePageAllocator<U>&) noexcept {
    return true;
  }
};

}  // namespace kvpool
