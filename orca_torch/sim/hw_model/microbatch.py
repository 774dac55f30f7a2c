"""FasterTransformer's pipeline on the paper GPU: microbatches, bubbles and a per-iteration control sync (lecture §4.4, §4.5).

Orca keeps `n_workers` batches in flight, so every pipeline stage has work without splitting a
batch (lecture §4.4). FasterTransformer runs ONE batch at a time: with pipeline parallelism it
cuts the batch into microbatches of `mbs` requests that follow each other through the `pp` stages,
and an iteration ends only when the last microbatch leaves the last stage (the new tokens go back
to the first stage before the next iteration can start). Each stage handles the microbatches in
order, so microbatch `i` enters stage `s` when both microbatch `i - 1` has left `s` and
microbatch `i` has left `s - 1` (GPipe's forward schedule); with `m` equal microbatches and equal
stages the iteration lasts `(m + pp - 1)` stage times, of which `pp - 1` are bubble. Small
microbatches shrink the bubble but batch less (a memory-bound stage reads all its weights for each
microbatch); one microbatch per batch leaves `pp - 1` of `pp` stages idle at any moment.

A microbatch's stage time is the roofline of `StepPricer` on that microbatch's share of the step,
its tensor-parallel all-reduces and its transfer to the next stage included, and `link` below says
which wire a transfer crosses (NVLink inside a VM, InfiniBand between VMs). FasterTransformer picks
the microbatch itself (`ft_microbatch_size`, the rule of its public GPT code): half the batch with
2 stages when the batch divides evenly, halved again while a microbatch holds over 1,024 tokens.
In a memory-bound decode that rule costs `(m + pp - 1) / pp` of a one-microbatch iteration (1.5x
at PP 2): each microbatch reads the stage's weights again.

The control-message synchronisation (Orca §4.2, lecture §4.4): FasterTransformer exchanges each
iteration's control data — the new token ids, the sequence lengths, the finished flags — among the
workers over NCCL, i.e. as GPU tensors on the compute stream, and the host reads them back, so
every iteration the host waits for the device and the device for the host. Orca sends control
messages between CPUs (gRPC) and NCCL carries only the activations. `control_sync_s` prices what
FasterTransformer pays for this per iteration from named constants; it is 0 on one GPU (no
workers to tell).
"""
from __future__ import annotations

import math

import numpy as np

from orca_torch.core.batch import StepTotals
from orca_torch.sim.hw_model.roofline import StepPricer, finite_time

HOST_SYNC_S = 20e-6
"""One blocking device-to-host read of a few bytes (`cudaMemcpy` D2H + `cudaStreamSynchronize`):
a PCIe round trip (~10 µs) plus waking the host thread; CUDA's documented small-copy latencies."""

KERNEL_LAUNCH_S = 5e-6
"""Host-side launch latency of one CUDA kernel (~5 µs, NVIDIA's usual figure): after a sync the
device idles until the host has launched the next iteration's first kernel."""

CONTROL_MESSAGES = 3
"""Control tensors FasterTransformer broadcasts per iteration with pipeline parallelism: output
token ids, sequence lengths, finished flags (one NCCL broadcast each)."""


def _roofline(pricer: StepPricer) -> StepPricer:
    """`pricer`, if it is a roofline `StepPricer`: the refined model has no per-stage coefficients to cut."""
    if not isinstance(pricer, StepPricer):
        raise ValueError(f"pricer must be a roofline StepPricer (hw_model.pricer(..., cost_model='roofline')), "
                         f"got a {type(pricer).__name__}")
    return pricer


def link(pricer: StepPricer, gpu_a: int, gpu_b: int) -> tuple[float, float, str]:
    """(bandwidth B/s, latency s, name) of the wire between two global GPU indices.

    GPUs `0..gpus_per_node-1` share a VM (NVLink); any other pair crosses the VMs' InfiniBand
    (Orca's Azure VMs: 8 x 200 Gb/s per 8 A100s, 25 GB/s per GPU). Orca's 175B runs PP 2 x TP 8 on
    16 GPUs: the all-reduces stay inside a VM and the stage-to-stage transfer crosses InfiniBand.
    The package asks this of a checked roofline pricer, with indices it computes.
    """
    bw, lat = pricer._link(gpu_a, gpu_b)
    same = gpu_a // pricer.gpu.gpus_per_node == gpu_b // pricer.gpu.gpus_per_node
    return bw, lat, "nvlink" if same else "infiniband"


