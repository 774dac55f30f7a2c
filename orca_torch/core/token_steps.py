"""Which step made each token: the one per-token column a run keeps (lecture §5.2's timestamps).

Every token's time is the end of the step that made it, so a run stores only the step index of
each token, and `RunResult.token_times` is `step_end[token_step]`, derived when asked for. Request
`i`'s tokens are the slots `first[i] .. first[i] + output_len - 1`, in order.

While the run goes on the column is `uint32` (4 bytes a token; a run may have at most
`MAX_STEPS` steps), written one slot at a time through a `memoryview`, which stores a Python
int as cheaply as a list does (a numpy item store costs about twice as much). A fast-forwarded run
of decode steps (`fast_forward.py`) notes only each request's first slot and token count; those
slots are filled in with numpy, a bounded number of tokens at a time, so a long run needs no
per-token Python objects. At the end the column shrinks to the smallest unsigned type that holds
the run's step indices (`step_dtype`): 1 byte a token up to 256 steps, 2 up to 65,536, 4 beyond.
"""
from __future__ import annotations

from array import array
from itertools import accumulate

import numpy as np

NOT_MADE = 2**32 - 1          # a slot no step has filled (yet)
MAX_STEPS = NOT_MADE          # step indices 0 .. MAX_STEPS - 1 fit the uint32 column
_FLUSH_TOKENS = 1 << 20       # expand noted decode runs once they stand for this many tokens


def step_dtype(n_steps: int) -> np.dtype:
    """The smallest unsigned integer type that holds step indices 0 .. n_steps - 1."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if n_steps - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


class TokenSteps:
    """The step index of every token of a run, request by request (the scheduler fills it in)."""

    def __init__(self, output_lens: list[int]) -> None:
        ends = list(accumulate(output_lens, initial=0))
        self.first = ends[:-1]                  # request i's first slot
        self.steps = np.empty(ends[-1], dtype=np.uint32)
        self.steps.fill(NOT_MADE)
        self.view = memoryview(self.steps)      # view[first[i] + g] = step that made token g of request i
        self._new()

    def extend(self, output_len: int) -> None:
        """A live run (`Engine.add`): one more request, its `output_len` slots after the others'
        (the column grows by doubling, so adding is amortised O(1))."""
        n = len(self.steps)
        self.first.append(n)
        if n + output_len > len(getattr(self, "_buf", self.steps)):
            buf = np.empty(max(2 * (n + output_len), 1024), dtype=np.uint32)
            buf.fill(NOT_MADE)
            buf[:n] = self.steps
            self._buf = buf
        self.steps = self._buf[:n + output_len]
        self.view = memoryview(self.steps)

    def _new(self) -> None:
        self._start = array("q")                # a noted run of tokens: the step that made its first,
        self._slots = array("q")                # the slot of its first
        self._counts = array("q")               # and its token count (one a step)
        self._pending = 0                       # tokens noted, not expanded yet

    def note_run(self, starts: list[int], counts: list[int], slots: list[int]) -> None:
        """Steps `starts[i], starts[i] + 1, ...` made `counts[i]` tokens from slot `slots[i]` on, one a step."""
        self._start.fromlist(starts)
        self._slots.fromlist(slots)
        self._counts.fromlist(counts)
        self._pending += sum(counts)
        if self._pending >= _FLUSH_TOKENS:
            self._expand()

    def _expand(self) -> None:
        """Fill in the noted runs. Token `i` of the flat list of runs, in slot order, sits at
        `slot + (i - o)` and was made by step `start + (i - o)`, `o` its run's first position: two
        per-run constants added to `arange`."""
        if not self._pending:
            return
        slots = np.frombuffer(self._slots, dtype=np.int64)
        m = np.frombuffer(self._counts, dtype=np.int64)     # tokens per run
        start = np.frombuffer(self._start, dtype=np.int64)
        order = np.argsort(slots, kind="stable")   # in slot order the writes below go forward in memory
        slots, m, start = slots[order], m[order], start[order]
        o = np.cumsum(m) - m
        n = int(m.sum())
        dt = np.int32 if len(self.steps) < 2**31 and int(start.max()) + n < 2**31 else np.int64   # (half the traffic)
        i = np.arange(n, dtype=dt)
        where = np.repeat((slots - o).astype(dt), m)
        where += i
        made_by = np.repeat((start - o).astype(dt), m)
        made_by += i
        self.steps[where] = made_by
        self._new()

    def column(self, n_steps: int) -> np.ndarray:
        """The finished column, in `step_dtype(n_steps)`; raises if a token was never made (a bug)."""
        self._expand()
        ts = self.steps
        if len(ts) and int(ts.max()) >= n_steps:
            raise RuntimeError("some tokens were never produced (a bug)")
        dt = step_dtype(n_steps)
        return ts if dt == ts.dtype else ts.astype(dt)
