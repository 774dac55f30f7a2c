"""Orca's scheduler, Algorithm 1: iteration-level FCFS with `max_bs`, reservation and pipelining (lecture §4.3).

The engine calls three methods: `add` (a request arrives and waits), `schedule` (pick the requests
of ONE iteration) and `complete` (the iteration's tokens are out), plus `decode_run_limit`,
`arrival_may_join` and `extend` to fast-forward over identical decode steps. `schedule` does:
1. the running requests that are not in flight decode one token each (they arrived before anyone
   waiting, so iteration-level FCFS holds: an earlier request has run at least as many iterations);
   each must be able to store one more token, else the latest arrival is preempted (lecture 3's
   on-demand memory; Orca's reservation never runs out);
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
running requests that decode together are a `DecodeGroup` (`decode_group.py`): a step is priced
from two running totals, and each request's token -> batch map is written once, when it leaves.

`tests/reference_engine.py` is the same algorithm in 100 plain lines — a waiting list, a running
list and per-request counters — and the engine is tested against it token for token
(`tests/test_reference_equivalence.py`): read it first.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal

from .batch import StepTotals
from .decode_group import DecodeGroup, TokenBatches
from .memory import MemoryManager
from .request import Request, Status

Order = Literal["fcfs", "spf"]
PrefillMode = Literal["mixed", "prefill_first"]
NO_LIMIT = 1 << 62


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


@dataclass(eq=False)
class Batch:
    """One iteration: a decode group (1 token per seat) plus prefills `(req, n_new, n_past)`.

    `n_steps > 1` when the engine fast-forwarded: the same decode group for `n_steps` iterations.
    """

    index: int
    group: DecodeGroup | None
    prefills: list[tuple[Request, int, int]]
    totals: StepTotals
    preempted: list[Request] = field(default_factory=list)
    decode_k: int = 0
    decode_ctx: int = 0
    lane_pos: int = -1
    n_steps: int = 1

    @property
    def pure_decode(self) -> bool:
        return not self.prefills and self.group is not None

    def works(self) -> list[tuple[Request, int, int]]:
        """Every live request's `(req, n_new, n_past)`, decodes first (O(batch); torch and traces).

        Static batching's idle seats are not listed: they cost time on the paper GPU, nothing here.
        """
        out = self.group.works_at(self.lane_pos) if self.group is not None else []
        return out + self.prefills


def step_totals(prefills: list[tuple[Request, int, int]], k: int, ctx_sum: int) -> StepTotals:
    """`StepTotals.of` the prefills' `SeqWork(n, p)` plus `k` decodes over `ctx_sum` stored tokens
    (each `SeqWork(1, ctx)`), summed here without building the objects: this runs every step."""
    c = ctx_sum + k
    s, t, kv, full, causal = k, k, c, c, c
    for _, n, p in prefills:
        s += 1
        t += n
        kv += p + n
        full += n * (p + n)
        causal += n * p + n * (n + 1) // 2
    return StepTotals(s, t, kv, full, causal)


class Scheduler:
    """Algorithm 1 over a memory manager; the engine calls `add`, `schedule`, `complete`."""

    def __init__(self, config: SchedulerConfig, memory: MemoryManager) -> None:
        if memory.can_run_out and config.n_workers > 1:
            raise ValueError("a memory manager that can run out (preemption) needs n_workers=1")
        if memory.can_run_out and config.static:
            raise ValueError("static batching needs a reserving or unlimited memory manager")
        self.cfg = config
        self.memory = memory
        self.start([])

    def start(self, requests: list[Request]) -> None:
        """Reset for a run over `requests` (sorted by arrival, ids unique)."""
        self.memory.reset()
        self.waiting: list = []                 # heap of (queue key, request)
        self.prefilling: list[Request] = []     # admitted, prompt not fully fed yet (or in flight)
        self.groups: list[DecodeGroup] = []     # the decoding requests (one group unless pipelining)
        self.static_batch: list[Request] = []
        self.tokens = TokenBatches(requests)
        self.release_batch: dict = {}           # req_id -> batch after which its memory was freed
        self.n_finished = 0
        self._rank = {r.req_id: i for i, r in enumerate(requests)}

    # ---- a request arrives ---------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        heapq.heappush(self.waiting, (self._queue_key(req), req))

    def _queue_key(self, req: Request) -> tuple:
        """FCFS: arrival (then submission order); SPF: predicted tokens still to come, then arrival."""
        if self.cfg.order == "spf":
            return (req.predicted_output - req.n_generated, req.arrival_s, self._rank[req.req_id])
        return (req.arrival_s, self._rank[req.req_id])

    # ---- one iteration ---------------------------------------------------------------------------
    def schedule(self, index: int) -> Batch | None:
        """Select the requests of batch `index` (None if nothing can run now)."""
        cfg = self.cfg
        if cfg.static:
            return self._schedule_static(index)
        g = self._decode_group()
        k = g.k if g is not None else 0
        budget = cfg.max_num_batched_tokens or NO_LIMIT
        preempted: list[Request] = []
        if cfg.prefill == "mixed":              # 1. the running decode, 2.-3. newcomers join them
            if k:
                preempted = self._make_room(g)
                k = g.k
            prefills = self._prefills(cfg.max_bs - k, budget - k, admit=not preempted)
        else:                                   # prefill_first: a step that admits runs only prefills
            prefills = self._prefills(cfg.max_bs - k, budget, admit=True)
            if prefills:
                g = None
            elif k:
                preempted = self._make_room(g)
        if g is not None and not g.k:
            g = None
        if g is None and not prefills:
            # Nothing runs; if everyone was preempted they wait for memory in the queue.
            return Batch(index, None, [], StepTotals(), preempted) if preempted else None
        return self._launch(index, g, prefills, preempted)

    def _decode_group(self) -> DecodeGroup | None:
        """The group that decodes this step. Pipelining: the groups back from flight, merged (or,
        if together they exceed `max_bs`, the one holding the earliest arrival).

        A simplification of Algorithm 1: when merged groups would exceed `max_bs`, a whole group
        runs and the seats left over stay empty for this step, rather than splitting a group to fill
        `max_bs` in arrival order (a group is priced as one unit; see decode_group.py)."""
        if len(self.groups) == 1:               # (always, without pipelining)
            g = self.groups[0]
            return g if g.k and not g.in_flight else None
        avail = [g for g in self.groups if g.k and not g.in_flight]
        if len(avail) < 2:
            return avail[0] if avail else None
        if sum(g.k for g in avail) > self.cfg.max_bs:
            return min(avail, key=lambda g: min((r.arrival_s, self._rank[r.req_id]) for r in g.members()))
        target = max(avail, key=lambda g: g.k)
        for g in avail:
            if g is not target:
                for r in g.members():
                    g.leave(r)
                    target.join(r)
                self.groups.remove(g)
        return target

    def _prefills(self, seats: int, budget: int, admit: bool) -> list[tuple[Request, int, int]]:
        """Continue chunked prefills, then admit from the queue in order while a seat, the token
        budget and the memory allow. When the head does not fit: stop, don't skip."""
        out: list[tuple[Request, int, int]] = []
        for r in self.prefilling:
            if r.status is not Status.RUNNING:
                continue                        # in flight (pipelining)
            seats -= 1
            if budget > 0:
                n = min(r.prompt_len + r.n_generated - r.n_prefilled, budget)
                out.append((r, n, r.n_prefilled))
                budget -= n
        while admit and self.waiting and seats > 0 and budget > 0:
            head = self.waiting[0][1]
            need = head.prompt_len + head.n_generated   # a preempted request recomputes its output too
            if need > budget and not self.cfg.chunked_prefill:
                break
            if not self.memory.try_admit(head):
                break
            heapq.heappop(self.waiting)
            head.status = Status.RUNNING
            head.n_prefilled = 0
            self.prefilling.append(head)
            n = min(need, budget)
            out.append((head, n, 0))
            seats -= 1
            budget -= n
        return out

    def _make_room(self, g: DecodeGroup) -> list[Request]:
        """Each decoder stores one more token; while that does not fit, preempt the latest arrival."""
        preempted: list[Request] = []
        while g.seats and not self.memory.grow_many(len(g.seats)):
            victims = g.members() + [r for r in self.prefilling if r.status is Status.RUNNING]
            victim = max(victims, key=lambda r: (r.arrival_s, self._rank[r.req_id]))
            if victim.req_id in g.seats:
                g.leave(victim)
            else:
                self.prefilling.remove(victim)
            self.memory.free(victim)
            victim.n_stored = victim.n_prefilled = 0   # recomputed when readmitted
            victim.n_preemptions += 1
            self.add(victim)
            preempted.append(victim)
        return preempted

    def _launch(self, index: int, g: DecodeGroup | None, prefills: list[tuple[Request, int, int]],
                preempted: list[Request]) -> Batch:
        for r, n, _ in prefills:
            self.memory.grow(r, n)
            r.n_prefilled += n
            r.n_stored += n
            r.status = Status.IN_FLIGHT
        if g is None:
            return Batch(index, None, prefills, step_totals(prefills, 0, 0), preempted)
        batch = Batch(index, g, prefills, step_totals(prefills, g.k, g.ctx_sum), preempted, g.k, g.ctx_sum,
                      g.lane_len)
        g.run(index)
        if self.cfg.n_workers > 1:
            g.in_flight = True
            for r in g.members():
                r.status = Status.IN_FLIGHT
        return batch

    def _schedule_static(self, index: int) -> Batch | None:
        """Request-level batching: up to `max_bs` start together only when no batch is running,
        and their seats stay until the last of them finishes."""
        if self.groups:
            g = self.groups[0]
            self.memory.grow_many(len(g.seats))
            return self._launch(index, g, [], [])
        prefills = self._prefills(self.cfg.max_bs, NO_LIMIT, admit=True)
        if not prefills:
            return None
        self.static_batch = [r for r, _, _ in prefills]
        return self._launch(index, None, prefills, [])

    # ---- fast-forward over identical pure-decode steps (engine) ---------------------------------------
    def decode_run_limit(self, batch: Batch) -> int:
        """How many more steps exactly like `batch` (same decoders, no admission) may follow it."""
        g = batch.group
        if not batch.pure_decode or not g.seats or batch.preempted:
            return 0  # (a step that preempted admitted no one; the next one may)
        extra = g.steps_to_next_finish()
        room = self.memory.growth_room()
        if room is not None:
            extra = min(extra, room // len(g.seats))
        return max(extra, 0)

    def arrival_may_join(self) -> bool:
        """Could a request arriving now be admitted before the next finish? (If not, arrivals
        during a pure-decode run change nothing and the engine may skip past them.)"""
        if self.cfg.static:
            return False
        running = len(self.prefilling)
        for g in self.groups:
            running += len(g.seats)
        return running < self.cfg.max_bs and (self.cfg.order != "fcfs" or not self.waiting)

    def extend(self, batch: Batch, extra: int) -> None:
        """Commit `extra` more steps of `batch`'s decode group (batch indices `index+1 ..`)."""
        if extra <= 0:
            return
        g = batch.group
        if not self.memory.grow_many(len(g.seats) * extra):
            raise RuntimeError("fast-forward exceeded the memory's growth room")
        g.run(batch.index + 1, extra)
        batch.n_steps = 1 + extra

    # ---- a batch returns --------------------------------------------------------------------------
    def complete(self, batch: Batch, tokens: list[int] | None = None) -> list[Request]:
        """Account the batch's tokens; return the requests that finished (memory already freed)."""
        cfg = self.cfg
        finished: list[Request] = []
        last = batch.index + batch.n_steps - 1
        if tokens is not None:
            self._store_tokens(batch, tokens)
        g = batch.group
        if g is not None:
            g.in_flight = False
            for r in g.pop_finished():
                g.leave(r, keep_seat=cfg.static and cfg.static_idle_seats_cost)
                self._finish(r, last, finished)
            if cfg.n_workers > 1:
                for r in g.members():
                    r.status = Status.RUNNING
        for r, n, p in batch.prefills:
            r.status = Status.RUNNING
            if r.n_prefilled < r.prompt_len + r.n_generated:
                continue                        # a chunk: the prompt is not done yet
            self.prefilling.remove(r)
            self.tokens.put(r, r.n_generated, batch.index)   # the prefill's one token
            r.n_generated += 1
            if g is None:
                g = self._group_to_join()
            if r.n_generated < r.output_len:
                g.join(r)
                continue
            if cfg.static and cfg.static_idle_seats_cost:
                g.keep_idle_seat(r.n_stored)
            self._finish(r, last, finished)
        if finished:                            # drop the groups nobody is left in
            self.groups = [x for x in self.groups if x.seats]
        if cfg.static and self.static_batch and not self.groups:
            for r in self.static_batch:         # the batch's last request finished: seats and memory go
                self.memory.free(r)
                self.release_batch[r.req_id] = last
            self.static_batch = []
        return finished

    def _group_to_join(self) -> DecodeGroup:
        """Where new decoders go: the one group, or with pipelining a new group for this batch's."""
        if self.cfg.n_workers == 1 and self.groups:
            return self.groups[0]
        g = DecodeGroup(self.tokens)
        self.groups.append(g)
        return g

    def _finish(self, r: Request, last_batch: int, finished: list[Request]) -> None:
        r.status = Status.FINISHED
        self.n_finished += 1
        finished.append(r)
        if not self.cfg.static:
            self.memory.free(r)
            self.release_batch[r.req_id] = last_batch

    def _store_tokens(self, batch: Batch, tokens: list[int]) -> None:
        """Append the executor's tokens (torch) to each request's `output_ids`, in `works()` order
        (decodes first); a prompt chunk that does not end its prompt makes no token."""
        n_decodes = len(batch.group.seats) if batch.group is not None else 0
        for i, ((r, n, p), tok) in enumerate(zip(batch.works(), tokens)):
            if i < n_decodes or p + n == r.prompt_len + r.n_generated:
                if r.output_ids is None:
                    r.output_ids = []
                r.output_ids.append(int(tok))
