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


def restore():
    """Back to the shipped kernels."""
    jit.kernel_source, reg.prefill_sm90 = ORIG_SOURCE, ORIG_FAMILY
    _clear()


def _clear():
    jit._modules.clear()
    jit._functions.clear()
    api._FUNCTIONS.clear()
    api._PLANS.clear()
