"""Bad input gets a clear error saying what was wrong and what is allowed, before any state changes
or any output is printed (the project standard). One block per defect a review found."""
from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from orca_torch import api
from orca_torch.batch import SeqWork
from orca_torch.hw_model import kv_capacity_tokens, memory_plan
from orca_torch.hw_model.__main__ import main as hw_main
from orca_torch.kv_manager import KVManager
from orca_torch.model import OrcaModel
from orca_torch.report import demos_arg, device_arg, run_experiment
from orca_torch.request import Request
from orca_torch.specs import get_model_spec
from orca_torch.workload import (chat, check_seed, long_context, make_workload, orca_synthetic, with_predictions,
                                 with_prompt_ids)

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((ROOT / "experiments").glob("[0-9][0-9]_*.py"))


def _load(script: Path):
    spec = importlib.util.spec_from_file_location(f"exp_{script.stem}", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- 1. --seed -1 and negative seeds in the API ---------------------------------------------------

@pytest.mark.parametrize("script", EXPERIMENTS, ids=lambda p: p.stem)
def test_every_experiment_refuses_a_negative_seed_before_running(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--seed", "-1", "--quick", "--json"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(script), run_name="__main__")
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""                                            # nothing ran
    assert "argument --seed: must be an integer >= 0, got -1" in out.err


def test_seed_flag_accepts_zero_and_up_and_rejects_text(capsys):
    seen = []
    run_experiment("t", lambda args, rep: seen.append(args.seed), argv=["--seed", "7"])
    run_experiment("t", lambda args, rep: seen.append(args.seed), argv=[])
    assert seen == [7, 0]
    with pytest.raises(SystemExit):
        run_experiment("t", lambda args, rep: seen.append(args.seed), argv=["--seed", "1.5"])
    assert "must be an integer >= 0, got '1.5'" in capsys.readouterr().err and seen == [7, 0]


@pytest.mark.parametrize("seed", [-1, True, 1.5, "3", None])
def test_api_and_generators_refuse_a_bad_seed(seed):
    calls = [lambda: api.simulate("orca", 1.0, 5, seed=seed), lambda: api.run("chat", 1.0, 5, seed=seed),
             lambda: api.goodput("orca", n_requests=5, seed=seed),
             lambda: chat(5, seed=seed), lambda: long_context(5, seed=seed), lambda: orca_synthetic(5, seed=seed),
             lambda: make_workload("orca", 5, seed=seed),
             lambda: with_predictions(orca_synthetic(3), 0.5, seed=seed),
             lambda: with_prompt_ids(orca_synthetic(3), 100, seed=seed)]
    for call in calls:
        with pytest.raises(ValueError, match=r"seed must be an integer >= 0, got"):
            call()


def test_numpy_integer_seeds_are_plain_seeds():
    assert check_seed(np.int64(4)) == 4 and type(check_seed(np.int64(4))) is int
    a, b = orca_synthetic(20, seed=np.int32(4)), orca_synthetic(20, seed=4)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in a] == \
           [(r.arrival_s, r.prompt_len, r.output_len) for r in b]
    assert orca_synthetic(20, seed=5)[1].arrival_s != b[1].arrival_s


# ---- 2. experiment 01: --device checked up front; one JSON shape for the real profiles ---------------

@pytest.fixture(scope="module")
def exp01():
    return _load(ROOT / "experiments" / "01_clipper_real.py")


@pytest.mark.parametrize("device, says", [
    ("bogus", "unknown device 'bogus'; allowed: cpu, cuda or cuda:N"),
    ("meta", "device type 'meta' is not supported here; allowed: cpu, cuda or cuda:N"),
    ("cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}", "asked for, but"),
])
def test_exp01_bad_device_fails_before_any_demo(exp01, device, says, capsys):
    ran = []
    with pytest.raises(SystemExit) as exc:
        run_experiment("01", lambda args, rep: ran.append(1), argv=["--device", device, "--json"], flags=("device",))
    assert exc.value.code == 2 and ran == []
    err = capsys.readouterr().err
    assert "argument --device" in err and says in err
    assert device_arg("cpu") == "cpu"


def test_exp01_profile_json_has_one_shape_whether_or_not_noise_hides_a_slope(exp01, monkeypatch):
    import argparse

    import clipper.torch_models as tm
    from orca_torch.report import Report

    sizes = np.repeat([1, 64, 256], 5).astype(float)

    def fake_measure(model_name, batch_sizes, reps, seed):
        # 'mlp' gets latencies that fall with the batch: every fit raises (slope hidden by noise)
        lat = 5.0 - 0.001 * sizes if model_name == "mlp" else 0.2 + 0.01 * sizes
        return tm.MeasuredProfile(model_name, sizes, lat)

    monkeypatch.setattr(tm, "make_model", lambda name, seed, device: name)
    monkeypatch.setattr(tm, "measure_profile", fake_measure)
    profiles = exp01.real_profiles(argparse.Namespace(quick=True, seed=0), Report(as_json=True), "cpu")
    shapes = {name: {key: sorted(p[key]) for key in ("mean", "median", "p90")} for name, p in profiles.items()}
    keys = ["a_ms", "b_ms", "slope_hidden_by_noise"]
    assert all(s == {"mean": keys, "median": keys, "p90": keys} for s in shapes.values())
    hidden, shown = profiles["mlp"]["median"], profiles["token-mlp"]["median"]
    assert hidden == {"a_ms": None, "b_ms": None, "slope_hidden_by_noise": True}
    assert profiles["mlp"]["fixed_share_at_32"] is None
    assert shown["slope_hidden_by_noise"] is False
    assert shown["a_ms"] == pytest.approx(0.2) and shown["b_ms"] == pytest.approx(0.01)
    assert profiles["token-mlp"]["fixed_share_at_32"] == pytest.approx(0.2 / (0.2 + 32 * 0.01))


# ---- 3. an explicit K/V budget must fit beside the weights ------------------------------------------

def test_kv_budget_larger_than_the_card_is_refused_with_both_numbers():
    with pytest.raises(ValueError) as exc:
        memory_plan("llama-3-8b", "h100", kv_budget_bytes=1000 * 2**30)
    msg = str(exc.value)
    assert "1073.74 GB (1000.00 GiB)" in msg and "16.06 GB of weights" in msg and "h100 has 80 GB" in msg
    assert "at most 63.94 GB" in msg
    with pytest.raises(ValueError, match="the weights alone do not fit: raise tp or pp"):
        kv_capacity_tokens("gpt3-175b", "h100", kv_budget_bytes=2**30)
    with pytest.raises(ValueError, match="kv_budget_bytes must be a positive number"):
        memory_plan("llama-3-8b", "h100", kv_budget_bytes=True)


def test_kv_budget_that_exactly_fills_the_card_is_accepted():
    plan = memory_plan("llama-3-8b", "h100")
    room = 80e9 - plan.weight_bytes_per_device
    full = memory_plan("llama-3-8b", "h100", kv_budget_bytes=room)
    assert full.kv_tokens == int(room // get_model_spec("llama-3-8b").kv_bytes_per_token)
    with pytest.raises(ValueError):
        memory_plan("llama-3-8b", "h100", kv_budget_bytes=room + 1)
    # under tp=2 each card holds half the weights, so the same budget fits
    assert memory_plan("llama-3-8b", "h100", tp=2, kv_budget_bytes=room + 1).kv_tokens > full.kv_tokens


def test_hw_model_cli_exits_2_on_an_impossible_kv_budget(capsys):
    with pytest.raises(SystemExit) as exc:
        hw_main(["--kv-budget-gib", "1000"])
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and "does not fit beside llama-3-8b's 16.06 GB of weights" in out.err


# ---- 4. KVManager.reserve refuses a bool ---------------------------------------------------------

def test_reserve_refuses_a_bool_and_changes_nothing():
    kv = KVManager(get_model_spec("tiny"), 8)
    for n in (True, False, 2.0):
        with pytest.raises(ValueError, match=r"n_tokens must be an integer >= 1 \(not a bool\)"):
            kv.reserve("a", n)
    assert not kv.has("a") and kv.slots_reserved == 0 and kv.n_requests == 0
    with pytest.raises(ValueError, match="n_slots must be an integer"):
        KVManager(get_model_spec("tiny"), True)
    kv.reserve("a", 1)
    assert kv.reserved("a") == 1


# ---- 5. token ids must be integers ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny() -> OrcaModel:
    return OrcaModel("tiny", seed=0)


@pytest.mark.parametrize("path", ["forward_batch", "forward_padded"])
@pytest.mark.parametrize("ids", [torch.tensor([3.0, 4.0, 5.7]), [3.0, 4.0, 5.0], torch.tensor([True, False, True])],
                         ids=["float-tensor", "float-list", "bool-tensor"])
def test_float_or_bool_token_ids_are_refused_before_kv_is_written(tiny, path, ids):
    kv = tiny.new_kv(8)
    kv.reserve("r", 8)
    before = kv.storage("r").clone()
    with pytest.raises(ValueError, match=r"token_ids must have an integer dtype \(e\.g\. torch\.long\), got torch\."):
        getattr(tiny, path)(ids, [SeqWork(3, 0)], ["r"], kv)
    assert kv.length("r") == 0 and kv.slots_used == 0 and torch.equal(kv.storage("r"), before)


def test_any_integer_dtype_gives_the_long_result(tiny):
    out = []
    for ids in (torch.tensor([3, 4, 5]), torch.tensor([3, 4, 5], dtype=torch.int32), [3, 4, 5],
                np.array([3, 4, 5], dtype=np.int16)):
        kv = tiny.new_kv(3)
        kv.reserve(0, 3)
        out.append(tiny.forward_batch(ids, [SeqWork(3, 0)], [0], kv))
        assert kv.length(0) == 3
    assert all(torch.equal(o, out[0]) for o in out)


# ---- 6. predictor_sigma only with order="spf" -------------------------------------------------------

def test_predictor_sigma_without_spf_is_an_error():
    with pytest.raises(ValueError, match=r"predictor_sigma=0.5 only applies to order='spf'.*order='fcfs'.*"
                                         r"leave predictor_sigma=None"):
        api.simulate("orca", 1.0, 5, predictor_sigma=0.5)
    with pytest.raises(ValueError, match="only applies to order='spf'"):
        api.run("orca", 1.0, 5, order="fcfs", predictor_sigma=0.0)
    m_oracle = api.simulate("orca", 2.0, 30, order="spf")                  # None: the oracle
    m_zero = api.simulate("orca", 2.0, 30, order="spf", predictor_sigma=0.0)
    assert m_oracle.ttft_mean_s == m_zero.ttft_mean_s and m_zero.n_requests == 30


# ---- 7. Request lengths: numpy integers yes, floats and bools no ------------------------------------

def test_request_accepts_numpy_integers_as_plain_ints():
    r = Request(0, np.float32(0.5), np.int64(3), np.int32(2), max_tokens=np.uint16(8), predicted_output=np.int64(2))
    assert (r.prompt_len, r.output_len, r.max_tokens, r.total_len) == (3, 2, 8, 5)
    assert all(type(v) is int for v in (r.prompt_len, r.output_len, r.max_tokens))
    assert type(r.arrival_s) is float and type(r.predicted_output) is float


@pytest.mark.parametrize("bad", [3.0, np.float64(3.0), True, np.bool_(True), "3", 0, np.int64(-2)])
def test_request_refuses_non_integer_lengths_saying_what_is_allowed(bad):
    with pytest.raises(ValueError, match=r"prompt_len must be an integer >= 1 \(a Python or numpy integer; "
                                         r"not a float or bool\), got"):
        Request(0, 0.0, bad, 1)
    with pytest.raises(ValueError, match="output_len must be an integer >= 1"):
        Request(0, 0.0, 1, bad)
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        Request(0, 0.0, 1, 1, max_tokens=True if bad is True else 3.0)


# ---- 8. experiment 02: --demos must name at least one demo --------------------------------------------

@pytest.mark.parametrize("value, says", [("", "argument --demos: is empty"),
                                         ("1,,2", "empty demo number in '1,,2'"),
                                         ("9", "no demo 9"), ("x", "got 'x'")])
def test_exp02_bad_demos_fail_before_any_demo(value, says, capsys):
    mod = _load(ROOT / "experiments" / "02_selective_batching.py")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--json", "--demos", value])
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and says in out.err and "demo numbers in 1..4" in out.err
    assert demos_arg(4)("2,1,2") == [1, 2]
    with pytest.raises(SystemExit):
        mod.main(["--threads", "0"])
    assert "argument --threads: must be an integer >= 1, got '0'" in capsys.readouterr().err
