"""The core one step at a time: counters that are true after every step, the pipelining driver with an
asynchronous executor, swapping memory managers, and the defects the rewrite must not have."""
from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from orca_torch.lab.api import run as api_run
from orca_torch.core.batch import ScheduledSeq
from orca_torch.core.engine import Engine
from orca_torch.sim.executors import CostModelExecutor, StepTimeExecutor
from orca_torch.core.executor import Executor, StepResult
from orca_torch.core.memory import ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.request import Request, Status
from orca_torch.core.scheduler import Scheduler
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.lab.workload import chat
from orca_torch.sim.fast_engine import FastEngine
from clocks import iteration_clock


def affine(max_context=64):
    return StepTimeExecutor(lambda t: .001 + .001 * t.n_tokens, max_context=max_context)


def snapshot(reqs):
    return {r.req_id: (r.num_computed_tokens, r.n_generated, r.status) for r in reqs}


@pytest.mark.parametrize("config, memory", [
    (SchedulerConfig(max_bs=3), lambda: UnlimitedMemory()),
    (SchedulerConfig(max_bs=4, max_num_batched_tokens=6, chunked_prefill=True), lambda: UnlimitedMemory()),
    (SchedulerConfig(max_bs=4), lambda: TokenMemory(30)),                      # preempts and recomputes
    (SchedulerConfig(max_bs=3, static=True), lambda: ReservationMemory(200, "oracle")),
    (SchedulerConfig(max_bs=3, prefill="prefill_first"), lambda: ReservationMemory(60, "oracle")),
])
@pytest.mark.parametrize("fast", [False, True])
def test_counters_are_true_after_every_step(config, memory, fast):
    """Drive the engine with `step()`: each work's n_past is its request's computed count before the
    step, and after the step every request says exactly what it has computed and generated (one
    that joined inside a run the fast engine took in bulk at step s: its prefill, then a decode a step)."""
    reqs = [Request(i, a, p, o) for i, (a, p, o) in
            enumerate([(0, 5, 4), (0, 9, 3), (1, 3, 7), (2, 12, 2), (2, 4, 5), (4, 7, 1), (6, 2, 6)])]
    eng = (FastEngine if fast else Engine)(iteration_clock(), memory(), config, max_context=64)
    eng.start(reqs)
    before = snapshot(reqs)
    n_steps = 0
    while (batch := eng.step()) is not None:
        n_run, joined = (eng.last_run.n_steps, eng.last_run.joined) if fast else (1, [])
        assert eng.log.n_steps == n_steps + n_run     # Engine: exactly one iteration a call
        assert len(batch.works) <= config.max_bs
        fed = {}
        for r, n, p in batch.works:             # (req, n_new, n_past)
            assert r.req_id not in fed, "a request twice in one batch"
            fed[r.req_id] = (n, p)
            was_computed, was_generated, _ = before[r.req_id]
            if r in batch.preempted:
                continue
            if r.n_preemptions and p == 0 and was_computed:
                was_computed = 0                # preempted in this very schedule (recompute)
            assert p == was_computed, f"step {batch.index}: {r.req_id} fed n_past={p}, had computed {was_computed}"
            assert 1 <= n <= r.prompt_len + was_generated - p
        for r in reqs:
            c0, g0, _ = before[r.req_id]
            if r.req_id in fed:
                n, p = fed[r.req_id]
                caught_up = p + n == r.prompt_len + g0
                m = min(n_run, r.output_len - g0) if caught_up else 1   # a fast run ends at its finish
                assert r.num_computed_tokens == p + n + m - 1
                assert r.n_generated == g0 + (m if caught_up else 0)
            elif r in batch.preempted:
                assert r.num_computed_tokens == 0 and r.status is Status.WAITING and r.n_generated == g0
            elif r in [j for j, _ in joined]:
                s = dict((id(j), s) for j, s in joined)[id(r)]
                assert (c0, g0) == (0, 0) and batch.index < s < batch.index + n_run
                m = min(batch.index + n_run - s, r.output_len)
                assert (r.num_computed_tokens, r.n_generated) == (r.prompt_len + m - 1, m)
            else:
                assert (r.num_computed_tokens, r.n_generated) == (c0, g0)
            assert r.num_computed_tokens <= r.prompt_len + r.n_generated - (1 if r.n_generated else 0)
            assert r.status in (Status.WAITING, Status.RUNNING, Status.FINISHED)
            assert (r.status is Status.FINISHED) == (r.n_generated == r.output_len)
            if r.status is Status.RUNNING:
                assert r in eng.scheduler.running
        assert eng.memory.slots_used == sum(eng.memory.stored(r) for r in reqs)
        before = snapshot(reqs)
        n_steps += n_run
    res = eng.result()
    assert res.n_steps == n_steps
    assert all(r.status is Status.FINISHED and r.n_generated == r.output_len for r in reqs)


