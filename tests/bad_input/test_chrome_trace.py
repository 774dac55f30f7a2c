"""The trace's public helpers take a RunResult and say so, rather than an AttributeError from inside."""
from __future__ import annotations

import pytest

from orca_torch.lab import api
from orca_torch.lab.chrome_trace import step_phases, trace_events


@pytest.mark.parametrize("f", [trace_events, step_phases])
@pytest.mark.parametrize("result, says", [(None, "got None"), ("run.json", r"got 'run.json' \(str\)")])
def test_the_trace_helpers_need_a_run_result(f, result, says):
    with pytest.raises(ValueError, match="result must be a RunResult, " + says):
        f(result)


def test_a_run_that_served_nothing_traces_to_its_two_process_names():
    rejected = api.run("orca", 1.0, 5, max_context=10, reject_invalid=True)
    events = trace_events(rejected)
    assert [e["args"]["name"] for e in events if e["ph"] == "M" and "tid" not in e] == ["engine", "requests"]
    assert not [e for e in events if e["ph"] == "X"]
    assert [a.tolist() for a in step_phases(rejected)] == [[], [], []]
