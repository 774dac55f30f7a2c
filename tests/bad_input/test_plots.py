"""The figures: a path that names no file to write (a directory, a name without a suffix, no name at
all) is refused before anything is drawn, rather than written to that name plus '.png'."""
from __future__ import annotations

import numpy as np
import pytest

from orca_torch.lab import plots

pytest.importorskip("matplotlib")


@pytest.mark.parametrize("name, says", [
    ("figs", r"path '.*figs' is a directory; give a file name, e.g. '.*figs/figure.png'"),
    ("cdf", r"path '.*cdf' has no suffix \(matplotlib would write '.*cdf.png'\); give the file name with its "
            r"format, e.g. '.*cdf.png'"),
    (None, "path must be a file name .* got None"),
    ("", "path must be a file name .* got ''"),
])
def test_a_path_that_names_no_file_is_refused_and_nothing_is_written(tmp_path, name, says):
    (tmp_path / "figs").mkdir()
    path = None if name is None else name if not name else tmp_path / name
    with pytest.raises(ValueError, match=says):
        plots.distributions(path, {"a": [1.0, 2.0]}, "s", "t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figs"] and not list((tmp_path / "figs").iterdir())


def test_a_figure_goes_into_a_folder_made_for_it_or_says_why_it_cannot(tmp_path):
    """A figure's missing folder is made, as a trace's is (`chrome_trace.to_chrome_trace`); a path the
    file system cannot hold (a folder under a file) is a ValueError naming the figure, not an OSError."""
    plots.distributions(tmp_path / "new" / "cdf.png", {"a": [1.0, 2.0]}, "s", "t")
    assert (tmp_path / "new" / "cdf.png").stat().st_size > 0
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"cannot write the figure '.*a_file/sub/cdf.png': "):
        plots.distributions(tmp_path / "a_file" / "sub" / "cdf.png", {"a": [1.0, 2.0]}, "s", "t")


# ---- nothing to draw: refused, with what was empty, before anything is written -------------------

NAN = float("nan")


@pytest.fixture(scope="module")
def runs():
    """A run that served requests, and one that served none (its only request refused)."""
    from orca_torch.core.request import Request
    from orca_torch.lab.api import run

    return (run("chat", 8.0, 20, "orca-oracle", max_bs=8, seed=0),
            run([Request(0, 0.0, 100, 100)], max_context=64, reject_invalid=True))


def _rows(**figures):
    return [{"system": "x", "rate_req_s": 1.0, "slo_attainment": 1.0, "ttft_median_s": 0.1, "tpot_median_s": 0.02,
             **figures}]


