"""Seeded sampling for the torch executor: `SamplingParams` (what a request asks for) and
`RowSampler` (one request's random stream), after vLLM's `SamplingParams` and sampler.

A request's next token is drawn from its row of logits alone, with a `torch.Generator` of its own
(seeded from `SamplingParams.seed`, or from the executor's seed and the request id), and exactly one
uniform number is drawn per token it makes. So its tokens depend on its seed and its own logits,
never on which requests share its batch, on chunked prefill or on a preemption: a recompute feeds
the tokens it made back to the model and draws nothing for them.

One draw: the logits over `temperature` (0, or below `GREEDY_BELOW`: the most likely token, as
greedy decoding picks it), the tokens outside the `top_k` most likely dropped (those tied with the
k-th stay, as in vLLM), then those outside the smallest set of most likely tokens whose probability
reaches `top_p`; the uniform number `u` picks the token whose slice of the cumulative distribution
holds `u` (inverse-CDF sampling). A token of probability 0 has a slice of width 0 and is never
picked; the sums are in float64, where float32's would round away the slices of a large
vocabulary's unlikely tokens. A row whose largest logit is not finite (a NaN from numbers that
overflowed) holds no distribution: `check_finite` refuses it, for greedy rows as for drawn ones.

Before the draw, and before greedy's pick alike (vLLM applies them before its argmax), a request
may change its row (`adjust_logits`, in vLLM's order): `logit_bias` adds a bias to chosen tokens'
logits (OpenAI's), then `repetition_penalty` r (transformers' and vLLM's) divides the positive
logits of every token in the prompt or made so far by r and multiplies the negative ones by r, then
`frequency_penalty` f and `presence_penalty` q (OpenAI's) take from each token's logit f times the
number of times it was made so far, and q once if it was made at all. The penalties read the
request's tokens (`TokenHistory`, which the executor hands over from the request); a request that
sets none of these (`SamplingParams.adjusts`) costs nothing more.

A request that asks for log probabilities (`SamplingParams.logprobs`, vLLM's) gets, with each token
it makes, the token's log probability and the `logprobs` most likely tokens' (`TokenLogprobs`), from
the log-softmax of its row of raw logits: the model's own distribution, before the bias, the
penalties, the temperature, top-k, top-p and `min_tokens`' bans (vLLM's default,
`logprobs_mode="raw_logprobs"`). Only the rows that ask pay for it (`token_logprobs`).
"""
from __future__ import annotations

import hashlib
import math
import numbers
import re
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch

from orca_torch.checks import SEED_LIMIT, brief, check_real, check_seed, is_int
from orca_torch.core.executor import RowsFailed


