"""Starting a group of workers and watching it (Orca §4.4, exercise 6).

- `launch_local(state, layout, ...)`: `tp x pp` worker processes on this machine over
  `torch.multiprocessing` (the forkserver start method where it exists, preloaded with the worker
  module, so a launch costs well under a second after the first), gloo on a free loopback port
  (or NCCL, one GPU each). The full model's weights travel once, as shared memory.
- `serve_torchrun(...)` / `join_torchrun(...)` (used by `python -m orca_torch.distributed` under
  `torchrun`): the same workers on any number of machines; the engine's process listens for the
  workers' control connections on a TCP port next to torchrun's rendezvous, bound
  (`control_listener`) before any process starts, so a port in use is said at once.

Spawned workers import the main script again (`leave_if_importing_main`, `exit_reason`: a script
that builds an executor outside `if __name__ == "__main__":` is told so).

Either way the engine gets a `WorkerGroup`: one duplex control connection per rank (the control
plane) and, for local processes, the processes themselves, whose liveness is the watchdog's, and
the write end of their lifeline (`lifeline`): the processes it starts end when the engine's does.
Nothing on rank 0 waits on a worker without a bound: receives wait at most a timeout, and so do
sends (`WorkerGroup.send`: a worker that stopped reading fills its connection's buffer) and the
accepting of the ranks' control connections (`accept_ranks`: a client that connects and never
answers the key's challenge is dropped).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import selectors
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as tmp

from orca_torch.checks import check_choice, check_instance, check_int, check_real
from orca_torch.distributed.control import Control, control_mode
from orca_torch.distributed.shard import ShardLayout
from orca_torch.distributed.worker import WorkerConfig, loopback_listener, worker_main
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


def free_port() -> int:
    """A TCP port free on the loopback interface now (bind to 127.0.0.1:0), for a program that binds
    it itself (torchrun's MASTER_PORT, a control port): it may be taken before that program binds
    it. A local launch's own store needs none: rank 0 takes a socket held open (`loopback_listener`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def frame(payload: bytes) -> bytes:
    """`payload` as `multiprocessing.connection` puts a message on the wire (its length, big-endian,
    then the bytes), so that the peer's `Connection.recv_bytes` or `recv` reads it."""
    n = len(payload)
    return (struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)) + payload


def _writable(fd: int, timeout_s: float) -> bool:
    if timeout_s <= 0:
        return False
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_WRITE)
        return bool(sel.select(timeout_s))


def send_within(conn: mpc.Connection, obj, deadline: float) -> bool:
    """`conn.send(obj)`, the same bytes on the wire, giving up at `deadline` (`time.monotonic()`):
    a blocking send to a peer that stopped reading waits forever once the buffer is full. False if
    the peer has not taken the whole message by then; the connection is then unusable (part of a
    message is in it). The socket is non-blocking for this call only: `recv` expects it blocking."""
    data = memoryview(frame(ForkingPickler.dumps(obj)))
    fd = conn.fileno()
    os.set_blocking(fd, False)
    try:
        while data:
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:                 # the buffer is full: wait for the peer to read
                if not _writable(fd, deadline - time.monotonic()):
                    return False
    finally:
        os.set_blocking(fd, True)
    return True


