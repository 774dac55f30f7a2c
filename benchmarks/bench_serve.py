"""The live server measured by a standard benchmark client, beside the paper GPU's prediction.

The paper GPU predicts the same run (lecture §5: the simulator checked against the real engine,
here end to end).

    python benchmarks/bench_serve.py [--client auto|aiperf|builtin] [--rates 1,4,16] [--n 32]
                                     [--isl 32] [--osl 16] [--max-bs 16] [--quick-calibration] [--seed 0] [--json]

1. Calibrates the paper GPU to this CPU on the `mini` model at one thread (`lab.calibrate`, as
   experiment 05 does), before the server starts so the two do not share the cores.
2. Starts `python -m orca_torch.serve --model mini --threads 1` on 127.0.0.1 (`--port 0`: the port
   the system picks as it binds, read from the server's banner; `--max-connections` at least `--n`,
   since every request may be in flight at once) and drives it at each Poisson rate
   with fixed prompt and output lengths: with AIPerf (the `bench` extra) when its `aiperf` command
   is found, else with the small built-in driver below, which is NOT a standard client and says
   so in the output.
3. Before the measured runs, sends a calibration load and fits the paper GPU a second time, to
   the server's own steps (`GET /orca/steps`: same process, core and contention as the runs).
4. Prints what the client measured (TTFT, TPOT, ITL, output throughput, goodput) and replays the
   same arrivals and lengths on the calibrated paper GPU (the same Orca scheduler and memory
   manager on a `CostModelExecutor`) with either fit, prediction beside measurement; then the
   server's own step log (iterations, mean batch, busy time) beside the simulator's, and the
   server's own steps priced by each fit (step-time error without any schedule divergence); and where
   the first token's time went (`FirstToken`): the client's mean TTFT, the server's own, the
   difference (outside the engine's clock), the step that fed each prompt (measured, and priced by
   each fit) and the engine's wait before it.

TPOT is per request (end-to-end minus TTFT, over the tokens after the first; AIPerf's
"inter_token_latency"), ITL per chunk (AIPerf's "inter_chunk_latency"); with one output token
there is no gap between tokens, so both are n/a in the table and null in `--json`. Throughput is
the output tokens, and goodput the requests that met both `--slo-ttft` and `--slo-tpot` (one
without a TPOT meets that side), per second from the first request to the last response, for the
client and the replay alike (not AIPerf's own two figures, whose window starts one Poisson gap
before the first request: they are kept in `--json`'s `extra`). What the simulator
does not model: HTTP, tokenization and the event loop (tens of microseconds a token), the engine
thread's Python between steps, and other processes on a shared machine.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:     # (once: tests import the scripts)
    sys.path.insert(0, str(ROOT))

from orca_torch.checks import brief, check_fits_in_memory  # noqa: E402
from orca_torch.core.engine import Engine  # noqa: E402
from orca_torch.core.memory import ReservationMemory  # noqa: E402
from orca_torch.core.request import Request  # noqa: E402
from orca_torch.core.scheduler_config import SchedulerConfig  # noqa: E402
from orca_torch.lab.cli_args import (FP32_BYTES, add_seed_flag, command_parser, count_arg,  # noqa: E402
                                     positive_float_arg)
from orca_torch.lab.metrics import per_request, summarize  # noqa: E402
from orca_torch.lab.report import jsonable, machine, machine_line, quiet_exit  # noqa: E402
from orca_torch.serve.limits import FD_RESERVE, connection_room, default_connections  # noqa: E402
from orca_torch.serve.live import KEEP_STEPS  # noqa: E402
from orca_torch.specs import get_model_spec  # noqa: E402

MODEL = "mini"
CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
SERVER_CPUS, CLIENT_CPUS = (CPUS[:1], CPUS[1:]) if len(CPUS) > 1 else (CPUS, CPUS)
"""The server on one core, the client (and this script) on the others: the client's processes must
not take the server's core (on a 2-core machine they otherwise slow its steps two- to threefold)."""


class BenchError(RuntimeError):
    """A run that cannot go on (a refused request, a failed client, a server gone), said as a message
    on stderr (`cli`), not a traceback: one line, then the failed client's or the server's output
    where it has some."""


def pin(cpus: list[int]):
    """A `preexec_fn` that keeps a child process on `cpus` (where the platform allows)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, cpus)


@dataclass
class Measured:
    """One rate's run as a client saw it (seconds), and what it sent (to replay it)."""

    client: str
    arrivals: list[float]
    prompt_lens: list[int]
    output_lens: list[int]
    ttft_median: float
    ttft_mean: float
    tpot_median: float
    itl_median: float
    throughput_tok_s: float
    goodput_req_s: float
    n_ok: int
    extra: dict = field(default_factory=dict)


