"""The live engine's request accounting: every request `submit` takes in (every id it gives) is
counted once in `request_success_total`, by the reason its last event gives, however it ended
(finished, stopped on end-of-sequence, its client gone before or after its first token or after
its end, the engine failed), and each stream gets its last event once; the memory is back at zero
at the end (lecture §4.1: requests join and leave a running batch)."""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

from orca_torch.core.engine import Engine
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.model.paged_kv_cache import PagedKVManager
from orca_torch.model.torch_executor import TorchExecutor
from orca_torch.serve.live import Event, LiveEngine, ShuttingDown, Stream
from orca_torch.serve.metrics import Metrics
from orca_torch.serve.stop import Answer
from orca_torch.serve.tokenizer import WordDetokenizer, preset_words
from tiny_model import MODEL, alone

TIMEOUT = 60
LEAVES = ("never", "at_once", "after_yields", "after_k", "after_end")   # where a client goes away


@dataclass(frozen=True)
class Client:
    """One client's plan, drawn before any runs (the engine thread's timing must not shift the draws)."""

    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    leave: str
    yields: int                                 # event-loop turns before it submits (arrivals spread)
    k: int                                      # events read before leaving ("after_k"), loop turns ("after_yields")


def plans(rng: np.random.Generator, n: int) -> list[Client]:
    out = []
    for i in range(n):
        prompt = rng.integers(0, MODEL.spec.vocab, size=int(rng.integers(2, 40))).tolist()
        leave = "never" if i == 0 else str(rng.choice(LEAVES, p=[0.5, 0.1, 0.1, 0.2, 0.1]))
        out.append(Client(prompt, int(rng.integers(1, 60)), i != 0 and bool(rng.random() < 0.5), leave,
                          int(rng.integers(0, 30)), int(rng.integers(0, 20))))
    return out


