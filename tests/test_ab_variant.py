"""benchmarks/_variant.py on the CPU: switching the kernel sources forgets every cache derived from
the compiled modules, the exported globals included (a variant with a larger shared memory must not
launch with the base kernel's size)."""
from _scripts import load_script

from mla_cupy import _geometry, jit

variant = load_script("benchmarks/_variant.py", "ab_variant")


def _fill():
    jit._modules[("m",)] = object()
    jit._functions[("f",)] = object()
    jit._globals[("g",)] = object()
    _geometry._KERNELS[("k",)] = object()


def _caches():
    return [jit._modules, jit._functions, jit._globals, _geometry._KERNELS]


def test_defines_and_restore_forget_every_compiled_cache():
    sources = dict(jit._RAW_SOURCES)
    saved = [dict(c) for c in _caches()]
    try:
        _fill()
        old = variant.use_defines({"MLA_SM90_HALF_TILE": "0"})
        assert not any(_caches()), "a cache derived from the base modules survived the switch"
        assert jit._RAW_SOURCES[variant._SWITCHED].startswith("#define MLA_SM90_HALF_TILE 0\n")
        _fill()
        variant.restore(old)
        assert not any(_caches())
        assert jit._RAW_SOURCES == sources
    finally:
        jit._RAW_SOURCES.clear()
        jit._RAW_SOURCES.update(sources)
        for c, s in zip(_caches(), saved):
            c.clear()
            c.update(s)
