"""Static SASS statistics of our kernel families and of a kernel in a compiled library, without a GPU.

For a kernel family of ``mla_cupy._registry.all_families()``, compiled here with NVRTC
(``mla_cupy.jit.compile_offline_with_log``, ptxas' ``-v`` report included), or for one kernel of a
shared library's fatbin (FlashAttention-3's ``fa3_fwd/_C.abi3.so``), the tool prints per kernel:

* resources: registers, stack frame and local memory (``cuobjdump -res-usage``), static shared
  memory (dynamic shared memory is set at launch and is not in the binary), ptxas' spill stores and
  loads and its advisories (ours only: a library carries no ptxas log), the ``setmaxnreg`` values in
  the code, and the highest register the code names;
* per loop, the instructions by opcode class: GMMA (HGMMA / QGMMA / IGMMA, and mma.sync), MUFU.EX2,
  other MUFU, FFMA, FMUL, FADD, FMNMX, LDS/STS (with LDSM / STSM), LDG/STG (and other global
  memory), LDL/STL (local memory: spills), R2UR, other uniform-datapath ops (``U*`` and S2UR), integer ALU
  (IMAD, IADD3, LOP3, SHF, ISETP, LEA, SEL, PRMT, ...), BAR/SYNC (barriers, mbarrier ``SYNCS``,
  fences, ``WARPGROUP`` arrive / wait), BRA (branches, calls, exits), other, total.

Loops are the natural loops of the control-flow graph (a backward branch whose target dominates
it; back edges to one header form one loop). A loop's counts are the instructions of its body
between its header and its last backward branch (nested loops included once); body blocks that
the compiler placed elsewhere (the retry paths of mbarrier waits, laid out after the kernel's end)
are reported apart as ``cold``. ``inner`` marks the innermost loops; loops of at most
:data:`SMALL_LOOP` instructions without MMA (try-wait retries, the compiler's ``BRA.U.ANY`` loops)
are hidden unless ``--all-loops``. The consumer main loop is, of the loops with MMA that hold no
other loop with MMA (a rare path's loop without MMA inside, such as a zeroing loop, does not count),
the one with the most GMMA, the shortest of several such (the mask-free copy where masked and
unmasked iterations have loops of their own, as in FlashAttention-3).
Counts are static, per warp and per iteration of every path of the body: a masked path inside the
body counts as much as the unmasked one. The shortest and the longest way round the body (from the
header back to it, inner loops once, out-of-line blocks where a way passes them) are counted apart,
and side by side the shortest way's classes too: where masked and mask-free iterations share one
body, the shortest way is the mask-free path.

Why: instruction counts per loop, registers and spills are the first thing to compare with a faster
kernel, and every change to a kernel moves them; this needs no GPU and takes seconds.

Usage (``cuobjdump`` from CUDA, ``PATH``, ``$CUOBJDUMP`` or the pip package
``nvidia-cuda-cuobjdump``; ``c++filt`` demangles library names when it is on ``PATH``)::

    python benchmarks/sass.py --list-families
    python benchmarks/sass.py --family "mla_prefill_sm90<bf16, CausalMask, 16-bit>"
    python benchmarks/sass.py --family "mla_prefill_sm90<bf16, CausalMask, 16-bit>" --family-kernel "float"
    python benchmarks/sass.py --family "mla_prefill_sm90<bf16, CausalMask, 16-bit>" --define MLA_SM90_SMEM_EPILOGUE=0
    python benchmarks/sass.py --so fa3/fa3_fwd/_C.abi3.so --list --kernel FlashAttnFwdSm90 --kernel "C<192>"
    # FA3's bf16 kernel for flash_attn_varlen_func(causal=True) at head sizes 192 / 128 with as many
    # K as Q heads; the booleans after Sm90: Is_causal, Is_local, Has_softcap, Varlen, PagedKVNonTMA,
    # AppendKV, HasQv, MmaPV_is_RS, IntraWGOverlap, PackGQA, Split, V_colmajor
    FA3_BF16=(--so fa3/fa3_fwd/_C.abi3.so --kernel FlashAttnFwdSm90 --kernel "C<192> >, 128,
      cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false, false, true, false, false, false,
      true, true, false, false, false>")   # (one line)
    python benchmarks/sass.py "${FA3_BF16[@]}"
    # side by side: both given; our family's first kernel (or the first --family-kernel keeps),
    # the main loop of each (or --ours-loop / --theirs-loop ADDRESS)
    python benchmarks/sass.py --family "mla_prefill_sm90<bf16, CausalMask, 16-bit>" "${FA3_BF16[@]}"

FlashAttention-4's SM90 kernels (the ``flash-attn-4`` CuTe DSL package) are compiled here, without a
GPU, under torch's FakeTensorMode: ``--fa4 fwd`` or ``--fa4 bwd`` (causal unless ``--fa4-no-mask``),
with ``--fa4-python`` naming an interpreter that has flash-attn-4, nvidia-cutlass-dsl (its CUDA 13
libraries) and torch, e.g. a virtual environment made with ``--system-site-packages``::

    python benchmarks/sass.py --family "mla_backward_sm90<bf16, CausalMask>" --fa4 bwd --fa4-python fa4env/bin/python

``--kernel`` may be given several times (every substring must appear in the demangled or the
mangled name); when several kernels still match, ``--index N`` picks one of the listed matches.
``--json`` prints the same content as JSON. As a module: :func:`analyze_family`,
:func:`analyze_library`, :func:`main_loop`, :func:`format_kernel`, :func:`format_side_by_side`.
The fa3-fwd wheel (``pip download --no-deps fa3-fwd==0.0.3``, README) unzips to ``fa3_fwd/_C.abi3.so``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

#: A loop of at most this many instructions and no MMA is "small" (hidden unless --all-loops).
SMALL_LOOP = 16

#: Opcode classes, in the order of the table's columns.
CLASSES = ("GMMA", "EX2", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "LDS/STS", "LDG/STG", "LDL/STL",
           "R2UR", "U*", "INT", "SYNC", "BRA", "other")

_INT = frozenset("IMAD IMAD32I IADD3 IADD IADD32I LOP3 LOP LOP32I SHF SHL SHR ISETP LEA IMNMX VIMNMX VIMNMX3 "
                 "VIADD VIADDMNMX SEL IABS POPC FLO BREV SGXT BMSK PRMT ISCADD IMUL IMUL32I BFE BFI IDP "
                 "VABSDIFF VABSDIFF4".split())
_SYNC = frozenset("BAR SYNCS MEMBAR FENCE WARPGROUP DEPBAR ARRIVES ERRBAR WARPSYNC LDGDEPBAR".split())
_BRANCH = frozenset("BRA BRX JMP JMX CALL RET EXIT".split())
_SHARED = frozenset("LDS STS LDSM STSM ATOMS".split())
_GLOBAL = frozenset("LDG STG LDGSTS ATOMG ATOM RED REDG LD ST".split())
_LOCAL = frozenset("LDL STL".split())
_MMA = frozenset("HMMA IMMA QMMA DMMA BMMA".split())


def classify(opcode: str) -> str:
    """The class (one of :data:`CLASSES`) of a SASS opcode with its modifiers, e.g.
    ``"HGMMA.64x128x16.F32.BF16"`` -> ``"GMMA"``, ``"MUFU.EX2"`` -> ``"EX2"``."""
    base = opcode.split(".", 1)[0]
    if base.endswith("GMMA") or base in _MMA:
        return "GMMA"
    if base == "MUFU":
        return "EX2" if ".EX2" in opcode else "MUFU"
    if base in ("FFMA", "FMUL", "FADD", "FMNMX"):
        return base
    if base in _SHARED:
        return "LDS/STS"
    if base in _GLOBAL:
        return "LDG/STG"
    if base in _LOCAL:
        return "LDL/STL"
    if base == "R2UR":
        return "R2UR"
    if base.startswith("U") or base == "S2UR":
        return "U*"
    if base in _INT:
        return "INT"
    if base in _SYNC:
        return "SYNC"
    if base in _BRANCH:
        return "BRA"
    return "other"


# ---------------------------------------------------------------------------------------------
# tools
# ---------------------------------------------------------------------------------------------
def find_tool(name: str) -> str:
    """Path of a CUDA binary tool: ``$NAME`` (upper case), ``PATH``, ``$CUDA_HOME/bin``, or a pip
    package's ``nvidia/*/bin`` (``nvidia-cuda-cuobjdump``).

    Raises
    ------
    FileNotFoundError
        None of these has it.
    """
    override = os.environ.get(name.upper())
    if override:
        return override
    found = shutil.which(name)
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidates = [Path(home) / "bin" / name]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(Path(root).glob(f"*/bin/{name}"))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise FileNotFoundError(f"{name} not found (${name.upper()}, PATH, $CUDA_HOME/bin, pip's nvidia/*/bin): "
                            f"pip install nvidia-cuda-{name}, or put CUDA's bin directory on PATH")


def _run(args: Sequence[str], cwd: Optional[str] = None) -> str:
    res = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} ... failed ({res.returncode}): {res.stderr.strip()[:2000]}")
    return res.stdout


def demangle(names: Sequence[str]) -> List[str]:
    """C++ names demangled by ``c++filt`` (one process for all); the names as given without it."""
    tool = shutil.which("c++filt")
    if not tool or not names:
        return list(names)
    out = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else list(names)


# ---------------------------------------------------------------------------------------------
# SASS
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Instr:
    """One SASS instruction: address, guard predicate ("" when none), opcode with its modifiers,
    operands."""

    addr: int
    pred: str
    opcode: str
    operands: str


_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PRED = re.compile(r"^(@!?U?P[0-7T])\s+")
_HEX = re.compile(r"0x[0-9a-f]+")
_REG = re.compile(r"\bR(\d+)\b")


def parse_sass(text: str) -> Dict[str, List[Instr]]:
    """``cuobjdump -sass`` output -> {function name: its instructions in address order}."""
    funcs: Dict[str, List[Instr]] = {}
    current: Optional[List[Instr]] = None
    for line in text.splitlines():
        if "Function :" in line:
            current = funcs.setdefault(line.split("Function :", 1)[1].strip(), [])
            continue
        m = _LINE.match(line)
        if m is None or current is None:
            continue
        body = m.group(2)
        pm = _PRED.match(body)
        pred = pm.group(1) if pm else ""
        body = body[pm.end():] if pm else body
        opcode, _, operands = body.partition(" ")
        current.append(Instr(int(m.group(1), 16), pred, opcode, operands.strip()))
    return funcs


def _conditional(ins: Instr) -> bool:
    """Whether control may also fall through: a guard predicate other than ``@PT``, or
    ``BRA.DIV`` (taken only when the warp diverged)."""
    return (ins.pred not in ("", "@PT")) or ".DIV" in ins.opcode


def _blocks(instrs: List[Instr]) -> Tuple[List[Tuple[int, int]], List[List[int]]]:
    """Basic blocks as (first, last + 1) instruction indices, and each block's successors."""
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    targets: Dict[int, Optional[int]] = {}
    leaders = {0}
    for i, ins in enumerate(instrs):
        base = ins.opcode.split(".", 1)[0]
        if base in _BRANCH:
            if base in ("BRA", "JMP"):  # direct: the target is the last address operand
                hexes = _HEX.findall(ins.operands)
                t = index.get(int(hexes[-1], 16)) if hexes else None
                targets[i] = t
                if t is not None:
                    leaders.add(t)
            if i + 1 < len(instrs):
                leaders.add(i + 1)
    starts = sorted(leaders)
    spans = [(s, (starts[k + 1] if k + 1 < len(starts) else len(instrs))) for k, s in enumerate(starts)]
    block_of = {s: k for k, (s, _) in enumerate(spans)}
    succs: List[List[int]] = []
    for s, e in spans:
        last = instrs[e - 1]
        base = last.opcode.split(".", 1)[0]
        out: List[int] = []
        falls = True  # CALL returns; an indirect BRX / JMX has no known successor here
        if base in _BRANCH and base != "CALL":
            if base in ("BRA", "JMP") and targets.get(e - 1) is not None:
                out.append(block_of[targets[e - 1]])
            falls = _conditional(last)
        if falls and e < len(instrs):
            out.append(block_of[e])
        succs.append(out)
    return spans, succs


