// 2:4 pruning of a (K, N) weight in one pass, for SR-STE training (jaxsparse/ops/_sr_ste.py). Compiled at run
// time by NVRTC (no includes), one build per (NM_IN_BF16, NM_OUT_BF16). Kernels:
//
// nm24_transposable: transposable 2:4: for every 4 x 4 tile (rows 4 r .. 4 r + 3, columns 4 c .. 4 c + 3)
//   the pattern with 2 kept entries in every row and every column (90 of them) whose kept scores have the
//   largest total, the first in jaxsparse.formats._nm_masks._tile_patterns(2, 4) order on exact ties; scores are
//   min(|w| with NaN as inf, FLT_MAX / 16), as jaxsparse.nm_mask(w, 2, 4, transposable=True) computes them.
//   Operands, row-major as JAX stores them:
//     w        (K, N) float32, or bfloat16 with NM_IN_BF16;
//     pruned   (K, N) float32, or bfloat16 with NM_OUT_BF16 (round to nearest even): where(mask, w, 0);
//     pattern  (K/4, N/4) uint8: the index of each tile's pattern in _tile_patterns(2, 4).
//   Needs K % 4 == 0 and N % 4 == 0. One thread per tile; consecutive threads take consecutive tiles of a
//   row of tiles, so each of the four row loads of a warp is one contiguous 512-byte (f32) span.
//   The sum of a pattern is that of its rows' pair sums, (r0 + r1) + (r2 + r3): another order than XLA's
//   product of the reference, so the two can pick different patterns where two totals agree to within
//   float32 rounding (both then keep the same magnitude, to that rounding).
// nm24_transposable_compress: the same, written as cuSPARSELt's compressed buffers of W and Wᵀ.
// nm24_prune: plain 2:4 along K (nm_mask(w, 2, 4) exactly): the pruned weight, each group's mask bits and,
//   optionally, cuSPARSELt's buffer of W.

#ifndef NM_IN_BF16
#define NM_IN_BF16 0
#endif
#ifndef NM_OUT_BF16
#define NM_OUT_BF16 1
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// The search meets in the middle: a pattern is a pair of row pairs (a, b) for rows 0 and 1 and one (c, d) for rows 2
// and 3 whose column counts add up to 2 in every column. The column counts of two row pairs are one of 19 states;
// for each state, the best pair of rows 2 and 3 with it, then for each (a, b) of rows 0 and 1 the best completion of
// the complementary state: 72 candidates instead of 90 patterns of 3 adds each. NM_ROW_PAIRS lists the 36 pairs of
// row pairs in order as P(a, b, state, complement, rank, base): the state of their column counts, that of 2 minus
// them, the pair's rank among the pairs of its state (in order), and the index in _tile_patterns(2, 4) of the first
// pattern whose rows 0 and 1 are (a, b) (the patterns are in the order of their row pairs, row 0 first), so a
// pattern's index is base(a, b) + rank(c, d). tests/test_cuda_kernels.py checks the table against _tile_patterns.
#define NM_ROW_PAIRS(P)                                                                                     \
  P(0, 0, 18, 0, 0, 0) P(0, 1, 17, 1, 0, 1) P(0, 2, 16, 2, 0, 3) P(0, 3, 12, 6, 0, 5)                       \
  P(0, 4, 11, 7, 0, 7) P(0, 5, 9, 9, 0, 9) P(1, 0, 17, 1, 1, 15) P(1, 1, 15, 3, 0, 17)                      \
  P(1, 2, 14, 4, 0, 18) P(1, 3, 10, 8, 0, 20) P(1, 4, 9, 9, 1, 22) P(1, 5, 7, 11, 0, 28)                    \
  P(2, 0, 16, 2, 1, 30) P(2, 1, 14, 4, 1, 32) P(2, 2, 13, 5, 0, 34) P(2, 3, 9, 9, 2, 35)                    \
  P(2, 4, 8, 10, 0, 41) P(2, 5, 6, 12, 0, 43) P(3, 0, 12, 6, 1, 45) P(3, 1, 10, 8, 1, 47)                   \
  P(3, 2, 9, 9, 3, 49) P(3, 3, 5, 13, 0, 55) P(3, 4, 4, 14, 0, 56) P(3, 5, 2, 16, 0, 58)                    \
  P(4, 0, 11, 7, 1, 60) P(4, 1, 9, 9, 4, 62) P(4, 2, 8, 10, 1, 68) P(4, 3, 4, 14, 1, 70)                    \
  P(4, 4, 3, 15, 0, 72) P(4, 5, 1, 17, 0, 73) P(5, 0, 9, 9, 5, 75) P(5, 1, 7, 11, 1, 81)                    \
  P(5, 2, 6, 12, 1, 83) P(5, 3, 2, 16, 1, 85) P(5, 4, 1, 17, 1, 87) P(5, 5, 0, 18, 0, 89)
