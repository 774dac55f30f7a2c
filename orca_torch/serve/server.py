"""What `python -m orca_torch.serve` builds: the model, the K/V, Orca's scheduler and memory
manager, the live engine, the app, and a uvicorn server that stops cleanly on SIGINT/SIGTERM.

`ServeConfig` holds every setting, checked when made (ValueError says what is wrong, naming the
parameters; `python -m orca_torch.serve` says it in its flags);
`build(config)` returns the parts; `Server` is uvicorn's server that, on a signal, first tells
the live engine to take no new requests and end the streams still running after `shutdown_grace_s`
(each ends with an error event and `data: [DONE]`, a whole answer with a 503), so the process
exits 0.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orca_torch.checks import (brief, check_choice, check_device, check_fits_in_memory, check_flag, check_int,
                               check_real, check_seed)
from orca_torch.core.engine import Engine
from orca_torch.core.memory import ReservationMemory
from orca_torch.core.paged_memory import BLOCK_SIZE, PagedMemory
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.model.orca_model import ATTENTION_PATHS, OrcaModel
from orca_torch.model.paged_kv_cache import PagedKVManager
from orca_torch.model.torch_executor import TorchExecutor
from orca_torch.serve.limits import (BODY_MEMORY_MIB, BODY_TIMEOUT_S, FD_RESERVE, MAX_BODY_BYTES, MAX_HEAD_BYTES,
                                     connection_room, default_connections)
from orca_torch.serve.live import LiveEngine
from orca_torch.serve.metrics import Metrics
from orca_torch.serve.tokenizer import PRESETS, CheckpointTokenizer, PresetTokenizer

MEMORIES = ("reserve", "paged")


@dataclass(frozen=True)
class ServeConfig:
    """Everything the server needs. `model`: a preset (`tiny`, `mini`: random weights from `seed`)
    or a local Llama checkpoint directory; `seed` also seeds, with its number, the draws of a request
    that samples without a seed of its own. `memory`: `reserve` (Orca: each request's prompt +
    max_tokens set aside when it is admitted) or `paged` (blocks of `block_size`, default 16, as
    tokens arrive, recompute on preemption); `kv_slots` (default `max_bs` x the context) is the K/V budget in tokens.
    `body_timeout_s`: how long a request's headers, and then its body, may take to arrive (uvicorn has
    no bound of its own: `headers_bounded`, `OpenAIServer.read_body`). `body_memory_mib`: how much of
    request bodies the server holds at once, being read or waiting to be parsed (`OpenAIServer.hold`);
    at least the largest body taken, which would otherwise never fit. `max_connections`: how many
    connections are served at once, past it a request gets 503 (None: `MAX_CONNECTIONS`, or what
    the open-file limit leaves room for where that is less: `connections`); at most what that
    limit leaves room for (`limits.connection_room`)."""

    model: str = "tiny"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    attention: str = "split"
    threads: int | None = None
    device: str = "cpu"
    dtype: str | None = None
    seed: int = 0
    memory: str = "reserve"
    kv_slots: int | None = None
    block_size: int | None = None
    max_bs: int = 16
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = False
    log_steps: bool = False
    shutdown_grace_s: float = 5.0
    body_timeout_s: float = BODY_TIMEOUT_S
    body_memory_mib: int = BODY_MEMORY_MIB
    max_connections: int | None = None

    def __post_init__(self) -> None:
        # Text first: "" would be Path(".") (this directory as a checkpoint), a host of "" every
        # interface, a served name of "" the model's own; a number would fail deep inside.
        if isinstance(self.model, os.PathLike):         # (a checkpoint given as a Path, kept as its text)
            object.__setattr__(self, "model", os.fspath(self.model))
        for name, optional in (("model", False), ("served_model_name", True), ("host", False)):
            v = getattr(self, name)
            if not (optional and v is None) and not (isinstance(v, str) and v.strip()):
                raise ValueError(f"{name} must be non-empty text{' (or None)' if optional else ''}, got {brief(v)}")
        check_flag("log_steps", self.log_steps)
        try:
            a_dir = Path(self.model).is_dir()
        except OSError:                                 # (a name the file system cannot look up: too long, say)
            a_dir = False
        if self.model not in PRESETS and not a_dir:
            raise ValueError(f"model must be a preset ({', '.join(PRESETS)}) or a local checkpoint directory, "
                             f"got {self.model!r}")
        for name, choices in (("attention", ATTENTION_PATHS), ("memory", MEMORIES)):
            check_choice(name, getattr(self, name), choices)
        check_device(self.device)
        for name, lo, hi, optional in (("port", 0, 65535, False), ("max_bs", 1, None, False),
                                       ("block_size", 1, None, True), ("threads", 1, os.cpu_count() or 1, True),
                                       ("kv_slots", 1, None, True)):
            if not (optional and getattr(self, name) is None):
                check_int(name, getattr(self, name), lo, hi)
        if self.block_size is not None and self.memory != "paged":
            raise ValueError(f"block_size sizes the blocks of memory='paged'; with memory={self.memory!r} it would "
                             "do nothing: leave it unset")
        check_real("shutdown_grace_s", self.shutdown_grace_s, 0.0)
        check_real("body_timeout_s", self.body_timeout_s, 0.0, lo_open=True)
        check_int("body_memory_mib", self.body_memory_mib, MAX_BODY_BYTES // 2**20)
        room = connection_room()
        if self.max_connections is not None:
            check_int("max_connections", self.max_connections, 1)
            if room is not None and self.max_connections > room:
                raise ValueError(f"max_connections={self.max_connections} is more than this process's open-file "
                                 f"limit leaves room for: {room} (ulimit -n, less {FD_RESERVE} files the server "
                                 "keeps for its own use); give at most that, or raise the limit")
        check_seed(self.seed)
        self.scheduler_config()                 # (its own checks: the token budget against max_bs)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_bs=self.max_bs, max_num_batched_tokens=self.max_num_batched_tokens,
                               chunked_prefill=self.chunked_prefill)

    @property
    def connections(self) -> int:
        """The connections served at once (`max_connections`, or its default)."""
        return self.max_connections or default_connections()

    @property
    def name(self) -> str:
        return self.served_model_name or (self.model if self.model in PRESETS else Path(self.model).name)


def build(cfg: ServeConfig) -> tuple[LiveEngine, object]:
    """The live engine (its thread started) and the tokenizer for `cfg`."""
    import torch

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if cfg.model in PRESETS:
        model = OrcaModel(cfg.model, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype or "float32",
                          attention=cfg.attention)
        tok = PresetTokenizer(cfg.model)
    else:
        tok = CheckpointTokenizer(cfg.model)
        model = OrcaModel.from_hf(cfg.model, device=cfg.device, dtype=cfg.dtype, attention=cfg.attention)
    ctx = model.spec.max_context
    n_slots = cfg.kv_slots or cfg.max_bs * ctx
    set_by = "kv_slots" if cfg.kv_slots else "max_bs x the context"
    budget = f"the K/V budget of {n_slots} tokens ({set_by})"
    block_size = cfg.block_size or BLOCK_SIZE
    if cfg.memory == "paged" and block_size > n_slots:
        raise ValueError(f"a block of {block_size} tokens (block_size) is larger than {budget}: "
                         f"give a block_size up to {n_slots}")
    kv_bytes = n_slots * model.spec.kv_bytes_per_token
    if model.device.type == "cuda":             # (the K/V is made on the card: the card's free memory holds it)
        check_fits_in_memory(f"{budget} on {model.device}", kv_bytes,
                             available=torch.cuda.mem_get_info(model.device)[0])
    else:
        check_fits_in_memory(budget, kv_bytes)
    if cfg.memory == "reserve":
        memory, kv = ReservationMemory(n_slots, "max"), model.new_kv(n_slots)
    else:                                       # whole blocks, within the budget
        n_blocks = n_slots // block_size
        memory = PagedMemory(n_blocks * block_size, block_size=block_size)
        kv = PagedKVManager(model.spec, n_blocks, block_size, device=model.device, dtype=model.dtype)
    engine = Engine(TorchExecutor(model, kv, seed=cfg.seed), memory, cfg.scheduler_config())
    live = LiveEngine(engine, Metrics(cfg.name), stop_token_ids=tok.stop_token_ids, log_steps=cfg.log_steps)
    return live, tok


DRAIN_MARGIN_S = 2.0
"""After the grace, how long the streams the engine aborted may take to get their last event."""

LAST_CHUNKS_S = 5
"""Once drained, how long uvicorn waits for connections to close: a client that stops reading
cannot hold the exit up longer."""


def headers_bounded(base: type, timeout_s: float) -> type:
    """uvicorn's HTTP protocol `base` with the wait for a request's headers bounded by `timeout_s`
    (then a 408 error object, and the connection closed). uvicorn has no such bound: a client that
    opened a connection and sent nothing, or part of a request line or of its headers, held the
    connection for ever. A connection that sent no byte at all is closed with nothing sent, as
    uvicorn's keep-alive closes an idle one: no request began, so there is none to answer (and a
    client's pool that opened it ahead of need would read a 408 as its next request's answer).
    Armed when the connection opens, and on the first byte that comes after an
    answer; disarmed once a request's headers are in (uvicorn's `cycle` for it is made), its body
    then bounded by the app (`OpenAIServer.read_body`). Between an answer and the next byte the wait
    is uvicorn's keep-alive, which closes an idle connection with no answer: a 408 sent there is no
    answer to any request, and a client sending its next request on that connection at that moment
    would read it as that request's. A request line and headers past `MAX_HEAD_BYTES` get a 431
    error object, counted in the reads that come while a request's head is under way (the parser's
    `on_message_begin` to its `on_headers_complete`: httptools'; h11 bounds a head itself), once no
    answer is under way (a pipelined head waits for the answers before it: a 431 among their bytes
    would break them); the connection is then half-closed and what else comes is dropped, so the
    client reads the 431 before the close, which the header timer ends. A request past uvicorn's
    `limit_concurrency` (`--max-connections`) gets a 503 error object naming it, with Retry-After,
    and its connection closed, as every refusal is an error object (uvicorn's own 503 is plain
    text, which it still sends under h11, whose parser has no `on_headers_complete`). A connection
    lost while a request runs tells that request its client has gone, even where a pipelined request
    came after it: httptools' protocol tells only the last request it parsed (one that never runs),
    so a whole answer's handler never heard the client leave and ran to its `max_tokens`."""
    from orca_torch.serve.bodies import APIError

    class HeadersBounded(base):
        _headers_timer = None
        _got_bytes = False                          # (a byte came: a request began)
        _in_head = False
        _head_bytes = 0
        _refused = False
        _cap: int | None = None                     # (uvicorn's limit_concurrency, checked here)

        def _waiting(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._headers_timer is None:
                self._headers_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _refuse(self, status: bytes, message: str) -> None:
            body = json.dumps(APIError(message, None, int(status.split()[0])).body()).encode()
            self.transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)

        def _headers_late(self) -> None:
            self._headers_timer = None
            if self._refused or not self._got_bytes:
                self.transport.close()
            elif self._waiting() and not self.transport.is_closing() and self.transport.get_protocol() is self:
                self._refuse(b"408 Request Timeout", f"the request's headers did not arrive within {timeout_s:g} s "
                             "of the connection opening (or, after an answer on it, of their first byte)")
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._cycles: list = []                 # (httptools: its requests not yet answered, running or pipelined)
            if hasattr(base, "on_headers_complete"):    # (httptools': refused here, as an error object)
                self._cap, self.limit_concurrency = self.limit_concurrency, None

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._cycles = [c for c in self._cycles if not c.response_complete]
            cap = self._cap
            if cap is None or (len(self.connections) < cap and len(self.tasks) < cap):
                super().on_headers_complete()
            else:
                self.logger.warning("Exceeded concurrency limit.")
                app, self.app = self.app, APIError(
                    f"the server serves at most {cap - 1} connections at once (--max-connections) and has as many "
                    "open; send the request again in a moment", None, 503, "service_unavailable",
                    headers={"Retry-After": "1", "Connection": "close"}).response()
                try:
                    super().on_headers_complete()       # (the request's cycle takes the app it runs here)
                finally:
                    self.app = app
            if self.cycle is not None:
                self._cycles.append(self.cycle)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            self._got_bytes = True
            in_head = self._in_head                 # (a read that began a head may end a body: not counted)
            super().data_received(data)
            if in_head and self._in_head:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                    self._refused = True
                    if self._waiting():                 # (else once the answer under way is sent)
                        self._refuse_head()
                    return
            if self._waiting():
                self._arm()
            else:
                self._disarm()

        def _refuse_head(self) -> None:
            self._refuse(b"431 Request Header Fields Too Large", "the request's line and headers passed "
                         f"{MAX_HEAD_BYTES} bytes, the most this server takes")
            self.transport.write_eof()
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._refused and self._waiting() and not self.transport.is_closing():
                self._refuse_head()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)
            for cycle in self._cycles:              # (uvicorn tells only the last request parsed)
                if not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()

    return HeadersBounded


