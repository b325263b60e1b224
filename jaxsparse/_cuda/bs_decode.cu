// y (M, N) = x (M, K) @ W for M <= 16 (decode), W a block-sparse 16-bit (K, N) weight stored as
// jaxsparse.BlockSparseMatrix stores it (kept blocks `data` (nnz, BK, BN) in row-major block order,
// `row_indices`, and the column-major listing `col_offsets` / `transpose_order`), on the tensor cores
// (mma.sync m16n8k16, float32 accumulation). Compiled at run time by NVRTC after cuda_common.cuh, one
// build per (BS_BK, BS_BN, BS_MT, BS_SPLIT, BS_WARPS, BS_F16).
//
// As in nm24_decode.cu the product runs transposed, yᵀ = Wᵀ xᵀ: an instruction's A is 16 columns of a
// block x 16 rows of it, B is 16 entries of x for 8 tokens. The thread blocks of block column j (a cluster
// of BS_SPLIT) share its work items, (kept block, 16-row step) pairs, and each warp takes every BS_WARPS-th
// item of its block's share. Lane group g owns BS_BN / 8 consecutive columns of the block column (one or
// two 16-byte loads per block row); instruction i takes column LC g + i as A row g and LC g + LC / 2 + i
// as A row g + 8. Before the loop each lane reads the block position and block row of one of the warp's
// first 32 items, so that the items' loads do not wait on index loads one after the other. Partial sums
// meet in shared memory and, across the cluster, through distributed shared memory (one kernel).

#ifndef BS_BK
#define BS_BK 128
#endif
#ifndef BS_BN
#define BS_BN 128
#endif
#ifndef BS_MT
#define BS_MT 2  // token tiles of 8 rows
#endif
#ifndef BS_SPLIT
#define BS_SPLIT 1
#endif
#ifndef BS_WARPS
#define BS_WARPS 4
#endif
#ifndef BS_F16
#define BS_F16 0  // 0: bfloat16, 1: float16
#endif

#define BS_LC (BS_BN / 8)  // columns per lane
#define BS_NI (BS_LC / 2)  // instructions per 16-row step
#define BS_SPB (BS_BK / 16)  // 16-row steps per block

