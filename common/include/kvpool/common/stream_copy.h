// StreamCopy: memcpy with non-temporal (streaming) stores, for copies whose destination
// will not be read again soon from this core's caches: KV pages moved into another
// process's arena, or landed in a pool much larger than the caches.
//
// Why: a plain store to a line that is not in cache first reads the line (read for
// ownership), so a DRAM-to-DRAM memcpy moves 3 bytes over the memory bus per byte copied.
// Streaming stores write whole lines without reading them: 2 bytes per byte. Measured on
// the development VM (AMD EPYC, 1 MiB copies over a 1 GiB footprint): glibc memcpy
// 7.3-9.0 GB/s, streaming 9.4-16.5 GB/s; the other way round for cache-resident data
// (1 MiB reused: glibc 34-36 GB/s, streaming 20-22 GB/s), so use it for large transfers only.
//
// Streaming stores are weakly ordered: call StreamFence() after the last StreamCopy and
// before telling anyone (another thread, process or device) that the bytes are there.
// Without SSE2 (non-x86 builds) both fall back to memcpy and a fence.
#pragma once

#include <cstddef>

namespace kvpool {

void StreamCopy(void* dst, const void* src, size_t n);
void StreamFence();

}  // namespace kvpool
