"""What a request body may hold, how it is checked, and how it becomes a `Generation`: the
pydantic models of the two endpoints' bodies, the tables of the parameters each takes, and the
wording of every refusal. The HTTP server that reads a body and answers it is `app.py`.

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
`stop_token_ids` (vLLM's: token ids) ends an answer at the first of them it makes, as the model's
end-of-sequence ids do (`finish_reason` "stop"; `ignore_eos` leaves these on), and the text of the
token that ended it is left out, as a stop string is; `include_stop_str_in_output` (vLLM's) keeps the
stop string, or that token's text, at the end of the answer (`stop.Answer`).
`logprobs` (completions: an integer 0 to 5; chat: `logprobs: true`, with `top_logprobs` 0 to 20)
returns each token's log probability and those of the most likely tokens (`_logprobs`; the model's
raw distribution, before temperature and the cuts: `model/sampling.py`); it changes no token.
`presence_penalty` and `frequency_penalty` (-2 to 2, OpenAI's), `repetition_penalty` (1e-6 to
1e6, vLLM's) and `logit_bias` (token ids as JSON keys -> numbers clamped to [-100, 100]) change the logits before each
token is picked, greedy or drawn (`_adjustments`; `model/sampling.py`).
Completions' `echo` begins each choice's text with the prompt's (as sent, or the token ids' text),
outside the stop strings' search; with `logprobs` it is refused (it would need the prompt's log
probabilities, which the executor does not compute).
`n` (1 to 16) returns n choices, each its own request in the engine (`_choices`); `best_of` is
taken only at n (left out: the same). The other parameters that would change the tokens or the answer
(`suffix`, tools, ...) are refused with 400 naming the parameter unless they carry their no-op value. Accepted are the
parameters that say how to keep, label, bill or route an answer but not what it is (`user`,
`metadata`, `parallel_tool_calls` with no tools, ...), with `store` and `service_tier` taken only
at values this server honours (nothing stored, one tier).
Errors are OpenAI-style objects `{"error": {"message", "type", "param", "code"}}` with a 4xx status
(`APIError`); `code` is a string where there is a specific one ("model_not_found"), else null, and
a message quotes a bad value cut short. A string holding a lone surrogate (JSON's \\ud800 escape),
which UTF-8 cannot carry, is refused wherever it is, in a field the answer reads or one it ignores
(`Text`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Annotated, Any, Callable, Literal

from fastapi.responses import JSONResponse
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from orca_torch import checks
from orca_torch.checks import SEED_LIMIT, is_finite_real
from orca_torch.core.engine import Engine
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.request import Request
from orca_torch.model.sampling import MAX_BIAS, MAX_PENALTY, MAX_REPETITION, SamplingParams
from orca_torch.serve.stop import MAX_STOP_CHARS, MAX_STOPS
from orca_torch.serve.tokenizer import content_text

ROLES = ("system", "user", "assistant", "developer")     # ("tool": refused, `_Message.no_tool_role`)
NO_TOOLS = ('role "tool" is not supported: this server does no tool calling (tools are refused unless empty, as '
            "is an assistant message's tool_calls), so a tool message has no call to answer; send a tool's output "
            "as a user message")
# parameter -> the values that change nothing here: no suffix, no tools, a server that
# stores nothing and has one tier (accepted; any other value is refused)
NO_OP = {
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
WHY = {"store": "this server stores no completions: leave it out or set false",
       "service_tier": 'this server has one processing tier: leave it out or set "auto" or "default"',
       "modalities": 'only text is generated: leave it out or set ["text"]'}


class APIError(Exception):
    """An OpenAI-style error: HTTP `status`, a message that says what was wrong, the parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code
        self.headers = headers

    def body(self) -> dict:
        """The error object: an answer's body, or a stream's error event once its 200 is sent."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def brief(value: Any) -> str:
    """A value a client sent, as JSON writes it, cut to about 100 characters (`checks.brief`)."""
    return checks.brief(value, 100, as_json=True)


def quoted_key(k: Any) -> str:
    """A key a client wrote, quoted, its first 60 characters at most."""
    k = str(k)
    return repr(k) if len(k) <= 60 else f"{k[:60]!r}..."


def _not_text(where: str, value: Any) -> str | None:
    """Why `value` at `where` is no text a client may send, or None where it is text UTF-8 can carry.
    JSON's \\ud800 escape gives a lone surrogate, which it cannot: not in an answer, a log or a
    tokenizer; so it is refused in every string of a body, a field this server reads or one it ignores."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"{where}: {brief(value)} is not valid text (a lone surrogate, which UTF-8 cannot carry)"
    return None


