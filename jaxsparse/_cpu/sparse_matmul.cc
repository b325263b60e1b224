// CPU kernels for unstructured sparse products, registered with XLA as FFI custom calls.
//
// y = x @ W with W (K, N) sparse and x (B, K) dense, float32. The batch is the vector dimension: x
// and dY are transposed once per call to (K, Bp) and (N, Bp) (Bp = B rounded up to 8, zero padded),
// stored as 64-wide batch tiles, so each nonzero w[k, o] becomes an axpy of one contiguous 256-byte
// row, accumulated in eight AVX registers. The three products of a training step are
//   forward  yT[o, :]  = sum_{k in col o} w[k, o] * xT[k, :]     (per output column, CSC order)
//   dX       dxT[k, :] = sum_{o in row k} w[k, o] * dyT[o, :]    (per input row, CSR order)
//   dW       dw[k, o]  = dot(xT[k, :], dyT[o, :])                (one dot per nonzero, CSR order)
// so the work is proportional to the nonzeros; dX and dW share one pass over the dyT rows (the CSR kernels that
// walk the entries in row order instead, for a few rows and the dense route, are in csr_rows.cc). The rows
// being gathered (of xT or dyT) are walked in blocks of rows so that a block of a tile stays in
// cache while every column (or row) of a chunk takes its nonzeros from it: kBlockRows (256 KiB, L2)
// for the backward; for the forward, ForwardBlockRows of the pattern's density, down to kFineRows
// (32 KiB, L1) for dense-ish patterns, where each column still finds ~64 entries per block. Chunks of
// columns (forward) or rows (backward) are handed out dynamically to the calling thread and the
// threads of XLA's intra-op pool. Portable C++ with GCC/Clang vector extensions (16-float vectors in
// the forward's axpy, which compile to AVX-512 where the CPU has it, else to pairs of 8); AVX2
// intrinsics only for transposes and mask scans, with scalar fallbacks.
//
// Two front ends share the kernels:
//   * masked: W is a dense (K, N) array plus a bool mask. Each work item finds the kept entries of
//     its chunk by scanning the mask (32 bytes per AVX2 compare), so the mask may change freely
//     between calls at no extra cost. The weight gradient is dense, zero outside the mask. The forward
//     runs dense-ish masks (and products of at most kFewRows rows) on packed_gemm.cc's GEMM instead,
//     chosen in the call from a sampled density (MaskedForward).
//   * csr: W is given by its nonzero values in row-major order plus CSR index arrays for the rows and
//     for the columns (built once per pattern); everything is O(nnz).

#include "common.h"

