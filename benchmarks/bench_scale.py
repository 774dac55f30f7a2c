"""How long a very large simulated run takes, and how much memory it needs (default: 1,000,000 chat requests).

The seeded `chat` workload at `--rate` req/s through `--system` on the paper GPU (Llama-3-8B,
H100), then `metrics.summarize`: `api.run("chat", ...)`, which draws the named workload itself, as
`api.simulate` does (a list of requests given to `api.run` is copied first, so the caller's
objects are never changed: at a million requests that copy costs about a second and 150 MB).
Prints the wall and CPU time of each phase (the run, the workload drawn inside it; the summary)
and the peak resident memory of the process (`resource.getrusage`); with `--tracemalloc` also the
peak of Python's own allocations (slower: every allocation is traced). It also times a fixed
pure-Python loop first (`python_reference_s`), which tells a fast sitting of the VM from a slow
one (not by how much: the loop stays in the cache, the run walks over a gigabyte).

What it needs per token: nothing. The fast engine keeps a request's tokens as runs of consecutive
steps (`token_steps.TokenRuns`: first slot, first step, count; here one run a request), the summary
reads the first and last tokens, the inter-token gaps (counted per pair of steps) and the steady
window's tokens off the runs, and the column of step indices (the smallest unsigned type that holds
the run's step count: 4 bytes a token beyond 65,536 steps, 844 MB here) is built only if a caller
reads `RunResult.token_step`; token times derive from the step ends. What it holds is per request
(the `Request` objects, a few numbers each) and per step (six numbers each).
What it costs in time: with Orca's reservation the memory cannot run out, so the fast engine
goes on past finishes and takes each step that admits (an arrival's, or the queue's after a
finish) inside the run (the scheduler admits; `FastEngine._join_step`), up to 256 a call. Per request
that is its admission and its step priced, its finish, and its share of the decode steps (about
15 a request, a few tenths of a microsecond each to price, in order); the cyclic garbage
collector is paused while the requests are made and the run goes (`orca_torch/sim/collector.py`).

    python benchmarks/bench_scale.py                       # 1M requests at 8 req/s, orca-max
    python benchmarks/bench_scale.py --n 100000 --rate 16 --system orca-oracle
"""
from __future__ import annotations

import heapq
import resource
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Callable

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

from orca_torch.lab.api import BYTES_PER_REQUEST, SYSTEMS, run  # noqa: E402
from orca_torch.checks import check_fits_in_memory  # noqa: E402
from orca_torch.lab.cli_args import (add_seed_flag, command_parser, count_arg, flag_names, in_flag_terms,  # noqa: E402
                                     positive_float_arg)
from orca_torch.lab.metrics import summarize  # noqa: E402
from orca_torch.lab.workload import refuse_slower_than_the_clock  # noqa: E402
from orca_torch.lab.report import Report, machine, machine_line, quiet_exit  # noqa: E402
from orca_torch.core.token_steps import step_dtype  # noqa: E402


def percent_ticks(tick: Callable[[str], None]) -> Callable[[int, int], None]:
    """`api.run`'s `progress(finished, total)` as one tick of a `Report.progress` bar per whole percent."""
    shown = [0]

    def progress(finished: int, total: int) -> None:
        while shown[0] < 100 * finished // total:
            shown[0] += 1
            tick(f"% ({finished:,} of {total:,} requests finished)")
    return progress


def python_reference_s(n: int = 200_000, repeat: int = 3) -> float:
    """The best of `repeat` timings of a fixed pure-Python loop (a heap, a dict and a list, `n`
    items): the kind of work the run does per request. The VM's speed moves between sittings, and
    this says which way; the run's time over it moved from 43 to 60 within one sitting, as the
    VM's memory and CPU speeds moved apart, so it is no exact yardstick."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        heap: list[tuple[int, int]] = []
        held: dict[int, int] = {}
        out: list[int] = []
        for i in range(n):
            heapq.heappush(heap, ((i * 7919) % n, i))
            held[i] = i + 1
        while heap:
            k, i = heapq.heappop(heap)
            out.append(held.pop(i) + k)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = command_parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=count_arg, default=1_000_000, help="chat requests (default 1,000,000)")
    p.add_argument("--rate", type=positive_float_arg, default=8.0, help="arrivals per second (default 8)")
    p.add_argument("--system", default="orca-max", choices=SYSTEMS, metavar="SYSTEM",
                   help=f"the system that serves them: {', '.join(SYSTEMS)} (default orca-max)")
    add_seed_flag(p, "the chat workload")
    p.add_argument("--tracemalloc", action="store_true", help="also trace Python allocations (slower)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args()
    try:                            # (a lower bound: 1,000,000 chat requests peaked at 1.3 GiB)
        check_fits_in_memory(f"--n {args.n:,} (at least {BYTES_PER_REQUEST:,} bytes a chat request)",
                             args.n * BYTES_PER_REQUEST)
        refuse_slower_than_the_clock("rate", args.rate, args.n, allowed="--rate")
    except ValueError as e:
        p.error(in_flag_terms(str(e), flag_names(p)))
    reference = python_reference_s()
    if args.tracemalloc:
        tracemalloc.start()
    clock = [(time.perf_counter(), time.process_time())]

    def lap() -> tuple[float, float]:
        clock.append((time.perf_counter(), time.process_time()))
        (w0, c0), (w1, c1) = clock[-2], clock[-1]
        return w1 - w0, c1 - c0

    rep = Report(show_progress=not args.quiet and args.n > 10_000)
    with rep.progress(f"{args.n:,} requests", total=100) as tick:
        res = run("chat", args.rate, args.n, args.system, seed=args.seed,
                  progress=percent_ticks(tick) if rep.show_progress else None)
    t_run = lap()
    m = summarize(res)
    t_sum = lap()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB
    total_w = clock[-1][0] - clock[0][0]
    total_c = clock[-1][1] - clock[0][1]
    print(f"{args.n:,} chat requests at {args.rate:g} req/s, {args.system}: {res.n_steps:,} steps, "
          f"{res.n_tokens:,} tokens (token_step {step_dtype(res.n_steps)})")
    print(f"  {machine_line(machine())}")
    for name, (w, c) in (("run", t_run), ("summarize", t_sum)):
        print(f"  {name:10s} {w:8.2f} s wall {c:8.2f} s CPU")
    print(f"  {'total':10s} {total_w:8.2f} s wall {total_c:8.2f} s CPU; peak RSS {peak_rss / 2**30:.2f} GiB")
    print(f"  python reference loop {reference:.3f} s (`python_reference_s`): the run took "
          f"{t_run[0] / reference:.1f} times it")
    if args.tracemalloc:
        print(f"  tracemalloc peak {tracemalloc.get_traced_memory()[1] / 2**30:.2f} GiB")
    print(f"  TTFT median {m.ttft_median_s:.4g} s, ITL p99 {m.itl_p99_s:.4g} s, "
          f"throughput {m.throughput_tok_s:,.0f} tok/s")


if __name__ == "__main__":
    with quiet_exit():
        main()
