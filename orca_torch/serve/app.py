"""The OpenAI-compatible HTTP face of the live engine (FastAPI), the contract standard benchmark
clients (vLLM's `bench serve`, AIPerf, GuideLLM) expect. What a request body may hold, and how it
is checked and turned into a `Generation`, is `bodies.py`.

- `GET /v1/models`: one model; `root` is the folder of its tokenizer, which a client loads
  (`GET /v1/models/{id}`: that model alone).
- `POST /v1/completions`, `POST /v1/chat/completions`: streaming (Server-Sent Events, one token per
  chunk, `data: [DONE]` at the end; `stream_options.include_usage` adds a last chunk with
  `choices: []` and `usage`) or not, with exact `usage`; with `logprobs`, each chunk's choice holds
  its token's log probabilities as OpenAI's API shapes them (`logprobs`), a whole answer's all of them.
  With `n` > 1 each choice is a request of its own (`LiveEngine.submit_all`): a whole answer lists
  them in index order, a stream interleaves their chunks, each naming its choice's `index`, and
  `usage` counts the prompt once and every choice's tokens; the first error ends the answer, and a
  client that leaves drops all of them.
- `GET /health`: 200 while serving, 503 once shutting down (or if the engine thread has stopped).
- `GET /metrics`: Prometheus text.
- `GET /orca/steps?since=N&limit=K`: the per-iteration log (index, start, end, each request's
  `[req_id, n_new, n_past]`), at most K iterations from index N on, `next`, the index to ask
  for next, and `prompt_ends`, beside `steps`, the req_ids whose prompt each step completed (a
  one-token last chunk reads as a decode without it): what the benchmark fits and replays against.

A path with a trailing slash is served as the path without it (`POST /v1/completions/`), with no
redirect; any other path gets a 404 that lists the routes. Every GET route answers HEAD too.
A query parameter a route does not take (every route but `/orca/steps` takes none), or one given
twice, is refused with 400 naming it and what the route takes (`_query`).

Errors are OpenAI-style objects (`bodies.APIError`). A body over `MAX_BODY_BYTES` is refused with
413 before it is read whole; one not sent as JSON (a `Content-Type` other than JSON's, or none), or
sent compressed (`Content-Encoding`), with 415; one sent with a transfer coding other than chunked
(`Transfer-Encoding: gzip, chunked`) with 501; one not in whole within `body_timeout_s` (its
Content-Length promised more than the client sent) with 408, and the connection closed; one that
would take the bodies the server holds, being read or waiting to be parsed, past
`body_memory_bytes`, with 503 and Retry-After (`OpenAIServer.hold`). A stream asked over HTTP/1.0
is refused with 505: uvicorn's httptools protocol would send it chunked, which such a client cannot read.
Parsing and tokenizing run in a worker thread of their own, so a long prompt does not hold up the
streams the event loop sends.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import re
import secrets
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator

from fastapi import Depends, FastAPI, Query, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from orca_torch.serve.bodies import APIError, BodyParser, Generation, Limits, brief, quoted_key
from orca_torch.serve.live import Event, LiveEngine, ShuttingDown, Stream
from orca_torch.serve.limits import BODY_MEMORY_MIB, BODY_TIMEOUT_S, MAX_BODY_BYTES
from orca_torch.serve.stop import Answer, Echo, ShownLogprob

STEPS_PAGE = 10_000                 # iterations `GET /orca/steps` returns at most
_ERROR_TYPES = {500: "server_error", 503: "service_unavailable"}    # an answer ended short, by its status


def _lp(v: float) -> float:
    """A log probability as JSON carries it: -inf (a token of probability 0) as -9999.0, as vLLM sends it."""
    return max(v, -9999.0)


def logprobs(kind: str, lps: tuple[ShownLogprob, ...] | list[ShownLogprob] | None, offset: int = 0) -> dict | None:
    """A choice's `logprobs` for its tokens `lps` (None: not asked for), as OpenAI's API shapes them.
    Completions: `tokens`, `token_logprobs`, `top_logprobs` (per token, the most likely tokens' texts
    and log probabilities, and the token's own where it is not among them, as vLLM adds it) and
    `text_offset` (where each token's text starts in the tokens' texts run together, from `offset`,
    the length of those before them in the answer: each the text it adds in context (`stop.Answer`),
    they run together to the answer's text, so it indexes into that, up to a stop string that cuts
    it or a stop token it leaves out, whose entry stays). Chat: `content`, a list of `{token, logprob,
    bytes, top_logprobs}` (`bytes`: the text's UTF-8)."""
    if lps is None:
        return None
    if kind == "chat":
        def one(t: str, v: float) -> dict:
            return {"token": t, "logprob": _lp(v), "bytes": list(t.encode("utf-8"))}
        return {"content": [{**one(p.token, p.logprob), "top_logprobs": [one(t, v) for t, v in p.top]} for p in lps]}
    tops = []
    for p in lps:
        top: dict[str, float] = {}
        for t, v in (*p.top, (p.token, p.logprob)):
            top.setdefault(t, _lp(v))
        tops.append(top)
    tokens = [p.token for p in lps]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
    return {"tokens": tokens, "token_logprobs": [_lp(p.logprob) for p in lps], "top_logprobs": tops,
            "text_offset": offsets}


@dataclass(frozen=True)
class Reply:
    """What every chunk of one answer shares: its endpoint ("completions" or "chat"), its id and
    when it was created (Unix seconds)."""

    kind: str
    id: str
    created: int


def _shown(path: str) -> str:
    """A route's path as a client reads it (`{id:path}`: `{id}`)."""
    return re.sub(r':[a-z]+}', '}', path)


def _routes(app: FastAPI) -> list[str]:
    """Every route the app serves, as `METHOD path` (HEAD only where GET is not)."""
    out = []
    for route in app.routes:
        methods = sorted(getattr(route, "methods", None) or ())
        shown = [m for m in methods if m != "HEAD" or "GET" not in methods]
        out.append(f"{'/'.join(shown)} {_shown(route.path)}")
    return out


def _query(path: str, takes: tuple[str, ...] = ()) -> Any:
    """The check of route `path`'s query string (a FastAPI dependency, run before the route reads a
    body): a parameter it does not take (`takes`; most routes take none), or one given twice, is
    refused with 400 naming it and what the route takes. Ignored, a misspelt `since` would read as 0,
    a body's parameter sent in the query (`?stream=true`) would silently do nothing, and of a
    repeated one a value would silently win over the other."""
    async def check(http: HTTPRequest) -> None:
        counts = Counter(k for k, _ in http.query_params.multi_items())
        odd = next((k for k, n in counts.items() if k not in takes or n > 1), None)
        if odd is None:
            return
        how = "repeated" if odd in takes else "unknown"
        said = (f"takes {' and '.join(takes)}, each at most once" if takes else "takes no query parameters"
                + ("; send its parameters in the JSON body" if http.method == "POST" else ""))
        raise APIError(f"query parameter {quoted_key(odd)} is {how}; {_shown(path)} {said}", odd[:60])
    return Depends(check)


class _TrailingSlash:
    """ASGI middleware: a path with a trailing slash (`/v1/completions/`) is served as the path
    without it. (Starlette's own answer is a 307 redirect, which most HTTP clients, httpx among
    them, do not follow for a POST: the client saw an empty 307.) The path as asked is kept in the
    scope for the 404 message."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/", "orca.asked_path": path}
        await self.app(scope, receive, send)


def _json_media(content_type: str) -> bool:
    """Whether a Content-Type says JSON (`application/json`, `...+json`, parameters aside). Only such a
    body is read, as OpenAI's API has it sent: a web page can post a form (`text/plain`,
    `application/x-www-form-urlencoded`), or a body with no Content-Type at all (a `fetch` of a
    `Blob` of no type), to a server on this machine with no CORS check, and neither may run here."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client has gone (reading the connection is what lets the server notice)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


class OpenAIServer(BodyParser):
    """Routes and answers around a `LiveEngine` and a tokenizer (`tokenizer.py`); the checks at the
    door, body to `Generation`, are `BodyParser`'s (`bodies.py`)."""

    def __init__(self, live: LiveEngine, tokenizer, model_name: str, body_timeout_s: float = BODY_TIMEOUT_S,
                 body_memory_bytes: int = BODY_MEMORY_MIB * 2**20) -> None:
        assert body_memory_bytes >= MAX_BODY_BYTES, "the largest body taken must fit the bodies' memory"
        self.live, self.tok, self.model_name = live, tokenizer, model_name
        self.body_timeout_s, self.body_memory_bytes = body_timeout_s, body_memory_bytes
        self.body_bytes_held = 0                # (the event loop's alone: `hold`)
        self.parser = ThreadPoolExecutor(1, thread_name_prefix="orca-parse")   # one: tokenizers are not shared
        self.vocab = live.engine.executor.model.spec.vocab
        self.eos_ids = live.stop_token_ids
        self.max_context = live.engine.max_context
        self.limits = lim = Limits.of(live.engine)
        if lim.prompt < 1:
            why = lim.tokens_set_by if lim.tokens < 2 else lim.prompt_set_by
            raise ValueError(f"with these settings no request fits (set by {why}): give a larger budget")
        self.created = int(time.time())        # (the model's, in /v1/models)
        self.run_id = secrets.token_hex(4)      # in every answer's id: ids differ across restarts

    # ---- answers ----------------------------------------------------------------------------------
    def hold(self, n: int) -> None:
        """Counts `n` more bytes of a body among those held, or refuses the request with 503 and
        Retry-After where they would pass `body_memory_bytes`: each body is held whole until the one
        parse thread has read it, so clients sending bodies faster than it parses them would
        otherwise fill the memory."""
        if self.body_bytes_held + n > self.body_memory_bytes:
            raise APIError(f"the server is busy: the request bodies it holds, being read or waiting to be parsed, "
                           f"would pass its bound of {self.body_memory_bytes / 2**20:g} MiB with this one; send "
                           "it again in a moment", None, 503, "service_unavailable", headers={"Retry-After": "1"})
        self.body_bytes_held += n

    async def read_body(self, http: HTTPRequest) -> bytes:
        """The request's body, held (`hold`) until its caller lets it go; 413 as soon as it is known
        to exceed `MAX_BODY_BYTES`, 503 as soon as it would take the bodies held past
        `body_memory_bytes`, 400 (sent to no one, and logged as no server error) when the client
        leaves before sending all of it, 408 when it is not all in within `body_timeout_s`: a client
        whose Content-Length promises more than it sends would otherwise hold its connection, and
        this handler, for ever."""
        media = http.headers.get("content-type")
        if media is None or not _json_media(media):
            got = "no Content-Type" if media is None else brief(media.split(";")[0].strip())
            raise APIError(f"the body must be JSON, sent with Content-Type: application/json; got {got}", None, 415)
        codings = [c.strip().lower() for v in http.headers.getlist("content-encoding") for c in v.split(",")]
        coded = next((c for c in codings if c not in ("", "identity")), None)
        if coded is not None:                           # (read as it came, a gzip body was "not valid UTF-8")
            raise APIError("the body must be sent uncompressed (no Content-Encoding, or identity); got "
                           f"Content-Encoding {brief(coded)}", None, 415)
        transfer = [c.strip().lower() for v in http.headers.getlist("transfer-encoding") for c in v.split(",")]
        other = next((c for c in transfer if c not in ("", "chunked")), None)
        if other is not None:                           # (httptools takes the chunks off, leaves the gzip on)
            raise APIError("the body must be sent with no transfer coding but chunked; got Transfer-Encoding "
                           f"{brief(other)}", None, 501)
        length = http.headers.get("content-length")
        n = int(length) if length is not None and length.isdigit() else 0
        chunks: list[bytes] = []
        got = held = 0

        async def read() -> None:
            nonlocal got, held
            async for chunk in http.stream():
                got += len(chunk)
                if got > MAX_BODY_BYTES:
                    return
                if got > held:                          # (a chunked body, held as it comes)
                    self.hold(got - held)
                    held = got
                chunks.append(chunk)

        try:
            if n <= MAX_BODY_BYTES:                     # else refused unread
                self.hold(n)
                held = n
                try:
                    await asyncio.wait_for(read(), self.body_timeout_s)
                except ClientDisconnect:                # nobody left to answer: an answer is dropped
                    raise APIError("the client left before sending its whole body") from None
                except asyncio.TimeoutError:            # (the rest of the body, should it come, is no request)
                    came = (f"{got} of the {length} bytes its Content-Length promised came; send as many as it "
                            "says" if length is not None else f"{got} bytes came, and no end of the chunked body")
                    raise APIError(f"the body did not arrive within {self.body_timeout_s:g} s: {came}", None, 408,
                                   headers={"Connection": "close"}) from None
                n = got
            if n > MAX_BODY_BYTES:
                raise APIError(f"the request body exceeds {MAX_BODY_BYTES} bytes", None, 413)
        except BaseException:
            self.body_bytes_held -= held
            raise
        self.body_bytes_held -= held - got              # (the body as read stays held: the caller lets it go)
        return b"".join(chunks)


    async def generate(self, http: HTTPRequest, kind: str):
        raw = await self.read_body(http)
        try:
            g = await asyncio.get_running_loop().run_in_executor(self.parser, self.parse_body, raw, kind)
        finally:
            self.body_bytes_held -= len(raw)
        if g.stream and http.scope.get("http_version") == "1.0":     # (uvicorn's httptools would send it chunked)
            raise APIError("a streamed answer (stream: true) needs HTTP/1.1, whose chunked body carries it; this "
                           "request came over HTTP/1.0: send it over HTTP/1.1, or without stream", "stream", 505)
        reqs = [self.live.new_request(g.prompt_ids, g.max_tokens, g.ignore_eos, g.min_tokens, g.choice_sampling(i),
                                      g.stop_token_ids) for i in range(g.n)]    # (the choices: requests of their own)
        answers = [self._answer(g, kind) for _ in reqs]     # (outside: a ValueError there is no fault of the request's)
        try:
            for req in reqs:
                self.live.check(req)                    # (refuses none the body check took: `Limits`)
            streams = self.live.submit_all(reqs, answers)
        except ValueError as e:
            raise APIError(str(e), g.max_tokens_param) from None
        except ShuttingDown as e:
            raise APIError(str(e), None, 503, "service_unavailable") from None
        reply = Reply(kind, f"{'cmpl' if kind == 'completions' else 'chatcmpl'}-{self.run_id}-{reqs[0].req_id}",
                      int(time.time()))
        if g.stream:
            return StreamingResponse(self.sse(streams, g, reply), media_type="text/event-stream")
        return await self.whole(http, streams, g, reply)

    def usage(self, g: Generation, n: int) -> dict:
        return {"prompt_tokens": len(g.prompt_ids), "completion_tokens": n, "total_tokens": len(g.prompt_ids) + n}

    def answer(self, reply: Reply, obj: str, choices: list[dict]) -> dict:
        """What every answer object holds around its choices (`obj`: OpenAI's name for its kind)."""
        return {"id": reply.id, "object": obj, "created": reply.created, "model": self.model_name, "choices": choices}

    @staticmethod
    def choice(reply: Reply, index: int, text: str | None, finish: str | None, role: bool = False,
               lps: dict | None = None, stop_reason: str | int | None = None) -> dict:
        """Choice `index` of a chunk (of a whole completion too), `lps` its `logprobs` (`logprobs`);
        `stop_reason` (vLLM's): the stop string, or the client's stop token id, that ended it."""
        if reply.kind == "completions":
            return {"index": index, "text": text, "logprobs": lps, "finish_reason": finish, "stop_reason": stop_reason}
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        return {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish, "stop_reason": stop_reason}

    def chunk(self, reply: Reply, choices: list[dict]) -> dict:
        """A chunk of a stream holding `choices` (`choice`)."""
        return self.answer(reply, "text_completion" if reply.kind == "completions" else "chat.completion.chunk",
                           choices)

    def _answer(self, g: Generation, kind: str) -> Answer:
        """A completion's text continues its prompt (prompt + completion is the whole text, its first
        word's space included); a chat message is a text of its own. It is the engine thread's to
        make (`LiveEngine.submit`), so it decodes with the tokenizer's decoding side (`detokenizer`:
        safe beside the parse thread's encoding), an echoed prompt's token ids too (`stop.Echo`)."""
        echo = Echo(g.prompt_text, g.prompt_ids, self.tok.detokenizer()) if g.echo else None
        return Answer(self.tok.detokenizer(g.prompt_ids if kind == "completions" else ()), g.stop, g.min_tokens,
                      g.include_stop_str_in_output, echo, self._reason_ids(g))

    def _reason_ids(self, g: Generation) -> set[int]:
        """The stop ids an answer's `stop_reason` names, as vLLM's: the client's `stop_token_ids`
        and, unless `ignore_eos`, the checkpoint's other end-of-sequence ids (those its config files
        list, which vLLM adds to `stop_token_ids`), but not the tokenizer's own eos id, which vLLM
        stops at with `stop_reason` None (unless `ignore_eos`: then the client's id names it)."""
        if g.ignore_eos:
            return set(g.stop_token_ids)
        return (set(g.stop_token_ids) | self.live.stop_token_ids) - {self.tok.eos_token_id}

    @staticmethod
    def _take(stream: Stream, ev: Event) -> list[str]:
        """The text pieces `ev` lets its client see, which the engine thread made (`Event.texts`)."""
        stream.ended = ev.finish_reason is not None     # (before a yield: the client may leave during one)
        if ev.error is not None:
            return []
        assert ev.texts, "a stream the app submitted has its text made in the engine thread, a piece a token"
        return list(ev.texts)

    async def sse(self, streams: list[Stream], g: Generation, reply: Reply) -> AsyncIterator[str]:
        """The choices' chunks as their tokens come, interleaved, each naming its choice's `index`;
        one `[DONE]` once every choice has ended, or at the first error (the others aborted)."""
        def data(obj: dict) -> str:
            if g.include_usage and "usage" not in obj:
                obj["usage"] = None
            return f"data: {json.dumps(obj)}\n\n"

        queue = streams[0].queue                    # (the choices' streams share it: `LiveEngine.submit_all`)
        n, offsets = 0, [0] * len(streams)          # tokens sent, and each choice's texts' length (`text_offset`)
        try:
            if reply.kind == "chat":
                for i in range(len(streams)):
                    yield data(self.chunk(reply, [self.choice(reply, i, None, None, role=True)]))
            while not all(s.ended for s in streams):
                ev: Event = await queue.get()
                texts, finish, at = self._take(streams[ev.index], ev), ev.finish_reason, ev.index
                if ev.error is not None:
                    yield f"data: {json.dumps(APIError(ev.error, None, ev.status, _ERROR_TYPES[ev.status]).body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                n += len(ev.ids)
                for i, text in enumerate(texts):        # (a token each)
                    lps = None if ev.logprobs is None else ev.logprobs[i:i + 1]
                    last = i == len(texts) - 1
                    yield data(self.chunk(reply, [self.choice(reply, at, text, finish if last else None,
                                                              lps=logprobs(reply.kind, lps, offsets[at]),
                                                              stop_reason=ev.stop_reason if last else None)]))
                    offsets[at] += sum(len(p.token) for p in lps or ())
            if g.include_usage:
                yield data({**self.chunk(reply, []), "usage": self.usage(g, n)})
            yield "data: [DONE]\n\n"
        finally:
            left = [s for s in streams if not s.ended]
            if left:                                    # the client went away mid-stream, or a choice failed
                self.live.abort(*left)

    async def whole(self, http: HTTPRequest, streams: list[Stream], g: Generation, reply: Reply) -> JSONResponse:
        """Every choice's answer, in index order, once all have ended; the first error ends it (the
        other choices aborted), as does the client leaving (all of them aborted)."""
        k = len(streams)
        texts: list[list[str]] = [[] for _ in range(k)]
        finish: list[str | None] = [None] * k
        stop_reasons: list[str | int | None] = [None] * k
        lps: list[list[ShownLogprob] | None] = [[] if g.logprobs else None for _ in range(k)]
        n, error, status = 0, None, None
        queue = streams[0].queue                        # (shared: `LiveEngine.submit_all`)
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            while error is None and not all(s.ended for s in streams):
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    break
                ev: Event = get.result()
                at = ev.index
                texts[at] += self._take(streams[at], ev)
                finish[at], stop_reasons[at], error, status = ev.finish_reason, ev.stop_reason, ev.error, ev.status
                n += len(ev.ids)
                if lps[at] is not None:
                    lps[at] += ev.logprobs or ()
        finally:
            gone.cancel()
            left = [s for s in streams if not s.ended]
            if left:
                self.live.abort(*left)
        if error is not None:                           # the engine failed, the answer's text, or the server stopped
            raise APIError(error, None, status, _ERROR_TYPES[status])
        if None in finish:                              # the client went away: nobody reads this
            raise APIError("the client disconnected before the answer was ready")
        if reply.kind == "completions":                 # (a whole completion is shaped as a chunk)
            choices = [self.choice(reply, i, "".join(texts[i]), finish[i], lps=logprobs(reply.kind, lps[i]),
                                   stop_reason=stop_reasons[i]) for i in range(k)]
            whole = self.chunk(reply, choices)
        else:
            choices = [{"index": i, "message": {"role": "assistant", "content": "".join(texts[i])},
                        "logprobs": logprobs(reply.kind, lps[i]), "finish_reason": finish[i],
                        "stop_reason": stop_reasons[i]}
                       for i in range(k)]
            whole = self.answer(reply, "chat.completion", choices)
        return JSONResponse({**whole, "usage": self.usage(g, n)})

    def metrics_text(self) -> str:
        eng = self.live.engine
        mem, kv = eng.memory, eng.executor.kv
        n_slots = mem.n_slots or 0
        gauges = {"vllm:num_requests_running": ("Requests in the running pool.", self.live.n_running),
                  "vllm:num_requests_waiting": ("Requests waiting to be admitted.", self.live.n_waiting),
                  "vllm:kv_cache_usage_perc": ("K/V slots reserved / all slots (1 = full).",
                                               mem.slots_reserved / n_slots if n_slots else 0.0),
                  "orca:kv_slots_reserved": ("K/V slots set aside by the memory manager.", mem.slots_reserved),
                  "orca:kv_slots_used": ("K/V slots holding a token's K/V.", mem.slots_used),
                  "orca:kv_slots_total": ("K/V slots of the memory manager.", n_slots),
                  "orca:kv_manager_slots_reserved": ("K/V slots the torch K/V manager holds.", kv.slots_reserved),
                  "orca:request_body_bytes_held": ("Bytes of request bodies being read or waiting to be parsed.",
                                                   self.body_bytes_held)}
        return self.live.metrics.render(gauges)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "orca-torch", "root": str(self.tok.path), "parent": None,
                                            "max_model_len": self.max_context}]}


