"""A public door that refuses a value of unknown size quotes it in a line (`checks.brief`): a list or a
dict of a million items is written to its first few (its whole repr went into the message before), and
so is the req_id that names the request a refusal is about, and a setting refused as doing nothing.
So are a name, a text or a key given anywhere else: a command-line value, a field of a file read, what
a policy, an executor or a size function of the caller's returned."""
from __future__ import annotations

import argparse
import json

import pytest

from clipper import Exp4, PredictionCache
from clipper.profile import check_batch_sizes
from clipper.straggler import answer_at_deadline
from orca_torch.core.engine import Engine
from orca_torch.core.memory import UnlimitedMemory
from orca_torch.core.request import Request
from orca_torch.core.scheduler import Scheduler
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.lab import api
from orca_torch.lab.calibration.samples import StepSample, check_samples, samples_from_rows
from orca_torch.lab.cli_args import count_arg, json_out_arg
from orca_torch.lab.report import spread
from orca_torch.lab.workload import make_workload
from orca_torch.model.hf_llama import spec_from_hf_config
from orca_torch.sim.executors import StepTimeExecutor
from orca_torch.sim.hw_model.cost import pricer_for
from orca_torch.sim.hw_model.gpus import FORMAT, get_gpu, load_profile
from orca_torch.specs import get_model_spec
from clocks import iteration_clock

MILLION = 10**6


@pytest.mark.parametrize("call, says", [
    (lambda: spread([1.0] * MILLION + [None]),
     "values must be a non-empty list of numbers (one per seed), got [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, "
     "1.0, 1.0, 1.0, ...]"),
    (lambda: check_batch_sizes([4] * MILLION + [0]), ", or a list or array of them (not bools), got [4, 4, 4, 4, 4, 4, "
                                                     "4, 4, 4, 4, 4, 4, ...]"),
    (lambda: Request(0, 0.0, 3, 3, stop_token_ids=[1] * MILLION),
     "request 0: stop_token_ids must be a tuple of token ids (integers >= 0), got [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, "
     "1, ...]"),
    (lambda: api.simulate(workload=dict.fromkeys(range(MILLION), 1)), "or a list of Request objects, got {0: 1, 1: 1, "
                                                                      "2: 1, 3: 1, ...}"),
    (lambda: Exp4(2).combine(dict.fromkeys(range(MILLION), 0.5)),
     "predictions must be a list of one prediction (or None) per model (2), got {0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5, ...}"),
    (lambda: Request(0, [0.0] * MILLION, 3, 3),
     "request 0: arrival_s must be a finite number >= 0, got [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "
     "0.0, ...]"),
    (lambda: Request(0, 0.0, 3, 3, min_tokens=[1] * MILLION),
     "request 0: min_tokens must be an integer in [0, output_len = 3], got [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, ...]"),
    (lambda: api.simulate(n_requests=5, order=["fcfs"] * MILLION),
     "order must be 'fcfs' or 'spf' (shortest predicted first), got ['fcfs', 'fcfs', 'fcfs', 'fcfs', 'fcfs', "
     "'fcfs', 'fcfs', 'fcfs', 'fcfs', 'fcfs', 'fcfs', 'fcfs', ..."),
    (lambda: get_model_spec((0,) * MILLION),
     "model must be a preset name or a ModelSpec, got (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, ...) (tuple); known presets"),
    (lambda: get_gpu((0,) * MILLION),
     "gpu must be a GPUSpec, a name or a profile path, got (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, ...); known GPUs"),
    (lambda: samples_from_rows([[0] * MILLION]),
     "row 0 must be (SeqWork list or StepTotals, seconds), got [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, ...]"),
    (lambda: Request("r" * MILLION, 0.0, 0, 3), f"request '{'r' * 37}...{'r' * 38}': prompt_len must be an integer"),
    (lambda: api.simulate(workload=[Request(("r",) * MILLION, 0.0, 10**5, 3)]),
     "request ('r', 'r', 'r', 'r', 'r', 'r', 'r', 'r', 'r', 'r', 'r', 'r', ...): prompt_len + output_len"),
    (lambda: api.simulate(workload=[Request("r" * MILLION, 0.0, 3, 3), Request("r" * MILLION, 0.0, 3, 3)]),
     f"duplicate req_id '{'r' * 37}...{'r' * 38}'"),
    (lambda: api.simulate(workload=[Request(0, 0.0, 3, 3)], rate=[1.0] * MILLION),
     "rate=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, ...]: a request list keeps its own arrivals"),
    (lambda: api.goodput(rate=[1.0] * MILLION),
     "rate=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, ...]: goodput searches the rate itself"),
], ids=["spread", "batch_sizes", "stop_token_ids", "workload", "predictions", "arrival_s", "min_tokens", "order",
        "model", "gpu", "rows", "req_id", "req_id_context", "req_id_twice", "refused_setting", "goodput_rate"])
def test_a_refused_value_of_a_million_items_is_quoted_in_a_line(call, says):
    with pytest.raises(ValueError) as e:
        call()
    assert says in str(e.value) and len(str(e.value)) < 400


