"""The knobs that change Algorithm 1's shape, one small scheduler each (lecture §3, §6.4, exercise 9).

- `PrefillFirstScheduler` (early vLLM, §6.4): a step that admits anyone runs only prefills; the
  running requests decode in the steps where nobody is admitted.
- `ChunkedPrefillScheduler` (Sarathi-Serve, exercise 9): the decodes first, then the prompts still
  being fed take their next chunk, then admission; a prompt longer than what the token budget
  leaves is cut to fit.
- `StaticScheduler` (request-level batching, the baseline of §3): a batch starts only when none is
  running and runs until its last member finishes; with `static_idle_seats_cost` a finished
  member's seat keeps costing one decode per step (FasterTransformer's fixed shape), and every
  member's memory goes back when the batch ends.

`make_scheduler(config, memory)` builds the one a `SchedulerConfig` asks for (`Scheduler` itself
for Orca's mixed steps, with or without a token budget), or a new policy given to it, in the checks
of `policy_check`, after refusing a pairing of knobs and memory it cannot serve (`check_pairing`).
"""
from __future__ import annotations

from orca_torch.checks import brief
from orca_torch.core.batch import Batch, ScheduledSeq, step_totals
from orca_torch.core.memory import MemoryManager
from orca_torch.core.policy_check import check_decodes, check_filled, check_key, check_set_up, check_victim
from orca_torch.core.request import Request, Status
from orca_torch.core.scheduler import NO_LIMIT, Scheduler
from orca_torch.core.scheduler_config import SchedulerConfig


class PrefillFirstScheduler(Scheduler):
    """Prefills alone whenever the queue lets anyone in; otherwise the running requests decode."""

    def select(self, batch: Batch, ready: list[Request]) -> None:
        self.admit(batch, self.cfg.max_bs - len(ready), self.budget)
        if not batch.works and ready:
            self.decode(batch, ready)


class ChunkedPrefillScheduler(Scheduler):
    """Every step's decodes mixed with prompt chunks that fill the token budget they leave."""

    def select(self, batch: Batch, ready: list[Request]) -> None:
        decodes, prompts = [], []               # a decode: past its prompt, one token to feed
        for r in ready:
            (decodes if r.n_generated and r.n_to_feed == 1 else prompts).append(r)
        if decodes:
            self.decode(batch, decodes)
        budget = self.budget - len(batch.works)
        for r in prompts:                       # a prompt still being fed: its next chunk, as prompt_share cuts it
            if budget > 0 and r.status is not Status.WAITING and (n := self.prompt_share(r, budget)):
                batch.works.append(ScheduledSeq(r, n, r.num_computed_tokens))     # (WAITING: preempted just now)
                budget -= n
        if not batch.preempted:
            self.admit(batch, self.cfg.max_bs - len(ready), budget)

    def prompt_share(self, req: Request, budget: int) -> int:
        return min(req.n_to_feed, budget)


class StaticScheduler(Scheduler):
    """Request-level batching: `members` run together from their prefill to the last one's finish."""

    request_level = True

    def start(self, requests: list[Request] | None = None) -> None:
        super().start(requests)
        self.members: list[Request] = []        # the batch running now, until its last member finishes
        self.n_idle_seats = 0                   # finished members whose seat still costs a decode a step,
        self.idle_seats_ctx = 0                 # and those seats' contexts summed

    def select(self, batch: Batch, ready: list[Request]) -> None:
        if not self.members:                    # a new batch only when none is running
            self.admit(batch, self.cfg.max_bs, NO_LIMIT)
            self.members = [w.req for w in batch.works]
        else:                                   # (its members still running: every one decodes)
            self.decode(batch, ready)

    def _launch(self, batch: Batch) -> Batch:
        batch = super()._launch(batch)
        if self.n_idle_seats:
            batch.totals += step_totals((), self.n_idle_seats, self.idle_seats_ctx)
        return batch

    def complete(self, batch: Batch, tokens: list[int] | None = None) -> list[Request]:
        self.idle_seats_ctx += self.n_idle_seats    # an idle seat's context grows like a decode's
        return super().complete(batch, tokens)

    def finish(self, r: Request, step: int) -> None:
        """`r` is done, but its seat and memory are the batch's until the last member finishes."""
        self.running.remove(r)
        self._leave(r, Status.FINISHED)
        if self.cfg.static_idle_seats_cost:
            self.n_idle_seats += 1
            self.idle_seats_ctx += r.num_computed_tokens
        if not self.running:                    # the batch's last request: seats and memory go
            for m in self.members:
                self._free(m, step)
            self.members = []
            self.n_idle_seats = self.idle_seats_ctx = 0


def feeds_prompts_whole(cls: type[Scheduler]) -> bool:
    """Whether `cls` admits a prompt only whole (never a chunk of it), whatever its config's
    `chunked_prefill` says: it takes `admit` and `prompt_share` from `Scheduler` unchanged, as
    `Scheduler` and `PrefillFirstScheduler` do, and a new policy that changes its queue's order, its
    victim or its `select` (a prompt joins the running pool only through `admit`, in the share
    `prompt_share` gives it). A new policy that changes either may chunk as it likes: its config's
    `chunked_prefill` is taken at its word."""
    return cls.admit is Scheduler.admit and cls.prompt_share is Scheduler.prompt_share


