"""A controller driving a saturated model, batch after batch (lecture §2.3, code 01 demo 2).

With a backlog that never runs dry every batch is as large as the controller allows, so the only
thing that varies is the controller: this is how the lecture compares a fixed batch with AIMD under
interference. `execute(i, batch_size) -> latency_ms` runs batch `i`: a toy latency model, or a real
torch forward timed by the wall clock (`clipper.torch_models.run_online`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from orca_torch.checks import brief, check_callable, check_fits_in_memory, check_instance, check_int, check_real

from .controllers import BatchController, read_max_batch
from .profile import as_numbers, check_slo_ms, holds_bool


@dataclass
class ControllerTrace:
    """What happened to each batch: its size and its latency (ms)."""

    batch_sizes: np.ndarray
    latencies_ms: np.ndarray

    def __post_init__(self) -> None:
        b, lat = np.asarray(self.batch_sizes), as_numbers(self.latencies_ms)
        if lat is None:
            raise ValueError(f"latencies_ms must be finite numbers >= 0 (not bools, nor strings), got "
                             f"{brief(self.latencies_ms, 80)}")
        if b.ndim != 1 or b.shape != lat.shape:
            raise ValueError(f"batch_sizes and latencies_ms must be 1-D and of equal length, got shapes "
                             f"{b.shape} and {lat.shape}")
        if not (np.issubdtype(b.dtype, np.integer) and np.all(b >= 1)) or holds_bool(self.batch_sizes):
            raise ValueError(f"batch_sizes must be integers >= 1 (not bools), got {brief(self.batch_sizes, 80)}")
        if not np.all(np.isfinite(lat) & (lat >= 0)):
            raise ValueError("latencies_ms must be finite numbers >= 0")
        self.batch_sizes, self.latencies_ms = b, lat

    def _window(self, start: int | None, stop: int | None) -> slice:
        """Batches `[start, stop)` (None: the trace's first, its end) as a slice, refused if empty."""
        n = len(self.batch_sizes)
        start = 0 if start is None else check_int("start", start, 0, n)
        stop = n if stop is None else check_int("stop", stop, 0, n)
        if stop <= start:
            raise ValueError(f"batches [start, stop) = [{start}, {stop}) is empty; the trace has {n} batches")
        return slice(start, stop)

    def _busy_ms(self, s: slice) -> float:
        total = float(self.latencies_ms[s].sum())
        if total <= 0:
            raise ValueError(f"batches [{s.start}, {s.stop}) took no time (every latency is 0): no rate to report")
        return total

    def throughput_qps(self, start: int | None = None, stop: int | None = None) -> float:
        """Inputs served per second over batches `[start, stop)`, back to back."""
        s = self._window(start, stop)
        return 1000.0 * float(self.batch_sizes[s].sum()) / self._busy_ms(s)

    def goodput_qps(self, slo_ms: float, start: int | None = None, stop: int | None = None) -> float:
        """Inputs answered within the SLO per second: what a late answer is worth counted as zero."""
        slo_ms = check_slo_ms(slo_ms)
        s = self._window(start, stop)
        on_time = self.latencies_ms[s] <= slo_ms
        return 1000.0 * float(self.batch_sizes[s][on_time].sum()) / self._busy_ms(s)

    def violation_rate(self, slo_ms: float, start: int | None = None, stop: int | None = None) -> float:
        """Fraction of batches over the SLO."""
        slo_ms = check_slo_ms(slo_ms)
        s = self._window(start, stop)
        return float(np.mean(self.latencies_ms[s] > slo_ms))

    def mean_batch(self, start: int | None = None, stop: int | None = None) -> float:
        return float(self.batch_sizes[self._window(start, stop)].mean())

    def batches_until(self, predicate: Callable[[int, float], bool], start: int,
                      stop: int | None = None) -> int | None:
        """Batches from `start` until the first one (before `stop`) for which `predicate(size, latency)`
        holds; None if none does. The bounds are batch indices `0 <= start <= stop <= len(trace)`: a
        negative one would silently search from the trace's end, as a Python index does."""
        check_callable("predicate", predicate, "(batch size, latency in ms) -> bool")
        n = len(self.batch_sizes)
        start = check_int("start", start, 0, n)
        stop = n if stop is None else check_int("stop", stop, start, n)
        for j in range(start, stop):
            if predicate(int(self.batch_sizes[j]), float(self.latencies_ms[j])):
                return j - start
        return None

    def compact(self, every: int) -> list[int]:
        """Every `every`-th batch size: a trace short enough to print on one line."""
        every = check_int("every", every, 1)
        return [int(b) for b in self.batch_sizes[::every]]


def run_closed_loop(controller: BatchController, execute: Callable[[int, int], float],
                    n_batches: int) -> ControllerTrace:
    """Run `n_batches` batches of the size the controller allows, feeding back each latency."""
    check_instance("controller", controller, BatchController)
    check_callable("execute", execute, "(batch index, batch size) -> latency in ms")
    n_batches = check_int("n_batches", n_batches, 1)
    check_fits_in_memory(f"run_closed_loop(n_batches={n_batches:,})", 16 * n_batches)  # (the trace, allocated up front)
    sizes = np.empty(n_batches, dtype=np.int64)
    lats = np.empty(n_batches, dtype=float)
    for i in range(n_batches):
        b = read_max_batch(controller)
        lat = check_real(f"the latency execute({i}, {b}) returned", execute(i, b), 0.0, unit="milliseconds")
        controller.observe(b, lat)
        sizes[i], lats[i] = b, lat
    return ControllerTrace(sizes, lats)
