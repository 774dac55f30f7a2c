"""A new policy (a `Scheduler` subclass given as `scheduler=`): what the scheduler refuses of the
requests its `select` hands `decode`, the batches it fills and the keys its `queue_key` gives, at
the step that did it, and how it says so, and what the engine says when a policy schedules nothing;
each refused run leaves the memory manager's counters at zero."""
from __future__ import annotations

import heapq
import math
import re

import numpy as np
import pytest

from orca_torch.core.batch import Batch, ScheduledSeq, step_totals
from orca_torch.core.engine import Engine
from orca_torch.core.memory import ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.request import Request, Status
from orca_torch.core.policies import ChunkedPrefillScheduler
from orca_torch.core.scheduler import NO_LIMIT, Scheduler
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.lab import api
from orca_torch.sim.fast_engine import FastEngine
from clocks import iteration_clock


def clock():
    ex = iteration_clock()
    ex.max_context = 512
    return ex


def then(change):
    """A new policy whose `select` is Orca's, then `change(scheduler, batch)`."""
    class ChangesItsBatch(Scheduler):
        def select(self, batch, ready):
            super().select(batch, ready)
            change(self, batch)
    return ChangesItsBatch


class DecodesByHand(Scheduler):
    """Puts the running requests in as works of its own, not through `decode`: where memory can
    run out, nothing grows their memory or preempts for them."""
    def select(self, batch, ready):
        batch.works += [ScheduledSeq(r, 1, r.num_computed_tokens) for r in ready]
        self.admit(batch, self.cfg.max_bs - len(ready), self.budget - len(batch.works))


class AdmitsThenDecodes(Scheduler):
    """The lecture's pseudocode order, admission first: `decode` would replace the admitted works."""
    def select(self, batch, ready):
        self.admit(batch, self.cfg.max_bs - len(ready), self.budget)
        self.decode(batch, ready)


class JoinsByHand(Scheduler):
    """Moves the queue's head into `running` itself, not through `admit`: no memory is set aside."""
    def select(self, batch, ready):
        if ready:
            self.decode(batch, ready)
        while self.waiting and len(self.running) < self.cfg.max_bs:
            r = heapq.heappop(self.waiting)[1]
            r.status = Status.RUNNING
            self.running.append(r)
            batch.works.append(ScheduledSeq(r, r.n_to_feed, 0))


def _replace(i, **fields):
    return lambda s, b: b.works.__setitem__(i, b.works[i]._replace(**fields)) if b.works else None


WRONG_BATCHES = [
    (then(lambda s, b: b.works.append((s.waiting[0][1], 8, 0))), RuntimeError,
     r"batch 0 wrong: works\[2\] is a tuple, not a ScheduledSeq of a Request"),
    (then(lambda s, b: b.works.append(ScheduledSeq(s.waiting[0][1], 8, 0))), RuntimeError,
     r"request 2 is waiting, not in running"),
    (then(lambda s, b: b.works.append(b.works[0])), RuntimeError, r"request 0 is in it twice"),
    (then(_replace(0, n_past=1)), RuntimeError, r"request 0 has n_past=1, but 0 of its tokens are stored"),
    (then(_replace(-1, n_new=0)), RuntimeError, r"request 1 has n_new=0, but it needs 8 tokens fed"),
    (then(_replace(0, n_new=9)), RuntimeError, r"request 0 has n_new=9, but it needs 8 tokens fed"),
    (then(lambda s, b: s.admit(b, 1, s.budget)), RuntimeError, r"it holds 3 works, past max_bs=2"),
    (then(lambda s, b: setattr(b, "totals", step_totals((), 1, 0))), RuntimeError,
     r"batch.totals is StepTotals\(n_seqs=1, n_tokens=1.*leave batch.totals to decode"),
    (DecodesByHand, RuntimeError, r"batch 1 wrong: request 0 has made 1 tokens and needs one fed, a decode, but it "
                                  r"is not among the decodes batch.totals counts: put in by hand, not by decode"),
    (AdmitsThenDecodes, RuntimeError,
     r"batch 0 wrong: it called decode on a batch that already holds 2 works; decode sets the batch's works"),
    (JoinsByHand, RuntimeError, r"batch 0 wrong: request 0 is in running but holds no memory in UnlimitedMemory: "
                                r"a request joins running through admit"),
]


