"""`python -m orca_torch.serve`: Orca's engine as a live OpenAI-compatible server (see docs/serving.md).

    python -m orca_torch.serve [--model tiny|mini|/path/to/llama] [--port 8000] [--attention split|fused]
                               [--threads N] [--device cpu|cuda] [--memory reserve|paged] [--kv-slots N]
                               [--max-bs 16] [--max-num-batched-tokens N [--chunked-prefill]] [--log-steps]
                               [--shutdown-grace 5] [--body-timeout 30] [--body-memory-mib 64]
                               [--max-connections 1000]

Serves on 127.0.0.1 by default (`--port 0`: a free port, named in the banner once bound); `--host
0.0.0.0` (or 0, the same to the socket layer) serves every interface, with no authentication, and
the banner says so for any address other than loopback. SIGINT or
SIGTERM drains: new requests get 503 while the streams still running end (those left after
--shutdown-grace seconds with an error, 503), then the process exits 0; a second signal ends them now.
Before the banner (the model loading) a signal stops start-up with one line, and the process exits 0.
"""
from __future__ import annotations

import argparse
import ipaddress
import signal
import socket
import sys
from dataclasses import fields

from orca_torch.lab.cli_args import (add_seed_flag, command_parser, count_arg, device_arg, flag_names, host_arg,
                                     in_flag_terms, int_arg, seconds_arg, text_arg, threads_arg, timeout_arg)

DESTS = {"shutdown_grace_s": "shutdown_grace", "body_timeout_s": "body_timeout"}
"""`ServeConfig` fields whose flag is not the field's name (`--shutdown-grace` sets `shutdown_grace_s`)."""