@dataclass
class WorkerGroup:
    """The engine's handles on a running group: control connections by rank, local processes."""

    layout: ShardLayout
    conns: list
    procs: list | None = None
    clock_offsets: list[float] = field(default_factory=list)   # worker perf_counter - engine's
    lifeline: object = None         # the write end of the local processes' lifeline (`lifeline`)

    def describe(self, rank: int) -> str:
        lay = self.layout
        return f"worker rank {rank} (stage {lay.stage_of(rank)}, tp rank {lay.tp_rank_of(rank)})"

    def local(self) -> list:
        """The processes this engine started (None for a remote rank)."""
        return [p for p in self.procs or [] if p is not None]

    def dead(self) -> str | None:
        """Why the group is broken, if any of its local processes has exited: each one that has, and how."""
        gone = [f"{self.describe(r)} {exit_reason(p.exitcode)}" for r, p in enumerate(self.procs or [])
                if p is not None and p.exitcode is not None]
        return "; ".join(gone) or None

    def gone(self, rank: int) -> str:
        """Why worker `rank`'s control connection closed (usually a death: say how)."""
        p = self.procs[rank] if self.procs else None
        if p is not None:
            p.join(1.0)
            if p.exitcode is not None:
                return f"{self.describe(rank)} {exit_reason(p.exitcode)}"
        return f"{self.describe(rank)} closed its control connection (it died or lost the network)"

    def send(self, ranks, msg, timeout_s: float) -> None:
        """Send `msg` to each of `ranks` (in order), all of it within `timeout_s`: a worker that is
        stopped or hung stops reading its control connection, and a plain send to it would block
        forever once the buffer is full. Raises `WorkerFailure` naming the worker that did not take
        its message in time, or that is gone; the caller then shuts the group down (a connection
        left with part of a message in it is unusable)."""
        deadline = time.monotonic() + timeout_s
        for rank in ranks:
            try:
                sent = send_within(self.conns[rank], msg, deadline)
            except OSError as e:
                raise WorkerFailure(f"{self.dead() or self.gone(rank)} ({e.strerror or e})") from e
            if not sent:
                raise WorkerFailure(f"{self.describe(rank)} did not read its control connection within "
                                    f"{timeout_s:g} s (stopped or hung?)")

    def receive(self, timeout_s: float) -> list[tuple]:
        """Messages from any worker within `timeout_s` (possibly none); raises if a worker died or failed."""
        out = []
        ready = mpc.wait(list(self.conns) + [p.sentinel for p in self.local()], timeout_s)
        for c in self.conns:
            if c in ready:
                try:
                    while c.poll():
                        out.append(c.recv())
                except (EOFError, OSError):
                    out.append(("gone", self.conns.index(c)))
                    break
        why = next((f"{self.describe(m[1])} failed:\n{m[2]}" for m in out if m[0] == "error"), None)
        why = why or next((self.gone(m[1]) for m in out if m[0] == "gone"), None) or self.dead()
        if why is not None:
            raise WorkerFailure(why)
        return out

    def shutdown(self, grace_s: float = 2.0) -> None:
        """Join the local processes (terminate, then kill, what does not leave); close connections
        and the lifeline."""
        deadline = time.monotonic() + grace_s
        for p in self.local():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.local():
            if p.is_alive():
                p.terminate()
                p.join(0.5)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass
        self.conns = []
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None


def handshake(group: WorkerGroup, timeout_s: float, pings: int = 3, same_clock: bool = False) -> None:
    """Wait until every worker is ready (bounded), learn each one's clock offset, say "go".

    Processes of one machine share `perf_counter`'s clock (CLOCK_MONOTONIC on Linux): their offset
    is 0 (`same_clock`), exactly. Across machines it is estimated from the fastest of `pings` round
    trips, to within half of that round trip."""
    n = group.layout.world_size
    ready: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(ready) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WorkerFailure(f"only {len(ready)} of {n} workers were ready within {timeout_s:g} s")
        for m in group.receive(min(left, 0.25)):
            if m[0] == "ready":
                ready.add(m[1])
    offsets = []
    for rank, c in enumerate(group.conns):
        best = None
        for _ in range(pings):
            t0 = time.perf_counter()
            group.send([rank], "ping", timeout_s)
            m = c.recv() if c.poll(timeout_s) else None
            t1 = time.perf_counter()
            if m is None:
                raise WorkerFailure(f"{group.describe(rank)} did not answer a clock ping within {timeout_s:g} s")
            if m[0] == "error":
                raise WorkerFailure(f"{group.describe(rank)} failed:\n{m[2]}")
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, m[2] - (t0 + t1) / 2)
        offsets.append(0.0 if same_clock else best[1])
        group.send([rank], "go", timeout_s)
    group.clock_offsets = offsets


def check_gpus(world_size: int) -> None:
    """A group on cuda needs a GPU per worker (NCCL takes one per rank): refuse one larger than the GPUs visible."""
    if torch.cuda.device_count() < world_size:
        raise ValueError(f"tp x pp = {world_size} workers on cuda need as many GPUs (NCCL takes one per "
                         f"rank), but {torch.cuda.device_count()} are visible")


