"""One run through a `DistributedExecutor`, read off the workers' timestamps: the figures that
experiment 06 tabulates (lecture §4.4, exercise 6) — throughput, per-stage busy and CPU shares,
overlap, batches in flight, round trips, handoffs and time in collectives."""
from __future__ import annotations

import time

import numpy as np

from orca_torch.core.engine import Engine
from orca_torch.core.memory import UnlimitedMemory
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.distributed import stages
from orca_torch.distributed.executor import DistributedExecutor
from orca_torch.lab.workload import MAX_LENGTH, make_requests, with_prompt_ids


def closed_workload(n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int, vocab: int):
    """`n` requests all waiting at t=0, lengths uniform in the ranges (a closed workload: the
    throughput is the machine's, not the arrivals'). Its callers, experiment 06 and the distributed
    command line, give constant ranges and a count and seed their argparse types checked."""
    assert n >= 0 and all(1 <= lo <= hi < MAX_LENGTH for lo, hi in (prompt, output)), (n, prompt, output)
    rng = np.random.default_rng(seed)
    reqs = make_requests(np.zeros(n), rng.integers(prompt[0], prompt[1] + 1, n),
                         rng.integers(output[0], output[1] + 1, n), "closed, uniform lengths")
    return with_prompt_ids(reqs, vocab, seed=seed)


def median_pair(ratios: list[float]) -> int:
    """Index of the interleaved pair whose ratio is the median (the lower one of an even count), so a
    table shows one pair's figures and its ratio, not medians taken from different pairs."""
    assert ratios, "the median pair of no pairs"
    return sorted(range(len(ratios)), key=ratios.__getitem__)[(len(ratios) - 1) // 2]


def serve(ex: DistributedExecutor, reqs, max_bs: int, n_workers: int) -> dict:
    """Run `reqs` through the engine on `ex`; the run's figures (times in seconds), which need a step."""
    assert reqs, "a run of no requests has no steps to take figures from"
    cpu0, t0 = time.process_time(), time.perf_counter()
    res = Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=max_bs, n_workers=n_workers)).run(reqs)
    wall = time.perf_counter() - t0
    recs = list(ex.timeline)
    first_start, last_end = stages.span(recs)
    span_s = last_end - first_start
    pp = ex.layout.pp
    handoffs = stages.handoffs(recs, 0, 1) if pp > 1 else []
    return {"res": res, "records": recs, "tokens": res.output_ids, "n_steps": res.n_steps,
            "throughput_tok_s": int(res.output_len.sum()) / span_s, "span_s": span_s, "wall_s": wall,
            "engine_cpu_share": (time.process_time() - cpu0) / wall,
            "busy_fraction": [stages.busy_fraction(recs, s) for s in range(pp)],
            "cpu_share_busy": [stages.cpu_share(recs, s) for s in range(pp)],
            "worker_cores_used": sum(r.cpu_s for r in recs) / span_s,
            "busy_s_per_batch": [float(np.mean([e - s for s, e, _ in stages.intervals(recs, st)]))
                                 for st in range(pp)],
            "overlap_fraction": stages.overlap_s(recs, 0, pp - 1) / span_s if pp > 1 else 0.0,
            "max_in_flight": stages.max_in_flight(recs, pp),
            "round_trip_s": float(np.mean([back - sent for _, sent, back in ex.round_trips])),
            "handoff_s": float(np.mean(handoffs)) if handoffs else 0.0,
            "collective_s_per_step": float(np.mean([r.collective_s for r in recs if r.rank == 0]))}
