// CPU kernels for block-sparse products (the layout of jaxsparse.BlockSparseMatrix), registered with
// XLA as FFI custom calls.
//
// W (K, N) keeps nnz blocks of (bk, bn); data (nnz, bk, bn) holds them in row-major block order.
// Every product is a sum of small dense products, one per kept block:
//   forward  y[:, col j]      = sum_{blocks (i, j)} x[:, row i] @ data[b]        (by block column)
//   dX       dx[:, row i]     = sum_{blocks (i, j)} dy[:, col j] @ data[b]^T     (by block row)
//   dW       ddata[b]         = x[:, row i]^T @ dy[:, col j]                      (per block)
// where "row i" is the slab of bk columns of x that block row i multiplies. x and dy are first
// packed slab by slab into contiguous (B, bk) / (B, bn) arrays. Each product then runs a register-
// blocked micro-kernel: a 6 x 16 tile of the output stays in 12 AVX registers while every
// contributing block streams through it (two vector loads and six broadcasts per 12 FMAs), so the
// output is written once. Work items (block columns, block rows) go to the calling thread and the
// threads of XLA's intra-op pool. Requires bk and bn to be multiples of 8 (the caller checks).

#include "common.h"

namespace {

constexpr int kTileRows = 6;  // output rows per micro-tile
constexpr int kTileVecs = 2;  // output vectors (16 floats) per micro-tile

// C[r][0 : 8 V] = sum_q sum_s A_q[r * a_rs + s * a_ss] * B_q[s * ldb + 0 : 8 V] for r < R, where
// A_q = a[q] + a_off and B_q = b[q] + b_off.
template <int R, int V>
inline void GemmTile(int64_t nq, const float* const* a, int64_t a_off, int64_t a_rs, int64_t a_ss,
                     const float* const* b, int64_t b_off, int64_t ldb, int64_t steps, float* c, int64_t ldc) {
  v8 acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = v8{};
  }
  for (int64_t q = 0; q < nq; ++q) {
    const float* ap = a[q] + a_off;
    const float* bp = b[q] + b_off;
    for (int64_t s = 0; s < steps; ++s) {
      v8 bv[V];
      for (int v = 0; v < V; ++v) bv[v] = Load8(bp + s * ldb + kLanes * v);
      for (int r = 0; r < R; ++r) {
        const v8 av = Splat8(ap[r * a_rs + s * a_ss]);
        for (int v = 0; v < V; ++v) acc[r][v] += av * bv[v];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) Store8(c + r * ldc + kLanes * v, acc[r][v]);
  }
}

template <int R>
inline void GemmTileV(int64_t vecs, int64_t nq, const float* const* a, int64_t a_off, int64_t a_rs, int64_t a_ss,
                      const float* const* b, int64_t b_off, int64_t ldb, int64_t steps, float* c, int64_t ldc) {
  if (vecs == 2) return GemmTile<R, 2>(nq, a, a_off, a_rs, a_ss, b, b_off, ldb, steps, c, ldc);
  GemmTile<R, 1>(nq, a, a_off, a_rs, a_ss, b, b_off, ldb, steps, c, ldc);
}

// C (rows, cols) = sum_q A_q (rows, steps) @ B_q (steps, cols) with A_q[r, s] = a[q][r * a_rs + s * a_ss],
// B_q[s, j] = b[q][s * ldb + j] and C[r, j] = c[r * ldc + j]; cols is a multiple of 8. With nq == 0,
// C is zeroed.
void Gemm(int64_t rows, int64_t cols, int64_t nq, const float* const* a, int64_t a_rs, int64_t a_ss,
          const float* const* b, int64_t ldb, int64_t steps, float* c, int64_t ldc) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t rn = std::min<int64_t>(kTileRows, rows - r0);
    for (int64_t c0 = 0; c0 < cols; c0 += kTileVecs * kLanes) {
      const int64_t vecs = std::min<int64_t>(kTileVecs, (cols - c0) / kLanes);
      const int64_t a_off = r0 * a_rs;
      float* ct = c + r0 * ldc + c0;
      switch (rn) {
        case 6: GemmTileV<6>(vecs, nq, a, a_off, a_rs, a_ss, b, c0, ldb, steps, ct, ldc); break;
        case 5: GemmTileV<5>(vecs, nq, a, a_off, a_rs, a_ss, b, c0, ldb, steps, ct, ldc); break;
        case 4: GemmTileV<4>(vecs, nq, a, a_off, a_rs, a_ss, b, c0, ldb, steps, ct, ldc); break;
        case 3: GemmTileV<3>(vecs, nq, a, a_off, a_rs, a_ss, b, c0, ldb, steps, ct, ldc); break;
        case 2: GemmTileV<2>(vecs, nq, a, a_off, a_rs, a_ss, b, c0, ldb, steps, ct, ldc); break;
        default: GemmTileV<1>(vecs, nq, a, a_off, a_rs, a_ss, b, c0, ldb, steps, ct, ldc); break;
      }
    }
  }
}

