"""Code 04, part 2: the scheduling knobs of continuous batching on the paper H100 (lecture §6.3–§6.4, ex. 5, 9).

The lecture's code 04 demos 1–2 and exercise 3 are `04_knobs.py`; this script runs the rest, so its
`--demos` numbers are not the lecture's: each demo is named after the lecture's, and its table says
which `--demos` number prints it.
--demos 1, lecture demo 3: FCFS vs shortest-predicted-first at 40 req/s, max_bs 64: oracle predictor
        and noisy ones (prediction = true x e^eps, eps ~ N(0, sigma^2), sigma 0.5 and 1); the figures
        set beside the lecture's are also given over --seeds N (median and range).
--demos 2, exercise 5: max_bs 256 at 40 req/s and at the same share of our goodput: FCFS vs shortest-first.
--demos 3, lecture demo 4: prefill insertion `mixed` (Orca) vs `prefill_first` (early vLLM) at max_bs 256.
--demos 4, exercise 9: chunked prefill (Sarathi-Serve) with a per-step token budget of 512 or 2048.
docs/experiments/04-scheduling.md says what the figures mean.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

from orca_torch.lab import plots
from orca_torch.lab.metrics import inter_token_latencies, per_request
from orca_torch.lab.report import (Demo, PaperGPU, Report, load_setup, ms, over_seeds, pct, queued, run_experiment,
    same_load, step_figures)

N = 600
BUDGETS = (512, 2048)   # Sarathi-Serve's strict and relaxed budgets (docs/experiments/04-scheduling.md: why these)
ORDERS = {"fcfs": ("FCFS", dict(order="fcfs")),      # predictor_sigma: the noise of the predicted lengths (0: oracle)
          "spf_oracle": ("shortest-first (oracle)", dict(order="spf", predictor_sigma=0.0)),
          "spf_sigma_0.5": ("shortest-first (sigma 0.5)", dict(order="spf", predictor_sigma=0.5)),
          "spf_sigma_1": ("shortest-first (sigma 1)", dict(order="spf", predictor_sigma=1.0))}
COMPARED = ("fcfs", "spf_oracle")   # the orders the lecture's demo 3 sets side by side
FIGURES = {"ttft_median_s": "TTFT median (s)", "slo_attainment": "SLO attainment", "ttft_max_s": "TTFT max (s)"}


def paper(args: argparse.Namespace) -> PaperGPU:
    return PaperGPU.from_args(args, slo=(1.0, 0.05))


def setup(args: argparse.Namespace, rep: Report) -> None:
    load_setup(args, rep, paper(args), N, long_context_slo=(2.0, 0.05))


def order_run(gpu: PaperGPU, key: str, rate: float, bs: int, seed: int):
    """Chat at `rate` through Orca (oracle reservation) with `max_bs` `bs`, the queue in ORDERS[key]'s order."""
    return gpu.run("chat", rate, N, "orca-oracle", seed, max_bs=bs, **ORDERS[key][1])


def compared_orders(figures: dict[str, dict]) -> dict[str, float]:
    """The figures set beside the lecture's, of each order in COMPARED (`figures` by order), named "figure, order"."""
    return {f"{k}, {o}": figures[o][k] for o in COMPARED for k in FIGURES}


def demo3(args: argparse.Namespace, rep: Report) -> None:
    rate, bs, gpu = 40, 64, paper(args)
    out, rows, ttft = {}, [], {}
    for key, (label, kw) in ORDERS.items():
        res = order_run(gpu, key, rate, bs, args.seed)
        f = out[key] = {**gpu.figures(res), "n_queued": queued(res)}
        ttft[label] = per_request(res)["ttft"]
        rows.append([label, round(f["ttft_median_s"], 2), round(f["ttft_p99_s"], 2), round(f["ttft_max_s"], 2),
                     pct(f["slo_attainment"]), f["n_queued"]])
    rep.put("scheduling_order", out)
    rep.section("scheduling_order", f"Lecture demo 3 ({flag(demo3)}): FCFS vs shortest-predicted-first, chat at "
                f"{rate} req/s, max_bs {bs}, oracle reservation", rows,
                ["queue order", "TTFT med s", "TTFT P99 s", "TTFT max s", "SLO %", "queued"],
                note="SLO: TTFT <= 1 s and TPOT <= 50 ms. queued: requests not admitted at the first step after "
                     "they arrived.")
    fcfs, spf = out["fcfs"], out["spf_oracle"]
    rep.compare("scheduling_order_lecture_vs_project", "Lecture demo 3: its figures beside ours", {
        **{f"{k}, FCFS -> shortest-first (oracle)": (lec, [fcfs[k], spf[k]], f"{fcfs[k]:.2f} -> {spf[k]:.2f}")
           for k, lec in (("ttft_median_s", "3.4 -> 0.1"), ("slo_attainment", "0.23 -> 0.74"))},
        "TTFT max gets worse (starvation)": (True, spf["ttft_max_s"] > fcfs["ttft_max_s"])}, note="Lecture §6.3.",
        labels={f"{k}, FCFS -> shortest-first (oracle)": f"{FIGURES[k]}, FCFS -> shortest-first (oracle)"
                for k in ("ttft_median_s", "slo_attainment")})
    over_seeds(args, rep, "scheduling_order_over_seeds", "Lecture demo 3: the compared figures", compared_orders(out),
               lambda seed: compared_orders({o: gpu.figures(order_run(gpu, o, rate, bs, seed)) for o in COMPARED}),
               labels={f"{k}, {o}": f"{words}, {ORDERS[o][0]}" for o in COMPARED for k, words in FIGURES.items()})
    rep.plot("04_ttft_by_order", plots.distributions, {k: ttft[k] for k in ("FCFS", "shortest-first (oracle)")},
             "TTFT (s)", f"Code 04 demo 3: chat at {rate} req/s, max_bs {bs}, {gpu.title}: TTFT, FCFS vs "
             "shortest-first")


