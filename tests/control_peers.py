"""Stand-ins for workers on the control channel, for the tests of the launch's handshake and of the
channel itself: no model, no process group, no process; and a free loopback port for a torchrun launch."""
from __future__ import annotations

import socket
import threading
import time

from orca_torch.distributed.control import host_store
from orca_torch.distributed.launch import WorkerGroup, control_listener
from orca_torch.distributed.shard import ShardLayout
from orca_torch.distributed.worker import ControlChannel, DriverGone
from orca_torch.specs import get_model_spec

TIMEOUT_S = 20.0


def store_group(pp: int = 2) -> WorkerGroup:
    """A group of `pp` stages of `tiny` and no process: only its control channel, on a free loopback
    port, listened to (`WorkerGroup.listen`)."""
    group = WorkerGroup(ShardLayout(get_model_spec("tiny"), pp=pp), host_store(control_listener(("127.0.0.1", 0), pp)))
    group.listen()
    return group


def free_port() -> int:
    """A TCP port free on the loopback interface now (bind to 127.0.0.1:0), for a program that binds
    it itself (torchrun's MASTER_PORT, a control port): it may be taken before that program binds
    it. A local launch's own store needs none: rank 0 takes a socket held open (`loopback_listener`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address(group: WorkerGroup) -> tuple[str, int]:
    return group.store.host, group.store.port


def in_thread(target, *args):
    """Run `target(*args)` in a daemon thread; `out` holds what it returned or raised once it is done."""
    out = []

    def run():
        try:
            out.append(target(*args))
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def answer_handshake(channel: ControlChannel) -> str:
    """A worker's part of the launch's handshake (`Worker.handshake`): say ready, answer the clock pings
    until "go" (returned); "gone" if the engine's store closes first."""
    channel.connect(TIMEOUT_S)
    channel.send(("ready", channel.rank, time.perf_counter()))
    try:
        while (m := channel.recv()) != "go":
            channel.send(("pong", channel.rank, time.perf_counter()))
    except DriverGone:
        return "gone"
    return m
