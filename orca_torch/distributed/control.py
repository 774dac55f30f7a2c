"""The control plane: what the scheduler tells the workers about each batch (Orca §4.4), and the
channel it travels on.

Orca's engine master sends each iteration's control information — which requests, how many new
tokens each feeds and after how many stored ones, their input token ids, and which requests to
free — to every worker over a channel apart from the tensors (gRPC between CPUs in Orca); the data
plane (NCCL there, gloo/NCCL here) carries only activations and collectives. Knowing the batch
ahead, a worker prepares its step (K/V reservations, positions, masks, K/V views) while the
previous stage still computes. FasterTransformer and Megatron instead send the same information
through the data plane, with the tensors; `Control.DATA` does that here, so the two can be compared.

A message is a flat list of ints (request ids are the executor's integer handles), so exactly the
same content travels either way: pickled over the control channel (`Control.APART`), or as an
int64 tensor over torch.distributed (`Control.DATA`).

    BATCH: [BATCH, index, n_free, *handles, n_reserve, *(handle, n_slots), n_work, *(handle, n_new, n_past),
            n_ban, *(work, token_id), n_returned, *works, *token_ids]
    RESET: [RESET, mode]   free every K/V, switch the control path to `mode` (before the next batch)
    STOP:  [STOP]          leave the loop

The channel is torch.distributed's `TCPStore`: the engine's process (global rank 0) hosts it
(`host_store`) and every worker joins it as a client (`join_store`). The engine pushes each
worker's messages onto that worker's queue (`to_worker(rank)`), which the worker pops, blocking;
every worker pushes its replies onto one queue (`TO_ENGINE`), which a thread of the engine's
process pops, for the engine to take with a bound (`launch.WorkerGroup.listen`, `receive`). A push
is taken at once by the store's server, in the engine's process, so no send waits on its reader.
Messages are pickled, of plain values only (ints, floats, strings, None, tuples, lists), and read
back by an unpickler that refuses any other (`load`): anyone who reaches the port may push to it, as
to torchrun's own rendezvous store, and a pickle may name any function to call as it is read (read
by `pickle.loads`, one pushed onto the engine's queue runs a shell command in the engine's process).
A message that the reader's peers do not send, on either side, is a failure that says what arrived.
Anyone who reaches the port can still push such messages (no authentication), so it is for a trusted
network: a local launch keeps it on 127.0.0.1, and `python -m orca_torch.distributed` refuses another
address without `--trusted-network`.

Back from every worker, onto `TO_ENGINE` (pickled tuples; `launch.WorkerGroup.receive`):

    ("hello", rank, settings)                       a torchrun rank joining, with the flags every
                                                    rank must share (`launch.join_torchrun`)
    ("ready", rank, t) and ("pong", rank, t)        the launch's handshake and clock pings
    ("done", rank, index, t_start, t_end, collective_s, cpu_s, tokens, rows)
                                                    every rank, every batch (`StageRecord`); tokens,
                                                    and the returned rows' raw logits (float32 bytes)
                                                    or None, from the last stage's tp rank 0, None elsewhere
    ("error", rank, traceback)                      the worker failed and is leaving
    ("lost", 0, peer)                               under torchrun, rank 0's worker: rank `peer`'s
                                                    connection closed before its STOP (`worker.PeerWatch`)
    ("gone", rank)                                  not a message: the engine's own watch saw a
                                                    local process end (`launch.WorkerGroup.listen`)
"""
from __future__ import annotations

import datetime
import io
import pickle
import socket
from dataclasses import dataclass
from enum import IntEnum

import torch.distributed as dist

from orca_torch import checks
from orca_torch.core.batch import SeqWork

TO_ENGINE = "orca/to-engine"
"""The queue every worker's replies go to, in the order the store's server takes them."""


def host_port(host: str, port: int) -> str:
    """`host:port` as a message writes it, an IPv6 address in brackets (`[::1]:29501`), where its own
    colons would run into the port's."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def to_worker(rank: int) -> str:
    """The queue of worker `rank`'s messages from the engine."""
    return f"orca/to-worker-{rank}"


def host_store(listener: socket.socket) -> dist.TCPStore:
    """The control channel's server, in the engine's process, on `listener`, a socket already bound and
    listening (the store owns it from here, so the port is never free between its choice and its use).
    The server serves every connection as it comes: a client that connects and says nothing, or
    speaks another protocol, holds no one up."""
    host, port = listener.getsockname()[:2]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)   # (the store's own client connects to it)
    return dist.TCPStore(host, port, None, True, wait_for_workers=False, master_listen_fd=listener.detach())


def join_store(address: tuple[str, int], timeout_s: float) -> dist.TCPStore:
    """A client of the control channel at `address`; torch retries until the server answers, for about
    `timeout_s` (then a `torch.distributed.DistNetworkError`)."""
    return dist.TCPStore(address[0], address[1], None, False, timeout=datetime.timedelta(seconds=timeout_s))


