"""Workload generators and trace readers: seeds, numbers, and trace files that are malformed in
every way a real file can be (each parse error names the file, the row and the column)."""
from __future__ import annotations

import dataclasses
import re
import warnings

import numpy as np
import pytest

from orca_torch.core.request import Request
from orca_torch.lab.workload import (AZURE_CONV_CSV, at_rate, chat, from_azure_csv, from_csv, long_context,
    make_requests, make_workload, orca_homogeneous, orca_synthetic, slowest_rate,
    with_predictions, with_prompt_ids)

HEADER = "arrival_s,prompt_tokens,output_tokens\n"
MAX = "arrival_s,prompt_tokens,output_tokens,max_tokens\n"
AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _file(tmp_path, data: bytes | str, name="t.csv"):
    p = tmp_path / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


@pytest.mark.parametrize("call", [lambda p: chat(24, 150.0), lambda p: long_context(24, 150.0),
                                  lambda p: orca_synthetic(24, 150.0), lambda p: orca_homogeneous(24, 150.0),
                                  lambda p: from_csv(p, 24, 150.0),
                                  lambda p: from_azure_csv(AZURE_CONV_CSV, 24, 150.0)],
                         ids=["chat", "long_context", "orca_synthetic", "orca_homogeneous", "from_csv",
                              "from_azure_csv"])
def test_generators_take_the_request_count_and_rate_by_name_only(tmp_path, call):
    """`api.simulate` takes `rate` before `n_requests`; a generator took them the other way round, so
    `chat(24, 150.0)` beside `simulate("chat", 24, 150)` was silently 24 requests at 150 req/s."""
    with pytest.raises(TypeError, match="positional argument"):
        call(_file(tmp_path, HEADER + "0,10,5\n1,10,5\n"))


@pytest.mark.parametrize("seed", [-1, True, 1.5, "3", None, 2**63, 2**64])
def test_generators_refuse_a_seed_outside_the_one_rule(seed):
    calls = [lambda: chat(n_requests=5, seed=seed), lambda: long_context(n_requests=5, seed=seed),
             lambda: orca_synthetic(n_requests=5, seed=seed),
             lambda: make_workload("orca", n_requests=5, seed=seed),
             lambda: with_predictions(orca_synthetic(n_requests=3), 0.5, seed=seed),
             lambda: with_prompt_ids(orca_synthetic(n_requests=3), 100, seed=seed)]
    for call in calls:
        with pytest.raises(ValueError, match=r"seed must be an integer with 0 <= seed < 2\*\*63, got"):
            call()


def test_numpy_seeds_rates_and_counts_are_plain_ones_and_bools_are_refused():
    a = orca_synthetic(n_requests=np.int64(20), rate=np.int64(2), seed=np.int32(4))
    b = orca_synthetic(n_requests=20, rate=2.0, seed=4)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in a] == \
           [(r.arrival_s, r.prompt_len, r.output_len) for r in b]
    assert orca_synthetic(n_requests=20, seed=5)[1].arrival_s != b[1].arrival_s
    assert len(chat(n_requests=np.int64(7), rate=np.float32(3.0))) == 7
    for kw, says in ((dict(n_requests=True), "n_requests must be an integer >= 1, got True (a bool)"),
                     (dict(rate=True), "rate must be a finite number of requests per second > 0, got True"),
                     (dict(rate=np.float64("nan")), "rate must be a finite number")):
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            orca_synthetic(**{"n_requests": 5, **kw})


def test_lengths_too_large_for_a_number_are_refused_not_wrapped_around():
    with pytest.raises(ValueError, match=r"prompt length of row 0 is 1e\+30; lengths must be whole numbers"):
        make_requests([0.0], [1e30], [1])
    with pytest.raises(ValueError, match="output lengths must be whole numbers of tokens, got bools"):
        make_requests([0.0], [3], np.array([True]))


def test_homogeneous_lengths_and_a_vocab_past_what_numpy_draws_are_refused_by_name():
    for kw, says in ((dict(prompt_len=2**63), r"prompt_len must be an integer in \[1, 9007199254740991\], got "
                                                r"9223372036854775808"),
                     (dict(output_len=2**53), r"output_len must be an integer in \[1, 9007199254740991\]")):
        with pytest.raises(ValueError, match=says):
            orca_homogeneous(n_requests=3, **kw)
        with pytest.raises(ValueError, match=says):
            make_workload("orca-homogeneous", n_requests=3, **kw)
    assert {r.prompt_len for r in orca_homogeneous(n_requests=3, prompt_len=2**53 - 1)} == {2**53 - 1}
    with pytest.raises(ValueError, match=r"vocab must be an integer in \[1, 2\*\*63\], got 18446744073709551616"):
        with_prompt_ids(orca_synthetic(n_requests=2), 2**64)
    assert all(0 <= t < 2**63 for r in with_prompt_ids(orca_synthetic(n_requests=2), 2**63) for t in r.prompt_ids)


