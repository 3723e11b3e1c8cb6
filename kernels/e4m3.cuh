// float8_e4m3fn conversions (sm_89+): round to nearest even with saturation to +-448 on the way
// in, exact on the way out. Shared by the fp8 prefill variants (sm90/fp8.cuh) and the quantizers
// (quantize.cu).
#pragma once
#include "common.cuh"

namespace mla {

// Four floats -> four e4m3 bytes, x0 in the low byte.
__device__ __forceinline__ u32 e4m3x4(float x0, float x1, float x2, float x3) {
  u32 r;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(r)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  return r;
}

// One float -> its e4m3 byte.
__device__ __forceinline__ unsigned char to_e4m3(float x) {
  unsigned short two;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(two) : "f"(0.f), "f"(x));
  return static_cast<unsigned char>(two & 0xff);
}

// Two e4m3 values (the low byte first) times `scale`, as two floats.
__device__ __forceinline__ float2 e4m3x2_to_float2(u32 two, float scale) {
  u32 h2;
  asm("{\n.reg .b16 b;\ncvt.u16.u32 b, %1;\ncvt.rn.f16x2.e4m3x2 %0, b;\n}\n" : "=r"(h2) : "r"(two));
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
  return make_float2(f.x * scale, f.y * scale);
}

}  // namespace mla