// Row pair p (0..5) of itertools.combinations(range(4), 2) as a column bit mask: (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)
// are 0x3 0x5 0x9 0x6 0xa 0xc, one nibble each of a literal (an index that differs between a warp's threads would
// serialize a __constant__ table's reads).
__device__ __forceinline__ u32 pair_bits(u32 p) { return (0xca6953u >> (4 * p)) & 0xf; }

__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float(static_cast<u32>(h) << 16); }

__device__ __forceinline__ u16 float_to_bf16(float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// The 4 entries of one tile row.
__device__ __forceinline__ void load_row(const void* w, long long offset, float v[4]) {
#if NM_IN_BF16
  const uint2 q = *reinterpret_cast<const uint2*>(static_cast<const u16*>(w) + offset);
  v[0] = bf16_to_float(q.x & 0xffff);
  v[1] = bf16_to_float(q.x >> 16);
  v[2] = bf16_to_float(q.y & 0xffff);
  v[3] = bf16_to_float(q.y >> 16);
#else
  const float4 q = *reinterpret_cast<const float4*>(static_cast<const float*>(w) + offset);
  v[0] = q.x;
  v[1] = q.y;
  v[2] = q.z;
  v[3] = q.w;
#endif
}

__device__ __forceinline__ void store_row(void* out, long long offset, const float v[4], u32 keep) {
  float k[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) k[j] = (keep >> j) & 1 ? v[j] : 0.0f;
#if NM_OUT_BF16
  uint2 q;
  q.x = static_cast<u32>(float_to_bf16(k[0])) | (static_cast<u32>(float_to_bf16(k[1])) << 16);
  q.y = static_cast<u32>(float_to_bf16(k[2])) | (static_cast<u32>(float_to_bf16(k[3])) << 16);
  *reinterpret_cast<uint2*>(static_cast<u16*>(out) + offset) = q;
#else
  *reinterpret_cast<float4*>(static_cast<float*>(out) + offset) = make_float4(k[0], k[1], k[2], k[3]);
#endif
}

// min(|v| with NaN as the largest (inf), cap) for a cap >= 0, as jaxsparse.formats._nm_masks._scores then the cap:
// in integer steps (non-negative floats order as their bits, and NaN's are above inf's), 5% faster than fabsf, a NaN
// test and fminf in nm24_transposable.
__device__ __forceinline__ float score(float v, float cap) {
  return __int_as_float(min(__float_as_int(v) & 0x7fffffff, __float_as_int(cap)));
}

// Tile (rows 4 tr .., columns 4 tc ..) of w.
__device__ __forceinline__ void load_tile(const void* w, long long tr, long long tc, int n, float v[4][4]) {
  const long long base = 4 * tr * n + 4 * tc;
#pragma unroll
  for (int r = 0; r < 4; ++r) load_row(w, base + r * static_cast<long long>(n), v[r]);
}

// The tile of this thread in a one-thread-per-tile grid over the (K / 4, N / 4) tiles, tile columns fastest;
// false for the threads past the last tile.
__device__ __forceinline__ bool thread_tile(int k, int n, long long* tr, long long* tc) {
  const long long tiles_per_row = n >> 2;
  const long long tile = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  *tr = tile / tiles_per_row;
  *tc = tile - *tr * tiles_per_row;
  return tile < (k >> 2) * tiles_per_row;
}

// The index of the best pattern of tile v; *code = the pattern's code (row r keeps the columns
// pair_bits((code >> 3 r) & 7)).
__device__ __forceinline__ int best_pattern(const float v[4][4], u32* code) {
  const float big = 3.4028234663852886e38f / 16.0f;
  float pair[4][6];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    float a[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      a[j] = score(v[r][j], big);
    }
    pair[r][0] = a[0] + a[1];
    pair[r][1] = a[0] + a[2];
    pair[r][2] = a[0] + a[3];
    pair[r][3] = a[1] + a[2];
    pair[r][4] = a[1] + a[3];
    pair[r][5] = a[2] + a[3];
  }
  // Rows 2 and 3: per state, the best total and, as one word, (rank << 12) | (c << 6) | (d << 9); a state's first
  // pair sets them. The first in order wins ties (strict >), as it does among the patterns.
  float best23[19] = {};
  u32 word23[19] = {};
#define NM_TRY23(a, b, s, t, rank, base)                    \
  {                                                         \
    const float total = pair[2][a] + pair[3][b];            \
    if ((rank) == 0 || total > best23[s]) {                 \
      best23[s] = total;                                    \
      word23[s] = ((rank) << 12) | ((a) << 6) | ((b) << 9); \
    }                                                       \
  }
  NM_ROW_PAIRS(NM_TRY23)
#undef NM_TRY23
  // Rows 0 and 1 with the best completion: the index and the code of the best pattern so far as one word,
  // (index << 12) | code (one select per candidate for both).
  float best = -1.0f;
  u32 best_pc = 0;
#define NM_TRY01(a, b, s, t, rank, base)                                     \
  {                                                                          \
    const float total = (pair[0][a] + pair[1][b]) + best23[t];               \
    if (total > best) {                                                      \
      best = total;                                                          \
      best_pc = (((base) << 12) | (a) | ((b) << 3)) + word23[t];             \
    }                                                                        \
  }
  NM_ROW_PAIRS(NM_TRY01)
#undef NM_TRY01
  *code = best_pc & 0xfff;
  return static_cast<int>(best_pc >> 12);
}