def median(xs) -> float:
    """The median of the finite values in `xs`, NaN if there are none (and no numpy warning: one
    output token a request has no TPOT or ITL, which is no fault)."""
    x = np.asarray(xs, dtype=float).ravel()
    x = x[np.isfinite(x)]
    return float(np.median(x)) if len(x) else math.nan


def figure(v: float, fmt: str) -> str:
    """A table cell: `v` formatted, or n/a where there is no such figure (NaN)."""
    return format(v, fmt) if math.isfinite(v) else "n/a"


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics as {name{labels}: value}."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k.split("{")[0] + ("" if "le=" not in k else k[k.index("le="):])] = float(v)
    return out


def fetch_steps(url: str, since: int) -> list:
    """The server's iterations from `since` on: [index, start, end, [[req_id, n_new, n_past], ...],
    prompt_ends] (the page's `prompt_ends` beside each step: the req_ids whose prompt it completed),
    a page at a time; all of them, or a BenchError (the server keeps only its last `KEEP_STEPS`, and
    answers from the oldest it holds: a rate's run is priced and replayed from them, so it must fit)."""
    import httpx

    steps: list = []
    while True:
        page = httpx.get(url + "/orca/steps", params={"since": since}, timeout=60).json()
        if not steps and page["steps"] and page["steps"][0][0] != since:
            raise BenchError(f"the server's step log no longer holds its iterations {since} to "
                             f"{page['steps'][0][0] - 1} (it keeps its last {KEEP_STEPS:,}): give fewer "
                             "requests a rate (--n) or shorter outputs (--osl)")
        steps += [[*step, ends] for step, ends in zip(page["steps"], page["prompt_ends"], strict=True)]
        if not page["steps"]:
            return steps
        since = page["next"]


def step_samples(steps: list) -> list:
    from orca_torch.core.batch import SeqWork, StepTotals
    from orca_torch.lab.calibration.samples import StepSample

    return [StepSample(f"server step {i}", StepTotals.of([SeqWork(n, p) for _, n, p in works]), end - start)
            for i, start, end, works, _ in steps]


CALIBRATION_PROMPTS, CALIBRATION_NEW = (8, 32, 128), 24
"""The calibration load's prompt lengths and new tokens: `--kv-slots` must hold its longest request."""


async def _calibration_load(url: str, a) -> None:
    """Bursts of 1, 2, 4, 8 and 16 concurrent requests with prompts of 8 to 128 tokens: steps of many
    shapes for the in-server fit."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as c:
        for k in (1, 2, 4, 8, 16):
            answers = await asyncio.gather(*[c.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": list(range(1, CALIBRATION_PROMPTS[i % 3] + 1)),
                "max_tokens": CALIBRATION_NEW}) for i in range(k)])
            for r in answers:
                if r.status_code != 200:
                    raise BenchError(f"the server refused a calibration request (prompts of 8, 32 "
                                     f"and 128 tokens, 24 new): {r.json()['error']['message']}")


def fit_on_server(url: str, a):
    """The paper GPU fitted to the server's own steps under a calibration load (same process,
    same core, same contention as the measured runs)."""
    from orca_torch.lab.calibration.roofline_fit import fit

    since = int(scrape(url)["orca:iterations_total"])      # the index of the server's next iteration
    asyncio.run(_calibration_load(url, a))
    return fit(step_samples(fetch_steps(url, since)), MODEL)


def good_count(ttft: np.ndarray, tpot: np.ndarray, a) -> int:
    """The requests that met both SLOs; one without a TPOT (a single output token) meets that side,
    as `summarize` counts it."""
    return int(np.sum((ttft <= a.slo_ttft) & (np.nan_to_num(tpot) <= a.slo_tpot)))


# ---- the standard client -----------------------------------------------------------------------
AIPERF_SLACK_S = 1800.0
"""How long a run of AIPerf may take past twice `--n` / rate (its arrivals' expected span, which `MAX_RUN_S`
bounds, and a gap more): its start, and the server's backlog at a rate it cannot keep up with."""


def run_aiperf(aiperf: str, url: str, tokenizer: Path, rate: float, a, out_dir: Path) -> Measured:
    """One rate's run by AIPerf, its files in `out_dir`: removed once read, kept where the run fails
    (the message names them: AIPerf's own output points at its log there)."""
    try:
        m = _aiperf_run(aiperf, url, tokenizer, rate, a, out_dir)
    except BenchError as e:
        raise BenchError(f"{e}\nAIPerf's files, its log (logs/aiperf.log) and records (profile_export.jsonl), are "
                         f"kept in {out_dir}; --client builtin measures without AIPerf") from None
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    return m


@contextlib.contextmanager
def aiperf_folder():
    """A folder for the runs' `out_dir`s, removed at the end unless a failed run's files are kept in it."""
    files = Path(tempfile.mkdtemp(prefix="bench_serve_aiperf_"))
    try:
        yield files
    finally:
        with contextlib.suppress(OSError):
            files.rmdir()


