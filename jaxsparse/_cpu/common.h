// Shared by the jaxsparse CPU kernels: vectors, the thread-pool loop, scratch, transposes and the
// FFI plumbing. Everything is internal to each translation unit (an anonymous namespace).

#ifndef JAXSPARSE_CPU_COMMON_H_
#define JAXSPARSE_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#include <sys/mman.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Aliases keep commas out of the handler-definition macros.
using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;
using F32Tensor3 = ffi::Buffer<ffi::F32, 3>;
using I32Vector = ffi::Buffer<ffi::S32, 1>;
using BoolMatrix = ffi::Buffer<ffi::PRED, 2>;
using F32MatrixOut = ffi::ResultBuffer<ffi::F32, 2>;
using F32VectorOut = ffi::ResultBuffer<ffi::F32, 1>;
using F32Tensor3Out = ffi::ResultBuffer<ffi::F32, 3>;

namespace jaxsparse_cpu {

// Scratch memory that could not be allocated, thrown where it is asked for (on the calling thread, or in a pool
// task, whose ParallelFor rethrows it) and returned by the handler as an ffi::Error naming the kernel and the bytes
// (Guarded): a null buffer must never be written through, and std::bad_alloc must never reach XLA. Outside the
// anonymous namespace: one type for every translation unit, as packed_gemm.cc's throws reach sparse_matmul.cc's
// handler.
class ScratchError : public std::bad_alloc {
 public:
  explicit ScratchError(int64_t bytes) : bytes_(bytes) {}
  int64_t bytes() const { return bytes_; }
  const char* what() const noexcept override { return "jaxsparse: scratch allocation failed"; }

 private:
  int64_t bytes_;
};

}  // namespace jaxsparse_cpu

namespace {

using jaxsparse_cpu::ScratchError;

typedef float v8 __attribute__((vector_size(32)));

constexpr int64_t kLanes = 8;  // floats per vector

inline v8 Load8(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline void Store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }
inline v8 Splat8(float s) { return v8{s, s, s, s, s, s, s, s}; }
// Forwards of at most this many rows (a decode step) run the few-row kernels (packed_gemm.cc, sparse_matmul.cc),
// which stream the weight once instead of tiling the batch.
constexpr int kFewRows = 8;

inline int64_t RoundUp(int64_t a, int64_t b) { return (a + b - 1) / b * b; }
inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int NumWorkers() {
  static const int n = [] {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return n;
}

// Hands a task to another thread: XLA's intra-op pool in the FFI handlers.
using Scheduler = std::function<void(std::function<void()>)>;

// Runs fn(i) for i in [0, n) on the calling thread plus up to NumWorkers() - 1 scheduled tasks.
// Items are claimed from an atomic counter, so a task that starts late finds nothing to do; the
// caller only waits for items that another thread has already claimed, which never deadlocks.
// An exception thrown by an item (a ScratchError in a pool task) must not leave its thread: the first one is kept,
// the items not yet started are skipped, and it is rethrown on the calling thread once every claimed item is done.
template <typename F>
void ParallelFor(const Scheduler& schedule, int64_t n, const F& fn) {
  if (n <= 0) return;
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::atomic<bool> failed{false};
    std::exception_ptr error;  // written by the item that set `failed`, before its `done` increment
  };
  std::shared_ptr<State> state;
  try {
    state = std::make_shared<State>();
  } catch (const std::bad_alloc&) {  // no memory to share with the pool: every item on this thread
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  const F* f = &fn;
  auto work = [state, f, n]() noexcept {
    for (;;) {
      const int64_t i = state->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      if (!state->failed.load(std::memory_order_relaxed)) {
        try {
          (*f)(i);
        } catch (...) {
          if (!state->failed.exchange(true, std::memory_order_relaxed)) state->error = std::current_exception();
        }
      }
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(NumWorkers() - 1, n - 1);
  try {
    for (int64_t h = 0; h < helpers; ++h) schedule(work);
  } catch (const std::bad_alloc&) {  // a task could not be allocated: fewer helpers, the caller takes the rest
  }
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  if (state->failed.load(std::memory_order_relaxed)) std::rethrow_exception(state->error);
}

// v.resize(n), throwing ScratchError with the bytes asked for when the memory is not there.
template <typename T>
void Resize(std::vector<T>& v, int64_t n) {
  try {
    v.resize(static_cast<size_t>(n));
  } catch (const std::bad_alloc&) {
    throw ScratchError(n * static_cast<int64_t>(sizeof(T)));
  } catch (const std::length_error&) {
    throw ScratchError(n * static_cast<int64_t>(sizeof(T)));
  }
}

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using FloatBuffer = std::unique_ptr<float[], FreeDeleter>;

// The bytes AllocFloats(n) asks for.
inline int64_t FloatBytes(int64_t n) { return RoundUp(std::max<int64_t>(n, 1) * 4, 64); }

// n floats, 64-byte aligned; null when the memory is not there.
inline FloatBuffer AllocFloats(int64_t n) {
  if (n > (std::numeric_limits<int64_t>::max() - 64) / 4) return nullptr;
  return FloatBuffer(static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(FloatBytes(n)))));
}

// Asks Linux to back a large output buffer with transparent huge pages before its first write. XLA
// allocates big outputs with a fresh mmap per call, and faulting in 4 KiB pages costs more than
// the product itself for a (4096, 4096) weight gradient. A hint only; errors are ignored.
inline void AdviseHugePages(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 4 * static_cast<int64_t>(kHuge)) return;
  const uintptr_t start = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// Copies n floats to dst with non-temporal stores where dst is 32-byte aligned: a written-once
// output row need not be read into the cache first.
inline void StreamCopy(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 31) != 0; ++i) dst[i] = src[i];
  for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
#endif
  for (; i < n; ++i) dst[i] = src[i];
}

