"""Code 03, cost models (beyond the lecture): demo 2's goodput and demo 3's throughput under the roofline and the refined cost model.

The same runs as `03_continuous_batching.py` (Llama-3-8B on the paper H100, the chat workload,
static B = 128, Orca max and oracle), priced twice: by the lecture's roofline and by the refined
model (`hw_model.refined`: GEMM efficiency by shape, elementwise kernels, causal attention by tiles).
The figures vary with the seed, so the compared ones are also given over --seeds N (median and range).
docs/experiments/03-cost-models.md says what the difference means.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

from orca_torch.lab.report import CHAT_SYSTEMS, PaperGPU, Report, over_seeds, run_experiment  # noqa: E402

SYSTEMS = {k: CHAT_SYSTEMS[k] for k in ("static_b128", "orca_max", "orca_oracle")}
COST_MODELS = {"roofline": None, "refined": "refined"}


def priced(args: argparse.Namespace, seed: int, rep: Report) -> dict:
    """One seed's goodput (demo 2's search) and throughput (demo 3's 600 requests at 128 req/s) of each
    system under each cost model."""
    rel_tol, n, lo, hi = (0.3, 150, 0.05, 64.0) if args.quick else (0.01, 600, 0.01, 256.0)
    out, at = {}, "" if seed == args.seed else f", seed {seed}"
    for key, (label, system) in SYSTEMS.items():
        figs = out[key] = {}
        for name, cm in COST_MODELS.items():
            gpu = dataclasses.replace(PaperGPU(), cost_model=cm)
            g = gpu.goodput(n, seed, rel_tol, lo=lo, hi=hi, rep=rep, label=f"{label}, {name}{at}", **system)
            f = gpu.figures(gpu.run("chat", 128.0, 600, seed=seed, **system))
            figs[name] = {"goodput_req_s": g.rate, "throughput_tok_s": f["throughput_tok_s"],
                          "steady_throughput_tok_s": f["steady_throughput_tok_s"]}
    return out


COMPARED = {"goodput_req_s, roofline": "goodput req/s, roofline", "goodput_req_s, refined": "goodput req/s, refined",
            "goodput, refined vs roofline": "goodput, refined vs roofline",
            "throughput, refined vs roofline": "throughput, refined vs roofline"}
"""The compared figures: their name in the JSON (after the system's key) -> in the table (after the system's name)."""


def compared(out: dict) -> dict:
    """The figures docs/experiments/03-cost-models.md quotes, from one seed's runs: each system's goodput
    under both models, and what the refined model changes in goodput and overall throughput (`COMPARED`)."""
    figs = {}
    for key, f in out.items():
        r, d = f["roofline"], f["refined"]
        values = (r["goodput_req_s"], d["goodput_req_s"], d["goodput_req_s"] / r["goodput_req_s"] - 1,
                  d["throughput_tok_s"] / r["throughput_tok_s"] - 1)
        figs.update({f"{key}: {name}": v for name, v in zip(COMPARED, values)})
    return figs


def cost_models(args: argparse.Namespace, rep: Report) -> None:
    """Goodput with demo 2's search and overall / steady throughput of demo 3's 600 requests at 128 req/s,
    the compared figures also over --seeds N."""
    base, out, rows = PaperGPU(), priced(args, args.seed, rep), []
    for key, (label, _) in SYSTEMS.items():
        r, f = out[key]["roofline"], out[key]["refined"]
        rows.append([label, round(r["goodput_req_s"], 3), round(f["goodput_req_s"], 3), round(r["throughput_tok_s"]),
                     round(f["throughput_tok_s"]), f"{f['throughput_tok_s'] / r['throughput_tok_s'] - 1:+.0%}",
                     round(r["steady_throughput_tok_s"]), round(f["steady_throughput_tok_s"])])
    rep.put("cost_models", out)
    rep.section("cost_models", f"Demo 2's goodput and demo 3's throughput under both cost models ({base.title})",
                rows, ["system", "goodput req/s (roofline)", "goodput req/s (refined)", "overall tok/s (roofline)",
                       "overall tok/s (refined)", "overall, refined / roofline - 1", "steady tok/s (roofline)",
                       "steady tok/s (refined)"],
                note="The refined model charges what the roofline leaves out (GEMMs near the ridge point, "
                     "elementwise kernels, launch overhead) and skips masked attention tiles; its constants come "
                     "from an A100-80GB kernel profile and stand for the H100 until one of that card exists."
                     + (" --quick searches goodput to 30%, too coarse to tell the two apart." if args.quick else ""))
    over_seeds(args, rep, "cost_models_over_seeds", "The compared figures", compared(out),
               lambda seed: compared(priced(args, seed, rep)),
               aside="refined vs roofline: refined / roofline - 1; throughput: overall, 600 requests at 128 req/s",
               labels={f"{key}: {name}": f"{label}: {words}" for key, (label, _) in SYSTEMS.items()
                       for name, words in COMPARED.items()})


def main(argv: list[str] | None = None) -> dict:
    return run_experiment(__doc__, [cost_models], argv=argv, flags=("seeds",),
                          seeds_from=(cost_models,))


if __name__ == "__main__":
    main()
