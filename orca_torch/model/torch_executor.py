"""The torch executor: a scheduled iteration run on the real model (lecture §5.1).

`TorchExecutor(model, kv)` runs the step on `OrcaModel.forward_batch` through the K/V cache,
returns each request's next token and times it: the greedy token (the row's most likely), or for a
request with `sampling` a token drawn from its own seeded generator (`sampling.py`), after the
request's logit bias and penalties where it sets them (greedy too: `sampling.pick`); either way a
request's stop ids are kept from being picked before its `min_tokens` (`ban_stops`), and a row of
logits that is not finite (a NaN from overflowed numbers) fails its request, greedy or drawn
(`NonFiniteLogits`, a `core.executor.RowsFailed` naming each such request, with the step as it ran
for the others: an offline run stops on it, a live run drops those requests alone). A request whose
`SamplingParams.logprobs` is set also gets each token's log probabilities (`StepResult.logprobs`),
computed for its rows alone. Timing: `time.perf_counter` on CPU, `torch.cuda.Event` with
synchronisation on CUDA, or `clock="iterations"` (every step lasts 1: the lecture's timeline). A
step's wall time also counts the seconds the K/V store spent copying K/V while it made room for the
step (`KVStore.make_room`: a paged store's swaps, lecture §7).
"""
from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from typing import Hashable, Literal

import torch

from orca_torch.checks import brief, brief_items, check_choice, check_instance, check_seed
from orca_torch.core.batch import Batch, ScheduledSeq, SeqWork
from orca_torch.core.executor import Executor, StepResult
from orca_torch.core.request import ACTIVE, Request
from orca_torch.model.kv_cache import KVStore
from orca_torch.model.orca_model import OrcaModel
from orca_torch.model.sampling import (NonFiniteLogits, RowSampler, SamplingParams, TokenHistory, TokenLogprobs, pick,
                                       printed_by_address, request_seed, rows_not_finite, token_logprobs)


def check_prompt_ids(req: Request, vocab: int, who: str) -> None:
    """Raise ValueError unless `req` has prompt ids, each below `vocab`, and stop token ids below it
    too (`Request.validate`, which the engine runs first, has made sure they are integers >= 0), and
    unless its stop ids, banned before its `min_tokens` (`ban_stops`), leave a token to make."""
    ids = req.prompt_ids
    if ids is None:
        raise ValueError(f"request {brief(req.req_id)} has no prompt_ids; {who} needs tokens "
                         "(see workload.with_prompt_ids)")
    for name, ids in (("prompt ids", ids), ("stop_token_ids", req.stop_token_ids)):
        big = next((t for t in ids if t >= vocab), None)
        if big is not None:
            raise ValueError(f"request {brief(req.req_id)}: {name} must lie in [0, {vocab}), got {int(big)}")
    if req.min_tokens and len(set(req.stop_token_ids)) == vocab:
        raise ValueError(f"request {brief(req.req_id)}: its stop_token_ids hold every one of the {vocab} token ids, so "
                         f"none could be made before min_tokens={req.min_tokens}; leave a token out of them, or set "
                         "min_tokens=0")


def check_sampling(req: Request, vocab: int) -> None:
    """Raise ValueError unless `req.sampling` is None or a `SamplingParams` whose draws come out alike
    each run (a seed, or an id that prints alike: `request_seed`) and whose `logit_bias` ids lie in
    the model's vocabulary."""
    rid, p = req.req_id, req.sampling
    if p is not None and not isinstance(p, SamplingParams):
        raise ValueError(f"request {brief(rid)}: sampling must be a SamplingParams (orca_torch.model.sampling) or "
                         f"None for greedy decoding, got {type(p).__name__}")
    big = next((t for t, _ in p.logit_bias if t >= vocab), None) if p is not None else None
    if big is not None:
        raise ValueError(f"request {brief(rid)}: logit_bias token ids must lie in [0, {vocab}), got {big}")
    part = printed_by_address(rid) if p is not None and not p.greedy and p.seed is None else None
    if part is not None:
        inside = "" if part is rid else " (inside it)"
        raise ValueError(f"request {brief(rid)}: sampling without a seed draws from a seed derived from its req_id's "
                         f"repr, and a {type(part).__name__}'s repr{inside} shows a memory address, another each run; "
                         "give SamplingParams a seed, or the request a req_id that prints alike each run (an int, a "
                         "str)")


