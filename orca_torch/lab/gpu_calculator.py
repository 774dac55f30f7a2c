"""The paper-GPU calculator: one step's price and a card's K/V capacity.

    python -m orca_torch.lab.gpu_calculator --model llama-3-8b --gpu h100 --batch 256 --context 1024

Prints one step's time under the chosen cost model (`--cost-model roofline`, the lecture's, or
`refined`, with the step's GEMM / attention / elementwise / overhead breakdown), its bound, FLOPs
and bytes, the card's K/V capacity in both memory conventions (decimal GB as the lecture, GiB as
vLLM) and the requests that fit under a reservation; `--within-ms 20 --context 512 8192` adds the
largest decode batch whose step fits the budget (lecture §2.6; a time bound alone, beside how many
such sequences the K/V memory holds; `--prompt` is not in it). `--gpu` also takes a JSON GPU
profile's path. `--json` prints the same figures as one JSON object.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from orca_torch.checks import check_int
from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.lab.cli_args import (command_parser, count_arg, flag_names, float_arg, gpu_arg, in_flag_terms, int_arg,
                                     positive_float_arg)
from orca_torch.lab.report import Report, quiet_exit
from orca_torch.sim.hw_model.capacity import DEFAULT_MEM_FRACTION, DEFAULT_MEM_UNIT, MEM_UNITS, MemoryPlan, memory_plan
from orca_torch.sim.hw_model.cost import COST_MODELS, MAX_BATCH_SEARCHED, decode_totals, max_batch_within, pricer
from orca_torch.sim.hw_model.gpus import GPUSpec, get_gpu, known_gpus
from orca_torch.sim.hw_model.refined_params import ATTENTION_MODES
from orca_torch.specs import PRESETS, ModelSpec, get_model_spec

fraction_arg = float_arg(1.0)     # a share of the card: in (0, 1]


def _parser() -> argparse.ArgumentParser:
    p = command_parser(prog="python -m orca_torch.lab.gpu_calculator", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3-8b",
                   help=f"model preset: {', '.join(sorted(PRESETS))} (default llama-3-8b)")
    p.add_argument("--gpu", type=gpu_arg, default="h100",
                   help=f"card: {', '.join(known_gpus())} (cpu is measured), or a GPU profile's .json path "
                        "(default h100)")
    p.add_argument("--cost-model", choices=COST_MODELS, default="roofline",
                   help="roofline (the lecture's, default) or refined (GEMMs by shape, elementwise, causal tiles)")
    p.add_argument("--batch", type=int_arg(0, 2**53, what="an integer from 0 to 2**53"), default=1,
                   help="decodes in the step (default 1)")
    p.add_argument("--context", type=int_arg(2), nargs="+", default=None,
                   help="tokens each decode attends to, its new one included (one row per value; default "
                        "1024, or the model's max context if shorter; with --batch 0, for --within-ms alone)")
    p.add_argument("--prompt", type=int_arg(0), default=0,
                   help="add one prefill of this many tokens to the step (default 0: none)")
    p.add_argument("--tp", type=count_arg, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--pp", type=count_arg, default=1, help="pipeline stages (default 1)")
    p.add_argument("--reserve", type=count_arg, default=None,
                   help="K/V tokens reserved per request (default: max context)")
    p.add_argument("--mem-fraction", type=fraction_arg, default=None,
                   help=f"share of memory for weights + K/V (default {DEFAULT_MEM_FRACTION:g}; not with "
                        "--kv-budget-gib)")
    p.add_argument("--mem-unit", choices=tuple(MEM_UNITS), default=DEFAULT_MEM_UNIT,
                   help="what the card's nominal memory counts: GB (the lecture's, default) or GiB (vLLM's)")
    p.add_argument("--kv-budget-gib", type=positive_float_arg, default=None,
                   help="explicit K/V budget per device, GiB (default: what the memory share leaves)")
    p.add_argument("--flop-efficiency", type=fraction_arg, default=None,
                   help="share of peak FLOP/s reached (default: the card's; 0.7 on the datasheet cards, 1.0 on "
                        "the measured cpu)")
    p.add_argument("--bw-efficiency", type=fraction_arg, default=None,
                   help="share of peak memory bandwidth reached (default: the card's; 0.8 on the datasheet cards, "
                        "1.0 on the measured cpu)")
    p.add_argument("--overhead-ms", type=float_arg(unit="milliseconds", zero=True), default=None,
                   help="fixed time per step (default: roofline 0, refined the card's launch overhead)")
    p.add_argument("--attention", choices=ATTENTION_MODES, default=None,
                   help="attention counting (default: roofline full, refined causal-tiles; causal-tiles needs "
                        "--cost-model refined)")
    p.add_argument("--attention-tile", type=count_arg, default=None,
                   help="refined causal-tiles block size, tokens (default: the card's, 128 on the datasheet cards)")
    p.add_argument("--within-ms", type=positive_float_arg, default=None,
                   help="also print the largest decode batch whose step fits this many ms, per --context "
                        "(decodes only; beside what the K/V memory holds)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    return p


def _ms(x: float) -> float:
    """Milliseconds to 6 significant figures (a small model's step is a fraction of a microsecond)."""
    return float(f"{x * 1e3:.6g}")


def main(argv: Sequence[str] | None = None) -> dict:
    p = _parser()
    words = sys.argv[1:] if argv is None else list(argv)
    a, stray = p.parse_known_args(words)
    if stray:
        p.error(_unrecognized(words, stray))
    try:
        with quiet_exit():
            return _print(a, _calculate(a))
    except ValueError as e:             # (a refusal of the library's, said in the flags typed)
        p.error(in_flag_terms(str(e), flag_names(p)))


def _unrecognized(words: list[str], stray: list[str]) -> str:
    """argparse's refusal of the `stray` words; for more numbers after --batch's one (as --context
    takes several), what the calculator takes instead."""
    for i, w in enumerate(words):
        if w != "--batch" and not w.startswith("--batch="):
            continue
        start = i + 2 if w == "--batch" else i + 1
        more = list(itertools.takewhile(lambda x: not x.startswith("--"), words[start:]))
        if more and stray[:len(more)] == more:
            given = " ".join(words[i + 1:start] + more if w == "--batch" else [w.split("=", 1)[1], *more])
            return (f"--batch takes one batch size, got {given}: price each batch size in a run of its own "
                    "(--context takes several, a row each; --within-ms finds the largest batch a step time allows)")
    return f"unrecognized arguments: {' '.join(stray)}"


@dataclass(frozen=True)
class _Figures:
    """What the calculator prints, all computed before any of it is: a bad flag prints only its error."""

    model: ModelSpec
    gpu: GPUSpec
    pricer: Any
    plan: MemoryPlan
    contexts: list[int]
    reserve: int
    mem_fraction: float
    budget: float | None
    steps: list[dict]
    memory: dict
    conventions: dict
    within: list[dict]


def _calculate(a: argparse.Namespace) -> _Figures:
    """The step's price at each --context, the K/V capacity, the batch --within-ms allows; ValueError
    for flags that are fine alone but not with the model or with each other."""
    m, g = get_model_spec(a.model), get_gpu(a.gpu)
    contexts = a.context or [min(1024, m.max_context)]
    twice = sorted({c for c in contexts if contexts.count(c) > 1})
    if twice:
        raise ValueError(f"--context names {', '.join(map(str, twice))} twice; give each context once")
    reserve = a.reserve if a.reserve is not None else m.max_context
    lengths = (("--prompt", a.prompt, 0), *(("--context", c, 2) for c in contexts), ("--reserve", reserve, 1))
    for flag, v, lo in lengths:     # argparse checked the lower bounds; the model sets the upper one
        check_int(f"{flag} (at most {m.name}'s max context)", v, lo, m.max_context)
    if a.batch == 0 and a.prompt == 0:
        raise ValueError("the step is empty: give --batch >= 1 or --prompt >= 1")
    if a.batch == 0 and a.context and a.within_ms is None:
        raise ValueError("--context is the decodes' context, but with --batch 0 the step is the --prompt prefill "
                         "alone: leave --context out, or give --batch >= 1 (or --within-ms, which reads it)")
    settings = dict(cost_model=a.cost_model, tp=a.tp, pp=a.pp, flop_efficiency=a.flop_efficiency,
                    bw_efficiency=a.bw_efficiency, overhead_s=None if a.overhead_ms is None else a.overhead_ms / 1e3,
                    attention=a.attention, attention_tile=a.attention_tile)
    pr = pricer(m, g, **settings)
    if a.kv_budget_gib is not None and a.mem_fraction is not None:
        raise ValueError("--kv-budget-gib and --mem-fraction both set the K/V budget; give one of them")
    mem_fraction = DEFAULT_MEM_FRACTION if a.mem_fraction is None else a.mem_fraction
    budget = None if a.kv_budget_gib is None else a.kv_budget_gib * 2**30
    if budget is not None and not math.isfinite(budget):
        raise ValueError(f"--kv-budget-gib {a.kv_budget_gib:g} is too large to count in bytes: give a budget the card "
                         "could hold")
    plan = memory_plan(m, g, mem_fraction=mem_fraction, tp=a.tp, pp=a.pp, kv_budget_bytes=budget,
                       mem_unit=a.mem_unit)
    conventions = {}
    for unit in MEM_UNITS:
        try:
            pl = memory_plan(m, g, mem_fraction=mem_fraction, tp=a.tp, pp=a.pp, mem_unit=unit)
        except ValueError as e:
            raise ValueError(f"{e} (memory counted in {unit})") from None
        conventions[unit] = {"usable_gb_per_device": pl.usable_bytes / 1e9, "kv_capacity_tokens": pl.kv_tokens,
                             "max_requests": pl.kv_tokens // reserve}
    prefill = StepTotals.of([SeqWork(a.prompt)]) if a.prompt else StepTotals()
    steps = []
    for c in (contexts if a.batch else [None]):         # (no decodes: one row, the prefill's, at no context)
        decodes = decode_totals(a.batch, c) if a.batch else StepTotals()
        cost, kv_tokens = pr.cost(decodes + prefill), a.batch * (c or 0) + a.prompt
        extra = {f"{k[:-2]}_ms": _ms(v) for k, v in cost.breakdown.items()}
        steps.append({"context": c, "batch": a.batch, "prompt": a.prompt, "cost_model": cost.cost_model,
                      "time_ms": _ms(cost.time_s), "breakdown_ms": extra,
                      "bound": cost.bound, "compute_ms": _ms(cost.compute_s), "memory_ms": _ms(cost.memory_s),
                      "comm_ms": _ms(cost.comm_s), "tp_comm_ms": _ms(cost.tp_comm_s),
                      "pp_comm_ms": _ms(cost.pp_comm_s), "stage_ms": _ms(cost.stage_s),
                      "flops": cost.flops, "bytes": cost.bytes,
                      "kv_tokens": kv_tokens, "kv_fits": kv_tokens <= plan.kv_tokens})
    mem = {"weight_gb_per_device": plan.weight_bytes_per_device / 1e9,
           "kv_budget_gb_per_device": plan.kv_budget_bytes / 1e9,
           "kv_bytes_per_token_per_device": plan.kv_bytes_per_token_per_device,
           "kv_capacity_tokens": plan.kv_tokens, "reserve_tokens": reserve,
           "max_requests": plan.kv_tokens // reserve, "mem_unit": a.mem_unit}
    within = []
    if a.within_ms is not None:
        budget_s = max(a.within_ms / 1e3, math.ulp(0.0))    # (under the least float of seconds: still > 0)
        for c in contexts:
            try:            # (the context and settings are checked above: the search's limit is what is left)
                b = max_batch_within(m, g, budget_s, c, **settings)
            except ValueError:
                raise ValueError(f"--within-ms {a.within_ms:g} fits more than {MAX_BATCH_SEARCHED:,} decodes at "
                                 f"context {c} in a step, more than the search counts: give a smaller budget") from None
            within.append({"context": c, "budget_ms": a.within_ms, "max_batch": b,
                           "time_ms": _ms(pr.time(decode_totals(b, c))) if b else None,
                           "kv_holds": plan.kv_tokens // c})
    return _Figures(m, g, pr, plan, contexts, reserve, mem_fraction, budget, steps, mem, conventions, within)


def _or_na(x: object) -> object:
    """A table cell: `x`, or "n/a" for a figure the step has none of (a prefill alone has no context)."""
    return "n/a" if x is None else x


def _print(a: argparse.Namespace, f: _Figures) -> dict:
    """The tables (or, with --json, one JSON object); returns the figures as the JSON holds them."""
    m, g, pr, plan, steps, mem, within = f.model, f.gpu, f.pricer, f.plan, f.steps, f.memory, f.within
    rep = Report(as_json=a.json)
    rep.put("model", m.name)
    rep.put("gpu", g.name)
    rep.put("cost_model", a.cost_model)
    rep.text(f"{m.name} ({m.n_params:,} params, {m.weight_bytes / 1e9:.2f} GB) on {g.name}: {g.source}")
    if a.cost_model == "roofline":
        fe = a.flop_efficiency if a.flop_efficiency is not None else g.flop_efficiency
        be = a.bw_efficiency if a.bw_efficiency is not None else g.bw_efficiency
        rep.put("settings", {"tp": a.tp, "pp": a.pp, "flop_efficiency": fe, "bw_efficiency": be,
                             "overhead_ms": pr.overhead_s * 1e3, "attention": pr.attention})
        rep.text(f"cost model: roofline; tp {a.tp}, pp {a.pp}; efficiency: compute {fe}, memory {be}; "
                 f"overhead {pr.overhead_s * 1e3} ms/step; attention {pr.attention}")
    else:
        rp = pr.params.to_dict()
        rep.put("settings", {"tp": a.tp, "pp": a.pp, "overhead_ms": pr.overhead_s * 1e3, "attention": pr.attention,
                             "attention_tile": pr.tile, "refined": rp})
        rep.text(f"cost model: refined; tp {a.tp}, pp {a.pp}; " + ", ".join(f"{k} {v}" for k, v in rp.items())
                 + f"; attention {pr.attention} (tile {pr.tile})")
    rep.put("step", steps)
    if a.cost_model == "refined":
        rep.section("breakdown", "refined step breakdown (ms, summed along the pipeline)",
                    [[_or_na(s["context"]), s["batch"], s["prompt"], s["time_ms"], *s["breakdown_ms"].values()]
                     for s in steps],
                    ["context", "batch", "prompt", "step ms", *(k[:-3] for k in steps[0]["breakdown_ms"])],
                    floatfmt=".4g")
    rep.section("step", f"one step ({a.cost_model}): --batch decodes at each --context (+ one --prompt prefill)",
                [[_or_na(s["context"]), s["batch"], s["prompt"], s["time_ms"], s["bound"], s["compute_ms"],
                  s["memory_ms"], s["comm_ms"], s["flops"]["total"] / 1e12, s["bytes"]["weights"] / 1e9,
                  s["bytes"]["kv_read"] / 1e9, s["bytes"]["kv_write"] / 1e9] for s in steps],
                ["context", "batch", "prompt", "step ms", "bound", "compute ms", "memory ms", "comm ms",
                 "TFLOP", "weights GB", "K/V read GB", "K/V write GB"],
                note=("memory charges weights + K/V of every context token once (cached read, new written);"
                      " activations are reported in --json only") if a.cost_model == "roofline" else
                "compute/memory: the GEMMs' and attention's two sides (+ elementwise traffic on memory)",
                floatfmt=".4g")
    for st in steps:
        if not st["kv_fits"]:
            where = "the prefill alone" if st["context"] is None else f"context {st['context']}"
            rep.text(f"{where}: the step holds {st['kv_tokens']:,} tokens of K/V, more than the "
                     f"{plan.kv_tokens:,} the K/V memory holds (below): it could not run so configured; its time "
                     "is what it would take")
    rep.put("memory", mem)
    how = (f"explicit {a.kv_budget_gib:g} GiB = {f.budget / 1e9:.3f} GB" if f.budget is not None
           else f"{f.mem_fraction} x {g.mem_bytes / 1e9:g} {a.mem_unit} - weights")
    # mem_unit counts the card, which a given budget leaves out of the capacity
    shown = {k: v for k, v in mem.items() if k != "mem_unit" or f.budget is None}
    rep.section("memory", f"K/V capacity per device ({how})",
                [[k, f"{v:,}" if isinstance(v, int) else (f"{v:.3f}" if isinstance(v, float) else v)]
                 for k, v in shown.items()],
                ["quantity", "value"])
    rep.put("memory_conventions", f.conventions)
    rep.section("memory_conventions",
                f"K/V capacity under both memory conventions ({f.mem_fraction} of the card for weights + K/V; "
                f"reservation {f.reserve} tokens)",
                [[u, f"{g.mem_bytes / 1e9:g} {u}", f"{c['usable_gb_per_device']:.2f}", f"{c['kv_capacity_tokens']:,}",
                  c["max_requests"]] for u, c in f.conventions.items()],
                ["unit", "card", "usable GB", "K/V tokens", "requests"],
                note=f"GB: decimal, as the lecture counts ({f.conventions['GB']['max_requests']:,} requests of "
                     f"{f.reserve:,} tokens for {m.name} on {g.name}); GiB: the nominal figure in GiB, near the "
                     "driver's count that vLLM takes a share of")
    if within:
        rep.put("max_batch_within", within)
        alone = [c for c, w in zip(f.contexts, within) if not w["max_batch"]]
        note = None if not alone else (
            "no batch fits at context " + ", ".join(
                f"{c} (one sequence alone takes {_ms(pr.time(decode_totals(1, c))):.3g} ms)" for c in alone))
        rep.section("max_batch_within", f"largest batch of decodes (no prompt) whose step takes at most "
                    f"{a.within_ms} ms, and how many such sequences the K/V memory holds",
                    [[w["context"], w["max_batch"], _or_na(w["time_ms"]), w["kv_holds"]]
                     for w in within], ["context", "max batch", "step ms", "K/V holds"], note=note)
    rep.finish()
    return rep.results


if __name__ == "__main__":
    main(sys.argv[1:])
