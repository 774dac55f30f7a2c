"""A live run held to the offline run, over random interleavings of `add`, `step`, `abort` and
`forget_done` (lecture §4.1: requests join and leave a running batch).

For the requests not aborted, a live run makes what the engine makes for them otherwise: on the
paper GPU, the offline run's steps (every step's times, works, occupancy, and each token's step);
on the torch model, the tokens each request makes alone (selective batching makes a request's
tokens its own, whoever shares its steps). After every call, whatever the interleaving (preemptions
under on-demand or paged memory, chunks of a prompt cut by the token budget, aborts of a queued,
a preempted or a half-fed request, the past dropped between any two calls, ids that are strings or
come again), every request's counters are those its steps give, the memory manager and the K/V
store hold what the running requests hold and nothing else, and the queue keeps its order; at the
end everything is freed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
from hypothesis import event, given, settings, strategies as st

from orca_torch.core.batch import Batch, StepTotals
from orca_torch.core.engine import Engine
from orca_torch.core.memory import ReservationMemory, TokenMemory, UnlimitedMemory, slots_to_finish
from orca_torch.core.paged_memory import PagedMemory, blocks_for
from orca_torch.core.request import ACTIVE, Request, Status
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.model.paged_kv_cache import PagedKVManager
from orca_torch.model.sampling import SamplingParams
from orca_torch.model.torch_executor import TorchExecutor
from orca_torch.sim.executors import CostModelExecutor, StepTimeExecutor
from tiny_model import MODEL, alone

MAX_CONTEXT = 256
GPU = CostModelExecutor("llama-3-8b", "h100")


def _affine(t: StepTotals) -> float:
    return 1e-3 + 4e-6 * t.n_tokens + 3e-8 * t.kv_read_tokens


EXECUTORS = {"gpu": GPU, "affine": StepTimeExecutor(_affine, max_context=MAX_CONTEXT)}


def make_memory(kind: str, n_slots: int):
    """Reservation (`max`, `oracle`), on-demand (`ondemand`: preempts), paged (recompute: preempts),
    or none."""
    if kind in ("max", "oracle"):
        return ReservationMemory(n_slots, kind)
    if kind == "ondemand":
        return TokenMemory(n_slots)
    if kind == "paged":
        return PagedMemory(n_slots, block_size=4, watermark_blocks=0)
    return UnlimitedMemory(n_slots)


def make_config(max_bs: int, shape: str) -> SchedulerConfig:
    """Orca's mixed steps, prefill-first, or chunked prefill under a small token budget."""
    if shape == "chunked":
        return SchedulerConfig(max_bs=max_bs, max_num_batched_tokens=max_bs + 7, chunked_prefill=True)
    if shape == "prefill_first":
        return SchedulerConfig(max_bs=max_bs, prefill="prefill_first")
    return SchedulerConfig(max_bs=max_bs)


# ---- what the run must hold after every call ------------------------------------------------------
@dataclass
class Shadow:
    """A request's counters kept from the batches the run returned alone: tokens stored, and the
    step (counted over the whole run) that made each token."""

    req: Request
    computed: int = 0
    n_preemptions: int = 0
    steps: list[int] = field(default_factory=list)
    aborted_after: int | None = None            # the step its abort followed (over the whole run)


