"""The CUDA paths: the check script's contract without a GPU, and the real thing when one is there."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from orca_torch.lab.calibration.refined_fit import not_identified_note
from orca_torch.model.fused_attention import torch_varlen_kernel
from orca_torch.model.orca_model import OrcaModel, generate_alone

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cuda_check", ROOT / "benchmarks" / "cuda_check.py")
cuda_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_check)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_check_without_cuda_says_so_and_fails(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert cuda_check.main(["--out", str(out), "--json"]) == 1     # nothing checked is no pass
    said = capsys.readouterr()
    assert "no CUDA device" in said.err and said.out == ""         # (no half JSON on stdout)
    assert not out.exists()


def test_cuda_check_smoke_on_cpu(tmp_path, capsys):
    out = tmp_path / "c.json"
    threads = torch.get_num_threads()
    assert cuda_check.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads
    r = json.loads(out.read_text())
    assert r["ok"] and len(r["parity"]) == 4
    assert r["machine"]["torch_threads"] == 1                      # (the CPU runs on one thread)
    fp32 = [p for p in r["parity"] if p["dtype"] == "float32"]
    assert all(p["max_abs_diff"] <= 1e-4 and p["rows_compared"] == p["rows"] for p in fp32)
    for e in r["engine"]:
        shares = e["executor_host_share"] + e["scheduler_share"] + e["engine_share"]
        assert abs(shares - 1) < 1e-9 and 0 < e["device_share"] <= 1
    assert {p["step"] for p in r["paper_gpu"]} == {"decode", "prefill"}
    assert all(p["measured_ms"] > 0 and p["predicted_ms"] > 0 and p["kernel_ms"] is None and p["top_ops"] == []
               for p in r["paper_gpu"])
    ref = r["refined_cost_model"]
    assert ref["n_samples"] > len(ref["fitted"]) > 0 and ref["n_held_out"] > 0
    assert set(ref["fitted_params"]) == set(ref["fitted"]) and all(v >= 0 for v in ref["fitted_params"].values())
    for k in ("fit_median_abs_error", "held_out_median_abs_error", "card_params_held_out_median_abs_error"):
        assert 0 <= ref[k] < 10, (k, ref[k])
    out = capsys.readouterr().out
    assert "parity OK" in out
    assert "3. small-llama-shape (0.36M params, float32)" in out     # (it read 0.00B)
    assert r["kernel_gqa"] is None                                 # (no varlen kernel on a CPU)
    if ref["not_identified"]:                                      # (as the measured steps fall)
        assert not_identified_note(ref["not_identified"]) in out   # what those rates' values are


def test_the_kernel_gqa_check_compares_the_heads_as_stored_with_them_repeated(monkeypatch):
    """With a reference kernel standing in for Flash Attention on the CPU: the K/V heads as stored
    and repeated give the same attention; a kernel that ignores the grouping is caught."""
    from test_fused_attention import reference_varlen

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        return reference_varlen(q.float(), k.float(), v.float(), cu_q, cu_k, max_q, max_k,
                                **{**kw, "scale": 1.0}).to(q.dtype)

    monkeypatch.setattr(cuda_check, "torch_varlen_kernel", lambda device, dtype: kernel)
    r = cuda_check.kernel_gqa(torch.device("cpu"), seed=0, repeats=1, batch=4, keys=16)
    assert r["within"] and r["max_abs_diff"] <= 1e-2 and r["as_stored_ms"] > 0 and r["repeated_ms"] > 0

    def first_heads_only(q, k, v, cu_q, cu_k, max_q, max_k, **kw):   # pairs query head h with K/V head h % n_kv
        g = q.shape[1] // k.shape[1]
        return kernel(q, k.repeat(1, g, 1), v.repeat(1, g, 1), cu_q, cu_k, max_q, max_k, **kw)

    monkeypatch.setattr(cuda_check, "torch_varlen_kernel", lambda device, dtype: first_heads_only)
    assert not cuda_check.kernel_gqa(torch.device("cpu"), seed=0, repeats=1, batch=4, keys=16)["within"]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused_and_split_agree_with_the_cpu(dtype):
    """Within cuda_check's stated tolerances (FP32_TOL; BF16_REL_TOL of the reference logits' std)."""
    rows = [r for r in cuda_check.parity(cuda_check.get_model_spec("tiny"), torch.device("cuda"), 0)
            if r["dtype"] == str(dtype).split(".")[1]]
    assert rows and all(r["within"] and r["greedy_equal"] for r in rows)
    if dtype == torch.bfloat16 and torch_varlen_kernel(torch.device("cuda"), dtype) is not None:
        assert any(r["kernel"] == "varlen" for r in rows)


@needs_cuda
def test_cuda_greedy_generation_equals_cpu():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = generate_alone(OrcaModel("tiny", seed=0), prompt, 10)
    for path in ("split", "fused"):
        assert generate_alone(OrcaModel("tiny", seed=0, device="cuda", attention=path), prompt, 10) == ref


@needs_cuda
def test_a_server_s_kv_budget_on_the_card_is_held_to_the_card_s_memory(monkeypatch):
    """The server's K/V on `--device cuda` is made on the card: its budget is checked against the
    card's free memory, not the host's (a budget the card holds is served however little the host
    has free; one past the card is refused when the server starts, not met by an out-of-memory error
    in a step once requests arrive)."""
    import orca_torch.checks as checks
    from orca_torch.serve.server import ServeConfig, build
    from orca_torch.specs import get_model_spec

    free, _ = torch.cuda.mem_get_info()
    per_token = get_model_spec("tiny").kv_bytes_per_token
    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 10**6)           # 1 MB free on the host
    live, _ = build(ServeConfig(model="tiny", device="cuda", kv_slots=free // 4 // per_token))
    live.stop()
    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 10**15)          # 1 PB free on the host
    with pytest.raises(ValueError, match=r"the K/V budget of \d+ tokens \(kv_slots\) on cuda\S* needs [\d,.]+ GB of "
                                         r"memory, but only [\d,.]+ GB is available here"):
        build(ServeConfig(model="tiny", device="cuda", kv_slots=2 * free // per_token))
