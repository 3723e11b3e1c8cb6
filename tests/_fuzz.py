"""Random MLA prefill problems against the float64 reference: drawn from ``(seed, index)`` alone,
run in resumable ranges under a time budget, with progress lines, a shrinker and JSON records.

One generator serves the GPU suite (``tests/test_gpu_fuzz.py``: the first few problems) and the
command line (``python benchmarks/fuzz.py``, ``bash benchmarks/gpu.sh verify fuzz``: thousands).

* :func:`draw` makes problem ``index`` of ``seed`` (a :class:`Problem`: shapes, positions, mask,
  rope source, options, the seed of its data), so any problem can be regenerated alone.
  Problems go round the schedule of (variant, kernel) pairs and, across rounds, every mask, so
  any range of ``len(SCHEDULE) * 5`` problems holds every pair at every mask.
* :func:`check` builds the problem's data on the host and runs its variant (:data:`VARIANTS`):
  the kernel with a NaN-poisoned output, compared with the float64 reference by the checkers of
  the GPU tests (``gpu_util.run_and_check`` / ``check_result``, ``test_gpu_fp8.check_fp8`` /
  ``run_fp8_rope``, ``gpu_util.BackwardProblem`` for the backward: its four gradients).
* :func:`shrink` makes a failing problem smaller (fewer sequences, fewer heads, shorter lengths,
  fewer options) while it still fails the same way, within a time budget.
* :func:`run_range` runs problems ``[start, end)``, prints progress (problems done per kernel and
  variant, elapsed time, the seed), stops before ``budget_s`` and records what it did
  (:mod:`_verify`), so that the next command resumes where it stopped.

Adding a variant is one entry of
:data:`VARIANTS`: its name, the kernels it runs on, what it draws, and a runner
``run(problem, case) -> worst error`` that raises ``AssertionError`` on a wrong answer.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from mla_cupy import CausalMask, ChunkedCausalMask, ChunkedMask, NullMask, PagedKVCache, SlidingWindowCausalMask

from _cases import BF16, FP16, Case, build_paged, build_paged_fp8_rope, make_case

MASK_TYPES = {cls.__name__: cls for cls in (NullMask, CausalMask, SlidingWindowCausalMask, ChunkedMask, ChunkedCausalMask)}
MASKS_WITH_ARG = ("SlidingWindowCausalMask", "ChunkedMask", "ChunkedCausalMask")
DTYPES = {"bf16": BF16, "fp16": FP16}
#: Lengths around the tile sizes (64 keys, 128 query rows), drawn half of the time.
SPECIAL_LENGTHS = (0, 1, 2, 63, 64, 65, 127, 128, 129, 191, 257)
PAGE_SIZES = (16, 64, 512)
#: Keys per chunk of the chunked variant.
CHUNK_SIZES = (1, 16, 64, 100, 257, 1000)
#: fp8 per token on random short slices: the contract's bound for any slice is 6e-2; the e4m3
#: rounding of P alone reached 3.2% on an H200 (the 3e-2 bar is asserted on slices of 64+ keys in
#: test_gpu_fp8.py).
FP8_TOL = 5e-2


@dataclass(frozen=True)
class Problem:
    """One random problem; every field is plain data (JSON in :meth:`to_json`).

    ``mask`` is ``(class name, window or chunk size or 0)``; ``page_size`` 0 means a plain rope;
    ``cache_offsets`` of a paged problem are multiples of the page size when ``aligned`` (whole
    pages copied) and not otherwise (rows gathered); ``chunk_size`` is the chunked variant's;
    ``split`` the accumulate variant's keys of each sequence in its first call; ``deterministic``
    and ``dlse`` the backward variant's mode and whether the loss reads the lse; ``no_read_back``
    the backward called with ``q_max_seq_len`` and ``validate=False`` (nothing read back: Tk's
    key blocks bound its grid).
    """

    variant: str
    kernel: str
    sq: Tuple[int, ...]
    sk: Tuple[int, ...]
    heads: int
    dtype: str
    mask: Tuple[str, int]
    cache_offsets: Optional[Tuple[int, ...]] = None
    q_start_pos: Optional[Tuple[int, ...]] = None
    out_f32: bool = False
    lse: bool = True
    page_size: int = 0
    chunk_size: int = 0
    split: Optional[Tuple[int, ...]] = None
    data_seed: int = 0
    deterministic: bool = False
    dlse: bool = False
    no_read_back: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Problem":
        d = json.loads(text)
        for name in ("sq", "sk", "mask", "cache_offsets", "q_start_pos", "split"):
            if d.get(name) is not None:
                d[name] = tuple(d[name])
        return cls(**d)

    @property
    def combo(self) -> str:
        return f"{self.kernel}/{self.variant}"

    def mask_object(self):
        name, arg = self.mask
        return MASK_TYPES[name](arg) if name in MASKS_WITH_ARG else MASK_TYPES[name]()

    def case(self) -> Case:
        """The problem's data on the host (normal(0, 1) inputs from ``data_seed``)."""
        return make_case(self.sq, self.sk, self.heads, DTYPES[self.dtype], seed=self.data_seed,
                         cache_offsets=self.cache_offsets, q_start_pos=self.q_start_pos)


