"""A worker: one process holding one shard, running one iteration at a time of whatever batch it
is handed (Orca §4.4, "workers").

The loop, per batch: take the batch's control message (`control.py`) — from the engine's own
channel (`Control.APART`) or from the data plane (`Control.DATA`) —, free and reserve K/V as it
says, prepare the step (positions, masks, K/V views), then take the input (token ids on the first
stage, the previous stage's activations otherwise, point to point), run this stage's layers with
the tensor-parallel collectives, and hand the output on (activations to the next stage, or the
greedy tokens, with the raw logits rows of the requests that sample or adjust them or ask for
log probabilities, back to the engine from the last stage). Every worker reports its own
timestamps for every batch, so the engine can draw a per-stage timeline and check the overlap.

A worker never waits without a bound on something it knows is coming: joining the group (the
control channel, the rendezvous, and a stage's tensor-parallel group) waits at most
`launch_timeout_s` (over gloo: NCCL's group keeps a day, `group_timeout`), activations and
collectives at most `step_timeout_s`, and then fail (gloo
closes the pair; every peer fails fast); only the wait for the next control message is unbounded (a
day at a time, `IDLE_TIMEOUT`), because an idle engine is not a fault — a worker whose engine is
gone sees the control channel close (the store's server ends with the engine's process), or its
upstream peer fail, and leaves. Under torchrun, rank 0's worker also watches every other rank's
connection and tells the engine at once of one that closes (`PeerWatch`), where the engine would
otherwise wait out its step bound for a rank on another machine. Any error is reported to the engine
with its traceback before the process exits, and on stderr where the report does not reach the
engine (`ControlChannel.report`: a push into a store whose server has gone is lost without a word).

Exit status: 0 only for a worker that the engine stopped (STOP). One whose engine went away without
stopping it (its process killed, or it gave up on the group) says so in one line on stderr and exits
with 1 (`abandoned`), as a failed worker does: a supervisor that reads exit codes (torchrun's agent
on another node, a job scheduler) must not take an abandoned run for a finished one.

A worker that the engine's process started (a local launch, and torchrun's rank 0, whose worker is
its child) also ends as soon as that process does, at any point, joining the group included, where
it would otherwise wait out the rendezvous's bound, or longer, after a SIGKILL of its engine. It
holds the read end of a pipe, its lifeline, whose only write end the engine's process holds
(`WorkerGroup.lifeline`): multiprocessing's forkserver and spawn hand a child only the descriptors
it is given, and `os.pipe`'s are not inherited by other programs (a plain `os.fork` of the engine's
process would keep a copy, and with it the workers, as long as that child lives). The kernel closes
that end when the process ends, however it ends; a thread of the worker waits on the read end and,
at its end of file, ends the worker at once (`watch_lifeline`). An engine already gone when the
worker starts is seen the same way. This follows the engine's own process, where Linux's
parent-death signal (`PR_SET_PDEATHSIG`) would follow the worker's parent, the forkserver, or fire
when the engine's thread that started the worker ends.

A worker that the engine's process started ignores SIGINT: a terminal's Ctrl-C reaches the whole
process group, and the engine's process, which gets it too, stops its workers in order
(`DistributedExecutor.reset`). A rank that torchrun started keeps it: torchrun's agent passes
Ctrl-C on to its ranks as SIGINT and expects them to end: until the group is joined (the
rendezvous waits inside torch, where Python cannot raise `KeyboardInterrupt`) SIGINT ends such a
rank at once, as it would end any program. The idle wait for the next control message is inside
torch too: there the interrupt takes effect when the wait returns, as the channel closes (rank 0,
which torchrun interrupts as well, stops its group at once, sending no STOP: `DistributedExecutor.reset`).
"""
from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from orca_torch.distributed.control import (TO_ENGINE, BatchControl, Control, Kind, Stray, brief, decode, join_store,
                                            load, to_worker)
from orca_torch.distributed.shard import ShardLayout, StageShard
from orca_torch.model.orca_model import OrcaModel
from orca_torch.specs import ModelSpec

