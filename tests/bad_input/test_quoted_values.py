"""A public door that refuses a value of unknown size quotes it in a line (`checks.brief`): a list or a
dict of a million items is written to its first few (its whole repr went into the message before), and
so is the req_id that names the request a refusal is about, and a setting refused as doing nothing."""
from __future__ import annotations

import pytest

from clipper import Exp4
from clipper.profile import check_batch_sizes
from orca_torch.core.request import Request
from orca_torch.lab import api
from orca_torch.lab.calibration.samples import samples_from_rows
from orca_torch.lab.metrics import quantiles
from orca_torch.lab.report import spread
from orca_torch.sim.hw_model.gpus import get_gpu
from orca_torch.specs import get_model_spec

MILLION = 10**6


@pytest.mark.parametrize("call, says", [
    (lambda: spread([1.0] * MILLION + [None]),
     "values must be a non-empty list of numbers (one per seed), got [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, "
     "1.0, 1.0, 1.0, ...]"),
    (lambda: check_batch_sizes([4] * MILLION + [0]), ", or a list or array of them, got [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, "
                                                     "4, 4, ...]"),
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
    (lambda: quantiles([1.0], "0.5" * MILLION),
     "qs must be a list of quantiles in [0, 1] (e.g. [0.5, 0.99]), got '0.50.50.50.50.50.50.50.50.50.50.50.50....50.50.50.50.50.50.50.50.50.50.50.50.5'"),
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
        "model", "gpu", "rows", "qs", "req_id", "req_id_context", "req_id_twice", "refused_setting", "goodput_rate"])
def test_a_refused_value_of_a_million_items_is_quoted_in_a_line(call, says):
    with pytest.raises(ValueError) as e:
        call()
    assert says in str(e.value) and len(str(e.value)) < 400
