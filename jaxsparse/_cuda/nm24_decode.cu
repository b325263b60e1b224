// y (M, N) = x (M, K) @ W for M <= 32 (decode), W a 2:4 bfloat16 (K, N) weight (groups of 4 along K) stored
// as jaxsparse.NMSparseMatrix stores it, on the sparse tensor cores (mma.sp; compute capability 9.0+ for the
// thread block clusters).
// Compiled at run time by NVRTC (its one include, copies.cuh, handed over as a header), one build per (NM_MT,
// NM_CPL, NM_SPLIT, NM_WARPS, NM_MINB, NM_TSPLIT, NM_XLOAD, NM_META, NM_LOADS, NM_STAGES).
//
// Operands, all row-major as JAX stores them:
//   x       (M, K) bf16;
//   values  (K/2, N) bf16: row 2g+s = the s-th kept entry (in increasing position) of group g;
//   idx     NM_META 0: (K/8, N) uint8, word r = code(group r) | code(group r + K/8) << 4, code = p0 | p1 << 2
//           with p0 < p1 the positions of the two kept entries inside their group (NMSparseMatrix.indices);
//           NM_META 1: the K N / 8 metadata bytes of cuSPARSELt's buffer (jaxsparse/_cuda/_layout.py), which
//           follow `values` in that buffer;
//   y       (M, N) bf16.
// Needs N % (8 NM_CPL) == 0 and K % 64 == 0.
//
// The product runs transposed, yᵀ = Wᵀ xᵀ, so that the structured operand is mma.sp's A (16 rows = 16
// columns of W, 32 K = 8 groups per instruction, 16 kept values per row) and xᵀ is B (K x 8 tokens).
// A warp owns a span of 8 NM_CPL columns of W and walks pairs of 8-group steps (p, p + K/64): one load
// of the position bytes serves both (low and high nibbles). The 16 A rows of an instruction are not 16
// consecutive columns: lane group g (lane / 4) loads NM_CPL (16 or 8) consecutive columns of a values row
// with NM_CPL / 8 16-byte loads, and instruction i (0 .. NI - 1, NI = NM_CPL / 2) takes column
// NM_CPL g + i as its row g and NM_CPL g + NI + i as its row g + 8, so every load is a full 16 bytes and
// no data moves between lanes. A lane's B fragment (x) is 4 bf16 pairs 16 bytes apart (K 8j + 2t, j = 0..3): each
// lane of a quad loads 16 contiguous bytes (K 8t .. 8t + 7) and the quad transposes them, by shuffles (NM_XLOAD 1)
// or through shared memory and ldmatrix (NM_XLOAD 2), instead of four 4-byte loads that each touch 8 rows of x
// (the x loads were most of the instructions at 32 rows). Token tiles of 8 rows (NM_MT of them) share each A
// fragment; with NM_TSPLIT = 2 two warps load the same A fragments (the second load mostly from L1) and take
// half of the tiles each, for half the accumulator registers and twice the warps a multiprocessor holds. Any
// order of the rows is as good as another: each row's output column is tracked. The warps of a thread block split
// the steps; their partial sums meet in shared memory, and with NM_SPLIT > 1 the NM_SPLIT blocks of a
// cluster (each a slice of K) add them through distributed shared memory: each block owns a share of the
// span's outputs, the others store their partial sums of that share into its shared memory, and after one
// cluster barrier it adds them and writes them (no second kernel, no atomics in global memory).
// With NM_LOADS 3 (cuSPARSELt's buffer, one token tile) the loads go another way: each warp streams its pairs of
// consecutive steps by bulk tensor copies (TMA: two tensor maps, of the values and of x, made by the launcher per
// call) and one bulk copy of the metadata into a ring of NM_STAGES stages in dynamic shared memory, NM_STAGES - 1
// pairs ahead of its products, each stage's arrival counted on an mbarrier; the lanes then read their fragments from
// shared memory, so the bytes in flight cost no registers.

