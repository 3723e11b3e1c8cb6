"""Kernel versions side by side in one process, for measurement scripts (benchmarks/ab.py):
``use_sources(directory)`` makes the next plans compile every kernel from an older version's
sources, ``use_defines({...})`` from the shipped ones with compile-time switches set (e.g.
``MLA_SM90_SPLIT_MASKED=0``, kernels/sm90/config.cuh); ``restore`` goes back to the shipped ones.
Plans packed meanwhile keep their functions."""
from pathlib import Path

from mla_cupy import _geometry, jit

# The Hopper kernel's entry file: switches are defined at its top, before every header.
_SWITCHED = "mla_prefill_sm90.cu"


def use_sources(directory):
    """The next API calls compile every kernel from the .cu/.cuh files under ``directory`` (an
    older version of kernels/, e.g. written by ``git archive``), so that two versions run in one
    process. Its kernels must take the parameters the current launch code packs. ``directory`` is
    the kernels folder itself or a folder holding it (what ``git archive REV kernels | tar -x -C
    DIR`` writes)."""
    root = Path(directory)
    if (root / "kernels").is_dir():
        root = root / "kernels"
    raw = {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in root.rglob("*")
           if p.suffix in (".cu", ".cuh")}
    return _swap(raw)


def use_defines(defines, entry: str = _SWITCHED):
    """The next API calls compile the shipped kernels with ``#define NAME VALUE`` for each item of
    ``defines`` at the top of ``entry``'s source (the Hopper forward kernel's by default; the
    backward's: ``mla_backward_sm90.cu``)."""
    raw = dict(jit._RAW_SOURCES)
    raw[entry] = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + raw[entry]
    return _swap(raw)


def _swap(raw):
    saved = dict(jit._RAW_SOURCES)
    jit._RAW_SOURCES.clear()
    jit._RAW_SOURCES.update(raw)
    _clear()
    return saved


def restore(saved_sources=None):
    """Back to the shipped kernels (given what ``use_sources`` or ``use_defines`` returned)."""
    if saved_sources is not None:
        jit._RAW_SOURCES.clear()
        jit._RAW_SOURCES.update(saved_sources)
    _clear()


def _clear():
    """Forget compiled modules, functions and the globals read from them (the exported parameter
    layout and geometry: a variant's shared-memory size is its own), so the next plan compiles from
    the current sources (plans already packed keep the functions they hold)."""
    jit._modules.clear()
    jit._functions.clear()
    jit._globals.clear()
    _geometry._KERNELS.clear()
