"""The refined cost model beside the roofline: shape, monotonicity, FLOPs, tiles, profiles, capacity conventions."""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.sim.hw_model import (GPUS, GPUSpec, RefinedParams, decode_totals, get_gpu,
    kv_capacity_tokens, load_profile, max_requests, pricer, save_profile, step_cost)
from orca_torch.specs import get_model_spec
from test_docs import table_row

ROOT = Path(__file__).resolve().parents[1]
LLAMA = get_model_spec("llama-3-8b")
CARDS = sorted(GPUS)


def refined(model="llama-3-8b", gpu="a100-80gb", **kw):
    return pricer(model, gpu, cost_model="refined", **kw)


def prefill(n: int, past: int = 0) -> StepTotals:
    return StepTotals.of([SeqWork(n, past)])


# ---- the roofline stays the default, unchanged --------------------------------------------------------

def test_roofline_is_the_default_and_keeps_the_lecture_anchors():
    assert pricer("llama-3-8b", "h100") is pricer("llama-3-8b", "h100", cost_model="roofline")
    t = pricer("llama-3-8b", "h100").time(decode_totals(1, 2))
    assert round(t * 1e3, 2) == 5.99
    c = step_cost("llama-3-8b", "h100", decode_totals(1, 2))
    assert c.cost_model == "roofline" and c.breakdown == {}


# ---- shape of the refined model -----------------------------------------------------------------------

@pytest.mark.parametrize("gpu", CARDS)
def test_refined_is_monotone_in_batch_prompt_and_context(gpu):
    pr = refined(gpu=gpu)
    for ctx in (2, 512, 1400, 8192):
        times = [pr.time(decode_totals(b, ctx)) for b in range(1, 300)]
        assert all(b > a for a, b in zip(times, times[1:])), ctx
    for b in (1, 16, 128):
        times = [pr.time(decode_totals(b, c)) for c in range(2, 8193, 97)]
        assert all(y > x for x, y in zip(times, times[1:])), b
    times = [pr.time(prefill(n)) for n in range(1, 8193, 37)]
    assert all(y > x for x, y in zip(times, times[1:]))
    chunks = [pr.time(prefill(n, 1000)) for n in range(1, 4000, 53)]
    assert all(y > x for x, y in zip(chunks, chunks[1:]))


@pytest.mark.parametrize("gpu", CARDS)
@pytest.mark.parametrize("ctx", [128, 1400, 4096])
def test_refined_decode_time_per_sequence_falls_with_batch(gpu, ctx):
    pr = refined(gpu=gpu)
    per_seq = [pr.time(decode_totals(b, ctx)) / b for b in range(1, 513)]
    assert all(y < x for x, y in zip(per_seq, per_seq[1:]))


steps_st = st.lists(st.builds(SeqWork, st.integers(1, 1024), st.integers(0, 2047)), min_size=1, max_size=64).filter(
    lambda ws: sum(w.n_new for w in ws) <= 4096)


@settings(max_examples=60, deadline=None)
@given(works=steps_st, model=st.sampled_from(["llama-3-8b", "gpt3-13b", "opt-13b"]),
       gpu=st.sampled_from(CARDS), tp=st.sampled_from([1, 2, 8]))
def test_refined_is_never_faster_than_the_roofline(works, model, gpu, tp):
    """For steps of up to 4,096 new tokens (a serving step's token budget); see docs/paper-gpu.md for longer ones."""
    t = StepTotals.of(works)
    assert refined(model, gpu, tp=tp).time(t) >= pricer(model, gpu, tp=tp).time(t)


def test_at_the_profiled_steps_the_refined_model_charges_more_most_near_the_ridge():
    """At context 1,400 the roofline is optimistic; the refined model charges more, most in the middle."""
    ro, re = pricer("llama-3-8b", "a100-80gb"), refined()
    dev = [ro.time(decode_totals(b, 1400)) / re.time(decode_totals(b, 1400)) - 1 for b in (1, 16, 64, 128)]
    assert all(d < 0 for d in dev)
    assert dev[0] > dev[1] > dev[2] > dev[3]            # the gap widens toward the ridge point
    assert ro.time(prefill(1155)) < re.time(prefill(1155))
    assert re.time(prefill(4096)) == pytest.approx(ro.time(prefill(4096)), rel=0.03)


