"""Orca's evaluation on the paper GPU: the FasterTransformer baseline, its pipeline pricing, the
homogeneous workload, the sweep (`orca_torch.lab.orca_evaluation`), and the shape of experiment 07's
--quick figures (not its exact numbers)."""
from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from orca_torch.lab.baselines import (FT_MAX_LENGTH, FasterTransformerExecutor, OutOfMemory, ServingSetup,
    fastertransformer_setup, memory_fit, orca_setup, static_batching)
from orca_torch.core.batch import ScheduledSeq, SeqWork, StepTotals
from orca_torch.core.engine import Engine
from orca_torch.sim.executors import CostModelExecutor, PricedExecutor
from orca_torch.core.executor import StepResult
from orca_torch.core.request import Request
from orca_torch.sim.hw_model import get_gpu, max_requests, pricer
from orca_torch.sim.hw_model.microbatch import (CONTROL_MESSAGES, HOST_SYNC_S, KERNEL_LAUNCH_S, control_sync_s,
    decode_iterations_s, ft_microbatch_size, iteration_s, link, microbatch_sizes)
from orca_torch.lab import orca_evaluation as ev
from orca_torch.core.memory import ReservationMemory
from orca_torch.lab.workload import make_workload, orca_homogeneous, orca_synthetic

ROOT = Path(__file__).resolve().parents[1]
GPU = "a100-40gb"
P175 = pricer("gpt3-175b", GPU, tp=8, pp=2)


# ---- the wires and the control sync ----------------------------------------------------------------

def test_link_is_nvlink_inside_a_vm_and_infiniband_between():
    g = get_gpu(GPU)
    assert link(P175, 0, 7)[2] == "nvlink" and link(P175, 0, 7)[:2] == (g.nvlink_bw, g.nvlink_latency_s)
    assert link(P175, 0, 8)[2] == "infiniband" and link(P175, 7, 8)[:2] == (g.ib_bw, g.ib_latency_s)
    assert g.ib_bw == pytest.approx(8 * 200e9 / 8 / 8)      # 8 x 200 Gb/s per 8-GPU VM, per GPU


def test_control_sync_counts_the_wire_each_stage_boundary_crosses():
    g = get_gpu(GPU)
    assert control_sync_s(pricer("gpt3-13b", GPU)) == 0.0   # one GPU: no workers to tell
    one_vm = control_sync_s(pricer("gpt3-101b", GPU, tp=8))
    assert one_vm == pytest.approx(CONTROL_MESSAGES * g.nvlink_latency_s + HOST_SYNC_S + KERNEL_LAUNCH_S)
    assert control_sync_s(P175) == pytest.approx(CONTROL_MESSAGES * g.ib_latency_s + 2 * (HOST_SYNC_S + KERNEL_LAUNCH_S))
    p341 = pricer("gpt3-341b", GPU, tp=8, pp=4)
    assert control_sync_s(p341) == pytest.approx(3 * CONTROL_MESSAGES * g.ib_latency_s + 4 * (HOST_SYNC_S + KERNEL_LAUNCH_S))


# ---- microbatches and bubbles ------------------------------------------------------------------------

@pytest.mark.parametrize("batch, seq_len, pp, want", [
    (8, 1, 2, 4), (7, 1, 2, 7), (1, 1, 2, 1), (16, 1, 4, 4), (16, 480, 2, 2), (16, 600, 2, 1),
    (6, 300, 2, 3), (12, 1, 1, 12), (16, 128, 2, 8), (16, 129, 2, 4)])   # 1,024 tokens is not over 1,024
def test_ft_microbatch_rule(batch, seq_len, pp, want):
    assert ft_microbatch_size(batch, seq_len, pp) == want


def test_microbatch_sizes_cover_the_batch_evenly():
    for n in range(1, 40):
        for mbs in (1, 3, 8, 64):
            sizes = microbatch_sizes(n, mbs)
            assert sum(sizes) == n and max(sizes) <= mbs and max(sizes) - min(sizes) <= 1
            assert len(sizes) == math.ceil(n / mbs)


def _decode(k: int, ctx: int) -> StepTotals:
    return StepTotals.of([SeqWork(1, ctx)] * k)


@pytest.mark.parametrize("attention", ["full", "causal"])     # (a prompt's pairs: n^2, or n (n + 1) / 2)
@pytest.mark.parametrize("model, tp, pp", [("gpt3-13b", 1, 1), ("gpt3-175b", 8, 2), ("gpt3-341b", 8, 4)])
def test_one_microbatch_is_the_plain_step(model, tp, pp, attention):
    pr = pricer(model, GPU, tp=tp, pp=pp, attention=attention)
    for t in (_decode(8, 300), StepTotals.of([SeqWork(200, 0), SeqWork(500, 0)]), _decode(1, 40)):
        assert iteration_s(pr, t, t.n_seqs) == pytest.approx(pr.time(t), rel=1e-12)