class NonFiniteLogits(RowsFailed):
    """A step's logits row has no finite largest logit: no token can be picked from it. Raised by
    an executor for a step, its `rows` name every such request (`RowsFailed`)."""


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")     # how CPython's reprs print a memory address
GREEDY_BELOW = 1e-5         # a temperature below this is greedy (vLLM's threshold): dividing by it overflows
MAX_PENALTY = 2.0           # |presence_penalty|, |frequency_penalty| at most (OpenAI's range)
MAX_BIAS = 100.0            # |a logit_bias value| at most (OpenAI's range)
MAX_REPETITION = 1e6
"""`repetition_penalty` lies in [1 / MAX_REPETITION, MAX_REPETITION]: a seen token's logit, divided
or multiplied by it and then divided by a temperature (>= `GREEDY_BELOW`), stays a float32 number
for any logit below 1e27 in size. Past that range (vLLM sets no upper bound) the arithmetic leaves
float32: 1e-300 rounds to 0 and a positive logit divided by it is +inf, 1e300 to inf and a logit of
0 times it NaN, so no token could be picked from the row."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a request's tokens are picked: `temperature` >= 0 (0: greedy), `top_p` in (0, 1] (1: off),
    `top_k` >= 1 or None (off), `seed` (None: the executor derives one from its own seed and the
    request id, so a run is reproducible). A `Request` without them (`sampling=None`) is greedy.
    `logprobs`: None (the default), or return each token's log probability and those of the
    `logprobs` most likely tokens (an integer >= 0; `TokenLogprobs`); it changes no token.
    `presence_penalty`, `frequency_penalty` (in [-2, 2], 0: off), `repetition_penalty` (in [1e-6,
    1e6], 1: off; `MAX_REPETITION`) and `logit_bias` (token id -> a bias in [-100, 100]; a mapping,
    kept as `(id, bias)` pairs in order of id; None or empty: none): see the module docstring; they
    apply at temperature 0 too. The ids are checked against the model's vocabulary when the
    executor checks the request (`torch_executor.check_sampling`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", check_real("temperature", self.temperature, 0.0))
        object.__setattr__(self, "top_p", check_real("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        if self.top_k is not None:
            if not (is_int(self.top_k) and self.top_k >= 1):
                raise ValueError(f"top_k must be an integer >= 1, or None for all tokens, got {brief(self.top_k)}")
            object.__setattr__(self, "top_k", int(self.top_k))
        if self.seed is not None:
            object.__setattr__(self, "seed", check_seed(self.seed))
        if self.logprobs is not None:
            if not (is_int(self.logprobs) and self.logprobs >= 0):
                raise ValueError(f"logprobs must be an integer >= 0 (how many most likely tokens to return beside "
                                 f"each token made), or None for none, got {brief(self.logprobs)}")
            object.__setattr__(self, "logprobs", int(self.logprobs))
        for name in ("presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, check_real(name, getattr(self, name), -MAX_PENALTY, MAX_PENALTY))
        object.__setattr__(self, "repetition_penalty", check_real("repetition_penalty", self.repetition_penalty,
                                                                  1 / MAX_REPETITION, MAX_REPETITION))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    @property
    def adjusts(self) -> bool:
        """Whether the request changes its logits before the pick (bias or penalties): `adjust_logits`."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Whether the tokens are the greedy ones (temperature 0): no draw at all."""
        return self.temperature < GREEDY_BELOW


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """`SamplingParams.logit_bias` as `(token id, bias)` pairs in order of id (a mapping given, or
    the pairs themselves; None: none), or ValueError saying what is wrong. The caller's mapping is
    only read."""
    if bias is None:
        return ()
    allowed = (f"logit_bias must map token ids (integers >= 0) to biases (numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}]): "
               "a dict, or (id, bias) pairs")
    if isinstance(bias, Mapping):
        items = list(bias.items())
    elif isinstance(bias, tuple) and all(isinstance(x, tuple) and len(x) == 2 for x in bias):
        items = list(bias)
    else:
        raise ValueError(f"{allowed}; got {brief(bias)}")
    out = []
    for t, b in items:
        if not (is_int(t) and t >= 0):
            raise ValueError(f"{allowed}; got the key {brief(t)}")
        out.append((int(t), check_real(f"logit_bias[{int(t)}]", b, -MAX_BIAS, MAX_BIAS)))
    if len({t for t, _ in out}) != len(out):        # (compared once each is an int: a key may have no hash)
        raise ValueError(f"{allowed}; a token id is given twice in {brief(bias)}")
    return tuple(sorted(out))


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """A request's tokens so far, as its penalties read them: its prompt's and those it has made
    (the executor hands them over from the request; they are read, never kept)."""

    prompt: Sequence[int]
    output: Sequence[int]


