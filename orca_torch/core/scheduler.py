"""Orca's scheduler, Algorithm 1: iteration-level FCFS with `max_bs`, reservation and pipelining (lecture §4.3).

State: a `waiting` queue and a `running` list of `Request`s, nothing else. Each request says how
many tokens it has computed (K/V stored) and generated; it needs `n_to_feed = prompt_len +
n_generated - num_computed_tokens` tokens fed to yield its next token. A prefill, a prompt chunk,
a decode (1 token) and the recompute after a preemption are all that one "catch up".

`schedule()` picks ONE iteration and returns it as a `Batch` (the output, apart from the state):
1. the running requests that are not in flight decode (they arrived before anyone waiting, so
   iteration-level FCFS holds); each must store one more token, else the latest arrival is
   preempted (lecture 3's on-demand memory; Orca's reservation never runs out);
2. running requests still catching up (a chunked prompt) take their next chunk;
3. waiting requests are admitted in queue order while the batch has fewer than `max_bs` requests
   (every request in the batch counts, chunks too), the token budget allows and the memory manager
   can set their K/V aside; when the head does not fit, selection stops — it does not skip to a
   smaller request behind it (exercise 1b). A step that preempted admits no one.
With `prefill="prefill_first"` (early vLLM, §6.4) a step that admits anyone runs only prefills.
`complete(batch, tokens)` brings every request of the batch up to date when the batch is done.

Knobs (§6): `order="spf"` sorts the queue by predicted tokens still to come; a token budget
`max_num_batched_tokens` caps each step, and `chunked_prefill` feeds long prompts in chunks that
fill the budget the decodes leave (exercise 9). `n_workers > 1` is Orca's pipelining (§4.4,
exercise 6): a request whose batch is in flight is skipped until it returns (`pipeline.py` decides
when a batch enters). `static=True` is request-level batching, the baseline of §3: a batch starts
only when none is running and runs until its last request finishes; with `static_idle_seats_cost`
a finished member's seat keeps costing one decode per step (FasterTransformer's fixed shape).

`tests/reference_engine.py` is the same algorithm as one plain loop; the engine equals it token
for token (`tests/test_reference_equivalence.py`).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import repeat
from typing import Literal

from orca_torch.checks import check_flag, check_instance, check_int, is_int
from orca_torch.core.batch import Batch, StepTotals, step_totals
from orca_torch.core.memory import MemoryManager
from orca_torch.core.request import Request, Status
from orca_torch.core.token_steps import MAX_STEPS, TokenSteps

Order = Literal["fcfs", "spf"]
PrefillMode = Literal["mixed", "prefill_first"]
NO_LIMIT = 1 << 62
NO_WORK = StepTotals()


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
        for name in ("max_bs", "n_workers"):       # frozen: numpy integers become ints here
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        for name in ("chunked_prefill", "static", "static_idle_seats_cost"):
            object.__setattr__(self, name, check_flag(name, getattr(self, name)))
        if self.order not in ("fcfs", "spf"):
            raise ValueError(f"order must be 'fcfs' or 'spf' (shortest predicted first), got {self.order!r}")
        if self.prefill not in ("mixed", "prefill_first"):
            raise ValueError(f"prefill must be 'mixed' or 'prefill_first', got {self.prefill!r}")
        b = self.max_num_batched_tokens
        if is_int(b):
            b = int(b)
            object.__setattr__(self, "max_num_batched_tokens", b)
        if b is not None and (not is_int(b) or b < self.max_bs):
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


class Scheduler:
    """Algorithm 1 over a memory manager; the engine calls `add`, `schedule`, `complete`."""

    def __init__(self, config: SchedulerConfig, memory: MemoryManager) -> None:
        check_instance("config", config, SchedulerConfig)
        check_instance("memory", memory, MemoryManager)
        if memory.can_run_out and config.n_workers > 1:
            raise ValueError("a memory manager that can run out (preemption) needs n_workers=1")
        if memory.can_run_out and config.static:
            raise ValueError("static batching needs a reserving or unlimited memory manager")
        self.cfg = config
        self.memory = memory
        self.start()

    def start(self, requests: list[Request] | None = None) -> None:
        """Reset for a new run over `requests` (their `run_index` set: 0, 1, ...)."""
        self.memory.reset()
        requests = requests or []
        self.tokens = TokenSteps([r.output_len for r in requests])   # the step that made each token
        self.release_step = [-1] * len(requests)   # run_index -> batch after which its memory was freed
        self.waiting: list = []                 # heap of (queue key, request)
        self.running: list[Request] = []        # admitted, in admission order
        self.static_batch: list[Request] = []   # static: the batch's members, until its last finishes
        self.idle_k = self.idle_ctx = 0         # static: finished members' seats, their contexts summed
        self.n_batches = 0
        self.n_finished = 0
        self.decodes_follow = False             # the last batch: its steps after it are its requests' decodes

    def add(self, req: Request) -> None:
        """`req` arrives (or comes back after a preemption) and waits."""
        req.status = Status.WAITING
        key = self.arrival_order(req)           # FCFS: arrival, then submission order
        if self.cfg.order == "spf":             # SPF: predicted tokens still to come first
            key = (req.predicted_output - req.n_generated,) + key
        heapq.heappush(self.waiting, (key, req))

    # ---- one iteration ------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        """Choose the next batch; None when nothing can run now."""
        cfg = self.cfg
        ready = self.running if cfg.n_workers == 1 else [r for r in self.running if r.status is Status.RUNNING]
        if len(ready) > cfg.max_bs:
            ready = ready[:cfg.max_bs]
        if cfg.chunked_prefill:
            decodes = [r for r in ready if r.n_generated and r.n_to_feed == 1]
            chunks = [r for r in ready if not r.n_generated or r.n_to_feed > 1]
        else:                                   # unchunked prefills catch up at once: all decode
            decodes, chunks = ready, []
        budget = cfg.max_num_batched_tokens or NO_LIMIT
        batch = Batch(self.n_batches, [], NO_WORK)
        n_decodes = 0                           # the decodes come first in `works`
        if cfg.static:
            if not self.static_batch:           # a new batch only when none is running
                self.admit(batch, cfg.max_bs, NO_LIMIT)
                self.static_batch = [r for r, _, _ in batch.works]
            elif decodes:
                n_decodes = self._decode(batch, decodes)
        elif cfg.prefill == "prefill_first":
            self.admit(batch, cfg.max_bs - len(ready), budget)
            if not batch.works and decodes:     # a step that admits runs only prefills
                n_decodes = self._decode(batch, decodes)
        else:
            if decodes:
                n_decodes = self._decode(batch, decodes)
            seats = cfg.max_bs - len(ready) + len(batch.preempted)
            budget -= len(batch.works)
            for r in chunks:
                if r.status is Status.WAITING:
                    continue                    # preempted just now
                if budget > 0:
                    n = min(r.n_to_feed, budget)
                    batch.works.append((r, n, r.num_computed_tokens))
                    budget -= n
            if not batch.preempted:
                self.admit(batch, seats, budget)
        if not batch.works:
            return batch if batch.preempted else None
        return self._launch(batch, n_decodes)

    def _decode(self, batch: Batch, decodes: list[Request]) -> int:
        """Each decoder stores one more token; while one does not fit, preempt the latest arrival."""
        mem = self.memory
        if mem.can_run_out:
            decodes = sorted(decodes, key=self.arrival_order)
            for r in decodes:
                while r.status is not Status.WAITING and not mem.grow(r, 1):
                    self._preempt(batch, max(self._ready(), key=self.arrival_order))
            decodes = [r for r in decodes if r.status is not Status.WAITING]
        else:
            mem.grow_all(decodes)
        computed = [r.num_computed_tokens for r in decodes]
        batch.works = list(zip(decodes, repeat(1), computed))
        self._decode_ctx = sum(computed)
        return len(decodes)

    def admit(self, batch: Batch, seats: int, budget: int) -> None:
        """Admit from the queue in order while a seat, the token budget and the memory allow.
        When the head does not fit: stop, don't skip."""
        while self.waiting and seats > 0 and budget > 0:
            head = self.waiting[0][1]
            need = head.n_to_feed
            if need > budget and not self.cfg.chunked_prefill:
                break
            if not self.memory.try_admit(head):
                break
            heapq.heappop(self.waiting)
            head.status = Status.RUNNING
            self.running.append(head)
            if head.num_computed_tokens:        # its K/V comes back from host memory
                batch.swapped_in.append((head, head.num_computed_tokens))
            n = min(need, budget)
            batch.works.append((head, n, head.num_computed_tokens))
            seats -= 1
            budget -= n

    def _preempt(self, batch: Batch, victim: Request) -> None:
        self.running.remove(victim)
        if self.memory.preempt(victim):
            batch.swapped_out.append((victim, victim.num_computed_tokens))
        else:
            victim.num_computed_tokens = 0      # recomputed when readmitted
        victim.n_preemptions += 1
        batch.preempted.append(victim)
        self.add(victim)

    def _launch(self, batch: Batch, n_decodes: int) -> Batch:
        rest = batch.works[n_decodes:] if n_decodes else batch.works
        self.store(rest)                        # prefills and chunks (the decodes grew in `_decode`)
        self.decodes_follow = self._decodes_follow(batch, rest)
        ctx = self.idle_ctx + (self._decode_ctx if n_decodes else 0)
        batch.totals = step_totals(rest, self.idle_k + n_decodes, ctx)
        if self.cfg.n_workers > 1:
            for r, _, _ in batch.works:
                r.status = Status.IN_FLIGHT
        self.n_batches += 1
        return batch

    def store(self, works: list[tuple[Request, int, int]]) -> None:
        """The admitted requests' prefills and the chunks store their tokens' K/V (admission set it aside)."""
        mem = self.memory
        for r, n, _ in works:
            if not mem.grow(r, n):
                raise RuntimeError(f"{type(mem).__name__} admitted request {r.req_id!r} but has no room "
                                   f"for its {n} tokens (a memory manager bug)")

    def _decodes_follow(self, batch: Batch, rest: list[tuple[Request, int, int]]) -> bool:
        """Will the next steps be one decode for each of this batch's requests, and nothing else,
        until a request finishes or an arrival joins? True when the batch holds every running
        request, none was preempted, every prompt in it is done by this step, and the queue cannot
        be admitted before a finish (nothing frees memory or seats; a token budget would have room
        once these prompts are done, so with a budget the queue must be empty). `fast_forward.py`
        then prices those decodes at once."""
        if batch.preempted or len(batch.works) != len(self.running):
            return False
        if rest:
            if self.waiting and self.cfg.max_num_batched_tokens is not None:
                return False
            for r, n, p in rest:
                if p + n != r.prompt_len + r.n_generated:
                    return False                # a chunk: its prompt goes on next step
        return True

    def _ready(self) -> list[Request]:
        return [r for r in self.running if r.status is Status.RUNNING]

    @staticmethod
    def arrival_order(r: Request) -> tuple:
        """FCFS order: arrival, then submission (the order decodes grow in when memory can run out)."""
        return (r.arrival_s, r.run_index)

    # ---- a live run (`Engine.add`, `Engine.abort`) -------------------------------------------
    def extend(self, req: Request) -> None:
        """A live run: `req` (its `run_index` the next) joins the run's per-request columns."""
        assert req.run_index == len(self.release_step)
        self.tokens.extend(req.output_len)
        self.release_step.append(-1)

    def abort(self, req: Request) -> None:
        """`req` leaves before its end: out of the queue or the running pool, its memory freed now.
        It counts in `n_finished` (the requests that left)."""
        if req.status is Status.WAITING:
            self.waiting = [(k, r) for k, r in self.waiting if r is not req]
            heapq.heapify(self.waiting)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
            if req in self.static_batch:
                self.static_batch.remove(req)
        else:
            raise RuntimeError(f"request {req.req_id!r} is {req.status.value}: only a waiting or running "
                               "request can be aborted")
        if self.memory.holds(req):
            self.memory.free(req)
        req.status = Status.ABORTED
        self.n_finished += 1
        self.release_step[req.run_index] = self.n_batches - 1

    # ---- a batch returns ----------------------------------------------------------------------
    def complete(self, batch: Batch, tokens: list[int] | None = None) -> list[Request]:
        """Bring the batch's requests up to date; return those that finished (memory freed).
        `tokens` (torch) has one token per work; a chunk that does not end its prompt yields none.
        After a fast-forward (`batch.n_steps = m > 1`) each request of the batch, and each one that
        joined at step `s` (`batch.joined`), made a token in every step until it finished (the
        fast-forward already let go of those that finished inside the run, at their step). Also
        notes which batch made each token (`self.tokens`)."""
        m, index = batch.n_steps, batch.index
        last = index + m - 1
        if tokens is not None:
            for (r, n, p), tok in zip(batch.works, tokens):
                if p + n == r.prompt_len + r.n_generated:
                    if r.output_ids is None:
                        r.output_ids = []
                    r.output_ids.append(int(tok))
        if last >= MAX_STEPS:
            raise RuntimeError(f"a run may have at most {MAX_STEPS} steps")
        view, first = self.tokens.view, self.tokens.first
        finished: list[Request] = []            # requests this call lets go of,
        made: list[int] = []                    # with the tokens each made in it
        gone: list[Request] = []                # those the fast-forward let go of already
        if m == 1:
            for r, n, p in batch.works:
                done, g = p + n, r.n_generated
                if done < r.prompt_len + g:     # a chunk: not caught up yet
                    r.num_computed_tokens = done
                    continue
                view[first[r.run_index] + g] = index    # caught up: the step made its next token
                r.num_computed_tokens = done
                r.n_generated = g = g + 1
                if g >= r.output_len:
                    finished.append(r)
                    made.append(1)
        else:                                   # fast-forwarded: this step, then decodes until done or m
            slots, counts = [], []
            slot, count = slots.append, counts.append
            for r, n, p in batch.works:         # every prompt is done by this step: it makes token g
                g = p + n - r.prompt_len
                c = r.output_len - g            # tokens it still had to make: it finishes in this run
                if c > m:
                    c = m
                elif r.status is Status.FINISHED:
                    gone.append(r)
                else:
                    finished.append(r)
                    made.append(c)
                slot(first[r.run_index] + g)
                count(c)
                r.num_computed_tokens = p + n + c - 1
                r.n_generated = g + c
            self.tokens.note_run([index] * len(slots), counts, slots)
            if batch.joined:
                starts, slots, counts = [], [], []
                for r, s in batch.joined:
                    c = min(r.output_len, last - s + 1)
                    if r.status is Status.FINISHED:     # (one that finished in the run is let go already)
                        gone.append(r)
                    elif c == r.output_len:
                        finished.append(r)
                        made.append(c + s - index)  # (counted from the batch's first step)
                    starts.append(s)
                    slots.append(first[r.run_index])
                    counts.append(c)
                    r.num_computed_tokens = r.prompt_len + c - 1
                    r.n_generated = c
                self.tokens.note_run(starts, counts, slots)
        if self.cfg.n_workers > 1:
            for r, _, _ in batch.works:
                r.status = Status.RUNNING
        self.idle_ctx += self.idle_k * m
        for r, c in zip(finished, made):
            if not self.cfg.static:
                self.finish(r, index + c - 1)
            else:
                r.status = Status.FINISHED
                self.running.remove(r)
                self.n_finished += 1
                if self.cfg.static_idle_seats_cost:
                    self.idle_k += 1            # its seat keeps costing until the batch ends
                    self.idle_ctx += r.num_computed_tokens + m - c
        if self.cfg.static and self.static_batch and not self.running:
            for r in self.static_batch:         # the batch's last request finished: seats and memory go
                self.memory.free(r)
                self.release_step[r.run_index] = last
            self.static_batch = []
            self.idle_k = self.idle_ctx = 0
        return gone + finished

    def finish(self, r: Request, step: int) -> None:
        """`r` made its last token in batch `step`: it leaves the running pool and its memory goes."""
        r.status = Status.FINISHED
        self.running.remove(r)
        self.n_finished += 1
        self.memory.free(r)
        self.release_step[r.run_index] = step