#ifndef NM_MT
#define NM_MT 2  // token tiles of 8 rows: ceil(M / 8), at most 4
#endif
#ifndef NM_CPL
#define NM_CPL 16  // columns per lane group: 16 (spans of 128) or 8 (spans of 64: half the accumulators)
#endif
#ifndef NM_SPLIT
#define NM_SPLIT 1  // thread blocks per column span, each a slice of K (a cluster)
#endif
#ifndef NM_TSPLIT
#define NM_TSPLIT 1  // warps that share a step of K, each with NM_MT / NM_TSPLIT of the token tiles (1 or 2)
#endif
#ifndef NM_WARPS
#define NM_WARPS 8
#endif
#ifndef NM_XLOAD
#define NM_XLOAD 1  // the quad transpose of x: 1 shuffles, 2 shared memory + ldmatrix
#endif
#ifndef NM_META
#define NM_META 0  // the layout of the positions: 0 NMSparseMatrix.indices, 1 cuSPARSELt's metadata
#endif
#ifndef NM_LOADS
#define NM_LOADS 0  // when a warp loads a pair of steps: 0 each step before its products, 1 both before either's,
                    // 2 the next pair before the current pair's products (two stages of registers),
                    // 3 bulk copies (TMA) into a ring of NM_STAGES steps a warp in shared memory
#endif
#ifndef NM_STAGES
#define NM_STAGES 2  // NM_LOADS 3: pairs of steps a warp's ring holds (loads in flight ahead of its products)
#endif
#ifndef NM_MINB
#define NM_MINB 1  // thread blocks a multiprocessor must hold at once (caps the registers per thread)
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#include "copies.cuh"

#define NM_SPAN (8 * NM_CPL)
#define NM_NI (NM_CPL / 2)  // instructions per step and token tile
#define NM_WMT (NM_MT / NM_TSPLIT)  // token tiles per warp
#define NM_KW (NM_WARPS / NM_TSPLIT)  // warps with their own steps of K
#if NM_MT % NM_TSPLIT != 0 || NM_WARPS % NM_TSPLIT != 0
#error "NM_TSPLIT must divide NM_MT and NM_WARPS"
#endif

// Element w (0..3) of a uint4, w known at compile time after unrolling.
__device__ __forceinline__ u32 word_of(const uint4& v, int w) {
  return w == 0 ? v.x : (w == 1 ? v.y : (w == 2 ? v.z : v.w));
}

// (lo, hi) bf16 pair: column j of `lo_row` and column j of `hi_row`, each row NM_CPL columns in uint4s
// (j / 8 picks the uint4).
__device__ __forceinline__ u32 pair_of(const uint4* lo_row, const uint4* hi_row, int j) {
  const u32 a = word_of(lo_row[j >> 3], (j & 7) >> 1);
  const u32 b = word_of(hi_row[j >> 3], (j & 7) >> 1);
  return __byte_perm(a, b, (j & 1) ? 0x7632 : 0x5410);
}

// Metadata registers (mma.sp m16n8k32, 16-bit types, sparsity selector 0; measured on an H100 with a
// probe that flips one nibble at a time): lane (g, t), t < 2, gives nibble u (0..3) = the code of A row
// g and group 4t + u of the step, nibble 4 + u = that of A row g + 8; lanes t = 2, 3 give none.
// meta[u] holds the position bytes of group 4t + u for the lane's NM_CPL columns, word w = columns
// 4w .. 4w + 3 (A row g + 8h of instruction i is column NI h + i). A 4 x 4 byte transpose per 4
// instructions gathers, for column (h, i), the bytes of the 4 groups in one word: tr[h][i] byte u.
__device__ __forceinline__ void transpose_meta(const u32 (*meta)[NM_CPL / 4], u32 (*tr)[NM_NI]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int c = 0; c < NM_NI / 4; ++c) {
      const int w = h * (NM_NI / 4) + c;
      const u32 a0 = meta[0][w], a1 = meta[1][w], a2 = meta[2][w], a3 = meta[3][w];
      const u32 p0 = __byte_perm(a0, a1, 0x5140), p1 = __byte_perm(a0, a1, 0x7362);
      const u32 p2 = __byte_perm(a2, a3, 0x5140), p3 = __byte_perm(a2, a3, 0x7362);
      tr[h][4 * c + 0] = __byte_perm(p0, p2, 0x5410);
      tr[h][4 * c + 1] = __byte_perm(p0, p2, 0x7632);
      tr[h][4 * c + 2] = __byte_perm(p1, p3, 0x5410);
      tr[h][4 * c + 3] = __byte_perm(p1, p3, 0x7632);
    }
}

