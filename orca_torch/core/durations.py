"""Step durations, checked: the engine's clock only moves by what an executor says a step took.

Every duration an executor gives must be a finite number >= 0; `check_durations` says what was
wrong otherwise, and `check_clock` stops a run whose clock sums past the largest float.
"""
from __future__ import annotations

import math

import numpy as np

from orca_torch.checks import is_finite_real, is_real


def check_clock(end: float, d: float) -> None:
    """Raise if a step of `d` seconds ends at a time no float holds (finite steps summing past 1.8e308)."""
    if not end < math.inf:
        raise RuntimeError(f"the run's clock overflows: a step of {d!r} s ends past the largest float "
                           "(check the step-time function)")


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
