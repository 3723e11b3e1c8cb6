"""Every template instantiation compiles, for every architecture it targets, through NVRTC alone
(no GPU needed), with no register spills and no serialized wgmma. Modules compile in parallel, one
process per core; compiling them all takes minutes, so those tests are marked ``slow``."""
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from mla_cupy import _geometry, dims, jit
from mla_cupy import _registry as reg
from mla_cupy._arrays import BF16, FP16
from mla_cupy._launch import ArgPack
from mla_cupy._registry import family_label
from mla_cupy.masks import MASKS, CausalMask, Mask, NullMask

FAMILIES = reg.all_families()


def _leaf(name: str) -> str:
    """``mla::sm90::kGeometry<mla::CausalMask>`` -> ``kGeometry``."""
    return name.split("<", 1)[0].rsplit("::", 1)[-1]


def _family_mask(names) -> Mask:
    """The mask of a prefill family's kernels (their third template argument)."""
    cpp = next(n for n in names if reg.is_kernel(n)).split("<", 1)[1].split(", ")[2]
    return next(m for m in MASKS if m.cpp_name == cpp)


def _exported(build, names):
    """(parameter struct, geometry by name) a family's cubin exports (None, None without exports)."""
    exports = [n for n in names if _leaf(n).startswith(("kParam", "kGeometry"))]
    if len(exports) != 4:
        return None, None
    layout, param_names, geometry_names, geometry = (build.global_bytes(n) for n in exports)
    return (ArgPack.from_export(np.frombuffer(layout, np.int32), param_names),
            _geometry.geometry_of(np.frombuffer(geometry, np.int32), geometry_names))


def _compile(job):
    """(cubin size, error or "", every exported table of the family in the cubin, the functions
    that use local memory as (name expression or mangled name, ptxas' report), ptxas'
    serialized-wgmma lines, the exported parameter struct and geometry) of one family."""
    arch, (filename, names) = job
    try:
        build = jit.compile_offline_with_log(filename, names, arch)
    except Exception as exc:  # reported per family by the tests below
        return 0, f"{type(exc).__name__}: {exc}", False, [], [], (None, None)
    expression = {mangled: name for name, mangled in build.lowered.items()}
    spills = [(expression.get(f.name, f.name), f) for f in build.functions().values() if f.spills]
    cubin = build.binary
    tables = [build.lowered[n].encode() for n in names if _leaf(n).startswith(("kParam", "kGeometry"))]
    return (len(cubin), "", all(t in cubin for t in tables), spills, build.serialized_wgmma(),
            _exported(build, names))


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("cupy")
    with ProcessPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as ex:
        return dict(zip(range(len(FAMILIES)), ex.map(_compile, FAMILIES)))


FAMILY_IDS = [f"{a}-{family_label(f)}" for a, f in FAMILIES]


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(FAMILIES)), ids=FAMILY_IDS)
def test_family_compiles(compiled, i):
    size, err, has_tables, _, _, _ = compiled[i]
    assert not err, err
    assert size > 1000  # a real cubin came back
    filename, names = FAMILIES[i][1]
    exports = (reg.sm90_exports(*_sm90_args(names)) if filename == reg.PREFILL_SM90[0] else
               REQUIRED_EXPORTS.get(filename, ()))
    # the launch code reads the parameter struct and the geometry from the module
    assert set(exports) <= set(names) and has_tables


def _sm90_args(names):
    """(dtype, mask, variant, pairs) of a Hopper family, from its first kernel's name."""
    mask = _family_mask(names)
    for dtype in (BF16, FP16):
        for variant in reg.SM90_VARIANTS:
            for pairs in ((False, True) if variant in reg.SM90_PAIRED else (False,)):
                if reg.prefill_sm90(dtype, mask, variant, pairs)[1] == tuple(names):
                    return dtype, mask, variant, pairs
    raise AssertionError(f"no Hopper family of {names[0]}")


