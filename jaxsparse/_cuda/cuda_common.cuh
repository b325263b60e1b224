// Helpers shared by the CUDA kernels of jaxsparse/_cuda (NVRTC sources, no includes): _kernels.py compiles
// this file followed by a kernel's source.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// Element w (0..3) of a uint4, w known at compile time after unrolling.
__device__ __forceinline__ u32 word_of(const uint4& v, int w) {
  return w == 0 ? v.x : (w == 1 ? v.y : (w == 2 ? v.z : v.w));
}

// Byte b (0..15) of a 16-byte vector.
__device__ __forceinline__ u32 byte_of(const uint4& v, int b) { return (word_of(v, b >> 2) >> (8 * (b & 3))) & 0xffu; }

// (lo, hi) bf16 pair: column j of `lo_row` and column j of `hi_row`, each row 16 columns in two uint4
// (h = j / 8).
__device__ __forceinline__ u32 pair_of(const uint4* lo_row, const uint4* hi_row, int j) {
  const u32 a = word_of(lo_row[j >> 3], (j & 7) >> 1);
  const u32 b = word_of(hi_row[j >> 3], (j & 7) >> 1);
  return __byte_perm(a, b, (j & 1) ? 0x7632 : 0x5410);
}

// The same from rows held as 32-bit words (two 16-bit values each): column j is half j & 1 of word j / 2.
__device__ __forceinline__ u32 pair_of_words(const u32* lo_row, const u32* hi_row, int j) {
  return __byte_perm(lo_row[j >> 1], hi_row[j >> 1], (j & 1) ? 0x7632 : 0x5410);
}

__device__ __forceinline__ u16 to_f16(float f) {
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ u16 to_bf16(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

// Thread block clusters (compute capability 9.0): all threads of every block of the cluster meet here.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// A float of block `rank`'s shared memory at the address of `p` in ours.
__device__ __forceinline__ float load_peer(const float* p, u32 rank) {
  u32 local = (u32)__cvta_generic_to_shared(p), remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

