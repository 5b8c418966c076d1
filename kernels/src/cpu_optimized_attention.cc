// CPU optimized GQA and MLA kernels.
//
// Decode work items are (sequence, split of kGqaSplitTokens / kMlaSplitTokens
// tokens); each walks its tokens in tiles of kTile and, per tile, every K/V head, so a
// page is read once, front to back, for all q heads of its group (GQA) or all heads
// (MLA). Partials merge per sequence in split order, so the result is independent of
// the thread count.
// Memory: the loops software-prefetch a fixed distance ahead (GQA: near, plus far for
// groups with few FMAs per byte), a few tokens between two score sub-blocks (pages are
// scattered, so hardware prefetchers restart at every page), and read K whole token
// rows at a time (GQA: every kv head of a sub-block).
// bf16 with dimensions a multiple of the ISA's pair_block uses the paired kernels
// (SimdOps::score_bf16p / accum_bf16p) where the ISA has them: q is permuted once per
// split, accumulators stay permuted until the split ends. Every score/accumulator
// element is summed in the same order however tokens are grouped, so results depend
// only on the sequence.
// Prefill items are (sequence, kv head, block of queries) with causal masks per row.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_attention.h"
#include "cpu_optimized.h"

namespace kvpool::kernels::internal {
namespace {

struct Split {
  int b;
  int t0, t1;  // token range
};

// Splits of every sequence, in (sequence, position) order; first[b] indexes seq b's.
std::vector<Split> MakeSplits(const BlockTable& t, int split_tokens, std::vector<int>* first) {
  std::vector<Split> splits;
  first->assign(t.batch + 1, 0);
  for (int b = 0; b < t.batch; ++b) {
    (*first)[b] = static_cast<int>(splits.size());
    const int64_t len = t.seq_lens[b];
    for (int64_t t0 = 0; t0 < len; t0 += split_tokens) {  // int64: t0 + split_tokens may pass INT_MAX
      splits.push_back({b, static_cast<int>(t0), static_cast<int>(std::min(len, t0 + split_tokens))});
    }
  }
  (*first)[t.batch] = static_cast<int>(splits.size());
  return splits;
}

// Element offsets of the token slots [t0, t0+T) of one sequence (slot * token_stride).
inline void SlotOffsets(const int32_t* table_row, int page_size, int64_t token_stride, int t0,
                        int T, int64_t* off) {
  for (int t = 0; t < T; ++t) {
    const int pos = t0 + t;
    off[t] = (int64_t{table_row[pos / page_size]} * page_size + pos % page_size) * token_stride;
  }
}

// Slot of cache position `pos` of one sequence; page sizes are powers of two (1, 16,
// 64; validated), so no division per token.
struct SlotMap {
  const int32_t* row;
  int shift, mask;
  SlotMap(const int32_t* table_row, int page_size)
      : row(table_row), shift(__builtin_ctz(static_cast<unsigned>(page_size))), mask(page_size - 1) {}
  int64_t operator()(int pos) const { return (int64_t{row[pos >> shift]} << shift) + (pos & mask); }
};

// One cache line into L1 (kOuter: prefetcht2, "into the outer levels"). gcc 12 emitted
// no prefetch at all for __builtin_prefetch / _mm_prefetch in this file (checked with
// objdump), so x86 issues the instruction itself; prefetcht0/t2 are baseline SSE.
template <bool kOuter = false>
inline void PrefetchLine(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (kOuter) {
    asm volatile("prefetcht2 %0" : : "m"(*p));
  } else {
    asm volatile("prefetcht0 %0" : : "m"(*p));
  }
#else
  __builtin_prefetch(p, 0, kOuter ? 1 : 3);
#endif
}

// Prefetches the whole rows (row_bytes each) of the slots of positions [p0, p1) into
// cache. Pages of a sequence are scattered, so the hardware prefetcher restarts at
// every page; the decode loops ask a fixed distance ahead, a few tokens at a time
// between compute, so the core keeps misses in flight without a burst that overflows
// its miss buffers. Positions in one page are contiguous slots, so each page's run is
// one byte range: one table lookup and one line loop per run, not per token (per-token
// lookups and loops were ~20% of tiny-gqa's instructions, callgrind).
template <bool kOuter = false>
inline void PrefetchRows(const SlotMap& map, int p0, int p1, const void* base, size_t row_bytes) {
  for (int pos = p0; pos < p1;) {
    const int run_end = std::min(p1, ((pos >> map.shift) + 1) << map.shift);
    const uintptr_t p = reinterpret_cast<uintptr_t>(base) + map(pos) * row_bytes;
    // Every line of [p, p + bytes) once (a range not 64-byte aligned spans one more).
    const uintptr_t end = p + static_cast<size_t>(run_end - pos) * row_bytes;
    for (uintptr_t line = p & ~uintptr_t{63}; line < end; line += 64) {
      PrefetchLine<kOuter>(reinterpret_cast<const char*>(line));
    }
    pos = run_end;
  }
}

// Decode sub-blocks: tokens scored between two prefetch batches (a multiple of 4, so
// the generic-layout score kernels group tokens as over the whole tile). Small batches
// of prefetches (4 tokens: 8-16 lines per stream) measured better than 16 tokens at
// 8 KiB ahead on the shared 2-vCPU dev VM (noisy; see README).
constexpr int kSub = 4;

// MLA tokens per score call and prefetch batch for `rows` heads: 2 for 3-7 heads on the
// paired path (score_bf16p's token group there), so each pair's 36 prefetch lines go
// out between two score calls instead of 72 at once (tiny-mla: +17-30% bytes per
// CPU-second at >= 64 MiB, +34% single-thread; noisy VM, see README). With 8+ heads
// one entry per call measured the same or a few % worse (deepseek-v3-tp8), so those
// keep kSub. score_bf16p gives the same bits for any grouping; the generic-layout
// kernels do not, so they keep kSub.
inline int SubTokens(bool paired, int rows) { return paired && rows >= 3 && rows < 8 ? 2 : kSub; }

// GQA decode prefetches whole K and V token rows about kPrefetchBytes of each ahead with
// prefetcht0 (256-byte rows, llama-70b-tp8: 16 tokens, one page of 16). Where a token
// costs few FMAs (G / esz <= kFarMaxFmaPerByte: tiny-gqa's 1, not llama-70b-tp8's 4),
// 16 tokens of compute are shorter than a loaded memory latency, so those rows are
// requested about kPrefetchFarBytes ahead (32 tokens) with prefetcht2 and again
// kPrefetchNearBytes ahead (12 tokens) with prefetcht0. Against the single batch
// (noisy shared VM, see README): tiny-gqa 32 x 4K +12-36% bytes per CPU-second (one
// thread), the far hint (t0, t2, nta) made no difference; llama-70b-tp8 with both
// batches 6-7% slower (more prefetch instructions, no latency left to hide), with one
// batch 12 tokens ahead within noise of 16.
constexpr size_t kPrefetchBytes = 4096;
constexpr size_t kPrefetchNearBytes = 3072;
constexpr size_t kPrefetchFarBytes = 8192;
constexpr double kFarMaxFmaPerByte = 2.0;
// MLA decode prefetch distance in tokens (18 KiB of bf16 entries), far more than the
// memory latency at >= 500 cycles of FMAs per entry.
constexpr int kMlaAhead = 16;

// Merges the splits of each sequence into out[b][R][dv].
void MergeSplits(const CpuContext& cx, const std::vector<int>& first, int batch, int R, int dv,
                 const std::vector<float>& ws_m, const std::vector<float>& ws_l,
                 const std::vector<float>& ws_acc, float* out) {
  cx.pool->ParallelFor(batch, [&](int64_t b) {
    const int n = first[b + 1] - first[b];
    std::vector<float> m(n), l(n);
    std::vector<const float*> acc(n);
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < n; ++i) {
        const int64_t row = int64_t{first[b] + i} * R + r;
        m[i] = ws_m[row];
        l[i] = ws_l[row];
        acc[i] = ws_acc.data() + row * dv;
      }
      MergePartials(n, m.data(), l.data(), acc.data(), dv, out + (b * R + r) * int64_t{dv});
    }
  });
}


