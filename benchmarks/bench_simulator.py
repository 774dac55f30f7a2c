"""How long one simulated 600-request chat run takes (tens of milliseconds, not seconds).

Llama-3-8B on the paper H100, the seeded `chat` workload, Orca (max and oracle reservation,
max_bs 512) and static batching (B = 128) at 1, 16 and 64 req/s. Each configuration runs once to
warm up, then `--repeat` times; the figure is the median wall time of workload generation +
simulation + metrics, and the CPU time beside it (the machine may be shared).

What bounds it: the scheduler touches every running request of every batch it schedules, twice
(building the batch's `works`, then bringing each request's counters up to date in `complete`),
and the fast-forward once more to find the next finish: plain Python passes, about 0.3 us per
request and batch together on the 2-core machine. After a step whose requests will all just
decode (a pure decode, or a step that admits whole prompts while nothing else can join), the
decodes that follow are priced at once, so the cost grows with the batches actually scheduled
times their size: the busiest setting (hundreds of requests running and an arrival every step or
two: orca-oracle at 64 req/s, ~370 batches of ~215 requests) costs the most. This is the price of
requests whose counters are true after every step: an earlier core kept the decoding requests
in shared lanes and paid per batch, not per request, and took less than half as long there.

    python benchmarks/bench_simulator.py            # one line per configuration, then a summary line
"""
from __future__ import annotations

import argparse
import statistics
import time

from orca_torch.api import run
from orca_torch.metrics import summarize
from orca_torch.report import seed_arg
from orca_torch.workload import chat


def bench(system: str, rate: float, repeat: int, seed: int) -> tuple[float, float, int]:
    times, cpu = [], []
    steps = 0
    for i in range(repeat + 1):
        w0, c0 = time.perf_counter(), time.process_time()
        res = run(chat(600, rate, seed=seed), system=system, max_bs=128 if system == "static" else 512)
        summarize(res)
        w1, c1 = time.perf_counter(), time.process_time()
        if i:  # the first run warms up
            times.append(w1 - w0)
            cpu.append(c1 - c0)
        steps = res.n_steps
    return statistics.median(times), statistics.median(cpu), steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--seed", type=seed_arg, default=0)
    args = p.parse_args()
    worst = 0.0
    for system in ("orca-max", "orca-oracle", "static"):
        for rate in (1, 16, 64):
            wall, cpu, steps = bench(system, rate, args.repeat, args.seed)
            worst = max(worst, wall)
            print(f"{system:12s} rate {rate:3d} req/s: {wall * 1e3:6.1f} ms wall, {cpu * 1e3:6.1f} ms CPU "
                  f"({steps} steps)")
    print(f"simulator: 600-request chat run, median wall time, slowest configuration: {worst * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