// Prunes tile (tr, tc), v, into `pruned` and writes its pattern's index.
__device__ __forceinline__ void prune_tile(const float v[4][4], void* pruned, u8* pattern, long long tr, long long tc,
                                           int n) {
  u32 code;
  const int p = best_pattern(v, &code);
  const long long base = 4 * tr * n + 4 * tc;
#pragma unroll
  for (int r = 0; r < 4; ++r)
    store_row(pruned, base + r * static_cast<long long>(n), v[r], pair_bits((code >> (3 * r)) & 7));
  pattern[tr * (n >> 2) + tc] = static_cast<u8>(p);
}

extern "C" __global__ void __launch_bounds__(256, 4) nm24_transposable(const void* __restrict__ w,
                                                                    void* __restrict__ pruned,
                                                                    u8* __restrict__ pattern, int k, int n) {
  long long tr, tc;
  if (!thread_tile(k, n, &tr, &tc)) return;
  float v[4][4];
  load_tile(w, tr, tc, n, v);
  prune_tile(v, pruned, pattern, tr, tc, n);
}

// cuSPARSELt's compressed layout of a bfloat16 (K, N) 2:4 weight read as stored (LAYOUT_KN; mapped on an H100
// with cuSPARSELt 0.8, jaxsparse/_cuda/_layout.py, and checked against cuSPARSELt at run time before use):
// values (K/2, N) bf16, row 2 g + s = the s-th kept entry of group g (4 rows), then one 4-bit code
// p0 | p1 << 2 per (group, column), two a byte, at byte meta_byte(g, n) (low nibble for bit 3 of n clear).
__device__ __forceinline__ long long meta_byte(long long g, long long n, long long groups) {
  return ((n >> 6) * (groups >> 3) + (g >> 3)) * 256 + (((n >> 5) & 1) << 7) + (((n >> 4) & 1) << 6) +
         (((n >> 2) & 1) << 5) + (((n >> 1) & 1) << 4) + ((n & 1) << 3) + (((g >> 1) & 1) << 2) + ((g & 1) << 1) +
         ((g >> 2) & 1);
}

// Entry i (0..3, known only at run time) of four registers.
__device__ __forceinline__ float pick(float a, float b, float c, float d, int i) {
  return i == 0 ? a : (i == 1 ? b : (i == 2 ? c : d));
}

// The positions (p0 < p1) of the two set bits of a 4-bit mask, as the code p0 | p1 << 2.
__device__ __forceinline__ u32 pair_code(u32 bits) {
  const u32 p0 = __ffs(bits) - 1, p1 = 31 - __clz(bits);
  return p0 | (p1 << 2);
}

// Column j of tile v with kept rows `bits` (two set) for a compressed buffer of W: the code p0 | p1 << 2 and
// the two kept values (bfloat16), *lo of row p0 and *hi of row p1.
__device__ __forceinline__ u32 kept_pair(const float v[4][4], int j, u32 bits, u16* lo, u16* hi) {
  *lo = float_to_bf16(pick(v[0][j], v[1][j], v[2][j], v[3][j], __ffs(bits) - 1));
  *hi = float_to_bf16(pick(v[0][j], v[1][j], v[2][j], v[3][j], 31 - __clz(bits)));
  return pair_code(bits);
}