def picked_rows(works: Sequence[ScheduledSeq]) -> list[int]:
    """The works whose token this step is picked by `pick`, not plain greedy: a request with sampling
    that draws or changes its logits (`SamplingParams.adjusts`) and makes a token (a chunk that does
    not end its prompt makes none, and draws nothing)."""
    return [i for i, (r, n_new, n_past) in enumerate(works)
            if r.sampling is not None and (not r.sampling.greedy or r.sampling.adjusts)
            and makes_token(r, n_new, n_past)]


def makes_token(r: Request, n_new: int, n_past: int) -> bool:
    """Whether a work makes a token this step: it catches up with its prompt and output (a chunk that
    does not end its prompt makes none)."""
    return n_past + n_new >= r.prompt_len + r.n_generated


def logprob_rows(works: Sequence[ScheduledSeq]) -> list[int]:
    """The works whose request asks for log probabilities (`SamplingParams.logprobs`) and makes a
    token this step."""
    return [i for i, (r, n_new, n_past) in enumerate(works)
            if r.sampling is not None and r.sampling.logprobs is not None and makes_token(r, n_new, n_past)]


def step_logprobs(works: Sequence[ScheduledSeq], asked: Sequence[int], raw: torch.Tensor,
                  tokens: torch.Tensor) -> list[TokenLogprobs | None]:
    """A step's `StepResult.logprobs`: for each of `works`, its `TokenLogprobs` where it is one of
    `asked` (`logprob_rows`, not empty), None for the others. `raw`: the asked works' raw logits
    rows `[len(asked), vocab]` (before bans, bias and penalties), `tokens` their tokens
    `[len(asked)]` (also `distributed.DistributedExecutor.wait`'s, from the rows its last stage
    sends back)."""
    out: list[TokenLogprobs | None] = [None] * len(works)
    made = token_logprobs(raw, tokens, [works[i].req.sampling.logprobs for i in asked])
    for i, lp in zip(asked, made):
        out[i] = lp
    return out


def draw(samplers: dict[Hashable, RowSampler], seed: int, r: Request, logits: torch.Tensor) -> int:
    """`r`'s next token from its logits row `[vocab]` (`sampling.pick`, its tokens so far handed over
    for its penalties), drawn on its own generator in `samplers` (made on its first draw from
    `request_seed`, kept across preemptions until the executor drops it); a greedy request has none."""
    p, sampler = r.sampling, samplers.get(r.req_id)
    if sampler is None and not p.greedy:
        sampler = samplers[r.req_id] = RowSampler(request_seed(p, seed, r.req_id), logits.device)
    return pick(logits, p, TokenHistory(r.prompt_ids, r.output_ids or ()), sampler, r.n_generated)


