"""The baselines Orca is measured against, on the same engine (lecture §3, §5.2).

- Request-level (static) batching, as Triton + FasterTransformer serve a generative model: when the
  engine is idle, up to B waiting requests start together and the batch runs until its LAST request
  finishes; a request that arrives meanwhile waits for the whole batch (§3.1). Seats of requests
  that finished early stay in the batch. With `idle_seats_cost=True` (default) they still cost
  compute and K/V reads on the paper GPU — FasterTransformer keeps decoding the batch's fixed shape
  until every sequence is done — and their memory is released only when the batch ends. Tokens are
  still timed when they are produced (streaming), which is kind to static batching: a server that
  returns whole answers would make its TTFT far worse. The batch's prompts are priced as one ragged
  prefill (selective batching), also a little kinder than FasterTransformer's padding.
- One at a time: Orca's engine with `max_bs = 1` — each request runs alone, prefill then decodes.
- FasterTransformer as Orca measured it (OSDI 2022 §6, lecture §4.5): `fastertransformer_setup`.
  The same engine and scheduler, configured as Triton + FasterTransformer: request-level batching
  that takes up to `max_bs` waiting requests whenever the engine is free; K/V pre-allocated for the
  maximum length (2048) of every seat, so a `max_bs` whose reservation exceeds the card is out of
  memory (`OutOfMemory`, from the same arithmetic as `hw_model.max_requests`); prompts padded to
  the batch's longest; with pipeline parallelism, FasterTransformer's own microbatch rule (or a
  fixed `mbs`) through the stages, bubbles included, and a per-iteration control-message sync
  (`hw_model.microbatch`). `orca_setup` is Orca on the same
  parts: iteration-level scheduling, `n_workers = pp`, the request's `max_tokens` reserved.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orca_torch.checks import check_flag, check_int
from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.core.engine import Engine
from orca_torch.core.executor import Executor, StepResult
from orca_torch.core.memory import MemoryManager, ReservationMemory
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.sim.executors import CostModelExecutor, PricedExecutor
from orca_torch.sim.fast_engine import FastEngine

FT_MAX_LENGTH = 2048
"""Tokens FasterTransformer pre-allocates per seat in Orca's evaluation: the models' maximum length."""


def static_batching(max_bs: int = 128, idle_seats_cost: bool = True) -> SchedulerConfig:
    """Request-level batching with batches of up to `max_bs` requests."""
    return SchedulerConfig(max_bs=max_bs, static=True, static_idle_seats_cost=idle_seats_cost)


def one_at_a_time() -> SchedulerConfig:
    """Iteration-level scheduling with a single seat."""
    return SchedulerConfig(max_bs=1)


# ---- FasterTransformer and Orca on the same engine (Orca's evaluation) -----------------------------

class OutOfMemory(ValueError):
    """A configuration whose K/V pre-allocation does not fit the devices (the run is not attempted)."""


@dataclass(frozen=True)
class MemoryFit:
    """`max_bs` seats of `reserve_tokens` each against the K/V slots the devices hold."""

    max_bs: int
    reserve_tokens: int
    slots_available: int

    @property
    def slots_needed(self) -> int:
        return self.max_bs * self.reserve_tokens

    @property
    def fits(self) -> bool:
        return self.slots_needed <= self.slots_available

    def explain(self) -> str:
        return (f"max_bs {self.max_bs} x {self.reserve_tokens} tokens = {self.slots_needed:,} K/V slots "
                f"{'<=' if self.fits else '>'} {self.slots_available:,} available "
                f"(at most {self.slots_available // self.reserve_tokens} seats)")


def memory_fit(model, gpu, max_bs: int, *, tp: int = 1, pp: int = 1) -> MemoryFit:
    """Does FasterTransformer's pre-allocation of `FT_MAX_LENGTH` tokens for each of `max_bs` seats fit?
    (`hw_model.kv_capacity_tokens`). `max_bs` is checked where it comes in: `fastertransformer_setup`'s
    by `static_batching`; `orca_evaluation` gives its own tables' sizes."""
    from orca_torch.sim.hw_model import kv_capacity_tokens

    return MemoryFit(max_bs, FT_MAX_LENGTH, kv_capacity_tokens(model, gpu, tp=tp, pp=pp))


