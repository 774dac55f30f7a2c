"""Step durations: checked, and summed into the steps' end times (the engine's clock).

Every duration an executor gives, one step's or a decode run's, must be a finite number >= 0;
`check_durations` says what was wrong otherwise. `step_ends` turns a decode run's durations into
end times with the same float additions as the step-by-step loop (`t += d`, in order), which is
what keeps the fast-forward's timestamps exactly those of one step at a time. Every sum is
checked (`check_clock`): a step must end after it starts (a float clock far from 0 would swallow
a short step, `t + d == t`), and before the largest float.
"""
from __future__ import annotations

import math

import numpy as np

from orca_torch.checks import is_finite_real, is_real


def check_clock(end: float, d: float, t: float | None = None) -> None:
    """Raise if a step of `d` seconds that starts at `t` ends at a time no float holds (finite steps
    summing past 1.8e308), or where it started: a clock so far from 0 that a positive `d` is lost
    against it (`t + d == t`) would report that step, and every latency it adds to, as taking no time."""
    if not end < math.inf:
        raise RuntimeError(f"the run's clock overflows: a step of {d!r} s ends past the largest float "
                           "(check the step-time function)")
    if t is not None and end == t and d > 0.0:
        raise ValueError(f"a step of {d!r} s starting at {t!r} s on the run's clock ends when it starts: at that "
                         f"time a float cannot hold a step so short, and every latency would lose it. The clock "
                         "counts from the first arrival; bring the arrivals closer together (a higher rate, or a "
                         "trace cut into shorter pieces)")


_RULE = "every duration must be a finite number >= 0 (check the step-time function)"


def _bad_duration(d) -> RuntimeError:
    return RuntimeError(f"the executor returned a step duration of {d!r} s; {_RULE}")


def check_durations(d) -> None:
    """Raise unless every step duration (a number or an array of numbers) is finite and >= 0;
    a bool or a string is not a duration."""
    if type(d) is float and 0.0 <= d < math.inf:
        return
    if is_real(d):
        if is_finite_real(d) and d >= 0:
            return
        raise _bad_duration(d)
    a = None if isinstance(d, (str, bytes)) or (
        isinstance(d, (list, tuple)) and any(isinstance(x, (bool, np.bool_, str, bytes)) for x in d)) \
        else np.asarray(d)
    if a is None or a.dtype.kind not in "iuf":
        raise RuntimeError(f"the executor returned {d!r} ({type(d).__name__}) as a step duration; {_RULE}")
    a = a.astype(float)
    if not (np.isfinite(a).all() and (a >= 0).all()):
        raise _bad_duration(a[~(np.isfinite(a) & (a >= 0))].ravel()[0] if a.ndim else float(a))


SHORT_RUN = 64
"""Runs up to this many steps are summed in plain Python: cheaper than numpy's cost per call."""


def step_ends(ds, m: int, t: float, stop_at: float | None) -> list[float] | np.ndarray:
    """End times `t + d0`, `t + d0 + d1`, ... (the float additions of the step-by-step loop, in
    order) of `m` durations, up to and including the first end at or after `stop_at`; checked."""
    if len(ds) != m or getattr(ds, "ndim", 1) != 1:
        raise RuntimeError(f"executor.decode_durations returned {np.shape(ds)} durations, expected ({m},)")
    if m <= SHORT_RUN:
        ends = []
        for d in (ds.tolist() if isinstance(ds, np.ndarray) else ds):
            if type(d) is not float or not 0.0 <= d < math.inf:     # (NaN fails too)
                check_durations(d)
                d = float(d)
            end = t + d
            if not end < math.inf or end == t:
                check_clock(end, d, t)
            t = end
            ends.append(t)
            if stop_at is not None and t >= stop_at:
                break
        return ends
    if getattr(ds, "dtype", None) is None or ds.dtype.kind != "f":
        check_durations(ds)                 # (a bool or a string array is not durations)
    ds = np.array(ds, dtype=float)
    if not ds.min() >= 0:
        check_durations(ds)
    d0 = float(ds[0])
    ds[0] += t
    with np.errstate(over="ignore"):        # (an overflow is reported below, as an error)
        ends = ds.cumsum()
    if not math.isfinite(ends[-1]):         # an infinite duration anywhere, or a sum past the floats
        check_durations(ds)
        check_clock(ends[-1], float(ds[int(np.argmax(~np.isfinite(ends)))]))
    if stop_at is not None:
        ends = ends[:int(np.searchsorted(ends, stop_at, side="left")) + 1]
    if ends[0] == t:
        check_clock(float(ends[0]), d0, t)
    lost = np.flatnonzero((ends[1:] == ends[:-1]) & (ds[1:len(ends)] > 0))
    if len(lost):
        check_clock(float(ends[lost[0] + 1]), float(ds[lost[0] + 1]), float(ends[lost[0]]))
    return ends
