// The parameter fields that the prefill kernels (mla_prefill_sm80.cu, sm90/params.cuh) and the
// paged rope's gather (rope_gather.cu) share, listed once as X-macros of (type, name) pairs for
// their parameter structs (params_abi.cuh), each group in this order.
#pragma once
#include "common.cuh"

// The ragged batch (tile_scheduler.cuh: SeqOffsets).
#define MLA_SEQ_OFFSET_PARAMS(X)                                                                    \
  X(const u32*, q_offsets) X(const u32*, kv_begin) X(const u32*, kv_end) X(const u32*, cache_offsets)        \
  X(const i64*, q_start_pos)
// The rope source (rope_source.cuh: RopeArgs): a plain rope's rows, or a paged cache and its table.
#define MLA_ROPE_PARAMS(X)                                                                          \
  X(const void*, rope_base) X(i64, rope_row_stride) X(i64, rope_block_stride) X(const u32*, lookup)          \
  X(i64, lookup_stride) X(int, log2_page_size) X(u32, num_blocks) X(u32, max_pages)
// The work: heads, L2 sections of heads, sequences, query blocks of the longest sequence
// (tile_scheduler.cuh).
#define MLA_WORK_PARAMS(X) X(int, num_heads) X(int, heads_per_section) X(int, batch) X(int, num_m_blocks)
// Softmax scale times log2(e), the mask's argument, merge into out / lse (chunked prefill).
#define MLA_SCORE_PARAMS(X) X(float, scale_log2) X(i64, mask_arg) X(int, accumulate)
