"""Experiment 08 (paged K/V vs Orca's reservation on the paper GPU), on its --quick form, in process."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_docs import page_text

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "08_paged_kv.py"


def load():
    spec = importlib.util.spec_from_file_location("paged_kv_experiment", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def e08():
    mod = load()
    return mod.main(["--quick", "--json"]), mod


def test_token_states_paged_near_all_and_orca_max_far_below(e08):
    res, _ = e08
    tsf = res["token_state_fraction"]
    assert set(tsf) >= {"orca_max", "orca_pow2", "orca_oracle", "paged"}
    assert tsf["paged"] > 0.9 and tsf["orca_max"] < 0.4
    for setup in res["setups"].values():
        t = setup["token_state_fraction"]
        assert t["orca_max"] < t["orca_pow2"] < t["orca_oracle"] < t["paged"] <= 1.0
        assert 1 - t["paged"] < 16 / 1000                  # only block tails: < 16 slots per ~1K-token request


def test_the_page_quotes_the_quick_figure(e08):
    """docs/experiments/08-paged-kv.md quotes the full run, and names what `--quick` gives instead."""
    res, _ = e08
    share = res["setups"]["opt13b_a100"]["token_state_fraction"]["orca_max"]
    assert f"gives, for instance, {share:.1%} for Orca (Max) on OPT-13B" in page_text("docs/experiments/08-paged-kv.md")


def test_preemption_cost_recompute_vs_swap_on_the_memory_bound_setup(e08):
    res, _ = e08
    rows = res["setups"]["opt13b_a100"]["sweep"]
    top = max(r["rate_req_s"] for r in rows)
    at = {r["system"]: r for r in rows if r["rate_req_s"] == top}
    assert at["paged"]["n_preemptions"] > 0 and at["paged"]["recompute_tokens"] > 0 and at["paged"]["swap_bytes"] == 0
    assert at["paged_swap"]["n_swap_out"] > 0 and at["paged_swap"]["swap_s"] > 0
    assert at["paged_swap"]["swap_bytes"] % (2 * 40 * 5120 * 2) == 0   # whole tokens of OPT-13B K/V
    for name in ("orca_max", "orca_pow2", "orca_oracle"):
        assert at[name]["n_preemptions"] == 0                  # a reservation never runs out
    assert at["paged"]["mean_batch"] > at["orca_oracle"]["mean_batch"] > at["orca_max"]["mean_batch"]
    assert at["paged"]["throughput_tok_s"] > at["orca_max"]["throughput_tok_s"]


def test_same_seed_same_figures_and_the_plots(e08, tmp_path):
    pytest.importorskip("matplotlib")
    res, mod = e08
    again = mod.main(["--quick", "--json", "--seed", "0", "--plot", str(tmp_path)])
    assert again == res
    assert sorted(p.name for p in tmp_path.iterdir()) == ["08_kv_composition_llama3_8b_h100.png",
                                                          "08_kv_composition_opt13b_a100.png"]
