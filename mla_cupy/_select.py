"""Kernel choice: which prefill kernel runs on this device, and the Hopper kernel's order of work
tiles: its L2 grouping of heads (``heads_per_section``) and the query blocks that end the launch
(``tail_blocks``)."""
from __future__ import annotations

import functools
from typing import Optional, Tuple

from ._launch import environ_get
from .dims import DV
from .masks import CausalMask, NullMask

__all__ = ["KERNELS", "choose_kernel", "sm90_disabled", "heads_per_section", "tail_blocks", "sm_count", "device_id"]

KERNELS = ("auto", "sm80", "sm90")


@functools.lru_cache(maxsize=None)
def _capability(dev: int) -> str:
    import cupy

    return cupy.cuda.Device(dev).compute_capability


@functools.lru_cache(maxsize=None)
def _sm_count_and_l2(dev: int) -> Tuple[int, int]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(dev)
    return int(props["multiProcessorCount"]), int(props.get("l2CacheSize", 50 << 20))


def sm_count(dev: int) -> int:
    """Streaming multiprocessors of device ``dev``."""
    return _sm_count_and_l2(dev)[0]


def l2_bytes(dev: int) -> int:
    """Bytes of device ``dev``'s L2 cache."""
    return _sm_count_and_l2(dev)[1]


def device_id() -> int:
    """The current CUDA device."""
    import cupy

    return cupy.cuda.runtime.getDevice()


def check_kernel_name(kernel: str) -> None:
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")


def choose_kernel(kernel: str, paged: bool, device_id: Optional[int] = None) -> str:
    """``'sm90'`` (the Hopper TMA + wgmma kernel) on compute capability 9.0, else ``'sm80'`` (the
    portable mma.sync kernel). ``kernel`` forces one; the environment variable
    ``MLA_CUPY_DISABLE_SM90=1`` makes ``"auto"`` pick the portable kernel. ``paged`` does not change
    the choice (both kernels read a 16-bit PagedKVCache); the fp8 variants need ``'sm90'`` and the
    plan refuses anything else."""
    check_kernel_name(kernel)
    if device_id is None:
        import cupy

        device_id = cupy.cuda.runtime.getDevice()
    hopper = _capability(device_id) == "90"
    if kernel == "sm90":
        if not hopper:
            raise ValueError(f"kernel: 'sm90' needs a compute capability 9.0 GPU, this one is {_capability(device_id)}")
        return "sm90"
    if kernel == "sm80":
        return "sm80"
    return "sm90" if hopper and not sm90_disabled() else "sm80"


def sm90_disabled() -> bool:
    """The environment variable ``MLA_CUPY_DISABLE_SM90`` is set (non-empty): ``"auto"`` picks the
    portable kernel."""
    return bool(environ_get("MLA_CUPY_DISABLE_SM90"))


def heads_per_section(p, device_id: int) -> int:
    """Heads whose keys and values together fill part of the L2 (see kernels/tile_scheduler.cuh):
    the tiles of one section run together, so each head's K/V is read from DRAM about once. Half
    the L2 for one causal sequence (its tiles in flight read nested prefixes of its keys: the short
    ones stay hot; larger sections measured faster there, H = 16, 1 x 8192: 6%), a quarter for a
    batch (whose tiles read every sequence's keys whole: 16 x 512 7% faster than with a half), an
    eighth without a mask (every tile reads its head's keys whole: sections of 2 heads measured 3%
    faster than 12 at 1 x 4096). The section size is a divisor of the heads, so that every section
    is equal (H = 16 at 16384 keys: sections of 2 or 4 heads 3% faster than 3). ``p`` is the checked
    :class:`~mla_cupy.validation.Problem`."""
    kv_bytes_per_head = max(1, p.tk) * 2 * DV * (1 if p.fp8 else p.dtype.itemsize)
    l2 = l2_bytes(device_id)
    budget = l2 // 8 if isinstance(p.mask, NullMask) else l2 // (2 if p.batch == 1 else 4)
    g = max(1, min(p.heads, budget // kv_bytes_per_head))
    return max(d for d in range(1, g + 1) if p.heads % d == 0)


#: The fewest query blocks of each sequence that :func:`tail_blocks` pools at a launch's end.
MIN_TAIL_BLOCKS = 4


def tail_blocks(p, heads_per_section: int, num_m_blocks: int, ctas: int) -> int:
    """Query blocks taken out of the L2 sections to end the launch, all heads together
    (kernels/tile_scheduler.cuh): under a causal mask every sequence's first blocks are its
    cheapest work tiles, and with them pooled the persistent CTAs even out their finishing times
    (with sections, the launch ends on the last section's short tiles alone). As many blocks as give
    about 1.5 work tiles per CTA (``ctas``), where that is at least :data:`MIN_TAIL_BLOCKS` and
    fewer than ``num_m_blocks``: few sequences of few heads (H = 16, one sequence: 13 blocks).
    Pooled from many heads, a sequence's first one or two blocks are work tiles of one or two key
    tiles whose keys come back from DRAM, and the launch's end waits on those loads instead
    (measured 1.1% slower per token at 1 x 4096, 3.8% in 16-bit at 1 x 1024, both H = 128).
    0 without sections, under any other mask, or where keys outnumber the queries twice over (a
    prefix: every tile then reads it, and the tiles cost about the same). ``p`` is the checked
    :class:`~mla_cupy.validation.Problem`."""
    if not isinstance(p.mask, CausalMask) or heads_per_section >= p.heads or p.tk > 2 * p.tq:
        return 0
    t = -(-3 * ctas // (2 * p.batch * p.heads))  # p.batch * p.heads work tiles per query block index
    return t if MIN_TAIL_BLOCKS <= t < num_m_blocks else 0