def test_microbatches_pay_pipeline_bubbles():
    t = _decode(16, 400)
    one = iteration_s(P175, t, 16)
    stage = [P175.cost(StepTotals.of([SeqWork(1, 400)] * 8)).stage_s]
    two = iteration_s(P175, t, 8)
    # 2 microbatches through 2 stages: 3 stage-times of a half batch, more than the whole batch
    # at once while the step is memory-bound (each microbatch reads the stage's weights again)
    assert 2 * stage[0] <= two <= 3 * stage[0] + 1e-12
    assert 1.3 < two / one < 1.6
    sixteen = iteration_s(P175, t, 1)
    assert sixteen > two                                     # smaller microbatches batch less


def test_decode_iterations_match_step_by_step():
    k, ctx, m = 6, 1000, 20
    many = decode_iterations_s(P175, k, ctx, m, 3)
    one_by_one = [iteration_s(P175, StepTotals(k, k, ctx + k * (j + 1), ctx + k * (j + 1), ctx + k * (j + 1)), 3)
                  for j in range(m)]
    np.testing.assert_allclose(many, one_by_one, rtol=1e-12)
    assert np.all(np.diff(many) >= 0)


# ---- the FasterTransformer configuration -------------------------------------------------------------

@pytest.mark.parametrize("model, tp, pp, fits, oom", [
    ("gpt3-13b", 1, 1, [1], [8, 16, 32]), ("gpt3-101b", 8, 1, [1, 8], [16, 32]),
    ("gpt3-175b", 8, 2, [1, 8, 16], [32])])
def test_ft_out_of_memory_matches_the_paper_by_reservation_arithmetic(model, tp, pp, fits, oom):
    seats = max_requests(model, GPU, FT_MAX_LENGTH, tp=tp, pp=pp)
    for b in fits + oom:
        fit = memory_fit(model, GPU, b, tp=tp, pp=pp)
        assert fit.fits == (b <= seats) == (b in fits)
        assert fit.slots_needed == b * 2048
    with pytest.raises(OutOfMemory, match=f"max_bs {oom[0]} x 2048"):
        fastertransformer_setup(model, GPU, oom[0], tp=tp, pp=pp)
    with pytest.raises(ValueError, match="max_bs must be an integer >= 1, got 0"):
        fastertransformer_setup(model, GPU, 0, tp=tp, pp=pp)


def test_ft_differs_from_static_batching_only_where_it_should():
    """One GPU, homogeneous requests (no padding), no workers to sync: FT's executor prices every
    step as the plain cost model, so FT = request-level batching on the same engine, exactly."""
    reqs = orca_homogeneous(n_requests=40, rate=2.0, seed=3, prompt_len=64, output_len=20)
    ft = fastertransformer_setup("gpt3-13b", GPU, 4)
    plain = ServingSetup("static", static_batching(4), ReservationMemory(ft.memory.n_slots, "max"),
                         CostModelExecutor("gpt3-13b", GPU), 2048)
    a = ft.engine().run(reqs)
    b = plain.engine().run(orca_homogeneous(n_requests=40, rate=2.0, seed=3, prompt_len=64, output_len=20))
    np.testing.assert_allclose(a.release_s, b.release_s, rtol=1e-12)


def test_ft_batch_returns_together_and_the_fast_engine_is_exact():
    reqs = orca_synthetic(n_requests=30, rate=1.0, seed=1)
    ft = fastertransformer_setup("gpt3-175b", GPU, 8, tp=8, pp=2)
    res = ft.engine().run(reqs)
    s = fastertransformer_setup("gpt3-175b", GPU, 8, tp=8, pp=2)
    slow = Engine(s.executor, s.memory, s.config, max_context=s.max_context).run(
        orca_synthetic(n_requests=30, rate=1.0, seed=1))
    np.testing.assert_allclose(res.release_s, slow.release_s, rtol=1e-9)
    # a batch's members leave together: few distinct release times, each shared
    assert len(np.unique(res.release_s)) < res.n
    assert np.all(res.release_s >= res.last_token_s)
    assert np.sum(res.release_s > res.last_token_s) > res.n / 2      # most wait for their batch's longest