def step_one_iteration_at_a_time(eng: Engine, reqs: list[Request]):
    """Step `eng` through `reqs`, checking after every call that exactly one iteration ran (the step
    log grew by one) and that every request's counters are what that step's works say: each work's
    `n_past` was its request's computed count, and it has now computed `n_past + n_new` and, if the
    step caught it up, made one more token; a preempted request holds nothing; the others are as
    they were. Returns the result."""
    eng.start(reqs)
    before = snapshot(reqs)
    n = 0
    while (batch := eng.step()) is not None:
        n += 1
        assert eng.log.n_steps == n and batch.index == n - 1 and eng.scheduler.n_batches == n
        fed = {}
        for w in batch.works:
            r = w.req
            assert r.req_id not in fed, "a request twice in one batch"
            fed[r.req_id] = w
            c0, g0, _ = before[r.req_id]
            if r.n_preemptions and w.n_past == 0 and c0:
                c0 = 0                          # preempted in this very schedule (recompute)
            assert w.n_past == c0, f"step {batch.index}: {r.req_id} fed n_past={w.n_past}, had computed {c0}"
            caught_up = w.n_past + w.n_new == r.prompt_len + g0
            assert (r.num_computed_tokens, r.n_generated) == (w.n_past + w.n_new, g0 + caught_up)
            if r.output_ids is not None:        # (the torch executor's tokens)
                assert len(r.output_ids) == r.n_generated
        for r in reqs:
            c0, g0, _ = before[r.req_id]
            if r in batch.preempted and r.req_id not in fed:
                assert r.n_generated == g0 and r.status is Status.WAITING
                assert r.num_computed_tokens in (0, c0)         # recompute drops it, a swap keeps it
            elif r.req_id not in fed:
                assert (r.num_computed_tokens, r.n_generated) == (c0, g0)
            assert (r.status is Status.FINISHED) == (r.n_generated == r.output_len)
        mem = eng.memory                        # (a swapped-out request's K/V is in host memory)
        assert mem.slots_used == sum(mem.stored(r) for r in reqs if mem.holds(r))
        before = snapshot(reqs)
    res = eng.result()
    assert res.n_steps == n
    return res


@pytest.mark.parametrize("config, memory", [
    (SchedulerConfig(max_bs=3), lambda: UnlimitedMemory()),
    (SchedulerConfig(max_bs=4, max_num_batched_tokens=300, chunked_prefill=True), lambda: UnlimitedMemory()),
    (SchedulerConfig(max_bs=4), lambda: TokenMemory(200)),                     # preempts and recomputes
    (SchedulerConfig(max_bs=4), lambda: PagedMemory(200, preemption="swap")),  # preempts and swaps
    (SchedulerConfig(max_bs=3, static=True), lambda: ReservationMemory(4000, "oracle")),
    (SchedulerConfig(max_bs=3, prefill="prefill_first"), lambda: ReservationMemory(1500, "max")),
])
def test_engine_step_is_one_iteration_on_the_paper_gpu(config, memory):
    reqs = [Request(i, a, p, o, max_tokens=p + o + 40) for i, (a, p, o) in
            enumerate([(0, 50, 40), (0, 90, 30), (.01, 30, 70), (.02, 120, 20), (.02, 40, 50), (.04, 70, 10)])]
    mem = memory()
    res = step_one_iteration_at_a_time(Engine(CostModelExecutor("llama-3-8b", "h100"), mem, config,
                                              max_context=512), reqs)
    assert res.n_steps >= 70
    assert (res.n_preemptions.sum() > 0) == mem.can_run_out


