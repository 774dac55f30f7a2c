"""Batch-size controllers behind one interface (lecture §2.3; Clipper paper §4.2, Batching).

A controller proposes the largest batch the next dispatch may send (`max_batch`) and learns from
each batch it hears about (`observe(batch_size, latency_ms)`). The batching queue, the closed-loop
runner and the real torch models all talk to this interface only, so every policy can steer every
kind of model:

- `FixedBatch`: the offline-tuned baseline. Fine until the machine changes under it.
- `AIMD`: Clipper's default, borrowed from TCP congestion control: +`increase` after a batch that met
  the target, `x backoff` (0.9, a gentle 10%) after one that missed. It finds the limit by probing
  until a batch misses, so at steady state some batches always miss; a `margin` (target below the
  SLO) trades a little throughput for fewer misses (lecture §2.3, pitfall 7).
- `QuantileRegression`: the paper's alternative: fit the P99 latency line over recent batches and
  take the largest batch whose predicted P99 meets the SLO.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque

import numpy as np

from orca_torch.checks import check_flag, check_int, check_probability, check_real

from .profile import MAX_BATCH, MAX_LATENCY_MS, check_slo_ms, fit_line, slope_is_zero


class BatchController(ABC):
    """Proposes the next maximum batch; learns from observed batch latencies.

    A new controller subclasses this and writes two things: the property `max_batch` (an `int` in
    [1, 2**63 - 1]; the queue may send fewer when fewer wait) and `_observe(batch_size, latency_ms)`,
    which learns from one finished batch. Callers (`run_closed_loop`, `simulate_queue`,
    `torch_models.run_online`) call `observe`, which checks the batch and its latency before
    `_observe` sees them, and read `max_batch` through a check that refuses anything but such an
    integer (0, 2.5, NaN, a bool). `observe` is therefore not overridden: a subclass that does is
    refused when it is defined, since its `_observe` would be handed whatever a caller sent."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "observe" in vars(cls):
            raise TypeError(f"{cls.__name__} overrides BatchController.observe, which checks each batch size and "
                            "latency before the controller learns from them; write _observe(batch_size, "
                            "latency_ms) instead (observe calls it and returns max_batch)")

    @property
    @abstractmethod
    def max_batch(self) -> int:
        """The largest batch the next dispatch may send (>= 1)."""

    def observe(self, batch_size: int, latency_ms: float) -> int:
        """Record one executed batch; returns the new `max_batch`.

        A latency is at most `MAX_LATENCY_MS` (some 30 years), the largest a profile line is fitted
        to: checked here, before any controller keeps it, because `QuantileRegression` would
        otherwise hold it in its window and fail at every refit until it slid out."""
        batch_size = check_int("batch_size", batch_size, 1, MAX_BATCH)
        latency_ms = check_real("latency_ms", latency_ms, 0.0, MAX_LATENCY_MS, unit="milliseconds")
        self._observe(batch_size, latency_ms)
        return self.max_batch

    @abstractmethod
    def _observe(self, batch_size: int, latency_ms: float) -> None: ...


def read_max_batch(controller: BatchController) -> int:
    """`controller.max_batch`, checked where it is used: a custom controller answering 2.5 or 2**70
    would otherwise fail deep inside a slice or an int64 array."""
    return check_int(f"{type(controller).__name__}.max_batch (the batch the controller allows)",
                     controller.max_batch, 1, MAX_BATCH)


class FixedBatch(BatchController):
    """A batch size tuned offline and never changed: the baseline AIMD is compared with.

    At most `MAX_BATCH` (2**63 - 1, a batch an int64 counts), the bound the other controllers clip to;
    a fixed size above it is refused rather than silently changed."""

    def __init__(self, size: int) -> None:
        self._size = check_int("size (at most 2**63 - 1, the largest batch an int64 counts)", size, 1, MAX_BATCH)

    @property
    def max_batch(self) -> int:
        return self._size

    def _observe(self, batch_size: int, latency_ms: float) -> None:
        pass

    def __repr__(self) -> str:
        return f"FixedBatch({self._size})"


