"""The paper GPU's executors: a step priced, not run (lecture §5.1).

A `PricedExecutor` prices a step from its `StepTotals` without running it (`step_time`), and a
run of `m` decode steps of the same requests at once (`decode_durations`, `decode_ends`): what
lets the fast engine (`fast_engine.py`) price many steps in one call.
- `CostModelExecutor(model, gpu)` prices a step on the paper GPU from the batch's `StepTotals`
  (`hw_model.pricer`: the roofline's `StepPricer`, or with `cost_model="refined"` the
  `RefinedPricer`; O(1) per step).
- `StepTimeExecutor(fn)` prices a step with any function of `StepTotals` (a Clipper-style
  `a + b * tokens` profile, a fixed 1 per iteration, a calibrated fit).

The engine's step is schedule -> `execute` -> record -> complete; only what `execute` returns
differs from the torch executor (`model/torch_executor.py`).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from orca_torch.checks import brief, check_callable, check_int, from_outside, is_finite_real
from orca_torch.core.batch import StepTotals
from orca_torch.core.executor import Executor, StepResult
from orca_torch.core.memory import MAX_SLOTS, MemoryManager
from orca_torch.sim.decode_runs import decode_step_totals, step_ends, steps_to_price


def defined_by(cls: type, name: str) -> type:
    """The class of `cls`'s method resolution order whose own body defines the method `name`."""
    return next(c for c in cls.__mro__ if name in vars(c))


class PricedExecutor(Executor):
    """An executor that prices a step without running it, and a run of decode steps in bulk."""

    reads_works = False
    """False: `execute` prices a step from `batch.totals` (and its swaps) alone, never reading
    `batch.works`, so the fast engine need not build the works of the steps it takes."""

    decodes_by_step_time = False
    """Said by the class that defines `execute`, in its own body: its `execute` prices a step of
    decodes alone as `step_time(batch.totals)`, as the fast engine prices its runs of decode steps
    (`decode_durations`, `decode_ends`) without calling `execute`. The fast engine takes its
    shortcuts only where that holds (`prices_decodes_by_step_time`): a subclass that overrides
    `execute` without saying it again, or `step_time` without `decode_durations` (or the other way
    round), runs one step a call. A cost added to every step goes in `step_time` and
    `decode_durations` of one class."""

    _outside_decode_durations = False
    """Whether the class's `decode_durations` is defined outside the project, so that `decode_ends`
    checks it against `step_time` (`check_agrees`; the project's own are tested): decided once per
    class, where it is defined (`__init_subclass__`)."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._outside_decode_durations = from_outside(defined_by(cls, "decode_durations"))

    def step_time(self, totals: StepTotals) -> float:
        """Duration of a step with these totals (every priced executor defines it)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement step_time")

    def decode_durations(self, n_seqs: int, ctx_sum: int, m: int) -> np.ndarray | list:
        """Durations of `m` consecutive decode steps of `n_seqs` sequences whose stored contexts sum
        to `ctx_sum` before the first (each step adds `n_seqs`); a float array, unless one of them
        is no number (`as_durations`)."""
        return as_durations([self.step_time(decode_step_totals(n_seqs, ctx_sum, j)) for j in range(m)])

    def decode_ends(self, n_seqs: int, ctx_sum: int, m: int, t: float, stop_at: float | None = None
                    ) -> list[float] | np.ndarray:
        """When each of those `m` decode steps ends if the first starts at `t`, up to and including
        the first end at or after `stop_at`; how many to price is guessed from the first step's
        time (`decode_runs.steps_to_price`)."""
        if stop_at is not None and m > 1:       # (the first step priced only where the run may be cut)
            m = steps_to_price(m, self.step_time(decode_step_totals(n_seqs, ctx_sum)), t, stop_at)
        ds = self.decode_durations(n_seqs, ctx_sum, m)
        if self._outside_decode_durations:
            check_agrees(self, ds, n_seqs, ctx_sum, f"{type(self).__name__}.decode_durations")
        return step_ends(ds, m, t, stop_at)


