// Launches CUDA kernels compiled at run time (NVRTC, from jaxsparse/_cuda/_kernels.py) as XLA FFI custom
// calls for the CUDA platform.
//
// Python compiles a kernel's source to a cubin and hands the bytes over once with
// JaxsparseKernelRegister (which returns an id); the FFI handler loads the cubin into the CUDA context
// of the stream XLA gives it (once per context), and launches it on that stream. Host code only, built
// with the system C++ compiler: the CUDA driver API (libcuda.so.1, part of the driver) is opened with
// dlopen, so no CUDA headers or toolkit are needed to build it.
//
// Handlers:
//   JaxsparseNm24Decode: y (M, N) = x (M, K) @ W for a 2:4 bfloat16 W given as NMSparseMatrix values
//     (K/2, N) and packed positions (K/8, N) uint8, M <= 32 (nm24_decode.cu). Attributes: kernel (the id
//     of the registered cubin), split (thread blocks per column span = the cluster size of the cubin),
//     warps (per thread block), span (columns per thread block), as compiled.
//   JaxsparseNm24DecodeBuffer: the same product with W given as cuSPARSELt's compressed buffer (K N 9 / 8 bytes:
//     the values, then the metadata; jaxsparse/_cuda/_layout.py), read by a build with NM_META 1. Same attributes.
//   JaxsparseNm24DecodeBufferTma: the same product on a build with NM_LOADS 3 (M <= 8), whose warps stream the buffer
//     through bulk tensor copies (TMA) into rings of shared memory: two tensor maps (the values, x) made per call,
//     and the build's dynamic shared memory. Attributes: those of JaxsparseNm24DecodeBuffer and stages (the ring's).
//   JaxsparseBlockSparseDecode: y (M, N) = x (M, K) @ W for a block-sparse W given as BlockSparseMatrix data (nnz, bk,
//     bn), col_offsets, transpose_order and row_indices, M <= 8, bfloat16 or float16 (block_sparse_decode.cu): two
//     tensor maps (data, x) made per call, the build's dynamic shared memory. Attributes: kernel, bk, bn, warps,
//     split, stages, f16 (float16 operands, else bfloat16) and out_f32 (a float32 y, else the operands' dtype).
//   JaxsparseNm24Transposable: transposable 2:4 pruning of a (K, N) float32 / bfloat16 weight: the pruned
//     weight (float32 / bfloat16) and each 4 x 4 tile's pattern index (K/4, N/4) uint8
//     (nm24_prune.cu). Attributes: kernel (the id of the cubin), w_bf16 and out_bf16 (the dtypes it
//     was built for: bfloat16, else float32).
//   JaxsparseNm24TransposableCompress: the same pruning written as cuSPARSELt's compressed bf16 buffers of W
//     and of Wᵀ (K N 9 / 8 bytes each), and the patterns; K, N multiples of 64. Attributes: kernel, w_bf16.
//   JaxsparseNm24Prune: plain 2:4 pruning along K: the pruned weight, each group's mask bits (K/4, N) uint8 and,
//     where the third result is not empty, cuSPARSELt's compressed bf16 buffer of W (K a multiple of 32, N
//     of 64). Attributes: kernel, w_bf16, out_bf16.

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "launch_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef int CUresult;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;

constexpr int kCaptureModeRelaxed = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
constexpr int kMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

// CUtensorMap: 128 opaque bytes, 64-byte aligned, passed to the kernel by value.
struct alignas(64) TensorMap {
  uint64_t words[16];
};

struct Driver {
  CUresult (*StreamGetCtx)(CUstream, CUcontext*) = nullptr;
  CUresult (*CtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*CtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*ModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void**, void**) = nullptr;
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*ThreadExchangeStreamCaptureMode)(int*) = nullptr;
  // Only the TMA builds need these (CUDA 12.0+ drivers); a driver without them fails those launches only.
  CUresult (*FuncSetAttribute)(CUfunction, int, int) = nullptr;
  CUresult (*TensorMapEncodeTiled)(TensorMap*, int, unsigned, void*, const uint64_t*, const uint64_t*,
                                   const unsigned*, const unsigned*, int, int, int, int) = nullptr;
  std::string error;
};

