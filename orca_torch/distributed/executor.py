"""`DistributedExecutor`: the engine's executor interface over a group of worker processes
(Orca §4.4: the engine master and its workers; lecture §4.4, exercise 6).

It is asynchronous: `submit(batch)` sends the batch's control message and returns at once,
`wait()` blocks until the oldest submitted batch leaves the last stage and returns its tokens
(greedy, or drawn here from the last stage's logits rows for a request with `sampling`, on its
own generator seeded as `TorchExecutor` seeds it, from `seed`; a request with a logit bias or
penalties has its row picked here too, greedy or not, its tokens so far read from the request, as
`TorchExecutor` picks it: `sampling.pick`; a row of logits that is not finite
fails the step as there, `sampling.NonFiniteLogits`) and, for a request that asks for them
(`SamplingParams.logprobs`), their log probabilities (`StepResult.logprobs`): the last stage sends
each such row back raw, before the `min_tokens` bans (one row a request, `returned_rows`; the bans
are applied here for a pick), and the log-softmax is `TorchExecutor`'s own
(`torch_executor.step_logprobs`), of the token picked here or, greedy, by the workers.
`now()` is the run's clock. The
engine's pipelining driver keeps up to `n_workers` batches submitted, so with `n_workers = pp`
every stage works on a different batch at the same time — no microbatches: the scheduler
injects the next iteration without waiting for the previous one (Algorithm 1's
`n_scheduled < n_workers`). `execute(batch)` is submit-then-wait, for a synchronous engine.

The engine's process holds no weights and no K/V: it maps request ids to integer handles, tells
the workers which handles to reserve (a request's `prompt_len + output_len - 1`, the first time it is
scheduled) and to free (`release`: finished or preempted), and which tokens each request feeds.
A swapping memory manager's moves (`batch.swapped_out`, `swapped_in`) copy nothing here: a
swapped-out request keeps its K/V reserved on the workers until it is readmitted, so its tokens
are those of a run without the swap, and only the scheduler's accounting says it left the device.
Times are the workers' own `perf_counter` readings (after a CUDA synchronise on GPU), brought to
the engine's clock with the offsets measured at launch; `timeline` keeps every stage's busy
interval of every batch of the current run, `round_trips` each batch's submission and return.

Tokens: the workers compute the single-process model's arithmetic. With pipeline stages alone
(`tp = 1`) it is the same sums in the same order, so the tokens are those of `TorchExecutor`; in
float32 they equal one-by-one generation (`generate_alone`), and a sampled request draws the
same tokens as on a CPU `TorchExecutor` (the engine's process draws on a CPU generator, whose
numbers for a seed are not a CUDA generator's); its log probabilities are exactly those of a
`TorchExecutor` on one torch thread, as each worker runs by default (`threads`; on two a matmul
of one process sums in another order, and `tiny`'s differ by up to 9.5e-7). With `tp > 1` each
layer's all-reduce adds the ranks' partial products in another order than one process does: in
float32 the logits then agree to about 1e-6 (`tiny`: 9.5e-7, its log probabilities as closely)
and a greedy token changes only on a near-exact tie; in bfloat16 (or float16) they move by about
1e-2, enough to flip a close pair, after which that request's tokens go their own way (`tiny` in
bfloat16 on the CPU, 40 requests of 24 prompt and 24 output tokens: 10 differ from one-by-one
generation with tp=2, none with pp=2 or in one process; docs/experiments/06-distributed.md has
the script). The executor warns when asked for that combination.

K/V: every worker holds `n_slots` tokens of K/V for its heads and layers. A request that needs
more (`prompt_len + output_len`) is refused at submission (`check`); a batch whose new requests
would take the workers past `n_slots` (the engine's memory manager admitted more than the workers
hold: give it `ReservationMemory(n_slots, policy="oracle")`, which reserves what the workers do)
is refused before it is sent, and the group stays up.

Ctrl-C: the workers ignore SIGINT (a terminal sends it to the whole process group); the engine's
process gets the `KeyboardInterrupt`, and the run's abort stops the workers at once rather than
finishing what is in flight, so the interrupt reaches the caller with every worker gone; the next
`submit` starts a fresh group.

Workers are started by spawning (forkserver), which imports the main script again in each of them:
a script that builds the executor at its top level needs `if __name__ == "__main__":`, and without
it the launch fails saying so.

Faults: every wait is bounded (`step_timeout_s`), and a worker's error or the end of its local
process (under torchrun, of any rank: rank 0's worker watches the others, `worker.PeerWatch`) wakes
it at once, so a worker that dies, fails or hangs makes `wait` raise `WorkerFailure` within that
bound, saying which worker and why. A control message's send (`submit`, `reset`) never waits on a
worker: the control channel's store, in the engine's process, holds it until the worker takes it,
and a stopped or hung worker is found by the wait for its report. (The workers' own waits give up
after twice the bound and a second, at most a day, a backstop for a lost engine; the engine's
watchdog speaks first and names the silent ones.) All workers are then stopped and the K/V handles
forgotten; the next `submit` starts a fresh group.
"""
from __future__ import annotations

