"""Latency profiles `a + b·B` and the largest batch under an SLO (lecture §2.2, exercise 2).

Clipper measured how long one batch takes as the batch grows and found that for many frameworks the
curve is close to a line: `a` is the fixed cost of sending a batch (RPC, framework overhead, copying
inputs to the GPU), `b` the cost of one more input. Given a latency objective the largest batch is
`B_max = floor((SLO - a) / b)`; the batch that pays off differs by orders of magnitude between models,
so it has to be set per model. Times are in milliseconds throughout `clipper/`.

`fit_profile` turns measurements into a profile: least squares for the mean latency, or a linear
quantile regression (minimum pinball loss) for a tail such as P99, which is what a batch size must
be chosen from if most batches, not the average one, are to meet the SLO (lecture §2.3; Clipper paper §4.2).
"""
from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from orca_torch.checks import brief, check_int, check_probability, check_real, is_finite_real, is_real

_ROUNDING = 1e-8  # relative size below which a per-input cost is indistinguishable from zero
_EPS = 1e-9  # so that (20 - 3) / 0.5 = 34 is not floored to 33 by rounding
_QUOTIENT_RTOL = 8 * sys.float_info.epsilon
"""The rounding of `(SLO - a) / b`, relative to `(SLO + a) / b` (each input and each operation carries up
to half a unit in the last place, and SLO - a cancels what SLO and a share): an exact quotient of
236867175 comes out as 236867174.99999997, past what `_EPS` alone covers, and must not floor to one
input less. Never more than half an input: past some 1e14 inputs a float no longer resolves one."""
MAX_BATCH = 2**63 - 1  # the largest batch an int64 counts
MAX_LATENCY_MS = 1e12
"""The largest latency a line is fitted to (some 30 years): far past any measurement, and small
enough that the quantile search's span stays finite (1e308 made a line of -inf and inf)."""


@dataclass(frozen=True)
class LatencyProfile:
    """Batch latency `a_ms + b_ms * B` of one model on one machine."""

    a_ms: float
    b_ms: float
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"LatencyProfile.name must be a str (the model's name, or \"\"), got {brief(self.name)} "
                             f"({type(self.name).__name__})")
        # (at most MAX_LATENCY_MS each, as a fitted line's latencies are: a batch of 2**63 - 1 stays a finite time)
        object.__setattr__(self, "a_ms", check_real("LatencyProfile.a_ms (fixed cost per batch)", self.a_ms, 0.0,
                                                    MAX_LATENCY_MS, unit="milliseconds"))
        object.__setattr__(self, "b_ms", check_real("LatencyProfile.b_ms (cost per input)", self.b_ms, 0.0,
                                                    MAX_LATENCY_MS, lo_open=True, unit="milliseconds"))
        if self.b_ms <= _ROUNDING * max(1.0, self.a_ms):
            raise ValueError(f"LatencyProfile.b_ms (cost per input) {self.b_ms:.3g} ms is within rounding of zero "
                             f"beside a fixed cost of {self.a_ms:.3g} ms: with no per-input cost there is no "
                             "largest batch to divide the SLO into; cap the batch instead")

    def latency_ms(self, batch_size: int | np.ndarray) -> float | np.ndarray:
        """Time of one batch of `batch_size` inputs (an array of times for a list or array of sizes)."""
        return self.a_ms + self.b_ms * check_batch_sizes(batch_size)

    def max_batch(self, slo_ms: float) -> int:
        """`floor((SLO - a) / b)`: 0 means not even one input fits within the SLO.

        A batch must be countable by an int64 (numpy's sizes and traces), so an SLO that would allow
        more than 2**63 - 1 inputs is refused rather than answered with infinity or a wrapped count.
        """
        slo_ms = check_slo_ms(slo_ms, "slo_ms (the SLO)")
        quotient = (slo_ms - self.a_ms) / self.b_ms
        batch = quotient + min(0.5, max(_EPS, _QUOTIENT_RTOL * (slo_ms + self.a_ms) / self.b_ms))
        if not batch <= MAX_BATCH:
            raise ValueError(f"slo_ms {float(slo_ms):g} ms is too large for this profile: the batch would exceed "
                             f"2**63 - 1 inputs; allowed: slo_ms <= a_ms + b_ms * (2**63 - 1), about "
                             f"{self.a_ms + self.b_ms * MAX_BATCH:.6g} ms")
        return max(0, math.floor(batch))

    def throughput_qps(self, batch_size: int) -> float:
        """Inputs per second of one worker that always runs batches of `batch_size`."""
        batch_size = check_int("batch_size", batch_size, 1, MAX_BATCH)
        return 1000.0 * batch_size / self.latency_ms(batch_size)

    def scaled(self, a_factor: float = 1.0, b_factor: float = 1.0) -> "LatencyProfile":
        """The same model on a slower or faster machine (interference scales the per-input cost)."""
        a_factor = check_real("a_factor", a_factor, 0.0)
        b_factor = check_real("b_factor", b_factor, 0.0, lo_open=True)
        return LatencyProfile(self.a_ms * a_factor, self.b_ms * b_factor, self.name)