def test_engine_step_is_inspectable_mid_run():
    reqs = [Request(0, 0.0, 4, 3), Request(1, 0.0, 6, 2), Request(2, 5.0, 3, 2)]
    eng = Engine(iteration_clock(), UnlimitedMemory(), SchedulerConfig(max_bs=2), max_context=32)
    eng.start(reqs)
    b0 = eng.step()
    assert [(w.req.req_id, w.n_new, w.n_past) for w in b0.works] == [(0, 4, 0), (1, 6, 0)]
    assert [r.num_computed_tokens for r in reqs[:2]] == [4, 6] and [r.n_generated for r in reqs[:2]] == [1, 1]
    assert eng.scheduler.running == reqs[:2] and reqs[2].status is Status.WAITING
    b1 = eng.step()
    assert [(w.req.req_id, w.n_new, w.n_past) for w in b1.works] == [(0, 1, 4), (1, 1, 6)]
    assert reqs[1].status is Status.FINISHED and eng.scheduler.running == [reqs[0]]


# ---- pipelining: the driver with an asynchronous executor -----------------------------------------
class FakeAsyncExecutor(Executor):
    """P simulated stages on a virtual clock: a batch enters when the first stage is free, holds each
    stage for d / P, and leaves in order. It checks the driver's promises as it goes."""

    is_async = True

    def __init__(self, n_workers: int, reorder: bool = False) -> None:
        self.P, self.reorder = n_workers, reorder
        self.max_context = 256
        self.reset()

    def reset(self) -> None:
        self.clock = self.stage_free = self.last_end = 0.0
        self.queue: deque = deque()
        self.max_in_flight = 0
        self.submitted: list = []

    def now(self) -> float:
        return self.clock

    def submit(self, batch) -> None:
        in_flight = {w.req.req_id for b, *_ in self.queue for w in b.works}
        assert not in_flight & {w.req.req_id for w in batch.works}, "a request in two in-flight batches"
        assert all(w.req.status is Status.IN_FLIGHT for w in batch.works)
        d = .002 + .0005 * batch.totals.n_tokens
        start = max(self.clock, self.stage_free)
        end = max(start + d, self.last_end)
        self.stage_free, self.last_end = start + d / self.P, end
        self.queue.append((batch, start, end, d))
        self.max_in_flight = max(self.max_in_flight, len(self.queue))
        assert len(self.queue) <= self.P
        self.submitted.append(batch.index)

    def wait(self):
        batch, start, end, d = self.queue.pop() if self.reorder and len(self.queue) > 1 else self.queue.popleft()
        self.clock = max(self.clock, end)
        return batch, StepResult(d, None, None, start, end)


@pytest.mark.parametrize("n_workers", [2, 3])
def test_pipeline_drives_an_asynchronous_executor(n_workers):
    reqs = chat(n_requests=40, rate=50.0, seed=1, max_context=256)
    ex = FakeAsyncExecutor(n_workers)
    res = Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=8, n_workers=n_workers), trace=True).run(reqs)
    assert ex.max_in_flight == n_workers                     # it really pipelines, and never more
    assert ex.submitted == list(range(res.n_steps))
    assert np.all(np.diff(res.step_end) >= 0)                 # batches leave in order
    assert (res.step_start[1:] < res.step_end[:-1]).mean() > 0.3     # batches overlap in the pipeline
    for i, r in enumerate(reqs):
        assert len(res.tokens_of(i)) == r.output_len and np.all(np.diff(res.tokens_of(i)) > 0)
        assert res.tokens_of(i)[0] > res.arrival_s[i]
    assert all(r.status is Status.FINISHED for r in reqs)


def test_pipeline_refuses_batches_that_leave_out_of_order():
    reqs = chat(n_requests=10, rate=50.0, seed=1, max_context=256)
    mem = UnlimitedMemory()
    with pytest.raises(RuntimeError, match="order they were submitted"):
        Engine(FakeAsyncExecutor(2, reorder=True), mem, SchedulerConfig(max_bs=4, n_workers=2)).run(reqs)
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)


