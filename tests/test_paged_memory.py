"""The scheduler-side paged manager: block accounting, watermark, recompute vs swap, the fast engine's decode room, errors."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from orca_torch.core.paged_memory import BlockPool, PagedMemory, blocks_for, default_watermark, pool_admitting
from orca_torch.core.request import Request
from orca_torch.sim.decode_runs import decode_reserved, decode_room


def req(i, prompt, out, arrival=0.0):
    return Request(i, arrival, prompt, out)


def test_blocks_are_given_as_a_request_grows_and_tails_are_visible():
    mem = PagedMemory(160, block_size=16, watermark_blocks=0)        # 10 blocks
    r = req(0, 17, 20)
    assert mem.try_admit(r)
    assert mem.blocks_used == 2 and mem.slots_used == 0              # the prompt's 17 tokens: 2 blocks
    assert mem.grow(r, 17)
    assert (mem.slots_reserved, mem.slots_used) == (32, 17)          # 15 slots of tail waste
    for _ in range(15):
        assert mem.grow(r, 1)
    assert mem.blocks_used == 2 and mem.slots_used == 32
    assert mem.grow(r, 1)
    assert (mem.slots_reserved, mem.slots_used) == (48, 33)
    mem.check_invariants()
    mem.free(r)
    assert (mem.slots_reserved, mem.slots_used, mem.blocks_free) == (0, 0, 10)


def test_n_slots_is_rounded_down_to_whole_blocks_and_bad_settings_are_refused():
    assert PagedMemory(100, block_size=16).n_slots == 96
    with pytest.raises(ValueError, match="at least one block"):
        PagedMemory(8, block_size=16)
    with pytest.raises(ValueError, match="unknown preemption .drop.; choose one of .recompute., .swap."):
        PagedMemory(160, preemption="drop")
    with pytest.raises(ValueError, match="cpu_blocks must be >= 1"):
        PagedMemory(160, preemption="swap", cpu_blocks=0)
    with pytest.raises(ValueError, match="cpu_blocks=4 is the swap pool's size, but preemption='recompute'"):
        PagedMemory(160, preemption="recompute", cpu_blocks=4)     # it would be silently ignored
    assert PagedMemory(160, preemption="recompute", cpu_blocks=0).cpu_blocks == 0
    with pytest.raises(ValueError, match="block_size must be an integer"):
        PagedMemory(160, block_size=0)
    with pytest.raises(ValueError, match="watermark_blocks"):
        PagedMemory(160, watermark_blocks=10)


def test_admission_keeps_the_watermark_free_and_refusal_changes_nothing():
    mem = PagedMemory(160, block_size=16, watermark_blocks=2)
    a, b = req(0, 16 * 6, 4), req(1, 16 * 3, 4)
    assert mem.try_admit(a)                                           # 10 - 6 = 4 >= 2
    assert not mem.try_admit(b)                                       # 4 - 3 = 1 < 2
    assert mem.blocks_used == 6 and not mem.holds(b)
    assert mem.try_admit(req(2, 16 * 2, 4))                           # 4 - 2 = 2: exactly the watermark
    mem.check_invariants()


def test_grow_that_does_not_fit_answers_false_and_changes_nothing():
    mem = PagedMemory(64, block_size=16, watermark_blocks=0)         # 4 blocks
    a, b = req(0, 32, 40), req(1, 32, 40)
    assert mem.try_admit(a) and mem.grow(a, 32)
    assert mem.try_admit(b) and mem.grow(b, 32)
    before = (mem.slots_reserved, mem.slots_used, mem.block_table(a))
    assert not mem.grow(a, 1)
    assert (mem.slots_reserved, mem.slots_used, mem.block_table(a)) == before
    assert decode_room(mem, [a, b]) == 0


def test_errors_unknown_double_free_and_growing_a_stranger():
    mem = PagedMemory(64, block_size=16)
    a = req("a", 10, 5)
    with pytest.raises(AssertionError, match="never admitted"):
        mem.free(a)
    with pytest.raises(AssertionError, match="never admitted"):
        mem.grow(a, 1)
    assert mem.try_admit(a)
    with pytest.raises(AssertionError, match="already admitted"):
        mem.try_admit(a)
    mem.free(a)
    with pytest.raises(AssertionError, match="never admitted, or freed already"):
        mem.free(a)
    with pytest.raises(AssertionError, match="never admitted, or freed already"):
        mem.preempt(a)
    with pytest.raises(ValueError, match="could never run to the end"):
        mem.check(req("big", 60, 10))                                  # 70 tokens = 5 blocks > 4
    mem.check(req("ok", 60, 4))


def test_recompute_preemption_drops_the_blocks_and_readmits_prompt_plus_output():
    mem = PagedMemory(160, block_size=16, watermark_blocks=0)
    r = req(0, 20, 30)
    mem.try_admit(r)
    mem.grow(r, 20)
    r.n_generated = 1
    for _ in range(9):
        mem.grow(r, 1)
        r.n_generated += 1
    assert mem.preempt(r) is False
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)
    assert mem.stats.n_recompute == 1 and mem.stats.recompute_tokens == [29]
    assert mem.try_admit(r)                                           # re-feeds 20 + 10 = 30 tokens: 2 blocks
    assert mem.blocks_used == blocks_for(30, 16) == 2 and mem.stored(r) == 0
    mem.check_invariants()


def test_swap_keeps_the_tokens_in_the_cpu_pool_and_brings_them_back():
    mem = PagedMemory(160, block_size=16, preemption="swap", cpu_blocks=3, watermark_blocks=0)
    r = req(0, 40, 10)
    mem.try_admit(r)
    mem.grow(r, 40)
    assert mem.preempt(r) is True
    assert mem.is_swapped(r) and mem.stored(r) == 40 and mem.cpu_blocks_used == 3
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)
    assert mem.try_admit(r)                                           # the swap-in
    assert not mem.is_swapped(r) and mem.stored(r) == 40 and mem.slots_used == 40
    assert mem.cpu_blocks_used == 0 and mem.blocks_used == 3
    s = mem.stats
    assert (s.n_swap_out, s.n_swap_in, s.swap_out_tokens, s.swap_in_tokens) == (1, 1, 40, 40)
    assert mem.grow(r, 9)                                             # it carries on where it was
    mem.check_invariants()


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    mem = PagedMemory(160, block_size=16, preemption="swap", cpu_blocks=2, watermark_blocks=0)
    a, b = req(0, 20, 10), req(1, 40, 10)
    for r, n in ((a, 20), (b, 40)):
        mem.try_admit(r)
        mem.grow(r, n)
    assert mem.preempt(a) is True                                     # 2 blocks: fits the CPU pool
    assert mem.preempt(b) is False                                    # 3 blocks, CPU pool full
    assert mem.stats.n_swap_fallbacks == 1 and mem.stats.recompute_tokens == [40]
    assert mem.is_swapped(a) and not mem.is_swapped(b)
    mem.check_invariants()


def test_a_victim_that_stored_nothing_is_not_swapped():
    """Nothing to copy: it is dropped (a recompute of nothing), and no CPU block is taken or fallback counted."""
    mem = PagedMemory(160, block_size=16, preemption="swap", cpu_blocks=4, watermark_blocks=0)
    r = req(0, 20, 10)
    assert mem.try_admit(r)
    assert mem.preempt(r) is False
    s = mem.stats
    assert (s.n_swap_out, s.n_recompute, s.n_swap_fallbacks, s.recompute_tokens) == (0, 1, 0, [0])
    assert not mem.is_swapped(r) and mem.cpu_blocks_used == 0 and mem.blocks_free == 10
    mem.check_invariants()


def test_swap_in_respects_the_watermark():
    mem = PagedMemory(160, block_size=16, preemption="swap", cpu_blocks=10, watermark_blocks=1)
    a, b = req(0, 64, 10), req(1, 80, 10)
    mem.try_admit(a), mem.grow(a, 64)                                  # 4 blocks
    assert mem.preempt(a)
    mem.try_admit(b), mem.grow(b, 80)                                  # 5 blocks, 5 free
    assert mem.grow(b, 1)                                              # 6 used, 4 free
    assert not mem.try_admit(a)                                        # 4 - 4 = 0 < 1
    assert mem.is_swapped(a)
    mem.free(b)
    assert mem.try_admit(a) and mem.stored(a) == 64


def _brute_decode_room(mem, running):
    """Step one token at a time on a copy of the counters until a block is missing."""
    bs = mem.block_size
    alloc = {r.req_id: len(mem.block_table(r)) for r in running}
    tok = {r.req_id: mem.stored(r) for r in running}
    free, s = mem.blocks_free, 0
    while True:
        for rid in tok:
            if tok[rid] + 1 > alloc[rid] * bs:
                if free == 0:
                    return s
                free -= 1
                alloc[rid] += 1
            tok[rid] += 1
        s += 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(1, 70), min_size=1, max_size=6), st.integers(12, 40))
def test_decode_room_equals_stepping_one_token_at_a_time(bs, prompts, n_blocks):
    mem = PagedMemory(n_blocks * bs, block_size=bs, watermark_blocks=0)
    running = []
    for i, p in enumerate(prompts):
        r = req(i, p, 5)
        if mem.try_admit(r) and mem.grow(r, p):
            running.append(r)
    if not running:
        assert decode_room(mem, []) is None
        return
    room = _brute_decode_room(mem, running)
    assert decode_room(mem, running) == room
    for cap in {0, 1, max(room - 1, 0), room, room + 1, 10 * room + 3}:     # at most the steps the caller needs
        assert decode_room(mem, running, cap) == min(room, cap)


def test_decode_room_lends_no_block_from_a_request_whose_blocks_run_far_ahead_of_its_tokens():
    """Just admitted, a request holds the blocks of its prompt (3 of 16, 48 empty slots) and stores
    nothing; its spare room is its own. Beside it two with a full block each and 1 block free: at
    step 1 both need a block and there is one, so no step fits."""
    mem = PagedMemory(6 * 16, block_size=16, watermark_blocks=0)
    ahead, full, full2 = req(0, 40, 5), req(1, 16, 5), req(2, 16, 5)
    assert mem.try_admit(ahead) and all(mem.try_admit(r) and mem.grow(r, 16) for r in (full, full2))
    assert (mem.tail_room(ahead), mem.tail_room(full), mem.blocks_free) == (48, 0, 1)
    running = [ahead, full, full2]
    assert decode_room(mem, running) == _brute_decode_room(mem, running) == 0
    assert decode_room(mem, running, 4) == 0


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("agpf"), st.integers(0, 5), st.integers(1, 40)), max_size=60),
       st.sampled_from(["recompute", "swap"]), st.integers(1, 6))
def test_no_block_is_leaked_or_shared_under_any_sequence_of_calls(ops, mode, cpu_blocks):
    mem = PagedMemory(8 * 16, block_size=16, preemption=mode, cpu_blocks=cpu_blocks if mode == "swap" else 0,
                      watermark_blocks=1)
    reqs = [req(i, 10 + 7 * i, 100) for i in range(6)]
    for op, i, n in ops:
        r = reqs[i]
        if op == "a" and not mem.holds(r):
            mem.try_admit(r)
        elif op == "g" and mem.holds(r):
            before = mem.stored(r)
            if not mem.grow(r, n):
                assert mem.stored(r) == before
        elif op == "p" and mem.holds(r):
            n_before = mem.stored(r)
            if mem.preempt(r):
                assert mem.stored(r) == n_before and mem.is_swapped(r)
            else:
                assert not mem.is_swapped(r) and not mem.holds(r)
        elif op == "f" and mem.holds(r):
            mem.free(r)
        mem.check_invariants()
        assert mem.blocks_used <= mem.n_blocks
        assert mem.slots_used <= mem.slots_reserved <= mem.n_slots
    for r in reqs:                                                     # drain: swap in and finish everyone
        if mem.is_swapped(r):
            for other in reqs:
                if mem.holds(other):
                    mem.free(other)
            assert mem.try_admit(r)
        if mem.holds(r):
            mem.free(r)
    mem.check_invariants()
    assert (mem.blocks_used, mem.cpu_blocks_used, mem.slots_used) == (0, 0, 0)


# ---- through the real Engine and Scheduler ------------------------------------------------------------

import numpy as np  # noqa: E402

from orca_torch.core.engine import Engine  # noqa: E402
from orca_torch.sim.fast_engine import FastEngine  # noqa: E402
from orca_torch.sim.executors import CostModelExecutor, StepTimeExecutor  # noqa: E402
from orca_torch.sim.hw_model.host_link import swap_bytes, swap_time  # noqa: E402
from orca_torch.core.memory import TokenMemory  # noqa: E402
from orca_torch.core.scheduler_config import SchedulerConfig  # noqa: E402


def affine(max_context=256):
    return StepTimeExecutor(lambda t: .001 + .0001 * t.n_tokens + 1e-6 * t.kv_read_tokens, max_context=max_context)


def requests(specs):
    t, out = 0.0, []
    for i, (gap, p, o) in enumerate(specs):
        t += gap
        out.append(Request(i, t, p, o))
    return out


def drive(eng, reqs):
    """Step the engine, checking the manager's books after every step; return the result and batches."""
    mem, batches = eng.memory, []
    eng.start(reqs)
    while (b := eng.step()) is not None:
        mem.check_invariants()
        assert mem.slots_used <= mem.slots_reserved <= mem.n_slots
        assert mem.blocks_used <= mem.n_blocks
        batches.append(b)
    return eng.result(), batches


