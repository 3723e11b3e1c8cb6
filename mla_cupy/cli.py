"""``mla-cupy`` (also ``python -m mla_cupy``): the command line of mla_cupy (info, smoke, compile, bench)."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

import click
import numpy as np

from . import _registry as reg
from . import bench as B
from ._arrays import INSTALL_GPU, gpu_missing
from ._optional import MissingDependency, require
from ._registry import family_label

Job = Tuple[str, reg.Family, bool]  # (arch, family, compile through this GPU's driver)


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def cuda_version(v: int) -> str:
    """CUDA's integer version as people write it: ``13020`` -> ``'13.2'``."""
    return f"{v // 1000}.{v % 1000 // 10}"


def require_cupy_and_nvrtc():
    """The ``cupy`` module and NVRTC's version ``(major, minor)``, or a one-line
    :class:`click.ClickException` (exit status 1, no traceback) that says what is missing."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy built for another CUDA
        raise click.ClickException(f"CuPy is not importable ({type(exc).__name__}: {exc}); "
                                   f"kernels need it: {INSTALL_GPU}") from None
    try:
        nvrtc = tuple(cupy.cuda.nvrtc.getVersion())
    except Exception as exc:
        raise click.ClickException(f"NVRTC (libnvrtc) is not found by CuPy {cupy.__version__} ({type(exc).__name__}); "
                                   f"kernels compile through it: {INSTALL_GPU}") from None
    return cupy, nvrtc


def _compile_one(job: Job) -> Tuple[float, str]:
    """Compile one family; (seconds, '' or the error). Runs in a worker process."""
    arch, (filename, names), on_device = job
    from . import jit

    t0 = time.perf_counter()
    try:
        if on_device:  # through CuPy's RawModule: fills CuPy's on-disk kernel cache
            jit.get_function(filename, names, names[0], arch=arch)
        else:
            jit.compile_offline(filename, names, arch)
        return time.perf_counter() - t0, ""
    except Exception as exc:
        return time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"


def compile_jobs(offline: bool, only: Sequence[str] = ()) -> List[Job]:
    """What ``mla-cupy compile`` builds: every family for every target arch (``offline``), or the
    families this GPU runs, for its arch; ``only`` keeps the families whose label or source file
    contains one of the given strings."""
    if offline:
        jobs = [(arch, fam, False) for arch, fam in reg.all_families()]
    else:
        import cupy

        from .jit import arch_for_capability

        arch = arch_for_capability(cupy.cuda.Device().compute_capability)
        fams = [fam for a, fam in reg.all_families() if a == arch or (a == "sm_80" and arch != "sm_90a")]
        jobs = [(arch, fam, True) for fam in dict.fromkeys(fams)]
    if only:
        jobs = [j for j in jobs if any(s in family_label(j[1]) or s in j[1][0] for s in only)]
    return jobs


@click.group(invoke_without_command=True)
@click.version_option(package_name="mla_cupy")
@click.pass_context
def cli(ctx):
    """MLA (DeepSeek V2/V3) prefill kernels for CuPy."""
    if ctx.invoked_subcommand is None:  # no command: the help, and success
        click.echo(ctx.get_help())


@cli.command()
def info():
    """Versions, the device and its arch, the kernel sources, and what is compiled or cached."""
    import mla_cupy
    from mla_cupy import jit

    bench_files = {reg.SPIN[0]}  # the benchmark's helper, not a kernel of the package
    sources = [s for s in jit.iter_sources() if s.endswith(".cu") and s not in bench_files]
    headers = [s for s in jit.iter_sources() if s.endswith(".cuh")]
    click.echo(f"mla_cupy {mla_cupy.__version__}, kernel sources in {jit.KERNEL_DIR}")
    click.echo(f"kernels: {', '.join(sources)} (+ {len(headers)} headers); "
               f"{len(reg.all_families())} (arch, module) pairs for `mla-cupy compile --offline`")
    try:
        cupy, nvrtc = require_cupy_and_nvrtc()
    except click.ClickException as exc:
        click.echo(f"{exc.message}; the float64 reference (mla_cupy.reference) works without it")
        return
    driver = cupy.cuda.runtime.driverGetVersion()
    click.echo(f"CuPy {cupy.__version__} (built with CUDA {cuda_version(cupy.cuda.runtime.runtimeGetVersion())}), "
               f"CUDA runtime library {_local_runtime(cupy)}, NVRTC {nvrtc[0]}.{nvrtc[1]} (compiles the kernels), "
               f"driver {cuda_version(driver) if driver else 'none'}")
    click.echo("  (CuPy's wheel carries the CUDA runtime it was built with; the extra pins the NVRTC and "
               "headers the kernels compile with, and a driver runs code of its CUDA version or older)")
    if not _gpu_available():
        click.echo(f"device: none ({gpu_missing() or 'no CUDA GPU visible'}): kernels can still be compiled "
                   "offline with NVRTC")
    else:
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        cc = dev.compute_capability
        click.echo(f"device {dev.id}: {name}, compute capability {cc[:-1]}.{cc[-1]}, target "
                   f"{jit.arch_for_capability(cc)}, {props['multiProcessorCount']} SMs")
    from pathlib import Path

    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    n = len(list(cache.glob("*.cubin"))) if cache.is_dir() else 0
    click.echo(f"CuPy kernel cache: {cache} ({n} cubins on disk)")
    for f, arch, names in jit.compiled_modules():
        click.echo(f"  compiled in this process: {f} [{arch}] {len(names)} instantiations")


def _local_runtime(cupy) -> str:
    """The version of the CUDA runtime library installed beside CuPy (the extra's), or ``'none
    found'``."""
    try:
        return cuda_version(cupy.cuda.get_local_runtime_version())
    except Exception:  # no libcudart beside CuPy
        return "none found"


def _smoke_case(seed=0):
    import ml_dtypes

    rng = np.random.default_rng(seed)
    sq, sk, h = [300, 17, 129, 1], [300, 1041, 200, 64], 16  # ragged, with prefix context
    bf = ml_dtypes.bfloat16
    q = rng.standard_normal((sum(sq), h, 192)).astype(bf)
    k = rng.standard_normal((sum(sk), h, 128)).astype(bf)
    v = rng.standard_normal((sum(sk), h, 128)).astype(bf)
    kr = rng.standard_normal((sum(sk), 1, 64)).astype(bf)
    vl = np.concatenate([[0], np.cumsum(sq)]).astype(np.uint32)
    cro = np.concatenate([[0], np.cumsum(sk)]).astype(np.uint32)
    return q, k, v, kr, vl, cro


@cli.command()
@click.option("--cpu", is_flag=True, help="Run the float64 reference only, even if a GPU is present.")
def smoke(cpu):
    """Run a DeepSeek-shaped ragged batch; on a GPU check the kernel against the reference."""
    from mla_cupy import reference

    args = _smoke_case()
    t0 = time.perf_counter()
    ref = reference.mla_prefill(*args)
    t_ref = time.perf_counter() - t0
    shape = "B=4, Sq=[300,17,129,1], Sk=[300,1041,200,64], H=16, bf16, causal"
    if cpu or not _gpu_available():
        click.echo(f"no GPU: ran the float64 reference only ({shape}) in {t_ref * 1e3:.1f} ms; "
                   f"output {ref.shape}, finite: {bool(np.isfinite(ref).all())}")
        return
    import cupy as cp

    import mla_cupy

    d = [cp.asarray(a) for a in args]
    out = mla_cupy.mla_prefill(*d)
    cp.cuda.Device().synchronize()
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    ev0.record()
    for _ in range(10):
        mla_cupy.mla_prefill(*d)
    ev1.record()
    ev1.synchronize()
    ms = cp.cuda.get_elapsed_time(ev0, ev1) / 10
    got = cp.asnumpy(out).astype(np.float64)
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    ok = err < 1e-2 and np.isfinite(got).all()
    click.echo(f"GPU kernel ({shape}): relative error {err:.2e} vs float64 reference, {ms:.3f} ms/call "
               f"-> {'OK' if ok else 'FAILED'}")
    if not ok:
        sys.exit(1)


@cli.command(name="compile")
@click.option("--offline", is_flag=True, help="Compile every family for every target arch with NVRTC alone, "
                                              "no GPU needed (what CI does; the default without a GPU).")
@click.option("-j", "--jobs", default=0, help="Parallel processes (default: all cores).")
@click.option("--only", multiple=True, help="Only families whose label or source file contains this text (repeatable).")
@click.option("--list", "list_only", is_flag=True, help="List the families and exit, compiling nothing.")
def compile_cmd(offline, jobs, only, list_only):
    """Compile every kernel family ahead of time (on a GPU machine: for its arch, filling CuPy's
    kernel cache, so that first calls do not wait for NVRTC)."""
    if list_only:
        for arch, fam, _ in compile_jobs(True, only):
            n = len(fam[1])
            click.echo(f"{arch} {family_label(fam)} ({n} kernel{'s' if n > 1 else ''}, {fam[0]})")
        return
    require_cupy_and_nvrtc()
    todo = compile_jobs(offline or not _gpu_available(), only)
    if not todo:
        raise click.ClickException(f"no family matches --only {list(only)}; see `mla-cupy compile --list`")
    workers = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    t0, failed = time.perf_counter(), []
    for i, (job, (secs, err)) in enumerate(_run_jobs(todo, workers), 1):
        name = f"{job[0]} {family_label(job[1])}"
        click.echo(f"[{i}/{len(todo)}] {name} {secs:.1f} s{'  FAILED' if err else ''}")
        if err:
            failed.append((name, err))
    for name, err in failed:
        click.echo(f"\n{name}: {err}", err=True)
    click.echo(f"{len(todo) - len(failed)}/{len(todo)} families compiled in {time.perf_counter() - t0:.1f} s")
    if failed:
        sys.exit(1)


def _run_jobs(todo: List[Job], workers: int):
    """Yield (job, (seconds, error)) as the jobs finish. Worker processes are *spawned*, never
    forked: the parent may have initialised CUDA (to find the GPU and its arch), and a forked
    child cannot use the driver state it inherits (cudaErrorInitializationError)."""
    if workers == 1:
        for job in todo:
            yield job, _compile_one(job)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        futures = {ex.submit(_compile_one, job): job for job in todo}
        for fut in as_completed(futures):
            yield futures[fut], fut.result()


_BENCH_HELP = """Time this package's kernels on this GPU over a matrix of cases; prints a table
(ms, TFLOP/s, error against the float64 reference, host time per call, share of the card's bf16
matmul rate). Without a GPU, times the float64 reference on tiny cases.

\b
Other implementations (FlashAttention-3, cuDNN, torch SDPA, FlexAttention) are timed by the
benchmark scripts of the checkout, not by this command:
  python benchmarks/matrix.py          the same matrix with the peers' rows
  python benchmarks/ab.py --help       implementations in interleaved rounds (the README's numbers)
"""


_CP_HELP = ("Context-parallel run on W ranks (mla_cupy.distributed.bench): equality with the one-GPU "
            "result per mask, then the scaling of 1 x --seq tokens. W = 1 runs in this process; W > 1 starts "
            "W processes through torch.distributed.run (NCCL's NVLink multicast off). The arguments after "
            "the options go to that runner (--seq, --heads, --check-seq, --page-size, --iters, --warmup, "
            "--device, --skip-scaling); --json and --cpu (as --device cpu) are passed on too.")
_CP_CONFLICTS = ("cases", "list_cases", "csv_path", "plot_path", "fp8", "reps", "host", "calls")

_HOST_HELP = ("Host time per call instead of GPU time (mla_cupy.bench_host): plan.run, the one-shot mla_prefill "
              "(with q_max_seq_len= and validate=False, and with default arguments), the torch op and "
              "flash_attn_varlen_func, CuPy and torch; each --calls times back to back on a small problem, median "
              "of --reps interleaved rounds (the peers' calls beside them: benchmarks/matrix.py --host). Takes "
              "--reps, --calls and --json.")
_HOST_CONFLICTS = ("cases", "list_cases", "csv_path", "plot_path", "fp8", "cpu")


def cp_command(world_size: int, args: Sequence[str]) -> List[str]:
    """The command line that starts ``world_size`` ranks of :mod:`mla_cupy.distributed.bench`
    with ``args`` (through ``torch.distributed.run``, with this Python)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size),
            "-m", "mla_cupy.distributed.bench", *args]


@contextlib.contextmanager
def _missing_as_click_error():
    """A missing optional package ends the command with its install line, no traceback."""
    try:
        yield
    except MissingDependency as exc:
        raise click.ClickException(str(exc)) from None


def run_cp(world_size: int, args: Sequence[str]) -> int:
    """``mla-cupy bench --cp W``: one rank in this process (returns the runner's exit status), or
    W ranks in place of this process (``os.execvp``, never returns) with NVLink multicast off in
    the environment the ranks inherit."""
    with _missing_as_click_error():
        require("torch", "mla-cupy bench --cp", extra="distributed")
    from .distributed import bench as cp_bench

    if world_size == 1:
        return cp_bench.main(list(args))
    os.environ.update(cp_bench.NVLS_OFF)
    cmd = cp_command(world_size, args)
    os.execvp(cmd[0], cmd)
    raise AssertionError("os.execvp returned")  # only a replaced execvp (tests) gets here


def _options_given(ctx: click.Context, names: Sequence[str]) -> List[str]:
    """The flags (``--cases``, ...) of the parameters ``names`` that the command line set."""
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    return [flags[name] for name in names if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]


def _output_path(path: Optional[str], option: str) -> Optional[str]:
    """``path`` checked before any work (:func:`mla_cupy.bench.check_writable`), or a one-line
    error naming ``option``."""
    if path is None:
        return None
    try:
        return B.check_writable(path)
    except ValueError as exc:
        raise click.ClickException(f"{option}: {exc}") from None


def _write(what: str, path: str, write) -> None:
    """``write(path)``, then one line on stderr saying where ``what`` went; a failure is one line."""
    try:
        write(path)
    except OSError as exc:
        raise click.ClickException(f"could not write {what} to {path}: {exc.strerror or exc}") from None
    click.echo(f"{what} written to {path}", err=True)


def run_host(json_path: Optional[str], **kw) -> None:
    """``mla-cupy bench --host``: :func:`mla_cupy.bench_host.run` with ``kw``, its table, and the
    result as JSON in ``json_path``."""
    from . import bench_host

    json_path = _output_path(json_path, "--json")
    result = bench_host.run(**kw)
    click.echo(bench_host.format_table(result))
    if json_path:
        _write("the rows (JSON)", json_path, lambda p: B.write_json(result, p))


@cli.command(help=_BENCH_HELP, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--cp", "cp_ranks", type=click.IntRange(min=1), default=None, metavar="W", help=_CP_HELP)
@click.option("--host", is_flag=True, help=_HOST_HELP)
@click.option("--calls", type=click.IntRange(min=1), default=300, show_default=True,
              help="With --host: calls back to back in each timed round.")
@click.option("--cases", default=None, help="Comma-separated case names (default: this machine's matrix; see --list).")
@click.option("--list", "list_cases", is_flag=True, help="List every case, marking those that need a GPU, and exit.")
@click.option("--json", "json_path", default=None, help="Write the rows to this JSON file.")
@click.option("--csv", "csv_path", default=None, help="Write the rows to this CSV file.")
@click.option("--plot", "plot_path", default=None, help="Draw TFLOP/s per case and implementation to this PNG.")
@click.option("--fp8", is_flag=True, help="Add the fp8 rows (a Hopper GPU): per token (bf16 rope) and all e4m3 "
                                          "(mla_cupy-fp8-e4m3), with their errors against the dequantized and the "
                                          "unquantized inputs.")
@click.option("--reps", default=20, show_default=True, help="Timed repeats per measurement (median reported).")
@click.option("--cpu", is_flag=True, help="No GPU: time the reference on tiny cases (what CI runs).")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@click.pass_context
def bench(ctx, cp_ranks, host, calls, cases, list_cases, json_path, csv_path, plot_path, fp8, reps, cpu,
          no_progress):
    if cp_ranks is not None:
        given = _options_given(ctx, _CP_CONFLICTS)
        if given:
            raise click.UsageError(f"--cp runs the context-parallel runner; it does not take {', '.join(given)}")
        args = list(ctx.args) + (["--json", json_path] if json_path else []) + (["--device", "cpu"] if cpu else [])
        ctx.exit(run_cp(cp_ranks, args))
    if ctx.args:
        raise click.UsageError(f"unexpected arguments {' '.join(ctx.args)} (only --cp passes arguments on)")
    if host:
        given = _options_given(ctx, _HOST_CONFLICTS)
        if given:
            raise click.UsageError(f"--host times calls on one small problem; it does not take {', '.join(given)}")
        if not _gpu_available():
            raise click.ClickException(f"--host times calls on a GPU: none found ({gpu_missing() or 'no CUDA device'})")
        run_host(json_path, calls=calls, reps=reps)
        return
    if _options_given(ctx, ("calls",)):
        raise click.UsageError("--calls: only with --host")
    gpu = not cpu and _gpu_available()
    if list_cases:
        defaults = {c.name for c in B.resolve_cases(None, gpu)}
        for c in B.ALL_CASES.values():
            tags = ["needs a GPU" if c.needs_gpu else "CPU or GPU"] + (["default here"] if c.name in defaults else [])
            click.echo(f"{c.name:<18} {c.describe():<46} [{', '.join(tags)}]")
        return
    if fp8 and not gpu:
        why = "--cpu was given" if cpu else f"none found: {gpu_missing() or 'no CUDA device'}"
        raise click.ClickException(f"--fp8 times the fp8 kernels on a Hopper GPU ({why})")
    names = [c.strip() for c in cases.split(",") if c.strip()] if cases else None
    try:
        chosen = B.resolve_cases(names, gpu)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--cases") from None
    json_path, csv_path, plot_path = (_output_path(p, o) for p, o in ((json_path, "--json"), (csv_path, "--csv"),
                                                                     (plot_path, "--plot")))
    if plot_path:
        with _missing_as_click_error():
            require("matplotlib", "mla-cupy bench --plot")
    if not gpu:
        click.echo("no GPU: timing the float64 reference on tiny cases", err=True)
        result = B.run_cpu(chosen, reps=reps)
    else:
        result = B.run(chosen, fp8=fp8, reps=reps, progress=not no_progress, checkpoint=json_path)
    click.echo(B.format_table(result))
    if json_path:
        _write("the rows (JSON)", json_path, lambda p: B.write_json(result, p))
    if csv_path:
        _write("the rows (CSV)", csv_path, lambda p: B.write_csv(result, p))
    if plot_path:
        _write("the plot (PNG)", plot_path, lambda p: B.plot(result, p))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``mla-cupy`` and ``python -m mla_cupy``."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="mla-cupy")