namespace {

constexpr int64_t kTile = 64;          // batch entries per register tile (four 16-float or eight 8-float accumulators)
constexpr int64_t kBlockRows = 1024;   // gathered rows per cache block: 1024 x 64 floats = 256 KiB (L2)
constexpr int64_t kFineRows = 128;     // the forward's smallest block: 128 x 64 floats = 32 KiB (L1)
constexpr int64_t kColChunk = 256;     // output columns per forward work item, at most (ForwardColChunk)
constexpr int64_t kRowChunk = 128;     // input rows per backward work item
constexpr int64_t kPrefetchRows = 4;   // mask / weight rows read ahead in the forward scan
constexpr int64_t kGatherAhead = 32;   // entries prefetched ahead in random gathers
constexpr int64_t kTransposeChunk = 64;

// Per-thread scratch, reused across calls (pool threads live as long as the process).
struct Scratch {
  std::vector<int32_t> idx, counts, seg, pos;
  std::vector<float> val, out, dots, row;
};
Scratch& ThreadScratch() {
  thread_local Scratch s;
  return s;
}

// ------------------------------------------------------------------------------------------------
// Transposed, batch-tiled operands.
// ------------------------------------------------------------------------------------------------

// A (rows, bp) matrix stored as column tiles: tile t holds columns [64 t, 64 t + width(t)) as a
// row-major (rows, width(t)) block, so the rows of one tile are contiguous and 256 bytes apart.
struct Tiled {
  float* data = nullptr;
  int64_t rows = 0, bp = 0;
  int64_t tiles() const { return CeilDiv(bp, kTile); }
  int64_t width(int64_t t) const { return std::min(kTile, bp - t * kTile); }
  const float* tile(int64_t t) const { return data + t * kTile * rows; }
};

// src (b, d) row-major -> its transpose (d, bp) as tiles in buffer `slot`, zero padded to
// bp = b rounded up to 8.
Tiled TransposeTiled(const Scheduler& pool, const float* src, int64_t b, int64_t d, int slot) {
  Tiled out;
  out.rows = d;
  out.bp = RoundUp(b, kLanes);
  out.data = CachedBuffer(slot, d * out.bp);
  ParallelFor(pool, CeilDiv(d, kTransposeChunk), [&](int64_t i) {
    const int64_t d0 = i * kTransposeChunk, dn = std::min(kTransposeChunk, d - d0);
    for (int64_t t = 0; t < out.tiles(); ++t) {
      const int64_t b0 = t * kTile, tw = out.width(t), valid = std::min(tw, b - b0);
      float* dst = out.data + t * kTile * d + d0 * tw;
      Transpose(src + b0 * d + d0, valid, dn, d, dst, tw);
      if (valid < tw) {
        for (int64_t c = 0; c < dn; ++c) std::memset(dst + c * tw + valid, 0, (tw - valid) * sizeof(float));
      }
    }
  });
  return out;
}

// ------------------------------------------------------------------------------------------------
// Micro-kernels.
// ------------------------------------------------------------------------------------------------

typedef float v16 __attribute__((vector_size(64)));

inline v16 Load16(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline void Store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// out[0 : 8 NV] (+)= sum_j val[j] * base[idx[j] * ld + 0 : 8 NV]. An even NV runs as NV / 2 vectors of 16:
// one 512-bit load and FMA per 16 floats on AVX-512 (0.6-0.8x the time of 8-float vectors, 2-core Xeon).
template <int NV>
inline void AxpyTile(const int32_t* idx, const float* val, int64_t n, const float* base, int64_t ld, float* out,
                     bool accumulate) {
  if constexpr (NV % 2 == 0) {
    constexpr int kWide = NV / 2;
    v16 acc[kWide];
    for (int i = 0; i < kWide; ++i) acc[i] = accumulate ? Load16(out + 16 * i) : v16{};
    for (int64_t j = 0; j < n; ++j) {
      const float* row = base + static_cast<int64_t>(idx[j]) * ld;
      const v16 v = v16{} + val[j];
      for (int i = 0; i < kWide; ++i) acc[i] += v * Load16(row + 16 * i);
    }
    for (int i = 0; i < kWide; ++i) Store16(out + 16 * i, acc[i]);
  } else {
    v8 acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = accumulate ? Load8(out + kLanes * i) : v8{};
    for (int64_t j = 0; j < n; ++j) {
      const float* row = base + static_cast<int64_t>(idx[j]) * ld;
      const v8 v = Splat8(val[j]);
      for (int i = 0; i < NV; ++i) acc[i] += v * Load8(row + kLanes * i);
    }
    for (int i = 0; i < NV; ++i) Store8(out + kLanes * i, acc[i]);
  }
}

inline void AxpyTileN(int64_t nv, const int32_t* idx, const float* val, int64_t n, const float* base, int64_t ld,
                      float* out, bool accumulate) {
  switch (nv) {
    case 8: return AxpyTile<8>(idx, val, n, base, ld, out, accumulate);
    case 7: return AxpyTile<7>(idx, val, n, base, ld, out, accumulate);
    case 6: return AxpyTile<6>(idx, val, n, base, ld, out, accumulate);
    case 5: return AxpyTile<5>(idx, val, n, base, ld, out, accumulate);
    case 4: return AxpyTile<4>(idx, val, n, base, ld, out, accumulate);
    case 3: return AxpyTile<3>(idx, val, n, base, ld, out, accumulate);
    case 2: return AxpyTile<2>(idx, val, n, base, ld, out, accumulate);
    default: return AxpyTile<1>(idx, val, n, base, ld, out, accumulate);
  }
}

inline float Sum8(v8 a) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += a[l];
  return s;
}

// The two backward products over the same gathered rows in one pass, so each row tile is read
// once: out[0 : 8 NV] (+)= sum_j val[j] * row_j and dots[j] += dot(x[0 : 8 NV], row_j), where
// row_j = base[idx[j] * ld + 0 : 8 NV]. Two nonzeros per step, each dot over two accumulators,
// keep enough independent FMA chains in flight.
template <int NV>
inline void AxpyDotsTile(const int32_t* idx, const float* val, int64_t n, const float* base, int64_t ld,
                         const float* x, float* out, bool accumulate, float* dots) {
  v8 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = accumulate ? Load8(out + kLanes * i) : v8{};
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const float* r0 = base + static_cast<int64_t>(idx[j]) * ld;
    const float* r1 = base + static_cast<int64_t>(idx[j + 1]) * ld;
    const v8 v0 = Splat8(val[j]), v1 = Splat8(val[j + 1]);
    v8 d0[2] = {v8{}, v8{}}, d1[2] = {v8{}, v8{}};
    for (int i = 0; i < NV; ++i) {
      const v8 a = Load8(r0 + kLanes * i), b = Load8(r1 + kLanes * i), xv = Load8(x + kLanes * i);
      acc[i] += v0 * a;
      acc[i] += v1 * b;
      d0[i & 1] += xv * a;
      d1[i & 1] += xv * b;
    }
    dots[j] += Sum8(d0[0] + d0[1]);
    dots[j + 1] += Sum8(d1[0] + d1[1]);
  }
  if (j < n) {
    const float* r0 = base + static_cast<int64_t>(idx[j]) * ld;
    const v8 v0 = Splat8(val[j]);
    v8 d0[2] = {v8{}, v8{}};
    for (int i = 0; i < NV; ++i) {
      const v8 a = Load8(r0 + kLanes * i);
      acc[i] += v0 * a;
      d0[i & 1] += Load8(x + kLanes * i) * a;
    }
    dots[j] += Sum8(d0[0] + d0[1]);
  }
  for (int i = 0; i < NV; ++i) Store8(out + kLanes * i, acc[i]);
}

