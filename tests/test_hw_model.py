"""The paper GPU (`hw_model`): the lecture's and the papers' figures, the shared formula, parallelism, errors."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.sim.hw_model import (BW_EFFICIENCY, GPUS, GPUSpec, Partition, RefinedParams, decode_profile,
    decode_totals, get_gpu, kv_capacity_tokens, max_batch_within, max_requests, measure_cpu, memory_plan,
    pricer, step_cost, step_time)
from orca_torch.sim.hw_model.roofline import MEMORY_SIDE_TABLE, check_totals
from orca_torch.sim.decode_runs import SHORT_RUN
from orca_torch.specs import PRESETS, ModelSpec, get_model_spec

LLAMA, H100 = get_model_spec("llama-3-8b"), get_gpu("h100")

# Llama-3-8B's published shape and the H100 datasheet, written out here so the expected figures do not
# come from the code under test: 8,030,261,248 bf16 parameters; K and V x 32 layers x 8 K/V heads x 128
# dims x 2 bytes per token; 3.35 TB/s HBM at the lecture's 80% efficiency.
WEIGHT_BYTES = 8_030_261_248 * 2
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
HBM_RATE = 0.8 * 3.35e12


def decode_step_s(batch: int, context: int) -> float:
    """A memory-bound decode step: one read of the weights and of every context token's K/V."""
    return (WEIGHT_BYTES + batch * context * KV_BYTES_PER_TOKEN) / HBM_RATE


def decodes(batch: int, context: int) -> list[SeqWork]:
    return [SeqWork(1, context - 1)] * batch


# ---- the lecture's Llama-3-8B on H100 figures (§1.2, §2.6, §5.2) ------------------------------------

def test_batch1_decode_is_one_weight_read_at_80_percent_bandwidth():
    c = step_cost(LLAMA, H100, decodes(1, 2))
    assert c.bound == "memory"
    assert BW_EFFICIENCY == 0.8
    assert c.time_s == pytest.approx(WEIGHT_BYTES / HBM_RATE, rel=1e-4)
    assert round(c.time_s * 1e3, 2) == 5.99 and round(c.time_s * 1e3, 1) == 6.0  # "6 ms"


def test_batch256_at_1k_context_is_about_19_ms():
    c = step_cost(LLAMA, H100, decodes(256, 1024))
    assert c.bound == "memory"
    assert c.bytes["hbm"] == WEIGHT_BYTES + 256 * 1024 * KV_BYTES_PER_TOKEN
    assert c.time_s == pytest.approx(decode_step_s(256, 1024), rel=1e-12)
    assert 18.5 < c.time_s * 1e3 < 19.5                                          # the lecture's "about 19 ms"


@pytest.mark.parametrize("context, expected", [(512, 559), (8192, 34)])
def test_largest_batch_within_20_ms(context, expected):
    b = max_batch_within(LLAMA, H100, 20e-3, context)
    assert b == expected
    assert step_cost(LLAMA, H100, decodes(b, context)).time_s <= 20e-3
    assert step_cost(LLAMA, H100, decodes(b + 1, context)).time_s > 20e-3


def test_anchors_do_not_depend_on_compute_efficiency_while_memory_bound():
    for fe in (0.45, 0.7, 1.0):
        assert max_batch_within(LLAMA, H100, 20e-3, 512, flop_efficiency=fe) == 559


