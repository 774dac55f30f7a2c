"""Fast-forward: price the steps that follow a step without scheduling them one by one (a speed layer; lecture §4.1).

When every running request is in a step, none is preempted and every prompt in it is done by
that step (`Scheduler.decodes_follow`: a pure decode step, or one that admits and prefills whole
prompts while the queue cannot be admitted before a finish), the steps after it are the same
requests decoding one token apiece, contexts one token longer each step, until a request
finishes, the memory runs out, or an arrival could join. Instead of that many trips through the
scheduler, after the step ran take `m = min(steps to the next finish, memory.decode_room
(running), steps to the next arrival that could join)`, price the `m` decodes with
`executor.decode_ends` (their durations summed into end times), grow the memory by `m` more
tokens per request and let `Scheduler.complete` advance every request in one pass.

When the memory cannot run out (Orca's reservation, or no limit) and nobody waits, or the batch
is a static one, a finish changes nothing for the others: the run goes on past it as the next
`Segment`, one request fewer (or, for static batching's idle seats, the same seats). The finished
request is let go at its own step (`Scheduler.finish`: its seat and memory given back), so the
memory the run logs, and what the queue finds, are the true ones.

Where the memory cannot run out and every step holds every running request whole (mixed
prefill, no token budget, not static), a step that admits does not end the run either: the step
after an arrival, or after a finish while someone waits, is the running requests' decodes plus
whoever `Scheduler.admit` lets in, exactly as `schedule` would choose it. The run takes that step (a `Join`: a whole `Batch`, priced
by `executor.execute`) and goes on with the newcomers decoding too; where the queue's head is not
let in, that step is the decodes alone. Until the next finish nothing frees a seat or memory (a
manager that cannot run out gives room back only through `free`: `MemoryManager`'s contract),
so a head left waiting stays waiting: FCFS tries again only after a finish, SPF also after an
arrival, which may go before the head. Arrivals that could not join are queued when the run
ends, as the step-by-step loop would have queued them by its last step. A run stops at the first
step that admits after `MAX_RUN` segments and joins, so what a call keeps stays bounded: at most
`MAX_RUN` of them, then one segment per finish of the requests still running.

The timestamps are those of the step-by-step loop exactly: the same float additions, in order
(`t + d0 + d1 + ...` across segments and joins: a Python loop for a short run, `cumsum` for a
long one). Only executors that can price a step without running it (`can_fast_forward`: the cost
models) enter here; the torch executor never does.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from orca_torch.core.batch import Batch, step_totals
from orca_torch.core.durations import check_clock
from orca_torch.core.memory import MemoryManager
from orca_torch.core.request import Request
from orca_torch.core.scheduler import NO_LIMIT, NO_WORK, Scheduler

if TYPE_CHECKING:
    from orca_torch.core.engine import Engine


MAX_RUN = 256
"""A run stops at the first step that admits after this many segments and joins, so what a call
keeps until `complete` (every segment's end times, every join's batch) is at most this many
entries plus one segment per request still running (each finish)."""


@dataclass(slots=True)
class Segment:
    """`len(ends)` decode steps after a batch, each one token for every request in `decoding` (after
    the first segment, in the order they finish; static batching's idle seats make `k` larger),
    which had each made `offset` decode steps since the batch; the K/V slots reserved and used in
    the first of them (`reserved`, `used`) and their growth per step, or, where it is uneven,
    `reserved_steps`, step by step."""

    ends: list[float] | np.ndarray
    decoding: list[Request]
    offset: int
    k: int
    reserved: int
    used: int
    dres: int
    dused: int
    reserved_steps: list[int] | None = None


def arrival_may_join(sched: Scheduler, leaving: int = 0) -> bool:
    """Could a request arriving now be admitted before the next finish (`leaving` running requests
    about to be let go)? If not, arrivals during the decodes change nothing, and the run may go
    past them. Under FCFS a request that waits goes first, and stays refused until a finish."""
    cfg = sched.cfg
    return (not cfg.static and len(sched.running) - leaving < cfg.max_bs
            and (cfg.order != "fcfs" or not sched.waiting))


def admits(sched: Scheduler) -> bool:
    """May the run take steps that admit (arrivals, or the queue after a finish)? When the memory
    cannot run out and every step holds every running request whole (no token budget, no
    prefill-only steps, not static), such a step is the running requests' decodes plus whoever
    `Scheduler.admit` lets in: the run takes it and goes on."""
    cfg = sched.cfg
    return (not cfg.static and cfg.prefill == "mixed" and cfg.max_num_batched_tokens is None
            and not sched.memory.can_run_out)


def spans_finishes(sched: Scheduler) -> bool:
    """Are the steps after a finish still the survivors' decodes, or a step the run takes? (See
    the module's docstring.)"""
    return sched.cfg.static or (not sched.memory.can_run_out and (not sched.waiting or admits(sched)))


@dataclass(slots=True)
class Join:
    """A step inside the run that admitted (or tried to): every running request's decode plus the
    prefills `Scheduler.admit` let in (`batch`, a whole step, as `schedule` would have chosen it),
    from `start` to `end`, with the K/V slots reserved and used after it."""

    batch: Batch
    decodes: int                                # its first `decodes` works are the decodes,
    new: list[tuple[Request, int, int]]         # then the prefills of those it admitted
    start: float
    end: float
    reserved: int
    used: int


class JoinWorks(Sequence):
    """A join step's `works`, for an executor that prices from the totals (`reads_works = False`)
    in a run that keeps no trace: `(r, 1, n_past)` for each decode, then the prefills, built
    (once) only if read, so the run does not build the hundreds of decode tuples of every such
    step that nobody reads. `base` is the run's request -> tokens stored after its step j, less j;
    an entry never changes once set, so the tuples are the step's whenever they are read.
    Anyone else gets a plain list."""

    __slots__ = ("decoding", "base", "done", "new", "_works")

    def __init__(self, decoding: list[Request], base: dict[Request, int], done: int, new: list) -> None:
        self.decoding, self.base, self.done, self.new = decoding, base, done, new
        self._works: list | None = None

    def as_list(self) -> list[tuple[Request, int, int]]:
        if self._works is None:
            base, done = self.base, self.done
            self._works = [(r, 1, base[r] + done) for r in self.decoding] + self.new
        return self._works

    def __len__(self) -> int:
        return len(self.decoding) + len(self.new)

    def __getitem__(self, i):
        return self.as_list()[i]

    def __iter__(self):
        return iter(self.as_list())

    def __eq__(self, other) -> bool:
        return self.as_list() == (other.as_list() if isinstance(other, JoinWorks) else other)

    def __repr__(self) -> str:
        return repr(self.as_list())


def decodes_after(engine: Engine, batch: Batch) -> list[Segment | Join] | None:
    """`batch` ends at `engine.t`: commit the steps that follow it and return them in order (decode
    segments, and the steps that admitted or tried to). None when no step can follow: a request
    finishes now and another could take its place, or an arrival joins next step, and the run may
    not take a step that admits."""
    sched, executor, mem, cfg = engine.scheduler, engine.executor, engine.memory, engine.scheduler.cfg
    next_arrival = engine.next_arrival
    join = next_arrival is not None and arrival_may_join(sched)
    joins = admits(sched)
    if join and next_arrival <= engine.t and not joins:
        return None
    decoding = sched.running[:]                 # every running request is in the batch (read before `complete`)
    left = [r.output_len - r.n_generated - 1 for r in decoding]   # decodes each needs after the batch
    span = spans_finishes(sched)
    if span:                                    # the requests in the order they finish
        by_left = sorted(range(len(left)), key=left.__getitem__)
        left = [left[i] for i in by_left]
        finishing = [decoding[i] for i in by_left]
        stop = left[0]                          # the decodes until the next finish
    else:
        stop = min(left)
        room = mem.decode_room(decoding)
        if room is not None and room < stop:
            stop = room
    k, kv = batch.totals.n_seqs, batch.totals.kv_read_tokens
    seat_goes = not (cfg.static and cfg.static_idle_seats_cost)    # (else a finished seat keeps costing)
    price, uneven = executor.decode_ends, type(mem).decode_reserved is not MemoryManager.decode_reserved
    run: list[Segment | Join] = []
    t, done, gone = engine.t, 0, 0
    base = None                                 # request -> tokens it stores after the run's step j, less j
    done_now: list[Request] = []                # finished at step `done`: let go once another step follows
    while True:
        if span:                                # those whose last token step `done` made are done
            first_gone = gone
            while gone < len(left) and left[gone] == done:
                gone += 1
            done_now = finishing[first_gone:gone]
            if seat_goes:
                for r in done_now:
                    kv, k = kv - (r.prompt_len + r.output_len - 1), k - 1
            if gone == len(left):
                break                           # everyone is done (a static batch ends)
            if gone > first_gone:
                decoding, stop = finishing[gone:], left[gone]
                join = next_arrival is not None and arrival_may_join(sched, len(done_now))
        refill = joins and bool(done_now) and bool(sched.waiting)  # the queue may take the finished ones' place
        due = refill or (join and next_arrival <= t)    # or an arrival joins the next step
        if not due:
            if stop <= done:
                break
            ends = price(k, kv, stop - done, t, next_arrival if join else None)
            m = len(ends)
            if done_now:
                _let_go(sched, done_now, batch.index + done)
            res0, used0 = mem.slots_reserved, mem.slots_used
            reserved_steps = mem.decode_reserved(decoding, m) if uneven else None
            mem.grow_all(decoding, m)
            dres, dused = (mem.slots_reserved - res0) // m, (mem.slots_used - used0) // m
            run.append(Segment(ends, decoding, done, k, res0 + dres, used0 + dused, dres, dused, reserved_steps))
            last_start = float(ends[-2]) if m > 1 else t
            t, done, kv = float(ends[-1]), done + m, kv + k * m
            if not span:
                break
            if done == stop:
                continue                        # a finish
        if not joins or len(run) >= MAX_RUN:
            break                               # a step that admits follows: the engine schedules it
        if base is None:
            base = {r: p + n for r, n, p in batch.works}
        if done_now:
            _let_go(sched, done_now, batch.index + done)
        step = _join_step(engine, batch.index + 1 + done, base, done, kv, t)
        run.append(step)
        for r, n, _ in step.new:                # the new requests, in the order they finish
            i = bisect_right(left, done + r.output_len, gone)
            left.insert(i, done + r.output_len)
            finishing.insert(i, r)
            base[r] = n - done - 1
            batch.joined.append((r, step.batch.index))
        last_start, t, done = t, step.end, done + 1
        kv, k = step.batch.totals.kv_read_tokens, step.batch.totals.n_seqs
        decoding, stop = finishing[gone:], left[gone]
        next_arrival = engine.next_arrival
        join = next_arrival is not None and arrival_may_join(sched)
    if not run:
        return None
    engine.admit_arrivals(last_start)           # the queue as a step of its own leaves it: who came by the last step
    batch.n_steps = 1 + done
    sched.n_batches += done
    return run


def _let_go(sched: Scheduler, done_now: list[Request], step: int) -> None:
    """Requests whose last token batch `step` made, with a step of the run after it: their seat and
    memory go before it (`Scheduler.finish`), as they would in a step of its own; the run's last
    finishers are left to `Scheduler.complete`. A static batch lets no one go before its end."""
    if sched.cfg.static:
        return
    for r in done_now:
        r.num_computed_tokens, r.n_generated = r.prompt_len + r.output_len - 1, r.output_len
        sched.finish(r, step)
    done_now.clear()


def _join_step(engine: Engine, index: int, base: dict[Request, int], done: int, kv: int, t: float) -> Join:
    """Step `index` (the run's step `done + 1`), after `t`, as `Scheduler.schedule` would choose it:
    the arrivals by `t` join the queue, every running request decodes (their stored tokens sum to
    `kv`; `base[r] + done` each) and `Scheduler.admit` lets in whom it would. Priced by the
    executor like any step. Where it lets in no one it is a plain decode step."""
    sched, mem = engine.scheduler, engine.memory
    engine.admit_arrivals(t)
    decoding = sched.running[:]
    step = Batch(index, [], NO_WORK)
    mem.grow_all(decoding)                      # the decodes first, then admission, as `schedule` does
    sched.admit(step, sched.cfg.max_bs - len(decoding), NO_LIMIT)
    new = step.works                            # (the prefills: admission's works)
    sched.store(new)
    lazy = JoinWorks(decoding, base, done, new)
    step.works = lazy.as_list() if engine.executor.reads_works or engine.trace_steps is not None else lazy
    step.totals = step_totals(new, len(decoding), kv)
    d = engine.checked_duration(engine.executor.execute(step), step)
    end = t + d
    if end == t:
        check_clock(end, d, t)
    return Join(step, len(decoding), new, t, end, mem.slots_reserved, mem.slots_used)
