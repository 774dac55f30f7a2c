"""The engine as a server runs it: 64 greedy requests at once through Engine + TorchExecutor (lecture §5.1).

    python benchmarks/bench_engine.py [--requests 64] [--new-tokens 48] [--threads 1,2]
                                      [--attention split,fused] [--hf] [--seed 0] [--quick] [--json] [--profile]

A Llama shape of about 22M parameters (vocab 16,000, hidden 384, 6 layers, 6 heads, 2 K/V heads,
FFN 1,024), fp32 on the CPU; prompts of 17-127 tokens (seeded), all arriving at t = 0. For each
attention path and thread count: output tokens per second, and the run's compute roofline on this
machine measured in the same run: the run's useful matmul FLOPs (`ModelSpec.step_flops` of every
step with causal attention: the (query, key) pairs the mask keeps, no padding; the same for both
paths) over the best fp32 512^3 matmul rate measured just before and just after the run at the
same thread count (on one thread of this AVX2 CPU that rate is about the core's FMA peak). The
FLOPs each path executed are printed beside them: the split loop computes each prefill's full
masked rectangle, the fused path also pads its decode rows to the longest context. The ratio
wall / roofline says how far the engine is from doing nothing but useful matmuls at full speed;
on a shared machine the process's CPU time per thread over the roofline is the steadier figure
(time spent waiting for a core is not in it). "Matmuls alone" replays only the run's
weight matmuls at their own shapes (skinny decode rows and large prefill outputs run well below
the 512^3 rate here): CPU time over it is what the rest of the step (attention, copies, Python,
dispatch) adds.
The greedy tokens of every path and thread count are checked to be the same (with one of each,
nothing is compared, and the last line says so; `same_tokens` is null in the JSON).
`--hf` also runs transformers' `generate` (the `hf` extra) at each thread count, the baseline a reader
knows: the same weights (copied into a `LlamaForCausalLM`), fp32, all the requests in one batch
(left-padded, as `generate` takes a batch), greedy, the same new tokens each, warmed up the same way,
its matmul rate taken around it; its tokens are compared with the engine's like the paths'.
`--profile` prints torch.profiler's top ops for one run of each path (one thread).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from orca_torch.model.accounting import torch_threads  # noqa: E402
from orca_torch.core.batch import SeqWork  # noqa: E402
from orca_torch.checks import brief, brief_items, check_fits_in_memory  # noqa: E402
from orca_torch.lab.cli_args import add_seed_flag, command_parser, count_arg, threads_arg  # noqa: E402
from orca_torch.core.engine import Engine  # noqa: E402
from orca_torch.model.torch_executor import TorchExecutor  # noqa: E402
from orca_torch.core.memory import UnlimitedMemory, slots_to_finish  # noqa: E402
from orca_torch.model.orca_model import ATTENTION_PATHS, OrcaModel  # noqa: E402
from orca_torch.core.request import Request  # noqa: E402
from orca_torch.lab.report import machine, machine_line, quiet_exit  # noqa: E402
from orca_torch.core.scheduler_config import SchedulerConfig  # noqa: E402
from orca_torch.specs import ModelSpec  # noqa: E402

SPEC = ModelSpec(name="bench-20m", n_layers=6, hidden=384, n_heads=6, n_kv_heads=2, head_dim=64,
                 intermediate=1024, vocab=16000, max_context=256, dtype_bytes=4, rope_theta=10_000.0)


def matmul_rate(n: int = 512, repeats: int = 25) -> float:
    """Best fp32 n^3 matmul rate (FLOP/s) at the current thread count."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def matmul_only_s(model: OrcaModel, shapes: dict[tuple[int, int], int], repeats: int = 3) -> float:
    """CPU seconds per thread the run's weight matmuls alone take at their own shapes:
    for each distinct step shape (rows, sequences), the best of `repeats` replays of every layer's
    projections on `rows` token rows and the LM head on `sequences` rows, times how often it ran."""
    g = torch.Generator().manual_seed(0)
    mats = [w for blk in model.layers for w in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down)]
    total = 0.0
    for (rows, seqs), count in shapes.items():
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=g) for w in mats}
        head_x = torch.randn(seqs, SPEC.hidden, generator=g)

        def replay() -> None:
            for w in mats:
                torch.nn.functional.linear(xs[w.shape[1]], w)
            model.lm_head(head_x)

        replay()
        best = math.inf
        for _ in range(repeats):
            t0 = time.process_time()
            replay()
            best = min(best, (time.process_time() - t0) / torch.get_num_threads())
        total += best * count
    return total


