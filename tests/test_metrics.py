"""Metrics on hand-made timestamps, goodput's bisection, and the one-call API's headline shape."""
from __future__ import annotations

import math

import numpy as np
import pytest

from orca_torch.lab.api import goodput, simulate
from orca_torch.core.engine import Engine
from orca_torch.sim.executors import CostModelExecutor
from orca_torch.core.memory import ReservationMemory
from orca_torch.lab.metrics import (counted_quantiles, goodput_search, inter_token_latencies, memory_occupancy,
    per_request, quantiles, steady_throughput, summarize)
from orca_torch.lab.report import queued, step_figures
from orca_torch.core.request import Request
from orca_torch.core.run_result import Rejected, RunResult
from orca_torch.core.scheduler_config import SchedulerConfig


def hand_made() -> RunResult:
    """r0 arrives at 0, tokens at 1, 2, 4; r1 at 1, token at 3; r2 at 2, tokens at 3, 5."""
    reqs = [Request(0, 0.0, 10, 3), Request(1, 1.0, 10, 1), Request(2, 2.0, 10, 2)]
    offsets = np.array([0, 3, 4, 6])
    steps = np.array([0, 1, 3, 2, 2, 4])
    return RunResult(
        requests=reqs, rejected=[], arrival_s=np.array([0.0, 1.0, 2.0]), prompt_len=np.array([10, 10, 10]),
        output_len=np.array([3, 1, 2]), token_offsets=offsets,
        token_step=steps,
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


def test_a_latency_equal_to_its_slo_meets_it():
    m = summarize(hand_made(), slo_ttft_s=1.0, slo_tpot_s=1.5)    # r0: TTFT 1, TPOT 1.5, both met exactly
    assert (m.ttft_attainment, m.tpot_attainment, m.slo_attainment) == (2 / 3, 2 / 3, 1 / 3)


def test_ttft_and_tpot_attainment_are_each_over_their_own_limit():
    """`hand_made` has TTFT 1, 2, 1 and TPOT 1.5, none, 2: at TTFT <= 2.5 all meet it and r2 misses
    TPOT <= 1.6; with no TPOT bound, r1 misses TTFT <= 1.5 alone."""
    m = summarize(hand_made(), slo_ttft_s=2.5, slo_tpot_s=1.6)
    assert (m.ttft_attainment, m.tpot_attainment, m.slo_attainment) == pytest.approx((1.0, 2 / 3, 2 / 3))
    m = summarize(hand_made(), slo_ttft_s=1.5, slo_tpot_s=math.inf)
    assert (m.ttft_attainment, m.tpot_attainment, m.slo_attainment) == pytest.approx((2 / 3, 1.0, 2 / 3))


def test_figures_count_from_the_first_arrival_whatever_the_clock_reads_then():
    """A live run keeps its requests' own clock, so its first arrival need not be at 0: `hand_made`
    with every time 10 s later has the same figures (6 tokens over 5 s, 4 of them in the 3 s to the
    last first token, occupancy averaged over the 5 s)."""
    res = hand_made()
    for column in ("arrival_s", "release_s", "step_start", "step_end"):
        setattr(res, column, getattr(res, column) + 10.0)
    m = summarize(res, slo_ttft_s=1.5, slo_tpot_s=1.6)
    assert m.makespan_s == 5.0
    assert (m.throughput_tok_s, m.throughput_req_s) == pytest.approx((6 / 5, 3 / 5))
    assert (m.steady_throughput_tok_s, m.steady_window_s) == pytest.approx((4 / 3, 3.0))
    assert (m.mem_occupied_tokens, m.mem_stored_tokens) == pytest.approx((14.0, 3.4))
    assert (m.ttft_median_s, m.tpot_median_s, m.e2e_median_s) == pytest.approx((1.0, 1.75, 3.0))


@pytest.mark.parametrize("few_steps", [4, 0])    # ITL from the gaps themselves, and counted per pair of steps
def test_one_token_answers_have_no_tpot_and_no_inter_token_gap(few_steps, monkeypatch):
    """Two one-token answers (r0 at 0, token at 1; r1 at 0.5, token at 2): TTFT 1 and 1.5, and no
    TPOT or ITL at all, so their mean, median and P99 are NaN rather than 0 (a 0 would read as
    instant decoding); each meets any TPOT limit."""
    from orca_torch.lab import metrics

    monkeypatch.setattr(metrics, "_FEW_STEPS", few_steps)
    res = RunResult(
        requests=[Request(0, 0.0, 4, 1), Request(1, 0.5, 4, 1)], rejected=[], arrival_s=np.array([0.0, 0.5]),
        prompt_len=np.array([4, 4]), output_len=np.array([1, 1]), token_offsets=np.array([0, 1, 2]),
        token_step=np.array([0, 1]), release_s=np.array([1.0, 2.0]), n_preemptions=np.zeros(2, dtype=int),
        step_start=np.array([0.0, 1.0]), step_end=np.array([1.0, 2.0]), step_n_seqs=np.array([1, 1]),
        step_n_tokens=np.array([4, 4]), step_reserved=np.array([5, 5]), step_used=np.array([5, 5]),
        n_slots=10.0, config=SchedulerConfig())
    m = summarize(res, slo_ttft_s=1.2, slo_tpot_s=1e-9)
    assert (m.ttft_mean_s, m.ttft_max_s) == pytest.approx((1.25, 1.5))
    for figure in ("tpot_mean_s", "tpot_median_s", "tpot_p99_s", "itl_median_s", "itl_p99_s", "itl_max_s"):
        assert math.isnan(getattr(m, figure)), figure
    assert (m.ttft_attainment, m.tpot_attainment, m.slo_attainment) == (0.5, 1.0, 0.5)


def test_queued_and_step_figures_of_the_hand_made_run():
    """r0 and r2 got their first token from the step that started at their arrival (0 and 2); r1
    arrived as step 1 started but got its first token from step 2: one request queued. The steps
    fed at most 21 tokens and each took 1 s."""
    assert queued(hand_made()) == 1
    assert step_figures(hand_made()) == {"max_step_tokens": 21, "max_step_s": 1.0}


def test_queued_counts_a_chunked_prompt_admitted_at_once_as_not_queued():
    """r0's 40-token prompt is admitted at step 0 and fed in chunks of 16 to its first token at step
    2; r1 and r2 wait for the budget. It counted r0 too, by its first token: 3."""
    from orca_torch.lab.api import run

    reqs = [Request(0, 0.0, 40, 2), Request(1, 0.0, 8, 2), Request(2, 0.0, 8, 2)]
    res = run(reqs, max_bs=2, chunked_prefill=True, max_num_batched_tokens=16, trace=True)
    assert [rid for rid, _, _ in res.trace[0].works] == [0] and list(res.first_token_step) == [2, 2, 4]
    assert queued(res) == 2


def test_summarize_and_queued_read_a_fast_runs_tokens_as_runs(monkeypatch):
    """A run of the fast engine holds its tokens as runs (`TokenRuns`); the summary and `queued`
    read them so, and never build the per-token column (queued once read it to find first tokens)."""
    from orca_torch.core.token_steps import TokenRuns
    from orca_torch.lab.api import run

    def fast_run() -> RunResult:                # (4 seats for 32 req/s: most requests wait)
        return run("chat", rate=32.0, n_requests=40, seed=1, max_bs=4)

    res = fast_run()
    want_queued = int((res.token_step[res.token_offsets[:-1]]
                       > np.searchsorted(res.step_start, res.arrival_s, side="left")).sum())
    assert want_queued > 0
    res = fast_run()
    monkeypatch.setattr(TokenRuns, "column", lambda self, step_count: pytest.fail("the token column was built"))
    summarize(res)
    assert queued(res) == want_queued


def test_steady_and_occupancy_helpers():
    assert steady_throughput(hand_made()) == (4 / 3, 3.0)
    assert memory_occupancy(hand_made()) == (14.0, 3.4)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_occupancy_summed_a_chunk_of_steps_at_a_time_is_the_same(chunk, monkeypatch):
    from orca_torch.lab import metrics

    res = hand_made()
    res.step_start = np.array([0.0, 0.5, 1.0, 3.5, 4.0])    # overlapping, then an idle gap
    whole = memory_occupancy(res)
    monkeypatch.setattr(metrics, "_STEPS", chunk)
    assert memory_occupancy(res) == pytest.approx(whole, rel=1e-15)
    assert whole == pytest.approx(((10 * .5 + 10 * .5 + 20 * 2 + 20 * .5 + 10 * 1) / 5,   # step 2 runs 1 -> 3
                                   (1 * .5 + 2 * .5 + 5 * 2 + 6 * .5 + 3 * 1) / 5))


def test_occupancy_counts_overlapping_pipelined_steps_once():
    res = hand_made()
    res.step_start = np.array([0.0, 0.5, 1.0, 1.5, 2.0])    # injected every 0.5, each lasts 1
    res.step_end = res.step_start + 1
    occ, used = memory_occupancy(res)
    assert res.last_token_s.max() == 3.0                   # tokens come out when their steps end
    assert math.isclose(occ, (0.5 * (10 + 10 + 20 + 20) + 10) / 3)
    assert math.isclose(used, (0.5 * (1 + 2 + 5 + 6) + 3) / 3)


def test_goodput_bisection_finds_the_edge_within_tolerance():
    calls = []

    def att(rate):
        calls.append(rate)
        return 1.0 if rate <= 20.34 else 0.5

    g = goodput_search(att, target=0.9, lo=0.01, hi=256, rel_tol=0.01, probes=())
    assert 20.34 / 1.01 <= g.rate <= 20.34
    assert len(calls) == len(g.evaluations) <= 14
    assert g.note == ""
    # the default probes add three rates around the answer; a monotone attainment gives no warning
    calls.clear()
    probed = goodput_search(att, target=0.9, lo=0.01, hi=256, rel_tol=0.01)
    assert probed.rate == g.rate and probed.evaluations[:len(g.evaluations)] == g.evaluations
    assert [r for r, _ in probed.evaluations[len(g.evaluations):]] == [g.rate * f for f in (0.5, 0.8, 1.25)]
    assert len(calls) == len(probed.evaluations) == len(g.evaluations) + 3 and probed.note == ""
    assert goodput_search(lambda r: 1.0, lo=1, hi=10).rate == 10
    probed_to_lo = goodput_search(lambda r: 1.0, lo=1.0, hi=2.0)      # a probe at a bound is inside [lo, hi]
    assert probed_to_lo.evaluations == [(2.0, 1.0), (1.0, 1.0), (1.6, 1.0)]
    assert goodput_search(lambda r: 0.0, lo=1, hi=10).rate == 0.0
    with pytest.raises(ValueError, match="rel_tol"):
        goodput_search(att, rel_tol=0)


def test_goodput_counts_an_attainment_equal_to_the_target_as_meeting_it():
    """Goodput is the largest rate with attainment >= 90% (lecture §5.3): exactly 90% qualifies."""
    g = goodput_search(lambda rate: 0.9 if rate <= 20.34 else 0.5, target=0.9, lo=0.01, hi=256, rel_tol=0.01)
    assert 20.34 / 1.01 <= g.rate <= 20.34
    assert g.note == ""                  # monotone: a rate at exactly the target met it, none missed it


@pytest.mark.parametrize("met", [1.0, 0.9])      # 0.9: meeting the target exactly meets it here too
@pytest.mark.parametrize("shape", ["dip below", "second hill above"])
def test_goodput_warns_when_attainment_is_not_monotone(shape, met):
    """Bisection's own evaluations cannot show non-monotonicity; the probes can, and the note says so."""
    def att(rate):
        if shape == "dip below" and 8 < rate < 12:
            return 0.5                                   # a rate below the answer misses the target
        if shape == "second hill above" and 24 < rate <= 27:
            return met                                   # a rate above the answer meets it
        return met if rate <= 20.34 else 0.5

    plain = goodput_search(att, probes=())
    assert plain.note == ""                             # the bisection alone sees nothing wrong
    g = goodput_search(att)
    assert g.rate == plain.rate and 20.34 / 1.01 <= g.rate <= 20.34
    assert g.note.startswith("warning: attainment is not monotone in the rate")
    missed = [r for r, a in g.evaluations if a < 0.9]
    met = [r for r, a in g.evaluations if a >= 0.9]
    assert min(missed) < max(met)
    bad_rate = g.rate * (0.5 if shape == "dip below" else 1.25)
    assert f"{bad_rate:.4g} req/s" in g.note


def test_goodput_warning_names_the_lowest_rate_that_missed_and_the_highest_that_met_above_it():
    """Attainment dips below the target between 8 and 17 req/s: the probes at half and 80% of the
    answer (about 10 and 16) both miss while the answer met, and the warning names the widest such
    pair, the lower probe and the answer."""
    g = goodput_search(lambda rate: 0.5 if 8 < rate < 17 else 1.0 if rate <= 20.34 else 0.5)
    assert 8 < g.rate * 0.5 < g.rate * 0.8 < 17 < g.rate <= 20.34
    assert f"{g.rate * 0.5:.4g} req/s missed the target" in g.note
    assert f"while {g.rate:.4g} req/s met it" in g.note


def test_slo_attainment_over_submitted_counts_rejections_as_misses():
    served = summarize(hand_made(), slo_ttft_s=1.5, slo_tpot_s=1.6)
    assert served.slo_attainment_submitted == served.slo_attainment    # nothing rejected: the same
    res = hand_made()
    res.rejected = [Rejected(Request(9, 0.5, 5000, 10), "request 9 exceeds the max context")]
    m = summarize(res, slo_ttft_s=1.5, slo_tpot_s=1.6)
    assert math.isclose(m.slo_attainment, 1 / 3)                        # 1 of 3 served meets both
    assert math.isclose(m.slo_attainment_submitted, 1 / 4)              # 1 of 4 submitted
    assert m.n_rejected == 1 and m.n_requests == 3
    # a refused request made no token and was not served: the rates are over the 3 served, as before
    assert (m.throughput_tok_s, m.throughput_req_s) == pytest.approx((6 / 5, 3 / 5))


def test_a_run_that_rejects_everything_is_a_clear_error():
    engine = Engine(CostModelExecutor("llama-3-8b", "h100"), ReservationMemory(50_000, "max"), max_context=4096)
    reqs = [Request(0, 0.0, 4000, 200), Request(1, 0.1, 5000, 10)]
    res = engine.run(reqs, on_invalid="reject")
    assert res.n == 0 and len(res.rejected) == 2
    with pytest.raises(ValueError, match=r"^all 2 requests were rejected: request 0\b.*exceeds the max context 4096"):
        summarize(res)
    # one request served is enough to summarize: attainment over submitted counts the other as a miss
    res = engine.run([Request(0, 0.0, 100, 20), reqs[1]], on_invalid="reject")
    m = summarize(res, slo_ttft_s=10.0, slo_tpot_s=10.0)
    assert (m.slo_attainment, m.slo_attainment_submitted) == (1.0, 0.5)


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
    with pytest.raises(ValueError, match="unknown GPU 'tpu'; known GPUs: a100-40gb, .*, or a GPU profile's .json path"):
        simulate(n_requests=5, gpu="tpu")
    with pytest.raises(ValueError, match="unknown executor 'fpga'; choose one of 'cost', 'torch'"):
        simulate(n_requests=5, executor="fpga")


def test_every_summary_figure_of_the_hand_made_run_by_hand():
    """Each figure from its definition (module docstring) on `hand_made`: TTFT 1, 2, 1; TPOT 1.5,
    none, 2; E2E 4, 2, 3; normalized latency 4/3, 2, 3/2; gaps 1, 2 (r0) and 2 (r2). A P99 of three
    sorted values a <= b <= c is numpy's linear one: b + 0.98 (c - b)."""
    res = hand_made()
    res.n_preemptions = np.array([1, 0, 2])
    m = summarize(res, slo_ttft_s=1.5, slo_tpot_s=1.6)
    assert (m.n_requests, m.n_rejected, m.n_preemptions, m.n_steps) == (3, 0, 3, 5)
    assert m.ttft_mean_s == pytest.approx(4 / 3) and m.ttft_median_s == 1.0 and m.ttft_max_s == 2.0
    assert m.ttft_p99_s == pytest.approx(1 + 0.98 * (2 - 1))
    assert m.tpot_mean_s == pytest.approx((1.5 + 2.0) / 2)        # a one-token answer has no TPOT
    assert m.tpot_median_s == pytest.approx(1.75) and m.tpot_p99_s == pytest.approx(1.5 + 0.99 * 0.5)
    assert (m.itl_median_s, m.itl_p99_s, m.itl_max_s) == pytest.approx((2.0, 2.0, 2.0))
    assert m.e2e_median_s == 3.0 and m.e2e_p99_s == pytest.approx(3 + 0.98 * (4 - 3))
    assert m.norm_latency_median_s == 1.5 and m.norm_latency_mean_s == pytest.approx((4 / 3 + 2 + 1.5) / 3)
    assert (m.slo_ttft_s, m.slo_tpot_s) == (1.5, 1.6)
    assert m.throughput_tok_s == pytest.approx(6 / 5) and m.throughput_req_s == pytest.approx(3 / 5)


def test_quantiles_of_values_of_different_magnitudes_are_numpy_s_at_the_midpoint_too():
    """At g = 0.5 exactly (the median of an even count) numpy's linear quantile is `x1 - d / 2`, which
    differs from `x0 + d / 2` in the last bit when the two values differ in magnitude (a gap of
    microseconds beside one of a second)."""
    rng = np.random.default_rng(4)
    for n in (2, 4, 6, 10, 100):
        for _ in range(50):
            x = np.abs(rng.standard_normal(n)) * 10.0 ** rng.integers(-5, 2, n)
            qs = (0.5, 0.25, 0.75)
            want = [float(np.quantile(x, q)) for q in qs]
            assert quantiles(x, qs) == want, x
            assert counted_quantiles(x, np.ones(n, dtype=np.uint32), qs) == want, x


@pytest.mark.parametrize("bins", [2, 3, 4, 16])
def test_order_statistics_through_bins_at_every_rank(bins, monkeypatch):
    """Every rank of a multiset binned into a few bins, against the sorted list itself: ranks that
    fall on the boundary between two bins (a rank equal to the count below a bin) included."""
    from orca_torch.lab import metrics

    monkeypatch.setattr(metrics, "_BINS", bins)
    rng = np.random.default_rng(5)
    for values in (np.arange(8.0), rng.permutation(np.arange(20.0)) / 7, rng.exponential(1.0, 30)):
        for counts in (np.ones(len(values), dtype=np.uint32), rng.integers(1, 4, len(values)).astype(np.uint32)):
            want = np.sort(np.repeat(values, counts)).tolist()
            ranks = list(range(len(want)))
            assert metrics.order_statistics(values, counts, ranks) == want


def instant() -> RunResult:
    """One request that arrives at 0 and gets its one token from a step of no length at 0 (a coarse clock)."""
    return RunResult(
        requests=[Request(0, 0.0, 4, 1)], rejected=[], arrival_s=np.array([0.0]), prompt_len=np.array([4]),
        output_len=np.array([1]), token_offsets=np.array([0, 1]), token_step=np.array([0]),
        release_s=np.array([0.0]), n_preemptions=np.zeros(1, dtype=int), step_start=np.array([0.0]),
        step_end=np.array([0.0]), step_n_seqs=np.array([1]), step_n_tokens=np.array([4]),
        step_reserved=np.array([5]), step_used=np.array([5]), n_slots=10.0, config=SchedulerConfig())


def test_a_run_whose_first_tokens_all_came_at_the_first_arrival_has_no_steady_window():
    """(NaN, 0.0) when the last first token came at the first arrival (§5.4: no window to divide by),
    as a step of no length on a coarse clock makes it."""
    rate, window = steady_throughput(instant())
    assert math.isnan(rate) and window == 0.0


def test_a_run_of_no_length_summarizes_with_no_rates_and_no_occupancy():
    """A run whose last token came at its first arrival spans no time: its latencies are 0, and a rate
    or a time-weighted occupancy over no time is NaN (JSON null), not a division by zero."""
    m = summarize(instant())
    assert (m.makespan_s, m.steady_window_s, m.ttft_median_s, m.e2e_median_s) == (0.0, 0.0, 0.0, 0.0)
    assert m.slo_attainment == 1.0
    for figure in ("throughput_tok_s", "throughput_req_s", "steady_throughput_tok_s", "mem_occupied_frac",
                   "mem_stored_frac", "mem_occupied_tokens", "mem_stored_tokens"):
        assert math.isnan(getattr(m, figure)), figure


def test_occupancy_is_averaged_over_the_run_from_the_first_arrival():
    """The run spans first arrival to last token (the makespan), idle start included: a request
    arriving at 0 whose steps run 1 -> 2 -> 3 holds 6 slots for 2 s of the run's 3 s."""
    res = RunResult(
        requests=[Request(0, 0.0, 4, 2)], rejected=[], arrival_s=np.array([0.0]), prompt_len=np.array([4]),
        output_len=np.array([2]), token_offsets=np.array([0, 2]), token_step=np.array([0, 1]),
        release_s=np.array([3.0]), n_preemptions=np.zeros(1, dtype=int), step_start=np.array([1.0, 2.0]),
        step_end=np.array([2.0, 3.0]), step_n_seqs=np.array([1, 1]), step_n_tokens=np.array([4, 1]),
        step_reserved=np.array([6, 6]), step_used=np.array([5, 6]), n_slots=12.0, config=SchedulerConfig())
    occ, stored = memory_occupancy(res)
    assert occ == pytest.approx((6 * 1 + 6 * 1) / 3) and stored == pytest.approx((5 * 1 + 6 * 1) / 3)
    m = summarize(res)
    assert m.makespan_s == 3.0 and m.mem_occupied_frac == pytest.approx(4 / 12)


@pytest.mark.parametrize("lo, hi, rel_tol", [(1.0, 2.0, 0.01), (0.01, 256.0, 0.01), (0.5, 64.0, 0.05),
                                             (3.0, 3.5, 0.001)])
def test_goodput_brackets_the_edge_within_its_tolerance(lo, hi, rel_tol):
    """The rate returned met the target and some evaluated rate within a factor 1 + rel_tol above it
    missed: the bracket the bisection promises, whatever the bounds."""
    rng = np.random.default_rng(6)
    for edge in np.exp(rng.uniform(math.log(lo), math.log(hi), 20)):
        def att(rate, edge=edge):
            return 1.0 if rate <= edge else 0.0

        g = goodput_search(att, target=0.9, lo=lo, hi=hi, rel_tol=rel_tol, probes=())
        assert att(g.rate) == 1.0
        missed_above = [r for r, a in g.evaluations if a < 0.9 and r > g.rate]
        assert min(missed_above) <= g.rate * (1 + rel_tol), (edge, g.evaluations)


def test_steady_throughput_counts_the_tokens_out_by_then_when_steps_end_out_of_order():
    """Overlapping steps may end out of order (step 1 runs 1 -> 4 while steps 2 and 3 end at 3 and
    2.5): the steady window is 0 -> 3 (the last first token) and holds the tokens of the steps ended
    by then, steps 0, 2 and 3: 1 + 1 + 2 = 4 of the run's 9."""
    reqs = [Request(0, 0.0, 4, 3), Request(1, 0.5, 4, 2), Request(2, 1.0, 4, 2), Request(3, 1.0, 4, 2)]
    res = RunResult(
        requests=reqs, rejected=[], arrival_s=np.array([0.0, 0.5, 1.0, 1.0]), prompt_len=np.full(4, 4),
        output_len=np.array([3, 2, 2, 2]), token_offsets=np.array([0, 3, 5, 7, 9]),
        token_step=np.array([0, 1, 4, 2, 4, 3, 4, 3, 4]), release_s=np.array([5.0, 5.0, 5.0, 5.0]),
        n_preemptions=np.zeros(4, dtype=int), step_start=np.array([0.0, 1.0, 1.5, 2.0, 4.0]),
        step_end=np.array([1.0, 4.0, 3.0, 2.5, 5.0]), step_n_seqs=np.array([1, 1, 1, 2, 4]),
        step_n_tokens=np.array([4, 1, 4, 8, 4]), step_reserved=np.full(5, 20), step_used=np.full(5, 10),
        n_slots=40.0, config=SchedulerConfig())
    assert res.first_token_s.max() == 3.0 and int((res.token_times <= 3.0).sum()) == 4
    assert steady_throughput(res) == (4 / 3, 3.0)


def test_goodput_evaluates_no_rate_twice():
    """Each evaluation is a whole simulated run: a probe at a rate already tried (here 1.25 x the
    answer 1.0 is the upper bound, evaluated first) is not run again."""
    g = goodput_search(lambda rate: 1.0 if rate <= 1.0 else 0.0, lo=1.0, hi=1.25, rel_tol=0.01)
    assert g.rate == 1.0
    rates = [r for r, _ in g.evaluations]
    assert len(set(rates)) == len(rates) and rates[:2] == [1.25, 1.0]


def test_a_value_counted_zero_times_is_not_among_the_counted_quantiles():
    """`counted_quantiles(values, counts, q)` is `np.quantile(np.repeat(values, counts), q)`: a value
    that appears 0 times is not there, the largest included (it was reported as the maximum)."""
    rng = np.random.default_rng(7)
    qs = (0.0, 0.5, 0.99, 1.0)
    for _ in range(50):
        values = rng.exponential(1.0, 12)
        counts = rng.integers(0, 3, 12)
        counts[int(np.argmax(values))] = 0                   # the largest value never occurs
        if counts.sum() == 0:
            continue
        x = np.repeat(values, counts)
        assert counted_quantiles(values, counts, qs) == [float(np.quantile(x, q)) for q in qs]


def test_quantiles_take_lists():
    """Values and counts given as lists are read as arrays (they were an AttributeError where a
    list's dtype or max was read: the largest value, q = 1)."""
    assert counted_quantiles([3.0, 1.0, 2.0], [1, 2, 0], [0.5, 1.0]) == quantiles([3.0, 1.0, 1.0], [0.5, 1.0]) \
        == [1.0, 3.0]
