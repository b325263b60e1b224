// CPU kernel for the forward of densely masked weights: the dense route of sparse_matmul.cc's masked forward.
//
// y = x @ where(mask, w, 0) for a mask that keeps too many weights for the sparse kernels of sparse_matmul.cc to
// win. Building the masked weight first and handing it to XLA's dot costs a pass over K x N and a fresh buffer per
// call, and XLA's dot on a weight computed in the same call ran 0.0-0.28 slower than on one passed in
// (benchmarks/results/cpu_random_shapes_2026-11-27.md): 1.06-1.55x the plain product at 34-50% density. Here the
// mask is applied while the weight is packed for a register-blocked GEMM, as any GEMM packs its operands anyway (a
// zero-masking load per vector on AVX-512, else a bitwise select). Products of at most kFewRows rows (a decode
// step) skip the packing: DirectProduct streams w and mask once (benchmarks/results/cpu_random_shapes_2026-11-29.md).
// The GEMM: each work item (a chunk of at most kNc output columns times a group of row panels of kMr rows) runs the
// kMr x kNr micro-kernel (kMr x 2 accumulator vectors: 24 of the 32 AVX-512 registers) over its strips of the packed
// weight, packed by the item block by block as it goes (one group of rows), or once per call beforehand (several
// groups). x is read in place, kMr rows of a kKc slice at a time (they stay in L1 across a chunk's strips), which ran
// at 0.97-1.28x the rate of packing it in a pass of its own on a Xeon, 0.84-1.18x on a Zen 5 (only the last, partial
// panel is copied, zero padded). Portable C++ with GCC/Clang vector extensions: 16-float vectors where the
// CPU has AVX-512, else 8-float ones with half the tile.

#include "common.h"