IDLE_TIMEOUT = datetime.timedelta(days=1)   # a wait for the next control message (an idle engine)
WATCH_TIMEOUT = datetime.timedelta(days=3650)   # a `PeerWatch` receive (past 292 years gloo's ns deadline overflows)
STEP_TIMEOUT_S = 60.0       # the default bound on a step's waits: activations, collectives, a batch's results
LAUNCH_TIMEOUT_S = 120.0    # the default bound on joining: the control channel, the rendezvous, the process groups


def group_timeout(device: str, launch_timeout_s: float) -> datetime.timedelta:
    """The process groups' own timeout, which bounds joining them: the launch's bound over gloo, whose
    waits here each say their own (a rank that starts a few seconds after its peers is no fault, even
    where a step's bound is shorter). NCCL's watchdog ends a process with any operation pending past
    it, an idle worker's wait for the next control message included: a day there."""
    return IDLE_TIMEOUT if device == "cuda" else datetime.timedelta(seconds=launch_timeout_s)


def default_n_slots(spec: ModelSpec) -> int:
    """Each worker's K/V slots when none are given: 256 requests of the model's whole context."""
    return 256 * spec.max_context


@dataclass
class WorkerConfig:
    """What every worker of a group is started with (picklable; `state` tensors are shared memory)."""

    layout: ShardLayout
    state: dict | None              # the full model's state_dict, or None: build `preset` from `seed`
    preset: str
    seed: int
    n_slots: int
    init_method: str                # "tcp://127.0.0.1:PORT" (local launch) or "env://" (torchrun)
    loopback: bool = False          # local launch: gloo's pairs on the loopback interface only
    control: Control = Control.APART
    step_timeout_s: float = STEP_TIMEOUT_S
    launch_timeout_s: float = LAUNCH_TIMEOUT_S
    device: str = "cpu"             # "cpu" or "cuda" (one GPU per worker)
    dtype: torch.dtype = torch.float32
    threads: int = 1
    attention: str = "split"        # the model's attention path ("split" or "fused")
    watch_peers: bool = False       # torchrun: rank 0's worker reports the end of any other rank (`PeerWatch`)
    progress: torch.Tensor | None = None   # local launch: each rank's count of its stage's steps (`DataPlane.entering`)


class DriverGone(Exception):
    """The engine's end of the control channel closed: the engine went away (`abandoned`)."""


@dataclass
class ControlChannel:
    """Worker `rank`'s end of the control channel (`control.py`): a client of the store at `address`,
    which the engine's process hosts. It is handed to the worker's process unconnected (a connection
    does not travel) and connects there (`connect`); a torchrun rank connects before it starts, to
    say hello (`launch.join_torchrun`)."""

    address: tuple[str, int]
    rank: int
    store: object = field(default=None, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "store": None}

    def connect(self, timeout_s: float) -> None:
        """Join the store (bounded by `timeout_s`); from then on its waits last a day (`IDLE_TIMEOUT`)."""
        if self.store is None:
            self.store = join_store(self.address, timeout_s)
            self.store.set_timeout(IDLE_TIMEOUT)

    def send(self, msg) -> None:
        self.store.queue_push(TO_ENGINE, pickle.dumps(msg))

    def report(self, msg, timeout_s: float) -> None:
        """`send`, and make sure the engine's store took it: a push is written without waiting for an
        answer, so one into a store whose server has ended (the engine's process gone) is lost without
        a word. A query behind it on the same connection fails then (`DistNetworkError`), or after
        `timeout_s` where the engine's machine no longer answers."""
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.send(msg)
        self.store.check([TO_ENGINE])

    def recv(self, timeout_s: float | None = None):
        """The engine's next message for this rank, however long it takes (an idle engine is no fault),
        or within `timeout_s` where given (else None); `DriverGone` once the engine's store has closed;
        `Stray` for what the engine does not send."""
        if timeout_s is not None:
            self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        try:
            while True:
                try:
                    data = self.store.queue_pop(to_worker(self.rank))
                except dist.DistNetworkError:
                    raise DriverGone() from None
                except dist.DistStoreError:         # a day (or `timeout_s`) without a message
                    if timeout_s is not None:
                        return None
                    continue
                return load(data, from_engine, "the engine does not send")
        finally:
            if timeout_s is not None:
                self.store.set_timeout(IDLE_TIMEOUT)

    def close(self) -> None:
        self.store = None


