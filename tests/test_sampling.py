"""Seeded sampling on the torch executor: a request's tokens depend on its seed and its own logits
alone, never on its batch, the memory manager, chunked prefill or a preemption; the parameters that
leave one token standing give the greedy tokens; one draw picks each token as the distribution says."""
from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np
import pytest
import torch

from orca_torch.core.engine import Engine
from orca_torch.core.memory import ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.model.paged_kv_cache import PagedKVManager
from orca_torch.lab import api
from orca_torch.model.sampling import (NonFiniteLogits, RowSampler, SamplingParams, TokenHistory, adjust_logits,
                                       pick, request_seed, sample)
from orca_torch.model.torch_executor import TorchExecutor
from tiny_model import MODEL, alone, next_logits, raw_logprobs

WARM = SamplingParams(temperature=1.0, top_p=0.95, top_k=200)


def make(specs, sampling, seed=0):
    """Requests from (arrival, prompt len, output len), the i-th with `sampling[i]`."""
    rng = np.random.default_rng(seed)
    return [Request(i, float(a), p, o, prompt_ids=rng.integers(0, MODEL.spec.vocab, size=p).tolist(), sampling=s)
            for i, ((a, p, o), s) in enumerate(zip(specs, sampling))]


def run(reqs, config=SchedulerConfig(max_bs=4), memory=None, exec_seed=0):
    """Each request's tokens, served together on contiguous K/V (or on paged K/V with a PagedMemory)."""
    memory = memory or UnlimitedMemory()
    kv = (PagedKVManager.mirroring(memory, MODEL) if isinstance(memory, PagedMemory)
          else MODEL.new_kv(sum(r.total_len for r in reqs)))
    res = Engine(TorchExecutor(MODEL, kv, clock="iterations", seed=exec_seed), memory, config).run(reqs)
    return res.output_ids, int(res.n_preemptions.sum())


def alone_sampled(r, exec_seed=0):
    """`r`'s tokens when it is the run's only request."""
    return run([dataclasses.replace(r, arrival_s=0.0)], exec_seed=exec_seed)[0][r.req_id]


SPECS = [(0, 9, 14), (0, 6, 16), (1, 11, 12), (1, 4, 18), (2, 7, 10)]
MIXED = [SamplingParams(seed=11), None, dataclasses.replace(WARM, seed=12), SamplingParams(temperature=0.7), None]


@pytest.mark.parametrize("config, memory, preempts", [
    (SchedulerConfig(max_bs=4), None, False),
    (SchedulerConfig(max_bs=3, max_num_batched_tokens=5, chunked_prefill=True), None, False),
    (SchedulerConfig(max_bs=4), TokenMemory(40), True),
    (SchedulerConfig(max_bs=4), ReservationMemory(80, "oracle"), False),
    (SchedulerConfig(max_bs=4), PagedMemory(48, block_size=4, preemption="recompute", watermark_blocks=0), True),
    (SchedulerConfig(max_bs=4, max_num_batched_tokens=6, chunked_prefill=True),
     PagedMemory(48, block_size=4, preemption="swap", cpu_blocks=12, watermark_blocks=0), True),
], ids=["continuous", "chunked", "token-recompute", "reservation", "paged-recompute", "paged-swap-chunked"])
def test_a_sampled_request_makes_the_tokens_it_makes_alone(config, memory, preempts):
    """Seeded or not (then seeded from the executor's seed and its id), batched with greedy and other
    sampled requests, preempted or chunked, each request gets its tokens of a run of its own; the
    greedy ones keep their greedy tokens."""
    reqs = make(SPECS, MIXED)
    out, n_preempted = run(reqs, config, memory)
    assert (n_preempted > 0) == preempts
    for r in reqs:
        want = alone(r.prompt_ids, r.output_len) if r.sampling is None else alone_sampled(r)
        assert out[r.req_id] == want, r.req_id
    assert out[0] != alone(reqs[0].prompt_ids, reqs[0].output_len)     # (sampled: not the greedy tokens)


