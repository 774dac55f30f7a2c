"""Fast-forward: price a run of identical decode steps with one call (a speed layer; lecture §4.1).

When a step is a pure decode — every running request decodes one token, nobody is admitted or
preempted — the steps after it stay the same decodes, with contexts one token longer each, until
a request finishes, the memory runs out, or an arrival could join. Instead of `m` trips through
the scheduler, take `m = min(steps to the next finish, 1 + memory.decode_room(running), steps to
the next arrival that could join)`, price the `m` steps with `executor.decode_durations`, grow the
memory by `m - 1` more tokens per request and let `Scheduler.complete` advance every request by `m`
in one pass. When `m` would be 1 (a request finishes now, or an arrival joins the very next step)
the batch is left to the engine's plain step. The timestamps are those of the step-by-step loop
exactly: the same float additions, in order (`t + d0 + d1 + ...`: a Python loop for a short run,
`cumsum` for a long one). Only executors that can price a step without running
it (`can_fast_forward`: the cost models) enter here; the torch executor never does.
"""
from __future__ import annotations

import math

import numpy as np

from .executor import Executor, check_durations
from .scheduler import Batch, Scheduler


def run_length(sched: Scheduler, batch: Batch) -> int:
    """How many steps `batch` may stand for (1: it cannot be repeated)."""
    if not sched.pure_decode:
        return 1
    running = sched.running
    m = min([r.output_len - r.n_generated for r in running])   # this step included
    room = sched.memory.decode_room(running)
    return min(m, 1 + room) if room is not None else m


def arrival_may_join(sched: Scheduler) -> bool:
    """Could a request arriving now be admitted before the next finish? If not, arrivals during a
    pure-decode run change nothing, and the run may go past them."""
    cfg = sched.cfg
    return not cfg.static and len(sched.running) < cfg.max_bs and (cfg.order != "fcfs" or not sched.waiting)


def decode_run(sched: Scheduler, executor: Executor, batch: Batch, t: float,
               next_arrival: float | None) -> list[float] | np.ndarray | None:
    """Commit `batch` as `m >= 2` identical decode steps starting at `t` and return their end
    times; None when it can stand only for itself (the engine then runs it as any other step)."""
    join = next_arrival is not None and arrival_may_join(sched)
    if join:  # steps only get longer as contexts grow: no need to price far past the arrival
        d0 = executor.step_time(batch.totals)
        check_durations(d0)
        if next_arrival <= t + d0:          # the arrival joins the very next step
            return None
    m = run_length(sched, batch)
    if join and d0 > 0:
        m = min(m, int((next_arrival - t) / d0) + 2)
    if m < 2:
        return None
    k = batch.totals.n_seqs
    ends = step_ends(executor.decode_durations(k, batch.totals.kv_read_tokens - k, m), m, t,
                     next_arrival if join else None)
    m = len(ends)
    if m > 1:
        sched.memory.grow_all(sched.running, m - 1)
        batch.n_steps = m
        sched.n_batches += m - 1
    return ends


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
            if not 0.0 <= d < math.inf:     # (NaN fails too)
                check_durations(d)
            t += d
            ends.append(t)
            if stop_at is not None and t >= stop_at:
                break
        return ends
    ds = np.array(ds, dtype=float)
    if not ds.min() >= 0:
        check_durations(ds)
    ds[0] += t
    ends = ds.cumsum()
    if not math.isfinite(ends[-1]):         # an infinite duration anywhere
        check_durations(ds)
    if stop_at is not None:
        ends = ends[:int(np.searchsorted(ends, stop_at, side="left")) + 1]
    return ends