def stops_at_the_door(engine, mem, policy, error, match):
    """Stepping the run ends in `error` (matching `match`) from the door of `policy`'s select, and the
    run is aborted with all its memory given back."""
    with pytest.raises(error, match=match) as refused:
        for _ in range(100):
            engine.step()
    assert str(refused.value).startswith(f"{policy.__name__}.select filled batch ")
    assert engine.aborted and (mem.slots_reserved, mem.slots_used) == (0, 0)


@pytest.mark.parametrize("kind", [Engine, FastEngine])
@pytest.mark.parametrize("policy, error, match", WRONG_BATCHES)
def test_a_new_policy_s_wrong_batch_stops_the_run_at_the_step_that_filled_it(policy, error, match, kind):
    """Left to run on, each of these ends in a memory manager's KeyError, in memory not freed at
    the end, in a run that never ends, or in a run that ends with wrong counts and no error."""
    mem = UnlimitedMemory()
    engine = kind(clock(), mem, SchedulerConfig(max_bs=2), scheduler=policy)
    engine.start([Request(i, 0.0, 8, 4) for i in range(3)])
    stops_at_the_door(engine, mem, policy, error, match)


@pytest.mark.parametrize("kind", [Engine, FastEngine])
def test_a_new_policy_s_batch_past_the_token_budget_stops_the_run(kind):
    """An admit handed more than the budget left ran steps of any size under max_num_batched_tokens
    with no error (the budget holds for a new policy as for any)."""
    class PastTheBudget(ChunkedPrefillScheduler):
        def select(self, batch, ready):
            if ready:
                self.decode(batch, ready)
            self.admit(batch, self.cfg.max_bs - len(ready), NO_LIMIT)

    mem = UnlimitedMemory()
    cfg = SchedulerConfig(max_bs=4, chunked_prefill=True, max_num_batched_tokens=16)
    engine = kind(clock(), mem, cfg, scheduler=PastTheBudget)
    engine.start([Request(i, 0.0, 12, 4) for i in range(3)])
    stops_at_the_door(engine, mem, PastTheBudget, RuntimeError,
                      r"batch 0 wrong: it feeds 36 tokens, past max_num_batched_tokens=16; admit takes the budget")
    res = kind(clock(), mem, cfg, scheduler=ChunkedPrefillScheduler).run([Request(i, 0.0, 12, 4) for i in range(3)])
    assert res.n == 3


def decodes_also(pick):
    """A new policy whose `select` is Orca's with `pick(scheduler)` added to the ready requests it
    hands `decode`."""
    class DecodesAlso(Scheduler):
        def start(self, requests=None):
            super().start(requests)
            self.given = list(requests or [])

        def select(self, batch, ready):
            super().select(batch, ready + pick(self))
    return DecodesAlso


class DecodesAGenerator(Scheduler):
    """Hands `decode` a generator of the ready requests, not a list."""
    def select(self, batch, ready):
        if ready:
            self.decode(batch, (r for r in ready))
        self.admit(batch, self.cfg.max_bs - len(ready), self.budget - len(batch.works))


class CutsPromptsButDecodesThem(Scheduler):
    """Admits at most 4 tokens of a prompt, with Orca's `select`, which decodes every ready request."""
    def prompt_share(self, req, budget):
        return min(req.n_to_feed, budget, 4)


MEMORIES = {"reservation": lambda: ReservationMemory(4096, "oracle"), "token": lambda: TokenMemory(4096),
            "paged": lambda: PagedMemory(4096), "unlimited": UnlimitedMemory}