// The bf16 fast path (SimdOps::score_bf16p / accum_bf16p) where the ISA has one and
// every dimension is a multiple of its pair_block (16 or 32); q rows and accumulators
// are then paired.
// KVPOOL_KERNELS_BF16_PAIRED=0 turns it off (A/B measurements).
bool PairedAllowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("KVPOOL_KERNELS_BF16_PAIRED");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return allowed;
}

inline bool UsePaired(const SimdOps& ops, Elem elem, int dim, int dv) {
  return PairedAllowed() && elem == Elem::kBf16 && dim % ops.pair_block == 0 &&
         dv % ops.pair_block == 0 && ops.score_bf16p != nullptr && ops.accum_bf16p != nullptr;
}

// Scores of one sub-block: `q` natural rows or `qp` paired rows (paired path).
inline void ScoreRows(const SimdOps& ops, bool paired, const float* q, const float* qp, int R,
                      int dim, const void* const* rows, Elem elem, int T, float scale, float* s) {
  if (paired) {
    ops.score_bf16p(qp, R, dim, rows, T, scale, s, kTile);
  } else {
    ops.score(q, R, dim, rows, elem, T, scale, s, kTile);
  }
}

// FoldTile, with paired accumulators on the paired path.
inline void FoldTileAny(const SimdOps& ops, bool paired, const SoftmaxRows& st, int T, float* s,
                        const void* const* vrows, Elem elem) {
  if (paired) {
    SoftmaxTile(ops, st, T, s);
    ops.accum_bf16p(s, st.R, kTile, vrows, T, st.dv, st.acc);
  } else {
    FoldTile(ops, st, T, s, vrows, elem);
  }
}

