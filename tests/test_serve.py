"""The live OpenAI-compatible server on the real engine: streamed tokens equal generation alone
whatever the overlap, bad input gets an OpenAI-style 4xx, a departed client's memory comes back,
and a signal ends the streams cleanly (lecture §4.1: a request joins a running batch)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from orca_torch.core.request import Status  # noqa: E402
from orca_torch.model.orca_model import generate_alone  # noqa: E402
from orca_torch.serve.server import ServeConfig, make_server  # noqa: E402
from serving import Lines, serving, tiny_checkpoint  # noqa: E402
from tiny_model import raw_logprobs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60


@pytest.fixture(scope="module")
def server():
    """A `tiny` server in this process, max_bs=4 so that 16 requests queue and overlap."""
    with serving(ServeConfig(model="tiny", port=0, max_bs=4, kv_slots=4 * 512)) as running:
        yield running


def sse_events(lines) -> list:
    """The `data:` payloads of an SSE stream, parsed; the last is the string "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            d = line[len("data: "):]
            out.append(d if d == "[DONE]" else json.loads(d))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


async def stream_one(client, url, body, delay):
    await asyncio.sleep(delay)
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        return sse_events([line async for line in r.aiter_lines()])


async def stream_or_leave(client, url: str, body: dict, leave_at: int | None) -> list | None:
    """A streamed completion's SSE events, or None for a client that leaves (its connection closed)
    after reading `leave_at` lines."""
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = []
        async for line in r.aiter_lines():
            if leave_at is not None and len(lines) == leave_at:
                return None
            lines.append(line)
    return sse_events(lines)



def test_the_step_log_counts_on_across_idle_stretches(server):
    """The engine drops its records (its steps' too) when it goes idle; the step log's indices go on
    rising, so `since=N` finds every step after the N-th the server ran."""
    url, live, _ = server
    before = len(httpx.get(url + "/orca/steps").json()["steps"])
    for prompt, n in (("ka", 3), ("ka bemo", 2)):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": n},
                       timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        deadline = time.time() + 10
        while live.engine.requests and time.time() < deadline:    # until it idles and drops them
            time.sleep(0.02)
        assert live.engine.requests == []
    steps = httpx.get(url + "/orca/steps").json()["steps"]
    indices = [s[0] for s in steps]
    assert indices == list(range(indices[0], indices[0] + len(indices)))       # no index twice
    later = httpx.get(url + "/orca/steps", params={"since": indices[before]}).json()["steps"]
    assert [s[0] for s in later] == indices[before:] and len(later) >= 5     # 3 + 2 steps at least


def test_16_concurrent_streams_equal_generation_alone(server):
    url, live, _ = server
    model, tok = live.engine.executor.model, None
    from orca_torch.serve.tokenizer import PresetTokenizer
    tok = PresetTokenizer("tiny")
    rng = np.random.default_rng(1)
    bodies, prompts = [], []
    for i in range(16):
        n_out = int(rng.integers(3, 40))
        if i % 2:
            ids = rng.integers(0, model.spec.vocab, size=int(rng.integers(2, 40))).tolist()
            body = {"model": "tiny", "prompt": ids}
        else:
            words = [tok.words[int(t)] for t in rng.integers(1, model.spec.vocab, size=int(rng.integers(2, 40)))]
            text = " ".join(words) + " nonsense"                 # an unknown word becomes <unk>
            ids = tok.encode(text)
            body = {"model": "tiny", "prompt": text}
        if i % 4 == 3:
            body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "ka bo"}]}]}
            ids = tok.encode("user: ka bo\nassistant:")
        body.update(max_tokens=n_out, stream=True, stream_options={"include_usage": True})
        bodies.append(body)
        prompts.append((ids, n_out))

    async def go():
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            return await asyncio.gather(*[
                stream_one(c, url + ("/v1/chat/completions" if "messages" in b else "/v1/completions"), b, 0.01 * i)
                for i, b in enumerate(bodies)])

    results = asyncio.run(asyncio.wait_for(go(), TIMEOUT))
    try:
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(httpx.get(url + "/v1/models").json()["data"][0]["root"])
    except ImportError:
        hf = None
    for body, (ids, n_out), events in zip(bodies, prompts, results):
        chat = "messages" in body
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": len(ids), "completion_tokens": n_out,
                                                              "total_tokens": len(ids) + n_out}
        chunks = events[1:-2] if chat else events[:-2]
        if chat:
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        texts = [c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in chunks]
        assert len(texts) == n_out                          # one token per chunk
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (n_out - 1) + ["length"]
        assert tok.encode("".join(texts)) == generate_alone(model, ids, n_out)
        if hf is not None:                                  # what a benchmark client counts with
            assert hf("".join(texts), add_special_tokens=False)["input_ids"] == generate_alone(model, ids, n_out)
    # the per-iteration log: a request that arrived later joined a batch of running decodes
    arrival = {r.req_id: r.arrival_s for r in live.requests}
    mixed = [s for s in live.steps if any(p == 0 for _, _, p in s.works) and any(p > 0 for _, _, p in s.works)
             and len({arrival[rid] for rid, _, _ in s.works}) > 1]
    assert mixed, "no iteration mixed a new request's prefill with earlier requests' decodes"
    assert max(s.batch_size for s in live.steps) == 4
    # the metrics add up
    text = httpx.get(url + "/metrics").text
    gen = sum(n for _, n in prompts)

    def value(line_start):
        return float(next(line for line in text.splitlines() if line.startswith(line_start)).split()[-1])

    assert value('vllm:generation_tokens_total{model_name="tiny"}') >= gen
    assert value('vllm:time_to_first_token_seconds_count{model_name="tiny"}') >= 16
    assert value('orca:batch_size_count{model_name="tiny"}') == len(live.steps)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:inter_token_latency_seconds_bucket",
                 "orca:kv_slots_reserved", "orca:kv_slots_used", "orca:batch_size_bucket"):
        assert name in text


def test_a_seeded_sampled_answer_is_the_same_streamed_whole_and_amid_other_requests(server):
    """temperature, top_p, top_k and seed are taken: the same seed gives the same tokens streamed,
    whole and while greedy requests share its batches, the tokens the engine draws for the request in
    a run of its own; another seed gives other tokens, and temperature 0 the greedy ones, whatever
    the seed, top_p and top_k."""
    from orca_torch.core.engine import Engine
    from orca_torch.core.memory import UnlimitedMemory
    from orca_torch.core.request import Request
    from orca_torch.model.sampling import SamplingParams
    from orca_torch.model.torch_executor import TorchExecutor

    url, live, _ = server
    body = {"prompt": "ka bemo", "max_tokens": 24, "temperature": 1, "top_p": 0.95, "top_k": 100, "seed": 42}
    crowd = [{"prompt": [i + 1] * (i + 2), "max_tokens": 20 + i} for i in range(6)]

    async def go():
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            return await asyncio.gather(*[stream_one(c, url + "/v1/completions", {**b, "stream": True}, 0.01 * i)
                                          for i, b in enumerate(crowd[:3] + [body] + crowd[3:])])

    amid = "".join(e["choices"][0]["text"] for e in asyncio.run(asyncio.wait_for(go(), TIMEOUT))[3][:-1])
    texts, _, _ = _token_texts(url, "/v1/completions", body)
    whole, n, _, rid = _whole(url, "/v1/completions", body)
    assert amid == "".join(texts) == whole and n == 24
    req = next(r for r in live.requests if f"-{r.req_id}" == rid[rid.rindex("-"):])
    model = live.engine.executor.model
    own = Request(0, 0.0, req.prompt_len, 24, prompt_ids=req.prompt_ids, sampling=SamplingParams(1.0, 0.95, 100, 42))
    alone = Engine(TorchExecutor(model, model.new_kv(64)), UnlimitedMemory()).run([own]).output_ids[0]
    assert req.output_ids == alone != generate_alone(model, req.prompt_ids, 24)
    assert _whole(url, "/v1/completions", {**body, "seed": 43})[0] != whole
    greedy = _whole(url, "/v1/completions", {"prompt": "ka bemo", "max_tokens": 24})[0]
    assert _whole(url, "/v1/completions", {**body, "temperature": 0.0})[0] == greedy


def test_penalties_and_logit_bias_change_an_answer_as_the_engine_alone_does(server):
    """presence_penalty, frequency_penalty, repetition_penalty and logit_bias are taken, greedy or
    drawn: a bias of -100 on the greedy first token moves it (its key read as vLLM reads it, int(key):
    " 5" and "+5" are 5, and a bias past ±100 clamped to it), a frequency penalty breaks the greedy
    answer's repeats; each answer is the one the engine makes for the request in a run of its own
    with those SamplingParams, streamed or whole."""
    from orca_torch.core.engine import Engine
    from orca_torch.core.memory import UnlimitedMemory
    from orca_torch.core.request import Request
    from orca_torch.model.sampling import SamplingParams
    from orca_torch.model.torch_executor import TorchExecutor

    url, live, _ = server
    model = live.engine.executor.model
    prompt = [100, 219, 141, 8, 195, 186, 216, 44]
    plain = generate_alone(model, prompt, 24)
    assert len(set(plain)) < len(plain)                 # (it repeats)
    for extra, params in (
            ({"logit_bias": {str(plain[0]): -100}}, SamplingParams(0.0, logit_bias={plain[0]: -100})),
            ({"logit_bias": {f" {plain[0]}": -1e9}}, SamplingParams(0.0, logit_bias={plain[0]: -100})),
            ({"logit_bias": {f"+{(plain[0] + 1) % 256}": 250}},
             SamplingParams(0.0, logit_bias={(plain[0] + 1) % 256: 100})),
            ({"frequency_penalty": 2}, SamplingParams(0.0, frequency_penalty=2.0)),
            ({"presence_penalty": 1.5, "repetition_penalty": 1.2, "temperature": 0.8, "seed": 3},
             SamplingParams(0.8, seed=3, presence_penalty=1.5, repetition_penalty=1.2))):
        body = {"prompt": prompt, "max_tokens": 24, **extra}
        whole, n, _, rid = _whole(url, "/v1/completions", body)
        texts, _, _ = _token_texts(url, "/v1/completions", body)
        req = next(r for r in live.requests if f"-{r.req_id}" == rid[rid.rindex("-"):])
        own = Request(0, 0.0, len(prompt), 24, prompt_ids=prompt, sampling=params)
        alone = Engine(TorchExecutor(model, model.new_kv(64)), UnlimitedMemory()).run([own]).output_ids[0]
        assert req.sampling == params and req.output_ids == alone != plain, extra
        assert "".join(texts) == whole and n == 24


def test_64_at_once_queue_and_each_is_answered_once_with_exact_usage(server):
    """Overload (64 requests, max_bs 4): they queue; none is lost or answered twice."""
    url, live, _ = server
    n_before = len(live.requests)

    async def one(c, i):
        body = {"prompt": [i % 200 + 1] * (1 + i % 9), "max_tokens": 1 + i % 13}
        if i % 2:
            r = await c.post(url + "/v1/completions", json=body)
            assert r.status_code == 200
            out = r.json()
            return out["id"], out["usage"], 1
        body.update(stream=True, stream_options={"include_usage": True})
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            events = sse_events([line async for line in r.aiter_lines()])
        assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        assert len({e["id"] for e in events[:-1]}) == 1
        return events[0]["id"], events[-2]["usage"], len(events) - 2

    async def go():
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*[one(c, i) for i in range(64)])

    got = asyncio.run(asyncio.wait_for(go(), TIMEOUT))
    assert len({rid for rid, _, _ in got}) == 64
    for i, (_, usage, n_chunks) in enumerate(got):
        p, n = 1 + i % 9, 1 + i % 13
        assert usage == {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
        assert i % 2 or n_chunks == n                   # a stream: one chunk per token
    assert len(live.requests) - n_before == 64


@pytest.mark.parametrize("stops, pieces, want, matched", [
    (["abc", "bcd"], [("xa",), ("b",), ("cd",)], ["x", "", ""], True),        # the earliest of two, across pieces
    (["bcd", "abc"], [("xabcd",)], ["x"], True),                              # (whatever their order)
    ([" ka"], [(" bo",), (" k",), (" kb",), (" ka",)], [" bo", "", " k kb", ""], True),   # held, then let out
    (["zz"], [("az",), ("z", True)], ["a", ""], True),                        # matched by the last piece
    (["zz"], [("az",), ("y", True)], ["a", "zy"], False),                     # the end lets out what was held
    (["zz"], [("a",), ("z", True)], ["a", "z"], False),                       # even a possible start of one
    (["zz"], [("azz", False, False), ("z",)], ["az", ""], True),              # only the later zz counts
    (["abc", "b"], [("ab", False, False), ("x",)], ["", "abx"], False),       # b, whole before it counted: not
    (["ab", "wxyz"], [("qab", False, False), ("c",)], ["qab", "c"], False),   # nor held back, as it can no longer
    ([], [("a",), ("b", True)], ["a", "b"], False),                           # no stop strings: as it comes
])
def test_a_stop_matcher_cuts_before_the_first_stop_string_and_holds_back_only_its_possible_start(
        stops, pieces, want, matched):
    from orca_torch.serve.stop import StopMatcher

    m = StopMatcher(stops)
    assert [m.add(*p) for p in pieces] == want and m.matched is matched


def _token_texts(url: str, path: str, body: dict) -> tuple[list[str], dict, list]:
    """A stream's chunks' texts (one per token), its usage and its finish reasons."""
    with httpx.stream("POST", url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    chunks = [e["choices"][0] for e in events[:-2] if e["choices"] and "role" not in e["choices"][0].get("delta", {})]
    texts = [c["text"] if "text" in c else c["delta"].get("content", "") for c in chunks]
    return texts, events[-2]["usage"], [c["finish_reason"] for c in chunks]


def _whole(url: str, path: str, body: dict) -> tuple[str, int, str, str]:
    """A whole answer's text, completion tokens, finish reason and id."""
    r = httpx.post(url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    out = r.json()
    c = out["choices"][0]
    return (c["text"] if "text" in c else c["message"]["content"], out["usage"]["completion_tokens"],
            c["finish_reason"], out["id"])


def _stopped(texts: list[str], stops: list[str], min_tokens: int = 0) -> tuple[str, int, str]:
    """What an answer whose tokens' texts are `texts` is with `stops`, as OpenAI's API defines it:
    its text cut before the first stop string to end after the first `min_tokens` tokens' text, the
    tokens up to the one that completes it, "stop"; none: all of it, "length"."""
    full = "".join(texts)
    ends = [len("".join(texts[:j])) for j in range(len(texts) + 1)]       # where each token's text ends
    found = []
    for s in stops:
        at = full.find(s, max(ends[min_tokens] - len(s) + 1, 0))
        if at >= 0:
            found.append((next(j for j, e in enumerate(ends) if e >= at + len(s)), at))
    if not found:
        return full, len(texts), "length"
    n = min(j for j, _ in found)
    return full[:min(at for j, at in found if j == n)], n, "stop"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "ka bemo", "max_tokens": 24}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ka bemo"}], "max_tokens": 24}),
], ids=["completions", "chat"])
def test_stop_strings_cut_the_answer_before_the_first_one_and_change_no_token_before_it(server, path, body):
    """The same prompt with and without `stop`: the answer with it is the one without, cut right
    before the first place any of its strings occurs (one spanning two tokens here); usage counts
    the tokens up to the one that completed it; a stream sends the same text, one chunk a token."""
    url, _, _ = server
    texts, usage, _ = _token_texts(url, path, body)
    assert usage["completion_tokens"] == 24 and _whole(url, path, body)[:3] == ("".join(texts), 24, "length")
    span = texts[5][-2:] + texts[6][:3]                  # the end of the 6th token's word, the 7th's start
    for stop in (span, [texts[20].strip(), "zzzzzz", span], [texts[9][1:]], texts[0]):
        want = _stopped(texts, [stop] if isinstance(stop, str) else stop)
        assert want[2] == "stop" and _whole(url, path, {**body, "stop": stop})[:3] == want, stop
        got, usage, finishes = _token_texts(url, path, {**body, "stop": stop})
        assert ("".join(got), usage["completion_tokens"]) == want[:2] and len(got) == want[1]
        assert finishes == [None] * (want[1] - 1) + ["stop"]


@pytest.mark.parametrize("stops, pieces, want", [
    (["abc", "bcd"], [("xa",), ("b",), ("cdy",)], ["x", "", "abc"]),        # the first to begin, kept whole
    (["bcd", "b"], [("xbcdy",)], ["xb"]),                                    # of two that begin alike, the first to end
    ([" ka"], [(" bo",), (" k",), (" kay",)], [" bo", "", " k ka"]),        # held back, then let out with it
])
def test_a_stop_matcher_that_keeps_the_stop_string_ends_the_text_with_it(stops, pieces, want):
    from orca_torch.serve.stop import StopMatcher

    m = StopMatcher(stops, keep=True)
    assert [m.add(*p) for p in pieces] == want and m.matched


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "ka bemo", "max_tokens": 24}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ka bemo"}], "max_tokens": 24}),
], ids=["completions", "chat"])
def test_include_stop_str_in_output_keeps_the_stop_string_streamed_and_whole(server, path, body):
    """With `include_stop_str_in_output` (vLLM's) the answer ends with the stop string that ended it,
    not before it, streamed or whole; the tokens and usage are as without it."""
    url, _, _ = server
    texts, _, _ = _token_texts(url, path, body)
    full = "".join(texts)
    span = texts[5][-2:] + texts[6][:3]                  # the end of the 6th token's word, the 7th's start
    for stop in (span, ["zzzzzz", span]):
        cut, n, finish = _stopped(texts, [stop] if isinstance(stop, str) else stop)
        kept = full[:len(cut) + len(span)]
        assert finish == "stop" and kept.endswith(span) and len(kept) > len(cut)
        keep = {**body, "stop": stop, "include_stop_str_in_output": True}
        assert _whole(url, path, keep)[:3] == (kept, n, "stop"), stop
        got, usage, finishes = _token_texts(url, path, keep)
        assert ("".join(got), usage["completion_tokens"], finishes[-1]) == (kept, n, "stop") and len(got) == n
        assert _whole(url, path, {**body, "stop": stop, "include_stop_str_in_output": False})[:3] == (cut, n, "stop")


def test_echo_begins_each_choice_with_the_prompt_streamed_and_whole(server):
    """Completions' `echo`: each choice's text is the prompt's (as sent, or a token prompt's words),
    then the completion's; a stream sends the prompt with the first token's chunk. A stop string is
    looked for in the completion only; the tokens and usage are as without echo."""
    from orca_torch.serve.tokenizer import preset_words

    url, live, _ = server
    words = preset_words(live.engine.executor.model.spec.vocab)
    for prompt, head in (("ka bemo", "ka bemo"), ([7, 8, 9], "".join(" " + words[t] for t in (7, 8, 9)))):
        body = {"prompt": prompt, "max_tokens": 12}
        texts, usage, _ = _token_texts(url, "/v1/completions", body)
        got, usage_echo, finishes = _token_texts(url, "/v1/completions", {**body, "echo": True})
        assert got == [head + texts[0], *texts[1:]] and usage_echo == usage and finishes[-1] == "length"
        r = httpx.post(url + "/v1/completions", json={**body, "echo": True, "n": 2}, timeout=TIMEOUT).json()
        assert [c["text"] for c in r["choices"]] == [head + "".join(texts)] * 2
        stop = head.split()[-1]                         # (a word of the prompt, not of the completion)
        assert stop not in "".join(texts)
        assert _whole(url, "/v1/completions", {**body, "echo": True, "stop": stop})[:3] == (
            head + "".join(texts), 12, "length")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_token_ids_end_the_answer_with_stop_leaving_the_token_s_text_out_unless_kept(server, stream):
    """`stop_token_ids` (vLLM's): the answer ends at the first of them it makes, finish_reason "stop",
    the request leaving the engine there; usage counts the stop token, whose text is left out (vLLM's
    rule) unless `include_stop_str_in_output`. `ignore_eos` leaves them on; with `min_tokens` m none
    is made among the first m tokens."""
    url, live, _ = server
    model = live.engine.executor.model
    prompt = [7, 8, 9]
    plain = generate_alone(model, prompt, 24)
    k = next(i for i in range(4, 24) if plain[i] not in plain[:i])
    texts, _, _ = _token_texts(url, "/v1/completions", {"prompt": prompt, "max_tokens": 24})
    for extra, text in (({}, "".join(texts[:k])), ({"ignore_eos": True}, "".join(texts[:k])),
                        ({"include_stop_str_in_output": True}, "".join(texts[:k + 1]))):
        body = {"prompt": prompt, "max_tokens": 24, "stop_token_ids": [plain[k], 255], **extra}
        if stream:
            got, usage, finishes = _token_texts(url, "/v1/completions", body)
            assert finishes == [None] * k + ["stop"] and len(got) == k + 1, extra
            answer = ("".join(got), usage["completion_tokens"], finishes[-1])
        else:
            answer = _whole(url, "/v1/completions", body)[:3]
        assert answer == (text, k + 1, "stop"), extra
    _settled(live)
    req = live.requests[-1]
    assert req.status is Status.ABORTED and req.output_ids == plain[:k + 1]
    body = {"prompt": prompt, "max_tokens": 24, "stop_token_ids": [plain[k]], "min_tokens": k + 1}
    _whole(url, "/v1/completions", body)
    assert plain[k] not in live.requests[-1].output_ids[:k + 1]


def test_the_stop_token_a_text_leaves_out_keeps_its_log_probability_entry_with_its_text(server):
    """With `logprobs`, an answer a stop token ended lists that token's log probability, with the
    text it would add, as vLLM lists every token it made (and counts in usage), though the answer's
    text leaves it out: the entries run together are the text that `include_stop_str_in_output`
    keeps, the last one's `text_offset` is the text's length, and it is among its likely tokens by
    that text; whole and streamed, each of n=2 choices, and chat's alike."""
    url, live, _ = server
    prompt = [7, 8, 9]
    plain = generate_alone(live.engine.executor.model, prompt, 24)
    k = next(i for i in range(4, 24) if plain[i] not in plain[:i])
    body = {"prompt": prompt, "max_tokens": 24, "stop_token_ids": [plain[k]], "logprobs": 2, "n": 2}
    kept = _whole(url, "/v1/completions", {**body, "include_stop_str_in_output": True})[0]
    r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT).json()
    assert r["usage"]["completion_tokens"] == 2 * (k + 1)
    for c in r["choices"]:
        lp, text = c["logprobs"], c["text"]
        stop_text = kept[len(text):]
        assert stop_text and kept.startswith(text) and c["finish_reason"] == "stop"
        assert len(lp["tokens"]) == k + 1 and lp["tokens"][-1] == stop_text and "".join(lp["tokens"]) == kept
        assert lp["text_offset"][-1] == len(text) and lp["top_logprobs"][-1][stop_text] == lp["token_logprobs"][-1]
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as s:
        events = sse_events(s.iter_lines())
    for i, c in enumerate(r["choices"]):
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == i]
        assert [t for ch in chunks for t in ch["logprobs"]["tokens"]] == c["logprobs"]["tokens"]
        assert [o for ch in chunks for o in ch["logprobs"]["text_offset"]] == c["logprobs"]["text_offset"]
        assert (chunks[-1]["text"], chunks[-1]["finish_reason"]) == ("", "stop")
    chat = {"messages": [{"role": "user", "content": "ka bemo"}], "max_tokens": 12, "logprobs": True}
    said = httpx.post(url + "/v1/chat/completions", json=chat, timeout=TIMEOUT).json()["choices"][0]
    tokens = [e["token"] for e in said["logprobs"]["content"]]
    j = next(i for i in range(2, 12) if tokens[i] not in tokens[:i])
    stop_id = generate_alone(live.engine.executor.model, live.requests[-1].prompt_ids, 12)[j]
    said = httpx.post(url + "/v1/chat/completions", json={**chat, "stop_token_ids": [stop_id]},
                      timeout=TIMEOUT).json()["choices"][0]
    assert said["message"]["content"] == "".join(tokens[:j]) and said["finish_reason"] == "stop"
    assert [e["token"] for e in said["logprobs"]["content"]] == tokens[:j + 1]


