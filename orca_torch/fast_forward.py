"""Fast-forward: price the identical decode steps after a step with one call (a speed layer; lecture §4.1).

When every running request is in a step, none is preempted and every prompt in it is done by
that step (`Scheduler.decodes_follow`: a pure decode step, or one that admits and prefills whole
prompts while the queue cannot be admitted before a finish), the steps after it are the same
requests decoding one token apiece, contexts one token longer each step, until a request
finishes, the memory runs out, or an arrival could join. Instead of that many trips through the
scheduler, after the step ran take `m = min(steps to the next finish, memory.decode_room
(running), steps to the next arrival that could join)`, price the `m` decodes with
`executor.decode_ends` (their durations summed into end times), grow the memory by `m` more tokens per request and let
`Scheduler.complete` advance every request in one pass.

A finish changes nothing when nobody could take its place: the queue is empty and the memory
cannot run out (Orca's reservation, or no limit), or the batch is a static one (no one joins it
before its last request is done). Then the run goes on past the finish as the next `segment`:
one request fewer (or, for static batching's idle seats, the same seats), its K/V given back in
the step log, until the next finish, an arrival, or the static batch's end. Each segment is priced
with one call.

The timestamps are those of the step-by-step loop exactly: the same float additions, in order
(`t + d0 + d1 + ...` across segments: a Python loop for a short run, `cumsum` for a long one).
Only executors that can price a step without running it (`can_fast_forward`: the cost models)
enter here; the torch executor never does.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import Batch
from .executor import Executor
from .memory import MemoryManager
from .request import Request
from .scheduler import Scheduler


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


def arrival_may_join(sched: Scheduler) -> bool:
    """Could a request arriving now be admitted before the next finish? If not, arrivals during
    the decodes change nothing, and the run may go past them."""
    cfg = sched.cfg
    return not cfg.static and len(sched.running) < cfg.max_bs and (cfg.order != "fcfs" or not sched.waiting)


def spans_finishes(sched: Scheduler) -> bool:
    """Are the steps after a finish still the survivors' decodes? (See the module's docstring.)
    The step log after a finish needs what the memory gives back (`freed_by`): a manager that
    frees its own way without saying so is not gone past."""
    if sched.cfg.static:
        return True
    mem = type(sched.memory)
    says_what_it_frees = mem.free is MemoryManager.free or mem.freed_by is not MemoryManager.freed_by
    return not sched.memory.can_run_out and not sched.waiting and says_what_it_frees


def decodes_after(sched: Scheduler, executor: Executor, batch: Batch, end: float,
                  next_arrival: float | None) -> list[Segment] | None:
    """`batch` ends at `end`: commit the decode steps that follow it unchanged and
    return them as segments (None when no step can follow: a request finishes now and another
    could take its place, or an arrival joins next step)."""
    join = next_arrival is not None and arrival_may_join(sched)
    if join and next_arrival <= end:
        return None
    cfg, mem = sched.cfg, sched.memory
    decoding = sched.running                    # every running request is in the batch (read before `complete`)
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
    segments: list[Segment] = []
    t, done, gone, freed_res, freed_used = end, 0, 0, 0, 0
    while True:
        m = stop - done
        if m > 0:
            ends = executor.decode_ends(k, kv, m, t, next_arrival if join else None)
            m = len(ends)
            res0, used0 = mem.slots_reserved, mem.slots_used
            reserved_steps = mem.decode_reserved(decoding, m)
            if reserved_steps is not None and freed_res:
                reserved_steps = [v - freed_res for v in reserved_steps]
            mem.grow_all(decoding, m)
            dres, dused = (mem.slots_reserved - res0) // m, (mem.slots_used - used0) // m
            segments.append(Segment(ends, decoding, done, k, res0 - freed_res + dres, used0 - freed_used + dused,
                                    dres, dused, reserved_steps))
            t, done, kv = float(ends[-1]), done + m, kv + k * m
            if done < stop:
                break                           # cut: an arrival may join at the next step
        if not span:
            break
        first_gone = gone                       # the requests with `stop` decodes left finish here
        while gone < len(left) and left[gone] == stop:
            gone += 1
        if seat_goes:
            for r in finishing[first_gone:gone]:
                stored = r.prompt_len + r.output_len - 1
                kv, k = kv - stored, k - 1
                if not cfg.static:
                    res, used = mem.freed_by(r, stored)
                    freed_res, freed_used = freed_res + res, freed_used + used
        if gone == len(left):
            break                               # everyone is done (a static batch ends)
        decoding, stop = finishing[gone:], left[gone]
        join = next_arrival is not None and not cfg.static     # a seat is free now
        if join and next_arrival <= t:
            break
    if not segments:
        return None
    batch.n_steps = 1 + done
    sched.n_batches += done
    return segments
