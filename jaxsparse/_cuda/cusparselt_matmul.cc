// 2:4 sparse x dense products on sparse tensor cores through cuSPARSELt, as XLA FFI custom calls for
// the CUDA platform.
//
// y (M, N) = x (M, K) @ W, W 2:4-sparse along K (the input features), all row-major as JAX stores
// them. cuSPARSELt computes D = op(A) op(B) with A structured, so we compute the transpose:
//   yᵀ (N x M, column-major = y row-major) = Wᵀ (N x K, structured along K) · xᵀ (K x M)
// with xᵀ read as op(B) = transpose of the row-major x, and Wᵀ read from W in one of two layouts:
//   kLayoutKN: W as stored by Flax, (K, N) row-major, op(A) = transpose;
//   kLayoutNK: Wᵀ, (N, K) row-major (PyTorch's layout), op(A) = non-transpose.
//
// Two handlers:
//   JaxsparseCsltCompress: a pruned dense W (at most 2 nonzeros in every group of 4 along K) ->
//     cuSPARSELt's compressed buffer (values + metadata, an opaque byte array), on the device.
//   JaxsparseCsltMatmul: x and a compressed buffer -> y, float32 accumulation.
// Handles, descriptors and plans are created once per device and shape and cached for the life of
// the process; the algorithm of each plan is chosen on its first call by cusparseLtMatmulSearch
// (timed on the real operands) unless the call asks for the default one. Workspace and the
// compression's temporary buffer come from XLA's scratch allocator. Host code only: built with the
// system C++ compiler, linked against libcusparseLt (which carries its own CUDA runtime).

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include <cusparseLt.h>

#include "launch_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLayoutKN = 0;
constexpr int64_t kLayoutNK = 1;
constexpr uint32_t kAlignment = 16;  // bytes; leading dimensions are multiples of 8 elements
constexpr size_t kSearchWorkspace = size_t{64} << 20;
constexpr int kSearchIterations = 20;
// XLA's FFI scratch allocator refuses alignments above 16 bytes (its buffers are more aligned anyway).
constexpr size_t kScratchAlignment = 16;

std::string StatusText(cusparseStatus_t s) {
  const char* name = cusparseLtGetErrorName(s);
  const char* text = cusparseLtGetErrorString(s);
  return std::string(name ? name : "?") + " (" + (text ? text : "") + ")";
}

