// y (M, N) = x (M, K) @ W for M <= 8 (decode), W a block-sparse (K, N) 16-bit weight stored as
// jaxsparse.BlockSparseMatrix stores it, blocks (BS_BK, BS_BN) with both dims multiples of 64, on the tensor cores
// (mma.sync m16n8k16), the weight streamed by bulk tensor copies (TMA; compute capability 9.0+).
// Compiled at run time by NVRTC (its one include, copies.cuh, handed over as a header), one build per (BS_BK,
// BS_BN, BS_WARPS, BS_SPLIT, BS_STAGES, BS_F16, BS_OUT_F32).
//
// Operands:
//   col_offsets (N / BN + 1,) int32, order (nnz,) int32, rows (nnz,) int32: BlockSparseMatrix.col_offsets,
//           .transpose_order and .row_indices (the kept blocks of block column j are data[order[t]] for t in
//           col_offsets[j] .. col_offsets[j + 1], in block row rows[order[t]]);
//   y       (M, N) of the input dtype (BS_OUT_F32 0) or float32 (1), row-major;
//   tmw     a tensor map of data (nnz, BK, BN) seen as (nnz BK, BN), boxes of 64 columns x 64 rows (128-byte swizzle);
//   tmx     a tensor map of x (M, K), boxes of 64 columns x 8 rows (rows past M: the copy's zero fill).
// Index values are read as they are but never outside their arrays: offsets are clamped into [0, nnz], a block id
// outside [0, nnz) or a block row outside [0, K / BK) reads the tensor copies' zero fill (no fault, as for the other
// GPU routes the op documents: BlockSparseMatrix.validate checks the arrays).
//
// The product runs transposed, yᵀ = Wᵀ xᵀ: a 64 x 64 tile of W (64 columns, 64 rows of K) gives mma's A (16
// columns x 16 of K per instruction, ldmatrix.trans from the swizzled tile) and 8 tokens of x its B (ldmatrix). A unit
// of work is one such tile of a kept block and x's matching 64 columns (9 KB). Thread block (j, s) takes block column
// j (the grid's x) and the s-th of BS_SPLIT slices of its kept blocks (a cluster along y); its warps take the block's
// 64-column boxes in turn (warp w: box w % (BN / 64)) and, for their box, every (BS_WARPS / boxes)-th unit. Each warp
// streams its units through a ring of BS_STAGES stages in dynamic shared memory, BS_STAGES - 1 units ahead of its
// products, arrivals counted on mbarriers; its units' block ids and rows are read 32 at a time, a lane each. Partial
// sums meet in shared memory, then across the cluster through distributed shared memory (as in nm24_decode.cu).

#ifndef BS_BK
#define BS_BK 64
#endif
#ifndef BS_BN
#define BS_BN 64
#endif
#ifndef BS_WARPS
#define BS_WARPS 4
#endif
#ifndef BS_SPLIT
#define BS_SPLIT 1  // thread blocks per block column, each a slice of its kept blocks (a cluster)
#endif
#ifndef BS_STAGES
#define BS_STAGES 2
#endif
#ifndef BS_F16
#define BS_F16 0  // 0: bfloat16 operands, 1: float16
#endif
#ifndef BS_OUT_F32
#define BS_OUT_F32 0  // 0: y in the operands' dtype, 1: float32
#endif

#define BS_BOXES (BS_BN / 64)          // 64-column boxes of a block
#define BS_KSUB (BS_BK / 64)           // 64-row slices of a block: units per kept block and box
#define BS_WPB (BS_WARPS / BS_BOXES)   // warps per box
#define BS_UNIT_BYTES (8192 + 1024)    // a stage: the 64 x 64 tile of W, then 8 x 64 of x
#define BS_ENTRIES 16                  // accumulator registers per lane: 4 instructions' tiles (64 columns) x 4
#define BS_OUT_PER (BS_BOXES * BS_ENTRIES * 32 / BS_SPLIT)  // the outputs (as red entries) a cluster rank owns
#if BS_BK % 64 || BS_BN % 64 || BS_WARPS % BS_BOXES
#error "BS_BK and BS_BN must be multiples of 64, BS_WARPS a multiple of BS_BN / 64"
#endif

typedef unsigned int u32;
typedef unsigned short u16;