def test_stop_reason_names_the_stop_string_or_stop_token_that_ended_each_choice(server):
    """vLLM's `stop_reason`, in every choice, whole and streamed (its last chunk; null before), on
    both endpoints: the stop string an answer ended at, or the client's stop token id; null for an
    answer that ran to its length or ended at an end-of-sequence id, as vLLM has it."""
    from orca_torch.serve.stop import Answer

    url, live, app = server
    prompt = [7, 8, 9]
    plain = generate_alone(live.engine.executor.model, prompt, 24)
    k = next(i for i in range(4, 24) if plain[i] not in plain[:i])
    text = _whole(url, "/v1/completions", {"prompt": prompt, "max_tokens": 24})[0]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    chat = {"messages": [{"role": "user", "content": "ka bemo"}], "max_tokens": 24}
    said = _whole(url, "/v1/chat/completions", chat)[0]
    for path, body, why in (("/v1/completions", {"prompt": prompt, "max_tokens": 24, "n": 2}, None),
                            ("/v1/completions", {"prompt": prompt, "max_tokens": 24, "stop": ["é", stop]}, stop),
                            ("/v1/completions", {"prompt": prompt, "max_tokens": 24, "stop_token_ids": [plain[k]],
                                                 "n": 2}, plain[k]),
                            ("/v1/chat/completions", {**chat, "stop": said[5:8]}, said[5:8]),
                            ("/v1/chat/completions", chat, None)):
        r = httpx.post(url + path, json=body, timeout=TIMEOUT).json()
        assert [c["stop_reason"] for c in r["choices"]] == [why] * body.get("n", 1), (body, r["choices"])
        assert {c["finish_reason"] for c in r["choices"]} == {"length" if why is None else "stop"}
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=TIMEOUT) as s:
            chunks = [e["choices"][0] for e in sse_events(s.iter_lines())[:-1]]
        assert [c["stop_reason"] for c in chunks if c["finish_reason"]] == [why] * body.get("n", 1), body
        assert {c["stop_reason"] for c in chunks if not c["finish_reason"]} == {None}, body
    answer = Answer(app.state.server.tok.detokenizer(), stop_ids=[plain[k]])     # (an eos id is no stop id)
    answer.take(plain[:3], "stop")
    assert (answer.finish, answer.stop_reason) == ("stop", None)


def test_text_that_might_begin_a_stop_string_is_held_back_until_it_is_known_not_to(server):
    """A stop string that never occurs but begins with the 4th token's word: that word is held back
    from the 4th chunk and sent with the 5th; the whole text and each token's chunk are as without it."""
    url, _, _ = server
    body = {"prompt": "ka bemo", "max_tokens": 12}
    texts, _, _ = _token_texts(url, "/v1/completions", body)
    word = texts[3].strip()
    got, usage, finishes = _token_texts(url, "/v1/completions", {**body, "stop": word + "qq"})
    assert "".join(got) == "".join(texts) and usage["completion_tokens"] == 12 and finishes[-1] == "length"
    assert len(got) == 12 and got[3].endswith(" ") and word in got[4]


def _settled(live) -> None:
    deadline = time.time() + 10
    eng = live.engine
    while ((eng.memory.slots_reserved or eng.executor.kv.slots_reserved or not eng.done or live._inbox)
           and time.time() < deadline):
        time.sleep(0.02)
    assert eng.memory.slots_reserved == eng.executor.kv.slots_reserved == 0 and eng.done


def _ended_and_generated(url: str) -> tuple[dict, float]:
    """/metrics' requests ended by finish reason (and "e2e": the end-to-end latencies observed),
    and its tokens generated."""
    fams = parse_prometheus(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
    ended = {lab["finished_reason"]: v for _, lab, v in fams["vllm:request_success_total"][1]}
    ended["e2e"] = next(v for name, _, v in fams["vllm:e2e_request_latency_seconds"][1] if name.endswith("_count"))
    return ended, fams["vllm:generation_tokens_total"][1][0][2]


def _counted_since(url: str, before: tuple[dict, float], n: int) -> tuple[dict, float]:
    """How many requests /metrics counted as ended by each reason since `before`, once it counts
    `n` (at most 10 s), and the tokens."""
    deadline = time.time() + 10
    while True:
        ended, gen = _ended_and_generated(url)
        delta = {k: v - before[0][k] for k, v in ended.items()}
        if sum(delta.values()) >= n or time.time() > deadline:
            return delta, gen - before[1]
        time.sleep(0.02)


def test_a_request_stopped_by_a_stop_string_leaves_the_engine_and_its_figures_add_up(server):
    """Once its answer meets a stop string the request is aborted in the engine (K/V and seat given
    back), long before its max_tokens, on the token that completed it; /metrics counts it once, as
    "stop", with the tokens usage counts, which the step log lists a step each."""
    url, live, _ = server
    _settled(live)
    body = {"prompt": [7, 8, 9], "max_tokens": 400}
    texts, _, _ = _token_texts(url, "/v1/completions", {**body, "max_tokens": 8})
    stop = texts[2]
    before = parse_prometheus(httpx.get(url + "/metrics").text)
    since = httpx.get(url + "/orca/steps").json()["next"]
    text, n, finish, rid = _whole(url, "/v1/completions", {**body, "stop": stop})
    assert (text, n, finish) == _stopped(texts, [stop]) and n <= 3
    _settled(live)
    after = parse_prometheus(httpx.get(url + "/metrics").text)
    req = next(r for r in live.requests if r.req_id == int(rid.rsplit("-", 1)[1]))
    assert req.status is Status.ABORTED and req.n_generated == n

    def delta(name, **labels):
        old, new = (next(v for _, lab, v in fams[name][1] if labels.items() <= lab.items()) for fams in (before, after))
        return new - old

    assert [delta("vllm:request_success_total", finished_reason=k) for k in ("stop", "length", "abort")] == [1, 0, 0]
    assert delta("vllm:generation_tokens_total") == n
    steps = httpx.get(url + "/orca/steps", params={"since": since}).json()["steps"]
    assert sum(any(w[0] == req.req_id for w in s[3]) for s in steps) == req.n_generated


def test_a_stop_string_the_last_token_completes_ends_with_stop_and_min_tokens_defers_stop_strings(server):
    """A stop string the max_tokens-th token completes: finish "stop", not "length". With
    `min_tokens` m, a stop string that ends in the first m tokens' text does not count (as in vLLM);
    one that ends later does, though it begins earlier."""
    url, _, _ = server
    body = {"prompt": "ka bemo", "max_tokens": 24}
    texts, _, _ = _token_texts(url, "/v1/completions", body)
    n = next(k for k in range(24, 0, -1) if _stopped(texts[:k], [texts[k - 1][-2:]])[1] == k)
    want = _stopped(texts[:n], [texts[n - 1][-2:]])
    assert want[2] == "stop"
    assert _whole(url, "/v1/completions", {**body, "max_tokens": n, "stop": texts[n - 1][-2:]})[:3] == want
    for k in (1, 3):
        stop = texts[k - 1] + texts[k][:2]              # ends in token k + 1
        assert _stopped(texts, [stop], k + 1) != _stopped(texts, [stop])     # (its first occurrence ends by then)
        for m in (0, k, k + 1):
            got = _whole(url, "/v1/completions", {**body, "stop": stop, "min_tokens": m})[:3]
            assert got == _stopped(texts, [stop], m), (k, m)


def test_a_stop_string_the_max_tokens_th_token_completes_is_counted_as_stop_in_metrics(server):
    """The answer said "stop" and /metrics counted "length": the engine ended the request at its
    max_tokens, and counted it so, before the HTTP side found the stop string in that token's text
    (its abort then found the request gone). A stop string wins over length on the same token, as
    in vLLM, in the answer and in /metrics, streamed or not."""
    url, live, _ = server
    body = {"prompt": "ka bemo", "max_tokens": 24}
    texts, _, _ = _token_texts(url, "/v1/completions", body)
    n = next(k for k in range(24, 0, -1) if _stopped(texts[:k], [texts[k - 1][-2:]])[1] == k)
    asked = {**body, "max_tokens": n, "stop": texts[n - 1][-2:]}
    _settled(live)
    before = _ended_and_generated(url)
    assert _whole(url, "/v1/completions", asked)[1:3] == (n, "stop")
    _, usage, finishes = _token_texts(url, "/v1/completions", asked)
    assert usage["completion_tokens"] == n and finishes[-1] == "stop"
    ended, generated = _counted_since(url, before, 4)
    assert ended == {"length": 0, "stop": 2, "abort": 0, "e2e": 2} and generated == 2 * n


def held_aborts(live, monkeypatch, more: int) -> None:
    """Each handler's word to the engine is held until the engine has made `more` tokens more for
    its request (or it has left the engine), as a slow event loop would hold it."""
    real = live.abort

    def late(stream, *finish):
        deadline, at = time.time() + 10, stream.req.n_generated
        while (stream.req.n_generated < at + more and stream.req.status in (Status.WAITING, Status.RUNNING)
               and time.time() < deadline):
            time.sleep(0.005)
        real(stream, *finish)

    monkeypatch.setattr(live, "abort", late)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_no_token_is_made_after_the_one_that_completes_a_stop_string(server, monkeypatch, stream):
    """The HTTP side found a stop string in the text and asked the engine to drop the request: the
    engine ran on for it until that word landed (a token or more for nobody, which /orca/steps
    listed). The engine thread finds it now, and ends the request on the token that completed it,
    however slow the handler: its steps are those usage counts, and /metrics counts them alone."""
    url, live, _ = server
    body = {"prompt": [7, 8, 9], "max_tokens": 400}
    texts, _, _ = _token_texts(url, "/v1/completions", {**body, "max_tokens": 8})
    stop = texts[2]
    n_stop = _stopped(texts, [stop])[1]
    held_aborts(live, monkeypatch, 3)
    _settled(live)
    before = _ended_and_generated(url)
    since = httpx.get(url + "/orca/steps").json()["next"]
    if stream:
        _, usage, finishes = _token_texts(url, "/v1/completions", {**body, "stop": stop})
        n, finish = usage["completion_tokens"], finishes[-1]
    else:
        _, n, finish, _ = _whole(url, "/v1/completions", {**body, "stop": stop})
    assert (n, finish) == (n_stop, "stop")
    _settled(live)
    req = live.requests[-1]
    assert req.status is Status.ABORTED and req.n_generated == n
    steps = httpx.get(url + "/orca/steps", params={"since": since}).json()["steps"]
    assert sum(any(w[0] == req.req_id for w in s[3]) for s in steps) == n
    ended, generated = _counted_since(url, before, 2)
    assert ended == {"length": 0, "stop": 1, "abort": 0, "e2e": 1} and generated == n


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tokens_the_engine_made_after_a_stop_string_have_no_inter_token_latency(server, monkeypatch, stream):
    """vllm:inter_token_latency_seconds observed a latency for each token the engine sent a request
    after its first, those after the one that completed a stop string (made before the abort reached
    the engine) included, so its count exceeded the tokens generated less the requests. It observes
    those the answer took; here each handler's word is held until the engine has made three tokens
    more, which it no longer makes."""
    url, live, _ = server
    body = {"prompt": [7, 8, 9], "max_tokens": 400}
    texts, _, _ = _token_texts(url, "/v1/completions", {**body, "max_tokens": 8})
    stop = texts[2]
    n_stop = _stopped(texts, [stop])[1]
    assert n_stop >= 2

    def itl_count() -> float:
        fams = parse_prometheus(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
        return next(v for name, _, v in fams["vllm:inter_token_latency_seconds"][1] if name.endswith("_count"))

    held_aborts(live, monkeypatch, 3)
    _settled(live)
    before, itl_before = _ended_and_generated(url), itl_count()
    if stream:
        _, usage, finishes = _token_texts(url, "/v1/completions", {**body, "stop": stop})
        n, finish = usage["completion_tokens"], finishes[-1]
    else:
        _, n, finish, _ = _whole(url, "/v1/completions", {**body, "stop": stop})
    assert (n, finish) == (n_stop, "stop") and live.requests[-1].n_generated == n
    ended, generated = _counted_since(url, before, 2)
    assert ended["stop"] == 1 and generated == n and itl_count() - itl_before == n - 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_a_stop_string_ended_has_its_end_to_end_latency_observed(server, stream):
    """vllm:e2e_request_latency_seconds observed a request's latency only where the engine ended it
    (its length, an end-of-sequence token): one a stop string ended, which the engine drops as an
    abort, was counted as ended by "stop" but had no latency, so the histogram's count fell short
    of the requests answered and its mean left out every request with `stop`. Its answer's end,
    as the handler has it (where vLLM measures it too), is its latency now."""
    url, live, _ = server
    body = {"prompt": [7, 8, 9], "max_tokens": 8}
    texts, _, _ = _token_texts(url, "/v1/completions", body)
    _settled(live)
    before = _ended_and_generated(url)
    asked = {**body, "max_tokens": 400, "stop": texts[2]}
    if stream:
        assert _token_texts(url, "/v1/completions", asked)[2][-1] == "stop"
    else:
        assert _whole(url, "/v1/completions", asked)[2] == "stop"
    ended, _ = _counted_since(url, before, 2)
    assert ended == {"length": 0, "stop": 1, "abort": 0, "e2e": 1}


def test_a_stream_a_stop_string_ended_is_not_aborted_when_its_client_leaves_during_its_last_chunk(server,
                                                                                                 monkeypatch):
    """A client that leaves while the chunk of its answer's end is sent (the engine thread ended the
    request at a stop string, and counted it) has its request counted once, as "stop": its handler
    asks the engine to drop nothing. The chunk holds the text the engine thread cut, no more."""
    from orca_torch.serve.app import Reply
    from orca_torch.serve.live import Event, Stream

    _, live, app = server
    srv = app.state.server
    dropped = []
    monkeypatch.setattr(live, "abort", dropped.append)
    ids = srv.tok.encode("ka bemo")
    g = srv.parse({"prompt": "ka", "max_tokens": 8, "stop": "bemo", "stream": True}, "completions")

    async def leave_at_the_last_chunk() -> list[dict]:
        answer = srv._answer(g, "completions")
        stream = Stream(None, asyncio.Queue(), asyncio.get_running_loop(), text=answer)
        stream.queue.put_nowait(Event(tuple(ids), "stop", texts=tuple(answer.take(ids))))
        chunks, got = srv.sse([stream], g, Reply("completions", "cmpl-x", 0)), []
        while not got or got[-1]["finish_reason"] is None:
            got.append(json.loads((await chunks.__anext__())[len("data: "):])["choices"][0])
        await chunks.aclose()                           # (the client leaves)
        return got

    got = asyncio.run(leave_at_the_last_chunk())
    assert [(c["text"], c["finish_reason"]) for c in got] == [(" ka", None), (" ", "stop")] and dropped == []


def test_non_streaming_answers_with_usage(server):
    url, live, _ = server
    model = live.engine.executor.model
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5, "seed": 7}, timeout=TIMEOUT)
    assert r.status_code == 200
    out = r.json()
    from orca_torch.serve.tokenizer import PresetTokenizer
    assert PresetTokenizer("tiny").encode(out["choices"][0]["text"]) == generate_alone(model, [1, 2, 3], 5)
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert out["choices"][0]["finish_reason"] == "length"
    models = httpx.get(url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and Path(models["data"][0]["root"], "tokenizer.json").is_file()
    assert httpx.get(url + "/health").status_code == 200


BAD = [
    (b"{not json", 400, None),
    (b"[" * 5000, 400, None),                            # nested past the JSON parser's recursion limit
    (b"\xff\xfe", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "ka", "model": "gpt-4"}, 404, "model"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["ka", "bo"]}, 400, "prompt"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "ka", "max_tokens": 600}, 400, "max_tokens"),
    ({"prompt": "ka", "max_tokens": "10"}, 400, "max_tokens"),
    ({"prompt": "ka", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "ka", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "ka", "n": 0}, 400, "n"),
    ({"prompt": "ka", "temperature": -0.8}, 400, "temperature"),
    ({"prompt": "ka", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "ka", "top_k": -2}, 400, "top_k"),
    ({"prompt": "ka", "seed": -1}, 400, "seed"),
    ({"prompt": "ka", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "ka", "seed": "x"}, 400, "seed"),
    ({"prompt": "ka", "stream": "yes"}, 400, "stream"),
    ({"prompt": "ka", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "ka", "best_fit": 1}, 400, "best_fit"),
    ({"prompt": "ka", "model": 3}, 400, "model"),
    ({"prompt": "ka", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    (b'{"prompt": "\\ud800"}', 400, "prompt"),                        # a lone surrogate is no text
    (b'{"prompt": ["\\udfff x"]}', 400, "prompt"),
    (b'{"prompt": "x", "seed": ' + b"1" * 5000 + b"}", 400, None),       # past Python's 4300 digits of an int
    (b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}", 400, None),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 4300 + b"}", 400, "max_tokens"),  # read, but + 1 is past them
]
BAD_CHAT = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4, "max_tokens": 5}, 400,
     "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 600}, 400, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4, "min_tokens": 5}, 400,
     "min_tokens"),
    ({"prompt": "ka"}, 400, "prompt"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", [("/v1/completions", *b) for b in BAD]
                         + [("/v1/chat/completions", *b) for b in BAD_CHAT],
                         ids=[f"completions-{i}" for i in range(len(BAD))] + [f"chat-{i}" for i in range(len(BAD_CHAT))])
def test_bad_input_gets_an_openai_error_and_the_server_stays_up(server, path, body, status, param):
    url, _, _ = server
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + path, timeout=TIMEOUT, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] in ("invalid_request_error", "NotFoundError")
    assert err["code"] == ("model_not_found" if param == "model" and status == 404 else None)    # a string or null
    assert httpx.get(url + "/health").status_code == 200


HUGE = [[0] * 1000] * 300                                # about 1.2 MB of JSON


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "ka", "user": HUGE}, 400, "user"),
    ({"prompt": "ka", "temperature": HUGE}, 400, "temperature"),
    ({"prompt": "ka", "logit_bias": {"1": HUGE}}, 400, "logit_bias"),
    ({"prompt": "ka", "seed": "x" * 2**20}, 400, "seed"),
    ({"prompt": "ka", "model": "m" * 2**20}, 404, "model"),
    ({"prompt": "ka", "k" * 2**20: 1}, 400, "k" * 60 + "..."),             # (an unknown key's name, cut)
    ({"prompt": "ka", "stream": True, "stream_options": {"k" * 2**20: 1}}, 400, "stream_options"),
    ({"prompt": [10 ** 4000]}, 400, "prompt"),
    ({"prompt": "ka", "top_p": json.loads("[" * 500 + "]" * 500)}, 400, "top_p"),
    ({"prompt": "ka", "max_tokens": 10 ** 4000, "min_tokens": 10 ** 4000}, 400, "max_tokens"),
    ({"prompt": "ka", "max_tokens": 5, "min_tokens": 10 ** 4000}, 400, "min_tokens"),
], ids=range(11))
def test_an_error_quotes_a_bad_value_cut_short(server, body, status, param):
    """The message says which value was wrong in a few hundred characters at most (the list of
    parameters this server takes included), not the megabytes a client sent."""
    url, _, _ = server
    r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
    err = r.json()["error"]
    assert r.status_code == status and err["param"] == param, r.text[:500]
    assert 0 < len(err["message"]) < 500, err["message"][:1000]


def test_an_integer_past_python_s_digit_limit_is_a_400_that_says_so(server):
    url, _, _ = server
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}",
                   headers={"content-type": "application/json"}, timeout=TIMEOUT)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["code"] is None
    assert f"an integer too long to read (Exceeds the limit ({sys.get_int_max_str_digits()} digits)" in err["message"], \
        err["message"]


