"""A run as Chrome trace-event JSON: loaded back, its events match the run they came from."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from orca_torch.core.request import Request
from orca_torch.lab.api import run
from orca_torch.lab.chrome_trace import ENGINE_PID, REQUESTS_PID, UNKNOWN, to_chrome_trace


def _load(res, tmp_path, name="run.json") -> list[dict]:
    path = to_chrome_trace(res, tmp_path / name)
    doc = json.loads(path.read_text())
    assert doc["otherData"]["n_requests"] == res.n and doc["otherData"]["n_steps"] == res.n_steps
    return doc["traceEvents"]


def _phases(res, tmp_path) -> list[tuple]:
    """Each step's (prefills, decodes) as its span in the trace gives them (`UNKNOWN` where it cannot tell)."""
    steps = [e for e in _load(res, tmp_path, "phases.json") if e.get("cat") == "step"]
    assert [int(e["name"].split()[1]) for e in steps] == list(range(res.n_steps))
    return [(e["args"]["prefills"], e["args"]["decodes"]) for e in steps]


@pytest.fixture(scope="module")
def traced():
    return run("chat", 16.0, 40, "orca-oracle", max_bs=16, seed=2, trace=True)


def test_one_span_per_step_with_its_batch(traced, tmp_path):
    events = _load(traced, tmp_path)
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names[(ENGINE_PID, None)] == "engine" and names[(REQUESTS_PID, None)] == "requests"
    assert names[(ENGINE_PID, 0)] == "worker"
    steps = [e for e in events if e.get("cat") == "step"]
    assert len(steps) == traced.n_steps
    assert all(e["ph"] == "X" and e["pid"] == ENGINE_PID and e["tid"] == 0 for e in steps)
    ts = np.array([e["ts"] for e in steps]) / 1e6
    end = ts + np.array([e["dur"] for e in steps]) / 1e6
    assert np.allclose(ts, traced.step_start, atol=1e-6) and np.allclose(end, traced.step_end, atol=1e-6)
    assert [e["args"]["batch_size"] for e in steps] == traced.step_n_seqs.tolist()
    assert [e["args"]["tokens"] for e in steps] == traced.step_n_tokens.tolist()
    for e, (_, _, _, works) in zip(steps, traced.trace):
        assert e["args"]["prefills"] + e["args"]["decodes"] == e["args"]["batch_size"] == len(works)


def test_one_lane_per_request_from_arrival_to_last_token(traced, tmp_path):
    events = _load(traced, tmp_path)
    spans = {e["tid"]: e for e in events if e.get("cat") == "request"}
    firsts = {e["tid"]: e for e in events if e.get("cat") == "token"}
    assert sorted(spans) == sorted(firsts) == list(range(traced.n))
    for i in range(traced.n):
        s, f = spans[i], firsts[i]
        assert s["ts"] / 1e6 == pytest.approx(traced.arrival_s[i], abs=1e-6)
        assert (s["ts"] + s["dur"]) / 1e6 == pytest.approx(traced.last_token_s[i], abs=1e-6)
        assert f["ph"] == "i" and f["ts"] / 1e6 == pytest.approx(traced.first_token_s[i], abs=1e-6)
        assert s["ts"] <= f["ts"] <= s["ts"] + s["dur"]
        assert s["args"]["ttft_s"] == pytest.approx(traced.first_token_s[i] - traced.arrival_s[i])
        assert s["args"]["output_len"] == traced.output_len[i] == len(traced.tokens_of(i))
        tokens = traced.tokens_of(i)            # TPOT: the decode tokens' mean gap; a one-token answer has none
        want_tpot = (tokens[-1] - tokens[0]) / (len(tokens) - 1) if len(tokens) > 1 else None
        assert s["args"]["prompt_len"] == traced.requests[i].prompt_len
        assert s["args"]["tpot_s"] == (want_tpot if want_tpot is None else pytest.approx(want_tpot, rel=1e-12))


def test_a_one_token_answer_has_no_tpot_in_its_lane(tmp_path):
    """TPOT is the mean gap between decode tokens: a one-token answer has none (null, not 0, which
    would read as instant decoding), beside a three-token answer's (last - first) / 2."""
    res = run([Request(0, 0.0, 8, 1), Request(1, 0.0, 8, 3)], max_bs=2)
    spans = {e["tid"]: e["args"] for e in _load(res, tmp_path) if e.get("cat") == "request"}
    tokens = res.tokens_of(1)
    assert len(tokens) == 3 and spans[0]["tpot_s"] is None
    assert spans[1]["tpot_s"] == pytest.approx((tokens[2] - tokens[0]) / 2, rel=1e-12)


def test_phases_from_works_equal_phases_from_token_times_without_chunking(traced, tmp_path):
    with_works = _phases(traced, tmp_path)
    from_tokens = _phases(dataclasses.replace(traced, trace=None), tmp_path)
    assert with_works == from_tokens
    assert sum(p for p, _ in with_works) == traced.n            # every request's prompt once (no preemption here)
    assert sum(p + d for p, d in with_works) == len(traced.token_times)


@pytest.mark.parametrize("kw", [dict(system="orca-oracle", max_num_batched_tokens=256, chunked_prefill=True),
                                dict(system="paged", n_slots=4096)], ids=["chunked", "recompute"])