@pytest.mark.parametrize("config, memory", [
    (SchedulerConfig(max_bs=4), None),
    (SchedulerConfig(max_bs=3, max_num_batched_tokens=5, chunked_prefill=True), None),
    (SchedulerConfig(max_bs=4), TokenMemory(40)),
    (SchedulerConfig(max_bs=4), PagedMemory(48, block_size=4, preemption="recompute", watermark_blocks=0)),
    (SchedulerConfig(max_bs=4, max_num_batched_tokens=6, chunked_prefill=True),
     PagedMemory(48, block_size=4, preemption="swap", cpu_blocks=12, watermark_blocks=0)),
], ids=["continuous", "chunked", "token-recompute", "paged-recompute", "paged-swap-chunked"])
def test_logprobs_are_the_model_s_own_and_change_no_token(config, memory):
    """A request that asks for log probabilities gets, with each token, its log-softmax under the model's
    raw logits (those of its prompt and tokens run alone), and the k most likely tokens', the greedy
    token first; batched, chunked or preempted, its tokens are those it makes without asking (greedy
    or seeded), and the requests that do not ask get none."""
    plain = make(SPECS, MIXED)
    asking = make(SPECS, [dataclasses.replace(s or SamplingParams(temperature=0.0), logprobs=k)
                          for s, k in zip(MIXED, (3, 0, 5, None, 2))])
    want, _ = run(plain, config, memory)
    kv = (PagedKVManager.mirroring(memory, MODEL) if isinstance(memory, PagedMemory)
          else MODEL.new_kv(sum(r.total_len for r in asking)))
    res = Engine(TorchExecutor(MODEL, kv, clock="iterations"), memory or UnlimitedMemory(), config).run(asking)
    assert res.output_ids == want
    if memory is not None:
        assert int(res.n_preemptions.sum()) > 0
    assert asking[3].output_logprobs is None
    for r, k in zip(asking, (3, 0, 5, None, 2)):
        if k is None:
            continue
        ref = raw_logprobs(r.prompt_ids, r.output_ids)
        assert [lp.token for lp in r.output_logprobs] == r.output_ids
        for i, (lp, row) in enumerate(zip(r.output_logprobs, ref, strict=True)):
            assert lp.logprob == pytest.approx(float(row[lp.token]), abs=1e-4)
            assert len(lp.top) == k
            assert [t for t, _ in lp.top] == row.topk(k).indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)
            if r.sampling.greedy and k:
                assert lp.top[0] == (lp.token, lp.logprob), (r.req_id, i)


def test_a_runs_result_holds_the_log_probabilities_beside_the_tokens():
    """`api.run` on the torch model: `RunResult.output_logprobs` gives each request's log probabilities
    as `output_ids` gives its tokens, per request id; None for a request that asked none."""
    reqs = make(SPECS[:3], [SamplingParams(temperature=0.0, logprobs=2), None, SamplingParams(seed=5, logprobs=0)])
    res = api.run(reqs, model="tiny", executor="torch", clock="iterations", max_bs=4)
    assert set(res.output_logprobs) == set(res.output_ids) == {0, 1, 2}
    assert res.output_logprobs == {r.req_id: r.output_logprobs for r in res.requests} and res.output_logprobs[1] is None
    for i, k in ((0, 2), (2, 0)):
        assert [lp.token for lp in res.output_logprobs[i]] == res.output_ids[i]
        assert all(len(lp.top) == k for lp in res.output_logprobs[i])