@pytest.mark.parametrize("path,body,param,says", [
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages", "messages[0].content is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"content": "ka"}]}, "messages",
     "messages[1].role is required"),
    ("/v1/completions", {"prompt": "ka", "stream": True, "stream_options": {"foo": 1}}, "stream_options",
     "unsupported key 'foo' in stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "ka", "tool_calls": []}]}, "messages",
     "unsupported key 'tool_calls' in messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "ka", "x": 1}]}]},
     "messages", "unsupported key 'x' in messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ka", "name": 5}]}, "messages",
     "messages[0].name: Input should be a valid string, got 5"),           # (role and content are right)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages",
     "messages[0].content[0].text: Input should be a valid string, got 5"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     "messages[0].content[0].text is required"),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "ka"}]}, "messages",
     "messages[0].role: Input should be 'system', 'user', 'assistant' or 'developer', got \"bot\""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ka"},
                                           {"role": "tool", "content": "bo", "tool_call_id": "call_1"}]},
     "messages", 'messages[1]: role "tool" is not supported: this server does no tool calling'),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "bo"}]}, "messages",
     'messages[0]: role "tool" is not supported'),
    ("/v1/completions", {"prompt": "ka", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options", "stream_options.include_usage: Input should be a valid boolean, got \"yes\""),
    ("/v1/completions", {"prompt": [[1, "x"]]}, "prompt", "prompt[0][1]: Input should be a valid integer, got \"x\""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages",    # null: no branch fits
     "content a string or a non-empty list of text parts"),
    ("/v1/completions", {"prompt": [1] * 600, "max_tokens": 1}, "prompt", "maximum context length is 512 tokens"),
    ("/v1/completions", {"prompt": [1] * 10, "max_tokens": 505}, "max_tokens", "maximum context length is 512"),
    ("/v1/completions", {"prompt": "ka", "min_tokens": 20}, "min_tokens",           # (no max_tokens given)
     "min_tokens (20) must be <= the 16 tokens the request may generate without max_tokens (the default)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ka"}], "min_tokens": 5000}, "min_tokens",
     "tokens the request may generate without max_tokens (the rest of the server's tokens per request)"),
    ("/v1/completions", {"prompt": "ka", "max_tokens": 5, "min_tokens": 20}, "min_tokens",
     "min_tokens (20) must be <= max_tokens (5)"),
])
def test_an_error_names_the_field_a_client_wrote(server, path, body, param, says):
    url, _, _ = server
    r = httpx.post(url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and says in r.json()["error"]["message"]


KV, BUDGET = "--kv-slots", "--max-num-batched-tokens without --chunked-prefill"
RECOMPUTE = BUDGET + " (a preempted request is recomputed, its prompt and the tokens it has so far, in one step)"


@pytest.mark.parametrize("settings, tokens, prompt, tokens_by, prompt_by", [
    (dict(kv_slots=10), 10, 9, KV, KV),
    (dict(memory="paged", kv_slots=400, block_size=4), 99 * 4 + 1, 99 * 4, KV + ", --block-size",   # 1 watermark;
     KV + ", --block-size"),                                        # (the last token's K/V is never stored)
    (dict(memory="paged", kv_slots=100, block_size=16), 6 * 16 + 1, 6 * 16, KV + ", --block-size",  # whole blocks
     KV + ", --block-size"),
    (dict(max_num_batched_tokens=16), 512, 16, "the model's context", BUDGET),   # a prompt in one step
    (dict(memory="paged", max_num_batched_tokens=16), 17, 16, RECOMPUTE, BUDGET),   # (all but one token)
    (dict(kv_slots=15, max_num_batched_tokens=100), 15, 14, KV, KV),             # (the budget does not bind)
])
def test_a_request_past_the_server_s_limits_is_refused_in_its_terms(settings, tokens, prompt, tokens_by, prompt_by):
    """One rule, the engine's own `check`: the longest request and prompt it takes are served, one
    token more is refused naming what set the limit; chat's default max_tokens stays within."""
    from orca_torch.serve.bodies import Limits
    with serving(ServeConfig(model="tiny", port=0, **settings)) as (url, live, _):
        lim = Limits.of(live.engine)
        assert (lim.tokens, lim.prompt, lim.tokens_set_by, lim.prompt_set_by) == (tokens, prompt, tokens_by,
                                                                                   prompt_by)
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
            r = c.post("/v1/completions", json={"prompt": [1], "max_tokens": tokens})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            assert r.json()["error"]["message"] == (         # (the model's context is said as such)
                f"this model's maximum context length is 512 tokens; the request asks for 513 (1 in the prompt, "
                f"512 to generate)" if tokens == 512 else
                f"the request needs {tokens + 1} tokens (1 in the prompt, {tokens} to generate), more than the "
                f"{tokens} this server takes in one request (set by {tokens_by})")
            r = c.post("/v1/completions", json={"prompt": [1] * (prompt + 1), "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            if prompt < tokens - 1:
                assert r.json()["error"]["message"] == (f"the prompt has {prompt + 1} tokens, more than the {prompt} "
                                                        f"this server takes in one request (set by {prompt_by})")
            if tokens <= 100:                   # (the tiny model's pace on a CPU: a short answer)
                r = c.post("/v1/completions", json={"prompt": [1] * prompt, "max_tokens": tokens - prompt})
                assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == tokens
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ka"}]})
            assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == tokens


@pytest.mark.parametrize("settings", [
    dict(kv_slots=40, max_bs=4), dict(memory="paged", kv_slots=50, block_size=7, max_bs=2),
    dict(max_num_batched_tokens=30, max_bs=4, kv_slots=200),
    dict(memory="paged", kv_slots=64, block_size=8, max_num_batched_tokens=20, max_bs=4),
    dict(memory="paged", kv_slots=64, block_size=8, max_num_batched_tokens=20, max_bs=4, chunked_prefill=True)])
def test_every_body_the_server_takes_the_engine_takes(settings):
    """The body check (`BodyParser.parse`, against `Limits`) is the server's door: what it takes,
    the engine's own `check` takes too, each of n choices, and the n fit the memory together, so
    app.py's `live.check` (whose refusal speaks the engine's terms) refuses nothing a client sends.
    Bodies of many lengths and choices, of both endpoints."""
    import random

    from orca_torch.serve.app import OpenAIServer
    from orca_torch.serve.bodies import APIError
    from orca_torch.serve.server import build

    live, tok = build(ServeConfig(model="tiny", **settings))
    srv, rng, taken = OpenAIServer(live, tok, "tiny"), random.Random(0), 0
    try:
        for _ in range(400):
            p, n = rng.randint(1, 40), rng.randint(1, 4)
            body = {"max_tokens": rng.choice([None, rng.randint(1, 40)]), "n": n, "min_tokens": rng.choice([0, 1])}
            kind = rng.choice(["completions", "chat"])
            if kind == "completions":
                body["prompt"] = [1] * p
            else:
                body["messages"] = [{"role": "user", "content": " ".join(["ka"] * p)}]
            try:
                g = srv.parse(body, kind)
            except APIError:
                continue
            reqs = [live.new_request(g.prompt_ids, g.max_tokens, g.ignore_eos, g.min_tokens, g.choice_sampling(i),
                                     g.stop_token_ids) for i in range(g.n)]
            for req in reqs:
                live.check(req)
            assert live.engine.memory.fits_together(reqs), body
            taken += 1
    finally:
        live.stop()
    assert taken >= 40, taken


def test_each_answer_is_stamped_when_it_was_created(server, monkeypatch):
    url, _, _ = server
    from orca_torch.serve import app as app_module
    monkeypatch.setattr(app_module.time, "time", lambda: 2_000_000_000.5)     # (the app's clock, not the engine's)
    whole = httpx.post(url + "/v1/completions", json={"prompt": "ka", "max_tokens": 2}, timeout=TIMEOUT).json()
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=TIMEOUT,
                      json={"messages": [{"role": "user", "content": "ka"}], "max_tokens": 2, "stream": True}) as r:
        chunks = [e for e in sse_events(list(r.iter_lines())) if e != "[DONE]"]
    assert whole["created"] == 2_000_000_000 and {c["created"] for c in chunks} == {2_000_000_000}
    assert httpx.get(url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["created"] < 2_000_000_000


def test_a_body_over_the_limit_is_refused_with_413_however_it_is_sent(server):
    url, live, _ = server
    from orca_torch.serve.limits import MAX_BODY_BYTES
    big = b'{"prompt": "ka", "user": "' + b"x" * MAX_BODY_BYTES + b'"}'

    def chunked():
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + 1 << 16]

    before = len(live.requests)
    for content in (big, chunked()):                     # with a Content-Length, then without one
        r = httpx.post(url + "/v1/completions", content=content, timeout=TIMEOUT,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200
    assert len(live.requests) == before


def test_tokenizing_a_prompt_does_not_hold_up_the_event_loop(server):
    """The body is parsed and tokenized off the event loop: /health answers while a prompt is
    still being tokenized."""
    url, _, app = server
    tok = app.state.server.tok
    entered, release = threading.Event(), threading.Event()
    real = tok.encode

    def slow(text):
        entered.set()
        assert release.wait(TIMEOUT)
        return real(text)

    tok.encode = slow
    try:
        with httpx.Client(timeout=TIMEOUT) as c:
            box = {}
            t = threading.Thread(target=lambda: box.update(r=c.post(url + "/v1/completions",
                                                                    json={"prompt": "ka", "max_tokens": 2})))
            t.start()
            assert entered.wait(TIMEOUT)
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            release.set()
            t.join(TIMEOUT)
        assert box["r"].status_code == 200 and box["r"].json()["usage"]["completion_tokens"] == 2
    finally:
        release.set()
        del tok.encode


def test_a_preset_prompt_sure_to_be_too_long_is_refused_before_it_is_tokenized(server):
    url, _, app = server
    srv = app.state.server
    called = []
    srv.tok.encode = lambda text: called.append(text) or []
    try:
        for path, body, n in (("/v1/completions", {"prompt": "ka " * 600_000}, 600_000),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ka " * 600_000}]},
                               600_000),
                              ("/v1/completions", {"prompt": "ka\u3000" * 300_000}, 300_000),   # spaces outside
                              ("/v1/completions", {"prompt": "ka\xa0" * 300_000}, 300_000),     # ASCII split too
                              ("/v1/completions", {"prompt": "日本 " * 300_000}, 300_000)):     # words outside ASCII
            r = httpx.post(url + path, json=body, timeout=TIMEOUT)
            err = r.json()["error"]
            assert r.status_code == 400 and f"the prompt has at least {n} tokens, more than the" in err["message"]
    finally:
        del srv.tok.encode
    assert called == []                                 # refused without tokenizing
    r = httpx.post(url + "/v1/completions", json={"prompt": "ka " * 400, "max_tokens": 1}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 400
    spaces = "\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(map(chr, range(0x2000, 0x200b)))
    for text, n_words in (("ka" + "".join(c + "bo" for c in spaces), 1 + len(spaces)),
                          ("\u3000ka\xa0\xa0日\x1cé\u200bx\ufeff ", 2),      # (U+001C, U+200B, U+FEFF: no spaces)
                          (" ka<unk>bo", 1)):                                  # ("<unk>" splits the word: 3 tokens)
        assert srv.tok.min_tokens(text) == n_words <= len(srv.tok.encode(text)), text


def test_a_preset_tokenizer_s_bound_is_its_token_count():
    from hypothesis import given, settings, strategies as st

    from orca_torch.serve.tokenizer import PresetTokenizer
    tok = PresetTokenizer("tiny")
    words = [w for w in tok.words[:50] if not w.startswith("<")]     # (a special token is matched inside a word)
    pieces = st.sampled_from(words + ["<unk>", "", " ", "  ", "\t", "\n", "\r\n", "\x0b", "\x0c", "\u00a0", "\u3000",
                                                "\x1c", ",", "é", "zzz"])

    @settings(max_examples=300, deadline=None)
    @given(st.lists(pieces, max_size=30))
    def check(parts):
        text = "".join(parts)
        assert tok.min_tokens(text) <= len(tok.encode(text))
        if "<unk>" not in text and set(text) <= set("".join(words) + " \t\n\r\x0b\x0c"):
            assert tok.min_tokens(text) == len(tok.encode(text))    # visible ASCII and its whitespace: exact
    check()


def test_the_step_log_comes_in_pages_and_its_reader_holds_up_nothing(server):
    url, live, _ = server
    r = httpx.post(url + "/v1/completions", json={"prompt": "ka", "max_tokens": 6}, timeout=TIMEOUT)
    assert r.status_code == 200
    first = live.steps[0].index
    page = httpx.get(url + "/orca/steps", params={"since": first, "limit": 2}).json()
    assert [s[0] for s in page["steps"]] == [first, first + 1] and page["next"] == first + 2
    assert page["prompt_ends"] == [list(s.prompt_ends) for s in list(live.steps)[:2]]
    rest = httpx.get(url + "/orca/steps", params={"since": page["next"]}).json()
    assert [s[0] for s in rest["steps"]] == [s.index for s in live.steps][2:]
    assert len(rest["prompt_ends"]) == len(rest["steps"])
    end = httpx.get(url + "/orca/steps", params={"since": rest["next"]}).json()
    assert end == {"steps": [], "next": rest["next"], "prompt_ends": []}
    for bad in ({"limit": 0}, {"limit": 10_001}, {"since": -1}, {"since": "x"}):
        r = httpx.get(url + "/orca/steps", params=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] in bad, bad


@pytest.mark.parametrize("query, param", [("sinse=5", "sinse"), ("since=0&limit=2&page=3", "page"),
                                          ("since=5&since=6", "since"), ("limit=1&limit=2", "limit")])
def test_the_step_log_refuses_a_query_parameter_it_does_not_take(server, query, param):
    """A misspelt or repeated parameter is refused, naming it and what the route takes, not read as
    the default (all 10,000 steps from index 0) or as one of its values."""
    url, _, _ = server
    r = httpx.get(f"{url}/orca/steps?{query}", timeout=TIMEOUT)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, r.text
    assert repr(param) in err["message"] and "since and limit, each at most once" in err["message"]


def test_openai_s_other_routes_ids_and_a_body_that_is_not_json(server):
    url, _, _ = server
    one = httpx.get(url + "/v1/models/tiny").json()
    assert one["id"] == "tiny" and one["object"] == "model"
    r = httpx.get(url + "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for path in ("/health", "/v1/models", "/v1/models/tiny", "/metrics", "/orca/steps"):     # (every GET route)
        r = httpx.head(url + path)
        assert r.status_code == 200 and r.content == b"" and int(r.headers["content-length"]) > 0, path
    r = httpx.post(url + "/v1/completions", json={"prompt": "ka", "max_tokens": 1}, timeout=TIMEOUT)
    assert re.fullmatch(r"cmpl-[0-9a-f]{8}-\d+", r.json()["id"])     # a tag drawn at start: no repeats across restarts
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "ka", "name": "Ann"}],
                                                       "max_tokens": 1}, timeout=TIMEOUT)
    assert r.status_code == 200                         # a message's name: OpenAI's, accepted
    for media in ("text/plain", "application/x-www-form-urlencoded"):
        r = httpx.post(url + "/v1/completions", content=json.dumps({"prompt": "ka"}), headers={"content-type": media})
        assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"], media
    r = httpx.post(url + "/v1/completions", content=json.dumps({"prompt": "ka", "max_tokens": 1}),
                   headers={"content-type": "application/json; charset=utf-8"}, timeout=TIMEOUT)
    assert r.status_code == 200

def test_a_refused_parameter_says_what_is_allowed(server):
    url, _, _ = server
    for name, value, allowed in (("suffix", "x", '""'), ("best_of", 2, "1")):
        r = httpx.post(url + "/v1/completions", json={"prompt": "ka", name: value}, timeout=TIMEOUT)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == name
        assert f"set {allowed}" in err["message"], err["message"]


def test_parameters_that_keep_label_or_route_an_answer_are_taken_and_change_nothing(server):
    """What SDKs send with values that change nothing here (`store: false`, `service_tier: "auto"`,
    `metadata`, `parallel_tool_calls` with no tools, ...) was refused as unknown; each is taken now,
    and the answer is the one the bare request gets."""
    url, _, _ = server
    bare = {"messages": [{"role": "user", "content": "ka bemo"}], "max_completion_tokens": 4}
    want = httpx.post(url + "/v1/chat/completions", json=bare, timeout=TIMEOUT).json()["choices"][0]["message"]
    for extra in ({"store": False, "service_tier": "auto", "metadata": {"team": "a", "run": "7"},
                   "parallel_tool_calls": True, "user": "ann", "safety_identifier": "u-1", "prompt_cache_key": "k",
                   "modalities": ["text"]},
                  {"store": None, "service_tier": "default", "metadata": {}, "parallel_tool_calls": False,
                   "tools": [], "tool_choice": "none"},
                  {"service_tier": None, "metadata": None, "parallel_tool_calls": None}):
        r = httpx.post(url + "/v1/chat/completions", json={**bare, **extra}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == want
    r = httpx.post(url + "/v1/completions", json={"prompt": "ka", "max_tokens": 1, "user": "ann"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    opts = {"include_usage": True, "include_obfuscation": False}      # (the SDK's way to ask for no padding)
    with httpx.stream("POST", url + "/v1/chat/completions", json={**bare, "stream": True, "stream_options": opts},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2]) == want["content"]
    assert events[-2]["usage"]["completion_tokens"] == 4 and events[-1] == "[DONE]"


@pytest.mark.parametrize("path, other, names", [
    ("/v1/chat/completions", "/v1/completions", ("suffix", "best_of", "echo")),
    ("/v1/completions", "/v1/chat/completions",
     ("max_completion_tokens", "tools", "tool_choice", "response_format", "top_logprobs", "store", "service_tier",
      "modalities", "metadata", "parallel_tool_calls", "safety_identifier", "prompt_cache_key")),
], ids=["chat", "completions"])
def test_each_endpoint_takes_only_its_own_parameters(server, path, other, names):
    """The other endpoint's own parameters are refused, even at their no-op value, as unsupported
    here, the message naming the endpoint they belong to; neither is listed among those this one takes."""
    url, _, _ = server
    body = {"prompt": "ka"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "ka"}]}
    no_op = {"suffix": "", "best_of": 1, "echo": False, "max_completion_tokens": 1, "tools": [],
             "tool_choice": "none", "response_format": {"type": "text"}, "top_logprobs": 0, "store": False,
             "service_tier": "auto", "modalities": ["text"], "metadata": {}, "parallel_tool_calls": False,
             "safety_identifier": "u1", "prompt_cache_key": "k1"}
    for name in names:
        r = httpx.post(url + path, json={**body, "max_tokens": 1, name: no_op[name]}, timeout=TIMEOUT)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == name, r.text
        head, takes = err["message"].split("; this endpoint takes ")
        assert head == f"unsupported parameter {name!r} for {path} (a parameter of {other} only)"
        assert not set(takes.split(", ")) & set(names) and "stream" in takes.split(", "), takes
    r = httpx.post(url + other, json={**({"prompt": "ka"} if other == "/v1/completions" else
                                        {"messages": [{"role": "user", "content": "ka"}]}),
                                     **{n: no_op[n] for n in names}, "max_tokens": 1},
                   timeout=TIMEOUT)
    assert r.status_code == 200, r.text                  # where they belong, their no-op values are taken


def test_a_body_that_is_json_but_no_object_is_named_as_json_names_it(server):
    """An empty body (a POST with none) was "not valid JSON: Expecting value: line 1 column 1
    (char 0)"; it is said to be empty now."""
    url, _, _ = server
    for raw in (b"", b" \r\n"):
        r = httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"] == "the body is empty: it must be a JSON object"
    for raw, kind in ((b"null", "null"), (b"[1, 2]", "an array"), (b'"ka"', "a string"), (b"7", "a number"),
                      (b"true", "a boolean")):
        r = httpx.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"] == f"the body must be a JSON object, got {kind}"


@pytest.mark.parametrize("path, raw, key", [
    ("/v1/completions", b'{"prompt": "ka", "max_tokens": 2, "max_tokens": 500}', "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "ka", "content": "bo"}]}', "content")])
def test_a_key_given_twice_in_the_body_is_refused(server, path, raw, key):
    """JSON leaves an object with a key given twice to the reader; here one value is not silently
    dropped for the other: the body is refused, naming the key."""
    url, _, _ = server
    r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f"the body is not valid JSON here: the key {key!r} is given twice in one object"


def test_unknown_route_or_method_gets_an_error_object_that_says_what_is_served(server):
    url, _, _ = server
    r = httpx.post(url + "/v1/chat/completion", json={"messages": []})       # a typo's route
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and message.startswith('no route POST "/v1/chat/completion"; ')
    assert "POST /v1/chat/completions" in message and "GET /v1/models/{model_id}" in message
    for method, path, allow in (("GET", "/v1/completions", "POST"), ("POST", "/v1/models", "GET, HEAD"),
                                ("DELETE", "/health", "GET, HEAD")):
        r = httpx.request(method, url + path)
        assert r.status_code == 405 and r.headers["allow"] == allow, (method, path)     # HTTP requires Allow
        assert r.json()["error"]["message"] == f'{method} "{path}" is not allowed; that route takes {allow}'


def test_a_path_with_a_trailing_slash_is_served_as_the_path_without_it(server):
    """No redirect (httpx, as most clients, does not follow a 307 for a POST): the route is served;
    a path that is no route with the slash or without is a 404 naming the path as asked."""
    url, _, _ = server
    r = httpx.post(url + "/v1/completions/", json={"prompt": [1, 2], "max_tokens": 2}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                                          "total_tokens": 4}, r.text
    r = httpx.post(url + "/v1/chat/completions/", json={"messages": [{"role": "user", "content": "ka"}],
                                                        "max_tokens": 1}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    assert httpx.get(url + "/v1/models/").json() == httpx.get(url + "/v1/models").json()
    assert httpx.get(url + "/v1/models/tiny/").json()["id"] == "tiny"
    assert httpx.get(url + "/health/").status_code == 200
    r = httpx.post(url + "/v1/completion/", json={"prompt": "ka"})
    assert r.status_code == 404 and r.json()["error"]["message"].startswith('no route POST "/v1/completion/"; ')
    assert "POST /v1/completions" in r.json()["error"]["message"]
    r = httpx.get(url + "/v1/completions/")
    assert r.status_code == 405 and r.json()["error"]["message"] == \
        'GET "/v1/completions/" is not allowed; that route takes POST'


N_LEAVERS = 12


def test_disconnects_give_memory_and_kv_back(server):
    """Many clients leave mid-stream at once: each request is aborted, the others run to their end,
    and the memory manager and the K/V manager are back at zero."""
    url, live, _ = server
    eng = live.engine

    async def go():
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            async def leaver():
                async with c.stream("POST", url + "/v1/completions",
                                    json={"prompt": [5, 6, 7], "max_tokens": 400, "stream": True}) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if n == 3:
                            return n                    # leaves mid-stream: the connection closes
            others = [stream_one(c, url + "/v1/completions", {"prompt": [9] * k, "max_tokens": 30, "stream": True},
                                 0.0) for k in (1, 2, 3)]
            return await asyncio.gather(*[leaver() for _ in range(N_LEAVERS)], *others)

    before = {r.req_id for r in live.requests}
    got = asyncio.run(asyncio.wait_for(go(), TIMEOUT))
    assert got[:N_LEAVERS] == [3] * N_LEAVERS
    assert all(ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] == "length" for ev in got[N_LEAVERS:])
    deadline = time.time() + 10
    while (eng.memory.slots_reserved or eng.executor.kv.slots_reserved or not eng.done) and time.time() < deadline:
        time.sleep(0.02)
    assert eng.memory.slots_reserved == eng.memory.slots_used == 0
    assert eng.executor.kv.slots_reserved == 0
    left = [r for r in live.requests if r.req_id not in before and r.output_len == 400]
    assert len(left) == N_LEAVERS and all(r.status is Status.ABORTED and r.n_generated < 400 for r in left)


def test_a_client_gone_before_its_body_is_read_is_no_server_error(server):
    """A client that sends half its body and closes: nothing to answer and no traceback in the log;
    the server answers the next request."""
    url, _, _ = server
    port = int(url.rsplit(":", 1)[1])
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log = logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\"")
        time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=TIMEOUT)
        assert r.status_code == 200
    finally:
        log.removeHandler(handler)
    assert not records, [rec.getMessage() for rec in records]


def test_an_idle_server_keeps_no_per_request_history(server):
    """Once nothing is queued or running, the engine drops its records of the requests that left
    (`Engine.forget_done`): its requests, token columns and step log do not grow with every request
    a server ever took."""
    url, live, _ = server
    r = httpx.post(url + "/v1/completions", json={"prompt": [4, 2], "max_tokens": 3}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    eng, deadline = live.engine, time.time() + 10
    while eng.requests and time.time() < deadline:
        time.sleep(0.02)
    assert eng.requests == [] and eng.scheduler.release_step == [] and eng.done
    assert live.requests[-1].n_generated == 3 and live.requests[-1].status is Status.FINISHED
    assert live.requests.maxlen == 1_000            # the server's own record of requests is bounded too


def test_eos_stops_a_request_unless_ignore_eos():
    """A model with an end-of-sequence token: the stream stops at it (finish "stop", memory freed at
    once) unless `ignore_eos`; with `min_tokens` k it is never picked among the first k tokens (its
    logit masked), though it is the model's greedy first token here."""
    from orca_torch.serve.live import LiveEngine
    from orca_torch.serve.metrics import Metrics
    from orca_torch.serve.server import build

    live, _ = build(ServeConfig(model="tiny"))
    live.stop()                                         # (only its engine is reused)
    model = live.engine.executor.model
    prompt = [3, 1, 4, 1, 5]
    ref = generate_alone(model, prompt, 12)
    eos, k = ref[0], 4
    live = LiveEngine(live.engine, Metrics("tiny"), stop_token_ids=[eos])

    async def run(ignore_eos, min_tokens=0):
        req = live.new_request(prompt, 12, ignore_eos, min_tokens)
        live.check(req)
        s = live.submit(req)
        ids, finish = [], None
        while finish is None:
            ev = await asyncio.wait_for(s.queue.get(), TIMEOUT)
            ids += ev.ids
            finish = ev.finish_reason
        return ids, finish, req

    try:
        ids, finish, req = asyncio.run(run(False))
        assert ids == [eos] and finish == "stop" and req.status is Status.ABORTED
        ids, finish, _ = asyncio.run(run(True))
        assert ids == ref and finish == "length"
        ids, finish, _ = asyncio.run(run(False, min_tokens=k))
        assert eos not in ids[:k] and finish == ("stop" if ids[-1] == eos else "length")
        assert len(ids) == (ids.index(eos) + 1 if eos in ids else 12)     # (from the k + 1st on, eos ends it)
        assert live.engine.memory.slots_reserved == 0 and live.engine.executor.kv.slots_reserved == 0
    finally:
        live.stop()


def test_a_server_goes_on_past_the_token_columns_step_limit():
    """A server never idle runs one live run for ever, past `MAX_STEPS` (2**32) steps, the most a
    token column (uint32) numbers: the engine counts its steps anew as it drops its records
    (`Engine.forget_done`), and the step log's indices count on. Here the server starts 4 steps
    short of the limit: a and b join at one iteration, b ends after 2 steps (the records go), a
    and then c go on past the limit and make the tokens they make alone."""
    from orca_torch.core.token_steps import MAX_STEPS
    from orca_torch.serve.live import LiveEngine
    from orca_torch.serve.metrics import Metrics
    from orca_torch.serve.server import build

    live, _ = build(ServeConfig(model="tiny"))
    live.stop()                                         # (only its engine is reused)
    model = live.engine.executor.model
    live = LiveEngine(live.engine, Metrics("tiny"))
    eng = live.engine
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1], [8, 2, 8]]
    n_out = [10, 2, 6]

    async def collect(s):
        ids, ev = [], None
        while ev is None or ev.finish_reason is None:
            ev = await asyncio.wait_for(s.queue.get(), TIMEOUT)
            assert ev.error is None, ev.error
            ids += ev.ids
        return ids

    async def run():
        reqs = [live.new_request(p, n) for p, n in zip(prompts, n_out)]
        with live._cond:                                # (the engine thread is idle: it takes both at once)
            eng.scheduler.n_batches = MAX_STEPS - 4
            a, b = live.submit(reqs[0]), live.submit(reqs[1])
        got_b = await collect(b)
        c = live.submit(reqs[2])
        return await collect(a), got_b, await collect(c)

    try:
        assert list(asyncio.run(run())) == [generate_alone(model, p, n) for p, n in zip(prompts, n_out)]
        deadline = time.time() + 10
        while eng.requests and time.time() < deadline:
            time.sleep(0.02)
        indices = [s.index for s in live.steps]
        assert indices == list(range(len(indices))) and len(indices) >= 10    # a's 10 tokens at least
        assert eng.requests == [] and eng.scheduler.n_batches == 0
        assert eng.n_steps_forgotten == MAX_STEPS - 4 + len(indices)            # every step, counted once
    finally:
        live.stop()