class Watch:
    """The run's requests, followed through every call and checked after each."""

    def __init__(self, engine: Engine, expected: dict | None = None) -> None:
        self.engine = engine
        self.shadows: dict[int, Shadow] = {}    # id(request) -> its shadow, every request ever added
        self.order: list[Request] = []          # the run's requests in the order added, none forgotten
        self.expected = expected or {}          # id(request) -> the tokens it must make (torch)
        self.trace: list[tuple] = []            # (step over the whole run, start, end, works, reserved, used)

    def add(self, req: Request) -> None:
        self.engine.add(req)
        self.shadows[id(req)] = Shadow(req)
        self.order.append(req)
        self.check()

    def abort(self, req: Request) -> None:
        self.shadows[id(req)].aborted_after = self.engine.scheduler.n_batches - 1 + self.engine.n_steps_forgotten
        self.engine.abort(req)
        assert req.status is Status.ABORTED
        self.check()

    def forget(self) -> None:
        eng = self.engine
        queue = [r for _, r in sorted(eng.scheduler.waiting, key=lambda kr: kr[0])]
        running = list(eng.scheduler.running)
        n = eng.forget_done()
        kept = [r for r in self.order if r.status in ACTIVE]
        assert n == len(self.order) - len(kept)
        self.order = kept
        assert [r for _, r in sorted(eng.scheduler.waiting, key=lambda kr: kr[0])] == queue
        assert eng.scheduler.running == running
        self.check()

    def step(self) -> Batch | None:
        eng = self.engine
        batch = eng.step()
        if batch is not None:
            at = batch.index + eng.n_steps_forgotten
            for s in self.shadows.values():     # (a step whose every choice was preempted is never returned)
                if s.req.n_preemptions != s.n_preemptions:
                    s.n_preemptions, s.computed = s.req.n_preemptions, 0
            for r, n_new, n_past in batch.works:
                s = self.shadows[id(r)]
                assert n_past == s.computed and 0 < n_new <= r.prompt_len + len(s.steps) - n_past, (r.req_id, n_new,
                                                                                                   n_past, s)
                s.computed = n_past + n_new
                if s.computed == r.prompt_len + len(s.steps):
                    s.steps.append(at)
            made = [r for r, _, _ in batch.works if self.shadows[id(r)].steps[-1:] == [at]]
            assert eng.tokens_made(batch) == made
            assert eng.prompts_completed(batch) == [r for r in made if len(self.shadows[id(r)].steps) == 1]
            start, end, _, _, reserved, used = (c[-1] for c in eng.log.columns())
            self.trace.append((at, start, end, [(r.req_id, n, p) for r, n, p in batch.works], reserved, used))
        self.check()
        return batch

    def check(self) -> None:
        """Every counter true, the run's lists and numbering right, and the memory and K/V held
        exactly what the running requests hold."""
        eng, sched = self.engine, self.engine.scheduler
        assert eng.requests == self.order
        assert all(r.run_index == i for i, r in enumerate(eng.requests))
        running = sched.running
        assert {id(r) for r in running} == {id(r) for r in eng.requests if r.status is Status.RUNNING}
        assert len(running) <= eng.config.max_bs
        heap = sched.waiting
        assert all(heap[(i - 1) // 2][0] <= heap[i][0] for i in range(1, len(heap))), "the queue is no heap"
        waiting = {id(r) for _, r in heap}
        assert waiting <= {id(r) for r in eng.requests if r.status is Status.WAITING}
        assert sched.n_done == sum(r.status not in ACTIVE for r in eng.requests)
        col, base = sched.tokens, eng.n_steps_forgotten
        for r in eng.requests:
            s = self.shadows[id(r)]
            assert r.n_generated == len(s.steps) <= r.output_len, (r.req_id, r.n_generated, s)
            first = col.first[r.run_index]
            assert [int(x) + base for x in col.view[first:first + r.n_generated]] == s.steps, r.req_id
            if r.status is Status.RUNNING:
                assert r.num_computed_tokens == s.computed, (r.req_id, r.num_computed_tokens, s)
            if r.status is Status.WAITING:
                assert r.num_computed_tokens == 0
            assert (r.status is Status.FINISHED) == (r.n_generated == r.output_len)
            released = {Status.FINISHED: s.steps[-1] if s.steps else None, Status.ABORTED: s.aborted_after}
            assert sched.release_step[r.run_index] + base == released.get(r.status, base - 1), r.req_id
        for s in self.shadows.values():
            r = s.req
            if r.output_ids is not None or id(r) in self.expected:
                assert len(r.output_ids or []) == r.n_generated
                assert (r.output_ids or []) == self.expected[id(r)][:r.n_generated], r.req_id
        self.check_memory(running)

    def check_memory(self, running: list[Request]) -> None:
        mem = self.engine.memory
        assert all(mem.holds(r) and mem.stored(r) == r.num_computed_tokens for r in running)
        assert mem.slots_used == sum(r.num_computed_tokens for r in running)
        if isinstance(mem, PagedMemory):
            mem.check_invariants()
            assert all(len(mem.block_table(r)) >= blocks_for(r.num_computed_tokens, mem.block_size) for r in running)
            assert mem.blocks_used == sum(len(mem.block_table(r)) for r in running)
        elif isinstance(mem, ReservationMemory):
            assert mem.slots_reserved == sum(mem.reservation(r) for r in running)
        else:
            assert mem.slots_reserved >= mem.slots_used and (mem.slots_reserved == 0) == (not running)
        kv = getattr(self.engine.executor, "kv", None)
        if kv is not None:
            assert kv.n_requests == len(running)
            assert all(kv.holds(r.req_id) and kv.length(r.req_id) == r.num_computed_tokens for r in running)
            assert kv.slots_used == mem.slots_used
            if not isinstance(kv, PagedKVManager):
                assert kv.slots_reserved == sum(slots_to_finish(r) for r in running)

    def assert_all_freed(self) -> None:
        eng = self.engine
        assert eng.done and not eng.scheduler.running and not eng.scheduler.waiting
        assert eng.memory.slots_reserved == eng.memory.slots_used == 0
        kv = getattr(eng.executor, "kv", None)
        if kv is not None:
            assert kv.slots_reserved == kv.slots_used == kv.n_requests == 0


# ---- the paper GPU: the offline run's steps ---------------------------------------------------------
workloads = st.lists(st.tuples(st.sampled_from([0.0, 0.0, 0.001, 0.004, 0.03]), st.integers(1, 40),
                               st.integers(1, 30)), min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(reqs=workloads, executor=st.sampled_from(sorted(EXECUTORS)), max_bs=st.integers(1, 6),
       memory=st.sampled_from(["max", "oracle", "ondemand", "paged", "unlimited"]), slack=st.integers(0, 60),
       shape=st.sampled_from(["mixed", "prefill_first", "chunked"]), str_ids=st.booleans(), data=st.data())
def test_a_live_run_takes_the_offline_runs_steps(reqs, executor, max_bs, memory, slack, shape, str_ids, data):
    """Requests added as the clock passes their arrival (while it is idle, the clock moves up to
    the next), the past dropped between any two calls, and requests added and aborted before any
    step took them: the run's steps (times, works, occupancy), each token's step and each request's
    preemptions are the offline run's of the same requests, and each call leaves the counters true."""
    gaps = [0.0] + [a for a, _, _ in reqs[1:]]
    arrivals = np.cumsum(gaps)
    requests = [Request(f"r{i}" if str_ids else i, float(t), p, o, max_tokens=MAX_CONTEXT)
                for i, (t, (_, p, o)) in enumerate(zip(arrivals, reqs))]
    n_slots = max(r.total_len for r in requests) + slack if memory in ("ondemand", "paged") else 4 * MAX_CONTEXT
    n_slots += 3 if memory == "paged" else 0          # (whole blocks of 4)
    config = make_config(max_bs, shape)
    ex = EXECUTORS[executor]
    offline = Engine(ex, make_memory(memory, n_slots), config, max_context=MAX_CONTEXT, trace=True).run(
        [replace(r) for r in requests])

    engine = Engine(ex, make_memory(memory, n_slots), config, max_context=MAX_CONTEXT, trace=True)
    engine.start_live()
    watch = Watch(engine)
    pending, n_ghosts = list(requests), 0
    while True:
        while pending and (pending[0].arrival_s <= engine.t or engine.done):
            watch.add(pending.pop(0))
        then = data.draw(st.integers(0, 19), label="forget (0-4), or add and abort a request (5-8)")
        if then < 5:
            watch.forget()
        elif then < 9 and engine.requests:
            like = data.draw(st.sampled_from(requests), label="ghost like")
            ghost = replace(like, req_id=f"ghost{n_ghosts}" if str_ids else -1 - n_ghosts,
                            arrival_s=engine.requests[-1].arrival_s)
            n_ghosts += 1
            watch.add(ghost)
            watch.abort(ghost)
        if engine.done and not pending:
            break
        assert watch.step() is not None
    assert watch.step() is None
    watch.assert_all_freed()
    event(f"preemptions: {min(sum(offline.n_preemptions), 3)}")

    assert [t[0] for t in watch.trace] == list(range(offline.n_steps))
    for (at, start, end, works, reserved, used), step in zip(watch.trace, offline.trace):
        assert (start, end, works) == (step.start, step.end, step.works), at
        assert (reserved, used) == (offline.step_reserved[at], offline.step_used[at]), at
    for i, r in enumerate(requests):
        assert watch.shadows[id(r)].steps == list(offline.steps_of(i)), r.req_id
        assert r.n_preemptions == offline.n_preemptions[i], r.req_id


# ---- the torch model: each request's tokens alone ---------------------------------------------------
RNG = np.random.default_rng(11)
PROMPTS = [RNG.integers(0, MODEL.spec.vocab, size=n).tolist() for n in (3, 9, 14, 22, 5)]


@lru_cache(maxsize=None)
def drawn_alone(prompt: tuple[int, ...], n: int, seed: int) -> tuple[int, ...]:
    """The tokens of a request with seeded sampling, generated alone in a live run of its own."""
    engine = Engine(TorchExecutor(MODEL, MODEL.new_kv(64), clock="iterations"), ReservationMemory(64, "oracle"),
                    SchedulerConfig(max_bs=1))
    engine.start_live()
    r = Request(0, 0.0, len(prompt), n, prompt_ids=list(prompt), sampling=SamplingParams(temperature=1.0, seed=seed))
    engine.add(r)
    while engine.step() is not None:
        pass
    return tuple(r.output_ids)


def kind_of(r: Request) -> str:
    """Where `r` stands in its run, for the statistics of what the examples aborted."""
    if r.status is Status.WAITING:
        return "preempted, queued" if r.n_preemptions else "queued"
    if r.num_computed_tokens < r.prompt_len + r.n_generated - 1:
        return "half-fed"
    return "decoding" if r.n_generated else "fed, no token yet"


OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "add", "step", "step", "step", "step", "abort", "forget"]),
                         st.integers(0, 1 << 16)), min_size=8, max_size=40)


