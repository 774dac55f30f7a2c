"""What one forward call costs: FLOPs counted on the real forward, bytes by formula, time measured
(lecture §1.1, §4.2; code 02 demos 2 and 3).

The FLOPs the paper GPU charges for a step come from `ModelSpec.step_flops`. Here we count the
FLOPs the torch model actually executes with `torch.utils.flop_counter.FlopCounterMode` and split
them the same way (linear layers, attention, LM head), so a test can check that formula and
forward agree exactly. Attribution: the LM head is the `lm_head` submodule; attention is every
`bmm` (the model's only batched matmuls are Q·K^T and P·V); linear is every other `mm`/`addmm`.
Any other counted op lands in `other`, which is zero for this model.

Bytes are by formula (`ModelSpec.step_bytes`): CPU caches make measured traffic meaningless here.
"""
from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from orca_torch.checks import derived_seed, is_int
from orca_torch.core.batch import SeqWork, padded_shape
from orca_torch.model.kv_cache import KVManager
from orca_torch.model.orca_model import OrcaModel
from orca_torch.specs import ModelSpec


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with `n` torch intra-op threads, restoring the previous number after.

    On a small shared CPU, OpenMP worker threads that spin while another process holds the cores
    turn a 1 ms forward into 10+ ms at random; one thread gives timings that can be compared.
    `n` is 1 or a count its door checked: `--threads` (`cli_args.threads_arg`), `lab.api`'s `threads`.
    """
    assert is_int(n) and 1 <= n <= (os.cpu_count() or 1), n
    n = int(n)
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_aten = torch.ops.aten
_LINEAR_OPS = (_aten.mm, _aten.addmm)
_ATTENTION_OPS = (_aten.bmm, _aten.baddbmm)


def counted_flops(model: OrcaModel, token_ids: torch.Tensor, works: Sequence[SeqWork],
                  req_ids: Sequence[Hashable], kv: KVManager,
                  padded: bool = False) -> tuple[dict[str, int], torch.Tensor]:
    """Run one real forward under FlopCounterMode; return its FLOPs split like `step_flops`, and
    the logits (the forward's side effects on `kv` happen as usual)."""
    with FlopCounterMode(display=False) as counter:
        logits = model(token_ids, works, req_ids, kv, padded=padded)
    counts = counter.get_flop_counts()
    glob = counts["Global"]
    head = sum(counts.get(f"{type(model).__name__}.lm_head", {}).values())
    attention = sum(v for op, v in glob.items() if op in _ATTENTION_OPS)
    matmul = sum(v for op, v in glob.items() if op in _LINEAR_OPS)
    other = sum(glob.values()) - attention - matmul
    flops = {"linear": matmul - head, "attention": attention, "lm_head": head,
             "total": matmul + attention, "other": other}
    return flops, logits


def padded_works(works: Sequence[SeqWork]) -> list[SeqWork]:
    """The work a padded `[B, L_max, H]` step does, as `SeqWork`s: every request L_max new tokens
    over K_max keys, so `step_flops(padded_works(w))` prices what `forward_padded` executes."""
    B, L, K = padded_shape(works)
    return [SeqWork(L, K - L)] * B


def gathered_weight_bytes(spec: ModelSpec, works: Sequence[SeqWork]) -> int:
    """Weight bytes if the embedding table is charged only for the rows looked up.

    `step_bytes` charges every parameter once per forward (lecture §1.1: a decode step reads all
    the weights once). An embedding lookup is a gather, though: it touches one row per token, and that part
    does not shrink with batching. This count shows how such a per-token term pulls the batched vs
    one-by-one weight ratio below the number of forwards. Where the spec ties the LM head to the
    embedding, the head reads the whole table anyway, so every parameter is read: `weight_bytes`.
    """
    if spec.tied_embeddings:
        return spec.weight_bytes
    n_tokens = sum(w.n_new for w in works)
    return (spec.n_params - spec.vocab * spec.hidden + n_tokens * spec.hidden) * spec.dtype_bytes


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def count_dispatched_ops(fn: Callable[[], object]) -> int:
    """How many aten ops `fn()` dispatches. On a CPU, small ops cost microseconds each whatever
    their size, so this count explains the part of a step that is neither FLOPs nor bytes."""
    with _OpCounter() as counter:
        fn()
    return counter.n


# ---- wall time -------------------------------------------------------------------------------------
def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall seconds of `fn()` over `repeats` runs after `warmup` runs (CUDA-synchronised)."""
    assert repeats >= 1, repeats
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _decoding_requests(model: OrcaModel, n_requests: int, past_lo: int, past_hi: int, headroom: int,
                       seed: int) -> tuple[KVManager, list[int]]:
    """`n_requests` requests holding U[past_lo, past_hi] tokens of K/V each, with `headroom` more
    slots reserved for decoding. The K/V is seeded random numbers written in place rather than a
    real prefill: a decode step's cost does not depend on the values, and this takes milliseconds.
    Same seed -> same K/V, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    past = torch.randint(past_lo, past_hi + 1, (n_requests,), generator=g).tolist()
    kv = model.new_kv(sum(past) + n_requests * headroom)
    for r, p in enumerate(past):
        kv.reserve(r, p + headroom)
        buf = kv.storage(r)
        buf[..., :p, :] = torch.randn(*buf.shape[:3], p, buf.shape[4], generator=g, dtype=torch.float32).to(buf)
        kv.commit(r, p)
    return kv, past


def decode_step_times(model: OrcaModel, n_requests: int = 64, repeats: int = 7, seed: int = 0) -> dict[str, float]:
    """Median wall time of one decode step for `n_requests` requests, each holding 16 to 128 tokens
    of K/V: one batched `forward_batch` vs `n_requests` one-request calls (code 02 demo 3). Both
    sides run the same code on identical K/V; repeats are interleaved so machine noise hits both alike."""
    kv_b, _ = _decoding_requests(model, n_requests, 16, 128, repeats + 2, seed)
    kv_s, _ = _decoding_requests(model, n_requests, 16, 128, repeats + 2, seed)
    g = torch.Generator().manual_seed(derived_seed(seed))
    ids = torch.randint(0, model.spec.vocab, (n_requests,), generator=g)
    reqs = list(range(n_requests))

    def batched() -> None:
        model.forward_batch(ids, [SeqWork(1, kv_b.length(r)) for r in reqs], reqs, kv_b)

    def one_by_one() -> None:
        for r in reqs:
            model.forward_batch(ids[r:r + 1], [SeqWork(1, kv_s.length(r))], [r], kv_s)

    batched(), one_by_one()                                  # warm-up
    tb, ts = [], []
    for _ in range(repeats):
        tb.append(median_time(batched, 1, warmup=0)[0])
        ts.append(median_time(one_by_one, 1, warmup=0)[0])
    b, s = statistics.median(tb), statistics.median(ts)
    return {"batched_s": b, "one_by_one_s": s, "speedup": s / b}


def _weight_matrices(model: OrcaModel) -> list[torch.Tensor]:
    """The weights a forward multiplies by: every layer's projections and MLP, and the LM head."""
    return [w for blk in model.layers for w in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down)] + [model.lm_head.weight]