@pytest.mark.parametrize("then", ["exits", "hangs"])
def test_waiting_for_a_line_that_never_comes_fails_instead_of_hanging(then):
    """What the tests that start a server wait behind: a process that never says the line fails the
    wait, whether it exits or hangs (here for 600 s, against a guard of 2 s made short to see it)."""
    code = "print('starting', flush=True)" + ("; import time; time.sleep(600)" if then == "hangs" else "")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = Lines(proc.stdout, wait_s=2 if then == "hangs" else 300)
        says = "no line with 'serving' within 2 s" if then == "hangs" else "the output ended with no line with 'serving'"
        with pytest.raises(pytest.fail.Exception, match=says):
            lines.first_with("serving")
        assert then == "hangs" or lines.seen == ["starting\n"]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("sig,grace,twice,finish", [(signal.SIGTERM, "0", False, "error"),
                                                   (signal.SIGINT, "30", False, "length"),
                                                   (signal.SIGTERM, "30", True, "error")],
                         ids=["SIGTERM-no-grace", "SIGINT-grace", "SIGTERM-twice"])
def test_shutdown_ends_streams_cleanly_and_exits_0(sig, grace, twice, finish):
    """A signal: no new requests (503, and `/health` 503, while the streams drain); streams run on
    for the grace (here: to their end, "length") or end with an error event, as they do at once on
    a second signal; the process exits 0 and leaves nothing listening. Port 0: the banner names the
    port the system chose, and the tokenizer the server serves with."""
    from orca_torch.serve.tokenizer import PRESETS_DIR

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "orca_torch.serve", "--model", "tiny", "--port", "0",
                             "--threads", "1", "--shutdown-grace", grace], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = Lines(proc.stdout)
        banner = lines.first_with("serving")                            # (printed once the socket is bound)
        port = int(re.search(r"http://127\.0\.0\.1:(\d+) ", banner).group(1))
        assert port != 0 and banner.rstrip().endswith(f"(tokenizer {PRESETS_DIR / 'tiny'})")
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
        events, refused = [], []
        with httpx.stream("POST", url + "/v1/completions", timeout=TIMEOUT,
                          json={"prompt": [1, 2], "max_tokens": 500, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 2:
                        proc.send_signal(sig)
                        if grace != "0":        # draining: the socket is open, and says no
                            refused = [httpx.get(url + "/health", timeout=TIMEOUT),
                                       httpx.post(url + "/v1/completions", timeout=TIMEOUT,
                                                  json={"prompt": [1], "max_tokens": 2})]
                        if twice:
                            proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0, lines.text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for resp in refused:
        assert resp.status_code == 503 and "shutting down" in resp.json()["error"]["message"]
    assert len(refused) == (0 if grace == "0" else 2)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "still listening after exit"
    parsed = sse_events(events)
    assert parsed[-1] == "[DONE]"
    if finish == "length":
        assert parsed[-3]["choices"][0]["finish_reason"] == "length"
        assert parsed[-2]["usage"]["completion_tokens"] == 500 == sum(1 for e in parsed[:-2] if e["choices"][0]["text"])
    else:                                       # cut short: an error event, no usage that reads as complete
        n = sum(1 for e in parsed[:-2] if e["choices"][0]["text"])
        assert 2 <= n < 500 and parsed[-2]["error"]["type"] == "service_unavailable"
        assert f"(after {n} of at most 500 tokens)" in parsed[-2]["error"]["message"]


@pytest.mark.parametrize("path,stream,n", [("/v1/completions", False, 1), ("/v1/chat/completions", False, 1),
                                           ("/v1/completions", True, 1), ("/v1/chat/completions", True, 1),
                                           ("/v1/completions", False, 3), ("/v1/chat/completions", True, 3)],
                         ids=["completion", "chat", "completion-stream", "chat-stream", "completion-n3",
                              "chat-stream-n3"])
def test_an_answer_a_shutdown_cuts_short_is_an_error_not_a_200_that_reads_complete(path, stream, n, monkeypatch):
    """The engine's steps wait, once the request runs, until the shutdown (grace 0) has been
    asked, so the request is surely cut short: a whole answer gets a 503 error object, a stream
    (its 200 sent) an error event and `[DONE]`, each of which OpenAI's SDK raises on; none ends
    with a `finish_reason` a client must know to check. The request is counted as aborted and its
    memory is freed; with `n` choices each is, and the error comes once."""
    with serving(ServeConfig(model="tiny", port=0)) as (url, live, _):
        eng = live.engine
        running, asked = threading.Event(), threading.Event()
        step = eng.step
        monkeypatch.setattr(eng, "step", lambda: (running.set(), asked.wait(TIMEOUT), step())[2])
        body = {"prompt": [3, 4], "messages": [{"role": "user", "content": "ka"}], "max_tokens": 400,
                "stream": stream, "n": n}
        body.pop("messages" if "chat" not in path else "prompt")
        got: list = []

        def client():
            with httpx.stream("POST", url + path, json=body, timeout=TIMEOUT) as r:
                got.append((r.status_code, [line for line in r.iter_lines() if line]))

        thread = threading.Thread(target=client)
        thread.start()
        assert running.wait(TIMEOUT)
        live.shutdown(0.0)
        asked.set()
        thread.join(TIMEOUT)
        assert live.drained(TIMEOUT)
        (status, lines), = got
        if stream:
            assert status == 200 and lines[-1] == "data: [DONE]"
            last = json.loads(lines[-2][len("data: "):])
            assert all('"finish_reason": "abort"' not in line for line in lines)
            assert sum('"error"' in line for line in lines) == 1 and lines.count("data: [DONE]") == 1
        else:
            assert status == 503
            last = json.loads(lines[0])
        error = last["error"]
        assert error["type"] == "service_unavailable" and error["code"] is None
        assert re.fullmatch(r"the server shut down before the answer was complete \(after \d+ of at most 400 "
                            r"tokens\); send the request again", error["message"]), error["message"]
        assert live.metrics.finished["abort"] == n
        assert eng.memory.slots_reserved == 0 and eng.executor.kv.slots_reserved == 0


def test_shutdown_waits_for_connections_a_bounded_time():
    from orca_torch.serve.server import LAST_CHUNKS_S

    cfg = ServeConfig(model="tiny", port=0, shutdown_grace_s=2.5)
    srv, live = make_server(cfg)
    live.stop()
    assert srv.config.timeout_graceful_shutdown == LAST_CHUNKS_S == 5



@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_model_loads_stops_start_up_quietly_and_exits_0(sig):
    """Ctrl-C before the banner (a checkpoint loading) ended the process with a KeyboardInterrupt
    traceback (SIGINT, rc -2) or killed it (SIGTERM, rc -15). As after the banner, where a signal
    drains and the process exits 0, it now stops start-up with one line and exits 0. The load is
    held here until the signal comes: `build` says it has begun, then reads stdin, which the test
    never writes."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    hold = ("import runpy, sys, orca_torch.serve.server as s; build = s.build; "
            "s.build = lambda cfg: (print('loading', flush=True), sys.stdin.readline(), build(cfg))[2]; "
            "runpy.run_module('orca_torch.serve', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", hold, "--model", "tiny", "--port", "0", "--threads", "1"],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = Lines(proc.stdout)
        lines.first_with("loading")
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
        assert lines.text() == f"loading\norca-torch: {sig.name} while starting, before serving: stopped\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_third_signal_stops_at_once(sig):
    """A connection that never finishes its request would hold the exit up for uvicorn's last
    5 s; a third signal, SIGTERM as SIGINT, stops the server without waiting for it. That wait is
    made 300 s here (and the body's timeout, which would end that connection), so that the test tells
    the two apart by far more than a loaded machine's delays. The server says when it has taken each
    of the first two signals: sent before, the next might merge with it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    hold = ("import runpy, orca_torch.serve.server as s, orca_torch.serve.live as l; s.LAST_CHUNKS_S = 300; "
            "shutdown = l.LiveEngine.shutdown; "
            "l.LiveEngine.shutdown = lambda self, grace: (shutdown(self, grace), print('signal taken', flush=True)); "
            "runpy.run_module('orca_torch.serve', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", hold, "--model", "tiny", "--port", "0",
                             "--threads", "1", "--shutdown-grace", "30", "--body-timeout", "300"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = Lines(proc.stdout)
        banner = lines.first_with("serving")
        port = int(re.search(r"http://127\.0\.0\.1:(\d+) ", banner).group(1))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\"")           # and never the rest
            # (answered after the server has read the request above, sent on a connection made before)
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=TIMEOUT).status_code == 200
            for _ in range(2):
                proc.send_signal(sig)
                lines.first_with("signal taken")
            proc.send_signal(sig)
            assert proc.wait(timeout=30) == 0           # (not forced, the exit would wait 300 s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

PYTHON_NAMES = re.compile(r"(?<![\w-])(max_bs|max_num_batched_tokens|chunked_prefill|block_size|kv_slots|"
                          r"shutdown_grace_s|served_model_name|memory=|model=|device=)")


def test_a_library_s_refusal_is_said_in_the_flags_typed():
    """Parameter names become flags (`name='x'` the flag and its value as typed); a one-word name,
    which prose uses too, only where it opens the message."""
    from orca_torch.lab.cli_args import in_flag_terms
    from orca_torch.serve.__main__ import flags, parser
    f = flags(parser())
    assert f["max_bs"] == "--max-bs" and f["shutdown_grace_s"] == "--shutdown-grace" and f["model"] == "--model"
    assert in_flag_terms("model must be a preset; max_bs x the model's context (max_bs_x, kv_slots), memory='paged', "
                         "port=80", f) == \
        "--model must be a preset; --max-bs x the model's context (max_bs_x, --kv-slots), --memory paged, --port 80"


@pytest.mark.parametrize("bound, says", [
    ("0.0.0.0", "every interface"), ("::", "every interface"), ("192.0.2.7", "192.0.2.7"),
    ("127.0.0.1", None), ("127.0.0.2", None), ("::1", None), ("localhost", None)])
def test_the_banner_says_who_can_reach_a_server_listening_beyond_loopback(bound, says):
    """`--host 0` binds every interface, as `--host 0.0.0.0` does (the socket layer reads 0 as
    0.0.0.0), and neither --help nor the banner said so: a server with no authentication, open to
    anyone who reaches the port. --help says it now, and the banner adds a note for an address bound
    other than loopback (what the socket got: 0.0.0.0 for both)."""
    from orca_torch.serve.__main__ import exposure, parser

    note = exposure(bound, 8000)
    assert note is None if says is None else note.startswith(f"note: listening on {says}, not loopback only: "
                                                              "anyone who reaches port 8000 can send requests")
    assert "0.0.0.0, or 0" in " ".join(parser().format_help().split())


def test_bad_flags_are_refused(capsys, tmp_path):
    from orca_torch.serve.__main__ import main, parse
    for argv, says in ((["--model", "nope"], "model must be a preset"), (["--memory", "swap"], "invalid choice"),
                       (["--max-bs", "0"], "argument --max-bs: must be an integer >= 1"),
                       (["--port", "70000"], "argument --port: must be an integer from 0 to 65535"),
                       (["--seed", "-1"], "argument --seed: must be an integer with 0 <= seed"),
                       (["--kv-slots", "0"], "argument --kv-slots"),
                       (["--shutdown-grace", "-1"], "argument --shutdown-grace: must be a finite number of "
                                                    "seconds >= 0"),
                       (["--body-timeout", "0"], "argument --body-timeout: must be a finite number of seconds > 0"),
                       (["--body-memory-mib", "3"], "argument --body-memory-mib: must be an integer >= 4 (the "
                                                    "largest body taken), got '3'"),
                       (["--host", ""], "argument --host: must be non-empty text"),
                       (["--model", " "], "argument --model: must be non-empty text"),
                       (["--served-model-name", ""], "argument --served-model-name: must be non-empty text"),
                       (["--threads", "100000"], "argument --threads: must be an integer from 1 to"),
                       (["--block-size", "32"], "error: --block-size sizes the blocks of --memory paged; with "
                                                "--memory reserve it would do nothing: leave it unset\n"),
                       (["--max-num-batched-tokens", "4"], "error: --max-num-batched-tokens must be an integer >= "
                                                           "--max-bs (16) so every decode fits a step, got 4\n"),
                       (["--max-bs", "32", "--max-num-batched-tokens", "16"], "error: --max-num-batched-tokens must "
                                                                              "be an integer >= --max-bs (32)"),
                       (["--chunked-prefill"], "error: --chunked-prefill needs a token budget: set "
                                               "--max-num-batched-tokens\n")):
        with pytest.raises(SystemExit) as e:
            parse(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and not PYTHON_NAMES.search(err), (argv, err)
    for argv, says in ((["--model", str(tmp_path)], "no tokenizer in"),     # found while building: usage errors too
                       (["--memory", "paged", "--block-size", "100000"], "error: a block of 100000 tokens "
                                                                         "(--block-size) is larger than the K/V budget "
                                                                         "of 8192 tokens (--max-bs x the context): "
                                                                         "give a --block-size up to 8192\n"),
                       (["--memory", "paged", "--kv-slots", "3"], "error: a block of 16 tokens (--block-size) "
                                                                  "is larger than the K/V budget of 3 tokens "
                                                                  "(--kv-slots)"),
                       (["--kv-slots", str(10**13)], "error: the K/V budget of 10000000000000 tokens (--kv-slots) "
                                                     "needs 5,120,000.0 GB of memory"),
                       (["--max-bs", str(10**9)], "error: the K/V budget of 512000000000 tokens (--max-bs x the "
                                                  "context) needs"),
                       (["--kv-slots", "1"], "error: with these settings no request fits (set by --kv-slots)")):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--port", "0"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and not PYTHON_NAMES.search(err), (argv, err)
    with socket.socket() as held:                    # where it cannot listen: said before anything is built
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["--port", str(port)])
        says = f"cannot listen on 127.0.0.1:{port}: Address already in use"
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_shipped_tokenizers_round_trip_and_match_a_fresh_build(tmp_path):
    from orca_torch.serve.tokenizer import PLAIN_CHAT_TEMPLATE, PRESETS_DIR, PresetTokenizer, build_preset_tokenizer
    for name in ("tiny", "mini"):
        tok = PresetTokenizer(name)
        ids = list(range(len(tok.words)))
        assert tok.encode(tok.detokenizer().add(ids)) == ids           # every id's text round-trips
    transformers = pytest.importorskip("transformers")
    build_preset_tokenizer("tiny", tmp_path / "tiny")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "tiny" / f).read_text() == (PRESETS_DIR / "tiny" / f).read_text()
    hf = transformers.AutoTokenizer.from_pretrained(str(PRESETS_DIR / "tiny"))
    msgs = [{"role": "system", "content": "ka"}, {"role": "user", "content": "bo di"}]
    from orca_torch.serve.tokenizer import plain_chat_text
    assert hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == plain_chat_text(msgs)
    parts = [{"role": "user", "content": [{"type": "text", "text": "ka"}, {"type": "text", "text": "bo di"}]}]
    assert hf.apply_chat_template(parts, add_generation_prompt=True, tokenize=False) == plain_chat_text(parts) \
        == "user: ka\nbo di\nassistant:"                 # text parts: a newline between them
    assert json.loads((PRESETS_DIR / "tiny" / "tokenizer_config.json").read_text())["chat_template"] == \
        PLAIN_CHAT_TEMPLATE


def test_a_message_s_text_parts_are_joined_with_a_newline(server):
    """As the shipped template joins them, so the prompt the server runs is the one a client that
    applies the template counts; parts run together would make one word of two."""
    url, _, _ = server
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "ka"}, {"type": "text", "text": "bo"}]}],
            "max_tokens": 3}
    chat = httpx.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT).json()
    plain = httpx.post(url + "/v1/completions", json={"prompt": "user: ka\nbo\nassistant:", "max_tokens": 3},
                       timeout=TIMEOUT).json()
    assert chat["usage"] == plain["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]


def test_standard_client_smallest_form(server, tmp_path):
    """AIPerf (the `bench` extra), its smallest run against the test server."""
    aiperf = shutil.which("aiperf")
    if aiperf is None:
        pytest.skip("the standard client is not installed (pip install 'orca-torch[bench]' puts aiperf on PATH)")
    url, live, _ = server
    from orca_torch.serve.tokenizer import PRESETS_DIR
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    cmd = [aiperf, "profile", "--model", "tiny", "--tokenizer", str(PRESETS_DIR / "tiny"), "--url", url,
           "--endpoint-type", "completions", "--streaming", "--request-count", "4", "--concurrency", "2",
           "--isl", "16", "--isl-stddev", "0", "--osl", "8", "--osl-stddev", "0", "--random-seed", "1",
           "--extra-inputs", "ignore_eos:true", "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
           "--workers-max", "1", "--artifact-dir", str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    found = list(tmp_path.rglob("profile_export_aiperf.json"))
    assert found, f"no AIPerf export in {tmp_path}"
    data = json.loads(found[0].read_text())
    assert data["request_count"]["avg"] == 4
    assert data["output_sequence_length"]["avg"] == 8


@pytest.mark.parametrize("settings", [dict(memory="paged", kv_slots=256, max_bs=3),
                                      dict(max_bs=3, max_num_batched_tokens=8, chunked_prefill=True)])
def test_paged_memory_and_chunked_prefill_serve_the_same_tokens(settings):
    from orca_torch.serve.server import build

    live, _ = build(ServeConfig(model="tiny", **settings))
    model = live.engine.executor.model
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20, [7, 7]]

    async def run():
        streams = [live.submit(live.new_request(p, 30)) for p in prompts]
        out = []
        for s in streams:
            ids, finish = [], None
            while finish is None:
                ev = await asyncio.wait_for(s.queue.get(), TIMEOUT)
                ids += ev.ids
                finish = ev.finish_reason
            out.append(ids)
        return out

    try:
        got = asyncio.run(run())
        assert got == [generate_alone(model, p, 30) for p in prompts]
        assert live.engine.memory.slots_reserved == 0 and live.engine.executor.kv.slots_reserved == 0
        if settings.get("chunked_prefill"):
            assert max(n for s in live.steps for _, n, _ in s.works) <= 8
    finally:
        live.stop()


def test_a_checkpoint_uses_its_tokenizer_chat_template_and_eos_token(tmp_path):
    """A local Llama checkpoint: its own tokenizer, chat template and end-of-sequence token."""
    from orca_torch.serve.app import create_app
    from orca_torch.serve.server import build

    tok = tiny_checkpoint(tmp_path)
    tok.chat_template = "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}"
    tok.save_pretrained(tmp_path)
    live, stok = build(ServeConfig(model=str(tmp_path)))
    assert live.stop_token_ids == {2}
    app = create_app(live, stok, "ckpt")
    model = live.engine.executor.model

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=TIMEOUT) as c:
            models = (await c.get("/v1/models")).json()
            chat = (await c.post("/v1/chat/completions", json={
                "model": "ckpt", "max_completion_tokens": 5, "ignore_eos": True,
                "messages": [{"role": "user", "content": "w4 w5"}]})).json()
            body = {"model": "ckpt", "prompt": "w4 w5", "max_tokens": 5, "ignore_eos": True}
            whole = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            async def streamed(**extra):
                async with c.stream("POST", "/v1/completions", json={**body, "stream": True, **extra}) as r:
                    return "".join([json.loads(line[6:])["choices"][0]["text"] async for line in r.aiter_lines()
                                    if line.startswith("data: {")])

            stop = whole.split()[2][-2:] + " w"         # (the end of one word, the start of the next)
            cut = (await c.post("/v1/completions", json={**body, "stop": stop})).json()["choices"][0]
            return models, chat, whole, await streamed(), stop, cut, await streamed(stop=[stop])

    try:
        models, chat, whole, streamed, stop, cut, cut_streamed = asyncio.run(run())
    finally:
        live.stop()
    assert whole.find(stop) >= 0 and cut["finish_reason"] == "stop"
    assert cut["text"] == cut_streamed == whole[:whole.find(stop)]
    # A completion continues its prompt: the prompt and it are the whole text, the space between
    # them included (decoded alone, the first word lost it).
    assert "w4 w5" + whole == "w4 w5" + streamed == tok.decode([4 + 3, 5 + 3] + generate_alone(model, [4 + 3, 5 + 3], 5))
    assert models["data"][0]["root"] == str(tmp_path)
    ids = [1, 4 + 3, 5 + 3]                              # "<s> w4 w5" through the checkpoint's template
    ref = generate_alone(model, ids, 5)
    assert chat["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert chat["choices"][0]["message"]["content"] == tok.decode(ref, skip_special_tokens=True)


def test_the_server_s_seed_seeds_the_draws_of_a_request_sent_without_one(tmp_path):
    """A sampled request without a seed draws from the server's --seed and its number: the same
    server started again answers the same, one with another --seed other text. (--seed reached a
    preset's weights only: a checkpoint's server answered the same whatever its --seed.)"""
    from orca_torch.serve.app import create_app
    from orca_torch.serve.server import build

    tiny_checkpoint(tmp_path).save_pretrained(tmp_path)
    body = {"prompt": "w4 w5", "max_tokens": 12, "ignore_eos": True, "temperature": 1.0}

    def answer(seed: int) -> str:
        live, tok = build(ServeConfig(model=str(tmp_path), seed=seed))

        async def run():
            transport = httpx.ASGITransport(app=create_app(live, tok, "ckpt"))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=TIMEOUT) as c:
                return (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]

        try:
            return asyncio.run(run())
        finally:
            live.stop()

    first = answer(0)
    assert answer(0) == first != answer(1)


