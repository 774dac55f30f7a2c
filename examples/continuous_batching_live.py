"""Continuous batching, live: a request joins a running batch and leaves on its own (lecture §4.1).

    python examples/continuous_batching_live.py [--model tiny|mini] [--long 64] [--short 6]

Starts the OpenAI-compatible server in this process (127.0.0.1, a port the system picks as it
binds), streams request A (`--long` tokens) and, once A's fifth token has arrived, request B
(`--short` tokens). The server's per-iteration log then shows B's prefill joining A's decodes at
the next iteration (selective batching runs both in one step), both decoding together, and B
leaving the batch at its last token while A runs on: no request waits for another, which is Orca's
iteration-level scheduling. Needs the `serve` extra: pip install 'orca-torch[serve]'.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import sys
import threading
import time
from pathlib import Path

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

from orca_torch.lab.cli_args import command_parser, count_arg  # noqa: E402
from orca_torch.lab.report import quiet_exit  # noqa: E402
from orca_torch.serve.server import ServeConfig, make_server  # noqa: E402
from orca_torch.specs import get_model_spec  # noqa: E402

PROMPT_A, PROMPT_B = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]
SERVE_EXTRA = ("fastapi", "pydantic", "uvicorn", "httptools", "tokenizers", "httpx")  # the `serve` extra (tested)


def missing_modules(names: tuple[str, ...] = SERVE_EXTRA) -> list[str]:
    """The modules of `names` that cannot be imported here."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


async def stream(client, url: str, name: str, prompt: list[int], n: int, started: asyncio.Event | None,
                 after: asyncio.Event | None = None) -> list[str]:
    if after is not None:
        await after.wait()
    got = []
    body = {"prompt": prompt, "max_tokens": n, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:                # (B waits for A's fifth token: fail, do not wait)
            raise RuntimeError(f"request {name}: the server answered {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:                # (the engine failed, or the server shut down)
                    raise RuntimeError(f"request {name} ended after {len(got)} tokens: {event['error']['message']}")
                got.append(event["choices"][0]["text"])
                if started is not None and len(got) == 5:
                    started.set()
    print(f"{name}: {len(got)} tokens:{''.join(got)}")
    return got


async def drive(url: str, long: int, short: int) -> None:
    import httpx

    a_has_five = asyncio.Event()
    async with httpx.AsyncClient(timeout=120) as c:
        await asyncio.gather(stream(c, url, "A", PROMPT_A, long, a_has_five),
                             stream(c, url, "B", PROMPT_B, short, None, after=a_has_five))


def main(argv: list[str] | None = None) -> int:
    p = command_parser(__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tiny", "mini"), default="tiny", help="the preset served (default tiny)")
    p.add_argument("--long", type=count_arg, default=64, help="tokens of request A (default 64)")
    p.add_argument("--short", type=count_arg, default=6, help="tokens of request B (default 6)")
    a = p.parse_args(argv)
    missing = missing_modules()
    if missing:                                 # (before a server starts that could not serve, or be asked)
        p.error(f"this example needs the serve extra, and {', '.join(missing)} cannot be imported: "
                "pip install 'orca-torch[serve]'")
    if a.short + 5 >= a.long:
        p.error("--short must end before A does: give --long > --short + 5")
    context = get_model_spec(a.model).max_context
    if len(PROMPT_A) + a.long > context:
        p.error(f"--long {a.long}: A's {len(PROMPT_A)}-token prompt and its tokens must fit the {a.model} model's "
                f"context of {context} tokens: give --long <= {context - len(PROMPT_A)}")
    cfg = ServeConfig(model=a.model, port=0, threads=1)        # (port 0: the system picks a free one as it binds)
    bound: list[int] = []
    server, live = make_server(cfg, on_start=lambda host, port: bound.append(port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:                                        # (the server stops however this ends, Ctrl-C included)
        while not bound:
            if not thread.is_alive():           # (it could not bind, say: uvicorn has said why)
                print(f"the server did not start on {cfg.host}{f':{cfg.port}' if cfg.port else ''}", file=sys.stderr)
                return 1
            time.sleep(0.05)
        asyncio.run(drive(f"http://127.0.0.1:{bound[0]}", a.long, a.short))
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        server.should_exit = True
        thread.join(10)
        live.stop()
    names = {0: "A", 1: "B"}
    steps = list(live.steps)
    with_b = [i for i, s in enumerate(steps) if any(rid == 1 for rid, _, _ in s.works)]
    lo, hi = max(with_b[0] - 2, 0), min(with_b[-1] + 3, len(steps))
    print(f"\nthe server's iterations {steps[lo].index}-{steps[hi - 1].index} of {len(steps)} (prefill n+0: "
          "a prompt of n tokens; decode 1+p: one token on p cached):")
    for s in steps[lo:hi]:
        works = ", ".join(f"{names[rid]} {'prefill' if p == 0 else 'decode'} {n}+{p}" for rid, n, p in s.works)
        print(f"  step {s.index:3d}  {s.start_s * 1e3:9.1f}-{s.end_s * 1e3:9.1f} ms  batch={s.batch_size}  [{works}]")
    joined, left = steps[with_b[0]], steps[with_b[-1]]
    a_then = [p for rid, _, p in joined.works if rid == 0]
    a_after = [s.index for s in steps[with_b[-1] + 1:] if any(rid == 0 for rid, _, _ in s.works)]
    if not a_then or not a_after:
        print("A finished before B could join and leave on its own on this machine: give a larger --long.",
              file=sys.stderr)
        return 1
    a_had = a_then[0] - len(PROMPT_A) + 1
    print(f"\nB joined the running batch at step {joined.index}, beside A's decode (A had {a_had} tokens); "
          f"B left after step {left.index}; A ran on alone until step {a_after[-1]}.")
    return 0


if __name__ == "__main__":
    with quiet_exit():
        sys.exit(main())
