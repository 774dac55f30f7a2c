"""How long one simulated 600-request run takes on the paper H100 (issue 6: tens of milliseconds).

Seeded chat workload, one warm-up, the median of `--repeat` runs; one line per (system, rate),
the cases experiments 03 and 04 run most: a loaded Orca, an overloaded one, and the low rates at
which static batching and one-at-a-time are bisected for their goodput.

    python benchmarks/bench_experiments.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orca_torch.api import run
from orca_torch.metrics import summarize

CASES = [("orca-oracle", 1.0), ("orca-oracle", 32.0), ("orca-max", 32.0), ("orca-oracle", 128.0),
         ("static", 0.2), ("sequential", 0.15)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--n", type=int, default=600)
    args = p.parse_args()
    for system, rate in CASES:
        run("chat", rate, args.n, system)  # warm-up (trace parse, pricer cache)
        times, steps = [], 0
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            res = run("chat", rate, args.n, system)
            summarize(res)
            times.append(time.perf_counter() - t0)
            steps = res.n_steps
        med = statistics.median(times)
        print(f"{system:12s} {rate:6g} req/s  {args.n} requests  {steps:7d} steps  median {med * 1e3:7.1f} ms "
              f"(run + metrics)")


if __name__ == "__main__":
    main()
