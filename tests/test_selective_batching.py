"""Selective batching (§4.2): a batched step equals the same work done one request at a time, for
any mix of prefills, prompt chunks and decodes; FLOPs counted on the forward equal the shared
formula; and experiments/02's demos give the lecture's figures."""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from figure_files import assert_pngs
from test_docs import page_text, table_row
from orca_torch.model.accounting import (counted_flops, decode_op_counts, gathered_weight_bytes, padded_works,
    weight_matmul_bytes)
from orca_torch.core.batch import SeqWork, StepTotals, padded_shape
from orca_torch.model.orca_model import OrcaModel, generate_alone
from orca_torch.lab.report import Report

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "02_selective_batching.py"
DEMO1 = [SeqWork(37, 0), SeqWork(9, 0), SeqWork(1, 120), SeqWork(1, 15), SeqWork(1, 64)]


@pytest.fixture(scope="module")
def tiny() -> OrcaModel:
    return OrcaModel("tiny", seed=11)


@pytest.fixture(scope="module")
def mini() -> OrcaModel:
    return OrcaModel("mini", seed=0)


def _history_state(model: OrcaModel, chunks: list[list[int]], new: list[int], seed: int):
    """A K/V manager where request r has already run the prompt chunks `chunks[r]` (chunk k of
    every request batched in step k), room for `new[r]` more tokens, and the token ids of all of it.
    Deterministic: two calls give bit-identical states."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, model.spec.vocab, (sum(c) + n,), generator=g) for c, n in zip(chunks, new)]
    kv = model.new_kv(sum(t.numel() for t in tokens))
    for r, t in enumerate(tokens):
        kv.reserve(r, t.numel())
    done = [0] * len(chunks)
    for k in range(max((len(c) for c in chunks), default=0)):
        reqs = [r for r, c in enumerate(chunks) if k < len(c)]
        if not reqs:
            continue
        ids = torch.cat([tokens[r][done[r]:done[r] + chunks[r][k]] for r in reqs])
        model.forward_batch(ids, [SeqWork(chunks[r][k], done[r]) for r in reqs], reqs, kv)
        for r in reqs:
            done[r] += chunks[r][k]
    return kv, tokens, done


def _batched_vs_one_by_one(model: OrcaModel, chunks, new, seed):
    kv_b, tokens, past = _history_state(model, chunks, new, seed)
    kv_s, _, _ = _history_state(model, chunks, new, seed)
    works = [SeqWork(n, p) for n, p in zip(new, past)]
    ids = torch.cat([t[p:] for t, p in zip(tokens, past)])
    reqs = list(range(len(works)))
    flops_b, batched = counted_flops(model, ids, works, reqs, kv_b)
    single = torch.cat([model.forward_batch(t[p:], [w], [r], kv_s)
                        for r, (t, p, w) in enumerate(zip(tokens, past, works))])
    return works, tokens, flops_b, batched, single, kv_b, kv_s


def test_demo1_counts_are_the_lectures():
    t = StepTotals.of(DEMO1)
    B, L, K = padded_shape(DEMO1)
    assert (t.n_tokens, B * L) == (49, 185)
    assert round(1 - t.n_tokens / (B * L), 2) == 0.74
    assert (t.attn_pairs_causal, B * L * K) == (950, 22_385)
    assert round(B * L * K / t.attn_pairs_causal, 1) == 23.6


def test_step_totals_add_field_by_field():
    # 2 new on 3 stored: 5 keys read, 2 x 5 = 10 pairs, 2 x 3 + 3 = 9 kept by the mask;
    # 3 new on 4 stored: 7 keys read, 3 x 7 = 21 pairs, 3 x 4 + 6 = 18 kept.
    a, b = StepTotals.of([SeqWork(2, 3)]), StepTotals.of([SeqWork(3, 4)])
    assert a + b == StepTotals(2, 5, 12, 31, 27) == StepTotals.of([SeqWork(2, 3), SeqWork(3, 4)])


def test_demo1_step_batched_equals_one_by_one_on_mini(mini):
    works, _, flops, batched, single, kv_b, kv_s = _batched_vs_one_by_one(
        mini, [[w.n_past] if w.n_past else [] for w in DEMO1], [w.n_new for w in DEMO1], seed=2)
    assert works == DEMO1
    assert float((batched - single).abs().max()) < 1e-5
    assert torch.equal(batched.argmax(-1), single.argmax(-1))
    for r, w in enumerate(DEMO1):
        assert kv_b.length(r) == kv_s.length(r) == w.n_ctx
        assert float((kv_b.storage(r) - kv_s.storage(r)).abs().max()) < 1e-5
    formula = mini.spec.step_flops(DEMO1)
    assert {k: flops[k] for k in formula} == formula          # linear, attention, LM head, total
    assert flops["other"] == 0


def test_padded_path_counts_the_padded_formula_on_mini(mini):
    kv, tokens, past = _history_state(mini, [[w.n_past] if w.n_past else [] for w in DEMO1],
                                      [w.n_new for w in DEMO1], seed=2)
    ids = torch.cat([t[p:] for t, p in zip(tokens, past)])
    flops, _ = counted_flops(mini, ids, DEMO1, list(range(5)), kv, padded=True)
    formula = mini.spec.step_flops(padded_works(DEMO1))
    assert {k: flops[k] for k in formula} == formula
    assert formula["attention"] == 4 * mini.spec.n_layers * mini.spec.n_heads * mini.spec.head_dim * 22_385


request = st.tuples(st.lists(st.integers(1, 12), min_size=0, max_size=3),   # earlier prompt chunks
                    st.one_of(st.just(1), st.integers(1, 10)))               # this step's new tokens


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_random_mixes_batched_equals_one_by_one_and_full_recompute(tiny, reqs, seed):
    chunks, new = [c for c, _ in reqs], [n for _, n in reqs]
    works, tokens, flops, batched, single, _, _ = _batched_vs_one_by_one(tiny, chunks, new, seed)
    assert float((batched - single).abs().max()) < 1e-5
    assert torch.equal(batched.argmax(-1), single.argmax(-1))
    formula = tiny.spec.step_flops(works)
    assert {k: flops[k] for k in formula} == formula
    for r, t in enumerate(tokens):       # chunked + cached == one prefill of the whole sequence
        kv = tiny.new_kv(t.numel())
        kv.reserve(0, t.numel())
        full = tiny.forward_batch(t, [SeqWork(t.numel(), 0)], [0], kv)[0]
        assert float((batched[r] - full).abs().max()) < 1e-4


def test_one_by_one_flops_sum_to_the_batched_flops(tiny):
    chunks, new = [[], [5, 3], [20], [4]], [6, 2, 1, 1]
    kv, tokens, past = _history_state(tiny, chunks, new, seed=4)
    works = [SeqWork(n, p) for n, p in zip(new, past)]
    total = {"linear": 0, "attention": 0, "lm_head": 0, "total": 0}
    for r, (t, p, w) in enumerate(zip(tokens, past, works)):
        f, _ = counted_flops(tiny, t[p:], [w], [r], kv)
        total = {k: total[k] + f[k] for k in total}
    assert total == tiny.spec.step_flops(works)
    spec = tiny.spec
    assert sum(spec.step_bytes([w])["weights"] for w in works) == len(works) * spec.step_bytes(works)["weights"]
    assert gathered_weight_bytes(spec, works) < spec.weight_bytes


def test_gathered_weight_bytes_by_hand_and_a_tied_head_reads_the_whole_table():
    """tiny: 106,816 parameters, 256 x 64 of them the embedding. A step of 7 tokens looks up 7 rows of
    it; with the LM head tied to the table the head reads all 256 rows, so nothing is saved."""
    from dataclasses import replace
    spec = OrcaModel("tiny").spec
    works = [SeqWork(3, 0), SeqWork(1, 5), SeqWork(1, 2), SeqWork(2, 4)]
    assert gathered_weight_bytes(spec, works) == (106_816 - 256 * 64 + 7 * 64) * 4
    tied = replace(spec, tied_embeddings=True)
    assert tied.n_params == 106_816 - 256 * 64
    assert gathered_weight_bytes(tied, works) == tied.weight_bytes == (106_816 - 256 * 64) * 4


def test_long_greedy_generation_continuous_batched_equals_alone(tiny):
    """Iteration-level scheduling on the real model: requests arrive at different steps, prompts
    are prefilled in chunks of at most 8 tokens alongside other requests' decodes, and every
    request's tokens equal `generate_alone`'s, token for token."""
    g = torch.Generator().manual_seed(9)
    specs = [(0, 3, 48), (0, 29, 40), (2, 17, 56), (5, 1, 33), (9, 12, 45)]   # (arrival step, prompt, n_new)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for _, n, _ in specs]
    kv = tiny.new_kv(sum(p + n for _, p, n in specs))
    fed = [0] * len(specs)              # tokens whose K/V is stored
    out: list[list[int]] = [[] for _ in specs]
    step = 0
    while any(len(o) < n for o, (_, _, n) in zip(out, specs)):
        works, ids, reqs = [], [], []
        for r, ((arrive, plen, n_new), prompt) in enumerate(zip(specs, prompts)):
            if step < arrive or len(out[r]) >= n_new:
                continue
            if not kv.has(r):
                kv.reserve(r, plen + n_new - 1)
            if fed[r] < plen:
                chunk = prompt[fed[r]:fed[r] + 8]
            else:
                chunk = [out[r][-1]]
            works.append(SeqWork(len(chunk), fed[r]))
            ids += chunk
            reqs.append(r)
        logits = tiny.forward_batch(torch.tensor(ids), works, reqs, kv)
        for r, w, row in zip(reqs, works, logits):
            fed[r] += w.n_new
            if fed[r] >= len(prompts[r]):          # the prompt is done: this row is a real next token
                out[r].append(int(row.argmax()))
                if len(out[r]) == specs[r][2]:
                    kv.free(r)
        step += 1
    assert kv.slots_reserved == 0 and kv.n_requests == 0
    for r, (prompt, (_, _, n_new)) in enumerate(zip(prompts, specs)):
        assert out[r] == generate_alone(tiny, prompt, n_new)


# ---- experiments/02_selective_batching.py ---------------------------------------------------------
def load_02():
    """A fresh copy of the script's module, for a test to replace what it calls."""
    spec = importlib.util.spec_from_file_location("exp02", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def plot_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("plots02")


@pytest.fixture(scope="module")
def quick_json(plot_dir) -> dict:
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", "--plot", str(plot_dir)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_script_plots_the_demo4_timelines(quick_json, plot_dir):
    assert_pngs(plot_dir, ["02_timelines"])


def test_script_demo1_figures(quick_json):
    d = quick_json["demo1"]
    assert (d["useful_tokens"], d["padded_tokens"]) == (49, 185)
    assert (d["useful_attention_pairs"], d["padded_attention_pairs"]) == (950, 22_385)
    assert d["selective_attention_pairs"] == 37 * 37 + 9 * 9 + 121 + 16 + 65
    for kind in ("selective", "padded"):
        counted, formula = d[f"flops_{kind}_counted"], d[f"flops_{kind}_formula"]
        assert {k: counted[k] for k in formula} == formula
    assert d["flops_padded_counted"]["total"] > 3 * d["flops_selective_counted"]["total"]
    assert d["padded_vs_selective_max_abs_logit_diff"] < 1e-5


def test_script_prints_the_token_waste_as_the_lecture_gives_it(capsys):
    """The lecture gives the token waste as 0.74 (74%, to a whole percent) and the project's is the
    same 1 - 49/185: the table prints it in the lecture's form beside it, with its tenth of a
    percent, so that the two columns read as the one figure they are."""
    mod = load_02()
    mod.demo1(argparse.Namespace(seed=0), Report())
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tokens: waste"))
    lecture, project = row.split()[2:4]
    assert project == lecture == f"{1 - 49 / 185:.2f}"
    assert row.split()[4] == f"({1 - 49 / 185:.1%})"


def test_script_demo2_figures(quick_json):
    d = quick_json["demo2"]
    assert d["max_abs_logit_diff"] < 1e-5 and d["same_greedy_tokens"] is True
    assert d["flops_batched"] == d["flops_one_by_one"]
    assert d["kv_bytes_batched"] == d["kv_bytes_one_by_one"]
    assert d["weight_bytes_one_by_one"] == d["n_requests"] * d["weight_bytes_batched"]
    assert d["weight_bytes_ratio"] == d["n_requests"] == 5
    assert 4.9 < d["weight_bytes_ratio_gathered_embedding"] < 5


def test_the_page_quotes_these_figures(quick_json):
    """docs/experiments/02-selective-batching.md's figures that no clock or BLAS moves: demos 1, 2
    (its weight bytes) and 4 are the same in `--quick` and the full form."""
    page = "docs/experiments/02-selective-batching.md"
    d1, d2, d4 = quick_json["demo1"], quick_json["demo2"], quick_json["demo4"]
    assert table_row(page, "1: §3.2's step, useful vs padded tokens")[-1].startswith(
        f"{d1['useful_tokens']} vs {d1['padded_tokens']}, waste {d1['token_waste_fraction']:.1%} (the same "
        f"1 − {d1['useful_tokens']}/{d1['padded_tokens']},")
    assert table_row(page, "1 / exercise 4: useful vs padded attention pairs")[-1] == (
        f"{d1['useful_attention_pairs']:,} vs {d1['padded_attention_pairs']:,} "
        f"({d1['padded_over_useful_pairs']:.1f}×)")
    assert table_row(page, "2: weight bytes, one by one / batched")[-1] == f"{d2['weight_bytes_ratio']:.2f}×"
    assert table_row(page, "4: continuous vs static batching, 6 requests, max_bs 3")[-1].startswith(
        f"{d4['continuous_iterations']} vs {d4['static_iterations']},")
    text = page_text(page)
    assert f"computes {d1['selective_attention_pairs']:,} attention pairs" in text
    assert f"gives {d2['weight_bytes_ratio_gathered_embedding']:.3f}×" in text


def test_the_page_quotes_demo3s_counts(mini):
    """The page's demo-3 figures that no clock moves, for the full run's 64 requests: the model's size,
    the bytes one forward's weight matmuls stream, and the torch ops each side dispatches."""
    ops_batched, ops_alone = decode_op_counts(mini, 64, 0)
    text = page_text("docs/experiments/02-selective-batching.md")
    assert f"`mini` torch model ({mini.spec.n_params / 1e6:.1f}M parameters, fp32)" in text
    assert f"one by one streams 64 × {weight_matmul_bytes(mini) / 1e6:.1f} MB of weight matrices" in text
    assert f"one by one dispatches {ops_alone:,} ops against batched's {ops_batched:,}" in text


def test_script_demo3_reports_its_measurements(quick_json):
    d = quick_json["demo3"]
    assert d["n_requests"] == 32 and d["repeats"] == 3 and d["threads"] == 1
    assert d["one_by_one_ms"] > 0 and d["batched_ms"] > 0
    assert d["speedup"] == pytest.approx(d["one_by_one_ms"] / d["batched_ms"])
    assert d["aten_ops_one_by_one"] > d["aten_ops_batched"] > 0
    assert d["lecture_speedup"] == 4.5
    assert d["lecture_n_requests"] == 64     # --quick times 32: the lecture's 37 / 8.2 ms are for 64


def test_demo3_says_how_many_requests_the_lectures_figures_are_for(capsys):
    """--quick times 32 requests; the lecture's figures beside them are for 64 and the title says so."""
    mod = load_02()
    mod.decode_step_times = lambda model, n_requests, repeats, seed: {"batched_s": 0.02, "one_by_one_s": 0.1,
                                                                      "speedup": 5.0}
    mod.weight_matmul_time = lambda model, n, repeats: 0.001
    mod.main(["--quick", "--demos", "3"])
    title = capsys.readouterr().out.split("\n== ")[1].splitlines()[0]
    assert "one decode step, 32 requests" in title and "the lecture (64 requests, Apple M4 Pro" in title


def test_bench_decode_batching_says_which_side_its_ratio_divides_by_which(monkeypatch, capsys):
    import runpy
    import sys
    from pathlib import Path

    import orca_torch.model.accounting as accounting

    monkeypatch.setattr(accounting, "decode_step_times", lambda model, n_requests, repeats, seed: {
        "batched_s": 0.02, "one_by_one_s": 0.1, "speedup": 5.0})
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_decode_batching.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--model", "tiny", "--requests", "2", "--repeats", "1"])
    runpy.run_path(str(script), run_name="__main__")
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        "one_by_one=100.0 ms batched=20.0 ms one_by_one/batched=5.00")


