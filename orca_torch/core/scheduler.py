"""Orca's scheduler, Algorithm 1 (lecture §4.3): iteration-level FCFS, `max_bs`, reservation, pipelining.

State: a `waiting` queue, a `running` list, the step that made each token (`tokens`) and the step
after which each request's memory went (`release_step`). A request needs `n_to_feed = prompt_len +
n_generated - num_computed_tokens` tokens fed to make its next token: a prefill, a prompt chunk, a
decode (1 token) and the recompute after a preemption are all that one "catch up".

`schedule()` picks ONE iteration, a `Batch`: the running requests `decode` first (rule
iteration-level FCFS; where memory can run out, `victim`, the latest arrival, is preempted), then
`admit` takes the queue in order while `max_bs`, the token budget and the memory allow, and stops
at the first request that does not fit (rule reservation, stop don't skip: exercise 1b).
`complete(batch, tokens)` brings the batch's requests up to date: every counter is true after it.

The lecture's pseudocode (§5.1) admits first and checks the decodes' memory after. Here the decodes
grow first and a step that had to preempt admits no one (vLLM's order): memory short enough to
evict a running request has no room for a new one. Where memory cannot run out (Orca's
reservation) both orders admit the same requests, which changes no step's totals and no token.

With `n_workers > 1` (§4.4) the engine keeps up to `n_workers` batches in flight (rule
n_scheduled < n_workers, `pipeline.py`) and `_ready` leaves out a request in flight (Algorithm 1's
select skips it). Elsewhere: the other shapes (prefill-first, chunked, static) and the pairings
they refuse, `policies.py`; a live run's joins and leaves, `live_run.py`; the same algorithm as one
plain loop, `tests/reference_engine.py`.
"""
from __future__ import annotations

import heapq
from itertools import repeat

from orca_torch.checks import brief
from orca_torch.core.batch import Batch, ScheduledSeq, StepTotals, Swap, step_totals
from orca_torch.core.live_run import LiveRun
from orca_torch.core.memory import MemoryManager
from orca_torch.core.request import Request, Status
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.core.token_steps import MAX_STEPS, TokenSteps

NO_LIMIT = 1 << 62
NO_WORK = StepTotals()


