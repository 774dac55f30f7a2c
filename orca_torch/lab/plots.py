"""The experiments' figures as pictures (PNG), for people who would rather look at a curve than a table.

Needs matplotlib (the optional extra `plot`: `pip install 'orca-torch[plot]'`); it is imported only
when a figure is drawn, on a bare `Figure` (Agg, headless; pyplot's backend and figures untouched).
Every function draws one figure into `path` (its folder made if missing):
axes with units, the workload, model and GPU in the title (the caller's `title`), and the lecture's
figure as a marked point where it has one (`marks`: (panel, x, y, label) tuples, drawn as stars).
A figure of one column of panels has room at the right: its legends go there, off the data.

A figure with nothing to draw is refused (ValueError naming what was empty) before anything is drawn:
no panel, run or curve at all, a series with no point, or none that can be drawn (all NaN, or none > 0
on a log axis); series drawn against each other must be as long. A NaN among drawable points is a gap
in its line. The one exception: a panel of `latency_throughput` without a curve is drawn empty (its
title and the latency target), for a model or workload that has no runs.
"""
from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from orca_torch.checks import brief, check_choice, check_instance, check_int, check_real, quoted_path
from orca_torch.core.run_result import RunResult

Mark = tuple   # (panel index, x, y, label[, text offset in points, up; default 3])


def _check_figure_path(path: str | Path) -> None:
    """`path` must name the file to write: given a name without a suffix, a directory's included,
    matplotlib writes that name plus '.png', a file the caller did not name."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"path must be a file name (a str or a Path), got {brief(path)}")
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"path {quoted_path(p)} is a directory; give a file name, "
                         f"e.g. {quoted_path(p / 'figure.png')}")
    if not p.suffix:
        raise ValueError(f"path {quoted_path(p)} has no suffix (matplotlib would write {quoted_path(f'{p}.png')}); "
                         f"give the file name with its format, e.g. {quoted_path(f'{p}.png')}")


def _some(name: str, items: Any, what: str) -> None:
    """Refuse a figure of no panel, run or curve: `items` must hold at least one `what`."""
    if not len(items):
        raise ValueError(f"{name} is empty: nothing to draw; give at least one {what}")


def _labelled(name: str, items: Any, what: str) -> None:
    """`_some` for a dict of `what` (label -> ...), refusing anything else by name."""
    if not isinstance(items, dict):
        raise ValueError(f"{name} must be a dict of {what}, got {brief(items, 80)}")
    _some(name, items, what)


def _tuple(name: str, value: Any, shape: str, *sizes: int) -> tuple | list:
    """`value` itself, refused unless it is a tuple or list of one of these `sizes`, `shape` saying
    what it holds (`"a (RunResult, capacity, kind)"`)."""
    if not isinstance(value, (tuple, list)) or len(value) not in sizes:
        raise ValueError(f"{name} must be {shape} tuple, got {brief(value, 80)}")
    return value


def _series(name: str, values: Any, n: int | None = None, *, positive: bool = False) -> np.ndarray:
    """`values` as floats, refused if none can be drawn: no value, or no finite one (`positive`, on a
    log axis: none finite and > 0). `n`: the length it must have, that of the series it is drawn
    against. (The caller draws what it was given; this only checks it.)"""
    try:
        raw = np.asarray(values)
    except (TypeError, ValueError):
        raw = None
    if raw is not None and (raw.dtype.kind in "US" or raw.dtype.kind == "O" and any(
            isinstance(v, (str, bytes)) for v in raw.ravel())):
        # (matplotlib would draw text as categories, placed in the order given, not at their values)
        raise ValueError(f"{name} must be a list of numbers, got text: {brief(values, 80)}; convert it to numbers "
                         "(a CSV's cells are read as text)")
    try:
        a = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of numbers, got {brief(values, 80)}") from None
    if a.ndim != 1:
        raise ValueError(f"{name} must be a flat list of numbers, got an array of shape {a.shape}")
    if n is not None and len(a) != n:
        raise ValueError(f"{name} has {len(a)} value(s), but the series it is drawn against has {n}")
    if not len(a):
        raise ValueError(f"{name} is empty: nothing to draw; give at least one value")
    drawable = np.isfinite(a) & (a > 0) if positive else np.isfinite(a)
    if not drawable.any():
        raise ValueError(f"{name} has no {'finite value > 0 (a log axis)' if positive else 'finite value'} among "
                         f"its {len(a)}: nothing to draw")
    return a


def _check_marks(marks: Sequence[Mark], n_panels: int) -> None:
    """Each mark a (panel, x, y, label[, offset]) tuple on one of the figure's `n_panels` panels."""
    if isinstance(marks, (str, bytes)) or not isinstance(marks, (list, tuple)):
        raise ValueError(f"marks must be a list of (panel, x, y, label[, offset]) tuples, got {brief(marks, 80)}")
    for k, mark in enumerate(marks):
        _tuple(f"marks[{k}]", mark, "a (panel, x, y, label[, offset])", 4, 5)
        panel = mark[0]
        if isinstance(panel, (bool, np.bool_)) or not isinstance(panel, (int, np.integer)) or \
                not 0 <= panel < n_panels:
            raise ValueError(f"marks[{k}]'s panel must be an index from 0 to {n_panels - 1} (the figure has "
                             f"{n_panels} panel(s)), got {brief(panel)}")
        for what, v in zip(("x", "y", "offset"), (*mark[1:3], *mark[4:])):
            check_real(f"marks[{k}]'s {what}", v)
        if not isinstance(mark[3], str):
            raise ValueError(f"marks[{k}]'s label must be a str, got {brief(mark[3], 80)}")


