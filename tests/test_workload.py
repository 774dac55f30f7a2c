"""Workloads: seeded, Poisson, the right length distributions, trace replay, clear errors."""
from __future__ import annotations

import copy
import csv
import dataclasses
import math
import os
import pickle
import re
import weakref
from datetime import datetime

import numpy as np
import pytest

from orca_torch.core.request import Request, Status
from orca_torch.lab.workload import (AZURE_CONV_CSV, at_rate, chat, fresh_copies, from_azure_csv, from_csv,
    long_context, make_requests, make_workload, orca_homogeneous, orca_synthetic, poisson_arrivals, trace_lengths,
    with_predictions, with_prompt_ids)


def _cols(reqs):
    return (np.array([r.arrival_s for r in reqs]), np.array([r.prompt_len for r in reqs]),
            np.array([r.output_len for r in reqs]))


def _trace_pairs():
    with open(AZURE_CONV_CSV) as f:
        rows = list(csv.reader(f))[1:]
    return rows, {(int(r[1]), int(r[2])) for r in rows}


def test_chat_is_seeded_and_draws_real_trace_lengths():
    a = chat(n_requests=300, rate=8.0, seed=3)
    b = chat(n_requests=300, rate=8.0, seed=3)
    c = chat(n_requests=300, rate=8.0, seed=4)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in a] == \
           [(r.arrival_s, r.prompt_len, r.output_len) for r in b]
    assert [r.prompt_len for r in a] != [r.prompt_len for r in c]
    _, pairs = _trace_pairs()
    assert all((r.prompt_len, r.output_len) in pairs for r in a)
    assert [r.req_id for r in a] == list(range(300))


def test_trace_lengths_are_every_row_of_the_trace_read_only(tmp_path):
    rows, _ = _trace_pairs()
    p, o = trace_lengths()
    assert p.tolist() == [int(r[1]) for r in rows] and o.tolist() == [int(r[2]) for r in rows]
    assert not p.flags.writeable and not o.flags.writeable
    with pytest.raises(ValueError, match="no such file; give the path of a trace's CSV file"):
        trace_lengths(tmp_path / "nope.csv")
    with pytest.raises(ValueError, match="path must be a file path"):
        trace_lengths(3)


def test_chat_lengths_match_the_trace_statistics():
    _, p, o = _cols(chat(n_requests=4000, rate=8.0, seed=0))
    # The trace: prompt mean 1,155, output mean 211 (data/README.md).
    assert abs(p.mean() - 1155) / 1155 < 0.05
    assert abs(o.mean() - 211) / 211 < 0.08


def test_chat_leaves_out_rows_longer_than_the_context():
    _, p, o = _cols(chat(n_requests=3000, rate=8.0, seed=1, max_context=4096))
    assert (p + o).max() <= 4096


def test_poisson_rate_and_rescaling_keep_the_same_requests():
    a, p, o = _cols(chat(n_requests=2000, rate=4.0, seed=5))
    a2, p2, o2 = _cols(chat(n_requests=2000, rate=8.0, seed=5))
    assert np.array_equal(p, p2) and np.array_equal(o, o2)
    np.testing.assert_allclose(a2, a / 2, rtol=1e-12)
    gaps = np.diff(a)
    assert abs(gaps.mean() - 0.25) / 0.25 < 0.06
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1          # exponential: CV = 1
    assert a[0] == 0 and np.all(gaps >= 0)


def test_long_context_and_orca_distributions():
    _, p, o = _cols(long_context(n_requests=6000, rate=2.0, seed=0))
    assert p.min() >= 1024 and p.max() <= 3072 and o.min() >= 1 and o.max() <= 1023
    assert abs(p.mean() - 2048) < 25 and abs(o.mean() - 512) < 12
    _, p, o = _cols(orca_synthetic(n_requests=6000, rate=1.0, seed=0))
    assert p.min() == 32 and p.max() == 512 and o.min() == 1 and o.max() == 128
    assert abs(p.mean() - 272) < 5 and abs(o.mean() - 64.5) < 2


