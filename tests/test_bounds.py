"""The throughput bounds (`sim.bounds`) on a workload small enough to count by hand."""
from __future__ import annotations

from orca_torch.core.batch import StepTotals
from orca_torch.sim.bounds import ideal_decode_bound, roofline_bound
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