class OneAtATimeAsync(Executor):
    """Batches run one after another on a virtual clock, 1 s each; `ends` overrides the end it reports
    for a batch index (a worker whose clock is off), and `submitted` keeps every batch's works."""

    is_async = True

    def __init__(self, ends=None) -> None:
        self.max_context, self.ends = 64, ends or {}
        self.reset()

    def reset(self) -> None:
        self.clock, self.queue, self.submitted = 0.0, deque(), []

    def now(self) -> float:
        return self.clock

    def submit(self, batch) -> None:
        self.submitted.append([(w.req.req_id, w.n_new, w.n_past) for w in batch.works])
        start = max(self.clock, self.queue[-1][2] if self.queue else 0.0)
        self.queue.append((batch, start, start + 1.0))

    def wait(self):
        batch, start, end = self.queue.popleft()
        self.clock = max(self.clock, end)
        return batch, StepResult(1.0, None, None, start, self.ends.get(batch.index, end))


def test_a_batch_reported_to_end_before_the_one_ahead_of_it_is_recorded_as_leaving_after_it():
    """Batches leave in order: batch 1 (1 s to 2 s) said to end at 2.0 behind batch 0's 2.5 leaves at 2.5."""
    reqs = [Request(0, 0.0, 4, 1), Request(1, 0.0, 4, 1)]
    ex = OneAtATimeAsync(ends={0: 2.5})
    res = Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=1, n_workers=2)).run(reqs)
    assert ex.submitted == [[(0, 4, 0)], [(1, 4, 0)]]
    assert list(res.step_start) == [0.0, 1.0] and list(res.step_end) == [2.5, 2.5]


def test_an_asynchronous_executor_is_never_handed_a_step_whose_every_decode_was_preempted():
    """`NewestDecodesAlone`'s run in the scheduler's tests, on an asynchronous executor: the step that
    only preempts is not submitted, and the next one is, at once."""
    from test_scheduler import NewestDecodesAlone

    reqs = [Request(0, 0.0, 4, 3), Request(1, 0.0, 4, 3)]
    ex = OneAtATimeAsync()
    res = Engine(ex, TokenMemory(9), SchedulerConfig(max_bs=2), scheduler=NewestDecodesAlone).run(reqs)
    assert ex.submitted == [[(0, 4, 0), (1, 4, 0)], [(1, 1, 4)], [(0, 1, 4)], [(0, 1, 5)], [(1, 6, 0)]]
    assert list(res.step_start) == [0.0, 1.0, 2.0, 3.0, 4.0] and list(res.n_preemptions) == [0, 1]


# ---- pipelining: the simulated stages -----------------------------------------------------------------
class StagedClock(Executor):
    """A step lasts `.01 + .01 * n_tokens` s on `n_stages` stages (None: n_workers) and keeps a stage
    busy for `stage_of(d)` (None: its share of d); what it said of each batch is kept, so a test can
    replay the stages."""

    def __init__(self, stage_of=lambda d: None, n_stages=None) -> None:
        self.max_context, self.stage_of, self.said, self.n_stages = 256, stage_of, {}, n_stages

    def execute(self, batch) -> StepResult:
        d = .01 + .01 * batch.totals.n_tokens
        self.said[batch.index] = (d, self.stage_of(d))
        return StepResult(d, None, self.stage_of(d))


def replay_stages(starts, said, P):
    """An event-by-event replay of P stages in a row, each serving its queue in order: when each
    batch leaves the last one, given when it entered the first and what the executor said of it."""
    queues = [deque() for _ in range(P)]                # (batch, ready at)
    free = [0.0] * P
    for i, t in enumerate(starts):
        queues[0].append((i, t))
    ends = {}
    while any(queues):
        k = min((k for k in range(P) if queues[k]), key=lambda k: max(queues[k][0][1], free[k]))
        i, ready = queues[k].popleft()
        d, stage = said[i]
        begin = max(ready, free[k])
        free[k] = begin + max(d / P, stage or 0.0)
        if k + 1 < P:
            queues[k + 1].append((i, begin + d / P))
        else:
            ends[i] = begin + d / P
    return [ends[i] for i in range(len(starts))]