# the parameter list of each module, in the kernels' text (the fake GPU packs from them: tests/_fake_gpu.py)
PARAM_LISTS = {reg.PREFILL_SM90[0]: "MLA_SM90_PARAMS", reg.PREFILL_SM80[0]: "MLA_SM80_PARAMS",
               reg.TRANSPOSE_V[0]: "MLA_VT_PARAMS", reg.ROPE_GATHER[0]: "MLA_ROPE_GATHER_PARAMS"}
EXPORTING = [i for i, (_, f) in enumerate(FAMILIES) if f[0] in PARAM_LISTS]


@pytest.mark.slow
@pytest.mark.parametrize("i", EXPORTING, ids=[FAMILY_IDS[i] for i in EXPORTING])
def test_exported_facts_are_what_python_states_without_a_module(compiled, i):
    """What the Python side states of a kernel without a compiled module is what the compiled module
    exports: its parameter struct is the one packed from the parameter list read from the kernel's
    text (dims.param_fields), and a Hopper variant's geometry under its mask cuts the work as
    _registry.sm90_schedule says (the reference's reach of a NaN in v follows it)."""
    _, err, _, _, _, (pack, geometry) = compiled[i]
    assert not err, err
    filename, names = FAMILIES[i][1]
    parsed = ArgPack.from_fields(dims.param_fields(PARAM_LISTS[filename]))
    assert pack.dtype == parsed.dtype and pack.names == parsed.names
    if filename == reg.PREFILL_SM90[0]:
        _, mask, variant, _ = _sm90_args(names)
        sched = reg.sm90_schedule(variant, mask)
        assert {n: geometry[n] for n in sched._fields} == sched._asdict(), geometry
        assert geometry["threads"] == 128 * (1 + geometry["block_m"] // geometry["q_rows"])


#: The tables each module must export besides the Hopper prefill's (per mask: sm90_exports).
REQUIRED_EXPORTS = {reg.PREFILL_SM80[0]: reg.SM80_EXPORTS, reg.BACKWARD_SM80[0]: reg.BWD_SM80_EXPORTS,
                    reg.BACKWARD_SM90[0]: reg.BWD_SM90_EXPORTS,
                    reg.BACKWARD_PREPOST: reg.BWD_PRE_EXPORTS + reg.BWD_DQ_EXPORTS + reg.BWD_ROPE_EXPORTS}


# The portable kernel runs at its register limit (255): ptxas spills a few bytes in some of its
# paged, chunked or windowed instantiations (measured with this test's report: 4-8 bytes of stack
# frame), outside its mainloop. Every other family, the Hopper kernel's included, must not spill.
NO_SPILL = [i for i, (_, f) in enumerate(FAMILIES) if f[0] != reg.PREFILL_SM80[0]]

# The one kernel allowed a little local memory, by its template's name: the Hopper backward kernel
# (kernels/mla_backward_sm90.cu). Its producer warpgroup runs at 40 registers (sm90_bwd/config.cuh:
# kProducerRegs, setmaxnreg: all that the consumers' 232 leave of the launch's 168 per thread) while
# its load thread and dq thread decode key tiles and walk the query blocks, and its consumers hold
# 232 registers' worth of accumulators: ptxas spills a few scalars in both, outside the step loop
# (benchmarks/sass.py: no local load or store in it), which the consumers reload once per head and
# the producer's threads once per tile (NVRTC 13.0, its ten instantiations: up to 112 bytes of stack
# frame, 200 of spill stores and 236 of spill loads, the sliding window's); the ceiling leaves a few
# bytes. ptxas reports per kernel, not per warpgroup, so the allowance is a ceiling on those bytes
# for that kernel alone, every other backward kernel (the portable one, the pre-pass and
# post-passes) must have none, and a growth past the ceiling fails as any spill does.
#: kernel template -> the most (stack frame, spill stores, spill loads) bytes it may report
SPILL_ALLOWANCE = {reg.BACKWARD_SM90[1]: (120, 208, 244)}


def _spill_allowed(name: str, f) -> bool:
    limit = SPILL_ALLOWANCE.get(name.split("<", 1)[0])
    return limit is not None and all(x <= m for x, m in zip((f.stack_frame, f.spill_stores, f.spill_loads), limit))


@pytest.mark.slow
@pytest.mark.parametrize("i", NO_SPILL, ids=[FAMILY_IDS[i] for i in NO_SPILL])
def test_family_has_no_spills_nor_serialized_wgmma(compiled, i):
    """ptxas' report of every function of the family: no stack frame, spill stores or spill loads
    (but for :data:`SPILL_ALLOWANCE`), and no advisory that wgmma instructions were serialized
    (C7511, C7514, C7515, C7518, C7520 and kin: :data:`mla_cupy.jit.WGMMA_SERIALIZED` matches the
    message, whatever the code)."""
    size, err, _, spills, serialized, _ = compiled[i]
    assert not err, err
    bad = [f"{name}: {f.stack_frame} bytes stack frame, {f.spill_stores} bytes spill stores, "
           f"{f.spill_loads} bytes spill loads" for name, f in spills if not _spill_allowed(name, f)]
    assert not bad, "local memory in use:\n" + "\n".join(bad)
    assert not serialized, "ptxas serialized wgmma:\n" + "\n".join(serialized)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_86", "sm_89"])
def test_portable_backward_one_stage_build_has_no_spills(arch):
    """GPUs with 99 KiB of shared memory per CTA (sm_86, sm_89: the L40) get the portable backward
    kernel with one q / dout stage (kernels/mla_backward_sm80.cu: kStages), a build CI's archs never
    make: its instantiations must not spill either (its loop-invariant stage address once did)."""
    pytest.importorskip("cupy")
    from mla_cupy._arrays import BF16

    names = tuple(reg.backward_name("sm80", BF16, m) for m in MASKS) + reg.BWD_SM80_EXPORTS
    build = jit.compile_offline_with_log(reg.BACKWARD_SM80[0], names, arch)
    funcs = build.functions()
    kernels = [build.lowered[n] for n in names if reg.is_kernel(n)]
    assert set(kernels) <= set(funcs)
    spills = [f"{funcs[k].name}: {funcs[k].stack_frame} B stack" for k in kernels if funcs[k].spills]
    assert not spills, "local memory in use:\n" + "\n".join(spills)


def test_spill_allowance_is_the_hopper_backward_kernels_alone():
    """The allowance names one kernel template, and holds to its ceiling in every field."""
    f = jit.PtxasFunction("k", stack_frame=40, spill_stores=52, spill_loads=56)
    hopper = reg.backward_name("sm90", reg.BF16, CausalMask())
    assert set(SPILL_ALLOWANCE) == {reg.BACKWARD_SM90[1]} and _spill_allowed(hopper, f)
    assert not _spill_allowed(reg.backward_name("sm80", reg.BF16, CausalMask()), f)
    assert not _spill_allowed(reg.backward_pre_name(reg.BF16, reg.BF16), f)
    stack, stores, loads = SPILL_ALLOWANCE[reg.BACKWARD_SM90[1]]
    assert _spill_allowed(hopper, jit.PtxasFunction("k", stack_frame=stack, spill_stores=stores, spill_loads=loads))
    assert not _spill_allowed(hopper, jit.PtxasFunction("k", stack_frame=stack + 8))
    assert not _spill_allowed(hopper, jit.PtxasFunction("k", spill_stores=stores + 4))
    assert not _spill_allowed(hopper, jit.PtxasFunction("k", spill_loads=loads + 4))


# Switches of the Hopper kernel kept for A/B measurements (kernels/sm90/config.cuh), built away from
# their defaults: (define, value, variant, mask, paged). Their plain-rope kernels (with `paged` their
# paged ones too) must compile as cleanly as the defaults, so that a measurement times the code the
# switch describes.
SWITCH_BUILDS = [("MLA_SM90_LAZY_RESCALE", "1", "bf16", CausalMask(), False),
                 ("MLA_SM90_LAZY_RESCALE", "1", "fp8", CausalMask(), False),
                 ("MLA_SM90_LAZY_RESCALE", "2", "bf16", CausalMask(), True),
                 ("MLA_SM90_LAZY_RESCALE", "2", "fp8", CausalMask(), True),
                 ("MLA_SM90_LAZY_RESCALE", "2", "e4m3", CausalMask(), False),
                 ("MLA_SM90_LAZY_RESCALE", "1", "e4m3", NullMask(), False),
                 ("MLA_SM90_LAZY_RESCALE", "0", "fp8", CausalMask(), True),
                 ("MLA_SM90_FP8_TURNS", "2", "fp8", CausalMask(), True),
                 ("MLA_SM90_FP8_TURNS", "2", "e4m3", CausalMask(), False),
                 ("MLA_SM90_FP8_TURNS", "0", "e4m3", CausalMask(), False),
                 ("MLA_SM90_FP8_ROWSUM_MMA", "0", "e4m3", CausalMask(), False),
                 ("MLA_SM90_FP8_ROWSUM_MMA", "0", "fp8", CausalMask(), True),
                 ("MLA_SM90_FP8_EXP_BYTES", "0", "e4m3", CausalMask(), False),
                 ("MLA_SM90_FP8_EXP_BYTES", "0", "fp8", CausalMask(), True),
                 ("MLA_SM90_TRACE", "1", "bf16", CausalMask(), True),
                 ("MLA_SM90_TRACE", "1", "fp8", CausalMask(), True),
                 ("MLA_SM90_TRACE", "1", "e4m3", CausalMask(), False)]


@pytest.mark.slow
@pytest.mark.parametrize("define, value, variant, mask, paged", SWITCH_BUILDS,
                         ids=[f"{d}={v}-{var}-{type(m).__name__}{'-paged' if pg else ''}"
                              for d, v, var, m, pg in SWITCH_BUILDS])
def test_switch_builds_have_no_spills_nor_serialized_wgmma(define, value, variant, mask, paged):
    pytest.importorskip("cupy")
    from mla_cupy._arrays import BF16

    filename, names = reg.prefill_sm90(BF16, mask, variant)
    build = jit.compile_offline_with_log(filename, names, "sm_90a", defines={define: value})
    checked = {build.lowered[n] for n in names if reg.is_kernel(n) and (paged or n.endswith(", false>"))}
    funcs = build.functions()
    assert checked <= set(funcs)
    assert not paged or len(checked) == 4  # out in bf16 and float32, plain and paged rope
    spills = [f"{f.name}: {f.stack_frame} B stack, {f.spill_stores} B spill stores" for m, f in funcs.items()
              if m in checked and f.spills]
    assert not spills, "local memory in use:\n" + "\n".join(spills)
    assert not build.serialized_wgmma(), "ptxas serialized wgmma:\n" + "\n".join(build.serialized_wgmma())


def test_matrix_covers_every_dtype_mask_and_arch():
    from mla_cupy._arrays import BF16, FP16, FP32
    from mla_cupy.masks import MASKS

    for f, want_archs in (("mla_prefill_sm80.cu", {"sm_80", "sm_90a"}), ("mla_prefill_sm90.cu", {"sm_90a"})):
        assert {a for a, (ff, _) in FAMILIES if ff == f} == want_archs
    names = {n for _, (ff, nn) in FAMILIES for n in nn}
    for m in MASKS:
        for t in (BF16, FP16):
            for o in (t, FP32):
                for paged in (False, True):
                    assert reg.prefill_sm80_name(t, o, m, paged) in names
                    assert reg.prefill_sm90_name(t, o, m, paged) in names
                    if t == BF16:  # the fp8 per-token and fp8-rope variants
                        for variant in ("fp8", "fp8_rope"):
                            assert reg.prefill_sm90_name(t, o, m, paged, variant) in names
    assert "mla::sm90::mla_prefill_kernel<mla::sm90::Variant16<__half>, float, mla::CausalMask, true>" in names


def test_backward_families_cover_every_dtype_mask_and_arch():
    from mla_cupy._arrays import BF16, FP16, FP32
    from mla_cupy.masks import MASKS

    for f, want_archs in ((reg.BACKWARD_SM80[0], {"sm_80", "sm_90a"}), (reg.BACKWARD_SM90[0], {"sm_90a"}),
                          (reg.BACKWARD_PREPOST, {"sm_80", "sm_90a"})):
        assert {a for a, (ff, _) in FAMILIES if ff == f} == want_archs
    names = {n for _, (ff, nn) in FAMILIES for n in nn}
    for t in (BF16, FP16):
        for m in MASKS:
            assert reg.backward_name("sm80", t, m) in names and reg.backward_name("sm90", t, m) in names
        for o in (t, FP32):
            assert reg.backward_pre_name(t, o) in names
        for layout in reg.BWD_DQ_LAYOUT.values():
            assert reg.backward_dq_name(t, layout) in names
        assert reg.backward_rope_name(t) in names
    assert reg.backward_name("sm80", FP16, CausalMask()) == "mla::sm80_bwd::mla_backward_kernel<__half, mla::CausalMask>"
    assert reg.backward_dq_name(BF16, reg.BWD_DQ_LAYOUT["sm90"]) == "mla::bwd::dq_kernel<__nv_bfloat16, mla::bwd::kDqWgmma>"
    with pytest.raises(ValueError, match="dq layout"):
        reg.backward_dq_name(BF16, "kDqRowMajor")
    # one family per (file, dtype[, mask]), each with its module's exports
    for kernel in ("sm80", "sm90"):
        fam = reg.backward_family(kernel, BF16, CausalMask())
        assert fam[1] == (reg.backward_name(kernel, BF16, CausalMask()),) + reg.backward_exports(kernel)
    assert reg.family_label(reg.backward_prepost(FP16)) == "mla_backward_prepost<fp16>"
    assert reg.family_label(reg.backward_sm80(BF16, CausalMask())) == "mla_backward_sm80<bf16, CausalMask>"


def test_sm90a_features_are_enabled():
    """NOTES: CuPy appends its own -arch=sm_90; NVRTC must keep sm_90a (undocumented). The PTX must
    target sm_90a, and the arch-specific macro must be defined."""
    pytest.importorskip("cupy")
    from cupy._core.core import assemble_cupy_compiler_options
    from cupy.cuda import compiler

    src = "#ifndef __CUDA_ARCH_FEAT_SM90_ALL\n#error sm_90a features missing\n#endif\nextern \"C\" __global__ void f(){}\n"
    opts = assemble_cupy_compiler_options(jit._options("sm_90a")) + ("-arch=sm_90",)  # CuPy's own appended flag
    ptx, _ = compiler._NVRTCProgram(src, "probe.cu", method="ptx").compile(
        tuple(o.replace("-arch=sm_", "-arch=compute_") for o in opts))
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert ".target sm_90a" in text


def test_kernel_source_inlines_headers():
    src = jit.kernel_source("mla_prefill_sm80.cu")
    assert '#include "' not in src
    assert "struct SwizzledTile" in src and "struct CausalMask" in src
    assert src.count("struct SwizzledTile") == 1  # each header once


def test_compile_time_switches(monkeypatch):
    """MLA_CUPY_DEFINES's items (jit.DEFINES) and a call's own become #define lines before the
    source; a name in both takes the call's value."""
    assert jit.parse_defines("MLA_SM90_SMEM_EPILOGUE=0, A=0 B") == {"MLA_SM90_SMEM_EPILOGUE": "0", "A": "0", "B": "1"}
    assert jit.parse_defines("") == {}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        jit.parse_defines("2X=1")
    monkeypatch.setattr(jit, "DEFINES", {"MLA_SM90_SMEM_EPILOGUE": "0", "A": "1"})
    src = jit.kernel_source("mla_prefill_sm90.cu", {"A": "3"})
    head = src.split("// ----", 1)[0]
    assert head == "#define MLA_SM90_SMEM_EPILOGUE 0\n#define A 3\n"
    monkeypatch.setattr(jit, "DEFINES", {})
    assert jit.kernel_source("mla_prefill_sm90.cu").startswith("// ----")


# ---- the checks above, on kernels made to fail them (fast: tiny sources) ----
_WGMMA = ('asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, 1, 1, 1, 0, 0;"'
          ' : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])'
          ' : "l"(da), "l"(db));\n')


def _probe(src, monkeypatch):
    """compile_offline_with_log of ``src`` as a kernel file of its own, for sm_90a."""
    monkeypatch.setitem(jit._RAW_SOURCES, "probe.cu", src)
    return jit.compile_offline_with_log("probe.cu", (), "sm_90a")


def test_log_reports_serialized_wgmma(monkeypatch):
    """A plain write to a wgmma accumulator between two wgmma of one pipeline stage makes ptxas
    serialize them (C7511 with NVRTC 13.0): the check must see it, and not see it without the write."""
    pytest.importorskip("cupy")
    body = ('extern "C" __global__ void f(float* x, unsigned long long da, unsigned long long db) {\n'
            '  float d[8];\n  for (int i = 0; i < 8; ++i) d[i] = x[i];\n'
            '  asm volatile("wgmma.fence.sync.aligned;");\n' + _WGMMA + "{WRITE}" + _WGMMA +
            '  asm volatile("wgmma.commit_group.sync.aligned;");\n'
            '  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");\n'
            '  for (int i = 0; i < 8; ++i) x[i + 8 * threadIdx.x] = d[i];\n}\n')
    bad = _probe(body.replace("{WRITE}", "  d[0] = 3.f;\n"), monkeypatch)
    assert bad.serialized_wgmma(), bad.log
    assert all(jit.WGMMA_SERIALIZED.search(a) for a in bad.serialized_wgmma())
    good = _probe(body.replace("{WRITE}", ""), monkeypatch)
    assert not good.serialized_wgmma(), good.log
    assert "f" in good.functions() and good.functions()["f"].registers > 0  # the -v report is there


def test_log_reports_local_memory(monkeypatch):
    """A per-thread array indexed at run time lives in local memory: a stack frame in the report."""
    pytest.importorskip("cupy")
    src = ('extern "C" __global__ void f(float* x, int i) {\n  float a[512];\n'
           '  for (int j = 0; j < 512; ++j) a[j] = x[j * threadIdx.x];\n  a[i & 511] += 1.f;\n'
           '  x[threadIdx.x] = a[(i >> 9) & 511];\n}\n')
    fn = _probe(src, monkeypatch).functions()["f"]
    assert fn.spills and fn.stack_frame >= 2048, fn


def test_ptxas_log_parser_reads_every_field():
    log = ("ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "insufficient register resources for the wgmma pipeline in the function 'k'\n"
           "ptxas info    : 0 bytes gmem\n"
           "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
           "ptxas info    : Function properties for k\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 2 barriers, 8 bytes cumulative stack size, 1024 bytes smem\n"
           "ptxas info    : Function properties for _Z5otherPf\n"
           "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    fns = jit.parse_ptxas_log(log)
    assert fns["k"] == jit.PtxasFunction("k", 8, 4, 12, 168, 1024, 2)
    assert fns["_Z5otherPf"] == jit.PtxasFunction("_Z5otherPf") and not fns["_Z5otherPf"].spills
    build = jit.OfflineBuild(b"", log, {})
    assert build.advisories() == build.serialized_wgmma() == [log.splitlines()[0].strip()]


def test_offline_cubin_is_whole():
    """CuPy's getCUBIN drops the cubin's last byte; compile_offline gives it back, so the ELF ends
    where its header says its tables end."""
    pytest.importorskip("cupy")
    import struct

    cubin = jit.compile_offline(*reg.SPIN, "sm_90a")
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    assert len(cubin) == max(phoff + phentsize * phnum, shoff + shentsize * shnum)