def test_make_workload_names():
    assert len(make_workload("orca", n_requests=10, rate=1.0)) == 10
    with pytest.raises(ValueError, match="unknown workload 'nope'; known: chat, long-context, orca, orca-homogeneous"):
        make_workload("nope")
    with pytest.raises(ValueError, match="rate must be a finite number of requests per second > 0, got 0.0"):
        chat(n_requests=10, rate=0.0)
    with pytest.raises(ValueError, match="n_requests must be an integer >= 1, got 0"):
        chat(n_requests=0, rate=1.0)


def test_azure_replay_at_its_own_pace_and_rescaled():
    rows, _ = _trace_pairs()
    reqs = from_azure_csv(AZURE_CONV_CSV, n_requests=50)
    t = [datetime.strptime(r[0][:26], "%Y-%m-%d %H:%M:%S.%f") for r in rows[:50]]
    want = np.array([(x - t[0]).total_seconds() for x in t])
    np.testing.assert_allclose([r.arrival_s for r in reqs], want, atol=1e-6)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(int(r[1]), int(r[2])) for r in rows[:50]]
    fast = from_azure_csv(AZURE_CONV_CSV, n_requests=50, rate=20.0)
    a = np.array([r.arrival_s for r in fast])
    assert a[0] == 0 and math.isclose(49 / a[-1], 20.0, rel_tol=1e-9)
    half = from_azure_csv(AZURE_CONV_CSV, n_requests=50, scale=0.5)
    np.testing.assert_allclose([r.arrival_s for r in half], want * 0.5, atol=1e-6)
    mid = from_azure_csv(AZURE_CONV_CSV, n_requests=5, start=10)
    assert mid[0].arrival_s == 0 and mid[0].prompt_len == int(rows[10][1])


def _write(tmp_path, text, name="trace.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_plain_csv_replay_and_its_errors(tmp_path):
    ok = _write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n0,10,5\n0.5,20,3\n2.0,7,1\n", "ok.csv")
    reqs = from_csv(ok)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in reqs] == [(0, 10, 5), (0.5, 20, 3), (2.0, 7, 1)]
    assert [r.arrival_s for r in from_csv(ok, scale=2.0)] == [0, 1.0, 4.0]
    cases = {
        "0,10,5\n1,2,3\n": "line 1: expected the header arrival_s,prompt_tokens,output_tokens, got '0,10,5'",
        "arrival_s,prompt_tokens,output_tokens\n1,10,5\n0.5,20,3\n":
            "line 3 (row 1), column arrival_s: arrivals must be sorted, but row 1 arrives at 0.5 before row 0 at 1.0",
        "arrival_s,prompt_tokens,output_tokens\nnan,10,5\n":
            "line 2 (row 0), column arrival_s: nan; arrival times must be finite numbers of seconds >= 0",
        "arrival_s,prompt_tokens,output_tokens\n0,-3,5\n": "line 2 (row 0), column prompt_tokens: prompt length -3; "
                                                         "lengths must be whole numbers of tokens, 1 <= n < 2**53",
        "arrival_s,prompt_tokens,output_tokens\n0,3,0\n": "line 2 (row 0), column output_tokens: output length 0; "
                                                        "lengths must be whole numbers of tokens, 1 <= n < 2**53",
        "arrival_s,prompt_tokens,output_tokens\n0,3.5,2\n":
            "line 2 (row 0), column prompt_tokens: '3.5'; prompt lengths must be whole numbers of tokens",
        "arrival_s,prompt_tokens,output_tokens\n0,abc,2\n": "line 2 (row 0), column prompt_tokens: cannot parse 'abc' "
                                                          "as a number; lengths must be whole numbers of tokens",
    }
    for text, msg in cases.items():
        with pytest.raises(ValueError, match=re.escape(msg)):
            from_csv(_write(tmp_path, text))
    with pytest.raises(ValueError, match=re.escape("give either rate (a target mean rate) or scale (a time factor), "
                                                   "not both")):
        from_csv(ok, rate=1.0, scale=2.0)
    with pytest.raises(ValueError, match=r"ok\.csv: asked for rows 0\.\.9 but the trace has 3$"):
        from_csv(ok, n_requests=10)