// The register of instruction i: q picks the nibble (0: first step of the pair, 1: second).
__device__ __forceinline__ u32 meta_word(const u32 (*tr)[NM_NI], int i, int q) {
  u32 x[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const u32 nib = (q ? (tr[h][i] >> 4) : tr[h][i]) & 0x0f0f0f0fu;  // byte u = code of group 4t + u
    x[h] = nib | (nib >> 4);                                           // bytes 0, 2: two codes each
  }
  return __byte_perm(x[0], x[1], 0x6420);
}

#if NM_META == 1
// The metadata of step `step` (groups 8 step .. 8 step + 7) for lane (g, t) of the warp whose lane group starts at
// column `col`, from cuSPARSELt's layout: tiles of 8 groups x 64 columns, 256 bytes each, tile (step, col / 64) at
// byte (col / 64 * K / 32 + step) * 256; in a tile, byte ((c / 16) % 4) * 64 + (c % 8) * 8 + 2 u + t holds the code
// of column c for group 4 t + u (nibble (c / 8) % 2). The lane's columns (A rows g and g + 8 of instruction i:
// col + i and col + NI + i) lie in the 64 bytes at ((col / 16) % 4) * 64; tr[h][i] gets, in byte u's low nibble,
// the code of group 4 t + u for A row g + 8 h, as transpose_meta gives it for NM_META 0.
__device__ __forceinline__ const uint4* cslt_meta_src(const u8* meta, int k, int step, int col) {
  return reinterpret_cast<const uint4*>(meta + ((size_t)(col >> 6) * (k >> 5) + step) * 256 + ((col >> 4) & 3) * 64);
}

// tr from the lane's 64 metadata bytes of the step (zero on lanes t >= 2).
__device__ __forceinline__ void cslt_meta(const uint4 (&q)[4], int col, int t, u32 (*tr)[NM_NI]) {
  u32 w[16];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[4 * j] = q[j].x, w[4 * j + 1] = q[j].y, w[4 * j + 2] = q[j].z, w[4 * j + 3] = q[j].w;
  const u32 sel = (t & 1) ? 0x7531 : 0x6420;  // bytes t, 2 + t, 4 + t, 6 + t of each 8-byte run: u = 0 .. 3
#if NM_CPL == 16
#pragma unroll
  for (int i = 0; i < NM_NI; ++i) {  // columns col + i (low nibbles) and col + 8 + i (high) share bytes
    const u32 b = __byte_perm(w[2 * i], w[2 * i + 1], sel);
    tr[0][i] = b, tr[1][i] = b >> 4;
  }
#else
  const int shift = 4 * ((col >> 3) & 1);  // columns col + i and col + 4 + i: bytes 8 i and 32 + 8 i, one nibble
#pragma unroll
  for (int i = 0; i < NM_NI; ++i) {
    tr[0][i] = __byte_perm(w[2 * i], w[2 * i + 1], sel) >> shift;
    tr[1][i] = __byte_perm(w[8 + 2 * i], w[9 + 2 * i], sel) >> shift;
  }
#endif
}
#endif