def _dominators(succs: List[List[int]]) -> Tuple[List[Optional[int]], List[int]]:
    """Immediate dominators (Cooper, Harvey and Kennedy) from block 0, and the reverse postorder."""
    n = len(succs)
    order: List[int] = []
    seen = [False] * n
    stack = [(0, iter(succs[0]))] if n else []
    if n:
        seen[0] = True
    while stack:
        node, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            order.append(node)
            stack.pop()
        elif not seen[nxt]:
            seen[nxt] = True
            stack.append((nxt, iter(succs[nxt])))
    rpo = order[::-1]
    pos = {b: i for i, b in enumerate(rpo)}
    preds: List[List[int]] = [[] for _ in range(n)]
    for b in rpo:
        for s in succs[b]:
            preds[s].append(b)
    idom: List[Optional[int]] = [None] * n
    if n:
        idom[0] = 0
    changed = True
    while changed:
        changed = False
        for b in rpo[1:]:
            new = None
            for p in preds[b]:
                if idom[p] is None:
                    continue
                if new is None:
                    new = p
                    continue
                a, c = p, new
                while a != c:
                    while pos[a] > pos[c]:
                        a = idom[a]
                    while pos[c] > pos[a]:
                        c = idom[c]
                new = a
            if new is not None and idom[b] != new:
                idom[b] = new
                changed = True
    return idom, rpo