// Four bfloat16 values as one 8-byte store.
__device__ __forceinline__ uint2 pack4(const u16 h[4]) {
  return make_uint2(h[0] | (static_cast<u32>(h[1]) << 16), h[2] | (static_cast<u32>(h[3]) << 16));
}

// Writes tile (tr, tc) of a 2:4 (along K) bfloat16 weight into its compressed buffer (LAYOUT_KN): column j of the
// tile keeps the rows set in cols[j] (two of them). Lanes l and l ^ 2 must hold tile columns tc and tc ^ 2 of
// the same tile row (they share metadata bytes), and all 32 lanes must call it.
__device__ __forceinline__ void write_groups(u8* blob, long long tr, long long tc, int k, int n, const float v[4][4],
                                             const u32 cols[4]) {
  u16* values = reinterpret_cast<u16*>(blob);  // (K / 2, N)
  u8* meta = blob + static_cast<long long>(k) * n;
  u16 lo[4], hi[4];
  u32 codes[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) codes[j] = kept_pair(v, j, cols[j], &lo[j], &hi[j]);
  const long long col = 4 * tc;
  *reinterpret_cast<uint2*>(values + (2 * tr) * n + col) = pack4(lo);
  *reinterpret_cast<uint2*>(values + (2 * tr + 1) * n + col) = pack4(hi);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const u32 other = __shfl_xor_sync(0xffffffffu, codes[j], 2);
    if (!(tc & 2)) meta[meta_byte(tr, col + j, k >> 2)] = static_cast<u8>(codes[j] | (other << 4));
  }
}

// Writes the 512 metadata bytes of a 64 x 64 region (16 groups from g0, 64 columns from n0; g0 % 16 == 0,
// n0 % 64 == 0): two runs of 256 consecutive bytes. codes[gl][nl] is the 4-bit code of group g0 + gl, column
// n0 + nl. All 256 threads of the block call it.
__device__ __forceinline__ void write_meta_region(u8* meta, const u8 (*codes)[64], long long g0, long long n0,
                                                  long long groups, int t) {
#pragma unroll
  for (int idx = t; idx < 512; idx += 256) {
    const int b = idx & 255;
    const int gl = (idx >> 8) * 8 + (((b >> 2) & 1) << 1) + ((b >> 1) & 1) + ((b & 1) << 2);
    const int nl = (((b >> 7) & 1) << 5) + (((b >> 6) & 1) << 4) + (((b >> 5) & 1) << 2) + (((b >> 4) & 1) << 1) +
                   ((b >> 3) & 1);  // bit 3 (the nibble) clear
    meta[meta_byte(g0 + gl, n0 + nl, groups)] = static_cast<u8>(codes[gl][nl] | (codes[gl][nl | 8] << 4));
  }
}

