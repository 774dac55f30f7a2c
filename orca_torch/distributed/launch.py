"""Starting a group of workers and watching it (Orca §4.4, exercise 6).

- `launch_local(state, layout, ...)`: `tp x pp` worker processes on this machine over
  `torch.multiprocessing` (the forkserver start method where it exists, preloaded with the worker
  module, so a launch costs well under a second after the first), gloo on a free loopback port
  (or NCCL, one GPU each). The full model's weights travel once, as shared memory.
- `serve_torchrun(...)` / `join_torchrun(...)` (used by `python -m orca_torch.distributed` under
  `torchrun`): the same workers on any number of machines; the engine's process hosts the control
  channel on a TCP port next to torchrun's rendezvous, bound (`control_listener`) before any
  process starts, so a port in use is said at once.

Spawned workers import the main script again (`leave_if_importing_main`, `exit_reason`: a script
that builds an executor outside `if __name__ == "__main__":` is told so).

Either way the engine gets a `WorkerGroup`: the control channel, a torch.distributed `TCPStore`
that the engine's process hosts (`control.py`: a queue per worker, one back to the engine), and,
for local processes, the processes themselves, whose ends are watched, and the write end of their
lifeline (`lifeline`): the processes it starts end when the engine's does. Nothing on rank 0 waits
on a worker without a bound: a receive waits at most its timeout on what two threads of the
engine's process hand it (`WorkerGroup.listen`), the workers' messages as the store takes them and
the end of any local process at once, and a Ctrl-C interrupts it; a send is a push that the
store's server, in the engine's own process, takes whatever the worker does (one that stopped
reading is found by the wait for its report). Under torchrun the other ranks join by pushing a
hello with their settings (`join_torchrun`, checked by `handshake`): a client that connects to the
control port and says nothing, or speaks another protocol, holds nothing up (the store serves every
connection as it comes); it simply never pushes a valid hello, and the launch waits for the ranks'
hellos and readiness within its timeout alone.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_ends
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from orca_torch.checks import check_choice, check_instance, check_int, check_real
from orca_torch.distributed.control import (TO_ENGINE, Control, Stray, brief, control_mode, host_port, host_store,
                                            load, to_worker)
from orca_torch.distributed.shard import ShardLayout, check_state
from orca_torch.distributed.worker import (IDLE_TIMEOUT, LAUNCH_TIMEOUT_S, STEP_TIMEOUT_S, ControlChannel, DriverGone,
                                           WorkerConfig, loopback_listener, worker_main)
from orca_torch.lab.cli_args import TIMEOUT_MAX_S
from orca_torch.model.kv_cache import check_dtype
from orca_torch.model.orca_model import check_attention


class WorkerFailure(RuntimeError):
    """A worker died, reported an error, or stopped making progress; the group has been shut down."""


MAIN_REIMPORTED_EXIT = 3
"""A worker's exit code when the main script, imported again in the worker, built an executor."""


def leave_if_importing_main() -> None:
    """Called where an executor is built: in a process that multiprocessing is still starting (spawn
    and forkserver run the main script again in every child, as `__mp_main__`), an executor being
    built is the script's top level running in a worker, which would start workers of its own. Leave
    at once, with an exit code the engine's side explains (`exit_reason`)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.stderr.write("a worker process is leaving: the main script, run again in it, builds a "
                         "DistributedExecutor at its top level\n")
        sys.stderr.flush()
        os._exit(MAIN_REIMPORTED_EXIT)


def check_main_runs_again() -> None:
    """Spawn and forkserver run the main script again in every worker (its path, `__main__.__file__`);
    a script read from stdin (`python - < script.py`) is named '<stdin>', which no worker can open,
    so every worker would die at start with a traceback of multiprocessing's. Said here instead."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"the main script is {path!r}, which the worker processes cannot open: each runs the "
                         "main script again (multiprocessing's spawn and forkserver); save it to a file and run "
                         "`python script.py` (python -c, a notebook and an interactive session work too)")


def exit_reason(code: int) -> str:
    """What a worker's exit code says: the main script without a `__main__` guard, or just the code."""
    if code != MAIN_REIMPORTED_EXIT:
        return f"exited with code {code}"
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None) or "the main script"
    return (f"exited at start: workers are started by spawning, which runs the main script again in each "
            f"of them, and {script} builds a DistributedExecutor when imported, outside "
            "`if __name__ == \"__main__\":`, so the worker began to build one of its own; put the code that "
            "builds the DistributedExecutor and runs the engine under that line")


