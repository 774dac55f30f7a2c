"""The scheduler settings and memory managers the random-workload tests draw, built in one place."""
from __future__ import annotations

from orca_torch.core.memory import POLICIES, MemoryManager, ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.lab.baselines import static_batching


def make_memory(kind: str, n_slots: int | None, serving_context: int) -> MemoryManager:
    """`max` / `pow2` / `oracle` (reservation), `ondemand` (TokenMemory) or `unlimited`, its serving
    context (what a request without `max_tokens` may reach) set as an engine would set it."""
    if kind in POLICIES:
        mem = ReservationMemory(n_slots, kind)
    elif kind == "ondemand":
        mem = TokenMemory(n_slots)
    else:
        assert kind == "unlimited", kind
        mem = UnlimitedMemory(n_slots)
    mem.default_max_tokens = serving_context
    return mem


def random_config(max_bs: int, static: bool, budget: str | None, prefill: str, **knobs) -> SchedulerConfig:
    """Static batching, or Orca with no token budget, a whole-prompt budget (`"whole"`) or chunked
    prefill (`"chunked"`, with mixed steps only); `knobs` go to `SchedulerConfig` as they are."""
    if static:
        return static_batching(max_bs)
    if budget == "chunked" and prefill == "mixed":
        knobs.update(max_num_batched_tokens=max_bs + 100, chunked_prefill=True)
    elif budget == "whole":
        knobs.update(max_num_batched_tokens=1000)
    return SchedulerConfig(max_bs=max_bs, prefill=prefill, **knobs)
