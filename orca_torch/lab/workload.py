"""Workloads: who arrives when, with how long a prompt and how long an answer (lecture §4.5, §5.2, §6.1).

Every generator is seeded and returns a list of `Request` sorted by arrival. Its sizes are taken by
name only (`chat(n_requests=150, rate=24.0)`), as `make_workload` and the trace replays take them:
`api.simulate` takes `rate` before `n_requests`, so `chat(24, 150)` beside `simulate("chat", 24, 150)`
would silently be another workload.

- `chat`: prompt and output lengths drawn (with replacement) from the Azure LLM inference trace 2023,
  conversation service (`data/azure_llm_2023_conv.csv`; Azure/AzurePublicDataset, CC-BY 4.0, from
  P. Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024).
  Real production lengths: prompts average about 1,150 tokens, outputs about 211. The lecture's own
  chat distribution is not published.
- `long_context` (§6.1): prompt ~ U{1024..3072}, output ~ U{1..1023}: means 2048 and 512 exactly,
  at most 4,095 tokens in all, so nothing is capped at an 8K context. The wide output spread is what
  separates reserving the maximum, a power of two, and the true length.
- `orca_synthetic` (OSDI 2022 §6): input ~ U{32..512}, output ~ U{1..128}, no end-of-sequence token;
  `orca_homogeneous`: every request alike, e.g. (32, 32) or (256, 256) (Orca's Fig. 11).
- `from_azure_csv` / `from_csv`: trace replay at the trace's own rate or rescaled to a given one;
  `from_csv` reads further columns into the fields they name (of a `Request` subclass: `request=`).
- `trace_lengths`: the prompt and output lengths of a whole Azure trace (what `chat` draws from).

Arrivals are Poisson: exponential gaps with mean 1/rate. The gaps are drawn at rate 1 and divided by
the rate, so one seed gives the same requests at every rate, only closer together — which keeps a
goodput bisection over the rate free of sampling noise.
"""
from __future__ import annotations

import copy
import csv
import difflib
import dataclasses
import functools
import inspect
import io
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from orca_torch.checks import brief, check_fits_in_memory, check_int, check_items, check_real, check_seed
from orca_torch.core.durations import CLOCK_SPAN_S
from orca_torch.core.request import Request
from orca_torch.sim.collector import cyclic_gc_paused

AZURE_CONV_CSV = Path(__file__).parents[1] / "data" / "azure_llm_2023_conv.csv"


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """`n` arrival times of a Poisson process at `rate` per second, starting from 0: the draw of the
    builders (`chat`, `_uniform`), which check `n` (`_check_n`) and `rate` (`check_rate`) first."""
    gaps = rng.exponential(1.0, size=n)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps) / rate
    assert np.isfinite(arrivals[-1])        # (n - 1 gaps of mean 1 / rate end near (n - 1) / rate <= 2**32)
    return arrivals


def slowest_rate(n_requests: int) -> float:
    """The smallest mean rate at which `n_requests` arrivals (n - 1 gaps of 1 / rate on average) stay
    within the run's clock range, `CLOCK_SPAN_S` from the first: (n - 1) / 2**32 req/s, 1.4e-7 for
    600 requests (0 for one request, whose clock starts and stays near 0)."""
    return (n_requests - 1) / CLOCK_SPAN_S


def past_the_clock(span_s: float) -> str:
    """Why arrivals that span `span_s` seconds, more than `CLOCK_SPAN_S`, cannot be run: a run would
    stop mid-way with a `durations.ClockError` (said alike for a slow rate and a trace, stretched by its
    scale or at its own pace)."""
    return (f"their arrivals would span about {span_s:.3g} s, past the {CLOCK_SPAN_S:.4g} s (2**32) within which the "
            "run's clock resolves a step to a microsecond")


def refuse_slower_than_the_clock(name: str, rate: float, n_requests: int, allowed: str | None = None) -> None:
    """ValueError for a rate > 0 too slow for `n_requests` arrivals to fit the run's clock
    (`slowest_rate`): a run at it would stop mid-way with a `durations.ClockError`. `allowed` names
    what must be at least the slowest rate (default: `name`)."""
    floor = slowest_rate(n_requests)
    if 0 < rate < floor:
        raise ValueError(f"{name}={rate!r} requests per second is too slow for {n_requests} requests: "
                         f"{past_the_clock((n_requests - 1) / rate)}; {allowed or name} must be at least (n - 1) / 2**32 = "
                         f"{floor!r} requests per second")


