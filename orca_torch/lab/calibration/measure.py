"""Measuring the torch executor's steps: `measure_steps(model, mixes) -> samples`, on lists of `SeqWork`.

`measure_steps` times `OrcaModel.forward_batch` plus the greedy argmax, what `TorchExecutor`
times, for a list of `SeqWork` mixes: repeats are interleaved across mixes (round-robin) so that
another process slowing the machine for a moment hits every mix alike; the median is kept. On a
CUDA device each step is timed with CUDA events. `check_mixes` and `check_repeats` let a caller
refuse a grid before it builds a model, which for a large preset takes long, and `kv_tokens_needed`
(of a grid they took) check that its K/V fits in memory. The samples feed `roofline_fit.fit` and
`refined_fit.fit_refined` (docs/paper-gpu.md, "GPU profiles and calibration").
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Sequence

from orca_torch.checks import brief, check_device, check_int, check_items, check_list, check_seed, same_device
from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.lab.calibration.samples import StepSample, describe
from orca_torch.specs import ModelSpec, get_model_spec


def _mix_lists(mixes: Sequence[Sequence[SeqWork]]) -> list[list[SeqWork]]:
    """`mixes` as lists, if it is a non-empty list of non-empty `SeqWork` lists."""
    mixes = [check_items(f"mixes[{i}]", m, SeqWork)
             for i, m in enumerate(check_list("mixes", mixes, "non-empty SeqWork lists"))]
    if not mixes or any(not m for m in mixes):
        raise ValueError("mixes must be a non-empty list of non-empty SeqWork lists")
    return mixes


def _pool_ids(mixes: Sequence[Sequence[SeqWork]]) -> tuple[list[list], Counter]:
    """Each work's pooled request (None: a fresh request each repeat) and the tokens each pooled
    request decodes per round (`measure_steps`)."""
    pool_ids: list[list] = []
    per_round: Counter = Counter()
    for m in mixes:
        used: Counter = Counter()
        ids = []
        for w in m:
            rid = None
            if w.n_past:
                rid = ("pool", w.n_past, used[w.n_past])
                used[w.n_past] += 1
                per_round[rid] += w.n_new
            ids.append(rid)
        pool_ids.append(ids)
    return pool_ids, per_round


def max_repeats(spec: ModelSpec | str, mixes: Sequence[Sequence[SeqWork]]) -> int:
    """The most `repeats` that `measure_steps` can time `mixes` for on `spec`: each pooled request
    decodes on for `repeats + 1` rounds (one warm-up) and must stay within the model's context."""
    spec = get_model_spec(spec)
    _, per_round = _pool_ids(_mix_lists(mixes))
    return min(((spec.max_context - rid[1]) // n for rid, n in per_round.items()), default=2**62) - 1


def check_repeats(spec: ModelSpec | str, mixes: Sequence[Sequence[SeqWork]], repeats: int,
                  name: str = "repeats") -> int:
    """`repeats` if `measure_steps` can time `mixes` that often on `spec` (`max_repeats`); a command-line
    tool checks its `--repeats` here before printing or measuring anything."""
    repeats, spec = check_int(name, repeats, 1), get_model_spec(spec)
    most = max_repeats(spec, mixes)
    if repeats > most:
        raise ValueError(f"{name} {repeats}: the mixes' decodes would run past {spec.name}'s context "
                         f"{spec.max_context}; {name} may be at most {most}")
    return repeats


def kv_tokens_needed(mixes: Sequence[Sequence[SeqWork]], repeats: int) -> int:
    """The K/V slots `measure_steps` allocates to time `mixes` `repeats` times (plus its warm-up round):
    a command-line tool checks that they fit in memory before building anything, after `check_repeats`
    (or `check_mixes`) took `mixes` and `repeats`."""
    _, per_round = _pool_ids(mixes)
    fresh = max(sum(w.n_new for w in m if not w.n_past) for m in mixes)
    return sum(rid[1] + n * (repeats + 1) for rid, n in per_round.items()) + fresh + 1


def check_mixes(spec: ModelSpec | str, mixes: Sequence[Sequence[SeqWork]], repeats: int) -> list[list[SeqWork]]:
    """`mixes` as lists, if `measure_steps` can time each of them `repeats` times on `spec`: checked
    by every caller before it builds a model, which for a large preset takes long, so that a bad
    argument costs nothing."""
    spec, mixes = get_model_spec(spec), _mix_lists(mixes)
    for i, m in enumerate(mixes):
        for j, w in enumerate(m):
            if w.n_past + w.n_new > spec.max_context:
                raise ValueError(f"mixes[{i}][{j}]: {w} needs {w.n_past + w.n_new} tokens, more than {spec.name}'s "
                                 f"context {spec.max_context}")
    check_repeats(spec, mixes, repeats)
    return mixes


def measure_steps(model, mixes: Sequence[Sequence[SeqWork]], repeats: int = 5, seed: int = 0, *,
                  device: str | None = None) -> list[StepSample]:
    """Median seconds of one `forward_batch` + greedy argmax for each mix, on `model` (an `OrcaModel`,
    or a preset / `ModelSpec` built on `device` with seeded weights). CUDA steps are timed with
    CUDA events, CPU steps with `time.perf_counter`.

    A work with `n_past > 0` reads K/V that is already stored: requests with seeded random K/V are
    set up once (a pool per `n_past`, shared by the mixes, reserved with room to grow) and each
    repeat decodes on from where the last left, so a sample's `totals` are those of the repeat whose
    time is the median (the lower middle one for an even count). A work with `n_past = 0` is a fresh
    request each repeat (reserved before the clock starts, freed after, as `TorchExecutor` does).
    One warm-up round is not recorded.
    """
    import torch

    from orca_torch.model.orca_model import OrcaModel, torch_spec

    seed = check_seed(seed)
    if isinstance(model, OrcaModel) and device is not None:
        try:
            same = same_device(device, model.device)
        except (RuntimeError, TypeError):       # torch reads no device in it: said as check_device says it
            check_device(device)
            raise
        if not same:
            raise ValueError(f"device={brief(device)} but the model lives on {model.device}; move the model or "
                             "drop device")
    spec = torch_spec(model)
    mixes = check_mixes(spec, mixes, repeats)            # every refusal comes before a model is built
    rounds = int(repeats) + 1                            # (an integer: check_mixes checked it)
    if not isinstance(model, OrcaModel):
        model = OrcaModel(spec, seed=seed, device="cpu" if device is None else device)
    cuda = model.device.type == "cuda"
    pool_ids, per_round = _pool_ids(mixes)
    growth = Counter({rid: n * rounds for rid, n in per_round.items()})
    kv = model.new_kv(kv_tokens_needed(mixes, rounds - 1))
    token_rng = torch.Generator().manual_seed(seed)
    kv_rng = torch.Generator(device=model.device).manual_seed(seed)  # fills K/V where it lives
    for rid, grow in growth.items():
        kv.reserve(rid, rid[1] + grow)
        kv.storage(rid)[..., :rid[1], :].normal_(generator=kv_rng)
        kv.commit(rid, rid[1])
    times: list[list[tuple[float, StepTotals]]] = [[] for _ in mixes]
    try:
        for r in range(rounds):
            for i, m in enumerate(mixes):
                req_ids, works = [], []
                for j, (w, rid) in enumerate(zip(m, pool_ids[i])):
                    if rid is None:
                        rid = ("fresh", j)
                        kv.reserve(rid, w.n_new)
                    req_ids.append(rid)
                    works.append(SeqWork(w.n_new, kv.length(rid)))
                ids = torch.randint(0, spec.vocab, (sum(w.n_new for w in works),), generator=token_rng).to(model.device)
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize(model.device)
                    start.record()
                    model.forward_batch(ids, works, req_ids, kv).argmax(dim=-1).tolist()
                    end.record()
                    end.synchronize()
                    dt = start.elapsed_time(end) / 1e3
                else:
                    t0 = time.perf_counter()
                    model.forward_batch(ids, works, req_ids, kv).argmax(dim=-1).tolist()
                    dt = time.perf_counter() - t0
                for rid in req_ids:
                    if rid[0] == "fresh":
                        kv.free(rid)
                if r:
                    times[i].append((dt, StepTotals.of(works)))
    finally:
        for rid in growth:
            kv.free(rid)
    out = []
    for m, ts in zip(mixes, times):
        ts.sort(key=lambda x: x[0])
        dt, totals = ts[(len(ts) - 1) // 2]
        out.append(StepSample(describe(m), totals, dt, spec))
    return out