namespace {

#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
constexpr int kMr = 12;  // rows of the micro-tile
#else
typedef float vec __attribute__((vector_size(32)));
constexpr int kMr = 6;
#endif
constexpr int kVec = sizeof(vec) / sizeof(float);
constexpr int kNr = 2 * kVec;          // columns of the micro-tile: two vectors
constexpr int64_t kKc = 512;           // contraction rows per packed block (256: 0.89-0.95x the rate on a Zen 5, 0.93-1.02x
                                       // on a Xeon, benchmarks/results/cpu_random_shapes_2026-11-30.md)
constexpr int64_t kNc = 4 * kNr;       // output columns per work item, at most
constexpr int64_t kItemsPerWorker = 4;  // work items per thread, at least where the product allows
constexpr int64_t kDirectRows = 64;     // DirectProduct (kFewRows rows at most): weight rows per work item, at least
constexpr int64_t kDirectCols = 256;    // ... columns per work item, at least (where the rows do not split enough)
constexpr int64_t kDirectRowParts = 8;  // ... partial sums of y, at most

inline vec LoadVec(const float* p) {
  vec r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline void StoreVec(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

// c (rows, cols; row stride ldc) = [c +] a (kMr, kc; row stride lda) @ b (kc, kNr packed); rows <= kMr (a has kMr
// rows all the same), cols <= kNr.
inline void MicroKernel(int64_t kc, const float* __restrict a, int64_t lda, const float* __restrict b, float* c,
                        int64_t ldc, bool accumulate, int64_t rows, int64_t cols) {
  vec lo[kMr], hi[kMr];
  for (int i = 0; i < kMr; ++i) lo[i] = hi[i] = vec{};
  for (int64_t p = 0; p < kc; ++p) {
    const vec b0 = LoadVec(b + p * kNr), b1 = LoadVec(b + p * kNr + kVec);
#pragma GCC unroll 16
    for (int i = 0; i < kMr; ++i) {
      const float s = a[i * lda + p];
      lo[i] += s * b0;
      hi[i] += s * b1;
    }
  }
  if (rows == kMr && cols == kNr) {
    for (int i = 0; i < kMr; ++i) {
      float* row = c + i * ldc;
      if (accumulate) {
        lo[i] += LoadVec(row);
        hi[i] += LoadVec(row + kVec);
      }
      StoreVec(row, lo[i]);
      StoreVec(row + kVec, hi[i]);
    }
    return;
  }
  alignas(64) float tile[kMr * kNr];
  for (int i = 0; i < kMr; ++i) {
    StoreVec(tile + i * kNr, lo[i]);
    StoreVec(tile + i * kNr + kVec, hi[i]);
  }
  for (int64_t i = 0; i < rows; ++i) {
    float* row = c + i * ldc;
    for (int64_t j = 0; j < cols; ++j) row[j] = accumulate ? row[j] + tile[i * kNr + j] : tile[i * kNr + j];
  }
}

// The packed weight: chunks of kNc columns, each [block][strip] of (kKc, kNr), zero past k and n.
constexpr int64_t kStrips = kNc / kNr, kStripSize = kKc * kNr, kBlockSize = kStrips * kStripSize;

// The GEMM over packed x and a packed weight. pack(blk, c0, cn, dst) writes the weight's rows of block blk and
// columns [c0, c0 + cn) as ceil(cn / kNr) strips, kStripSize apart, to dst. Work items are chunks of columns
// times groups of row panels; a chunk's weight is packed by its item, block by block while it is used (one group
// of rows), or once per call for every group beforehand (few rows: several groups would repack it).
template <typename Pack>
void PackedGemm(const Scheduler& pool, const float* x, int64_t m, int64_t k, int64_t n, float* y, const Pack& pack) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::memset(y, 0, sizeof(float) * m * n);
    return;
  }
  const int64_t panels = CeilDiv(m, kMr), blocks = CeilDiv(k, kKc), chunks = CeilDiv(n, kNc);
  const int64_t chunk_size = blocks * kBlockSize;
  // Enough items for every thread to take several (few columns: split the rows too).
  const int64_t want = kItemsPerWorker * NumWorkers();
  const int64_t row_groups = std::min(panels, CeilDiv(want, chunks));
  const int64_t per_group = CeilDiv(panels, row_groups);
  const int64_t groups = CeilDiv(panels, per_group);
  const float* packed = nullptr;
  if (groups > 1) {
    float* buf = CachedBuffer(1, chunks * chunk_size);
    ParallelFor(pool, chunks * blocks, [&](int64_t i) {
      const int64_t c0 = (i / blocks) * kNc, blk = i % blocks;
      pack(blk, c0, std::min(kNc, n - c0), buf + (c0 / kNc) * chunk_size + blk * kBlockSize);
    });
    packed = buf;
  }
  ParallelFor(pool, chunks * groups, [&](int64_t item) {
    const int64_t c0 = (item % chunks) * kNc, cn = std::min(kNc, n - c0);
    const int64_t p0 = (item / chunks) * per_group, p1 = std::min(panels, p0 + per_group);
    const int64_t strips = CeilDiv(cn, kNr);
    float* own = packed == nullptr ? CachedBuffer(2, kBlockSize) : nullptr;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t k0 = blk * kKc, kc = std::min(kKc, k - k0);
      const float* b = own;
      if (own != nullptr) {
        pack(blk, c0, cn, own);
      } else {
        b = packed + (c0 / kNc) * chunk_size + blk * kBlockSize;
      }
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t rows = std::min<int64_t>(kMr, m - p * kMr);
        const float* ap = x + p * kMr * k + k0;
        int64_t lda = k;
        if (rows < kMr) {
          float* edge = CachedBuffer(0, kMr * kKc);
          for (int64_t i = 0; i < kMr; ++i) {
            for (int64_t q = 0; q < kc; ++q) edge[i * kKc + q] = i < rows ? ap[i * k + q] : 0.f;
          }
          ap = edge;
          lda = kKc;
        }
        for (int64_t s = 0; s < strips; ++s) {
          MicroKernel(kc, ap, lda, b + s * kStripSize, y + p * kMr * n + c0 + s * kNr, n, blk > 0, rows,
                      std::min<int64_t>(kNr, cn - s * kNr));
        }
      }
    }
  });
}

