"""Algorithm 1's decisions, step by step: FCFS, max_bs, stop-don't-skip, policies, pipelining."""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from orca_torch.lab.baselines import static_batching
from orca_torch.core.engine import Engine
from orca_torch.sim.executors import CostModelExecutor
from orca_torch.core.memory import ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.core.request import Request
from orca_torch.core.policies import ChunkedPrefillScheduler
from orca_torch.core.scheduler import Scheduler
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.sim.fast_engine import FastEngine
from orca_torch.lab.timeline import DEMO4_ARRIVALS, DEMO4_OUTPUTS, timeline_chart, timeline_rows
from clocks import iteration_clock

# The lecture's two charts (§4.1, code 02 demo 4).
LECTURE_CONTINUOUS = ["PDDDDD    ", "PDD       ", " PDDDDDDDD", "  ·PD     ", "   ··PDDDD", "      PDD "]
LECTURE_STATIC = ["PDDDDD            ", "PDD---            ", " ·····PDDDDDDDD   ",
                  "  ····PD-------   ", "   ···PDDDD----   ", "      ·········PDD"]


def clock(max_context=512):
    ex = iteration_clock()
    ex.max_context = max_context
    return ex


MAX_ASKS = 100_000
"""More turns of admission's loop (`prompt_share` calls) than any run here takes: past it, admission
goes on past a head that did not fit instead of stopping (stop, don't skip), which loops within one
step for ever (the head is asked again and again)."""


def bounded(engine):
    """`engine`, its scheduler failing once its admission has turned `MAX_ASKS` times, so that a
    scheduler that skips the head fails at once instead of looping."""
    sched = engine.scheduler
    share, asked = sched.prompt_share, [0]

    def prompt_share(req, budget):
        asked[0] += 1
        assert asked[0] <= MAX_ASKS, f"admission asked about {req.req_id} after {MAX_ASKS} asks: it must stop, not skip"
        return share(req, budget)
    sched.prompt_share = prompt_share
    return engine


def run(reqs, config, memory=None, **kw):
    return bounded(Engine(clock(kw.pop("max_context", 512)), memory or UnlimitedMemory(), config, trace=True,
                          **kw)).run(reqs)


def demo_requests(prompt=4):
    return [Request(i, float(a), prompt, o) for i, (a, o) in enumerate(zip(DEMO4_ARRIVALS, DEMO4_OUTPUTS))]


def test_demo4_continuous_batching_takes_10_iterations_as_in_the_lecture():
    res = run(demo_requests(), SchedulerConfig(max_bs=3))
    assert res.n_steps == 10
    assert timeline_rows(res) == LECTURE_CONTINUOUS
    # r3 arrives after r2 but finishes first (exercise 1a): FCFS bounds iterations run, not finish order.
    assert res.last_token_s[3] < res.last_token_s[2]


def test_demo4_static_batching_takes_18_iterations_as_in_the_lecture():
    res = run(demo_requests(), static_batching(3))
    assert res.n_steps == 18
    assert timeline_rows(res) == LECTURE_STATIC
    # Idle seats keep costing: the second batch runs 3 sequences until its last request is done.
    assert list(res.step_n_seqs[6:15]) == [3] * 9
    res2 = run(demo_requests(), static_batching(3, idle_seats_cost=False))
    assert list(res2.step_n_seqs[6:15]) == [3, 3, 2, 2, 2, 1, 1, 1, 1]
    np.testing.assert_array_equal(res.token_times, res2.token_times)