WRONG_DECODES = {
    "waiting": (decodes_also(lambda s: [s.waiting[0][1]] if s.running and s.waiting else []), 1,
                r"batch 1 wrong: it called decode with request 2, which is waiting, not in running; decode takes a "
                r"list of requests that are running and not in flight \(those of select's ready\), each once, each "
                r"needing one token fed; a waiting one joins running through admit$"),
    "finished": (decodes_also(lambda s: [r for r in s.given if r.status is Status.FINISHED][:1]), 1,
                 r"batch 2 wrong: it called decode with request 0, which is finished, not in running; decode takes "),
    "twice": (decodes_also(lambda s: s.running[:1]), 1,
              r"batch 1 wrong: it called decode with request 0 twice; decode takes "),
    "in_flight": (decodes_also(lambda s: [r for r in s.running if r.status is Status.IN_FLIGHT][:1]), 2,
                  r"batch 1 wrong: it called decode with request 0, which is in_flight, in running; decode takes "),
    "not_a_request": (decodes_also(lambda s: [s.running[0].req_id] if s.running else []), 1,
                      r"batch 1 wrong: it called decode with 0 \(int\), not a Request; decode takes "),
    "cut_prompt": (CutsPromptsButDecodesThem, 1,
                   r"batch 1 wrong: it called decode with request 0, which needs 4 tokens fed, not one: decode would "
                   r"feed the rest of a prompt that prompt_share cut one token a step; select feeds it its next share "
                   r"as a work of its own, ScheduledSeq\(req, n, req.num_computed_tokens\), as "
                   r"ChunkedPrefillScheduler.select does \(a policy that cuts prompts subclasses it\); decode takes "),
    "generator": (DecodesAGenerator, 1,
                  r"batch 1 wrong: it called decode with a generator, not a list of requests; decode takes "),
}


@pytest.mark.parametrize("kind", [Engine, FastEngine])
@pytest.mark.parametrize("policy, n_workers, match, memory", [
    pytest.param(*case, memory, id=f"{what}-{memory}") for what, case in WRONG_DECODES.items() for memory in MEMORIES
    if case[1] == 1 or not MEMORIES[memory]().can_run_out])     # (preemption needs n_workers=1)
def test_a_new_policy_s_wrong_decodes_stop_the_run_before_decode_acts(policy, n_workers, match, memory, kind):
    """Where memory can run out, `decode` left a waiting request it was handed out of the step (as it
    does the ones it preempts), and the run went on without it and without an error; a finished one
    stopped the run on the memory manager's KeyError or assert, a request's id in its place on an
    AttributeError; a generator's decodes vanished from the step with UnlimitedMemory; one twice or
    in flight was refused only after its memory grew; the rest of a prompt its own prompt_share cut was fed
    one token a step, that prompt_share never read again.
    Each is now refused, with every memory manager, before decode acts."""
    mem = MEMORIES[memory]()
    engine = kind(clock(), mem, SchedulerConfig(max_bs=2, n_workers=n_workers), scheduler=policy)
    engine.start([Request(i, 0.0, 8, 2 + 2 * i) for i in range(4)])
    stops_at_the_door(engine, mem, policy, RuntimeError, match)


class ByPromptLength(Scheduler):
    """Orders the queue by a bare number, not a tuple."""
    def queue_key(self, req):
        return req.prompt_len


class SkipsInit(Scheduler):
    """An __init__ of its own that does not call Scheduler's."""
    def __init__(self, config, memory):
        self.seen = {}


class SkipsStart(Scheduler):
    """A start of its own that does not call Scheduler's."""
    def start(self, requests=None):
        self.seen = {}


class DropsTheRequests(Scheduler):
    """Calls Scheduler's start, but without the run's requests."""
    def start(self, requests=None):
        super().start()


@pytest.mark.parametrize("kind", [Engine, FastEngine])
@pytest.mark.parametrize("policy, says", [
    (SkipsInit, "SkipsInit was not set up as a Scheduler: it has no cfg, memory, budget, waiting, running, tokens, "
                "release_step, n_batches, n_done; a policy's __init__, where it has one, calls "
                "super().__init__(config, memory)"),
    (SkipsStart, "SkipsStart was not set up as a Scheduler: it has no waiting, running, tokens, release_step, "
                 "n_batches, n_done; "),
    (DropsTheRequests, "DropsTheRequests.start set up a run of 0 requests where the engine started one of 3; a "
                       "policy's __init__, where it has one, calls super().__init__(config, memory), and its "
                       "start(requests) calls super().start(requests) with the requests it is given"),
])
def test_a_new_policy_that_skips_the_scheduler_s_set_up_is_refused_naming_the_call(kind, policy, says):
    """A policy's own __init__ or start that skips Scheduler's (docs/extending.md: "State of its own is
    set in start") is refused when the engine is built or the run starts, not with an AttributeError
    or IndexError from inside a step; the requests of a refused start are free for another run."""
    reqs = [Request(i, 0.0, prompt_len=4, output_len=3) for i in range(3)]
    engines = []                                # (kept: a refused run's engine still alive)
    with pytest.raises(RuntimeError, match=re.escape(says)):
        engines.append(kind(clock(), UnlimitedMemory(), SchedulerConfig(max_bs=2), scheduler=policy))
        engines[0].run(reqs)
    kind(clock(), UnlimitedMemory(), SchedulerConfig(max_bs=2)).run(reqs)
    assert all(r.status is Status.FINISHED for r in reqs)