def paged_live(eos: int | None, n_slots: int = 256) -> LiveEngine:
    """A live `tiny` engine on paged memory small enough that 8 requests at once preempt (`eos`
    None: the model has no end-of-sequence token)."""
    kv = PagedKVManager(MODEL.spec, n_slots // 16, block_size=16)
    engine = Engine(TorchExecutor(MODEL, kv), PagedMemory(n_slots, block_size=16), SchedulerConfig(max_bs=8))
    return LiveEngine(engine, Metrics("tiny"), stop_token_ids=[] if eos is None else [eos])


def is_last(ev: Event) -> bool:
    return ev.finish_reason is not None or ev.error is not None


async def run_client(live: LiveEngine, c: Client, text: Answer | None = None) -> tuple[Stream, list[Event], bool]:
    """Submit `c`'s request (with `text`: its stop strings') and read its stream as planned:
    (stream, events read, whether it left)."""
    for _ in range(c.yields):
        await asyncio.sleep(0)
    req = live.new_request(c.prompt, c.max_tokens, c.ignore_eos)
    live.check(req)
    s = live.submit(req, text)
    evs: list[Event] = []
    if c.leave in ("at_once", "after_yields"):
        for _ in range(c.k if c.leave == "after_yields" else 0):
            await asyncio.sleep(0)
        live.abort(s)
        return s, evs, True
    while not evs or not is_last(evs[-1]):
        if c.leave == "after_k" and len(evs) >= c.k:
            live.abort(s)
            return s, evs, True
        evs.append(await asyncio.wait_for(s.queue.get(), TIMEOUT))
    if c.leave == "after_end":                  # (a handler that aborts after the end changes nothing)
        live.abort(s)
    return s, evs, False


def assert_accounted(live: LiveEngine, ends: list[tuple[Stream, list[Event], bool]]) -> None:
    """After `live.stop()`: each stream's events (read, and left in its queue) hold at most one
    last event, and it is their last; one exactly where the client stayed; the counts by reason are
    those last events' reasons, plus one "abort" per client gone before any; every id given counted."""
    reasons: Counter = Counter()
    for s, read, left in ends:
        evs = read + [s.queue.get_nowait() for _ in range(s.queue.qsize())]
        lasts = [i for i, ev in enumerate(evs) if is_last(ev)]
        assert len(lasts) <= 1 and lasts in ([], [len(evs) - 1]), (s.req.req_id, evs)
        assert lasts or left, (s.req.req_id, evs)
        reasons[evs[-1].finish_reason if lasts else "abort"] += 1
    with live.metrics.lock:
        finished = dict(live.metrics.finished)
    assert finished == {"length": reasons["length"], "stop": reasons["stop"], "abort": reasons["abort"]}
    assert sorted(s.req.req_id for s, _, _ in ends) == list(range(len(ends)))
    assert sum(finished.values()) == len(ends)
    eng = live.engine
    assert eng.memory.slots_reserved == eng.memory.slots_used == eng.executor.kv.slots_reserved == 0
    assert live.n_running == live.n_waiting == 0


async def serve(live: LiveEngine, clients: list[Client]) -> list[tuple[Stream, list[Event], bool]]:
    """Every client at once, then `stop` (its events are in their queues when it returns: the
    engine thread sent them before the loop learns that `stop` returned)."""
    try:
        ends = await asyncio.wait_for(asyncio.gather(*[run_client(live, c) for c in clients]), TIMEOUT)
    finally:
        await asyncio.to_thread(live.stop)
    return list(ends)


@pytest.mark.parametrize("seed,fail_at", [(0, None), (1, None), (2, 7), (3, 30)])
def test_every_request_is_counted_once_however_it_ended(seed, fail_at):
    """60 clients at once on paged memory (preemptions), a third going away at random points, some
    stopping on end-of-sequence; with `fail_at`, that step fails (the engine starts afresh)."""
    clients = plans(np.random.default_rng(seed), 60)
    live = paged_live(eos=alone(clients[0].prompt, 1)[0])        # (the first stops on its first token)
    ex = live.engine.executor
    real, calls = ex.execute, []

    def fail_once(batch):
        calls.append(batch.index)
        if len(calls) == fail_at:
            raise RuntimeError("injected")
        return real(batch)

    ex.execute = fail_once
    ends = asyncio.run(serve(live, clients))
    assert_accounted(live, ends)
    assert fail_at is None or len(calls) >= fail_at                 # (the failure did happen)
    assert ends[0][1][-1].finish_reason == "stop" or fail_at is not None


def test_a_request_that_ended_before_its_iteration_failed_has_one_last_event():
    """A request finishes in the iteration that took it in; dropping the engine's records after it
    fails: the engine ends the streams it held with the error, not that one, already ended and counted."""
    prompt = [3, 1, 4, 1, 5]
    live = paged_live(eos=None)
    eng = live.engine
    real = eng.forget_done

    def fails_once():
        eng.forget_done = real
        raise RuntimeError("injected where the records are dropped")

    eng.forget_done = fails_once

    async def run():
        s = live.submit(live.new_request(prompt, 1))
        ev = await asyncio.wait_for(s.queue.get(), TIMEOUT)
        return [(s, [ev], False)] + await serve(live, [])

    ends = asyncio.run(run())
    assert ends[0][1] == [Event(tuple(alone(prompt, 1)), "length")]
    assert_accounted(live, ends)
    assert eng.forget_done is real              # (the failure did happen)


def held(live: LiveEngine) -> dict[str, int]:
    """How many records of requests the server holds, structure by structure."""
    eng = live.engine
    return {"requests": len(eng.requests), "arrivals": len(eng._arrivals), "ids": len(eng._live_ids),
            "release_step": len(eng.scheduler.release_step), "token_columns": len(eng.scheduler.tokens.first),
            "window": len(live.requests), "steps_window": len(live.steps)}


def test_a_server_never_idle_holds_records_bounded_by_its_requests_in_flight():
    """A server that never falls idle runs one live run for ever: the engine drops its records of
    the requests that have left it once they are as many as those in it (`Engine.forget_done`), and
    the windows kept to inspect hold their last ones, so what it holds does not grow with the
    requests it has served: after 40 requests and after 80 more, at most those in flight and as
    many that left. A long request in flight throughout makes its tokens as alone."""
    kv = PagedKVManager(MODEL.spec, 64, block_size=16)
    engine = Engine(TorchExecutor(MODEL, kv), PagedMemory(1024, block_size=16), SchedulerConfig(max_bs=8))
    live = LiveEngine(engine, Metrics("tiny"), keep_steps=8, keep_requests=4)
    long_prompt = [2, 7, 1]
    counts = []

    async def read(s: Stream) -> list[int]:
        evs = [await asyncio.wait_for(s.queue.get(), TIMEOUT)]
        while not is_last(evs[-1]):
            evs.append(await asyncio.wait_for(s.queue.get(), TIMEOUT))
        assert evs[-1].finish_reason == "length"
        return [t for e in evs for t in e.ids]

    async def run():
        busy = live.submit(live.new_request(long_prompt, 500))     # one token an iteration: never idle
        reading = asyncio.create_task(read(busy))
        for n in (40, 80):
            streams = [live.submit(live.new_request([3, 1, 4, i % 4], 2)) for i in range(n)]
            outs = await asyncio.gather(*[read(s) for s in streams])
            assert outs == [alone([3, 1, 4, i % 4], 2) for i in range(n)]
            counts.append(held(live))
        assert [r.prompt_ids for r in live.requests] == [[3, 1, 4, i % 4] for i in range(76, 80)]
        out = await reading
        await asyncio.to_thread(live.stop)
        return out

    assert asyncio.run(run()) == alone(long_prompt, 500)
    bound = 2 * 8 + 1                           # the long one, and twice the most a step runs
    assert all(max(c.values()) <= bound for c in counts), counts


WORDS = preset_words(MODEL.spec.vocab)


def text_of(ids) -> str:
    return "".join(" " + WORDS[t] for t in ids)


@pytest.mark.parametrize("seed,fail_at,shut_at", [(4, None, None), (5, 9, None), (6, None, 12), (7, None, 4)])
def test_requests_with_stop_strings_end_on_the_token_that_completes_one(seed, fail_at, shut_at):
    """60 clients at once on paged memory (preemptions), half of them with a stop string (a drawn
    token's word, or one never made), a third going away at random points; with `fail_at`, that
    step fails; with `shut_at`, the server shuts down with no grace once that many iterations have
    run. Each request is counted once, by its last event; a stream a stop string ended got the
    text before it, and its request made no token after the one that completed it; the tokens
    generated are those the engine sent, each request ended by length or stop has one end-to-end
    latency, and each step that sent a request tokens but its first an inter-token latency."""
    rng = np.random.default_rng(seed)
    clients = plans(rng, 60)
    stops = []
    for i, c in enumerate(clients):
        at = int(rng.integers(1, c.max_tokens + 1))
        word = WORDS[alone(c.prompt, at)[-1]] if rng.random() < 0.6 else "qqzz"
        stops.append([" " + word] if i % 2 else None)
    live = paged_live(eos=alone(clients[0].prompt, 1)[0])
    ex = live.engine.executor
    real, calls = ex.execute, []

    def step(batch):
        calls.append(batch.index)
        if len(calls) == fail_at:
            raise RuntimeError("injected")
        if len(calls) == shut_at:
            live.shutdown(0.0)
        return real(batch)

    ex.execute = step

    async def client(c: Client, stop: list[str] | None):
        try:
            return await run_client(live, c, None if stop is None else Answer(WordDetokenizer(WORDS), stop))
        except ShuttingDown:                            # (refused: no id given, nothing to count)
            return None

    async def go():
        try:
            return await asyncio.wait_for(asyncio.gather(*[client(c, stops[i]) for i, c in enumerate(clients)]),
                                          TIMEOUT)
        finally:
            await asyncio.to_thread(live.stop)

    ends = asyncio.run(go())
    taken = [(end, stops[i]) for i, end in enumerate(ends) if end is not None]
    for k, ((s, read, left), stop) in enumerate(taken):
        evs = read + [s.queue.get_nowait() for _ in range(s.queue.qsize())]
        taken[k] = (s, evs, left), stop
        ids = [t for ev in evs for t in ev.ids]
        assert (s.req.output_ids or [])[:len(ids)] == ids
        if stop is None or not evs or evs[-1].error is not None:
            continue
        shown, full = "".join(t for ev in evs for t in ev.texts), text_of(ids)
        if evs[-1].finish_reason == "stop" and stop[0] in full:         # (not an end-of-sequence token)
            assert full.index(stop[0]) + len(stop[0]) > len(text_of(ids[:-1])) and shown == full[:full.index(stop[0])]
            assert s.req.n_generated == len(ids)
        elif is_last(evs[-1]):                  # (an end-of-sequence token's text is left out, as vLLM leaves it)
            eos = evs[-1].finish_reason == "stop"
            assert stop[0] not in full and shown == text_of(ids[:-1] if eos else ids)
    assert_accounted(live, [end for end, _ in taken])
    sent = [[ev for ev in evs if ev.ids] for (_, evs, _), _ in taken]
    with live.metrics.lock:
        m = live.metrics
        assert m.generation_tokens == sum(len(ev.ids) for evs in sent for ev in evs)
        assert m.hist["vllm:e2e_request_latency_seconds"].n == m.finished["length"] + m.finished["stop"]
        assert m.hist["vllm:inter_token_latency_seconds"].n == sum(max(len(evs) - 1, 0) for evs in sent)
    assert len(calls) >= max(fail_at or 0, shut_at or 0)          # (the failure, the shutdown did happen)


def test_a_failing_text_ends_its_own_answer_not_the_others():
    """The engine thread makes the text of a request with stop strings; should its tokenizer fail
    there, that answer ends with an error and is counted as aborted, its memory freed, while the
    other requests of the batch run to their ends (an iteration's failure would end them all)."""
    class Broken(Answer):
        def take(self, ids, finish=None, lps=None):
            if self.n >= 2:
                raise RuntimeError("decode failed")
            return super().take(ids, finish, lps)

    live = paged_live(eos=None, n_slots=1024)
    words = preset_words(MODEL.spec.vocab)

    async def go():
        try:
            reqs = [live.new_request([1, 2, 3 + i], 8, True) for i in range(3)]
            streams = [live.submit(r, Broken(WordDetokenizer(words), ["never seen"]) if i == 1 else None)
                       for i, r in enumerate(reqs)]
            out = []
            for s in streams:
                evs = [await asyncio.wait_for(s.queue.get(), TIMEOUT)]
                while not is_last(evs[-1]):
                    evs.append(await asyncio.wait_for(s.queue.get(), TIMEOUT))
                out.append(evs)
            return out
        finally:
            await asyncio.to_thread(live.stop)

    ends = asyncio.run(go())
    assert [evs[-1].finish_reason for evs in ends] == ["length", "abort", "length"]
    assert ends[1][-1].error is not None and "decode failed" in ends[1][-1].error
    assert [sum(len(ev.ids) for ev in evs) for evs in ends] == [8, 2, 8]
    assert dict(live.metrics.finished) == {"length": 2, "stop": 0, "abort": 1}
    eng = live.engine
    assert eng.memory.slots_reserved == eng.memory.slots_used == eng.executor.kv.slots_reserved == 0


class HoldingDetokenizer(WordDetokenizer):
    """Holds every token's text back until the answer ends, as a BPE detokenizer holds a split
    character back (and lets it out, cut short, at the end)."""

    def __init__(self, words: list[str]) -> None:
        super().__init__(words)
        self.ids: list[int] = []

    def add(self, ids, final: bool = False) -> str:
        self.ids += ids
        return super().add(self.ids) if final else ""


def shut_down_at(live: LiveEngine, k: int) -> None:
    """The k-th step the engine executes starts a shutdown with no grace: the streams still running
    are cut at its end."""
    ex, calls = live.engine.executor, []
    real = ex.execute

    def step(batch):
        calls.append(batch.index)
        if len(calls) == k:
            live.shutdown(0.0)
        return real(batch)

    ex.execute = step


def test_a_shutdown_cut_while_text_is_held_back_is_an_error_to_the_client_and_an_abort_to_metrics():
    """The shutdown's grace runs out while an answer's text is held back (it could complete a stop
    string). The server ended the request: its client is told so by an error (status 503) naming
    how many tokens came, not a last piece of text that reads as a whole answer, and /metrics
    counts it as "abort" (no end-to-end latency)."""
    live = paged_live(eos=None, n_slots=1024)
    prompt = [1, 2, 3]
    shut_down_at(live, 3)
    first = text_of(alone(prompt, 1))

    async def go():
        try:
            s = live.submit(live.new_request(prompt, 400, True), Answer(HoldingDetokenizer(WORDS), [first + " "]))
            evs = [await asyncio.wait_for(s.queue.get(), TIMEOUT)]
            while not is_last(evs[-1]):
                evs.append(await asyncio.wait_for(s.queue.get(), TIMEOUT))
            return evs
        finally:
            await asyncio.to_thread(live.stop)

    evs = asyncio.run(go())
    n = sum(len(ev.ids) for ev in evs)
    assert 1 < n < 400 and evs[-1].status == 503
    assert evs[-1].error == (f"the server shut down before the answer was complete (after {n} of at most 400 tokens); "
                             "send the request again")
    assert (evs[-1].finish_reason, "".join(t for ev in evs for t in ev.texts or ())) == ("abort", "")
    with live.metrics.lock:
        assert dict(live.metrics.finished) == {"length": 0, "stop": 0, "abort": 1}
        assert live.metrics.hist["vllm:e2e_request_latency_seconds"].n == 0
        assert live.metrics.generation_tokens == n


def test_a_shutdown_cut_asks_no_answer_for_its_held_back_text_and_ends_each_once():
    """The shutdown's grace runs out: each answer ends with the shutdown's error, and none is asked
    to let out the text it held back (one whose text would fail there once ended as the engine's
    failure, or with no last event), each counted once as aborted, its memory freed."""
    class FailsAtTheEnd(WordDetokenizer):
        def add(self, ids, final: bool = False) -> str:
            if final:
                raise RuntimeError("decode failed")
            return super().add(ids)

    live = paged_live(eos=None, n_slots=1024)
    shut_down_at(live, 3)

    async def go():
        streams = [live.submit(live.new_request([1, 2, 3 + i], 400, True),
                               Answer((FailsAtTheEnd if i == 1 else WordDetokenizer)(WORDS), ["never seen"]))
                   for i in range(3)]
        read: list[list[Event]] = [[], [], []]
        try:
            for i in (0, 2):
                read[i].append(await asyncio.wait_for(streams[i].queue.get(), TIMEOUT))
                while not is_last(read[i][-1]):
                    read[i].append(await asyncio.wait_for(streams[i].queue.get(), TIMEOUT))
        finally:
            await asyncio.to_thread(live.stop)
        await asyncio.sleep(0)
        return [evs + [s.queue.get_nowait() for _ in range(s.queue.qsize())] for evs, s in zip(read, streams)]

    ends = asyncio.run(go())
    lasts = [[ev for ev in evs if is_last(ev)] for evs in ends]
    assert [len(x) for x in lasts] == [1, 1, 1] and all(is_last(evs[-1]) for evs in ends)
    assert [(x[0].finish_reason, x[0].status) for x in lasts] == [("abort", 503)] * 3
    assert all(x[0].error.startswith("the server shut down before the answer was complete") for x in lasts)
    with live.metrics.lock:
        assert dict(live.metrics.finished) == {"length": 0, "stop": 0, "abort": 3}
    eng = live.engine
    assert eng.memory.slots_reserved == eng.executor.kv.slots_reserved == 0


@pytest.mark.parametrize("leave_at", [1, 3])
def test_a_client_gone_while_a_step_ran_gets_none_of_its_tokens_in_the_metrics(leave_at):
    """The client leaves while the step that makes its request's `leave_at`-th token runs (its
    abort reaches the inbox during the step). That token was made after it left: no stream gets
    it, and /metrics counts neither it (`generation_tokens`) nor its latency (a time to first
    token for a client that left before its first token was made, once); the request is one abort."""
    live = paged_live(eos=None, n_slots=1024)
    ex = live.engine.executor
    real, calls, held_stream = ex.execute, [], []

    def step(batch):
        calls.append(batch.index)
        if len(calls) == leave_at:
            live.abort(held_stream[0])
        return real(batch)

    ex.execute = step

    async def go():
        try:
            held_stream.append(live.submit(live.new_request([1, 2, 3], 8, True)))
            deadline = time.monotonic() + TIMEOUT
            while live.metrics.finished["abort"] == 0 and time.monotonic() < deadline:     # (its abort applied)
                await asyncio.sleep(0.01)
        finally:
            await asyncio.to_thread(live.stop)
        s = held_stream[0]
        return [s.queue.get_nowait() for _ in range(s.queue.qsize())]

    evs = asyncio.run(go())
    assert sum(len(ev.ids) for ev in evs) == leave_at - 1 and not any(is_last(ev) for ev in evs)
    m = live.metrics
    assert dict(m.finished) == {"length": 0, "stop": 0, "abort": 1}
    assert m.generation_tokens == leave_at - 1
    assert m.hist["vllm:time_to_first_token_seconds"].n == min(leave_at - 1, 1)
    assert m.hist["vllm:inter_token_latency_seconds"].n == max(leave_at - 2, 0)
    eng = live.engine
    assert eng.memory.slots_reserved == eng.executor.kv.slots_reserved == 0
