// y (M, N) = x (M, K) @ W for M <= 32 (decode), W a block-sparse (K, N) weight of (BS_BK, BS_BN) blocks stored as
// jaxsparse.BlockSparseMatrix stores it, on the tensor cores (mma.sync m16n8k16; compute capability 9.0+ for the
// thread block clusters). Compiled at run time by NVRTC (no includes), one build per define set below.
//
// Operands, row-major as JAX stores them:
//   x            (M, K) bf16 (fp16 with BS_F16);
//   data         (nnz, BS_BK, BS_BN), x's dtype: the kept blocks in row-major block order;
//   col_offsets  (N / BS_BN + 1) int32: block column c keeps blocks order[col_offsets[c] .. col_offsets[c + 1]);
//   order        (nnz) int32: the blocks in column-major order (BlockSparseMatrix.transpose_order);
//   rows         (nnz) int32: each block's block row;
//   y            (M, N), x's dtype.
//
// The product runs transposed, yᵀ = Wᵀ xᵀ, as nm24_decode.cu's does: Wᵀ is mma's A (16 rows = 16 columns of a
// block, 16 of K per step) and xᵀ is B (K x 8 tokens). A step is 16 rows of one kept block; the steps of block
// column c (its kept blocks x BS_BK / 16) are shared out over BS_SPLIT x BS_WARPS warps: the BS_SPLIT thread
// blocks of a cluster, BS_WARPS warps each, step s to warp s mod (BS_SPLIT BS_WARPS). Lane group g (lane / 4)
// loads BS_CPL consecutive columns of the step's 4 rows 2t, 2t + 1, 2t + 8, 2t + 9 (t = lane % 4) with 16-byte
// loads; instruction i takes column BS_CPL g + i as its A row g and BS_CPL g + BS_NI + i as row g + 8. Two steps
// are loaded before either is multiplied. The warps' partial sums meet in shared memory, the cluster's through
// distributed shared memory; each thread block writes a share of the column's outputs.

#ifndef BS_F16
#define BS_F16 0
#endif
#ifndef BS_BK
#define BS_BK 128
#endif
#ifndef BS_BN
#define BS_BN 128  // 64 or 128
#endif
#ifndef BS_MT
#define BS_MT 2  // token tiles of 8 rows: ceil(M / 8), at most 4
#endif
#ifndef BS_SPLIT
#define BS_SPLIT 1
#endif
#ifndef BS_WARPS
#define BS_WARPS 8
#endif

typedef unsigned int u32;
typedef unsigned short u16;

#define BS_CPL (BS_BN / 8)  // columns per lane group
#define BS_NI (BS_CPL / 2)  // instructions per step and token tile
#define BS_KSUB (BS_BK / 16)
#define BS_WORKERS (BS_SPLIT * BS_WARPS)

__device__ __forceinline__ u32 word_of(const uint4& v, int w) {
  return w == 0 ? v.x : (w == 1 ? v.y : (w == 2 ? v.z : v.w));
}

// (lo, hi) 16-bit pair: column j of `lo_row` and of `hi_row`, each BS_CPL columns in uint4s.
__device__ __forceinline__ u32 pair_of(const uint4* lo_row, const uint4* hi_row, int j) {
  const u32 a = word_of(lo_row[j >> 3], (j & 7) >> 1);
  const u32 b = word_of(hi_row[j >> 3], (j & 7) >> 1);
  return __byte_perm(a, b, (j & 1) ? 0x7632 : 0x5410);
}