EMPTY = [
    ("aimd_trace", lambda p, r: plots.aimd_trace(p, [], [], 20.0, (0, 1), "t"), r"batch_sizes is empty"),
    ("aimd_trace", lambda p, r: plots.aimd_trace(p, [NAN, NAN], [5.0, 6.0], 20.0, (0, 1), "t"),
     r"batch_sizes has no finite value among its 2"),
    ("aimd_trace", lambda p, r: plots.aimd_trace(p, [1, 2, 3], [5.0, 6.0], 20.0, (0, 1), "t"),
     r"latencies_ms has 2 value\(s\), but the series it is drawn against has 3"),
    ("timelines", lambda p, r: plots.timelines(p, {}, "t"), r"charts is empty: nothing to draw"),
    ("timelines", lambda p, r: plots.timelines(p, {"static": []}, "t"), r"charts\['static'\] is empty"),
    ("rate_sweep", lambda p, r: plots.rate_sweep(p, [], {"x": "X"}, (1.0, 0.05), "t"), r"rows is empty"),
    ("rate_sweep", lambda p, r: plots.rate_sweep(p, _rows(), {}, (1.0, 0.05), "t"), r"labels is empty"),
    ("rate_sweep", lambda p, r: plots.rate_sweep(p, _rows(), {"x": "X", "y": "Y"}, (1.0, 0.05), "t"),
     r"rows hold no row of system 'y'"),
    ("rate_sweep", lambda p, r: plots.rate_sweep(p, _rows(ttft_median_s=NAN), {"x": "X"}, (1.0, 0.05), "t"),
     r"ttft_median_s of 'x' has no finite value > 0 \(a log axis\)"),
    ("throughput_over_time", lambda p, r: plots.throughput_over_time(p, {}, "t"), r"runs is empty"),
    ("throughput_over_time", lambda p, r: plots.throughput_over_time(p, {"none": r[1]}, "t"),
     r"runs\['none'\] served no request"),
    ("kv_over_time", lambda p, r: plots.kv_over_time(p, {}, 100, "t"), r"runs is empty"),
    ("kv_over_time", lambda p, r: plots.kv_over_time(p, {"none": r[1]}, 100, "t"), r"runs\['none'\] ran no step"),
    ("kv_over_time", lambda p, r: plots.kv_over_time(p, {"a": r[0]}, NAN, "t"),
     r"n_slots must be a finite number of K/V slots > 0, got nan"),
    ("kv_composition", lambda p, r: plots.kv_composition(p, {}, "t"), r"panels is empty"),
    ("kv_composition", lambda p, r: plots.kv_composition(p, {"none": (r[1], 100, "tail")}, "t"),
     r"panels\['none'\] ran no step"),
    ("kv_composition", lambda p, r: plots.kv_composition(p, {"a": (r[0], 100, "blocks")}, "t"),
     r"unknown panels\['a'\] kind 'blocks'; choose one of 'reserved', 'tail'"),
    ("tradeoff", lambda p, r: plots.tradeoff(p, {}, "x", "y", "t"), r"curves is empty"),
    ("tradeoff", lambda p, r: plots.tradeoff(p, {"a": ([], [], [])}, "x", "y", "t"), r"curves\['a'\]'s xs is empty"),
    ("tradeoff", lambda p, r: plots.tradeoff(p, {"a": ([1.0], [NAN], [8])}, "x", "y", "t"),
     r"curves\['a'\]'s ys has no finite value"),
    ("tradeoff", lambda p, r: plots.tradeoff(p, {"a": ([1.0, 2.0], [3.0, 4.0], [8])}, "x", "y", "t"),
     r"curves\['a'\] has 2 points but 1 knob values"),
    ("distributions", lambda p, r: plots.distributions(p, {}, "s", "t"), r"samples is empty"),
    ("distributions", lambda p, r: plots.distributions(p, {"a": []}, "s", "t"), r"samples\['a'\] is empty"),
    ("distributions", lambda p, r: plots.distributions(p, {"a": [NAN, NAN]}, "s", "t", log_x=False),
     r"samples\['a'\] has no finite value among its 2"),
    ("distributions", lambda p, r: plots.distributions(p, {"a": [1.0, NAN]}, "s", "t"),
     r"samples\['a'\] holds NaN \(item 1\): an empirical CDF needs numbers"),
    ("predicted_vs_measured", lambda p, r: plots.predicted_vs_measured(p, [], [], "t"), r"measured_s is empty"),
    ("predicted_vs_measured", lambda p, r: plots.predicted_vs_measured(p, [0.01, 0.02], [0.01], "t"),
     r"predicted_s has 1 value\(s\), but the series it is drawn against has 2"),
    ("predicted_vs_measured", lambda p, r: plots.predicted_vs_measured(p, [0.01, 0.02], [0.01, NAN], "t"),
     r"predicted_s\[1\] is nan: step times must be finite numbers of seconds > 0"),
    ("predicted_vs_measured", lambda p, r: plots.predicted_vs_measured(p, [0.01], [0.01], "t", groups=[]),
     r"groups has 0 names for 1 steps"),
    ("latency_throughput", lambda p, r: plots.latency_throughput(p, {}, 50.0, "t"), r"panels is empty"),
    ("latency_throughput", lambda p, r: plots.latency_throughput(p, {"m": [("8", [], [], False, 0)]}, 50.0, "t"),
     r"the throughputs of '8' in panels\['m'\] is empty"),
    ("latency_throughput", lambda p, r: plots.latency_throughput(p, {"m": [("8", [NAN], [NAN], False, 0)]}, 50.0,
                                                                 "t"),
     r"the throughputs of '8' in panels\['m'\] has no finite value > 0 \(a log axis\)"),
]