def _utf8(s: str) -> str:
    """`s`, checked by `_not_text` (a pydantic error `string_unicode`, as pydantic's own)."""
    if _not_text("", s) is not None:
        raise PydanticCustomError("string_unicode", "not valid text")
    return s


Text = Annotated[str, AfterValidator(_utf8)]
"""A string of a body: pydantic's plain `str` takes a lone surrogate."""


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
    sampling: SamplingParams | None = None      # None: greedy, no log probabilities
    n: int = 1                                  # choices, each its own request (`choice_sampling`)
    stop_token_ids: tuple[int, ...] = ()        # the client's own stop tokens (beside the model's eos)
    include_stop_str_in_output: bool = False    # keep the stop string, or stop token's text, that ended it
    echo: bool = False                          # each choice's text begins with the prompt's (completions')
    prompt_text: str | None = None              # the prompt as sent, where it was text (None: token ids)

    @property
    def logprobs(self) -> bool:
        """Whether the answer returns log probabilities (`SamplingParams.logprobs`)."""
        return self.sampling is not None and self.sampling.logprobs is not None

    def choice_sampling(self, i: int) -> SamplingParams | None:
        """Choice `i`'s sampling: the request's, its seed (if given) plus `i`, as vLLM seeds the n
        requests it makes of one (`ParentRequest`): each choice repeatable, and the choices drawn
        apart. Without a seed each draws from one derived from its own request id (`request_seed`)."""
        p = self.sampling
        if p is None or p.seed is None or i == 0:
            return p
        return replace(p, seed=p.seed + i)


class _Strict(BaseModel):
    """JSON's own types only (no "10" for 10, no true for 1); null is the same as absent."""
    model_config = ConfigDict(strict=True, extra="forbid")


class _StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: Literal[False] | None = None     # (vLLM's: usage in every chunk)
    include_obfuscation: Literal[False] | None = None        # (OpenAI's: padding against length side channels)


class _TextPart(_Strict):
    type: Literal["text"]
    text: Text

    @model_validator(mode="before")
    @classmethod
    def text_only(cls, data: Any) -> Any:
        """A part of another type (`image_url`, `input_audio`) is refused as such, before its keys
        are (its `image_url` key was the "unsupported key" the client was told of)."""
        if isinstance(data, dict) and "type" in data and data["type"] != "text":
            raise PydanticCustomError("refused", f'only text parts are supported (type "text"), got type '
                                                 f'{brief(data["type"])}')
        return data


class _Message(_Strict):
    role: Literal[ROLES]
    content: Text | list[_TextPart]
    name: Text | None = None             # (OpenAI's; no template here reads it)

    @model_validator(mode="before")
    @classmethod
    def no_tool_role(cls, data: Any) -> Any:
        """A tool message is refused as such, before its keys are (its `tool_call_id` would be)."""
        if isinstance(data, dict) and data.get("role") == "tool":
            raise PydanticCustomError("refused", NO_TOOLS)
        return data

    @field_validator("content")
    @classmethod
    def some_content(cls, content: Text | list[_TextPart]) -> Text | list[_TextPart]:
        """An empty list of parts is refused, as OpenAI's API refuses it (an empty string is text)."""
        if isinstance(content, list) and not content:
            raise PydanticCustomError("refused", "an empty list is not content: give a string, or a list of at "
                                                 "least one text part")
        return content


class _Body(_Strict):
    model: Text | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    seed: int | None = None
    temperature: Any = None             # (these three checked by `_sampling`, in the client's terms)
    top_p: Any = None
    top_k: Any = None
    user: Text | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    stop: Any = None                    # (checked by `_stop_strings`, in the client's terms)
    logprobs: Any = None                # (checked by `_logprobs`, as each endpoint defines it)
    n: Any = None                       # (checked by `_choices`)
    presence_penalty: Any = None        # (these four checked by `_adjustments`)
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    stop_token_ids: Any = None          # (checked by `_stop_ids`)
    include_stop_str_in_output: bool | None = None


def _no_op_fields(kind: str) -> dict[str, Any]:
    """The NO_OP parameters endpoint `kind` takes (any value here; `parse` checks it): the other
    endpoint's own are left out, so they are refused as unsupported."""
    other = next(names for k, names in ONLY.items() if k != kind)
    return {name: (Any, None) for name in NO_OP if name not in other}


