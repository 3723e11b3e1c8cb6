import functools
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run against the checkout (cli.py lives at the top level)
    sys.path.insert(0, str(ROOT))


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (the offline compile of every kernel family); "
                          "or set MLA_CUPY_RUN_SLOW=1")


def run_slow(config) -> bool:
    return bool(config.getoption("--run-slow")) or os.environ.get("MLA_CUPY_RUN_SLOW") == "1"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip without a GPU; tests marked ``slow`` skip unless asked for (the
    default command stays short; CI runs them in a second step with ``--run-slow -m slow``)."""
    skips = []
    if gpu_count() == 0:
        skips.append(("gpu", pytest.mark.skip(reason="no CUDA GPU on this machine")))
    if not run_slow(config):
        skips.append(("slow", pytest.mark.skip(reason="slow: run with --run-slow (or MLA_CUPY_RUN_SLOW=1)")))
    for item in items:
        for keyword, skip in skips:
            if keyword in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def as_if_gpu(monkeypatch):
    """The device checks behave as on a machine with a GPU (host data is told how to move)."""
    import mla_cupy._arrays

    monkeypatch.setattr(mla_cupy._arrays, "gpu_missing", lambda: None)


@pytest.fixture
def as_if_no_gpu(monkeypatch):
    """The device checks behave as on a machine without a GPU."""
    import mla_cupy._arrays

    monkeypatch.setattr(mla_cupy._arrays, "gpu_missing", lambda: "CuPy sees no CUDA device")