#define CSLT_RETURN_IF_ERROR(call)                                                               \
  do {                                                                                           \
    cusparseStatus_t _s = (call);                                                                \
    if (_s != CUSPARSE_STATUS_SUCCESS) return std::string(#call) + " failed: " + StatusText(_s); \
  } while (0)

bool Verbose() {
  static const bool v = [] {
    const char* e = std::getenv("JAXSPARSE_CUSPARSELT_VERBOSE");
    return e != nullptr && e[0] != '\0' && e[0] != '0';
  }();
  return v;
}

// cuSPARSELt data type of a 16-bit XLA element type; false when unsupported.
bool ValueType(ffi::DataType t, cudaDataType* out) {
  if (t == ffi::DataType::BF16) {
    *out = CUDA_R_16BF;
    return true;
  }
  if (t == ffi::DataType::F16) {
    *out = CUDA_R_16F;
    return true;
  }
  return false;
}

// One cuSPARSELt handle per device, created on first use and kept (handles are cheap to keep and
// plans refer to them).
std::mutex g_mu;
std::map<int32_t, std::unique_ptr<cusparseLtHandle_t>> g_handles;

std::string Handle(int32_t device, cusparseLtHandle_t** out) {
  auto it = g_handles.find(device);
  if (it == g_handles.end()) {
    auto h = std::make_unique<cusparseLtHandle_t>();
    CSLT_RETURN_IF_ERROR(cusparseLtInit(h.get()));
    it = g_handles.emplace(device, std::move(h)).first;
  }
  *out = it->second.get();
  return "";
}

// The structured operand: Wᵀ (N x K) as op(A), stored per `layout`.
std::string InitSparse(cusparseLtHandle_t* h, cusparseLtMatDescriptor_t* d, int64_t n, int64_t k, int64_t layout,
                       cudaDataType type) {
  const bool kn = layout == kLayoutKN;
  CSLT_RETURN_IF_ERROR(cusparseLtStructuredDescriptorInit(h, d, kn ? k : n, kn ? n : k, kn ? n : k, kAlignment, type,
                                                          CUSPARSE_ORDER_ROW, CUSPARSELT_SPARSITY_50_PERCENT));
  return "";
}

cusparseOperation_t OpA(int64_t layout) {
  return layout == kLayoutKN ? CUSPARSE_OPERATION_TRANSPOSE : CUSPARSE_OPERATION_NON_TRANSPOSE;
}

struct SparseKey {
  int32_t device;
  int64_t n, k, layout;
  cudaDataType type;
  bool operator<(const SparseKey& o) const {
    return std::tie(device, n, k, layout, type) < std::tie(o.device, o.n, o.k, o.layout, o.type);
  }
};

struct SparseEntry {
  cusparseLtMatDescriptor_t desc;
  size_t compressed_size = 0, buffer_size = 0;
};

std::map<SparseKey, std::unique_ptr<SparseEntry>> g_sparse;

// The cached structured descriptor and compressed sizes of (n, k, layout, type) on `device`.
std::string Sparse(const SparseKey& key, SparseEntry** out) {
  auto it = g_sparse.find(key);
  if (it == g_sparse.end()) {
    cusparseLtHandle_t* h;
    if (std::string e = Handle(key.device, &h); !e.empty()) return e;
    auto entry = std::make_unique<SparseEntry>();
    if (std::string e = InitSparse(h, &entry->desc, key.n, key.k, key.layout, key.type); !e.empty()) return e;
    CSLT_RETURN_IF_ERROR(
        cusparseLtSpMMACompressedSize2(h, &entry->desc, &entry->compressed_size, &entry->buffer_size));
    it = g_sparse.emplace(key, std::move(entry)).first;
  }
  *out = it->second.get();
  return "";
}

struct PlanKey {
  int32_t device;
  int64_t m, n, k, layout;
  cudaDataType type;
  bool search;
  bool operator<(const PlanKey& o) const {
    return std::tie(device, m, n, k, layout, type, search) <
           std::tie(o.device, o.m, o.n, o.k, o.layout, o.type, o.search);
  }
};

// Descriptors live here, at a fixed address, for as long as the plan that refers to them.
struct PlanEntry {
  cusparseLtMatDescriptor_t a, b, d;
  cusparseLtMatmulDescriptor_t matmul;
  cusparseLtMatmulAlgSelection_t alg;
  cusparseLtMatmulPlan_t plan;
  std::once_flag searched;
  std::string search_error;
  int alg_id = -1;
};

std::map<PlanKey, std::unique_ptr<PlanEntry>> g_plans;

std::string Plan(const PlanKey& key, PlanEntry** out) {
  auto it = g_plans.find(key);
  if (it == g_plans.end()) {
    cusparseLtHandle_t* h;
    if (std::string e = Handle(key.device, &h); !e.empty()) return e;
    auto p = std::make_unique<PlanEntry>();
    if (std::string e = InitSparse(h, &p->a, key.n, key.k, key.layout, key.type); !e.empty()) return e;
    // op(B) = xᵀ: x is (M, K) row-major.
    CSLT_RETURN_IF_ERROR(
        cusparseLtDenseDescriptorInit(h, &p->b, key.m, key.k, key.k, kAlignment, key.type, CUSPARSE_ORDER_ROW));
    // D = yᵀ (N x M) column-major, i.e. y (M, N) row-major.
    CSLT_RETURN_IF_ERROR(
        cusparseLtDenseDescriptorInit(h, &p->d, key.n, key.m, key.n, kAlignment, key.type, CUSPARSE_ORDER_COL));
    CSLT_RETURN_IF_ERROR(cusparseLtMatmulDescriptorInit(h, &p->matmul, OpA(key.layout), CUSPARSE_OPERATION_TRANSPOSE,
                                                        &p->a, &p->b, &p->d, &p->d, CUSPARSE_COMPUTE_32F));
    CSLT_RETURN_IF_ERROR(cusparseLtMatmulAlgSelectionInit(h, &p->alg, &p->matmul, CUSPARSELT_MATMUL_ALG_DEFAULT));
    // Time each candidate of the search over more calls than cuSPARSELt's default: with few, the pick varied
    // between processes (one MLP train step's sparse GEMMs took 3.86-4.17 ms over four runs on an H200).
    CSLT_RETURN_IF_ERROR(cusparseLtMatmulAlgSetAttribute(h, &p->alg, CUSPARSELT_MATMUL_SEARCH_ITERATIONS,
                                                         &kSearchIterations, sizeof(kSearchIterations)));
    CSLT_RETURN_IF_ERROR(cusparseLtMatmulPlanInit(h, &p->plan, &p->matmul, &p->alg));
    it = g_plans.emplace(key, std::move(p)).first;
  }
  *out = it->second.get();
  return "";
}

ffi::Error Fail(const char* op, const std::string& message) {
  return ffi::Error::Internal(std::string("jaxsparse ") + op + ": " + message);
}

// -------------------------------------------------------------------------------------------------
// Compression.
// -------------------------------------------------------------------------------------------------

ffi::Error Compress(cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device, ffi::AnyBuffer dense,
                    ffi::Result<ffi::AnyBuffer> out, int64_t layout) {
  cudaDataType type;
  if (!ValueType(dense.element_type(), &type)) return Fail("cusparselt_compress", "dtype must be bfloat16 or float16");
  const auto dims = dense.dimensions();
  if (dims.size() != 2 || (layout != kLayoutKN && layout != kLayoutNK)) {
    return Fail("cusparselt_compress", "expected a 2-D weight and layout 0 or 1");
  }
  const int64_t k = layout == kLayoutKN ? dims[0] : dims[1];
  const int64_t n = layout == kLayoutKN ? dims[1] : dims[0];
  if (std::string e = jaxsparse_cuda::CheckCslt("cusparselt_compress", k, n, layout, 0); !e.empty()) {
    return ffi::Error::InvalidArgument(e);
  }
  if (out->element_type() != ffi::DataType::U8 || out->dimensions().size() != 1) {
    return Fail("cusparselt_compress", "the compressed buffer must be 1-D uint8");
  }
  SparseEntry* entry;
  cusparseLtHandle_t* h;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (std::string e = Sparse({device, n, k, layout, type}, &entry); !e.empty()) return Fail("cusparselt_compress", e);
    if (std::string e = Handle(device, &h); !e.empty()) return Fail("cusparselt_compress", e);
  }
  if (out->size_bytes() < entry->compressed_size) {
    return Fail("cusparselt_compress", "output buffer of " + std::to_string(out->size_bytes()) + " bytes, need " +
                                           std::to_string(entry->compressed_size));
  }
  void* buffer = nullptr;
  if (entry->buffer_size > 0) {
    auto b = scratch.Allocate(entry->buffer_size, kScratchAlignment);
    if (!b.has_value()) return Fail("cusparselt_compress", "could not allocate the compression buffer");
    buffer = *b;
  }
  cusparseStatus_t s = cusparseLtSpMMACompress2(h, &entry->desc, 1, OpA(layout), dense.untyped_data(),
                                                out->untyped_data(), buffer, stream);
  if (s != CUSPARSE_STATUS_SUCCESS) return Fail("cusparselt_compress", "cusparseLtSpMMACompress2: " + StatusText(s));
  return ffi::Error::Success();
}