BODIES = {"completions": create_model(
              "CompletionBody", __base__=_Body, **_no_op_fields("completions"), best_of=(Any, None),
              echo=(bool | None, None),
              prompt=(Text | list[int] | Annotated[list[Text | list[int]], Field(min_length=1, max_length=1)], ...)),
          "chat": create_model("ChatBody", __base__=_Body, **_no_op_fields("chat"),
                               max_completion_tokens=(Annotated[int, Field(ge=1)] | None, None),
                               metadata=(Annotated[dict[Annotated[str, Field(max_length=64), AfterValidator(_utf8)],
                                                        Annotated[str, Field(max_length=512), AfterValidator(_utf8)]],
                                                   Field(max_length=16)] | None, None),
                               parallel_tool_calls=(bool | None, None), safety_identifier=(Text | None, None),
                               prompt_cache_key=(Text | None, None), top_logprobs=(Any, None),
                               messages=(Annotated[list[_Message], Field(min_length=1)], ...))}
SHAPES = {"prompt": "prompt must be a string, a list of token ids, or a list of one of those (one prompt per request)",
          "stream_options": "stream_options must be an object with include_usage (and continuous_usage_stats, "
                            "include_obfuscation false)",
          "messages": "messages must be a non-empty list of {role, content} objects: role one of "
                      f"{', '.join(ROLES)}, content a string or a non-empty list of text parts "
                      '{"type": "text", "text": ...} (only text is supported)'}


def _walk(body: Any, loc: tuple) -> tuple[list, Any]:
    """The parts of pydantic's `loc` that are the client's, and what they point at in `body`: those
    that index into the body as written (the names pydantic gives a union's branches, `str` or
    `list[_TextPart]`, and a dict key's `[key]` index nothing, and are left out)."""
    parts = []
    for part in loc:
        if isinstance(body, dict) and part in body or (isinstance(body, list) and type(part) is int
                                                       and 0 <= part < len(body)):
            body = body[part]
            parts.append(part)
    return parts, body


def _refusal(e: ValidationError, kind: str, body: Any) -> APIError:
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
    if err["type"] == "string_unicode" and (loc[-1:] == ("[key]",) or not isinstance(_walk(body, loc)[1], str)):
        where = loc[:-2] if loc[-1:] == ("[key]",) else loc     # (a dict's key: pydantic's name for it is garbled)
        msg = _not_text(f"a key of {_path(body, where) or 'the body'}", value)    # (named by the object holding it)
    elif err["type"] == "string_unicode":               # (a value: named by its own path)
        msg = _not_text(_path(body, loc), value)
    elif name is None:
        msg = f"the body must be a JSON object, got {_json_kind(value)}"
    elif err["type"] == "extra_forbidden" and len(loc) > 1:
        msg = f"unsupported key {quoted_key(loc[-1])} in {_path(body, loc[:-1])}"
    elif err["type"] == "extra_forbidden":
        other = next((k for k, names in ONLY.items() if k != kind and name in names), None)
        where = f" (a parameter of {PATHS[other]} only)" if other else ""
        msg = (f"unsupported parameter {quoted_key(name)} for {PATHS[kind]}{where}; this endpoint takes "
               f"{', '.join(sorted(BODIES[kind].model_fields))}")
    elif err["type"] == "refused":                      # (said whole by the validator)
        msg = f"{_path(body, loc)}: {err['msg']}"
    elif err["type"] == "missing":
        msg = f"{_path(body, loc[:-1], loc[-1])} is required"
    elif name in SHAPES and (ambiguous or re.fullmatch(r"[a-z_]+(\[\d+\])?", _path(body, loc))):  # (field or item)
        at = any(isinstance(i, int) for i in loc[1:2])     # (an item: say which, and what it holds)
        msg = SHAPES[name] + (f"; {_path(body, loc)} is {brief(value)}" if at else "")
    elif err["type"] == "model_type":                   # (pydantic's message names the class: `_TextPart`)
        msg = f"{_path(body, loc)} must be an object, got {brief(value)}"
    else:
        msg = f"{_path(body, loc)}: {err['msg']}, got {brief(value)}"
    return APIError(msg, name if name is None or len(name) <= 60 else name[:60] + "...")     # (a key's name, cut)


MAX_N = 16          # choices per request at most (OpenAI's API takes up to 128, vLLM sets no limit)