def test_a_refused_start_ends_the_run_it_replaced_so_no_step_goes_on_with_it():
    """A live run going, then a start the policy's set-up refuses: the live run's requests were let go
    (ABORTED), so a step after the refusal is refused as on any failed run, not run on with a queue the
    refused start emptied (which reported the policy stalled, its two requests 'unfinished')."""
    eng = Engine(clock(), UnlimitedMemory(), SchedulerConfig(max_bs=2), scheduler=DropsTheRequests)
    eng.start_live()
    live = [Request(i, 0.0, prompt_len=4, output_len=5) for i in range(2)]
    for r in live:
        eng.add(r)
    eng.step()
    with pytest.raises(RuntimeError, match="DropsTheRequests.start set up a run of 0 requests"):
        eng.start([Request(i, 0.0, prompt_len=4, output_len=3) for i in range(3)])
    assert all(r.status is Status.ABORTED for r in live)
    with pytest.raises(RuntimeError, match="^the run stopped on an error and has no result; start a new run$"):
        eng.step()


@pytest.mark.parametrize("kind", [Engine, FastEngine])
def test_a_new_policy_s_queue_key_that_is_no_tuple_stops_the_run_saying_what_a_key_is(kind):
    mem = UnlimitedMemory()
    with pytest.raises(RuntimeError, match=r"^ByPromptLength.queue_key gave 8 \(int\) for request 0: a queue key is "
                                           r"a tuple \(\(x,\) to order by one value x\), which add follows with "
                                           r"the arrival order$"):
        kind(clock(), mem, SchedulerConfig(max_bs=2), scheduler=ByPromptLength).run(
            [Request(i, 0.0, 8, 4) for i in range(3)])
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)
    with pytest.raises(RuntimeError, match=r"^ByPromptLength.queue_key gave "):
        api.simulate("orca", 8.0, 4, scheduler=ByPromptLength)


class NoPriorityIsNone(Scheduler):
    """Orders by a priority that some requests lack: None, which no number compares with."""
    def queue_key(self, req):
        return (None if req.req_id % 2 else -req.prompt_len,)


class ByPromptLengthOfTheOddOnes(Scheduler):
    """Keys of two lengths: the odd requests' prompt length would be compared with the others' arrival."""
    def queue_key(self, req):
        return (req.prompt_len,) if req.req_id % 2 else ()


@pytest.mark.parametrize("kind", [Engine, FastEngine])
@pytest.mark.parametrize("policy, why", [
    (NoPriorityIsNone, r"None at place 0 does not compare with -8 of its first key \(-8,\)"),
    (ByPromptLengthOfTheOddOnes, r"has 1 values, but its first key, \(\), has 0")])
def test_a_new_policy_s_queue_keys_that_do_not_compare_stop_the_run_saying_what_keys_are(kind, policy, why):
    with pytest.raises(RuntimeError, match=rf"^{policy.__name__}.queue_key gave \S+ for request 1, which {why}: the "
                                           r"keys of one queue are tuples of one length"):
        kind(clock(), UnlimitedMemory(), SchedulerConfig(max_bs=2), scheduler=policy).run(
            [Request(i, 0.0, 8, 4) for i in range(3)])


class NaNForRequest(Scheduler):
    """Orders by prompt length, but gives `nan` for request `which` (a prediction that failed, say)."""
    which, nan = 1, math.nan

    def queue_key(self, req):
        return (self.nan if req.req_id == self.which else float(req.prompt_len),)


