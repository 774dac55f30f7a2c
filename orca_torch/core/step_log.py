"""What every step of a run was: its start and end, sequences, tokens, and K/V slots reserved and used.

The engine appends a step at a time, or a whole fast-forwarded decode run at a time (its steps
share their sequence count and grow their memory evenly, so a run is a few numbers and its end
times). Entries go into typed arrays (`array.array`: 8 bytes a number, no Python object per
entry) and become numpy columns every `FLUSH` steps, so a run of millions of steps keeps 32 bytes
a step (two float64 times, four int32 counts where they fit).
"""
from __future__ import annotations

from array import array

import numpy as np


def _narrow(col: np.ndarray) -> np.ndarray:
    """An int64 column as int32 when its values allow (half the memory of a long run's steps)."""
    if len(col) and -2**31 <= col.min() and col.max() < 2**31:
        return col.astype(np.int32)
    return col


class StepLog:
    """The per-step columns of a run, filled in step order; `columns()` returns them."""

    FLUSH = 1 << 17

    def __init__(self) -> None:
        self.n = 0
        self.base = 0                           # the first step not yet in `chunks`
        self.chunks: list[tuple] = []           # (start, end, n_seqs, n_tokens, reserved, used) of steps assembled
        self._new()

    def _new(self) -> None:
        self._one_i = array("q")                # a single step: its index, n_seqs, n_tokens, reserved, used
        self._one_t = array("d")                # and its start and end
        self._run_i = array("q")                # a decode run: its first index, m, k, res0, dres, used0, dused,
        self._run_start = array("d")            # its first step's start
        self._run_ends = array("d")             # and every step's end
        self._uneven: list[tuple[int, list[int]]] = []    # (first step, reserved per step) of uneven runs

    def add(self, start: float, end: float, n_seqs: int, n_tokens: int, reserved: int, used: int) -> None:
        self._one_i.extend((self.n, n_seqs, n_tokens, reserved, used))
        self._one_t.extend((start, end))
        self.n += 1
        if self.n - self.base >= self.FLUSH:
            self._assemble()

    def add_run(self, start: float, ends: list[float] | np.ndarray, k: int, res0: int, dres: int, used0: int,
                dused: int, reserved: list[int] | None = None) -> None:
        """`m = len(ends)` decode steps of `k` sequences, the first starting at `start`; the memory
        in the first is `res0`, `used0`, and grows by `dres`, `dused` a step (or, where `reserved`
        is given, the slots reserved are those, step by step)."""
        m = len(ends)
        self._run_i.extend((self.n, m, k, res0, dres, used0, dused))
        self._run_start.append(start)
        if isinstance(ends, np.ndarray):
            self._run_ends.frombytes(np.ascontiguousarray(ends, dtype=np.float64).tobytes())
        else:
            self._run_ends.fromlist(ends)
        if reserved is not None:
            self._uneven.append((self.n, reserved))
        self.n += m
        if self.n - self.base >= self.FLUSH:
            self._assemble()

    def _assemble(self) -> None:
        """Steps `base .. n - 1` from the pending entries into one chunk of numpy columns."""
        n, base = self.n - self.base, self.base
        t0, t1 = np.zeros(n), np.zeros(n)      # start, end (two arrays: each column frees on its own)
        i = np.zeros((4, n), dtype=np.int64)
        if len(self._one_i):
            one = np.frombuffer(self._one_i, dtype=np.int64).reshape(-1, 5)
            idx = one[:, 0] - base
            t = np.frombuffer(self._one_t, dtype=np.float64).reshape(-1, 2)
            t0[idx], t1[idx] = t[:, 0], t[:, 1]
            i[:, idx] = one[:, 1:].T
        if len(self._run_i):
            first, ms, k, res0, dres, used0, dused = np.frombuffer(self._run_i, dtype=np.int64).reshape(-1, 7).T
            first = first - base
            run_of_step = np.repeat(np.arange(len(ms)), ms)
            within = np.arange(int(ms.sum())) - (np.cumsum(ms) - ms)[run_of_step]
            idx = first[run_of_step] + within
            ends = np.frombuffer(self._run_ends, dtype=np.float64)
            starts = np.empty_like(ends)
            starts[1:] = ends[:-1]
            starts[np.cumsum(ms) - ms] = np.frombuffer(self._run_start, dtype=np.float64)
            t0[idx], t1[idx] = starts, ends
            i[0, idx] = i[1, idx] = k[run_of_step]
            i[2, idx] = res0[run_of_step] + dres[run_of_step] * within
            i[3, idx] = used0[run_of_step] + dused[run_of_step] * within
            for n0, reserved in self._uneven:
                i[2, n0 - base:n0 - base + len(reserved)] = reserved
        self.chunks.append((t0, t1, *(_narrow(c) for c in i)))
        self._new()
        self.base = self.n

    def columns(self) -> tuple[np.ndarray, ...]:
        """start, end (float) and n_seqs, n_tokens, reserved, used (int) per step."""
        if self.n > self.base or not self.chunks:
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
