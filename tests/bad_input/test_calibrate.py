"""Calibration refuses what it cannot fit by name: no list of samples or mixes, step times no
measurement has, contexts beyond the model's, a string for a time or a flag, and an empty `free`."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.lab.calibrate import calibrate, calibrate_refined, default_mixes, refined_grid, uncalibrated_gpu
from orca_torch.lab.calibration.measure import check_mixes, max_repeats, measure_steps
from orca_torch.lab.calibration.refined_fit import fit_refined
from orca_torch.lab.calibration.roofline_fit import Calibration, fit
from orca_torch.lab.calibration.samples import StepSample, describe, samples_from_rows, step_kind
from orca_torch.sim.hw_model import GPUSpec, pricer
from orca_torch.model.orca_model import OrcaModel
from orca_torch.specs import get_model_spec

GOOD = samples_from_rows([([SeqWork(1, 9)] * b, 1e-3 * b) for b in range(1, 10)] + [([SeqWork(64)], 5e-3)])


def _synthetic(model: str = "tiny") -> list[StepSample]:
    gpu = GPUSpec("synthetic", 50e9, 8e9, 1e10, flop_efficiency=1.0, bw_efficiency=1.0)
    pr = pricer(model, gpu, overhead_s=1e-3, seq_overhead_s=3e-4)
    return [StepSample(describe(m), StepTotals.of(m), pr.time(StepTotals.of(m))) for m in default_mixes(model)]


@pytest.mark.parametrize("call, says", [
    (lambda: fit(None), "samples must be a list of StepSample items, got None"),
    (lambda: fit(GOOD[0], "tiny"), "samples must be a list of StepSample items, got one StepSample"),
    (lambda: fit_refined(None, "tiny"), "samples must be a list of StepSample items, got None"),
    (lambda: measure_steps("tiny", None), "mixes must be a list of non-empty SeqWork lists, got None"),
    (lambda: measure_steps("tiny", [[SeqWork(4)], [(1, 0)]]), r"mixes\[1\] must hold SeqWork objects only"),
    (lambda: samples_from_rows(None), r"rows must be a list of \(SeqWork list or StepTotals, seconds\) rows"),
    (lambda: samples_from_rows([(5, 0.1)]), "row 0: the step must be a non-empty SeqWork list or a StepTotals"),
    (lambda: samples_from_rows([([SeqWork(4)], 0.1)], label=3), "label must be a str, got 3"),
])
def test_what_is_no_list_is_refused_by_name(call, says):
    with pytest.raises(ValueError, match=says):
        call()


@pytest.mark.parametrize("machine, mem_bytes, says", [
    ("cuda", None, "machine='cuda' is no card with a datasheet here (a100-40gb, a100-80gb, h100, h200) nor this "
                   "host (cpu, mps): give its memory in bytes as mem_bytes"),
    ("H300", None, "machine='H300' is no card with a datasheet here"),     # (a card's name in any case: H200 is one)
    ("", None, "machine must name what the steps ran on ('cpu', or a card such as 'h200'), got ''"),
    (None, None, "machine must name what the steps ran on ('cpu', or a card such as 'h200'), got None"),
    ("h200", 0, "mem_bytes must be a finite number of bytes > 0, got 0"),
    ("cuda", "24e9", "mem_bytes must be a finite number of bytes > 0, got '24e9' (str)"),
])
def test_a_fit_by_hand_refuses_a_machine_it_cannot_name_or_size(machine, mem_bytes, says):
    with pytest.raises(ValueError) as e:
        fit(_synthetic(), machine=machine, mem_bytes=mem_bytes)
    assert str(e.value).startswith(says)


@pytest.mark.parametrize("secs", [1e-300, 1e-13, 1e7, 1e300])
def test_step_times_no_measurement_has_are_refused_not_fitted_with_warnings(secs, recwarn):
    samples = _synthetic()
    bad = samples[:-1] + [StepSample("odd", samples[-1].totals, secs)]
    for f in (fit, fit_refined):
        with pytest.raises(ValueError, match=r"sample 'odd': seconds must be a step time in \[1e-12, 1e\+06\] s"):
            f(bad, "tiny")
    with pytest.raises(ValueError, match=r"row 0: seconds must be a step time in \[1e-12, 1e\+06\] s"):
        samples_from_rows([([SeqWork(4)], secs)])
    assert not recwarn.list


def test_a_string_is_no_step_time():
    with pytest.raises(ValueError, match=r"row 0: seconds must be a finite number > 0, got '0.1' \(str\)"):
        samples_from_rows([([SeqWork(1, 3)], "0.1")])


def test_contexts_beyond_the_models_are_refused():
    far = samples_from_rows([([SeqWork(1, 10**6)], 1e-3)])
    for f in (fit, fit_refined):
        with pytest.raises(ValueError, match=r"read 1000001 K/V tokens, beyond tiny's context of 512 tokens each"):
            f(_synthetic()[:-1] + far, "tiny")
    with pytest.raises(ValueError, match=r"mixes\[0\]\[0\]: .* needs 600 tokens, more than tiny's context 512"):
        measure_steps("tiny", [[SeqWork(600)]], repeats=1)


@pytest.mark.parametrize("call", [
    lambda: refined_grid("mini", "x"),
    lambda: calibrate("tiny", quick="x"), lambda: calibrate_refined("tiny", quick="x"),
    lambda: refined_grid("tiny", 1),
])
def test_quick_is_a_flag(call):
    with pytest.raises(ValueError, match="quick must be True or False, got"):
        call()


@pytest.mark.parametrize("free", [[], (), None])
def test_both_refined_fits_refuse_an_empty_or_odd_free_alike(free):
    says = "free must name distinct refined parameters"
    with pytest.raises(ValueError, match=says):
        fit_refined(GOOD, "tiny", "h100", free=free)
    if free is not None:            # calibrate_refined's None is its default; it refuses before measuring
        with pytest.raises(ValueError, match=says):
            calibrate_refined(OrcaModel("tiny", seed=0), quick=True, repeats=1, free=free)


def test_repeats_are_refused_past_the_context_with_the_most_that_fit():
    mix = [[SeqWork(1, 500), SeqWork(1, 500)]]              # two pooled requests, 500 tokens stored each
    assert max_repeats("tiny", mix) == 11                   # 500 + (11 + 1 warm-up) decodes = 512, tiny's context
    assert max_repeats("tiny", [[SeqWork(5, 0)]]) > 10**18   # fresh prompts only: nothing grows
    with pytest.raises(ValueError, match=r"repeats 12: the mixes' decodes would run past tiny's context 512; "
                                         r"repeats may be at most 11$"):
        measure_steps("tiny", mix, repeats=12)
    assert len(measure_steps("tiny", mix, repeats=11)) == 1


def test_free_may_be_any_collection_of_names():
    from orca_torch.lab.calibration.refined_fit import check_free

    assert sorted(check_free({"overlap", "seq_overhead_s"})) == ["overlap", "seq_overhead_s"]
    assert check_free(np.array(["overlap"])) == ("overlap",)
    for bad in ("overlap", None, [], ["overlap", "overlap"], ["nope"]):
        with pytest.raises(ValueError, match="free must name distinct refined parameters among"):
            check_free(bad)


def test_measure_steps_and_both_calibrations_refuse_before_they_build_a_model(monkeypatch):
    def built(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(OrcaModel, "__init__", built)
    for kw, says in ((dict(repeats=0), "repeats must be an integer >= 1, got 0"),
                     (dict(mixes=[[SeqWork(9000)]]), r"mixes\[0\]\[0\]: .* more than llama-3-8b's context 8192"),
                     (dict(seed=-1), "seed must be an integer")):
        with pytest.raises(ValueError, match=says):
            measure_steps("llama-3-8b", **{"mixes": [[SeqWork(4)]], **kw})
    for kw, says in ((dict(quick="x"), "quick must be True or False, got 'x'"),
                     (dict(free=[]), "free must name distinct refined parameters")):
        with pytest.raises(ValueError, match=says):
            calibrate_refined("llama-3-8b", **kw)
    for f in (calibrate, calibrate_refined):      # the grid's checks too, before a model is built
        for kw, says in ((dict(repeats=0), "repeats must be an integer >= 1, got 0"),
                         (dict(repeats=10**6), "repeats 1000000: the mixes' decodes would run past mini's context"),
                         (dict(gpu="nope"), "unknown GPU 'nope'"),
                         (dict(mixes=[[SeqWork(9000)]]), r"mixes\[0\]\[0\]: .* more than mini's context 2048"),
                         (dict(mixes=[]), "mixes must be a non-empty list")):
            if f is calibrate_refined and "mixes" in kw or f is calibrate and "gpu" in kw:
                continue
            with pytest.raises(ValueError, match=says):
                f("mini", **kw)
    for f in (calibrate, calibrate_refined, measure_steps):       # the presets the torch model builds, only
        for model, says in (("foo", "unknown model preset 'foo'; known presets: llama-3-8b, mini, tiny (the "
                                    "Llama-style ones, which the torch model builds)"),
                            ("gpt3-13b", "OrcaModel builds Llama-style specs only"),
                            (5, "model must be an OrcaModel or ModelSpec or str, got 5")):
            with pytest.raises(ValueError) as e:
                f(model, mixes=[[SeqWork(4)]]) if f is measure_steps else f(model)
            assert str(e.value).startswith(says)
    from orca_torch.lab.calibration.refined_fit import _FITTABLE
    from orca_torch.specs import get_model_spec

    short = dataclasses.replace(get_model_spec("tiny"), max_context=1024)   # its quick grid: 9 fitted steps
    with pytest.raises(ValueError, match="need at least 10 measured steps to fit 9 parameters, got 9"):
        calibrate_refined(short, quick=True, free=_FITTABLE)


def test_a_model_other_than_the_samples_own_is_refused():
    tiny, mini = [dataclasses.replace(s, spec=get_model_spec("tiny")) for s in _synthetic()], get_model_spec("mini")
    for f in (fit, fit_refined):
        with pytest.raises(ValueError, match="model='mini', but the samples were measured on tiny"):
            f(tiny, "mini")
        with pytest.raises(ValueError, match=r"the samples were measured on different models \(mini, tiny\)"):
            f(tiny[:-1] + [dataclasses.replace(tiny[-1], spec=mini)])


def test_a_model_of_the_samples_name_but_other_shapes_is_told_apart():
    """Samples of a model converted to bfloat16, fitted on its preset: the refusal said 'model='tiny', but
    the samples were measured on tiny'."""
    half = get_model_spec("tiny").with_dtype_bytes(2)
    samples = [dataclasses.replace(s, spec=half) for s in _synthetic()]
    for f in (fit, fit_refined):
        with pytest.raises(ValueError, match=r"model='tiny' \(dtype_bytes=4\), but the samples were measured on "
                                             r"tiny \(dtype_bytes=2\); give that model"):
            f(samples, "tiny")
        with pytest.raises(ValueError, match=r"measured on different models \(tiny \(dtype_bytes=2\), tiny "
                                             r"\(dtype_bytes=4\)\)"):
            f(samples[:-1] + [dataclasses.replace(samples[-1], spec=get_model_spec("tiny"))])
    assert fit(samples).model == half


