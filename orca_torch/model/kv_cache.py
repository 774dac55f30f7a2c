"""Orca's Attention K/V manager: per-request K/V storage, reserved on admission (lecture §4.2, §4.3).

Orca keeps each request's keys and values from the step it is admitted until the scheduler says
it finished, and reserves room for `max_tokens` of them up front so an admitted request can always
run to the end (Algorithm 1's `n_slots` bound). This manager does exactly that:

- `reserve(req_id, n_tokens)` allocates one buffer `[n_layers, 2, n_kv_heads, n_tokens, head_dim]`
  for the request (so its K/V is contiguous per head and attention reads it as a view, never a
  gather); the sum of reservations may not exceed `n_slots`.
- the model writes each step's new K/V *in place* at positions `length .. length + n_new` and reads
  `[:length + n_new]` per request for attention; nothing already stored is copied again.
- `free(req_id)` releases the buffer when the request finishes (or is preempted).

It accounts slots reserved vs slots holding tokens: the gap is the memory Orca's max-length
reservation wastes (lecture §6.1, the starting point of PagedAttention).
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

from orca_torch.checks import brief, check_device, check_instance, check_int, check_req_id
from orca_torch.core.batch import Batch
from orca_torch.core.memory import slots_to_finish
from orca_torch.core.request import Request
from orca_torch.model.kv_views import StepKV, StepView
from orca_torch.specs import ModelSpec, get_model_spec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def check_dtype(dtype, name: str = "dtype") -> torch.dtype:
    """A floating torch dtype the model runs in, given as the dtype or by its name."""
    d = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if d not in DTYPES.values():
        raise ValueError(f"{name} must be one of {', '.join(DTYPES)} (a torch dtype or its name), got {brief(dtype)}")
    return d


def check_spec(spec) -> ModelSpec:
    """`spec` itself if a `ModelSpec`, the preset it names if a string (`get_model_spec`)."""
    return get_model_spec(check_instance("spec", spec, (ModelSpec, str)))


class KVError(Exception):
    """Base class of the manager's errors."""


class OutOfSlotsError(KVError, ValueError):
    """A reservation would take the total past `n_slots`."""


class KVStore:
    """The K/V store the model is given: the one plug-in point for K/V storage (a contiguous buffer per
    request, paged blocks, or a researcher's own layout), as gpt-fast's and vLLM's models ask their
    cache for K/V and never look at its type.

    Built here, and checked once: the model's spec (a `ModelSpec` or a preset's name), the device, and
    the dtype (a floating torch dtype or its name, "bfloat16"); its `spec` says the bytes of the dtype
    it holds, as `OrcaModel.spec` does. A store defines the `MODEL_CALLS`: `length` and `capacity`
    (what `can_append`, the model's question before a step, asks of) and `step_view`, the object
    (`kv_views.StepView`) through which the step reads and writes K/V; `OrcaModel.check_kv` refuses a
    store that leaves one out. `serves_block_tables` says whether the view hands a block-table kernel
    the store itself (paged stores of a block size the kernel takes).

    A store the torch executor runs on also defines the `EXECUTOR_CALLS`, how it makes and gives
    back room for requests: `holds`, `check_fits` (at the door, before a run), `make_room` (before
    each step's forward) and `free`. The executor calls nothing else on it and never looks at its
    type, so each store makes room its own way: `KVManager` reserves a request's whole future when
    it is first fed, `PagedKVManager` hands out blocks as its tokens arrive and copies swaps."""

    MODEL_CALLS = ("length", "capacity", "step_view")
    EXECUTOR_CALLS = ("holds", "check_fits", "make_room", "free")

    def __init__(self, spec: ModelSpec | str, device: str | torch.device, dtype: torch.dtype | str) -> None:
        self.dtype = check_dtype(dtype)
        self.spec = check_spec(spec).with_dtype_bytes(self.dtype.itemsize)
        self.device = torch.device(check_device(device))

    @classmethod
    def undefined(cls, calls: Sequence[str]) -> list[str]:
        """Those of `calls` (`MODEL_CALLS`, `EXECUTOR_CALLS`) the store leaves to `KVStore`, whose own
        raise NotImplementedError: what `OrcaModel.check_kv` and `TorchExecutor` refuse a store for."""
        return [name for name in calls if getattr(cls, name) is getattr(KVStore, name)]

    def length(self, req_id: Hashable) -> int:
        """Tokens whose K/V is stored for the request."""
        raise NotImplementedError

    def capacity(self, req_id: Hashable) -> int:
        """Tokens the request can hold without more memory."""
        raise NotImplementedError

    def step_view(self, req_ids: Sequence[Hashable], past: Sequence[int], sizes: Sequence[int]) -> StepView:
        """One step's K/V of `req_ids` (`past[i]` tokens stored, `sizes[i]` new ones), in the layouts the
        attention paths read (`kv_views.StepView`); its `finish` commits the step."""
        raise NotImplementedError

    @property
    def serves_block_tables(self) -> bool:
        """Whether `step_view(...).block_table_layout()` hands a block-table kernel the store in place."""
        return False

    def holds(self, req_id: Hashable) -> bool:
        """Whether the store keeps K/V under `req_id`, wherever it keeps it (paged: on the device or
        swapped out): the executor frees only what it put there, and refuses a run whose id the store
        already holds K/V under from outside."""
        raise NotImplementedError

    def check_fits(self, req: Request) -> None:
        """Raise ValueError, naming the request and the store's size, unless the store could hold
        `req`'s K/V to its end (`memory.slots_to_finish` tokens) with nothing else in it: the
        executor's check at the door, before the run."""
        raise NotImplementedError

    def make_room(self, batch: Batch) -> float:
        """Before the step's forward: carry out the batch's swaps (`Batch.swapped_out`, `swapped_in`), if
        the store keeps swapped K/V, and give each work room for its `n_past + n_new` tokens, holding a
        request first where it is fed from its first token (`n_past == 0`) and not held yet. Returns the
        seconds spent copying K/V (the swaps), which the step's wall time counts. Raises RuntimeError
        naming `batch.index` where the engine's memory manager admitted more than the store holds."""
        raise NotImplementedError

    def free(self, req_id: Hashable) -> None:
        """Give back all the K/V held under `req_id` (it finished, left or was preempted)."""
        raise NotImplementedError

    def can_append(self, req_id: Hashable, n_past: int, n_new: int) -> bool:
        """Whether `n_new` tokens can follow `n_past` stored ones in the room the request holds now
        (its `capacity`; `make_room`, or paged `ensure` by hand, gives it more): what the step asserts
        before writing."""
        return self.length(req_id) == n_past and n_past + n_new <= self.capacity(req_id)

    @staticmethod
    def _get(table: dict, req_id: Hashable):
        """`table[req_id]`, None if absent: the one lookup every method taking a request id goes
        through, so an id no request could have is refused (`checks.check_req_id`) wherever a user
        passes it, at no cost to the ids the engine passes (the check runs only once the lookup fails)."""
        try:
            return table.get(req_id)
        except TypeError:
            check_req_id(req_id)
            raise