def make_server(cfg: ServeConfig, on_start: Callable[[str, int], None] | None = None):
    """A `Server` (uvicorn) for `cfg`, and its live engine; `server.run()` serves until a signal.
    `on_start(host, port)` is called once the socket is bound (with the port the system chose for
    port 0). `server.tokenizer` is the tokenizer the app serves with (its `path` says whose)."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from orca_torch.serve.app import create_app

    live, tok = build(cfg)
    try:
        app = create_app(live, tok, cfg.name, body_timeout_s=cfg.body_timeout_s,
                         body_memory_bytes=cfg.body_memory_mib * 2**20)
    except BaseException:
        live.stop()
        raise

    class Server(uvicorn.Server):
        """Drains on the first signal: the socket stays open, so new requests and `/health` get
        503, until the streams have ended (by the grace); then uvicorn stops. A second signal ends
        the streams at the next iteration (each still gets its error event); a third stops at once,
        SIGTERM as SIGINT (uvicorn's own forces the exit on a SIGINT only, and would leave a
        SIGTERM waiting on connections that are slow to close)."""

        n_signals = 0
        tokenizer = tok

        def handle_exit(self, sig, frame) -> None:
            self.n_signals += 1
            if self.n_signals > 2:
                super().handle_exit(sig, frame)
                self.should_exit = self.force_exit = True
                return
            live.shutdown(cfg.shutdown_grace_s if self.n_signals == 1 else 0.0)
            if self.n_signals == 1:
                threading.Thread(target=self._exit_when_drained, args=(sig, frame), daemon=True).start()

        def _exit_when_drained(self, sig, frame) -> None:
            live.drained(cfg.shutdown_grace_s + DRAIN_MARGIN_S)
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if on_start is not None and self.servers:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                on_start(host, port)

    server = Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                                   lifespan="off", timeout_graceful_shutdown=LAST_CHUNKS_S,
                                   limit_concurrency=cfg.connections + 1,     # (its count includes the one asking)
                                   http=headers_bounded(AutoHTTPProtocol, cfg.body_timeout_s)))
    if cfg.log_steps:
        logging.getLogger("orca_torch.serve").setLevel(logging.INFO)
    return server, live
