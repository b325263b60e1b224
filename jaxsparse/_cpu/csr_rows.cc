// CPU kernels that walk a CSR matrix's entries in row order, registered with XLA as FFI custom calls: the forward
// of a few rows (a decode step), and the dense route's conversions (entries to a dense weight, a dense weight
// gradient back to the entries). The layout is jaxsparse.CSRMatrix's: data (nnz,) in row-major order with
// col_indices (nnz,) and row_offsets (k + 1,); every index array is checked before use.

#include "common.h"

namespace {

constexpr int64_t kFewRowsItemEntries = 16384;  // CsrFewRowsKernel (kFewRows rows at most): entries per item, at least
constexpr int64_t kFewRowsParts = 16;           // ... work items (partial sums of y), at most
constexpr int64_t kSumColumns = 256;            // ... output columns per work item of the final sum
constexpr int64_t kRowsPerItem = 128;           // CsrToDenseKernel / CsrTakeKernel: weight rows per work item

// The forward of a few rows (at most kFewRows: a decode step), where sparse_matmul.cc's batch tiles would be mostly
// padding and each entry an axpy of 8 lanes for one row: the entries are streamed once in row order, each scattered
// into its work item's partial sums (interleaved, so a column's rows share a cache line), added up at the end.
typedef float v2 __attribute__((vector_size(8)));
typedef float v4 __attribute__((vector_size(16)));
template <int P> struct RowsVec;  // P floats as one vector (GCC ignores vector_size on a dependent typedef)
template <> struct RowsVec<2> { using type = v2; };
template <> struct RowsVec<4> { using type = v4; };
template <> struct RowsVec<8> { using type = v8; };

template <int P>  // P: the rows rounded up to a power of two (at least 2), one vector of partial sums per column
void CsrFewRowsPart(const float* x, const float* data, const int32_t* row_offsets, const int32_t* col_indices,
                    int64_t b, int64_t k, int64_t n, int64_t r0, int64_t r1, float* part) {
  std::memset(part, 0, sizeof(float) * P * n);
  if (b == 1) {  // scalar, a row at a time
    for (int64_t r = r0; r < r1; ++r) {
      const float s = x[r];
      for (int32_t e = row_offsets[r]; e < row_offsets[r + 1]; ++e) {
        part[static_cast<int64_t>(col_indices[e]) * P] += s * data[e];
      }
    }
    return;
  }
  using rows_vec = typename RowsVec<P>::type;
  for (int64_t r = r0; r < r1; ++r) {
    rows_vec s{};
    for (int64_t i = 0; i < b; ++i) s[i] = x[i * k + r];
    for (int32_t e = row_offsets[r]; e < row_offsets[r + 1]; ++e) {
      float* out = part + static_cast<int64_t>(col_indices[e]) * P;
      rows_vec acc;
      std::memcpy(&acc, out, sizeof(acc));
      acc += s * data[e];
      std::memcpy(out, &acc, sizeof(acc));
    }
  }
}

template <int P>
void CsrFewRows(const Scheduler& pool, const float* x, const float* data, const int32_t* row_offsets,
                const int32_t* col_indices, int64_t b, int64_t k, int64_t n, float* y) {
  // Work items of at least kFewRowsItemEntries entries (a small product runs on the calling thread alone), at most
  // kFewRowsParts of them: each keeps partial sums the size of y.
  const int64_t nnz = row_offsets[k];
  const int64_t items =
      std::max<int64_t>(1, std::min({nnz / kFewRowsItemEntries, 4 * int64_t{NumWorkers()}, kFewRowsParts}));
  const int64_t per_item = CeilDiv(k, items);
  float* parts = CachedBuffer(2, items * P * n);
  ParallelFor(pool, items, [&](int64_t i) {
    CsrFewRowsPart<P>(x, data, row_offsets, col_indices, b, k, n, std::min(k, i * per_item),
                      std::min(k, (i + 1) * per_item), parts + i * P * n);
  });
  ParallelFor(pool, items > 1 ? CeilDiv(n, kSumColumns) : 1, [&](int64_t chunk) {
    const int64_t c0 = items > 1 ? chunk * kSumColumns : 0, c1 = items > 1 ? std::min(n, c0 + kSumColumns) : n;
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t i = 0; i < b; ++i) {
        float sum = 0.f;
        for (int64_t t = 0; t < items; ++t) sum += parts[t * P * n + c * P + i];
        y[i * n + c] = sum;
      }
    }
  });
}

