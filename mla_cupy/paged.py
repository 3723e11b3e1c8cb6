"""The paged KV cache that MAX uses for MLA, as a source of the shared rope part of the keys."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["PagedKVCache", "check_page_geometry"]


@dataclass(frozen=True)
class PagedKVCache:
    """MAX's ``PagedKVCache`` layout for MLA, passed as ``k_rope``.

    Parameters
    ----------
    blocks : array ``[num_blocks, page_size, 1, Dc]``
        Cache pages; each row is ``Dc`` (576 for DeepSeek: 512 latent values, then 64 rope values).
        Same dtype as ``q``, or float8_e4m3fn bytes (uint8) with ``scales`` (bfloat16 q, Hopper).
    lookup_table : array ``[B, max_pages]`` int32 or uint32
        Block id of each sequence's pages. With ``t = cache_offsets[b] + j`` key ``j`` of sequence
        ``b`` has its rope values at ``blocks[lookup_table[b, t // page_size], t % page_size, 0,
        rope_offset : rope_offset + 64]``.
    page_size : int
        Keys per page: a power of two from 16 to 512, equal to ``blocks.shape[1]`` (checked when
        the cache is built).
    rope_offset : int
        Column of the first rope value in a cache row; a multiple of 64 (default 512).
    scales : array, optional
        Per-64-value scales of an fp8 cache (``[num_blocks, page_size, 1, Dc // 64]`` float32); the
        rope's scale is at index ``rope_offset // 64``. Required exactly when ``blocks`` is uint8.

    Notes
    -----
    Block ids are checked on the host when ``validate=True`` (an id outside ``[0, num_blocks)`` is
    a ``ValueError``). With ``validate=False`` the kernel still never reads outside ``blocks``: a
    key whose block id (or page index) is out of range is treated as masked.
    """

    blocks: Any
    lookup_table: Any
    page_size: int
    rope_offset: int = 512
    scales: Optional[Any] = None

    def __post_init__(self):
        check_page_geometry(self.page_size, self.rope_offset, "PagedKVCache.")
        shape = getattr(self.blocks, "shape", None)
        if shape is not None and len(shape) >= 2 and int(shape[1]) != self.page_size:
            raise ValueError(f"PagedKVCache.page_size: expected blocks.shape[1] = {int(shape[1])} (slots per page of "
                             f"blocks {list(shape)}), got {self.page_size}")


def check_page_geometry(page_size: Any, rope_offset: Any, prefix: str = "") -> None:
    """``page_size`` a power of two from 16 to 512, ``rope_offset`` a non-negative multiple of 64;
    errors name them with ``prefix`` (``"PagedKVCache."`` for the cache's fields)."""
    ps, ro = page_size, rope_offset
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 16 or ps > 512 or ps & (ps - 1):
        raise ValueError(f"{prefix}page_size: expected a power of two from 16 to 512, got {ps!r}")
    if isinstance(ro, bool) or not isinstance(ro, int) or ro < 0 or ro % 64:
        raise ValueError(f"{prefix}rope_offset: expected a non-negative multiple of 64, got {ro!r}")
