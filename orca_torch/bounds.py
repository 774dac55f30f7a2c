"""Throughput bounds no schedule beats on a paper GPU (lecture §5.4; code 03 demo 3, exercise 8).

`ideal_decode_bound` is lecture 1's ideal: every step a pure decode at the largest batch the K/V
memory holds. It leaves prefill out, which is why no real schedule reaches it when prompts are long;
`roofline_bound` counts the prefills too. `prefill_alone_s` prices each prompt prefilled on its own.
"""
from __future__ import annotations

import numpy as np

from .batch import SeqWork, StepTotals
from .hw_model import decode_totals, kv_capacity_tokens, pricer


def ideal_decode_bound(model: str, gpu: str, prompt_len: np.ndarray, output_len: np.ndarray,
                       max_bs: int | None = None) -> dict:
    """Every step a pure decode at the largest batch the K/V memory holds.

    Context = the token-weighted mean context of the workload's decodes (token j >= 1 of a request
    with prompt p is decoded at context p + j, the new token included). Batch = K/V slots // that
    context (memory filled exactly with live tokens, nothing reserved ahead), capped at `max_bs` if
    given.
    """
    p, o = prompt_len.astype(float), output_len.astype(float)
    n_dec = (o - 1).sum()
    ctx = float(((o - 1) * p + (o - 1) * o / 2).sum() / n_dec)
    c = max(2, round(ctx))
    slots = kv_capacity_tokens(model, gpu)
    batch = slots // c if max_bs is None else min(max_bs, slots // c)
    step = pricer(model, gpu).time(decode_totals(batch, c))
    return {"batch": batch, "context_tokens": c, "kv_slots": slots, "step_s": step, "tok_s": batch / step}


def roofline_bound(model: str, gpu: str, prompt_len: np.ndarray, output_len: np.ndarray, ideal: dict) -> dict:
    """Every FLOP of the workload (prefills and decodes) at the compute roof, perfectly overlapped
    with the decode-only memory time at the ideal batch.

    Time >= max(all FLOPs / FLOP rate, decode tokens / ideal decode rate); tokens / that time.
    """
    p = prompt_len.astype(np.int64)
    o = output_len.astype(np.int64)
    d = o - 1
    dec_ctx = int((d * p + d * o // 2).sum())  # decode j = 1..o-1 reads p + j tokens
    pre = StepTotals(len(p), int(p.sum()), int(p.sum()), int((p * p).sum()), int((p * (p + 1) // 2).sum()))
    dec = StepTotals(int(d.sum()), int(d.sum()), dec_ctx, dec_ctx, dec_ctx)
    compute_s = pricer(model, gpu).cost(pre + dec).compute_s
    decode_s = float(d.sum()) / ideal["tok_s"]
    return {"all_flops_s": compute_s, "decode_only_s": decode_s,
            "tok_s": float(o.sum()) / max(compute_s, decode_s)}


def prefill_alone_s(model: str, gpu: str, prompt_len: np.ndarray) -> float:
    """GPU time of every prompt prefilled alone (the work the ideal decode bound leaves out)."""
    pr = pricer(model, gpu)
    return float(sum(pr.time(StepTotals.of([SeqWork(int(p), 0)])) for p in prompt_len))