// -------------------------------------------------------------------------------------------------
// Product.
// -------------------------------------------------------------------------------------------------

ffi::Error Matmul(cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device, ffi::AnyBuffer x,
                  ffi::AnyBuffer compressed, ffi::Result<ffi::AnyBuffer> y, int64_t layout, int64_t search) {
  cudaDataType type;
  if (!ValueType(x.element_type(), &type) || y->element_type() != x.element_type()) {
    return Fail("cusparselt_matmul", "x and y must both be bfloat16 or both float16");
  }
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0]) return Fail("cusparselt_matmul", "shape mismatch");
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  if (std::string e = jaxsparse_cuda::CheckCsltMatmul(m, k, n, yd[0], layout); !e.empty()) {
    return ffi::Error::InvalidArgument(e);
  }
  if (compressed.element_type() != ffi::DataType::U8 || compressed.dimensions().size() != 1) {
    return Fail("cusparselt_matmul", "the compressed weight must be 1-D uint8");
  }
  PlanEntry* p;
  SparseEntry* entry;
  cusparseLtHandle_t* h;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (std::string e = Sparse({device, n, k, layout, type}, &entry); !e.empty()) return Fail("cusparselt_matmul", e);
    if (std::string e = Plan({device, m, n, k, layout, type, search != 0}, &p); !e.empty()) {
      return Fail("cusparselt_matmul", e);
    }
    if (std::string e = Handle(device, &h); !e.empty()) return Fail("cusparselt_matmul", e);
  }
  if (compressed.size_bytes() < entry->compressed_size) {
    return Fail("cusparselt_matmul", "compressed weight of " + std::to_string(compressed.size_bytes()) +
                                         " bytes, the plan needs " + std::to_string(entry->compressed_size));
  }
  const float alpha = 1.0f, beta = 0.0f;
  if (search) {
    // Timed on the real operands once per plan; it writes y, which the product below overwrites.
    std::call_once(p->searched, [&] {
      auto ws = scratch.Allocate(kSearchWorkspace, kScratchAlignment);
      if (!ws.has_value()) {
        p->search_error = "could not allocate the search workspace";
        return;
      }
      cudaStream_t streams[1] = {stream};
      cusparseStatus_t s = cusparseLtMatmulSearch(h, &p->plan, &alpha, compressed.untyped_data(), x.untyped_data(),
                                                  &beta, y->untyped_data(), y->untyped_data(), *ws, streams, 1);
      if (s != CUSPARSE_STATUS_SUCCESS) {
        p->search_error = "cusparseLtMatmulSearch: " + StatusText(s);
        return;
      }
      cusparseLtMatmulAlgGetAttribute(h, &p->alg, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &p->alg_id, sizeof(p->alg_id));
      if (Verbose()) {
        std::fprintf(stderr, "jaxsparse cusparselt: M=%lld N=%lld K=%lld layout=%lld -> algorithm %d\n",
                     static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
                     static_cast<long long>(layout), p->alg_id);
      }
    });
    if (!p->search_error.empty()) return Fail("cusparselt_matmul", p->search_error);
  }
  size_t ws_size = 0;
  cusparseStatus_t s = cusparseLtMatmulGetWorkspace(h, &p->plan, &ws_size);
  if (s != CUSPARSE_STATUS_SUCCESS) return Fail("cusparselt_matmul", "cusparseLtMatmulGetWorkspace: " + StatusText(s));
  void* ws = nullptr;
  if (ws_size > 0) {
    auto w = scratch.Allocate(ws_size, kScratchAlignment);
    if (!w.has_value()) return Fail("cusparselt_matmul", "could not allocate the workspace");
    ws = *w;
  }
  cudaStream_t streams[1] = {stream};
  s = cusparseLtMatmul(h, &p->plan, &alpha, compressed.untyped_data(), x.untyped_data(), &beta, y->untyped_data(),
                       y->untyped_data(), ws, streams, 1);
  if (s != CUSPARSE_STATUS_SUCCESS) return Fail("cusparselt_matmul", "cusparseLtMatmul: " + StatusText(s));
  return ffi::Error::Success();
}

}  // namespace

// Built with -fvisibility=hidden: only the handlers and the size query are exported.
#pragma GCC visibility push(default)

// Bytes of the compressed buffer for an (n x k) structured operand in `layout` (dtype 0: bf16,
// 1: f16) on the current device, or -1 with the reason in `error` (at least 512 bytes). Called
// from Python (ctypes) when tracing, to size the compression's output.
extern "C" int64_t JaxsparseCsltCompressedSize(int32_t device, int64_t n, int64_t k, int64_t layout, int32_t dtype,
                                               char* error) {
  if (std::string e = jaxsparse_cuda::CheckCslt("cusparselt compressed size", k, n, layout, dtype); !e.empty()) {
    if (error != nullptr) std::snprintf(error, 512, "%s", e.c_str());
    return -1;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  SparseEntry* entry;
  std::string e = Sparse({device, n, k, layout, dtype == 0 ? CUDA_R_16BF : CUDA_R_16F}, &entry);
  if (!e.empty()) {
    std::snprintf(error, 512, "%s", e.c_str());
    return -1;
  }
  return static_cast<int64_t>(entry->compressed_size);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseCsltCompress, Compress,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseCsltMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("layout")
                                  .Attr<int64_t>("search"));

#pragma GCC visibility pop
