"""A request in the pool: what the client asked for, and the counters the scheduler keeps (lecture §4.3).

Orca's workload generates no end-of-sequence token: every request runs for exactly its
`output_len` tokens (OSDI 2022 §6), so the true output length is part of the request. `max_tokens`
is what the request *may* reach (prompt + the allowance the server grants); it is what Orca's
max-length reservation sets aside when the request is first scheduled. `predicted_output` feeds
shortest-predicted-first (§6.3); `prompt_ids` feed the torch executor.

The counters are true after every step: `num_computed_tokens` (tokens whose K/V is stored; 0
again after a recompute preemption), `n_generated` (tokens delivered), `status`. The request
needs `n_to_feed = prompt_len + n_generated - num_computed_tokens` tokens fed to yield its next
one: the whole prompt, a chunk of it, everything again after a preemption, or 1 to decode. The
engine re-checks the fields (`validate`) and resets the counters when a run starts, so the same
list can be run twice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Hashable, Sized

from orca_torch.checks import is_finite_real, is_int


class Status(Enum):
    """Where a request is: waiting in the queue, admitted to the running pool, inside a batch that
    is in the pipeline (only with `n_workers > 1`: between `schedule` and `complete`), done, or
    refused at submission, or gone before its end (a live run's `Engine.abort`). WAITING -> RUNNING
    (<-> IN_FLIGHT) -> FINISHED; a preempted request goes back to WAITING."""

    WAITING = "waiting"
    RUNNING = "running"
    IN_FLIGHT = "in_flight"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class Request:
    """One generation request; lengths in tokens, `arrival_s` in the run's clock (seconds or iterations)."""

    req_id: Hashable
    arrival_s: float
    prompt_len: int
    output_len: int
    max_tokens: int | None = None
    predicted_output: float | None = None
    prompt_ids: list[int] | None = field(default=None, repr=False)

    status: Status = field(default=Status.WAITING, init=False)
    num_computed_tokens: int = field(default=0, init=False)  # tokens whose K/V is stored
    n_generated: int = field(default=0, init=False)          # tokens delivered to the client so far
    n_preemptions: int = field(default=0, init=False)
    output_ids: list[int] | None = field(default=None, init=False, repr=False)
    run_index: int = field(default=-1, init=False, repr=False)  # position in the engine's run

    def __post_init__(self) -> None:
        self.validate()
        if type(self.prompt_len) is not int or type(self.output_len) is not int:
            self.prompt_len, self.output_len = int(self.prompt_len), int(self.output_len)
        if type(self.arrival_s) is not float:
            self.arrival_s = float(self.arrival_s)
        if self.max_tokens is not None:
            self.max_tokens = int(self.max_tokens)
        if self.predicted_output is not None:
            self.predicted_output = float(self.predicted_output)

    def validate(self) -> None:
        """Raise ValueError unless the fields make a request (the engine re-checks at submission, so
        a field changed after construction is caught before the run starts). Changes nothing."""
        try:
            hash(self.req_id)                   # the engine and the results key requests by req_id
            usable = self.req_id == self.req_id
        except TypeError:
            usable = False
        if not usable:                          # (NaN is hashable but equals nothing, itself included)
            raise ValueError(f"req_id must be hashable and equal to itself (an int, a str, a tuple, ...), "
                             f"got {self.req_id!r} ({type(self.req_id).__name__})")
        p, o, a = self.prompt_len, self.output_len, self.arrival_s
        if (type(p) is int and type(o) is int and type(a) is float and p >= 1 and o >= 1 and 0.0 <= a < math.inf
                and self.max_tokens is None and self.predicted_output is None and self.prompt_ids is None):
            return                              # the common case, checked cheaply (workloads make many)
        for name in ("prompt_len", "output_len"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"request {self.req_id!r}: {name} must be an integer >= 1 (a Python or "
                                 f"numpy integer; not a float or bool), got {v!r} ({type(v).__name__})")
        if not is_finite_real(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"request {self.req_id!r}: arrival_s must be a finite number >= 0, "
                             f"got {self.arrival_s!r}")
        if self.max_tokens is not None:
            if not is_int(self.max_tokens) or self.max_tokens < self.total_len:
                raise ValueError(f"request {self.req_id!r}: max_tokens must be an integer >= prompt_len + "
                                 f"output_len = {self.total_len}, got {self.max_tokens!r}")
        if self.predicted_output is not None:
            p = self.predicted_output
            if not is_finite_real(p) or p <= 0:
                raise ValueError(f"request {self.req_id!r}: predicted_output must be a finite number > 0, "
                                 f"got {p!r}")
        ids = self.prompt_ids
        if ids is not None:
            self._check_prompt_ids(ids)
        if ids is not None and len(ids) != self.prompt_len:
            raise ValueError(f"request {self.req_id!r}: prompt_ids has {len(self.prompt_ids)} tokens but "
                             f"prompt_len is {self.prompt_len}")

    def _check_prompt_ids(self, ids) -> None:
        def refuse(got: str) -> None:
            raise ValueError(f"request {self.req_id!r}: prompt_ids must be a list of token ids (integers >= 0), "
                             f"got {got}")

        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sized):
            refuse(type(ids).__name__)
        for i, t in enumerate(ids):
            if not (is_int(t) and t >= 0):
                refuse(f"{t!r} at position {i}")

    @property
    def total_len(self) -> int:
        """Prompt plus output: the K/V the request needs at most (Orca's oracle reservation)."""
        return self.prompt_len + self.output_len

    @property
    def n_to_feed(self) -> int:
        """Tokens to feed before it yields its next one: a prefill, the rest of a chunked prompt,
        a recompute after preemption (prompt and output so far), or 1 for a decode."""
        return self.prompt_len + self.n_generated - self.num_computed_tokens

    def reset(self) -> None:
        """Back to a fresh, waiting request (the engine calls this when a run starts)."""
        self.status = Status.WAITING
        self.n_generated = self.num_computed_tokens = self.n_preemptions = 0
        self.output_ids = None

    def check_context(self, max_context: int) -> None:
        """Raise unless the request fits a model whose context is `max_context` tokens."""
        if self.total_len > max_context:
            raise ValueError(f"request {self.req_id!r}: prompt_len + output_len = {self.prompt_len} + "
                             f"{self.output_len} = {self.total_len} exceeds the max context {max_context}")
        if self.max_tokens is not None and self.max_tokens > max_context:
            raise ValueError(f"request {self.req_id!r}: max_tokens {self.max_tokens} exceeds the max "
                             f"context {max_context}")