def _choices(b: _Body) -> int:
    """How many choices to return: `n`, an integer 1 to `MAX_N` (null: 1). Each is its own request
    (Orca schedules them at iteration level as any others; no prompt K/V is shared). Completions'
    `best_of` is taken only where it changes nothing, at n: choosing the n most likely of more
    answers is not done here. With a `seed`, choice i draws with seed + i (`Generation.choice_sampling`),
    so seed + n - 1 must be a seed too."""
    n = b.n
    if n is not None and (type(n) is not int or not 1 <= n <= MAX_N):
        raise APIError(f"n={brief(n)} is not supported (an integer from 1 to {MAX_N}: how many choices to return, "
                       "each its own request)", "n")
    n = 1 if n is None else n
    best = getattr(b, "best_of", None)                  # (completions' own)
    if best is not None and not (type(best) is int and best == n):
        raise APIError(f"best_of={brief(best)} is not supported (answers are not ranked here to keep the best n: "
                       f"leave it out or set {n}, the request's n)", "best_of")
    if b.seed is not None and b.seed + n - 1 >= SEED_LIMIT:      # (`_sampling` checked the seed itself)
        raise APIError(f"seed={b.seed} with n={n} is not supported (choice i draws with seed + i, so seed + n - 1 "
                       "must stay below 2**63)", "seed")
    return n


MAX_LOGPROBS = {"completions": 5, "chat": 20}     # OpenAI's limits: most likely tokens listed per token


