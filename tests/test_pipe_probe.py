"""benchmarks/pipe_probe.py: the probe tables and command line (no GPU), the load probes' layout, and
(slow) every probe compiled for sm_90a with neither spills nor serialized wgmma, as the kernel itself."""
import pytest
from _scripts import load_script

probe = load_script("benchmarks/pipe_probe.py", "pipe_probe_tool")


def test_tensor_cycles_per_key_tile():
    p = probe.PROBES
    assert p["e4m3-gemm"].tensor_cycles == 3 * 10 * 64  # S 6 + P V 4 e4m3 k32 steps per consumer
    assert p["e4m3-loop-1wg"].tensor_cycles == 10 * 64
    assert p["bf16-loop"].tensor_cycles == 2 * 20 * 64  # S 12 + P V 8 16-bit k16 steps
    assert p["e4m3-softmax"].tensor_cycles == 0 and p["bf16-softmax"].tensor_cycles == 0
    assert p["e4m3-loop-rowsum"].tensor_cycles == 3 * (10 * 64 + 4 * 4)  # and P times ones: m64n8k32, 4 cycles
    for name in ("e4m3-loop-noscales", "e4m3-loop-constscales"):  # the scales' work is no tensor work
        assert p[name].tensor_cycles == p["e4m3-loop"].tensor_cycles
    assert p["e4m3-loop-rowsum-noscales"].tensor_cycles == p["e4m3-loop-rowsum"].tensor_cycles
    # per token: S's nope by 4 e4m3 k32 steps and its 16-bit rope by 4 k16 steps, P V 4, the sums 4 x 4
    assert p["fp8-gemm-rowsum"].tensor_cycles == 3 * (12 * 64 + 4 * 4) == 2352
    assert p["fp8-loop-bytes-1wg"].tensor_cycles == 12 * 64 + 4 * 4
    assert p["e4m3-gemm-rowsum"].tensor_cycles == p["e4m3-loop-bytes"].tensor_cycles == 3 * (10 * 64 + 4 * 4)
    # per token on 96-key tiles: S's 8 k-steps of m64n96 (48 cycles), P V 3 k-steps, the sums 3 x 4
    assert p["fp8k96-loop-bytes-overlap"].tensor_cycles == 3 * (8 * 48 + 3 * 64 + 3 * 4) == 1764
    assert p["fp8k96-loop-bytes-overlap"].keys == 96 and p["fp8-loop-bytes"].keys == 128


def test_attention_flops_per_key_tile():
    p = probe.PROBES
    assert p["bf16-loop"].flops == 2 * 64 * 128 * (192 + 128) * 2  # two consumers of 64 rows, 128 keys
    assert p["e4m3-loop-1wg"].flops == 64 * 128 * (192 + 128) * 2
    assert p["fp8k96-loop-bytes"].flops == 3 * 64 * 96 * (192 + 128) * 2
    assert p["e4m3-loop-rowsum"].flops == p["e4m3-loop"].flops  # P times ones is no attention work
    assert p["bf16-softmax"].flops == 0 and p["e4m3-softmax"].flops == 0


def test_expressions_name_the_template_arguments():
    p = probe.PROBES["e4m3-loop-turns2"]
    assert p.expression == "probe::pipe_probe<mla::sm90::Wide<mla::sm90::VariantE4m3>, 3, 2, 3>"
    assert probe.PROBES["bf16-loop-1wg"].expression.endswith("Variant16<__nv_bfloat16>, 3, 0, 1>")
    # turns only with three consumers, every one running (pipe_probe.cu asserts it)
    for q in probe.PROBES.values():
        assert q.turns == 0 or (q.runners == q.consumers == 3)
    assert probe.PROBES["fp8k96-loop-bytes-overlap"].expression == "probe::pipe_probe<probe::Fp8K96, 51, 3, 3>"


