"""One step's access to the Attention K/V manager: the only code of the model that reads or writes
stored K/V (lecture §4.2). The model asks its store for the step's view (`kv_cache.KVStore.step_view`)
and calls only the `StepView` methods on it, never looking at the store's type.

Selective batching needs K/V in one of three layouts, all built here from the manager's storage:

- the split loop (the lecture's reference): per request and per layer, a view of the slots the
  step's new tokens go to, and views of K^T and V over `n_past + n_new` tokens; new K/V is written
  in place, layer by layer, so nothing stored is ever copied;
- the batched decode path: the stored K/V of the step's one-token rows gathered, layer by layer,
  into one padded block `[2, B, n_kv, K_max, d]` (allocated once per step, refilled per layer in
  one batched copy); each layer inserts its new K/V there with one indexed write, and `finish`
  copies the new tokens back to the manager;
- the variable-length path: every request's K/V gathered once per step into the flat layout
  `[n_layers, 2, sum(n_past + n_new), n_kv, d]` with cumulative lengths, the layout a
  variable-length attention kernel reads; new K/V inserted per layer and copied back by `finish`.

The two gathered layouts copy each request's past once per step because this manager keeps one
buffer per request; the paged manager (`paged_kv_cache.py`) can hand a kernel its block tables instead
(`BlockTableKV`). A K/V store of one's own (another layout, quantized, counting reads) needs on the
model's side only a `KVStore` subclass whose `step_view` returns a view with the `StepView` methods,
as `KVManager.step_view` returns a `StepKV` and `PagedKVManager.step_view` a `paged_kv_cache.PagedStepKV`
(docs/extending.md, "A K/V store").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, NamedTuple, Protocol, Sequence

import torch


@dataclass
class FlatKV:
    """The variable-length layout of one step."""

    cache: torch.Tensor      # [n_layers, 2, sum K, n_kv, d]
    new_rows: torch.Tensor   # [sum L] row of each new token in `cache`
    cu_q: torch.Tensor       # [B + 1] int32 cumulative n_new
    cu_k: torch.Tensor       # [B + 1] int32 cumulative n_past + n_new
    max_q: int
    max_k: int


@dataclass
class BlockTableKV:
    """A paged step as a block-table kernel reads it: the pool itself, no copy of past K/V."""

    pool: torch.Tensor         # [n_layers, 2, n_blocks, block_size, n_kv, d]
    flat_pool: torch.Tensor    # the same storage as [n_layers, 2, n_blocks * block_size, n_kv, d]
    new_slots: torch.Tensor    # [sum L] flat slot of each new token (block * block_size + offset)
    block_tables: torch.Tensor # [B, max blocks] int32
    seqused_k: torch.Tensor    # [B] int32 n_past + n_new
    cu_q: torch.Tensor         # [B + 1] int32 cumulative n_new
    cu_k: torch.Tensor         # [B + 1] int32 cumulative n_past + n_new
    max_q: int
    max_k: int


@dataclass
class PaddedKV:
    """The padded layout of the step's one-token rows, one layer at a time."""

    idx: list[int]           # which requests (positions in the step) these rows are
    cache: torch.Tensor      # [2, B, n_kv, K_max, d] the current layer's K/V (reused layer to layer)
    batch_idx: torch.Tensor  # [B] 0..B-1
    pos: torch.Tensor        # [B] slot of each row's new token (its n_past)
    mask: torch.Tensor       # [B, 1, 1, K_max] True = no key there
    sources: list[tuple[torch.Tensor, ...]]  # per row, per layer: stored K/V [2, n_kv, n_past, d]
    targets: list[torch.Tensor]              # per row: cache[:, j, :, :n_past]
    new: list[torch.Tensor]                  # per layer done: this step's K/V [B, 2, n_kv, d]


