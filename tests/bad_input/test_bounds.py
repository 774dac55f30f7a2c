"""The throughput bounds take a workload's lengths as lists or integer arrays alike, and refuse empty,
mismatched or non-integer lengths and lengths beyond the model's context, by name."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from orca_torch.sim.bounds import ideal_decode_bound, prefill_alone_s, roofline_bound
from orca_torch.sim.hw_model import get_gpu

LLAMA, H100 = "llama-3-8b", "h100"
PROMPTS, OUTPUTS = [100, 700, 31], [10, 200, 2]


def test_lists_and_arrays_give_the_same_bounds():
    ideal = ideal_decode_bound(LLAMA, H100, np.array(PROMPTS), np.array(OUTPUTS))
    assert ideal_decode_bound(LLAMA, H100, PROMPTS, OUTPUTS) == ideal
    assert ideal_decode_bound(LLAMA, H100, [np.int64(p) for p in PROMPTS], tuple(OUTPUTS)) == ideal
    assert ideal_decode_bound(LLAMA, H100, np.array(PROMPTS, dtype=np.int32), OUTPUTS, np.int64(64)) == \
        ideal_decode_bound(LLAMA, H100, PROMPTS, OUTPUTS, 64)
    # token-weighted decode context: sum over requests of (o - 1) p + (o - 1) o / 2, over sum of (o - 1)
    ctx = sum((o - 1) * p + (o - 1) * o / 2 for p, o in zip(PROMPTS, OUTPUTS)) / sum(o - 1 for o in OUTPUTS)
    assert ideal["context_tokens"] == round(ctx) and ideal["batch"] == ideal["kv_slots"] // round(ctx)
    roof = roofline_bound(LLAMA, H100, np.array(PROMPTS), np.array(OUTPUTS), ideal)
    assert roofline_bound(LLAMA, H100, PROMPTS, OUTPUTS, ideal) == roof
    assert prefill_alone_s(LLAMA, H100, PROMPTS) == prefill_alone_s(LLAMA, H100, np.array(PROMPTS)) > 0


@pytest.mark.parametrize("prompts, outputs, says", [
    ([], [], "prompt_len is empty: a bound needs at least one request"),
    (np.array([], dtype=np.int64), np.array([], dtype=np.int64), "prompt_len is empty"),
    ([100, 200], [10], "one entry per request, got 2 and 1"),
    ([100], [10, 20, 30], "one entry per request, got 1 and 3"),     # (not one prompt broadcast to each)
    ([100, True], [10, 10], "prompt_len[1] must be an integer >= 1, got True (a bool)"),
    ([100, 2.5], [10, 10], "prompt_len[1] must be an integer >= 1, got 2.5"),
    (np.array([100.0]), [10], "prompt_len must be a 1-D array of integers, got an array of shape (1,) and dtype float64"),
    (np.array([[100]]), [10], "prompt_len must be a 1-D array of integers"),
    ([100, 50], np.array([10, 0]), "output_len[1] must be an integer >= 1, got 0"),
    ("100", [10], "prompt_len must be a list or 1-D array of integers, got str"),
    ([100, 50], [1, 1], "every request has output_len 1: there is no decode to bound"),
])
def test_bad_lengths_are_refused_clearly(prompts, outputs, says):
    with pytest.raises(ValueError) as e:
        ideal_decode_bound(LLAMA, H100, prompts, outputs)
    assert says in str(e.value)


def test_prefill_alone_and_max_bs_refuse_bad_input():
    with pytest.raises(ValueError, match="prompt_len is empty"):
        prefill_alone_s(LLAMA, H100, np.array([], dtype=np.int64))
    with pytest.raises(ValueError, match=r"prompt_len\[0\] must be an integer >= 1, got 0"):
        prefill_alone_s(LLAMA, H100, [0, 5])
    with pytest.raises(ValueError, match=r"max_bs must be an integer >= 1, got True \(a bool\)"):
        ideal_decode_bound(LLAMA, H100, PROMPTS, OUTPUTS, True)
    ideal = ideal_decode_bound(LLAMA, H100, PROMPTS, OUTPUTS)
    with pytest.raises(ValueError, match="prompt_len is empty"):
        roofline_bound(LLAMA, H100, [], [], ideal)


@pytest.mark.parametrize("ideal, says", [
    ({}, r"ideal must be ideal_decode_bound's result \(a dict with 'tok_s'\), got keys \[\]"),
    ("fast", r"ideal must be ideal_decode_bound's result .*, got str"),
    ({"tok_s": 0}, r"ideal\['tok_s'\] must be a finite number of tokens per second > 0, got 0"),
    ({"tok_s": -5.0}, r"ideal\['tok_s'\] must be .* > 0, got -5.0"),
    ({"tok_s": float("nan")}, r"ideal\['tok_s'\] must be .* > 0, got nan"),
    ({"tok_s": "fast"}, r"ideal\['tok_s'\] must be .* > 0, got 'fast' \(str\)"),
])
def test_the_roofline_bound_refuses_an_ideal_that_is_no_decode_rate(ideal, says):
    """`decode_only_s` divides by it: a negative or NaN rate would give a time of that sign beside a bound."""
    with pytest.raises(ValueError, match=says):
        roofline_bound(LLAMA, H100, PROMPTS, OUTPUTS, ideal)


@pytest.mark.parametrize("call, says", [
    (lambda: ideal_decode_bound(LLAMA, H100, [10**6], [5]),
     r"prompt_len\[0\] must be at most llama-3-8b's context of 8192 tokens, got 1000000"),
    (lambda: ideal_decode_bound(LLAMA, H100, [100, 8000], [10, 5000]),
     r"request 1: prompt_len 8000 \+ output_len 5000 = 13000 tokens, beyond llama-3-8b's context of 8192"),
    (lambda: roofline_bound(LLAMA, H100, [100], [9000], {"tok_s": 1.0}),
     r"output_len\[0\] must be at most llama-3-8b's context of 8192 tokens, got 9000"),
    (lambda: prefill_alone_s(LLAMA, H100, [100, 10**6]),
     r"prompt_len\[1\] must be at most llama-3-8b's context of 8192 tokens, got 1000000"),
])
def test_lengths_beyond_the_models_context_are_refused_naming_the_row(call, says):
    with pytest.raises(ValueError, match=says):
        call()


def test_a_card_that_holds_no_decode_batch_is_named():
    small = dataclasses.replace(get_gpu(H100), mem_bytes=16.3e9 / 0.9)   # the weights and ~1800 K/V tokens
    with pytest.raises(ValueError, match=r"llama-3-8b on h100 holds \d+ K/V tokens, fewer than one decode"):
        ideal_decode_bound(LLAMA, small, [4000], [100])


def test_roofline_takes_the_ideal_decode_bound_with_a_numpy_rate():
    rate = np.float32(ideal_decode_bound(LLAMA, H100, PROMPTS, OUTPUTS)["tok_s"])
    got = roofline_bound(LLAMA, H100, PROMPTS, OUTPUTS, {"tok_s": rate})
    assert got == roofline_bound(LLAMA, H100, PROMPTS, OUTPUTS, {"tok_s": float(rate)})
    assert {type(v) for v in got.values()} == {float}
    assert got["decode_only_s"] == pytest.approx((9 + 199 + 1) / float(rate), rel=1e-12)   # decodes / rate


def test_unsigned_lengths_are_reported_as_given_not_wrapped_around():
    huge = np.array([2**64 - 1], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"prompt_len\[0\] must be at most .* got 18446744073709551615"):
        ideal_decode_bound(LLAMA, H100, huge, [5])
    with pytest.raises(ValueError, match=r"output_len\[0\] must be at most .* got 9223372036854775808"):
        ideal_decode_bound(LLAMA, H100, [5], np.array([2**63], dtype=np.uint64))
    assert ideal_decode_bound(LLAMA, H100, np.array(PROMPTS, dtype=np.uint64), np.array(OUTPUTS, dtype=np.uint16)) \
        == ideal_decode_bound(LLAMA, H100, PROMPTS, OUTPUTS)