def said(error: dict) -> str:
    """An error in AIPerf's records: its HTTP code, or its type where it has none (a refused
    connection), then its message."""
    return f"{error.get('code') or error.get('type', '')} {error.get('message', '')[:500]}"


def profiling_records(out_dir: Path) -> list[dict]:
    """AIPerf's per-request records of the measured phase."""
    recs = [json.loads(line) for line in (out_dir / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in recs if r["metadata"].get("benchmark_phase", "profiling") == "profiling"]


def _aiperf_run(aiperf: str, url: str, tokenizer: Path, rate: float, a, out_dir: Path) -> Measured:
    """`run_aiperf`'s run of AIPerf, and what it measured."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}   # it refuses local paths with it
    cmd = [aiperf, "profile", "--model", MODEL, "--tokenizer", str(tokenizer), "--url", url,
           "--endpoint-type", "completions", "--streaming", "--request-rate", str(rate),
           "--arrival-pattern", "poisson", "--request-count", str(a.n), "--isl", str(a.isl), "--isl-stddev", "0",
           "--osl", str(a.osl), "--osl-stddev", "0", "--random-seed", str(a.seed),
           "--extra-inputs", "ignore_eos:true", "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
           "--workers-max", "1", "--goodput",
           f"time_to_first_token:{a.slo_ttft * 1e3:g} inter_token_latency:{a.slo_tpot * 1e3:g}",
           "--artifact-dir", str(out_dir)]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=pin(CLIENT_CPUS), start_new_session=True)
    limit = AIPERF_SLACK_S + 2 * a.n / rate
    try:
        stdout, stderr = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        raise BenchError(f"aiperf had not finished after {limit:.0f} s ({a.n} requests at {rate:g} req/s arrive "
                         f"over about {a.n / rate:.3g} s), and was stopped") from None
    finally:        # (its worker processes outlive a killed aiperf, waiting forever: the whole group goes)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    if p.returncode:
        first = ""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            first = next((f"; its first failed request: {said(r['error'])}" for r in profiling_records(out_dir)
                          if r.get("error")), "")
        tail = "\n".join(x[-2000:].strip() for x in (stdout, stderr) if x.strip())
        raise BenchError(f"aiperf failed (exit status {p.returncode}){first}"
                         + (f"; its output ends:\n{tail}" if tail else " (and wrote nothing)"))
    try:
        return aiperf_measured(out_dir, a)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:   # (a BenchError passes)
        raise BenchError(f"aiperf exited 0, but its results could not be read ({type(e).__name__}: {e}); "
                         "this script reads the profile_export_aiperf.json and profile_export.jsonl of AIPerf "
                         "0.13") from None


def aiperf_measured(out_dir: Path, a) -> Measured:
    """The run in AIPerf's files, throughput and goodput over its `benchmark_duration` (the first request
    to the last response) as the replay's, goodput's requests counted from its records by `good_count`
    (AIPerf's own goodput counts one without a TPOT as missed)."""
    s = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    recs = profiling_records(out_dir)
    failed = [r["error"] for r in recs if r.get("error")]
    if failed:                                          # (it exits 0 when only some failed)
        raise BenchError(f"AIPerf recorded {len(failed)} of {len(recs)} requests as failed; the first: "
                         f"{said(failed[0])}")
    if len(recs) != a.n:
        raise BenchError(f"AIPerf recorded {len(recs)} requests, not the {a.n} it was asked for")
    recs.sort(key=lambda r: r["metadata"]["request_start_ns"])
    t0 = recs[0]["metadata"]["request_start_ns"]
    ms = 1e-3
    dur = s["benchmark_duration"]["avg"]
    ttft = np.array([r["metrics"]["time_to_first_token"]["value"] * ms for r in recs])
    tpot = np.array([r["metrics"].get("inter_token_latency", {}).get("value", math.nan) * ms for r in recs])
    outs = [int(r["metrics"]["output_sequence_length"]["value"]) for r in recs]
    return Measured(
        "AIPerf " + s.get("aiperf_version", ""),
        [(r["metadata"]["request_start_ns"] - t0) * 1e-9 for r in recs],
        [int(r["metrics"]["input_sequence_length"]["value"]) for r in recs], outs,
        s["time_to_first_token"]["p50"] * ms, float(np.mean(ttft)),
        s.get("inter_token_latency", {}).get("p50", math.nan) * ms,
        s.get("inter_chunk_latency", {}).get("p50", math.nan) * ms, sum(outs) / dur,
        good_count(ttft, tpot, a) / dur, len(recs),
        {"benchmark_duration_s": dur, "aiperf_output_token_throughput": s["output_token_throughput"]["avg"],
         "aiperf_goodput": s.get("goodput", {}).get("avg", math.nan)})


# ---- the fallback: NOT a standard client --------------------------------------------------------
async def _builtin(url: str, rate: float, a) -> Measured:
    import httpx

    rng = np.random.default_rng(a.seed)
    gaps = rng.exponential(1.0 / rate, a.n)
    gaps[0] = 0.0
    vocab = get_model_spec(MODEL).vocab
    prompts = [rng.integers(1, vocab, a.isl).tolist() for _ in range(a.n)]
    body = {"model": MODEL, "max_tokens": a.osl, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def one(c, i, at):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        sent = time.perf_counter() - t0
        times = []
        async with c.stream("POST", url + "/v1/completions", json=dict(body, prompt=prompts[i])) as r:
            if r.status_code != 200:
                raise BenchError(f"the server refused request {i} ({r.status_code}): {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise BenchError(f"request {i}'s stream ended with the server's error after {len(times)} "
                                     f"tokens: {chunk['error'].get('message')}")
                if chunk["choices"]:                    # (one token a chunk; the usage chunk has none)
                    times.append(time.perf_counter() - t0)
        if not times:
            raise BenchError(f"request {i}'s stream held no token")
        return sent, times

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=a.n)) as c:
        res = await asyncio.gather(*[one(c, i, at) for i, at in enumerate(np.cumsum(gaps))])
    sent = [s for s, _ in res]
    ttft = np.array([t[0] - s for s, t in res])
    tpot = np.array([(t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else math.nan for _, t in res])
    itl = np.concatenate([np.diff(t) for _, t in res])       # (empty with one token each)
    dur = max(t[-1] for _, t in res) - min(sent)
    good = good_count(ttft, tpot, a)
    return Measured("built-in driver (NOT a standard client)", [s - sent[0] for s in sent], [a.isl] * a.n,
                    [len(t) for _, t in res], median(ttft), float(np.mean(ttft)), median(tpot),
                    median(itl), sum(len(t) for _, t in res) / dur, good / dur, a.n)


# ---- the prediction ------------------------------------------------------------------------------
@dataclass
class PromptEnd:
    """The step (of the server's step log) that completed a request's prompt, and the prompt's tokens."""

    step: list
    prompt: int


def prompt_ends(steps: list) -> dict:
    """Each request's `PromptEnd` in `steps`, the server's step log over a run (`fetch_steps`), in order
    of the step: the one the server names as having completed its prompt (a chunked prefill feeds a
    prompt over several steps, and its first token comes from the last, whose chunk may be of one token,
    as a decode's is)."""
    ends: dict = {}
    for step in steps:
        done = set(step[4])
        for rid, n_new, n_past in step[3]:
            if rid in done:
                ends[rid] = PromptEnd(step, n_past + n_new)
    return ends


def served_lengths(steps: list) -> list[tuple[int, int]]:
    """Each request's (prompt, output) tokens in the server's step log, sorted: its prompt is what it
    was fed up to its `prompt_ends` step, and it fed every token but its last output (Orca's
    reservation never preempts)."""
    fed: dict = {}
    for _, _, _, works, _ in steps:
        for rid, n_new, n_past in works:
            fed[rid] = max(fed.get(rid, 0), n_past + n_new)
    return sorted((e.prompt, fed[rid] - e.prompt + 1) for rid, e in prompt_ends(steps).items())


def check_replayable(m: Measured, steps: list) -> None:
    """Refuse to replay lengths the client counted (AIPerf's, from its own tokenizer) unless they are
    what the server served in `steps`, its step log over the run: the replay would be another run."""
    client = sorted(zip(m.prompt_lens, m.output_lens))
    served = served_lengths(steps)
    if client == served:
        return
    if len(client) != len(served):
        what = f"{len(client)} requests, and the server's step log {len(served)}"
    else:
        k = sum(c != s for c, s in zip(client, served))
        c, s = next((c, s) for c, s in zip(client, served) if c != s)
        what = (f"(prompt, output) tokens that differ from the server's in {k} of {len(client)} requests (in order "
                f"of length, the first: {c} against {s})")
    raise BenchError(f"{m.client} recorded {what}: a replay of its lengths would not be the run the server "
                     "served, so no prediction is printed")


def prompt_steps(steps: list) -> list:
    """The step that completed each request's prompt (`prompt_ends`), one entry a request: a step that
    completed several prompts counts once for each."""
    return [e.step for e in prompt_ends(steps).values()]


TTFT_METRIC = "vllm:time_to_first_token_seconds"


@dataclass
class FirstToken:
    """Where a rate's requests waited for their first token, means over them (seconds; lecture §5: what
    the simulator models and what it leaves out). `server_s` is the server's own TTFT (`TTFT_METRIC`,
    from a request's submission to the engine, its body read and tokenized, to the end of the step that
    fed its prompt) and `step_s` that step's time (`/orca/steps`). The client's TTFT less the server's
    is the time outside the engine's clock (HTTP, reading and tokenizing the body, the first chunk's way
    back), which the simulator does not model; the server's less the step's is the engine's wait before
    the step (a step already running when the request came)."""

    client_s: float
    server_s: float
    step_s: float
    outside_s: float
    wait_s: float


def first_token(m: Measured, before: dict[str, float], after: dict[str, float], steps: list) -> FirstToken:
    """The run's `FirstToken`, from the client's TTFTs (`m`), the server's `/metrics` scraped before and
    after it and its step log over it."""
    n = after[TTFT_METRIC + "_count"] - before[TTFT_METRIC + "_count"]
    if n != m.n_ok:
        raise BenchError(f"the server counted {n:g} first tokens over the run, the client {m.n_ok}: the "
                         "server's TTFT would not be these requests'")
    server = (after[TTFT_METRIC + "_sum"] - before[TTFT_METRIC + "_sum"]) / n
    step = float(np.mean([end - start for _, start, end, _, _ in prompt_steps(steps)]))
    return FirstToken(m.ttft_mean, server, step, m.ttft_mean - server, server - step)


def predict(cal, m: Measured, a, n_slots: int, log: list) -> dict:
    """The same arrivals and lengths on the calibrated paper GPU, the same scheduler and memory; and the
    server's own steps over the run (`log`, its step log) priced by `cal`: all of them, and those that fed
    a prompt (`prompt_steps`), each counted once a request, their mean."""
    reqs = [Request(i, t, p, o, max_tokens=p + o) for i, (t, p, o) in
            enumerate(zip(m.arrivals, m.prompt_lens, m.output_lens))]
    res = Engine(cal.executor(), ReservationMemory(n_slots, "max"), SchedulerConfig(max_bs=a.max_bs)).run(reqs)
    s = summarize(res, a.slo_ttft, a.slo_tpot)
    pr = per_request(res)
    good = good_count(pr["ttft"], pr["tpot"], a)
    return {"ttft_median": s.ttft_median_s, "ttft_mean": s.ttft_mean_s, "tpot_median": s.tpot_median_s,
            "itl_median": s.itl_median_s,
            "throughput_tok_s": s.throughput_tok_s, "goodput_req_s": good / s.makespan_s,
            "steps": s.n_steps, "mean_batch": s.mean_batch, "busy_s": float((res.step_end - res.step_start).sum()),
            "busy_on_server_steps_s": sum(cal.predict(x.totals) for x in step_samples(log)),
            "prompt_step_on_server_steps_s": float(np.mean([cal.predict(x.totals)
                                                            for x in step_samples(prompt_steps(log))]))}


def warm_up(url: str, a) -> None:
    """Two requests before measuring: the first steps of a fresh process are slow (allocation)."""
    import httpx

    for _ in range(2):
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": list(range(1, a.isl + 1)),
                                                 "max_tokens": a.osl}, timeout=600).raise_for_status()