__device__ __forceinline__ void mma_sp(float* c, const u32* a, const u32* b, u32 e) {
  asm volatile(
      "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e));
}

__device__ __forceinline__ u16 to_bf16(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}


#if NM_LOADS == 3
#if NM_META != 1 || NM_MT != 1 || NM_TSPLIT != 1
#error "NM_LOADS 3 reads cuSPARSELt's buffer at up to 8 rows"
#endif
// A warp's ring: NM_STAGES stages of two consecutive steps each, then their metadata. A stage holds the 32 values
// rows of the span in NM_SPAN / 64 boxes of 64 columns x 32 rows (4 KB each; 128-byte swizzle: 16-byte chunk c of
// row r at chunk c ^ (r % 8)), then 8 token rows of x (64 of K, 128 bytes a row, the same swizzle; rows past M are
// the tensor copy's zero fill); its metadata are the two steps' tiles of each 64 columns (512 bytes).
#define NM_STAGE_BYTES ((NM_SPAN / 64) * 4096 + 1024)
#define NM_X_OFF ((NM_SPAN / 64) * 4096)
#define NM_META_BYTES ((NM_SPAN / 64) * 512)
#define NM_RING_BYTES ((NM_STAGES * (NM_STAGE_BYTES + NM_META_BYTES) + 1023) / 1024 * 1024)
#endif

extern "C" __global__ void __launch_bounds__(NM_WARPS * 32, NM_MINB)
#if NM_SPLIT > 1
    __cluster_dims__(1, NM_SPLIT, 1)
#endif
    nm24_decode(const u16* __restrict__ x, const u16* __restrict__ values, const u8* __restrict__ idx,
                u16* __restrict__ y, int m, int k, int n
#if NM_LOADS == 3
                , const __grid_constant__ TensorMap tmv, const __grid_constant__ TensorMap tmx
#endif
                ) {
  // Partial-sum slots: up to 4, within the 48 KB of static shared memory (less the cluster's receive rows).
  constexpr int kEntries = 4 * NM_NI * NM_MT;  // accumulator registers per lane
#if NM_XLOAD == 2 && NM_LOADS != 3
  __shared__ __align__(16) u32 xs[NM_WARPS][NM_WMT][128];  // per warp and tile: 8 tokens x 32 K, swizzled
  constexpr int kXs = NM_WARPS * NM_WMT * 512;
#else
  constexpr int kXs = 0;
#endif
  constexpr int kFree = 49152 - kXs - (NM_SPLIT > 1 ? kEntries * 128 : 0);
  constexpr int kSlots = (NM_KW < 4 ? NM_KW : 4) * kEntries * 128 <= kFree ? (NM_KW < 4 ? NM_KW : 4)
                         : 2 * kEntries * 128 <= kFree                          ? 2
                                                                                : 1;
  __shared__ float red[kSlots][kEntries][32];
#if NM_SPLIT > 1
  // Block `rank` of the cluster owns entries [rank, rank + 1) * kPer; recv[r] holds block r's sums of them.
  constexpr int kPer = kEntries / NM_SPLIT;
  __shared__ float recv[NM_SPLIT][kPer][32];
  // Arrive now, wait before the first store into a peer: every block of the cluster has started by then.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int span0 = blockIdx.x * NM_SPAN;
  const int col = span0 + NM_CPL * g;
  const int pairs = k >> 6;  // step pairs; a step is 8 groups (32 of K)
  const int per_block = (pairs + NM_SPLIT - 1) / NM_SPLIT;
  const int p_begin = blockIdx.y * per_block;
  const int p_end = min(pairs, p_begin + per_block);

  const int kwarp = warp / NM_TSPLIT, mt0 = (warp % NM_TSPLIT) * NM_WMT;  // steps of K; first token tile
  float acc[NM_NI][NM_WMT][4];
#pragma unroll
  for (int i = 0; i < NM_NI; ++i)
#pragma unroll
    for (int mt = 0; mt < NM_WMT; ++mt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][mt][r] = 0.f;

  // A pair of steps: its loads (a stage) and its products, in the order NM_LOADS says.
  struct Stage {
#if NM_META == 0
    u32 meta[4][NM_CPL / 4];
#else
    uint4 meta[2][4];
#endif
    uint4 v[2][4][NM_CPL / 8];  // per step of the pair: compressed rows 2t, 2t+1, 2t+8, 2t+9, NM_CPL columns each
    uint4 xq[2][NM_WMT];        // per step and token tile: the lane's K 8t .. 8t + 7 of its token
  };
#if NM_LOADS != 3
  auto load_meta = [&](Stage& s, int p) {
#if NM_META == 0
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const u8* src = idx + (size_t)(8 * p + 4 * t + u) * n + col;
#if NM_CPL == 16
      const uint4 q = t < 2 ? __ldg(reinterpret_cast<const uint4*>(src)) : uint4{0u, 0u, 0u, 0u};
      s.meta[u][0] = q.x, s.meta[u][1] = q.y, s.meta[u][2] = q.z, s.meta[u][3] = q.w;
#else
      const uint2 q = t < 2 ? __ldg(reinterpret_cast<const uint2*>(src)) : uint2{0u, 0u};
      s.meta[u][0] = q.x, s.meta[u][1] = q.y;
#endif
    }
#endif
  };
  auto load_step = [&](Stage& s, int p, int q) {
    const int step = p + q * pairs;
#if NM_META == 1
    const uint4* msrc = cslt_meta_src(idx, k, step, col);
#pragma unroll
    for (int j = 0; j < 4; ++j) s.meta[q][j] = t < 2 ? __ldg(msrc + j) : uint4{0u, 0u, 0u, 0u};
#endif
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = 16 * step + 2 * t + (r & 1) + 8 * (r >> 1);
      const uint4* src = reinterpret_cast<const uint4*>(values + (size_t)row * n + col);
#pragma unroll
      for (int h = 0; h < NM_CPL / 8; ++h) s.v[q][r][h] = __ldg(src + h);
    }
#pragma unroll
    for (int mt = 0; mt < NM_WMT; ++mt) {
      const int tok = g + 8 * (mt0 + mt);
      s.xq[q][mt] = tok < m ? __ldg(reinterpret_cast<const uint4*>(x + (size_t)tok * k + 32 * step + 8 * t))
                            : uint4{0u, 0u, 0u, 0u};
    }
  };
  auto load = [&](Stage& s, int p) {
    load_meta(s, p);
    load_step(s, p, 0);
    load_step(s, p, 1);
  };
  // The products of step q of the pair; tr: the metadata registers (NM_META 0: of the pair, from transpose_meta).
  auto compute_step = [&](const Stage& s, int q, u32 (*tr)[NM_NI]) {
#if NM_META == 1
    cslt_meta(s.meta[q], col, t, tr);
#endif
    u32 b[NM_WMT][4];
#pragma unroll
    for (int mt = 0; mt < NM_WMT; ++mt) {
      // Lane t loaded K 8t .. 8t + 7 (its pair s at 8t + 2s); it needs pair t of every 8-wide chunk j.
      const uint4 q4 = s.xq[q][mt];
#if NM_XLOAD == 1
      // A 4 x 4 transpose across the quad: swap within 2 x 2 blocks (lanes t, t ^ 1), then the off-diagonal
      // blocks (lanes t, t ^ 2).
      u32 r0 = q4.x, r1 = q4.y, r2 = q4.z, r3 = q4.w;
      const bool odd = t & 1, upper = t & 2;
      const u32 s0 = __shfl_xor_sync(0xffffffffu, odd ? r0 : r1, 1);
      const u32 s1 = __shfl_xor_sync(0xffffffffu, odd ? r2 : r3, 1);
      if (odd) r0 = s0, r2 = s1; else r1 = s0, r3 = s1;
      const u32 s2 = __shfl_xor_sync(0xffffffffu, upper ? r0 : r2, 2);
      const u32 s3 = __shfl_xor_sync(0xffffffffu, upper ? r1 : r3, 2);
      if (upper) r0 = s2, r1 = s3; else r2 = s2, r3 = s3;
      b[mt][0] = r0, b[mt][1] = r1, b[mt][2] = r2, b[mt][3] = r3;
#else
      // Token g's chunk t at 16-byte slot t ^ ((g / 2) % 4) of its 64-byte row: the 8 rows ldmatrix reads per
      // matrix (and the 8 lanes of each store phase) fall in different banks.
      u32* buf = xs[warp][mt];
      *reinterpret_cast<uint4*>(buf + 16 * g + 4 * (t ^ ((g >> 1) & 3))) = q4;
      __syncwarp();
      const int row = lane & 7, chunk = lane >> 3;  // lane l gives the address of row l % 8 of matrix l / 8
      const u32 addr = (u32)__cvta_generic_to_shared(buf + 16 * row + 4 * (chunk ^ ((row >> 1) & 3)));
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(b[mt][0]), "=r"(b[mt][1]), "=r"(b[mt][2]), "=r"(b[mt][3]) : "r"(addr) : "memory");
      __syncwarp();  // the next step's stores wait for every lane's ldmatrix
#endif
    }
