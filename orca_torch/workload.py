"""Workloads: who arrives when, with how long a prompt and how long an answer (lecture §4.5, §5.2, §6.1).

Every generator is seeded and returns a list of `Request` sorted by arrival.

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
- `from_azure_csv` / `from_csv`: trace replay at the trace's own rate or rescaled to a given one.

Arrivals are Poisson: exponential gaps with mean 1/rate. The gaps are drawn at rate 1 and divided by
the rate, so one seed gives the same requests at every rate, only closer together — which keeps a
goodput bisection over the rate free of sampling noise.
"""
from __future__ import annotations

import csv
import functools
import math
import numbers
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .request import Request

AZURE_CONV_CSV = Path(__file__).parent / "data" / "azure_llm_2023_conv.csv"


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """`n` arrival times of a Poisson process at `rate` per second, starting from 0."""
    _check_rate(rate)
    gaps = rng.exponential(1.0, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps) / rate


def _check_rate(rate: float) -> None:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"rate must be a finite number of requests per second > 0, got {rate!r}")


def check_seed(seed: int, name: str = "seed") -> int:
    """An integer >= 0 (numpy integers too) as a plain int; numpy's and torch's generators take no less."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {seed!r}")
    return int(seed)


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n_requests must be an integer >= 1, got {n!r}")


def make_requests(arrivals: Sequence[float], prompt_lens: Sequence[int], output_lens: Sequence[int],
                  source: str = "workload") -> list[Request]:
    """Requests with ids 0..n-1 from three columns; clear errors for NaN/unsorted arrivals or bad lengths."""
    a = np.asarray(arrivals, dtype=float)
    p = np.asarray(prompt_lens)
    o = np.asarray(output_lens)
    if not (len(a) == len(p) == len(o)):
        raise ValueError(f"{source}: columns differ in length ({len(a)}, {len(p)}, {len(o)})")
    if len(a) == 0:
        raise ValueError(f"{source}: no requests")
    bad = np.flatnonzero(~np.isfinite(a))
    if len(bad):
        raise ValueError(f"{source}: arrival time of row {bad[0]} is {a[bad[0]]} (must be a finite number)")
    dec = np.flatnonzero(np.diff(a) < 0)
    if len(dec):
        i = dec[0] + 1
        raise ValueError(f"{source}: arrivals must be sorted, but row {i} arrives at {a[i]} before row "
                         f"{i - 1} at {a[i - 1]}")
    if a[0] < 0:
        raise ValueError(f"{source}: arrival times must be >= 0, got {a[0]}")
    for name, col in (("prompt", p), ("output", o)):
        if not np.issubdtype(col.dtype, np.integer):
            if not np.all(np.isfinite(col.astype(float))) or np.any(col.astype(float) % 1):
                raise ValueError(f"{source}: {name} lengths must be whole numbers of tokens")
            col = col.astype(np.int64)
        low = np.flatnonzero(col < 1)
        if len(low):
            raise ValueError(f"{source}: {name} length of row {low[0]} is {col[low[0]]}; lengths must be >= 1")
        if name == "prompt":
            p = col
        else:
            o = col
    return [Request(i, float(a[i]), int(p[i]), int(o[i])) for i in range(len(a))]


# ---- synthetic and trace-drawn workloads -----------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _azure_cached(path: str, mtime_ns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cols = _read_azure(Path(path))
    for c in cols:
        c.flags.writeable = False
    return cols


def _azure_lengths(path: Path = AZURE_CONV_CSV) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths of an Azure trace (parsed once per file version)."""
    path = Path(path).resolve()
    _, p, o = _azure_cached(str(path), path.stat().st_mtime_ns)
    return p, o


