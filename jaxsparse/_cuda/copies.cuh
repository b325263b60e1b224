// The decode kernels' shared helpers (nm24_decode.cu, block_sparse_decode.cu include this file; _kernels.py hands it
// to NVRTC as a header): shared-memory addresses, bulk copies (TMA) whose bytes complete an mbarrier's transaction
// count, the waits on those barriers, and the stores and barriers of a thread block cluster.
#pragma once

// CUtensorMap: 128 opaque bytes, 64-byte aligned, made by the launcher (cuTensorMapEncodeTiled), passed by value.
struct __align__(64) TensorMap {
  unsigned long long words[16];
};

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// `bytes` from `src` (global, 16-byte aligned, a multiple of 16 bytes) to shared memory at `dst`, counted on `bar`.
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// The box of `map` at coordinates (c0 inner, c1 outer) to shared memory at `dst`, counted on `bar`.
__device__ __forceinline__ void tensor_copy(unsigned dst, const TensorMap* map, int c0, int c1, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// One arrival on `bar` that also expects `bytes` more of its copies.
__device__ __forceinline__ void bar_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Waits until the phase of `bar` with parity `parity` has completed.
__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

// Every thread of the cluster arrives (its earlier memory operations released) and waits for all (acquired).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Stores v at `p` (an address of this block's shared memory) in the block of cluster rank `rank`.
__device__ __forceinline__ void store_peer(float* p, unsigned rank, float v) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}