def test_timeline_chart_counts_each_arrival_in_its_own_columns_on_any_clock():
    """The chart's columns are iterations, so a request's arrival is the first iteration that starts at
    or after it: where its row begins (its · or, taken at once, its P). It printed the arrival's clock
    time instead: @30 on an iteration clock that jumped over idle time to the arrival (the chart's
    iteration 3), seconds beside iterations on the paper GPU's clock."""
    reqs = [Request(i, a, 8, o) for i, (a, o) in enumerate(zip((0.0, 1.0, 30.0), (3, 2, 2)))]
    chart = timeline_chart(run(reqs, SchedulerConfig(max_bs=3)), "t").splitlines()
    assert chart[2:] == ["  r0  PDD     arrived @0, last token @2", "  r1   PD     arrived @1, last token @2",
                         "  r2     PD   arrived @3, last token @4"]
    reqs = [Request(i, a, 16, o) for i, (a, o) in enumerate(zip((0.0, 0.0, 0.013, 0.02, 0.3), (4, 6, 3, 2, 2)))]
    res = Engine(CostModelExecutor("llama-3-8b", "h100"), UnlimitedMemory(), SchedulerConfig(max_bs=2)).run(reqs)
    lines = timeline_chart(res, "seconds").splitlines()[2:]
    for row, line in zip(timeline_rows(res), lines):
        begins = len(row) - len(row.lstrip())
        assert line.split("arrived @")[1].startswith(f"{begins},"), (row, line)
    assert any("·" in row for row in timeline_rows(res))          # one of them waited


def test_timeline_chart_keeps_its_columns_past_ten_requests():
    """A row begins where the header's iteration 0 does, r10's as r9's: the labels are padded to the
    widest (r10's row began one column right, under the next iteration)."""
    reqs = [Request(i, float(i), 4, 2) for i in range(12)]
    res = run(reqs, SchedulerConfig(max_bs=3))
    header, *lines = timeline_chart(res, "t").splitlines()[1:]
    assert header == "       " + "".join(str(s % 10) for s in range(res.n_steps))
    assert lines[9].startswith("  r9            PD") and lines[10].startswith("  r10            PD")
    for row, line in zip(timeline_rows(res), lines):
        assert line[len(header) - res.n_steps:].startswith(row)


def test_timeline_chart_names_each_row_by_its_requests_id():
    """A row is named by its request's id (r5 for the id 5, as the lecture names them; a text id as
    it is), not by its place in the run: a run of requests 5 and 9 charted them as r0 and r1."""
    reqs = [Request(5, 0.0, 4, 2), Request(9, 1.0, 4, 2), Request("chat-3", 1.0, 4, 3)]
    lines = timeline_chart(run(reqs, SchedulerConfig(max_bs=3)), "t").splitlines()[2:]
    assert [line.split()[0] for line in lines] == ["r5", "r9", "chat-3"]
    assert len({line.index("P") - i for i, line in zip((0, 1, 1), lines)}) == 1, lines   # one column per iteration


def test_stop_dont_skip_when_the_head_does_not_fit():
    # 1000 slots, oracle reservation: r0 takes 600; r1 needs 500 (no room), r2 needs 100 (would fit).
    reqs = [Request(0, 0.0, 500, 100), Request(1, 0.5, 400, 100), Request(2, 0.5, 50, 50)]
    res = run(reqs, SchedulerConfig(max_bs=8), ReservationMemory(1000, "oracle"), max_context=1024)
    first = res.first_token_s
    assert first[2] == first[1] > res.last_token_s[0]            # r2 waited behind the head, r1
    assert res.steps_of(1)[0] == res.steps_of(0)[-1] + 1        # r1 starts right after r0 frees
    assert res.steps_of(2)[0] == res.steps_of(1)[0]             # r2 joins r1's first step


def test_max_bs_and_reservation_bound_every_step():
    reqs = [Request(i, 0.0, 10, 5 + i) for i in range(10)]
    res = run(reqs, SchedulerConfig(max_bs=4), ReservationMemory(100, "oracle"))
    assert res.step_n_seqs.max() <= 4 and res.step_reserved.max() <= 100
    assert max(len(w) for _, _, _, w in res.trace) == 4


def test_shortest_predicted_first_orders_the_queue():
    reqs = [Request(0, 0.0, 5, 4, predicted_output=4.0), Request(1, 0.5, 5, 9, predicted_output=9.0),
            Request(2, 0.5, 5, 2, predicted_output=2.0), Request(3, 0.5, 5, 6, predicted_output=6.0)]
    fcfs = run(reqs, SchedulerConfig(max_bs=1))
    spf = run(reqs, SchedulerConfig(max_bs=1, order="spf"))
    order = lambda res: list(np.argsort(res.first_token_s, kind="stable"))  # noqa: E731
    assert order(fcfs) == [0, 1, 2, 3]
    assert order(spf) == [0, 2, 3, 1]