def _logprobs(b: _Body, kind: str) -> int | None:
    """How many most likely tokens to list beside each token's own log probability, or None for no
    log probabilities: completions' `logprobs` (an integer 0 to 5; null or false: none), chat's
    `logprobs` (true or false) and `top_logprobs` (0 to 20, only with `logprobs: true`; 0 or null:
    the tokens' own alone)."""
    lp, most = b.logprobs, MAX_LOGPROBS[kind]
    if kind == "completions":
        if lp is None or lp is False:
            return None
        if type(lp) is not int or not 0 <= lp <= most:
            raise APIError(f"logprobs={brief(lp)} is not supported (an integer from 0 to {most}: how many most likely "
                           "tokens to list beside each token's own log probability; null or false for none)",
                           "logprobs")
        return lp
    top = b.top_logprobs
    if lp is not None and type(lp) is not bool:
        raise APIError(f"logprobs={brief(lp)} is not supported (true to return each token's log probability, "
                       "false or null for none)", "logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= most):
        raise APIError(f"top_logprobs={brief(top)} is not supported (an integer from 0 to {most}: how many most "
                       "likely tokens to list beside each token's own, with logprobs: true)", "top_logprobs")
    if not lp:
        if top:
            raise APIError(f"top_logprobs={brief(top)} needs logprobs: true (it lists the most likely tokens beside "
                           "each token's own log probability, which logprobs asks for)", "top_logprobs")
        return None
    return top or 0


def _number(v: Any) -> bool:
    """Whether `v` is a JSON number (not a boolean) that is finite."""
    return type(v) in (int, float) and is_finite_real(v)


MAX_BIAS_KEY = 64
"""The longest `logit_bias` key read as a token id (spaces and zeros around a vocabulary's ids fit)."""


def _adjustments(b: _Body, vocab: int) -> dict[str, Any]:
    """The logit bias and penalties the request sets, as `SamplingParams`' keyword arguments (those
    left out, null or at their no-op value are not given): `presence_penalty` and
    `frequency_penalty` numbers in [-2, 2] (OpenAI's), `repetition_penalty` a number in [1e-6, 1e6]
    (vLLM's, bounded where float32's arithmetic stays finite: `sampling.MAX_REPETITION`),
    `logit_bias` an object mapping token ids, written as JSON keys and read as vLLM reads them
    (`_bias_id`: "42", " 42", "+42"), each in the model's vocabulary and named once, to finite
    numbers, clamped to [-100, 100] (OpenAI's range) as vLLM clamps them."""
    out: dict[str, Any] = {}
    for name, ok, allowed, off in (
            ("presence_penalty", lambda v: _number(v) and abs(v) <= MAX_PENALTY,
             f"a number from -{MAX_PENALTY:g} to {MAX_PENALTY:g}; 0 or left out for none", 0),
            ("frequency_penalty", lambda v: _number(v) and abs(v) <= MAX_PENALTY,
             f"a number from -{MAX_PENALTY:g} to {MAX_PENALTY:g}; 0 or left out for none", 0),
            ("repetition_penalty", lambda v: _number(v) and 1 / MAX_REPETITION <= v <= MAX_REPETITION,
             f"a number from {1 / MAX_REPETITION:g} to {MAX_REPETITION:g}; 1 or left out for none", 1)):
        v = getattr(b, name)
        if v is not None and not ok(v):
            raise APIError(f"{name}={brief(v)} is not supported ({allowed})", name)
        if v is not None and v != off:
            out[name] = v
    bias = b.logit_bias
    if bias is None or bias == {}:
        return out
    allowed = (f"logit_bias must be an object mapping token ids, integers as strings (\"42\"), from 0 to {vocab - 1}, "
               f"to finite numbers (clamped to [-{MAX_BIAS:g}, {MAX_BIAS:g}])")
    if not isinstance(bias, dict):
        raise APIError(f"{allowed}; got {brief(bias)}", "logit_bias")
    seen: dict[int, str] = {}
    for key, v in bias.items():
        t = _bias_id(key)
        if t is None or not 0 <= t < vocab:
            why = (f"has more than {MAX_BIAS_KEY} characters" if len(key) > MAX_BIAS_KEY else "is not an integer"
                   if t is None else f"names token {t}, outside the vocabulary")
            raise APIError(f"{allowed}; the key {quoted_key(key)} {why}", "logit_bias")
        if not _number(v):
            raise APIError(f"{allowed}; logit_bias[{quoted_key(key)}] is {brief(v)}", "logit_bias")
        if t in seen:
            raise APIError(f"{allowed}; the keys {quoted_key(seen[t])} and {quoted_key(key)} name one token",
                           "logit_bias")
        seen[t] = key
    out["logit_bias"] = {t: min(MAX_BIAS, max(-MAX_BIAS, bias[key])) for t, key in seen.items()}
    return out


def _bias_id(key: str) -> int | None:
    """A `logit_bias` key's token id as vLLM reads it, Python's `int(key)` (" 5" and "+5" are 5);
    None where that is no integer, or the key has more than `MAX_BIAS_KEY` characters (not read:
    `int` reads thousands of digits before its limit refuses them)."""
    if len(key) > MAX_BIAS_KEY:
        return None
    try:
        return int(key)
    except ValueError:
        return None


def _sampling(b: _Body, logprobs: int | None, vocab: int) -> SamplingParams | None:
    """How the answer's tokens are picked: None (greedy, no log probabilities) unless `temperature` > 0,
    `logprobs` (`_logprobs`) or a bias or penalty (`_adjustments`, which apply to greedy decoding
    too) is asked for. Each value is checked whether or not it is used (`top_p` with temperature 0
    too), as JSON's numbers."""
    t, p, k = b.temperature, b.top_p, b.top_k
    for name, v, ok, allowed in (
            ("temperature", t, _number(t) and t >= 0, "a number >= 0; 0 or left out is greedy decoding"),
            ("top_p", p, _number(p) and 0 < p <= 1, "a number in (0, 1]; 1 or left out keeps every token"),
            ("top_k", k, type(k) is int and k >= -1, "an integer >= 1, or -1, 0 or left out for every token"),
            ("seed", b.seed, 0 <= (b.seed or 0) < SEED_LIMIT, "an integer with 0 <= seed < 2**63")):
        if v is not None and not ok:
            raise APIError(f"{name}={brief(v)} is not supported ({allowed})", name)
    adjust = _adjustments(b, vocab)
    if t is None or t == 0:
        return None if logprobs is None and not adjust else SamplingParams(0.0, logprobs=logprobs, **adjust)
    return SamplingParams(t, 1.0 if p is None else p, k if k is not None and k >= 1 else None, b.seed, logprobs,
                          **adjust)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """`stop` as the strings to stop at: null, "" and [] are none (what clients send for none)."""
    allowed = (f"stop must be a string or a list of at most {MAX_STOPS} strings, each of 1 to {MAX_STOP_CHARS} "
               'characters (or null, "" or [] for none)')
    if stop is None or stop == "":
        return ()
    if not isinstance(stop, (str, list)):
        raise APIError(f"{allowed}; got {brief(stop)}", "stop")
    items = [stop] if isinstance(stop, str) else stop
    if len(items) > MAX_STOPS:
        raise APIError(f"{allowed}; got a list of {len(items)}", "stop")
    for i, s in enumerate(items):
        at = "stop" if isinstance(stop, str) else f"stop[{i}]"
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            got = (f"{_json_kind(s)}, {brief(s)}" if not isinstance(s, str) else "an empty string" if not s
                   else f"a string of {len(s)} characters")
            raise APIError(f"{allowed}; {at} is {got}", "stop")
        if _not_text(at, s) is not None:
            raise APIError(_not_text(at, s), "stop")
    return tuple(items)


def _stop_ids(ids: Any, vocab: int) -> tuple[int, ...]:
    """`stop_token_ids` (vLLM's) as the token ids that end the answer, besides the model's own
    end-of-sequence ids (which `ignore_eos` turns off, and these not): null or [] are none."""
    allowed = f"stop_token_ids must be a list of token ids, integers from 0 to {vocab - 1} (or null or [] for none)"
    if ids is None:
        return ()
    if not isinstance(ids, list):
        raise APIError(f"{allowed}; got {brief(ids)}", "stop_token_ids")
    for i, t in enumerate(ids):
        if type(t) is not int or not 0 <= t < vocab:
            raise APIError(f"{allowed}; stop_token_ids[{i}] is {brief(t)}", "stop_token_ids")
    return tuple(ids)


def _one_prompt(p: str | list) -> str | list[int]:
    """A completion's prompt, a text or token ids, out of a batch of one where it was sent as one."""
    return p[0] if isinstance(p, list) and p and not isinstance(p[0], int) else p


def _json_kind(value: Any) -> str:
    """What JSON calls `value`'s type (`null`, `array`, ...), as the client wrote it."""
    kinds = ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"), (list, "an array"),
             (dict, "an object"))
    return "null" if value is None else next((k for t, k in kinds if isinstance(value, t)), type(value).__name__)