def _dominates(idom: List[Optional[int]], a: int, b: int) -> bool:
    while True:
        if b == a:
            return True
        if b == 0 or idom[b] is None:
            return False
        b = idom[b]


@dataclass
class LoopReport:
    """One natural loop: ``start`` / ``end`` are the addresses of its header and of its last
    backward branch; ``classes`` / ``opcodes`` count its in-line body (``total`` instructions),
    ``cold`` the body instructions laid out elsewhere; ``gmma`` its MMA instructions; ``max_register``
    the highest register its in-line body names; ``depth`` 0 for an outermost loop. ``path_min`` /
    ``path_max``: the instructions of the shortest and the longest way from the header round to it
    (inner loops once, cold blocks where the way passes them), ``path_classes`` the shortest way's
    counts: where masked and mask-free iterations share a body, the shortest way is the mask-free
    one."""

    start: int
    end: int
    total: int
    cold: int
    gmma: int
    depth: int
    innermost: bool
    small: bool
    max_register: int
    classes: Dict[str, int]
    opcodes: Dict[str, int]
    path_min: int = 0
    path_max: int = 0
    path_classes: Dict[str, int] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.start:#06x}-{self.end:#06x}"


def _count(instrs: Iterable[Instr]) -> Tuple[Dict[str, int], Dict[str, int], int]:
    classes = Counter({c: 0 for c in CLASSES})
    opcodes: Counter = Counter()
    top = -1
    for ins in instrs:
        classes[classify(ins.opcode)] += 1
        opcodes[ins.opcode] += 1
        regs = [int(r) for r in _REG.findall(ins.operands)]
        if regs:
            top = max(top, max(regs))
    return {c: classes[c] for c in CLASSES}, dict(opcodes.most_common()), top


