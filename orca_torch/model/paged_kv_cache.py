"""Paged K/V for the torch model: one block pool per layer, a block table per request (lecture §7; vLLM §4).

`kv_cache.KVManager` gives each request one contiguous buffer sized for its whole future. Here
K/V memory is a pool of fixed blocks of `block_size` tokens, shaped as varlen attention reads it:

    pool [n_layers, 2 (K, V), n_blocks, block_size, n_kv_heads, head_dim]

A request owns a list of block ids (its block table); token `t` of it lives in block
`table[t // block_size]` at offset `t % block_size`. Blocks are handed out as the request grows
(`make_room` before each step, `ensure` by hand), from the scheduler's own `paged_memory.BlockPool`
(so both hand out the same ids in the same order), written in place (`write`: an `index_copy_`
into the pool, nothing stored is moved) and read back by a gather (`gather`). The model reaches
them through `PagedStepKV` (the view `PagedKVManager.step_view` gives each step), the paged form
of `kv_views.StepKV` (same methods): the split loop gathers each request's blocks per layer, the
batched decode path gathers them per layer into its padded block and the flat varlen layout once
per step, and the step's new tokens are written back into the blocks. Where a varlen kernel reads
block tables itself (`kernel_takes_blocks`, which `serves_block_tables` answers),
`block_table_layout` hands it the pool as it is: each layer writes its new K/V straight into the
blocks and one kernel call serves every request, with no gather of past K/V. `swap_out` /
`swap_in` copy a request's blocks to a CPU pool (a separate tensor, pinned on CUDA) and back into
whichever device blocks are free then.

Running out of blocks is an error that leaves everything unchanged; what the engine never asks
(writing past the allocated blocks, an unknown request, a double free) fails an assertion. A
request's reads and writes go only through its own block table, so no step can touch another
request's blocks (tested).
"""
from __future__ import annotations

import time
from typing import Hashable, Sequence

import torch

from orca_torch.checks import brief, check_fits_in_memory, check_int, check_req_id
from orca_torch.core.batch import Batch
from orca_torch.core.memory import slots_to_finish
from orca_torch.core.paged_memory import BlockPool, PagedMemory, blocks_for, blocks_to_finish, check_block_owners
from orca_torch.core.request import Request
from orca_torch.model.kv_cache import KVError, KVStore
from orca_torch.model.kv_views import BlockTableKV, FlatKV, PaddedKV, StepLengths
from orca_torch.specs import ModelSpec

BLOCK_TABLE_MULTIPLE = 256


def kernel_takes_blocks(block_size: int) -> bool:
    """Whether torch's varlen kernel can read a pool of `block_size`-token blocks through block
    tables: Flash Attention 2 builds take paged K/V only for blocks of a multiple of
    `BLOCK_TABLE_MULTIPLE` (256) tokens, so smaller blocks (vLLM's 16) go through the gathering path."""
    return block_size % BLOCK_TABLE_MULTIPLE == 0


def _blocks_said(n: int) -> str:
    """`n` blocks in words, "1 block" or "3 blocks"."""
    return f"{n} block{'' if n == 1 else 's'}"


class OutOfBlocksError(KVError, ValueError):
    """Not enough free blocks (device or CPU pool) for what was asked."""