def _runs(name: str, runs: Any) -> None:
    """Refuse `runs` unless it is a non-empty dict of label -> `RunResult`."""
    _labelled(name, runs, "label -> RunResult")
    for label, res in runs.items():
        check_instance(f"{name}[{brief(label)}]", res, RunResult)


def _steps(name: str, res: Any) -> None:
    """Refuse a run of no step: it has no memory over time to draw."""
    if not len(res.step_start):
        raise ValueError(f"{name} ran no step: nothing to draw")


def _figure(path: str | Path, title: str, ncols: int = 1, nrows: int = 1, width: float = 6.4, height: float = 4.0,
            sharex: bool = False):
    # A bare Figure, not pyplot: drawing leaves the caller's backend and open figures alone.
    from matplotlib.figure import Figure

    _check_figure_path(path)                   # before anything is drawn

    fig = Figure(figsize=(width * ncols if ncols > 1 else width, height * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=sharex)
    fig.suptitle(textwrap.fill(title, int(12 * fig.get_figwidth())), fontsize=10)    # (~12 characters an inch)
    return fig, list(axes.ravel())


def _save(fig, path: str | Path, marks: Sequence[Mark] = (), axes: Sequence = ()) -> None:
    for k, mark in enumerate(marks):
        (panel, x, y, label), dy = mark[:4], (mark[4] if len(mark) > 4 else 3)
        ax = axes[panel]
        ax.plot([x], [y], marker="*", markersize=11, color="black", linestyle="none", zorder=5,
                label="the lecture's figure" if k == 0 else None)
        right = ax.transAxes.inverted().transform(ax.transData.transform((x, y)))[0] > 0.6
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(-7 if right else 7, dy), fontsize=7,
                    ha="right" if right else "left")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            if ax.get_subplotspec().get_gridspec().ncols == 1:      # room at the right: off the data
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
            else:
                ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    _spread_annotations(fig, axes)
    try:  # (a folder under a file, or one not writable: said as the figure it is, not as an OSError)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=90)
    except OSError as e:
        raise ValueError(f"cannot write the figure {quoted_path(Path(path))}: {e.strerror or e}") from None