class StepTimeExecutor(PricedExecutor):
    """Prices a step with `step_time(StepTotals) -> seconds`; optionally `many(n_seqs, ctx_sum, m)` vectorized.

    The fast engine prices a run of decode steps ahead, up to a step or two past the one an arrival
    cuts it at (`decode_ends`), and keeps only those up to the cut: the functions must answer for
    any totals of the run's requests decoding on, without side effects (their results are the
    stepped engine's either way)."""

    decodes_by_step_time = True

    def __init__(self, step_time: Callable[[StepTotals], float],
                 many: Callable[[int, int, int], np.ndarray] | None = None,
                 max_context: int | None = None) -> None:
        self._step_time = check_callable("step_time", step_time, "(StepTotals) -> seconds")
        self._decode_durations = check_callable("many", many, "(k, ctx_sum, m) -> m seconds", allow_none=True)
        self.max_context = None if max_context is None else check_int("max_context", max_context, 2, MAX_SLOTS)

    def step_time(self, totals: StepTotals) -> float:
        """The function's answer as it gave it: the engines check every duration (`decode_runs.step_ends`
        those of a run)."""
        return self._step_time(totals)

    def execute(self, batch) -> StepResult:
        return StepResult(self.step_time(batch.totals))

    def decode_durations(self, n_seqs: int, ctx_sum: int, m: int) -> np.ndarray | list:
        """`many`'s answer, checked against `step_time` (`check_agrees`)."""
        if self._decode_durations is None:
            return super().decode_durations(n_seqs, ctx_sum, m)
        ds = as_durations(self._decode_durations(n_seqs, ctx_sum, m))
        check_agrees(self, ds, n_seqs, ctx_sum, "StepTimeExecutor's many")
        return ds


def check_agrees(ex: PricedExecutor, ds, n_seqs: int, ctx_sum: int, what: str) -> None:
    """RuntimeError unless the first and last of the durations `what` gave for a run of `len(ds)`
    decode steps are `ex.step_time`'s for those steps (where both are durations: `decode_runs.step_ends`
    refuses any that is not): the fast engine prices the run so, `Engine` each step with `step_time`,
    and the two runs must be one."""
    m = len(ds) if getattr(ds, "ndim", 1) == 1 and hasattr(ds, "__len__") else 0
    for j in sorted({0, m - 1}) if m else ():
        d, want = ds[j], ex.step_time(decode_step_totals(n_seqs, ctx_sum, j))
        if (is_finite_real(d) and is_finite_real(want) and d >= 0 and want >= 0
                and not math.isclose(float(d), float(want), rel_tol=1e-9, abs_tol=1e-300)):
            raise RuntimeError(f"{what}({n_seqs}, {ctx_sum}, {m}) timed decode step {j} at {brief(float(d))} s, "
                               f"where step_time times that step ({decode_step_totals(n_seqs, ctx_sum, j)}) at "
                               f"{brief(float(want))} s: the fast engine prices runs of decodes so, Engine each step "
                               "with step_time, and the two must agree (step j of a run stores ctx_sum + n_seqs * "
                               "(j + 1) tokens' K/V, as kv_read_tokens counts them)")


def as_durations(values) -> np.ndarray | list:
    """Durations as a step-time function gave them, as a float array where that changes none of
    them (floats, and finite ints); otherwise the list itself, which `decode_runs.step_ends` checks
    in order, so the first that is no duration is refused, named as it was given, as `Engine`
    refuses a step's. (Made an array as they are, `True` would be read as 1.0, and a list holding a
    string would turn its numbers into strings too.) Anything but a list or a tuple is `np.asarray`."""
    if not isinstance(values, (list, tuple)):
        return np.asarray(values)
    if all(type(d) is float or is_finite_real(d) for d in values):
        return np.array(values, dtype=float)
    return list(values)


