"""Orca's scheduler, Algorithm 1: iteration-level FCFS with `max_bs`, reservation and pipelining (lecture §4.3).

Each call to `schedule` picks the requests of ONE iteration:
1. the running requests that are not in flight decode one token each (they arrived before anyone
   waiting, so iteration-level FCFS holds: an earlier request has run at least as many iterations);
2. waiting requests are admitted in queue order while the batch has fewer than `max_bs` requests
   and the memory manager can set their K/V aside; when the head does not fit, selection stops —
   it does not skip to a smaller request behind it (exercise 1b);
3. the new requests' prefills join the same step (`prefill="mixed"`, Orca) or, with
   `prefill="prefill_first"`, a step that admits anyone runs only prefills (early vLLM, §6.4).

Knobs (§6): `order="spf"` sorts the queue by predicted output (shortest first); a token budget
`max_num_batched_tokens` caps each step, and `chunked_prefill` splits long prompts into chunks
that fill the budget left by the decodes (`SeqWork(n_new=chunk, n_past=done)`, exercise 9).
`n_workers > 1` is Orca's pipelining (§4.4, exercise 6): up to `n_workers` batches are in flight,
a request in flight cannot be picked again until its batch returns, and the engine injects the
next batch without waiting. `static=True` is request-level batching, the baseline of §3: a batch
is admitted only when the engine is idle and runs until its last request finishes.

The scheduler holds Python numbers, lists and dicts — no tensors, no per-token objects. The
requests that decode together form a *decode group*: the group keeps the number of seats `k`, the
sum of their stored contexts, and a lane of the batch indices it ran in, so a step of any size is
priced from `(k, ctx_sum)` in O(1) (issue 6's speed requirement) and a member's token times are
written once, when it leaves the group (finishes, is preempted or moves), as one slice.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Literal

import numpy as np

from .batch import StepTotals
from .memory import MemoryManager
from .request import Request, Status

Order = Literal["fcfs", "spf"]
PrefillMode = Literal["mixed", "prefill_first"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler knobs, named as Orca and vLLM name them."""

    max_bs: int = 256
    n_workers: int = 1
    order: Order = "fcfs"
    prefill: PrefillMode = "mixed"
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = False
    static: bool = False
    static_idle_seats_cost: bool = True

    def __post_init__(self) -> None:
        for name in ("max_bs", "n_workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.order not in ("fcfs", "spf"):
            raise ValueError(f"order must be 'fcfs' or 'spf' (shortest predicted first), got {self.order!r}")
        if self.prefill not in ("mixed", "prefill_first"):
            raise ValueError(f"prefill must be 'mixed' or 'prefill_first', got {self.prefill!r}")
        b = self.max_num_batched_tokens
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < self.max_bs):
            raise ValueError(f"max_num_batched_tokens must be an integer >= max_bs ({self.max_bs}) so every "
                             f"decode fits a step, got {b!r}")
        if self.chunked_prefill and b is None:
            raise ValueError("chunked_prefill needs a token budget: set max_num_batched_tokens")
        if self.chunked_prefill and self.prefill == "prefill_first":
            raise ValueError("chunked_prefill mixes every step's decodes with prompt chunks (Sarathi-Serve); "
                             "it cannot be combined with prefill='prefill_first'")
        if self.static and (self.n_workers != 1 or b is not None or self.order != "fcfs"
                            or self.prefill != "mixed"):
            raise ValueError("static (request-level) batching takes only max_bs: n_workers=1, fcfs, mixed, "
                             "no token budget")


class _Lane:
    """A growable array of batch indices (numpy, so a member's slice is copied in one go)."""

    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.n = 0

    def _room(self, m: int) -> None:
        if self.n + m > len(self.buf):
            buf = np.empty(max(2 * len(self.buf), self.n + m), dtype=np.int64)
            buf[:self.n] = self.buf[:self.n]
            self.buf = buf

    def append(self, index: int) -> None:
        if self.n == len(self.buf):
            self._room(1)
        self.buf[self.n] = index
        self.n += 1

    def extend_range(self, first: int, m: int) -> None:
        self._room(m)
        self.buf[self.n:self.n + m] = np.arange(first, first + m)
        self.n += m


