"""``mla-cupy``: the command line of mla_cupy (info, smoke, bench)."""
from __future__ import annotations

import json
import sys
import time

import click
import numpy as np


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@click.group()
@click.version_option(package_name="mla_cupy")
def cli():
    """MLA (DeepSeek V2/V3) prefill kernels for CuPy."""


@cli.command()
def info():
    """CuPy / CUDA versions, the device and its arch, and which kernels are compiled or cached."""
    import mla_cupy
    from mla_cupy import _registry as reg, jit

    click.echo(f"mla_cupy {mla_cupy.__version__}  kernels: {jit.KERNEL_DIR}")
    click.echo(f"kernel families: {len(reg.all_families())} (arch, module) pairs for CI; sources: {', '.join(jit.iter_sources())}")
    try:
        import cupy
    except ImportError:
        click.echo("cupy: not installed (pip install 'mla_cupy[cuda12]' or 'mla_cupy[cuda13]'); reference only")
        return
    click.echo(f"cupy {cupy.__version__}")
    try:
        click.echo(f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, NVRTC {cupy.cuda.nvrtc.getVersion()}")
    except Exception as exc:
        click.echo(f"CUDA runtime / NVRTC: unavailable ({type(exc).__name__})")
    if not _gpu_available():
        click.echo("device: none (no CUDA GPU visible): kernels can still be compiled offline with NVRTC")
    else:
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        cc = dev.compute_capability
        click.echo(f"device {dev.id}: {name}, compute capability {cc}, target {jit.arch_for_capability(cc)}, "
                   f"{props['multiProcessorCount']} SMs")
    import os
    from pathlib import Path

    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    n = len(list(cache.glob("*.cubin"))) if cache.is_dir() else 0
    click.echo(f"CuPy kernel cache: {cache} ({n} cubins on disk)")
    for f, arch, names in jit.compiled_modules():
        click.echo(f"  compiled in this process: {f} [{arch}] {len(names)} instantiations")


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


def _compile_one(job):
    arch, (filename, names) = job
    from mla_cupy import jit

    t0 = time.perf_counter()
    try:
        if arch is None:  # on this GPU, through CuPy's RawModule (fills CuPy's on-disk kernel cache)
            jit.get_function(filename, names, names[0])
        else:
            jit.compile_offline(filename, names, arch)
        return arch, (filename, names), time.perf_counter() - t0, ""
    except Exception as exc:
        return arch, (filename, names), time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"


@cli.command(name="compile")
@click.option("--offline", is_flag=True, help="No GPU: compile every family for every target arch with NVRTC (what CI does).")
@click.option("-j", "--jobs", default=0, help="Parallel processes (default: all cores).")
def compile_cmd(offline, jobs):
    """Compile every kernel family ahead of time (fills CuPy's kernel cache on a GPU machine)."""
    import os
    from concurrent.futures import ProcessPoolExecutor

    from mla_cupy import _registry as reg, jit

    if offline or not _gpu_available():
        todo = reg.all_families()
    else:
        import cupy

        arch = jit.arch_for_capability(cupy.cuda.Device().compute_capability)
        todo = [(None, fam) for a, fam in reg.all_families() if a == arch or (a == "sm_80" and arch != "sm_90a")]
        todo = list({fam: (None, fam) for _, fam in todo}.values())
    t0 = time.perf_counter()
    failed = 0
    with ProcessPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as ex:
        for arch, fam, secs, err in ex.map(_compile_one, todo):
            failed += bool(err)
            click.echo(f"{'FAIL' if err else 'ok  '} {secs:5.1f}s {arch or 'this GPU'} {reg.family_label(fam)}{(' ' + err) if err else ''}")
    click.echo(f"{len(todo) - failed}/{len(todo)} families compiled in {time.perf_counter() - t0:.1f}s")
    if failed:
        sys.exit(1)


@cli.command()
@click.option("--cases", default=None, help="Comma-separated case names (default: the full matrix).")
@click.option("--list", "list_cases", is_flag=True, help="List the case names and exit.")
@click.option("--json", "json_path", default=None, help="Write the rows to this JSON file.")
@click.option("--csv", "csv_path", default=None, help="Write the rows to this CSV file.")
@click.option("--plot", "plot_path", default=None, help="Draw TFLOP/s per case and implementation to this PNG.")
@click.option("--no-peers", is_flag=True, help="Time mla_cupy only.")
@click.option("--reps", default=20, show_default=True, help="Timed repeats per measurement (median reported).")
@click.option("--cpu", is_flag=True, help="No GPU: time the reference on tiny cases (what CI runs).")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def bench(cases, list_cases, json_path, csv_path, plot_path, no_peers, reps, cpu, no_progress):
    """Benchmark against cuDNN SDPA and FlexAttention on this GPU; prints a table."""
    from mla_cupy import bench as B

    pool = B.CPU_CASES if (cpu or not _gpu_available()) else B.DEFAULT_CASES
    if list_cases:
        for c in pool.values():
            click.echo(f"{c.name}: Sq={list(c.sq)} Sk={list(c.sk)} H={c.heads} {'causal' if c.causal else 'non-causal'}")
        return
    names = list(pool) if not cases else [c.strip() for c in cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in pool]
    if unknown:
        raise click.BadParameter(f"unknown case(s) {unknown}; known: {list(pool)}", param_hint="--cases")
    chosen = [pool[n] for n in names]
    if pool is B.CPU_CASES:
        click.echo("no GPU: timing the float64 reference on tiny cases (no peers)", err=True)
        result = B.run_cpu(chosen)
    else:
        result = B.run(chosen, peers=not no_peers, reps=reps, progress=not no_progress, checkpoint=json_path)
    click.echo(B.format_table(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, default=float)
    if csv_path:
        B.write_csv(result, csv_path)
    if plot_path:
        B.plot(result, plot_path)


def main(argv=None):
    cli.main(args=argv, prog_name="mla-cupy")


if __name__ == "__main__":
    main()