inline void AxpyDotsTileN(int64_t nv, const int32_t* idx, const float* val, int64_t n, const float* base, int64_t ld,
                          const float* x, float* out, bool accumulate, float* dots) {
  switch (nv) {
    case 8: return AxpyDotsTile<8>(idx, val, n, base, ld, x, out, accumulate, dots);
    case 7: return AxpyDotsTile<7>(idx, val, n, base, ld, x, out, accumulate, dots);
    case 6: return AxpyDotsTile<6>(idx, val, n, base, ld, x, out, accumulate, dots);
    case 5: return AxpyDotsTile<5>(idx, val, n, base, ld, x, out, accumulate, dots);
    case 4: return AxpyDotsTile<4>(idx, val, n, base, ld, x, out, accumulate, dots);
    case 3: return AxpyDotsTile<3>(idx, val, n, base, ld, x, out, accumulate, dots);
    case 2: return AxpyDotsTile<2>(idx, val, n, base, ld, x, out, accumulate, dots);
    default: return AxpyDotsTile<1>(idx, val, n, base, ld, x, out, accumulate, dots);
  }
}

// Bit c of the result is set when m[c] is true, c < n <= 64.
inline uint64_t MaskBits(const bool* m, int64_t n) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(m);
  uint64_t bits = 0;
  int64_t c = 0;
#if defined(__AVX2__)
  const __m256i zero = _mm256_setzero_si256();
  for (; c + 32 <= n; c += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c));
    const uint32_t nz = ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, zero)));
    bits |= static_cast<uint64_t>(nz) << c;
  }
#endif
  for (; c < n; ++c) bits |= static_cast<uint64_t>(p[c] != 0) << c;
  return bits;
}

// Splits the entries of each line (column or row) of a chunk by block of `rows` gathered indices:
// seg[i * nblocks + blk] is where line i's entries with idx in block blk start (relative to
// line_start[0]); entries must be sorted by idx within a line for the blocks to be exact, but every
// entry lands in exactly one segment either way, so unsorted input is still computed correctly.
void Segment(const int32_t* line_start, int64_t lines, const int32_t* idx, int64_t nblocks, int64_t rows,
             std::vector<int32_t>& seg) {
  Resize(seg, lines * nblocks + 1);
  const int32_t base = line_start[0];
  for (int64_t i = 0; i < lines; ++i) {
    int32_t p = line_start[i] - base;
    const int32_t end = line_start[i + 1] - base;
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      seg[i * nblocks + blk] = p;
      const int64_t limit = (blk + 1) * rows;
      while (p < end && idx[p] < limit) ++p;
    }
  }
  seg[lines * nblocks] = line_start[lines] - base;
}

// ------------------------------------------------------------------------------------------------
// The blocked products over one chunk.
// ------------------------------------------------------------------------------------------------