def exercise5(args: argparse.Namespace, rep: Report) -> None:
    gpu, good = paper(args), rep.results["setup"]["orca_oracle_chat_goodput_req_s"]
    out, rows, orders = {}, [], dict(zip(("fcfs", "spf"), COMPARED))    # JSON name -> ORDERS key
    for rate in (40, same_load(40, good)):
        runs = {o: order_run(gpu, key, rate, 256, args.seed) for o, key in orders.items()}
        d = {o: {**gpu.figures(r), "n_queued": queued(r)} for o, r in runs.items()}
        d["identical_token_times"] = bool(np.array_equal(runs["fcfs"].token_times, runs["spf"].token_times))
        out[str(rate)] = d
        rows += [[rate, ORDERS[key][0], ms(d[o]["ttft_mean_s"]), ms(d[o]["ttft_p99_s"]), pct(d[o]["slo_attainment"]),
                  d[o]["max_batch"], d[o]["n_queued"], d["identical_token_times"]] for o, key in orders.items()]
    rep.put("order_at_max_bs_256", out)
    rep.section("order_at_max_bs_256", f"Exercise 5 ({flag(exercise5)}): FCFS vs shortest-first (oracle) at max_bs 256, "
                "chat", rows,
                ["req/s", "order", "TTFT mean ms", "TTFT P99 ms", "SLO %", "max batch", "queued", "same token times"],
                note=f"Lecture (exercise 5's answer) at 40 req/s: identical (TTFT mean 31.8 ms, P99 115.3 ms, at most 169 running). "
                     f"{same_load(40, good)} req/s = 40 x {good:.1f}/63.24. 'queued' = not admitted at the first step "
                     f"after arriving.")


def mode_words(r: dict) -> str:
    """How the tables name a run's prefill insertion: mixed, prefill-first or chunked with its token budget."""
    return f"chunked {r['token_budget']}" if r.get("token_budget") else r["prefill"].replace("_", "-")


def insertion_runs(args: argparse.Namespace, rep: Report) -> tuple[list[dict], dict]:
    """Lecture demo 4's runs: (figures per rate and mode, ITLs at the highest rate for the plot)."""
    rates, gpu = ([8, 48] if args.quick else [8, 16, 24, 32, 48]), paper(args)
    out, itl = [], {}
    for rate in rates:
        for mode in ("mixed", "prefill_first"):
            res = gpu.run("chat", rate, N, "orca-oracle", args.seed, max_bs=256, prefill=mode)
            out.append({"prefill": mode, "rate_req_s": rate, **gpu.figures(res), **step_figures(res)})
            if rate == rates[-1] and rep.plotting:
                itl[mode_words({"prefill": mode})] = inter_token_latencies(res)
    return out, itl


def rate_words(values: list) -> str:
    """`[8, 48]` as "8 and 48 req/s" for a note; none as "no rate"."""
    words = [f"{v:g}" for v in values]
    return f"{' and '.join([', '.join(words[:-1]), words[-1]] if len(words) > 1 else words)} req/s" if words else "no rate"