FORKSERVER_LOST = 255
"""The exit code multiprocessing's forkserver `Popen` gives a process whose end it cannot read, its
connection to the forkserver (which reaps the process and writes its code) being closed."""


def ended(p) -> str:
    """How local process `p` ended (`exit_reason`). A `FORKSERVER_LOST` code while its process is still
    there is the forkserver's end, not the worker's: a process the forkserver saw end was reaped first."""
    if p.exitcode == FORKSERVER_LOST and _exists(p.pid):
        return ("is still running, but multiprocessing's forkserver, which started the workers and reports "
                "their ends, went away (was it killed?)")
    return exit_reason(p.exitcode)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:                 # (none, or another user's: a pid taken again since)
        return False
    return True


def worker_context():
    """torch.multiprocessing's forkserver (preloaded with the worker module), or spawn where there is none."""
    try:
        ctx = tmp.get_context("forkserver")
        ctx.set_forkserver_preload(["orca_torch.distributed.worker"])
        return ctx
    except ValueError:                     # no forkserver on this platform
        return tmp.get_context("spawn")


def lifeline(ctx):
    """A pipe `(read end, write end)` that nobody writes to: the workers the engine's process starts
    are each given the read end, and end at its end of file, which comes when the engine's process,
    the only holder of the write end (`WorkerGroup.lifeline`), ends or closes it (`worker.watch_lifeline`)."""
    return ctx.Pipe(duplex=False)


def _settings(v) -> bool:
    return type(v) is tuple and all(type(p) is tuple and len(p) == 2 and type(p[0]) is str
                                    and type(p[1]) in (str, int) for p in v)


def _tokens(v) -> bool:
    return v is None or (type(v) is list and all(type(t) is int for t in v))


def _bytes(v) -> bool:
    return v is None or type(v) is bytes


REPLIES = {"hello": (_settings,), "ready": (float,), "pong": (float,),
           "done": (int, float, float, float, float, _tokens, _bytes), "error": (str,), "lost": (int,)}
"""What a worker pushes onto the engine's queue: each kind and what follows its rank, a type or a
check for each field (the watch's own `("gone", rank)` goes straight to the inbox, unpickled)."""

LAST = b""
"""The engine's queue's last item, which the engine pushes at shutdown (no pickle is empty): it ends
the thread that pops the queue only then (`WorkerGroup.closing`); pushed by anyone before, it is a
message that no worker sends."""