#pragma unroll
    for (int i = 0; i < NM_NI; ++i) {
      u32 a[4];
      a[0] = pair_of(s.v[q][0], s.v[q][1], i);          // row g, compressed columns 2t, 2t+1
      a[1] = pair_of(s.v[q][0], s.v[q][1], NM_NI + i);  // row g + 8
      a[2] = pair_of(s.v[q][2], s.v[q][3], i);          // row g, compressed columns 2t+8, 2t+9
      a[3] = pair_of(s.v[q][2], s.v[q][3], NM_NI + i);
      const u32 e = meta_word(tr, i, NM_META ? 0 : q);  // zero on lanes t >= 2 (meta is zero there)
#pragma unroll
      for (int mt = 0; mt < NM_WMT; ++mt) mma_sp(acc[i][mt], a, b[mt], e);
    }
  };
  auto compute = [&](const Stage& s) {
    u32 tr[2][NM_NI];
#if NM_META == 0
    transpose_meta(s.meta, tr);
#endif
    compute_step(s, 0, tr);
    compute_step(s, 1, tr);
  };
#endif
#if NM_LOADS == 3
  {
    extern __shared__ __align__(1024) u8 ring[];
    __shared__ __align__(8) unsigned long long bars[NM_WARPS][NM_STAGES];
    const u32 pad = ((smem_addr(ring) + 1023) & ~1023u) - smem_addr(ring);  // the swizzle wants 1 KB alignment
    const u32 mine_s = smem_addr(ring) + pad + warp * NM_RING_BYTES, bar0 = smem_addr(&bars[warp][0]);
    const u8* const mine = ring + pad + warp * NM_RING_BYTES;
    const int meta_off = NM_STAGES * NM_STAGE_BYTES;  // the stages' metadata after the stages
    if (lane == 0) {
#pragma unroll
      for (int st = 0; st < NM_STAGES; ++st)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * st) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    const int steps = k >> 5;
    const int b_begin = blockIdx.y * per_block, b_end = p_end;  // pairs of consecutive steps [b_begin, b_end)
    const int count = b_begin + warp < b_end ? (b_end - b_begin - warp + NM_WARPS - 1) / NM_WARPS : 0;
    // Pair j of this warp (steps 2P, 2P + 1, P = b_begin + warp + j NM_WARPS) into stage st: lane 0 its tensor
    // copies, lanes 1 .. NM_SPAN / 64 a metadata copy each.
    auto issue = [&](int st, int j) {
      const int pp = b_begin + warp + j * NM_WARPS;
      const u32 dst = mine_s + st * NM_STAGE_BYTES, bar = bar0 + 8 * st;
      if (lane == 0) {
        bar_expect(bar, (NM_SPAN / 64) * (4096 + 512) + 1024);
#pragma unroll
        for (int bx = 0; bx < NM_SPAN / 64; ++bx) tensor_copy(dst + bx * 4096, &tmv, span0 + 64 * bx, 32 * pp, bar);
        tensor_copy(dst + NM_X_OFF, &tmx, 64 * pp, 0, bar);
      } else if (lane <= NM_SPAN / 64) {
        const int tile = (span0 >> 6) + lane - 1;
        const u32 meta_dst = mine_s + meta_off + st * NM_META_BYTES + (lane - 1) * 512;
        bulk_copy(meta_dst, idx + ((size_t)tile * steps + 2 * pp) * 256, 512, bar);
      }
    };
#pragma unroll
    for (int j = 0; j < NM_STAGES; ++j)
      if (j < count) issue(j, j);
    int st = 0;
    u32 parity = 0;
    const int cb = (col - span0) >> 6;                            // the lane's 64-column box
    const int chunk0 = (NM_CPL * g * 2 / 16) & 7;                 // its first 16-byte chunk in a box row
    for (int j = 0; j < count; ++j) {
      bar_wait(bar0 + 8 * st, parity);
      const u8* src = mine + st * NM_STAGE_BYTES;
      const u32 src_s = mine_s + st * NM_STAGE_BYTES;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        uint4 v[4][NM_CPL / 8], mq[4];  // compressed rows 2t, 2t+1, 2t+8, 2t+9; the lane's 64 metadata bytes
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int rr = 16 * q + 2 * t + (r & 1) + 8 * (r >> 1);
#pragma unroll
          for (int h = 0; h < NM_CPL / 8; ++h)
            v[r][h] = *reinterpret_cast<const uint4*>(src + cb * 4096 + rr * 128 + (((chunk0 + h) ^ (rr & 7)) << 4));
        }
        const uint4* msrc = reinterpret_cast<const uint4*>(mine + meta_off + st * NM_META_BYTES + cb * 512 + q * 256 +
                                                           ((col >> 4) & 3) * 64);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) mq[jj] = t < 2 ? msrc[jj] : uint4{0u, 0u, 0u, 0u};
        u32 b[4];
        {
          const int r = lane & 7;
          const u32 addr = src_s + NM_X_OFF + r * 128 + (((4 * q + (lane >> 3)) ^ r) << 4);
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                       : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(addr) : "memory");
        }
        u32 tr[2][NM_NI];
        cslt_meta(mq, col, t, tr);