import os
import sys
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable, NoReturn, Sequence

import torch

from orca_torch.checks import brief, check_instance, check_int, check_real, check_seed
from orca_torch.core.batch import Batch, ScheduledSeq
from orca_torch.core.executor import Executor, Returned, StepResult
from orca_torch.core.memory import slots_to_finish
from orca_torch.core.request import ACTIVE, Request
from orca_torch.distributed.control import STOP_MESSAGE, BatchControl, Control, control_mode, reset_message
from orca_torch.distributed.launch import (WorkerFailure, WorkerGroup, check_gpus, launch_local,
                                           leave_if_importing_main)
from orca_torch.distributed.shard import NOT_FINITE, ShardLayout
from orca_torch.distributed.worker import LAUNCH_TIMEOUT_S, STEP_TIMEOUT_S, default_n_slots
from orca_torch.lab.cli_args import TIMEOUT_MAX_S
from orca_torch.model.orca_model import OrcaModel
from orca_torch.model.sampling import RowSampler, not_finite
from orca_torch.model.torch_executor import (ban_stops, check_prompt_ids, check_sampling, draw, logprob_rows,
                                             new_token_ids, picked_rows, step_logprobs, stop_bans)


@dataclass(frozen=True)
class StageRecord:
    """One worker's view of one batch, in seconds on the executor's clock: input in hand and compute
    start (`start_s`), output ready to hand on (`end_s`); `collective_s` is the time spent inside TP
    collectives, `cpu_s` the process's CPU time from start to end (below `busy_s` when the core was
    shared)."""

    index: int
    rank: int
    stage: int
    tp_rank: int
    start_s: float
    end_s: float
    collective_s: float
    cpu_s: float

    @property
    def busy_s(self) -> float:
        return self.end_s - self.start_s


def no_report(layout: ShardLayout, late: list[int], describe: Callable[[int], str],
              entered: list[int] | None = None) -> str:
    """The `late` ranks (no report of the batch), those that likely hung first: the lowest stage among
    them. A stage waits for the previous one's activations (and, with `Control.DATA`, its control
    message), so every later stage falls silent behind a stage that stopped; a stage itself reports
    once its sends are queued, waiting on the next stage only for the batch before, which every rank
    reported (`worker.DataPlane.send`). The tp ranks of one stage wait in each other's collectives,
    all silent alike: `entered`, each rank's count of its stage's steps (`worker.DataPlane.entering`;
    a local launch's), tells the ones that stopped short of a step (fewer) from those waiting in it
    for them. Without it (torchrun), or where the counts are equal, they are all named."""
    first = min(layout.stage_of(r) for r in late)
    stage = [r for r in late if layout.stage_of(r) == first]
    most = max(entered[r] for r in stage) if entered is not None else None
    short = [r for r in stage if most is not None and entered[r] < most]
    said = [f"no report from {', '.join(map(describe, short or stage))} (hung?)"]
    if short:
        waiting = [describe(r) for r in stage if r not in short]
        said.append(f"which {', '.join(waiting)} wait{'s' * (len(waiting) == 1)} for in a tensor-parallel "
                    "collective")
    behind = [describe(r) for r in late if layout.stage_of(r) > first]
    if behind:
        said.append(f"the first stage without one; nor from {', '.join(behind)}, likely waiting on stage {first}")
    return ", ".join(said)