def test_a_checkpoint_s_stop_ids_are_its_tokenizer_s_eos_and_every_id_its_config_files_list(tmp_path):
    """The tokenizer's own eos token counts where no config file names it, and id 0 is a token id
    like any other (GPT-NeoX's <|endoftext|> is 0)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from orca_torch.serve.tokenizer import CheckpointTokenizer

    vocab = {"<unk>": 0, "</s>": 1, "a": 2}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                            unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    assert CheckpointTokenizer(tmp_path).stop_token_ids == {1}
    (tmp_path / "config.json").write_text('{"eos_token_id": 0}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [0, 2]}')
    assert CheckpointTokenizer(tmp_path).stop_token_ids == {0, 1, 2}


@pytest.mark.parametrize("where", ["generation_config.json", "config.json"])
def test_a_checkpoint_stops_at_each_eos_id_its_config_files_list(tmp_path, where):
    """An instruct model's end of turn (Llama 3's <|eot_id|>, say) is often an `eos_token_id` of its
    generation_config.json or config.json, not its tokenizer's eos token: a reply stops there with
    finish_reason "stop", as transformers' generate stops (it ran on to max_tokens, "length"), and not
    among the first `min_tokens` tokens."""
    from orca_torch.serve.app import create_app
    from orca_torch.serve.server import build

    tiny_checkpoint(tmp_path).save_pretrained(tmp_path)
    live, tok = build(ServeConfig(model=str(tmp_path)))
    live.stop()
    ref = generate_alone(live.engine.executor.model, tok.encode("w4 w5"), 8)
    k = next(i for i in range(1, 8) if ref[i] != 2 and ref[i] not in ref[:i])     # an id first made at i > 0
    f = tmp_path / where
    f.write_text(json.dumps({**json.loads(f.read_text()), "eos_token_id": [2, ref[k]]}))
    live, tok = build(ServeConfig(model=str(tmp_path)))
    assert live.stop_token_ids == {2, ref[k]}
    app = create_app(live, tok, "ckpt")

    async def run(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=TIMEOUT) as c:
            whole = (await c.post("/v1/completions", json=body)).json()
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                chunks = [json.loads(line[6:])["choices"][0] async for line in r.aiter_lines()
                          if line.startswith("data: {")]
            return whole, chunks

    try:
        body = {"model": "ckpt", "prompt": "w4 w5", "max_tokens": 8}
        whole, chunks = asyncio.run(run(body))
        assert whole["choices"][0]["finish_reason"] == "stop" and whole["usage"]["completion_tokens"] == k + 1
        assert len(chunks) == k + 1 and [c["finish_reason"] for c in chunks] == [None] * k + ["stop"]
        whole, chunks = asyncio.run(run({**body, "ignore_eos": True}))
        assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 8
        whole, chunks = asyncio.run(run({**body, "min_tokens": k + 1}))    # (ref[k] masked: not among the first k + 1)
        n = whole["usage"]["completion_tokens"]
        assert (n > k + 1 or n == 8) and len(chunks) == n
    finally:
        live.stop()


def test_a_checkpoints_stream_decodes_each_token_a_bounded_number_of_times():
    """A checkpoint's streamed text: the chunks join to the whole decode (spaces, split UTF-8
    characters held back), and each chunk decodes a short window, not the whole stream so far."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from orca_torch.serve.tokenizer import IncrementalDetokenizer

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]    # byte-level BPE's byte alphabet
    others = [b for b in range(256) if b not in printable]
    shown = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    vocab = {shown[b]: b for b in range(256)} | {"\u0120" + w: 256 + j for j, w in enumerate(["ka", "bo", "di"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=t)
    snowman = list("\u2603".encode())                  # one character, three byte tokens
    ids = ([256, 257, 258] * 100)[:299] + snowman + [257] * 100
    decoded = []
    real = tok.decode
    tok.decode = lambda xs, **kw: decoded.append(len(xs)) or real(xs, **kw)
    d = IncrementalDetokenizer(tok)
    chunks = [d.add([i]) for i in ids]
    assert "".join(chunks) == real(ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(chunks) and chunks[299:302] == ["", "", "\u2603"]
    assert sum(decoded) <= 8 * len(ids)                  # a window per token (the whole stream: ~n^2/2)
    cut = [256] + snowman[:2]                           # a stream that ends inside a character
    assert IncrementalDetokenizer(tok).add(cut, final=True) == real(cut, skip_special_tokens=True) != ""
    d = IncrementalDetokenizer(tok)
    assert d.add(cut[:2]) + d.add(cut[2:], final=True) == real(cut, skip_special_tokens=True)
    d = IncrementalDetokenizer(tok, ids[:40])          # after a prompt: its last few tokens open the window
    assert "".join(d.add([i]) for i in ids[40:]) == real(ids)[len(real(ids[:40])):]
    assert d.ids[:IncrementalDetokenizer.CONTEXT] == ids[40 - IncrementalDetokenizer.CONTEXT:40]


def test_a_checkpoint_s_logprob_tokens_are_the_text_each_adds_so_they_make_up_the_answer_s_text(tmp_path):
    """A SentencePiece-like tokenizer ('\u2581' a space, which a text's start drops: a Metaspace
    decoder): each log probability's token, and each likely token's, is the text it adds after the
    tokens before it, its leading space kept (decoded alone, "\u2581w5" is "w5"), so a completion's
    tokens run together are its text and `text_offset` indexes into it, whole and streamed; chat's
    the same, its first word without the space a text's start drops."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from orca_torch.serve.app import create_app
    from orca_torch.serve.server import build

    tiny_checkpoint(tmp_path)
    words = ["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(150)] + [f"x{i}" for i in range(147)]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(tmp_path)
    live, tok = build(ServeConfig(model=str(tmp_path)))
    app = create_app(live, tok, "ckpt")

    async def run(path, body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=TIMEOUT) as c:
            whole = (await c.post(path, json=body)).json()["choices"][0]
            async with c.stream("POST", path, json={**body, "stream": True}) as r:
                chunks = [json.loads(line[6:])["choices"][0] async for line in r.aiter_lines()
                          if line.startswith("data: {")]
            return whole, chunks

    try:
        body = {"prompt": "w4 w5", "max_tokens": 16, "ignore_eos": True, "logprobs": 3}
        whole, chunks = asyncio.run(run("/v1/completions", body))
        text, lp = whole["text"], whole["logprobs"]
        assert "".join(lp["tokens"]) == text
        assert [text[o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == lp["tokens"]
        assert any(t.startswith(" w") for t in lp["tokens"]), lp["tokens"]
        likely = [t for top in lp["top_logprobs"] for t in top]
        assert any(t.startswith(" w") for t in likely) and not any(t.startswith("w") for t in likely), likely
        streamed = [t for c in chunks for t in c["logprobs"]["tokens"]]
        offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
        assert streamed == lp["tokens"] and offsets == lp["text_offset"] and "".join(c["text"] for c in chunks) == text
        chat = {"messages": [{"role": "user", "content": "w4 w5"}], "max_tokens": 16, "ignore_eos": True,
                "logprobs": True, "top_logprobs": 2}
        whole, _ = asyncio.run(run("/v1/chat/completions", chat))
        assert "".join(e["token"] for e in whole["logprobs"]["content"]) == whole["message"]["content"]
    finally:
        live.stop()


def test_a_continuation_of_unknown_words_keeps_the_space_before_its_first_word():
    """A word-level tokenizer (a preset's, loaded as a checkpoint's) turns a real prompt into
    `<unk>`s: the continuation still opens with the space a whole decode puts after them, while a
    `<unk>` the stream makes is skipped like any special token, and known words are as before."""
    pytest.importorskip("transformers")
    from orca_torch.serve.tokenizer import PRESETS_DIR, CheckpointTokenizer

    tok = CheckpointTokenizer(PRESETS_DIR / "tiny")
    prompt, words, unk = "The capital of France is", tok.encode("ka ke"), tok.tok.unk_token_id
    after = tok.encode(prompt)
    assert set(after) == {unk}
    assert prompt + tok.detokenizer(after).add(words, final=True) == "The capital of France is ka ke"
    d = tok.detokenizer(after)
    assert [d.add([words[0]]), d.add([unk]), d.add([words[1]], final=True)] == [" ka", "", " ke"]
    assert tok.detokenizer(tok.encode("ki ko")).add(words, final=True) == " ka ke"
    assert tok.detokenizer().add([unk, *words], final=True) == "ka ke"            # (a chat reply: no prompt)


def test_a_chat_template_that_refuses_the_messages_gets_a_400(server, tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from orca_torch.serve.app import OpenAIServer
    from orca_torch.serve.bodies import APIError
    from orca_torch.serve.tokenizer import CheckpointTokenizer

    _, live, _ = server
    t = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    tok.save_pretrained(tmp_path)
    srv = OpenAIServer(live, CheckpointTokenizer(tmp_path), "ckpt")
    assert srv.parse({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, "chat").prompt_ids == [1]
    with pytest.raises(APIError) as e:
        srv.parse({"messages": [{"role": "system", "content": "hi"}], "max_tokens": 1}, "chat")
    assert e.value.status == 400 and e.value.param == "messages" and "System role not supported" in e.value.message


def test_an_unexpected_error_gets_a_500_error_object_and_the_server_stays_up(server):
    url, _, app = server
    tok = app.state.server.tok

    def broken(text):
        raise KeyError("injected")

    tok.encode = broken
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "ka"}, timeout=TIMEOUT)
    finally:
        del tok.encode
    assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.post(url + "/v1/completions", json={"prompt": "ka", "max_tokens": 2}, timeout=TIMEOUT).status_code == 200


def test_an_engine_failure_mid_stream_is_an_error_chunk_with_a_null_code(server):
    url, live, _ = server
    ex = live.engine.executor

    def broken(batch):
        del ex.execute                                  # (once)
        raise RuntimeError("injected")

    ex.execute = broken
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=TIMEOUT,
                          json={"prompt": "ka", "max_tokens": 3, "stream": True}) as r:
            events = sse_events(list(r.iter_lines()))
    finally:
        ex.__dict__.pop("execute", None)
    err = events[-2]["error"]
    assert events[-1] == "[DONE]" and "injected" in err["message"] and err["code"] is None
    r = httpx.post(url + "/v1/completions", json={"prompt": "ka", "max_tokens": 2}, timeout=TIMEOUT)
    assert r.status_code == 200


@pytest.mark.parametrize("stop", [None, ["never seen"]])
@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_whose_text_fails_ends_alike_streamed_or_whole_with_stop_strings_or_not(server, monkeypatch,
                                                                                          stream, stop):
    """The tokenizer raises as it makes the text of the answer's last token: the answer ends with
    the same error either way it was asked for, a stream with an error chunk and `[DONE]` (its 200
    is sent), a whole answer with a 500 error object, and /metrics counts it as aborted, not as
    ended at its length (a text without stop strings once cut the stream with neither, and counted
    it as `length`)."""
    from orca_torch.serve.tokenizer import WordDetokenizer
    url, live, app = server
    tok = app.state.server.tok

    class FailsAtTheFourth(WordDetokenizer):
        def __init__(self, words) -> None:
            super().__init__(words)
            self.n = 0

        def add(self, ids, final: bool = False) -> str:
            self.n += len(ids)
            if self.n >= 4:
                raise RuntimeError("decode failed")
            return super().add(ids, final)

    monkeypatch.setattr(tok, "detokenizer", lambda after=(): FailsAtTheFourth(tok.words))
    before = _ended_and_generated(url)
    body = {"prompt": "ka", "max_tokens": 4, "stream": stream, "stop": stop}
    says = "the answer's text could not be made (RuntimeError: decode failed)"
    if stream:
        with httpx.stream("POST", url + "/v1/completions", timeout=TIMEOUT, json=body) as r:
            events = sse_events(list(r.iter_lines()))
        assert r.status_code == 200 and events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert [e["choices"][0]["finish_reason"] for e in events[:-2]] == [None] * 3
    else:
        r = httpx.post(url + "/v1/completions", timeout=TIMEOUT, json=body)
        assert r.status_code == 500
        error = r.json()["error"]
    assert error == {"message": says, "type": "server_error", "param": None, "code": None}
    ended, generated = _counted_since(url, before, 1)
    assert ended == {"length": 0, "stop": 0, "abort": 1, "e2e": 0} and generated == 3
    _settled(live)


def test_a_tokenizer_that_fails_to_start_an_answer_is_the_server_s_fault_not_the_request_s(server, monkeypatch):
    """The answer's detokenizer raises ValueError as it is made: a 500 of the server's own, not the
    400 naming max_tokens that the context and K/V checks beside it give a request too long."""
    url, live, app = server
    tok = app.state.server.tok

    def broken(after=()):
        raise ValueError("no decoder")

    monkeypatch.setattr(tok, "detokenizer", broken)
    r = httpx.post(url + "/v1/completions", timeout=TIMEOUT, json={"prompt": "ka", "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "internal error: ValueError: no decoder", "type": "server_error",
                                 "param": None, "code": None}
    _settled(live)


def test_a_non_streaming_client_that_leaves_is_aborted(server, monkeypatch):
    """The engine's steps wait until the server has heard the client leave (its 0.3 s timeout): a
    machine fast enough to make the 500 tokens first would otherwise answer it in full."""
    url, live, _ = server
    eng = live.engine
    before = len(live.requests)
    left = threading.Event()
    abort, step = live.abort, eng.step
    monkeypatch.setattr(live, "abort", lambda stream: (abort(stream), left.set()))
    monkeypatch.setattr(eng, "step", lambda: (left.wait(TIMEOUT), step())[1])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": [3, 4], "max_tokens": 500}, timeout=0.3)
    deadline = time.time() + 15
    while (len(live.requests) == before or live.requests[before].status is not Status.ABORTED) \
            and time.time() < deadline:
        time.sleep(0.05)
    r = live.requests[before]
    assert r.status is Status.ABORTED and r.n_generated < 500
    while (eng.memory.slots_reserved or not eng.done) and time.time() < deadline:
        time.sleep(0.02)
    assert eng.memory.slots_reserved == 0 and eng.executor.kv.slots_reserved == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_with_a_pipelined_request_behind_its_own_is_aborted(server, monkeypatch, stream):
    """A client sends a request and, on the same connection, a second one behind it (HTTP
    pipelining), then closes the connection: the first request, running, is aborted. uvicorn's
    httptools protocol told only the second (which never runs) that its client had gone, so a whole
    answer's handler never heard it and its request ran to max_tokens for nobody. The engine's first
    step waits until the server has heard the client leave (at most 10 s, so the old code ends)."""
    url, live, _ = server
    eng = live.engine
    _settled(live)
    before = len(live.requests)
    left = threading.Event()
    abort, step = live.abort, eng.step
    monkeypatch.setattr(live, "abort", lambda *streams: (abort(*streams), left.set()))
    monkeypatch.setattr(eng, "step", lambda: (left.wait(10), step())[1])
    body = json.dumps({"prompt": [3, 4], "max_tokens": 500, "stream": stream}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                     + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        deadline = time.time() + TIMEOUT
        while len(live.requests) == before and time.time() < deadline:
            time.sleep(0.02)
    deadline = time.time() + TIMEOUT
    while (live.requests[before].status in (Status.WAITING, Status.RUNNING) or not eng.done) \
            and time.time() < deadline:
        time.sleep(0.02)
    r = live.requests[before]
    assert r.status is Status.ABORTED and r.n_generated < 500
    _settled(live)


def _post_and_leave(app, body: bytes) -> None:
    """Call the ASGI `app` with a POST to /v1/completions of `body` whose client is gone once the body
    is in (its next receive is a disconnect), reading nothing it sends."""
    messages = [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0) if len(messages) > 1 else messages[0]

    async def send(_):
        pass

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), TIMEOUT))


def test_a_streaming_client_gone_before_the_first_chunk_is_aborted(server):
    """The client is gone before the response starts: the request is aborted all the same, not left
    to run to max_tokens for nobody."""
    _, live, app = server
    eng = live.engine
    body = json.dumps({"prompt": [4, 5], "max_tokens": 500, "stream": True}).encode()
    before = len(live.requests)
    _post_and_leave(app, body)
    deadline = time.time() + 15
    while (len(live.requests) == before or not eng.done) and time.time() < deadline:
        time.sleep(0.02)
    r = live.requests[before]
    assert r.status is Status.ABORTED and r.n_generated < 500
    assert eng.memory.slots_reserved == 0 and eng.executor.kv.slots_reserved == 0


def test_a_stream_whose_client_reads_nothing_holds_no_memory_and_ends_when_it_leaves(server):
    """A client that keeps its connection but reads nothing: the server's send waits (the socket's
    buffer is full; here a `send` that never returns), but the engine does not wait on it: the
    request runs to its max_tokens and leaves the engine, its memory freed, while its tokens queue
    for the handler (at most max_tokens of them, as in vLLM). When the client leaves, the handler
    ends, and the request stays counted as it finished."""
    _, live, app = server
    eng = live.engine
    body = json.dumps({"prompt": [5, 6], "max_tokens": 300, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    _settled(live)
    before, length = len(live.requests), live.metrics.finished["length"]

    async def run() -> None:
        stalled, gone = asyncio.Event(), asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                stalled.set()
                await asyncio.Event().wait()            # the client reads no more: this send never returns

        handler = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.wait_for(stalled.wait(), TIMEOUT)
        deadline = time.time() + TIMEOUT
        while (len(live.requests) == before or live.requests[before].status is not Status.FINISHED
               or not eng.done) and time.time() < deadline:
            await asyncio.sleep(0.02)
        assert not handler.done()                       # (held by its client, which holds nothing else)
        gone.set()
        await asyncio.wait_for(handler, TIMEOUT)

    asyncio.run(run())
    r = live.requests[before]
    assert r.status is Status.FINISHED and r.n_generated == 300
    assert eng.memory.slots_reserved == 0 and eng.executor.kv.slots_reserved == 0
    assert live.metrics.finished["length"] == length + 1


def test_an_engine_failure_ends_its_streams_and_the_engine_goes_on():
    from orca_torch.serve.server import build

    live, _ = build(ServeConfig(model="tiny"))
    ex = live.engine.executor
    real = ex.execute
    calls = []

    def fail_once(batch):
        calls.append(batch.index)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(batch)

    ex.execute = fail_once

    async def run(prompt):
        s = live.submit(live.new_request(prompt, 5))
        evs = []
        while not evs or evs[-1].finish_reason is None:
            evs.append(await asyncio.wait_for(s.queue.get(), TIMEOUT))
        return evs

    try:
        failed = asyncio.run(run([1, 2, 3]))
        assert failed[-1].error is not None and "injected" in failed[-1].error
        assert live.requests[0].status is Status.ABORTED        # (not left "running" in the history)
        ok = asyncio.run(run([1, 2, 3]))
        assert [t for e in ok for t in e.ids] == generate_alone(ex.model, [1, 2, 3], 5)
        assert live.engine.memory.slots_reserved == 0 and ex.kv.slots_reserved == 0
    finally:
        live.stop()


@pytest.mark.parametrize("error", [RuntimeError, ValueError])
def test_a_failure_outside_the_step_ends_the_streams_and_the_engine_goes_on(error):
    """A bug in the loop's own bookkeeping (here: adding a request; a refusal there too, as a
    request was checked at the door) ends the affected streams with an error instead of killing
    the engine thread and leaving every stream waiting."""
    from orca_torch.serve.server import build

    live, _ = build(ServeConfig(model="tiny"))
    eng = live.engine
    real_add = eng.add

    def add_fails_once(req):
        eng.add = real_add
        raise error("injected")

    eng.add = add_fails_once

    async def run(prompt):
        s = live.submit(live.new_request(prompt, 5))
        evs = []
        while not evs or evs[-1].finish_reason is None:
            evs.append(await asyncio.wait_for(s.queue.get(), 10))
        return evs

    try:
        failed = asyncio.run(run([1, 2, 3]))
        assert failed[-1].error is not None and "injected" in failed[-1].error
        assert live.serving
        real_record = live._record

        def record_fails_once(*args):                   # after a step: the request holds memory
            live._record = real_record
            assert eng.memory.slots_reserved > 0
            raise RuntimeError("injected after the step")

        live._record = record_fails_once
        failed = asyncio.run(run([1, 2, 3]))
        assert failed[-1].error is not None and "injected after the step" in failed[-1].error
        assert live.requests[-1].status is Status.ABORTED
        assert eng.memory.slots_reserved == 0 and eng.executor.kv.slots_reserved == 0
        ok = asyncio.run(run([1, 2, 3]))
        assert [t for e in ok for t in e.ids] == generate_alone(eng.executor.model, [1, 2, 3], 5)
        assert live.metrics.finished == {"length": 1, "stop": 0, "abort": 2}     # (the one not added too)
    finally:
        live.stop()
    assert not live.serving



def test_requests_an_engine_failure_ends_are_counted_once():
    """Every request the engine took in is counted once in `request_success_total`, those an
    engine failure ended too (as "abort", the reason their last event gives): taken in = ended +
    running + waiting holds after a failure as before it."""
    from orca_torch.serve.server import build

    live, _ = build(ServeConfig(model="tiny"))
    ex, m = live.engine.executor, live.metrics
    real = ex.execute

    def fail_once(batch):                               # the first step that holds all three
        if len(batch.works) < 3:
            return real(batch)
        ex.execute = real
        raise RuntimeError("injected")

    async def run(n):
        streams = [live.submit(live.new_request([1, 2, 3], 20)) for _ in range(n)]
        ends = []
        for s in streams:
            ev = await asyncio.wait_for(s.queue.get(), TIMEOUT)
            while ev.finish_reason is None:
                ev = await asyncio.wait_for(s.queue.get(), TIMEOUT)
            ends.append(ev.error is not None)
        return ends

    try:
        assert asyncio.run(run(2)) == [False, False]
        ex.execute = fail_once
        assert asyncio.run(run(3)) == [True, True, True]
        assert asyncio.run(run(1)) == [False]
        with m.lock:
            ended = dict(m.finished)
        assert ended == {"length": 3, "stop": 0, "abort": 3} and m.prompt_tokens == 6 * 3
        assert live.n_running == live.n_waiting == 0
    finally:
        live.stop()


async def post_and_leave(url: str, body: dict, k: int) -> None:
    """A whole-answer client that sends its body, lets the event loop turn 10 k times, and leaves
    (its connection closed) before reading any answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    raw = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
    await writer.drain()
    for _ in range(10 * k):
        await asyncio.sleep(0)
    writer.close()
    await writer.wait_closed()


def test_clients_leaving_at_random_points_are_each_counted_once():
    """30 clients at once on paged memory (preemptions), streaming or not, 40% of them leaving at
    points a seeded RNG draws (after k lines of the stream; with the body sent, after k turns of
    the event loop): `request_success_total` counts each request the engine took in once, a client
    that stays gets one last chunk, and once every request has left, nothing runs or waits and
    the K/V memory is back at zero."""
    rng = np.random.default_rng(0)
    plans = [(rng.integers(0, 100, size=int(rng.integers(2, 40))).tolist(), int(rng.integers(1, 60)),
              bool(rng.random() < 0.6), bool(rng.random() < 0.4), int(rng.integers(0, 12))) for _ in range(30)]

    async def client(c, url, prompt, max_tokens, stream, leave, k):
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
        if stream:
            events = await stream_or_leave(c, url, body, k if leave else None)
            if events is None:
                return None
            assert events[-1] == "[DONE]" and [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
            return sum(e["choices"][0]["finish_reason"] is not None for e in events[:-1])
        if not leave:
            r = await c.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return 1
        await post_and_leave(url, body, k)
        return None

    with serving(ServeConfig(model="tiny", port=0, memory="paged", kv_slots=512, max_bs=8)) as (url, live, _):
        async def go():
            async with httpx.AsyncClient(timeout=TIMEOUT) as c:
                return await asyncio.gather(*[client(c, url, *plan) for plan in plans])

        lasts = asyncio.run(asyncio.wait_for(go(), TIMEOUT))
        assert all(n == 1 for n in lasts if n is not None)
        reached = len(live.requests)
        assert [r.req_id for r in live.requests] == list(range(reached))

        def figures() -> dict:
            fams = parse_prometheus(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
            return {(name, labels.get("finished_reason")): v for fam in fams.values() for name, labels, v in fam[1]}

        deadline = time.time() + TIMEOUT
        while True:                                     # until every request has left and been counted
            f = figures()
            ended = sum(v for (name, _), v in f.items() if name == "vllm:request_success_total")
            idle = all(f[(g, None)] == 0 for g in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                   "orca:kv_slots_used", "orca:kv_slots_reserved"))
            if (idle and ended >= reached) or time.time() > deadline:
                break
            time.sleep(0.02)
        assert idle and ended == reached, {k: v for k, v in f.items() if k[1] is not None}
        assert live.engine.executor.kv.slots_reserved == 0


def test_a_client_leaving_during_a_step_is_not_counted_waiting():
    """While a step runs, the inbox holds what the HTTP side sent since: a new request is waiting,
    but a departed client's abort is not a request (it is running, and counted so)."""
    from orca_torch.serve.server import build

    live, _ = build(ServeConfig(model="tiny"))
    ex = live.engine.executor
    real, in_step, go_on = ex.execute, threading.Event(), threading.Event()

    def held(batch):
        in_step.set()
        assert go_on.wait(TIMEOUT)
        return real(batch)

    async def run():
        s = live.submit(live.new_request([1, 2, 3], 50))
        assert await asyncio.to_thread(in_step.wait, TIMEOUT)
        ex.execute = real                               # (the next steps run freely)
        running = (live.n_running, live.n_waiting)
        live.abort(s)
        leaving = (live.n_running, live.n_waiting)
        live.submit(live.new_request([4, 5], 2))
        arriving = live.n_waiting
        go_on.set()
        return running, leaving, arriving

    ex.execute = held
    try:
        assert asyncio.run(asyncio.wait_for(run(), TIMEOUT)) == ((1, 0), (1, 0), 1)
    finally:
        go_on.set()
        live.stop()

PROM_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
                         r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*")*)?\})? '
                         r'([-+]?(?:[0-9.]+(?:[eE][-+]?[0-9]+)?|Inf|NaN))$')
PROM_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict:
    """Prometheus text format 0.0.4, strictly: {family: (type, [(name, labels, value)])}."""
    assert text.endswith("\n")
    fams: dict = {}
    current = None
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in fams
            fams[name], current = (kind, []), name
            continue
        m = PROM_SAMPLE.match(line)
        assert m, f"not a Prometheus sample: {line!r}"
        name, labels, value = m.group(1), dict(PROM_LABEL.findall(m.group(2) or "")), float(m.group(3))
        kind = fams[current][0]
        allowed = {current + x for x in ("_bucket", "_sum", "_count")} if kind == "histogram" else {current}
        assert name in allowed, f"{name} under # TYPE {current} {kind}"
        fams[current][1].append((name, labels, value))
    for name, (kind, samples) in fams.items():
        if kind == "histogram":
            buckets = [(lab["le"], v) for n, lab, v in samples if n.endswith("_bucket")]
            counts = [v for _, v in buckets]
            assert buckets[-1][0] == "+Inf" and counts == sorted(counts)
            assert [float(le) for le, _ in buckets] == sorted(float(le) for le, _ in buckets)
            assert next(v for n, _, v in samples if n == name + "_count") == counts[-1]
    return fams


def test_metrics_are_valid_prometheus_text_and_counters_only_grow(server):
    url, _, _ = server
    before = parse_prometheus(httpx.get(url + "/metrics").text)
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}, timeout=TIMEOUT)
    assert r.status_code == 200
    after = parse_prometheus(httpx.get(url + "/metrics").text)
    for name, (kind, samples) in after.items():
        assert before[name][0] == kind
        if kind != "gauge":
            old = {(n, tuple(sorted(lab.items()))): v for n, lab, v in before[name][1]}
            assert all(v >= old[(n, tuple(sorted(lab.items())))] for n, lab, v in samples), name
    gen = [fams["vllm:generation_tokens_total"][1][0][2] for fams in (before, after)]
    assert gen[1] - gen[0] == 3
    from orca_torch.serve.metrics import Metrics
    odd = parse_prometheus(Metrics('my "model"\\v2').render({"g": ("a gauge", 1)}))
    assert odd["g"][1][0][1] == {"model_name": 'my \\"model\\"\\\\v2'}


