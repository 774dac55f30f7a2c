"""The engine: what it refuses (and how it says so), and that a refused or failed run leaves the
memory manager's counters at zero at once and the engine ready for the next run."""
from __future__ import annotations

import copy
import dataclasses
import gc
import math
import pickle
import re

import numpy as np
import pytest

from orca_torch.core.durations import ClockError
from orca_torch.lab import api
from orca_torch.core.engine import Engine
from orca_torch.sim.executors import CostModelExecutor, StepTimeExecutor
from orca_torch.core.executor import RowsFailed, StepResult
from orca_torch.core.memory import ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.request import Request, Status
from orca_torch.core.scheduler import Scheduler
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.sim.fast_engine import FastEngine
from orca_torch.sim.hw_model import get_gpu
from clocks import iteration_clock

GPU = CostModelExecutor("llama-3-8b", "h100")


def affine(max_context=64):
    return StepTimeExecutor(lambda t: .001 + .001 * t.n_tokens, max_context=max_context)


def renamed(req_id):
    """A request whose req_id was changed after construction (which checked the first one)."""
    r = Request(0, 0.0, 3, 2)
    r.req_id = req_id
    return r


# ---- construction and submission ------------------------------------------------------------------

@pytest.mark.parametrize("make, says", [
    (lambda: Engine(None, UnlimitedMemory()), "executor must be an Executor, got None"),
    (lambda: Engine(affine(), None), "memory must be a MemoryManager, got None"),
    (lambda: Engine(affine(), UnlimitedMemory(), config="fcfs"), "config must be a SchedulerConfig or None, got 'fcfs'"),
    (lambda: Engine(affine(), UnlimitedMemory(), trace=1), "trace must be True or False"),
    (lambda: Engine(affine(), UnlimitedMemory(), max_context=0), r"max_context must be an integer in \[2, 2\*\*40\]"),
    (lambda: Engine(StepTimeExecutor(lambda t: .001), UnlimitedMemory()),
     r"max_context must be given: StepTimeExecutor.max_context is None; pass Engine\(..., max_context=N\), or set "
     "max_context on the executor"),
    (lambda: StepTimeExecutor(None), r"step_time must be a function \(StepTotals\) -> seconds, got None"),
    (lambda: StepTimeExecutor(lambda t: .001, 5), r"many must be a function .* or None, got 5"),
    (lambda: StepTimeExecutor(lambda t: .001, max_context=2.5), r"max_context must be an integer in .*, got 2.5"),
])
def test_an_engine_is_refused_a_part_that_is_not_one(make, says):
    with pytest.raises(ValueError, match=says):
        make()


def test_a_memory_manager_that_skipped_the_base_init_is_refused_at_the_door():
    """A new manager (docs/extending.md, section 3) whose own __init__ forgets super().__init__(n_slots)
    is refused by name when the engine is built, not with an AttributeError from inside a run."""
    class Forgot(ReservationMemory):
        def __init__(self, n_slots):
            self.extra = n_slots

    with pytest.raises(ValueError, match=r"memory: Forgot was not set up as a MemoryManager: its __init__ must "
                                         r"call super\(\).__init__\(n_slots\) first"):
        Engine(affine(max_context=64), Forgot(100))


def test_an_executor_s_stages_are_a_count():
    for bad in (0, -1, 2.5, "2"):
        ex = affine()
        ex.n_stages = bad
        with pytest.raises(ValueError, match=r"StepTimeExecutor\.n_stages must be an integer >= 1, got "):
            Engine(ex, UnlimitedMemory(), SchedulerConfig(n_workers=2))


def test_a_refused_engine_leaves_the_callers_memory_manager_as_it_was():
    mem = TokenMemory(100)
    with pytest.raises(ValueError, match="can run out .* needs n_workers=1"):
        Engine(affine(max_context=64), mem, SchedulerConfig(n_workers=2))
    assert mem.default_max_tokens == 8192
    assert Engine(affine(max_context=64), mem).memory.default_max_tokens == 64


@pytest.mark.parametrize("engine_class", [Engine, FastEngine])
def test_a_swapping_memory_on_a_card_without_a_host_link_is_refused_when_the_engine_is_built(engine_class):
    """Else the run stops at its first swap, after the work before it (`api` refuses it alike)."""
    card = dataclasses.replace(get_gpu("h100"), name="no-pcie", host_link_bw=None)
    with pytest.raises(ValueError, match=r"PagedMemory\(preemption='swap'\) swaps K/V over the card's host link, "
                                         r"and 'no-pcie' has none \(GPUSpec.host_link_bw is None\); use "
                                         r"preemption='recompute', or a card with a host link"):
        engine_class(CostModelExecutor("llama-3-8b", card), PagedMemory(40_000, preemption="swap"))
    recompute = engine_class(CostModelExecutor("llama-3-8b", card), PagedMemory(40_000))
    assert recompute.run([Request(0, 0.0, 30, 5)]).n == 1
    assert engine_class(GPU, PagedMemory(40_000, preemption="swap")).memory.swaps


