"""The torch paged K/V manager: blocks on demand, in-place writes, gathers, swap, errors that change nothing."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from orca_torch.model.paged_kv_cache import OutOfBlocksError, PagedKVManager, kernel_takes_blocks
from orca_torch.specs import get_model_spec

SPEC = get_model_spec("tiny")


def kv_rows(n, seed):
    """n tokens of K/V for every layer, `[n_layers, n, 2, n_kv, d]`, distinct per seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SPEC.n_layers, n, 2, SPEC.n_kv_heads, SPEC.head_dim, generator=g)


def append(kv, rid, rows):
    """Write `rows` after what `rid` stores, in every layer, and commit them."""
    n_past, n = kv.length(rid), rows.shape[1]
    assert kv.can_append(rid, n_past, n)
    slots = kv.slots(rid, n_past, n_past + n)
    for layer in range(SPEC.n_layers):
        kv.write(layer, slots, rows[layer])
    kv.commit(rid, n)


def holding(kv, rid, n, seed, room=None):
    """Add `rid` with blocks for `room` tokens (default `n`), write `kv_rows(n, seed)` after it and return them."""
    kv.add(rid)
    kv.ensure(rid, n if room is None else room)
    rows = kv_rows(n, seed)
    append(kv, rid, rows)
    return rows


def stored(kv, rid):
    slots = kv.slots(rid, 0, kv.length(rid))
    return torch.stack([torch.stack(kv.gather(layer, slots), dim=1) for layer in range(SPEC.n_layers)])


def test_blocks_come_as_the_request_grows_and_reads_cross_block_boundaries():
    kv = PagedKVManager(SPEC, n_blocks=8, block_size=4)
    kv.add("a")
    kv.ensure("a", 5)
    assert len(kv.block_table("a")) == 2 and kv.capacity("a") == 8
    rows = kv_rows(5, 0)
    append(kv, "a", rows)
    kv.ensure("a", 11)
    more = kv_rows(6, 1)
    append(kv, "a", more)
    assert kv.length("a") == 11 and len(kv.block_table("a")) == 3
    assert torch.equal(stored(kv, "a"), torch.cat([rows, more], dim=1))
    assert (kv.slots_used, kv.slots_reserved, kv.blocks_free) == (11, 12, 5)


def test_writing_past_the_allocated_blocks_is_an_error_and_writes_nothing():
    kv = PagedKVManager(SPEC, n_blocks=4, block_size=4)
    holding(kv, "a", 3, seed=0, room=4)
    before = kv.pool.clone()
    assert kv.can_append("a", 3, 1) and not kv.can_append("a", 3, 2) and not kv.can_append("a", 2, 1)
    with pytest.raises(AssertionError, match=r"^request 'a': tokens 3\.\.5 lie outside its 1 block; only tokens 0\.\.4 "
                                             r"fit \(ensure more blocks first\)$"):
        kv.slots("a", 3, 5)                     # the model's side trusts can_append
    with pytest.raises(AssertionError, match=r"^request 'a': committing 2 tokens after 3 exceeds its 1 block, room "
                                             r"for 4 tokens \(ensure more blocks first\)$"):
        kv.commit("a", 2)
    with pytest.raises(AssertionError, match=r"^request 'a': committing -1 tokens \(a commit stores 0 or more\)$"):
        kv.commit("a", -1)                      # not an overflow: said as what it is
    assert torch.equal(kv.pool, before) and kv.length("a") == 3


def test_running_out_of_blocks_changes_nothing():
    kv = PagedKVManager(SPEC, n_blocks=3, block_size=4)
    kv.add("a"), kv.add("b")
    kv.ensure("a", 8)
    with pytest.raises(OutOfBlocksError, match="^request 'b' needs 2 more blocks for 8 tokens but only 1 of 3 are free$"):
        kv.ensure("b", 8)
    assert kv.block_table("b") == [] and kv.blocks_free == 1
    kv.check_invariants()


