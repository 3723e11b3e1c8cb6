"""The peers of ``mla_cupy``'s kernels, for the benchmark scripts (``matrix.py``, ``ab.py``): the
calls of FlashAttention-3 (the ``fa3-fwd`` wheel or FA3's own ``flash_attn_interface``), cuDNN's
ragged SDPA and fp8 SDPA graph (the ``nvidia-cudnn-frontend`` wheel), torch SDPA on its cuDNN
backend (one call per sequence) and FlexAttention, each given K built at 192 width; and their row
builders for :func:`mla_cupy.bench.run` (``builders=``), which time a peer on a case's input sets
and check its output against the float64 reference as our rows are checked.

A peer that does not import is left out (FA3: no row; cuDNN's frontend: one line on stderr saying
how to get it); one that cannot express a case's mask gives a row that says why.
"""
from __future__ import annotations

import inspect
import math
import sys
from typing import Callable, List, Tuple

import numpy as np

from mla_cupy.bench import BenchCase, CaseRun, Row, _as_cupy, e4m3_to_f64, failed_row, time_ms
from mla_cupy.dims import DQK, DR, DV
from mla_cupy.masks import CausalMask, NullMask


def torch_sets(run: CaseRun) -> List[dict]:
    """The case's input sets as zero-copy torch tensors (made once per case, kept in ``run.cache``)."""
    if "torch" not in run.cache:
        import torch

        run.cache["torch"] = [{k: torch.from_dlpack(v) for k, v in x.items()} for x in run.sets]
    return run.cache["torch"]


def k192(run: CaseRun):
    """(K built at 192 width for every set, the median time of that build in ms): :func:`k192_of` of
    each set, what the peers need (made once per case, kept in ``run.cache``)."""
    if "k192" not in run.cache:
        h = run.case.heads
        tx = torch_sets(run)
        ms = time_ms(lambda i: k192_of(tx[i], h), len(tx), reps=run.reps)
        run.cache["k192"] = ([k192_of(t, h) for t in tx], ms)
    return run.cache["k192"]


def k192_of(t, heads: int):
    """K at the 192 width the peers take: ``torch.cat`` of ``t["k"]`` ``[Tk, H, 128]`` and
    ``t["k_rope"]`` ``[Tk, 1, 64]`` broadcast to ``[Tk, H, 64]`` (torch tensors)."""
    import torch

    return torch.cat([t["k"], t["k_rope"].expand(t["k"].shape[0], heads, DR)], dim=-1)


