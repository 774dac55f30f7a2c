"""A run keeps one small integer per token (the step that made it); times and ITL figures derive from it."""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from orca_torch.lab.baselines import static_batching
from orca_torch.core.engine import Engine
from orca_torch.sim.executors import CostModelExecutor
from orca_torch.core.memory import ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.lab import metrics
from orca_torch.lab.metrics import counted_quantiles, inter_token_latencies, itl_counts, quantiles, summarize
from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.core import token_steps
from orca_torch.core.token_steps import MAX_STEPS, TokenRuns, step_dtype
from orca_torch.core.run_result import RunResult
from orca_torch.lab.workload import chat
from orca_torch.sim.fast_engine import FastEngine
from clocks import iteration_clock

GPU = CostModelExecutor("llama-3-8b", "h100")

CONFIGS = {
    "mixed": (SchedulerConfig(max_bs=16), lambda: ReservationMemory(400_000, "oracle")),
    "prefill_first": (SchedulerConfig(max_bs=16, prefill="prefill_first"), lambda: ReservationMemory(400_000, "max")),
    "chunked": (SchedulerConfig(max_bs=16, max_num_batched_tokens=512, chunked_prefill=True), UnlimitedMemory),
    "pipelined": (SchedulerConfig(max_bs=16, n_workers=3), lambda: ReservationMemory(400_000, "oracle")),
    "static": (static_batching(8), lambda: ReservationMemory(400_000, "oracle")),
    "preempting": (SchedulerConfig(max_bs=16), lambda: TokenMemory(6000)),
}


GPU_PP3 = CostModelExecutor("llama-3-8b", "h100", pp=3)     # three stages for the three batches in flight


def run(name: str, n: int = 40, rate: float = 12.0, kind=FastEngine):
    config, memory = CONFIGS[name]
    reqs = chat(n_requests=n, rate=rate, seed=3, max_context=4096)
    return kind(GPU_PP3 if config.n_workers > 1 else GPU, memory(), config, max_context=4096, trace=True).run(reqs)


def test_step_dtype_is_the_smallest_that_holds_every_step_index():
    assert step_dtype(1) == step_dtype(256) == np.uint8
    assert step_dtype(257) == step_dtype(65_536) == np.uint16
    assert step_dtype(65_537) == step_dtype(MAX_STEPS) == np.uint32          # (a run has at most MAX_STEPS)


@pytest.mark.parametrize("output_len, dtype", [(200, np.uint8), (3_000, np.uint16), (70_000, np.uint32)])
def test_a_run_stores_token_steps_in_the_smallest_dtype(output_len, dtype):
    reqs = [Request(0, 0.0, 4, output_len), Request(1, 0.0, 4, 5)]
    res = Engine(iteration_clock(), UnlimitedMemory(), SchedulerConfig(max_bs=4), max_context=80_000).run(reqs)
    assert res.n_steps == output_len and res.token_step.dtype == dtype
    assert res.token_step.nbytes == np.dtype(dtype).itemsize * (output_len + 5)
    np.testing.assert_array_equal(res.tokens_of(0), np.arange(1.0, output_len + 1))   # one step lasts 1