@pytest.mark.parametrize("requests, says", [
    (None, "requests must be a list of Request objects, got None"),
    (Request(0, 0.0, 3, 2), "requests must be a list of Request objects, got Request"),
    ([Request(0, 0.0, 3, 2), (1, 0.0, 3, 2)], "item 1 is"),
    ([renamed([1])], r"req_id must be hashable .* got \[1\] \(list\)"),
    ([Request(0, 0.0, 3, 2), renamed((1, {}))], r"req_id must be hashable"),
])
def test_run_is_refused_what_is_not_a_list_of_requests(requests, says):
    mem = TokenMemory(100)
    eng = Engine(affine(), mem, SchedulerConfig(max_bs=2))
    with pytest.raises(ValueError, match=says):
        eng.run(requests)
    for bad in ("skip", np.array(["raise", "reject"])):
        with pytest.raises(ValueError, match="on_invalid must be 'raise' or 'reject'"):
            eng.run([Request(0, 0.0, 3, 2)], on_invalid=bad)
    with pytest.raises(ValueError, match=r"progress must be a function \(finished, total\) or None, got 3"):
        eng.run([Request(0, 0.0, 3, 2)], progress=3)
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)
    assert eng.run([Request(0, 0.0, 3, 2)]).n == 1


def test_bad_requests_are_refused_and_leave_the_engine_usable():
    engine = Engine(GPU, ReservationMemory(5000, "max"), SchedulerConfig(max_bs=4), max_context=2048)
    good = [Request(0, 0.0, 100, 20), Request(1, 0.1, 50, 10)]
    want = engine.run(good).token_times.copy()
    cases = {
        "request 0: prompt_len + output_len = 2000 + 100 = 2100 exceeds the max context 2048":
            [Request(0, 0.0, 2000, 100)],
        "request 0: max_tokens 3000 exceeds the max context 2048": [Request(0, 0.0, 100, 20, max_tokens=3000)],
        "request 1: arrival_s must be finite and no earlier than the last arrival 1.0 (requests are sorted by "
        "arrival), got 0.5": [Request(0, 1.0, 10, 10), Request(1, 0.5, 10, 10)],
        "duplicate req_id 0: each request's req_id must be unique within a run":
            [Request(0, 0.0, 10, 10), Request(0, 0.1, 10, 10)],
        "no requests to run: give at least one request": [],
    }
    for msg, reqs in cases.items():
        with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
            engine.run(reqs)
        np.testing.assert_array_equal(engine.run(good).token_times, want)
    small = Engine(GPU, ReservationMemory(1000, "max"), SchedulerConfig(max_bs=4), max_context=2048)
    with pytest.raises(ValueError, match=re.escape("request 0 needs 2048 K/V slots (ReservationMemory policy='max') "
                                                   "but n_slots is 1000: it could never be admitted")):
        small.run(good)
    with pytest.raises(ValueError, match=re.escape("request 0 has no predicted_output, which order='spf' needs (see "
                                                   "workload.with_predictions)")):
        Engine(GPU, UnlimitedMemory(), SchedulerConfig(order="spf"), max_context=2048).run(good)
    with pytest.raises(ValueError, match=r"request 0: a prefill \(or, after a preemption, a recompute\) of 100 tokens "
                                         r"can never fit the step budget max_num_batched_tokens=64 \(enable "
                                         r"chunked_prefill\)"):
        Engine(GPU, UnlimitedMemory(), SchedulerConfig(max_bs=4, max_num_batched_tokens=64),
               max_context=2048).run(good)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        Engine(GPU, UnlimitedMemory(), max_context=10**6)


def test_the_step_budget_refuses_only_a_recompute_that_could_never_fit():
    """A preempted request re-feeds its prompt and the tokens it has made: at most all but its
    last, which is never fed. So with a budget of 8, prompt 4 + output 5 runs; output 6 cannot."""
    cfg = SchedulerConfig(max_bs=2, max_num_batched_tokens=8)
    res = Engine(GPU, TokenMemory(40), cfg, max_context=64).run([Request(0, 0.0, 4, 5)])
    assert list(res.output_len) == [5]
    with pytest.raises(ValueError, match=r"recompute\) of 9 tokens can never fit the step budget"):
        Engine(GPU, TokenMemory(40), cfg, max_context=64).run([Request(0, 0.0, 4, 6)])


@pytest.mark.parametrize("bad", [-0.01, math.nan, math.inf, 10**400, True, "x"], ids=lambda v: repr(v)[:12])
@pytest.mark.parametrize("where", ["decode_durations", "step"])
def test_every_duration_must_be_finite_and_non_negative(bad, where):
    def fn(t):
        return bad if (where == "step" or t.n_tokens == t.n_seqs) and t.n_seqs > 1 else .001

    many = (lambda k, c, m: np.full(m, bad)) if where == "decode_durations" else None
    ex = StepTimeExecutor(fn if where == "step" else (lambda t: .001), many, max_context=64)
    mem = TokenMemory(500)
    eng = (FastEngine if where == "decode_durations" else Engine)(ex, mem, SchedulerConfig(max_bs=4))
    reqs = [Request(i, 0.0, 4, 6) for i in range(3)]
    with pytest.raises(RuntimeError, match="finite number >= 0"):
        eng.run(reqs)
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)    # nothing left half-changed
    ok = Engine(affine(), mem, SchedulerConfig(max_bs=4)).run(reqs)
    assert ok.n_steps > 0 and (mem.slots_reserved, mem.slots_used) == (0, 0)


@pytest.mark.parametrize("answer", [.001, np.float64(.001), None, "x"], ids=repr)
def test_a_many_function_that_answers_one_value_is_told_how_many_were_expected(answer):
    ex = StepTimeExecutor(lambda t: .001, lambda k, c, m: answer, max_context=64)
    mem = TokenMemory(500)
    with pytest.raises(RuntimeError, match=r"decode_durations returned \(\) durations, expected \(\d+,\)"):
        FastEngine(ex, mem, SchedulerConfig(max_bs=4)).run([Request(i, 0.0, 4, 6) for i in range(3)])
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)


