"""The iteration-level engine: schedule -> execute -> record -> complete, until all are done (lecture §4.1, §5.1).

`Engine(executor, memory, config).run(requests)` drives Orca's scheduler (`scheduler.py`) with any
executor: the paper GPU (`CostModelExecutor`, a simulated clock) or the real torch model
(`TorchExecutor`, the wall clock, CUDA events, or iterations). It records when every token of every
request came out (the batch that made it; numpy arrays in the `RunResult`, `run_result.py`) and
the occupancy of each step. Finished requests leave at once and free their memory; when an
on-demand memory manager cannot grow, the scheduler preempts the latest-arrived running request
(recompute, or swap when the manager keeps the K/V in host memory). A failed run (an executor error, a bad
duration) resets the executor and the memory manager before the error reaches the caller.

Time model:
- The clock counts from the first arrival (`RunResult.clock_origin_s`), so arrivals given as Unix
  timestamps keep every step's duration; a step the clock still cannot hold (`t + d == t`: arrivals
  so far apart that a float there is coarser than a step) stops the run with a ValueError
  (`durations.check_clock`).
- `n_workers = 1`: a batch starts when the previous one ends; a request that arrives during a
  step is seen at the next step (it waits at most one iteration, §4.1).
- `n_workers = P > 1` (Orca's pipelining, §4.4, `pipeline.py`): up to P batches in flight, leaving
  in order. A synchronous executor's batch passes through its stages in a row (`n_stages`),
  waiting at a stage the batch before it still holds; an asynchronous executor keeps its own
  clock. Tokens exist when the batch leaves.

`Engine.step()` is one iteration: schedule -> execute -> record -> complete (pipelined: one batch
enters the pipeline or the oldest leaves it). It returns the `Batch`, so a notebook or a debugger
can go one step at a time and look at `engine.scheduler`'s `waiting` and `running` requests, whose
counters are true after every call; `run()` is `start()`, `step()` until done, `result()`. The
paper GPU's long runs go through `sim/fast_engine.FastEngine`, which produces exactly what this
engine produces step by step, in bulk.

Bad input is refused before anything changes, and the engine stays usable: a request that is
malformed, longer than the context, or whose reservation (or prefill, against the token budget)
could never fit raises ValueError (or, with `on_invalid="reject"`, is marked REJECTED and
reported); an arrival earlier than the one before it, a duplicate or unhashable `req_id`, or a
request another run still holds raises ValueError either way (the run's order depends on them).
"""
from __future__ import annotations

import gc
import math
import weakref
from dataclasses import replace
from typing import Callable, Literal, Sequence

import numpy as np

from orca_torch.checks import (brief, brief_items, check_callable, check_flag, check_instance, check_int, check_items,
                               from_outside, is_finite_real, is_real)
from orca_torch.core.batch import Batch
from orca_torch.core.durations import check_clock, check_duration
from orca_torch.core.executor import Executor, RowsFailed, StepResult
from orca_torch.core.memory import MAX_SLOTS, MemoryManager, occupancy_denominator, slots_to_finish
from orca_torch.core.pipeline import Pipeline
from orca_torch.core.policies import PrefillFirstScheduler, check_policy, feeds_prompts_whole, make_scheduler
from orca_torch.core.request import ACTIVE, Request, Status
from orca_torch.core.run_result import Rejected, RunResult, TraceStep
from orca_torch.core.scheduler import Scheduler
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.core.step_log import StepLog


COPY = "dataclasses.replace(req, req_id=...)"
"""How a live run takes a request again: a copy, under an id the run has not seen (`Engine.add`)."""


