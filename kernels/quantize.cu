// fp8 quantizers of the MLA prefill inputs (SPEC "Data types"), bit-exact with mla_cupy/quant.py:
// scale = amax / 448 in float32 (1 when amax is 0), values divided by it in float32 (IEEE
// division), cast to e4m3 with round-to-nearest-even and saturation to +-448; 16-bit outputs
// rounded to nearest even.
//
// One CTA per row r of x[R, H, W] (W values per head, the last contiguous). The first n8 values of
// each head are stored as e4m3 bytes in q8[R, H, n8], the other W - n8 in T in rest[R, H, W - n8]
// (both contiguous). With `side` (k_rope[R, 1, 64] for the keys) that row is divided by the same
// scale into side_out[R, 1, 64]. With use_scale = 0 nothing is scaled (V: a saturating cast).
// With rope8 (the all-e4m3 mode) `rest` and `side_out` are e4m3 bytes too, and the side row counts
// in the row's amax (the key's scale covers its 128 nope values of every head and its 64 rope
// values); otherwise they are T and the amax is over x's row alone.
#include "common.cuh"
#include "e4m3.cuh"

namespace mla {

constexpr int kQuantThreads = 256;
constexpr float kE4m3Max = 448.f;

template <typename T>
__global__ void __launch_bounds__(kQuantThreads) quantize_rows_kernel(
    const T* __restrict__ x, i64 x_st, i64 x_sh, int heads, int width, int n8, unsigned char* __restrict__ q8,
    void* __restrict__ rest, float* __restrict__ scale_out, const T* __restrict__ side, i64 side_st,
    void* __restrict__ side_out, int use_scale, int rope8) {
  __shared__ float warp_max[kQuantThreads / 32];
  const i64 r = blockIdx.x;
  const int n = heads * width;
  float scale = 1.f;
  if (use_scale) {
    float amax = 0.f;
    for (int i = threadIdx.x; i < n; i += kQuantThreads)
      amax = fmaxf(amax, fabsf(to_float(x[r * x_st + (i / width) * x_sh + i % width])));
    if (rope8 && side != nullptr)
      for (int c = threadIdx.x; c < 64; c += kQuantThreads) amax = fmaxf(amax, fabsf(to_float(side[r * side_st + c])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = warp_max[0];
#pragma unroll
    for (int w = 1; w < kQuantThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
    scale = amax > 0.f ? __fdiv_rn(amax, kE4m3Max) : 1.f;
    if (threadIdx.x == 0) scale_out[r] = scale;
  }
  for (int i = threadIdx.x; i < n; i += kQuantThreads) {
    const int h = i / width, c = i % width;
    const float v = use_scale ? __fdiv_rn(to_float(x[r * x_st + h * x_sh + c]), scale) : to_float(x[r * x_st + h * x_sh + c]);
    const i64 o = (r * heads + h) * (width - n8) + (c - n8);
    if (c < n8) q8[(r * heads + h) * n8 + c] = to_e4m3(v);
    else if (rope8) static_cast<unsigned char*>(rest)[o] = to_e4m3(v);
    else static_cast<T*>(rest)[o] = from_float<T>(v);
  }
  if (side != nullptr)
    for (int c = threadIdx.x; c < 64; c += kQuantThreads) {
      const float v = __fdiv_rn(to_float(side[r * side_st + c]), scale);
      if (rope8) static_cast<unsigned char*>(side_out)[r * 64 + c] = to_e4m3(v);
      else static_cast<T*>(side_out)[r * 64 + c] = from_float<T>(v);
    }
}

}  // namespace mla
