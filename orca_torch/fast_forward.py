"""Fast-forward: price the identical decode steps after a step with one call (a speed layer; lecture §4.1).

When every running request is in a step, none is preempted and every prompt in it is done by
that step (`Scheduler.decodes_follow`: a pure decode step, or one that admits and prefills whole
prompts while the queue cannot be admitted before a finish), the steps after it are the same
requests decoding one token apiece, contexts one token longer each step, until a request
finishes, the memory runs out, or an arrival could join. Instead of that many trips through the
scheduler, after the step ran take `extra = min(steps to the next finish, memory.decode_room
(running), steps to the next arrival that could join)`, price the `extra` decodes with
`executor.decode_durations`, grow the memory by `extra` more tokens per request and let
`Scheduler.complete` advance every request by `1 + extra` in one pass. The timestamps are those
of the step-by-step loop exactly: the same float additions, in order (`t + d0 + d1 + ...`: a
Python loop for a short run, `cumsum` for a long one). Only executors that can price a step
without running it (`can_fast_forward`: the cost models) enter here; the torch executor never does.
"""
from __future__ import annotations

import math

import numpy as np

from .batch import Batch, decode_step_totals
from .executor import Executor, check_durations
from .scheduler import Scheduler


def extra_steps(sched: Scheduler) -> int:
    """How many decode steps may follow the batch just scheduled (before its `complete`): every
    request of it makes a token in it, so the next finish is `remaining - 1` steps after it."""
    running = sched.running
    m = min([r.output_len - r.n_generated for r in running]) - 1
    room = sched.memory.decode_room(running)
    return min(m, room) if room is not None else m


def arrival_may_join(sched: Scheduler) -> bool:
    """Could a request arriving now be admitted before the next finish? If not, arrivals during
    the decodes change nothing, and the run may go past them."""
    cfg = sched.cfg
    return not cfg.static and len(sched.running) < cfg.max_bs and (cfg.order != "fcfs" or not sched.waiting)


def decodes_after(sched: Scheduler, executor: Executor, batch: Batch, end: float, d: float,
                  next_arrival: float | None) -> tuple[list[float] | np.ndarray, list[int] | None] | None:
    """`batch` ran for `d` and ends at `end`: commit the decode steps that follow it unchanged and
    return their end times and, where the memory does not grow evenly, its `slots_reserved` after
    each (None when no step can follow: a request finishes now, or an arrival joins next step)."""
    join = next_arrival is not None and arrival_may_join(sched)
    if join and next_arrival <= end:
        return None
    m = extra_steps(sched)
    k, kv = batch.totals.n_seqs, batch.totals.kv_read_tokens
    if join and m > 1:  # decodes only get longer: a first decode's time bounds how many fit before it
        if batch.totals.n_tokens != k:
            d = executor.step_time(decode_step_totals(k, kv))   # (the batch itself prefilled)
        if d > 0:
            m = min(m, int((next_arrival - end) / d) + 2)
    if m < 1:
        return None
    ends = step_ends(executor.decode_durations(k, kv, m), m, end, next_arrival if join else None)
    m = len(ends)
    reserved = sched.memory.decode_reserved(sched.running, m)
    sched.memory.grow_all(sched.running, m)
    batch.n_steps = 1 + m
    sched.n_batches += m
    return ends, reserved


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
            t += d
            ends.append(t)
            if stop_at is not None and t >= stop_at:
                break
        return ends
    if getattr(ds, "dtype", None) is None or ds.dtype.kind != "f":
        check_durations(ds)                 # (a bool or a string array is not durations)
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
