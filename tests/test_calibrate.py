"""Calibrating the paper GPU from measured steps, and experiment 05 (simulator vs real run).

No timing is asserted: the fit is checked on step times the cost model itself generates (so the
parameters must come back exactly), and the real run only on what does not depend on the clock.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from figure_files import assert_pngs
from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.lab.calibrate import (MIN_GRID_CONTEXT, calibrate, calibrate_refined, calibrated_machine,
                                      default_mixes, refined_grid)
from orca_torch.lab.calibration.measure import measure_steps
from orca_torch.lab.calibration.refined_fit import REFINED_FIT_PARAMS, fit_refined, not_identified_note
from orca_torch.lab.calibration.roofline_fit import Calibration, fit
from orca_torch.lab.calibration.samples import StepSample, describe, samples_from_rows, step_kind
from orca_torch.sim.hw_model import GPUSpec, RefinedParams, get_gpu, load_profile, pricer
from orca_torch.sim.hw_model.gpus import physical_memory_bytes
from orca_torch.sim.hw_model.refined import RefinedPricer
from orca_torch.sim.hw_model.refined_params import CPU_GEMM_RAMP_TOKENS
from orca_torch.sim.hw_model.roofline import check_totals
from orca_torch.model.orca_model import OrcaModel
from orca_torch.specs import PRESETS, get_model_spec

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


def test_the_fit_errors_are_signed_per_step_and_their_largest_is_by_magnitude():
    """A calibration at the true parameters of its steps predicts each exactly; a step measured at
    twice its time is under-predicted by half (-0.5), one at 0.8 of it over-predicted by a
    quarter (+0.25): the rms is sqrt((0.25 + 0.0625) / n), the largest error 0.5, the one below zero."""
    flops, bw, over, per_seq = 50e9, 8e9, 1.5e-3, 3e-4
    samples = synthetic(flops, bw, over, per_seq, quick=True)
    n = len(samples)
    measured = [dataclasses.replace(samples[0], seconds=2.0 * samples[0].seconds),
                dataclasses.replace(samples[1], seconds=0.8 * samples[1].seconds), *samples[2:]]
    cal = Calibration("mini", flops, bw, over, per_seq, samples=tuple(measured))
    assert cal.rel_errors().tolist() == pytest.approx([-0.5, 0.25] + [0.0] * (n - 2), abs=1e-12)
    assert cal.rms_rel_error == pytest.approx(math.sqrt((0.25 + 0.0625) / n), rel=1e-9)
    assert cal.max_rel_error == pytest.approx(0.5, rel=1e-9)


def test_fit_prices_samples_on_the_model_they_were_measured_on():
    tiny = get_model_spec("tiny")
    samples = [dataclasses.replace(s, spec=tiny) for s in synthetic(50e9, 8e9, 1.5e-3, 3e-4, model="tiny")]
    cal = fit(samples)                              # (not mini's shapes: the FLOPs of tiny's steps)
    assert cal.model == tiny
    assert cal.peak_flops == pytest.approx(50e9, rel=1e-9) and cal.mem_bw == pytest.approx(8e9, rel=1e-9)


def test_fitted_executor_prices_decode_runs_like_single_steps():
    cal = fit(synthetic(60e9, 7e9, 1e-3, 4e-4), "mini")
    ex = cal.executor()
    k, ctx, m = 8, 8 * 300, 20
    runs = ex.decode_durations(k, ctx, m)
    single = [ex.step_time(StepTotals(k, k, ctx + k * (j + 1), ctx + k * (j + 1), ctx + k * (j + 1))) for j in range(m)]
    assert runs.tolist() == single                  # exactly, as the fast engine needs
    # the per-request overhead is charged once per request: 8 decodes cost 7 x 0.4 ms more than one,
    # beyond what their extra FLOPs and K/V bytes cost
    one, eight = StepTotals.of([SeqWork(1, 299)]), StepTotals.of([SeqWork(1, 299)] * 8)
    no_seq = pricer("mini", cal.gpu(), overhead_s=cal.overhead_s)
    assert cal.predict(eight) - cal.predict(one) == pytest.approx(
        no_seq.time(eight) - no_seq.time(one) + 7 * 4e-4, rel=1e-9)


def test_a_calibration_measured_on_a_cuda_card_is_named_after_it_and_carries_its_memory(monkeypatch):
    """A roofline fit of steps timed on an H200 prices as "h200-calibrated" with the card's memory, as a
    refined fit's card is "h200-refined"; it was "cpu-calibrated" with the host's memory on any device.
    No CUDA here: torch answers for the device as on an H200, and the steps are the cost model's."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=150 * 10**9))
    assert calibrated_machine("cuda:0") == ("h200", 141e9)                  # the datasheet's nominal 141 GB
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A card without a datasheet here")
    assert calibrated_machine(torch.device("cuda")) == ("cuda", 150e9)
    assert calibrated_machine("cpu") == ("cpu", physical_memory_bytes())

    gpu = GPUSpec("synthetic", 60e9, 7e9, 1e10, flop_efficiency=1.0, bw_efficiency=1.0)
    price = pricer("mini", gpu, overhead_s=1e-3, seq_overhead_s=4e-4)
    monkeypatch.setattr("orca_torch.lab.calibrate.measure_steps", lambda model, mixes, repeats, seed, device=None: [
        StepSample(describe(m), StepTotals.of(m), price.time(StepTotals.of(m)), model.spec) for m in mixes])
    asked = []
    monkeypatch.setattr("orca_torch.lab.calibrate.calibrated_machine",
                        lambda device: asked.append(str(device)) or ("h200", 141e9))
    card = calibrate("mini", quick=True).gpu()
    assert asked == ["cpu"] and (card.name, card.mem_bytes) == ("h200-calibrated", 141e9)
    assert "steps on h200" in card.source and card.peak_flops == pytest.approx(60e9, rel=1e-9)
    assert fit(synthetic(60e9, 7e9, 1e-3, 4e-4)).gpu().name == "cpu-calibrated"     # steps built by hand


