"""The `tiny` model every torch-path test compares with, its one-request greedy generation
(memoised: many examples share a prompt), and the log probabilities a request's tokens must have."""
from __future__ import annotations

from functools import lru_cache

import torch

from orca_torch.core.batch import SeqWork
from orca_torch.model.orca_model import OrcaModel, generate_alone

MODEL = OrcaModel("tiny", seed=0)


@lru_cache(maxsize=None)
def _alone(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(generate_alone(MODEL, list(prompt), n))


def alone(prompt, n: int) -> list[int]:
    """`generate_alone(MODEL, prompt, n)`, a fresh list each call."""
    return list(_alone(tuple(int(t) for t in prompt), n))


def next_logits(ids, model: OrcaModel = MODEL) -> torch.Tensor:
    """`model`'s raw logits `[vocab]` for the token after `ids`, fed to it alone in one prefill."""
    kv = model.new_kv(len(ids))
    kv.reserve(0, len(ids))
    return model.forward_batch(torch.tensor(list(ids)), [SeqWork(len(ids), 0)], [0], kv)[0]


def raw_logprobs(prompt, out, model: OrcaModel = MODEL) -> torch.Tensor:
    """The log-softmax of `model`'s logits before each of `out`: the prompt and the tokens before it
    fed to it alone, in one prefill."""
    ids = list(prompt) + list(out[:-1])
    rows = [next_logits(ids[:n], model) for n in range(len(prompt), len(ids) + 1)]
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)
