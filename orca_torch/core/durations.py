"""Step durations, checked: the engine's clock only moves by what an executor says a step took.

Every duration an executor gives must be a finite number >= 0; `check_durations` says what was
wrong otherwise, and `check_clock` stops a run whose clock sums past the largest float, or whose
step ends where it started (a float clock far from 0 swallows a short step, `t + d == t`).
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


def check_durations(d) -> None:
    """Raise unless every step duration (a number or an array of numbers) is finite and >= 0;
    a bool or a string is not a duration."""
    if type(d) is float and 0.0 <= d < math.inf:
        return
    why = _duration_problem(d)
    if why:
        raise RuntimeError(why)


def _duration_problem(d) -> str | None:
    """What is wrong with duration(s) `d` (None: nothing)."""
    if is_real(d):
        ok = is_finite_real(d) and d >= 0
        return None if ok else f"the executor returned a step duration of {d!r} s; {_RULE}"
    a = None if isinstance(d, (str, bytes)) or (
        isinstance(d, (list, tuple)) and any(isinstance(x, (bool, np.bool_, str, bytes)) for x in d)) \
        else np.asarray(d)
    if a is None or a.dtype.kind not in "iuf":
        return f"the executor returned {d!r} ({type(d).__name__}) as a step duration; {_RULE}"
    a = a.astype(float)
    ok = np.isfinite(a) & (a >= 0)
    if ok.all():
        return None
    return f"the executor returned a step duration of {a[~ok].ravel()[0] if a.ndim else float(a)!r} s; {_RULE}"