def test_trace_start_at_or_past_the_end_and_bool_start_or_scale(tmp_path):
    ok = _file(tmp_path, HEADER + "0,10,5\n1,20,3\n")
    with pytest.raises(ValueError, match=r"start=2, but the trace has 2 rows \(start must be 0\.\.1\)"):
        from_csv(ok, start=2)
    with pytest.raises(ValueError, match=r"start \(a row index\) must be an integer >= 0, got True \(a bool\)"):
        from_csv(ok, start=True)
    with pytest.raises(ValueError, match=r"scale must be a finite number > 0, got True \(a bool\)"):
        from_csv(ok, scale=True)
    assert [r.arrival_s for r in from_csv(ok, scale=np.float64(2.0), start=np.int64(0))] == [0.0, 2.0]
    assert [r.prompt_len for r in from_csv(ok, start=1)] == [20]
    far = _file(tmp_path, HEADER + "0,10,5\n1e10,20,3\n", "far.csv")    # (past the clock at its own pace)
    with pytest.raises(ValueError, match=r"far.csv: scale=1e\+300 puts the arrivals past the largest float"):
        from_csv(far, scale=1e300)
    with pytest.raises(ValueError, match=r"far.csv: scale=1e\+298 stretches rows 0\.\.1 too far"):
        from_csv(far, scale=1e298)
    with pytest.raises(ValueError, match=r"far.csv: rows 0\.\.1 reach too far at the trace's own pace"):
        from_csv(far)
    assert [r.arrival_s for r in from_csv(far, scale=0.25)] == [0.0, 2.5e9]


def test_a_trace_scale_that_stretches_the_arrivals_past_the_clock_is_refused(tmp_path):
    """A run of arrivals past `durations.CLOCK_SPAN_S` would stop mid-way in a ClockError: a replay
    whose `scale` stretches them so far is refused at the door, saying the largest scale that fits."""
    far = _file(tmp_path, HEADER + "0,10,5\n1e9,20,3\n", "far.csv")
    assert from_csv(far, scale=4.0)[-1].arrival_s == 4e9
    with pytest.raises(ValueError, match=re.escape(
            "far.csv: scale=5.0 stretches rows 0..1 too far: their arrivals would span about 5e+09 s, past the "
            "4.295e+09 s (2**32) within which the run's clock resolves a step to a microsecond; scale must be at "
            "most 4.294967296 for them") + "$"):
        from_csv(far, scale=5.0)


@pytest.mark.parametrize("read, data, span, most", [
    (from_csv, HEADER + "0,10,5\n1,10,5\n5e9,20,3\n", "5e+09", "0.8589934592"),
    (from_azure_csv, AZURE + "1900-01-01,10,5\n1900-01-01 00:00:01,10,5\n2060-01-01,20,3\n", "5.05e+09",
     "0.8506351859140237")], ids=["from_csv", "from_azure_csv"])
def test_a_trace_whose_own_arrivals_pass_the_clock_is_refused(tmp_path, read, data, span, most):
    """Replayed at its own pace (no scale, no rate), a trace whose arrivals span past
    `durations.CLOCK_SPAN_S` was taken, and its run stopped mid-way in a ClockError: it is refused at
    the door, as a scale that stretches a trace so far is, saying the largest scale that fits; the
    rows before the far one, and the trace at that scale, are taken."""
    far = _file(tmp_path, data, "far.csv")
    with pytest.raises(ValueError, match="^" + re.escape(
            f"{far}: rows 0..2 reach too far at the trace's own pace: their arrivals would span about {span} s, "
            "past the 4.295e+09 s (2**32) within which the run's clock resolves a step to a microsecond; scale must "
            f"be at most {most} for them") + "$"):
        read(far)
    assert [r.arrival_s for r in read(far, n_requests=2)] == [0.0, 1.0]
    assert read(far, scale=float(most))[-1].arrival_s <= 2.0 ** 32