def interleave(watch: Watch, ops: list[tuple[str, int]], str_ids: bool, torch: bool) -> None:
    """Run `ops` on `watch`'s live run (each call checked), then step it to its end: `add` takes one
    to three requests at the clock (on torch, greedy or seeded; an id forgotten may come again),
    `abort` a request still in the run (queued, preempted back to the queue, half-fed by chunks or
    running, the rarer ones often), `forget` drops the past. Everything is freed at the end, and
    each request finished made its tokens (`watch.expected`)."""
    engine = watch.engine
    forgotten: list = []                        # ids of requests dropped by forget_done, free to come again
    n_added = 0
    for op, k in ops:
        if op == "add":
            for j in range(1 + k % 3):
                prompt, n_out = PROMPTS[(k + j) % len(PROMPTS)], 4 + (k >> 2) % 8
                if forgotten and k % 3 == 0:
                    rid = forgotten.pop(k % len(forgotten))
                else:
                    rid = f"q{n_added}" if str_ids else n_added
                seed = (k >> 4) % 5 if k % 2 and torch else None
                r = Request(rid, engine.t, len(prompt), n_out, max_tokens=40, prompt_ids=prompt if torch else None,
                            sampling=None if seed is None else SamplingParams(temperature=1.0, seed=seed))
                n_added += 1
                if torch:
                    watch.expected[id(r)] = (alone(prompt, n_out) if seed is None else
                                             list(drawn_alone(tuple(prompt), n_out, seed)))
                watch.add(r)
        elif op == "step":
            watch.step()
        elif op == "abort":
            live = [r for r in engine.requests if r.status in ACTIVE]
            odd = [r for r in live if kind_of(r) in ("half-fed", "preempted, queued")]
            live = odd if odd and k % 2 else live
            if live:
                r = live[k % len(live)]
                event(f"abort of a {kind_of(r)} request")
                watch.abort(r)
        else:
            before = list(engine.requests)
            watch.forget()
            forgotten += [r.req_id for r in before if r.status not in ACTIVE and r.req_id not in forgotten]
    while watch.step() is not None:
        pass
    watch.assert_all_freed()
    event(f"preemptions: {min(sum(s.req.n_preemptions for s in watch.shadows.values()), 3)}")
    for s in watch.shadows.values():
        r = s.req
        assert r.status in (Status.FINISHED, Status.ABORTED)
        if r.status is Status.FINISHED and torch:
            assert r.output_ids == watch.expected[id(r)]


