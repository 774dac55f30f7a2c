"""The fast engine: the core engine's run, runs of decode steps priced and recorded in bulk (lecture §4.1).

`FastEngine` is an `Engine` over the same scheduler, memory managers and a `PricedExecutor` (the
paper GPU, or any step-time function). It schedules, executes and records a step exactly as
`Engine` does; then, where the steps that follow are certain to be the same requests decoding one
token apiece (`decodes_follow`: every running request is in the step, none was preempted, every
prompt in it is done by this step, and the queue cannot be admitted before a finish), it takes
them without scheduling them one by one: `m = min(steps to the next finish, decode_room(memory),
steps to the next arrival that could join)` decode steps, priced with `executor.decode_ends`
(their durations summed into end times), the memory grown by `m` tokens per request, and the
requests advanced in one pass (`_complete_run`). Nothing in the core knows of this.

When the memory cannot run out (Orca's reservation, or no limit) and nobody waits, or the batch
is a static one, a finish changes nothing for the others: the run goes on past it as the next
decode segment, one request fewer (or, for static batching's idle seats, the same seats). The finished
request is let go at its own step (`Scheduler.finish`: its seat and memory given back), so the
memory the run logs, and what the queue finds, are the true ones.

Where the memory cannot run out and every step holds every running request whole (Orca's mixed
steps, no token budget, not static), a step that admits does not end the run either: the step
after an arrival, or after a finish while someone waits, is the running requests' decodes plus
whoever the core's `Scheduler.admit` lets in, exactly as `schedule` would choose it (a whole
`Batch` priced by `executor.execute`), and the run goes on with the newcomers decoding too.
Until the next finish nothing frees a seat or memory (a manager that cannot run out gives room
back only through `free`: `MemoryManager`'s contract), so a head left waiting stays waiting:
FCFS tries again only after a finish, SPF also after an arrival, which may go before the head.
Nor does it end when everyone is done: the next step is then the queue's, or, where nobody
waits, the next arrival's, which starts when that request arrives (the step-by-step loop idles
until then, `Engine.next_batch`). Arrivals that could not join are queued when the run ends, as
the step-by-step loop would have queued them by its last step. A run stops at the first step that
admits after `MAX_RUN` segments and joins, so what a call keeps stays bounded.

The timestamps are those of the step-by-step loop exactly: the same float additions, in order
(`t + d0 + d1 + ...` across segments and joins). Every token time, every step's columns, the
release times, the preemptions and the trace equal those of `Engine` stepped one iteration at a
time (`tests/test_fast_engine.py`). A run's bookkeeping stays compact: `RunStepLog` keeps a
decode segment as a few numbers and its end times, `RunTokenSteps` a request's tokens in a
segment as its first slot, first step and count, and never builds the token column: the result
holds the runs (`token_steps.TokenRuns`, a request decoding without a break is one run), the
summary reads them, and the column is built only for a caller that reads `RunResult.token_step`.
`run()` pauses Python's cyclic garbage collector (`collector.py`).
"""
from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Literal

import numpy as np

from orca_torch.checks import check_instance
from orca_torch.core.batch import Batch, ScheduledSeq, step_totals
from orca_torch.core.engine import Engine
from orca_torch.core.memory import MemoryManager
from orca_torch.core.policies import policy_for
from orca_torch.core.request import Request, Status
from orca_torch.core.run_result import RunResult, TraceStep
from orca_torch.core.scheduler import NO_LIMIT, NO_WORK, Scheduler
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.core.step_log import StepLog, narrow_ints
from orca_torch.core.token_steps import MAX_STEPS, TokenRuns, TokenSteps
from orca_torch.sim.collector import cyclic_gc_paused
from orca_torch.sim.decode_runs import KNOWN_MEMORY, decode_grow, decode_reserved, decode_room
from orca_torch.sim.executors import PricedExecutor, prices_decodes_by_step_time

MAX_RUN = 256
"""A run stops at the first step that admits after this many segments and joins, so what a call
keeps until it completes (who joined, the log's pending segments) stays bounded."""

_NOT_LIVE = ("FastEngine simulates a known list of requests on the paper GPU; a live run (start_live, add, abort, "
             "forget_done) needs Engine")