__device__ __forceinline__ void mma(float* c, const u32* a, const u32* b) {
#if BS_F16
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ __forceinline__ u16 to_out(float f) {
  u16 r;
#if BS_F16
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
  return r;
}

#if BS_SPLIT > 1
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ float load_peer(const float* p, u32 rank) {
  u32 local = (u32)__cvta_generic_to_shared(p), remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
#endif

// The operands of step s of a column whose blocks start at `first` in `order`: the 4 rows of A (BS_CPL columns
// from `col` each) and the B fragments of the BS_MT token tiles.
struct Step {
  uint4 v[4][BS_CPL / 8];
  u32 b[BS_MT][2];
};

__device__ __forceinline__ void load_step(Step& st, int s, int first, const int* __restrict__ order,
                                          const int* __restrict__ rows, const u16* __restrict__ x,
                                          const u16* __restrict__ data, int m, int k, int col, int g, int t) {
  const int blk = __ldg(order + first + s / BS_KSUB), kk = s % BS_KSUB;
  const u16* base = data + (size_t)blk * (BS_BK * BS_BN) + (16 * kk) * BS_BN + col;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint4* src = reinterpret_cast<const uint4*>(base + (2 * t + (r & 1) + 8 * (r >> 1)) * BS_BN);
#pragma unroll
    for (int h = 0; h < BS_CPL / 8; ++h) st.v[r][h] = __ldg(src + h);
  }
  const int k0 = __ldg(rows + blk) * BS_BK + 16 * kk + 2 * t;
#pragma unroll
  for (int mt = 0; mt < BS_MT; ++mt) {
    const int tok = g + 8 * mt;
#pragma unroll
    for (int j = 0; j < 2; ++j)
      st.b[mt][j] = tok < m ? __ldg(reinterpret_cast<const u32*>(x + (size_t)tok * k + k0 + 8 * j)) : 0u;
  }
}

__device__ __forceinline__ void mma_step(float (*acc)[BS_MT][4], const Step& st) {
#pragma unroll
  for (int i = 0; i < BS_NI; ++i) {
    u32 a[4];
    a[0] = pair_of(st.v[0], st.v[1], i);          // row g, k 2t, 2t+1
    a[1] = pair_of(st.v[0], st.v[1], BS_NI + i);  // row g + 8
    a[2] = pair_of(st.v[2], st.v[3], i);          // row g, k 2t+8, 2t+9
    a[3] = pair_of(st.v[2], st.v[3], BS_NI + i);
#pragma unroll
    for (int mt = 0; mt < BS_MT; ++mt) mma(acc[i][mt], a, st.b[mt]);
  }
}

extern "C" __global__ void __launch_bounds__(BS_WARPS * 32)
#if BS_SPLIT > 1
    __cluster_dims__(1, BS_SPLIT, 1)
#endif
    bsr_decode(const u16* __restrict__ x, const u16* __restrict__ data, const int* __restrict__ col_offsets,
               const int* __restrict__ order, const int* __restrict__ rows, u16* __restrict__ y, int m, int k,
               int n) {
  constexpr int kEntries = 4 * BS_NI * BS_MT;  // accumulator registers per lane
  // Partial-sum slots: up to 4, within the 48 KB of static shared memory.
  constexpr int kMaxSlots = BS_WARPS < 4 ? BS_WARPS : 4;
  constexpr int kSlots = kMaxSlots * kEntries * 128 <= 49152 ? kMaxSlots : 2 * kEntries * 128 <= 49152 ? 2 : 1;
  __shared__ float red[kSlots][kEntries][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int c = blockIdx.x;
  const int col = BS_CPL * g;
  const int first = __ldg(col_offsets + c);
  const int steps = (__ldg(col_offsets + c + 1) - first) * BS_KSUB;
  const int worker = blockIdx.y * BS_WARPS + warp;

  float acc[BS_NI][BS_MT][4];
#pragma unroll
  for (int i = 0; i < BS_NI; ++i)
#pragma unroll
    for (int mt = 0; mt < BS_MT; ++mt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][mt][r] = 0.f;

  Step s0, s1;
  for (int s = worker; s < steps; s += 2 * BS_WORKERS) {
    load_step(s0, s, first, order, rows, x, data, m, k, col, g, t);
    const bool two = s + BS_WORKERS < steps;
    if (two) load_step(s1, s + BS_WORKERS, first, order, rows, x, data, m, k, col, g, t);
    mma_step(acc, s0);
    if (two) mma_step(acc, s1);
  }
  // Partial sums meet in shared memory in fragment order, red[slot][e][lane]: warps 0 .. kSlots - 1 write their
  // slot, the others add into slot warp % kSlots, kSlots warps at a time.
  for (int round = 0; round < BS_WARPS / kSlots; ++round) {
    if (warp / kSlots == round) {
#pragma unroll
      for (int i = 0; i < BS_NI; ++i)
#pragma unroll
        for (int mt = 0; mt < BS_MT; ++mt)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            float* dst = &red[warp % kSlots][(i * BS_MT + mt) * 4 + r][lane];
            *dst = round == 0 ? acc[i][mt][r] : *dst + acc[i][mt][r];
          }
    }
    __syncthreads();
  }
  // Entry e = (i, mt, r) of lane (g, t): token 8 mt + 2 t + (r & 1), column BS_CPL g + i + BS_NI (r >> 1) of the
  // block column (D fragment: c0, c1 = A row g, c2, c3 = A row g + 8).
#if BS_SPLIT > 1
  for (int j = threadIdx.x; j < kEntries * 32; j += BS_WARPS * 32) {
    const int e = j >> 5, l = j & 31;
    float s = 0.f;
#pragma unroll
    for (int slot = 0; slot < kSlots; ++slot) s += red[slot][e][l];
    red[0][e][l] = s;
  }
  cluster_sync();
  // Block `rank` of the cluster adds entries [rank, rank + 1) * kEntries / BS_SPLIT of every block.
  constexpr int kPer = kEntries / BS_SPLIT;
  for (int j = threadIdx.x; j < kPer * 32; j += BS_WARPS * 32) {
    const int e = blockIdx.y * kPer + (j >> 5), l = j & 31;
    const int i = e / (4 * BS_MT), mt = (e >> 2) % BS_MT, r = e & 3;
    const int tok = 8 * mt + 2 * (l & 3) + (r & 1), cc = BS_CPL * (l >> 2) + i + BS_NI * (r >> 1);
    float s = 0.f;
#pragma unroll
    for (int rank = 0; rank < BS_SPLIT; ++rank) s += load_peer(&red[0][e][l], (u32)rank);
    if (tok < m) y[(size_t)tok * n + c * BS_BN + cc] = to_out(s);
  }
  cluster_sync();
#else
  for (int j = threadIdx.x; j < kEntries * 32; j += BS_WARPS * 32) {
    const int e = j >> 5, l = j & 31;
    const int i = e / (4 * BS_MT), mt = (e >> 2) % BS_MT, r = e & 3;
    const int tok = 8 * mt + 2 * (l & 3) + (r & 1), cc = BS_CPL * (l >> 2) + i + BS_NI * (r >> 1);
    float s = 0.f;
#pragma unroll
    for (int slot = 0; slot < kSlots; ++slot) s += red[slot][e][l];
    if (tok < m) y[(size_t)tok * n + c * BS_BN + cc] = to_out(s);
  }
#endif
}