// y (b, n) = x (b, k) @ W for b <= kFewRows, from the CSR arrays.
std::string CsrFewRowsKernel(const Scheduler& pool, const float* x, const float* data, const int32_t* row_offsets,
                             const int32_t* col_indices, int64_t b, int64_t k, int64_t n, int64_t nnz, float* y) {
  if (!ValidOffsets(row_offsets, k, nnz)) return "row_offsets is not an offset array for nnz=" + std::to_string(nnz);
  if (!RowsIncreasingInRange(row_offsets, col_indices, 0, k, n)) {
    return RowColumnsError(row_offsets, col_indices, 0, k, n);
  }
  if (b < 0 || b > kFewRows) return "takes at most " + std::to_string(kFewRows) + " rows, got " + std::to_string(b);
  if (b == 0 || n == 0) return "";
  const auto run = b <= 2 ? CsrFewRows<2> : b <= 4 ? CsrFewRows<4> : CsrFewRows<8>;
  run(pool, x, data, row_offsets, col_indices, b, k, n, y);
  return "";
}

// The dense route of dense-ish patterns (x @ W in XLA beats the sparse kernels there) needs W dense, and dW at
// the entries from a dense x.T @ dY; XLA's scatter / gather of the entries cost about as much as the product.
// Both walk kRowsPerItem rows a work item, body(r0, r1), each item checking its own rows' offsets and column indices
// before it reads through them (every offset in [0, nnz] and not below the one before: with row_offsets[0] = 0 and
// row_offsets[k] = nnz, checked first, that is ValidOffsets; each row's columns increasing, in [0, n)), on every
// thread instead of in one pass before the work. An item whose rows fail the checks writes nothing; the error is the
// offsets' where any item found bad offsets, else the columns' (out of range, or a row's out of order or twice).
template <typename Body>
std::string CheckedRowItems(const Scheduler& pool, const int32_t* row_offsets, const int32_t* col_indices, int64_t k,
                            int64_t n, int64_t nnz, const Body& body) {
  const std::string bad_offsets = "row_offsets is not an offset array for nnz=" + std::to_string(nnz);
  if (row_offsets[0] != 0 || row_offsets[k] != nnz) return bad_offsets;
  std::atomic<bool> offsets_ok{true}, columns_ok{true};
  ParallelFor(pool, CeilDiv(k, kRowsPerItem), [&](int64_t chunk) {
    const int64_t r0 = chunk * kRowsPerItem, r1 = std::min(k, r0 + kRowsPerItem);
    bool ok = true;
    for (int64_t r = r0; r < r1; ++r) {
      ok &= (row_offsets[r] >= 0) & (row_offsets[r + 1] >= row_offsets[r]) & (row_offsets[r + 1] <= nnz);
    }
    if (!ok) {
      offsets_ok.store(false, std::memory_order_relaxed);
      return;
    }
    if (!RowsIncreasingInRange(row_offsets, col_indices, r0, r1, n)) {
      columns_ok.store(false, std::memory_order_relaxed);
      return;
    }
    body(r0, r1);
  });
  if (!offsets_ok.load()) return bad_offsets;
  if (!columns_ok.load()) return RowColumnsError(row_offsets, col_indices, 0, k, n);  // every item's offsets valid
  return "";
}

