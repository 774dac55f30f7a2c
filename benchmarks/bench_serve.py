"""The live server measured by a standard benchmark client, beside the paper GPU's prediction of
the same run (lecture §5: the simulator checked against the real engine, here end to end).

    python benchmarks/bench_serve.py [--client auto|aiperf|builtin] [--rates 1,3,8] [--n 24]
                                     [--isl 32] [--osl 16] [--max-bs 16] [--seed 0] [--json]

1. Calibrates the paper GPU to this CPU on the `mini` model at one thread (`lab.calibrate`, as
   experiment 05 does), before the server starts so the two do not share the cores.
2. Starts `python -m orca_torch.serve --model mini --threads 1` on 127.0.0.1 and drives it at each
   Poisson rate with fixed prompt and output lengths: with AIPerf (the `bench` extra) when its
   `aiperf` command is found, else with the small built-in driver below, which is NOT a standard
   client and says so in the output.
3. Prints what the client measured (TTFT, TPOT, ITL, output throughput, goodput) and replays the
   same arrivals and lengths on the calibrated paper GPU (the same Orca scheduler and memory
   manager on a `CostModelExecutor`), prediction beside measurement; then the server's own step
   log (iterations and mean batch, from its /metrics) beside the simulator's.

TPOT is per request (end-to-end minus TTFT, over the tokens after the first; AIPerf's
"inter_token_latency"), ITL per chunk (AIPerf's "inter_chunk_latency"). Goodput counts the requests
that met both `--slo-ttft` and `--slo-tpot` per second of the run. What the simulator does not
model: HTTP, tokenization and the event loop (tens of microseconds a token), the engine thread's
Python between steps, and other processes on a shared machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orca_torch.core.engine import Engine  # noqa: E402
from orca_torch.core.memory import ReservationMemory  # noqa: E402
from orca_torch.core.request import Request  # noqa: E402
from orca_torch.core.scheduler import SchedulerConfig  # noqa: E402
from orca_torch.lab.metrics import per_request, summarize  # noqa: E402

MODEL = "mini"


@dataclass
class Measured:
    """One rate's run as a client saw it (seconds), and what it sent (to replay it)."""

    client: str
    arrivals: list[float]
    prompt_lens: list[int]
    output_lens: list[int]
    ttft_median: float
    tpot_median: float
    itl_median: float
    throughput_tok_s: float
    goodput_req_s: float
    n_ok: int
    extra: dict = field(default_factory=dict)