@dataclass(frozen=True)
class ReturnedRows:
    """The works whose whole raw logits row the last stage sends back (`control.BatchControl.returned`):
    `picked`, those whose token the engine's process picks (`picked_rows`), and `asked`, those that
    ask for log probabilities (`logprob_rows`); `rows`, all of them, one row each, in batch order."""

    picked: list[int]
    asked: list[int]
    rows: list[int]


def returned_rows(works: Sequence[ScheduledSeq]) -> ReturnedRows:
    """The `ReturnedRows` of a batch's `works`."""
    picked, asked = picked_rows(works), logprob_rows(works)
    return ReturnedRows(picked, asked, sorted(set(picked) | set(asked)))


@dataclass(frozen=True)
class InFlight:
    """A batch submitted and not yet waited for: when it was sent, and the raw logits rows its last
    stage returns (`returned_rows`, worked out once, as the control message names them)."""

    batch: Batch
    submitted: float
    returned: ReturnedRows


class DistributedExecutor(Executor):
    """`model` split over `tp x pp` worker processes (see the module docstring).

    `control="apart"` sends each batch's control message to every worker over its own channel
    (Orca); `"data"` sends it to rank 0 only, and it travels with the activations through the data
    plane (FasterTransformer). Change `control` between runs; it takes effect at `reset()`.
    A bad `tp`/`pp` is refused before any process starts. In float32 the tokens equal one-by-one
    generation (exactly for `tp = 1`, to rounding for `tp > 1`); in bfloat16 `tp > 1` changes far
    more of them than one process does (see the module docstring; a warning says so). `seed`
    seeds the draws of a sampled request without a seed of its own, as `TorchExecutor`'s does.
    """

    is_async = True

    def __init__(self, model, tp: int = 1, pp: int = 1, *, control: str | Control = "apart",
                 n_slots: int | None = None, step_timeout_s: float = STEP_TIMEOUT_S,
                 launch_timeout_s: float = LAUNCH_TIMEOUT_S, threads: int = 1, seed: int = 0,
                 group: WorkerGroup | None = None) -> None:
        leave_if_importing_main()
        check_instance("model", model, OrcaModel)
        self.layout = ShardLayout(model.spec, tp, pp)
        step_timeout_s, launch_timeout_s = (check_real(name, v, 0.0, TIMEOUT_MAX_S, lo_open=True, unit="seconds")
                                            for name, v in (("step_timeout_s", step_timeout_s),
                                                            ("launch_timeout_s", launch_timeout_s)))
        if model.device.type == "cuda" and group is None:
            check_gpus(self.layout.world_size)
        self.spec = model.spec
        self.max_context = model.spec.max_context
        self.n_stages = self.layout.pp      # (the engine's in-flight bound is n_workers, not this)
        n_slots = default_n_slots(model.spec) if n_slots is None else n_slots
        self.n_slots = check_int("n_slots (K/V slots per worker)", n_slots, 1)
        # Each worker's torch threads, at most this machine's cores (as everywhere a thread count is
        # taken): a count far past them aborted every worker inside torch.set_num_threads.
        threads = check_int("threads", threads, 1, os.cpu_count() or 1)
        self.step_timeout_s, self.launch_timeout_s, self.threads = step_timeout_s, launch_timeout_s, threads
        self.seed = check_seed(seed)
        self._samplers: dict[Hashable, RowSampler] = {}
        self._control = control_mode(control)
        self._device = model.device.type
        self._dtype = model.dtype
        self._attention = model.attention
        if self.layout.tp > 1 and model.dtype in (torch.bfloat16, torch.float16):
            warnings.warn(f"tp={self.layout.tp} in {model.dtype}: the tensor-parallel all-reduces sum each "
                          "layer's partial products in another order than one process does, and at this "
                          "precision the rounding can flip a near-tie between two logits, so a request's "
                          "greedy tokens may differ from one-by-one generation; use float32 where the tokens "
                          "must match", UserWarning, stacklevel=2)
        self._group: WorkerGroup | None = None
        self._finalizer = None
        self._workers_mode = self._control
        self._clear()
        if group is not None:                      # started elsewhere (torchrun): not ours to relaunch
            check_instance("group", group, WorkerGroup)
            if group.layout != self.layout:
                said = [f"{g.spec.name} ({g.spec.dtype_bytes}-byte weights) as tp={g.tp} x pp={g.pp}"
                        for g in (group.layout, self.layout)]
                raise ValueError(f"the worker group holds {said[0]}, but this executor was asked for {said[1]}")
            self._state = None
            self._group = group
            self._finalizer = weakref.finalize(self, WorkerGroup.shutdown, group, 0.0)
            return
        self._state = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in model.state_dict().items()}
        self._launch()

    # ---- the group ------------------------------------------------------------------------------
    def _launch(self) -> None:
        if self._state is None:
            raise WorkerFailure("the worker group this executor was given has failed and cannot be restarted "
                                "from here: start torchrun again")
        self._group = launch_local(self._state, self.layout, n_slots=self.n_slots, control=self._control,
                                   step_timeout_s=min(2 * self.step_timeout_s + 1.0, TIMEOUT_MAX_S),  # (a backstop)
                                   launch_timeout_s=self.launch_timeout_s,
                                   device=self._device, dtype=self._dtype, threads=self.threads,
                                   attention=self._attention)
        self._workers_mode = self._control
        self._finalizer = weakref.finalize(self, WorkerGroup.shutdown, self._group, 0.0)

    @property
    def running(self) -> bool:
        """Whether a worker group is up (False after a fault or `close()`, until the next `submit` starts one)."""
        return self._group is not None

    @property
    def control(self) -> str:
        return "apart" if self._control is Control.APART else "data"

    @control.setter
    def control(self, value: str | Control) -> None:
        self._control = control_mode(value)

    def _clear(self) -> None:
        self._handles: dict = {}
        self._next_handle = 0
        self._frees: list[int] = []
        self._held: dict[int, int] = {}      # handle -> K/V slots reserved on every worker
        self._slots_reserved = 0
        self._inflight: deque[InFlight] = deque()
        self._samplers.clear()
        self._reports: dict[int, dict[int, tuple]] = {}
        self.timeline: list[StageRecord] = []
        self.round_trips: list[tuple[int, float, float]] = []   # (batch index, submitted, tokens back)
        self._t0 = time.perf_counter()

    def _send(self, msg: list[int], mode: Control) -> None:
        """Send `msg` to the workers `mode` addresses (it never waits on them); the `WorkerFailure` of a
        send that fails names the local workers that are gone, as a wait's does."""
        self._group.send(range(self.layout.world_size) if mode is Control.APART else [0], msg)

    def _fail(self, why: str) -> NoReturn:
        """Stop every worker, forget all K/V handles, raise `WorkerFailure` saying `why`."""
        self._stop(in_order=False)
        then = ("the next batch starts a fresh group" if self._state is not None else "a group started by "
                "torchrun cannot be restarted from here: start torchrun again")
        raise WorkerFailure(f"{why}\nEvery worker process was stopped and the K/V state reset; {then}.") from None

    def close(self) -> None:
        """Stop the workers (in order where they answer, by force where they do not)."""
        self._stop(in_order=True)

    def _stop(self, in_order: bool) -> None:
        """Stop the workers and forget all K/V handles: `in_order`, each leaves after the batches already
        sent to it and a STOP, within a grace; else at once, by signal (a fault, a Ctrl-C)."""
        if self._group is None:
            return
        if in_order:
            try:
                self._send(list(STOP_MESSAGE), self._workers_mode)
            except WorkerFailure:
                pass
        group, self._group = self._group, None
        group.shutdown(grace_s=5.0 if in_order else 0.0)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._clear()

    def __enter__(self) -> "DistributedExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the executor interface -----------------------------------------------------------------
    def check(self, req: Request) -> None:
        check_prompt_ids(req, self.spec.vocab, "the distributed executor")
        check_sampling(req, self.spec.vocab)
        if slots_to_finish(req) > self.n_slots:
            raise ValueError(f"request {brief(req.req_id)} stores up to {slots_to_finish(req)} tokens' K/V (prompt "
                             f"{req.prompt_len} + output {req.output_len} - 1) on every worker, but each holds "
                             f"n_slots={self.n_slots}: "
                             "it could never run; give the DistributedExecutor a larger n_slots")

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def submit(self, batch) -> None:
        if self._group is None:
            self._launch()
        handles, works, ids, reserves, fresh = [], [], [], [], []
        for w in batch.works:
            r = w.req
            h = self._handles.get(r.req_id)
            if h is None:
                assert not w.n_past, (f"request {brief(r.req_id)} resumes at n_past={w.n_past} with no K/V on the "
                                      "workers")
                h = self._handles[r.req_id] = self._next_handle
                self._next_handle += 1
                reserves.append((h, slots_to_finish(r)))
                fresh.append(r.req_id)
            handles.append(h)
            works.append(w.work)
            ids += new_token_ids(r, w.n_new, w.n_past)
        need = sum(n for _, n in reserves)
        if need > self.n_slots - self._slots_reserved:
            for rid in fresh:                       # nothing was sent: forget the new handles again
                del self._handles[rid]
            self._next_handle -= len(fresh)
            raise RuntimeError(f"batch {batch.index} reserves {need} K/V slots on every worker, but only "
                               f"{self.n_slots - self._slots_reserved} of n_slots={self.n_slots} are free: the "
                               "engine's memory manager admits more than the workers hold; give it the workers' "
                               f"reservation and size (ReservationMemory({self.n_slots}, policy='oracle') reserves "
                               "prompt + output, a slot more than they do) or give the executor a larger n_slots")
        self._held.update(reserves)
        self._slots_reserved += need
        returned = returned_rows(batch.works)
        msg = BatchControl(batch.index, tuple(self._frees), tuple(reserves), tuple(handles), tuple(works),
                           tuple(ids), tuple(stop_bans([w.req for w in batch.works])), tuple(returned.rows)).encode()
        self._frees = []
        submitted = self.now()          # before the send: a worker may start the batch before the send returns
        try:
            self._send(msg, self._workers_mode)
        except WorkerFailure as e:
            self._fail(f"could not send batch {batch.index} to the workers: {e}")
        self._inflight.append(InFlight(batch, submitted, returned))

    def wait(self) -> Returned:
        assert self._inflight, "wait() with no batch submitted"
        pending = self._inflight[0]
        batch, returned = pending.batch, pending.returned
        idx, world = batch.index, self.layout.world_size
        deadline = time.perf_counter() + self.step_timeout_s
        while len(self._reports.get(idx, ())) < world:
            left = deadline - time.perf_counter()
            if left <= 0:
                done = self._reports.get(idx, {})
                late = [r for r in range(world) if r not in done]
                self._fail(f"batch {idx} did not leave the pipeline within step_timeout_s={self.step_timeout_s:g} "
                           f"s; {no_report(self.layout, late, self._group.describe, self._group.entered())}")
            try:
                m = self._group.receive(left)
            except WorkerFailure as e:
                self._fail(f"while batch {idx} was in flight: {e}")
            if m is not None and m[0] == "done":
                self._reports.setdefault(m[2], {})[m[1]] = m
        self._inflight.popleft()
        reports = self._reports.pop(idx)
        sent = reports[self.layout.stage_ranks(self.layout.pp - 1)[0]][-1]    # (the last stage's tp rank 0)
        result = self._result(idx, pending.submitted, reports)
        bad = next((i for i, t in enumerate(result.tokens) if t == NOT_FINITE), None)
        if bad is not None:             # (greedy or drawn: the last stage marks a row that is not finite)
            raise not_finite(batch.works[bad].req.req_id, "NaN, +inf or only -inf")
        rows = returned.rows
        if rows:                        # raw logits rows, one per work that picks here or asks for logprobs
            raw = torch.frombuffer(bytearray(sent), dtype=torch.float32).view(len(rows), -1)
            row_of = {i: j for j, i in enumerate(rows)}
            works = batch.works
            banned = ban_stops(raw, [works[i].req for i in rows])
            for i in returned.picked:
                result.tokens[i] = draw(self._samplers, self.seed, works[i].req, banned[row_of[i]])
            asked = returned.asked
            if asked:
                result.logprobs = step_logprobs(works, asked, raw[[row_of[i] for i in asked]],
                                                torch.tensor([result.tokens[i] for i in asked]))
        return Returned(batch, result)

    def _result(self, idx: int, submitted: float, reports: dict[int, tuple]) -> StepResult:
        lay, off = self.layout, self._group.clock_offsets
        recs = []                       # each report: ("done", rank, index, ..., tokens), as control.py lists
        for rank, (_, _, _, t_start, t_end, coll, cpu, _, _) in sorted(reports.items()):
            c = off[rank] + self._t0
            recs.append(StageRecord(idx, rank, lay.stage_of(rank), lay.tp_rank_of(rank), t_start - c, t_end - c,
                                    coll, cpu))
        self.timeline += recs
        self.round_trips.append((idx, submitted, self.now()))
        tokens = reports[lay.stage_ranks(lay.pp - 1)[0]][-2]       # the last stage's tp rank 0 sends them
        start = max(submitted, min(r.start_s for r in recs if r.stage == 0))
        end = min(max(max(r.end_s for r in recs), start), self.now())
        stage_s = max(r.busy_s for r in recs)
        return StepResult(end - start, tokens, stage_s, start_s=start, end_s=end)

    def execute(self, batch) -> StepResult:
        assert not self._inflight, "execute() while batches are in flight: use submit()/wait()"
        self.submit(batch)
        return self.wait()[1]

    def release(self, req: Request) -> None:
        if req.status not in ACTIVE:            # (a preempted request keeps its generator)
            self._samplers.pop(req.req_id, None)
        h = self._handles.pop(req.req_id, None)
        if h is not None:
            self._frees.append(h)
            self._slots_reserved -= self._held.pop(h)

    def reset(self) -> None:
        """A run starts (or one was abandoned): drain what is in flight, free all K/V on the workers,
        apply a changed `control`, restart the clock. A run abandoned by Ctrl-C (a `KeyboardInterrupt`
        being handled) stops the workers instead, at once: the person wants out, not the batches."""
        if self._group is not None:
            if isinstance(sys.exc_info()[1], KeyboardInterrupt):
                self._stop(in_order=False)      # (which forgets the K/V state too)
                return
            while self._inflight:
                self.wait()
            try:
                self._send(reset_message(self._control), self._workers_mode)
            except WorkerFailure as e:
                self._fail(f"could not reset the workers for the next run: {e}")
            self._workers_mode = self._control
        self._clear()