// The running max, sum and accumulators of one split, kept in the worker thread's own
// memory while the split runs and copied to the merge workspace once at its end (back
// in natural order on the paired path). Written in place, neighbouring splits' m/l
// (and the lines where their accumulators meet) shared cache lines that the two
// threads wrote every tile.
struct SplitState {
  std::vector<float> m, l, acc;
  SoftmaxRows Start(int R, int dv) {
    m.resize(R);
    l.resize(R);
    acc.resize(static_cast<size_t>(R) * dv);
    const SoftmaxRows st{R, dv, m.data(), l.data(), acc.data()};
    st.Reset();
    return st;
  }
  void Finish(const SimdOps& ops, bool paired, const SoftmaxRows& st, float* ws_m, float* ws_l,
              float* ws_acc) const {
    std::copy(m.begin(), m.end(), ws_m);
    std::copy(l.begin(), l.end(), ws_l);
    if (!paired) {
      std::copy(acc.begin(), acc.end(), ws_acc);
      return;
    }
    for (int r = 0; r < st.R; ++r) ops.unpair16(st.acc + int64_t{r} * st.dv, ws_acc + int64_t{r} * st.dv, st.dv);
  }
};

// Per-thread scratch reused across calls (pool threads live as long as the backend).
struct Scratch {
  std::vector<float> qp, s;
  SplitState split;
  std::vector<const void*> krows, vrows;
};
Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

}  // namespace