SPECS = st.lists(st.tuples(st.floats(0, 0.003), st.integers(1, 20), st.integers(8, 45)), min_size=2, max_size=10)


@settings(max_examples=60, deadline=None)
@given(SPECS, st.sampled_from([1, 4, 16]), st.integers(7, 12), st.sampled_from(["recompute", "swap"]),
       st.sampled_from(["mixed", "prefill_first", "chunked"]), st.integers(1, 6), st.booleans())
def test_scheduler_invariants_with_the_paged_manager(specs, bs, n_blocks_x4, mode, prefill, max_bs, fast):
    n_slots = n_blocks_x4 * 16                        # 112 .. 192 slots: requests of up to 65 tokens preempt
    mem = PagedMemory(n_slots, block_size=bs, preemption=mode,
                      cpu_blocks=max(1, n_slots // bs // 3) if mode == "swap" else None, watermark_blocks=1)
    knobs = ({"max_num_batched_tokens": max_bs + 9, "chunked_prefill": True} if prefill == "chunked"
             else {"prefill": prefill})
    reqs = requests(specs)
    eng = (FastEngine if fast else Engine)(affine(), mem, SchedulerConfig(max_bs=max_bs, **knobs), trace=True)
    res, batches = drive(eng, reqs)
    for i, r in enumerate(reqs):                      # every request once, with exactly its tokens
        assert len(res.tokens_of(i)) == r.output_len and r.n_generated == r.output_len
        assert np.all(np.diff(res.tokens_of(i)) > 0)
    assert (mem.blocks_used, mem.cpu_blocks_used, mem.slots_used) == (0, 0, 0)
    assert res.step_reserved.max() <= mem.n_slots
    assert all(len(w) <= max_bs for _, _, _, w in res.trace)
    s = mem.stats
    assert sum(res.n_preemptions) == s.n_recompute + s.n_swap_out
    assert s.n_swap_out == s.n_swap_in == sum(len(b.swapped_out) for b in batches) == \
        sum(len(b.swapped_in) for b in batches)
    assert s.swap_out_tokens == sum(n for b in batches for _, n in b.swapped_out) == s.swap_in_tokens
    if mode == "recompute":
        assert s.n_swap_out == 0
    if prefill == "mixed":                            # iteration-level FCFS: who runs is an arrival-order prefix
        rank = {r.req_id: i for i, r in enumerate(reqs)}
        last = res.last_token_s
        for _, start, _, works in res.trace:
            ids = sorted(rank[rid] for rid, _, _ in works)
            waiting = [i for i, a in enumerate(res.arrival_s) if a <= start and last[i] > start]
            assert ids == waiting[:len(ids)], (start, ids, waiting)


@settings(max_examples=40, deadline=None)
@given(SPECS, st.integers(50, 120), st.booleans())
def test_blocks_of_one_token_decide_exactly_as_the_token_manager(specs, n_slots, fast):
    """block_size 1, no watermark, recompute: the paged manager is the on-demand token manager."""
    reqs = requests([(g, min(p, 25), min(o, 20)) for g, p, o in specs])
    cfg = SchedulerConfig(max_bs=4)
    kind = FastEngine if fast else Engine
    a = kind(affine(), PagedMemory(n_slots, block_size=1, watermark_blocks=0), cfg).run(reqs)
    b = kind(affine(), TokenMemory(n_slots), cfg).run(reqs)
    np.testing.assert_array_equal(a.token_times, b.token_times)
    np.testing.assert_array_equal(a.n_preemptions, b.n_preemptions)
    np.testing.assert_array_equal(a.step_reserved, b.step_reserved)


def test_the_fast_engine_equals_step_by_step_with_paged_memory():
    reqs = requests([(0.0, 30, 60), (0.001, 20, 70), (0.002, 25, 50), (0.05, 10, 40)])
    runs = [kind(affine(), PagedMemory(160, block_size=16, preemption="swap", watermark_blocks=0),
                 SchedulerConfig(max_bs=4)).run(reqs) for kind in (Engine, FastEngine)]
    assert sum(runs[0].n_preemptions) > 0
    np.testing.assert_array_equal(runs[0].token_times, runs[1].token_times)
    np.testing.assert_array_equal(runs[0].step_used, runs[1].step_used)
    np.testing.assert_array_equal(runs[0].step_reserved, runs[1].step_reserved)   # whole blocks, step by step


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 0.05), st.integers(1, 40), st.integers(1, 90)), min_size=1, max_size=8),
       st.sampled_from([1, 3, 16]), st.sampled_from(["recompute", "swap"]))