// Gathered rows per block in the forward for a pattern of the given density: ~64 entries of a column per
// block, between kFineRows (an L1-sized block, dense-ish patterns) and kBlockRows (L2, sparse ones). Measured
// on the 2-core Xeon (CSR forward, one thread, 256 x 2048 x 1536, medians of 5 alternating runs, time against
// 1024 rows): density 0.5, 128 rows 0.67-0.8x; density 0.25, 256 rows 0.54-0.7x; density 0.05-0.1, no block
// size faster than 1024 beyond the noise (+-15%).
inline int64_t ForwardBlockRows(double density) {
  const double rows = density > 0 ? 64.0 / density : static_cast<double>(kBlockRows);
  return std::clamp<int64_t>(RoundUp(static_cast<int64_t>(rows), kFineRows), kFineRows, kBlockRows);
}

// Output columns per forward work item: kColChunk, or fewer so that every thread gets about four items (an N
// of 256 was one item, so one thread, and took 1.4-2.9x the dense product's time at 50-80% sparsity).
inline int64_t ForwardColChunk(int64_t n) {
  return std::clamp<int64_t>(RoundUp(CeilDiv(n, 4 * NumWorkers()), 32), 32, kColChunk);
}

// Columns [c0, c0 + cn) of y (b, ld_y) from xT: column j's entries in gathered-row block blk are
// idx/val[seg[j * nblocks + blk] : seg[j * nblocks + blk + 1]].
void ForwardChunk(const Tiled& xT, int64_t b, const int32_t* idx, const float* val, const int32_t* seg,
                  int64_t nblocks, int64_t cn, float* y, int64_t ld_y, Scratch& s) {
  Resize(s.out, cn * kTile);
  float* out = s.out.data();
  for (int64_t t = 0; t < xT.tiles(); ++t) {
    const int64_t tw = xT.width(t), nv = tw / kLanes, b0 = t * kTile;
    const float* base = xT.tile(t);
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      for (int64_t j = 0; j < cn; ++j) {
        const int32_t e0 = seg[j * nblocks + blk], e1 = seg[j * nblocks + blk + 1];
        if (blk == 0 || e1 > e0) AxpyTileN(nv, idx + e0, val + e0, e1 - e0, base, tw, out + j * tw, blk > 0);
      }
    }
    Transpose(out, cn, std::min(tw, b - b0), tw, y + b0 * ld_y, ld_y);
  }
}

// Rows [r0, r0 + rn) of dx (b, ld_dx) from dyT, and dots[e] = dot(xT[row of e], dyT[idx[e]]) for the
// chunk's entries, in one pass over the gathered dyT rows; row i's entries in gathered-row block
// blk are [seg[i * nblocks + blk], seg[i * nblocks + blk + 1]).
void BackwardChunk(const Tiled& xT, const Tiled& dyT, int64_t b, int64_t r0, const int32_t* idx, const float* val,
                   const int32_t* seg, int64_t nblocks, int64_t rn, float* dx, int64_t ld_dx, float* dots,
                   Scratch& s) {
  Resize(s.out, rn * kTile);
  float* out = s.out.data();
  std::fill(dots, dots + seg[rn * nblocks], 0.f);
  for (int64_t t = 0; t < dyT.tiles(); ++t) {
    const int64_t tw = dyT.width(t), nv = tw / kLanes, b0 = t * kTile;
    const float* ybase = dyT.tile(t);
    const float* xbase = xT.tile(t);
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      for (int64_t i = 0; i < rn; ++i) {
        const int32_t e0 = seg[i * nblocks + blk], e1 = seg[i * nblocks + blk + 1];
        if (blk == 0 || e1 > e0) {
          AxpyDotsTileN(nv, idx + e0, val + e0, e1 - e0, ybase, tw, xbase + (r0 + i) * tw, out + i * tw, blk > 0,
                        dots + e0);
        }
      }
    }
    Transpose(out, rn, std::min(tw, b - b0), tw, dx + b0 * ld_dx + r0, ld_dx);
  }
}

// ------------------------------------------------------------------------------------------------
// Masked front end: W dense (K, N) plus a bool mask (K, N), all row-major.
// ------------------------------------------------------------------------------------------------

