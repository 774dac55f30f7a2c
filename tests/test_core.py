"""The core one step at a time: counters that are true after every step, the pipelining driver with an
asynchronous executor, swapping memory managers, and the defects the rewrite must not have."""
from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest

from orca_torch.lab.api import run as api_run
from orca_torch.lab.baselines import FasterTransformerExecutor
from orca_torch.core.engine import Engine
from orca_torch.sim.executors import CostModelExecutor, StepTimeExecutor, iteration_clock
from orca_torch.core.executor import Executor, StepResult
from orca_torch.core.memory import MemoryManager, ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.core.request import Request, Status
from orca_torch.core.scheduler import SchedulerConfig
from orca_torch.lab.workload import chat


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
    that joined inside a fast-forwarded run at step s: its prefill, then a decode a step)."""
    reqs = [Request(i, a, p, o) for i, (a, p, o) in
            enumerate([(0, 5, 4), (0, 9, 3), (1, 3, 7), (2, 12, 2), (2, 4, 5), (4, 7, 1), (6, 2, 6)])]
    eng = Engine(iteration_clock(), memory(), config, max_context=64, fast_forward=fast)
    eng.start(reqs)
    before = snapshot(reqs)
    n_steps = 0
    while (batch := eng.step()) is not None:
        assert len(batch.works) <= config.max_bs
        fed = {}
        for r, n, p in batch.works:
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
                m = min(batch.n_steps, r.output_len - g0) if caught_up else 1   # a fast-forward ends at its finish
                assert r.num_computed_tokens == p + n + m - 1
                assert r.n_generated == g0 + (m if caught_up else 0)
            elif r in batch.preempted:
                assert r.num_computed_tokens == 0 and r.status is Status.WAITING and r.n_generated == g0
            elif r in [j for j, _ in batch.joined]:
                s = dict((id(j), s) for j, s in batch.joined)[id(r)]
                assert (c0, g0) == (0, 0) and batch.index < s < batch.index + batch.n_steps
                m = min(batch.index + batch.n_steps - s, r.output_len)
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
        n_steps += batch.n_steps
    res = eng.result()
    assert res.n_steps == n_steps
    assert all(r.status is Status.FINISHED and r.n_generated == r.output_len for r in reqs)


def test_engine_step_is_inspectable_mid_run():
    reqs = [Request(0, 0.0, 4, 3), Request(1, 0.0, 6, 2), Request(2, 5.0, 3, 2)]
    eng = Engine(iteration_clock(), UnlimitedMemory(), SchedulerConfig(max_bs=2), max_context=32,
                 fast_forward=False)
    eng.start(reqs)
    b0 = eng.step()
    assert [(r.req_id, n, p) for r, n, p in b0.works] == [(0, 4, 0), (1, 6, 0)]
    assert [r.num_computed_tokens for r in reqs[:2]] == [4, 6] and [r.n_generated for r in reqs[:2]] == [1, 1]
    assert eng.scheduler.running == reqs[:2] and reqs[2].status is Status.WAITING
    b1 = eng.step()
    assert [(r.req_id, n, p) for r, n, p in b1.works] == [(0, 1, 4), (1, 1, 6)]
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
        in_flight = {r.req_id for b, *_ in self.queue for r, _, _ in b.works}
        assert not in_flight & {r.req_id for r, _, _ in batch.works}, "a request in two in-flight batches"
        assert all(r.status is Status.IN_FLIGHT for r, _, _ in batch.works)
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
    reqs = chat(40, 50.0, seed=1, max_context=256)
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
    reqs = chat(10, 50.0, seed=1, max_context=256)
    mem = UnlimitedMemory()
    with pytest.raises(RuntimeError, match="order they were submitted"):
        Engine(FakeAsyncExecutor(2, reorder=True), mem, SchedulerConfig(max_bs=4, n_workers=2)).run(reqs)
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
            assert (r, 1, n) in b.works         # it resumes decoding where it stopped
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
    res = api_run(chat(150, 32.0, seed=0), system="orca-oracle", max_bs=16, n_workers=4,
                  max_num_batched_tokens=512, chunked_prefill=True)
    assert res.step_n_seqs.max() == 16


@pytest.mark.parametrize("m", [1, 2, 17, 64, 65, 300])         # SHORT_RUN = 64: both paths
@pytest.mark.parametrize("as_list", [False, True])
def test_step_ends_are_the_step_by_step_sums_cut_at_the_arrival(m, as_list):
    from orca_torch.core.durations import SHORT_RUN, step_ends

    assert SHORT_RUN == 64
    rng = np.random.default_rng(m)
    ds = rng.uniform(0.001, 0.03, m)
    t, want = 12.345, []
    for d in ds.tolist():                       # the engine's own loop: t += d
        t += d
        want.append(t)
    got = step_ends(ds.tolist() if as_list else ds.copy(), m, 12.345, None)
    assert list(map(float, got)) == want        # exactly, not approximately
    stop = want[m // 2]
    cut = step_ends(ds.tolist() if as_list else ds.copy(), m, 12.345, stop)
    assert list(map(float, cut)) == want[:m // 2 + 1]     # up to the first end at or after the arrival
    mid = (want[m // 2 - 1] + want[m // 2]) / 2 if m > 1 else want[0] - 1e-9
    assert len(step_ends(ds.copy(), m, 12.345, mid)) == max(1, m // 2 + (m > 1))


@pytest.mark.parametrize("m", [5, 100])
@pytest.mark.parametrize("bad", [-1e-3, math.nan, math.inf])
def test_step_ends_refuse_a_bad_duration_and_a_wrong_count(m, bad):
    from orca_torch.core.durations import step_ends

    ds = np.full(m, 0.01)
    ds[m - 2] = bad
    with pytest.raises(RuntimeError, match="finite number >= 0"):
        step_ends(ds, m, 0.0, None)
    for not_a_number in (True, "0.01"):                 # a list from a step-time function
        with pytest.raises(RuntimeError, match="as a step duration; every duration must be a finite number >= 0"):
            step_ends([0.01] * (m - 1) + [not_a_number], m, 0.0, None)
    assert step_ends([1] * m, m, 0.5, None)[-1] == 0.5 + m      # whole numbers are durations
    with pytest.raises(RuntimeError, match=r"returned \(4,\) durations, expected \(5,\)"):
        step_ends(np.ones(4), 5, 0.0, None)
    with pytest.raises(RuntimeError, match=r"returned \(5, 1\) durations"):
        step_ends(np.ones((5, 1)), 5, 0.0, None)


@pytest.mark.parametrize("order", ["fcfs", "spf"])
@pytest.mark.parametrize("memory", [lambda: TokenMemory(100), lambda: UnlimitedMemory()])
def test_fast_forwarded_steps_trace_as_steps_of_their_own(order, memory):
    """The trace of a fast-forwarded decode lists its works in the order a plain step would (a
    memory that can run out serves decodes by arrival, SPF admits out of arrival order)."""
    out = []
    for ff in (False, True):
        reqs = [Request("a", 0.0, 4, 5, predicted_output=9.0), Request("b", 0.0, 4, 5, predicted_output=1.0),
                Request("c", 1.0, 3, 4, predicted_output=2.0)]
        res = Engine(iteration_clock(), memory(), SchedulerConfig(max_bs=4, order=order), max_context=64,
                     trace=True, fast_forward=ff).run(reqs)
        out.append(res.trace)
    assert out[0] == out[1]


# ---- the fast-forward past finishes, and the collector paused for a simulated run -------------------------
def three_at_once():
    return [Request(i, 0.0, 4, o) for i, o in enumerate((3, 7, 12))]


def test_a_decode_run_goes_on_past_finishes_when_no_one_could_take_their_place():
    """Queue empty, memory that cannot run out: one `step()` covers the prefill and every decode
    until the last finish, each request's tokens on consecutive steps and its memory given back
    at its own last step."""
    eng = Engine(iteration_clock(), ReservationMemory(1000, "oracle"), SchedulerConfig(max_bs=4), max_context=64)
    eng.start(three_at_once())
    batch = eng.step()
    assert batch.n_steps == 12 and eng.done and eng.step() is None
    res = eng.result()
    for i, o in enumerate((3, 7, 12)):
        np.testing.assert_array_equal(res.steps_of(i), np.arange(o))
    np.testing.assert_array_equal(res.release_s, [3.0, 7.0, 12.0])
    np.testing.assert_array_equal(res.step_n_seqs, [3] * 3 + [2] * 4 + [1] * 5)
    # reserved: 7 + 11 + 16 slots until the first finishes, then 11 + 16, then 16
    np.testing.assert_array_equal(res.step_reserved, [34] * 3 + [27] * 4 + [16] * 5)


@pytest.mark.parametrize("why", ["a request waits for prefill-only steps", "memory can run out",
                                 "an arrival's step feeds only prompts"])
def test_a_decode_run_stops_where_the_next_step_could_differ(why):
    reqs = three_at_once()
    config, memory, stop = SchedulerConfig(max_bs=4), UnlimitedMemory(), 3
    if why == "a request waits for prefill-only steps":
        config = SchedulerConfig(max_bs=2, prefill="prefill_first")    # the third waits for the first finish
    elif why == "memory can run out":
        memory = TokenMemory(100)
    else:
        config = SchedulerConfig(max_bs=4, prefill="prefill_first")
        reqs.append(Request(3, 5.0, 2, 2))         # seen at the first step boundary at or after t = 5
        stop = 5
    eng = Engine(iteration_clock(), memory, config, max_context=64)
    eng.start(reqs)
    assert eng.step().n_steps == stop
    while eng.step() is not None:
        pass
    slow = Engine(iteration_clock(), type(memory)(*([100] if why == "memory can run out" else [])), config,
                  max_context=64, fast_forward=False).run([Request(r.req_id, r.arrival_s, r.prompt_len,
                                                                    r.output_len) for r in reqs])
    assert_same_columns(eng.result(), slow)


@pytest.mark.parametrize("case", ["joins", "a seat frees first", "no room: it waits", "waits for two finishes",
                                  "waits from the start", "two at once", "one token", "spf", "spf waits"])
def test_arrivals_join_a_decode_run_as_the_scheduler_would_admit_them(case):
    """The memory cannot run out: an arrival is admitted inside the run (its step is the decodes
    plus its prefill, priced like any step), and the run goes on; one that cannot be let in waits,
    and the step after a finish lets the queue in as `schedule` would. Every column, each
    request's release and the trace equal the step-by-step run's."""
    reqs = [(0, 0.0, 4, 3), (1, 0.0, 4, 7), (2, 0.0, 4, 12), (3, 5.0, 2, 4)]
    config, memory = SchedulerConfig(max_bs=4), lambda: ReservationMemory(1000, "oracle")
    if case == "a seat frees first":
        config = SchedulerConfig(max_bs=3)          # seats full until the first finish (step 3)
        reqs[3] = (3, 1.0, 2, 4)
    elif case == "no room: it waits":
        memory = lambda: ReservationMemory(34 + 5, "oracle")     # 7 + 11 + 16 held; it needs 6
        reqs[3] = (3, 2.0, 2, 4)                    # seen after step 1, before the first finish
    elif case == "waits for two finishes":
        memory = lambda: ReservationMemory(34, "oracle")         # 27 held after the first finish; it needs 9
        reqs[3] = (3, 2.0, 2, 8)
    elif case == "waits from the start":
        config = SchedulerConfig(max_bs=2)          # request 2 waits for the first finish, 3 for the second
    elif case == "two at once":
        reqs += [(4, 5.5, 3, 9), (5, 8.0, 6, 2)]
    elif case == "one token":
        reqs[3] = (3, 5.0, 2, 1)                    # done at its prefill
    elif case == "spf":
        config = SchedulerConfig(max_bs=6, order="spf")
        reqs = [(*r, None, float(10 - i)) for i, r in enumerate(reqs + [(4, 5.0, 3, 2), (5, 5.0, 2, 9)])]
    elif case == "spf waits":                       # 6 and 4 wait behind 5, which waits for a seat
        config = SchedulerConfig(max_bs=4, order="spf")
        reqs = [(*r, None, p) for r, p in zip(reqs + [(4, 5.0, 3, 2), (5, 5.0, 2, 9), (6, 6.0, 2, 3)],
                                              (12.0, 7.0, 3.0, 4.0, 2.0, 1.0, 3.0))]
    fast, slow = fast_and_slow(iteration_clock, memory, reqs, config)
    assert_same_columns(fast, slow)
    eng = Engine(iteration_clock(), memory(), config, max_context=64)
    eng.start([Request(*r) for r in reqs])
    calls = []
    while (batch := eng.step()) is not None:
        calls.append((batch.n_steps, [(r.req_id, s) for r, s in batch.joined]))
    if case in ("a seat frees first", "no room: it waits"):
        assert calls == [(fast.n_steps, [(3, 3)])]  # admitted at the step after the first finish
    elif case == "waits for two finishes":
        assert calls == [(fast.n_steps, [(3, 7)])]
    elif case == "waits from the start":
        assert calls == [(fast.n_steps, [(2, 3), (3, 7)])]
    else:
        assert len(calls) == 1 and calls[0][0] == fast.n_steps and len(calls[0][1]) == len(reqs) - 3


class GrowsIntoAdmission(MemoryManager):
    """Cannot run out (growth never refuses), but what the decodes grow counts against admission."""

    def __init__(self):
        super().__init__(12, 2048)
        self._kv = {}

    def reservation(self, r):
        return r.prompt_len + r.n_generated

    def try_admit(self, r):
        if not super().try_admit(r):
            return False
        self._kv[r.req_id] = 0
        return True

    def grow(self, r, n=1):
        self._kv[r.req_id] = kv = self._kv[r.req_id] + n
        extra = max(0, kv - self._res[r.req_id])
        self._res[r.req_id] += extra
        self.slots_reserved += extra
        self.slots_used += n
        return True

    def free(self, r):
        self.slots_reserved -= self._res.pop(r.req_id)
        self.slots_used -= self._kv.pop(r.req_id)

    def reset(self):
        super().reset()
        self._kv.clear()


def test_a_step_that_admits_inside_a_run_reads_as_the_scheduler_would_have_built_it():
    """The run builds such a step's decode works only when read (`JoinWorks`): FasterTransformer's
    executor reads them to pad the prompts, and its times and the trace (which reads them after
    the run) equal the step-by-step run's."""
    reqs = [(i, t, p, o) for i, (t, p, o) in enumerate(     # steps of ~10 ms: 3 and 5 wait at max_bs 3
        [(0.0, 30, 40), (0.0, 8, 9), (0.0, 50, 25), (0.01, 12, 30), (0.02, 70, 6), (0.02, 9, 14), (0.3, 5, 3)])]
    ft = lambda: FasterTransformerExecutor("llama-3-8b", "h100")
    for config in (SchedulerConfig(max_bs=3), SchedulerConfig(max_bs=8)):
        fast, slow = fast_and_slow(ft, lambda: ReservationMemory(300, "oracle"), reqs, config)
        assert_same_columns(fast, slow)
        eng = Engine(ft(), ReservationMemory(300, "oracle"), config, max_context=2048)
        eng.start([Request(*r) for r in reqs])
        joined = []
        while (batch := eng.step()) is not None:
            joined += [r.req_id for r, _ in batch.joined]
        assert joined == [3, 4, 5]              # taken inside a run (6 arrives once everyone is done)


