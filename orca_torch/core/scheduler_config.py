"""The scheduler's knobs (lecture §4.3, §6): named as Orca and vLLM name them, checked when made.

`max_bs` caps the requests in a step; `n_workers > 1` is Orca's pipelining (§4.4); `order="spf"`
serves the shortest predicted output first; `prefill="prefill_first"` runs a step of prefills
alone whenever anyone is admitted (early vLLM); `max_num_batched_tokens` caps a step's tokens and
`chunked_prefill` cuts prompts to fill it (exercise 9); `static=True` is request-level batching
(§3), with `static_idle_seats_cost` keeping a finished member's seat busy until its batch ends.
`policies.make_scheduler` picks the scheduler class that implements a config.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

from orca_torch.checks import brief, check_choice, check_flag, check_int, is_int

Order = Literal["fcfs", "spf"]
PrefillMode = Literal["mixed", "prefill_first"]
ORDERS = ("fcfs", "spf")
PREFILL_MODES = ("mixed", "prefill_first")
MAX_WORKERS = 1024
"""The most batches in flight (`n_workers`): each is a pipeline stage a step passes through, and no
model has that many layers to split into stages (the pipeline keeps a few numbers per stage)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler knobs, named as Orca and vLLM name them."""

    max_bs: int = 256
    n_workers: int = 1
    order: Order = "fcfs"
    prefill: PrefillMode = "mixed"
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = False
    static: bool = False
    static_idle_seats_cost: bool = True

    def __post_init__(self) -> None:
        for name, most in (("max_bs", None), ("n_workers", MAX_WORKERS)):    # frozen: numpy integers become ints here
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1, most))
        for name in ("chunked_prefill", "static", "static_idle_seats_cost"):
            object.__setattr__(self, name, check_flag(name, getattr(self, name)))
        for name, choices in (("order", ORDERS), ("prefill", PREFILL_MODES)):
            with contextlib.suppress(ValueError):   # (a numpy string becomes the str; `_problem` says what is wrong)
                object.__setattr__(self, name, check_choice(name, getattr(self, name), choices))
        b = self.max_num_batched_tokens
        if is_int(b):
            object.__setattr__(self, "max_num_batched_tokens", int(b))
        why = self._problem()
        if why:
            raise ValueError(why)

    def _problem(self) -> str | None:
        """The first setting that is wrong, or that does not go with the others (None: they all do)."""
        b = self.max_num_batched_tokens
        if not isinstance(self.order, str) or self.order not in ORDERS:
            return f"order must be 'fcfs' or 'spf' (shortest predicted first), got {brief(self.order)}"
        if not isinstance(self.prefill, str) or self.prefill not in PREFILL_MODES:
            return f"prefill must be 'mixed' or 'prefill_first', got {brief(self.prefill)}"
        if self.static and (self.n_workers != 1 or b is not None or self.chunked_prefill or self.order != "fcfs"
                            or self.prefill != "mixed"):     # (before the budget's own checks, which it has none of)
            given = {"n_workers": (self.n_workers, 1), "order": (self.order, "fcfs"),
                     "prefill": (self.prefill, "mixed"), "max_num_batched_tokens": (b, None),
                     "chunked_prefill": (self.chunked_prefill, False)}
            got = ", ".join(f"{k}={brief(v)}" for k, (v, default) in given.items() if v != default)
            return ("static (request-level) batching takes only max_bs: n_workers=1, fcfs, mixed, no token budget "
                    f"(max_num_batched_tokens=None, chunked_prefill=False); got {got}")
        if b is not None and (not is_int(b) or b < self.max_bs):
            return (f"max_num_batched_tokens must be an integer >= max_bs ({self.max_bs}) so every decode fits a "
                    f"step, got {brief(b)}")
        if self.chunked_prefill and b is None:
            return "chunked_prefill needs a token budget: set max_num_batched_tokens"
        if self.chunked_prefill and self.prefill == "prefill_first":
            return ("chunked_prefill mixes every step's decodes with prompt chunks (Sarathi-Serve); "
                    "it cannot be combined with prefill='prefill_first'")
        return None
