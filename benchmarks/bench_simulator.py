"""How long one simulated 600-request chat run takes (tens of milliseconds, not seconds).

Llama-3-8B on the paper H100, the seeded `chat` workload, Orca (max and oracle reservation,
max_bs 512) and static batching (B = 128) at 1, 16 and 64 req/s. Each configuration runs once to
warm up, then `--repeat` times; the figure is the median wall time of workload generation +
simulation + metrics, and the CPU time beside it (the machine may be shared).

What bounds it: the scheduler touches every running request of every batch it schedules, twice
(building the batch's `works`, then bringing each request's counters up to date in `complete`),
and the fast-forward once more to find the next finish: plain Python passes, a few tenths of a
microsecond per request and batch on the 2-core machine. After a step whose requests will all just
decode (a pure decode, or a step that admits whole prompts while nothing else can join), the
decodes that follow are priced at once, past finishes too where no one waits to take the
finished request's place (a static batch is then one call from its prefill to its last finish),
and past arrivals the scheduler lets in at once (their steps taken inside the run), so the cost
grows with the batches actually scheduled times their size: the busiest setting
(hundreds of requests running and a finish that lets a waiting request in at almost every step:
orca-oracle at 64 req/s, ~160 batches of ~300 requests) costs the most. The "floor" column
measures the per-request part of that in the same run: the same batches' sizes replayed through
nothing but what any core whose requests are true after every step must do, a `works` tuple per
request and its two counters brought up to date, over `Request` objects. What the run takes
beyond it is the rest of the engine (the token record, the finish and next-finish checks, the
step's totals, pricing, memory, the step log, the queue, workload and summary). An earlier core
kept the decoding requests in shared lanes and paid per batch, not per request: at orca-oracle
64 req/s it executed less than half the instructions and took two thirds to nine tenths of the
time. On a shared machine whose speed moves between sittings, instructions are the steadier
count: `valgrind --tool=callgrind --callgrind-out-file=/dev/null python -c "..."` around one run
and around two, and the difference.

    python benchmarks/bench_simulator.py            # one line per configuration, then a summary line
"""
from __future__ import annotations

import argparse
import statistics
import time

from orca_torch.api import make_config, make_memory, run
from orca_torch.cli_args import count_arg, seed_arg
from orca_torch.engine import Engine
from orca_torch.executor import CostModelExecutor
from orca_torch.hw_model import kv_capacity_tokens
from orca_torch.metrics import summarize
from orca_torch.request import Request
from orca_torch.workload import chat


def max_bs(system: str) -> int:
    return 128 if system == "static" else 512


def bench(system: str, rate: float, repeat: int, seed: int) -> tuple[float, float, int]:
    times, cpu = [], []
    steps = 0
    for i in range(repeat + 1):
        w0, c0 = time.perf_counter(), time.process_time()
        res = run(chat(600, rate, seed=seed), system=system, max_bs=max_bs(system))
        summarize(res)
        w1, c1 = time.perf_counter(), time.process_time()
        if i:  # the first run warms up
            times.append(w1 - w0)
            cpu.append(c1 - c0)
        steps = res.n_steps
    return statistics.median(times), statistics.median(cpu), steps


def scheduled_sizes(system: str, rate: float, seed: int) -> tuple[list[int], int]:
    """The number of requests in each batch the scheduler chose (`Engine.step()` one at a time,
    set up as `api.run` sets it up), and the run's step count (to check it is the same run)."""
    mem = make_memory(system, kv_capacity_tokens("llama-3-8b", "h100"))
    engine = Engine(CostModelExecutor("llama-3-8b", "h100"), mem, make_config(system, max_bs(system)))
    engine.start(chat(600, rate, seed=seed))
    sizes = []
    while (batch := engine.step()) is not None:
        sizes.append(len(batch.works))
    return sizes, engine.result().n_steps


def floor_s(sizes: list[int], repeat: int) -> float:
    """Median seconds of the per-request work alone for batches of these sizes: each batch's
    `works` built and every request's two counters brought up to date."""
    pool = [Request(i, 0.0, 1, 2**40) for i in range(max(sizes))]
    batches = [pool[:k] for k in sizes]
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        for reqs in batches:
            works = [(r, 1, r.num_computed_tokens) for r in reqs]
            for r, n, p in works:
                r.num_computed_tokens = p + n
                r.n_generated += 1
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=count_arg, default=7, help="timed runs per configuration after a warm-up "
                   "(default 7)")
    p.add_argument("--seed", type=seed_arg, default=0)
    args = p.parse_args()
    worst = 0.0
    for system in ("orca-max", "orca-oracle", "static"):
        for rate in (1, 16, 64):
            wall, cpu, steps = bench(system, rate, args.repeat, args.seed)
            sizes, n_steps = scheduled_sizes(system, rate, args.seed)
            if n_steps != steps:
                raise RuntimeError(f"{system} at {rate} req/s: {n_steps} steps one at a time, {steps} through api.run")
            floor = floor_s(sizes, args.repeat)
            worst = max(worst, wall)
            print(f"{system:12s} rate {rate:3d} req/s: {wall * 1e3:6.1f} ms wall, {cpu * 1e3:6.1f} ms CPU "
                  f"({steps} steps; {len(sizes)} batches scheduled, {sum(sizes)} requests in them; "
                  f"floor {floor * 1e3:5.1f} ms)")
    print(f"simulator: 600-request chat run, median wall time, slowest configuration: {worst * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
