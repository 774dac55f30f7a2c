"""The checks of what a new policy (a `Scheduler` subclass given as `scheduler=`) hands the scheduler: the
requests its `select` hands `decode`, the batch it filled, the key its `queue_key` gave, the request
its `victim` named.

The project's own policies are trusted: their invariants are `assert`s. A policy from outside is
code the project did not write, so `policies.make_scheduler` checks that it was set up as a
`Scheduler` (when built, and at every `start`) and wraps its `select`, `decode`, `queue_key` and
`victim`: each call of `decode` is checked before it acts, each batch it fills
before anything acts on it, and a wrong one stops the run at that step, naming the request (or
work) and what is allowed; each queue key and each victim is checked alike.
"""
from __future__ import annotations

from orca_torch.checks import GOT_LIMIT, brief
from orca_torch.core.batch import Batch, ScheduledSeq, step_totals
from orca_torch.core.memory import MemoryManager
from orca_torch.core.request import Request, Status

ALLOWED = ("a batch holds at most max_bs works and max_num_batched_tokens tokens fed, each ScheduledSeq(req, "
           "n_new, n_past) of a request that is running and not in flight (admitted through admit; decodes through "
           "decode, first), each request once, with n_past its num_computed_tokens and 1 <= n_new <= its n_to_feed")
"""What a new policy's `select` may put in a batch, said with every refusal."""

SET_UP = ("a policy's __init__, where it has one, calls super().__init__(config, memory), and its start(requests) "
          "calls super().start(requests) with the requests it is given: they set up the queue, the running list "
          "and the run's columns")
"""How a new policy keeps the state `Scheduler` sets up, said with every refusal of a policy that did not."""

STATE = ("cfg", "memory", "budget", "waiting", "running", "tokens", "release_step", "n_batches", "n_done")
"""What `Scheduler.__init__` and `Scheduler.start` set, which every call of the scheduler reads."""

DECODES = ("decode takes a list of requests that are running and not in flight (those of select's ready), each "
           "once, each needing one token fed; a waiting one joins running through admit")
"""What a new policy's `select` may hand `decode`, said with every refusal of a call."""


def _not_running(r: Request, in_running: set[int]) -> str | None:
    """Where `r` is not a running request of the scheduler's `running` (`in_running`: their ids),
    its status and whether it is in `running` ("waiting, not in running"); None where it is."""
    if id(r) in in_running and r.status is Status.RUNNING:
        return None
    return f"{r.status.value}, {'in' if id(r) in in_running else 'not in'} running"


def check_decodes(batch: Batch, decodes: object, policy: str, running: list[Request]) -> None:
    """Refuse a call of `decode` from `policy`'s `select` before it acts: a batch that already holds
    works (decode sets the batch's works and totals to the decodes', so those would be lost), or a
    decode that is not a running request, in `running` and not in flight, once, needing one token fed
    (one still being fed a prompt `prompt_share` cut would be fed the rest one token a step, with no
    error, while the policy's `prompt_share` is never read again for it). Where memory can run
    out, `decode` leaves out of the step a request that is waiting (the one it preempted), so a
    queued request handed to it would vanish from the step with no error; a finished one would stop
    the run in a memory manager, naming neither the policy nor the rule."""
    where = f"{policy}.select filled batch {batch.index} wrong: it called decode"
    if batch.works:
        raise RuntimeError(f"{where} on a batch that already holds {len(batch.works)} works; decode sets the "
                           "batch's works and totals to the decodes' (the works there would be lost): call it "
                           f"first, then admit; {ALLOWED}")
    if not isinstance(decodes, (list, tuple)):
        raise RuntimeError(f"{where} with a {type(decodes).__name__}, not a list of requests; {DECODES}")
    in_running, seen = {id(r) for r in running}, set()
    for r in decodes:
        why = None
        if not isinstance(r, Request):
            why = f"{brief(r)} ({type(r).__name__}), not a Request"
        elif (place := _not_running(r, in_running)) is not None:
            why = f"request {brief(r.req_id)}, which is {place}"
        elif id(r) in seen:
            why = f"request {brief(r.req_id)} twice"
        elif r.n_to_feed != 1:
            why = (f"request {brief(r.req_id)}, which needs {r.n_to_feed} tokens fed, not one: decode would feed the "
                   "rest of a prompt that prompt_share cut one token a step; select feeds it its next share as a "
                   "work of its own, ScheduledSeq(req, n, req.num_computed_tokens), as ChunkedPrefillScheduler.select "
                   "does (a policy that cuts prompts subclasses it)")
        if why:
            raise RuntimeError(f"{where} with {why}; {DECODES}")
        seen.add(id(r))


