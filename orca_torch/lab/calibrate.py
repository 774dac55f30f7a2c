"""Calibrate the paper GPU from the torch executor's own measurements: the bridge between
the torch half of the project and the simulator half (docs/paper-gpu.md, "GPU profiles and
calibration"; experiments 05 and 05 refined).

Two calls measure the torch model's steps and fit a cost model to them:

- `calibrate(model)`: `default_mixes`, timed, then the roofline fit (`Calibration`, whose
  `executor()` simulates this machine; docs/experiments/05-sim-vs-real.md);
- `calibrate_refined(model)`: `refined_grid`'s fitted and held-out mixes (or a grid of the caller's,
  as benchmarks/gpu_profile.py gives), timed, then the refined fit on the first from `refined_start`
  (`RefinedFit`, a GPU profile; docs/experiments/05-refined-calibration.md).

Their parts live in `orca_torch.lab.calibration`, one module each; the fits take steps measured
anywhere (a server's log, another machine):

- `samples`: what is measured, `StepSample` (one step's `StepTotals` and its median seconds),
  `samples_from_rows` for any table of measured steps, and what both fits share;
- `measure`: `measure_steps(model, mixes) -> samples`, timing the torch model on lists of `SeqWork`;
- `roofline_fit`: `fit(samples) -> Calibration`, the roofline's rates and overheads;
- `refined_fit`: `fit_refined(samples) -> RefinedFit`, the refined cost model's named parameters.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from orca_torch.checks import brief, check_device, check_flag, check_items, check_list
from orca_torch.core.batch import SeqWork
from orca_torch.lab.calibration.measure import check_mixes, measure_steps
from orca_torch.lab.calibration.refined_fit import REFINED_FIT_PARAMS, RefinedFit, check_free, fit_refined
from orca_torch.lab.calibration.roofline_fit import Calibration, fit, machine_memory
from orca_torch.lab.calibration.samples import StepSample, check_enough
from orca_torch.sim.hw_model import GPUSpec, card_for, get_gpu
from orca_torch.sim.hw_model.refined_params import CPU_GEMM_RAMP_TOKENS, RefinedParams
from orca_torch.specs import ModelSpec, get_model_spec


def uncalibrated_gpu(device) -> GPUSpec:
    """The paper GPU of a torch device before calibration: a CPU's measured peaks (`get_gpu("cpu")`),
    or a card's datasheet (`card_for` its name; the H100's for a card without one here)."""
    import torch

    device = torch.device(check_device(device))
    if device.type != "cuda":
        return get_gpu("cpu")
    return get_gpu(card_for(torch.cuda.get_device_name(device)) or "h100")


def calibrated_machine(device) -> tuple[str, float]:
    """What a roofline calibration on a torch device names its machine, and that machine's memory in
    bytes: "cpu" (or "mps") and this host's; for a CUDA device its datasheet card's name (`card_for`) and
    nominal memory, as `uncalibrated_gpu` and the capacity's `mem_unit` count it, or for a card without
    one here "cuda" and the bytes the driver reports. `device` is a built model's (`calibrate` and
    `calibrate_refined` pass `model.device`), checked where the model was built."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device.type, machine_memory(device.type)
    card = card_for(torch.cuda.get_device_name(device))
    if card is not None:
        return card, machine_memory(card)
    return "cuda", float(torch.cuda.get_device_properties(device).total_memory)


# ---- the roofline: calibrate ---------------------------------------------------------------------

