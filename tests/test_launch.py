"""The packed-argument launcher (mla_cupy/_launch.py) on the CPU: its buffer layout, and that the
parameter lists declared in mla_cupy/api.py match the kernels' C++ signatures, parameter by
parameter (name and size), so a kernel edit that is not mirrored in Python fails CI."""
import ctypes
import re

import numpy as np
import pytest

from mla_cupy import api, jit
from mla_cupy._launch import F32, I32, I64, PTR, ArgPack
from mla_cupy.tma import TENSOR_MAP_DTYPE


def test_buffer_layout_and_values():
    pack = ArgPack([("a", I32), ("tm", TENSOR_MAP_DTYPE), ("p", PTR), ("x", F32), ("n", I64)])
    buf, ptrs, pptr = pack._buffer()
    tm = np.zeros(1, TENSOR_MAP_DTYPE)[0]
    tm["opaque"][:] = np.arange(16)
    buf[0] = (-7, tm, 0xDEADBEEF000, 1.5, -(1 << 40))
    base = buf.ctypes.data
    offs = [int(p) - base for p in ptrs]
    assert offs == [0, 64, 192, 200, 208]  # natural alignment, tensor maps on 64 bytes
    assert int(np.frombuffer(ctypes.string_at(int(ptrs[0]), 4), np.int32)[0]) == -7
    assert list(np.frombuffer(ctypes.string_at(int(ptrs[1]), 128), np.uint64)) == list(range(16))
    assert int(np.frombuffer(ctypes.string_at(int(ptrs[2]), 8), np.uint64)[0]) == 0xDEADBEEF000
    assert float(np.frombuffer(ctypes.string_at(int(ptrs[3]), 4), np.float32)[0]) == 1.5
    assert int(np.frombuffer(ctypes.string_at(int(ptrs[4]), 8), np.int64)[0]) == -(1 << 40)
    assert ctypes.c_uint64.from_address(pptr).value == int(ptrs[0])


_CPP_SIZE = [(r"TensorMap", 128), (r"\*", 8), (r"\bi64\b|long long", 8), (r"\b(int|u32|float)\b", 4)]


def _signature(filename):
    src = jit.kernel_source(filename)
    body = src[src.index("mla_prefill_kernel("):]
    body = body[len("mla_prefill_kernel("):body.index(") {")]
    params = []
    for decl in body.split(","):
        decl = decl.strip()
        name = re.findall(r"(\w+)$", decl)[0]
        size = next(s for pat, s in _CPP_SIZE if re.search(pat, decl))
        params.append((name, size))
    return params


@pytest.mark.parametrize("filename, pack", [("mla_prefill_sm80.cu", api.SM80_ARGS), ("mla_prefill_sm90.cu", api.SM90_ARGS)])
def test_declared_parameters_match_the_kernel_signature(filename, pack):
    want = _signature(filename)
    got = [(n, pack.dtype.fields[n][0].itemsize) for n in pack.names]
    assert got == want


def test_shared_memory_size_matches_the_kernel_layout():
    """The launch code's mirror of kSmemBytes<kFp8> (api.sm90_smem_bytes, taken through
    api.sm90_smem_for) equals the kernel's own table, read from the PTX. (A mismatch launched the
    fp8-rope variant with too little shared memory once: an illegal address on the GPU.)"""
    pytest.importorskip("cupy")
    from mla_cupy import _registry as reg
    from mla_cupy._arrays import BF16
    from mla_cupy.masks import CausalMask
    from mla_cupy.validation import Problem

    fam = reg.prefill_sm90(BF16, CausalMask())
    ptx = jit.compile_offline(fam[0], fam[1][:1], "sm_90a", method="ptx")
    ptx = ptx if isinstance(ptx, str) else ptx.decode()
    line = next(ln for ln in ptx.splitlines() if "kSmemBytesOf" in ln and "=" in ln)
    raw = [int(b) for b in re.search(r"\{([^}]*)\}", line).group(1).split(",")]
    raw += [0] * (8 - len(raw))  # PTX omits trailing zero bytes
    table = [int.from_bytes(bytes(raw[4 * i:4 * i + 4]), "little") for i in range(2)]  # [fp8]
    for fp8 in (False, True):
        assert api.sm90_smem_bytes(fp8) == table[fp8], fp8
    for paged, fp8, rope8 in [(False, False, False), (True, False, False), (False, True, False), (True, True, False),
                              (False, False, True), (True, False, True)]:
        p = Problem(1, 1, 1, 1, BF16, BF16, CausalMask(), 1.0, 1, paged, fp8, rope8)
        assert api.sm90_smem_for(p) == table[fp8]