def check_policy(scheduler, config: SchedulerConfig) -> type[Scheduler] | None:
    """`scheduler` itself if it is None or a `Scheduler` subclass (a policy built as `scheduler(config,
    memory)`) that does what the class `config`'s knobs name (`policy_for`) does: request-level
    batching for `StaticScheduler`, prefill-only steps for `PrefillFirstScheduler` (a subclass),
    chunked prompts for `ChunkedPrefillScheduler` (not `feeds_prompts_whole`)."""
    if scheduler is None:
        return None
    if not (isinstance(scheduler, type) and issubclass(scheduler, Scheduler)):
        raise ValueError(f"scheduler must be a Scheduler subclass (built as scheduler(config, memory)), "
                         f"got {brief(scheduler)}")
    named = policy_for(config)
    if named is Scheduler:      # no knob names a class (they are exclusive: at most one does)
        return scheduler
    knob, does, default = {
        StaticScheduler: ("static=True", scheduler.request_level,
                          "static=False (in api, a system other than 'static')"),
        PrefillFirstScheduler: ("prefill='prefill_first'", issubclass(scheduler, PrefillFirstScheduler),
                                "prefill='mixed'"),
        ChunkedPrefillScheduler: ("chunked_prefill=True", not feeds_prompts_whole(scheduler),
                                  "chunked_prefill=False")}[named]
    if not does:
        raise ValueError(f"scheduler={scheduler.__name__} decides itself how a step is filled, so {knob} would "
                         f"be ignored: give a {named.__name__} subclass as scheduler=, or leave {default}")
    return scheduler


def policy_for(config: SchedulerConfig) -> type[Scheduler]:
    """The scheduler class that implements `config`."""
    if config.static:
        return StaticScheduler
    if config.chunked_prefill:
        return ChunkedPrefillScheduler
    if config.prefill == "prefill_first":
        return PrefillFirstScheduler
    return Scheduler


def check_pairing(cls: type[Scheduler], config: SchedulerConfig, memory: MemoryManager) -> None:
    """Refuse `cls` over `config` and `memory` where Algorithm 1 cannot serve them: memory that can
    run out preempts, which only one batch in flight allows (a request in flight cannot be evicted),
    and which request-level batching never does (it frees a batch's memory at its end alone);
    request-level batching starts a batch only when none runs, whole prompts and all."""
    if memory.can_run_out and config.n_workers > 1:
        raise ValueError("a memory manager that can run out (preemption) needs n_workers=1")
    if memory.can_run_out and (config.static or cls.request_level):
        what = cls.__name__ if cls.request_level else "static=True"
        raise ValueError(f"static batching ({what}) keeps a batch's memory until its last member "
                         f"finishes and never preempts: it needs a reserving or unlimited memory manager, one "
                         f"that cannot run out, got {type(memory).__name__}")
    if cls.request_level and (config.max_num_batched_tokens is not None or config.n_workers != 1):
        raise ValueError(f"{cls.__name__} starts a batch only when none is running, whole prompts and "
                         "all, so it cannot keep to a step budget and a second batch in flight would never start: "
                         f"it takes max_num_batched_tokens=None and n_workers=1, got max_num_batched_tokens="
                         f"{config.max_num_batched_tokens}, n_workers={config.n_workers}")


def make_scheduler(config: SchedulerConfig, memory: MemoryManager,
                   policy: type[Scheduler] | None = None) -> Scheduler:
    """The scheduler that implements `config`, or `policy` (a new one, given as `scheduler=`) over it,
    checked as set up when built and at each `start` (`policy_check.check_set_up`), and its `select`,
    `decode`, `queue_key` and `victim` wrapped so that each call of `decode` is checked
    before it acts (`policy_check.check_decodes`), each batch as it is filled
    (`policy_check.check_filled`), each queue key as it is given (`policy_check.check_key`) and each
    victim before it is preempted (`policy_check.check_victim`): the checks of code from outside sit
    at this door, and `Scheduler` itself carries none of them. Either is refused first over a
    config and memory it cannot serve (`check_pairing`)."""
    cls = policy or policy_for(config)
    check_pairing(cls, config, memory)
    if policy is None:
        return cls(config, memory)
    name = policy.__name__
    scheduler = policy(config, memory)
    check_set_up(scheduler, name, 0)
    scheduler.checks_batches = True
    key_of, select, decode, victim, start = (scheduler.queue_key, scheduler.select, scheduler.decode,
                                             scheduler.victim, scheduler.start)

    def checked_start(requests: list[Request] | None = None) -> None:
        start(requests)
        check_set_up(scheduler, name, len(requests or ()))

    def checked_select(batch: Batch, ready: list[Request]) -> None:
        select(batch, ready)
        check_filled(batch, name, scheduler.running, scheduler.cfg.max_bs, scheduler.budget, scheduler.memory)

    def checked_decode(batch: Batch, decodes: list[Request]) -> None:
        check_decodes(batch, decodes, name, scheduler.running)
        decode(batch, decodes)

    first: list[tuple] = []                     # the first key it gives, which every other must match

    def checked_key(req: Request) -> tuple:
        key = check_key(key_of(req), name, req, first[0] if first else None)
        if not first:
            first.append(key)
        return key

    def checked_victim(candidates: list[Request]) -> Request:
        # (its own copy: a policy may take its victim out of the list, which the check reads after)
        return check_victim(victim(list(candidates)), name, candidates, scheduler.running, scheduler.n_batches)

    scheduler.start = checked_start
    scheduler.queue_key = checked_key
    scheduler.victim = checked_victim
    scheduler.decode = checked_decode
    scheduler.select = checked_select
    return scheduler