def ban_stops(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """`logits` (row i: `reqs[i]`'s next token) with the stop ids of each request that has made
    fewer than its `min_tokens` tokens set to -inf, as vLLM's `min_tokens` does: it cannot end yet."""
    return ban_tokens(logits, stop_bans(reqs))


def stop_bans(reqs: Sequence[Request]) -> list[tuple[int, int]]:
    """The `(row, token id)` pairs `ban_stops` bans: each stop id of `reqs[row]` while it is short of
    its `min_tokens` (also what a distributed batch tells its last stage, `control.BatchControl.bans`)."""
    return [(i, t) for i, r in enumerate(reqs) if r.n_generated < r.min_tokens for t in sorted(set(r.stop_token_ids))]


def ban_tokens(logits: torch.Tensor, banned: Sequence[tuple[int, int]]) -> torch.Tensor:
    """`logits` with each `(row, column)` of `banned` set to -inf (`ban_stops`; a vocab-parallel
    shard's columns in `distributed.shard.StageShard.greedy`)."""
    if banned:
        rows, cols = torch.tensor(banned, device=logits.device).T
        logits = logits.index_put((rows, cols), torch.tensor(-math.inf, dtype=logits.dtype, device=logits.device))
    return logits


def new_token_ids(r: Request, n_new: int, n_past: int) -> list[int]:
    """The token ids a request feeds this step: a slice of its prompt (and, after a preemption,
    of its own output), or its last generated token for a decode."""
    n_prompt = r.prompt_len
    if n_new == 1 and n_past >= n_prompt:
        return [r.output_ids[n_past - n_prompt]]
    head = [int(t) for t in r.prompt_ids[n_past:min(n_past + n_new, n_prompt)]]
    tail = r.output_ids[max(n_past - n_prompt, 0):n_past + n_new - n_prompt] if n_past + n_new > n_prompt else []
    return head + tail


Clock = Literal["wall", "iterations"]


def _warn_freed_outside(rids: Sequence[Hashable], then: str) -> None:
    """Name K/V the executor put in the store that a user freed by hand (`release`, `reset`)."""
    warnings.warn(f"K/V this executor put in the store under {brief_items(rids)} was freed outside it (kv.free by "
                  f"hand){then}", stacklevel=3)


class TorchExecutor(Executor):
    """Runs each step on the real model (selective batching) and returns each request's next token:
    greedy, or drawn for a request with `sampling` from its own generator (`sampling.RowSampler`),
    seeded from its `SamplingParams.seed` or, without one, from `seed` and its id. The generator is
    kept across preemptions and dropped when the request finishes or leaves.

    One process runs every layer, so a pipelined run (`n_workers > 1`) has one stage (`n_stages`):
    a batch enters when the one before it is done.

    Before each step the store `kv` makes room for the batch's works (`KVStore.make_room`), and a
    request's K/V is freed when it finishes or is preempted; the scheduler's memory manager decides
    admission, the store only stores. The executor calls the store through `KVStore.EXECUTOR_CALLS`
    alone, so each store makes room its own way: a `KVManager` reserves `prompt_len + output_len - 1`
    tokens (what a request will store, at most: `memory.slots_to_finish`) the first time it is
    scheduled, a `paged_kv_cache.PagedKVManager` hands out blocks as its tokens arrive and really
    copies the batch's swaps (`swapped_out`, `swapped_in`) to the CPU pool and back, and a store of
    one's own does as it defines. The store is the user's: K/V freed in it by hand (kv.free) is named
    in a warning where this executor would free it (`release`, `reset`), and a step of a request
    whose K/V is gone fails in the store.
    """

    n_stages = 1

    def __init__(self, model: OrcaModel, kv: KVStore, clock: Clock = "wall", seed: int = 0) -> None:
        check_instance("model", model, OrcaModel)
        model.check_kv(kv)
        missing = kv.undefined(KVStore.EXECUTOR_CALLS)
        if missing:
            raise ValueError(f"the {type(kv).__name__} does not define {', '.join(missing)}, which the torch executor "
                             "calls on a K/V store to make room for each step and give it back "
                             "(KVStore.EXECUTOR_CALLS; docs/extending.md, \"A K/V store\")")
        self.model, self.kv, self.clock = model, kv, check_choice("clock", clock, ("wall", "iterations"))
        self.seed = check_seed(seed)
        self._samplers: dict[Hashable, RowSampler] = {}
        self.max_context = model.spec.max_context
        self._cuda = model.device.type == "cuda"
        self._held: set = set()

    def check(self, req: Request) -> None:
        """Refuse a request the run could not serve, before it starts: no prompt ids, more K/V than the
        store holds (`KVStore.check_fits`), or an id the store already holds K/V under that this
        executor did not put there (a step run by hand on the same store): its first step would find
        that K/V in the way."""
        check_prompt_ids(req, self.model.spec.vocab, "the torch executor")
        check_sampling(req, self.model.spec.vocab)
        rid = req.req_id
        if rid not in self._held and self.kv.holds(rid):
            raise ValueError(f"request {brief(rid)}: the K/V store already holds K/V under this id, put there outside "
                             f"this executor; free it first (kv.free({brief(rid)})) or give the executor a store of "
                             "its own (model.new_kv)")
        self.kv.check_fits(req)

    def execute(self, batch: Batch) -> StepResult:
        """Room for the step's K/V (`KVStore.make_room`), then the forward, timed."""
        works = batch.works
        reqs = [w.req for w in works]
        req_ids = [r.req_id for r in reqs]
        try:
            swap_s = self.kv.make_room(batch)
        finally:                                # (a refused batch's requests the store took are freed too)
            self._held.update(rid for rid in req_ids if self.kv.holds(rid))
        seq_works: list[SeqWork] = [w.work for w in works]
        token_ids = torch.tensor([t for w in works for t in new_token_ids(w.req, w.n_new, w.n_past)],
                                 dtype=torch.long)
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = self.model.forward_batch(token_ids, seq_works, req_ids, self.kv)
            tokens, logits, logprobs, bad = self._next_tokens(logits, works)
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            logits = self.model.forward_batch(token_ids, seq_works, req_ids, self.kv)
            tokens, logits, logprobs, bad = self._next_tokens(logits, works)
            elapsed = time.perf_counter() - t0
        if bad is None:                         # (after the timing: on CUDA the check waits for the GPU)
            bad = rows_not_finite(logits, req_ids)
        res = StepResult(1.0 if self.clock == "iterations" else elapsed + swap_s, tokens.tolist(), logprobs=logprobs)
        if bad:
            raise NonFiniteLogits(next(iter(bad.values())), {req_ids[i]: why for i, why in bad.items()}, res)
        return res

    @torch.inference_mode()
    def _next_tokens(self, logits: torch.Tensor, works: Sequence[ScheduledSeq]
                     ) -> tuple[torch.Tensor, torch.Tensor, list[TokenLogprobs | None] | None, dict[int, str] | None]:
        """Each work's next token: greedy, but `sampling.pick`'s (drawn, or from the row its bias and
        penalties adjust) for a request with sampling that makes a token this step (`picked_rows`:
        a chunk that does not end its prompt makes none, and draws nothing); the logits after the
        `min_tokens` bans; the log probabilities of the rows that ask for them, from their raw
        logits (None for the others; None at all where no row asks); and the rows that are not
        finite (`rows_not_finite`), found before a pick, where a row is picked (None: not looked
        for, `execute` looks after its timing). Such a row draws nothing and has no log
        probabilities, and the others go on as without it: `execute` raises `NonFiniteLogits`
        with the step as it ran for them (`RowsFailed`)."""
        reqs = [w.req for w in works]
        raw, logits = logits, ban_stops(logits, reqs)
        tokens = logits.argmax(dim=-1)
        rows = picked_rows(works)
        bad = rows_not_finite(logits, [r.req_id for r in reqs]) if rows else None
        for i in rows:
            if i not in bad:
                tokens[i] = draw(self._samplers, self.seed, works[i].req, logits[i])
        asked = [i for i in logprob_rows(works) if bad is None or i not in bad]
        if not asked:
            return tokens, logits, None, bad
        return tokens, logits, step_logprobs(works, asked, raw[asked], tokens[asked]), bad

    def release(self, req: Request) -> None:
        """Free the request's K/V (it finished, left or was preempted). K/V someone freed by hand
        meanwhile (kv.free) is already what release wants, so it is named in a warning, as `reset`
        names it, and the run goes on."""
        rid = req.req_id
        if req.status not in ACTIVE:            # (a preempted request keeps its generator)
            self._samplers.pop(rid, None)
        if rid in self._held:
            self._held.discard(rid)
            if self.kv.holds(rid):
                self.kv.free(rid)
            else:
                _warn_freed_outside([rid], "")

    def reset(self) -> None:
        """A run starts (or one was abandoned): free the K/V of every request this executor put in the
        store and drop its generators. K/V someone freed by hand meanwhile is named in a warning, and
        the rest is freed all the same: reset ends with nothing held, never half done."""
        gone = sorted((rid for rid in self._held if not self.kv.holds(rid)), key=brief)
        for rid in self._held:
            if self.kv.holds(rid):
                self.kv.free(rid)
        self._held.clear()
        self._samplers.clear()
        if gone:
            _warn_freed_outside(gone, "; the rest of what it held is freed")
