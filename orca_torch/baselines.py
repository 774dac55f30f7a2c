"""The baselines Orca is measured against, on the same engine (lecture §3, §5.2).

- Request-level (static) batching, as Triton + FasterTransformer serve a generative model: when the
  engine is idle, up to B waiting requests start together and the batch runs until its LAST request
  finishes; a request that arrives meanwhile waits for the whole batch (§3.1). Seats of requests
  that finished early stay in the batch. With `idle_seats_cost=True` (default) they still cost
  compute and K/V reads on the paper GPU — FasterTransformer keeps decoding the batch's fixed shape
  until every sequence is done — and their memory is released only when the batch ends. Tokens are
  still timed when they are produced (streaming), which is kind to static batching: a server that
  returns whole answers would make its TTFT far worse. The batch's prompts are priced as one ragged
  prefill (selective batching), also a little kinder than FasterTransformer's padding.
- One at a time: Orca's engine with `max_bs = 1` — each request runs alone, prefill then decodes.
"""
from __future__ import annotations

from .scheduler import SchedulerConfig


def static_batching(max_bs: int = 128, idle_seats_cost: bool = True) -> SchedulerConfig:
    """Request-level batching with batches of up to `max_bs` requests."""
    return SchedulerConfig(max_bs=max_bs, static=True, static_idle_seats_cost=idle_seats_cost)


def one_at_a_time() -> SchedulerConfig:
    """Iteration-level scheduling with a single seat."""
    return SchedulerConfig(max_bs=1)
