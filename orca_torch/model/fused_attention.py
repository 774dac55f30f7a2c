"""Orca's fused attention: one attention call per layer for many requests (lecture §4.2; Orca §4.2,
"selective batching" with its fused kernel), a speed layer beside the model's split loop.

The split loop dispatches a handful of small ops per request per layer: on a CPU that is
microseconds of dispatch each, on a GPU thousands of tiny kernel launches per step. Three fused forms:

- `batched_decode_attention`: the step's one-token rows attend together, as one masked
  matmul-softmax-matmul over their K/V padded to the longest context among them. It computes the
  padded rectangle `B x K_max` per head, not `sum(n_ctx)`: `OrcaModel.executed_works` (`orca_model.py`) says so,
  and FlopCounterMode counts exactly that.
- `varlen_attention`: every row of the step in one call of a variable-length kernel (torch's
  `varlen_attn`, Flash Attention on CUDA) over the flat `[sum L]` queries and flat K/V with
  cumulative lengths, causal aligned to the end of each request's keys, GQA in the kernel.
- `block_table_attention`: the same kernel reading paged K/V through the requests' block tables
  (`block_table=`, `seqused_k=`): each layer writes its new K/V into the blocks in place and no past
  K/V is gathered (vLLM's PagedAttention, lecture §7).

All take Q pre-scaled by 1/sqrt(d), as the split loop does.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

from orca_torch.model.kv_views import BlockTableKV, FlatKV, PaddedKV

VarlenKernel = Callable[..., torch.Tensor]


VARLEN_ARGS = ("scale", "window_size", "enable_gqa")
BLOCK_TABLE_ARGS = VARLEN_ARGS + ("seqused_k", "block_table")
"""The keyword arguments `varlen_attention` and `block_table_attention` pass the kernel."""


def torch_varlen_kernel(device: torch.device, dtype: torch.dtype, needs: tuple[str, ...] = VARLEN_ARGS
                        ) -> VarlenKernel | None:
    """torch's `varlen_attn` where it can run (CUDA, fp16/bf16: Flash Attention's dtypes) and takes
    the keyword arguments `needs`, else None (the batched path runs). An older torch's takes no
    `enable_gqa` and is called without it (`without_gqa_flag`)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    takes = set(inspect.signature(varlen_attn).parameters)
    if not set(needs) - {"enable_gqa"} <= takes:
        return None
    return varlen_attn if "enable_gqa" in takes else without_gqa_flag(varlen_attn)


def without_gqa_flag(kernel: VarlenKernel) -> VarlenKernel:
    """`kernel`, whose signature has no `enable_gqa`, called without it and given the K/V heads as
    they are stored: Flash Attention reads a K/V head for each group of query heads itself, and the
    later flag only guards a check of the head counts. Repeating the heads instead halved the
    speed of a large decode on an H200 with torch 2.11 (`benchmarks/README.md`, "On a GPU")."""
    def call(q, k, v, *args, enable_gqa: bool = False, **kwargs):
        return kernel(q, k, v, *args, **kwargs)
    return call


def batched_decode_attention(cache: torch.Tensor, q: torch.Tensor, kv_new: torch.Tensor, pk: PaddedKV,
                             group: int) -> torch.Tensor:
    """cache `[2, B, n_kv, K_max, d]` (this layer's stored K/V), q `[B, n_heads, d]`, kv_new
    `[B, 2, n_kv, d]` of one-token rows -> `[B, n_heads * d]`."""
    B, n_heads, d = q.shape
    n_kv = kv_new.shape[2]
    cache[:, pk.batch_idx, :, pk.pos] = kv_new               # this step's K/V at slot n_past
    pk.new.append(kv_new)
    scores = torch.matmul(q.view(B, n_kv, group, d), cache[0].transpose(-1, -2))  # [B, n_kv, g, K_max]
    scores = scores.masked_fill(pk.mask, float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), cache[1])    # [B, n_kv, g, d]
    return out.reshape(B, n_heads * d)


def varlen_attention(layer: int, q: torch.Tensor, kv_new: torch.Tensor, fk: FlatKV,
                     kernel: VarlenKernel) -> torch.Tensor:
    """q `[T, n_heads, d]`, kv_new `[T, 2, n_kv, d]` for every row of the step -> `[T, n_heads * d]`."""
    T, n_heads, d = q.shape
    cache = fk.cache[layer]                                  # [2, sum K, n_kv, d]
    cache[:, fk.new_rows] = kv_new.transpose(0, 1)
    out = kernel(q, cache[0], cache[1], fk.cu_q, fk.cu_k, fk.max_q, fk.max_k, scale=1.0,
                 window_size=(-1, 0), enable_gqa=True)       # [T, n_heads, d]
    return out.reshape(T, n_heads * d)


def block_table_attention(layer: int, q: torch.Tensor, kv_new: torch.Tensor, bt: BlockTableKV,
                          kernel: VarlenKernel) -> torch.Tensor:
    """q `[T, n_heads, d]`, kv_new `[T, 2, n_kv, d]` for every row of the step -> `[T, n_heads * d]`;
    the new K/V goes into the pool first, then one kernel call reads every request's blocks."""
    T, n_heads, d = q.shape
    bt.flat_pool[layer].index_copy_(1, bt.new_slots, kv_new.transpose(0, 1))
    pool = bt.pool[layer]                                    # [2, n_blocks, block_size, n_kv, d]
    out = kernel(q, pool[0], pool[1], bt.cu_q, bt.cu_k, bt.max_q, bt.max_k, scale=1.0, window_size=(-1, 0),
                 enable_gqa=True, seqused_k=bt.seqused_k, block_table=bt.block_tables)
    return out.reshape(T, n_heads * d)