def from_engine(m) -> bool:
    """What the engine sends a worker: under torchrun first its answer to the rank's hello ("welcome",
    or `("refused", why)`), then "ping" and "go" (the launch's handshake), then control messages."""
    return ((type(m) is str and m in ("welcome", "ping", "go"))
            or (type(m) is tuple and len(m) == 2 and m[0] == "refused" and type(m[1]) is str)
            or (type(m) is list and all(isinstance(v, int) for v in m) and decode(m) is not None))


class PeerWatch:
    """Under torchrun, rank 0's worker (the engine's child, whose end the engine sees) learns at once of
    the end of any other rank, which the engine's process cannot see: those ranks run elsewhere, and
    one killed while the pipeline waits on it left the engine to wait out its step bound and call it
    hung. Every rank joins one more gloo group (`group`, all ranks); in it rank 0 posts a receive from
    every other rank, which a rank sends only as it leaves at a STOP (`goodbye`): a peer's end before
    that closes its connection, and gloo fails the receive at once. A thread per peer waits on it and
    pushes `("lost", 0, peer)` onto the engine's queue."""

    def __init__(self, layout: ShardLayout, rank: int, joining: datetime.timedelta) -> None:
        self.group = dist.new_group(list(range(layout.world_size)), timeout=joining, backend="gloo")
        self.rank, self.world_size = rank, layout.world_size
        self.threads: list[threading.Thread] = []

    def start(self, channel: "ControlChannel") -> None:
        """Rank 0: watch every other rank, telling the engine over a connection of the watch's own."""
        store = channel.store.clone()

        def watch(peer: int, pending) -> None:
            try:
                pending.wait(WATCH_TIMEOUT)
            except Exception:                   # its connection closed
                try:
                    store.queue_push(TO_ENGINE, pickle.dumps(("lost", 0, peer)))
                except Exception:               # the engine is gone too
                    pass

        for peer in range(1, self.world_size):
            pending = dist.irecv(torch.empty(1), peer, group=self.group)
            self.threads.append(threading.Thread(target=watch, args=(peer, pending), name=f"orca-peer-{peer}",
                                                 daemon=True))
            self.threads[-1].start()

    def goodbye(self, timeout: datetime.timedelta) -> None:
        """At a STOP: another rank sends rank 0 the receive it waits on; rank 0 waits (bounded) for every
        one of them, so that no receive is left pending when the group is destroyed."""
        if self.rank != 0:
            dist.isend(torch.empty(1), 0, group=self.group).wait(timeout)
            return
        end = time.monotonic() + timeout.total_seconds()
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))