def test_unknown_requests_and_double_free_fail_assertions():
    kv = PagedKVManager(SPEC, n_blocks=3, block_size=4)
    with pytest.raises(AssertionError, match="^unknown request 'x': never added, or freed already; add it first$"):
        kv.length("x")
    with pytest.raises(AssertionError, match=r"^cannot free request 'x': it holds no blocks \(never added, or freed "
                                             r"already\); free each added request once$"):
        kv.free("x")
    kv.add("a")
    with pytest.raises(AssertionError, match=r"^request 'a' is already held \(on the device or swapped out\); free it "
                                             r"first$"):
        kv.add("a")
    kv.free("a")
    with pytest.raises(AssertionError, match=r"^cannot free request 'a': it holds no blocks \(never added, or freed "
                                             r"already\); free each added request once$"):
        kv.free("a")
    with pytest.raises(AssertionError, match="^unknown request 'a': never added, or freed already; add it first$"):
        kv.ensure("a", 1)
    with pytest.raises(AssertionError, match="^cannot swap in request 'a': it is not swapped out; only a request "
                                             "swap_out moved to the CPU pool can be swapped in$"):
        kv.swap_in("a")
    with pytest.raises(ValueError, match="^n_blocks must be an integer >= 1, got 0$"):
        PagedKVManager(SPEC, n_blocks=0)


def test_swap_moves_blocks_to_the_cpu_pool_and_back_into_other_blocks():
    kv = PagedKVManager(SPEC, n_blocks=3, block_size=4, cpu_blocks=2)
    rows = holding(kv, "a", 6, seed=3)
    assert kv.swap_out("a") == 6
    assert kv.is_swapped("a") and not kv.has("a") and kv.blocks_free == 3 and kv.cpu_blocks_free == 0
    with pytest.raises(AssertionError, match="^request 'a' is swapped out; swap it in first$"):
        kv.length("a")
    holding(kv, "b", 5, seed=4)                     # b reuses a's old blocks and overwrites them
    with pytest.raises(OutOfBlocksError, match="needs 2 blocks"):
        kv.swap_in("a")                             # 1 free
    assert kv.is_swapped("a")
    kv.free("b")
    assert kv.swap_in("a") == 6
    assert torch.equal(stored(kv, "a"), rows) and kv.cpu_blocks_free == 2
    kv.check_invariants()


def test_swap_out_into_a_full_cpu_pool_is_an_error_and_changes_nothing():
    kv = PagedKVManager(SPEC, n_blocks=3, block_size=4, cpu_blocks=1)
    holding(kv, "a", 6, seed=0)
    with pytest.raises(OutOfBlocksError, match="CPU blocks"):
        kv.swap_out("a")
    assert kv.has("a") and kv.length("a") == 6 and kv.cpu_blocks_free == 1


def test_swapped_request_can_be_freed_from_the_cpu_pool():
    kv = PagedKVManager(SPEC, n_blocks=2, block_size=4, cpu_blocks=2)
    holding(kv, "a", 3, seed=0)
    kv.swap_out("a")
    kv.free("a")
    assert kv.cpu_blocks_free == 2 and kv.blocks_free == 2
    kv.check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("aeworif"), st.integers(0, 3), st.integers(1, 7)), max_size=40))
def test_no_request_ever_reads_or_corrupts_another_requests_blocks(ops):
    """Random adds, growths, writes, swaps and frees against a plain per-request shadow copy."""
    kv = PagedKVManager(SPEC, n_blocks=6, block_size=3, cpu_blocks=4)
    shadow: dict = {}
    seed = 0
    for op, i, n in ops:
        rid = f"r{i}"
        seed += 1
        if op == "a" and rid not in shadow:
            kv.add(rid)
            shadow[rid] = kv_rows(0, 0)
        elif op == "e" and kv.has(rid):
            try:
                kv.ensure(rid, kv.length(rid) + n)
            except OutOfBlocksError:
                pass
        elif op == "w" and kv.has(rid):
            room = kv.capacity(rid) - kv.length(rid)
            if room:
                rows = kv_rows(min(n, room), seed)
                append(kv, rid, rows)
                shadow[rid] = torch.cat([shadow[rid], rows], dim=1)
        elif op == "o" and kv.has(rid):
            try:
                kv.swap_out(rid)
            except OutOfBlocksError:
                assert kv.has(rid)
        elif op == "i" and kv.is_swapped(rid):
            try:
                kv.swap_in(rid)
            except OutOfBlocksError:
                assert kv.is_swapped(rid)
        elif op == "f" and rid in shadow:
            kv.free(rid)
            del shadow[rid]
        kv.check_invariants()
        for r, want in shadow.items():
            if kv.has(r):
                assert torch.equal(stored(kv, r), want)
    for r in list(shadow):
        kv.free(r)
    kv.check_invariants()
    assert kv.blocks_free == 6 and kv.cpu_blocks_free == 4