void CpuGqaDecode(const CpuContext& cx, const GqaDecodeParams& p) {
  const GqaPagedKv& kv = p.kv;
  const int d = kv.head_dim, Hkv = kv.num_kv_heads, G = p.num_q_heads / Hkv, Hq = p.num_q_heads;
  const int64_t token_stride = int64_t{Hkv} * d;
  const size_t esz = ElementBytes(kv.dtype);
  const Elem elem = ElemOf(kv.dtype);
  std::vector<int> first;
  const std::vector<Split> splits = MakeSplits(p.table, kGqaSplitTokens, &first);
  std::vector<float> ws_m(splits.size() * Hq), ws_l(splits.size() * Hq),
      ws_acc(splits.size() * Hq * d);
  const bool paired = UsePaired(*cx.ops, elem, d, d);
  cx.pool->ParallelFor(static_cast<int64_t>(splits.size()), [&](int64_t si) {
    const Split& sp = splits[si];
    const int32_t* row = p.table.block_table + int64_t{sp.b} * p.table.max_blocks;
    const float* q = p.q + int64_t{sp.b} * Hq * d;
    Scratch& scr = ThreadScratch();
    const SoftmaxRows all = scr.split.Start(Hq, d);
    const float* qp = nullptr;
    if (paired) {
      scr.qp.resize(static_cast<size_t>(Hq) * d);
      cx.ops->pair16(q, scr.qp.data(), Hq * d);  // rows of d, d % pair_block == 0
      qp = scr.qp.data();
    }
    scr.s.resize(static_cast<size_t>(kTile) * std::max(Hq, 16));  // [Hkv][G][kTile]
    float* sbuf = scr.s.data();
    const SlotMap map(row, kv.page_size);
    const size_t row_bytes = static_cast<size_t>(token_stride) * esz;
    // Prefetch distances in whole sub-blocks: near within [kSub, kTile] tokens, far at
    // least one sub-block beyond near (0: no far batch).
    const bool two_batches = static_cast<double>(G) / esz <= kFarMaxFmaPerByte;
    const size_t near_bytes = two_batches ? kPrefetchNearBytes : kPrefetchBytes;
    const int ahead = std::clamp(static_cast<int>(near_bytes / row_bytes) / kSub * kSub, kSub, kTile);
    const int far = two_batches ? std::clamp(static_cast<int>(kPrefetchFarBytes / row_bytes) / kSub * kSub,
                                             ahead + kSub, 2 * kTile)
                                : 0;
    // Row pointers per kv head: rows[h * kTile + t] (K in scr.krows, V in scr.vrows).
    scr.krows.resize(static_cast<size_t>(Hkv) * kTile);
    scr.vrows.resize(static_cast<size_t>(Hkv) * kTile);
    const void** krows = scr.krows.data();
    const void** vrows = scr.vrows.data();
    int64_t off[kTile];
    for (int t0 = sp.t0; t0 < sp.t1; t0 += kTile) {
      const int T = std::min(kTile, sp.t1 - t0);
      // Byte offsets of the tile's rows, then per head a plain add (a loop the compiler
      // vectorizes; the pointer setup was ~15% of tiny-gqa's instructions per token).
      for (int t = 0; t < T; ++t) off[t] = map(t0 + t) * static_cast<int64_t>(row_bytes);
      for (int h = 0; h < Hkv; ++h) {
        const char* kh = static_cast<const char*>(kv.k) + static_cast<size_t>(h) * d * esz;
        const char* vh = static_cast<const char*>(kv.v) + static_cast<size_t>(h) * d * esz;
        for (int t = 0; t < T; ++t) {
          krows[h * kTile + t] = kh + off[t];
          vrows[h * kTile + t] = vh + off[t];
        }
      }
      // Scores in sub-blocks of kSub tokens, every kv head per sub-block, so K is read
      // a whole token row (all heads) at a time, front to back through each page; a
      // pass per head over the tile instead strides through the rows (head 0's half,
      // then head 1's), which at 256 MiB, as a plain read without math, ran at
      // ~0.5-0.7 of a contiguous read against ~0.8-1.0 row by row (dev VM). Between
      // sub-blocks, prefetch whole K and V rows `ahead` tokens ahead (prefetcht0) and,
      // for cheap tokens, `far` tokens ahead (prefetcht2), never past the split.
      // (Scores get the same bits in sub-blocks of kSub tokens as over the whole tile.)
      for (int u = 0; u < T; u += kSub) {
        const int n = std::min(kSub, T - u);
        const int pf0 = t0 + ahead + u, pf1 = std::min(sp.t1, pf0 + kSub);
        if (pf0 < pf1) {
          PrefetchRows(map, pf0, pf1, kv.k, row_bytes);
          PrefetchRows(map, pf0, pf1, kv.v, row_bytes);
        }
        const int ff0 = t0 + far + u, ff1 = std::min(sp.t1, ff0 + kSub);
        if (far > 0 && ff0 < ff1) {
          PrefetchRows<true>(map, ff0, ff1, kv.k, row_bytes);
          PrefetchRows<true>(map, ff0, ff1, kv.v, row_bytes);
        }
        for (int h = 0; h < Hkv; ++h) {
          ScoreRows(*cx.ops, paired, q + int64_t{h} * G * d, paired ? qp + int64_t{h} * G * d : nullptr,
                    G, d, krows + h * kTile + u, elem, n, p.scale, sbuf + int64_t{h} * G * kTile + u);
        }
      }
      // V per head over the tile; its rows were prefetched with K's, so they come
      // from cache. (Prefetching V instead while the previous tile accumulated, in
      // chunks of 16 tokens, measured ~25% slower for llama-70b-tp8.)
      for (int h = 0; h < Hkv; ++h) {
        const SoftmaxRows st{G, d, all.m + h * G, all.l + h * G, all.acc + int64_t{h} * G * d};
        FoldTileAny(*cx.ops, paired, st, T, sbuf + int64_t{h} * G * kTile, vrows + h * kTile, elem);
      }
    }
    scr.split.Finish(*cx.ops, paired, all, &ws_m[si * Hq], &ws_l[si * Hq], &ws_acc[si * Hq * d]);
  });
  MergeSplits(cx, first, p.table.batch, Hq, d, ws_m, ws_l, ws_acc, p.out);
}

