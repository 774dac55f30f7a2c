"""Serve a few real prompts with a real Llama checkpoint through Orca's engine (lecture §4, §5.1).

    python examples/serve_llama.py /path/to/llama-dir [--prompt TEXT ...] [--new-tokens 32]
                                   [--attention split|fused] [--device cpu|cuda|cuda:N]
                                   [--dtype float32|bfloat16|float16] [--json]

The directory is a local transformers checkpoint (config.json, *.safetensors) with its tokenizer
files (e.g. a Llama 3.2 1B or a TinyLlama download); nothing is fetched from a hub. The weights go
into `OrcaModel.from_hf`, the prompts become `Request`s that all arrive at t = 0, the Engine with
the torch executor runs them with iteration-level scheduling and selective batching, and the
greedy continuations are decoded and printed (each cut at its first end-of-sequence id: the
tokenizer's eos and every `eos_token_id` the checkpoint's config files list).
Needs the `hf` extra: pip install 'orca-torch[hf]'.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

from orca_torch.checks import quoted_path  # noqa: E402
from orca_torch.lab.cli_args import command_parser, count_arg, device_arg, prompt_arg  # noqa: E402
from orca_torch.lab.report import quiet_exit  # noqa: E402
from orca_torch.core.engine import Engine  # noqa: E402
from orca_torch.model.torch_executor import TorchExecutor  # noqa: E402
from orca_torch.core.memory import UnlimitedMemory, slots_to_finish  # noqa: E402
from orca_torch.model.orca_model import ATTENTION_PATHS, OrcaModel  # noqa: E402
from orca_torch.core.request import Request  # noqa: E402
from orca_torch.core.scheduler_config import SchedulerConfig  # noqa: E402
from orca_torch.serve.tokenizer import CheckpointTokenizer, check_tokenizer_files  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Iteration-level scheduling means that",
           "Once upon a time,"]
DTYPES = ("float32", "bfloat16", "float16")


def checkpoint_dir(text: str) -> Path:
    """argparse type: an existing directory with tokenizer files (this example prints text)."""
    if not text:                                # (Path('') is the current directory)
        raise argparse.ArgumentTypeError("is empty; give a local checkpoint directory")
    path = Path(text)
    try:
        there, a_dir = path.exists(), path.is_dir()
    except OSError as e:                        # (a name the file system cannot look up: too long, say)
        raise argparse.ArgumentTypeError(f"cannot read {quoted_path(text)}: {e.strerror or e}") from None
    if not there:
        raise argparse.ArgumentTypeError(f"{quoted_path(text)} does not exist; give a local checkpoint directory")
    if not a_dir:
        raise argparse.ArgumentTypeError(f"{quoted_path(text)} is not a directory; give a local checkpoint directory")
    try:
        check_tokenizer_files(path)             # (this example prints text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return path


def load(path: Path, prompts: list[str], new_tokens: int, attention: str, device: str,
         dtype: str | None) -> tuple[OrcaModel, CheckpointTokenizer, list[Request]]:
    """The model, its tokenizer (the server's: `CheckpointTokenizer`) and the requests, every input
    checked (ValueError says what is wrong)."""
    tok = CheckpointTokenizer(path)
    try:
        model = OrcaModel.from_hf(path, device=device, dtype=dtype, attention=attention)
    except ImportError as e:
        raise ValueError(str(e)) from None
    reqs = [Request(i, 0.0, len(ids), new_tokens, prompt_ids=ids) if ids else None
            for i, ids in enumerate(tok.encode(p) for p in prompts)]
    empty = [i for i, r in enumerate(reqs) if r is None]
    if empty:
        raise ValueError(f"prompts {empty} have no tokens once tokenized; give text the tokenizer keeps")
    for r in reqs:
        outside = sorted({i for i in r.prompt_ids if not 0 <= i < model.spec.vocab})
        if outside:
            raise ValueError(f"prompt {r.req_id} has token ids {outside[:5]} outside the model's vocabulary (ids "
                             f"0..{model.spec.vocab - 1}); is the tokenizer the checkpoint's own?")
    context = model.spec.max_context
    too_long = [r.req_id for r in reqs if r.total_len > context]
    if too_long:
        longest = max(r.prompt_len for r in reqs)
        fix = (f"give --new-tokens {context - longest} at most" if longest < context else
               f"give prompts of at most {context - 1} tokens (the longest has {longest})")
        raise ValueError(f"prompts {too_long} + {new_tokens} new token{'s' * (new_tokens > 1)} exceed the model's "
                         f"context {context}: {fix}")
    return model, tok, reqs


def serve(model: OrcaModel, tok: CheckpointTokenizer, reqs: list[Request], prompts: list[str],
          attention: str) -> list[dict]:
    """Every prompt through one engine run; each completion cut at its first end-of-sequence id (any of
    the tokenizer's `stop_token_ids`: its eos and every one the checkpoint's config files list)."""
    kv = model.new_kv(sum(map(slots_to_finish, reqs)))
    engine = Engine(TorchExecutor(model, kv), UnlimitedMemory(), SchedulerConfig(max_bs=len(reqs)))
    t0 = time.perf_counter()
    res = engine.run(reqs)
    wall = time.perf_counter() - t0
    out = []
    for r, prompt in zip(reqs, prompts):
        ids = res.output_ids[r.req_id]
        ends = [i for i, t in enumerate(ids) if t in tok.stop_token_ids]
        if ends:
            ids = ids[:ends[0]]
        detok = tok.detokenizer(r.prompt_ids)       # (after the prompt: alone, the first word may lose its space)
        out.append({"prompt": prompt, "completion": detok.add(ids, final=True),
                    "output_ids": res.output_ids[r.req_id]})
    n = model.spec.n_params
    size = f"{n / 1e6:.0f}M" if n >= 10**6 else f"{n:,}"     # (a test checkpoint has thousands)
    print(f"{model.spec.name}: {size} params, {len(reqs)} requests, "
          f"{res.n_steps} steps, {wall:.1f} s, attention={attention}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = command_parser(__doc__.splitlines()[0])
    p.add_argument("path", nargs="?", type=checkpoint_dir,       # (optional to argparse: missing, it is refused below)
                   help="needed: a local checkpoint directory (config.json, *.safetensors) with its tokenizer "
                        "files, such as a Llama 3.2 1B or TinyLlama download; nothing is downloaded")
    p.add_argument("--prompt", action="append", type=prompt_arg, help="a prompt (repeatable); default: four examples")
    p.add_argument("--new-tokens", type=count_arg, default=32, help="greedy tokens per prompt at most (default 32)")
    p.add_argument("--attention", choices=ATTENTION_PATHS, default="split",
                   help="split: a loop over requests (the reference); fused: one attention call per layer "
                        "(default split)")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="the weights' dtype (default: the checkpoint's)")
    p.add_argument("--json", action="store_true", help="print the prompts and completions as one JSON list")
    a = p.parse_args(argv)
    if a.path is None:
        p.error("give the path of a local Llama checkpoint directory (config.json, *.safetensors and "
                "tokenizer files); nothing is downloaded")
    prompts = a.prompt or PROMPTS
    try:
        model, tok, reqs = load(a.path, prompts, a.new_tokens, a.attention, a.device, a.dtype)
    except ValueError as e:
        p.error(str(e))
    out = serve(model, tok, reqs, prompts, a.attention)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for o in out:
            print(f"--- {o['prompt']!r}\n{o['prompt']}{o['completion']}")
    return 0


if __name__ == "__main__":
    with quiet_exit():
        sys.exit(main())
