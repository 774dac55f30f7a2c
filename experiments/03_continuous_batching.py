"""Code 03: continuous (iteration-level) vs static (request-level) batching on the paper H100 (lecture §5.2–§5.4).

Demo 1: 600 chat requests over a sweep of arrival rates, SLO TTFT <= 1 s and TPOT <= 50 ms: static (B = 128),
        Orca reserving the max context (8192), Orca with oracle reservation. Demo 2: goodput (the largest rate
        with >= 90% SLO attainment) and the H100s for 100 req/s. Demo 3: overload at 128 req/s, overall vs
        steady throughput against the ideal bounds; exercise 8: the same with 3000 requests.
docs/experiments/03-continuous-batching.md says what the figures mean and why they differ from the lecture's.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

from orca_torch.lab import plots
from orca_torch.sim.bounds import ideal_decode_bound, prefill_alone_s, roofline_bound
from orca_torch.lab.report import (CHAT_ORCA_MAX_BS as ORCA_MAX_BS, CHAT_SYSTEMS as SYSTEMS, PaperGPU, Report,
    chat_lengths, ms, over_seeds, pct, run_experiment, workload_note)

SWEPT = ("static_b128", "orca_max", "orca_oracle")
CLIFF = {"orca_max": (16, 24, 32), "orca_oracle": (24, 32, 48)}   # rates where attainment falls off
LECTURE_GOODPUT = {"one_at_a_time": "~0.10 (like static)", "static_b128": 0.10, "orca_max": 20.34, "orca_oracle": 63.24}
LECTURE_GPUS = {"one_at_a_time": "~1000", "static_b128": 1000, "orca_max": 5, "orca_oracle": 2}


def simulate(args: argparse.Namespace, key: str, rate: float, n: int, seed: int):
    return PaperGPU.from_args(args).run("chat", rate, n, seed=seed, **SYSTEMS[key].options)


def setup(args: argparse.Namespace, rep: Report) -> None:
    gpu, lengths = PaperGPU.from_args(args), chat_lengths(600, args.seed)
    rep.put("workload", {"name": "chat (Azure LLM inference trace 2023, conversation)", **lengths["drawn"],
                         "whole_trace": lengths["whole_trace"], "model": gpu.model, "gpu": gpu.gpu,
                         "kv_slots": gpu.kv_slots, "slo_ttft_s": gpu.slo[0], "slo_tpot_s": gpu.slo[1],
                         "seed": args.seed})
    rep.text(f"{gpu.title} ({gpu.kv_slots:,} K/V slots). {workload_note(lengths)}")


def demo1(args: argparse.Namespace, rep: Report) -> None:
    rates = [1, 16, 32, 64] if args.quick else [1, 2, 4, 8, 16, 24, 32, 48, 64]
    n = 600
    gpu, out, rows = PaperGPU.from_args(args), [], []
    for rate in rates:
        for key in SWEPT:
            f = gpu.figures(simulate(args, key, rate, n, args.seed))
            out.append({"system": key, "rate_req_s": rate, **f})
            rows.append([rate, SYSTEMS[key].label, ms(f["ttft_median_s"]), round(f["ttft_p99_s"], 2),
                         ms(f["tpot_median_s"]), ms(f["itl_p99_s"]), round(f["throughput_tok_s"]),
                         pct(f["slo_attainment"]), round(f["mean_batch"], 1)])
    rep.put("rate_sweep", out)
    rep.section("rate_sweep", f"Demo 1: {n} chat requests, {gpu.title}, SLO TTFT <= 1 s and TPOT <= 50 ms", rows,
                ["req/s", "system", "TTFT med ms", "TTFT P99 s", "TPOT med ms", "ITL P99 ms", "tok/s", "SLO %",
                 "mean batch"],
                note="TTFT, TPOT: over requests; ITL: over all gaps between a request's tokens; tok/s: overall (all "
                     "tokens / first arrival to last token); SLO %: requests meeting both limits; mean batch: "
                     "sequences a step, averaged over steps (static's finished seats count until its batch ends).")
    at = {(r["system"], r["rate_req_s"]): r for r in out}
    lo, hi = rates[0], rates[-1]
    quoted = {  # JSON name: (system, figure, its name in the table, rate (None: its peak), the lecture's value)
        "static_ttft_median_s_at_1": ("static_b128", "ttft_median_s", "TTFT median (s)", 1, 1.6),
        "orca_ttft_median_s_at_1": ("orca_oracle", "ttft_median_s", "TTFT median (s)", 1, 0.012),
        "static_peak_throughput_tok_s": ("static_b128", "throughput_tok_s", "highest tok/s at any rate swept", None,
                                         "1,000-2,000"),
        "orca_max_slo_attainment_at_16": ("orca_max", "slo_attainment", "SLO attainment", 16, 1.0),
        "orca_max_throughput_tok_s_at_16": ("orca_max", "throughput_tok_s", "tok/s", 16, 3715),
        "orca_max_slo_attainment_at_32": ("orca_max", "slo_attainment", "SLO attainment", 32, 0.20),
        "orca_max_throughput_tok_s_at_32": ("orca_max", "throughput_tok_s", "tok/s", 32, 4516),
        "orca_oracle_slo_attainment_at_32": ("orca_oracle", "slo_attainment", "SLO attainment", 32, 1.0),
        f"orca_oracle_itl_p99_s_at_{lo}": ("orca_oracle", "itl_p99_s", "ITL P99 (s)", lo, 0.0065),
        f"orca_oracle_itl_p99_s_at_{hi}": ("orca_oracle", "itl_p99_s", "ITL P99 (s)", hi, 0.053)}
    peak = max(r["throughput_tok_s"] for r in out if r["system"] == "static_b128")
    rep.compare("rate_sweep_lecture_vs_project", "Demo 1: the lecture's figures beside ours",
                {k: (lecture, at[key, r][f] if r else peak) for k, (key, f, _, r, lecture) in quoted.items()},
                labels={k: f"{SYSTEMS[key].label}: {name}" + (f" at {r} req/s" if r else "")
                        for k, (key, _, name, r, _) in quoted.items()},
                note="Lecture §5.2 (TTFT at 1 req/s, static's ceiling, oracle at 32 req/s, ITL P99 6.5 -> 53 ms as "
                     "the load rises: ours at the lowest and highest rate swept); exercise 3's answer (Orca (max) at "
                     "16, 32 req/s).")
    cliff = [(k, r) for k, rs in CLIFF.items() for r in rs if r in rates]
    over_seeds(args, rep, "rate_sweep_over_seeds", "Demo 1: SLO attainment where it falls off,",
               {f"{k}_at_{r}": at[k, r]["slo_attainment"] for k, r in cliff},
               lambda seed: {f"{k}_at_{r}": gpu.metrics(simulate(args, k, r, n, seed)).slo_attainment
                             for k, r in cliff}, under="slo_attainment",
               labels={f"{k}_at_{r}": f"{SYSTEMS[k].label} at {r} req/s" for k, r in cliff})
    draw_sweep(args, rep)


def draw_sweep(args: argparse.Namespace, rep: Report) -> None:
    gpu = PaperGPU.from_args(args)
    rep.plot("03_rate_sweep", plots.rate_sweep, rep.results["rate_sweep"], {k: SYSTEMS[k].label for k in SWEPT},
             gpu.slo, f"Code 03: chat, {gpu.title}: the rate sweep", goodput=rep.results.get("goodput_req_s"),
             marks=[(0, 32, 20, "Orca (max) 20%"), (0, 20.34, 90, "Orca (max) goodput 20.3", -12),
                    (0, 63.24, 90, "Orca (oracle) goodput 63.2"), (1, 1, 1.6, "static 1.6 s"),
                    (1, 1, 0.012, "Orca 12 ms")])


def demo2(args: argparse.Namespace, rep: Report) -> None:
    rel_tol, n, lo, hi = (0.3, 150, 0.05, 64.0) if args.quick else (0.01, 600, 0.01, 256.0)
    gpu, target = PaperGPU.from_args(args), 0.9

    def goodput(key: str, seed: int):
        return gpu.goodput(n, seed, rel_tol, lo=lo, hi=hi, target=target, rep=rep,
                           label=f"{SYSTEMS[key].label}, seed {seed}", **SYSTEMS[key].options)

    good, gpus, search, rows, warnings = {}, {}, {}, [], []
    for key, (label, _) in SYSTEMS.items():
        g = goodput(key, args.seed)
        if "warning" in g.note:
            warnings.append(f"{label}: {g.note}")
        good[key], gpus[key] = g.rate, math.ceil(100 / g.rate) if g.rate > 0 else None
        search[key] = {"evaluations": [[r, a] for r, a in g.evaluations], "note": g.note}
        rows.append([label, round(g.rate, 3), gpus[key]])
    rep.put("goodput_req_s", good)
    rep.put("h100s_for_100_req_s", gpus)
    rep.put("goodput_search", {"target_attainment": target, "rel_tol": rel_tol, "range_req_s": [lo, hi],
                               "n_requests": n, "by_system": search})
    ratio = good["orca_oracle"] / good["static_b128"] if good["static_b128"] else math.inf
    rep.put("goodput_oracle_over_static", ratio)
    prompts = simulate(args, "orca_oracle", 8.0, 600, args.seed).prompt_len   # demo 1's 600 (any rate draws them)
    per_prefill = prefill_alone_s(gpu.model, gpu.gpu, prompts, gpu.pricing) / len(prompts)
    rep.put("prefill_alone_mean_s", per_prefill)
    rep.put("prefill_saturation_rate_req_s", 1 / per_prefill)
    rep.section("goodput_req_s", "Demo 2: goodput (largest rate with >= 90% SLO attainment) and H100s for 100 req/s",
                rows, ["system", "goodput req/s", "H100s for 100 req/s"],
                note=(f"Bisection over [{lo:g}, {hi:g}] req/s to {rel_tol:.0%}, {n} requests; H100s = ceil(100 / "
                      f"goodput) (exercise 7). Orca (oracle) / static = {ratio:.0f}x (lecture: 63.24 / 0.10 = 632x, "
                      f"exercise 7). One prompt takes {per_prefill * 1e3:.1f} ms to prefill alone (mean of demo 1's "
                      f"600): prefills alone saturate the GPU at {1 / per_prefill:.0f} req/s (lecture: ~88 = 600 "
                      f"prompts / 6.8 s of prefill, §5.4)."
                      + "".join(f"\n{w}" for w in warnings)))
    rep.compare("goodput_lecture_vs_project", "Demo 2: the lecture's figures beside ours", {
        **{f"goodput, {SYSTEMS[k].label} (req/s)": (LECTURE_GOODPUT[k], good[k]) for k in SYSTEMS},
        **{f"H100s for 100 req/s, {SYSTEMS[k].label}": (LECTURE_GPUS[k], gpus[k]) for k in SYSTEMS},
        "goodput, Orca (oracle) / static": ("632x", ratio, f"{ratio:.0f}x")}, digits=3,
        note="Lecture exercise 7's answer (goodput, H100s), §5.3 (one-at-a-time 'as bad as static').")
    over_seeds(args, rep, "goodput_over_seeds", "Demo 2: goodput (req/s)", good,
               lambda seed: {key: goodput(key, seed).rate for key in SYSTEMS}, under="goodput_req_s",
               name_header="system", labels={k: label for k, (label, _) in SYSTEMS.items()})
    if "rate_sweep" in rep.results:
        draw_sweep(args, rep)


def demo3(args: argparse.Namespace, rep: Report) -> None:
    rate, gpu = 128.0, PaperGPU.from_args(args)
    lectures = {600: {"static_b128": (1495, 1590), "orca_oracle": (7336, 10354)},
                3000: {"static_b128": (1412, 1418), "orca_oracle": (10363, 11850)}}
    for n, keys in ((600, list(SYSTEMS)), (3000, ["static_b128", "orca_oracle"])):
        with rep.progress(f"overload: {n} requests at {rate:g} req/s, {len(keys)} systems", len(keys)) as bar:
            results = {k: simulate(args, k, rate, n, args.seed) for k in bar.each(keys)}
        p, o = results[keys[-1]].prompt_len, results[keys[-1]].output_len
        ideal = ideal_decode_bound(gpu.model, gpu.gpu, p, o, cost_model=gpu.pricing)
        ideal_bs = ideal_decode_bound(gpu.model, gpu.gpu, p, o, ORCA_MAX_BS, gpu.pricing)
        roof = roofline_bound(gpu.model, gpu.gpu, p, o, ideal, gpu.pricing)
        out, rows, big = {}, [], n == 3000
        for key, res in results.items():
            f = gpu.figures(res)
            overall, steady, dur = f["throughput_tok_s"], f["steady_throughput_tok_s"], res.step_end - res.step_start
            out[key] = {"throughput_tok_s": overall, "steady_throughput_tok_s": steady,
                        "steady_over_overall": steady / overall, "steady_fraction_of_ideal": steady / ideal["tok_s"],
                        "overall_fraction_of_ideal": overall / ideal["tok_s"],
                        f"steady_fraction_of_ideal_max_bs_{ORCA_MAX_BS}": steady / ideal_bs["tok_s"],
                        f"overall_fraction_of_ideal_max_bs_{ORCA_MAX_BS}": overall / ideal_bs["tok_s"],
                        "steady_fraction_of_roofline_bound": steady / roof["tok_s"], "busy_gpu_s": float(dur.sum()),
                        "prefill_alone_gpu_s": prefill_alone_s(gpu.model, gpu.gpu, res.prompt_len, gpu.pricing),
                        "longest_step_s": float(dur.max()), "longest_step_n_seqs": int(res.step_n_seqs[np.argmax(dur)])}
            rows.append([SYSTEMS[key].label, round(overall), round(steady), f"{steady / overall - 1:+.0%}",
                         f"{steady / ideal['tok_s']:.0%}", f"{steady / ideal_bs['tok_s']:.0%}",
                         f"{steady / roof['tok_s']:.0%}"])
        out.update({"ideal_decode_bound": ideal, f"ideal_decode_bound_max_bs_{ORCA_MAX_BS}": ideal_bs,
                    "roofline_bound_with_prefill": roof})
        key = f"overload_{3000 if big else 600}_requests"
        rep.put(key, out)
        o3 = out["orca_oracle"]
        rep.section(key, f"{'Exercise 8' if big else 'Demo 3'}: overload at {rate:g} req/s, {n} requests", rows,
                    ["system", "overall tok/s", "steady tok/s", "steady / overall - 1", "steady / ideal",
                     f"steady / ideal at max_bs {ORCA_MAX_BS}", "steady / bound w. prefill"],
                    note=(f"Steady: tokens out until the last request's first token, over that window. Ideal decode "
                          f"bound (lecture, exercise 8: 12,656 tok/s): {ideal['kv_slots']:,} slots // mean context "
                          f"{ideal['context_tokens']} = {ideal['batch']} sequences, {ideal['tok_s']:,.0f} tok/s "
                          f"({ideal_bs['tok_s']:,.0f} at max_bs {ORCA_MAX_BS}); with prefill: {roof['tok_s']:,.0f}. "
                          f"Orca (oracle): prefills alone {o3['prefill_alone_gpu_s']:.1f} s of "
                          f"{o3['busy_gpu_s']:.1f} s busy (lecture §5.4: 6.8 of 23.5 s); its longest step, "
                          f"{o3['longest_step_s']:.1f} s, holds {o3['longest_step_n_seqs']} sequences (queued prompts "
                          "prefilled and the decodes beside them)."))
        rep.compare(f"{key}_lecture_vs_project", f"{'Exercise 8' if big else 'Demo 3'}: the lecture's figures beside "
                    "ours", {f"{SYSTEMS[k].label}: overall / steady tok/s": (
                        f"{lo:,} / {ls:,}", [out[k]["throughput_tok_s"], out[k]["steady_throughput_tok_s"]],
                        f"{out[k]['throughput_tok_s']:,.0f} / {out[k]['steady_throughput_tok_s']:,.0f}")
                        for k, (lo, ls) in lectures[n].items()}, note="Lecture: exercise 8's answer.")
        if not big:
            rep.trace(results["orca_oracle"])
            rep.plot("03_overload_throughput", plots.throughput_over_time,
                     {SYSTEMS[k].label: results[k] for k in ("static_b128", "orca_oracle")},
                     f"Code 03 demo 3: {n} chat requests at {rate:g} req/s, {gpu.title}")


def main(argv: list[str] | None = None) -> dict:
    return run_experiment(__doc__, [demo1, demo2, demo3], argv=argv, setup=setup,
                          flags=("plot", "trace", "seeds", "cost_model"), trace_from=demo3, seeds_from=(demo1, demo2),
                          plots_from=(demo1, demo3))


if __name__ == "__main__":
    main()
