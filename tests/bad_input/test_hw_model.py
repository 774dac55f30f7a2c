"""The paper GPU's memory plan: an explicit K/V budget must fit beside the weights, with both numbers said."""
from __future__ import annotations

import pytest

from orca_torch.hw_model import kv_capacity_tokens, memory_plan
from orca_torch.hw_model.__main__ import main as hw_main
from orca_torch.specs import get_model_spec

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