@pytest.mark.parametrize("name, draw, says", EMPTY, ids=[f"{c[0]}-{i}" for i, c in enumerate(EMPTY)])
def test_a_figure_with_nothing_to_draw_is_refused_saying_what_was_empty(tmp_path, runs, name, draw, says):
    with pytest.raises(ValueError, match=says):
        draw(tmp_path / "f.png", runs)
    assert not list(tmp_path.iterdir())


def test_a_latency_throughput_panel_without_a_curve_is_drawn_empty(tmp_path, monkeypatch):
    """A model with no runs keeps its panel (title and target), beside one that has curves."""
    drawn, save = [], plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k)))
    plots.latency_throughput(tmp_path / "f.png", {"m": [("8", [1.0, 2.0], [30.0, 60.0], False, 0)], "none": []},
                             50.0, "t")
    m, none = (ax for ax in drawn[0].axes if ax.axison)
    assert (m.get_title(), none.get_title()) == ("m", "none") and (tmp_path / "f.png").stat().st_size > 0
    assert [list(line.get_ydata()) for line in m.get_lines() if len(line.get_xdata())] == [[30.0, 60.0], [50, 50]]
    assert [list(line.get_ydata()) for line in none.get_lines()] == [[50, 50]]           # the target alone


def test_a_mark_given_as_a_list_is_drawn_as_a_tuple_is(tmp_path, monkeypatch):
    """A mark read from JSON is a list: the check of its shape takes it, as the drawing does."""
    drawn, save = [], plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k)))
    marks = [(0, 1.5, 3.5, "paper", -12), (0, 1.0, 3.0, "lecture")]
    for given in ([list(m) for m in marks], marks):
        plots.tradeoff(tmp_path / "f.png", {"a": ([1.0, 2.0], [3.0, 4.0], [1, 2])}, "x", "y", "t", marks=given)
    stars, notes = ([[(list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].get_lines()
                      if line.get_marker() == "*"] for fig in drawn],
                    [{(t.get_text(), t.xy, t.xyann) for t in fig.axes[0].texts} for fig in drawn])
    assert stars[0] == stars[1] == [([1.5], [3.5]), ([1.0], [3.0])] and notes[0] == notes[1]
    assert {(text, xy) for text, xy, _ in notes[0]} >= {("paper", (1.5, 3.5)), ("lecture", (1.0, 3.0))}


TEXT = [
    lambda p: plots.tradeoff(p, {"a": (["1", "10", "2"], [3.0, 4.0, 5.0], [1, 2, 3])}, "x", "y", "t"),
    lambda p: plots.rate_sweep(p, [{"system": "x", "rate_req_s": r, "slo_attainment": 1.0, "ttft_median_s": 0.1,
                                    "tpot_median_s": 0.02} for r in ("8", "1", "32")], {"x": "X"}, (1.0, 0.05), "t"),
    lambda p: plots.aimd_trace(p, [1, 2, 3], np.array(["10", "12", "9"]), 20.0, (0, 1), "t"),
]


@pytest.mark.parametrize("draw", TEXT)
def test_numbers_given_as_text_are_refused_not_drawn_as_categories(tmp_path, draw):
    # A CSV read with the csv module gives text: matplotlib drew '1', '10', '2' as three categories in the
    # order given, evenly spaced, so the curve looked right and was not at its values.
    with pytest.raises(ValueError, match=r"must be a list of numbers, got text: .*convert it to numbers"):
        draw(tmp_path / "f.png")
    assert not list(tmp_path.iterdir())