typedef int32_t ivec __attribute__((vector_size(sizeof(vec))));
typedef uint8_t bytes __attribute__((vector_size(kVec)));

// where(mask[0], w[0], 0), bitwise (a pruned NaN or inf becomes +0; a nonzero mask byte keeps).
inline float MaskedScalar(const float* w, const bool* mask) {
  uint32_t bits;
  std::memcpy(&bits, w, sizeof(bits));
  bits &= 0u - static_cast<uint32_t>(*reinterpret_cast<const uint8_t*>(mask) != 0);
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// where(mask, w, 0) for kVec weights (a pruned NaN or inf becomes +0; a nonzero mask byte keeps): a zero-masking
// load on AVX-512 (half the time of the portable select in the few-rows product), else a bitwise select.
inline vec MaskedLoad(const float* w, const bool* mask) {
  vec out;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mask));
  const __m512 v = _mm512_maskz_loadu_ps(_mm_test_epi8_mask(m, m), w);
  std::memcpy(&out, &v, sizeof(out));
#else
  ivec bits;
  bytes m;
  std::memcpy(&bits, w, sizeof(bits));
  std::memcpy(&m, mask, sizeof(m));
  const ivec kept = bits & (__builtin_convertvector(m, ivec) != 0);
  std::memcpy(&out, &kept, sizeof(out));
#endif
  return out;
}