class AIMD(BatchController):
    """Additive increase, multiplicative decrease of the maximum batch (Clipper's default).

    `target_ms = slo_ms * (1 - margin)`. A batch slower than the target cuts the maximum to
    `floor(batch * backoff)`, never raising it; a batch within it raises the maximum by `increase`,
    but only when the batch was full (`batch_size >= max_batch`): a half-empty batch that met the SLO
    says nothing about a bigger one, and growing on it would let the maximum drift up without bound
    at low load (TCP's congestion-window validation, RFC 7661, is a looser form of this rule: it grows
    the window only once at least half of it was in use). Set
    `grow_only_when_full=False` for the paper's plain increase. The first maximum is `start` (by
    default `min_batch`), which must lie within `[min_batch, cap]`.

    What is cut: the paper and the lecture cut "the batch size" by 10% on a miss, and the batch size
    they adapt is the maximum. With a backlog (`run_closed_loop`'s, the lecture's demo 2) every
    batch is the maximum, so `x backoff` of the batch that missed is their rule exactly (exercise
    2c: a miss at 18 leaves floor(18 * 0.9) = 16). The two differ only for a batch of another size: a
    larger one sent before a cut (the next paragraph) or a smaller one, for which the batch is the
    one to cut from: a partial batch of 10 that missed shows that 10 is already too many, so the
    maximum goes to 9, where `x 0.9` of a maximum of 40 would leave 36 and take eleven misses (36,
    32, 28, ..., 11, 9) to come below the size known to miss.

    One controller may steer several replicas (`simulate_queue(n_workers > 1)` shares it): state is
    shared, every replica's batches are observed, each dispatch reads the one maximum. A cut is
    relative to the batch that missed, so the batches already in flight at the old size, which miss
    too, cut once between them rather than once each (TCP's one decrease per window): `x 0.9**k` for
    k replicas would make the backoff depend on how many replicas there are. Shared state suits
    identical replicas (the queue simulator's); replicas of different speeds would share the slowest
    one's maximum, and each would want a controller of its own.
    """

    def __init__(self, slo_ms: float, *, start: int | None = None, increase: int = 1, backoff: float = 0.9,
                 margin: float = 0.0, min_batch: int = 1, cap: int | None = None,
                 grow_only_when_full: bool = True) -> None:
        self.slo_ms = check_slo_ms(slo_ms)
        self.increase = check_int("increase", increase, 1)
        self.backoff = check_probability("backoff (Clipper uses 0.9)", backoff, lo_open=True, hi_open=True)
        self.margin = check_probability("margin (the fraction of the SLO kept free)", margin, hi_open=True)
        self.min_batch = check_int("min_batch (at most 2**63 - 1, the largest batch an int64 counts)", min_batch, 1,
                                   MAX_BATCH)
        self.cap = None if cap is None else check_int("cap (at least min_batch)", cap, self.min_batch)
        # (a start outside [min_batch, cap] is refused, not moved: the first batch would not be the one asked for)
        start = self.min_batch if start is None else check_int(
            "start (the first max_batch, within [min_batch, cap])", start, self.min_batch,
            MAX_BATCH if self.cap is None else min(self.cap, MAX_BATCH))
        self.grow_only_when_full = check_flag("grow_only_when_full", grow_only_when_full)
        self._max = start

    @property
    def target_ms(self) -> float:
        return self.slo_ms * (1.0 - self.margin)

    @property
    def max_batch(self) -> int:
        return self._max

    def _clip(self, b: int) -> int:
        b = max(self.min_batch, min(b, MAX_BATCH))     # (a batch an int64 still counts)
        return b if self.cap is None else min(self.cap, b)

    def _observe(self, batch_size: int, latency_ms: float) -> None:
        if latency_ms > self.target_ms:      # multiplicative decrease (lecture §2.3): x backoff, 0.9
            self._max = min(self._max, self._clip(math.floor(batch_size * self.backoff)))
        elif batch_size >= self._max or not self.grow_only_when_full:   # additive increase: + increase, 1
            self._max = self._clip(self._max + self.increase)

    def __repr__(self) -> str:
        return f"AIMD(slo_ms={self.slo_ms}, margin={self.margin}, max_batch={self._max})"


FIT_RTOL = 1e-6
"""`fit_line`'s search for the quantile line stops within about 1e-8 of its slope (relative), so a
quotient `(SLO - a_q) / b_q` within a millionth of an integer is taken as that integer: on the
exact line 3 + 0.5 B at a 20 ms SLO the fit gives 33.99999986, and the answer is 34 (exercise 2a)."""


