// What every backward kernel shares (the Hopper and portable main kernels, the pre-pass and the
// post-passes, kernels/mla_backward_*.cu): the main kernels' parameters, the layout of the float32
// workspace, and the work decomposition.
//
// The backward of out = softmax(scale * q key^T) v over the visible pairs, with key_j =
// concat(k_j, rope_j) and rope_j shared by every head, given dout, out and the natural-log lse:
//   P = exp(scale * S - lse)      dv_j = sum_i P_ij dout_i         D_i = dout_i . out_i
//   dP_ij = dout_i . v_j          dS = P * (dP - D)
//   dq_i = scale * sum_j dS_ij key_j        dkey_j = scale * sum_i dS_ij q_i
//   dk_j = dkey_j[:128] per head            dk_rope_j = sum over heads of dkey_j[128:]
//
// Work: key-block CTAs. A work tile is (key block n, head group g, sequence b); its CTA loads the
// block's rope rows once, then for each head of the group its k and v rows, and loops over the
// query blocks that see the key block, keeping dk and dv in registers. The rope part of dkey is
// summed over the group's heads in the same registers (it is never reset between heads) and leaves
// the tile once: the Hopper kernel adds it into the one slot of `rope_part` by a bulk reduction
// (in deterministic mode in head-group order: rope_sem), the portable kernel stores it into the
// group's own slot; the post-pass sums the slots.
// dq is summed over key blocks in the float32 `dq_accum`, one chunk of 64 rows per query block.
//
// The workspace (float32 unless said), sized by the host from num_chunks and the group count:
//   lse_log2[H][num_chunks * 64]   lse * log2(e) of each query row; +inf where the row sees no key
//                                  (lse -inf) and in a chunk's rows past its sequence, so that
//                                  P = exp2(scale_log2 * S - lse_log2) is 0 there
//   dpsum[H][num_chunks * 64]      D = dout . out (0 past the sequence)
//   dq_accum[H][num_chunks][64 * 192]  sum over key blocks of dS K (unscaled), layout per kernel
//                                  (the post-pass takes it as a template argument: DqLayout)
//   rope_part[slots][tk][64]       the scaled sum over heads of dkey[128:]: one slot that every
//                                  tile adds into (Hopper; zeroed by the pre-pass), or one per head
//                                  group (portable)
//   rope_sem[key_blocks] (int32)   Hopper, deterministic mode: head groups that have added a key
//                                  block's rope rows (key_block_of), zeroed with rope_part
//   dq_sem[H][num_chunks] (int32)  deterministic mode: key blocks that have added to a chunk
// Query block m of sequence b (rows 64m .. 64m + 63 of the sequence) is chunk
// chunk_of(q_offsets[b], b, m) = q_offsets[b] / 64 + b + m: the sequences' chunks never overlap
// (sequence b + 1's first chunk is past b's last one) and every chunk index is below
// num_chunks = Tq / 64 + B + 1. Key blocks are numbered alike (key_block_of), below
// Tk / block_n + B + 1.
#pragma once
#include "common.cuh"
#include "mask.cuh"
#include "params_abi.cuh"
#include "tile_scheduler.cuh"

