"""Context-parallel MLA prefill over a ``torch.distributed`` process group.

A long prompt's tokens are split over W ranks (:class:`ZigzagLayout`: each sequence in ``2W``
chunks, rank r holding chunks r and 2W - 1 - r, which balances causal work); every rank attends
its own queries over all keys, which travel around a ring of point-to-point sends overlapped with
compute (or are all-gathered), each block merged into the running result by its log-sum-exp.

Importing this package imports neither torch nor CuPy; its functions take torch tensors. See
``docs/distributed.md``.
"""
from .attention import KernelAttention, LocalAttention, NoAttention, ReferenceAttention
from .layout import Split, ZigzagLayout, rank_chunks
from .prefill import VARIANTS, context_parallel_prefill
from .schedule import AttentionCall, rank_schedule
from .shard import Shard, gather, shard, unshard
from .transport import ThreadTransport, TorchTransport, simulate
from .visibility import block_visible

__all__ = [
    "context_parallel_prefill",
    "shard",
    "gather",
    "unshard",
    "Shard",
    "ZigzagLayout",
    "Split",
    "rank_chunks",
    "rank_schedule",
    "AttentionCall",
    "block_visible",
    "LocalAttention",
    "KernelAttention",
    "ReferenceAttention",
    "NoAttention",
    "TorchTransport",
    "ThreadTransport",
    "simulate",
    "VARIANTS",
]