@pytest.mark.parametrize("data, says", [
    (HEADER + "0,1e30,5\n", r"t.csv, line 2 \(row 0\), column prompt_tokens: prompt length 1e30; lengths must be "
                            r"whole numbers of tokens, 1 <= n < 2\*\*53"),
    (HEADER + "0,10,9007199254740992\n", r"column output_tokens: output length 9007199254740992; lengths must be "
                                         r"whole numbers of tokens, 1 <= n < 2\*\*53"),      # 2**53 itself
    (HEADER + "0,10,5\n1,20\n", r"t.csv, line 3 \(row 1\): 2 column\(s\), expected 3"),
    (HEADER + "0,10,5\n\n1,x,3\n", r"t.csv, line 4 \(row 1\), column prompt_tokens: cannot parse 'x' as a number; "
                                   r"lengths must be whole numbers of tokens, 1 <= n < 2\*\*53"),
    (HEADER + "2023-11-16 18:15:46,10,5\n", r"line 2 \(row 0\), column arrival_s: cannot parse '2023-11-16 18:15:46' "
                                           r"as a number; arrival times must be finite numbers of seconds >= 0 "
                                           r"\(a trace with dates and times is an Azure-format one: from_azure_csv\)"),
    (HEADER + "0,10,2.5\n", r"line 2 \(row 0\), column output_tokens: '2.5'; output lengths must be whole numbers"),
    (HEADER + "inf,10,2\n", r"line 2 \(row 0\), column arrival_s: inf; arrival times must be finite numbers"),
    (HEADER + "1,10,2\n0.5,3,3\n", r"line 3 \(row 1\), column arrival_s: arrivals must be sorted"),
    (b"arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,\xe9,3\n", r"t.csv, line 3: byte 0xe9 is not UTF-8 text"),
    ("", r"t.csv: empty file; expected the header"),
    (HEADER + "\n\n", r"t.csv: no requests after the header"),
    ("a,b,c\n0,1,1\n", r"t.csv, line 1: expected the header arrival_s,prompt_tokens,output_tokens"),
    (HEADER + "0,10,5,99,100\n", r"t.csv, line 2 \(row 0\): 5 column\(s\), expected 3"),     # nothing left unread
    ("arrival_s,prompt_tokens,output_tokens,user\n0,10,5\n", r"t.csv, header: the column 'user' names no field of "
     r"Request that a trace sets \(fields typed int, float or str: max_tokens, predicted_output, min_tokens\); add it "
     r"to a Request subclass given as request=, or leave the column out"),
    ("user,arrival_s,prompt_tokens,output_tokens\n1,0,10,5\n", r"t.csv, line 1: expected the header"),
    ("arrival_s,prompt_tokens,output_tokens,prompt_ids\n0,10,5,1\n", r"the column 'prompt_ids' names no field"),
    ("arrival_s,prompt_tokens,output_tokens,max_tokens,max_tokens\n0,10,5\n",
     r"t.csv, header: the column 'max_tokens' is there twice"),
    (MAX + "0,10,5,99,1\n", r"line 2 \(row 0\): 5 column\(s\), expected 4"),
    (MAX + "0,10,5,lots\n", r"t.csv, line 2 \(row 0\), column max_tokens: cannot parse 'lots' as a number; the field "
                            r"is typed int"),
    (MAX + "0,10,5,20.5\n", r"column max_tokens: '20.5'; the field is typed int: a whole number"),
    (HEADER[:-1] + ",predicted_output\n0,10,5,inf\n", r"column predicted_output: 'inf'; the field is typed float: a "
                                                      r"finite number"),
    (HEADER[:-1] + ",min_tokens\n0,10,5,\n", r"line 2 \(row 0\), column min_tokens: empty, and the field is typed "
                                             r"int, which takes no None"),
    (MAX + "0,10,5,20\n1,10,5,12\n", r"t.csv, line 3 \(row 1\): request 1: max_tokens must be an integer >= "
                                      r"prompt_len \+ output_len = 15, got 12"),
])
def test_plain_trace_errors_name_file_line_row_and_column(tmp_path, data, says):
    with pytest.raises(ValueError, match=says):
        from_csv(_file(tmp_path, data))


def test_plain_trace_with_a_bom_blank_lines_and_crlf_reads(tmp_path):
    p = _file(tmp_path, b"\xef\xbb\xbf" + (HEADER + "0,10,5,\n\n0.5,20,3\n").replace("\n", "\r\n").encode())
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in from_csv(p)] == [(0.0, 10, 5), (0.5, 20, 3)]


