"""The fast engine (`sim/fast_engine.py`): runs of decode steps priced and recorded in bulk, equal to
the core engine stepped one iteration at a time, column for column and token time for token time."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from orca_torch.checks import brief
from orca_torch.core.engine import Engine
from orca_torch.core.batch import StepTotals
from orca_torch.core.executor import StepResult
from orca_torch.core.memory import MemoryManager, ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.request import Request
from orca_torch.core.policies import ChunkedPrefillScheduler, PrefillFirstScheduler, StaticScheduler
from orca_torch.core.scheduler import Scheduler
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.core.token_steps import TokenRuns, TokenSteps
from orca_torch.lab.baselines import FasterTransformerExecutor, static_batching
from orca_torch.lab.workload import chat, with_predictions
from orca_torch.sim import fast_engine
from orca_torch.sim.decode_runs import SHORT_RUN, step_ends, steps_to_price
from orca_torch.sim.executors import CostModelExecutor, StepTimeExecutor
from orca_torch.sim.fast_engine import FastEngine
from random_settings import make_memory, random_config
from clocks import iteration_clock

GPU = CostModelExecutor("llama-3-8b", "h100")
GPU_PP = {pp: CostModelExecutor("llama-3-8b", "h100", pp=pp) for pp in (2, 3)}   # stages for pipelined runs


@pytest.mark.parametrize("m", [1, 2, 17, SHORT_RUN, SHORT_RUN + 1, 300])    # both paths
@pytest.mark.parametrize("as_list", [False, True])
def test_step_ends_are_the_step_by_step_sums_cut_at_the_arrival(m, as_list):
    assert 17 < SHORT_RUN < 300
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


@pytest.mark.parametrize("m", [17, 300])                # both paths
@pytest.mark.parametrize("bad", [math.nan, -1.0, math.inf, 1e308, True])
def test_step_ends_check_the_durations_up_to_the_cut_only(m, bad):
    """A duration past the first end at or after `stop_at` belongs to no step of the run (the next
    step is the arrival's): it is not refused, as the engine never prices it; one before is."""
    ds = [0.01] * (m - 2) + [1e308, bad] if bad == 1e308 else [0.01] * (m - 1) + [bad]
    cut = step_ends(ds, m, 0.0, 0.015)
    assert len(cut) == 2 and cut[-1] >= 0.015
    said = "the run's clock overflows" if bad == 1e308 else "finite number >= 0"
    with pytest.raises(RuntimeError, match=said):
        step_ends(ds, m, 0.0, None)


def test_a_step_time_with_no_value_past_an_arrival_that_cuts_the_run_runs_as_the_stepped_engine():
    """One request decodes alone; the second arrives at 100.5 and joins. The fast engine prices a
    couple of steps past the arrival (its guess of where the run ends); the function has no value
    for one sequence decoding at 111-119 stored tokens, which only those steps would have: the run
    equals the stepped one instead of refusing a step it never takes."""
    def fn(t):
        return math.nan if t.n_seqs == 1 and t.n_tokens == 1 and 110 < t.kv_read_tokens < 120 else 1.0

    reqs = [(0, 0.0, 10, 105), (1, 100.5, 300, 60)]
    fast, slow = fast_and_slow(lambda: StepTimeExecutor(fn, max_context=2048), UnlimitedMemory, reqs)
    assert_same_columns(fast, slow)
    assert slow.n_steps == 161


@pytest.mark.parametrize("bad", [True, "slow", 10**400, math.nan], ids=repr)
@pytest.mark.parametrize("many", [False, True])
def test_a_bad_duration_inside_a_decode_run_is_refused_as_the_stepped_engine_refuses_it(bad, many):
    """A step-time function (or its vectorized `many`, as a list) that times the decodes past 20
    stored tokens with something that is no duration: the fast engine prices them in bulk and
    refuses the same value, named as it was given (numpy would read True as 1.0, and a list
    holding a string as strings, the 0.01 before it included)."""
    def fn(t):
        return bad if t.kv_read_tokens > 20 else 0.01

    def fn_many(k, ctx_sum, m):
        return [fn(StepTotals(k, k, ctx_sum + k * (j + 1))) for j in range(m)]

    errors = []
    for kind in (FastEngine, Engine):
        ex = StepTimeExecutor(fn, fn_many if many else None, max_context=64)
        with pytest.raises(RuntimeError, match="every duration must be a finite number >= 0") as e:
            kind(ex, UnlimitedMemory(), max_context=64).run([Request(0, 0.0, 4, 40)])
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    assert f"returned {brief(bad)}" in errors[0] or f"of {brief(bad)} s" in errors[0]


@pytest.mark.parametrize("order", ["fcfs", "spf"])
@pytest.mark.parametrize("memory", [lambda: TokenMemory(100), lambda: UnlimitedMemory()])
def test_steps_taken_in_bulk_trace_as_steps_of_their_own(order, memory):
    """The trace of a decode taken in bulk lists its works in the order a plain step would (a
    memory that can run out serves decodes by arrival, SPF admits out of arrival order)."""
    out = []
    for kind in (Engine, FastEngine):
        reqs = [Request("a", 0.0, 4, 5, predicted_output=9.0), Request("b", 0.0, 4, 5, predicted_output=1.0),
                Request("c", 1.0, 3, 4, predicted_output=2.0)]
        res = kind(iteration_clock(), memory(), SchedulerConfig(max_bs=4, order=order), max_context=64,
                   trace=True).run(reqs)
        out.append(res.trace)
    assert out[0] == out[1]


# ---- runs past finishes, and the collector paused for a simulated run ----------------------------------
def three_at_once():
    return [Request(i, 0.0, 4, o) for i, o in enumerate((3, 7, 12))]


def test_a_decode_run_goes_on_past_finishes_when_no_one_could_take_their_place():
    """Queue empty, memory that cannot run out: one `step()` covers the prefill and every decode
    until the last finish, each request's tokens on consecutive steps and its memory given back
    at its own last step."""
    eng = FastEngine(iteration_clock(), ReservationMemory(1000, "oracle"), SchedulerConfig(max_bs=4), max_context=64)
    eng.start(three_at_once())
    eng.step()
    assert eng.last_run.n_steps == 12 and eng.done and eng.step() is None
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
    eng = FastEngine(iteration_clock(), memory, config, max_context=64)
    eng.start(reqs)
    eng.step()
    assert eng.last_run.n_steps == stop
    while eng.step() is not None:
        pass
    slow = Engine(iteration_clock(), type(memory)(*([100] if why == "memory can run out" else [])), config,
                  max_context=64).run([Request(r.req_id, r.arrival_s, r.prompt_len,
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
    eng = FastEngine(iteration_clock(), memory(), config, max_context=64)
    eng.start([Request(*r) for r in reqs])
    calls = []
    while eng.step() is not None:
        calls.append((eng.last_run.n_steps, [(r.req_id, s) for r, s in eng.last_run.joined]))
    if case in ("a seat frees first", "no room: it waits"):
        assert calls == [(fast.n_steps, [(3, 3)])]  # admitted at the step after the first finish
    elif case == "waits for two finishes":
        assert calls == [(fast.n_steps, [(3, 7)])]
    elif case == "waits from the start":
        assert calls == [(fast.n_steps, [(2, 3), (3, 7)])]
    else:
        assert len(calls) == 1 and calls[0][0] == fast.n_steps and len(calls[0][1]) == len(reqs) - 3


class KeepsItsOwnCounts(MemoryManager):
    """A test manager that counts each request's stored tokens itself (as `TokenMemory` does)."""

    def __init__(self, n_slots):
        super().__init__(n_slots)
        self._kv = {}

    def free(self, r):
        self.slots_reserved -= self._reservations.pop(r.req_id)
        self.slots_used -= self._kv.pop(r.req_id)

    def reset(self):
        super().reset()
        self._kv.clear()


class GrowsIntoAdmission(KeepsItsOwnCounts):
    """Cannot run out (growth never refuses), but what the decodes grow counts against admission."""

    def __init__(self):
        super().__init__(12)

    def reservation(self, r):
        return r.prompt_len + r.n_generated

    def try_admit(self, r):
        if not super().try_admit(r):
            return False
        self._kv[r.req_id] = 0
        return True

    def grow(self, r, n=1):
        self._kv[r.req_id] = kv = self._kv[r.req_id] + n
        extra = max(0, kv - self._reservations[r.req_id])
        self._reservations[r.req_id] += extra
        self.slots_reserved += extra
        self.slots_used += n
        return True


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
        eng = FastEngine(ft(), ReservationMemory(300, "oracle"), config, max_context=2048)
        eng.start([Request(*r) for r in reqs])
        joined = []
        while eng.step() is not None:
            joined += [r.req_id for r, _ in eng.last_run.joined]
        assert joined == [3, 4, 5, 6]           # taken inside a run (6 after it idled: everyone was done)


@pytest.mark.parametrize("tiled", [True, False])
def test_token_runs_noted_in_any_order_are_the_columns_runs(tiled):
    """`RunTokenSteps` notes a request's tokens in a run as three numbers, and keeps the tokens
    written one at a time apart; at the end they are the runs of the column they stand for, the
    fewest (a request's runs that go on from one another are joined, across requests never)."""
    rng = np.random.default_rng(7)
    lens = rng.integers(1, 40, 30).tolist()
    tokens = fast_engine.RunTokenSteps(TokenSteps(lens))
    want = np.zeros(sum(lens), dtype=np.int64)
    starts, counts, slots = [], [], []
    last = -1
    for i, n in enumerate(lens):
        first = tokens.first[i]                 # a request's steps: one after another, now and then one skipped;
        s = last + 1 if i % 4 == 0 else int(rng.integers(0, 1000))   # some start where the one before ended
        want[first:first + n] = s + np.arange(n) + np.cumsum(rng.random(n) < 0.2)
        last = int(want[first + n - 1])
        if not tiled and i % 3 == 0:            # its first token written alone
            tokens.view[first] = int(want[first])
            first, n = first + 1, n - 1
        while n:                                # the rest noted in pieces of consecutive steps
            c = 1
            while c < n and rng.random() < 0.8 and want[first + c] == want[first] + c:
                c += 1
            starts.append(int(want[first])), counts.append(c), slots.append(first)
            first, n = first + c, n - c
    order = rng.permutation(len(starts))        # noted in any order, five runs a call
    for k in range(0, len(order), 5):
        tokens.note_run(*([v[j] for j in order[k:k + 5]] for v in (starts, counts, slots)))
    runs = tokens.made(2000)
    assert isinstance(runs, TokenRuns)
    np.testing.assert_array_equal(runs.column(2000), want.astype(np.uint16))
    fewest = TokenRuns.of_column(want, np.array(tokens.first))
    for name in ("slot", "start", "count"):
        np.testing.assert_array_equal(getattr(runs, name), getattr(fewest, name), err_msg=name)
    assert len(runs.slot) < len(starts) + len(tokens.view)    # pieces were joined


def test_token_runs_that_miss_or_share_a_slot_are_refused():
    tokens = fast_engine.RunTokenSteps(TokenSteps([3, 4]))
    tokens.note_run([7, 20], [3, 3], [0, 3])    # the second request's last token never made
    with pytest.raises(AssertionError, match="cover every slot once"):
        tokens.made(100)
    tokens.note_run([30], [1], [5])             # one slot twice
    with pytest.raises(AssertionError, match="cover every slot once"):
        tokens.made(100)


def test_token_runs_keep_no_column_and_refuse_a_live_runs_growth_by_name():
    """`RunTokenSteps` skips `TokenSteps.__init__` (no column): a live run's `extend` is refused,
    saying why, before it changes anything (FastEngine refuses live runs at the door)."""
    tokens = fast_engine.RunTokenSteps(TokenSteps([3, 4]))
    with pytest.raises(AssertionError, match="no column to extend: FastEngine simulates a known list"):
        tokens.extend(5)
    assert (tokens.first, tokens.n_tokens) == ([0, 3], 7)


def test_a_run_that_admits_goes_on_past_an_idle_stretch_to_the_next_arrival():
    """Everyone done and nobody waiting: the step-by-step loop idles until the next arrival
    (`Engine.next_batch`), and the run takes that step too, starting when the request arrives, so
    one call covers busy stretches far apart; a static batch still ends the call."""
    reqs = [(i, 10.0 * i + 0.25 * (i % 2), 2 + i, 1 + i % 3) for i in range(6)]   # each done before the next
    fast, slow = fast_and_slow(iteration_clock, lambda: ReservationMemory(100, "oracle"), reqs)
    assert_same_columns(fast, slow)
    assert {10.25, 20.0, 50.25} <= set(slow.step_start.tolist())    # (the clock waited for them)
    for config, calls in ((SchedulerConfig(max_bs=4), 1), (static_batching(4), len(reqs))):
        eng = FastEngine(iteration_clock(), ReservationMemory(100, "oracle"), config, max_context=64)
        eng.start([Request(*r) for r in reqs])
        n = 0
        while eng.step() is not None:
            n += 1
        assert n == calls, config
        np.testing.assert_array_equal(eng.result().step_start, slow.step_start)


def state_after_each_step(engine: Engine, reqs) -> dict[int, tuple]:
    """Step index -> (each request's counters and status, the queue, the memory) after the call
    that ended with that step."""
    engine.start([Request(*r) for r in reqs])
    states = {}
    while (batch := engine.step()) is not None:
        sched = engine.scheduler
        n_steps = engine.last_run.n_steps if isinstance(engine, FastEngine) else 1
        states[batch.index + n_steps - 1] = (
            [(r.num_computed_tokens, r.n_generated, r.status) for r in engine.requests],
            sorted(r.req_id for _, r in sched.waiting), [r.req_id for r in sched.running],
            engine.memory.slots_reserved, engine.memory.slots_used)
    return states


WAITING_RUNS = {                                # (max_bs, slots, order): someone waits for most of the run
    "fcfs, seats": (2, 1000, "fcfs"), "fcfs, memory": (8, 40, "fcfs"), "spf, seats": (3, 1000, "spf")}
WAITING_REQS = [(i, 0.4 * i, 2 + i % 5, 1 + (7 * i) % 11, None, float(1 + (5 * i) % 9)) for i in range(14)]


@pytest.mark.parametrize("setting", [*WAITING_RUNS, "two arrive while the seats are full",
                                     "one arrives in the call's last step"])
def test_after_each_call_the_queue_and_every_request_are_as_after_that_step_of_the_step_by_step_run(
        setting, monkeypatch):
    if setting in WAITING_RUNS:
        (max_bs, slots, order), reqs = WAITING_RUNS[setting], WAITING_REQS
    else:                                       # both arrive during the first call, which ends at step 9
        last = 3.5 if setting == "two arrive while the seats are full" else 9.5    # (step 9 runs from 9 to 10)
        (max_bs, slots, order), reqs = (2, 1000, "fcfs"), [(0, 0.0, 2, 10), (1, 0.0, 3, 10), (2, 0.5, 2, 3),
                                                          (3, last, 2, 3)]
        monkeypatch.setattr(fast_engine, "MAX_RUN", 1)      # (one segment a call: else it takes them in)
    config = SchedulerConfig(max_bs=max_bs, order=order)
    engines = [kind(iteration_clock(), ReservationMemory(slots, "oracle"), config, max_context=64)
               for kind in (FastEngine, Engine)]
    fast, slow = (state_after_each_step(e, reqs) for e in engines)
    assert len(fast) < len(slow) // 3           # the fast run took several steps a call
    for step, state in fast.items():
        assert state == slow[step], step
    if setting not in WAITING_RUNS:             # one arriving after step 9 started waits from step 10 on
        assert fast[9][1] == ([2, 3] if last < 9 else [2])


@pytest.mark.parametrize("max_run", [1, 2, 3])
def test_a_run_cut_at_max_run_leaves_its_last_finishers_to_complete(monkeypatch, max_run):
    monkeypatch.setattr(fast_engine, "MAX_RUN", max_run)
    for max_bs, slots, order in WAITING_RUNS.values():
        reqs = WAITING_REQS + [(14, 0.4 * 14, 3, 1, None, 1.0), (15, 0.4 * 14, 2, 1, None, 2.0)]
        fast, slow = fast_and_slow(iteration_clock, lambda: ReservationMemory(slots, "oracle"), reqs,
                                   SchedulerConfig(max_bs=max_bs, order=order))
        assert_same_columns(fast, slow)


class ReadsWorks(StepTimeExecutor):
    """Prices a step from its works, read as a list (a decode run from the same sums' totals)."""

    reads_works = True
    decodes_by_step_time = True

    def __init__(self):
        super().__init__(lambda t: 0.01 + 0.001 * t.n_tokens + 1e-5 * (t.kv_read_tokens - t.n_tokens),
                         max_context=2048)

    def execute(self, batch):
        works = batch.works.copy()
        return StepResult(0.01 + 0.001 * sum(w.n_new for w in works) + 1e-5 * sum(w.n_past for w in works))


def test_an_executor_that_reads_the_works_gets_a_list_inside_a_run_and_one_that_prices_totals_need_not():
    reqs = [(i, 0.01 * t, p, o) for i, t, p, o, _, _ in WAITING_REQS]     # steps of 10-20 ms: they join
    fast, slow = fast_and_slow(ReadsWorks, lambda: ReservationMemory(40, "oracle"), reqs, SchedulerConfig(max_bs=8))
    assert_same_columns(fast, slow)
    untraced = FastEngine(ReadsWorks(), ReservationMemory(40, "oracle"), SchedulerConfig(max_bs=8), max_context=2048)
    np.testing.assert_array_equal(untraced.run([Request(*r) for r in reqs]).step_end, slow.step_end)
    assert CostModelExecutor.reads_works is False and StepTimeExecutor.reads_works is False
    assert FasterTransformerExecutor.reads_works is True


def test_an_arrival_inside_a_run_is_admitted_after_the_decodes_grow_as_in_a_step_of_its_own():
    fast, slow = fast_and_slow(iteration_clock, GrowsIntoAdmission, [(0, 0.0, 4, 6), (1, 2.0, 7, 3)])
    assert_same_columns(fast, slow)


def test_a_static_batch_goes_on_to_its_end_while_requests_wait():
    reqs = [Request(0, 0.0, 4, 50), Request(1, 0.0, 4, 50), Request(2, 0.0, 4, 5)]
    eng = FastEngine(iteration_clock(), ReservationMemory(1000, "oracle"), SchedulerConfig(max_bs=2, static=True),
                     max_context=64)
    eng.start(reqs)
    calls = []
    while eng.step() is not None:
        calls.append(eng.last_run.n_steps)
    assert calls == [50, 5]                     # the first batch in one call, though request 2 waits


COLUMNS = ("step_start", "step_end", "step_n_seqs", "step_n_tokens", "step_reserved", "step_used", "token_step",
           "release_s")


def assert_same_columns(fast, slow):
    for col in COLUMNS:
        np.testing.assert_array_equal(getattr(fast, col), getattr(slow, col), err_msg=col)
    assert fast.trace == slow.trace


def fast_and_slow(make_executor, make_memory, reqs, config=SchedulerConfig(max_bs=4)):
    return [kind(make_executor(), make_memory(), config, max_context=2048, trace=True).run(
        [Request(*r) for r in reqs]) for kind in (FastEngine, Engine)]


class BlockMemory(KeepsItsOwnCounts):
    """No limit, K/V in blocks of 16 slots: the slots reserved grow unevenly, in a way the fast
    engine does not know (`decode_runs.KNOWN_MEMORY`)."""

    def __init__(self):
        super().__init__(None)

    def reservation(self, r):
        return -(-(r.prompt_len + r.n_generated) // 16) * 16

    def try_admit(self, r):
        super().try_admit(r)
        self._kv[r.req_id] = 0
        return True

    def grow(self, r, n=1):
        old, kv = self._reservations[r.req_id], self._kv[r.req_id] + n
        self._reservations[r.req_id] = new = max(old, -(-kv // 16) * 16)
        self._kv[r.req_id] = kv
        self.slots_reserved += new - old
        self.slots_used += n
        return True


def test_a_memory_manager_of_its_own_is_stepped_one_iteration_a_call_and_logged_exactly():
    """A manager the fast engine does not know may grow unevenly: it is not taken in bulk."""
    reqs = [(0, 0.0, 5, 40), (1, 0.0, 9, 3), (2, 0.0, 30, 17), (3, 8.0, 20, 9)]
    fast, slow = fast_and_slow(iteration_clock, BlockMemory, reqs)
    assert_same_columns(fast, slow)
    assert len(set(np.diff(fast.step_reserved))) > 2                       # it did grow unevenly
    eng = FastEngine(iteration_clock(), BlockMemory(), SchedulerConfig(max_bs=4), max_context=2048)
    eng.start([Request(*r) for r in reqs])
    calls = 0
    while eng.step() is not None:
        calls += 1
        assert eng.last_run.n_steps == 1
    assert calls == fast.n_steps


def test_an_executor_that_prices_steps_its_own_way_is_taken_in_bulk_with_its_own_times():
    class HostWork(CostModelExecutor):          # the paper GPU plus 1 ms of host work a step
        decodes_by_step_time = True

        def execute(self, batch):
            return StepResult(self.step_time(batch.totals))

        def step_time(self, totals):
            return super().step_time(totals) + 1e-3

        def decode_durations(self, k, ctx_sum, m):
            return super().decode_durations(k, ctx_sum, m) + 1e-3

    fast, slow = fast_and_slow(HostWork, UnlimitedMemory, [(0, 0.0, 16, 10), (1, 0.0, 16, 30), (2, 0.05, 8, 90)])
    assert_same_columns(fast, slow)
    assert fast.n_steps > 40                    # (several runs of decodes, each taken in one call:)
    eng = FastEngine(HostWork(), UnlimitedMemory(), SchedulerConfig(max_bs=8))
    eng.start([Request(0, 0.0, 16, 40)])
    eng.step()
    assert eng.last_run.n_steps == 40


def test_an_execute_that_adds_a_cost_without_saying_so_runs_one_step_a_call_and_right():
    """A subclass whose `execute` adds 2 ms a step, `step_time` left alone: the bulk path (priced by
    `step_time`) would miss the 2 ms on every decode it takes, so the run goes one step a call."""
    class HostOverhead(CostModelExecutor):
        def execute(self, batch):
            return StepResult(super().execute(batch).duration_s + 2e-3)

    reqs = [(i, 0.0, 50, 200) for i in range(4)]
    fast, slow = fast_and_slow(HostOverhead, UnlimitedMemory, reqs)
    assert_same_columns(fast, slow)
    assert slow.step_end[-1] > 200 * 2e-3


def test_a_cost_added_in_step_time_alone_runs_one_step_a_call_and_right():
    """`step_time` overridden but not `decode_durations`, which the bulk path prices by: stepped."""
    class SlowerSteps(CostModelExecutor):
        def step_time(self, totals):
            return super().step_time(totals) + 1e-3

    fast, slow = fast_and_slow(SlowerSteps, UnlimitedMemory, [(i, 0.0, 50, 150) for i in range(4)])
    assert_same_columns(fast, slow)


@pytest.mark.parametrize("policy, knobs", [(PrefillFirstScheduler, {}), (StaticScheduler, {}),
                                           (ChunkedPrefillScheduler, {})])
def test_one_of_the_project_s_policies_on_other_knobs_is_run_as_itself(policy, knobs):
    """A policy given as `scheduler=` that is not the one the config's knobs name: the fast engine's
    shortcuts read the knobs, so it steps the run, to the same result as `Engine`."""
    config = SchedulerConfig(max_bs=8, max_num_batched_tokens=2048 if policy is ChunkedPrefillScheduler else None,
                             **knobs)
    reqs = chat(n_requests=60, rate=16.0, seed=4, max_context=2048)
    runs = [kind(GPU, ReservationMemory(400_000, "oracle"), config, max_context=2048, scheduler=policy,
                 trace=True).run(reqs) for kind in (FastEngine, Engine)]
    assert_same_run(*runs)


def test_a_new_policy_runs_in_both_engines_and_the_fast_one_takes_it_a_step_a_call():
    """A `Scheduler` subclass given as `scheduler=`: one admission a step. The fast engine's
    shortcuts were written for the project's own policies, so it steps this one, to the same run."""
    class OneAdmissionPerStep(Scheduler):
        def select(self, batch, ready):
            if ready:
                self.decode(batch, ready)
            if not batch.preempted:
                self.admit(batch, min(1, self.cfg.max_bs - len(ready)), self.budget - len(batch.works))

    runs = [kind(GPU, ReservationMemory(10_000, "oracle"), SchedulerConfig(max_bs=8), scheduler=OneAdmissionPerStep,
                 trace=True).run([Request(i, 0.0, 100, 50) for i in range(8)]) for kind in (FastEngine, Engine)]
    assert_same_run(*runs)
    prefills = [sum(n_past == 0 for _, _, n_past in step.works) for step in runs[0].trace]
    assert prefills[:8] == [1] * 8
    class NeverAdmits(Scheduler):
        def select(self, batch, ready):
            pass
    for kind in (FastEngine, Engine):
        mem = ReservationMemory(10_000, "oracle")
        with pytest.raises(RuntimeError, match=r"NeverAdmits stalled: it schedules nothing, nothing more will "
                                               r"arrive, and 2 requests are unfinished \(2 waiting, 0 running\)"):
            kind(GPU, mem, scheduler=NeverAdmits).run([Request(i, 0.0, 10, 5) for i in range(2)])
        assert (mem.slots_reserved, mem.slots_used) == (0, 0)
    with pytest.raises(ValueError, match="scheduler must be a Scheduler subclass"):
        Engine(GPU, UnlimitedMemory(), scheduler=OneAdmissionPerStep(SchedulerConfig(), UnlimitedMemory()))


class EvictsTheMostToCome(Scheduler):
    """Preempts the candidate with the most tokens still to make (the latest arrival among equals)."""
    def victim(self, candidates):
        return max(candidates, key=lambda r: (r.output_len - r.n_generated,) + self.arrival_order(r))


@pytest.mark.parametrize("memory", [lambda: TokenMemory(6000), lambda: PagedMemory(6000),
                                    lambda: PagedMemory(6000, preemption="swap", watermark_blocks=0)],
                         ids=["token", "paged", "paged-swap"])
def test_a_policy_with_a_victim_of_its_own_runs_in_both_engines_alike_and_evicts_its_own(memory):
    """The fast engine steps a policy it does not know (its bulk runs never preempt: `decode_room`
    ends them before a decode would not fit), so a victim of the policy's own gives the stepped
    engine's run, token time for token time; and the victims are its own, not the latest arrivals."""
    reqs = chat(n_requests=60, rate=16.0, seed=4, max_context=2048)
    own, stepped, latest = (kind(GPU, memory(), SchedulerConfig(max_bs=16), max_context=2048, scheduler=policy,
                                 trace=True).run(reqs)
                            for kind, policy in ((FastEngine, EvictsTheMostToCome), (Engine, EvictsTheMostToCome),
                                                 (FastEngine, None)))
    assert_same_run(own, stepped)
    assert own.n_preemptions.sum() and latest.n_preemptions.sum()
    assert not np.array_equal(own.n_preemptions, latest.n_preemptions)


@pytest.mark.parametrize("idle_seats_cost", [True, False])
def test_a_static_batch_is_one_call_from_its_prefill_to_its_last_finish(idle_seats_cost):
    config = SchedulerConfig(max_bs=4, static=True, static_idle_seats_cost=idle_seats_cost)
    eng = FastEngine(iteration_clock(), ReservationMemory(1000, "oracle"), config, max_context=64)
    eng.start(three_at_once() + [Request(3, 0.5, 2, 2)])
    eng.step()
    assert eng.last_run.n_steps == 12            # the late request waits for the whole batch
    eng.step()
    assert eng.last_run.n_steps == 2
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

    def run(ex, kind=FastEngine):
        return kind(ex, UnlimitedMemory(), SchedulerConfig(max_bs=4), max_context=64).run(three_at_once())

    assert gc.isenabled()
    run(StepTimeExecutor(step_time, max_context=64))
    assert seen and not any(seen) and gc.isenabled()

    seen.clear()
    run(StepTimeExecutor(step_time, max_context=64), Engine)      # the plain engine (torch's) keeps it

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


# ---- the fast engine equals the stepped core on random workloads and settings ----------------------------
workloads = st.lists(st.tuples(st.floats(0, 0.05), st.integers(1, 900), st.integers(1, 60)), min_size=1, max_size=30)
RESULT_COLUMNS = ("token_offsets", "token_step", "release_s", "n_preemptions", "step_start", "step_end",
                  "step_n_seqs", "step_n_tokens", "step_reserved", "step_used")


def assert_same_run(fast, slow):
    for col in RESULT_COLUMNS:
        a, b = getattr(fast, col), getattr(slow, col)
        np.testing.assert_array_equal(a, b, err_msg=col)
        assert a.dtype == b.dtype, col
    assert_same_token_runs(fast, slow)
    np.testing.assert_array_equal(fast.token_times, slow.token_times)
    assert fast.trace == slow.trace


def assert_same_token_runs(fast, slow):
    """The fast engine's token runs (kept as runs, no column) are those of the stepped engine's column."""
    for name in ("slot", "start", "count"):
        np.testing.assert_array_equal(getattr(fast.token_runs, name), getattr(slow.token_runs, name), err_msg=name)
    for col in ("first_token_step", "last_token_step", "first_token_s", "last_token_s"):
        np.testing.assert_array_equal(getattr(fast, col), getattr(slow, col), err_msg=col)


def random_requests(reqs) -> list[Request]:
    arrivals = np.cumsum([a for a, _, _ in reqs])
    return with_predictions([Request(i, float(t), p, o) for i, (t, (_, p, o)) in enumerate(zip(arrivals, reqs))],
                            0.5, seed=1)


MEMORIES = ["max", "pow2", "oracle", "ondemand", "unlimited", "paged", "paged-swap"]


def random_memory(kind: str, n_slots: int, block_size: int):
    if kind == "paged":
        return PagedMemory(n_slots, block_size=block_size)
    if kind == "paged-swap":
        return PagedMemory(n_slots, block_size=block_size, preemption="swap", watermark_blocks=0)
    return make_memory(kind, n_slots, 1024)


@settings(max_examples=150, deadline=None)
@given(reqs=workloads, memory=st.sampled_from(MEMORIES), slack=st.integers(0, 6000),
       block_size=st.sampled_from([1, 16]), max_bs=st.integers(1, 12),
       budget=st.sampled_from([None, "whole", "chunked"]), prefill=st.sampled_from(["mixed", "prefill_first"]),
       order=st.sampled_from(["fcfs", "spf"]), static=st.booleans(), n_workers=st.integers(1, 3),
       clock=st.sampled_from(["gpu", "iterations"]))
def test_the_fast_engine_equals_the_stepped_engine_on_random_workloads_and_settings(
        reqs, memory, slack, block_size, max_bs, budget, prefill, order, static, n_workers, clock):
    requests = random_requests(reqs)
    if clock == "iterations":                   # arrivals in iterations: spread them over the steps
        for r in requests:
            r.arrival_s = float(int(r.arrival_s * 400))
    runs_out = memory in ("ondemand", "paged", "paged-swap")
    if static:
        memory = "oracle" if runs_out else memory
    config = random_config(max_bs, static, budget, prefill, order=order, n_workers=1 if runs_out else n_workers)
    longest = max(r.total_len for r in requests)
    n_slots = longest + 16 + slack // 4 if runs_out and not static else 1024 + slack
    out = []
    for kind in (FastEngine, Engine):
        ex = iteration_clock() if clock == "iterations" else GPU_PP.get(config.n_workers, GPU)
        out.append(kind(ex, random_memory(memory, n_slots, block_size), config, max_context=1024,
                        trace=True).run(requests))
    assert_same_run(*out)


@settings(max_examples=60, deadline=None)
@given(reqs=workloads, max_bs=st.integers(1, 40), policy=st.sampled_from(["max", "oracle", "ondemand"]),
       slots=st.integers(1500, 20000), order=st.sampled_from(["fcfs", "spf"]))
def test_the_fast_engine_equals_step_by_step_exactly_untraced(reqs, max_bs, policy, slots, order):
    requests = random_requests(reqs)
    a, b = (kind(GPU, make_memory(policy, slots, 1024), SchedulerConfig(max_bs=max_bs, order=order),
                 max_context=1024).run(requests) for kind in (FastEngine, Engine))
    assert a.trace is None
    for col in RESULT_COLUMNS:
        np.testing.assert_array_equal(getattr(a, col), getattr(b, col), err_msg=col)


# ---- the same at the edges: tight pools, odd blocks, small budgets, pipelines, late clocks ----------------
EDGE_MEMORIES = ["paged-swap", "paged", "ondemand"] * 2 + ["max", "pow2", "oracle", "unlimited"]   # (most can run out)
EDGE_STEPS = [("mixed", None, False), *(("mixed", b, True) for b in (1, 2, 3, 7, 16, 64)), ("mixed", 7, False),
              ("prefill_first", None, False), ("prefill_first", 64, False), ("prefill_first", 1000, False)]
"""(prefill, max_num_batched_tokens, chunked_prefill): budgets down to 1 token, chunked, or whole (the
longer prompts then rejected)."""
EDGE_EXECUTORS = {(cost, pp): CostModelExecutor("llama-3-8b", "h100", pp=pp, **knobs) for cost, knobs in
                  (("roofline", {}), ("refined", {"cost_model": "refined", "attention_tile": 3, "overhead_s": 1e-3}))
                  for pp in (1, 2, 3, 4)}
edge_workloads = st.lists(st.tuples(
    st.one_of(st.floats(0, 0.05), st.sampled_from([0.0, 0.001, 0.5, 3.0])),              # the gap before it
    st.one_of(st.sampled_from([1, 2, 3, 7, 15, 16, 17, 31, 100]), st.integers(1, 120)),   # its prompt
    st.integers(1, 45), st.booleans(),                  # its output; a string id (else an int)
    st.sampled_from([None, 0, 1, 5]),                   # max_tokens past its length (None: the context)
    st.sampled_from([None, 0.5, 1.0, 5.5, 100.0])),     # a prediction of its own (None: drawn)
    min_size=2, max_size=12)


def edge_requests(specs, offset: float, sigma: float) -> list[Request]:
    """Requests from `offset` on, ids of both kinds; those without a prediction of their own get one
    drawn with `sigma` (as `api.run` fills them for `order="spf"`)."""
    t, reqs = offset, []
    for i, (gap, p, o, named, extra, predicted) in enumerate(specs):
        t += gap
        reqs.append(Request(f"r{i}" if named else i, t, p, o, None if extra is None else p + o + extra, predicted))
    for r, drawn in zip(reqs, with_predictions(reqs, sigma, seed=len(reqs))):
        if r.predicted_output is None:
            r.predicted_output = drawn.predicted_output
    return reqs


class PagedOfItsOwn(PagedMemory):
    """Paged memory as a class of the user's own (`api.run(memory=...)`): the fast engine knows
    managers by their exact type, so it steps this one, to the same run."""


def edge_memory(kind: str, n_slots: int, block_size: int, watermark: int | None, cpu_blocks: int | None,
                max_context: int, own: bool = False) -> MemoryManager:
    if kind in ("paged", "paged-swap"):
        swap = kind == "paged-swap"
        return (PagedOfItsOwn if own else PagedMemory)(
            n_slots, block_size=block_size, preemption="swap" if swap else "recompute",
            cpu_blocks=cpu_blocks if swap else None, watermark_blocks=watermark)
    return make_memory(kind, n_slots, max_context)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(specs=edge_workloads, offset=st.sampled_from([0.0, 5.0, 1.7e9]), sigma=st.sampled_from([0.0, 0.5, 2.0]),
       memory=st.sampled_from(EDGE_MEMORIES), block_size=st.sampled_from([3, 1, 2, 16]),
       watermark=st.sampled_from([None, 0]), cpu_blocks=st.sampled_from([None, 1, 3]), own=st.booleans(),
       extra=st.sampled_from([0, 1, 2, 3, 16, -1, 400]), max_bs=st.sampled_from([4, 6, 2, 3, 1]),
       steps=st.sampled_from(EDGE_STEPS), order=st.sampled_from(["fcfs", "spf"]), n_workers=st.integers(1, 4),
       pp=st.sampled_from([2, 3, 4]), clock=st.sampled_from(["iterations", "roofline", "refined"]),
       max_context=st.sampled_from([256, 1024]), trace=st.booleans())
def test_the_fast_engine_equals_the_stepped_engine_in_tight_pools_small_budgets_and_pipelines(
        specs, offset, sigma, memory, block_size, watermark, cpu_blocks, own, extra, max_bs, steps, order,
        n_workers, pp, clock, max_context, trace):
    """Where the random settings above stop short: a pool just at (or a unit under, or a little over)
    what the largest request needs to finish, in slots or in blocks of 1, 2, 3 or 16, so that
    requests are preempted often, recomputed or swapped (to a CPU pool that may be full), in a
    manager the fast engine knows or one of the user's own; step budgets down to 1 token; up to 4
    workers on 2-4 stages; arrivals together, at 0, seconds apart or at 1.7e9 s; ids of both kinds;
    `max_tokens`; SPF's predictions drawn or given; the refined cost model. Requests that could
    never run are rejected, by both alike, and the swaps are the same."""
    def requests():
        return edge_requests(specs, offset, sigma)

    runs_out = memory in ("ondemand", "paged", "paged-swap")
    unit = block_size if memory.startswith("paged") else 1
    need = max(map(edge_memory(memory, 1 << 30, block_size, 0, None, max_context).need_to_finish, requests()))
    prefill, budget, chunked = steps
    config = SchedulerConfig(max_bs=max_bs, order=order, prefill=prefill, n_workers=1 if runs_out else n_workers,
                             max_num_batched_tokens=None if budget is None else max(budget, max_bs),
                             chunked_prefill=chunked)
    ex = iteration_clock() if clock == "iterations" else EDGE_EXECUTORS[clock, pp if config.n_workers > 1 else 1]
    out = []
    for kind in (FastEngine, Engine):
        mem = edge_memory(memory, max(1, need + extra) * unit, block_size, watermark, cpu_blocks, max_context, own)
        res = kind(ex, mem, config, max_context=max_context, trace=trace).run(requests(), on_invalid="reject")
        out.append((res, [(r.req.req_id, r.why) for r in res.rejected], getattr(mem, "stats", None),
                    getattr(ex, "swap_s", None)))
    (fast, *fast_rest), (slow, *slow_rest) = out
    assert_same_run(fast, slow)
    assert fast_rest == slow_rest


def test_the_fast_engine_takes_a_priced_executor_only():
    from orca_torch.core.executor import Executor

    with pytest.raises(ValueError, match="executor must be a PricedExecutor"):
        FastEngine(Executor(), UnlimitedMemory(), max_context=64)


@pytest.mark.parametrize("flush", [3, 1 << 17])
def test_run_step_log_fills_its_columns_as_the_step_log_assembles_chunks(monkeypatch, flush):
    """`RunStepLog` writes each flush straight into columns that grow, not chunks joined at the end:
    the same columns and dtypes as `StepLog` given the same steps one at a time, an int column
    becoming int64 once a value leaves int32 (here in a late flush), the empty log included, and a
    segment's reserved slots listed step by step (blocks) in a later flush too; columns read part-way
    and held stay as they were read."""
    from orca_torch.core.step_log import StepLog

    monkeypatch.setattr(StepLog, "FLUSH", flush)
    assert [c.dtype for c in fast_engine.RunStepLog().columns()] == [c.dtype for c in StepLog().columns()]
    fast, ref = fast_engine.RunStepLog(), StepLog()
    t = 0.0
    for i in range(40):
        if i % 3:
            ends = [t + 0.5 * (j + 1) for j in range(i % 5 + 1)]
            used = 2**31 + i if i == 37 else 10 * i
            uneven = [100 + i + 16 * (j // 2) for j in range(len(ends))] if i % 3 == 2 else None   # (blocks)
            fast.add_run(t, ends, 4, 100 + i, 2, used, 4, uneven)
            for j, end in enumerate(ends):
                ref.add(t, end, 4, 4, 100 + i + 2 * j if uneven is None else uneven[j], used + 4 * j)
                t = end
        else:
            fast.add(t, t + 1.0, 3, 7, 50 + i, 40 + i)
            ref.add(t, t + 1.0, 3, 7, 50 + i, 40 + i)
            t += 1.0
        if i == 20:                             # read part-way, as a live run may, then go on
            held = fast.columns()               # (views kept: the columns then go on in copies)
            early = [c.copy() for c in ref.columns()]
            for got, want in zip(held, early):
                np.testing.assert_array_equal(got, want)
    cols = fast.columns()
    for got, want in zip(cols, ref.columns()):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype
    for got, want in zip(held, early):          # what was read part-way is as it was
        np.testing.assert_array_equal(got, want)
    assert [c.dtype for c in cols[2:]] == [np.int32] * 3 + [np.int64]
    assert not fast.chunks or flush > 40        # nothing to join: the columns were filled in place


def test_a_live_run_is_refused_with_the_engine_to_use():
    eng = FastEngine(CostModelExecutor("tiny", "h100"), ReservationMemory(1000, "max"), max_context=64)
    for call in (eng.start_live, lambda: eng.add(Request(0, 0.0, 4, 4)), lambda: eng.abort(Request(0, 0.0, 4, 4)),
                 eng.forget_done):
        with pytest.raises(ValueError, match=r"a live run \(start_live, add, abort, forget_done\) needs Engine"):
            call()
    eng.start([Request(0, 0.0, 4, 4)])          # an offline run refuses them too, and goes on
    with pytest.raises(ValueError, match="needs Engine"):
        eng.add(Request(1, 0.0, 4, 4))
    assert eng.run([Request(0, 0.0, 4, 4)]).n == 1


def test_a_run_whose_first_step_takes_no_time_prices_every_step():
    """A first step of 0 s says nothing of how many steps reach the arrival: all of them are priced
    (as for a duration that is no number), not divided by zero."""
    assert steps_to_price(10, 0.0, 0.0, 5.0) == 10
    assert steps_to_price(10, float("nan"), 0.0, 5.0) == 10
    assert steps_to_price(10, 1.0, 0.0, None) == 10
