"""Paged K/V for the scheduler: blocks on demand, preemption by recompute or swap (lecture §5.1, §6.1, §7).

Orca sets aside a request's whole future K/V when it admits it (`memory.ReservationMemory`); vLLM's
PagedAttention instead cuts K/V memory into fixed blocks of `block_size` tokens and gives a request
a block only when its last one is full. What is occupied is then what holds tokens, plus the empty
tail of each request's last block (internal fragmentation, at most `block_size - 1` tokens each).
The counters say exactly that: `slots_reserved = blocks in use x block_size`, `slots_used = tokens`.

Nothing is set aside for the future, so memory can run out while requests grow. `grow` then answers
False and the scheduler preempts its policy's victim (`Scheduler.victim`: the latest arrival, vLLM's
policy, unless a new policy names another), and this manager either
- `preemption="recompute"`: drops its blocks; it waits again and re-feeds prompt + output, or
- `preemption="swap"`: copies its blocks into a CPU pool of `cpu_blocks` blocks and back when it is
  readmitted (`try_admit` is the swap-in); when the CPU pool is full it falls back to recompute and
  counts it (`n_swap_fallbacks`).

Admission keeps `watermark_blocks` free (vLLM's watermark, 1% of the pool by default) so a request
admitted now does not force a preemption at the very next decode step. The manager holds Python
integers only — block ids in free lists — so the same object drives the paper GPU and the torch model;
on the torch side `PagedKVManager.mirroring(this, model)` (`model/paged_kv_cache.py`) holds the
tensors in a pool of the same sizes, so whatever this manager admits, grows or swaps fits there too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, Literal

from orca_torch.checks import brief, check_choice, check_int
from orca_torch.core.memory import MAX_SLOTS, MemoryManager, slots_to_finish
from orca_torch.core.request import Request

Preemption = Literal["recompute", "swap"]
BLOCK_SIZE = 16
"""Tokens a block holds unless told otherwise (vLLM's default)."""


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that hold `n_tokens` tokens."""
    return -(-n_tokens // block_size)


def blocks_to_finish(req: Request, block_size: int) -> int:
    """Blocks `req` holds at its last step, those of its `slots_to_finish` tokens' K/V."""
    return blocks_for(slots_to_finish(req), block_size)


def default_watermark(n_blocks: int) -> int:
    """The blocks admission keeps free in a pool of `n_blocks` unless told otherwise (vLLM's 1%)."""
    return n_blocks // 100


def pool_admitting(blocks: int) -> int:
    """Blocks of a pool large enough that its `default_watermark` still lets `blocks` be admitted."""
    return blocks + -(-blocks // 99)


def check_block_owners(tables: Iterable[list[int]], swapped: Iterable[list[int]], free: BlockPool,
                       cpu_free: BlockPool) -> None:
    """Raise AssertionError unless every block of the device pool `free` is free or in exactly one
    of `tables`, and every block of the CPU pool `cpu_free` free or in exactly one of `swapped`
    (the invariant of `PagedMemory` and of the torch pool mirroring it, for tests)."""
    owned = [b for t in tables for b in t]
    assert len(owned) == len(set(owned)), "a device block is owned by two requests"
    assert not set(owned) & free.free_ids(), "a device block is both free and owned"
    assert len(owned) + free.n_free == free.n_blocks, "a device block leaked"
    cpu = [b for t in swapped for b in t]
    assert len(cpu) == len(set(cpu)) and not set(cpu) & cpu_free.free_ids(), "a CPU block is shared"
    assert len(cpu) + cpu_free.n_free == cpu_free.n_blocks, "a CPU block leaked"


class BlockPool:
    """Free block ids `0 .. n_blocks - 1`, handed out lowest first and reused last-freed first (a
    stack), without a list of them all: ids never handed out are counted, not stored, so a pool of
    any size costs only what is in use. `n_free` is kept as a plain attribute: the scheduler reads
    it every step."""

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = self.n_free = n_blocks
        self._fresh = 0                 # ids >= _fresh were never handed out
        self._freed: list[int] = []     # ids given back, the last one on top

    def take(self, k: int) -> list[int]:
        self.n_free -= k
        freed = self._freed
        if k <= len(freed):
            return [freed.pop() for _ in range(k)]
        out = freed[::-1]               # every freed id, the last freed first, then never-used ones
        freed.clear()
        new = k - len(out)
        out.extend(range(self._fresh, self._fresh + new))
        self._fresh += new
        return out

    def give(self, blocks: list[int]) -> None:
        """Give `blocks` back so that the first of them is handed out first again."""
        self._freed.extend(reversed(blocks))
        self.n_free += len(blocks)

    def free_ids(self) -> set[int]:
        """Every free id (for invariant checks in tests: linear in the pool's size)."""
        ids = set(self._freed) | set(range(self._fresh, self.n_blocks))
        assert len(ids) == len(self._freed) + self.n_blocks - self._fresh == self.n_free, "the free count is off"
        return ids


@dataclass
class PreemptionStats:
    """What preemption cost in a run: counts, tokens dropped (to recompute) and tokens moved."""

    n_recompute: int = 0
    n_swap_out: int = 0
    n_swap_in: int = 0
    n_swap_fallbacks: int = 0           # swap asked for, CPU pool full: recomputed instead
    recompute_tokens: list[int] = field(default_factory=list)   # tokens dropped, per recompute
    swap_out_tokens: int = 0
    swap_in_tokens: int = 0


class PagedMemory(MemoryManager):
    """Block-granular K/V for the scheduler (vLLM's block manager, in Python numbers).

    `n_slots` is the K/V capacity in tokens; the pool holds `n_slots // block_size` blocks.
    `cpu_blocks` (swap only) is the CPU pool's capacity, by default as many blocks as the GPU's.
    """

    can_run_out = True

    def __init__(self, n_slots: int, block_size: int = BLOCK_SIZE, preemption: Preemption = "recompute",
                 cpu_blocks: int | None = None, watermark_blocks: int | None = None) -> None:
        if n_slots is None:
            raise ValueError("PagedMemory needs n_slots (K/V slots, in tokens): its blocks are a pool of fixed "
                             "size; for memory with no limit use UnlimitedMemory")
        super().__init__(n_slots)
        self.block_size = check_int("block_size", block_size, 1)
        self.preemption = check_choice("preemption", preemption, ("recompute", "swap"))
        self.n_blocks = self.n_slots // self.block_size
        if cpu_blocks is None:
            cpu_blocks = self.n_blocks if preemption == "swap" else 0
        self.cpu_blocks = check_int("cpu_blocks", cpu_blocks, 0, MAX_SLOTS)
        if watermark_blocks is None:
            watermark_blocks = default_watermark(self.n_blocks)
        self.watermark_blocks = check_int("watermark_blocks", watermark_blocks, 0)
        why = self._problem()
        if why:
            raise ValueError(why)
        self.n_slots = self.n_blocks * self.block_size
        self.reset()

    @property
    def swaps(self) -> bool:
        return self.preemption == "swap"

    def _problem(self) -> str | None:
        """What keeps the sizes from making a pool (None: they make one)."""
        if self.n_slots < self.block_size:
            return f"n_slots ({self.n_slots}) must hold at least one block of block_size={self.block_size} tokens"
        if self.preemption != "swap" and self.cpu_blocks:
            return (f"cpu_blocks={brief(self.cpu_blocks)} is the swap pool's size, but "
                    f"preemption={brief(self.preemption)} drops a victim's blocks and keeps no CPU pool: leave "
                    "cpu_blocks unset (or 0), or use preemption='swap'")
        if self.preemption == "swap" and self.cpu_blocks == 0:
            return "preemption='swap' needs a CPU pool: cpu_blocks must be >= 1"
        if self.watermark_blocks >= self.n_blocks:
            return f"watermark_blocks ({self.watermark_blocks}) must leave room in a pool of {self.n_blocks} blocks"
        return None

    # ---- bookkeeping --------------------------------------------------------------------------
    def reset(self) -> None:
        self._free = BlockPool(self.n_blocks)
        self._cpu_free = BlockPool(self.cpu_blocks)
        self._table: dict[Hashable, list[int]] = {}               # req_id -> its device blocks, in order
        self._tokens: dict[Hashable, int] = {}                    # req_id -> tokens stored on the device
        self._swapped: dict[Hashable, tuple[list[int], int]] = {} # req_id -> (CPU blocks, tokens)
        self.slots_used = 0
        self.stats = PreemptionStats()

    @property
    def slots_reserved(self) -> int:
        """Slots in blocks that are in use: token states plus the empty tails of last blocks."""
        return (self.n_blocks - self._free.n_free) * self.block_size

    @property
    def blocks_free(self) -> int:
        return self._free.n_free

    @property
    def blocks_used(self) -> int:
        return self.n_blocks - self._free.n_free

    @property
    def cpu_blocks_used(self) -> int:
        """CPU-pool blocks holding swapped-out K/V: the CPU side of `blocks_used`, a query for a
        reader (a debugger, the tests) that the run never asks."""
        return self.cpu_blocks - self._cpu_free.n_free

    def block_table(self, req: Request | Hashable) -> list[int]:
        """The device blocks of a request (or of a `req_id`), in token order (a copy): paged
        attention's block table, for a reader (a debugger, the tests); the run never asks."""
        return list(self._table[req.req_id if isinstance(req, Request) else req])

    def stored(self, req: Request) -> int:
        """Tokens of K/V this manager holds for `req`, on the device or (swapped out) in the CPU pool
        (a reader's query, as `MemoryManager.stored`; `slots_used` counts the device's alone)."""
        rid = req.req_id
        if rid in self._table:
            return self._tokens[rid]
        return self._swapped[rid][1] if rid in self._swapped else 0

    def holds(self, req: Request) -> bool:
        return req.req_id in self._table

    def is_swapped(self, req: Request) -> bool:
        """Whether `req`'s K/V waits in the CPU pool (swapped out, not readmitted yet): a query for a
        reader (a debugger, the tests); the run never asks, `try_admit` brings it back."""
        return req.req_id in self._swapped

    def describe(self) -> str:
        return (f"block_size={self.block_size} n_blocks={self.n_blocks} preemption={self.preemption!r} "
                f"cpu_blocks={self.cpu_blocks} watermark_blocks={self.watermark_blocks}")

    # ---- the interface ------------------------------------------------------------------------------
    def need_to_finish(self, req: Request) -> int:
        """A request's blocks at its last step (`blocks_to_finish`: whole blocks, the last one's empty
        tail included)."""
        return blocks_to_finish(req, self.block_size)

    def room_for(self, need: int) -> bool:
        """`need` blocks and the watermark admission keeps free, within the pool."""
        return need + self.watermark_blocks <= self.n_blocks

    def check(self, req: Request) -> None:
        blocks = self.need_to_finish(req)
        if not self.room_for(blocks):
            raise ValueError(f"request {brief(req.req_id)} needs {blocks} blocks of {self.block_size} tokens to finish "
                             f"(prompt_len + output_len - 1 stored; + {self.watermark_blocks} watermark) but the "
                             f"pool has {self.n_blocks}: it could never run to the end")

    def try_admit(self, req: Request) -> bool:
        """Waiting -> running, with the blocks of everything it is about to hold: its prompt plus
        output so far (`prompt_len + n_generated`: what a fresh or recomputed request feeds, or what
        a swapped-out one brings back from the CPU pool plus what it still has to feed), so the
        scheduler's `grow` for this step cannot fail. Refused unless `watermark_blocks` stay free."""
        rid = req.req_id
        assert rid not in self._table, f"request {brief(rid)} is already admitted"
        n = self._swapped[rid][1] if rid in self._swapped else 0
        need = blocks_for(max(req.prompt_len + req.n_generated, n), self.block_size)
        if self._free.n_free - need < self.watermark_blocks:
            return False
        if rid in self._swapped:
            cpu, _ = self._swapped.pop(rid)
            self._cpu_free.give(cpu)
            self.stats.n_swap_in += 1
            self.stats.swap_in_tokens += n
        self._table[rid] = self._free.take(need)
        self._tokens[rid] = n
        self.slots_used += n
        return True

    def grow(self, req: Request, n: int = 1) -> bool:
        """`req` stores `n` more tokens; a new block only when its last one is full. False = no block."""
        rid = req.req_id
        assert rid in self._table, self._unknown(rid, "cannot grow: it holds no device blocks")
        table = self._table[rid]
        extra = blocks_for(self._tokens[rid] + n, self.block_size) - len(table)
        if extra > self._free.n_free:
            return False
        if extra > 0:
            table.extend(self._free.take(extra))
        self._tokens[rid] += n
        self.slots_used += n
        return True

    def free(self, req: Request) -> None:
        """`req` finished (or a live run aborted it): its blocks go back to the pool."""
        rid = req.req_id
        assert rid in self._table, self._unknown(rid, "cannot be freed: it holds no device blocks")
        self._release(rid)

    def preempt(self, req: Request) -> bool:
        """Free `req`'s device blocks. True: its K/V went to the CPU pool (swap) and it keeps its
        computed tokens; False: dropped, it recomputes from 0 when readmitted."""
        rid = req.req_id
        assert rid in self._table, self._unknown(rid, "cannot be preempted: it holds no device blocks")
        n = self._tokens[rid]
        need = blocks_for(n, self.block_size)
        if self.preemption == "swap" and 0 < need <= self._cpu_free.n_free:
            self._release(rid)
            cpu = self._cpu_free.take(need)
            self._swapped[rid] = (cpu, n)
            self.stats.n_swap_out += 1
            self.stats.swap_out_tokens += n
            return True
        if self.preemption == "swap" and need > 0:
            self.stats.n_swap_fallbacks += 1
        self._release(rid)
        self.stats.n_recompute += 1
        self.stats.recompute_tokens.append(n)
        return False

    def tail_room(self, req: Request) -> int:
        """Tokens `req` can still store in its last block before it needs another."""
        rid = req.req_id
        return len(self._table[rid]) * self.block_size - self._tokens[rid]

    # ---- internals -------------------------------------------------------------------------------------
    def _release(self, rid: Hashable) -> None:
        self._free.give(self._table.pop(rid))
        self.slots_used -= self._tokens.pop(rid)

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is free or owned by exactly one request, and each
        request's tokens fit its blocks (tests)."""
        check_block_owners(self._table.values(), [cpu for cpu, _ in self._swapped.values()], self._free,
                           self._cpu_free)
        for rid, t in self._table.items():
            assert len(t) * self.block_size >= self._tokens[rid], f"request {brief(rid)} stores past its blocks"
        assert self.slots_used == sum(self._tokens.values())

    def __repr__(self) -> str:
        return (f"PagedMemory({self.describe()}, blocks_used={self.blocks_used}, slots_used={self.slots_used}, "
                f"swapped={len(self._swapped)})")

