"""benchmarks/pipe_probe.py: the probe table and command line (no GPU), and (slow) every probe
compiled for sm_90a with neither spills nor serialized wgmma, as the kernel itself."""
import pytest
from _scripts import load_script

probe = load_script("benchmarks/pipe_probe.py", "pipe_probe_tool")


def test_tensor_cycles_per_key_tile():
    p = probe.PROBES
    assert p["e4m3-gemm"].tensor_cycles == 3 * 10 * 64  # S 6 + P V 4 e4m3 k32 steps per consumer
    assert p["e4m3-loop-1wg"].tensor_cycles == 10 * 64
    assert p["bf16-loop"].tensor_cycles == 2 * 20 * 64  # S 12 + P V 8 16-bit k16 steps
    assert p["bf16x3-loop"].tensor_cycles == 3 * 20 * 64
    assert p["e4m3-softmax"].tensor_cycles == 0 and p["bf16-softmax"].tensor_cycles == 0


def test_expressions_name_the_template_arguments():
    p = probe.PROBES["e4m3-loop-poly2"]
    assert p.expression == "probe::pipe_probe<mla::sm90::Wide<mla::sm90::VariantE4m3>, 3, 1, 2, 3>"
    assert probe.PROBES["bf16-loop-1wg"].expression.endswith("Variant16<__nv_bfloat16>, 3, 0, 0, 1>")
    # turns only with every consumer running, turns of P V's issue alone only with three (pipe_probe.cu
    # asserts it)
    for q in probe.PROBES.values():
        assert q.turns == 0 or (q.runners == q.consumers and (q.turns == 1 or q.consumers == 3))


def test_command_line(capsys):
    assert probe.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in probe.PROBES)
    with pytest.raises(SystemExit) as exc:
        probe.main(["--probes", "e4m3-loop,nope"])
    assert exc.value.code == 2 and "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        probe.main(["--probes", "e4m3-loop", "--iters", "0"])


@pytest.mark.slow
def test_probes_compile_without_spills_nor_serialized_wgmma(capsys):
    pytest.importorskip("cupy")
    assert probe.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert out.count("spills 0/0") == len(probe.PROBES)
    if "(no loop counts" not in out:  # cuobjdump found: one key tile per loop pass, the kernel's 66 exp2
        assert "e4m3-loop " in out and "GMMA 10 EX2 66" in out
