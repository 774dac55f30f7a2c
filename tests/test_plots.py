"""The figures: each drawing function writes a real PNG of the numbers it was given; scripts run without matplotlib unless --plot is asked."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from figure_files import assert_pngs

from orca_torch.lab import plots
from orca_torch.lab.api import run

ROOT = Path(__file__).resolve().parents[1]
NO_MATPLOTLIB = "import sys, runpy; sys.modules['matplotlib'] = None; sys.argv = {argv!r}; " \
                "runpy.run_path({script!r}, run_name='__main__')"


@pytest.fixture(scope="module")
def small_run():
    return run("chat", 8.0, 30, "orca-oracle", max_bs=16, seed=0)


def test_every_drawing_writes_a_png(tmp_path, small_run):
    rng = np.random.default_rng(0)
    plots.aimd_trace(tmp_path / "a.png", rng.integers(1, 40, 200), rng.uniform(5, 25, 200), 20.0, (50, 100), "t")
    plots.timelines(tmp_path / "b.png", {"continuous": ["PDD  ", " ·PD "], "static": ["PDD--", "···PD"]}, "t")
    rows = [{"system": s, "rate_req_s": r, "slo_attainment": a, "ttft_median_s": 0.01 * r, "tpot_median_s": 0.02}
            for s in ("x", "y") for r, a in ((1, 1.0), (8, 0.95), (32, 0.2))]
    plots.rate_sweep(tmp_path / "c.png", rows, {"x": "X", "y": "Y"}, (1.0, 0.05), "t", goodput={"x": 9.0},
                     marks=[(0, 16, 100, "lecture"), (1, 1, 0.012, "lecture", -12)])
    plots.throughput_over_time(tmp_path / "d.png", {"orca": small_run}, "t")
    plots.kv_over_time(tmp_path / "e.png", {"oracle": small_run, "max": small_run}, small_run.n_slots, "t")
    plots.tradeoff(tmp_path / "f.png", {"48 req/s": ([10, 20, 30], [1000, 2000, 2500], [8, 64, 256])},
                   "TPOT (ms)", "tok/s", "t")
    plots.distributions(tmp_path / "g.png", {"a": rng.exponential(1, 300), "b": rng.exponential(2, 300)}, "s", "t")
    plots.predicted_vs_measured(tmp_path / "h.png", [0.01, 0.02, 0.05], [0.011, 0.018, 0.06], "t",
                                groups=["decode", "decode", "prefill"])
    assert_pngs(tmp_path, list("abcdefgh"))


def _without_matplotlib(script: str, *argv: str) -> subprocess.CompletedProcess:
    code = NO_MATPLOTLIB.format(argv=[script, *argv], script=str(ROOT / "experiments" / script))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_scripts_run_without_matplotlib_and_say_how_to_get_it(tmp_path):
    ok = _without_matplotlib("01_clipper_batching.py", "--quick", "--json", "--demos", "1,4")
    assert ok.returncode == 0, ok.stderr
    assert '"demo4"' in ok.stdout
    asked = _without_matplotlib("01_clipper_batching.py", "--quick", "--demos", "1", "--plot", str(tmp_path))
    assert asked.returncode == 2 and asked.stdout == ""
    assert "--plot: needs matplotlib, which is not installed: pip install 'orca-torch[plot]'" in asked.stderr
    assert not list(tmp_path.iterdir())


def test_drawing_leaves_the_callers_pyplot_alone(tmp_path):
    """A notebook's backend and its open figures are the caller's: drawing a figure changes neither."""
    code = ("import matplotlib; matplotlib.use('svg'); import matplotlib.pyplot as plt; fig = plt.figure(); "
            "from orca_torch.lab import plots; plots.distributions({p!r}, {{'a': [1.0, 2.0, 3.0]}}, 's', 't'); "
            "print(matplotlib.get_backend(), plt.get_fignums())").format(p=str(tmp_path / "d.png"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["svg", "[1]"]
    assert_pngs(tmp_path, ["d"])


def test_each_drawing_plots_the_numbers_it_was_given(tmp_path, small_run, monkeypatch):
    """The figures' content, read back off the matplotlib objects before they are saved: the lines
    carry the caller's numbers in the units the axes name, the lecture's marks sit where given."""
    drawn = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k)))

    rows = [{"system": s, "rate_req_s": r, "slo_attainment": a, "ttft_median_s": t, "tpot_median_s": 0.02}
            for s in ("x", "y") for r, a, t in ((8, 0.95, 0.5), (1, 1.0, 0.1), (32, 0.2, 9.0))]
    plots.rate_sweep(tmp_path / "c.png", rows, {"x": "X", "y": "Y"}, (1.0, 0.05), "t", goodput={"x": 9.0},
                     marks=[(0, 16, 100, "lecture")])
    slo, ttft, tpot = drawn[-1].axes
    x_line = next(line for line in slo.get_lines() if line.get_label() == "X")
    assert list(x_line.get_xdata()) == [1, 8, 32] and list(x_line.get_ydata()) == [100, 95, 20]   # sorted by rate
    assert list(ttft.get_lines()[0].get_ydata()) == [0.1, 0.5, 9.0]
    assert list(tpot.get_lines()[0].get_ydata()) == [20.0] * 3                                      # in ms
    assert [ax.get_ylabel() for ax in (slo, ttft, tpot)] == ["SLO attainment (%)", "TTFT median (s)",
                                                             "TPOT median (ms)"]
    goodput = next(line for line in slo.get_lines() if line.get_label() == "goodput 9 req/s")
    assert list(goodput.get_xdata()) == [9.0, 9.0]
    star = next(line for line in slo.get_lines() if line.get_label() == "the lecture's figure")
    assert (list(star.get_xdata()), list(star.get_ydata()), star.get_marker()) == ([16], [100], "*")

    plots.aimd_trace(tmp_path / "a.png", [3, 5, 8], [10.0, 12.0, 30.0], 20.0, (1, 2), "t")
    sizes, latency = drawn[-1].axes
    assert list(sizes.get_lines()[0].get_ydata()) == [3, 5, 8]
    assert list(latency.get_lines()[0].get_ydata()) == [10.0, 12.0, 30.0]
    assert list(latency.get_lines()[1].get_ydata()) == [20.0, 20.0]                               # the SLO

    plots.kv_over_time(tmp_path / "e.png", {"oracle": small_run}, small_run.n_slots, "t")
    occupied, holding = drawn[-1].axes[0].get_lines()[:2]
    at_start = np.isin(occupied.get_xdata(), small_run.step_start)       # the other points: 0 at an idle step's end
    assert np.array_equal(occupied.get_xdata()[at_start], small_run.step_start)
    assert np.allclose(occupied.get_ydata()[at_start], 100 * small_run.step_reserved / small_run.n_slots)
    assert np.allclose(holding.get_ydata()[at_start], 100 * small_run.step_used / small_run.n_slots)
    assert np.isin(occupied.get_xdata()[~at_start], small_run.step_end).all()
    assert not occupied.get_ydata()[~at_start].any() and not holding.get_ydata()[~at_start].any()

    plots.predicted_vs_measured(tmp_path / "h.png", [0.01, 0.02], [0.012, 0.018], "t", groups=["a", "b"])
    ax = drawn[-1].axes[0]
    points = np.concatenate([c.get_offsets() for c in ax.collections])
    assert np.allclose(points, [[10.0, 12.0], [20.0, 18.0]])                                      # ms
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")

    plots.kv_composition(tmp_path / "k.png", {"paged": (small_run, small_run.n_slots, "tail")}, "t")
    stacks = drawn[-1].axes[0].collections
    assert [c.get_label() for c in stacks] == ["token states", "reserved-but-empty", "block-tail waste"]

    plots.latency_throughput(tmp_path / "l.png", {"13B": [("FT", [1, 2], [5.0, 6.0], True, 0),
                                                          ("Orca", [1, 4], [4.0, 7.0], False, 1)]}, 10.0, "t")
    ax = drawn[-1].axes[0]
    ft, orca = ax.get_lines()[:2]
    assert (list(ft.get_ydata()), ft.get_linestyle(), list(orca.get_xdata())) == ([5.0, 6.0], "--", [1, 4])
    assert ax.get_ylim() == (0, 22.0)
    assert_pngs(tmp_path, list("caehkl"))


def test_tradeoff_names_the_knobs_of_points_that_coincide_once(tmp_path, monkeypatch):
    # Two knob values giving the same point (max_bs 256 and 512 when 166 is the most ever running) were
    # written on top of each other, unreadable; so was a point two curves share.
    drawn = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k)))
    plots.tradeoff(tmp_path / "f.png", {"48 req/s": ([7.0, 42.6, 50.0], [1100.0, 4910.0, 4754.0], [8, 256, 512]),
                                        "25 req/s": ([7.0, 18.5, 18.5], [1100.0, 4133.0, 4133.0], [8, 256, 512])},
                   "x", "y", "t")
    texts = sorted((t.xy, t.get_text()) for t in drawn[-1].axes[0].texts)
    assert texts == [((7.0, 1100.0), "8"), ((18.5, 4133.0), "256, 512"), ((42.6, 4910.0), "256"),
                     ((50.0, 4754.0), "512")]


def _renderer(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return FigureCanvasAgg(fig).get_renderer()


def _drawn(monkeypatch) -> list:
    drawn = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k)))
    return drawn


def test_tradeoff_labels_of_close_points_do_not_overprint(tmp_path, monkeypatch):
    # Points close but not equal (two curves near each other, or max_bs 128 beside 256 and 512) had
    # their labels written over one another; each label now stays whole, in its curve's colour.
    drawn = _drawn(monkeypatch)
    plots.tradeoff(tmp_path / "f.png", {"48 req/s": ([10.3, 15.2, 24.0], [2840.0, 3870.0, 4700.0], [32, 64, 128]),
                                        "23 req/s": ([10.4, 15.8, 16.0], [2810.0, 3910.0, 3925.0], [32, 128, 256])},
                   "x", "y", "t")
    fig = drawn[-1]
    texts = fig.axes[0].texts
    assert sorted(t.get_text() for t in texts) == ["128", "128", "256", "32", "32", "64"]
    renderer = _renderer(fig)
    boxes = [t.get_window_extent(renderer) for t in texts]
    overlapping = [(texts[i].get_text(), texts[j].get_text()) for i in range(len(boxes))
                   for j in range(i) if boxes[i].overlaps(boxes[j])]
    assert overlapping == []
    blue, orange = (line.get_color() for line in fig.axes[0].get_lines()[:2])
    assert {t.get_text(): t.get_color() for t in texts if t.xy == (24.0, 4700.0) or t.xy == (16.0, 3925.0)} == \
        {"128": blue, "256": orange}


def test_timeline_iterations_are_whole_numbers(tmp_path, monkeypatch):
    # The static panel (18 iterations) was ticked 2.5, 7.5, ...: a count has no half iteration.
    drawn = _drawn(monkeypatch)
    plots.timelines(tmp_path / "b.png", {"static": ["PDD" + "-" * 15, "···PD" + " " * 13]}, "t")
    ticks = [v for v in drawn[-1].axes[0].get_xticks() if drawn[-1].axes[0].get_xlim()[0] <= v]
    assert ticks and all(float(v).is_integer() for v in ticks)


def test_kv_composition_panels_share_one_time_axis_and_legends_sit_off_the_data(tmp_path, small_run, monkeypatch):
    # Each stacked panel had its own time range (100, 90, 80 s), so durations could not be compared by eye,
    # and a legend inside a panel covered its data.
    short = run("chat", 8.0, 10, "orca-oracle", max_bs=16, seed=0)
    drawn = _drawn(monkeypatch)
    plots.kv_composition(tmp_path / "k.png", {"long": (small_run, small_run.n_slots, "reserved"),
                                              "short": (short, short.n_slots, "tail")}, "t")
    fig = drawn[-1]
    assert fig.axes[0].get_xlim() == fig.axes[1].get_xlim()
    assert fig.axes[0].get_xlim()[1] >= float(small_run.step_start.max())
    renderer = _renderer(fig)
    for ax in fig.axes:
        legend, plot_area = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        assert legend.x0 >= plot_area.x1


def test_kv_memory_over_time_is_empty_while_the_engine_idles(tmp_path, monkeypatch):
    """Two requests 50 s apart: between the first's last step and the second's arrival the engine
    idles and holds no K/V (`metrics.memory_occupancy` counts nothing there). The curves drop to 0
    at the end of the step before the idle time, rather than hold that step's memory until the
    next step starts; the last step is drawn to its end."""
    from orca_torch.core.request import Request

    res = run([Request("a", 0.0, 100, 20), Request("b", 50.0, 100, 20)], system="orca-oracle")
    first_end = float(res.step_end[res.last_token_step[0]])
    drawn = _drawn(monkeypatch)
    plots.kv_over_time(tmp_path / "e.png", {"oracle": res}, res.n_slots, "t")
    plots.kv_composition(tmp_path / "k.png", {"oracle": (res, res.n_slots, "reserved")}, "t")
    over_time, composition = (fig.axes[0] for fig in drawn)
    for line in over_time.get_lines()[:2]:                       # occupied, holding tokens (post steps)
        x, y = line.get_xdata(), line.get_ydata()
        assert y[np.searchsorted(x, 25.0, side="right") - 1] == 0
        assert y[np.searchsorted(x, first_end - 1e-9, side="right") - 1] > 0
        assert x[-1] == res.step_end[-1] and y[-1] == 0
    held = float(res.step_used[res.last_token_step[0]])          # the token states of a's last step
    tokens = composition.collections[0].get_paths()[0]
    assert tokens.contains_point((first_end / 2, held / 2)) and not tokens.contains_point((25.0, held / 2))


def _area(collection) -> float:
    """The area a filled band covers (the shoelace formula over its outline)."""
    x, y = collection.get_paths()[0].vertices.T
    return 0.5 * abs(float(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1))))


def test_the_stacks_rates_and_cdfs_are_the_numbers_given(tmp_path, small_run, monkeypatch):
    """The drawings whose lines are derived: each K/V band's area is its slots held over the steps'
    durations (the empty slots go to the band its kind names, the other band stays flat); the
    throughput curve's area is every token of the run, and its steady window ends at the last first
    token; a CDF of three values climbs by thirds and its tail falls by them."""
    drawn = _drawn(monkeypatch)
    res = small_run
    # each step's value holds to the next step's start, or to its own end where the engine then idles
    held = np.minimum(np.append(res.step_start[1:], np.inf), res.step_end) - res.step_start
    used = float((res.step_used * held).sum())
    empty = float(((res.step_reserved - res.step_used) * held).sum())
    assert empty > 0.05 * used
    for kind, want in (("reserved", [used, empty, 0.0]), ("tail", [used, 0.0, empty])):
        plots.kv_composition(tmp_path / f"{kind}.png", {kind: (res, res.n_slots, kind)}, "t")
        bands = drawn[-1].axes[0].collections
        assert [_area(b) for b in bands] == pytest.approx(want, rel=1e-9, abs=1e-6), kind

    plots.throughput_over_time(tmp_path / "d.png", {"orca": res}, "t", bins=60)
    ax = drawn[-1].axes[0]
    rate = ax.get_lines()[0].get_ydata()
    width = (res.token_times.max() - res.arrival_s.min()) / 60
    assert len(rate) == 60 and float(rate.sum()) * width == pytest.approx(len(res.token_times), rel=1e-12)
    steady = next(p for p in ax.patches if p.get_label().startswith("steady window"))
    assert (steady.get_x(), steady.get_x() + steady.get_width()) == pytest.approx(
        (res.arrival_s.min(), res.first_token_s.max()), rel=1e-12)

    plots.distributions(tmp_path / "g.png", {"a": [3.0, 1.0, 2.0]}, "s", "t")
    cdf, tail = (ax.get_lines()[0] for ax in drawn[-1].axes)
    assert list(cdf.get_xdata()) == [1.0, 2.0, 3.0]
    assert list(cdf.get_ydata()) == pytest.approx([100 / 3, 200 / 3, 100])
    assert list(tail.get_ydata()) == pytest.approx([1, 2 / 3, 1 / 3])       # the share at or above each value