@pytest.mark.parametrize("kind", [Engine, FastEngine])
@pytest.mark.parametrize("which, nan", [(0, math.nan), (1, math.nan), (2, np.float32("nan"))])
def test_a_new_policy_s_queue_key_holding_a_nan_stops_the_run_naming_the_request_and_the_key(kind, which, nan):
    """A NaN compares false both ways with every value, so heapq raised nothing and the queue came
    out in a silently wrong order; it is refused whether it is the first key given or a later one."""
    policy = type("NaNForRequest", (NaNForRequest,), {"which": which, "nan": nan})
    mem = UnlimitedMemory()
    key = re.escape(repr((nan,)))
    with pytest.raises(RuntimeError, match=rf"^NaNForRequest.queue_key gave {key} for request {which}, which holds "
                                           rf"{re.escape(repr(nan))} at place 0, a value not equal to itself \(NaN\) "
                                           r"that compares false both ways with every value: the keys of one queue"):
        kind(clock(), mem, SchedulerConfig(max_bs=2), scheduler=policy).run(
            [Request(i, 0.0, 8 + i, 4) for i in range(3)])
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)


def evicts(pick):
    """A new policy whose `victim` is `pick(scheduler, candidates)`."""
    class Evicts(Scheduler):
        def victim(self, candidates):
            return pick(self, candidates)
    return Evicts


WRONG_VICTIMS = {
    "waiting": (evicts(lambda s, c: s.waiting[0][1]), r"request 4, which is waiting, not in running"),
    "not_a_request": (evicts(lambda s, c: c[0].req_id), r"2 \(int\), not a Request"),
    "grown": (evicts(lambda s, c: min(s.running, key=s.arrival_order)),
              r"request 0, running, but its memory grew for this step already"),
}


@pytest.mark.parametrize("kind", [Engine, FastEngine])
@pytest.mark.parametrize("policy, why", WRONG_VICTIMS.values(), ids=WRONG_VICTIMS)
def test_a_new_policy_s_victim_that_is_not_a_candidate_stops_the_run_before_it_is_preempted(kind, policy, why):
    """Four requests of 8 tokens fill 32 of 38 slots; in batch 2 requests 0 and 1 grow, request 2
    does not fit, and 4 and 5 wait. A waiting victim or a request's id stopped the run on
    list.remove's ValueError; request 0, whose memory grew this step, would have been preempted
    holding a token the step never computes."""
    mem = TokenMemory(38)
    with pytest.raises(RuntimeError, match=rf"^Evicts.victim gave {why}, in batch 2: the victim is one of the "
                                           r"candidates it is given, the running requests whose memory the step "
                                           r"has not grown yet \(the one in need among them\)$"):
        kind(clock(), mem, SchedulerConfig(max_bs=4), scheduler=policy).run(
            [Request(i, 0.0, 8, 20) for i in range(6)])
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)


@pytest.mark.parametrize("kind", [Engine, FastEngine])
def test_a_new_policy_s_victim_taken_out_of_its_candidates_is_still_one_of_them(kind):
    """A policy may use the list it is given as its own (`candidates.pop()`): the check reads the
    candidates the scheduler offered, which the policy's copy leaves as they were (the check read
    the list after the pop and refused request 3, a candidate, as grown this step)."""
    mem = TokenMemory(38)
    res = kind(clock(), mem, SchedulerConfig(max_bs=4), scheduler=evicts(lambda s, c: c.pop())).run(
        [Request(i, 0.0, 8, 20) for i in range(6)])
    assert res.n_preemptions.sum() > 0 and (mem.slots_reserved, mem.slots_used) == (0, 0)


class FillsABatchOfItsOwn(Scheduler):
    """Fills a new batch and returns it: the batch `schedule` gave it stays empty."""
    def select(self, batch, ready):
        mine = Batch(batch.index, [], batch.totals)
        super().select(mine, ready)
        return mine