class FewestTokensToComeFirst(Scheduler):
    """A new policy that orders the queue its own way: the tokens still to come (the true ones),
    fewest first; equal counts, as here, are left to arrival."""

    def queue_key(self, req):
        return (req.output_len - req.n_generated,)


def test_a_new_policy_orders_the_queue_by_its_queue_key_through_ties_and_preemptions():
    reqs = [Request(0, 0.0, 5, 9), Request(1, 0.5, 5, 6), Request(2, 0.5, 5, 3), Request(3, 0.5, 5, 3),
            Request(4, 0.5, 5, 6)]
    res = run(reqs, SchedulerConfig(max_bs=1), scheduler=FewestTokensToComeFirst)
    assert list(np.argsort(res.first_token_s, kind="stable")) == [0, 2, 3, 1, 4]
    # Memory runs out: r3, preempted twice, comes back with fewer tokens to come than r1 and r4 and
    # goes before them each time (first come, it would go after r1).
    res = run(reqs, SchedulerConfig(max_bs=3), TokenMemory(16), scheduler=FewestTokensToComeFirst)
    assert list(res.n_preemptions) == [0, 0, 0, 2, 1]
    assert [rid for _, _, _, w in res.trace for rid, _, n_past in w if n_past == 0] == [0, 2, 3, 3, 3, 1, 4, 4]
    assert [len(res.tokens_of(i)) for i in range(5)] == [9, 6, 3, 3, 6]


class NewestDecodesAlone(Scheduler):
    """A new policy that decodes only the newest ready request each step (and admits when it preempted no one)."""

    def select(self, batch, ready):
        if ready:
            self.decode(batch, ready[-1:])
        if not batch.preempted:
            self.admit(batch, self.cfg.max_bs - len(ready), self.budget - len(batch.works))


def test_a_step_whose_every_decode_is_preempted_frees_its_victim_and_the_next_step_starts_at_once():
    # 9 slots on demand. Step 0 feeds both prompts (8 slots); step 1 decodes r1 alone (the 9th slot).
    # Step 2 decodes r1 alone again: it cannot grow and is the latest arrival, so it is preempted and
    # the step has no work left. Its slots are free at once: r0 decodes at t=2 in the very next step
    # (no empty step, no waiting), and r1 comes back (prompt 4 + 2 tokens made = 6 slots) once r0 has
    # finished at step 3 and freed its 6.
    reqs = [Request(0, 0.0, 4, 3), Request(1, 0.0, 4, 3)]
    res = run(reqs, SchedulerConfig(max_bs=2), TokenMemory(9), scheduler=NewestDecodesAlone)
    assert [s.works for s in res.trace] == [[(0, 4, 0), (1, 4, 0)], [(1, 1, 4)], [(0, 1, 4)], [(0, 1, 5)],
                                            [(1, 6, 0)]]
    assert list(res.step_start) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert list(res.n_preemptions) == [0, 1]
    assert [len(res.tokens_of(i)) for i in range(2)] == [3, 3]


class EvictsTheEarliest(Scheduler):
    """Preempts the earliest arrival it may, and notes what it was offered."""
    def start(self, requests=None):
        super().start(requests)
        self.offered = []

    def victim(self, candidates):
        self.offered.append((self.n_batches, [r.req_id for r in candidates]))
        return min(candidates, key=self.arrival_order)


