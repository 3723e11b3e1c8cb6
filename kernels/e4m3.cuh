// float8_e4m3fn conversions (sm_89+): round to nearest even with saturation to +-448 on the way
// in, exact on the way out, and e4m3 bytes made from an exponent on the FMA pipe. Shared by the fp8
// prefill variants (sm90/fp8.cuh, softmax.cuh) and the quantizers (quantize.cu).
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

// e4m3 bytes straight from the exponent: the byte of 2^x (x <= 8.75, the fp8 kernels' kPScale * P)
// with its 3 mantissa bits linear in x's fraction is round(8 x + 56 + kExpByteBias) (exponent field
// floor(x) + 7). f16's step in [2^10, 2^11) is 1, so 2^10 + that value, converted to f16 (round to
// nearest: the byte's rounding), holds the byte in its low 8 bits. One fused multiply-add per score
// makes the carrier in float32 (s * 8 scale plus the row's exp_byte_base: the exponent's precision);
// per two scores one conversion to f16x2 and one max with 2^10 that keeps NaN clamp what lies below
// e4m3's range to the byte 0 (-inf, a masked score, included) and leave NaN f16's canonical 0x7fff,
// whose byte 0xff is e4m3's NaN; one byte permute gathers four. No special-function unit: the fp8
// softmax's 64 exp2 per thread and key tile leave it. Against exp2 rounded to e4m3, 2^f's curve
// between two powers of 2 taken as its chord adds up to 0.69 of a mantissa step, centred by the
// bias (-0.4585: the chord's mean excess, so that sums of P are unbiased); the rows of x with
// e4m3's subnormal bytes (x in [-7, -6)) come out linear in the step 2^-9, under 2^-14 of a row's
// largest P.
constexpr float kExpByteFloor = 1024.f;  // 2^10
constexpr float kExpByteSteps = 8.f;     // e4m3's mantissa steps per power of 2
constexpr float kExpByteBias = -0.4585f;
// The per-row constant of the carriers' fused multiply-add: 2^10 + 56 + bias - 8 ref, for
// exponents x = scale * s - ref; the scores' factor is 8 scale.
__device__ __forceinline__ float exp_byte_base(float ref) {
  return fmaf(-kExpByteSteps, ref, kExpByteFloor + 56.f + kExpByteBias);
}
// A score's carrier (float32, not yet clamped: exp_bytes4 converts and clamps).
__device__ __forceinline__ float exp_byte(float s, float scale8, float base) { return fmaf(s, scale8, base); }
// The bytes of two carriers as f16x2, lo's in the low half.
__device__ __forceinline__ u32 exp_byte_pair(float lo, float hi) {
  u32 h;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(hi), "f"(lo));
  asm("max.NaN.f16x2 %0, %0, %1;" : "+r"(h) : "r"(0x64006400u));  // 2^10 in both halves
  return h;
}
// Four carriers' bytes, a in the low byte: 2 conversions, 2 half maxima and a permute. Made where P
// is packed (sm90/fp8.cuh: pack_p_e4m3), the pairs leave S's registers as the float32 carriers do;
// made in the softmax step, ptxas serialized every wgmma of the fp8 kernels (C7511).
__device__ __forceinline__ u32 exp_bytes4(float a, float b, float c, float d) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, 0x6420;" : "=r"(r) : "r"(exp_byte_pair(a, b)), "r"(exp_byte_pair(c, d)));
  return r;
}

}  // namespace mla
