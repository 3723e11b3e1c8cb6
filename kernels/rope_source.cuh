// Where the shared rotary part of key j of sequence b comes from (SPEC "Where rope_j comes from").
// Both sources return a pointer to the Dr contiguous rope values of that key, or nullptr when the
// key cannot be read safely (a paged-cache block id outside [0, num_blocks) or a page index past
// the lookup table): the kernels then zero-fill the row and treat the key as masked.
#pragma once
#include "common.cuh"

namespace mla {

// Flat description passed from Python; unused fields are zero for the plain source.
struct RopeArgs {
  const void* base;      // plain: k_rope data; paged: blocks data + rope_offset elements
  i64 row_stride;        // elements between consecutive keys (plain) or page slots (paged)
  i64 block_stride;      // paged: elements between blocks
  const u32* lookup;     // paged: lookup_table[B, max_pages], read as unsigned
  i64 lookup_stride;     // paged: elements between lookup rows
  int log2_page_size;    // paged
  u32 num_blocks;        // paged
  u32 max_pages;         // paged
};

template <bool kPaged> struct RopeSource;

// A plain k_rope[Tk, 1, Dr] array (any row stride): key j of sequence b is row kv_begin[b] + j.
template <> struct RopeSource<false> {
  template <typename T>
  static __device__ __forceinline__ const T* row(const RopeArgs& a, int, i64 kv_row, i64) {
    return static_cast<const T*>(a.base) + kv_row * a.row_stride;
  }
};

// MAX's paged MLA cache: blocks[num_blocks, page_size, 1, Dc], key at absolute position t lives in
// block lookup[b, t / page_size], slot t % page_size.
constexpr u32 kNoBlock = 0xFFFFFFFFu;  // "this key cannot be read"

template <> struct RopeSource<true> {
  // The block holding position t of sequence b, or kNoBlock (page past the table, id out of range).
  static __device__ __forceinline__ u32 block(const RopeArgs& a, int b, i64 t) {
    const i64 page_idx = t >> a.log2_page_size;
    if (t < 0 || page_idx >= static_cast<i64>(a.max_pages)) return kNoBlock;
    const u32 blk = a.lookup[static_cast<i64>(b) * a.lookup_stride + page_idx];
    return blk < a.num_blocks ? blk : kNoBlock;
  }
  static __device__ __forceinline__ int slot(const RopeArgs& a, i64 t) {
    return static_cast<int>(t & ((1LL << a.log2_page_size) - 1));
  }
  // The rope values of position t in block blk (a block() result other than kNoBlock).
  template <typename T>
  static __device__ __forceinline__ const T* at(const RopeArgs& a, u32 blk, i64 t) {
    return static_cast<const T*>(a.base) + static_cast<i64>(blk) * a.block_stride + slot(a, t) * a.row_stride;
  }
  template <typename T>
  static __device__ __forceinline__ const T* row(const RopeArgs& a, int b, i64, i64 t) {
    const u32 blk = block(a, b, t);
    return blk == kNoBlock ? nullptr : at<T>(a, blk, t);
  }
};

}  // namespace mla
