"""The paper GPU: an explicit K/V budget must fit beside the weights, with both numbers said; bools are not
numbers; priced totals must be a real step's; no request reaches past the model's context."""
from __future__ import annotations

import numpy as np
import pytest

from orca_torch.batch import SeqWork, StepTotals
from orca_torch.hw_model import (GPUSpec, Partition, RefinedParams, causal_tile_pairs, decode_profile, decode_totals,
                                 kv_capacity_tokens, max_batch_within, max_requests, memory_plan, pricer, step_cost)
from orca_torch.hw_model.__main__ import main as hw_main
from orca_torch.hw_model.links import LinkSpec
from orca_torch.specs import get_model_spec

LLAMA, H100 = "llama-3-8b", "h100"

def test_kv_budget_larger_than_the_card_is_refused_with_both_numbers():
    with pytest.raises(ValueError) as exc:
        memory_plan("llama-3-8b", "h100", kv_budget_bytes=1000 * 2**30)
    msg = str(exc.value)
    assert "1073.74 GB (1000.00 GiB)" in msg and "16.06 GB of weights" in msg and "h100 has 80 GB" in msg
    assert "at most 63.94 GB" in msg
    with pytest.raises(ValueError, match="the weights alone do not fit: raise tp or pp"):
        kv_capacity_tokens("gpt3-175b", "h100", kv_budget_bytes=2**30)
    with pytest.raises(ValueError, match="kv_budget_bytes must be a finite number of bytes > 0, got True"):
        memory_plan("llama-3-8b", "h100", kv_budget_bytes=True)