ONE = {"a": ([1.0, 2.0], [3.0, 4.0], [1, 2])}
CURVE = ("8", [1.0, 2.0], [30.0, 60.0], False, 0)
SHAPES = [
    (lambda p: plots.tradeoff(p, ONE, "x", "y", "t", marks=[(3, 1.0, 2.0, "paper")]),
     r"marks\[0\]'s panel must be an index from 0 to 0 \(the figure has 1 panel\(s\)\), got 3"),
    (lambda p: plots.tradeoff(p, ONE, "x", "y", "t", marks=[(-1, 1.0, 2.0, "paper")]),
     r"marks\[0\]'s panel must be an index from 0 to 0 .* got -1"),
    (lambda p: plots.tradeoff(p, ONE, "x", "y", "t", marks=[(0, 1.0)]),
     r"marks\[0\] must be a \(panel, x, y, label\[, offset\]\) tuple, got \(0, 1.0\)"),
    (lambda p: plots.rate_sweep(p, _rows(), {"x": "X"}, (1.0, 0.05), "t", marks=[(0, "16", 100, "lecture")]),
     r"marks\[0\]'s x must be a finite number, got '16'"),
    (lambda p: plots.latency_throughput(p, {"m": [CURVE[:3]]}, 50.0, "t"),
     r"panels\['m'\]\[0\] must be a \(label, xs, ys, dashed, color_index\) tuple"),
    (lambda p: plots.latency_throughput(p, {"m": [CURVE[:4] + ("red",)]}, 50.0, "t"),
     r"the color_index of panels\['m'\]\[0\] must be an integer >= 0, got 'red'"),
    (lambda p: plots.latency_throughput(p, {"m": [CURVE]}, 50.0, "t", legend_panel=1),
     r"legend_panel must be an integer in \[0, 0\], got 1"),
    (lambda p: plots.latency_throughput(p, {"m": [CURVE]}, 50.0, "t", ncols=0), r"ncols must be an integer >= 1"),
    (lambda p: plots.latency_throughput(p, {"m": [CURVE]}, NAN, "t"),
     r"target_ms must be a finite number of ms per token > 0, got nan"),
    (lambda p: plots.aimd_trace(p, [1, 2, 3], [1.0, 2.0, 3.0], 20.0, (1,), "t"),
     r"window must be \(first, last\) batch numbers of the interference, got \(1,\)"),
    (lambda p: plots.aimd_trace(p, [1, 2, 3], [1.0, 2.0, 3.0], -5, (0, 1), "t"), r"slo_ms must be a finite number"),
    (lambda p: plots.throughput_over_time(p, {"a": None}, "t"), r"runs\['a'\] must be a RunResult, got None"),
    (lambda p: plots.throughput_over_time(p, [1], "t"), r"runs must be a dict of label -> RunResult, got \[1\]"),
    (lambda p: plots.kv_over_time(p, {"a": None}, 10, "t"), r"runs\['a'\] must be a RunResult, got None"),
    (lambda p: plots.kv_composition(p, {"a": None}, "t"),
     r"panels\['a'\] must be a \(RunResult, capacity, kind\) tuple, got None"),
    (lambda p: plots.kv_composition(p, {"a": (None, 10, "tail")}, "t"),
     r"the run of panels\['a'\] must be a RunResult, got None"),
    (lambda p: plots.timelines(p, [["PD"]], "t"), r"charts must be a dict of label -> rows, got \[\['PD'\]\]"),
    (lambda p: plots.distributions(p, [[1.0]], "s", "t"), r"samples must be a dict of label -> values"),
    (lambda p: plots.tradeoff(p, [1], "x", "y", "t"), r"curves must be a dict of label -> \(xs, ys, knobs\)"),
    (lambda p: plots.tradeoff(p, {"a": None}, "x", "y", "t"),
     r"curves\['a'\] must be an \(xs, ys, knobs\) tuple, got None"),
    (lambda p: plots.latency_throughput(p, [1], 50.0, "t"), r"panels must be a dict of name -> curves"),
    (lambda p: plots.rate_sweep(p, _rows(), ["x"], (1.0, 0.05), "t"), r"labels must be a dict of system -> label"),
    (lambda p: plots.rate_sweep(p, [None], {"x": "X"}, (1.0, 0.05), "t"),
     r"rows\[0\] must be a dict with system, rate_req_s, slo_attainment, ttft_median_s, tpot_median_s, got None"),
]


@pytest.mark.parametrize("draw, says", SHAPES)
def test_marks_curves_and_settings_of_the_wrong_shape_are_refused_by_name_before_drawing(tmp_path, draw, says):
    # (these ended in an IndexError, a ZeroDivisionError, a TypeError or a bare unpacking error, or a mark on
    # panel -1 went to the last panel)
    with pytest.raises(ValueError, match=says):
        draw(tmp_path / "f.png")
    assert not list(tmp_path.iterdir())
