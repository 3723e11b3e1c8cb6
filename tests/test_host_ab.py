"""benchmarks/host_ab.py on the CPU: another tree's package imports beside this one under its own
name, with its own kernel sources and classes, and the table pairs each call's rounds."""
import math
import subprocess

import pytest
from _scripts import ROOT, load_script

import mla_cupy
from mla_cupy.bench_host import HostRow
from mla_cupy.masks import SlidingWindowCausalMask

host_ab = load_script("benchmarks/host_ab.py", "host_ab")


def test_the_base_tree_imports_beside_this_package(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD", "mla_cupy", "kernels", "-o", str(tmp_path / "t.tar")],
                   check=True)
    subprocess.run(["tar", "xf", str(tmp_path / "t.tar"), "-C", str(tree)], check=True)
    base = host_ab.load_base(tree, tmp_path / "copy")
    assert base.__name__ == host_ab.BASE_NAME and base is not mla_cupy
    assert base.jit.KERNEL_DIR == (tmp_path / "copy" / "kernels").resolve()
    assert base.CausalMask is not mla_cupy.CausalMask
    m = host_ab.mask_of(base, SlidingWindowCausalMask(7))
    assert type(m) is base.SlidingWindowCausalMask and m == base.SlidingWindowCausalMask(7)


def test_a_tree_without_the_package_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="has no mla_cupy/"):
        host_ab.load_base(tmp_path, tmp_path / "copy")


def test_each_call_is_its_rounds_new_over_base():
    rows = [HostRow("plan.run [base]", "base", 10.0, 8.0, 20.0, [8.0, 10.0, 20.0]),
            HostRow("plan.run [new]", "new", 12.0, 9.0, 12.0, [12.0, 9.0, 10.0])]
    (t,) = host_ab.compare(rows)
    assert t["call"] == "plan.run" and (t["base_us"], t["new_us"]) == (10.0, 12.0)
    assert math.isclose(t["ratio"], 0.9) and math.isclose(t["lo"], 0.5) and math.isclose(t["hi"], 1.5)
