"""The launch code on the CPU: the packed argument buffer (mla_cupy/_launch.py), the parameter
lists (mla_cupy/_prefill_args.py, mla_cupy/fp8.py) against the kernels' C++ signatures, the
shared-memory table the Hopper modules export, and the few tile constants the launch code still
names (mla_cupy/_geometry.py) against the kernels' own, so a kernel edit that is not followed in
Python fails CI."""
import ctypes
import re

import numpy as np
import pytest

from mla_cupy import _geometry, _registry as reg, jit
from mla_cupy._launch import F32, I32, I64, PTR, ArgPack, PreparedLaunch
from mla_cupy._prefill_args import SM80_ARGS, SM90_ARGS, SM90_MAPS
from mla_cupy.fp8 import TRANSPOSE_V_ARGS
from mla_cupy.tma import TENSOR_MAP_DTYPE


class _NoKernel:
    """Stands in for a RawKernel: a prepared launch that is only packed, never launched."""


def test_buffer_layout_and_values():
    pack = ArgPack([("a", I32), ("tm", TENSOR_MAP_DTYPE), ("p", PTR), ("x", F32), ("n", I64)])
    tm = np.zeros(1, TENSOR_MAP_DTYPE)[0]
    tm["opaque"][:] = np.arange(16)
    pl = PreparedLaunch(pack, _NoKernel(), (1, 1, 1), 32, 0, dict(a=-7, tm=tm, p=0xDEADBEEF000, x=1.5, n=-(1 << 40)))
    base = pl._buf.ctypes.data
    ptrs = pl._ptrs
    assert [int(p) - base for p in ptrs] == [0, 64, 192, 200, 208]  # natural alignment, tensor maps on 64 bytes
    assert int(np.frombuffer(ctypes.string_at(int(ptrs[0]), 4), np.int32)[0]) == -7
    assert list(np.frombuffer(ctypes.string_at(int(ptrs[1]), 128), np.uint64)) == list(range(16))
    assert int(np.frombuffer(ctypes.string_at(int(ptrs[2]), 8), np.uint64)[0]) == 0xDEADBEEF000
    assert float(np.frombuffer(ctypes.string_at(int(ptrs[3]), 4), np.float32)[0]) == 1.5
    assert int(np.frombuffer(ctypes.string_at(int(ptrs[4]), 8), np.int64)[0]) == -(1 << 40)
    assert ctypes.c_uint64.from_address(pl._pptr).value == int(ptrs[0])
    # a run rewrites single fields in place, leaving the others as packed
    pl.set_pointer("p", 0x1234560)
    pl.set_bytes("tm", np.arange(16, 32, dtype=np.uint64).tobytes())
    assert int(np.frombuffer(ctypes.string_at(int(ptrs[2]), 8), np.uint64)[0]) == 0x1234560
    assert list(np.frombuffer(ctypes.string_at(int(ptrs[1]), 128), np.uint64)) == list(range(16, 32))
    assert pl.values()[0] == -7 and pl.values()[3] == 1.5


def test_prepared_launch_needs_every_value():
    with pytest.raises(ValueError, match=r"no value for parameters \['n'\]"):
        PreparedLaunch(ArgPack([("a", I32), ("n", I64)]), _NoKernel(), (1, 1, 1), 32, 0, dict(a=1))


_CPP_SIZE = [(r"TensorMap", 128), (r"\*", 8), (r"\bi64\b|long long", 8), (r"\b(int|u32|float)\b", 4)]


def _signature(filename, kernel):
    src = jit.kernel_source(filename)
    body = src[src.index(f"{kernel}("):]
    body = body[len(f"{kernel}("):body.index(") {")]
    params = []
    for decl in body.split(","):
        decl = decl.strip()
        name = re.findall(r"(\w+)$", decl)[0]
        size = next(s for pat, s in _CPP_SIZE if re.search(pat, decl))
        params.append((name, size))
    return params


@pytest.mark.parametrize("filename, kernel, pack", [("mla_prefill_sm80.cu", "mla_prefill_kernel", SM80_ARGS),
                                                    ("mla_prefill_sm90.cu", "mla_prefill_kernel", SM90_ARGS),
                                                    ("transpose_v.cu", "transpose_v_e4m3_kernel", TRANSPOSE_V_ARGS)])
