"""attention="fused" on paged K/V with a kernel that reads block tables (lecture §7; vLLM's
PagedAttention): every request of a step in one kernel call per layer, new K/V written into the
blocks in place, no gather of past K/V; the same tokens and logits as the split loop and as
generation alone. With blocks the kernel cannot take, the gathering path runs instead."""
from __future__ import annotations

import random

import pytest
import torch

from orca_torch.model.accounting import counted_flops
from orca_torch.core.batch import SeqWork
from orca_torch.model.orca_model import OrcaModel, generate_alone
from orca_torch.model.paged_kv_cache import PagedKVManager, PagedStepKV, kernel_takes_blocks


def reference_block_table_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa,
                                 seqused_k, block_table):
    """What torch's `varlen_attn(..., seqused_k=, block_table=)` computes, per request: its first
    `seqused_k[i]` keys gathered from the pools `[n_blocks, block_size, n_kv, d]` by its block
    table, causal aligned to the end of its keys, GQA by repeating each K/V head."""
    assert window_size == (-1, 0) and enable_gqa and scale == 1.0
    assert k.dim() == 4 and block_table.dtype == torch.int32 and seqused_k.dtype == torch.int32
    _, bs, n_kv, d = k.shape
    g = q.shape[1] // n_kv
    outs = []
    for i in range(len(cu_q) - 1):
        K = int(seqused_k[i])
        assert int(cu_k[i + 1] - cu_k[i]) == K and K <= max_k
        blocks = block_table[i, :-(-K // bs)].long()
        ki, vi = (t[blocks].reshape(-1, n_kv, d)[:K].repeat_interleave(g, 1) for t in (k, v))
        qi = q[cu_q[i]:cu_q[i + 1]]
        L = qi.shape[0]
        assert L <= max_q
        s = torch.bmm(qi.transpose(0, 1), ki.permute(1, 2, 0))            # [H, L, K]
        s = s.masked_fill(torch.arange(K)[None] > (K - L + torch.arange(L))[:, None], float("-inf"))
        outs.append(torch.bmm(s.softmax(-1), vi.transpose(0, 1)).transpose(0, 1))
    return torch.cat(outs)


def reference_flat_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """The flat form (no block table): the gathering path's kernel."""
    assert k.dim() == 3
    n = len(cu_q) - 1
    bt = torch.arange(n, dtype=torch.int32)[:, None]
    lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    pad = int(lens.max())
    kp, vp = (torch.stack([t[cu_k[i]:cu_k[i + 1]].new_zeros(pad, *t.shape[1:]).index_copy_(
        0, torch.arange(int(lens[i])), t[cu_k[i]:cu_k[i + 1]]) for i in range(n)]) for t in (k, v))
    return reference_block_table_varlen(q, kp, vp, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                                        enable_gqa=enable_gqa, seqused_k=lens, block_table=bt)


class Calls:
    """A kernel wrapper that records how it was called."""

    def __init__(self, fn):
        self.fn, self.batches = fn, []

    def __call__(self, q, k, v, cu_q, *args, **kw):
        self.batches.append(len(cu_q) - 1)
        return self.fn(q, k, v, cu_q, *args, **kw)


def fused_model(block_kernel=True, flat_kernel=True):
    model = OrcaModel("tiny", seed=5, attention="fused")
    model.block_table_kernel = Calls(reference_block_table_varlen) if block_kernel else None
    model.varlen_kernel = Calls(reference_flat_varlen) if flat_kernel else None
    return model


SPLIT = OrcaModel("tiny", seed=5)


def random_mix(seed: int, n_reqs: int = 4):
    """Prompts of 1..300 tokens, one above 256 (so tables of one and of two 256-token blocks), 1..6 output tokens, and a
    random schedule: each step a random subset of the unfinished requests, each feeding a random
    chunk of its prompt or one decode token."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lens = [rng.randint(1, 300) for _ in range(n_reqs)]
    lens[rng.randrange(n_reqs)] = rng.randint(257, 300)                  # one table of two blocks at least
    prompts = [torch.randint(0, SPLIT.spec.vocab, (n,), generator=g).tolist() for n in lens]
    return prompts, [rng.randint(1, 6) for _ in range(n_reqs)], rng


def run_mix(model, kv, prompts, outs, rng):
    """Drive the mix; return per-step logits, each request's generated tokens and its stored K/V."""
    seqs, fed = [list(p) for p in prompts], [0] * len(prompts)
    done = lambda i: len(seqs[i]) - len(prompts[i]) == outs[i]          # noqa: E731
    for i in range(len(prompts)):
        kv.add(i) if isinstance(kv, PagedKVManager) else kv.reserve(i, len(prompts[i]) + outs[i])
    logits = []
    while not all(done(i) for i in range(len(prompts))):
        live = [i for i in range(len(prompts)) if not done(i)]
        items = rng.sample(live, rng.randint(1, len(live)))
        works, toks = [], []
        for i in items:
            left = len(prompts[i]) - fed[i]
            n = rng.randint(1, left) if left > 0 else 1
            if isinstance(kv, PagedKVManager):
                kv.ensure(i, fed[i] + n)
            works.append(SeqWork(n, fed[i]))
            toks.extend(seqs[i][fed[i]:fed[i] + n])
            fed[i] += n
        out = model.forward_batch(torch.tensor(toks), works, items, kv)
        logits.append(out)
        for i, row in zip(items, out):
            if fed[i] == len(seqs[i]):
                seqs[i].append(int(row.argmax()))
    stored = [kv.gather(0, kv.slots(i, 0, kv.length(i))) if isinstance(kv, PagedKVManager) else None
              for i in range(len(prompts))]
    return logits, [s[len(p):] for s, p in zip(seqs, prompts)], stored


def no_gathers(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the block-table path gathered K/V")
    for name in ("gather_flat", "gather_padded", "split_views"):
        monkeypatch.setattr(PagedStepKV, name, refuse)
    monkeypatch.setattr(PagedStepKV, "ctx", property(refuse))         # not even the context's slots


def test_the_predicate_names_flash_attentions_block_sizes():
    assert [kernel_takes_blocks(b) for b in (16, 128, 255, 256, 512, 768)] == [False] * 3 + [True] * 3
    model = fused_model()
    assert model.step_path(PagedKVManager(model.spec, 4, 256)) == "block_table"
    assert model.step_path(PagedKVManager(model.spec, 4, 16)) == "varlen"
    assert model.step_path(model.new_kv(16)) == "varlen"
    assert model.step_path(PagedKVManager(model.spec, 4, 256), attention="split") == "split"
    assert fused_model(flat_kernel=False).step_path(PagedKVManager(model.spec, 4, 16)) == "batched"
    assert OrcaModel("tiny").block_table_kernel is None                    # CPU: torch's kernel is not used


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_table_path_equals_split_and_generation_alone(seed, monkeypatch):
    prompts, outs, rng = random_mix(seed)
    state = rng.random()
    _, ref_tokens, ref_kv = run_mix(SPLIT, PagedKVManager(SPLIT.spec, 10, 256), prompts, outs, random.Random(state))
    model = fused_model()
    kv = PagedKVManager(model.spec, 10, 256)
    with monkeypatch.context() as m:
        no_gathers(m)
        logits, tokens, stored = run_mix(model, kv, prompts, outs, random.Random(state))
    assert len(model.block_table_kernel.batches) == model.spec.n_layers * len(logits)
    assert model.varlen_kernel.batches == []
    assert model.block_table_kernel.batches[::model.spec.n_layers] == [len(x) for x in logits]
    assert tokens == ref_tokens == [generate_alone(SPLIT, p, n) for p, n in zip(prompts, outs)]
    for (k, v), (k_ref, v_ref) in zip(stored, ref_kv):                    # written in place, same K/V
        assert torch.allclose(k, k_ref, atol=1e-5) and torch.allclose(v, v_ref, atol=1e-5)
    kv.check_invariants()
    assert kv.slots_used == sum(len(p) + n - 1 for p, n in zip(prompts, outs))


@pytest.mark.parametrize("seed", [3, 4])
def test_block_table_logits_equal_split_step_by_step(seed):
    """Same schedule (same rng state) on both: every step's logits agree."""
    prompts, outs, rng = random_mix(seed)
    state = rng.random()
    ref, _, _ = run_mix(SPLIT, SPLIT.new_kv(4 * 310), prompts, outs, random.Random(state))
    got, _, _ = run_mix(fused_model(), PagedKVManager(SPLIT.spec, 10, 256), prompts, outs, random.Random(state))
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), float((a - b).abs().max())


@pytest.mark.parametrize("flat_kernel", [True, False])
def test_small_blocks_fall_back_to_the_gathering_path(flat_kernel):
    prompts, outs, rng = random_mix(5)
    model = fused_model(flat_kernel=flat_kernel)
    kv = PagedKVManager(model.spec, 4 * 20, 16)
    _, tokens, _ = run_mix(model, kv, prompts, outs, rng)
    assert model.block_table_kernel.batches == []
    if flat_kernel:
        assert model.varlen_kernel.batches
    assert tokens == [generate_alone(SPLIT, p, n) for p, n in zip(prompts, outs)]
    kv.check_invariants()


def _decoding(kv, pasts, model):
    g = torch.Generator().manual_seed(2)
    for r, p in enumerate(pasts):
        kv.add(r), kv.ensure(r, p + 1)
        model.forward_batch(torch.randint(0, model.spec.vocab, (p,), generator=g), [SeqWork(p, 0)], [r], kv)


def test_flops_of_the_block_table_path_are_each_requests_own_rectangle():
    """The block-table kernel computes no padding: `executed_works(works, kv)` is `works`, and the
    FLOPs counted on the forward match it; the batched fallback on small blocks pads the decodes."""
    pasts = [3, 270, 40]
    works = [SeqWork(1, p) for p in pasts] + [SeqWork(6, 0)]
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])
    for block_size, flat_kernel in ((256, True), (16, False)):
        model = fused_model(flat_kernel=flat_kernel)
        kv = PagedKVManager(model.spec, 40, block_size)
        _decoding(kv, pasts, model)
        kv.add(3), kv.ensure(3, 6)
        model.block_table_kernel.batches.clear()
        counts, _ = counted_flops(model, ids, works, [0, 1, 2, 3], kv)
        executed = model.executed_works(works, kv)
        assert counts == {**model.spec.step_flops(executed), "other": 0}
        if block_size == 256:
            assert executed == works and model.block_table_kernel.batches == [4] * model.spec.n_layers
        else:
            assert executed == [SeqWork(1, 270)] * 3 + [SeqWork(6, 0)]