@pytest.mark.parametrize("field, value, says", [("output_len", 0, "output_len must be an integer >= 1"),
                                                ("prompt_len", 0, "prompt_len must be an integer >= 1"),
                                                ("max_tokens", 3, "max_tokens must be an integer >= prompt_len"),
                                                ("output_len", 2.5, "output_len must be an integer")])
def test_requests_changed_after_construction_are_rechecked_at_submission(field, value, says):
    reqs = [Request(0, 0.0, 4, 3), Request(1, 0.0, 5, 4, max_tokens=20)]
    setattr(reqs[1], field, value)
    eng = Engine(affine(), UnlimitedMemory(), SchedulerConfig())
    with pytest.raises(ValueError, match=says):
        eng.run(reqs)
    res = eng.run(reqs, on_invalid="reject")
    assert [r.req_id for r, _ in res.rejected] == [1] and reqs[1].status is Status.REJECTED
    assert res.n == 1 and len(res.tokens_of(0)) == 3


class ShortTokens(StepTimeExecutor):
    """Returns one token too few per step."""

    def execute(self, batch) -> StepResult:
        return StepResult(.001, [7] * (len(batch.works) - 1))


def test_an_executor_returning_too_few_tokens_is_an_error():
    ex = ShortTokens(lambda t: .001, max_context=64)
    mem = ReservationMemory(500, "oracle")
    with pytest.raises(RuntimeError, match="returned 1 tokens for batch 0, which has 2 works"):
        Engine(ex, mem, SchedulerConfig(max_bs=4)).run([Request(0, 0.0, 4, 3), Request(1, 0.0, 5, 4)])
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)


class ShortLogprobs(StepTimeExecutor):
    """Returns a token per work but log probabilities for one work too few."""

    def execute(self, batch) -> StepResult:
        return StepResult(.001, [7] * len(batch.works), logprobs=[None] * (len(batch.works) - 1))


def test_an_executor_returning_too_few_logprobs_entries_is_an_error():
    """StepResult.logprobs, like its tokens, has one entry per work: too few would pair a request
    with another's log probabilities."""
    ex = ShortLogprobs(lambda t: .001, max_context=64)
    mem = ReservationMemory(500, "oracle")
    with pytest.raises(RuntimeError, match=r"returned 1 logprobs entries for batch 0, which has 2 works: it must "
                                           r"return one per work \(None for a work without\), in order"):
        Engine(ex, mem, SchedulerConfig(max_bs=4)).run([Request(0, 0.0, 4, 3), Request(1, 0.0, 5, 4)])
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)


class AnswersSeconds(StepTimeExecutor):
    """Answers a step with its seconds, not a StepResult."""

    def execute(self, batch):
        return .001


@pytest.mark.parametrize("n_workers", [1, 2])
def test_an_executor_answering_a_step_with_no_step_result_is_told_what_to_answer(n_workers):
    mem = ReservationMemory(500, "oracle")
    with pytest.raises(RuntimeError, match=r"^AnswersSeconds answered batch 0 with 0.001 \(float\): an executor "
                                           r"answers a step with a StepResult\(duration_s, tokens=None\)$"):
        Engine(AnswersSeconds(lambda t: .001, max_context=64), mem,
               SchedulerConfig(max_bs=4, n_workers=n_workers)).run([Request(0, 0.0, 4, 3)])
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)


def test_step_and_result_before_start_or_after_a_failure_say_what_to_do():
    eng = Engine(iteration_clock(), UnlimitedMemory(), SchedulerConfig(max_bs=2), max_context=64)
    not_started = re.escape("no run started: call start(requests), run(requests) or start_live() first")
    with pytest.raises(RuntimeError, match=not_started):
        eng.step()
    with pytest.raises(RuntimeError, match=not_started):
        eng.result()
    bad = Engine(StepTimeExecutor(lambda t: -1.0, max_context=64), ReservationMemory(256, "oracle"),
                 SchedulerConfig(max_bs=2))
    reqs = [Request(i, 0.0, 3, 2) for i in range(3)]
    with pytest.raises(RuntimeError, match=r"the executor returned a step duration of -1.0 s; every duration must "
                                           r"be a finite number >= 0"):
        bad.run(reqs)
    assert bad.memory.slots_reserved == 0 and bad.memory.slots_used == 0
    with pytest.raises(RuntimeError, match="the run stopped on an error and has no result; start a new run"):
        bad.result()
    with pytest.raises(RuntimeError, match="the run stopped on an error and has no result; start a new run"):
        bad.step()
    eng.run(reqs)                      # the same requests serve fine on a healthy engine afterwards
    assert [r.n_generated for r in reqs] == [2, 2, 2]

# ---- a failure mid-run ----------------------------------------------------------------------------