class Engine:
    """Drives the scheduler with an executor; `run(requests)` returns a `RunResult`.

    `max_context` is the serving context (default: the model's); the engine hands it to the memory
    manager as the reservation of a request without `max_tokens` (Orca (Max) reserves 8192 for
    Llama-3-8B). `trace=True` keeps every batch's `(req_id, n_new, n_past)` list for tests and charts.
    The run advances the `Request` objects it is given (their counters are its state): a list may be
    run again once its run is over (finished, stopped on an error, or replaced by this engine's next
    run, which leaves the requests it had not finished ABORTED), but a request still waiting or
    running in another engine's run is refused (`api.run` copies the caller's).
    `scheduler`, a `Scheduler` subclass built as `scheduler(config, memory)`, is a new policy run in
    place of the one `make_scheduler` picks for `config`; each call of its `decode`, each batch it
    fills, each queue key it gives and each victim it names are checked (`policy_check`).
    """

    def __init__(self, executor: Executor, memory: MemoryManager, config: SchedulerConfig | None = None,
                 max_context: int | None = None, trace: bool = False,
                 scheduler: type[Scheduler] | None = None) -> None:
        check_instance("executor", executor, Executor)
        if executor.n_stages is not None:
            check_int(f"{type(executor).__name__}.n_stages", executor.n_stages, 1)
        check_instance("memory", memory, MemoryManager)
        memory.check_set_up()
        executor.check_memory(memory)
        check_instance("config", config, SchedulerConfig, allow_none=True)
        self.trace = check_flag("trace", trace)
        self.config = config or SchedulerConfig()
        model_ctx = executor.max_context
        if max_context is None and model_ctx is None:
            raise ValueError(f"max_context must be given: {type(executor).__name__}.max_context is None; pass "
                             "Engine(..., max_context=N), or set max_context on the executor (the longest context, "
                             "prompt and output, a request may have)")
        max_context = check_int("max_context", model_ctx if max_context is None else max_context, 2,
                                MAX_SLOTS)
        if model_ctx is not None and max_context > model_ctx:
            raise ValueError(f"max_context {max_context} exceeds the model's context {model_ctx}")
        self.max_context = max_context
        self.executor = executor
        self.scheduler = make_scheduler(self.config, memory, check_policy(scheduler, self.config))
        self.memory = memory
        memory.default_max_tokens = max_context
        self.requests: list[Request] = []
        self.done = True
        self.started = self.aborted = False
        self._live_ids: set | None = None       # a live run's request ids (`start_live`)
        self.failed_rows: dict = {}             # this run's last step's requests dropped on `RowsFailed`, with why
        self.n_aborted = self.n_forgotten = self.n_steps_forgotten = 0
        self._ref = weakref.ref(self)           # each of its run's requests' `owner`

    # ---- submission --------------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raise ValueError (saying what is wrong) unless `req`, a `Request` (`start` and `add` check
        that it is one), can be served by this engine."""
        req.validate()
        req.check_context(self.max_context)
        self.memory.default_max_tokens = self.max_context   # (a manager may serve engines of other contexts in turn)
        self.memory.check(req)
        why = self._config_problem(req)
        if why:
            raise ValueError(why)
        self.executor.check(req)

    def _config_problem(self, req: Request) -> str | None:
        """What keeps the scheduler's settings from serving `req` (None: nothing)."""
        cfg = self.config
        if cfg.order == "spf" and req.predicted_output is None:
            return (f"request {brief(req.req_id)} has no predicted_output, which order='spf' needs "
                    "(see workload.with_predictions)")
        budget = cfg.max_num_batched_tokens
        need = slots_to_finish(req) if self.memory.can_run_out else req.prompt_len   # a recompute feeds all it stores
        if budget is None or need <= budget:
            return None
        cls = type(self.scheduler)
        whole = feeds_prompts_whole(cls)
        if cfg.chunked_prefill and not whole:
            return None
        if whole and self.scheduler.checks_batches:
            assert not cfg.chunked_prefill, "check_policy refuses chunked_prefill beside a policy that feeds whole"
            how = "" if cls in (Scheduler, PrefillFirstScheduler) else " (its admit and prompt_share are Scheduler's)"
            fix = (f"{cls.__name__}, given as scheduler=, feeds prompts whole{how}, and chunked_prefill=True is "
                   "refused beside it: enable chunked_prefill with scheduler=ChunkedPrefillScheduler or with "
                   "scheduler= left out")
        else:
            fix = "enable chunked_prefill"
        return (f"request {brief(req.req_id)}: a prefill (or, after a preemption, a recompute) of {need} tokens can "
                f"never fit the step budget max_num_batched_tokens={budget} ({fix})")

    def _refusal(self, req: Request) -> str | None:
        """Why `check` refuses `req` (None: it takes it)."""
        try:
            self.check(req)
        except ValueError as e:
            return str(e)
        return None

    def _intake(self, requests: Sequence[Request], on_invalid: str) -> tuple[list[Request], list[Rejected]]:
        """The run's requests, checked: those accepted and those rejected, with why (changes nothing)."""
        if not isinstance(on_invalid, str) or on_invalid not in ("raise", "reject"):
            raise ValueError(f"on_invalid must be 'raise' or 'reject', got {brief(on_invalid)}")
        requests = check_items("requests", requests, Request)
        if not requests:
            raise ValueError("no requests to run: give at least one request")
        ids: set = set()
        last = -math.inf
        for r in requests:                      # (refused even when rejecting: the run's order depends on it,
            last = _check_follows(r, ids, last)     # and another run's request is not this one's to mark)
            ids.add(r.req_id)
            self._check_free(r, replacing=True)
        accepted: list[Request] = []
        rejected: list[Rejected] = []
        for r in requests:
            if on_invalid == "raise":
                self.check(r)                   # the first bad request stops the run
                accepted.append(r)
            elif (why := self._refusal(r)) is None:
                accepted.append(r)
            else:
                rejected.append(Rejected(r, why))
        return accepted, rejected

    def _check_free(self, r: Request, replacing: bool) -> None:
        """Refuse `r` if a run that is not over holds it (WAITING, RUNNING or IN_FLIGHT there): its
        counters are that run's state, which this one would reset. With `replacing`, this engine's
        own run may hold it: the new run replaces that one (`_end_run`). A run that ends before its
        end lets its requests go (`_end_run`); a copy (`copy`, `dataclasses.replace`) has no owner.
        An engine no one holds any more holds nothing: before refusing, the collector frees one kept
        alive only by a reference cycle (a pipelined engine and its `Pipeline`), so whether a request
        is refused does not depend on when the collector last ran."""
        if r.owner is None or r.status not in ACTIVE:
            return
        if r.owner() not in (None, self):
            gc.collect()
        eng = r.owner()
        if eng is None or (replacing and eng is self):
            return
        if eng is self:                         # (a copy under its id would be a duplicate here)
            raise ValueError(f"request {brief(r.req_id)} is {r.status.value} in this live run: a Request object is one "
                             "run's state and can be in one run at a time; to serve it twice, add a copy under a "
                             f"new req_id ({COPY})")
        raise ValueError(f"request {brief(r.req_id)} is {r.status.value} in another engine's run "
                         f"({type(eng).__name__}) that is not over: a Request object is one run's state and can be in "
                         "one run at a time; give this run a copy (dataclasses.replace(req)), or let that run finish "
                         "first")

    def _in_run(self, req: Request) -> bool:
        """Whether this very object is one of the run's requests."""
        return 0 <= req.run_index < len(self.requests) and self.requests[req.run_index] is req

    def _end_run(self) -> None:
        """The run held now is over before its end (it failed, or a new run replaces it): its
        requests still in it become ABORTED, so another run may take them."""
        for r in self.requests:
            if r.status in ACTIVE and r.owner is self._ref:
                r.status = Status.ABORTED

    # ---- the run --------------------------------------------------------------------------------
    def start(self, requests: Sequence[Request], on_invalid: Literal["raise", "reject"] = "raise") -> None:
        """Check `requests` (sorted by arrival) and set up a run; then `step()` until `done`."""
        reqs, rejected = self._intake(requests, on_invalid)
        self._begin(reqs, rejected)

    def _begin(self, reqs: list[Request], rejected: list[Rejected]) -> None:
        """Everything a run (offline or live) starts from: the run it replaces ended, its requests
        reset and numbered, the executor's and the memory's state reset."""
        self.executor.reset()                   # (first: if it fails, no request has changed)
        if not self.done:
            self._end_run()
        for i, r in enumerate(reqs):
            r.reset()
            r.run_index, r.owner = i, self._ref
        for r, _ in rejected:
            r.reset()
            r.status = Status.REJECTED
        try:
            self.scheduler.start(reqs)          # (a new policy's start is checked: it may refuse)
        except BaseException:
            for r in reqs:                      # (refused before it began: the requests are free)
                r.status = Status.ABORTED
            self.done = self.aborted = True     # (the run it replaced is over too: no step goes on with it)
            raise
        self.requests, self.rejected = reqs, rejected
        self.clock_origin_s = reqs[0].arrival_s if reqs else 0.0     # the run's clock counts from here
        self._arrivals = [r.arrival_s - self.clock_origin_s for r in reqs]
        self._next = 0
        self.t = 0.0
        self.log = StepLog()
        self.trace_steps: list | None = [] if self.trace else None
        self._pipeline = Pipeline(self) if self.config.n_workers > 1 or self.executor.is_async else None
        self._live_ids, self.n_aborted, self.n_forgotten, self.n_steps_forgotten = None, 0, 0, 0
        self.failed_rows = {}
        self.started, self.aborted = True, False
        self.done = not reqs                    # (every request rejected, or a live run's start)

    def step(self) -> Batch | None:
        """Run the next iteration and return its batch (None once every request is done).

        With `n_workers = 1`: schedule (waiting while nothing can run), execute, record, complete —
        when it returns, every request's counters include this batch. Pipelined: one batch enters
        the pipeline (its requests are IN_FLIGHT) or the oldest leaves it (`pipeline.py`).
        """
        self._check_run()
        try:
            if self._pipeline is not None:
                return self._pipeline.step()
            return self._step()
        except BaseException:
            self._abort()
            raise

    def _step(self) -> Batch | None:
        """One iteration with `n_workers = 1`: schedule, execute, record, complete (the one method of
        the loop `FastEngine` overrides: it takes runs of decode steps in bulk)."""
        batch = self.next_batch()
        if batch is None:
            return None
        res = self.execute_and_record(batch)
        if self.failed_rows:
            self.complete(*self._drop_failed(batch, res))
        else:
            self.complete(batch, res.tokens, res.logprobs)
        return batch

    def execute_and_record(self, batch: Batch) -> StepResult:
        """The executor runs `batch` from now: the clock moves on by its checked duration and the
        step's row is recorded. Returns the executor's answer, whose tokens `complete` takes. In a
        live run, a step some of whose rows failed (`RowsFailed`, with the others' result) goes on
        for the others: `failed_rows` names the failed requests, with why (else it is empty)."""
        start = self.t
        self.failed_rows = {}
        try:
            res = self.executor.execute(batch)
        except RowsFailed as e:
            if self._live_ids is None or e.result is None:
                raise
            res, self.failed_rows = e.result, e.rows
            ids = {w.req.req_id for w in batch.works}
            strangers = [rid for rid in self.failed_rows if rid not in ids]
            if strangers:
                raise RuntimeError(f"{type(self.executor).__name__} failed rows of batch {batch.index} naming "
                                   f"{brief_items(strangers)}, not a request of the batch: "
                                   "RowsFailed.rows names requests of the step that failed") from e
        self.t = start + self.checked_duration(res, batch)
        self.record(batch, start, self.t, self.memory.slots_reserved, self.memory.slots_used)
        return res

    def next_batch(self) -> Batch | None:
        """The scheduler's next batch, the clock moved on to arrivals while nothing can run (None:
        the run is over)."""
        while not self.done:
            self.admit_arrivals()
            batch = self.scheduler.schedule()
            if batch is None:
                if self.next_arrival is None:
                    raise RuntimeError(self.stall_report())
                self.t = self.next_arrival
                continue
            if batch.preempted:
                self.release_preempted(batch)
            if batch.totals.n_seqs:
                return batch
            # everyone it chose was preempted: they wait for memory
        return None

    def run(self, requests: Sequence[Request], on_invalid: Literal["raise", "reject"] = "raise",
            progress: Callable[[int, int], None] | None = None) -> RunResult:
        """Serve `requests` (sorted by arrival) to completion. `progress(finished, total)`, if given,
        is called once the run passes each 1024th step (`FastEngine` takes many in one `step()` call)
        and at the end, unless the last call said every request finished (a long run's progress
        bar); if it raises (Ctrl-C during a bar's update), the run stops as on any other error."""
        check_callable("progress", progress, "(finished, total)", allow_none=True)
        self.start(requests, on_invalid)
        try:
            total, report_at, reported = len(self.requests), 1024, -1
            while self.step() is not None:
                if progress is not None and self.scheduler.n_batches >= report_at:
                    report_at = (self.scheduler.n_batches // 1024 + 1) * 1024
                    reported = self.scheduler.n_done
                    progress(reported, total)
            if progress is not None and reported != total:
                progress(self.scheduler.n_done, total)
        except BaseException:
            if not self.aborted:                # (`step` has already aborted on its own errors)
                self._abort()
            raise
        return self.result()

    # ---- a live run: requests join and leave while it runs (`orca_torch/serve/live.py`) ---------
    def start_live(self) -> None:
        """Start a run with no requests: `add` each as it arrives, `abort` one whose client left,
        and `step()` while not `done` (a server's loop; `forget_done` drops the past's records).
        `n_workers = 1`, a synchronous executor and iteration-level batching (not `static`) only; a
        request held in host memory (swap) cannot be aborted, so a swapping memory manager is refused."""
        if self.config.n_workers != 1 or self.config.static or self.executor.is_async:
            raise ValueError("a live run needs n_workers=1, a synchronous executor and iteration-level batching "
                             "(static=False)")
        if self.memory.swaps:
            raise ValueError("a live run cannot use a swapping memory manager (an aborted request's K/V "
                             "could sit in host memory); use preemption='recompute'")
        self._begin([], [])
        self._live_ids = set()

    def add(self, req: Request) -> None:
        """`req` arrives at `req.arrival_s` on the run's clock (no earlier than the previous arrival)
        and joins at the next iteration: the clock moves up to its arrival if behind (the real time
        between steps counts). Checked like `start`'s requests; ValueError leaves the run unchanged."""
        self._check_live("add")
        if not isinstance(req, Request):
            raise ValueError(f"expected a Request, got {type(req).__name__}")
        self.check(req)
        self._check_free(req, replacing=False)
        if self._in_run(req):                   # (done with: its tokens and times are that entry's)
            raise ValueError(f"request {brief(req.req_id)} was added to this live run already and is "
                             f"{req.status.value}: add a copy under a new req_id ({COPY}) to serve it again")
        _check_follows(req, self._live_ids, self._arrivals[-1] if self._arrivals else -math.inf)
        req.reset()
        req.run_index, req.owner = len(self.requests), self._ref
        self.requests.append(req)
        self._arrivals.append(req.arrival_s)
        self._live_ids.add(req.req_id)
        self.scheduler.extend_run(req)          # its columns; it reaches the queue in `admit_arrivals`
        self.t = max(self.t, req.arrival_s)
        self.done = False

    def abort(self, req: Request) -> None:
        """`req` (a request of this live run, not finished) leaves now: out of the queue or the
        running pool, its memory manager's reservation and the executor's K/V freed at once. Should
        the executor fail to free it, the run stops on that error, as on a step's."""
        self._check_run()
        if not isinstance(req, Request):
            raise ValueError(f"abort takes the Request given to add, got {brief(req)} ({type(req).__name__})")
        if self._live_ids is None or not self._in_run(req):
            raise ValueError(f"request {brief(req.req_id)} is not a request of this live run")
        if req.owner is not self._ref:          # (done here, then added to another engine's run)
            raise ValueError(f"request {brief(req.req_id)} has left this live run for another engine's run "
                             f"(where it is {req.status.value}): this engine cannot abort it")
        if req.status not in (Status.WAITING, Status.RUNNING):
            raise ValueError(f"request {brief(req.req_id)} is {req.status.value}: only a waiting or running request "
                             "can be aborted")
        try:
            self.admit_arrivals()               # (one added since the last step is not in the queue yet)
            self._leave(req)
        except BaseException:                   # (the executor failed: the run stops, as on a step's error)
            self._abort()
            raise
        if self.scheduler.n_done == len(self.requests):
            self.done = True

    @property
    def n_waiting(self) -> int:
        """The run's requests in the scheduler's queue: arrived, waiting for a seat (or preempted back
        to it); one added since the last step joins the queue as the next step starts."""
        return len(self.scheduler.waiting)

    @property
    def n_running(self) -> int:
        """The run's requests in the scheduler's running pool: seated, making tokens (lecture §4.3)."""
        return len(self.scheduler.running)

    @property
    def n_done(self) -> int:
        """The run's requests that have left it (finished or aborted) and are still on record: those
        `forget_done` would drop (a server calls it when they are half the run's records)."""
        return self.scheduler.n_done

    def prompts_completed(self, batch: Batch) -> list[Request]:
        """The requests of `batch`, the live run's step just taken (`step` returned it, before
        `forget_done`), whose prompt it fed to its end, making their first token: a whole prompt, or
        a chunked prompt's last chunk however few its tokens; never a decode, nor a recompute after a
        preemption (lecture §4.3). The token column says which step made each first token: a
        chunk's tokens alone cannot (a one-token last chunk looks like a decode)."""
        self._check_live("prompts_completed")
        return [r for r in self._made(batch) if r.n_generated == 1]

    def tokens_made(self, batch: Batch) -> list[Request]:
        """The requests of `batch`, the live run's step just taken (`step` returned it, before
        `forget_done`), that it made a token for: their work caught up with their prompt and output
        (a decode, a whole prompt or recompute, or the last chunk of one), not a chunk short of it.
        The token column says which step made each token: after the step, a request fed its newest
        token and one fed a chunk of a recompute that stops one short look alike."""
        self._check_live("tokens_made")
        return self._made(batch)

    def _made(self, batch: Batch) -> list[Request]:
        """`tokens_made`, unchecked: whose latest token's step (the token column's) is `batch`'s."""
        col = self.scheduler.tokens
        return [w.req for w in batch.works
                if w.req.n_generated and col.view[col.first[w.req.run_index] + w.req.n_generated - 1] == batch.index]

    def forget_done(self) -> int:
        """A live run drops its records of the requests that have left it (finished or aborted) and
        of its steps so far, and returns how many requests it dropped (none: it changes nothing). A
        server that is never idle runs one live run for ever: without this it keeps every request
        and step it ever served (`serve/live.py` calls it, lecture §4.1). The requests still in the
        run keep their state (counters, memory, K/V, place in the queue) and go on exactly as they
        would have; the run has no `RunResult` after, and a dropped request's req_id may be added
        again. Step indices (`Batch.index`, the token column's) then count from the first step that
        made a kept token (the steps before it, `n_steps_forgotten` in all, are no record's any
        more), so a run that never ends stays within `token_steps.MAX_STEPS` steps unless a request
        stays in it that long; `batch.index + n_steps_forgotten` numbers a step over the whole run.
        An offline run keeps every record: they are its result."""
        self._check_live("forget_done")
        keep = [r for r in self.requests if r.status in ACTIVE]
        n = len(self.requests) - len(keep)
        if not n:
            return 0
        assert all(r.status in ACTIVE for r in self.requests[self._next:]), "a request left before its arrival"
        self._next = sum(r.status in ACTIVE for r in self.requests[:self._next])
        self._arrivals = [self._arrivals[r.run_index] for r in keep]
        self.n_steps_forgotten += self.scheduler.forget(keep)
        self.requests, self._live_ids = keep, {r.req_id for r in keep}
        self.log = StepLog()
        self.trace_steps = [] if self.trace else None
        self.n_forgotten += n
        return n

    def _check_run(self) -> None:
        """Refuse a call that needs a run: one started, and not stopped by an error."""
        if self.aborted:
            raise RuntimeError("the run stopped on an error and has no result; start a new run")
        if not self.started:
            raise RuntimeError("no run started: call start(requests), run(requests) or start_live() first")

    def _check_live(self, call: str) -> None:
        """Refuse `call` (a method of the live run) unless a live run is going."""
        self._check_run()
        if self._live_ids is None:
            raise RuntimeError(f"{call}() needs a live run: call start_live() first")

    # ---- pieces the step (and `pipeline.py`) use -----------------------------------------------
    @property
    def next_arrival(self) -> float | None:
        """When the next request not yet in the queue arrives (None: none is left to arrive)."""
        return self._arrivals[self._next] if self._next < len(self._arrivals) else None

    def admit_arrivals(self) -> None:
        """Every request that has arrived by now joins the waiting queue: the one place arrivals
        enter the scheduler."""
        arr, i, t = self._arrivals, self._next, self.t
        while i < len(arr) and arr[i] <= t:
            self.scheduler.add(self.requests[i])
            i += 1
        self._next = i

    def release_preempted(self, batch: Batch) -> None:
        """The executor drops the K/V of the batch's victims that will recompute (a swapped-out one's
        K/V moves with the batch's `swapped_out`)."""
        swapped = {id(r) for r, _ in batch.swapped_out}
        for r in batch.preempted:
            if id(r) not in swapped:
                self.executor.release(r)        # recompute: its K/V is gone

    def checked_duration(self, res: StepResult, batch: Batch) -> float:
        """The step's duration, after checking the executor's answer."""
        if not isinstance(res, StepResult):
            raise RuntimeError(f"{type(self.executor).__name__} answered batch {batch.index} with {brief(res)} "
                               f"({type(res).__name__}): an executor answers a step with a StepResult(duration_s, "
                               "tokens=None)")
        d = res.duration_s
        if type(d) is not float or not 0.0 <= d < math.inf:
            check_duration(d)
            d = float(d)
        end = self.t + d
        if not end < math.inf or end == self.t:
            check_clock(end, d, self.t)
        if res.tokens is not None and len(res.tokens) != len(batch.works):
            raise RuntimeError(f"the executor returned {len(res.tokens)} tokens for batch {batch.index}, which "
                               f"has {len(batch.works)} works: it must return one token per work, in order")
        if res.logprobs is not None and len(res.logprobs) != len(batch.works):
            raise RuntimeError(f"the executor returned {len(res.logprobs)} logprobs entries for batch {batch.index}, "
                               f"which has {len(batch.works)} works: it must return one per work (None for a work "
                               "without), in order")
        return d

    def record(self, batch: Batch, start: float, end: float, reserved: int, used: int) -> None:
        """The step's row of the run's columns (`StepLog`), and with `trace=True` its works."""
        n_slots = self.memory.n_slots
        assert used <= reserved and (n_slots is None or reserved <= n_slots), (
            f"{type(self.memory).__name__} holds {used} tokens' K/V (slots_used) in {reserved} slots occupied "
            f"(slots_reserved) of n_slots={n_slots} after batch {batch.index}: a manager occupies at least what it "
            "holds and at most n_slots (a grow past a request's reservation adds to slots_reserved, as TokenMemory's "
            "does, and answers False where that would pass n_slots)")
        self.log.add(start, end, batch.totals.n_seqs, batch.totals.n_tokens, reserved, used)
        if self.trace_steps is not None:
            self.trace_steps.append(TraceStep(batch.index, start, end, [(w.req.req_id, w.n_new, w.n_past)
                                                                        for w in batch.works]))

    def complete(self, batch: Batch, tokens: list[int] | None, logprobs: list | None = None) -> None:
        """The scheduler brings the requests up to date; the executor drops the finished ones' state.
        `logprobs` (`StepResult.logprobs`): each token's log probabilities, kept beside its id in
        `Request.output_logprobs`, for the requests that asked for them."""
        for w, lp in zip(batch.works, logprobs or ()):
            if lp is not None:
                if w.req.output_logprobs is None:
                    w.req.output_logprobs = []
                w.req.output_logprobs.append(lp)
        for r in self.scheduler.complete(batch, tokens):
            self.executor.release(r)
        if self.scheduler.n_done == len(self.requests):
            self.done = True

    def _leave(self, req: Request) -> None:
        """`req` leaves the live run now (`abort`, `_drop_failed`): out of the scheduler, its memory
        and the executor's K/V freed."""
        self.scheduler.abort(req)
        self.executor.release(req)
        self.n_aborted += 1

    def _drop_failed(self, batch: Batch, res: StepResult) -> tuple[Batch, list | None, list | None]:
        """The live run's requests of `failed_rows` leave it (`_leave`), their tokens those before
        the step; returns the rest of `batch`, with its tokens and log probabilities, for `complete`.
        The step stored the failed requests' new tokens' K/V, and their memory counted it when the
        step was scheduled (`num_computed_tokens`, which `MemoryManager.free` gives back, says so),
        so it goes with them."""
        kept = []
        for i, w in enumerate(batch.works):
            if w.req.req_id in self.failed_rows:
                w.req.num_computed_tokens = w.n_past + w.n_new
                self._leave(w.req)
            else:
                kept.append(i)
        rest = replace(batch, works=[batch.works[i] for i in kept])
        return rest, res.tokens and [res.tokens[i] for i in kept], res.logprobs and [res.logprobs[i] for i in kept]

    def stall_report(self) -> str:
        """What to say if nothing can run and nothing will arrive. The project's policies never get
        there (every request was checked at submission); a new policy (`scheduler=`) may."""
        sched, cls = self.scheduler, type(self.scheduler)
        n, waiting, running = len(self.requests) - sched.n_done, len(sched.waiting), len(sched.running)
        own = list(dict.fromkeys(name for c in cls.__mro__ if from_outside(c)
                                 for name, v in vars(c).items() if callable(v) and not name.startswith("__")))
        if running:
            cause, suspects = "no running request was given work", ("select", "decode")
        else:
            cause, suspects = "no waiting request was admitted", ("select", "admit")
        unfinished = "1 request is" if n == 1 else f"{n} requests are"
        stalled = (f"{cls.__name__} stalled: it schedules nothing, nothing more will arrive, and {unfinished} "
                   f"unfinished ({waiting} waiting, {running} running) at t={self.t}: {cause}")
        mem, name = self.memory, type(self.memory).__name__
        if waiting and not running:             # (an empty pool refuses the head: the manager's door let it in)
            head = sched.waiting[0][1]
            reserves = mem.n_slots is not None and type(mem).reservation is not MemoryManager.reservation
            need = mem.reservation(head) if reserves else None      # (a paged pool has blocks instead)
            past = need is not None and need > mem.n_slots
            if past or (not own and from_outside(type(mem))):
                why = (f"needs {brief(need)} K/V slots ({name}.reservation) and n_slots is {mem.n_slots}, so "
                       if past else "")
                return (f"{stalled}: the queue's head, request {brief(head.req_id)}, {why}{name}.try_admit refuses it "
                        f"with nothing running; {name}.check(req) must refuse at submission a request it could never "
                        "admit, at any point of its run (MemoryManager.check compares the reservation with n_slots)")
        mine = [f"{cls.__name__}.{m}" for m in suspects if m in own] or [f"{cls.__name__}.{m}" for m in own]
        where = (f"look first at its own {' and '.join(mine)}" if mine else
                 "one of the project's policies never gets here (every request is checked at submission)")
        return (f"{stalled}; {where}. A policy's select fills the Batch it is given: decode(batch, ready) runs the "
                "ready requests, admit(batch, seats, budget) the queue's (it returns nothing)")

    def _abort(self) -> None:
        """A failed run leaves nothing behind: the executor's and the memory's state are dropped, and
        its requests not finished are ABORTED (free for another run)."""
        self._end_run()
        self.done = self.aborted = True
        try:
            self.executor.reset()
        finally:
            self.scheduler.start()

    def result(self) -> RunResult:
        """The finished run's `RunResult`."""
        self._check_run()
        if not self.done:
            raise RuntimeError("the run is not finished: call step() until it returns None")
        if self.n_forgotten:
            raise RuntimeError(f"this live run dropped its records of {self.n_forgotten} request(s) and of its "
                               "steps before (forget_done), so it has no RunResult")
        if self.n_aborted:
            raise RuntimeError(f"{self.n_aborted} request(s) of this live run were aborted, so it has no "
                               "RunResult; read engine.log (every step) instead")
        mem, sched, reqs = self.memory, self.scheduler, self.requests
        assert not (mem.slots_reserved or mem.slots_used), f"memory not freed at the end: {mem!r}"
        start, end, n_seqs, n_tokens, reserved, used = self.log.columns()
        assert not reqs or min(sched.release_step) >= 0, "some requests never gave their memory back"
        token_step = sched.tokens.made(len(end))        # (every request finished: each token's slot written)
        offsets = np.array(sched.tokens.first + [sched.tokens.n_tokens], dtype=np.int64)
        return RunResult(
            requests=list(reqs), rejected=list(self.rejected),     # (a live run's list grows on)
            arrival_s=np.array(self._arrivals, dtype=float),
            prompt_len=np.array([r.prompt_len for r in reqs], dtype=np.int64),
            output_len=np.array([r.output_len for r in reqs], dtype=np.int64),
            token_offsets=offsets, token_step=token_step,
            release_s=end[np.array(sched.release_step, dtype=np.int64)],
            n_preemptions=np.array([r.n_preemptions for r in reqs], dtype=np.int64),
            step_start=start, step_end=end, step_n_seqs=n_seqs, step_n_tokens=n_tokens,
            step_reserved=reserved, step_used=used,
            n_slots=occupancy_denominator(mem), config=self.config, trace=self.trace_steps,
            clock_origin_s=self.clock_origin_s, stage_start=self._stage_start(),
            output_ids={r.req_id: list(r.output_ids) for r in reqs if r.output_ids is not None},
            output_logprobs={r.req_id: None if r.output_logprobs is None else list(r.output_logprobs)
                             for r in reqs if r.output_ids is not None})

    def _stage_start(self) -> np.ndarray | None:
        pipe = self._pipeline
        if pipe is None or self.executor.is_async:
            return None
        return np.array(pipe.stage_start, dtype=float).reshape(-1, pipe.n_stages)


def _check_follows(r: Request, ids: set, last: float) -> float:
    """Refuse `r` unless its `req_id` is new (and hashable: else `validate` says why) and its arrival is
    finite and no earlier than `last`; return the arrival the next request must not precede (an
    arrival that is not a number is left to `validate`)."""
    try:
        hash(r.req_id)
    except TypeError:
        r.validate()
    a = r.arrival_s
    if type(a) is float and last <= a < math.inf and r.req_id not in ids:     # the common case
        return a
    if r.req_id in ids:
        raise ValueError(f"duplicate req_id {brief(r.req_id)}: each request's req_id must be unique within a run")
    if not is_real(a):
        return last
    if not (is_finite_real(a) and a >= last):
        after = f" {last}" if last > -math.inf else ""
        raise ValueError(f"request {brief(r.req_id)}: arrival_s must be finite and no earlier than the last arrival"
                         f"{after} (requests are sorted by arrival), got {brief(a)}")
    return a
