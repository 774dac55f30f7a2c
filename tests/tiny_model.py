"""The `tiny` model every torch-path test compares with, and its one-request greedy generation
(memoised: many examples share a prompt)."""
from __future__ import annotations

from functools import lru_cache

from orca_torch.model.orca_model import OrcaModel, generate_alone

MODEL = OrcaModel("tiny", seed=0)


@lru_cache(maxsize=None)
def _alone(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(generate_alone(MODEL, list(prompt), n))


def alone(prompt, n: int) -> list[int]:
    """`generate_alone(MODEL, prompt, n)`, a fresh list each call."""
    return list(_alone(tuple(int(t) for t in prompt), n))
