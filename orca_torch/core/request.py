"""A request in the pool: what the client asked for, and the counters the scheduler keeps (lecture §4.3).

Orca's workload generates no end-of-sequence token: every request runs for exactly its
`output_len` tokens (as in Orca's evaluation), so the true output length is part of the request. `max_tokens`
is what the request *may* reach (prompt + the allowance the server grants); it is what Orca's
max-length reservation sets aside when the request is first scheduled. `predicted_output` feeds
shortest-predicted-first (§6.3); `prompt_ids` feed the torch executor, which keeps the request's
`stop_token_ids` (a model's end-of-sequence ids, a client's stop tokens) from being picked until it
has made `min_tokens` tokens (vLLM's `min_tokens`; the engine itself runs every request for
`output_len`: a live server ends one at a stop token it makes later). `sampling` (a
`model.sampling.SamplingParams`, or None: greedy) says how the torch executor draws its tokens;
the paper GPU makes no tokens and ignores it.

The counters are true after every step: `num_computed_tokens` (tokens whose K/V is stored; 0
again after a recompute preemption), `n_generated` (tokens delivered), `status`. The request
needs `n_to_feed = prompt_len + n_generated - num_computed_tokens` tokens fed to yield its next
one: the whole prompt, a chunk of it, everything again after a preemption, or 1 to decode. The
engine re-checks the fields (`validate`) and resets the counters when a run starts, so the same
list can be run twice; never by two runs at once: the counters are one run's state, so a request still
WAITING, RUNNING or IN_FLIGHT in a run that is not over is refused by any other (`owner`, a weak
reference to the engine of its last run, says which: a run replaced, failed or garbage-collected
holds it no more).
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Hashable

from orca_torch.checks import brief, is_finite_real, is_int, req_id_problem


class Status(Enum):
    """Where a request is: waiting in the queue, admitted to the running pool, inside a batch that
    is in the pipeline (only with `n_workers > 1`: between `schedule` and `complete`), done, or
    refused at submission, or gone before its end (a live run's `Engine.abort`, or a run that stopped
    on an error or was left for another before its end). WAITING -> RUNNING (<-> IN_FLIGHT) ->
    FINISHED; a preempted request goes back to WAITING; REJECTED at submission instead of WAITING;
    WAITING, RUNNING or IN_FLIGHT -> ABORTED. The first three are a run's: `ACTIVE`."""

    WAITING = "waiting"
    RUNNING = "running"
    IN_FLIGHT = "in_flight"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"