@pytest.mark.parametrize("data, says", [
    (AZURE + "2023-11-16 18:15:46.68,374,44\n\n2023-11-16 18:15:50.99,12\n",
     r"line 4 \(row 1\): 2 column\(s\), expected 3"),
    (AZURE + "yesterday,374,44\n", r"line 2 \(row 0\), column TIMESTAMP: cannot parse 'yesterday' as a timestamp"),
    (AZURE + "1700-01-01 00:00:00,374,44\n2250-01-01 00:00:00,12,3\n",
     r"the timestamps span more than 292 years, from 1700-01-01 00:00:00 to 2250-01-01 00:00:00"),
    (AZURE + "2023-11-16 18:15:46.68,374,0\n", r"column GeneratedTokens: output length 0; lengths must be"),
    (AZURE + "2023-11-16 18:15:46.68,1e30,4\n", r"column ContextTokens: prompt length 1e30"),
    (AZURE + "2023-11-16 18:15:50,1,1\n2023-11-16 18:15:46,1,1\n", r"line 3 \(row 1\), column TIMESTAMP: arrivals "
                                                                 r"must be sorted"),
])
def test_azure_trace_errors_name_file_line_row_and_column(tmp_path, data, says):
    with pytest.raises(ValueError, match=says):
        from_azure_csv(_file(tmp_path, data))


@pytest.mark.parametrize("stamp", ["0", "1", "1700000000", "2023", "now", "today", "-2023-11-16",
                                   "2023-11-16Z", "2023-11-16 18:00+24:00", "2023-11-16 18:00+01:60",
                                   "1677-09-21 00:12:44+01:00", "2262-04-11 23:47:16-01:00"])
def test_azure_timestamps_that_are_not_dates_are_refused_not_read_as_years_or_the_clock(tmp_path, stamp):
    """numpy reads a bare number as a year (seconds 0, 1 would arrive a year apart) and "now" as the clock;
    an offset goes with a time of day, within a day, and keeps the time within int64 nanoseconds."""
    p = _file(tmp_path, AZURE + f"{stamp},10,5\n2023-11-16 18:15:47,20,6\n")
    with pytest.raises(ValueError, match=rf"line 2 \(row 0\), column TIMESTAMP: cannot parse '{re.escape(stamp)}' as a "
                                         r"timestamp; TIMESTAMP is a date and time, YYYY-MM-DD.*use from_csv"):
        from_azure_csv(p)


def test_azure_timestamps_with_a_date_alone_a_t_or_a_utc_offset_still_read(tmp_path):
    p = _file(tmp_path, AZURE + "2023-11-16,1,1\n2023-11-16T00:00:01.5,2,2\n2023-11-16 00:00:03Z,3,3\n"
                                "2023-11-16 01:00:04+01:00,4,4\n")
    got = [(r.arrival_s, r.prompt_len) for r in from_azure_csv(p)]
    assert got == [(0.0, 1), (1.5, 2), (3.0, 3), (4.0, 4)]


def test_azure_utc_offsets_are_applied_without_numpy_s_deprecated_reading_of_them(tmp_path):
    """numpy's datetime64 reads an offset only with a deprecation warning (UserWarning: "no explicit
    representation of timezones"), on every cell that has one; the reader applies it itself."""
    p = _file(tmp_path, AZURE + "2023-11-16 18:00:00Z,1,1\n2023-11-16T19:00:01+01:00,2,2\n"
                                "2023-11-16 13:30:02-0430,3,3\n2023-11-16 18:00:03+00:00,4,4\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [(r.arrival_s, r.prompt_len) for r in from_azure_csv(p)]
    assert got == [(0.0, 1), (1.0, 2), (2.0, 3), (3.0, 4)]


def test_azure_trace_skips_blank_lines_and_a_bom(tmp_path):
    p = _file(tmp_path, b"\xef\xbb\xbf" + (AZURE + "2023-11-16 18:15:46.5,374,44\n\n"
                                           "2023-11-16 18:15:47.0,396,109\n\n").encode())
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in from_azure_csv(p)] == [(0.0, 374, 44), (0.5, 396, 109)]


@pytest.mark.parametrize("read", [from_csv, from_azure_csv, lambda p: chat(n_requests=3, path=p)],
                         ids=["plain", "azure", "chat"])
def test_a_trace_path_that_is_no_file_is_refused_by_name(tmp_path, read):
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path))} is not a file: give the path of a trace's CSV"):
        read(tmp_path)
    missing = tmp_path / "nope.csv"
    with pytest.raises(ValueError, match=f"^{re.escape(str(missing))}: no such file"):
        read(missing)


def test_at_rate_rescales_copies_and_refuses_lists_that_span_no_time():
    reqs = make_requests([2.0, 3.0, 6.0], [5, 6, 7], [1, 2, 3])
    reqs[1].prompt_ids = [1, 2, 3, 4, 5, 6]
    out = at_rate(reqs, 4.0)                                  # mean rate (n - 1) / span = 4
    assert [r.arrival_s for r in out] == [0.0, 0.125, 0.5]
    assert [r.arrival_s for r in reqs] == [2.0, 3.0, 6.0]     # the originals are untouched
    assert out[1].prompt_ids == [1, 2, 3, 4, 5, 6] and out[1].prompt_ids is not reqs[1].prompt_ids
    with pytest.raises(ValueError, match="span no time"):
        at_rate([Request(0, 1.0, 3, 3), Request(1, 1.0, 3, 3)], 2.0)
    with pytest.raises(ValueError, match=r"their arrivals span 5e-324 s, too little to stretch"):
        at_rate([Request(0, 0.0, 3, 3), Request(1, 5e-324, 3, 3)], 8.0)
    with pytest.raises(ValueError, match="rate must be a finite number of requests per second > 0"):
        at_rate(reqs, 0)


