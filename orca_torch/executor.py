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
import time
from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np

from .batch import SeqWork, StepTotals, decode_step_totals
from .checks import check_callable, check_choice, check_instance, check_int, is_int
from .durations import check_durations, step_ends
from .memory import MAX_SLOTS
from .request import Request


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


def check_prompt_ids(req: Request, vocab: int, who: str) -> None:
    """Raise ValueError unless `req.prompt_ids` are integer token ids in [0, vocab) (a list, a tuple
    or a numpy array of integers; a float id would be truncated silently by torch)."""
    ids = req.prompt_ids
    if ids is None:
        raise ValueError(f"request {req.req_id!r} has no prompt_ids; {who} needs tokens "
                         "(see workload.with_prompt_ids)")
    for t in ids:
        if not is_int(t):
            raise ValueError(f"request {req.req_id!r}: prompt ids must be integers (a list, tuple or numpy "
                             f"array of ints), got {t!r} ({type(t).__name__})")
        if not 0 <= t < vocab:
            raise ValueError(f"request {req.req_id!r}: prompt ids must lie in [0, {vocab}), got {int(t)}")


def new_token_ids(r: Request, n_new: int, n_past: int) -> list[int]:
    """The token ids a request feeds this step: a slice of its prompt (and, after a preemption,
    of its own output), or its last generated token for a decode."""
    n_prompt = r.prompt_len
    if n_new == 1 and n_past >= n_prompt:
        return [r.output_ids[n_past - n_prompt]]
    head = [int(t) for t in r.prompt_ids[n_past:min(n_past + n_new, n_prompt)]]
    tail = r.output_ids[max(n_past - n_prompt, 0):n_past + n_new - n_prompt] if n_past + n_new > n_prompt else []
    return head + tail


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


class StepTimeExecutor(Executor):
    """Prices a step with `step_time(StepTotals) -> seconds`; optionally `many(k, ctx0, m)` vectorized."""

    can_fast_forward = True
    reads_works = False

    def __init__(self, step_time: Callable[[StepTotals], float],
                 many: Callable[[int, int, int], np.ndarray] | None = None,
                 max_context: int | None = None) -> None:
        self._fn = check_callable("step_time", step_time, "(StepTotals) -> seconds")
        self._many = check_callable("many", many, "(k, ctx_sum, m) -> m seconds", allow_none=True)
        self.max_context = None if max_context is None else check_int("max_context", max_context, 2, MAX_SLOTS)

    def step_time(self, totals: StepTotals) -> float:
        d = self._fn(totals)
        if type(d) is not float:
            check_durations(d)              # a bool or a string is not a duration
        return float(d)

    def execute(self, batch) -> StepResult:
        return StepResult(self.step_time(batch.totals))

    def decode_durations(self, k: int, ctx_sum: int, m: int) -> np.ndarray:
        if self._many is not None:
            ds = self._many(k, ctx_sum, m)
            if not (isinstance(ds, np.ndarray) and ds.dtype.kind == "f"):
                check_durations(ds)
            return np.array(ds, dtype=float)
        return np.array([self.step_time(decode_step_totals(k, ctx_sum, j)) for j in range(m)], dtype=float)


def iteration_clock() -> StepTimeExecutor:
    """Every step lasts exactly 1: time is counted in iterations (lecture §4.1's charts)."""
    return StepTimeExecutor(lambda t: 1.0, lambda k, c, m: np.ones(m))


class CostModelExecutor(Executor):
    """The paper GPU: `hw_model.StepPricer` for `model` on `gpu` (tp, pp and efficiencies as there)."""

    can_fast_forward = True
    reads_works = False

    def __init__(self, model="llama-3-8b", gpu="h100", **settings) -> None:
        from .hw_model.cost import pricer_for
        from .specs import get_model_spec

        self.model = get_model_spec(model)
        self.max_context = self.model.max_context
        self.pricer = pricer_for(model, gpu, settings)
        self.gpu = gpu
        self.tp, self.pp = self.pricer.tp, self.pricer.pp  # checked plain ints
        own_pricing = (type(self).step_time, type(self).decode_durations) != _ROOFLINE_PRICING
        self._run_ends = None if own_pricing else getattr(self.pricer, "decode_run_ends", None)
        self.reset()

    def execute(self, batch) -> StepResult:
        t = batch.totals
        swap = self.swap_time(batch) if batch.swapped_out or batch.swapped_in else 0.0
        if self.pp > 1:
            return StepResult(self.pricer.time(t) + swap, None, self.pricer.stage_time(t) + swap)
        return StepResult(self.pricer.time(t) + swap)

    def swap_time(self, batch) -> float:
        """The batch's K/V swaps over the host link, before its step runs (one copy per request each
        way, `hw_model.host_link`); added to `swap_s` and `swap_bytes`, the run's totals."""
        from .hw_model.host_link import swap_bytes, swap_time

        s = 0.0
        for moves in (batch.swapped_out, batch.swapped_in):
            if moves:
                tokens = sum(n for _, n in moves)
                s += swap_time(self.model, self.gpu, tokens, len(moves), self.tp, self.pp)
                self.swap_bytes += swap_bytes(self.model, tokens, self.tp, self.pp)
        self.swap_s += s
        return s

    def reset(self) -> None:
        self.swap_s = 0.0
        self.swap_bytes = 0

    def step_time(self, totals: StepTotals) -> float:
        return self.pricer.time(totals)

    def decode_durations(self, k: int, ctx_sum: int, m: int) -> np.ndarray:
        """`m` decode-step times at once: `StepPricer.decode_run_times`, each entry equal to `step_time`."""
        return self.pricer.decode_run_times(k, ctx_sum, m)

    def decode_ends(self, k: int, ctx_sum: int, m: int, t: float, stop_at: float | None = None
                    ) -> list[float] | np.ndarray:
        """The roofline prices and sums the steps in one loop (`StepPricer.decode_run_ends`); a
        subclass that prices steps its own way (`step_time`, `decode_durations`) gets the generic
        `Executor.decode_ends`, which sums its `decode_durations`."""
        if self._run_ends is None:
            return super().decode_ends(k, ctx_sum, m, t, stop_at)
        return self._run_ends(k, ctx_sum, m, t, stop_at)


