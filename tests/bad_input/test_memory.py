"""The K/V memory managers: sizes within what any machine holds, a paged pool whose cost does not
grow with its size, and a new manager's grow that answers what its contract does not allow."""
from __future__ import annotations

import pytest

from orca_torch.core.engine import Engine
from orca_torch.core.memory import (MAX_SLOTS, MemoryManager, ReservationMemory, TokenMemory, UnlimitedMemory,
                                   slots_to_finish)
from orca_torch.core.paged_memory import BlockPool, PagedMemory
from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.sim.fast_engine import FastEngine
from clocks import iteration_clock


@pytest.mark.parametrize("make", [lambda n: TokenMemory(n), lambda n: ReservationMemory(n), lambda n: PagedMemory(n),
                                  lambda n: UnlimitedMemory(n)])
def test_n_slots_is_within_what_any_machine_holds(make):
    for bad in (0, MAX_SLOTS + 1, 2**70, 2.5, True):
        with pytest.raises(ValueError, match=r"n_slots .*must be an integer in \[1, 2\*\*40\], got"):
            make(bad)


def test_a_paged_pool_needs_a_size():
    with pytest.raises(ValueError, match="PagedMemory needs n_slots .* for memory with no limit use UnlimitedMemory"):
        PagedMemory(None)


def test_a_paged_pool_of_any_size_costs_only_what_is_in_use():
    mem = PagedMemory(MAX_SLOTS, block_size=1)                # 2**40 blocks: a list of them would not fit
    r = Request(0, 0.0, 5, 3)
    assert mem.try_admit(r) and mem.blocks_free == MAX_SLOTS - 5
    assert mem.block_table(r) == [0, 1, 2, 3, 4]
    mem.free(r)
    assert mem.blocks_free == MAX_SLOTS and mem.try_admit(Request(1, 0.0, 2, 1)) and mem.block_table(1) == [0, 1]


def test_the_block_pool_hands_out_lowest_first_and_reuses_last_freed_first():
    pool = BlockPool(10)
    a, b = pool.take(3), pool.take(2)
    assert (a, b, pool.n_free) == ([0, 1, 2], [3, 4], 5)
    pool.give(a)
    assert pool.n_free == 8 and pool.take(4) == [0, 1, 2, 5]      # the freed first, in their order, then new
    pool.give([5, 3])
    assert pool.take(1) == [5] and pool.free_ids() == {3, 6, 7, 8, 9} and pool.n_free == 5


def test_a_request_needs_room_for_all_but_its_last_tokens_k_v():
    """At its last step a request stores prompt + output - 1 tokens (its last token is never fed):
    exactly that much memory serves it, one slot less is refused saying how much it needs."""
    from orca_torch.core.engine import Engine
    from orca_torch.sim.executors import CostModelExecutor

    ex, reqs = CostModelExecutor("llama-3-8b", "h100"), [Request("a", 0.0, 2, 2), Request("b", 0.0, 2, 2)]
    for fits in (TokenMemory(3), PagedMemory(3, block_size=1, watermark_blocks=0),
                 PagedMemory(3, block_size=1, watermark_blocks=0, preemption="swap")):
        res = Engine(ex, fits, max_context=64).run(reqs)
        assert res.token_step.tolist() == [0, 1, 2, 3] and max(res.step_used) == 3
    for short, says in ((TokenMemory(2), "needs 3 K/V slots to finish"),
                        (PagedMemory(2, block_size=1, watermark_blocks=0), "needs 3 blocks of 1 tokens to finish")):
        with pytest.raises(ValueError, match=f"request 'a' {says} .*could never run to the end"):
            Engine(ex, short, max_context=64).run(reqs)


class AnswersNothing(ReservationMemory):
    """A new manager whose grow stores the tokens but forgets to answer True."""

    def grow(self, req, n=1):
        self.slots_used += n


class AnswersNothingOnDemand(TokenMemory):
    def grow(self, req, n=1):
        super().grow(req, n)


@pytest.mark.parametrize("memory", [AnswersNothing(100, "oracle"), AnswersNothingOnDemand(100)],
                         ids=lambda m: type(m).__name__)
def test_a_new_manager_whose_grow_answers_no_bool_is_told_what_grow_answered(memory):
    """Not 'admitted without room': the room was there, the answer was None."""
    ex = iteration_clock()
    ex.max_context = 64
    with pytest.raises(AssertionError, match=rf"^{type(memory).__name__}.grow\(0, 5\) answered None after try_admit let "
                                             r"the request in \(grow answers True when the tokens are stored\)$"):
        Engine(ex, memory, SchedulerConfig(max_bs=2)).run([Request(i, 0.0, 5, 3) for i in range(2)])
    assert (memory.slots_reserved, memory.slots_used) == (0, 0)


class RefusesToGrowButCannotRunOut(MemoryManager):
    """Says it cannot run out (the default), yet refuses every decode's growth."""

    def reservation(self, req):
        return req.prompt_len

    def grow(self, req, n=1):
        if req.num_computed_tokens:
            return False
        self.slots_used += n
        return True


def test_a_new_manager_that_refuses_to_grow_says_it_can_run_out():
    ex = iteration_clock()
    ex.max_context = 64
    memory = RefusesToGrowButCannotRunOut(100)
    with pytest.raises(AssertionError, match=r"^RefusesToGrowButCannotRunOut.grow\(0, 1\) answered False where the "
                                             r"growth fits: a manager whose grow may refuse says can_run_out = True$"):
        Engine(ex, memory, SchedulerConfig(max_bs=2)).run([Request(i, 0.0, 5, 3) for i in range(2)])
    assert (memory.slots_reserved, memory.slots_used) == (0, 0)


