"""The launch code on the CPU: the packed argument buffer (mla_cupy/_launch.py), and the parameter
structs and geometry the kernel modules export (kernels/params_abi.cuh), read here from NVRTC's PTX
exactly as the launch code reads them from a loaded module, so a kernel edit that the launch code
does not follow fails CI."""
import ctypes
import functools
import re

import numpy as np
import pytest

from mla_cupy import _geometry, _packing, _registry as reg, dims, fp8, jit
from mla_cupy._arrays import BF16, FP16
from mla_cupy._launch import F32, I32, I64, PTR, TENSOR_MAP_DTYPE, ArgPack, PreparedLaunch
from mla_cupy.masks import CausalMask, ChunkedMask, NullMask, SlidingWindowCausalMask


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


@functools.lru_cache(maxsize=None)
def _ptx(fam, arch: str, defines=()):
    """The PTX of a family for ``arch`` (with the compile-time switches ``defines``, pairs) and
    NVRTC's lowered names of its name expressions, compiled once per pytest run (NVRTC takes seconds)."""
    build = jit.compile_offline_with_log(fam[0], fam[1], arch, method="ptx", defines=dict(defines))
    ptx = build.binary
    return (ptx if isinstance(ptx, str) else ptx.decode()), build.lowered


def _ptx_globals(fam, names, arch="sm_90a", defines=()):
    """name expression -> bytes of the exported globals ``names`` of the family's module, from its PTX."""
    pytest.importorskip("cupy")
    text, lowered = _ptx(fam, arch, defines)
    out = {}
    for name in names:
        m = re.search(r"\.global \.align \d+ \.b8 (%s)\[(\d+)\](?: = \{([^}]*)\})?" % re.escape(lowered[name]), text)
        assert m, f"{name} is not in the PTX of {fam[0]}"
        raw = [int(b) for b in m.group(3).split(",")] if m.group(3) else []
        out[name] = bytes(raw + [0] * (int(m.group(2)) - len(raw)))  # PTX omits trailing zero bytes
    return out


def _pack_of(fam, exports):
    """(parameter struct, geometry by name, the globals) a family exports, read from its PTX."""
    g = _ptx_globals(fam, exports, "sm_90a" if fam[0] != reg.PREFILL_SM80[0] else "sm_80")
    layout = np.frombuffer(g[exports[0]], np.int32)
    geometry = _geometry.geometry_of(np.frombuffer(g[exports[3]], np.int32), g[exports[2]])
    return ArgPack.from_export(layout, g[exports[1]]), geometry, g


