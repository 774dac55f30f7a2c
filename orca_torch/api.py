"""One call for notebooks and scripts: run a workload through a serving system and get its metrics.

    from orca_torch.api import simulate, goodput
    m = simulate(workload="chat", rate=8, n_requests=600, system="orca-max")   # paper GPU
    print(m.ttft_median_s, m.slo_attainment, m.throughput_tok_s)
    g = goodput(system="orca-oracle")                                          # req/s at 90% SLO

Systems (lecture §5.2, §6.1):
- `orca-max`, `orca-pow2`, `orca-oracle`: iteration-level scheduling with Orca's reservation of
  `max_tokens` (the context), of the true length rounded up to a power of two, or of the true length;
- `orca-unlimited`: as if K/V memory were unlimited (occupied = holding tokens);
- `orca-ondemand`: one slot per stored token, no reservation; preempts when it runs out;
- `paged`, `paged-swap`: paged K/V (blocks of 16 tokens on demand, `paged_memory.PagedMemory`),
  preempting by recompute, or by swap to a CPU pool as large as the GPU's;
- `static`: request-level batching, batches of `max_bs` (default 128), see `baselines.py`;
- `sequential`: one request at a time (`max_bs = 1`).

`executor="cost"` prices steps on the paper GPU (`model`, `gpu`, `tp`, `pp`); `executor="torch"`
runs the real `OrcaModel` (preset `tiny` or `mini`) and times it on `device`. The K/V capacity
`n_slots` defaults to what the GPU holds (`hw_model.kv_capacity_tokens`, 90% of memory minus
weights) on the paper GPU, and to room for every request at once on torch. Requests refused at
submission raise ValueError, or with `reject_invalid=True` are counted in `Metrics.n_rejected` and
left out of every other figure.
"""
from __future__ import annotations

from typing import Sequence

from .baselines import one_at_a_time, static_batching
from .engine import Engine, RunResult
from .memory import MemoryManager, ReservationMemory, TokenMemory, UnlimitedMemory
from .metrics import Goodput, Metrics, goodput_search, summarize
from .paged_kv import PagedKVManager
from .paged_memory import PagedMemory
from .request import Request
from .scheduler import SchedulerConfig
from .specs import get_model_spec
from .workload import check_seed, make_workload, with_predictions, with_prompt_ids

SYSTEMS = ("orca-max", "orca-pow2", "orca-oracle", "orca-unlimited", "orca-ondemand", "paged", "paged-swap", "static",
           "sequential")


def make_memory(system: str, n_slots: int) -> MemoryManager:
    """The memory manager a system uses over `n_slots` K/V slots."""
    if system in ("orca-max", "orca-pow2", "orca-oracle"):
        return ReservationMemory(n_slots, system.split("-")[1])
    if system == "orca-ondemand":
        return TokenMemory(n_slots)
    if system in ("paged", "paged-swap"):
        return PagedMemory(n_slots, preemption="swap" if system == "paged-swap" else "recompute")
    if system in ("orca-unlimited", "static", "sequential"):
        return UnlimitedMemory(n_slots)
    raise ValueError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")


def make_config(system: str, max_bs: int | None = None, **knobs) -> SchedulerConfig:
    """Scheduler knobs for a system (`order`, `prefill`, `n_workers`, `max_num_batched_tokens`, ...)."""
    if system == "static":
        if knobs:
            raise ValueError(f"static batching takes only max_bs, got {', '.join(knobs)}")
        return static_batching(128 if max_bs is None else max_bs)
    if system == "sequential":
        if max_bs not in (None, 1):
            raise ValueError(f"sequential means max_bs=1, got max_bs={max_bs}")
        return SchedulerConfig(**{**one_at_a_time().__dict__, **knobs})
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")
    return SchedulerConfig(max_bs=256 if max_bs is None else max_bs, **knobs)