namespace mla {
namespace bwd {

constexpr int kDv = 128;                 // values, dout and the per-head part of q / k
constexpr int kDr = 64;                  // the shared rope part
constexpr int kDqk = kDv + kDr;          // 192
constexpr int kChunkRows = 64;           // query rows of a query block and of a dq chunk
constexpr float kLog2e = 1.4426950408889634f;

// The main kernels' arguments common to both architectures (element strides of the 16-bit type).
#define MLA_BWD_COMMON_PARAMS(X)                                                                           \
  /* inputs: q [Tq, H, 192], k / v [Tk, H, 128], k_rope [Tk, 1, 64] (row stride), dout [Tq, H, 128] */    \
  X(const void*, q) X(const void*, k) X(const void*, v) X(const void*, k_rope) X(const void*, dout)       \
  X(i64, q_st) X(i64, q_sh) X(i64, k_st) X(i64, k_sh) X(i64, v_st) X(i64, v_sh) X(i64, rope_st)           \
  X(i64, do_st) X(i64, do_sh)                                                                             \
  /* results: dk, dv [Tk, H, 128] */                                                                      \
  X(void*, dk) X(void*, dv) X(i64, dk_st) X(i64, dk_sh) X(i64, dv_st) X(i64, dv_sh)                        \
  /* the workspace (above); tk: rows of rope_part per slot */                                            \
  X(float*, dq_accum) X(const float*, lse_log2) X(const float*, dpsum) X(float*, rope_part) X(int*, dq_sem) \
  X(int*, rope_sem) X(i64, tk)                                                                            \
  /* the ragged batch (tile_scheduler.cuh: SeqOffsets) */                                                 \
  X(const u32*, q_offsets) X(const u32*, kv_begin) X(const u32*, kv_end) X(const u32*, cache_offsets)     \
  X(const i64*, q_start_pos)                                                                              \
  /* the work: heads, heads per group, sequences, key blocks of the longest sequence, dq chunks, the */  \
  /* last head groups whose key blocks go slowest (decode_key_tile) */                                    \
  X(int, num_heads) X(int, heads_per_group) X(int, batch) X(int, num_n_blocks) X(int, num_chunks)        \
  X(int, tail_groups)                                                                                     \
  /* scale * log2(e), scale, the mask's argument, 1: dq summed in a fixed key-block order */             \
  X(float, scale_log2) X(float, scale) X(i64, mask_arg) X(int, deterministic)                           \
  /* the work-tile counter of this launch's stream (Hopper), or null: round robin */                      \
  X(u32*, tile_counter)

__device__ __forceinline__ i64 chunk_of(u32 q_offset, int b, int m) {
  return static_cast<i64>(q_offset / kChunkRows) + b + m;
}
// Key block n (of block_n keys) of sequence b, whose keys start at row kv_begin: its index among
// every sequence's key blocks, none shared, as chunk_of's (the sequences' key rows are consecutive).
__device__ __forceinline__ i64 key_block_of(u32 kv_begin, int b, int n, int block_n) {
  return static_cast<i64>(kv_begin / block_n) + b + n;
}

// Deterministic mode: a chunk's semaphore (dq_sem) read with acquire semantics, and its release
// increment once a key block's additions to the chunk are complete.
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// One work tile: key block n_block of sequence b (keys n0 .. n0 + block_n - 1 of the sequence,
// those below sk existing), heads h0 .. h0 + heads - 1, and the query blocks [m_begin, m_end) of
// the sequence whose rows may see one of its keys (m_end <= m_begin: none; the tile then writes
// zero gradients).
struct KeyTile {
  WorkTile w;      // b, sq, sk, row offsets and positions (w.h and w.m_block unused)
  int n_block, n0;
  int h0, heads;
  int m_begin, m_end;
  int valid;       // 0: no more work for this CTA
};

// Query rows [lo, hi) of the sequence that may see a key in [n0, n1) (keys of the sequence).
template <typename Mask>
__device__ __forceinline__ void visible_query_rows(const Mask& mask, const WorkTile& w, int n0, int n1, int& lo,
                                                   int& hi) {
  i64 q_lo, q_hi;
  mask.query_range(w.k_pos0 + n0, w.k_pos0 + n1 - 1, q_lo, q_hi);
  const i64 sq = w.sq;
  const i64 a = q_lo - w.q_pos0 < 0 ? 0 : (q_lo - w.q_pos0 > sq ? sq : q_lo - w.q_pos0);
  const i64 c = q_hi - w.q_pos0 < a ? a : (q_hi - w.q_pos0 > sq ? sq : q_hi - w.q_pos0);
  lo = static_cast<int>(a);
  hi = static_cast<int>(c);
}

// The query blocks [m_begin, m_end) that key block n of width block_n processes. Both ends never
// decrease with n (mask.cuh: the visible keys' ends never decrease with the query), which the
// deterministic mode relies on (dq_turn): a block that no row sees gets an empty range at its
// clamped row, 0 before every row or the last block's end past them (an empty range at 0 after the
// seen blocks would send the bisection past them, and their turns would never come).
template <typename Mask>
__device__ __forceinline__ void query_blocks(const Mask& mask, const WorkTile& w, int n, int block_n, int& m_begin,
                                             int& m_end) {
  const int n0 = n * block_n, n1 = min(n0 + block_n, w.sk);
  int lo = 0, hi = 0;
  if (n0 < n1) visible_query_rows(mask, w, n0, n1, lo, hi);
  if (lo >= hi) {  // no row sees the block: lo is 0 or the sequence's length
    m_begin = m_end = (lo + kChunkRows - 1) / kChunkRows;
    return;
  }
  m_begin = lo / kChunkRows;
  m_end = (hi + kChunkRows - 1) / kChunkRows;
}

// Deterministic mode: the turn of key block n at query block m's dq chunk (the chunk's semaphore
// counts the blocks that have added to it). The blocks that process m are [first, last], contiguous
// (query_blocks: both ends never decrease with n). Under a mask bounded above (every mask but
// NullMask) they add from the last down, the order in which they reach m: a higher block's query
// blocks begin no earlier, so it reaches m in no more steps, and it is handed out before
// (decode_key_tile, last_first). In key-block order from the first, each block of a causal mask
// waited on the one below it, which reaches m later: every tile then lasted as long as its
// sequence's longest. Without a mask every block starts at the first query block, and they add
// from the first up. Either end is found by bisection.
template <typename Mask>
__device__ __forceinline__ int dq_turn(const Mask& mask, const WorkTile& w, int m, int n, int block_n) {
  constexpr bool kLastFirst = Mask::kBoundedAbove;
  int lo = 0, hi = (w.sk + block_n - 1) / block_n;  // the first block past the end sought is in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    int mb, me;
    query_blocks(mask, w, mid, block_n, mb, me);
    if (kLastFirst ? mb > m : me > m) hi = mid;
    else lo = mid + 1;
  }
  return kLastFirst ? lo - 1 - n : n - lo;
}

// Decodes work tile idx (0 <= idx < num_n_blocks * batch * groups) in the order: key blocks fastest
// (block 0, which sees the most queries under a causal mask, first), then sequences, then head
// groups. The CTAs running at once then work on the key blocks of a few heads, whose q and dout
// rows stay in L2. The last tail_groups head groups (0: none) take key blocks slowest instead, so
// that the launch ends on the short tiles of every one of them rather than on the long first
// blocks of its last group. With last_first (deterministic mode) and a mask bounded above, a
// sequence's key blocks go out from its last, in either order: a block's turn at a chunk comes after
// the higher blocks of its sequence and group (dq_turn), so those must hold lower indices. Returns
// false when the sequence has no such key block.
template <typename Mask>
__device__ __forceinline__ bool decode_key_tile(const SeqOffsets& so, const Mask& mask, int idx, int num_heads,
                                                int heads_per_group, int batch, int num_n_blocks, int block_n,
                                                int tail_groups, bool last_first, KeyTile& t) {
  const int groups = (num_heads + heads_per_group - 1) / heads_per_group;
  const int tail0 = (groups - tail_groups) * num_n_blocks * batch;  // the first index of the tail
  int rest;
  if (idx < tail0) {
    t.n_block = idx % num_n_blocks;
    rest = idx / num_n_blocks;
  } else {
    const int j = idx - tail0, per_block = batch * tail_groups;
    t.n_block = j / per_block;
    rest = (groups - tail_groups) * batch + j % per_block;
  }
  if (Mask::kBoundedAbove && last_first) t.n_block = num_n_blocks - 1 - t.n_block;
  t.w.b = rest % batch;
  const int g = rest / batch;
  WorkTile& w = t.w;
  w.kv_row0 = so.kv_begin[w.b];
  w.sk = static_cast<int>(so.kv_end[w.b] - so.kv_begin[w.b]);
  t.n0 = t.n_block * block_n;
  if (t.n0 >= w.sk) return false;
  w.q_row0 = so.q_offsets[w.b];
  w.sq = static_cast<int>(so.q_offsets[w.b + 1] - so.q_offsets[w.b]);
  w.k_pos0 = so.cache_offsets ? static_cast<i64>(so.cache_offsets[w.b]) : 0;
  w.q_pos0 = so.q_start_pos ? so.q_start_pos[w.b] : w.k_pos0 + w.sk - w.sq;
  w.h = 0;
  w.m_block = 0;
  t.h0 = g * heads_per_group;
  t.heads = min(heads_per_group, num_heads - t.h0);
  query_blocks(mask, w, t.n_block, block_n, t.m_begin, t.m_end);
  t.valid = 1;
  return true;
}

}  // namespace bwd
}  // namespace mla
