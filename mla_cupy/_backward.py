"""The backward's launches: the pre-pass, the main kernel (Hopper or portable) and the two
post-passes of ``kernels/mla_backward_*.cu``, over a float32 workspace (kernels/backward.cuh says
what it holds), packed once per array layout and launched with the data pointers of each run.

Nothing here checks arguments: callers pass checked device arrays (:mod:`mla_cupy.backward`).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _registry as reg
from ._arrays import device_pointer
from ._geometry import CompiledKernel, _compiled, _exports
from ._launch import PreparedLaunch
from ._select import sm_count
from .jit import get_function
from .masks import Mask
from .tma import encode_tiled, stride16
from .workspace import allocate_on, tile_counter

__all__ = ["BackwardShape", "BackwardLaunch", "backward_launch", "workspace_floats", "heads_per_group"]

#: kGeometry's fields: kernels/mla_backward_sm90.cu and mla_backward_sm80.cu (main), and the passes
#: of kernels/mla_backward_prepost.cu.
MAIN_GEOMETRY = ("smem", "threads", "block_m", "block_n")
PRE_GEOMETRY = ("threads", "heads_per_cta")
DQ_GEOMETRY = ("threads", "smem")
ROPE_GEOMETRY = ("threads", "rows_per_cta")

_KERNELS: Dict[Tuple, CompiledKernel] = {}
_LOCK = threading.Lock()


def _kernel(key: Tuple, fam, name: str, exports: Tuple[str, str, str], fields: Tuple[str, ...], what: str,
            smem_field: Optional[str]) -> CompiledKernel:
    ck = _KERNELS.get(key)
    if ck is not None:
        return ck
    params, table = _exports(fam, exports, len(fields), what)
    geometry = dict(zip(fields, (int(x) for x in table)))
    ck = _compiled(key, get_function(*fam, name), geometry[smem_field] if smem_field else 0, params, geometry)
    with _LOCK:
        return _KERNELS.setdefault(key, ck)


def main_kernel(kernel: str, dtype: np.dtype, mask: Mask, device_id: int) -> CompiledKernel:
    """The backward main kernel (``'sm90'`` or ``'sm80'``) for ``dtype`` and ``mask``."""
    fam = reg.backward_family(kernel, dtype, mask)
    return _kernel((device_id, "main", kernel, dtype, mask.cpp_name), fam, reg.backward_name(kernel, dtype, mask),
                   reg.backward_exports(kernel), MAIN_GEOMETRY, f"the {kernel} backward kernel", "smem")


def pass_kernels(dtype: np.dtype, out_dtype: np.dtype, kernel: str, device_id: int):
    """(pre, dq, rope) kernels of the passes around the main kernel ``kernel`` (whose dq_accum
    layout the dq pass reads: :data:`mla_cupy._registry.BWD_DQ_LAYOUT`)."""
    fam = reg.backward_prepost(dtype)
    layout = reg.BWD_DQ_LAYOUT[kernel]
    pre = _kernel((device_id, "pre", dtype, out_dtype), fam, reg.backward_pre_name(dtype, out_dtype),
                  reg.BWD_PRE_EXPORTS, PRE_GEOMETRY, "the backward pre-pass", None)
    dq = _kernel((device_id, "dq", dtype, layout), fam, reg.backward_dq_name(dtype, layout),
                 reg.BWD_DQ_EXPORTS, DQ_GEOMETRY, "the backward dq pass", "smem")
    rope = _kernel((device_id, "rope", dtype), fam, reg.backward_rope_name(dtype), reg.BWD_ROPE_EXPORTS,
                   ROPE_GEOMETRY, "the backward rope pass", None)
    return pre, dq, rope

_CHUNK_ROWS = 64  # kernels/backward.cuh: kChunkRows (checked against the kernels' block_m)


def heads_per_group(heads: int, work_per_group: int, sms: int) -> int:
    """Heads a work tile takes one after another (its rope gradient summed over them in registers):
    4 when that still leaves 4 work tiles per SM, else 2 (a rope slot per group: ``heads / g``
    rows of float32 per key in the workspace, never one per head)."""
    g = 4
    if work_per_group * -(-heads // g) < 4 * sms:
        g = 2
    return min(g, heads)


@dataclass(frozen=True)
class BackwardShape:
    """What the launches depend on besides pointers: sizes, the kernel, and the schedule."""

    heads: int
    tq: int
    tk: int
    batch: int
    max_sq: int
    max_sk: int
    dtype: np.dtype
    out_dtype: np.dtype
    mask: Mask
    scale: float
    kernel: str
    deterministic: bool
    device_id: int


def workspace_floats(s: BackwardShape, block_n: int, groups: int) -> Tuple[int, Dict[str, Tuple[int, int]]]:
    """Float32 elements of the workspace and each part's (offset, length) in them."""
    chunks = s.tq // _CHUNK_ROWS + s.batch + 1
    stat = s.heads * chunks * _CHUNK_ROWS
    parts = [("lse_log2", stat), ("dpsum", stat), ("dq_accum", stat * 192), ("rope_part", groups * s.tk * 64),
             ("dq_sem", -(-s.heads * chunks // 4) * 4 if s.deterministic else 0)]
    out, off = {}, 0
    for name, n in parts:
        out[name] = (off, n)
        off += n
    return off, out


class BackwardLaunch:
    """The four launches of one backward, packed for one set of array layouts; :meth:`launch` runs
    them on a run's pointers."""

    def __init__(self, s: BackwardShape, layouts: Dict[str, Any], offsets: Dict[str, int]):
        self.shape = s
        dev = s.device_id
        main = main_kernel(s.kernel, s.dtype, s.mask, dev)
        pre, dq, rope = pass_kernels(s.dtype, s.out_dtype, s.kernel, dev)
        if main.geometry["block_m"] != _CHUNK_ROWS:
            raise RuntimeError(f"backward kernel: query block of {main.geometry['block_m']} rows, expected {_CHUNK_ROWS}")
        block_n = main.geometry["block_n"]
        self.n_blocks = -(-s.max_sk // block_n) if s.max_sk else 0
        self.m_blocks = -(-s.max_sq // _CHUNK_ROWS) if s.max_sq else 0
        self.chunks = s.tq // _CHUNK_ROWS + s.batch + 1
        self.queries = bool(self.m_blocks and s.batch)  # some sequence has a query
        sms = sm_count(dev)
        g = heads_per_group(s.heads, self.n_blocks * s.batch, sms)
        self.groups = -(-s.heads // g)
        self.ws_floats, self.parts = workspace_floats(s, block_n, self.groups)
        self.main_ck, self.layouts = main, layouts
        el = s.dtype.itemsize
        st = {name: tuple(x // el for x in lay.strides) for name, lay in layouts.items()}  # element strides
        common = dict(
            q=0, k=0, v=0, k_rope=0, dout=0, q_st=st["q"][0], q_sh=st["q"][1], k_st=st["k"][0], k_sh=st["k"][1],
            v_st=st["v"][0], v_sh=st["v"][1], rope_st=st["k_rope"][0], do_st=st["dout"][0], do_sh=st["dout"][1],
            dk=0, dv=0, dk_st=st["dk"][0], dk_sh=st["dk"][1], dv_st=st["dv"][0], dv_sh=st["dv"][1],
            dq_accum=0, lse_log2=0, dpsum=0, rope_part=0, dq_sem=0, tk=s.tk,
            q_offsets=offsets["q_offsets"], kv_begin=offsets["kv_begin"], kv_end=offsets["kv_end"],
            cache_offsets=offsets["cache_offsets"], q_start_pos=offsets["q_start"],
            num_heads=s.heads, heads_per_group=g, batch=s.batch, num_n_blocks=self.n_blocks, num_chunks=self.chunks,
            scale_log2=s.scale * math.log2(math.e), scale=s.scale, mask_arg=s.mask.arg, deterministic=int(s.deterministic),
            tile_counter=0)
        work = self.n_blocks * s.batch * self.groups
        if s.kernel == "sm90":
            from .tma import ZERO_MAP

            common.update(tm_q=ZERO_MAP, tm_k=ZERO_MAP, tm_v=ZERO_MAP, tm_rope=ZERO_MAP, tm_do=ZERO_MAP)
            grid = (max(1, min(work, sms)), 1, 1)
        else:
            grid = (max(1, work), 1, 1)
        self.main = PreparedLaunch(main.params, main.fn, grid, main.threads, main.smem, common)
        out_st = tuple(x // layouts["out"].dtype.itemsize for x in layouts["out"].strides)
        self.pre = PreparedLaunch(pre.params, pre.fn, (max(1, self.m_blocks), max(1, s.batch),
                                                       -(-s.heads // pre.geometry["heads_per_cta"])), pre.threads, 0,
                                  dict(dout=0, do_st=st["dout"][0], do_sh=st["dout"][1], out=0, o_st=out_st[0],
                                       o_sh=out_st[1], lse=0, lse_st=layouts["lse"].strides[0] // 4, dlse=0,
                                       dlse_st=layouts["dlse"].strides[0] // 4 if "dlse" in layouts else 0,
                                       lse_log2=0, dpsum=0,
                                       dq_accum=0, dq_sem=0, q_offsets=offsets["q_offsets"], num_heads=s.heads,
                                       batch=s.batch, num_chunks=self.chunks))
        self.dq = PreparedLaunch(dq.params, dq.fn, (max(1, self.m_blocks), max(1, s.batch), s.heads), dq.threads, dq.smem,
                                 dict(dq_accum=0, dq=0, dq_st=st["dq"][0], dq_sh=st["dq"][1], scale=s.scale,
                                      q_offsets=offsets["q_offsets"], num_heads=s.heads, batch=s.batch,
                                      num_chunks=self.chunks))
        self.rope = PreparedLaunch(rope.params, rope.fn, (max(1, -(-s.tk // rope.geometry["rows_per_cta"])), 1, 1),
                                   rope.threads, 0,
                                   dict(rope_part=0, groups=self.groups, tk=s.tk, dk_rope=0, dkr_st=st["dk_rope"][0],
                                        dk=0, dk_st=st["dk"][0], dk_sh=st["dk"][1], dv=0, dv_st=st["dv"][0],
                                        dv_sh=st["dv"][1], num_heads=s.heads, kv_end=offsets["kv_end_last"],
                                        batch=s.batch if self.queries else 0))

    def workspace_bytes(self) -> int:
        return 4 * self.ws_floats

    def _maps(self, p: Dict[str, int]) -> None:
        s, lay = self.shape, self.layouts
        h, tq, tk, dt = s.heads, s.tq, s.tk, s.dtype
        st = {n: (stride16(lay[n], 1), stride16(lay[n], 0)) for n in ("q", "k", "v", "dout")}
        rope_row = stride16(lay["k_rope"], 0)
        self.main.set_bytes("tm_q", encode_tiled(p["q"], dt, (192, h, tq), st["q"], (64, 1, 64)).tobytes())
        self.main.set_bytes("tm_do", encode_tiled(p["dout"], dt, (128, h, tq), st["dout"], (64, 1, 64)).tobytes())
        self.main.set_bytes("tm_k", encode_tiled(p["k"], dt, (128, h, tk), st["k"], (32, 1, 96), swizzle=64).tobytes())
        self.main.set_bytes("tm_v", encode_tiled(p["v"], dt, (128, h, tk), st["v"], (64, 1, 96)).tobytes())
        self.main.set_bytes("tm_rope", encode_tiled(p["k_rope"], dt, (64, tk), (rope_row,), (32, 96),
                                                    swizzle=64).tobytes())

    def launch(self, p: Dict[str, int], stream_ptr: int, workspace: Any = None) -> Any:
        """Run the four launches on the data pointers ``p`` (q, k, v, k_rope, dout, out, lse, dq, dk,
        dv, dk_rope, and dlse where the launches were packed with it) on ``stream_ptr``; the workspace is ``workspace`` (a float32 device array of at
        least :meth:`workspace_bytes`) or taken from CuPy's pool for the run. Returns the workspace."""
        s = self.shape
        if workspace is None:
            workspace = allocate_on((4 * self.ws_floats,), stream_ptr, "the backward's workspace")
        base = device_pointer(workspace)
        ws = {name: base + 4 * off if n else 0 for name, (off, n) in self.parts.items()}
        m, pre, r = self.main, self.pre, self.rope
        for name in ("q", "k", "v", "k_rope", "dout", "dk", "dv"):
            m.set_pointer(name, p[name])
        for name in ("dq_accum", "lse_log2", "dpsum", "rope_part", "dq_sem"):
            m.set_pointer(name, ws[name])
        for name in ("dout", "out", "lse"):
            pre.set_pointer(name, p[name])
        pre.set_pointer("dlse", p.get("dlse", 0))
        for name in ("lse_log2", "dpsum", "dq_accum", "dq_sem"):
            pre.set_pointer(name, ws[name])
        self.dq.set_pointer("dq_accum", ws["dq_accum"])
        self.dq.set_pointer("dq", p["dq"])
        r.set_pointer("rope_part", ws["rope_part"])
        for name in ("dk_rope", "dk", "dv"):
            r.set_pointer(name, p[name])
        if self.queries:
            pre.launch(stream_ptr)
            if self.n_blocks:
                if s.kernel == "sm90":
                    self._maps(p)
                # the Hopper kernel's work tiles, the portable one's tickets (in launch order: what its
                # deterministic mode needs to make progress), from the stream's counter
                m.set_pointer("tile_counter", tile_counter(s.device_id, stream_ptr))
                m.launch(stream_ptr)
            self.dq.launch(stream_ptr)
        if s.tk:  # without queries the rope pass zeroes dk, dv and dk_rope (it sees no sequence)
            r.launch(stream_ptr)
        return workspace


@dataclass(frozen=True)
class Layout:
    """What a launch keeps of an array: dtype, shape and byte strides (no pointer, no reference)."""

    dtype: np.dtype
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]

    @classmethod
    def of(cls, x: Any) -> "Layout":
        return cls(np.dtype(x.dtype), tuple(int(v) for v in x.shape), tuple(int(v) for v in x.strides))


def backward_launch(s: BackwardShape, arrays: Dict[str, Any], offsets: Dict[str, int]) -> BackwardLaunch:
    """The launches of shape ``s`` for these arrays' layouts (device arrays by name)."""
    return BackwardLaunch(s, {n: Layout.of(a) for n, a in arrays.items()}, offsets)
