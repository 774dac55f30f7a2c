"""Step durations, checked: the engine's clock only moves by what an executor says a step took.

Every duration an executor gives must be a finite number >= 0; `check_duration` says what was
wrong otherwise, and `check_clock` stops a run whose clock sums past the largest float, or whose
step ends where it started (a float clock far from 0 swallows a short step, `t + d == t`).
"""
from __future__ import annotations

import math

from orca_torch.checks import brief, is_finite_real, is_real


CLOCK_SPAN_S = 2.0 ** 32
"""How far from its start (the first arrival) a run's clock may be asked to reach: within 2**32 s
(136 years) a float clock resolves a step to 2**-20 s, under a microsecond. Further out its steps
blur, and far enough out (about 5e13 s for the paper GPU's 10-20 ms steps) they are lost
(`check_clock`): the arrival clock's range is what bounds how slow a rate a run can take."""


class ClockError(ValueError):
    """The run's clock cannot hold a step: its arrivals lie so far from the first that a step is lost."""


def check_clock(end: float, d: float, t: float) -> None:
    """Raise if a step of `d` seconds that starts at `t` ends at a time no float holds (finite steps
    summing past 1.8e308), or where it started: a clock so far from 0 that a positive `d` is lost
    against it (`t + d == t`) would report that step, and every latency it adds to, as taking no time."""
    if not end < math.inf:
        raise RuntimeError(f"the run's clock overflows: a step of {d!r} s ends past the largest float "
                           "(check the step-time function)")
    if end == t and d > 0.0:
        raise ClockError(f"a step of {d!r} s starting at {t!r} s on the run's clock ends when it starts: at that "
                         f"time a float cannot hold a step so short, and every latency would lose it. The clock "
                         "counts from the first arrival; bring the arrivals closer together (a higher rate, or a "
                         "trace cut into shorter pieces)")


_RULE = "every duration must be a finite number >= 0 (check the step-time function)"


def check_duration(d: object) -> None:
    """Raise unless `d` is a step duration: a finite number >= 0 (a bool or a string is not one).
    Called only where each step's own test (a float in [0, inf)) failed: the common case is not
    tested twice."""
    if not is_real(d):
        raise RuntimeError(f"the executor returned {brief(d)} ({type(d).__name__}) as a step duration; {_RULE}")
    if not (is_finite_real(d) and d >= 0):
        raise RuntimeError(f"the executor returned a step duration of {brief(d)} s; {_RULE}")