SERVER_START_S = 120.0
"""How long the server may take to answer `/health` (it loads mini in seconds)."""

BANNER = re.compile(r"orca-torch serving .* on (http://\S+) \(tokenizer ")
"""The server's line once bound, which names the port the system picked for `--port 0`."""


def server_command(a) -> list[str]:
    """The server's command line: the mini preset on one thread, the run's `--max-bs` and
    `--kv-slots`, and connections enough for all `--n` requests in flight at once (the client sends
    each at its Poisson time, answered or not; past `--max-connections` one would get 503)."""
    return [sys.executable, "-m", "orca_torch.serve", "--model", MODEL, "--threads", "1", "--port", "0",
            "--max-bs", str(a.max_bs), "--kv-slots", str(a.kv_slots),
            "--max-connections", str(max(a.n, default_connections()))]


def start_server(a) -> tuple[subprocess.Popen, str]:
    """The server in a process of its own on a port the system picks as it binds (`--port 0`), and
    its URL, read from its banner, once it answers `/health`. Its stderr goes to a file (`proc.log`):
    a pipe nobody reads during the run would stop the server once its log filled the pipe's buffer."""
    import httpx

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(server_command(a), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True,
                            preexec_fn=pin(SERVER_CPUS))
    proc.log = log
    url, health = None, "it printed no banner naming its address"
    deadline = time.time() + SERVER_START_S
    try:                            # (a Ctrl-C or SIGTERM meanwhile must not leave the server behind)
        while time.time() < deadline:
            if proc.poll() is not None:
                raise BenchError(server_exit(proc))
            if url is None:         # (pread: the server writes through the same file offset, left alone)
                found = BANNER.search(os.pread(log.fileno(), 1 << 20, 0).decode(errors="replace"))
                url = found and found.group(1)
            if url is not None:
                try:
                    status = httpx.get(f"{url}/health", timeout=1).status_code
                    if status == 200:
                        return proc, url
                    health = f"its /health answered {status}"
                except httpx.TransportError as e:
                    health = f"its /health did not answer ({type(e).__name__})"
            time.sleep(0.2)
        raise BenchError(f"the server did not start within {SERVER_START_S:g} s ({health}), and was stopped"
                         + log_tail(proc))
    except BaseException:
        proc.kill()
        proc.wait()
        log.close()
        raise