def launch_local(state: dict, layout: ShardLayout, *, n_slots: int, control: Control = Control.APART,
                 step_timeout_s: float = 60.0, launch_timeout_s: float = 120.0, device: str = "cpu",
                 dtype=None, threads: int = 1, attention: str = "split") -> WorkerGroup:
    """Start `layout.world_size` workers on this machine; returns once all are ready (bounded).
    `state` is the full model's `state_dict` (its tensors in shared memory travel once); `control` is
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
    leave_if_importing_main()
    check_main_runs_again()
    ctx = worker_context()
    listener, init_method = loopback_listener()
    cfg = WorkerConfig(layout=layout, state=state, preset=layout.spec.name, seed=0, n_slots=n_slots,
                       init_method=init_method, loopback=True, control=control,
                       step_timeout_s=step_timeout_s, device=device, dtype=dtype,
                       threads=threads, attention=attention)
    conns, procs = [], []
    life_r, life_w = lifeline(ctx)
    group = WorkerGroup(layout, conns, procs, lifeline=life_w)
    try:
        with listener, life_r:              # (each worker has its own copy once started)
            for rank in range(layout.world_size):
                mine, theirs = ctx.Pipe(duplex=True)
                p = ctx.Process(target=worker_main,
                                args=(rank, cfg, theirs, False, listener if rank == 0 else None, life_r),
                                daemon=True, name=f"orca-worker-{rank}")
                p.start()
                theirs.close()
                conns.append(mine)
                procs.append(p)
        handshake(group, launch_timeout_s, same_clock=True)
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.kill()
        group.shutdown(grace_s=0.0)
        raise
    return group


CONTROL_KEY = b"orca-torch-control"
"""The HMAC key of the control connections (multiprocessing.connection's handshake): it keeps
stray clients out, it is not a secret; run the control port on a trusted network."""


def control_listener(address: tuple[str, int], n_ranks: int = 1) -> mpc.Listener:
    """Global rank 0's control port, bound before any process starts (an `OSError` says why it cannot).
    Its queue holds the other `n_ranks - 1` ranks connecting at once (`Listener`'s default holds one:
    the kernel drops the others' first attempts, and each retries a second or more later)."""
    return mpc.Listener(address, backlog=max(n_ranks, 1), authkey=CONTROL_KEY)


AUTH_TIMEOUT_S = 5.0
"""How long rank 0 gives one new control connection to pass the key's challenge and say its rank
(`accept_ranks`); a rank does both at once, so this is only how long a silent client holds it up."""


@dataclass
class Joining:
    """A control connection being accepted: `multiprocessing.connection`'s byte messages over the raw
    socket, every read and write giving up at `deadline` (`time.monotonic()`), so that the key's
    challenge (`mpc.deliver_challenge`, `mpc.answer_challenge`, run on it as on a Connection) gives up
    on a client that connects and says nothing, which `Listener.accept` would wait on forever."""

    sock: socket.socket
    deadline: float

    def _bound(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the connection did not finish joining in time")
        self.sock.settimeout(left)

    def send_bytes(self, buf: bytes) -> None:
        self._bound()
        self.sock.sendall(frame(buf))

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        n, = struct.unpack("!i", self._read(4))
        if n < 0 or (maxlength is not None and n > maxlength):
            raise OSError(f"bad message length {n}")
        return self._read(n)

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            self._bound()
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the connection closed while joining")
            buf += chunk
        return buf

    def connection(self) -> mpc.Connection:
        """The joined connection as `Listener.accept` returns it (blocking, no timeout)."""
        self.sock.settimeout(None)
        return mpc.Connection(self.sock.detach())


def accept_ranks(listener: mpc.Listener, conns: list, timeout_s: float, *,
                 auth_timeout_s: float = AUTH_TIMEOUT_S, settings: tuple = ()) -> None:
    """Accept the other ranks' control connections on `listener` into `conns[rank]` (None until then),
    all within `timeout_s`. `Listener.accept` bounds only the TCP accept, then runs the key's challenge
    without a bound: one client that connects and never answers would hold rank 0 forever. Here each
    new connection has `auth_timeout_s` to pass the challenge both ways and say its rank; one that
    does not pass it (silent, another key, not multiprocessing at all) is closed and accepting goes
    on. One that passes it but does not say a rank is a misconfigured group: an error.

    `settings` are rank 0's `(flag, value)` pairs that every rank must share (`join_torchrun` sends
    its own): each node's torchrun is given its own command line, and a node started with another
    layout, model, seed, control path or device would build other shards or weights, to hang in the
    first collective or serve other tokens. A rank whose settings differ is an error naming them."""
    address = listener.address
    server = listener._listener._socket           # (CPython's Listener has no accept timeout)
    deadline = time.monotonic() + timeout_s
    dropped: list[str] = []                        # the hosts of connections that failed the challenge

    def late() -> WorkerFailure:
        many = len(dropped) > 1
        why = (f"; {len(dropped)} other connection{'s' * many} (from {', '.join(sorted(set(dropped)))}) did not "
               f"pass the control key's challenge within {auth_timeout_s:g} s and {'were' if many else 'was'} "
               "dropped" if dropped else "")
        return WorkerFailure(f"not every rank connected to the control port {address} within {timeout_s:g} s{why}")

    while None in conns:
        left = deadline - time.monotonic()
        if left <= 0:
            raise late()
        server.settimeout(left)
        try:
            sock, peer = server.accept()
        except socket.timeout:
            raise late() from None
        joining = Joining(sock, min(deadline, time.monotonic() + auth_timeout_s))
        try:
            mpc.deliver_challenge(joining, CONTROL_KEY)
            mpc.answer_challenge(joining, CONTROL_KEY)
        except (OSError, EOFError, AssertionError, mpc.AuthenticationError):   # (malformed challenge: assert)
            sock.close()
            dropped.append(str(peer[0]))
            continue
        try:
            said = pickle.loads(joining.recv_bytes(256))     # ("hello", rank): a few dozen bytes
        except Exception:                                    # silent, closed, or not a pickle
            said = None
        c = joining.connection()
        hello, rank, theirs = said if isinstance(said, tuple) and len(said) == 3 else (said, None, None)
        if hello != "hello" or not (type(rank) is int and 0 < rank < len(conns)) or conns[rank] is not None:
            c.close()
            raise WorkerFailure(f"a worker connected to {address} but did not say its rank" if hello is None
                                else f"unexpected control connection {hello!r} from rank {rank!r}")
        if not isinstance(theirs, tuple) or theirs != tuple(settings):
            c.close()
            theirs = theirs if isinstance(theirs, tuple) else ()
            raise WorkerFailure(f"rank {rank} was started with {_flags(theirs, settings)} but rank 0 with "
                                f"{_flags(settings, theirs)}: give every node's torchrun the same "
                                f"{', '.join(flag for flag, _ in settings)}")
        conns[rank] = c


def _flags(mine, other) -> str:
    """The `(flag, value)` pairs of `mine` that `other` does not hold, as typed on a command line."""
    return " ".join(f"{flag} {value}" for flag, value in mine if (flag, value) not in set(other)) or "nothing else"


def serve_torchrun(cfg: WorkerConfig, listener: mpc.Listener, timeout_s: float,
                   settings: tuple = ()) -> WorkerGroup:
    """Global rank 0 under torchrun: start this node's rank-0 worker as a child (it inherits
    torchrun's environment), accept the other ranks' control connections on `listener`
    (`control_listener`, closed here; `accept_ranks`, which refuses a rank whose `settings`
    differ), handshake."""
    ctx = tmp.get_context("spawn")
    n = cfg.layout.world_size
    conns: list = [None] * n
    procs: list = [None] * n
    life_r, life_w = lifeline(ctx)
    group = WorkerGroup(cfg.layout, conns, procs, lifeline=life_w)
    try:
        with listener, life_r:
            mine, theirs = ctx.Pipe(duplex=True)
            procs[0] = ctx.Process(target=worker_main, args=(0, cfg, theirs, False, None, life_r), daemon=True,
                                   name="orca-worker-0")
            procs[0].start()
            theirs.close()
            conns[0] = mine
            accept_ranks(listener, conns, timeout_s, settings=settings)
        handshake(group, timeout_s, same_clock=False)
    except BaseException:
        group.conns = [c for c in conns if c is not None]
        group.shutdown(grace_s=0.0)
        raise
    return group


def join_torchrun(rank: int, address: tuple[str, int], timeout_s: float, settings: tuple = ()):
    """Any other rank under torchrun: connect to the engine's control port (retrying until it listens)
    and say its rank and the `settings` every rank must share (`accept_ranks` compares them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            c = mpc.Client(address, authkey=CONTROL_KEY)
            c.send(("hello", rank, tuple(settings)))
            return c
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise WorkerFailure(f"rank {rank} could not reach the engine's control port {address} within "
                                    f"{timeout_s:g} s") from None
            time.sleep(0.2)