@pytest.mark.parametrize("call, says", [
    (lambda: Calibration("tiny", -1.0, 1e9, 0.0, 0.0), r"peak_flops must be a finite number of FLOP/s > 0, got -1.0"),
    (lambda: Calibration("tiny", 1e9, float("nan"), 0.0, 0.0), "mem_bw must be a finite number of bytes/s > 0"),
    (lambda: Calibration("tiny", 1e9, 1e9, -1e-3, 0.0), "overhead_s must be a finite number of seconds >= 0"),
    (lambda: Calibration("tiny", 1e9, 1e9, 0.0, True), r"seq_overhead_s must be .* got True \(a bool\)"),
    (lambda: Calibration(3, 1e9, 1e9, 0.0, 0.0), "model must be a preset name or a ModelSpec"),
    (lambda: Calibration("tiny", 1e9, 1e9, 0.0, 0.0, machine=""), "machine must name what the steps ran on"),
    (lambda: Calibration("tiny", 1e9, 1e9, 0.0, 0.0, machine=None), r"\('cpu', or a card such as 'h200'\), got None"),
    (lambda: describe([1]), "mix must hold SeqWork objects only; item 0 is 1"),
    (lambda: describe(None), "mix must be a list of SeqWork objects, got None"),
    (lambda: max_repeats("tiny", [[(1, 0)]]), r"mixes\[0\] must hold SeqWork objects only"),
    (lambda: uncalibrated_gpu("gpu0"), "unknown device 'gpu0'"),
    (lambda: fit_refined(GOOD, "tiny", "h100", max_iter=1).rel_errors([1]), "samples must be StepSample items"),
])
def test_calibration_helpers_refuse_at_the_door(call, says):
    with pytest.raises(ValueError, match=says):
        call()