def adjust_logits(logits: torch.Tensor, p: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """A new row: one row of logits (`[vocab]`) with `p`'s logit bias, then its repetition, frequency
    and presence penalties, applied (see the module docstring), in float32 at least. The row given
    is not changed; a token banned (-inf) stays banned."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    if p.logit_bias:
        ids, biases = zip(*p.logit_bias)
        x[list(ids)] += torch.tensor(biases, dtype=x.dtype, device=x.device)
    made = torch.as_tensor(list(history.output), dtype=torch.long, device=x.device)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[torch.as_tensor(list(history.prompt), dtype=torch.long, device=x.device)] = True
        seen[made] = True
        r = p.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if (p.frequency_penalty or p.presence_penalty) and made.numel():
        counts = torch.bincount(made, minlength=x.numel()).to(x.dtype)
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def pick(logits: torch.Tensor, p: SamplingParams, history: TokenHistory, sampler: "RowSampler | None",
         n_generated: int) -> int:
    """A request's next token from its row of logits (`[vocab]`): adjusted (`adjust_logits`, where
    `p.adjusts`), then the greedy one, or one drawn by `sampler` (which a greedy request has none of).
    A row whose largest logit is not finite, as given or once adjusted (a penalty may overflow a
    finite logit), is refused (`check_finite`) before either."""
    x = adjust_logits(logits, p, history) if p.adjusts else logits
    check_finite(x[None])
    if p.greedy:
        return int(x.argmax())
    assert sampler is not None
    return sampler.draw(x, p, n_generated)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A token made, its log probability, and the most likely tokens' `(id, log probability)`, most
    likely first (as many as the request's `SamplingParams.logprobs`): see the module docstring."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: Sequence[int]) -> list[TokenLogprobs]:
    """Each row's `TokenLogprobs`: `logits` (`[n, vocab]`, raw) and `tokens` (`[n]`) the rows of the
    requests that asked, `ks` how many most likely tokens each asked for. The log-softmax is in
    float32 at least, as vLLM computes it."""
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    chosen = lp.gather(1, tokens[:, None].to(lp.device))[:, 0].tolist()
    values, ids = lp.topk(min(max(ks), lp.shape[-1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprobs(int(t), c, tuple(zip(i[:k], v[:k])))
            for t, c, i, v, k in zip(tokens.tolist(), chosen, ids, values, ks)]


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """One token from one row of `logits` (`[vocab]`, on `generator`'s device), drawing one
    uniform number from `generator` (see the module docstring). The row has a finite largest logit:
    `pick` (through `RowSampler.draw`) refused any other (`check_finite`)."""
    assert logits.dim() == 1 and not p.greedy
    x = logits.to(torch.float64) / p.temperature
    if p.top_k is not None and p.top_k < x.numel():
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], -math.inf)
    probs = x.softmax(-1)
    if p.top_p < 1.0:
        ranked, order = probs.sort(descending=True, stable=True)
        beyond = ranked.cumsum(0) - ranked >= p.top_p       # the mass before it reaches top_p already
        probs = probs.index_fill(0, order[beyond], 0.0)
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator, device=logits.device, dtype=torch.float32)
    # u <= 1 - 2**-24, so u * total rounds (in float64) to below total: the slice found is a token's
    return int(torch.searchsorted(cdf, u.double() * cdf[-1], right=True))


def check_finite(logits: torch.Tensor) -> None:
    """Raise NonFiniteLogits unless each row of `logits` (`[B, vocab]`) has a finite largest logit.
    A NaN would be greedy's pick (`argmax` takes NaN as the largest) and makes a draw's distribution
    NaN, which holds no token; -inf logits alone are fine (`ban_stops` sets them). Greedy and sampled
    rows are refused alike."""
    bad = rows_not_finite(logits)
    if bad:
        raise NonFiniteLogits(next(iter(bad.values())))


def rows_not_finite(logits: torch.Tensor, req_ids: Sequence[Hashable] | None = None) -> dict[int, str]:
    """The rows of `logits` (`[B, vocab]`) with no finite largest logit, in order, each with the
    message `check_finite` raises for it (row i: request `req_ids[i]`, where given)."""
    ok = torch.isfinite(logits.amax(dim=-1))            # (amax is NaN where the row holds one)
    if bool(ok.all()):
        return {}
    bad = {}
    for i in (~ok).nonzero()[:, 0].tolist():
        row = logits[i]
        what = "NaN" if bool(row.isnan().any()) else "+inf" if bool(row.isposinf().any()) else "only -inf"
        bad[i] = str(not_finite(None if req_ids is None else req_ids[i], what))
    return bad


def not_finite(req_id: Hashable | None, what: str) -> NonFiniteLogits:
    """The error for request `req_id`'s logits row (None: a row given by hand), which holds `what`."""
    who = "a logits row is" if req_id is None else f"request {brief(req_id)}: its logits row is"
    return NonFiniteLogits(f"{who} not finite (it holds {what}), so no token can be picked: the model's numbers "
                           "overflowed (float16 activations past its range, or weights that are not finite); run "
                           "the model in float32 or bfloat16, or check its weights")


def id_text(key: Hashable) -> str:
    """The text a request's seed is derived from: `repr(key)` for a str, an int or a tuple or
    namedtuple of such, and alike for ids the engine keys alike (equal, same hash), from process
    to process. A number counts as the int or float it equals (`np.int64(3)`, `3.0` and `3`,
    `True` and `1`: a column of ids read as floats or numpy scalars draws as the same ids), inside
    a tuple too; a frozenset lists its members sorted, where its repr lists them in hash order (for
    str members another in each process, as PYTHONHASHSEED varies). A namedtuple keeps its own
    repr (`Key(user='a', turn=3)`): a type the caller chose, not one a reader turned it into."""
    if isinstance(key, np.generic):
        key = key.item()
    if isinstance(key, numbers.Number):
        for cast in (int, float):
            try:
                as_cast = cast(key)
            except (TypeError, ValueError, OverflowError):     # (a complex; inf to int)
                continue
            if as_cast == key:
                return repr(as_cast)
        return repr(key)
    if not _has_members(key):
        return repr(key)
    parts = [id_text(k) for k in key]
    if isinstance(key, frozenset):
        return f"frozenset({{{', '.join(sorted(parts))}}})" if parts else "frozenset()"
    if type(key) is tuple:
        return f"({', '.join(parts)}{',' if len(parts) == 1 else ''})"
    return f"{type(key).__name__}({', '.join(f'{f}={t}' for f, t in zip(key._fields, parts))})"


def _has_members(key: Hashable) -> bool:
    """True for a tuple, a namedtuple or a frozenset: the ids whose members `id_text` reads."""
    return isinstance(key, frozenset) or type(key) is tuple or (isinstance(key, tuple) and hasattr(key, "_fields"))


def printed_by_address(key: Hashable) -> Hashable | None:
    """The part of `key` (itself, or a member of a tuple, namedtuple or frozenset in it) whose text
    (`id_text`) shows a memory address, as CPython prints one (' at 0x...': object's repr, a
    function's, a bound method's, a repr holding any of these), so that it is another each run; None
    if none is. A str or bytes is its own text, whatever it says."""
    if _has_members(key):
        return next((part for part in map(printed_by_address, key) if part is not None), None)
    if isinstance(key, (str, bytes)) or _ADDRESS.search(id_text(key)) is None:
        return None
    return key


def request_seed(p: SamplingParams, executor_seed: int, req_id: Hashable) -> int:
    """The seed of a request's generator: its own, or one derived from the executor's seed and its
    id (`id_text`, by a hash that does not change from process to process, as Python's `hash` of a
    str does)."""
    if p.seed is not None:
        return p.seed
    digest = hashlib.blake2b(f"{executor_seed}:{id_text(req_id)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT


class RowSampler:
    """One request's random stream, kept from its first token to its last (across preemptions)."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.n_drawn = 0

    def draw(self, logits: torch.Tensor, p: SamplingParams, n_generated: int) -> int:
        """Its next token: the request has made `n_generated` so far, each drawn here once."""
        assert self.n_drawn == n_generated, f"token {n_generated} drawn after {self.n_drawn} draws"
        self.n_drawn += 1
        return sample(logits, p, self.generator)