def test_make_requests_errors_name_the_row():
    with pytest.raises(ValueError, match="arrivals must be sorted, but row 2 arrives at 0.5 before row 1 at 1.0"):
        make_requests([0, 1, 0.5], [1, 1, 1], [1, 1, 1])
    with pytest.raises(ValueError, match=re.escape("arrival time of row 1 is nan (must be a finite number)")):
        make_requests([0, float("nan")], [1, 1], [1, 1])
    with pytest.raises(ValueError, match=re.escape("columns differ in length (2, 1, 2)")):
        make_requests([0, 1], [1], [1, 1])


def test_request_validation():
    with pytest.raises(ValueError, match="request 0: prompt_len must be an integer >= 1 .*, got 0"):
        Request(0, 0.0, 0, 5)
    with pytest.raises(ValueError, match="request 0: output_len must be an integer >= 1 .*, got -1"):
        Request(0, 0.0, 5, -1)
    with pytest.raises(ValueError, match="request 0: arrival_s must be a finite number >= 0, got nan"):
        Request(0, float("nan"), 5, 5)
    with pytest.raises(ValueError, match="request 0: max_tokens must be an integer >= prompt_len [+] output_len = 10, "
                                         "got 9"):
        Request(0, 0.0, 5, 5, max_tokens=9)
    with pytest.raises(ValueError, match="request 0: prompt_ids has 2 tokens but prompt_len is 5"):
        Request(0, 0.0, 5, 5, prompt_ids=[1, 2])
    with pytest.raises(ValueError, match="request 0: prompt_len [+] output_len = 5 [+] 5 = 10 exceeds the max "
                                         "context 9"):
        Request(0, 0.0, 5, 5).check_context(9)


def test_predictions():
    reqs = with_predictions(chat(n_requests=3000, rate=1.0, seed=0), sigma=0.0)
    assert all(r.predicted_output == r.output_len for r in reqs)
    reqs = with_predictions(chat(n_requests=3000, rate=1.0, seed=0), sigma=0.5, seed=7)
    logs = np.log([r.predicted_output / r.output_len for r in reqs])
    assert abs(logs.std() - 0.5) < 0.03 and abs(logs.mean()) < 0.03


def test_poisson_arrivals_start_at_zero():
    a = poisson_arrivals(5, 2.0, np.random.default_rng(0))
    assert a[0] == 0 and np.all(np.diff(a) > 0)


def test_chat_keeps_a_row_of_exactly_max_context_and_draws_every_kept_row(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5,3\n"
                 "2023-11-16 18:15:47,4,2\n2023-11-16 18:15:48,10,10\n")
    reqs = chat(n_requests=200, rate=1.0, seed=0, max_context=8, path=p)      # 5 + 3 = 8 fits; 10 + 10 does not
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(5, 3), (4, 2)}


def test_copies_keep_every_field_a_client_sets():
    sampling = object()                 # (a frozen model.sampling.SamplingParams in a torch run)
    reqs = [Request(0, 0.0, 5, 3, 16, 2.5, [1, 2, 3, 4, 5], 1, (7, 9), sampling), Request("b", 1.5, 2, 2)]
    asked = [f.name for f in dataclasses.fields(Request) if f.init and f.name != "arrival_s"]
    for out in (fresh_copies(reqs), at_rate(reqs, 2.0)):
        assert [[getattr(r, f) for f in asked] for r in out] == [[getattr(r, f) for f in asked] for r in reqs]
        assert out[0].prompt_ids is not reqs[0].prompt_ids
    assert [r.arrival_s for r in at_rate(reqs, 2.0)] == [0.0, 0.5]


@dataclasses.dataclass(eq=False, slots=True)
class TaggedRequest(Request):
    """A request that carries a field of a client's own, as a policy that reads it would give."""

    tag: int = 0


def test_copies_keep_a_request_subclass_and_its_fields():
    reqs = [TaggedRequest(0, 0.0, 5, 3, tag=7), TaggedRequest(1, 1.0, 4, 2, prompt_ids=[1, 2, 3, 4], tag=2)]
    for out in (fresh_copies(reqs), at_rate(reqs, 2.0), with_prompt_ids(reqs, 10)):
        assert [(type(r), r.tag, r.req_id) for r in out] == [(TaggedRequest, 7, 0), (TaggedRequest, 2, 1)]
        assert out[1].prompt_ids is not reqs[1].prompt_ids and out[0].owner is None