@dataclass
class WorkerGroup:
    """The engine's handles on a running group: the control channel's store, local processes."""

    layout: ShardLayout
    store: object                   # the control channel, hosted here (`control.host_store`); None once shut down
    procs: list | None = None
    clock_offsets: list[float] = field(default_factory=list)   # worker perf_counter - engine's
    lifeline: object = None         # the write end of the local processes' lifeline (`lifeline`)
    progress: torch.Tensor | None = None   # the local ranks' counts of their stages' steps (`WorkerConfig.progress`)
    inbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue, repr=False)
    threads: list[threading.Thread] = field(default_factory=list, repr=False)
    closing: threading.Event = field(default_factory=threading.Event, repr=False)   # set by `shutdown`

    def __post_init__(self) -> None:
        """Refuse what the engine could not use, before a `DistributedExecutor` is handed the group: a
        layout that is no `ShardLayout` (the executor compares it with its own), a store that is no
        torch.distributed `Store` (or None: one without a control channel, or shut down), and local
        processes that are not one entry a rank (None for a rank started elsewhere)."""
        check_instance("layout", self.layout, ShardLayout)
        check_instance("store", self.store, dist.Store, allow_none=True)
        n = self.layout.world_size
        if self.procs is not None and not (isinstance(self.procs, list) and len(self.procs) == n):
            raise ValueError(f"procs must be a list of one process a rank (None for a rank started elsewhere), "
                             f"{n} for tp x pp = {self.layout.tp} x {self.layout.pp}, or None, got {brief(self.procs)}")

    def describe(self, rank: int) -> str:
        lay = self.layout
        return f"worker rank {rank} (stage {lay.stage_of(rank)}, tp rank {lay.tp_rank_of(rank)})"

    def entered(self) -> list[int] | None:
        """Each rank's count of its stage's steps (`worker.DataPlane.entering`), or None (torchrun)."""
        return None if self.progress is None else self.progress.tolist()

    def local(self) -> list:
        """The processes this engine started (None for a remote rank)."""
        return [p for p in self.procs or [] if p is not None]

    def dead(self, besides: int | None = None, signalled: bool = False) -> str | None:
        """Why the group is broken, if any of its local processes (rank `besides`'s aside) has exited:
        each one that has, and how; `signalled`: only those a signal ended (a negative exit code)."""
        gone = [f"{self.describe(r)} {ended(p)}" for r, p in enumerate(self.procs or [])
                if p is not None and r != besides and p.exitcode is not None and (p.exitcode < 0 or not signalled)]
        return "; ".join(gone) or None

    def listen(self) -> None:
        """Start the two threads that fill `inbox`, on which the engine waits (`receive`): one pops the
        engine's queue of the store, blocking, over a connection of its own (a wait inside torch,
        which neither a Ctrl-C nor the end of a process could interrupt); the other waits on the
        local processes' sentinels and puts `("gone", rank)` as each ends. A remote rank's death is
        said by rank 0's worker, which watches its connection (`worker.PeerWatch`: `("lost", 0, rank)`),
        or by its peers, whose torch.distributed waits fail as its connections close."""
        store = self.store.clone()
        store.set_timeout(IDLE_TIMEOUT)

        def pop() -> None:
            while True:
                try:
                    data = store.queue_pop(TO_ENGINE)
                except dist.DistStoreError:             # idle for a day
                    continue
                if data == LAST and self.closing.is_set():
                    return
                self.inbox.put(data)

        ends = {p.sentinel: rank for rank, p in enumerate(self.procs or []) if p is not None}

        def watch() -> None:
            while ends:
                for end in wait_for_ends(list(ends)):
                    self.inbox.put(("gone", ends.pop(end)))

        self.threads = [threading.Thread(target=pop, name="orca-control", daemon=True)]
        if ends:
            self.threads.append(threading.Thread(target=watch, name="orca-watch", daemon=True))
        for t in self.threads:
            t.start()

    def send(self, ranks, msg) -> None:
        """Push `msg` onto each of `ranks`' queues. The store's server, in this process, takes it at once,
        so a send never waits on a worker: one that is stopped or hung is found by the wait for its
        report. Raises `WorkerFailure` naming the local processes that have ended (their queues would
        keep the message forever)."""
        why = self.dead()
        if why is not None:
            raise WorkerFailure(why)
        data = pickle.dumps(msg)
        for rank in ranks:
            self.store.queue_push(to_worker(rank), data)

    def receive(self, timeout_s: float) -> tuple | None:
        """The next message from any worker within `timeout_s`, or None (`listen` fills the inbox as
        they come). Raises `WorkerFailure` for a worker's error (with its traceback), the end of a
        local process, or a message that no worker sends."""
        try:
            m = self._decode(self.inbox.get(timeout=max(timeout_s, 0.0)))
        except queue.Empty:
            return None
        if m[0] in ("gone", "error", "lost"):
            raise self._failure(m)
        return m

    def _failure(self, m: tuple) -> WorkerFailure:
        """What a worker's error or the end of its process says. A failing worker pushes its traceback
        and ends; the engine sees the two in no set order (the store's server reads the worker's
        connection, the watch its sentinel), so each waits a second for the other. An error may be
        the consequence of a peer's end (a rank killed: its neighbours' reads fail), which comes to
        light no later than the failing worker's own: the local processes ended by then are named,
        first where a signal ended them (a kill from outside the group is no worker's error: the cause,
        and the error, 'Connection reset by peer' inside torch, what followed)."""
        if m[0] == "lost":
            return WorkerFailure(f"{self.describe(m[2])} is gone: its connection to worker rank 0 closed (its process "
                                 "ended, or its machine went away)")
        rank = m[1]
        p = self.procs[rank] if self.procs else None
        if p is not None:
            p.join(1.0)
        if m[0] == "gone" and p.exitcode == 1:          # it failed: its traceback is on its way, or was lost
            m = self._error_from(rank) or m
        if m[0] == "gone":
            return WorkerFailure(f"{self.describe(rank)} {ended(p)}")
        killed = self.dead(besides=rank, signalled=True)
        if killed:
            return WorkerFailure(f"{killed}, a signal's end; then {self.describe(rank)} failed:\n{m[2]}")
        others = self.dead(besides=rank)
        return WorkerFailure(f"{self.describe(rank)} failed:\n{m[2]}" + (f"\nBy then {others}." if others else ""))

    def _error_from(self, rank: int) -> tuple | None:
        """The error that worker `rank` pushed before it ended, if it arrives within a second (`_failure`)."""
        deadline = time.monotonic() + 1.0
        while (left := deadline - time.monotonic()) > 0:
            try:
                m = self._decode(self.inbox.get(timeout=left))
            except queue.Empty:
                return None
            if m[0] == "error" and m[1] == rank:
                return m
        return None

    def _decode(self, item) -> tuple:
        if isinstance(item, tuple):                     # the watch's own ("gone", rank)
            return item
        try:
            return load(item, self._from_worker, "no worker sends")
        except Stray as e:
            raise WorkerFailure(str(e)) from None

    def _from_worker(self, m) -> bool:
        """What a worker pushes (`REPLIES`): a kind it sends, from a rank of the group, each field of the
        type it sends (one of another, nested or shared without end, would fail, or hang, where it is
        read)."""
        n = self.layout.world_size
        fields = REPLIES.get(m[0]) if type(m) is tuple and len(m) >= 2 and type(m[0]) is str else None
        return (fields is not None and len(m) == 2 + len(fields) and type(m[1]) is int and 0 <= m[1] < n
                and all(type(v) is f if isinstance(f, type) else f(v) for f, v in zip(fields, m[2:]))
                and (m[0] != "lost" or (m[1] == 0 and 0 < m[2] < n)))

    def shutdown(self, grace_s: float = 2.0) -> None:
        """Join the local processes within `grace_s`, then terminate what is left and, half a second
        later, kill what is still there (each signal goes to all of them before any join, so hung
        workers take one wait, not one each); close the control channel (the workers still connected
        see it close) and the lifeline."""
        deadline = time.monotonic() + grace_s
        for p in self.local():
            p.join(max(0.0, deadline - time.monotonic()))
        for end, wait_s in (("terminate", 0.5), ("kill", 1.0)):
            left = [p for p in self.local() if p.is_alive()]
            for p in left:
                getattr(p, end)()
            deadline = time.monotonic() + wait_s
            for p in left:
                p.join(max(0.0, deadline - time.monotonic()))
        if self.threads:
            self.closing.set()
            self.store.queue_push(TO_ENGINE, LAST)
            for t in self.threads:
                t.join(1.0)
            self.threads = []
        self.store = None
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None


