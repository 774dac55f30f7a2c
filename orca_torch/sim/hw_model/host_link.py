"""What a K/V swap costs: bytes over the card's host link (lecture §7; vLLM §4.5 "swapping").

A request preempted by swap has its K/V blocks copied to CPU memory and, when it is readmitted,
copied back; both cross the host link (PCIe, `GPUSpec.host_link_bw` per direction). Under `tp x pp`
every device holds its share of each token's K/V and moves it over its own link at the same time,
so the stage with the largest share sets the time. A recompute needs no pricing here: the
readmitted request re-feeds its tokens, and the paper GPU prices that prefill like any other.
The paper GPU's executor asks these with the counts of a batch's swaps (its own, >= 0).
"""
from __future__ import annotations

from orca_torch.checks import brief
from orca_torch.sim.hw_model.gpus import GPUSpec, get_gpu
from orca_torch.sim.hw_model.layout import Partition
from orca_torch.specs import ModelSpec, get_model_spec

HOST_LINK_EFFICIENCY = 0.8
"""Share of the PCIe peak that a pinned-memory device <-> host copy reaches (about 25 of 31.5 GB/s
on PCIe 4.0 x16 in NVIDIA's bandwidthTest); K/V blocks are swapped from pinned buffers."""


def swap_bytes(model: ModelSpec | str, tokens: int, tp: int = 1, pp: int = 1) -> int:
    """Bytes one device moves to swap `tokens` tokens of K/V (the busiest stage's share)."""
    assert tokens >= 0, tokens
    part = Partition(get_model_spec(model), tp, pp)
    return tokens * max(part.stage_kv_bytes_per_token(s) for s in range(part.pp))


def check_host_link(gpu: GPUSpec | str, swapper: str, instead: str) -> None:
    """Refuse swapping on a card with no host link before a run starts: else a run stops at its
    first swap, after the work before it. `swapper` names the swapping setting as its caller took
    it, `instead` the setting that preempts by recompute."""
    g = get_gpu(gpu)
    if g.host_link_bw is None:
        raise ValueError(f"{swapper} swaps K/V over the card's host link, and {brief(g.name)} has none "
                         f"(GPUSpec.host_link_bw is None); use {instead}, or a card "
                         "with a host link")


def swap_time(model: ModelSpec | str, gpu: GPUSpec | str, tokens: int, n_transfers: int = 1,
              tp: int = 1, pp: int = 1) -> float:
    """Seconds to move `tokens` tokens of K/V one way over the host link at `HOST_LINK_EFFICIENCY` of
    its peak, in `n_transfers` copies (one per request swapped: each pays the link's latency once)."""
    g = get_gpu(gpu)
    if g.host_link_bw is None:
        raise ValueError(f"GPU {brief(g.name)} has no host link bandwidth (GPUSpec.host_link_bw); a swap cannot be "
                         "priced on it")
    assert n_transfers >= 0, n_transfers
    if tokens == 0 and n_transfers == 0:
        return 0.0
    bw = g.host_link_bw * HOST_LINK_EFFICIENCY
    return n_transfers * g.host_link_latency_s + swap_bytes(model, tokens, tp, pp) / bw
