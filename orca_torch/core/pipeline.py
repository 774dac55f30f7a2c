"""Orca's pipelining: up to `n_workers` batches in flight, leaving in order (lecture §4.4, exercise 6).

With `n_workers = P` the engine does not wait for a batch to return before scheduling the next:
it injects a new batch as soon as the first of the executor's stages is free, as long as fewer
than P batches are in flight; a request whose batch is in flight (`IN_FLIGHT`) is not picked
again until it returns. Batches leave in the order they entered, and their tokens exist when
they leave.

Two kinds of executor are driven here:
- synchronous (`execute`, a cost model or the torch model run in one process): the pipeline is
  simulated as the executor's S stages in a row (`n_stages`: the paper GPU's `pp`, 1 for a model
  in one process; a step-time function's S is P), each taking the batches in the order they
  came. A batch of duration `d` spends `d / S` in each stage and keeps it busy for `d / S` (or
  the executor's `stage_s`, the slowest stage, where that is longer). It enters stage `k` when it
  has left stage `k - 1` and stage `k` is done with the batch before it, so with nothing ahead it
  leaves at `t + d`, and behind a longer batch it waits at every stage that one still holds. The
  next batch may enter as soon as the first stage is free: with one stage, only once the batch
  before it is done, so `n_workers > 1` changes nothing there.
- asynchronous (`is_async`: `submit`, `wait`, `now`, e.g. workers in other processes): the engine
  keeps at most P batches submitted; when it cannot submit another it `wait`s for the oldest. Times
  are the executor's clock (`StepResult.start_s`/`end_s`, else `now()` at submit and return),
  which runs with the wall clock: with nothing in flight the engine sleeps until the next arrival,
  and arrivals while batches are in flight join at the next scheduling decision.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import NamedTuple

from orca_torch.checks import brief, is_finite_real
from orca_torch.core.batch import Batch
from orca_torch.core.executor import StepResult


class InFlight(NamedTuple):
    """A batch in the pipeline. Synchronous: its `end` and `result`, known when it enters.
    Asynchronous: the K/V occupancy when it was `submitted` (recorded when it leaves)."""

    batch: Batch
    end: float | None = None
    result: StepResult | None = None
    reserved: int | None = None
    used: int | None = None
    submitted: float | None = None


class Pipeline:
    """The in-flight queue of one run; `Engine.step` calls `step` when `n_workers > 1` or the
    executor is asynchronous."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.n_workers = engine.config.n_workers
        self.n_stages = engine.executor.n_stages or self.n_workers     # (checked by the engine)
        self.inflight: deque[InFlight] = deque()   # oldest first
        self.stage_free = [0.0] * self.n_stages   # synchronous: when each stage is done with its last batch,
        self.stage_start: list[float] = []         # and when each batch entered each stage, n_stages a batch
        self.last_end = 0.0                         # when the last batch left

    def step(self) -> Batch | None:
        """Inject the next batch (returned), or retire the oldest one (returned after `complete`);
        None when the run is over. In order: the oldest batch leaves if it has ended by now
        (asynchronous: the clock catches up with the executor's); arrivals join the queue; a batch
        is scheduled and enters if fewer than `n_workers` are in flight and the first stage is free;
        else an asynchronous executor's oldest batch is waited for; else the clock moves to the next
        moment something can change (a batch leaves, a request arrives, the first stage frees)."""
        eng = self.engine
        ex, sched = eng.executor, eng.scheduler
        while not eng.done:
            if not ex.is_async:
                if self.inflight and self.inflight[0].end <= eng.t:
                    return self._retire()
            else:
                eng.t = max(eng.t, ex.now())    # arrivals while batches were in flight join now
            eng.admit_arrivals()
            batch = None
            n_scheduled = len(self.inflight)    # Algorithm 1 (lines 9-10): inject while n_scheduled < n_workers
            if n_scheduled < self.n_workers and (ex.is_async or eng.t >= self.stage_free[0]):
                batch = sched.schedule()
            if batch is not None:
                eng.release_preempted(batch)
                if batch.totals.n_seqs == 0:
                    continue
                return self._inject(batch)
            if ex.is_async and self.inflight:
                return self._retire()
            wake_at = [self.inflight[0].end] if self.inflight else []     # when something can change
            if eng.next_arrival is not None:
                wake_at.append(eng.next_arrival)
            if not ex.is_async and self.stage_free[0] > eng.t:
                wake_at.append(self.stage_free[0])
            if not wake_at:
                raise RuntimeError(eng.stall_report())
            eng.t = float(min(wake_at))
            if ex.is_async:
                idle = eng.t - ex.now()
                if not self.inflight and idle > 0:
                    time.sleep(idle)                # its clock is the wall's: wait for the arrival
                eng.t = max(eng.t, ex.now())
        return None

    def _inject(self, batch: Batch) -> Batch:
        eng, ex = self.engine, self.engine.executor
        mem = eng.memory
        if ex.is_async:
            ex.submit(batch)
            self.inflight.append(InFlight(batch, reserved=mem.slots_reserved, used=mem.slots_used,
                                          submitted=ex.now()))
            return batch
        res = ex.execute(batch)
        d = eng.checked_duration(res, batch)
        s = res.stage_s
        if s is not None and (type(s) is not float or not 0.0 <= s < math.inf) and not (is_finite_real(s) and s >= 0):
            raise RuntimeError(f"the executor returned a stage time of {brief(s)} s; it must be a finite "
                               "number >= 0")
        hop = d / self.n_stages                 # its time in each stage
        busy = hop if res.stage_s is None else max(hop, res.stage_s)    # how long it keeps a stage
        t, waited, entered = eng.t, 0.0, []
        for k in range(self.n_stages):          # stage k takes it once stage k - 1 is done with it
            at = t + k * hop + waited
            if self.stage_free[k] > at:         # and stage k is done with the batch before it
                waited, at = waited + (self.stage_free[k] - at), self.stage_free[k]
            entered.append(at)
            self.stage_free[k] = at + busy
        end = max(t + d + waited, self.last_end)    # (in order, whatever the rounding of equal times)
        self.last_end = end
        self.stage_start.extend(entered)
        eng.record(batch, t, end, mem.slots_reserved, mem.slots_used)
        self.inflight.append(InFlight(batch, end, res))
        return batch

    def _retire(self) -> Batch:
        eng, ex = self.engine, self.engine.executor
        oldest = self.inflight.popleft()
        batch, res = oldest.batch, oldest.result
        if ex.is_async:
            batch, res = ex.wait()
            if batch is not oldest.batch:
                raise RuntimeError(f"the executor returned batch {batch.index} before batch {oldest.batch.index}: "
                                   "batches must leave in the order they were submitted")
            eng.checked_duration(res, batch)
            start = res.start_s if res.start_s is not None else oldest.submitted
            end = res.end_s if res.end_s is not None else ex.now()
            end = max(end, self.last_end, start)
            self.last_end = end
            eng.t = max(eng.t, end)
            eng.record(batch, start, end, oldest.reserved, oldest.used)
        eng.complete(batch, res.tokens, res.logprobs)
        return batch