@pytest.mark.parametrize("call", [lambda v: at_rate(v, 2.0), lambda v: with_predictions(v, 0.5),
                                  lambda v: with_prompt_ids(v, 100)])
def test_what_takes_a_list_of_requests_says_so_when_given_something_else(call):
    for bad, says in ((None, "requests must be a list of Request objects, got None"), (5, "got 5"),
                      (Request(0, 0.0, 3, 3), "got Request"), ([Request(0, 0.0, 3, 3), (1, 0.5, 3, 3)], "item 1 is")):
        with pytest.raises(ValueError, match=re.escape(says)):
            call(bad)


@pytest.mark.parametrize("field, call", [("predicted_output", lambda v: with_predictions(v, 0.5, seed=3)),
                                         ("prompt_ids", lambda v: with_prompt_ids(v, 100, seed=3))])
def test_copies_with_a_field_set_leave_the_callers_requests_as_they_were(field, call):
    def given():
        return [Request(0, 0.0, 5, 3, 16, 2.5, [1, 2, 3, 4, 5], 1, (7,)), Request("b", 1.5, 2, 2)]

    reqs = given()
    before = [dataclasses.astuple(r) for r in reqs]
    out = call(reqs)
    assert [dataclasses.astuple(r) for r in reqs] == before
    assert all(o is not r for o, r in zip(out, reqs))
    values = [getattr(r, field) for r in out]
    assert values == [getattr(r, field) for r in call(given())]             # seeded
    assert None not in values and values != [getattr(r, field) for r in reqs]
    kept = [f.name for f in dataclasses.fields(Request) if f.init and f.name != field]
    assert [[getattr(r, f) for f in kept] for r in out] == [[getattr(r, f) for f in kept] for r in reqs]


@pytest.mark.parametrize("cols, says", [
    (([0.0, 1.0], [True, 4], [1, 2]), r"prompt value of row 0 is True; lengths must be numbers, not bools"),
    (([0.0, 1.0], [3, 4], [1, np.True_]), r"output value of row 1 is np.True_; lengths must be numbers"),
    (([0.0, "a"], [3, 4], [1, 2]), r"arrival value of row 1 is 'a'; arrival times must be numbers"),
    ((np.array([True, False]), [3, 4], [1, 2]), r"arrival times must be numbers, got bool"),
    ((0.0, 3, 1), r"the arrival column must be a 1-D list or array, got 0.0"),
    (([[0.0]], [[3]], [[1]]), r"the arrival column must be a 1-D list or array"),
    (([0.0, 1.0], [3, 4], "ab"), r"the output column must be a 1-D list or array, got 'ab'"),
])
def test_make_requests_names_the_column_and_row_of_what_is_not_a_number(cols, says):
    with pytest.raises(ValueError, match=says):
        make_requests(*cols, source="mine")
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in make_requests([0, 1.5], [3.0, 4], np.array([1, 2]))] \
        == [(0.0, 3, 1), (1.5, 4, 2)]         # ints for arrivals, whole floats for lengths: fine


@pytest.mark.parametrize("col, says", [([None], "prompt length of row 0 is None"),
                                       ([10**30], "prompt length of row 0 is 1000000000000000000000000000000"),
                                       ([3 + 2j], "prompt lengths must be whole numbers of tokens, got complex"),
                                       ([3.5], "prompt length of row 0 is 3.5; lengths must be whole numbers"),
                                       (np.array([0.25]), "prompt length of row 0 is 0.25; lengths must be whole")])