void CpuMlaDecodeAbsorbed(const CpuContext& cx, const MlaDecodeParams& p) {
  const MlaPagedKv& kv = p.kv;
  const int entry = kv.EntryDim(), rank = kv.kv_lora_rank, H = p.num_heads;
  const size_t esz = ElementBytes(kv.dtype);
  const Elem elem = ElemOf(kv.dtype);
  std::vector<int> first;
  const std::vector<Split> splits = MakeSplits(p.table, kMlaSplitTokens, &first);
  std::vector<float> ws_m(splits.size() * H), ws_l(splits.size() * H),
      ws_acc(splits.size() * H * rank);
  const bool paired = UsePaired(*cx.ops, elem, entry, rank);
  cx.pool->ParallelFor(static_cast<int64_t>(splits.size()), [&](int64_t si) {
    const Split& sp = splits[si];
    const int32_t* row = p.table.block_table + int64_t{sp.b} * p.table.max_blocks;
    Scratch& scr = ThreadScratch();
    const SoftmaxRows st = scr.split.Start(H, rank);
    scr.s.resize(static_cast<size_t>(kTile) * H);
    float* s = scr.s.data();
    const SlotMap map(row, kv.page_size);
    const size_t row_bytes = static_cast<size_t>(entry) * esz;
    const float* q = p.q + int64_t{sp.b} * H * entry;
    const float* qp = nullptr;
    if (paired) {
      scr.qp.resize(static_cast<size_t>(H) * entry);
      cx.ops->pair16(q, scr.qp.data(), H * entry);  // rows of 576 = 36 x 16 = 18 x 32
      qp = scr.qp.data();
    }
    const int sub = SubTokens(paired, H);
    const void* rows[kTile];
    for (int t0 = sp.t0; t0 < sp.t1; t0 += kTile) {
      const int T = std::min(kTile, sp.t1 - t0);
      for (int t = 0; t < T; ++t) rows[t] = static_cast<const char*>(kv.entries) + map(t0 + t) * row_bytes;
      // Entries are 1152 bytes (bf16, 18 lines): prefetch kMlaAhead tokens ahead, `sub`
      // tokens at a time.
      for (int u = 0; u < T; u += sub) {
        const int n = std::min(sub, T - u);
        const int pf0 = t0 + u + kMlaAhead, pf1 = std::min(sp.t1, pf0 + sub);
        if (pf0 < pf1) PrefetchRows(map, pf0, pf1, kv.entries, row_bytes);
        ScoreRows(*cx.ops, paired, q, qp, H, entry, rows + u, elem, n, p.scale, s + u);
      }
      // V = the first 512 of each entry; paired blocks of the latent are the entry's.
      FoldTileAny(*cx.ops, paired, st, T, s, rows, elem);
    }
    scr.split.Finish(*cx.ops, paired, st, &ws_m[si * H], &ws_l[si * H], &ws_acc[si * H * rank]);
  });
  MergeSplits(cx, first, p.table.batch, H, rank, ws_m, ws_l, ws_acc, p.out);
}