def check_rate(rate: float, n_requests: int) -> float:
    """A mean arrival rate (req/s) > 0 at which `n_requests` arrivals fit the run's clock."""
    rate = check_real("rate", rate, 0.0, lo_open=True, unit="requests per second")
    refuse_slower_than_the_clock("rate", rate, n_requests)
    return rate


REQUEST_BYTES = 320
"""About what a generated request takes at its peak while a workload is drawn (a `Request` and its
share of the draw's arrays; 250-320 bytes measured with tracemalloc for the four workloads)."""


def _check_n(n: int) -> int:
    """A count of requests the memory can hold: a billion is refused before a billion are built."""
    n = check_int("n_requests", n, 1)
    if n * REQUEST_BYTES > 1 << 26:             # (a smaller draw is not worth a read of /proc/meminfo)
        check_fits_in_memory(f"n_requests={n:,} (about {REQUEST_BYTES} bytes a request)", n * REQUEST_BYTES)
    return n


def _rng(seed: int) -> np.random.Generator:
    """The generator of a seed (the project's one seed rule, `checks.check_seed`)."""
    return np.random.default_rng(check_seed(seed))


# A length beyond this cannot be held exactly by a float column: no context is anywhere near it.
MAX_LENGTH = 2**53
_LENGTHS = "lengths must be whole numbers of tokens, 1 <= n < 2**53"


def _lengths(col: np.ndarray, name: str, source: str) -> np.ndarray:
    """A column of token counts as int64, or an error naming the first bad row."""
    got = {"b": "bools", "c": "complex numbers"}.get(col.dtype.kind)
    if got is None and not np.issubdtype(col.dtype, np.integer):
        try:
            try:
                f = col.astype(float)
            except OverflowError:           # an int past the largest float: a length too long, named at its row
                f = np.array([_float_or_inf(x) for x in col])
        except (TypeError, ValueError):
            got = str(col.dtype)
    if got is not None:
        raise ValueError(f"{source}: {name} lengths must be whole numbers of tokens, got {got}")
    if not np.issubdtype(col.dtype, np.integer):
        with np.errstate(invalid="ignore"):         # (inf % 1 is NaN: inf is refused as not finite)
            bad = np.flatnonzero(~np.isfinite(f) | (f % 1 != 0) | (np.abs(f) >= MAX_LENGTH))
        if len(bad):
            v = col[bad[0]]
            v = v.item() if isinstance(v, np.generic) else v        # (an object column holds Python values)
            raise ValueError(f"{source}: {name} length of row {bad[0]} is {brief(v)}; {_LENGTHS}")
        col = f.astype(np.int64)
    low = np.flatnonzero(col < 1)
    if len(low):
        raise ValueError(f"{source}: {name} length of row {low[0]} is {col[low[0]]}; lengths must be >= 1")
    high = np.flatnonzero(col >= MAX_LENGTH)
    if len(high):
        raise ValueError(f"{source}: {name} length of row {high[0]} is {col[high[0]]}; {_LENGTHS}")
    return col.astype(np.int64, copy=False)


def _float_or_inf(x: object) -> float:
    """`x` as numpy converts it to a float (None: NaN), or infinity for an int past the largest float."""
    try:
        return np.array([x], dtype=object).astype(float)[0]
    except OverflowError:
        return math.inf


def make_requests(arrivals: Sequence[float], prompt_lens: Sequence[int], output_lens: Sequence[int],
                  source: str = "workload") -> list[Request]:
    """Requests with ids 0..n-1 from three columns (none: no requests); clear errors for NaN/unsorted
    arrivals or bad lengths."""
    cols = {"arrival": arrivals, "prompt": prompt_lens, "output": output_lens}
    for name, col in cols.items():
        if isinstance(col, (str, bytes)) or np.ndim(col) != 1:
            raise ValueError(f"{source}: the {name} column must be a 1-D list or array, got {brief(col, 150)}")
        if not isinstance(col, np.ndarray):
            bad = [i for i, x in enumerate(col) if isinstance(x, (bool, np.bool_, str, bytes))]
            if bad:
                raise ValueError(f"{source}: {name} value of row {bad[0]} is {brief(col[bad[0]])}; "
                                 f"{'arrival times' if name == 'arrival' else 'lengths'} must be numbers, "
                                 "not bools or strings")
    a, p, o = np.asarray(arrivals), np.asarray(prompt_lens), np.asarray(output_lens)
    for name, col in zip(cols, (a, p, o)):
        if col.dtype.kind in "mMUS":        # (a number of some unit, a date, or text: no seconds, no count)
            want = ("arrival times must be numbers of seconds (a duration column d: d / np.timedelta64(1, 's'))"
                    if name == "arrival" else "lengths must be numbers of tokens")
            raise ValueError(f"{source}: the {name} column holds {col.dtype} values; {want}")
    if a.dtype == bool or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise ValueError(f"{source}: arrival times must be numbers, got {a.dtype}")
    a = a.astype(float)
    if not len(a) == len(p) == len(o):
        raise ValueError(f"{source}: columns differ in length ({len(a)}, {len(p)}, {len(o)})")
    bad = np.flatnonzero(~np.isfinite(a))
    if len(bad):
        raise ValueError(f"{source}: arrival time of row {bad[0]} is {a[bad[0]]} (must be a finite number)")
    _check_sorted(a, lambda i: source)
    if len(a) and a[0] < 0:
        raise ValueError(f"{source}: arrival times must be >= 0, got {a[0]}")
    return _build(a, _lengths(p, "prompt", source), _lengths(o, "output", source))


