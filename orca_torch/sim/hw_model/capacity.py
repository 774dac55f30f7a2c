"""How many K/V slots a card holds, and how many requests fit under a reservation (lecture §4.3, §5.2, §6.1).

The K/V budget of a device is a fraction of its memory minus the weights it stores; the rest of
the card (10% by default) stands for activations, workspace and the CUDA context. Under `tp x pp`
every device holds its share of the weights and of each token's K/V, and the stage that runs out
first sets the capacity. Orca reserves `max_tokens` slots per request when it admits it, so the
number of concurrent requests is `capacity // reservation` (lecture §4.3); FasterTransformer
pre-allocates 2048 tokens per request the same way (Orca §6.1).

Memory convention (`mem_unit`): the lecture counts a card's nominal memory in decimal GB (an
"80 GB" H100 holds 80e9 bytes) and gives 90% of it to weights + K/V (`DEFAULT_MEM_FRACTION`), which
reproduces its 52 requests of 8,192 tokens. vLLM counts the memory the driver reports, and its
`gpu_memory_utilization` (0.9 by default) is a share of that. `mem_unit="GiB"` reads the card's
nominal figure as GiB, close to that count but not it: nvidia-smi reports 81,920 MiB (80 GiB, 7.4%
more bytes than 80 GB) on an A100-80GB and 40,960 MiB on an A100-40GB, but 81,559 MiB (79.6 GiB,
0.4% less than 80 GiB) on an H100 SXM, and CUDA's own total is a little less again. The CLI prints
both conventions. (vLLM then also subtracts the activations' peak, which neither convention models.)

A K/V budget can also be given in bytes, as vLLM's paper does for OPT-13B on one A100-40GB
(12 GiB -> 15.7K slots -> Orca (Max) batches 7 requests of 2048).
"""
from __future__ import annotations

from dataclasses import dataclass

from orca_torch.checks import check_choice, check_int, check_real
from orca_torch.sim.hw_model.gpus import GPUSpec, get_gpu
from orca_torch.sim.hw_model.layout import Partition
from orca_torch.specs import ModelSpec, get_model_spec

DEFAULT_MEM_FRACTION = 0.9
"""Share of a card's (decimal) memory for weights plus K/V: (0.9 x 80 GB - 16.06 GB) / 1.07 GB gives
the lecture's 52 requests of 8192 tokens for Llama-3-8B on an H100."""


MEM_UNITS = {"GB": 1e9, "GiB": float(2**30)}
"""Bytes per unit of a card's nominal memory figure: decimal (the lecture's) or binary (vLLM's)."""
DEFAULT_MEM_UNIT = "GB"


@dataclass(frozen=True)
class MemoryPlan:
    """Per-device memory of one model on one card: weights, K/V budget, and K/V slots (tokens)."""

    model: str
    gpu: str
    tp: int
    pp: int
    usable_bytes: float             # mem_fraction x memory (or weights + the explicit K/V budget)
    weight_bytes_per_device: int    # heaviest stage
    kv_budget_bytes: float          # per device, on the stage that binds
    kv_bytes_per_token_per_device: int
    kv_tokens: int
    mem_unit: str = DEFAULT_MEM_UNIT