def test_a_calibration_takes_a_presets_name():
    cal = Calibration("tiny", 1e9, 1e9, 0.0, 0.0)
    assert cal.model == get_model_spec("tiny") and cal.predict([SeqWork(4)]) > 0
    assert check_mixes("tiny", [[SeqWork(4)]], 1) == [[SeqWork(4)]]


def test_a_calibration_s_not_identified_names_its_own_rates():
    with pytest.raises(ValueError, match="not_identified names rates of this calibration, peak_flops and mem_bw; "
                                         "got 'bandwidth'"):
        Calibration("mini", 1e9, 1e9, 0.0, 0.0, not_identified=("bandwidth",))
    with pytest.raises(ValueError, match="not_identified must hold str objects only; item 0 is"):
        Calibration("mini", 1e9, 1e9, 0.0, 0.0, not_identified=(1,))


def test_a_step_measured_again_counts_once_toward_enough_steps():
    """Repeats of a few steps are as many equations as the steps: 8 samples of one decode would leave a
    refined fit's 6 parameters free, and 4 samples of two steps the roofline fit's 4."""
    one = samples_from_rows([([SeqWork(1, 31)] * 4, 0.01)] * 8)
    with pytest.raises(ValueError, match="need at least 7 measured steps to fit 6 parameters, got 1 distinct "
                                         r"\(8 samples, some of the same step\)"):
        fit_refined(one, "mini")
    two = samples_from_rows([([SeqWork(1, 31)] * 4, 0.01), ([SeqWork(64)], 0.03)] * 2)
    with pytest.raises(ValueError, match="need at least 4 measured steps to fit 4 parameters .*, got 2 distinct"):
        fit(two, "mini")