#include "copies.cuh"

__device__ __forceinline__ void mma(float* c, const u32* a, const u32* b) {
#if BS_F16
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#endif
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#if BS_OUT_F32
typedef float out_t;
__device__ __forceinline__ float to_out(float f) { return f; }
#else
typedef u16 out_t;
__device__ __forceinline__ u16 to_out(float f) {
  u16 r;
#if BS_F16
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
  return r;
}
#endif


extern "C" __global__ void __launch_bounds__(BS_WARPS * 32, 1)
#if BS_SPLIT > 1
    __cluster_dims__(1, BS_SPLIT, 1)
#endif
    block_sparse_decode(const int* __restrict__ col_offsets, const int* __restrict__ order,
                        const int* __restrict__ rows, out_t* __restrict__ y, int m, int k, int n, int nnz,
                        const __grid_constant__ TensorMap tmw, const __grid_constant__ TensorMap tmx) {
  extern __shared__ __align__(1024) unsigned char ring[];
  __shared__ __align__(8) unsigned long long bars[BS_WARPS][BS_STAGES];
  __shared__ float red[BS_WARPS][BS_ENTRIES][32];
#if BS_SPLIT > 1
  __shared__ float recv[BS_SPLIT][BS_OUT_PER];
  // Arrive now, wait before the first store into a peer: every block of the cluster has started by then.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int box = warp % BS_BOXES, wi = warp / BS_BOXES;
  const int j = blockIdx.x;

  // This thread block's slice of block column j's kept blocks, offsets clamped into [0, nnz].
  int begin = min(max(__ldg(col_offsets + j), 0), nnz), end = min(max(__ldg(col_offsets + j + 1), 0), nnz);
  end = max(end, begin);
  const int per = (end - begin + BS_SPLIT - 1) / BS_SPLIT;
  const int e0 = min(end, begin + (int)blockIdx.y * per), e1 = min(end, e0 + per);
  const int units = (e1 - e0) * BS_KSUB;  // of each box
  const int count = wi < units ? (units - wi + BS_WPB - 1) / BS_WPB : 0;  // this warp's: wi, wi + BS_WPB, ...

  const u32 pad = ((smem_addr(ring) + 1023) & ~1023u) - smem_addr(ring);  // the swizzle wants 1 KB alignment
  const u32 mine_s = smem_addr(ring) + pad + warp * (BS_STAGES * BS_UNIT_BYTES);
  const u32 bar0 = smem_addr(&bars[warp][0]);
  if (lane == 0) {
#pragma unroll
    for (int st = 0; st < BS_STAGES; ++st)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * st) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();

  // The tensor-copy coordinates of this warp's units, 32 at a time (lane l: unit 32 chunk + l): the W tile's first
  // row (block id * BK + 64 * slice; nnz * BK, past the tensor, for a bad id) and x's first column (block row * BK +
  // 64 * slice; K, past x, for a bad row). The block ids come first: a unit's W tile is requested before its block
  // row is read (a second dependent load), its x tile after.
  int chunk = -1, b = -1, wrow = 0, xcol = 0;
  auto fetch_ids = [&](int c) {
    chunk = c;
    const int u = c * 32 + lane, unit = wi + u * BS_WPB;
    b = u < count ? __ldg(order + e0 + unit / BS_KSUB) : -1;
    wrow = b >= 0 && b < nnz ? b * BS_BK + 64 * (unit % BS_KSUB) : nnz * BS_BK;
  };
  auto fetch_rows = [&]() {
    const int unit = wi + (chunk * 32 + lane) * BS_WPB;
    const int r = b >= 0 && b < nnz ? __ldg(rows + b) : -1;
    xcol = r >= 0 && r < k / BS_BK ? r * BS_BK + 64 * (unit % BS_KSUB) : k;
  };
  auto issue_w = [&](int st, int u) {
    const int c1 = __shfl_sync(0xffffffffu, wrow, u & 31);
    if (lane == 0) {
      bar_expect(bar0 + 8 * st, BS_UNIT_BYTES);  // both copies' bytes: the x tile's completes the stage
      tensor_copy(mine_s + st * BS_UNIT_BYTES, &tmw, 64 * box, c1, bar0 + 8 * st);
    }
  };
  auto issue_x = [&](int st, int u) {
    const int c0 = __shfl_sync(0xffffffffu, xcol, u & 31);
    if (lane == 0) tensor_copy(mine_s + st * BS_UNIT_BYTES + 8192, &tmx, c0, 0, bar0 + 8 * st);
  };
  auto issue = [&](int st, int u) {
    if ((u >> 5) != chunk) fetch_ids(u >> 5), fetch_rows();
    issue_w(st, u);
    issue_x(st, u);
  };

  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[i][r] = 0.f;
  fetch_ids(0);  // the first stages' W tiles, then their x tiles (BS_STAGES <= 32: one chunk)
#pragma unroll
  for (int u = 0; u < BS_STAGES; ++u)
    if (u < count) issue_w(u, u);
  fetch_rows();
#pragma unroll
  for (int u = 0; u < BS_STAGES; ++u)
    if (u < count) issue_x(u, u);
  int st = 0;
  u32 parity = 0;
  for (int u = 0; u < count; ++u) {
    bar_wait(bar0 + 8 * st, parity);
    const u32 tile = mine_s + st * BS_UNIT_BYTES, xs = tile + 8192;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {  // 32 of K at a time: one ldmatrix of x, two k16 steps
      u32 b[4];
      {
        const int r = lane & 7;  // lane l: row l % 8 (token) of matrix l / 8 (8 of K each)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                     : "r"(xs + r * 128 + (((4 * kk + (lane >> 3)) ^ r) << 4)) : "memory");
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int k0 = 32 * kk + 16 * q;
        // Lane l: row k0 + l % 8 + 8 (l / 16) of the tile (K), 16-byte chunk (l / 8) % 2 of the instruction's 16
        // columns; .trans gives A = Wᵀ's fragment (matrix 0: A rows 0-7, K 0-7; 1: rows 8-15; 2, 3: K 8-15).
        const int kr = k0 + (lane & 7) + 8 * (lane >> 4), half = (lane >> 3) & 1;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          u32 a[4];
          const u32 addr = tile + kr * 128 + (((2 * i + half) ^ (kr & 7)) << 4);
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                       : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr) : "memory");
          mma(acc[i], a, b + 2 * q);
        }
      }
    }
    __syncwarp();  // every lane's reads of the stage are done before the copies refill it
    if (u + BS_STAGES < count) issue(st, u + BS_STAGES);
    if (++st == BS_STAGES) st = 0, parity ^= 1;
  }

  // Entry e = 4 i + r of lane (g, t): column 16 i + g + 8 (r / 2) of the warp's box, token 2 t + (r % 2).
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) red[warp][4 * i + r][lane] = acc[i][r];
  __syncthreads();
  // Output q (0 .. BOXES * 512): box q / 512, entry (q / 32) % 16, lane q % 32; the sum over the box's warps.
  auto partial = [&](int q) {
    const int bx = q >> 9, e = (q >> 5) & 15, l = q & 31;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < BS_WPB; ++w) s += red[bx + w * BS_BOXES][e][l];
    return s;
  };
  auto write = [&](int q, float s) {
    const int bx = q >> 9, e = (q >> 5) & 15, l = q & 31;
    const int i = e >> 2, r = e & 3;
    const int tok = 2 * (l & 3) + (r & 1), c = 64 * bx + 16 * i + (l >> 2) + 8 * (r >> 1);
    if (tok < m) y[(size_t)tok * n + (size_t)j * BS_BN + c] = to_out(s);
  };
#if BS_SPLIT > 1
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  for (int q = threadIdx.x; q < BS_BOXES * 512; q += BS_WARPS * 32)
    store_peer(&recv[blockIdx.y][q % BS_OUT_PER], (u32)(q / BS_OUT_PER), partial(q));
  cluster_sync();  // every block's stores into its peers are visible; no block reads a peer after this
  for (int q = threadIdx.x; q < BS_OUT_PER; q += BS_WARPS * 32) {
    float s = 0.f;
#pragma unroll
    for (int rank = 0; rank < BS_SPLIT; ++rank) s += recv[rank][q];
    write(blockIdx.y * BS_OUT_PER + q, s);
  }
#else
  for (int q = threadIdx.x; q < BS_BOXES * 512; q += BS_WARPS * 32) write(q, partial(q));
#endif
}
