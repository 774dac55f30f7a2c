"""Code 01: Clipper's adaptive batching (lecture §2, exercise 2), the lecture's figures beside ours.

Demo 1: latency profiles and the largest batch under a 20 ms SLO (three toy models).
Demo 2: fixed batch vs AIMD vs AIMD with a margin (and quantile regression) under interference.
Demo 3: delayed batching (0 vs 2 ms) for a high- and a low-fixed-cost model under Poisson load.
Demo 4: Llama-3-8B decode on the paper H100 as a latency profile (orca_torch.sim.hw_model).
Demos 2 and 3 draw noise and arrivals from the seed: their figures are also given over --seeds N (median, range).
The real torch models are `01_clipper_real.py`. The toy profiles are this project's own;
docs/experiments/01-clipper-batching.md says what the figures mean.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

from clipper import (AIMD, FixedBatch, NoisyLatency, QuantileRegression, fit_profile, get_toy_profile,
                     run_closed_loop, simulate_queue)
from orca_torch.lab import plots
from orca_torch.core.batch import SeqWork
from orca_torch.sim.hw_model import max_batch_within, step_cost
from orca_torch.lab.report import Report, over_seeds, run_experiment

SLO_MS = 20.0


def demo1(args: argparse.Namespace, rep: Report) -> None:
    rows, out = [], {}
    for name in ("linear-svm-like", "medium", "kernel-svm-like"):
        p = get_toy_profile(name)
        b = p.max_batch(SLO_MS)
        qps, qps1 = p.throughput_qps(b), p.throughput_qps(1)
        out[name] = {"a_ms": p.a_ms, "b_ms": p.b_ms, "max_batch": b, "throughput_qps": qps,
                     "unbatched_qps": qps1, "batching_gain": qps / qps1}
        rows.append([name, p.a_ms, p.b_ms, b, round(qps), round(qps1), f"{qps / qps1:.1f}x"])
    out["linear_over_kernel_max_batch"] = ratio = out["linear-svm-like"]["max_batch"] / out["kernel-svm-like"]["max_batch"]
    rep.put("demo1", out)
    rep.section("demo1", f"Demo 1: latency profiles a + b*B at a {SLO_MS:g} ms SLO (toy profiles are ours)", rows,
                ["model", "a ms", "b ms", "max batch", "qps at max", "qps at B=1", "batching gain"])
    rep.compare("demo1_lecture_vs_project", "Demo 1: the lecture's (and the Clipper paper's) figures beside ours", {
        "medium: largest batch": (34, out["medium"]["max_batch"]),
        "medium: qps at it": (1700, out["medium"]["throughput_qps"]),
        "linear / kernel SVM largest batch (paper)": ("241x", ratio, f"{ratio:.0f}x"),
        "kernel SVM qps (paper)": ("~200", out["kernel-svm-like"]["throughput_qps"])},
        note="Not matched: the paper's ~30,000 qps for the linear SVM (docs/experiments/01-clipper-batching.md says why).")


def picked(out: dict, paths: Sequence[str]) -> dict:
    """The figures at `paths` in a demo's `out` ("a / b" is out["a"]["b"]), named by their paths."""
    return {p: functools.reduce(dict.__getitem__, p.split(" / "), out) for p in paths}


DEMO2_SEEDED = {"fixed_batch": "fixed: batch (P99-tuned offline)", "fixed / violation_pct_calm": "fixed: miss % calm",
    **{f"{key} / {k}": f"{policy}: {words}" for key, policy in (("aimd", "AIMD"),
       ("quantile_regression", "quantile regression")) for k, words in (("violation_pct", "miss %"),
       ("violation_pct_calm", "miss % calm"), ("violation_pct_interference", "miss % during interference"),
       ("throughput_qps", "qps"))},
    "aimd / recovery_batches": "AIMD: batches to recover", "aimd_margin / violation_pct": "AIMD with a margin: miss %",
    "margin_throughput_cost_pct": "AIMD with a margin: throughput cost %"}
DEMO3_SEEDED = {f"{name} / delay_{d}ms / {k}": f"{name}, {f'{d} ms delay' if d else 'no delay'}: {words}"
                for name in ("high-fixed-cost", "low-fixed-cost")
                for k, words in (("busy_pct", "busy %"), ("mean_latency_ms", "mean latency (ms)")) for d in (0, 2)}