def test_off_cuda_the_model_gathers_paged_kv_instead_of_a_block_table_kernel():
    from orca_torch.model.orca_model import OrcaModel
    model = OrcaModel("tiny", attention="fused")
    assert model.block_table_kernel is None and model.varlen_kernel is None
    assert model.step_path(PagedKVManager(SPEC, n_blocks=2, block_size=256)) == "batched"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (varlen attention with a block table)")
def test_block_table_attention_on_cuda_equals_plain_attention():
    from orca_torch.model.fused_attention import BLOCK_TABLE_ARGS, block_table_attention, torch_varlen_kernel
    from orca_torch.model.paged_kv_cache import PagedStepKV
    dt = torch.bfloat16
    kernel = torch_varlen_kernel(torch.device("cuda"), dt, BLOCK_TABLE_ARGS)
    if kernel is None:
        pytest.skip(f"torch {torch.__version__}'s varlen_attn takes no block table")
    kv = PagedKVManager(SPEC, n_blocks=8, block_size=256, device="cuda", dtype=dt)
    kv.add("pad"), kv.ensure("pad", 300)                          # so the tables do not start at block 0
    g = torch.Generator().manual_seed(0)
    sizes, past = [5, 1, 3], [0, 290, 17]
    for i, (n, p) in enumerate(zip(sizes, past)):
        kv.add(i), kv.ensure(i, p + n)
        append(kv, i, torch.randn(SPEC.n_layers, p, 2, SPEC.n_kv_heads, SPEC.head_dim, generator=g).to("cuda", dt))
    q = torch.randn(sum(sizes), SPEC.n_heads, SPEC.head_dim, generator=g).to("cuda", dt) / SPEC.head_dim ** 0.5
    kv_new = torch.randn(sum(sizes), 2, SPEC.n_kv_heads, SPEC.head_dim, generator=g).to("cuda", dt)
    bt = PagedStepKV(kv, [0, 1, 2], past, sizes).block_table_layout()
    out = block_table_attention(0, q, kv_new, bt, kernel).view(q.shape)
    grp = SPEC.n_heads // SPEC.n_kv_heads
    for i, (qi, oi) in enumerate(zip(q.split(sizes), out.split(sizes))):
        k, v = kv.gather(0, kv.slots(i, 0, past[i] + sizes[i]))
        assert torch.equal(k[past[i]:], kv_new.split(sizes)[i][:, 0])          # written in place
        k, v = k.repeat_interleave(grp, 1).float(), v.repeat_interleave(grp, 1).float()
        s = torch.einsum("qhd,khd->hqk", qi.float(), k)
        rows = past[i] + torch.arange(sizes[i], device="cuda")
        mask = torch.arange(k.shape[0], device="cuda")[None] > rows[:, None]
        ref = torch.einsum("hqk,khd->qhd", s.masked_fill(mask, float("-inf")).softmax(-1), v)
        assert torch.allclose(oi.float(), ref, atol=2e-2, rtol=2e-2)


# ---- the torch model reading and writing K/V through block tables ------------------------------------

from orca_torch.core.batch import SeqWork  # noqa: E402
from orca_torch.model.orca_model import OrcaModel  # noqa: E402
from tiny_model import MODEL, alone  # noqa: E402