def _torch_peak(fn: Callable[[], float]):
    """(fn(), peak extra torch memory in MB while it ran)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = fn()
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def _timed_rows(run: CaseRun, impl: str, call: Callable[[int], object], out, note: str = "",
                kbuild: bool = True) -> List[Row]:
    """Rows of a 16-bit peer that reads K at 192 width: its kernel time and, with ``kbuild``, its
    time with the K build; ``out`` is its output on set 0 (checked against the reference)."""
    kfull, ms_build = k192(run)
    ms, extra = _torch_peak(lambda: time_ms(call, len(run.sets), reps=run.reps))
    extra += kfull[0].numel() * kfull[0].element_size() / 2**20
    err, flops = run.error(out), run.case.flops()
    rows = [Row(run.case.name, impl, ms, flops / ms / 1e9, err, extra, note=note)]
    if kbuild:
        rows.append(Row(run.case.name, impl + "+kbuild", ms + ms_build, flops / (ms + ms_build) / 1e9, err, extra))
    return rows


# ----------------------------------------------------------------------------------------------
# peers (torch); each builder returns its rows, or none when it is not importable
# ----------------------------------------------------------------------------------------------
def sdpa_per_sequence(case: BenchCase, t: dict, k192) -> list:
    """torch SDPA (whichever backend the caller's ``sdpa_kernel`` context allows), one call per
    sequence of ``case``: bottom-right causal when Sq != Sk. ``t`` holds torch views of the inputs,
    ``k192`` the keys built at 192 width; returns each sequence's output ``[1, H, Sq, 128]``."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    vl, cro = case.offsets()
    scale = 1.0 / math.sqrt(DQK)
    outs = []
    for b in range(len(case.sq)):
        qb = t["q"][vl[b]:vl[b + 1]].transpose(0, 1).unsqueeze(0)
        kb = k192[cro[b]:cro[b + 1]].transpose(0, 1).unsqueeze(0)
        vb = t["v"][cro[b]:cro[b + 1]].transpose(0, 1).unsqueeze(0)
        sq, sk = case.sq[b], case.sk[b]
        if not case.causal:
            outs.append(sdpa(qb, kb, vb, scale=scale))
        elif sq == sk:
            outs.append(sdpa(qb, kb, vb, is_causal=True, scale=scale))
        else:
            outs.append(sdpa(qb, kb, vb, attn_mask=causal_lower_right(sq, sk), scale=scale))
    return outs


def bench_sdpa(run: CaseRun) -> List[Row]:
    """cuDNN SDPA, one call per sequence (bottom-right causal when Sq != Sk), K built at 192; the
    flash / memory-efficient backends when cuDNN does not run."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return []
    case = run.case
    tx, (kfull, _) = torch_sets(run), k192(run)

    def sdpa_call(i):
        return sdpa_per_sequence(case, tx[i], kfull[i])

    rows: List[Row] = []
    for label, backends in (("cudnn-sdpa", [SDPBackend.CUDNN_ATTENTION]),
                            ("sdpa-fallback", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])):
        try:
            with sdpa_kernel(backends):
                out = torch.cat([o[0].transpose(0, 1) for o in sdpa_call(0)])
                return rows + _timed_rows(run, label, sdpa_call, out, note=f"backend={backends[0].name}")
        except Exception as exc:  # record why the backend did not run, try the next
            rows.append(failed_row(run, label, exc))
    return rows


def bench_flex(run: CaseRun) -> List[Row]:
    """FlexAttention (torch.compile), one call for the whole batch with a document mask."""
    try:
        import torch
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return []
    case = run.case
    try:
        # One compiled kernel per case shape: without a higher limit dynamo stops recompiling after
        # 8 shapes and silently runs the unfused (materializing) implementation.
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
        flex = torch.compile(flex_attention, dynamic=False)
        dev = "cuda"
        vl, cro = case.offsets()
        q_doc = torch.repeat_interleave(torch.arange(len(case.sq), device=dev), torch.tensor(case.sq, device=dev))
        k_doc = torch.repeat_interleave(torch.arange(len(case.sk), device=dev), torch.tensor(case.sk, device=dev))
        q_first = torch.tensor(vl[:-1].astype(np.int64), device=dev)
        k_first = torch.tensor(cro[:-1].astype(np.int64), device=dev)
        shift = torch.tensor(np.array(case.sk, np.int64) - np.array(case.sq, np.int64), device=dev)
        causal = case.causal

        def mask_mod(b, hh, qi, kj):
            same = q_doc[qi] == k_doc[kj]
            if not causal:
                return same
            qp = qi - q_first[q_doc[qi]] + shift[q_doc[qi]]  # end-aligned position of the query
            kp = kj - k_first[k_doc[kj]]
            return same & (kp <= qp)

        bm = create_block_mask(mask_mod, None, None, sum(case.sq), sum(case.sk), device=dev)
        tx, (kfull, _) = torch_sets(run), k192(run)

        def flex_call(i):
            t, kf = tx[i], kfull[i]
            return flex(t["q"].transpose(0, 1).unsqueeze(0), kf.transpose(0, 1).unsqueeze(0),
                        t["v"].transpose(0, 1).unsqueeze(0), block_mask=bm, scale=1.0 / math.sqrt(DQK))

        return _timed_rows(run, "flex", flex_call, flex_call(0)[0].transpose(0, 1), note="torch.compile(flex_attention)")
    except Exception as exc:
        return [failed_row(run, "flex", exc)]


#: Modules that provide FlashAttention-3's ``flash_attn_varlen_func``, in the order tried.
FA3_MODULES = ("fa3_fwd_interface", "flash_attn_interface")


def fa3_function():
    """(FlashAttention-3's ``flash_attn_varlen_func``, the module's name), or None when neither of
    :data:`FA3_MODULES` imports."""
    import importlib

    for name in FA3_MODULES:
        try:
            return importlib.import_module(name).flash_attn_varlen_func, name
        except Exception:  # not installed, or built for another torch / CUDA
            continue
    return None


FA4_MODULE = "flash_attn.cute"
FA4_HINT = ("FlashAttention-4 (flash-attn-4 and nvidia-cutlass-dsl wheels; benchmarks/gpu.sh --wheels puts "
            "their dsl_packages folder on PYTHONPATH)")


def fa4_function():
    """FlashAttention-4's ``flash_attn_varlen_func`` (its CuTe DSL package; the SM90 path takes head
    dims 192 / 128 forward and backward), or None when it does not import."""
    import importlib

    try:
        return importlib.import_module(FA4_MODULE).flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch / CUDA
        return None


def varlen_args(case: BenchCase, device) -> dict:
    """The varlen keywords of FlashAttention's calls for ``case`` (offsets as int32 torch tensors,
    the longest lengths, the score scale, causal), built once, not timed."""
    import torch

    vl, cro = case.offsets()
    return dict(cu_seqlens_q=torch.tensor(vl.astype(np.int32), device=device),
                cu_seqlens_k=torch.tensor(cro.astype(np.int32), device=device), max_seqlen_q=int(max(case.sq)),
                max_seqlen_k=int(max(case.sk)), softmax_scale=1.0 / math.sqrt(DQK), causal=case.causal)


def fa4_call(fn, q, k192, v, args: dict):
    """One FlashAttention-4 varlen call; its output whether the version returns ``out`` or a tuple."""
    out = fn(q, k192, v, **args)
    return out[0] if isinstance(out, tuple) else out


def fa3_varlen_call(case: BenchCase, fn, qs, ks, vs, kw_of: Callable[[int], dict] = lambda i: {}):
    """``call(i)``: one FlashAttention-3 varlen call ``fn`` (:func:`fa3_function`) over set i's whole
    batch of ``case`` (``qs[i]``, ``ks[i]``, ``vs[i]``: torch tensors, K at 192; keywords
    ``kw_of(i)``), the offsets built once, not timed. FA3's causal mask is bottom-right aligned, as
    ours; the output is returned whether the version gives ``out`` or ``(out, lse)``."""
    import torch

    vl, cro = case.offsets()
    dev = qs[0].device
    cu_q, cu_k = torch.tensor(vl.astype(np.int32), device=dev), torch.tensor(cro.astype(np.int32), device=dev)
    scale, causal = 1.0 / math.sqrt(DQK), case.causal
    mq, mk = max(case.sq), max(case.sk)

    def call(i):
        res = fn(qs[i], ks[i], vs[i], cu_q, cu_k, mq, mk, softmax_scale=scale, causal=causal, **kw_of(i))
        return res[0] if isinstance(res, (tuple, list)) else res

    return call


def bench_fa3(run: CaseRun) -> List[Row]:
    """FlashAttention-3 (``fa3-fwd`` wheel or FA3's own build), bf16, K built at 192."""
    found = fa3_function()
    if found is None:
        return []
    fn, module = found
    try:
        tx, (kfull, _) = torch_sets(run), k192(run)
        call = fa3_varlen_call(run.case, fn, [t["q"] for t in tx], kfull, [t["v"] for t in tx])
        return _timed_rows(run, "fa3", call, call(0), note=f"{module}.flash_attn_varlen_func")
    except Exception as exc:
        return [failed_row(run, "fa3", exc)]


#: How to get cuDNN's frontend (module ``cudnn``), which the ``cudnn-ragged`` rows need.
CUDNN_FRONTEND_HINT = ("pip install --no-deps nvidia-cudnn-frontend==1.32.0 (it uses the libcudnn torch ships; "
                       "for a GPU machine without network see the README: bash benchmarks/gpu.sh --wheels DIR)")

_said: set = set()


def _say_once(text: str) -> None:
    """Print ``text`` on stderr the first time only (one line per missing peer and process)."""
    if text not in _said:
        _said.add(text)
        print(text, file=sys.stderr)


def cudnn_sdpa_function():
    """cuDNN frontend's ``sdpa_torch`` (the ``nvidia-cudnn-frontend`` wheel), or None when the
    module ``cudnn`` does not import (see :data:`CUDNN_FRONTEND_HINT`)."""
    try:
        import cudnn

        return cudnn.sdpa_torch
    except Exception:  # not installed, or built for another torch / cuDNN
        return None


def cudnn_ragged_args(case: BenchCase) -> dict:
    """The keywords of ``cudnn.sdpa_torch`` for ``case`` other than the offsets: the mask (causal
    bottom-right aligned, as ours), the scale, the longest sequences.

    Raises
    ------
    ValueError
        The case's mask is one cuDNN's ragged path cannot express as ours does: a mask other than
        none or causal, or a causal sequence with more queries than keys (rows that see no key).
    """
    mask = case.mask
    if isinstance(mask, NullMask):
        kw = dict(is_causal=False)
    elif isinstance(mask, CausalMask):
        if any(q > k for q, k in zip(case.sq, case.sk)):
            raise ValueError("causal with more queries than keys in a sequence (rows that see no key)")
        kw = dict(is_causal=True, causal_bottom_right=True)
    else:
        raise ValueError(f"cuDNN's ragged SDPA has no {type(mask).__name__}")
    return dict(kw, scale=1.0 / math.sqrt(DQK), max_seqlen_q=max(case.sq), max_seqlen_kv=max(case.sk))


def cudnn_ragged_fn(case: BenchCase, fn, device):
    """``attn(q, k192, v, **extra) -> out``: one call of cuDNN's ragged (THD) SDPA ``fn``
    (:func:`cudnn_sdpa_function`) over the whole batch of ``case``: torch tensors ``[T, H, D]``, the
    offsets (``cu_seqlens``) built once on ``device``, the other keywords :func:`cudnn_ragged_args`'s
    (which raises ValueError for a mask cuDNN cannot express) and ``extra``."""
    kw = cudnn_ragged_args(case)
    import torch

    vl, cro = case.offsets()
    kw.update(cu_seqlens_q=torch.tensor(vl.astype(np.int32), device=device),
              cu_seqlens_kv=torch.tensor(cro.astype(np.int32), device=device))

    def attn(q, k192, v, **extra):
        return fn(q, k192, v, **kw, **extra)

    return attn


def bench_cudnn_ragged(run: CaseRun) -> List[Row]:
    """cuDNN's ragged SDPA (``cudnn.sdpa_torch`` with ``cu_seqlens``), one call for the whole
    batch, K built at 192; left out, with one line on stderr, when the frontend does not import."""
    fn = cudnn_sdpa_function()
    if fn is None:
        _say_once(f"cudnn-ragged rows left out: the cuDNN frontend (module cudnn) does not import; {CUDNN_FRONTEND_HINT}")
        return []
    tx = torch_sets(run)
    try:
        attn = cudnn_ragged_fn(run.case, fn, tx[0]["q"].device)
    except ValueError as exc:
        return [Row(run.case.name, "cudnn-ragged", float("nan"), float("nan"), note=f"skipped: {exc}")]
    kfull, _ = k192(run)

    def call(i):
        return attn(tx[i]["q"], kfull[i], tx[i]["v"])

    try:
        return _timed_rows(run, "cudnn-ragged", call, call(0), note="cudnn.sdpa_torch, one call per batch (cu_seqlens)")
    except Exception as exc:
        return [failed_row(run, "cudnn-ragged", exc)]


def quantize_per_batch_head(x, offsets):
    """e4m3 of ``x[T, H, D]`` (torch) with one scale per (sequence, head): ``(x8, descale[B, H]
    float32)``, ``descale = amax / 448`` over the sequence's rows and all D values (1 when 0)."""
    import torch

    from mla_cupy.quant import E4M3_MAX

    lens = np.diff(np.asarray(offsets, np.int64))
    descale = torch.ones((len(lens), x.shape[1]), dtype=torch.float32, device=x.device)
    for i in np.flatnonzero(lens):
        amax = x[int(offsets[i]):int(offsets[i + 1])].float().abs().amax(dim=(0, 2))
        descale[i] = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    rows = torch.as_tensor(np.repeat(np.arange(len(lens)), lens), device=x.device)
    x8 = (x.float() / descale[rows][:, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, descale


def dequantize_per_batch_head(x8, descale, offsets):
    """float64 CuPy values of :func:`quantize_per_batch_head`'s output."""
    import cupy as cp

    x = e4m3_to_f64(x8)
    d = _as_cupy(descale).astype(cp.float64)
    rows = cp.asarray(np.repeat(np.arange(len(offsets) - 1), np.diff(offsets.astype(np.int64))))
    return x * d[rows][:, :, None]


def quantize_inputs(case: BenchCase, qs, ks, vs, per_tensor: bool = False):
    """(q8, k8, v8): each set's q, K at 192 and v (torch) in e4m3, lists of ``(x8, descale)``, with one
    descale per (sequence, head) (:func:`quantize_per_batch_head`, FlashAttention-3's) or per tensor
    (:func:`quantize_per_tensor`, cuDNN's). Not timed."""
    vl, cro = case.offsets()

    def one(x, offsets):
        return quantize_per_tensor(x) if per_tensor else quantize_per_batch_head(x, offsets)

    return tuple([one(x, offsets) for x in xs] for xs, offsets in ((qs, vl), (ks, cro), (vs, cro)))


def bench_fa3_fp8(run: CaseRun) -> List[Row]:
    """FlashAttention-3 e4m3: q, K built at 192 and v quantized per (sequence, head) (not timed),
    ``q_descale`` / ``k_descale`` / ``v_descale`` of shape [B, H], bf16 output."""
    found = fa3_function()
    if found is None:
        return []
    fn, module = found
    vl, cro = run.case.offsets()
    try:
        tx, (kfull, _) = torch_sets(run), k192(run)
        q8, k8, v8 = quantize_inputs(run.case, [t["q"] for t in tx], kfull, [t["v"] for t in tx])
        call = fa3_varlen_call(run.case, fn, [q for q, _ in q8], [k for k, _ in k8], [v for v, _ in v8],
                               lambda i: dict(q_descale=q8[i][1], k_descale=k8[i][1], v_descale=v8[i][1]))
        out = call(0)
        ms = time_ms(call, len(run.sets), reps=run.reps)
    except Exception as exc:
        return [failed_row(run, "fa3-fp8", exc, "fp8")]
    k_deq = dequantize_per_batch_head(*k8[0], cro)
    ref8 = run.reference(dequantize_per_batch_head(*q8[0], vl), k_deq[:, :, :DV],
                         dequantize_per_batch_head(*v8[0], cro), k_deq[:, :, DV:])
    return [Row(run.case.name, "fa3-fp8", ms, run.case.flops() / ms / 1e9, run.error(out, ref8), None,
                note=f"{module}, e4m3 per (sequence, head) descales; K build and quantization not timed",
                err_vs_16bit=run.error(out), group="fp8")]


def quantize_per_tensor(x):
    """e4m3 of ``x`` (torch) with one scale for the whole tensor, the form cuDNN's fp8 SDPA takes:
    ``(x8, descale)``, ``descale`` a float32 ``[1, 1, 1, 1]`` tensor holding ``amax / 448`` (1 when
    ``x`` is all zeros)."""
    import torch

    from mla_cupy.quant import E4M3_MAX

    amax = x.float().abs().max()
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).reshape(1, 1, 1, 1)
    x8 = (x.float() / descale.reshape(())).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, descale


# Tensor ids of the cuDNN fp8 graph (cudnn_fp8_fn): inputs, scales, outputs, ragged layout.
_CUDNN_FP8_UIDS = dict(q=0, k=1, v=2, o=3, q_descale=5, k_descale=6, v_descale=7, s_descale=8, s_scale=9, o_scale=10,
                       o_amax=12, kv_len=13, q_len=14, q_off=17, k_off=18, v_off=19, o_off=20)


def cudnn_fp8_fn(case: BenchCase, device):
    """``attn(q8, k8, v8, q_descale, k_descale, v_descale, out) -> out``: one execution of a cuDNN
    frontend graph of fp8 SDPA (``pygraph.sdpa_fp8``, built once here) over the whole batch of
    ``case``: e4m3 ``q`` ``[Tq, H, 192]``, K at 192 and ``v`` ``[Tk, H, 128]`` torch tensors, one
    descale per tensor (:func:`quantize_per_tensor`), P quantized under cuDNN's fixed scale of 448,
    bf16 ``out`` ``[Tq, H, 128]``. Sequences of unequal lengths go through the ragged layout
    (offsets per sequence, a padding mask); the causal mask is bottom-right aligned, as ours.

    Raises
    ------
    ValueError
        A mask cuDNN cannot express as ours does (:func:`cudnn_ragged_args`).
    Exception
        What the frontend raises when this cuDNN does not support the graph (e.g.
        ``cudnn.cudnnGraphNotSupportedError``).
    """
    mask_kw = cudnn_ragged_args(case)
    import cudnn
    import torch

    from mla_cupy.quant import E4M3_MAX

    dt, uid = cudnn.data_type, _CUDNN_FP8_UIDS
    b, h = len(case.sq), case.heads
    s_q, s_kv = max(case.sq), max(case.sk)
    ragged = len(set(case.sq)) > 1 or len(set(case.sk)) > 1
    g = cudnn.pygraph(io_data_type=dt.FP8_E4M3, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT)

    def rows(name, s, d, data_type=dt.FP8_E4M3):  # [T, H, d] rows as (b, h, s, d)
        return g.tensor(uid=uid[name], dim=(b, h, s, d), stride=(s * h * d, d, h * d, 1), data_type=data_type)

    def scalar(name):
        return g.tensor(uid=uid[name], dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=dt.FLOAT)

    q, k, v = rows("q", s_q, DQK), rows("k", s_kv, DQK), rows("v", s_kv, DV)
    sc = {n: scalar(n) for n in ("q_descale", "k_descale", "v_descale", "s_descale", "s_scale", "o_scale")}
    vl, cro = case.offsets()
    fixed = {uid["s_scale"]: E4M3_MAX, uid["s_descale"]: 1.0 / E4M3_MAX, uid["o_scale"]: 1.0}
    fixed = {u: torch.full((1, 1, 1, 1), x, dtype=torch.float32, device=device) for u, x in fixed.items()}
    extra = dict(use_causal_mask_bottom_right=True) if mask_kw["is_causal"] else {}
    offsets = {}
    if ragged:  # per-sequence lengths (a padding mask) and element offsets of each sequence's rows
        def ints(name, values, data_type):
            fixed[uid[name]] = torch.tensor(values, device=device).reshape(len(values), 1, 1, 1)
            return g.tensor(uid=uid[name], dim=(len(values), 1, 1, 1), stride=(1, 1, 1, 1), data_type=data_type)

        extra.update(use_padding_mask=True, seq_len_q=ints("q_len", np.diff(vl).astype(np.int32), dt.INT32),
                     seq_len_kv=ints("kv_len", np.diff(cro).astype(np.int32), dt.INT32))
        for name, starts, width in (("q_off", vl, DQK), ("k_off", cro, DQK), ("v_off", cro, DV), ("o_off", vl, DV)):
            offsets[name] = ints(name, starts.astype(np.int64) * h * width, dt.INT64)
        for t, name in ((q, "q_off"), (k, "k_off"), (v, "v_off")):
            t.set_ragged_offset(offsets[name])
    o, _, _, amax_o = g.sdpa_fp8(q=q, k=k, v=v, descale_q=sc["q_descale"], descale_k=sc["k_descale"],
                                 descale_v=sc["v_descale"], descale_s=sc["s_descale"], scale_s=sc["s_scale"],
                                 scale_o=sc["o_scale"], generate_stats=False, attn_scale=mask_kw["scale"], **extra)
    o.set_uid(uid["o"]).set_output(True).set_dim((b, h, s_q, DV)).set_stride((s_q * h * DV, DV, h * DV, 1))
    o.set_data_type(dt.BFLOAT16)
    if ragged:
        o.set_ragged_offset(offsets["o_off"])
    amax_o.set_uid(uid["o_amax"]).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1))
    amax_o.set_data_type(dt.FLOAT)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    handle = cudnn.create_handle()
    workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=device)
    fixed[uid["o_amax"]] = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device)

    def attn(q8, k8, v8, q_descale, k_descale, v_descale, out):
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)  # a no-op once it is set
        pack = {uid["q"]: q8, uid["k"]: k8, uid["v"]: v8, uid["q_descale"]: q_descale, uid["k_descale"]: k_descale,
                uid["v_descale"]: v_descale, uid["o"]: out, **fixed}
        g.execute(pack, workspace, handle=handle)
        return out

    return attn


