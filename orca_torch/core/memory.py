"""K/V memory managers: the scheduler asks, the manager answers (lecture §4.3, §5.1, §6.1).

The scheduler decides *who runs each step*; whether the K/V fits is a question for one of these
objects, behind a few calls: `try_admit` (may this request join the pool?), `grow` (may its K/V
grow by n tokens?), `free` (finished) and `preempt` (evicted: swap its K/V out, or drop it). They hold
Python numbers only, so one scheduler drives them on the paper GPU and on the torch model alike,
and a paged manager (lecture 3, `paged_memory.py`) drops in.

- `ReservationMemory(n_slots, policy)`: Orca. When a request is first scheduled, set aside the slots it may
  ever need — `max` (its `max_tokens`, by default the model's context: what Orca can really do),
  `pow2` (the true length rounded up to a power of two: a good length predictor) or `oracle` (the
  true length) — so an admitted request always runs to the end and nothing ever deadlocks.
  Growth is always within the reservation.
- `TokenMemory`: on demand, one slot per stored token and nothing set aside for the future. It can
  run out while requests grow, and then the engine preempts (lecture §5.1, §6.1, lecture 3).
- `UnlimitedMemory`: on demand with no limit — "occupied = holding tokens", §6.1's bottom line.

`slots_reserved` is what is occupied (set aside); `slots_used` is what holds K/V. The gap is the
memory Orca's reservation wastes.
"""
from __future__ import annotations

import math
from typing import Hashable

from orca_torch.checks import brief, check_choice, check_int, is_int
from orca_torch.core.request import Request

POLICIES = ("max", "pow2", "oracle")


MAX_SLOTS = 2**40
"""More K/V slots than any machine holds (1.1e12 tokens, a terabyte at one byte each): past it the
step arithmetic (int64 counts of slots and steps) could overflow."""


def slots_to_finish(req: Request) -> int:
    """K/V slots `req` holds at its last step, `prompt_len + output_len - 1`: its last token is
    never fed, so its K/V never is stored."""
    return req.total_len - 1


