"""Serve a few real prompts with a real Llama checkpoint through Orca's engine (lecture §4, §5.1).

    python examples/serve_llama.py /path/to/llama-dir [--prompt TEXT ...] [--new-tokens 32]
                                   [--attention split|fused] [--device cpu|cuda] [--dtype float32|bfloat16] [--json]

The directory is a local transformers checkpoint (config.json, *.safetensors) with its tokenizer
files (e.g. a Llama 3.2 1B or a TinyLlama download); nothing is fetched from a hub. The weights go
into `OrcaModel.from_hf`, the prompts become `Request`s that all arrive at t = 0, the Engine with
the torch executor runs them with iteration-level scheduling and selective batching, and the
greedy continuations are decoded and printed (cut at the end-of-sequence token).
Needs the `hf` extra: pip install 'orca-torch[hf]'.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from orca_torch.engine import Engine
from orca_torch.executor import TorchExecutor
from orca_torch.memory import UnlimitedMemory
from orca_torch.model import ATTENTION_PATHS, OrcaModel
from orca_torch.request import Request
from orca_torch.scheduler import SchedulerConfig

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Iteration-level scheduling means that",
           "Once upon a time,"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
DTYPES = ("float32", "bfloat16", "float16")


def load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise SystemExit(f"no tokenizer in {str(path)!r} (looked for {', '.join(TOKENIZER_FILES)}); "
                         f"this example prints text, so it needs the checkpoint's tokenizer files")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise SystemExit("this example needs transformers: pip install 'orca-torch[hf]'") from None
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def serve(path: Path, prompts: list[str], new_tokens: int, attention: str, device: str,
          dtype: str | None) -> list[dict]:
    tok = load_tokenizer(path)
    model = OrcaModel.from_hf(path, device=device, dtype=dtype, attention=attention)
    reqs = [Request(i, 0.0, len(ids), new_tokens, prompt_ids=ids)
            for i, ids in enumerate(tok(p)["input_ids"] for p in prompts)]
    too_long = [r.req_id for r in reqs if r.total_len > model.spec.max_context]
    if too_long:
        raise SystemExit(f"prompts {too_long} + {new_tokens} new tokens exceed the model's context "
                         f"{model.spec.max_context}")
    kv = model.new_kv(sum(r.total_len for r in reqs))
    engine = Engine(TorchExecutor(model, kv), UnlimitedMemory(), SchedulerConfig(max_bs=len(reqs)))
    t0 = time.perf_counter()
    res = engine.run(reqs)
    wall = time.perf_counter() - t0
    eos = tok.eos_token_id
    out = []
    for r, prompt in zip(reqs, prompts):
        ids = res.output_ids[r.req_id]
        if eos is not None and eos in ids:
            ids = ids[:ids.index(eos)]
        out.append({"prompt": prompt, "completion": tok.decode(ids, skip_special_tokens=True),
                    "output_ids": res.output_ids[r.req_id]})
    print(f"{model.spec.name}: {model.spec.n_params / 1e6:.0f}M params, {len(reqs)} requests, "
          f"{res.n_steps} steps, {wall:.1f} s, attention={attention}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", nargs="?", help="local checkpoint directory with tokenizer files")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: four examples")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--attention", choices=ATTENTION_PATHS, default="split")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.path is None:
        p.print_usage(sys.stderr)
        raise SystemExit("give the path of a local Llama checkpoint directory (config.json, *.safetensors and "
                         "tokenizer files); nothing is downloaded")
    if a.new_tokens < 1:
        raise SystemExit(f"--new-tokens must be >= 1, got {a.new_tokens}")
    out = serve(Path(a.path), a.prompt or PROMPTS, a.new_tokens, a.attention, a.device,
                a.dtype)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for o in out:
            print(f"--- {o['prompt']!r}\n{o['prompt']}{o['completion']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