class ShortRequest(Request):
    """A subclass whose constructor takes other arguments than the fields, and sets an attribute that is none."""

    def __init__(self, req_id, arrival_s, tag):
        super().__init__(req_id, arrival_s, 5, 3)
        self.tag = tag


def test_copies_of_a_subclass_with_its_own_constructor_keep_the_attributes_it_set():
    reqs = [ShortRequest(0, 0.0, tag=7), ShortRequest(1, 1.0, tag=2), TaggedRequest(2, 2.0, 4, 2, tag=5)]
    reqs[1].note = "vip"
    for out in (fresh_copies(reqs), at_rate(reqs, 2.0), with_prompt_ids(reqs, 10)):
        assert [(type(r), r.tag, r.req_id, r.status, r.owner) for r in out] == [
            (ShortRequest, 7, 0, Status.WAITING, None), (ShortRequest, 2, 1, Status.WAITING, None),
            (TaggedRequest, 5, 2, Status.WAITING, None)]
        assert out[1].note == "vip" and all(a is not b for a, b in zip(out, reqs))


def test_copy_and_pickle_of_a_request_keep_every_attribute_of_its_subclass_and_no_run():
    r = ShortRequest(0, 0.5, tag=7)
    r.note = "vip"
    r.n_generated, r.owner = 2, weakref.ref(r)
    for c in (copy.copy(r), copy.deepcopy(r), pickle.loads(pickle.dumps(r))):
        assert (type(c), c.tag, c.note, c.arrival_s, c.n_generated, c.owner) == (ShortRequest, 7, "vip", 0.5, 2, None)
    t = TaggedRequest(1, 0.0, 4, 2, tag=3)
    assert (copy.copy(t).tag, pickle.loads(pickle.dumps(t)).tag) == (3, 3)


class PrivateRequest(Request):
    """A subclass with a private slot, which Python stores under a mangled name (_PrivateRequest__tag)."""

    __slots__ = ("__tag",)

    def __init__(self, req_id, tag):
        super().__init__(req_id, 0.0, 5, 3)
        self.__tag = tag

    @property
    def tag(self):
        return self.__tag


def test_copies_keep_a_private_slot_of_a_subclass():
    r = PrivateRequest(0, tag=7)
    for c in (copy.copy(r), copy.deepcopy(r), pickle.loads(pickle.dumps(r)), fresh_copies([r])[0]):
        assert (type(c), c.tag) == (PrivateRequest, 7)


def test_every_generator_and_copy_with_random_fields_draws_from_its_own_seed():
    """Determinism takes a seed (§4.5): one seed gives the same draw, another a different one, for each
    generator, through `make_workload` too, and for the two copies with random fields
    (`with_predictions`, `with_prompt_ids`)."""
    def draws(seed):
        def cols(reqs):
            return [c.tolist() for c in _cols(reqs)]
        return {
            "long-context": cols(long_context(n_requests=40, rate=2.0, seed=seed)),
            "orca": cols(orca_synthetic(n_requests=40, rate=2.0, seed=seed)),
            "orca-homogeneous arrivals": cols(make_workload("orca-homogeneous", n_requests=40, rate=2.0, seed=seed))[0],
            "make_workload": cols(make_workload("orca", n_requests=40, rate=2.0, seed=seed)),
            "predictions": [r.predicted_output
                            for r in with_predictions(orca_synthetic(n_requests=40), 0.5, seed=seed)],
            "prompt ids": [r.prompt_ids for r in with_prompt_ids(orca_synthetic(n_requests=5), 1000, seed=seed)],
        }
    one, again, other = draws(1), draws(1), draws(2)
    for name in one:
        assert one[name] == again[name] and one[name] != other[name], name
    assert one["make_workload"] == one["orca"]


def test_prompt_ids_are_drawn_from_the_whole_vocabulary():
    """Ids are uniform over [0, vocab): with 3 ids and 600 draws each id comes up (each is missed with
    probability (2/3)**600), and none lies outside."""
    reqs = with_prompt_ids(orca_homogeneous(n_requests=20, rate=1.0, prompt_len=30, output_len=1), vocab=3, seed=0)
    assert {t for r in reqs for t in r.prompt_ids} == {0, 1, 2}