// y (b, n) = x (b, k) @ where(mask, w, 0).
void MaskedForwardKernel(const Scheduler& pool, const float* x, const float* w, const bool* mask, int64_t b,
                         int64_t k, int64_t n, float* y) {
  if (b == 0 || n == 0) return;
  const Tiled xT = TransposeTiled(pool, x, b, k, 0);
  const int64_t nfine = std::max<int64_t>(1, CeilDiv(k, kFineRows));
  const int64_t col_chunk = ForwardColChunk(n);
  ParallelFor(pool, CeilDiv(n, col_chunk), [&](int64_t chunk) {
    Scratch& s = ThreadScratch();
    const int64_t c0 = chunk * col_chunk, cn = std::min(col_chunk, n - c0);
    // Count the kept entries per (fine row block, column); the chunk's density then sets the row blocks
    // (whole numbers of fine ones), and the entries are bucketed by (column, row block).
    Resize(s.counts, nfine * cn);
    std::fill(s.counts.begin(), s.counts.end(), 0);
    int64_t kept = 0;
    for (int64_t r = 0; r < k; ++r) {
      const uint8_t* m = reinterpret_cast<const uint8_t*>(mask + r * n + c0);
      // Rows are n bytes apart, beyond what the hardware prefetcher follows.
      if (r + 4 * kPrefetchRows < k) {
        for (int64_t q = 0; q < cn; q += 64) __builtin_prefetch(m + 4 * kPrefetchRows * n + q);
      }
      int32_t* cnt = s.counts.data() + (r / kFineRows) * cn;
      // A mask byte is kept when nonzero, as MaskBits reads it below: a bool array viewed from other
      // bytes (e.g. 255) must count as many entries as the fill writes, or the chunk reads stale scratch.
      for (int64_t j = 0; j < cn; ++j) cnt[j] += m[j] != 0;
    }
    for (int64_t i = 0; i < nfine * cn; ++i) kept += s.counts[i];
    const int64_t rows = ForwardBlockRows(static_cast<double>(kept) / static_cast<double>(k * cn));
    const int64_t per = rows / kFineRows, nblocks = CeilDiv(nfine, per);
    Resize(s.seg, cn * nblocks + 1);
    int32_t total = 0;
    for (int64_t j = 0; j < cn; ++j) {
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        s.seg[j * nblocks + blk] = total;
        for (int64_t f = blk * per; f < std::min(nfine, (blk + 1) * per); ++f) total += s.counts[f * cn + j];
      }
    }
    s.seg[cn * nblocks] = total;
    Resize(s.pos, cn * nblocks);
    std::copy(s.seg.begin(), s.seg.end() - 1, s.pos.begin());
    Resize(s.idx, total + 1);
    Resize(s.val, total + 1);
    for (int64_t r = 0; r < k; ++r) {
      const bool* m = mask + r * n + c0;
      const float* wr = w + r * n + c0;
      if (r + kPrefetchRows < k) {
        for (int64_t q = 0; q < cn; q += 64) __builtin_prefetch(m + kPrefetchRows * n + q);
        for (int64_t q = 0; q < cn; q += 16) __builtin_prefetch(wr + kPrefetchRows * n + q);
      }
      int32_t* pos = s.pos.data() + r / rows;
      for (int64_t q = 0; q < cn; q += 64) {
        uint64_t bits = MaskBits(m + q, std::min<int64_t>(64, cn - q));
        while (bits) {
          const int64_t j = q + __builtin_ctzll(bits);
          bits &= bits - 1;
          const int32_t p = pos[j * nblocks]++;
          s.idx[p] = static_cast<int32_t>(r);
          s.val[p] = wr[j];
        }
      }
    }
    ForwardChunk(xT, b, s.idx.data(), s.val.data(), s.seg.data(), nblocks, cn, y + c0, n, s);
  });
}