def _refuse(group: WorkerGroup, rank: int, why: str) -> NoReturn:
    """Raise `WorkerFailure` saying `why`, having told `rank` first, so that its own node (whose
    torchrun shows its output, not rank 0's) says it too: the message is given a moment, at most a
    second, to be taken before the store closes under it."""
    group.send([rank], ("refused", why))
    end = time.monotonic() + 1.0
    while group.store.queue_len(to_worker(rank)) and time.monotonic() < end:
        time.sleep(0.01)
    raise WorkerFailure(why)


def _unexpected(m: tuple, when: str) -> WorkerFailure:
    return WorkerFailure(f"unexpected control message {brief(m)} {when}")


def handshake(group: WorkerGroup, timeout_s: float, same_clock: bool = False, settings: tuple | None = None) -> None:
    """Wait until every worker is ready (bounded), learn each one's clock offset, say "go".

    Under torchrun (`settings` given) every rank but 0, whose worker the engine's process starts,
    first says hello with the `(flag, value)` pairs every rank must share (`join_torchrun`): each
    node's torchrun is given its own command line, and a node started with another layout, model,
    seed, control path or device would build other shards or weights, to hang in the first
    collective or serve other tokens. A rank whose settings differ is refused, naming the flags.

    Processes of one machine share `perf_counter`'s clock (CLOCK_MONOTONIC on Linux): their offset
    is 0 (`same_clock`), exactly. Across machines it is estimated from the fastest of three round
    trips, to within half of that round trip."""
    n = group.layout.world_size
    ready: set[int] = set()
    said: set[int] = {0} if settings is not None else set(range(n))
    deadline = time.monotonic() + timeout_s
    while len(ready) < n:
        m = group.receive(deadline - time.monotonic())
        if m is None:
            silent = sorted(set(range(n)) - said)
            late = [group.describe(r) for r in sorted(said - ready)]
            why = (f"; not ready: {', '.join(late)} (each still building its shard or joining the process group?)"
                   if late else "")
            why += (f"; rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))} never said hello on the control "
                    f"port {host_port(group.store.host, group.store.port)}" if silent else "")
            raise WorkerFailure(f"only {len(ready)} of {n} workers were ready within launch_timeout_s={timeout_s:g} s"
                                f"{why}; raise launch_timeout_s if they are only slow to start")
        kind, rank = m[:2]
        if kind == "hello" and rank not in said:
            theirs = m[2] if isinstance(m[2], tuple) else ()
            if theirs != tuple(settings):
                _refuse(group, rank, f"rank {rank} was started with {_flags(theirs, settings)} but rank 0 with "
                                     f"{_flags(settings, theirs)}: give every node's torchrun the same "
                                     f"{', '.join(flag for flag, _ in settings)}")
            said.add(rank)
            group.send([rank], "welcome")
        elif kind == "ready" and rank in said:
            ready.add(rank)
        else:
            raise _unexpected(m, "while the workers were joining")
    offsets = []
    for rank in range(n):
        best = None
        for _ in range(3):
            t0 = time.perf_counter()
            group.send([rank], "ping")
            m = group.receive(timeout_s)
            t1 = time.perf_counter()
            if m is None:
                raise WorkerFailure(f"{group.describe(rank)} did not answer a clock ping within launch_timeout_s="
                                    f"{timeout_s:g} s")
            if m[:2] != ("pong", rank):
                raise _unexpected(m, f"while {group.describe(rank)} was answering a clock ping")
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, m[2] - (t0 + t1) / 2)
        offsets.append(0.0 if same_clock else best[1])
        group.send([rank], "go")
    group.clock_offsets = offsets