def _live_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("cb_live", ROOT / "examples" / "continuous_batching_live.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_the_live_continuous_batching_example(capsys):
    assert _live_example().main([]) == 0
    out = capsys.readouterr().out
    assert "B joined the running batch at step" in out and "A ran on alone" in out


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")     # (uvicorn's exit, in its thread)
def test_the_live_example_fails_rather_than_waits_when_its_server_cannot_start(capsys):
    """Its server cannot bind (here a port another socket holds, in place of the port 0 it asks
    for): the server's thread ends, and the example says so and returns 1 instead of waiting for a
    server that will never start."""
    example = _live_example()
    result: list[int] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        example.ServeConfig = lambda **kw: ServeConfig(**{**kw, "port": taken.getsockname()[1]})
        runner = threading.Thread(target=lambda: result.append(example.main([])), daemon=True)
        runner.start()
        runner.join(20)
    assert result == [1]
    assert "the server did not start on 127.0.0.1" in capsys.readouterr().err


def test_the_live_example_stops_its_server_on_a_ctrl_c_before_the_server_has_started(monkeypatch):
    """A Ctrl-C while the example waits for its server to bind: the server's thread and the engine's
    have both ended when the KeyboardInterrupt leaves `main`."""
    from types import SimpleNamespace

    example, made, threads = _live_example(), [], []

    class Recorded(threading.Thread):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            threads.append(self)

    def ctrl_c(seconds):
        raise KeyboardInterrupt

    # (the bind is never reported to the example, so it is still waiting when the Ctrl-C comes)
    monkeypatch.setattr(example, "make_server", lambda cfg, on_start: made.append(make_server(cfg)) or made[-1])
    monkeypatch.setattr(example, "threading", SimpleNamespace(Thread=Recorded))
    monkeypatch.setattr(example, "time", SimpleNamespace(sleep=ctrl_c))
    with pytest.raises(KeyboardInterrupt):
        example.main([])
    (_, live), = made
    assert threads and not any(t.is_alive() for t in threads) and not live.thread.is_alive()


def test_the_live_example_refuses_a_request_past_the_context_and_fails_on_an_error(server, capsys):
    example = _live_example()
    with pytest.raises(SystemExit) as e:
        example.main(["--long", "505"])          # 8 prompt tokens + 505 > tiny's 512
    assert e.value.code == 2 and "give --long <= 504" in capsys.readouterr().err
    url, _, _ = server                           # a refused A ends the run: B does not wait for its tokens
    with pytest.raises(RuntimeError, match="request A: the server answered 400"):
        asyncio.run(asyncio.wait_for(example.drive(url, 100_000, 6), TIMEOUT))


def _bench_serve():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "benchmarks" / "bench_serve.py")
    mod = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "bench_serve", mod)     # (its dataclasses look it up while it loads)
        spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("n, served", [(32, 1000), (1000, 1000), (1500, 1500)])
def test_bench_serve_starts_its_server_with_connections_for_every_request(n, served, monkeypatch):
    """The server the benchmark starts serves all --n requests in flight at once (--max-connections
    raised past its default where --n is larger), so none gets 503 for want of a connection."""
    from types import SimpleNamespace

    from orca_torch.serve import limits

    monkeypatch.setattr(limits, "connection_room", lambda: None)
    cmd = _bench_serve().server_command(SimpleNamespace(n=n, max_bs=8, kv_slots=4096))
    assert cmd[cmd.index("--max-connections") + 1] == str(served)


def test_bench_serve_figures_a_run_has_not_are_n_a_and_null():
    """With one output token there is no gap between tokens: TPOT and ITL are absent, said as n/a in
    the table and null in JSON (which has no NaN), and numpy is not asked for a median of nothing."""
    import warnings

    bs = _bench_serve()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(bs.median([])) and math.isnan(bs.median([math.nan, math.nan]))
        assert bs.median(np.array([3.0, math.nan, 1.0, 2.0])) == 2.0
    assert bs.figure(math.nan, ".1f") == "n/a" and bs.figure(12.345, ".1f") == "12.3"
    safe = bs.jsonable({"a": [math.nan, np.float64(math.inf), np.float32(1.5), np.int64(3)], "b": (1, "x", None)})
    assert json.loads(json.dumps(safe, allow_nan=False)) == {"a": [None, None, 1.5, 3], "b": [1, "x", None]}


@pytest.mark.parametrize("status, says", [(400, r"refused request 0 \(400\): b'\{\"error\": \"nope\"\}'"),
                                          (200, "request 0's stream held no token")])
def test_bench_serve_s_builtin_driver_says_when_a_request_got_no_tokens(status, says, monkeypatch):
    # (it counted every request as answered: a refusal or an empty stream ended in an IndexError)
    import asyncio
    import types

    import httpx

    bs, real = _bench_serve(), httpx.AsyncClient
    reply = httpx.Response(status, content=b'{"error": "nope"}' if status == 400 else b"data: [DONE]\n\n")
    monkeypatch.setattr(httpx, "AsyncClient",
                        lambda **kw: real(transport=httpx.MockTransport(lambda request: reply), **kw))
    with pytest.raises(RuntimeError, match=says):
        asyncio.run(bs._builtin("http://127.0.0.1:9", 1000.0, types.SimpleNamespace(seed=0, n=1, isl=4, osl=2)))


@pytest.mark.parametrize("last, says", [
    ({"error": {"message": "the engine failed: boom"}}, "request 0's stream ended with the server's error after 1 "
                                                        "tokens: the engine failed: boom"),
    ({"error": {"message": "the server shut down before the answer was complete"}},
     "request 0's stream ended with the server's error after 1 tokens: the server shut down")])
def test_bench_serve_s_builtin_driver_says_when_a_stream_ends_in_an_error(last, says, monkeypatch):
    # (an error chunk was skipped: the run measured on)
    import types

    import httpx

    bs, real = _bench_serve(), httpx.AsyncClient
    token = {"choices": [{"index": 0, "text": " ka", "finish_reason": None}]}
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in (token, last)) + "data: [DONE]\n\n"
    reply = httpx.Response(200, content=body.encode())
    monkeypatch.setattr(httpx, "AsyncClient",
                        lambda **kw: real(transport=httpx.MockTransport(lambda request: reply), **kw))
    with pytest.raises(RuntimeError, match=re.escape(says)):
        asyncio.run(bs._builtin("http://127.0.0.1:9", 1000.0, types.SimpleNamespace(seed=0, n=1, isl=4, osl=2)))


def test_bench_serve_s_builtin_driver_draws_prompt_ids_from_the_model_s_vocabulary(monkeypatch):
    """The driver drew ids below a written 10240 (mini's vocabulary) whatever the script's model: a
    model with a smaller one would have its prompts refused. It draws below the spec's `vocab`."""
    import asyncio
    import types

    import httpx

    from orca_torch.specs import get_model_spec

    bs, real = _bench_serve(), httpx.AsyncClient
    prompts = []
    token = {"choices": [{"index": 0, "text": " ka", "finish_reason": None}]}

    def answer(request):
        prompts.append(json.loads(request.content)["prompt"])
        return httpx.Response(200, content=f"data: {json.dumps(token)}\n\ndata: [DONE]\n\n".encode())

    monkeypatch.setattr(bs, "MODEL", "tiny")
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(answer), **kw))
    a = types.SimpleNamespace(seed=0, n=8, isl=64, osl=1, slo_ttft=1.0, slo_tpot=0.1)
    assert asyncio.run(bs._builtin("http://127.0.0.1:9", 1000.0, a)).n_ok == 8
    ids = [t for p in prompts for t in p]
    assert len(prompts) == 8 and len(ids) == 8 * 64 and get_model_spec("tiny").vocab == 256
    assert 1 <= min(ids) and max(ids) < 256