def test_ft_pads_prompts():
    """A batch of one short and one long prompt costs FT two long prefills."""
    ex = FasterTransformerExecutor("gpt3-13b", GPU)

    class B:
        works = None
    for works in ([ScheduledSeq(None, 500, 0), ScheduledSeq(None, 32, 0)],
                  [ScheduledSeq(None, 500, 0), ScheduledSeq(None, 500, 0)]):
        b = B()
        b.works = works
        b.totals = StepTotals.of([w.work for w in works])
        ex.reset()
        t = ex.execute(b).duration_s
        assert t == pytest.approx(pricer("gpt3-13b", GPU).time(StepTotals.of([SeqWork(500, 0)] * 2)))


def test_ft_short_request_pays_for_its_batch_longest():
    """One FT batch of a 3-token and a 128-token request: the short one is answered when the long
    one ends, so its normalized latency is the batch's time / 3; its padded prompt and its idle seat
    cost exactly what a second copy of the long request would (every seat decodes to the end)."""
    def run(system, specs):
        reqs = [Request(i, 0.0, p, o) for i, (p, o) in enumerate(specs)]
        for r in reqs:
            r.max_tokens = r.total_len if system == "orca" else None
        return ev.make_setup(system, "gpt3-175b", 8).engine().run(reqs)

    ft = run("ft", [(32, 3), (512, 128)])
    assert ft.release_s[0] == ft.release_s[1]
    norm = (ft.release_s - ft.arrival_s) / ft.output_len
    assert norm[0] == pytest.approx(ft.release_s[1] / 3) and norm[0] > 40 * norm[1]
    twin = run("ft", [(512, 128), (512, 128)])
    assert ft.release_s[1] == pytest.approx(twin.release_s[1], rel=1e-12)
    orca = run("orca", [(32, 3), (512, 128)])
    assert orca.release_s[0] < ft.release_s[0] / 20                   # Orca answers it after its 3 tokens


class Stretched(PricedExecutor):
    """Another executor with every duration multiplied by `s` (a slower GPU, same decisions)."""

    reads_works = True
    decodes_by_step_time = True

    def __init__(self, inner, s: float) -> None:
        self.inner, self.s, self.max_context = inner, s, inner.max_context

    def execute(self, batch) -> StepResult:
        r = self.inner.execute(batch)
        return StepResult(r.duration_s * self.s, r.tokens, None if r.stage_s is None else r.stage_s * self.s)

    def step_time(self, totals) -> float:
        return self.inner.step_time(totals) * self.s

    def decode_durations(self, k, ctx_sum, m):
        return self.inner.decode_durations(k, ctx_sum, m) * self.s

    def reset(self) -> None:
        self.inner.reset()


@pytest.mark.parametrize("system, max_bs", [("ft", 8), ("orca", 32)])
def test_a_slower_gpu_stretches_the_curve(system, max_bs):
    """What the slowed-GPU headline rests on: every duration and arrival times s gives every
    latency times s (so the normalized latency), and the throughput / s, exactly."""
    import dataclasses

    sw = ev.sweep_for(True)
    base = ev.make_setup(system, "gpt3-175b", max_bs)
    slow = dataclasses.replace(base, executor=Stretched(ev.make_setup(system, "gpt3-175b", max_bs).executor, 2.0))
    reqs = ev.requests_for(system, orca_synthetic, sw, 3.0, 4)
    late = ev.requests_for(system, orca_synthetic, sw, 3.0, 4)
    for r in late:
        r.arrival_s *= 2.0
    a, b = base.engine().run(reqs), slow.engine().run(late)
    np.testing.assert_array_equal(b.release_s, 2.0 * a.release_s)
    assert len(np.unique(a.release_s)) >= 5                           # several batches, not a trivial run


def test_published_slowdown_compares_the_same_runs():
    slow = ev.published_slowdown()
    ex = FasterTransformerExecutor("gpt3-175b", "a100-80gb", tp=8)
    assert len(slow["rows"]) == len(ev.FT_PUBLISHED_175B) and slow["gpu"] == "a100-80gb" and slow["tp"] == 8
    for r, (b, i, o, ms) in zip(slow["rows"], ev.FT_PUBLISHED_175B):
        assert r["model_ms"] == pytest.approx(ev.engine_time_s(ex, b, i, o) * 1e3)
        assert r["ratio"] == pytest.approx(ms / r["model_ms"]) and r["ratio"] > 1   # real kernels are slower
    assert slow["s"] == pytest.approx(np.median([r["ratio"] for r in slow["rows"]]))
    assert 1.2 < slow["s"] < 2.1
    assert ev.scaled_target_ms(slow["s"]) == pytest.approx(ev.TARGET_MS / slow["s"], abs=0.05)