#pragma unroll
        for (int i = 0; i < NM_NI; ++i) {
          u32 a[4];
          a[0] = pair_of(v[0], v[1], i);
          a[1] = pair_of(v[0], v[1], NM_NI + i);
          a[2] = pair_of(v[2], v[3], i);
          a[3] = pair_of(v[2], v[3], NM_NI + i);
          mma_sp(acc[i][0], a, b, meta_word(tr, i, 0));
        }
      }
      __syncwarp();  // every lane's reads of the stage are done before the copies refill it
      if (j + NM_STAGES < count) issue(st, j + NM_STAGES);
      if (++st == NM_STAGES) st = 0, parity ^= 1;
    }
  }
#elif NM_LOADS == 2
  {
    Stage s0, s1;  // two stages, used in turn (no copies between them: a copy would wait for its loads)
    int p = p_begin + kwarp;
    if (p < p_end) load(s0, p);
    while (p < p_end) {
      if (p + NM_KW < p_end) load(s1, p + NM_KW);
      compute(s0);
      p += NM_KW;
      if (p >= p_end) break;
      if (p + NM_KW < p_end) load(s0, p + NM_KW);
      compute(s1);
      p += NM_KW;
    }
  }
#elif NM_LOADS == 1
  for (int p = p_begin + kwarp; p < p_end; p += NM_KW) {
    Stage s;
    load(s, p);
    compute(s);
  }