def test_the_seed_decides_the_tokens_and_an_unseeded_request_the_executor_s_seed_and_its_id():
    """The same seed under another id gives the same tokens; other seeds give other tokens (temperature
    1 over the tiny model's nearly flat 256-token distributions: 24 tokens alike would be a miracle);
    without a seed, the executor's seed and the request's id decide them."""
    base = make([(0, 6, 24)], [SamplingParams(seed=5)])[0]
    tokens = alone_sampled(base)
    assert alone_sampled(dataclasses.replace(base, req_id="other")) == tokens
    assert alone_sampled(base, exec_seed=3) == tokens                   # (its own seed rules)
    runs = [alone_sampled(dataclasses.replace(base, sampling=SamplingParams(seed=s))) for s in (6, 7)]
    assert tokens != runs[0] != runs[1] != tokens
    unseeded = dataclasses.replace(base, sampling=SamplingParams())
    assert alone_sampled(unseeded) == alone_sampled(unseeded)
    assert len({tuple(alone_sampled(unseeded, exec_seed=e)) for e in (0, 1)}
               | {tuple(alone_sampled(dataclasses.replace(unseeded, req_id=1)))}) == 3


def test_an_unseeded_request_with_a_numpy_id_draws_as_the_int_it_equals():
    """The engine keys `np.int64(3)` and `3` alike; the seed derived from the id does too, and so does
    not change with numpy's repr of its numbers (`np.int64(3)` since numpy 2, `3` before)."""
    unseeded = make([(0, 6, 24)], [SamplingParams()])[0]
    tokens = alone_sampled(dataclasses.replace(unseeded, req_id=3))
    assert alone_sampled(dataclasses.replace(unseeded, req_id=np.int64(3))) == tokens
    assert alone_sampled(dataclasses.replace(unseeded, req_id=np.int32(3))) == tokens


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=1e-6),
                                    SamplingParams(top_k=1, seed=2), SamplingParams(top_p=1e-9, seed=3),
                                    SamplingParams(temperature=5.0, top_k=1, top_p=1e-9)])
def test_parameters_that_leave_one_token_give_the_greedy_tokens(params):
    r = make([(0, 8, 20)], [params])[0]
    assert alone_sampled(r) == alone(r.prompt_ids, r.output_len)


def test_a_request_s_generator_is_dropped_as_it_finishes_or_is_aborted():
    """A live run (a server's) never ends: the executor keeps a request's generator from its first
    token (and across preemptions, above) and drops it as the request finishes or is aborted, so it
    holds none for the requests that have left."""
    ex = TorchExecutor(MODEL, MODEL.new_kv(64), clock="iterations")
    engine = Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=4))
    engine.start_live()
    short, other, gone = make([(0, 5, 2), (0, 5, 10), (0, 5, 10)], [SamplingParams(seed=s) for s in (1, 2, 3)])
    for r in (short, other, gone):
        engine.add(r)
    engine.step()                                       # each makes its first token
    assert set(ex._samplers) == {0, 1, 2}
    engine.step()                                       # short makes its last
    assert short.n_generated == 2 and set(ex._samplers) == {1, 2}
    engine.abort(gone)
    assert set(ex._samplers) == {1}
    while engine.step() is not None:
        pass
    assert other.n_generated == 10 and ex._samplers == {}


def test_min_tokens_bans_the_stop_ids_before_the_draw():
    """A sampled request whose first token (drawn alone) is its stop id, with min_tokens 1, never
    draws it first."""
    r = make([(0, 5, 3)], [SamplingParams(top_k=1)])[0]
    first = alone(r.prompt_ids, 1)[0]
    banned = dataclasses.replace(r, min_tokens=1, stop_token_ids=(first,))
    assert alone_sampled(banned)[0] != first