def weight_matmul_bytes(model: OrcaModel) -> int:
    """Bytes of the matrices `weight_matmul_time` multiplies by: what one forward's matmuls stream.
    Less than `spec.weight_bytes`, which also counts the norms and an untied embedding table (a
    gather of one row per token, no matmul)."""
    return sum(w.numel() * w.element_size() for w in _weight_matrices(model))


def weight_matmul_time(model: OrcaModel, n_rows: int, repeats: int = 5) -> float:
    """Median seconds of only the weight matmuls of one forward on `n_rows` token rows (every layer's
    projections and MLP, and the LM head): the part of a step that batching amortises."""
    mats = _weight_matrices(model)
    g = torch.Generator().manual_seed(0)
    xs = {w.shape[1]: torch.randn(n_rows, w.shape[1], generator=g, dtype=torch.float32).to(model.device, model.dtype) for w in mats}

    @torch.inference_mode()
    def run() -> None:
        for w in mats:
            F.linear(xs[w.shape[1]], w)

    return median_time(run, repeats)[0]


def step_state(model: OrcaModel, works: list[SeqWork], seed: int) -> tuple[KVManager, torch.Tensor]:
    """A K/V manager in which request i has `works[i].n_past` tokens stored, and the step's token ids.
    Deterministic in `seed`, so two calls give two identical states."""
    g = torch.Generator().manual_seed(seed)
    kv = model.new_kv(sum(w.n_ctx for w in works))
    hist = [(r, w.n_past) for r, w in enumerate(works) if w.n_past]
    for r, w in enumerate(works):
        kv.reserve(r, w.n_ctx)
    if hist:
        ids = torch.randint(0, model.spec.vocab, (sum(p for _, p in hist),), generator=g)
        model.forward_batch(ids, [SeqWork(p, 0) for _, p in hist], [r for r, _ in hist], kv)
    step_ids = torch.randint(0, model.spec.vocab, (sum(w.n_new for w in works),), generator=g)
    return kv, step_ids


def decode_op_counts(model: OrcaModel, n_req: int, seed: int) -> tuple[int, int]:
    """aten ops dispatched by one batched decode step, and by the same step one request at a time
    (every one-request decode forward dispatches the same ops, so one is counted and multiplied)."""
    kv, past = _decoding_requests(model, n_req, 16, 128, 2, seed)
    ids, reqs = torch.zeros(n_req, dtype=torch.long), list(range(n_req))
    batched = count_dispatched_ops(lambda: model.forward_batch(ids, [SeqWork(1, p) for p in past], reqs, kv))
    one = count_dispatched_ops(lambda: model.forward_batch(ids[:1], [SeqWork(1, past[0] + 1)], [0], kv))
    return batched, one * n_req