def cudnn_fp8_call(case: BenchCase, attn, q8, k8, v8):
    """``call(i)``: cuDNN's fp8 graph ``attn`` (:func:`cudnn_fp8_fn`) on set i's e4m3 inputs
    (:func:`quantize_inputs` with ``per_tensor``), into a bf16 output of that set's own."""
    import torch

    outs = [torch.empty((sum(case.sq), case.heads, DV), dtype=torch.bfloat16, device=q[0].device) for q in q8]

    def call(i):
        return attn(q8[i][0], k8[i][0], v8[i][0], q8[i][1], k8[i][1], v8[i][1], outs[i])

    return call


def bench_cudnn_fp8(run: CaseRun) -> List[Row]:
    """cuDNN's fp8 SDPA (a frontend graph, :func:`cudnn_fp8_fn`): q, K built at 192 and v in e4m3
    with one descale per tensor (not timed), bf16 output, one execution for the whole batch; left
    out, with one line on stderr, when the frontend does not import."""
    if cudnn_sdpa_function() is None:
        _say_once(f"cudnn-fp8 rows left out: the cuDNN frontend (module cudnn) does not import; {CUDNN_FRONTEND_HINT}")
        return []
    try:
        tx, (kfull, _) = torch_sets(run), k192(run)
        attn = cudnn_fp8_fn(run.case, tx[0]["q"].device)
    except ValueError as exc:
        return [Row(run.case.name, "cudnn-fp8", float("nan"), float("nan"), note=f"skipped: {exc}", group="fp8")]
    except Exception as exc:  # this cuDNN does not take the graph
        return [failed_row(run, "cudnn-fp8", exc, "fp8")]
    try:
        q8, k8, v8 = quantize_inputs(run.case, [t["q"] for t in tx], kfull, [t["v"] for t in tx], per_tensor=True)
        call = cudnn_fp8_call(run.case, attn, q8, k8, v8)
        out = call(0)
        ms = time_ms(call, len(run.sets), reps=run.reps)
    except Exception as exc:
        return [failed_row(run, "cudnn-fp8", exc, "fp8")]

    def deq(x8, descale):
        return e4m3_to_f64(x8) * float(descale.reshape(()))

    k_deq = deq(*k8[0])
    ref8 = run.reference(deq(*q8[0]), k_deq[:, :, :DV], deq(*v8[0]), k_deq[:, :, DV:])
    return [Row(run.case.name, "cudnn-fp8", ms, run.case.flops() / ms / 1e9, run.error(out, ref8), None,
                note="cuDNN frontend sdpa_fp8 graph, e4m3 per-tensor descales; K build and quantization not timed",
                err_vs_16bit=run.error(out), group="fp8")]