def _build(arrivals: np.ndarray, prompts: np.ndarray, outputs: np.ndarray) -> list[Request]:
    """Requests with ids 0..n-1 from columns already known to be good (drawn here, or checked)."""
    with cyclic_gc_paused():
        return [Request(i, a, p, o) for i, (a, p, o) in
                enumerate(zip(np.asarray(arrivals, dtype=float).tolist(), prompts.tolist(), outputs.tolist()))]


def at_rate(requests: Sequence[Request], rate: float) -> list[Request]:
    """Copies of `requests` with arrivals shifted to start at 0 and scaled to a mean rate of `rate`
    req/s, (n - 1) / span: the same requests, closer together or further apart (trace replay, goodput).
    The requests given are not changed."""
    reqs = check_items("requests", requests, Request)
    rate = check_rate(rate, len(reqs))
    a = np.array([r.arrival_s for r in reqs], dtype=float)
    _check_sorted(a, lambda i: "cannot rescale to a rate")
    if len(a) < 2 or a[-1] <= a[0]:
        raise ValueError(f"cannot rescale {len(a)} request(s) to a rate: their arrivals span no time")
    span = float(a[-1] - a[0])
    with np.errstate(over="ignore", invalid="ignore"):
        a = (a - a[0]) * ((len(a) - 1) / span / rate)           # (their own rate over the rate asked for)
    if not np.isfinite(a[-1]):
        raise ValueError(f"cannot rescale {len(a)} requests to rate={rate!r}: their arrivals span {span!r} s, too "
                         f"little to stretch to {(len(a) - 1) / rate:.3g} s (the factor is past the largest float)")
    return fresh_copies(reqs, a.tolist())


def fresh_copies(requests: list[Request], arrivals: Sequence[float] | None = None) -> list[Request]:
    """Copies of checked requests as never run (their prompt ids copied too), with `arrivals` in
    place of their own if given: what a run or a rescaling takes, so the caller's objects are never
    run or changed. A copy of a `Request` subclass is one of that class, with its own fields and
    any other attribute it carries (a policy may read them: `_subclass_copy`)."""
    arrivals = [r.arrival_s for r in requests] if arrivals is None else arrivals
    with cyclic_gc_paused():
        return [Request(r.req_id, t, r.prompt_len, r.output_len, r.max_tokens, r.predicted_output,
                        None if r.prompt_ids is None else list(r.prompt_ids), r.min_tokens, r.stop_token_ids,
                        r.sampling)
                if type(r) is Request else _subclass_copy(r, t)
                for r, t in zip(requests, arrivals)]


_RUN_STATE = {f.name: f.default for f in dataclasses.fields(Request) if not f.init}


def _subclass_copy(r: Request, arrival: float) -> Request:
    """A copy of an object of a `Request` subclass, made without its `__init__` (which may take other
    arguments than the fields, or set attributes that are no field): every attribute it has
    (`copy.copy`), the run's counters those of a request never run, checked as a new request is."""
    c = copy.copy(r)
    for name, default in _RUN_STATE.items():
        setattr(c, name, default)
    c.arrival_s = arrival
    c.prompt_ids = None if r.prompt_ids is None else list(r.prompt_ids)
    c.validate()
    return c


# ---- synthetic and trace-drawn workloads -----------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _azure_parsed(path: str, version: tuple[int, int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_read_azure` of one version of a file, read-only. `version` is only the cache's key: the
    file's inode, size, modification and change times (`_version`)."""
    cols = _read_azure(Path(path))
    for c in cols:
        c.flags.writeable = False
    return cols