class KVManager(KVStore):
    """Per-request K/V buffers with Orca-style reservation and slot accounting.

    `n_slots` is the K/V budget in tokens (one slot holds one token's K and V in every layer).
    """

    def __init__(self, spec: ModelSpec | str, n_slots: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str = torch.float32) -> None:
        super().__init__(spec, device, dtype)
        self.n_slots = check_int("n_slots", n_slots, 1)
        self._buf: dict[Hashable, torch.Tensor] = {}
        self._len: dict[Hashable, int] = {}
        self._slots_reserved = 0
        self._slots_used = 0

    # ---- admission and release -------------------------------------------------------------
    def reserve(self, req_id: Hashable, n_tokens: int) -> None:
        """Reserve room for `n_tokens` tokens of `req_id` (Orca reserves the request's max_tokens).
        Called by the distributed workers and by hand (a step run directly), so a count past the
        model's context, or an id no request could have (`checks.req_id_problem`), is refused here,
        with nothing reserved (`make_room`, which the torch executor calls, uses `_reserve`)."""
        check_req_id(req_id)
        n_tokens = check_int("n_tokens", n_tokens, 1)
        if n_tokens > self.spec.max_context:
            raise ValueError(f"cannot reserve {n_tokens} tokens for request {brief(req_id)}: a request holds at most "
                             f"the model's max_context={self.spec.max_context} tokens")
        assert req_id not in self._buf, f"request {brief(req_id)} already holds a reservation; free it first"
        free = self.n_slots - self._slots_reserved
        if n_tokens > free:
            raise OutOfSlotsError(f"cannot reserve {n_tokens} slots for request {brief(req_id)}: only "
                                  f"{free} of n_slots={self.n_slots} are unreserved")
        self._reserve(req_id, n_tokens)

    def _reserve(self, req_id: Hashable, n_tokens: int) -> None:
        """`reserve` past its checks: `make_room`'s requests passed the engine's door (`Request`'s id,
        `Request.check_context`), and it found the room itself."""
        assert req_id not in self._buf and 1 <= n_tokens <= self.slots_free, (req_id, n_tokens, self.slots_free)
        s = self.spec
        self._buf[req_id] = torch.zeros(s.n_layers, 2, s.n_kv_heads, n_tokens, s.head_dim,
                                        device=self.device, dtype=self.dtype)
        self._len[req_id] = 0
        self._slots_reserved += n_tokens

    def make_room(self, batch: Batch) -> float:
        """A request fed for the first time gets its buffer of `slots_to_finish` slots (Orca reserves
        its whole future); nothing is copied, so 0 seconds. A memory manager that admits more than the
        store holds is named."""
        for w in batch.works:
            r = w.req
            if w.n_past == 0 and not self.has(r.req_id):
                need = slots_to_finish(r)
                if need > self.slots_free:
                    raise RuntimeError(f"batch {batch.index} needs {need} K/V slots for request {brief(r.req_id)}, "
                                       f"but only {self.slots_free} of n_slots={self.n_slots} are free: the engine's "
                                       "memory manager admits more than the K/V store holds; give it the store's size "
                                       f"(e.g. ReservationMemory({self.n_slots}, policy='oracle'), which reserves "
                                       "prompt + output, a slot more than the store takes)")
                self._reserve(r.req_id, need)
        return 0.0

    def free(self, req_id: Hashable) -> None:
        """Release the request's reservation (`TorchExecutor.release` calls this when it finishes or is
        preempted; the scheduler frees its own accounting, a `MemoryManager`, apart)."""
        buf = self._get(self._buf, req_id)
        assert buf is not None, (f"cannot free request {brief(req_id)}: it holds no reservation (never reserved, "
                                 "or freed already)")
        del self._buf[req_id]
        self._slots_reserved -= buf.shape[3]
        self._slots_used -= self._len.pop(req_id)

    # ---- queries ------------------------------------------------------------------------------
    def has(self, req_id: Hashable) -> bool:
        return self._get(self._buf, req_id) is not None

    def holds(self, req_id: Hashable) -> bool:
        """Whether the request holds a reservation (`has`: the store keeps K/V nowhere else)."""
        return self.has(req_id)

    def check_fits(self, req: Request) -> None:
        """Refuse a request whose `slots_to_finish` exceed `n_slots`: no reservation could hold it."""
        if slots_to_finish(req) > self.n_slots:
            raise ValueError(f"request {brief(req.req_id)} stores up to {slots_to_finish(req)} tokens' K/V (prompt "
                             f"{req.prompt_len} + output {req.output_len} - 1), but the K/V store holds "
                             f"n_slots={self.n_slots}: it could never run; give the model a larger K/V store")

    def length(self, req_id: Hashable) -> int:
        """Tokens whose K/V is stored for the request."""
        self._buffer(req_id)
        return self._len[req_id]

    @property
    def slots_reserved(self) -> int:
        return self._slots_reserved

    @property
    def slots_used(self) -> int:
        """Slots that hold a token's K/V (<= slots_reserved)."""
        return self._slots_used

    @property
    def slots_free(self) -> int:
        return self.n_slots - self._slots_reserved

    @property
    def n_requests(self) -> int:
        return len(self._buf)

    # ---- the model's side -----------------------------------------------------------------------
    def capacity(self, req_id: Hashable) -> int:
        """Tokens the request can hold without more memory: the slots reserved for it (what
        `PagedKVManager.capacity` is for its blocks)."""
        return self._buffer(req_id).shape[3]

    def storage(self, req_id: Hashable) -> torch.Tensor:
        """The request's buffer `[n_layers, 2 (K, V), n_kv_heads, reserved, head_dim]`.

        The model writes new K/V into `[..., length:length + n_new, :]` in place and reads
        `[..., :length + n_new, :]` as a view; call `commit` once the step's layers are done.
        """
        return self._buffer(req_id)

    def step_view(self, req_ids: Sequence[Hashable], past: Sequence[int], sizes: Sequence[int]) -> StepKV:
        """The step's views of the requests' buffers (`kv_views.StepKV`)."""
        return StepKV(self, req_ids, past, sizes)

    def commit(self, req_id: Hashable, n_new: int) -> None:
        """Mark `n_new` more tokens as stored (after every layer wrote them; `can_append` allowed them)."""
        buf = self._buffer(req_id)
        new_len = self._len[req_id] + n_new
        assert n_new >= 0, f"request {brief(req_id)}: committing {n_new} tokens (a commit stores 0 or more)"
        assert new_len <= buf.shape[3], (
            f"request {brief(req_id)}: committing {n_new} tokens after {self._len[req_id]} exceeds its reservation "
            f"of {buf.shape[3]} (reserve it at least {new_len} tokens from the start: a reservation does not grow)")
        self._len[req_id] = new_len
        self._slots_used += n_new

    def read(self, req_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored K and V of one layer, each `[n_kv_heads, length, head_dim]` (views, no copy)."""
        buf = self._buffer(req_id)
        n = self._len[req_id]
        return buf[layer, 0, :, :n], buf[layer, 1, :, :n]

    def _buffer(self, req_id: Hashable) -> torch.Tensor:
        """The request's buffer (as `PagedKVManager._blocks` gives a request's blocks), asserted held."""
        buf = self._get(self._buf, req_id)
        assert buf is not None, f"unknown request {brief(req_id)}: never reserved, or freed already; reserve it first"
        return buf

    def __repr__(self) -> str:
        return (f"KVManager({self.spec.name}, requests={self.n_requests}, slots_used={self._slots_used}, "
                f"slots_reserved={self._slots_reserved}, n_slots={self.n_slots})")