@dataclass(frozen=True)
class Variant:
    """A way to call the kernels, and what its problems draw.

    Attributes
    ----------
    name : str
    kernels : tuple of str
        The kernels it runs on (each is one entry of :data:`SCHEDULE`).
    run : callable
        ``run(problem, case) -> float``: the call and its check against the reference; raises
        ``AssertionError`` on a wrong answer. Imports CuPy itself (the module stays CPU-only).
    dtypes : tuple of str
        16-bit input dtypes it draws from (:data:`DTYPES`).
    paged, out_f32, lse : float
        Probabilities of a paged rope, a float32 output, an lse output (1: always, 0: never).
    min_batch : int
        Fewest sequences it draws (its shrinker keeps at least that many).
    extra : callable, optional
        ``extra(rng, sk) -> dict`` of more :class:`Problem` fields (``chunk_size``, ``split``,
        ``deterministic``, ``dlse``, ``no_read_back``), drawn after the common fields.
    """

    name: str
    kernels: Tuple[str, ...]
    run: Callable[[Problem, Case], float]
    dtypes: Tuple[str, ...] = ("bf16", "fp16")
    paged: float = 0.3
    out_f32: float = 0.5
    lse: float = 0.7
    min_batch: int = 1
    extra: Optional[Callable] = None


# ------------------------------------------------------------------------------------------------
# The runners (GPU): each builds the device inputs of its variant and checks the result.


def _ropes(p: Problem, case: Case):
    """``(device rope, host rope for the reference)`` of a paged 16-bit problem, ``(None, None)``
    for a plain rope (the case's own)."""
    if not p.page_size:
        return None, None
    import cupy as cp

    blocks, lut = build_paged(case, p.page_size, seed=p.data_seed % 1000)
    return PagedKVCache(cp.asarray(blocks), cp.asarray(lut), p.page_size), PagedKVCache(blocks, lut, p.page_size)


def _run_one_shot(p: Problem, case: Case) -> float:
    """``mla_prefill`` with a plain or paged rope (``gpu_util.run_and_check``)."""
    from gpu_util import run_and_check

    rope, ref_rope = _ropes(p, case)
    return run_and_check(case, mask=p.mask_object(), out_dtype=np.float32 if p.out_f32 else None, kernel=p.kernel,
                         k_rope=rope, ref_k_rope=ref_rope, return_lse=p.lse)[2]


def _run_chunked(p: Problem, case: Case) -> float:
    """``mla_prefill_chunked`` (the epilogue merge of every chunk) against the one-shot reference."""
    import cupy as cp

    import mla_cupy
    from gpu_util import check_result, reference_result, upload

    d = upload(case)
    rope, ref_rope = _ropes(p, case)
    out_dtype = np.float32 if p.out_f32 else None
    out = cp.full((case.q.shape[0], p.heads, 128), np.nan, np.dtype(out_dtype or case.q.dtype))
    res = mla_cupy.mla_prefill_chunked(d["q"], d["k"], d["v"], d["k_rope"] if rope is None else rope, d["valid_length"],
                                       d["cache_row_offsets"], chunk_size=p.chunk_size, mask=p.mask_object(),
                                       cache_offsets=d["cache_offsets"], q_start_pos=d["q_start_pos"], out=out,
                                       out_dtype=out_dtype, return_lse=p.lse, kernel=p.kernel)
    got, lse = res if p.lse else (res, None)
    ref, ref_lse = reference_result(case, mask=p.mask_object(), k_rope=ref_rope)
    return check_result(case, got, lse, ref, ref_lse)


