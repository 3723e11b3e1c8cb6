"""The wheel carries the kernel sources; installed into a fresh venv, it compiles a kernel from
its own copy (NVRTC, no GPU needed) and exposes the mla-cupy command."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
                   check=True)
    (whl,) = out.glob("mla_cupy-*.whl")
    return whl


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    prefix = "mla_cupy/kernels/"
    kernels = {n[len(prefix):] for n in names if n.startswith(prefix)}
    assert kernels == {p.relative_to(ROOT / "kernels").as_posix() for p in (ROOT / "kernels").rglob("*")
                       if p.suffix in (".cu", ".cuh")}
    assert "sm90/mainloop.cuh" in kernels  # the Hopper kernel's role headers
    assert "cli.py" not in names and "mla_cupy/cli.py" in names and "mla_cupy/__init__.py" in names
    assert "mla_cupy/py.typed" in names  # the package's type hints are for its users too
    assert not any(n.startswith("tests/") for n in names)


def _venv_with(wheel, tmp_path, extra: str = ""):
    """A fresh venv with the wheel installed (``extra``: e.g. ``"[cuda13]"``; pip's cache makes this
    quick after the CI install); returns (its python, its bin directory, an environment without
    this checkout on PYTHONPATH)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"{wheel}{extra}"], check=True, timeout=900, env=env)
    return py, venv / "bin", env


@pytest.mark.slow
def test_installed_wheel_compiles_from_its_own_kernels(wheel, tmp_path):
    """Install the wheel with its cuda13 extra into a fresh venv, run from a directory outside the
    checkout, and compile a kernel from the installed sources; the mla-cupy command works there too."""
    pytest.importorskip("cupy")
    py, bindir, env = _venv_with(wheel, tmp_path, "[cuda13]")
    venv = bindir.parent
    script = (
        "import mla_cupy, mla_cupy.jit as j, mla_cupy._registry as r\n"
        "from mla_cupy.masks import CausalMask\n"
        "from mla_cupy._arrays import BF16\n"
        f"assert str(j.KERNEL_DIR).startswith({str(venv)!r}), j.KERNEL_DIR\n"
        "f, names = r.prefill_sm80(BF16, CausalMask())\n"
        "print(len(j.compile_offline(f, names[:1], 'sm_90a')), j.KERNEL_DIR)\n"
    )
    res = subprocess.run([str(py), "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    size, kdir = res.stdout.split()
    assert int(size) > 1000 and kdir.endswith("mla_cupy/kernels")
    res = subprocess.run([str(bindir / "mla-cupy"), "smoke", "--cpu"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert "no GPU: ran the float64 reference only" in res.stdout


@pytest.mark.slow
def test_plain_install_runs_the_reference_without_cupy(wheel, tmp_path):
    """``pip install .`` without an extra (NumPy, ml_dtypes, click): the reference, ``mla-cupy
    smoke`` and the GPU API's own message, with no CuPy in the venv."""
    py, bindir, env = _venv_with(wheel, tmp_path)
    script = (
        "import importlib.util, numpy as np, ml_dtypes, mla_cupy\n"
        "assert importlib.util.find_spec('cupy') is None\n"
        "bf = ml_dtypes.bfloat16\n"
        "q, k, r = np.ones((4, 2, 192), bf), np.ones((4, 2, 128), bf), np.ones((4, 1, 64), bf)\n"
        "o = np.array([0, 4], np.uint32)\n"
        "print(mla_cupy.reference.mla_prefill(q, k, k, r, o, o).shape)\n"
        "try:\n"
        "    mla_cupy.mla_prefill(q, k, k, r, o, o)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    res = subprocess.run([str(py), "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    shape, message = res.stdout.splitlines()
    assert shape == "(4, 2, 128)"
    assert message.startswith("mla_prefill needs a CUDA GPU: none found (CuPy is not installed: pip install")
    res = subprocess.run([str(bindir / "mla-cupy"), "smoke"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert "no GPU: ran the float64 reference only" in res.stdout