def _flags(mine, other) -> str:
    """The `(flag, value)` pairs of `mine` that `other` does not hold, as typed on a command line."""
    return " ".join(f"{flag} {value}" for flag, value in mine if (flag, value) not in set(other)) or "nothing else"


def check_gpus(world_size: int) -> None:
    """A group on cuda needs a GPU per worker (NCCL takes one per rank): refuse one larger than the GPUs visible."""
    if torch.cuda.device_count() < world_size:
        raise ValueError(f"tp x pp = {world_size} workers on cuda need as many GPUs (NCCL takes one per "
                         f"rank), but {torch.cuda.device_count()} are visible")


def launch_local(state: dict, layout: ShardLayout, *, n_slots: int, control: Control = Control.APART,
                 step_timeout_s: float = STEP_TIMEOUT_S, launch_timeout_s: float = LAUNCH_TIMEOUT_S,
                 device: str = "cpu", dtype=None, threads: int = 1, attention: str = "split") -> WorkerGroup:
    """Start `layout.world_size` workers on this machine; returns once all are ready (bounded).
    `state` is the whole model's `state_dict`, of the model `layout` splits (`shard.check_state`; its
    tensors in shared memory travel once); `control` is
    a `Control` or its name ("apart", "data"); `device` "cpu" (gloo) or "cuda" (NCCL, one GPU a
    worker); `dtype` the weights' (None: float32); `attention` the model's path ("split", "fused").
    Each is checked here, before any process starts."""
    check_instance("state", state, dict)
    check_instance("layout", layout, ShardLayout)
    n_slots, control = check_int("n_slots", n_slots, 1), control_mode(control)
    step_timeout_s, launch_timeout_s = (check_real(name, v, 0.0, TIMEOUT_MAX_S, lo_open=True, unit="seconds")
                                        for name, v in (("step_timeout_s", step_timeout_s),
                                                        ("launch_timeout_s", launch_timeout_s)))
    device = check_choice("device", device, ("cpu", "cuda"))
    if device == "cuda":
        check_gpus(layout.world_size)
    dtype = torch.float32 if dtype is None else check_dtype(dtype)
    threads = check_int("threads", threads, 1, os.cpu_count() or 1)
    attention = check_attention(attention)
    check_state(state, layout.spec)
    leave_if_importing_main()
    check_main_runs_again()
    ctx = worker_context()
    listener, init_method = loopback_listener()
    store = host_store(control_listener(("127.0.0.1", 0), layout.world_size))
    progress = torch.zeros(layout.world_size, dtype=torch.long).share_memory_()
    cfg = WorkerConfig(layout=layout, state=state, preset=layout.spec.name, seed=0, n_slots=n_slots,
                       init_method=init_method, loopback=True, control=control,
                       step_timeout_s=step_timeout_s, launch_timeout_s=launch_timeout_s, device=device, dtype=dtype,
                       threads=threads, attention=attention, progress=progress)
    procs: list = [None] * layout.world_size
    life_r, life_w = lifeline(ctx)
    group = WorkerGroup(layout, store, procs, lifeline=life_w, progress=progress)
    try:
        with listener, life_r:              # (each worker has its own copy once started)
            for rank in range(layout.world_size):
                channel = ControlChannel((store.host, store.port), rank)
                p = ctx.Process(target=worker_main,
                                args=(rank, cfg, channel, False, listener if rank == 0 else None, life_r),
                                daemon=True, name=f"orca-worker-{rank}")
                p.start()
                procs[rank] = p
        group.listen()
        handshake(group, launch_timeout_s, same_clock=True)
    except BaseException:
        for p in group.local():
            if p.is_alive():
                p.kill()
        group.shutdown(grace_s=0.0)
        raise
    return group


