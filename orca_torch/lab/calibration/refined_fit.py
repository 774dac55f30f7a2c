"""The refined fit, `fit_refined(samples) -> RefinedFit`: the refined cost model's parameters, fitted
to measured steps.

The refined cost model (`hw_model.refined`, docs/paper-gpu.md) is fitted the way `roofline_fit.fit`
fits the roofline, by least squares on the relative error: its named parameters (GEMM ceilings,
attention and elementwise efficiencies, per-step and per-request overhead: `REFINED_FIT_PARAMS`) by
Levenberg-Marquardt within bounds (efficiencies > 0, times >= 0; `_levenberg_marquardt`). Its
result is a `GPUSpec` with fitted `RefinedParams`, saved as a JSON GPU profile that
`pricer(model, "profile.json", cost_model="refined")` reads. docs/experiments/05-refined-calibration.md
uses it; `calibrate.calibrate_refined` measures and fits in one call.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from orca_torch.checks import brief, check_int
from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.lab.calibration.samples import (IDENTIFIED_SHIFT, FitErrors, StepSample, check_enough,
                                                check_fit_context, check_samples, samples_model)
from orca_torch.sim.hw_model import GPUSpec, get_gpu, pricer
from orca_torch.sim.hw_model.cost import step_time
from orca_torch.sim.hw_model.gpus import save_profile
from orca_torch.sim.hw_model.refined import RefinedPricer
from orca_torch.sim.hw_model.refined_params import RefinedParams
from orca_torch.specs import ModelSpec


REFINED_FIT_PARAMS = ("gemm_flop_ceiling", "gemm_bw_ceiling", "attention_flop_efficiency",
                      "elementwise_bw_efficiency", "launch_overhead_s", "seq_overhead_s")
"""What `fit_refined` fits by default. `kernel_floor_s` is a per-step constant for one model, like
`launch_overhead_s`, so only one of them can be told apart; `overlap` and `gemm_ramp_tokens` may
be added to `free` when the grid has many steps near the ridge point."""
_FITTABLE = REFINED_FIT_PARAMS + ("overlap", "gemm_ramp_tokens", "kernel_floor_s")
_FLOP_SIDE, _BYTE_SIDE = ("gemm_flop_ceiling", "attention_flop_efficiency"), ("gemm_bw_ceiling",
                                                                              "elementwise_bw_efficiency")
_SCALE = 1e3  # efficiencies are fitted against peaks x this, so a fitted rate may beat the given peak

MAX_ITER = 300
"""Levenberg-Marquardt iterations per start of `fit_refined` (default)."""

LOWERED_SHIFT = 1e-3
"""How far a rate the steps bound from below only may be lowered: until some fitted step's predicted
time moves by this much."""


@dataclass(frozen=True)
class RefinedFit(FitErrors):
    """The refined model fitted to measured steps: `gpu` carries the fitted `RefinedParams`."""

    model: ModelSpec
    gpu: GPUSpec
    free: tuple[str, ...]
    samples: tuple[StepSample, ...] = field(default=(), repr=False)
    not_identified: tuple[str, ...] = ()   # fitted rates the steps do not pin down (`fit_refined`)

    def pricer(self) -> RefinedPricer:
        return pricer(self.model, self.gpu, cost_model="refined")

    def predict(self, totals: StepTotals | Sequence[SeqWork]) -> float:
        return step_time(self.model, self.gpu, totals, cost_model="refined")

    def notes(self, held_out: Sequence[StepSample] = ()) -> dict:
        d = {"model": self.model.name, "fitted": list(self.free), "not_identified": list(self.not_identified),
             "n_samples": len(self.samples), "fit_median_abs_error": self.median_abs_error()}
        if held_out:
            d.update(n_held_out=len(held_out), held_out_median_abs_error=self.median_abs_error(held_out))
        return d

    def save(self, path: str | os.PathLike, held_out: Sequence[StepSample] = ()):
        """Write the fitted card as a JSON GPU profile (see `hw_model.gpus.save_profile`)."""
        return save_profile(self.gpu, path, self.notes(held_out))


def fit_refined(samples: Sequence[StepSample], model: ModelSpec | str | None = None, gpu: GPUSpec | str = "cpu", *,
                free: Sequence[str] = REFINED_FIT_PARAMS, start: RefinedParams | None = None,
                max_iter: int = MAX_ITER) -> RefinedFit:
    """Fit the refined model's `free` parameters to measured `samples` of `model` on `gpu`.

    `model` defaults to the spec `measure_steps` recorded on the samples (and must be it when given).
    `gpu` gives the peaks the efficiencies are measured against (a datasheet card, or "cpu" measured)
    and the starting point (`start`, default the card's `RefinedParams`); the fixed parameters keep
    their values. Least squares on the relative error by Levenberg-Marquardt within bounds, from the
    start and from two scaled copies of it (the best fit is kept). The result's `not_identified` names the fitted
    efficiencies and ceilings the steps do not pin down (`IDENTIFIED_SHIFT`): the steps bound them
    from below only, so each is lowered to about the slowest rate they allow (`LOWERED_SHIFT`) and
    at most the peak (the card's, or the fastest pinned-down rate where that beat it). It is no
    measured rate and raises no peak; where the steps wanted it faster than the peak, the cap moves
    the fitted steps, and the fit's errors show by how much. Raises ValueError for unknown parameter
    names, fewer distinct steps than parameters + 1, or bad times.
    """
    samples = check_samples(samples)
    max_iter = check_int("max_iter", max_iter, 1)
    spec, g = samples_model(samples, model, None), get_gpu(gpu)
    check_fit_context(spec, samples)
    free = check_free(free)
    check_enough(samples, len(free) + 1, len(free))
    start = g.refined if start is None else start
    if not isinstance(start, RefinedParams):
        raise ValueError(f"start must be a RefinedParams, got {type(start).__name__}")
    return _fit_refined(samples, spec, g, free, start, max_iter)


def _fit_refined(samples: list[StepSample], spec: ModelSpec, g: GPUSpec, free: tuple[str, ...], start: RefinedParams,
                 max_iter: int) -> RefinedFit:
    """`fit_refined` on checked arguments."""
    scaled = dataclasses.replace(g, peak_flops=g.peak_flops * _SCALE, mem_bw=g.mem_bw * _SCALE)
    base = dataclasses.replace(start, **{n: getattr(start, n) / _SCALE for n in _FLOP_SIDE + _BYTE_SIDE})
    totals = [s.totals for s in samples]
    secs = np.array([s.seconds for s in samples])

    def residuals(theta: np.ndarray) -> np.ndarray:
        try:
            prm = _refined_params(base, free, theta)
        except ValueError:
            return np.full(len(secs), 1e6)
        pr = RefinedPricer(spec, scaled, params=prm)
        return np.array([pr.time(t) for t in totals]) / secs - 1.0

    lo, hi = _bounds(free)
    theta0 = np.clip(_to_theta(base, free), lo, hi)
    # A few starts: the step time is not convex in the parameters (max, smooth max); the best fit wins.
    starts = [theta0] + [np.clip(np.where(lo > 0, theta0 * f, theta0 * f * 10 if f > 1 else 0.0), lo, hi)
                         for f in (0.3, 3.0)]
    best = None
    for theta in starts:
        theta, loss = _levenberg_marquardt(residuals, theta, lo, hi, max_iter)
        if best is None or loss < best[1]:
            best = (theta, loss)
    prm = _refined_params(base, free, best[0])
    loose = _not_identified(spec, _normalised(g, prm), free, samples)
    fitted = _normalised(g, _lowest_rates(spec, scaled, prm, loose, totals), loose)
    fitted = dataclasses.replace(fitted, name=f"{g.name}-refined", source=(
        f"{g.name} with refined parameters fitted to {len(samples)} measured {spec.name} steps "
        f"({fit_refined.__module__}.{fit_refined.__qualname__}; fitted: {', '.join(free)})"))
    return RefinedFit(spec, fitted, free, tuple(samples), loose)


def _levenberg_marquardt(residuals, theta: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                         max_iter: int) -> tuple[np.ndarray, float]:
    """Minimise |residuals(theta)|^2 within [lo, hi]: forward-difference Jacobian, Marquardt's scaling."""
    r = residuals(theta)
    loss, lam = float(r @ r), 1e-3
    for _ in range(max_iter):
        jac = np.empty((len(r), len(theta)))
        for j in range(len(theta)):
            h = 1e-7 * max(abs(theta[j]), 1e-6)
            step = np.zeros_like(theta)
            step[j] = h
            jac[:, j] = (residuals(theta + step) - r) / h
        jtj, jtr = jac.T @ jac, jac.T @ r
        improved = False
        while lam < 1e12:
            a = jtj + lam * np.diag(np.diag(jtj) + 1e-30)
            try:
                delta = np.linalg.solve(a, -jtr)
            except np.linalg.LinAlgError:
                lam *= 10
                continue
            cand = np.clip(theta + delta, lo, hi)
            rc = residuals(cand)
            lc = float(rc @ rc)
            if lc < loss:
                improved = True
                theta, r, loss, lam = cand, rc, lc, max(lam / 5, 1e-12)
                break
            lam *= 4
        if not improved or loss < 1e-26:
            break
    return theta, loss


def _refined_params(base: RefinedParams, names: Sequence[str], theta: np.ndarray) -> RefinedParams:
    """Efficiencies are fitted as their inverses (a step's time is close to linear in them), the rest as is."""
    vals = {n: float(1.0 / x if n in _FLOP_SIDE + _BYTE_SIDE else x) for n, x in zip(names, theta)}
    return dataclasses.replace(base, **vals)


def _to_theta(prm: RefinedParams, names: Sequence[str]) -> np.ndarray:
    return np.array([1.0 / getattr(prm, n) if n in _FLOP_SIDE + _BYTE_SIDE else float(getattr(prm, n))
                     for n in names])


def _bounds(names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    lo = {"overlap": 1.0}
    hi = {"overlap": 64.0}
    return (np.array([lo.get(n, 1.0 if n in _FLOP_SIDE + _BYTE_SIDE else 0.0) for n in names]),
            np.array([hi.get(n, np.inf) for n in names]))


def _normalised(g: GPUSpec, prm: RefinedParams, loose: Sequence[str] = ()) -> GPUSpec:
    """`prm`'s efficiencies are against `g`'s peaks x `_SCALE`: fold the scale back, raising a peak to
    the fastest fitted rate the steps pin down when the machine beat it (efficiencies stay in
    (0, 1]). A `loose` rate, which the steps bound from below only, raises no peak: it is capped at
    the peak (the card's, or the fastest pinned-down rate where that beat it), for the peak is what
    a roofline reads and the machine never showed a faster one."""
    f_top = max([getattr(prm, n) for n in _FLOP_SIDE if n not in loose], default=0.0) * _SCALE
    b_top = max([getattr(prm, n) for n in _BYTE_SIDE if n not in loose], default=0.0) * _SCALE
    f_peak, b_peak = g.peak_flops * max(1.0, f_top), g.mem_bw * max(1.0, b_top)
    f_k, b_k = g.peak_flops * _SCALE / f_peak, g.mem_bw * _SCALE / b_peak
    vals = {n: min(1.0, getattr(prm, n) * f_k) for n in _FLOP_SIDE}
    vals.update({n: min(1.0, getattr(prm, n) * b_k) for n in _BYTE_SIDE})
    return dataclasses.replace(g, peak_flops=f_peak, mem_bw=b_peak, refined=dataclasses.replace(prm, **vals))


def not_identified_note(names: Sequence[str]) -> str:
    """What the values of `RefinedFit.not_identified`'s rates are (`_lowest_rates`, then `_normalised`),
    said where a fit's rates are printed."""
    return (f"not pinned down by these steps, which bound them from below only: {', '.join(names)}; each was "
            "lowered towards the slowest rate the steps allow, but not below the fastest rate of its side (FLOP "
            "or byte) that they pin down, or the card's peak where they pin none, then capped at the peak (a 1 is "
            "the peak): not a measured rate")


def _lowest_rates(spec: ModelSpec, scaled: GPUSpec, prm: RefinedParams, loose: Sequence[str],
                  totals: Sequence[StepTotals]) -> RefinedParams:
    """Each `loose` rate (a fitted efficiency the steps do not pin down: wherever the fit stopped, up
    to its bound, which as a card's peak a roofline would read) lowered to about the slowest the steps
    allow: bisected, in `prm`'s units against `scaled`'s peaks, between the fastest pinned-down rate
    of its side (or the given peak) and its fitted value."""
    def times(p: RefinedParams) -> np.ndarray:
        pr = RefinedPricer(spec, scaled, params=p)
        return np.array([pr.time(t) for t in totals])

    base = times(prm)
    for n in loose:
        side = _FLOP_SIDE if n in _FLOP_SIDE else _BYTE_SIDE
        fast, slow = getattr(prm, n), max([getattr(prm, m) for m in side if m not in loose], default=1 / _SCALE)

        def keeps(v: float) -> bool:
            moved = times(dataclasses.replace(prm, **{n: v})) / base - 1.0
            return float(np.abs(moved).max()) <= LOWERED_SHIFT

        if slow >= fast:
            continue
        if keeps(slow):
            prm = dataclasses.replace(prm, **{n: slow})
            continue
        for _ in range(40):                     # keeps(fast) and not keeps(slow): close in, geometrically
            mid = math.sqrt(slow * fast)
            slow, fast = (slow, mid) if keeps(mid) else (mid, fast)
        prm = dataclasses.replace(prm, **{n: fast})
    return prm


def _not_identified(spec: ModelSpec, g: GPUSpec, free: Sequence[str], samples: Sequence[StepSample]) -> tuple[str, ...]:
    """The free efficiencies and ceilings of the fitted card `g` that the samples do not identify."""
    def times(card: GPUSpec) -> np.ndarray:
        pr = pricer(spec, card, cost_model="refined")
        return np.array([pr.time(s.totals) for s in samples])

    base = times(g)
    out = []
    for n in free:
        if n not in _FLOP_SIDE + _BYTE_SIDE:
            continue
        half = dataclasses.replace(g, refined=dataclasses.replace(g.refined, **{n: getattr(g.refined, n) / 2}))
        moved = times(half) / base - 1.0
        if float(np.abs(moved).max()) < IDENTIFIED_SHIFT:
            out.append(n)
    return tuple(out)


def check_free(free: Sequence[str]) -> tuple[str, ...]:
    """`free` as a tuple: at least one refined parameter, each fittable and named once."""
    names = () if isinstance(free, (str, bytes)) or not isinstance(free, Iterable) else tuple(free)
    if not names or any(n not in _FITTABLE for n in names) or len(set(names)) != len(names):
        raise ValueError(f"free must name distinct refined parameters among {', '.join(_FITTABLE)}, got {brief(free)}")
    return names
