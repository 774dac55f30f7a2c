"""The engine loop on the real clock: Orca's iteration-level scheduling, live (lecture §4.1, §4.3).

One thread owns the `Engine` (the same scheduler, memory manager and `TorchExecutor` as every
offline run) and loops: take in what the HTTP side asked for since the last iteration (new requests
join through `Engine.add`, so a request that arrives while a batch runs is admitted at the next
iteration; a departed client's request is dropped through `Engine.abort`, which gives its
reservation and K/V back at once), run ONE iteration (`engine.step()`), and push each request's new
token to its stream the moment the step ends (an asyncio queue, fed through
`loop.call_soon_threadsafe`). A request submitted with its answer (every one the app takes in) has
its text made here too, as its tokens are delivered (`stop.Answer`): the step whose token completes
a stop string ends it, through `Engine.abort`, and no token is made after that one; a text that
fails to be made ends that answer alone, counted as aborted, however it was asked for. A request's
arrival is its time on the server's clock (seconds since start); the engine's clock is moved up to
it, so the step log is on the real clock.

A request runs for `max_tokens` tokens (Orca's workload has no end-of-sequence token). Where the
model has such tokens (`stop_token_ids`: a checkpoint's tokenizer's eos and the `eos_token_id` its
config files list) and the request does not set `ignore_eos`, they are its `stop_token_ids`, with
those the client sent (which `ignore_eos` leaves on): the executor keeps them from being picked
before its `min_tokens`, and generating one after ends the stream with `finish_reason="stop"` and
the request leaves the engine through `abort`, freeing its memory at once, exactly as a finish does
(and as a stop string does). Every iteration goes in `steps` (the last `keep_steps`) and to the log
at INFO level with `log_steps`, every request in `requests` (the last `keep_requests`, with their
prompts' and outputs' ids). Once the requests that have left the engine's run are as many as those
still in it, the engine drops its records of them and of its steps (`Engine.forget_done`), so what
the server holds is bounded by the requests in flight and those two windows, however long it runs
without falling idle. If an iteration fails (the model, or this loop's own bookkeeping), the engine
starts afresh and the streams it held end with an error: no stream is left waiting on a thread that
has died. A request whose logits row alone is not finite (`Engine.failed_rows`) ends with that
error, and the others in its step go on."""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Collection, Hashable

from orca_torch.checks import brief, check_int
from orca_torch.core.batch import Batch
from orca_torch.core.engine import Engine
from orca_torch.core.request import Request, Status
from orca_torch.model.sampling import SamplingParams
from orca_torch.serve.metrics import Metrics
from orca_torch.serve.stop import Answer, ShownLogprob

log = logging.getLogger("orca_torch.serve")


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


@dataclass(frozen=True, slots=True)
class Event:
    """What a stream receives after an iteration: its new tokens, and why it ended (None: it goes
    on). `finish_reason`: "length" (max_tokens reached), "stop" (end-of-sequence, or a stop string
    the last of `ids` completed), "abort" (the server stopped before the end, or the engine failed);
    `error`: why it ended short, the stream ends with it, and a whole answer with it as HTTP
    `status` (500: the engine failed, or the answer's text; 503: the server stopped first), which
    an event without an error has not (None).
    `texts`, to a stream with its answer (`Stream.text`) only: the text pieces its client may see
    now. `logprobs`, to a stream with its answer whose request asks for them
    (`SamplingParams.logprobs`) only: each of `ids`' log probabilities, with their texts. `index`:
    its stream's (`Stream.index`), the choice it belongs to where an answer's streams share a queue.
    `stop_reason`, with a last event "stop" to a stream with its answer: `stop.Answer.stop_reason`."""

    ids: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None
    texts: tuple[str, ...] | None = None
    logprobs: tuple[ShownLogprob, ...] | None = None
    index: int = 0
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        assert (self.error is None) == (self.status is None), f"an error goes with its status: {self}"


