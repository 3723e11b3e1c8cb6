"""The model dimensions of DeepSeek's Multi-head Latent Attention that the kernels are built for."""
from __future__ import annotations

__all__ = ["DV", "DR", "DQK", "QUERY_BLOCK", "HALF_BLOCK", "KEY_TILE", "FP8_CONSUMERS"]

DV = 128  #: value / per-head ("nope") key size
DR = 64  #: shared rope size
DQK = DV + DR  #: query / full key size

#: Query rows of one work tile of the prefill kernels (kBlockM). The contract states how far a NaN
#: in ``v`` reaches in these blocks: every row of a block whose visible key span holds the key.
QUERY_BLOCK = 128
#: Rows of a half block: each of the Hopper kernel's two consumer warpgroups computes one (kWgRows).
HALF_BLOCK = QUERY_BLOCK // 2
#: Keys of one key tile of the Hopper kernel (its variants' ``kBlockN``). A half block whose rows see none of
#: the second half of its block's last key tile computes that tile's first ``KEY_TILE // 2`` keys
#: only, which bounds the reach of a NaN in ``v`` there (``reference``).
KEY_TILE = 128
#: Consumer warpgroups of the Hopper kernel's fp8 variants (per token and all-e4m3) under a mask
#: whose rows' keys have no lower end (the causal mask and no mask: kernels/sm90/config.cuh, Wide),
#: which a slow CPU test holds to this value (:func:`mla_cupy.fp8.fp8_query_block`).
FP8_CONSUMERS = 3