# ---- compact bookkeeping ---------------------------------------------------------------------------
class RunTokenSteps(TokenSteps):
    """`TokenSteps` kept as runs, with no column: a request's tokens made one a step from a step on
    are noted as three numbers (`note_run`), and the tokens the core writes one at a time (a step
    taken alone, `Scheduler.complete`: `view[slot] = step`) go into a dict, `view`. At the end
    they are sorted into `TokenRuns`, which `RunResult` keeps: the column is built only if a
    caller reads `token_step`."""

    def __init__(self, tokens: TokenSteps) -> None:
        """Takes the place of `tokens` (a new run's, nothing written yet), leaving its column unused.
        `TokenSteps.__init__` is not called: there is no column (`steps`), which only a live run's
        calls would need (`extend`, refused below, and `Scheduler.forget`), and FastEngine refuses
        a live run."""
        self.first, self.n_tokens = tokens.first, tokens.n_tokens
        self.view: dict[int, int] = {}          # slot -> step, for the tokens written one at a time
        self._start = array("q")                # a noted run of tokens: the step that made its first,
        self._slots = array("q")                # the slot of its first
        self._counts = array("q")               # and its token count (one a step)

    def extend(self, output_len: int) -> None:
        """Never called: only a live run grows by a request (`Engine.add`)."""
        raise AssertionError(f"RunTokenSteps keeps no column to extend: {_NOT_LIVE}")

    def note_run(self, starts: list[int], counts: list[int], slots: list[int]) -> None:
        """Steps `starts[i], starts[i] + 1, ...` made `counts[i]` tokens from slot `slots[i]` on, one a step."""
        self._start.fromlist(starts)
        self._slots.fromlist(slots)
        self._counts.fromlist(counts)

    def made(self, step_count: int) -> TokenRuns:
        """The noted runs and the single tokens, in slot order, checked to tile every slot once, and
        joined where a run goes on where the one before it stopped (next slot, next step, the same
        request): the fewest runs, those `TokenRuns.of_column` finds in the column."""
        view = self.view
        slot = np.concatenate((np.frombuffer(self._slots, dtype=np.int64), np.fromiter(view, np.int64, len(view))))
        start = np.concatenate((np.frombuffer(self._start, dtype=np.int64),
                                np.fromiter(view.values(), np.int64, len(view))))
        count = np.concatenate((np.frombuffer(self._counts, dtype=np.int64), np.ones(len(view), dtype=np.int64)))
        order = np.argsort(slot, kind="stable")
        slot, start, count = slot[order], start[order], count[order]
        keep = count > 0
        slot, start, count = slot[keep], start[keep], count[keep]
        # They tile the slots 0 .. n_tokens - 1: the first starts at 0, each other where the one before ended.
        assert np.array_equal(np.append(slot, self.n_tokens), np.append(0, slot + count)), \
            "the token runs do not cover every slot once"
        starts_run = np.ones(len(slot), dtype=bool)         # a run starts where its first step does not
        starts_run[1:] = start[1:] != start[:-1] + count[:-1]    # follow the last of the run before,
        starts_run[np.searchsorted(slot, self.first)] = True     # or where a request's tokens begin
        at = np.flatnonzero(starts_run)
        return TokenRuns(slot[at], start[at], np.diff(slot[at], append=self.n_tokens))