@pytest.mark.parametrize("call", [calibrate, calibrate_refined])
def test_a_device_other_than_the_given_models_is_refused(call):
    """A model built on the CPU is not moved by device="cuda": measuring it there anyway would
    calibrate another machine than the one asked for."""
    model = OrcaModel("tiny", seed=0, device="cpu")
    with pytest.raises(ValueError, match=r"device='cuda' but the model lives on cpu"):
        call(model, repeats=1, device="cuda")


@pytest.mark.parametrize("call", [calibrate, calibrate_refined, measure_steps])
@pytest.mark.parametrize("given", [False, True])
def test_an_empty_device_is_refused_not_read_as_the_cpu(call, given):
    """device="" names no device: it is refused as one, whether the model is a preset's name (it was
    built on the CPU without a word) or an `OrcaModel` (torch's RuntimeError)."""
    model = OrcaModel("tiny", seed=0, device="cpu") if given else "tiny"
    args = (model, [[SeqWork(4)]]) if call is measure_steps else (model,)
    with pytest.raises(ValueError, match="^unknown device ''; allowed: cpu, cuda or cuda:N$"):
        call(*args, repeats=1, device="")


def test_quick_with_mixes_given_is_refused():
    """quick only picks the default mixes: with mixes given it would do nothing, though asked for."""
    with pytest.raises(ValueError, match="quick=True picks the quick default_mixes, but mixes were given"):
        calibrate("mini", [[SeqWork(16)]], quick=True)