def _version(path: Path) -> tuple[int, int, int, int]:
    """What tells a file's versions apart without reading it: its modification time alone does not
    (`cp -p`, `tar x` and `rsync -t` set an old one), but the change time moves with every write and
    every such setting, and no tool sets it."""
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _check_trace_file(path: str | os.PathLike) -> Path:
    """A trace's path: a file that is there (a CSV is read whole from it)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path (a str or a Path), got {brief(path)} ({type(path).__name__})")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p} is not a file: give the path of a trace's CSV file" if p.exists() else
                         f"{p}: no such file; give the path of a trace's CSV file")
    return p


def trace_lengths(path: str | os.PathLike = AZURE_CONV_CSV) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths of every row of an Azure trace CSV, by default the conversation
    trace `chat` draws from: two read-only integer arrays in the file's row order, parsed once per
    version of the file (`_version`)."""
    path = _check_trace_file(path).resolve()
    _, p, o = _azure_parsed(str(path), _version(path))
    return p, o


def chat(*, n_requests: int = 600, rate: float = 8.0, seed: int = 0, max_context: int = 8192,
         path: str | Path = AZURE_CONV_CSV) -> list[Request]:
    """Chat requests: Azure conversation lengths, Poisson arrivals at `rate` req/s.

    Rows whose prompt + output exceed `max_context` (1 of 19,366 at 8192) are left out of the draw,
    as a server with that context would refuse them.
    """
    _check_n(n_requests)
    rng = _rng(seed)
    max_context = check_int("max_context", max_context, 2)
    p, o = trace_lengths(path)
    keep = p + o <= max_context
    if not keep.any():
        raise ValueError(f"no trace row fits max_context={max_context}")
    p, o = p[keep], o[keep]
    arrivals = poisson_arrivals(n_requests, check_rate(rate, n_requests), rng)
    idx = rng.integers(0, len(p), size=n_requests)
    return _build(arrivals, p[idx], o[idx])


def _uniform(n_requests: int, rate: float, seed: int, prompt: tuple[int, int], output: tuple[int, int]
             ) -> list[Request]:
    """Poisson arrivals; prompt and output lengths uniform over the inclusive ranges given."""
    _check_n(n_requests)
    rng = _rng(seed)
    arrivals = poisson_arrivals(n_requests, check_rate(rate, n_requests), rng)
    prompts = rng.integers(prompt[0], prompt[1] + 1, size=n_requests)
    outputs = rng.integers(output[0], output[1] + 1, size=n_requests)
    return _build(arrivals, prompts, outputs)


def long_context(*, n_requests: int = 600, rate: float = 4.0, seed: int = 0) -> list[Request]:
    """Long-context requests (§6.1): prompt ~ U{1024..3072}, output ~ U{1..1023} (means 2048, 512)."""
    return _uniform(n_requests, rate, seed, (1024, 3072), (1, 1023))


def orca_synthetic(*, n_requests: int = 600, rate: float = 1.0, seed: int = 0) -> list[Request]:
    """Orca's own workload (OSDI 2022 §6): input ~ U{32..512}, output ~ U{1..128}, Poisson arrivals."""
    return _uniform(n_requests, rate, seed, (32, 512), (1, 128))


def orca_homogeneous(*, n_requests: int = 600, rate: float = 1.0, seed: int = 0, prompt_len: int = 32,
                     output_len: int = 32) -> list[Request]:
    """Orca's homogeneous variant (OSDI 2022 §6.2): every request has the same input and output
    length — no request of a batch finishes before the others — with Poisson arrivals. Each length is
    below 2**53, as a trace's lengths are (`MAX_LENGTH`)."""
    prompt_len = check_int("prompt_len", prompt_len, 1, MAX_LENGTH - 1)
    output_len = check_int("output_len", output_len, 1, MAX_LENGTH - 1)
    return _uniform(n_requests, rate, seed, (prompt_len, prompt_len), (output_len, output_len))


WORKLOADS: dict[str, Callable[..., list[Request]]] = {
    "chat": chat, "long-context": long_context, "orca": orca_synthetic, "orca-homogeneous": orca_homogeneous,
}


def make_workload(name: str, *, n_requests: int = 600, rate: float = 8.0, seed: int = 0, **kw) -> list[Request]:
    """A named workload (`chat`, `long-context`, `orca`, `orca-homogeneous`); `kw` are its own settings."""
    if not isinstance(name, str) or name not in WORKLOADS:
        raise ValueError(f"unknown workload {brief(name)}; known: {', '.join(WORKLOADS)} "
                         "(or replay a trace with from_azure_csv / from_csv)")
    make = WORKLOADS[name]
    own = [k for k in inspect.signature(make).parameters if k not in ("n_requests", "rate", "seed")]
    for k in kw:
        if k not in own:
            raise ValueError(f"workload {name!r} has no setting {brief(k)}; its own settings: "
                             f"{', '.join(own) or 'none'}")
    return make(n_requests=n_requests, rate=rate, seed=seed, **kw)