class ReservesAPrediction(TokenMemory):
    """Sets aside the prompt and a predicted output, a float (as `Request.predicted_output` is)."""

    def reservation(self, req):
        return req.prompt_len + 1.5 * req.output_len


class ReservesLessThanNothing(MemoryManager):
    def reservation(self, req):
        return -1

    def grow(self, req, n=1):
        self.slots_used += n
        return True


@pytest.mark.parametrize("memory, says", [(ReservesAPrediction(100), r"9\.5 \(float\)"),
                                          (ReservesLessThanNothing(100), r"-1 \(int\)")],
                         ids=["a float", "below zero"])
def test_a_new_managers_reservation_is_a_whole_number_of_slots(memory, says):
    """Not a TypeError from the step log's int columns after the step, nor a count of slots that
    ends below zero: the reservation `try_admit` set aside, named as it was given."""
    ex = iteration_clock()
    ex.max_context = 64
    with pytest.raises(AssertionError, match=rf"^{type(memory).__name__}.reservation\(0\) answered {says}: a "
                                             r"reservation is a whole number of K/V slots \(an int >= 0\)$"):
        Engine(ex, memory, SchedulerConfig(max_bs=2)).run([Request(i, 0.0, 5, 3) for i in range(2)])
    assert (memory.slots_reserved, memory.slots_used) == (0, 0)


class GrowsOutsideItsCount(MemoryManager):
    """Sets the prompt aside, then stores every decode without counting it as occupied."""

    def reservation(self, req):
        return req.prompt_len

    def grow(self, req, n=1):
        self.slots_used += n
        return True


class GrowsPastItsSlots(TokenMemory):
    """Counts every slot it grows into, but never refuses one: 10 slots end up holding more."""

    def grow(self, req, n=1):
        n_slots, self.n_slots = self.n_slots, None
        try:
            return super().grow(req, n)
        finally:
            self.n_slots = n_slots


COUNTS = r"holds 12 tokens' K/V \(slots_used\) in {} slots occupied \(slots_reserved\) of n_slots={}"


@pytest.mark.parametrize("memory, says", [(GrowsOutsideItsCount(100), COUNTS.format(10, 100)),
                                          (GrowsPastItsSlots(10), COUNTS.format(12, 10))],
                         ids=["holds more than it occupies", "occupies more than n_slots"])
def test_a_new_managers_counts_stay_within_what_it_occupies_and_its_slots(memory, says):
    """Not 'memory not freed at the end' with a count below zero, nor a run whose occupied share
    of the memory passes 100% with no error: the first step whose counts say what cannot be."""
    ex = iteration_clock()
    ex.max_context = 64
    with pytest.raises(AssertionError, match=rf"^{type(memory).__name__} {says} after batch 1: a manager occupies at "
                                             r"least what it holds and at most n_slots"):
        Engine(ex, memory, SchedulerConfig(max_bs=2)).run([Request(i, 0.0, 5, 3) for i in range(2)])
    assert (memory.slots_reserved, memory.slots_used) == (0, 0)


class ChecksTheFinishNotTheReservation(MemoryManager):
    """Sets aside the prompt and half the output to come, rounded up, but checks at submission only
    the slots a request holds at its end, `slots_to_finish`: one fewer than a one-token output's
    reservation."""

    can_run_out = True

    def reservation(self, req):
        return req.prompt_len + req.n_generated + -(-(req.output_len - req.n_generated) // 2)

    def check(self, req):
        if slots_to_finish(req) > self.n_slots:
            raise ValueError(f"request {req.req_id} needs {slots_to_finish(req)} K/V slots")

    def grow(self, req, n=1):
        self.slots_used += n
        return True


@pytest.mark.parametrize("kind", [Engine, FastEngine])
def test_a_new_manager_that_admits_at_submission_what_it_never_admits_is_named_in_the_stall(kind):
    """The run stalled with 'Scheduler stalled: ... one of the project's policies never gets here',
    naming neither the manager nor its check."""
    ex = iteration_clock()
    ex.max_context = 64
    with pytest.raises(RuntimeError, match=r"^Scheduler stalled: it schedules nothing, nothing more will arrive, and 1 "
                                           r"request is unfinished \(1 waiting, 0 running\) at t=0\.0: no waiting "
                                           r"request was admitted: the queue's head, request 0, needs 11 K/V slots "
                                           r"\(ChecksTheFinishNotTheReservation\.reservation\) and n_slots is 10, so "
                                           r"ChecksTheFinishNotTheReservation\.try_admit refuses it with nothing "
                                           r"running; ChecksTheFinishNotTheReservation\.check\(req\) must refuse"):
        kind(ex, ChecksTheFinishNotTheReservation(10), SchedulerConfig()).run([Request(0, 0.0, 10, 1)])


class AdmitsNothing(ReservationMemory):
    """Its own admission, which refuses every request, whatever it reserves."""

    def try_admit(self, req):
        return False


@pytest.mark.parametrize("kind", [Engine, FastEngine])
def test_a_new_manager_whose_own_try_admit_refuses_an_empty_pool_is_named_in_the_stall(kind):
    """The project's policy admits whenever an empty pool takes the head: the stall said 'one of
    the project's policies never gets here', naming no manager."""
    ex = iteration_clock()
    ex.max_context = 64
    with pytest.raises(RuntimeError, match=r"^Scheduler stalled: .* no waiting request was admitted: the queue's "
                                           r"head, request 0, AdmitsNothing\.try_admit refuses it with nothing "
                                           r"running; AdmitsNothing\.check\(req\) must refuse at submission"):
        kind(ex, AdmitsNothing(100), SchedulerConfig()).run([Request(0, 0.0, 10, 1)])
