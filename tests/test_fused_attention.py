"""attention="fused" computes what the split loop computes (lecture §4.2), and FLOPs still reconcile."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from orca_torch.model.accounting import counted_flops
from orca_torch.core.batch import SeqWork
from orca_torch.model.orca_model import OrcaModel, generate_alone

MODEL = OrcaModel("tiny", seed=3)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """What torch's varlen_attn computes (causal aligned to the end of each request's keys), written
    per request, so the flat layout the model builds for it can be checked on a CPU."""
    assert window_size == (-1, 0) and enable_gqa and scale == 1.0
    g = q.shape[1] // k.shape[1]
    outs = []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)                       # [H, L, d]
        ki = k[cu_k[i]:cu_k[i + 1]].transpose(0, 1).repeat_interleave(g, 0)
        vi = v[cu_k[i]:cu_k[i + 1]].transpose(0, 1).repeat_interleave(g, 0)
        L, K = qi.shape[1], ki.shape[1]
        assert L <= max_q and K <= max_k
        mask = torch.arange(K)[None, :] > torch.arange(L)[:, None] + (K - L)
        s = (qi @ ki.transpose(1, 2)).masked_fill(mask, float("-inf"))
        outs.append((s.softmax(-1) @ vi).transpose(0, 1))
    return torch.cat(outs)


def run_steps(model, steps, n_slots=6 * 96):
    """Run a list of steps, each a list of (req_id, n_new) with the tokens of a fixed random stream
    per request; return every step's logits."""
    kv = model.new_kv(n_slots)
    g = torch.Generator().manual_seed(7)
    stream = {}
    out = []
    for step in steps:
        ids, works, rids = [], [], []
        for r, n in step:
            if not kv.has(r):
                kv.reserve(r, 96)
                stream[r] = torch.randint(0, model.spec.vocab, (96,), generator=g)
            p = kv.length(r)
            ids.append(stream[r][p:p + n])
            works.append(SeqWork(n, p))
            rids.append(r)
        out.append(model.forward_batch(torch.cat(ids), works, rids, kv))
    return out


steps_strategy = st.lists(
    st.lists(st.tuples(st.integers(0, 5), st.sampled_from([1, 1, 1, 2, 5, 9])), min_size=1, max_size=6,
             unique_by=lambda t: t[0]),
    min_size=1, max_size=6)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps_strategy)
def test_fused_equals_split_on_mixes_of_prompts_chunks_and_decodes(steps):
    split = run_steps(OrcaModel("tiny", seed=3, attention="split"), steps)
    fused = run_steps(OrcaModel("tiny", seed=3, attention="fused"), steps)
    for a, b in zip(split, fused):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), float((a - b).abs().max())
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@settings(max_examples=4, deadline=None)
@given(steps_strategy)
def test_varlen_layout_equals_split(steps):
    """The flat K/V layout, cumulative lengths and write-back the CUDA kernel gets are right."""
    model = OrcaModel("tiny", seed=3, attention="fused")
    model.varlen_kernel = reference_varlen
    split = run_steps(OrcaModel("tiny", seed=3), steps)
    for a, b in zip(split, run_steps(model, steps)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_fused_greedy_generation_equals_split_and_the_switch_is_a_setting():
    model = OrcaModel("tiny", seed=3)
    ref = generate_alone(model, [5, 9, 11, 200], 12)
    model.attention = "fused"
    assert generate_alone(model, [5, 9, 11, 200], 12) == ref
    with pytest.raises(ValueError, match="attention must be one of"):
        model.attention = "flash"
    assert model.attention == "fused"
    with pytest.raises(ValueError, match="attention must be one of"):
        OrcaModel("tiny", attention="paged")


def _decoding_kv(model, pasts):
    kv = model.new_kv(sum(pasts) + 64)
    g = torch.Generator().manual_seed(1)
    for r, p in enumerate(pasts):
        kv.reserve(r, p + 8)
        prompt = torch.randint(0, model.spec.vocab, (p,), generator=g)
        model.forward_batch(prompt, [SeqWork(p, 0)], [r], kv)
    return kv


def test_fused_flops_are_the_padded_decode_rectangle():
    """FlopCounterMode on the fused path counts B x K_max keys for the one-token rows (the padded
    rectangle `executed_works` names), prefills unchanged; the split path counts sum(n_ctx)."""
    pasts = [3, 17, 40]
    works = [SeqWork(1, p) for p in pasts] + [SeqWork(6, 0)]
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])
    counts = {}
    for path in ("split", "fused"):
        model = OrcaModel("tiny", seed=3, attention=path)
        kv = _decoding_kv(model, pasts)
        kv.reserve(3, 8)
        counts[path], _ = counted_flops(model, ids, works, [0, 1, 2, 3], kv)
        assert counts[path] == {**model.spec.step_flops(model.executed_works(works)), "other": 0}
    assert MODEL.executed_works(works) == works
    fused_model = OrcaModel("tiny", seed=3, attention="fused")
    assert fused_model.executed_works(works) == [SeqWork(1, 40)] * 3 + [SeqWork(6, 0)]
    s = MODEL.spec
    pad_pairs = sum(41 - (p + 1) for p in pasts)                   # keys the padding adds
    assert counts["fused"]["attention"] - counts["split"]["attention"] == 4 * s.n_layers * s.n_heads * s.head_dim * pad_pairs
    assert counts["fused"]["linear"] == counts["split"]["linear"]
    assert counts["fused"]["lm_head"] == counts["split"]["lm_head"]


