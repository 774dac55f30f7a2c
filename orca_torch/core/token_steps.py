"""Which step made each token (lecture §5.1's timestamps): a run's one per-token record.

Every token's time is the end of the step that made it, so a run stores only the step index of
each token, and `RunResult.token_times` is `step_end[token_step]`, derived when asked for. Request
`i`'s tokens are the slots `first[i] .. first[i] + output_len - 1`, in order.

`TokenSteps` is what the scheduler writes while a run goes on: a `uint32` column (4 bytes a token;
a run may have at most `MAX_STEPS` steps), one slot at a time through a `memoryview`, which
stores a Python int as cheaply as a list does (a numpy item store costs about twice as much).
The column starts zeroed (`np.zeros`: fresh pages the system hands out zeroed, so nothing is
written to them until a step makes a token); `Scheduler.complete` writes each slot once, as its
token is made, and `Engine.result` checks that every request finished. At the end the column
shrinks to the smallest unsigned type that holds the run's step indices (`step_dtype`): 1 byte a
token up to 256 steps, 2 up to 65,536, 4 beyond.

`TokenRuns` holds the same steps as runs: a request's tokens made one a step, from a step on, as
three numbers. A request decoding from its admission to its finish is one run, so a run of a
million requests is a million runs where its column would be hundreds of millions of slots; the
summary (`metrics.summarize`) reads the runs, and the column is built from them only for a caller
that reads it (`RunResult.token_step`).
"""
from __future__ import annotations

from itertools import accumulate

import numpy as np

MAX_STEPS = 2**32 - 1         # a run may have at most this many steps: their indices fit the uint32 column

_CHUNK = 1 << 22              # slots handled at once when building a column or reading one


def step_dtype(step_count: int) -> np.dtype:
    """The smallest unsigned integer type that holds step indices 0 .. step_count - 1 (a run has at
    most `MAX_STEPS` steps, so `uint32` holds them all)."""
    assert step_count <= MAX_STEPS, f"a run may have at most {MAX_STEPS} steps"
    for dt in (np.uint8, np.uint16):
        if step_count - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint32)


class TokenRuns:
    """A run's token steps as runs: the tokens in slots `slot[k] .. slot[k] + count[k] - 1` were made
    one a step by the steps `start[k], start[k] + 1, ...` (int64 arrays, one entry a run).

    The runs are in slot order and tile the slots `0 .. n_tokens - 1`, and none spans two requests:
    every request's first slot starts a run. A request's tokens may lie in several runs (it sat out
    a step, or the runs were noted apart); `of_column` makes the fewest, one per stretch of
    consecutive steps."""

    def __init__(self, slot: np.ndarray, start: np.ndarray, count: np.ndarray) -> None:
        self.slot, self.start, self.count = slot, start, count
        self._column: np.ndarray | None = None             # built (or given to `of_column`) and kept
        self._first: tuple[np.ndarray, np.ndarray] | None = None    # (offsets, `first_runs(offsets)`), kept

    def __repr__(self) -> str:
        return f"TokenRuns({len(self.slot)} runs, {self.n_tokens} tokens)"

    @property
    def n_tokens(self) -> int:
        return int(self.slot[-1] + self.count[-1]) if len(self.slot) else 0

    @property
    def last(self) -> np.ndarray:
        """The step that made each run's last token."""
        return self.start + self.count - 1

    @classmethod
    def of_column(cls, steps: np.ndarray, first: np.ndarray) -> TokenRuns:
        """The runs of a column of token steps whose requests start at the slots `first`: a run starts
        at every request's first slot (slot 0 among them) and at every slot whose step is not the one
        after the step of the slot before it, found a bounded chunk of the column at a time."""
        n = len(steps)
        starts = [np.asarray(first, dtype=np.int64)]
        for lo in range(1, n, _CHUNK):          # slots lo .. hi - 1, each against the slot before it
            hi = min(lo + _CHUNK, n)
            step_on = steps[lo:hi].astype(np.int64) - steps[lo - 1:hi - 1]
            starts.append(np.flatnonzero(step_on != 1) + lo)
        at = np.unique(np.concatenate(starts))
        at = at[at < n]                         # (no slot at all: no run)
        runs = cls(at, steps[at].astype(np.int64), np.diff(at, append=n))
        runs._column = steps
        return runs

    def first_runs(self, offsets: np.ndarray) -> np.ndarray:
        """The index of each request's first run, for requests whose tokens start at the slots
        `offsets[:-1]` (`RunResult.token_offsets`; kept for the same array)."""
        if self._first is None or self._first[0] is not offsets:
            k = np.searchsorted(self.slot, offsets[:-1])
            assert (self.slot[k] == offsets[:-1]).all(), "a request's first token does not start a run"
            self._first = offsets, k
        return self._first[1]

    def column(self, step_count: int) -> np.ndarray:
        """The step of every token, slot by slot, in `step_dtype(step_count)`, built a bounded chunk
        of slots at a time (token `p` of run `k` was made by step `start[k] + p - slot[k]`) on the
        first call and kept (or the column these runs were found in)."""
        if self._column is None:
            self._column = self._built(step_count)
        return self._column

    def _built(self, step_count: int) -> np.ndarray:
        n = self.n_tokens
        out = np.empty(n, dtype=step_dtype(step_count))
        assert not len(self.slot) or int(self.last.max()) < step_count, "a token made after the run's last step"
        for lo in range(0, n, _CHUNK):
            hi = min(lo + _CHUNK, n)
            k0 = int(np.searchsorted(self.slot, lo, side="right")) - 1     # the runs over slots lo .. hi - 1
            k1 = int(np.searchsorted(self.slot, hi))
            slot = self.slot[k0:k1]
            lengths = np.minimum(slot + self.count[k0:k1], hi) - np.maximum(slot, lo)
            made_by = np.repeat(self.start[k0:k1] - slot, lengths)
            made_by += np.arange(lo, hi)
            out[lo:hi] = made_by
        return out


class TokenSteps:
    """The step index of every token of a run, request by request (the scheduler fills it in)."""

    def __init__(self, output_lens: list[int]) -> None:
        ends = list(accumulate(output_lens, initial=0))
        self.first = ends[:-1]                  # request i's first slot
        self.n_tokens = ends[-1]
        self.steps = np.zeros(self.n_tokens, dtype=np.uint32)
        self.view = memoryview(self.steps)      # view[first[i] + g] = step that made token g of request i
        self._buf = self.steps                  # a live run: `steps` is the head of this, grown by doubling

    def extend(self, output_len: int) -> None:
        """A live run (`Engine.add`): one more request, its `output_len` slots after the others'
        (the column grows by doubling, so adding is amortised O(1))."""
        n = self.n_tokens
        self.first.append(n)
        self.n_tokens = n + output_len
        if n + output_len > len(self._buf):
            buf = np.zeros(max(2 * (n + output_len), 1024), dtype=np.uint32)
            buf[:n] = self.steps
            self._buf = buf
        self.steps = self._buf[:n + output_len]
        self.view = memoryview(self.steps)

    def made(self, step_count: int) -> np.ndarray | TokenRuns:
        """The finished run's token steps as `RunResult.token_step` takes them: here the column, in
        `step_dtype(step_count)` (a kind that keeps runs returns its `TokenRuns`)."""
        ts = self.steps
        dt = step_dtype(step_count)
        return ts if dt == ts.dtype else ts.astype(dt)
