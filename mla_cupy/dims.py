"""The model dimensions of DeepSeek's Multi-head Latent Attention that the kernels are built for."""
from __future__ import annotations

__all__ = ["DV", "DR", "DQK", "QUERY_BLOCK"]

DV = 128  #: value / per-head ("nope") key size
DR = 64  #: shared rope size
DQK = DV + DR  #: query / full key size

#: Query rows of one work tile of the prefill kernels (kBlockM). The contract states how far a NaN
#: in ``v`` reaches in these blocks: every row of a block whose visible key span holds the key.
QUERY_BLOCK = 128