def default_mixes(spec: ModelSpec | str = "mini", quick: bool = False) -> list[list[SeqWork]]:
    """Decodes at several batch sizes and contexts, prefills of several lengths, and mixed steps,
    covering what Orca's scheduler builds for prompts up to a quarter of the context."""
    ctx_max = get_model_spec(spec).max_context
    if quick:
        batches, contexts, prompts = (1, 4, 16), (32, ctx_max // 4), (32, 128, ctx_max // 8)
    else:
        batches, contexts, prompts = (1, 2, 4, 8, 16, 32), (32, ctx_max // 8, ctx_max // 3), (16, 64, 128, 256,
                                                                                              ctx_max // 4)
    mixes = [[SeqWork(1, c - 1)] * b for b in batches for c in contexts]
    mixes += [[SeqWork(p, 0)] for p in prompts]
    mixes.append([SeqWork(prompts[1], 0)] + [SeqWork(1, contexts[1] - 1)] * 8)
    if not quick:
        mixes.append([SeqWork(prompts[1], 0)] * 4)
        mixes.append([SeqWork(prompts[-2], 0)] + [SeqWork(1, contexts[-1] - 1)] * 16)
    return mixes


def calibrate(model="mini", mixes: Sequence[Sequence[SeqWork]] | None = None, repeats: int = 5, seed: int = 0,
              quick: bool = False, device: str | None = None) -> Calibration:
    """Measure `mixes` (default `default_mixes(quick=quick)`; quick=True with mixes is refused) on the torch
    model and fit (`model`: an `OrcaModel`, or a preset built on `device`, default the CPU; a `device`
    other than an `OrcaModel`'s own is refused). The calibration names the machine the steps ran on,
    and carries its memory (`calibrated_machine`): a fit measured on an H200 prices as "h200-calibrated"."""
    from orca_torch.model.orca_model import OrcaModel, torch_spec

    if check_flag("quick", quick) and mixes is not None:
        raise ValueError("quick=True picks the quick default_mixes, but mixes were given: give one of them")
    spec = torch_spec(model)
    mixes = check_mixes(spec, default_mixes(spec, quick) if mixes is None else mixes, repeats)
    if not isinstance(model, OrcaModel):
        model = OrcaModel(model, seed=seed, device="cpu" if device is None else device)
    machine, mem_bytes = calibrated_machine(model.device)
    return fit(measure_steps(model, mixes, repeats, seed, device=device), model.spec, machine=machine,
               mem_bytes=mem_bytes)


# ---- the refined cost model: calibrate_refined ---------------------------------------------------

MIN_GRID_CONTEXT = {True: 132, False: 256}
"""The smallest max_context `refined_grid` accepts, for quick=True and False: below it the fitted
grid's contexts or prompt lengths collapse or exceed the context (tests/test_calibrate.py checks
that every larger context is accepted)."""


def refined_grid(spec: ModelSpec | str = "mini", quick: bool = False) -> tuple[list[list[SeqWork]], list[list[SeqWork]]]:
    """(fit mixes, held-out mixes): decodes, prefills and mixed steps; the held-out ones use decode batch
    sizes, decode contexts and prompt lengths that no fitted step has, so no held-out mix is a fitted one.

    The grid scales with the model's `max_context`; a fitted value that repeats is kept once. A
    held-out context or prompt length that a fitted step has moves halfway to the next larger fitted
    value, and is dropped if there is none or that value is taken too: on `mini` nothing moves; on
    `tiny` (512) the full grid holds out context 48 and prompt 192 instead of 32 and 128, and the quick
    grid one prompt length fewer (64 would move to 96, already held out). Raises ValueError when
    `max_context` is below `MIN_GRID_CONTEXT[quick]`.
    """
    ctx_max = get_model_spec(spec).max_context
    if ctx_max < MIN_GRID_CONTEXT[check_flag("quick", quick)]:
        raise ValueError(f"max_context {ctx_max} is too small for refined_grid(quick={quick}): its fitted and "
                         f"held-out steps need max_context >= {MIN_GRID_CONTEXT[quick]}")
    if quick:
        fit_batches, fit_contexts, fit_prompts = (1, 8, 32), (32, ctx_max // 4), (16, 128, ctx_max // 8)
        held_batches, held_contexts, held_prompts = (4, 16), (ctx_max // 8,), (64, ctx_max // 16 * 3)
    else:
        fit_batches = (1, 4, 16, 48)
        fit_contexts, fit_prompts = (32, ctx_max // 8, ctx_max // 3), (16, 64, 256, ctx_max // 4)
        held_batches = (2, 8, 24, 32)
        held_contexts, held_prompts = (ctx_max // 16, ctx_max // 4), (32, 128, ctx_max // 16 * 3)
    fit_contexts, fit_prompts = _fitted_values(fit_contexts, 2, ctx_max), _fitted_values(fit_prompts, 1, ctx_max)
    held_contexts = _held_values(held_contexts, fit_contexts, 2, ctx_max)
    held_prompts = _held_values(held_prompts, fit_prompts, 1, ctx_max)
    fit_mixes = ([[SeqWork(1, c - 1)] * b for b in fit_batches for c in fit_contexts]
                 + [[SeqWork(p, 0)] for p in fit_prompts])
    fit_mixes.append([SeqWork(fit_prompts[1], 0)] + [SeqWork(1, fit_contexts[1] - 1)] * fit_batches[-2])
    held_mixes = ([[SeqWork(1, c - 1)] * b for b in held_batches for c in held_contexts]
                  + [[SeqWork(p, 0)] for p in held_prompts])
    held_mixes.append([SeqWork(held_prompts[0], 0)] + [SeqWork(1, held_contexts[0] - 1)] * held_batches[-1])
    return fit_mixes, held_mixes


def _fitted_values(values: tuple[int, ...], lo: int, ctx_max: int) -> tuple[int, ...]:
    """The fitted grid's values, each once: at least two, all within [lo, ctx_max]."""
    out = tuple(dict.fromkeys(values))
    assert len(out) >= 2 and all(lo <= v <= ctx_max for v in out), (values, ctx_max)
    return out


def _held_values(values: tuple[int, ...], fitted: tuple[int, ...], lo: int, ctx_max: int) -> tuple[int, ...]:
    """`values` with none a fitted step has: such a value moves halfway to the next larger fitted one and
    is dropped if there is none, or if it lands on a taken value; values outside [lo, ctx_max] are dropped."""
    out: list[int] = []
    for v in values:
        if v in fitted:
            above = [f for f in fitted if f > v]
            v = (v + min(above)) // 2 if above else 0
        if lo <= v <= ctx_max and v not in fitted and v not in out:
            out.append(v)
    assert out, (values, fitted, ctx_max)
    return tuple(out)


def calibrate_refined(model="mini", quick: bool = False, repeats: int = 5, seed: int = 0, device: str | None = None,
                      gpu: GPUSpec | str | None = None, free: Sequence[str] | None = None,
                      grid: tuple[Sequence[Sequence[SeqWork]], Sequence[Sequence[SeqWork]]] | None = None
                      ) -> tuple[RefinedFit, list[StepSample]]:
    """Time `grid`'s steps (default `refined_grid(quick=quick)`; quick=True with a grid is refused) on the
    torch model, fit the refined model on the first part; returns the fit and the measured held-out
    samples of the second (`fit.median_abs_error(held)` is the held-out error). `model` is an
    `OrcaModel`, or a preset built on `device` (default the CPU); a `device` other than an
    `OrcaModel`'s own is refused.

    The fit starts from `gpu`, by default the model's device before calibration (`uncalibrated_gpu`),
    with the attention the model's path computes (`refined_start`). A CUDA card without a datasheet here
    starts from the H100's rates, but its fitted card is named and sized as itself ("cuda-refined", the
    memory the driver reports: `calibrated_machine`), not as an H100.
    """
    from orca_torch.model.orca_model import OrcaModel, torch_spec

    if check_flag("quick", quick) and grid is not None:
        raise ValueError("quick=True picks the quick refined_grid, but a grid was given: give one of them")
    free = REFINED_FIT_PARAMS if free is None else check_free(free)
    spec = torch_spec(model)
    fit_m, held_m = refined_grid(spec, quick) if grid is None else _check_grid(grid)   # before a model is built
    check_enough(fit_m, len(free) + 1, len(free))
    check_mixes(spec, fit_m + held_m, repeats)
    g = get_gpu(gpu) if gpu is not None else None
    if not isinstance(model, OrcaModel):
        model = OrcaModel(spec, seed=seed, device="cpu" if device is None else device)
    if g is None:
        g = uncalibrated_gpu(model.device)
        machine, mem_bytes = calibrated_machine(model.device)
        if machine != g.name:           # a card without a datasheet: the H100's rates stand in, not its name
            g = dataclasses.replace(g, name=machine, mem_bytes=mem_bytes)
    measured = measure_steps(model, fit_m + held_m, repeats, seed, device=device)
    fit_s, held_s = measured[:len(fit_m)], measured[len(fit_m):]
    return fit_refined(fit_s, model.spec, g, free=free, start=refined_start(g, model)), held_s


def _check_grid(grid) -> tuple[list[list[SeqWork]], list[list[SeqWork]]]:
    """`grid` as (fit mixes, held-out mixes), two lists of `SeqWork` lists; either may be empty here
    (`check_enough` and `check_mixes` say what the fit part needs)."""
    if not (isinstance(grid, (tuple, list)) and len(grid) == 2):
        raise ValueError(f"grid must be (fit mixes, held-out mixes), two lists of SeqWork lists; got {brief(grid)}")
    return tuple([check_items(f"grid[{i}][{j}]", m, SeqWork)
                  for j, m in enumerate(check_list(f"grid[{i}]", part, "SeqWork lists"))]
                 for i, part in enumerate(grid))


def refined_start(card: GPUSpec, model) -> RefinedParams:
    """Where a refined fit of `model`'s timed steps starts: `card`'s `RefinedParams` with the attention
    the model's path computes, "causal-tiles" where a variable-length kernel (Flash Attention's) runs
    the fused path, else "full" (the split loop's and the padded batch's masked matmul computes the
    whole rectangle). On a CPU, also no per-kernel floor (eager dispatch costs per step, in
    `launch_overhead_s`) and a CPU's GEMM ramp (`CPU_GEMM_RAMP_TOKENS`): a CPU's GEMM works on a
    few rows at a time."""
    attention = "causal-tiles" if model.step_path() == "varlen" else "full"
    cpu = {"kernel_floor_s": 0.0, "gemm_ramp_tokens": CPU_GEMM_RAMP_TOKENS} if model.device.type == "cpu" else {}
    return dataclasses.replace(card.refined, attention=attention, **cpu)
