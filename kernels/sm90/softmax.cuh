// The consumers' per-tile score work on Hopper: fp8 dequantization of S, the mask, the online
// softmax (../softmax.cuh: OnlineSoftmax, shared with the portable kernel) and P packed as the A
// operand of P V. A thread holds rows g and g + 8 of its warp's 16 (the wgmma C layout, ../softmax.cuh).
#pragma once
#include "../mask.cuh"
#include "../softmax.cuh"
#include "config.cuh"
#include "fp8.cuh"

namespace mla {
namespace sm90 {

// How a key tile's scores are masked: kMaskNone for tiles that every row of the warpgroup sees
// whole, kMaskApply on a mask's edge, kMaskTest to decide per tile and thread at run time.
enum MaskMode : int { kMaskNone = 0, kMaskApply = 1, kMaskTest = 2 };
template <int kMode> struct MaskTag { static constexpr int value = kMode; };

// fp8 per token: a tile's key scales start (kv_row0 + n0) % 4 floats into its stage's box (the
// producer loads the box from the 16-byte boundary); this thread's first one (its column
// 2 (threadIdx.x % 4) of n-tile 0) is this many floats in, n-tile nt's 8 nt further.
__device__ __forceinline__ i64 key_scale_index(i64 first_row) { return (first_row & 3) + 2 * (threadIdx.x % 4); }

// The key scales of this thread's columns of a tile, read from its K stage as soon as it is full,
// before the GEMMs that would hold the shared memory, so that their latency stays off the softmax's
// path.
template <int kNT>
__device__ __forceinline__ void load_key_scales(const float* box, i64 first_row, float (&ksc)[kNT][2]) {
  const float* p = box + key_scale_index(first_row);
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) ksc[nt][0] = p[nt * 8], ksc[nt][1] = p[nt * 8 + 1];
}

// An n-tile of S (rows g, g + 8; this thread's two columns) times its columns' key scales.
__device__ __forceinline__ void scale_columns(float (&s)[4], float even, float odd) {
  s[0] *= even;
  s[1] *= odd;
  s[2] *= even;
  s[3] *= odd;
}

// fp8 per token: S_ij *= k_scales[j] (q_scale[i] is folded into the row's softmax scale), over the
// first kTiles n-tiles of S's kNT (all of them by default).
template <int kTiles = 0, int kNT>
__device__ __forceinline__ void dequantize_scores(float (&s)[kNT][4], const float (&ksc)[kNT][2]) {
#pragma unroll
  for (int nt = 0; nt < (kTiles ? kTiles : kNT); ++nt) scale_columns(s[nt], ksc[nt][0], ksc[nt][1]);
}

// dequantize_scores with the key scales read from shared memory where they multiply: `addr` is
// the shared address of this thread's first scale (4 key_scale_index bytes into the box). Three
// fp8 consumers: at 160 registers S, O and a tile's 32 scales do not fit together. kPairs: `addr`
// is 8-byte aligned (EvenKeyRows: the box's first scale at an even float), so a thread's two
// scales of an n-tile come in one load.
template <int kTiles = 0, bool kPairs = false, int kNT>
__device__ __forceinline__ void dequantize_scores_at(float (&s)[kNT][4], u32 addr) {
#pragma unroll
  for (int nt = 0; nt < (kTiles ? kTiles : kNT); ++nt) {
    u32 even, odd;
    if constexpr (kPairs) {
      lds64(addr + 32 * nt, even, odd);
    } else {
      even = lds32(addr + 32 * nt);
      odd = lds32(addr + 32 * nt + 4);
    }
    scale_columns(s[nt], __uint_as_float(even), __uint_as_float(odd));
  }
}

// P (kPScale * P in fp8) as the A fragments of the kPvSteps k-steps of P V; kBytes: s holds
// exp_byte carriers.
template <class V, bool kBytes = kExpBytes<V>>
__device__ __forceinline__ void pack_probabilities(const float (&s)[kSTiles<V>][4], u32 (&pa)[kPvSteps<V>][4]) {
#pragma unroll
  for (int kk = 0; kk < kPvSteps<V>; ++kk) {
    if constexpr (V::kFp8) pack_p_e4m3<kBytes>(s, kk, pa[kk]);
    else pack_p<typename V::Elem>(s, kk, pa[kk]);
  }
}

// The keys each of the thread's two rows sees, as [lo[r], hi[r]) relative to the work tile's first
// key n_begin and inside its span [n_begin, n_end): found once per work tile (the mask's 64-bit
// position arithmetic, divisions for the chunked masks), so that masking a key tile is two integer
// compares per score. r0 is the sequence row of the thread's row g; rows past sq get the range of
// their would-be positions (never stored); kClampFirst: rows before the first (never stored) get row
// 0's, so that none sees less than a real row.
template <bool kClampFirst = false, class Mask>
__device__ __forceinline__ void row_key_ranges(const Mask& mask, const WorkTile& w, int r0, int n_begin, int n_end,
                                               int (&lo)[2], int (&hi)[2]) {
  const i64 key0 = w.k_pos0 + n_begin;
  const i64 span = n_end - n_begin;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    i64 k_lo, k_hi;
    const int row = r0 + 8 * r;
    const i64 q = w.q_pos0 + (kClampFirst && row < 0 ? 0 : row);
    mask.key_range(q, q, k_lo, k_hi);
    k_lo -= key0;  // |positions| < 2^62: no overflow
    k_hi -= key0;
    lo[r] = static_cast<int>(k_lo < 0 ? 0 : (k_lo > span ? span : k_lo));
    hi[r] = static_cast<int>(k_hi < 0 ? 0 : (k_hi > span ? span : k_hi));
  }
}