class Stray(ValueError):
    """A message on the control channel that its reader's peers never send: anyone who reaches the port
    may push onto any queue."""


class _PlainValues(pickle.Unpickler):
    """Reads a pickle of plain values only: any class or function it names is refused, not imported
    (which is how a pickle calls code as it is read)."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}, and control messages hold plain values only")


def brief(m) -> str:
    """What arrived on the control channel, said in at most 200 characters, in bounded time (`checks.brief`)."""
    return checks.brief(m, 200)


def load(data: bytes, valid, senders: str):
    """The message pickled in `data`, of plain values (`_PlainValues`), where `valid(m)` holds (without
    raising); otherwise `Stray`, saying briefly what arrived, as a message that `senders` ("no worker
    sends", "the engine does not send")."""
    try:
        m = _PlainValues(io.BytesIO(data)).load()
    except Exception as e:
        raise Stray(f"a message on the control channel that {senders} ({len(data)} bytes: "
                    f"{type(e).__name__}: {e})") from None
    try:
        ok = valid(m)
    except Exception:
        ok = False
    if not ok:
        raise Stray(f"a message on the control channel that {senders}: {brief(m)}")
    return m


class Kind(IntEnum):
    BATCH = 1
    RESET = 2
    STOP = 3


class Control(IntEnum):
    """Where each batch's control message travels."""

    APART = 0   # its own channel, to every worker at submission (Orca)
    DATA = 1    # through the data plane with the activations, stage to stage (FasterTransformer)


def control_mode(value: "str | Control") -> Control:
    """`"apart"` / `"data"` (or a `Control`) as a `Control`; anything else is a clear error."""
    if isinstance(value, Control):
        return value
    names = {"apart": Control.APART, "data": Control.DATA}
    if not isinstance(value, str) or value not in names:
        raise ValueError(f"control must be 'apart' (a channel of its own, Orca) or 'data' (through the data "
                         f"plane, FasterTransformer/Megatron), got {checks.brief(value)}")
    return names[value]


@dataclass(frozen=True)
class BatchControl:
    """One batch as the workers see it."""

    index: int
    frees: tuple[int, ...]
    reserves: tuple[tuple[int, int], ...]    # (handle, slots to reserve) for requests new to the workers
    handles: tuple[int, ...]
    works: tuple[SeqWork, ...]
    token_ids: tuple[int, ...]               # every request's new tokens back to back
    bans: tuple[tuple[int, int], ...] = ()   # (work, token id) that work may not make (short of min_tokens)
    returned: tuple[int, ...] = ()           # works whose raw logits row comes back (a pick here, or logprobs)

    def encode(self) -> list[int]:
        out = [Kind.BATCH, self.index, len(self.frees), *self.frees, len(self.reserves)]
        for h, n in self.reserves:
            out += (h, n)
        out.append(len(self.works))
        for h, w in zip(self.handles, self.works):
            out += (h, w.n_new, w.n_past)
        out.append(len(self.bans))
        for row, t in self.bans:
            out += (row, t)
        out += (len(self.returned), *self.returned)
        out += self.token_ids
        return [int(v) for v in out]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def decode(msg: list[int]) -> tuple[Kind, BatchControl | int | None]:
    """`(kind, payload)`: a `BatchControl` for BATCH, the new `Control` for RESET, None for STOP."""
    kind = Kind(msg[0])
    if kind is Kind.STOP:
        return kind, None
    if kind is Kind.RESET:
        return kind, Control(msg[1])
    i = 2
    n = msg[i]
    frees = tuple(msg[i + 1:i + 1 + n])
    i += 1 + n
    n = msg[i]
    reserves = tuple((msg[i + 1 + 2 * k], msg[i + 2 + 2 * k]) for k in range(n))
    i += 1 + 2 * n
    n = msg[i]
    handles = tuple(msg[i + 1 + 3 * k] for k in range(n))
    works = tuple(SeqWork(msg[i + 2 + 3 * k], msg[i + 3 + 3 * k]) for k in range(n))
    i += 1 + 3 * n
    n = msg[i]
    bans = tuple((msg[i + 1 + 2 * k], msg[i + 2 + 2 * k]) for k in range(n))
    i += 1 + 2 * n
    n = msg[i]
    returned = tuple(msg[i + 1:i + 1 + n])
    i += 1 + n
    tokens = tuple(msg[i:])
    assert len(tokens) == sum(w.n_new for w in works), f"control message of batch {msg[1]} is malformed"
    return kind, BatchControl(msg[1], frees, reserves, handles, works, tokens, bans, returned)


def reset_message(mode: Control) -> list[int]:
    return [int(Kind.RESET), int(mode)]


STOP_MESSAGE = [int(Kind.STOP)]
