// Attention masks as template parameters, on absolute positions (mla_cupy/masks.py states each
// predicate). Every mask here sees, from one query, one INTERVAL of keys, so two range queries
// define it:
//   key_range(q_lo, q_hi, k_lo, k_hi): a half-open range of key positions that contains every key
//       visible to any query in [q_lo, q_hi]; tiles outside it are never loaded nor computed. For
//       one query (q_lo == q_hi) it is exactly that query's visible keys: apply_mask (softmax.cuh)
//       tests a key with two integer compares against it.
//   all_visible(q_lo, q_hi, k_lo, k_hi): true when every pair in [q_lo, q_hi] x [k_lo, k_hi]
//       (inclusive) is visible; such tiles skip the per-element predicate.
//   query_range(k_lo, k_hi, q_lo, q_hi): the backward's converse of key_range, a half-open range of
//       query positions that contains every query seeing some key in [k_lo, k_hi]; the query
//       blocks outside it are never computed for those keys.
// The single run-time argument (window or chunk size) is `arg`; masks without one ignore it.
// kBoundedAbove: a query's visible keys end at a position that depends on the query (every mask but
// NullMask), so a tile's last keys can be invisible to a whole block of rows. kBoundedBelow: they
// also start at a position that depends on the query (the window and chunked masks), so a row's
// visible keys have two ends to test, not one.
// For every mask here a query's first and last visible key never decrease as the query moves on
// (tested on the CPU: tests/test_masks.py), which common_key_range relies on.
#pragma once
#include "common.cuh"

namespace mla {

struct NullMask {
  static constexpr bool kBoundedAbove = false;
  static constexpr bool kBoundedBelow = false;
  i64 arg;
  __device__ __forceinline__ void key_range(i64, i64, i64& k_lo, i64& k_hi) const {
    k_lo = kPosMin;
    k_hi = kPosMax;
  }
  __device__ __forceinline__ void query_range(i64, i64, i64& q_lo, i64& q_hi) const {
    q_lo = kPosMin;
    q_hi = kPosMax;
  }
  __device__ __forceinline__ bool all_visible(i64, i64, i64, i64) const { return true; }
};

struct CausalMask {
  static constexpr bool kBoundedAbove = true;
  static constexpr bool kBoundedBelow = false;
  i64 arg;
  __device__ __forceinline__ void key_range(i64, i64 q_hi, i64& k_lo, i64& k_hi) const {
    k_lo = kPosMin;
    k_hi = q_hi + 1;
  }
  __device__ __forceinline__ void query_range(i64 k_lo, i64, i64& q_lo, i64& q_hi) const {
    q_lo = k_lo;
    q_hi = kPosMax;
  }
  __device__ __forceinline__ bool all_visible(i64 q_lo, i64, i64, i64 k_hi) const { return k_hi <= q_lo; }
};

// Causal with a window of `arg` keys counting the diagonal: visible when 0 <= q - k < arg.
struct SlidingWindowCausalMask {
  static constexpr bool kBoundedAbove = true;
  static constexpr bool kBoundedBelow = true;
  i64 arg;
  __device__ __forceinline__ void key_range(i64 q_lo, i64 q_hi, i64& k_lo, i64& k_hi) const {
    k_lo = q_lo - arg + 1;
    k_hi = q_hi + 1;
  }
  __device__ __forceinline__ void query_range(i64 k_lo, i64 k_hi, i64& q_lo, i64& q_hi) const {
    q_lo = k_lo;
    q_hi = k_hi + arg;
  }
  __device__ __forceinline__ bool all_visible(i64 q_lo, i64 q_hi, i64 k_lo, i64 k_hi) const {
    return k_hi <= q_lo && q_hi - k_lo < arg;
  }
};

// Query and key in the same chunk of `arg` positions (floor division, also for negatives).
struct ChunkedMask {
  static constexpr bool kBoundedAbove = true;
  static constexpr bool kBoundedBelow = true;
  i64 arg;
  __device__ __forceinline__ void key_range(i64 q_lo, i64 q_hi, i64& k_lo, i64& k_hi) const {
    k_lo = floor_div(q_lo, arg) * arg;
    k_hi = (floor_div(q_hi, arg) + 1) * arg;
  }
  __device__ __forceinline__ void query_range(i64 k_lo, i64 k_hi, i64& q_lo, i64& q_hi) const {
    q_lo = floor_div(k_lo, arg) * arg;
    q_hi = (floor_div(k_hi, arg) + 1) * arg;
  }
  __device__ __forceinline__ bool all_visible(i64 q_lo, i64 q_hi, i64 k_lo, i64 k_hi) const {
    const i64 c = floor_div(q_lo, arg);
    return floor_div(q_hi, arg) == c && floor_div(k_lo, arg) == c && floor_div(k_hi, arg) == c;
  }
};

struct ChunkedCausalMask {
  static constexpr bool kBoundedAbove = true;
  static constexpr bool kBoundedBelow = true;
  i64 arg;
  __device__ __forceinline__ void key_range(i64 q_lo, i64 q_hi, i64& k_lo, i64& k_hi) const {
    k_lo = floor_div(q_lo, arg) * arg;
    k_hi = q_hi + 1;
  }
  __device__ __forceinline__ void query_range(i64 k_lo, i64 k_hi, i64& q_lo, i64& q_hi) const {
    q_lo = k_lo;
    q_hi = (floor_div(k_hi, arg) + 1) * arg;
  }
  __device__ __forceinline__ bool all_visible(i64 q_lo, i64 q_hi, i64 k_lo, i64 k_hi) const {
    const i64 c = floor_div(q_lo, arg);
    return k_hi <= q_lo && floor_div(q_hi, arg) == c && floor_div(k_lo, arg) == c;
  }
};

// Keys [k_lo, k_hi) visible to EVERY query in [q_lo, q_hi] (empty when k_hi <= k_lo): with the
// first and last visible key non-decreasing in the query, that is from the last query's first key
// to the first query's last key.
template <typename Mask>
__device__ __forceinline__ void common_key_range(const Mask& mask, i64 q_lo, i64 q_hi, i64& k_lo, i64& k_hi) {
  i64 a, b;
  mask.key_range(q_hi, q_hi, k_lo, a);
  mask.key_range(q_lo, q_lo, b, k_hi);
}

}  // namespace mla
