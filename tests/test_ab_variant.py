"""benchmarks/_variant.py on the CPU: switching the kernel sources forgets every cache derived from
the compiled modules, the exported globals included (a variant with a larger shared memory must not
launch with the base kernel's size)."""
import pytest
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


def test_fp8_paged_rope_takes_one_sequence_per_token():
    """ab.py's ``ours-fp8:paged=P`` refuses a batch and the all-e4m3 mode (whose rope is plain
    only) before it quantizes anything."""
    import pytest

    ab = load_script("benchmarks/ab.py", "ab_paged_tool")
    for impl, case in (("ours-fp8", "4x2048"), ("ours-e4m3", "1x8192")):
        base, opts = ab.parse_impl(f"{impl}:paged=64")
        with pytest.raises(SystemExit, match="one-sequence cases, per token"):
            ab.FACTORIES[base](ab.parse_case(case), [], opts)


def test_backward_heads_per_tile_overridden_while_the_plans_pack(monkeypatch):
    """``ours:hpg=N`` (ab.py --backward): the packing's heads-per-tile rule gives N while the plans
    are packed and its own answer again afterwards, also when packing fails."""
    from mla_cupy import _backward

    ab = load_script("benchmarks/ab.py", "ab_hpg")
    rule = _backward.heads_per_group
    seen = []

    def runs(case, sets, opts):
        seen.append(_backward.heads_per_group(128, 10, 132))
        return [(lambda: None, ())]

    monkeypatch.setattr(ab, "_bwd_runs", runs)
    ab._bwd_ours(None, [None], {"hpg": "1"})
    assert seen == [1] and _backward.heads_per_group is rule and rule(128, 10, 132, "sm80") == 2

    def fails(case, sets, opts):
        raise RuntimeError("packing failed")

    monkeypatch.setattr(ab, "_bwd_runs", fails)
    with pytest.raises(RuntimeError, match="packing failed"):
        ab._bwd_ours(None, [None], {"hpg": "2"})
    assert _backward.heads_per_group is rule