def check_batch_sizes(batch_size: int | Sequence[int] | np.ndarray) -> int | np.ndarray:
    """A batch size as an `int`, or a list or array of them as an integer array: each an integer in
    [1, 2**63 - 1], as the controllers take them (a batch counts inputs: 2.5, inf or True is a
    caller's slip, which a latency formula would otherwise answer with a number)."""
    try:
        b = np.asarray(batch_size)
    except ValueError:      # a ragged list
        b = None
    if b is not None and b.ndim == 0 and not isinstance(batch_size, np.ndarray):
        return check_int("batch_size", batch_size, 1, MAX_BATCH)
    if b is None or not np.issubdtype(b.dtype, np.integer) or holds_bool(batch_size) \
            or not np.all((b >= 1) & (b <= MAX_BATCH)):
        raise ValueError(f"batch_size must be an integer in [1, {MAX_BATCH}], or a list or array of them "
                         f"(not bools), got {brief(batch_size)}")
    return b


def check_slo_ms(slo_ms: float, name: str = "slo_ms") -> float:
    """A latency SLO in milliseconds, > 0 (the profile's, the controllers' and the closed loop's)."""
    return check_real(name, slo_ms, 0.0, lo_open=True, unit="milliseconds")


def holds_bool(v: Any) -> bool:
    """True for a bool, or a sequence (a list, a tuple; not an array) with one in it at any depth: numpy
    reads [True, 2] as the numbers [1, 2], so a check of the array alone takes a bool beside numbers
    that it refuses alone."""
    if isinstance(v, (bool, np.bool_)):
        return True
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        return False
    return any(holds_bool(e) for e in v)


def as_numbers(v: Sequence[float]) -> np.ndarray | None:
    """`v` as a float array, or None if it holds anything but real numbers (Python ints past int64's
    are numbers: the range check names them; one past any float is infinite, as the finite check says)."""
    try:
        a = np.asarray(v)
    except (TypeError, ValueError):     # a ragged list
        return None
    if a.dtype.kind in "iuf":
        return None if holds_bool(v) else a.astype(float)
    if a.dtype.kind == "O" and a.ndim == 1 and all(is_real(e) for e in a):
        return np.array([e if is_finite_real(e) else math.inf for e in a], dtype=float)   # (10**400: no float)
    return None