// dx (b, k) = dy (b, n) @ where(mask, w, 0).T; dw (k, n) = where(mask, x.T @ dy, 0).
void MaskedBackwardKernel(const Scheduler& pool, const float* x, const float* w, const bool* mask, const float* dy,
                          int64_t b, int64_t k, int64_t n, float* dx, float* dw) {
  if (k == 0) return;
  if (b == 0 || n == 0) {
    std::memset(dw, 0, sizeof(float) * k * n);
    std::memset(dx, 0, sizeof(float) * b * k);
    return;
  }
  AdviseHugePages(dw, k * n * static_cast<int64_t>(sizeof(float)));
  const Tiled xT = TransposeTiled(pool, x, b, k, 0);
  const Tiled dyT = TransposeTiled(pool, dy, b, n, 1);
  const int64_t nblocks = std::max<int64_t>(1, CeilDiv(n, kBlockRows));
  ParallelFor(pool, CeilDiv(k, kRowChunk), [&](int64_t chunk) {
    Scratch& s = ThreadScratch();
    const int64_t r0 = chunk * kRowChunk, rn = std::min(kRowChunk, k - r0);
    // The kept entries of the chunk's rows, in row-major order.
    Resize(s.counts, rn + 1);
    Resize(s.idx, rn * n + 1);
    Resize(s.val, rn * n + 1);
    int32_t total = 0;
    for (int64_t i = 0; i < rn; ++i) {
      s.counts[i] = total;
      const bool* m = mask + (r0 + i) * n;
      const float* wr = w + (r0 + i) * n;
      for (int64_t c0 = 0; c0 < n; c0 += 64) {
        uint64_t bits = MaskBits(m + c0, std::min<int64_t>(64, n - c0));
        while (bits) {
          const int64_t c = c0 + __builtin_ctzll(bits);
          bits &= bits - 1;
          s.idx[total] = static_cast<int32_t>(c);
          s.val[total] = wr[c];
          ++total;
        }
      }
    }
    s.counts[rn] = total;
    Segment(s.counts.data(), rn, s.idx.data(), nblocks, kBlockRows, s.seg);
    Resize(s.dots, total + 1);
    BackwardChunk(xT, dyT, b, r0, s.idx.data(), s.val.data(), s.seg.data(), nblocks, rn, dx, k, s.dots.data(), s);
    Resize(s.row, n);
    std::fill(s.row.begin(), s.row.end(), 0.f);
    for (int64_t i = 0; i < rn; ++i) {
      for (int32_t e = s.counts[i]; e < s.counts[i + 1]; ++e) s.row[s.idx[e]] = s.dots[e];
      StreamCopy(dw + (r0 + i) * n, s.row.data(), n);
      for (int32_t e = s.counts[i]; e < s.counts[i + 1]; ++e) s.row[s.idx[e]] = 0.f;
    }
    StreamFence();
  });
}

// ------------------------------------------------------------------------------------------------
// CSR front end, the layout of jaxsparse.CSRMatrix: data (nnz,) in row-major order with col_indices
// (nnz,) (the column of each value) and row_offsets (k + 1,) (CSR offsets); col_offsets (n + 1,)
// delimit each column's entries in transpose_order (nnz,), the positions in `data` in column-major
// order, and in transpose_row_indices (nnz,), their rows.
// ------------------------------------------------------------------------------------------------

// y (b, n) = x (b, k) @ W. Returns an error message for invalid index arrays, else "".
std::string CsrForwardKernel(const Scheduler& pool, const float* x, const float* data, const int32_t* col_offsets,
                             const int32_t* transpose_order, const int32_t* transpose_row_indices, int64_t b,
                             int64_t k, int64_t n, int64_t nnz, float* y) {
  if (!ValidOffsets(col_offsets, n, nnz)) return "col_offsets is not an offset array for nnz=" + std::to_string(nnz);
  if (!InRange(transpose_row_indices, nnz, k)) {
    return "transpose_row_indices has entries outside [0, " + std::to_string(k) + ")";
  }
  if (!InRange(transpose_order, nnz, nnz)) {
    return "transpose_order has entries outside [0, " + std::to_string(nnz) + ")";
  }
  if (b == 0 || n == 0) return "";
  const Tiled xT = TransposeTiled(pool, x, b, k, 0);
  const double density = static_cast<double>(nnz) / (static_cast<double>(k) * static_cast<double>(n));
  const int64_t rows = ForwardBlockRows(density);
  const int64_t nblocks = std::max<int64_t>(1, CeilDiv(k, rows));
  const int64_t col_chunk = ForwardColChunk(n);
  ParallelFor(pool, CeilDiv(n, col_chunk), [&](int64_t chunk) {
    Scratch& s = ThreadScratch();
    const int64_t c0 = chunk * col_chunk, cn = std::min(col_chunk, n - c0);
    const int32_t start = col_offsets[c0];
    const int64_t total = col_offsets[c0 + cn] - start;
    Resize(s.val, total + 1);
    const int32_t* order = transpose_order + start;
    for (int64_t e = 0; e < total; ++e) {
      // Random reads of an nnz-long array: fetch a few dozen entries ahead.
      if (e + kGatherAhead < total) __builtin_prefetch(data + order[e + kGatherAhead]);
      s.val[e] = data[order[e]];
    }
    const int32_t* row_idx = transpose_row_indices + start;
    Segment(col_offsets + c0, cn, row_idx, nblocks, rows, s.seg);
    ForwardChunk(xT, b, row_idx, s.val.data(), s.seg.data(), nblocks, cn, y + c0, n, s);
  });
  return "";
}

