"""Calibrating the paper GPU from measured steps, and experiment 05 (simulator vs real run).

No timing is asserted: the fit is checked on step times the cost model itself generates (so the
parameters must come back exactly), and the real run only on what does not depend on the clock.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from figure_files import assert_pngs
from orca_torch.batch import SeqWork, StepTotals
from orca_torch.calibrate import StepSample, default_mixes, describe, fit, measure_steps
from orca_torch.hw_model import GPUSpec, pricer
from orca_torch.model import OrcaModel

ROOT = Path(__file__).resolve().parents[1]


def synthetic(peak_flops: float, mem_bw: float, overhead_s: float, seq_overhead_s: float, model: str = "mini",
              quick: bool = False) -> list[StepSample]:
    """Step times of the default mixes as the cost model prices them on a made-up card."""
    gpu = GPUSpec("synthetic", peak_flops, mem_bw, 1e10, flop_efficiency=1.0, bw_efficiency=1.0)
    pr = pricer(model, gpu, overhead_s=overhead_s, seq_overhead_s=seq_overhead_s)
    return [StepSample(describe(m), StepTotals.of(m), pr.time(StepTotals.of(m))) for m in default_mixes(model, quick)]


@pytest.mark.parametrize("truth", [(50e9, 8e9, 1.5e-3, 3e-4), (70e9, 6e9, 0.0, 5e-4), (1e11, 1.2e10, 2e-3, 0.0),
                                   (2e10, 3e10, 4e-4, 1e-4)])
@pytest.mark.parametrize("quick", [False, True])
def test_fit_recovers_the_cost_models_own_parameters(truth, quick):
    flops, bw, over, per_seq = truth
    samples = synthetic(*truth, quick=quick)
    gpu = GPUSpec("synthetic", flops, bw, 1e10, flop_efficiency=1.0, bw_efficiency=1.0)
    bounds = {pricer("mini", gpu).cost(s.totals).bound for s in samples}
    assert bounds == {"compute", "memory"}          # both sides of the roofline are exercised
    cal = fit(samples, "mini")
    assert cal.peak_flops == pytest.approx(flops, rel=1e-9)
    assert cal.mem_bw == pytest.approx(bw, rel=1e-9)
    assert cal.overhead_s == pytest.approx(over, rel=1e-9, abs=1e-15)
    assert cal.seq_overhead_s == pytest.approx(per_seq, rel=1e-9, abs=1e-15)
    assert cal.rms_rel_error < 1e-9 and cal.max_rel_error < 1e-9
    ex = cal.executor()                             # an ordinary CostModelExecutor on the fitted spec
    for s in samples:
        assert ex.step_time(s.totals) == pytest.approx(s.seconds, rel=1e-9)


def test_fitted_executor_prices_decode_runs_like_single_steps():
    cal = fit(synthetic(60e9, 7e9, 1e-3, 4e-4), "mini")
    ex = cal.executor()
    k, ctx, m = 8, 8 * 300, 20
    runs = ex.decode_durations(k, ctx, m)
    single = [ex.step_time(StepTotals(k, k, ctx + k * (j + 1), ctx + k * (j + 1), ctx + k * (j + 1))) for j in range(m)]
    assert runs.tolist() == single                  # exactly, as the engine's fast-forward needs
    # the per-request overhead is charged once per request: 8 decodes cost 7 x 0.4 ms more than one,
    # beyond what their extra FLOPs and K/V bytes cost
    one, eight = StepTotals.of([SeqWork(1, 299)]), StepTotals.of([SeqWork(1, 299)] * 8)
    no_seq = pricer("mini", cal.gpu(), overhead_s=cal.overhead_s)
    assert cal.predict(eight) - cal.predict(one) == pytest.approx(
        no_seq.time(eight) - no_seq.time(one) + 7 * 4e-4, rel=1e-9)


def test_seq_overhead_defaults_to_zero_and_is_validated():
    t = StepTotals.of([SeqWork(1, 99)] * 4)
    assert pricer("llama-3-8b", "h100").time(t) == pricer("llama-3-8b", "h100", seq_overhead_s=0.0).time(t)
    assert pricer("llama-3-8b", "h100", seq_overhead_s=1e-3).time(t) == pytest.approx(
        pricer("llama-3-8b", "h100").time(t) + 4e-3, rel=1e-12)
    for bad in (-1e-3, math.inf, math.nan, "1"):
        with pytest.raises(ValueError, match="seq_overhead_s must be"):
            pricer("llama-3-8b", "h100", seq_overhead_s=bad)


def test_fit_rejects_bad_input():
    samples = synthetic(50e9, 8e9, 1e-3, 3e-4)
    with pytest.raises(ValueError, match="at least 4 measured steps"):
        fit(samples[:3], "mini")
    with pytest.raises(ValueError, match="positive finite"):
        fit(samples[:-1] + [StepSample("bad", samples[-1].totals, 0.0)], "mini")
    with pytest.raises(ValueError, match="positive finite"):
        fit(samples[:-1] + [StepSample("bad", samples[-1].totals, math.nan)], "mini")
    with pytest.raises(ValueError, match="StepSample"):
        fit(samples[:-1] + [(1.0, samples[-1].totals)], "mini")
    with pytest.raises(ValueError, match="unknown model preset"):
        fit(samples, "gpt-5")
    # the same step measured five times: no rate or per-request cost can be told apart
    same = [StepSample("decode 4", StepTotals.of([SeqWork(1, 10)] * 4), 0.01 + 0.001 * i) for i in range(5)]
    with pytest.raises(ValueError, match="no fit with a positive FLOP rate and bandwidth"):
        fit(same, "mini")


def test_describe_labels_mixes():
    assert describe([SeqWork(128, 0)] + [SeqWork(1, 255)] * 8) == "prefill 128 + decode 8 x ctx 256"
    assert describe([SeqWork(64, 0)] * 4) == "prefill 4 x 64"
    assert describe([SeqWork(16, 32)]) == "chunk 1 x 16 after 32"


def test_measure_steps_records_each_mix_with_its_own_totals():
    model = OrcaModel("tiny", seed=0)
    mixes = [[SeqWork(1, 40)] * 3, [SeqWork(24, 0)], [SeqWork(8, 0), SeqWork(1, 40), SeqWork(1, 100)]]
    repeats = 3
    samples = measure_steps(model, mixes, repeats=repeats, seed=1)
    assert [s.label for s in samples] == [describe(m) for m in mixes]
    for s, m in zip(samples, mixes):
        base = StepTotals.of(m)
        assert (s.totals.n_seqs, s.totals.n_tokens) == (base.n_seqs, base.n_tokens)
        assert s.seconds > 0
        # decodes go on from where the previous repeat left: contexts only grow, by at most one
        # token per decode per round (warm-up included), and prefills start from scratch each time
        n_decodes = sum(1 for w in m if w.n_past)
        assert base.kv_read_tokens <= s.totals.kv_read_tokens
        assert s.totals.kv_read_tokens - base.kv_read_tokens <= n_decodes * len(mixes) * (repeats + 1)
    assert samples[1].totals == StepTotals.of([SeqWork(24, 0)])
    with pytest.raises(ValueError, match="repeats must be"):
        measure_steps(model, mixes, repeats=0)
    with pytest.raises(ValueError, match="context"):
        measure_steps(model, [[SeqWork(1, model.spec.max_context - 2)]], repeats=3)
    with pytest.raises(ValueError, match="non-empty"):
        measure_steps(model, [[]])


def test_experiment_05_quick_json(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "05_sim_vs_real.py"), "--quick", "--json",
                          "--plot", str(tmp_path), "--trace", str(tmp_path / "real.json")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert_pngs(tmp_path, ["05_calibration", "05_real_steps"])
    events = json.loads((tmp_path / "real.json").read_text())["traceEvents"]
    spans = [e for e in events if e.get("cat") == "request"]
    assert len(spans) == r["run"]["workload"]["n_requests"]
    assert sum(e.get("cat") == "step" for e in events) == r["run"]["real_steps"]["n_steps"]
    cal = r["calibration"]
    assert cal["n_mixes"] == len(default_mixes("mini", quick=True)) == len(cal["mixes"])
    for k in ("peak_flops", "mem_bw", "rms_rel_error", "max_rel_error"):
        assert isinstance(cal[k], float) and math.isfinite(cal[k]) and cal[k] > 0
    assert cal["overhead_s"] >= 0 and cal["seq_overhead_s"] >= 0
    for m in cal["mixes"]:
        assert m["measured_s"] > 0 and m["predicted_s"] > 0
        assert m["rel_error"] == pytest.approx(m["predicted_s"] / m["measured_s"] - 1)
    # the reported fit error is the error of the reported rows
    errs = np.array([m["rel_error"] for m in cal["mixes"]])
    assert cal["rms_rel_error"] == pytest.approx(float(np.sqrt(np.mean(errs ** 2))))

    run = r["run"]
    n, outs = run["workload"]["n_requests"], run["output_len"]
    assert len(outs) == n
    assert run["every_request_exact_tokens"] is True
    # the real run's token ids, not just their count: each request equals its prompt generated alone
    assert run["tokens_equal_generation_alone"] is True and run["requests_differing_from_generation_alone"] == []
    assert run["tokens_per_request_real"] == outs == run["tokens_per_request_predicted"]
    for side in ("real", "predicted", "uncalibrated"):
        fig = run[side]
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in fig.values()), (side, fig)
        # clock-free facts of the same scheduler: every request sits in exactly output_len steps
        # (its prefill gives the first token, each decode one more), and no step exceeds max_bs
        assert fig["mean_batch"] * fig["n_steps"] == pytest.approx(sum(outs))
        assert max(outs) <= fig["n_steps"] <= sum(outs)
        assert fig["ttft_median_s"] <= fig["ttft_p99_s"]
    assert set(run["rel_error"]) == set(run["real"])
    assert run["real_steps"]["n_steps"] == run["real"]["n_steps"]
    assert all(math.isfinite(v) for v in run["real_steps"].values())
