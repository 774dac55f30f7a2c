"""A K/V store of one's own plugs into the model through `KVStore`'s contract alone (`length`,
`capacity`, `step_view`): the model asks the store for the step's view and never looks at its type,
so a store in another layout, or one that counts what the step reads, gives the built-in store's tokens.
The torch executor likewise calls `KVStore.EXECUTOR_CALLS` alone, so such a store makes room its own way."""
from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence

import pytest
import torch

from orca_torch.core.batch import Batch, SeqWork
from orca_torch.core.engine import Engine
from orca_torch.core.memory import TokenMemory, UnlimitedMemory
from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.model.kv_cache import KVManager, KVStore
from orca_torch.model.kv_views import StepKV
from orca_torch.model.orca_model import OrcaModel
from orca_torch.model.torch_executor import TorchExecutor
from test_fused_attention import reference_varlen


class TokenMajorKV(KVStore):
    """Each request's K/V token-major, `[n_layers, 2, tokens, n_kv, d]`, not the built-in store's
    `[n_layers, 2, n_kv, tokens, d]`: `storage` hands `StepKV` a transposed view of it, so every write
    the step makes lands in this layout."""

    def __init__(self, spec, device="cpu", dtype=torch.float32) -> None:
        super().__init__(spec, device, dtype)
        self.bufs: dict[Hashable, torch.Tensor] = {}
        self.lens: dict[Hashable, int] = {}

    def add(self, req_id: Hashable, n_tokens: int) -> None:
        s = self.spec
        self.bufs[req_id] = torch.zeros(s.n_layers, 2, n_tokens, s.n_kv_heads, s.head_dim, dtype=self.dtype)
        self.lens[req_id] = 0

    def length(self, req_id: Hashable) -> int:
        return self.lens[req_id]

    def capacity(self, req_id: Hashable) -> int:
        return self.bufs[req_id].shape[2]

    def storage(self, req_id: Hashable) -> torch.Tensor:
        return self.bufs[req_id].transpose(2, 3)

    def commit(self, req_id: Hashable, n_new: int) -> None:
        self.lens[req_id] += n_new

    def step_view(self, req_ids: Sequence[Hashable], past: Sequence[int], sizes: Sequence[int]) -> StepKV:
        return StepKV(self, req_ids, past, sizes)


class GrowingKV(TokenMajorKV):
    """`TokenMajorKV` under the torch executor (`KVStore.EXECUTOR_CALLS`), subclassing neither built-in
    store: it makes room its own way, each request's buffer grown to exactly the tokens a step brings
    (a copy), where `KVManager` reserves a request's future and `PagedKVManager` hands out blocks."""

    def __init__(self, spec, device="cpu", dtype=torch.float32) -> None:
        super().__init__(spec, device, dtype)
        self.grown = 0

    def holds(self, req_id: Hashable) -> bool:
        return req_id in self.bufs

    def check_fits(self, req: Request) -> None:
        pass                                    # it grows without a bound: every request the engine takes fits

    def make_room(self, batch: Batch) -> float:
        for w in batch.works:
            rid, short = w.req.req_id, w.n_past + w.n_new
            if w.n_past == 0 and not self.holds(rid):
                self.add(rid, 0)
            short -= self.capacity(rid)
            if short > 0:
                s = self.spec
                more = torch.zeros(s.n_layers, 2, short, s.n_kv_heads, s.head_dim, dtype=self.dtype)
                self.bufs[rid] = torch.cat([self.bufs[rid], more], dim=2)
                self.grown += 1
        return 0.0

    def free(self, req_id: Hashable) -> None:
        del self.bufs[req_id], self.lens[req_id]


class CountingStepKV(StepKV):
    """The built-in view, counting each call the model makes on it."""

    def __init__(self, kv: "CountingKV", *args) -> None:
        super().__init__(kv, *args)
        self.calls = kv.calls

    def split_views(self, i):
        self.calls["split_views"] += 1
        return super().split_views(i)

    def load_padded(self, layer):
        self.calls["load_padded"] += 1
        return super().load_padded(layer)

    def gather_flat(self):
        self.calls["gather_flat"] += 1
        return super().gather_flat()

    def finish(self):
        self.calls["finish"] += 1
        super().finish()