inline void StreamFence() {
#if defined(__AVX2__)
  _mm_sfence();
#endif
}

#if defined(__AVX2__)
inline void Transpose8x8(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m256 r0 = _mm256_loadu_ps(src + 0 * ld_src), r1 = _mm256_loadu_ps(src + 1 * ld_src);
  __m256 r2 = _mm256_loadu_ps(src + 2 * ld_src), r3 = _mm256_loadu_ps(src + 3 * ld_src);
  __m256 r4 = _mm256_loadu_ps(src + 4 * ld_src), r5 = _mm256_loadu_ps(src + 5 * ld_src);
  __m256 r6 = _mm256_loadu_ps(src + 6 * ld_src), r7 = _mm256_loadu_ps(src + 7 * ld_src);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst + 0 * ld_dst, _mm256_permute2f128_ps(s0, s4, 0x20));
  _mm256_storeu_ps(dst + 1 * ld_dst, _mm256_permute2f128_ps(s1, s5, 0x20));
  _mm256_storeu_ps(dst + 2 * ld_dst, _mm256_permute2f128_ps(s2, s6, 0x20));
  _mm256_storeu_ps(dst + 3 * ld_dst, _mm256_permute2f128_ps(s3, s7, 0x20));
  _mm256_storeu_ps(dst + 4 * ld_dst, _mm256_permute2f128_ps(s0, s4, 0x31));
  _mm256_storeu_ps(dst + 5 * ld_dst, _mm256_permute2f128_ps(s1, s5, 0x31));
  _mm256_storeu_ps(dst + 6 * ld_dst, _mm256_permute2f128_ps(s2, s6, 0x31));
  _mm256_storeu_ps(dst + 7 * ld_dst, _mm256_permute2f128_ps(s3, s7, 0x31));
}
#endif

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols.
inline void Transpose(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst) {
  int64_t r0 = 0;
#if defined(__AVX2__)
  for (; r0 + 8 <= rows; r0 += 8) {
    int64_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8) Transpose8x8(src + r0 * ld_src + c0, ld_src, dst + c0 * ld_dst + r0, ld_dst);
    for (; c0 < cols; ++c0) {
      for (int64_t r = r0; r < r0 + 8; ++r) dst[c0 * ld_dst + r] = src[r * ld_src + c0];
    }
  }
#endif
  for (; r0 < rows; ++r0) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r0] = src[r0 * ld_src + c];
  }
}

// Scratch buffers for packed or transposed operands, kept per calling thread (slots 0 to 3): a fresh
// multi-MiB allocation per call would cost a page fault per 4 KiB, as much as the packing itself.
// Throws ScratchError when a buffer cannot grow; the slot then keeps its old buffer.
inline float* CachedBuffer(int slot, int64_t n) {
  struct Buffer {
    FloatBuffer data;
    int64_t size = 0;
  };
  thread_local Buffer buffers[4];
  Buffer& b = buffers[slot];
  if (b.size < n) {
    FloatBuffer grown = AllocFloats(n);
    if (grown == nullptr) throw ScratchError(FloatBytes(n));
    b.data = std::move(grown);
    b.size = n;
  }
  return b.data.get();
}