class StepLengths(NamedTuple):
    """A step's lengths as the variable-length layouts count them (on the CPU, int64)."""

    ctx: list[int]           # [B] n_past + n_new per request
    cu_q: torch.Tensor       # [B + 1] cumulative n_new
    cu_k: torch.Tensor       # [B + 1] cumulative n_past + n_new

    @staticmethod
    def of(past: Sequence[int], sizes: Sequence[int]) -> "StepLengths":
        ctx = [p + L for p, L in zip(past, sizes)]
        return StepLengths(ctx, torch.tensor([0, *sizes]).cumsum(0), torch.tensor([0, *ctx]).cumsum(0))

    def new_rows(self, past: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """`[sum L]` the row of each new token in the flat layout, where request i's keys start at
        `cu_k[i]` and its new tokens follow its `n_past` stored ones."""
        shift = (self.cu_k[:-1] + torch.tensor(past) - self.cu_q[:-1]).repeat_interleave(torch.tensor(sizes))
        return torch.arange(int(self.cu_q[-1])) + shift


class StepView(Protocol):
    """What the model calls on the view a store's `step_view` gives it, for one step: `plan_step` takes
    the layout of the path `OrcaModel.step_path` picks (`split_views` per split request, `gather_padded`
    for the batched one-token rows, `gather_flat` for a variable-length kernel, `block_table_layout`
    only where the store `serves_block_tables`), each layer reads and writes through what they
    returned (`load_padded` per layer), and `finish`, after the last layer, stores the step's new
    K/V the gathered layouts hold and commits the step in the store."""

    def split_views(self, i: int) -> tuple: ...
    def gather_padded(self, idx: list[int]) -> PaddedKV: ...
    def load_padded(self, layer: int) -> torch.Tensor: ...
    def gather_flat(self) -> FlatKV: ...
    def finish(self) -> None: ...


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Many copies in one dispatch where torch has it (the copies are the same either way)."""
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(targets, sources)
    else:
        for t, s in zip(targets, sources):
            t.copy_(s)


class StepKV:
    """K/V of the requests of one step, in the layouts the attention paths read: the view
    `kv_cache.KVManager.step_view` gives, and a view for any store whose `storage(req_id)` is a
    (possibly strided) `[n_layers, 2, n_kv, capacity, d]` and whose `commit` counts the tokens
    stored. (`kv_cache` imports this module, so `kv` is annotated by name only.)"""

    def __init__(self, kv: "kv_cache.KVManager", req_ids: Sequence[Hashable], past: Sequence[int],
                 sizes: Sequence[int]) -> None:
        self.kv = kv
        self.req_ids = list(req_ids)
        self.past = list(past)
        self.sizes = list(sizes)
        self.bufs = [kv.storage(r) for r in req_ids]    # each [n_layers, 2, n_kv, reserved, d]
        self._padded: PaddedKV | None = None
        self._flat: FlatKV | None = None
        self._flat_offsets: list[int] = []

    # ---- the split loop ----------------------------------------------------------------------
    def split_views(self, i: int) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Request `i`'s per-layer views: slots to write `[2, n_kv, L, d]`, K^T `[n_kv, d, n_ctx]`,
        V `[n_kv, n_ctx, d]` (taken once per step, not per layer)."""
        buf, p, L = self.bufs[i], self.past[i], self.sizes[i]
        ctx = buf[:, :, :, : p + L]
        return (ctx[:, :, :, p:].unbind(0), ctx[:, 0].transpose(-1, -2).unbind(0), ctx[:, 1].unbind(0))

    # ---- the batched decode path ---------------------------------------------------------------
    def gather_padded(self, idx: list[int]) -> PaddedKV:
        """Set up the padded layout of the one-token requests `idx` (longest context among them);
        `load_padded(layer)` fills it with that layer's stored K/V."""
        dev = self.bufs[0].device
        past = [self.past[i] for i in idx]
        k_max = max(past) + 1
        b0 = self.bufs[idx[0]]
        _, _, n_kv, _, d = b0.shape
        cache = torch.zeros(2, len(idx), n_kv, k_max, d, device=dev, dtype=b0.dtype)
        rows = [j for j, p in enumerate(past) if p]
        sources = [self.bufs[idx[j]][:, :, :, :past[j]].unbind(0) for j in rows]
        targets = [cache[:, j, :, :past[j]] for j in rows]
        pos = torch.tensor(past, device=dev)
        mask = (torch.arange(k_max, device=dev)[None, :] > pos[:, None])[:, None, None, :]
        self._padded = PaddedKV(idx, cache, torch.arange(len(idx), device=dev), pos, mask, sources, targets, [])
        return self._padded

    def load_padded(self, layer: int) -> torch.Tensor:
        """The padded block `[2, B, n_kv, K_max, d]` holding layer `layer`'s stored K/V (slots past
        each row's n_past hold zeros or an earlier layer's new token, which the mask hides)."""
        pk = self._padded
        if pk.targets:
            _copy_all(pk.targets, [src[layer] for src in pk.sources])
        return pk.cache

    # ---- the variable-length path --------------------------------------------------------------
    def gather_flat(self) -> FlatKV:
        """Every request's stored K/V back to back, with room for this step's tokens after each."""
        dev = self.bufs[0].device
        n_layers, _, n_kv, _, d = self.bufs[0].shape
        ctx, cu_q, cu_k = lengths = StepLengths.of(self.past, self.sizes)
        cache = torch.empty(n_layers, 2, int(cu_k[-1]), n_kv, d, device=dev, dtype=self.bufs[0].dtype)
        self._flat_offsets = cu_k.tolist()
        for buf, p, off in zip(self.bufs, self.past, self._flat_offsets):
            if p:
                cache[:, :, off:off + p] = buf[:, :, :, :p].transpose(2, 3)
        new_rows = lengths.new_rows(self.past, self.sizes)
        self._flat = FlatKV(cache, new_rows.to(dev), cu_q.to(dev, torch.int32), cu_k.to(dev, torch.int32),
                            max(self.sizes), max(ctx))
        return self._flat

    # ---- end of step ----------------------------------------------------------------------------
    def finish(self) -> None:
        """Copy the new tokens of the gathered layouts back to the manager, then commit the step."""
        if self._padded is not None:
            pk = self._padded
            new = torch.stack(pk.new, dim=1)                            # [B, n_layers, 2, n_kv, d]
            _copy_all([self.bufs[i][:, :, :, self.past[i]] for i in pk.idx], list(new.unbind(0)))
        if self._flat is not None:
            fk = self._flat
            for buf, p, L, off in zip(self.bufs, self.past, self.sizes, self._flat_offsets):
                buf[:, :, :, p:p + L] = fk.cache[:, :, off + p:off + p + L].transpose(2, 3)
        self._padded = self._flat = None
        for r, L in zip(self.req_ids, self.sizes):
            self.kv.commit(r, L)
