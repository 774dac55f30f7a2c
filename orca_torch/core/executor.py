"""Executors: what one scheduled iteration costs, and (on torch) what it computes (lecture §5.1).

One interface, two halves of the project:
- `CostModelExecutor(model, gpu)` prices a step on the paper GPU from the batch's `StepTotals`
  (`hw_model.StepPricer`, O(1) per step) and, for a run of identical decode steps, prices all of
  them at once (`decode_durations`, i.e. `StepPricer.decode_run_times`), which is what lets the
  engine fast-forward.
- `TorchExecutor(model, kv)` runs the step on the real `OrcaModel.forward_batch` through the K/V
  manager, returns the greedy tokens, and times it: `time.perf_counter` on CPU, `torch.cuda.Event`
  with synchronisation on CUDA, or `clock="iterations"` (every step lasts 1: the lecture's timeline).
- `StepTimeExecutor(fn)` prices a step with any function of `StepTotals` (a Clipper-style
  `a + b * tokens` profile, a fixed 1 per iteration, a calibrated fit).

The engine's step is schedule -> `execute` -> record; only what `execute` returns differs.

An executor may instead be asynchronous (`is_async = True`, e.g. pipelined workers in other
processes): `submit(batch)` returns at once, `wait()` blocks until the OLDEST submitted batch has
left the last stage and returns it with its `StepResult` (batches leave in submission order), and
`now()` is its run clock in seconds since `reset()`. `pipeline.py` drives both kinds. A synchronous
executor under `n_workers > 1` is pipelined in simulation: a batch of duration `d` holds each of
the P stages for `d / P` (or `StepResult.stage_s`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from orca_torch.core.batch import StepTotals, decode_step_totals
from orca_torch.core.durations import check_durations, step_ends
from orca_torch.core.request import Request


@dataclass(slots=True)
class StepResult:
    """What a step took (`duration_s`, in the run's clock), its greedy tokens in `batch.works`
    order (torch only), the interval after which the next batch may enter the pipeline (None:
    `duration / n_workers`), and for asynchronous executors the start and end on `now()`'s clock."""

    duration_s: float
    tokens: list[int] | None = None
    stage_s: float | None = None
    start_s: float | None = None
    end_s: float | None = None


class Executor:
    """The interface the engine uses."""

    can_fast_forward = False
    reads_works = True
    """False: `execute` prices a step from `batch.totals` (and its swaps) alone, never reading
    `batch.works`, so the fast-forward need not build the works of the steps it takes."""
    is_async = False
    max_context: int | None = None

    def execute(self, batch) -> StepResult:
        raise NotImplementedError

    def submit(self, batch) -> None:
        """Asynchronous executors: start `batch` and return at once."""
        raise NotImplementedError

    def wait(self) -> tuple:
        """Asynchronous executors: block until the oldest submitted batch is done; `(batch, StepResult)`."""
        raise NotImplementedError

    def now(self) -> float:
        """Asynchronous executors: seconds on the run clock since `reset()`."""
        raise NotImplementedError

    def step_time(self, totals: StepTotals) -> float:
        """Duration of a step with these totals, without running it (cost models only)."""
        raise NotImplementedError

    def decode_durations(self, k: int, ctx_sum: int, m: int) -> np.ndarray:
        """Durations of `m` consecutive decode steps of `k` sequences whose stored contexts sum to
        `ctx_sum` before the first (each step adds `k`)."""
        raise NotImplementedError

    def decode_ends(self, k: int, ctx_sum: int, m: int, t: float, stop_at: float | None = None
                    ) -> list[float] | np.ndarray:
        """When each of those `m` decode steps ends if the first starts at `t`, up to and including
        the first end at or after `stop_at` (the fast-forward's run, `fast_forward.py`). How many
        to price is guessed from the first step's time, as if steps only got longer; where they do
        not, the run just ends before `stop_at` and the engine goes on from there."""
        if stop_at is not None and m > 1:
            d = self.step_time(decode_step_totals(k, ctx_sum))
            if type(d) is not float or not 0.0 <= d < math.inf:
                check_durations(d)
            if d > 0:
                m = min(m, int((stop_at - t) / d) + 2)
        return step_ends(self.decode_durations(k, ctx_sum, m), m, t, stop_at)

    def check(self, req: Request) -> None:
        """Raise ValueError if this executor cannot run `req`."""

    def release(self, req: Request) -> None:
        """`req` finished or was preempted: drop any state held for it."""

    def reset(self) -> None:
        """A run starts."""