def test_a_progress_callback_that_raises_stops_the_run_with_the_memory_back_at_zero():
    mem = ReservationMemory(3000, "oracle")
    eng = Engine(iteration_clock(), mem, SchedulerConfig(max_bs=4), max_context=2048)
    reqs = [Request(i, 0.0, 4, 1100) for i in range(2)]       # > 1024 steps: progress is called mid-run

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eng.run(reqs, progress=interrupt)
    assert eng.aborted and (mem.slots_reserved, mem.slots_used) == (0, 0)
    with pytest.raises(RuntimeError, match="stopped on an error"):
        eng.result()
    seen = []
    res = eng.run([Request(i, 0.0, 4, 1100) for i in range(2)], progress=lambda d, t: seen.append((d, t)))
    assert res.n == 2 and seen[-1] == (2, 2) and (mem.slots_reserved, mem.slots_used) == (0, 0)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("n_out", [5, 300])                    # a short decode run and a long (numpy) one
def test_finite_steps_that_sum_past_the_largest_float_stop_the_run(fast, n_out):
    ex = StepTimeExecutor(lambda t: 1e307, lambda k, c, m: np.full(m, 1e307), max_context=400)
    mem = TokenMemory(1000)
    eng = (FastEngine if fast else Engine)(ex, mem)
    if n_out < 18:                                              # 5e307: still a float
        assert eng.run([Request(0, 0.0, 3, n_out)]).tokens_of(0)[-1] == pytest.approx(5e307)
        return
    with pytest.raises(RuntimeError, match=r"the run's clock overflows: a step of 1e\+307 s ends past the largest"):
        eng.run([Request(0, 0.0, 3, n_out)])
    assert eng.aborted and (mem.slots_reserved, mem.slots_used) == (0, 0)



@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("executor", [GPU, StepTimeExecutor(lambda t: 0.01, max_context=4096)],
                         ids=["roofline", "step_time"])
def test_an_arrival_so_late_that_a_step_cannot_move_the_clock_stops_the_run_alike(fast, executor):
    eng = (FastEngine if fast else Engine)(executor, ReservationMemory(10**5, "oracle"))
    with pytest.raises(ClockError, match=r"starting at 1e\+308 s on the run's clock ends when it starts"):
        eng.run([Request(0, 0.0, 5, 5), Request(1, 1e308, 5, 5)])

def test_an_arrival_changed_to_an_int_no_float_holds_is_refused_even_when_rejecting():
    r = Request(0, 0.0, 3, 2)
    r.arrival_s = 10**400
    with pytest.raises(ValueError, match="request 0: arrival_s must be finite"):
        Engine(affine(), UnlimitedMemory()).run([Request(1, 0.0, 3, 2), r], on_invalid="reject")


def test_scheduler_and_serving_setups_check_their_flags_and_settings():
    from orca_torch.lab.baselines import FasterTransformerExecutor, fastertransformer_setup

    for make, says in [
            (lambda: SchedulerConfig(static=True, static_idle_seats_cost="no"), "static_idle_seats_cost must be True"),
            (lambda: FasterTransformerExecutor("gpt3-13b", "a100-80gb", control_sync=1), "control_sync must be True"),
            (lambda: FasterTransformerExecutor("gpt3-13b", "a100-80gb", cost_model="refined", control_sync=False),
             "pricer must be a roofline StepPricer .*got a RefinedPricer"),
            (lambda: fastertransformer_setup("gpt3-13b", "a100-80gb", 2, foo=1), r"unknown setting 'foo'=1; allowed: "),
            (lambda: CostModelExecutor("llama-3-8b", "h100", tp=2, flop_eff=0.5), "unknown setting 'flop_eff'=0.5")]:
        with pytest.raises(ValueError, match=says):
            make()


@pytest.mark.parametrize("config", [SchedulerConfig(n_workers=2), SchedulerConfig(static=True)],
                         ids=["pipelined", "static"])
def test_a_live_run_refuses_pipelining_and_static_batching(config):
    eng = Engine(affine(), UnlimitedMemory(), config)
    with pytest.raises(ValueError, match=r"^a live run needs n_workers=1, a synchronous executor and "
                                         r"iteration-level batching \(static=False\)$"):
        eng.start_live()
    assert not eng.started


# ---- one Request object, one run at a time --------------------------------------------------------

def _mid_run(config=None, live=False):
    """An engine part-way through a run of two requests, and the requests."""
    eng = Engine(affine(), UnlimitedMemory(), config)
    reqs = [Request(i, 0.0, 3, 4) for i in range(2)]
    if live:
        eng.start_live()
        for r in reqs:
            eng.add(r)
    else:
        eng.start(reqs)
    eng.step()
    return eng, reqs


@pytest.mark.parametrize("holder", ["offline", "live", "pipelined"])
@pytest.mark.parametrize("taker", ["run", "reject", "add"])
def test_a_request_another_run_still_holds_is_refused_and_that_run_goes_on(holder, taker):
    """Resetting it would silently corrupt the other run: refused whatever `on_invalid` says."""
    eng, reqs = _mid_run(SchedulerConfig(n_workers=2) if holder == "pipelined" else None, live=holder == "live")
    status = reqs[0].status.value
    state = [(r.status, r.n_generated, r.num_computed_tokens) for r in reqs]
    other = Engine(affine(), UnlimitedMemory())
    says = (rf"request 0 is {status} in another engine's run \(Engine\) that is not over: a Request object is one "
            r"run's state and can be in one run at a time; give this run a copy \(dataclasses.replace\(req\)\)")
    with pytest.raises(ValueError, match=says):
        if taker == "add":
            other.start_live()
            other.add(reqs[0])
        else:
            other.run(reqs, on_invalid="raise" if taker == "run" else "reject")
    assert [(r.status, r.n_generated, r.num_computed_tokens) for r in reqs] == state
    while eng.step() is not None:
        pass
    assert [r.n_generated for r in reqs] == [4, 4] and other.run(reqs).n == 2    # free once its run is over


