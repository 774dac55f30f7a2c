"""Which step made each token: the one per-token column a run keeps (lecture §5.2's timestamps).

Every token's time is the end of the step that made it, so a run stores only the step index of
each token, and `RunResult.token_times` is `step_end[token_step]`, derived when asked for. Request
`i`'s tokens are the slots `first[i] .. first[i] + output_len - 1`, in order.

While the run goes on the column is `uint32` (4 bytes a token; a run may have at most
`MAX_STEPS` steps), written one slot at a time through a `memoryview`, which stores a Python
int as cheaply as a list does (a numpy item store costs about twice as much). At the end the
column shrinks to the smallest unsigned type that holds the run's step indices (`step_dtype`):
1 byte a token up to 256 steps, 2 up to 65,536, 4 beyond.
"""
from __future__ import annotations

from itertools import accumulate

import numpy as np

NOT_MADE = 2**32 - 1          # a slot no step has filled (yet)
MAX_STEPS = NOT_MADE          # step indices 0 .. MAX_STEPS - 1 fit the uint32 column


def step_dtype(step_count: int) -> np.dtype:
    """The smallest unsigned integer type that holds step indices 0 .. step_count - 1 (a run has at
    most `MAX_STEPS` steps, so `uint32` holds them all)."""
    assert step_count <= MAX_STEPS, f"a run may have at most {MAX_STEPS} steps"
    for dt in (np.uint8, np.uint16):
        if step_count - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint32)


class TokenSteps:
    """The step index of every token of a run, request by request (the scheduler fills it in)."""

    def __init__(self, output_lens: list[int]) -> None:
        ends = list(accumulate(output_lens, initial=0))
        self.first = ends[:-1]                  # request i's first slot
        self.steps = np.empty(ends[-1], dtype=np.uint32)
        self.steps.fill(NOT_MADE)
        self.view = memoryview(self.steps)      # view[first[i] + g] = step that made token g of request i
        self._buf = self.steps                  # a live run: `steps` is the head of this, grown by doubling

    def extend(self, output_len: int) -> None:
        """A live run (`Engine.add`): one more request, its `output_len` slots after the others'
        (the column grows by doubling, so adding is amortised O(1))."""
        n = len(self.steps)
        self.first.append(n)
        if n + output_len > len(self._buf):
            buf = np.empty(max(2 * (n + output_len), 1024), dtype=np.uint32)
            buf.fill(NOT_MADE)
            buf[:n] = self.steps
            self._buf = buf
        self.steps = self._buf[:n + output_len]
        self.view = memoryview(self.steps)

    def column(self, step_count: int) -> np.ndarray:
        """The finished column, in `step_dtype(step_count)`; raises if a token was never made (a bug)."""
        ts = self.steps
        assert not len(ts) or int(ts.max()) < step_count, "some tokens were never produced"
        dt = step_dtype(step_count)
        return ts if dt == ts.dtype else ts.astype(dt)