def drive(kv, prompts, n_out, choices, preempt):
    """Random steps over the requests: each step takes a subset, feeds each a prompt chunk or one
    decode, and between steps may swap a request out (`preempt="swap"`, back in at its next step) or
    drop its K/V and restart it (`"recompute"`). Returns each request's greedy tokens."""
    out = {i: [] for i in range(len(prompts))}
    fed = {i: 0 for i in range(len(prompts))}                 # tokens whose K/V is stored
    for i in out:
        kv.add(i)
    it = iter(choices)
    while any(len(out[i]) < n_out[i] for i in out):
        works, ids, toks = [], [], []
        for i in out:
            if len(out[i]) >= n_out[i] or next(it, 1) == 0:
                continue
            if kv.is_swapped(i):
                kv.swap_in(i)
            seq = prompts[i] + out[i]
            if fed[i] < len(prompts[i]):                       # a chunk of the prompt (or of the recompute)
                n = max(1, min(len(seq) - fed[i], next(it, 3)))
            else:
                n = len(seq) - fed[i]                          # 1: a decode
            kv.ensure(i, fed[i] + n)
            works.append(SeqWork(n, fed[i])), ids.append(i), toks.extend(seq[fed[i]:fed[i] + n])
            fed[i] += n
        if not works:
            continue
        logits = MODEL.forward_batch(torch.tensor(toks), works, ids, kv)
        for i, w, row in zip(ids, works, logits):
            if w.n_past + w.n_new == len(prompts[i]) + len(out[i]):
                out[i].append(int(row.argmax()))
        kv.check_invariants()
        victim = next(it, 0) - 1
        if preempt and 0 <= victim < len(prompts) and kv.has(victim) and len(out[victim]) < n_out[victim]:
            if preempt == "swap" and kv.cpu_blocks_free * kv.block_size >= kv.length(victim):
                kv.swap_out(victim)
            else:
                kv.free(victim)
                kv.add(victim)
                fed[victim] = 0
                prompts[victim] = prompts[victim] + out[victim]      # re-feed prompt + output so far
                n_out[victim] -= len(out[victim])
                out[victim] = []
    return out


@settings(max_examples=6, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 6)), min_size=1, max_size=4),
       st.lists(st.integers(0, 4), min_size=20, max_size=60), st.sampled_from([None, "swap", "recompute"]),
       st.sampled_from([1, 3, 4]))
def test_paged_model_tokens_equal_generation_alone(reqs, choices, preempt, block_size):
    g = torch.Generator().manual_seed(len(choices))
    prompts = [torch.randint(0, MODEL.spec.vocab, (p,), generator=g).tolist() for p, _ in reqs]
    want = [alone(p, o) for p, (_, o) in zip(prompts, reqs)]
    kv = PagedKVManager(MODEL.spec, 64, block_size, cpu_blocks=16)
    prompts_now, n_out = list(prompts), [o for _, o in reqs]
    out = drive(kv, prompts_now, n_out, choices, preempt)
    for i in range(len(reqs)):   # a recompute folded the tokens generated before it into the prompt
        assert prompts_now[i][len(prompts[i]):] + out[i] == want[i]
    for i in range(len(reqs)):
        if kv.has(i) or kv.is_swapped(i):
            kv.free(i)
    kv.check_invariants()
    assert kv.blocks_free == 64 and kv.cpu_blocks_free == 16


def test_padded_reference_reads_paged_kv_too():
    kv = PagedKVManager(MODEL.spec, 16, 4)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8]]
    for i, p in enumerate(prompts):
        kv.add(i), kv.ensure(i, len(p) + 1)
    works = [SeqWork(len(p), 0) for p in prompts]
    logits = MODEL.forward_padded(torch.tensor(sum(prompts, [])), works, [0, 1], kv)
    assert [int(x) for x in logits.argmax(-1)] == [alone(p, 1)[0] for p in prompts]


def _step(kv, seqs, fed, ids):
    """One forward for requests `ids`: each feeds everything of `seqs[i]` not yet stored; the greedy
    token of each is appended to its sequence."""
    works, toks = [], []
    for i in ids:
        n = len(seqs[i]) - fed[i]
        kv.ensure(i, fed[i] + n)
        works.append(SeqWork(n, fed[i]))
        toks.extend(seqs[i][fed[i]:])
        fed[i] += n
    logits = MODEL.forward_batch(torch.tensor(toks), works, ids, kv)
    for i, row in zip(ids, logits):
        seqs[i].append(int(row.argmax()))


@pytest.mark.parametrize("preempt", ["swap", "recompute"])
def test_paged_model_survives_preemption_while_others_reuse_the_blocks(preempt):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, MODEL.spec.vocab, (p,), generator=g).tolist() for p in (7, 5, 6)]
    kv = PagedKVManager(MODEL.spec, 24, 2, cpu_blocks=8)
    seqs, fed = [list(p) for p in prompts], [0, 0, 0]
    for i in range(3):
        kv.add(i)
    for _ in range(3):
        _step(kv, seqs, fed, [0, 1, 2])
    blocks_of_0 = set(kv.block_table(0))
    if preempt == "swap":
        kv.swap_out(0)
    else:
        kv.free(0)
        kv.add(0)
        fed[0] = 0                                              # re-feed prompt + output so far
    for _ in range(3):
        _step(kv, seqs, fed, [1, 2])
    assert blocks_of_0 & (set(kv.block_table(1)) | set(kv.block_table(2)))   # its blocks were reused
    if preempt == "swap":
        kv.swap_in(0)
    for _ in range(3):
        _step(kv, seqs, fed, [0, 1, 2])
    _step(kv, seqs, fed, [0])
    for i, n in enumerate((7, 9, 9)):
        assert seqs[i][len(prompts[i]):] == alone(prompts[i], n)
    kv.check_invariants()