def chat(n_requests: int = 600, rate: float = 8.0, seed: int = 0, max_context: int = 8192,
         path: str | Path = AZURE_CONV_CSV) -> list[Request]:
    """Chat requests: Azure conversation lengths, Poisson arrivals at `rate` req/s.

    Rows whose prompt + output exceed `max_context` (1 of 19,366 at 8192) are left out of the draw,
    as a server with that context would refuse them.
    """
    _check_n(n_requests)
    seed = check_seed(seed)
    p, o = _azure_lengths(Path(path))
    keep = p + o <= max_context
    if not keep.any():
        raise ValueError(f"no trace row fits max_context={max_context}")
    p, o = p[keep], o[keep]
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(n_requests, rate, rng)
    idx = rng.integers(0, len(p), size=n_requests)
    return make_requests(arrivals, p[idx], o[idx], "chat")


def _uniform(n_requests: int, rate: float, seed: int, prompt: tuple[int, int], output: tuple[int, int],
             name: str) -> list[Request]:
    """Poisson arrivals; prompt and output lengths uniform over the inclusive ranges given."""
    _check_n(n_requests)
    rng = np.random.default_rng(check_seed(seed))
    arrivals = poisson_arrivals(n_requests, rate, rng)
    prompts = rng.integers(prompt[0], prompt[1] + 1, size=n_requests)
    outputs = rng.integers(output[0], output[1] + 1, size=n_requests)
    return make_requests(arrivals, prompts, outputs, name)


def long_context(n_requests: int = 600, rate: float = 4.0, seed: int = 0) -> list[Request]:
    """Long-context requests (§6.1): prompt ~ U{1024..3072}, output ~ U{1..1023} (means 2048, 512)."""
    return _uniform(n_requests, rate, seed, (1024, 3072), (1, 1023), "long-context")


def orca_synthetic(n_requests: int = 600, rate: float = 1.0, seed: int = 0) -> list[Request]:
    """Orca's own workload (OSDI 2022 §6): input ~ U{32..512}, output ~ U{1..128}, Poisson arrivals."""
    return _uniform(n_requests, rate, seed, (32, 512), (1, 128), "orca")