def bench_kbuild(run: CaseRun) -> List[Row]:
    """The K build the 16-bit peers need, on its own (when a peer built it)."""
    if "k192" not in run.cache:
        return []
    return [Row(run.case.name, "kbuild", k192(run)[1], float("nan"),
                note="torch.cat(k, k_rope broadcast) to [Tk, H, 192]")]


#: Row builders run with ``peers=True``, in order: each takes the :class:`CaseRun` and returns its rows.


#: The 16-bit peers' row builders, in order (``bench.run(..., builders=PEER_ROWS)``).
PEER_ROWS: List[Callable[[CaseRun], List[Row]]] = [bench_sdpa, bench_cudnn_ragged, bench_flex, bench_fa3,
                                                   bench_kbuild]

#: The fp8 peers (``matrix.py --fp8``).
FP8_PEER_ROWS: List[Callable[[CaseRun], List[Row]]] = [bench_fa3_fp8, bench_cudnn_fp8]




def _takes_out(fn) -> bool:
    """Whether a peer's function names an ``out`` parameter (then it is given one)."""
    try:
        return "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def host_peer_calls(case: BenchCase, t: dict, tout) -> Tuple[list, List[str]]:
    """The peers' calls for ``mla_cupy.bench_host.run(peers=...)``: FlashAttention-3's
    ``flash_attn_varlen_func`` and cuDNN frontend's ``sdpa_torch`` (ragged, one call per batch), each
    on K built at 192 width once (not timed), with ``out=tout`` where the function takes it;
    ``(calls, left_out)``, a line for each peer that does not import."""
    from mla_cupy.bench_host import HostCall

    tq_, tv_ = t["q"], t["v"]
    k192 = k192_of(t, case.heads)
    calls, left_out = [], []
    found = fa3_function()
    if found is None:
        left_out.append("FA3 row left out: neither fa3_fwd_interface nor flash_attn_interface imports")
    else:
        fn, module = found
        fa3_kw = {"out": tout} if _takes_out(fn) else {}
        fa3 = fa3_varlen_call(case, fn, [tq_], [k192], [tv_], lambda i: fa3_kw)
        calls.append(HostCall("FA3 flash_attn_varlen_func (K at 192)", "peer", lambda i: fa3(0),
                              note=f"{module}; out= {'given' if fa3_kw else 'not taken'}"))
    sdpa = cudnn_sdpa_function()
    if sdpa is None:
        left_out.append(f"cuDNN row left out: the cuDNN frontend (module cudnn) does not import; {CUDNN_FRONTEND_HINT}")
    else:
        try:
            attn = cudnn_ragged_fn(case, sdpa, tq_.device)
        except ValueError as exc:
            left_out.append(f"cuDNN row left out: {exc}")
        else:
            cudnn_kw = {"out": tout} if _takes_out(sdpa) else {}
            note = f"cudnn.sdpa_torch with cu_seqlens; out= {'given' if cudnn_kw else 'not taken'}"
            calls.append(HostCall("cuDNN sdpa_torch (ragged, K at 192)", "peer",
                                  lambda i: attn(tq_, k192, tv_, **cudnn_kw), note=note))
    return calls, left_out
