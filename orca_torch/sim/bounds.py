"""Throughput bounds no schedule beats on a paper GPU (lecture §5.4; code 03 demo 3, exercise 8).

`ideal_decode_bound` is lecture 1's ideal: every step a pure decode at the largest batch the K/V
memory holds. It leaves prefill out, which is why no real schedule reaches it when prompts are long;
`roofline_bound` counts the prefills too. `prefill_alone_s` prices each prompt prefilled on its own.
Lengths come as lists or 1-D integer arrays, one entry per request; `cost_model` prices the steps
(the roofline by default, as the lecture's bounds are).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from orca_torch.checks import GOT_LIMIT, brief, check_int, check_real
from orca_torch.core.batch import SeqWork, StepTotals, step_totals
from orca_torch.sim.hw_model import decode_totals, get_gpu, kv_capacity_tokens, pricer
from orca_torch.specs import ModelSpec, get_model_spec


def _lengths(name: str, v: Sequence[int] | np.ndarray, spec: ModelSpec) -> np.ndarray:
    """`v` as a non-empty 1-D int64 array of integers in [1, the model's context] (a list of Python or
    numpy integers, or an integer array; bools and floats refused)."""
    if isinstance(v, np.ndarray):
        want = None if v.ndim == 1 and v.dtype.kind in "iu" else \
            f"a 1-D array of integers, got an array of shape {v.shape} and dtype {v.dtype}"
    else:
        want = None if isinstance(v, Sequence) and not isinstance(v, (str, bytes)) else \
            f"a list or 1-D array of integers, got {type(v).__name__}"
    if want is not None:
        raise ValueError(f"{name} must be {want}")
    if len(v) == 0:
        raise ValueError(f"{name} is empty: a bound needs at least one request")
    if not isinstance(v, np.ndarray):
        v = np.array([check_int(f"{name}[{i}]", x, 1) for i, x in enumerate(v)], dtype=object)
    for i in (int(np.argmin(v)), int(np.argmax(v))):     # (compared as exact ints: a uint64 is never negative)
        x = int(v[i])
        if not 1 <= x <= spec.max_context:
            want = "an integer >= 1" if x < 1 else f"at most {spec.name}'s context of {spec.max_context} tokens"
            raise ValueError(f"{name}[{i}] must be {want}, got {x}")
    return v.astype(np.int64)


def _workload(spec: ModelSpec, prompt_len, output_len) -> tuple[np.ndarray, np.ndarray]:
    """Prompt lengths (>= 1) and output lengths (>= 1), one of each per request, each request within
    the model's context (prompt + output <= max_context, as the engine admits it)."""
    p, o = _lengths("prompt_len", prompt_len, spec), _lengths("output_len", output_len, spec)
    if len(p) != len(o):
        raise ValueError(f"prompt_len and output_len must have one entry per request, got {len(p)} and {len(o)}")
    over = np.flatnonzero(p + o > spec.max_context)
    if over.size:
        i = int(over[0])
        raise ValueError(f"request {i}: prompt_len {p[i]} + output_len {o[i]} = {p[i] + o[i]} tokens, beyond "
                         f"{spec.name}'s context of {spec.max_context}")
    return p, o


def ideal_decode_bound(model: str, gpu: str, prompt_len: np.ndarray, output_len: np.ndarray,
                       max_bs: int | None = None, cost_model: str = "roofline") -> dict:
    """Every step a pure decode at the largest batch the K/V memory holds.

    Context = the token-weighted mean context of the workload's decodes (token j >= 1 of a request
    with prompt p is decoded at context p + j, the new token included). Batch = K/V slots // that
    context (memory filled exactly with live tokens, nothing reserved ahead), capped at `max_bs` if
    given.
    """
    spec = get_model_spec(model)
    p, o = (a.astype(float) for a in _workload(spec, prompt_len, output_len))
    if max_bs is not None:
        max_bs = check_int("max_bs", max_bs, 1)
    n_dec = (o - 1).sum()
    if n_dec == 0:
        raise ValueError("every request has output_len 1: there is no decode to bound (output_len >= 2 for one)")
    mean_context = float(((o - 1) * p + (o - 1) * o / 2).sum() / n_dec)   # sum over j = 1..o-1 of p + j
    context = max(2, round(mean_context))
    slots = kv_capacity_tokens(model, gpu)
    batch = slots // context if max_bs is None else min(max_bs, slots // context)
    if batch == 0:
        raise ValueError(f"{spec.name} on {get_gpu(gpu).name} holds {slots} K/V tokens, fewer than one decode at "
                         f"the workload's mean context of {context} tokens: no decode batch fits")
    step = pricer(model, gpu, cost_model=cost_model).time(decode_totals(batch, context))
    return {"batch": batch, "context_tokens": context, "kv_slots": slots, "step_s": step, "tok_s": batch / step}


def roofline_bound(model: str, gpu: str, prompt_len: np.ndarray, output_len: np.ndarray, ideal: dict,
                   cost_model: str = "roofline") -> dict:
    """Every FLOP of the workload (prefills and decodes) at the compute roof, perfectly overlapped
    with the decode-only memory time at the ideal batch.

    Time >= max(all FLOPs / FLOP rate, decode tokens / ideal decode rate); tokens / that time.
    `ideal` is `ideal_decode_bound`'s result (its `tok_s`, a finite number > 0, is used).
    """
    p, o = _workload(get_model_spec(model), prompt_len, output_len)
    if not isinstance(ideal, Mapping) or "tok_s" not in ideal:
        got = (f"keys {brief(sorted(map(str, ideal)), GOT_LIMIT)}" if isinstance(ideal, Mapping)
               else type(ideal).__name__)
        raise ValueError(f"ideal must be ideal_decode_bound's result (a dict with 'tok_s'), got {got}")
    tok_s = check_real("ideal['tok_s']", ideal["tok_s"], 0.0, lo_open=True, unit="tokens per second")
    n_decodes = o - 1                   # a request's first token comes out of its prefill
    stored = int((n_decodes * (p - 1) + n_decodes * o // 2).sum())   # decode j = 1..o-1 has p + j - 1 stored
    # Every prompt as one step (SeqWork(p, 0)) and every decode as one of a token on top of its
    # stored context (SeqWork(1, p + j - 1)), summed as one step: the totals are additive, the FLOPs follow them.
    totals = step_totals(((None, n, 0) for n in p.tolist()), int(n_decodes.sum()), stored)
    compute_s = pricer(model, gpu, cost_model=cost_model).cost(totals).compute_s
    decode_s = float(n_decodes.sum()) / tok_s
    return {"all_flops_s": compute_s, "decode_only_s": decode_s,
            "tok_s": float(o.sum()) / max(compute_s, decode_s)}


def prefill_alone_s(model: str, gpu: str, prompt_len: np.ndarray, cost_model: str = "roofline") -> float:
    """GPU time of every prompt prefilled alone (the work the ideal decode bound leaves out)."""
    step_pricer = pricer(model, gpu, cost_model=cost_model)
    prompts = _lengths("prompt_len", prompt_len, get_model_spec(model))
    return float(sum(step_pricer.time(StepTotals.of([SeqWork(int(p), 0)])) for p in prompts))
