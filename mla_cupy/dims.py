"""The kernels' facts that Python code reads without a compiled module, read from the kernel sources'
text by one small parser: where the sources are (:data:`KERNEL_DIR`), a numeric constant
(:func:`kernel_int`: ``constexpr int NAME = 123;``, :func:`kernel_float`), a parameter list (:func:`param_fields`: the
X-macros of ``kernels/params_abi.cuh``), and the model dimensions the checks and the reference use
(:data:`DV`, :data:`DR`, :data:`DQK`, from ``kernels/common.cuh``).

What a compiled module exports (its parameter struct, its geometry: ``mla_cupy._geometry``) is read
from the module itself; what can only be read there but is needed without one (how the Hopper kernel
cuts the work, for the reference: ``mla_cupy._registry.sm90_schedule``) is held to the exports by a
CPU test that compiles the modules offline (``tests/test_compile.py``)."""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Dict, List, Tuple

__all__ = ["KERNEL_DIR", "kernel_int", "kernel_float", "param_fields", "DV", "DR", "DQK"]


def _find_kernel_dir() -> Path:
    here = Path(__file__).resolve().parent
    for cand in (here / "kernels", here.parent / "kernels"):  # installed wheel, then checkout
        if (cand / "common.cuh").is_file():
            return cand
    raise ImportError(f"mla_cupy: kernel sources not found next to {here}")


#: The kernel sources: ``kernels/`` of the checkout, or the copy inside an installed wheel.
KERNEL_DIR: Path = _find_kernel_dir()


@functools.lru_cache(maxsize=None)
def _text(path: str) -> str:
    return (KERNEL_DIR / path).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)  # read once: the checks ask for the schedule's constants on every call
def _literal(path: str, ctype: str, name: str, literal: str) -> str:
    found = re.findall(rf"\bconstexpr {ctype} {re.escape(name)} = ({literal});", _text(path))
    if len(found) != 1:
        raise RuntimeError(f"kernels/{path}: expected one literal 'constexpr {ctype} {name} = ...;', found {len(found)}")
    return found[0]


def kernel_int(path: str, name: str) -> int:
    """The integer constant ``constexpr int NAME = <literal>;`` of ``kernels/<path>`` (it must be
    there once, as a literal)."""
    return int(_literal(path, "int", name, r"-?\d+"))


def kernel_float(path: str, name: str) -> float:
    """The float constant ``constexpr float NAME = <literal>f;`` of ``kernels/<path>``."""
    return float(_literal(path, "float", name, r"-?[0-9.]+(?:e-?\d+)?f").rstrip("f"))


_MACRO = re.compile(r"^#define (\w+)\(X\)((?:[^\n]*\\\n)*[^\n]*)", re.MULTILINE)
_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)
_ITEM = re.compile(r"\bX\(\s*([^,()]+?)\s*,\s*(\w+)\s*\)|\b(\w+)\(X\)")


@functools.lru_cache(maxsize=1)
def _param_macros() -> Dict[str, str]:
    """Every X-macro of a parameter list (``#define NAME(X) ...``) of the kernel sources: its body."""
    macros: Dict[str, str] = {}
    for path in sorted(KERNEL_DIR.rglob("*")):
        if path.suffix in (".cu", ".cuh"):
            for m in _MACRO.finditer(path.read_text(encoding="utf-8")):
                macros[m.group(1)] = _COMMENT.sub(" ", m.group(2).replace("\\\n", " "))
    return macros


def param_fields(macro: str) -> List[Tuple[str, str]]:
    """``(C type, name)`` of every field of the parameter list ``macro`` (e.g. ``"MLA_SM90_PARAMS"``),
    in order, the lists it names (``MLA_ROPE_PARAMS(X)``) expanded in place: what
    ``MLA_DEFINE_PARAMS`` makes a parameter struct of (:meth:`mla_cupy._launch.ArgPack.from_fields`)."""
    body = _param_macros().get(macro)
    if body is None:
        raise KeyError(f"no parameter list {macro}(X) in the kernel sources")
    fields: List[Tuple[str, str]] = []
    for m in _ITEM.finditer(body):
        fields += [(" ".join(m.group(1).split()), m.group(2))] if m.group(2) else param_fields(m.group(3))
    return fields


#: Values and the per-head ("nope") part of q and k (kernels/common.cuh: kDv).
DV = kernel_int("common.cuh", "kDv")
#: The rope part every head shares (kDr).
DR = kernel_int("common.cuh", "kDr")
#: A query's (and a key's) whole head: the nope part and the rope (kDqk).
DQK = DV + DR
