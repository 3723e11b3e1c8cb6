"""The wheel carries the kernel sources; installed into a fresh venv, it compiles a kernel from
its own copy (NVRTC, no GPU needed) and exposes the mla-cupy command."""
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
    assert not any(n.startswith("tests/") for n in names)


def test_installed_wheel_compiles_from_its_own_kernels(wheel, tmp_path):
    """Install the wheel with its cuda13 extra into a fresh venv (pip's cache makes this quick after
    the CI install), run from a directory outside the checkout, and compile a kernel from the
    installed sources; the mla-cupy command works there too."""
    pytest.importorskip("cupy")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"{wheel}[cuda13]"], check=True, timeout=900)
    script = (
        "import mla_cupy, mla_cupy.jit as j, mla_cupy._registry as r\n"
        "from mla_cupy.masks import CausalMask\n"
        "from mla_cupy._arrays import BF16\n"
        f"assert str(j.KERNEL_DIR).startswith({str(venv)!r}), j.KERNEL_DIR\n"
        "f, names = r.prefill_sm80(BF16, CausalMask())\n"
        "print(len(j.compile_offline(f, names[:1], 'sm_90a')), j.KERNEL_DIR)\n"
    )
    res = subprocess.run([str(py), "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    size, kdir = res.stdout.split()
    assert int(size) > 1000 and kdir.endswith("mla_cupy/kernels")
    res = subprocess.run([str(venv / "bin" / "mla-cupy"), "smoke", "--cpu"], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "no GPU: ran the float64 reference only" in res.stdout