@pytest.mark.parametrize("policy", [Scheduler, EvictsTheEarliest])
def test_decode_preempts_the_victim_its_policy_names_among_the_requests_it_has_not_grown(policy):
    # 38 slots on demand, four prompts of 8 (32 slots). Step 1 grows all four (36); in step 2 r0 and
    # r1 grow (38) and r2 does not fit. The candidates are r2 and r3: growing r0 or r1 again would
    # take a slot the step never fills. Scheduler's victim is the latest arrival, r3, after which r2
    # fits; the earliest, r2, leaves r3 to grow in its place.
    reqs = [Request(i, 0.0, 8, 4) for i in range(4)]
    engine = bounded(Engine(clock(), TokenMemory(38), SchedulerConfig(max_bs=4), scheduler=policy, trace=True))
    res = engine.run(reqs)
    evicted = 3 if policy is Scheduler else 2
    assert [w for w in res.trace[2].works] == [(i, 1, 9) for i in range(4) if i != evicted]
    assert list(res.n_preemptions) == [int(i == evicted) for i in range(4)]
    if policy is EvictsTheEarliest:
        assert engine.scheduler.offered == [(2, [2, 3])]


def test_prefill_first_pauses_decodes_and_mixed_does_not():
    reqs = [Request(0, 0.0, 20, 8), Request(1, 2.0, 30, 4), Request(2, 3.0, 30, 4)]
    for mode in ("mixed", "prefill_first"):
        res = run(reqs, SchedulerConfig(max_bs=4, prefill=mode))
        kinds = [{"P" if p == 0 else "D" for _, n, p in w} for _, _, _, w in res.trace]
        if mode == "mixed":
            assert {"P", "D"} in kinds
        else:
            assert all(len(k) == 1 for k in kinds)
            assert res.n_steps == 8 + 2                  # r0 paused for two prefill-only steps


def test_chunked_prefill_respects_the_token_budget():
    reqs = [Request(0, 0.0, 300, 6), Request(1, 0.0, 20, 30), Request(2, 1.0, 150, 3)]
    res = run(reqs, SchedulerConfig(max_bs=4, max_num_batched_tokens=64, chunked_prefill=True))
    assert res.step_n_tokens.max() <= 64
    chunks = [(n, p) for _, _, _, w in res.trace for rid, n, p in w if rid == 0 and p < 300]
    assert sum(n for n, _ in chunks) == 300 and chunks[0] == (64, 0)
    assert [p for _, p in chunks] == list(np.cumsum([0] + [n for n, _ in chunks[:-1]]))
    assert list(res.output_len) == [len(res.tokens_of(i)) for i in range(3)]


class AtMost16TokensOfAPrompt(ChunkedPrefillScheduler):
    """A new policy over chunked prefill: no prompt feeds more than 16 tokens a step."""

    def prompt_share(self, req, budget):
        return min(req.n_to_feed, budget, 16)


def test_chunked_prefill_takes_every_chunk_of_a_prompt_through_prompt_share():
    reqs = [Request(0, 0.0, 40, 2), Request(1, 0.0, 20, 2)]
    res = run(reqs, SchedulerConfig(max_bs=2, max_num_batched_tokens=64, chunked_prefill=True),
              scheduler=AtMost16TokensOfAPrompt)
    chunks = [[(rid, n) for rid, n, p in w if p < reqs[rid].prompt_len] for _, _, _, w in res.trace]
    assert chunks[:3] == [[(0, 16), (1, 16)], [(0, 16), (1, 4)], [(0, 8)]]


def test_pipelining_injects_without_waiting_and_never_doubles_a_request():
    reqs = [Request(0, 0.0, 2, 3), Request(1, 0.0, 2, 3)]
    res = run(reqs, SchedulerConfig(max_bs=1, n_workers=2))
    np.testing.assert_allclose(res.tokens_of(0), [1.0, 2.0, 3.0])
    np.testing.assert_allclose(res.tokens_of(1), [1.5, 2.5, 3.5])
    np.testing.assert_allclose(res.step_start, [0, 0.5, 1.0, 1.5, 2.0, 2.5])
    together = run(reqs, SchedulerConfig(max_bs=2, n_workers=2))
    np.testing.assert_allclose(together.tokens_of(1), [1.0, 2.0, 3.0])