std::string CsrBackwardKernel(const Scheduler& pool, const float* x, const float* data, const int32_t* row_offsets,
                              const int32_t* col_indices, const float* dy, int64_t b, int64_t k, int64_t n, int64_t nnz,
                              float* dx, float* ddata) {
  if (!ValidOffsets(row_offsets, k, nnz)) return "row_offsets is not an offset array for nnz=" + std::to_string(nnz);
  if (!RowsIncreasingInRange(row_offsets, col_indices, 0, k, n)) {
    return RowColumnsError(row_offsets, col_indices, 0, k, n);
  }
  if (k == 0) return "";
  if (b == 0 || n == 0) {
    std::memset(ddata, 0, sizeof(float) * nnz);
    std::memset(dx, 0, sizeof(float) * b * k);
    return "";
  }
  const Tiled xT = TransposeTiled(pool, x, b, k, 0);
  const Tiled dyT = TransposeTiled(pool, dy, b, n, 1);
  const int64_t nblocks = std::max<int64_t>(1, CeilDiv(n, kBlockRows));
  ParallelFor(pool, CeilDiv(k, kRowChunk), [&](int64_t chunk) {
    Scratch& s = ThreadScratch();
    const int64_t r0 = chunk * kRowChunk, rn = std::min(kRowChunk, k - r0);
    const int32_t start = row_offsets[r0];
    Segment(row_offsets + r0, rn, col_indices + start, nblocks, kBlockRows, s.seg);
    BackwardChunk(xT, dyT, b, r0, col_indices + start, data + start, s.seg.data(), nblocks, rn, dx, k,
                  ddata + start, s);
  });
  return "";
}

// ------------------------------------------------------------------------------------------------
// FFI handlers: shape checks, then the kernels above on XLA's intra-op thread pool.
// ------------------------------------------------------------------------------------------------

// The masked kernels number a chunk's kept entries with int32: a forward chunk holds up to k * kColChunk of
// them, a backward chunk kRowChunk * n.
constexpr int64_t kMaxChunkEntries = (int64_t{1} << 31) - 1;

// The masked forward's routes (the route attribute): kAuto picks one of the others in the call.
enum MaskedRoute : int32_t { kAuto = 0, kSparse = 1, kGemm = 2 };

// The fraction of mask's entries kept in its rows 0, step, 2 * step, ... (nonzero bytes, as MaskBits reads them).
double SampledDensity(const bool* mask, int64_t k, int64_t n, int64_t step) {
  int64_t kept = 0, rows = 0;
  for (int64_t r = 0; r < k; r += step, ++rows) {
    const uint8_t* m = reinterpret_cast<const uint8_t*>(mask + r * n);
    for (int64_t j = 0; j < n; ++j) kept += m[j] != 0;
  }
  return static_cast<double>(kept) / static_cast<double>(rows * n);
}

// kAuto: the GEMM for at most kFewRows rows, else the sparse kernel where the density sampled every sample_step rows
// is at most max_density (small_max_density below small_rows rows), else the GEMM. Deciding here, on the rows the
// call multiplies, costs a pass over the sampled rows: a density test in XLA before the call (a reduction and a
// conditional) cost 5-30% of the whole product at 96-256 rows (benchmarks/results/cpu_random_shapes_2026-11-30.md).
ffi::Error MaskedForward(ffi::ThreadPool pool, F32Matrix x, F32Matrix w, BoolMatrix mask, F32MatrixOut y,
                         int32_t route, float max_density, int64_t small_rows, float small_max_density,
                         int64_t sample_step) {
  return Guarded("masked forward", [&]() -> ffi::Error {
    const int64_t b = Dim(x, 0), k = Dim(x, 1), n = Dim(w, 1);
    if (Dim(w, 0) != k || Dim(mask, 0) != k || Dim(mask, 1) != n || Dim(*y, 0) != b || Dim(*y, 1) != n) {
      return ShapeError("masked forward");
    }
    if (route < kAuto || route > kGemm || sample_step < 1) {
      return Status("masked forward", "route=" + std::to_string(route) + ", sample_step=" +
                                          std::to_string(sample_step) + " (internal error in jaxsparse)");
    }
    const Scheduler scheduler = PoolScheduler(pool);
    if (route == kAuto) {
      const double limit = b < small_rows ? small_max_density : max_density;
      const bool sparse =
          b > kFewRows && k > 0 && n > 0 && SampledDensity(mask.typed_data(), k, n, sample_step) <= limit;
      route = sparse ? kSparse : kGemm;
    }
    if (route == kGemm) {
      jaxsparse_cpu::MaskedGemm(scheduler, x.typed_data(), w.typed_data(), mask.typed_data(), b, k, n,
                                y->typed_data());
      return ffi::Error::Success();
    }
    if (k > kMaxChunkEntries / kColChunk) {
      return Status("masked forward", "k=" + std::to_string(k) + " rows exceed the kernel's int32 chunk indexing");
    }
    MaskedForwardKernel(scheduler, x.typed_data(), w.typed_data(), mask.typed_data(), b, k, n, y->typed_data());
    return ffi::Error::Success();
  });
}