// Sets to -inf the scores of key tile t (of 8 kNT keys) outside each row's [lo, hi)
// (row_key_ranges). Returns nothing to rescale: the softmax treats a row with nothing visible yet as
// empty.
template <int kNT>
__device__ __forceinline__ void mask_tile(float (&s)[kNT][4], const int (&lo)[2], const int (&hi)[2], int t) {
  const int c0 = 2 * (threadIdx.x % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int l = lo[r] - t * 8 * kNT - c0, h = hi[r] - t * 8 * kNT - c0;  // this thread's columns: c0 + 8 nt + e
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = nt * 8 + e;
        if (!(col >= l && col < h)) s[nt][2 * r + e] = neg_inf();
      }
    }
  }
}

// Sets to -inf the scores of the tile's unreadable keys: `ok` holds a readable bit per key (key
// 32 w + b: word w, bit b). The thread's columns c0 + 8 nt + e sit in word nt / 4 at bit
// 8 (nt % 4) + c0 + e, so one shift per word puts them on constant bits. The words come in one
// 16-byte load, or (kByWord) in four loads, which ptxas can schedule with fewer registers live (the
// fp8 consumers with the row sums' accumulators at 160 registers: with the 16-byte load they spill).
template <int kNT, bool kByWord = false>
__device__ __forceinline__ void mask_unreadable(float (&s)[kNT][4], const u32 (&ok)[kKeyWordsMax]) {
  static_assert(kNT % 4 == 0 && kNT / 4 <= kKeyWordsMax, "four 8-column groups per 32-key word; one 16-byte load");
  const int c0 = 2 * (threadIdx.x % 4);
  u32 w[kKeyWordsMax];
  if constexpr (kByWord) {
#pragma unroll
    for (int i = 0; i < kKeyWordsMax; ++i) w[i] = ok[i] >> c0;
  } else {
    const uint4 w4 = *reinterpret_cast<const uint4*>(ok);
    w[0] = w4.x >> c0, w[1] = w4.y >> c0, w[2] = w4.z >> c0, w[3] = w4.w >> c0;
  }
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (!((w[nt / 4] >> (8 * (nt % 4) + e)) & 1u)) s[nt][e] = s[nt][2 + e] = neg_inf();
    }
  }
}

// Whether key tile t (of kBlockN keys) needs mask_tile for this thread's rows.
template <int kBlockN>
__device__ __forceinline__ bool tile_needs_mask(const int (&lo)[2], const int (&hi)[2], int t) {
  const int a = t * kBlockN, b = a + kBlockN;
  return lo[0] > a || hi[0] < b || lo[1] > a || hi[1] < b;
}