# ---- the same Engine and Scheduler driving the torch model on paged K/V --------------------------------

from orca_torch.core.engine import Engine  # noqa: E402
from orca_torch.model.torch_executor import TorchExecutor  # noqa: E402
from orca_torch.core.paged_memory import PagedMemory  # noqa: E402
from orca_torch.core.request import Request  # noqa: E402
from orca_torch.core.scheduler_config import SchedulerConfig  # noqa: E402


def torch_run(specs, mem, config, seed=0, clock="iterations"):
    g = torch.Generator().manual_seed(seed)
    reqs = [Request(i, float(a), p, o, prompt_ids=torch.randint(0, MODEL.spec.vocab, (p,), generator=g).tolist())
            for i, (a, p, o) in enumerate(specs)]
    kv = PagedKVManager.mirroring(mem, MODEL)
    ex = TorchExecutor(MODEL, kv, clock=clock)
    calls = {"swap_out": 0, "swap_in": 0}
    for name in calls:                               # count the real copies
        real = getattr(kv, name)

        def counted(rid, real=real, name=name):
            calls[name] += 1
            return real(rid)
        setattr(kv, name, counted)
    res = Engine(ex, mem, config).run(reqs)
    for r in reqs:
        assert res.output_ids[r.req_id] == alone(r.prompt_ids, r.output_len), r.req_id
    kv.check_invariants()
    assert kv.blocks_free == kv.n_blocks and kv.cpu_blocks_free == kv.cpu_blocks and kv.n_requests == 0
    return res, calls


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_on_paged_kv_under_memory_pressure_gives_the_tokens_of_generation_alone(mode):
    specs = [(0, 9, 14), (0, 6, 16), (1, 11, 12), (1, 4, 18), (2, 7, 10)]
    mem = PagedMemory(48, block_size=4, preemption=mode, cpu_blocks=12 if mode == "swap" else None,
                      watermark_blocks=0)   # 12 blocks
    res, calls = torch_run(specs, mem, SchedulerConfig(max_bs=4))
    assert sum(res.n_preemptions) > 0
    if mode == "swap":
        assert calls["swap_out"] == calls["swap_in"] == mem.stats.n_swap_out > 0
    else:
        assert calls["swap_out"] == 0 and mem.stats.n_recompute > 0


def test_a_wall_clock_step_lasts_its_swap_copies_and_its_forward_pass(monkeypatch):
    """A step's wall time counts the copies of its swaps (`PagedKVManager.make_room` times them) as well
    as its forward pass (`TorchExecutor`): the copies are what a swap costs (lecture §7). A fake
    `perf_counter` that only a forward pass (1 s), a swap-out (8 s) and a swap-in (64 s) move makes
    every step's duration known exactly, whatever the real work took."""
    from types import SimpleNamespace

    from orca_torch.model import paged_kv_cache, torch_executor

    now = [0.0]

    def taking(fn, seconds):
        def run(*args, **kwargs):
            now[0] += seconds
            return fn(*args, **kwargs)
        return run
    for module in (torch_executor, paged_kv_cache):
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(MODEL, "forward_batch", taking(MODEL.forward_batch, 1.0))
    monkeypatch.setattr(PagedKVManager, "swap_out", taking(PagedKVManager.swap_out, 8.0))
    monkeypatch.setattr(PagedKVManager, "swap_in", taking(PagedKVManager.swap_in, 64.0))
    swaps = []                                       # (n out, n in) of each step, in order
    execute = TorchExecutor.execute

    def recorded(self, batch):
        swaps.append((len(batch.swapped_out), len(batch.swapped_in)))
        return execute(self, batch)
    monkeypatch.setattr(TorchExecutor, "execute", recorded)
    mem = PagedMemory(48, block_size=4, preemption="swap", cpu_blocks=12, watermark_blocks=0)
    res, calls = torch_run([(0, 9, 14), (0, 6, 16), (1, 11, 12), (1, 4, 18), (2, 7, 10)], mem,
                           SchedulerConfig(max_bs=4), clock="wall")
    assert calls["swap_out"] == calls["swap_in"] > 0
    assert (res.step_end - res.step_start).tolist() == [1.0 + 8.0 * o + 64.0 * i for o, i in swaps]