# ---- trace replay ---------------------------------------------------------------------------------

def _csv_rows(path: Path, header: tuple[str, str, str], more: bool = False
              ) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """The names of the columns after `header` (with `more`, columns the caller reads; else none are
    allowed), and (line number, its cells) of every non-blank data row of a UTF-8 CSV whose header
    starts with `header`.

    A byte-order mark and empty cells at the end of a line are allowed (a row that stops before the
    last columns leaves theirs empty); a cell past the header's columns is not (nothing in a trace
    is left unread). Any error names the file and the line."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}, line {line}: byte {raw[e.start]:#04x} is not UTF-8 text; save the trace "
                         "as UTF-8") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[tuple[int, list[str]]] = []
    head = None
    for cells in _cells(reader, path):
        while cells and not cells[-1].strip():
            cells.pop()                                 # empty cells at the end, or a blank line
        if not cells:
            continue
        if head is None:
            head = [c.strip() for c in cells]
            if head[:3] != list(header) or (len(head) > 3 and not more):
                raise ValueError(f"{path}, line {reader.line_num}: expected the header {','.join(header)}, "
                                 f"got {brief(','.join(cells))}{_header_hint(head, header)}")
            continue
        if not 3 <= len(cells) <= len(head):
            raise ValueError(f"{path}, line {reader.line_num} (row {len(rows)}): {len(cells)} column(s), "
                             f"expected {len(head)} ({','.join(head)})")
        rows.append((reader.line_num, cells + [""] * (len(head) - len(cells))))
    if not rows:
        raise ValueError(f"{path}: empty file; expected the header {','.join(header)}" if head is None
                         else f"{path}: no requests after the header")
    return head[3:], rows


def _cells(reader, path: Path):
    """`reader`'s rows; one the csv module refuses (a cell past its limit, 131,072 characters) as a ValueError."""
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise ValueError(f"{path}, line {reader.line_num}: {e}; a trace's cells are numbers and timestamps") \
                from None
        yield cells


PLAIN_HEADER = ("arrival_s", "prompt_tokens", "output_tokens")
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _header_hint(head: list[str], header: tuple[str, str, str]) -> str:
    """What a header that is not `header` is, where it tells: the other trace format, other separators,
    a misspelt column, or further columns where a trace has these three alone (a reader that left
    them unread, as pandas' does, would drop what the user meant it to read)."""
    for other, reader in ((PLAIN_HEADER, "from_csv"), (AZURE_HEADER, "from_azure_csv")):
        if other != header and head == list(other):
            return f"; that is the header of a trace {reader} reads"
    if len(head) == 1:
        for sep in ";\t|":
            if [c.strip() for c in head[0].split(sep)] == list(header):
                return f"; its cells are separated by {sep!r}: separate them by commas"
    for got, want in zip(head, header):
        if got != want and difflib.get_close_matches(got.casefold(), [want.casefold()], cutoff=0.8):
            return f"; {got!r} is not a column of such a trace: did you mean {want!r}?"
    if head[:3] == list(header):
        return (f"; such a trace has these three columns alone, and {','.join(head[3:])} would be left unread: "
                "drop them (from_csv reads further columns, each setting a request's field of its name)")
    return ""


def _where(path: Path, i: int, line: int, column: str) -> str:
    return f"{path}, line {line} (row {i}), column {column}"


_SECONDS = ("arrival times must be finite numbers of seconds >= 0 (a trace with dates and times is an "
            "Azure-format one: from_azure_csv)")


