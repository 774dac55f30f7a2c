"""Shape checks on experiments 03 and 04 (lecture §5.2–§6.4), on their --quick forms.

Each script runs once per module as a subprocess (`--quick --json --plot DIR --trace FILE`, a few
seconds each on 2 cores) and a second time, without the pictures, for the determinism check; the
assertions are on the lecture's shapes — orders of magnitude, the ordering of systems, the
crossovers — not on exact figures. Code 04 is two scripts (`04_knobs.py`, `04_scheduling.py`); their
JSON objects are read as one.
The pages' figures are checked against the same runs, and their tables over seeds 0-2 against the
full form of code 04's demo 1 (about a second a script).
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from figure_files import assert_pngs
from test_docs import page_text, table_row

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"03": ROOT / "experiments" / "03_continuous_batching.py", "04": ROOT / "experiments" / "04_knobs.py",
           "04s": ROOT / "experiments" / "04_scheduling.py"}
COST_MODELS = ROOT / "experiments" / "03_cost_models.py"     # (no pictures: not among SCRIPTS)
PNGS = {"03": ["03_rate_sweep", "03_overload_throughput"], "04": ["04_kv_over_time", "04_max_bs_tradeoff"],
        "04s": ["04_ttft_by_order", "04_itl_by_prefill"]}


def _run(which: str, *extra: str) -> str:
    """`which` is a key of SCRIPTS, or "03c" for 03_cost_models.py."""
    assert which in SCRIPTS or which == "03c", which
    proc = subprocess.run([sys.executable, str(SCRIPTS.get(which, COST_MODELS)), "--quick", "--json", *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("figures")


def _run_with_files(which: str, out_dir: Path) -> str:
    return _run(which, "--plot", str(out_dir), "--trace", str(out_dir / f"{which}.trace.json"))


@pytest.fixture(scope="module")
def out03(out_dir: Path) -> str:
    return _run_with_files("03", out_dir)


@pytest.fixture(scope="module")
def out04(out_dir: Path) -> str:
    return _run_with_files("04", out_dir)


@pytest.fixture(scope="module")
def out04s(out_dir: Path) -> str:
    return _run_with_files("04s", out_dir)


@pytest.fixture(scope="module")
def e03(out03: str) -> dict:
    return json.loads(out03)


@pytest.fixture(scope="module")
def e04(out04: str, out04s: str) -> dict:
    knobs, scheduling = json.loads(out04), json.loads(out04s)
    assert knobs["setup"] == scheduling["setup"]
    return {**knobs, **scheduling}


def _row(rows: list[dict], **match) -> dict:
    found = [r for r in rows if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, match
    return found[0]


# ---- 03: continuous vs static ------------------------------------------------------------------

def test_goodput_ordering_and_two_orders_of_magnitude(e03: dict) -> None:
    g = e03["goodput_req_s"]
    one, static, omax, oracle = g["one_at_a_time"], g["static_b128"], g["orca_max"], g["orca_oracle"]
    assert 0 < one and 0 < static < 1                      # both held back by head-of-line blocking
    assert 0.5 < static / one < 2                          # static ~ one at a time
    assert omax > 20 * static                              # continuous batching: a different regime
    assert oracle > 1.2 * omax                             # reserving less admits more
    assert oracle / static >= 100                          # two orders of magnitude (lecture 632x)
    gpus = e03["h100s_for_100_req_s"]
    assert gpus["static_b128"] == math.ceil(100 / static)
    assert gpus["static_b128"] > 50 * gpus["orca_oracle"]


def test_goodput_search_brackets_the_target(e03: dict) -> None:
    s = e03["goodput_search"]
    for name, rate in e03["goodput_req_s"].items():
        evals = s["by_system"][name]["evaluations"]
        met = [r for r, a in evals if a >= s["target_attainment"]]
        missed = [r for r, a in evals if a < s["target_attainment"]]
        assert rate == max(met)
        above = min(r for r in missed if r > rate)
        assert above / rate <= 1 + s["rel_tol"] + 1e-9


def test_ttft_at_1_req_s_milliseconds_vs_about_a_second(e03: dict) -> None:
    rows = e03["rate_sweep"]
    static = _row(rows, system="static_b128", rate_req_s=1)["ttft_median_s"]
    for orca in ("orca_max", "orca_oracle"):
        t = _row(rows, system=orca, rate_req_s=1)["ttft_median_s"]
        assert 0.001 < t < 0.1                             # a prefill or two (lecture 12 ms)
        assert static > 10 * t
    assert static > 0.7                                     # waits for the previous batch (lecture 1.6 s)


def test_static_saturates_and_max_reservation_overloads_first(e03: dict) -> None:
    rows = e03["rate_sweep"]
    static_tp = [r["throughput_tok_s"] for r in rows if r["system"] == "static_b128"]
    assert 1000 < max(static_tp) < 3000                    # lecture: one to two thousand tok/s
    hi = max(r["rate_req_s"] for r in rows)
    assert _row(rows, system="orca_oracle", rate_req_s=hi)["throughput_tok_s"] > 2 * max(static_tp)
    at32 = {s: _row(rows, system=s, rate_req_s=32) for s in ("orca_max", "orca_oracle")}
    assert at32["orca_max"]["slo_attainment"] < 0.5 < at32["orca_oracle"]["slo_attainment"]
    assert at32["orca_max"]["mean_batch"] < 53            # at most 52 requests of 8192 fit the H100
    lo = min(r["rate_req_s"] for r in rows)
    assert (_row(rows, system="orca_oracle", rate_req_s=hi)["itl_p99_s"]
            > 3 * _row(rows, system="orca_oracle", rate_req_s=lo)["itl_p99_s"])   # prefills join decode steps


def test_overload_throughput_below_the_bounds(e03: dict) -> None:
    for key in ("overload_600_requests", "overload_3000_requests"):
        o = e03[key]
        ideal, roof = o["ideal_decode_bound"], o["roofline_bound_with_prefill"]
        assert ideal["batch"] * ideal["context_tokens"] <= ideal["kv_slots"]
        assert (ideal["batch"] + 1) * ideal["context_tokens"] > ideal["kv_slots"]
        capped = o["ideal_decode_bound_max_bs_256"]
        assert capped["batch"] == min(256, ideal["batch"]) and capped["tok_s"] <= ideal["tok_s"]
        assert roof["tok_s"] <= ideal["tok_s"]
        systems = [k for k in o if isinstance(o[k], dict) and "throughput_tok_s" in o[k]]
        assert "orca_oracle" in systems and "static_b128" in systems
        for s in systems:
            assert o[s]["throughput_tok_s"] <= roof["tok_s"]
            # both shares of the ideal bound: uncapped, and capped at the max_bs Orca runs with
            for kind in ("steady", "overall"):
                tok_s = o[s]["steady_throughput_tok_s" if kind == "steady" else "throughput_tok_s"]
                assert o[s][f"{kind}_fraction_of_ideal"] == pytest.approx(tok_s / ideal["tok_s"], rel=1e-12)
                assert o[s][f"{kind}_fraction_of_ideal_max_bs_256"] == pytest.approx(tok_s / capped["tok_s"],
                                                                                     rel=1e-12)
                assert o[s][f"{kind}_fraction_of_ideal_max_bs_256"] >= o[s][f"{kind}_fraction_of_ideal"]
        assert o["orca_oracle"]["steady_throughput_tok_s"] > 2 * o["static_b128"]["steady_throughput_tok_s"]
    # Exercise 8: a longer run brings overall and steady together.
    o600, o3000 = e03["overload_600_requests"]["orca_oracle"], e03["overload_3000_requests"]["orca_oracle"]
    assert abs(o3000["steady_over_overall"] - 1) < abs(o600["steady_over_overall"] - 1)
    assert abs(o3000["steady_over_overall"] - 1) < 0.05


# ---- 04: the knobs -----------------------------------------------------------------------------

def test_max_reservation_stores_far_less_than_it_occupies(e04: dict) -> None:
    rows = e04["reservation_sweep"]
    mx = _row(rows, reservation="max", rate_req_s=8)
    assert mx["mem_occupied_frac"] > 0.8                   # lecture: about 90% occupied
    assert mx["mem_stored_frac"] < 0.4 * mx["mem_occupied_frac"]   # lecture: about a quarter holds tokens
    assert 35 < mx["mean_batch"] <= 52                     # forty-some; 52 reservations of 8192 fit
    for rate in {r["rate_req_s"] for r in rows}:
        o = _row(rows, reservation="oracle", rate_req_s=rate)
        u = _row(rows, reservation="unlimited", rate_req_s=rate)
        m = _row(rows, reservation="max", rate_req_s=rate)
        assert o["stored_over_occupied"] > m["stored_over_occupied"]
        assert u["stored_over_occupied"] == pytest.approx(1.0)
        assert m["slo_attainment"] <= o["slo_attainment"] + 1e-9 <= u["slo_attainment"] + 2e-9


def test_fcfs_equals_shortest_first_exactly_when_nothing_queues(e04: dict) -> None:
    runs = e04["order_at_max_bs_256"]
    light = [r for r in runs if int(r) != 40]
    assert light, "exercise 5 must run a rate without queueing"
    for rate, d in runs.items():
        nothing_queued = d["fcfs"]["n_queued"] == 0 and d["spf"]["n_queued"] == 0
        assert d["identical_token_times"] == nothing_queued
    for rate in light:
        d = runs[rate]
        assert d["identical_token_times"]
        assert d["fcfs"]["ttft_p99_s"] == d["spf"]["ttft_p99_s"]
        assert d["fcfs"]["slo_attainment"] == d["spf"]["slo_attainment"] == 1.0


def test_shortest_first_lowers_median_ttft_at_max_bs_64(e04: dict) -> None:
    d = e04["scheduling_order"]
    fcfs = d["fcfs"]
    assert fcfs["n_queued"] > 0
    for k in ("spf_oracle", "spf_sigma_0.5", "spf_sigma_1"):
        assert d[k]["ttft_median_s"] < fcfs["ttft_median_s"] / 3   # lecture: 3.4 s -> 0.1 s
        assert d[k]["slo_attainment"] > fcfs["slo_attainment"]
        assert d[k]["ttft_max_s"] > fcfs["ttft_max_s"]             # starvation of long requests


def test_max_bs_beyond_the_needed_concurrency_changes_nothing(e04: dict) -> None:
    same = e04["max_bs_256_equals_512"]
    light = [r for r in same if int(r) != 48]
    assert light and all(same[r] for r in light)
    rows = e04["max_bs_sweep"][light[0]]
    assert _row(rows, max_bs=256)["max_batch"] < 256
    small, big = _row(rows, max_bs=8), _row(rows, max_bs=256)
    assert small["ttft_median_s"] > 10 * big["ttft_median_s"]
    assert big["tpot_median_s"] > small["tpot_median_s"]


def test_prefill_first_hurts_inter_token_latency(e04: dict) -> None:
    rows = e04["prefill_insertion"]
    rates = sorted({r["rate_req_s"] for r in rows})
    for rate in rates:
        m, p = _row(rows, prefill="mixed", rate_req_s=rate), _row(rows, prefill="prefill_first", rate_req_s=rate)
        assert p["itl_max_s"] > m["itl_max_s"]
    hi = rates[-1]
    m, p = _row(rows, prefill="mixed", rate_req_s=hi), _row(rows, prefill="prefill_first", rate_req_s=hi)
    assert p["throughput_tok_s"] < m["throughput_tok_s"] and p["ttft_median_s"] > m["ttft_median_s"]


def test_chunked_prefill_bounds_every_step_and_the_stall(e04: dict) -> None:
    """Exercise 9: a token budget caps each step, so no decode waits behind a whole prompt (ITL max drops)."""
    rows = e04["chunked_prefill"]
    rates = sorted({r["rate_req_s"] for r in rows})
    budgets = sorted({r["token_budget"] for r in rows if r["prefill"] == "chunked"})
    assert budgets == [512, 2048] and rates == sorted({r["rate_req_s"] for r in e04["prefill_insertion"]})
    for rate in rates:
        mixed = _row(rows, prefill="mixed", rate_req_s=rate)
        assert mixed == {**_row(e04["prefill_insertion"], prefill="mixed", rate_req_s=rate), "token_budget": None}
        assert mixed["max_step_tokens"] > budgets[-1]          # a whole long prompt in one step
        c = {b: _row(rows, prefill="chunked", token_budget=b, rate_req_s=rate) for b in budgets}
        for b, r in c.items():
            assert r["n_requests"] == mixed["n_requests"] and r["n_rejected"] == 0
            assert r["max_step_tokens"] <= b
            assert r["itl_max_s"] <= r["max_step_s"] + 1e-12   # decodes are never paused: a gap is one step
            assert r["itl_max_s"] < mixed["itl_max_s"]
        assert c[512]["itl_max_s"] < c[2048]["itl_max_s"]      # a smaller budget, a shorter worst step
    lo = rates[0]
    m, c512 = _row(rows, prefill="mixed", rate_req_s=lo), _row(rows, prefill="chunked", token_budget=512, rate_req_s=lo)
    assert m["ttft_median_s"] < c512["ttft_median_s"] < 1.5 * m["ttft_median_s"]   # a small TTFT cost


def test_api_passes_the_token_budget_and_chunked_prefill_through() -> None:
    from orca_torch.lab.api import run, simulate
    from orca_torch.lab.metrics import summarize

    kw = dict(max_bs=16, seed=3, max_num_batched_tokens=256, chunked_prefill=True)
    res = run("chat", 8.0, 40, "orca-oracle", trace=True, **kw)
    assert res.config.max_num_batched_tokens == 256 and res.config.chunked_prefill
    assert res.step_n_tokens.max() <= 256
    fed: dict = {}
    for _, _, _, works in res.trace:
        assert sum(nn for _, nn, _ in works) <= 256
        for rid, nn, past in works:
            assert past == fed.get(rid, 0)                      # chunks continue where the last one stopped
            fed[rid] = past + nn
    assert any(nn > 1 and past > 0 for *_, works in res.trace for _, nn, past in works)   # a prompt was split
    for r in res.requests:
        assert fed[r.req_id] == r.prompt_len + r.output_len - 1
    assert simulate("chat", 8.0, 40, "orca-oracle", **kw) == summarize(run("chat", 8.0, 40, "orca-oracle", **kw))
    with pytest.raises(ValueError, match="chunked_prefill"):    # a budget without chunking refuses long prompts
        run("chat", 8.0, 40, "orca-oracle", max_bs=16, max_num_batched_tokens=256)


def test_max_context_4096_rejects_long_requests_and_doubles_capacity(e04: dict) -> None:
    from orca_torch.lab.workload import chat

    rows = e04["max_context_4096"]
    for rate in (16, 32):
        want = sum(r.total_len > 4096 for r in chat(n_requests=600, rate=rate, seed=e04["setup"]["seed"]))
        short, full = _row(rows, max_context=4096, rate_req_s=rate), _row(rows, max_context=8192, rate_req_s=rate)
        assert short["n_rejected"] == want > 0 and full["n_rejected"] == 0
        assert short["n_requests"] == 600 - want
        # over submitted requests a rejection is a miss: it can only lower attainment, and by exactly that share
        met = short["slo_attainment"] * short["n_requests"]
        assert short["slo_attainment_submitted"] == pytest.approx(met / 600, rel=1e-12)
        served, submitted = short["slo_attainment"], short["slo_attainment_submitted"]
        assert served - want / 600 - 1e-12 <= submitted < served
        assert full["slo_attainment_submitted"] == full["slo_attainment"]
        assert short["mem_occupied_frac"] < full["mem_occupied_frac"]
    s32, f32 = _row(rows, max_context=4096, rate_req_s=32), _row(rows, max_context=8192, rate_req_s=32)
    assert f32["slo_attainment"] < 0.5 < 0.9 < s32["slo_attainment"]
    assert s32["mean_batch"] > 1.3 * f32["mean_batch"]


# ---- both -------------------------------------------------------------------------------------

def test_workload_means_are_those_of_the_drawn_requests_and_the_data_file(e03: dict, e04: dict) -> None:
    import numpy as np

    from orca_torch.lab.workload import chat, from_azure_csv

    trace = from_azure_csv()
    whole = {"n_requests": len(trace), "prompt_mean_tokens": float(np.mean([r.prompt_len for r in trace])),
             "output_mean_tokens": float(np.mean([r.output_len for r in trace]))}
    drawn = chat(n_requests=600, rate=1.0, seed=e04["setup"]["seed"])
    assert e03["workload"]["whole_trace"] == whole == e04["setup"]["chat_lengths"]["whole_trace"]
    d = e04["setup"]["chat_lengths"]["drawn"]
    assert d["prompt_mean_tokens"] == float(np.mean([r.prompt_len for r in drawn]))
    assert d["output_mean_tokens"] == float(np.mean([r.output_len for r in drawn]))
    assert e03["workload"]["prompt_mean_tokens"] == d["prompt_mean_tokens"]


def test_the_overload_tables_give_each_column_its_unit() -> None:
    """Two columns are tok/s, the rest ratios printed as percentages: the title claims no one unit."""
    proc = subprocess.run([sys.executable, str(SCRIPTS["03"]), "--quick"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    for n, n_systems in ((600, 4), (3000, 2)):
        table = proc.stdout.split(f"overload at 128 req/s, {n} requests")[1].splitlines()
        title, head, _, *rows = table[:3 + n_systems]
        assert title == ""
        assert re.split(r"\s{2,}", head.strip())[:3] == ["system", "overall tok/s", "steady tok/s"]
        for row in rows:
            cells = re.split(r"\s{2,}", row.strip())
            assert float(cells[1]) > 0 and float(cells[2]) > 0 and all(c.endswith("%") for c in cells[3:]), row


def test_same_seed_same_json_with_or_without_pictures(out03: str, out04: str, out04s: str) -> None:
    assert _run("03") == out03
    assert _run("04") == out04
    assert _run("04s") == out04s


@pytest.mark.parametrize("which", list(SCRIPTS))
def test_quick_plot_writes_the_figures(which: str, out_dir: Path, e03: dict, e04: dict) -> None:
    assert_pngs(out_dir, PNGS[which])


def test_trace_holds_the_traced_run(out_dir: Path, e03: dict, e04: dict) -> None:
    """03 traces Orca (oracle) in overload (600 requests), 04 the max reservation at 8 req/s, 04_scheduling
    chunked prefill 512 at the highest rate: one request lane each, a step span per step."""
    def load(which: str) -> list[dict]:
        return json.loads((out_dir / f"{which}.trace.json").read_text())["traceEvents"]

    spans = [e for e in load("03") if e.get("cat") == "request"]
    assert len(spans) == 600 and all(e["dur"] >= 0 for e in spans)
    mx = _row(e04["reservation_sweep"], reservation="max", rate_req_s=8)
    steps = [e for e in load("04") if e.get("cat") == "step"]
    assert max(e["args"]["batch_size"] for e in steps) == mx["max_batch"]
    hi = max(r["rate_req_s"] for r in e04["chunked_prefill"])
    c512 = _row(e04["chunked_prefill"], prefill="chunked", token_budget=512, rate_req_s=hi)
    chunked = [e["args"] for e in load("04s") if e.get("cat") == "step"]
    assert max(a["tokens"] for a in chunked) == c512["max_step_tokens"]
    # every sequence of a step works on its prompt (a chunk counts) or decodes: none is left out of both
    assert all(a["prefills"] + a["decodes"] == a["batch_size"] for a in chunked)


# ---- the pages quote these figures -------------------------------------------------------------------
# The pages quote the full runs; where `--quick` runs the same simulation (the same 600 requests at a
# rate both forms sweep, the overload run), its --json must give the figure the page prints.

def test_page_03_quotes_these_figures(e03: dict, out_dir: Path) -> None:
    page = "docs/experiments/03-continuous-batching.md"
    lv = {k: v["project"] for k, v in e03["rate_sweep_lecture_vs_project"].items()}
    assert table_row(page, "TTFT median at 1 req/s, static / Orca")[-1] == \
        f"{lv['static_ttft_median_s_at_1']:.2f} s / {lv['orca_ttft_median_s_at_1'] * 1e3:.1f} ms"
    assert table_row(page, "static throughput ceiling")[-1] == f"{lv['static_peak_throughput_tok_s']:,.0f} tok/s"
    assert table_row(page, "Orca (max 8192) at 16 req/s: SLO, tok/s")[-1] == \
        f"{lv['orca_max_slo_attainment_at_16']:.0%}, {lv['orca_max_throughput_tok_s_at_16']:,.0f}"
    assert table_row(page, "Orca (max 8192) at 32 req/s: SLO, tok/s")[-1] == \
        f"{lv['orca_max_slo_attainment_at_32']:.1%}, {lv['orca_max_throughput_tok_s_at_32']:,.0f}"
    assert table_row(page, "Orca (oracle) at 32 req/s: SLO")[-1].startswith(f"{lv['orca_oracle_slo_attainment_at_32']:.0%} ")
    assert table_row(page, "ITL P99, low → high load")[-1] == \
        f"{lv['orca_oracle_itl_p99_s_at_1'] * 1e3:.1f} → {lv['orca_oracle_itl_p99_s_at_64'] * 1e3:.0f} ms"
    o = e03["overload_600_requests"]
    for label, key in (("overload 128 req/s, Orca (oracle) overall / steady tok/s", "orca_oracle"),
                       ("overload, static overall / steady tok/s", "static_b128")):
        assert table_row(page, label)[-1] == \
            f"{o[key]['throughput_tok_s']:,.0f} / {o[key]['steady_throughput_tok_s']:,.0f}"
    oracle, ideal = o["orca_oracle"], o["ideal_decode_bound"]
    text = page_text(page)
    steps = [e for e in json.loads((out_dir / "03.trace.json").read_text())["traceEvents"] if e.get("cat") == "step"]
    longest = max(steps, key=lambda e: e["dur"])["args"]       # (the traced run is this overload's Orca (oracle))
    assert longest["batch_size"] == oracle["longest_step_n_seqs"]
    assert (f"one step carries {oracle['longest_step_n_seqs']} sequences at once ({oracle['longest_step_s']:.1f} s "
            f"with no token out): {longest['prefills']} queued prompts prefilled together and {longest['decodes']} "
            "decodes held up beside them") in text
    assert f"steady ends up {1 - oracle['steady_over_overall']:.0%} *below* overall" in text
    assert f"for demo 3's 600 requests {ideal['batch']} sequences, {ideal['tok_s']:,.0f} tok/s" in text
    assert f"({oracle['prefill_alone_gpu_s']:.1f} of {oracle['busy_gpu_s']:.1f} s)" in text
    assert f"one prefill alone takes {e03['prefill_alone_mean_s'] * 1e3:.1f} ms" in text


def test_page_04_knobs_quotes_these_figures(e04: dict) -> None:
    page = "docs/experiments/04-knobs.md"
    lv = {k: v["project"] for k, v in e04["reservation_lecture_vs_project"].items()}
    assert table_row(page, "demo 1, long-context, max reservation at 8 req/s: occupied / holding tokens")[-1] == \
        f"{lv['max_occupied_frac_at_8']:.1%} / {lv['max_stored_frac_at_8']:.1%}"
    assert table_row(page, "demo 1: mean batch under max; first overloaded rate")[-1] == \
        f"{lv['max_mean_batch_at_8']:.1f}; {lv['max_first_rate_below_90pct_slo']} req/s"
    assert table_row(page, "demo 1: unlimited memory at 12 req/s")[-1] == f"{lv['unlimited_slo_attainment_at_12']:.1%}"
    mx = _row(e04["reservation_sweep"], reservation="max", rate_req_s=8)
    assert f"`stored_over_occupied` in the JSON: {mx['stored_over_occupied']:.3f} under max at 8 req/s" in page_text(page)
    long, short = (_row(e04["max_context_4096"], rate_req_s=32, max_context=c) for c in (8192, 4096))
    assert table_row(page, "exercise 3, max context 4096: rejected")[-1].startswith(
        f"{short['n_rejected']} of {short['n_rejected'] + short['n_requests']} ")
    cell = table_row(page, "exercise 3 at 32 req/s, 8192 → 4096: SLO, mean batch, tok/s")[-1]
    assert cell.startswith(f"{100 * long['slo_attainment']:.1f} → {short['slo_attainment']:.1%} of served "
                           f"({short['slo_attainment_submitted']:.1%} of submitted")
    assert cell.endswith(f", {long['mean_batch']:.0f} → {short['mean_batch']:.0f}, "
                         f"{long['throughput_tok_s']:,.0f} → {short['throughput_tok_s']:,.0f}")


def test_page_04_scheduling_quotes_these_figures(e04: dict) -> None:
    page = "docs/experiments/04-scheduling.md"
    o = e04["scheduling_order"]
    fcfs, spf, noisy = o["fcfs"], o["spf_oracle"], o["spf_sigma_1"]
    rows = {label: table_row(page, label)[-1] for label in (
        "demo 3, 40 req/s, max_bs 64: TTFT median FCFS → shortest-first (oracle)", "demo 3: SLO attainment",
        "demo 3: TTFT P99 / max get worse (starvation)", "demo 3: noisy predictor σ = 1 keeps most of the gain")}
    assert list(rows.values()) == [
        f"{fcfs['ttft_median_s']:.2f} s → {spf['ttft_median_s']:.2f} s",
        f"{fcfs['slo_attainment']:.0%} → {spf['slo_attainment']:.0%}",
        f"{fcfs['ttft_p99_s']:.1f} → {spf['ttft_p99_s']:.1f} s / {fcfs['ttft_max_s']:.1f} → {spf['ttft_max_s']:.1f} s",
        f"{noisy['ttft_median_s']:.2f} s, {noisy['slo_attainment']:.0%}"]


# The lecture's code 04 demos and exercises, and the row of seeds/README.md that says which command shows each.
LECTURE_MAP_ROWS = {"Lecture demo 3": "§6.3 FCFS vs shortest-first", "Lecture demo 4": "§6.4 prefill insertion",
                    "Exercise 3": "exercise 3 (max context 4096)", "Exercise 5": "exercise 5 (ordering needs a queue)",
                    "Exercise 9": "exercise 9 (chunked prefill)"}


@pytest.mark.parametrize("lecture, row", LECTURE_MAP_ROWS.items())
def test_the_lecture_map_gives_the_command_that_prints_each_code_04_demo(lecture: str, row: str) -> None:
    """seeds/README.md names the script and `--demos` number of each of code 04's demos and exercises;
    that command prints it first, and 04_scheduling (whose numbers are not the lecture's) heads its
    table with the same `--demos` number."""
    m = re.search(r"experiments/(04_\w+)\.py --demos (\d)", table_row("seeds/README.md", row)[-1])
    assert m, f"seeds/README.md, row {row!r}: no `experiments/04_....py --demos k`"
    script, k = m.groups()
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / f"{script}.py"), "--quick", "--demos", k],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first = next(line for line in proc.stdout.splitlines() if line.startswith("== "))
    assert first.startswith(f"== {lecture} (--demos {k}): " if script == "04_scheduling" else f"== {lecture}: "), first


@pytest.mark.parametrize("which, key, compared", [("04", "reservation_over_seeds", "reservation_lecture_vs_project"),
                                                  ("04s", "scheduling_order_over_seeds", None)])
def test_the_figures_set_beside_the_lecture_come_with_their_spread_over_seeds(which, key, compared) -> None:
    """--seeds N reruns demo 1's compared figures at seed..seed+N-1: the first value is the tables' own,
    the second what --seed 1 prints (the lecture's figures sit within that spread or they do not)."""
    two, one = (json.loads(_run(which, "--demos", "1", "--seeds", "2", *s)) for s in ((), ("--seed", "1")))
    over = two[key]
    assert over["seeds"] == [0, 1]
    for name, s in over["figures"].items():
        if compared:
            firsts = [two[compared][name]["project"], one[compared][name]["project"]]
        else:
            stat, order = name.split(", ")
            firsts = [two["scheduling_order"][order][stat], one["scheduling_order"][order][stat]]
        assert s["values"] == pytest.approx(firsts)
        assert s["min"] == min(firsts) and s["max"] == max(firsts) and s["median"] == pytest.approx(sum(firsts) / 2)
    assert one[key]["seeds"] == [1, 2] and len(over["figures"]) == (7 if compared else 6)


def test_code_03_cost_models_gives_its_compared_figures_with_their_spread_over_seeds() -> None:
    """03_cost_models' goodput and throughput move with the seed: --seeds N reruns them at seed..seed+N-1,
    the first values being the table's own, the second what --seed 1 prints; the table is unchanged."""
    two, one = (json.loads(_run("03c", *s)) for s in (("--seeds", "2"), ("--seed", "1")))
    assert set(two) == {"cost_models", "cost_models_over_seeds"} and one["cost_models_over_seeds"]["seeds"] == [1]
    over = two["cost_models_over_seeds"]
    assert over["seeds"] == [0, 1] and len(over["figures"]) == 4 * len(two["cost_models"])
    for key in two["cost_models"]:
        firsts = {}
        for out in (two, one):
            r, d = out["cost_models"][key]["roofline"], out["cost_models"][key]["refined"]
            for name, v in (("goodput_req_s, roofline", r["goodput_req_s"]),
                            ("goodput_req_s, refined", d["goodput_req_s"]),
                            ("goodput, refined vs roofline", d["goodput_req_s"] / r["goodput_req_s"] - 1),
                            ("throughput, refined vs roofline", d["throughput_tok_s"] / r["throughput_tok_s"] - 1)):
                firsts.setdefault(f"{key}: {name}", []).append(v)
        for name, v in firsts.items():
            s = over["figures"][name]
            assert s["values"] == pytest.approx(v)
            assert s["min"] == min(v) and s["max"] == max(v) and s["median"] == pytest.approx(sum(v) / 2)
    assert two["cost_models"]["orca_oracle"]["refined"]["throughput_tok_s"] != \
        one["cost_models"]["orca_oracle"]["refined"]["throughput_tok_s"]    # (the seeds do differ)


def _full_over_seeds(script: str, key: str) -> dict[str, dict]:
    """The figures over seeds 0-2 of `script`'s demo 1, full form (about a second each), as the pages quote them."""
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / f"{script}.py"), "--demos", "1", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    over = json.loads(proc.stdout)[key]
    assert over["seeds"] == [0, 1, 2]
    return over["figures"]


def _cells(f: dict, fmt: str, unit: str = "") -> list[str]:
    """A figure's median, range and per-seed cells as the pages' seeds tables write them."""
    lo, hi = (format(f[k], fmt) for k in ("min", "max"))
    return [f"{f['median']:{fmt}}{unit}", (lo if lo == hi else f"{lo}–{hi}") + unit,
            ", ".join(format(v, fmt) for v in f["values"]) + unit]


def test_page_04_scheduling_quotes_the_spread_over_seeds() -> None:
    """docs/experiments/04-scheduling.md's table over seeds 0-2 and the ratios after it are what
    `04_scheduling.py --demos 1` prints (--quick's default is one seed)."""
    page, f = "docs/experiments/04-scheduling.md", _full_over_seeds("04_scheduling", "scheduling_order_over_seeds")
    for label, stat, fmt, unit in (("TTFT median", "ttft_median_s", ".2f", " s"),
                                   ("TTFT max", "ttft_max_s", ".1f", " s")):
        fcfs, spf = (_cells(f[f"{stat}, {o}"], fmt, unit) for o in ("fcfs", "spf_oracle"))
        want = [f"{a} → {b}" for a, b in zip(fcfs, spf)]
        assert table_row(page, f"{label}, FCFS → shortest-first (oracle)") == want
    pct = {o: {k: (100 * v if k != "values" else [100 * x for x in v]) for k, v in f[f"slo_attainment, {o}"].items()}
           for o in ("fcfs", "spf_oracle")}
    assert table_row(page, "SLO attainment, FCFS → shortest-first (oracle)") == \
        [f"{a} → {b}" for a, b in zip(_cells(pct["fcfs"], ".1f", "%"), _cells(pct["spf_oracle"], ".1f", "%"))]
    cut = [a / b for a, b in zip(f["ttft_median_s, fcfs"]["values"], f["ttft_median_s, spf_oracle"]["values"])]
    gain = [b / a for a, b in zip(f["slo_attainment, fcfs"]["values"], f["slo_attainment, spf_oracle"]["values"])]
    assert (f"cuts the TTFT median {min(cut):.0f} to {max(cut):.0f} times, raises SLO attainment "
            f"{min(gain):.1f} to {max(gain):.1f} times") in page_text(page)


def test_page_04_knobs_quotes_the_spread_over_seeds() -> None:
    """docs/experiments/04-knobs.md's table over seeds 0-2 is what `04_knobs.py --demos 1` prints."""
    page, f = "docs/experiments/04-knobs.md", _full_over_seeds("04_knobs", "reservation_over_seeds")
    pct = {k: {s: (100 * v if s != "values" else [100 * x for x in v]) for s, v in f[k].items()}
           for k in ("max_occupied_frac_at_8", "max_stored_frac_at_8", "unlimited_slo_attainment_at_12")}
    occ, held = _cells(pct["max_occupied_frac_at_8"], ".1f", "%"), _cells(pct["max_stored_frac_at_8"], ".1f", "%")
    held[1] += " at each" if "–" not in held[1] else ""
    assert table_row(page, "max at 8 req/s: occupied / holding tokens") == [f"{a} / {b}" for a, b in zip(occ, held)]
    assert table_row(page, "max at 8 req/s: mean batch") == _cells(f["max_mean_batch_at_8"], ".1f")
    rates = [_cells(f[f"{r}_first_rate_below_90pct_slo"], ".0f") for r in ("max", "pow2", "oracle")]
    got = [" / ".join(c[i] for c in rates) for i in range(3)]
    assert table_row(page, "first rate below 90% SLO: max / pow2 / oracle") == [got[0] + " req/s", *got[1:]]
    assert table_row(page, "unlimited memory at 12 req/s: SLO attainment") == \
        _cells(pct["unlimited_slo_attainment_at_12"], ".1f", "%")


def _shown(cells: list[str]) -> list[float]:
    """The numbers a table row shows, in order (thousands separators dropped)."""
    return [float(n.replace(",", "")) for c in cells for n in re.findall(r"\d[\d,]*(?:\.\d+)?", c)]


def _rounds_to(shown: list[float], cells: list[str], values: list[float]) -> bool:
    """Each shown number is its value rounded to the digits the page gives it."""
    digits = [len(n.split(".")[1]) if "." in n else 0 for c in cells for n in re.findall(r"\d[\d,]*(?:\.\d+)?", c)]
    return len(shown) == len(values) and all(abs(s - v) <= 0.5 * 10 ** -d + 1e-9
                                             for s, v, d in zip(shown, values, digits))


def test_page_03_quotes_the_full_goodputs_and_the_spread_over_seeds(e03: dict) -> None:
    """docs/experiments/03-continuous-batching.md's goodputs, H100 counts and seeds-0-2 table are the full
    form's (`--demos 1,2`, a few seconds: goodput to 1% over 600 requests); the goodput --quick gives
    instead, which the page names, is the fixture's."""
    page = "docs/experiments/03-continuous-batching.md"
    proc = subprocess.run([sys.executable, str(SCRIPTS["03"]), "--demos", "1,2", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    full = json.loads(proc.stdout)
    systems = ("one_at_a_time", "static_b128", "orca_max", "orca_oracle")
    g, slo = full["goodput_over_seeds"], full["rate_sweep_over_seeds"]
    assert g["seeds"] == slo["seeds"] == [0, 1, 2]
    rows = {"goodput: one-at-a-time / static / Orca (max) / Orca (oracle), req/s":
            [full["goodput_req_s"][s] for s in systems],
            "H100s for 100 req/s (exercise 7): static / max / oracle":
            [full["h100s_for_100_req_s"][s] for s in systems[1:]]}
    for label, s in zip(("goodput, one-at-a-time (req/s)", "goodput, static B = 128 (req/s)",
                         "goodput, Orca (max 8192) (req/s)", "goodput, Orca (oracle) (req/s)"), systems):
        f = g["goodput_req_s"][s]
        rows[label] = [f["median"], f["min"], f["max"], f["values"][0]]
    for label, (a, b) in (("SLO attainment, Orca (max) at 24 / 32 req/s", ("orca_max_at_24", "orca_max_at_32")),
                          ("SLO attainment, Orca (oracle) at 32 / 48 req/s",
                           ("orca_oracle_at_32", "orca_oracle_at_48"))):
        fa, fb = (slo["slo_attainment"][k] for k in (a, b))
        rows[label] = [100 * v for v in (fa["median"], fb["median"], fa["min"], fa["max"], fb["min"], fb["max"],
                                         fa["values"][0], fb["values"][0])]
    for label, values in rows.items():
        cells = table_row(page, label)[-1:] if label.startswith(("goodput:", "H100s")) else table_row(page, label)
        assert _rounds_to(_shown(cells), cells, values), (label, cells, values)
    text = page_text(page)
    assert f"with {full['goodput_oracle_over_static']:.0f}× between static and Orca (oracle)" in text
    quick, whole = e03["goodput_req_s"]["orca_max"], full["goodput_req_s"]["orca_max"]
    assert f"(Orca (max): {quick:.1f} req/s, not {whole:.1f})" in text


def _printed_table(out: str, title: str) -> list[list[str]]:
    """The rows of the printed table under the heading that starts with `title`, cells split on runs of
    two or more blanks."""
    lines = out.split(f"\n== {title}", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("---")) + 1
    rows = []
    for line in lines[start:]:
        if not line.strip() or line.startswith(("==", "Lecture:")):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_exercise_3_prints_each_figure_beside_the_lecture_as_its_table_does() -> None:
    """One figure, one form: the lecture-beside-project table of `04_knobs.py`'s exercise 3 shows each of
    our figures as the exercise's table above it does (mean batch 30.2 in both, not 30.2 and 30.25)."""
    proc = subprocess.run([sys.executable, str(SCRIPTS["04"]), "--quick", "--demos", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    columns = {"tok/s": 3, "SLO % served": 4, "mean batch": 6, "occupied %": 7}
    table = {(r[0], r[1]): r for r in _printed_table(proc.stdout, "Exercise 3: Orca (max)")}
    compared = _printed_table(proc.stdout, "Exercise 3: the lecture's figures beside ours")
    assert len(compared) == len(table) * len(columns)
    for label, _lecture, shown in compared:
        rate, ctx, name = re.fullmatch(r"(\d+) req/s, max context (\d+): (.+)", label).groups()
        assert shown == table[rate, ctx][columns[name]], label