namespace {

// Causal attention of a block of `nq` queries (at cache positions pos0 .. pos0+nq-1)
// with R = nq * G rows (row r = query r / G, head r % G) over K/V rows given by
// row_of(t) -> {k, v} pointers. q_rows: [R][dk], out_rows[r] -> [dv].
template <typename RowsFn>
void CausalBlock(const SimdOps& ops, const float* q_rows, int nq, int G, int dk, int dv,
                 int pos0, float scale, Elem elem, RowsFn rows_of, float* const* out_rows) {
  const int R = nq * G;
  std::vector<float> m(R), l(R), acc(static_cast<size_t>(R) * dv), s(static_cast<size_t>(R) * kTile);
  const SoftmaxRows st{R, dv, m.data(), l.data(), acc.data()};
  st.Reset();
  const void* krows[kTile];
  const void* vrows[kTile];
  const int end = pos0 + nq;  // tokens any row of the block sees
  for (int t0 = 0; t0 < end; t0 += kTile) {
    const int T = std::min(kTile, end - t0);
    rows_of(t0, T, krows, vrows);
    ops.score(q_rows, R, dk, krows, elem, T, scale, s.data(), kTile);
    if (t0 + T > pos0) {  // the tile reaches the diagonal: mask the future
      for (int r = 0; r < R; ++r) {
        const int limit = pos0 + r / G;  // last visible position
        for (int t = std::max(0, limit + 1 - t0); t < T; ++t) s[static_cast<size_t>(r) * kTile + t] = kNegInf;
      }
    }
    FoldTile(ops, st, T, s.data(), vrows, elem);
  }
  for (int r = 0; r < R; ++r) {
    const float inv = 1.f / l[r];  // l > 0: every query sees at least itself
    for (int j = 0; j < dv; ++j) out_rows[r][j] = acc[static_cast<size_t>(r) * dv + j] * inv;
  }
}

constexpr int kQueryBlock = 16;

struct QueryBlock {
  int b, head, i0, n;  // sequence, head (kv head or MLA head), first query, count
};

std::vector<QueryBlock> MakeQueryBlocks(const BlockTable& t, const int32_t* q_indptr, int heads) {
  std::vector<QueryBlock> blocks;
  for (int b = 0; b < t.batch; ++b) {
    const int q_len = q_indptr[b + 1] - q_indptr[b];
    for (int h = 0; h < heads; ++h) {
      for (int i0 = 0; i0 < q_len; i0 += kQueryBlock) {
        blocks.push_back({b, h, i0, std::min(kQueryBlock, q_len - i0)});
      }
    }
  }
  return blocks;
}

}  // namespace

void CpuGqaPrefill(const CpuContext& cx, const GqaPrefillParams& p) {
  const GqaPagedKv& kv = p.kv;
  const int d = kv.head_dim, Hkv = kv.num_kv_heads, Hq = p.num_q_heads, G = Hq / Hkv;
  const int64_t token_stride = int64_t{Hkv} * d;
  const size_t esz = ElementBytes(kv.dtype);
  const std::vector<QueryBlock> blocks = MakeQueryBlocks(p.table, p.q_indptr, Hkv);
  cx.pool->ParallelFor(static_cast<int64_t>(blocks.size()), [&](int64_t bi) {
    const QueryBlock& qb = blocks[bi];
    const int32_t* row = p.table.block_table + int64_t{qb.b} * p.table.max_blocks;
    const int q_len = p.q_indptr[qb.b + 1] - p.q_indptr[qb.b];
    const int pos0 = p.table.seq_lens[qb.b] - q_len + qb.i0;
    std::vector<float> q_rows(static_cast<size_t>(qb.n) * G * d);
    std::vector<float*> out_rows(static_cast<size_t>(qb.n) * G);
    for (int i = 0; i < qb.n; ++i) {
      for (int g = 0; g < G; ++g) {
        const int64_t at = (int64_t{p.q_indptr[qb.b] + qb.i0 + i} * Hq + qb.head * G + g) * d;
        std::memcpy(&q_rows[(static_cast<size_t>(i) * G + g) * d], p.q + at, d * sizeof(float));
        out_rows[static_cast<size_t>(i) * G + g] = p.out + at;
      }
    }
    int64_t off[kTile];
    auto rows_of = [&](int t0, int T, const void** krows, const void** vrows) {
      SlotOffsets(row, kv.page_size, token_stride, t0, T, off);
      for (int t = 0; t < T; ++t) {
        krows[t] = static_cast<const char*>(kv.k) + (off[t] + int64_t{qb.head} * d) * esz;
        vrows[t] = static_cast<const char*>(kv.v) + (off[t] + int64_t{qb.head} * d) * esz;
      }
    };
    CausalBlock(*cx.ops, q_rows.data(), qb.n, G, d, d, pos0, p.scale, ElemOf(kv.dtype), rows_of,
                out_rows.data());
  });
}