@settings(max_examples=6, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 10), st.integers(1, 10)), min_size=1, max_size=5),
       st.sampled_from(["recompute", "swap"]), st.sampled_from([2, 4]),
       st.sampled_from(["mixed", "prefill_first", "chunked"]))
def test_engine_on_paged_kv_random_mixes(specs, mode, bs, prefill):
    specs = sorted(specs)
    knobs = ({"max_num_batched_tokens": 7, "chunked_prefill": True} if prefill == "chunked" else {"prefill": prefill})
    mem = PagedMemory(40, block_size=bs, preemption=mode, cpu_blocks=8 if mode == "swap" else None, watermark_blocks=0)
    torch_run(specs, mem, SchedulerConfig(max_bs=3, **knobs))


def test_the_api_runs_paged_kv_on_the_torch_model():
    from orca_torch.lab.api import run as api_run

    reqs = [Request(i, 0.0, p, o, prompt_ids=list(range(3 + i, 3 + i + p))) for i, (p, o) in
            enumerate([(5, 28), (6, 26), (4, 27), (7, 25)])]
    res = api_run(reqs, system="paged-swap", executor="torch", model="tiny", n_slots=80, clock="iterations", max_bs=4)
    assert sum(res.n_preemptions) > 0                                # 5 blocks of 16; each request grows to 2
    for r in reqs:
        assert res.output_ids[r.req_id] == alone(r.prompt_ids, r.output_len)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=1.0, window_size=(-1, 0), enable_gqa=True):
    """A plain per-request causal attention with varlen_attn's signature: the oracle for the flat layout."""
    out, g = [], q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i]:cu_q[i + 1]]
        ki, vi = (t[cu_k[i]:cu_k[i + 1]].repeat_interleave(g, 1) for t in (k, v))
        L, K = qi.shape[0], ki.shape[0]
        s = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        s = s.masked_fill(torch.arange(K)[None] > (K - L + torch.arange(L))[:, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vi))
    return torch.cat(out)


@pytest.mark.parametrize("path", ["split", "fused", "flat"])
def test_every_attention_path_of_the_model_reads_and_writes_paged_kv(path):
    """Split loop, batched decodes and the flat varlen layout (here with a plain reference kernel) all
    give the tokens of generation alone through the block tables."""
    model = OrcaModel("tiny", seed=0)
    if path != "split":
        model.attention = "fused"
    if path == "flat":
        model.varlen_kernel = _reference_varlen
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, MODEL.spec.vocab, (n,), generator=g).tolist() for n in (7, 3, 12, 5)]
    kv = PagedKVManager(model.spec, 40, block_size=4)
    seqs, fed = [list(p) for p in prompts], [0] * 4
    for i in range(4):
        kv.add(i)

    def step(items):
        works, ids, toks = [], [], []
        for i, n in items:
            kv.ensure(i, fed[i] + n)
            works.append(SeqWork(n, fed[i])), ids.append(i), toks.extend(seqs[i][fed[i]:fed[i] + n])
            fed[i] += n
        for (i, _), row in zip(items, model.forward_batch(torch.tensor(toks), works, ids, kv)):
            if fed[i] == len(seqs[i]):
                seqs[i].append(int(row.argmax()))

    step([(0, 7), (1, 3)])
    step([(0, 1), (1, 1), (2, 5)])                          # decodes beside a prompt chunk
    step([(0, 1), (1, 1), (2, 7), (3, 5)])
    for _ in range(5):
        step([(i, 1) for i in range(4) if len(seqs[i]) - len(prompts[i]) < 6])
    for i, p in enumerate(prompts):
        assert seqs[i][len(p):] == alone(p, 6)
    kv.check_invariants()