def server_exit(proc: subprocess.Popen) -> str:
    """How the server's process (`start_server`'s, exited) ended, and the end of its log."""
    rc = proc.returncode
    how = f"was killed by signal {-rc} ({signal.strsignal(-rc)})" if rc < 0 else f"exited with code {rc}"
    return f"the server {how}" + log_tail(proc)


def log_tail(proc: subprocess.Popen) -> str:
    """The end of the server's log (`start_server`'s `proc.log`), as a message's last part. (pread: a
    server still running writes through the same file offset.)"""
    fd = proc.log.fileno()
    tail = os.pread(fd, 2000, max(0, os.fstat(fd).st_size - 2000)).decode(errors="replace").strip()
    return f"; its log ends:\n{tail}" if tail else " (its log is empty)"


def slo_arg(text: str) -> float:
    """An SLO side in seconds: a finite number > 0, or inf for no bound on that side."""
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    try:
        return positive_float_arg(text)
    except argparse.ArgumentTypeError:         # (its "a finite number > 0" would hide that inf is taken)
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, or inf for no bound, "
                                         f"got {brief(text)}") from None


MAX_RUN_S = 3600.0
"""The longest a rate's arrivals may be expected to span ((`--n` - 1) / rate, the first at t = 0): past it, a
slip of the decimal point."""