class MemoryManager:
    """The interface the scheduler uses; subclasses set `can_run_out` and the reservation rule.

    The scheduler updates a request's `num_computed_tokens` when its step completes, and calls
    `grow` (at most once per request per step) before that, `free` and `preempt` after: managers
    that never refuse read the stored count off the request; `TokenMemory`, which must refuse
    exactly, keeps its own per-request count.

    `can_run_out = False` promises two things: `grow` never refuses, and room comes back only
    through `free` (while requests decode, what `try_admit` would answer can only get worse).
    So between finishes, a queue head that was refused stays refused (the fast engine in
    `sim/fast_engine.py` relies on it). A manager that gives reserved room back as requests grow
    must say `can_run_out = True`.

    `default_max_tokens` is the serving context: what a request without `max_tokens` may reach
    (Orca (Max) reserves it). The engine sets it to its `max_context`; until then it is 8192.
    """

    can_run_out = False
    swaps = False
    """True: a preempted request's K/V is kept in host memory (`preempt` answers True), which a
    run on the paper GPU prices over the card's host link."""
    slots_reserved = 0
    default_max_tokens = 8192

    def __init__(self, n_slots: int | None) -> None:
        """The size a user gives, checked once here (None: no limit); every call after trusts it."""
        self.n_slots = None if n_slots is None else check_int("n_slots (K/V slots, in tokens)", n_slots, 1,
                                                              MAX_SLOTS)
        self.slots_used = 0
        self._reservations: dict = {}   # req_id -> slots set aside

    # -- subclass rules --
    def reservation(self, req: Request) -> int:
        """Slots `try_admit` sets aside for `req`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement reservation")

    def need_to_finish(self, req: Request) -> int:
        """What `req` holds at its last step, as this manager counts it (here, its reservation, in
        slots): the one count `check` and `fits_together` compare with the pool (`room_for`)."""
        return self.reservation(req)

    def room_for(self, need: int) -> bool:
        """Whether an empty pool holds `need` (a sum of `need_to_finish`) at once."""
        return self.n_slots is None or need <= self.n_slots

    def fits_together(self, reqs: list[Request]) -> bool:
        """Whether `reqs` could all be held at once, each to its last step, in an empty pool: what
        `check` asks of one request, asked of requests that must run side by side (the n choices
        of one answer on the server), each counted by `need_to_finish`."""
        return self.room_for(sum(map(self.need_to_finish, reqs)))

    def check(self, req: Request) -> None:
        """Raise ValueError if `req` could never be admitted, even into an empty pool (`fits_together`
        of it alone, asked here without building the list: it runs for every request submitted)."""
        need = self.need_to_finish(req)
        if not self.room_for(need):
            raise ValueError(f"request {brief(req.req_id)} needs {need} K/V slots "
                             f"({type(self).__name__} {self.describe()}) but n_slots is {self.n_slots}: "
                             "it could never be admitted")

    def describe(self) -> str:
        return ""

    def check_set_up(self) -> None:
        """Raise ValueError unless `MemoryManager.__init__` ran: a manager from outside whose own
        `__init__` skipped it would fail inside its first run, on an AttributeError in `reset`."""
        if not hasattr(self, "_reservations"):
            raise ValueError(f"memory: {type(self).__name__} was not set up as a MemoryManager: its __init__ must "
                             "call super().__init__(n_slots) first (n_slots: the K/V slots in tokens, None for no "
                             "limit), which sets the count and the reservations every manager keeps")

    # -- the calls --
    def try_admit(self, req: Request) -> bool:
        """May `req` join the running pool (waiting -> running)? Sets its reservation aside."""
        need = self.reservation(req)
        assert (type(need) is int or is_int(need)) and need >= 0, (   # (the common case first: it runs each admission)
            f"{type(self).__name__}.reservation({brief(req.req_id)}) answered {brief(need)} ({type(need).__name__}): "
            "a reservation is a whole number of K/V slots (an int >= 0)")
        if self.n_slots is not None and self.slots_reserved + need > self.n_slots:
            return False
        self.slots_reserved += need
        self._reservations[req.req_id] = need
        return True

    def grow(self, req: Request, n: int = 1) -> bool:
        """`req` stores `n` more tokens this step (a prefill, a chunk, or decodes); False = no room."""
        raise NotImplementedError(f"{type(self).__name__} does not implement grow")

    def grow_all(self, reqs: list[Request]) -> None:
        """Every request in `reqs` stores one more token, growth that cannot be refused: a step's
        decodes on a manager that cannot run out (the same as `grow` on each; managers may do it in
        one pass)."""
        for r in reqs:
            grown = self.grow(r, 1)
            assert grown, (f"{type(self).__name__}.grow({brief(r.req_id)}, 1) answered {grown!r} where the "
                           "growth fits: a manager whose grow may refuse says can_run_out = True")

    def free(self, req: Request) -> None:
        """`req` finished (or is preempted): give back everything it holds, its reservation or, where
        it grew past it (`UnlimitedMemory`), its stored tokens."""
        stored = req.num_computed_tokens
        self.slots_reserved -= max(self._pop_reservation(req), stored)
        self.slots_used -= stored

    def _pop_reservation(self, req: Request) -> int:
        """The slots `try_admit` set aside for `req` (and its growth added), forgotten here."""
        assert req.req_id in self._reservations, self._unknown(req.req_id, "holds no memory")
        return self._reservations.pop(req.req_id)

    def _unknown(self, rid: Hashable, what: str) -> str:
        """The message of an assert on a request this manager does not hold."""
        return f"request {brief(rid)} {what} (never admitted, or freed already)"

    def preempt(self, req: Request) -> bool:
        """Free `req`'s device memory. True = its K/V was kept in host memory (swap), so it keeps
        its computed tokens; False = dropped, it recomputes from 0 when readmitted (these managers)."""
        self.free(req)
        return False

    def stored(self, req: Request) -> int:
        """Tokens of `req` whose K/V this manager holds (between steps): a query for a reader (a
        debugger, the tests), which the run never asks; `slots_used` sums it over the requests the
        manager `holds`."""
        return req.num_computed_tokens if req.req_id in self._reservations else 0

    def holds(self, req: Request) -> bool:
        return req.req_id in self._reservations

    def reset(self) -> None:
        self.slots_reserved = self.slots_used = 0
        self._reservations.clear()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.describe()} n_slots={self.n_slots}, "
                f"reserved={self.slots_reserved}, used={self.slots_used})")


class ReservationMemory(MemoryManager):
    """Orca's reservation when a request is first scheduled (Algorithm 1, `n_rsrv <= n_slots`)."""

    def __init__(self, n_slots: int, policy: str = "max") -> None:
        policy = check_choice("reservation policy", policy, POLICIES)
        super().__init__(n_slots)
        self.policy = policy

    def describe(self) -> str:
        return f"policy={self.policy!r}"

    def reservation(self, req: Request) -> int:
        """`oracle`: the true length (`total_len`, as Orca's oracle sets aside: one slot more than the
        request stores, `slots_to_finish`); `pow2`: rounded up to a power of two, but never past what the
        request may hold (`max_tokens`, else the serving context, `default_max_tokens`); `max`:
        `max_tokens`, else the serving context (never less than the true length)."""
        if self.policy == "oracle":
            return req.total_len
        if self.policy == "pow2":
            p2 = 1 << (req.total_len - 1).bit_length()
            cap = req.max_tokens if req.max_tokens is not None else self.default_max_tokens
            return max(req.total_len, min(p2, cap))
        return req.max_tokens if req.max_tokens is not None else max(self.default_max_tokens, req.total_len)

    def grow(self, req: Request, n: int = 1) -> bool:
        held = self._reservations.get(req.req_id)
        assert held is not None, self._unknown(req.req_id, "cannot grow: it holds no memory")
        kv = req.num_computed_tokens + n
        assert kv <= held, f"request {brief(req.req_id)} would store {kv} tokens, past its reservation of {held}"
        self.slots_used += n
        return True

    def grow_all(self, reqs: list[Request]) -> None:
        """Decodes: within the reservation, which covers `prompt_len + output_len` (admission checked)."""
        self.slots_used += len(reqs)