def test_elementwise_embedding_and_overhead_are_charged_as_documented():
    pr = refined()
    c = pr.cost(decode_totals(64, 1400))
    assert 0.7e-3 < c.breakdown["elementwise_s"] < 1.1e-3       # ~0.9 ms at a serving batch on the A100
    assert c.breakdown["overhead_s"] == pr.params.launch_overhead_s == 20e-6
    assert sum(c.breakdown.values()) == pytest.approx(c.time_s, rel=1e-12)
    table = LLAMA.vocab * LLAMA.hidden * LLAMA.dtype_bytes
    assert c.bytes["weights"] == LLAMA.weight_bytes - table + 64 * LLAMA.hidden * LLAMA.dtype_bytes
    # the kernel floor is charged per kernel: 7 per block + the gather + the final norm
    no_floor = refined(gpu=dataclasses.replace(get_gpu("a100-80gb"), refined=dataclasses.replace(
        get_gpu("a100-80gb").refined, kernel_floor_s=0.0)))
    assert pr.time(decode_totals(1, 100)) - no_floor.time(decode_totals(1, 100)) == pytest.approx(
        (7 * 32 + 2) * 3e-6, rel=1e-9)
    assert pricer("llama-3-8b", "a100-80gb", cost_model="refined", overhead_s=0.0).time(
        decode_totals(1, 100)) == pytest.approx(pr.time(decode_totals(1, 100)) - 20e-6, rel=1e-12)


def test_refined_attention_of_a_long_prompt_is_its_flops_over_the_tp_devices():
    """GPT-3 101B at TP 8 (80 layers, hidden 10,240): a 2,048-token prompt's full score rectangle is
    4 h FLOPs a pair a layer, computed by 8 devices at the card's attention efficiency; its K/V read
    (well under a millisecond) does not bind."""
    a100 = get_gpu("a100-40gb")
    c = refined("gpt3-101b", "a100-40gb", tp=8, attention="full").cost([SeqWork(2048)])
    flops = 4 * 80 * 10240 * 2048 * 2048
    assert c.breakdown["attention_s"] == pytest.approx(
        flops / 8 / (312e12 * a100.refined.attention_flop_efficiency), rel=1e-12)


def test_time_equals_cost_and_breakdown_sums_over_the_pipeline():
    pr = refined("gpt3-175b", "a100-40gb", tp=8, pp=2)
    works = [SeqWork(1, 37), SeqWork(16, 8), SeqWork(400), SeqWork(1, 1200)]
    c = pr.cost(works)
    assert c.time_s == pr.time(StepTotals.of(works))
    assert c.cost_model == "refined"
    assert sum(c.breakdown.values()) == pytest.approx(c.time_s, rel=1e-12)
    assert c.breakdown["comm_s"] == pytest.approx(
        pricer("gpt3-175b", "a100-40gb", tp=8, pp=2).cost(works).comm_s, rel=1e-12)
    assert c.stage_s < c.time_s


