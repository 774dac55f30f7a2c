"""A live run's bookkeeping in the scheduler: requests join, leave early, and the past is dropped.

Algorithm 1 (`scheduler.py`) serves a run whose requests are all known when it starts. A live run
(`Engine.start_live`, a server's) takes requests while it runs: `Engine.add` extends the run's
columns by one (`extend_run`), `Engine.abort` takes one out before its end (`abort`), and
`Engine.forget_done` drops those that left and renumbers the rest (`forget`). `LiveRun` is
`Scheduler`'s base, so a policy with state of its own by step overrides `forget` as it overrides
any other method (docs/extending.md).
"""
from __future__ import annotations

import heapq

import numpy as np

from orca_torch.checks import brief
from orca_torch.core.memory import MemoryManager
from orca_torch.core.request import Request, Status
from orca_torch.core.token_steps import TokenSteps


class LiveRun:
    """The calls a live run makes on a `Scheduler` besides Algorithm 1's, over its state (a queued
    request goes back through `Scheduler.add`, one that leaves counts through `Scheduler._leave`)."""

    memory: MemoryManager
    tokens: TokenSteps
    release_step: list[int]
    waiting: list
    running: list[Request]
    n_batches: int
    n_done: int

    def extend_run(self, req: Request) -> None:
        """`req` (its `run_index` the next) joins the run's per-request columns."""
        assert req.run_index == len(self.release_step)
        self.tokens.extend(req.output_len)
        self.release_step.append(-1)

    def forget(self, keep: list[Request]) -> int:
        """The requests that left the run are dropped (`Engine.forget_done`): `keep`, those still in
        it in run order, become requests 0, 1, ... with the tokens they made, and the queue's
        requests are added again under the new numbers (as a preempted request comes back), which
        keeps their order. Step indices then count from the first step that made a kept token (so a
        live run that never ends stays below `MAX_STEPS` steps); returns how many steps came before
        it."""
        old, first = self.tokens.steps, self.tokens.first
        base = min([self.n_batches] + [int(old[first[r.run_index]]) for r in keep if r.n_generated])
        self.tokens = TokenSteps([r.output_len for r in keep])
        for i, r in enumerate(keep):
            assert self.release_step[r.run_index] == -1, f"{brief(r.req_id)} has left the run"
            was_at, now_at = first[r.run_index], self.tokens.first[i]     # its first token's place, old and new
            self.tokens.steps[now_at:now_at + r.n_generated] = old[was_at:was_at + r.n_generated] - np.uint32(base)
            r.run_index = i
        self.n_batches -= base
        self.release_step = [-1] * len(keep)
        queued, self.waiting = [r for _, r in self.waiting], []
        for r in queued:
            self.add(r)
        self.n_done = 0
        return base

    def abort(self, req: Request) -> None:
        """`req` leaves before its end: out of the queue or the running pool, its memory freed now.
        It counts in `n_done` (the requests that left)."""
        assert req.status in (Status.WAITING, Status.RUNNING), f"{brief(req.req_id)} is {req.status.value}"
        if req.status is Status.WAITING:
            self.waiting = [(k, r) for k, r in self.waiting if r is not req]
            heapq.heapify(self.waiting)
        else:
            self.running.remove(req)
        self._leave(req, Status.ABORTED)
        if self.memory.holds(req):
            self.memory.free(req)
        self.release_step[req.run_index] = self.n_batches - 1