def _number(text: str, where: str, allowed: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{where}: cannot parse {brief(text)} as a number; {allowed}") from None


def _whole(text: str, where: str, allowed: str, whole: str) -> int:
    """`text` as a whole number, written as one (`12`) or as a float that is one (`1.2e3`); else a
    ValueError saying `allowed` (no number) or `whole` (a fraction, or not finite)."""
    try:
        return int(text.strip())
    except ValueError:
        f = _number(text, where, allowed)
        if not (math.isfinite(f) and f % 1 == 0):
            raise ValueError(f"{where}: {brief(text)}; {whole}") from None
        return int(f)


def _length_cell(text: str, where: str, what: str) -> int:
    v = _whole(text, where, _LENGTHS, f"{what} lengths must be whole numbers of tokens")
    if not 1 <= v < MAX_LENGTH:
        raise ValueError(f"{where}: {what} length {text.strip()}; {_LENGTHS}")
    return v


def _check_sorted(arrivals: np.ndarray, where: Callable[[int], str]) -> None:
    """Refuse arrivals out of order, naming (`where(row)`) the first row that arrives before the one above it."""
    dec = np.flatnonzero(np.diff(arrivals) < 0)
    if len(dec):
        i = int(dec[0]) + 1
        raise ValueError(f"{where(i)}: arrivals must be sorted, but row {i} arrives at {arrivals[i]} before row "
                         f"{i - 1} at {arrivals[i - 1]}")


def _read_plain(path: Path, request: type[Request]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, list], list[int]]:
    """(arrival seconds, prompt tokens, output tokens) of an `arrival_s,prompt_tokens,output_tokens` CSV,
    the values of its further columns, each a field of `request` (`_trace_fields`), and each row's line."""
    names, rows = _csv_rows(path, PLAIN_HEADER, more=True)
    kinds = _trace_fields(request, names, path)
    a = np.empty(len(rows))
    p = np.empty(len(rows), dtype=np.int64)
    o = np.empty(len(rows), dtype=np.int64)
    own: dict[str, list] = {name: [] for name in names}
    for i, (line, (t, pt, ot, *more)) in enumerate(rows):
        a[i] = _number(t, _where(path, i, line, "arrival_s"), _SECONDS)
        if not (math.isfinite(a[i]) and a[i] >= 0):
            raise ValueError(f"{_where(path, i, line, 'arrival_s')}: {t.strip()}; {_SECONDS}")
        p[i] = _length_cell(pt, _where(path, i, line, "prompt_tokens"), "prompt")
        o[i] = _length_cell(ot, _where(path, i, line, "output_tokens"), "output")
        for name, cell in zip(names, more):
            own[name].append(_field_cell(cell, _where(path, i, line, name), *kinds[name]))
    _check_sorted(a, lambda i: _where(path, i, rows[i][0], "arrival_s"))
    return a, p, o, own, [line for line, _ in rows]


TRACE_KINDS = (int, float, str)
"""The types of a field a trace's column may set: a cell is one value."""


def _trace_fields(request: type[Request], names: list[str], path: Path) -> dict[str, tuple[type, bool]]:
    """Each of `names` (columns after the three) as (its type, whether it takes None): a field of
    `request` built from a trace, one of `TRACE_KINDS` or that or None, and not one the row sets
    itself (its id, arrival and lengths); otherwise a ValueError naming the fields a column may set."""
    if not names:
        return {}
    try:
        hints = typing.get_type_hints(request)
    except Exception as e:              # (an annotation of the caller's class that does not resolve)
        raise ValueError(f"{path}: the types of {request.__name__}'s fields, which its further columns set, do not "
                         f"resolve: {type(e).__name__}: {e}") from None
    settable: dict[str, tuple[type, bool]] = {}
    for f in dataclasses.fields(request):
        if not f.init or f.name in ("req_id", "arrival_s", "prompt_len", "output_len"):
            continue
        kind = hints.get(f.name)
        args = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
        scalars = [k for k in args if k is not type(None)]
        if len(scalars) == 1 and scalars[0] in TRACE_KINDS:
            settable[f.name] = (scalars[0], type(None) in args)
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{path}, header: the column {brief(name)} is there twice")
        seen.add(name)
        if name not in settable:
            raise ValueError(f"{path}, header: the column {brief(name)} names no field of {request.__name__} that a "
                             f"trace sets (fields typed int, float or str: {', '.join(settable) or 'none'}); add it "
                             "to a Request subclass given as request=, or leave the column out")
    return {name: settable[name] for name in names}


def _field_cell(text: str, where: str, kind: type, optional: bool) -> int | float | str | None:
    """A cell of a column after the three, as the field's `kind`; empty: None where the field takes it."""
    text = text.strip()
    if not text:
        if optional:
            return None
        raise ValueError(f"{where}: empty, and the field is typed {kind.__name__}, which takes no None")
    if kind is str:
        return text
    wanted = f"the field is typed {kind.__name__}"
    if kind is int:
        return _whole(text, where, wanted, f"{wanted}: a whole number")
    f = _number(text, where, wanted)
    if not math.isfinite(f):
        raise ValueError(f"{where}: {brief(text)}; {wanted}: a finite number")
    return f


# A TIMESTAMP cell: a calendar date, or a date and a time with optionally Z or a UTC offset (sign, hours
# 00-23, minutes). numpy alone would also take a bare number as a year ("1" is the year 1, so seconds would
# become years) and "now" or "today" as the clock; the offset is applied here, as numpy's own reading
# of one is deprecated (it warns on every such cell).
_STAMP = re.compile(r"(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?)(?:Z|([+-])([01]\d|2[0-3]):?([0-5]\d))?"
                    r"|(\d{4}-\d{2}-\d{2})")