def split_keys(case: Case, split: Sequence[int]):
    """The two key sets of the accumulate variant: for each part, ``(rows, row_offsets,
    cache_offsets)`` with ``rows`` the rows of k / v it takes (keys ``[0, split[b])`` of each
    sequence, then the rest) and the absolute position of each sequence's first key in it; and
    the query positions of the whole problem (what both calls pass as ``q_start_pos``)."""
    cro = case.cache_row_offsets.astype(np.int64)
    sk = np.diff(cro)
    sq = np.diff(case.valid_length.astype(np.int64))
    s = np.minimum(np.asarray(split, np.int64), sk)
    co = np.zeros(len(sk), np.int64) if case.cache_offsets is None else case.cache_offsets.astype(np.int64)
    q_start = co + sk - sq if case.q_start_pos is None else case.q_start_pos.astype(np.int64)
    parts = []
    for lo, hi, pos in ((cro[:-1], cro[:-1] + s, co), (cro[:-1] + s, cro[1:], co + s)):
        rows = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)] + [np.zeros(0, np.int64)])
        offsets = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.uint32)
        parts.append((rows, offsets, pos.astype(np.uint32)))
    return parts, q_start


def _run_accumulate(p: Problem, case: Case) -> float:
    """Two calls over disjoint keys (``split``) merged by ``accumulate=True`` into a float32 out and
    lse, against the reference over all keys."""
    import cupy as cp

    import mla_cupy
    from gpu_util import check_result, reference_result, upload

    d = upload(case)
    rope, ref_rope = _ropes(p, case)
    tq = case.q.shape[0]
    out = cp.full((tq, p.heads, 128), np.nan, cp.float32)
    lse = cp.full((tq, p.heads), np.nan, cp.float32)
    parts, q_start = split_keys(case, p.split)
    for i, (rows, offsets, co) in enumerate(parts):
        r = cp.asarray(rows)
        mla_cupy.mla_prefill(d["q"], d["k"][r], d["v"][r], d["k_rope"][r] if rope is None else rope, d["valid_length"],
                             cp.asarray(offsets), mask=p.mask_object(), cache_offsets=cp.asarray(co),
                             q_start_pos=cp.asarray(q_start), out=out, lse=lse, accumulate=i > 0, kernel=p.kernel)
    ref, ref_lse = reference_result(case, mask=p.mask_object(), k_rope=ref_rope)
    return check_result(case, out, lse, ref, ref_lse)


def _run_fp8(p: Problem, case: Case) -> float:
    """``mla_prefill_fp8`` on the per-token quantization of the case (plain or paged bf16 rope)."""
    import cupy as cp

    from test_gpu_fp8 import check_fp8, quantized

    fq = quantized(case)
    cache = None
    if p.page_size:  # the cache holds the rope divided by the key's scale, as MAX's per-token cache
        blocks, lut = build_paged(dataclasses.replace(case, k_rope=fq["k_rope"]), p.page_size, seed=p.data_seed % 1000)
        cache = PagedKVCache(cp.asarray(blocks), cp.asarray(lut), p.page_size)
    return check_fp8(case, mask=p.mask_object(), k_rope=cache, tol=FP8_TOL, fq=fq,
                     out_dtype=np.float32 if p.out_f32 else None, kernel=p.kernel)


def _run_fp8_rope(p: Problem, case: Case) -> float:
    """``mla_prefill`` with an e4m3 rope and per-key scales, plain or in an fp8 paged cache."""
    import cupy as cp

    from mla_cupy import quant
    from test_gpu_fp8 import run_fp8_rope

    if p.page_size:
        blocks8, lut, scales, _, _ = build_paged_fp8_rope(case, p.page_size, seed=p.data_seed % 1000)
        cache = PagedKVCache(cp.asarray(blocks8), cp.asarray(lut), p.page_size, scales=cp.asarray(scales))
        return run_fp8_rope(case, cache, mask=p.mask_object(), kernel=p.kernel)
    r8, sc = quant.quantize_rope_blocks(case.k_rope)
    return run_fp8_rope(case, cp.asarray(r8.view(np.uint8)), cp.asarray(sc), mask=p.mask_object(), kernel=p.kernel)


def _run_e4m3(p: Problem, case: Case) -> float:
    """``mla_prefill_fp8`` in the all-e4m3 mode: e4m3 q_rope and plain k_rope under the per-token
    scales (no paged cache in this mode)."""
    from test_gpu_fp8 import check_fp8, quantized

    return check_fp8(case, mask=p.mask_object(), tol=FP8_TOL, fq=quantized(case, e4m3_rope=True),
                     out_dtype=np.float32 if p.out_f32 else None, kernel=p.kernel)


