"""How long one simulated 600-request chat run takes (tens of milliseconds, not seconds).

Llama-3-8B on the paper H100, the seeded `chat` workload, Orca (max and oracle reservation,
max_bs 512) and static batching (B = 128) at 1, 16 and 64 req/s. Every configuration runs once
to warm up, then `--repeat` rounds run each configuration in turn (on a shared machine a stretch of
slower runs then falls on every configuration, not on one); the figure is the median wall time of
workload generation + simulation + metrics (`api.run("chat", ...)`, which draws the named workload
itself, as `api.simulate` does, then `summarize`), with its quartiles, and the median CPU time
beside it.

What bounds it: the steps, not the scheduling. After a step whose requests will all just decode (a
pure decode, or a step that admits whole prompts while nothing else can join), the fast engine
(`sim/fast_engine.py`) prices the decodes that follow at once; where the memory cannot run out it
goes on past finishes and takes the steps that admit (an arrival, or the queue after a finish)
inside the run, so one `FastEngine.step()` covers up to 256 of them, and at 64 req/s one call covers
nearly the whole run. Each step is still priced on its own, in order (a decode run of up to 32 steps
in a Python loop, longer ones with numpy), and a step that admits still costs its admission, its
pricing and the finishes it follows: at 1 req/s, where each request runs mostly alone, 74,000 steps
are priced (about a quarter of the time), at 64 req/s a thousand. The rest is per request: the
workload, the submission checks, the queue, the finish, the token record and the summary. An earlier
core that kept the decoding requests in shared lanes, and did not keep every request's counters true
after every step, executed more instructions at every setting (the core that followed it, before
`Engine.step()` became one iteration: 0.66-0.98 of its count for Orca, the closest at orca-oracle 64
req/s, 0.77-0.96 for static batching; valgrind --tool=callgrind around three runs and around one,
the difference halved, PYTHONHASHSEED=0 for the closest, since the hash seed moves a count by up to
~8%: the machine's speed moves between sittings, instructions do not). Each line also prints how
many calls of `FastEngine.step()` the run took.

    python benchmarks/bench_simulator.py            # one line per configuration, then a summary line
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if (ROOT := str(Path(__file__).resolve().parents[1])) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, ROOT)

from orca_torch.lab.api import make_config, make_memory, run  # noqa: E402
from orca_torch.lab.cli_args import add_seed_flag, command_parser, int_arg  # noqa: E402
from orca_torch.sim.executors import CostModelExecutor  # noqa: E402
from orca_torch.sim.fast_engine import FastEngine  # noqa: E402
from orca_torch.sim.hw_model import kv_capacity_tokens  # noqa: E402
from orca_torch.lab.metrics import summarize  # noqa: E402
from orca_torch.lab.report import machine, machine_line, quiet_exit  # noqa: E402
from orca_torch.lab.workload import chat  # noqa: E402


def max_bs(system: str) -> int:
    return 128 if system == "static" else 512


CONFIGS = [(system, rate) for system in ("orca-max", "orca-oracle", "static") for rate in (1, 16, 64)]
MAX_REPEAT = 1000       # a round times every configuration (a third of a second or so): 1000 take minutes


def timed_run(system: str, rate: float, seed: int) -> tuple[float, float, int]:
    """Wall and CPU seconds of one run and its summary, and the run's step count."""
    w0, c0 = time.perf_counter(), time.process_time()
    res = run("chat", rate, 600, system, max_bs=max_bs(system), seed=seed)
    summarize(res)
    return time.perf_counter() - w0, time.process_time() - c0, res.n_steps


def bench(repeat: int, seed: int) -> dict[tuple[str, int], tuple[list[float], list[float], int]]:
    """Every configuration once to warm up, then `repeat` rounds of every configuration in turn: a
    stretch where the shared machine runs slower falls on all of them, not on one."""
    out = {c: ([], [], 0) for c in CONFIGS}
    for i in range(repeat + 1):
        for c in CONFIGS:
            wall, cpu, steps = timed_run(*c, seed)
            if i:
                out[c][0].append(wall)
                out[c][1].append(cpu)
            out[c] = (out[c][0], out[c][1], steps)
    return out


def step_calls(system: str, rate: float, seed: int) -> tuple[int, int]:
    """How many calls of `FastEngine.step()` the run takes (set up as `api.run` sets it up), and its
    step count (to check it is the same run)."""
    mem = make_memory(system, kv_capacity_tokens("llama-3-8b", "h100"))
    engine = FastEngine(CostModelExecutor("llama-3-8b", "h100"), mem, make_config(system, max_bs(system)))
    engine.start(chat(n_requests=600, rate=rate, seed=seed))
    calls = 0
    while engine.step() is not None:
        calls += 1
    return calls, engine.result().n_steps


def main() -> None:
    p = command_parser(__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int_arg(1, MAX_REPEAT, f" (a round times all {len(CONFIGS)} configurations)"),
                   default=15, help=f"timed runs per configuration after a warm-up, 1 to {MAX_REPEAT} (default 15)")
    add_seed_flag(p, "the chat workloads")
    args = p.parse_args()
    print(machine_line(machine()))
    worst = 0.0
    for (system, rate), (times, cpu, steps) in bench(args.repeat, args.seed).items():
        wall = statistics.median(times)
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (wall, wall, wall)
        calls, n_steps = step_calls(system, rate, args.seed)
        if n_steps != steps:
            raise RuntimeError(f"{system} at {rate} req/s: {n_steps} steps one call at a time, "
                               f"{steps} through api.run")
        worst = max(worst, wall)
        print(f"{system:12s} rate {rate:3d} req/s: {wall * 1e3:6.1f} ms wall (quartiles {q1 * 1e3:.1f}-"
              f"{q3 * 1e3:.1f}), {statistics.median(cpu) * 1e3:6.1f} ms CPU "
              f"({steps} steps in {calls} calls of FastEngine.step())")
    print(f"simulator: 600-request chat run, median wall time, slowest configuration: {worst * 1e3:.1f} ms")


if __name__ == "__main__":
    with quiet_exit():
        main()