@settings(max_examples=100, deadline=None)
@given(ops=OPS, max_bs=st.integers(2, 5), memory=st.sampled_from(["ondemand", "paged"]),
       shape=st.sampled_from(["mixed", "chunked"]), slack=st.integers(0, 6), str_ids=st.booleans())
def test_a_live_run_makes_each_request_its_tokens_alone(ops, max_bs, memory, shape, slack, str_ids):
    """Random interleavings of `add`, `step`, `abort` and `forget_done` on the torch model under
    memory that preempts: each call leaves the counters, memory and K/V true, every request's
    tokens so far are those it makes alone (greedy or seeded), and at the end everything is freed."""
    n_slots = 22 + 11 + slack + (3 if memory == "paged" else 0)    # the longest request, and little more
    mem = make_memory(memory, n_slots)
    kv = PagedKVManager.mirroring(mem, MODEL) if memory == "paged" else MODEL.new_kv(4 * n_slots)
    engine = Engine(TorchExecutor(MODEL, kv, clock="iterations"), mem, make_config(max_bs, shape))
    engine.start_live()
    interleave(Watch(engine), ops, str_ids, torch=True)


@settings(max_examples=400, deadline=None)
@given(ops=OPS, max_bs=st.integers(1, 5), memory=st.sampled_from(["max", "oracle", "ondemand", "paged", "unlimited"]),
       shape=st.sampled_from(["mixed", "prefill_first", "chunked"]), slack=st.integers(0, 12), str_ids=st.booleans())
def test_a_live_run_on_the_paper_gpu_keeps_its_accounts_under_any_interleaving(ops, max_bs, memory, shape, slack,
                                                                              str_ids):
    """The same interleavings on the paper GPU, with every memory manager and every scheduler
    shape: each call leaves the counters, the memory and the queue true, and the end frees all."""
    engine = Engine(GPU, make_memory(memory, 40 + slack), make_config(max_bs, shape), max_context=MAX_CONTEXT)
    engine.start_live()
    interleave(Watch(engine), ops, str_ids, torch=False)