def _spread_annotations(fig, axes: Sequence) -> None:
    """An annotation that would overprint one already written moves down (else up) a line at a time,
    so that labels of points close together stay readable, each beside its own point."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Annotation

    renderer = FigureCanvasAgg(fig).get_renderer()
    for ax in axes:
        placed: list = []
        for ann in (t for t in ax.texts if isinstance(t, Annotation)):
            x0, y0 = ann.xyann
            line = ann.get_window_extent(renderer).height * 72 / fig.dpi + 1     # points
            for k in (0, *(s * j for j in range(1, 11) for s in (-1, 1))):
                ann.xyann = (x0, y0 + k * line)
                box = ann.get_window_extent(renderer)
                if not any(box.overlaps(p) for p in placed):
                    break
            else:
                ann.xyann = (x0, y0)
                box = ann.get_window_extent(renderer)
            placed.append(box)


def aimd_trace(path: str | Path, batch_sizes: Sequence[int], latencies_ms: Sequence[float], slo_ms: float,
               window: tuple[int, int], title: str) -> None:
    """Clipper's AIMD: batch size and latency per batch, the interference window shaded, the SLO drawn."""
    _series("latencies_ms", latencies_ms, len(_series("batch_sizes", batch_sizes)))
    check_real("slo_ms", slo_ms, 0.0, lo_open=True, unit="ms")
    if not isinstance(window, (list, tuple)) or len(window) != 2:
        raise ValueError(f"window must be (first, last) batch numbers of the interference, got {brief(window, 80)}")
    for end in window:
        check_real("an end of window", end)
    fig, (a, b) = _figure(path, title, nrows=2, height=2.6)
    x = np.arange(len(batch_sizes))
    a.plot(x, batch_sizes, lw=0.9, label="AIMD batch size")
    b.plot(x, latencies_ms, lw=0.6, color="tab:orange", label="batch latency")
    b.axhline(slo_ms, color="red", ls="--", lw=1, label=f"SLO {slo_ms:g} ms")
    for ax in (a, b):
        ax.axvspan(*window, color="grey", alpha=0.2, label="interference")
    a.set_ylabel("batch size (inputs)")
    b.set_ylabel("latency (ms)")
    b.set_xlabel("batch number")
    _save(fig, path, axes=[a, b])


CELLS = {"P": ("prefill", "tab:red"), "D": ("decode", "tab:blue"), "R": ("recompute", "tab:purple"),
         "·": ("waiting", "lightgrey"), "~": ("in flight", "lightsteelblue"), "-": ("seat held, finished", "wheat")}


def timelines(path: str | Path, charts: dict[str, Sequence[str]], title: str) -> None:
    """Who runs in which iteration (lecture §4.1): `timeline.timeline_rows` strings, one row per request."""
    _labelled("charts", charts, "label -> rows")
    for label, rows in charts.items():
        _some(f"charts[{brief(label)}]", rows, "row (a request)")
    from matplotlib.ticker import MaxNLocator

    fig, axes = _figure(path, title, nrows=len(charts), height=2.2)
    for ax, (label, rows) in zip(axes, charts.items()):
        seen = set()
        for i, row in enumerate(rows):
            for it, c in enumerate(row):
                if c in CELLS:
                    name, color = CELLS[c]
                    ax.barh(i, 1, left=it, color=color, edgecolor="white", label=None if c in seen else name)
                    seen.add(c)
        ax.set_title(f"{label}: {max(len(r.rstrip()) for r in rows)} iterations", fontsize=9)
        ax.set_yticks(range(len(rows)), [f"r{i}" for i in range(len(rows))], fontsize=7)
        ax.invert_yaxis()
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))        # iterations are counted
        ax.set_xlabel("iteration")
    _save(fig, path, axes=axes)


