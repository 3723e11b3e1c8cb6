// merge_states: combine two partial attention results over disjoint key sets (the formula and
// the empty-side rules are in merge.cuh). One warp per (token, head) row (Dv a multiple of 4); out may alias out_a and lse_out may alias
// lse_a (in-place fold).
#include "common.cuh"
#include "merge.cuh"

namespace mla {

constexpr int kMergeWarps = 8;

template <typename InT, typename OutT>
__global__ void __launch_bounds__(kMergeWarps * 32) merge_states_kernel(
    const InT* a, const float* lse_a, const InT* b, const float* lse_b, OutT* out, float* lse_out,
    i64 tokens, int heads, int dv,
    i64 a_st, i64 a_sh, i64 b_st, i64 b_sh, i64 o_st, i64 o_sh, i64 la_st, i64 lb_st, i64 lo_st) {
  const i64 row = static_cast<i64>(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= tokens * heads) return;
  const i64 t = row / heads;
  const int h = static_cast<int>(row % heads);
  const MergeWeights mw = merge_weights(lse_a[t * la_st + h], lse_b[t * lb_st + h]);
  const InT* pa = a + t * a_st + h * a_sh;
  const InT* pb = b + t * b_st + h * b_sh;
  OutT* po = out + t * o_st + h * o_sh;
  // Four consecutive values per lane and step (16-byte loads for float32, 8-byte for 16-bit types).
  for (int d = 4 * lane; d < dv; d += 128) {
    float xa[4], xb[4], r[4];
    load4<InT>(pa + d, xa);
    load4<InT>(pb + d, xb);
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = merge_value(mw, xa[i], xb[i]);
    store4<OutT>(po + d, r);
  }
  __syncwarp();  // every lane has read lse_a before lane 0 may overwrite it in place
  if (lane == 0 && lse_out != nullptr) lse_out[t * lo_st + h] = mw.lse;
}

}  // namespace mla