// w (k, n) = the entries at their places, zeros elsewhere. Each row is zeroed just before its entries are written
// (in L1), not 128 rows at once: with the checks on every thread, 0.60-0.81x the time of before at K x N from
// 384 x 384 to 2048 x 1536, density 0.39-0.5 (the project's 2-core VM, a standalone harness, paired runs).
std::string CsrToDenseKernel(const Scheduler& pool, const float* data, const int32_t* row_offsets,
                             const int32_t* col_indices, int64_t k, int64_t n, int64_t nnz, float* w) {
  return CheckedRowItems(pool, row_offsets, col_indices, k, n, nnz, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = w + r * n;
      std::memset(row, 0, sizeof(float) * n);
      for (int32_t e = row_offsets[r]; e < row_offsets[r + 1]; ++e) row[col_indices[e]] = data[e];
    }
  });
}

// values (nnz,) = w (k, n) at the entries.
std::string CsrTakeKernel(const Scheduler& pool, const float* w, const int32_t* row_offsets,
                          const int32_t* col_indices, int64_t k, int64_t n, int64_t nnz, float* values) {
  return CheckedRowItems(pool, row_offsets, col_indices, k, n, nnz, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = w + r * n;
      for (int32_t e = row_offsets[r]; e < row_offsets[r + 1]; ++e) values[e] = row[col_indices[e]];
    }
  });
}

// ------------------------------------------------------------------------------------------------
// FFI handlers: shape checks, then the kernels above on XLA's intra-op thread pool.
// ------------------------------------------------------------------------------------------------

ffi::Error CsrFewRowsForward(ffi::ThreadPool pool, F32Matrix x, F32Vector data, I32Vector row_offsets,
                             I32Vector col_indices, F32MatrixOut y) {
  return Guarded("csr few-rows forward", [&]() -> ffi::Error {
    const int64_t b = Dim(x, 0), k = Dim(x, 1), n = Dim(*y, 1), nnz = Dim(data, 0);
    if (Dim(*y, 0) != b || Dim(row_offsets, 0) != k + 1 || Dim(col_indices, 0) != nnz) {
      return ShapeError("csr few-rows forward");
    }
    return Status("csr few-rows forward", CsrFewRowsKernel(PoolScheduler(pool), x.typed_data(), data.typed_data(),
                                                           row_offsets.typed_data(), col_indices.typed_data(), b, k, n,
                                                           nnz, y->typed_data()));
  });
}

ffi::Error CsrToDense(ffi::ThreadPool pool, F32Vector data, I32Vector row_offsets, I32Vector col_indices,
                      F32MatrixOut w) {
  return Guarded("csr to dense", [&]() -> ffi::Error {
    const int64_t k = Dim(*w, 0), n = Dim(*w, 1), nnz = Dim(data, 0);
    if (Dim(row_offsets, 0) != k + 1 || Dim(col_indices, 0) != nnz) return ShapeError("csr to dense");
    return Status("csr to dense", CsrToDenseKernel(PoolScheduler(pool), data.typed_data(), row_offsets.typed_data(),
                                                   col_indices.typed_data(), k, n, nnz, w->typed_data()));
  });
}

ffi::Error CsrTake(ffi::ThreadPool pool, F32Matrix w, I32Vector row_offsets, I32Vector col_indices,
                   F32VectorOut values) {
  return Guarded("csr take", [&]() -> ffi::Error {
    const int64_t k = Dim(w, 0), n = Dim(w, 1), nnz = Dim(*values, 0);
    if (Dim(row_offsets, 0) != k + 1 || Dim(col_indices, 0) != nnz) return ShapeError("csr take");
    return Status("csr take", CsrTakeKernel(PoolScheduler(pool), w.typed_data(), row_offsets.typed_data(),
                                            col_indices.typed_data(), k, n, nnz, values->typed_data()));
  });
}

}  // namespace

// Built with -fvisibility=hidden: only the handlers are exported.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseCsrFewRowsForward, CsrFewRowsForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Ret<F32Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseCsrToDense, CsrToDense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Ret<F32Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseCsrTake, CsrTake,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Ret<F32Vector>());

#pragma GCC visibility pop