def control_sync_s(pricer: StepPricer) -> float:
    """FasterTransformer's per-iteration cost of control messages over NCCL (0 on a single GPU).

    Each of `CONTROL_MESSAGES` broadcasts travels from the last stage to every other stage (one
    link latency per stage boundary, InfiniBand where stages sit in different VMs, NVLink inside a
    VM); the host then reads the data back once (`HOST_SYNC_S`) and the device waits for the next
    iteration's first launch (`KERNEL_LAUNCH_S`), on every stage.
    """
    tp, pp = _roofline(pricer).tp, pricer.pp
    if tp * pp == 1:
        return 0.0
    hops = sum(link(pricer, s * tp, (s + 1) * tp)[1] for s in range(pp - 1)) if pp > 1 \
        else link(pricer, 0, tp - 1)[1]
    return CONTROL_MESSAGES * hops + pp * (HOST_SYNC_S + KERNEL_LAUNCH_S)


FT_MICROBATCH_TOKENS = 1024
"""FasterTransformer halves a (pipeline) microbatch while it holds more tokens than this."""


def ft_microbatch_size(batch: int, seq_len: int, pp: int) -> int:
    """FasterTransformer's microbatch for a batch of `batch` sequences of `seq_len` new tokens each
    (1 in a decode iteration, the padded prompt length in the context phase) on `pp` stages:
    `batch / pp` when `pp` divides it (else the whole batch), then halved while it holds more than
    `FT_MICROBATCH_TOKENS` tokens and is even. One microbatch without pipeline parallelism.
    Asked by FasterTransformer's executor with its own counts (all >= 1)."""
    assert min(batch, seq_len, pp) >= 1, (batch, seq_len, pp)
    local = batch                       # requests per microbatch
    if pp == 1:
        return local
    if local % pp == 0:
        local //= pp
    while local * seq_len > FT_MICROBATCH_TOKENS and local % 2 == 0:
        local //= 2
    return max(local, 1)


def microbatch_sizes(n_seqs: int, mbs: int) -> list[int]:
    """`n_seqs` requests cut into microbatches of at most `mbs` (>= 1), as equal as possible."""
    if n_seqs == 0:
        return []
    m = math.ceil(n_seqs / mbs)
    base, extra = divmod(n_seqs, m)
    return [base + 1] * extra + [base] * (m - extra)


def _stage_times(pricer: StepPricer, seqs, tokens, kv, pairs) -> list:
    """Per stage, the time of a microbatch with these totals (floats or numpy arrays alike:
    `StageCoefficients.seconds`)."""
    return [stage.seconds(tokens, pairs, seqs, kv, np.maximum) for stage in pricer.stages]


def _pipeline(stage_times: list[list]) -> object:
    """End of the last microbatch at the last stage: `stage_times[i][s]`, GPipe's forward order."""
    pp = len(stage_times[0])
    free = [0.0] * pp                       # when stage s is free
    for d in stage_times:
        t = 0.0
        for s in range(pp):
            t = np.maximum(t, free[s]) + d[s]
            free[s] = t
    return free[-1]


def iteration_s(pricer: StepPricer, totals: StepTotals, mbs: int) -> float:
    """One iteration of a batch with `totals`, cut into microbatches of at most `mbs` requests.

    Each microbatch gets its share of every total in proportion to its requests (exact when the
    requests are alike, as in FasterTransformer's padded batch). With one microbatch this is
    `pricer.time(totals)`. The pricer must be a roofline one; the totals and `mbs` are the
    caller's own. FasterTransformer's executor calls `pipelined_s` every step.
    """
    return finite_time(_roofline(pricer), totals, pipelined_s(pricer, totals, mbs))


def pipelined_s(pricer: StepPricer, totals: StepTotals, mbs: int) -> float:
    """`iteration_s` without its pricer and overflow checks (the engine checks the durations)."""
    n = totals.n_seqs
    if n == 0:
        return 0.0
    pairs = totals.attn_pairs_full if pricer.attention == "full" else totals.attn_pairs_causal
    times = [_stage_times(pricer, b, totals.n_tokens * b / n, totals.kv_read_tokens * b / n, pairs * b / n)
             for b in microbatch_sizes(n, mbs)]
    return float(_pipeline(times)) + pricer.overhead_s + pricer.seq_overhead_s * n


def decode_iterations_s(pricer: StepPricer, k: int, ctx_sum: int, m: int, mbs: int) -> np.ndarray:
    """`iteration_s` of `m` consecutive decode iterations of `k` requests (contexts summing to
    `ctx_sum` before the first, `k` more each iteration), as one numpy computation; the counts
    are the executor's own (>= 0, `mbs` >= 1)."""
    _roofline(pricer)
    if k == 0 or m == 0:
        return np.zeros(m)
    ctx = (ctx_sum + k * np.arange(1, m + 1)).astype(float)
    times = [_stage_times(pricer, b, float(b), ctx * b / k, ctx * b / k) for b in microbatch_sizes(k, mbs)]
    out = np.asarray(_pipeline(times), dtype=float) + (pricer.overhead_s + pricer.seq_overhead_s * k)
    last = ctx_sum + k * m
    return finite_time(pricer, StepTotals(k, k, last, last, last), np.broadcast_to(out, (m,)).copy())