def demo2(args: argparse.Namespace, rep: Report) -> None:
    n, start, stop = 1000, 300, 500
    out, rows = policy_runs(args.seed, n, start, stop, rep)
    rep.put("demo2", out)
    rep.section("demo2", f"Demo 2: medium model, {n} batches, 5% noise, per-input cost x2 in batches {start}-{stop - 1}",
                rows, ["policy", "mean batch calm/interf.", "qps", "miss %", "miss % calm", "qps / on-time qps interf.",
                       "miss % interf.", "recovery", "climb back"],
                note=f"recovery: batches from batch {start} to the first within the SLO; climb back: batches from batch "
                     f"{stop} until one is 90% of the mean batch over batches {start - 100}-{start - 1}.")
    a, qr_over_aimd = out["aimd"], out["quantile_regression"]["throughput_qps"] / out["aimd"]["throughput_qps"]
    rep.compare("demo2_lecture_vs_project", "Demo 2: the lecture's figures beside ours", {
        "fixed: miss % during interference": ("every batch", out["fixed"]["violation_pct_interference"]),
        "AIMD: miss % calm (its arithmetic)": ("~20", a["violation_pct_calm"], f"{a['violation_pct_calm']:.1f} "
                                               f"({a['arithmetic_violation_pct_calm']:.0f})"),
        "AIMD: miss % during interference (ex. 2c)": ("35", a["violation_pct_interference"]),
        "AIMD: batches to recover": ("within tens", a["recovery_batches"]),
        "AIMD with a margin: miss %": ("almost none", out["aimd_margin"]["violation_pct"]),
        "AIMD with a margin: throughput cost %": ("~2", out["margin_throughput_cost_pct"]),
        "quantile regression: qps / AIMD's": ("about the same", qr_over_aimd, f"{qr_over_aimd:.2f}")},
        digits=3)
    over_seeds(args, rep, "demo2_over_seeds", "Demo 2: the figures that move with the seed", picked(out, DEMO2_SEEDED),
               lambda seed: picked(policy_runs(seed, n, start, stop)[0], DEMO2_SEEDED), digits=4, labels=DEMO2_SEEDED)


def policy_runs(seed: int, n: int, start: int, stop: int, rep: Report | None = None) -> tuple[dict, list]:
    """Demo 2's runs at one seed: their figures and table rows (`rep` given: the AIMD trace is plotted)."""
    noisy = NoisyLatency(get_toy_profile("medium"), 0.05)

    # offline tuning of the fixed batch: profile the calm machine, take the P99 line's largest batch
    rng = np.random.default_rng([seed, 0])
    xs = np.repeat(np.arange(1, 61), 40)
    tuned = fit_profile(xs, noisy.sample_ms(xs, rng), quantile=0.99).max_batch(SLO_MS)

    policies = {"fixed": (f"fixed (offline P99-tuned, B={tuned})", FixedBatch(tuned)),
                "aimd": ("AIMD (+1, x0.9)", AIMD(SLO_MS)),
                "aimd_margin": ("AIMD, margin 10% (target 18 ms)", AIMD(SLO_MS, margin=0.10)),
                "quantile_regression": ("quantile regression (P99 line)", QuantileRegression(SLO_MS))}
    rows, out = [], {}
    for key, (label, ctl) in policies.items():
        rng = np.random.default_rng([seed, 1])  # the same noise for every policy
        tr = run_closed_loop(ctl, lambda i, b: noisy.sample_ms(b, rng, 2.0 if start <= i < stop else 1.0), n)
        before = tr.mean_batch(start - 100, start)
        recover = tr.batches_until(lambda b, lat: lat <= SLO_MS, start, stop)
        climb = tr.batches_until(lambda b, lat: b >= 0.9 * before, stop)
        calm = np.r_[0:start, stop:n]
        r = {"mean_batch_calm": float(tr.batch_sizes[calm].mean()),
             "mean_batch_interference": tr.mean_batch(start, stop),
             "throughput_qps": tr.throughput_qps(), "violation_pct": 100 * tr.violation_rate(SLO_MS),
             "violation_pct_calm": 100 * float(np.mean(tr.latencies_ms[calm] > SLO_MS)),
             "throughput_interference_qps": tr.throughput_qps(start, stop),
             "goodput_interference_qps": tr.goodput_qps(SLO_MS, start, stop),
             "violation_pct_interference": 100 * tr.violation_rate(SLO_MS, start, stop),
             "recovery_batches": recover, "climb_back_batches": climb}
        if key == "aimd":  # at steady state increases balance decreases: one miss per 1 + (B - floor(0.9B))
            for phase, (a, b) in (("calm", (start - 150, start)), ("interference", (start + 50, stop))):
                missed = tr.batch_sizes[a:b][tr.latencies_ms[a:b] > SLO_MS]
                r[f"arithmetic_violation_pct_{phase}"] = 100 / (1 + float(np.mean(missed - np.floor(0.9 * missed))))
        out[key] = r
        if key == "aimd" and rep is not None:
            rep.plot("01_aimd_trace", plots.aimd_trace, tr.batch_sizes, tr.latencies_ms, SLO_MS, (start, stop),
                     f"Code 01 demo 2: AIMD on the medium toy model (3 + 0.5 B ms, 5% noise), per-input cost x2 "
                     f"in batches {start}-{stop - 1}")
        rows.append([label, f"{r['mean_batch_calm']:.1f} / {r['mean_batch_interference']:.1f}",
                     round(r["throughput_qps"]), f"{r['violation_pct']:.1f}", f"{r['violation_pct_calm']:.1f}",
                     f"{r['throughput_interference_qps']:.0f} / {r['goodput_interference_qps']:.0f}",
                     f"{r['violation_pct_interference']:.1f}",
                     "never" if recover is None else recover, "-" if climb is None else climb])
    margin_cost = 100 * (1 - out["aimd_margin"]["throughput_qps"] / out["aimd"]["throughput_qps"])
    return {**out, "margin_throughput_cost_pct": margin_cost, "fixed_batch": tuned}, rows