@pytest.mark.parametrize("variant", ["bf16", "fp8", "fp8_rope", "e4m3"])
def test_hopper_module_exports_its_parameter_struct_and_geometry(variant):
    """What mla_cupy._geometry.prefill_kernel reads from a loaded module (jit.get_global), taken from
    the PTX: the parameter struct (every field the packing writes, the seven tensor maps consecutive as
    a run rewrites them), and the variant's geometry under the mask, within the limits of a Hopper
    CTA and as the reference's schedule says (_registry.sm90_schedule)."""
    mask = CausalMask()
    fam = reg.prefill_sm90(BF16, mask, variant)
    pack, geom, _ = _pack_of(fam, reg.sm90_exports(BF16, mask, variant))
    assert pack.struct and pack.dtype.itemsize <= 4096  # kernel parameters: 4 KiB
    assert _packing.map_fields(pack) == ("tm_q", "tm_k", "tm_v", "tm_rope", "tm_q_rope", "tm_k_scales", "tm_out")
    assert pack.dtype.fields["tm_q"][0] == TENSOR_MAP_DTYPE and pack.offsets["tm_q"] % 64 == 0
    for name in ("out", "lse", "q_offsets", "kv_begin", "kv_end", "tile_counter", "q_scale", "rope_scales"):
        assert pack.dtype.fields[name][0] == PTR, name
    assert pack.dtype.fields["scale_log2"][0] == F32 and pack.dtype.fields["mask_arg"][0] == I64
    assert pack.dtype.fields["num_heads"][0] == I32
    assert 100 * 1024 < geom["smem"] <= 227 * 1024, geom
    sched = reg.sm90_schedule(variant, mask)
    assert {n: geom[n] for n in sched._fields} == sched._asdict(), geom
    assert geom["threads"] == 128 * (1 + geom["block_m"] // geom["q_rows"]), geom
    assert geom["scale_box"] >= geom["block_n"], geom  # a tile's key scales and the aligned start
    # the staged epilogue stores by TMA in the fp8 kernels of three consumers (config.cuh: kTmaEpilogue)
    assert geom["out_tma"] == int(variant in reg.FP8_VARIANTS and geom["block_m"] == 3 * geom["q_rows"]), geom


def test_portable_module_and_pre_pass_export_theirs():
    fam = reg.prefill_sm80(FP16, ChunkedMask(5))
    pack, geom, _ = _pack_of(fam, reg.SM80_EXPORTS)
    assert set(geom) == {"smem", "threads", "block_m"}
    assert 64 * 1024 < geom["smem"] <= 164 * 1024 and geom["threads"] == 256 and geom["block_m"] == 128, geom
    assert {"q", "k", "v", "out", "lse", "q_st", "rope_base", "accumulate"} <= set(pack.names)
    fam = reg.transpose_v_family()
    pack, geom, _ = _pack_of(fam, fam[1][1:])
    assert pack.names == ("v", "v_st", "v_sh", "kv_begin", "kv_end", "batch", "vt", "cols")
    assert geom == {"threads": 128, "cols_per_cta": 128}
    assert (geom["threads"], geom["cols_per_cta"]) == fp8.VT_TILE  # what V's quantizer launches with


def _bwd_common_params():
    """The field names of ``MLA_BWD_COMMON_PARAMS`` as kernels/backward.cuh lists them."""
    lines = jit._RAW_SOURCES["backward.cuh"].split("#define MLA_BWD_COMMON_PARAMS(X)", 1)[1].splitlines()
    body = []
    for line in lines:
        body.append(line)
        if not line.rstrip().endswith("\\"):
            break
    text = re.sub(r"/\*.*?\*/", "", " ".join(body))
    return re.findall(r"X\([^,()]+,\s*(\w+)\)", text)


def _bwd_exports(kernel: str, arch: str):
    """(ArgPack, geometry) the backward main kernel ``kernel``'s module exports for ``arch``, from its PTX."""
    fam = reg.backward_family(kernel, BF16, CausalMask())
    exports = reg.backward_exports(kernel)
    g = _ptx_globals(fam, exports, arch)
    pack = ArgPack.from_export(np.frombuffer(g[exports[0]], np.int32), g[exports[1]], fam[0])
    return pack, _geometry.geometry_of(np.frombuffer(g[exports[3]], np.int32), g[exports[2]])


def test_backward_main_kernels_export_one_parameter_layout():
    """The portable and Hopper backward kernels take one common parameter list, so that the host
    packs both from it: the portable struct is exactly that list (for every arch it is built for),
    the Hopper struct its tensor maps and then the same fields, in the same order, with the same
    sizes and kinds, at the same offsets from the first common field."""
    common = _bwd_common_params()
    assert len(common) > 30 and common[0] == "q" and common[-1] == "tile_counter"
    portable, geom80 = _bwd_exports("sm80", "sm_80")
    assert portable.names == tuple(common)
    portable90, _ = _bwd_exports("sm80", "sm_90a")
    assert portable90.dtype == portable.dtype
    hopper, geom90 = _bwd_exports("sm90", "sm_90a")
    maps = hopper.names[:len(hopper.names) - len(common)]
    assert maps == ("tm_q", "tm_k", "tm_v", "tm_rope", "tm_do")
    assert all(hopper.dtype.fields[m][0] == TENSOR_MAP_DTYPE for m in maps)
    assert hopper.names[len(maps):] == portable.names
    base90, base80 = hopper.offsets[common[0]], portable.offsets[common[0]]
    for name in common:
        assert hopper.dtype.fields[name][0] == portable.dtype.fields[name][0], name
        assert hopper.offsets[name] - base90 == portable.offsets[name] - base80, name
    for name in ("q", "dq_accum", "rope_part", "dq_sem", "q_offsets", "tile_counter"):
        assert portable.dtype.fields[name][0] == PTR, name
    assert portable.dtype.fields["scale"][0] == F32 and portable.dtype.fields["mask_arg"][0] == I64
    assert portable.dtype.fields["deterministic"][0] == I32
    # both work in query blocks of one dq chunk (backward.cuh: kChunkRows)
    assert geom80["block_m"] == geom90["block_m"] == 64, (geom80, geom90)


@pytest.mark.parametrize("arch, limit_kib", [("sm_80", 163), ("sm_90a", 227), ("sm_89", 99), ("sm_86", 99)])
def test_portable_backward_geometry_fits_each_arch(arch, limit_kib):
    """The portable backward kernel's exported geometry: 8 warps, 64 x 64 tiles, and shared memory
    within what one CTA may have on that arch (one q / dout stage where that is 99 KiB)."""
    _, geom = _bwd_exports("sm80", arch)
    assert geom["threads"] == 256 and geom["block_m"] == 64 and geom["block_n"] == 64, geom
    assert 64 * 1024 < geom["smem"] <= limit_kib * 1024, geom


def test_export_parser_rejects_a_malformed_layout():
    """A kind or size the launch code cannot pack is an error, not a silent misplacement."""
    layout = np.array([16, 2, 4, 0, 8, 0, 8, 4, 1], np.int32)  # ptr at 0, int at 8
    pack = ArgPack.from_export(layout, b"a,b,")
    assert pack.names == ("a", "b") and pack.offsets == {"a": 0, "b": 8} and pack.dtype.itemsize == 16
    with pytest.raises(RuntimeError, match="parameter 'b' has kind 1, 8 bytes"):
        ArgPack.from_export(np.array([16, 2, 4, 0, 8, 0, 8, 8, 1], np.int32), b"a,b,")
    with pytest.raises(RuntimeError, match="malformed"):
        ArgPack.from_export(layout, b"a,")


def test_struct_launch_passes_one_pointer_to_the_whole_buffer():
    pack = ArgPack.from_export(np.array([16, 2, 4, 0, 8, 0, 8, 4, 1], np.int32), b"a,b,")
    pl = PreparedLaunch(pack, _NoKernel(), (1, 1, 1), 32, 0, dict(a=0xABC0, b=-3))
    assert len(pl._ptrs) == 1 and int(pl._ptrs[0]) == pl._buf.ctypes.data
    assert int(np.frombuffer(ctypes.string_at(int(pl._ptrs[0]) + 8, 4), np.int32)[0]) == -3


def test_launch_code_reads_the_exports_as_a_module_serves_them(monkeypatch):
    """mla_cupy._geometry._exports through jit.get_global's contract (the first ``count`` elements
    of a global), served here from the PTX: the struct and geometry it returns are those above."""
    exports = reg.sm90_exports(BF16, CausalMask(), "fp8")
    fam = reg.prefill_sm90(BF16, CausalMask(), "fp8")
    g = _ptx_globals(fam, exports)

    def get_global(filename, names, name, dtype, count, arch=None):
        assert filename == fam[0] and name in names
        data = np.frombuffer(g[name], dtype)
        assert count <= data.size, (name, count, data.size)  # never past the end of the symbol
        return data[:count]

    monkeypatch.setattr(_geometry, "get_global", get_global)
    pack, geometry = _geometry._exports(fam, exports, "test")
    want, want_geometry, _ = _pack_of(fam, exports)
    assert pack.dtype == want.dtype and pack.names == want.names
    assert geometry == want_geometry


def test_the_parameter_lists_read_from_the_sources_are_the_exported_structs():
    """The fake GPU's parameter structs (ArgPack.from_fields of dims.param_fields: the kernels' own
    lists read from their text) are the structs the compiled modules export."""
    fams = [(reg.prefill_sm90(BF16, CausalMask(), "fp8"), "MLA_SM90_PARAMS"),
            (reg.prefill_sm80(BF16, CausalMask()), "MLA_SM80_PARAMS"),
            (reg.transpose_v_family(), "MLA_VT_PARAMS"), (reg.rope_gather_family(), "MLA_ROPE_GATHER_PARAMS")]
    for fam, macro in fams:
        exports = [n for n in fam[1] if n.rsplit("::", 1)[-1].startswith("kParam")]
        g = _ptx_globals(fam, exports, "sm_90a")
        exported = ArgPack.from_export(np.frombuffer(g[exports[0]], np.int32), g[exports[1]])
        parsed = ArgPack.from_fields(dims.param_fields(macro))
        assert parsed.dtype == exported.dtype and parsed.names == exported.names, macro
    assert dims.param_fields("MLA_ROPE_PARAMS")[0] == ("const void*", "rope_base")  # shared lists expanded in place


def _causal_problem(heads, sq, sk=None, mask=None, fp8=False):
    """What the order of work tiles reads of a checked problem (validation.Problem's fields)."""
    from types import SimpleNamespace

    sk = sq if sk is None else sk
    return SimpleNamespace(mask=CausalMask() if mask is None else mask, heads=heads, batch=len(sq), tq=sum(sq),
                           tk=sum(sk), fp8=fp8)


@pytest.mark.parametrize("case, sections, blocks, want", [
    ((16, [8192]), 8, 43, 13),            # per token, 192-row tiles: 5.2 per SM, 13 x 16 pooled
    ((16, [8192]), 4, 64, 13),            # 16-bit, 128-row tiles
    ((16, [1500, 901]), 4, 8, 7),         # a batch of two: 7 blocks of each, 224 pooled
    ((32, [1400]), 8, 8, 7),
    ((128, [4096]), 16, 22, 0),           # 2 blocks of 128 heads: too few blocks of each
    ((16, [8192]), 16, 43, 0),            # one section: the order is already longest first
    ((128, [512] * 16), 64, 3, 0),
    ((128, [128] * 64), 128, 1, 0),       # one block a sequence
    ((16, [1024], [4096]), 8, 6, 0),      # a prefix: keys four times the queries
    ((16, [2000]), 8, 11, 0),             # fewer blocks than the pool would take
])
def test_the_cheapest_blocks_end_the_launch_where_sections_would(case, sections, blocks, want):
    """_select.tail_blocks: the query blocks that leave the L2 sections to end a causal launch
    (kernels/tile_scheduler.cuh), about 1.5 work tiles per CTA of 132, at least 4 of each
    sequence."""
    from mla_cupy import _select

    assert _select.tail_blocks(_causal_problem(*case), sections, blocks, 132) == want


@pytest.mark.parametrize("mask", [NullMask(), SlidingWindowCausalMask(100), ChunkedMask(64)], ids=lambda m: type(m).__name__)
def test_the_order_keeps_its_sections_without_a_causal_mask(mask):
    """Under the other masks every work tile of a sequence costs about the same: nothing is pooled."""
    from mla_cupy import _select

    assert _select.tail_blocks(_causal_problem(16, [8192], mask=mask), 8, 43, 132) == 0