def _bracket(pts: list[dict], target: float) -> tuple[float, float]:
    i = next(i for i, p in enumerate(pts) if p["norm_latency_median_ms"] > target)
    return pts[i - 1]["rate_req_s"], pts[i]["rate_req_s"]


def test_curve_bisects_every_crossing_to_its_tolerance():
    sw = ev.Sweep((0.5, 2.0, 8.0, 32.0), 20.0, 20, 200)
    one = ev.curve("orca", "gpt3-101b", 16, None, orca_synthetic, sw, [0])
    two = ev.curve("orca", "gpt3-101b", 16, None, orca_synthetic, sw, [0], rel_tol=0.05, targets=(120.0, 60.0))
    rates = lambda pts: [p["rate_req_s"] for p in pts]  # noqa: E731
    assert "finer_points" not in one and set(rates(one["points"])) < set(rates(two["points"]))
    assert rates(two["points"]) == sorted(rates(two["points"])) and two["rel_tol"] == 0.05
    half = ev.at_half_tolerance({"c": two})["c"]["points"]
    assert set(rates(two["points"])) < set(rates(half)) and len(half) == len(two["points"]) + len(two["finer_points"])
    for target in (120.0, 60.0):
        lo, hi = _bracket(two["points"], target)
        assert 1 < hi / lo <= 1.05                                 # from the grid's 4x
        lo2, hi2 = _bracket(half, target)
        assert hi2 / lo2 <= 1.025 and lo <= lo2 < hi2 <= hi          # the same bisection, carried on


def test_bisect_crossings_ends_with_every_bracket_narrow():
    """A latency that is not monotone in the rate (a spike at 2.27-2.29 req/s): a midpoint taken for
    the lower target lands in it and moves the higher target's first crossing below the bracket it
    was narrowing; the bisection goes on until every target's first crossing is narrow."""
    def at(rate: float) -> dict:
        return {"rate_req_s": rate, "norm_latency_median_ms": 150.0 if 2.27 <= rate <= 2.29 else 40.0 * rate,
                "throughput_req_s": rate}

    given = [at(1.0), at(4.0)]
    pts = ev.bisect_crossings(given, [120.0, 90.0], 0.01, at)
    assert [p["rate_req_s"] for p in given] == [1.0, 4.0]                    # the list given is not changed
    rates = [p["rate_req_s"] for p in pts]
    assert rates == sorted(rates) and any(2.27 <= r <= 2.29 for r in rates)    # the spike was sampled
    (lo120, hi120), (lo90, hi90) = _bracket(pts, 120.0), _bracket(pts, 90.0)
    assert lo120 < 2.27 <= hi120 <= 1.01 * lo120            # 120 ms first crossed at the spike, not at 3.0
    assert lo90 < 2.25 <= hi90 <= 1.01 * lo90
    assert ev.throughput_at({"points": pts}, 90.0)["req_s"] == pytest.approx(2.25, rel=0.01)


def test_requests_for_leaves_the_requests_a_workload_hands_it_as_they_were():
    import dataclasses

    stored = orca_synthetic(n_requests=40, rate=1.0, seed=0)
    before = [dataclasses.astuple(r) for r in stored]
    reqs = ev.requests_for("orca", lambda **kw: stored, ev.sweep_for(True), 1.0, 0)
    assert reqs and all(r.max_tokens == r.total_len for r in reqs)
    assert [dataclasses.astuple(r) for r in stored] == before


def test_throughput_at_a_target_is_the_most_reached_within_it():
    """Past saturation a higher rate can complete fewer requests a second: the throughput read at a
    looser target is never below a tighter one's."""
    def pt(req_s, ms):
        return {"rate_req_s": None, "throughput_req_s": req_s, "norm_latency_median_ms": ms}

    c = {"points": [pt(1.0, 100.0), pt(1.69, 179.0), pt(1.59, 226.0), pt(1.57, 275.0)]}
    got = {ms: ev.throughput_at(c, ms) for ms in (90.0, 150.0, 190.0, 250.0, 300.0)}
    assert got[90.0] == {"req_s": 0.0, "bound": "starts above the target"}
    assert ev.throughput_at(c, 100.0) == {"req_s": 1.0, "bound": None}       # a latency at the target is within it
    assert got[150.0] == {"req_s": pytest.approx(1.0 + 0.69 * 50 / 79), "bound": None}     # the first crossing
    assert got[190.0]["req_s"] == got[250.0]["req_s"] == 1.69 and got[250.0]["bound"] is None
    assert got[300.0] == {"req_s": 1.69, "bound": "never reaches the target: a lower bound"}
    rising = [ev.throughput_at(c, ms)["req_s"] for ms in range(50, 320, 5)]
    assert rising == sorted(rising)


