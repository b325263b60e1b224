// Launches CUDA kernels compiled at run time (NVRTC, from jaxsparse/_cuda/_kernels.py) as XLA FFI custom
// calls for the CUDA platform.
//
// Python compiles a kernel's source to a cubin and hands the bytes over once with
// JaxsparseKernelRegister (which returns an id); the FFI handler loads the cubin into the CUDA context
// of the stream XLA gives it (once per context), and launches it on that stream. Host code only, built
// with the system C++ compiler: the CUDA driver API (libcuda.so.1, part of the driver) is opened with
// dlopen, so no CUDA headers or toolkit are needed to build it.
//
// Handler:
//   JaxsparseNm24Decode: y (M, N) = x (M, K) @ W for a 2:4 bfloat16 W given as NMSparseMatrix values
//     (K/2, N) and packed positions (K/8, N) uint8, M <= 32 (nm24_decode.cu). Attributes: kernel (the id
//     of the registered cubin), split (thread blocks per column span = the cluster size of the cubin),
//     warps (per thread block), span (columns per thread block), as compiled.

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef int CUresult;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;

struct Driver {
  CUresult (*StreamGetCtx)(CUstream, CUcontext*) = nullptr;
  CUresult (*CtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*CtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*ModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void**, void**) = nullptr;
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;
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
        Symbol(lib, "cuGetErrorString", &d->GetErrorString, &d->error);
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

// The function of registered kernel `id` in context `ctx` (current), loading its module on first use.
std::string Function(const Driver& d, int64_t id, CUcontext ctx, CUfunction* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (id < 0 || id >= static_cast<int64_t>(g_kernels.size())) return "unknown kernel id " + std::to_string(id);
  auto it = g_functions.find({id, ctx});
  if (it != g_functions.end()) {
    *out = it->second;
    return "";
  }
  CUmodule module;
  CUresult r = d.ModuleLoadData(&module, g_kernels[id].cubin.data());
  if (r != 0) return CudaError(d, "cuModuleLoadData", r);
  r = d.ModuleGetFunction(out, module, g_kernels[id].name.c_str());
  if (r != 0) return CudaError(d, "cuModuleGetFunction", r);
  g_functions[{id, ctx}] = *out;
  return "";
}

ffi::Error Nm24Decode(CUstream stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> values,
                      ffi::Buffer<ffi::U8> idx, ffi::ResultBuffer<ffi::BF16> y, int64_t kernel, int64_t split,
                      int64_t warps, int64_t span) {
  const auto xd = x.dimensions(), vd = values.dimensions(), id = idx.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || vd.size() != 2 || id.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("nm24_decode: x, values, idx and y must be 2-D");
  const int64_t m = xd[0], k = xd[1], n = vd[1];
  if (m < 1 || m > 32 || k % 64 != 0 || (span != 64 && span != 128) || n % span != 0 || vd[0] != k / 2 ||
      id[0] != k / 8 || id[1] != n || yd[0] != m || yd[1] != n || split < 1 || (128 % split) != 0 || warps < 1 ||
      warps > 32)
    return ffi::Error::InvalidArgument("nm24_decode: shapes x (" + std::to_string(m) + ", " + std::to_string(k) +
                                       "), values (" + std::to_string(vd[0]) + ", " + std::to_string(n) +
                                       "), span " + std::to_string(span) +
                                       " are not those the kernel supports (M <= 32, K % 64 == 0, N % span == 0)");
  const Driver& d = GetDriver();
  if (!d.error.empty()) return ffi::Error::Internal(d.error);
  ScopedContext scope(d, stream);
  if (!scope.error().empty()) return ffi::Error::Internal(scope.error());
  CUfunction f;
  std::string error = Function(d, kernel, scope.context(), &f);
  if (!error.empty()) return ffi::Error::Internal("nm24_decode: " + error);
  const void* xp = x.untyped_data();
  const void* vp = values.untyped_data();
  const void* ip = idx.untyped_data();
  void* yp = y->untyped_data();
  int mi = static_cast<int>(m), ki = static_cast<int>(k), ni = static_cast<int>(n);
  void* args[] = {&xp, &vp, &ip, &yp, &mi, &ki, &ni};
  CUresult r = d.LaunchKernel(f, static_cast<unsigned>(n / span), static_cast<unsigned>(split), 1,
                              static_cast<unsigned>(warps * 32), 1, 1, 0, stream, args, nullptr);
  if (r != 0) return ffi::Error::Internal(CudaError(d, "nm24_decode: cuLaunchKernel", r));
  return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)

// Registers a kernel (a cubin holding the extern "C" function `name`); returns its id, or -1 with the reason
// in `error` (512 bytes).
extern "C" int64_t JaxsparseKernelRegister(const char* name, const void* cubin, int64_t size, char* error) {
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
                                  .Attr<int64_t>("span"));

#pragma GCC visibility pop
