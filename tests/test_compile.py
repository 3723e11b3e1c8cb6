"""Every template instantiation compiles, for every architecture it targets, through NVRTC alone
(no GPU needed). Modules compile in parallel, one process per core."""
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from mla_cupy import _registry as reg
from mla_cupy import jit
from mla_cupy._registry import family_label

FAMILIES = reg.all_families()


def _compile(job):
    arch, (filename, names) = job
    try:
        cubin = jit.compile_offline(filename, names, arch)
        return len(cubin), "", b"kSmemBytesOf" in cubin
    except Exception as exc:  # reported per family by the test below
        return 0, f"{type(exc).__name__}: {exc}", False


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("cupy")
    with ProcessPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as ex:
        return dict(zip(range(len(FAMILIES)), ex.map(_compile, FAMILIES)))


@pytest.mark.parametrize("i", range(len(FAMILIES)), ids=[f"{a}-{family_label(f)}" for a, f in FAMILIES])
def test_family_compiles(compiled, i):
    size, err, has_smem_table = compiled[i]
    assert not err, err
    assert size > 1000  # a real cubin came back
    if FAMILIES[i][1][0] == reg.PREFILL_SM90[0]:  # the launch code reads its shared-memory size from the module
        assert reg.SM90_SMEM_TABLE in FAMILIES[i][1][1] and has_smem_table


def test_matrix_covers_every_dtype_mask_and_arch():
    from mla_cupy.masks import MASKS

    for f, ns, want_archs in (("mla_prefill_sm80.cu", "sm80", {"sm_80", "sm_90a"}), ("mla_prefill_sm90.cu", "sm90", {"sm_90a"})):
        names = [n for a, (ff, nn) in FAMILIES if ff == f for n in nn]
        assert {a for a, (ff, _) in FAMILIES if ff == f} == want_archs
        for m in MASKS:
            for t in ("__nv_bfloat16", "__half"):
                for o in (t, "float"):
                    for paged in ("false", "true"):
                        sfx = ", 0>" if ns == "sm90" else ">"
                        assert f"mla::{ns}::mla_prefill_kernel<{t}, {o}, {m.cpp_name}, {paged}{sfx}" in names
                        if ns == "sm90" and t == "__nv_bfloat16":  # the fp8 per-token and fp8-rope variants
                            for variant in (1, 2):
                                assert f"mla::sm90::mla_prefill_kernel<{t}, {o}, {m.cpp_name}, {paged}, {variant}>" in names


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
