"""Any value in any setting of `api.simulate` (a good one, one given as a numpy scalar or 0-d array, or an
odd one): a result, or ValueError saying what was wrong; never another exception or a warning, and the
caller's request list as it was."""
from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from orca_torch.core.request import Request
from orca_torch.lab import api

ODD = st.sampled_from([0, 1, -1, 3, 2**63, 10**30, 0.0, 0.5, 5e-324, 1e300, math.inf, -math.inf, math.nan, True, False,
                       np.int64(4), np.float32(2.5), np.int8(-3), np.uint64(2**64 - 1), np.bool_(True), np.str_("paged"),
                       np.array("spf"), np.array([1, 2]), "8", "", None, [], (1,), object(), lambda: None])
GOOD = {"system": st.sampled_from(api.SYSTEMS), "max_bs": st.integers(1, 8), "seed": st.integers(0, 9),
        "order": st.sampled_from(["fcfs", "spf"]), "prefill": st.sampled_from(["mixed", "prefill_first"]),
        "n_workers": st.integers(1, 2), "max_num_batched_tokens": st.integers(8, 600),
        "chunked_prefill": st.booleans(), "max_context": st.integers(2, 8192), "n_slots": st.integers(1, 5000),
        "tp": st.sampled_from([1, 2]), "pp": st.sampled_from([1, 2]), "reject_invalid": st.booleans(),
        "slo_ttft_s": st.floats(0.01, 5), "progress": st.just(lambda finished, total: None)}


def _requests(lengths):
    reqs = [Request(i, float(i), p, o) for i, (p, o) in enumerate(lengths)]
    if reqs[0].prompt_len % 2:
        reqs[0].output_len = np.int64(reqs[0].output_len)      # a numpy length set after construction
    return reqs


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.one_of(st.sampled_from(["orca", "chat"]), st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40)),
                                                             min_size=1, max_size=4).map(_requests)),
       st.fixed_dictionaries({}, optional={k: st.one_of(v, v, ODD, v.map(np.array)) for k, v in GOOD.items()}))
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
