"""The OpenAI-compatible HTTP face of the live engine (FastAPI), the contract standard benchmark
clients (vLLM's `bench serve`, AIPerf, GuideLLM) expect.

- `GET /v1/models`: one model; `root` is the folder of its tokenizer, which a client loads
  (`GET /v1/models/{id}`: that model alone).
- `POST /v1/completions`, `POST /v1/chat/completions`: streaming (Server-Sent Events, one token per
  chunk, `data: [DONE]` at the end; `stream_options.include_usage` adds a last chunk with
  `choices: []` and `usage`) or not, with exact `usage`.
- `GET /health`: 200 while serving, 503 once shutting down (or if the engine thread has stopped).
- `GET /metrics`: Prometheus text.
- `GET /orca/steps?since=N&limit=K`: the per-iteration log (index, start, end, each request's
  `[req_id, n_new, n_past]`), at most K iterations from index N on, and `next`, the index to ask
  for next: what the benchmark fits and replays against.

A path with a trailing slash is served as the path without it (`POST /v1/completions/`), with no
redirect; any other path gets a 404 that lists the routes. Every GET route answers HEAD too.

Each endpoint takes its own parameters as OpenAI's API defines them (`ONLY`): the other's are
refused as unsupported, the message naming the endpoint they belong to. There is no tool calling:
a message of role "tool" is refused, saying so.
Decoding is greedy unless the request sends `temperature` > 0: then each token is drawn (the torch
executor's seeded sampling, `model/sampling.py`) after `top_k` (vLLM's extension; -1 or 0: every
token) and `top_p`; `seed` makes the draws repeatable (the same seed, prompt and parameters give
the same tokens, streamed or not, whatever else the server runs), and without one a request's draws
follow from the server's seed and its order of requests. Left out, `temperature` is 0 here
(OpenAI's default is 1). Values outside their range are refused with 400 saying what is allowed
(`_sampling`).
`stop` (a string, or a list of at most 4) ends an answer at the first stop string in its text, which
it leaves out (`finish_reason` "stop"; usage counts the tokens up to the one that completed it), and
drops the request from the engine; a stream holds back text that may begin a stop string until it
is known not to (`stop.py`). It does not change the tokens before the stop.
The other parameters that would change the tokens or the answer (penalties, n > 1, logprobs, ...)
are refused with 400 naming the parameter unless they carry their no-op value. Accepted are the
parameters that say how to keep, label, bill or route an answer but not what it is (`user`,
`metadata`, `parallel_tool_calls` with no tools, ...), with `store` and `service_tier` taken only
at values this server honours (nothing stored, one tier). Errors are
OpenAI-style objects `{"error": {"message", "type", "param", "code"}}` with a 4xx status; `code`
is a string where there is a specific one ("model_not_found"), else null, and a message quotes a
bad value cut short. A body over `max_body_bytes` is refused with 413 before it is read whole; one
not sent as JSON, or sent compressed (`Content-Encoding`), with 415; one not in whole within
`body_timeout_s` (its Content-Length promised more than the client sent) with 408, and the
connection closed.
Parsing and tokenizing run in a worker thread of their own, so a long prompt does not hold up the
streams the event loop sends.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import reprlib
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Callable, Literal

from fastapi import FastAPI, Query, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from orca_torch.checks import SEED_LIMIT, is_finite_real
from orca_torch.core.engine import Engine
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.request import Request
from orca_torch.model.sampling import SamplingParams
from orca_torch.serve.live import Event, LiveEngine, ShuttingDown, Stream
from orca_torch.serve.limits import BODY_TIMEOUT_S, MAX_BODY_BYTES
from orca_torch.serve.stop import MAX_STOP_CHARS, MAX_STOPS, StopMatcher
from orca_torch.serve.tokenizer import content_text

ROLES = ("system", "user", "assistant", "developer")     # ("tool": refused, `_Message.no_tool_role`)
NO_TOOLS = ('role "tool" is not supported: this server does no tool calling (tools are refused unless empty, as '
            "is an assistant message's tool_calls), so a tool message has no call to answer; send a tool's output "
            "as a user message")
# parameter -> the values that change nothing here: one choice, no penalties or biases, a server
# that stores nothing and has one tier (accepted; any other value is refused)
NO_OP = {
    "n": (None, 1),
    "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False), "top_logprobs": (None, 0),
    "stop_token_ids": (None, []), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0), "logit_bias": (None, {}),
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}), "store": (None, False), "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
}
# each endpoint's own parameters, as OpenAI's API defines them (the rest of NO_OP both take)
ONLY = {"completions": ("suffix", "best_of", "echo"),
        "chat": ("max_completion_tokens", "tools", "tool_choice", "response_format", "top_logprobs", "store",
                 "service_tier", "modalities", "metadata", "parallel_tool_calls", "safety_identifier",
                 "prompt_cache_key")}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
WHY = {"n": "one choice per request: leave it out or set 1",
       "best_of": "one choice per request: leave it out or set 1",
       "stop_token_ids": "stop tokens are not supported: leave it out or set []",
       "logprobs": "log probabilities are not returned: leave it out or set null or false",
       "store": "this server stores no completions: leave it out or set false",
       "service_tier": 'this server has one processing tier: leave it out or set "auto" or "default"',
       "modalities": 'only text is generated: leave it out or set ["text"]'}
STEPS_PAGE = 10_000                 # iterations `GET /orca/steps` returns at most


class APIError(Exception):
    """An OpenAI-style error: HTTP `status`, a message that says what was wrong, the parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