def test_a_live_run_refuses_a_request_it_holds_already_even_renamed():
    eng, reqs = _mid_run(live=True)
    reqs[0].req_id = 7
    with pytest.raises(ValueError, match=r"request 7 is running in this live run: .* one run at a time"):
        eng.add(reqs[0])
    assert eng.step() is not None and reqs[0].n_generated == 2


@pytest.mark.parametrize("ended", ["finished", "aborted"])
def test_a_live_run_refuses_a_request_it_served_already_under_a_new_id(ended):
    """Its entry's tokens and times would be read off the object's new counters: refused, the run
    unchanged; a copy is served."""
    eng, reqs = _mid_run(live=True)
    if ended == "aborted":
        eng.abort(reqs[0])
    while reqs[0].status is not Status.FINISHED and ended == "finished":
        eng.step()
    reqs[0].req_id = 7
    with pytest.raises(ValueError, match=rf"request 7 was added to this live run already and is {ended}: add a "
                                         r"copy under a new req_id \(dataclasses.replace\(req, req_id=...\)\)"):
        eng.add(reqs[0])
    assert len(eng.requests) == 2 and reqs[0].status.value == ended
    again = dataclasses.replace(reqs[0])
    eng.add(again)
    while eng.step() is not None:
        pass
    assert again.n_generated == 4 and eng.requests[2] is again


@pytest.mark.parametrize("ended", [False, True])
def test_a_live_run_refusing_a_request_it_holds_names_a_copy_it_would_take(ended):
    """A copy under the same id is a duplicate in that run: the refusal asks for a new req_id,
    and the copy it describes is served."""
    eng, reqs = _mid_run(live=True)
    while ended and reqs[0].status is not Status.FINISHED:
        eng.step()
    says = "was added to this live run already and is finished: " if ended else "is running in this live run: .*"
    with pytest.raises(ValueError, match=rf"request 0 {says}add a copy under a new req_id "
                                         r"\(dataclasses.replace\(req, req_id=...\)\)"):
        eng.add(reqs[0])
    with pytest.raises(ValueError, match="duplicate req_id 0"):
        eng.add(dataclasses.replace(reqs[0]))
    again = dataclasses.replace(reqs[0], req_id=2)
    eng.add(again)
    while eng.step() is not None:
        pass
    assert again.n_generated == 4 and len(eng.requests) == 3


@pytest.mark.parametrize("call", ["tokens_made", "prompts_completed"])
def test_what_a_live_step_made_needs_a_live_run(call):
    """Which requests a step made a token for (a server's step log) is asked of a live run's step:
    refused before any run and in an offline run, as `forget_done` is."""
    eng = Engine(affine(), UnlimitedMemory())
    with pytest.raises(RuntimeError, match=r"no run started: call start\(requests\), run\(requests\) or start_live"):
        getattr(eng, call)(None)
    eng, reqs = _mid_run()
    with pytest.raises(RuntimeError, match=rf"^{call}\(\) needs a live run: call start_live\(\) first$"):
        getattr(eng, call)(None)
    eng, reqs = _mid_run(live=True)
    batch = eng.step()
    assert getattr(eng, call)(batch) == (reqs if call == "tokens_made" else [])


def test_forget_done_needs_a_live_run_and_leaves_it_without_a_result():
    """Dropping records is a live run's (a server's): refused before any run and in an offline run,
    whose records are its result; a live run that dropped some has no `RunResult`, and says why."""
    eng = Engine(affine(), UnlimitedMemory())
    with pytest.raises(RuntimeError, match=r"no run started: call start\(requests\), run\(requests\) or start_live"):
        eng.forget_done()
    eng, reqs = _mid_run()
    with pytest.raises(RuntimeError, match=r"forget_done\(\) needs a live run: call start_live\(\) first"):
        eng.forget_done()
    while eng.step() is not None:
        pass
    assert eng.result().n == 2                  # the offline run kept every record
    eng, reqs = _mid_run(live=True)
    while eng.step() is not None:
        pass
    assert eng.forget_done() == 2 and eng.requests == []
    with pytest.raises(RuntimeError, match=r"this live run dropped its records of 2 request\(s\) and of its steps "
                                           r"before \(forget_done\), so it has no RunResult"):
        eng.result()


def test_requests_go_free_when_their_run_is_replaced_fails_or_is_dropped():
    """Legitimate reuse: a copy; the same engine starting again; a run stopped by an error (its
    unfinished requests are ABORTED, not left running forever); an engine no longer referenced."""
    eng, reqs = _mid_run()
    copies = [dataclasses.replace(r) for r in reqs] + [copy.copy(r) for r in reqs]
    assert Engine(affine(), UnlimitedMemory()).run(copies[:2]).n == 2
    copies[2].req_id, copies[3].req_id = 2, 3
    assert Engine(affine(), UnlimitedMemory()).run(copies[2:]).n == 2
    assert eng.run(reqs).n == 2 and [r.status for r in reqs] == [Status.FINISHED] * 2   # its own again

    eng, reqs = _mid_run()
    eng.start([reqs[1]])                         # a new run of this engine: reqs[0] is let go, ABORTED
    assert reqs[0].status is Status.ABORTED and reqs[1].status is Status.WAITING
    assert Engine(affine(), UnlimitedMemory()).run([reqs[0]]).n == 1

    bad = Engine(StepTimeExecutor(lambda t: -1.0, max_context=64), UnlimitedMemory())
    reqs = [Request(i, 0.0, 3, 4) for i in range(2)]
    with pytest.raises(RuntimeError, match=r"the executor returned a step duration of -1.0 s; every duration must "
                                           r"be a finite number >= 0"):
        bad.run(reqs)
    assert [r.status for r in reqs] == [Status.ABORTED] * 2
    assert Engine(affine(), UnlimitedMemory()).run(reqs).n == 2

    eng, reqs = _mid_run()
    del eng
    gc.collect()
    assert Engine(affine(), UnlimitedMemory()).run(reqs).n == 2


