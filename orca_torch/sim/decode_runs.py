"""Runs of decode steps, in bulk: their totals, their end times, and how many the memory fits (lecture §4.1).

The fast engine (`fast_engine.py`) prices and records many decode steps at once where the
scheduler would choose the same requests, one more token each, step after step. What it needs
beyond one step is here, outside the core:
- `decode_step_totals`: step `j` of such a run, from two numbers;
- `steps_to_price`: how many steps of a run to price before an arrival cuts it;
- `step_ends`: the run's durations summed into end times with the same float additions as the
  step-by-step loop (`t += d`, in order), so the timestamps are exactly those of one step at a time;
- `decode_room`, `decode_grow` and `decode_reserved`, keyed on the memory manager's type: how many
  such steps fit without a preemption, the growth of that many at once, and the slots reserved
  after each when they do not grow evenly (blocks).
  A manager of another type is not known here: the fast engine steps it one iteration at a time.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from orca_torch.checks import brief, is_real
from orca_torch.core.batch import StepTotals, step_totals
from orca_torch.core.durations import check_clock, check_duration
from orca_torch.core.memory import MemoryManager, ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.request import Request


def decode_step_totals(n_seqs: int, ctx_sum: int, j: int = 0) -> StepTotals:
    """Step `j` of a run of pure decodes: `n_seqs` sequences whose stored tokens summed to `ctx_sum`
    before step 0 (each step stores one more apiece), as the scheduler's `step_totals` sums them."""
    return step_totals((), n_seqs, ctx_sum + n_seqs * j)


def steps_to_price(m: int, first_s: float, t: float, stop_at: float | None) -> int:
    """How many of a run's `m` decode steps to price when the first, starting at `t`, lasts
    `first_s` and the run ends at the first end at or after `stop_at`: guessed as if steps only got
    longer, so that the cut comes within `(stop_at - t) / first_s + 1` steps. Where they do not, the
    run just ends before `stop_at` and the fast engine goes on from there. All `m` when nothing cuts
    the run, or when `first_s` is no positive finite number (`step_ends` refuses one that is no
    duration)."""
    if stop_at is None or m <= 1 or not ((type(first_s) is float or is_real(first_s)) and 0 < first_s < math.inf):
        return m
    return min(m, int(min((stop_at - t) / first_s, m)) + 2)    # (the quotient may overflow to inf)


SHORT_RUN = 32
"""Runs up to this many steps are summed in plain Python: cheaper than numpy's cost per call."""


def step_ends(ds, m: int, t: float, stop_at: float | None) -> list[float] | np.ndarray:
    """End times `t + d0`, `t + d0 + d1`, ... (the float additions of the step-by-step loop, in
    order) of `m` durations, up to and including the first end at or after `stop_at`; checked, as
    the engine checks a step's, up to that end (a duration past it is no step of the run)."""
    if getattr(ds, "ndim", 1) != 1 or not hasattr(ds, "__len__") or len(ds) != m:   # (a 0-d array has no len)
        raise RuntimeError(f"executor.decode_durations returned {np.shape(ds)} durations, expected ({m},)")
    if m <= SHORT_RUN or getattr(ds, "dtype", None) is None or ds.dtype.kind != "f" or not (
            ds.min() >= 0 and ds.max() < math.inf):  # (where one is no duration, only those up to the cut are checked)
        ends = []
        for d in (ds.tolist() if isinstance(ds, np.ndarray) else ds):
            if type(d) is not float or not 0.0 <= d < math.inf:     # (NaN fails too)
                check_duration(d)
                d = float(d)
            end = t + d
            if not end < math.inf or end == t:
                check_clock(end, d, t)
            t = end
            ends.append(t)
            if stop_at is not None and t >= stop_at:
                break
        return ends
    ds = np.array(ds, dtype=float)
    d0 = float(ds[0])
    with np.errstate(over="ignore"):        # (an overflow is reported below, as an error)
        ds[0] += t
        ends = ds.cumsum()
    if stop_at is not None:                 # (an overflow past the cut is no step of the run)
        ends = ends[:int(np.searchsorted(ends, stop_at, side="left")) + 1]
    if not math.isfinite(ends[-1]):         # a sum past the largest float: the step that crossed it
        i = int(np.argmax(~np.isfinite(ends)))
        check_clock(ends[i], d0 if i == 0 else float(ds[i]), t if i == 0 else float(ends[i - 1]))
    if ends[0] == t:
        check_clock(float(ends[0]), d0, t)
    lost = np.flatnonzero((ends[1:] == ends[:-1]) & (ds[1:len(ends)] > 0))
    if len(lost):
        check_clock(float(ends[lost[0] + 1]), float(ds[lost[0] + 1]), float(ends[lost[0]]))
    return ends


