"""Serving metrics from token timestamps (lecture §5.2–§5.4, §6.1; lecture 1 §4).

Everything is computed from the times at which each token came out (`RunResult`), with numpy:
- TTFT: first token - arrival. TPOT: (last - first) / (output - 1), per request (a one-token answer
  has none and meets any TPOT limit). ITL: gaps between consecutive tokens of a request, over all
  tokens (median, P99, max: the stutters of §6.4). E2E: last token - arrival. Orca's normalized
  latency: E2E / generated tokens (OSDI 2022 §6).
- SLO attainment: the share of served requests with TTFT <= `slo_ttft_s` and TPOT <= `slo_tpot_s`.
- Throughput (tokens/s): overall = all tokens / (last token - first arrival); steady = tokens out
  by the time the last request got its first token, over that window (§5.4: a finite overloaded
  run ends with a tail of a few long requests that says nothing about the scheduler).
- Mean batch: sequences per step (static batching's idle seats included). K/V memory: slots
  occupied (reserved) and holding tokens (used), time-weighted over the run, as fractions of the
  capacity (§6.1: under max reservation about 90% is occupied but about a quarter holds tokens).
- Goodput: the largest arrival rate whose SLO attainment is >= the target (90%), by geometric
  bisection to a stated relative tolerance, regenerating the seeded workload at each rate (§5.3).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from .engine import RunResult


@dataclass(frozen=True)
class Metrics:
    """One run's figures; times in the run's clock (seconds unless the clock counts iterations)."""

    n_requests: int
    n_rejected: int
    n_preemptions: int
    ttft_mean_s: float
    ttft_median_s: float
    ttft_p99_s: float
    ttft_max_s: float
    tpot_mean_s: float
    tpot_median_s: float
    tpot_p99_s: float
    itl_median_s: float
    itl_p99_s: float
    itl_max_s: float
    e2e_median_s: float
    e2e_p99_s: float
    norm_latency_median_s: float
    norm_latency_mean_s: float
    slo_ttft_s: float
    slo_tpot_s: float
    ttft_attainment: float
    tpot_attainment: float
    slo_attainment: float
    throughput_tok_s: float
    steady_throughput_tok_s: float
    throughput_req_s: float
    makespan_s: float
    steady_window_s: float
    mean_batch: float
    max_batch: int
    mem_occupied_frac: float
    mem_stored_frac: float
    mem_occupied_tokens: float
    mem_stored_tokens: float
    n_steps: int

    def as_dict(self) -> dict:
        return asdict(self)


def _q(x: np.ndarray, q: float) -> float:
    x = x[~np.isnan(x)]
    return float(np.quantile(x, q)) if len(x) else math.nan


def _mean(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(x.mean()) if len(x) else math.nan


def per_request(result: RunResult) -> dict[str, np.ndarray]:
    """TTFT, TPOT (NaN for one-token answers), E2E and normalized latency per request."""
    first, last = result.first_token_s, result.last_token_s
    out = result.output_len
    ttft = first - result.arrival_s
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(out > 1, (last - first) / np.maximum(out - 1, 1), np.nan)
    e2e = last - result.arrival_s
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e, "norm_latency": e2e / out}


def inter_token_latencies(result: RunResult) -> np.ndarray:
    """Gaps between consecutive tokens of the same request, all requests together."""
    gaps = np.diff(result.token_times)
    return np.delete(gaps, result.token_offsets[1:-1] - 1)


def slo_met(result: RunResult, slo_ttft_s: float, slo_tpot_s: float) -> np.ndarray:
    """Per request: did it meet both limits?"""
    pr = per_request(result)
    return (pr["ttft"] <= slo_ttft_s) & (np.isnan(pr["tpot"]) | (pr["tpot"] <= slo_tpot_s))


def steady_throughput(result: RunResult) -> tuple[float, float]:
    """(tokens/s, window s) up to the moment the last request produced its first token (§5.4)."""
    t0 = float(result.arrival_s.min())
    ts = float(result.first_token_s.max())
    if ts <= t0:
        return math.nan, 0.0
    return float((result.token_times <= ts).sum()) / (ts - t0), ts - t0


def memory_occupancy(result: RunResult) -> tuple[float, float]:
    """Time-weighted K/V slots (occupied, holding tokens) over the run, in tokens.

    Each step's occupancy holds from its start until the next step starts (or it ends, if the
    engine then idles); with pipelining the steps overlap and this counts each moment once.
    """
    if result.n_steps == 0:
        return 0.0, 0.0
    start, end = result.step_start, result.step_end
    until = np.minimum(end, np.append(start[1:], end[-1]))
    dur = np.maximum(until - start, 0.0)
    span = float(result.last_token_s.max() - result.arrival_s.min())
    if span <= 0:
        return math.nan, math.nan
    return float((result.step_reserved * dur).sum()) / span, float((result.step_used * dur).sum()) / span


def summarize(result: RunResult, slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.05) -> Metrics:
    """All the figures of a run against one SLO."""
    for name, v in (("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
        if not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{name} must be a positive number, got {v!r}")
    pr = per_request(result)
    itl = inter_token_latencies(result)
    ok_ttft = pr["ttft"] <= slo_ttft_s
    ok_tpot = np.isnan(pr["tpot"]) | (pr["tpot"] <= slo_tpot_s)
    t0 = float(result.arrival_s.min())
    makespan = float(result.last_token_s.max()) - t0
    n_tok = int(result.output_len.sum())
    steady, window = steady_throughput(result)
    occ, stored = memory_occupancy(result)
    cap = result.n_slots
    nan = math.nan
    return Metrics(
        n_requests=result.n, n_rejected=len(result.rejected), n_preemptions=int(result.n_preemptions.sum()),
        ttft_mean_s=_mean(pr["ttft"]), ttft_median_s=_q(pr["ttft"], 0.5), ttft_p99_s=_q(pr["ttft"], 0.99),
        ttft_max_s=float(pr["ttft"].max()),
        tpot_mean_s=_mean(pr["tpot"]), tpot_median_s=_q(pr["tpot"], 0.5), tpot_p99_s=_q(pr["tpot"], 0.99),
        itl_median_s=_q(itl, 0.5) if len(itl) else nan, itl_p99_s=_q(itl, 0.99) if len(itl) else nan,
        itl_max_s=float(itl.max()) if len(itl) else nan,
        e2e_median_s=_q(pr["e2e"], 0.5), e2e_p99_s=_q(pr["e2e"], 0.99),
        norm_latency_median_s=_q(pr["norm_latency"], 0.5), norm_latency_mean_s=_mean(pr["norm_latency"]),
        slo_ttft_s=float(slo_ttft_s), slo_tpot_s=float(slo_tpot_s),
        ttft_attainment=float(ok_ttft.mean()), tpot_attainment=float(ok_tpot.mean()),
        slo_attainment=float((ok_ttft & ok_tpot).mean()),
        throughput_tok_s=n_tok / makespan if makespan > 0 else nan,
        steady_throughput_tok_s=steady, throughput_req_s=result.n / makespan if makespan > 0 else nan,
        makespan_s=makespan, steady_window_s=window,
        mean_batch=float(result.step_n_seqs.mean()) if result.n_steps else nan,
        max_batch=int(result.step_n_seqs.max()) if result.n_steps else 0,
        mem_occupied_frac=occ / cap if cap and not math.isnan(cap) else nan,
        mem_stored_frac=stored / cap if cap and not math.isnan(cap) else nan,
        mem_occupied_tokens=occ, mem_stored_tokens=stored, n_steps=result.n_steps)


@dataclass(frozen=True)
class Goodput:
    """The largest rate found with attainment >= target, and how it was found."""

    rate: float
    target: float
    rel_tol: float
    lo: float
    hi: float
    evaluations: list[tuple[float, float]] = field(default_factory=list)
    note: str = ""


def goodput_search(attainment_at: Callable[[float], float], target: float = 0.9, lo: float = 0.01,
                   hi: float = 256.0, rel_tol: float = 0.01) -> Goodput:
    """Geometric bisection for the largest rate in [lo, hi] whose attainment is >= `target`.

    Returns a rate that met the target, within a factor `1 + rel_tol` of one that did not
    (attainment is assumed to fall as the rate rises; the evaluations are kept to check it).
    `rate` is 0 if even `lo` misses the target, and `hi` if `hi` meets it.
    """
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    if not (0 < lo < hi) or not all(math.isfinite(x) for x in (lo, hi)):
        raise ValueError(f"need 0 < lo < hi (finite), got lo={lo!r}, hi={hi!r}")
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol!r}")
    evals: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        a = float(attainment_at(rate))
        evals.append((rate, a))
        return a >= target

    if ok(hi):
        return Goodput(hi, target, rel_tol, lo, hi, evals, f"meets the target at the upper bound {hi}")
    if not ok(lo):
        return Goodput(0.0, target, rel_tol, lo, hi, evals, f"misses the target at the lower bound {lo}")
    a, b = lo, hi
    while b / a > 1 + rel_tol:
        mid = math.sqrt(a * b)
        if ok(mid):
            a = mid
        else:
            b = mid
    return Goodput(a, target, rel_tol, lo, hi, evals)