def test_an_engine_dropped_in_a_reference_cycle_holds_no_request_whenever_the_collector_ran():
    """A pipelined engine and its `Pipeline` refer to each other: dropped mid-run, it stays alive
    until the collector runs. Its requests are free all the same (with the collector off here)."""
    gc.disable()
    try:
        for _ in range(3):                      # (a loop of engines, each dropped mid-run for the next)
            eng, reqs = _mid_run(SchedulerConfig(n_workers=2))
            ref = eng._ref
            del eng
            assert ref() is not None and reqs[0].status is Status.IN_FLIGHT
            assert Engine(affine(), UnlimitedMemory()).run(reqs).n == 2
            assert ref() is None
    finally:
        gc.enable()


def test_a_request_pickles_and_copies_without_its_run():
    eng, reqs = _mid_run()
    back = pickle.loads(pickle.dumps(reqs[0]))
    assert back.owner is None and (back.req_id, back.status, back.n_generated) == (0, Status.RUNNING, 1)
    assert copy.deepcopy(reqs[0]).owner is None and reqs[0].owner() is eng


def test_api_run_copies_so_it_takes_requests_another_run_holds():
    eng, reqs = _mid_run()
    state = [(r.status, r.n_generated) for r in reqs]
    assert api.run(reqs, system="orca-oracle").n == 2
    assert [(r.status, r.n_generated) for r in reqs] == state


def test_the_timeline_of_what_is_no_run_result_says_so():
    from orca_torch.lab.timeline import timeline_chart, timeline_rows

    for call in (timeline_rows, lambda r: timeline_chart(r, "title")):
        with pytest.raises(ValueError, match=r"result must be a RunResult, got None"):
            call(None)


def test_the_timeline_of_a_run_with_a_preemption_and_no_trace_says_it_needs_the_trace():
    """Whether a preempted request came back with a recompute or a decode is in the trace alone."""
    from orca_torch.lab.timeline import timeline_rows

    reqs = [Request(0, 0.0, 10, 10), Request(1, 0.0, 10, 10)]
    res = Engine(iteration_clock(), TokenMemory(24), SchedulerConfig(max_bs=2), max_context=64).run(reqs)
    assert list(res.n_preemptions) == [0, 1]
    with pytest.raises(ValueError, match=r"request 1 was preempted, .* chart a run that kept one \(Engine\(\.\.\., "
                                         r"trace=True\)\)"):
        timeline_rows(res)


def test_a_scheduler_config_takes_a_numpy_string_as_the_str_and_refuses_an_array_of_names():
    c = SchedulerConfig(order=np.str_("spf"), prefill=np.array("prefill_first"))
    assert (type(c.order), type(c.prefill)) == (str, str) and c == SchedulerConfig(order="spf", prefill="prefill_first")
    hash(c)                                         # (frozen: a config is hashable, as its fields are)
    for bad in (np.array(["fcfs", "spf"]), ["spf"]):
        with pytest.raises(ValueError, match=r"order must be 'fcfs' or 'spf' \(shortest predicted first\), got"):
            SchedulerConfig(order=bad)
    with pytest.raises(ValueError, match=r"prefill must be 'mixed' or 'prefill_first', got"):
        SchedulerConfig(prefill=np.array(["mixed"] * 2))


def test_a_many_function_that_times_decodes_apart_from_step_time_is_refused():
    """A `many` one step of context behind `step_time` made the fast engine's run differ from
    `Engine`'s with no error (they are one run where the two agree)."""
    def step_time(t):
        return 0.004 + 1e-5 * t.kv_read_tokens

    def behind(k, ctx_sum, m):
        return 0.004 + 1e-5 * (ctx_sum + k * np.arange(m))

    def right(k, ctx_sum, m):
        return 0.004 + 1e-5 * (ctx_sum + k * (np.arange(m) + 1))

    reqs = [Request(i, 0.0, 4, 6) for i in range(3)]
    mem = TokenMemory(500)
    with pytest.raises(RuntimeError, match=r"^StepTimeExecutor's many\(3, 12, \d+\) timed decode step 0 at 0\.00412 s, "
                                           r"where step_time times that step \(StepTotals\(n_seqs=3, n_tokens=3, "
                                           r"kv_read_tokens=15, .*\)\) at 0\.00415 s: the fast engine prices runs"):
        FastEngine(StepTimeExecutor(step_time, behind, max_context=64), mem, SchedulerConfig(max_bs=4)).run(reqs)
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)
    fast = FastEngine(StepTimeExecutor(step_time, right, max_context=64), mem, SchedulerConfig(max_bs=4)).run(reqs)
    assert fast.step_end.tolist() == Engine(StepTimeExecutor(step_time, max_context=64), mem,
                                            SchedulerConfig(max_bs=4)).run(reqs).step_end.tolist()


