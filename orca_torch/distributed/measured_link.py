"""The link two worker processes of this machine get: gloo over loopback, measured (lecture §4.4).

`get_link("cpu")` times point-to-point gloo sends over 127.0.0.1, best of several ping-pongs at a
few message sizes, fitted as `one-way time = latency + bytes / bandwidth`, once per process like
`get_gpu("cpu")`. The result is a `LinkSpec`, which `hw_model.links.with_link` puts on a card.
"""
from __future__ import annotations

import functools
import math
import os
import time
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_ends

import numpy as np
import torch
import torch.distributed as dist

from orca_torch.checks import brief
from orca_torch.distributed.launch import lifeline, worker_context
from orca_torch.distributed.worker import init_loopback_group, loopback_listener, use_loopback, watch_lifeline
from orca_torch.lab.cli_args import TIMEOUT_MAX_S
from orca_torch.sim.hw_model.links import LinkSpec

SIZES = (8, 64 << 10, 256 << 10, 1 << 20)


def _pingpong(rank: int, init_method: str, listener, sizes: tuple[int, ...], repeats: int, conn, life) -> None:
    """Rank 0 and 1 bounce a float32 tensor of each size; rank 0 sends back the best round trips. Both
    end at once when the process that started them ends or is done with them (`life`, its lifeline)."""
    watch_lifeline(life, lambda: os._exit(0))     # (also how they end once their result is read)
    torch.set_num_threads(1)
    use_loopback()
    init_loopback_group("gloo", init_method, rank, 2, timedelta(seconds=300), listener)
    best = []
    for n in sizes:
        x = torch.zeros(max(1, n // 4))
        rtt = math.inf
        for i in range(repeats + 2):              # two warm-ups
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            if i >= 2:
                rtt = min(rtt, time.perf_counter() - t0)
        best.append(rtt)
    if rank == 0:
        conn.send(best)
    dist.destroy_process_group()
    conn.close()


def measure_loopback(repeats: int = 20, timeout_s: float = 60.0) -> LinkSpec:
    """gloo between two processes of this machine over 127.0.0.1, fitted from the best ping-pongs
    (`get_link("cpu")`'s, with these defaults)."""
    assert repeats >= 1 and 0 < timeout_s <= TIMEOUT_MAX_S, (repeats, timeout_s)
    return _measure(repeats, timeout_s)


@functools.lru_cache(maxsize=1)
def _measure(repeats: int, timeout_s: float) -> LinkSpec:
    ctx = worker_context()
    listener, init_method = loopback_listener()
    mine, theirs = ctx.Pipe(duplex=False)
    life_r, life_w = lifeline(ctx)
    procs = [ctx.Process(target=_pingpong, daemon=True,
                         args=(r, init_method, listener if r == 0 else None, SIZES, repeats, theirs, life_r))
             for r in (0, 1)]
    with listener, life_r:
        for p in procs:
            p.start()
    theirs.close()
    try:
        rtts = _result(mine, procs, timeout_s)
    finally:
        life_w.close()                            # (they end now, done or not)
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
    one_way = np.array(rtts) / 2
    slope, intercept = np.polyfit(np.array(SIZES, dtype=float), one_way, 1)
    lat = max(float(intercept), float(one_way[0]) * 0.5, 1e-7)
    bw = 1.0 / slope if slope > 0 else SIZES[-1] / max(one_way[-1] - lat, 1e-9)
    return LinkSpec("cpu", float(bw), lat,
                    source=f"measured: gloo send/recv over 127.0.0.1 between two processes, best of {repeats} "
                           f"ping-pongs at {', '.join(f'{s:,}' for s in SIZES)} B; one-way "
                           f"{', '.join(f'{t * 1e6:.0f}' for t in one_way)} us")


def _result(conn, procs: list, timeout_s: float) -> list[float]:
    """Rank 0's round trips from `conn`, within `timeout_s`; a ping-pong process that fails first (its
    traceback on stderr) is named as its end comes, with its exit code, rather than left to the pipe's
    bare end of file."""
    ends = {p.sentinel: rank for rank, p in enumerate(procs)}
    deadline = time.monotonic() + timeout_s
    while True:
        ready = wait_for_ends([conn, *ends], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RuntimeError(f"the loopback link measurement did not finish within {timeout_s:g} s")
        if conn in ready:
            try:
                return conn.recv()
            except EOFError:                    # every process that holds the pipe ended, none sent
                ended = list(range(len(procs)))
        else:
            ended = [ends.pop(end) for end in ready]
        for rank in ended:
            procs[rank].join(5.0)
        failed = [r for r in ended if procs[r].exitcode != 0]
        if failed or conn in ready:
            said = "; ".join(f"rank {r} exited with code {procs[r].exitcode}" for r in failed or ended)
            raise RuntimeError(f"the loopback link measurement ended before it was done: {said} (its error is on "
                               "stderr)")


def get_link(name: str) -> LinkSpec:
    """`"cpu"`: this machine's loopback gloo link, measured."""
    if not isinstance(name, str) or name != "cpu":
        raise ValueError(f"unknown link {brief(name)}; known links: cpu (datasheet links are on the GPU specs)")
    return measure_loopback()