__device__ __forceinline__ void mma_dense(float* c, const u32* a, const u32* b) {
#if BS_F16
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// BS_LC / 2 words of a block row starting at `p` (16-byte aligned for BS_LC >= 8, 8-byte for 4).
__device__ __forceinline__ void load_row(const u16* p, u32* out) {
#if BS_LC == 16
  const uint4 a = __ldg(reinterpret_cast<const uint4*>(p)), b = __ldg(reinterpret_cast<const uint4*>(p) + 1);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w; out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
#elif BS_LC == 8
  const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
#else
  const uint2 a = __ldg(reinterpret_cast<const uint2*>(p));
  out[0] = a.x; out[1] = a.y;
#endif
}

extern "C" __global__ void __launch_bounds__(BS_WARPS * 32)
#if BS_SPLIT > 1
    __cluster_dims__(1, BS_SPLIT, 1)
#endif
    bs_decode(const u16* __restrict__ x, const u16* __restrict__ data, const int* __restrict__ row_indices,
              const int* __restrict__ col_offsets, const int* __restrict__ transpose_order, u16* __restrict__ y,
              int m, int k, int n) {
  constexpr int kSlots = BS_WARPS < 4 ? BS_WARPS : 4;
  constexpr int kEntries = BS_NI * BS_MT * 4;
  __shared__ float red[kSlots][kEntries][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int j = blockIdx.x;
  const int c0 = __ldg(col_offsets + j);
  const int items = (__ldg(col_offsets + j + 1) - c0) * BS_SPB;
  const int per_block = (items + BS_SPLIT - 1) / BS_SPLIT;
  const int begin = blockIdx.y * per_block;
  const int end = min(items, begin + per_block);
  const int first = begin + warp;
  const int count = first < end ? (end - first + BS_WARPS - 1) / BS_WARPS : 0;

  float acc[BS_NI][BS_MT][4];
#pragma unroll
  for (int i = 0; i < BS_NI; ++i)
#pragma unroll
    for (int mt = 0; mt < BS_MT; ++mt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][mt][r] = 0.f;

  for (int base = 0; base < count; base += 32) {
    // Lane L: block position and block row of the warp's item base + L.
    int my_b = 0, my_row = 0;
    if (base + lane < count) {
      const int item = first + (base + lane) * BS_WARPS;
      my_b = __ldg(transpose_order + c0 + item / BS_SPB);
      my_row = __ldg(row_indices + my_b);
    }
    const int n_here = min(32, count - base);
    for (int q = 0; q < n_here; ++q) {
      const int item = first + (base + q) * BS_WARPS;
      const int b = __shfl_sync(0xffffffffu, my_b, q), row = __shfl_sync(0xffffffffu, my_row, q);
      const int s = item % BS_SPB;
      // Rows 2t, 2t+1, 2t+8, 2t+9 of the step, the lane's BS_LC columns each.
      const u16* blk = data + ((size_t)b * BS_BK + 16 * s) * BS_BN + BS_LC * g;
      u32 v[4][BS_LC / 2];
#pragma unroll
      for (int r = 0; r < 4; ++r) load_row(blk + (2 * t + (r & 1) + 8 * (r >> 1)) * BS_BN, v[r]);
      const int kk = row * BS_BK + 16 * s;
      u32 bf[BS_MT][2];
#pragma unroll
      for (int mt = 0; mt < BS_MT; ++mt) {
        const int tok = g + 8 * mt;
#pragma unroll
        for (int h = 0; h < 2; ++h)
          bf[mt][h] = tok < m ? __ldg(reinterpret_cast<const u32*>(x + (size_t)tok * k + kk + 8 * h + 2 * t)) : 0u;
      }
#pragma unroll
      for (int i = 0; i < BS_NI; ++i) {
        u32 a[4];
        a[0] = pair_of_words(v[0], v[1], i);               // A row g, k 2t, 2t+1
        a[1] = pair_of_words(v[0], v[1], BS_LC / 2 + i);   // A row g + 8
        a[2] = pair_of_words(v[2], v[3], i);               // A row g, k 2t+8, 2t+9
        a[3] = pair_of_words(v[2], v[3], BS_LC / 2 + i);
#pragma unroll
        for (int mt = 0; mt < BS_MT; ++mt) mma_dense(acc[i][mt], a, bf[mt]);
      }
    }
  }

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
  // Entry e = (i, mt, r) of lane (g, t): token 8 mt + 2 t + (r & 1), column LC g + i + LC / 2 (r >> 1).
  auto store = [&](int e, int l, float v) {
    const int i = e / (4 * BS_MT), mt = (e >> 2) % BS_MT, r = e & 3;
    const int tok = 8 * mt + 2 * (l & 3) + (r & 1), c = BS_LC * (l >> 2) + i + (BS_LC / 2) * (r >> 1);
    if (tok < m) y[(size_t)tok * n + j * BS_BN + c] = BS_F16 ? to_f16(v) : to_bf16(v);
  };
#if BS_SPLIT > 1
  for (int idx = threadIdx.x; idx < kEntries * 32; idx += BS_WARPS * 32) {
    const int e = idx >> 5, l = idx & 31;
    float s = 0.f;
#pragma unroll
    for (int slot = 0; slot < kSlots; ++slot) s += red[slot][e][l];
    red[0][e][l] = s;
  }
  cluster_sync();
  constexpr int kPer = (kEntries + BS_SPLIT - 1) / BS_SPLIT;
  for (int idx = threadIdx.x; idx < kPer * 32; idx += BS_WARPS * 32) {
    const int e = blockIdx.y * kPer + (idx >> 5), l = idx & 31;
    if (e < kEntries) {
      float s = 0.f;
#pragma unroll
      for (int rank = 0; rank < BS_SPLIT; ++rank) s += load_peer(&red[0][e][l], (u32)rank);
      store(e, l, s);
    }
  }
  cluster_sync();
#else
  for (int idx = threadIdx.x; idx < kEntries * 32; idx += BS_WARPS * 32) {
    const int e = idx >> 5, l = idx & 31;
    float s = 0.f;
#pragma unroll
    for (int slot = 0; slot < kSlots; ++slot) s += red[slot][e][l];
    store(e, l, s);
  }
#endif
}