class Scheduler(LiveRun):
    """Algorithm 1 over a memory manager; the engine calls `add`, `schedule`, `complete`."""

    checks_batches = False
    """True for a new policy (`scheduler=`), wrapped by `policies.make_scheduler` in `policy_check`'s checks."""

    request_level = False
    """True for request-level (static) batching: a batch holds its memory until its last member finishes."""

    def __init__(self, config: SchedulerConfig, memory: MemoryManager) -> None:
        self.cfg = config
        self.memory = memory
        self.budget = config.max_num_batched_tokens or NO_LIMIT    # tokens a step may feed
        self.start()

    def start(self, requests: list[Request] | None = None) -> None:
        """Reset for a new run over `requests`, numbered by the engine (`run_index` 0, 1, ...)."""
        self.memory.reset()
        requests = requests or []
        self.tokens = TokenSteps([r.output_len for r in requests])
        self.release_step = [-1] * len(requests)   # run_index -> batch after which its memory was freed
        self.waiting: list = []                 # heap of (queue key, request)
        self.running: list[Request] = []        # admitted, in admission order
        self.n_batches = 0
        self.n_done = 0

    def add(self, req: Request) -> None:
        """`req` arrives (or comes back after a preemption) and waits, in the order `queue_key` gives,
        then arrival, then submission: no two keys are equal, so the heap never compares requests."""
        req.status = Status.WAITING
        heapq.heappush(self.waiting, (self.queue_key(req) + self.arrival_order(req), req))

    def queue_key(self, req: Request) -> tuple:
        """What orders the queue before arrival: nothing for FCFS, the predicted tokens still to come
        for SPF. A policy with its own order overrides this alone (a tuple, read again when a
        preempted request comes back), keeping the state and the ties `add` keeps."""
        if self.cfg.order == "spf":
            return (req.predicted_output - req.n_generated,)
        return ()

    @staticmethod
    def arrival_order(r: Request) -> tuple:
        """FCFS order: arrival, then submission (the order decodes grow in when memory can run out)."""
        return (r.arrival_s, r.run_index)

    # ---- one iteration ------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        """The next batch; None when nothing can run now (a batch of preemptions alone is returned:
        its victims' memory is gone)."""
        batch = Batch(self.n_batches, [], NO_WORK)
        self.select(batch, self._ready())
        if not batch.works:
            return batch if batch.preempted else None
        return self._launch(batch)

    def _ready(self) -> list[Request]:
        """The running requests that may run this step, at most `max_bs` (rule max_bs), none in flight
        (a new list: `running` changes as the step admits and preempts)."""
        cfg = self.cfg
        ready = self.running if cfg.n_workers == 1 else [r for r in self.running if r.status is Status.RUNNING]
        return ready[:cfg.max_bs]

    def select(self, batch: Batch, ready: list[Request]) -> None:
        """Orca's step: every ready request decodes, then the queue fills the seats left (none when
        a decode had to preempt: the memory is short)."""
        if ready:
            self.decode(batch, ready)
        if not batch.preempted:
            self.admit(batch, self.cfg.max_bs - len(ready), self.budget - len(batch.works))

    def decode(self, batch: Batch, decodes: list[Request]) -> None:
        """Rule iteration-level FCFS: the running requests go first, one token each. Each stores
        one more token; while one does not fit, the request `victim` names is preempted."""
        assert not batch.works, f"decode on batch {batch.index}, which already holds {len(batch.works)} works"
        mem = self.memory
        if mem.can_run_out:
            decodes = sorted(decodes, key=self.arrival_order)
            for i, r in enumerate(decodes):
                while r.status is not Status.WAITING and not mem.grow(r, 1):
                    grown = set(decodes[:i])
                    self._preempt(batch, self.victim([q for q in self.running if q not in grown]))
            decodes = [r for r in decodes if r.status is not Status.WAITING]
        else:
            mem.grow_all(decodes)
        n_past = [r.num_computed_tokens for r in decodes]
        batch.works = list(map(ScheduledSeq, decodes, repeat(1), n_past))
        batch.totals = step_totals((), len(decodes), sum(n_past))    # (`_launch` adds the rest)

    def victim(self, candidates: list[Request]) -> Request:
        """Whom `decode` preempts while a decode does not fit (§5.1 step 4), one of `candidates`: the
        running requests this step has not grown yet, the one in need among them (a swapped-out
        victim that had grown would take a token the step never computes). The latest arrival, as
        vLLM evicts under FCFS, so earlier arrivals keep their place (rule iteration-level FCFS); it
        recomputes, or swaps back in, when readmitted. A policy that evicts in another order
        overrides this alone."""
        return max(candidates, key=self.arrival_order)

    def admit(self, batch: Batch, seats: int, budget: int) -> None:
        """Admit from the queue in order while a seat (rule max_bs), the token budget and the
        memory allow. Rule reservation with stop-don't-skip: when the head does not fit, stop."""
        while self.waiting and seats > 0 and budget > 0:
            head = self.waiting[0][1]
            n = self.prompt_share(head, budget)
            if not n or not self.memory.try_admit(head):
                break
            heapq.heappop(self.waiting)
            head.status = Status.RUNNING
            self.running.append(head)
            if head.num_computed_tokens:        # its K/V comes back from host memory
                batch.swapped_in.append(Swap(head, head.num_computed_tokens))
            batch.works.append(ScheduledSeq(head, n, head.num_computed_tokens))
            seats -= 1
            budget -= n

    def prompt_share(self, req: Request, budget: int) -> int:
        """Tokens `req` feeds this step if admitted with `budget` left: all it needs, or 0 (it does
        not fit; chunked prefill takes what fits, and cuts each later chunk of the prompt too)."""
        need = req.n_to_feed
        return need if need <= budget else 0

    def _preempt(self, batch: Batch, victim: Request) -> None:
        self.running.remove(victim)
        if self.memory.preempt(victim):
            batch.swapped_out.append(Swap(victim, victim.num_computed_tokens))
        else:
            victim.num_computed_tokens = 0      # recomputed when readmitted
        victim.n_preemptions += 1
        batch.preempted.append(victim)
        self.add(victim)

    def _launch(self, batch: Batch) -> Batch:
        """The works after the decodes (whole prompts, chunks, recomputes) store their K/V, which
        admission set aside; the totals are completed; pipelined, the requests go in flight."""
        prompts = batch.works[batch.totals.n_seqs:]   # (so far the totals count the decodes alone)
        for req, n_new, _ in prompts:
            stored = self.memory.grow(req, n_new)
            assert stored, (f"{type(self.memory).__name__}.grow({brief(req.req_id)}, {n_new}) answered {stored!r} "
                            "after try_admit let the request in (grow answers True when the tokens are stored)")
        batch.totals += step_totals(prompts)
        if self.cfg.n_workers > 1:
            for w in batch.works:
                w.req.status = Status.IN_FLIGHT
        self.n_batches += 1
        return batch

    # ---- a batch returns ----------------------------------------------------------------------
    def complete(self, batch: Batch, tokens: list[int] | None = None) -> list[Request]:
        """Bring the batch's requests up to date: each that caught up made its next token, its step
        noted in `self.tokens` (a chunk short of its prompt's end makes none; `tokens`, torch's, has
        one per work). Returns those that finished (`finish`)."""
        index = batch.index
        assert index < MAX_STEPS, f"a run may have at most {MAX_STEPS} steps"
        view, first = self.tokens.view, self.tokens.first
        finished: list[Request] = []
        for i, (req, n_new, n_past) in enumerate(batch.works):
            n_stored, n_made = n_past + n_new, req.n_generated
            req.num_computed_tokens = n_stored
            if n_stored < req.prompt_len + n_made:  # a chunk: not caught up yet
                continue
            view[first[req.run_index] + n_made] = index     # caught up: this step made its next token
            req.n_generated = n_made = n_made + 1
            if tokens is not None:
                if req.output_ids is None:
                    req.output_ids = []
                req.output_ids.append(int(tokens[i]))
            if n_made >= req.output_len:
                finished.append(req)
        if self.cfg.n_workers > 1:
            for w in batch.works:
                w.req.status = Status.RUNNING
        for r in finished:
            self.finish(r, index)
        return finished

    def finish(self, r: Request, step: int) -> None:
        """`r` made its last token in batch `step`: it leaves the running pool and its memory goes."""
        self.running.remove(r)
        self._leave(r, Status.FINISHED)
        self._free(r, step)

    def _leave(self, r: Request, status: Status) -> None:
        """`r` is done (FINISHED or ABORTED): the one place `n_done`, the requests that left, moves."""
        r.status = status
        self.n_done += 1

    def _free(self, r: Request, step: int) -> None:
        """`r`'s memory goes back after batch `step` (its `release_step`)."""
        self.memory.free(r)
        self.release_step[r.run_index] = step