PROBS = [0.5, 0.25, 0.125, 0.125]
LOGITS = torch.tensor(PROBS, dtype=torch.float64).log()
N = 4000


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(), PROBS),
    (SamplingParams(top_k=2), [2 / 3, 1 / 3, 0, 0]),
    (SamplingParams(top_p=0.7), [2 / 3, 1 / 3, 0, 0]),                    # 0.5 < 0.7 <= 0.75
    (SamplingParams(temperature=2.0), [math.sqrt(p) for p in PROBS]),     # p ** (1 / 2), normalised
], ids=["plain", "top_k", "top_p", "temperature"])
def test_each_draw_is_one_uniform_number_through_the_distribution_s_cdf(params, kept):
    """`sample` over a fixed distribution, on a seeded generator, makes exactly the tokens the
    inverse CDF of the distribution the parameters leave gives for the same generator's uniform
    numbers, one per token; and (seed 0: fixed, so never flaky) the frequencies follow it."""
    g = torch.Generator().manual_seed(0)
    got = [sample(LOGITS, params, g) for _ in range(N)]
    total = sum(kept)
    cdf = torch.tensor(kept, dtype=torch.float64).cumsum(0) / total
    u = torch.rand(N, generator=torch.Generator().manual_seed(0))
    want = torch.searchsorted(cdf, u.double(), right=True).tolist()
    assert got == want
    freq = np.bincount(got, minlength=4) / N
    assert np.abs(freq - np.array(kept) / total).max() < 0.03 and all(freq[np.array(kept) == 0] == 0)


@pytest.mark.parametrize("params", [None, SamplingParams(seed=5), SamplingParams(top_k=3, top_p=0.9, seed=6)],
                         ids=["greedy", "sampled", "top-k-top-p"])
@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_logits_that_are_not_finite_fail_the_step_naming_the_request(monkeypatch, params, bad):
    """Logits overflowed (a float16 checkpoint): greedy's argmax would pick the NaN's token and a draw
    one past the vocabulary; both refuse the step, naming the request, before any token is made."""
    forward = MODEL.forward_batch

    def overflowing(*args, **kwargs):
        logits = forward(*args, **kwargs).clone()
        logits[-1, 7] = bad
        return logits

    monkeypatch.setattr(MODEL, "forward_batch", overflowing)
    reqs = make([(0, 5, 4), (0, 6, 4)], [None, params])
    with pytest.raises(NonFiniteLogits, match=rf"request 1: its logits row is not finite \(it holds "
                                              rf"{'NaN' if math.isnan(bad) else '[+]inf'}\)"):
        run(reqs)


@pytest.mark.parametrize("row", [[0.0, math.nan, 1.0], [0.0, math.inf, 1.0], [-math.inf] * 3])
def test_a_draw_from_a_row_that_is_not_finite_is_refused(row):
    """By hand too: a draw never returns an id past the vocabulary."""
    sampler = RowSampler(0, torch.device("cpu"))
    with pytest.raises(NonFiniteLogits, match="a logits row is not finite"):
        pick(torch.tensor(row), SamplingParams(), TokenHistory((), ()), sampler, 0)
    assert sampler.n_drawn == 0


def test_a_numpy_number_inside_a_tuple_id_draws_as_the_python_number_it_equals():
    """The engine keys `("a", np.int64(3))` and `("a", 3)` alike (equal, same hash); the seed
    derived from the id does too, as it does for a bare numpy id."""
    assert request_seed(SamplingParams(), 0, ("a", np.int64(3))) == request_seed(SamplingParams(), 0, ("a", 3))
    assert request_seed(SamplingParams(), 0, ("a", (np.float32(0.5),))) == request_seed(SamplingParams(), 0,
                                                                                         ("a", (0.5,)))
    unseeded = make([(0, 6, 24)], [SamplingParams()])[0]
    assert (alone_sampled(dataclasses.replace(unseeded, req_id=("a", np.int64(3))))
            == alone_sampled(dataclasses.replace(unseeded, req_id=("a", 3))))


Key = collections.namedtuple("Key", "user turn")


def test_a_numpy_number_inside_a_namedtuple_id_draws_as_the_python_number_it_equals():
    """A namedtuple id is a tuple to the engine too: `Key("a", np.int64(3)) == Key("a", 3)`, so the
    seed derived from it is the same, as for a plain tuple id."""
    assert request_seed(SamplingParams(), 0, Key("a", np.int64(3))) == request_seed(SamplingParams(), 0, Key("a", 3))
    assert (request_seed(SamplingParams(), 0, ("x", Key("a", np.int64(3))))
            == request_seed(SamplingParams(), 0, ("x", Key("a", 3))))


