"""benchmarks/ab.py's energy windows on the CPU: joules, watts, clock and cycles per call from a
counter and clock samples whose values are known, and the per-round ratios to the base."""
import pytest
from _scripts import load_script

ab = load_script("benchmarks/ab.py", "ab_energy_tool")


class _Card:
    """A card whose calls each take ``ms`` of wall time and ``joules``, at ``mhz``: one clock
    sample per call."""

    def __init__(self, sampler, ms, joules, mhz, counts_energy=True):
        self.sampler, self.ms, self.joules, self.mhz = sampler, ms, joules, mhz
        self.t, self.mj, self.calls = 100.0, 5.0e6, []
        sampler.energy_mj = (lambda: self.mj) if counts_energy else (lambda: None)

    def call(self, i):
        self.calls.append(i)
        self.t += self.ms / 1e3
        self.mj += self.joules * 1e3
        self.sampler.samples.append((self.t, self.mhz, 600.0))

    def clock(self):
        return self.t


def _sampler():
    s = ab.NvmlSampler.__new__(ab.NvmlSampler)  # no NVML thread: the samples are the card's
    s.samples, s._nv = [(0.0, 1980.0, 100.0)], None
    return s


def test_window_reports_joules_watts_clock_and_cycles_per_call():
    s = _sampler()
    card = _Card(s, ms=4.0, joules=2.5, mhz=1800.0)
    synced = []
    w = ab.energy_window(card.call, 3, 10, s, lambda: synced.append(len(card.calls)), clock=card.clock)
    assert card.calls == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert synced == [0, 10], "the device is synchronized before the first and after the last call"
    assert w["calls"] == 10
    assert w["j_per_call"] == pytest.approx(2.5)
    assert w["watts"] == pytest.approx(625.0)
    assert w["ms_per_call"] == pytest.approx(4.0)
    assert w["sm_mhz"] == 1800.0, "the clock sampled before the window must not count"
    assert w["kcycles_per_call"] == pytest.approx(7200.0)


def test_window_without_an_energy_counter_keeps_time_and_cycles():
    s = _sampler()
    card = _Card(s, ms=2.0, joules=1.0, mhz=1500.0, counts_energy=False)
    w = ab.energy_window(card.call, 1, 4, s, lambda: None, clock=card.clock)
    assert w["j_per_call"] is None and w["watts"] is None
    assert w["kcycles_per_call"] == pytest.approx(3000.0)


def test_calls_fill_the_window_within_bounds():
    assert ab.energy_calls(4.0, 1.0) == 250
    assert ab.energy_calls(3.7, 1.0) == 271
    assert ab.energy_calls(5000.0, 1.0) == 3
    assert ab.energy_calls(1e-4, 1.0) == 20000


def test_ratios_are_per_round_and_skip_missing_rounds():
    r = ab._ratios({"a": [2.0, 4.0, 3.0], "b": [1.0, None, 3.3]}, "a")
    assert r["a"]["ratio_median"] == 1.0
    assert r["b"]["median"] == pytest.approx(2.15)
    assert r["b"]["ratio_min"] == pytest.approx(0.5) and r["b"]["ratio_max"] == pytest.approx(1.1)
    assert r["b"]["ratio_median"] == pytest.approx(0.8)


def test_energy_rows_format_every_field():
    s = _sampler()
    windows = {}
    for name, joules, mhz in (("ours", 2.0, 1800.0), ("fa3", 2.2, 1700.0)):
        card = _Card(s, ms=4.0, joules=joules, mhz=mhz)
        windows[name] = [ab.energy_window(card.call, 1, 5, s, lambda: None, clock=card.clock)]
    res = {"case": "1x8192", "impls": {k: {"energy": e} for k, e in ab.energy_summary(windows, "ours").items()}}
    rows = ab.format_energy(res)
    assert rows[0] == ("| 1x8192 | ours | 2.0000 | 1.000 (1.000-1.000) | 7200 | 1.000 (1.000-1.000) | 4.000 | 500 "
                       "| 1800 |")
    assert rows[1] == ("| 1x8192 | fa3 | 2.2000 | 1.100 (1.100-1.100) | 6800 | 0.944 (0.944-0.944) | 4.000 | 550 "
                       "| 1700 |")


def test_launch_table_groups_kernels_per_call_longest_first():
    # two calls, each: a pre-pass (10 us), the main kernel (100 us) and a post-pass (20 us), 5 us apart
    kernels = []
    for c in range(2):
        t0 = 1000.0 * c
        kernels += [("pre", t0, t0 + 10), ("main", t0 + 15, t0 + 115), ("post", t0 + 120, t0 + 140)]
    rows, span = ab.launch_table(kernels, 2)
    assert [r["kernel"] for r in rows] == ["main", "post", "pre"]
    assert [r["launches"] for r in rows] == [1, 1, 1]
    assert [r["us"] for r in rows] == pytest.approx([100, 20, 10])
    assert [r["share"] for r in rows] == pytest.approx([100 / 130, 20 / 130, 10 / 130])
    assert span == pytest.approx((1140 - 0) / 2)
    lines = ab.format_launches("1x2048", "ours", rows, span)
    assert lines[0].startswith("| 1x2048 | ours | main | 1 | 100.0 | 76.9% |")
    assert "570.0" in lines[-1] and "22.8% busy" in lines[-1]


def test_launch_table_counts_repeated_launches_and_rejects_bad_input():
    rows, _ = ab.launch_table([("k", 0, 4), ("k", 5, 9), ("k", 10, 14), ("k", 15, 19)], 2)
    assert rows[0]["launches"] == 2 and rows[0]["us"] == pytest.approx(8)
    with pytest.raises(ValueError, match="calls"):
        ab.launch_table([("k", 0, 1)], 0)
    with pytest.raises(ValueError, match="before it starts"):
        ab.launch_table([("k", 5, 1)], 1)
    assert ab.launch_table([], 3) == ([], 0.0)


def test_profile_launches_calls_input_set_zero_and_keeps_device_events(monkeypatch):
    import types

    pytest.importorskip("torch", reason="the profiler is torch's")
    import torch.profiler as tp
    from torch.autograd import DeviceType

    class _Event:
        def __init__(self, name, device_type, start, end):
            self.name, self.device_type = name, device_type
            self.time_range = types.SimpleNamespace(start=start, end=end)

    class _Profile:  # records the calls made inside it, as the profiler's device events would
        def __init__(self, activities):
            self.inside = False

        def __enter__(self):
            self.inside = True
            return self

        def __exit__(self, *exc):
            self.inside = False

        def events(self):
            return [_Event("cudaLaunchKernel", DeviceType.CPU, 0, 1)] + [
                _Event("main", DeviceType.CUDA, 10 * i, 10 * i + 7) for i in range(len(inside))]

    inside, synced = [], []
    prof_box = {}

    def make(activities):
        prof_box["p"] = _Profile(activities)
        return prof_box["p"]

    monkeypatch.setattr(tp, "profile", make)
    seen = []

    def call(i):
        seen.append(i)
        if "p" in prof_box and prof_box["p"].inside:
            inside.append(i)

    kernels = ab.profile_launches(call, 4, lambda: synced.append(len(seen)))
    assert seen == [0] * 7, "three untimed calls, then four recorded, all on input set 0"
    assert inside == [0] * 4 and synced == [3, 7]
    assert kernels == [("main", 0.0, 7.0), ("main", 10.0, 17.0), ("main", 20.0, 27.0), ("main", 30.0, 37.0)]