@pytest.mark.parametrize("kind", [Engine, FastEngine])
def test_a_new_policy_that_leaves_its_batch_empty_is_told_which_batch_select_fills(kind):
    """Its admissions moved requests into running, but no step ever ran them: the run stops where
    nothing more arrives, and says what select is for."""
    mem = UnlimitedMemory()
    with pytest.raises(RuntimeError, match=r"^FillsABatchOfItsOwn stalled: it schedules nothing, nothing more will "
                                           r"arrive, and 3 requests are unfinished \(1 waiting, 2 running\) at "
                                           r"t=0.0: .*its own FillsABatchOfItsOwn\.select\. A policy's select fills "
                                           r"the Batch it is given: .*\(it returns nothing\)$"):
        kind(clock(), mem, SchedulerConfig(max_bs=2), scheduler=FillsABatchOfItsOwn).run(
            [Request(i, 0.0, 8, 4) for i in range(3)])
    assert (mem.slots_reserved, mem.slots_used) == (0, 0)


class EvenFirstWithNoPriority(Scheduler):
    """Keys whose second place is None for every request: never ordered, as tuples compare."""
    def queue_key(self, req):
        return (req.req_id % 2, None)


@pytest.mark.parametrize("kind", [Engine, FastEngine])
def test_a_new_policy_s_queue_keys_may_hold_equal_values_that_do_not_order(kind):
    """(0, None) and (1, None) order by their first place, as heapq compares them: not refused."""
    res = kind(clock(), UnlimitedMemory(), SchedulerConfig(max_bs=2), scheduler=EvenFirstWithNoPriority).run(
        [Request(i, 0.0, 8, 4) for i in range(3)])
    first_token_step = {r.req_id: int(res.token_step[res.token_offsets[i]]) for i, r in enumerate(res.requests)}
    assert first_token_step[0] == first_token_step[2] < first_token_step[1]


class ByPromptLengthFirst(Scheduler):
    def queue_key(self, req):
        return (req.prompt_len,)


@pytest.mark.parametrize("knobs, knob, kind, default", [
    (dict(static=True), "static=True", "StaticScheduler", r"static=False \(in api, a system other than 'static'\)"),
    (dict(prefill="prefill_first"), "prefill='prefill_first'", "PrefillFirstScheduler", "prefill='mixed'"),
    (dict(chunked_prefill=True, max_num_batched_tokens=64), "chunked_prefill=True", "ChunkedPrefillScheduler",
     "chunked_prefill=False")])
def test_a_knob_that_picks_the_scheduler_is_refused_beside_a_policy_that_would_ignore_it(knobs, knob, kind, default):
    """A policy given as `scheduler=` is built in place of the class the knobs name: static batching,
    prefill-only steps or chunked prefill asked for beside one that does none of them ran Orca's
    mixed steps, silently. Refused before anything runs, naming both and the fix."""
    says = (rf"^scheduler=ByPromptLengthFirst decides itself how a step is filled, so {re.escape(knob)} would be "
            rf"ignored: give a {kind} subclass as scheduler=, or leave {default}")   # (goodput: and the rate)
    for kind_ in (Engine, FastEngine):
        with pytest.raises(ValueError, match=says):
            kind_(clock(), UnlimitedMemory(), SchedulerConfig(max_bs=2, **knobs), scheduler=ByPromptLengthFirst)
    api_knobs = dict(system="static") if "static" in knobs else dict(knobs, max_bs=2)
    for call in (lambda: api.run("orca", 8.0, 4, scheduler=ByPromptLengthFirst, **api_knobs),
                 lambda: api.simulate("orca", 8.0, 4, scheduler=ByPromptLengthFirst, **api_knobs),
                 lambda: api.goodput("orca", n_requests=4, scheduler=ByPromptLengthFirst, **api_knobs)):
        with pytest.raises(ValueError, match=says):
            call()


def test_a_knob_that_picks_the_scheduler_goes_with_a_policy_of_that_kind():
    """The same knobs beside a policy of the kind they name are what it does, and run."""
    from orca_torch.core.policies import PrefillFirstScheduler, StaticScheduler

    reqs = [Request(i, 0.0, 12, 4) for i in range(3)]
    for policy, knobs in ((StaticScheduler, dict(system="static")),
                          (PrefillFirstScheduler, dict(prefill="prefill_first")),
                          (ChunkedPrefillScheduler, dict(chunked_prefill=True, max_num_batched_tokens=64))):
        assert api.run(reqs, max_bs=2, scheduler=policy, **knobs).n == 3