def test_a_short_batch_behind_a_long_one_waits_for_the_last_stage():
    """Two stages: a 1.01 s prefill, then a 0.03 s decode injected when the first stage is free. The
    decode cannot leave the second stage before the prefill has, and then needs its own half there."""
    reqs = [Request(0, 0.0, 100, 1), Request(1, 0.0, 2, 2)]
    res = Engine(StagedClock(), UnlimitedMemory(), SchedulerConfig(max_bs=1, n_workers=2)).run(reqs)
    assert [round(x, 9) for x in res.step_start[:2]] == [0.0, 0.505]
    assert [round(x, 9) for x in res.step_end[:2]] == [1.01, round(1.01 + .03 / 2, 9)]


@pytest.mark.parametrize("n_workers, n_stages", [(2, None), (3, None), (4, None), (2, 4), (4, 2), (3, 5)])
@pytest.mark.parametrize("stage_of", [lambda d: None, lambda d: 0.6 * d, lambda d: 0.1 * d],
                         ids=["d/S", "slowest stage 0.6d", "stage 0.1d (below d/S)"])
def test_the_simulated_pipeline_is_its_stages_in_a_row(n_workers, n_stages, stage_of):
    """Every batch leaves when an event-by-event replay of the stages says: it waits at each stage
    until the batch before it is done there, so batches leave in order, one stage time apart, and
    at most n_workers are in flight, whether there are fewer stages than that or more."""
    reqs = chat(n_requests=60, rate=40.0, seed=2, max_context=256)
    ex = StagedClock(stage_of, n_stages)
    S = n_stages or n_workers
    res = Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=6, n_workers=n_workers)).run(reqs)
    assert np.allclose(res.step_end, replay_stages(res.step_start, ex.said, S), rtol=0, atol=1e-9)
    assert res.stage_start.shape == (res.n_steps, S) and np.array_equal(res.stage_start[:, 0], res.step_start)
    assert np.all(np.diff(res.stage_start, axis=1) >= 0)
    hops = np.array([ex.said[i][0] for i in range(res.n_steps)]) / S
    assert np.all(np.diff(res.step_end) >= hops[1:] - 1e-12)
    in_flight = [(res.step_end[:i] > res.step_start[i]).sum() + 1 for i in range(res.n_steps)]
    assert max(in_flight) <= n_workers
    assert (res.step_start[1:] < res.step_end[:-1]).mean() > 0.3     # batches overlap in the pipeline


def one_stage_executor(kind):
    if kind == "cost":
        return CostModelExecutor()                                  # pp = 1
    from orca_torch.model.orca_model import OrcaModel
    from orca_torch.model.torch_executor import TorchExecutor

    model = OrcaModel("tiny", seed=0)
    return TorchExecutor(model, model.new_kv(4096), clock="iterations")


@pytest.mark.parametrize("kind", ["cost", "torch"], ids=["paper GPU, pp=1", "torch model in this process"])
def test_batches_in_flight_on_one_stage_run_one_after_another(kind):
    """`n_workers = 2` where there is one stage (the paper GPU without pp, the torch model in this
    process): the next batch enters when the stage is free, that is once the batch before it is
    done, so the run is the one `n_workers = 1` makes (it once ran two batches at once on one GPU)."""
    def go(n_workers):
        reqs = chat(n_requests=30, rate=64.0, seed=0, max_context=256)
        for r in reqs:
            r.prompt_ids = [(7 * r.req_id + j) % 100 for j in range(r.prompt_len)]
        return Engine(one_stage_executor(kind), UnlimitedMemory(), SchedulerConfig(max_bs=8, n_workers=n_workers),
                      max_context=256).run(reqs)

    piped, alone = go(2), go(1)
    assert piped.stage_start.shape == (piped.n_steps, 1)
    assert np.array_equal(piped.step_start, alone.step_start) and np.array_equal(piped.step_end, alone.step_end)
    assert np.array_equal(piped.token_step, alone.token_step)


