"""The throughput bounds (`sim.bounds`) on a workload small enough to count by hand."""
from __future__ import annotations

import numpy as np
import pytest

from orca_torch.core.batch import StepTotals
from orca_torch.sim.bounds import ideal_decode_bound, prefill_alone_s, roofline_bound
from orca_torch.sim.hw_model import decode_totals, kv_capacity_tokens, pricer
from orca_torch.specs import get_model_spec

# Two requests: prompts of 100 and 300 tokens, 11 and 21 output tokens. Their decodes (the output
# tokens after the first) read contexts 101..110 and 301..320: 1,055 + 6,210 = 7,265 tokens in 30 decodes.
PROMPTS, OUTPUTS = [100, 300], [11, 21]


def test_the_ideal_decode_bound_is_the_workload_s_mean_decode_context_at_the_batch_memory_holds():
    ideal = ideal_decode_bound("llama-3-8b", "h100", PROMPTS, OUTPUTS)
    slots = kv_capacity_tokens("llama-3-8b", "h100")
    assert ideal["context_tokens"] == round(7265 / 30) == 242
    assert ideal["batch"] == slots // 242 and ideal["kv_slots"] == slots
    assert ideal["step_s"] == pricer("llama-3-8b", "h100").time(decode_totals(slots // 242, 242))
    assert ideal["tok_s"] == ideal["batch"] / ideal["step_s"]


def test_the_roofline_bound_counts_every_prefill_and_decode_flop():
    ideal = ideal_decode_bound("llama-3-8b", "h100", PROMPTS, OUTPUTS)
    bound = roofline_bound("llama-3-8b", "h100", PROMPTS, OUTPUTS, ideal)
    prefills = StepTotals(2, 400, 400, 100 * 100 + 300 * 300, 100 * 101 // 2 + 300 * 301 // 2)
    decodes = StepTotals(30, 30, 7265, 7265, 7265)
    assert bound["all_flops_s"] == pricer("llama-3-8b", "h100").cost(prefills + decodes).compute_s
    assert bound["decode_only_s"] == 30 / ideal["tok_s"]
    assert bound["tok_s"] == 32 / max(bound["all_flops_s"], bound["decode_only_s"])


def test_prefill_alone_is_the_sum_of_each_prompt_s_roofline():
    """Each prompt alone, by hand: Llama-3-8B's 218,103,808 matmul weights a layer (Q, O 4096^2; K, V
    4096 x 1024; SwiGLU 3 x 4096 x 14336), n^2 score pairs at 4 x 4096 FLOPs a layer, one LM-head row;
    against the weights and the prompt's K/V at 80% of 3.35 TB/s. 100 tokens are memory-bound, 300 not."""
    def sides(n: int) -> tuple[float, float]:
        flops = 2 * n * 32 * 218_103_808 + 4 * 32 * 4096 * n * n + 2 * 4096 * 128256
        return flops / (989.4e12 * 0.7), (8_030_261_248 * 2 + n * 131072) / (0.8 * 3.35e12)
    (c1, m1), (c3, m3) = sides(100), sides(300)
    assert c1 < m1 and c3 > m3
    assert prefill_alone_s("llama-3-8b", "h100", PROMPTS) == pytest.approx(m1 + c3, rel=1e-9)


def test_the_decode_context_is_the_mean_over_every_decode_rounded_to_the_nearest_token():
    """Prompts 10 and 20, outputs 3 and 2: decodes at contexts 11, 12 and 21, a mean of 44/3 = 14.67,
    15 tokens; and on random workloads, the mean counted decode by decode is within half a token."""
    assert ideal_decode_bound("llama-3-8b", "h100", [10, 20], [3, 2])["context_tokens"] == 15
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 6))
        prompts, outputs = rng.integers(1, 2000, n).tolist(), rng.integers(2, 500, n).tolist()
        contexts = [p + j for p, o in zip(prompts, outputs) for j in range(1, o)]
        mean = sum(contexts) / len(contexts)
        got = ideal_decode_bound("llama-3-8b", "h100", prompts, outputs)["context_tokens"]
        assert abs(got - mean) <= 0.5, (prompts, outputs, mean, got)


def test_max_bs_caps_the_ideal_batch_and_only_caps_it():
    free = ideal_decode_bound("llama-3-8b", "h100", PROMPTS, OUTPUTS)
    capped = ideal_decode_bound("llama-3-8b", "h100", PROMPTS, OUTPUTS, max_bs=8)
    assert free["batch"] > 8 and capped["batch"] == 8
    assert capped["step_s"] == pricer("llama-3-8b", "h100").time(decode_totals(8, 242))
    assert ideal_decode_bound("llama-3-8b", "h100", PROMPTS, OUTPUTS, max_bs=10 * free["batch"]) == free


def test_the_bounds_price_with_the_cost_model_they_are_given():
    """The refined model counts the causal pairs of the prefills (n (n + 1) / 2 a prompt), which the
    roofline's full attention does not: each bound equals the refined pricer's own figure."""
    refined = pricer("llama-3-8b", "h100", cost_model="refined")
    ideal = ideal_decode_bound("llama-3-8b", "h100", PROMPTS, OUTPUTS, cost_model="refined")
    assert ideal["step_s"] == refined.time(decode_totals(ideal["batch"], 242))
    bound = roofline_bound("llama-3-8b", "h100", PROMPTS, OUTPUTS, ideal, cost_model="refined")
    prefills = StepTotals(2, 400, 400, 100 * 100 + 300 * 300, 100 * 101 // 2 + 300 * 301 // 2)
    decodes = StepTotals(30, 30, 7265, 7265, 7265)
    assert bound["all_flops_s"] == refined.cost(prefills + decodes).compute_s
    assert bound["all_flops_s"] != pricer("llama-3-8b", "h100").cost(prefills + decodes).compute_s
    assert prefill_alone_s("llama-3-8b", "h100", PROMPTS, cost_model="refined") == pytest.approx(
        sum(refined.time(StepTotals(1, p, p, p * p, p * (p + 1) // 2)) for p in PROMPTS), rel=1e-12)


def test_a_request_that_fills_the_context_exactly_is_bounded():
    """prompt + output <= max_context, as the engine admits a request."""
    ctx = get_model_spec("llama-3-8b").max_context
    ideal = ideal_decode_bound("llama-3-8b", "h100", [ctx - 100], [100])
    assert ideal["context_tokens"] == ctx - 100 + 50
    assert roofline_bound("llama-3-8b", "h100", [ctx - 100], [100], ideal)["tok_s"] > 0


def test_prefill_alone_prices_every_prompt_even_one_of_the_whole_context():
    """Two equal prompts cost twice one; a prompt as long as the context is a prompt the engine admits."""
    one = prefill_alone_s("llama-3-8b", "h100", [100])
    assert prefill_alone_s("llama-3-8b", "h100", [100, 100]) == pytest.approx(2 * one, rel=1e-12)
    ctx = get_model_spec("llama-3-8b").max_context
    assert prefill_alone_s("llama-3-8b", "h100", [ctx]) == pricer("llama-3-8b", "h100").time(
        StepTotals(1, ctx, ctx, ctx * ctx, ctx * (ctx + 1) // 2))