def create_app(live: LiveEngine, tokenizer, model_name: str, body_timeout_s: float = BODY_TIMEOUT_S,
               body_memory_bytes: int = BODY_MEMORY_MIB * 2**20) -> FastAPI:
    """The FastAPI application serving `live` under the name `model_name`."""
    srv = OpenAIServer(live, tokenizer, model_name, body_timeout_s, body_memory_bytes)
    app = FastAPI(title="orca-torch", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.add_middleware(_TrailingSlash)
    app.state.server = srv

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(http: HTTPRequest, e: StarletteHTTPException) -> JSONResponse:
        """The router's own refusals, said as what was asked and what is served; a 405 keeps its
        `Allow` header (HTTP requires it)."""
        asked = f"{http.method} {brief(http.scope.get('orca.asked_path', http.url.path))}"
        headers = dict(e.headers or {})
        if e.status_code == 404:
            message = f"no route {asked}; this server serves {', '.join(_routes(app))}"
        elif e.status_code == 405 and "Allow" in headers:
            headers["Allow"] = ", ".join(sorted(headers["Allow"].split(", ")))     # (a set's order otherwise)
            message = f"{asked} is not allowed; that route takes {headers['Allow']}"
        else:
            message = f"{e.detail}"
        response = APIError(message, None, e.status_code, "NotFoundError" if e.status_code == 404
                            else "invalid_request_error").response()
        response.headers.update(headers)
        return response

    @app.exception_handler(Exception)
    async def server_error(_: HTTPRequest, e: Exception) -> JSONResponse:
        return APIError(f"internal error: {type(e).__name__}: {e}", None, 500, "server_error").response()

    @app.exception_handler(RequestValidationError)
    async def query_error(_: HTTPRequest, e: RequestValidationError) -> JSONResponse:
        """A bad query parameter (`/orca/steps?since=-1`), said as a bad body field is: its name,
        the rule, and the value sent."""
        first = e.errors()[0] if e.errors() else {}
        name = str(first.get("loc", ["?"])[-1])
        return APIError(f"{name}: {first.get('msg', 'invalid request')}, got {brief(first.get('input'))}",
                        name).response()

    def get(path: str, query: tuple[str, ...] = ()):
        """A GET route that takes HEAD too, as HTTP has every server take it wherever it takes GET,
        and the query parameters `query` only (`_query`)."""
        return app.api_route(path, methods=["GET", "HEAD"], dependencies=[_query(path, query)])

    @get("/health")
    async def health():
        if not live.serving:
            why = "shutting down" if live.closing else "not serving: its engine thread has stopped"
            return APIError(f"the server is {why}", None, 503, "service_unavailable").response()
        return JSONResponse({})

    @get("/v1/models")
    async def models():
        return srv.models()

    @get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != srv.model_name:
            raise srv.no_such_model(model_id)
        return srv.models()["data"][0]

    @get("/metrics")
    async def metrics():
        return PlainTextResponse(srv.metrics_text(), media_type="text/plain; version=0.0.4")

    @get("/orca/steps", ("since", "limit"))
    def steps(since: Annotated[int, Query(ge=0)] = 0,
              limit: Annotated[int, Query(ge=1, le=STEPS_PAGE)] = STEPS_PAGE):
        """At most `limit` of the server's iterations from index `since` on (the last `keep_steps`
        are kept; their indices run on without a gap), and the index to ask for next. A plain `def`:
        FastAPI runs it in a worker thread, so a long log does not hold up the streams."""
        kept = list(live.steps)
        first = since - kept[0].index if kept else 0
        page = kept[max(first, 0):max(first, 0) + limit]
        return {"steps": [[s.index, s.start_s, s.end_s, [list(w) for w in s.works]] for s in page],
                "next": page[-1].index + 1 if page else since,
                "prompt_ends": [list(s.prompt_ends) for s in page]}

    @app.post("/v1/completions", dependencies=[_query("/v1/completions")])
    async def completions(http: HTTPRequest):
        return await srv.generate(http, "completions")

    @app.post("/v1/chat/completions", dependencies=[_query("/v1/chat/completions")])
    async def chat(http: HTTPRequest):
        return await srv.generate(http, "chat")

    return app
