"""The throughput bounds (`sim.bounds`) on a workload small enough to count by hand."""
from __future__ import annotations

import pytest

from orca_torch.core.batch import StepTotals
from orca_torch.sim.bounds import ideal_decode_bound, prefill_alone_s, roofline_bound
from orca_torch.sim.hw_model import decode_totals, kv_capacity_tokens, pricer

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
