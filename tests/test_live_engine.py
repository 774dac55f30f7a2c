"""A live run: requests added to a running engine join at the next iteration, and an aborted one
gives its reservation and K/V back at once (what a server needs of the core, lecture §4.1)."""
from __future__ import annotations

import numpy as np
import pytest

from orca_torch.core.engine import Engine
from orca_torch.core.memory import ReservationMemory
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.request import Request, Status
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.core.token_steps import MAX_STEPS
from orca_torch.model.paged_kv_cache import PagedKVManager
from orca_torch.model.torch_executor import TorchExecutor
from tiny_model import MODEL, alone

RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(0, MODEL.spec.vocab, size=n).tolist() for n in (7, 12, 5, 9)]


def req(i, t, n_out, prompt=None):
    prompt = PROMPTS[i % len(PROMPTS)] if prompt is None else prompt
    return Request(i, t, len(prompt), n_out, max_tokens=len(prompt) + n_out, prompt_ids=prompt)


def live(max_bs=4, n_slots=512, paged=False):
    if paged:
        kv = PagedKVManager(MODEL.spec, n_slots // 16, block_size=16)
        mem = PagedMemory(n_slots, block_size=16)
    else:
        kv, mem = MODEL.new_kv(n_slots), ReservationMemory(n_slots, "max")
    engine = Engine(TorchExecutor(MODEL, kv, clock="iterations"), mem, SchedulerConfig(max_bs=max_bs), trace=True)
    engine.start_live()
    return engine, kv


def two_running():
    """A live run one step into two requests of 6 tokens, both running: the engine, its K/V and the two."""
    engine, kv = live()
    a, b = req(0, 0.0, 6), req(1, 0.0, 6)
    engine.add(a)
    engine.add(b)
    engine.step()
    return engine, kv, a, b


def raising(message):
    """A stand-in for an executor's method that fails with RuntimeError(message)."""
    def fail(*args):
        raise RuntimeError(message)
    return fail


def test_added_requests_join_the_running_batch_and_match_generation_alone():
    engine, kv = live()
    a, b = req(0, 0.0, 6), req(1, 0.0, 3)
    engine.add(a)
    for _ in range(3):
        engine.step()
    assert engine.done is False
    engine.add(b)                                 # arrives while `a` decodes: joins the next iteration
    batch = engine.step()
    assert [(r.req_id, n, p) for r, n, p in batch.works] == [(0, 1, 9), (1, 12, 0)]
    while engine.step() is not None:
        pass
    assert engine.done and a.status is Status.FINISHED and b.status is Status.FINISHED
    assert a.output_ids == alone(PROMPTS[0], 6) and b.output_ids == alone(PROMPTS[1], 3)
    res = engine.result()                         # a live run without aborts has its RunResult
    assert res.n == 2 and list(res.output_len) == [6, 3] and res.n_steps == 6
    assert list(res.steps_of(1)) == [3, 4, 5]
    assert engine.memory.slots_reserved == 0 and kv.slots_reserved == 0


def test_the_clock_moves_up_to_a_later_arrival():
    engine, _ = live()
    engine.add(req(0, 0.0, 2))
    engine.step()
    engine.add(req(1, 10.0, 2))
    assert engine.t == 10.0
    batch = engine.step()
    assert {r.req_id for r, _, _ in batch.works} == {0, 1}
    with pytest.raises(ValueError, match="no earlier than the last arrival"):
        engine.add(req(2, 5.0, 2))


def test_the_clock_does_not_go_back_to_an_arrival_behind_it():
    engine, _ = live()
    engine.add(req(0, 0.0, 4))
    engine.step()
    engine.step()
    assert engine.t == 2.0
    engine.add(req(1, 1.0, 2))                    # no earlier than the last arrival, but behind the clock
    assert engine.t == 2.0
    batch = engine.step()
    assert engine.trace_steps[-1].start == 2.0 and [r.req_id for r, _, _ in batch.works] == [0, 1]


@pytest.mark.parametrize("paged", [False, True])
def test_abort_frees_reservation_and_kv_at_once(paged):
    engine, kv = live(paged=paged)
    a, b, c = req(0, 0.0, 20), req(1, 0.0, 20), req(2, 0.0, 4)
    for r in (a, b, c):
        engine.add(r)
    engine.step()
    engine.step()
    mem_before, kv_before = engine.memory.slots_reserved, kv.slots_reserved
    engine.abort(b)
    assert b.status is Status.ABORTED
    assert engine.memory.slots_reserved < mem_before and kv.slots_reserved < kv_before
    if not paged:
        assert mem_before - engine.memory.slots_reserved == b.total_len
        assert kv_before - kv.slots_reserved == b.total_len - 1     # (its last token's K/V is never stored)
    assert not kv.has(b.req_id)
    while engine.step() is not None:
        pass
    assert a.output_ids == alone(PROMPTS[0], 20) and c.output_ids == alone(PROMPTS[2], 4)
    assert engine.memory.slots_reserved == engine.memory.slots_used == 0
    assert kv.slots_reserved == kv.n_requests == 0 if paged else kv.slots_reserved == 0
    with pytest.raises(RuntimeError, match="aborted, so it has no RunResult"):
        engine.result()


def test_abort_of_a_waiting_request_and_the_last_one_ends_the_run():
    engine, kv = live(max_bs=1)
    a, b = req(0, 0.0, 5), req(1, 0.0, 5)
    engine.add(a)
    engine.add(b)
    engine.step()                                 # max_bs=1: b waits
    assert b.status is Status.WAITING
    engine.abort(b)
    assert b.status is Status.ABORTED and not engine.scheduler.waiting
    engine.abort(a)
    assert engine.done and engine.step() is None
    assert engine.memory.slots_reserved == 0 and kv.slots_reserved == 0


def test_bad_additions_are_refused_and_change_nothing():
    engine, _ = live()
    with pytest.raises(ValueError, match="exceeds the max context"):
        engine.add(req(0, 0.0, MODEL.spec.max_context))
    engine.add(req(0, 0.0, 2))
    with pytest.raises(ValueError, match="duplicate req_id"):
        engine.add(req(0, 0.0, 2))
    assert len(engine.requests) == 1 and len(engine.scheduler.release_step) == 1
    idle = Engine(TorchExecutor(MODEL, MODEL.new_kv(64)), ReservationMemory(64), SchedulerConfig())
    with pytest.raises(RuntimeError, match="start_live"):
        idle.add(req(0, 0.0, 2))
    with pytest.raises(ValueError, match="n_workers=1"):
        Engine(TorchExecutor(MODEL, MODEL.new_kv(64)), ReservationMemory(64),
               SchedulerConfig(n_workers=2)).start_live()

    class Submitting(TorchExecutor):                 # (an executor that says it submits and waits)
        is_async = True

    with pytest.raises(ValueError, match="a synchronous executor"):
        Engine(Submitting(MODEL, MODEL.new_kv(64)), ReservationMemory(64), SchedulerConfig()).start_live()


def test_many_additions_grow_the_token_column():
    engine, _ = live(max_bs=8, n_slots=4096)
    reqs = [req(i, 0.0, 1 + i % 5) for i in range(60)]
    for r in reqs:
        engine.add(r)
        engine.step()
    while engine.step() is not None:
        pass
    res = engine.result()
    assert [len(r.output_ids) for r in reqs] == [1 + i % 5 for i in range(60)]
    assert all(list(np.diff(res.steps_of(i))) == [1] * (len(res.steps_of(i)) - 1) for i in range(60))


def test_a_result_taken_before_an_addition_keeps_its_requests():
    """`result()` of a live run that is done, then one more request: the first result is a copy,
    its `requests` as many as its columns (it shared the run's list, which grew)."""
    engine, _ = live()
    engine.add(req(0, 0.0, 2))
    while engine.step() is not None:
        pass
    first = engine.result()
    engine.add(req(1, 5.0, 2))
    while engine.step() is not None:
        pass
    assert first.n == len(first.arrival_s) == 1 and [r.req_id for r in first.requests] == [0]
    assert engine.result().n == 2


def test_an_executor_that_fails_to_free_an_aborted_request_stops_the_run():
    """As a step's error does: everything freed, the others ABORTED (free for another run), and
    the run says it stopped (it went on with the request gone, and `result()` failed an assert)."""
    engine, kv, a, b = two_running()
    engine.executor.release = raising("cannot free")
    with pytest.raises(RuntimeError, match="cannot free"):
        engine.abort(b)
    del engine.executor.release
    assert a.status is Status.ABORTED and b.status is Status.ABORTED
    assert engine.memory.slots_reserved == 0 and kv.slots_reserved == 0
    with pytest.raises(RuntimeError, match="the run stopped on an error"):
        engine.step()
    with pytest.raises(RuntimeError, match="the run stopped on an error"):
        engine.result()


def test_forget_done_drops_the_requests_that_left_and_the_others_go_on_as_before():
    """A server never idle runs one live run for ever: `forget_done` drops the records of the
    requests that have left it (finished, aborted) and of its steps; those still in it keep their
    counters, K/V, token steps and place in the queue, and make the tokens they make alone."""
    engine, kv = live(max_bs=2)
    a, b, c, d = req(0, 0.0, 2), req(1, 0.0, 8), req(2, 0.0, 3), req(3, 0.0, 5)
    for r in (a, b, c, d):
        engine.add(r)
    assert (engine.n_running, engine.n_waiting) == (0, 0)          # they join the queue as the step starts
    engine.step()
    assert (engine.n_running, engine.n_waiting) == (2, 2)
    assert engine.n_done == engine.forget_done() == 0 and engine.log.n_steps == 1 and len(engine.requests) == 4
    engine.step()                                 # a finishes; max_bs=2: c and d wait
    engine.abort(c)
    assert (a.status, c.status, d.status) == (Status.FINISHED, Status.ABORTED, Status.WAITING)
    assert (engine.n_running, engine.n_waiting) == (1, 1)
    assert engine.n_done == engine.forget_done() == 2
    assert engine.requests == [b, d] and [b.run_index, d.run_index] == [0, 1]
    assert engine.scheduler.release_step == [-1, -1] and engine.n_done == 0
    assert engine.log.n_steps == 0 and engine.trace_steps == []
    e, again = req(4, 0.0, 3), req(0, 0.0, 4)     # a dropped request's id may come again
    engine.add(e)
    engine.add(again)
    joined = {}                                   # req_id -> the first batch it is in
    while (batch := engine.step()) is not None:
        for r, _, _ in batch.works:
            joined.setdefault(r.req_id, batch.index)
    assert list(joined) == [1, 3, 4, 0] and joined[3] < joined[4]     # b decodes; d, e, the new 0 join: FCFS
    first = engine.scheduler.tokens.first
    assert list(engine.scheduler.tokens.steps[first[0]:first[0] + 8]) == list(range(8))  # b: one token a step
    assert b.output_ids == alone(PROMPTS[1], 8) and d.output_ids == alone(PROMPTS[3], 5)
    assert e.output_ids == alone(PROMPTS[0], 3) and again.output_ids == alone(PROMPTS[0], 4)
    assert engine.memory.slots_reserved == engine.memory.slots_used == kv.slots_reserved == 0
    assert engine.n_done == engine.forget_done() == 4 and engine.requests == [] and engine.done


def test_a_live_run_goes_on_past_the_token_columns_step_limit():
    """A server never idle runs one live run for ever, past `MAX_STEPS` steps (2**32: the token
    column is uint32): `forget_done` counts the steps from the first that made a kept token, so the
    indices stay small while `batch.index + n_steps_forgotten` counts on. Here the run starts 4
    steps short of the limit; the requests still make the tokens they make alone."""
    engine, kv = live(max_bs=4)
    engine.scheduler.n_batches = MAX_STEPS - 4     # (as after 2**32 - 4 steps)
    a, b, c = req(0, 0.0, 10), req(1, 0.0, 2), req(2, 0.0, 6)
    engine.add(a)
    engine.add(b)
    indices = []
    while b.status is not Status.FINISHED:
        indices.append(engine.step().index)
    assert engine.forget_done() == 1              # b: a's first step is kept, the ones before it go
    engine.add(c)
    while c.status is not Status.FINISHED:
        indices.append(engine.step().index)
    assert engine.forget_done() == 1              # c: a's first step is still kept
    while (batch := engine.step()) is not None:
        indices.append(batch.index)
    assert indices == [MAX_STEPS - 4, MAX_STEPS - 3, *range(2, 10)]    # 10 steps: a's tokens
    first = engine.scheduler.tokens.first
    assert list(engine.scheduler.tokens.steps[first[0]:first[0] + 10]) == list(range(10))   # a's, counted anew
    assert (a.output_ids, b.output_ids, c.output_ids) == (alone(PROMPTS[0], 10), alone(PROMPTS[1], 2),
                                                          alone(PROMPTS[2], 6))
    assert engine.n_steps_forgotten == MAX_STEPS - 4    # step i after the forget is step MAX_STEPS - 4 + i
    assert engine.forget_done() == 1 and engine.scheduler.n_batches == 0 and engine.requests == []
    assert engine.n_steps_forgotten == MAX_STEPS + 6
    assert engine.memory.slots_reserved == kv.slots_reserved == 0


def poison(monkeypatch, model, when):
    """`model`'s logits rows become NaN where `when(req_id)` holds (weights that overflowed for
    one request's numbers alone), the others' rows as the model made them."""
    made = model.forward_batch

    def forward_batch(token_ids, works, req_ids, kv):
        logits = made(token_ids, works, req_ids, kv).clone()
        for i, rid in enumerate(req_ids):
            if when(rid):
                logits[i] = float("nan")
        return logits

    monkeypatch.setattr(model, "forward_batch", forward_batch)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("drawn", [False, True], ids=["greedy", "drawn"])
@pytest.mark.parametrize("at_step", [0, 2], ids=["prefill", "decode"])
def test_a_row_that_is_not_finite_drops_its_request_alone(monkeypatch, paged, drawn, at_step):
    """b's logits row turns NaN at one step: b leaves the run (its memory and K/V freed, its
    tokens those before the step), and a and c, in the same steps, make the tokens they make
    alone; the run was failed whole before."""
    from orca_torch.model.sampling import SamplingParams

    sampling = SamplingParams(seed=5, temperature=1.0) if drawn else None

    def three():
        out = [req(i, 0.0, 6) for i in range(3)]
        for r in out:
            r.sampling = sampling
        return out

    engine, kv = live(paged=paged)
    a, b, c = three()
    for r in (a, b, c):
        engine.add(r)
    for _ in range(at_step):
        engine.step()
    made_before = list(b.output_ids or [])
    poison(monkeypatch, MODEL, lambda rid: rid == 1 and engine.scheduler.n_batches == at_step + 1)
    batch = engine.step()
    assert [w.req.req_id for w in batch.works] == [0, 1, 2]
    assert list(engine.failed_rows) == [1] and "request 1: its logits row is not finite (it holds NaN)" in \
        engine.failed_rows[1]
    assert b.status is Status.ABORTED and (b.output_ids or []) == made_before and not kv.has(1)
    while engine.step() is not None:
        assert engine.failed_rows == {}
    monkeypatch.undo()
    ref, _ = live(paged=paged)
    ra, _, rc = three()
    for r in (ra, rc):
        ref.add(r)
    while ref.step() is not None:
        pass
    assert a.status is c.status is Status.FINISHED
    assert a.output_ids == ra.output_ids and c.output_ids == rc.output_ids
    if not drawn:
        assert a.output_ids == alone(PROMPTS[0], 6) and c.output_ids == alone(PROMPTS[2], 6)
    assert engine.memory.slots_reserved == engine.memory.slots_used == 0
    assert kv.slots_reserved == kv.n_requests == 0 if paged else kv.slots_reserved == 0


def test_a_row_that_is_not_finite_fails_an_offline_run_whole(monkeypatch):
    """An offline run has no one to tell about one request: it stops on the error, as before."""
    from orca_torch.model.sampling import NonFiniteLogits

    poison(monkeypatch, MODEL, lambda rid: rid == 1)
    engine = Engine(TorchExecutor(MODEL, MODEL.new_kv(512), clock="iterations"), ReservationMemory(512, "max"),
                    SchedulerConfig(max_bs=4))
    with pytest.raises(NonFiniteLogits, match=r"request 1: its logits row is not finite \(it holds NaN\)"):
        engine.run([req(0, 0.0, 4), req(1, 0.0, 4)])
    assert engine.aborted


def test_a_fresh_live_run_names_no_failed_rows_of_the_run_before(monkeypatch):
    """`failed_rows` is the last step's of this run: a run started afresh (as the server starts
    one after a failed iteration) has taken no step, so it names none."""
    engine, _ = live()
    engine.add(req(0, 0.0, 4))
    poison(monkeypatch, MODEL, lambda rid: rid == 0)
    engine.step()
    assert list(engine.failed_rows) == [0]
    engine.start_live()
    assert engine.failed_rows == {}