def check_set_up(scheduler: object, policy: str, n_requests: int) -> None:
    """Refuse `policy`, just built or just started on a run of `n_requests`, unless `Scheduler.__init__`
    and `Scheduler.start` set up its state for that run: an override that skipped them would stop the
    run on an AttributeError or an IndexError deep in the scheduler, naming neither the policy nor the
    rule."""
    missing = [name for name in STATE if not hasattr(scheduler, name)]
    if missing:
        raise RuntimeError(f"{policy} was not set up as a Scheduler: it has no {', '.join(missing)}; {SET_UP}")
    if len(scheduler.release_step) != n_requests:
        raise RuntimeError(f"{policy}.start set up a run of {len(scheduler.release_step)} requests where the engine "
                           f"started one of {n_requests}; {SET_UP}")


def check_key(key: object, policy: str, req: Request, first: tuple | None) -> tuple:
    """`key`, the one `policy`'s `queue_key` gave for `req`, refused unless it is a tuple (`add`
    follows it with the arrival order, so a bare number would stop the run on a TypeError that names
    neither the policy nor the rule) of the length of `first`, the first key it gave (None: this is
    it), whose values compare with `first`'s place by place where they differ: a key of another
    length would be compared with another's arrival, the queue silently out of order, and a value
    that does not compare (None among numbers) would stop the run on a TypeError inside `heapq`
    (values equal at a place, None beside None, are passed over there as here). A NaN, which
    compares false both ways with every value, is refused in any key: it raises nothing in `heapq`,
    whose order it breaks silently."""
    if not isinstance(key, tuple):
        raise RuntimeError(f"{policy}.queue_key gave {brief(key, GOT_LIMIT)} ({type(key).__name__}) for request "
                           f"{brief(req.req_id)}: a queue key is a tuple ((x,) to order by one value x), which add "
                           "follows with the arrival order")
    why = next((f"holds {brief(a)} at place {i}, a value not equal to itself (NaN) that compares false both "
                "ways with every value" for i, a in enumerate(key) if a != a), None)
    if why is None and first is not None:
        why = _unlike(key, first)
    if why:
        raise RuntimeError(f"{policy}.queue_key gave {brief(key, GOT_LIMIT)} for request {brief(req.req_id)}, which "
                           f"{why}: the keys of one queue are tuples of one length whose values compare place by place "
                           "(the queue is ordered by them, then by arrival)")
    return key


def _unlike(key: tuple, first: tuple) -> str | None:
    """How `key` fails to compare with `first` place by place (None: it compares)."""
    if len(key) != len(first):
        return f"has {len(key)} values, but its first key, {brief(first, GOT_LIMIT)}, has {len(first)}"
    for i, (a, b) in enumerate(zip(key, first)):
        try:
            if a != b:                          # (as tuples compare: equal values are never ordered)
                a < b
        except TypeError:
            return (f"{brief(a)} at place {i} does not compare with {brief(b)} of its first key "
                    f"{brief(first, GOT_LIMIT)}")
    return None


