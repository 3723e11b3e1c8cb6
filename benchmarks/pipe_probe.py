"""The Hopper kernel taken apart (``pipe_probe.cu``): the consumer loop without its loads, cycles per
key tile of the loop's parts alone and together, to tell what bounds the kernel's loop (the tensor
pipe, the softmax, the turns) apart from what its loads, barriers and work-tile boundaries add; and
the loads without the consumers (``l2-*`` and ``dram-*`` probes), the rate at which one CTA per SM
fills a ring of key-tile stages from L2 or DRAM, alone or against the tensor time a tile feeds.

Every probe runs one CTA per SM, each consumer warpgroup ``--iters`` key tiles on tiles already in
shared memory; the result is cycles per key tile (``clock64``: independent of the SM clock, which
the power cap moves), the median over CTAs of their slowest consumer, and the SM clock the run saw
(cycles over ``globaltimer`` nanoseconds). "pipe" is the tensor pipe's share of those cycles at the
full wgmma rate: a consumer's key tile is 10 e4m3 wgmma m64n128k32 (S 6, P V 4), in the per-token
variant (``fp8-*``: S's rope in 16 bits) 4 e4m3 and 4 16-bit m64n128k16 for S beside P V's 4, or 20
16-bit m64n128k16 (S 12, P V 8), 64 cycles each for the SM.

A load probe reports cycles per tile, bytes per cycle and SM taken in (and read from L2: a cluster
sharing by multicast reads each tile once), and the whole card's intake in TB/s (bytes of all CTAs
over the launch's wall time, first start to last end); CTAs of clusters that waited for SMs (a later
wave) are counted as late and left out of the cycles per tile.

With ``--energy S`` each probe also runs back to back for about S seconds with the board's energy
counter read around that window (``ab.py``'s ``energy_window``), after a second of the idle board's
power: a loop probe's nanojoules per key tile and picojoules per attention FLOP, a load probe's
nanojoules per tile and picojoules per byte, to set beside the kernel's joules per call (``ab.py
--energy``) over its FLOPs: what share of the kernel's energy its loop's GEMMs and softmax take, and
what its loads do. Under the power cap a kernel's time is its energy over the cap's watts.

Usage (GPU)::

    PYTHONPATH=. python3 benchmarks/pipe_probe.py [--probes NAME,...] [--iters N] [--json FILE]

``--check`` compiles every probe for sm_90a with NVRTC (no GPU) and fails on spills or serialized
wgmma, as the kernel's own compile test does. ``--list`` prints the probes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

from mla_cupy import jit
from mla_cupy.dims import DQK, DV

SOURCE = Path(__file__).with_name("pipe_probe.cu")
GEMMS, SOFTMAX, NO_SCALES, CONST_SCALES, ROWSUM_MMA, EXP_BYTES = 1, 2, 4, 8, 16, 32  # kParts bits (pipe_probe.cu)
WGMMA_CYCLES = 64      # one m64n128k32 e4m3 or m64n128k16 16-bit wgmma at the full rate of an SM


@dataclass(frozen=True)
class Probe:
    name: str
    variant: str       # traits type of kernels/sm90/config.cuh
    consumers: int     # the variant's consumer warpgroups
    parts: int         # GEMMS | SOFTMAX (fp8 | NO_SCALES: without the key scales' loads and multiplies;
                       # | CONST_SCALES: their multiplies by constants, without the loads;
                       # | ROWSUM_MMA: the row sums by P times ones on the tensor pipe, not FADD;
                       # with it | EXP_BYTES: P's e4m3 bytes from the exponent, MLA_SM90_FP8_EXP_BYTES)
    turns: int = 0     # 0 none; three consumers: 1 P V + its completion + S, 2 P V's issue (MLA_SM90_FP8_TURNS),
                       # 3 S and P V issued together, both in flight (fp8 on 96-key tiles)
    active: int = 0    # consumers that run (0: all)

    @property
    def runners(self) -> int:
        return self.active or self.consumers

    @property
    def expression(self) -> str:
        return f"probe::pipe_probe<{self.variant}, {self.parts}, {self.turns}, {self.runners}>"

    @property
    def keys(self) -> int:
        """Keys of the variant's key tile (Fp8K96: 96, else 128)."""
        return 96 if "K96" in self.variant else 128

    @property
    def tensor_cycles(self) -> int:
        """Tensor-pipe cycles of one key tile of all running consumers at the full rate: S's k-steps
        of N = keys columns (N / 2 cycles each), P V's keys / k k-steps of 128 columns (64 each) and,
        with ROWSUM_MMA, as many of 8 columns (4 each)."""
        if not self.parts & GEMMS:
            return 0
        fp8 = "E4m3" in self.variant or "Fp8" in self.variant
        # S in wgmma of 64 cycles: all-e4m3 6, per token 8 (4 e4m3 over the nope, 4 16-bit over the rope), 16-bit 12
        s_steps, k = (6 if "E4m3" in self.variant else 8, 32) if fp8 else (12, 16)
        rowsum = self.keys // k * 8 // 2 if self.parts & ROWSUM_MMA else 0  # m64n8k32 per P V k-step: 4 cycles
        return self.runners * (s_steps * self.keys // 2 + self.keys // k * WGMMA_CYCLES + rowsum)

    @property
    def flops(self) -> int:
        """Attention FLOPs of one key tile of all running consumers (S and P V of 64 rows each, the
        kernel's useful work; 0 without GEMMS)."""
        return self.runners * 64 * self.keys * (DQK + DV) * 2 if self.parts & GEMMS else 0


E4M3 = "mla::sm90::Wide<mla::sm90::VariantE4m3>"
FP8 = "mla::sm90::Wide<mla::sm90::VariantFp8>"  # per token: S's rope by 16-bit wgmma
B16 = "mla::sm90::Variant16<__nv_bfloat16>"
FP8K96 = "probe::Fp8K96"  # per token on 96-key tiles (S, P and O apart in 160 registers; no kernel)
PROBES: Dict[str, Probe] = {p.name: p for p in (
    Probe("e4m3-gemm", E4M3, 3, GEMMS, turns=1),
    Probe("e4m3-gemm-noturns", E4M3, 3, GEMMS),
    Probe("e4m3-softmax-1wg", E4M3, 3, SOFTMAX, active=1),
    Probe("e4m3-softmax", E4M3, 3, SOFTMAX),
    Probe("e4m3-loop-1wg", E4M3, 3, GEMMS | SOFTMAX, active=1),
    Probe("e4m3-loop", E4M3, 3, GEMMS | SOFTMAX, turns=1),
    Probe("e4m3-loop-turns2", E4M3, 3, GEMMS | SOFTMAX, turns=2),
    Probe("e4m3-loop-noturns", E4M3, 3, GEMMS | SOFTMAX),
    Probe("e4m3-softmax-noscales", E4M3, 3, SOFTMAX | NO_SCALES),
    Probe("e4m3-loop-noscales", E4M3, 3, GEMMS | SOFTMAX | NO_SCALES, turns=1),
    Probe("e4m3-loop-constscales", E4M3, 3, GEMMS | SOFTMAX | CONST_SCALES, turns=1),
    Probe("e4m3-softmax-rowsum", E4M3, 3, SOFTMAX | ROWSUM_MMA),
    Probe("e4m3-loop-rowsum", E4M3, 3, GEMMS | SOFTMAX | ROWSUM_MMA, turns=1),
    Probe("e4m3-loop-rowsum-noscales", E4M3, 3, GEMMS | SOFTMAX | ROWSUM_MMA | NO_SCALES, turns=1),
    Probe("e4m3-softmax-bytes", E4M3, 3, SOFTMAX | ROWSUM_MMA | EXP_BYTES),
    Probe("e4m3-softmax-bytes-1wg", E4M3, 3, SOFTMAX | ROWSUM_MMA | EXP_BYTES, active=1),
    Probe("e4m3-loop-bytes", E4M3, 3, GEMMS | SOFTMAX | ROWSUM_MMA | EXP_BYTES, turns=1),
    Probe("e4m3-gemm-rowsum", E4M3, 3, GEMMS | ROWSUM_MMA, turns=1),
    Probe("fp8-gemm-rowsum", FP8, 3, GEMMS | ROWSUM_MMA, turns=1),
    Probe("fp8-loop-bytes-1wg", FP8, 3, GEMMS | SOFTMAX | ROWSUM_MMA | EXP_BYTES, active=1),
    Probe("fp8-loop-bytes", FP8, 3, GEMMS | SOFTMAX | ROWSUM_MMA | EXP_BYTES, turns=1),
    Probe("fp8k96-gemm-rowsum", FP8K96, 3, GEMMS | ROWSUM_MMA, turns=1),
    Probe("fp8k96-loop-bytes", FP8K96, 3, GEMMS | SOFTMAX | ROWSUM_MMA | EXP_BYTES, turns=1),
    Probe("fp8k96-loop-bytes-overlap", FP8K96, 3, GEMMS | SOFTMAX | ROWSUM_MMA | EXP_BYTES, turns=3),
    Probe("bf16-gemm", B16, 2, GEMMS),
    Probe("bf16-softmax", B16, 2, SOFTMAX),
    Probe("bf16-loop-1wg", B16, 2, GEMMS | SOFTMAX, active=1),
    Probe("bf16-loop", B16, 2, GEMMS | SOFTMAX),
)}


KIB, MIB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class LoadProbe:
    name: str
    tile_bytes: int    # bytes of one key tile (16-bit: K nope 32 KiB + rope 16 + V 32 = 80 KiB)
    copy_bytes: int    # bytes of one bulk copy (the kernel's column blocks: 16 KiB for 128 keys)
    stages: int        # the ring's depth (the 16-bit kernel: 2)
    hold: int          # cycles the consumer holds each tile (the tensor time a tile feeds; 0: none)
    span: int          # bytes of the source walked
    shared: bool       # every group walks the same span from its own offset (an L2 section), or each its own
    cluster: int = 1   # CTAs of a cluster (1: none)
    multicast: bool = False  # the cluster's CTAs share each tile: one L2 read delivered into all of them
    ctas: int = 0      # CTAs launched (one per SM); 0: as many as the card has SMs
    # Two rings (kv_probe) when v_bytes > 0: tile_bytes, stages and hold are then K's (its part of the
    # tile, its ring, S's cycles), these V's; v_lag 1: V of tile i - 1 taken with K of tile i;
    # k_ahead 1: the producer fills K of tile i + 1 before V of tile i (0: each V behind its K)
    v_bytes: int = 0
    v_stages: int = 0
    v_hold: int = 0
    v_lag: int = 0
    k_ahead: int = 0

    @property
    def expression(self) -> str:
        if self.v_bytes:
            return "probe::kv_probe"
        return f"probe::load_probe<{self.cluster}, {'true' if self.multicast else 'false'}>"

    @property
    def walk_bytes(self) -> int:
        """Bytes of one whole key tile (K and V parts) in the source."""
        return self.tile_bytes + self.v_bytes

    @property
    def ring_bytes(self) -> int:
        return self.stages * self.tile_bytes + self.v_stages * self.v_bytes

    def groups(self, ctas: int) -> int:
        """Groups of ``ctas`` CTAs that walk the span apart: the clusters with multicast, else every CTA."""
        return ctas // self.cluster if self.multicast else ctas


# The 16-bit kernel's key tile (80 KiB, 2 stages) and its tensor time at the full rate (two
# consumers' S and P V: 2 x 20 x 64 = 2560 cycles), from an L2-sized span all CTAs share (a section
# of heads) and from DRAM; K's share of it in rings of 2 and 4 stages; the 16-bit tile in clusters of 2 CTAs each loading its own (the clusters' placement alone), and in clusters of 2
# and 4 sharing it by multicast, alone and against the tensor time, and on 16 SMs alone (L2 output
# or SM intake); the 16-bit tile's K (48 KiB) and V (32 KiB) in rings of their own, released after
# S's and P V's shares of the tensor time as the kernel's consumers release them, with two stages
# each (the kernel's) or a third K or V stage.
def _whole(tile: int, about: int) -> int:
    """The largest span of whole tiles within ``about`` bytes."""
    return tile * (about // tile)


L2_SPAN, DRAM_SPAN = 16 * MIB, 40 * MIB  # an L2 section's keys and values; per CTA, 132 of them far past the L2
LOAD_PROBES: Dict[str, LoadProbe] = {p.name: p for p in (
    LoadProbe("l2-ring2", 80 * KIB, 16 * KIB, 2, 0, _whole(80 * KIB, L2_SPAN), True),
    LoadProbe("l2-ring2-hold", 80 * KIB, 16 * KIB, 2, 2560, _whole(80 * KIB, L2_SPAN), True),
    LoadProbe("l2-ring2x48", 48 * KIB, 16 * KIB, 2, 0, _whole(48 * KIB, L2_SPAN), True),
    LoadProbe("l2-ring4x48", 48 * KIB, 16 * KIB, 4, 0, _whole(48 * KIB, L2_SPAN), True),
    LoadProbe("dram-ring2", 80 * KIB, 16 * KIB, 2, 0, _whole(80 * KIB, DRAM_SPAN), False),
    LoadProbe("l2-ring2-x16", 80 * KIB, 16 * KIB, 2, 0, _whole(80 * KIB, L2_SPAN), True, ctas=16),
    LoadProbe("l2-ring2-c2", 80 * KIB, 16 * KIB, 2, 0, _whole(80 * KIB, L2_SPAN), True, cluster=2),
    LoadProbe("l2-ring2-mc2", 80 * KIB, 16 * KIB, 2, 0, _whole(80 * KIB, L2_SPAN), True, cluster=2, multicast=True),
    LoadProbe("l2-ring2-mc2-hold", 80 * KIB, 16 * KIB, 2, 2560, _whole(80 * KIB, L2_SPAN), True, cluster=2,
              multicast=True),
    LoadProbe("l2-ring2-mc4", 80 * KIB, 16 * KIB, 2, 0, _whole(80 * KIB, L2_SPAN), True, cluster=4, multicast=True),
    LoadProbe("l2-ring2-mc4-hold", 80 * KIB, 16 * KIB, 2, 2560, _whole(80 * KIB, L2_SPAN), True, cluster=4,
              multicast=True),
    LoadProbe("l2-kv2x2", 48 * KIB, 16 * KIB, 2, 0, _whole(80 * KIB, L2_SPAN), True, v_bytes=32 * KIB, v_stages=2,
              v_lag=1),
    LoadProbe("l2-kv2x2-hold", 48 * KIB, 16 * KIB, 2, 1536, _whole(80 * KIB, L2_SPAN), True, v_bytes=32 * KIB,
              v_stages=2, v_hold=1024, v_lag=1),
    LoadProbe("l2-kv3x2-hold", 48 * KIB, 16 * KIB, 3, 1536, _whole(80 * KIB, L2_SPAN), True, v_bytes=32 * KIB,
              v_stages=2, v_hold=1024, v_lag=1),
    LoadProbe("l2-kv2x3-hold", 48 * KIB, 16 * KIB, 2, 1536, _whole(80 * KIB, L2_SPAN), True, v_bytes=32 * KIB,
              v_stages=3, v_hold=1024, v_lag=1),
    # the same, filled in the consumer's order (K of tile i + 1 before V of tile i)
    LoadProbe("l2-kv2x2-hold-ka", 48 * KIB, 16 * KIB, 2, 1536, _whole(80 * KIB, L2_SPAN), True, v_bytes=32 * KIB,
              v_stages=2, v_hold=1024, v_lag=1, k_ahead=1),
    LoadProbe("l2-kv3x2-hold-ka", 48 * KIB, 16 * KIB, 3, 1536, _whole(80 * KIB, L2_SPAN), True, v_bytes=32 * KIB,
              v_stages=2, v_hold=1024, v_lag=1, k_ahead=1),
    LoadProbe("l2-kv2x3-hold-ka", 48 * KIB, 16 * KIB, 2, 1536, _whole(80 * KIB, L2_SPAN), True, v_bytes=32 * KIB,
              v_stages=3, v_hold=1024, v_lag=1, k_ahead=1),
)}


def source() -> str:
    return jit.source_with_includes(SOURCE.read_text(encoding="utf-8"), SOURCE.name)


def check(probes: Sequence[Probe]) -> int:
    """Compile every probe for sm_90a (NVRTC, no GPU) and print its spills and, where cuobjdump is
    found (``sass.py``), its loop's instructions per warp by class; 1 when one spills or has
    serialized wgmma."""
    import tempfile

    sys.path.insert(0, str(SOURCE.parent))
    import sass

    loads = sorted({p.expression for p in LOAD_PROBES.values()})
    build = jit.compile_source_offline_with_log(source(), SOURCE.name, [p.expression for p in probes] + loads,
                                                "sm_90a")
    funcs = build.functions()
    try:
        tool = sass.find_tool("cuobjdump")
    except FileNotFoundError as exc:
        print(f"(no loop counts: {exc})")
        code = {}
    else:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(build.binary)
            f.flush()
            code = sass.parse_sass(sass._run([tool, "-sass", f.name]))
    shown = ("GMMA", "EX2", "FFMA", "FMUL", "FADD", "FMNMX", "LDS/STS", "U*", "INT")
    bad = 0
    for p in probes:
        lowered = build.lowered[p.expression]
        f = funcs[lowered]
        line = f"{p.name:20s} spills {f.spill_stores}/{f.spill_loads}"
        if code:
            loop = max(sass.find_loops(code[lowered]), key=lambda lp: (lp.gmma, lp.total))
            line += f"  loop {loop.total:4d}: " + " ".join(f"{c} {loop.classes[c]}" for c in shown)
        print(line)
        bad |= f.spills
    for expr in loads:
        f = funcs[build.lowered[expr]]
        print(f"{expr:20s} spills {f.spill_stores}/{f.spill_loads}")
        bad |= f.spills
    for adv in build.serialized_wgmma():
        print("serialized wgmma:", adv)
        bad = 1
    return bad


def energy_row(launch, launch_ms: float, energy_s: float, sampler, sync) -> dict:
    """Launches ``launch()`` back to back for about ``energy_s`` seconds with the board's energy counter
    read around them (``ab.py``'s ``energy_window``): joules per launch, watts, the SM clock."""
    from ab import energy_calls, energy_window
    return energy_window(lambda i: launch(), 1, energy_calls(launch_ms, energy_s), sampler, sync)


def idle_watts(sampler, seconds: float = 1.0) -> float:
    """The board's mean power over ``seconds`` with nothing launched (from its energy counter)."""
    import time
    e0, t0 = sampler.energy_mj(), time.perf_counter()
    time.sleep(seconds)
    e1, t1 = sampler.energy_mj(), time.perf_counter()
    return float("nan") if e0 is None or e1 is None else (e1 - e0) / 1e3 / (t1 - t0)


def run(probes: Sequence[Probe], iters: int, repeats: int, energy_s: float = 0.0, sampler=None) -> List[dict]:
    import cupy as cp

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    sms, smem = int(props["multiProcessorCount"]), int(props["sharedMemPerBlockOptin"])
    module = cp.RawModule(code=source(), options=("-std=c++17", "-arch=sm_90a"),
                          name_expressions=[p.expression for p in probes])
    rows = []
    for p in probes:
        fn = module.get_function(p.expression)
        fn.max_dynamic_shared_size_bytes = smem
        threads = 128 * (1 + p.consumers)
        cyc = cp.zeros(sms * p.consumers, cp.int64)
        ns = cp.zeros_like(cyc)
        per_tile, mhz = [], []
        for r in range(repeats + 1):  # the first launch warms up
            cyc.fill(0)
            fn((sms,), (threads,), (cyc, ns, cp.int32(iters)), shared_mem=smem)
            dev.synchronize()
            if r == 0:
                continue
            c = cyc.get().reshape(sms, p.consumers)[:, :p.runners]
            t = ns.get().reshape(sms, p.consumers)[:, :p.runners]
            if (c <= 0).any():
                raise RuntimeError(f"{p.name}: a consumer reported no cycles")
            per_tile.append(float(statistics.median(c.max(axis=1))) / iters)
            mhz.append(float(statistics.median((c / t).ravel())) * 1e3)
        cycles = statistics.median(per_tile)
        row = {"probe": p.name, "cycles_per_tile": cycles, "spread": [min(per_tile), max(per_tile)],
               "mhz": statistics.median(mhz), "tensor_cycles": p.tensor_cycles,
               "pipe": p.tensor_cycles / cycles if p.tensor_cycles else None}
        energy = ""
        if energy_s > 0:
            win = energy_row(lambda: fn((sms,), (threads,), (cyc, ns, cp.int32(iters)), shared_mem=smem),
                             cycles * iters / (row["mhz"] * 1e3), energy_s, sampler, dev.synchronize)
            row["energy"] = win
            if win["j_per_call"] is not None:
                tiles = sms * iters  # key tiles of every CTA's running consumers
                row["nj_per_tile"] = win["j_per_call"] / tiles * 1e9
                row["pj_per_flop"] = win["j_per_call"] / (tiles * p.flops) * 1e12 if p.flops else None
                pj = f"{row['pj_per_flop']:.3f} pJ/FLOP" if p.flops else "-"
                energy = (f"  {row['nj_per_tile']:7.1f} nJ/tile {pj}  {win['watts']:4.0f} W "
                          f"{win['sm_mhz'] or 0:5.0f} MHz")
        rows.append(row)
        pipe = f"{row['pipe']:6.1%}" if row["pipe"] is not None else "     -"
        print(f"{p.name:22s} {cycles:8.0f} cycles/tile ({min(per_tile):.0f}-{max(per_tile):.0f})  "
              f"pipe {pipe}  {row['mhz']:5.0f} MHz{energy}", flush=True)
    return rows


def load_layout(p: LoadProbe, groups: int):
    """(tiles of the source, tiles between groups' first tiles) of a load probe: a shared span is one
    buffer the groups (CTAs, or clusters sharing by multicast) enter 7 tiles apart (so that they do not
    move in lock step); an own span per group is ``span`` bytes of one buffer of ``groups * span``."""
    if p.copy_bytes % 16 or p.tile_bytes % p.copy_bytes or p.v_bytes % p.copy_bytes:
        raise ValueError(f"{p.name}: a tile of {p.tile_bytes} + {p.v_bytes} B is not whole copies of "
                         f"{p.copy_bytes} B (a multiple of 16)")
    if p.span % p.walk_bytes:
        raise ValueError(f"{p.name}: a span of {p.span} B is not whole tiles of {p.walk_bytes} B")
    per = p.span // p.walk_bytes
    return (per, 7) if p.shared else (groups * per, per)


def run_loads(probes: Sequence[LoadProbe], tiles: int, repeats: int, energy_s: float = 0.0, sampler=None) -> List[dict]:
    import cupy as cp

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    sms, smem = int(props["multiProcessorCount"]), int(props["sharedMemPerBlockOptin"])
    module = cp.RawModule(code=source(), options=("-std=c++17", "-arch=sm_90a"),
                          name_expressions=sorted({p.expression for p in probes}))
    rows = []
    for p in probes:
        ring = p.ring_bytes
        if max(p.stages, p.v_stages) > 8 or ring > smem - 1024:
            raise ValueError(f"{p.name}: stages of {ring} B in all do not fit (at most 8 a ring, {smem - 1024} B)")
        ctas = min(p.ctas or sms, sms) // p.cluster * p.cluster  # whole clusters, at most one CTA per SM
        span_tiles, step = load_layout(p, p.groups(ctas))
        src = cp.ones(span_tiles * p.walk_bytes, cp.uint8)
        fn = module.get_function(p.expression)
        fn.max_dynamic_shared_size_bytes = ring
        cyc, ns, t0 = (cp.zeros(ctas, cp.int64) for _ in range(3))
        per_tile, tbs, late = [], [], 0
        if p.v_bytes:
            args = (cp.int32(p.tile_bytes), cp.int32(p.v_bytes), cp.int32(p.copy_bytes), cp.int32(p.stages),
                    cp.int32(p.v_stages), cp.int32(p.hold), cp.int32(p.v_hold), cp.int32(p.v_lag), cp.int32(p.k_ahead))
        else:
            args = (cp.int32(p.tile_bytes), cp.int32(p.copy_bytes), cp.int32(p.stages), cp.int32(p.hold))
        for r in range(repeats + 1):  # the first launch warms up (and brings a shared span into L2)
            fn((ctas,), (64,), (src, cp.int64(span_tiles), cp.int64(step), cp.int32(tiles), *args, cyc, ns, t0),
               shared_mem=ring)
            dev.synchronize()
            if r == 0:
                continue
            c, t, start = cyc.get(), ns.get(), t0.get()
            if (c <= 0).any():
                raise RuntimeError(f"{p.name}: a CTA reported no cycles")
            # CTAs that started after half the others' time ran in a later wave (clusters that found no
            # SMs free in one GPC): left out of the per-tile cycles, counted, and in the wall time.
            first = start - start.min() < 0.5 * float(statistics.median(t))
            late = max(late, int((~first).sum()))
            per_tile.append(float(statistics.median(c[first])) / tiles)
            tbs.append(ctas * tiles * p.walk_bytes / float((start + t).max() - start.min()) / 1e3)  # B/ns = GB/s; TB/s
            mhz = float(statistics.median(c / t)) * 1e3
        cycles = statistics.median(per_tile)
        row = {"probe": p.name, "cycles_per_tile": cycles, "spread": [min(per_tile), max(per_tile)],
               "bytes_per_cycle_sm": p.walk_bytes / cycles, "tb_per_s": statistics.median(tbs), "mhz": mhz,
               "hold": p.hold + p.v_hold, "ctas": ctas, "late_ctas": late,
               "l2_bytes_per_cycle_sm": p.walk_bytes / cycles / (p.cluster if p.multicast else 1)}
        energy = ""
        if energy_s > 0:
            def launch(src=src):
                fn((ctas,), (64,), (src, cp.int64(span_tiles), cp.int64(step), cp.int32(tiles), *args, cyc, ns, t0),
                   shared_mem=ring)
            win = energy_row(launch, cycles * tiles / (mhz * 1e3), energy_s, sampler, dev.synchronize)
            row["energy"] = win
            if win["j_per_call"] is not None:
                row["nj_per_tile"] = win["j_per_call"] / (ctas * tiles) * 1e9
                row["pj_per_byte"] = row["nj_per_tile"] * 1e3 / p.walk_bytes
                energy = (f"  {row['nj_per_tile']:7.1f} nJ/tile {row['pj_per_byte']:.2f} pJ/B  {win['watts']:4.0f} W "
                          f"{win['sm_mhz'] or 0:5.0f} MHz")
        rows.append(row)
        print(f"{p.name:22s} {cycles:8.0f} cycles/tile ({min(per_tile):.0f}-{max(per_tile):.0f})  "
              f"{row['bytes_per_cycle_sm']:5.1f} B/cycle/SM in ({row['l2_bytes_per_cycle_sm']:5.1f} from L2)  "
              f"{row['tb_per_s']:5.2f} TB/s in  {mhz:5.0f} MHz  {ctas} CTAs" + (f", {late} late" if late else "") + energy,
              flush=True)
        del src
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", default=",".join([*PROBES, *LOAD_PROBES]), help="comma separated (--list)")
    ap.add_argument("--iters", type=int, default=4096,
                    help="key tiles per consumer (load probes: per CTA) and launch")
    ap.add_argument("--repeats", type=int, default=3, help="timed launches per probe (median)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--energy", type=float, default=0.0, metavar="S",
                    help="also launch each probe back to back for about S seconds with the board's energy "
                         "counter read around them: loop probes nJ per key tile and pJ per attention FLOP, "
                         "load probes nJ per tile and pJ per byte (0: off)")
    ap.add_argument("--check", action="store_true", help="compile only (no GPU): spills and serialized wgmma")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    if a.list:
        for p in PROBES.values():
            print(f"{p.name:22s} {p.expression}")
        for p in LOAD_PROBES.values():
            rings = (f"K {p.stages} x {p.tile_bytes // KIB} KiB, V {p.v_stages} x {p.v_bytes // KIB} KiB"
                     if p.v_bytes else f"{p.stages} x {p.tile_bytes // KIB} KiB")
            holds = f"hold {p.hold} + {p.v_hold}, V lag {p.v_lag}" if p.v_bytes else f"hold {p.hold}"
            print(f"{p.name:22s} {p.expression}: {rings} "
                  f"({p.copy_bytes // KIB} KiB copies), {holds}, "
                  f"{p.span // MIB} MiB {'shared' if p.shared else 'per group'}"
                  + (f", clusters of {p.cluster}" + (" sharing by multicast" if p.multicast else "")
                     if p.cluster > 1 else "") + (f", {p.ctas} CTAs" if p.ctas else ""))
        return 0
    names = [n for n in a.probes.split(",") if n]
    unknown = [n for n in names if n not in PROBES and n not in LOAD_PROBES]
    if unknown:
        ap.error(f"unknown probe(s) {unknown}: see --list")
    probes = [PROBES[n] for n in names if n in PROBES]
    loads = [LOAD_PROBES[n] for n in names if n in LOAD_PROBES]
    if a.check:
        return check(probes)
    if a.iters < 1 or a.repeats < 1:
        ap.error("--iters and --repeats must be at least 1")
    if a.energy < 0:
        ap.error("--energy must be 0 (off) or a number of seconds")
    if a.energy > 0:
        import cupy as cp
        from ab import NvmlSampler
        with NvmlSampler(cp.cuda.Device().id) as sampler:
            idle = idle_watts(sampler)
            print(f"idle board power {idle:.0f} W", flush=True)
            rows = ((run(probes, a.iters, a.repeats, a.energy, sampler) if probes else [])
                    + (run_loads(loads, a.iters, a.repeats, a.energy, sampler) if loads else []))
            rows.append({"idle_watts": idle})
    else:
        rows = (run(probes, a.iters, a.repeats) if probes else []) + (run_loads(loads, a.iters, a.repeats) if loads else [])
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