def test_demo3_takes_the_bandwidth_over_the_bytes_its_matmuls_stream(mini):
    """The one-by-one weight matmuls are timed on the layers' matrices and the LM head; the untied
    embedding table (a gather, one row per token) and the norms are no part of them."""
    mod = load_02()
    mod.decode_step_times = lambda model, n_requests, repeats, seed: {"batched_s": 0.02, "one_by_one_s": 0.1,
                                                                      "speedup": 5.0}
    mod.weight_matmul_time = lambda model, n, repeats: 1e-3
    d = mod.main(["--quick", "--json", "--demos", "3"])["demo3"]
    streamed = sum(p.numel() * p.element_size() for name, p in mini.named_parameters()
                   if p.dim() == 2 and name != "embed")
    assert not mini.spec.tied_embeddings and streamed < mini.spec.weight_bytes
    assert d["one_by_one_weight_bandwidth_gb_s"] == pytest.approx(streamed / 1e-3 / 1e9)


def test_script_demo4_timelines(quick_json):
    d = quick_json["demo4"]
    assert (d["continuous_iterations"], d["static_iterations"]) == (10, 18)
    assert d["tokens_match_alone"] and d["static_tokens_match_alone"]
    assert d["continuous_rows"][3] == "  \u00b7PD     "
    assert d["static_rows"][5] == "      " + "\u00b7" * 9 + "PDD"


def test_script_is_deterministic_and_has_a_demo_registry():
    mod = load_02()
    assert [d.__name__ for d in mod.DEMOS] == ["demo1", "demo2", "demo3", "demo4"]
    a = mod.main(["--quick", "--json", "--demos", "1,2", "--seed", "3"])
    b = mod.main(["--quick", "--json", "--demos", "1,2", "--seed", "3"])
    assert {k.split("_")[0] for k in a} == {"demo1", "demo2"} and json.dumps(a) == json.dumps(b)
    with pytest.raises(SystemExit):
        mod.main(["--demos", "9"])


def test_demo3_leaves_out_a_split_the_shared_machine_spoiled(capsys):
    """The weight matmuls are timed apart from the step: where they outlast it (the machine slowed in
    between), the table says n/a instead of a negative rest."""
    mod = load_02()
    mod.weight_matmul_time = lambda model, n, repeats: 10.0        # seconds: longer than any step
    mod.main(["--quick", "--demos", "3"])
    out = capsys.readouterr().out
    assert "n/a" in out and "the split is left out (rerun on a quiet machine)" in out and "(-" not in out