def test_a_pipelined_run_that_schedules_nothing_says_it_stalled():
    """With batches in flight (`n_workers = 2`), a new policy that never schedules anyone stops the
    run with the same report as an unpipelined one, not a bare error from an empty wait."""
    class NeverAdmits(Scheduler):
        def select(self, batch, ready):
            pass

    mem = ReservationMemory(1000, "oracle")
    with pytest.raises(RuntimeError, match=r"NeverAdmits stalled: it schedules nothing, nothing more will arrive, "
                                           r"and 2 requests are unfinished \(2 waiting, 0 running\)"):
        Engine(affine(), mem, SchedulerConfig(n_workers=2), scheduler=NeverAdmits).run(
            [Request(i, 0.0, 10, 5) for i in range(2)])
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)


# ---- swapping memory managers -----------------------------------------------------------------------
class SwappingMemory(TokenMemory):
    """On-demand slots whose preemption copies the K/V to host memory (kept, not recomputed)."""

    def __init__(self, n_slots: int) -> None:
        super().__init__(n_slots)
        self.host: dict = {}

    def preempt(self, req) -> bool:
        self.host[req.req_id] = self._kv[req.req_id]
        self.free(req)
        return True

    def try_admit(self, req) -> bool:
        if not super().try_admit(req):
            return False
        back = self.host.pop(req.req_id, 0)
        assert back == req.num_computed_tokens
        self._kv[req.req_id] = back
        self.slots_used += back
        return True

    def reset(self) -> None:
        super().reset()
        self.host.clear()


def test_a_swapping_manager_keeps_computed_tokens_across_preemption():
    reqs = [Request(i, 0.0, 6, 12) for i in range(4)]
    swap, recompute = SwappingMemory(40), TokenMemory(40)
    eng = Engine(iteration_clock(), swap, SchedulerConfig(max_bs=4), max_context=64, trace=True)
    eng.start(reqs)
    outs, ins = [], []
    while (b := eng.step()) is not None:
        for r, n in b.swapped_out:
            assert r in b.preempted and r.num_computed_tokens == n > 0
            outs.append((r.req_id, n))
        for r, n in b.swapped_in:
            assert ScheduledSeq(r, 1, n) in b.works     # it resumes decoding where it stopped
            ins.append((r.req_id, n))
    res = eng.result()
    assert outs and sorted(outs) == sorted(ins)
    assert sum(res.n_preemptions) == len(outs)
    assert (swap.slots_reserved, swap.slots_used) == (0, 0) and not swap.host
    ref = Engine(iteration_clock(), recompute, SchedulerConfig(max_bs=4), max_context=64).run(
        [Request(i, 0.0, 6, 12) for i in range(4)])
    assert sum(ref.n_preemptions) > 0
    assert res.step_n_tokens.sum() < ref.step_n_tokens.sum()   # nothing recomputed


# ---- defects ----------------------------------------------------------------------------------------
def test_max_bs_counts_every_request_with_pipelining_and_chunked_prefill():
    reqs = [Request(0, .004, 5, 3), Request(1, .008, 1, 3), Request(2, .010, 4, 1)]
    config = SchedulerConfig(max_bs=2, n_workers=2, max_num_batched_tokens=4, chunked_prefill=True)
    res = Engine(affine(), UnlimitedMemory(), config, trace=True).run(reqs)
    assert max(len(w) for *_, w in res.trace) == 2
    assert res.step_n_seqs.max() == 2


def test_max_bs_holds_through_the_api_with_pipelining_and_chunked_prefill():
    res = api_run(chat(n_requests=150, rate=32.0, seed=0), system="orca-oracle", max_bs=16, n_workers=4, pp=4,
                  max_num_batched_tokens=512, chunked_prefill=True)
    assert res.step_n_seqs.max() == 16


def test_the_core_imports_only_itself_and_the_shared_leaves():
    """The core is the algorithm alone: nothing of the simulator, the model or the toolkit."""
    import ast
    from pathlib import Path

    import orca_torch.core

    allowed = ("orca_torch.core", "orca_torch.checks", "orca_torch.specs")
    for path in Path(orca_torch.core.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if name.startswith("orca_torch"):
                    assert name.startswith(allowed), f"{path.name} imports {name}"
