"""The scheduler settings the random-workload tests draw, built in one place."""
from __future__ import annotations

from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.lab.baselines import static_batching


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
