"""Records of the reliability runs (fuzz, sanitizers, soak) and their one summary.

Each run writes a JSON record into the ``--out`` folder of ``bash benchmarks/gpu.sh verify``:
``fuzz-s<seed>-<start>-<time>.json`` (:mod:`_fuzz`), ``sanitize-<tool>.json`` (from the tool's
log, :func:`sanitizer_record`) and ``soak.json`` (:mod:`_soak`: the soak, the concurrency check
and the backward's repeatability). :func:`summarize` reads them back
(problems counted once per (seed, index), whatever runs repeated them) and :func:`format_summary`
prints the summary with a ready-to-paste markdown row for ``benchmarks/RESULTS.md``.

Everything here runs without a GPU: records can be summarized on any machine.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional

ROOT = Path(__file__).resolve().parent.parent
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
#: The markdown columns of :func:`markdown_row`.
TABLE_HEADER = ("| commit | GPU | problems (seed: indices) | mismatches | sanitizer errors | soak memory after warm-up "
                "| concurrency | backward repeatability |\n| --- | --- | --- | --- | --- | --- | --- | --- |")


def commit() -> str:
    """The checkout's short commit, with ``+`` when kernels/ or mla_cupy/ differ from it
    (``MLA_VERIFY_COMMIT`` overrides; ``?`` without git)."""
    if os.environ.get("MLA_VERIFY_COMMIT"):
        return os.environ["MLA_VERIFY_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "kernels", "mla_cupy"],
                               capture_output=True, timeout=10).returncode != 0
        return head + ("+" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def device() -> str:
    """The name of CUDA device 0, or ``"no GPU"``."""
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return "no GPU"


def write_record(out_dir, name: str, record: dict) -> Path:
    """Write ``record`` as ``out_dir/name`` (atomically: a killed run leaves the previous
    version), adding the commit, the device and the time when absent."""
    record.setdefault("commit", commit())
    record.setdefault("device", device())
    record.setdefault("time", time.time())
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def load_records(out_dir, kind: Optional[str] = None) -> List[dict]:
    """Every record (``*.json`` with a ``kind``) in ``out_dir``, oldest first; only ``kind`` if given."""
    found = []
    folder = Path(out_dir)
    if not folder.is_dir():
        return found
    for path in sorted(folder.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and "kind" in rec and (kind is None or rec["kind"] == kind):
            found.append(rec)
    return sorted(found, key=lambda r: r.get("time", 0))


# ------------------------------------------------------------------------------------------------
# Fuzz records


def fuzz_outcomes(records: Iterable[dict], seed: Optional[int] = None) -> Dict[tuple, list]:
    """``{(seed, index): [combo, status, tags]}`` over fuzz records (of ``seed`` only, if given);
    ``tags[0]`` is the problem's mask. A problem run more than once keeps its worst status (failed
    over ok over skipped)."""
    rank = {"skipped": 0, "ok": 1, "failed": 2}
    out: Dict[tuple, list] = {}
    for rec in records:
        if rec.get("kind") != "fuzz" or (seed is not None and rec["seed"] != seed):
            continue
        for index, combo, status, tags in rec["problems"]:
            key = (rec["seed"], index)
            if key not in out or rank[status] > rank[out[key][1]]:
                out[key] = [combo, status, tags]
    return out


def resume_start(done: Iterable[int], total: int) -> int:
    """The first index in ``[0, total)`` not in ``done`` (``total`` when all are)."""
    done = set(done)
    return next((i for i in range(total) if i not in done), total)


# ------------------------------------------------------------------------------------------------
# Sanitizer logs

_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?)\b")


def parse_sanitizer_log(text: str) -> dict:
    """What a compute-sanitizer log says: ``errors`` (the sum of its ``ERROR SUMMARY`` lines, or of
    racecheck's errors where only its ``RACECHECK SUMMARY`` is there; None when no summary line
    came, i.e. the tool did not finish), racecheck's ``hazards``, and pytest's ``passed`` /
    ``failed`` counts (errors of pytest count as failed)."""
    errors = [int(n) for n in _ERROR_SUMMARY.findall(text)]
    races = [tuple(int(x) for x in m) for m in _RACE_SUMMARY.findall(text)]
    if errors:
        total: Optional[int] = sum(errors)
    elif races:
        total = sum(r[1] for r in races)
    else:
        total = None
    counts = {"passed": 0, "failed": 0}
    tail = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    for n, what in _PYTEST_COUNT.findall(tail[-1] if tail else ""):
        counts["passed" if what == "passed" else "failed"] += int(n)
    return dict(errors=total, hazards=sum(r[0] for r in races) if races else None, **counts)


def sanitizer_record(tool: str, log_path, rc: int) -> dict:
    """The record of one sanitizer run from its log and exit status (124: stopped at the limit)."""
    text = Path(log_path).read_text(errors="replace") if Path(log_path).exists() else ""
    return dict(kind="sanitize", tool=tool, rc=int(rc), timed_out=int(rc) in (124, 137), **parse_sanitizer_log(text))


# ------------------------------------------------------------------------------------------------
# The summary


def summarize(records: List[dict]) -> dict:
    """The numbers of one summary from every record of a folder."""
    outcomes = fuzz_outcomes(records)
    ran = {k: v for k, v in outcomes.items() if v[1] != "skipped"}
    combos: Dict[str, int] = {}
    masks: Dict[str, int] = {}
    tags: Dict[str, int] = {}
    for combo, _, problem_tags in ran.values():
        combos[combo] = combos.get(combo, 0) + 1
        masks[problem_tags[0]] = masks.get(problem_tags[0], 0) + 1
        for t in problem_tags[1:]:
            tags[t] = tags.get(t, 0) + 1
    by_seed: Dict[int, List[int]] = {}
    for seed, index in ran:
        by_seed.setdefault(seed, []).append(index)
    fuzz_recs = [r for r in records if r.get("kind") == "fuzz"]
    failures = {}
    for rec in fuzz_recs:
        for f in rec.get("failures", []):
            failures.setdefault((rec["seed"], f["index"]), f)
    sanitize = {}
    for rec in records:
        if rec.get("kind") == "sanitize":
            sanitize[rec["tool"]] = rec  # the latest run of each tool
    soaks = [r for r in records if r.get("kind") == "soak"]
    return dict(
        problems=len(ran), failed=sum(1 for v in ran.values() if v[1] == "failed"),
        skipped=sum(1 for v in outcomes.values() if v[1] == "skipped"), combos=combos, masks=masks, tags=tags,
        ranges={seed: _ranges(ix) for seed, ix in by_seed.items()}, failures=list(failures.values()),
        fatal=[r["fatal"] for r in fuzz_recs if r.get("fatal")], sanitize=sanitize,
        soak=soaks[-1] if soaks else None,
        schedules=len({tuple(r.get("schedule") or ()) for r in fuzz_recs}),
        commits=sorted({r.get("commit", "?") for r in records}), devices=sorted({r.get("device", "?") for r in records}),
    )


def _ranges(indices: Iterable[int]) -> List[List[int]]:
    """Sorted indices as inclusive ``[first, last]`` runs."""
    runs: List[List[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return runs


def _ranges_text(summary: dict) -> str:
    parts = []
    for seed, runs in sorted(summary["ranges"].items()):
        spans = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)
        parts.append(f"seed {seed}: {spans}")
    return "; ".join(parts) or "none"


def _sanitizer_text(summary: dict) -> str:
    cells = []
    for tool in SANITIZER_TOOLS:
        rec = summary["sanitize"].get(tool)
        if rec is None:
            cells.append(f"{tool} not run")
        elif rec["errors"] is None:
            cells.append(f"{tool} incomplete" + (" (time limit)" if rec.get("timed_out") else f" (rc {rec['rc']})"))
        else:
            extra = f", {rec['failed']} tests failed" if rec.get("failed") else ""
            cells.append(f"{tool} {rec['errors']}{extra}")
    return ", ".join(cells)


def _mib(nbytes) -> str:
    """A signed byte count: in bytes below 1 MiB (a small leak stays visible), else in MiB."""
    if nbytes is None:
        return "n/a"
    return f"{nbytes:+,} B" if abs(nbytes) < 2**20 else f"{nbytes / 2**20:+.1f} MiB"


def _soak_text(soak: Optional[dict]) -> str:
    if soak is None:
        return "not run"
    d = soak["drift"]
    return (f"{soak['calls']:,} calls: pool used {_mib(d['pool_used'])}, torch allocated {_mib(d.get('torch_allocated'))}, "
            f"device free {_mib(d['device_free'])}, compiled modules {d['compiled_modules']:+d}, "
            f"plan records {d['plan_records']:+d}"
            + ("" if d.get("plan_cache") is None else f", plan cache entries {d['plan_cache']:+d}")
            + ("" if soak["ok"] else " (FAILED)"))


def _concurrency_text(soak: Optional[dict]) -> str:
    c = (soak or {}).get("concurrency")
    if not c:
        return "not run"
    verdict = "bitwise equal to serial" if c["ok"] else f"{c['mismatches']} runs differ, {len(c['errors'])} errors"
    return f"{c['threads']} threads x {c['runs_per_thread']} runs: {verdict}"


def _backward_text(soak: Optional[dict]) -> str:
    b = (soak or {}).get("backward")
    if not b:
        return "not run"
    if b.get("unfinished"):
        return "did not finish (hung or stopped: the soak step's log says where)"
    parts = b["kernels"]
    names = ", ".join(p["kernel"] for p in parts)
    if b["ok"]:
        worst = max(p["free_worst"] for p in parts)
        differ = sum(p["free_differ_bits"] for p in parts)
        return (f"{names}: deterministic {b['runs']} serial + {b['threads']} threads x {b['runs']} runs bitwise equal; "
                f"default mode {b['threads']} threads x {b['free_runs']} runs within {worst:.1e} of serial "
                f"({differ} of {len(parts) * b['threads'] * b['free_runs']} differ in bits)")
    bad = [f"{p['kernel']}: {p['serial_mismatches']} + {p['thread_mismatches']} elements differ, default mode worst "
           f"{p['free_worst']}, {len(p['errors'])} errors" for p in parts if not p["ok"]]
    return f"{names}: FAILED ({'; '.join(bad)})"


def markdown_row(summary: dict) -> str:
    """One row of the reliability table (:data:`TABLE_HEADER`)."""
    return "| " + " | ".join([
        ", ".join(summary["commits"]) or "?", ", ".join(d for d in summary["devices"] if d != "no GPU") or "?",
        f"{summary['problems']:,} ({_ranges_text(summary)})", str(summary["failed"]), _sanitizer_text(summary),
        _soak_text(summary["soak"]), _concurrency_text(summary["soak"]), _backward_text(summary["soak"])]) + " |"


def format_summary(summary: dict) -> str:
    """The summary as text: one line per part, what failed, then the markdown row."""
    lines = [f"commit {', '.join(summary['commits']) or '?'} on {', '.join(summary['devices']) or '?'}"]
    if len(summary["commits"]) > 1:
        lines.append("!! the records come from more than one commit: run every step on the same one")
    if summary.get("schedules", 0) > 1:
        lines.append("!! the fuzz records come from more than one schedule: an index names another problem in each")
    combos = ", ".join(f"{k} {n}" for k, n in sorted(summary["combos"].items()))
    masks = ", ".join(f"{k} {n}" for k, n in sorted(summary["masks"].items()))
    lines += [f"fuzz: {summary['problems']:,} problems ({_ranges_text(summary)}), {summary['failed']} mismatches, "
              f"{summary['skipped']} skipped (kernel not on this GPU)",
              f"  by kernel/variant: {combos or '-'}", f"  by mask: {masks or '-'}",
              "  covering: " + (", ".join(f"{k} {n}" for k, n in sorted(summary["tags"].items())) or "-")]
    for f in summary["failures"]:
        lines.append(f"  FAILED {f['label']}: {f['error']}")
        lines.append(f"    reproduce: {f['repro']}")
        if f.get("shrunk_repro"):
            lines.append(f"    smallest: {f['shrunk_repro']}")
    for fatal in summary["fatal"]:
        lines.append(f"  FATAL (CUDA context lost): {fatal}")
    lines += [f"sanitizers: {_sanitizer_text(summary)}", f"soak: {_soak_text(summary['soak'])}"]
    if summary["soak"] and summary["soak"].get("failures"):
        lines += [f"  {f}" for f in summary["soak"]["failures"]]
    lines += [f"concurrency: {_concurrency_text(summary['soak'])}",
              f"backward repeatability: {_backward_text(summary['soak'])}"]
    if summary["soak"] and summary["soak"].get("backward"):
        lines += [f"  {p['kernel']}: {e}" for p in summary["soak"]["backward"]["kernels"] for e in p["errors"]]
    lines += ["", "markdown row (benchmarks/RESULTS.md):",
              TABLE_HEADER, markdown_row(summary)]
    return "\n".join(lines)


def main(argv=None) -> int:
    """``verify.py summary DIR`` | ``verify.py record-sanitizer TOOL LOG RC DIR`` | ``verify.py soak ...``"""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "summary" and len(rest) == 1:
        print(format_summary(summarize(load_records(rest[0]))))
        return 0
    if cmd == "record-sanitizer" and len(rest) == 4:
        tool, log, rc, out_dir = rest
        rec = write_record(out_dir, f"sanitize-{tool}.json", sanitizer_record(tool, log, int(rc)))
        data = json.loads(rec.read_text())
        print(f"{tool}: errors {data['errors']}, hazards {data['hazards']}, tests passed {data['passed']}, "
              f"failed {data['failed']} ({rec})")
        return 0
    if cmd == "soak":
        from _soak import main as soak_main

        return soak_main(rest)
    print(main.__doc__, file=sys.stderr)
    return 2