def state_after_each_step(engine: Engine, reqs) -> dict[int, tuple]:
    """Step index -> (each request's counters and status, the queue, the memory) after the call
    that ended with that step."""
    engine.start([Request(*r) for r in reqs])
    states = {}
    while (batch := engine.step()) is not None:
        sched = engine.scheduler
        states[batch.index + batch.n_steps - 1] = (
            [(r.num_computed_tokens, r.n_generated, r.status) for r in engine.requests],
            sorted(r.req_id for _, r in sched.waiting), [r.req_id for r in sched.running],
            engine.memory.slots_reserved, engine.memory.slots_used)
    return states


WAITING_RUNS = {                                # (max_bs, slots, order): someone waits for most of the run
    "fcfs, seats": (2, 1000, "fcfs"), "fcfs, memory": (8, 40, "fcfs"), "spf, seats": (3, 1000, "spf")}
WAITING_REQS = [(i, 0.4 * i, 2 + i % 5, 1 + (7 * i) % 11, None, float(1 + (5 * i) % 9)) for i in range(14)]


@pytest.mark.parametrize("setting", [*WAITING_RUNS, "two arrive while the seats are full"])
def test_after_each_call_the_queue_and_every_request_are_as_after_that_step_of_the_step_by_step_run(setting):
    if setting in WAITING_RUNS:
        (max_bs, slots, order), reqs = WAITING_RUNS[setting], WAITING_REQS
    else:                                       # both arrive during the first call, which ends at step 9
        (max_bs, slots, order), reqs = (2, 1000, "fcfs"), [(0, 0.0, 2, 10), (1, 0.0, 3, 10), (2, 0.5, 2, 3),
                                                          (3, 3.5, 2, 3)]
    config = SchedulerConfig(max_bs=max_bs, order=order)
    engines = [Engine(iteration_clock(), ReservationMemory(slots, "oracle"), config, max_context=64,
                      fast_forward=ff) for ff in (True, False)]
    fast, slow = (state_after_each_step(e, reqs) for e in engines)
    assert len(fast) < len(slow) // 3           # the fast run took several steps a call
    for step, state in fast.items():
        assert state == slow[step], step
    if setting not in WAITING_RUNS:
        assert fast[9][1] == [2, 3]


