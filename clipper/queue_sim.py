"""A batching queue under open-loop Poisson arrivals, with and without delayed batching (lecture §2.4).

One model, one queue, `n_workers` replicas. When a worker is free and requests wait, it takes up to
`max_batch` of them (a fixed number or a `BatchController`'s current proposal: one controller
shared by the replicas, which learns of each batch once it has finished; see `AIMD`). With
`delay_ms > 0` it first waits, as Nagle's algorithm does, until either the batch is full or the
oldest waiting request has waited `delay_ms`; a request that already waited that long (a backlog)
goes at once. So under load the delay costs nothing, and below capacity it buys bigger batches:
fewer fixed costs paid for the same requests, at the price of latency.

Time is in milliseconds. The loop advances one *batch* at a time over arrival times drawn up front
with numpy, so a run of 10^5 requests takes well under a second with a fixed batch or `AIMD`. A
`QuantileRegression` refits its line every few batches (some 0.6 ms a fit), which at light load, a
batch for each request or two, makes it seconds (12 s on the shared 2-core test machine). Arrivals
and latency jitter use two streams spawned from the seed, so two runs that differ only in the delay
see the same arrivals.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from orca_torch.checks import brief, check_fits_in_memory, check_instance, check_int, check_real, check_seed

from .controllers import BatchController, read_max_batch
from .profile import LatencyProfile, as_numbers, holds_bool
from .toy_models import NoisyLatency

BYTES_PER_REQUEST = 80
"""What one simulated request holds at the peak (its arrival, draw and latency, a batch size as a
list entry and an array entry, numpy's temporaries), for refusing a run that cannot fit up front."""

TIME_RESOLUTION = 1e-3
"""The coarsest a float of milliseconds may be at the last arrival, relative to a batch of one's
latency: a latency is a completion time less an arrival time, and at a rate so low that the arrivals
lie centuries apart the difference rounds away (1e-300 requests per second answered 0 ms)."""


@dataclass
class QueueResult:
    """Per-request latencies (arrival order) and per-batch sizes of one simulated run."""

    latencies_ms: np.ndarray
    batch_sizes: np.ndarray
    busy_ms: np.ndarray         # per worker
    horizon_ms: float           # time 0 to the last completion

    def __post_init__(self) -> None:
        """Checked as `ControllerTrace` is: a result built by hand must not answer NaN or a ZeroDivisionError."""
        lat, b, busy = as_numbers(self.latencies_ms), np.asarray(self.batch_sizes), as_numbers(self.busy_ms)
        if not (lat is not None and lat.ndim == 1 and lat.size and np.all(np.isfinite(lat) & (lat >= 0))):
            raise ValueError("latencies_ms must be a non-empty 1-D array of finite numbers >= 0 (one per request; "
                             "not bools, nor strings)")
        if not (b.ndim == 1 and b.dtype.kind in "iu" and np.all(b >= 1) and b.sum() == lat.size) \
                or holds_bool(self.batch_sizes):
            raise ValueError(f"batch_sizes must be a 1-D array of integers >= 1 that add up to the {lat.size} "
                             f"requests (not bools), got {brief(self.batch_sizes, 80)}")
        if not (busy is not None and busy.ndim == 1 and busy.size and np.all(np.isfinite(busy) & (busy >= 0))):
            raise ValueError("busy_ms must be a non-empty 1-D array of finite numbers >= 0 (one per worker; not "
                             "bools, nor strings)")
        self.horizon_ms = check_real("horizon_ms", self.horizon_ms, 0.0, lo_open=True, unit="milliseconds")
        self.latencies_ms, self.batch_sizes, self.busy_ms = lat, b, busy

    @property
    def busy_fraction(self) -> float:
        """Share of worker time spent executing batches."""
        return float(self.busy_ms.sum() / (self.busy_ms.size * self.horizon_ms))

    @property
    def mean_batch(self) -> float:
        return float(self.batch_sizes.mean())

    @property
    def throughput_qps(self) -> float:
        return 1000.0 * self.latencies_ms.size / self.horizon_ms

    def latency_pct(self, q: float) -> float:
        """The `q`-th percentile of the latencies (ms), `q` in [0, 100] (99, not 0.99, for the p99)."""
        return float(np.percentile(self.latencies_ms, check_real("q (a percentile)", q, 0.0, 100.0)))

    @property
    def mean_latency_ms(self) -> float:
        return float(self.latencies_ms.mean())


def poisson_arrivals(rate_qps: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` arrival times (ms) of a Poisson process of `rate_qps` requests per second."""
    rate_qps = check_real("rate_qps", rate_qps, 0.0, lo_open=True, unit="requests per second")
    n = check_int("n_requests", n, 1)
    check_instance("rng", rng, np.random.Generator)
    check_fits_in_memory(f"poisson_arrivals of n_requests={n:,}", 16 * n)
    arr = np.cumsum(rng.exponential(1000.0 / rate_qps, n))
    if not np.isfinite(arr[-1]):
        raise ValueError(f"rate_qps {rate_qps:g} requests per second is too small: the arrival times of {n} "
                         "requests overflow a float of milliseconds; allowed: a rate at which they stay finite")
    return arr


def simulate_queue(latency: NoisyLatency | LatencyProfile, rate_qps: float, n_requests: int, *,
                   max_batch: int | BatchController, delay_ms: float = 0.0, n_workers: int = 1,
                   seed: int = 0) -> QueueResult:
    """Simulate one model's queue; see the module docstring for the dispatch rule.

    `latency` is one batch's time (a profile, or a profile with noise); `rate_qps` the Poisson
    arrival rate in requests per second; `max_batch` a fixed largest batch or a `BatchController`
    the `n_workers` replicas share; `delay_ms` delayed batching's timeout (lecture §2.4: how long
    the oldest waiting request may wait for the batch to fill), 0 to send at once.
    """
    if isinstance(latency, LatencyProfile):
        latency = NoisyLatency(latency, 0.0)
    if not isinstance(latency, NoisyLatency):
        raise ValueError(f"latency must be a LatencyProfile or NoisyLatency, got {type(latency).__name__}")
    delay_ms = check_real("delay_ms", delay_ms, 0.0, unit="milliseconds")
    n_workers = check_int("n_workers", n_workers, 1)
    seed = check_seed(seed)
    n_requests = check_int("n_requests", n_requests, 1)
    check_fits_in_memory(f"simulate_queue(n_requests={n_requests:,}, n_workers={n_workers:,})",
                         BYTES_PER_REQUEST * n_requests + 8 * n_workers)
    controller = max_batch if isinstance(max_batch, BatchController) else None
    fixed_cap = None if controller else check_int("max_batch", max_batch, 1)
    arr_rng, lat_rng = np.random.default_rng(seed).spawn(2)
    arr = poisson_arrivals(rate_qps, n_requests, arr_rng)
    n = arr.size
    shortest = float(latency.profile.latency_ms(1))
    if np.spacing(arr[-1]) > TIME_RESOLUTION * shortest:
        raise ValueError(f"rate_qps {rate_qps:g} requests per second is too small for this model: the last of "
                         f"{n:,} arrivals comes at {arr[-1]:.3g} ms, where a float of milliseconds is "
                         f"{np.spacing(arr[-1]):.3g} ms coarse, too coarse for a batch of one ({shortest:.3g} ms) "
                         f"and its latency would round away; allowed: a rate whose arrivals stay below about "
                         f"{TIME_RESOLUTION * shortest / np.finfo(float).eps:.3g} ms")
    if np.spacing(arr[-1] + delay_ms) > TIME_RESOLUTION * shortest:
        raise ValueError(f"delay_ms {delay_ms:g} ms is too long for this model: a batch held that long after the last "
                         f"arrival leaves at about {arr[-1] + delay_ms:.3g} ms, where a float of milliseconds is "
                         f"{np.spacing(arr[-1] + delay_ms):.3g} ms coarse, too coarse for a batch of one "
                         f"({shortest:.3g} ms), and its latency would round away; allowed: delay_ms up to about "
                         f"{TIME_RESOLUTION * shortest / np.finfo(float).eps - arr[-1]:.3g} ms at this rate")

    z = lat_rng.standard_normal(n)  # at most one batch per request: one draw each, drawn in bulk
    lat = np.empty(n)
    sizes: list[int] = []
    # Heap of (time the worker is free, worker). Idle workers leave it in index order and every batch
    # takes a request, so workers past the n-th never run: only the first n are listed.
    free = [(0.0, w) for w in range(min(n_workers, n))]
    busy = np.zeros(n_workers)
    pending: list[tuple[float, int, float]] = []  # (completion time, size, latency) not yet observed
    head = 0                            # the first request not dispatched yet (arrived or not)
    while head < n:
        t_free, w = heapq.heappop(free)
        if controller is not None:  # the controller learns of a batch only once it has finished
            while pending and pending[0][0] <= max(t_free, arr[head]):
                _, b_done, l_done = heapq.heappop(pending)
                controller.observe(b_done, l_done)
            cap = read_max_batch(controller)
        else:
            cap = fixed_cap
        t_go = max(t_free, arr[head])
        if delay_ms > 0:    # delayed batching (lecture §2.4): wait until full or the oldest waited delay_ms
            t_full = arr[head + cap - 1] if head + cap - 1 < n else math.inf
            t_go = max(t_free, min(arr[head] + delay_ms, t_full))
        b = min(cap, int(arr.searchsorted(t_go, side="right")) - head)
        dur = float(latency._latency(b, z[len(sizes)]))
        done = t_go + dur
        lat[head:head + b] = done - arr[head:head + b]
        busy[w] += dur
        sizes.append(b)
        heapq.heappush(free, (done, w))
        if controller is not None:
            heapq.heappush(pending, (done, b, dur))
        head += b
    horizon = max(t for t, _ in free)
    return QueueResult(lat, np.asarray(sizes), busy, horizon)