def parser() -> argparse.ArgumentParser:
    from orca_torch.serve.limits import BODY_MEMORY_MIB, BODY_TIMEOUT_S, MAX_BODY_BYTES, MAX_CONNECTIONS
    from orca_torch.serve.server import MEMORIES

    p = command_parser(prog="python -m orca_torch.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=text_arg, default="tiny", help="a preset (tiny, mini: random weights) or a local Llama "
                                                   "checkpoint directory (default tiny)")
    p.add_argument("--served-model-name", type=text_arg, default=None,
                   help="the name /v1/models gives (default: the model's)")
    p.add_argument("--host", type=host_arg, default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1, this machine alone; 0.0.0.0, or 0, which the "
                        "socket layer reads as 0.0.0.0: every interface, open to anyone who reaches the port, with no "
                        "authentication)")
    p.add_argument("--port", type=int_arg(0, 65535), default=8000,
                   help="the port to listen on (default 8000; 0: a free port, which the banner says)")
    p.add_argument("--attention", choices=("split", "fused"), default="split",
                   help="split: a loop over requests (the reference); fused: one attention call per layer "
                        "(default split)")
    p.add_argument("--threads", type=threads_arg, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the weights' dtype (default: float32 for a preset, the checkpoint's own otherwise)")
    add_seed_flag(p, "a preset's random weights and of the draws of a request that samples without a seed")
    p.add_argument("--memory", choices=MEMORIES, default="reserve",
                   help="reserve: Orca's reservation of prompt + max_tokens (default); paged: blocks on demand")
    p.add_argument("--kv-slots", type=count_arg, default=None, help="K/V budget in tokens (default max-bs x context)")
    p.add_argument("--block-size", type=count_arg, default=None, help="paged: tokens per block (default 16)")
    p.add_argument("--max-bs", type=count_arg, default=16,
                   help="requests per iteration at most (Orca's max_bs; default 16)")
    p.add_argument("--max-num-batched-tokens", type=count_arg, default=None,
                   help="tokens per iteration at most (default: no limit)")
    p.add_argument("--chunked-prefill", action="store_true", help="split prompts to fill the token budget")
    p.add_argument("--log-steps", action="store_true", help="log every iteration's batch")
    p.add_argument("--shutdown-grace", type=seconds_arg, default=5.0,
                   help="seconds in-flight streams may run on after SIGINT/SIGTERM (default 5)")
    p.add_argument("--body-timeout", type=timeout_arg, default=BODY_TIMEOUT_S,
                   help=f"seconds a request's headers, and then its body, may take to arrive; then 408 "
                        f"(default {BODY_TIMEOUT_S:g})")
    p.add_argument("--body-memory-mib", type=int_arg(MAX_BODY_BYTES // 2**20, why=" (the largest body taken)"),
                   default=BODY_MEMORY_MIB,
                   help=f"MiB of request bodies held at once, being read or waiting to be parsed; past it, 503 "
                        f"with Retry-After (default {BODY_MEMORY_MIB})")
    p.add_argument("--max-connections", type=count_arg, default=None,
                   help=f"connections served at once; a request on one past them gets 503 (default {MAX_CONNECTIONS}, "
                        "or fewer where the open-file limit, ulimit -n, leaves room for fewer)")
    return p


def flags(p: argparse.ArgumentParser) -> dict[str, str]:
    """Each `ServeConfig` field -> the flag that sets it (`max_bs` -> `--max-bs`)."""
    from orca_torch.serve.server import ServeConfig

    by_dest = flag_names(p)
    return {f.name: by_dest[DESTS.get(f.name, f.name)] for f in fields(ServeConfig)}


def refuse(p: argparse.ArgumentParser, e: Exception) -> None:
    """argparse's usage error (exit 2) for a refusal of the library's, said in the flags typed."""
    p.error(in_flag_terms(str(e), flags(p)))


def parse(argv: list[str] | None = None, p: argparse.ArgumentParser | None = None):
    """The `ServeConfig` the flags give; a bad flag, or a bad mix of them, is argparse's usage error
    naming the flags."""
    from orca_torch.serve.server import ServeConfig

    p = p or parser()
    a = p.parse_args(argv)
    try:
        return ServeConfig(**{field: getattr(a, DESTS.get(field, field)) for field in flags(p)})
    except ValueError as e:
        refuse(p, e)


SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM while the server starts, before its banner (a model loading): there is no
    stream to drain, so start-up stops. A BaseException, as KeyboardInterrupt, so that no `except
    Exception` on the way takes it for a failure."""


def _interrupt(sig: int, frame) -> None:
    raise Interrupted(signal.Signals(sig).name)


def main(argv: list[str] | None = None) -> int:
    before = {sig: signal.signal(sig, _interrupt) for sig in SIGNALS}     # until the server takes them
    live = None
    try:
        server, live = start(argv)
        for sig in SIGNALS:                         # uvicorn re-raises the signal it caught once it has
            signal.signal(sig, lambda *_: None)     # shut down; these handlers make that a no-op
    except BaseException as e:
        stopped = isinstance(e, Interrupted)
        for sig, handler in before.items():         # (a later signal must not break the exit either)
            signal.signal(sig, signal.SIG_IGN if stopped else handler)
        if live is not None:
            live.stop()
        if not stopped:
            raise
        print(f"orca-torch: {e} while starting, before serving: stopped", file=sys.stderr, flush=True)
        return 0
    try:
        server.run()
    finally:
        for sig in SIGNALS:                             # a late signal must not kill the exit (Python
            signal.signal(sig, signal.SIG_IGN)          # restores the default handlers as it ends)
        live.stop()
    return 0


def start(argv: list[str] | None = None):
    """The server the flags give, built (the model loaded) but not yet listening, and its live
    engine; a bad flag is argparse's usage error."""
    import logging

    from orca_torch.serve.server import make_server

    p = parser()
    cfg = parse(argv, p)
    try:                                        # before minutes of loading a checkpoint
        check_can_listen(cfg.host, cfg.port)
    except ValueError as e:
        refuse(p, e)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)

    def announce(host: str, port: int) -> None:
        host = f"[{host}]" if ":" in host else host     # (an IPv6 address in a URL)
        print(f"orca-torch serving {cfg.name!r} on http://{host}:{port} (tokenizer {server.tokenizer.path})",
              file=sys.stderr, flush=True)
        note = exposure(host.strip("[]"), port)
        if note:
            print(note, file=sys.stderr, flush=True)

    try:                                        # (a checkpoint's files, the K/V budget against memory)
        server, live = make_server(cfg, on_start=announce)
    except ValueError as e:
        refuse(p, e)
    except ImportError as e:                    # (uvicorn, fastapi, tokenizers: the extra not installed)
        refuse(p, ValueError(f"{e}: the server needs the serve extra: pip install 'orca-torch[serve]'"))
    return server, live


def exposure(bound: str, port: int) -> str | None:
    """What the banner adds for a server bound to `bound` (the address the socket got: `--host 0`
    and `--host 0.0.0.0` both bind 0.0.0.0) beyond loopback: who can reach it. None on loopback."""
    try:
        ip = ipaddress.ip_address(bound.split("%")[0])          # (an IPv6 scope, fe80::1%eth0)
    except ValueError:
        return None
    if ip.is_loopback:
        return None
    where = "every interface" if ip.is_unspecified else bound
    return (f"note: listening on {where}, not loopback only: anyone who reaches port {port} can send requests "
            "(no authentication); put a proxy in front of a server open to clients you do not trust, or use "
            "--host 127.0.0.1")


def check_can_listen(host: str, port: int) -> None:
    """ValueError unless this process can listen on `host`:`port` now: a name that resolves to an
    address of this machine, and a port nobody holds (bound and let go at once, as uvicorn binds)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:    # (UnicodeError: no host name, e.g. 'a..b', a label over 63)
        why = e.strerror if isinstance(e, socket.gaierror) else "not a host name"
        raise ValueError(f"--host {host!r} names no address ({why}): give an address of this machine, "
                         "e.g. 127.0.0.1") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}; give another --port (0: a free one) "
                             "or --host") from None


if __name__ == "__main__":
    sys.exit(main())
