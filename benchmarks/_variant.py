"""Compile-time kernel variants for measurement scripts: text edits of a kernel source, compiled for
one run only (never shipped). ``use_variant(filename, edits, names)`` makes the next API calls
compile ``kernels/<filename>`` with ``edits`` applied, as a family of just ``names(dtype, mask, variant)``."""
from mla_cupy import _registry as reg, api, jit

ORIG_SOURCE = jit.kernel_source
ORIG_FAMILY = reg.prefill_sm90


def use_variant(filename, edits, paged=(False, True)):
    """Edits [(old, new), ...] of kernels/<filename>; the Hopper prefill family shrinks to the
    instantiations with output in the input dtype, for the ``paged`` flags given."""
    def source(name):
        text = ORIG_SOURCE(name)
        if name == filename:
            for a, b in edits:
                assert a in text, a
                text = text.replace(a, b)
        return text

    jit.kernel_source = source
    reg.prefill_sm90 = lambda dtype, mask, v="bf16": (reg.PREFILL_SM90[0], tuple(
        reg.prefill_sm90_name(dtype, dtype, mask, p, v) for p in paged))
    _clear()


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
    """Back to the shipped kernels (and sources, given what ``use_sources`` returned)."""
    if saved_sources is not None:
        jit._RAW_SOURCES.clear()
        jit._RAW_SOURCES.update(saved_sources)
    jit.kernel_source, reg.prefill_sm90 = ORIG_SOURCE, ORIG_FAMILY
    _clear()


def _clear():
    jit._modules.clear()
    jit._functions.clear()
    api._FUNCTIONS.clear()
    api._PLANS.clear()