def _path(body: Any, loc: tuple, missing: str | None = None) -> str:
    """Where in the body, as a client writes it: `messages[0].content` (`_walk`'s parts of `loc`,
    then the key `missing` where one is; a client's key, a `metadata` key say, cut to its first 60
    characters)."""
    parts = _walk(body, loc)[0] + ([] if missing is None else [missing])
    return "".join(f"[{i}]" if isinstance(i, int) else f".{i[:60]}..." if len(i) > 60 else f".{i}" for i in parts)[1:]


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


@dataclass(frozen=True)
class Limits:
    """The longest request (prompt + max_tokens) and the longest prompt the engine's own `check`
    takes, and what sets each: the model's context, the K/V memory or the step budget.
    `kv_tokens[n - 1]`: the most tokens (prompt + max_tokens) each of n choices of a request may
    take, past the context (`MAX_N` contexts where the memory does not bind): the n choices, each
    a request of its own with its own K/V, must fit the K/V memory together, as its manager counts
    them (`MemoryManager.fits_together`: paged, each in whole blocks)."""

    tokens: int
    prompt: int
    tokens_set_by: str
    prompt_set_by: str
    kv_tokens: tuple[int, ...]
    kv_set_by: str

    @classmethod
    def of(cls, engine: Engine) -> "Limits":
        """Found by bisection on `engine.check`, monotone in each length (1 and 0: nothing fits);
        the memory manager's own `check` alone says whether the K/V memory is what binds, and only
        the step budget limits a prompt more than the request; the memory manager, whether n
        choices fit it together."""
        def request(prompt: int, output: int) -> Request:
            return Request(0, 0.0, prompt, output, max_tokens=prompt + output, prompt_ids=[0] * prompt)

        def takes(check: Callable[[Request], None], prompt: int, output: int) -> bool:
            try:
                check(request(prompt, output))
            except ValueError:
                return False
            return True

        tokens = _longest(lambda n: takes(engine.check, 1, n - 1), 2, engine.max_context)
        prompt = _longest(lambda n: takes(engine.check, n, 1), 1, tokens - 1)
        kv_tokens = tuple(_longest(lambda t: engine.memory.fits_together([request(1, t - 1)] * n), 2,
                                   MAX_N * engine.max_context) for n in range(1, MAX_N + 1))
        in_memory = min(kv_tokens[0], engine.max_context)
        budget = "--max-num-batched-tokens without --chunked-prefill"
        kv = "--kv-slots" + (", --block-size" if isinstance(engine.memory, PagedMemory) else "")
        by = "the model's context" if tokens == engine.max_context else kv if tokens == in_memory else budget
        prompt_by = by if prompt == tokens - 1 else budget
        if by == budget:                        # (only where memory can run out: a recompute's prefill)
            by += " (a preempted request is recomputed, its prompt and the tokens it has so far, in one step)"
        return cls(tokens, prompt, by, prompt_by, kv_tokens, kv)


