"""Stop strings (OpenAI's `stop`): an answer ends at the first place any of them occurs in the text
it generates (not its prompt), and leaves the stop string out, as OpenAI's API and vLLM do, unless
it is asked to keep it (vLLM's `include_stop_str_in_output`): then the text ends with it. An answer
ended by a stop token (an end-of-sequence id, or one of the request's `stop_token_ids`) leaves that
token's text out alike, or keeps it, as vLLM's detokenizer does. The
engine thread matches the detokenized text as it delivers each step's tokens (`LiveEngine`), for a
stream and a whole answer alike, and ends the request in the engine on the token that completed
the match, as vLLM's output processor does: no token is made after it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, NamedTuple, Sequence

MAX_STOPS = 4                   # OpenAI's limit on stop strings per request
MAX_STOP_CHARS = 1_000          # a stop string's length at most (the held-back text is shorter)


class StopMatcher:
    """One answer's text, piece by piece, cut before the first stop string. `add` returns the text
    that may be sent now: the end of it that could be the start of a stop string is held back until
    a later piece shows it is not one (a client never sees part of a stop string), and sent with
    the last piece (`final`). No stop strings: every piece is sent as it comes. `keep`: the text
    let out at a match ends with the stop string, not before it. `hit`: the stop string the text
    ended at (None: none yet)."""

    def __init__(self, stops: Sequence[str], keep: bool = False) -> None:
        assert all(isinstance(s, str) and s for s in stops), stops
        self.stops, self.keep = tuple(stops), keep
        self.longest = max(map(len, self.stops), default=1) - 1     # the most text ever held back
        self.held = ""
        self.matched = False
        self.hit: str | None = None

    def add(self, text: str, final: bool = False, armed: bool = True) -> str:
        """What `text`, the answer's next piece, lets out. `armed` false: a stop string that ends in
        this piece does not count (vLLM's rule while a request has fewer than `min_tokens` tokens);
        one that begins in it and ends in a later armed piece does."""
        assert not self.matched, "the answer ended at a stop string already"
        pending = self.held + text
        if armed:
            held = len(self.held)           # (held back unarmed, it may hold a whole, shorter, stop string)
            hits = [(i, i + len(s), s) for s in self.stops for i in (pending.find(s, max(held - len(s) + 1, 0)),)
                    if i >= 0]
            if hits:
                start, end, self.hit = min(hits)    # (the first to begin; of two alike, the first to end)
                self.matched, self.held = True, ""
                return pending[:end if self.keep else start]
        keep = 0 if final else self._open_end(pending)
        self.held = pending[len(pending) - keep:]
        return pending[:len(pending) - keep]

    def _open_end(self, text: str) -> int:
        """The length of the longest end of `text` that some stop string begins with (and is longer than)."""
        for start in range(max(len(text) - self.longest, 0), len(text)):
            end = text[start:]
            if any(len(s) > len(end) and s.startswith(end) for s in self.stops):
                return len(text) - start
        return 0


class ShownLogprob(NamedTuple):
    """A token's log probabilities as an answer shows them: its text, its log probability, and the
    most likely tokens' `(text, log probability)`, most likely first (`model.sampling.TokenLogprobs`
    with texts for ids)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Echo:
    """The prompt a completion's text begins with (its `echo`): `text` as the client sent it, or
    where it sent token ids (`text` None), their text, decoded where the answer's text is made, on
    `detok`, a detokenizer of its own (a tokenizer's `detokenizer()`)."""

    text: str | None
    ids: Sequence[int] = ()
    detok: Any = None

    def shown(self) -> str:
        """The prompt's text (a token prompt's decoded here, once: call it once)."""
        return self.text if self.text is not None else self.detok.add(list(self.ids), final=True)


class Answer:
    """One answer's text as its tokens come: each token's text (`detok`'s, a tokenizer's
    `detokenizer`), cut before the first stop string, the end that may begin one held back. `n`: the
    tokens it took, up to and including the one that completed a stop string; `finish`: why it
    ended (None: it goes on). The one way the server makes an answer's text, in the engine thread
    (`LiveEngine`), stop strings or not: a text that fails to be made ends its answer there alike.
    `keep_stop`: vLLM's `include_stop_str_in_output` (see the module docstring); `echo`: the prompt
    its first piece begins with, outside the stop strings' search (`Echo`). `stop_reason`, once it
    ends with "stop": the stop string it ended at, or the id of the stop token, where that is one of
    `stop_ids` (the client's, and a checkpoint's other end-of-sequence ids: `OpenAIServer._reason_ids`),
    else None, as vLLM's `stop_reason`."""

    def __init__(self, detok: Any, stops: Sequence[str] = (), min_tokens: int = 0, keep_stop: bool = False,
                 echo: Echo | None = None, stop_ids: Collection[int] = ()) -> None:
        self.detok, self.match, self.min_tokens = detok, StopMatcher(stops, keep_stop), min_tokens
        self.echo, self.stop_ids = echo, frozenset(stop_ids)
        self.stop_reason: str | int | None = None
        self.n = 0
        self.finish: str | None = None
        self.logprobs: list[ShownLogprob] | None = None     # (the last `take`'s tokens')

    def take(self, ids: Sequence[int], finish: str | None = None, lps: Sequence[Any] | None = None) -> list[str]:
        """The text each of `ids` (a step's new tokens, at least one) adds, up to the one that
        completes a stop string (looked for once the answer has more than `min_tokens` tokens, as
        vLLM looks); `finish`: the engine ends the answer with these (then what was held back comes
        too, with the last): "stop" where the last is a stop token, whose own text is left out unless
        `keep_stop`. `lps`: their log probabilities (`model.sampling.TokenLogprobs`, one a
        token), shown as `logprobs` then holds them for the tokens taken (`ShownLogprob`): each
        token's text, and each likely token's, is the text it adds after the tokens before it (as
        vLLM's detokenizer decodes them in context), so a token's leading space is kept and the
        texts of an answer's tokens run together are its text, but for a special token, which the
        text skips and which shows as vLLM shows it, decoded alone ("</s>": `special_text`), and
        where a stop string cuts it or a stop token it leaves out ended it: that token keeps its
        entry and its text, as vLLM lists every token it made."""
        assert len(ids) > 0, "an answer's text comes with its tokens"
        assert lps is None or len(lps) == len(ids), "a log probability a token"
        out = [self.echo.shown() if self.echo is not None and self.n == 0 else ""]
        self.logprobs = None if lps is None else []
        for i, t in enumerate(ids):
            final = finish is not None and i == len(ids) - 1
            self.n += 1
            left_out = final and finish == "stop" and not self.match.keep
            if lps is not None:
                texts = {a: self.detok.next_text(a) for a, _ in lps[i].top if a != t}
                if left_out or self.detok.special_text(t) is not None:     # (in no piece of the text)
                    texts[t] = self.detok.next_text(t)
            piece = self.detok.add([] if left_out else [t], final=final)
            if lps is not None:
                texts.setdefault(t, piece)
                top = tuple((texts[a], v) for a, v in lps[i].top)
                self.logprobs.append(ShownLogprob(texts[t], lps[i].logprob, top))
            out.append(self.match.add(piece, final, armed=self.n > self.min_tokens))
            if self.match.matched:
                self.finish, self.stop_reason = "stop", self.match.hit
                break
        else:
            self.finish = finish
            if finish == "stop":
                self.stop_reason = ids[-1] if ids[-1] in self.stop_ids else None
        return [out[0] + out[1], *out[2:]]
