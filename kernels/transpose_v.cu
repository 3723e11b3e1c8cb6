// The fp8 per-token variant's pre-pass: v[Tk, H, 128] (e4m3 bytes) -> vt[H][128][cols] in the layout
// of vt_layout.cuh (per-sequence regions of aligned columns, the sigma key order in each group of
// 16, zeros elsewhere). A bandwidth-bound copy: every byte of v read once, every byte of vt written
// once, both as whole 128-byte lines (the walk of vt_tile.cuh, each key's bytes loaded as they are).
// A call given V^T ahead (the quantizer's, quantize.cu) launches none.
#include "common.cuh"
#include "params_abi.cuh"
#include "vt_tile.cuh"

namespace mla {

namespace vt_prepass {
// The arguments (params_abi.cuh): v [Tk, H, 128] e4m3 bytes (byte strides v_st, v_sh), the
// sequences' key rows [kv_begin[b], kv_end[b]) of `batch` sequences, vt [H][128][cols].
#define MLA_VT_PARAMS(X)                                                                            \
  X(const unsigned char*, v) X(i64, v_st) X(i64, v_sh) X(const u32*, kv_begin) X(const u32*, kv_end) \
  X(int, batch) X(unsigned char*, vt) X(i64, cols)
MLA_DEFINE_PARAMS(Params, MLA_VT_PARAMS)
// What the launch code reads besides the parameters (params_abi.cuh): threads per CTA, V^T columns
// per CTA.
#define MLA_VT_GEOMETRY(X) X(threads, kVtThreads) X(cols_per_cta, kVtCols)
MLA_DEFINE_GEOMETRY(MLA_VT_GEOMETRY)
}  // namespace vt_prepass

__global__ void __launch_bounds__(kVtThreads) transpose_v_e4m3_kernel(const __grid_constant__ vt_prepass::Params p) {
  const unsigned char* __restrict__ v = p.v;
  const i64 v_st = p.v_st, v_sh = p.v_sh;
  const int h = blockIdx.y;
  const auto load = [&](i64 row, int c) {
    return *reinterpret_cast<const uint4*>(v + row * v_st + h * v_sh + 16 * c);
  };
  write_vt_tile(load, p.kv_begin, p.kv_end, p.batch, p.vt, p.cols, h, static_cast<i64>(blockIdx.x) * kVtCols);
}

}  // namespace mla