def _run_backward(p: Problem, case: Case) -> float:
    """``mla_prefill`` for out and lse (poisoned; float32 out when drawn), then
    ``mla_prefill_backward`` into poisoned gradients (deterministic mode and a dlse when drawn),
    every gradient against the float64 reference backward of the same out, lse, dout and dlse."""
    from gpu_util import BackwardProblem

    bp = BackwardProblem(case, p.mask_object(), p.kernel, out_dtype=np.float32 if p.out_f32 else None, dlse=p.dlse,
                         seed=(p.data_seed, 1))  # dout's stream apart from the inputs' (data_seed's)
    call = dict(q_max_seq_len=max(p.sq, default=0), validate=False) if p.no_read_back else {}
    return bp.check(bp.run(deterministic=p.deterministic, **call))


def _chunk_size(rng, sk) -> dict:
    return dict(chunk_size=int(rng.choice(CHUNK_SIZES)))


def _split(rng, sk) -> dict:
    return dict(split=tuple(int(rng.integers(0, s + 1)) for s in sk))


def _backward_options(rng, sk) -> dict:
    return dict(deterministic=bool(rng.random() < 0.4), dlse=bool(rng.random() < 0.3),
                no_read_back=bool(rng.random() < 0.5))


#: Every variant the fuzz runs, in schedule order.
VARIANTS: Dict[str, Variant] = {v.name: v for v in (
    Variant("plain", ("sm80", "sm90"), _run_one_shot, paged=0.0, min_batch=0),
    Variant("paged", ("sm80", "sm90"), _run_one_shot, paged=1.0),
    Variant("chunked", ("sm80", "sm90"), _run_chunked, extra=_chunk_size),
    Variant("accumulate", ("sm80", "sm90"), _run_accumulate, out_f32=1.0, lse=1.0, extra=_split),
    Variant("fp8", ("sm90",), _run_fp8, dtypes=("bf16",), lse=1.0),
    Variant("fp8_rope", ("sm90",), _run_fp8_rope, dtypes=("bf16",), out_f32=0.0, lse=1.0),
    Variant("e4m3", ("sm90",), _run_e4m3, dtypes=("bf16",), paged=0.0, lse=1.0),
    # last, so that the problems of the first round keep the pairs they had before it came
    Variant("backward", ("sm80", "sm90"), _run_backward, paged=0.0, lse=1.0, min_batch=0, extra=_backward_options),
)}
#: (variant, kernel) pairs; problem ``index`` is of pair ``index % len(SCHEDULE)``. Its length plus
#: one must not be a multiple of the masks' count (5), or a pair would meet one mask only.
SCHEDULE: Tuple[Tuple[str, str], ...] = tuple((v.name, k) for v in VARIANTS.values() for k in v.kernels)


def schedule_names() -> List[str]:
    """The schedule as ``kernel/variant`` names: a fuzz record keeps it, since an index means
    another problem under another schedule (resuming reads only the records of this one)."""
    return [f"{k}/{v}" for v, k in SCHEDULE]


# ------------------------------------------------------------------------------------------------
# The generator (CPU)


def _length(rng) -> int:
    return int(rng.choice(SPECIAL_LENGTHS)) if rng.random() < 0.5 else int(rng.integers(0, 301))