def test_the_timeline_shows_a_preempted_request_waiting_then_recomputed_or_swapped_back_and_in_flight_steps():
    """After a preemption a request waits (·) and comes back with a recompute (R, prompt and tokens
    fed again) or, swapped, a decode (D); in a pipelined run its step is in flight (~) between its
    tokens. The wait showed blank and the recompute D; in flight showed blank, as if not there."""
    from orca_torch.core.paged_memory import PagedMemory
    from orca_torch.lab.plots import CELLS

    charts = {}
    for mode in ("recompute", "swap"):
        reqs = [Request(0, 0.0, 4, 3), Request(1, 0.0, 4, 3)]
        memory = PagedMemory(9, block_size=1, preemption=mode)
        charts[mode] = timeline_rows(run(reqs, SchedulerConfig(max_bs=2), memory, scheduler=NewestDecodesAlone))
    assert charts == {"recompute": ["P·DD ", "PD··R"], "swap": ["P·DD ", "PD··D"]}
    reqs = [Request(0, 0.0, 2, 3), Request(1, 0.0, 2, 3)]
    charts["pipelined"] = timeline_rows(run(reqs, SchedulerConfig(max_bs=1, n_workers=2)))
    assert charts["pipelined"] == ["P~D~D ", "·P~D~D"]
    assert set("".join(r for rows in charts.values() for r in rows)) <= set(CELLS) | {" "}   # the figure's legend


def assert_no_request_in_two_batches_at_once(res):
    spans = defaultdict(list)
    for _, start, end, works in res.trace:
        for rid, _, _ in works:
            spans[rid].append((start, end))
    for rid, s in spans.items():
        s.sort()
        for (a0, a1), (b0, b1) in zip(s, s[1:]):
            assert b0 >= a1 - 1e-12, f"request {rid} in two batches at once: {(a0, a1)} and {(b0, b1)}"