@pytest.mark.parametrize("kind", [Engine, FastEngine])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_token_times_are_the_ends_of_the_steps_that_made_them(name, kind):
    """Replayed from the trace alone: a work yields a token when it catches its request up to
    prompt + tokens so far; that token's time is the end of that step."""
    res = run(name, kind=kind)
    made = {r.req_id: [] for r in res.requests}
    prompt = {r.req_id: r.prompt_len for r in res.requests}
    for _, _, end, works in res.trace:
        for rid, n, p in works:
            if p + n == prompt[rid] + len(made[rid]):
                made[rid].append(end)
    for i, r in enumerate(res.requests):
        assert len(made[r.req_id]) == r.output_len
        np.testing.assert_array_equal(res.tokens_of(i), made[r.req_id])
        assert res.first_token_s[i] == made[r.req_id][0] and res.last_token_s[i] == made[r.req_id][-1]
    np.testing.assert_array_equal(res.token_times, np.concatenate([made[r.req_id] for r in res.requests]))
    assert res.token_times.dtype == np.float64


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_counted_itl_figures_equal_numpy_over_every_gap(name, monkeypatch):
    res = run(name)
    gaps = inter_token_latencies(res)
    values, counts = itl_counts(res)
    assert counts.sum() == len(gaps)
    np.testing.assert_array_equal(np.sort(np.repeat(values, counts)), np.sort(gaps))
    want = (float(np.quantile(gaps, 0.5)), float(np.quantile(gaps, 0.99)), float(gaps.max()))
    for few_steps in (0, 1 << 40):                    # counted, then from the gaps, whatever the steps
        monkeypatch.setattr(metrics, "_FEW_STEPS", few_steps)
        assert metrics.itl_figures(res) == want
    monkeypatch.setattr(metrics, "_CHUNK", 64)        # summarize counts, binning a few values at a time
    monkeypatch.setattr(metrics, "_STEPS", 7)         # and a few steps at a time
    assert len(gaps) > 64 * 10 and res.n_steps > 7 * 10
    v7, c7 = itl_counts(res)
    np.testing.assert_array_equal(np.sort(np.repeat(v7, c7)), np.sort(gaps))
    m = summarize(res)
    assert m.itl_median_s == float(np.quantile(gaps, 0.5))
    assert m.itl_p99_s == float(np.quantile(gaps, 0.99))
    assert m.itl_max_s == float(gaps.max())
    assert m.steady_throughput_tok_s * m.steady_window_s == pytest.approx(
        float((res.token_times <= res.first_token_s.max()).sum()))


def test_counted_quantile_is_numpy_quantile_exactly():
    rng = np.random.default_rng(0)
    for n_values in (1, 2, 3, 7, 50):
        values = rng.exponential(0.03, n_values)
        counts = rng.integers(1, 9, n_values)
        x = np.repeat(values, counts)
        qs = (0.0, 0.01, 0.25, 0.5, 0.9, 0.99, 0.999, 1.0)
        want = [float(np.quantile(x, q)) for q in qs]
        assert counted_quantiles(values, counts, qs) == want, n_values
        assert quantiles(rng.permutation(x), qs) == want, n_values     # (one partition, any order)
    assert np.isnan(counted_quantiles(np.array([]), np.array([], dtype=np.int64), [0.5])[0])
    assert np.isnan(quantiles(np.array([]), [0.5])[0])


def test_quantiles_interpolate_as_numpy_on_both_sides_of_the_midpoint():
    """numpy's linear quantile takes `x0 + d g` below g = 0.5 and `x1 - d (1 - g)` from it on: the two
    differ in the last bit of a few percent of quantiles, which these many small lists reach."""
    rng = np.random.default_rng(2)
    qs = (0.3, 0.5, 0.7, 0.9, 0.99)
    for n in range(2, 62):
        for _ in range(5):
            x = rng.uniform(0, 1, n)
            want = [float(np.quantile(x, q)) for q in qs]
            assert quantiles(x, qs) == want, n
            assert counted_quantiles(x, np.ones(n, dtype=np.uint32), qs) == want, n