@pytest.mark.parametrize("out", ["table", "json"])
def test_bench_serve_with_one_output_token_runs_clean(out):
    """The benchmark end to end at its smallest (three one-token requests), numpy warnings as errors."""
    cmd = [sys.executable, "-W", "error::RuntimeWarning", str(ROOT / "benchmarks" / "bench_serve.py"),
           "--client", "builtin", "--osl", "1", "--n", "3", "--rates", "50", "--quick-calibration"]
    p = subprocess.run(cmd + (["--json"] if out == "json" else []), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "Warning" not in p.stderr, p.stderr[-3000:]
    if out == "json":
        def no_nan(c):
            raise AssertionError(f"{c} in JSON")

        doc = json.loads(p.stdout, parse_constant=no_nan)
        if hasattr(os, "sched_getaffinity"):     # the run's cores (server and client), not the server's one
            assert doc["machine"]["logical_cores"] == len(os.sched_getaffinity(0))
        row = doc["rows"][0]
        for side in ("measured", "predicted", "predicted_server_fit"):
            assert row[side]["tpot_median"] is None and row[side]["itl_median"] is None
            assert row[side]["ttft_median"] > 0
    else:
        for figure in ("TPOT p50 (ms)", "ITL p50 (ms)"):
            line = next(ln for ln in p.stdout.splitlines() if figure in ln)
            assert line.split()[-5:] == ["n/a", "n/a", "-", "n/a", "-"], line
        assert "nan" not in p.stdout



def _bench_args(**kw):
    import argparse

    return argparse.Namespace(**{"n": 3, "isl": 4, "osl": 3, "seed": 0, "slo_ttft": 1.0, "slo_tpot": 0.1,
                                 "max_bs": 4, "kv_slots": 4096, **kw})


def _fake_aiperf(tmp_path: Path, body: str) -> str:
    """An executable standing in for `aiperf`: `body` runs in Python with `out`, its --artifact-dir."""
    exe = tmp_path / "aiperf"
    exe.write_text(f"#!{sys.executable}\nimport json, os, subprocess, sys, time\nfrom pathlib import Path\n"
                   f"out = Path(sys.argv[sys.argv.index('--artifact-dir') + 1])\n{body}\n")
    exe.chmod(0o755)
    return str(exe)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie left for its new parent to reap counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_bench_serve_refuses_a_step_log_that_lost_the_run_s_first_steps(monkeypatch):
    # (the server answers from the oldest step it keeps: the steps priced were silently fewer than the
    # run's, and "busy s, priced on the server's steps" fell short of the busy time it is set beside)
    import types

    import httpx

    bs = _bench_serve()
    log = [[i, i * 0.01, i * 0.01 + 0.005, [[0, 1, 8]]] for i in (7, 8, 9)]
    pages = {i: {"steps": [s for s in log if s[0] >= i], "next": 10, "prompt_ends": [[] for s in log if s[0] >= i]}
             for i in range(11)}
    monkeypatch.setattr(httpx, "get", lambda url, params, **kw: types.SimpleNamespace(
        json=lambda: pages[params["since"]] if params["since"] < 10 else
        {"steps": [], "next": params["since"], "prompt_ends": []}))
    assert [s[0] for s in bs.fetch_steps("http://127.0.0.1:9", 7)] == [7, 8, 9]
    with pytest.raises(RuntimeError, match=re.escape("the server's step log no longer holds its iterations 5 to 6 "
                                                     "(it keeps its last 100,000)")):
        bs.fetch_steps("http://127.0.0.1:9", 5)


def test_bench_serve_splits_the_first_token_s_time_at_the_engine_s_clock():
    """The client's mean TTFT less the server's own (its TTFT histogram over the run) is the time outside
    the engine; the server's less the step that fed each prompt (one entry a request, a shared step once
    for each) is the engine's wait. A server that counted other first tokens is refused."""
    import types

    bs = _bench_serve()
    log = [[10, 1.0, 1.02, [[0, 4, 0]], [0]], [11, 1.02, 1.03, [[0, 1, 4]], []],
           [12, 1.03, 1.07, [[0, 1, 5], [1, 4, 0], [2, 4, 0]], [1, 2]], [13, 1.07, 1.08, [[1, 1, 4], [2, 1, 4]], []]]
    assert [s[0] for s in bs.prompt_steps(log)] == [10, 12, 12]
    m = types.SimpleNamespace(ttft_mean=0.05, n_ok=3)
    before = {bs.TTFT_METRIC + "_sum": 1.0, bs.TTFT_METRIC + "_count": 5}
    after = {bs.TTFT_METRIC + "_sum": 1.12, bs.TTFT_METRIC + "_count": 8}
    ft = bs.first_token(m, before, after, log)
    assert ft.client_s == 0.05 and ft.server_s == pytest.approx(0.04)
    assert ft.step_s == pytest.approx((0.02 + 0.04 + 0.04) / 3)
    assert ft.outside_s == pytest.approx(0.01) and ft.wait_s == pytest.approx(0.04 - 0.1 / 3)
    with pytest.raises(RuntimeError, match="the server counted 4 first tokens over the run, the client 3"):
        bs.first_token(m, before, dict(after, **{bs.TTFT_METRIC + "_count": 9}), log)


def test_bench_serve_takes_the_step_that_completed_a_chunked_prompt():
    """A prompt fed in chunks gets its first token from the step that fed its last chunk: that step is
    the one the first-token split prices, and the prompt is every chunk, not the first alone."""
    import types

    bs = _bench_serve()
    log = [[20, 2.0, 2.01, [[0, 3, 0]], []], [21, 2.01, 2.05, [[0, 2, 3], [1, 6, 0]], [0, 1]],
           [22, 2.05, 2.06, [[0, 1, 5], [1, 1, 6]], []], [23, 2.06, 2.07, [[0, 1, 6]], []]]
    assert [s[0] for s in bs.prompt_steps(log)] == [21, 21]
    assert bs.served_lengths(log) == [(5, 3), (6, 2)]
    m = types.SimpleNamespace(ttft_mean=0.08, n_ok=2)
    ft = bs.first_token(m, {bs.TTFT_METRIC + "_sum": 0.0, bs.TTFT_METRIC + "_count": 0},
                        {bs.TTFT_METRIC + "_sum": 0.12, bs.TTFT_METRIC + "_count": 2}, log)
    assert ft.step_s == pytest.approx(0.04) and ft.wait_s == pytest.approx(0.02)


def test_the_step_log_names_a_one_token_last_chunk_as_the_end_of_its_prompt(caplog):
    """Chunked prefill cuts a chunk to the token budget left: a 9-token prompt under a budget of 8 is
    fed 8 tokens, then 1, which by its tokens alone reads as a decode (the benchmark took the prompt
    for 8 tokens and the output for 4). The step log names the step that completed each prompt, and
    the benchmark reads it: the prompt is 9 tokens, the first token's step the one-token chunk."""
    bs = _bench_serve()
    caplog.set_level(logging.INFO, logger="orca_torch.serve")
    cfg = ServeConfig(model="tiny", port=0, max_bs=2, max_num_batched_tokens=8, chunked_prefill=True, log_steps=True)
    with serving(cfg) as (url, _, _):
        since = httpx.get(url + "/orca/steps").json()["next"]
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": list(range(4, 13)), "max_tokens": 3},
                       timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        page = httpx.get(url + "/orca/steps", params={"since": since}).json()
        log = bs.fetch_steps(url, since)
    (rid, _, _), = page["steps"][0][3]
    assert [s[3] for s in page["steps"]] == [[[rid, 8, 0]], [[rid, 1, 8]], [[rid, 1, 9]], [[rid, 1, 10]]]
    assert page["prompt_ends"] == [[], [rid], [], []]
    assert [s[0] for s in bs.prompt_steps(log)] == [page["steps"][1][0]]
    assert bs.served_lengths(log) == [(9, 3)]
    said = [m for m in caplog.messages if m.startswith("step ")]
    assert [m.split()[-1] for m in said[-4:]] == [f"{rid}:prefill(8+0)", f"{rid}:chunk(1+8)", f"{rid}:decode(1+9)",
                                                  f"{rid}:decode(1+10)"]


def test_bench_serve_takes_throughput_and_goodput_over_the_first_request_to_the_last_response(tmp_path):
    """As the replay does (its arrivals start at the first request): AIPerf's own figures divide by
    its phase, which begins one Poisson gap earlier, and count a request without a TPOT as missed."""
    bs = _bench_serve()
    recs = [(1.0, 50.0, 5.0, 3), (1.5, 2000.0, 5.0, 3), (2.0, 10.0, None, 1)]   # start s, TTFT ms, TPOT ms, osl
    lines = [{"metadata": {"request_start_ns": int(t * 1e9), "benchmark_phase": "profiling"},
              "metrics": {"time_to_first_token": {"value": ttft}, "input_sequence_length": {"value": 4},
                          "output_sequence_length": {"value": osl},
                          **({} if tpot is None else {"inter_token_latency": {"value": tpot}})}}
             for t, ttft, tpot, osl in recs]
    summary = {"aiperf_version": "fake", "time_to_first_token": {"p50": 50.0}, "inter_token_latency": {"p50": 5.0},
               "inter_chunk_latency": {"p50": 5.0}, "benchmark_duration": {"avg": 2.0},
               "output_token_throughput": {"avg": 7 / 2.5}, "goodput": {"avg": 1 / 2.5}}
    aiperf = _fake_aiperf(tmp_path, f"out.mkdir(parents=True)\n(out / 'profile_export_aiperf.json').write_text("
                                    f"{json.dumps(json.dumps(summary))})\n(out / 'profile_export.jsonl').write_text("
                                    f"{json.dumps(''.join(json.dumps(r) + chr(10) for r in lines))})")
    m = bs.run_aiperf(aiperf, "http://127.0.0.1:1", tmp_path, 1.0, _bench_args(), tmp_path / "r0")
    assert m.throughput_tok_s == 7 / 2.0 and m.goodput_req_s == 2 / 2.0
    assert m.arrivals == [0.0, 0.5, 1.0] and m.output_lens == [3, 3, 1] and m.n_ok == 3
    assert not (tmp_path / "r0").exists()                        # its files, once read


def test_bench_serve_says_why_aiperf_failed_and_keeps_its_files(tmp_path):
    # (the message ended in AIPerf's "Log File:" line, naming a temporary folder removed by then, and said
    # neither which request failed, nor how, nor what to do)
    bs = _bench_serve()
    refused = {"metadata": {"request_start_ns": 0, "benchmark_phase": "profiling"},
               "metrics": {"error_isl": {"value": 4}},
               "error": {"type": "ClientConnectorError", "message": "Connect call failed ('127.0.0.1', 9)"}}
    aiperf = _fake_aiperf(tmp_path, f"out.mkdir(parents=True)\n(out / 'profile_export.jsonl').write_text("
                                    f"{json.dumps(json.dumps(refused) + chr(10))})\n"
                                    f"print('Log File:', out / 'logs' / 'aiperf.log')\nsys.exit(1)")
    with bs.aiperf_folder() as files:
        with pytest.raises(RuntimeError) as e:
            bs.run_aiperf(aiperf, "http://127.0.0.1:1", tmp_path, 1.0, _bench_args(), files / "r0")
    try:
        assert (files / "r0" / "profile_export.jsonl").exists()
        assert str(e.value) == ("aiperf failed (exit status 1); its first failed request: ClientConnectorError "
                                f"Connect call failed ('127.0.0.1', 9); its output ends:\nLog File: {files}/r0/logs/"
                                "aiperf.log\nAIPerf's files, its log (logs/aiperf.log) and records "
                                f"(profile_export.jsonl), are kept in {files}/r0; --client builtin measures without "
                                "AIPerf")
    finally:
        shutil.rmtree(files)
    with bs.aiperf_folder() as files:                            # (nothing kept: nothing left)
        pass
    assert not files.exists()


def test_bench_serve_says_when_aiperf_recorded_failed_requests(tmp_path):
    # (AIPerf exits 0 when only some requests failed; their records have no TTFT: a KeyError)
    bs = _bench_serve()
    ok = {"metadata": {"request_start_ns": 0, "benchmark_phase": "profiling"},
          "metrics": {"time_to_first_token": {"value": 5.0}, "input_sequence_length": {"value": 4},
                      "output_sequence_length": {"value": 3}}}
    bad = {"metadata": {"request_start_ns": 1, "benchmark_phase": "profiling"}, "metrics": {"error_isl": {"value": 4}},
           "error": {"code": 500, "type": "Internal Server Error", "message": "the engine failed: boom"}}
    summary = {"time_to_first_token": {"p50": 5.0}, "benchmark_duration": {"avg": 1.0},
               "output_token_throughput": {"avg": 3.0}}
    aiperf = _fake_aiperf(tmp_path, f"out.mkdir(parents=True)\n(out / 'profile_export_aiperf.json').write_text("
                                    f"{json.dumps(json.dumps(summary))})\n(out / 'profile_export.jsonl').write_text("
                                    f"{json.dumps(''.join(json.dumps(r) + chr(10) for r in (ok, bad)))})")
    with pytest.raises(RuntimeError, match="AIPerf recorded 1 of 2 requests as failed; the first: 500 the engine failed"):
        bs.run_aiperf(aiperf, "http://127.0.0.1:1", tmp_path, 1.0, _bench_args(), tmp_path / "r0")


def test_bench_serve_says_in_one_line_when_its_server_dies_during_the_run(monkeypatch, capsys):
    # (the client's ConnectError came out as a traceback, and the server's log, which says why, was lost)
    import tempfile
    import types

    import torch

    import orca_torch.lab.calibrate

    bs = _bench_serve()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('out of memory in step 7')"], stderr=log)
    proc.log = log
    proc.wait(TIMEOUT)
    monkeypatch.setattr(bs, "start_server", lambda a: (proc, "http://127.0.0.1:9"))    # (nothing listens on 9)
    monkeypatch.setattr(orca_torch.lab.calibrate, "calibrate", lambda *a, **kw: None)
    monkeypatch.setattr(bs, "SERVER_CPUS", [])
    monkeypatch.setattr(bs, "CLIENT_CPUS", [])
    monkeypatch.setattr(bs, "signal", types.SimpleNamespace(SIGTERM=signal.SIGTERM, signal=lambda *a: None,
                                                            strsignal=signal.strsignal))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    assert bs.cli(["--client", "builtin"]) == 1
    last = capsys.readouterr().err.split("bench_serve.py: ")[-1]        # (after its progress lines)
    assert re.fullmatch(r"the server exited with code 1; its log ends:\nout of memory in step 7\n"
                        r"\(the client saw ConnectError: .*\)\n", last), last


_AIPERF_RECORD = {"metadata": {"request_start_ns": 0, "benchmark_phase": "profiling"},
                  "metrics": {"time_to_first_token": {"value": 5.0}, "input_sequence_length": {"value": 4},
                              "output_sequence_length": {"value": 3}}}


@pytest.mark.parametrize("body, says", [
    ("", "(FileNotFoundError: [Errno 2] No such file or directory: "),                  # it wrote nothing
    ("(out / 'profile_export_aiperf.json').write_text('{}')\n(out / 'profile_export.jsonl').write_text("
     f"{json.dumps((json.dumps(_AIPERF_RECORD) + chr(10)) * 3)})",
     "(KeyError: 'benchmark_duration')"),                                          # another version's fields
])
def test_bench_serve_says_when_aiperf_s_results_cannot_be_read(body, says, tmp_path):
    # (a missing file or field came out as a traceback, the server left to the benchmark's cleanup)
    bs = _bench_serve()
    aiperf = _fake_aiperf(tmp_path, f"out.mkdir(parents=True)\n{body}")
    with pytest.raises(RuntimeError, match=r"^aiperf exited 0, but its results could not be read ") as e:
        bs.run_aiperf(aiperf, "http://127.0.0.1:1", tmp_path, 1.0, _bench_args(), tmp_path / "r0")
    assert says in str(e.value) and "profile_export.jsonl of AIPerf 0.13" in str(e.value)
    assert f"kept in {tmp_path / 'r0'}; --client builtin measures without AIPerf" in str(e.value)


def test_bench_serve_says_when_aiperf_recorded_fewer_requests_than_asked(tmp_path):
    bs = _bench_serve()
    one = json.dumps(json.dumps(_AIPERF_RECORD))
    aiperf = _fake_aiperf(tmp_path, "out.mkdir(parents=True)\n(out / 'profile_export_aiperf.json').write_text('{}')\n"
                                    f"(out / 'profile_export.jsonl').write_text({one})")
    with pytest.raises(RuntimeError, match=r"^AIPerf recorded 1 requests, not the 3 it was asked for\n"):
        bs.run_aiperf(aiperf, "http://127.0.0.1:1", tmp_path, 1.0, _bench_args(), tmp_path / "r0")


def test_bench_serve_bounds_an_aiperf_run_by_its_arrivals_span(tmp_path, monkeypatch):
    # (a fixed 1800 s, under the hour of arrivals --rates and --n may ask for, then a TimeoutExpired traceback)
    bs = _bench_serve()
    pid_file = tmp_path / "aiperf.pid"
    aiperf = _fake_aiperf(tmp_path, f"Path({str(pid_file)!r}).write_text(str(os.getpid()))\ntime.sleep(3600)")
    monkeypatch.setattr(bs, "AIPERF_SLACK_S", 0.5)
    with pytest.raises(RuntimeError, match=re.escape("aiperf had not finished after 1 s (3 requests at 10 req/s "
                                                     "arrive over about 0.3 s), and was stopped\n")):
        bs.run_aiperf(aiperf, "http://127.0.0.1:1", tmp_path, 10.0, _bench_args(), tmp_path / "r0")
    assert _gone(int(pid_file.read_text()))


def test_an_interrupted_aiperf_run_leaves_none_of_its_processes(tmp_path):
    """AIPerf's worker processes wait forever once it is killed: a Ctrl-C during its run ends them too."""
    bs = _bench_serve()
    pid_file = tmp_path / "worker.pid"
    aiperf = _fake_aiperf(tmp_path, f"w = subprocess.Popen(['sleep', '3600'])\nPath({str(pid_file)!r}).write_text("
                                    f"str(w.pid))\ntime.sleep(60)")

    def ctrl_c(*_):
        if not pid_file.exists() or not pid_file.read_text():
            signal.setitimer(signal.ITIMER_REAL, 0.1)       # (the worker is not started yet)
            return
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGALRM, ctrl_c)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            bs.run_aiperf(aiperf, "http://127.0.0.1:1", tmp_path, 1.0, _bench_args(), tmp_path / "r0")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    worker = int(pid_file.read_text())
    try:
        deadline = time.time() + TIMEOUT
        while not _gone(worker) and time.time() < deadline:
            time.sleep(0.05)
        assert _gone(worker)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.parametrize("log, health", [
    ("loading the weights ...", "it printed no banner naming its address"),
    ("orca-torch serving mini on http://127.0.0.1:9 (tokenizer x)", "its /health answered 503")])
def test_a_benchmark_server_that_does_not_start_is_stopped_and_its_log_said(log, health, tmp_path, monkeypatch):
    # (the message said only "did not start within 120 s"; a /health answering other than 200 was asked
    # again at once, without a pause, until then)
    import types

    import httpx

    bs = _bench_serve()
    exe = tmp_path / "server"
    exe.write_text(f"#!/bin/sh\necho '{log}' >&2\nexec sleep 3600\n")
    exe.chmod(0o755)
    asked = []
    monkeypatch.setattr(httpx, "get", lambda *a, **kw: asked.append(a) or types.SimpleNamespace(status_code=503))
    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            started.append(self)

    monkeypatch.setattr(bs.subprocess, "Popen", Recorded)
    monkeypatch.setattr(bs, "sys", types.SimpleNamespace(executable=str(exe)))
    monkeypatch.setattr(bs, "SERVER_START_S", 0.5)
    try:
        with pytest.raises(RuntimeError) as e:
            bs.start_server(_bench_args())
        assert str(e.value) == f"the server did not start within 0.5 s ({health}), and was stopped; its log ends:\n{log}"
        assert len(started) == 1 and started[0].poll() is not None
        assert len(asked) <= 5                                  # (a pause between two polls, at 503 too)
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_an_interrupt_while_the_benchmark_s_server_starts_stops_it(monkeypatch):
    """A Ctrl-C (or the benchmark's SIGTERM, a SystemExit) before the server answers: it is not left running."""
    import types

    bs = _bench_serve()
    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            started.append(self)

    def ctrl_c(_):
        raise KeyboardInterrupt

    monkeypatch.setattr(bs.subprocess, "Popen", Recorded)
    monkeypatch.setattr(bs, "time", types.SimpleNamespace(time=time.time, sleep=ctrl_c))
    try:
        with pytest.raises(KeyboardInterrupt):
            bs.start_server(_bench_args())
        assert len(started) == 1 and started[0].poll() is not None
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()

def test_when_the_engine_thread_ends_for_good_no_stream_waits_on_it():
    """A step fails, and starting afresh fails too: the thread ends. The streams it held end with
    the failure, one submitted during the failing step (still in the inbox) with "the engine
    thread has stopped", and a later request is refused rather than queued for nobody."""
    from orca_torch.serve.live import ShuttingDown
    from orca_torch.serve.server import build

    live, _ = build(ServeConfig(model="tiny"))
    ex, eng = live.engine.executor, live.engine
    in_step, go_on = threading.Event(), threading.Event()

    def fail(batch):
        in_step.set()
        go_on.wait(TIMEOUT)
        raise RuntimeError("injected")

    def no_fresh_start():
        raise RuntimeError("injected at the fresh start")

    async def run():
        ex.execute = fail
        first = [live.submit(live.new_request([1, 2, 3], 5)) for _ in range(2)]
        assert await asyncio.to_thread(in_step.wait, TIMEOUT)
        eng.start_live = no_fresh_start
        late = live.submit(live.new_request([1, 2, 3], 5))      # the inbox, during the failing step
        go_on.set()
        ends = []
        for s in [*first, late]:
            ev = await asyncio.wait_for(s.queue.get(), TIMEOUT)
            while ev.finish_reason is None:
                ev = await asyncio.wait_for(s.queue.get(), TIMEOUT)
            ends.append(ev.error)
        await asyncio.to_thread(live.thread.join, TIMEOUT)
        with pytest.raises(ShuttingDown, match="the engine thread has stopped"):
            live.submit(live.new_request([1, 2, 3], 5))
        return ends

    try:
        ends = asyncio.run(run())
        assert ends[:2] == ["the engine failed: injected"] * 2 and ends[2] == "the engine thread has stopped"
        assert not live.thread.is_alive() and not live.serving
        assert live.metrics.finished == {"length": 0, "stop": 0, "abort": 3}     # (the one in the inbox too)
    finally:
        live.stop()


@pytest.mark.parametrize("leave", [False, True], ids=["all_stay", "some_leave"])
def test_clients_with_stop_strings_are_each_counted_once_and_their_tokens_add_up(leave, monkeypatch):
    """30 clients at once on paged memory (preemptions), most with stop strings (found at a token a
    seeded RNG draws, or nowhere), some with `min_tokens`, streaming or not; each handler's word (the
    end it found, or that its client left) is held until the engine has made up to 3 more tokens
    for it (a departed client's, for half of them, until the engine has ended its request), so the
    engine often ends a request before that word lands. `request_success_total`
    counts each request the engine took in once; `e2e_request_latency_seconds` has one latency
    for each counted as ended by length or stop; each client that stays gets the answer `stop`
    defines. With none leaving: the counts by reason are the answers' finish reasons,
    `generation_tokens_total` grows by the sum of their `usage.completion_tokens` and
    `inter_token_latency_seconds` by that less one per request."""
    rng = np.random.default_rng(7 + leave)
    prompts = [[7, 8, 9], [3, 1, 4, 1, 5], [20, 21]]
    with serving(ServeConfig(model="tiny", port=0, memory="paged", kv_slots=512, max_bs=8)) as (url, live, _):
        refs = [_token_texts(url, "/v1/completions", {"prompt": p, "max_tokens": 30})[0] for p in prompts]
        plans = []
        for _ in range(30):
            pi, m = int(rng.integers(0, len(prompts))), int(rng.integers(1, 31))
            kind = str(rng.choice(["none", "absent", "at"], p=[0.2, 0.2, 0.6]))
            stop = {"none": None, "absent": ["qqzz"], "at": [refs[pi][int(rng.integers(0, m))].strip()]}[kind]
            plans.append((pi, m, stop, int(rng.integers(0, 4)) if rng.random() < 0.3 else 0, bool(rng.random() < 0.5),
                          leave and bool(rng.random() < 0.5), int(rng.integers(0, 4))))
        real = live.abort

        def held(stream):                               # (in the server's event loop: every handler waits)
            deadline, more = time.time() + 5, stream.req.req_id % 4
            if stream.req.req_id % 2:
                more = 10 ** 6                          # (a client gone: half held until the engine ends it)
            at = stream.req.n_generated
            while (stream.req.n_generated < at + more and stream.req.status in (Status.WAITING, Status.RUNNING)
                   and time.time() < deadline):
                time.sleep(0.002)
            real(stream)

        monkeypatch.setattr(live, "abort", held)
        _settled(live)
        before, reached = _figures(url), len(live.requests)

        async def client(c, pi, m, stop, min_tokens, stream, leaves, k):
            body = {"prompt": prompts[pi], "max_tokens": m, "min_tokens": min(min_tokens, m), "stream": stream}
            if stop is not None:
                body["stop"] = stop
            if stream:
                body["stream_options"] = {"include_usage": True}
                events = await stream_or_leave(c, url, body, k if leaves else None)
                if events is None:
                    return None
                chunks = [e["choices"][0] for e in events[:-2]]
                got = ("".join(ch["text"] for ch in chunks), events[-2]["usage"]["completion_tokens"],
                       chunks[-1]["finish_reason"])
            elif not leaves:
                r = await c.post(url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                out = r.json()
                got = out["choices"][0]["text"], out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]
            else:
                await post_and_leave(url, body, k)
                return None
            assert got == _stopped(refs[pi][:m], stop or [], min(min_tokens, m)), (pi, m, stop, min_tokens)
            return got

        async def go():
            async with httpx.AsyncClient(timeout=TIMEOUT) as c:
                return await asyncio.gather(*[client(c, *plan) for plan in plans])

        answers = asyncio.run(asyncio.wait_for(go(), 2 * TIMEOUT))
        _settled(live)
        n = len(live.requests) - reached
        deadline = time.time() + TIMEOUT
        while True:                                     # until every request that left has been counted
            d = {key: v - before[key] for key, v in _figures(url).items()}
            ended = {k: d[("vllm:request_success_total", k)] for k in ("length", "stop", "abort")}
            if sum(ended.values()) >= n or time.time() > deadline:
                break
            time.sleep(0.02)
    stayed = [a for a in answers if a is not None]
    assert sum(ended.values()) == n
    assert d[("vllm:e2e_request_latency_seconds_count", None)] == ended["length"] + ended["stop"]
    assert ended["length"] + ended["stop"] >= len(stayed) and d[("vllm:generation_tokens_total", None)] >= sum(
        a[1] for a in stayed)
    if not leave:
        assert ended == {"length": sum(a[2] == "length" for a in stayed), "stop": sum(a[2] == "stop" for a in stayed),
                         "abort": 0}
        assert d[("vllm:generation_tokens_total", None)] == sum(a[1] for a in stayed)
        assert d[("vllm:inter_token_latency_seconds_count", None)] == sum(a[1] - 1 for a in stayed)