def test_the_fast_engine_keeps_every_steps_blocks_with_paged_memory(specs, bs, mode):
    reqs = requests(sorted(specs))
    n_slots = max(bs * -(-(p + o) // bs) for _, p, o in specs) + 3 * bs * 8
    runs = [kind(affine(), PagedMemory(n_slots, block_size=bs, preemption=mode, watermark_blocks=0),
                 SchedulerConfig(max_bs=6)).run(reqs) for kind in (Engine, FastEngine)]
    for field in ("token_times", "step_end", "step_reserved", "step_used", "n_preemptions"):
        np.testing.assert_array_equal(getattr(runs[0], field), getattr(runs[1], field), err_msg=field)
    assert np.all(runs[1].step_used <= runs[1].step_reserved)


def test_decode_reserved_is_growing_one_token_at_a_time():
    mem = PagedMemory(40 * 4, block_size=4, watermark_blocks=0)
    reqs = [req(i, p, 60) for i, p in enumerate([1, 4, 6, 9])]
    for r in reqs:
        assert mem.try_admit(r) and mem.grow(r, r.prompt_len)
    want = []
    probe = PagedMemory(40 * 4, block_size=4, watermark_blocks=0)
    for r in reqs:
        probe.try_admit(r) and probe.grow(r, r.prompt_len)
    for _ in range(11):
        for r in reqs:
            assert probe.grow(r, 1)
        want.append(probe.slots_reserved)
    assert decode_reserved(mem, reqs, 11) == want
    assert want[0] == (7 + 1) * 4 and want[-1] > want[0]    # 7 blocks; the full one (4 of 4) takes one at once


def test_swap_moves_less_than_recompute_and_the_paper_gpu_charges_the_host_link():
    reqs = requests([(0.0, 600, 300)] + [(0.01, 500, 300)] * 5)
    out = {}
    for mode in ("recompute", "swap"):
        ex = CostModelExecutor("llama-3-8b", "h100")
        mem = PagedMemory(3200, block_size=16, preemption=mode, watermark_blocks=0)
        eng = Engine(ex, mem, SchedulerConfig(max_bs=8))
        res, batches = drive(eng, reqs)
        out[mode] = (res, mem, ex, batches)
    (rr, rm, rx, _), (sr, sm, sx, sb) = out["recompute"], out["swap"]
    assert sum(rr.n_preemptions) > 0 and rm.stats.n_recompute > 0 and sum(rm.stats.recompute_tokens) > 0
    assert sm.stats.n_swap_out > 0 and sm.stats.n_recompute == 0
    assert sr.step_n_tokens.sum() < rr.step_n_tokens.sum()          # nothing re-fed
    assert rx.swap_s == 0 and rx.swap_bytes == 0
    want_s = sum(swap_time("llama-3-8b", "h100", sum(n for _, n in moves), len(moves))
                 for b in sb for moves in (b.swapped_out, b.swapped_in) if moves)
    assert sx.swap_s == pytest.approx(want_s) and sx.swap_s > 0
    assert sx.swap_bytes == 2 * sm.stats.swap_out_tokens * 131072    # Llama-3-8B: 128 KiB of K/V per token


def test_swaps_are_priced_on_the_gpu_profile_as_read_when_the_executor_was_built(tmp_path):
    from orca_torch.sim.hw_model import GPUS, save_profile

    path = save_profile(GPUS["h100"], tmp_path / "card.json")
    ex = CostModelExecutor("llama-3-8b", str(path))
    path.unlink()                                  # the profile is the executor's from now on, as its pricer's
    mem = PagedMemory(3200, block_size=16, preemption="swap", watermark_blocks=0)
    reqs = requests([(0.0, 600, 300)] + [(0.01, 500, 300)] * 5)
    _, batches = drive(Engine(ex, mem, SchedulerConfig(max_bs=8)), reqs)
    assert mem.stats.n_swap_out > 0
    want_s = sum(swap_time("llama-3-8b", "h100", sum(n for _, n in moves), len(moves))
                 for b in batches for moves in (b.swapped_out, b.swapped_in) if moves)
    assert ex.swap_s == pytest.approx(want_s) and ex.swap_s > 0


def test_a_full_cpu_pool_falls_back_to_recompute_through_the_engine():
    reqs = requests([(0.0, 60, 40)] + [(0.001, 50, 40)] * 4)
    mem = PagedMemory(256, block_size=16, preemption="swap", cpu_blocks=4, watermark_blocks=0)
    res, _ = drive(Engine(affine(), mem, SchedulerConfig(max_bs=8)), reqs)
    assert mem.stats.n_swap_fallbacks > 0 and mem.stats.n_swap_out > 0
    assert sum(res.n_preemptions) == mem.stats.n_swap_out + mem.stats.n_recompute
    assert [len(res.tokens_of(i)) for i in range(5)] == [r.output_len for r in reqs]


def test_host_link_prices_bytes_over_pcie():
    kv_tok = 2 * 32 * 1024 * 2                                      # Llama-3-8B: 2 x layers x kv_dim x bf16
    assert swap_bytes("llama-3-8b", 1000) == 1000 * kv_tok
    assert swap_bytes("llama-3-8b", 1000, tp=2) == 1000 * kv_tok // 2
    t5, t4 = swap_time("llama-3-8b", "h100", 10_000), swap_time("llama-3-8b", "a100-80gb", 10_000)
    assert t4 / t5 == pytest.approx(2.0, rel=0.01)                  # PCIe 4.0 vs 5.0 x16
    assert t5 == pytest.approx(10e-6 + 10_000 * kv_tok / (0.8 * 32e9 * 16 * 128 / 130 / 8))
    assert swap_time("llama-3-8b", "h100", 0, 0) == 0.0
    # four requests swapped: four copies, each paying the link's 10 us once
    assert swap_time("llama-3-8b", "h100", 10_000, 4) == pytest.approx(4 * 10e-6 + t5 - 10e-6, rel=1e-12)
    # GPT-3 13B's 40 layers on 3 stages hold 14, 13 and 13 layers' K/V (2 x 5,120 x 2 bytes a layer); each
    # device swaps its own share at once, so the first stage's 14 layers set the bytes, not all 40
    assert swap_bytes("gpt3-13b", 1000, pp=3) == 1000 * 14 * 2 * 5120 * 2


def test_a_freed_request_leaves_no_trace_in_the_manager():
    """A live run's manager serves millions of requests: what it keeps is what it holds now."""
    mem = PagedMemory(64, block_size=16)
    a = req("gone", 10, 5)
    assert mem.try_admit(a)
    mem.free(a)
    assert not any(isinstance(v, (dict, set, list)) and "gone" in v for v in vars(mem).values())


def test_a_request_is_refused_unless_its_longest_recompute_fits_beside_the_watermark():
    """A request preempted near its end comes back with `prompt_len + n_generated` tokens to hold, and
    admission keeps the watermark free: the blocks of `total_len - 1` tokens plus the watermark must fit
    the pool, or the request could wait for ever."""
    mem = PagedMemory(64, block_size=16, watermark_blocks=1)               # 4 blocks
    mem.check(req(0, 16, 33))                                               # 48 tokens: 3 blocks + 1 = 4
    late = req(1, 16, 34)                                                   # 49 tokens: 4 blocks + 1 = 5
    with pytest.raises(ValueError, match="needs 4 blocks of 16 tokens to finish .* pool has 4: it could never"):
        mem.check(late)
    late.n_generated = 33                                                   # as if preempted before its last token
    assert not mem.try_admit(late)                                          # 4 free - 4 = 0 < 1


def test_the_block_pool_hands_out_fresh_ids_lowest_first_and_given_back_ones_in_the_order_given():
    pool = BlockPool(6)
    assert pool.take(4) == [0, 1, 2, 3]
    pool.give([2, 0])
    assert pool.take(1) == [2]
    pool.give([2])
    assert pool.take(3) == [2, 0, 4] and pool.n_free == 1      # the given ones first, then a fresh one


def test_a_request_that_needs_every_block_to_finish_is_served():
    """The last token's K/V is never stored: `prompt_len + output_len - 1` tokens in the pool's
    blocks run a request to the end, so it is accepted (one block fewer is refused)."""
    r = req(0, 60, 5)
    mem = PagedMemory(r.total_len - 1, block_size=16, watermark_blocks=0)     # exactly 4 full blocks
    mem.check(r)
    res = Engine(affine(), mem, SchedulerConfig(max_bs=1)).run([r])
    assert len(res.tokens_of(0)) == r.output_len and mem.blocks_free == mem.n_blocks
    with pytest.raises(ValueError, match="could never run to the end"):
        PagedMemory(r.total_len - 1 - mem.block_size, block_size=16, watermark_blocks=0).check(r)


def test_a_pool_sized_by_pool_admitting_admits_those_blocks_beside_its_default_watermark():
    """api sizes a paged run's default budget so; the watermark rule is written once, beside it."""
    for blocks in (1, 98, 99, 100, 198, 1000, 12345):
        mem = PagedMemory(pool_admitting(blocks) * 16, block_size=16)
        assert mem.watermark_blocks == default_watermark(mem.n_blocks)
        assert blocks + mem.watermark_blocks <= mem.n_blocks


@pytest.mark.parametrize("total, fits", [(49, True), (50, False)])
def test_requests_fit_together_as_whole_blocks_and_those_that_fit_grow_to_their_end_side_by_side(total, fits):
    """3 requests of `total` tokens each store total - 1, in whole blocks: in 10 blocks of 16, three
    of 49 (3 blocks each) fit together, three of 50 (4 each) do not, though 150 tokens < 160. Those
    that fit are admitted and grow to their last token side by side, no growth refused."""
    mem = PagedMemory(160, block_size=16)
    reqs = [req(i, 2, total - 2) for i in range(3)]
    assert mem.fits_together(reqs) is fits and mem.fits_together(reqs[:2])
    if fits:
        assert all(mem.try_admit(r) for r in reqs)
        for r in reqs:
            assert mem.grow(r, total - 1)
        assert mem.blocks_free == 1