class LaunchOverhead(CostModelExecutor):
    """The paper GPU plus a cost per step and per sequence, which decode_durations forgets the second of."""

    def step_time(self, totals):
        return super().step_time(totals) + 1e-3 + 2e-5 * totals.n_seqs

    def decode_durations(self, n_seqs, ctx_sum, m):
        return super().decode_durations(n_seqs, ctx_sum, m) + 1e-3


def test_an_executor_whose_decode_durations_times_decodes_apart_from_its_step_time_is_refused():
    reqs = [Request(i, 0.0, 40, 30) for i in range(3)]
    mem = ReservationMemory(10_000, "oracle")
    with pytest.raises(RuntimeError, match=r"^LaunchOverhead.decode_durations\(3, 120, 29\) timed decode step 0 at "
                                           r"[0-9.]+ s, where step_time times that step \(StepTotals\(n_seqs=3, "):
        FastEngine(LaunchOverhead(), mem, SchedulerConfig(max_bs=4)).run(reqs)
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)


class _AdmitsNobody(Scheduler):
    """A new policy whose own admit leaves every request in the queue."""
    def admit(self, batch, seats, budget):
        pass


class _RunsNobody(Scheduler):
    """A new policy that seats requests but whose own decode gives them no work."""
    def decode(self, batch, decodes):
        pass


@pytest.mark.parametrize("kind", [Engine, FastEngine])
@pytest.mark.parametrize("policy, state, cause, method", [
    (_AdmitsNobody, "3 waiting, 0 running", "no waiting request was admitted", "admit"),
    (_RunsNobody, "1 waiting, 2 running", "no running request was given work", "decode")])
def test_a_new_policy_that_stalls_is_named_with_the_method_of_its_own_to_look_at(kind, policy, state, cause, method):
    """The report named the policy and said what select, decode and admit are for, but not which of
    the policy's own methods left the requests where they are."""
    name = policy.__name__
    with pytest.raises(RuntimeError, match=rf"^{name} stalled: it schedules nothing, nothing more will arrive, and 3 "
                                           rf"requests are unfinished \({state}\) at t=[\d.]+: {cause}; look first "
                                           rf"at its own {name}\.{method}\. A policy's select fills the Batch"):
        kind(GPU, UnlimitedMemory(), SchedulerConfig(max_bs=2), scheduler=policy).run(
            [Request(i, 0.0, 8, 4) for i in range(3)])


@pytest.mark.parametrize("kind", [Engine, FastEngine])
def test_a_stall_with_one_request_unfinished_says_one_request_is(kind):
    """The report said '1 requests are unfinished'."""
    with pytest.raises(RuntimeError, match=r"^_AdmitsNobody stalled: it schedules nothing, nothing more will arrive, "
                                           r"and 1 request is unfinished \(1 waiting, 0 running\) at t="):
        kind(GPU, UnlimitedMemory(), SchedulerConfig(max_bs=2), scheduler=_AdmitsNobody).run(
            [Request(0, 0.0, 8, 4)])


class FailsAStranger(StepTimeExecutor):
    """Fails each step's rows naming a request the step does not hold."""

    def execute(self, batch) -> StepResult:
        raise RowsFailed("a row failed", {"stranger": "its row failed"}, StepResult(.001, [7] * len(batch.works)))


def test_an_executor_failing_rows_of_requests_not_in_the_step_is_told_so():
    """A live run drops the requests `RowsFailed.rows` names: one the step does not hold would be
    dropped by no one (and its row's token taken for another's), so the run stops saying so."""
    eng = Engine(FailsAStranger(lambda t: .001, max_context=64), ReservationMemory(500, "oracle"),
                 SchedulerConfig(max_bs=4))
    eng.start_live()
    eng.add(Request(0, 0.0, 4, 3))
    with pytest.raises(RuntimeError, match=r"^FailsAStranger failed rows of batch 0 naming 'stranger', not a request "
                                           r"of the batch: RowsFailed.rows names requests of the step that failed$"):
        eng.step()
    assert eng.aborted and (eng.memory.slots_reserved, eng.memory.slots_used) == (0, 0)


# ---- refusals of a live run and of a result there is none of ------------------------------------

def test_a_live_run_refuses_a_swapping_memory_manager():
    eng = Engine(affine(), PagedMemory(64, block_size=4, preemption="swap"))
    with pytest.raises(ValueError, match=r"^a live run cannot use a swapping memory manager \(an aborted request's "
                                         r"K/V could sit in host memory\); use preemption='recompute'$"):
        eng.start_live()
    assert not eng.started


@pytest.mark.parametrize("bad, kind", [(None, "NoneType"), (7, "int"), ([Request(0, 0.0, 3, 2)], "list")])
def test_add_refuses_what_is_not_a_request_and_leaves_the_live_run_as_it_was(bad, kind):
    eng = Engine(affine(), UnlimitedMemory())
    eng.start_live()
    with pytest.raises(ValueError, match=rf"^expected a Request, got {kind}$"):
        eng.add(bad)
    assert eng.requests == [] and eng.done and eng.step() is None