def test_kv_budget_that_exactly_fills_the_card_is_accepted():
    plan = memory_plan("llama-3-8b", "h100")
    room = 80e9 - plan.weight_bytes_per_device
    full = memory_plan("llama-3-8b", "h100", kv_budget_bytes=room)
    assert full.kv_tokens == int(room // get_model_spec("llama-3-8b").kv_bytes_per_token)
    with pytest.raises(ValueError):
        memory_plan("llama-3-8b", "h100", kv_budget_bytes=room + 1)
    # under tp=2 each card holds half the weights, so the same budget fits
    assert memory_plan("llama-3-8b", "h100", tp=2, kv_budget_bytes=room + 1).kv_tokens > full.kv_tokens


def test_hw_model_cli_exits_2_on_an_impossible_kv_budget(capsys):
    with pytest.raises(SystemExit) as exc:
        hw_main(["--kv-budget-gib", "1000"])
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and "does not fit beside llama-3-8b's 16.06 GB of weights" in out.err


# ---- a bool is not a number -----------------------------------------------------------------------------

@pytest.mark.parametrize("call, says", [
    (lambda: kv_capacity_tokens(LLAMA, H100, True), "mem_fraction must be a finite number in (0, 1], got True (a bool)"),
    (lambda: max_batch_within(LLAMA, H100, True, 512), "budget_s must be a finite number of seconds > 0, got True"),
    (lambda: max_batch_within(LLAMA, H100, 0.02, True), "context (at most llama-3-8b's max context) must be an integer"),
    (lambda: max_requests(LLAMA, H100, True), "reserve_tokens (at most llama-3-8b's max context) must be an integer"),
    (lambda: decode_totals(True, 512), "batch must be an integer >= 0, got True (a bool)"),
    (lambda: decode_totals(4, np.bool_(True)), "context must be an integer >= 2, got True (a bool)"),
    (lambda: decode_profile(LLAMA, H100, True), "context (at most llama-3-8b's max context) must be an integer"),
    (lambda: pricer(LLAMA, H100, flop_efficiency=True), "flop_efficiency must be a finite number in (0, 1], got True"),
    (lambda: pricer(LLAMA, H100, bw_efficiency=True), "bw_efficiency must be a finite number in (0, 1], got True"),
    (lambda: pricer(LLAMA, H100, overhead_s=False), "overhead_s must be a finite number of seconds >= 0, got False"),
    (lambda: pricer(LLAMA, H100, pp=True), "pp must be an integer >= 1, got True (a bool)"),
    (lambda: pricer(LLAMA, H100, cost_model="refined", attention_tile=True), "attention_tile must be an integer >= 1"),
    (lambda: pricer(LLAMA, H100, count_activations=1), "count_activations must be True or False, got 1"),
    (lambda: Partition(get_model_spec(LLAMA), True), "tp must be an integer >= 1, got True (a bool)"),
    (lambda: GPUSpec("x", True, 1e12, 1e9), "GPUSpec.peak_flops must be a finite number > 0, got True"),
    (lambda: GPUSpec("x", 1e12, 1e12, 1e9, gpus_per_node=True), "GPUSpec.gpus_per_node must be an integer >= 1"),
    (lambda: GPUSpec("x", 1e12, 1e12, 1e9, bw_efficiency=True), "GPUSpec.bw_efficiency must be a finite number in"),
    (lambda: GPUSpec("x", 1e12, 1e12, 1e9, nvlink_bw=-1.0), "GPUSpec.nvlink_bw must be a finite number of bytes/s > 0"),
    (lambda: GPUSpec("x", 1e12, 1e12, 1e9, ib_latency_s=-1e-6), "GPUSpec.ib_latency_s must be a finite number of "
                                                                 "seconds >= 0"),
    (lambda: RefinedParams(overlap=True), "RefinedParams.overlap must be a finite number in [1, 64], got True"),
    (lambda: RefinedParams(attention_tile=True), "RefinedParams.attention_tile must be an integer >= 1, got True"),
    (lambda: causal_tile_pairs([SeqWork(4)], True), "tile must be an integer >= 1, got True (a bool)"),
    (lambda: LinkSpec("l", True, 1e-6), "LinkSpec.bandwidth must be a finite number of bytes/s > 0, got True"),
    (lambda: LinkSpec("l", 1e9, "1"), "LinkSpec.latency_s must be a finite number of seconds >= 0, got '1' (str)"),
])
def test_bools_and_non_numbers_are_refused_by_name(call, says):
    with pytest.raises(ValueError) as e:
        call()
    assert says in str(e.value)


def test_a_bool_never_finds_the_pricer_cached_for_its_integer():
    assert pricer(LLAMA, H100, tp=1).tp == 1     # cached under tp=1, and True == 1 as a key
    with pytest.raises(ValueError, match=r"tp must be an integer >= 1, got True \(a bool\)"):
        pricer(LLAMA, H100, tp=True)
    assert pricer(LLAMA, H100, flop_efficiency=1.0).tp == 1
    with pytest.raises(ValueError, match="flop_efficiency must be a finite number"):
        pricer(LLAMA, H100, flop_efficiency=True)


# ---- priced totals must be a real step's ------------------------------------------------------------------

@pytest.mark.parametrize("totals, says", [
    (StepTotals("1", 2, 3, 3, 3), "StepTotals.n_seqs must be an integer >= 0, got '1' (str)"),
    (StepTotals(True, True, True, True, True), "StepTotals.n_seqs must be an integer >= 0, got True (a bool)"),
    (StepTotals(1, 1, 3, np.bool_(True), 3), "StepTotals.attn_pairs_full must be an integer >= 0, got True (a bool)"),
    (StepTotals(1.5, 2.0, 3, 3, 3), "StepTotals.n_seqs must be an integer >= 0, got 1.5"),
    (StepTotals(1, 2.0, 3, 3, 3), "StepTotals.n_tokens must be an integer >= 0, got 2.0"),
    (StepTotals(1, 1, 10, 5, 50), "n_tokens <= attn_pairs_causal <= attn_pairs_full"),   # causal > full
    (StepTotals(1, 1, 0, 0, 0), "need n_seqs <= n_tokens <= kv_read_tokens"),
    (StepTotals(1, 4, 10, 40, 2), "n_tokens <= attn_pairs_causal"),                        # fewer pairs than tokens
    (StepTotals(0, 0, 5, 5, 5), "every field 0 when n_seqs == 0"),
])
def test_inconsistent_or_non_integer_totals_are_refused_by_both_cost_models(totals, says):
    for cost_model in ("roofline", "refined"):
        with pytest.raises(ValueError) as e:
            step_cost(LLAMA, H100, totals, cost_model=cost_model)
        assert says in str(e.value)


# ---- nothing reaches past the model's context ------------------------------------------------------------

def test_contexts_beyond_the_models_are_refused_naming_its_max_context():
    with pytest.raises(ValueError, match=r"context \(at most llama-3-8b's max context\) must be an integer in "
                                         r"\[2, 8192\], got 1000000$"):
        max_batch_within(LLAMA, H100, 0.02, 10**6)
    with pytest.raises(ValueError, match=r"in \[2, 8192\], got 8193$"):
        decode_profile(LLAMA, H100, 8193)
    for cost_model in ("roofline", "refined"):
        with pytest.raises(ValueError, match=r"works\[1\]: n_past \+ n_new \(at most llama-3-8b's max context\) "
                                             r"must be an integer in \[1, 8192\], got 100001$"):
            step_cost(LLAMA, H100, [SeqWork(1, 10), SeqWork(1, 100000)], cost_model=cost_model)