def demo4(args: argparse.Namespace, rep: Report) -> None:
    out, _ = insertion_runs(args, rep)
    rep.put("prefill_insertion", out)
    rates = sorted({r["rate_req_s"] for r in out})
    by = {(r["prefill"], r["rate_req_s"]): r for r in out}
    worse = {k: [rate for rate in rates if by["prefill_first", rate][k] > by["mixed", rate][k]]
             for k in ("itl_p99_s", "itl_max_s")}
    rep.put("prefill_first_worse_at_rates", worse)
    rep.section("prefill_insertion", f"Lecture demo 4 ({flag(demo4)}): prefill insertion, chat, max_bs 256, oracle "
                "reservation",
                [[r["rate_req_s"], mode_words(r), ms(r["ttft_median_s"]), round(r["ttft_p99_s"], 2), ms(r["itl_p99_s"]),
                  ms(r["itl_max_s"], 0), round(r["throughput_tok_s"]), pct(r["slo_attainment"])] for r in out],
                ["req/s", "prefill", "TTFT med ms", "TTFT P99 s", "ITL P99 ms", "ITL max ms", "tok/s", "SLO %"],
                note=f"Lecture §6.4: mixed ITL max ~90 ms (131 ms at 48 req/s). prefill-first has the worse ITL P99 at "
                     f"{rate_words(worse['itl_p99_s'])} and the worse ITL max at {rate_words(worse['itl_max_s'])}.")


def exercise9(args: argparse.Namespace, rep: Report) -> None:
    insertion_out, itl = insertion_runs(args, rep) if rep.plotting or "prefill_insertion" not in rep.results \
        else (rep.results["prefill_insertion"], {})
    gpu, rates = paper(args), sorted({r["rate_req_s"] for r in insertion_out})
    out = [{**r, "token_budget": None} for r in insertion_out]
    for rate in rates:
        for b in BUDGETS:
            traced = rep.trace_path is not None and rate == rates[-1] and b == BUDGETS[0]
            res = gpu.run("chat", rate, N, "orca-oracle", args.seed, max_bs=256, max_num_batched_tokens=b,
                          chunked_prefill=True, trace=traced)   # (its works: the trace counts every chunk)
            out.append({"prefill": "chunked", "token_budget": b, "rate_req_s": rate,
                        **gpu.figures(res), **step_figures(res)})
            if rate == rates[-1]:
                itl[f"chunked {b}"] = inter_token_latencies(res) if rep.plotting else None
                if traced:
                    rep.trace(res)
    rep.put("chunked_prefill", out)
    rows = [[r["rate_req_s"], mode_words(r),
             ms(r["ttft_median_s"]), round(r["ttft_p99_s"], 2), ms(r["itl_p99_s"]), ms(r["itl_max_s"]),
             ms(r["tpot_median_s"]), round(r["throughput_tok_s"]), pct(r["slo_attainment"]), r["max_step_tokens"]]
            for rate in rates for r in out if r["rate_req_s"] == rate]
    by = {(r["prefill"], r["token_budget"], r["rate_req_s"]): r for r in out}
    bounded = {b: all(by["chunked", b, x]["itl_max_s"] < by["mixed", None, x]["itl_max_s"] for x in rates)
               for b in BUDGETS}
    rep.section("chunked_prefill", f"Exercise 9 ({flag(exercise9)}): chunked prefill (token budget per step) vs lecture "
                "demo 4's insertion modes, chat, max_bs 256, oracle reservation", rows,
                ["req/s", "prefill", "TTFT med ms", "TTFT P99 s", "ITL P99 ms", "ITL max ms", "TPOT med ms", "tok/s",
                 "SLO %", "max step tok"],
                note=f"Chunked = decodes first, then prompt chunks up to the budget. ITL max below mixed's at every "
                     f"rate: budget 512 {bounded[512]}, 2048 {bounded[2048]}. 'max step tok' = most new tokens in a "
                     "step.")
    rep.plot("04_itl_by_prefill", plots.distributions, itl, "inter-token latency (s)",
             f"Code 04 exercise 9: chat at {rates[-1]} req/s, max_bs 256, {gpu.title}: ITL by prefill insertion")


DEMOS = [demo3, exercise5, demo4, exercise9]   # --demos k runs DEMOS[k - 1]


def flag(demo: Demo) -> str:
    """How a table names the `--demos` number that prints it (the lecture's numbers are not the script's)."""
    return f"--demos {DEMOS.index(demo) + 1}"


def main(argv: list[str] | None = None) -> dict:
    return run_experiment(__doc__, DEMOS, argv=argv,
                          setup=setup, flags=("plot", "trace", "cost_model", "seeds"), trace_from=exercise9,
                          seeds_from=(demo3,), plots_from=(demo3, exercise9))


if __name__ == "__main__":
    main()
