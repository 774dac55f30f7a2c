"""The engine end to end on the paper GPU: invariants over random workloads, exact equalities, bad input."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from orca_torch.core.engine import Engine
from orca_torch.sim.executors import CostModelExecutor, StepTimeExecutor
from orca_torch.core.memory import ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.request import Request, Status
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.lab.workload import chat
from orca_torch.sim.fast_engine import FastEngine
from random_settings import make_memory, random_config
from reference_engine import reference_run
from test_reference_equivalence import priced_by

GPU = CostModelExecutor("llama-3-8b", "h100")


def assert_fcfs_every_step(res):
    """Iteration-level FCFS (Orca §4.3): at every step, among requests in the pool, an earlier
    arrival has run at least as many iterations as a later one."""
    ids = [r.req_id for r in res.requests]
    arrival = dict(zip(ids, res.arrival_s))
    last = {rid: int(res.steps_of(i)[-1]) for i, rid in enumerate(ids)}
    ran = defaultdict(int)
    for index, start, _, works in res.trace:
        for rid, _, _ in works:
            ran[rid] += 1
        counts = [ran[rid] for rid in ids if arrival[rid] <= start and last[rid] >= index]
        assert all(a >= b for a, b in zip(counts, counts[1:])), f"FCFS broken at step {index}: {counts}"


def replay_token_steps(res) -> tuple[dict, np.ndarray]:
    """Replay the trace: a work item yields a token exactly when it brings its request's context up to
    prompt + tokens generated so far (a prompt's last chunk, a decode, or a recompute after
    preemption); an earlier chunk yields none. Returns (req_id -> steps that yielded its tokens,
    per step the number of work items that yielded nothing)."""
    prompt = {r.req_id: r.prompt_len for r in res.requests}
    steps: dict = defaultdict(list)
    silent = np.zeros(len(res.trace), dtype=np.int64)
    for s, (index, _, _, works) in enumerate(res.trace):
        assert index == s
        for rid, n_new, n_past in works:
            due = prompt[rid] + len(steps[rid])
            assert n_past + n_new <= due, f"step {s}: request {rid} runs past its context"
            if n_past + n_new == due:
                steps[rid].append(s)
            else:
                silent[s] += 1
    return steps, silent


def assert_served_exactly(res, reqs):
    """Every request got exactly its tokens, in time order, each made by the step the trace says."""
    assert res.trace is not None, "needs Engine(..., trace=True)"
    assert [r.status for r in res.requests] == [Status.FINISHED] * len(reqs)
    for i, r in enumerate(reqs):
        t = res.tokens_of(i)
        assert len(t) == r.output_len
        assert t[0] > res.arrival_s[i] and np.all(np.diff(t) > 0)
    assert len(res.trace) == res.n_steps
    # static batching's finished requests keep their seat (one token of cost each) but are not listed
    idle = res.step_n_seqs - np.array([len(w) for *_, w in res.trace])
    assert np.all(idle >= 0)
    if not (res.config.static and res.config.static_idle_seats_cost):
        assert not idle.any()
    np.testing.assert_array_equal(res.step_n_tokens, [sum(n for _, n, _ in w) for *_, w in res.trace] + idle)
    want, silent = replay_token_steps(res)
    assert np.all((0 <= res.token_step) & (res.token_step < res.n_steps))
    for i, r in enumerate(res.requests):
        assert res.steps_of(i).tolist() == want[r.req_id], f"request {r.req_id}: tokens from the wrong steps"
    # tokens per step = the step's sequences minus its idle seats and its prompt chunks that finished no prompt
    np.testing.assert_array_equal(np.bincount(res.token_step, minlength=res.n_steps),
                                  res.step_n_seqs - idle - silent)
    np.testing.assert_array_equal(res.token_times, res.step_end[res.token_step])


workloads = st.lists(st.tuples(st.floats(0, 0.05), st.integers(1, 900), st.integers(1, 60)), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(reqs=workloads, max_bs=st.integers(1, 12),
       memory=st.sampled_from(["max", "pow2", "oracle", "ondemand", "unlimited"]), slack=st.integers(0, 6000),
       prefill=st.sampled_from(["mixed", "prefill_first"]), budget=st.sampled_from([None, "chunked", "whole"]),
       static=st.booleans(), kind=st.sampled_from([Engine, FastEngine]))
def test_engine_invariants_on_random_workloads(reqs, max_bs, memory, slack, prefill, budget, static, kind):
    """Reservation never exceeds n_slots, every request gets exactly its tokens once, FCFS holds at
    every step, everything is freed, nothing deadlocks — for every manager and knob."""
    arrivals = np.cumsum([a for a, _, _ in reqs])
    requests = [Request(i, float(t), p, o) for i, (t, (_, p, o)) in enumerate(zip(arrivals, reqs))]
    if static:
        memory = "oracle" if memory == "ondemand" else memory
    config = random_config(max_bs, static, budget, prefill)
    n_slots = 1024 + slack if memory != "ondemand" else max(r.total_len for r in requests) + slack // 4
    mem = make_memory(memory, n_slots, 1024)
    res = kind(GPU, mem, config, max_context=1024, trace=True).run(requests)
    assert_served_exactly(res, requests)
    assert np.all(res.step_used <= res.step_reserved)
    if memory != "unlimited":
        assert res.step_reserved.max() <= n_slots
    assert res.step_n_seqs.max() <= max_bs
    if config.max_num_batched_tokens:
        assert res.step_n_tokens.max() <= config.max_num_batched_tokens
    assert_fcfs_every_step(res)
    assert mem.slots_reserved == 0 and mem.slots_used == 0
    if memory != "ondemand":
        assert res.n_preemptions.sum() == 0


def test_max_bs_1_serves_one_at_a_time_as_the_plain_loop_does():
    reqs = chat(n_requests=60, rate=2.0, seed=2)
    res = Engine(GPU, UnlimitedMemory(), SchedulerConfig(max_bs=1)).run(reqs)
    ref = reference_run(reqs, priced_by(GPU), UnlimitedMemory(), max_bs=1)
    assert max(s.n_seqs for s in ref.steps) == 1
    for i, r in enumerate(reqs):
        np.testing.assert_array_equal(res.tokens_of(i), ref.times[r.req_id])
        assert len(res.tokens_of(i)) == r.output_len


def test_served_exactly_catches_tokens_credited_to_the_wrong_step():
    """The check above must fail if `token_step` were wrong, even with consistent token times."""
    reqs = [Request(0, 0.0, 300, 4), Request(1, 0.0, 40, 6), Request(2, 0.002, 500, 3)]
    config = SchedulerConfig(max_bs=4, max_num_batched_tokens=128, chunked_prefill=True)
    res = Engine(GPU, UnlimitedMemory(), config, max_context=1024, trace=True).run(reqs)
    assert_served_exactly(res, reqs)
    first = res.token_offsets[:-1]

    def mutated(step):
        return replace(res, token_step=step)

    early = res.token_step.copy()
    early[first[0]] -= 1                      # r0's first token credited to a chunk that ends no prompt
    late = res.token_step.copy()
    late[first[2] - 1] += 1                   # r1's last token one step late (a step that exists)
    assert late[first[2] - 1] < res.n_steps
    swap = res.token_step.copy()              # r0's last and r2's first exchanged: same tokens per step,
    a, b = first[1] - 1, first[2]             # both still increasing in time
    swap[a], swap[b] = swap[b], swap[a]
    assert swap[a] > swap[a - 1] and swap[b] < swap[b + 1]
    for step in (early, late, swap):
        assert not np.array_equal(step, res.token_step)
        with pytest.raises(AssertionError, match="tokens from the wrong steps"):
            assert_served_exactly(mutated(step), reqs)


def test_preemption_with_an_on_demand_manager():
    reqs = [Request(i, 0.001 * i, 200, 150) for i in range(8)]
    mem = TokenMemory(1000)
    res = Engine(GPU, mem, SchedulerConfig(max_bs=8), max_context=1024, trace=True).run(reqs)
    assert res.n_preemptions.sum() > 0
    assert res.n_preemptions[0] == 0                     # the earliest arrival is never evicted
    assert res.step_reserved.max() <= 1000
    assert_served_exactly(res, reqs)
    assert_fcfs_every_step(res)
    # A preempted request recomputes its prompt and generated tokens in one prefill.
    victim = int(np.flatnonzero(res.n_preemptions)[0])
    recompute = [(n, p) for _, _, _, w in res.trace for rid, n, p in w if rid == victim and p == 0]
    assert len(recompute) == 1 + res.n_preemptions[victim] and recompute[1][0] > 200


def test_reject_mode_serves_the_rest():
    reqs = [Request(0, 0.0, 100, 20), Request(1, 0.1, 4000, 200), Request(2, 0.2, 50, 10)]
    res = Engine(GPU, ReservationMemory(50_000, "max"), max_context=4096).run(reqs, on_invalid="reject")
    assert [r.req_id for r in res.requests] == [0, 2]
    assert [(r.req_id, r.status) for r, _ in res.rejected] == [(1, Status.REJECTED)]
    assert "exceeds the max context 4096" in res.rejected[0][1]


def test_requests_arriving_during_a_step_wait_one_iteration_at_most():
    ex = StepTimeExecutor(lambda t: 1.0)
    ex.max_context = 100
    reqs = [Request(0, 0.0, 5, 10), Request(1, 2.5, 5, 2)]
    res = Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=4)).run(reqs)
    assert res.first_token_s[1] == 4.0                    # seen at the step starting at 3, out at 4
    assert res.tokens_of(0)[-1] == 10.0                   # r0 never paused


def test_requests_arriving_together_are_served_whatever_number_type_their_arrival_has():
    """An `arrival_s` set after construction may be a numpy float or an int: a request arriving with the
    one before it is taken, as one whose arrival is a float is, and all three start in the first step."""
    reqs = [Request(0, 1.0, 4, 2), Request(1, 1.0, 4, 2), Request(2, 1.0, 4, 2)]
    reqs[1].arrival_s, reqs[2].arrival_s = np.float64(1.0), 1
    res = Engine(StepTimeExecutor(lambda t: 1.0, max_context=64), UnlimitedMemory(), SchedulerConfig(max_bs=4),
                 trace=True).run(reqs)
    assert res.trace[0].works == [(0, 4, 0), (1, 4, 0), (2, 4, 0)] and res.n_steps == 2


@pytest.mark.parametrize("memory", [ReservationMemory(1000, "pow2"), PagedMemory(1000, 4), TokenMemory(1000)])
def test_lengths_set_to_numpy_integers_after_construction_run_as_plain_ones(memory):
    """The engine re-checks a request's fields at submission; a length set to a numpy integer there
    becomes an int, as at construction (Orca (pow2) rounds it up with int.bit_length)."""
    reqs = [Request(0, 0.0, 5, 3, max_tokens=20), Request(1, 0.5, 6, 2)]
    plain = Engine(StepTimeExecutor(lambda t: 1.0, max_context=64), memory, trace=True).run(reqs)
    reqs[0].prompt_len, reqs[0].output_len, reqs[0].max_tokens = np.int64(5), np.int32(3), np.uint16(20)
    res = Engine(StepTimeExecutor(lambda t: 1.0, max_context=64), memory, trace=True).run(reqs)
    assert res.trace == plain.trace and res.step_reserved.tolist() == plain.step_reserved.tolist()
    assert all(type(v) is int for v in (reqs[0].prompt_len, reqs[0].output_len, reqs[0].max_tokens))


def test_memory_occupancy_is_recorded_per_step():
    reqs = [Request(0, 0.0, 100, 3), Request(1, 0.0, 200, 2)]
    res = Engine(GPU, ReservationMemory(10_000, "max"), max_context=1000).run(reqs)
    # Step 0: both prefill (300 tokens stored); step 1: both decode (+2); r1 leaves with 201 stored.
    assert list(res.step_reserved) == [2000, 2000, 1000]
    assert list(res.step_used) == [300, 302, 102]



def test_two_engines_over_one_memory_manager_each_reserve_for_their_own_context():
    mem = ReservationMemory(10_000, "max")
    short = Engine(GPU, mem, max_context=1000)
    Engine(GPU, mem, max_context=4000)                # built later: its context must not leak into `short`
    res = short.run([Request(0, 0.0, 100, 3)])
    assert list(res.step_reserved) == [1000, 1000, 1000]

def test_simulating_on_the_paper_gpu_does_not_import_torch():
    """The simulator is numpy and Python: `api.simulate` on the cost model runs without loading
    torch (seconds of import), which only the torch executor, the model and the K/V managers need."""
    import subprocess
    import sys

    code = ("import sys; from orca_torch.lab.api import simulate; "
            "m = simulate(rate=8, n_requests=40, system='orca-max'); "
            "assert m.n_requests == 40, m; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


class ReleaseLog(StepTimeExecutor):
    """An iteration clock that notes each step it runs and each request whose state it is told to drop."""

    def __init__(self):
        super().__init__(lambda t: 1.0, max_context=64)
        self.events = []

    def execute(self, batch):
        self.events.append(("step", batch.index))
        return super().execute(batch)

    def release(self, req):
        self.events.append(("release", req.req_id))


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_the_executor_drops_a_recompute_victim_s_state_at_once_and_keeps_a_swapped_one_s(preemption):
    # 3 blocks of 8: r0 and r1 take one each, then r0's second block leaves none for r1's: r1 is preempted.
    ex = ReleaseLog()
    mem = PagedMemory(24, block_size=8, preemption=preemption, watermark_blocks=0)
    res = Engine(ex, mem, SchedulerConfig(max_bs=2)).run([Request(0, 0.0, 8, 9), Request(1, 0.0, 8, 9)])
    assert list(res.n_preemptions) == [0, 1]
    gone = ex.events.index(("release", 0))              # r0 finishes first; r1 was preempted before
    early = [e for e in ex.events[:gone] if e[0] == "release"]
    assert early == ([("release", 1)] if preemption == "recompute" else [])
    assert ex.events.count(("release", 1)) == (2 if preemption == "recompute" else 1)


@pytest.mark.parametrize("fast", [False, True])
def test_a_request_arriving_as_a_step_ends_joins_the_next_step(fast):
    # Every step lasts 1 s: r1 arrives at 1.0, the very end of step 0, so step 1 prefills it beside r0's decode.
    from clocks import iteration_clock
    from orca_torch.sim.fast_engine import FastEngine

    kind = FastEngine if fast else Engine
    res = kind(iteration_clock(), UnlimitedMemory(), SchedulerConfig(max_bs=2), max_context=64, trace=True).run(
        [Request(0, 0.0, 4, 3), Request(1, 1.0, 4, 2)])
    assert [w for _, _, _, w in res.trace][:2] == [[(0, 4, 0)], [(0, 1, 4), (1, 4, 0)]]
    assert list(res.first_token_s) == [1.0, 2.0]
