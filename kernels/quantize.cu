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
//
// V with its V^T (quantize_v_transposed_kernel): V takes no scale, so its quantization is a cast
// of each value alone, and the kernel that makes V^T (vt_layout.cuh) for a call can make the e4m3
// bytes too: the walk of vt_tile.cuh over the columns of V^T loads each key of each sequence once,
// as 16 values of T per lane (8 lanes per key and head: whole 128-byte lines of e4m3 written to
// v8), casts them, and writes the transposed tile (whole 128-byte rows of vt). Rows of v past the
// last sequence are in no column: quantize_rows_kernel (use_scale = 0) casts them.
#include "common.cuh"
#include "e4m3.cuh"
#include "vt_tile.cuh"

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

// x[Tk, H, 128] (T; element strides x_st, x_sh, the last dimension contiguous) -> v8[Tk, H, 128]
// e4m3 bytes (contiguous; the rows of the `batch` >= 1 sequences [kv_begin[b], kv_end[b]) only) and
// vt[H][128][cols] (every column). Grid (ceil(cols / kVtCols), H), kVtThreads threads. `vec`: x's
// pointer and byte strides are multiples of 16 (16-byte loads), else element loads.
template <typename T>
__global__ void __launch_bounds__(kVtThreads) quantize_v_transposed_kernel(
    const T* __restrict__ x, i64 x_st, i64 x_sh, const u32* __restrict__ kv_begin, const u32* __restrict__ kv_end,
    int batch, unsigned char* __restrict__ v8, unsigned char* __restrict__ vt, i64 cols, int vec) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));  // values of T per 16 bytes
  const int h = blockIdx.y, heads = gridDim.y;
  const auto load = [&](i64 row, int c) {
    const T* src = x + row * x_st + h * x_sh + 16 * c;
    float f[16];
    if (vec) {
#pragma unroll
      for (int i = 0; i < 16 / kPer; ++i) {
        const uint4 u = reinterpret_cast<const uint4*>(src)[i];
        const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
        for (int k = 0; k < kPer; ++k) f[i * kPer + k] = to_float(e[k]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) f[i] = to_float(src[i]);
    }
    const uint4 bytes = make_uint4(e4m3x4(f[0], f[1], f[2], f[3]), e4m3x4(f[4], f[5], f[6], f[7]),
                                   e4m3x4(f[8], f[9], f[10], f[11]), e4m3x4(f[12], f[13], f[14], f[15]));
    *reinterpret_cast<uint4*>(v8 + (row * heads + h) * 128 + 16 * c) = bytes;
    return bytes;
  };
  write_vt_tile(load, kv_begin, kv_end, batch, vt, cols, h, static_cast<i64>(blockIdx.x) * kVtCols);
}

}  // namespace mla
