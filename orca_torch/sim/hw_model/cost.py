"""The paper GPU's cost models by name (lecture §2.6): `pricer(model, gpu, cost_model=...)` builds, and
caches, the roofline's `StepPricer` ("roofline", `roofline.py`) or the refined model's `RefinedPricer`
("refined", `refined.py`); `step_cost`, `step_time`, `max_batch_within` and `decode_profile` price
through it.
"""
from __future__ import annotations

import functools
from typing import Iterable

from orca_torch.checks import brief, check_flag, check_int, check_items, check_real
from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.sim.decode_runs import decode_step_totals
from orca_torch.sim.hw_model.gpus import GPUSpec, get_gpu
from orca_torch.sim.hw_model.refined import RefinedPricer
from orca_torch.sim.hw_model.refined_params import ATTENTION_MODES
from orca_torch.sim.hw_model.layout import Partition
from orca_torch.sim.hw_model.roofline import (STEP_OVERHEAD_S, StepCost, StepPricer, check_totals,
                                              finite_time)
from orca_torch.specs import ModelSpec, get_model_spec

COST_MODELS = ("roofline", "refined")
"""The named cost models: the lecture's roofline (the default) and the refined one (`refined.RefinedPricer`)."""

_ROOFLINE_ONLY = {"flop_efficiency": None, "bw_efficiency": None, "count_activations": False}


@functools.lru_cache(maxsize=128)
def _cached_pricer(cost_model: str, model: ModelSpec | str, gpu: GPUSpec | str, tp: int, pp: int,
                   flop_efficiency: float | None, bw_efficiency: float | None, comm_efficiency: float | None,
                   overhead_s: float | None, attention: str | None, count_activations: bool,
                   seq_overhead_s: float | None, attention_tile: int | None):
    if cost_model == "refined":
        return RefinedPricer(model, gpu, tp=tp, pp=pp, comm_efficiency=comm_efficiency, overhead_s=overhead_s,
                             attention=attention, attention_tile=attention_tile, seq_overhead_s=seq_overhead_s)
    return StepPricer(model, gpu, tp=tp, pp=pp, flop_efficiency=flop_efficiency, bw_efficiency=bw_efficiency,
                      comm_efficiency=comm_efficiency, overhead_s=STEP_OVERHEAD_S if overhead_s is None else overhead_s,
                      attention="full" if attention is None else attention, count_activations=count_activations,
                      seq_overhead_s=0.0 if seq_overhead_s is None else seq_overhead_s)


def pricer(model: ModelSpec | str, gpu: GPUSpec | str, *, cost_model: str = "roofline", tp: int = 1, pp: int = 1,
           flop_efficiency: float | None = None, bw_efficiency: float | None = None,
           comm_efficiency: float | None = None, overhead_s: float | None = None,
           attention: str | None = None, count_activations: bool = False,
           seq_overhead_s: float | None = None, attention_tile: int | None = None):
    """A (cached) pricer for these settings: a roofline `StepPricer` or a `refined.RefinedPricer`.

    `gpu` is a `GPUSpec`, a card's name, or the path of a JSON GPU profile. Settings left `None`
    take the cost model's defaults: roofline `overhead_s` 0, `attention` "full", `seq_overhead_s`
    0; refined `overhead_s` / `seq_overhead_s` / `attention` / `attention_tile` from the card's
    `RefinedParams` ("causal-tiles" on every datasheet card). `flop_efficiency`, `bw_efficiency` and
    `count_activations` are roofline settings; `attention_tile` a refined one. Every setting is
    checked here, once: the pricers built from them trust them.
    """
    if not isinstance(cost_model, str) or cost_model not in COST_MODELS:
        raise ValueError(f"unknown cost_model {brief(cost_model)}; known: {', '.join(COST_MODELS)}")
    spec = get_model_spec(model)
    if not isinstance(gpu, GPUSpec):
        gpu = get_gpu(gpu)  # a profile path is loaded here, so an edited file is read afresh
    modes = ATTENTION_MODES if cost_model == "refined" else ("full", "causal")
    if attention is not None and not (isinstance(attention, str) and attention in modes):
        if isinstance(attention, str) and attention in ATTENTION_MODES:
            raise ValueError(f"attention {attention!r} needs the refined cost model; the roofline counts attention "
                             "as 'full' or 'causal'")
        raise ValueError(f"attention must be one of {', '.join(modes)}, or None for the {cost_model} model's "
                         f"default, got {brief(attention)} ({type(attention).__name__})")
    # Numbers are checked before the cache: True == 1 and np.int64(2) == 2 as keys, so the pricer
    # built for one must never answer for the other unchecked; what is cached holds plain numbers.
    part = Partition(spec, tp, pp)  # checks tp and pp
    tp, pp = part.tp, part.pp
    flop_efficiency, bw_efficiency, comm_efficiency, overhead_s, seq_overhead_s = (  # shares in (0, 1], seconds >= 0
        None if v is None else check_real(name, v, 0.0, hi, lo_open=hi is not None, unit=unit)
        for name, v, hi, unit in (
            ("flop_efficiency", flop_efficiency, 1.0, ""), ("bw_efficiency", bw_efficiency, 1.0, ""),
            ("comm_efficiency", comm_efficiency, 1.0, ""), ("overhead_s", overhead_s, None, "seconds"),
            ("seq_overhead_s", seq_overhead_s, None, "seconds")))
    if attention_tile is not None:
        attention_tile = check_int("attention_tile", attention_tile, 1)
    count_activations = check_flag("count_activations", count_activations)
    if cost_model == "refined":
        for name, v in (("flop_efficiency", flop_efficiency), ("bw_efficiency", bw_efficiency),
                        ("count_activations", count_activations)):
            if v != _ROOFLINE_ONLY[name]:
                raise ValueError(f"{name} is a roofline setting; the refined model takes its ceilings from the "
                                 f"GPU's RefinedParams (GPUSpec.refined, or a JSON profile), got {name}={v!r}")
    if attention_tile is not None:
        if cost_model != "refined":
            raise ValueError(f"attention_tile belongs to the refined model's 'causal-tiles' attention; the roofline "
                             f"counts 'full' or 'causal' pairs, got attention_tile={attention_tile!r}")
        in_effect = gpu.refined.attention if attention is None else attention
        if in_effect != "causal-tiles":
            raise ValueError(f"attention_tile belongs to the refined model's 'causal-tiles' attention; with "
                             f"attention {in_effect!r} it would change nothing, got attention_tile={attention_tile!r}")
    return _cached_pricer(cost_model, spec, gpu, tp, pp, flop_efficiency, bw_efficiency, comm_efficiency,
                          overhead_s, attention, count_activations, seq_overhead_s, attention_tile)