def _ways(instrs: List[Instr], spans, succs, idom, h: int, body: set, latches: List[int]):
    """(shortest, longest, the shortest's class counts): the ways through a loop's body from its
    header ``h`` to a latch, over the body's edges that are not back edges (an inner loop counts
    once), in instructions."""
    size = {b: spans[b][1] - spans[b][0] for b in body}
    dag = {b: [x for x in succs[b] if x in body and not _dominates(idom, x, b)] for b in body}
    order, state, stack = [], {}, [(h, 0)]
    while stack:  # depth-first postorder from the header
        b, i = stack.pop()
        state[b] = 1
        if i < len(dag[b]):
            stack.append((b, i + 1))
            x = dag[b][i]
            if x not in state:
                stack.append((x, 0))
        else:
            order.append(b)
    shortest, longest, prev = {h: size[h]}, {h: size[h]}, {h: None}
    for b in reversed(order):  # topological
        if b not in shortest:
            continue
        for x in dag[b]:
            if shortest[b] + size[x] < shortest.get(x, 1 << 60):
                shortest[x], prev[x] = shortest[b] + size[x], b
            longest[x] = max(longest.get(x, -1), longest[b] + size[x])
    ends = [u for u in latches if u in shortest]
    if not ends:
        return 0, 0, {}
    end = min(ends, key=lambda u: shortest[u])
    way, b = [], end
    while b is not None:
        way.append(b)
        b = prev[b]
    classes, _, _ = _count(ins for b in way for ins in instrs[spans[b][0]:spans[b][1]])
    return shortest[end], max(longest[u] for u in ends), classes


def find_loops(instrs: List[Instr]) -> List[LoopReport]:
    """The natural loops of one function's instructions, in address order (see the module
    docstring for what is counted)."""
    if not instrs:
        return []
    spans, succs = _blocks(instrs)
    idom, rpo = _dominators(succs)
    reachable = set(rpo)
    preds: List[List[int]] = [[] for _ in spans]
    for b in reachable:
        for s in succs[b]:
            preds[s].append(b)
    bodies: Dict[int, set] = {}
    latches: Dict[int, List[int]] = {}
    for u in reachable:
        for h in succs[u]:
            if _dominates(idom, h, u):
                body = bodies.setdefault(h, {h})
                latches.setdefault(h, []).append(u)
                work = [u] if u != h else []
                while work:
                    x = work.pop()
                    if x not in body:
                        body.add(x)
                        work.extend(p for p in preds[x] if p in reachable)
    loops = []
    for h, body in bodies.items():
        start = instrs[spans[h][0]].addr
        end = max(instrs[spans[u][1] - 1].addr for u in latches[h])
        inline, cold = [], 0
        for b in body:
            s, e = spans[b]
            for ins in instrs[s:e]:
                if start <= ins.addr <= end:
                    inline.append(ins)
                else:
                    cold += 1
        inline.sort(key=lambda i: i.addr)
        classes, opcodes, top = _count(inline)
        short, long_, way = _ways(instrs, spans, succs, idom, h, body, latches[h])
        loops.append((h, body, LoopReport(start, end, len(inline), cold, classes["GMMA"], 0, False,
                                          len(inline) <= SMALL_LOOP and classes["GMMA"] == 0, top, classes, opcodes,
                                          short, long_, way)))
    for h, body, rep in loops:
        rep.depth = sum(1 for h2, b2, _ in loops if h2 != h and h in b2)
        rep.innermost = not rep.small and not any(h2 != h and h2 in body and not r2.small for h2, _, r2 in loops)
    return sorted((rep for _, _, rep in loops), key=lambda r: r.start)


# ---------------------------------------------------------------------------------------------
# resource usage
# ---------------------------------------------------------------------------------------------
def parse_res_usage(text: str) -> List[Dict[str, Dict[str, int]]]:
    """``cuobjdump -res-usage`` output -> per ELF (in order), {function: {"REG": .., "STACK": ..,
    "SHARED": .., "LOCAL": .., ...}}. Output for one cubin is one ELF."""
    elves: List[Dict[str, Dict[str, int]]] = []
    current: Optional[Dict[str, Dict[str, int]]] = None
    name = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("Fatbin elf code") or current is None and s.startswith("Resource usage"):
            current = {}
            elves.append(current)
        elif s.startswith("Function ") and s.endswith(":"):
            name = s[len("Function "):-1]
        elif name is not None and s.startswith("REG:"):
            current[name] = {k: int(v) for k, v in re.findall(r"([A-Z_]+(?:\[\d+\])?):(\d+)", s)}
            name = None
    return elves


