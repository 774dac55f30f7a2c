"""Code 02: selective batching on a real torch model (lecture §1.1, §3.2, §4.2, exercise 4).

demo 1  the step of §3.2 (prefills of 37 and 9 tokens, decodes at past 120, 15, 64): what padding
        to [B, L_max, H] wastes, for tokens and for attention (query, key) pairs; FLOPs counted
        on the selective and the padded forward, each equal to the shared formula.
demo 2  the same five requests batched vs one by one: logits, greedy tokens, FLOPs, K/V bytes
        and weight bytes (batching saves only the repeated weight reads).
demo 3  CPU wall time of one decode step for 64 requests (`mini`), batched vs one by one.
demo 4  continuous vs static batching on the real model (lecture §4.1): six requests, max_bs 3,
        the two timeline charts (10 vs 18 iterations) and the check that continuous batching's
        tokens equal each request generated alone.

The demos are functions in `DEMOS`; each takes `(args, report)` and adds its tables and a `demoN` entry to the
JSON. docs/experiments/02-selective-batching.md says what the figures mean.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

from orca_torch.lab import plots
from orca_torch.model.accounting import (counted_flops, decode_op_counts, decode_step_times,
    gathered_weight_bytes, padded_works, step_state, torch_threads, weight_matmul_bytes, weight_matmul_time)
from orca_torch.core.batch import SeqWork, StepTotals, padded_shape
from orca_torch.model.orca_model import OrcaModel
from orca_torch.lab.report import Report, run_experiment
from orca_torch.lab.timeline import demo4 as timeline_demo4, format_demo4

# §3.2's step: two prefills from scratch and three decodes.
STEP = [SeqWork(37, 0), SeqWork(9, 0), SeqWork(1, 120), SeqWork(1, 15), SeqWork(1, 64)]
LECTURE = {"useful_tokens": 49, "padded_tokens": 185, "token_waste": 0.74, "useful_pairs": 950,
           "padded_pairs": 22_385, "pairs_ratio": 23.6, "max_logit_diff": 1.1e-6, "weight_bytes_ratio": 4.88,
           "n_requests": 64, "one_by_one_ms": 37.0, "batched_ms": 8.2, "speedup": 4.5}


def demo1(args: argparse.Namespace, report: Report) -> None:
    """§3.2 and exercise 4: useful vs padded tokens and attention pairs; counted FLOPs."""
    t = StepTotals.of(STEP)
    B, L, K = padded_shape(STEP)
    pad_tokens, pad_pairs = B * L, B * L * K
    waste = 1 - t.n_tokens / pad_tokens
    rows = [[f"r{i}", "prefill" if w.n_past == 0 else "decode", w.n_new, w.n_past,
             w.n_new * w.n_past + w.n_new * (w.n_new + 1) // 2, w.n_new * w.n_ctx, L * K]
            for i, w in enumerate(STEP)]
    report.section("demo1.requests", "demo 1: the step of §3.2, per request", rows,
                   ["req", "phase", "new tokens", "past tokens", "useful pairs (causal)", "pairs computed (selective)",
                    f"pairs padded ({L}x{K})"])
    ratio = pad_pairs / t.attn_pairs_causal
    report.compare("demo1_lecture_vs_project", "demo 1: useful vs padded work, the lecture's figures beside ours", {
        "tokens: useful (sum L)": (LECTURE["useful_tokens"], t.n_tokens),
        f"tokens: padded (B x L_max = {B} x {L})": (LECTURE["padded_tokens"], pad_tokens),
        "tokens: waste": (LECTURE["token_waste"], waste, f"{waste:.2f} ({waste:.1%})"),
        "attention pairs: useful (causal)": (LECTURE["useful_pairs"], t.attn_pairs_causal),
        "attention pairs: computed by selective batching": ("-", t.attn_pairs_full),
        f"attention pairs: padded (B x L_max x K_max = {B} x {L} x {K})": (LECTURE["padded_pairs"], pad_pairs),
        "attention pairs: padded / useful": (LECTURE["pairs_ratio"], ratio, f"{ratio:.1f}x")},
        note="Selective batching computes each request's own score rectangle, new x (past + new) tokens; padding "
             "computes B x L_max x K_max pairs, padding the query and the key dimension at once (exercise 4).")

    model = OrcaModel("mini", seed=args.seed)
    kv, ids = step_state(model, STEP, args.seed)
    sel, logits = counted_flops(model, ids, STEP, list(range(B)), kv)
    kv_p, _ = step_state(model, STEP, args.seed)
    pad, logits_p = counted_flops(model, ids, STEP, list(range(B)), kv_p, padded=True)
    f_sel, f_pad = model.spec.step_flops(STEP), model.spec.step_flops(padded_works(STEP))
    diff = float((logits - logits_p).abs().max())
    report.section("demo1.flops", "demo 1: FLOPs counted by FlopCounterMode on the mini model (vs formula)", [
        [{"lm_head": "LM head"}.get(k, k), f"{sel[k]:,}", f"{f_sel[k]:,}", f"{pad[k]:,}", f"{f_pad[k]:,}",
         f"{pad[k] / sel[k]:.2f}x"]
        for k in ("linear", "attention", "lm_head", "total")],
        ["part", "selective: counted", "formula", "padded: counted", "formula (padded works)", "padded / selective"],
        note=f"Padded and selective logits differ by at most {diff:.1e}: padding changes the cost, not the result.")
    report.put("demo1", {
        "useful_tokens": t.n_tokens, "padded_tokens": pad_tokens, "token_waste_fraction": waste,
        "useful_attention_pairs": t.attn_pairs_causal, "selective_attention_pairs": t.attn_pairs_full,
        "padded_attention_pairs": pad_pairs, "padded_over_useful_pairs": pad_pairs / t.attn_pairs_causal,
        "flops_selective_counted": sel, "flops_selective_formula": f_sel,
        "flops_padded_counted": pad, "flops_padded_formula": f_pad,
        "padded_vs_selective_max_abs_logit_diff": diff,
    })


def demo2(args: argparse.Namespace, report: Report) -> None:
    """§1.1 / §4.2: batched = one by one in results and FLOPs; only weight reads are saved."""
    model = OrcaModel("mini", seed=args.seed)
    spec, n = model.spec, len(STEP)
    kv_b, ids = step_state(model, STEP, args.seed)
    kv_s, _ = step_state(model, STEP, args.seed)
    fb, logits_b = counted_flops(model, ids, STEP, list(range(n)), kv_b)
    one = [counted_flops(model, tok, [STEP[r]], [r], kv_s) for r, tok in enumerate(ids.split([w.n_new for w in STEP]))]
    fs = {k: sum(f[k] for f, _ in one) for k in fb}                 # each request alone, in order
    logits_s = torch.cat([lg for _, lg in one])
    diff = float((logits_b - logits_s).abs().max())
    same = int((logits_b.argmax(-1) == logits_s.argmax(-1)).sum())
    bb = spec.step_bytes(STEP)
    bs = [spec.step_bytes([w]) for w in STEP]
    kv_b_bytes, kv_s_bytes = bb["kv_read"] + bb["kv_write"], sum(b["kv_read"] + b["kv_write"] for b in bs)
    wb, ws = bb["weights"], sum(b["weights"] for b in bs)
    gb, gs = gathered_weight_bytes(spec, STEP), sum(gathered_weight_bytes(spec, [w]) for w in STEP)
    report.compare("demo2_lecture_vs_project", f"demo 2: {n} mixed-phase requests (the demo-1 step), batched vs "
                   "one by one, the lecture's figures beside ours", {
        "max |logit difference|": (LECTURE["max_logit_diff"], diff, f"{diff:.1e}"),
        "same greedy next token": ("all", same, f"{same}/{n}"),
        "FLOPs (counted): batched / one by one": ("equal", [fb["total"], fs["total"]],
                                                  f"{fb['total']:,} / {fs['total']:,}"),
        "K/V bytes read+written: batched / one by one": ("equal", [kv_b_bytes, kv_s_bytes],
                                                         f"{kv_b_bytes:,} / {kv_s_bytes:,}"),
        "weight bytes: one by one / batched": (LECTURE["weight_bytes_ratio"], ws / wb, f"{ws / wb:.2f}x"),
        "  same, embedding charged per row gathered": ("-", gs / gb, f"{gs / gb:.3f}x")},
        note=(f"Every parameter is charged once per forward, so {n} forwards read the weights {n} times: the "
              f"ratio is the number of forwards ({gs / gb:.3f}x with the embedding charged per row gathered). "
              "FLOPs and K/V bytes do not change: batching saves only the repeated weight reads."))
    report.put("demo2", {
        "n_requests": n, "max_abs_logit_diff": diff, "same_greedy_tokens": same == n,
        "flops_batched": fb, "flops_one_by_one": fs,
        "kv_bytes_batched": kv_b_bytes, "kv_bytes_one_by_one": kv_s_bytes,
        "weight_bytes_batched": wb, "weight_bytes_one_by_one": ws, "weight_bytes_ratio": ws / wb,
        "weight_bytes_ratio_gathered_embedding": gs / gb, "lecture_weight_bytes_ratio": LECTURE["weight_bytes_ratio"],
    })


def demo3(args: argparse.Namespace, report: Report) -> None:
    """§1.1: one decode step of 64 requests on the CPU, batched vs one by one (median of repeats)."""
    n_req, repeats = (32, 3) if args.quick else (64, 9)
    model = OrcaModel("mini", seed=args.seed)
    t = decode_step_times(model, n_requests=n_req, repeats=repeats, seed=args.seed)
    ops_b, ops_s = decode_op_counts(model, n_req, args.seed)
    mm_one = weight_matmul_time(model, 1, repeats) * n_req
    mm_batch = weight_matmul_time(model, n_req, repeats)
    spec, mb = model.spec, weight_matmul_bytes(model)
    bw = n_req * mb / mm_one / 1e9
    f = spec.step_flops([SeqWork(1, 1)] * n_req)
    flops = f["linear"] + f["lm_head"]                       # the weight matmuls' share of the step
    gflops = flops / mm_batch / 1e9
    b_ms, s_ms = t["batched_s"] * 1e3, t["one_by_one_s"] * 1e3
    report.compare("demo3_lecture_vs_project", f"demo 3: one decode step, {n_req} requests, mini "
                   f"({spec.n_params / 1e6:.1f}M params, fp32), median of {repeats}: the lecture "
                   f"({LECTURE['n_requests']} requests, Apple M4 Pro, numpy) beside this CPU (torch, "
                   f"{args.threads} thread(s))", {
        "one by one (ms)": (LECTURE["one_by_one_ms"], s_ms), "batched (ms)": (LECTURE["batched_ms"], b_ms),
        "speed-up": (LECTURE["speedup"], t["speedup"], f"{t['speedup']:.1f}x")}, digits=3)
    def split(total_ms: float, mm_ms: float, ops: int) -> list[str]:   # n/a: the matmuls, timed apart, outlasted it
        rest = total_ms - mm_ms
        return [f"{mm_ms:.1f}", "n/a", "n/a"] if rest < 0 else [
            f"{mm_ms:.1f} ({mm_ms / total_ms:.0%})", f"{rest:.1f} ({rest / total_ms:.0%})", f"{rest * 1e3 / ops:.1f}"]

    one, batched = split(s_ms, mm_one * 1e3, ops_s), split(b_ms, mm_batch * 1e3, ops_b)
    moved = " Here the matmuls alone outlasted a whole step timed earlier: the machine's speed moved between " \
            "the two timings, so the split is left out (rerun on a quiet machine)." if "n/a" in one + batched else ""
    report.section("demo3.bounds", "demo 3: what bounds each side on this machine", [
        ["one by one", f"{s_ms:.1f}", one[0], f"{n_req} x {mb / 1e6:.1f} MB streamed at {bw:.1f} GB/s",
         one[1], f"{ops_s:,}", one[2]],
        ["batched", f"{b_ms:.1f}", batched[0], f"{flops / 1e9:.2f} GFLOP at {gflops:.0f} GFLOP/s", batched[1],
         f"{ops_b:,}", batched[2]],
    ], ["step", "total ms", "weight matmuls ms (share)", "the matmuls", "everything else ms (share)",
        "aten ops dispatched", "us per op (else / ops)"],
        note=("One by one: matrix-vector products streaming every weight matrix, plus a fixed cost per small torch "
              f"op ({ops_s // n_req} ops x {n_req} forwards). Batched: weights read once, compute-bound matmuls, and "
              "per-op dispatch in the per-request attention loop. Medians on a shared machine." + moved))
    report.put("demo3", {
        "n_requests": n_req, "repeats": repeats, "threads": args.threads,
        "one_by_one_ms": s_ms, "batched_ms": b_ms, "speedup": t["speedup"],
        "aten_ops_one_by_one": ops_s, "aten_ops_batched": ops_b,
        "weight_matmuls_one_by_one_ms": mm_one * 1e3, "weight_matmuls_batched_ms": mm_batch * 1e3,
        "one_by_one_weight_bandwidth_gb_s": bw, "batched_matmul_gflop_s": gflops,
        "lecture_one_by_one_ms": LECTURE["one_by_one_ms"], "lecture_batched_ms": LECTURE["batched_ms"],
        "lecture_speedup": LECTURE["speedup"], "lecture_n_requests": LECTURE["n_requests"],
    })


def demo4(args: argparse.Namespace, report: Report) -> None:
    """§4.1: the same Orca scheduler on the real torch model, clocked in iterations."""
    d = timeline_demo4("tiny" if args.quick else "mini", seed=args.seed)
    report.text("\n== demo 4: continuous vs static batching on the real model (max_bs 3)")
    report.text(format_demo4(d))
    report.compare("demo4_lecture_vs_project", "demo 4: the lecture's figures beside ours", {
        "iterations, continuous batching": (10, d.continuous_iterations),
        "iterations, static batching": (18, d.static_iterations),
        "tokens equal generating each request alone": (True, d.tokens_match)})
    report.plot("02_timelines", plots.timelines, {"continuous batching": d.continuous_rows,
                                                  "static batching": d.static_rows},
                f"Code 02 demo 4: six requests, max_bs 3, the real '{'tiny' if args.quick else 'mini'}' model")
    report.put("demo4", {
        "continuous_iterations": d.continuous_iterations, "static_iterations": d.static_iterations,
        "continuous_rows": d.continuous_rows, "static_rows": d.static_rows,
        "tokens_match_alone": d.tokens_match, "static_tokens_match_alone": d.static_tokens_match,
        "lecture_continuous_iterations": 10, "lecture_static_iterations": 18,
    })


DEMOS: list[Callable[[argparse.Namespace, Report], None]] = [demo1, demo2, demo3, demo4]


def main(argv: list[str] | None = None) -> dict:
    return run_experiment(__doc__, DEMOS, argv=argv, flags=("threads", "plot"),
                          within=lambda args: torch_threads(args.threads), plots_from=(demo4,))


if __name__ == "__main__":
    main()