# ---- the memory managers ------------------------------------------------------------------------------
KNOWN_MEMORY = (ReservationMemory, TokenMemory, UnlimitedMemory, PagedMemory)
"""The managers whose decode room and growth are known here (exactly these types: a subclass may
grow its own way)."""


def decode_room(mem: MemoryManager, running: Sequence[Request], cap: int | None = None) -> int | None:
    """Steps of one more token per running request that fit without a preemption (None: any), or
    `cap` where at least that many fit (the run stops there anyway: no need to know how many more)."""
    kind = type(mem)
    if kind is TokenMemory:                 # each holds exactly what it stores: a slot apiece a step
        if mem.n_slots is None or not running:
            return None
        room = (mem.n_slots - mem.slots_reserved) // len(running)
        return room if cap is None else min(room, cap)
    if kind is PagedMemory:
        return _paged_decode_room(mem, running, cap)
    return None                             # a reservation covers every token; no limit has no end


def decode_reserved(mem: MemoryManager, running: Sequence[Request], m: int) -> list[int] | None:
    """`slots_reserved` after each of the next `m` steps of one more token per running request,
    where it may grow by different amounts from one step to the next (blocks, taken a whole block
    at a time); None where it grows by the same amount every step (then the first and last say it all)."""
    return _paged_decode_reserved(mem, running, m) if type(mem) is PagedMemory else None


def decode_grow(mem: MemoryManager, running: Sequence[Request], m: int) -> None:
    """Each running request stores `m` more tokens, `m` steps of decodes within `decode_room`: the
    same as `m` calls of `grow_all` (one addition where every token is a slot: a reservation, or
    no limit)."""
    kind = type(mem)
    if kind is ReservationMemory:           # within the reservation, which covers every token
        mem.slots_used += m * len(running)
    elif kind is UnlimitedMemory:           # each holds all it stores: every token is a new slot
        mem.slots_used += m * len(running)
        mem.slots_reserved += m * len(running)
    else:
        for r in running:
            grown = mem.grow(r, m)
            assert grown, f"{type(mem).__name__}.grow({brief(r.req_id)}, {m}) refused growth within decode_room"


def _paged_decode_room(mem: PagedMemory, running: Sequence[Request], cap: int | None) -> int | None:
    """The largest `s` with sum_i ceil((s - room_i) / block_size) <= free blocks, room_i the empty
    tail of request i's last block (at most `cap`: one sum says whether `cap` fits, most often it does)."""
    if not running:
        return None
    if cap is not None and cap <= 0:
        return cap
    bs = mem.block_size
    room = np.array([mem.tail_room(r) for r in running], dtype=np.int64)
    free = mem.blocks_free

    def blocks_needed(s: int) -> int:
        return int(np.maximum(-(-(s - room) // bs), 0).sum())

    lo, hi = 0, int(room.min()) + free * bs + 1      # s = hi needs > free blocks for the tightest request
    if cap is not None and cap < hi:
        if blocks_needed(cap) <= free:
            return cap
        hi = cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if blocks_needed(mid) <= free:
            lo = mid
        else:
            hi = mid
    return lo


def _paged_decode_reserved(mem: PagedMemory, running: Sequence[Request], m: int) -> list[int]:
    """Blocks are taken a whole block at a time: request i takes one at step `room_i + 1` (its last
    block full), then every `block_size` steps. Counting the first-block steps per residue of the
    step index modulo `block_size` gives the blocks taken at every step at once."""
    bs = mem.block_size
    first = np.array([mem.tail_room(r) + 1 for r in running], dtype=np.int64)
    marks = np.bincount(first[first <= m], minlength=m + 1)          # steps 0 .. m
    rows = -(-(m + 1) // bs)
    per_step = np.pad(marks, (0, rows * bs - (m + 1))).reshape(rows, bs).cumsum(axis=0).ravel()
    return (mem.slots_reserved + bs * np.cumsum(per_step[1:m + 1])).tolist()