# ---------------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------------
@dataclass
class KernelReport:
    """Everything the tool prints about one kernel. ``resources`` comes from ``cuobjdump
    -res-usage`` (REG, STACK, SHARED, LOCAL, ...); ``ptxas`` from ptxas' report (stack frame, spill
    stores and loads; ours only) and ``advisories`` from its log; ``setmaxnreg`` are the register
    counts the code asks for; ``classes`` count the whole kernel."""

    name: str
    label: str
    source: str
    resources: Dict[str, int]
    ptxas: Optional[Dict[str, int]]
    advisories: List[str]
    setmaxnreg: List[int]
    max_register: int
    total: int
    classes: Dict[str, int]
    loops: List[LoopReport] = field(default_factory=list)


def _report(name: str, label: str, source: str, instrs: List[Instr], resources: Dict[str, int],
            ptxas=None, advisories: Sequence[str] = ()) -> KernelReport:
    classes, _, top = _count(instrs)
    maxreg = sorted({int(h, 16) for i in instrs if i.opcode.startswith("USETMAXREG") for h in _HEX.findall(i.operands)})
    return KernelReport(name, label, source, resources, ptxas, list(advisories), maxreg, top, len(instrs), classes,
                        find_loops(instrs))


def main_loop(report: KernelReport, start: Optional[int] = None) -> LoopReport:
    """The loop at address ``start``, or of the loops with MMA that hold no other such loop the one
    with the most GMMA (of several, the shortest: the mask-free copy when masked iterations have a
    loop of their own).

    Raises
    ------
    ValueError
        No loop starts at ``start``, or the kernel has no loop.
    """
    if start is not None:
        for lp in report.loops:
            if lp.start == start:
                return lp
        raise ValueError(f"no loop starts at {start:#x} in {report.label[:120]}; loops: "
                         f"{[lp.where for lp in report.loops]}")
    if not report.loops:
        raise ValueError(f"{report.label[:120]} has no loop")
    mma = [lp for lp in report.loops if lp.gmma > 0]
    # innermost among the loops with MMA: a cold loop without MMA inside one (a rare path's
    # zeroing loop) does not make it an outer loop
    inner = [lp for lp in mma if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in mma)]
    inner = inner or [lp for lp in report.loops if lp.innermost] or report.loops
    return max(inner, key=lambda lp: (lp.gmma, -lp.total))


def _families(arch: str):
    from mla_cupy import _registry as reg

    return [(a, fam, reg.family_label(fam)) for a, fam in reg.all_families() if a == arch]


def find_family(label: str, arch: str = "sm_90a"):
    """The (filename, name expressions) of our family whose label is ``label`` or, failing that,
    the only one whose label contains it.

    Raises
    ------
    ValueError
        No family, or several, match.
    """
    fams = _families(arch)
    exact = [f for _, f, lab in fams if lab == label]
    if exact:
        return exact[0]
    some = [(f, lab) for _, f, lab in fams if label in lab]
    if len(some) != 1:
        known = "\n  ".join(lab for _, _, lab in fams)
        raise ValueError(f"{len(some)} families for {arch} match {label!r}; the families:\n  {known}")
    return some[0][0]


