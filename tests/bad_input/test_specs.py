"""`ModelSpec` and `RopeScaling` fields, and the works a step is priced from (`specs.py`)."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.specs import RopeScaling, get_model_spec

TINY = get_model_spec("tiny")


@pytest.mark.parametrize("field, value, says", [
    ("n_layers", True, r"ModelSpec\.n_layers must be an integer >= 1, got True \(a bool\)"),
    ("hidden", 64.0, r"ModelSpec\.hidden must be an integer >= 1, got 64\.0"),
    ("n_heads", 0, r"ModelSpec\.n_heads must be an integer >= 1, got 0"),
    ("dtype_bytes", "4", r"ModelSpec\.dtype_bytes must be an integer >= 1, got '4' \(str\)"),
    ("name", 3, r"ModelSpec\.name must be a str, got 3"),
    ("mlp", "relu", r"unknown ModelSpec\.mlp 'relu'; choose one of 'swiglu', 'gelu'"),
    ("norm", None, r"unknown ModelSpec\.norm None; choose one of 'rmsnorm', 'layernorm'"),
    ("tied_embeddings", 1, r"ModelSpec\.tied_embeddings must be True or False, got 1"),
    ("learned_positions", "no", r"ModelSpec\.learned_positions must be True or False, got 'no'"),
    ("bias", None, r"ModelSpec\.bias must be True or False, got None"),
    ("rope_theta", -1.0, r"ModelSpec\.rope_theta must be a finite number > 0, got -1\.0"),
    ("rope_theta", math.nan, r"ModelSpec\.rope_theta must be a finite number > 0, got nan"),
    ("rope_theta", "x", r"ModelSpec\.rope_theta must be a finite number > 0, got 'x' \(str\)"),
    ("norm_eps", "x", r"ModelSpec\.norm_eps must be a finite number > 0, got 'x' \(str\)"),
    ("norm_eps", True, r"ModelSpec\.norm_eps must be a finite number > 0, got True \(a bool\)"),
    ("rope_scaling", {}, r"ModelSpec\.rope_scaling must be a RopeScaling or None, got \{\} \(dict\)"),
])
def test_every_model_spec_field_is_checked(field, value, says):
    with pytest.raises(ValueError, match=says):
        replace(TINY, **{field: value})


def test_numpy_numbers_are_taken_and_stored_as_python_ones():
    spec = replace(TINY, n_layers=np.int64(2), hidden=np.int32(64), rope_theta=np.float32(1e4),
                   norm_eps=np.float64(1e-5), tied_embeddings=np.bool_(True))
    assert spec == replace(TINY, tied_embeddings=True)
    assert type(spec.n_layers) is int and type(spec.rope_theta) is float and spec.tied_embeddings is True
    wide = TINY.with_dtype_bytes(np.int64(2))
    assert type(wide.dtype_bytes) is int and wide.weight_bytes == TINY.weight_bytes // 2
    with pytest.raises(ValueError, match=r"ModelSpec\.dtype_bytes must be an integer >= 1, got True"):
        TINY.with_dtype_bytes(True)


@pytest.mark.parametrize("args, says", [
    (("linear", "2"), r"RopeScaling\.factor must be a finite number > 0, got '2' \(str\)"),
    (("linear", math.inf), r"RopeScaling\.factor must be a finite number > 0, got inf"),
    (("linear", True), r"RopeScaling\.factor must be a finite number > 0, got True \(a bool\)"),
    (("linear", 0.0), r"RopeScaling\.factor must be a finite number > 0, got 0\.0"),
    (("llama3", 8.0, 1.0, 4.0, 0), r"RopeScaling\.original_max_position must be an integer >= 1, got 0"),
    (("llama3", 8.0, 1.0, 4.0, 1.5), r"RopeScaling\.original_max_position must be an integer >= 1, got 1\.5"),
    (("llama3", 8.0, None), r"RopeScaling\.low_freq_factor must be a finite number > 0, got None"),
    (("cubic", 2.0), r"unknown RopeScaling\.kind 'cubic'; choose one of 'linear', 'llama3'"),
])
def test_rope_scaling_fields_are_checked(args, says):
    with pytest.raises(ValueError, match=says):
        RopeScaling(*args)


def test_rope_scaling_takes_numpy_numbers():
    sc = RopeScaling("llama3", np.float32(8.0), 1, 4, np.int64(32))
    assert sc == RopeScaling("llama3", 8.0, 1.0, 4.0, 32) and type(sc.original_max_position) is int


def test_step_formulas_take_seq_work_lists_generators_and_totals_alike():
    works = [SeqWork(5), SeqWork(1, 7)]
    t = StepTotals.of(works)
    for m in ("step_flops", "step_bytes", "step_activation_bytes"):
        assert getattr(TINY, m)(works) == getattr(TINY, m)(t) == getattr(TINY, m)(w for w in works)