class _Brief(reprlib.Repr):
    """A value as JSON writes it, cut short: an error says which value was wrong without echoing
    megabytes of body back (nor walking all of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxlong, self.maxother = 3, 60, 60, 60

    def repr_str(self, x: str, level: int) -> str:
        return json.dumps(x) if len(x) <= self.maxstring else json.dumps(x[:self.maxstring])[:-1] + '..."'

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4 * self.maxlong:       # (also past Python's limit on digits written out)
            return f"<an integer of about {int(x.bit_length() * math.log10(2)) + 1} digits>"
        return super().repr_int(x, level)

    def repr_float(self, x: float, level: int) -> str:
        return json.dumps(x)                        # (NaN, Infinity: JSON's literals, not Python's nan, inf)

    def repr_bool(self, x: bool, level: int) -> str:
        return "true" if x else "false"

    def repr_NoneType(self, x: None, level: int) -> str:
        return "null"


def _brief(value: Any, limit: int = 100) -> str:
    """`value` for an error message: JSON-like, at most about `limit` characters."""
    s = _Brief().repr(value)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def _key(k: Any) -> str:
    """A key a client wrote, quoted, its first 60 characters at most."""
    k = str(k)
    return repr(k) if len(k) <= 60 else f"{k[:60]!r}..."


def _text(s: str, param: str) -> str:
    """`s` if it is text UTF-8 can carry (JSON's \\ud800 escapes can give a lone surrogate), else a 400."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"{param} is not valid text: {e.reason} at character {e.start}", param) from None
    return s


@dataclass(frozen=True)
class Generation:
    """A checked request: the prompt's tokens and how to answer."""

    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    min_tokens: int
    max_tokens_param: str = "max_tokens"        # the field the client sent (max_completion_tokens or this)
    stop: tuple[str, ...] = ()                  # stop strings
    sampling: SamplingParams | None = None      # None: greedy


@dataclass(frozen=True)
class Reply:
    """What every chunk of one answer shares: its endpoint ("completions" or "chat"), its id and
    when it was created (Unix seconds)."""

    kind: str
    id: str
    created: int


@dataclass
class _Answer:
    """One answer's text as its tokens arrive: each token's text (`detok`'s), cut before the first
    stop string, the end that may begin one held back (`match`). `n`: the tokens it counts, up to
    and including the one that completed a stop string; `finish`: why it ended (None: it goes on)."""

    detok: Any
    match: StopMatcher
    min_tokens: int
    n: int = 0
    finish: str | None = None

    def take(self, ev: Event) -> list[str]:
        """The text each of `ev`'s tokens adds, up to the one that completes a stop string (looked
        for once the answer has more than `min_tokens` tokens, as vLLM looks); should `ev` end the
        answer with no token, what was held back, if anything, as a piece of its own."""
        end = ev.finish_reason is not None
        steps = [[t] for t in ev.ids] or ([[]] if end else [])
        out = []
        for i, ids in enumerate(steps):
            final = end and i == len(steps) - 1
            self.n += len(ids)
            text = self.match.add(self.detok.add(ids, final=final), final, armed=self.n > self.min_tokens)
            if ids or text:
                out.append(text)
            if self.match.matched:
                self.finish = "stop"
                return out
        self.finish = ev.finish_reason
        return out


class _Strict(BaseModel):
    """JSON's own types only (no "10" for 10, no true for 1); null is the same as absent."""
    model_config = ConfigDict(strict=True, extra="forbid")


class _StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: Literal[False] | None = None     # (vLLM's: usage in every chunk)
    include_obfuscation: Literal[False] | None = None        # (OpenAI's: padding against length side channels)


class _TextPart(_Strict):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def text_only(cls, data: Any) -> Any:
        """A part of another type (`image_url`, `input_audio`) is refused as such, before its keys
        are (its `image_url` key was the "unsupported key" the client was told of)."""
        if isinstance(data, dict) and "type" in data and data["type"] != "text":
            raise PydanticCustomError("refused", f'only text parts are supported (type "text"), got type '
                                                 f'{_brief(data["type"])}')
        return data


class _Message(_Strict):
    role: Literal[ROLES]
    content: str | list[_TextPart]
    name: str | None = None             # (OpenAI's; no template here reads it)

    @model_validator(mode="before")
    @classmethod
    def no_tool_role(cls, data: Any) -> Any:
        """A tool message is refused as such, before its keys are (its `tool_call_id` would be)."""
        if isinstance(data, dict) and data.get("role") == "tool":
            raise PydanticCustomError("refused", NO_TOOLS)
        return data

    @field_validator("content")
    @classmethod
    def some_content(cls, content: str | list[_TextPart]) -> str | list[_TextPart]:
        """An empty list of parts is refused, as OpenAI's API refuses it (an empty string is text)."""
        if isinstance(content, list) and not content:
            raise PydanticCustomError("refused", "an empty list is not content: give a string, or a list of at "
                                                 "least one text part")
        return content


class _Body(_Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    seed: int | None = None
    temperature: Any = None             # (these three checked by `_sampling`, in the client's terms)
    top_p: Any = None
    top_k: Any = None
    user: str | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    stop: Any = None                    # (checked by `_stop_strings`, in the client's terms)


def _no_op_fields(kind: str) -> dict[str, Any]:
    """The NO_OP parameters endpoint `kind` takes (any value here; `parse` checks it): the other
    endpoint's own are left out, so they are refused as unsupported."""
    other = next(names for k, names in ONLY.items() if k != kind)
    return {name: (Any, None) for name in NO_OP if name not in other}


BODIES = {"completions": create_model(
              "CompletionBody", __base__=_Body, **_no_op_fields("completions"),
              prompt=(str | list[int] | Annotated[list[str | list[int]], Field(min_length=1, max_length=1)], ...)),
          "chat": create_model("ChatBody", __base__=_Body, **_no_op_fields("chat"),
                               max_completion_tokens=(Annotated[int, Field(ge=1)] | None, None),
                               metadata=(Annotated[dict[Annotated[str, Field(max_length=64)],
                                                        Annotated[str, Field(max_length=512)]],
                                                   Field(max_length=16)] | None, None),
                               parallel_tool_calls=(bool | None, None), safety_identifier=(str | None, None),
                               prompt_cache_key=(str | None, None),
                               messages=(Annotated[list[_Message], Field(min_length=1)], ...))}
SHAPES = {"prompt": "prompt must be a string, a list of token ids, or a list of one of those (one prompt per request)",
          "stream_options": "stream_options must be an object with include_usage (and continuous_usage_stats, "
                            "include_obfuscation false)",
          "messages": "messages must be a non-empty list of {role, content} objects: role one of "
                      f"{', '.join(ROLES)}, content a string or a non-empty list of text parts "
                      '{"type": "text", "text": ...} (only text is supported)'}


def _refusal(e: ValidationError, kind: str) -> APIError:
    """The first thing pydantic found wrong with a body (an unknown parameter first), said plainly:
    within the first field at fault, the deepest error, which names the key inside an item that
    is wrong (`messages[0].name`); where the branches of a union fail alike (`content` null: not a
    string, not a list), the field's expected shape."""
    errors = e.errors()
    err = next((x for x in errors if x["type"] == "extra_forbidden"), None)
    ambiguous = False
    if err is None:
        field = [x for x in errors if x["loc"][:1] == errors[0]["loc"][:1]]
        depth = max(len(x["loc"]) for x in field)
        deepest = [x for x in field if len(x["loc"]) == depth]
        err, ambiguous = deepest[0], len(deepest) > 1
    loc, value = err["loc"], err["input"]
    name = str(loc[0]) if loc else None
    if err["type"] == "string_unicode":                 # (a key: pydantic names the object holding it)
        msg = (f"{_path(loc) or 'the body'}: {_brief(value)} is not valid text (a lone surrogate, which UTF-8 cannot "
               "carry), as a key or a value")
    elif name is None:
        msg = f"the body must be a JSON object, got {_json_kind(value)}"
    elif err["type"] == "extra_forbidden" and len(loc) > 1:
        msg = f"unsupported key {_key(loc[-1])} in {_path(loc[:-1])}"
    elif err["type"] == "extra_forbidden":
        other = next((k for k, names in ONLY.items() if k != kind and name in names), None)
        where = f" (a parameter of {PATHS[other]} only)" if other else ""
        msg = (f"unsupported parameter {_key(name)} for {PATHS[kind]}{where}; this endpoint takes "
               f"{', '.join(sorted(BODIES[kind].model_fields))}")
    elif err["type"] == "refused":                      # (said whole by the validator)
        msg = f"{_path(loc)}: {err['msg']}"
    elif err["type"] == "missing":
        msg = f"{_path(loc)} is required"
    elif name in SHAPES and (ambiguous or re.fullmatch(r"[a-z_]+(\[\d+\])?", _path(loc))):   # (the field or an item)
        at = "".join(f"[{i}]" for i in loc[1:2] if isinstance(i, int))
        msg = SHAPES[name] + (f"; {name}{at} is not" if at else "")
    elif err["type"] == "model_type":                   # (pydantic's message names the class: `_TextPart`)
        msg = f"{_path(loc)} must be an object, got {_brief(value)}"
    else:
        msg = f"{_path(loc)}: {err['msg']}, got {_brief(value)}"
    return APIError(msg, name if name is None or len(name) <= 60 else name[:60] + "...")     # (a key's name, cut)


def _sampling(b: _Body) -> SamplingParams | None:
    """How the answer's tokens are drawn: None (greedy) unless `temperature` > 0. Each value is
    checked whether or not it is used (`top_p` with temperature 0 too), as JSON's numbers."""
    def number(v: Any) -> bool:
        return type(v) in (int, float) and is_finite_real(v)
    t, p, k = b.temperature, b.top_p, b.top_k
    for name, v, ok, allowed in (
            ("temperature", t, number(t) and t >= 0, "a number >= 0; 0 or left out is greedy decoding"),
            ("top_p", p, number(p) and 0 < p <= 1, "a number in (0, 1]; 1 or left out keeps every token"),
            ("top_k", k, type(k) is int and k >= -1, "an integer >= 1, or -1, 0 or left out for every token"),
            ("seed", b.seed, 0 <= (b.seed or 0) < SEED_LIMIT, "an integer with 0 <= seed < 2**63")):
        if v is not None and not ok:
            raise APIError(f"{name}={_brief(v)} is not supported ({allowed})", name)
    if t is None or t == 0:
        return None
    return SamplingParams(t, 1.0 if p is None else p, k if k is not None and k >= 1 else None, b.seed)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """`stop` as the strings to stop at: null, "" and [] are none (what clients send for none)."""
    allowed = (f"stop must be a string or a list of at most {MAX_STOPS} strings, each of 1 to {MAX_STOP_CHARS} "
               'characters (or null, "" or [] for none)')
    if stop is None or stop == "":
        return ()
    if not isinstance(stop, (str, list)):
        raise APIError(f"{allowed}; got {_brief(stop)}", "stop")
    items = [stop] if isinstance(stop, str) else stop
    if len(items) > MAX_STOPS:
        raise APIError(f"{allowed}; got a list of {len(items)}", "stop")
    for i, s in enumerate(items):
        at = "stop" if isinstance(stop, str) else f"stop[{i}]"
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            got = (f"{_json_kind(s)}, {_brief(s)}" if not isinstance(s, str) else "an empty string" if not s
                   else f"a string of {len(s)} characters")
            raise APIError(f"{allowed}; {at} is {got}", "stop")
        _text(s, "stop")
    return tuple(items)


def _json_kind(value: Any) -> str:
    """What JSON calls `value`'s type (`null`, `array`, ...), as the client wrote it."""
    kinds = ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"), (list, "an array"),
             (dict, "an object"))
    return "null" if value is None else next((k for t, k in kinds if isinstance(value, t)), type(value).__name__)


def _path(loc: tuple) -> str:
    """Where in the body, as a client writes it: `messages[0].content` (pydantic's names for the
    branch of a union it tried, `str` or `list[_TextPart]`, left out; a client's key, a `metadata`
    key say, cut to its first 60 characters)."""
    loc = [i for i in loc if not (isinstance(i, str) and ("[" in i or i in ("str", "int", "float", "bool")))]
    return "".join(f"[{i}]" if isinstance(i, int) else f".{i[:60]}..." if len(i) > 60 else f".{i}" for i in loc)[1:]


@dataclass(frozen=True)
class Limits:
    """The longest request (prompt + max_tokens) and the longest prompt the engine's own `check`
    takes, and what sets each: the model's context, the K/V memory or the step budget."""

    tokens: int
    prompt: int
    tokens_set_by: str
    prompt_set_by: str

    @classmethod
    def of(cls, engine: Engine) -> "Limits":
        """Found by bisection on `engine.check`, monotone in each length (1 and 0: nothing fits);
        the memory manager's own `check` alone says whether the K/V memory is what binds, and only
        the step budget limits a prompt more than the request."""
        def takes(check: Callable[[Request], None], prompt: int, output: int) -> bool:
            try:
                check(Request(0, 0.0, prompt, output, max_tokens=prompt + output, prompt_ids=[0] * prompt))
            except ValueError:
                return False
            return True

        tokens = _longest(lambda n: takes(engine.check, 1, n - 1), 2, engine.max_context)
        prompt = _longest(lambda n: takes(engine.check, n, 1), 1, tokens - 1)
        in_memory = _longest(lambda n: takes(engine.memory.check, 1, n - 1), 2, engine.max_context)
        budget = "--max-num-batched-tokens without --chunked-prefill"
        kv = "--kv-slots" + (", --block-size" if isinstance(engine.memory, PagedMemory) else "")
        by = "the model's context" if tokens == engine.max_context else kv if tokens == in_memory else budget
        prompt_by = by if prompt == tokens - 1 else budget
        if by == budget:                        # (only where memory can run out: a recompute's prefill)
            by += " (a preempted request is recomputed, its prompt and the tokens it has so far, in one step)"
        return cls(tokens, prompt, by, prompt_by)


def _longest(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest `n` in [lo, hi] with `ok(n)` (`ok` true up to some `n`, false after), or lo - 1."""
    lo -= 1                                     # ok(lo) holds, vacuously
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _routes(app: FastAPI) -> list[str]:
    """Every route the app serves, as `METHOD path` (HEAD only where GET is not)."""
    out = []
    for route in app.routes:
        methods = sorted(getattr(route, "methods", None) or ())
        shown = [m for m in methods if m != "HEAD" or "GET" not in methods]
        out.append(f"{'/'.join(shown)} {re.sub(r':[a-z]+}', '}', route.path)}")     # ({id:path}: {id})
    return out


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


class _RepeatedKey(ValueError):
    """A JSON object gives a key twice (its args: the key)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; `_RepeatedKey` if a key comes twice (`json` would keep the last value
    and silently drop the first)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _RepeatedKey(k)
        out[k] = v
    return out


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client has gone (reading the connection is what lets the server notice)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


class OpenAIServer:
    """Routes and checks around a `LiveEngine` and a tokenizer (`tokenizer.py`)."""

    def __init__(self, live: LiveEngine, tokenizer, model_name: str, max_body_bytes: int = MAX_BODY_BYTES,
                 body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.live, self.tok, self.model_name, self.max_body_bytes = live, tokenizer, model_name, max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.parser = ThreadPoolExecutor(1, thread_name_prefix="orca-parse")   # one: tokenizers are not shared
        self.vocab = live.engine.executor.model.spec.vocab
        self.max_context = live.engine.max_context
        self.limits = lim = Limits.of(live.engine)
        if lim.prompt < 1:
            why = lim.tokens_set_by if lim.tokens < 2 else lim.prompt_set_by
            raise ValueError(f"with these settings no request fits (set by {why}): give a larger budget")
        self.created = int(time.time())        # (the model's, in /v1/models)
        self.run_id = secrets.token_hex(4)      # in every answer's id: ids differ across restarts

    # ---- checks at the door -----------------------------------------------------------------------
    def parse(self, body: Any, kind: str) -> Generation:
        try:
            b = BODIES[kind].model_validate(body)
        except ValidationError as e:
            raise _refusal(e, kind) from None
        if b.model is not None and b.model != self.model_name:
            raise self.no_such_model(b.model)
        for name, ok in NO_OP.items():
            if name not in BODIES[kind].model_fields:      # (the other endpoint's own)
                continue
            v = getattr(b, name)
            if not any(type(v) is type(o) and v == o for o in ok):
                why = WHY.get(name) or f"leave it out or set {json.dumps(ok[1])}"
                raise APIError(f"{name}={_brief(v)} is not supported ({why})", name)
        sampling = _sampling(b)
        stream, opts = bool(b.stream), b.stream_options
        if opts is not None and not stream:
            raise APIError("stream_options is only allowed with stream: true", "stream_options")
        mt, mct = b.max_tokens, getattr(b, "max_completion_tokens", None)     # (chat's own)
        if mt is not None and mct is not None and mt != mct:
            raise APIError(f"max_tokens ({_brief(mt)}) and max_completion_tokens ({_brief(mct)}) differ; give one",
                           "max_tokens")
        ids = self.prompt(b.prompt) if kind == "completions" else self.chat_prompt(b.messages)
        max_tokens = mt if mt is not None else mct
        max_param = "max_completion_tokens" if mt is None and mct is not None else "max_tokens"
        if max_tokens is None:
            max_tokens = 16 if kind == "completions" else max(self.limits.tokens - len(ids), 1)
        min_tokens = b.min_tokens or 0
        out_of_vocab = next((t for t in ids if not 0 <= t < self.vocab), None)
        if out_of_vocab is not None:
            raise APIError(f"prompt token ids must lie in [0, {self.vocab}), got {_brief(out_of_vocab)}", "prompt")
        prompt_param = "prompt" if kind == "completions" else "messages"
        if not ids:
            raise APIError("prompt is empty (no tokens once tokenized)" if kind == "completions" else
                           "messages are empty once tokenized", prompt_param)
        if len(ids) + max_tokens > self.max_context:
            raise APIError(f"this model's maximum context length is {self.max_context} tokens; the request asks "
                           f"for {_brief(len(ids) + max_tokens)} ({len(ids)} in the prompt, {_brief(max_tokens)} "
                           "to generate)",
                           max_param if len(ids) < self.max_context else prompt_param)
        lim = self.limits
        if len(ids) > lim.prompt:
            raise self.too_long(str(len(ids)), prompt_param)
        if len(ids) + max_tokens > lim.tokens:
            raise APIError(f"the request needs {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
                           f"to generate), more than the {lim.tokens} this server takes in one request (set by "
                           f"{lim.tokens_set_by})",
                           max_param)
        if min_tokens > max_tokens:
            given = mt is not None or mct is not None
            cap = f"{max_param} ({max_tokens})" if given else (
                f"the {max_tokens} tokens the request may generate without max_tokens "
                + ("(the default)" if kind == "completions" else "(the rest of the server's tokens per request)"))
            raise APIError(f"min_tokens ({_brief(min_tokens)}) must be <= {cap}", "min_tokens")
        include_usage = bool(opts is not None and opts.include_usage)
        return Generation(ids, max_tokens, stream, include_usage, bool(b.ignore_eos), min_tokens, max_param,
                          _stop_strings(b.stop), sampling)

    def no_such_model(self, model: str) -> APIError:
        return APIError(f"the model {_key(model)} does not exist; this server serves {self.model_name!r}",
                        "model", 404, "NotFoundError", "model_not_found")

    def too_long(self, n_tokens: str, param: str) -> APIError:
        lim = self.limits
        return APIError(f"the prompt has {n_tokens} tokens, more than the {lim.prompt} this server takes in one "
                        f"request (set by {lim.prompt_set_by})", param)

    def refuse_sure_misses(self, text: str, param: str) -> None:
        """Before tokenizing (seconds for megabytes, on the one parser thread): a text whose tokens
        are sure to be more than the server takes is refused at once."""
        n = self.tok.min_tokens(text)
        if n > self.limits.prompt:
            raise self.too_long(f"at least {n}", param)

    def prompt(self, p: str | list) -> list[int]:
        if isinstance(p, list) and p and not isinstance(p[0], int):
            p = p[0]                                    # a batch of one prompt
        if not isinstance(p, str):
            return list(p)
        self.refuse_sure_misses(_text(p, "prompt"), "prompt")
        return list(self.tok.encode(p))

    def chat_prompt(self, messages: list[_Message]) -> list[int]:
        clean = [{"role": m.role, "content": _text(content_text(m.model_dump()["content"]), "messages")}
                 for m in messages]         # (text parts joined with a newline, before any template sees them)
        self.refuse_sure_misses(" ".join(m["content"] for m in clean), "messages")
        try:
            return list(self.tok.chat(clean))
        except ValueError as e:
            raise APIError(str(e), "messages") from None

    # ---- answers ----------------------------------------------------------------------------------
    async def read_body(self, http: HTTPRequest) -> bytes:
        """The request's body; 413 as soon as it is known to exceed `max_body_bytes`, 400 (sent to no
        one, and logged as no server error) when the client leaves before sending all of it, 408
        when it is not all in within `body_timeout_s`: a client whose Content-Length promises more
        than it sends would otherwise hold its connection, and this handler, for ever."""
        media = http.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):     # (a web page's form cannot post here)
            raise APIError(f"the body must be JSON, sent with Content-Type: application/json; got {_brief(media)}",
                           None, 415)
        codings = [c.strip().lower() for v in http.headers.getlist("content-encoding") for c in v.split(",")]
        coded = next((c for c in codings if c not in ("", "identity")), None)
        if coded is not None:                           # (read as it came, a gzip body was "not valid UTF-8")
            raise APIError("the body must be sent uncompressed (no Content-Encoding, or identity); got "
                           f"Content-Encoding {_brief(coded)}", None, 415)
        limit = self.max_body_bytes
        length = http.headers.get("content-length")
        n = int(length) if length is not None and length.isdigit() else 0
        chunks: list[bytes] = []
        got = 0

        async def read() -> None:
            nonlocal got
            async for chunk in http.stream():
                got += len(chunk)
                if got > limit:
                    return
                chunks.append(chunk)

        if n <= limit:                                  # else refused unread
            try:
                await asyncio.wait_for(read(), self.body_timeout_s)
            except ClientDisconnect:                    # nobody left to answer: an answer is dropped
                raise APIError("the client left before sending its whole body") from None
            except asyncio.TimeoutError:                # (the rest of the body, should it come, is no request)
                came = (f"{got} of the {length} bytes its Content-Length promised came; send as many as it says"
                        if length is not None else f"{got} bytes came, and no end of the chunked body")
                raise APIError(f"the body did not arrive within {self.body_timeout_s:g} s: {came}", None, 408,
                               headers={"Connection": "close"}) from None
            n = got
        if n > limit:
            raise APIError(f"the request body exceeds {limit} bytes", None, 413)
        return b"".join(chunks)

    def parse_body(self, raw: bytes, kind: str) -> Generation:
        """The body's JSON, checked (`parse`); runs in the parser thread."""
        if not raw.strip():                             # (JSON's own word for it: "Expecting value: line 1 column 1")
            raise APIError("the body is empty: it must be a JSON object")
        try:
            body = json.loads(raw, object_pairs_hook=_unique_keys)
        except _RepeatedKey as e:
            raise APIError(f"the body is not valid JSON here: the key {_key(e.args[0])} is given twice in one "
                           "object") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else e
            raise APIError(f"the body is not valid JSON: {why}") from None
        except ValueError as e:                         # valid JSON, past what Python reads as an int
            raise APIError(f"the body holds an integer too long to read ({str(e).split(';')[0]}); integers here "
                           "must be shorter") from None
        return self.parse(body, kind)

    async def generate(self, http: HTTPRequest, kind: str):
        raw = await self.read_body(http)
        g = await asyncio.get_running_loop().run_in_executor(self.parser, self.parse_body, raw, kind)
        req = self.live.new_request(g.prompt_ids, g.max_tokens, g.ignore_eos, g.min_tokens, g.sampling)
        try:
            self.live.check(req)                        # (a ValueError: the context or the K/V budget)
            stream = self.live.submit(req)
        except ValueError as e:
            raise APIError(str(e), g.max_tokens_param) from None
        except ShuttingDown as e:
            raise APIError(str(e), None, 503, "service_unavailable") from None
        reply = Reply(kind, f"{'cmpl' if kind == 'completions' else 'chatcmpl'}-{self.run_id}-{req.req_id}",
                      int(time.time()))
        if g.stream:
            return StreamingResponse(self.sse(stream, g, reply), media_type="text/event-stream")
        return await self.whole(http, stream, g, reply)

    def usage(self, g: Generation, n: int) -> dict:
        return {"prompt_tokens": len(g.prompt_ids), "completion_tokens": n, "total_tokens": len(g.prompt_ids) + n}

    def answer(self, reply: Reply, obj: str, choice: dict) -> dict:
        """What every answer object holds around its one choice (`obj`: OpenAI's name for its kind)."""
        return {"id": reply.id, "object": obj, "created": reply.created, "model": self.model_name, "choices": [choice]}

    def chunk(self, reply: Reply, text: str | None, finish: str | None, role: bool = False) -> dict:
        if reply.kind == "completions":
            return self.answer(reply, "text_completion",
                               {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        return self.answer(reply, "chat.completion.chunk",
                           {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish})

    def _answer(self, g: Generation, reply: Reply) -> _Answer:
        """A completion's text continues its prompt (prompt + completion is the whole text, its first
        word's space included); a chat message is a text of its own."""
        return _Answer(self.tok.detokenizer(g.prompt_ids if reply.kind == "completions" else ()),
                       StopMatcher(g.stop), g.min_tokens)

    def _ended(self, stream: Stream, answer: _Answer) -> None:
        """The handler has `stream`'s last event, or has cut its answer at a stop string: then the
        engine drops the request at its next iteration, as it drops a departed client's (K/V freed,
        seat in the batch given back), counted as ended by "stop"."""
        if answer.match.matched:
            self.live.abort(stream, "stop")
        stream.ended = True

    async def sse(self, stream: Stream, g: Generation, reply: Reply) -> AsyncIterator[str]:
        answer = self._answer(g, reply)

        def data(obj: dict) -> str:
            if g.include_usage and "usage" not in obj:
                obj["usage"] = None
            return f"data: {json.dumps(obj)}\n\n"

        try:
            if reply.kind == "chat":
                yield data(self.chunk(reply, None, None, role=True))
            while True:
                ev: Event = await stream.queue.get()
                if ev.error is not None:
                    stream.ended = True
                    error = {"message": ev.error, "type": "server_error", "param": None, "code": None}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                texts = answer.take(ev)
                if answer.finish is not None:
                    self._ended(stream, answer)         # (before a yield: the client may leave during one)
                for i, text in enumerate(texts):
                    yield data(self.chunk(reply, text, answer.finish if i == len(texts) - 1 else None))
                if answer.finish is not None:
                    if not texts:
                        yield data(self.chunk(reply, "" if reply.kind == "completions" else None, answer.finish))
                    if g.include_usage:
                        yield data({**self.chunk(reply, None, None), "choices": [], "usage": self.usage(g, answer.n)})
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not stream.ended:                        # the client went away mid-stream
                self.live.abort(stream)

    async def whole(self, http: HTTPRequest, stream: Stream, g: Generation, reply: Reply) -> JSONResponse:
        answer, texts = self._answer(g, reply), []
        error = None
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            while answer.finish is None and error is None:
                get = asyncio.ensure_future(stream.queue.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    break
                ev: Event = get.result()
                error = ev.error
                if error is None:
                    texts += answer.take(ev)
            if answer.finish is not None:
                self._ended(stream, answer)
            elif error is not None:                     # (the engine ended it)
                stream.ended = True
        finally:
            gone.cancel()
            if not stream.ended:
                self.live.abort(stream)
        if error is not None:                           # the engine failed
            raise APIError(error, None, 500, "server_error")
        if answer.finish is None:                       # the client went away: nobody reads this
            raise APIError("the client disconnected before the answer was ready")
        text = "".join(texts)
        if reply.kind == "completions":                 # (a whole completion is shaped as its one chunk)
            whole = self.chunk(reply, text, answer.finish)
        else:
            message = {"role": "assistant", "content": text}
            whole = self.answer(reply, "chat.completion",
                                {"index": 0, "message": message, "logprobs": None, "finish_reason": answer.finish})
        return JSONResponse({**whole, "usage": self.usage(g, answer.n)})

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
                  "orca:kv_manager_slots_reserved": ("K/V slots the torch K/V manager holds.", kv.slots_reserved)}
        return self.live.metrics.render(gauges)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "orca-torch", "root": str(self.tok.path), "parent": None,
                                            "max_model_len": self.max_context}]}


def create_app(live: LiveEngine, tokenizer, model_name: str, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The FastAPI application serving `live` under the name `model_name`."""
    srv = OpenAIServer(live, tokenizer, model_name, max_body_bytes, body_timeout_s)
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
        asked = f"{http.method} {_brief(http.scope.get('orca.asked_path', http.url.path))}"
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
        return APIError(f"{name}: {first.get('msg', 'invalid request')}, got {_brief(first.get('input'))}",
                        name).response()

    def get(path: str):
        """A GET route that takes HEAD too, as HTTP has every server take it wherever it takes GET."""
        return app.api_route(path, methods=["GET", "HEAD"])

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

    @get("/orca/steps")
    def steps(http: HTTPRequest, since: Annotated[int, Query(ge=0)] = 0,
              limit: Annotated[int, Query(ge=1, le=STEPS_PAGE)] = STEPS_PAGE):
        """At most `limit` of the server's iterations from index `since` on (the last `keep_steps`
        are kept; their indices run on without a gap), and the index to ask for next. A plain `def`:
        FastAPI runs it in a worker thread, so a long log does not hold up the streams. A parameter
        it does not take, or one given twice, is refused: a misspelt `since` would otherwise read
        as 0, and a second value would silently win over the first."""
        keys = [k for k, _ in http.query_params.multi_items()]
        odd = next((k for k in keys if k not in ("since", "limit") or keys.count(k) > 1), None)
        if odd is not None:
            raise APIError(f"query parameter {_key(odd)} is {'unknown' if odd not in ('since', 'limit') else 'repeated'}"
                           "; /orca/steps takes since and limit, each at most once", odd[:60])
        kept = list(live.steps)
        first = since - kept[0].index if kept else 0
        page = kept[max(first, 0):max(first, 0) + limit]
        return {"steps": [[s.index, s.start_s, s.end_s, [list(w) for w in s.works]] for s in page],
                "next": page[-1].index + 1 if page else since}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await srv.generate(http, "completions")

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        return await srv.generate(http, "chat")

    return app
