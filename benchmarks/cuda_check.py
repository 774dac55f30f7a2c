"""The CUDA check, prepared to run in one go on the day a GPU is there (lecture §0.5, §4.2, §5.1).

    python benchmarks/cuda_check.py [--out cuda_check.json] [--json] [--seed 0]
    python benchmarks/cuda_check.py --device cpu --tiny      # a CPU smoke test of every section

Four sections, one JSON file (`--out`; `--json` prints it instead of the table), bounded to a few
minutes on a GPU:

1. parity: the same random model on the CPU (fp32, split attention, the reference) and on the
   device, teacher-forced over mixed steps (prefills, a chunk, decodes): fp32 logits within 1e-4,
   bf16 within a stated tolerance (max |diff| <= 0.1 x the std of the reference logits: bf16 keeps
   8 bits of mantissa), greedy tokens equal wherever the reference's top-2 gap exceeds the observed
   error (not a near tie); for both attention paths (fused in bf16 on CUDA = the varlen kernel);
   and that kernel given the K/V heads as stored (its own GQA) against the heads repeated;
2. engine: 32 requests through Engine + TorchExecutor on the device for both attention paths:
   the executor's CUDA-event time, and the wall time split into the scheduler, the executor's
   host call and the engine's own loop, per step;
3. paper GPU: a ~1.2B-parameter Llama-3.2-1B-shaped random bf16 model (tied head), decode steps
   and a prefill timed with CUDA events, against the paper GPU's prediction for the card
   (H200 or H100 preset, by device name);
4. refined cost model: the same model's steps timed on the quick calibration grid; the paper card's
   refined parameters and the ones fitted to those steps, judged on held-out steps.

Without CUDA (and without `--device cpu`) it says so on stderr and exits 1: nothing was checked.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from orca_torch.lab import calibrate  # noqa: E402
from orca_torch.lab.calibration.refined_fit import RefinedFit, not_identified_note  # noqa: E402
from orca_torch.model.accounting import torch_threads  # noqa: E402
from orca_torch.model.fused_attention import torch_varlen_kernel  # noqa: E402
from orca_torch.core.batch import SeqWork, StepTotals  # noqa: E402
from orca_torch.lab.cli_args import add_seed_flag, command_parser, json_out_arg  # noqa: E402
from orca_torch.lab.report import machine, machine_line, quiet_exit  # noqa: E402
from orca_torch.core.engine import Engine  # noqa: E402
from orca_torch.model.torch_executor import TorchExecutor  # noqa: E402
from orca_torch.sim.hw_model import card_for, get_gpu, pricer  # noqa: E402
from orca_torch.core.memory import UnlimitedMemory, slots_to_finish  # noqa: E402
from orca_torch.model.orca_model import ATTENTION_PATHS, OrcaModel  # noqa: E402
from orca_torch.core.request import Request  # noqa: E402
from orca_torch.core.scheduler_config import SchedulerConfig  # noqa: E402
from orca_torch.specs import ModelSpec, get_model_spec  # noqa: E402

FP32_TOL = 1e-4
BF16_REL_TOL = 0.1
GQA_TOL = 1e-2
"""How far the varlen kernel's own GQA may be from repeating the K/V heads (bf16 attention outputs of
order 1; the H200 with torch 2.11 gave 0.0)."""
LLAMA_1B = ModelSpec(name="llama-3.2-1b-shape", n_layers=16, hidden=2048, n_heads=32, n_kv_heads=8, head_dim=64,
                     intermediate=8192, vocab=128256, max_context=4096, tied_embeddings=True, dtype_bytes=2)
SMALL_LLAMA = ModelSpec(name="small-llama-shape", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32,
                        intermediate=256, vocab=512, max_context=512, tied_embeddings=True, dtype_bytes=4)


class Timer:
    """Event timing on CUDA (synchronised), perf_counter elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def kernels(self, fn, top: int = 4) -> tuple[float | None, list[dict]]:
        """Seconds the device spends in kernels during `fn()` (torch.profiler), and the `top` torch ops
        by their kernels' time; (None, []) off CUDA. Beside the event time: what of a step is the GPU's
        work, what is waiting for the host to launch it, and which ops the work is."""
        if not self.cuda:
            return None, []
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = prof.key_averages()
        ops = sorted((e for e in events if e.key.startswith("aten::") and e.self_device_time_total > 0),
                     key=lambda e: -e.self_device_time_total)
        on_card = (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        kernel_s = sum(e.self_device_time_total for e in on_card) / 1e6
        return (kernel_s,
                [{"op": e.key, "ms": e.self_device_time_total / 1e3, "calls": e.count} for e in ops[:top]])


# ---- 1. parity ---------------------------------------------------------------------------------
def teacher_forced_logits(model: OrcaModel, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Logits of every step of a fixed schedule over `seqs`: all prompts' first halves in one step
    (the second request as two chunks), then decodes of every request, one token each, fed the
    reference tokens. Returns `[n_rows, vocab]` in fp32 on the CPU."""
    kv = model.new_kv(sum(len(s) for s in seqs))
    for r, s in enumerate(seqs):
        kv.reserve(r, len(s))
    half = [len(s) // 2 for s in seqs]
    half[1] = max(2, half[1] // 2)                        # request 1 prefills in two chunks
    out = [model.forward_batch(torch.cat([s[:h] for s, h in zip(seqs, half)]),
                               [SeqWork(h, 0) for h in half], list(range(len(seqs))), kv)]
    done = list(half)
    while any(d < len(s) for d, s in zip(done, seqs)):
        rs = [r for r, s in enumerate(seqs) if done[r] < len(s)]
        ns = [len(seqs[r]) // 2 - done[r] if done[r] < len(seqs[r]) // 2 else 1 for r in rs]
        ids = torch.cat([seqs[r][done[r]:done[r] + n] for r, n in zip(rs, ns)])
        out.append(model.forward_batch(ids, [SeqWork(n, done[r]) for r, n in zip(rs, ns)], rs, kv))
        for r, n in zip(rs, ns):
            done[r] += n
    return torch.cat(out).float().cpu()


def parity(spec: ModelSpec, device: torch.device, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, spec.vocab, (n,), generator=g) for n in (40, 23, 9, 61)]
    ref = teacher_forced_logits(OrcaModel(spec, seed=seed), seqs)
    top2 = ref.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model = OrcaModel(spec, seed=seed, device=device, dtype=dtype)
        for path in ATTENTION_PATHS:
            model.attention = path
            got = teacher_forced_logits(model, seqs)
            err = float((got - ref).abs().max())
            tol = FP32_TOL if dtype == torch.float32 else BF16_REL_TOL * float(ref.std())
            clear = gap > 2 * err
            same = bool((got.argmax(-1) == ref.argmax(-1))[clear].all())
            rows.append({"dtype": str(dtype).split(".")[1], "attention": path,
                         "kernel": model.step_path(),      # split, varlen or batched (contiguous K/V)
                         "max_abs_diff": err, "tolerance": tol, "within": err <= tol, "rows": len(ref),
                         "rows_compared": int(clear.sum()), "greedy_equal": same})
    return rows


def kernel_gqa(device: torch.device, seed: int, repeats: int = 5, batch: int = 128, keys: int = 1024
               ) -> dict | None:
    """The varlen kernel the fused path calls, on `batch` decodes of `keys` seeded keys each (32
    query and 8 K/V heads, d = 64, bf16), given the K/V heads as stored and repeated per query head
    (what the fused path did before, in every layer): the largest difference and each call's
    median time. None where no such kernel runs."""
    kernel = torch_varlen_kernel(device, torch.bfloat16)
    if kernel is None:
        return None
    B, K, H, H_KV, D = batch, keys, 32, 8, 64
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(n, h, D, device=device, dtype=torch.bfloat16, generator=g)
               for n, h in ((B, H), (B * K, H_KV), (B * K, H_KV)))
    cu_q = torch.arange(B + 1, device=device, dtype=torch.int32)

    def call(repeat: bool) -> torch.Tensor:
        kk, vv = (t.repeat_interleave(H // H_KV, 1) for t in (k, v)) if repeat else (k, v)
        return kernel(q, kk, vv, cu_q, cu_q * K, 1, K, scale=D ** -0.5, window_size=(-1, 0), enable_gqa=True)

    timer = Timer(device)
    diff = float((call(False).float() - call(True).float()).abs().max())
    ms = {name: 1e3 * statistics.median(timer(lambda r=r: call(r)) for _ in range(repeats))
          for name, r in (("as_stored_ms", False), ("repeated_ms", True))}
    return {"max_abs_diff": diff, "tolerance": GQA_TOL, "within": diff <= GQA_TOL, **ms}


# ---- 2. the engine -------------------------------------------------------------------------------
class _TimedTorchExecutor(TorchExecutor):
    """The torch executor, with the host wall time of each `execute` call recorded."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.host_s = 0.0

    def execute(self, batch):
        t0 = time.perf_counter()
        res = super().execute(batch)
        self.host_s += time.perf_counter() - t0
        return res


def engine_shares(spec: ModelSpec, device: torch.device, n_requests: int, new_tokens: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    model = OrcaModel(spec, seed=seed, device=device)
    rows = []
    for path in ATTENTION_PATHS:
        model.attention = path
        reqs = [Request(i, 0.0, int(p), new_tokens, prompt_ids=rng.integers(0, spec.vocab, int(p)).tolist())
                for i, p in enumerate(rng.integers(17, 128, n_requests))]
        ex = _TimedTorchExecutor(model, model.new_kv(sum(map(slots_to_finish, reqs))))
        engine = Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=n_requests))
        sched_s = [0.0]
        for name in ("schedule", "complete"):
            fn = getattr(engine.scheduler, name)

            def timed(*a, _fn=fn, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    sched_s[0] += time.perf_counter() - t0
            setattr(engine.scheduler, name, timed)
        engine.run(reqs[:2])                                            # warm-up
        ex.host_s, sched_s[0] = 0.0, 0.0
        t0 = time.perf_counter()
        res = engine.run(reqs)
        wall = time.perf_counter() - t0
        dev_s = float(np.sum(res.step_end - res.step_start))
        n = res.n_steps
        rows.append({"attention": path, "steps": n, "wall_ms_per_step": 1e3 * wall / n,
                     "device_ms_per_step": 1e3 * dev_s / n, "device_share": dev_s / wall,
                     "executor_host_share": ex.host_s / wall, "scheduler_share": sched_s[0] / wall,
                     "engine_share": (wall - ex.host_s - sched_s[0]) / wall,
                     "tok_per_s": n_requests * new_tokens / wall})
    return rows


# ---- 3. the paper GPU ------------------------------------------------------------------------------
def paper_gpu_name(device: torch.device) -> str:
    """The paper card the device is compared with: its own datasheet, else the H100's."""
    if device.type != "cuda":
        return "h100"
    return card_for(torch.cuda.get_device_name(device)) or "h100"


def _filled_kv(model: OrcaModel, batch: int, ctx: int, headroom: int, seed: int):
    """`batch` requests holding `ctx` tokens of seeded random K/V, drawn on the device (a decode
    step's cost does not depend on the values; a real prefill of a 1B model would take longer)."""
    kv = model.new_kv(batch * (ctx + headroom))
    g = torch.Generator(device=model.device).manual_seed(seed)
    for r in range(batch):
        kv.reserve(r, ctx + headroom)
        kv.storage(r)[..., :ctx, :].normal_(generator=g)
        kv.commit(r, ctx)
    return kv


def _steps(model: OrcaModel, kind: str, batch: int, ctx: int, n: int, seed: int):
    """`step_at(k)`: the `k`-th of `n` runs of the step as a call (decodes go on from one another
    over seeded K/V, each prefill starts on fresh K/V), and the works one run has."""
    ids = torch.randint(0, model.spec.vocab, (batch if kind == "decode" else batch * ctx,),
                        generator=torch.Generator().manual_seed(seed))
    rids = list(range(batch))
    if kind == "decode":
        kv = _filled_kv(model, batch, ctx, n, seed)
        return (lambda k: lambda: model.forward_batch(ids, [SeqWork(1, ctx + k)] * batch, rids, kv)), \
            [SeqWork(1, ctx + n // 2)] * batch

    def prefill_at(k: int):
        kv = model.new_kv(batch * ctx)
        for r in rids:
            kv.reserve(r, ctx)
        return lambda: model.forward_batch(ids, [SeqWork(ctx, 0)] * batch, rids, kv)
    return prefill_at, [SeqWork(ctx, 0)] * batch


def paper_gpu(model: OrcaModel, gpu: str, shapes: list[tuple[str, int, int]], seed: int, repeats: int) -> list[dict]:
    """Each step timed (median of `repeats`, after two warm-ups), its kernels' time in one more run,
    and the paper card's prediction for it."""
    price = pricer(model.spec, gpu)
    timer = Timer(model.device)
    rows = []
    for kind, batch, ctx in shapes:
        step_at, works = _steps(model, kind, batch, ctx, repeats + 3, seed)
        for k in range(2):
            step_at(k)()                                                # warm-up
        measured = statistics.median(timer(step_at(k)) for k in range(2, repeats + 2))
        kernels, ops = timer.kernels(step_at(repeats + 2))
        predicted = price.time(StepTotals.of(works))
        rows.append({"step": kind, "batch": batch, "context": ctx, "measured_ms": 1e3 * measured,
                     "kernel_ms": None if kernels is None else 1e3 * kernels, "top_ops": ops,
                     "predicted_ms": 1e3 * predicted, "measured_over_predicted": measured / predicted})
        del step_at
    return rows


# ---- 4. the refined cost model, fitted on the device ---------------------------------------------
def refined(model: OrcaModel, gpu: str, seed: int, repeats: int) -> dict:
    """How far the paper card's refined cost model is from the device, before and after it is fitted
    to steps timed there (`calibrate.calibrate_refined`, its quick grid of decodes, prefills and
    mixed steps): the median |error| of the card's own parameters and of the fitted ones on held-out
    steps (batch sizes, contexts and prompt lengths no fitted step has), and the fitted values."""
    fit, held = calibrate.calibrate_refined(model, quick=True, repeats=repeats, seed=seed, gpu=gpu)
    card = RefinedFit(fit.model, get_gpu(gpu), ())
    fitted = fit.gpu.refined.to_dict()
    return {"card": gpu, **fit.notes(held),
            "card_params_held_out_median_abs_error": card.median_abs_error(held),
            "fitted_params": {k: fitted[k] for k in fit.free}}


def params(n: int) -> str:
    """A parameter count as the table's title says it: in billions from one billion, else in millions
    (the tiny smoke test's 0.36M read "0.00B")."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def main(argv: list[str] | None = None) -> int:
    p = command_parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="the device checked against the CPU reference (default cuda; cpu: a smoke test, with --tiny only)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes everywhere (a smoke test of the script)")
    add_seed_flag(p, "the random models and their inputs")
    p.add_argument("--out", type=json_out_arg, default="cuda_check.json",
                   help="where the JSON goes: a .json file; a missing directory is made (default cuda_check.json)")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the tables")
    a = p.parse_args(argv)
    if a.device == "cpu" and not a.tiny:        # (the CPU against itself, at a 1.2B model's size: hours, nothing learned)
        p.error("--device cpu is the script's smoke test: add --tiny")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("cuda_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check. "
              "Run it on a machine with a GPU, or use --device cpu --tiny for a smoke test.", file=sys.stderr)
        return 1                            # (nothing checked is no pass)
    device = torch.device(a.device)
    # on a shared CPU, spinning OpenMP workers make timings random: one thread there
    with torch_threads(1) if device.type == "cpu" else contextlib.nullcontext():
        return _check(a, device)


def _check(a: argparse.Namespace, device: torch.device) -> int:
    t_start = time.perf_counter()
    small = get_model_spec("tiny") if a.tiny else get_model_spec("mini")
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "machine": machine(torch.get_num_threads()), "seed": a.seed,
              "tiny": a.tiny}
    result["parity"] = parity(small, device, a.seed)
    result["kernel_gqa"] = kernel_gqa(device, a.seed)
    result["engine"] = engine_shares(small, device, 4 if a.tiny else 32, 3 if a.tiny else 32, a.seed)
    big = SMALL_LLAMA if a.tiny else LLAMA_1B
    shapes = ([("decode", 4, 16), ("prefill", 1, 32)] if a.tiny else
              [("decode", 1, 512), ("decode", 16, 512), ("decode", 64, 512), ("decode", 128, 1024),
               ("prefill", 1, 2048), ("prefill", 4, 512)])
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    gpu = paper_gpu_name(device)
    model = OrcaModel(big, seed=a.seed, device=device, dtype=dtype, attention="fused")
    result["paper_gpu"] = paper_gpu(model, gpu, shapes, a.seed, 3 if a.tiny else 7)
    result["paper_gpu_card"], result["paper_gpu_model"] = gpu, big.name
    result["paper_gpu_params"] = big.n_params
    result["refined_cost_model"] = refined(model, gpu, a.seed, 3 if a.tiny else 5)
    del model
    result["seconds"] = time.perf_counter() - t_start
    result["ok"] = (all(r["within"] and r["greedy_equal"] for r in result["parity"])
                    and (result["kernel_gqa"] is None or result["kernel_gqa"]["within"]))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    if a.json:
        print(json.dumps(result, indent=1))
        return 0 if result["ok"] else 1
    print(f"cuda_check on {result['device']} (torch {torch.__version__}), {result['seconds']:.0f} s; JSON in {a.out}")
    print(machine_line(result["machine"]))
    print("\n1. CPU fp32 split (reference) vs device")
    print(tabulate([[r["dtype"], r["attention"], r["kernel"], f"{r['max_abs_diff']:.2e}", f"{r['tolerance']:.2e}",
                     r["within"], f"{r['rows_compared']}/{r['rows']}", r["greedy_equal"]] for r in result["parity"]],
                   headers=["dtype", "attention", "kernel", "max |diff|", "tolerance", "within", "rows (no tie)",
                            "greedy equal"]))
    kg = result["kernel_gqa"]
    print("the varlen kernel's own GQA: no such kernel here" if kg is None else
          f"the varlen kernel's own GQA against the K/V heads repeated (128 decodes of 1,024): max |diff| "
          f"{kg['max_abs_diff']:.2e} (tolerance {kg['tolerance']:.0e}), {kg['as_stored_ms']:.3f} ms a call "
          f"against {kg['repeated_ms']:.3f} ms")
    print("\n2. engine on the device: time per step and where the wall time goes")
    print(tabulate([[r["attention"], r["steps"], f"{r['wall_ms_per_step']:.2f}", f"{r['device_ms_per_step']:.2f}",
                     f"{r['device_share']:.0%}", f"{r['executor_host_share']:.0%}", f"{r['scheduler_share']:.1%}",
                     f"{r['engine_share']:.1%}", f"{r['tok_per_s']:.0f}"] for r in result["engine"]],
                   headers=["attention", "steps", "wall ms/step", "timed ms/step", "timed share", "execute() share",
                            "scheduler share", "engine share", "tok/s"]))
    print(f"\n3. {big.name} ({params(big.n_params)} params, {str(dtype).split('.')[1]}): measured vs the paper "
          f"{gpu.upper()}'s prediction")
    print(tabulate([[r["step"], r["batch"], r["context"], f"{r['measured_ms']:.3f}",
                     "n/a" if r["kernel_ms"] is None else f"{r['kernel_ms']:.3f}", f"{r['predicted_ms']:.3f}",
                     f"{r['measured_over_predicted']:.2f}"] for r in result["paper_gpu"]],
                   headers=["step", "batch", "context", "measured ms", "kernels ms", "predicted ms",
                            "measured / predicted"]))
    for r in result["paper_gpu"]:
        if r["top_ops"]:
            print(f"kernels of the {r['step']} of {r['batch']} x {r['context']}: "
                  + ", ".join(f"{o['op']} {o['ms']:.2f} ms ({o['calls']} calls)" for o in r["top_ops"]))
    r = result["refined_cost_model"]
    print(f"\n4. the paper {gpu.upper()}'s refined cost model against {big.name}'s steps on the device "
          f"({r['n_samples']} fitted, {r['n_held_out']} held out): median |error| on the held-out steps "
          f"{r['card_params_held_out_median_abs_error']:.1%} with the card's parameters, "
          f"{r['held_out_median_abs_error']:.1%} fitted ({r['fit_median_abs_error']:.1%} on the fitted steps)")
    print(tabulate([[k, f"{v:.4g}"] for k, v in r["fitted_params"].items()], headers=["fitted parameter", "value"]))
    if r["not_identified"]:
        print(not_identified_note(r["not_identified"]))
    print(f"\nparity {'OK' if result['ok'] else 'FAILED'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    with quiet_exit():
        sys.exit(main())
