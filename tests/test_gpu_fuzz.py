"""Random problems against the float64 reference (pytest -m gpu): the first MLA_FUZZ_EXAMPLES
(default 20) problems of seed MLA_FUZZ_SEED (default 0) of the generator in _fuzz.py, which go
round every variant (plain and paged rope, chunked, accumulate, fp8 per token, fp8 rope, all-e4m3,
the backward) on every kernel this GPU runs, at every mask. ``python benchmarks/fuzz.py`` (``bash benchmarks/gpu.sh
verify fuzz N``) runs thousands of the same problems with progress, resume and shrinking."""
import os

import pytest

import _fuzz
from gpu_util import KERNELS

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("MLA_FUZZ_SEED", "0"))
COUNT = int(os.environ.get("MLA_FUZZ_EXAMPLES", "20"))


@pytest.mark.parametrize("index", range(COUNT), ids=lambda i: f"{i}-{_fuzz.draw(SEED, i).combo.replace('/', '-')}")
def test_fuzz_against_reference(index):
    p = _fuzz.draw(SEED, index)
    if p.kernel not in KERNELS:
        pytest.skip(f"the {p.kernel} kernel does not run on this GPU")
    try:
        _fuzz.check(p)
    except AssertionError as exc:
        raise AssertionError(f"{_fuzz.describe(p)}: {exc}\nreproduce and shrink: "
                             f"{_fuzz.repro_index(SEED, index)}") from exc
