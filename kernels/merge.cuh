// Exact merge of two partial attention results over disjoint key sets, from their natural-log
// log-sum-exps. Shared by merge_states.cu and the prefill epilogues (store_rows with accumulate):
//   m = max(la, lb); ea = exp(la - m); eb = exp(lb - m)
//   out = (ea * out_a + eb * out_b) / (ea + eb);  lse = m + log(ea + eb)
// An empty side (lse = -inf) gets weight 0 and its values are never read into the sum (garbage
// or NaN there cannot leak); both empty gives out = 0 and lse = -inf. A NaN lse on either side
// makes the merged row and its lse NaN.
#pragma once
#include "common.cuh"

namespace mla {

struct MergeWeights {
  float wa, wb;  // normalized weights of side a and side b
  float lse;     // lse of the merged result
};

__device__ __forceinline__ MergeWeights merge_weights(float la, float lb) {
  if (isnan(la) || isnan(lb)) return {la + lb, la + lb, la + lb};  // a NaN lse: the merged row is NaN
  const float m = fmaxf(la, lb);
  if (m == neg_inf()) return {0.f, 0.f, neg_inf()};
  const float ea = expf(la - m), eb = expf(lb - m);
  const float inv = 1.f / (ea + eb);
  return {ea * inv, eb * inv, m + logf(ea + eb)};
}

__device__ __forceinline__ float merge_value(const MergeWeights& w, float a, float b) {
  return (w.wa != 0.f ? w.wa * a : 0.f) + (w.wb != 0.f ? w.wb * b : 0.f);  // NaN weights give NaN
}

}  // namespace mla
