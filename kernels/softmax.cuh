// Per-thread pieces of the attention tile shared by every kernel variant. A thread holds two rows
// of an accumulator tile (rows g and g + 8 of its warp's 16, g = lane / 4) in the mma.sync / wgmma
// C layout: element e of n-tile j is (row g + 8 * (e / 2), column 8 * j + 2 * (lane % 4) + e % 2).
#pragma once
#include "common.cuh"
#include "e4m3.cuh"
#include "merge.cuh"
#include "tile_scheduler.cuh"

namespace mla {

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Sets invisible scores to -inf: keys past the block's span (n_end), pairs the mask removes, and
// (when `key_ok` is given) keys whose data could not be read. `row0` is the sequence row of g.
// A row's visible keys are one interval (mask.cuh), found once per row as tile columns [lo, hi).
template <int kSTiles, typename Mask>
__device__ __forceinline__ void apply_mask(float (&s)[kSTiles][4], const Mask& mask, const WorkTile& w, int row0,
                                           int n0, int n_end, const unsigned char* key_ok) {
  const int lane = threadIdx.x % 32;
  const i64 key0 = w.k_pos0 + n0;  // absolute position of the tile's column 0
  int lo[2], hi[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const i64 q = w.q_pos0 + row0 + 8 * r;
    i64 k_lo, k_hi;
    mask.key_range(q, q, k_lo, k_hi);
    const i64 c_lo = k_lo - key0, c_hi = k_hi - key0;  // |positions| < 2^62: no overflow
    lo[r] = static_cast<int>(c_lo < 0 ? 0 : (c_lo > 8 * kSTiles ? 8 * kSTiles : c_lo));
    hi[r] = static_cast<int>(c_hi < 0 ? 0 : (c_hi > n_end - n0 ? n_end - n0 : c_hi));
  }
#pragma unroll
  for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = nt * 8 + 2 * (lane & 3) + (e & 1);
      const int r = e >> 1;
      bool vis = col >= lo[r] && col < hi[r];
      if (key_ok != nullptr) vis = vis && key_ok[col];
      if (!vis) s[nt][e] = neg_inf();
    }
  }
}

// Online softmax in the log2 domain with the scale folded in. A row with nothing visible yet keeps
// max = -inf and uses 0 as its reference, so exp2(-inf) = 0 and no NaN appears.
struct OnlineSoftmax {
  float row_max[2];
  float row_sum[2];  // this lane's partial sums; quad-reduced in finish()

  __device__ __forceinline__ void init() {
    row_max[0] = row_max[1] = neg_inf();
    row_sum[0] = row_sum[1] = 0.f;
  }

