"""The public API's modules carry type hints and type-check as pyproject.toml's ``[tool.mypy]`` says
(``mypy`` from the checkout's root; skipped where mypy is not installed: ``pip install ".[test]"``
brings it), and the package ships its types (``mla_cupy/py.typed``)."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TYPED = ["mla_cupy/api.py", "mla_cupy/prefill_plan.py", "mla_cupy/merge.py"]


def test_the_public_modules_type_check(tmp_path, monkeypatch):
    mypy = pytest.importorskip("mypy.api")
    monkeypatch.chdir(ROOT)
    out, err, status = mypy.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path),
                                 *TYPED])
    assert status == 0, out + err


def test_the_package_says_it_is_typed():
    assert (ROOT / "mla_cupy" / "py.typed").is_file()