def analyze_family(label: str, arch: str = "sm_90a", kernel: Sequence[str] = (),
                   defines: Optional[Dict[str, str]] = None) -> List[KernelReport]:
    """Compile our family ``label`` (:func:`find_family`) for ``arch`` with NVRTC, with the
    compile-time switches ``defines`` (``{"MLA_SM90_SMEM_EPILOGUE": "0"}``: ``#define`` lines before the
    source, as ``MLA_CUPY_DEFINES`` sets them for a process), and report its kernels in the
    family's order, those whose name expression or mangled name contains every string of
    ``kernel``."""
    from mla_cupy import jit
    from mla_cupy._registry import family_label

    filename, names = find_family(label, arch)
    build = jit.compile_offline_with_log(filename, names, arch, defines=defines)
    ptxas = build.functions()
    tool = find_tool("cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "family.cubin")
        with open(path, "wb") as f:
            f.write(build.binary)
        sass = parse_sass(_run([tool, "-sass", path]))
        res = parse_res_usage(_run([tool, "-res-usage", path]))
    res = res[0] if res else {}
    switches = "".join(f", {k}={v}" for k, v in (defines or {}).items())
    source = f"{family_label((filename, names))} ({arch}, NVRTC{switches})"
    reports = []
    for expr in names:
        mangled = build.lowered.get(expr)
        if mangled not in sass or not all(k in expr or k in mangled for k in kernel):
            continue  # a global of the family (not a kernel), or filtered out
        p = ptxas.get(mangled)
        pt = None if p is None else {"registers": p.registers, "stack_frame": p.stack_frame,
                                     "spill_stores": p.spill_stores, "spill_loads": p.spill_loads}
        adv = [a for a in build.advisories() if mangled in a or "'" not in a]
        reports.append(_report(mangled, expr, source, sass[mangled], res.get(mangled, {}), pt, adv))
    if not reports:
        raise ValueError(f"no kernel of {source} matches {list(kernel)}; its kernels: {list(names)}")
    return reports


@dataclass(frozen=True)
class LibraryKernel:
    """A kernel of a library's fatbin: the ELF holding it (index from 1, name as ``cuobjdump
    -lelf`` gives it), its mangled and demangled names and its resource usage."""

    elf_index: int
    elf_name: str
    name: str
    demangled: str
    resources: Dict[str, int]


def library_kernels(so: str, substrings: Sequence[str] = ()) -> List[LibraryKernel]:
    """The kernels of the fatbin of ``so`` whose demangled or mangled name contains every string
    of ``substrings``, in fatbin order."""
    tool = find_tool("cuobjdump")
    elves = re.findall(r"ELF file\s+(\d+):\s+(\S+)", _run([tool, "-lelf", so]))
    res = parse_res_usage(_run([tool, "-res-usage", so]))
    if len(elves) != len(res):
        raise RuntimeError(f"cuobjdump lists {len(elves)} ELF files in {so} but reports resources of {len(res)}")
    flat = [(int(i), n, fn, r) for (i, n), fns in zip(elves, res) for fn, r in fns.items()]
    names = demangle([fn for _, _, fn, _ in flat])
    return [LibraryKernel(i, n, fn, d, r) for (i, n, fn, r), d in zip(flat, names)
            if all(s in d or s in fn for s in substrings)]


def analyze_library(so: str, substrings: Sequence[str], index: Optional[int] = None) -> KernelReport:
    """Report the one kernel of ``so`` that :func:`library_kernels` finds for ``substrings`` (or
    the ``index``-th of several).

    Raises
    ------
    ValueError
        No kernel matches, or several do and ``index`` does not pick one.
    """
    found = library_kernels(so, substrings)
    if index is not None:
        if not 0 <= index < len(found):
            raise ValueError(f"--index {index}: {len(found)} kernels match {list(substrings)}")
        found = [found[index]]
    if len(found) != 1:
        shown = "\n".join(f"  [{i}] {_short(k.demangled)}" for i, k in enumerate(found[:30]))
        raise ValueError(f"{len(found)} kernels of {so} match {list(substrings)}"
                         + (f" (more --kernel strings, or --index N):\n{shown}" if found else ""))
    k = found[0]
    tool = find_tool("cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        _run([tool, "-xelf", k.elf_name, os.path.abspath(so)], cwd=tmp)
        sass = parse_sass(_run([tool, "-sass", "-fun", k.name, os.path.join(tmp, k.elf_name)]))
    if k.name not in sass:
        raise RuntimeError(f"cuobjdump gave no SASS for {k.name[:200]} in ELF {k.elf_name}")
    return _report(k.name, k.demangled, f"{so} (ELF {k.elf_index}: {k.elf_name})", sass[k.name], k.resources)


#: FlashAttention-4's SM90 kernel compiled on a machine without a GPU: its CuTe DSL traces and
#: compiles under torch's FakeTensorMode once FLASH_ATTENTION_ARCH and CUTE_DSL_ARCH name the target,
#: and CUTE_DSL_KEEP=cubin leaves the binary in CUTE_DSL_DUMP_DIR. The shape is MLA's (192 / 128, 128
#: heads, one varlen sequence); the kernels do not depend on the lengths.
_FA4_COMPILE = """
import sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from flash_attn.cute import interface as fi
which, causal = sys.argv[1], sys.argv[2] == "1"
T, H = 4096, 128
with FakeTensorMode():
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt, device="cuda")
    q, k, v, cu = e(T, H, 192), e(T, H, 192), e(T, H, 128), e(2, dt=torch.int32)
    lens = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=T, max_seqlen_k=T)
    if which == "fwd":
        fi._flash_attn_fwd(q, k, v, softmax_scale=192 ** -0.5, causal=causal, return_lse=True, **lens)
    else:
        fi._flash_attn_bwd(q, k, v, e(T, H, 128), e(T, H, 128), e(H, T, dt=torch.float32),
                           softmax_scale=192 ** -0.5, causal=causal, **lens)
"""
#: The class name of FlashAttention-4's main SM90 kernel per direction, in its kernel and file names.
FA4_KERNELS = {"fwd": "FlashAttentionForwardSm90", "bwd": "FlashAttentionBackwardSm90"}


def analyze_fa4(which: str, causal: bool = True, python: Optional[str] = None) -> KernelReport:
    """FlashAttention-4's SM90 ``which`` ("fwd" or "bwd") kernel for MLA's head sizes, compiled here
    without a GPU by ``python`` (an interpreter with flash-attn-4, nvidia-cutlass-dsl and torch;
    default: this one), and reported as a library kernel.

    Raises
    ------
    ValueError
        ``which`` is neither "fwd" nor "bwd".
    RuntimeError
        The compile failed (its output's tail in the message) or left no kernel binary.
    """
    if which not in FA4_KERNELS:
        raise ValueError(f"--fa4 takes fwd or bwd, got {which!r}")
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
                   CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=tmp)
        r = subprocess.run([python or sys.executable, "-c", _FA4_COMPILE, which, "1" if causal else "0"],
                           env=env, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"FlashAttention-4's {which} kernel did not compile (rc {r.returncode}):\n"
                               f"{(r.stdout + r.stderr)[-3000:]}")
        found = sorted(f for f in os.listdir(tmp) if f.endswith(".cubin") and FA4_KERNELS[which] in f)
        if not found:
            raise RuntimeError(f"the compile left no {FA4_KERNELS[which]} binary in {tmp}: {os.listdir(tmp)}")
        path = os.path.join(tmp, "fa4_" + which + ".cubin")
        shutil.copyfile(os.path.join(tmp, found[0]), path)
        rep = analyze_library(path, [FA4_KERNELS[which]])
    mask = "causal" if causal else "no mask"
    return replace(rep, source=f"FlashAttention-4 SM90 {which}, 192 / 128, {mask} (compiled without a GPU)")


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------
def _short(name: str, width: int = 400) -> str:
    return name if len(name) <= width else name[:width - 5] + " ..."


def _table(head: List[str], rows: List[List[str]]) -> List[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"
    return [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows]


def _reg(top: int) -> str:
    return f"R{top}" if top >= 0 else "-"


def _other(lp: LoopReport, n: int = 8) -> str:
    other = Counter()
    for op, c in lp.opcodes.items():
        if classify(op) == "other":
            other[op.split(".", 1)[0]] += c
    return ", ".join(f"{op} {c}" for op, c in other.most_common(n))


def format_kernel(rep: KernelReport, all_loops: bool = False) -> str:
    """A kernel's resources and its loops' class counts as text."""
    r = rep.resources
    lines = [f"kernel: {_short(rep.label)}", f"  from {rep.source}"]
    lines.append(f"  registers {r.get('REG', '?')} (launch), setmaxnreg {rep.setmaxnreg or '-'}, highest register "
                 f"named R{rep.max_register}; stack {r.get('STACK', '?')} B, local {r.get('LOCAL', '?')} B, "
                 f"static shared {r.get('SHARED', '?')} B; {rep.total} instructions")
    if rep.ptxas is not None:
        p = rep.ptxas
        lines.append(f"  ptxas: {p['registers']} registers, {p['stack_frame']} B stack frame, "
                     f"{p['spill_stores']} B spill stores, {p['spill_loads']} B spill loads")
    lines += [f"  advisory: {a}" for a in rep.advisories]
    shown = [lp for lp in rep.loops if all_loops or not lp.small]
    hidden = len(rep.loops) - len(shown)
    rows = [[lp.where, str(lp.depth), "*" if lp.innermost else "", str(lp.cold), _reg(lp.max_register)]
            + [str(lp.classes[c]) for c in CLASSES] + [str(lp.total), str(lp.path_min), str(lp.path_max)]
            for lp in shown]
    lines += ["  loops (inner *: innermost; cold: body instructions laid out elsewhere, not counted; ways: the "
              "shortest and the longest way round the body)"]
    lines += ["  " + ln for ln in _table(["loop", "depth", "inner", "cold", "top reg", *CLASSES, "total",
                                          "shortest way", "longest way"], rows)]
    for lp in shown:
        if lp.innermost:
            lines.append(f"  {lp.where} other: {_other(lp) or '-'}")
    if hidden:
        lines.append(f"  ({hidden} small loops of <= {SMALL_LOOP} instructions without MMA not shown: --all-loops)")
    return "\n".join(lines)


def format_side_by_side(ours: KernelReport, ours_loop: LoopReport, theirs: KernelReport, theirs_loop: LoopReport,
                        names: Tuple[str, str] = ("ours", "theirs")) -> str:
    """Two loops' class counts side by side (the difference is theirs minus ours)."""
    a, b = names
    lines = [f"{a}: {_short(ours.label, 200)}", f"  loop {ours_loop.where}, {ours_loop.gmma} GMMA",
             f"{b}: {_short(theirs.label, 200)}", f"  loop {theirs_loop.where}, {theirs_loop.gmma} GMMA"]
    def pair(x: int, y: int) -> List[str]:
        return [str(x), str(y), f"{y - x:+d}"]

    wa, wb = ours_loop.path_classes, theirs_loop.path_classes
    rows = [[c, *pair(ours_loop.classes[c], theirs_loop.classes[c]), *pair(wa.get(c, 0), wb.get(c, 0))]
            for c in CLASSES]
    rows.append(["total", *pair(ours_loop.total, theirs_loop.total), *pair(ours_loop.path_min, theirs_loop.path_min)])
    rows.append(["longest way", "", "", "", *pair(ours_loop.path_max, theirs_loop.path_max)])
    rows.append(["cold", *pair(ours_loop.cold, theirs_loop.cold), "", "", ""])
    rows.append(["top register", _reg(ours_loop.max_register), _reg(theirs_loop.max_register), "", "", "", ""])
    rows.append(["setmaxnreg", "/".join(map(str, ours.setmaxnreg)) or "-", "/".join(map(str, theirs.setmaxnreg)) or "-",
                 "", "", "", ""])
    rows.append(["stack B", str(ours.resources.get("STACK", "?")), str(theirs.resources.get("STACK", "?")), "", "", "",
                 ""])
    lines.append("(body: every instruction of the loop's body; shortest way: those of the shortest way round it, the "
                 "mask-free path where masked iterations share the body)")
    lines += _table(["class", f"{a} body", f"{b} body", f"{b} - {a}", f"{a} shortest way", f"{b} shortest way",
                     f"{b} - {a}"], rows)
    lines += [f"{a} other: {_other(ours_loop) or '-'}", f"{b} other: {_other(theirs_loop) or '-'}"]
    for name, rep, lp in ((a, ours, ours_loop), (b, theirs, theirs_loop)):
        alike = [f"{o.where} ({o.total})" for o in rep.loops if o is not lp and o.innermost and o.gmma == lp.gmma]
        if alike:
            lines.append(f"{name}: other innermost loops with {lp.gmma} GMMA (instructions): {', '.join(alike)}")
    return "\n".join(lines)


def _as_json(rep: KernelReport) -> dict:
    d = asdict(rep)
    for lp, src in zip(d["loops"], rep.loops):
        lp["where"] = src.where
    return d


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", help="our family: its label (mla-cupy compile --list) or a unique part of it")
    ap.add_argument("--family-kernel", action="append", default=[],
                    help="keep our kernels whose name expression contains this (repeatable)")
    ap.add_argument("--arch", default="sm_90a", help="target of our family (default sm_90a)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="compile our family with this switch (kernels/sm90/config.cuh; repeatable), "
                         "e.g. --define MLA_SM90_SMEM_EPILOGUE=0")
    ap.add_argument("--list-families", action="store_true", help="list our families for --arch and exit")
    ap.add_argument("--so", help="a shared library whose fatbin holds the other kernel (fa3_fwd/_C.abi3.so)")
    ap.add_argument("--kernel", action="append", default=[],
                    help="part of the library kernel's demangled or mangled name (repeatable: all must match)")
    ap.add_argument("--index", type=int, default=None, help="pick the N-th of several matching library kernels")
    ap.add_argument("--list", action="store_true", help="list the library's kernels that match --kernel and exit")
    ap.add_argument("--fa4", choices=sorted(FA4_KERNELS), default=None,
                    help="the other kernel is FlashAttention-4's SM90 forward or backward at 192 / 128, compiled "
                         "here without a GPU (needs flash-attn-4 and nvidia-cutlass-dsl: --fa4-python)")
    ap.add_argument("--fa4-python", default=None, metavar="PY",
                    help="the interpreter that has flash-attn-4 installed (default: this one)")
    ap.add_argument("--fa4-no-mask", action="store_true", help="FlashAttention-4's kernel without the causal mask")
    ap.add_argument("--ours-loop", type=lambda s: int(s, 0), default=None, help="side by side: our loop's start address")
    ap.add_argument("--theirs-loop", type=lambda s: int(s, 0), default=None,
                    help="side by side: the library kernel's loop start address")
    ap.add_argument("--all-loops", action="store_true", help=f"also the loops of <= {SMALL_LOOP} instructions without MMA")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    a = ap.parse_args(argv)
    try:
        if a.list_families:
            for _, fam, lab in _families(a.arch):
                print(f"{lab}    ({fam[0]}, {len(fam[1])} names)")
            return 0
        if a.so and a.list:
            found = library_kernels(a.so, a.kernel)
            if a.json:
                print(json.dumps([asdict(k) for k in found], indent=1))
                return 0
            for i, k in enumerate(found):
                print(f"[{i}] ELF {k.elf_index} REG {k.resources.get('REG')} STACK {k.resources.get('STACK')}: {_short(k.demangled)}")
            return 0
        if not a.family and not a.so and not a.fa4:
            ap.error("give --family, --so (with --kernel) or --fa4, or --family with one of the others for the "
                     "side-by-side view")
        if a.so and a.fa4:
            ap.error("give --so or --fa4, not both")
        if a.so and not a.kernel and a.index is None:
            ap.error("--so needs --kernel (see --list)")
        from mla_cupy.jit import parse_defines

        defines = parse_defines(",".join(a.define))
        ours = analyze_family(a.family, a.arch, a.family_kernel, defines) if a.family else []
        theirs = analyze_library(a.so, a.kernel, a.index) if a.so else None
        if a.fa4:
            theirs = analyze_fa4(a.fa4, not a.fa4_no_mask, a.fa4_python)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"sass.py: {exc}", file=sys.stderr)
        return 2
    if ours and theirs is not None:  # side by side: our first kernel's main loop against theirs
        names = ("ours", "fa4" if a.fa4 else (Path(a.so).parent.name or "theirs"))
        try:
            lo, lt = main_loop(ours[0], a.ours_loop), main_loop(theirs, a.theirs_loop)
        except ValueError as exc:
            print(f"sass.py: {exc}", file=sys.stderr)
            return 2
        if a.json:
            print(json.dumps({names[0]: _as_json(ours[0]), names[1]: _as_json(theirs),
                              "loops": {names[0]: lo.where, names[1]: lt.where}}, indent=1))
        else:
            print(format_side_by_side(ours[0], lo, theirs, lt, names))
        return 0
    reports = ours + ([theirs] if theirs is not None else [])
    if a.json:
        print(json.dumps([_as_json(r) for r in reports], indent=1))
    else:
        print("\n\n".join(format_kernel(r, a.all_loops) for r in reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
