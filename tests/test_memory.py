"""Memory managers: what each policy reserves, the n_slots bound, on-demand growth, clear errors."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from orca_torch.sim.hw_model import kv_capacity_tokens
from orca_torch.core.memory import ReservationMemory, TokenMemory, UnlimitedMemory, occupancy_denominator
from orca_torch.core.request import Request
from orca_torch.core.engine import Engine
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.sim.decode_runs import KNOWN_MEMORY, decode_grow, decode_room
from orca_torch.sim.executors import CostModelExecutor
from random_settings import make_memory


def req(i, prompt, out, **kw):
    return Request(i, 0.0, prompt, out, **kw)


def test_reservation_amounts_per_policy():
    r = req(0, 700, 300)                            # 1000 tokens in all
    assert ReservationMemory(10_000, "oracle").reservation(r) == 1000
    assert ReservationMemory(10_000, "pow2").reservation(r) == 1024
    assert ReservationMemory(10_000, "max").reservation(r) == 8192
    assert ReservationMemory(10_000, "max").reservation(req(1, 700, 300, max_tokens=2048)) == 2048
    assert ReservationMemory(10_000, "pow2").reservation(req(2, 1000, 24)) == 1024
    assert ReservationMemory(10_000, "pow2").reservation(req(3, 1000, 25)) == 2048
    # The next power of two never exceeds the context the server allows (the engine's max_context).
    assert make_memory("pow2", 10_000, 3000).reservation(req(4, 2000, 100)) == 3000
    # Nor past the request's own max_tokens: it never holds more, so the rest of the power would lie idle.
    assert ReservationMemory(10_000, "pow2").reservation(req(6, 700, 300, max_tokens=1010)) == 1010
    assert ReservationMemory(10_000, "pow2").reservation(req(7, 700, 300, max_tokens=4096)) == 1024
    # Max reserves the serving context, but never less than what the request will hold.
    long = req(5, 9000, 100)
    assert ReservationMemory(10_000, "max").reservation(long) == long.total_len
    # Pow2 caps at the serving context (8192 here, below 16384) but never below the 9100 tokens it will hold.
    assert ReservationMemory(10_000, "pow2").reservation(long) == 9100


def test_lecture_anchor_52_requests_of_8192_on_an_h100():
    n_slots = kv_capacity_tokens("llama-3-8b", "h100")
    mem = ReservationMemory(n_slots, "max")
    admitted = 0
    while mem.try_admit(req(admitted, 100, 100)):
        admitted += 1
    assert admitted == 52
    assert mem.slots_reserved == 52 * 8192 <= n_slots


def test_admission_stops_at_n_slots_and_free_gives_back():
    mem = ReservationMemory(3000, "oracle")
    a, b, c = req(0, 900, 100), req(1, 900, 100), req(2, 900, 200)
    assert mem.try_admit(a) and mem.try_admit(b)
    assert not mem.try_admit(c)                     # 2000 + 1100 > 3000: refused, nothing changed
    assert mem.slots_reserved == 2000 and mem.slots_used == 0
    assert mem.grow(a, 900)
    a.num_computed_tokens = 900                      # the scheduler, when the step completes
    assert mem.slots_used == 900 and mem.stored(a) == 900
    mem.free(a)
    assert (mem.slots_reserved, mem.slots_used) == (1000, 0)
    assert mem.stored(a) == 0 and not mem.holds(a)   # its 900 computed tokens are no longer held here
    assert mem.try_admit(c)
    with pytest.raises(AssertionError, match=r"request 0 holds no memory \(never admitted, or freed already\)"):
        mem.free(a)


def test_growth_past_a_reservation_is_a_bug_not_silent():
    mem = ReservationMemory(3000, "oracle")
    r = req(0, 10, 5)
    mem.try_admit(r)
    assert mem.grow(r, 14)
    r.num_computed_tokens = 14
    with pytest.raises(AssertionError, match="past its reservation"):
        mem.grow(r, 2)
    assert mem.slots_used == 14                      # refused before anything changed


def test_impossible_reservations_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="could never be admitted"):
        ReservationMemory(4096, "max").check(req(0, 10, 10))
    ReservationMemory(4096, "oracle").check(req(0, 10, 10))
    with pytest.raises(ValueError, match="could never run to the end"):
        TokenMemory(100).check(req(0, 80, 30))
    with pytest.raises(ValueError, match="unknown reservation policy"):
        ReservationMemory(100, "median")
    with pytest.raises(ValueError, match=r"n_slots \(K/V slots, in tokens\) must be an integer in \[1, 2\*\*40\], "
                                         r"got 0"):
        ReservationMemory(0, "max")


def test_on_demand_memory_serves_a_request_that_needs_every_slot():
    """The last token's K/V is never stored, so `prompt_len + output_len - 1` slots run a request
    to the end: that many are accepted (and served), one fewer is refused."""
    r = req(0, 80, 21)
    TokenMemory(r.total_len - 1).check(r)
    res = Engine(CostModelExecutor("llama-3-8b", "h100"), TokenMemory(r.total_len - 1), max_context=1024).run([r])
    assert len(res.tokens_of(0)) == r.output_len
    with pytest.raises(ValueError, match="could never run to the end"):
        TokenMemory(r.total_len - 2).check(r)


def test_on_demand_memory_runs_out_while_growing():
    mem = TokenMemory(100)
    a, b = req(0, 40, 50), req(1, 40, 50)
    assert mem.try_admit(a) and mem.try_admit(b)    # prefills: 80 slots
    assert mem.grow(a, 40) and mem.grow(b, 40)
    assert decode_room(mem, [a, b]) == 10
    for _ in range(10):                              # 10 decode steps for both
        assert mem.grow(a, 1) and mem.grow(b, 1)
    assert decode_room(mem, [a, b]) == 0
    assert not mem.grow(a, 1)                        # full: refused, nothing changed
    assert (mem.slots_reserved, mem.slots_used) == (100, 100)
    assert mem.preempt(a) is False                   # dropped: a recomputes from 0
    assert (mem.slots_reserved, mem.slots_used) == (50, 50) and mem.grow(b, 2)


def test_unlimited_never_refuses():
    mem = UnlimitedMemory(capacity=10)
    for i in range(100):
        assert mem.try_admit(req(i, 1000, 1000))
    r = req(100, 10, 10)
    assert mem.try_admit(r) and mem.grow(r, 10**6) and decode_room(mem, [r]) is None
    mem.check(req(0, 10**5, 10**5))


@pytest.mark.parametrize("make", [lambda: ReservationMemory(1000, "oracle"), lambda: TokenMemory(1000),
                                  UnlimitedMemory, lambda: PagedMemory(1000, block_size=16)],
                         ids=["reservation", "token", "unlimited", "paged"])
@pytest.mark.parametrize("m", [1, 7, 40])
def test_decode_grow_is_m_steps_of_grow_all(make, m):
    """The fast engine grows `m` decode steps at once (`decode_grow`) where the core grows one step
    at a time (`grow_all`): the counts, and the room left after, are the same."""
    counts = []
    for bulk in (True, False):
        mem = make()
        running = [req(i, p, 60) for i, p in enumerate((30, 45, 17))]
        for r in running:
            assert mem.try_admit(r) and mem.grow(r, r.prompt_len)
            r.num_computed_tokens = r.prompt_len
        if bulk:
            decode_grow(mem, running, m)
            for r in running:
                r.num_computed_tokens += m
        else:
            for _ in range(m):
                mem.grow_all(running)
                for r in running:
                    r.num_computed_tokens += 1
        counts.append((mem.slots_reserved, mem.slots_used, decode_room(mem, running)))
    assert counts[0] == counts[1] and counts[0][1] == 30 + 45 + 17 + 3 * m
    assert type(make()) in KNOWN_MEMORY


@pytest.mark.parametrize("make", [lambda: ReservationMemory(100, "oracle"), lambda: TokenMemory(100), UnlimitedMemory],
                         ids=["reservation", "token", "unlimited"])
def test_growing_a_request_that_holds_no_memory_is_a_bug_named_by_its_request(make):
    mem = make()
    r = req("stranger", 10, 5)
    with pytest.raises(AssertionError, match="'stranger' cannot grow: it holds no memory .never admitted"):
        mem.grow(r, 1)
    assert mem.try_admit(r) and mem.grow(r, 10)
    r.num_computed_tokens = 10
    mem.free(r)
    with pytest.raises(AssertionError, match="'stranger' cannot grow: it holds no memory .never admitted, or freed"):
        mem.grow(r, 1)
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)


@settings(max_examples=40, deadline=None)
@given(policy=st.sampled_from(["max", "pow2", "oracle", "ondemand"]), n_slots=st.integers(500, 1500),
       ops=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 400), st.integers(1, 300)), min_size=20, max_size=60))
def test_invariants_under_random_operations(policy, n_slots, ops):
    """Admissions, growths (a decode, or a chunk of up to 400) and frees, with n_slots small and the
    lists long enough that admissions are refused in most examples and on-demand growths in some."""
    mem = make_memory(policy, n_slots, 1000)
    held: list[Request] = []
    stored: dict = {}
    for i, (op, p, o) in enumerate(ops):
        if op == 0:
            r = req(i, p, o)
            try:
                mem.check(r)
            except ValueError:
                continue
            before = (mem.slots_reserved, mem.slots_used)
            if mem.try_admit(r):
                assert mem.grow(r, p)
                stored[r.req_id] = r.num_computed_tokens = p
                held.append(r)
            else:
                assert (mem.slots_reserved, mem.slots_used) == before
        elif op == 1 and held:
            for r in [r for r in held if stored[r.req_id] < r.total_len - 1]:
                n = min(p, r.total_len - 1 - stored[r.req_id]) if o % 2 else 1     # a chunk, or a decode
                before = (mem.slots_reserved, mem.slots_used)
                if mem.grow(r, n):
                    stored[r.req_id] += n
                    r.num_computed_tokens += n
                else:
                    assert (mem.slots_reserved, mem.slots_used) == before
        elif held:
            mem.free(held.pop(0))
        assert 0 <= mem.slots_used <= mem.slots_reserved <= n_slots
        assert mem.slots_used == sum(stored[r.req_id] for r in held)
    for r in held:
        mem.free(r)
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)


def test_the_serving_context_is_the_engines_max_context():
    """What a request without `max_tokens` may reach, and Orca (Max) reserves, is the engine's
    `max_context`: a manager takes no context of its own that the engine would overwrite."""
    for ctx in (64, 2048):
        mem = ReservationMemory(100_000, "max")
        res = Engine(CostModelExecutor(), mem, max_context=ctx).run([Request(0, 0.0, 5, 3)])
        assert mem.reservation(Request(1, 0.0, 5, 3)) == ctx and res.step_reserved[0] == ctx


def test_occupancy_is_reported_against_n_slots_or_an_unlimited_managers_capacity():
    assert occupancy_denominator(ReservationMemory(3000, "oracle")) == 3000.0
    assert occupancy_denominator(TokenMemory(500)) == 500.0
    assert occupancy_denominator(UnlimitedMemory(capacity=100)) == 100.0   # no limit, but a size to compare with
    assert math.isnan(occupancy_denominator(UnlimitedMemory()))
