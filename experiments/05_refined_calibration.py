"""Code 05, refined (beyond the lecture): the refined cost model calibrated on this CPU beside the roofline, on held-out steps and a real run.

Part 1  time the torch executor's step (`mini`, one thread) over `calibrate.refined_grid`; fit the
        refined model (`refined_fit.fit_refined`) and the roofline (`roofline_fit.fit`) on the same part
        of the grid; median |error| of each on the fitted steps and on held-out ones (batch sizes,
        contexts and prompt lengths no fitted step has).
Part 2  `05_sim_vs_real.py`'s workload through the same scheduler on the torch executor (real) and
        on the cost-model executor with each calibrated model (predicted).
The machine is shared: the real figures carry noise; rerun to see it.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

from orca_torch.model.accounting import torch_threads  # noqa: E402
from orca_torch.lab.calibrate import calibrate_refined  # noqa: E402
from orca_torch.lab.calibration.refined_fit import not_identified_note  # noqa: E402
from orca_torch.lab.calibration.roofline_fit import fit  # noqa: E402
from orca_torch.sim.executors import CostModelExecutor  # noqa: E402
from orca_torch.core.memory import slots_to_finish  # noqa: E402
from orca_torch.model.torch_executor import TorchExecutor
from orca_torch.model.orca_model import OrcaModel  # noqa: E402
from orca_torch.lab.report import Report, run_experiment  # noqa: E402

_spec = importlib.util.spec_from_file_location("sim_vs_real", Path(__file__).with_name("05_sim_vs_real.py"))
sim_vs_real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim_vs_real)  # its workload, scheduler setting and figures, not a copy of them


def body(args: argparse.Namespace, rep: Report) -> None:
    model = OrcaModel(args.model, seed=args.seed)
    refined, held = calibrate_refined(model, quick=args.quick, repeats=3 if args.quick else 5, seed=args.seed)
    roof = fit(refined.samples, model.spec)
    errs = {"roofline": {"fit": roof.median_abs_error(), "held_out": roof.median_abs_error(held)},
            "refined": {"fit": refined.median_abs_error(), "held_out": refined.median_abs_error(held)}}
    rep.put("median_abs_error", errs)
    loose = list(refined.not_identified)
    rep.put("calibration", {"n_fit": len(refined.samples), "n_held_out": len(held),
                            "refined_fitted": {k: getattr(refined.gpu.refined, k) for k in refined.free},
                            "not_identified": loose})
    rep.section("median_abs_error", f"Part 1: both cost models calibrated on this CPU ({model.spec.name}, "
                f"{args.threads} thread{'s' if args.threads > 1 else ''})",
                [[name, f"{e['fit']:.1%}", f"{e['held_out']:.1%}"] for name, e in errs.items()],
                ["cost model (calibrated)", f"{len(refined.samples)} fitted steps", f"{len(held)} held-out steps"],
                note="Median |predicted / measured - 1| per step; held-out steps have batch sizes, contexts and "
                     "prompt lengths that no fitted step has." + (f" Rates {not_identified_note(loose)}." if loose else ""))

    n, rate, scale = sim_vs_real.WORKLOADS["quick" if args.quick else "full"]
    reqs = sim_vs_real.workload(n, rate, scale, args.seed, model.spec.vocab)
    n_slots = sum(r.total_len for r in reqs)
    kv = model.new_kv(sum(map(slots_to_finish, reqs)))        # (n_slots: what the oracle reserves)
    figs = {"real": sim_vs_real._figures(sim_vs_real._run(TorchExecutor(model, kv), reqs, n_slots))}
    figs["roofline"] = sim_vs_real._figures(sim_vs_real._run(roof.executor(), reqs, n_slots))
    figs["refined"] = sim_vs_real._figures(sim_vs_real._run(
        CostModelExecutor(model.spec, refined.gpu, cost_model="refined"), reqs, n_slots))
    err = lambda side, k: figs[side][k] / figs["real"][k] - 1 if figs["real"][k] else math.nan  # noqa: E731
    rep.put("run", {**figs, "rel_error": {side: {k: err(side, k) for _, k in sim_vs_real.COMPARED}
                                          for side in ("roofline", "refined")}})
    rep.section("run", f"Part 2: {n} requests ({sim_vs_real.SYSTEM}, max_bs {sim_vs_real.MAX_BS}), real vs predicted",
                [[label, figs["real"][k], figs["roofline"][k], f"{err('roofline', k):+.0%}", figs["refined"][k],
                  f"{err('refined', k):+.0%}"] for label, k in sim_vs_real.COMPARED],
                ["figure", "real (torch)", "roofline (calibrated)", "error", "refined (calibrated)", "error"],
                floatfmt=".4g")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="mini", choices=("mini", "tiny"), help="torch preset (default mini)")


def main(argv: list[str] | None = None) -> dict:
    return run_experiment(__doc__, body, add_args, argv, flags=("threads",),
                          within=lambda args: torch_threads(args.threads))


if __name__ == "__main__":
    main()
