"""Batch-size controllers behind one interface (lecture §2.3; Clipper paper §4.3.1).

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

from .profile import fit_line


def _check_pos_int(name: str, v: object, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def _check_slo(slo_ms: float) -> float:
    if isinstance(slo_ms, bool) or not isinstance(slo_ms, (int, float)) or not math.isfinite(slo_ms) or slo_ms <= 0:
        raise ValueError(f"slo_ms must be a finite number of milliseconds > 0, got {slo_ms!r}")
    return float(slo_ms)


class BatchController(ABC):
    """Proposes the next maximum batch; learns from observed batch latencies."""

    @property
    @abstractmethod
    def max_batch(self) -> int:
        """The largest batch the next dispatch may send (>= 1)."""

    def observe(self, batch_size: int, latency_ms: float) -> int:
        """Record one executed batch; returns the new `max_batch`."""
        _check_pos_int("batch_size", batch_size)
        if isinstance(latency_ms, bool) or not isinstance(latency_ms, (int, float, np.floating)) \
                or not math.isfinite(latency_ms) or latency_ms < 0:
            raise ValueError(f"latency_ms must be a finite number >= 0, got {latency_ms!r}")
        self._observe(int(batch_size), float(latency_ms))
        return self.max_batch

    @abstractmethod
    def _observe(self, batch_size: int, latency_ms: float) -> None: ...


class FixedBatch(BatchController):
    """A batch size tuned offline and never changed: the baseline AIMD is compared with."""

    def __init__(self, size: int) -> None:
        self._size = _check_pos_int("size", size)

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
    `floor(min(batch, max) * backoff)`; a batch within it raises the maximum by `increase`, but only
    when the batch was full (`batch_size >= max_batch`): a half-empty batch that met the SLO says
    nothing about a bigger one, and growing on it would let the maximum drift up without bound at low
    load (TCP's congestion-window validation, RFC 7661, makes the same rule). Set
    `grow_only_when_full=False` for the paper's plain rule.
    """

    def __init__(self, slo_ms: float, *, start: int = 1, increase: int = 1, backoff: float = 0.9,
                 margin: float = 0.0, min_batch: int = 1, cap: int | None = None,
                 grow_only_when_full: bool = True) -> None:
        self.slo_ms = _check_slo(slo_ms)
        self.increase = _check_pos_int("increase", increase)
        if not (isinstance(backoff, (int, float)) and 0.0 < backoff < 1.0):
            raise ValueError(f"backoff must be strictly between 0 and 1 (Clipper uses 0.9), got {backoff!r}")
        if not (isinstance(margin, (int, float)) and 0.0 <= margin < 1.0):
            raise ValueError(f"margin is the fraction of the SLO kept free, in [0, 1), got {margin!r}")
        self.backoff = float(backoff)
        self.margin = float(margin)
        self.min_batch = _check_pos_int("min_batch", min_batch)
        self.cap = None if cap is None else _check_pos_int("cap", cap, self.min_batch)
        start = _check_pos_int("start", start)
        self.grow_only_when_full = bool(grow_only_when_full)
        self._max = self._clip(start)

    @property
    def target_ms(self) -> float:
        return self.slo_ms * (1.0 - self.margin)

    @property
    def max_batch(self) -> int:
        return self._max

    def _clip(self, b: int) -> int:
        b = max(self.min_batch, b)
        return b if self.cap is None else min(self.cap, b)

    def _observe(self, batch_size: int, latency_ms: float) -> None:
        if latency_ms > self.target_ms:
            self._max = self._clip(math.floor(min(batch_size, self._max) * self.backoff))
        elif batch_size >= self._max or not self.grow_only_when_full:
            self._max = self._clip(self._max + self.increase)

    def __repr__(self) -> str:
        return f"AIMD(slo_ms={self.slo_ms}, margin={self.margin}, max_batch={self._max})"


class QuantileRegression(BatchController):
    """Largest batch whose fitted `quantile` latency line meets the SLO (paper §4.3.1).

    Keeps the last `window` observations; until it has `warmup` of them at two or more batch sizes it
    explores as AIMD does. After that it refits the quantile line every `refit_every` batches and
    proposes `floor((SLO - a_q) / b_q)`. Every `probe_every`-th proposal is a smaller probe
    (`probe_fraction` of the estimate): without batch sizes spread along the line, a window that
    only ever saw one size could not tell the fixed cost from the per-input cost.
    A sliding window makes it adaptive, asymmetrically: a slowdown shows in the tail as soon as 1%
    of the window is slow, a recovery only once the slow batches have left the window.
    """

    def __init__(self, slo_ms: float, *, quantile: float = 0.99, window: int = 200, warmup: int = 30,
                 refit_every: int = 5, probe_every: int = 10, probe_fraction: float = 0.5,
                 start: int = 1, cap: int | None = None) -> None:
        self.slo_ms = _check_slo(slo_ms)
        if not (isinstance(quantile, float) and 0.0 < quantile < 1.0):
            raise ValueError(f"quantile must be a float strictly between 0 and 1, got {quantile!r}")
        self.quantile = quantile
        self.window = _check_pos_int("window", window, 3)
        self.warmup = _check_pos_int("warmup", warmup, 2)
        if self.warmup > self.window:
            raise ValueError(f"warmup ({warmup}) cannot exceed window ({window})")
        self.refit_every = _check_pos_int("refit_every", refit_every)
        self.probe_every = _check_pos_int("probe_every", probe_every, 2)
        if not (isinstance(probe_fraction, (int, float)) and 0.0 < probe_fraction < 1.0):
            raise ValueError(f"probe_fraction must be strictly between 0 and 1, got {probe_fraction!r}")
        self.probe_fraction = float(probe_fraction)
        self.cap = None if cap is None else _check_pos_int("cap", cap)
        self._explore = AIMD(slo_ms, start=start, cap=cap)
        self._xs: deque[int] = deque(maxlen=self.window)
        self._ys: deque[float] = deque(maxlen=self.window)
        self._estimate: int | None = None
        self._n = 0
        self.line: tuple[float, float] | None = None  # (a_q, b_q) of the last fit

    @property
    def estimate(self) -> int:
        """The current largest batch meeting the SLO at the fitted quantile (no probing)."""
        return self._explore.max_batch if self._estimate is None else self._estimate

    @property
    def max_batch(self) -> int:
        est = self.estimate
        if self._estimate is not None and self._n % self.probe_every == self.probe_every - 1:
            return max(1, int(est * self.probe_fraction))
        return est

    def _observe(self, batch_size: int, latency_ms: float) -> None:
        self._n += 1
        self._xs.append(batch_size)
        self._ys.append(latency_ms)
        if self._estimate is None:
            self._explore.observe(batch_size, latency_ms)
            if len(self._xs) < self.warmup or len(set(self._xs)) < 2:
                return
        elif self._n % self.refit_every:
            return
        a, b = fit_line(np.fromiter(self._xs, float), np.fromiter(self._ys, float), self.quantile)
        self.line = (a, b)
        if b <= 0:  # no visible per-input cost yet: keep growing as AIMD would on success
            est = self.estimate + 1
        else:
            est = max(1, math.floor((self.slo_ms - a) / b + 1e-9))
        self._estimate = est if self.cap is None else min(self.cap, est)

    def __repr__(self) -> str:
        return f"QuantileRegression(slo_ms={self.slo_ms}, q={self.quantile}, estimate={self.estimate})"