def run(workload: str | Sequence[Request] = "chat", rate: float = 8.0, n_requests: int = 600,
        system: str = "orca-max", model: str = "llama-3-8b", gpu: str = "h100",
        executor: str = "cost", max_bs: int | None = None, seed: int = 0, *,
        order: str = "fcfs", predictor_sigma: float | None = None, prefill: str = "mixed",
        n_workers: int = 1, max_num_batched_tokens: int | None = None, chunked_prefill: bool = False,
        max_context: int | None = None, n_slots: int | None = None, mem_fraction: float = 0.9,
        tp: int = 1, pp: int = 1, reject_invalid: bool = False, device: str = "cpu",
        clock: str = "wall", trace: bool = False) -> RunResult:
    """Run one workload through one system; returns the raw `RunResult` (see `simulate`).

    `max_context` is the serving context (default: the model's). A generated workload is drawn
    for the MODEL's context (`chat` leaves the trace rows longer than that out of the draw), not
    for `max_context`, so a lower `max_context` treats it like a request list: the requests longer
    than `max_context` raise ValueError, or with `reject_invalid=True` are refused, listed in
    `RunResult.rejected` and counted in `Metrics.n_rejected` (exercise 3: refused, not hidden).

    `predictor_sigma` is the noise of the output-length predictor that `order="spf"` sorts by
    (§6.3; None or 0 is the oracle); with any other order nothing reads a prediction, so giving it
    is an error rather than a silently ignored setting.
    """
    seed = check_seed(seed)
    knobs = {}
    for name, v, default in (("order", order, "fcfs"), ("prefill", prefill, "mixed"), ("n_workers", n_workers, 1),
                             ("max_num_batched_tokens", max_num_batched_tokens, None),
                             ("chunked_prefill", chunked_prefill, False)):
        if v != default:
            knobs[name] = v
    config = make_config(system, max_bs, **knobs)
    if predictor_sigma is not None and order != "spf":
        raise ValueError(f"predictor_sigma={predictor_sigma!r} only applies to order='spf' (shortest predicted "
                         f"first); with order={order!r} no prediction is used: leave predictor_sigma=None")
    spec = get_model_spec(model)
    if isinstance(workload, str):
        # Chat draws trace rows that fit the MODEL's context; a lower serving `max_context`
        # (exercise 3) then refuses the longer ones (with reject_invalid=True) instead of hiding them.
        extra = {"max_context": spec.max_context} if workload == "chat" else {}
        reqs = make_workload(workload, n_requests=n_requests, rate=rate, seed=seed, **extra)
    else:
        reqs = list(workload)
    if order == "spf":
        reqs = with_predictions(reqs, predictor_sigma or 0.0, seed=seed + 1)

    if executor == "cost":
        from .executor import CostModelExecutor
        from .hw_model import kv_capacity_tokens

        ex = CostModelExecutor(model, gpu, tp=tp, pp=pp)
        if n_slots is None:
            n_slots = kv_capacity_tokens(model, gpu, mem_fraction, tp, pp)
    elif executor == "torch":
        from .executor import TorchExecutor
        from .model import OrcaModel

        if model not in ("tiny", "mini"):
            raise ValueError(f"executor='torch' runs the project's own presets 'tiny' or 'mini', got {model!r}")
        m = OrcaModel(model, seed=seed, device=device)
        if isinstance(workload, str) or any(r.prompt_ids is None for r in reqs):
            reqs = with_prompt_ids(reqs, m.spec.vocab, seed=seed)
        if n_slots is None:  # room for every request at once (and for one max-length reservation)
            n_slots = max(sum(r.total_len for r in reqs), spec.max_context)
        mem = make_memory(system, n_slots)
        kv = PagedKVManager.mirroring(mem, m) if isinstance(mem, PagedMemory) else \
            m.new_kv(max(n_slots, sum(r.total_len for r in reqs)))
        ex = TorchExecutor(m, kv, clock=clock)
    else:
        raise ValueError(f"executor must be 'cost' or 'torch', got {executor!r}")
    if executor == "cost":
        mem = make_memory(system, n_slots)
    engine = Engine(ex, mem, config, max_context=max_context, trace=trace)
    return engine.run(reqs, on_invalid="reject" if reject_invalid else "raise")


def simulate(workload: str | Sequence[Request] = "chat", rate: float = 8.0, n_requests: int = 600,
             system: str = "orca-max", model: str = "llama-3-8b", gpu: str = "h100",
             executor: str = "cost", max_bs: int | None = None, seed: int = 0, *,
             slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.05, **options) -> Metrics:
    """Run one workload through one system and return its `Metrics` (options as `run`)."""
    res = run(workload, rate, n_requests, system, model, gpu, executor, max_bs, seed, **options)
    return summarize(res, slo_ttft_s, slo_tpot_s)


def goodput(workload: str = "chat", system: str = "orca-max", n_requests: int = 600, *,
            slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.05, target: float = 0.9,
            lo: float = 0.01, hi: float = 256.0, rel_tol: float = 0.01, seed: int = 0, **options) -> Goodput:
    """Largest arrival rate with SLO attainment >= `target` (lecture §5.3), within `rel_tol`.

    The seeded workload is regenerated at every rate tried: the same requests, closer together.
    """
    if not isinstance(workload, str):
        raise ValueError("goodput regenerates the workload at each rate: pass a workload name")
    seed = check_seed(seed)

    def attainment(rate: float) -> float:
        res = run(workload, rate, n_requests, system, seed=seed, **options)
        return summarize(res, slo_ttft_s, slo_tpot_s).slo_attainment

    return goodput_search(attainment, target, lo, hi, rel_tol)