def hf_twin(model: OrcaModel):
    """transformers' `LlamaForCausalLM` holding `model`'s weights: the inverse of `OrcaModel.from_hf`'s
    loading (the fused QKV and gate/up matrices split back into HF's projections)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = model.spec
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.n_layers,
        num_attention_heads=s.n_heads, num_key_value_heads=s.n_kv_heads, head_dim=s.head_dim,
        max_position_embeddings=s.max_context, rms_norm_eps=s.norm_eps, rope_theta=s.rope_theta,
        tie_word_embeddings=s.tied_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=0))
    state = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.final_norm,
             "lm_head.weight": model.lm_head.weight}
    for i, blk in enumerate(model.layers):
        q, k, v = blk.wqkv.split([s.q_dim, s.kv_dim, s.kv_dim])
        gate, up = blk.w_gate_up.split([s.intermediate, s.intermediate])
        state |= {f"model.layers.{i}.{name}": w for name, w in (
            ("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", k), ("self_attn.v_proj.weight", v),
            ("self_attn.o_proj.weight", blk.wo), ("mlp.gate_proj.weight", gate), ("mlp.up_proj.weight", up),
            ("mlp.down_proj.weight", blk.w_down), ("input_layernorm.weight", blk.attn_norm),
            ("post_attention_layernorm.weight", blk.mlp_norm))}
    hf.load_state_dict({k: w.detach() for k, w in state.items()}, strict=True)
    return hf.eval()


def run_hf(hf, requests: list[Request], new: int) -> dict:
    """transformers' greedy `generate` of `new` tokens for every request, in one left-padded batch."""
    width = max(r.prompt_len for r in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_ids)
        mask[i, width - r.prompt_len:] = 1
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    output_ids = {r.req_id: out[i, width:].tolist() for i, r in enumerate(requests)}
    return {"wall_s": wall, "cpu_s": cpu, "n_steps": new, "tokens": sum(map(len, output_ids.values())),
            "output_ids": output_ids}


HF = "transformers"     # `--hf`'s rows, in the attention column

PROMPT_LENS = (17, 128)        # prompts of 17..127 tokens
FULL = (64, 48, [t for t in (1, 2) if t <= (os.cpu_count() or 1)])     # (requests, new tokens, thread counts)
QUICK = (16, 12, [1])


def threads_list_arg(text: str) -> list[int]:
    """argparse type for `--threads`: comma-separated thread counts, each as `report.threads_arg` allows."""
    try:
        counts = [threads_arg(t.strip()) for t in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"comma-separated thread counts, e.g. 1,2: {e}") from None
    if len(set(counts)) < len(counts):
        raise argparse.ArgumentTypeError(f"{brief(text)} names a thread count twice; give each once")
    return counts


def attention_list_arg(text: str) -> list[str]:
    """argparse type for `--attention`: comma-separated attention paths."""
    paths = [x.strip() for x in text.split(",")]
    bad = [x for x in paths if x not in ATTENTION_PATHS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown attention path(s) {brief_items(bad)}; give comma-separated "
                                         f"paths from {', '.join(ATTENTION_PATHS)}")
    if len(set(paths)) < len(paths):
        raise argparse.ArgumentTypeError(f"{brief(text)} names a path twice; give each once")
    return paths