template <typename F>
bool Symbol(void* lib, const char* name, F* out, std::string* error) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr) *error = std::string("libcuda.so.1 has no symbol ") + name;
  return *out != nullptr;
}

const Driver& GetDriver() {
  static const Driver* driver = [] {
    auto* d = new Driver;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* e = dlerror();
      d->error = std::string("cannot open libcuda.so.1: ") + (e ? e : "?");
      return d;
    }
    Symbol(lib, "cuStreamGetCtx", &d->StreamGetCtx, &d->error) &&
        Symbol(lib, "cuCtxPushCurrent_v2", &d->CtxPushCurrent, &d->error) &&
        Symbol(lib, "cuCtxPopCurrent_v2", &d->CtxPopCurrent, &d->error) &&
        Symbol(lib, "cuModuleLoadData", &d->ModuleLoadData, &d->error) &&
        Symbol(lib, "cuModuleGetFunction", &d->ModuleGetFunction, &d->error) &&
        Symbol(lib, "cuLaunchKernel", &d->LaunchKernel, &d->error) &&
        Symbol(lib, "cuGetErrorString", &d->GetErrorString, &d->error) &&
        Symbol(lib, "cuThreadExchangeStreamCaptureMode", &d->ThreadExchangeStreamCaptureMode, &d->error);
    d->FuncSetAttribute = reinterpret_cast<decltype(d->FuncSetAttribute)>(dlsym(lib, "cuFuncSetAttribute"));
    d->TensorMapEncodeTiled =
        reinterpret_cast<decltype(d->TensorMapEncodeTiled)>(dlsym(lib, "cuTensorMapEncodeTiled"));
    return d;
  }();
  return *driver;
}

std::string CudaError(const Driver& d, const char* what, CUresult r) {
  const char* text = nullptr;
  if (d.GetErrorString != nullptr) d.GetErrorString(r, &text);
  return std::string(what) + " failed: CUDA error " + std::to_string(r) + " (" + (text ? text : "?") + ")";
}

struct Kernel {
  std::string name;
  std::vector<char> cubin;
};

std::mutex g_mu;
std::vector<Kernel> g_kernels;
std::map<std::pair<int64_t, CUcontext>, CUfunction> g_functions;

// Makes the stream's context current for the lifetime of the object.
class ScopedContext {
 public:
  ScopedContext(const Driver& d, CUstream stream) : d_(d) {
    CUresult r = d.StreamGetCtx(stream, &ctx_);
    if (r != 0) {
      error_ = CudaError(d, "cuStreamGetCtx", r);
      return;
    }
    r = d.CtxPushCurrent(ctx_);
    if (r != 0) {
      error_ = CudaError(d, "cuCtxPushCurrent", r);
      return;
    }
    pushed_ = true;
  }
  ~ScopedContext() {
    CUcontext popped;
    if (pushed_) d_.CtxPopCurrent(&popped);
  }
  CUcontext context() const { return ctx_; }
  const std::string& error() const { return error_; }

 private:
  const Driver& d_;
  CUcontext ctx_ = nullptr;
  bool pushed_ = false;
  std::string error_;
};