def test_steps_fitted_by_hand_are_named_after_the_machine_they_ran_on():
    """A CUDA server's steps fitted by hand price as the card they ran on, named and sized as `calibrate`
    names a device it times: "h200-calibrated" with the H200's 141 GB (they were "cpu-calibrated" with
    this host's memory, unless the caller replaced both afterwards); a card without a datasheet here
    comes with its memory. The fitted rates do not depend on the name."""
    steps = synthetic(60e9, 7e9, 1e-3, 4e-4)
    here = fit(steps)
    for machine, mem_bytes, memory in (("h200", None, 141e9), ("a100-40gb", None, 40e9), ("cuda", 24e9, 24e9),
                                       ("h200", 150e9, 150e9), ("cpu", None, physical_memory_bytes())):
        cal = fit(steps, machine=machine, mem_bytes=mem_bytes)
        card = cal.gpu()
        assert (cal.machine, card.name, card.mem_bytes) == (machine, f"{machine}-calibrated", memory)
        assert f"steps on {machine} " in card.source
        assert (cal.peak_flops, cal.mem_bw, cal.overhead_s, cal.seq_overhead_s) == \
            (here.peak_flops, here.mem_bw, here.overhead_s, here.seq_overhead_s)


def test_a_card_is_named_in_any_case_as_get_gpu_takes_it():
    """fit(machine="H200") was refused (no card with a datasheet), though get_gpu("H200") and
    fit_refined(gpu="H200") take the card: every entry point now takes a card's name in any case and
    names it in its canonical form."""
    steps = synthetic(60e9, 7e9, 1e-3, 4e-4)
    for typed, machine, memory in (("H200", "h200", 141e9), ("A100-40GB", "a100-40gb", 40e9),
                                   ("CPU", "cpu", physical_memory_bytes()), ("MyRig", "MyRig", 24e9)):
        cal = fit(steps, machine=typed, mem_bytes=None if machine != "MyRig" else 24e9)
        assert (cal.machine, cal.gpu().name, cal.mem_bytes) == (machine, f"{machine}-calibrated", memory)
        assert dataclasses.replace(cal, machine=typed).machine == machine
    assert get_gpu("H200") is get_gpu("h200")


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
    with pytest.raises(ValueError, match="seconds must be a finite number > 0"):
        fit(samples[:-1] + [StepSample("bad", samples[-1].totals, 0.0)], "mini")
    with pytest.raises(ValueError, match="seconds must be a finite number > 0"):
        fit(samples[:-1] + [StepSample("bad", samples[-1].totals, math.nan)], "mini")
    with pytest.raises(ValueError, match="seconds must be a finite number > 0"):
        fit(samples[:-1] + [StepSample("bad", samples[-1].totals, True)], "mini")
    with pytest.raises(ValueError, match="samples must be StepSample items, got tuple"):
        fit(samples[:-1] + [(1.0, samples[-1].totals)], "mini")
    with pytest.raises(ValueError, match="unknown model preset 'gpt-5'; known presets: gpt3-101b, .*, tiny"):
        fit(samples, "gpt-5")
    # the same step measured five times: no rate or per-request cost can be told apart
    same = [StepSample("decode 4", StepTotals.of([SeqWork(1, 10)] * 4), 0.01 + 0.001 * i) for i in range(5)]
    with pytest.raises(ValueError, match=r"got 1 distinct \(5 samples, some of the same step\)"):
        fit(same, "mini")


def test_describe_labels_mixes():
    assert describe([SeqWork(128, 0)] + [SeqWork(1, 255)] * 8) == "prefill 128 + decode 8 x ctx 256"
    assert describe([SeqWork(64, 0)] * 4) == "prefill 4 x 64"
    assert describe([SeqWork(16, 32)]) == "chunk 1 x 16 after 32"


def test_step_kind_names_decodes_prefills_and_mixed_steps():
    """One classification for gpu_profile.py's tables and 05_sim_vs_real.py's plot groups."""
    kinds = {describe(m): step_kind(samples_from_rows([(m, 1e-3)])[0]) for m in (
        [SeqWork(1, 40)], [SeqWork(1, 40)] * 8, [SeqWork(128, 0)], [SeqWork(16, 32)], [SeqWork(64, 0)] * 4,
        [SeqWork(128, 0)] + [SeqWork(1, 255)] * 8)}
    assert kinds == {"decode 1 x ctx 41": "decode", "decode 8 x ctx 41": "decode", "prefill 128": "prefill",
                     "chunk 1 x 16 after 32": "prefill", "prefill 4 x 64": "mixed",
                     "prefill 128 + decode 8 x ctx 256": "mixed"}


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
    with pytest.raises(ValueError, match="repeats must be an integer >= 1, got 0"):
        measure_steps(model, mixes, repeats=0)
    with pytest.raises(ValueError, match="repeats 3: the mixes' decodes would run past tiny's context 512; repeats "
                                         "may be at most 1$"):         # 510 + 1 a repeat, warm-up included
        measure_steps(model, [[SeqWork(1, model.spec.max_context - 2)]], repeats=3)
    with pytest.raises(ValueError, match="mixes must be a non-empty list of non-empty SeqWork lists"):
        measure_steps(model, [[]])