class RunStepLog(StepLog):
    """`StepLog` that also takes a decode segment at once: its steps share their sequence count and
    grow their memory evenly (or as listed), so a segment is a few numbers and its end times.

    Every `FLUSH` steps the pending entries are appended to the run's six columns, typed arrays
    (`array.array`) that grow by `realloc` (which, with glibc, remaps a block above its mmap
    threshold rather than copying it, and writes nothing ahead; glibc raises that threshold, up to
    32 MiB, each time a mapped block is freed, so a column below it may be copied as it grows),
    rather than into chunks joined at the end: joining copies the whole log once more, and the
    chunks it frees are left to the allocator, which keeps them (a million-request run's columns
    are half a gigabyte). `columns()` returns numpy views of them; while a caller holds those, each
    flush goes on in a copy. A log that never reaches `FLUSH` steps (or is read before it does)
    keeps `StepLog`'s chunks instead."""

    def __init__(self) -> None:
        super().__init__()
        self._cols: list[array] = []            # start, end, n_seqs, n_tokens, reserved, used

    def _assemble(self) -> None:
        """Steps `base .. n_steps - 1` from the pending entries onto the columns (an int column becomes
        int64 for good once a value leaves int32, as `step_log.narrow_ints` keeps it); a short log
        (or one read before its first flush) as one chunk, as `StepLog` keeps it."""
        starts, ends, counts = self._pending()
        if not self._cols and (self.chunks or self.n_steps < self.FLUSH):
            self.chunks.append((starts, ends, *(narrow_ints(c) for c in counts)))
        else:
            if not self._cols:
                self._cols = [array("d"), array("d")] + [array("i") for _ in counts]
            for j, values in enumerate((starts, ends, *counts)):
                col = self._cols[j]
                if col.typecode == "i" and len(values) and not (-2**31 <= values.min() and values.max() < 2**31):
                    wide = array("q")
                    wide.frombytes(memoryview(np.frombuffer(col, dtype="i").astype(np.int64)).cast("B"))
                    col = self._cols[j] = wide
                values = memoryview(values.astype(col.typecode, copy=False)).cast("B")
                try:
                    col.frombytes(values)
                except BufferError:             # `columns()` read mid-run and still held: go on in a copy
                    col = self._cols[j] = col[:]
                    col.frombytes(values)
        self._new()
        self.base = self.n_steps

    def columns(self) -> tuple[np.ndarray, ...]:
        if self.n_steps > self.base:
            self._assemble()
        if not self._cols:
            return super().columns()
        return tuple(np.frombuffer(c, dtype=c.typecode) for c in self._cols)

    def _new(self) -> None:
        super()._new()
        self._run_i = array("q")                # a segment: its first index, m, n_seqs, reserved, its
        self._run_start = array("d")            # growth a step, used, its growth; its first step's start
        self._ends = array("d")                 # every step's end, the single steps' too, in step order
        self._uneven: list[tuple[int, list[int]]] = []    # (first step, reserved per step) of uneven segments

    def add(self, start: float, end: float, n_seqs: int, n_tokens: int, reserved: int, used: int) -> None:
        self._ends.append(end)
        super().add(start, end, n_seqs, n_tokens, reserved, used)

    def add_run(self, start: float, ends: list[float] | np.ndarray, n_seqs: int, reserved: int,
                reserved_per_step: int, used: int, used_per_step: int,
                reserved_steps: list[int] | None = None) -> None:
        """`m = len(ends)` decode steps of `n_seqs` sequences, the first starting at `start`; the
        memory in the first is `reserved`, `used`, and grows by the per-step amounts (or, where
        `reserved_steps` is given, the slots reserved are those, step by step)."""
        m = len(ends)
        self._run_i.extend((self.n_steps, m, n_seqs, reserved, reserved_per_step, used, used_per_step))
        self._run_start.append(start)
        if type(ends) is list:
            self._ends.fromlist(ends)
        else:
            assert ends.dtype == np.float64, ends.dtype
            self._ends.frombytes(ends.tobytes())
        if reserved_steps is not None:
            self._uneven.append((self.n_steps, reserved_steps))
        self.n_steps += m
        if self.n_steps - self.base >= self.FLUSH:
            self._assemble()

    def _pending(self) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
        """The pending steps' start and end times and their counts (n_seqs, n_tokens, reserved,
        used), in order. The segments and the single steps between them (each a segment of one
        step) are merged as records, a few numbers each; a count column is then each record's
        value repeated over its steps, the memory also growing by its growth a step within a
        segment (`_grown`)."""
        n = self.n_steps - self.base
        ends = np.frombuffer(self._ends, dtype=np.float64)  # (every step's, in step order)
        one_t = np.frombuffer(self._step_times, dtype=np.float64).reshape(-1, 2)
        one_i = np.frombuffer(self._step_counts, dtype=np.int64).reshape(-1, 4)
        if not len(self._run_i):
            return one_t[:, 0].copy(), ends, tuple(one_i.T.copy())
        first, ms, n_seqs, reserved, reserved_per_step, used, used_per_step = \
            np.frombuffer(self._run_i, dtype=np.int64).reshape(-1, 7).T
        in_runs = np.cumsum(ms)                 # steps in the segments up to each one's end
        singles_before = first - self.base - (in_runs - ms)
        n_seg, n_one = len(ms), len(one_t)
        seg_before = np.searchsorted(singles_before, np.arange(n_one), side="right")
        one_at = np.arange(n_one) + np.concatenate(([0], in_runs))[seg_before]     # the single steps' indices
        rec_seg, rec_one = np.arange(n_seg) + singles_before, np.arange(n_one) + seg_before    # record order
        recs = np.zeros((7, n_seg + n_one), dtype=np.int64)
        rec_m, rec_seqs, rec_tokens, rec_reserved, rec_rps, rec_used, rec_ups = recs
        recs[:, rec_seg] = ms, n_seqs, n_seqs, reserved, reserved_per_step, used, used_per_step
        rec_m[rec_one] = 1
        for rec, col in zip((rec_seqs, rec_tokens, rec_reserved, rec_used), one_i.T):
            rec[rec_one] = col
        at = np.cumsum(rec_m) - rec_m           # each record's first step
        starts = np.empty(n)                    # each step starts as the one before it ends,
        starts[1:] = ends[:-1]
        starts[at[rec_seg]] = np.frombuffer(self._run_start, dtype=np.float64)   # but a segment's first
        starts[one_at] = one_t[:, 0]
        counts = (np.repeat(rec_seqs, rec_m), np.repeat(rec_tokens, rec_m),
                  _grown(rec_reserved, rec_rps, rec_m, at), _grown(rec_used, rec_ups, rec_m, at))
        for n0, reserved_steps in self._uneven:
            counts[2][n0 - self.base:n0 - self.base + len(reserved_steps)] = reserved_steps
        return starts, ends, counts