void CpuMlaMaterialized(const CpuContext& cx, const MlaMaterializedParams& p) {
  const MlaPagedKv& kv = p.kv;
  const int entry = kv.EntryDim(), rank = kv.kv_lora_rank, rope = kv.rope_dim;
  const int nope = p.qk_nope_dim, dv = p.v_head_dim, H = p.num_heads, dk = nope + rope;
  // Items (sequence, head): up-project the head's K and V once, then run its queries.
  struct Item {
    int b, h;
  };
  std::vector<Item> items;
  for (int b = 0; b < p.table.batch; ++b) {
    if (p.q_indptr[b + 1] == p.q_indptr[b]) continue;
    for (int h = 0; h < H; ++h) items.push_back({b, h});
  }
  cx.pool->ParallelFor(static_cast<int64_t>(items.size()), [&](int64_t ii) {
    const auto [b, h] = items[ii];
    const int32_t* row = p.table.block_table + int64_t{b} * p.table.max_blocks;
    const int n = p.table.seq_lens[b], q_len = p.q_indptr[b + 1] - p.q_indptr[b];
    std::vector<float> K(static_cast<size_t>(n) * dk), V(static_cast<size_t>(n) * dv), c(entry);
    const float* wk = p.w_uk + int64_t{h} * nope * rank;
    const float* wv = p.w_uv + int64_t{h} * dv * rank;
    for (int t = 0; t < n; ++t) {
      const int64_t slot = int64_t{row[t / kv.page_size]} * kv.page_size + t % kv.page_size;
      for (int i = 0; i < entry; ++i) c[i] = LoadAsFloat(kv.entries, kv.dtype, slot * entry + i);
      float* kt = &K[static_cast<size_t>(t) * dk];
      for (int j = 0; j < nope; ++j) kt[j] = cx.ops->dot(wk + int64_t{j} * rank, c.data(), rank);
      std::memcpy(kt + nope, c.data() + rank, rope * sizeof(float));
      for (int j = 0; j < dv; ++j) {
        V[static_cast<size_t>(t) * dv + j] = cx.ops->dot(wv + int64_t{j} * rank, c.data(), rank);
      }
    }
    auto rows_of = [&](int t0, int T, const void** krows, const void** vrows) {
      for (int t = 0; t < T; ++t) {
        krows[t] = &K[static_cast<size_t>(t0 + t) * dk];
        vrows[t] = &V[static_cast<size_t>(t0 + t) * dv];
      }
    };
    std::vector<float> q_rows(static_cast<size_t>(kQueryBlock) * dk);
    std::vector<float*> out_rows(kQueryBlock);
    for (int i0 = 0; i0 < q_len; i0 += kQueryBlock) {
      const int nq = std::min(kQueryBlock, q_len - i0);
      for (int i = 0; i < nq; ++i) {
        const int64_t qi = int64_t{p.q_indptr[b] + i0 + i} * H + h;
        std::memcpy(&q_rows[static_cast<size_t>(i) * dk], p.q_nope + qi * nope, nope * sizeof(float));
        std::memcpy(&q_rows[static_cast<size_t>(i) * dk + nope], p.q_rope + qi * rope, rope * sizeof(float));
        out_rows[i] = p.out + qi * dv;
      }
      CausalBlock(*cx.ops, q_rows.data(), nq, 1, dk, dv, n - q_len + i0, p.scale, Elem::kF32,
                  rows_of, out_rows.data());
    }
  });
}

}  // namespace kvpool::kernels::internal
