"""The model dimensions of DeepSeek's Multi-head Latent Attention that the kernels are built for."""
from __future__ import annotations

__all__ = ["DV", "DR", "DQK"]

DV = 128  #: value / per-head ("nope") key size
DR = 64  #: shared rope size
DQK = DV + DR  #: query / full key size