def test_replay_from_a_later_row_takes_that_rows_lengths_and_time():
    rows, _ = _trace_pairs()
    mid = from_azure_csv(AZURE_CONV_CSV, n_requests=5, start=10)
    t = [datetime.strptime(r[0][:26], "%Y-%m-%d %H:%M:%S.%f") for r in rows[10:15]]
    np.testing.assert_allclose([r.arrival_s for r in mid], [(x - t[0]).total_seconds() for x in t], atol=1e-6)
    assert [(r.prompt_len, r.output_len) for r in mid] == [(int(r[1]), int(r[2])) for r in rows[10:15]]


def test_a_trace_rewritten_in_place_is_read_again(tmp_path):
    """The parsed trace is kept per version of the file: a file rewritten between two calls gives its
    new lengths."""
    p = tmp_path / "trace.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5,3\n")
    os.utime(p, ns=(1_000_000_000, 1_000_000_000))
    assert [a.tolist() for a in trace_lengths(p)] == [[5], [3]]
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,7,2\n")
    os.utime(p, ns=(2_000_000_000, 2_000_000_000))
    assert [a.tolist() for a in trace_lengths(p)] == [[7], [2]]
    assert {(r.prompt_len, r.output_len) for r in chat(n_requests=5, rate=1.0, seed=0, path=p)} == {(7, 2)}


def test_a_trace_replaced_under_the_same_modification_time_is_read_again(tmp_path):
    """A file's modification time does not tell its versions apart: `cp -p`, `tar x` and `rsync -t`
    keep the old one. The kept parse is found by the file's change time too, which every write and
    every such setting moves, so the new lengths are read, not the old ones."""
    p = tmp_path / "trace.csv"
    for prompt, output in ((5, 3), (7, 2)):
        p.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,{prompt},{output}\n")
        os.utime(p, ns=(1_000_000_000, 1_000_000_000))
        assert [a.tolist() for a in trace_lengths(p)] == [[prompt], [output]]


@dataclasses.dataclass(eq=False, slots=True)
class TenantRequest(Request):
    tenant: str = ""
    priority: int = 0
    weight: float | None = None


def test_a_trace_s_further_columns_set_the_fields_they_name(tmp_path):
    """A column after the three sets the field of its name: Request's own (max_tokens, an empty cell
    None) or a subclass's, typed as the field is; slices and rescaled copies keep them."""
    path = _write(tmp_path, "arrival_s,prompt_tokens,output_tokens,priority,tenant,max_tokens,weight\n"
                            "0,10,5,1,acme,,0.5\n1,20,3,0,zeta,64\n3,7,1,2.0,acme,32,2\n", "own.csv")
    reqs = from_csv(path, request=TenantRequest)
    assert all(type(r) is TenantRequest for r in reqs)
    assert [(r.priority, r.tenant, r.max_tokens, r.weight) for r in reqs] == [
        (1, "acme", None, 0.5), (0, "zeta", 64, None), (2, "acme", 32, 2.0)]
    assert [type(v) for v in (reqs[2].priority, reqs[2].max_tokens, reqs[2].weight)] == [int, int, float]
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in reqs] == [(0.0, 10, 5), (1.0, 20, 3), (3.0, 7, 1)]
    tail = from_csv(path, request=TenantRequest, start=1, rate=2.0)
    assert [(type(r), r.req_id, r.arrival_s, r.priority, r.tenant) for r in tail] == [
        (TenantRequest, 0, 0.0, 0, "zeta"), (TenantRequest, 1, 0.5, 2, "acme")]
    predicted = _write(tmp_path, "arrival_s,prompt_tokens,output_tokens,predicted_output\n0,10,5,4.5\n", "p.csv")
    assert [(type(r), r.predicted_output) for r in from_csv(predicted)] == [(Request, 4.5)]
    assert [(type(r), r.priority) for r in from_csv(predicted, request=TenantRequest)] == [(TenantRequest, 0)]