class TokenMemory(MemoryManager):
    """On-demand slots: admit if the prefill fits now, grow one slot per decoded token, may run out."""

    can_run_out = True

    def __init__(self, n_slots: int) -> None:
        super().__init__(n_slots)
        self._kv: dict = {}      # req_id -> tokens whose K/V is stored, this step's growth included

    def reservation(self, req: Request) -> int:
        return req.prompt_len + req.n_generated  # the prefill (or the recompute after a preemption)

    def try_admit(self, req: Request) -> bool:
        if not super().try_admit(req):
            return False
        self._kv[req.req_id] = 0
        return True

    def free(self, req: Request) -> None:
        self.slots_reserved -= self._pop_reservation(req)
        self.slots_used -= self._kv.pop(req.req_id)

    def stored(self, req: Request) -> int:
        return self._kv.get(req.req_id, 0)

    def reset(self) -> None:
        super().reset()
        self._kv.clear()

    def need_to_finish(self, req: Request) -> int:
        """At its last step a request stores `slots_to_finish(req)` tokens."""
        return slots_to_finish(req)

    def check(self, req: Request) -> None:
        need = self.need_to_finish(req)
        if not self.room_for(need):
            raise ValueError(f"request {brief(req.req_id)} needs {need} K/V slots to finish "
                             f"(prompt_len + output_len - 1: the last token's K/V is never stored) but n_slots is "
                             f"{self.n_slots}: it could never run to the end")

    def grow(self, req: Request, n: int = 1) -> bool:
        rid = req.req_id
        assert rid in self._kv, self._unknown(rid, "cannot grow: it holds no memory")
        kv = self._kv[rid] + n
        extra = kv - self._reservations[rid]
        if extra > 0:
            if self.n_slots is not None and self.slots_reserved + extra > self.n_slots:
                return False
            self.slots_reserved += extra
            self._reservations[rid] += extra
        self._kv[rid] = kv
        self.slots_used += n
        return True


class UnlimitedMemory(MemoryManager):
    """No limit: occupied = holding tokens (the prefill is set aside when admitted, then every
    token stored is a slot). `capacity` (optional) is only a denominator for reports."""

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity)
        self.capacity, self.n_slots = self.n_slots, None     # (checked as a size, but no limit)

    def reservation(self, req: Request) -> int:
        return req.prompt_len + req.n_generated

    def check(self, req: Request) -> None:
        return None

    def grow(self, req: Request, n: int = 1) -> bool:
        held = self._reservations.get(req.req_id)
        assert held is not None, self._unknown(req.req_id, "cannot grow: it holds no memory")
        before = req.num_computed_tokens
        self.slots_reserved += max(held, before + n) - max(held, before)
        self.slots_used += n
        return True

    def grow_all(self, reqs: list[Request]) -> None:
        """Decodes: each already holds all it stores, so every token is a new slot."""
        self.slots_used += len(reqs)
        self.slots_reserved += len(reqs)


def occupancy_denominator(mem: MemoryManager) -> float:
    """The slots fractions are reported against (NaN when there is no capacity to compare with)."""
    if mem.n_slots is not None:
        return float(mem.n_slots)
    cap = getattr(mem, "capacity", None)
    return float(cap) if cap else math.nan