def cpu_name() -> str:
    """The CPU's model name (Linux), else the platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics as {name{labels}: value}."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k.split("{")[0] + ("" if "le=" not in k else k[k.index("le="):])] = float(v)
    return out


# ---- the standard client -----------------------------------------------------------------------
def run_aiperf(aiperf: str, url: str, tokenizer: Path, rate: float, a, out_dir: Path) -> Measured:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}   # it refuses local paths with it
    cmd = [aiperf, "profile", "--model", MODEL, "--tokenizer", str(tokenizer), "--url", url,
           "--endpoint-type", "completions", "--streaming", "--request-rate", str(rate),
           "--arrival-pattern", "poisson", "--request-count", str(a.n), "--isl", str(a.isl), "--isl-stddev", "0",
           "--osl", str(a.osl), "--osl-stddev", "0", "--random-seed", str(a.seed),
           "--extra-inputs", "ignore_eos:true", "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
           "--workers-max", "1", "--goodput",
           f"time_to_first_token:{a.slo_ttft * 1e3:g} inter_token_latency:{a.slo_tpot * 1e3:g}",
           "--artifact-dir", str(out_dir)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise RuntimeError(f"aiperf failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    s = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    recs = [json.loads(line) for line in (out_dir / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r["metadata"].get("benchmark_phase", "profiling") == "profiling"]
    recs.sort(key=lambda r: r["metadata"]["request_start_ns"])
    t0 = recs[0]["metadata"]["request_start_ns"]
    ms = 1e-3
    return Measured(
        "AIPerf " + s.get("aiperf_version", ""),
        [(r["metadata"]["request_start_ns"] - t0) * 1e-9 for r in recs],
        [int(r["metrics"]["input_sequence_length"]["value"]) for r in recs],
        [int(r["metrics"]["output_sequence_length"]["value"]) for r in recs],
        s["time_to_first_token"]["p50"] * ms, s["inter_token_latency"]["p50"] * ms,
        s["inter_chunk_latency"]["p50"] * ms, s["output_token_throughput"]["avg"],
        s.get("goodput", {}).get("avg", math.nan), len(recs),
        {"benchmark_duration_s": s["benchmark_duration"]["avg"]})


# ---- the fallback: NOT a standard client --------------------------------------------------------
async def _builtin(url: str, rate: float, a) -> Measured:
    import httpx

    rng = np.random.default_rng(a.seed)
    gaps = rng.exponential(1.0 / rate, a.n)
    gaps[0] = 0.0
    prompts = [rng.integers(1, 10240, a.isl).tolist() for _ in range(a.n)]
    body = {"model": MODEL, "max_tokens": a.osl, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def one(c, i, at):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        sent = time.perf_counter() - t0
        times = []
        async with c.stream("POST", url + "/v1/completions", json=dict(body, prompt=prompts[i])) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    times.append(time.perf_counter() - t0)
        return sent, times

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=a.n)) as c:
        res = await asyncio.gather(*[one(c, i, at) for i, at in enumerate(np.cumsum(gaps))])
    sent = [s for s, _ in res]
    ttft = np.array([t[0] - s for s, t in res])
    tpot = np.array([(t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else math.nan for _, t in res])
    itl = np.concatenate([np.diff(t) for _, t in res])
    dur = max(t[-1] for _, t in res) - min(sent)
    good = int(np.sum((ttft <= a.slo_ttft) & (np.nan_to_num(tpot) <= a.slo_tpot)))
    return Measured("built-in driver (NOT a standard client)", [s - sent[0] for s in sent], [a.isl] * a.n,
                    [len(t) for _, t in res], float(np.median(ttft)), float(np.nanmedian(tpot)),
                    float(np.median(itl)), sum(len(t) for _, t in res) / dur, good / dur, a.n)


# ---- the prediction ------------------------------------------------------------------------------
def predict(cal, m: Measured, a, n_slots: int) -> dict:
    """The same arrivals and lengths on the calibrated paper GPU, the same scheduler and memory."""
    reqs = [Request(i, t, p, o, max_tokens=p + o) for i, (t, p, o) in
            enumerate(zip(m.arrivals, m.prompt_lens, m.output_lens))]
    res = Engine(cal.executor(), ReservationMemory(n_slots, "max"), SchedulerConfig(max_bs=a.max_bs)).run(reqs)
    s = summarize(res, a.slo_ttft, a.slo_tpot)
    pr = per_request(res)
    good = int(np.sum((pr["ttft"] <= a.slo_ttft) & (np.nan_to_num(pr["tpot"]) <= a.slo_tpot)))
    return {"ttft_median": s.ttft_median_s, "tpot_median": s.tpot_median_s, "itl_median": s.itl_median_s,
            "throughput_tok_s": s.throughput_tok_s, "goodput_req_s": good / s.makespan_s,
            "steps": s.n_steps, "mean_batch": s.mean_batch, "busy_s": float((res.step_end - res.step_start).sum())}


def warm_up(url: str, a) -> None:
    """Two requests before measuring: the first steps of a fresh process are slow (allocation)."""
    import httpx

    for _ in range(2):
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": list(range(1, a.isl + 1)),
                                                 "max_tokens": a.osl}, timeout=600).raise_for_status()


def start_server(port: int, a) -> subprocess.Popen:
    import httpx

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "orca_torch.serve", "--model", MODEL, "--threads", "1",
                             "--port", str(port), "--max-bs", str(a.max_bs), "--kv-slots", str(a.kv_slots)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start within 120 s")


def rates_arg(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates must be comma-separated numbers, got {text!r}") from None
    if not rates or not all(0 < r < math.inf for r in rates):
        raise argparse.ArgumentTypeError(f"--rates must be positive, got {text!r}")
    return rates


def positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--client", choices=("auto", "aiperf", "builtin"), default="auto")
    p.add_argument("--rates", type=rates_arg, default=[1.0, 3.0, 8.0], help="Poisson rates, req/s")
    p.add_argument("--n", type=positive, default=24, help="requests per rate")
    p.add_argument("--isl", type=positive, default=32, help="prompt tokens")
    p.add_argument("--osl", type=positive, default=16, help="output tokens")
    p.add_argument("--max-bs", type=positive, default=16)
    p.add_argument("--kv-slots", type=positive, default=16 * 2048)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="goodput's TTFT limit, s")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput's TPOT limit, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.isl + a.osl > 2048:
        p.error(f"--isl + --osl must fit mini's context of 2048 tokens, got {a.isl + a.osl}")
    aiperf = shutil.which("aiperf")
    if a.client == "aiperf" and aiperf is None:
        p.error("aiperf is not on PATH: pip install 'orca-torch[bench]' (or use --client builtin)")
    use_aiperf = aiperf is not None and a.client != "builtin"

    import torch

    from orca_torch.lab.calibrate import calibrate
    from orca_torch.serve.tokenizer import PRESETS_DIR

    torch.set_num_threads(1)
    machine = f"{cpu_name()}, {os.cpu_count()} cores ({platform.system()} {platform.machine()})"
    print(f"machine: {machine}; torch {torch.__version__}, one thread", file=sys.stderr)
    print("calibrating the paper GPU to this CPU (mini, one thread) ...", file=sys.stderr)
    cal = calibrate(MODEL, quick=True, repeats=3, seed=a.seed)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port, a)
    rows = []
    try:
        warm_up(url, a)
        with tempfile.TemporaryDirectory() as tmp:
            for i, rate in enumerate(a.rates):
                print(f"rate {rate:g} req/s: {a.n} requests ...", file=sys.stderr)
                before = scrape(url)
                if use_aiperf:
                    m = run_aiperf(aiperf, url, PRESETS_DIR / MODEL, rate, a, Path(tmp) / f"r{i}")
                else:
                    m = asyncio.run(_builtin(url, rate, a))
                after = scrape(url)
                steps = after["orca:iterations_total"] - before["orca:iterations_total"]
                batch = (after["orca:batch_size_sum"] - before["orca:batch_size_sum"]) / max(steps, 1)
                busy = after["orca:iteration_seconds_sum"] - before["orca:iteration_seconds_sum"]
                rows.append({"rate": rate, "measured": m.__dict__,
                             "server": {"steps": steps, "mean_batch": batch, "busy_s": busy},
                             "predicted": predict(cal, m, a, a.kv_slots)})
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    if a.json:
        print(json.dumps({"machine": machine, "client": rows[0]["measured"]["client"], "server_exit": rc,
                          "calibration": {"rms_rel_error": cal.rms_rel_error, "overhead_s": cal.overhead_s},
                          "rows": [{k: v for k, v in r.items()} for r in rows]}, indent=1, default=float))
        return 0
    from tabulate import tabulate

    client = rows[0]["measured"]["client"]
    print(f"Orca live server ({MODEL}, one torch thread, max_bs={a.max_bs}, Orca's reservation) on {machine}")
    print(f"client: {client}; {a.n} requests per rate, prompt {a.isl} and output {a.osl} tokens, Poisson "
          f"arrivals; goodput SLO: TTFT <= {a.slo_ttft:g} s and TPOT <= {a.slo_tpot * 1e3:g} ms")
    print(f"prediction: the same arrivals and lengths on the paper GPU calibrated to this CPU "
          f"(rms step error {cal.rms_rel_error:.0%} on {len(cal.samples)} mixes)\n")
    table = []
    for r in rows:
        m, pr, sv = r["measured"], r["predicted"], r["server"]
        for label, key, scale, unit in (("TTFT p50", "ttft_median", 1e3, "ms"), ("TPOT p50", "tpot_median", 1e3, "ms"),
                                        ("ITL p50", "itl_median", 1e3, "ms"),
                                        ("throughput", "throughput_tok_s", 1, "tok/s"),
                                        ("goodput", "goodput_req_s", 1, "req/s")):
            mv, pv = m[key] * scale, pr[key] * scale
            table.append([f"{r['rate']:g}", f"{label} ({unit})", f"{mv:.1f}", f"{pv:.1f}", f"{pv / mv - 1:+.0%}"
                          if mv else "-"])
        table.append([f"{r['rate']:g}", "steps (server log)", f"{sv['steps']:.0f}", f"{pr['steps']}",
                      f"{pr['steps'] / sv['steps'] - 1:+.0%}" if sv["steps"] else "-"])
        table.append([f"{r['rate']:g}", "mean batch (server log)", f"{sv['mean_batch']:.2f}", f"{pr['mean_batch']:.2f}",
                      f"{pr['mean_batch'] / sv['mean_batch'] - 1:+.0%}" if sv["mean_batch"] else "-"])
        table.append([f"{r['rate']:g}", "busy s (server log)", f"{sv['busy_s']:.2f}", f"{pr['busy_s']:.2f}",
                      f"{pr['busy_s'] / sv['busy_s'] - 1:+.0%}" if sv["busy_s"] else "-"])
    print(tabulate(table, ["rate req/s", "figure", "measured", "predicted", "error"], disable_numparse=True))
    print(f"\nserver exit status after SIGTERM: {rc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
