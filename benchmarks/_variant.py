"""Kernel versions side by side in one process, for measurement scripts (benchmarks/ab.py):
``use_sources(directory)`` makes the next plans compile every kernel from an older version's
sources; ``restore`` goes back to the shipped ones. Plans packed meanwhile keep their functions."""
from mla_cupy import _geometry, jit


def use_sources(directory):
    """The next API calls compile every kernel from the .cu/.cuh files of ``directory`` (an older
    version, e.g. written by ``git archive``), so that two versions run in one process."""
    from pathlib import Path

    raw = {p.name: p.read_text(encoding="utf-8") for p in Path(directory).iterdir() if p.suffix in (".cu", ".cuh")}
    saved = dict(jit._RAW_SOURCES)
    jit._RAW_SOURCES.clear()
    jit._RAW_SOURCES.update(raw)
    _clear()
    return saved


def restore(saved_sources=None):
    """Back to the shipped kernels (given what ``use_sources`` returned)."""
    if saved_sources is not None:
        jit._RAW_SOURCES.clear()
        jit._RAW_SOURCES.update(saved_sources)
    _clear()


def _clear():
    """Forget compiled modules and functions, so the next plan compiles from the current sources
    (plans already packed keep the functions they hold)."""
    jit._modules.clear()
    jit._functions.clear()
    _geometry._KERNELS.clear()
