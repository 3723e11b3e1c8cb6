"""The test markers: ``gpu`` tests skip without a GPU; ``slow`` tests skip unless asked for with
``--run-slow`` (or MLA_CUPY_RUN_SLOW=1), also when ``-m`` selects markers."""
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")

TESTS = '''
import pytest

def test_fast():
    pass

@pytest.mark.slow
def test_slow():
    pass

@pytest.mark.gpu
def test_gpu():
    pass
'''


@pytest.fixture
def suite(pytester, monkeypatch):
    monkeypatch.delenv("MLA_CUPY_RUN_SLOW", raising=False)
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: gpu\n    slow: slow\n")
    pytester.makepyfile(test_it=TESTS)
    return pytester


def _outcomes(result) -> dict:
    return {k: v for k, v in result.parseoutcomes().items() if k in ("passed", "skipped", "deselected")}


def _want(**counts) -> dict:
    return {k: v for k, v in counts.items() if v}


def test_slow_tests_skip_by_default_and_run_when_asked(suite, monkeypatch):
    from conftest import gpu_count

    gpu = 1 if gpu_count() else 0
    assert _outcomes(suite.runpytest("-p", "no:cacheprovider")) == _want(passed=1 + gpu, skipped=2 - gpu)
    assert _outcomes(suite.runpytest("-p", "no:cacheprovider", "--run-slow")) == _want(passed=2 + gpu, skipped=1 - gpu)
    assert _outcomes(suite.runpytest("-p", "no:cacheprovider", "--run-slow", "-m", "slow")) == {"passed": 1, "deselected": 2}
    assert _outcomes(suite.runpytest("-p", "no:cacheprovider", "-m", "gpu")) == (
        {"passed": 1, "deselected": 2} if gpu else {"skipped": 1, "deselected": 2})
    monkeypatch.setenv("MLA_CUPY_RUN_SLOW", "1")
    assert _outcomes(suite.runpytest("-p", "no:cacheprovider", "-m", "slow")) == {"passed": 1, "deselected": 2}