@settings(max_examples=80, deadline=None)
@given(n_workers=st.integers(2, 4), max_bs=st.integers(1, 5),
       reqs=st.lists(st.tuples(st.floats(0, 1.5), st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=12),
       policy=st.sampled_from(["oracle", "max", "unlimited"]),
       mode=st.sampled_from(["mixed", "prefill_first", "chunked"]))
def test_pipelining_properties(n_workers, max_bs, reqs, policy, mode):
    arrivals = np.cumsum([a for a, _, _ in reqs])
    requests = [Request(i, float(t), p, o) for i, (t, (_, p, o)) in enumerate(zip(arrivals, reqs))]
    mem = UnlimitedMemory() if policy == "unlimited" else ReservationMemory(200, policy)
    knobs = ({"max_num_batched_tokens": max_bs + 7, "chunked_prefill": True} if mode == "chunked"
             else {"prefill": mode})
    res = run(requests, SchedulerConfig(max_bs=max_bs, n_workers=n_workers, **knobs), mem, max_context=100)
    assert_no_request_in_two_batches_at_once(res)
    assert all(len(w) <= max_bs for _, _, _, w in res.trace)
    assert [len(res.tokens_of(i)) for i in range(res.n)] == [o for _, _, o in reqs]
    assert res.step_reserved.max() <= 200 or policy == "unlimited"
    in_flight = [(s, e) for _, s, e, _ in res.trace]
    for _, s, _, _ in res.trace:  # at most n_workers batches in flight at any start
        assert sum(1 for a, b in in_flight if a <= s < b) <= n_workers


def test_config_validation():
    with pytest.raises(ValueError, match="max_bs must be an integer >= 1, got 0"):
        SchedulerConfig(max_bs=0)
    with pytest.raises(ValueError, match=r"order must be 'fcfs' or 'spf' \(shortest predicted first\), got 'lifo'"):
        SchedulerConfig(order="lifo")
    with pytest.raises(ValueError, match="prefill must be 'mixed' or 'prefill_first', got 'never'"):
        SchedulerConfig(prefill="never")
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be an integer >= max_bs \(8\) .*, got 4"):
        SchedulerConfig(max_bs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="chunked_prefill needs a token budget: set max_num_batched_tokens"):
        SchedulerConfig(chunked_prefill=True)
    with pytest.raises(ValueError, match=r"chunked_prefill .* cannot be combined with prefill='prefill_first'"):
        SchedulerConfig(max_num_batched_tokens=512, chunked_prefill=True, prefill="prefill_first")
    with pytest.raises(ValueError, match=r"static \(request-level\) batching takes only max_bs: .*; got n_workers=2"):
        SchedulerConfig(static=True, n_workers=2)
    with pytest.raises(ValueError, match="n_workers=1"):
        Engine(clock(), TokenMemory(100), SchedulerConfig(n_workers=2))


def test_the_token_budget_counts_the_decodes_and_a_prompt_may_fill_it_exactly():
    # Budget 10: r0's prompt of 10 fills step 0; then r0's decode leaves 9, so r1's 10 wait for r0 to end.
    reqs = [Request(0, 0.0, 10, 3), Request(1, 0.5, 10, 1)]
    res = run(reqs, SchedulerConfig(max_bs=2, max_num_batched_tokens=10))
    assert list(res.step_n_tokens) == [10, 1, 1, 10]


@pytest.mark.parametrize("kind", [Engine, FastEngine])
def test_spf_after_a_preemption_admits_no_one_then_orders_by_the_tokens_still_to_come(kind):
    # 24 slots: r0 and r1 grow to 12 each; at step 3 r0 cannot grow and r1 (the latest) is preempted.
    # r2 (the SPF head, 2 slots) would fit in what r1 left, but a step that preempts admits no one.
    # Back in the queue r1 has 10 - 3 = 7 tokens to come, so it goes before r3 (8) and, too big to
    # fit beside r0, holds r3 back until r0 is done (stop, don't skip).
    reqs = [Request(0, 0.0, 10, 10, predicted_output=10.0), Request(1, 0.0, 10, 10, predicted_output=10.0),
            Request(2, 2.5, 2, 1, predicted_output=1.0), Request(3, 2.5, 2, 2, predicted_output=8.0)]
    res = bounded(kind(clock(), TokenMemory(24), SchedulerConfig(max_bs=4, order="spf"), trace=True)).run(reqs)
    assert list(res.n_preemptions) == [0, 1, 0, 0]
    assert res.trace[3].works == [(0, 1, 12)]
    assert [(s, rid) for s, _, _, w in res.trace for rid, _, p in w if p == 0] == [(0, 0), (0, 1), (4, 2), (10, 1),
                                                                                   (10, 3)]


def test_chunked_prefill_a_step_that_preempts_admits_no_one_and_feeds_no_chunk_to_its_victim():
    # 24 slots, chunks of 8: step 0 feeds r0's prompt (4) and r1's first chunk (4 of 20), which
    # reserves r1's whole prompt. At step 1 r0 cannot grow, so r1 (the latest) is preempted with its
    # prompt half fed: it gets no chunk that step, and r2 (the SPF head, 2 slots) would fit in what
    # r1 left, but a step that preempts admits no one.
    reqs = [Request(0, 0.0, 4, 10, predicted_output=1.0), Request(1, 0.0, 20, 5, predicted_output=5.0),
            Request(2, 0.5, 2, 1, predicted_output=1.0)]
    config = SchedulerConfig(max_bs=4, order="spf", max_num_batched_tokens=8, chunked_prefill=True)
    engine = bounded(Engine(clock(), TokenMemory(24), config, trace=True))
    engine.start(reqs)
    preempting = 0
    while True:
        before = list(engine.scheduler.running)
        batch = engine.step()
        if batch is None:
            break
        if batch.preempted:
            preempting += 1
            ran = [w.req for w in batch.works]
            assert all(any(r is b for b in before) for r in ran), f"step {batch.index} admitted someone"
            assert not any(r is v for r in ran for v in batch.preempted), f"step {batch.index} fed its victim"
    res = engine.result()
    assert preempting == 1 and list(res.n_preemptions) == [0, 1, 0]
    assert [len(res.tokens_of(i)) for i in range(3)] == [r.output_len for r in reqs]