def make_requests(n: int, new_tokens: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(*PROMPT_LENS, size=n)
    return [Request(i, 0.0, int(p), new_tokens, prompt_ids=rng.integers(0, SPEC.vocab, size=int(p)).tolist())
            for i, p in enumerate(lens)]


def run_once(model: OrcaModel, requests: list[Request]) -> dict:
    kv = model.new_kv(sum(map(slots_to_finish, requests)))
    engine = Engine(TorchExecutor(model, kv), UnlimitedMemory(), SchedulerConfig(max_bs=len(requests)), trace=True)
    t0, c0 = time.perf_counter(), time.process_time()
    res = engine.run(requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    executed = useful = 0
    shapes: dict[tuple[int, int], int] = {}
    for _, _, _, works in res.trace:
        sw = [SeqWork(n, p) for _, n, p in works]
        key = (sum(w.n_new for w in sw), len(sw))
        shapes[key] = shapes.get(key, 0) + 1
        executed += SPEC.step_flops(model.executed_works(sw))["total"]
        useful += SPEC.step_flops(sw, attention="causal")["total"]
    step_s = res.step_end - res.step_start
    return {"wall_s": wall, "cpu_s": cpu, "step_s": float(np.sum(step_s)), "first_step_s": float(step_s[0]),
            "n_steps": res.n_steps, "executed_flops": executed, "useful_flops": useful,
            "tokens": int(sum(len(v) for v in res.output_ids.values())), "output_ids": res.output_ids,
            "shapes": shapes}


def figures(label: str, n_threads: int, r: dict, rate: float) -> dict:
    """One run's row: `r`'s times and FLOPs (`run_once`'s or `run_hf`'s) with the matmul `rate` taken
    around it, the tokens per second and the ratios to the roofline (and to the matmuls alone, where
    replayed)."""
    roof = r["useful_flops"] / rate
    row = {"attention": label, "threads": n_threads, **r, "matmul_gflops": rate / 1e9,
           "tok_per_s": r["tokens"] / r["wall_s"], "roofline_s": roof, "ratio": r["wall_s"] / roof,
           "cpu_ratio": r["cpu_s"] / n_threads / roof}
    if "matmul_only_s" in r:
        row["cpu_over_matmul_only"] = r["cpu_s"] / n_threads / r["matmul_only_s"]
    return row


def table_row(row: dict) -> list:
    """`figures`' row as the table prints it (n/a: not counted for transformers' run)."""
    def cell(key: str, fmt: str, scale: float = 1.0) -> str:
        return format(row[key] / scale, fmt) if key in row else "n/a"

    return [row["attention"], row["threads"], row["n_steps"], cell("wall_s", ".2f"), cell("cpu_s", ".2f"),
            cell("tok_per_s", ".0f"), cell("useful_flops", ".1f", 1e9), cell("executed_flops", ".1f", 1e9),
            cell("matmul_gflops", ".1f"), cell("roofline_s", ".2f"), cell("ratio", ".2f"), cell("cpu_ratio", ".2f"),
            cell("matmul_only_s", ".2f"), cell("cpu_over_matmul_only", ".2f")]


def main() -> None:
    p = command_parser(__doc__.splitlines()[0])
    p.add_argument("--requests", type=count_arg, default=None,
                   help=f"requests, all arriving at t=0 (default {FULL[0]}; {QUICK[0]} with --quick)")
    p.add_argument("--new-tokens", type=count_arg, default=None,
                   help=f"greedy tokens per request, at most {SPEC.max_context - PROMPT_LENS[1] + 1} (the longest "
                        f"prompt plus these must fit the context of {SPEC.max_context}); default {FULL[1]} "
                        f"({QUICK[1]} with --quick)")
    p.add_argument("--threads", type=threads_list_arg, default=None,
                   help="comma-separated torch thread counts, each at most this machine's cores (default 1,2 where there "
                        "are two cores; 1 with --quick)")
    p.add_argument("--attention", type=attention_list_arg, default=list(ATTENTION_PATHS),
                   help=f"comma-separated attention paths from {', '.join(ATTENTION_PATHS)} (default all)")
    add_seed_flag(p, "the weights and the prompts")
    p.add_argument("--hf", action="store_true", help="also run transformers' generate on the same weights, batch "
                   "and tokens at each thread count (needs the hf extra)")
    p.add_argument("--quick", action="store_true", help="16 requests, 12 new tokens, one thread, unless those flags "
                   "are given")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--profile", action="store_true", help="also print torch.profiler's top ops for one run of each "
                   "path (a table: not with --json)")
    a = p.parse_args()
    if a.json and a.profile:
        p.error("--profile prints tables, which would break --json's one JSON object: give one of them")
    for name, full, quick in zip(("requests", "new_tokens", "threads"), FULL, QUICK):
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    if a.hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            p.error("--hf needs transformers: pip install 'orca-torch[hf]'")
    longest = PROMPT_LENS[1] - 1
    if longest + a.new_tokens > SPEC.max_context:
        p.error(f"--new-tokens {a.new_tokens}: prompts of up to {longest} tokens plus {a.new_tokens} new ones exceed "
                f"the model's max context {SPEC.max_context}; --new-tokens may be at most {SPEC.max_context - longest}")
    try:
        check_fits_in_memory(f"--requests {a.requests} x (prompt + {a.new_tokens} new tokens) of K/V and the fp32 "
                             f"weights" + (", twice (transformers' copy and cache)" if a.hf else ""),
                             (1 + a.hf) * (SPEC.weight_bytes
                                           + SPEC.kv_bytes_per_token * a.requests * (longest + a.new_tokens)))
    except ValueError as e:
        p.error(str(e))
    threads, paths = a.threads, a.attention
    model = OrcaModel(SPEC, seed=a.seed)
    hf = hf_twin(model) if a.hf else None
    requests = make_requests(a.requests, a.new_tokens, a.seed)
    out, tokens = [], {}
    for n_threads in threads:
        with torch_threads(n_threads):
            for path in paths:
                model.attention = path
                run_once(model, make_requests(4, 2, a.seed))             # warm-up, of the path timed next
                before = matmul_rate()
                r = run_once(model, requests)
                rate = max(before, matmul_rate())
                tokens[(path, n_threads)] = r.pop("output_ids")
                r["matmul_only_s"] = matmul_only_s(model, r.pop("shapes"))
                out.append(figures(path, n_threads, r, rate))
            if hf is not None:
                run_hf(hf, make_requests(4, 2, a.seed), 2)                   # warm-up
                before = matmul_rate()
                r = run_hf(hf, requests, a.new_tokens)
                rate = max(before, matmul_rate())
                tokens[(HF, n_threads)] = r.pop("output_ids")
                r["useful_flops"] = out[-1]["useful_flops"]         # (the requests' own, whatever runs them)
                out.append(figures(HF, n_threads, r, rate))
    first = next(iter(tokens))
    differ = [f"{k[0]}@{k[1]}" for k, t in tokens.items() if t != tokens[first]]
    same = None if len(tokens) == 1 else not differ          # (one run: nothing compared)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        with torch_threads(1):
            for path in paths:
                model.attention = path
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    run_once(model, requests)
                print(f"--- {path}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    m = machine(threads)
    if a.json:
        print(json.dumps({"machine": m, "model": SPEC.name, "n_params": SPEC.n_params, "requests": a.requests,
                          "new_tokens": a.new_tokens, "runs": out, "same_tokens": same,
                          "tokens_differ_from_first": differ}, indent=1))
        return
    lens = [r.prompt_len for r in requests]
    print(f"{SPEC.name} ({SPEC.n_params / 1e6:.1f}M params, fp32), {a.requests} requests x {a.new_tokens} new "
          f"tokens, prompts of {min(lens)}-{max(lens)} tokens (drawn from {PROMPT_LENS[0]}-{PROMPT_LENS[1] - 1}), "
          "all at t=0; machine shared, figures are one run's")
    print(machine_line(m))
    print(tabulate([table_row(row) for row in out],
                   headers=["attention", "threads", "steps", "wall s", "CPU s", "tok/s", "GFLOP useful",
                            "GFLOP executed", "matmul GFLOP/s", "roofline s", "wall/roofline", "CPU/threads/roofline",
                            "matmuls alone s", "CPU/threads/matmuls"], disable_numparse=True))
    for n_threads in threads if a.hf else ():
        wall = {row["attention"]: row["wall_s"] for row in out if row["threads"] == n_threads}
        print(f"wall time over transformers' generate at {n_threads} thread(s): "
              + ", ".join(f"{path} {wall[path] / wall[HF]:.2f}" for path in paths))
    if same is None:
        print(f"greedy tokens: one run ({first[0]}@{first[1]}), not compared with another path or thread count")
    else:
        print(f"greedy tokens identical across paths{', transformers' if a.hf else ''} and thread counts: " +
              ("yes" if same else f"NO: {', '.join(differ)} differ from {first[0]}@{first[1]}"))


if __name__ == "__main__":
    with quiet_exit():
        main()
