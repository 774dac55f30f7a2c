"""Requests: lengths are whole numbers of tokens, Python or numpy, never floats or bools."""
from __future__ import annotations

import numpy as np
import pytest

from orca_torch.request import Request


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