// The function of registered kernel `id` in context `ctx` (current), loading its module on first use (and allowing
// it `smem` bytes of dynamic shared memory, when not 0).
std::string Function(const Driver& d, int64_t id, CUcontext ctx, unsigned smem, CUfunction* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (id < 0 || id >= static_cast<int64_t>(g_kernels.size())) return "unknown kernel id " + std::to_string(id);
  auto it = g_functions.find({id, ctx});
  if (it != g_functions.end()) {
    *out = it->second;
    return "";
  }
  // The first launch in a context may come while XLA captures the stream into a CUDA graph (the decode handler is
  // command-buffer compatible): loading a module is not a stream operation, so this thread leaves the capture's
  // guard for it (relaxed mode) and restores the caller's mode after.
  int mode = kCaptureModeRelaxed;
  CUresult r = d.ThreadExchangeStreamCaptureMode(&mode);
  if (r != 0) return CudaError(d, "cuThreadExchangeStreamCaptureMode", r);
  CUmodule module;
  const char* what = "cuModuleLoadData";
  r = d.ModuleLoadData(&module, g_kernels[id].cubin.data());
  if (r == 0) {
    what = "cuModuleGetFunction";
    r = d.ModuleGetFunction(out, module, g_kernels[id].name.c_str());
  }
  if (r == 0 && smem > 0) {
    what = "cuFuncSetAttribute";
    r = d.FuncSetAttribute == nullptr ? 500 /* CUDA_ERROR_NOT_FOUND */
                                      : d.FuncSetAttribute(*out, kMaxDynamicSharedBytes, static_cast<int>(smem));
  }
  d.ThreadExchangeStreamCaptureMode(&mode);
  if (r != 0) return CudaError(d, what, r);
  g_functions[{id, ctx}] = *out;
  return "";
}

// Launches registered kernel `id` on `stream` (grid x, y; `threads` per block; `smem` bytes of dynamic shared
// memory).
ffi::Error Launch(CUstream stream, int64_t id, const char* what, unsigned grid_x, unsigned grid_y, unsigned threads,
                  void** args, unsigned smem = 0) {
  const Driver& d = GetDriver();
  if (!d.error.empty()) return ffi::Error::Internal(d.error);
  ScopedContext scope(d, stream);
  if (!scope.error().empty()) return ffi::Error::Internal(scope.error());
  CUfunction f;
  std::string error = Function(d, id, scope.context(), smem, &f);
  if (!error.empty()) return ffi::Error::Internal(std::string(what) + ": " + error);
  CUresult r = d.LaunchKernel(f, grid_x, grid_y, 1, threads, 1, 1, smem, stream, args, nullptr);
  if (r != 0) return ffi::Error::Internal(CudaError(d, (std::string(what) + ": cuLaunchKernel").c_str(), r));
  return ffi::Error::Success();
}

// Launches an nm24_decode build (checked shapes): one thread block per column span and slice of K.
ffi::Error LaunchNm24Decode(CUstream stream, int64_t kernel, const char* what, const void* xp, const void* vp,
                            const void* ip, void* yp, int64_t m, int64_t k, int64_t n, int64_t split, int64_t warps,
                            int64_t span) {
  int mi = static_cast<int>(m), ki = static_cast<int>(k), ni = static_cast<int>(n);
  void* args[] = {&xp, &vp, &ip, &yp, &mi, &ki, &ni};
  return Launch(stream, kernel, what, static_cast<unsigned>(n / span), static_cast<unsigned>(split),
                static_cast<unsigned>(warps * 32), args);
}

ffi::Error Nm24Decode(CUstream stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> values,
                      ffi::Buffer<ffi::U8> idx, ffi::ResultBuffer<ffi::BF16> y, int64_t kernel, int64_t split,
                      int64_t warps, int64_t span) {
  const auto xd = x.dimensions(), vd = values.dimensions(), id = idx.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || vd.size() != 2 || id.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("nm24_decode: x, values, idx and y must be 2-D");
  const int64_t m = xd[0], k = xd[1], n = vd[1];
  if (std::string e = jaxsparse_cuda::CheckNm24Decode(m, k, n, vd[0], vd[1], id[0], id[1], yd[0], yd[1], split, warps,
                                                       span);
      !e.empty())
    return ffi::Error::InvalidArgument(e);
  return LaunchNm24Decode(stream, kernel, "nm24_decode", x.untyped_data(), values.untyped_data(), idx.untyped_data(),
                          y->untyped_data(), m, k, n, split, warps, span);
}