class DecodeGroup:
    """Requests that decode together, one token each per batch the group is in."""

    __slots__ = ("members", "ghosts", "k", "ctx_sum", "lane", "heap", "in_flight")

    def __init__(self) -> None:
        self.members: dict = {}          # req_id -> Request, live decoders
        self.ghosts: list[Request] = []  # static batching: finished, seat still held
        self.k = 0                       # seats that compute each step
        self.ctx_sum = 0                 # sum of stored tokens over those seats
        self.lane = _Lane()              # batch indices this group ran in
        self.heap: list = []             # (lane length at which a member is done, serial, req_id)
        self.in_flight = False


@dataclass(eq=False)
class _Run:
    """A member's stretch in a group: its token `tok_from + j` came from batch `lane[lane_from + j]`."""

    group: DecodeGroup
    lane_from: int
    tok_from: int
    stored0: int
    key: int
    serial: int


@dataclass(eq=False)
class Batch:
    """One iteration: the decode group's members (1 token each) plus prefills `(req, n_new, n_past)`."""

    index: int
    group: DecodeGroup | None
    decode_k: int
    decode_ctx: int
    prefills: list[tuple[Request, int, int]]
    totals: StepTotals
    preempted: list[Request] = field(default_factory=list)
    lane_pos: int = -1
    n_steps: int = 1
    _runs: dict | None = field(default=None, repr=False)

    @property
    def pure_decode(self) -> bool:
        return not self.prefills and self.group is not None

    def works(self) -> list[tuple[Request, int, int]]:
        """Every live request's `(req, n_new, n_past)` in this batch (O(batch); for torch and traces).

        Static batching's idle seats are not listed: they cost time on the paper GPU, nothing here.
        """
        out: list[tuple[Request, int, int]] = []
        if self.group is not None:
            for rid, r in self.group.members.items():
                run = self._runs[rid]
                out.append((r, 1, run.stored0 + self.lane_pos - run.lane_from))
        out.extend(self.prefills)
        return out


def _prefill_totals(prefills: Iterable[tuple[Request, int, int]]) -> tuple[int, int, int, int, int]:
    s = t = kv = full = causal = 0
    for _, n, p in prefills:
        s += 1
        t += n
        kv += p + n
        full += n * (p + n)
        causal += n * p + n * (n + 1) // 2
    return s, t, kv, full, causal


