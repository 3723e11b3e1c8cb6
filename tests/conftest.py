import functools
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


def pytest_collection_modifyitems(config, items):
    if gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
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
