// Work decomposition for ragged batches: one launch covers every (query block, sequence, head).
//
// A linear tile index maps to (m_block, b, h) in an order chosen for the L2 cache and for balance:
//   * heads are grouped into SECTIONS of `heads_per_section` (the host sizes a section so that the
//     keys and values of its heads fit in about half the L2), and sections run one after another,
//     so the CTAs running at any moment read the K/V of a few heads, which then stay in L2
//     (ordering all heads side by side streamed every head's K/V from DRAM again per query block);
//   * inside a section the LAST query blocks of every sequence come first: under causal masks they
//     see the most keys, so the longest work starts earliest and short tiles fill the tail;
//   * then sequences, then the heads of the section (fastest);
//   * the last `tail_blocks` query blocks of that order (every sequence's first ones: under a causal
//     mask the fewest keys) leave their sections and end the launch, all heads together. With
//     sections, each section's short tiles would otherwise run amid the next section's long ones,
//     and the launch would end on the last section's short tiles alone, too few to even out the
//     CTAs' finishing times (a few work tiles per SM: 2-3% of the launch at H = 16, 1 x 8192).
//     Their keys are each sequence's first blocks, read again by several pooled tiles each where
//     the heads are few; the host pools only there (mla_cupy/_select.py: tail_blocks).
// Sequences shorter than the grid's q_max_seq_len leave indices that decode to nothing.
// The portable kernel launches one CTA per index; the Hopper kernel is persistent and takes the
// indices in this order from a counter as its CTAs free up (sm90/scheduler.cuh), so longest-first
// holds across CTAs and indices that decode to nothing cost a CTA almost nothing.
#pragma once
#include "common.cuh"

namespace mla {

struct SeqOffsets {
  const u32* q_offsets;      // valid_length[B + 1]: rows of each sequence in q / out
  const u32* kv_begin;       // [B]: row of each sequence's first key in k / v (/ plain k_rope)
  const u32* kv_end;         // [B]: one past its last key (cache_row_offsets + 1 in the plain call)
  const u32* cache_offsets;  // [B] absolute position of key 0, or nullptr (0)
  const i64* q_start_pos;    // [B] absolute position of query 0, or nullptr (end-aligned default)
};

struct WorkTile {
  int b, h, m_block;
  int sq, sk;      // query and key counts of the sequence
  i64 q_row0;      // first row of the sequence in q / out
  i64 kv_row0;     // first row of the sequence in k / v
  i64 q_pos0;      // absolute position of query 0
  i64 k_pos0;      // absolute position of key 0
};

// Decodes tile `idx` (0 <= idx < num_m_blocks * batch * num_heads). Returns false when the tile has
// no rows (its sequence is shorter than m_block * block_m). from_end: m_block counts the query
// blocks from the sequence's end (0: its last block_m rows; the caller places the rows), in the same
// order (every sequence's last block first). tail_blocks < num_m_blocks: query blocks (counted from
// the end) past num_m_blocks - tail_blocks come after every section, all heads together.
__device__ __forceinline__ bool decode_work_tile(const SeqOffsets& so, int idx, int num_heads, int heads_per_section,
                                                 int batch, int num_m_blocks, int block_m, WorkTile& w,
                                                 bool from_end = false, int tail_blocks = 0) {
  const int lead = num_m_blocks - tail_blocks;   // query blocks in the sections
  const int lead_tiles = lead * batch * num_heads;
  int j;  // the query block counted from the end
  if (idx < lead_tiles) {
    const int section_tiles = lead * batch * heads_per_section;  // tiles of a full section
    const int sec = idx / section_tiles;
    const int hs = min(heads_per_section, num_heads - sec * heads_per_section);  // the last one may be short
    int rest = idx - sec * section_tiles;
    w.h = sec * heads_per_section + rest % hs;
    rest /= hs;
    w.b = rest % batch;
    j = rest / batch;
  } else {
    int rest = idx - lead_tiles;
    w.h = rest % num_heads;
    rest /= num_heads;
    w.b = rest % batch;
    j = lead + rest / batch;
  }
  w.m_block = from_end ? j : num_m_blocks - 1 - j;
  w.q_row0 = so.q_offsets[w.b];
  w.sq = static_cast<int>(so.q_offsets[w.b + 1] - so.q_offsets[w.b]);
  if (w.m_block * block_m >= w.sq) return false;
  w.kv_row0 = so.kv_begin[w.b];
  w.sk = static_cast<int>(so.kv_end[w.b] - so.kv_begin[w.b]);
  w.k_pos0 = so.cache_offsets ? static_cast<i64>(so.cache_offsets[w.b]) : 0;
  // Default: queries aligned to the end of the keys (MAX, FA bottom-right causal, FlashInfer append).
  w.q_pos0 = so.q_start_pos ? so.q_start_pos[w.b] : w.k_pos0 + w.sk - w.sq;
  return true;
}

// Key indices [n_begin, n_end) of the sequence that any query position in [q_lo, q_hi] may see.
template <typename Mask>
__device__ __forceinline__ void visible_key_span(const Mask& mask, const WorkTile& w, i64 q_lo, i64 q_hi,
                                                 int& n_begin, int& n_end) {
  i64 k_lo, k_hi;
  mask.key_range(q_lo, q_hi, k_lo, k_hi);
  const i64 sk = w.sk;
  const i64 lo = k_lo - w.k_pos0 < 0 ? 0 : (k_lo - w.k_pos0 > sk ? sk : k_lo - w.k_pos0);
  const i64 hi = k_hi - w.k_pos0 < lo ? lo : (k_hi - w.k_pos0 > sk ? sk : k_hi - w.k_pos0);
  n_begin = static_cast<int>(lo);
  n_end = static_cast<int>(hi);
}

}  // namespace mla