def orca_homogeneous(n_requests: int = 600, rate: float = 1.0, seed: int = 0, prompt_len: int = 32,
                     output_len: int = 32) -> list[Request]:
    """Orca's homogeneous variant (OSDI 2022 §6.2): every request has the same input and output
    length — no request of a batch finishes before the others — with Poisson arrivals."""
    for name, v in (("prompt_len", prompt_len), ("output_len", output_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return _uniform(n_requests, rate, seed, (prompt_len, prompt_len), (output_len, output_len),
                    f"orca-homogeneous({prompt_len},{output_len})")


WORKLOADS: dict[str, Callable[..., list[Request]]] = {
    "chat": chat, "long-context": long_context, "orca": orca_synthetic, "orca-homogeneous": orca_homogeneous,
}


def make_workload(name: str, n_requests: int = 600, rate: float = 8.0, seed: int = 0, **kw) -> list[Request]:
    """A named workload (`chat`, `long-context`, `orca`, `orca-homogeneous`)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)} "
                         "(or replay a trace with from_azure_csv / from_csv)")
    return WORKLOADS[name](n_requests=n_requests, rate=rate, seed=seed, **kw)


# ---- trace replay ---------------------------------------------------------------------------------

def _read_azure(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival seconds from the first row, prompt tokens, output tokens) of an Azure-format CSV."""
    path = Path(path)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or [c.strip() for c in rows[0][:3]] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
        raise ValueError(f"{path}: expected the Azure trace header TIMESTAMP,ContextTokens,GeneratedTokens")
    rows = rows[1:]
    if not rows:
        raise ValueError(f"{path}: no requests")
    try:
        stamps = np.array([r[0].strip().replace(" ", "T") for r in rows], dtype="datetime64[ns]")
        prompts = np.array([int(r[1]) for r in rows], dtype=np.int64)
        outputs = np.array([int(r[2]) for r in rows], dtype=np.int64)
    except (ValueError, IndexError) as e:
        raise ValueError(f"{path}: cannot parse a row ({e})") from None
    if np.isnat(stamps).any():
        raise ValueError(f"{path}: row {int(np.flatnonzero(np.isnat(stamps))[0])} has no timestamp")
    arrivals = (stamps - stamps[0]).astype(np.int64) / 1e9
    return arrivals, prompts, outputs


def _replay(arrivals: np.ndarray, prompts: np.ndarray, outputs: np.ndarray, source: str,
            n_requests: int | None, rate: float | None, scale: float | None, start: int) -> list[Request]:
    if rate is not None and scale is not None:
        raise ValueError("give either rate (a target mean rate) or scale (a time factor), not both")
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an integer row index >= 0, got {start!r}")
    end = len(arrivals) if n_requests is None else start + n_requests
    if n_requests is not None:
        _check_n(n_requests)
    if end > len(arrivals):
        raise ValueError(f"{source}: asked for rows {start}..{end - 1} but the trace has {len(arrivals)}")
    reqs = make_requests(arrivals, prompts, outputs, source)[start:end]   # validates the whole trace
    a = np.array([r.arrival_s for r in reqs])
    a = a - a[0]
    if rate is not None:
        _check_rate(rate)
        span = a[-1]
        if len(a) < 2 or span <= 0:
            raise ValueError(f"{source}: cannot rescale to a rate: the selected rows span no time")
        a = a * ((len(a) - 1) / span / rate)
    elif scale is not None:
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        a = a * scale
    return make_requests(a, [r.prompt_len for r in reqs], [r.output_len for r in reqs], source)


def from_azure_csv(path: str | Path = AZURE_CONV_CSV, n_requests: int | None = None, rate: float | None = None,
                   scale: float | None = None, start: int = 0) -> list[Request]:
    """Replay an Azure-format trace (TIMESTAMP, ContextTokens, GeneratedTokens).

    At the trace's own pace by default; `rate` rescales time so the mean rate is `rate` req/s,
    `scale` multiplies every gap. Arrivals are shifted so the first selected row arrives at 0.
    """
    a, p, o = _read_azure(Path(path))
    return _replay(a, p, o, str(path), n_requests, rate, scale, start)


def from_csv(path: str | Path, n_requests: int | None = None, rate: float | None = None,
             scale: float | None = None, start: int = 0) -> list[Request]:
    """Replay a plain CSV with header `arrival_s,prompt_tokens,output_tokens`."""
    path = Path(path)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or [c.strip() for c in rows[0][:3]] != ["arrival_s", "prompt_tokens", "output_tokens"]:
        raise ValueError(f"{path}: expected the header arrival_s,prompt_tokens,output_tokens")
    try:
        cols = np.array([[float(x) for x in r[:3]] for r in rows[1:] if r], dtype=float).reshape(-1, 3)
    except ValueError as e:
        raise ValueError(f"{path}: cannot parse a row ({e})") from None
    return _replay(cols[:, 0], cols[:, 1], cols[:, 2], str(path), n_requests, rate, scale, start)


# ---- decorations --------------------------------------------------------------------------------

def with_predictions(requests: Sequence[Request], sigma: float = 0.0, seed: int = 0) -> list[Request]:
    """Set `predicted_output = output_len * exp(eps)`, eps ~ N(0, sigma^2) (§6.3); sigma 0 is the oracle."""
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
    rng = np.random.default_rng(check_seed(seed))
    eps = rng.normal(0.0, sigma, size=len(requests)) if sigma > 0 else np.zeros(len(requests))
    for r, e in zip(requests, eps):
        r.predicted_output = float(r.output_len * math.exp(e))
    return list(requests)


def with_prompt_ids(requests: Sequence[Request], vocab: int, seed: int = 0) -> list[Request]:
    """Give every request random prompt token ids in [0, vocab) (for the torch executor), seeded."""
    rng = np.random.default_rng(check_seed(seed))
    for r in requests:
        r.prompt_ids = rng.integers(0, vocab, size=r.prompt_len).tolist()
    return list(requests)


def with_max_tokens(requests: Sequence[Request], max_tokens: int) -> list[Request]:
    """Set every request's `max_tokens` (what a max-length reservation sets aside)."""
    for r in requests:
        if max_tokens < r.total_len:
            raise ValueError(f"request {r.req_id!r} needs {r.total_len} tokens, more than max_tokens={max_tokens}")
        r.max_tokens = max_tokens
    return list(requests)