def prices_decodes_by_step_time(ex: PricedExecutor) -> bool:
    """Whether `ex` prices a step of decodes the same way in `execute` and in bulk: the class that
    defines its `execute` says so, and its `decode_durations` and `decode_ends` are the defaults
    (which price by `step_time`, `CostModelExecutor.decode_ends` by its own when unchanged) or come
    with its `step_time`."""
    cls = type(ex)
    timed = defined_by(cls, "step_time")
    return (vars(defined_by(cls, "execute")).get("decodes_by_step_time", False)
            and defined_by(cls, "decode_durations") in (PricedExecutor, timed)
            and defined_by(cls, "decode_ends") in (PricedExecutor, CostModelExecutor, timed))


class CostModelExecutor(PricedExecutor):
    """The paper GPU: `hw_model.pricer` for `model` on `gpu` (the roofline's `StepPricer`, or the
    `RefinedPricer` with `cost_model="refined"`; tp, pp and efficiencies as there)."""

    decodes_by_step_time = True

    def __init__(self, model="llama-3-8b", gpu="h100", **settings) -> None:
        from orca_torch.sim.hw_model.cost import pricer_for
        from orca_torch.specs import get_model_spec

        self.model = get_model_spec(model)
        self.max_context = self.model.max_context
        self.pricer = pricer_for(model, gpu, settings)
        self.gpu = gpu
        self.tp, self.pp = self.pricer.tp, self.pricer.pp  # checked plain ints
        self.n_stages = self.pp
        self._roofline_runs = (hasattr(self.pricer, "decode_run_ends")    # (not a subclass's own pricing)
                               and type(self).step_time is CostModelExecutor.step_time
                               and type(self).decode_durations is CostModelExecutor.decode_durations)
        self.reset()

    def execute(self, batch) -> StepResult:
        totals = batch.totals
        swap = self.swap_time(batch) if batch.swapped_out or batch.swapped_in else 0.0
        if self.pp > 1:
            return StepResult(self.step_time(totals) + swap, None, self.pricer.stage_time(totals) + swap)
        return StepResult(self.step_time(totals) + swap)

    def check_memory(self, memory: MemoryManager) -> None:
        """A memory manager that swaps needs the card's host link, which prices each swap."""
        from orca_torch.sim.hw_model.host_link import check_host_link

        if memory.swaps:
            check_host_link(self.pricer.gpu, f"{type(memory).__name__}(preemption='swap')", "preemption='recompute'")

    def swap_time(self, batch) -> float:
        """The batch's K/V swaps over the host link, before its step runs (one copy per request each
        way, `hw_model.host_link`); added to `swap_s` and `swap_bytes`, the run's totals."""
        from orca_torch.sim.hw_model.host_link import swap_bytes, swap_time

        seconds = 0.0
        for moves in (batch.swapped_out, batch.swapped_in):
            if moves:
                tokens = sum(n for _, n in moves)
                seconds += swap_time(self.model, self.pricer.gpu, tokens, len(moves), self.tp, self.pp)
                self.swap_bytes += swap_bytes(self.model, tokens, self.tp, self.pp)
        self.swap_s += seconds
        return seconds

    def reset(self) -> None:
        self.swap_s = 0.0
        self.swap_bytes = 0

    def step_time(self, totals: StepTotals) -> float:
        return self.pricer.time(totals)

    def decode_durations(self, n_seqs: int, ctx_sum: int, m: int) -> np.ndarray:
        """`m` decode-step times at once: the pricer's `decode_run_times`, each entry equal to `step_time`."""
        return self.pricer.decode_run_times(n_seqs, ctx_sum, m)

    def decode_ends(self, n_seqs: int, ctx_sum: int, m: int, t: float, stop_at: float | None = None
                    ) -> list[float] | np.ndarray:
        """On the roofline, `StepPricer.decode_run_ends` prices and sums the run itself (a Python loop
        for a short run, numpy for a long one); the refined pricer, which has none, and a subclass
        that prices steps its own way go through `PricedExecutor.decode_ends`."""
        if self._roofline_runs:
            return self.pricer.decode_run_ends(n_seqs, ctx_sum, m, t, stop_at)
        return super().decode_ends(n_seqs, ctx_sum, m, t, stop_at)