@dataclass(eq=False)
class Stream:
    """One request's way back to its HTTP handler: the queue its events arrive on, which the streams
    of one answer's choices share (`submit_all`), each event tagged with its stream's `index`."""

    req: Request
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    sent: int = 0                           # tokens delivered
    last_token_s: float = 0.0               # when the last of them was, on the server's clock
    ended: bool = False                     # the handler received the last event
    text: Answer | None = None              # its answer's text, the engine thread's (None: ids alone)
    index: int = 0                          # its choice in its answer (`Event.index`)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One iteration as the server ran it: its index (counted over the server's life), start and
    end (seconds on the server's clock), each request's `(req_id, n_new, n_past)`: a prefill has
    n_past 0, a decode n_new 1; and `prompt_ends`, the requests whose prompt it fed to its end,
    making their first token (`Engine.prompts_completed`): a chunked prompt's last chunk may be of
    one token, which `works` alone cannot tell from a decode."""

    index: int
    start_s: float
    end_s: float
    works: tuple[tuple[Hashable, int, int], ...]
    prompt_ends: tuple[Hashable, ...] = ()

    @property
    def batch_size(self) -> int:
        return len(self.works)


def work_kind(req: Request, n_new: int, n_past: int, caught_up: bool) -> str:
    """What a request's work in a step is, for the step log: `prefill`, its tokens from the first
    (its prompt, or a recompute's prompt and output); `decode`, its one new token: a single token
    past its prompt that catches the request up (`caught_up`: the work fed the request's tokens to
    their end, so the step made its next); `chunk`, any other work, more of its prompt or of a
    recompute. Not told by the work's tokens alone: a chunk cut to one token, in the middle of a
    prompt or of a recompute (a preempted request fed its prompt and output again) or at a prompt's
    end, is no decode; a recompute's last token, which the request made but was never fed, is."""
    if n_past == 0:
        return "prefill"
    return "decode" if n_new == 1 and n_past >= req.prompt_len and caught_up else "chunk"


UNSUBMITTED = -1
"""The req_id of a request `new_request` made, until `submit` gives it its own (ids count from 0)."""

KEEP_STEPS = 100_000
"""The iterations a server keeps in its step log unless told (`LiveEngine`'s `keep_steps`)."""


class LiveEngine:
    """Runs `engine` in a thread of its own; `submit` a request, `abort` it, `shutdown`, `stop`.

    What it keeps of the past: `steps`, the last `keep_steps` iterations (`/orca/steps`);
    `requests`, the last `keep_requests` requests taken in, with their token ids, to inspect; the
    engine's records of at most as many requests that have left it as there are in it; and the
    metrics' counters and histograms, over the server's life, of a fixed size."""

    def __init__(self, engine: Engine, metrics: Metrics, stop_token_ids: Collection[int] = (),
                 log_steps: bool = False, keep_steps: int = KEEP_STEPS, keep_requests: int = 1_000) -> None:
        keep_steps, keep_requests = check_int("keep_steps", keep_steps, 1), check_int("keep_requests", keep_requests, 1)
        vocab = engine.executor.model.spec.vocab
        outside = sorted(t for t in stop_token_ids if not 0 <= t < vocab)
        if outside:                                     # (else every request's check would refuse them)
            raise ValueError(f"end-of-sequence ids {outside} lie outside the model's vocabulary [0, {vocab}): the "
                             "tokenizer and the model do not match")
        engine.start_live()
        self.engine, self.metrics, self.log_steps = engine, metrics, log_steps
        self.stop_token_ids = frozenset(stop_token_ids)     # the model's end-of-sequence ids (none: a preset)
        self.steps: deque[StepRecord] = deque(maxlen=keep_steps)
        self.requests: deque[Request] = deque(maxlen=keep_requests)   # the last ones taken in, to inspect
        self.t0 = time.perf_counter()
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Stream]] = []
        self._streams: dict[Hashable, Stream] = {}          # the engine thread's own
        self._in_hand = False
        self._ids = itertools.count()
        self.closing = False
        self._deadline: float | None = None
        self._stop = False
        self._ended = False                             # the engine thread has ended (`_end`)
        self.thread = threading.Thread(target=self._run, name="orca-engine", daemon=True)
        self.thread.start()

    def now(self) -> float:
        """Seconds since the server started: the run's clock."""
        return time.perf_counter() - self.t0

    # ---- called from the HTTP side -----------------------------------------------------------------
    def new_request(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True,
                    min_tokens: int = 0, sampling: SamplingParams | None = None,
                    stop_token_ids: Collection[int] = ()) -> Request:
        """The request as the engine will see it (arrival set at `submit`); `check` it first. Its stop
        ids, none made before `min_tokens`: `stop_token_ids` (the client's), and, unless `ignore_eos`,
        the model's end-of-sequence ids. `sampling`: how its tokens are drawn (None: greedy)."""
        p = len(prompt_ids)
        stops = tuple(sorted(set(stop_token_ids) | (set() if ignore_eos else self.stop_token_ids)))
        return Request(UNSUBMITTED, 0.0, p, max_tokens, max_tokens=p + max_tokens, prompt_ids=prompt_ids,
                       min_tokens=min_tokens, stop_token_ids=stops, sampling=sampling)

    def check(self, req: Request) -> None:
        """ValueError unless the engine can serve `req` (context, memory, token ids): read-only. One
        not yet submitted is "the request" in the message: its id, `UNSUBMITTED`, is no id its client
        ever sees (the engine's messages name a request by its id)."""
        try:
            self.engine.check(req)
        except ValueError as e:
            if req.req_id != UNSUBMITTED:
                raise
            raise ValueError(str(e).replace(f"request {brief(UNSUBMITTED)}", "the request")) from None

    def submit(self, req: Request, text: Answer | None = None) -> Stream:
        """Queue `req` for the next iteration: `submit_all` of one request."""
        return self.submit_all([req], [text])[0]

    def submit_all(self, reqs: list[Request], texts: list[Answer | None]) -> list[Stream]:
        """Queue `reqs`, the choices of one answer, for the next iteration, all or none: their
        tokens arrive on one queue the returned streams share, each event tagged with its stream's
        index in `reqs` (`Event.index`). Each is a request of its own to the engine.

        `texts`: each request's answer, its text made in the engine thread (from here on that
        thread's alone), which ends the request on the token that completes a stop string
        ("stop"), counted in /metrics as a finish at its length is; each event carries the text
        pieces its client may see (`Event.texts`). Its tokenizer must be safe to decode with while
        the HTTP side encodes (`tokenizer.py`)."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if self.closing or self._ended:
                raise ShuttingDown("the server is shutting down" if self.closing else "the engine thread has stopped")
            queue: asyncio.Queue = asyncio.Queue()
            streams = []
            for i, (req, text) in enumerate(zip(reqs, texts, strict=True)):
                req.req_id = next(self._ids)
                req.arrival_s = self.now()
                streams.append(Stream(req, queue, loop, text=text, index=i))
            self._inbox += [("add", s) for s in streams]
            self._cond.notify()
        return streams

    def abort(self, *streams: Stream) -> None:
        """Drop their requests at the next iteration boundary, together (their client went away), counted in
        /metrics as "abort". One that has left the engine by then (at its length, an end-of-sequence
        token or a stop string, which it may reach before this lands) stays counted as it left: a
        counter only grows."""
        with self._cond:
            self._inbox += [("abort", s) for s in streams]
            self._cond.notify()

    def shutdown(self, grace_s: float) -> None:
        """Take no new requests; streams still running after `grace_s` seconds end with an error,
        status 503 (`_abort`)."""
        with self._cond:
            self.closing = True
            self._deadline = time.perf_counter() + grace_s
            self._cond.notify()

    def drained(self, timeout: float) -> bool:
        """After `shutdown`: wait until every stream has had its last event (at most `timeout`
        seconds); True if they all have."""
        end = time.perf_counter() + timeout
        while True:
            with self._cond:                    # (the engine thread takes the inbox in hand under it)
                if not (self._inbox or self._in_hand or self._streams):
                    return True
            if time.perf_counter() >= end or not self.thread.is_alive():
                return False
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        """End every stream (with an error, status 503, as a shutdown does) and the engine thread."""
        with self._cond:
            self.closing = self._stop = True
            self._cond.notify()
        self.thread.join(timeout)

    @property
    def serving(self) -> bool:
        """Taking requests: not shutting down, and the engine thread alive."""
        return not self.closing and self.thread.is_alive()

    @property
    def n_waiting(self) -> int:
        """Requests queued in the scheduler, and those submitted since the last iteration (the
        inbox's adds: an abort in it is a request leaving, not one more waiting)."""
        with self._cond:
            arriving = sum(kind == "add" for kind, _ in self._inbox)
        return self.engine.n_waiting + arriving

    @property
    def n_running(self) -> int:
        return self.engine.n_running

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stop) and self.engine.done:
                        self._cond.wait()
                    ops, self._inbox = deque(self._inbox), []
                    stop = self._stop
                    self._in_hand = bool(ops)           # (`drained`: taken, maybe not in `_streams` yet)
                try:
                    if self._iterate(ops, stop):
                        return
                except Exception as e:                 # the engine (or this loop) failed: its streams end
                    log.exception("engine iteration failed")
                    self._fail(f"the engine failed: {e}", [s for kind, s in ops if kind == "add"])   # (not taken)
                finally:
                    self._in_hand = False
        except Exception:                               # starting afresh after a failure failed too
            log.exception("the engine could not start afresh: its thread stops")
        finally:
            self._end()

    def _end(self) -> None:
        """The thread ends (stopped, or failed for good: starting afresh after a failure failed):
        every stream still held or waiting in the inbox gets its last event (and is counted, as
        `_drop` says), and `submit` takes no more, so no client waits on a thread that is gone."""
        with self._cond:
            self._ended = True
            ops, self._inbox = self._inbox, []
        held = [*self._streams.values(), *(s for kind, s in ops if kind == "add")]
        self._streams.clear()
        self._drop(held, "the engine thread has stopped")

    def _iterate(self, ops: deque[tuple[str, Stream]], stop: bool) -> bool:
        """Apply the HTTP side's adds and aborts, then run one iteration and deliver its tokens;
        True once the thread should end. Each op leaves `ops` as it is applied: should one fail,
        the adds still in it are those the engine never took (`_fail` ends them)."""
        eng = self.engine
        while ops:
            kind, s = ops.popleft()
            if kind == "add":
                self._add(s)
            else:
                self._abort(s, tell=False)
        if stop or (self._deadline is not None and time.perf_counter() >= self._deadline):
            for s in list(self._streams.values()):
                self._abort(s, tell=True)
            if stop:
                return True
        if not eng.done:
            start = self.now()
            batch = eng.step()
            end = self.now()
            if batch is not None:
                self._record(batch, start, end)
            self._drop_failed()
            self._leave_now()
            self._deliver(end)
            time.sleep(0)                               # let the event loop send them before the next step
        n_done = eng.n_done
        if n_done and 2 * n_done >= len(eng.requests):
            eng.forget_done()                           # (so it never holds more of the past than in flight)
        return False

    def _drop_failed(self) -> None:
        """End with its error each stream whose request the step dropped (`Engine.failed_rows`: its
        logits row was not finite); the others in the step went on."""
        for rid, why in self.engine.failed_rows.items():
            log.error("request %s failed: %s", rid, why)
            self._drop([self._streams.pop(rid)], f"the engine failed: {why}")

    def _leave_now(self) -> None:
        """Apply the aborts that came in while the step ran, before its tokens are delivered: a
        client gone before a token was made is sent none of that step's tokens, and /metrics counts
        none of them (nor a first token's latency for a request whose client left before it). An
        abort whose request is still an add in the inbox stays there, to follow its add."""
        with self._cond:
            now = list(dict.fromkeys(s for kind, s in self._inbox
                                     if kind == "abort" and self._streams.get(s.req.req_id) is s))
            self._inbox = [op for op in self._inbox if op[0] != "abort" or op[1] not in now]
        for s in now:
            self._abort(s, tell=False)

    def _fail(self, error: str, pending: list[Stream]) -> None:
        """Start afresh (every reservation and K/V freed), then end with `error` every stream the
        engine held and those of `pending`, the adds it never took (`_drop`). A stream that had
        its last event already (it finished, or its client left, earlier in the failed iteration)
        is in neither: it is not ended, nor counted, twice."""
        held = [*self._streams.values(), *pending]
        self._streams.clear()
        try:
            self.engine.start_live()
        finally:
            self._drop(held, error)

    def _drop(self, streams: list[Stream], error: str) -> None:
        """End `streams`, which the engine will not serve on, with `error`: each counts as aborted,
        the reason its last event gives, so every request `submit` took in (every id it gave) is
        counted once in `/metrics`, however it ended."""
        with self.metrics.lock:
            self.metrics.finished["abort"] += len(streams)
        for s in streams:
            self._send(s, Event((), "abort", error, 500))

    def _add(self, s: Stream) -> None:
        """`s`'s request joins the engine. `Engine.add` cannot refuse it: its caller checked it at the
        door (`check`) against what does not change while the server runs (the context, the memory's
        and the K/V store's sizes, the vocabulary), and `submit` gave it an id never used before and
        an arrival no earlier than the last (taken, and queued, under the inbox's lock). Were it
        refused, that is a bug: its ValueError fails the iteration as any other (`_fail`), the
        stream already held, so it ends with the others. `vllm:prompt_tokens_total` counts the
        prompt of an answer once, with its first choice (index 0), as its `usage` counts it and as
        vLLM's engine counts a sequence group's prompt, not once per choice."""
        self._streams[s.req.req_id] = s
        self.engine.add(s.req)
        self.requests.append(s.req)
        if s.index == 0:                                # (an answer's prompt, once however many choices)
            with self.metrics.lock:
                self.metrics.prompt_tokens += s.req.prompt_len

    def _abort(self, s: Stream, tell: bool) -> None:
        """Drop `s`'s request from the engine now (memory and K/V freed), counted as "abort"; if
        `tell` (the server stops before its end), send the stream its last event: an error, status
        503, which a client cannot take for a whole answer (a 200 ending in `finish_reason: "abort"`
        reads as complete to a client that checks the status, and OpenAI's SDK raises on neither;
        an error object or event it raises on). The stream leaves `_streams` once its request has
        left the engine: should `Engine.abort` fail, `_fail` still holds it, and ends and counts it
        once."""
        if self._streams.get(s.req.req_id) is not s:
            return                                      # it had its last event already
        if s.req.status in (Status.WAITING, Status.RUNNING):
            self.engine.abort(s.req)
        del self._streams[s.req.req_id]
        with self.metrics.lock:
            self.metrics.finished["abort"] += 1
        if tell:
            self._send(s, Event((), "abort", f"the server shut down before the answer was complete (after {s.sent} "
                                             f"of at most {s.req.output_len} tokens); send the request again", 503))

    def _record(self, batch: Batch, start: float, end: float) -> None:
        m = self.metrics
        with m.lock:
            index = m.iterations                # the server's count: the engine's fresh starts do not reset it
            m.iterations += 1
            m.preemptions += len(batch.preempted)
            m.hist["orca:batch_size"].observe(len(batch.works))
            m.hist["orca:iteration_seconds"].observe(end - start)
            m.hist["vllm:iteration_tokens_total"].observe(batch.totals.n_tokens)
        ends = tuple(r.req_id for r in self.engine.prompts_completed(batch))
        rec = StepRecord(index, start, end, tuple((r.req_id, n, p) for r, n, p in batch.works), ends)
        self.steps.append(rec)
        if self.log_steps:
            log.info("step %d %.4f-%.4fs batch=%d %s", rec.index, start, end, rec.batch_size,
                     " ".join(f"{r.req_id}:{kind}({n}+{p})"
                              for (r, n, p), kind in zip(batch.works, self._work_kinds(batch))))

    def _work_kinds(self, batch: Batch) -> list[str]:
        """Each work's `work_kind` in the step just taken: caught up where the step made its request a
        token (`Engine.tokens_made`), or, in a row that failed (`Engine.failed_rows`: it made none),
        where it fed every token its request had."""
        made, failed = set(map(id, self.engine.tokens_made(batch))), self.engine.failed_rows
        return [work_kind(r, n, p, id(r) in made or (r.req_id in failed and p + n == r.prompt_len + r.n_generated))
                for r, n, p in batch.works]

    def _deliver(self, end: float) -> None:
        """Each stream's new tokens, the moment the step ended (at `end`): up to an end-of-sequence
        token, or (`Stream.text`) the token that completes a stop string, which ends the request.
        Should a text fail to be made (its tokenizer raised), that answer alone ends, with the error."""
        m = self.metrics
        for s in list(self._streams.values()):
            r = s.req
            new = (r.output_ids or [])[s.sent:]
            if not new:
                continue
            finish = None
            for i, t in enumerate(new):
                if t in r.stop_token_ids:
                    assert s.sent + i >= r.min_tokens, f"request {r.req_id}: a stop token before min_tokens"
                    new, finish = new[:i + 1], "stop"
                    break
            if finish is None and r.status is Status.FINISHED:
                finish = "length"
            texts = lps = None
            if s.text is not None:                      # its text, cut at any stop string (`stop.Answer`)
                try:
                    asked = None if r.output_logprobs is None else r.output_logprobs[s.sent:s.sent + len(new)]
                    texts = tuple(s.text.take(new, finish, asked))
                    new, finish = new[:s.text.n - s.sent], s.text.finish
                    lps = None if asked is None else tuple(s.text.logprobs)
                except Exception as e:                  # its tokenizer failed: this answer ends, not the batch
                    log.exception("request %s: its text could not be made", r.req_id)
                    if r.status is not Status.FINISHED:
                        self.engine.abort(r)
                    del self._streams[r.req_id]
                    self._drop([s], self._text_error(e))
                    continue
            if finish is not None and r.status is not Status.FINISHED:
                self.engine.abort(r)                    # stopped early: it leaves the engine now
            itl = None if s.sent == 0 else end - s.last_token_s
            s.sent += len(new)
            with m.lock:
                m.generation_tokens += len(new)
                if itl is None:
                    m.hist["vllm:time_to_first_token_seconds"].observe(end - r.arrival_s)
                else:
                    m.hist["vllm:inter_token_latency_seconds"].observe(itl)
                if finish is not None:
                    m.finished[finish] += 1
                    m.hist["vllm:e2e_request_latency_seconds"].observe(end - r.arrival_s)
            s.last_token_s = end
            if finish is not None:
                del self._streams[r.req_id]
            self._send(s, Event(tuple(new), finish, texts=texts, logprobs=lps,
                                stop_reason=None if s.text is None else s.text.stop_reason))

    @staticmethod
    def _text_error(e: Exception) -> str:
        return f"the answer's text could not be made ({type(e).__name__}: {e})"

    @staticmethod
    def _send(s: Stream, ev: Event) -> None:
        try:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, replace(ev, index=s.index))
        except RuntimeError:                            # its event loop is closed: nobody listens
            pass