def _grown(v: np.ndarray, per_step: np.ndarray, m: np.ndarray, at: np.ndarray) -> np.ndarray:
    """`v[j] + per_step[j] s` at step `s` of record `j` (`m[j]` steps long, starting at step `at[j]`):
    a running sum of the growth, each record's first step jumping from the last value of the one
    before (integers: exact)."""
    if not per_step.any():
        return np.repeat(v, m)
    d = np.repeat(per_step, m)
    last = v + per_step * (m - 1)
    d[at] = v - np.concatenate(([0], last[:-1]))
    return np.cumsum(d, out=d)


# ---- a run's pieces -------------------------------------------------------------------------------
@dataclass(slots=True)
class DecodeRun:
    """What one `FastEngine.step()` covered: its batch, then `n_steps - 1` more steps; `joined`
    lists who was admitted inside them, each with the step that prefilled it."""

    batch: Batch
    n_steps: int = 1
    joined: list[tuple[Request, int]] = field(default_factory=list)


class FinishOrder:
    """The requests decoding in a run, in the order they finish: `reqs[i]` makes its last token in
    the run's step `at[i]` (counted from the batch, step 0); those before `n_gone` are done."""

    __slots__ = ("at", "reqs", "n_gone")

    def __init__(self, reqs: list[Request], left: list[int]) -> None:
        """`reqs[i]` needing `left[i]` more decodes after the batch, sorted by it (stably)."""
        order = sorted(range(len(left)), key=left.__getitem__)
        self.at = list(map(left.__getitem__, order))
        self.reqs = list(map(reqs.__getitem__, order))
        self.n_gone = 0

    def take_done(self, done: int) -> list[Request]:
        """Those that made their last token in step `done`, now counted as gone."""
        at, first = self.at, self.n_gone
        n = first
        while n < len(at) and at[n] == done:
            n += 1
        self.n_gone = n
        return self.reqs[first:n]

    def add(self, req: Request, at: int) -> None:
        """`req` joined and makes its last token in step `at` (after those that finish then already)."""
        i = bisect_right(self.at, at, self.n_gone)
        self.at.insert(i, at)
        self.reqs.insert(i, req)


class _RunSoFar:
    """Where a run being taken after `batch` stands: the steps taken since the batch (`done`), when
    the last one started and ended, and the next decode step's sequences and their stored tokens."""

    __slots__ = ("batch", "t", "last_start", "n_seqs", "ctx_sum", "next_arrival", "join", "done", "n_taken",
                 "joined", "finished_now", "base", "known")

    def __init__(self, batch: Batch, t: float, next_arrival: float | None, join: bool) -> None:
        self.batch = batch
        self.t = self.last_start = t            # the end of the last step taken (the batch's, at first), its start
        self.n_seqs = batch.totals.n_seqs       # the sequences of the next decode step,
        self.ctx_sum = batch.totals.kv_read_tokens   # their stored tokens before it
        self.next_arrival = next_arrival
        self.join = join                        # may the next arrival join before the next finish?
        self.done = 0                           # steps taken after the batch
        self.n_taken = 0                        # segments and joins taken
        self.joined: list[tuple[Request, int]] = []   # (who joined, the step that admitted it)
        self.finished_now: list[Request] = []   # made their last token in step `done`, not let go yet
        self.base: dict[Request, int] | None = None   # request -> tokens it stores after the run's step j, less j
        self.known: dict[Request, tuple[int, int]] | None = None  # (tracing) `base`, and its place in the step


class JoinWorks(Sequence):
    """A join step's `works`, for an executor that prices from the totals (`reads_works = False`)
    in a run that keeps no trace: `ScheduledSeq(r, 1, n_past)` for each decode, then the prefills,
    built (once) only if read, so the run does not build the hundreds of decode works of every such
    step that nobody reads. `base` is the run's request -> tokens stored after its step j, less j;
    an entry never changes once set, so the works are the step's whenever they are read."""

    __slots__ = ("decoding", "base", "done", "new", "_works")

    def __init__(self, decoding: list[Request], base: dict[Request, int], done: int, new: list) -> None:
        self.decoding, self.base, self.done, self.new = decoding, base, done, new
        self._works: list | None = None

    def as_list(self) -> list[ScheduledSeq]:
        if self._works is None:
            base, done = self.base, self.done
            self._works = [ScheduledSeq(r, 1, base[r] + done) for r in self.decoding] + self.new
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