class CountingKV(KVManager):
    """The built-in contiguous store whose steps go through `CountingStepKV`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter = Counter()

    def step_view(self, req_ids, past, sizes) -> CountingStepKV:
        return CountingStepKV(self, req_ids, past, sizes)


PROMPTS = {0: [5, 9, 11, 200, 7, 3], 1: [40, 2, 8], 2: [17, 1, 99, 4, 4, 60, 12, 8, 31]}
SCHEDULE = [{0: 6, 1: 3}, {0: 1, 1: 1, 2: 4}, {0: 1, 1: 1, 2: 5}, {0: 1, 1: 1, 2: 1}, {0: 1, 2: 1}, {2: 1}]


def greedy(model: OrcaModel, kv: KVStore, hold) -> tuple[dict[int, list[int]], list[torch.Tensor]]:
    """Run `SCHEDULE` (prompts, a chunked prompt, decodes, mixed) greedily; each request's tokens made,
    and every step's logits."""
    for r, prompt in PROMPTS.items():
        hold(kv, r, len(prompt) + 8)
    fed = {r: 0 for r in PROMPTS}
    made: dict[int, list[int]] = {r: [] for r in PROMPTS}
    all_logits = []
    for step in SCHEDULE:
        ids = [r for r in step]
        ids_in = []
        for r in ids:
            stream = PROMPTS[r] + made[r]
            ids_in += stream[fed[r]:fed[r] + step[r]]
        works = [SeqWork(step[r], fed[r]) for r in ids]
        logits = model.forward_batch(torch.tensor(ids_in), works, ids, kv)
        all_logits.append(logits)
        for r, w, row in zip(ids, works, logits):
            fed[r] += w.n_new
            if fed[r] >= len(PROMPTS[r]):
                made[r].append(int(row.argmax()))
    return made, all_logits


def reserve(kv, r, n):
    kv.reserve(r, n)


def add(kv, r, n):
    kv.add(r, n)


def model_on(path: str) -> OrcaModel:
    model = OrcaModel("tiny", seed=3, attention="split" if path == "split" else "fused")
    if path == "varlen":
        model.varlen_kernel = reference_varlen
    return model


@pytest.mark.parametrize("path", ["split", "batched", "varlen"])
def test_a_store_in_another_layout_gives_the_built_in_stores_tokens_and_holds_the_same_kv(path):
    model = model_on(path)
    assert model.step_path(TokenMajorKV("tiny")) == path
    built_in = model.new_kv(64)
    ref, ref_logits = greedy(model, built_in, reserve)
    mine = TokenMajorKV("tiny")
    got, logits = greedy(model, mine, add)
    assert got == ref and all(len(t) for t in got.values())
    for a, b in zip(ref_logits, logits):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    for r in PROMPTS:
        n = built_in.length(r)
        assert mine.length(r) == n
        assert torch.allclose(mine.bufs[r][:, :, :n], built_in.storage(r)[:, :, :, :n].transpose(2, 3), atol=1e-6)


@pytest.mark.parametrize("path, reads", [("split", "split_views"), ("batched", "load_padded"),
                                         ("varlen", "gather_flat")])
def test_the_model_reads_kv_only_through_the_view_the_store_gives(path, reads):
    model = model_on(path)
    ref, _ = greedy(model, model.new_kv(64), reserve)
    kv = CountingKV("tiny", 64)
    got, _ = greedy(model, kv, reserve)
    assert got == ref
    assert kv.calls["finish"] == len(SCHEDULE) and kv.calls[reads] > 0


def test_a_store_of_ones_own_runs_under_the_torch_executor_with_the_built_in_stores_tokens():
    model = OrcaModel("tiny", seed=3)

    def requests():
        return [Request(r, 0.1 * r, len(p), 5, prompt_ids=p) for r, p in PROMPTS.items()]

    ref = Engine(TorchExecutor(model, model.new_kv(64), clock="iterations"), UnlimitedMemory(),
                 SchedulerConfig(max_bs=2)).run(reqs := requests())
    kv = CountingKV("tiny", 64)
    res = Engine(TorchExecutor(model, kv, clock="iterations"), UnlimitedMemory(), SchedulerConfig(max_bs=2)).run(
        mine := requests())
    assert [r.output_ids for r in mine] == [r.output_ids for r in reqs] and res.n == ref.n == 3
    assert kv.calls["finish"] > 0 and kv.n_requests == 0


def test_a_store_of_ones_own_makes_room_its_own_way_under_the_torch_executor_through_a_preempting_run():
    """The executor refused any store but a `KVManager` or a `PagedKVManager` (subclasses included) and
    made room in each by its type; it calls `KVStore.EXECUTOR_CALLS` alone now, so a store that grows
    each request's buffer step by step runs a run that preempts and recomputes, with the built-in
    store's tokens, and gives back every buffer."""
    model = OrcaModel("tiny", seed=3)

    def requests():
        return [Request(r, 0.0, len(p), 5, prompt_ids=p) for r, p in PROMPTS.items()]

    config = SchedulerConfig(max_bs=3)
    ref = Engine(TorchExecutor(model, model.new_kv(64), clock="iterations"), TokenMemory(16), config).run(
        reqs := requests())
    kv = GrowingKV("tiny")
    res = Engine(TorchExecutor(model, kv, clock="iterations"), TokenMemory(16), config).run(mine := requests())
    assert [r.output_ids for r in mine] == [r.output_ids for r in reqs] and res.n == ref.n == 3
    assert res.n_preemptions.sum() == ref.n_preemptions.sum() > 0
    assert kv.grown == res.step_n_seqs.sum() and not kv.bufs     # each work grew its buffer to what it brings