@pytest.mark.parametrize("max_run", [1, 2, 3])
def test_a_run_cut_at_max_run_leaves_its_last_finishers_to_complete(monkeypatch, max_run):
    from orca_torch.sim import fast_forward
    monkeypatch.setattr(fast_forward, "MAX_RUN", max_run)
    for max_bs, slots, order in WAITING_RUNS.values():
        reqs = WAITING_REQS + [(14, 0.4 * 14, 3, 1, None, 1.0), (15, 0.4 * 14, 2, 1, None, 2.0)]
        fast, slow = fast_and_slow(iteration_clock, lambda: ReservationMemory(slots, "oracle"), reqs,
                                   SchedulerConfig(max_bs=max_bs, order=order))
        assert_same_columns(fast, slow)


class ReadsWorks(StepTimeExecutor):
    """Prices a step from its works, read as a list (a decode run from the same sums' totals)."""

    reads_works = True

    def __init__(self):
        super().__init__(lambda t: 0.01 + 0.001 * t.n_tokens + 1e-5 * (t.kv_read_tokens - t.n_tokens),
                         max_context=2048)

    def execute(self, batch):
        works = batch.works.copy()
        return StepResult(0.01 + 0.001 * sum(n for _, n, _ in works) + 1e-5 * sum(p for _, _, p in works))