def test_load_probes_walk_an_l2_span_together_or_dram_apart():
    p = probe.LOAD_PROBES
    ring2 = p["l2-ring2"]
    assert ring2.tile_bytes == (32 + 16 + 32) * 1024 and ring2.stages == 2  # the 16-bit kernel's K/V stage
    assert p["l2-ring2-hold"].hold == 2 * 20 * 64  # two consumers' wgmma of one key tile at the full rate
    for q in p.values():
        assert q.ring_bytes <= 227 * 1024 - 1024  # the ring(s) fit beside the barriers
        probe.load_layout(q, 132)  # whole copies, whole tiles
    tiles, step = probe.load_layout(ring2, 132)
    assert tiles * ring2.tile_bytes == ring2.span <= 25 * 2**20 and step == 7  # one span in L2, CTAs 7 tiles apart
    dram = p["dram-ring2"]
    tiles, step = probe.load_layout(dram, 132)
    assert tiles * dram.tile_bytes == 132 * dram.span > 2**30 and step == dram.span // dram.tile_bytes
    with pytest.raises(ValueError, match="whole copies"):
        probe.load_layout(probe.LoadProbe("odd", 40960, 16384, 2, 0, 40960, True), 132)
    with pytest.raises(ValueError, match="whole tiles"):
        probe.load_layout(probe.LoadProbe("odd", 32768, 16384, 2, 0, 2**20 + 16384, True), 132)


def test_cluster_load_probes_share_by_multicast_or_place_alone():
    p = probe.LOAD_PROBES
    alone, mc2, mc4 = p["l2-ring2-c2"], p["l2-ring2-mc2"], p["l2-ring2-mc4-hold"]
    assert alone.expression == "probe::load_probe<2, false>" and alone.groups(132) == 132  # each CTA its own tile
    assert mc2.expression == "probe::load_probe<2, true>" and mc2.groups(132) == 66  # a cluster reads a tile once
    assert mc4.groups(132) == 33 and mc4.hold == p["l2-ring2-hold"].hold
    assert p["l2-ring2"].expression == "probe::load_probe<1, false>" and p["l2-ring2"].ctas == 0  # every SM
    assert p["l2-ring2-x16"].ctas == 16 and p["l2-ring2-x16"].expression == p["l2-ring2"].expression
    for q in (alone, mc2, mc4):  # the 16-bit tile and ring, as l2-ring2
        assert (q.tile_bytes, q.copy_bytes, q.stages, q.span) == (80 * 1024, 16 * 1024, 2, p["l2-ring2"].span)


def test_split_load_probes_take_k_and_v_apart():
    p = probe.LOAD_PROBES
    ring2, kv = p["l2-ring2"], p["l2-kv2x2-hold"]
    assert kv.expression == "probe::kv_probe" and ring2.v_bytes == 0 and ring2.walk_bytes == ring2.tile_bytes
    assert (kv.tile_bytes, kv.v_bytes) == ((32 + 16) * 1024, 32 * 1024)  # K nope + rope, V: the 16-bit tile
    assert kv.walk_bytes == ring2.tile_bytes and kv.span == ring2.span and kv.v_lag == 1
    assert (kv.hold, kv.v_hold) == (2 * 12 * 64, 2 * 8 * 64)  # two consumers' S (12 k-steps) and P V (8)
    assert kv.hold + kv.v_hold == p["l2-ring2-hold"].hold and kv.ring_bytes == 2 * ring2.tile_bytes
    assert p["l2-kv3x2-hold"].ring_bytes == 208 * 1024 and p["l2-kv2x3-hold"].ring_bytes == 192 * 1024
    assert probe.load_layout(kv, 132) == probe.load_layout(ring2, 132)


def test_command_line(capsys):
    assert probe.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in [*probe.PROBES, *probe.LOAD_PROBES])
    with pytest.raises(SystemExit) as exc:
        probe.main(["--probes", "e4m3-loop,nope"])
    assert exc.value.code == 2 and "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        probe.main(["--probes", "e4m3-loop", "--iters", "0"])
    with pytest.raises(SystemExit) as exc:
        probe.main(["--probes", "e4m3-loop", "--energy", "-1"])
    assert exc.value.code == 2 and "--energy" in capsys.readouterr().err


@pytest.mark.slow
def test_probes_compile_without_spills_nor_serialized_wgmma(capsys):
    pytest.importorskip("cupy")
    assert probe.main(["--check"]) == 0
    out = capsys.readouterr().out
    loads = {p.expression for p in probe.LOAD_PROBES.values()}  # the load probe's instances
    assert out.count("spills 0/0") == len(probe.PROBES) + len(loads)
    if "(no loop counts" not in out:  # cuobjdump found: one key tile per loop pass, the kernel's 66 exp2
        assert "e4m3-loop " in out and "GMMA 10 EX2 66" in out
