"""The refined cost model: its A100 figures beside the roofline, and how well it predicts held-out steps on this CPU.

Part 1 (no measurement): Llama-3-8B on the paper A100-80GB at context 1,400, decode batches 1 / 16 /
64 / 128 and prefills of 1,155 and 4,096 tokens, under the roofline and the refined model, with the
deviation of the roofline from each. The published kernel profile's deviations are printed beside
them as the reference: this machine has no A100, so they are not measured here.

Part 2 (measured): the torch executor's step (`forward_batch` + argmax, on `--threads`: one unless
given) on the `mini` model for `calibrate.refined_grid`'s steps; both cost models are fitted on the
fit part (the roofline by `roofline_fit.fit`, the refined one by `refined_fit.fit_refined`) and
judged on held-out steps whose batch sizes, contexts and prompt lengths were not fitted. The figure is the median
|error| on the held-out steps. The machine is shared: rerun to see the noise.

    python benchmarks/bench_calibration.py [--quick] [--repeats 5] [--out cpu_profile.json] [--json]
    python benchmarks/bench_calibration.py --no-measure [--json]     # Part 1 only
"""
from __future__ import annotations

import sys
from pathlib import Path

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

from orca_torch.model.accounting import torch_threads  # noqa: E402
from orca_torch.core.batch import SeqWork, StepTotals  # noqa: E402
from orca_torch.lab.calibrate import calibrate_refined, refined_grid  # noqa: E402
from orca_torch.lab.calibration.measure import check_repeats  # noqa: E402
from orca_torch.lab.calibration.roofline_fit import fit  # noqa: E402
from orca_torch.lab.calibration.samples import IDENTIFIED_SHIFT  # noqa: E402
from orca_torch.lab.cli_args import count_arg, json_out_arg, threads_arg  # noqa: E402
from orca_torch.sim.hw_model import decode_totals, pricer  # noqa: E402
from orca_torch.lab.report import machine, machine_line, run_experiment  # noqa: E402

# The published Llama-3-8B / A100-80GB kernel profile: roofline time vs profiled, at context 1,400.
PROFILED_DEVIATION = {"decode 1": -0.03, "decode 16": -0.06, "decode 64": -0.10, "decode 128": -0.15,
                      "prefill 1155": -0.16, "prefill 4096": 0.0}


def a100_steps() -> dict[str, StepTotals]:
    steps = {f"decode {b}": decode_totals(b, 1400) for b in (1, 16, 64, 128)}
    steps.update({f"prefill {n}": StepTotals.of([SeqWork(n)]) for n in (1155, 4096)})
    return steps


def paper_gpu(args, rep) -> None:
    ro, re = pricer("llama-3-8b", "a100-80gb"), pricer("llama-3-8b", "a100-80gb", cost_model="refined")
    rows, figs = [], {}
    for name, t in a100_steps().items():
        a, b = ro.time(t), re.time(t)
        rows.append([name, a * 1e3, b * 1e3, f"{a / b - 1:+.1%}", f"{PROFILED_DEVIATION[name]:+.0%}"])
        figs[name] = {"roofline_ms": a * 1e3, "refined_ms": b * 1e3, "roofline_vs_refined": a / b - 1,
                      "roofline_vs_profiled_reference": PROFILED_DEVIATION[name]}
    rep.put("a100_80gb", figs)
    rep.section("a100_80gb", "Llama-3-8B on the paper A100-80GB, context 1,400: roofline vs refined (cost models; "
                "nothing measured)", rows,
                ["step", "roofline ms", "refined ms", "roofline vs refined", "roofline vs profiled (published)"],
                floatfmt=".2f",
                note="the last column is the published kernel profile's figure, the reference the refined "
                     "model aims at; it is not measured on this machine")


MODEL = "mini"      # the torch model the CPU's profile is measured on
REPEATS, THREADS, SEED = 5, 1, 0    # --repeats, --threads and --seed where not given (None, so that `flag_mix`
                                    # sees which are)