def rate_sweep(path: str | Path, rows: Sequence[dict], labels: dict[str, str], slo: tuple[float, float],
               title: str, goodput: dict[str, float] | None = None, target: float = 0.9,
               marks: Sequence[Mark] = ()) -> None:
    """SLO attainment, TTFT median and TPOT median against the arrival rate, per system; goodput marked."""
    _some("rows", rows, "row (a system at a rate)")
    _labelled("labels", labels, "system -> label")
    _check_marks(marks, 3)
    keys = ("system", "rate_req_s", "slo_attainment", "ttft_median_s", "tpot_median_s")
    for k, r in enumerate(rows):
        if not isinstance(r, dict) or not all(key in r for key in keys):
            raise ValueError(f"rows[{k}] must be a dict with {', '.join(keys)}, got {brief(r, 80)}")
    for key in labels:
        mine = [r for r in rows if r["system"] == key]
        if not mine:
            raise ValueError(f"rows hold no row of system {brief(key)} (labels names it): nothing to draw for it")
        x = _series(f"the rates of {brief(key)}", [r["rate_req_s"] for r in mine], positive=True)
        for name, log in (("slo_attainment", False), ("ttft_median_s", True), ("tpot_median_s", False)):
            _series(f"{name} of {brief(key)}", [r[name] for r in mine], len(x), positive=log)
    fig, axes = _figure(path, title, ncols=3, width=4.2, height=3.6)
    for key, label in labels.items():
        mine = sorted((r for r in rows if r["system"] == key), key=lambda r: r["rate_req_s"])
        x = [r["rate_req_s"] for r in mine]
        line, = axes[0].plot(x, [100 * r["slo_attainment"] for r in mine], marker="o", ms=3, label=label)
        axes[1].plot(x, [r["ttft_median_s"] for r in mine], marker="o", ms=3, color=line.get_color())
        axes[2].plot(x, [1e3 * r["tpot_median_s"] for r in mine], marker="o", ms=3, color=line.get_color())
        if goodput and goodput.get(key):
            axes[0].axvline(goodput[key], color=line.get_color(), ls=":", lw=1,
                            label=f"goodput {goodput[key]:.3g} req/s")
    axes[0].axhline(100 * target, color="grey", ls="--", lw=0.8)
    axes[1].axhline(slo[0], color="red", ls="--", lw=0.8, label=f"SLO {slo[0]:g} s")
    axes[2].axhline(1e3 * slo[1], color="red", ls="--", lw=0.8, label=f"SLO {1e3 * slo[1]:g} ms")
    for ax, ylabel in zip(axes, ("SLO attainment (%)", "TTFT median (s)", "TPOT median (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(ylabel)
    axes[1].set_yscale("log")
    _save(fig, path, marks, axes)


def throughput_over_time(path: str | Path, runs: dict[str, Any], title: str, bins: int = 60) -> None:
    """Tokens per second over the run: the ramp, the steady window (until the last first token), the drain."""
    _runs("runs", runs)
    for label, res in runs.items():
        if not res.n:
            raise ValueError(f"runs[{brief(label)}] served no request: no token to draw")
    fig, axes = _figure(path, title, nrows=len(runs), height=2.6)
    for ax, (label, res) in zip(axes, runs.items()):
        t0, end = float(res.arrival_s.min()), float(res.token_times.max())
        edges = np.linspace(t0, end, bins + 1)
        counts, _ = np.histogram(res.token_times, edges)
        ax.step(edges[:-1], counts / np.diff(edges), where="post", lw=1, label=label)
        ax.set_title(label, fontsize=9)
        steady_end = float(res.first_token_s.max())
        rate = counts / np.diff(edges)
        inside = edges[:-1] < steady_end
        ramp_end = float(edges[np.argmax(rate >= 0.5 * rate[inside].mean())]) if inside.any() else t0
        ax.axvspan(t0, ramp_end, color="tab:grey", alpha=0.15, label="ramp (below half the steady rate)")
        ax.axvspan(t0, steady_end, color="tab:green", alpha=0.12, label="steady window (to the last first token)")
        ax.axvspan(steady_end, end, color="tab:orange", alpha=0.12, label="drain")
        ax.axvline(float(res.arrival_s.max()), color="grey", ls=":", lw=1, label="last arrival")
        ax.set_ylabel("throughput (tok/s)")
    axes[-1].set_xlabel("time (s)")
    _save(fig, path, axes=axes)


def _held(res: RunResult, *values: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Per-step `values` as curves to draw with steps "post": each step's value from its start, and 0
    from its end where the engine then idles (the next step starts later, or none does) — the
    moments `metrics.memory_occupancy` weighs, so a curve holds no memory through idle time."""
    start, end = res.step_start, res.step_end
    idle = end < np.append(start[1:], np.inf)
    order = np.argsort(np.concatenate((start, end[idle])), kind="stable")
    x = np.concatenate((start, end[idle]))[order]
    return x, [np.concatenate((np.asarray(v, dtype=float), np.zeros(int(idle.sum()))))[order] for v in values]


def kv_over_time(path: str | Path, runs: dict[str, Any], n_slots: int, title: str) -> None:
    """K/V slots occupied (reserved) vs holding a token, over time, per reservation policy."""
    _runs("runs", runs)
    check_real("n_slots", n_slots, 0, lo_open=True, unit="K/V slots")
    for label, res in runs.items():
        _steps(f"runs[{brief(label)}]", res)
    fig, axes = _figure(path, title, ncols=len(runs), width=3.4, height=3.4)
    for ax, (label, res) in zip(axes, runs.items()):
        x, (reserved, used) = _held(res, res.step_reserved, res.step_used)
        ax.step(x, 100 * reserved / n_slots, where="post", lw=0.9, label="occupied")
        ax.step(x, 100 * used / n_slots, where="post", lw=0.9, label="holding tokens")
        ax.axhline(100, color="grey", ls="--", lw=0.8)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("time (s)")
    axes[0].set_ylabel(f"K/V slots (% of {n_slots:,})")
    _save(fig, path, axes=axes)


def kv_composition(path: str | Path, panels: dict[str, tuple[Any, int, str]], title: str) -> None:
    """K/V memory over time, stacked: token states, then what is occupied without holding a token —
    set aside for the future (`kind="reserved"`) or the empty tails of last blocks (`kind="tail"`).
    `panels`: label -> (RunResult, capacity in slots, kind); one panel per entry, one above the other."""
    _labelled("panels", panels, "label -> (RunResult, capacity, kind)")
    for label, panel in panels.items():
        res, n_slots, kind = _tuple(f"panels[{brief(label)}]", panel, "a (RunResult, capacity, kind)", 3)
        check_instance(f"the run of panels[{brief(label)}]", res, RunResult)
        _steps(f"panels[{brief(label)}]", res)
        check_real(f"the capacity of panels[{brief(label)}]", n_slots, 0, lo_open=True, unit="K/V slots")
        check_choice(f"panels[{brief(label)}] kind", kind, ("reserved", "tail"))
    fig, axes = _figure(path, title, nrows=len(panels), width=7.0, height=1.8, sharex=True)  # durations compare
    colors = {"token states": "tab:blue", "reserved-but-empty": "tab:orange", "block-tail waste": "tab:red"}
    for ax, (label, (res, n_slots, kind)) in zip(axes, panels.items()):
        x, (used, reserved) = _held(res, res.step_used, res.step_reserved)
        empty = reserved - used
        zero = 0 * empty
        ax.stackplot(x, used, empty if kind == "reserved" else zero,
                     empty if kind == "tail" else zero, labels=list(colors), colors=list(colors.values()),
                     step="post")
        ax.axhline(n_slots, color="grey", ls="--", lw=0.8)
        ax.set_title(label, fontsize=8)
        ax.set_ylabel("K/V slots", fontsize=8)
    axes[-1].set_xlabel("time (s)")
    _save(fig, path, axes=axes)


def tradeoff(path: str | Path, curves: dict[str, tuple[Sequence[float], Sequence[float], Sequence[Any]]],
             xlabel: str, ylabel: str, title: str, marks: Sequence[Mark] = ()) -> None:
    """One curve per label through (x, y) points, each annotated with its knob value; knob values that
    give the same point (of one curve or several) are written there once, together, not on top of each other;
    a label is written in its curve's colour, and one that would overprint another moves a line aside."""
    _labelled("curves", curves, "label -> (xs, ys, knobs)")
    _check_marks(marks, 1)
    for label, curve in curves.items():
        xs, ys, knobs = _tuple(f"curves[{brief(label)}]", curve, "an (xs, ys, knobs)", 3)
        n = len(_series(f"curves[{brief(label)}]'s xs", xs))
        _series(f"curves[{brief(label)}]'s ys", ys, n)
        if len(knobs) != n:
            raise ValueError(f"curves[{brief(label)}] has {n} points but {len(knobs)} knob values: one for each point")
    fig, axes = _figure(path, title)
    ax = axes[0]
    knobs_at: dict[tuple[float, float], list[str]] = {}
    colors_at: dict[tuple[float, float], set[str]] = {}
    for label, (xs, ys, knobs) in curves.items():
        line, = ax.plot(xs, ys, marker="o", ms=4, label=label)
        for x, y, k in zip(xs, ys, knobs):
            names = knobs_at.setdefault((float(x), float(y)), [])
            colors_at.setdefault((float(x), float(y)), set()).add(line.get_color())
            if str(k) not in names:
                names.append(str(k))
    for xy, names in knobs_at.items():       # in its curve's colour, black where curves meet
        color = next(iter(colors_at[xy])) if len(colors_at[xy]) == 1 else "black"
        ax.annotate(", ".join(names), xy, textcoords="offset points", xytext=(4, -10), fontsize=7, color=color)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    _save(fig, path, marks, axes)


def distributions(path: str | Path, samples: dict[str, Sequence[float]], xlabel: str, title: str,
                  log_x: bool = True) -> None:
    """Empirical CDFs (and, below, the tail as 1 - CDF on a log scale), one curve per label. A sample
    with a NaN is refused: it has no place in a CDF."""
    _labelled("samples", samples, "label -> values")
    for label, xs in samples.items():
        x = _series(f"samples[{brief(label)}]", xs, positive=log_x)
        if np.isnan(x).any():
            raise ValueError(f"samples[{brief(label)}] holds NaN (item {int(np.argmax(np.isnan(x)))}): an empirical "
                             "CDF needs numbers; leave the missing ones out")
    fig, (a, b) = _figure(path, title, nrows=2, height=2.8)
    for label, xs in samples.items():
        x = np.sort(np.asarray(xs, dtype=float))
        y = np.arange(1, len(x) + 1) / len(x)
        line, = a.plot(x, 100 * y, lw=1, label=f"{label} (max {x[-1]:.3g})")
        b.plot(x, np.maximum(1 - y + 1 / len(x), 1 / len(x)), lw=1, color=line.get_color())
    a.set_ylabel("share at or below (%)")
    b.set_ylabel("share above")
    b.set_yscale("log")
    for ax in (a, b):
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
    _save(fig, path, axes=[a, b])


def predicted_vs_measured(path: str | Path, measured_s: Sequence[float], predicted_s: Sequence[float],
                          title: str, groups: Sequence[str] | None = None) -> None:
    """Predicted against measured step time, log-log, the line of perfect prediction drawn. Every
    time must be a finite number > 0 (a log-log plot, and its range is taken from them)."""
    m = _series("measured_s", measured_s)
    for name, t in (("measured_s", m), ("predicted_s", _series("predicted_s", predicted_s, len(m)))):
        bad = ~(np.isfinite(t) & (t > 0))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}[{i}] is {float(t[i])!r}: step times must be finite numbers of seconds > 0")
    if groups is not None and len(groups) != len(m):
        raise ValueError(f"groups has {len(groups)} names for {len(m)} steps: give one for each step")
    fig, axes = _figure(path, title, width=5.2, height=4.6)
    ax = axes[0]
    m, p = 1e3 * np.asarray(measured_s, dtype=float), 1e3 * np.asarray(predicted_s, dtype=float)
    kinds = np.asarray(groups if groups is not None else ["steps"] * len(m))
    for g in dict.fromkeys(kinds.tolist()):
        sel = kinds == g
        ax.scatter(m[sel], p[sel], s=10, alpha=0.7, label=g)
    lo, hi = min(m.min(), p.min()) * 0.8, max(m.max(), p.max()) * 1.25
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="predicted = measured")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    subs = (1.0,) if hi / lo > 100 else (1.0, 2.0, 5.0)     # labelled in plain milliseconds, 1 (2, 5) x 10^k
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(subs=subs))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    _save(fig, path, axes=axes)