ffi::Error Nm24DecodeBuffer(CUstream stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> buffer,
                            ffi::ResultBuffer<ffi::BF16> y, int64_t kernel, int64_t split, int64_t warps, int64_t span) {
  const auto xd = x.dimensions(), bd = buffer.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || bd.size() != 1 || yd.size() != 2)
    return ffi::Error::InvalidArgument("nm24_decode_buffer: x and y must be 2-D, the buffer 1-D");
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  if (std::string e = jaxsparse_cuda::CheckNm24DecodeBuffer(m, k, n, bd[0], yd[0], yd[1], split, warps, span);
      !e.empty())
    return ffi::Error::InvalidArgument(e);
  const char* values = static_cast<const char*>(buffer.untyped_data());
  return LaunchNm24Decode(stream, kernel, "nm24_decode_buffer", x.untyped_data(), values,
                          values + k * n,  // the metadata after the K N bytes of values
                          y->untyped_data(), m, k, n, split, warps, span);
}

constexpr int kTensorBf16 = 9, kTensorF16 = 6;  // CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, _FLOAT16

// A 2-D tensor map of a row-major 16-bit (outer, inner) array (`type`: kTensorBf16 or kTensorF16), boxes of
// (box_outer, 64) elements (128 bytes a row, swizzled by 128 bytes), zeros past its bounds.
std::string Encode16(const Driver& d, TensorMap* map, const void* base, int64_t inner, int64_t outer,
                     unsigned box_outer, int type = kTensorBf16) {
  if (d.TensorMapEncodeTiled == nullptr) return "libcuda.so.1 has no cuTensorMapEncodeTiled (a CUDA 12.0+ driver)";
  const uint64_t dims[2] = {static_cast<uint64_t>(inner), static_cast<uint64_t>(outer)};
  const uint64_t strides[1] = {static_cast<uint64_t>(inner) * 2};
  const unsigned box[2] = {64, box_outer}, element_strides[2] = {1, 1};
  // CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
  // CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE.
  CUresult r = d.TensorMapEncodeTiled(map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides, 0, 3,
                                      3, 0);
  return r == 0 ? "" : CudaError(d, "cuTensorMapEncodeTiled", r);
}

ffi::Error Nm24DecodeBufferTma(CUstream stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> buffer,
                               ffi::ResultBuffer<ffi::BF16> y, int64_t kernel, int64_t split, int64_t warps,
                               int64_t span, int64_t stages) {
  const char* op = "nm24_decode_buffer_tma";
  const auto xd = x.dimensions(), bd = buffer.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || bd.size() != 1 || yd.size() != 2)
    return ffi::Error::InvalidArgument(std::string(op) + ": x and y must be 2-D, the buffer 1-D");
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  if (std::string e = jaxsparse_cuda::CheckNm24DecodeBufferTma(m, k, n, bd[0], yd[0], yd[1], split, warps, span, stages,
                                                               reinterpret_cast<uintptr_t>(x.untyped_data()),
                                                               reinterpret_cast<uintptr_t>(buffer.untyped_data()));
      !e.empty())
    return ffi::Error::InvalidArgument(e);
  const Driver& d = GetDriver();
  if (!d.error.empty()) return ffi::Error::Internal(d.error);
  TensorMap values_map, x_map;
  const char* values = static_cast<const char*>(buffer.untyped_data());
  std::string e = Encode16(d, &values_map, values, n, k / 2, 32);  // 32 values rows: two steps of K
  if (e.empty()) e = Encode16(d, &x_map, x.untyped_data(), k, m, 8);  // 8 token rows (past M: zeros)
  if (!e.empty()) return ffi::Error::Internal(std::string(op) + ": " + e);
  const void* xp = x.untyped_data();
  const void* ip = values + k * n;  // the metadata after the K N bytes of values
  void* yp = y->untyped_data();
  int mi = static_cast<int>(m), ki = static_cast<int>(k), ni = static_cast<int>(n);
  void* args[] = {&xp, &values, &ip, &yp, &mi, &ki, &ni, &values_map, &x_map};
  return Launch(stream, kernel, op, static_cast<unsigned>(n / span), static_cast<unsigned>(split),
                static_cast<unsigned>(warps * 32), args,
                static_cast<unsigned>(jaxsparse_cuda::Nm24TmaSharedBytes(warps, span, stages)));
}