def rates_arg(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {brief(text)}") from None
    if not rates or not all(0 < r < math.inf for r in rates):
        raise argparse.ArgumentTypeError(f"must be finite numbers > 0 (req/s), got {brief(text)}")
    if len(set(rates)) < len(rates):
        raise argparse.ArgumentTypeError(f"{brief(text)} names a rate twice; give each once")
    return rates


def main(argv: list[str] | None = None) -> int:
    p = command_parser(__doc__.splitlines()[0])
    p.add_argument("--client", choices=("auto", "aiperf", "builtin"), default="auto",
                   help="the load generator: aiperf, the built-in driver (not a standard client), or auto: aiperf "
                        "where its command is found (default auto)")
    p.add_argument("--rates", type=rates_arg, default=[1.0, 4.0, 16.0],
                   help="comma-separated Poisson rates, req/s (default 1,4,16)")
    p.add_argument("--n", type=count_arg, default=32,
                   help="requests per rate, each on a connection of its own (the server is given that many), so at "
                        "most what this process's open-file limit leaves room for (default 32)")
    p.add_argument("--quick-calibration", action="store_true", help="fewer step mixes, 3 repeats")
    p.add_argument("--isl", type=count_arg, default=32, help="prompt tokens per request (default 32)")
    p.add_argument("--osl", type=count_arg, default=16, help="output tokens per request (default 16)")
    p.add_argument("--max-bs", type=count_arg, default=16, help="the server's max batch size (default 16)")
    p.add_argument("--kv-slots", type=count_arg, default=16 * 2048,
                   help="the server's K/V budget in tokens (default 32768: 16 x mini's context)")
    p.add_argument("--slo-ttft", type=slo_arg, default=1.0, help="goodput's TTFT limit, s (inf: none; default 1)")
    p.add_argument("--slo-tpot", type=slo_arg, default=0.1, help="goodput's TPOT limit, s (inf: none; default 0.1)")
    add_seed_flag(p, "the arrivals, the prompts and the calibration")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    a = p.parse_args(argv)
    if a.isl + a.osl > 2048:
        p.error(f"--isl + --osl must fit mini's context of 2048 tokens, got {a.isl + a.osl}")
    if a.kv_slots < a.isl + a.osl:
        p.error(f"--kv-slots {a.kv_slots} must hold one request: --isl + --osl = {a.isl + a.osl} tokens")
    longest = max(CALIBRATION_PROMPTS) + CALIBRATION_NEW
    if a.kv_slots < longest:            # (else the server refuses it, after the minutes of calibrating)
        p.error(f"--kv-slots {a.kv_slots} must hold the calibration load's longest request: "
                f"{max(CALIBRATION_PROMPTS)} + {CALIBRATION_NEW} = {longest} tokens")
    try:                                # (the server's own check, before the minutes of calibrating)
        check_fits_in_memory(f"--kv-slots {a.kv_slots} (the server's fp32 K/V of {MODEL})",
                             get_model_spec(MODEL).with_dtype_bytes(FP32_BYTES).kv_bytes_per_token * a.kv_slots)
    except ValueError as e:
        p.error(str(e))
    least = -(-a.n * a.osl // a.max_bs)         # (a request's every output token takes a step; max_bs share one)
    if least > KEEP_STEPS:
        p.error(f"--n {a.n} requests of --osl {a.osl} tokens, --max-bs {a.max_bs} at a time, take at least {least:,} "
                f"steps a rate, past the {KEEP_STEPS:,} the server's step log keeps (the run is priced and "
                "replayed from it): give fewer requests, shorter outputs or a larger --max-bs")
    room = connection_room()
    if room is not None and a.n > room:     # (open-loop: the requests go at their times, answered or not)
        p.error(f"--n {a.n} requests may all be in flight at once, each on a connection of its own (the client sends "
                f"each at its Poisson time, whatever has been answered), past the {room:,} connections this "
                f"process's open-file limit leaves room for (ulimit -n, less {FD_RESERVE} files kept for other "
                f"use): give --n of at most {room:,}, or raise the limit")
    span = (a.n - 1) / min(a.rates)         # (the first request goes at t = 0)
    if span > MAX_RUN_S:
        p.error(f"--rates {min(a.rates):g} with --n {a.n}: the requests' arrivals would span about {span:.3g} s, "
                f"past the {MAX_RUN_S:.0f} s a rate's run may take; give rates of at least "
                f"{(a.n - 1) / MAX_RUN_S:.3g} req/s (--n - 1 over {MAX_RUN_S:.0f} s)")
    aiperf = shutil.which("aiperf")
    if a.client == "aiperf" and aiperf is None:
        p.error("aiperf is not on PATH: pip install 'orca-torch[bench]' (or use --client builtin)")
    use_aiperf = aiperf is not None and a.client != "builtin"

    import torch

    from orca_torch.lab.calibrate import calibrate
    from orca_torch.serve.tokenizer import PRESETS_DIR

    torch.set_num_threads(1)
    on = machine(torch_threads=1)                        # (the run's cores, server's and client's, before pinning)
    if SERVER_CPUS and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, SERVER_CPUS)             # calibrate on the server's core
    print(machine_line(on), file=sys.stderr)
    print("calibrating the paper GPU to this CPU (mini, one thread) ...", file=sys.stderr)
    cal = calibrate(MODEL, quick=a.quick_calibration, repeats=3 if a.quick_calibration else 5, seed=a.seed)
    if CLIENT_CPUS and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, CLIENT_CPUS)             # the built-in driver runs in this process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))   # (so the server is stopped below)
    proc, url = start_server(a)
    rows = []
    try:
        warm_up(url, a)
        print("fitting the paper GPU to the server's own steps under a calibration load ...", file=sys.stderr)
        cal_server = fit_on_server(url, a)
        with aiperf_folder() as tmp:
            for i, rate in enumerate(a.rates):
                print(f"rate {rate:g} req/s: {a.n} requests ...", file=sys.stderr)
                before = scrape(url)
                first_step = int(before["orca:iterations_total"])
                if use_aiperf:
                    m = run_aiperf(aiperf, url, PRESETS_DIR / MODEL, rate, a, tmp / f"r{i}")
                else:
                    m = asyncio.run(_builtin(url, rate, a))
                after = scrape(url)
                steps = after["orca:iterations_total"] - before["orca:iterations_total"]
                batch = (after["orca:batch_size_sum"] - before["orca:batch_size_sum"]) / max(steps, 1)
                busy = after["orca:iteration_seconds_sum"] - before["orca:iteration_seconds_sum"]
                log = fetch_steps(url, first_step)
                check_replayable(m, log)
                rows.append({"rate": rate, "measured": m.__dict__,
                             "server": {"steps": steps, "mean_batch": batch, "busy_s": busy},
                             "first_token": first_token(m, before, after, log).__dict__,
                             "predicted": predict(cal, m, a, a.kv_slots, log),
                             "predicted_server_fit": predict(cal_server, m, a, a.kv_slots, log)})
    except Exception as e:
        with contextlib.suppress(subprocess.TimeoutExpired):   # (a killed server's sockets close a moment
            proc.wait(timeout=2)                               # before it can be reaped)
        if proc.returncode is None:
            raise
        why = (str(e).splitlines() or [""])[0][:300]    # (the client's side of it: a refused connection, say)
        saw = type(e).__name__ + (f": {why}" if why else "")
        raise BenchError(f"{server_exit(proc)}\n(the client saw {saw})") from None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        proc.log.close()
    if a.json:
        print(json.dumps(jsonable({"machine": on, "client": rows[0]["measured"]["client"], "server_exit": rc,
                                    "calibration_05": {"rms_rel_error": cal.rms_rel_error, "n_mixes": len(cal.samples)},
                                    "calibration_server": {"rms_rel_error": cal_server.rms_rel_error,
                                                           "n_steps": len(cal_server.samples),
                                                           "not_identified": list(cal_server.not_identified)},
                                    "rows": rows}), indent=1, allow_nan=False))
        return 0
    from tabulate import tabulate

    def err(pv: float, mv: float) -> str:
        return f"{pv / mv - 1:+.0%}" if mv and math.isfinite(pv / mv) else "-"

    print(f"Orca live server ({MODEL}, one torch thread on its own core, max_bs={a.max_bs}, Orca's reservation)")
    print(machine_line(on))
    print(f"client: {rows[0]['measured']['client']}; {a.n} requests per rate, prompt {a.isl} and output {a.osl} "
          f"tokens, Poisson arrivals; goodput SLO: TTFT <= {a.slo_ttft:g} s and TPOT <= {a.slo_tpot * 1e3:g} ms")
    print("prediction: the same arrivals and lengths replayed on the paper GPU calibrated to this CPU, two ways:\n"
          f"  A: experiment 05's calibration (timed steps in this process before the server starts; rms step error "
          f"{cal.rms_rel_error:.0%} on {len(cal.samples)} mixes)\n"
          f"  B: fitted to the server's own {len(cal_server.samples)} steps under a calibration load before the "
          f"runs (rms {cal_server.rms_rel_error:.0%}"
          + (f"; they bound {' and '.join(cal_server.not_identified)} from below only" if cal_server.not_identified
             else "") + ")\n")
    table = []
    for r in rows:
        m, pa, pb, sv, ft = r["measured"], r["predicted"], r["predicted_server_fit"], r["server"], r["first_token"]
        rate = f"{r['rate']:g}"

        def line(label: str, mv: float, va: float, vb: float, fmt: str = ".1f") -> None:
            table.append([rate, label, figure(mv, fmt), figure(va, fmt), err(va, mv), figure(vb, fmt), err(vb, mv)])

        for label, key, scale, fmt in (("TTFT p50 (ms)", "ttft_median", 1e3, ".1f"),
                                       ("TPOT p50 (ms)", "tpot_median", 1e3, ".1f"),
                                       ("ITL p50 (ms)", "itl_median", 1e3, ".1f"),
                                       ("throughput (tok/s)", "throughput_tok_s", 1, ".1f"),
                                       ("goodput (req/s)", "goodput_req_s", 1, ".2f")):
            line(label, m[key] * scale, pa[key] * scale, pb[key] * scale, fmt)
        for label, key, fmt in (("steps (step log)", "steps", ".0f"), ("mean batch (step log)", "mean_batch", ".2f"),
                                ("busy s (step log)", "busy_s", ".2f")):
            line(label, sv[key], pa[key], pb[key], fmt)
        line("busy s, priced on the server's steps", sv["busy_s"], pa["busy_on_server_steps_s"],
             pb["busy_on_server_steps_s"], ".2f")
        line("TTFT mean (ms)", ft["client_s"] * 1e3, pa["ttft_mean"] * 1e3, pb["ttft_mean"] * 1e3)
        line("TTFT mean, the server's clock (ms)", ft["server_s"] * 1e3, pa["ttft_mean"] * 1e3, pb["ttft_mean"] * 1e3)
        line("TTFT mean, outside that clock (ms)", ft["outside_s"] * 1e3, math.nan, math.nan)
        line("the step that fed the prompt (ms)", ft["step_s"] * 1e3, pa["prompt_step_on_server_steps_s"] * 1e3,
             pb["prompt_step_on_server_steps_s"] * 1e3)
        line("the engine's wait before that step (ms)", ft["wait_s"] * 1e3, math.nan, math.nan)
    print(tabulate(table, ["rate req/s", "figure", "measured", "A", "error", "B", "error"], disable_numparse=True))
    print(f"\nTTFT mean: the client's; on the server's clock, its {TTFT_METRIC} (from a request's submission to "
          "the engine, its body read and tokenized, to the end of the step that fed its prompt); outside that "
          "clock, the client's less the server's (HTTP, reading and tokenizing the body, the first chunk's way "
          "back), which the simulator does not model (n/a). The step that fed each prompt (/orca/steps), a mean "
          "over the requests, with A and B pricing those same steps; the engine's wait before it, the server's "
          "TTFT less that step.")
    print(f"\nserver exit status after SIGTERM: {rc}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`main`, a `BenchError` said on stderr after the script's name (exit code 1)."""
    try:
        return main(argv)
    except BenchError as e:
        print(f"bench_serve.py: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    with quiet_exit():
        sys.exit(cli())