def demo3(args: argparse.Namespace, rep: Report) -> None:
    n = 10_000 if args.quick else 50_000
    out, rows = delay_runs(args.seed, n, rep)
    rep.put("demo3", out)
    rep.section("demo3", f"Demo 3: delayed batching at 80% of unbatched capacity, Poisson arrivals, {n} requests",
                rows, ["model", "profile ms", "load qps", "delay ms", "busy %", "mean batch", "mean lat ms",
                       "P99 lat ms", "qps"])
    busy = {(k, d): out[k][f"delay_{d}ms"]["busy_pct"] for k in ("high-fixed-cost", "low-fixed-cost") for d in (0, 2)}
    rep.compare("demo3_lecture_vs_project", "Demo 3: the lecture's figures beside ours", {
        "high fixed cost: busy % without delay": (64, busy["high-fixed-cost", 0]),
        "high fixed cost: busy % with 2 ms delay": (40, busy["high-fixed-cost", 2]),
        "low fixed cost: busy % 0 -> 2 ms": ("a few points lower", busy["low-fixed-cost", 2],
                                             f"{busy['low-fixed-cost', 0]:.0f} -> {busy['low-fixed-cost', 2]:.0f}")},
        digits=3)
    over_seeds(args, rep, "demo3_over_seeds", "Demo 3: the figures that move with the seed", picked(out, DEMO3_SEEDED),
               lambda seed: picked(delay_runs(seed, n, rep, f", seed {seed}")[0], DEMO3_SEEDED), labels=DEMO3_SEEDED,
               digits=4)


def delay_runs(seed: int, n: int, rep: Report, at: str = "") -> tuple[dict, list]:
    """Demo 3's runs at one seed (`at` names the seed in the progress lines): their figures and table rows."""
    rows, out = [], {}
    for name in ("high-fixed-cost", "low-fixed-cost"):
        p = get_toy_profile(name)
        rate = 0.8 * p.throughput_qps(1)
        out[name] = {"rate_qps": rate}
        for delay in (0, 2):
            with rep.progress(f"delayed batching: {name}, delay {delay} ms, {n:,} requests{at}"):
                r = simulate_queue(NoisyLatency(p, 0.05), rate, n, max_batch=p.max_batch(SLO_MS),
                                   delay_ms=float(delay), seed=seed)
            out[name][f"delay_{delay}ms"] = {
                "busy_pct": 100 * r.busy_fraction, "mean_batch": r.mean_batch,
                "mean_latency_ms": r.mean_latency_ms, "p99_latency_ms": r.latency_pct(99),
                "throughput_qps": r.throughput_qps}
            rows.append([name, f"{p.a_ms:g} + {p.b_ms:g}B", round(rate), delay, f"{100 * r.busy_fraction:.0f}",
                         f"{r.mean_batch:.2f}", f"{r.mean_latency_ms:.2f}", f"{r.latency_pct(99):.2f}",
                         round(r.throughput_qps)])
    return out, rows


def demo4(args: argparse.Namespace, rep: Report) -> None:
    def step_ms(ctx: int, batch: int) -> float:
        return 1000.0 * step_cost("llama-3-8b", "h100", [SeqWork(1, ctx - 1)] * batch).time_s

    rows, out = [], {}
    for ctx in (512, 8192):
        xs = np.array([1, 2, 4, 8, 16, 32, 64, 128])
        prof = fit_profile(xs, [step_ms(ctx, int(b)) for b in xs])
        b = max_batch_within("llama-3-8b", "h100", SLO_MS / 1e3, ctx)
        out[f"context_{ctx}"] = {"a_ms": prof.a_ms, "b_ms": prof.b_ms, "max_batch": b,
                                 "max_batch_from_line": prof.max_batch(SLO_MS), "step_ms_at_max": step_ms(ctx, b)}
        rows.append([ctx, f"{prof.a_ms:.2f}", f"{prof.b_ms * 1000:.1f}", b, prof.max_batch(SLO_MS)])
    rep.put("demo4", out)
    rep.section("demo4", "Demo 4: Llama-3-8B decode step on the paper H100 as a latency profile", rows,
                ["context", "a ms (weights)", "b us/seq (KV)", f"largest batch <= {SLO_MS:g} ms", "from the line"],
                note="a is reading the weights once; b is each sequence's K/V, so it grows with the context.")
    rep.compare("demo4_lecture_vs_project", "Demo 4: the lecture's figures beside ours", {
        f"largest batch within {SLO_MS:g} ms at context 512": ("500+", out["context_512"]["max_batch"]),
        f"largest batch within {SLO_MS:g} ms at context 8192": (34, out["context_8192"]["max_batch"])})


def main(argv: list[str] | None = None) -> dict:
    return run_experiment(__doc__, [demo1, demo2, demo3, demo4], argv=argv, flags=("plot", "seeds"),
                          seeds_from=(demo2, demo3), plots_from=(demo2,))


if __name__ == "__main__":
    main()