def test_lengths_that_are_no_count_of_tokens_name_the_row(col, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        make_requests([0.0], col, [1])


def test_what_make_requests_refuses_is_quoted_in_a_line():
    """A refused column or value is quoted in brief, its repr never written whole: of a column of a
    thousand rows only the first dozen are written (the whole repr was made, then cut to 200
    characters), a string of a million characters is cut in its middle; an int past the largest float
    is a length too long at its row (it raised OverflowError)."""
    asked = []

    class Cell:
        def __repr__(self):
            asked.append(self)
            return "c"

    with pytest.raises(ValueError) as e:
        make_requests([[0.0, Cell()] for _ in range(1000)], [1] * 1000, [1] * 1000, source="mine")
    assert str(e.value) == f"mine: the arrival column must be a 1-D list or array, got [{'[0.0, c], ' * 12}...]"
    assert len(asked) == 12
    with pytest.raises(ValueError) as e:
        make_requests([0.0], ["x" * 10**6], [1], source="mine")
    assert str(e.value) == (f"mine: prompt value of row 0 is '{'x' * 37}...{'x' * 38}'; lengths must be numbers, "
                            "not bools or strings")
    with pytest.raises(ValueError) as e:
        make_requests([0.0, 1.0], [3, 10**400], [1, 1], source="mine")
    assert str(e.value) == ("mine: prompt length of row 1 is <an integer of about 401 digits>; lengths must be whole "
                            "numbers of tokens, 1 <= n < 2**53")


def test_a_trace_file_is_quoted_in_a_line(tmp_path):
    """A header or a cell that cannot be read is quoted in brief, however long its line."""
    with pytest.raises(ValueError) as e:
        from_csv(_file(tmp_path, "x" * 100_000 + ",b,c\n0,1,1\n"))
    assert str(e.value).endswith(f"t.csv, line 1: expected the header arrival_s,prompt_tokens,output_tokens, got "
                                 f"'{'x' * 37}...{'x' * 34},b,c'")
    for data, column in ((HEADER + "0," + "y" * 100_000 + ",5\n", "prompt_tokens"),
                         (HEADER + "z" * 100_000 + ",1,5\n", "arrival_s")):
        with pytest.raises(ValueError) as e:
            from_csv(_file(tmp_path, data))
        assert f"column {column}: cannot parse '" in str(e.value) and len(str(e.value)) < 400
    with pytest.raises(ValueError) as e:
        from_azure_csv(_file(tmp_path, AZURE + "w" * 100_000 + ",1,5\n"))
    assert "column TIMESTAMP: cannot parse '" in str(e.value) and len(str(e.value)) < 600



@pytest.mark.parametrize("read, head", [(from_csv, HEADER), (from_azure_csv, AZURE)])
def test_a_cell_past_the_csv_module_s_limit_is_refused_by_line(tmp_path, read, head):
    """A cell of more than 131,072 characters (the csv module's limit) raised csv.Error, not the
    refusal naming the file and the line that every other unreadable trace gets."""
    with pytest.raises(ValueError, match=r"t\.csv, line 3: field larger than field limit \(131072\); a trace's cells "
                                         r"are numbers and timestamps$"):
        read(_file(tmp_path, head + "0,1,1\n0," + "7" * 200_000 + ",5\n"))


@pytest.mark.parametrize("col", [[2**53], np.array([5, 2**60]), np.array([5, 2**63 + 5], dtype=np.uint64)])
def test_integer_lengths_past_2_53_are_refused_as_float_ones_are(col):
    with pytest.raises(ValueError, match=r"prompt length of row \d is \d+; lengths must be whole numbers of tokens, "
                                         r"1 <= n < 2\*\*53"):
        make_requests(np.arange(len(col), dtype=float), col, [1] * len(col))


def test_at_rate_names_arrivals_out_of_order_as_such():
    late_first = [Request(0, 5.0, 3, 3), Request(1, 1.0, 3, 3), Request(2, 2.0, 3, 3)]
    with pytest.raises(ValueError, match="arrivals must be sorted, but row 1 arrives at 1.0 before row 0 at 5.0"):
        at_rate(late_first, 2.0)


def test_a_named_workload_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match=r"unknown workload \['orca'\]; known: chat, long-context"):
        make_workload(["orca"])
    with pytest.raises(ValueError, match="workload 'orca' has no setting 'max_context'; its own settings: none"):
        make_workload("orca", n_requests=5, max_context=100)
    with pytest.raises(ValueError, match="workload 'orca-homogeneous' has no setting 'path'; its own settings: "
                                         "prompt_len, output_len"):
        make_workload("orca-homogeneous", n_requests=5, path="x.csv")
    assert len(make_workload("chat", n_requests=5, max_context=2000)) == 5
    with pytest.raises(TypeError, match="takes 1 positional argument but 3 were given"):
        make_workload("chat", 24, 150)          # (simulate takes rate first, the generators n_requests: by name)
    for call in (lambda: chat(n_requests=5, path=None), lambda: from_csv(None), lambda: from_azure_csv(5)):
        with pytest.raises(ValueError, match="path must be a file path"):
            call()