def draw(seed: int, index: int) -> Problem:
    """Problem ``index`` of ``seed``: the same on every machine and every call (NumPy's generator
    seeded with ``(seed, index)``)."""
    rng = np.random.default_rng([int(seed), int(index)])
    name, kernel = SCHEDULE[index % len(SCHEDULE)]
    v = VARIANTS[name]
    mask_name = tuple(MASK_TYPES)[(index + index // len(SCHEDULE)) % len(MASK_TYPES)]
    mask_arg = int(rng.integers(1, 301)) if mask_name in MASKS_WITH_ARG else 0
    b = int(rng.integers(v.min_batch, 13))
    heads = int(rng.choice([1, 16, 128] if b <= 3 else [1, 16]))
    sq = [_length(rng) for _ in range(b)]
    sk = [max(0, s + int(rng.choice([0, 0, 1, 37, 200])) - int(rng.choice([0, 0, 5]))) for s in sq]
    if b >= 2 and rng.random() < 0.3:  # an empty sequence: no queries, or no keys
        j = int(rng.integers(0, b))
        (sq if rng.random() < 0.5 else sk)[j] = 0
    page_size = int(rng.choice(PAGE_SIZES)) if rng.random() < v.paged else 0
    if page_size and rng.random() < 0.5:  # aligned: every sequence starts on a page
        co: Optional[List[int]] = [page_size * int(rng.integers(0, 3)) for _ in range(b)]
    elif page_size:  # gathered: starts inside a page
        co = [page_size * int(rng.integers(0, 3)) + int(rng.integers(1, page_size)) for _ in range(b)]
    else:
        co = [int(rng.integers(0, 1001)) for _ in range(b)] if rng.random() < 0.5 else None
    q_start = [int(rng.integers(-300, 1501)) for _ in range(b)] if rng.random() < 0.4 else None
    fields = dict(
        variant=name, kernel=kernel, sq=tuple(sq), sk=tuple(sk), heads=heads, dtype=str(rng.choice(v.dtypes)),
        mask=(mask_name, mask_arg), cache_offsets=None if co is None else tuple(co),
        q_start_pos=None if q_start is None else tuple(q_start), out_f32=bool(rng.random() < v.out_f32),
        lse=bool(rng.random() < v.lse), page_size=page_size, data_seed=int(rng.integers(0, 2**31)))
    if v.extra is not None:
        fields.update(v.extra(rng, sk))
    return Problem(**fields)


def aligned(p: Problem) -> bool:
    """Whether every sequence of a paged problem starts on a page boundary."""
    return all(c % p.page_size == 0 for c in (p.cache_offsets or [0]))


def tags(p: Problem) -> List[str]:
    """What a problem covers, for the coverage counts: its mask (first), dtype, positions, empty
    sequences, the rope source, the outputs, the backward's options."""
    out = [p.mask[0], p.dtype]
    if not p.sq:
        out.append("B=0")
    if p.cache_offsets is not None:
        out.append("cache_offsets")
    if p.q_start_pos is not None:
        out.append("q_start_pos")
    if 0 in p.sq or 0 in p.sk:
        out.append("empty sequence")
    if len(set(zip(p.sq, p.sk))) > 1:
        out.append("ragged")
    if p.page_size:
        out.append(f"paged {p.page_size} {'aligned' if aligned(p) else 'gathered'}")
    if p.lse:
        out.append("lse")
    if p.out_f32:
        out.append("float32 out")
    if p.deterministic:
        out.append("deterministic")
    if p.dlse:
        out.append("dlse")
    if p.no_read_back:
        out.append("no read-back")
    return out


def describe(p: Problem) -> str:
    """One line: what the problem is."""
    name, arg = p.mask
    parts = [f"{p.combo}: B={len(p.sq)} sq={list(p.sq)} sk={list(p.sk)} H={p.heads} {p.dtype}",
             f"{name}({arg})" if name in MASKS_WITH_ARG else f"{name}()"]
    if p.cache_offsets is not None:
        parts.append(f"cache_offsets={list(p.cache_offsets)}")
    if p.q_start_pos is not None:
        parts.append(f"q_start_pos={list(p.q_start_pos)}")
    if p.page_size:
        parts.append(f"pages of {p.page_size} ({'aligned' if aligned(p) else 'gathered'})")
    if p.chunk_size:
        parts.append(f"chunks of {p.chunk_size}")
    if p.split is not None:
        parts.append(f"split={list(p.split)}")
    parts += (["lse"] if p.lse else []) + (["float32 out"] if p.out_f32 else [])
    parts += (["deterministic"] if p.deterministic else []) + (["dlse"] if p.dlse else [])
    parts += ["q_max_seq_len, validate=False"] if p.no_read_back else []
    return " ".join(parts)


def repro_index(seed: int, index: int) -> str:
    return f"python benchmarks/fuzz.py --seed {seed} --index {index}"


def repro_problem(p: Problem) -> str:
    return f"python benchmarks/fuzz.py --problem '{p.to_json()}'"


# ------------------------------------------------------------------------------------------------
# Shrinking (CPU logic; the predicate runs the GPU check)


def _keep(p: Problem, keep: Sequence[int]) -> Problem:
    """The problem with only the sequences ``keep``."""
    pick = (lambda xs: None if xs is None else tuple(xs[j] for j in keep))
    return dataclasses.replace(p, sq=pick(p.sq), sk=pick(p.sk), cache_offsets=pick(p.cache_offsets),
                               q_start_pos=pick(p.q_start_pos), split=pick(p.split))


def _lengths(p: Problem, j: int, sq: int, sk: int) -> Problem:
    """The problem with sequence ``j`` of ``sq`` queries and ``sk`` keys."""
    new_sq, new_sk = list(p.sq), list(p.sk)
    new_sq[j], new_sk[j] = sq, sk
    split = None if p.split is None else tuple(min(s, k) for s, k in zip(p.split, new_sk))
    return dataclasses.replace(p, sq=tuple(new_sq), sk=tuple(new_sk), split=split)


def candidates(p: Problem) -> Iterator[Problem]:
    """Smaller problems than ``p``, roughly the biggest cuts first: fewer sequences, fewer heads,
    shorter sequences, then fewer options."""
    b = len(p.sq)
    low = VARIANTS[p.variant].min_batch
    if b > max(low, 1):
        half = b // 2
        for keep in (range(half), range(half, b)):
            if len(keep) >= low:
                yield _keep(p, list(keep))
        if b - 1 >= low:
            for j in range(b):
                yield _keep(p, [i for i in range(b) if i != j])
    for h in (1, 16):
        if h < p.heads:
            yield dataclasses.replace(p, heads=h)
    for j in sorted(range(b), key=lambda i: -(p.sq[i] + p.sk[i])):
        sq, sk = p.sq[j], p.sk[j]
        for nq, nk in ((sq // 2, sk // 2), (sq // 2, sk), (sq, sk // 2), (sq - 1, sk - 1), (sq - 1, sk), (sq, sk - 1)):
            if min(nq, nk) >= 0 and (nq, nk) != (sq, sk):
                yield _lengths(p, j, nq, nk)
    v = VARIANTS[p.variant]
    simpler = dict(cache_offsets=None, q_start_pos=None, out_f32=v.out_f32 >= 1, lse=v.lse >= 1,
                   page_size=p.page_size if v.paged >= 1 else 0, deterministic=False, dlse=False)
    for name, value in simpler.items():
        if getattr(p, name) != value:
            yield dataclasses.replace(p, **{name: value})


def shrink(p: Problem, fails: Callable[[Problem], bool], budget_s: float, clock: Callable[[], float] = time.monotonic,
           max_checks: int = 500) -> Tuple[Problem, int]:
    """Greedy shrinking: take the first of :func:`candidates` that still ``fails``, and again from
    there, until none does or ``budget_s`` / ``max_checks`` run out. Returns (the smallest failing
    problem found, the number of checks)."""
    t0, checks = clock(), 0
    improved = True
    while improved:
        improved = False
        for c in candidates(p):
            if clock() - t0 >= budget_s or checks >= max_checks:
                return p, checks
            checks += 1
            if fails(c):
                p, improved = c, True
                break
    return p, checks


# ------------------------------------------------------------------------------------------------
# Running ranges


def check(p: Problem) -> float:
    """Run problem ``p`` on the GPU against the reference; raises on a wrong answer. Returns the
    worst per-slice relative error."""
    return VARIANTS[p.variant].run(p, p.case())


def is_fatal(exc: BaseException) -> bool:
    """A CUDA runtime or driver error (e.g. an illegal address): the context is lost, so nothing
    after it in this process can be trusted."""
    return any(t.__name__ in ("CUDARuntimeError", "CUDADriverError") for t in type(exc).__mro__)


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def counts_line(counts: Dict[str, int]) -> str:
    """``sm80: plain 3 paged 2 ... | sm90: ...``: problems done per kernel and variant."""
    kernels = dict.fromkeys(k for _, k in SCHEDULE)
    return " | ".join(f"{k}: " + " ".join(f"{v} {counts.get(f'{k}/{v}', 0)}" for v, kv in SCHEDULE if kv == k)
                      for k in kernels)


def record_name(seed: int, start: int, t: float) -> str:
    return f"fuzz-s{seed}-{start:06d}-{int(t)}.json"


def run_range(seed: int, start: int, end: int, *, budget_s: float = 450.0, kernels: Iterable[str] = ("sm80", "sm90"),
              out_dir=None, shrink_s: float = 60.0, max_shrinks: int = 2, every: int = 50, skip: Iterable[int] = (),
              checker: Callable[[Problem], float] = check, clock: Callable[[], float] = time.monotonic,
              log: Callable[[str], None] = print, total: Optional[int] = None) -> dict:
    """Run problems ``[start, end)`` of ``seed`` (less those in ``skip``) with ``checker``.

    Prints a progress line every ``every`` problems; stops before ``budget_s`` seconds (the next
    problem is not started when the time so far plus twice the longest of the last 20 problems
    would pass it); shrinks the first ``max_shrinks`` failures for at most ``shrink_s`` each (and
    never past the budget). A CUDA error ends the range (the context is lost). Writes the record
    to ``out_dir`` after every progress line and at the end. Returns the record: ``next_start`` is
    where the next command resumes (``end`` when the range is complete).
    """
    kernels, skip = set(kernels), set(skip)
    t0 = clock()
    rec = dict(kind="fuzz", seed=seed, schedule=schedule_names(), start=start, end=end,
               total=end if total is None else total, budget_s=budget_s, next_start=start, stopped="running",
               problems=[], failures=[], fatal=None, counts={}, tags={}, elapsed_s=0.0, worst_error={})
    name = record_name(seed, start, time.time())
    recent: deque = deque(maxlen=20)

    def save():
        rec["elapsed_s"] = round(clock() - t0, 2)
        if out_dir is not None:
            from _verify import write_record

            write_record(out_dir, name, rec)

    def progress(prefix="fuzz"):
        failed = len(rec["failures"])
        log(f"{prefix} seed {seed} [{start}, {end}): next {rec['next_start']}, {clock() - t0:.1f} s, "
            f"{failed} failed | {counts_line(rec['counts'])}")

    log(f"fuzz seed {seed}: problems [{start}, {end}), budget {budget_s:.0f} s, kernels {', '.join(sorted(kernels))}")
    ran = 0
    for index in range(start, end):
        rec["next_start"] = index
        if index in skip:
            continue
        if recent and clock() - t0 + 2 * max(recent) > budget_s:
            rec["stopped"] = "budget"
            break
        p = draw(seed, index)
        if p.kernel not in kernels:
            rec["problems"].append([index, p.combo, "skipped", tags(p)])
            continue
        t1 = clock()
        try:
            err = checker(p)
            recent.append(clock() - t1)
            status = "ok"
            rec["worst_error"][p.combo] = max(rec["worst_error"].get(p.combo, 0.0), float(err or 0.0))
        except Exception as exc:  # a wrong answer, or an error raised by the call
            recent.append(clock() - t1)
            status = "failed"
            fail = dict(index=index, label=describe(p), error=_error_text(exc), repro=repro_index(seed, index),
                        problem=p.to_json())
            log(f"!! FAILED problem {index} ({describe(p)}): {fail['error']}\n   reproduce: {fail['repro']}")
            if is_fatal(exc):
                rec["fatal"] = f"problem {index}: {fail['error']}"
            elif len(rec["failures"]) < max_shrinks:
                left = budget_s - (clock() - t0) - 2 * max(recent)
                fail.update(_shrunk(p, exc, checker, min(shrink_s, left), clock, log))
            rec["failures"].append(fail)
        rec["problems"].append([index, p.combo, status, tags(p)])
        rec["counts"][p.combo] = rec["counts"].get(p.combo, 0) + 1
        for tag in tags(p):
            rec["tags"][tag] = rec["tags"].get(tag, 0) + 1
        rec["next_start"] = index + 1
        ran += 1
        if rec["fatal"]:
            rec["stopped"] = "fatal"
            break
        if every and ran % every == 0:
            progress()
            save()
    else:
        rec["next_start"] = end
        rec["stopped"] = "complete"
    save()
    progress("fuzz done:")
    log("coverage: " + ", ".join(f"{t} {n}" for t, n in sorted(rec["tags"].items())))
    if rec["stopped"] != "complete":
        why = {"budget": f"stopped before the {budget_s:.0f} s budget", "fatal": "stopped: CUDA error"}[rec["stopped"]]
        log(f"{why}; resume: bash benchmarks/gpu.sh verify fuzz {rec['total']} --seed {seed} --start {rec['next_start']}"
            f"  (or python benchmarks/fuzz.py --seed {seed} --start {rec['next_start']} --count {end - rec['next_start']})")
    return rec


def _shrunk(p: Problem, exc: BaseException, checker, budget_s: float, clock, log) -> dict:
    """Shrink a failing problem: the fields of the failure record it adds."""
    if budget_s < 5:
        log("   (not shrunk: no time left in the budget; run the reproduction alone to shrink it)")
        return {}
    kind = type(exc)

    def fails(c: Problem) -> bool:
        try:
            checker(c)
        except Exception as e:  # the same kind of failure counts; a lost context ends the search
            if is_fatal(e):
                raise
            return type(e) is kind
        return False

    try:
        small, checks = shrink(p, fails, budget_s, clock=clock)
    except Exception as e:
        log(f"   (shrinking stopped: {_error_text(e)})")
        return {}
    if small == p:
        log(f"   (no smaller failing problem in {checks} tries)")
        return {}
    log(f"   smallest failing problem after {checks} tries: {describe(small)}\n   reproduce it: {repro_problem(small)}")
    return dict(shrunk=small.to_json(), shrunk_label=describe(small), shrunk_repro=repro_problem(small))


# ------------------------------------------------------------------------------------------------
# The command line


def _gpu_kernels() -> List[str]:
    from gpu_util import KERNELS

    return list(KERNELS)


def one(p: Problem, shrink_s: float, show: bool, log=print, checker=check) -> int:
    """Print problem ``p``, run it (unless ``show``) and shrink it if it fails. Returns the exit status."""
    log(describe(p))
    log(f"problem: {p.to_json()}")
    if show:
        return 0
    try:
        err = checker(p)
    except Exception as exc:
        log(f"FAILED: {_error_text(exc)}")
        if not is_fatal(exc):
            _shrunk(p, exc, checker, shrink_s, time.monotonic, log)
        return 1
    log(f"ok: worst per-slice relative error {err:.3g}")
    return 0


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="fuzz.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, help="default: the seed of the records in --out, else a random one")
    ap.add_argument("--start", type=int, help="first index (default: the first one the records in --out lack, else 0)")
    ap.add_argument("--count", type=int, help="problems from --start")
    ap.add_argument("--total", type=int, help="run up to this index (exclusive) instead of --count")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop before this many seconds (default 450)")
    ap.add_argument("--out", help="folder of the JSON records (resume reads them)")
    ap.add_argument("--index", type=int, help="run problem INDEX of --seed alone (shrunk if it fails)")
    ap.add_argument("--problem", help="run this problem (JSON, as printed by a failure) alone")
    ap.add_argument("--show", action="store_true", help="print the problems without running them (no GPU needed)")
    ap.add_argument("--remaining", action="store_true", help="print how many of [0, --total) the records in --out lack")
    ap.add_argument("--shrink-s", type=float, default=60.0, help="time to shrink each failure (default 60)")
    ap.add_argument("--every", type=int, default=50, help="a progress line every N problems (default 50)")
    ap.add_argument("--kernels", help="comma-separated (default: every kernel this GPU runs)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    """``python benchmarks/fuzz.py``: see ``--help``. Exit status 1 when a problem failed, 2 when
    the CUDA context was lost, else 0 (also when the range stopped at the budget: resume it)."""
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.problem is not None:
        return one(Problem.from_json(a.problem), a.shrink_s, a.show)
    from _verify import fuzz_outcomes, load_records, resume_start

    records = load_records(a.out, "fuzz") if a.out else []
    others = [r for r in records if r.get("schedule") != schedule_names()]
    if others:
        print(f"fuzz.py: {len(others)} record(s) in {a.out} are of another schedule (an older commit): "
              "not resumed from", file=sys.stderr)
        records = [r for r in records if r not in others]
    seed = a.seed
    if seed is None:
        seed = records[-1]["seed"] if records else int(np.random.default_rng().integers(0, 2**31))
    if a.index is not None:
        return one(draw(seed, a.index), a.shrink_s, a.show)
    done = {i for (_, i) in fuzz_outcomes(records, seed)}
    if a.remaining:
        print(sum(1 for i in range(a.total or 0) if i not in done))
        return 0
    if a.count is None and a.total is None:
        print("fuzz.py: give --count or --total", file=sys.stderr)
        return 2
    if a.start is not None:
        start = a.start
    else:  # the first index the records lack
        start = resume_start(done, a.total if a.total is not None else max(done, default=-1) + 1)
    end = start + a.count if a.count is not None else a.total
    if a.show:
        for i in range(start, end):
            print(f"{i}: {describe(draw(seed, i))}")
        return 0
    kernels = a.kernels.split(",") if a.kernels else _gpu_kernels()
    rec = run_range(seed, start, end, budget_s=a.budget_s, kernels=kernels, out_dir=a.out, shrink_s=a.shrink_s,
                    every=a.every, skip=done if a.start is None else (), total=a.total)
    return 2 if rec["fatal"] else 1 if rec["failures"] else 0