@pytest.mark.parametrize("bins, chunk", [(4, 3), (16, 1000), (1 << 16, 1 << 22)])
def test_counted_quantile_through_bins_is_numpy_quantile_exactly(bins, chunk, monkeypatch):
    monkeypatch.setattr(metrics, "_BINS", bins)          # a long list is binned, not sorted whole
    monkeypatch.setattr(metrics, "_CHUNK", chunk)
    rng = np.random.default_rng(1)
    qs = (0.0, 0.01, 0.5, 0.9, 0.99, 1.0)
    for values in (rng.exponential(0.03, 300), np.round(rng.uniform(0, 1, 500), 2),   # ties across bins
                   np.full(40, 0.25), np.append(np.full(60, 1e-3), 7.0)):         # one value; one far away
        counts = rng.integers(1, 9, len(values)).astype(np.uint32)
        x = np.repeat(values, counts)
        assert counted_quantiles(values, counts, qs) == [float(np.quantile(x, q)) for q in qs]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_token_runs_built_and_read_in_small_chunks_give_the_same_column(name, monkeypatch):
    """A fast run keeps its tokens as runs and builds the column from them, a chunk of slots at a
    time; the stepped engine's column read back into runs, a chunk at a time, gives the same runs."""
    want = run(name, n=60, kind=Engine).token_step
    monkeypatch.setattr(token_steps, "_CHUNK", 7)
    fast = run(name, n=60)
    stepped = name == "pipelined"           # (stepped one iteration at a time: the core's column, as Engine's)
    assert isinstance(vars(fast)["token_step"], np.ndarray if stepped else token_steps.TokenRuns)
    got = fast.token_step
    np.testing.assert_array_equal(got, want)
    assert got.dtype == want.dtype
    runs = token_steps.TokenRuns.of_column(want, fast.token_offsets[:-1])
    for part in ("slot", "start", "count"):
        np.testing.assert_array_equal(getattr(runs, part), getattr(fast.token_runs, part), err_msg=part)