def test_an_executor_that_reads_the_works_gets_a_list_inside_a_run_and_one_that_prices_totals_need_not():
    reqs = [(i, 0.01 * t, p, o) for i, t, p, o, _, _ in WAITING_REQS]     # steps of 10-20 ms: they join
    fast, slow = fast_and_slow(ReadsWorks, lambda: ReservationMemory(40, "oracle"), reqs, SchedulerConfig(max_bs=8))
    assert_same_columns(fast, slow)
    untraced = Engine(ReadsWorks(), ReservationMemory(40, "oracle"), SchedulerConfig(max_bs=8), max_context=2048)
    np.testing.assert_array_equal(untraced.run([Request(*r) for r in reqs]).step_end, slow.step_end)
    assert CostModelExecutor.reads_works is False and StepTimeExecutor.reads_works is False
    assert FasterTransformerExecutor.reads_works is True


def test_an_arrival_inside_a_run_is_admitted_after_the_decodes_grow_as_in_a_step_of_its_own():
    fast, slow = fast_and_slow(iteration_clock, GrowsIntoAdmission, [(0, 0.0, 4, 6), (1, 2.0, 7, 3)])
    assert_same_columns(fast, slow)


def test_a_static_batch_goes_on_to_its_end_while_requests_wait():
    reqs = [Request(0, 0.0, 4, 50), Request(1, 0.0, 4, 50), Request(2, 0.0, 4, 5)]
    eng = Engine(iteration_clock(), ReservationMemory(1000, "oracle"), SchedulerConfig(max_bs=2, static=True),
                 max_context=64)
    eng.start(reqs)
    calls = []
    while (batch := eng.step()) is not None:
        calls.append(batch.n_steps)
    assert calls == [50, 5]                     # the first batch in one call, though request 2 waits


