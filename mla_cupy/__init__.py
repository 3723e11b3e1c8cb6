"""mla_cupy: hand-written CUDA kernels for Multi-head Latent Attention (DeepSeek V2/V3) prefill.

Importing compiles nothing and needs no GPU; kernels are JIT-compiled on first use per dtype and
mask. See ``mla_prefill`` for the semantics, ``plan`` to run many layers of one batch layout, and
``mla_cupy.reference`` for the float64 oracle.
"""
from . import fp8, quant, reference
from .api import mla_prefill, mla_prefill_backward, mla_prefill_fp8
from .jit import KernelCompileError
from .merge import merge_states, mla_prefill_chunked
from .masks import CausalMask, ChunkedCausalMask, ChunkedMask, Mask, NullMask, SlidingWindowCausalMask
from .paged import PagedKVCache
from ._plan_cache import PlanCacheInfo, plan_cache_clear, plan_cache_info, set_plan_cache_size
from .prefill_plan import PrefillPlan, plan

__version__ = "0.1.0"

__all__ = [
    "mla_prefill",
    "mla_prefill_fp8",
    "mla_prefill_backward",
    "plan",
    "PrefillPlan",
    "plan_cache_info",
    "plan_cache_clear",
    "set_plan_cache_size",
    "PlanCacheInfo",
    "mla_prefill_chunked",
    "merge_states",
    "reference",
    "quant",
    "fp8",
    "PagedKVCache",
    "Mask",
    "NullMask",
    "CausalMask",
    "SlidingWindowCausalMask",
    "ChunkedMask",
    "ChunkedCausalMask",
    "KernelCompileError",
    "__version__",
]