def _longest(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest `n` in [lo, hi] with `ok(n)` (`ok` true up to some `n`, false after), or lo - 1."""
    lo -= 1                                     # ok(lo) holds, vacuously
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


class BodyParser:
    """The checks at the door: a body's JSON checked against the endpoint's model and the server's
    limits, its prompt tokenized, and the result a `Generation`. The server (`app.OpenAIServer`)
    sets what they read: the tokenizer, the model's name, vocabulary and context, its `Limits`
    (the longest request and prompt the engine takes, and what sets each) and the model's
    end-of-sequence ids (`LiveEngine.stop_token_ids`)."""

    tok: Any
    model_name: str
    vocab: int
    max_context: int
    limits: Limits
    eos_ids: frozenset[int]

    def parse(self, body: Any, kind: str) -> Generation:
        try:
            b = BODIES[kind].model_validate(body)
        except ValidationError as e:
            raise _refusal(e, kind, body) from None
        if b.model is not None and b.model != self.model_name:
            raise self.no_such_model(b.model)
        for name, ok in NO_OP.items():
            if name not in BODIES[kind].model_fields:      # (the other endpoint's own)
                continue
            v = getattr(b, name)
            if not any(type(v) is type(o) and v == o for o in ok):
                why = WHY.get(name) or f"leave it out or set {json.dumps(ok[1])}"
                raise APIError(f"{name}={brief(v)} is not supported ({why})", name)
        sampling = _sampling(b, _logprobs(b, kind), self.vocab)
        n = _choices(b)
        stream, opts = bool(b.stream), b.stream_options
        if opts is not None and not stream:
            raise APIError("stream_options is only allowed with stream: true", "stream_options")
        mt, mct = b.max_tokens, getattr(b, "max_completion_tokens", None)     # (chat's own)
        if mt is not None and mct is not None and mt != mct:
            raise APIError(f"max_tokens ({brief(mt)}) and max_completion_tokens ({brief(mct)}) differ; give one",
                           "max_tokens")
        ids = self.prompt(b.prompt) if kind == "completions" else self.chat_prompt(b.messages)
        max_tokens = mt if mt is not None else mct
        max_param = "max_completion_tokens" if mt is None and mct is not None else "max_tokens"
        lim = self.limits
        if max_tokens is None:          # (chat's: the rest of a request's tokens, within the K/V memory's share)
            max_tokens = 16 if kind == "completions" else max(min(lim.tokens, lim.kv_tokens[n - 1]) - len(ids), 1)
        min_tokens = b.min_tokens or 0
        out_of_vocab = next((t for t in ids if not 0 <= t < self.vocab), None)
        if out_of_vocab is not None:
            raise APIError(f"prompt token ids must lie in [0, {self.vocab}), got {brief(out_of_vocab)}", "prompt")
        prompt_param = "prompt" if kind == "completions" else "messages"
        if not ids:
            raise APIError("prompt is empty (no tokens once tokenized)" if kind == "completions" else
                           "messages are empty once tokenized", prompt_param)
        if len(ids) + max_tokens > self.max_context:
            raise APIError(f"this model's maximum context length is {self.max_context} tokens; the request asks "
                           f"for {brief(len(ids) + max_tokens)} ({len(ids)} in the prompt, {brief(max_tokens)} "
                           "to generate)",
                           max_param if len(ids) < self.max_context else prompt_param)
        if len(ids) > lim.prompt:
            raise self.too_long(str(len(ids)), prompt_param)
        if len(ids) + max_tokens > lim.tokens:
            raise APIError(f"the request needs {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
                           f"to generate), more than the {lim.tokens} this server takes in one request (set by "
                           f"{lim.tokens_set_by})",
                           max_param)
        if lim.kv_tokens[n - 1] < 2:            # (n fit at no length: say how many choices would)
            most = max(k for k in range(1, MAX_N + 1) if lim.kv_tokens[k - 1] >= 2)
            raise APIError(f"n={n} choices do not fit the K/V memory together even at their shortest (each a request "
                           f"of its own, of at least 2 tokens: 1 in the prompt and 1 to generate): it holds at most "
                           f"{most} side by side (set by {lim.kv_set_by}); ask for at most {most} choices", "n")
        if len(ids) + max_tokens > lim.kv_tokens[n - 1]:
            raise APIError(f"n={n} choices of {len(ids) + max_tokens} tokens each ({len(ids)} in the prompt and "
                           f"{max_tokens} to generate: each choice is a request of its own, sharing no prompt) do not "
                           f"fit the K/V memory together: it holds {n} of at most {lim.kv_tokens[n - 1]} tokens each "
                           f"(set by {lim.kv_set_by}); ask for fewer choices or tokens", "n")
        if min_tokens > max_tokens:
            given = mt is not None or mct is not None
            cap = f"{max_param} ({max_tokens})" if given else (
                f"the {max_tokens} tokens the request may generate without max_tokens "
                + ("(the default)" if kind == "completions" else "(the rest of the server's tokens per request)"))
            raise APIError(f"min_tokens ({brief(min_tokens)}) must be <= {cap}", "min_tokens")
        include_usage = bool(opts is not None and opts.include_usage)
        stop_ids = _stop_ids(b.stop_token_ids, self.vocab)
        if min_tokens:
            self.refuse_no_token_left(set(stop_ids), bool(b.ignore_eos), min_tokens)
        echo = bool(getattr(b, "echo", None))             # (completions' own)
        if echo and sampling is not None and sampling.logprobs is not None:
            raise APIError("echo with logprobs is not supported (it would list the prompt's tokens' log "
                           "probabilities, which this server does not compute): leave one of them out", "echo")
        text = _one_prompt(b.prompt) if kind == "completions" else None
        return Generation(ids, max_tokens, stream, include_usage, bool(b.ignore_eos), min_tokens, max_param,
                          _stop_strings(b.stop), sampling, n, stop_ids, bool(b.include_stop_str_in_output), echo,
                          text if isinstance(text, str) else None)

    def refuse_no_token_left(self, stop_ids: set[int], ignore_eos: bool, min_tokens: int) -> None:
        """Refuses a request whose stop ids leave no token to make before its `min_tokens`: they are
        banned until then (`LiveEngine.new_request`): the client's and, unless `ignore_eos`, the
        model's end-of-sequence ids, as vLLM bans them. (The engine refuses such a request too, but
        as its own `check` sees it: the client's ids and the model's, run together.)"""
        eos = set() if ignore_eos else self.eos_ids - stop_ids
        if len(stop_ids | eos) < self.vocab:
            return
        held = (f"stop_token_ids and the model's end-of-sequence ids {sorted(eos)} (banned with them unless "
                "ignore_eos)" if eos else "stop_token_ids")
        fix = ", set ignore_eos" if eos else ""
        raise APIError(f"{held} hold every one of the {self.vocab} token ids, so none could be made before "
                       f"min_tokens={min_tokens}; leave a token out of them{fix}, or set min_tokens to 0",
                       "stop_token_ids")

    def no_such_model(self, model: str) -> APIError:
        return APIError(f"the model {quoted_key(model)} does not exist; this server serves {self.model_name!r}",
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
        p = _one_prompt(p)
        if not isinstance(p, str):
            return list(p)
        self.refuse_sure_misses(p, "prompt")
        return list(self.tok.encode(p))

    def chat_prompt(self, messages: list[_Message]) -> list[int]:
        clean = [{"role": m.role, "content": content_text(m.model_dump()["content"])}
                 for m in messages]         # (text parts joined with a newline, before any template sees them)
        self.refuse_sure_misses(" ".join(m["content"] for m in clean), "messages")
        try:
            return list(self.tok.chat(clean))
        except ValueError as e:
            raise APIError(str(e), "messages") from None

    def parse_body(self, raw: bytes, kind: str) -> Generation:
        """The body's JSON, checked (`parse`); runs in the parser thread."""
        if not raw.strip():                             # (JSON's own word for it: "Expecting value: line 1 column 1")
            raise APIError("the body is empty: it must be a JSON object")
        try:
            body = json.loads(raw, object_pairs_hook=_unique_keys)
        except _RepeatedKey as e:
            raise APIError(f"the body is not valid JSON here: the key {quoted_key(e.args[0])} is given twice in one "
                           "object") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else e
            raise APIError(f"the body is not valid JSON: {why}") from None
        except ValueError as e:                         # valid JSON, past what Python reads as an int
            raise APIError(f"the body holds an integer too long to read ({str(e).split(';')[0]}); integers here "
                           "must be shorter") from None
        return self.parse(body, kind)