// src (rows, d) row-major -> d / bw slabs, slab i = src[:, i bw : (i + 1) bw] as a contiguous
// (rows, bw) array, in scratch buffer `slot`.
const float* PackSlabs(const Scheduler& pool, const float* src, int64_t rows, int64_t d, int64_t bw, int slot) {
  float* dst = CachedBuffer(slot, rows * d);
  ParallelFor(pool, d / bw, [&](int64_t i) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + (i * rows + r) * bw, src + r * d + i * bw, bw * sizeof(float));
  });
  return dst;
}

struct BlockScratch {
  std::vector<const float*> a, b;
  std::vector<float> transposed;
};
BlockScratch& ThreadBlockScratch() {
  thread_local BlockScratch s;
  return s;
}

// row_offsets, col_indices and row_indices describe one matrix: block row i's segment of row_offsets holds exactly
// the blocks with row_indices == i, in increasing block columns (no block twice). Ranges checked first. O(nnz).
// Returns an error message, or "".
std::string RowIndexError(const int32_t* row_offsets, const int32_t* col_indices, const int32_t* row_indices,
                          int64_t kb) {
  for (int64_t i = 0; i < kb; ++i) {
    int64_t last_col = -1;
    for (int64_t t = row_offsets[i]; t < row_offsets[i + 1]; ++t) {
      if (row_indices[t] != i) {
        return "row_offsets put block " + std::to_string(t) + " in block row " + std::to_string(i) +
               ", row_indices in " + std::to_string(row_indices[t]);
      }
      if (col_indices[t] <= last_col) {
        return "block row " + std::to_string(i) + " does not list its blocks in increasing block columns "
               "(col_indices; a block kept twice?)";
      }
      last_col = col_indices[t];
    }
  }
  return "";
}

// All five index arrays describe one matrix, that of to_dense(): the row arrays agree (RowIndexError), and
// transpose_order is a permutation of [0, nnz) whose column j segment holds exactly the blocks with
// col_indices == j, in increasing block rows. The forward reads col_offsets, transpose_order and row_indices; a
// matrix whose arrays disagree would give another matrix's product. Ranges checked first. O(nnz).
std::string ForwardIndexError(const int32_t* row_indices, const int32_t* col_offsets, const int32_t* transpose_order,
                              const int32_t* col_indices, const int32_t* row_offsets, int64_t nnz, int64_t kb,
                              int64_t nb) {
  const std::string rows = RowIndexError(row_offsets, col_indices, row_indices, kb);
  if (!rows.empty()) return rows;
  std::vector<char> seen(static_cast<size_t>(nnz), 0);
  for (int64_t j = 0; j < nb; ++j) {
    int64_t last_row = -1;
    for (int64_t t = col_offsets[j]; t < col_offsets[j + 1]; ++t) {
      const int32_t blk = transpose_order[t];
      if (seen[blk]) return "transpose_order is not a permutation of [0, nnz): block " + std::to_string(blk) + " twice";
      seen[blk] = 1;
      if (col_indices[blk] != j) {
        return "transpose_order / col_offsets put block " + std::to_string(blk) + " in block column " +
               std::to_string(j) + ", col_indices in " + std::to_string(col_indices[blk]);
      }
      if (row_indices[blk] <= last_row) {
        return "block column " + std::to_string(j) + " does not list its blocks in increasing block rows "
               "(row_indices / transpose_order; a block kept twice?)";
      }
      last_row = row_indices[blk];
    }
  }
  return "";
}