def latency_throughput(path: str | Path, panels: dict[str, Sequence[tuple]], target_ms: float, title: str,
                       marks: Sequence[Mark] = (), ncols: int = 3, legend_panel: int = 0) -> None:
    """Orca's Figs. 10 / 11: median normalized latency (ms per token) against throughput (req/s),
    one panel per model or workload. Each curve is `(label, xs, ys, dashed, color_index)`: one
    system dashed, the other solid, one colour per `max_bs`; the latency target dotted. The colours
    mean the same in every panel, so one legend (on `legend_panel`) lists every label. A panel
    without a curve is drawn empty."""
    _labelled("panels", panels, "name -> curves")
    n = len(panels)
    ncols = check_int("ncols", ncols, 1)
    legend_panel = check_int("legend_panel", legend_panel, 0, n - 1)
    check_real("target_ms", target_ms, 0.0, lo_open=True, unit="ms per token")
    _check_marks(marks, n)
    for name, curves in panels.items():
        for k, curve in enumerate(curves):
            _tuple(f"panels[{brief(name)}][{k}]", curve, "a (label, xs, ys, dashed, color_index)", 5)
            check_int(f"the color_index of panels[{brief(name)}][{k}]", curve[4], 0)
        for label, xs, ys, *_ in curves:
            _series(f"the latencies of {brief(label)} in panels[{brief(name)}]", ys,
                    len(_series(f"the throughputs of {brief(label)} in panels[{brief(name)}]", xs, positive=True)))
    cols = min(ncols, n)
    fig, axes = _figure(path, title, ncols=cols, nrows=-(-n // cols), width=3.6, height=2.8)
    styles: dict[str, tuple] = {}
    for ax, (name, curves) in zip(axes, panels.items()):
        for label, xs, ys, dashed, color in curves:
            style = ("--o" if dashed else "-s", f"C{color}")
            styles.setdefault(label, style)
            ax.plot(xs, ys, style[0], color=style[1], ms=3, lw=1.2)
        ax.axhline(target_ms, color="grey", ls=":", lw=1)
        ax.set_title(name, fontsize=9)
        ax.set_ylim(0, 2.2 * target_ms)
        ax.set_xscale("log")
        ax.set_xlabel("throughput (req/s)", fontsize=8)
        ax.set_ylabel("median normalized latency (ms/token)", fontsize=8)
        ax.tick_params(labelsize=7)
    for label, (fmt, color) in sorted(styles.items(), key=lambda kv: (kv[1][0] != "--o", kv[1][1])):
        axes[legend_panel].plot([], [], fmt, color=color, ms=3, lw=1.2, label=label)
    for ax in axes[n:]:
        ax.axis("off")
    _save(fig, path, marks, axes[:n])
