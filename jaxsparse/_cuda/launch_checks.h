// Host-side checks of the CUDA custom calls' operands: every size, dim and attribute a handler reads is checked
// here before anything is launched, with the values in the message. Plain C++ (no XLA, no CUDA), so that
// tests/test_faults_cuda_entry.py compiles and runs the checks on any machine. Each returns "" or the error.
#ifndef JAXSPARSE_CUDA_LAUNCH_CHECKS_H_
#define JAXSPARSE_CUDA_LAUNCH_CHECKS_H_

#include <cstdint>
#include <string>

namespace jaxsparse_cuda {

constexpr int64_t kMaxDim = int64_t{1} << 30;           // the kernels take K and N as int
constexpr int64_t kMaxGridX = (int64_t{1} << 31) - 1;  // CUDA's grid.x limit
constexpr int64_t kMaxGridY = 65535;                    // CUDA's grid.y limit

inline std::string Shape(int64_t a, int64_t b) { return "(" + std::to_string(a) + ", " + std::to_string(b) + ")"; }

// K and N inside [0, 2**30] (checked first: the size products below then cannot overflow int64).
inline std::string CheckKN(const char* op, int64_t k, int64_t n) {
  if (k < 0 || n < 0 || k > kMaxDim || n > kMaxDim)
    return std::string(op) + ": w " + Shape(k, n) + " needs K and N in [0, 2**30]";
  return "";
}

// nm24_decode: x (M, K), values (K/2, N) bf16, idx (K/8, N) u8, y (M, N); split / warps / span as the cubin
// was compiled (Nm24DecodeConfig: split 1, 2, 4 or 8; warps 2, 4 or 8; span 64 or 128).
// The grid and the shapes every nm24_decode build needs (x (M, K), W (K, N), y (M, N)).
inline std::string CheckNm24DecodeGrid(const std::string& op, int64_t m, int64_t k, int64_t n, int64_t y0, int64_t y1,
                                       int64_t split, int64_t warps, int64_t span) {
  if (std::string e = CheckKN(op.c_str(), k, n); !e.empty()) return e;
  if (m < 1 || m > 32) return op + ": x has M=" + std::to_string(m) + " rows, needs 1 <= M <= 32";
  if (span != 64 && span != 128) return op + ": span=" + std::to_string(span) + ", needs 64 or 128";
  if (split != 1 && split != 2 && split != 4 && split != 8)
    return op + ": split=" + std::to_string(split) + ", needs 1, 2, 4 or 8";
  if (warps != 2 && warps != 4 && warps != 8) return op + ": warps=" + std::to_string(warps) + ", needs 2, 4 or 8";
  if (k % 64 != 0 || n % span != 0)
    return op + ": W " + Shape(k, n) + " needs K a multiple of 64 and N of span=" + std::to_string(span);
  if (y0 != m || y1 != n) return op + ": y " + Shape(y0, y1) + ", needs (M, N) = " + Shape(m, n);
  return "";
}

inline std::string CheckNm24Decode(int64_t m, int64_t k, int64_t n, int64_t v0, int64_t v1, int64_t i0, int64_t i1,
                                   int64_t y0, int64_t y1, int64_t split, int64_t warps, int64_t span) {
  const std::string op = "nm24_decode";
  if (std::string e = CheckNm24DecodeGrid(op, m, k, n, y0, y1, split, warps, span); !e.empty()) return e;
  if (v0 != k / 2 || v1 != n) return op + ": values " + Shape(v0, v1) + ", needs (K / 2, N) = " + Shape(k / 2, n);
  if (i0 != k / 8 || i1 != n) return op + ": idx " + Shape(i0, i1) + ", needs (K / 8, N) = " + Shape(k / 8, n);
  return "";
}

// nm24_decode on cuSPARSELt's buffer of a bfloat16 W: K N bytes of values, then K N / 8 of metadata, whose tiles of
// 64 columns need N a multiple of 64 (every span is).
inline std::string CheckNm24DecodeBuffer(int64_t m, int64_t k, int64_t n, int64_t bytes, int64_t y0, int64_t y1,
                                         int64_t split, int64_t warps, int64_t span) {
  const std::string op = "nm24_decode_buffer";
  if (std::string e = CheckNm24DecodeGrid(op, m, k, n, y0, y1, split, warps, span); !e.empty()) return e;
  if (bytes != k * n + k * n / 8)
    return op + ": buffer of " + std::to_string(bytes) + " bytes, needs K N 9 / 8 = " + std::to_string(k * n / 8 * 9) +
           " for W " + Shape(k, n);
  return "";
}

// The dynamic shared memory of an NM_LOADS 3 build (nm24_decode.cu's NM_RING_BYTES per warp, and 1 KB to align the
// rings to the swizzle's 1024 bytes).
inline int64_t Nm24TmaSharedBytes(int64_t warps, int64_t span, int64_t stages) {
  const int64_t stage = (span / 64) * 4096 + 1024, meta = (span / 64) * 512;
  return warps * ((stages * (stage + meta) + 1023) / 1024 * 1024) + 1024;
}
constexpr int64_t kMaxNm24TmaSharedBytes = 200 * 1024;  // of the 227 KB a block may have: the rest is static

// nm24_decode_buffer on an NM_LOADS 3 build: at most 8 rows, 2-4 stages, shared memory within kMaxNm24TmaSharedBytes,
// and x and the buffer 16-byte aligned (the tensor copies' global addresses).
inline std::string CheckNm24DecodeBufferTma(int64_t m, int64_t k, int64_t n, int64_t bytes, int64_t y0, int64_t y1,
                                            int64_t split, int64_t warps, int64_t span, int64_t stages,
                                            uint64_t x_address, uint64_t buffer_address) {
  const std::string op = "nm24_decode_buffer_tma";
  if (std::string e = CheckNm24DecodeBuffer(m, k, n, bytes, y0, y1, split, warps, span); !e.empty())
    return op + e.substr(e.find(':'));
  if (m > 8) return op + ": x has M=" + std::to_string(m) + " rows, needs M <= 8";
  if (stages < 2 || stages > 4) return op + ": stages=" + std::to_string(stages) + ", needs 2, 3 or 4";
  if (const int64_t s = Nm24TmaSharedBytes(warps, span, stages); s > kMaxNm24TmaSharedBytes)
    return op + ": warps=" + std::to_string(warps) + ", span=" + std::to_string(span) + ", stages=" +
           std::to_string(stages) + " need " + std::to_string(s) + " bytes of shared memory, at most " +
           std::to_string(kMaxNm24TmaSharedBytes);
  if (x_address % 16 != 0 || buffer_address % 16 != 0) return op + ": x and the buffer must be 16-byte aligned";
  return "";
}

// nm24_transposable / nm24_prune: one thread a 4 x 4 tile (a group of 4 for nm24_prune), 256 a block.
inline std::string CheckPruneGrid(const char* op, int64_t k, int64_t n) {
  if (std::string e = CheckKN(op, k, n); !e.empty()) return e;
  if (k % 4 != 0 || n % 4 != 0) return std::string(op) + ": w " + Shape(k, n) + " needs K and N multiples of 4";
  if (((k / 4) * (n / 4) + 255) / 256 > kMaxGridX)
    return std::string(op) + ": w " + Shape(k, n) + " has more 4 x 4 tiles than one launch covers (256 * (2**31 - 1))";
  return "";
}

inline std::string CheckNm24Transposable(int64_t k, int64_t n, bool types, int64_t p0, int64_t p1, int64_t t0,
                                         int64_t t1) {
  const char* op = "nm24_transposable";
  if (std::string e = CheckPruneGrid(op, k, n); !e.empty()) return e;
  if (!types) return std::string(op) + ": w or pruned is not of the dtype the kernel was built for";
  if (p0 != k || p1 != n) return std::string(op) + ": pruned " + Shape(p0, p1) + ", needs w's shape " + Shape(k, n);
  if (t0 != k / 4 || t1 != n / 4)
    return std::string(op) + ": pattern " + Shape(t0, t1) + ", needs (K / 4, N / 4) = " + Shape(k / 4, n / 4);
  return "";
}

inline std::string CheckNm24TransposableCompress(int64_t k, int64_t n, bool types, int64_t t0, int64_t t1, int64_t b,
                                                 int64_t bt) {
  const char* op = "nm24_transposable_compress";
  if (std::string e = CheckKN(op, k, n); !e.empty()) return e;
  if (!types) return std::string(op) + ": w is not of the dtype the kernel was built for";
  if (k % 64 != 0 || n % 64 != 0 || k / 64 > kMaxGridY)
    return std::string(op) + ": w " + Shape(k, n) + " needs K and N multiples of 64 and K <= 64 * 65535";
  if (t0 != k / 4 || t1 != n / 4)
    return std::string(op) + ": pattern " + Shape(t0, t1) + ", needs (K / 4, N / 4) = " + Shape(k / 4, n / 4);
  const int64_t bytes = k * n / 8 * 9;
  if (b != bytes || bt != bytes)
    return std::string(op) + ": buffers of " + std::to_string(b) + " and " + std::to_string(bt) +
           " bytes, need K N 9 / 8 = " + std::to_string(bytes) + " each";
  return "";
}

inline std::string CheckNm24Prune(int64_t k, int64_t n, bool types, int64_t p0, int64_t p1, int64_t g0, int64_t g1,
                                  int64_t b, bool out_bf16) {
  const char* op = "nm24_prune";
  if (std::string e = CheckPruneGrid(op, k, n); !e.empty()) return e;
  if (!types) return std::string(op) + ": w or pruned is not of the dtype the kernel was built for";
  if (p0 != k || p1 != n) return std::string(op) + ": pruned " + Shape(p0, p1) + ", needs w's shape " + Shape(k, n);
  if (g0 != k / 4 || g1 != n) return std::string(op) + ": bits " + Shape(g0, g1) + ", needs (K / 4, N) = " + Shape(k / 4, n);
  if (b != 0) {
    if (!out_bf16) return std::string(op) + ": the compressed buffer holds bfloat16, pruned is not";
    if (k % 32 != 0 || n % 64 != 0 || b != k * n / 8 * 9)
      return std::string(op) + ": a buffer of " + std::to_string(b) + " bytes for w " + Shape(k, n) +
             ", needs 0 or (K a multiple of 32, N of 64) K N 9 / 8 = " + std::to_string(k * n / 8 * 9);
  }
  return "";
}

// JaxsparseKernelRegister's arguments (from Python, ctypes).
inline std::string CheckRegister(const char* name, const void* cubin, int64_t size) {
  if (name == nullptr || name[0] == '\0') return "kernel name is empty";
  if (cubin == nullptr || size <= 0) return "cubin is empty (size " + std::to_string(size) + ")";
  return "";
}

// cuSPARSELt: the structured operand (K, N) in layout 0 (KN) or 1 (NK), dtype 0 (bf16) or 1 (f16); K and N positive
// multiples of 16 (ALIGN in _cusparselt.py).
inline std::string CheckCslt(const char* op, int64_t k, int64_t n, int64_t layout, int64_t dtype) {
  if (layout != 0 && layout != 1) return std::string(op) + ": layout=" + std::to_string(layout) + ", needs 0 or 1";
  if (dtype != 0 && dtype != 1) return std::string(op) + ": dtype code " + std::to_string(dtype) + ", needs 0 or 1";
  if (std::string e = CheckKN(op, k, n); !e.empty()) return e;
  if (k < 16 || n < 16 || k % 16 != 0 || n % 16 != 0)
    return std::string(op) + ": W (K, N) = " + Shape(k, n) + " needs K and N positive multiples of 16";
  return "";
}

// cusparselt_matmul: x (M, K) and y (M, N), M a positive multiple of 16 (the wrapper pads it).
inline std::string CheckCsltMatmul(int64_t m, int64_t k, int64_t n, int64_t y0, int64_t layout) {
  if (std::string e = CheckCslt("cusparselt_matmul", k, n, layout, 0); !e.empty()) return e;
  if (m < 16 || m % 16 != 0 || m > kMaxDim)
    return "cusparselt_matmul: x has M=" + std::to_string(m) + " rows, needs a positive multiple of 16";
  if (y0 != m) return "cusparselt_matmul: y has " + std::to_string(y0) + " rows, x " + std::to_string(m);
  return "";
}

// block_sparse_decode (block_sparse_decode.cu): the dynamic shared memory of a build (a ring of `stages` units of
// 9 KB a warp, and 1 KB for its alignment).
inline int64_t BlockSparseDecodeSharedBytes(int64_t warps, int64_t stages) { return warps * stages * 9216 + 1024; }
constexpr int64_t kMaxBlockSparseDecodeSharedBytes = 200 * 1024;  // static shared memory takes up to 20 KB more

// block_sparse_decode: x (M, K), data (nnz, bk, bn), col_offsets (N / bn + 1), order and rows (nnz), y (M, N); the
// build's attributes (bk, bn multiples of 64 up to 256; warps 1-8 a multiple of bn / 64; split 1, 2, 4 or 8; stages
// 2-4); x and data 16-byte aligned (the tensor copies' global addresses); dtypes: `types` says whether x, data and y
// are of the dtypes the build was made for.
inline std::string CheckBlockSparseDecode(int64_t m, int64_t k, int64_t n, int64_t nnz, int64_t d1, int64_t d2,
                                          int64_t offsets, int64_t order, int64_t rows, int64_t y0, int64_t y1,
                                          int64_t bk, int64_t bn, int64_t warps, int64_t split, int64_t stages,
                                          bool types, uint64_t x_address, uint64_t data_address) {
  const std::string op = "block_sparse_decode";
  if (std::string e = CheckKN(op.c_str(), k, n); !e.empty()) return e;
  if (m < 1 || m > 8) return op + ": x has M=" + std::to_string(m) + " rows, needs 1 <= M <= 8";
  if (bk < 64 || bk > 256 || bk % 64 != 0 || bn < 64 || bn > 256 || bn % 64 != 0)
    return op + ": block " + Shape(bk, bn) + ", needs both dims among 64, 128, 192, 256";
  if (warps < 1 || warps > 8 || warps % (bn / 64) != 0)
    return op + ": warps=" + std::to_string(warps) + ", needs 1-8 and a multiple of bn / 64 = " +
           std::to_string(bn / 64);
  if (split != 1 && split != 2 && split != 4 && split != 8)
    return op + ": split=" + std::to_string(split) + ", needs 1, 2, 4 or 8";
  if (stages < 2 || stages > 4) return op + ": stages=" + std::to_string(stages) + ", needs 2, 3 or 4";
  if (const int64_t s = BlockSparseDecodeSharedBytes(warps, stages); s > kMaxBlockSparseDecodeSharedBytes)
    return op + ": warps=" + std::to_string(warps) + ", stages=" + std::to_string(stages) + " need " +
           std::to_string(s) + " bytes of shared memory, at most " + std::to_string(kMaxBlockSparseDecodeSharedBytes);
  if (k % bk != 0 || n % bn != 0 || k == 0 || n == 0)
    return op + ": W " + Shape(k, n) + " needs K and N positive multiples of the block " + Shape(bk, bn);
  if (nnz < 1 || nnz > (int64_t{1} << 31) / bk - 1)
    return op + ": " + std::to_string(nnz) + " kept blocks, needs 1 <= nnz < 2**31 / bk";
  if (d1 != bk || d2 != bn)
    return op + ": data (" + std::to_string(nnz) + ", " + std::to_string(d1) + ", " + std::to_string(d2) +
           "), needs blocks of " + Shape(bk, bn);
  if (offsets != n / bn + 1)
    return op + ": col_offsets of " + std::to_string(offsets) + ", needs N / bn + 1 = " + std::to_string(n / bn + 1);
  if (order != nnz || rows != nnz)
    return op + ": transpose_order of " + std::to_string(order) + " and row_indices of " + std::to_string(rows) +
           ", need nnz = " + std::to_string(nnz) + " each";
  if (y0 != m || y1 != n) return op + ": y " + Shape(y0, y1) + ", needs (M, N) = " + Shape(m, n);
  if (!types) return op + ": x, data or y is not of the dtypes the kernel was built for";
  if (x_address % 16 != 0 || data_address % 16 != 0) return op + ": x and data must be 16-byte aligned";
  return "";
}

}  // namespace jaxsparse_cuda

#endif  // JAXSPARSE_CUDA_LAUNCH_CHECKS_H_