// The same pruning, written straight into cuSPARSELt's compressed buffers of W (K, N) and of Wᵀ (N, K), both in the
// LAYOUT_KN form (Wᵀ as a weight of contraction N: the transposable mask is 2:4 along N too), for bfloat16 products.
// Needs K % 64 == 0, N % 64 == 0 and K / 64 <= 65535. A block of 256 threads takes a 64 x 64 region (16 x 16 tiles,
// one a thread; grid (N / 64, K / 64)); the metadata of both buffers and Wᵀ's values go through shared memory, so
// that every global write of the block is a contiguous run.
extern "C" __global__ void __launch_bounds__(256) nm24_transposable_compress(const void* __restrict__ w,
                                                                             u8* __restrict__ pattern,
                                                                             u8* __restrict__ blob,
                                                                             u8* __restrict__ blob_t, int k, int n) {
  __shared__ u8 codes_w[16][64];    // [group tr][column 4 tc + j] of W
  __shared__ u8 codes_t[16][64];    // [group tc][column 4 tr + r] of Wᵀ
  __shared__ __align__(16) u16 values_sh[32][64];  // Wᵀ's values: [2 tc + s][4 tr + r]
  const int t = threadIdx.x, tcl = t & 15, trl = t >> 4;
  const long long tc = blockIdx.x * 16LL + tcl, tr = blockIdx.y * 16LL + trl;
  const int tiles_per_row = n >> 2;
  float v[4][4];
  load_tile(w, tr, tc, n, v);
  u32 code;
  pattern[tr * tiles_per_row + tc] = static_cast<u8>(best_pattern(v, &code));
  u32 rows[4];  // kept columns of each row
#pragma unroll
  for (int r = 0; r < 4; ++r) rows[r] = pair_bits((code >> (3 * r)) & 7);
  // W: group tr, columns 4 tc + j; column j keeps the rows whose bit j is set. Values straight to memory (the
  // 16 threads of a tile row write 128 consecutive bytes of each values row).
  u16* values = reinterpret_cast<u16*>(blob);  // (K / 2, N)
  u16 lo[4], hi[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 bits = 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) bits |= ((rows[r] >> j) & 1) << r;
    codes_w[trl][4 * tcl + j] = static_cast<u8>(kept_pair(v, j, bits, &lo[j], &hi[j]));
  }
  *reinterpret_cast<uint2*>(values + (2 * tr) * n + 4 * tc) = pack4(lo);
  *reinterpret_cast<uint2*>(values + (2 * tr + 1) * n + 4 * tc) = pack4(hi);
  // Wᵀ: group tc, columns 4 tr + r; row r of the tile keeps the columns set in rows[r].
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    codes_t[tcl][4 * trl + r] = static_cast<u8>(pair_code(rows[r]));
    values_sh[2 * tcl][4 * trl + r] = float_to_bf16(pick(v[r][0], v[r][1], v[r][2], v[r][3], __ffs(rows[r]) - 1));
    values_sh[2 * tcl + 1][4 * trl + r] =
        float_to_bf16(pick(v[r][0], v[r][1], v[r][2], v[r][3], 31 - __clz(rows[r])));
  }
  __syncthreads();
  // Wᵀ's values: 32 rows of 64 columns (128 bytes), a 16-byte piece a thread.
  u16* values_t = reinterpret_cast<u16*>(blob_t);  // (N / 2, K)
  const int row = t >> 3, piece = t & 7;
  *reinterpret_cast<uint4*>(values_t + (blockIdx.x * 32LL + row) * k + blockIdx.y * 64LL + piece * 8) =
      *reinterpret_cast<const uint4*>(&values_sh[row][piece * 8]);
  const long long kn = static_cast<long long>(k) * n;
  write_meta_region(blob + kn, codes_w, blockIdx.y * 16LL, blockIdx.x * 64LL, k >> 2, t);
  write_meta_region(blob_t + kn, codes_t, blockIdx.x * 16LL, blockIdx.y * 64LL, n >> 2, t);
}

// Plain 2:4 pruning along K (jaxsparse.nm_mask(w, 2, 4): the 2 largest |w| of each group of 4, NaN the largest,
// the lower index first on ties): the pruned weight (as nm24_transposable's), each group's mask bits
// (bits (K/4, N) uint8: bit r set where row 4 g + r of the group is kept), and, where blob is not null,
// cuSPARSELt's compressed bfloat16 buffer of W (LAYOUT_KN; needs K % 32 == 0 and N % 64 == 0: whole warps).
// One thread per 4 x 4 tile, as nm24_transposable.
extern "C" __global__ void __launch_bounds__(256) nm24_prune(const void* __restrict__ w, void* __restrict__ pruned,
                                                             u8* __restrict__ bits, u8* __restrict__ blob, int k,
                                                             int n) {
  long long tr, tc;
  if (!thread_tile(k, n, &tr, &tc)) return;
  float v[4][4];
  load_tile(w, tr, tc, n, v);
  u32 cols[4];  // kept rows of each column
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float a[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) a[r] = score(v[r][j], __int_as_float(0x7f800000));
    cols[j] = 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      int rank = 0;  // entries that beat entry r: larger, or equal and earlier
#pragma unroll
      for (int o = 0; o < 4; ++o) rank += o != r && (a[o] > a[r] || (a[o] == a[r] && o < r));
      cols[j] |= static_cast<u32>(rank < 2) << r;
    }
  }
  const long long base = 4 * tr * n + 4 * tc;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    u32 keep = 0;  // kept columns of row r
#pragma unroll
    for (int j = 0; j < 4; ++j) keep |= ((cols[j] >> r) & 1) << j;
    store_row(pruned, base + r * static_cast<long long>(n), v[r], keep);
  }
  *reinterpret_cast<u32*>(bits + tr * n + 4 * tc) = cols[0] | (cols[1] << 8) | (cols[2] << 16) | (cols[3] << 24);
  if (blob) write_groups(blob, tr, tc, k, n, v, cols);
}