  // Turns scores s into unnormalized probabilities (in place) and returns in `corr` the factor by
  // which each of the thread's two rows of the output accumulator must be rescaled. Split from
  // rescale() so that a kernel can run this while the previous tile's P V is still in flight.
  template <int kSTiles>
  __device__ __forceinline__ void update_scores(float (&s)[kSTiles][4], float scale_log2, float (&corr)[2]) {
    const float row_scale[2] = {scale_log2, scale_log2};
    update_scores(s, row_scale, corr);
  }
  // The same with a scale per row (scale_log2[r] for row g + 8 r): the fp8 kernel folds q_scale in.
  // With kLog2P > 0 the probabilities (and row_sum) come out multiplied by 2^kLog2P, for free: the
  // exponent's reference is lowered by kLog2P (the fp8 kernel's kPScale).
  // kSum false leaves row_sum alone: the caller sums the probabilities elsewhere and rescales the
  // sums itself (rescale_sums; MLA_SM90_FP8_ROWSUM_MMA sums them on the tensor pipe). kSlackQ > 0:
  // a row keeps its maximum (the exponents' reference) until a tile raises it by more than kSlackQ / 4
  // (log2 units), so that its factor is 1 on the tiles in between; the probabilities then reach
  // 2^(kSlackQ / 4 + kLog2P). kBytes: each probability is left as an exp_byte carrier of its e4m3
  // byte, unclamped (no sums: the caller's are P's bytes' on the tensor pipe; its pack clamps).
  template <int kLog2P = 0, bool kSum = true, int kSlackQ = 0, bool kBytes = false, int kSTiles>
  __device__ __forceinline__ void update_scores(float (&s)[kSTiles][4], const float (&scale_log2)[2],
                                                float (&corr)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // The row maximum of scale * s, found on the raw scores and scaled once (scale >= 0: the API
      // rejects others), by a tree (log2 kSTiles dependent steps, not kSTiles). A fully masked row
      // keeps -inf: "nothing new".
      float m[kSTiles];
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) m[nt] = fmaxf(s[nt][2 * r], s[nt][2 * r + 1]);
#pragma unroll
      for (int step = 1; step < kSTiles; step *= 2)
#pragma unroll
        for (int i = 0; i + step < kSTiles; i += 2 * step) m[i] = fmaxf(m[i], m[i + step]);
      const float scaled = quad_max(m[0]) * scale_log2[r];
      // (with the slack: from -inf any finite maximum is more than it; a NaN maximum keeps the old,
      // as fmaxf does)
      const float mx = kSlackQ > 0 ? (scaled > row_max[r] + 0.25f * kSlackQ ? scaled : row_max[r])
                                   : fmaxf(row_max[r], scaled);
      const float ref = mx == neg_inf() ? 0.f : mx;
      corr[r] = fast_exp2(row_max[r] - ref);
      row_max[r] = mx;
      const float ref_p = ref - static_cast<float>(kLog2P);
      static_assert(!(kBytes && kSum), "exp bytes: the sums elsewhere");
      float scale8 = 0.f, base = 0.f;
      if constexpr (kBytes) {
        // made here in every tile (volatile): hoisted out of the loops, 8 scale would stay live beside
        // the scale through the masked loops too
        asm volatile("mul.f32 %0, %1, %2;" : "=f"(scale8) : "f"(scale_log2[r]), "f"(kExpByteSteps));
        base = exp_byte_base(ref_p);
      }
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          if constexpr (kBytes) {
            s[nt][e] = exp_byte(s[nt][e], scale8, base);
            continue;
          }
          s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2[r], -ref_p));
          if constexpr (kSum) sum += s[nt][e];
        }
      }
      if constexpr (kSum) row_sum[r] = row_sum[r] * corr[r] + sum;
    }
  }

  // The row sums rescaled by an update_scores<.., kSum = false>'s factors, as O is.
  __device__ __forceinline__ void rescale_sums(const float (&corr)[2]) {
    row_sum[0] *= corr[0];
    row_sum[1] *= corr[1];
  }

  template <int kOTiles>
  __device__ __forceinline__ static void rescale(float (&o)[kOTiles][4], const float (&corr)[2]) {
#pragma unroll
    for (int dt = 0; dt < kOTiles; ++dt) {
      o[dt][0] *= corr[0];
      o[dt][1] *= corr[0];
      o[dt][2] *= corr[1];
      o[dt][3] *= corr[1];
    }
  }

  // Both steps at once, for kernels that do not overlap them with a matrix product.
  template <int kSTiles, int kOTiles>
  __device__ __forceinline__ void update(float (&s)[kSTiles][4], float (&o)[kOTiles][4], float scale_log2) {
    float corr[2];
    update_scores(s, scale_log2, corr);
    rescale(o, corr);
  }
};