def test_reserving_8192_tokens_fits_52_requests():
    plan = memory_plan(LLAMA, H100)
    assert plan.weight_bytes_per_device == WEIGHT_BYTES
    assert plan.kv_tokens == int((0.9 * 80e9 - WEIGHT_BYTES) // KV_BYTES_PER_TOKEN)
    assert max_requests(LLAMA, H100, 8192) == 52


def test_decode_profile_is_weights_plus_kv_per_sequence():
    a, b = decode_profile(LLAMA, H100, 512)
    assert a == pytest.approx(WEIGHT_BYTES / HBM_RATE, rel=1e-9)
    assert b == pytest.approx(512 * KV_BYTES_PER_TOKEN / HBM_RATE, rel=1e-9)
    assert a + 256 * b == pytest.approx(step_cost(LLAMA, H100, decodes(256, 512)).time_s, rel=1e-9)


@pytest.mark.parametrize("name, billions", [("gpt3-13b", 13), ("gpt3-101b", 101), ("gpt3-175b", 175),
                                             ("gpt3-341b", 341), ("opt-13b", 13)])
def test_model_sizes_come_from_the_shapes(name, billions):
    assert (LLAMA.n_params, LLAMA.weight_bytes, LLAMA.kv_bytes_per_token) == (
        8_030_261_248, WEIGHT_BYTES, KV_BYTES_PER_TOKEN)
    assert PRESETS[name].n_params == pytest.approx(billions * 1e9, rel=0.015)

def test_a_512_token_prefill_on_the_h100_is_compute_bound_by_hand():
    """Llama-3-8B's matmul weights a layer (Q, O 4096^2; K, V 4096 x 1024; SwiGLU 3 x 4096 x 14336), 2 FLOPs
    each a token, the 512^2 score pairs of full attention at 4 x 32 heads x 128 FLOPs a pair a layer, one
    LM-head row: 7.29 TFLOP at 70% of 989.4 TFLOP/s, 10.52 ms, over the 6.02 ms of its bytes."""
    n, layer = 512, 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    flops = 2 * n * 32 * layer + 4 * 32 * 32 * 128 * n * n + 2 * 4096 * 128256
    c = step_cost(LLAMA, H100, [SeqWork(n)])
    assert c.flops["total"] == flops == 7_285_315_207_168
    assert c.bound == "compute" and c.time_s == pytest.approx(flops / (0.7 * 989.4e12), rel=1e-12)
    assert c.memory_s == pytest.approx((WEIGHT_BYTES + n * KV_BYTES_PER_TOKEN) / HBM_RATE, rel=1e-12)
    assert round(c.time_s * 1e3, 2) == 10.52


def test_gpt3_175b_on_eight_a100_80gb_by_hand():
    """GPT-3 175B from its shape (96 layers of 12 h^2 matmul weights, 9 h biases and two LayerNorms of 2 h;
    h = 12,288; 50,257 tied vocabulary rows, 2,048 learned positions, a final LayerNorm): 174,604,259,328
    fp16 parameters, 4.5 MiB of K/V a token. At TP 8 on A100-80GB a device stores an eighth of the
    matmuls, biases and vocabulary and whole norms and positions, 43.70 GB; a batch-1 decode at context
    1,024 reads that and its eighth of the K/V at 80% of 2,039 GB/s, plus 2 ring all-reduces a layer of
    one 12,288-wide fp16 row over NVLink 3 (10 us + 2 x 7/8 x 24,576 B at 80% of 300 GB/s)."""
    h, layers, vocab = 12288, 96, 50257
    layer = 12 * h * h + 9 * h + 2 * 2 * h
    spec = get_model_spec("gpt3-175b")
    assert spec.n_params == layers * layer + vocab * h + 2048 * h + 2 * h == 174_604_259_328
    assert spec.kv_bytes_per_token == 2 * layers * h * 2 == 4_718_592
    device = layers * (12 * h * h // 8 + 9 * h // 8 + 4 * h) + -(-vocab // 8) * h + 2048 * h + 2 * h
    plan = memory_plan(spec, "a100-80gb", tp=8)
    assert plan.weight_bytes_per_device == 2 * device and round(2 * device / 1e9, 2) == 43.70
    assert plan.kv_tokens == int((0.9 * 80e9 - 2 * device) // (4_718_592 // 8)) == 47_974
    c = step_cost(spec, "a100-80gb", decodes(1, 1024), tp=8)
    memory = (2 * device + 1024 * 4_718_592 // 8) / (0.8 * 2.039e12)
    links = 2 * layers * (10e-6 + 2 * 7 / 8 * h * 2 / (0.8 * 300e9))
    assert c.bound == "memory" and c.time_s == pytest.approx(memory + links, rel=1e-12)
    assert round(c.time_s * 1e3, 2) == 29.12



# ---- the papers' memory figures ----------------------------------------------------------------------

def test_vllm_orca_max_on_opt13b_holds_7_requests():
    budget = 12 * 2**30
    assert kv_capacity_tokens("opt-13b", "a100-40gb", kv_budget_bytes=budget) == 15_728
    assert max_requests("opt-13b", "a100-40gb", 2048, kv_budget_bytes=budget) == 7
    # vLLM's 800 KB a token (2 x 5,120 hidden x 40 layers x 2 bytes): room for exactly 7 x 2,048 tokens holds 7
    exact = 7 * 2048 * 2 * 5120 * 40 * 2
    assert kv_capacity_tokens("opt-13b", "a100-40gb", kv_budget_bytes=exact) == 7 * 2048
    assert max_requests("opt-13b", "a100-40gb", 2048, kv_budget_bytes=exact) == 7
    assert max_requests("opt-13b", "a100-40gb", 2048, kv_budget_bytes=exact - 1) == 6


def test_fastertransformer_preallocation_runs_out_of_memory_where_orca_says():
    n13 = max_requests("gpt3-13b", "a100-40gb", 2048)
    assert 4 <= n13 < 8
    n101 = max_requests("gpt3-101b", "a100-40gb", 2048, tp=8)
    assert 8 <= n101 < 16


def test_weights_that_do_not_fit_are_a_clear_error():
    with pytest.raises(ValueError, match="raise tp or pp"):
        kv_capacity_tokens("gpt3-175b", "a100-40gb")
    assert kv_capacity_tokens("gpt3-175b", "a100-40gb", tp=8, pp=2) > 0
    assert kv_capacity_tokens("gpt3-341b", "a100-40gb", tp=8, pp=4) > 0


# ---- the roofline crossover ----------------------------------------------------------------------------

def _compute_exceeds_memory(n: int) -> bool:
    """The formula, evaluated here from the spec: does a prefill of n tokens take longer to compute?"""
    w = [SeqWork(n)]
    compute = LLAMA.step_flops(w)["total"] / (H100.peak_flops * H100.flop_efficiency)
    b = LLAMA.step_bytes(w)
    memory = (b["weights"] + b["kv_read"]) / (H100.mem_bw * H100.bw_efficiency)
    return compute > memory


def test_decode_memory_bound_long_prefill_compute_bound_crossover_where_arithmetic_says():
    for batch in (1, 64, 256):
        assert step_cost(LLAMA, H100, decodes(batch, 1024)).bound == "memory"
    assert step_cost(LLAMA, H100, [SeqWork(4096)]).bound == "compute"
    crossover = next(n for n in range(1, 4096) if _compute_exceeds_memory(n))
    assert step_cost(LLAMA, H100, [SeqWork(crossover - 1)]).bound == "memory"
    assert step_cost(LLAMA, H100, [SeqWork(crossover)]).bound == "compute"
    # a prefill does ~1 FLOP per weight byte per token, so it turns near the card's ridge point: the
    # arithmetic intensity where compute time equals memory time at the reached rates
    ridge = H100.peak_flops * H100.flop_efficiency / (H100.mem_bw * H100.bw_efficiency)
    assert crossover == pytest.approx(ridge, rel=0.15)


# ---- one formula: the cost model's FLOPs and bytes are the ModelSpec's -----------------------------------

MIXED = [SeqWork(1, 37), SeqWork(16, 8), SeqWork(40), SeqWork(1, 200)]


@pytest.mark.parametrize("attention", ["full", "causal"])
def test_flops_and_bytes_are_the_shared_formula(attention):
    spec = get_model_spec("gpt3-13b")
    c = step_cost(spec, "a100-40gb", MIXED, attention=attention)
    assert c.flops == spec.step_flops(MIXED, attention)
    b = spec.step_bytes(MIXED)
    for kind in ("weights", "kv_read", "kv_write"):
        assert c.bytes[kind] == b[kind]
    assert c.bytes["activations"] == spec.step_activation_bytes(MIXED) > 0
    assert c.bytes["hbm"] == b["weights"] + b["kv_read"]
    assert step_cost(spec, "a100-40gb", StepTotals.of(MIXED), attention=attention) == c
    empty = step_cost(spec, "a100-40gb", [], attention=attention)    # no request: not even the weights are read
    assert empty.bytes["total"] == empty.bytes["hbm"] == 0 and spec.step_bytes([])["weights"] == 0


def test_kv_is_read_for_every_context_token_and_written_for_the_new_ones():
    c = step_cost(LLAMA, H100, [SeqWork(16, 8), SeqWork(1, 37)])    # 16 new on 8 cached; a decode at 38
    assert c.bytes["kv_read"] == (16 + 8 + 1 + 37) * KV_BYTES_PER_TOKEN
    assert c.bytes["kv_write"] == (16 + 1) * KV_BYTES_PER_TOKEN


def test_causal_counting_lowers_prefill_attention_only():
    full = step_cost(LLAMA, H100, [SeqWork(2048)]).flops
    causal = step_cost(LLAMA, H100, [SeqWork(2048)], attention="causal").flops
    assert causal["linear"] == full["linear"]
    assert causal["attention"] * 2 * 2048 == full["attention"] * 2049
    d_full = step_cost(LLAMA, H100, decodes(8, 100)).flops
    assert step_cost(LLAMA, H100, decodes(8, 100), attention="causal").flops == d_full


def test_activations_charged_only_when_asked():
    plain = step_cost(LLAMA, H100, decodes(256, 512))
    unfused = step_cost(LLAMA, H100, decodes(256, 512), count_activations=True)
    extra = LLAMA.step_activation_bytes(decodes(256, 512))
    assert unfused.bytes["hbm"] == plain.bytes["hbm"] + extra
    assert unfused.memory_s == pytest.approx(plain.memory_s + extra / HBM_RATE, rel=1e-9)
    # By hand from `activation_elems_per_token`'s list, per layer: attention 2h + 4q + 2kv, SwiGLU MLP
    # 3h + 6i, two norms and two residual adds 10h; per request 3h + vocab (the final norm, the LM head).
    h, q, kv, i = 4096, 4096, 1024, 14336
    per_token = 32 * ((2 * h + 4 * q + 2 * kv) + (3 * h + 6 * i) + 10 * h) + h
    assert LLAMA.step_activation_bytes(decodes(1, 10)) == (per_token + 3 * h + 128256) * 2


def test_formula_flops_equal_flop_counter_on_the_torch_model():
    """The torch model (`model.py`) executes a mixed step; FlopCounterMode counts what step_cost charges."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from orca_torch.model.kv_cache import KVManager
    from orca_torch.model.orca_model import OrcaModel

    spec = get_model_spec("mini")
    model = OrcaModel(spec, seed=0)
    kv = KVManager(spec, n_slots=512)
    for rid, n in (("a", 64), ("b", 64), ("c", 64)):
        kv.reserve(rid, n)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        first = [SeqWork(5), SeqWork(9)]
        model.forward_batch(torch.randint(0, spec.vocab, (14,), generator=g), first, ["a", "b"], kv)
        works = [SeqWork(1, 5), SeqWork(7, 9), SeqWork(12, 0)]  # a decode, a prompt chunk, a fresh prefill
        ids = torch.randint(0, spec.vocab, (sum(w.n_new for w in works),), generator=g)
        with FlopCounterMode(display=False) as counter:
            logits = model.forward_batch(ids, works, ["a", "b", "c"], kv)
    assert tuple(logits.shape) == (3, spec.vocab)
    assert counter.get_total_flops() == step_cost(spec, "h100", works).flops["total"]


# ---- the fast path ---------------------------------------------------------------------------------------

works_st = st.lists(st.builds(SeqWork, st.integers(1, 600), st.integers(0, 1448)), min_size=0, max_size=24)  # within 2,048


@settings(max_examples=60, deadline=None)
@given(works=works_st, par=st.sampled_from([(1, 1), (2, 1), (8, 1), (1, 2), (8, 2), (4, 4), (8, 5)]),
       act=st.booleans())
def test_step_time_equals_step_cost(works, par, act):
    tp, pp = par
    c = step_cost("gpt3-13b", "a100-40gb", works, tp=tp, pp=pp, count_activations=act)
    t = step_time("gpt3-13b", "a100-40gb", StepTotals.of(works), tp=tp, pp=pp, count_activations=act)
    assert t == pytest.approx(c.time_s, rel=1e-12, abs=0)
    if works:
        assert c.time_s >= (max(c.compute_s, c.memory_s) + c.comm_s) * (1 - 1e-12)
        assert c.stage_s <= c.time_s * (1 + 1e-12)
        assert c.bound == ("compute" if c.compute_s > c.memory_s else "memory")
    else:
        assert c.time_s == 0 and c.flops["total"] == 0


def test_stage_coefficients_reproduce_step_time():
    pr = pricer("gpt3-175b", "a100-40gb", tp=8, pp=2)
    t = StepTotals.of(MIXED)
    pairs = t.attn_pairs_full
    by_hand = sum(max(s.c_tok * t.n_tokens + s.c_pair * pairs + s.c_seq * t.n_seqs,
                      s.m_fixed + s.m_kv * t.kv_read_tokens + s.m_tok * t.n_tokens + s.m_seq * t.n_seqs)
                  + s.tp_fixed + s.tp_tok * t.n_tokens + s.pp_fixed + s.pp_tok * t.n_tokens for s in pr.stages)
    assert len(pr.stages) == 2 and pr.stages[1].pp_fixed == 0 < pr.stages[0].pp_fixed
    assert pr.time(t) == pytest.approx(by_hand, rel=1e-12)
    a100 = get_gpu("a100-40gb")              # the LM head runs on the last stage only, split over its 8 ranks
    head = get_model_spec("gpt3-175b").step_flops(StepTotals(n_seqs=1))["lm_head"]
    assert pr.stages[0].c_seq == 0 < pr.stages[1].c_seq == pytest.approx(
        head / 8 / (a100.peak_flops * a100.flop_efficiency), rel=1e-12)


def test_overhead_is_added_once_per_step():
    base = step_cost(LLAMA, H100, decodes(4, 100)).time_s
    assert step_cost(LLAMA, H100, decodes(4, 100), overhead_s=1e-3).time_s == pytest.approx(base + 1e-3)
    mixed = [SeqWork(10, 5), SeqWork(20), SeqWork(1, 30)]        # 3 requests, 31 tokens: charged per request
    plain = step_cost(LLAMA, H100, mixed).time_s
    assert step_cost(LLAMA, H100, mixed, seq_overhead_s=1e-3).time_s == pytest.approx(plain + 3e-3, rel=1e-12)


DECODE_RUN_SETTINGS = [
    ("llama-3-8b", "h100", {}),
    ("llama-3-8b", "h100", {"overhead_s": 1e-3, "attention": "causal"}),
    ("llama-3-8b", "h200", {"flop_efficiency": 0.002}),          # compute-bound decodes
    ("gpt3-13b", "a100-40gb", {"tp": 2, "count_activations": True}),
    ("gpt3-175b", "a100-40gb", {"tp": 8, "pp": 2}),              # pipeline stages across nodes
    ("gpt3-13b", "a100-80gb", {"tp": 4, "pp": 5, "overhead_s": 2.5e-4, "count_activations": True}),
    ("gpt3-13b", "a100-40gb", {"tp": 2, "overhead_s": 3e-4, "count_activations": True}),   # one stage, every term
]
DECODE_RUNS = [(1, 1, 1), (1, 7, 11), (3, 1000, 12), (7, 40, 13), (64, 30_000, 100), (256, 2_000_000, 1000),
               (512, 123_457, 5), (5, 999, 20), (9, 4321, 21),   # 20 | 21: the scalar and numpy paths
               (32, 50_000, 2000)]


def test_decode_run_times_equal_step_by_step_time_exactly():
    bounds = set()
    for model, gpu, kw in DECODE_RUN_SETTINGS:
        pr = pricer(model, gpu, **kw)
        for k, ctx_sum, m in DECODE_RUNS:
            got = pr.decode_run_times(k, ctx_sum, m)
            totals = [StepTotals(k, k, ctx_sum + k * (j + 1), ctx_sum + k * (j + 1), ctx_sum + k * (j + 1))
                      for j in range(m)]
            want = np.array([pr.time(t) for t in totals])
            assert got.dtype == np.float64 and got.shape == (m,)
            np.testing.assert_array_equal(got, want, err_msg=f"{model} {gpu} {kw} k={k} ctx={ctx_sum} m={m}")
            bounds |= {pr.cost(totals[0]).bound, pr.cost(totals[-1]).bound}
    assert bounds == {"compute", "memory"}  # both sides of the max are exercised


@pytest.mark.parametrize("cut", [None, "before", "at"])
@pytest.mark.parametrize("start", [12.345, 0.0])     # (at 0 the sums keep the last bits of each step)
def test_decode_run_ends_are_the_step_by_step_sums_exactly(cut, start):
    """`t += time(step)` step by step, as the stepped engine adds it, up to and including
    the first end at or after `stop_at` (just before an end, or at it exactly); runs past `SHORT_RUN`
    steps (the numpy remainder) included."""
    for model, gpu, kw in DECODE_RUN_SETTINGS:
        pr = pricer(model, gpu, **kw)
        for k, ctx_sum, m in DECODE_RUNS + [(11, 5000, SHORT_RUN), (11, 5000, SHORT_RUN + 1), (3, 77, 300)]:
            t, want = start, []
            for j in range(m):
                c = ctx_sum + k * (j + 1)
                t += pr.time(StepTotals(k, k, c, c, c))
                want.append(t)
            stop = None if cut is None else want[(2 * m) // 3] - (1e-12 if cut == "before" else 0.0)
            if cut:                                                  # ends with the step at 2m/3
                want = want[:(2 * m) // 3 + 1]
            got = pr.decode_run_ends(k, ctx_sum, m, start, stop)
            assert list(got) == want, f"{model} {gpu} {kw} k={k} ctx={ctx_sum} m={m}"


def test_a_long_memory_bound_run_reads_the_same_prices_from_the_table_below_its_end_and_computes_them_past_it():
    """Context sums below `MEMORY_SIDE_TABLE` come from the pricer's table (grown as they come, up to
    its end), those past it are computed (a run that crosses it, throughout); cut or not."""
    pr = pricer(LLAMA, H100)
    top = MEMORY_SIDE_TABLE - 1 - 299          # a run of 300 single decodes whose last sum is the table's last
    for k, ctx_sum in [(2, 10), (3, 70_000), (1, top - 1), (1, top), (8, MEMORY_SIDE_TABLE - 8 * 150),
                       (8, MEMORY_SIDE_TABLE + 5)]:
        t, want = 3.0, []
        for j in range(300):
            c = ctx_sum + k * (j + 1)
            t += pr.time(StepTotals(k, k, c, c, c))
            want.append(t)
        assert pr.cost(StepTotals(k, k, ctx_sum + k, ctx_sum + k, ctx_sum + k)).bound == "memory"
        assert list(pr.decode_run_ends(k, ctx_sum, 300, 3.0)) == want, (k, ctx_sum)
        assert list(pr.decode_run_ends(k, ctx_sum, 300, 3.0, want[150] - 1e-12)) == want[:151], (k, ctx_sum)
        if k == 3:
            assert 70_000 + 3 * 300 < len(pr._memory_side)
    assert len(pr._memory_side) == MEMORY_SIDE_TABLE    # grown to its end, and no further


@pytest.mark.parametrize("m", [30, 300])                 # the scalar loop and numpy
def test_decode_runs_memory_bound_throughout_compute_bound_or_crossing_are_the_step_by_step_sums(m):
    """A run that is memory-bound at every step skips the compute side; one that starts
    compute-bound and crosses over (or stays compute-bound) takes the max step by step."""
    pr = pricer(LLAMA, H100)
    regimes = set()
    for k, ctx_sum in [(1, 0), (8, 4000), (512, 0), (512, 100_000), (4096, 0), (4096, 800_000)]:
        t, want = 7.0, []
        for j in range(m):
            c = ctx_sum + k * (j + 1)
            t += pr.time(StepTotals(k, k, c, c, c))
            want.append(t)
        first = pr.cost(StepTotals(k, k, ctx_sum + k, ctx_sum + k, ctx_sum + k)).bound
        last = pr.cost(StepTotals(k, k, ctx_sum + k * m, ctx_sum + k * m, ctx_sum + k * m)).bound
        regimes.add((first, last))
        assert list(pr.decode_run_ends(k, ctx_sum, m, 7.0)) == want, (k, ctx_sum, m)
        assert list(pr.decode_run_times(k, ctx_sum, m)) == [pr.time(StepTotals(k, k, c, c, c)) for c in
                                                            range(ctx_sum + k, ctx_sum + k * m + 1, k)]
    assert regimes == {("memory", "memory"), ("compute", "compute"), ("compute", "memory")}


@pytest.mark.parametrize("m", [30, 300])                 # the scalar loop and numpy
def test_a_run_memory_bound_until_its_last_step_is_priced_step_by_step(m):
    """Where the compute side grows over a thousand times faster than the K/V reads (512 query heads
    on one K/V head, a card at 1e-3 of its FLOP rate) it overtakes the memory side within one step:
    the runs that cross over at their very last step are the step-by-step sums too. (The weights,
    most of them learned positions, keep the first steps memory-bound.)"""
    spec = ModelSpec("mqa", n_layers=2, hidden=1024, n_heads=512, n_kv_heads=1, head_dim=16, intermediate=1024,
                     vocab=1024, max_context=1 << 18, learned_positions=True)
    pr = pricer(spec, H100, flop_efficiency=1e-3)
    s, k = pr.stages[0], 1
    assert s.c_pair > 1000 * s.m_kv
    x = int((s.m_fixed - s.c_tok * k - s.c_seq * k) / (s.c_pair - s.m_kv))    # where compute overtakes memory
    regimes = set()
    for ctx_sum in range(x - k * m - 3, x - k * m + 4):
        t, want = 0.0, []
        for j in range(m):
            c = ctx_sum + k * (j + 1)
            t += pr.time(StepTotals(k, k, c, c, c))
            want.append(t)
        regimes.add(tuple(pr.cost(StepTotals(k, k, c, c, c)).bound for c in (ctx_sum + k, ctx_sum + k * m)))
        assert list(pr.decode_run_ends(k, ctx_sum, m, 0.0)) == want, ctx_sum
        np.testing.assert_array_equal(pr.decode_run_times(k, ctx_sum, m), [
            pr.time(StepTotals(k, k, c, c, c)) for c in range(ctx_sum + k, ctx_sum + k * m + 1, k)])
    assert ("memory", "compute") in regimes and ("memory", "memory") in regimes


def test_a_long_decode_run_cut_by_an_arrival_prices_only_the_steps_it_uses():
    pr = pricer(LLAMA, H100)
    priced = []
    run_times, memory_bound_times = pr.decode_run_times, pr._memory_bound_times

    def spy(k, ctx_sum, m):
        priced.append(m)
        return run_times(k, ctx_sum, m)

    def spy_memory_bound(x, k, m, *terms):
        priced.append(m)
        return memory_bound_times(x, k, m, *terms)
    one = pr.time(StepTotals(8, 8, 4008, 4008, 4008))
    try:
        pr.decode_run_times, pr._memory_bound_times = spy, spy_memory_bound
        ends = pr.decode_run_ends(8, 4000, 100_000, 0.0, stop_at=80.5 * one)     # cut after about 80 steps
    finally:
        del pr.decode_run_times, pr._memory_bound_times
    assert 75 <= len(ends) <= 82 and ends[-1] >= 80.5 * one > ends[-2]
    assert priced == [82]                 # numpy from the first step (past SHORT_RUN before the cut), up to the bound 80.5 + 2


def test_decode_run_steps_are_the_decodes_of_the_same_sequences():
    pr = pricer("gpt3-175b", "a100-40gb", tp=8, pp=2, attention="causal")
    pasts = [5, 700, 31, 2048]
    got = pr.decode_run_times(len(pasts), sum(pasts), 20)
    want = [pr.time(StepTotals.of([SeqWork(1, p + j) for p in pasts])) for j in range(20)]
    np.testing.assert_array_equal(got, want)
    assert np.all(np.diff(got) > 0)  # contexts grow, so steps only get longer


def test_decode_run_times_edges():
    pr = pricer(LLAMA, H100)
    assert pr.decode_run_times(4, 100, 0).shape == (0,)
    np.testing.assert_array_equal(pr.decode_run_times(0, 0, 3), np.zeros(3))
    a = pr.decode_run_times(4, 100, 20)
    first = a.copy()
    a += 1.0  # the engine adds the start time in place: every call returns a new array
    np.testing.assert_array_equal(pr.decode_run_times(4, 100, 20), first)

# ---- tensor and pipeline parallelism (lecture §4.4) --------------------------------------------------------

def test_tp_all_reduce_cost_is_two_rings_per_layer():
    spec, a100 = get_model_spec("gpt3-101b"), get_gpu("a100-40gb")
    works = decodes(8, 300)
    c = step_cost(spec, a100, works, tp=8)
    ring = 2 * 7 / 8 * 8 * spec.hidden * spec.dtype_bytes / (a100.nvlink_bw * a100.comm_efficiency)
    assert c.tp_comm_s == pytest.approx(2 * spec.n_layers * (a100.nvlink_latency_s + ring), rel=1e-12)
    assert c.pp_comm_s == 0 and step_cost(spec, a100, works).comm_s == 0
    by_tp = [step_cost(spec, a100, works, tp=tp).tp_comm_s for tp in (2, 4, 8)]
    assert by_tp == sorted(by_tp) and by_tp[0] < by_tp[-1]
    by_tokens = [step_cost(spec, a100, [SeqWork(n)], tp=8).tp_comm_s for n in (1, 64, 512)]
    assert by_tokens == sorted(by_tokens) and by_tokens[0] < by_tokens[-1]


@pytest.mark.parametrize("attention", ["full", "causal"])
def test_a_prefill_s_flops_are_shared_by_the_tp_devices_of_each_stage(attention):
    """GPT-3 175B, Orca's PP 2 x TP 8: a 2,048-token prompt is compute-bound on every stage, so its time
    is every FLOP over 8 devices' rate, plus the links. By hand from GPT-3's shape (96 layers, hidden
    12,288, 4x GELU MLP: 12 h^2 matmul weights a layer; vocabulary 50,257), one LM-head row, and the
    2,048^2 score pairs of full attention (2,048 x 2,049 / 2 causal), 4 h FLOPs a pair a layer."""
    h, layers, vocab, n = 12288, 96, 50257, 2048
    pairs = n * n if attention == "full" else n * (n + 1) // 2
    flops = 2 * n * layers * 12 * h * h + 4 * layers * h * pairs + 2 * h * vocab
    rate = 312e12 * 0.7                                       # A100 fp16 dense at the flop efficiency
    c = step_cost("gpt3-175b", "a100-40gb", [SeqWork(n)], tp=8, pp=2, attention=attention)
    assert c.bound == "compute" and c.flops["total"] == flops
    assert c.compute_s == pytest.approx(flops / 8 / rate, rel=1e-12)
    assert c.time_s == pytest.approx(flops / 8 / rate + c.tp_comm_s + c.pp_comm_s, rel=1e-12)


def test_tp_splits_weight_reads_of_a_memory_bound_decode():
    spec = get_model_spec("gpt3-13b")
    one = step_cost(spec, "a100-40gb", decodes(4, 256))
    eight = step_cost(spec, "a100-40gb", decodes(4, 256), tp=8)
    assert eight.memory_s == pytest.approx(one.memory_s / 8, rel=0.01)
    assert eight.time_s < one.time_s / 4


def test_pp_adds_stage_transfers_over_infiniband_across_nodes():
    spec, a100 = get_model_spec("gpt3-175b"), get_gpu("a100-40gb")
    works = decodes(8, 300)
    c = step_cost(spec, a100, works, tp=8, pp=2)  # Orca's 175B: 2 VMs of 8 GPUs
    xfer = a100.ib_latency_s + 8 * spec.hidden * spec.dtype_bytes / (a100.ib_bw * a100.comm_efficiency)
    assert c.pp_comm_s == pytest.approx(xfer, rel=1e-12)
    inside = step_cost(spec, a100, works, tp=4, pp=2).pp_comm_s  # both stages in one node: NVLink
    assert inside < c.pp_comm_s
    four = step_cost("gpt3-341b", a100, works, tp=8, pp=4)
    assert four.pp_comm_s > c.pp_comm_s  # three boundaries


def test_pipeline_latency_runs_through_every_stage():
    spec = get_model_spec("gpt3-13b")
    works = decodes(4, 256)  # memory-bound in every stage
    one, two = step_cost(spec, "a100-80gb", works), step_cost(spec, "a100-80gb", works, pp=2)
    assert two.time_s == pytest.approx(one.time_s + two.pp_comm_s, rel=1e-9)
    assert two.stage_s < 0.6 * two.time_s


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_stage_weight_traffic_sums_to_the_shared_formula(name):
    spec = PRESETS[name]
    assert Partition(spec, 1, 1).stage_weight_bytes(0) == spec.weight_bytes
    for pp in (1, 2, 3, 4):
        if pp > spec.n_layers:
            continue
        part = Partition(spec, 1, pp)
        assert sum(part.stage_layers) == spec.n_layers and max(part.stage_layers) - min(part.stage_layers) <= 1
        assert sum(part.stage_weight_traffic(s) for s in range(pp)) == spec.weight_bytes
        assert sum(part.stage_kv_bytes_per_token(s) for s in range(pp)) == spec.kv_bytes_per_token
    # the first n_layers % pp stages take one more layer; the last reads the vocabulary and the final norm
    if spec.n_layers >= 3:
        part, (base, extra) = Partition(spec, 1, 3), divmod(spec.n_layers, 3)
        assert part.stage_layers == tuple(base + (s < extra) for s in range(3))
        per_layer = part.layer_params_per_device * spec.dtype_bytes
        assert part.stage_weight_traffic(0) == part.stage_layers[0] * per_layer
        assert part.stage_weight_traffic(2) == part.stage_layers[2] * per_layer + (
            spec.embedding_params + spec.lm_head_params + spec.norm_params) * spec.dtype_bytes


def test_tp_divides_weights_and_kv_per_device():
    spec = get_model_spec("gpt3-101b")
    part = Partition(spec, 8, 1)
    replicated = (part.position_params + (2 * spec.n_layers + 1) * spec.norm_params) * spec.dtype_bytes
    assert spec.weight_bytes / 8 < part.weight_bytes_per_device <= spec.weight_bytes / 8 + replicated
    assert part.stage_kv_bytes_per_token(0) * 8 == spec.kv_bytes_per_token
    gqa = Partition(LLAMA, 32, 1)  # more ranks than the 8 K/V heads: K/V heads are replicated
    assert gqa.kv_heads_per_device == 1
    assert gqa.stage_kv_bytes_per_token(0) == LLAMA.kv_bytes_per_token // 8
    # at TP 16 each rank holds one of the 8 K/V heads whole: its K and V weights are 2 x 4096 x 128, not halves
    # of one; Q and O (4096 x 4096 each) and the SwiGLU MLP (3 x 4096 x 14336) are split; two RMSNorms kept
    tp16 = Partition(LLAMA, 16, 1)
    assert tp16.layer_params_per_device == 2 * 4096 * 4096 // 16 + 2 * 4096 * 128 + 3 * 4096 * 14336 // 16 + 2 * 4096


def test_pipeline_stages_store_their_own_vocabulary_and_the_first_stage_binds_capacity():
    """GPT-3's layer by hand: 12 h^2 matmul weights, 9 h biases (QKV 3h, O h, MLP 4h + h), two LayerNorms
    of 2 h. Stage 0 stores the embedding and the 2,048 learned positions; the last stage the final norm
    and its own copy of the tied LM head."""
    h, vocab = 5120, 50257                                        # GPT-3 13B on two stages of 20 layers
    layer = 12 * h * h + 9 * h + 4 * h
    two = Partition(get_model_spec("gpt3-13b"), 1, 2)
    assert two.stage_weight_bytes(0) == (20 * layer + vocab * h + 2048 * h) * 2
    assert two.stage_weight_bytes(1) == (20 * layer + 2 * h + vocab * h) * 2
    # GPT-3 175B at PP 2 x TP 8 on A100-40GB: 48 layers a stage, each device an eighth of the matmuls, biases
    # and vocabulary; the embedding stage has the least room, and its K/V (48 layers x 12 of the 96 heads) sets it
    h, vocab = 12288, 50257
    layer = 12 * h * h // 8 + 9 * h // 8 + 4 * h
    stage0 = (48 * layer + -(-vocab // 8) * h + 2048 * h) * 2
    plan = memory_plan("gpt3-175b", "a100-40gb", tp=8, pp=2)
    assert plan.kv_bytes_per_token_per_device == 2 * 48 * 12 * 128 * 2
    assert plan.kv_tokens == int((0.9 * 40e9 - stage0) // (2 * 48 * 12 * 128 * 2))


# ---- the cards ---------------------------------------------------------------------------------------------

def test_datasheet_cards():
    assert (GPUS["h100"].peak_flops, GPUS["h100"].mem_bw, GPUS["h100"].mem_bytes) == (989.4e12, 3.35e12, 80e9)
    assert (GPUS["a100-40gb"].peak_flops, GPUS["a100-40gb"].mem_bw) == (312e12, 1.555e12)
    assert (GPUS["a100-80gb"].mem_bw, GPUS["h200"].mem_bw, GPUS["h200"].mem_bytes) == (2.039e12, 4.8e12, 141e9)
    assert GPUS["a100-40gb"].ib_bw * 8 * 8 == 1.6e12  # Orca's 1.6 Tb/s per 8-GPU VM
    assert GPUS["h100"].nvlink_bw * 2 == 900e9 and GPUS["a100-80gb"].nvlink_bw * 2 == 600e9
    assert GPUS["h200"].peak_flops == 989.4e12                            # dense bf16, not the 1,979 sparse
    assert GPUS["a100-80gb"].peak_flops == 312e12
    assert GPUS["h100"].ib_bw * 8 == GPUS["h200"].ib_bw * 8 == 400e9     # one 400 Gb/s NDR NIC per GPU
    assert get_gpu("H100") is GPUS["h100"]


def test_cpu_spec_is_measured_once_per_process_and_thread_count():
    from orca_torch.model.accounting import torch_threads

    cpu = get_gpu("cpu")
    assert cpu is get_gpu("cpu") is measure_cpu()
    with torch_threads(1):                      # the threads the steps it prices run on
        one = get_gpu("cpu")
        assert one is measure_cpu() and one.source.endswith(", 1 thread")
    assert get_gpu("cpu") is cpu
    assert cpu.peak_flops > 0 and math.isfinite(cpu.peak_flops)
    assert cpu.mem_bw > 0 and math.isfinite(cpu.mem_bw) and cpu.mem_bytes > 0
    assert cpu.flop_efficiency == cpu.bw_efficiency == 1.0
    assert "measured" in cpu.source
    c = step_cost("mini", cpu, [SeqWork(1, 10)] * 4)
    assert c.time_s == pytest.approx(max(c.flops["total"] / cpu.peak_flops, c.bytes["hbm"] / cpu.mem_bw))


# ---- bad input -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: get_gpu("h300"), "known GPUs: a100-40gb, a100-80gb, h100, h200, cpu"),
    (lambda: step_cost("llama-9b", "h100", []), "known presets"),
    (lambda: step_cost(LLAMA, H100, [], tp=3), "tp=3 must divide n_heads"),
    (lambda: step_cost(LLAMA, H100, [], tp=0), "tp must be an integer >= 1, got 0"),
    (lambda: step_cost(LLAMA, H100, [], pp=33), "pp=33 exceeds the 32 layers"),
    (lambda: step_cost(LLAMA, H100, [], flop_efficiency=0), r"flop_efficiency must be a finite number in \(0, 1\], got 0"),
    (lambda: step_cost(LLAMA, H100, [], bw_efficiency=1.5), r"bw_efficiency must be a finite number in \(0, 1\], got 1.5"),
    (lambda: step_cost(LLAMA, H100, [], overhead_s=-1e-3), "overhead_s must be"),
    (lambda: step_cost(LLAMA, H100, [], attention="sparse"), "attention must be"),
    (lambda: step_cost("mini", "cpu", [], tp=2), "no interconnect"),
    (lambda: kv_capacity_tokens(LLAMA, H100, 0.0), r"mem_fraction must be a finite number in \(0, 1\], got 0.0"),
    (lambda: max_batch_within(LLAMA, H100, 1e6, 512), "budget is too large"),
])
def test_bad_input_is_a_clear_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_budget_below_one_weight_read_fits_no_batch():
    assert max_batch_within(LLAMA, H100, 5e-3, 512) == 0


def test_a_step_that_takes_exactly_the_budget_fits_within_it():
    for batch in (1, 559):
        budget = step_time(LLAMA, H100, decode_totals(batch, 512))
        assert max_batch_within(LLAMA, H100, budget, 512) == batch


def test_pricer_is_shared_between_calls():
    assert pricer("llama-3-8b", "h100") is pricer("llama-3-8b", "h100")


# ---- one rule for numbers: numpy numbers price as Python ones, stored as plain int/float ---------------

def test_numpy_integers_give_the_python_integer_results():
    assert pricer(LLAMA, H100, tp=np.int64(2)) is pricer(LLAMA, H100, tp=2)   # one cached pricer
    assert type(pricer(LLAMA, H100, tp=np.int64(2), pp=np.int32(2)).tp) is int
    refined = pricer(LLAMA, H100, cost_model="refined", tp=np.int64(2), attention_tile=np.int64(64))
    assert (type(refined.tp), type(refined.tile)) == (int, int)
    assert max_requests(LLAMA, H100, np.int64(8192)) == max_requests(LLAMA, H100, 8192) == 52
    assert decode_profile(LLAMA, H100, np.int64(512)) == decode_profile(LLAMA, H100, 512)
    assert max_batch_within(LLAMA, H100, 0.02, np.int64(512)) == max_batch_within(LLAMA, H100, 0.02, 512) == 559
    t = decode_totals(np.int64(4), np.int64(512))
    assert t == decode_totals(4, 512) and all(type(getattr(t, f)) is int for f in t._fields)
    part = Partition(LLAMA, np.int64(2), np.uint8(2))
    assert (part.tp, part.pp) == (2, 2) and type(part.tp) is int and type(part.pp) is int


def test_numpy_totals_are_priced_as_python_totals_and_come_back_plain():
    works = decodes(8, 300) + [SeqWork(200)]
    plain = StepTotals.of(works)
    as_np = StepTotals(*(np.int64(getattr(plain, f)) for f in plain._fields))
    for cost_model in ("roofline", "refined"):
        pr = pricer(LLAMA, H100, cost_model=cost_model)
        assert pr.cost(as_np).time_s == pr.cost(plain).time_s == pr.time(plain)
        assert pr.cost(as_np).flops == pr.cost(plain).flops
    checked = check_totals(as_np)
    assert checked == plain and all(type(getattr(checked, f)) is int for f in plain._fields)


def test_numpy_floats_give_the_results_of_the_same_python_float():
    f32 = np.float32(0.9)
    assert kv_capacity_tokens(LLAMA, H100, f32) == kv_capacity_tokens(LLAMA, H100, float(f32))
    assert kv_capacity_tokens(LLAMA, H100, np.float64(0.9)) == kv_capacity_tokens(LLAMA, H100, 0.9)
    plan = memory_plan(LLAMA, H100, mem_fraction=np.float64(0.9), kv_budget_bytes=np.int64(2**34))
    assert plan == memory_plan(LLAMA, H100, mem_fraction=0.9, kv_budget_bytes=2**34)
    assert type(plan.kv_budget_bytes) is float
    budget = np.float32(0.02)
    assert max_batch_within(LLAMA, H100, budget, 512) == max_batch_within(LLAMA, H100, float(budget), 512) == 559
    t = StepTotals.of(decodes(64, 1000))
    for name in ("flop_efficiency", "bw_efficiency", "comm_efficiency", "overhead_s", "seq_overhead_s"):
        v = np.float32(0.5 if "efficiency" in name else 1e-3)
        pr = pricer(LLAMA, H100, tp=2, **{name: v})
        assert pr.time(t) == pricer(LLAMA, H100, tp=2, **{name: float(v)}).time(t)
        assert type(pr.overhead_s) is float and type(pr.seq_overhead_s) is float
    g = GPUSpec("numpy-card", np.float64(1e15), np.int64(2 * 10**12), np.float32(4e10), np.float64(1e11),
                gpus_per_node=np.int64(4), flop_efficiency=np.float32(0.5), nvlink_latency_s=np.float64(1e-5))
    assert type(g.peak_flops) is type(g.mem_bw) is type(g.mem_bytes) is type(g.flop_efficiency) is float
    assert type(g.nvlink_bw) is float and type(g.gpus_per_node) is int and g.mem_bw == 2e12
    prm = RefinedParams(overlap=np.float32(2.0), attention_tile=np.int64(64), kernel_floor_s=np.float64(0.0))
    assert (type(prm.overlap), type(prm.attention_tile), type(prm.kernel_floor_s)) == (float, int, float)
    assert prm == RefinedParams(overlap=2.0, attention_tile=64, kernel_floor_s=0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 3000)), min_size=0, max_size=12))
def test_the_totals_of_every_real_step_pass_the_check(pairs):
    """The consistency rules refuse only totals no SeqWork list can have."""
    t = StepTotals.of([SeqWork(n, p) for n, p in pairs])
    assert check_totals(t) is t


def test_contexts_up_to_the_models_own_are_priced():
    assert max_batch_within(LLAMA, H100, 0.02, LLAMA.max_context) == 34
    assert step_cost(LLAMA, H100, [SeqWork(1, LLAMA.max_context - 1)]).time_s > 0
    assert step_cost(LLAMA, H100, [SeqWork(LLAMA.max_context)], cost_model="refined").time_s > 0


# ---- the calculator ---------------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orca_torch.lab.gpu_calculator", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_prints_the_llama_figures():
    r = _cli("--model", "llama-3-8b", "--gpu", "h100", "--batch", "256", "--context", "1024", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    (step,) = out["step"]
    want_ms = decode_step_s(256, 1024) * 1e3
    assert step["time_ms"] == pytest.approx(want_ms, abs=5e-4) and step["bound"] == "memory"
    assert step["flops"]["total"] == LLAMA.step_flops(decodes(256, 1024))["total"]
    assert out["memory"]["kv_capacity_tokens"] == kv_capacity_tokens(LLAMA, H100) == int(
        (0.9 * 80e9 - WEIGHT_BYTES) // KV_BYTES_PER_TOKEN)
    assert (out["memory"]["reserve_tokens"], out["memory"]["max_requests"]) == (8192, 52)

    r = _cli("--batch", "1", "--context", "2", "--json")
    assert r.returncode == 0, r.stderr
    one_read_ms = LLAMA.n_params * LLAMA.dtype_bytes / (H100.bw_efficiency * H100.mem_bw) * 1e3  # "6 ms": 5.99
    assert json.loads(r.stdout)["step"][0]["time_ms"] == pytest.approx(one_read_ms, rel=1e-4)

    r = _cli("--context", "512", "8192", "--within-ms", "20", "--json")
    assert r.returncode == 0, r.stderr
    assert [(w["context"], w["max_batch"], w["kv_holds"]) for w in json.loads(r.stdout)["max_batch_within"]] == [
        (512, 559, 833), (8192, 34, 52)]              # (a time bound, beside what the K/V holds)

    r = _cli("--batch", "256", "--context", "1024")
    assert r.returncode == 0 and f"{want_ms:.2f}" in r.stdout and "memory" in r.stdout

    r = _cli("--context", "512", "--within-ms", "1")            # below one sequence's step: said, no NaN
    assert r.returncode == 0 and "no batch fits at context 512 (one sequence alone takes 6.02 ms)" in r.stdout
    assert "nan" not in r.stdout
    r = _cli("--context", "512", "--within-ms", "1", "--json")
    assert json.loads(r.stdout)["max_batch_within"] == [{"context": 512, "budget_ms": 1.0, "max_batch": 0,
                                                         "time_ms": None, "kv_holds": 426_784 // 512}]


def test_cli_prints_a_prefill_alone_as_one_row_at_no_context(capsys):
    """--batch 0 --prompt 512 is the prefill alone: it was printed at "context 1024", a context no token of it
    has. One row, its context null ("n/a"), its time the hand-computed 10.52 ms (7.29 TFLOP at 70% of
    989.4 TFLOP/s), its K/V the prompt's 512 tokens."""
    from orca_torch.lab.gpu_calculator import main

    (step,) = main(["--batch", "0", "--prompt", "512", "--json"])["step"]
    flops = 2 * 512 * 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 4 * 32 * 32 * 128 * 512 ** 2 \
        + 2 * 4096 * 128256
    assert (step["context"], step["kv_tokens"], step["bound"]) == (None, 512, "compute")
    assert step["time_ms"] == round(flops / (0.7 * 989.4e12) * 1e3, 4) == 10.5191
    capsys.readouterr()
    main(["--batch", "0", "--prompt", "512"])
    assert re.search(r"\nn/a +0 +512 +10\.52 +compute", capsys.readouterr().out)


def test_cli_heads_an_explicit_budget_in_the_units_of_its_table(capsys):
    """--kv-budget-gib 12 is 12 GiB, which the table beneath lists in decimal GB: the heading says both."""
    from orca_torch.lab.gpu_calculator import main

    out = main(["--kv-budget-gib", "12"])
    printed = capsys.readouterr().out
    assert out["memory"]["kv_budget_gb_per_device"] == 12 * 2**30 / 1e9
    assert "K/V capacity per device (explicit 12 GiB = 12.885 GB)" in printed


def test_cli_lists_the_memory_unit_only_where_the_capacity_counts_the_card_in_it(capsys):
    """A K/V budget given in GiB makes the same table whichever unit the card is counted in: its
    'mem_unit GiB' row read as if its GB figures were GiB. The JSON keeps the setting."""
    from orca_torch.lab.gpu_calculator import main

    tables = {}
    for unit in ("GB", "GiB"):
        out = main(["--kv-budget-gib", "12", "--mem-unit", unit])
        assert out["memory"]["mem_unit"] == unit
        tables[unit] = capsys.readouterr().out.split("== K/V capacity per device")[1].split("\n\n")[0]
    assert tables["GB"] == tables["GiB"] and "mem_unit" not in tables["GB"]
    main(["--mem-unit", "GiB"])
    assert "mem_unit                       GiB" in capsys.readouterr().out


def test_cli_writes_the_memory_tables_counts_as_it_does_without_a_budget(capsys):
    """With --kv-budget-gib the memory table is all figures (no 'mem_unit GB' row), and a table
    printer that read its cells as numbers would drop the counts' thousands separators (131072
    beside 16.061): the counts print as they do without a budget."""
    from orca_torch.lab.gpu_calculator import main

    out = main(["--kv-budget-gib", "12"])
    table = capsys.readouterr().out.split("== K/V capacity per device")[1].split("\n\n")[0]
    for k in ("kv_bytes_per_token_per_device", "kv_capacity_tokens", "reserve_tokens"):
        assert re.search(rf"^{k} +{out['memory'][k]:,}$", table, re.M), (k, table)


@pytest.mark.parametrize("argv, said", [
    ([], "52 requests of 8,192 tokens for llama-3-8b on h100"),
    (["--model", "tiny"], "274,656 requests of 512 tokens for tiny on h100"),
    (["--model", "opt-13b", "--gpu", "a100-40gb", "--reserve", "2048"],
     "6 requests of 2,048 tokens for opt-13b on a100-40gb"),
])
def test_cli_memory_note_gives_the_requests_of_the_model_and_card_priced(argv, said, capsys):
    """The conventions table's note said '52 x 8K on an H100', Llama-3-8B's figure, under every model
    and card: it gives the GB row's own requests and reservation."""
    from orca_torch.lab.gpu_calculator import main

    out = main(argv)
    printed = capsys.readouterr().out
    assert f"GB: decimal, as the lecture counts ({said}); GiB:" in printed
    assert said.startswith(f"{out['memory_conventions']['GB']['max_requests']:,} requests")


def test_cli_help_gives_the_efficiency_defaults_of_every_card(capsys):
    """The measured cpu card reaches its own peaks (1.0), the datasheet cards 0.7 and 0.8: the help
    says which, not 0.7 and 0.8 as if they held for all."""
    from orca_torch.lab.gpu_calculator import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: the card's; 0.7 on the datasheet cards, 1.0 on the measured cpu)" in text
    assert "(default: the card's; 0.8 on the datasheet cards, 1.0 on the measured cpu)" in text


def test_cli_rejects_unknown_names_and_bad_lengths():
    r = _cli("--gpu", "h300")
    assert r.returncode == 2 and "known GPUs: a100-40gb, a100-80gb, h100, h200, cpu" in r.stderr
    r = _cli("--model", "llama-9b")
    assert r.returncode == 2 and "known presets" in r.stderr
    r = _cli("--context", "9000")
    assert r.returncode == 2 and "--context (at most llama-3-8b's max context) must be an integer in [2, 8192]" in r.stderr
    r = _cli("--batch", "0")
    assert r.returncode == 2 and "empty" in r.stderr
    r = _cli("--model", "gpt3-175b", "--gpu", "a100-40gb")  # weights do not fit: an error, no half table
    assert r.returncode == 2 and "raise tp or pp" in r.stderr and r.stdout == ""


def test_a_cuda_device_name_points_at_its_datasheet_card():
    from orca_torch.sim.hw_model import card_for

    assert card_for("NVIDIA H200") == "h200" and card_for("NVIDIA H100 80GB HBM3") == "h100"
    assert card_for("NVIDIA A100-SXM4-80GB") == "a100-80gb" and card_for("NVIDIA A100-PCIE-40GB") == "a100-40gb"
    assert card_for("Tesla T4") is None
    assert all(get_gpu(card_for(n)) for n in ("NVIDIA H200", "NVIDIA A100-SXM4-40GB"))