// y (b, n) = x (b, k) @ W. Returns an error message for invalid index arrays, else "".
std::string BlockForwardKernel(const Scheduler& pool, const float* x, const float* data, const int32_t* row_indices,
                               const int32_t* col_offsets, const int32_t* transpose_order, const int32_t* col_indices,
                               const int32_t* row_offsets, int64_t b, int64_t k, int64_t n, int64_t nnz, int64_t bk,
                               int64_t bn, float* y) {
  const int64_t kb = k / bk, nb = n / bn;
  if (!ValidOffsets(col_offsets, nb, nnz)) return "col_offsets is not an offset array for nnz=" + std::to_string(nnz);
  if (!ValidOffsets(row_offsets, kb, nnz)) return "row_offsets is not an offset array for nnz=" + std::to_string(nnz);
  if (!InRange(transpose_order, nnz, nnz)) return "transpose_order has entries outside [0, nnz)";
  if (!InRange(row_indices, nnz, kb)) return "row_indices has entries outside [0, " + std::to_string(kb) + ")";
  if (!InRange(col_indices, nnz, nb)) return "col_indices has entries outside [0, " + std::to_string(nb) + ")";
  const std::string bad = ForwardIndexError(row_indices, col_offsets, transpose_order, col_indices, row_offsets, nnz,
                                                kb, nb);
  if (!bad.empty()) return bad;
  if (b == 0 || n == 0) return "";
  const float* xs = PackSlabs(pool, x, b, k, bk, 0);
  ParallelFor(pool, nb, [&](int64_t j) {
    BlockScratch& s = ThreadBlockScratch();
    const int32_t t0 = col_offsets[j], nq = col_offsets[j + 1] - t0;
    Resize(s.a, nq);
    Resize(s.b, nq);
    for (int32_t q = 0; q < nq; ++q) {
      const int64_t blk = transpose_order[t0 + q];
      s.a[q] = xs + row_indices[blk] * b * bk;
      s.b[q] = data + blk * bk * bn;
    }
    Gemm(b, bn, nq, s.a.data(), bk, 1, s.b.data(), bn, bk, y + j * bn, n);
  });
  return "";
}

// dx (b, k) = dy (b, n) @ W.T; ddata (nnz, bk, bn) = (x.T @ dy) on the kept blocks.
std::string BlockBackwardKernel(const Scheduler& pool, const float* x, const float* data, const int32_t* row_offsets,
                                const int32_t* col_indices, const int32_t* row_indices, const float* dy, int64_t b,
                                int64_t k, int64_t n, int64_t nnz, int64_t bk, int64_t bn, float* dx, float* ddata) {
  const int64_t kb = k / bk, nb = n / bn;
  if (!ValidOffsets(row_offsets, kb, nnz)) return "row_offsets is not an offset array for nnz=" + std::to_string(nnz);
  if (!InRange(col_indices, nnz, nb)) return "col_indices has entries outside [0, " + std::to_string(nb) + ")";
  if (!InRange(row_indices, nnz, kb)) return "row_indices has entries outside [0, " + std::to_string(kb) + ")";
  const std::string bad = RowIndexError(row_offsets, col_indices, row_indices, kb);
  if (!bad.empty()) return bad;
  if (k == 0) return "";
  if (b == 0 || n == 0) {
    std::memset(ddata, 0, sizeof(float) * nnz * bk * bn);
    std::memset(dx, 0, sizeof(float) * b * k);
    return "";
  }
  AdviseHugePages(ddata, nnz * bk * bn * static_cast<int64_t>(sizeof(float)));
  const float* xs = PackSlabs(pool, x, b, k, bk, 0);
  const float* dys = PackSlabs(pool, dy, b, n, bn, 1);
  ParallelFor(pool, kb, [&](int64_t i) {
    BlockScratch& s = ThreadBlockScratch();
    const int32_t t0 = row_offsets[i], nq = row_offsets[i + 1] - t0;
    const float* xi = xs + i * b * bk;
    Resize(s.a, nq);
    Resize(s.b, nq);
    Resize(s.transposed, std::max<int64_t>(nq, 1) * bn * bk);
    for (int32_t q = 0; q < nq; ++q) {
      const int64_t blk = t0 + q;
      const float* dyj = dys + col_indices[blk] * b * bn;
      // dW: (bk, bn) = x[:, row i].T @ dy[:, col j], summed over the whole batch in registers.
      Gemm(bk, bn, 1, &xi, 1, bk, &dyj, bn, b, ddata + blk * bk * bn, bn);
      float* t = s.transposed.data() + q * bn * bk;
      Transpose(data + blk * bk * bn, bk, bn, bn, t, bk);
      s.a[q] = dyj;
      s.b[q] = t;
    }
    // dX: dx[:, row i] = sum_j dy[:, col j] @ data[b].T.
    Gemm(b, bk, nq, s.a.data(), bn, 1, s.b.data(), bk, bn, dx + i * bk, k);
  });
  return "";
}