def test_declared_parameters_match_the_kernel_signature(filename, kernel, pack):
    want = _signature(filename, kernel)
    got = [(n, pack.dtype.fields[n][0].itemsize) for n in pack.names]
    assert got == want


def test_tensor_maps_are_consecutive_parameters():
    """A run rewrites the six maps as one 768-byte block from tm_q."""
    offs = [SM90_ARGS.offsets[n] for n in SM90_MAPS]
    assert offs == [offs[0] + 128 * i for i in range(len(SM90_MAPS))]
    assert SM90_ARGS.names[:len(SM90_MAPS)] == SM90_MAPS


def _ptx(fam, names):
    ptx = jit.compile_offline(fam[0], names, "sm_90a", method="ptx")
    return ptx if isinstance(ptx, str) else ptx.decode()


def test_hopper_module_exports_its_shared_memory_table():
    """The launch code reads the Hopper kernel's shared-memory size from the compiled module
    (mla_cupy._geometry.prefill_kernel through jit.get_global): the table is a name expression of
    the family, present in the PTX as a global of two ints, each within the 227 KiB a CTA may have."""
    pytest.importorskip("cupy")
    from mla_cupy._arrays import BF16
    from mla_cupy.masks import CausalMask

    fam = reg.prefill_sm90(BF16, CausalMask())
    assert reg.SM90_SMEM_TABLE in fam[1]
    line = next(ln for ln in _ptx(fam, fam[1][:1] + (reg.SM90_SMEM_TABLE,)).splitlines()
                if "kSmemBytesOf" in ln and "=" in ln)
    assert re.search(r"\.global .*kSmemBytesOf\w*\[8\]", line), line
    raw = [int(b) for b in re.search(r"\{([^}]*)\}", line).group(1).split(",")]
    raw += [0] * (8 - len(raw))  # PTX omits trailing zero bytes
    table = [int.from_bytes(bytes(raw[4 * i:4 * i + 4]), "little") for i in range(2)]  # [fp8]
    assert all(100 * 1024 < t <= 227 * 1024 for t in table), table


def test_geometry_constants_are_the_kernels_own():
    """Every tile constant the launch code names is the kernel's constexpr of the same meaning:
    checked by NVRTC itself (static_assert appended to each source; no GPU needed)."""
    pytest.importorskip("cupy")
    from cupy._core.core import assemble_cupy_compiler_options
    from cupy.cuda import compiler

    g = _geometry
    checks = {
        "mla_prefill_sm80.cu": [f"mla::sm80::kBlockM == {g.BLOCK_M}", f"mla::sm80::kSmemBytes == {g.SM80_SMEM_BYTES}"],
        "mla_prefill_sm90.cu": [f"mla::sm90::kBlockM == {g.BLOCK_M}", f"mla::sm90::kBlockN == {g.SM90_BLOCK_N}",
                                f"mla::sm90::kScaleBox == {g.SM90_BLOCK_N} + 4"],
        "transpose_v.cu": [f"mla::kVtCols == {g.VT_COLS_PER_CTA}"],
    }
    opts = assemble_cupy_compiler_options(("-std=c++17", "-arch=compute_90a"))
    for filename, conds in checks.items():
        src = jit.kernel_source(filename) + "".join(f'\nstatic_assert({c}, "{c}");' for c in conds)
        try:
            compiler._NVRTCProgram(src, filename).compile(opts)
        except compiler.CompileException as exc:
            pytest.fail(f"{filename}: {str(exc).splitlines()[0]}")


def test_static_assert_check_can_fail():
    """The check above reports a constant that differs (so it is not vacuous)."""
    pytest.importorskip("cupy")
    from cupy._core.core import assemble_cupy_compiler_options
    from cupy.cuda import compiler

    src = jit.kernel_source("transpose_v.cu") + f'\nstatic_assert(mla::kVtCols == {_geometry.VT_COLS_PER_CTA + 1}, "x");'
    with pytest.raises(compiler.CompileException, match="static assertion"):
        compiler._NVRTCProgram(src, "t.cu").compile(assemble_cupy_compiler_options(("-std=c++17", "-arch=compute_90a")))