def test_fused_leaves_the_kv_manager_as_split_does():
    pasts = [4, 9]
    stored = []
    for path in ("split", "fused"):
        model = OrcaModel("tiny", seed=3, attention=path)
        kv = _decoding_kv(model, pasts)
        model.forward_batch(torch.tensor([3, 4]), [SeqWork(1, 4), SeqWork(1, 9)], [0, 1], kv)
        assert (kv.length(0), kv.length(1), kv.slots_used) == (5, 10, 15)
        stored.append([kv.storage(r)[..., : kv.length(r), :].clone() for r in (0, 1)])
    for a, b in zip(*stored):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_varlen_kernel_is_taken_only_where_it_takes_the_arguments_passed(monkeypatch):
    """An older torch's `varlen_attn` lacks some keyword arguments the fused paths pass: without
    `enable_gqa` it is called without the flag; without a block table (or a window) the
    model runs the other paths rather than failing at its first step."""
    from torch.nn.attention import varlen

    from orca_torch.model.fused_attention import BLOCK_TABLE_ARGS, torch_varlen_kernel

    cuda, bf16 = torch.device("cuda"), torch.bfloat16

    def oldest(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
        raise AssertionError("not called")

    def no_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        raise AssertionError("not called")

    def flat_only(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                  enable_gqa=False):
        raise AssertionError("not called")

    monkeypatch.setattr(varlen, "varlen_attn", oldest)
    assert torch_varlen_kernel(cuda, bf16) is None
    monkeypatch.setattr(varlen, "varlen_attn", no_gqa)
    assert torch_varlen_kernel(cuda, bf16) not in (None, no_gqa)          # wrapped: `without_gqa_flag`
    assert torch_varlen_kernel(cuda, bf16, BLOCK_TABLE_ARGS) is None
    monkeypatch.setattr(varlen, "varlen_attn", flat_only)
    assert torch_varlen_kernel(cuda, bf16) is flat_only
    assert torch_varlen_kernel(cuda, bf16, BLOCK_TABLE_ARGS) is None
    assert torch_varlen_kernel(torch.device("cpu"), bf16) is None              # (Flash Attention: CUDA only)


def test_a_varlen_kernel_without_gqa_gets_the_kv_heads_as_stored_and_no_flag():
    from orca_torch.model.fused_attention import without_gqa_flag

    def without_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        assert k.shape[1] == v.shape[1] == MODEL.spec.n_kv_heads < q.shape[1]     # no head repeated
        return reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                                enable_gqa=True)

    steps = [[(0, 5), (1, 9)], [(0, 1), (1, 1), (2, 2)], [(2, 1), (3, 5)]]
    model = OrcaModel("tiny", seed=3, attention="fused")
    model.varlen_kernel = without_gqa_flag(without_gqa)
    for a, b in zip(run_steps(OrcaModel("tiny", seed=3), steps), run_steps(model, steps)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
