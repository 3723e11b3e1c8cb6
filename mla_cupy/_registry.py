"""Every kernel family the package compiles: one place that knows the template instantiations.

A *family* is one RawModule: a source file plus the name expressions compiled together. The API
asks for one family per (kernel, dtype, mask) on first use; CI compiles all of them for every
target architecture (``all_families``).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

import numpy as np

from ._arrays import BF16, FP16, FP32
from .dims import kernel_int
from .masks import MASKS, Mask

CPP_TYPE: Dict[np.dtype, str] = {BF16: "__nv_bfloat16", FP16: "__half", FP32: "float"}

#: Architectures CI compiles each family for.
TARGET_ARCHS = {"mla_prefill_sm80.cu": ("sm_80", "sm_90a"), "mla_prefill_sm90.cu": ("sm_90a",),
                "merge_states.cu": ("sm_80", "sm_90a"), "bench_spin.cu": ("sm_80", "sm_90a"),
                "quantize.cu": ("sm_90a",), "transpose_v.cu": ("sm_90a",),  # e4m3 needs sm_89+; fp8 runs on Hopper
                "rope_gather.cu": ("sm_90a",),
                # the backward: the portable main kernel (mma.sync), Hopper's (wgmma), the passes around them
                "mla_backward_sm80.cu": ("sm_80", "sm_90a"), "mla_backward_sm90.cu": ("sm_90a",),
                "mla_backward_prepost.cu": ("sm_80", "sm_90a")}

PREFILL_SM80 = ("mla_prefill_sm80.cu", "mla::sm80::mla_prefill_kernel")
PREFILL_SM90 = ("mla_prefill_sm90.cu", "mla::sm90::mla_prefill_kernel")
MERGE = ("merge_states.cu", "mla::merge_states_kernel")
SPIN = ("bench_spin.cu", ("mla::spin_kernel",))  # the benchmark's GPU-busy helper
QUANTIZE = ("quantize.cu", "mla::quantize_rows_kernel")
QUANTIZE_V = "mla::quantize_v_transposed_kernel"  # V's quantizer writing V^T too (quantize.cu)


def _exports(namespace: str, geometry: str = "kGeometry") -> Tuple[str, str, str, str]:
    """What a module exports besides its kernels (kernels/params_abi.cuh), in this order: its
    parameter struct's layout and field names, its geometry's field names and its geometry
    (``geometry``: the table's name expression)."""
    return (f"{namespace}::kParamLayout", f"{namespace}::kParamNames", f"{namespace}::kGeometryNames",
            f"{namespace}::{geometry}")


TRANSPOSE_V = ("transpose_v.cu", ("mla::transpose_v_e4m3_kernel",) + _exports("mla::vt_prepass"))  # V^T for fp8
ROPE_GATHER = ("rope_gather.cu", ("mla::rope_gather_kernel",) + _exports("mla::rope_gather"))  # paged rope, Hopper

Family = Tuple[str, Tuple[str, ...]]

# ---- the backward (kernels/backward.cuh: the work and the workspace every backward kernel shares) ----
BACKWARD_SM80 = ("mla_backward_sm80.cu", "mla::sm80_bwd::mla_backward_kernel")
BACKWARD_SM90 = ("mla_backward_sm90.cu", "mla::sm90_bwd::mla_backward_kernel")
BACKWARD_PREPOST = "mla_backward_prepost.cu"
#: The main kernels' exports: the parameter struct's layout and names (one common list,
#: ``MLA_BWD_COMMON_PARAMS``; the Hopper struct puts its tensor maps before it) and the geometry
#: ``{smem, threads, block_m, block_n}``.
BWD_SM80_EXPORTS = _exports("mla::sm80_bwd")
BWD_SM90_EXPORTS = _exports("mla::sm90_bwd")
#: The pre-pass's and post-passes' exports (kernels/mla_backward_prepost.cu), each namespace's own.
BWD_PRE_EXPORTS = _exports("mla::bwd::pre")
BWD_DQ_EXPORTS = _exports("mla::bwd::post_dq")
BWD_ROPE_EXPORTS = _exports("mla::bwd::post_rope")
#: How a main kernel lays out dq_accum's chunks (``DqLayout``), the dq post-pass's template argument.
DQ_ROW_MAJOR, DQ_WGMMA = "mla::bwd::kDqRowMajor", "mla::bwd::kDqWgmma"
#: The layout each main kernel writes: the portable kernel's atomics row-major, Hopper's bulk
#: reductions in its wgmma order.
BWD_DQ_LAYOUT = {"sm80": DQ_ROW_MAJOR, "sm90": DQ_WGMMA}
_BWD_MAIN = {"sm80": (BACKWARD_SM80, BWD_SM80_EXPORTS), "sm90": (BACKWARD_SM90, BWD_SM90_EXPORTS)}


def backward_name(kernel: str, dtype: np.dtype, mask: Mask) -> str:
    """The backward main kernel ``kernel`` (``'sm80'``: portable, ``'sm90'``: Hopper) for q, k, v,
    dout and the gradients in ``dtype`` under ``mask``."""
    return f"{_BWD_MAIN[kernel][0][1]}<{CPP_TYPE[np.dtype(dtype)]}, {mask.cpp_name}>"


def backward_family(kernel: str, dtype: np.dtype, mask: Mask) -> Family:
    """The family of :func:`backward_name`: that kernel and its module's exports
    (:data:`BWD_SM80_EXPORTS` or :data:`BWD_SM90_EXPORTS`)."""
    (filename, _), exports = _BWD_MAIN[kernel]
    return filename, (backward_name(kernel, dtype, mask),) + exports


def backward_sm80(dtype: np.dtype, mask: Mask) -> Family:
    return backward_family("sm80", dtype, mask)


def backward_sm90(dtype: np.dtype, mask: Mask) -> Family:
    return backward_family("sm90", dtype, mask)


def backward_exports(kernel: str) -> Tuple[str, str, str, str]:
    """The exported tables of the main kernel ``kernel``'s module (:func:`_exports`)."""
    return _BWD_MAIN[kernel][1]


def backward_pre_name(dtype: np.dtype, out_dtype: np.dtype) -> str:
    """The pre-pass (lse_log2, D, the chunks and semaphores zeroed) for dout in ``dtype`` and the
    forward's out in ``out_dtype`` (``dtype`` or float32)."""
    return f"mla::bwd::pre_kernel<{CPP_TYPE[np.dtype(dtype)]}, {CPP_TYPE[np.dtype(out_dtype)]}>"


def backward_dq_name(dtype: np.dtype, layout: str) -> str:
    """The dq post-pass writing dq in ``dtype`` from dq_accum in ``layout`` (:data:`DQ_ROW_MAJOR`,
    :data:`DQ_WGMMA`; :data:`BWD_DQ_LAYOUT` gives each main kernel's)."""
    if layout not in (DQ_ROW_MAJOR, DQ_WGMMA):
        raise ValueError(f"dq layout {layout!r}: one of {DQ_ROW_MAJOR!r}, {DQ_WGMMA!r}")
    return f"mla::bwd::dq_kernel<{CPP_TYPE[np.dtype(dtype)]}, {layout}>"


def backward_rope_name(dtype: np.dtype) -> str:
    """The rope post-pass (dk_rope from rope_part's group slots; the rows of no sequence zeroed)."""
    return f"mla::bwd::rope_kernel<{CPP_TYPE[np.dtype(dtype)]}>"


def backward_prepost(dtype: np.dtype) -> Family:
    """The passes around either main kernel for ``dtype``: the pre-pass for out in ``dtype`` or
    float32, the dq post-pass for both layouts, the rope post-pass, and each pass's exports
    (:data:`BWD_PRE_EXPORTS`, :data:`BWD_DQ_EXPORTS`, :data:`BWD_ROPE_EXPORTS`)."""
    names = tuple(backward_pre_name(dtype, o) for o in (dtype, FP32))
    names += tuple(backward_dq_name(dtype, lay) for lay in (DQ_ROW_MAJOR, DQ_WGMMA))
    names += (backward_rope_name(dtype),)
    return BACKWARD_PREPOST, names + BWD_PRE_EXPORTS + BWD_DQ_EXPORTS + BWD_ROPE_EXPORTS


def prefill_sm80(dtype: np.dtype, mask: Mask) -> Family:
    """Family for (dtype, mask): output in the input dtype or float32, plain or paged rope, and the
    exported tables (:data:`SM80_EXPORTS`)."""
    fam = _prefill_family(PREFILL_SM80, dtype, mask)
    return fam[0], fam[1] + SM80_EXPORTS


def prefill_sm80_name(dtype: np.dtype, out_dtype: np.dtype, mask: Mask, paged: bool) -> str:
    return _prefill_name(PREFILL_SM80, dtype, out_dtype, mask, paged)


def _prefill_family(kernel: Tuple[str, str], dtype: np.dtype, mask: Mask) -> Family:
    t = CPP_TYPE[np.dtype(dtype)]
    names = tuple(f"{kernel[1]}<{t}, {o}, {mask.cpp_name}, {paged}>" for o in (t, "float") for paged in ("false", "true"))
    return kernel[0], names


#: The kernel variants, by what the inputs are (a checked problem's ``variant``): q, k, v and the
#: rope in one 16-bit dtype (the only variant of the portable kernel); fp8 per token (e4m3 nope
#: parts under per-token scales) with a bfloat16 rope; 16-bit with an e4m3 rope under per-key
#: float32 scales, which the Hopper kernel's rope warp dequantizes; fp8 per token with e4m3 q_rope
#: and k_rope under the per-token scales, read by TMA (the all-e4m3 mode).
VARIANT_16, VARIANT_FP8, VARIANT_FP8_ROPE, VARIANT_E4M3 = "bf16", "fp8", "fp8_rope", "e4m3"
#: Hopper kernel variants: the traits type of each (kernels/sm90/config.cuh) as a template of the
#: 16-bit type.
SM90_VARIANTS = {VARIANT_16: "mla::sm90::Variant16<{t}>", VARIANT_FP8: "mla::sm90::VariantFp8",
                 VARIANT_FP8_ROPE: "mla::sm90::VariantFp8Rope<{t}>", VARIANT_E4M3: "mla::sm90::VariantE4m3"}
#: The fp8 per-token variants (e4m3 nope parts and V^T, per-token scales).
FP8_VARIANTS = (VARIANT_FP8, VARIANT_E4M3)
#: Variants with a plain rope only (no paged instantiation; the host refuses a paged cache).
SM90_PLAIN_ONLY = (VARIANT_E4M3,)

#: What the portable module exports besides its kernels (:func:`_exports`).
SM80_EXPORTS = _exports("mla::sm80")


def sm90_exports(dtype: np.dtype, mask: Mask, variant: str = VARIANT_16, pairs: bool = False) -> Tuple[str, ...]:
    """The Hopper module's exports (:func:`_exports`) for a variant under ``mask``: the geometry is
    that variant's as compiled under that mask (``kGeometry<traits, Mask>``: the consumer count, and
    so the work tile, may depend on the mask, kernels/sm90/config.cuh: ForMask)."""
    return _exports("mla::sm90", f"kGeometry<{_sm90_traits(dtype, variant, pairs)}, {mask.cpp_name}>")


class Schedule(NamedTuple):
    """How the Hopper kernel of one variant cuts the work under one mask. Its module exports these
    facts in its geometry (kernels/mla_prefill_sm90.cu: kGeometry), where the launch code reads
    them; :func:`sm90_schedule` states them for what runs without a compiled module (the
    reference's reach of a NaN in v, the tests' fake GPU), and ``tests/test_compile.py`` holds it to
    every Hopper family's export."""

    block_m: int       #: query rows of a work tile
    block_n: int       #: keys of a key tile
    q_rows: int        #: rows of a consumer warpgroup
    half_tiles: bool   #: a warpgroup that sees none of the last key tile's second half computes its first half only
    skip_tail: bool    #: a warpgroup computes no key tile past the one that holds its last row's last visible key
    end_aligned: bool  #: query blocks are counted from each sequence's end
    key_align: int     #: a work tile's key span starts on a multiple of this many keys


def sm90_schedule(variant: str, mask: Mask) -> Schedule:
    """The :class:`Schedule` of the Hopper kernel's ``variant`` under ``mask``: two consumer
    warpgroups of ``kWgRows`` rows, three in the fp8 per-token variants under a mask whose rows' keys
    have no lower end (the causal mask, no mask), which then count their query blocks from each
    sequence's end and, under a mask bounded above, skip a warpgroup's invisible key tiles; half tiles
    in the 16-bit variants under a mask bounded above; fp8 key spans on V^T's groups of
    ``kVtAlign`` keys; ``kKeyTile`` keys a tile (kernels/sm90/config.cuh)."""
    fp8 = variant in FP8_VARIANTS
    three = fp8 and not mask.bounded_below
    rows = kernel_int("sm90/config.cuh", "kWgRows")
    return Schedule((3 if three else 2) * rows, kernel_int("sm90/config.cuh", "kKeyTile"), rows,
                    not fp8 and mask.bounded_above, three and mask.bounded_above, three,
                    kernel_int("vt_layout.cuh", "kVtAlign") if fp8 else 1)


#: The traits wrapper of an fp8 variant for batches whose sequences all start at an even key row
#: and read a plain rope (kernels/sm90/config.cuh: EvenKeyRows; ``Problem.scale_pairs``): its own
#: family, compiled when used.
SCALE_PAIRS = "mla::sm90::EvenKeyRows<{}>"
#: The variants that have it.
SM90_PAIRED = FP8_VARIANTS


def prefill_sm90(dtype: np.dtype, mask: Mask, variant: str = VARIANT_16, pairs: bool = False) -> Family:
    """Hopper family for (dtype, mask, variant): output in the input dtype or float32, plain or
    paged rope (plain only for :data:`SM90_PLAIN_ONLY`), and the exported tables
    (:func:`sm90_exports`). The fp8 per-token variants take bfloat16 for their 16-bit parts;
    ``pairs``: their kernels for even first key rows (:data:`SCALE_PAIRS`; a plain rope only)."""
    pageds = (False,) if variant in SM90_PLAIN_ONLY or pairs else (False, True)
    names = tuple(prefill_sm90_name(dtype, o, mask, paged, variant, pairs) for o in (dtype, FP32) for paged in pageds)
    return PREFILL_SM90[0], names + sm90_exports(dtype, mask, variant, pairs)


def _sm90_traits(dtype: np.dtype, variant: str, pairs: bool) -> str:
    """The traits type of a Hopper variant (``pairs``: for even first key rows)."""
    if pairs and variant not in SM90_PAIRED:
        raise ValueError(f"pairs: the {variant!r} variant reads no key scales; {SM90_PAIRED} do")
    traits = SM90_VARIANTS[variant].format(t=CPP_TYPE[np.dtype(dtype)])
    return SCALE_PAIRS.format(traits) if pairs else traits


def prefill_sm90_name(dtype: np.dtype, out_dtype: np.dtype, mask: Mask, paged: bool, variant: str = VARIANT_16,
                      pairs: bool = False) -> str:
    return (f"{PREFILL_SM90[1]}<{_sm90_traits(dtype, variant, pairs)}, {CPP_TYPE[np.dtype(out_dtype)]}, "
            f"{mask.cpp_name}, {'true' if paged else 'false'}>")


def _prefill_name(kernel: Tuple[str, str], dtype, out_dtype, mask: Mask, paged: bool) -> str:
    t, o = CPP_TYPE[np.dtype(dtype)], CPP_TYPE[np.dtype(out_dtype)]
    return f"{kernel[1]}<{t}, {o}, {mask.cpp_name}, {'true' if paged else 'false'}>"


def merge_family() -> Family:
    """merge_states over partial outputs of any 16-bit or float32 dtype (into a float32 or same-dtype result)."""
    names = tuple(f"{MERGE[1]}<{a}, {o}>" for a in ("float", "__nv_bfloat16", "__half") for o in ("float", "__nv_bfloat16", "__half"))
    return MERGE[0], names


def merge_name(in_dtype: np.dtype, out_dtype: np.dtype) -> str:
    return f"{MERGE[1]}<{CPP_TYPE[np.dtype(in_dtype)]}, {CPP_TYPE[np.dtype(out_dtype)]}>"


def quantize_family() -> Family:
    """The fp8 quantizers of bf16, fp16 or float32 data (kernels/quantize.cu): over rows, and V's
    with its V^T."""
    return QUANTIZE[0], tuple(f"{k}<{t}>" for k in (QUANTIZE[1], QUANTIZE_V)
                              for t in ("__nv_bfloat16", "__half", "float"))


def quantize_name(dtype: np.dtype) -> str:
    return f"{QUANTIZE[1]}<{CPP_TYPE[np.dtype(dtype)]}>"


def quantize_v_name(dtype: np.dtype) -> str:
    """V's quantizer that writes V^T too."""
    return f"{QUANTIZE_V}<{CPP_TYPE[np.dtype(dtype)]}>"


def transpose_v_family() -> Family:
    """The fp8 per-token variant's V^T pre-pass (kernels/transpose_v.cu)."""
    return TRANSPOSE_V


def rope_gather_family() -> Family:
    """The Hopper kernel's gather of a paged 16-bit rope into key rows (kernels/rope_gather.cu)."""
    return ROPE_GATHER


_SHORT_TYPES = {"__nv_bfloat16": "bf16", "__half": "fp16", "float": "f32"}
_VARIANT_NAMES = {VARIANT_16: "16-bit", VARIANT_FP8: "fp8-per-token", VARIANT_FP8_ROPE: "fp8-rope",
                  VARIANT_E4M3: "e4m3-per-token"}


def _sm90_traits_label(arg: str) -> List[str]:
    """``mla::sm90::Variant16<__nv_bfloat16>`` -> ``["bf16", "16-bit"]``;
    ``mla::sm90::EvenKeyRows<mla::sm90::VariantFp8>`` -> ``["bf16", "fp8-per-token", "scale-pairs"]``."""
    head, tail = SCALE_PAIRS.split("{}")
    if arg.startswith(head) and arg.endswith(tail):
        return _sm90_traits_label(arg[len(head):-len(tail)]) + ["scale-pairs"]
    for name, pattern in SM90_VARIANTS.items():
        for t in _SHORT_TYPES:
            if arg == pattern.format(t=t):
                return [_SHORT_TYPES["__nv_bfloat16" if "{t}" not in pattern else t], _VARIANT_NAMES[name]]
    return [arg.rsplit("::", 1)[-1]]


def is_kernel(name: str) -> bool:
    """Whether a family's name expression names a kernel (every kernel here is ``..._kernel``),
    not an exported global."""
    return name.split("<", 1)[0].endswith("_kernel")


def family_label(fam: Family) -> str:
    """A family as a person reads it: the source's stem and the template arguments its kernels
    share (input dtype, mask, Hopper variant; the output dtype and rope source vary inside a
    family), e.g. ``mla_prefill_sm90<bf16, CausalMask, fp8-per-token>``."""
    stem = fam[0].rsplit(".", 1)[0]
    # kernel instantiations only (a family also names globals, e.g. an exported table per mask)
    arg_lists = [n.split("<", 1)[1].rsplit(">", 1)[0].split(", ") for n in fam[1] if "<" in n and is_kernel(n)]
    if not arg_lists:
        return stem
    shared, variant = [], []
    # kernels of different arities (the backward's passes): the leading arguments they all share
    for i, first in enumerate(arg_lists[0][:min(len(a) for a in arg_lists)]):
        if any(a[i] != first for a in arg_lists) or (i == 3 and fam[0] == PREFILL_SM90[0]):
            continue  # varies inside the family (the rope source: plain only in some Hopper families)
        if i == 0 and fam[0] == PREFILL_SM90[0]:
            dtype_and_variant = _sm90_traits_label(first)
            shared.append(dtype_and_variant[0])
            variant = dtype_and_variant[1:]
        else:
            shared.append(_SHORT_TYPES.get(first, first.rsplit("::", 1)[-1]))
    shared += variant
    return f"{stem}<{', '.join(shared)}>" if shared else stem


def all_families() -> List[Tuple[str, Family]]:
    """(arch, family) for every module CI must compile."""
    fams: List[Family] = [prefill_sm80(d, m) for d in (BF16, FP16) for m in MASKS]
    fams += [prefill_sm90(d, m) for d in (BF16, FP16) for m in MASKS]
    fams += [prefill_sm90(BF16, m, v) for m in MASKS for v in ("fp8", "fp8_rope", "e4m3")]
    fams += [prefill_sm90(BF16, m, v, pairs=True) for m in MASKS if not m.bounded_below
             for v in SM90_PAIRED]
    fams += [merge_family(), SPIN, quantize_family(), transpose_v_family(), rope_gather_family()]
    fams += [backward_family(k, d, m) for k in ("sm80", "sm90") for d in (BF16, FP16) for m in MASKS]
    fams += [backward_prepost(d) for d in (BF16, FP16)]
    return [(arch, fam) for fam in fams for arch in TARGET_ARCHS[fam[0]]]