# ---- when a run may go on -------------------------------------------------------------------------------
def decodes_follow(sched: Scheduler, batch: Batch) -> bool:
    """Will the steps after `batch` be one decode for each of its requests, and nothing else, until
    a request finishes or an arrival joins? True when the batch holds every running request, none
    was preempted, every prompt in it is done by this step, and the queue cannot be admitted
    before a finish (nothing frees memory or seats; a token budget would have room once these
    prompts are done, so with a budget and an admission in this step the queue must be empty).
    The decodes come first in `works`, then whoever caught up or was admitted."""
    works = batch.works
    if batch.preempted or len(works) != len(sched.running):
        return False
    admitted = bool(batch.swapped_in)
    for r, n_new, n_past in (works if admitted else reversed(works)):
        if n_past + n_new != r.prompt_len + r.n_generated:
            return False                        # a chunk: its prompt goes on next step
        if n_new == 1 and r.n_generated:
            if not admitted:
                break                           # a decode: the ones before it are decodes too
        else:
            admitted = True
    return not (admitted and sched.waiting and sched.cfg.max_num_batched_tokens is not None)


def arrival_may_join(sched: Scheduler, leaving: int = 0) -> bool:
    """Could a request arriving now be admitted before the next finish (`leaving` running requests
    about to be let go)? If not, arrivals during the decodes change nothing, and the run may go
    past them. Under FCFS a request that waits goes first, and stays refused until a finish."""
    cfg = sched.cfg
    return (not cfg.static and len(sched.running) - leaving < cfg.max_bs
            and (cfg.order != "fcfs" or not sched.waiting))


def takes_admissions(sched: Scheduler) -> bool:
    """May the run take steps that admit (arrivals, or the queue after a finish)? When the memory
    cannot run out and every step holds every running request whole (no token budget, no
    prefill-only steps, not static), such a step is the running requests' decodes plus whoever
    `Scheduler.admit` lets in: the run takes it and goes on."""
    cfg = sched.cfg
    return (not cfg.static and cfg.prefill == "mixed" and cfg.max_num_batched_tokens is None
            and not sched.memory.can_run_out)


def spans_finishes(sched: Scheduler, admitting: bool) -> bool:
    """Are the steps after a finish still the survivors' decodes, or a step the run takes
    (`admitting`: `takes_admissions(sched)`)?"""
    return sched.cfg.static or admitting or not (sched.memory.can_run_out or sched.waiting)