@pytest.mark.parametrize("tp", [2, 4])
def test_the_lm_head_is_split_over_the_tp_devices(tp):
    """Each tp device multiplies its vocab / tp columns of the LM head: what one more request adds to
    a step's GEMMs (the head's rows; the layers' depend on the tokens alone) equals the same at tp = 1
    on a model whose vocabulary is that shard."""
    shard = dataclasses.replace(LLAMA, vocab=LLAMA.vocab // tp)

    def head_of_one_more_request(pr):      # seven tokens in two requests against seven in one
        return (pr.cost([SeqWork(6, 40), SeqWork(1, 90)]).breakdown["gemm_s"]
                - pr.cost([SeqWork(7, 40)]).breakdown["gemm_s"])
    assert LLAMA.vocab % tp == 0
    assert head_of_one_more_request(refined(LLAMA, "h100", tp=tp)) == pytest.approx(
        head_of_one_more_request(refined(shard, "h100")), rel=1e-9)


@pytest.mark.parametrize("kw", [{}, {"attention": "full"}, {"attention": "causal"}, {"tp": 8, "pp": 2},
                                {"seq_overhead_s": 1e-4}])
def test_decode_run_times_equal_step_by_step_time_exactly(kw):
    model = "gpt3-175b" if kw.get("tp") else "llama-3-8b"
    pr = refined(model, "h100", **kw)
    for k, ctx, m in ((1, 5, 3), (7, 700, 11), (64, 64 * 300, 12), (200, 200 * 1500, 40), (3, 30, 500)):
        run = pr.decode_run_times(k, ctx, m)
        steps = [pr.time(StepTotals(k, k, ctx + k * (j + 1), ctx + k * (j + 1), ctx + k * (j + 1)))
                 for j in range(m)]
        assert run.tolist() == steps
    assert pr.decode_run_times(0, 0, 4).tolist() == [0.0] * 4


# ---- FLOPs: the refined GEMM shapes are the torch model's matmuls; attention by tiles ----------------------

def test_refined_matmul_flops_equal_flop_counter_on_the_torch_model():
    import torch

    from orca_torch.model.accounting import counted_flops
    from orca_torch.model.kv_cache import KVManager
    from orca_torch.model.orca_model import OrcaModel

    spec = get_model_spec("mini")
    model = OrcaModel(spec, seed=0)
    kv = KVManager(spec, n_slots=512)
    for rid in "abc":
        kv.reserve(rid, 64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.forward_batch(torch.randint(0, spec.vocab, (14,), generator=g), [SeqWork(5), SeqWork(9)], ["a", "b"], kv)
        works = [SeqWork(1, 5), SeqWork(7, 9), SeqWork(12, 0)]
        ids = torch.randint(0, spec.vocab, (20,), generator=g)
        counted, _ = counted_flops(model, ids, works, ["a", "b", "c"], kv)
    c = pricer(spec, "h100", cost_model="refined").cost(works)
    assert c.flops["linear"] == counted["linear"] > 0
    assert c.flops["lm_head"] == counted["lm_head"] > 0
    t = StepTotals.of(works)
    per_pair = 4 * spec.n_layers * spec.n_heads * spec.head_dim
    assert counted["attention"] == per_pair * t.attn_pairs_full               # the torch model: full rectangle
    assert per_pair * t.attn_pairs_causal <= c.flops["attention"] <= counted["attention"]


def _tile_pairs_by_mask(w: SeqWork, tile: int) -> int:
    """Brute force: build the causal mask, cut it in tiles, count the pairs of every tile not fully masked."""
    q = np.arange(w.n_new)[:, None] + w.n_past
    k = np.arange(w.n_ctx)[None, :]
    keep = k <= q
    total = 0
    for r0 in range(0, w.n_new, tile):
        for c0 in range(0, w.n_ctx, tile):
            blk = keep[r0:r0 + tile, c0:c0 + tile]
            if blk.any():
                total += blk.size
    return total


@settings(max_examples=80, deadline=None)
@given(n_new=st.integers(1, 160), n_past=st.integers(0, 200), tile=st.sampled_from([1, 7, 16, 64, 128]))
def test_the_tile_estimate_stays_near_the_tiles_the_mask_leaves(n_new, n_past, tile):
    w = SeqWork(n_new, n_past)
    exact = _tile_pairs_by_mask(w, tile)
    t = StepTotals.of([w])
    assert t.attn_pairs_causal <= exact <= t.attn_pairs_full
    est = refined(attention_tile=tile)._pairs(t)                   # what the totals-only price charges
    assert t.attn_pairs_causal <= est <= t.attn_pairs_full
    assert abs(est - exact) <= n_new * 2 * (tile - 1)           # a block runs to its last row, padded to a tile
    if n_past == 0 and (n_new % tile == 0 or n_new <= tile):
        assert est == exact


def test_tile_estimate_is_exact_for_decodes_and_aligned_prompts():
    pr = refined()
    for works in ([SeqWork(1, 99)] * 5, [SeqWork(128)], [SeqWork(4096)], [SeqWork(100)], [SeqWork(256), SeqWork(1, 9)]):
        exact = sum(_tile_pairs_by_mask(w, 128) for w in works)
        est = pr._pairs(StepTotals.of(works))
        assert est == exact or (len(works) > 1 and est - exact == 63.5)   # a decode beside a prompt: +63.5


def test_a_tile_past_every_sequence_prices_as_full_attention_however_large():
    """A tile of 10**400 tokens is one longer than any sequence: it prices, as one of the model's
    context does (building its pricer overflowed a float)."""
    works = [SeqWork(300, 40), SeqWork(1, 99)]
    huge, ctx = refined(attention_tile=10**400), refined(attention_tile=LLAMA.max_context)
    assert huge.tile == 10**400 and huge._pairs(StepTotals.of(works)) == StepTotals.of(works).attn_pairs_full
    assert huge.time(StepTotals.of(works)) == ctx.time(StepTotals.of(works))


@pytest.mark.parametrize("n", [1, 100, 1155, 4096])
def test_causal_tiles_attention_flops_lie_between_causal_and_full(n):
    for works in ([SeqWork(n)], [SeqWork(n, 700)], [SeqWork(1, n)] * 8 + [SeqWork(n)]):
        t = StepTotals.of(works)
        per_pair = 4 * LLAMA.n_layers * LLAMA.n_heads * LLAMA.head_dim
        f = refined().cost(works).flops["attention"]
        assert per_pair * t.attn_pairs_causal <= f <= per_pair * t.attn_pairs_full
    if n > 128:  # a long prompt skips most masked tiles
        t = prefill(n)
        assert refined().cost([SeqWork(n)]).flops["attention_pairs"] < 0.6 * t.attn_pairs_full


# ---- profiles ---------------------------------------------------------------------------------------------

def test_profile_json_round_trip_and_pricer_by_path(tmp_path):
    g = dataclasses.replace(get_gpu("a100-80gb"), name="a100-measured", refined=dataclasses.replace(
        get_gpu("a100-80gb").refined, gemm_flop_ceiling=0.61, launch_overhead_s=1e-4, attention_tile=64))
    path = save_profile(g, tmp_path / "a100.json", notes={"fitted": ["gemm_flop_ceiling"]})
    d = json.loads(path.read_text())
    assert d["format"] == "orca-torch-gpu-profile" and d["refined"]["attention_tile"] == 64
    back = load_profile(path)
    assert back == g and back.refined == g.refined
    t = decode_totals(32, 1400)
    assert pricer("llama-3-8b", str(path), cost_model="refined").time(t) == refined(gpu=g).time(t)
    assert pricer("llama-3-8b", path, cost_model="roofline").time(t) == pricer("llama-3-8b", "a100-80gb").time(t)
    assert get_gpu(str(path)) == g


@pytest.mark.parametrize("name, priced", [("eager", 0.09736), ("fused", 0.02335)])
def test_the_recorded_h200_profiles_load_and_price_their_held_out_decode(name, priced):
    """The profiles fitted on an H200 (benchmarks/h200/) still load: the split path's priced the
    held-out decode of 32 at context 1,400 at 97.4 ms, measured at 101.0 ms (gpu_profile.txt beside
    it); the fused path's at 23.4 ms, measured at 27.0 ms (gpu_profile_fused.txt)."""
    path = ROOT / "benchmarks" / "h200" / f"llama-3-8b-torch-{name}-profile.json"
    assert load_profile(path).name == "h200-refined"
    t = pricer("llama-3-8b", path, cost_model="refined").time(decode_totals(32, 1400))
    assert t == pytest.approx(priced, rel=1e-3)


def _defined_at(dotted: str) -> str:
    """Where the object `dotted` names is defined (module.qualname), found by importing its longest
    module prefix: a name that a module only imports from elsewhere is not where it lives."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj.__name__ if cut == len(parts) else f"{obj.__module__}.{obj.__qualname__}"
    raise AssertionError(f"{dotted} names no module")


def test_the_committed_profiles_name_their_fit_where_the_fit_lives():
    """A committed GPU profile's source names the function that fitted it; the name stays true after the
    code moves: it imports and is where that function is defined (as the fit writes it now)."""
    files = (json.loads(p.read_text()) for p in ROOT.joinpath("benchmarks").rglob("*.json"))
    sources = [d["gpu"]["source"] for d in files if d.get("format") == "orca-torch-gpu-profile"]
    named = [dotted for source in sources for dotted in re.findall(r"\borca_torch(?:\.\w+)+", source)]
    assert named
    for dotted in named:
        assert _defined_at(dotted) == dotted


def test_bad_profiles_are_refused_clearly(tmp_path):
    good = json.loads(save_profile(get_gpu("h100"), tmp_path / "h.json").read_text())
    cases = [({"format": "x"}, "not an orca-torch GPU profile"),
             ({**good, "version": 9}, "version 9 is not supported"),
             ({**good, "gpu": {**good["gpu"], "speed": 1}}, "unknown: 'speed', missing: none\\)"),
             ({**good, "refined": {**good["refined"], "gemm_flop_ceiling": 1.5}}, r"gemm_flop_ceiling must be a finite number in \(0, 1\]"),
             ({**good, "refined": {**good["refined"], "warp": 1}}, "unknown refined parameter"),
             ({**good, "gpu": {**good["gpu"], "peak_flops": -1}}, r"peak_flops must be a finite number > 0")]
    for i, (d, match) in enumerate(cases):
        p = tmp_path / f"bad{i}.json"
        p.write_text(json.dumps(d))
        with pytest.raises(ValueError, match=match):
            load_profile(p)
    with pytest.raises(ValueError, match="no GPU profile at"):
        get_gpu(str(tmp_path / "missing.json"))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the GPU profile"):
        load_profile(tmp_path / "junk.json")
    with pytest.raises(ValueError, match="a GPU profile is a .json file"):
        save_profile(get_gpu("h100"), tmp_path / "h.txt")


# ---- bad parameters ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: pricer("llama-3-8b", "h100", cost_model="exact"), "unknown cost_model 'exact'; known: roofline, refined"),
    (lambda: refined(flop_efficiency=0.5), "flop_efficiency is a roofline setting"),
    (lambda: refined(count_activations=True), "count_activations is a roofline setting"),
    (lambda: pricer("llama-3-8b", "h100", attention_tile=64), "attention_tile belongs to the refined model"),
    (lambda: pricer("llama-3-8b", "h100", attention="causal-tiles"),
     "attention 'causal-tiles' needs the refined cost model; the roofline counts attention as 'full' or 'causal'"),
    (lambda: refined(attention="sparse"), "attention must be one of causal-tiles, full, causal"),
    (lambda: refined(attention_tile=0), "attention_tile must be an integer >= 1"),
    (lambda: refined(attention="full", attention_tile=7),
     "attention_tile belongs to the refined model's 'causal-tiles' attention; with attention 'full' it would "
     "change nothing, got attention_tile=7"),
    (lambda: refined(gpu=dataclasses.replace(get_gpu("h100"), refined=RefinedParams(attention="causal")),
                     attention_tile=7), "with attention 'causal' it would change nothing"),
    (lambda: refined(overhead_s=-1.0), "overhead_s must be a finite number of seconds >= 0, got -1.0"),
    (lambda: RefinedParams(gemm_flop_ceiling=0.0), "gemm_flop_ceiling must be a finite number in \\(0, 1\\]"),
    (lambda: RefinedParams(overlap=0.5), "overlap must be a finite number in \\[1, 64\\]"),
    (lambda: RefinedParams(kernel_floor_s=math.nan), "kernel_floor_s must be a finite number >= 0"),
    (lambda: RefinedParams(attention="dense"), "RefinedParams.attention must be one of"),
    (lambda: RefinedParams(n_sms=-1), "n_sms must be an integer >= 0"),
    (lambda: GPUSpec("x", 1e12, 1e12, 1e9, refined={"overlap": 2}), "GPUSpec.refined must be a RefinedParams"),
])
def test_bad_parameters_are_refused_clearly(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- the memory convention ------------------------------------------------------------------------------------

@pytest.mark.parametrize("gpu", ["a100-80gb", "h100"])
def test_capacity_in_decimal_gb_and_in_gib(gpu):
    w, per_tok = LLAMA.weight_bytes, LLAMA.kv_bytes_per_token
    assert kv_capacity_tokens(LLAMA, gpu) == int((0.9 * 80e9 - w) // per_tok) == 426_784
    assert kv_capacity_tokens(LLAMA, gpu, mem_unit="GiB") == int((0.9 * 80 * 2**30 - w) // per_tok) == 467_291
    assert (max_requests(LLAMA, gpu, 8192), max_requests(LLAMA, gpu, 8192, mem_unit="GiB")) == (52, 57)


# ---- the calculator ------------------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orca_torch.lab.gpu_calculator", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_refined_json_prints_the_breakdown_and_both_memory_conventions():
    r = _cli("--model", "llama-3-8b", "--gpu", "a100-80gb", "--batch", "64", "--context", "1400",
             "--cost-model", "refined", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    (step,) = out["step"]
    assert out["cost_model"] == step["cost_model"] == "refined"
    bd = step["breakdown_ms"]
    assert set(bd) == {"gemm_ms", "attention_ms", "elementwise_ms", "comm_ms", "overhead_ms"}
    want = refined().time(decode_totals(64, 1400)) * 1e3
    assert step["time_ms"] == pytest.approx(want, abs=5e-4)
    assert sum(bd.values()) == pytest.approx(want, abs=5e-3)
    conv = out["memory_conventions"]
    assert (conv["GB"]["kv_capacity_tokens"], conv["GiB"]["kv_capacity_tokens"]) == (426_784, 467_291)
    r = _cli("--cost-model", "refined", "--flop-efficiency", "0.5")
    assert r.returncode == 2 and "roofline setting" in r.stderr and r.stdout == ""
    r = _cli("--gpu", "h100", "--batch", "8")
    assert r.returncode == 0 and "cost model: roofline" in r.stdout and "GiB" in r.stdout


# ---- experiment 03 under both cost models ---------------------------------------------------------------------

def test_experiment_03_cost_models_prices_goodput_and_overload_under_both():
    from pathlib import Path

    from orca_torch.lab.api import simulate

    script = Path(__file__).resolve().parents[1] / "experiments" / "03_cost_models.py"
    r = subprocess.run([sys.executable, str(script), "--quick", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    cm = json.loads(r.stdout)["cost_models"]
    assert set(cm) == {"static_b128", "orca_max", "orca_oracle"}
    for k, figs in cm.items():
        roof, ref = figs["roofline"], figs["refined"]
        # every step costs more under the refined model: fewer tokens per second, no higher goodput
        assert ref["throughput_tok_s"] < roof["throughput_tok_s"]
        assert ref["goodput_req_s"] <= roof["goodput_req_s"]
    for cost_model, side in ((None, "roofline"), ("refined", "refined")):
        m = simulate("chat", 128.0, 600, "orca-oracle", max_bs=256, seed=0, cost_model=cost_model)
        assert cm["orca_oracle"][side]["throughput_tok_s"] == m.throughput_tok_s
    # docs/experiments/03-cost-models.md quotes the full run; its throughput columns are --quick's too
    page = "docs/experiments/03-cost-models.md"
    for label, k in (("static (B = 128)", "static_b128"), ("Orca (max 8192)", "orca_max"), ("Orca (oracle)", "orca_oracle")):
        roof, ref = (cm[k][side]["throughput_tok_s"] for side in ("roofline", "refined"))
        assert table_row(page, label)[2:] == [f"{roof:,.0f}", f"{ref:,.0f}", f"{ref / roof - 1:.0%}".replace("-", "−")]