def cpu_calibration(args, rep) -> None:
    threads = args.threads or THREADS
    rep.put("machine", machine(threads))
    rep.text("\n" + machine_line(rep.results["machine"]))
    with torch_threads(threads):
        fitted, held = calibrate_refined(MODEL, quick=args.quick, repeats=args.repeats or REPEATS,
                                         seed=SEED if args.seed is None else args.seed)
    roof = fit(fitted.samples, fitted.model)
    steps = []
    for part, samples in (("fit", fitted.samples), ("held-out", held)):
        for s in samples:
            r, f = roof.predict(s.totals), fitted.predict(s.totals)
            steps.append({"part": part, "step": s.label, "measured_ms": s.seconds * 1e3, "roofline_ms": r * 1e3,
                          "refined_ms": f * 1e3, "roofline_err": r / s.seconds - 1, "refined_err": f / s.seconds - 1})
    rep.put("cpu_steps", steps)
    rows = [[d["part"], d["step"], d["measured_ms"], d["roofline_ms"], d["refined_ms"], f"{d['roofline_err']:+.1%}",
             f"{d['refined_err']:+.1%}"] for d in steps]
    roof_held = roof.median_abs_error(held)
    ref_held = fitted.median_abs_error(held)
    on = "one thread" if threads == 1 else f"{threads} threads"
    rep.section("cpu_steps", f"mini on this CPU ({on}): measured vs the two calibrated cost models (ms)", rows,
                ["part", "step", "measured", "roofline (calibrated)", "refined (calibrated)", "roofline err",
                 "refined err"], floatfmt=".2f")
    prm = fitted.gpu.refined.to_dict()
    rep.put("cpu_refined_params", {k: prm[k] for k in fitted.free})
    rep.put("cpu_held_out_median_abs_error", {"roofline": roof_held, "refined": ref_held, "n_held_out": len(held),
                                              "n_fit": len(fitted.samples)})
    rep.put("cpu_not_identified", list(fitted.not_identified))
    g = fitted.gpu
    # (name in --json, fitted parameter, its peak, unit): None where the steps do not pin the rate down
    effective = (("gemm_gflop_s", "gemm_flop_ceiling", g.peak_flops, "GFLOP/s"),
                 ("gemm_gb_s", "gemm_bw_ceiling", g.mem_bw, "GB/s"),
                 ("attention_gflop_s", "attention_flop_efficiency", g.peak_flops, "GFLOP/s"),
                 ("elementwise_gb_s", "elementwise_bw_efficiency", g.mem_bw, "GB/s"))
    rates = {key: None if name in fitted.not_identified else peak * prm[name] / 1e9
             for key, name, peak, _ in effective}
    rep.put("cpu_refined_effective_rates", rates)
    shown = {key: "not identified by these steps" if rates[key] is None else f"{rates[key]:.3g} {unit}"
             for key, _, _, unit in effective}
    rep.text(f"\nrefined fitted (effective rates): GEMM {shown['gemm_gflop_s']} and {shown['gemm_gb_s']}, attention "
             f"{shown['attention_gflop_s']}, elementwise {shown['elementwise_gb_s']}, per step "
             f"{prm['launch_overhead_s'] * 1e3:.3g} ms, per request {prm['seq_overhead_s'] * 1e3:.3g} ms")
    if fitted.not_identified:
        rep.text(f"not identified: {', '.join(fitted.not_identified)} (halving one moves no fitted step's predicted "
                 f"time by {IDENTIFIED_SHIFT:.0%}: the steps bound it from one side only, so its value is not a "
                 "measured rate)")
    rep.text(f"held-out median |error| on this CPU ({len(held)} steps, fitted on {len(fitted.samples)}): "
             f"refined {ref_held:.1%}, roofline {roof_held:.1%} (shared machine; goal <= 10%)")
    if args.out:
        rep.put("profile", str(fitted.save(args.out, held)))
        rep.text(f"profile written to {args.out}")


def body(args, rep) -> None:
    paper_gpu(args, rep)
    if not args.no_measure:
        cpu_calibration(args, rep)


def add_args(p) -> None:
    p.add_argument("--repeats", type=count_arg, default=None,
                   help=f"timed repeats per step, median kept (default {REPEATS})")
    p.add_argument("--threads", type=threads_arg, default=None, help=f"torch threads while timing (default {THREADS})")
    p.add_argument("--out", type=json_out_arg, default=None,
                   help="write the CPU's refined profile here (a .json file; a missing directory is made)")
    p.add_argument("--no-measure", action="store_true",
                   help="only the paper-GPU table (no --out, --quick, --seed, --repeats or --threads then: they "
                        "set the CPU's measuring)")
    p.set_defaults(seed=None)       # (SEED where not given: `flag_mix` refuses a --seed that --no-measure drops)


def flag_mix(args) -> str | None:
    """`run_experiment`'s `check`: the flags that set the CPU's measuring (the steps, the model's
    seed, the timing), which --no-measure skips, and a --repeats the measuring cannot take."""
    if args.out is not None and args.no_measure:
        return "--out writes the measured CPU profile, which --no-measure skips; drop one of them"
    given = [flag for flag, v in (("--quick", args.quick or None), ("--seed", args.seed), ("--repeats", args.repeats),
                                  ("--threads", args.threads)) if v is not None]
    if given and args.no_measure:
        named = given[0] if len(given) == 1 else f"{', '.join(given[:-1])} and {given[-1]}"
        return (f"{named} set how this CPU is measured, which --no-measure skips; drop "
                f"{'it' if len(given) == 1 else 'them'} or --no-measure")
    if not args.no_measure:
        fit_mixes, held_mixes = refined_grid(MODEL, args.quick)
        try:
            check_repeats(MODEL, fit_mixes + held_mixes, args.repeats or REPEATS, "--repeats")
        except ValueError as e:
            return str(e)
    return None


def main(argv: list[str] | None = None) -> dict:
    return run_experiment(__doc__, body, add_args, argv, check=flag_mix)


if __name__ == "__main__":
    main()