inline bool ValidOffsets(const int32_t* ptr, int64_t len, int64_t nnz) {
  if (ptr[0] != 0 || ptr[len] != nnz) return false;
  bool ok = true;
  for (int64_t i = 0; i < len; ++i) ok &= ptr[i + 1] >= ptr[i];
  return ok;
}

// Every v[i] in [0, bound). (Not `uint32_t(v[i]) < bound`: a negative entry passes that for a bound past 2^32.)
inline bool InRange(const int32_t* v, int64_t len, int64_t bound) {
  bool ok = true;
  for (int64_t i = 0; i < len; ++i) ok &= (v[i] >= 0) & (v[i] < bound);
  return ok;
}

// Rows r0..r1 of a CSR matrix (offsets ptr, already valid) list their columns strictly increasing and in [0, bound), as
// jaxsparse.CSRMatrix.validate asks: no entry twice (which to_dense makes NaN, and a kernel would add twice). One
// compare an entry, as InRange's two: increasing columns are in range where each row's first and last are.
inline bool RowsIncreasingInRange(const int32_t* ptr, const int32_t* cols, int64_t r0, int64_t r1, int64_t bound) {
  bool ok = true;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t e0 = ptr[r], e1 = ptr[r + 1];
    if (e0 == e1) continue;
    ok &= (cols[e0] >= 0) & (cols[e1 - 1] < bound);
    for (int64_t e = e0 + 1; e < e1; ++e) ok &= cols[e] > cols[e - 1];
  }
  return ok;
}

// What a failed RowsIncreasingInRange of rows r0..r1 found.
inline std::string RowColumnsError(const int32_t* ptr, const int32_t* cols, int64_t r0, int64_t r1, int64_t bound) {
  if (!InRange(cols + ptr[r0], ptr[r1] - ptr[r0], bound)) {
    return "col_indices has entries outside [0, " + std::to_string(bound) + ")";
  }
  return "col_indices lists a row's columns out of order or twice (they must increase within each row)";
}

template <typename Buf>
inline int64_t Dim(const Buf& buf, int i) {
  return static_cast<int64_t>(buf.dimensions()[i]);
}

inline Scheduler PoolScheduler(ffi::ThreadPool& pool) {
  return [&pool](std::function<void()> task) { pool.Schedule(std::move(task)); };
}

inline ffi::Error ShapeError(const char* op) {
  return ffi::Error::InvalidArgument(std::string(op) + ": operand shapes do not match (internal error in jaxsparse)");
}

inline ffi::Error Status(const char* op, const std::string& message) {
  return message.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

// RESOURCE_EXHAUSTED for op's scratch of `bytes` (< 0: unknown).
inline ffi::Error AllocationError(const char* op, int64_t bytes) noexcept {
  try {
    char mib[32];
    std::snprintf(mib, sizeof(mib), "%.1f", static_cast<double>(bytes) / (1 << 20));
    const std::string size = bytes < 0 ? "memory" : std::to_string(bytes) + " bytes (" + mib + " MiB)";
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(op) + ": could not allocate " + size + " of scratch memory for the product");
  } catch (...) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "out of memory");  // short enough to need no allocation
  }
}

inline ffi::Error InternalError(const char* op, const char* what) noexcept {
  try {
    return ffi::Error::Internal(std::string(op) + ": " + what + " (internal error in jaxsparse)");
  } catch (...) {
    return ffi::Error::Internal("jaxsparse");
  }
}

// run() (a handler's body: its checks and kernel), with what it throws returned as an error instead of reaching
// XLA (which cannot take a C++ exception): a failed allocation as RESOURCE_EXHAUSTED with its bytes.
template <typename F>
ffi::Error Guarded(const char* op, const F& run) noexcept {
  try {
    return run();
  } catch (const ScratchError& e) {
    return AllocationError(op, e.bytes());
  } catch (const std::bad_alloc&) {
    return AllocationError(op, -1);
  } catch (const std::exception& e) {
    return InternalError(op, e.what());
  } catch (...) {
    return InternalError(op, "unknown exception");
  }
}

}  // namespace

namespace jaxsparse_cpu {

// y (m, n) = x (m, k) @ where(mask, w, 0) on packed_gemm.cc's GEMM (the dense route of sparse_matmul.cc's masked
// forward).
void MaskedGemm(const std::function<void(std::function<void()>)>& pool, const float* x, const float* w,
                const bool* mask, int64_t m, int64_t k, int64_t n, float* y);

}  // namespace jaxsparse_cpu

#endif  // JAXSPARSE_CPU_COMMON_H_