@pytest.mark.parametrize("kind", [Engine, FastEngine])
def test_progress_is_reported_and_ends_at_the_total(kind):
    calls = []
    reqs = chat(n_requests=300, rate=40.0, seed=1)
    engine = kind(iteration_clock(), UnlimitedMemory(), SchedulerConfig(max_bs=64), max_context=8192)
    # (called once the run passes step 1024, 2048, ... and at the end, though FastEngine's calls
    # of step() take many steps each)
    res = engine.run(reqs, progress=lambda done, total: calls.append((done, total)))
    most = res.n_steps // 1024 + 1
    assert len(calls) == most if kind is Engine else 1 <= len(calls) <= most
    assert calls[-1] == (300, 300) and all(t == 300 for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert calls.count((300, 300)) == 1


def test_a_run_that_finishes_in_a_reported_step_reports_the_total_once():
    # (one FastEngine step takes the whole run, past step 1024: that report is already the total)
    calls = []
    engine = FastEngine(iteration_clock(), UnlimitedMemory(), SchedulerConfig(max_bs=64), max_context=8192)
    res = engine.run([Request(0, 0.0, 4, 2000)], progress=lambda done, total: calls.append((done, total)))
    assert res.n_steps == 2000 and calls == [(1, 1)]


@pytest.mark.parametrize("kind", [Engine, FastEngine])
def test_step_columns_assembled_in_small_chunks_are_the_same(monkeypatch, kind):
    from orca_torch.core.step_log import StepLog

    for name in ("mixed", "pipelined", "static"):
        want = run(name, n=60, kind=kind)
        monkeypatch.setattr(StepLog, "FLUSH", 3)
        got = run(name, n=60, kind=kind)
        monkeypatch.undo()
        for col in ("step_start", "step_end", "step_n_seqs", "step_n_tokens", "step_reserved", "step_used"):
            np.testing.assert_array_equal(getattr(got, col), getattr(want, col))
            assert getattr(got, col).dtype == getattr(want, col).dtype
        assert want.n_steps > 20
        if name == "pipelined":                     # batches in flight together
            assert (want.step_start[1:] < want.step_end[:-1]).mean() > 0.5


# ---- the summary read off token runs equals the per-token computation --------------------------------
a_request = st.tuples(st.integers(0, 20),                             # its first step
                      st.lists(st.sampled_from([1, 1, 1, 2, 5]), max_size=12),   # steps between its tokens
                      st.lists(st.integers(1, 4), max_size=4))        # where its runs are cut apart anyway


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(a_request, min_size=1, max_size=10), st.integers(0, 2**32 - 1))
def test_figures_read_off_token_runs_equal_those_counted_token_by_token(requests, seed):
    """Random requests, each a first step and the steps between its tokens, given as runs (cut at
    every skipped step, and at random places besides: a request's runs need not be the fewest).
    The gaps `itl_counts` counts, the first and last tokens' steps, the steady window's tokens
    and the column itself are those computed token by token."""
    rng = np.random.default_rng(seed)
    steps = [list(np.cumsum([first, *between])) for first, between, _ in requests]
    slot, start, count, at = [], [], [], 0
    for s, (_, _, cuts) in zip(steps, requests):
        pieces = {0, len(s)} | {i for i in range(1, len(s)) if s[i] != s[i - 1] + 1} | {c for c in cuts if c < len(s)}
        edges = sorted(pieces)
        for lo, hi in zip(edges, edges[1:]):
            slot.append(at + lo), start.append(s[lo]), count.append(hi - lo)
        at += len(s)
    n_steps = max(max(s) for s in steps) + 1 + int(rng.integers(0, 3))
    end = np.cumsum(rng.choice([0.25, 0.5, 1.0, 3.0], n_steps))      # (a few durations: equal gaps, ties)
    output_len = np.array([len(s) for s in steps])
    first_end = end[[s[0] for s in steps]]
    res = RunResult(
        requests=[Request(i, 0.0, 1, int(n)) for i, n in enumerate(output_len)], rejected=[],
        arrival_s=first_end - rng.uniform(0, 2, len(steps)), prompt_len=np.ones(len(steps), dtype=np.int64),
        output_len=output_len, token_offsets=np.concatenate(([0], np.cumsum(output_len))),
        token_step=TokenRuns(*(np.array(v, dtype=np.int64) for v in (slot, start, count))),
        release_s=end[[s[-1] for s in steps]], n_preemptions=np.zeros(len(steps), dtype=np.int64),
        step_start=end - 0.25, step_end=end, step_n_seqs=np.ones(n_steps, dtype=np.int64),
        step_n_tokens=np.ones(n_steps, dtype=np.int64), step_reserved=np.ones(n_steps, dtype=np.int64),
        step_used=np.ones(n_steps, dtype=np.int64), n_slots=10.0, config=SchedulerConfig())
    gaps = sorted(end[b] - end[a] for s in steps for a, b in zip(s, s[1:]))     # token by token
    values, counts = itl_counts(res)
    assert sorted(np.repeat(values, counts).tolist()) == gaps
    with mock.patch.object(metrics, "_STEPS", 3):    # counted three steps at a time
        values, counts = itl_counts(res)
    assert sorted(np.repeat(values, counts).tolist()) == gaps
    assert res.first_token_step.tolist() == [s[0] for s in steps]
    assert res.last_token_step.tolist() == [s[-1] for s in steps]
    t0, t_end = float(res.arrival_s.min()), float(first_end.max())
    made = sum(end[x] <= t_end for s in steps for x in s)
    assert t_end > t0 and metrics.steady_throughput(res) == (made / (t_end - t0), t_end - t0)
    assert res.token_step.tolist() == [x for s in steps for x in s]
    m = summarize(res)
    want = (float(np.quantile(gaps, 0.5)), float(np.quantile(gaps, 0.99)), float(max(gaps))) if gaps else None
    with mock.patch.object(metrics, "_FEW_STEPS", 0):  # selected from the counts, not from the gaps repeated
        for got in ((m.itl_median_s, m.itl_p99_s, m.itl_max_s), metrics.itl_figures(res)):
            assert got == want if gaps else np.isnan(got).all()


def test_a_fast_result_holding_runs_pickles_copies_and_remakes_as_it_was():
    """A fast run's result holds its token runs and builds the column only when read; pickled,
    copied, remade from its fields or replaced, before or after that read, it is the same run."""
    import copy
    import dataclasses
    import pickle

    res = run("mixed", n=30)
    want = summarize(res)
    column = run("mixed", n=30, kind=Engine).token_step
    remade = [pickle.loads(pickle.dumps(res)), copy.copy(res), copy.deepcopy(res), type(res)(**vars(res)),
              dataclasses.replace(res, trace=None)]
    for other in remade + [pickle.loads(pickle.dumps(res))]:        # (the last pickled after the column was read)
        assert summarize(other) == want
        np.testing.assert_array_equal(other.token_step, column)
    assert dataclasses.replace(res, token_step=column.copy()).first_token_s.tolist() == res.first_token_s.tolist()