class PagedKVManager(KVStore):
    """Block pool + block tables; same model-facing calls as `KVManager` (`can_append`, `commit`,
    `length`, `has`, `free`) and executor-facing ones (`KVStore.EXECUTOR_CALLS`) plus the paged ones
    (`ensure`, `write`, `gather`, `swap_out`, `swap_in`).

    Both pools are allocated whole here, so pools larger than the host memory available (the device
    pool when it is on the CPU, the CPU pool always) are refused before any is allocated."""

    def __init__(self, spec: ModelSpec | str, n_blocks: int, block_size: int = 16,
                 device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32,
                 cpu_blocks: int = 0) -> None:
        n_blocks, block_size, cpu_blocks = (check_int(name, v, lo) for name, v, lo in (
            ("n_blocks", n_blocks, 1), ("block_size", block_size, 1), ("cpu_blocks", cpu_blocks, 0)))
        super().__init__(spec, device, dtype)
        self.n_blocks, self.block_size, self.cpu_blocks = n_blocks, block_size, cpu_blocks
        s, dtype = self.spec, self.dtype
        host_blocks = cpu_blocks + (n_blocks if self.device.type == "cpu" else 0)
        check_fits_in_memory(f"PagedKVManager {brief(s.name)} ({n_blocks:,} blocks + {cpu_blocks:,} CPU blocks of "
                             f"{block_size:,} tokens in {dtype})", host_blocks * block_size * s.kv_bytes_per_token)
        self.pool = torch.zeros(s.n_layers, 2, n_blocks, block_size, s.n_kv_heads, s.head_dim,
                                device=self.device, dtype=dtype)
        self.cpu_pool = torch.zeros(s.n_layers, 2, cpu_blocks, block_size, s.n_kv_heads, s.head_dim, dtype=dtype,
                                    pin_memory=self.device.type == "cuda" and cpu_blocks > 0)
        self._flat = self.pool.view(s.n_layers, 2, n_blocks * block_size, s.n_kv_heads, s.head_dim)
        self.reset()
        self._check_view_serves_block_tables()

    def _check_view_serves_block_tables(self) -> None:
        """Refuse a subclass whose own `step_view` inherits `serves_block_tables` True (a block size the
        kernel takes): the model would hand a block-table kernel that view's `block_table_layout`, which
        `PagedStepKV` has and a view of one's own may lack (an AttributeError deep in a step, on a GPU only)."""
        mro = type(self).__mro__
        view_from = next(c for c in mro if "step_view" in vars(c))
        said_by = next(c for c in mro if "serves_block_tables" in vars(c))
        if self.serves_block_tables and not issubclass(said_by, view_from):
            raise ValueError(f"{view_from.__name__} defines its own step_view, but serves_block_tables is "
                             f"{said_by.__name__}'s, True for block_size={self.block_size} (a multiple of "
                             f"{BLOCK_TABLE_MULTIPLE}): a block-table kernel would be handed the view's "
                             "block_table_layout(), which PagedStepKV has and a view of one's own may lack; say in "
                             f"{view_from.__name__} whether its view serves block tables (a serves_block_tables "
                             "property: False, or True where the view has block_table_layout)")

    @classmethod
    def mirroring(cls, memory: PagedMemory, model) -> "PagedKVManager":
        """The torch pool behind a scheduler-side `paged_memory.PagedMemory`: the same blocks and block
        size, the same CPU pool, on the model's device and dtype (so whatever the scheduler admits,
        grows or swaps fits here too). Another memory manager holds no blocks to mirror: the contiguous
        store for it is `model.new_kv(n_slots)`."""
        if not isinstance(getattr(model, "spec", None), ModelSpec):
            raise ValueError(f"model must be an OrcaModel (whose spec, device and dtype the pool takes), got "
                             f"{type(model).__name__}")
        if not isinstance(memory, PagedMemory):
            raise ValueError(f"memory must be a PagedMemory (the scheduler's block pool) to mirror, got "
                             f"{type(memory).__name__}; for another memory manager make the K/V store with "
                             "model.new_kv(n_slots)")
        return cls(model.spec, memory.n_blocks, memory.block_size, model.device, model.dtype,
                   cpu_blocks=memory.cpu_blocks)

    def reset(self) -> None:
        """Drop every request (the pools' contents are left as they are; nothing reads a free block)."""
        self._free = BlockPool(self.n_blocks)           # handed out in the scheduler's order
        self._cpu_free = BlockPool(self.cpu_blocks)
        self._table: dict[Hashable, list[int]] = {}
        self._len: dict[Hashable, int] = {}
        self._swapped: dict[Hashable, tuple[list[int], int]] = {}

    # ---- lifecycle -------------------------------------------------------------------------------
    def add(self, req_id: Hashable) -> None:
        """Register a request with no blocks yet. Called by hand (a step run directly), so an id no
        request could have (`checks.req_id_problem`) is refused here (`make_room` calls `_add`)."""
        check_req_id(req_id)
        self._add(req_id)

    def _add(self, req_id: Hashable) -> None:
        """`add` past its check of the id (`make_room`'s requests passed the engine's door, `Request`)."""
        assert req_id not in self._table and req_id not in self._swapped, \
            f"request {brief(req_id)} is already held (on the device or swapped out); free it first"
        self._table[req_id] = []
        self._len[req_id] = 0

    def ensure(self, req_id: Hashable, n_tokens: int) -> None:
        """Allocate blocks until the request can hold `n_tokens` tokens (all or nothing). Called by
        hand (a step run directly), so a count past the model's context is refused here, as
        `KVManager.reserve` refuses it, with nothing allocated (`make_room` calls `_ensure`)."""
        self._blocks(req_id)
        n_tokens = check_int("n_tokens", n_tokens, 0)
        if n_tokens > self.spec.max_context:
            raise ValueError(f"cannot hold {n_tokens} tokens for request {brief(req_id)}: a request holds at most the "
                             f"model's max_context={self.spec.max_context} tokens")
        self._ensure(req_id, n_tokens)

    def _ensure(self, req_id: Hashable, n_tokens: int) -> None:
        """`ensure` past its checks of the count (`make_room`'s works lie within their request's
        context, which the engine's door checked, `Request.check_context`); all or nothing still."""
        table = self._blocks(req_id)
        assert 0 <= n_tokens <= self.spec.max_context, (req_id, n_tokens)
        extra = max(blocks_for(n_tokens, self.block_size) - len(table), 0)
        table += self._take(self._free, extra,
                            f"request {brief(req_id)} needs {extra} more blocks for {n_tokens} tokens")

    def make_room(self, batch: Batch) -> float:
        """Copy the batch's swapped-out requests to the CPU pool and the swapped-in ones back (returns
        the seconds the copies took, on `perf_counter`), then give every work the blocks its new tokens
        need, adding a request fed from its first token. A memory manager that hands out more blocks
        than the store holds is named, as `KVManager.make_room` names one that admits more than the
        contiguous store holds."""
        try:
            t0 = time.perf_counter()
            for r, _ in batch.swapped_out:
                self.swap_out(r.req_id)
            for r, _ in batch.swapped_in:
                self.swap_in(r.req_id)
            if self.device.type == "cuda" and (batch.swapped_out or batch.swapped_in):
                torch.cuda.synchronize()
            swap_s = time.perf_counter() - t0
            for w in batch.works:
                rid = w.req.req_id
                if w.n_past == 0 and not self.holds(rid):
                    self._add(rid)
                self._ensure(rid, w.n_past + w.n_new)
        except OutOfBlocksError as e:
            raise RuntimeError(f"batch {batch.index}: {e}: the engine's memory manager hands out more blocks than "
                               f"the paged K/V store holds ({self.n_blocks} blocks of {self.block_size} tokens, "
                               f"{self.cpu_blocks} CPU blocks); make the store with "
                               "PagedKVManager.mirroring(memory, model)") from None
        return swap_s

    def free(self, req_id: Hashable) -> None:
        """Give the request's blocks back (device or, if swapped out, CPU)."""
        swapped = self._get(self._swapped, req_id)
        assert swapped is not None or req_id in self._table, (
            f"cannot free request {brief(req_id)}: it holds no blocks (never added, or freed already); free each added "
            "request once")
        if swapped is not None:
            del self._swapped[req_id]
            self._cpu_free.give(swapped[0])
        else:
            self._free.give(self._table.pop(req_id))
            del self._len[req_id]

    def swap_out(self, req_id: Hashable) -> int:
        """Copy the request's stored K/V to the CPU pool and free its device blocks; returns its tokens."""
        table, n = self._blocks(req_id), self._len[req_id]
        need = blocks_for(n, self.block_size)
        cpu = self._take(self._cpu_free, need, f"swapping out request {brief(req_id)} needs {need} CPU blocks")
        if need:
            src = self.pool[:, :, torch.tensor(table[:need], device=self.device)]
            self.cpu_pool[:, :, torch.tensor(cpu)] = src.to("cpu", non_blocking=False)
        self._free.give(self._table.pop(req_id))
        del self._len[req_id]
        self._swapped[req_id] = (cpu, n)
        return n

    def swap_in(self, req_id: Hashable) -> int:
        """Copy a swapped-out request back into free device blocks; returns its tokens."""
        swapped = self._get(self._swapped, req_id)
        assert swapped is not None, (f"cannot swap in request {brief(req_id)}: it is not swapped out; only a request "
                                     "swap_out moved to the CPU pool can be swapped in")
        cpu, n = swapped
        table = self._take(self._free, len(cpu), f"swapping in request {brief(req_id)} needs {len(cpu)} blocks")
        del self._swapped[req_id]
        if cpu:
            src = self.cpu_pool[:, :, torch.tensor(cpu)]
            self.pool[:, :, torch.tensor(table, device=self.device)] = src.to(self.device)
        self._cpu_free.give(cpu)
        self._table[req_id] = table
        self._len[req_id] = n
        return n

    @staticmethod
    def _take(free: BlockPool, n: int, need: str) -> list[int]:
        """`n` blocks off the pool `free` (device or CPU), or OutOfBlocksError (`need` says who needs
        how many) with nothing taken."""
        if n > free.n_free:
            raise OutOfBlocksError(f"{need} but only {free.n_free} of {free.n_blocks} are free")
        return free.take(n)

    # ---- queries ---------------------------------------------------------------------------------
    def has(self, req_id: Hashable) -> bool:
        """On the device (a swapped-out request is not)."""
        return self._get(self._table, req_id) is not None

    def is_swapped(self, req_id: Hashable) -> bool:
        return self._get(self._swapped, req_id) is not None

    def holds(self, req_id: Hashable) -> bool:
        """On the device or swapped out."""
        return self.has(req_id) or self.is_swapped(req_id)

    def check_fits(self, req: Request) -> None:
        """Refuse a request whose `slots_to_finish` tokens need more blocks than the device pool has."""
        if blocks_to_finish(req, self.block_size) > self.n_blocks:
            raise ValueError(f"request {brief(req.req_id)} stores up to {slots_to_finish(req)} tokens' K/V (prompt "
                             f"{req.prompt_len} + output {req.output_len} - 1), more than the paged K/V store's "
                             f"{self.n_blocks} blocks of {self.block_size} hold: it could never run; give the "
                             "model a larger K/V store")

    def length(self, req_id: Hashable) -> int:
        self._blocks(req_id)
        return self._len[req_id]

    def capacity(self, req_id: Hashable) -> int:
        """Tokens the request's blocks hold."""
        return len(self._blocks(req_id)) * self.block_size

    @property
    def serves_block_tables(self) -> bool:
        """Whether torch's block-table kernel takes this pool's blocks (`kernel_takes_blocks`)."""
        return kernel_takes_blocks(self.block_size)

    def block_table(self, req_id: Hashable) -> list[int]:
        return list(self._blocks(req_id))

    @property
    def n_slots(self) -> int:
        return self.n_blocks * self.block_size

    @property
    def blocks_free(self) -> int:
        return self._free.n_free

    @property
    def cpu_blocks_free(self) -> int:
        return self._cpu_free.n_free

    @property
    def slots_reserved(self) -> int:
        return (self.n_blocks - self._free.n_free) * self.block_size

    @property
    def slots_used(self) -> int:
        return sum(self._len.values())

    @property
    def n_requests(self) -> int:
        return len(self._table)

    # ---- the model's side --------------------------------------------------------------------------
    def step_view(self, req_ids: Sequence[Hashable], past: Sequence[int], sizes: Sequence[int]) -> "PagedStepKV":
        """The step's K/V through the requests' block tables (`PagedStepKV`)."""
        return PagedStepKV(self, req_ids, past, sizes)

    def slots(self, req_id: Hashable, start: int, stop: int) -> torch.Tensor:
        """Flat pool indices (block * block_size + offset) of the request's tokens `start .. stop`."""
        table = self._blocks(req_id)
        assert 0 <= start <= stop <= len(table) * self.block_size, (
            f"request {brief(req_id)}: tokens {start}..{stop} lie outside its {_blocks_said(len(table))}; only tokens "
            f"0..{len(table) * self.block_size} fit (ensure more blocks first)")
        pos = torch.arange(start, stop)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size] if stop > start else pos
        return (blocks * self.block_size + pos % self.block_size).to(self.device)

    def write(self, layer: int, slots: torch.Tensor, kv_new: torch.Tensor) -> None:
        """Store new K/V `[L, 2, n_kv, d]` at flat `slots` `[L]` of `layer`, in place."""
        self._flat[layer].index_copy_(1, slots, kv_new.transpose(0, 1))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` at flat `slots`, each `[n, n_kv, d]` (a copy: the blocks are not contiguous)."""
        kv = self._flat[layer].index_select(1, slots)
        return kv[0], kv[1]

    def commit(self, req_id: Hashable, n_new: int) -> None:
        """Mark `n_new` more tokens as stored (after every layer wrote them; `can_append` allowed them)."""
        table = self._blocks(req_id)
        new_len = self._len[req_id] + n_new
        assert n_new >= 0, f"request {brief(req_id)}: committing {n_new} tokens (a commit stores 0 or more)"
        assert new_len <= len(table) * self.block_size, (
            f"request {brief(req_id)}: committing {n_new} tokens after {self._len[req_id]} exceeds its "
            f"{_blocks_said(len(table))}, room for {len(table) * self.block_size} tokens (ensure more blocks first)")
        self._len[req_id] = new_len

    def block_tables(self, req_ids: Sequence[Hashable]) -> torch.Tensor:
        """`[B, max blocks]` int32 block tables (padded with 0) for a varlen kernel."""
        tables = [self._blocks(r) for r in req_ids]
        width = max(1, max(len(t) for t in tables))
        out = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        return out.to(self.device)

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is free or owned by exactly one request (tests)."""
        check_block_owners(self._table.values(), [cpu for cpu, _ in self._swapped.values()], self._free,
                           self._cpu_free)

    def _blocks(self, req_id: Hashable) -> list[int]:
        t = self._get(self._table, req_id)
        assert t is not None, (f"request {brief(req_id)} is swapped out; swap it in first" if req_id in self._swapped
                               else f"unknown request {brief(req_id)}: never added, or freed already; add it first")
        return t

    def __repr__(self) -> str:
        return (f"PagedKVManager({self.spec.name}, blocks {self.n_blocks - self._free.n_free}/{self.n_blocks} x "
                f"{self.block_size}, requests={len(self._table)}, swapped={len(self._swapped)})")


class _Writes:
    """`[layer].copy_(kv_new [2, n_kv, L, d])` writes a request's new K/V into its slots of that layer."""

    def __init__(self, kv: PagedKVManager, slots: torch.Tensor) -> None:
        self.kv, self.slots = kv, slots

    def __getitem__(self, layer: int) -> "_LayerWrite":
        return _LayerWrite(self.kv, layer, self.slots)


class _LayerWrite:
    def __init__(self, kv: PagedKVManager, layer: int, slots: torch.Tensor) -> None:
        self.kv, self.layer, self.slots = kv, layer, slots

    def copy_(self, src: torch.Tensor) -> None:
        self.kv.write(self.layer, self.slots, src.permute(2, 0, 1, 3))      # -> [L, 2, n_kv, d]


class _Keys:
    """`[layer]` gathers K^T `[n_kv, d, n_ctx]` of a request's context."""

    def __init__(self, kv: PagedKVManager, slots: torch.Tensor) -> None:
        self.kv, self.slots = kv, slots

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.kv._flat[layer, 0].index_select(0, self.slots).permute(1, 2, 0)


class _Values(_Keys):
    """`[layer]` gathers V `[n_kv, n_ctx, d]` of a request's context."""

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.kv._flat[layer, 1].index_select(0, self.slots).transpose(0, 1)


class PagedStepKV:
    """One step's K/V through the block tables, in the layouts the model's attention paths read
    (the same methods as `kv_views.StepKV`): the split loop's per-layer writes and gathers, the
    batched decode path's padded block, and the variable-length path's flat layout, each gathered
    from the pool by slot index and written back to the request's own blocks by `finish`."""

    def __init__(self, kv: PagedKVManager, req_ids: Sequence[Hashable], past: Sequence[int],
                 sizes: Sequence[int]) -> None:
        self.kv, self.req_ids, self.past, self.sizes = kv, list(req_ids), list(past), list(sizes)
        self._ctx: list[torch.Tensor] | None = None
        self._padded: PaddedKV | None = None
        self._pad_src: torch.Tensor | None = None       # the padded layout's gather: slots of stored tokens,
        self._pad_at: tuple[torch.Tensor, torch.Tensor] | None = None  # their (row, position) in it,
        self._pad_new: torch.Tensor | None = None       # and each row's slot for its new token
        self._flat: FlatKV | None = None
        self._flat_new: torch.Tensor | None = None

    @property
    def ctx(self) -> list[torch.Tensor]:
        """Per request, the flat slots of its whole context `0 .. n_past + n_new` (the gathering paths)."""
        if self._ctx is None:
            self._ctx = [self.kv.slots(r, 0, p + L) for r, p, L in zip(self.req_ids, self.past, self.sizes)]
        return self._ctx

    def split_views(self, i: int) -> tuple:
        """Request `i`'s per-layer writes of its new K/V, K^T and V (gathered when indexed)."""
        s, p = self.ctx[i], self.past[i]
        return _Writes(self.kv, s[p:]), _Keys(self.kv, s), _Values(self.kv, s)

    def gather_padded(self, idx: list[int]) -> PaddedKV:
        """The padded layout of the one-token requests `idx`; `load_padded(layer)` gathers each layer.
        Only each row's own stored tokens are gathered: its padding stays zero, as in `StepKV`, so no
        row reads a slot of another request's blocks (a masked key still multiplies its value by 0,
        and 0 * inf is NaN)."""
        kv, dev = self.kv, self.kv.device
        past = [self.past[i] for i in idx]
        k_max = max(past) + 1
        rows = torch.arange(len(idx)).repeat_interleave(torch.tensor(past))
        cols = torch.cat([torch.arange(p) for p in past])
        self._pad_at = (rows.to(dev), cols.to(dev))                            # (row, position) of each stored token
        self._pad_src = torch.cat([self.ctx[i][:p] for i, p in zip(idx, past)])
        self._pad_new = torch.stack([self.ctx[i][p] for i, p in zip(idx, past)])
        s = kv.spec
        cache = torch.zeros(2, len(idx), s.n_kv_heads, k_max, s.head_dim, device=dev, dtype=kv.dtype)
        pos = torch.tensor(past, device=dev)
        mask = (torch.arange(k_max, device=dev)[None, :] > pos[:, None])[:, None, None, :]
        self._padded = PaddedKV(idx, cache, torch.arange(len(idx), device=dev), pos, mask, [], [], [])
        return self._padded

    def load_padded(self, layer: int) -> torch.Tensor:
        pk = self._padded
        if self._pad_src.numel():
            rows, cols = self._pad_at
            pk.cache[:, rows, :, cols] = self.kv._flat[layer].index_select(1, self._pad_src).transpose(0, 1)
        return pk.cache

    def gather_flat(self) -> FlatKV:
        """Every request's K/V back to back (this step's slots included), gathered from the pool."""
        dev = self.kv.device
        ctx, cu_q, cu_k = lengths = StepLengths.of(self.past, self.sizes)
        cache = self.kv._flat.index_select(2, torch.cat(self.ctx))              # [n_layers, 2, sum K, n_kv, d]
        new_rows = lengths.new_rows(self.past, self.sizes).to(dev)
        self._flat_new = torch.cat([s[p:] for s, p in zip(self.ctx, self.past)])
        self._flat = FlatKV(cache, new_rows, cu_q.to(dev, torch.int32), cu_k.to(dev, torch.int32),
                            max(self.sizes), max(ctx))
        return self._flat

    def block_table_layout(self) -> BlockTableKV:
        """The pool itself with block tables and lengths, for a kernel that reads blocks: nothing is
        gathered, each layer writes its new K/V into `new_slots` in place, `finish` only commits."""
        dev = self.kv.device
        ctx, cu_q, cu_k = StepLengths.of(self.past, self.sizes)
        new_slots = torch.cat([self.kv.slots(r, p, p + L) for r, p, L in zip(self.req_ids, self.past, self.sizes)])
        return BlockTableKV(self.kv.pool, self.kv._flat, new_slots, self.kv.block_tables(self.req_ids),
                            torch.tensor(ctx, dtype=torch.int32, device=dev), cu_q.to(dev, torch.int32),
                            cu_k.to(dev, torch.int32), max(self.sizes), max(ctx))

    def finish(self) -> None:
        """Write the gathered layouts' new tokens into the requests' blocks, then commit the step."""
        pool = self.kv._flat                                                       # [n_layers, 2, S, n_kv, d]
        if self._padded is not None:
            pk = self._padded
            new = torch.stack(pk.new, dim=0)                                       # [n_layers, B, 2, n_kv, d]
            pool.index_copy_(2, self._pad_new, new.transpose(1, 2))
        if self._flat is not None:
            pool.index_copy_(2, self._flat_new, self._flat.cache[:, :, self._flat.new_rows])
        self._padded = self._flat = None
        for r, L in zip(self.req_ids, self.sizes):
            self.kv.commit(r, L)