def control_listener(address: tuple[str, int], n_ranks: int = 1) -> socket.socket:
    """A control channel's port, bound and listening before any process starts (an `OSError` says why
    it cannot; `control.host_store` takes it over). Its queue holds the other `n_ranks - 1` ranks
    connecting at once (a queue of one would make the kernel drop the others' first attempts). An
    IPv6 address (`::1`) is listened on as one: the socket module's default family is IPv4's."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    return socket.create_server(address, family=family, backlog=max(n_ranks, 1))


def serve_torchrun(cfg: WorkerConfig, listener: socket.socket, timeout_s: float,
                   settings: tuple = ()) -> WorkerGroup:
    """Global rank 0 under torchrun: host the control channel on `listener` (`control_listener`), start
    this node's rank-0 worker as a child (it inherits torchrun's environment), and handshake, taking
    the other ranks' hellos (`handshake` refuses a rank whose `settings` differ)."""
    ctx = tmp.get_context("spawn")
    n = cfg.layout.world_size
    procs: list = [None] * n
    life_r, life_w = lifeline(ctx)
    group = WorkerGroup(cfg.layout, host_store(listener), procs, lifeline=life_w)
    try:
        with life_r:
            channel = ControlChannel((group.store.host, group.store.port), 0)
            procs[0] = ctx.Process(target=worker_main, args=(0, cfg, channel, False, None, life_r), daemon=True,
                                   name="orca-worker-0")
            procs[0].start()
        group.listen()
        handshake(group, timeout_s, same_clock=False, settings=tuple(settings))
    except BaseException:
        group.shutdown(grace_s=0.0)
        raise
    return group


def join_torchrun(rank: int, address: tuple[str, int], timeout_s: float, settings: tuple = ()) -> ControlChannel:
    """Any other rank under torchrun: join the engine's control channel (torch retrying until it is
    served, about `timeout_s`), say hello with its rank and the `settings` every rank must share, and
    wait for rank 0's answer (`handshake` compares them): a rank refused says why on its own node."""
    channel = ControlChannel(address, rank)
    try:
        channel.connect(timeout_s)
    except dist.DistError:
        raise WorkerFailure(f"rank {rank} could not reach the engine's control port {host_port(*address)} "
                            f"within launch_timeout_s={timeout_s:g} s") from None
    channel.send(("hello", rank, tuple(settings)))
    try:
        answer = channel.recv(timeout_s)
    except DriverGone:
        raise WorkerFailure(f"rank 0 ended before it answered rank {rank}'s hello: its output says why") from None
    except Stray as e:
        raise WorkerFailure(str(e)) from None
    if answer is None:
        raise WorkerFailure(f"rank 0 did not answer rank {rank}'s hello within launch_timeout_s={timeout_s:g} s")
    if answer != "welcome":
        raise WorkerFailure(f"rank 0 refused rank {rank}: {answer[1]}")
    return channel