def check_victim(victim: object, policy: str, candidates: list[Request], running: list[Request], step: int
                 ) -> Request:
    """`victim`, the request `policy`'s `victim` named among `candidates` for `decode` to preempt in
    batch `step`, refused unless it is one of them: a waiting or finished one, or no request, would
    stop the run on `list.remove`'s ValueError, which names neither the policy nor the rule, and a
    running one whose memory this step grew already would, swapped out, be swapped back in with a
    token that was never computed."""
    if any(victim is c for c in candidates):
        return victim
    if not isinstance(victim, Request):
        why = f"{brief(victim)} ({type(victim).__name__}), not a Request"
    elif (place := _not_running(victim, {id(r) for r in running})) is not None:
        why = f"request {brief(victim.req_id)}, which is {place}"
    else:
        why = f"request {brief(victim.req_id)}, running, but its memory grew for this step already"
    raise RuntimeError(f"{policy}.victim gave {why}, in batch {step}: the victim is one of the candidates it is "
                       "given, the running requests whose memory the step has not grown yet (the one in need among "
                       "them)")


def check_filled(batch: Batch, policy: str, running: list[Request], max_bs: int, budget: int,
                 memory: MemoryManager) -> None:
    """Refuse a batch that `policy`'s `select` filled wrong (`running`: the scheduler's running
    requests, each of which must hold memory), at the step that did it: run on, it would surface
    later and elsewhere (a memory manager's missing key, memory not freed at the end, a run that
    never ends) or not at all (a request fed twice, or past its prompt)."""
    where = f"{policy}.select filled batch {batch.index} wrong"
    in_running, seen = {id(r) for r in running}, set()
    for i, w in enumerate(batch.works):
        why = None
        if not (isinstance(w, ScheduledSeq) and isinstance(w.req, Request)):
            what = type(w.req if isinstance(w, ScheduledSeq) else w).__name__
            why = f"works[{i}] is a {what}, not a ScheduledSeq of a Request"
        elif (place := _not_running(w.req, in_running)) is not None:
            why = f"request {brief(w.req.req_id)} is {place}"
        elif id(w.req) in seen:
            why = f"request {brief(w.req.req_id)} is in it twice"
        elif w.n_past != w.req.num_computed_tokens:
            why = (f"request {brief(w.req.req_id)} has n_past={brief(w.n_past)}, but {w.req.num_computed_tokens} of "
                   "its tokens are stored")
        elif type(w.n_new) is not int or not 1 <= w.n_new <= w.req.n_to_feed:
            why = f"request {brief(w.req.req_id)} has n_new={brief(w.n_new)}, but it needs {w.req.n_to_feed} tokens fed"
        if why:
            raise RuntimeError(f"{where}: {why}; {ALLOWED}")
        seen.add(id(w.req))
    for r in running:
        if not memory.holds(r):
            raise RuntimeError(f"{where}: request {brief(r.req_id)} is in running but holds no memory in "
                               f"{type(memory).__name__}: a request joins running through admit, which sets its "
                               f"memory aside (memory.try_admit); {ALLOWED}")
    if len(batch.works) > max_bs:
        raise RuntimeError(f"{where}: it holds {len(batch.works)} works, past max_bs={max_bs}; {ALLOWED}")
    if (n_fed := sum(w.n_new for w in batch.works)) > budget:
        raise RuntimeError(f"{where}: it feeds {n_fed} tokens, past max_num_batched_tokens={budget}; admit takes "
                           f"the budget a step has left (less what it already feeds); {ALLOWED}")
    decodes = batch.works[:batch.totals.n_seqs]
    swapped_in = {id(s.req) for s in batch.swapped_in}
    for w in batch.works[len(decodes):]:        # past the decodes: prompts, chunks, recomputes, swap-ins
        r = w.req
        if r.n_generated and r.n_to_feed == 1 and id(r) not in swapped_in:
            raise RuntimeError(f"{where}: request {brief(r.req_id)} has made {r.n_generated} tokens and needs one "
                               "fed, a decode, but it is not among the decodes batch.totals counts: put in by hand, "
                               f"not by decode, which grows its memory first and preempts when it cannot; {ALLOWED}")
    if batch.totals != step_totals(decodes):
        raise RuntimeError(f"{where}: batch.totals is {batch.totals}, but the {len(decodes)} decodes it counts "
                           f"are {step_totals(decodes)}; leave batch.totals to decode, which sets those of its "
                           "decodes (schedule adds the rest)")