@pytest.mark.parametrize("call", [lambda r: orca_synthetic(n_requests=5, rate=r),
                                  lambda r: long_context(n_requests=5, rate=r),
                                  lambda r: chat(n_requests=5, rate=r),
                                  lambda r: make_workload("orca-homogeneous", n_requests=5, rate=r),
                                  lambda r: at_rate(orca_synthetic(n_requests=5), r),
                                  lambda r: from_azure_csv(n_requests=5, rate=r)])
def test_a_rate_too_slow_for_the_run_clock_is_refused_with_the_slowest_allowed(call):
    """Below (n - 1) / 2**32 req/s the arrivals reach past the range the run's clock resolves, and a
    run of them stopped mid-way with a clock error (or, far enough below, the arrivals overflowed):
    every entry that takes a rate refuses one, naming the slowest rate, which itself is taken."""
    floor = slowest_rate(5)
    for rate in (1e-320, 1e-300, floor * 0.999):
        with pytest.raises(ValueError) as e:
            call(rate)
        assert f"rate={rate!r} requests per second is too slow for 5 requests: their arrivals" in str(e.value)
        assert str(e.value).endswith(f"rate must be at least (n - 1) / 2**32 = {floor!r} requests per second")
    last = call(floor)[-1]
    assert 2**30 < last.arrival_s < 2**34     # about 2**32 s


def test_at_rate_refuses_arrivals_too_close_to_stretch_to_the_rate():
    """A rate the clock holds, but a list whose arrivals are so close that the factor overflows."""
    with pytest.raises(ValueError, match=r"^cannot rescale 2 requests to rate=1e-09: their arrivals span 1e-300 s, "
                                         r"too little to stretch to 1e\+09 s \(the factor is past the largest float\)"):
        at_rate([Request(0, 0.0, 3, 3), Request(1, 1e-300, 3, 3)], 1e-9)
    assert [r.arrival_s for r in at_rate([Request(0, 0.0, 3, 3), Request(1, 1e-300, 3, 3)], 1.0)] == pytest.approx([0, 1])


def test_prediction_noise_is_bounded_so_its_predictions_stay_numbers():
    with pytest.raises(ValueError, match=r"sigma must be a finite number in \[0, 10\], got 1000.0"):
        with_predictions(orca_synthetic(n_requests=50), 1000.0)
    reqs = with_predictions(orca_synthetic(n_requests=2000), 10.0, seed=1)
    assert all(0 < r.predicted_output < float("inf") for r in reqs)


@pytest.mark.parametrize("name", ["chat", "long-context", "orca", "orca-homogeneous"])
def test_a_workload_larger_than_the_memory_is_refused_before_it_is_drawn(name, monkeypatch):
    """A trillion requests was numpy's MemoryError, and a billion began to build a billion `Request`s;
    both are refused saying what they need and what there is. The memory available is fixed here: read
    twice, it moves by megabytes, and a count one request past the first reading could pass the second
    and be drawn."""
    import orca_torch.checks as checks
    from orca_torch.lab.workload import REQUEST_BYTES

    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 10**9)
    for n in (10**9 // REQUEST_BYTES + 1, 10**12):
        with pytest.raises(ValueError, match=rf"n_requests={n:,} \(about \d+ bytes a request\) needs .* but only "
                                             r"1.0 GB is available here"):
            make_workload(name, n_requests=n)


@pytest.mark.parametrize("cols, says", [
    ((np.array([0, 1500], dtype="timedelta64[ms]"), [3, 4], [1, 2]),
     r"the arrival column holds timedelta64\[ms\] values; arrival times must be numbers of seconds"),
    (([0.0, 1.0], np.array([3, 4], dtype="timedelta64[s]"), [1, 2]), r"the prompt column holds timedelta64\[s\]"),
    (([0.0, 1.0], np.array(["3", "4"]), [1, 2]), r"the prompt column holds <U1 values; lengths must be numbers"),
    (([0.0, 1.0], [3, 4], np.array([b"1", b"2"])), r"the output column holds \|S1 values; lengths must be numbers"),
])
def test_make_requests_refuses_durations_and_text_arrays_rather_than_reading_their_raw_numbers(cols, says):
    # 1,500 ms read as its raw count would arrive at 1,500 s; a text array would be parsed where a list is refused
    with pytest.raises(ValueError, match=says):
        make_requests(*cols)


def test_make_requests_refuses_a_negative_first_arrival_and_a_zero_length_naming_its_source():
    with pytest.raises(ValueError, match=r"^mine: arrival times must be >= 0, got -0\.5$"):
        make_requests([-0.5, 1.0], [3, 3], [3, 3], source="mine")
    with pytest.raises(ValueError, match=r"^mine: prompt length of row 1 is 0; lengths must be >= 1$"):
        make_requests([0.0, 1.0], [3, 0], [3, 3], source="mine")
    with pytest.raises(ValueError, match=r"^mine: output length of row 0 is 0; lengths must be >= 1$"):
        make_requests(np.array([0.0]), np.array([3]), np.array([0]), source="mine")


@pytest.mark.parametrize("read, data, hint", [
    (from_csv, AZURE + "2023-11-16 18:15:46,10,5\n", "that is the header of a trace from_azure_csv reads"),
    (from_azure_csv, HEADER + "0,10,5\n", "that is the header of a trace from_csv reads"),
    (lambda p: chat(n_requests=3, path=p), HEADER + "0,10,5\n", "that is the header of a trace from_csv reads"),
    (from_csv, HEADER.replace(",", ";") + "0;10;5\n", "its cells are separated by ';': separate them by commas"),
    (from_azure_csv, AZURE.replace(",", "\t") + "2023-11-16\t10\t5\n",
     r"its cells are separated by '\\t': separate them by commas"),
    (from_azure_csv, AZURE.replace("ContextTokens", "ContextToken") + "2023-11-16,10,5\n",
     r"'ContextToken' is not a column of such a trace: did you mean 'ContextTokens'\?"),
    (from_csv, HEADER.replace("prompt_tokens", "prompt_token") + "0,10,5\n",
     r"'prompt_token' is not a column of such a trace: did you mean 'prompt_tokens'\?"),
    (from_azure_csv, AZURE.replace("\n", ",user\n") + "2023-11-16,10,5,u1\n",
     r"such a trace has these three columns alone, and user would be left unread: drop them \(from_csv reads "
     r"further columns, each setting a request's field of its name\)"),
], ids=["azure-to-plain", "plain-to-azure", "plain-to-chat", "semicolons", "tabs", "misspelt-azure", "misspelt-plain",
        "azure-extra-column"])
def test_a_header_of_the_other_format_or_with_other_separators_says_so(tmp_path, read, data, hint):
    """A trace given to the other reader, saved with semicolons or tabs, with a misspelt column or
    with a column an Azure trace does not have, was refused with only the header expected: the
    message now says what the file is (an extra column is refused, not dropped unread)."""
    p = _file(tmp_path, data)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}, line 1: expected the header .*; {hint}$"):
        read(p)