#else
  for (int p = p_begin + kwarp; p < p_end; p += NM_KW) {
    Stage s;
    u32 tr[2][NM_NI];
    load_meta(s, p);
#if NM_META == 0
    transpose_meta(s.meta, tr);
#endif
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      load_step(s, p, q);
      compute_step(s, q, tr);
    }
  }
#endif
  // Partial sums meet in shared memory in fragment order, red[slot][e][lane] (no bank conflicts): warps of
  // steps 0 .. kSlots - 1 write their slot, the others add into slot kwarp % kSlots, kSlots at a time (the
  // NM_TSPLIT warps of one kwarp write different token tiles of it).
  for (int round = 0; round < NM_KW / kSlots; ++round) {
    if (kwarp / kSlots == round) {
#pragma unroll
      for (int i = 0; i < NM_NI; ++i)
#pragma unroll
        for (int mt = 0; mt < NM_WMT; ++mt)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            float* dst = &red[kwarp % kSlots][(i * NM_MT + mt0 + mt) * 4 + r][lane];
            *dst = round == 0 ? acc[i][mt][r] : *dst + acc[i][mt][r];
          }
    }
    __syncthreads();
  }
  // Entry e = (i, mt, r) of lane (g, t): token 8 mt + 2 t + (r & 1), column NM_CPL g + i + NI (r >> 1) of the
  // span (D fragment: c0, c1 = A row g, c2, c3 = A row g + 8; A row g + 8 h of instruction i = column
  // NM_CPL g + NI h + i).
#if NM_SPLIT > 1
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  for (int j = threadIdx.x; j < kEntries * 32; j += NM_WARPS * 32) {
    const int e = j >> 5, l = j & 31;
    float s = 0.f;
#pragma unroll
    for (int slot = 0; slot < kSlots; ++slot) s += red[slot][e][l];
    store_peer(&recv[blockIdx.y][e % kPer][l], (u32)(e / kPer), s);
  }
  cluster_sync();  // every block's stores into its peers are visible; no block reads a peer after this
  for (int j = threadIdx.x; j < kPer * 32; j += NM_WARPS * 32) {
    const int e = blockIdx.y * kPer + (j >> 5), l = j & 31;
    const int i = e / (4 * NM_MT), mt = (e >> 2) % NM_MT, r = e & 3;
    const int tok = 8 * mt + 2 * (l & 3) + (r & 1), c = NM_CPL * (l >> 2) + i + NM_NI * (r >> 1);
    float s = 0.f;
#pragma unroll
    for (int rank = 0; rank < NM_SPLIT; ++rank) s += recv[rank][j >> 5][l];
    if (tok < m) y[(size_t)tok * n + span0 + c] = to_bf16(s);
  }
#else
  for (int j = threadIdx.x; j < kEntries * 32; j += NM_WARPS * 32) {
    const int e = j >> 5, l = j & 31;
    const int i = e / (4 * NM_MT), mt = (e >> 2) % NM_MT, r = e & 3;
    const int tok = 8 * mt + 2 * (l & 3) + (r & 1), c = NM_CPL * (l >> 2) + i + NM_NI * (r >> 1);
    float s = 0.f;
#pragma unroll
    for (int slot = 0; slot < kSlots; ++slot) s += red[slot][e][l];
    if (tok < m) y[(size_t)tok * n + span0 + c] = to_bf16(s);
  }
#endif
}
