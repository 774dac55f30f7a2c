"""The trace takes a RunResult and says so, rather than an AttributeError from inside."""
from __future__ import annotations

import json

import pytest

from orca_torch.lab import api
from orca_torch.lab.chrome_trace import to_chrome_trace


@pytest.mark.parametrize("result, says", [(None, "got None"), ("run.json", r"got 'run.json' \(str\)")])
def test_the_trace_needs_a_run_result(result, says, tmp_path):
    with pytest.raises(ValueError, match="result must be a RunResult, " + says):
        to_chrome_trace(result, tmp_path / "t.json")


def test_a_run_that_served_nothing_traces_to_its_two_process_names(tmp_path):
    rejected = api.run("orca", 1.0, 5, max_context=10, reject_invalid=True)
    events = json.loads(to_chrome_trace(rejected, tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["args"]["name"] for e in events if e["ph"] == "M" and "tid" not in e] == ["engine", "requests"]
    assert not [e for e in events if e["ph"] == "X"]
