// Shared device primitives for every mla_cupy kernel: element traits, cp.async,
// ldmatrix, mma.sync, swizzled shared-memory addressing, and small math helpers.
// Every kernel variant includes this header instead of carrying its own copies.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/limits>

namespace mla {

typedef long long i64;
typedef unsigned int u32;

// The model's dimensions (DeepSeek's Multi-head Latent Attention): the values and the per-head
// ("nope") part of q and k, the rope part every head shares, and q's and a key's whole head. The
// Python side reads kDv and kDr from this text (mla_cupy/dims.py).
constexpr int kDv = 128;
constexpr int kDr = 64;
constexpr int kDqk = kDv + kDr;

// Positions are signed 64-bit; these bound "no limit" ranges well away from overflow.
constexpr i64 kPosMin = -(1LL << 62);
constexpr i64 kPosMax = (1LL << 62);

__device__ __forceinline__ float neg_inf() { return -cuda::std::numeric_limits<float>::infinity(); }

// ---------------------------------------------------------------------------------------------
// Element traits: packing two floats into one 32-bit register of the 16-bit input type, and the
// mma.sync m16n8k16 instruction for that type (float32 accumulation).
// ---------------------------------------------------------------------------------------------
template <typename T> struct Elem;

#define MLA_DEFINE_ELEM(TYPE, TYPE2, CVT2, PTXT)                                                          \
  template <> struct Elem<TYPE> {                                                                          \
    static __device__ __forceinline__ u32 pack(float lo, float hi) {                                       \
      TYPE2 v = CVT2(lo, hi);                                                                              \
      return *reinterpret_cast<u32*>(&v);                                                                  \
    }                                                                                                      \
    static __device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {         \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTXT "." PTXT ".f32 "                          \
                   "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                              \
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                        \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                        \
    }                                                                                                      \
  };

MLA_DEFINE_ELEM(__nv_bfloat16, __nv_bfloat162, __floats2bfloat162_rn, "bf16")
MLA_DEFINE_ELEM(__half, __half2, __floats2half2_rn, "f16")
#undef MLA_DEFINE_ELEM

// Stores two adjacent output values (columns 2t, 2t+1 of an mma accumulator fragment).
template <typename OutT> __device__ __forceinline__ void store2(OutT* p, float lo, float hi);
template <> __device__ __forceinline__ void store2<float>(float* p, float lo, float hi) {
  *reinterpret_cast<float2*>(p) = make_float2(lo, hi);
}
template <> __device__ __forceinline__ void store2<__nv_bfloat16>(__nv_bfloat16* p, float lo, float hi) {
  *reinterpret_cast<u32*>(p) = Elem<__nv_bfloat16>::pack(lo, hi);
}
template <> __device__ __forceinline__ void store2<__half>(__half* p, float lo, float hi) {
  *reinterpret_cast<u32*>(p) = Elem<__half>::pack(lo, hi);
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Two consecutive values as floats (the inverse of store2).
template <typename T> __device__ __forceinline__ void load2(const T* p, float (&x)[2]) {
  const u32 u = *reinterpret_cast<const u32*>(p);
  const T* h = reinterpret_cast<const T*>(&u);
  x[0] = to_float<T>(h[0]);
  x[1] = to_float<T>(h[1]);
}
template <> __device__ __forceinline__ void load2<float>(const float* p, float (&x)[2]) {
  const float2 u = *reinterpret_cast<const float2*>(p);
  x[0] = u.x;
  x[1] = u.y;
}

// Four consecutive values as floats: one 16-byte access for float32, one 8-byte access for 16-bit types.
template <typename T> __device__ __forceinline__ void load4(const T* p, float (&x)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = to_float<T>(h[i]);
}
template <> __device__ __forceinline__ void load4<float>(const float* p, float (&x)[4]) {
  const float4 u = *reinterpret_cast<const float4*>(p);
  x[0] = u.x; x[1] = u.y; x[2] = u.z; x[3] = u.w;
}
template <typename T> __device__ __forceinline__ void store4(T* p, const float (&x)[4]) {
  uint2 u;
  T* h = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = from_float<T>(x[i]);
  *reinterpret_cast<uint2*>(p) = u;
}
template <> __device__ __forceinline__ void store4<float>(float* p, const float (&x)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}

// ---------------------------------------------------------------------------------------------
// Asynchronous copies (sm_80+). A false predicate copies zero bytes and zero-fills the 16-byte
// destination: rows past a sequence's end become zeros, never a neighbour's data.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// The GPU's global timer in nanoseconds (comparable across SMs, unlike clock64).
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Plain shared-memory loads and stores at a shared (u32) address.
__device__ __forceinline__ u32 lds32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
// Two adjacent 32-bit words at an 8-byte aligned shared address.
__device__ __forceinline__ void lds64(u32 addr, u32& lo, u32& hi) {
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(lo), "=r"(hi) : "r"(addr));
}
__device__ __forceinline__ void sts32(u32 addr, u32 v) { asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v)); }
__device__ __forceinline__ void sts128(u32 addr, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d));
}

__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool pred) {
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------------------------------------
// ldmatrix: four 8x8 b16 matrices per warp; lane l supplies the row address of matrix l / 8.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// ---------------------------------------------------------------------------------------------
// Swizzled tile of ROWS x (CHUNKS * 16 bytes). Chunk c of row r lives at chunk c ^ (r % 8):
// the eight rows an ldmatrix phase reads then hit eight different 16-byte bank groups.
// CHUNKS must be a multiple of 8 so the XOR stays inside the row.
// ---------------------------------------------------------------------------------------------
template <int CHUNKS> struct SwizzledTile {
  static_assert(CHUNKS % 8 == 0, "row must be a multiple of 128 bytes");
  static constexpr int kRowBytes = CHUNKS * 16;
  static __device__ __forceinline__ u32 offset(int row, int chunk) {
    return static_cast<u32>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
  }
};

// Floor division for a positive divisor (C++ '/' truncates toward zero).
__device__ __forceinline__ i64 floor_div(i64 a, i64 b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// Reductions across the four lanes of an mma quad (lanes 4g .. 4g+3 own one accumulator row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace mla
