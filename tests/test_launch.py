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
from mla_cupy.masks import MASKS, CausalMask, ChunkedMask, NullMask, SlidingWindowCausalMask


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
    g = _ptx_globals(fam, exports, "sm_90a" if fam[0] != reg.PREFILL_SM80[0] else "sm_80")
    layout = np.frombuffer(g[exports[0]], np.int32)
    return ArgPack.from_export(layout, g[exports[1]]), np.frombuffer(g[exports[2]], np.int32), g


@pytest.mark.parametrize("variant", ["bf16", "fp8", "fp8_rope"])
def test_hopper_module_exports_its_parameter_struct_and_geometry(variant):
    """What mla_cupy._geometry.prefill_kernel reads from a loaded module (jit.get_global), taken from
    the PTX: the parameter struct (every field the packing writes, the seven tensor maps consecutive as
    a run rewrites them), and a geometry row per variant within the limits of a Hopper CTA."""
    fam = reg.prefill_sm90(BF16, CausalMask(), variant)
    pack, table, _ = _pack_of(fam, reg.sm90_exports(CausalMask()))
    assert pack.struct and pack.dtype.itemsize <= 4096  # kernel parameters: 4 KiB
    assert _packing.map_fields(pack) == _packing.SM90_MAPS
    assert pack.dtype.fields["tm_q"][0] == TENSOR_MAP_DTYPE and pack.offsets["tm_q"] % 64 == 0
    for name in ("out", "lse", "q_offsets", "kv_begin", "kv_end", "tile_counter", "q_scale", "rope_scales"):
        assert pack.dtype.fields[name][0] == PTR, name
    assert pack.dtype.fields["scale_log2"][0] == F32 and pack.dtype.fields["mask_arg"][0] == I64
    assert pack.dtype.fields["num_heads"][0] == I32
    rows = table.reshape(-1, len(_geometry.SM90_GEOMETRY))
    assert rows.shape[0] == len(reg.SM90_VARIANTS)
    for name, (_, row) in reg.SM90_VARIANTS.items():
        geom = dict(zip(_geometry.SM90_GEOMETRY, rows[row].tolist()))
        assert 100 * 1024 < geom["smem"] <= 227 * 1024, (name, geom)
        want_m, want_n = _want_blocks(name, CausalMask())
        assert geom["block_m"] == want_m and geom["block_n"] == want_n, geom
        assert geom["threads"] == 128 * (1 + want_m // dims.HALF_BLOCK), geom
        assert geom["scale_box"] >= geom["block_n"], geom  # a tile's key scales and the aligned start
        assert geom["q_rows"] == dims.HALF_BLOCK, geom  # each consumer's Q rows, loaded apart
        # the staged epilogue stores by TMA in the fp8 kernels of three consumers (config.cuh: kTmaEpilogue)
        assert geom["out_tma"] == int(name in FP8_VARIANTS and want_m == 3 * dims.HALF_BLOCK), (name, geom)


def _sm90_block_rows(mask, defines=()):
    """variant -> (block_m, threads, q_rows, block_n, smem) of the Hopper module's geometry table for ``mask``."""
    fam = reg.prefill_sm90(BF16, mask, "fp8")
    exports = reg.sm90_exports(mask)
    table = np.frombuffer(_ptx_globals(fam, exports, defines=defines)[exports[2]], np.int32)
    rows = table.reshape(-1, len(_geometry.SM90_GEOMETRY))
    out = {}
    for name, (_, row) in reg.SM90_VARIANTS.items():
        geom = dict(zip(_geometry.SM90_GEOMETRY, rows[row].tolist()))
        out[name] = (geom["block_m"], geom["threads"], geom["q_rows"], geom["block_n"], geom["smem"])
    return out


FP8_VARIANTS = (reg.VARIANT_FP8, reg.VARIANT_E4M3)  # the Hopper kernel's fp8 traits (VariantFp8 and kin)


def _want_blocks(name, mask):
    """(query rows, keys) of a work tile and key tile of variant ``name`` under ``mask`` as the
    reference sees the build (fp8.fp8_query_block, fp8.blocks_16bit)."""
    if name in FP8_VARIANTS:
        return fp8.fp8_query_block(mask), dims.KEY_TILE
    return fp8.blocks_16bit(mask, rope8=name == reg.VARIANT_FP8_ROPE)[:2]


@pytest.mark.slow
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
def test_geometry_rows_are_the_references_query_blocks(mask):
    """Each mask's exported geometry (kGeometry<Mask>) as compiled: the query rows of a work tile
    are the reference's (fp8.fp8_query_block, which shapes the reach of a NaN in v), 64 per consumer
    warpgroup, one producer warpgroup beside them. A default of MLA_SM90_FP8_CONSUMERS other than
    dims.FP8_CONSUMERS fails here."""
    for name, (block_m, threads, q_rows, block_n, _) in _sm90_block_rows(mask).items():
        assert (block_m, block_n) == _want_blocks(name, mask), (name, block_m, block_n)
        assert q_rows == dims.HALF_BLOCK and threads == 128 * (1 + block_m // q_rows), (name, threads)


@pytest.mark.slow
@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("mask", [CausalMask(), SlidingWindowCausalMask(100)], ids=lambda m: type(m).__name__)
def test_fp8_consumers_widen_the_unbounded_masks_only(mask, consumers):
    """Built with MLA_SM90_FP8_CONSUMERS 3 (the default) the fp8 variants take 192 rows (three
    consumers) under a mask without a lower bound, with 2 they take 128; 128 under the other masks,
    and the 16-bit variants stay at 128."""
    rows = _sm90_block_rows(mask, (("MLA_SM90_FP8_CONSUMERS", str(consumers)),))
    for name, (block_m, threads, _, _, _) in rows.items():
        want = 64 * consumers if name in FP8_VARIANTS and not mask.bounded_below else 128
        assert (block_m, threads) == (want, 128 + 2 * want), (name, block_m, threads)


@pytest.mark.slow
@pytest.mark.parametrize("mask", [CausalMask(), NullMask(), SlidingWindowCausalMask(100)], ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("define", ["MLA_SM90_16BIT_CONSUMERS=3", "MLA_SM90_16BIT_KEYS=64"])
def test_16bit_switches_shape_the_16bit_work_tiles_as_the_reference_sees_them(monkeypatch, mask, define):
    """Built with MLA_SM90_16BIT_CONSUMERS 3 the 16-bit variant takes 192 rows and 96-key tiles
    under a mask without a lower bound; with MLA_SM90_16BIT_KEYS 64 the 16-bit variants (the e4m3
    rope's too) take 64-key tiles under every mask. The exported geometry is what fp8.blocks_16bit
    says (the reference's NaN reach follows it); the fp8 variants keep theirs."""
    name_, value = define.split("=")
    monkeypatch.setattr(jit, "DEFINES", {name_: value})  # as MLA_CUPY_DEFINES sets it
    rows = _sm90_block_rows(mask, ((name_, value),))
    for name, (block_m, threads, _, block_n, smem) in rows.items():
        assert (block_m, block_n) == _want_blocks(name, mask), (name, block_m, block_n)
        assert threads == 128 + 2 * block_m, (name, threads)
        assert smem <= 227 * 1024, (name, smem)  # what a Hopper CTA may have
        wide = name == reg.VARIANT_16 and not mask.bounded_below and name_ == "MLA_SM90_16BIT_CONSUMERS"
        narrow = name in (reg.VARIANT_16, reg.VARIANT_FP8_ROPE) and name_ == "MLA_SM90_16BIT_KEYS"
        assert block_n == (96 if wide else 64 if narrow else 128), (name, block_n)


def test_portable_module_and_pre_pass_export_theirs():
    fam = reg.prefill_sm80(FP16, ChunkedMask(5))
    pack, table, _ = _pack_of(fam, reg.SM80_EXPORTS)
    geom = dict(zip(_geometry.SM80_GEOMETRY, table.tolist()))
    assert 64 * 1024 < geom["smem"] <= 164 * 1024 and geom["threads"] == 256 and geom["block_m"] == 128, geom
    assert {"q", "k", "v", "out", "lse", "q_st", "rope_base", "accumulate"} <= set(pack.names)
    fam = reg.transpose_v_family()
    pack, table, _ = _pack_of(fam, fam[1][1:])
    assert pack.names == ("v", "v_st", "v_sh", "kv_begin", "kv_end", "batch", "vt", "cols")
    assert dict(zip(_geometry.VT_GEOMETRY, table.tolist())) == {"threads": 128, "cols_per_cta": 128}


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
    return pack, dict(zip(("smem", "threads", "block_m", "block_n"), np.frombuffer(g[exports[2]], np.int32).tolist()))


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
    fam = reg.prefill_sm90(BF16, CausalMask(), "fp8")
    g = _ptx_globals(fam, reg.sm90_exports(CausalMask()))

    def get_global(filename, names, name, dtype, count, arch=None):
        assert filename == fam[0] and name in names
        data = np.frombuffer(g[name], dtype)
        assert count <= data.size, (name, count, data.size)  # never past the end of the symbol
        return data[:count]

    monkeypatch.setattr(_geometry, "get_global", get_global)
    n = len(_geometry.SM90_GEOMETRY) * len(reg.SM90_VARIANTS)
    pack, table = _geometry._exports(fam, reg.sm90_exports(CausalMask()), n, "test")
    want, want_table, _ = _pack_of(fam, reg.sm90_exports(CausalMask()))
    assert pack.dtype == want.dtype and pack.names == want.names
    assert table.tolist() == want_table.tolist()


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