def memory_plan(model: ModelSpec | str, gpu: GPUSpec | str, *, mem_fraction: float = DEFAULT_MEM_FRACTION,
                tp: int = 1, pp: int = 1, kv_budget_bytes: float | None = None,
                mem_unit: str = DEFAULT_MEM_UNIT) -> MemoryPlan:
    """Weights and K/V capacity per device; `kv_budget_bytes` (> 0) replaces `mem_fraction x memory - weights`;
    `mem_unit` (a key of `MEM_UNITS`) says whether the card's nominal memory counts decimal GB or GiB
    (module docstring). `mem_fraction` is checked here, for `lab.api`'s setting of that name."""
    m, g = get_model_spec(model), get_gpu(gpu)
    part = Partition(m, tp, pp)
    tp, pp = part.tp, part.pp
    mem_fraction = check_real("mem_fraction", mem_fraction, 0.0, 1.0, lo_open=True)
    mem_unit = check_choice("mem_unit", mem_unit, MEM_UNITS)
    card_bytes = g.mem_bytes / 1e9 * MEM_UNITS[mem_unit]
    usable = mem_fraction * card_bytes
    if kv_budget_bytes is not None:
        kv_budget_bytes = check_real("kv_budget_bytes", kv_budget_bytes, 0.0, lo_open=True, unit="bytes")
        usable = part.weight_bytes_per_device + kv_budget_bytes
        if usable > card_bytes:   # the budget sits beside the weights on every device
            room = card_bytes - part.weight_bytes_per_device
            raise ValueError(
                f"a K/V budget of {kv_budget_bytes / 1e9:.2f} GB ({kv_budget_bytes / 2**30:.2f} GiB) per device "
                f"does not fit beside {m.name}'s {part.weight_bytes_per_device / 1e9:.2f} GB of weights per "
                f"device (tp={tp}, pp={pp}): together {usable / 1e9:.2f} GB, but {g.name} has "
                f"{card_bytes / 1e9:g} GB; "
                + (f"allowed: at most {room / 1e9:.2f} GB ({room / 2**30:.2f} GiB)" if room > 0
                   else "the weights alone do not fit: raise tp or pp"))
    elif part.weight_bytes_per_device > usable:
        raise ValueError(
            f"{m.name} needs {part.weight_bytes_per_device / 1e9:.2f} GB of weights per device at "
            f"tp={tp}, pp={pp}, but {g.name} offers {usable / 1e9:.2f} GB ({mem_fraction} x "
            f"{card_bytes / 1e9:g} GB); raise tp or pp"
            + (", or mem_fraction (the whole card holds them)" if part.weight_bytes_per_device <= card_bytes else ""))
    best = None
    for s in range(part.pp):
        budget = (kv_budget_bytes if kv_budget_bytes is not None
                  else usable - part.stage_weight_bytes(s))
        per_tok = part.stage_kv_bytes_per_token(s)
        tokens = int(budget // per_tok)
        if best is None or tokens < best[0]:
            best = (tokens, budget, per_tok)
    tokens, budget, per_tok = best
    return MemoryPlan(m.name, g.name, tp, pp, usable, part.weight_bytes_per_device, budget, per_tok, tokens, mem_unit)


def kv_capacity_tokens(model: ModelSpec | str, gpu: GPUSpec | str, mem_fraction: float = DEFAULT_MEM_FRACTION,
                       tp: int = 1, pp: int = 1, *, kv_budget_bytes: float | None = None,
                       mem_unit: str = DEFAULT_MEM_UNIT) -> int:
    """K/V slots (tokens) the model's devices hold together: `(fraction x memory - weights) / K/V per token`."""
    return memory_plan(model, gpu, mem_fraction=mem_fraction, tp=tp, pp=pp,
                       kv_budget_bytes=kv_budget_bytes, mem_unit=mem_unit).kv_tokens


def max_requests(model: ModelSpec | str, gpu: GPUSpec | str, reserve_tokens: int, *,
                 mem_fraction: float = DEFAULT_MEM_FRACTION, tp: int = 1, pp: int = 1,
                 kv_budget_bytes: float | None = None, mem_unit: str = DEFAULT_MEM_UNIT) -> int:
    """Requests that fit at once when each reserves `reserve_tokens` (>= 1) K/V slots (Orca's reservation)."""
    reserve_tokens = check_int("reserve_tokens", reserve_tokens, 1)
    return kv_capacity_tokens(model, gpu, mem_fraction, tp, pp, kv_budget_bytes=kv_budget_bytes,
                              mem_unit=mem_unit) // reserve_tokens