def test_a_derived_seed_is_the_ids_repr_for_str_int_and_tuple_ids():
    """The rule behind every seed derived so far: blake2b of "executor seed:repr(id)"."""
    import hashlib

    for rid in ("a", 3, -7, ("a", 3), (3,), ("x", ("y", 2)), Key("a", 3), 0.5, None):
        digest = hashlib.blake2b(f"7:{rid!r}".encode(), digest_size=8).digest()
        assert request_seed(SamplingParams(), 7, rid) == int.from_bytes(digest, "little") % 2**63, rid


def test_ids_the_engine_keys_alike_draw_alike_and_a_frozensets_seed_is_one_in_every_process():
    """A frozenset's repr lists its members in hash order: {1, 9} and {9, 1} (equal) printed apart,
    and a frozenset of str printed another way in each process (PYTHONHASHSEED). A number counts as
    the int it equals (a float or numpy column of ids), as the engine keys it: 3.0 and 3 drew apart."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    seed = lambda rid: request_seed(SamplingParams(), 0, rid)      # noqa: E731
    assert seed(frozenset([1, 9])) == seed(frozenset([9, 1])) and repr(frozenset([1, 9])) != repr(frozenset([9, 1]))
    for a, b in ((3.0, 3), (np.float64(3.0), 3), (True, 1), (("a", 2.0), ("a", 2)), (frozenset([1.0]), frozenset([1]))):
        assert a == b and seed(a) == seed(b), (a, b)
    assert seed(3.5) != seed(3) and seed(Key("a", 3)) != seed(("a", 3))   # (a namedtuple keeps its own repr)
    names = frozenset(["alice", "bob", "carol", "dave", "erin", "frank"])
    root = Path(__file__).resolve().parents[1]
    code = "from orca_torch.model.sampling import SamplingParams, request_seed\n" \
           f"print(request_seed(SamplingParams(), 0, frozenset({sorted(names)!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "PYTHONPATH": str(root), "PYTHONHASHSEED": "0"}).stdout
    assert int(out) == seed(names)


def test_bias_and_penalties_are_the_hand_computed_arithmetic_on_a_small_row():
    """logits [2, -1, 0.5, 3, -2], prompt [1], made so far [3, 3, 2]: the bias {0: -1, 4: +1.5}
    gives [1, -1, 0.5, 3, -0.5]; repetition 2 on the tokens seen (1, 2, 3) divides the positive
    and multiplies the negative: [1, -2, 0.25, 1.5, -0.5]; frequency 0.5 per time made (3 twice, 2
    once) and presence 0.25 once for each made: [1, -2, -0.5, 0.25, -0.5]. The greedy pick moves
    from 3 to 0; the row given is left as it was."""
    p = SamplingParams(temperature=0.0, presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=2.0,
                       logit_bias={0: -1, 4: 1.5})
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    history = TokenHistory([1], [3, 3, 2])
    assert adjust_logits(row, p, history).tolist() == [1.0, -2.0, -0.5, 0.25, -0.5]
    assert row.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]
    assert pick(row, p, history, None, 3) == 0 and pick(row, SamplingParams(temperature=0.0), history, None, 3) == 3
    only_seen = SamplingParams(temperature=0.0, repetition_penalty=0.5)       # (below 1: a bonus)
    assert adjust_logits(row, only_seen, TokenHistory([4], [])).tolist() == [2.0, -1.0, 0.5, 3.0, -1.0]
    assert SamplingParams(logit_bias=None) == SamplingParams(logit_bias={}) == SamplingParams()
    assert not SamplingParams(temperature=0.0, repetition_penalty=1, presence_penalty=0).adjusts
    banned = torch.tensor([-math.inf, 1.0])
    assert adjust_logits(banned, SamplingParams(logit_bias={0: 100}, repetition_penalty=3.0),
                         TokenHistory([0], [0])).tolist() == [-math.inf, 1.0]


def penalized_greedy(prompt, n, p: SamplingParams) -> list[int]:
    """The greedy tokens under `p`'s bias and penalties, computed here by hand from the model's raw
    logits of the prompt and the tokens so far, run alone."""
    out: list[int] = []
    for _ in range(n):
        x = next_logits(list(prompt) + out).double().tolist()
        for t, b in p.logit_bias:
            x[t] += b
        for t in set(prompt) | set(out):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t, c in collections.Counter(out).items():
            x[t] -= p.frequency_penalty * c + p.presence_penalty
        out.append(max(range(len(x)), key=x.__getitem__))
    return out


def test_greedy_decoding_honours_bias_and_penalties():
    """At temperature 0 the bias and penalties apply before the pick, as vLLM applies them: a bias
    of -100 on the greedy first token moves it; a frequency or presence penalty breaks the greedy
    answer's repeats; a repetition penalty keeps a prompt token from coming back. Each answer is the
    hand-computed one, and the log probabilities stay the model's raw ones."""
    prompt = [100, 219, 141, 8, 195, 186, 216, 44]
    plain = alone(prompt, 24)
    assert plain[0] == prompt[0] and len(set(plain)) < len(plain)      # (a prompt token first, and repeats)
    for p in (SamplingParams(temperature=0.0, logit_bias={plain[0]: -100.0}),
              SamplingParams(temperature=0.0, frequency_penalty=2.0),
              SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=1),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={7: 3.0})):
        res = api.run([Request(0, 0.0, len(prompt), 24, prompt_ids=prompt, sampling=p)], model="tiny",
                      executor="torch", clock="iterations")
        got = res.output_ids[0]
        assert got == penalized_greedy(prompt, 24, p) and got != plain, p
        if p.logprobs is not None:
            ref = raw_logprobs(prompt, got)
            assert [lp.logprob for lp in res.output_logprobs[0]] == pytest.approx(
                [float(row[t]) for row, t in zip(ref, got)], abs=1e-4)
    assert penalized_greedy(prompt, 24, SamplingParams(temperature=0.0, frequency_penalty=2.0)).count(plain[1]) == 1