ffi::Error BlockSparseDecode(CUstream stream, ffi::AnyBuffer x, ffi::AnyBuffer data, ffi::Buffer<ffi::S32> col_offsets,
                             ffi::Buffer<ffi::S32> order, ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> y,
                             int64_t kernel, int64_t bk, int64_t bn, int64_t warps, int64_t split, int64_t stages,
                             bool f16, bool out_f32) {
  const char* op = "block_sparse_decode";
  const auto xd = x.dimensions(), dd = data.dimensions(), od = col_offsets.dimensions(), td = order.dimensions(),
             rd = rows.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || dd.size() != 3 || od.size() != 1 || td.size() != 1 || rd.size() != 1 || yd.size() != 2)
    return ffi::Error::InvalidArgument(std::string(op) + ": x and y must be 2-D, data 3-D, the index arrays 1-D");
  const int64_t m = xd[0], k = xd[1], n = yd[1], nnz = dd[0];
  const ffi::DataType in = f16 ? ffi::F16 : ffi::BF16;
  const bool types = x.element_type() == in && data.element_type() == in &&
                     y->element_type() == (out_f32 ? ffi::F32 : in);
  if (std::string e = jaxsparse_cuda::CheckBlockSparseDecode(
          m, k, n, nnz, dd[1], dd[2], od[0], td[0], rd[0], yd[0], yd[1], bk, bn, warps, split, stages, types,
          reinterpret_cast<uintptr_t>(x.untyped_data()), reinterpret_cast<uintptr_t>(data.untyped_data()));
      !e.empty())
    return ffi::Error::InvalidArgument(e);
  const Driver& d = GetDriver();
  if (!d.error.empty()) return ffi::Error::Internal(d.error);
  TensorMap w_map, x_map;
  const int type = f16 ? kTensorF16 : kTensorBf16;
  std::string e = Encode16(d, &w_map, data.untyped_data(), bn, nnz * bk, 64, type);  // 64 x 64 tiles of the blocks
  if (e.empty()) e = Encode16(d, &x_map, x.untyped_data(), k, m, 8, type);           // 8 token rows (past M: zeros)
  if (!e.empty()) return ffi::Error::Internal(std::string(op) + ": " + e);
  const void* op_ptr = col_offsets.typed_data();
  const void* tp = order.typed_data();
  const void* rp = rows.typed_data();
  void* yp = y->untyped_data();
  int mi = static_cast<int>(m), ki = static_cast<int>(k), ni = static_cast<int>(n), nz = static_cast<int>(nnz);
  void* args[] = {&op_ptr, &tp, &rp, &yp, &mi, &ki, &ni, &nz, &w_map, &x_map};
  return Launch(stream, kernel, op, static_cast<unsigned>(n / bn), static_cast<unsigned>(split),
                static_cast<unsigned>(warps * 32), args,
                static_cast<unsigned>(jaxsparse_cuda::BlockSparseDecodeSharedBytes(warps, stages)));
}

