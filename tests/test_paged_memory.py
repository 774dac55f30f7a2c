"""The scheduler-side paged manager: block accounting, watermark, recompute vs swap, decode_room, errors."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from orca_torch.paged_memory import PagedMemory, blocks_for
from orca_torch.request import Request


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
    with pytest.raises(ValueError, match="preemption must be"):
        PagedMemory(160, preemption="drop")
    with pytest.raises(ValueError, match="cpu_blocks must be >= 1"):
        PagedMemory(160, preemption="swap", cpu_blocks=0)
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
    assert mem.decode_room([a, b]) == 0


def test_errors_unknown_double_free_and_growing_a_stranger():
    mem = PagedMemory(64, block_size=16)
    a = req("a", 10, 5)
    with pytest.raises(KeyError, match="never admitted"):
        mem.free(a)
    with pytest.raises(KeyError, match="never admitted"):
        mem.grow(a, 1)
    assert mem.try_admit(a)
    with pytest.raises(RuntimeError, match="already admitted"):
        mem.try_admit(a)
    with pytest.raises(ValueError, match="n must be an integer"):
        mem.grow(a, -1)
    mem.free(a)
    with pytest.raises(KeyError, match="already freed"):
        mem.free(a)
    with pytest.raises(KeyError, match="already freed"):
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
        assert mem.decode_room([]) is None
        return
    assert mem.decode_room(running) == _brute_decode_room(mem, running)


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