// where(mask, w, 0) for a dense (k, n) w and a bool mask: rows of block blk, columns [c0, c0 + cn), as strips.
void PackMasked(const float* w, const bool* mask, int64_t k, int64_t n, int64_t blk, int64_t c0, int64_t cn,
                float* dst) {
  const int64_t k0 = blk * kKc, kc = std::min(kKc, k - k0);
  for (int64_t s = 0; s * kNr < cn; ++s) {
    const int64_t j0 = c0 + s * kNr, cols = std::min<int64_t>(kNr, cn - s * kNr);
    float* strip = dst + s * kStripSize;
    for (int64_t q = 0; q < kc; ++q) {
      const float* wq = w + (k0 + q) * n + j0;
      const bool* mq = mask + (k0 + q) * n + j0;
      float* d = strip + q * kNr;
      if (cols == kNr) {
        StoreVec(d, MaskedLoad(wq, mq));
        StoreVec(d + kVec, MaskedLoad(wq + kVec, mq + kVec));
      } else {
        for (int64_t j = 0; j < cols; ++j) d[j] = MaskedScalar(wq + j, mq + j);
        for (int64_t j = cols; j < kNr; ++j) d[j] = 0.f;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Few rows (kFewRows at most): no packing. Each weight element is used by at most kFewRows rows, so packing it would
// cost more than the product (and the micro-tile's kMr rows would be mostly padding): w and mask are streamed once,
// in order, and every row of x takes each masked weight vector from the registers. Memory-bound.
// ------------------------------------------------------------------------------------------------

// part[:, c0 : c1] (R rows, stride n) = x[:, k0 : k1] @ where(mask, w, 0)[k0 : k1, c0 : c1], the weight rows read
// in order, four at a time.
template <int R>
void DirectRows(const float* x, const float* w, const bool* mask, int64_t k, int64_t n, int64_t k0, int64_t k1,
                int64_t c0, int64_t c1, float* part) {
  for (int r = 0; r < R; ++r) std::memset(part + r * n + c0, 0, sizeof(float) * (c1 - c0));
  const int64_t full = c0 + (c1 - c0) / kVec * kVec;
  int64_t q = k0;
  for (; q + 4 <= k1; q += 4) {
    float s[R][4];
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 4; ++i) s[r][i] = x[r * k + q + i];
    }
    const float* w0 = w + q * n;
    const bool* m0 = mask + q * n;
    for (int64_t j = c0; j < full; j += kVec) {
      const vec b0 = MaskedLoad(w0 + j, m0 + j), b1 = MaskedLoad(w0 + n + j, m0 + n + j);
      const vec b2 = MaskedLoad(w0 + 2 * n + j, m0 + 2 * n + j), b3 = MaskedLoad(w0 + 3 * n + j, m0 + 3 * n + j);
      for (int r = 0; r < R; ++r) {
        vec acc = LoadVec(part + r * n + j);
        acc += s[r][0] * b0 + s[r][1] * b1 + s[r][2] * b2 + s[r][3] * b3;
        StoreVec(part + r * n + j, acc);
      }
    }
  }
  for (; q < k1; ++q) {
    const float* w0 = w + q * n;
    const bool* m0 = mask + q * n;
    for (int64_t j = c0; j < full; j += kVec) {
      const vec b0 = MaskedLoad(w0 + j, m0 + j);
      for (int r = 0; r < R; ++r) StoreVec(part + r * n + j, LoadVec(part + r * n + j) + x[r * k + q] * b0);
    }
  }
  for (q = k0; q < k1; ++q) {  // the last (c1 - c0) % kVec columns
    for (int64_t j = full; j < c1; ++j) {
      const float v = MaskedScalar(w + q * n + j, mask + q * n + j);
      for (int r = 0; r < R; ++r) part[r * n + j] += x[r * k + q] * v;
    }
  }
}

// y (R, n) = x (R, k) @ where(mask, w, 0): work items are ranges of weight rows (the weight streamed in order) times
// ranges of columns; each range of rows adds into its own partial sums (at most kDirectRowParts of them, so the
// scratch stays a few times y's size), added up at the end.
template <int R>
void DirectProduct(const Scheduler& pool, const float* x, const float* w, const bool* mask, int64_t k, int64_t n,
                   float* y) {
  const int64_t want = kItemsPerWorker * NumWorkers();
  const int64_t row_parts = std::max<int64_t>(1, std::min({CeilDiv(k, kDirectRows), want, kDirectRowParts}));
  const int64_t col_parts = std::max<int64_t>(1, std::min(CeilDiv(want, row_parts), CeilDiv(n, kDirectCols)));
  const int64_t width = RoundUp(CeilDiv(n, col_parts), kVec), col_groups = CeilDiv(n, width);
  const int64_t per_part = CeilDiv(k, row_parts);
  float* parts = CachedBuffer(3, row_parts * R * n);
  ParallelFor(pool, row_parts * col_groups, [&](int64_t i) {
    const int64_t p = i / col_groups, c0 = (i % col_groups) * width;
    DirectRows<R>(x, w, mask, k, n, std::min(k, p * per_part), std::min(k, (p + 1) * per_part), c0,
                  std::min(n, c0 + width), parts + p * R * n);
  });
  const int64_t chunk = RoundUp(CeilDiv(R * n, want), 1024);
  ParallelFor(pool, CeilDiv(R * n, chunk), [&](int64_t c) {
    const int64_t e0 = c * chunk, e1 = std::min<int64_t>(R * n, e0 + chunk);
    std::memcpy(y + e0, parts + e0, sizeof(float) * (e1 - e0));
    for (int64_t p = 1; p < row_parts; ++p) {
      const float* part = parts + p * R * n;
      for (int64_t e = e0; e < e1; ++e) y[e] += part[e];
    }
  });
}

}  // namespace

void jaxsparse_cpu::MaskedGemm(const Scheduler& pool, const float* x, const float* w, const bool* mask, int64_t m,
                               int64_t k, int64_t n, float* y) {
  if (m > 0 && m <= kFewRows && n > 0) {
    using Direct = void (*)(const Scheduler&, const float*, const float*, const bool*, int64_t, int64_t, float*);
    static constexpr Direct kDirect[kFewRows] = {DirectProduct<1>, DirectProduct<2>, DirectProduct<3>,
                                                 DirectProduct<4>, DirectProduct<5>, DirectProduct<6>,
                                                 DirectProduct<7>, DirectProduct<8>};
    return kDirect[m - 1](pool, x, w, mask, k, n, y);
  }
  PackedGemm(pool, x, m, k, n, y, [&](int64_t blk, int64_t c0, int64_t cn, float* dst) {
    PackMasked(w, mask, k, n, blk, c0, cn, dst);
  });
}

