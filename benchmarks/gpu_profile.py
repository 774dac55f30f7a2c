"""Profile a card: time a Llama-shaped model's steps with CUDA events, fit the refined cost model, write a JSON profile.

On a GPU (the default `--device cuda`): builds the torch model (`--model`, seeded random weights,
bf16, `--attention split` or `fused`) and hands it to `calibrate_refined` with a grid of decode
batches at several contexts, prefills of several lengths and mixed steps, which times them
(`measure_steps`: one forward + greedy argmax each, CUDA events, median of `--repeats`) and fits
the refined model's parameters on part of the grid, starting from the card's datasheet defaults
with the attention the model computes (`refined_start`: "full" where the torch model's masked
matmul computes the whole rectangle, "causal-tiles" where Flash Attention's variable-length kernel
runs the fused path). It prints, per step kind, the datasheet prediction (roofline, and refined as
for a FlashAttention engine) and the fitted one against the measurement, with the held-out error
(batch sizes, contexts and prompt lengths not fitted). The fitted card is written to `--out` for
`pricer(model, "profile.json", cost_model=...)`.

    python benchmarks/gpu_profile.py --model llama-3-8b --out profiles/a100-80gb.json   # on the GPU
    python benchmarks/gpu_profile.py --model llama-3-8b --attention fused --out profiles/a100-80gb-fused.json
    python benchmarks/gpu_profile.py --device cpu --model tiny --quick                 # a CPU dry run

Without CUDA, `--device cuda` says so on stderr and exits 1 (nothing measured). A model whose
weights and K/V do not fit in the memory available (the host's, where the fp32 weights are built,
and the card's) is refused before anything is built. The K/V pools hold up to about
`128 x 1,400 + 16 x 4,096` tokens (~40 GB for Llama-3-8B in bf16): an 80 GB card or larger.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

from orca_torch.core.batch import SeqWork  # noqa: E402
from orca_torch.lab.calibrate import calibrate_refined, refined_grid  # noqa: E402
from orca_torch.lab.calibration.measure import check_repeats, kv_tokens_needed  # noqa: E402
from orca_torch.lab.calibration.refined_fit import not_identified_note  # noqa: E402
from orca_torch.lab.calibration.samples import step_kind  # noqa: E402
from orca_torch.sim.hw_model import GPUS, card_for, get_gpu, pricer  # noqa: E402
from orca_torch.model.accounting import torch_threads  # noqa: E402
from orca_torch.model.orca_model import ATTENTION_PATHS, OrcaModel, buildable_presets  # noqa: E402
from orca_torch.checks import check_fits_in_memory  # noqa: E402
from orca_torch.lab.cli_args import (add_seed_flag, command_parser, count_arg, gpu_arg, json_out_arg,  # noqa: E402
                                     threads_arg, torch_preset_arg)
from orca_torch.lab.report import Report, machine, machine_line, quiet_exit  # noqa: E402
from orca_torch.specs import ModelSpec, get_model_spec  # noqa: E402


def gpu_grid(quick: bool) -> tuple[list[list[SeqWork]], list[list[SeqWork]]]:
    """(fit, held-out) steps at serving sizes: decodes at contexts 512 / 1,400 (/ 4,096 for small batches),
    prefills up to 4,096 tokens, mixed steps. Held-out batch sizes, contexts and prompt lengths are not fitted."""
    if quick:
        fb, hb, fp, hp = (1, 16, 64), (8, 32), (128, 1024), (512,)
    else:
        fb, hb, fp, hp = (1, 4, 16, 64, 128), (8, 32, 96), (64, 256, 1024, 2048, 4096), (128, 512, 1155, 3000)
    fc, hc = (512, 4096), (1400,)
    fit = [[SeqWork(1, c - 1)] * b for b in fb for c in fc if c < 4096 or b <= 16]
    fit += [[SeqWork(p)] for p in fp] + [[SeqWork(fp[1])] + [SeqWork(1, 511)] * fb[-2]]
    held = [[SeqWork(1, c - 1)] * b for b in hb for c in hc]
    held += [[SeqWork(p)] for p in hp] + [[SeqWork(hp[0])] + [SeqWork(1, 1399)] * hb[-1]]
    return fit, held


def check_memory(model: str, spec: ModelSpec, device: str, kv_tokens: int) -> None:
    """Refuse (ValueError) a model whose weights and K/V do not fit where they are built (`OrcaModel`
    makes its weights on the device, in their dtype); `spec` is in the dtype the steps run in (fp32 on cpu)."""
    import torch

    kv = spec.kv_bytes_per_token * kv_tokens
    if device == "cpu":
        check_fits_in_memory(f"--model {model} on cpu (fp32 weights and the steps' K/V)",
                             spec.weight_bytes + kv)
        return
    free, _ = torch.cuda.mem_get_info()
    check_fits_in_memory(f"--model {model} on {device} ({spec.dtype_bytes}-byte weights and the steps' K/V)",
                         spec.weight_bytes + kv, available=free)


def main(argv=None) -> int:
    p = command_parser(__doc__.splitlines()[0])
    p.add_argument("--model", type=torch_preset_arg, default="llama-3-8b",
                   help=f"model preset: {', '.join(buildable_presets())} (default llama-3-8b)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where the steps are timed: cuda (bf16, CUDA events) or cpu (fp32, a dry run) (default cuda)")
    p.add_argument("--gpu", type=gpu_arg, default=None,
                   help=f"datasheet card to compare with: {', '.join(sorted(GPUS))}, cpu (this machine's, measured) "
                   "or a GPU profile's .json path (default: from the CUDA device's name; cpu on --device cpu)")
    p.add_argument("--attention", choices=ATTENTION_PATHS, default="split",
                   help="the model's attention path: split (a loop over the requests, the reference) or fused "
                        "(one attention call a layer; Flash Attention's variable-length kernel on CUDA) (default split)")
    p.add_argument("--repeats", type=count_arg, default=7, help="timed repeats per step, median kept (default 7)")
    p.add_argument("--threads", type=threads_arg, default=None, help="torch threads on --device cpu (default 1)")
    p.add_argument("--out", type=json_out_arg, default=None,
                   help="write the fitted profile here (a .json file; a missing directory is made)")
    add_seed_flag(p, "the weights and the steps' tokens")
    p.add_argument("--quick", action="store_true", help="a smaller grid")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    a = p.parse_args(argv)
    import torch

    if a.threads is not None and a.device == "cuda":
        p.error("--threads sets the torch threads of --device cpu; with --device cuda it would do nothing: leave it "
                "unset")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_profile: CUDA is not available on this machine (torch.cuda.is_available() is False); "
              "nothing measured. Run it on a GPU, or try --device cpu --model tiny --quick.", file=sys.stderr)
        return 1                            # (nothing measured is no profile)
    card = a.gpu or (card_for(torch.cuda.get_device_name()) if a.device == "cuda" else "cpu")
    if card is None:
        p.error(f"cannot tell the datasheet card of {torch.cuda.get_device_name()!r}; give --gpu")
    threads = (a.threads or 1) if a.device == "cpu" else torch.get_num_threads()
    try:
        with torch_threads(threads):            # ("cpu" is measured: on the threads the steps run on)
            datasheet = get_gpu(card)
        spec = get_model_spec(a.model)
    except ValueError as e:
        p.error(str(e))
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    spec = spec.with_dtype_bytes(torch.finfo(dtype).bits // 8)
    if a.device == "cuda":
        fit_m, held_m = gpu_grid(a.quick)
    else:
        fit_m, held_m = refined_grid(spec, a.quick)
    try:
        check_repeats(spec, fit_m + held_m, a.repeats, "--repeats")
        check_memory(a.model, spec, a.device, kv_tokens_needed(fit_m + held_m, a.repeats))
    except ValueError as e:
        p.error(str(e))
    model = OrcaModel(spec, seed=a.seed, device=a.device, dtype=dtype, attention=a.attention)
    path = model.step_path()                    # split, varlen, or batched where no varlen kernel runs
    with torch_threads(threads):
        fit, held_s = calibrate_refined(model, repeats=a.repeats, seed=a.seed, gpu=datasheet, grid=(fit_m, held_m))
    fit_s = fit.samples

    rep = Report(as_json=a.json)
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    rep.put("device", name)
    rep.put("machine", machine(threads))
    rep.put("datasheet", card)
    rep.put("datasheet_source", datasheet.source)
    rep.put("attention_path", path)
    rep.text(f"{spec.name} ({dtype}, {path} attention) on {name}; datasheet card {card}: {datasheet.source}")
    rep.text(machine_line(rep.results["machine"]))
    roof, sheet, fitted = pricer(spec, datasheet), pricer(spec, datasheet, cost_model="refined"), fit.pricer()
    rows, per_kind = [], {}
    for part, samples in (("fit", fit_s), ("held-out", held_s)):
        for s in samples:
            preds = [pr.time(s.totals) for pr in (roof, sheet, fitted)]
            rows.append([part, step_kind(s), s.label, s.seconds * 1e3, *(x * 1e3 for x in preds),
                         *(f"{x / s.seconds - 1:+.1%}" for x in preds)])
            per_kind.setdefault((step_kind(s), part), []).append([abs(x / s.seconds - 1) for x in preds])
    rep.put("steps", [dict(zip(("part", "kind", "step", "measured_ms", "roofline_ms", "refined_datasheet_ms",
                                "refined_fitted_ms"), r[:7])) for r in rows])
    rep.section("steps", "measured vs predicted, per step (ms)", rows,
                ["part", "kind", "step", "measured", "roofline (datasheet)", "refined (datasheet)",
                 "refined (fitted)", "roofline err", "refined err", "fitted err"], floatfmt=".3f")
    summary = [[k, part, len(v), *(f"{statistics.median(e[i] for e in v):.1%}" for i in range(3))]
               for (k, part), v in sorted(per_kind.items())]
    rep.put("median_abs_error", {f"{k}/{part}": dict(zip(("roofline", "refined_datasheet", "refined_fitted"),
                                                          (statistics.median(e[i] for e in v) for i in range(3))))
                                 for (k, part), v in per_kind.items()})
    rep.section("median_abs_error", "median |error| per step kind", summary,
                ["kind", "part", "steps", "roofline (datasheet)", "refined (datasheet)", "refined (fitted)"])
    rep.put("fitted", fit.gpu.refined.to_dict())
    rep.put("not_identified", list(fit.not_identified))
    rep.put("held_out_median_abs_error", fit.median_abs_error(held_s))
    rep.text(f"\nfitted on {len(fit_s)} steps ({', '.join(fit.free)}): "
             + ", ".join(f"{k} {v:.4g}" for k, v in fit.gpu.refined.to_dict().items() if k in fit.free)
             + f"; peaks {fit.gpu.peak_flops / 1e12:.4g} TFLOP/s, {fit.gpu.mem_bw / 1e9:.4g} GB/s"
             + (f"; {not_identified_note(fit.not_identified)}" if fit.not_identified else ""))
    rep.text(f"held-out median |error| of the fitted refined model: {fit.median_abs_error(held_s):.1%} "
             f"({len(held_s)} steps)")
    if a.out:
        path = fit.save(a.out, held_s)
        rep.put("profile", str(path))
        rep.text(f"profile written to {path}")
    rep.finish()
    return 0


if __name__ == "__main__":
    with quiet_exit():
        sys.exit(main())