PRICER_SETTINGS = tuple(pricer.__kwdefaults__)
"""The settings `step_cost`, `step_time`, `max_batch_within` and `decode_profile` pass on to `pricer`."""


def pricer_for(model: ModelSpec | str, gpu: GPUSpec | str, settings: dict):
    """`pricer(model, gpu, **settings)`, a setting it does not take refused by name."""
    unknown = [k for k in settings if k not in PRICER_SETTINGS]
    if unknown:
        raise ValueError(f"unknown setting {brief(unknown[0])}={brief(settings[unknown[0]])}; "
                         f"allowed: {', '.join(PRICER_SETTINGS)}")
    return pricer(model, gpu, **settings)


def step_cost(model: ModelSpec | str, gpu: GPUSpec | str, works: Iterable[SeqWork] | StepTotals,
              **settings) -> StepCost:
    """Price one step of `works` (how: `roofline.py`, `refined.py`; settings as `pricer`)."""
    return pricer_for(model, gpu, settings).cost(_given_step(works))


def step_time(model: ModelSpec | str, gpu: GPUSpec | str, totals: StepTotals | Iterable[SeqWork],
              **settings) -> float:
    """Seconds for one step given its `StepTotals` (or works); equal to `step_cost(...).time_s`, without
    the breakdown. The settings and the step are checked (`pricer`, `_given_step`) and the price must
    be finite."""
    pr = pricer_for(model, gpu, settings)
    t = _given_step(totals)
    return finite_time(pr, t, pr.time(t))


def _given_step(works: Iterable[SeqWork] | StepTotals) -> StepTotals:
    """A step given at the door: `StepTotals` that could be a real step's (`check_totals`), or a list of
    `SeqWork` (each checked when it was made), summed."""
    if isinstance(works, StepTotals):
        return check_totals(works)
    if isinstance(works, (str, bytes)) or not isinstance(works, Iterable):
        raise ValueError(f"a step is a StepTotals or a list of SeqWork, got {brief(works)} ({type(works).__name__})")
    return StepTotals.of(check_items("works", works, SeqWork))


def decode_totals(batch: int, context: int) -> StepTotals:
    """`batch` decodes, each at `context` tokens including the new one: `batch x SeqWork(1, context - 1)`,
    which is the fast engine's decode step over `batch x (context - 1)` stored tokens
    (`decode_runs.decode_step_totals`).

    A context is at least 2 (one cached token plus the new one) and `batch` at least 0: the caller's
    counts (a search calls this once per batch it tries)."""
    batch, context = int(batch), int(context)      # plain ints, so the totals are (numpy's come back as them)
    assert batch >= 0 and context >= 2, f"a decode step of {batch} sequences at context {context}"
    return decode_step_totals(batch, batch * (context - 1))


def _decode_context(model: ModelSpec | str, context: int) -> int:
    """A decode step's context: one cached token and the new one at least, the model's context at most."""
    return check_int("context", context, 2, get_model_spec(model).max_context)


MAX_BATCH_SEARCHED = 1 << 24    # max_batch_within's default limit


def max_batch_within(model: ModelSpec | str, gpu: GPUSpec | str, budget_s: float, context: int,
                     *, limit: int = MAX_BATCH_SEARCHED, **settings) -> int:
    """Largest decode batch at `context` whose step fits in `budget_s` (lecture §2.6: 559 at 512, 34 at 8K).

    0 means that not even one sequence fits. `budget_s` > 0, `context` in [2, the model's context],
    `limit` (the largest batch searched) >= 1."""
    budget_s = check_real("budget_s", budget_s, 0.0, lo_open=True, unit="seconds")
    limit = check_int("limit", limit, 1)
    context = _decode_context(model, context)
    pr = pricer_for(model, gpu, settings)
    fits = lambda b: pr.time(decode_totals(b, context)) <= budget_s  # noqa: E731
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            raise ValueError(f"more than {limit} sequences fit in {budget_s} s; the budget is too large")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def decode_profile(model: ModelSpec | str, gpu: GPUSpec | str, context: int, **settings) -> tuple[float, float]:
    """Clipper's latency profile `a + b B` of a decode step at `context` (lecture §2.6).

    `a` is the cost of reading the weights, `b` the extra K/V read per sequence: exact while the
    step stays memory-bound, the slope between batch 1 and 2 (`context` in [2, the model's context]).
    """
    context = _decode_context(model, context)
    pr = pricer_for(model, gpu, settings)
    t1, t2 = (finite_time(pr, t, pr.time(t)) for t in (decode_totals(1, context), decode_totals(2, context)))
    return t1 - (t2 - t1), t2 - t1