def test_batched_decodes_read_no_slot_outside_their_own_blocks():
    """A decode padded to a longer one's context reads only its own blocks: a value no request of its
    step may see (a freed block's old contents, another request's overflowed K/V) leaves its logits
    as they were. A masked key still multiplies its value by 0, and 0 * inf is NaN."""
    model = OrcaModel("tiny", seed=0)

    def short_decode_logits(poison):
        kv = PagedKVManager(model.spec, 16, block_size=4)
        for rid, n in (("long", 8), ("short", 2)):
            kv.add(rid), kv.ensure(rid, n + 1)
            model.attention = "split"
            model.forward_batch(torch.arange(n), [SeqWork(n, 0)], [rid], kv)
        if poison:
            kv.pool[:, :, kv.block_table("long")[0]] = float("inf")
            kv.pool[:, :, kv.block_table("short")[0], 2:] = float("inf")      # past what it stores
        model.attention = "fused"
        return model.forward_batch(torch.tensor([5, 6]), [SeqWork(1, 8), SeqWork(1, 2)], ["long", "short"], kv)[1]

    assert model.step_path(PagedKVManager(model.spec, 1, 4), "fused") == "batched"
    assert torch.equal(short_decode_logits(poison=True), short_decode_logits(poison=False))


def test_a_freed_request_leaves_no_trace_in_the_store():
    """A server's store lives for millions of requests: what it keeps is what it holds now."""
    kv = PagedKVManager(SPEC, n_blocks=3, block_size=4, cpu_blocks=3)
    for rid, swapped in (("gone", False), ("gone-swapped", True)):
        kv.add(rid)
        kv.ensure(rid, 3)
        if swapped:
            kv.swap_out(rid)
        kv.free(rid)
        assert not any(isinstance(v, (dict, set, list)) and rid in v for v in vars(kv).values())


def test_bench_paged_kv_takes_the_two_layouts_decode_steps_in_turn(monkeypatch, capsys):
    """Its ratio is of two layouts timed on one machine: a decode step of each at every context, not all
    of one layout's steps and then the other's (a slower stretch of a shared machine would fall on one)."""
    import runpy
    import sys
    from pathlib import Path

    from orca_torch.model.orca_model import OrcaModel

    decodes = []
    forward = OrcaModel.forward_batch

    def recorded(self, token_ids, works, req_ids, kv):
        if all(w.n_new == 1 for w in works):
            decodes.append((type(kv).__name__, works[0].n_past))
        return forward(self, token_ids, works, req_ids, kv)

    monkeypatch.setattr(OrcaModel, "forward_batch", recorded)
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_paged_kv.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--model", "tiny", "--requests", "2", "--context", "8",
                                      "--block-size", "4", "--repeats", "3"])
    runpy.run_path(str(script), run_name="__main__")
    assert [n_past for _, n_past in decodes] == [8, 8, 9, 9, 10, 10]
    layouts = [name for name, _ in decodes]
    assert layouts[0::2] == [layouts[0]] * 3 and layouts[1::2] == ["PagedKVManager"] * 3 != layouts[0::2]
    line = capsys.readouterr().out.splitlines()[-1]
    contiguous, paged, ratio = (float(line.split(f"{k}=")[1].split()[0]) for k in ("contiguous", "paged",
                                                                               "paged/contiguous"))
    # The ms are printed to 0.1 and the ratio to 0.01: the ratio lies where those roundings allow.
    lo = (paged - 0.05) / (contiguous + 0.05)
    hi = (paged + 0.05) / (contiguous - 0.05) if contiguous > 0.05 else math.inf
    assert lo - 0.005 <= ratio <= hi + 0.005, (contiguous, paged, ratio)


def test_swap_out_copies_only_the_blocks_that_hold_tokens():
    # ensured for 12 tokens (3 blocks of 4), holding 5: two blocks go to the CPU, not three
    kv = PagedKVManager(SPEC, n_blocks=4, block_size=4, cpu_blocks=3)
    rows = holding(kv, "a", 5, seed=0, room=12)
    assert kv.swap_out("a") == 5 and kv.cpu_blocks_free == 1 and kv.blocks_free == 4
    kv.check_invariants()
    assert kv.swap_in("a") == 5 and len(kv.block_table("a")) == 2
    assert torch.equal(stored(kv, "a"), rows)


def test_only_blocks_of_a_multiple_of_256_tokens_go_to_the_kernel_as_they_are():
    assert [kernel_takes_blocks(b) for b in (16, 255, 256, 300, 512)] == [False, False, True, False, True]