ffi::Error MaskedBackward(ffi::ThreadPool pool, F32Matrix x, F32Matrix w, BoolMatrix mask, F32Matrix dy,
                          F32MatrixOut dx, F32MatrixOut dw) {
  return Guarded("masked backward", [&]() -> ffi::Error {
    const int64_t b = Dim(x, 0), k = Dim(x, 1), n = Dim(w, 1);
    if (Dim(w, 0) != k || Dim(mask, 0) != k || Dim(mask, 1) != n || Dim(dy, 0) != b || Dim(dy, 1) != n ||
        Dim(*dx, 0) != b || Dim(*dx, 1) != k || Dim(*dw, 0) != k || Dim(*dw, 1) != n) {
      return ShapeError("masked backward");
    }
    if (n > kMaxChunkEntries / kRowChunk) {
      return Status("masked backward", "n=" + std::to_string(n) + " columns exceed the kernel's int32 chunk indexing");
    }
    MaskedBackwardKernel(PoolScheduler(pool), x.typed_data(), w.typed_data(), mask.typed_data(), dy.typed_data(), b,
                         k, n, dx->typed_data(), dw->typed_data());
    return ffi::Error::Success();
  });
}

ffi::Error CsrForward(ffi::ThreadPool pool, F32Matrix x, F32Vector data, I32Vector col_offsets,
                      I32Vector transpose_order, I32Vector transpose_row_indices, F32MatrixOut y) {
  return Guarded("csr forward", [&]() -> ffi::Error {
    const int64_t b = Dim(x, 0), k = Dim(x, 1), n = Dim(*y, 1), nnz = Dim(data, 0);
    if (Dim(*y, 0) != b || Dim(col_offsets, 0) != n + 1 || Dim(transpose_order, 0) != nnz ||
        Dim(transpose_row_indices, 0) != nnz) {
      return ShapeError("csr forward");
    }
    return Status("csr forward", CsrForwardKernel(PoolScheduler(pool), x.typed_data(), data.typed_data(),
                                                  col_offsets.typed_data(), transpose_order.typed_data(),
                                                  transpose_row_indices.typed_data(), b, k, n, nnz,
                                                  y->typed_data()));
  });
}

ffi::Error CsrBackward(ffi::ThreadPool pool, F32Matrix x, F32Vector data, I32Vector row_offsets,
                       I32Vector col_indices, F32Matrix dy, F32MatrixOut dx, F32VectorOut ddata) {
  return Guarded("csr backward", [&]() -> ffi::Error {
    const int64_t b = Dim(x, 0), k = Dim(x, 1), n = Dim(dy, 1), nnz = Dim(data, 0);
    if (Dim(dy, 0) != b || Dim(row_offsets, 0) != k + 1 || Dim(col_indices, 0) != nnz || Dim(*dx, 0) != b ||
        Dim(*dx, 1) != k || Dim(*ddata, 0) != nnz) {
      return ShapeError("csr backward");
    }
    return Status("csr backward", CsrBackwardKernel(PoolScheduler(pool), x.typed_data(), data.typed_data(),
                                                    row_offsets.typed_data(), col_indices.typed_data(),
                                                    dy.typed_data(), b, k, n, nnz, dx->typed_data(),
                                                    ddata->typed_data()));
  });
}

}  // namespace

// Built with -fvisibility=hidden: only the handlers are exported.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseMaskedForward, MaskedForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Matrix>()
                                  .Arg<BoolMatrix>()
                                  .Ret<F32Matrix>()
                                  .Attr<int32_t>("route")
                                  .Attr<float>("max_density")
                                  .Attr<int64_t>("small_rows")
                                  .Attr<float>("small_max_density")
                                  .Attr<int64_t>("sample_step"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseMaskedBackward, MaskedBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Matrix>()
                                  .Arg<BoolMatrix>()
                                  .Arg<F32Matrix>()
                                  .Ret<F32Matrix>()
                                  .Ret<F32Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseCsrForward, CsrForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Ret<F32Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseCsrBackward, CsrBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<F32Matrix>()
                                  .Ret<F32Matrix>()
                                  .Ret<F32Vector>());

#pragma GCC visibility pop