def test_a_trace_read_into_a_request_subclass_refuses_what_is_no_such_class_and_its_fields_bad_cells(tmp_path):
    @dataclasses.dataclass(eq=False, slots=True)
    class Tenant(Request):
        tenant: str = ""
        weight: float = 1.0

    path = _file(tmp_path, "arrival_s,prompt_tokens,output_tokens,weight,tenant\n0,10,5,2,a\n1,10,5,x,b\n")
    for request in ("Tenant", Tenant(0, 0.0, 1, 1), dict):
        with pytest.raises(ValueError, match=r"request must be Request or a dataclass subclass of it \(each row built "
                                             r"as request\(row, arrival_s, prompt_len, output_len, \*\*its further "
                                             r"columns\)\), got"):
            from_csv(path, request=request)
    with pytest.raises(ValueError, match=r"line 3 \(row 1\), column weight: cannot parse 'x' as a number; the field "
                                         r"is typed float"):
        from_csv(path, request=Tenant)
    with pytest.raises(ValueError, match=r"the column 'weight' names no field of Request that a trace sets"):
        from_csv(path)


def test_a_request_subclass_that_refuses_a_row_is_named_with_the_row_with_or_without_further_columns(tmp_path):
    """A refusal of the caller's class (a field it needs that no column gives, a check of its own)
    names the file, line and row, as it does where further columns set its fields."""
    @dataclasses.dataclass(eq=False, slots=True)
    class Needs(Request):
        tenant: str = dataclasses.field(kw_only=True)

    @dataclasses.dataclass(eq=False, slots=True)
    class Short(Request):
        def __post_init__(self):
            Request.__post_init__(self)
            if self.prompt_len > 5:
                raise ValueError("prompts of at most 5 tokens")

    plain = _file(tmp_path, "arrival_s,prompt_tokens,output_tokens\n0,3,5\n1,10,5\n")
    with pytest.raises(ValueError, match=r"^.*t\.csv, line 2 \(row 0\): .*missing 1 required keyword-only argument: "
                                         r"'tenant'$"):
        from_csv(plain, request=Needs)
    for path in (plain, _file(tmp_path, "arrival_s,prompt_tokens,output_tokens,min_tokens\n0,3,5,1\n1,10,5,1\n",
                              "more.csv")):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}, line 3 \(row 1\): prompts of at most 5 "
                                             r"tokens$"):
            from_csv(path, request=Short)
    assert [r.prompt_len for r in from_csv(plain, request=Short, n_requests=1)] == [3]
