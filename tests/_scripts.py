"""The repository's scripts (``benchmarks/``, ``examples/``), imported by the CPU tests as modules."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "benchmarks") not in sys.path:  # the scripts import each other (peers.py) as a script run does
    sys.path.append(str(ROOT / "benchmarks"))


def load_script(relpath: str, name: str):
    """The script at ``ROOT / relpath`` executed as module ``name``, registered in ``sys.modules``
    first (dataclasses look their module up while the class is made)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