def test_result_of_a_run_not_finished_or_with_an_aborted_request_says_why_there_is_none():
    eng = Engine(affine(), UnlimitedMemory())
    eng.start([Request(0, 0.0, 3, 2)])
    with pytest.raises(RuntimeError, match=r"^the run is not finished: call step\(\) until it returns None$"):
        eng.result()
    eng.start_live()
    kept, left = Request(0, 0.0, 3, 2), Request(1, 0.0, 3, 2)
    eng.add(kept)
    eng.add(left)
    eng.abort(left)
    while eng.step() is not None:
        pass
    with pytest.raises(RuntimeError, match=r"^1 request\(s\) of this live run were aborted, so it has no RunResult; "
                                           r"read engine.log \(every step\) instead$"):
        eng.result()
    assert kept.status is Status.FINISHED and len(eng.log.columns()[0]) >= 1


# ---- abort's refusals -------------------------------------------------------------------------------

def test_abort_refuses_what_is_no_request_of_this_live_run_and_the_run_goes_on():
    """`abort` takes the Request object given to `add`: not None, not its id, nor another request
    with its id, nor a request of an offline run."""
    eng, reqs = _mid_run(live=True)
    for bad, says in ((None, r"abort takes the Request given to add, got None \(NoneType\)"),
                      (0, r"abort takes the Request given to add, got 0 \(int\)"),
                      (Request(0, 0.0, 3, 4), "request 0 is not a request of this live run")):
        with pytest.raises(ValueError, match=rf"^{says}$"):
            eng.abort(bad)
    offline, offline_reqs = _mid_run()
    with pytest.raises(ValueError, match="^request 0 is not a request of this live run$"):
        offline.abort(offline_reqs[0])
    for run in (eng, offline):
        while run.step() is not None:
            pass
    assert [r.n_generated for r in reqs + offline_reqs] == [4] * 4 and eng.result().n == 2


@pytest.mark.parametrize("ended", ["finished", "aborted"])
def test_abort_refuses_a_request_that_has_ended(ended):
    eng, reqs = _mid_run(live=True)
    if ended == "aborted":
        eng.abort(reqs[0])
    while reqs[0].status is not Status.FINISHED and ended == "finished":
        eng.step()
    with pytest.raises(ValueError, match=rf"^request 0 is {ended}: only a waiting or running request can be "
                                         "aborted$"):
        eng.abort(reqs[0])
    assert reqs[0].status.value == ended and eng.n_aborted == (ended == "aborted")


def test_abort_refuses_a_request_that_left_for_another_engines_run():
    """A request done in one live run may join another engine's run; the first engine, whose list
    still holds it at the same index, must not abort it there (it ended its own run early, with a
    request still running, and took the other run's request out of its hands)."""
    a, b = Engine(affine(), UnlimitedMemory()), Engine(affine(), UnlimitedMemory(), SchedulerConfig(max_bs=1))
    a.start_live()
    b.start_live()
    other, r = Request(0, 0.0, 3, 6), Request(1, 0.0, 3, 1)
    a.add(other)
    a.add(r)
    a.step()                                    # r finishes in a; other runs on
    assert r.status is Status.FINISHED and other.status is Status.RUNNING
    b.add(Request(5, 0.0, 3, 3))
    b.step()
    b.add(r)                                    # index 1 in b too, as in a
    assert r.run_index == 1 and r.status is Status.WAITING
    with pytest.raises(ValueError, match=r"^request 1 has left this live run for another engine's run \(where it is "
                                         r"waiting\): this engine cannot abort it$"):
        a.abort(r)
    assert r.status is Status.WAITING and not a.done and a.n_aborted == 0
    for run in (a, b):
        while run.step() is not None:
            pass
    assert (other.n_generated, r.n_generated) == (6, 1) and a.result().n == b.result().n == 2


def test_abort_before_a_run_or_after_it_stopped_on_an_error_is_refused_and_changes_nothing():
    with pytest.raises(RuntimeError, match=r"^no run started: call start\(requests\), run\(requests\) or "
                                           r"start_live\(\) first$"):
        Engine(affine(), UnlimitedMemory()).abort(Request(0, 0.0, 3, 2))
    eng, reqs = _mid_run(live=True)

    def fail(batch):
        raise RuntimeError("boom")

    eng.executor.execute = fail
    with pytest.raises(RuntimeError, match="^boom$"):
        eng.step()
    status = reqs[1].status
    with pytest.raises(RuntimeError, match="^the run stopped on an error and has no result; start a new run$"):
        eng.abort(reqs[1])
    assert reqs[1].status is status


class AnswersStageTime(StepTimeExecutor):
    """Answers each step with the stage time it is given (`stage_s`)."""

    def __init__(self, stage_s) -> None:
        super().__init__(lambda t: .001, max_context=64)
        self.stage_s = stage_s

    def execute(self, batch) -> StepResult:
        return StepResult(.001, None, self.stage_s)


@pytest.mark.parametrize("stage_s, shown", [(-1.0, "-1.0"), (math.nan, "nan"), (math.inf, "inf"), ("0.1", "'0.1'"),
                                            (True, "True")])
def test_a_pipelined_step_s_stage_time_that_is_no_finite_number_ge_0_stops_the_run(stage_s, shown):
    mem = ReservationMemory(500, "oracle")
    with pytest.raises(RuntimeError, match=rf"^the executor returned a stage time of {re.escape(shown)} s; it must be "
                                           r"a finite number >= 0$"):
        Engine(AnswersStageTime(stage_s), mem, SchedulerConfig(max_bs=4, n_workers=2)).run([Request(0, 0.0, 4, 3)])
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)