def test_experiment_05_quick_json(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "05_sim_vs_real.py"), "--quick", "--json",
                          "--device", "cpu", "--plot", str(tmp_path), "--trace", str(tmp_path / "real.json")],
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


# ---- the refined model's calibration -------------------------------------------------------------------------


TRUTHS = [
    RefinedParams(gemm_flop_ceiling=0.6, gemm_bw_ceiling=0.5, attention_flop_efficiency=0.3,
                  elementwise_bw_efficiency=0.4, launch_overhead_s=1e-3, seq_overhead_s=2e-4, kernel_floor_s=0.0,
                  attention="full"),
    RefinedParams(gemm_flop_ceiling=0.9, gemm_bw_ceiling=0.2, attention_flop_efficiency=0.7,
                  elementwise_bw_efficiency=0.05, launch_overhead_s=3e-4, seq_overhead_s=0.0, overlap=2.5,
                  attention="causal-tiles"),
]


@pytest.mark.parametrize("truth", TRUTHS)
@pytest.mark.parametrize("quick", [False, True])
def test_fit_refined_recovers_known_parameters(truth, quick):
    card = GPUSpec("synthetic", 50e9, 8e9, 1e10, refined=truth)
    fit_m, held_m = refined_grid("mini", quick)
    pr = RefinedPricer("mini", card)
    rows = [(m, pr.time(StepTotals.of(m))) for m in fit_m]
    samples = samples_from_rows(rows)
    start = dataclasses.replace(RefinedParams(), attention=truth.attention, kernel_floor_s=truth.kernel_floor_s,
                                overlap=truth.overlap)
    fitted = fit_refined(samples, "mini", GPUSpec("synthetic", 50e9, 8e9, 1e10), start=start)
    assert fitted.free == REFINED_FIT_PARAMS
    got = fitted.gpu.refined
    for name in ("gemm_flop_ceiling", "gemm_bw_ceiling", "attention_flop_efficiency", "elementwise_bw_efficiency"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    for name in ("launch_overhead_s", "seq_overhead_s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-10), name
    assert (fitted.gpu.peak_flops, fitted.gpu.mem_bw) == (50e9, 8e9)
    held = samples_from_rows([(m, pr.time(StepTotals.of(m))) for m in held_m])
    assert fitted.median_abs_error(held) < 1e-6                 # held-out steps come out right too
    assert fitted.not_identified == ()                          # every rate the truth has is pinned down


def _grid_properties(mixes: list[list[SeqWork]]) -> tuple[set, set, set]:
    """(decode batch sizes, decode contexts, prompt lengths) that the steps of `mixes` have."""
    batches, contexts, prompts = set(), set(), set()
    for m in mixes:
        decodes = [w for w in m if w.n_past]
        batches |= {len(decodes)} if decodes else set()
        contexts |= {w.n_past + 1 for w in decodes}
        prompts |= {w.n_new for w in m if not w.n_past}
    return batches, contexts, prompts


GRID_CONTEXTS = (132, 200, 256, 300, 384, 512, 640, 1000, 1024, 1031, 1536, 2048, 3000, 4096, 8192, 32768)


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_held_out_steps_share_no_batch_size_context_or_prompt_length_with_fitted_ones(preset, quick):
    base = get_model_spec(preset)
    for ctx in sorted({base.max_context, *GRID_CONTEXTS}):
        spec = dataclasses.replace(base, max_context=ctx)
        if ctx < MIN_GRID_CONTEXT[quick]:
            continue
        fit_m, held_m = refined_grid(spec, quick)
        fitted, held = _grid_properties(fit_m), _grid_properties(held_m)
        for what, f, h in zip(("batch sizes", "contexts", "prompt lengths"), fitted, held):
            assert h and not f & h, (preset, ctx, what, sorted(f & h))
        key = lambda m: sorted((w.n_new, w.n_past) for w in m)  # noqa: E731
        assert not {str(key(m)) for m in fit_m} & {str(key(m)) for m in held_m}, (preset, ctx)
        assert len(fit_m) >= len(REFINED_FIT_PARAMS) + 1 and len(held_m) >= 3, (preset, ctx)
        for m in fit_m + held_m:                                # every step fits the model's context
            assert all(w.n_new >= 1 and w.n_past + w.n_new <= ctx for w in m), (preset, ctx, describe(m))


@pytest.mark.parametrize("quick", [False, True])
def test_refined_grid_accepts_every_context_from_its_minimum_and_names_it_below(quick):
    tiny, lo = get_model_spec("tiny"), MIN_GRID_CONTEXT[quick]
    for ctx in range(lo, 4200):                             # no gap: every context from the minimum on
        fit_m, held_m = refined_grid(dataclasses.replace(tiny, max_context=ctx), quick)
        fitted, held = _grid_properties(fit_m), _grid_properties(held_m)
        assert all(not f & h for f, h in zip(fitted, held)), ctx
    for ctx in (lo - 1, 64, 16):
        with pytest.raises(ValueError, match=f"max_context {ctx} is too small.*max_context >= {lo}"):
            refined_grid(dataclasses.replace(tiny, max_context=ctx), quick)


def test_refined_grid_moves_tinys_colliding_held_out_values_and_keeps_minis_grid():
    held = lambda name, quick: [describe(m) for m in refined_grid(name, quick)[1]]  # noqa: E731
    assert held("tiny", True) == ["decode 4 x ctx 64", "decode 16 x ctx 64", "prefill 96",
                                  "prefill 96 + decode 16 x ctx 64"]
    assert held("tiny", False)[-4:] == ["prefill 32", "prefill 192", "prefill 96", "prefill 32 + decode 32 x ctx 48"]
    assert held("mini", True) == ["decode 4 x ctx 256", "decode 16 x ctx 256", "prefill 64", "prefill 384",
                                  "prefill 64 + decode 16 x ctx 256"]
    assert [describe(m) for m in refined_grid("mini", True)[0]][-4:] == [
        "prefill 16", "prefill 128", "prefill 256", "prefill 128 + decode 8 x ctx 512"]
    assert (len(refined_grid("mini")[0]), len(refined_grid("mini")[1])) == (17, 12)


def test_a_fitted_rate_above_the_given_peak_raises_the_peak():
    truth = RefinedParams(gemm_flop_ceiling=1.0, gemm_bw_ceiling=1.0, attention_flop_efficiency=1.0,
                          elementwise_bw_efficiency=1.0, kernel_floor_s=0.0, attention="full")
    fast = GPUSpec("fast", 100e9, 16e9, 1e10, refined=truth)
    pr = RefinedPricer("mini", fast)
    samples = samples_from_rows([(m, pr.time(StepTotals.of(m))) for m in refined_grid("mini")[0]])
    fitted = fit_refined(samples, "mini", GPUSpec("slow", 50e9, 8e9, 1e10),
                         start=dataclasses.replace(RefinedParams(), attention="full", kernel_floor_s=0.0))
    assert fitted.gpu.peak_flops == pytest.approx(100e9, rel=1e-6)
    assert fitted.gpu.mem_bw == pytest.approx(16e9, rel=1e-6)
    assert fitted.median_abs_error() < 1e-9


def test_a_rate_the_steps_cannot_see_is_reported_not_identified(tmp_path):
    # Attention's FLOPs at 200 TFLOP/s cost nothing next to 50 GFLOP/s GEMMs: no step pins that rate.
    truth = RefinedParams(gemm_flop_ceiling=2.5e-4, gemm_bw_ceiling=0.3, attention_flop_efficiency=1.0,
                          elementwise_bw_efficiency=0.05, launch_overhead_s=1e-3, seq_overhead_s=2e-4,
                          kernel_floor_s=0.0, attention="full")
    pr = RefinedPricer("mini", GPUSpec("free-attention", 2e14, 8e9, 1e10, refined=truth))
    samples = samples_from_rows([(m, pr.time(StepTotals.of(m))) for m in refined_grid("mini", quick=True)[0]])
    fitted = fit_refined(samples, "mini", GPUSpec("synthetic", 50e9, 8e9, 1e10),
                         start=dataclasses.replace(RefinedParams(), attention="full", kernel_floor_s=0.0))
    assert fitted.median_abs_error() < 1e-6
    assert fitted.not_identified == ("attention_flop_efficiency",)
    got, g = fitted.gpu.refined, fitted.gpu
    assert g.peak_flops * got.attention_flop_efficiency != pytest.approx(2e14, rel=0.5)  # wherever the fit stopped
    assert g.peak_flops * got.gemm_flop_ceiling == pytest.approx(50e9, rel=1e-6)       # the identified ones are right
    # the loose rate raises no peak (what a roofline reads): it is capped at the card's 50 GFLOP/s,
    # which moves only the steps whose attention the truth made free (the longest prefills), honestly
    # (the fitted GEMM ceiling may land a rounding error above the peak, which it then sets)
    assert g.peak_flops == pytest.approx(50e9, rel=1e-9) and got.attention_flop_efficiency == pytest.approx(1.0)
    errors = sorted(abs(fitted.pricer().time(s.totals) / s.seconds - 1) for s in samples)
    assert errors[len(errors) // 2] < 1e-6 and 1e-3 < errors[-1] < 0.05
    # so its 1 is the peak, slower than these steps allow: what the printed note says, not "the slowest"
    assert "then capped at the peak (a 1 is the peak)" in not_identified_note(fitted.not_identified)
    assert g.mem_bw * got.gemm_bw_ceiling == pytest.approx(0.3 * 8e9, rel=1e-6)
    assert g.mem_bw * got.elementwise_bw_efficiency == pytest.approx(0.05 * 8e9, rel=1e-6)
    assert fitted.notes()["not_identified"] == ["attention_flop_efficiency"]
    d = json.loads(fitted.save(tmp_path / "p.json").read_text())
    assert d["notes"]["not_identified"] == ["attention_flop_efficiency"]


def test_profile_from_a_fit_is_what_pricer_reads_by_path(tmp_path):
    card = GPUSpec("synthetic", 50e9, 8e9, 1e10, refined=TRUTHS[0])
    pr = RefinedPricer("mini", card)
    fit_m, held_m = refined_grid("mini", quick=True)
    samples = samples_from_rows([(StepTotals.of(m), pr.time(StepTotals.of(m))) for m in fit_m])
    held = samples_from_rows([(m, pr.time(StepTotals.of(m))) for m in held_m])
    fitted = fit_refined(samples, "mini", GPUSpec("synthetic", 50e9, 8e9, 1e10),
                         start=dataclasses.replace(RefinedParams(), attention="full", kernel_floor_s=0.0))
    path = fitted.save(tmp_path / "cpu.json", held)
    d = json.loads(path.read_text())
    assert d["notes"]["n_samples"] == len(samples) and d["notes"]["n_held_out"] == len(held)
    assert load_profile(path) == fitted.gpu
    t = StepTotals.of([SeqWork(1, 99)] * 8)
    assert pricer("mini", str(path), cost_model="refined").time(t) == fitted.predict(t)


def test_fit_refined_rejects_bad_input():
    samples = samples_from_rows([([SeqWork(1, 9)] * b, 1e-3 * b) for b in range(1, 10)])
    with pytest.raises(ValueError, match=r"give model=: the samples do not carry the model they were measured on"):
        fit_refined(samples)
    with pytest.raises(ValueError, match="free must name distinct refined parameters"):
        fit_refined(samples, "mini", free=("gemm_speed",))
    with pytest.raises(ValueError, match="need at least 7 measured steps"):
        fit_refined(samples[:3], "mini")
    with pytest.raises(ValueError, match="seconds must be a finite number > 0"):
        fit_refined(samples_from_rows([([SeqWork(4)], -1.0)] * 8), "mini")
    with pytest.raises(ValueError, match="StepSample items"):
        fit_refined(samples[:-1] + [(1e-3, samples[-1].totals)], "mini")
    with pytest.raises(ValueError, match="seconds must be a finite number > 0"):
        fit_refined(samples[:-1] + [StepSample("bool", samples[-1].totals, True)], "mini")
    with pytest.raises(ValueError, match=r"row 0 must be \(SeqWork list or StepTotals, seconds\), got "):
        samples_from_rows([([SeqWork(4)],)])
    with pytest.raises(ValueError, match="non-empty SeqWork list or a StepTotals"):
        samples_from_rows([([], 1.0)])


def test_measured_samples_carry_their_model_and_fit_without_naming_it():
    model = OrcaModel("tiny", seed=0)
    mixes = [[SeqWork(1, 15)] * b for b in (1, 2, 4, 8)] + [[SeqWork(n)] for n in (8, 32, 64)] + [
        [SeqWork(16)] + [SeqWork(1, 15)] * 4]
    samples = measure_steps(model, mixes, repeats=1, seed=0, device="cpu")
    assert all(s.spec == model.spec for s in samples)
    fitted = fit_refined(samples, gpu="cpu")
    assert fitted.model == model.spec and len(fitted.rel_errors()) == len(mixes)
    with pytest.raises(ValueError, match="device='cuda' but the model lives on cpu"):
        measure_steps(model, mixes, repeats=1, device="cuda")


def test_gpu_profile_script_says_it_measured_nothing_without_cuda_and_runs_on_cpu(tmp_path):
    script = ROOT / "benchmarks" / "gpu_profile.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "CUDA is not available" in r.stderr and r.stdout == ""
    out = tmp_path / "tiny.json"
    r = subprocess.run([sys.executable, str(script), "--device", "cpu", "--model", "tiny", "--quick", "--repeats",
                        "1", "--out", str(out), "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert {k.split("/")[0] for k in res["median_abs_error"]} == {"decode", "prefill", "mixed"}
    assert {s["part"] for s in res["steps"]} == {"fit", "held-out"}
    assert res["datasheet_source"].endswith("GB/s, 1 thread")       # measured on the steps' one thread
    assert res["attention_path"] == "split"
    prof = load_profile(out)
    assert prof.refined.attention == "full" and prof.name == "cpu-refined"
    assert prof.refined.kernel_floor_s == 0.0 and prof.refined.gemm_ramp_tokens == CPU_GEMM_RAMP_TOKENS
    assert pricer("tiny", str(out), cost_model="refined").time(StepTotals.of([SeqWork(8)])) > 0
    r = subprocess.run([sys.executable, str(script), "--device", "cpu", "--model", "tiny", "--quick", "--repeats",
                        "1", "--attention", "fused", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["attention_path"] == "batched"      # (no Flash Attention on a CPU)


def test_experiment_05_refined_quick_json(capsys):
    spec = importlib.util.spec_from_file_location("refined_calibration_05",
                                                  ROOT / "experiments" / "05_refined_calibration.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--quick", "--json"])
    r = json.loads(capsys.readouterr().out)
    fit_m, held_m = refined_grid("mini", quick=True)
    assert (r["calibration"]["n_fit"], r["calibration"]["n_held_out"]) == (len(fit_m), len(held_m))
    assert set(r["calibration"]["refined_fitted"]) == set(REFINED_FIT_PARAMS)
    # a rate the steps do not pin down is named, so its fitted value is not read as a measured rate
    assert set(r["calibration"]["not_identified"]) <= set(REFINED_FIT_PARAMS)
    for name in ("roofline", "refined"):
        assert all(0 <= v < math.inf for v in r["median_abs_error"][name].values())
    run = r["run"]
    outs_total = None
    for side in ("real", "roofline", "refined"):
        fig = run[side]
        assert fig["ttft_median_s"] <= fig["ttft_p99_s"]
        total = fig["mean_batch"] * fig["n_steps"]          # every request sits in output_len steps, on any clock
        outs_total = total if outs_total is None else outs_total
        assert total == pytest.approx(outs_total)
    assert set(run["rel_error"]["refined"]) == set(run["real"])


def test_both_fits_refuse_a_bool_as_a_step_time():
    """True is not 1 second: the two fits share one check of the samples."""
    samples = samples_from_rows([([SeqWork(1, 9)] * b, 1e-3 * b) for b in range(1, 10)])
    bad = samples[:-1] + [StepSample("bool", samples[-1].totals, True)]
    with pytest.raises(ValueError, match=r"seconds must be a finite number > 0, got True \(a bool\)"):
        fit(bad, "mini")
    with pytest.raises(ValueError, match=r"seconds must be a finite number > 0, got True \(a bool\)"):
        fit_refined(bad, "mini")


@pytest.mark.parametrize("totals", [StepTotals(True, True, 5, 5, 5), StepTotals(1, 1, 0, 0, 0),
                                    StepTotals(1, 1, 10, 5, 50), StepTotals(1.0, 1, 2, 2, 2)])
def test_sample_totals_get_one_check(totals):
    """One check of a step's totals: calibration rows and fitted samples say what `check_totals` says."""
    with pytest.raises(ValueError) as priced:
        check_totals(totals)
    with pytest.raises(ValueError) as row:
        samples_from_rows([(totals, 0.1)])
    assert str(row.value) == f"row 0: {priced.value}"
    good = samples_from_rows([([SeqWork(1, 9)] * b, 1e-3 * b) for b in range(1, 10)])
    with pytest.raises(ValueError) as sample:
        fit(good[:-1] + [StepSample("odd", totals, 0.1)], "mini")
    assert str(sample.value) == f"sample 'odd': {priced.value}"


def test_numpy_step_times_and_totals_fit_as_the_same_python_numbers():
    samples = synthetic(50e9, 8e9, 1e-3, 3e-4)
    as_np = [StepSample(s.label, StepTotals(*(np.int64(getattr(s.totals, f)) for f in s.totals._fields)),
                        np.float32(s.seconds)) for s in samples]
    same = [StepSample(s.label, s.totals, float(np.float32(s.seconds))) for s in samples]
    got, want = fit(as_np, "mini"), fit(same, "mini")
    assert (got.peak_flops, got.mem_bw, got.overhead_s, got.seq_overhead_s) == (
        want.peak_flops, want.mem_bw, want.overhead_s, want.seq_overhead_s)
    assert got.samples == want.samples and all(type(s.seconds) is float for s in got.samples)
    assert all(type(getattr(s.totals, f)) is int for s in got.samples for f in s.totals._fields)
    rows = samples_from_rows([(s.totals, s.seconds) for s in as_np])
    assert fit_refined(rows, "mini", "h100", free=("launch_overhead_s", "seq_overhead_s"), max_iter=np.int64(5)).gpu \
        == fit_refined(same, "mini", "h100", free=("launch_overhead_s", "seq_overhead_s"), max_iter=5).gpu
    with pytest.raises(ValueError, match=r"max_iter must be an integer >= 1, got True \(a bool\)"):
        fit_refined(same, "mini", "h100", max_iter=True)


# Quick-grid steps of `mini` timed on this project's 2-core VM (ms, one thread; fitted, then held
# out), in a sitting whose measured card (below) was slower than the steps, as a shared machine's
# often is.
MEASURED_MS = {"decode 1 x ctx 32": 8.1841, "decode 1 x ctx 512": 8.1982, "decode 8 x ctx 32": 17.8505,
               "decode 8 x ctx 512": 22.7361, "decode 32 x ctx 32": 36.7068, "decode 32 x ctx 512": 59.0678,
               "prefill 16": 16.6997, "prefill 128": 51.6440, "prefill 256": 116.9805,
               "prefill 128 + decode 8 x ctx 512": 83.1330,
               "decode 4 x ctx 256": 15.6789, "decode 16 x ctx 256": 35.7726, "prefill 64": 34.3674,
               "prefill 384": 177.3113, "prefill 64 + decode 16 x ctx 256": 47.5067}


def _recorded_steps(model, mixes, repeats, seed, device=None):
    """`measure_steps` as if the steps had taken `MEASURED_MS` (nothing is timed)."""
    return [StepSample(describe(m), StepTotals.of(m), MEASURED_MS[describe(m)] / 1e3, model.spec) for m in mixes]


def test_a_cpu_calibration_starts_from_a_cpus_gemm_ramp(monkeypatch):
    # From a GPU's ramp (64 rows) the fit of these steps leaves the GEMM rate unpinned above the
    # card's peak, where capping it puts the fitted steps 76% off; from a CPU's it is pinned.
    fit_mixes, held_mixes = refined_grid("mini", quick=True)
    assert [describe(m) for m in fit_mixes + held_mixes] == list(MEASURED_MS)

    monkeypatch.setattr("orca_torch.lab.calibrate.measure_steps", _recorded_steps)
    fitted, held = calibrate_refined("mini", quick=True, gpu=GPUSpec("cpu", 62.37e9, 15.34e9, 25e9))
    assert fitted.gpu.refined.gemm_ramp_tokens == CPU_GEMM_RAMP_TOKENS
    assert "gemm_flop_ceiling" not in fitted.not_identified and fitted.gpu.refined.gemm_flop_ceiling < 1.0
    assert fitted.median_abs_error() < 0.15 and fitted.median_abs_error(held) < 0.2


def test_the_refined_fit_starts_by_default_from_the_models_device_before_calibration(monkeypatch):
    """Without `gpu=`, the start is `uncalibrated_gpu` of the model's device (a card's datasheet on a
    GPU), not the host CPU's card; given the same card, the fit is the one `gpu=` gives."""
    card = GPUSpec("cpu", 62.37e9, 15.34e9, 25e9)
    asked = []

    def uncalibrated(device):
        asked.append(str(device))
        return card

    monkeypatch.setattr("orca_torch.lab.calibrate.measure_steps", _recorded_steps)
    monkeypatch.setattr("orca_torch.lab.calibrate.uncalibrated_gpu", uncalibrated)
    by_default, _ = calibrate_refined("mini", quick=True)
    given, _ = calibrate_refined("mini", quick=True, gpu=card)
    assert asked == ["cpu"] and by_default.gpu == given.gpu


def test_a_refined_fit_on_a_card_without_a_datasheet_is_named_and_sized_as_that_card(monkeypatch):
    """Such a card starts from the H100's rates (`uncalibrated_gpu`); its fitted card was named
    "h100-refined" with the H100's 80 GB, a profile claiming to be another card. No CUDA here: the
    device's answers are those of a 24 GB card without a datasheet."""
    monkeypatch.setattr("orca_torch.lab.calibrate.measure_steps", _recorded_steps)
    monkeypatch.setattr("orca_torch.lab.calibrate.uncalibrated_gpu", lambda device: get_gpu("h100"))
    monkeypatch.setattr("orca_torch.lab.calibrate.calibrated_machine", lambda device: ("cuda", 24e9))
    fitted, _ = calibrate_refined("mini", quick=True)
    assert (fitted.gpu.name, fitted.gpu.mem_bytes) == ("cuda-refined", 24e9)
    assert fitted.gpu.source.startswith("cuda with refined parameters fitted to 10 measured mini steps")
    monkeypatch.setattr("orca_torch.lab.calibrate.calibrated_machine", lambda device: ("h100", 80e9))
    assert calibrate_refined("mini", quick=True)[0].gpu.name == "h100-refined"       # a card with one: as before


@pytest.mark.parametrize("attention, kernel, computes", [
    ("split", None, "full"), ("fused", None, "full"), ("fused", lambda *a, **kw: None, "causal-tiles")])
def test_a_refined_fit_starts_from_the_attention_the_models_path_computes(attention, kernel, computes, monkeypatch):
    """The split loop and the padded batch compute attention's whole masked rectangle, a variable-length
    kernel (Flash Attention's, set here by hand on the CPU) only the causal tiles: the fit is priced on
    what the model's path computes, on any device (it used to say "full" on every CPU and keep the card's
    "causal-tiles" on every GPU)."""
    monkeypatch.setattr("orca_torch.lab.calibrate.measure_steps", _recorded_steps)
    model = OrcaModel("mini", seed=0, attention=attention)
    if kernel is not None:
        model.varlen_kernel = kernel
    fitted, _ = calibrate_refined(model, quick=True, gpu=GPUSpec("cpu", 62.37e9, 15.34e9, 25e9))
    assert fitted.gpu.refined.attention == computes


def bench_calibration_priced():
    """benchmarks/bench_calibration.py loaded as a module, with mini's quick steps (fit and held-out)
    timed at the A100's refined prices, 3x slower, and the fit to them: nothing is measured."""
    spec = importlib.util.spec_from_file_location("bench_calibration", ROOT / "benchmarks" / "bench_calibration.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fit_m, held_m = refined_grid("mini", quick=True)
    price = pricer("mini", "a100-80gb", cost_model="refined")
    fit_s, held_s = ([StepSample(describe(m), StepTotals.of(m), 3 * price.time(StepTotals.of(m))) for m in mixes]
                     for mixes in (fit_m, held_m))
    return bench, fit_s, held_s, fit_refined(fit_s, "mini", "a100-80gb")


def test_bench_calibration_json_holds_the_figures_it_prints(monkeypatch, capsys):
    """--json carries the per-step table (measured, both calibrated models, their errors) and the fitted
    effective rates the text prints, null where a rate is not identified. The steps' times are the A100's
    refined prices (3x slower), so nothing is measured."""
    bench, fit_s, held_s, fitted = bench_calibration_priced()
    seeds = []
    monkeypatch.setattr(bench, "calibrate_refined", lambda *a, **k: (seeds.append(k["seed"]), (fitted, held_s))[1])
    res = bench.main(["--quick", "--json"])
    assert json.loads(capsys.readouterr().out)["cpu_steps"] == res["cpu_steps"]
    steps = res["cpu_steps"]
    assert [(s["part"], s["step"]) for s in steps] == ([("fit", s.label) for s in fit_s]
                                                        + [("held-out", s.label) for s in held_s])
    for s in steps:
        assert s["refined_err"] == pytest.approx(s["refined_ms"] / s["measured_ms"] - 1)
        assert s["roofline_err"] == pytest.approx(s["roofline_ms"] / s["measured_ms"] - 1)
    assert np.median([abs(s["refined_err"]) for s in steps if s["part"] == "held-out"]) == pytest.approx(
        res["cpu_held_out_median_abs_error"]["refined"])
    rates = res["cpu_refined_effective_rates"]
    named = {"gemm_gflop_s": "gemm_flop_ceiling", "gemm_gb_s": "gemm_bw_ceiling",
             "attention_gflop_s": "attention_flop_efficiency", "elementwise_gb_s": "elementwise_bw_efficiency"}
    assert set(rates) == set(named)
    for key, name in named.items():
        assert (rates[key] is None) == (name in res["cpu_not_identified"])
    bench.main(["--quick", "--seed", "3"])
    text = capsys.readouterr().out
    assert f"{steps[0]['measured_ms']:.2f}" in text
    assert seeds == [0, 3]          # (--seed's default is 0, as its help says)
    assert rates["gemm_gflop_s"] is None or f"GEMM {rates['gemm_gflop_s']:.3g} GFLOP/s" in text


def test_bench_calibration_names_the_threads_it_timed_on(monkeypatch, capsys):
    """The measured table's title says the thread count `--threads` set, not "one thread" whatever it was
    (two cores pretended, so `--threads 2` is taken on any machine; the steps are priced, not measured)."""
    import os

    bench, fit_s, held_s, fitted = bench_calibration_priced()
    monkeypatch.setattr(bench, "calibrate_refined", lambda *a, **k: (fitted, held_s))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for argv, said in ((["--quick", "--threads", "2"], "2 threads"), (["--quick"], "one thread")):
        bench.main(argv)
        titles = [line for line in capsys.readouterr().out.splitlines() if line.startswith("== mini on this CPU")]
        assert titles == [f"== mini on this CPU ({said}): measured vs the two calibrated cost models (ms)"], argv


@pytest.mark.parametrize("mixes, loose", [
    ([[SeqWork(p, 0)] * b for p in (64, 128, 256, 512) for b in (1, 2, 4)], ("mem_bw",)),
    ([[SeqWork(1, c - 1)] * b for c in (32, 256, 1024) for b in (1, 2, 4, 8)], ("peak_flops",)),
    ([[SeqWork(p, 0)] * b for p in (64, 512) for b in (1, 4)] + [[SeqWork(1, 255)] * b for b in (1, 2, 8)], ()),
])
def test_a_rate_steps_on_one_side_of_the_roofline_bound_from_below_only_is_named_not_identified(mixes, loose):
    # only prefills (or only decodes) fit exactly with any rate of the other side at least as fast as the
    # ridge at one step: the fit returns that slowest rate (off by half here), so it says it is not measured
    gpu = GPUSpec("s", 50e9, 8e9, 1e12, flop_efficiency=1.0, bw_efficiency=1.0)
    pr = pricer("mini", gpu, overhead_s=1e-3, seq_overhead_s=3e-4)
    cal = fit(samples_from_rows([(m, pr.time(StepTotals.of(m))) for m in mixes]), "mini")
    assert cal.not_identified == loose
    if not loose:
        assert cal.peak_flops == pytest.approx(50e9) and cal.mem_bw == pytest.approx(8e9)


def test_a_device_without_an_index_is_the_one_a_model_built_on_it_lives_on():
    """calibrate('mini', device='cuda') builds the model on 'cuda', which lives on cuda:0, then has
    measure_steps check the model against 'cuda': a torch.device comparison calls them two devices."""
    import torch

    from orca_torch.checks import same_device

    assert torch.device("cuda") != torch.device("cuda", 0)
    assert same_device("cuda", torch.device("cuda", 0)) and same_device("cuda:1", torch.device("cuda", 1))
    assert same_device("cpu", torch.device("cpu"))
    assert not same_device("cuda:1", torch.device("cuda", 0)) and not same_device("cuda", torch.device("cpu"))
    assert not same_device("cpu", torch.device("cuda", 0))



def _script(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "experiments" / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("script, argv", [("05_sim_vs_real.py", ["--device", "cpu"]),
                                          ("05_refined_calibration.py", [])])
def test_experiment_05s_run_table_prints_a_tiny_runs_seconds_as_more_than_zero(script, argv, capsys):
    """Every figure of Part 2 is > 0 (times, a throughput, a batch, a step count), and the table
    shows it so on `tiny`, whose TPOT is a fraction of a millisecond: printed as 0.000 beside an
    error of some percent, a figure cannot be read. So is the busy time beside its error."""
    _script(script).main(["--quick", "--model", "tiny", *argv])
    out = capsys.readouterr().out
    labels = [label for label, _ in _script("05_sim_vs_real.py").COMPARED]
    part2 = out[out.index("== Part 2"):]
    rows = [line[len(label):].split() for line in part2.splitlines() for label in labels if line.startswith(label)]
    assert len(rows) == len(labels)
    for cells in rows:
        values = [float(c) for c in cells if not c.endswith("%")]
        assert len(values) == 3 and all(v > 0 for v in values), cells
    if script == "05_sim_vs_real.py":
        busy = re.search(r"busy time (\S+) s vs (\S+) s measured \(([+-]\d+)%\)", out)
        predicted, measured, error = float(busy[1]), float(busy[2]), int(busy[3]) / 100
        assert predicted / measured - 1 == pytest.approx(error, abs=0.015)