def test_clock_factors_span_the_published_runs():
    slow = ev.published_slowdown()
    f = ev.clock_factors(slow)
    rows = {(r["batch"], r["input"]): r for r in slow["rows"]}
    assert [d["batch"] for d in f["differences"]] == [1, 2, 4, 8, 16]   # both lengths published
    for d in f["differences"]:
        a, b = rows[(d["batch"], 128)], rows[(d["batch"], 512)]
        assert d["factor"] == pytest.approx((b["published_ms"] - a["published_ms"]) / (b["model_ms"] - a["model_ms"]))
    assert f["central"] == slow["s"] and f["ratios"] == [r["ratio"] for r in slow["rows"]]
    assert f["low"] == min(d["factor"] for d in f["differences"]) and f["high"] == max(f["ratios"])
    assert f["low"] < min(f["ratios"]) < f["central"] < f["high"]
    assert (round(f["low"], 2), round(f["central"], 2), round(f["high"], 2)) == (1.19, 1.59, 2.08)
    assert ev.headline_targets_ms() == (190.0, 159.4, 119.2, 91.4)


def test_orca_setup_is_iteration_level_with_n_workers_pp():
    s = orca_setup("gpt3-175b", GPU, 32, tp=8, pp=2)
    assert s.config.n_workers == 2 and not s.config.static and s.config.max_bs == 32
    reqs = orca_synthetic(n_requests=30, rate=1.0, seed=1)
    for r in reqs:
        r.max_tokens = r.total_len
    res = s.engine().run(reqs)
    np.testing.assert_array_equal(res.release_s, res.last_token_s)   # each leaves at its last token
    assert len(np.unique(res.release_s)) > 0.8 * res.n


def test_mbs_is_checked():
    with pytest.raises(ValueError, match=r"mbs \(microbatches\) applies only with pipeline parallelism \(pp > 1\)"):
        fastertransformer_setup("gpt3-13b", GPU, 1, mbs=1)
    with pytest.raises(ValueError, match=r"mbs \(microbatch size; None: FasterTransformer's own rule\) must be an "
                                         r"integer >= 1, got 0"):
        FasterTransformerExecutor("gpt3-175b", GPU, tp=8, pp=2, mbs=0)


# ---- the homogeneous workload -----------------------------------------------------------------------

def test_orca_homogeneous():
    reqs = orca_homogeneous(n_requests=50, rate=4.0, seed=2, prompt_len=256, output_len=256)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(256, 256)}
    arr = np.array([r.arrival_s for r in reqs])
    assert arr[0] == 0 and np.all(np.diff(arr) >= 0) and 2.0 < len(reqs) / arr[-1] < 8.0
    again = make_workload("orca-homogeneous", n_requests=50, rate=4.0, seed=2, prompt_len=256, output_len=256)
    assert [r.arrival_s for r in again] == arr.tolist()
    with pytest.raises(ValueError, match=r"prompt_len must be an integer in \[1, 9007199254740991\], got 0"):
        orca_homogeneous(n_requests=5, rate=1.0, prompt_len=0)


# ---- experiment 07, --quick ---------------------------------------------------------------------------