ffi::Error BlockForward(ffi::ThreadPool pool, F32Matrix x, F32Tensor3 data, I32Vector row_indices,
                        I32Vector col_offsets, I32Vector transpose_order, I32Vector col_indices, I32Vector row_offsets,
                        F32MatrixOut y) {
  return Guarded("block-sparse forward", [&]() -> ffi::Error {
    const int64_t b = Dim(x, 0), k = Dim(x, 1), n = Dim(*y, 1);
    const int64_t nnz = Dim(data, 0), bk = Dim(data, 1), bn = Dim(data, 2);
    if (Dim(*y, 0) != b || bk <= 0 || bn <= 0 || bk % kLanes || bn % kLanes || k % bk || n % bn ||
        Dim(row_indices, 0) != nnz || Dim(col_offsets, 0) != n / bn + 1 || Dim(transpose_order, 0) != nnz ||
        Dim(col_indices, 0) != nnz || Dim(row_offsets, 0) != k / bk + 1) {
      return ShapeError("block-sparse forward");
    }
    return Status("block-sparse forward",
                  BlockForwardKernel(PoolScheduler(pool), x.typed_data(), data.typed_data(), row_indices.typed_data(),
                                     col_offsets.typed_data(), transpose_order.typed_data(), col_indices.typed_data(),
                                     row_offsets.typed_data(), b, k, n, nnz, bk, bn, y->typed_data()));
  });
}

ffi::Error BlockBackward(ffi::ThreadPool pool, F32Matrix x, F32Tensor3 data, I32Vector row_offsets,
                         I32Vector col_indices, I32Vector row_indices, F32Matrix dy, F32MatrixOut dx,
                         F32Tensor3Out ddata) {
  return Guarded("block-sparse backward", [&]() -> ffi::Error {
    const int64_t b = Dim(x, 0), k = Dim(x, 1), n = Dim(dy, 1);
    const int64_t nnz = Dim(data, 0), bk = Dim(data, 1), bn = Dim(data, 2);
    if (Dim(dy, 0) != b || bk <= 0 || bn <= 0 || bk % kLanes || bn % kLanes || k % bk || n % bn ||
        Dim(row_offsets, 0) != k / bk + 1 || Dim(col_indices, 0) != nnz || Dim(row_indices, 0) != nnz ||
        Dim(*dx, 0) != b || Dim(*dx, 1) != k || Dim(*ddata, 0) != nnz || Dim(*ddata, 1) != bk ||
        Dim(*ddata, 2) != bn) {
      return ShapeError("block-sparse backward");
    }
    return Status("block-sparse backward",
                  BlockBackwardKernel(PoolScheduler(pool), x.typed_data(), data.typed_data(), row_offsets.typed_data(),
                                      col_indices.typed_data(), row_indices.typed_data(), dy.typed_data(), b, k, n,
                                      nnz, bk, bn, dx->typed_data(), ddata->typed_data()));
  });
}

}  // namespace

// Built with -fvisibility=hidden: only the handlers are exported.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseBlockForward, BlockForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Tensor3>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Ret<F32Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseBlockBackward, BlockBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Tensor3>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<F32Matrix>()
                                  .Ret<F32Matrix>()
                                  .Ret<F32Tensor3>());

#pragma GCC visibility pop