def test_a_refined_calibrations_grid_is_two_lists_of_mixes_checked_before_a_model_is_built(monkeypatch):
    """`grid` (fit mixes, held-out mixes) stands in for `refined_grid`: quick with it would do nothing,
    though asked for; a grid of another shape, or one the fit or the model's context cannot take, is
    refused by name before the model is built."""
    def built(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(OrcaModel, "__init__", built)
    fit_m, held_m = refined_grid("mini")
    for kw, says in ((dict(quick=True, grid=(fit_m, held_m)), "quick=True picks the quick refined_grid, but a grid "
                                                                "was given"),
                     (dict(grid=fit_m), r"grid must be \(fit mixes, held-out mixes\), two lists of SeqWork lists"),
                     (dict(grid=(fit_m, None)), r"grid\[1\] must be a list of SeqWork lists, got None"),
                     (dict(grid=(fit_m, [SeqWork(4)])), r"grid\[1\]\[0\] must be a list of SeqWork objects"),
                     (dict(grid=([[SeqWork(16)]], held_m)), "need at least 7 measured steps to fit 6 parameters"),
                     (dict(grid=(fit_m, [[SeqWork(9000)]])), r"mixes\[\d+\]\[0\]: .* more than mini's context 2048")):
        with pytest.raises(ValueError, match=says):
            calibrate_refined("mini", **kw)


def test_steps_of_one_arithmetic_intensity_are_refused_by_what_they_lack():
    """Four steps of two requests, 8 new tokens and 14 K/V tokens read, split differently among the two:
    distinct steps, but the same FLOPs (attention's full rectangle) and bytes, so no split into memory- and
    compute-bound steps exists and the FLOP rate cannot be told from the bandwidth. The refusal says so,
    where it said only that the data admitted no fit with a positive FLOP rate and bandwidth."""
    splits = [[SeqWork(1, 6), SeqWork(7, 0)], [SeqWork(2, 5), SeqWork(6, 1)], [SeqWork(3, 4), SeqWork(5, 2)],
              [SeqWork(4, 0), SeqWork(4, 6)]]
    samples = samples_from_rows([(m, 1e-3 * (1 + i / 10)) for i, m in enumerate(splits)])
    with pytest.raises(ValueError, match=r"every step has the same arithmetic intensity \(\d+\.?\d* FLOPs per byte\), "
                                         "so the fit cannot tell the FLOP rate from the bandwidth"):
        fit(samples, "mini")


def test_a_refined_fit_saved_to_an_empty_path_is_told_the_path_is_empty(tmp_path, monkeypatch):
    """Path('') is '.': `save('')` said "a GPU profile is a .json file, got '.'", a path not given."""
    monkeypatch.chdir(tmp_path)
    f = fit_refined(_synthetic(), "tiny", "h100", max_iter=1)
    with pytest.raises(ValueError, match=r"^path is empty; give the GPU profile's \.json file name, such as "
                                         r"'profile\.json'$"):
        f.save("")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("what", [StepTotals.of([SeqWork(8)]), [SeqWork(1, 9)], None])
def test_step_kind_takes_a_step_sample_only(what):
    with pytest.raises(ValueError, match=r"^sample must be a StepSample, got "):
        step_kind(what)
