"""A run keeps one small integer per token (the step that made it); times and ITL figures derive from it."""
from __future__ import annotations

import numpy as np
import pytest

from orca_torch.lab.baselines import static_batching
from orca_torch.core.engine import Engine
from orca_torch.sim.executors import CostModelExecutor, iteration_clock
from orca_torch.core.memory import ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.lab import metrics
from orca_torch.lab.metrics import counted_quantiles, inter_token_latencies, itl_counts, quantiles, summarize
from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.core.token_steps import MAX_STEPS, step_dtype
from orca_torch.lab.workload import chat
from orca_torch.sim import fast_engine
from orca_torch.sim.fast_engine import FastEngine

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
    reqs = chat(n, rate, seed=3, max_context=4096)
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
    for few_steps in (0, 1 << 40):                    # from the gaps, then counted, whatever the steps
        monkeypatch.setattr(metrics, "_FEW_STEPS", few_steps)
        assert metrics.itl_figures(res) == want
    monkeypatch.setattr(metrics, "_CHUNK", 64)        # summarize counts, a few tokens at a time
    monkeypatch.setattr(metrics, "_STEPS", 7)         # and a few steps at a time
    assert len(res.token_step) > 64 * 10 and res.n_steps > 7 * 10
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


def test_decode_runs_expanded_in_small_chunks_give_the_same_column(monkeypatch):
    want = run("mixed", n=60).token_step
    monkeypatch.setattr(fast_engine, "_FLUSH_TOKENS", 7)
    got = run("mixed", n=60).token_step
    np.testing.assert_array_equal(got, want)
    assert got.dtype == want.dtype


@pytest.mark.parametrize("kind", [Engine, FastEngine])
def test_progress_is_reported_and_ends_at_the_total(kind):
    calls = []
    reqs = chat(300, 40.0, seed=1)
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
