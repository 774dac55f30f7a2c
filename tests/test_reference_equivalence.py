"""The engine equals Algorithm 1 written as a plain loop (`reference_engine.py`), exactly.

Same workload, same settings, same step-time function: every token's timestamp, every step's
start, end, batch size, token count, K/V occupancy and `(req, n_new, n_past)` list must be
identical — so the scheduler's bookkeeping changes nothing. The fast engine (`sim/fast_engine.py`)
is held to the same loop at every setting, and to the stepped engine column for column: it
changes nothing but the speed.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given, settings, strategies as st
from reference_engine import reference_run

from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.core.engine import Engine
from orca_torch.sim.executors import CostModelExecutor, StepTimeExecutor
from orca_torch.model.torch_executor import TorchExecutor
from orca_torch.model.orca_model import OrcaModel
from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.lab.workload import with_predictions
from orca_torch.sim.fast_engine import FastEngine
from random_settings import make_memory

MAX_CONTEXT = 1024
GPU = CostModelExecutor("llama-3-8b", "h100")


def _cheap(t: StepTotals) -> float:
    """A Clipper-style affine profile in tokens and K/V read."""
    return 1e-3 + 4e-6 * t.n_tokens + 3e-8 * t.kv_read_tokens


def _bumpy(t: StepTotals) -> float:
    """Not monotone in the context: the fast engine must not assume steps only get longer."""
    return 1e-3 * (1 + (t.kv_read_tokens * 7919) % 5) + 1e-5 * t.n_tokens


def _step_time_executor(fn):
    ex = StepTimeExecutor(fn)
    ex.max_context = MAX_CONTEXT
    return ex


EXECUTORS = {"gpu": GPU, "cheap": _step_time_executor(_cheap), "bumpy": _step_time_executor(_bumpy)}


def priced_by(ex):
    return lambda works: (ex.step_time(StepTotals.of(SeqWork(n, p) for _, n, p in works)), None)


def assert_fast_equals_stepped(fast, stepped):
    for col in ("token_offsets", "token_step", "release_s", "n_preemptions", "step_start", "step_end",
                "step_n_seqs", "step_n_tokens", "step_reserved", "step_used"):
        np.testing.assert_array_equal(getattr(fast, col), getattr(stepped, col), err_msg=col)
    for name in ("slot", "start", "count"):     # the fast engine's runs, kept with no column, are the column's
        np.testing.assert_array_equal(getattr(fast.token_runs, name), getattr(stepped.token_runs, name), err_msg=name)
    assert fast.trace == stepped.trace


def run_both(ex, make_mem, config, requests):
    """The stepped engine's run and the fast engine's, checked equal; the stepped one is returned."""
    fast = FastEngine(ex, make_mem(), config, max_context=MAX_CONTEXT, trace=True).run(requests)
    stepped = Engine(ex, make_mem(), config, max_context=MAX_CONTEXT, trace=True).run(requests)
    assert_fast_equals_stepped(fast, stepped)
    return stepped


def assert_same_run(res, ref, requests):
    steps = ref.steps
    assert res.n_steps == len(steps)
    np.testing.assert_array_equal(res.step_start, [s.start for s in steps])
    np.testing.assert_array_equal(res.step_end, [s.end for s in steps])
    np.testing.assert_array_equal(res.step_n_seqs, [s.n_seqs for s in steps])
    np.testing.assert_array_equal(res.step_n_tokens, [s.n_tokens for s in steps])
    np.testing.assert_array_equal(res.step_reserved, [s.reserved for s in steps])
    np.testing.assert_array_equal(res.step_used, [s.used for s in steps])
    for (index, _, _, works), s in zip(res.trace, steps):
        assert sorted(works) == sorted(s.works), f"step {index}"
    for i, r in enumerate(requests):
        np.testing.assert_array_equal(res.tokens_of(i), ref.times[r.req_id])
    assert list(res.n_preemptions) == [ref.evictions[r.req_id] for r in requests]


workloads = st.lists(st.tuples(st.one_of(st.just(0.0), st.floats(0, 0.05)), st.integers(1, 900),
                               st.integers(1, 50)), min_size=1, max_size=25)


@settings(max_examples=120, deadline=None)
# Found by this test: a step that preempts admits no one, but the next one may, so the engine must
# not take the steps after it in bulk (both timelines went wrong after the preemption).
@example(reqs=[(0.0, 1, 1), (0.0, 1, 1), (0.0, 1, 35), (0.0, 19, 13), (0.03125, 1, 1)], executor="bumpy",
         max_bs=2, memory="ondemand", slack=0, order="spf", prefill="mixed", budget=None, static=False,
         idle_seats_cost=False)
@example(reqs=[(0.0, 1, 1), (0.0, 1, 1), (0.0, 1, 13), (0.0, 1, 16), (0.03125, 1, 1), (0.0, 2, 1)],
         executor="bumpy", max_bs=5, memory="ondemand", slack=30, order="spf", prefill="prefill_first",
         budget=2500, static=False, idle_seats_cost=False)
# The token budget's edges: two prompts fill it exactly, then the decodes leave one token too few.
@example(reqs=[(0.0, 550, 3), (0.0, 550, 3), (0.0, 549, 1), (0.0, 550, 1)], executor="cheap", max_bs=4,
         memory="unlimited", slack=0, order="fcfs", prefill="mixed", budget=1100, static=False,
         idle_seats_cost=False)
@given(reqs=workloads, executor=st.sampled_from(sorted(EXECUTORS)), max_bs=st.integers(1, 12),
       memory=st.sampled_from(["max", "pow2", "oracle", "ondemand", "unlimited"]), slack=st.integers(0, 5000),
       order=st.sampled_from(["fcfs", "spf"]), prefill=st.sampled_from(["mixed", "prefill_first"]),
       budget=st.sampled_from([None, 1100, 2500]), static=st.booleans(), idle_seats_cost=st.booleans())
def test_engine_equals_the_plain_loop(reqs, executor, max_bs, memory, slack, order, prefill, budget, static,
                                      idle_seats_cost):
    arrivals = np.cumsum([a for a, _, _ in reqs])
    requests = [Request(i, float(t), p, o) for i, (t, (_, p, o)) in enumerate(zip(arrivals, reqs))]
    if static:
        memory = "oracle" if memory == "ondemand" else memory
        config = SchedulerConfig(max_bs=max_bs, static=True, static_idle_seats_cost=idle_seats_cost)
    else:
        requests = with_predictions(requests, 0.7, seed=len(reqs))
        config = SchedulerConfig(max_bs=max_bs, order=order, prefill=prefill,
                                 max_num_batched_tokens=None if budget is None else max(budget, max_bs))
    if memory == "ondemand":   # tight enough to preempt often
        n_slots = max(r.total_len for r in requests) + slack // 5
    else:
        n_slots = MAX_CONTEXT + slack
    ex = EXECUTORS[executor]
    res = run_both(ex, lambda: make_memory(memory, n_slots, MAX_CONTEXT), config, requests)
    ref = reference_run(requests, priced_by(ex), make_memory(memory, n_slots, MAX_CONTEXT), max_bs,
                        config.order, config.prefill, config.max_num_batched_tokens, static, idle_seats_cost)
    assert_same_run(res, ref, requests)


def test_engine_equals_the_plain_loop_on_a_busy_chat_run():
    """A longer run on the paper GPU where memory (max reservation) and max_bs both bind."""
    from orca_torch.lab.workload import chat

    requests = chat(n_requests=150, rate=30.0, seed=3, max_context=MAX_CONTEXT)
    config = SchedulerConfig(max_bs=24)
    res = run_both(GPU, lambda: make_memory("max", 16 * MAX_CONTEXT, MAX_CONTEXT), config, requests)
    ref = reference_run(requests, priced_by(GPU), make_memory("max", 16 * MAX_CONTEXT, MAX_CONTEXT), 24)
    assert max(s.n_seqs for s in ref.steps) == 16            # the reservation binds before max_bs
    assert_same_run(res, ref, requests)


def test_torch_engine_equals_the_plain_loop_token_for_token():
    """The real model: the plain loop's own forward passes give the engine's tokens and timeline."""
    model = OrcaModel("tiny", seed=0)
    rng = np.random.default_rng(5)
    specs = [(0, 7, 5), (0, 3, 2), (1, 12, 9), (2, 5, 1), (2, 9, 6), (4, 4, 4), (6, 6, 3)]
    requests = [Request(i, float(a), p, o, prompt_ids=rng.integers(0, model.spec.vocab, size=p).tolist())
                for i, (a, p, o) in enumerate(specs)]
    n_slots = sum(r.total_len for r in requests)
    config = SchedulerConfig(max_bs=3)
    res = Engine(TorchExecutor(model, model.new_kv(n_slots), clock="iterations"),
                 make_memory("oracle", 40, 64), config, trace=True).run(requests)
    engine_tokens = res.output_ids           # read now: the plain loop resets the shared requests

    kv = model.new_kv(n_slots)
    generated: dict = {r.req_id: [] for r in requests}

    def torch_step(works):
        ids = []
        for r, n_new, n_past in works:
            if n_past == 0:
                kv.reserve(r.req_id, r.total_len)
            ids.extend((r.prompt_ids + generated[r.req_id])[n_past:n_past + n_new])
        with torch.no_grad():
            logits = model.forward_batch(torch.tensor(ids), [SeqWork(n, p) for _, n, p in works],
                                         [r.req_id for r, _, _ in works], kv)
        tokens = logits.argmax(dim=-1).tolist()
        for (r, _, _), tok in zip(works, tokens):
            generated[r.req_id].append(tok)
        return 1.0, tokens

    ref = reference_run(requests, torch_step, make_memory("oracle", 40, 64), 3)
    assert max(s.n_seqs for s in ref.steps) == 3
    assert_same_run(res, ref, requests)
    assert engine_tokens == ref.tokens