class Scheduler:
    """Algorithm 1 over a memory manager; the engine calls `add`, `schedule`, `complete`."""

    def __init__(self, config: SchedulerConfig, memory: MemoryManager) -> None:
        if memory.can_run_out and config.n_workers > 1:
            raise ValueError("a memory manager that can run out (preemption) needs n_workers=1")
        if memory.can_run_out and config.static:
            raise ValueError("static batching needs a reserving or unlimited memory manager")
        self.cfg = config
        self.memory = memory
        self._serial = itertools.count()
        self.start([])

    # ---- run lifecycle -------------------------------------------------------------------------
    def start(self, requests: list[Request]) -> None:
        """Reset for a run over `requests` (ids unique); allocate the token -> batch map."""
        self.memory.reset()
        self.waiting: list = []
        self.prefilling: list[Request] = []
        self.groups: list[DecodeGroup] = []
        self._runs: dict = {}
        self.n_finished = 0
        self.n_preemptions = 0
        self._static_batch: list[Request] = []
        sizes = np.array([r.output_len for r in requests], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._off = {r.req_id: int(o) for r, o in zip(requests, self.offsets[:-1])}
        self.token_batch = np.full(int(self.offsets[-1]), -1, dtype=np.int64)
        self.release_batch = {}

    def add(self, req: Request) -> None:
        """A request arrives: it joins the waiting queue."""
        req.status = Status.WAITING
        heapq.heappush(self.waiting, (self._queue_key(req), next(self._serial), req))

    def _queue_key(self, req: Request) -> tuple:
        """FCFS: arrival, then submission order; SPF: predicted tokens still to come first."""
        if self.cfg.order == "spf":
            return (req.predicted_output - req.n_generated, req.arrival_s, self._off[req.req_id])
        return (req.arrival_s, self._off[req.req_id])

    @property
    def n_running(self) -> int:
        return sum(len(g.members) for g in self.groups) + len(self.prefilling)

    # ---- one iteration ---------------------------------------------------------------------------
    def schedule(self, index: int) -> Batch | None:
        """Select the requests of batch `index` (None if nothing can run now)."""
        if self.cfg.static:
            return self._schedule_static(index)
        if self.cfg.n_workers == 1 and not self.waiting and not self.prefilling:
            # The common case, kept short: nobody to admit, every running request decodes.
            groups = self.groups
            if not groups or not groups[0].k:
                return None
            g = groups[0]
            if self.memory.grow_many(len(g.members)):
                return self._launch(index, g, [], [])
        cfg, mem = self.cfg, self.memory
        g = self._decode_group()
        preempted: list[Request] = []
        prefills: list[tuple[Request, int, int]] = []
        avail_prefilling = [r for r in self.prefilling if r.status is Status.RUNNING]
        k = g.k if g is not None else 0
        seats = cfg.max_bs - k - len(avail_prefilling)
        budget = cfg.max_num_batched_tokens if cfg.max_num_batched_tokens is not None else 1 << 62

        if cfg.prefill == "mixed":
            if k:
                preempted = self._grow_or_preempt(g)
                k = g.k
                avail_prefilling = [r for r in self.prefilling if r.status is Status.RUNNING]
                seats = cfg.max_bs - k - len(avail_prefilling)
            self._select_prefills(avail_prefilling, budget - k, seats, not preempted, prefills)
        else:
            self._select_prefills(avail_prefilling, budget, seats, True, prefills)
            if prefills:
                g = None
            elif k:
                preempted = self._grow_or_preempt(g)
        if g is not None and g.k == 0:
            g = None
        if not prefills and g is None:
            if preempted:  # everyone was preempted: nothing runs this step, they wait for memory
                return Batch(index, None, 0, 0, [], StepTotals(), preempted)
            return None
        return self._launch(index, g, prefills, preempted)

    def _decode_group(self) -> DecodeGroup | None:
        """The group that decodes this step: with pipelining, the available groups merged (or the one
        holding the earliest arrival when they would exceed `max_bs`)."""
        if self.cfg.n_workers == 1:
            return self.groups[0] if self.groups and self.groups[0].k else None
        avail = [g for g in self.groups if not g.in_flight and g.k]
        if not avail:
            return None
        if len(avail) == 1:
            return avail[0]
        if sum(g.k for g in avail) <= self.cfg.max_bs:
            target = max(avail, key=lambda g: g.k)
            for g in avail:
                if g is not target:
                    self._merge(g, target)
            return target
        return min(avail, key=lambda g: min(r.arrival_s for r in g.members.values()))

    def _select_prefills(self, avail_prefilling: list[Request], budget_left: int, seats: int, admit: bool,
                         out: list[tuple[Request, int, int]]) -> None:
        """Continue chunked prefills, then admit from the queue: stop, don't skip, at the first misfit."""
        chunked = self.cfg.chunked_prefill
        for r in avail_prefilling:
            if budget_left <= 0:
                return
            n = min(r.prompt_len + r.n_generated - r.n_prefilled, budget_left)
            out.append((r, n, r.n_prefilled))
            budget_left -= n
        if not admit:
            return
        mem, waiting = self.memory, self.waiting
        while waiting and seats > 0 and budget_left > 0:
            head = waiting[0][2]
            need = head.prompt_len + head.n_generated
            if need > budget_left and not chunked:
                break
            if not mem.try_admit(head):
                break
            heapq.heappop(waiting)
            head.status = Status.RUNNING
            head.n_prefilled = 0
            n = min(need, budget_left)
            out.append((head, n, 0))
            self.prefilling.append(head)
            seats -= 1
            budget_left -= n

    def _grow_or_preempt(self, g: DecodeGroup) -> list[Request]:
        """Make room for one more token per decoder; evict the latest arrival while it does not fit."""
        preempted: list[Request] = []
        while g.members and not self.memory.grow_many(len(g.members)):
            victims = list(g.members.values()) + [r for r in self.prefilling if r.status is Status.RUNNING]
            victim = max(victims, key=lambda r: (r.arrival_s, self._off[r.req_id]))
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def _preempt(self, r: Request) -> None:
        """Free `r` and requeue it; it recomputes its prompt and generated tokens when readmitted."""
        if r.req_id in self._runs:
            self._leave_group(r)
        else:
            self.prefilling.remove(r)
        self.memory.free(r)
        r.n_stored = r.n_prefilled = 0
        r.n_preemptions += 1
        self.n_preemptions += 1
        self.add(r)

    def _launch(self, index: int, g: DecodeGroup | None, prefills: list[tuple[Request, int, int]],
                preempted: list[Request]) -> Batch:
        mem = self.memory
        for r, n, _ in prefills:
            mem.grow(r, n)
            r.n_prefilled += n
            r.n_stored += n
            r.status = Status.IN_FLIGHT
        s, t, kv, full, causal = _prefill_totals(prefills) if prefills else (0, 0, 0, 0, 0)
        k = ctx = 0
        lane_pos = -1
        if g is not None:
            k, ctx = g.k, g.ctx_sum
            s, t, kv, full, causal = s + k, t + k, kv + ctx + k, full + ctx + k, causal + ctx + k
            lane_pos = g.lane.n
            g.lane.append(index)
            g.ctx_sum += k
            if self.cfg.n_workers > 1:
                g.in_flight = True
                for r in g.members.values():
                    r.status = Status.IN_FLIGHT
        return Batch(index, g, k, ctx, prefills, StepTotals(s, t, kv, full, causal), preempted, lane_pos,
                     _runs=self._runs)

    def _schedule_static(self, index: int) -> Batch | None:
        """Request-level batching: admit up to `max_bs` only when no batch is running."""
        if self.groups:
            g = self.groups[0]
            self.memory.grow_many(len(g.members))
            return self._launch(index, g, [], [])
        prefills: list[tuple[Request, int, int]] = []
        self._select_prefills([], 1 << 62, self.cfg.max_bs, True, prefills)
        if not prefills:
            return None
        self._static_batch = [r for r, _, _ in prefills]
        return self._launch(index, None, prefills, [])

    # ---- fast-forward over pure-decode steps -------------------------------------------------------
    def decode_run_limit(self, batch: Batch) -> int:
        """How many more steps exactly like `batch` (same decoders, no admission) may follow it."""
        g = batch.group
        if not batch.pure_decode or not g.members:
            return 0
        heap, runs = g.heap, self._runs
        while heap:
            key, serial, rid = heap[0]
            run = runs.get(rid)
            if run is not None and run.serial == serial:
                break
            heapq.heappop(heap)
        extra = heap[0][0] - g.lane.n
        room = self.memory.growth_room()
        if room is not None:
            extra = min(extra, room // len(g.members))
        return max(extra, 0)

    def arrival_may_join(self) -> bool:
        """Could a request arriving now be admitted before the next finish? (If not, arrivals
        during a pure-decode run change nothing and the engine may skip past them.)"""
        cfg = self.cfg
        if cfg.static:
            return False
        running = len(self.prefilling) + (len(self.groups[0].members) if cfg.n_workers == 1 and self.groups
                                          else sum(len(g.members) for g in self.groups))
        return running < cfg.max_bs and (cfg.order != "fcfs" or not self.waiting)

    def extend(self, batch: Batch, extra: int) -> None:
        """Commit `extra` more steps of `batch`'s decode group (batch indices `index+1 ..`)."""
        if extra <= 0:
            return
        g = batch.group
        ok = self.memory.grow_many(len(g.members) * extra)
        if not ok:
            raise RuntimeError("fast-forward exceeded the memory's growth room")
        g.lane.extend_range(batch.index + 1, extra)
        g.ctx_sum += g.k * extra
        batch.n_steps = 1 + extra

    # ---- a batch returns --------------------------------------------------------------------------
    def complete(self, batch: Batch, tokens: list[int] | None = None) -> list[Request]:
        """Account the batch's tokens; return the requests that finished (memory already freed)."""
        finished: list[Request] = []
        g = batch.group
        last = batch.index + batch.n_steps - 1
        if tokens is not None:
            self._store_tokens(batch, tokens)
        if g is not None:
            g.in_flight = False
            if self.cfg.n_workers > 1:
                for r in g.members.values():
                    r.status = Status.RUNNING
            L = g.lane.n
            heap, runs = g.heap, self._runs
            while heap and heap[0][0] <= L:
                key, serial, rid = heapq.heappop(heap)
                run = runs.get(rid)
                if run is None or run.serial != serial:
                    continue
                r = g.members[rid]
                self._leave_group(r, ghost=self.cfg.static)
                self._finish(r, last, finished)
        target = g
        for r, n, p in batch.prefills:
            r.status = Status.RUNNING
            if r.n_prefilled < r.prompt_len + r.n_generated:
                continue  # a chunk; the prompt is not done yet
            self.prefilling.remove(r)
            self.token_batch[self._off[r.req_id] + r.n_generated] = batch.index
            r.n_generated += 1
            if r.n_generated == r.output_len:
                if self.cfg.static:
                    self._static_ghost(r)
                self._finish(r, last, finished)
                continue
            if target is None:
                target = self._home_group()
            self._join(r, target)
        if self.cfg.static and self._static_batch and not (self.groups and self.groups[0].members):
            self._end_static_batch(last)
        return finished

    def _home_group(self) -> DecodeGroup:
        if self.cfg.n_workers == 1 and self.groups:
            return self.groups[0]
        g = DecodeGroup()
        self.groups.append(g)
        return g

    def _store_tokens(self, batch: Batch, tokens: list[int]) -> None:
        """Append the executor's tokens (torch) to each request's `output_ids`, in `works()` order."""
        i = 0
        if batch.group is not None:
            for r in batch.group.members.values():
                r.output_ids.append(int(tokens[i]))
                i += 1
        for r, n, p in batch.prefills:
            if r.n_prefilled == r.prompt_len + r.n_generated:
                if r.output_ids is None:
                    r.output_ids = []
                r.output_ids.append(int(tokens[i]))
            i += 1

    def _join(self, r: Request, g: DecodeGroup) -> None:
        lane_from = g.lane.n
        run = _Run(g, lane_from, r.n_generated, r.n_stored, lane_from + r.output_len - r.n_generated,
                   next(self._serial))
        self._runs[r.req_id] = run
        if g not in self.groups:
            self.groups.append(g)
        g.members[r.req_id] = r
        g.k += 1
        g.ctx_sum += r.n_stored
        heapq.heappush(g.heap, (run.key, run.serial, r.req_id))

    def _leave_group(self, r: Request, ghost: bool = False) -> None:
        """Close `r`'s run: sync its counters, write its token -> batch slice, take it out."""
        run = self._runs.pop(r.req_id)
        g = run.group
        n = g.lane.n - run.lane_from
        r.n_generated = run.tok_from + n
        r.n_stored = run.stored0 + n
        if n:
            o = self._off[r.req_id] + run.tok_from
            self.token_batch[o:o + n] = g.lane.buf[run.lane_from:run.lane_from + n]
        del g.members[r.req_id]
        if ghost:
            g.ghosts.append(r)
        if not (ghost and self.cfg.static_idle_seats_cost):
            g.k -= 1
            g.ctx_sum -= r.n_stored
        if self.cfg.n_workers > 1 and not g.members and g in self.groups:
            self.groups.remove(g)

    def _merge(self, src: DecodeGroup, dst: DecodeGroup) -> None:
        for r in list(src.members.values()):
            self._leave_group(r)
            self._join(r, dst)
        if src in self.groups:
            self.groups.remove(src)

    def _static_ghost(self, r: Request) -> None:
        """A static batch member that finished at its prefill still holds its seat (and memory)."""
        if not self.groups:
            self.groups.append(DecodeGroup())
        g = self.groups[0]
        g.ghosts.append(r)
        if self.cfg.static_idle_seats_cost:
            g.k += 1
            g.ctx_sum += r.n_stored

    def _finish(self, r: Request, last_batch: int, finished: list[Request]) -> None:
        r.status = Status.FINISHED
        self.n_finished += 1
        finished.append(r)
        if not self.cfg.static:
            self.memory.free(r)
            self.release_batch[r.req_id] = last_batch

    def _end_static_batch(self, last_batch: int) -> None:
        """The last request of a static batch finished: every seat and its memory are released."""
        for r in self._static_batch:
            self.memory.free(r)
            self.release_batch[r.req_id] = last_batch
        self._static_batch = []
        self.groups.clear()