def _figures(url: str) -> dict:
    """/metrics' counters and histograms' counts, by (sample name, finish reason or None)."""
    fams = parse_prometheus(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
    return {(name, labels.get("finished_reason")): v for kind, samples in fams.values() if kind != "gauge"
            for name, labels, v in samples if kind == "counter" or name.endswith("_count")}


def test_bench_serve_refuses_to_replay_lengths_the_server_did_not_serve(tmp_path):
    """The replay on the paper GPU takes AIPerf's token counts (its own tokenizer's): where they are not
    what the server's step log shows it served, the prediction would be of another run."""
    bs = _bench_serve()
    lines = [{"metadata": {"request_start_ns": int(t * 1e9), "benchmark_phase": "profiling"},
              "metrics": {"time_to_first_token": {"value": 50.0}, "input_sequence_length": {"value": 4},
                          "output_sequence_length": {"value": osl}, "inter_token_latency": {"value": 5.0}}}
             for t, osl in ((1.0, 3), (1.5, 3), (2.0, 2))]
    summary = {"aiperf_version": "fake", "time_to_first_token": {"p50": 50.0}, "inter_token_latency": {"p50": 5.0},
               "inter_chunk_latency": {"p50": 5.0}, "benchmark_duration": {"avg": 2.0},
               "output_token_throughput": {"avg": 4.0}, "goodput": {"avg": 1.0}}
    aiperf = _fake_aiperf(tmp_path, f"out.mkdir(parents=True)\n(out / 'profile_export_aiperf.json').write_text("
                                    f"{json.dumps(json.dumps(summary))})\n(out / 'profile_export.jsonl').write_text("
                                    f"{json.dumps(''.join(json.dumps(r) + chr(10) for r in lines))})")
    m = bs.run_aiperf(aiperf, "http://127.0.0.1:1", tmp_path, 1.0, _bench_args(), tmp_path / "r0")

    def log(outputs):                   # each request's prefill of 4 tokens, then its decodes, one a step
        return [[0, 0.0, 0.1, [["a", 4, 0], ["b", 4, 0], ["c", 4, 0]], ["a", "b", "c"]]] + [
            [k, 0.1 * k, 0.1 * k + 0.1, [[rid, 1, 3 + k] for rid, o in zip("abc", outputs) if k < o], []]
            for k in (1, 2)]
    assert bs.served_lengths(log((3, 2, 3))) == [(4, 2), (4, 3), (4, 3)]
    bs.check_replayable(m, log((3, 2, 3)))                       # the same lengths, in another order
    with pytest.raises(RuntimeError, match=re.escape(
            "AIPerf fake recorded (prompt, output) tokens that differ from the server's in 1 of 3 requests (in order "
            "of length, the first: (4, 2) against (4, 3)): a replay of its lengths would not be the run the server "
            "served, so no prediction is printed")):
        bs.check_replayable(m, log((3, 3, 3)))
    with pytest.raises(RuntimeError, match=r"^AIPerf fake recorded 3 requests, and the server's step log 2: "):
        bs.check_replayable(m, [[0, 0.0, 0.1, [["a", 4, 0], ["b", 4, 0]], ["a", "b"]]])


def _logprob_answers(url: str, path: str, body: dict) -> tuple[dict, list]:
    """A whole answer, and the `logprobs` of its stream's chunks (the role chunk aside)."""
    r = httpx.post(url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=TIMEOUT) as s:
        assert s.status_code == 200, s.read()
        events = sse_events(s.iter_lines())
    chunks = [e["choices"][0] for e in events[:-1]]
    return r.json(), [c["logprobs"] for c in chunks if "role" not in c.get("delta", {})]


def test_completion_logprobs_are_the_model_s_own_and_the_stream_s_chunks_make_up_the_whole(server):
    """`logprobs: k` on /v1/completions: each token's text and log probability (the log-softmax of the
    model's logits for the prompt and the tokens before it, run alone), its k most likely tokens (the
    greedy token the first) and its text's offset; each streamed chunk holds its own token's, which
    together are the whole answer's; the text is the one asked for without logprobs."""
    url, live, _ = server
    body = {"prompt": "ka bemo", "max_tokens": 12, "logprobs": 5}
    whole, chunks = _logprob_answers(url, "/v1/completions", body)
    c = whole["choices"][0]
    assert c["text"] == _whole(url, "/v1/completions", {**body, "logprobs": None})[0]
    lp = c["logprobs"]
    rid = whole["id"]
    req = next(r for r in live.requests if f"-{r.req_id}" == rid[rid.rindex("-"):])
    ref = raw_logprobs(req.prompt_ids, req.output_ids, live.engine.executor.model)
    from orca_torch.serve.tokenizer import PresetTokenizer

    tok = PresetTokenizer("tiny")
    assert [tok.encode(t) for t in lp["tokens"]] == [[t] for t in req.output_ids]
    assert "".join(lp["tokens"]) == c["text"]
    assert lp["token_logprobs"] == pytest.approx([float(ref[i, t]) for i, t in enumerate(req.output_ids)], abs=1e-4)
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(12)]
    for i, (t, top) in enumerate(zip(lp["tokens"], lp["top_logprobs"])):
        assert len(top) == 5 and next(iter(top)) == t and top[t] == lp["token_logprobs"][i]
        assert list(top.values()) == pytest.approx(ref[i].topk(5).values.tolist(), abs=1e-4)
    assert all(len(ch["tokens"]) == 1 for ch in chunks[:-1])
    assert {k: [x for ch in chunks for x in ch[k]] for k in lp} == lp
    sampled = {"prompt": "ka bemo", "max_tokens": 12, "temperature": 1, "seed": 7}
    with_lp, _ = _logprob_answers(url, "/v1/completions", {**sampled, "logprobs": 0})
    assert with_lp["choices"][0]["text"] == _whole(url, "/v1/completions", sampled)[0]
    assert all(len(top) == 1 for top in with_lp["choices"][0]["logprobs"]["top_logprobs"])


def test_chat_logprobs_are_the_model_s_own_and_the_stream_s_chunks_make_up_the_whole(server):
    """`logprobs: true` with `top_logprobs: k` on /v1/chat/completions: `content`, each token's text,
    log probability (the model's own), UTF-8 bytes and k most likely tokens, the greedy token the
    first; each streamed chunk holds its token's, which together are the whole answer's; a seeded
    sampled answer is the one it is without logprobs."""
    url, live, _ = server
    body = {"messages": [{"role": "user", "content": "ka bemo"}], "max_tokens": 10, "logprobs": True,
            "top_logprobs": 3}
    whole, chunks = _logprob_answers(url, "/v1/chat/completions", body)
    c = whole["choices"][0]
    content = c["logprobs"]["content"]
    rid = whole["id"]
    req = next(r for r in live.requests if f"-{r.req_id}" == rid[rid.rindex("-"):])
    ref = raw_logprobs(req.prompt_ids, req.output_ids, live.engine.executor.model)
    assert "".join(e["token"] for e in content) == c["message"]["content"]
    for i, (e, t) in enumerate(zip(content, req.output_ids, strict=True)):
        assert e["logprob"] == pytest.approx(float(ref[i, t]), abs=1e-4) and e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0] == {k: e[k] for k in ("token", "logprob", "bytes")}
    assert [e for ch in chunks for e in ch["content"]] == content
    own = _whole(url, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": None})
    assert own[0] == c["message"]["content"]
    sampled = {**body, "temperature": 0.8, "seed": 3}
    assert (_logprob_answers(url, "/v1/chat/completions", sampled)[0]["choices"][0]["message"]["content"]
            == _whole(url, "/v1/chat/completions", {**sampled, "logprobs": False, "top_logprobs": 0})[0])
    plain = httpx.post(url + "/v1/chat/completions", json={**body, "logprobs": None, "top_logprobs": None},
                       timeout=TIMEOUT).json()
    assert plain["choices"][0]["logprobs"] is None


def _choices_whole_and_streamed(url: str, path: str, body: dict) -> tuple[dict, list]:
    """`body`'s whole answer, and its stream's events (usage asked for)."""
    whole = httpx.post(url + path, json=body, timeout=TIMEOUT)
    assert whole.status_code == 200, whole.text
    with httpx.stream("POST", url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    return whole.json(), events


def _choice_text(kind: str, c: dict) -> str:
    return c["text"] if kind == "completions" else c["message"]["content"]


def _logprob_values(lp: dict) -> list[float]:
    """A choice's log probabilities in order: each token's, then its most likely tokens' (within
    1e-4 of those the same tokens get in another batch)."""
    if "content" in lp:
        return [v for e in lp["content"] for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]
    return [*lp["token_logprobs"], *(v for top in lp["top_logprobs"] for v in top.values())]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_seeded_choices_differ_each_is_the_request_seeded_seed_plus_index_and_the_stream_is_the_whole(server,
                                                                                                         path):
    """`n: 3` with a seed: three choices, index 0 to 2 in order, each the answer of a one-choice
    request seeded seed + index (vLLM's rule), its logprobs its own, and not all alike; the stream's
    chunks, each naming its choice, gathered by index are the whole answer's (text, logprobs and
    finish), a chat stream gives each choice its role chunk first, and one [DONE] ends it after
    every choice. usage counts the prompt once and the tokens of every choice."""
    url, _, _ = server
    kind = "completions" if path == "/v1/completions" else "chat"
    base = ({"prompt": "ka bemo", "logprobs": 1} if kind == "completions" else
            {"messages": [{"role": "user", "content": "ka bemo"}], "logprobs": True, "top_logprobs": 1})
    body = {**base, "max_tokens": 6, "temperature": 1, "seed": 11, "n": 3}
    whole, events = _choices_whole_and_streamed(url, path, body)
    choices = whole["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    texts = [_choice_text(kind, c) for c in choices]
    assert len(set(texts)) > 1, texts
    for i, c in enumerate(choices):
        one = httpx.post(url + path, json={**body, "n": None, "seed": 11 + i}, timeout=TIMEOUT).json()
        alone = one["choices"][0]
        assert _choice_text(kind, c) == _choice_text(kind, alone) and c["finish_reason"] == alone["finish_reason"]
        assert _logprob_values(c["logprobs"]) == pytest.approx(_logprob_values(alone["logprobs"]), abs=1e-4)
    p = one["usage"]["prompt_tokens"]
    assert whole["usage"] == {"prompt_tokens": p, "completion_tokens": 18, "total_tokens": p + 18}
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    chunks = events[:-2]
    assert all(len(e["choices"]) == 1 and e["id"] == chunks[0]["id"] for e in chunks)
    if kind == "chat":
        assert [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in chunks[:3]] == [
            (i, {"role": "assistant", "content": ""}) for i in range(3)]
        chunks = chunks[3:]
    for i, c in enumerate(choices):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == i]
        if kind == "completions":
            assert "".join(m["text"] for m in mine) == c["text"]
            assert {k: [x for m in mine for x in m["logprobs"][k]] for k in c["logprobs"]} == c["logprobs"]
        else:
            assert "".join(m["delta"].get("content", "") for m in mine) == c["message"]["content"]
            assert [x for m in mine for x in m["logprobs"]["content"]] == c["logprobs"]["content"]
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + [c["finish_reason"]]
    assert {e["choices"][0]["index"] for e in chunks[:-1]} == {0, 1, 2}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_greedy_n_gives_identical_choices_and_usage_sums_them(server, path):
    """Greedy decoding (temperature 0) with `n: 2` gives two identical choices (as OpenAI's API
    may), each the one-choice answer; usage counts the prompt once and both choices' tokens."""
    url, _, _ = server
    kind = "completions" if path == "/v1/completions" else "chat"
    base = {"prompt": "ka"} if kind == "completions" else {"messages": [{"role": "user", "content": "ka"}]}
    body = {**base, "max_tokens": 5, "n": 2}
    whole, events = _choices_whole_and_streamed(url, path, body)
    one = httpx.post(url + path, json={**base, "max_tokens": 5}, timeout=TIMEOUT).json()
    assert [{**c, "index": 0} for c in whole["choices"]] == one["choices"] * 2
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    p = one["usage"]["prompt_tokens"]
    assert whole["usage"] == {"prompt_tokens": p, "completion_tokens": 10, "total_tokens": p + 10}
    assert events[-2]["usage"] == whole["usage"] and events[-1] == "[DONE]"


def test_metrics_count_an_n_choice_request_s_prompt_once_as_its_usage_does(server):
    """`n: 3`, asked whole and streamed: /metrics' `vllm:prompt_tokens_total` grows by each
    answer's prompt once, its `usage.prompt_tokens`, while its generated tokens and finishes are
    each choice's (3 x 4 tokens, 3 ended by length, twice)."""
    url, live, _ = server
    _settled(live)
    counter = "vllm:prompt_tokens_total"
    before = parse_prometheus(httpx.get(url + "/metrics", timeout=TIMEOUT).text)[counter][1][0][2]
    ended = _ended_and_generated(url)
    body = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 4, "n": 3, "ignore_eos": True}
    whole, events = _choices_whole_and_streamed(url, "/v1/completions", body)
    _settled(live)
    finished, generated = _counted_since(url, ended, 6)
    after = parse_prometheus(httpx.get(url + "/metrics", timeout=TIMEOUT).text)[counter][1][0][2]
    assert whole["usage"]["prompt_tokens"] == events[-2]["usage"]["prompt_tokens"] == 5
    assert after - before == 2 * 5
    assert finished["length"] == 2 * 3 and generated == 2 * 12


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_aborts_every_one_of_its_n_choices(server, monkeypatch, stream):
    """A client of `n: 3` gone after sending its body: its three requests are dropped together (one
    abort naming all three), none runs to its max_tokens, and the memory manager and the K/V
    manager are back at zero. The engine's steps wait until the abort has been asked for."""
    _, live, app = server
    eng = live.engine
    _settled(live)
    asked, left = [], threading.Event()
    abort, step = live.abort, eng.step
    monkeypatch.setattr(live, "abort", lambda *streams: (asked.append(len(streams)), abort(*streams), left.set()))
    monkeypatch.setattr(eng, "step", lambda: (left.wait(TIMEOUT), step())[1])
    body = json.dumps({"prompt": [4, 5], "max_tokens": 300, "n": 3, "stream": stream}).encode()
    before = len(live.requests)
    _post_and_leave(app, body)
    assert left.wait(TIMEOUT) and asked == [3]
    _settled(live)
    mine = list(live.requests)[before:]
    assert len(mine) == 3 and all(r.status is Status.ABORTED and r.n_generated < 300 for r in mine)
    assert live.n_running == 0 and live.n_waiting == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_choice_whose_text_fails_ends_the_whole_answer_with_its_error_once(server, monkeypatch, stream):
    """Of `n: 3`, the second choice's tokenizer raises at its second token: the answer ends with
    that error, once (a stream: one error chunk and one `[DONE]`; a whole answer: a 500), and the
    other two choices are dropped, not run to their 300 tokens; the memory comes back. Once it has
    failed, the engine's steps wait until the others' abort has been asked for."""
    from orca_torch.serve.tokenizer import WordDetokenizer
    url, live, app = server
    tok = app.state.server.tok
    made, failed, asked = [], threading.Event(), threading.Event()

    class FailsSecond(WordDetokenizer):
        def __init__(self, words) -> None:
            super().__init__(words)
            self.fails, self.n = len(made) == 1, 0
            made.append(self)

        def add(self, ids, final: bool = False) -> str:
            self.n += len(ids)
            if self.fails and self.n >= 2:
                failed.set()
                raise RuntimeError("decode failed")
            return super().add(ids, final)

    monkeypatch.setattr(tok, "detokenizer", lambda after=(): FailsSecond(tok.words))
    abort, step = live.abort, live.engine.step
    monkeypatch.setattr(live, "abort", lambda *streams: (abort(*streams), asked.set()))
    monkeypatch.setattr(live.engine, "step", lambda: (failed.is_set() and asked.wait(TIMEOUT), step())[1])
    _settled(live)
    before = len(live.requests)
    body = {"prompt": "ka", "max_tokens": 300, "n": 3, "stream": stream, "ignore_eos": True}
    says = "the answer's text could not be made (RuntimeError: decode failed)"
    if stream:
        with httpx.stream("POST", url + "/v1/completions", timeout=TIMEOUT, json=body) as r:
            events = sse_events(list(r.iter_lines()))
        assert r.status_code == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
        errors = [e["error"] for e in events[:-1] if "error" in e]
        assert errors == [events[-2]["error"]] and all("choices" in e for e in events[:-2])
        error = errors[0]
    else:
        r = httpx.post(url + "/v1/completions", timeout=TIMEOUT, json=body)
        assert r.status_code == 500
        error = r.json()["error"]
    assert error == {"message": says, "type": "server_error", "param": None, "code": None}
    _settled(live)
    mine = list(live.requests)[before:]
    assert len(mine) == 3 and all(r.status is Status.ABORTED and r.n_generated < 300 for r in mine)


def test_the_step_log_names_a_work_by_where_it_stands_in_its_request_not_by_its_tokens():
    """A chunk cut to one token by the budget, in the middle of a 9-token prompt or at its end, is a
    chunk of the prompt, not a decode: the --log-steps label is told by the work's place against its
    prompt and whether it catches the request up. A decode feeds one token past the prompt, catching
    up; a recompute past it, several at once or one that stops short, is a chunk."""
    from orca_torch.core.request import Request
    from orca_torch.serve.live import work_kind
    req = Request("a", 0.0, 9, 4)
    works = ((7, 0, False), (1, 7, False), (1, 8, True), (1, 9, True), (1, 10, True), (3, 9, True), (1, 10, False))
    assert [work_kind(req, n, p, caught_up) for n, p, caught_up in works] == \
        ["prefill", "chunk", "chunk", "decode", "decode", "chunk", "chunk"]


def test_the_step_log_names_a_one_token_chunk_of_a_recompute_a_chunk_and_the_token_that_catches_it_up_a_decode(
        caplog):
    """A preempted request is fed its prompt and the tokens it made again (a recompute). Fed one
    token a step (a policy of one's own), each token past its prompt read as a decode in --log-steps,
    though all but the last are tokens fed before: the label went by the work's place against the
    prompt alone. It goes now by whether the work catches the request's tokens up (the step made its
    next token): those are chunks, and the last, the token it made and was never fed, its decode. The
    labels expected are replayed from the step log's works: a work that catches up makes a token."""
    from orca_torch.core.engine import Engine
    from orca_torch.core.memory import TokenMemory
    from orca_torch.core.policies import ChunkedPrefillScheduler
    from orca_torch.core.scheduler_config import SchedulerConfig
    from orca_torch.model.torch_executor import TorchExecutor
    from orca_torch.serve.live import LiveEngine
    from orca_torch.serve.metrics import Metrics
    from tiny_model import MODEL

    class OneTokenAStep(ChunkedPrefillScheduler):
        def prompt_share(self, req, budget):
            return min(1, budget)

    caplog.set_level(logging.INFO, logger="orca_torch.serve")
    engine = Engine(TorchExecutor(MODEL, MODEL.new_kv(64)), TokenMemory(8),
                    SchedulerConfig(max_bs=2, max_num_batched_tokens=8, chunked_prefill=True), scheduler=OneTokenAStep)
    live = LiveEngine(engine, Metrics("tiny"), log_steps=True)

    async def both():                           # (one call: both join the same step, so the run is one)
        streams = live.submit_all([live.new_request([5, 9, 11], 5), live.new_request([7, 1, 30], 5)], [None, None])
        for s in streams:
            while (await asyncio.wait_for(s.queue.get(), TIMEOUT)).finish_reason is None:
                pass
    try:
        asyncio.run(both())
    finally:
        live.stop()
    said = [m.split()[4:] for m in caplog.messages if m.startswith("step ")]
    prompt, made, expected, got = 3, {}, [], []
    for line in said:
        for word in line:
            rid, kind, n, p = re.fullmatch(r"(\d+):(\w+)\((\d+)\+(\d+)\)", word).groups()
            n, p, g = int(n), int(p), made.get(rid, 0)
            caught_up = p + n == prompt + g
            expected.append("prefill" if p == 0 else "decode" if n == 1 and p >= prompt and caught_up else "chunk")
            got.append((kind, n, p >= prompt, caught_up))
            made[rid] = g + caught_up
    assert [k for k, *_ in got] == expected and sum(r.n_preemptions for r in live.requests) == 1
    assert ("chunk", 1, True, False) in got     # a one-token chunk of the recompute, past the prompt


def test_a_request_whose_logits_are_not_finite_fails_alone():
    """One request's logits row turns NaN (numbers that overflowed for its input alone): its stream
    ends with the error, and the other request in the same steps finishes with the tokens it makes
    alone; the whole step failed, and every stream in it, before."""
    from orca_torch.serve.server import build

    live, _ = build(ServeConfig(model="tiny"))
    model = live.engine.executor.model
    made, poisoned = model.forward_batch, {}

    def forward_batch(token_ids, works, req_ids, kv):
        logits = made(token_ids, works, req_ids, kv).clone()
        for i, rid in enumerate(req_ids):
            if rid in poisoned and poisoned[rid].n_generated == 2:
                logits[i] = math.nan
        return logits

    async def run():
        model.forward_batch = forward_batch
        good, bad = (live.submit(live.new_request(p, 6)) for p in ([1, 2, 3], [4, 5, 6, 7]))
        poisoned[bad.req.req_id] = bad.req
        got = {}
        for s in (good, bad):
            ids, ev = [], await asyncio.wait_for(s.queue.get(), TIMEOUT)
            while True:
                ids += ev.ids
                if ev.finish_reason is not None:
                    break
                ev = await asyncio.wait_for(s.queue.get(), TIMEOUT)
            got[s.req.req_id] = ids, ev
        return good.req, bad.req, got

    try:
        good, bad, got = asyncio.run(run())
        ids, ev = got[good.req_id]
        assert ev.finish_reason == "length" and ev.error is None and ids == list(generate_alone(model, [1, 2, 3], 6))
        ids, ev = got[bad.req_id]
        assert ids == bad.output_ids and len(ids) == 2 and ev.status == 500
        assert ev.error.startswith(f"the engine failed: request {bad.req_id}: its logits row is not finite "
                                   "(it holds NaN)")
        assert live.metrics.finished == {"length": 1, "stop": 0, "abort": 1}
        assert live.engine.memory.slots_reserved == 0 and live.engine.executor.kv.slots_reserved == 0
    finally:
        live.stop()


def test_a_special_token_in_logprobs_shows_as_it_decodes_alone(tmp_path):
    """An end-of-sequence token kept in the answer (`ignore_eos`, or `include_stop_str_in_output`
    where it ends it) is skipped by the text, but its log probabilities' text is "</s>", the token
    decoded alone with special tokens kept, as vLLM shows it (it was ""), as a likely token too."""
    from orca_torch.serve.app import create_app
    from orca_torch.serve.server import build

    tiny_checkpoint(tmp_path).save_pretrained(tmp_path)
    live, tok = build(ServeConfig(model=str(tmp_path)))
    app = create_app(live, tok, "ckpt")

    async def run(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=TIMEOUT) as c:
            return (await c.post("/v1/completions", json=body)).json()["choices"][0]

    try:
        body = {"prompt": "w4 w5", "max_tokens": 3, "logprobs": 1, "logit_bias": {"2": 100}}
        kept = asyncio.run(run({**body, "ignore_eos": True}))
        assert kept["text"] == "" and kept["finish_reason"] == "length"
        assert kept["logprobs"]["tokens"] == ["</s>"] * 3
        assert all("</s>" in top and "" not in top for top in kept["logprobs"]["top_logprobs"])   # (raw logprobs)
        ended = asyncio.run(run({**body, "include_stop_str_in_output": True}))
        assert ended["finish_reason"] == "stop" and ended["logprobs"]["tokens"] == ["</s>"]
    finally:
        live.stop()


def test_an_answer_ended_by_a_config_eos_id_gives_that_id_as_stop_reason(tmp_path):
    """A generation config's second end-of-sequence id ends an answer with `stop_reason` that id,
    as vLLM, which adds such ids to `stop_token_ids`, gives it (it was null); the tokenizer's own
    eos token still ends one with `stop_reason` null."""
    from orca_torch.serve.app import create_app
    from orca_torch.serve.server import build

    tiny_checkpoint(tmp_path).save_pretrained(tmp_path)
    live, tok = build(ServeConfig(model=str(tmp_path)))
    live.stop()
    ref = generate_alone(live.engine.executor.model, tok.encode("w4 w5"), 8)
    k = next(i for i in range(1, 8) if ref[i] != 2 and ref[i] not in ref[:i])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, ref[k]]}))
    live, tok = build(ServeConfig(model=str(tmp_path)))
    app = create_app(live, tok, "ckpt")

    async def run(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=TIMEOUT) as c:
            whole = (await c.post("/v1/completions", json=body)).json()["choices"][0]
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                chunks = [json.loads(line[6:])["choices"][0] async for line in r.aiter_lines()
                          if line.startswith("data: {")]
            return whole, chunks[-1]

    try:
        body = {"model": "ckpt", "prompt": "w4 w5", "max_tokens": 8}
        for got in asyncio.run(run(body)):
            assert got["finish_reason"] == "stop" and got["stop_reason"] == ref[k]
        for got in asyncio.run(run({**body, "logit_bias": {"2": 100}})):
            assert got["finish_reason"] == "stop" and got["stop_reason"] is None
        for got in asyncio.run(run({**body, "ignore_eos": True, "stop_token_ids": [2], "logit_bias": {"2": 100}})):
            assert got["finish_reason"] == "stop" and got["stop_reason"] == 2
    finally:
        live.stop()