ffi::Error Nm24Transposable(CUstream stream, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> pruned,
                            ffi::ResultBuffer<ffi::U8> pattern, int64_t kernel, bool w_bf16, bool out_bf16) {
  const auto wd = w.dimensions(), pd = pruned->dimensions(), td = pattern->dimensions();
  if (wd.size() != 2 || pd.size() != 2 || td.size() != 2)
    return ffi::Error::InvalidArgument("nm24_transposable: w, pruned and pattern must be 2-D");
  const int64_t k = wd[0], n = wd[1];
  // The kernel was compiled for these element types (NM_IN_BF16, NM_OUT_BF16).
  const bool types = w.element_type() == (w_bf16 ? ffi::BF16 : ffi::F32) &&
                     pruned->element_type() == (out_bf16 ? ffi::BF16 : ffi::F32);
  if (std::string e = jaxsparse_cuda::CheckNm24Transposable(k, n, types, pd[0], pd[1], td[0], td[1]); !e.empty())
    return ffi::Error::InvalidArgument(e);
  const int64_t tiles = (k / 4) * (n / 4);
  if (tiles == 0) return ffi::Error::Success();
  const void* wp = w.untyped_data();
  void* pp = pruned->untyped_data();
  void* tp = pattern->untyped_data();
  int ki = static_cast<int>(k), ni = static_cast<int>(n);
  void* args[] = {&wp, &pp, &tp, &ki, &ni};
  return Launch(stream, kernel, "nm24_transposable", static_cast<unsigned>((tiles + 255) / 256), 1, 256, args);
}

ffi::Error Nm24TransposableCompress(CUstream stream, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::U8> pattern,
                                    ffi::ResultBuffer<ffi::U8> blob, ffi::ResultBuffer<ffi::U8> blob_t,
                                    int64_t kernel, bool w_bf16) {
  const auto wd = w.dimensions(), td = pattern->dimensions(), bd = blob->dimensions(), btd = blob_t->dimensions();
  if (wd.size() != 2 || td.size() != 2 || bd.size() != 1 || btd.size() != 1)
    return ffi::Error::InvalidArgument("nm24_transposable_compress: w and pattern must be 2-D, the buffers 1-D");
  const int64_t k = wd[0], n = wd[1];
  const bool types = w.element_type() == (w_bf16 ? ffi::BF16 : ffi::F32);
  if (std::string e = jaxsparse_cuda::CheckNm24TransposableCompress(k, n, types, td[0], td[1], bd[0], btd[0]);
      !e.empty())
    return ffi::Error::InvalidArgument(e);
  if (k == 0 || n == 0) return ffi::Error::Success();
  const void* wp = w.untyped_data();
  void* tp = pattern->untyped_data();
  void* bp = blob->untyped_data();
  void* btp = blob_t->untyped_data();
  int ki = static_cast<int>(k), ni = static_cast<int>(n);
  void* args[] = {&wp, &tp, &bp, &btp, &ki, &ni};
  // A block of 256 threads per 64 x 64 region.
  return Launch(stream, kernel, "nm24_transposable_compress", static_cast<unsigned>(n / 64),
                static_cast<unsigned>(k / 64), 256, args);
}