COLUMNS = ("step_start", "step_end", "step_n_seqs", "step_n_tokens", "step_reserved", "step_used", "token_step",
           "release_s")


def assert_same_columns(fast, slow):
    for col in COLUMNS:
        np.testing.assert_array_equal(getattr(fast, col), getattr(slow, col), err_msg=col)
    assert fast.trace == slow.trace


def fast_and_slow(make_executor, make_memory, reqs, config=SchedulerConfig(max_bs=4)):
    return [Engine(make_executor(), make_memory(), config, max_context=2048, trace=True, fast_forward=ff).run(
        [Request(*r) for r in reqs]) for ff in (True, False)]


class BlockMemory(MemoryManager):
    """No limit, K/V in blocks of 16 slots: the slots reserved grow unevenly (`decode_reserved`)."""

    def __init__(self):
        super().__init__(None, 2048)
        self._kv = {}

    def reservation(self, r):
        return -(-(r.prompt_len + r.n_generated) // 16) * 16

    def try_admit(self, r):
        super().try_admit(r)
        self._kv[r.req_id] = 0
        return True

    def grow(self, r, n=1):
        old, kv = self._res[r.req_id], self._kv[r.req_id] + n
        self._res[r.req_id] = new = max(old, -(-kv // 16) * 16)
        self._kv[r.req_id] = kv
        self.slots_reserved += new - old
        self.slots_used += n
        return True

    def free(self, r):
        self.slots_reserved -= self._res.pop(r.req_id)
        self.slots_used -= self._kv.pop(r.req_id)

    def decode_reserved(self, running, m):
        return [self.slots_reserved + sum(max(self._res[r.req_id], -(-(self._kv[r.req_id] + j) // 16) * 16)
                                          - self._res[r.req_id] for r in running) for j in range(1, m + 1)]

    def reset(self):
        super().reset()
        self._kv.clear()


def test_a_memory_manager_of_its_own_is_logged_exactly_past_finishes():
    """Uneven growth (`decode_reserved`) and what its own `free` gives back are followed through a
    run past finishes and an arrival admitted inside it."""
    fast, slow = fast_and_slow(iteration_clock, BlockMemory,
                               [(0, 0.0, 5, 40), (1, 0.0, 9, 3), (2, 0.0, 30, 17), (3, 8.0, 20, 9)])
    assert_same_columns(fast, slow)
    assert len(set(np.diff(fast.step_reserved))) > 2                       # it did grow unevenly


def test_an_executor_that_prices_steps_its_own_way_is_fast_forwarded_with_its_own_times():
    class HostWork(CostModelExecutor):          # the paper GPU plus 1 ms of host work a step
        def execute(self, batch):
            return StepResult(self.step_time(batch.totals))

        def step_time(self, totals):
            return super().step_time(totals) + 1e-3

        def decode_durations(self, k, ctx_sum, m):
            return super().decode_durations(k, ctx_sum, m) + 1e-3

    fast, slow = fast_and_slow(HostWork, UnlimitedMemory, [(0, 0.0, 16, 10), (1, 0.0, 16, 30), (2, 0.05, 8, 90)])
    assert_same_columns(fast, slow)


@pytest.mark.parametrize("idle_seats_cost", [True, False])
def test_a_static_batch_is_one_call_from_its_prefill_to_its_last_finish(idle_seats_cost):
    config = SchedulerConfig(max_bs=4, static=True, static_idle_seats_cost=idle_seats_cost)
    eng = Engine(iteration_clock(), ReservationMemory(1000, "oracle"), config, max_context=64)
    eng.start(three_at_once() + [Request(3, 0.5, 2, 2)])
    assert eng.step().n_steps == 12              # the late request waits for the whole batch
    assert eng.step().n_steps == 2
    res = eng.result()
    seats = [3] * 12 if idle_seats_cost else [3] * 3 + [2] * 4 + [1] * 5
    np.testing.assert_array_equal(res.step_n_seqs, seats + [1, 1])
    np.testing.assert_array_equal(res.release_s[:3], [12.0] * 3)    # a static batch's memory goes at its end


def test_a_simulated_run_pauses_the_cyclic_collector_and_restores_it():
    import gc
    seen = []

    def step_time(t):
        seen.append(gc.isenabled())
        return 0.001

    def run(ex):
        return Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=4), max_context=64).run(three_at_once())

    assert gc.isenabled()
    run(StepTimeExecutor(step_time, max_context=64))
    assert seen and not any(seen) and gc.isenabled()

    class Measured(StepTimeExecutor):           # an executor that runs its steps (torch) keeps it
        can_fast_forward = False
    seen.clear()
    run(Measured(step_time, max_context=64))
    assert seen and all(seen)

    def failing(t):
        raise RuntimeError("the step-time function failed")
    with pytest.raises(RuntimeError, match="step-time function failed"):
        run(StepTimeExecutor(failing, max_context=64))
    assert gc.isenabled()
    gc.disable()                                # a caller's own setting is left as it was
    try:
        run(StepTimeExecutor(step_time, max_context=64))
        assert not gc.isenabled()
    finally:
        gc.enable()