ADJUSTED = [SamplingParams(seed=11, frequency_penalty=1.0, logit_bias={5: 4.0}), None,
            SamplingParams(temperature=0.0, repetition_penalty=1.3),
            SamplingParams(temperature=0.7, presence_penalty=-1),
            SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.5)]


@pytest.mark.parametrize("config, memory", [
    (SchedulerConfig(max_bs=3, max_num_batched_tokens=5, chunked_prefill=True), None),
    (SchedulerConfig(max_bs=4), TokenMemory(40)),
    (SchedulerConfig(max_bs=4, max_num_batched_tokens=6, chunked_prefill=True),
     PagedMemory(48, block_size=4, preemption="swap", cpu_blocks=12, watermark_blocks=0)),
], ids=["chunked", "token-recompute", "paged-swap-chunked"])
def test_penalized_requests_make_the_tokens_they_make_alone(config, memory):
    """Requests with bias and penalties, greedy or drawn, batched with others, chunked or preempted
    (their history read again after a recompute), each get their tokens of a run of their own."""
    reqs = make(SPECS, ADJUSTED)
    plain = alone(reqs[2].prompt_ids, reqs[2].output_len)
    reqs[2].sampling = dataclasses.replace(ADJUSTED[2], logit_bias={plain[2]: -5.0})
    out, n_preempted = run(reqs, config, memory)
    assert (n_preempted > 0) == (memory is not None)
    for r in reqs:
        want = alone(r.prompt_ids, r.output_len) if r.sampling is None else alone_sampled(r)
        assert out[r.req_id] == want, r.req_id
    assert out[2] == penalized_greedy(reqs[2].prompt_ids, reqs[2].output_len, reqs[2].sampling) != plain