ffi::Error Nm24Prune(CUstream stream, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> pruned,
                     ffi::ResultBuffer<ffi::U8> bits, ffi::ResultBuffer<ffi::U8> blob, int64_t kernel, bool w_bf16,
                     bool out_bf16) {
  const auto wd = w.dimensions(), pd = pruned->dimensions(), gd = bits->dimensions(), bd = blob->dimensions();
  if (wd.size() != 2 || pd.size() != 2 || gd.size() != 2 || bd.size() != 1)
    return ffi::Error::InvalidArgument("nm24_prune: w, pruned and bits must be 2-D, the buffer 1-D");
  const int64_t k = wd[0], n = wd[1];
  const bool compress = bd[0] != 0;
  // The kernel was compiled for these element types (NM_IN_BF16, NM_OUT_BF16); the buffer holds bfloat16.
  const bool types = w.element_type() == (w_bf16 ? ffi::BF16 : ffi::F32) &&
                     pruned->element_type() == (out_bf16 ? ffi::BF16 : ffi::F32);
  if (std::string e = jaxsparse_cuda::CheckNm24Prune(k, n, types, pd[0], pd[1], gd[0], gd[1], bd[0], out_bf16);
      !e.empty())
    return ffi::Error::InvalidArgument(e);
  const int64_t tiles = (k / 4) * (n / 4);
  if (tiles == 0) return ffi::Error::Success();
  const void* wp = w.untyped_data();
  void* pp = pruned->untyped_data();
  void* gp = bits->untyped_data();
  void* bp = compress ? blob->untyped_data() : nullptr;
  int ki = static_cast<int>(k), ni = static_cast<int>(n);
  void* args[] = {&wp, &pp, &gp, &bp, &ki, &ni};
  return Launch(stream, kernel, "nm24_prune", static_cast<unsigned>((tiles + 255) / 256), 1, 256, args);
}

}  // namespace

#pragma GCC visibility push(default)

// Registers a kernel (a cubin holding the extern "C" function `name`); returns its id, or -1 with the reason
// in `error` (512 bytes).
extern "C" int64_t JaxsparseKernelRegister(const char* name, const void* cubin, int64_t size, char* error) {
  if (std::string e = jaxsparse_cuda::CheckRegister(name, cubin, size); !e.empty()) {
    if (error != nullptr) std::snprintf(error, 512, "%s", e.c_str());
    return -1;
  }
  const Driver& d = GetDriver();
  if (!d.error.empty()) {
    std::snprintf(error, 512, "%s", d.error.c_str());
    return -1;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  Kernel kernel{name, std::vector<char>(static_cast<const char*>(cubin), static_cast<const char*>(cubin) + size)};
  g_kernels.push_back(std::move(kernel));
  return static_cast<int64_t>(g_kernels.size()) - 1;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseNm24Decode, Nm24Decode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("kernel")
                                  .Attr<int64_t>("split")
                                  .Attr<int64_t>("warps")
                                  .Attr<int64_t>("span"),
                              // One kernel launch on XLA's stream, on its buffers only: XLA may record it in
                              // the CUDA graph of its neighbours instead of a launch from the host per call.
                              {ffi::Traits::kCmdBufferCompatible});

// The operands and attributes of the two handlers that read cuSPARSELt's buffer (the TMA one adds "stages").
static auto BufferDecodeBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<CUstream>>()
      .Arg<ffi::Buffer<ffi::BF16>>()
      .Arg<ffi::Buffer<ffi::U8>>()
      .Ret<ffi::Buffer<ffi::BF16>>()
      .Attr<int64_t>("kernel")
      .Attr<int64_t>("split")
      .Attr<int64_t>("warps")
      .Attr<int64_t>("span");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseNm24DecodeBuffer, Nm24DecodeBuffer, BufferDecodeBinding(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseNm24DecodeBufferTma, Nm24DecodeBufferTma,
                              BufferDecodeBinding().Attr<int64_t>("stages"), {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseBlockSparseDecode, BlockSparseDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("kernel")
                                  .Attr<int64_t>("bk")
                                  .Attr<int64_t>("bn")
                                  .Attr<int64_t>("warps")
                                  .Attr<int64_t>("split")
                                  .Attr<int64_t>("stages")
                                  .Attr<bool>("f16")
                                  .Attr<bool>("out_f32"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseNm24Transposable, Nm24Transposable,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("kernel")
                                  .Attr<bool>("w_bf16")
                                  .Attr<bool>("out_bf16"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseNm24TransposableCompress, Nm24TransposableCompress,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("kernel")
                                  .Attr<bool>("w_bf16"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseNm24Prune, Nm24Prune,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("kernel")
                                  .Attr<bool>("w_bf16")
                                  .Attr<bool>("out_bf16"));

#pragma GCC visibility pop
