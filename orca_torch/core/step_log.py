"""What every step of a run was: its start and end, sequences, tokens, and K/V slots reserved and used.

The engine appends a step at a time. Entries go into typed arrays (`array.array`: 8 bytes a
number, no Python object per entry) and become numpy columns every `FLUSH` steps, so a run of
millions of steps keeps 32 bytes a step (two float64 times, four int32 counts where they fit).
"""
from __future__ import annotations

from array import array

import numpy as np


def narrow_ints(col: np.ndarray) -> np.ndarray:
    """An int64 column as int32 when its values allow (half the memory of a long run's steps)."""
    if len(col) and -2**31 <= col.min() and col.max() < 2**31:
        return col.astype(np.int32)
    return col


class StepLog:
    """The per-step columns of a run, filled in step order; `columns()` returns them."""

    FLUSH = 1 << 17

    def __init__(self) -> None:
        self.n_steps = 0
        self.base = 0                           # the first step not yet in `chunks`
        self.chunks: list[tuple] = []           # (start, end, n_seqs, n_tokens, reserved, used) of steps assembled
        self._new()

    def _new(self) -> None:
        self._step_counts = array("q")          # each step: n_seqs, n_tokens, reserved, used
        self._step_times = array("d")           # and its start and end

    def add(self, start: float, end: float, n_seqs: int, n_tokens: int, reserved: int, used: int) -> None:
        self._step_counts.extend((n_seqs, n_tokens, reserved, used))
        self._step_times.extend((start, end))
        self.n_steps += 1
        if self.n_steps - self.base >= self.FLUSH:
            self._assemble()

    def _assemble(self) -> None:
        """Steps `base .. n_steps - 1` from the pending entries into one chunk of numpy columns."""
        t = np.frombuffer(self._step_times, dtype=np.float64).reshape(-1, 2)
        counts = np.frombuffer(self._step_counts, dtype=np.int64).reshape(-1, 4).T.copy()
        self.chunks.append((t[:, 0].copy(), t[:, 1].copy(), *(narrow_ints(c) for c in counts)))
        self._new()
        self.base = self.n_steps

    def columns(self) -> tuple[np.ndarray, ...]:
        """start, end (float) and n_seqs, n_tokens, reserved, used (int) per step."""
        if self.n_steps > self.base or not self.chunks:
            self._assemble()
        if len(self.chunks) > 1:
            chunks = [list(ch) for ch in self.chunks]
            self.chunks = []
            out = []
            for c in range(6):
                out.append(np.concatenate([ch[c] for ch in chunks]))
                for ch in chunks:
                    ch[c] = None        # this column's pieces go as soon as it is whole
            self.chunks = [tuple(out)]
        return self.chunks[0]