ACTIVE = (Status.WAITING, Status.RUNNING, Status.IN_FLIGHT)     # a request whose run is not over for it


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
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    sampling: object | None = None          # a SamplingParams (model.sampling; core does not import it)

    status: Status = field(default=Status.WAITING, init=False)
    num_computed_tokens: int = field(default=0, init=False)  # tokens whose K/V is stored
    n_generated: int = field(default=0, init=False)          # tokens delivered to the client so far
    n_preemptions: int = field(default=0, init=False)
    output_ids: list[int] | None = field(default=None, init=False, repr=False)
    output_logprobs: list | None = field(default=None, init=False, repr=False)  # beside output_ids, if asked
    run_index: int = field(default=-1, init=False, repr=False)  # position in the engine's run
    owner: weakref.ref | None = field(default=None, init=False, repr=False)   # its last run's engine, weakly

    def __post_init__(self) -> None:
        cls = type(self)
        if cls is not Request and (cls.__eq__ is not object.__eq__ or cls.__hash__ is not object.__hash__):
            how = ("compares by value and " + ("cannot be hashed" if cls.__hash__ is None else "hashes by value")
                   if cls.__eq__ is not object.__eq__ else "hashes by value")
            raise TypeError(f"{cls.__name__} {how} (a dataclass's eq=True or unsafe_hash=True): a run keys each "
                            "request by identity, in sets and dicts; declare it @dataclasses.dataclass(eq=False, "
                            "slots=True), as Request is")
        if cls is not Request and not hasattr(self, "owner"):
            # A dataclass subclass without slots=True: its __init__ leaves the run-state fields unset
            # (their defaults were class attributes, which the slots replaced).
            for f in fields(Request):
                if not f.init:
                    setattr(self, f.name, f.default)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError unless the fields make a request (the engine re-checks at submission, so
        a field changed after construction is caught before the run starts); a numpy number in a
        field that is right becomes the plain `int` or `float` the scheduler counts with."""
        p, o, a = self.prompt_len, self.output_len, self.arrival_s
        if (type(p) is int and type(o) is int and type(a) is float and p >= 1 and o >= 1 and 0.0 <= a < math.inf
                and self.max_tokens is None and self.predicted_output is None and self.prompt_ids is None
                and type(self.req_id) in (int, str) and type(self.min_tokens) is int and self.min_tokens == 0
                and type(self.stop_token_ids) is tuple and not self.stop_token_ids):
            return                              # the common case, checked cheaply (workloads make many)
        why = self._problem()
        if why:
            raise ValueError(why)
        if type(self.prompt_len) is not int or type(self.output_len) is not int:
            self.prompt_len, self.output_len = int(self.prompt_len), int(self.output_len)
        if type(self.arrival_s) is not float:
            self.arrival_s = float(self.arrival_s)
        if self.max_tokens is not None:
            self.max_tokens = int(self.max_tokens)
        if self.predicted_output is not None:
            self.predicted_output = float(self.predicted_output)
        self.min_tokens, self.stop_token_ids = int(self.min_tokens), tuple(int(t) for t in self.stop_token_ids)

    def _problem(self) -> str | None:
        """The first field that is wrong, and why (None: the fields make a request)."""
        why = req_id_problem(self.req_id)
        if why:
            return why
        at = f"request {brief(self.req_id)}: "
        for name in ("prompt_len", "output_len"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                return (f"{at}{name} must be an integer >= 1 (a Python or numpy integer; not a float or bool), "
                        f"got {brief(v)} ({type(v).__name__})")
        if not is_finite_real(self.arrival_s) or self.arrival_s < 0:
            return f"{at}arrival_s must be a finite number >= 0, got {brief(self.arrival_s)}"
        total = int(self.prompt_len) + int(self.output_len)     # (numpy integers would wrap around)
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < total):
            return (f"{at}max_tokens must be an integer >= prompt_len + output_len = {total}, "
                    f"got {brief(self.max_tokens)}")
        p = self.predicted_output
        if p is not None and (not is_finite_real(p) or p <= 0):
            return f"{at}predicted_output must be a finite number > 0, got {brief(p)}"
        m = self.min_tokens
        if not is_int(m) or not 0 <= m <= self.output_len:
            return f"{at}min_tokens must be an integer in [0, output_len = {self.output_len}], got {brief(m)}"
        stops = self.stop_token_ids
        if type(stops) is not tuple or not all(is_int(t) and t >= 0 for t in stops):
            return f"{at}stop_token_ids must be a tuple of token ids (integers >= 0), got {brief(stops)}"
        ids = self.prompt_ids
        if ids is None:
            return None
        if isinstance(ids, (str, bytes)) or not (isinstance(ids, Sequence) or getattr(ids, "ndim", None) == 1):
            return (f"{at}prompt_ids must be a list of token ids (integers >= 0), in order (a list, a tuple or a "
                    f"1-D array), got {type(ids).__name__}")
        for i, t in enumerate(ids):
            if not (is_int(t) and t >= 0):
                listed = ids.tolist()[i] if hasattr(ids, "tolist") and not is_int(t) else None   # a tensor's
                boxed = (f", an element of a {type(ids).__name__} that is no integer: give prompt_ids.tolist()"
                         if is_int(listed) and listed >= 0 else "")
                return (f"{at}prompt_ids must be a list of token ids (integers >= 0), got {brief(t)} at position "
                        f"{i}{boxed}")
        if len(ids) != self.prompt_len:
            return f"{at}prompt_ids has {len(ids)} tokens but prompt_len is {self.prompt_len}"
        return None

    def __getstate__(self) -> dict:
        """Every attribute, for pickle and `copy`: the fields and any a subclass adds (a slot, or one
        set in its `__init__` or after: a policy may read it), but `owner` (a weak reference: neither
        pickled nor shared): a copy belongs to no run."""
        state = {}
        for cls in type(self).__mro__:
            slots = cls.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name.startswith("__") and not name.endswith("__"):    # a private slot, stored mangled
                    name = f"_{cls.__name__.lstrip('_')}{name}"
                if name not in ("__dict__", "__weakref__") and hasattr(self, name):
                    state[name] = getattr(self, name)
        state.update(getattr(self, "__dict__", {}))
        state["owner"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        for name, v in state.items():
            setattr(self, name, v)

    @property
    def total_len(self) -> int:
        """Prompt plus output, the request's true length: what Orca's oracle reservation sets aside.
        It stores one token fewer at most: its last token is delivered, never fed back."""
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
        self.output_ids = self.output_logprobs = None

    def check_context(self, max_context: int) -> None:
        """Raise unless the request fits a model whose context is `max_context` tokens."""
        if self.total_len > max_context or (self.max_tokens or 0) > max_context:
            what = (f"prompt_len + output_len = {self.prompt_len} + {self.output_len} = {self.total_len}"
                    if self.total_len > max_context else f"max_tokens {self.max_tokens}")
            raise ValueError(f"request {brief(self.req_id)}: {what} exceeds the max context {max_context}")