class QuantileRegression(BatchController):
    """Largest batch whose fitted `quantile` latency line meets the SLO (lecture §2.3; Clipper paper §4.2).

    Keeps the last `window` observations; until it has `warmup` of them at two or more batch sizes it
    explores as AIMD does. After that it refits the quantile line every `refit_every` batches and
    proposes `floor((SLO - a_q) / b_q)`. Every `probe_every`-th proposal is a smaller probe
    (`probe_fraction` of the estimate; at an estimate of 1, a batch of 2, which may miss the SLO:
    the price of noticing that the model got faster): without batch sizes spread along the line, a
    window that only ever saw one size could not tell the fixed cost from the per-input cost. A
    refit over a window of one batch size (a light load that never fills a batch) keeps the estimate.
    A sliding window makes it adaptive, asymmetrically: a slowdown shows in the tail as soon as 1%
    of the window is slow, a recovery only once the slow batches have left the window.
    """

    def __init__(self, slo_ms: float, *, quantile: float = 0.99, window: int = 200, warmup: int = 30,
                 refit_every: int = 5, probe_every: int = 10, probe_fraction: float = 0.5,
                 start: int | None = None, cap: int | None = None) -> None:
        self.slo_ms = check_slo_ms(slo_ms)
        self.quantile = check_probability("quantile", quantile, lo_open=True, hi_open=True)
        self.window = check_int("window (at most 2**63 - 1 batches, what a deque holds)", window, 3, MAX_BATCH)
        self.warmup = check_int("warmup", warmup, 2)
        if self.warmup > self.window:
            raise ValueError(f"warmup ({warmup}) cannot exceed window ({window})")
        self.refit_every = check_int("refit_every", refit_every, 1)
        self.probe_every = check_int("probe_every", probe_every, 2)
        self.probe_fraction = check_probability("probe_fraction", probe_fraction, lo_open=True, hi_open=True)
        self.cap = None if cap is None else check_int("cap", cap, 1)
        # (checked here, not by the AIMD that explores: its message would name its min_batch, no setting of this class)
        start = None if start is None else check_int("start (the first max_batch, within [1, cap])", start, 1,
                                                      MAX_BATCH if self.cap is None else min(self.cap, MAX_BATCH))
        self._explore = AIMD(slo_ms, start=start, cap=cap)
        self._batch_sizes: deque[int] = deque(maxlen=self.window)
        self._latencies_ms: deque[float] = deque(maxlen=self.window)
        self._estimate: int | None = None
        self._n_observed = 0
        self.line: tuple[float, float] | None = None  # (a_q, b_q) of the last fit
        self.note = ""  # why the last estimate is what it is, when the fit alone cannot say

    @property
    def estimate(self) -> int:
        """The current largest batch meeting the SLO at the fitted quantile (no probing)."""
        return self._explore.max_batch if self._estimate is None else self._estimate

    @property
    def max_batch(self) -> int:
        est = self.estimate
        if self._estimate is not None and self._n_observed % self.probe_every == self.probe_every - 1:
            probe = int(est * self.probe_fraction)
            return probe if probe >= 1 else min(2, self.cap or 2)
        return est

    def _observe(self, batch_size: int, latency_ms: float) -> None:
        self._n_observed += 1
        self._batch_sizes.append(batch_size)
        self._latencies_ms.append(latency_ms)
        if self._estimate is None:
            self._explore.observe(batch_size, latency_ms)
            if len(self._batch_sizes) < self.warmup or len(set(self._batch_sizes)) < 2:
                return
        elif self._n_observed % self.refit_every:
            return
        x, y = np.fromiter(self._batch_sizes, float), np.fromiter(self._latencies_ms, float)
        if x.min() == x.max():
            self.note = f"the window holds batches of {int(x[0])} only: no line to fit, the estimate kept"
            return
        a, b = fit_line(x, y, self.quantile)
        self.line = (a, b)
        if b <= 0 or slope_is_zero(b, x, y):
            # No per-input cost visible (a flat profile's slope is rounding noise): never divide by
            # it. If the fixed cost meets the SLO every batch size does, so answer with the cap (or,
            # without one, grow by one as AIMD would on success); if not, no batch size does.
            seen = (f"no per-input cost visible (fitted slope {b:.3g} ms/input over batch sizes "
                    f"{int(x.min())}..{int(x.max())})")
            if a > self.slo_ms:
                est = 1
                self.note = f"{seen}, and the fixed cost {a:.3g} ms alone exceeds the SLO: batch of 1"
            elif self.cap is not None:
                est = self.cap
                self.note = f"{seen}: answering with cap={self.cap}"
            else:
                est = min(self.estimate + 1, MAX_BATCH)
                self.note = f"{seen}: growing by one per refit; set a cap to bound it"
        else:           # B_max = floor((SLO - a_q) / b_q) on the quantile line (lecture §2.2, §2.3)
            b_max = (self.slo_ms - a) / b
            est = max(1, min(math.floor(min(b_max + FIT_RTOL * abs(b_max), MAX_BATCH)), MAX_BATCH))  # (float 2**63)
            self.note = ""
        self._estimate = est if self.cap is None else min(self.cap, est)

    def __repr__(self) -> str:
        return f"QuantileRegression(slo_ms={self.slo_ms}, q={self.quantile}, estimate={self.estimate})"
