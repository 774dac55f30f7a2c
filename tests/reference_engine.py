"""Orca's Algorithm 1 as one plain loop: the oracle the real engine is tested against (lecture §4.3, §5.1).

Written apart from `scheduler.py`, with no heaps, no fast engine and no `Batch` objects: a waiting list, a running list, the counters on each
request, and every step built as a list of `(req, n_new, n_past)` and priced by `step`. It follows
the lecture's pseudocode with `n_workers = 1`, with one deliberate order (vLLM's, and the engine's):
the running requests first make room to grow (evicting the latest arrival when the memory runs out,
lecture 3), and only a step that evicted no one admits new requests.

`step(works) -> (duration, tokens)`: `works` lists every seat that computes, `(None, 1, ctx)` for a
static batch's idle seat; `tokens` (or None) has one token per live work, in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RefStep:
    start: float
    end: float
    n_seqs: int
    n_tokens: int
    reserved: int
    used: int
    works: list  # (req_id, n_new, n_past) of the live requests


@dataclass
class RefResult:
    times: dict = field(default_factory=dict)    # req_id -> the time of each of its tokens
    tokens: dict = field(default_factory=dict)   # req_id -> token ids (when `step` returns them)
    steps: list = field(default_factory=list)
    evictions: dict = field(default_factory=dict)


def reference_run(requests, step, memory, max_bs, order="fcfs", prefill="mixed", token_budget=None,
                  static=False, idle_seats_cost=True) -> RefResult:
    pos = {r.req_id: i for i, r in enumerate(requests)}   # requests come sorted by arrival
    for r in requests:
        r.reset()
    memory.reset()
    out = RefResult({r.req_id: [] for r in requests}, {r.req_id: [] for r in requests})
    out.evictions = {r.req_id: 0 for r in requests}
    budget = token_budget if token_budget is not None else float("inf")
    waiting, running, batch, idle = [], [], [], {}   # batch, idle: static batching's members, idle seats
    t, nxt, done = 0.0, 0, 0
    origin = requests[0].arrival_s if requests else 0.0   # the clock counts from the first arrival

    def queue_key(r):  # FCFS: arrival; SPF: predicted tokens still to come, then arrival
        return ((r.predicted_output - r.n_generated,) if order == "spf" else ()) + (r.arrival_s, pos[r.req_id])

    def admit(seats, tokens_left):  # in queue order; when the head does not fit, stop (don't skip)
        waiting.sort(key=queue_key)
        new = []
        while waiting and len(new) < seats:
            need = waiting[0].prompt_len + waiting[0].n_generated   # a readmitted request recomputes
            if need > tokens_left or not memory.try_admit(waiting[0]):
                break
            new.append(waiting.pop(0))
            tokens_left -= need
        return new

    def make_room(decoding):  # each decoder stores one more token; evict the latest arrival if it can't
        evicted = False
        for r in sorted(decoding, key=lambda r: pos[r.req_id]):
            while r in running and not memory.grow(r, 1):
                victim = max(running, key=lambda q: pos[q.req_id])
                running.remove(victim)
                memory.free(victim)
                victim.num_computed_tokens = 0
                out.evictions[victim.req_id] += 1
                waiting.append(victim)
                evicted = True
        return [r for r in decoding if r in running], evicted

    while done < len(requests):
        while nxt < len(requests) and requests[nxt].arrival_s - origin <= t:
            waiting.append(requests[nxt])
            nxt += 1
        decoding, new, evicted = list(running), [], False
        if static:
            if not batch:                       # request-level: a new batch only when the engine is idle
                new = batch = admit(max_bs, budget)
        elif prefill == "prefill_first":
            new = admit(max_bs - len(running), budget)
            if new:
                decoding = []                   # a step that admits runs only prefills
        if decoding:
            decoding, evicted = make_room(decoding)
        if not static and prefill == "mixed" and not evicted:
            new = admit(max_bs - len(decoding), budget - len(decoding))
        for r in new:
            memory.grow(r, r.prompt_len + r.n_generated)
        works = [(r, r.prompt_len + r.n_generated, 0) for r in new] + [(r, 1, r.num_computed_tokens) for r in decoding]
        seats = [(None, 1, ctx) for ctx in idle.values()]
        if not works:
            if not evicted:                     # nothing to run: wait for the next arrival
                if nxt == len(requests):
                    raise RuntimeError("deadlock: nothing runs and nothing arrives")
                t = requests[nxt].arrival_s - origin
            continue
        duration, tokens = step(works + seats)
        start, t = t, t + duration
        out.steps.append(RefStep(start, t, len(works) + len(seats), sum(n for _, n, _ in works + seats),
                                 memory.slots_reserved, memory.slots_used,
                                 [(r.req_id, n, p) for r, n, p in works]))
        for rid in idle:
            idle[rid] += 1
        for i, (r, n_new, n_past) in enumerate(works):
            r.num_computed_tokens = n_past + n_new
            r.n_generated += 1
            out.times[r.req_id].append(t)
            if tokens is not None:
                out.tokens[r.req_id].append(tokens[i])
            if r in new:
                running.append(r)
            if r.n_generated == r.output_len:   # finished: leaves at once (static: its seat stays)
                running.remove(r)
                done += 1
                if not static:
                    memory.free(r)
                elif idle_seats_cost:
                    idle[r.req_id] = r.num_computed_tokens
        if static and batch and not running:    # the batch's last request finished
            for r in batch:
                memory.free(r)
            batch, idle = [], {}
    return out