def _load_experiment():
    spec = importlib.util.spec_from_file_location("exp07", ROOT / "experiments" / "07_orca_evaluation.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["exp07"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def exp07():
    return _load_experiment()


@pytest.fixture(scope="module")
def quick(exp07, tmp_path_factory) -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exp07.main(["--quick", "--json"])
    return json.loads(out.getvalue())


def test_the_page_quotes_the_setup_and_the_clock_factors(quick):
    """docs/experiments/07-orca-evaluation.md quotes the full run; the figures here are the same in `--quick`
    (no sweep enters them): FasterTransformer's published runs against the paper GPU, the clock factors and
    targets they give, the seats that fit, and the control sync's price."""
    from test_docs import page_text, table_row

    page = "docs/experiments/07-orca-evaluation.md"
    text = page_text(page)
    rows = quick["published_ft_175b"]["rows"]
    hi, lo = max(rows, key=lambda r: r["ratio"]), min(rows, key=lambda r: r["ratio"])
    h = quick["headline_175b"]
    cf, rng = h["clock_factors"], h["range"]
    diffs = [d["factor"] for d in cf["differences"]]
    assert (f"the run-by-run ratios fall from {hi['ratio']:.2f} (batch {hi['batch']}) to {lo['ratio']:.2f} "
            f"(batch {lo['batch']}), and the same-batch differences between two run lengths, which cancel any fixed "
            f"cost, give {min(diffs):.2f}–{max(diffs):.2f}") in text
    assert (f"low s = {cf['low']:.2f} (the smallest difference), central s = {cf['central']:.2f} (the median ratio), "
            f"high s = {cf['high']:.2f} (the largest ratio)") in text
    table_row(page, f"central, s = {cf['central']:.2f} (target here {h['target_here_ms']:.1f} ms)")
    for side in ("low", "high"):
        table_row(page, f"{side}, s = {rng[side]['s']:.2f} ({rng[side]['target_here_ms']:.1f} ms)")
    oom = {o["model"]: o for o in quick["out_of_memory"] if o["max_bs"] == quick["ft_oom_from"][o["model"]]}
    seats = {m: re.search(r"at most (\d+) seats", o["why"]).group(1) for m, o in oom.items()}
    assert table_row(page, "FasterTransformer out of memory (2048 tokens a seat)")[-1] == (
        f"13B at ≥ {oom['gpt3-13b']['max_bs']} ({seats['gpt3-13b']} seats in {oom['gpt3-13b']['slots_available']:,} "
        f"slots), 101B at ≥ {oom['gpt3-101b']['max_bs']} ({seats['gpt3-101b']} in "
        f"{oom['gpt3-101b']['slots_available']:,}); 175B and 341B at {oom['gpt3-175b']['max_bs']} "
        f"({seats['gpt3-175b']}, {seats['gpt3-341b']} seats)")
    assert oom["gpt3-175b"]["max_bs"] == oom["gpt3-341b"]["max_bs"]
    sync_us = f"{quick['control_sync']['per_iteration_s'] * 1e6:.0f} µs"
    assert f"plus the {sync_us} control sync" in text and f"one kernel launch per stage: {sync_us})" in text


def test_seats_are_whole_requests_that_fit():
    """A seat holds a whole request: the setup table floors Orca's seats (K/V slots over the mean
    reservation) as it floors FasterTransformer's (slots over 2048), and the page quotes 175B's."""
    from test_docs import page_text

    rows = {r[0]: r for r in ev.setup_rows()}
    for model, r in rows.items():
        slots = int(r[5].replace(",", ""))
        assert r[6] == slots // FT_MAX_LENGTH and r[7] == math.floor(slots / ev.MEAN_RESERVATION), model
    assert rows["gpt3-175b"][7] == 141   # 47,627 / 336.5 = 141.5
    assert (f"share the ~{rows['gpt3-175b'][7]} reservations the K/V memory holds"
            in page_text("docs/experiments/07-orca-evaluation.md"))


def test_quick_oom_points_match_the_paper(quick):
    assert quick["ft_oom_from"]["gpt3-13b"] == 8 and quick["ft_oom_from"]["gpt3-101b"] == 16
    assert {(o["model"], o["max_bs"]) for o in quick["out_of_memory"]} >= {("gpt3-13b", 8), ("gpt3-101b", 16)}


def test_quick_every_curve_rises_with_the_rate(quick):
    curves = dict(quick["homogeneous_curves"])
    for model, cs in quick["curves"].items():
        curves[model] = cs
    n = 0
    for cs in curves.values():
        for name, c in cs.items():
            lat = [p["norm_latency_median_ms"] for p in sorted(c["points"], key=lambda p: p["rate_req_s"])]
            assert len(lat) >= 3, name
            assert lat[-1] > 1.5 * lat[0], name
            assert all(b >= 0.95 * a for a, b in zip(lat, lat[1:])), (name, lat)
            n += 1
    assert n >= 10


def test_quick_headline_shape(quick):
    h = quick["headline_175b_roofline"]
    assert set(h) >= {"ft_req_s", "orca_req_s", "ratio", "latency_target_ms"}
    assert h["latency_target_ms"] == 190 and h["seeds"] == [0]          # --quick: one seed
    assert h["ratio"] == pytest.approx(h["orca_req_s"] / h["ft_req_s"])
    assert h["ft_req_s"] > 0 and h["ratio"] > 5                          # Orca far ahead
    orca = {int(k): v for k, v in quick["orca_175b_req_s_by_max_bs"].items()}
    ft = {int(k): v for k, v in quick["ft_175b_req_s_by_max_bs"].items()}
    assert orca[1] < orca[16] < orca[64]                                  # rises with max_bs
    assert max(ft, key=ft.get) <= 16 and max(ft.values()) < orca[16]      # FT's best is small
    assert quick["ft_101b_peak_req_s"] > 0


def test_quick_headline_on_the_calibrated_clock(quick):
    h, s = quick["headline_175b_roofline"], quick["headline_175b"]
    assert set(s) >= {"ft_req_s", "orca_req_s", "ratio", "latency_target_ms"} and s["seeds"] == [0]
    assert s["ratio"] == pytest.approx(s["orca_req_s"] / s["ft_req_s"])
    assert s["s"] == quick["published_ft_175b"]["s"] and s["latency_target_ms"] == 190
    assert s["target_here_ms"] == pytest.approx(190 / s["s"], abs=0.05)
    assert s["ratio"] > h["ratio"]                      # a tighter target widens the gap
    assert s["orca_req_s"] < h["orca_req_s"] and s["ft_req_s"] < h["ft_req_s"]
    curves = quick["curves"]["gpt3-175b"]                # --quick: seed 0 only
    for system, key in (("FasterTransformer", "ft_req_s"), ("Orca", "orca_req_s")):
        assert s[key] == pytest.approx(ev.best_at(curves, system, s["target_here_ms"])[1]["req_s"] / s["s"])


def test_quick_headline_is_a_range_over_the_clock_factors(quick):
    s, curves = quick["headline_175b"], quick["curves"]["gpt3-175b"]
    f = s["clock_factors"]
    assert f == json.loads(json.dumps(ev.clock_factors(quick["published_ft_175b"])))   # (--json keeps every float)
    assert (s["range"]["low"]["s"], s["s"], s["range"]["high"]["s"]) == (f["low"], f["central"], f["high"])
    r = s["ratio_range"]
    assert r["low"] < r["central"] < r["high"] and r["central"] == s["ratio"]    # a slower clock, a wider gap
    for k in ("low", "high"):
        at = s["range"][k]
        assert at["target_here_ms"] == pytest.approx(190 / at["s"], abs=0.05) and at["ratio"] == r[k]
        assert set(at["over_seeds"]["ratio"]) == {"median", "min", "max", "values"}
        for system, key in (("FasterTransformer", "ft_req_s"), ("Orca", "orca_req_s")):
            assert at[key] == pytest.approx(ev.best_at(curves, system, at["target_here_ms"])[1]["req_s"] / at["s"])
    t = s["tolerance"]
    assert t["rel_tol"] == ev.QUICK_REL_TOL
    finer = ev.at_half_tolerance(curves)
    ft, orca = (ev.best_at(finer, system, s["target_here_ms"])[1]["req_s"] for system in ("FasterTransformer", "Orca"))
    assert t["half_rel_tol_ratio"] == pytest.approx(orca / ft)
    assert t["moved"]["ratio"] == pytest.approx(abs(t["half_rel_tol_ratio"] / s["ratio"] - 1))
    for name, c in curves.items():                       # every 175B crossing bisected to the tolerance
        targets = ev.headline_targets_ms() if c["microbatch"] != "one per iteration" else (190.0,)
        for target in targets:
            lat = [p["norm_latency_median_ms"] for p in c["points"]]
            if lat[0] < target < max(lat):
                lo, hi = _bracket(c["points"], target)
                assert hi <= lo * (1 + ev.QUICK_REL_TOL), (name, target)


def test_quick_roofline_target_binds_near_capacity(quick):
    shares = quick["capacity_share_175b"]
    at190, central = shares["190.0"], shares[str(quick["headline_175b"]["target_here_ms"])]
    assert at190["Orca"]["share_of_capacity"] > 0.9 and at190["FasterTransformer"]["share_of_capacity"] > 0.75
    assert central["FasterTransformer"]["share_of_capacity"] < 0.7 < central["Orca"]["share_of_capacity"]
    assert at190["Orca"]["light_load_ms"] < 190 / 4 and at190["FasterTransformer"]["light_load_ms"] < 190 / 4


def test_quick_homogeneous_orca_still_wins(quick):
    h = quick["homogeneous_req_s_at_target"]["32x32"]
    ft, orca = ({int(k): v for k, v in h[s].items()} for s in ("ft", "orca"))
    assert ft[16] > 3 * ft[1]                    # FT's large batches help when requests are alike
    assert orca[16] > ft[16]


def test_quick_headline_note_marks_the_lower_bounds_its_curve_table_marks(exp07, capsys):
    """The note read `by_max_bs`, which keeps only the rate: a curve still under the target at the
    sweep's last rate was '23.1+' in its curve table and a plain 23.14 in the note."""
    exp07.main(["--quick", "--demos", "2"])
    out = capsys.readouterr().out
    table = out.split("== gpt3-175b, every request (32, 32)\n")[1].split("\n\n")[0].splitlines()[2:]
    in_table = {int(re.match(r"(FT|Orca)\(max_bs=(\d+)\)", row)[2]) * (1 if row.startswith("O") else -1):
                row.endswith("+") for row in table}
    listing = re.search(r"Homogeneous, FT vs Orca by max_bs: 32x32: (.*)", out)[1]
    in_note = {}
    for b, ft, orca in re.findall(r"(\d+): ([\d.]+\+?|out of memory) vs ([\d.]+\+?)", listing):
        in_note[int(b)] = orca.endswith("+")
        if ft != "out of memory":
            in_note[-int(b)] = ft.endswith("+")
    assert in_note == in_table and any(in_note.values())
    assert "('+': a lower bound, the sweep's last rate still under it)" in out


def test_quick_microbenchmark(quick):
    m = quick["microbenchmark"]
    assert quick["micro_13b_101b_max_gap"] < 0.01                          # Orca ~ FT on 13B
    assert [r["ft_ms"] is None for r in m["gpt3-13b"]] == [r["batch"] >= 8 for r in m["gpt3-13b"]]
    assert 0.2 < quick["micro_175b_orca_faster_max"] < 1.0                 # FT slower on 175B ...
    assert 0 < quick["micro_175b_control_sync_share_max"] < 0.02           # ... little of it the sync
    assert 0 < quick["control_sync"]["per_iteration_s"] < 1e-3 and quick["control_sync"]["wire"] == "infiniband"


def test_run_point_is_deterministic():
    sw = ev.sweep_for(True)
    a = ev.run_point("orca", "gpt3-175b", 16, None, orca_synthetic, 4.0, sw, [5])
    b = ev.run_point("orca", "gpt3-175b", 16, None, orca_synthetic, 4.0, sw, [5])
    c = ev.run_point("orca", "gpt3-175b", 16, None, orca_synthetic, 4.0, sw, [6])
    assert a == b and a != c


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    sw = ev.Sweep((0.5, 2.0, 8.0), 10.0, 10, 60)
    curves = {"FT(max_bs=8)": ev.curve("ft", "gpt3-101b", 8, None, orca_synthetic, sw, [0]),
              "Orca(max_bs=8)": ev.curve("orca", "gpt3-101b", 8, None, orca_synthetic, sw, [0])}
    from orca_torch.lab import plots

    panels = ev.figure_panels({"gpt3-101b": curves})
    assert [(label, dashed) for label, _, _, dashed, _ in panels["gpt3-101b"]] == [("FT(8)", True), ("Orca(8)", False)]
    plots.latency_throughput(tmp_path / "f.png", panels, 190.0, "t", [(0, 1.0, 190.0, "paper")])
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_fastertransformer_points_hold_more_requests():
    """FasterTransformer's normalized latencies spread widely (batch-mates wait for the longest), so
    its light-load points hold at least `n_min_ft` requests; heavy ones reach the same cap as Orca's."""
    sw = ev.sweep_for(False)
    assert sw.n_at(0.1, "ft") == 150 and sw.n_at(0.1, "orca") == 30
    assert sw.n_at(10.0, "ft") == sw.n_at(10.0, "orca") == 600
    assert sw.n_at(40.0, "ft") == sw.n_at(40.0, "orca") == 1500
    assert len(ev.requests_for("ft", orca_synthetic, sw, 0.1, 0)) == 150
    assert ev.sweep_for(True).n_at(0.2, "ft") == ev.sweep_for(True).n_at(0.2, "orca")   # --quick: no floor


def test_over_seeds_gives_each_compared_figure_at_every_seed(exp07):
    """101B FasterTransformer's peak and 175B's throughput by max_bs move with the seed: the first
    seed's are the single-seed figures, another's are its own curves' (175B's, run only to their
    crossings, read as its whole curves would be)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exp07.main(["--quick", "--seeds", "2", "--demos", "2", "--json"])
    got = json.loads(out.getvalue())
    over = got["over_seeds"]
    assert over["seeds"] == [0, 1]
    peak = over["ft_101b_peak_req_s"]["values"]
    assert peak == [got["ft_101b_peak_req_s"], ev.ft_peak_req_s(ev.synthetic_curves("gpt3-101b", True, 1))]
    c175 = ev.synthetic_curves("gpt3-175b", True, 1)
    for system, key in (("Orca", "orca_175b_req_s_by_max_bs"), ("FasterTransformer", "ft_175b_req_s_by_max_bs")):
        by_bs = over["req_s_by_max_bs_175b"][system]
        assert {int(b): v["values"][0] for b, v in by_bs.items()} == {int(b): v for b, v in got[key].items()}
        assert {int(b): v["values"][1] for b, v in by_bs.items()} == ev.by_max_bs(c175, system)
