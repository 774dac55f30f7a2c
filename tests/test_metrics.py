"""Metrics on hand-made timestamps, goodput's bisection, and the one-call API's headline shape."""
from __future__ import annotations

import math

import numpy as np
import pytest

from orca_torch.api import goodput, simulate
from orca_torch.engine import RunResult
from orca_torch.metrics import (goodput_search, inter_token_latencies, memory_occupancy, per_request,
                                steady_throughput, summarize)
from orca_torch.request import Request
from orca_torch.scheduler import SchedulerConfig


def hand_made() -> RunResult:
    """r0 arrives at 0, tokens at 1, 2, 4; r1 at 1, token at 3; r2 at 2, tokens at 3, 5."""
    reqs = [Request(0, 0.0, 10, 3), Request(1, 1.0, 10, 1), Request(2, 2.0, 10, 2)]
    times = [[1, 2, 4], [3], [3, 5]]
    offsets = np.array([0, 3, 4, 6])
    steps = np.array([0, 1, 3, 2, 2, 4])
    return RunResult(
        requests=reqs, rejected=[], arrival_s=np.array([0.0, 1.0, 2.0]), prompt_len=np.array([10, 10, 10]),
        output_len=np.array([3, 1, 2]), token_offsets=offsets,
        token_times=np.array([t for ts in times for t in ts], dtype=float), token_step=steps,
        release_s=np.array([4.0, 3.0, 5.0]), n_preemptions=np.zeros(3, dtype=int),
        step_start=np.arange(5.0), step_end=np.arange(1.0, 6.0), step_n_seqs=np.array([1, 1, 2, 2, 1]),
        step_n_tokens=np.array([10, 1, 21, 2, 1]), step_reserved=np.array([10, 10, 20, 20, 10]),
        step_used=np.array([1, 2, 5, 6, 3]), n_slots=40.0, config=SchedulerConfig())


def test_per_request_latencies():
    pr = per_request(hand_made())
    np.testing.assert_allclose(pr["ttft"], [1, 2, 1])
    np.testing.assert_allclose(pr["tpot"], [1.5, np.nan, 2.0])
    np.testing.assert_allclose(pr["e2e"], [4, 2, 3])
    np.testing.assert_allclose(pr["norm_latency"], [4 / 3, 2, 1.5])
    np.testing.assert_allclose(sorted(inter_token_latencies(hand_made())), [1, 2, 2])


def test_summary_figures():
    m = summarize(hand_made(), slo_ttft_s=1.5, slo_tpot_s=1.6)
    assert (m.ttft_median_s, m.ttft_max_s) == (1.0, 2.0) and math.isclose(m.ttft_mean_s, 4 / 3)
    assert m.tpot_median_s == 1.75
    assert (m.itl_median_s, m.itl_max_s) == (2.0, 2.0)
    assert m.e2e_median_s == 3.0 and m.norm_latency_median_s == 1.5
    # r0 meets both; r1 misses TTFT; r2 misses TPOT; a one-token answer has no TPOT to miss.
    assert math.isclose(m.slo_attainment, 1 / 3) and math.isclose(m.ttft_attainment, 2 / 3)
    assert math.isclose(m.tpot_attainment, 2 / 3)
    assert math.isclose(m.throughput_tok_s, 6 / 5) and m.makespan_s == 5.0
    # Steady: up to t = 3, when the last request got its first token: 4 tokens in 3 s.
    assert math.isclose(m.steady_throughput_tok_s, 4 / 3) and m.steady_window_s == 3.0
    assert math.isclose(m.mean_batch, 1.4) and m.max_batch == 2
    assert math.isclose(m.mem_occupied_tokens, 14.0) and math.isclose(m.mem_stored_tokens, 3.4)
    assert math.isclose(m.mem_occupied_frac, 0.35) and math.isclose(m.mem_stored_frac, 0.085)
    assert m.as_dict()["n_requests"] == 3
    with pytest.raises(ValueError, match="slo_ttft_s"):
        summarize(hand_made(), slo_ttft_s=0)


def test_steady_and_occupancy_helpers():
    assert steady_throughput(hand_made()) == (4 / 3, 3.0)
    assert memory_occupancy(hand_made()) == (14.0, 3.4)


def test_occupancy_counts_overlapping_pipelined_steps_once():
    res = hand_made()
    res.step_start = np.array([0.0, 0.5, 1.0, 1.5, 2.0])    # injected every 0.5, each lasts 1
    res.step_end = res.step_start + 1
    occ, used = memory_occupancy(res)
    assert math.isclose(occ, (0.5 * (10 + 10 + 20 + 20) + 10) / 5)


def test_goodput_bisection_finds_the_edge_within_tolerance():
    calls = []

    def att(rate):
        calls.append(rate)
        return 1.0 if rate <= 20.34 else 0.5

    g = goodput_search(att, target=0.9, lo=0.01, hi=256, rel_tol=0.01)
    assert 20.34 / 1.01 <= g.rate <= 20.34
    assert len(calls) == len(g.evaluations) <= 14
    assert goodput_search(lambda r: 1.0, lo=1, hi=10).rate == 10
    assert goodput_search(lambda r: 0.0, lo=1, hi=10).rate == 0.0
    with pytest.raises(ValueError, match="rel_tol"):
        goodput_search(att, rel_tol=0)


def test_continuous_batching_ttft_is_orders_of_magnitude_below_static_at_low_load():
    """The lecture's first observation (§5.2): at 1 req/s, 12 ms vs 1.6 s median TTFT."""
    cont = simulate(workload="chat", rate=1.0, n_requests=200, system="orca-max")
    stat = simulate(workload="chat", rate=1.0, n_requests=200, system="static")
    assert cont.ttft_median_s < 0.05 < 0.3 < stat.ttft_median_s
    assert cont.slo_attainment == 1.0 > stat.slo_attainment
    # Max reservation occupies far more memory than it stores; oracle occupies what it will store.
    busy = simulate(workload="chat", rate=16.0, n_requests=200, system="orca-max")
    oracle = simulate(workload="chat", rate=16.0, n_requests=200, system="orca-oracle")
    assert busy.mem_stored_frac < 0.3 * busy.mem_occupied_frac
    assert oracle.mem_occupied_frac < 0.3 * busy.mem_occupied_frac


def test_goodput_orders_the_systems():
    kw = dict(workload="chat", n_requests=120, rel_tol=0.05, lo=0.02, hi=128)
    static = goodput(system="static", **kw)
    orca = goodput(system="orca-oracle", **kw)
    assert orca.rate > 10 * max(static.rate, 0.02)


def test_simulate_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown system"):
        simulate(n_requests=5, system="orca-paged")
    with pytest.raises(ValueError, match="unknown GPU|gpu"):
        simulate(n_requests=5, gpu="tpu")
    with pytest.raises(ValueError, match="executor"):
        simulate(n_requests=5, executor="fpga")
