// Helpers shared by the pool-node tests: temp dirs, patterned objects, one-call puts.
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/common/hash.h"
#include "kvpool/pool_node/pool_core.h"

namespace kvpool::pool_node::testing {

// A fresh directory under /tmp (O_DIRECT works there on this machine; NvmeStore probes
// and names --nvme-dir if it does not), removed at destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = "/tmp/kvpool-pool-node-test-XXXXXX";
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline BlockHash H(uint64_t i) { return BlockHash{0x1000 + i, 0xabc0000000000000ull ^ (i * 7919)}; }

// Deterministic bytes that differ per object and per offset.
inline std::string Pattern(uint64_t seed, size_t n) {
  std::string s(n, '\0');
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 1);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v = rng();
    for (size_t j = 0; j < 8 && i + j < n; ++j) s[i + j] = static_cast<char>(v >> (8 * j));
  }
  return s;
}

inline std::span<const std::byte> Bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

// Reserve -> copy into the arena (what a worker does over UCX) -> Commit.
inline absl::Status Put(PoolCore& core, BlockHash h, std::optional<BlockHash> parent,
                        const std::string& bytes, StateKind kind = StateKind::kAttnKv) {
  ReserveEntrySpec e{h, parent, kind, bytes.size()};
  auto r = core.Reserve({&e, 1});
  if (!r.ok()) return r.status();
  if (!r->slots[0].status.ok()) return r->slots[0].status;  // stored at another length
  if (r->slots[0].already_present) return absl::OkStatus();
  core.CopyToRun(r->slots[0].run, Bytes(bytes));
  CommitEntrySpec c{h, Checksum64(Bytes(bytes))};
  auto out = core.Commit(r->id, {&c, 1});
  if (!out.ok()) return out.status();
  return (*out)[0].status;
}

// Puts a chain h(first)..h(first+n-1), each `bytes` long, seeded by its index.
inline void PutChain(PoolCore& core, uint64_t first, uint64_t n, size_t bytes,
                     std::optional<BlockHash> parent = std::nullopt) {
  for (uint64_t i = first; i < first + n; ++i) {
    ASSERT_TRUE(Put(core, H(i), parent, Pattern(i, bytes)).ok()) << i;
    parent = H(i);
  }
}

}  // namespace kvpool::pool_node::testing