_ROOFLINE_PRICING = (CostModelExecutor.step_time, CostModelExecutor.decode_durations)

Clock = Literal["wall", "iterations"]


class TorchExecutor(Executor):
    """Runs each step on the real model (selective batching) and returns greedy tokens.

    Each request's K/V is reserved in `kv` for `prompt_len + output_len` tokens (what it will store,
    at most) the first time it is scheduled, and freed when it finishes or is preempted; the
    scheduler's memory manager decides admission, this manager only stores. With a
    `paged_kv.PagedKVManager` the request gets blocks as its tokens arrive instead, and the batch's
    swaps (`swapped_out`, `swapped_in`) really copy its blocks to the CPU pool and back.
    """

    can_fast_forward = False

    def __init__(self, model, kv, clock: Clock = "wall") -> None:
        import torch

        from .model import OrcaModel

        check_instance("model", model, OrcaModel)
        model.check_kv(kv)
        self.model, self.kv, self.clock = model, kv, check_choice("clock", clock, ("wall", "iterations"))
        self.max_context = model.spec.max_context
        self._torch = torch
        self._cuda = model.device.type == "cuda"
        self._held: set = set()
        from .paged_kv import PagedKVManager
        self._paged = isinstance(kv, PagedKVManager)

    def check(self, req: Request) -> None:
        check_prompt_ids(req, self.model.spec.vocab, "the torch executor")

    def execute(self, batch) -> StepResult:
        torch = self._torch
        works = batch.works
        ids: list[int] = []
        seq_works: list[SeqWork] = []
        req_ids = []
        swap_s = self._paged_room(batch) if self._paged else 0.0
        for r, n_new, n_past in works:
            if not self._paged and n_past == 0 and not self.kv.has(r.req_id):
                self.kv.reserve(r.req_id, r.total_len)
                self._held.add(r.req_id)
            ids += new_token_ids(r, n_new, n_past)
            seq_works.append(SeqWork(n_new, n_past))
            req_ids.append(r.req_id)
        token_ids = torch.tensor(ids, dtype=torch.long)
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = self.model.forward_batch(token_ids, seq_works, req_ids, self.kv)
            tokens = logits.argmax(dim=-1)
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
            tokens = tokens.tolist()
        else:
            t0 = time.perf_counter()
            logits = self.model.forward_batch(token_ids, seq_works, req_ids, self.kv)
            tokens = logits.argmax(dim=-1).tolist()
            elapsed = time.perf_counter() - t0
        return StepResult(1.0 if self.clock == "iterations" else elapsed + swap_s, tokens)

    def _paged_room(self, batch) -> float:
        """Paged K/V: copy the batch's swapped-out requests to the CPU pool and the swapped-in ones
        back (returns the seconds the copies took), then give every request the blocks its new
        tokens need."""
        kv = self.kv
        t0 = time.perf_counter()
        for r, _ in batch.swapped_out:
            kv.swap_out(r.req_id)
        for r, _ in batch.swapped_in:
            kv.swap_in(r.req_id)
        if self._cuda and (batch.swapped_out or batch.swapped_in):
            self._torch.cuda.synchronize()
        swap_s = time.perf_counter() - t0
        for r, n_new, n_past in batch.works:
            if r.req_id not in self._held:
                kv.add(r.req_id)
                self._held.add(r.req_id)
            kv.ensure(r.req_id, n_past + n_new)
        return swap_s

    def release(self, req: Request) -> None:
        if req.req_id in self._held:
            self._held.discard(req.req_id)
            self.kv.free(req.req_id)

    def reset(self) -> None:
        for rid in list(self._held):
            self.kv.free(rid)
        self._held.clear()
