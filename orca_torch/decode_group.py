"""Decode groups: the running requests that decode together, priced in O(1) per step (issue 6, speed).

Algorithm 1 says every running request decodes one token per step. Done literally, a step costs
O(running) Python work — build its `(n_new, n_past)` list, bump every counter, note which batch
made every token — and a 600-request simulation takes seconds. The trick that makes it take tens
of milliseconds:

- The requests that decode together form a *decode group*. The group keeps only the number of
  seats `k` and the sum of their stored contexts `ctx_sum`; a decode step's `StepTotals` follow
  from those two numbers, so the step is priced in O(1) whatever the batch size.
- The group keeps a *lane*: the batch indices it ran in, one per step. Each member remembers where
  it joined (lane position, tokens generated, tokens stored); its counters at any later step
  follow by subtraction, and its token -> batch map is the lane slice since it joined, written
  once, when it leaves (finishes, is preempted, or moves to another group). So while a request is
  in a group its `n_generated` and `n_stored` are stale: `leave` brings them up to date.
- A heap keyed by the lane length at which each member is done says when the next one finishes,
  so the engine can fast-forward over the identical pure-decode steps in between.

With `n_workers = 1` there is one group; with pipelining each batch in flight has its own. Static
batching keeps a finished member's seat (`leave(r, keep_seat=True)`): it costs compute until its
batch ends. `tests/reference_engine.py` does the same per request, and the engine is tested
against it.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .request import Request


class TokenBatches:
    """Which batch produced each token: request i's tokens are `batch[offsets[i]:offsets[i+1]]`."""

    def __init__(self, requests: Sequence[Request]) -> None:
        sizes = np.array([r.output_len for r in requests], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.batch = np.full(int(self.offsets[-1]), -1, dtype=np.int64)
        self._first = {r.req_id: int(o) for r, o in zip(requests, self.offsets[:-1])}

    def put(self, r: Request, token: int, index: int) -> None:
        """Token `token` of `r` came from batch `index`."""
        self.batch[self._first[r.req_id] + token] = index

    def put_run(self, r: Request, token: int, indices: np.ndarray) -> None:
        """Tokens `token, token + 1, ...` of `r` came from batches `indices`."""
        o = self._first[r.req_id] + token
        self.batch[o:o + len(indices)] = indices


@dataclass(eq=False)
class _Seat:
    """A member: its token `tokens0 + j` (stored context `stored0 + j`) comes from `lane[lane0 + j]`."""

    req: Request
    lane0: int
    tokens0: int
    stored0: int
    serial: int


class DecodeGroup:
    """Requests that decode together, one token each per batch the group runs in."""

    def __init__(self, tokens: TokenBatches) -> None:
        self.tokens = tokens
        self.seats: dict = {}           # req_id -> _Seat, the live members
        self.k = 0                      # seats that compute each step (static: idle ones too)
        self.ctx_sum = 0                # stored tokens summed over those seats
        self.lane = np.empty(256, dtype=np.int64)   # lane[:lane_len]: the batches it ran in
        self.lane_len = 0
        self.in_flight = False          # pipelining: its batch has not returned yet
        self._done_at: list = []        # heap of (lane length when done, serial, req_id)
        self._serial = itertools.count()

    def members(self) -> list[Request]:
        return [s.req for s in self.seats.values()]

    def works_at(self, lane_pos: int) -> list[tuple[Request, int, int]]:
        """The live members' `(req, 1, n_past)` in the step at `lane_pos`."""
        return [(s.req, 1, s.stored0 + lane_pos - s.lane0) for s in self.seats.values()]

    def run(self, first_batch: int, m: int = 1) -> None:
        """The group decodes in batches `first_batch .. first_batch + m - 1`, one token per seat each."""
        n = self.lane_len
        if n + m > len(self.lane):
            grown = np.empty(max(2 * len(self.lane), n + m), dtype=np.int64)
            grown[:n] = self.lane[:n]
            self.lane = grown
        if m == 1:
            self.lane[n] = first_batch
        else:
            self.lane[n:n + m] = np.arange(first_batch, first_batch + m)
        self.lane_len = n + m
        self.ctx_sum += self.k * m

    def join(self, r: Request) -> None:
        """`r` (`n_generated` tokens out, `n_stored` stored) decodes with the group from its next step."""
        seat = _Seat(r, self.lane_len, r.n_generated, r.n_stored, next(self._serial))
        self.seats[r.req_id] = seat
        self.k += 1
        self.ctx_sum += r.n_stored
        heapq.heappush(self._done_at, (self.lane_len + r.output_len - r.n_generated, seat.serial, r.req_id))

    def leave(self, r: Request, keep_seat: bool = False) -> None:
        """Take `r` out: bring its counters up to date and write its tokens' batches (one slice)."""
        seat = self.seats.pop(r.req_id)
        n = self.lane_len - seat.lane0
        r.n_generated = seat.tokens0 + n
        r.n_stored = seat.stored0 + n
        if n:
            self.tokens.put_run(r, seat.tokens0, self.lane[seat.lane0:self.lane_len])
        if not keep_seat:
            self.k -= 1
            self.ctx_sum -= r.n_stored

    def keep_idle_seat(self, n_stored: int) -> None:
        """Static batching: a request that finished at its prefill still holds a seat in the batch."""
        self.k += 1
        self.ctx_sum += n_stored

    def steps_to_next_finish(self) -> int:
        """Steps the group can run before a member's last token is out (0: the last step did it)."""
        heap = self._done_at
        while heap:
            done_at, serial, rid = heap[0]
            seat = self.seats.get(rid)
            if seat is not None and seat.serial == serial:
                return done_at - self.lane_len
            heapq.heappop(heap)  # it left (preempted or moved) before finishing here
        return 0

    def pop_finished(self) -> list[Request]:
        """The members whose last token is out by now (still members: the caller `leave`s them)."""
        out = []
        heap = self._done_at
        while heap and heap[0][0] <= self.lane_len:
            _, serial, rid = heapq.heappop(heap)
            seat = self.seats.get(rid)
            if seat is not None and seat.serial == serial:
                out.append(seat.req)
        return out
