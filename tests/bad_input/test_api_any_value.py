"""Any value in one setting of `api.simulate`, the others good: a result, or ValueError saying what was
wrong; never another exception or a warning, and the caller's request list as it was. The odd value is
one of `ODD`, or a good one given as a 0-d numpy array; every named setting is also given each way
numpy holds a name (a numpy string runs as the name, a 0-d array runs so or is refused by name) and as an
array of names (refused by name)."""
from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from orca_torch.core.request import Request
from orca_torch.lab import api

ODD = st.sampled_from([0, 1, -1, 3, 2**63, 10**30, 0.0, 0.5, 5e-324, 1e300, math.inf, -math.inf, math.nan, True,
                       False, np.int64(4), np.float32(2.5), np.int8(-3), np.uint64(2**64 - 1), np.bool_(True),
                       np.str_("paged"), np.array("spf"), np.array([1, 2]), np.array(["fcfs", "spf"]), "8", "", None,
                       [], (1,), object(), lambda: None])
GOOD = {"system": st.sampled_from(api.SYSTEMS), "max_bs": st.integers(1, 8), "seed": st.integers(0, 9),
        "order": st.sampled_from(["fcfs", "spf"]), "prefill": st.sampled_from(["mixed", "prefill_first"]),
        "n_workers": st.integers(1, 2), "max_num_batched_tokens": st.integers(8, 600),
        "chunked_prefill": st.booleans(), "max_context": st.integers(2, 8192), "n_slots": st.integers(1, 5000),
        "tp": st.sampled_from([1, 2]), "pp": st.sampled_from([1, 2]), "reject_invalid": st.booleans(),
        "slo_ttft_s": st.floats(0.01, 5), "attention": st.sampled_from(["full", "causal"]),
        "progress": st.just(lambda finished, total: None)}


def _requests(lengths):
    return [Request(i, float(i), p, o) for i, (p, o) in enumerate(lengths)]


@st.composite
def _settings(draw):
    kw = draw(st.fixed_dictionaries({}, optional=GOOD))
    odd = draw(st.sampled_from(sorted(GOOD)))
    kw[odd] = draw(st.one_of(ODD, GOOD[odd].map(np.array)))
    return kw


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.one_of(st.sampled_from(["orca", "chat"]), st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40)),
                                                             min_size=1, max_size=4).map(_requests)),
       _settings())
def test_any_setting_gives_a_result_or_a_value_error_and_leaves_the_requests_as_they_were(workload, kw):
    named = isinstance(workload, str)
    before = None if named else [(dataclasses.asdict(r), r.status, r.n_generated) for r in workload]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            m = api.simulate(workload, **(dict(rate=4.0, n_requests=6) if named else {}), **kw)
        except ValueError as e:
            assert str(e)
        else:
            assert m.n_requests + m.n_rejected == (6 if named else len(workload))
    assert named or [(dataclasses.asdict(r), r.status, r.n_generated) for r in workload] == before


NAMED = [("system", c) for c in api.SYSTEMS] + [("order", "spf"), ("prefill", "prefill_first"), ("attention", "causal"),
                                                ("cost_model", "refined"), ("gpu", "h200"), ("model", "opt-13b")]


@pytest.mark.parametrize("name, choice", NAMED)
def test_a_named_setting_given_as_numpy_runs_as_the_name_or_is_refused_and_several_names_are_refused(name, choice):
    plain = api.simulate("orca", 4.0, 6, **{name: choice})
    assert api.simulate("orca", 4.0, 6, **{name: np.str_(choice)}) == plain     # (a str subclass)
    try:
        assert api.simulate("orca", 4.0, 6, **{name: np.array(choice)}) == plain
    except ValueError as e:
        assert name in str(e)
    with pytest.raises(ValueError, match=name):
        api.simulate("orca", 4.0, 6, **{name: np.array([choice, choice])})
