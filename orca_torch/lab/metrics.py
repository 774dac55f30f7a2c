"""Serving metrics from token timestamps (lecture §5.2–§5.4, §6.1; lecture 1 §4).

Everything is computed from the times at which each token came out (`RunResult`), with numpy:
- TTFT: first token - arrival. TPOT: (last - first) / (output - 1), per request: the first token is
  left out (its wait is TTFT's), as in vLLM's serving benchmark; a one-token answer has none (NaN,
  out of TPOT's mean, median and P99) and meets any TPOT limit. ITL: gaps between consecutive
  tokens of a request, the first-to-second included (a request's TPOT is the mean of its gaps),
  pooled over all requests (median, P99, max: the stutters of §6.4); counted per pair of steps
  from the run's tokens as runs of consecutive steps (`itl_counts`), so a million requests need
  no number per token. E2E: last token - arrival. Orca's normalized latency: E2E / generated
  tokens (OSDI 2022 §6).
- Median and P99: numpy's default (linear) quantiles, `np.quantile(x, 0.5)` and `np.quantile(x, 0.99)`,
  as vLLM's benchmark takes them (`np.percentile`), over requests (TTFT, TPOT, E2E) or gaps (ITL).
- SLO attainment: the share of served requests with TTFT <= `slo_ttft_s` and TPOT <= `slo_tpot_s`
  (`slo_attainment`), and the share of submitted ones, a rejected request counting as a miss
  (`slo_attainment_submitted`): refusing the hardest requests must not look like meeting their SLO.
- Throughput (tokens/s, generated tokens only: prompts are not counted): overall = all of them /
  (last token - first arrival); steady = those out by the time the last request got its first
  token, over that window from the first arrival (§5.4: a finite overloaded run ends with a tail
  of a few long requests that says nothing about the scheduler).
- Mean batch: sequences per step (static batching's idle seats included). K/V memory: slots
  occupied (reserved) and holding tokens (used), time-weighted over the run, as fractions of the
  capacity (§6.1: under max reservation about 90% is occupied but about a quarter holds tokens).
- Goodput: the largest arrival rate whose SLO attainment is >= the target (90%), by geometric
  bisection to a stated relative tolerance, regenerating the seeded workload at each rate (§5.3);
  a few probe rates around the answer then test the monotonicity bisection assumes, and the
  result's note warns when a lower rate missed the target while a higher one met it.

A run that served nothing (every request rejected) has no latencies: `summarize` raises ValueError
naming the count and the first rejection's reason rather than returning NaNs or a numpy error.
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from orca_torch.checks import brief, check_callable, check_instance, check_real
from orca_torch.core.run_result import RunResult


@dataclass(frozen=True)
class Metrics:
    """One run's figures; times in the run's clock (seconds unless the clock counts iterations).

    `n_requests` counts the requests served, `n_rejected` those refused at submission: the latency
    and throughput figures are over the served ones, `slo_attainment_submitted` over both."""

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
    slo_attainment_submitted: float
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


def _median(x: np.ndarray) -> float:
    """The median of `x` without its NaN (NaN if none is left)."""
    return quantiles(x[~np.isnan(x)], (0.5,))[0]


def _median_p99(x: np.ndarray) -> tuple[float, float]:
    """The median and P99 of `x` without its NaN, from one selection (NaN if none is left)."""
    median, p99 = quantiles(x[~np.isnan(x)], (0.5, 0.99))
    return median, p99


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
    """Gaps between consecutive tokens of the same request, all requests together (one float a
    token: `summarize` counts them with `itl_counts` instead)."""
    gaps = np.diff(result.token_times)
    return np.delete(gaps, result.token_offsets[1:-1] - 1)


_CHUNK = 1 << 22   # values handled at once when binning them (and the most gaps `itl_figures` repeats)
_STEPS = 1 << 21   # steps handled at once when summing over a run's steps
_FEW_STEPS = 4     # `itl_figures` repeats the gaps where they average fewer than this many a counted value


def itl_counts(result: RunResult) -> tuple[np.ndarray, np.ndarray]:
    """The inter-token gaps as values and how often each occurs, without a float per token.

    Two consecutive tokens of a request came out at the ends of the steps `a < b` that made them,
    so their gap is `step_end[b] - step_end[a]` (the very subtraction `np.diff(token_times)` does)
    and the gaps can be counted per pair of steps: one counter per step for `b = a + 1`, the usual
    case (`values` starts with every step's `step_end[a + 1] - step_end[a]`, counted 0 times where
    no pair has it), and the other pairs kept as keys. They are read off the run's tokens as runs
    of consecutive steps (`RunResult.token_runs`): a run from step `s` to step `e` holds the pairs
    `(s, s + 1) .. (e - 1, e)`, and two runs of a request, one after the other, hold one pair
    more, from the first's last step to the second's first. So the count of pairs `(a, a + 1)` is
    the number of stretches begun by step `a` (`s <= a`) less the number over by then (`e <= a`):
    a running sum over the steps of +1 where a stretch begins and -1 where one is over, taken a
    bounded chunk of steps at a time."""
    runs, end = result.token_runs, result.step_end
    n_steps = len(end)
    last = runs.last
    goes_on = np.ones(len(runs.slot), dtype=bool)      # run k + 1 is the same request's as run k
    goes_on[runs.first_runs(result.token_offsets)] = False
    goes_on = goes_on[1:]
    a, b = last[:-1][goes_on], runs.start[1:][goes_on]  # the pairs between two runs of a request
    adjacent = b == a + 1
    begun = np.sort(np.concatenate((runs.start, a[adjacent])), kind="stable")   # stretches of pairs (a, a + 1):
    over = np.sort(np.concatenate((last, a[adjacent] + 1)), kind="stable")      # where each begins, is over
    keys, key_counts = np.unique(a[~adjacent] * n_steps + b[~adjacent], return_counts=True)
    n_next = max(n_steps - 1, 0)
    values, counts = np.empty(n_next + len(keys)), np.empty(n_next + len(keys), dtype=np.uint32)
    np.subtract(end[1:], end[:-1], out=values[:n_next])
    for lo in range(0, n_next, _STEPS):                # pairs (a, a + 1), lo <= a < hi, a chunk of steps at a time
        hi = min(lo + _STEPS, n_next)
        (i0, i1), (j0, j1) = np.searchsorted(begun, [lo, hi]), np.searchsorted(over, [lo, hi])
        here = np.bincount(begun[i0:i1] - lo, minlength=hi - lo)
        here -= np.bincount(over[j0:j1] - lo, minlength=hi - lo)
        here[0] += i0 - j0                             # those begun before lo, not over by then
        np.cumsum(here, out=here)
        counts[lo:hi] = here                           # (a step's count is at most its batch)
    values[n_next:] = end[keys % n_steps] - end[keys // n_steps]
    counts[n_next:] = key_counts
    return values, counts


def quantiles(x: np.ndarray, qs: Sequence[float]) -> list[float]:
    """`np.quantile(x, q)` for each `q` in [0, 1] (its default, linear method), exactly, for an `x`
    without NaN (`np.partition` puts NaN last, so a quantile read among them would be neither numpy's
    nor the numbers': `summarize` leaves them out first): the order statistics around each found by
    one `np.partition`, for less than `np.quantile`'s own machinery costs. NaN for each `q` if `x` is
    empty (no value has a median)."""
    x = np.asarray(x)
    return _interpolated(len(x), qs, lambda ranks: np.partition(x, ranks)[ranks].tolist(), lambda: float(x.max()))


def counted_quantiles(values: np.ndarray, counts: np.ndarray, qs: Sequence[float]) -> list[float]:
    """`np.quantile(x, q)` for each `q` in [0, 1] (its default, linear method), exactly, for the `x`
    in which each value appears `counts` times (a value counted 0 times is not in it, even as its
    largest): the same two order statistics, the same interpolation. `values` hold no NaN and
    `counts` are integers >= 0, one per value, as `itl_counts` makes them."""
    values, counts = np.asarray(values), np.asarray(counts)
    n = int(counts.sum()) if len(counts) else 0
    return _interpolated(n, qs, lambda ranks: order_statistics(values, counts, ranks),
                         lambda: float(values[counts > 0].max()))


def _interpolated(n: int, qs: Sequence[float], order_statistics_at: Callable[[list[int]], list[float]],
                  largest: Callable[[], float]) -> list[float]:
    """numpy's linear quantiles of `n` values (NaN for none), from the values at the 0-based ranks
    around each virtual index `(n - 1) q` (`order_statistics_at(ranks)`) and the largest value."""
    if n == 0:
        return [math.nan for _ in qs]
    at = [(n - 1) * q for q in qs]                    # numpy's virtual index
    low = [math.floor(a) for a in at]
    ranks = sorted({r for a, i in zip(at, low) if a < n - 1 for r in (i, i + 1)})   # the two around each
    value = dict(zip(ranks, order_statistics_at(ranks))) if ranks else {}
    out = []
    for a, i in zip(at, low):
        if a >= n - 1:
            out.append(largest())
            continue
        x0, x1 = value[i], value[i + 1]
        gamma = a - i
        diff = x1 - x0
        out.append(x1 - diff * (1 - gamma) if gamma >= 0.5 else x0 + diff * gamma)
    return out


_BINS = 1 << 16


def order_statistics(values: np.ndarray, counts: np.ndarray, ranks: Sequence[int]) -> list[float]:
    """The values at 0-based `ranks` of the sorted multiset (each value `counts` times).

    A long list is not sorted whole (its argsort would take twice its memory): values go into
    `_BINS` bins of equal width, a monotone map, so every value of a bin lies between those of
    the bins around it; the counts per bin say which bin holds a rank, and only that bin is sorted."""
    if len(values) <= _BINS:
        return _sorted_ranks(values, counts, ranks, 0)
    lo, hi = float(values.min()), float(values.max())
    scale = (_BINS - 1) / (hi - lo) if hi > lo else 0.0
    if not math.isfinite(scale):                  # a spread of ~1e-304: one bin, sorted whole
        scale = 0.0
    bins = np.empty(len(values), dtype=np.int32)
    for a in range(0, len(values), _CHUNK):
        bins[a:a + _CHUNK] = (values[a:a + _CHUNK] - lo) * scale
    below = np.zeros(_BINS)                       # the counts per bin, a chunk at a time (as floats: exact
    for a in range(0, len(values), _CHUNK):       # integers < 2**53; bincount's weights are float64)
        below += np.bincount(bins[a:a + _CHUNK], weights=counts[a:a + _CHUNK], minlength=_BINS)
    np.cumsum(below, out=below)
    where = np.searchsorted(below, ranks, side="right")
    out = {}
    for b in set(where.tolist()):                     # one mask and one sort per bin that holds a rank
        in_b = [r for r, w in zip(ranks, where) if w == b]
        keep = bins == b
        out.update(zip(in_b, _sorted_ranks(values[keep], counts[keep], in_b, int(below[b - 1]) if b else 0)))
    return [out[r] for r in ranks]


def _sorted_ranks(values: np.ndarray, counts: np.ndarray, ranks: Sequence[int], before: int) -> list[float]:
    order = np.argsort(values)                        # ties are equal values: their order is immaterial
    cum = np.cumsum(counts[order]) + before
    return [float(values[order[k]]) for k in np.searchsorted(cum, ranks, side="right")]


def itl_figures(result: RunResult) -> tuple[float, float, float]:
    """(median, P99, max) of the inter-token gaps (NaN if no request has two tokens), from their
    counts per pair of steps (`itl_counts`), so that no float per token is built. Where the gaps are
    at most `_CHUNK` and average fewer than `_FEW_STEPS` a counted value (few requests a step), they
    are repeated from the counts and selected among directly, the cheaper way there; both ways give
    the same numbers exactly."""
    values, counts = itl_counts(result)
    n = int(counts.sum(dtype=np.int64))
    if n <= _CHUNK and _FEW_STEPS * len(values) > n:
        if not n:
            return math.nan, math.nan, math.nan
        itl = np.repeat(values, counts)
        return *quantiles(itl, (0.5, 0.99)), float(itl.max())
    median, p99, largest = counted_quantiles(values, counts, (0.5, 0.99, 1.0))
    return median, p99, largest


def steady_throughput(result: RunResult) -> tuple[float, float]:
    """(tokens/s, window s) up to the moment the last request produced its first token (§5.4);
    (NaN, 0.0) where there is no window: no request served, or every first token at the first arrival.
    The tokens out by then are counted from the token runs: `ended_before[x]` steps among the
    first `x` had ended, so a run from step `s`, `c` tokens long, made `ended_before[s + c] -
    ended_before[s]` of them."""
    if result.n == 0:
        return math.nan, 0.0
    t0 = float(result.arrival_s.min())
    t_end = float(result.first_token_s.max())       # the last request's first token
    if t_end <= t0:
        return math.nan, 0.0
    ended_before = np.zeros(result.n_steps + 1, dtype=np.int64)
    np.cumsum(result.step_end <= t_end, out=ended_before[1:])
    runs = result.token_runs
    made = int((ended_before[runs.start + runs.count] - ended_before[runs.start]).sum())
    return float(made) / (t_end - t0), t_end - t0


def memory_occupancy(result: RunResult) -> tuple[float, float]:
    """Time-weighted K/V slots (occupied, holding tokens) over the run, in tokens (§6.1: occupied is not
    holding).

    Each step's occupancy holds from its start until the next step starts (or it ends, if the
    engine then idles); with pipelining the steps overlap and this counts each moment once.
    """
    if result.n_steps == 0:
        return 0.0, 0.0
    span = float(result.last_token_s.max() - result.arrival_s.min())
    if span <= 0:
        return math.nan, math.nan
    start, end, n = result.step_start, result.step_end, result.n_steps
    occupied = stored = 0.0
    for lo in range(0, n, _STEPS):                 # a bounded chunk of steps at a time
        hi = min(lo + _STEPS, n)
        nxt = start[lo + 1:hi + 1] if hi < n else np.append(start[lo + 1:], end[-1])
        dur = np.minimum(end[lo:hi], nxt)
        dur -= start[lo:hi]
        np.maximum(dur, 0.0, out=dur)
        occupied += float((result.step_reserved[lo:hi] * dur).sum())
        stored += float((result.step_used[lo:hi] * dur).sum())
    return occupied / span, stored / span


def check_slo(slo_ttft_s: float, slo_tpot_s: float) -> None:
    """An SLO is two numbers of seconds > 0 (inf: no bound on that side)."""
    check_real("slo_ttft_s", slo_ttft_s, 0.0, lo_open=True, allow_inf=True, unit="seconds")
    check_real("slo_tpot_s", slo_tpot_s, 0.0, lo_open=True, allow_inf=True, unit="seconds")


def summarize(result: RunResult, slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.05) -> Metrics:
    """All the figures of a run against one SLO.

    Raises ValueError if the run served no request: with every request rejected (the engine's
    `on_invalid="reject"`) there is no latency or throughput to report, and the message says how
    many were rejected and why the first was; `result.rejected` keeps every reason.
    """
    check_instance("result", result, RunResult)
    check_slo(slo_ttft_s, slo_tpot_s)
    if result.n == 0:
        if result.rejected:
            raise ValueError(f"all {len(result.rejected)} requests were rejected: {result.rejected[0].why}")
        raise ValueError("the run served no requests: nothing to summarize")
    pr = per_request(result)
    (ttft_median, ttft_p99), (tpot_median, tpot_p99), (e2e_median, e2e_p99) = \
        (_median_p99(pr[k]) for k in ("ttft", "tpot", "e2e"))
    itl_median, itl_p99, itl_max = itl_figures(result)
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
        ttft_mean_s=_mean(pr["ttft"]), ttft_median_s=ttft_median, ttft_p99_s=ttft_p99,
        ttft_max_s=float(pr["ttft"].max()),
        tpot_mean_s=_mean(pr["tpot"]), tpot_median_s=tpot_median, tpot_p99_s=tpot_p99,
        itl_median_s=itl_median, itl_p99_s=itl_p99, itl_max_s=itl_max,
        e2e_median_s=e2e_median, e2e_p99_s=e2e_p99,
        norm_latency_median_s=_median(pr["norm_latency"]), norm_latency_mean_s=_mean(pr["norm_latency"]),
        slo_ttft_s=float(slo_ttft_s), slo_tpot_s=float(slo_tpot_s),
        ttft_attainment=float(ok_ttft.mean()), tpot_attainment=float(ok_tpot.mean()),
        slo_attainment=float((ok_ttft & ok_tpot).mean()),
        slo_attainment_submitted=float((ok_ttft & ok_tpot).sum()) / (result.n + len(result.rejected)),
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
    """The largest rate found with attainment >= target, and how it was found: every (rate,
    attainment) evaluated, in order, and a note (an endpoint reached, or a monotonicity warning)."""

    rate: float
    target: float
    rel_tol: float
    lo: float
    hi: float
    evaluations: list[tuple[float, float]] = field(default_factory=list)
    note: str = ""
    attainment: str = "as given"   # which attainment was bisected on, e.g. "slo_attainment_submitted"


MIN_REL_TOL = 1e-9   # a finer tolerance than floats can bisect to (1 + rel_tol == 1 below ~1e-16) never ends


def goodput_search(attainment_at: Callable[[float], float], target: float = 0.9, lo: float = 0.01,
                   hi: float = 256.0, rel_tol: float = 0.01,
                   probes: Sequence[float] = (0.5, 0.8, 1.25)) -> Goodput:
    """Geometric bisection for the largest rate in [lo, hi] whose attainment is >= `target` (goodput, §5.3).

    Returns a rate that met the target, within a factor `1 + rel_tol` of one that did not.
    `rate` is 0 if even `lo` misses the target, and `hi` if `hi` meets it.

    Bisection assumes attainment falls as the rate rises, and its own evaluations can never
    contradict that (every rate it tries lies between the highest pass and the lowest miss so far).
    So after it, the rates `rate x probes` inside [lo, hi] are evaluated too (default: half, 80%
    and 125% of the answer; `probes=()` skips them), and if any evaluated rate missed the target
    while a higher one met it, `note` carries a warning: the answer met the target but need not be
    the largest rate that does, nor every lower rate meet it.

    Which attainment: whatever `attainment_at` returns. `api.goodput` passes
    `Metrics.slo_attainment_submitted`, over the submitted requests, so that refusals count as misses
    (and sets `Goodput.attainment` to say so); where nothing is rejected it equals `slo_attainment`.
    """
    target = check_real("target", target, 0, 1, lo_open=True)
    lo = check_real("lo", lo, 0, lo_open=True, unit="requests per second")
    hi = check_real("hi", hi, 0, lo_open=True, unit="requests per second")
    if not lo < hi:
        raise ValueError(f"need lo < hi, got lo={lo!r}, hi={hi!r}")
    rel_tol = check_real("rel_tol", rel_tol, MIN_REL_TOL, 1, hi_open=True)
    check_callable("attainment_at", attainment_at, "(rate) -> the share of requests meeting the SLO")
    if isinstance(probes, (str, bytes)) or not isinstance(probes, Iterable):
        raise ValueError(f"probes must be a list of factors of the answer (numbers > 0), got {brief(probes)}")
    probes = [check_real(f"probes[{i}]", f, 0, lo_open=True) for i, f in enumerate(probes)]
    evals: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        try:
            got = attainment_at(rate)
        except Exception as e:    # the caller's own error, raised as it is, with the rate that raised it
            e.add_note(f"(raised by attainment_at({rate!r}) in goodput_search)")
            raise
        a = check_real(f"attainment_at({rate!r}) (a share of requests)", got, 0, 1)
        evals.append((rate, a))
        return a >= target

    if ok(hi):
        rate, note = hi, f"meets the target at the upper bound {hi}"
    elif not ok(lo):
        rate, note = 0.0, f"misses the target at the lower bound {lo}"
    else:
        a, b = lo, hi
        while b / a > 1 + rel_tol:
            # (bounds near the ends of the float range: a * b overflows, or underflows past the normal floats)
            ab = a * b
            mid = math.sqrt(ab) if sys.float_info.min <= ab < math.inf else math.sqrt(a) * math.sqrt(b)
            if ok(mid):
                a = mid
            else:
                b = mid
        rate, note = a, ""
    tried = {r for r, _ in evals}
    for f in probes:
        r = rate * f
        if lo <= r <= hi and r not in tried:
            ok(r)
            tried.add(r)
    warning = _monotonicity_warning(evals, target)
    note = "; ".join(x for x in (note, warning) if x)
    return Goodput(rate, target, rel_tol, lo, hi, evals, note)


def _monotonicity_warning(evals: list[tuple[float, float]], target: float) -> str:
    """A warning if some evaluated rate missed the target while a higher one met it, else ''. It
    names the widest such pair: the lowest rate that missed, and the highest that met above it."""
    missed = [(r, a) for r, a in evals if a < target]
    met = [(r, a) for r, a in evals if a >= target]
    bad = [(m, p) for m in missed for p in met if p[0] > m[0]]
    if not bad:
        return ""
    (r_miss, a_miss), (r_met, a_met) = min(bad, key=lambda mp: (mp[0][0], -mp[1][0]))
    return (f"warning: attainment is not monotone in the rate: {r_miss:.4g} req/s missed the target "
            f"({a_miss:.3f} < {target:g}) while {r_met:.4g} req/s met it ({a_met:.3f}); {len(bad)} such "
            f"pair(s) among the evaluations. The bisection assumes attainment falls as the rate rises, so "
            f"the rate found met the target but may not be the largest that does.")
