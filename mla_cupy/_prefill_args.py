"""The prefill kernels' parameter lists, in order (kernels/mla_prefill_sm{80,90}.cu), as
:class:`~mla_cupy._launch.ArgPack` declarations; a CPU test compares them with the C++ signatures."""
from __future__ import annotations

from ._launch import F32, I32, I64, PTR, U32, ArgPack
from .tma import TENSOR_MAP_DTYPE

__all__ = ["SM80_ARGS", "SM90_ARGS", "SM90_MAPS"]

_ROPE_AND_GRID = [("rope_base", PTR), ("rope_row_stride", I64), ("rope_block_stride", I64), ("lookup", PTR),
                  ("lookup_stride", I64), ("log2_page_size", I32), ("num_blocks", U32), ("max_pages", U32),
                  ("num_heads", I32), ("heads_per_section", I32), ("batch", I32), ("num_m_blocks", I32),
                  ("scale_log2", F32), ("mask_arg", I64), ("accumulate", I32)]
_OFFSETS = [("q_offsets", PTR), ("kv_begin", PTR), ("kv_end", PTR), ("cache_offsets", PTR), ("q_start_pos", PTR)]

#: The Hopper kernel's tensor maps: consecutive parameters, rewritten together.
SM90_MAPS = ("tm_q", "tm_k", "tm_v", "tm_rope", "tm_q_rope", "tm_k_scales")

SM80_ARGS = ArgPack([("q", PTR), ("k", PTR), ("v", PTR), ("out", PTR), ("lse", PTR)] + _OFFSETS
                    + [(n, I64) for n in ("q_st", "q_sh", "k_st", "k_sh", "v_st", "v_sh", "o_st", "o_sh", "lse_st")]
                    + _ROPE_AND_GRID)
SM90_ARGS = ArgPack([(n, TENSOR_MAP_DTYPE) for n in SM90_MAPS] + [("out", PTR), ("lse", PTR)] + _OFFSETS
                    + [("o_st", I64), ("o_sh", I64), ("lse_st", I64)] + _ROPE_AND_GRID
                    + [("rope_box_rows", I32), ("q_scale", PTR), ("q_scale_stride", I64), ("rope_scales", PTR),
                       ("rope_scale_row_stride", I64), ("rope_scale_block_stride", I64), ("tile_counter", PTR)])
