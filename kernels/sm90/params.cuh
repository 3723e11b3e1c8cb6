// The Hopper kernel's arguments: one struct passed by value as a __grid_constant__ parameter (the
// tensor maps must live in parameter space for TMA). Its layout is exported from the compiled module
// (params_abi.cuh), and the launch code packs its buffer from that export.
#pragma once
#include "../params_abi.cuh"
#include "../prefill_params.cuh"
#include "ptx.cuh"

namespace mla {
namespace sm90 {

// (type, name) of every field, in order. Pointers are untyped where the element type depends on
// the variant (the kernel casts them).
#define MLA_SM90_PARAMS(X)                                                                          \
  /* TMA maps: q (fp8: e4m3 q_nope), k (fp8: e4m3 k), v (fp8: the e4m3 V^T of the pre-pass), the  */ \
  /* rope (k_rope, or the key rows of a paged 16-bit rope's gather), q_rope, the key scales (fp8 */ \
  /* per token) and out (16-bit, for the staged epilogue's stores); unused maps are zero          */ \
  X(TensorMap, tm_q) X(TensorMap, tm_k) X(TensorMap, tm_v) X(TensorMap, tm_rope) X(TensorMap, tm_q_rope)      \
  X(TensorMap, tm_k_scales) X(TensorMap, tm_out)                                                    \
  /* results: out [Tq, H, 128] (element strides o_st, o_sh), lse [Tq, H] (row stride lse_st) or null */ \
  X(void*, out) X(float*, lse) X(i64, o_st) X(i64, o_sh) X(i64, lse_st)                             \
  /* the batch and the rope source (prefill_params.cuh; the rope: a paged cache's table, which */  \
  /* the rope warp flags, or an fp8 rope's rows), the work and the query blocks that end the    */  \
  /* launch outside the sections (tile_scheduler.cuh), the scores, and 1 if tm_out maps out (the */ \
  /* staged epilogue then stores whole row halves by TMA)                                        */ \
  MLA_SEQ_OFFSET_PARAMS(X) MLA_ROPE_PARAMS(X) MLA_WORK_PARAMS(X) X(int, tail_blocks) MLA_SCORE_PARAMS(X)      \
  X(int, out_by_tma)                                                                                \
  /* fp8 per token: q_scale [Tq] (stride); fp8 rope: its scales per key (plain rows / paged slots) */ \
  X(const float*, q_scale) X(i64, q_scale_stride) X(const float*, rope_scales) X(i64, rope_scale_row_stride) \
  X(i64, rope_scale_block_stride)                                                                   \
  /* the work-tile counter of this launch's stream (sm90/scheduler.cuh), or null: round robin */     \
  X(u32*, tile_counter)

MLA_DEFINE_PARAMS(Params, MLA_SM90_PARAMS)

}  // namespace sm90
}  // namespace mla