def _check_xy(batch_sizes: Sequence[float], latencies_ms: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Both as float arrays, if they hold numbers: not bools, nor strings ("1" would convert), nor ragged lists."""
    x, y = as_numbers(batch_sizes), as_numbers(latencies_ms)
    if x is None or y is None:
        raise ValueError(f"batch sizes and latencies must be sequences of numbers (not bools, nor strings), got "
                         f"{brief(batch_sizes, 80)} and {brief(latencies_ms, 80)}")
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError("batch sizes and latencies must be 1-D and of equal length, "
                         f"got shapes {x.shape} and {y.shape}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("batch sizes and latencies must be finite numbers")
    if x.size == 0:
        raise ValueError("a line needs measurements at two or more distinct batch sizes, got none")
    if np.any(x < 1) or np.any(y < 0) or x.max() > MAX_BATCH or y.max() > MAX_LATENCY_MS:
        raise ValueError(f"batch sizes must be in [1, 2**63 - 1] and latencies in [0, {MAX_LATENCY_MS:g}] ms, "
                         f"got batch sizes {x.min():g}..{x.max():g} and latencies {y.min():g}..{y.max():g}")
    if np.unique(x).size < 2:
        raise ValueError("a line needs measurements at two or more distinct batch sizes")
    return x, y


def _slope_span(x: np.ndarray, y: np.ndarray) -> float:
    """More than the steepest slope between two measurements: their latency range over the smallest
    step between batch sizes, plus 1 (the quantile search looks within +-this)."""
    return (y.max() - y.min()) / np.diff(np.unique(x)).min() + 1.0


def _slope_tolerance(x: np.ndarray, y: np.ndarray) -> float:
    """The slope below which a fit cannot tell a per-input cost from rounding: 10x the quantile
    search's own resolution (the least-squares fit is far finer)."""
    return _ROUNDING * max(1.0, _slope_span(x, y), float(np.abs(y).max()))


def slope_is_zero(b: float, batch_sizes: Sequence[float], latencies_ms: Sequence[float]) -> bool:
    """True if a fitted slope `b` is within rounding of zero for these measurements (a flat profile)."""
    x, y = np.asarray(batch_sizes, dtype=float), np.asarray(latencies_ms, dtype=float)
    return abs(b) <= _slope_tolerance(x, y)


def _weighted_quantile(v: np.ndarray, w: np.ndarray, q: float) -> float:
    """Smallest `v` whose cumulative weight reaches `q`: the pinball minimiser of `y - b·x`, `v = y/x`, `w = x`."""
    order = np.argsort(v)
    cum = np.cumsum(w[order])
    return float(v[order][np.searchsorted(cum, q * cum[-1])])


def fit_line(batch_sizes: Sequence[float], latencies_ms: Sequence[float],
             quantile: float | None = None) -> tuple[float, float]:
    """Intercept and slope of the mean (least squares) or `quantile` line of latency vs batch size.

    The quantile line minimises the pinball loss. For a fixed slope the best intercept is the
    quantile of the residuals `y - b·x`, and the remaining loss is convex in the slope, so a
    golden-section search over the slope finds the exact minimiser to float precision.
    """
    x, y = _check_xy(batch_sizes, latencies_ms)
    if quantile is None:
        b, a = np.polyfit(x, y, 1)
        return float(a), float(b)
    quantile = check_probability("quantile", quantile, lo_open=True, hi_open=True)
    span = _slope_span(x, y)
    lo, hi = -span, span
    k = max(0, math.ceil(quantile * y.size) - 1)  # the residual order statistic that is the q-quantile

    def loss(b: float) -> tuple[float, float]:
        r = y - b * x
        a = float(np.partition(r, k)[k])
        r -= a
        return float(np.sum(np.maximum(quantile * r, (quantile - 1.0) * r))), a

    g = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = hi - g * (hi - lo), lo + g * (hi - lo)
    fc, fd = loss(c)[0], loss(d)[0]
    tol = 1e-9 * max(1.0, span)
    while hi - lo > tol:
        if fc <= fd:
            hi, d, fd = d, c, fc
            c = hi - g * (hi - lo)
            fc = loss(c)[0]
        else:
            lo, c, fc = c, d, fd
            d = lo + g * (hi - lo)
            fd = loss(d)[0]
    b = (lo + hi) / 2.0
    return loss(b)[1], float(b)


def fit_profile(batch_sizes: Sequence[float], latencies_ms: Sequence[float],
                quantile: float | None = None, name: str = "") -> LatencyProfile:
    """A `LatencyProfile` from measurements (mean line, or the `quantile` line such as 0.99).

    A fixed cost cannot be negative: if the free fit crosses zero, the line is refitted through the
    origin. A slope <= 0, or one within rounding of zero (a flat profile), means latency does not
    grow with the batch over the measured range, which no profile can describe (its largest batch
    would be a division by rounding noise), so it is an error rather than a silently clamped number.
    """
    a, b = fit_line(batch_sizes, latencies_ms, quantile)
    x, y = _check_xy(batch_sizes, latencies_ms)
    if b > 0 and slope_is_zero(b, x, y):
        raise ValueError(f"fitted slope {b:.3g} ms/input is within rounding of zero: latency does not grow "
                         "with the batch over the measured batch sizes (no per-input cost to divide the SLO "
                         "by); measure a wider range of sizes, or cap the batch instead")
    if a < 0:
        if quantile is None:
            b = float(np.dot(x, y) / np.dot(x, x))
        else:
            b = _weighted_quantile(y / x, x, quantile)
        a = 0.0
    if not b > 0:
        raise ValueError(f"fitted slope {b:.3g} ms/input is not > 0: latency does not grow with the batch "
                         "over the measured batch sizes; measure a wider range of sizes")
    return LatencyProfile(a, b, name)
