"""The unit of work of one step: `SeqWork(n_new, n_past)` (lecture §3.2, §4.2, exercise 9).

A request's share of an iteration is described by two numbers: how many new tokens it feeds this
step (a whole prompt, a chunk of a prompt, or 1 for a decode) and how many of its tokens already
have K/V stored. The torch model executes a list of these (selective batching) and the hardware
model prices the same list, so both halves of the project speak about exactly the same step.
A `Batch` is one step as the scheduler chose it: each request with its two numbers (a
`ScheduledSeq`), and the step's `StepTotals`, which are all the hardware model needs to price it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, NamedTuple, Sequence

from orca_torch.checks import check_int

if TYPE_CHECKING:
    from orca_torch.core.request import Request


@dataclass(frozen=True)
class SeqWork:
    """One request's work in one step: `n_new` tokens on top of `n_past` cached ones."""

    n_new: int
    n_past: int = 0

    def __post_init__(self) -> None:
        if type(self.n_new) is not int or type(self.n_past) is not int or self.n_new < 1 or self.n_past < 0:
            for f, lo in (("n_new", 1), ("n_past", 0)):
                object.__setattr__(self, f, check_int(f"SeqWork.{f}", getattr(self, f), lo))

    @property
    def n_ctx(self) -> int:
        """Keys each new query can see at most: the cached tokens plus the new ones."""
        return self.n_past + self.n_new


class StepTotals(NamedTuple):
    """The sums over a step's `SeqWork` list that every cost formula needs.

    Keeping a step as these five numbers lets the hardware model price a step in O(1). Immutable
    (a named tuple: built once a step, several times cheaper than a frozen dataclass); `+` adds
    field by field.
    """

    n_seqs: int = 0
    n_tokens: int = 0          # sum of n_new: rows of the flat [sum L, H] matrix
    kv_read_tokens: int = 0    # sum of n_past + n_new: K/V rows attention reads per layer
    attn_pairs_full: int = 0   # sum of n_new * (n_past + n_new): (query, key) pairs computed
    attn_pairs_causal: int = 0 # sum of n_new * n_past + n_new (n_new + 1) / 2: pairs the mask keeps

    @staticmethod
    def of(works: Iterable[SeqWork]) -> "StepTotals":
        return step_totals((None, w.n_new, w.n_past) for w in works)

    def __add__(self, other: "StepTotals") -> "StepTotals":      # (not a tuple's concatenation)
        if not isinstance(other, StepTotals):
            return NotImplemented
        return StepTotals(
            self.n_seqs + other.n_seqs,
            self.n_tokens + other.n_tokens,
            self.kv_read_tokens + other.kv_read_tokens,
            self.attn_pairs_full + other.attn_pairs_full,
            self.attn_pairs_causal + other.attn_pairs_causal,
        )


def padded_shape(works: Sequence[SeqWork]) -> tuple[int, int, int]:
    """`(B, L_max, K_max)` of the padded `[B, L_max, H]` layout that selective batching avoids."""
    if not works:
        return 0, 0, 0
    return len(works), max(w.n_new for w in works), max(w.n_ctx for w in works)


class ScheduledSeq(NamedTuple):
    """One request in one step: it feeds `n_new` tokens on top of its `n_past` stored ones."""

    req: Request
    n_new: int
    n_past: int

    @property
    def work(self) -> SeqWork:
        return SeqWork(self.n_new, self.n_past)


def step_totals(seqs: Iterable[tuple[object, int, int]], n_decodes: int = 0, decode_ctx: int = 0) -> StepTotals:
    """The `StepTotals` of `seqs` (`ScheduledSeq`s, or any `(_, n_new, n_past)` triples, as
    `StepTotals.of` passes), plus `n_decodes` more decodes whose stored tokens sum to
    `decode_ctx` (a decode over `n_past` stored tokens reads `n_past + 1` and has as many pairs):
    the one place the sums are written, summed without building objects."""
    n_seqs, n_tokens = n_decodes, n_decodes
    kv = full = causal = decode_ctx + n_decodes
    for _, n_new, n_past in seqs:
        n_seqs += 1
        n_tokens += n_new
        n_ctx = n_past + n_new
        kv += n_ctx
        full += n_new * n_ctx
        causal += n_new * n_past + n_new * (n_new + 1) // 2
    return StepTotals(n_seqs, n_tokens, kv, full, causal)


class Swap(NamedTuple):
    """A request whose K/V a step moves between device and host memory, and its tokens."""

    req: Request
    n_tokens: int


@dataclass(eq=False, slots=True)
class Batch:
    """One iteration, as the scheduler chose it: its `works` (`ScheduledSeq`s, the decodes first;
    `n_past` is the request's `num_computed_tokens` when chosen), the step's totals, who was
    preempted (and, when the memory manager swaps, whose K/V went out or came back, with the token
    counts). While `select` fills it, `totals` counts the decodes alone (`Scheduler.decode` sets
    them), so `works[:totals.n_seqs]` are the decodes; `Scheduler._launch` adds the rest."""

    index: int
    works: list[ScheduledSeq]
    totals: StepTotals
    preempted: list[Request] = field(default_factory=list)
    swapped_out: list[Swap] = field(default_factory=list)
    swapped_in: list[Swap] = field(default_factory=list)
