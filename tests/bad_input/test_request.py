"""Requests: lengths are whole numbers of tokens, Python or numpy, never floats or bools."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from orca_torch.core.engine import Engine
from orca_torch.core.memory import UnlimitedMemory
from orca_torch.core.request import Request, Status
from orca_torch.sim.executors import StepTimeExecutor


def test_request_accepts_numpy_integers_as_plain_ints():
    r = Request(0, np.float32(0.5), np.int64(3), np.int32(2), max_tokens=np.uint16(8), predicted_output=np.int64(2))
    assert (r.prompt_len, r.output_len, r.max_tokens, r.total_len) == (3, 2, 8, 5)
    assert all(type(v) is int for v in (r.prompt_len, r.output_len, r.max_tokens))
    assert type(r.arrival_s) is float and type(r.predicted_output) is float


def test_min_tokens_may_hold_back_a_stop_token_for_the_whole_output():
    assert Request(0, 0.0, 3, 2, min_tokens=2).min_tokens == 2


@pytest.mark.parametrize("bad", [3.0, np.float64(3.0), True, np.bool_(True), "3", 0, np.int64(-2)])
def test_request_refuses_non_integer_lengths_saying_what_is_allowed(bad):
    with pytest.raises(ValueError, match=r"prompt_len must be an integer >= 1 \(a Python or numpy integer; "
                                         r"not a float or bool\), got"):
        Request(0, 0.0, bad, 1)
    with pytest.raises(ValueError, match="output_len must be an integer >= 1"):
        Request(0, 0.0, 1, bad)
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        Request(0, 0.0, 1, 1, max_tokens=True if bad is True else 3.0)


def test_max_tokens_may_equal_a_requests_whole_length_and_not_less():
    """A reservation must hold the prompt and the whole answer: 10 slots for 6 + 4 tokens, not 9, even
    though the prompt alone fits."""
    assert Request(0, 0.0, 6, 4, max_tokens=10).max_tokens == 10
    with pytest.raises(ValueError, match=r"max_tokens must be an integer >= prompt_len \+ output_len = 10, got 9"):
        Request(0, 0.0, 6, 4, max_tokens=9)


def test_a_max_tokens_below_numpy_lengths_whose_sum_wraps_around_is_refused(recwarn):
    big = np.int64(2**63 - 1)
    with pytest.raises(ValueError, match=rf"max_tokens must be an integer >= prompt_len \+ output_len = {2**63 + 4}, "
                                         "got 7"):
        Request(0, 0.0, np.int64(5), big, max_tokens=7)
    assert not recwarn.list


@pytest.mark.parametrize("field, value, says", [
    ("arrival_s", 10**400, "arrival_s must be a finite number >= 0"),       # an int no float can hold
    ("arrival_s", float("inf"), "arrival_s must be a finite number >= 0"),
    ("predicted_output", 10**400, "predicted_output must be a finite number > 0"),
    ("predicted_output", 0, "predicted_output must be a finite number > 0, got 0"),
    ("prompt_ids", 5, r"prompt_ids must be a list of token ids \(integers >= 0\), in order .* got int"),
    ("prompt_ids", {200, 5, 100}, "in order .* got set"),            # no order: the prompt would be shuffled
    ("prompt_ids", {200: 0, 5: 0, 100: 0}, "got dict"),
    ("prompt_ids", np.zeros((1, 3), dtype=int), "got ndarray"),
    ("prompt_ids", "abc", "got str"),
    ("prompt_ids", [1, 2.0, 3], "got 2.0 at position 1"),
    ("prompt_ids", [1, -2, 3], "got -2 at position 1"),
    ("prompt_ids", [1, True, 3], "got True at position 1"),
    ("prompt_ids", torch.tensor([1, 2, 3]), r"got tensor\(1\) at position 0, an element of a Tensor that is no "
                                            r"integer: give prompt_ids\.tolist\(\)"),
    ("prompt_ids", np.array([1, -2, 3]), r"got np\.int64\(-2\) at position 1$"),   # an integer, only negative
    ("prompt_ids", [1, np.int64(-2), 3], r"got np\.int64\(-2\) at position 1$"),
    ("prompt_ids", np.array([1.0, 2.0, 3.0]), r"got np\.float64\(1\.0\) at position 0$"),
    ("prompt_ids", torch.tensor([1.0, 2.0, 3.0]), r"got tensor\(1\.\) at position 0$"),
    ("min_tokens", -1, r"min_tokens must be an integer in \[0, output_len = 2\], got -1"),
    ("min_tokens", 3, r"min_tokens must be an integer in \[0, output_len = 2\], got 3"),
    ("min_tokens", 1.0, "min_tokens must be an integer in .* got 1.0"),
    ("min_tokens", True, "min_tokens must be an integer in .* got True"),
    ("stop_token_ids", [2], r"stop_token_ids must be a tuple of token ids \(integers >= 0\), got \[2\]"),
    ("stop_token_ids", 2, "stop_token_ids must be a tuple of token ids .* got 2"),
    ("stop_token_ids", (2, -1), r"stop_token_ids must be a tuple of token ids .* got \(2, -1\)"),
    ("stop_token_ids", (2.0,), "stop_token_ids must be a tuple of token ids .* got"),
], ids=lambda v: repr(v)[:24])
def test_request_fields_out_of_any_range_get_a_clear_error(field, value, says):
    with pytest.raises(ValueError, match=says):
        Request(**{"req_id": 0, "arrival_s": 0.0, "prompt_len": 3, "output_len": 2, field: value})


@pytest.mark.parametrize("req_id", [[1], {"a": 1}, (1, [2]), float("nan")])
def test_a_req_id_must_be_usable_as_a_key(req_id):
    with pytest.raises(ValueError, match=r"req_id must be hashable and equal to itself"):
        Request(req_id, 0.0, 3, 2)
    assert Request((1, "a"), 0.0, 3, 2, prompt_ids=np.array([1, 2, 3])).req_id == (1, "a")


def test_a_dataclass_subclass_without_slots_starts_as_a_fresh_request():
    """Request is a slotted dataclass: a subclass's dataclass __init__ without slots=True sets none of
    its run-state fields (their defaults lived in class attributes that slots replace), so the engine
    stopped on an AttributeError for `owner`."""
    @dataclasses.dataclass(eq=False)
    class Tagged(Request):
        tag: int = 0

    r = Tagged(0, 0.0, 3, 2, tag=5)
    assert (r.status, r.num_computed_tokens, r.n_generated, r.n_preemptions, r.output_ids, r.run_index, r.owner) == \
        (Status.WAITING, 0, 0, 0, None, -1, None)
    res = Engine(StepTimeExecutor(lambda totals: 0.01, max_context=64), UnlimitedMemory()).run([r])
    assert res.n_steps == 2 and r.tag == 5 and r.status is Status.FINISHED


@pytest.mark.parametrize("knobs, says", [({}, "compares by value and cannot be hashed"),
                                         ({"unsafe_hash": True}, "compares by value and hashes by value"),
                                         ({"eq": False, "unsafe_hash": True}, "hashes by value")],
                         ids=["eq", "eq and unsafe_hash", "unsafe_hash"])
def test_a_request_subclass_that_compares_by_value_is_refused_when_made(knobs, says):
    """A plain @dataclass subclass (eq=True by default) ran until the scheduler put its requests in a
    set (a TypeError from core, or from the fast engine, on the first preemption or bulk step); one
    hashed by its fields would change its hash as its counters move."""
    Priority = dataclasses.make_dataclass("Priority", [("priority", int, dataclasses.field(default=0))],
                                          bases=(Request,), **knobs)
    with pytest.raises(TypeError, match=rf"^Priority {says} \(a dataclass's eq=True or unsafe_hash=True\): a run keys "
                                        r"each request by identity, in sets and dicts; declare it "
                                        r"@dataclasses.dataclass\(eq=False, slots=True\), as Request is$"):
        Priority(0, 0.0, 5, 3, priority=1)