def test_without_the_works_a_step_shows_its_true_counts_or_says_they_are_unknown(kw, tmp_path):
    # A prompt chunk makes no token and a recompute makes no first token: read from the token times
    # alone, a step of chunks showed 0 prefills and 0 decodes, and a recompute showed as a decode.
    res = run("chat", 16.0, 40, max_bs=16, seed=3, trace=True, reject_invalid=True, **kw)
    with_works = _phases(res, tmp_path)
    assert UNKNOWN not in {p for p, _ in with_works}
    unknown = 0
    for told, true in zip(_phases(dataclasses.replace(res, trace=None), tmp_path), with_works, strict=True):
        if told[0] == UNKNOWN:
            assert told == (UNKNOWN, UNKNOWN) == ("unknown (run with trace=True)",) * 2
            unknown += 1
        else:
            assert told == true
    assert 0 < unknown < res.n_steps                  # (steps of chunks, or with a recompute)


def test_static_batching_without_the_works_counts_every_step_from_its_tokens(tmp_path):
    """A static batch keeps its finished requests' seats idle until the batch ends, so a step's batch
    size is not the tokens it made; its works are still whole prompts and one-token decodes, so the
    token times tell its prefills and decodes: every step shows the counts its works give, none
    unknown."""
    res = run("chat", 16.0, 40, "static", max_bs=16, seed=3, trace=True)
    with_works = _phases(res, tmp_path)
    pre, dec = (np.array(c) for c in zip(*with_works))
    assert pre.sum() == res.n and (res.step_n_seqs != pre + dec).any()   # idle seats: batch size does not tell
    assert _phases(dataclasses.replace(res, trace=None), tmp_path) == with_works


def test_chunked_prefill_counts_every_chunk_and_pipelines_get_a_lane_per_stage(tmp_path):
    res = run("chat", 16.0, 30, "orca-oracle", max_bs=16, seed=1, trace=True, max_num_batched_tokens=256,
              chunked_prefill=True)
    assert sum(p for p, _ in _phases(res, tmp_path)) > res.n    # a long prompt is several chunks, each a prefill
    piped = run("orca", 8.0, 20, "orca-oracle", max_bs=8, seed=0, n_workers=2, pp=2)
    events = _load(piped, tmp_path, "piped.json")
    lanes = {e["tid"] for e in events if e.get("cat") == "step"}
    assert lanes == {0, 1}
    by_step: dict[str, list[dict]] = {}
    for e in events:
        if e.get("cat") == "step":
            by_step.setdefault(e["name"], []).append(e)
    for a, b in (sorted(v, key=lambda e: e["tid"]) for v in by_step.values()):
        assert a["ts"] + a["dur"] <= b["ts"]                               # stage 1 after stage 0
        assert b["ts"] + b["dur"] == pytest.approx(piped.step_end[int(a["name"].split()[1])] * 1e6, abs=0.5)
    for k in (0, 1):                                  # a stage holds one batch at a time
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "step" and e["tid"] == k)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


def test_an_asynchronous_run_draws_each_step_whole_on_the_lane_of_its_flight(tmp_path):
    # A run whose stages' times are not kept (real workers) has a lane per batch in flight: each step
    # once, from launch to return, on lane step % n_workers, and the steps of a lane never overlap.
    piped = run("orca", 8.0, 20, "orca-oracle", max_bs=8, seed=0, n_workers=2, pp=2)
    events = [e for e in _load(dataclasses.replace(piped, stage_start=None), tmp_path, "async.json")
              if e.get("cat") == "step"]
    assert len(events) == piped.n_steps
    for e in events:
        i = int(e["name"].split()[1])
        assert e["tid"] == i % 2
        assert e["ts"] == pytest.approx(piped.step_start[i] * 1e6, abs=0.5)
        assert e["ts"] + e["dur"] == pytest.approx(piped.step_end[i] * 1e6, abs=0.5)
    for k in (0, 1):
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == k)
        assert len(spans) > 1 and all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


def _as_read(events: list[dict], lane: tuple[int, int], ns) -> list[tuple[float, float]]:
    """(start, end) of the spans on a lane as a viewer reads them: `ns(ts)` and `ns(ts) + ns(dur)`."""
    return sorted((ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]))
                  for e in events if e["ph"] == "X" and (e["pid"], e["tid"]) == lane)


def test_back_to_back_steps_end_where_the_next_starts_and_never_nest(traced, tmp_path):
    # Step i ends exactly when step i + 1 starts, in every viewer: Perfetto's JSON import truncates
    # ts * 1000 and dur * 1000 to whole nanoseconds each, a script adds ts + dur in floats. Written as
    # microseconds with three decimals, an end passed the next start by a nanosecond (truncated) or by
    # a float's last bit (added), and a viewer drew the next step nested inside the one before it.
    events = _load(traced, tmp_path)
    assert (traced.step_end[:-1] == traced.step_start[1:]).all()
    readings = {"truncated to ns": lambda us: int(us * 1000.0), "added as floats": lambda us: us}
    for how, ns in readings.items():
        spans = _as_read(events, (ENGINE_PID, 0), ns)
        assert len(spans) == traced.n_steps
        assert all(end == nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), how
    assert all(isinstance(e[k], int) for e in events if e["ph"] in "Xi" for k in ("ts", "dur") if k in e)