# ---- the engine ----------------------------------------------------------------------------------------
class FastEngine(Engine):
    """`Engine` on a `PricedExecutor`, with runs of decode steps taken in bulk; the same `RunResult`.

    `step()` runs the next iteration and, where the fast path applies, the steps that follow it
    (`last_run` says how many, and who joined inside them). Pipelined runs (`n_workers > 1`), and
    runs whose memory manager, scheduler or executor the shortcuts above were not written for (a
    memory manager of a type other than those in `decode_runs.KNOWN_MEMORY`, a scheduler other
    than the class `policy_for(config)` names, both exactly, or an executor that does not price
    decodes alike in `execute` and in bulk: `PricedExecutor.decodes_by_step_time`), go one step a
    call, as `Engine`: a new policy or cost is right here before it is fast. A run taken in bulk
    never preempts (it ends where `decode_room` says a decode would not fit), so the victim,
    `Scheduler.victim`, is always chosen in a step the core schedules.
    """

    def __init__(self, executor: PricedExecutor, memory: MemoryManager, config: SchedulerConfig | None = None,
                 max_context: int | None = None, trace: bool = False,
                 scheduler: type[Scheduler] | None = None) -> None:
        check_instance("executor", executor, PricedExecutor)
        super().__init__(executor, memory, config, max_context, trace, scheduler)
        self._batch: Batch | None = None         # the last call's first batch,
        self._run: DecodeRun | None = None       # and the last run taken in bulk

    def start(self, requests: Sequence[Request], on_invalid: Literal["raise", "reject"] = "raise") -> None:
        """`Engine.start`, then the run's step log, and where runs of steps may be taken its token
        steps, kept by the kinds that also note a run of steps at once (the core knows nothing of
        them; its column, allocated but never written, is dropped untouched). A run stepped one
        iteration at a time (pipelined, or a policy, memory or pricer the runs are not written for)
        writes the core's column, as `Engine` does."""
        super().start(requests, on_invalid)
        self.log = RunStepLog()
        self._fast = (self._pipeline is None and type(self.memory) in KNOWN_MEMORY
                      and type(self.scheduler) is policy_for(self.config) and prices_decodes_by_step_time(self.executor))
        if self._fast:                          # (a run stepped one at a time writes the core's column)
            self.scheduler.tokens = RunTokenSteps(self.scheduler.tokens)
        self._batch = self._run = None

    def start_live(self) -> None:
        """A live run is served on the real clock (`Engine` with the torch executor): refused here,
        as are `add`, `abort` and `forget_done`, which belong to one."""
        raise ValueError(_NOT_LIVE)

    def add(self, req: Request) -> None:
        raise ValueError(_NOT_LIVE)

    def abort(self, req: Request) -> None:
        raise ValueError(_NOT_LIVE)

    def forget_done(self) -> int:
        raise ValueError(_NOT_LIVE)

    @property
    def last_run(self) -> DecodeRun | None:
        """What the last call of `step()` that returned a batch covered (a call that returns None,
        the run over, covers nothing and leaves it as it was; None before the first batch of a
        run, and for a pipelined run)."""
        if self._run is not None and self._run.batch is self._batch:
            return self._run
        return None if self._batch is None else DecodeRun(self._batch)

    def run(self, requests: Sequence[Request], on_invalid: Literal["raise", "reject"] = "raise",
            progress: Callable[[int, int], None] | None = None) -> RunResult:
        with cyclic_gc_paused():
            return super().run(requests, on_invalid, progress)

    def _step(self) -> Batch | None:
        batch = self.next_batch()
        if batch is None:
            return None
        res = self.execute_and_record(batch)
        self._batch = batch
        if self._fast and res.tokens is None and decodes_follow(self.scheduler, batch):
            run = self._decodes_after(batch)
            if run is not None:
                self._run = run
                self._complete_run(run)
                return batch
        self.complete(batch, res.tokens, res.logprobs)
        return batch

    # ---- taking the run -----------------------------------------------------------------------------
    def _decodes_after(self, batch: Batch) -> DecodeRun | None:
        """The steps after `batch` (which ends at `self.t`) taken in bulk, or None where the next
        step is one only the engine may take.

        The idea: between admissions, every running request decodes one token a step, so the steps
        up to the next finish (or the memory's room, or an arrival that could join) are the same
        requests one token longer each step: a *decode segment*, priced at once
        (`executor.decode_ends`), logged as a few numbers and grown in one call (`_take_segment`).
        Where the run spans finishes (`spans_finishes`), a finish only ends a segment: the next one
        is the survivors'. Where it also takes admissions (`takes_admissions`), the step after an
        arrival, or after a finish while someone waits, is built by the core's `Scheduler.admit`
        (`_take_join`), and the segments go on with the newcomers. Each step is committed as it is
        taken (memory, log, trace, those let go); `_complete_run` then brings the requests up to date.
        """
        sched = self.scheduler
        next_arrival = self.next_arrival
        join = next_arrival is not None and arrival_may_join(sched)
        admitting = takes_admissions(sched)
        if join and next_arrival <= self.t and not admitting:
            return None                         # an arrival joins the next step
        run = _RunSoFar(batch, self.t, next_arrival, join)
        if self.trace_steps is not None:
            run.known = {r: (n_past + n_new, i) for i, (r, n_new, n_past) in enumerate(batch.works)}
        decoding = sched.running                # every running request is in the batch (read before completing)
        left = [r.output_len - r.n_generated - 1 for r in decoding]   # decodes each needs after the batch
        if spans_finishes(sched, admitting):
            self._segments_and_joins(run, FinishOrder(decoding, left), admitting)
        else:                                   # a finish ends the run: one segment, within the memory's room
            stop = min(left)
            room = decode_room(self.memory, decoding, stop)
            if room is not None:
                stop = room
            if stop > 0:
                self._take_segment(run, decoding, stop)
        if not run.n_taken:
            return None
        self.t = run.last_start                 # the queue as a step of its own leaves it: who came by the last step
        self.admit_arrivals()
        self.t = run.t
        sched.n_batches += run.done
        return DecodeRun(batch, 1 + run.done, run.joined)

    def _segments_and_joins(self, run: _RunSoFar, finishes: FinishOrder, admitting: bool) -> None:
        """Decode segments from finish to finish, and, where the run takes admissions, the steps
        that admit between them, until a step only the engine may take (or `MAX_RUN` are taken)."""
        sched = self.scheduler
        seat_goes = not (sched.cfg.static and sched.cfg.static_idle_seats_cost)  # (else a finished seat keeps costing)
        while True:
            if finishes.n_gone < len(finishes.at) and finishes.at[finishes.n_gone] == run.done:
                run.finished_now = finishes.take_done(run.done)     # (else none finish: no call, the common case)
            if seat_goes:
                for r in run.finished_now:
                    run.ctx_sum, run.n_seqs = run.ctx_sum - (r.prompt_len + r.output_len - 1), run.n_seqs - 1
            idle = finishes.n_gone == len(finishes.at)
            if idle:                            # everyone is done: a static batch ends; a run that admits goes
                if not admitting or (run.next_arrival is None and not sched.waiting):  # on with the queue or,
                    return                      # idle until then, the next arrival
            elif run.finished_now:
                run.join = run.next_arrival is not None and arrival_may_join(sched, len(run.finished_now))
            if not (idle or (admitting and run.finished_now and sched.waiting)     # (the queue may take their place)
                    or (run.join and run.next_arrival <= run.t)):   # no step that admits comes next
                stop = finishes.at[finishes.n_gone]             # the next finish
                self._take_segment(run, finishes.reqs[finishes.n_gone:], stop - run.done)
                if run.done == stop:
                    continue                    # a finish
            if not admitting or run.n_taken >= MAX_RUN:
                return                          # a step that admits follows: the engine schedules it
            self._take_join(run, finishes, idle)

    def _take_segment(self, run: _RunSoFar, decoding: list[Request], steps: int) -> None:
        """Up to `steps` decode steps of `decoding`, the first starting at `run.t`, ended early at the
        first end at or after an arrival that could join: priced, logged, traced, the memory grown,
        and those that finished before it let go."""
        mem, t, n_seqs = self.memory, run.t, run.n_seqs
        ends = self.executor.decode_ends(n_seqs, run.ctx_sum, steps, t, run.next_arrival if run.join else None)
        m = len(ends)
        if run.finished_now:
            self._let_go_finished(run)
        res0, used0 = mem.slots_reserved, mem.slots_used
        reserved_steps = decode_reserved(mem, decoding, m)
        decode_grow(mem, decoding, m)
        res_step, used_step = (mem.slots_reserved - res0) // m, (mem.slots_used - used0) // m
        self.log.add_run(t, ends, n_seqs, res0 + res_step, res_step, used0 + used_step, used_step, reserved_steps)
        if run.known is not None:
            self._trace_segment(run.batch.index + 1 + run.done, t, ends, decoding, run.done, run.known)
        run.n_taken += 1
        run.last_start = float(ends[-2]) if m > 1 else t
        run.t, run.done, run.ctx_sum = float(ends[-1]), run.done + m, run.ctx_sum + n_seqs * m

    def _take_join(self, run: _RunSoFar, finishes: FinishOrder, idle: bool) -> None:
        """The step that admits (`_join_step`): those who finished go first, the clock waits for the
        next arrival where nothing runs and nobody waits, and whoever it admits joins `finishes`."""
        sched = self.scheduler
        if run.base is None:
            run.base = {r: n_past + n_new for r, n_new, n_past in run.batch.works}
        if run.finished_now:
            self._let_go_finished(run)
        if idle and not sched.waiting and run.next_arrival > run.t:
            run.t = run.next_arrival            # nothing runs until it comes, as `next_batch` waits
        done, base, known = run.done, run.base, run.known
        step, new, end = self._join_step(run.batch.index + 1 + done, base, done, run.ctx_sum, run.t)
        run.n_taken += 1
        for w in new:
            r = w.req
            finishes.add(r, done + r.output_len)
            base[r] = w.n_new - done - 1
            run.joined.append((r, step.index))
            if known is not None:
                known[r] = (base[r], len(known))
        run.last_start, run.t, run.done = run.t, end, done + 1
        run.ctx_sum, run.n_seqs = step.totals.kv_read_tokens, step.totals.n_seqs
        run.next_arrival = self.next_arrival
        run.join = run.next_arrival is not None and arrival_may_join(sched)

    def _let_go_finished(self, run: _RunSoFar) -> None:
        """`run.finished_now`, those whose last token the run's step `run.done` made, now that a step
        follows it: their seat and memory go before it (`Scheduler.finish`), as they would in a step
        of its own; the run's last finishers are left to `_complete_run`. A static batch lets no one
        go before its end."""
        if not self.scheduler.cfg.static:
            step = run.batch.index + run.done
            for r in run.finished_now:
                r.num_computed_tokens, r.n_generated = r.prompt_len + r.output_len - 1, r.output_len
                self.scheduler.finish(r, step)
        run.finished_now = []

    def _join_step(self, index: int, base: dict[Request, int], done: int, ctx_sum: int, t: float
                   ) -> tuple[Batch, list[ScheduledSeq], float]:
        """Step `index` (the run's step `done + 1`), after `t`, as `Scheduler.schedule` would choose
        it: the arrivals by `t` join the queue, every running request decodes (their stored tokens
        sum to `ctx_sum`; `base[r] + done` each) and `Scheduler.admit` lets in whom it would. Priced
        by the executor like any step, and recorded. Where it lets in no one it is a plain decode
        step. Returns it, the prefills of those it admitted (after the decodes) and its end."""
        sched, mem = self.scheduler, self.memory
        self.t = t                              # the step starts: the arrivals by now join the queue
        self.admit_arrivals()
        decoding = sched.running[:]
        step = Batch(index, [], NO_WORK)
        mem.grow_all(decoding)                  # the decodes first, then admission, as `schedule` does
        sched.admit(step, sched.cfg.max_bs - len(decoding), NO_LIMIT)
        new = step.works
        for w in new:                           # admission set their K/V aside: their prefills store it
            mem.grow(w.req, w.n_new)
        lazy = JoinWorks(decoding, base, done, new)
        step.works = lazy.as_list() if self.executor.reads_works or self.trace_steps is not None else lazy
        step.totals = step_totals(new, len(decoding), ctx_sum)
        end = t + self.checked_duration(self.executor.execute(step), step)
        self.record(step, t, end, mem.slots_reserved, mem.slots_used)
        return step, new, end

    # ---- tracing and completing it ----------------------------------------------------------------
    def _trace_segment(self, index: int, t: float, ends: list[float] | np.ndarray, decoding: list[Request],
                       offset: int, known: dict) -> None:
        """Each step of a decode segment of `decoding` (the first is batch `index`, starting at `t`,
        `offset` steps after the run's batch) as `(index, start, end, [(req_id, 1, n_past), ...])`,
        as a step of its own would have it."""
        if self.memory.can_run_out:             # the order such a step grows its decodes in
            decoding = sorted(decoding, key=Scheduler.arrival_order)
        else:                                   # the running list's order
            decoding = sorted(decoding, key=lambda r: known[r][1])
        for j, end in enumerate(ends):
            self.trace_steps.append(TraceStep(index, t, float(end), [(r.req_id, 1, known[r][0] + offset + j)
                                                                     for r in decoding]))
            t, index = float(end), index + 1

    def _complete_run(self, run: DecodeRun) -> None:
        """Bring every request up to date after the run: each request of the batch, and each one
        that joined at step `s`, made a token in every step until it finished (those that finished
        inside the run were let go already, at their step); then those that finish at its end go.
        A static batch's run goes on to its last member's finish, which gives back its seats (their
        idle-seat context with them: `StaticScheduler.finish`), so none is counted here."""
        sched, batch, m = self.scheduler, run.batch, run.n_steps
        index = batch.index
        last = index + m - 1
        assert last < MAX_STEPS, f"a run may have at most {MAX_STEPS} steps"   # (as `Scheduler.complete`)
        first = sched.tokens.first
        finished: list[Request] = []            # requests let go now,
        made: list[int] = []                    # with the tokens each made in the run
        let_go_before: list[Request] = []       # those the run let go already
        slots, counts = [], []
        for r, n_new, n_past in batch.works:    # every prompt is done by this step: it makes token g
            g = n_past + n_new - r.prompt_len
            c = r.output_len - g                # tokens it still had to make: it finishes in this run
            if c > m:
                c = m
            elif r.status is Status.FINISHED:
                let_go_before.append(r)
            else:
                finished.append(r)
                made.append(c)
            slots.append(first[r.run_index] + g)
            counts.append(c)
            r.num_computed_tokens = n_past + n_new + c - 1
            r.n_generated = g + c
        sched.tokens.note_run([index] * len(slots), counts, slots)
        if run.joined:
            starts, slots, counts = [], [], []
            for r, s in run.joined:
                c = min(r.output_len, last - s + 1)
                if r.status is Status.FINISHED:
                    let_go_before.append(r)
                elif c == r.output_len:
                    finished.append(r)
                    made.append(c + s - index)  # (counted from the batch's first step)
                starts.append(s)
                slots.append(first[r.run_index])
                counts.append(c)
                r.num_computed_tokens = r.prompt_len + c - 1
                r.n_generated = c
            sched.tokens.note_run(starts, counts, slots)
        for r, c in sorted(zip(finished, made), key=lambda rc: rc[1]):    # in the order they finished
            sched.finish(r, index + c - 1)
        assert not (sched.cfg.static and sched.running), "a static batch's run ends with its last member"
        for r in let_go_before + finished:
            self.executor.release(r)
        if sched.n_done == len(self.requests):
            self.done = True