LONG = "x" * MILLION
CUT = f"'{'x' * 37}...{'x' * 38}'"
"""A text of a million characters as a refusal quotes it: its first and last few."""


class ByAList(Scheduler):
    """Orders the queue by a list of a million numbers, not a tuple."""
    def queue_key(self, req):
        return [req.prompt_len] * MILLION


@pytest.mark.parametrize("call, error, says", [
    (lambda: get_model_spec(LONG), ValueError, f"unknown model preset {CUT}; known presets"),
    (lambda: get_gpu(LONG), ValueError, f"unknown GPU {CUT}; known GPUs"),
    (lambda: make_workload(LONG), ValueError, f"unknown workload {CUT}; known"),
    (lambda: make_workload("chat", **{LONG: 1}), ValueError, f"workload 'chat' has no setting {CUT}; its own"),
    (lambda: api.simulate(**{LONG: 1}), TypeError, f"unknown option {CUT}; the options are"),
    (lambda: api.simulate(n_requests=5, predictor_sigma=[0.5] * MILLION), ValueError,
     "predictor_sigma=[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, ...] only applies to order='spf'"),
    (lambda: pricer_for("tiny", "h100", {"x": [0] * MILLION}), ValueError,
     "unknown setting 'x'=[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, ...]; allowed"),
    (lambda: pricer_for("tiny", "h100", {LONG: 1}), ValueError, f"unknown setting {CUT}=1; allowed"),
    (lambda: count_arg("1" * MILLION), argparse.ArgumentTypeError,
     f"must be an integer >= 1, got '{'1' * 37}...{'1' * 38}'"),
    (lambda: json_out_arg(LONG), argparse.ArgumentTypeError, f"must be a .json file path, got {CUT}"),
    (lambda: spec_from_hf_config({"model_type": LONG}), ValueError, f"), got model_type {CUT}"),
    (lambda: spec_from_hf_config({"model_type": "llama", "max_position_embeddings": 64, "hidden_act": ["x"] * MILLION}),
     ValueError, "hidden_act=['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', ...]: OrcaModel's MLP"),
    (lambda: Engine(StepTimeExecutor(lambda t: [0.0] * MILLION, max_context=64), UnlimitedMemory(),
                    SchedulerConfig(max_bs=2)).run([Request(0, 0.0, 4, 3)]), RuntimeError,
     "the executor returned [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, ...] (list) as a step"),
    (lambda: Engine(iteration_clock(), UnlimitedMemory(), SchedulerConfig(max_bs=2), scheduler=ByAList,
                    max_context=64).run([Request(i, 0.0, 8, 4) for i in range(3)]), RuntimeError,
     "ByAList.queue_key gave [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, ...] (list) for request 0: a queue key"),
    (lambda: check_samples([StepSample(LONG, None, 1.0)]), ValueError, f"sample {CUT}: the step's totals"),
    (lambda: answer_at_deadline([LONG, LONG], [1.0, 2.0], [1.0, 1.0], 5.0, Exp4(2), 0.0), ValueError,
     f"two models are named {CUT}: an answer"),
    (lambda: PredictionCache(100, size_of=lambda v: [1] * MILLION).put("m", 1, "y"), ValueError,
     "but it returned [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, ...] for a value of type str"),
], ids=["preset", "gpu", "workload", "workload_setting", "option", "predictor_sigma", "pricer_setting",
        "pricer_setting_name", "cli_int",
        "cli_json", "hf_model_type", "hf_hidden_act", "step_duration", "queue_key", "sample_label", "model_names",
        "size_of"])
def test_a_refused_name_text_or_answer_of_a_million_is_quoted_in_a_line(call, error, says):
    with pytest.raises(error) as e:
        call()
    assert says in str(e.value) and len(str(e.value)) < 600


def test_a_gpu_profile_s_fields_of_a_million_are_quoted_in_a_line(tmp_path):
    """A profile is a file anyone may hand over: its version, or its keys, may be a million long. Its
    unknown keys and its GPUSpec fields are quoted alike (the fields were a Python list)."""
    for doc, says in (({"version": [0] * MILLION}, "profile version [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, ...] is not"),
                      ({"version": 1, **{f"k{i:07}": 0 for i in range(MILLION)}},
                       "unknown key(s) 'k0000000', 'k0000001', 'k0000002', 'k0000003', 'k0000004', 'k0000005', "
                       "'k0000006', 'k0000007', 'k0000008', 'k0000009', 'k0000010', 'k0000011', ...; a profile holds"),
                      ({"version": 1, "gpu": {"name": "x", "peak_flops": 1, "mem_bw": 1,
                                              **{f"f{i:07}": 0 for i in range(MILLION)}}},
                       "bad GPUSpec fields (unknown: 'f0000000', 'f0000001', 'f0000002', 'f0000003', 'f0000004', "
                       "'f0000005', 'f0000006', 'f0000007', 'f0000008', 'f0000009', 'f0000010', 'f0000011', ..., "
                       "missing: 'mem_bytes')")):
        path = tmp_path / "profile.json"
        path.write_text(json.dumps({"format": FORMAT, **doc}))
        with pytest.raises(ValueError) as e:
            load_profile(path)
        assert says in str(e.value) and len(str(e.value)) < 600