// The probabilities of k-step kk (keys 16kk .. 16kk+15) as an m16n8k16 / wgmma A fragment: the
// accumulators of n-tiles 2kk and 2kk+1 are exactly that fragment, rounded to 16 bits.
template <typename T, int kSTiles>
__device__ __forceinline__ void pack_p(const float (&s)[kSTiles][4], int kk, u32 (&a)[4]) {
  a[0] = Elem<T>::pack(s[2 * kk][0], s[2 * kk][1]);
  a[1] = Elem<T>::pack(s[2 * kk][2], s[2 * kk][3]);
  a[2] = Elem<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = Elem<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// The weights that finish row r (0: row g, 1: row g + 8) of a thread's accumulator: the row's
// result is o * wb, plus out * wa with `accumulate` (out and lse already hold a partial result of
// the row over other keys, whose lse is lse_old: merge.cuh), and its natural-log lse is .lse. A
// row with no visible key gets wb = 0 and lse -inf (with nothing to merge: out 0). kFast: the
// reciprocal and log2 of the special-function unit instead of an IEEE division and logf (relative
// error about 2^-21). Called by every lane of the warp together (quad reduction).
template <bool kFast>
__device__ __forceinline__ MergeWeights row_weights(const OnlineSoftmax& sm, int r, bool accumulate, float lse_old) {
  constexpr float kLn2 = 0.6931471805599453f;
  const float l = quad_sum(sm.row_sum[r]);
  // no visible key: -inf; a NaN score made the sum NaN: the lse is NaN too (the contract's rule)
  const float lse_new = l > 0.f ? sm.row_max[r] * kLn2 + (kFast ? __logf(l) : logf(l)) : (isnan(l) ? l : neg_inf());
  MergeWeights mw{0.f, l > 0.f ? 1.f : 0.f, lse_new};  // side a: what out / lse hold; side b: this result
  if (accumulate) mw = merge_weights(lse_old, lse_new);
  mw.wb = l > 0.f ? (kFast ? __fdividef(mw.wb, l) : mw.wb / l) : 0.f;
  return mw;
}

// Whether sequence row `row` exists (0 <= row < sq); kMayBeNegative: rows before the first are
// possible (the Hopper kernel's blocks from the end), one unsigned compare for both bounds.
template <bool kMayBeNegative>
__device__ __forceinline__ bool row_exists(int row, int sq) {
  if constexpr (kMayBeNegative) return static_cast<unsigned>(row) < static_cast<unsigned>(sq);
  else return row < sq;
}

// Normalizes and writes the thread's two rows of O (those < sq; kMayBeNegative: and >= 0) and their natural-log lse.
// Rows with no visible key get 0 and -inf. With `accumulate`, out and lse already hold a partial
// result of these rows over other keys: it is read and merged with this one in place (merge.cuh),
// so chunked prefill needs no separate merge pass. Called by every thread of the warp together.
template <typename OutT, bool kFast = false, bool kMayBeNegative = false, int kOTiles>
__device__ __forceinline__ void store_rows(const float (&o)[kOTiles][4], const OnlineSoftmax& sm, const WorkTile& w,
                                          int row0, OutT* out, i64 o_st, i64 o_sh, float* lse, i64 lse_st,
                                          bool accumulate) {
  const int lane = threadIdx.x % 32;
  float lse_old[2] = {neg_inf(), neg_inf()};
  if (accumulate) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (row_exists<kMayBeNegative>(row0 + 8 * r, w.sq)) lse_old[r] = lse[(w.q_row0 + row0 + 8 * r) * lse_st + w.h];
    __syncwarp();  // every lane has read its lse before the quad leaders overwrite them
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const MergeWeights mw = row_weights<kFast>(sm, r, accumulate, lse_old[r]);
    const int row = row0 + 8 * r;
    if (row_exists<kMayBeNegative>(row, w.sq)) {
      const i64 grow = w.q_row0 + row;
      OutT* op = out + grow * o_st + w.h * o_sh + 2 * (lane & 3);
#pragma unroll
      for (int dt = 0; dt < kOTiles; ++dt) {
        float lo = o[dt][2 * r] * mw.wb, hi = o[dt][2 * r + 1] * mw.wb;
        if (accumulate && mw.wa > 0.f) {
          float old[2];
          load2<OutT>(op + dt * 8, old);
          lo += mw.wa * old[0];
          hi += mw.wa * old[1];
        }
        store2<OutT>(op + dt * 8, lo, hi);
      }
      if (lse != nullptr && (lane & 3) == 0) lse[grow * lse_st + w.h] = mw.lse;
    }
  }
}

}  // namespace mla