class DataPlane:
    """torch.distributed for one worker: TP collectives in its stage and point-to-point to its
    neighbour stages, every wait bounded by `timeout` (idle control waits excepted); the `PeerWatch`
    group where `watch_peers`."""

    def __init__(self, layout: ShardLayout, rank: int, device: torch.device, timeout_s: float,
                 joining: datetime.timedelta, watch_peers: bool = False,
                 progress: torch.Tensor | None = None) -> None:
        self.layout, self.rank, self.device = layout, rank, device
        self._entered = None if progress is None or layout.tp == 1 else progress.numpy()
        self.timeout = datetime.timedelta(seconds=timeout_s)
        groups = ([dist.new_group(layout.stage_ranks(s), timeout=joining) for s in range(layout.pp)]
                  if layout.tp > 1 else [])
        self.tp_group = groups[layout.stage_of(rank)] if groups else None
        self.peers = PeerWatch(layout, rank, joining) if watch_peers else None
        self.collective_s = 0.0
        self._pending: list = []

    def entering(self) -> None:
        """Count one more step that every tp rank of this stage takes together (a collective, and with
        `Control.DATA` the first stage's control message), before waiting in it: a rank that hangs
        stops counting, while its peers count the step they wait in, so the engine can tell them
        apart (`executor.no_report`). In shared memory (`WorkerConfig.progress`): a local launch only."""
        if self._entered is not None:
            self._entered[self.rank] += 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return t
        self.entering()
        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.tp_group, async_op=True).wait(self.timeout)
        self.collective_s += time.perf_counter() - t0
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return t[None]
        self.entering()
        t0 = time.perf_counter()
        out = [torch.empty_like(t) for _ in range(self.layout.tp)]
        dist.all_gather(out, t.contiguous(), group=self.tp_group, async_op=True).wait(self.timeout)
        self.collective_s += time.perf_counter() - t0
        return torch.stack(out)

    def send(self, dst: int, *tensors: torch.Tensor) -> None:
        """Asynchronous sends of `tensors` to `dst`, in order, once the previous call's are done (bounded
        wait). One call's sends do not wait on each other: a stage that queued a step's control message
        and activations reports the step, and falls silent behind its next stage only when that one has
        not taken what it had a whole step to take (so the engine can tell which stage hung,
        `executor.no_report`). Each tensor is kept until its send is waited for."""
        self.flush()
        for t in tensors:
            t = t.contiguous()
            self._pending.append((t, dist.isend(t, dst)))

    def flush(self) -> None:
        for _, w in self._pending:
            w.wait(self.timeout)
        self._pending.clear()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, bounded: bool = True) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        w = dist.irecv(t, src)
        w.wait(self.timeout if bounded else IDLE_TIMEOUT)     # (not the group's own: `group_timeout`)
        return t

    def ints(self, msg: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A control message as the data plane sends it: its length, then the ints (int64 tensors)."""
        return (torch.tensor([len(msg)], dtype=torch.long, device=self.device),
                torch.tensor(msg, dtype=torch.long, device=self.device))

    def recv_ints(self, src: int) -> list[int]:
        n = int(self.recv((1,), torch.long, src, bounded=False)[0])   # idle until the next batch
        return self.recv((n,), torch.long, src).tolist()


class Worker:
    """One rank's loop over control messages (see the module docstring)."""

    def __init__(self, rank: int, cfg: WorkerConfig, channel: ControlChannel) -> None:
        self.rank, self.cfg, self.channel = rank, cfg, channel
        lay = cfg.layout
        self.layout = lay
        if cfg.device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        state = cfg.state
        if state is None:
            state = OrcaModel(cfg.preset, seed=cfg.seed, dtype=cfg.dtype).state_dict()
        self.shard = StageShard(state, lay, rank, device=self.device, dtype=cfg.dtype, attention=cfg.attention)
        self.first, self.last = self.shard.first, self.shard.last
        # The pipeline's hops join the same tensor-parallel rank of neighbouring stages (None at the ends).
        self.prev_rank = None if self.first else rank - lay.tp
        self.next_rank = None if self.last else rank + lay.tp
        self.kv = self.shard.new_kv(cfg.n_slots)
        self.plane = DataPlane(lay, rank, self.device, cfg.step_timeout_s,
                               group_timeout(cfg.device, cfg.launch_timeout_s), cfg.watch_peers, cfg.progress)
        if self.plane.peers is not None and rank == 0:
            self.plane.peers.start(channel)
        self.mode = cfg.control

    # ---- control ------------------------------------------------------------------------------
    def next_control(self) -> list[int]:
        if self.mode is Control.APART:
            return self.channel.recv()
        lay = self.layout
        if self.rank == 0:
            msg = self.channel.recv()
            self.plane.entering()
            for peer in lay.stage_ranks(0)[1:]:          # the head hands it to its stage's TP ranks
                self.plane.send(peer, *self.plane.ints(msg))
            return msg
        if self.first:
            self.plane.entering()
        return self.plane.recv_ints(0 if self.first else self.prev_rank)

    def pass_on(self, msg: list[int], *activations: torch.Tensor) -> None:
        """The next stage's share: through the data plane it learns of a message only from this stage,
        then the `activations`, sent together (`DataPlane.send`)."""
        if not self.last:
            control = self.plane.ints(msg) if self.mode is Control.DATA else ()
            self.plane.send(self.next_rank, *control, *activations)

    # ---- the loop -----------------------------------------------------------------------------
    def handshake(self) -> None:
        """Report ready, answer the engine's clock pings, wait for "go" (the engine sends nothing else
        before it: anything else came from elsewhere)."""
        self.channel.send(("ready", self.rank, time.perf_counter()))
        while True:
            m = self.channel.recv()
            if m == "go":
                return
            if m != "ping":
                raise Stray(f"a message on the control channel that the engine does not send before \"go\": {brief(m)}")
            self.channel.send(("pong", self.rank, time.perf_counter()))

    def run(self) -> None:
        while True:
            msg = self.next_control()
            kind, payload = decode(msg)
            if kind is Kind.STOP:
                self.pass_on(msg)
                self.plane.flush()
                if self.plane.peers is not None:
                    self.plane.peers.goodbye(self.plane.timeout)
                return
            if kind is Kind.RESET:
                self.pass_on(msg)
                self.plane.flush()
                self.kv = self.shard.new_kv(self.cfg.n_slots)
                self.mode = payload
                continue
            self.step(payload, msg)

    def step(self, batch: BatchControl, msg: list[int]) -> None:
        """One batch through this rank: K/V frees and reservations, the plan, the input (token ids or
        the previous stage's activations), the layers, the output handed on, the report."""
        kv, shard, plane = self.kv, self.shard, self.plane
        for h in batch.frees:
            kv.free(h)
        for h, n in batch.reserves:
            kv.reserve(h, n)
        plan = shard.plan(batch.works, batch.handles, kv)
        plane.collective_s = 0.0
        if self.first:
            t_start, cpu0 = time.perf_counter(), time.process_time()
            x = shard.embed(torch.tensor(batch.token_ids, dtype=torch.long, device=self.device), plane.all_reduce)
        else:
            x = plane.recv((batch.n_tokens, self.layout.spec.hidden), self.cfg.dtype, self.prev_rank)
            t_start, cpu0 = time.perf_counter(), time.process_time()
        cuda = self.device.type == "cuda"
        if cuda:                                    # on a GPU the busy interval is the CUDA events'
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        x = shard.layers(x, plan, plane.all_reduce)
        tokens = rows = None
        if self.last:
            tok, logits = shard.greedy(x, plan, plane.all_gather, batch.bans, batch.returned)
            if shard.tp_rank == 0:
                tokens = tok.tolist()
                rows = None if logits is None else logits.to("cpu", torch.float32).numpy().tobytes()
        if cuda:
            ev1.record()
            torch.cuda.synchronize(self.device)
        t_end, cpu_s = time.perf_counter(), time.process_time() - cpu0
        if cuda:
            t_start = max(t_start, t_end - ev0.elapsed_time(ev1) / 1e3)
        self.pass_on(msg, x)
        shard.commit(plan)
        self.channel.send(("done", self.rank, batch.index, t_start, t_end, plane.collective_s, cpu_s, tokens, rows))


def use_loopback() -> None:
    """Put this process's gloo pairs on the loopback interface (unless GLOO_SOCKET_IFNAME says otherwise)."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        names = {name for _, name in socket.if_nameindex()}
        lo = next((n for n in ("lo", "lo0") if n in names), None)
        if lo is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = lo


def init_loopback_group(backend: str, init_method: str, rank: int, world_size: int, timeout,
                        listener: socket.socket | None = None) -> None:
    """`dist.init_process_group` over `init_method` ("tcp://127.0.0.1:PORT") with its rendezvous
    store listening on 127.0.0.1 only: torch's own TCPStore listens on every interface, and
    anyone who reaches it may write to it (it has no authentication). Rank 0's store takes over
    `listener`, the socket the launcher bound to PORT and kept open (`loopback_listener`), so that
    no other program can take the port between its choice and its use."""
    port = int(init_method.rsplit(":", 1)[1])
    if rank == 0:
        assert listener is not None and listener.getsockname()[1] == port, "rank 0 serves the launcher's socket"
        store = dist.TCPStore("127.0.0.1", port, world_size, True, timeout=timeout,
                              master_listen_fd=listener.detach(),     # (the store owns the socket)
                              wait_for_workers=False, use_libuv=False)
    else:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def loopback_listener() -> tuple[socket.socket, str]:
    """A socket listening on a free port of 127.0.0.1, for rank 0's rendezvous store, and the
    `init_method` the other ranks reach it by. It is handed to rank 0 open (multiprocessing passes
    sockets to a child), so the port is never free between its choice and the store."""
    listener = socket.create_server(("127.0.0.1", 0))
    return listener, f"tcp://127.0.0.1:{listener.getsockname()[1]}"


ABANDONED_EXIT = 1
"""A worker's exit code when its engine went away without stopping it (`abandoned`)."""

_leaving = threading.Lock()


def abandoned(rank: int, how: str) -> NoReturn:
    """Leave at once, saying in one line on stderr that the engine went away (`how`) without stopping
    this worker, with `ABANDONED_EXIT` (the lifeline's thread and the control channel may both see
    it: the first says it)."""
    _leaving.acquire()
    os.write(2, f"orca_torch.distributed: worker rank {rank} is leaving: its engine went away without "
                f"stopping it ({how})\n".encode())
    os._exit(ABANDONED_EXIT)    # nothing is left to report to, nor to tear down in order


def watch_lifeline(lifeline, at_end: Callable[[], NoReturn]) -> None:
    """Call `at_end` (which ends this process) as soon as the engine's process ends: a daemon thread
    reads `lifeline`, the read end of a pipe that only the engine's process writes to (it never
    does), until its end of file, which the kernel gives when that process ends (see the module
    docstring)."""
    def watch() -> None:
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        at_end()

    threading.Thread(target=watch, name="orca-lifeline", daemon=True).start()


def worker_main(rank: int, cfg: WorkerConfig, channel: ControlChannel, interruptible: bool = False,
                listener: socket.socket | None = None, lifeline=None) -> None:
    """A worker process's entry point (local launch and torchrun alike); `channel`: its end of the
    control channel, connected here if it is not yet (bounded by `launch_timeout_s`); `interruptible`: SIGINT
    ends it (a torchrun rank) rather than being left to the engine (see the module docstring);
    `listener`: rank 0's store socket in a local launch (`loopback_listener`); `lifeline`: the read
    end of the engine's lifeline where the engine's process started this one (`watch_lifeline`)."""
    if lifeline is not None:
        watch_lifeline(lifeline, lambda: abandoned(rank, "its process ended"))
    # Ignored, or (a torchrun rank) the default action, ending the process, until the group is joined.
    signal.signal(signal.SIGINT, signal.SIG_DFL if interruptible else signal.SIG_IGN)
    torch.set_num_threads(cfg.threads)
    if cfg.loopback:
        use_loopback()
    try:
        channel.connect(cfg.launch_timeout_s)
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        joining = group_timeout(cfg.device, cfg.launch_timeout_s)
        if cfg.loopback:
            init_loopback_group(backend, cfg.init_method, rank, cfg.layout.world_size, joining, listener)
        else:
            dist.init_process_group(backend, init_method=cfg.init_method, rank=rank,
                                    world_size=cfg.layout.world_size, timeout=joining)
        w = Worker(rank, cfg, channel)
        if interruptible:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        w.handshake()
        w.run()
    except DriverGone:
        abandoned(rank, "its control channel closed")
    except BaseException as failure:
        why = str(failure) if isinstance(failure, Stray) else traceback.format_exc()   # (not the worker's fault)
        try:
            channel.report(("error", rank, why), cfg.step_timeout_s)
        except Exception as e:                  # never connected, or the engine is gone: say it here
            lost = ("it never joined the control channel" if channel.store is None else
                    f"its report could not reach the engine ({type(e).__name__}: {e})")
            os.write(2, f"orca_torch.distributed: worker rank {rank} failed, and {lost}:\n{why}".encode())
        os._exit(1)             # peers may be blocked on us: no orderly teardown of the group
    if dist.is_initialized():
        dist.destroy_process_group()
    channel.close()