class FasterTransformerExecutor(CostModelExecutor):
    """The paper GPU priced as FasterTransformer runs a batch.

    - prompts padded to the batch's longest (a request-level batch is one `[B, L_max]` tensor),
      and every decode iteration of that batch attends over the padding too;
    - with `pp > 1`, each iteration cut into microbatches of at most `mbs` requests (None:
      FasterTransformer's own rule, `hw_model.microbatch.ft_microbatch_size`) that go through the
      stages one after the other, the iteration ending when the last leaves the last stage
      (`hw_model.microbatch.iteration_s`, bubbles included);
    - `control_sync_s` added to every iteration (0 on a single GPU; `hw_model.microbatch`).
    Decode iterations are priced from the step's totals, so the fast engine may take them in bulk.
    """

    reads_works = True                          # (the prompts, to pad them)
    decodes_by_step_time = True                 # (a step of decodes alone is priced by `step_time`)

    def __init__(self, model, gpu, *, tp: int = 1, pp: int = 1, mbs: int | None = None,
                 control_sync: bool = True, **settings) -> None:
        from orca_torch.sim.hw_model.microbatch import control_sync_s

        super().__init__(model, gpu, tp=tp, pp=pp, **settings)
        self.mbs = None if mbs is None else check_int("mbs (microbatch size; None: FasterTransformer's own rule)",
                                                      mbs, 1)
        sync_s = control_sync_s(self.pricer)     # (refuses a refined pricer: microbatches are cut on the roofline)
        self.sync_s = sync_s if check_flag("control_sync", control_sync) else 0.0
        self._pad = 0     # padding tokens of the batch in flight (its prompts' gap to the longest)

    def microbatch(self, batch: int, seq_len: int) -> int:
        """Requests per microbatch for a batch of `batch` requests of `seq_len` new tokens each."""
        from orca_torch.sim.hw_model.microbatch import ft_microbatch_size

        return self.mbs if self.mbs is not None else ft_microbatch_size(batch, seq_len, self.pp)

    def _iteration(self, totals: StepTotals) -> float:
        from orca_torch.sim.hw_model.microbatch import pipelined_s

        n = totals.n_seqs
        seq_len = -(-totals.n_tokens // n) if n else 1
        return pipelined_s(self.pricer, totals, self.microbatch(max(n, 1), seq_len)) + self.sync_s

    def execute(self, batch) -> StepResult:
        t = batch.totals
        prompts = [(w.n_new, w.n_past) for w in batch.works if w.n_past == 0]
        if prompts:   # a new batch: its prompts become one [B, L_max] tensor
            longest = max(n for n, _ in prompts)
            self._pad = sum(longest - n for n, _ in prompts)
            t = StepTotals.of([SeqWork(longest, 0)] * len(prompts)) + _decodes_only(t, prompts)
            return StepResult(self._iteration(t))
        return StepResult(self.step_time(t))

    def step_time(self, totals: StepTotals) -> float:
        """A decode iteration attends over the padded prompts too (every sequence of the batch
        starts generating at the longest prompt's length)."""
        if self._pad and totals.n_tokens == totals.n_seqs:
            totals = StepTotals(totals.n_seqs, totals.n_tokens, totals.kv_read_tokens + self._pad,
                                totals.attn_pairs_full + self._pad, totals.attn_pairs_causal + self._pad)
        return self._iteration(totals)

    def decode_durations(self, k: int, ctx_sum: int, m: int) -> np.ndarray:
        from orca_torch.sim.hw_model.microbatch import decode_iterations_s

        return decode_iterations_s(self.pricer, k, ctx_sum + self._pad, m, self.microbatch(max(k, 1), 1)) + self.sync_s

    def reset(self) -> None:
        self._pad = 0


def _decodes_only(totals: StepTotals, prompts: list[tuple[int, int]]) -> StepTotals:
    """`totals` less the prompt works `(n_new, n_past)` given (what is left: the decodes)."""
    p = StepTotals.of([SeqWork(n, past) for n, past in prompts])
    return StepTotals(*(a - b for a, b in zip(
        (totals.n_seqs, totals.n_tokens, totals.kv_read_tokens, totals.attn_pairs_full, totals.attn_pairs_causal),
        (p.n_seqs, p.n_tokens, p.kv_read_tokens, p.attn_pairs_full, p.attn_pairs_causal))))


@dataclass
class ServingSetup:
    """One system: the scheduler's knobs, its memory manager and its executor (one engine for all)."""

    name: str
    config: SchedulerConfig
    memory: MemoryManager
    executor: Executor
    max_context: int

    def engine(self, **options) -> Engine:
        """The engine for this system: `FastEngine` (runs of decodes in bulk) on a priced executor."""
        kind = FastEngine if isinstance(self.executor, PricedExecutor) else Engine
        return kind(self.executor, self.memory, self.config, max_context=self.max_context, **options)


def fastertransformer_setup(model, gpu, max_bs: int, *, tp: int = 1, pp: int = 1, mbs: int | None = None,
                            **executor_options) -> ServingSetup:
    """Triton + FasterTransformer as Orca ran it; raises `OutOfMemory` when `max_bs` seats of
    `FT_MAX_LENGTH` tokens do not fit the devices' K/V memory."""
    config = static_batching(max_bs)               # checks max_bs before its seats are counted
    fit = memory_fit(model, gpu, config.max_bs, tp=tp, pp=pp)
    if not fit.fits:
        raise OutOfMemory(f"FasterTransformer pre-allocates K/V for every seat: {fit.explain()}")
    if mbs is not None and pp == 1:
        raise ValueError("mbs (microbatches) applies only with pipeline parallelism (pp > 1)")
    name = f"FT(max_bs={max_bs}" + (f", mbs={mbs})" if mbs is not None else ")")
    ex = FasterTransformerExecutor(model, gpu, tp=tp, pp=pp, mbs=mbs, **executor_options)
    return ServingSetup(name, config, ReservationMemory(fit.slots_available, "max"),
                        ex, FT_MAX_LENGTH)


def orca_setup(model, gpu, max_bs: int, *, tp: int = 1, pp: int = 1) -> ServingSetup:
    """Orca: iteration-level scheduling with selective batching, `n_workers = pp` batches in flight,
    and each request's `max_tokens` reserved when it is first scheduled (Algorithm 1)."""
    from orca_torch.sim.hw_model import kv_capacity_tokens

    ex = CostModelExecutor(model, gpu, tp=tp, pp=pp)
    slots = kv_capacity_tokens(model, gpu, tp=tp, pp=pp)
    return ServingSetup(f"Orca(max_bs={max_bs})", SchedulerConfig(max_bs=max_bs, n_workers=pp),
                        ReservationMemory(slots, "max"), ex, ex.max_context)