def _read_azure(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival seconds from the first row, prompt tokens, output tokens) of an Azure-format CSV."""
    _, rows = _csv_rows(path, AZURE_HEADER)
    stamps = np.empty(len(rows), dtype="datetime64[ns]")
    p = np.empty(len(rows), dtype=np.int64)
    o = np.empty(len(rows), dtype=np.int64)
    for i, (line, (t, pt, ot)) in enumerate(rows):
        stamps[i] = np.datetime64("NaT")
        m = _STAMP.fullmatch(t.strip())
        if m:
            east = 0 if m[2] is None else (1 if m[2] == "+" else -1) * (int(m[3]) * 60 + int(m[4]))
            try:
                utc = int(np.datetime64((m[1] or m[5]).replace(" ", "T"), "ns").astype(np.int64)) - east * 60 * 10**9
            except ValueError:
                utc = None
            if utc is not None and -2**63 < utc < 2**63:     # (int64 nanoseconds, -2**63 being NaT)
                stamps[i] = np.datetime64(utc, "ns")
        if np.isnat(stamps[i]):
            raise ValueError(f"{_where(path, i, line, 'TIMESTAMP')}: cannot parse {brief(t)} as a timestamp; TIMESTAMP "
                             "is a date and time, YYYY-MM-DD[ HH:MM[:SS[.fraction]][Z or +-HH:MM]] (e.g. 2023-11-16 "
                             "18:15:46.6805900); for arrival times in seconds use from_csv (header "
                             "arrival_s,prompt_tokens,output_tokens)")
        p[i] = _length_cell(pt, _where(path, i, line, "ContextTokens"), "prompt")
        o[i] = _length_cell(ot, _where(path, i, line, "GeneratedTokens"), "output")
    ns = stamps.astype(np.int64)
    if int(ns.max()) - int(ns.min()) >= 2**63:          # (a difference int64 nanoseconds cannot hold)
        first, last = (rows[int(i)][1][0].strip() for i in (ns.argmin(), ns.argmax()))
        raise ValueError(f"{path}: the timestamps span more than 292 years, from {first} to {last}; a trace's "
                         "arrivals are counted in nanoseconds")
    arrivals = (stamps - stamps[0]).astype(np.int64) / 1e9
    _check_sorted(arrivals, lambda i: _where(path, i, rows[i][0], "TIMESTAMP"))
    return arrivals, p, o


def _replay(arrivals: np.ndarray, prompts: np.ndarray, outputs: np.ndarray, source: str,
            n_requests: int | None, rate: float | None, scale: float | None, start: int,
            request: type[Request] = Request, own: dict[str, list] | None = None, lines: list[int] | None = None
            ) -> list[Request]:
    """`n_requests` rows of a trace's columns from row `start` (default: to the end) as requests, the
    first arriving at 0: at the trace's pace, every gap times `scale`, or rescaled to `rate` (`at_rate`);
    arrivals that span past `CLOCK_SPAN_S` at the trace's pace or scaled are refused (`past_the_clock`).
    Objects of `request`, with the fields in `own` set row by row where it is given; a row that
    `request` refuses (a field a column sets, or a check or field of a subclass's own) is named,
    with its line in `lines`."""
    if rate is not None and scale is not None:
        raise ValueError("give either rate (a target mean rate) or scale (a time factor), not both")
    start = check_int("start (a row index)", start, 0)
    n = len(arrivals)
    if start >= n:
        raise ValueError(f"{source}: start={start}, but the trace has {n} rows (start must be 0..{n - 1})")
    end = n if n_requests is None else start + _check_n(n_requests)
    if end > n:
        raise ValueError(f"{source}: asked for rows {start}..{end - 1} but the trace has {n}")
    a = arrivals[start:end] - arrivals[start]
    span = float(a[-1])
    if scale is not None:
        scale = check_real("scale", scale, 0.0, lo_open=True)
        with np.errstate(over="ignore"):
            a = a * scale
        if not np.isfinite(a[-1]):
            raise ValueError(f"{source}: scale={scale!r} puts the arrivals past the largest float")
    if rate is None and a[-1] > CLOCK_SPAN_S:           # (at_rate checks a rate against the clock)
        how = (f"rows {start}..{end - 1} reach too far at the trace's own pace" if scale is None
               else f"scale={scale!r} stretches rows {start}..{end - 1} too far")
        raise ValueError(f"{source}: {how}: {past_the_clock(a[-1])}; scale must be at most {CLOCK_SPAN_S / span!r} "
                         "for them")
    if own or request is not Request:
        reqs = []
        for i, (t, pl, ol) in enumerate(zip(a.tolist(), prompts[start:end].tolist(), outputs[start:end].tolist())):
            try:
                reqs.append(request(i, t, pl, ol, **{name: values[start + i] for name, values in (own or {}).items()}))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{source}, line {lines[start + i]} (row {start + i}): {e}") from None
    else:
        reqs = _build(a, prompts[start:end], outputs[start:end])
    if rate is None:
        return reqs
    try:
        return at_rate(reqs, rate)
    except ValueError as e:
        raise ValueError(f"{source}: rows {start}..{end - 1}: {e}") from None


def from_azure_csv(path: str | Path = AZURE_CONV_CSV, *, n_requests: int | None = None, rate: float | None = None,
                   scale: float | None = None, start: int = 0) -> list[Request]:
    """Replay an Azure-format trace (TIMESTAMP, ContextTokens, GeneratedTokens); a TIMESTAMP is a date
    and time, YYYY-MM-DD[ HH:MM[:SS[.fraction]]], optionally with Z or a UTC offset (not seconds: those
    are `from_csv`'s arrival_s).

    At the trace's own pace by default; `rate` rescales time so the mean rate is `rate` req/s,
    `scale` multiplies every gap. Arrivals are shifted so the first selected row arrives at 0; rows
    whose arrivals would then span past 2**32 s (`durations.CLOCK_SPAN_S`) are refused, with the
    largest scale that fits them.
    Rows are counted from 0 after the header, blank lines skipped; every parse error names the
    file, the line, the row and the column.
    """
    a, p, o = _read_azure(_check_trace_file(path))
    return _replay(a, p, o, str(path), n_requests, rate, scale, start)


def from_csv(path: str | Path, *, n_requests: int | None = None, rate: float | None = None,
             scale: float | None = None, start: int = 0, request: type[Request] = Request) -> list[Request]:
    """Replay a plain CSV whose header starts `arrival_s,prompt_tokens,output_tokens` (options as
    `from_azure_csv`), as objects of `request`, `Request` or a dataclass subclass of it.

    A column after those three sets the field of its name on every request: one `request` has,
    typed int, float or str (or that or None: an empty cell is None), other than the row's id, arrival
    and lengths: `Request`'s own `max_tokens`, `predicted_output`, `min_tokens`, and those a subclass
    adds (a policy's priority, a tenant). A column that names no such field is refused rather than
    left unread, as is a cell that is not of the field's type or that the class refuses.
    """
    if not (isinstance(request, type) and issubclass(request, Request)):
        raise ValueError(f"request must be Request or a dataclass subclass of it (each row built as request(row, "
                         f"arrival_s, prompt_len, output_len, **its further columns)), got {brief(request)}")
    a, p, o, own, lines = _read_plain(_check_trace_file(path), request)
    return _replay(a, p, o, str(path), n_requests, rate, scale, start, request, own, lines)


# ---- copies with a field set --------------------------------------------------------------------

MAX_SIGMA = 10.0
"""The largest predictor noise: at five sigmas a prediction is already off by a factor e^50, so a larger
sigma tells nothing more, and one large enough makes exp() overflow (past sigma ~140)."""


def with_predictions(requests: Sequence[Request], sigma: float = 0.0, seed: int = 0) -> list[Request]:
    """Copies of `requests` (`fresh_copies`) with `predicted_output = output_len * exp(eps)`,
    eps ~ N(0, sigma^2) (§6.3); sigma 0 is the oracle. The requests given are not changed."""
    requests = check_items("requests", requests, Request)
    sigma = check_real("sigma", sigma, 0.0, MAX_SIGMA)
    rng = _rng(seed)
    eps = rng.normal(0.0, sigma, size=len(requests)) if sigma > 0 else np.zeros(len(requests))
    copies = fresh_copies(requests)
    for r, e in zip(copies, eps):
        r.predicted_output = float(r.output_len * math.exp(e))
    return copies


def with_prompt_ids(requests: Sequence[Request], vocab: int, seed: int = 0) -> list[Request]:
    """Copies of `requests` (`fresh_copies`), each with random prompt token ids in [0, vocab) (for
    the torch executor), seeded. `vocab` is at most 2**63: a token id is an int64, as torch's
    embedding takes it. The requests given are not changed."""
    requests = check_items("requests", requests, Request)
    vocab = check_int("vocab", vocab, 1, 2**63)
    rng = _rng(seed)
    copies = fresh_copies(requests)
    for r in copies:
        r.prompt_ids = rng.integers(0, vocab, size=r.prompt_len).tolist()
    return copies