// The tiles [t_lo, t_hi) of a work tile's num_tiles key tiles (of kBlockN keys) that every row of a
// warpgroup sees whole: inside the keys common to its first and last row (mask.cuh:
// common_key_range) and the span [n_begin, n_end). Rows wr0 .. of the sequence (none when wr0 >= sq:
// then nothing is stored and nothing needs masking).
template <int kBlockN, class Mask>
__device__ __forceinline__ void full_tile_range(const Mask& mask, const WorkTile& w, int wr0, int n_begin, int n_end,
                                                int num_tiles, int& t_lo, int& t_hi) {
  t_lo = 0;
  t_hi = num_tiles;
  if (wr0 >= w.sq) return;
  const i64 q_lo = w.q_pos0 + wr0, q_hi = w.q_pos0 + min(wr0 + kWgRows - 1, w.sq - 1);
  i64 k_lo, k_hi;
  common_key_range(mask, q_lo, q_hi, k_lo, k_hi);
  const i64 key0 = w.k_pos0 + n_begin;                        // position of tile 0's first key
  const i64 lo = k_lo - key0;                                 // first fully visible key, from key0
  const i64 hi = (k_hi - w.k_pos0 < n_end ? k_hi - w.k_pos0 : n_end) - n_begin;  // one past the last
  t_lo = lo <= 0 ? 0 : static_cast<int>(lo >= static_cast<i64>(num_tiles) * kBlockN ? num_tiles : (lo + kBlockN - 1) / kBlockN);
  t_hi = hi <= 0 ? 0 : static_cast<int>(hi >= static_cast<i64>(num_tiles) * kBlockN ? num_tiles : hi / kBlockN);
  if (t_hi < t_lo) t_hi = t_lo;
}

// Whether the last of a work tile's key tiles is a half tile for a warpgroup (1) or not (0): it
// runs masked (t_hi < num_tiles: split loops only) and no row of the warpgroup sees a key of its
// second half. The warpgroup's last visible key is its last row's (a query's last visible key never
// decreases: mask.cuh). Rows wr0 .. of the sequence; none (wr0 >= sq): not half. Its rows past sq
// (never stored) are not consulted: keys of the second half they might see score -inf.
template <int kBlockN, class Mask>
__device__ __forceinline__ int last_tile_is_half(const Mask& mask, const WorkTile& w, int wr0, int n_begin,
                                                 int num_tiles, int t_hi) {
  if (wr0 >= w.sq || t_hi >= num_tiles) return 0;
  const i64 q_hi = w.q_pos0 + min(wr0 + kWgRows - 1, w.sq - 1);
  i64 k_lo, k_hi;
  mask.key_range(q_hi, q_hi, k_lo, k_hi);
  return k_hi - (w.k_pos0 + n_begin) <= static_cast<i64>(num_tiles - 1) * kBlockN + kBlockN / 2 ? 1 : 0;
}

// Key tiles from a work tile's first that hold a key a warpgroup's rows may see (kSkipTail): up to
// the tile of its last existing row's last visible key (a query's last visible key never decreases:
// mask.cuh), at least one. Rows wr0 .. of the sequence; none (wr0 >= sq): every tile.
template <int kBlockN, class Mask>
__device__ __forceinline__ int visible_tiles(const Mask& mask, const WorkTile& w, int wr0, int n_begin, int num_tiles) {
  if (wr0 >= w.sq) return num_tiles;
  const i64 q_hi = w.q_pos0 + min(wr0 + kWgRows - 1, w.sq - 1);
  i64 k_lo, k_hi;
  mask.key_range(q_hi, q_hi, k_lo, k_hi);
  const i64 hi = k_hi - (w.k_pos0 + n_begin);  // one past the last visible key, from tile 0's first
  if (hi >= static_cast<i64>(num_tiles) * kBlockN) return num_tiles;
  return hi <= kBlockN ? 1 : static_cast<int>((hi + kBlockN - 1) / kBlockN);
}

}  // namespace sm90
}  // namespace mla
