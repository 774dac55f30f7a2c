"""One call for notebooks and scripts: run a workload through a serving system and get its metrics.

    from orca_torch.lab.api import simulate, goodput
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

`executor="cost"` prices steps on the paper GPU: `model`, `gpu`, and the settings of
`hw_model.pricer` (`tp`, `pp`, `attention`, `flop_efficiency`, `bw_efficiency`, `comm_efficiency`,
`overhead_s`, `seq_overhead_s`, `count_activations`, `cost_model`), passed on only when given so
the pricer's own defaults and checks apply. `executor="torch"` runs the real `OrcaModel` (preset
`tiny` or `mini`) and times it on `device` with `clock`. A setting that the chosen executor or
workload would ignore is refused with ValueError rather than silently dropped. The K/V capacity
`n_slots` defaults to what the GPU holds (`hw_model.kv_capacity_tokens`, 90% of memory minus
weights) on the paper GPU, and to room for every request at once on torch. Requests refused at
submission raise ValueError, or with `reject_invalid=True` are counted in `Metrics.n_rejected` and
as misses in `slo_attainment_submitted` (which `goodput` bisects on), and left out of every other
figure.

A request list is never changed: the run works on copies, and fills in only what is missing
(`predicted_output` for `order="spf"`, `prompt_ids` for the torch executor).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from orca_torch.checks import (check_choice, check_device, check_flag, check_int, check_items, check_real,
                               check_seed, derived_seed)
from orca_torch.core.engine import Engine, RunResult
from orca_torch.core.memory import MAX_SLOTS, MemoryManager, ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.request import Request
from orca_torch.core.scheduler import SchedulerConfig
from orca_torch.lab.baselines import one_at_a_time, static_batching
from orca_torch.lab.metrics import MIN_REL_TOL, Goodput, Metrics, goodput_search, summarize
from orca_torch.lab.workload import MAX_SIGMA, WORKLOADS, at_rate, make_workload, with_predictions, with_prompt_ids
from orca_torch.sim.collector import cyclic_gc_paused
from orca_torch.sim.fast_engine import FastEngine
from orca_torch.specs import get_model_spec

SYSTEMS = ("orca-max", "orca-pow2", "orca-oracle", "orca-unlimited", "orca-ondemand", "paged", "paged-swap", "static",
           "sequential")
EXECUTORS = ("cost", "torch")
# The settings of the paper GPU (`hw_model.pricer`), forwarded only when given.
PAPER_GPU_SETTINGS = ("tp", "pp", "attention", "flop_efficiency", "bw_efficiency", "comm_efficiency",
                      "overhead_s", "seq_overhead_s", "count_activations", "cost_model")
DEFAULT_RATE = 8.0
DEFAULT_N_REQUESTS = 600


def make_memory(system: str, n_slots: int) -> MemoryManager:
    """The memory manager a system uses over `n_slots` K/V slots."""
    system = check_choice("system", system, SYSTEMS)
    if system in ("orca-max", "orca-pow2", "orca-oracle"):
        return ReservationMemory(n_slots, system.split("-")[1])
    if system == "orca-ondemand":
        return TokenMemory(n_slots)
    if system in ("paged", "paged-swap"):
        return PagedMemory(n_slots, preemption="swap" if system == "paged-swap" else "recompute")
    return UnlimitedMemory(n_slots)


def make_config(system: str, max_bs: int | None = None, **knobs) -> SchedulerConfig:
    """Scheduler knobs for a system (`order`, `prefill`, `n_workers`, `max_num_batched_tokens`, ...)."""
    system = check_choice("system", system, SYSTEMS)
    if max_bs is not None:
        max_bs = check_int("max_bs", max_bs, 1)
    for name in ("n_workers", "max_num_batched_tokens"):
        if knobs.get(name) is not None:
            knobs[name] = check_int(name, knobs[name], 1)
    if system == "static":
        if knobs:
            raise ValueError(f"static batching takes only max_bs, got {', '.join(knobs)}")
        return static_batching(128 if max_bs is None else max_bs)
    if system == "sequential":
        if max_bs not in (None, 1):
            raise ValueError(f"sequential means max_bs=1, got max_bs={max_bs}")
        return SchedulerConfig(**{**one_at_a_time().__dict__, **knobs})
    return SchedulerConfig(max_bs=256 if max_bs is None else max_bs, **knobs)


def request_copies(workload: Any) -> list[Request]:
    """Fresh copies of a request list (the caller's objects are never run or changed)."""
    if not isinstance(workload, (list, tuple)) or isinstance(workload, Request):
        raise ValueError(f"workload must be a workload name ({', '.join(WORKLOADS)}) or a list of Request "
                         f"objects, got {workload!r}")
    reqs = check_items("workload", workload, Request)
    if not reqs:
        raise ValueError("the request list is empty: nothing to run")
    with cyclic_gc_paused():
        return [Request(r.req_id, r.arrival_s, r.prompt_len, r.output_len, r.max_tokens, r.predicted_output,
                        None if r.prompt_ids is None else list(r.prompt_ids)) for r in reqs]


def _refuse(given: dict[str, Any], why: str) -> None:
    """ValueError naming the settings in `given` that are not None, which `why` says do nothing."""
    names = [k for k, v in given.items() if v is not None]
    if names:
        listed = ", ".join(f"{k}={given[k]!r}" for k in names)
        raise ValueError(f"{listed}: {why}; leave {'it' if len(names) == 1 else 'them'} unset")


def run(workload: str | Sequence[Request] = "chat", rate: float | None = None, n_requests: int | None = None,
        system: str = "orca-max", model: str = "llama-3-8b", gpu: str | None = None,
        executor: str = "cost", max_bs: int | None = None, seed: int = 0, *,
        order: str = "fcfs", predictor_sigma: float | None = None, prefill: str = "mixed",
        n_workers: int = 1, max_num_batched_tokens: int | None = None, chunked_prefill: bool = False,
        max_context: int | None = None, n_slots: int | None = None, mem_fraction: float | None = None,
        tp: int | None = None, pp: int | None = None, attention: str | None = None,
        flop_efficiency: float | None = None, bw_efficiency: float | None = None,
        comm_efficiency: float | None = None, overhead_s: float | None = None,
        seq_overhead_s: float | None = None, count_activations: bool | None = None, cost_model: str | None = None,
        reject_invalid: bool = False, device: str | None = None, clock: str | None = None,
        trace: bool = False, progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Run one workload through one system; returns the raw `RunResult` (see `simulate`).

    A named workload is drawn with `n_requests` (default 600) at `rate` req/s (default 8); a request
    list keeps its own arrivals and length, so `rate` and `n_requests` are refused with one
    (rescale it with `workload.at_rate`). The paper GPU is `gpu` (default "h100") with `mem_fraction`
    of its memory for weights and K/V (default 0.9; refused when `n_slots` is given). On torch the
    model runs on `device` (default "cpu") timed by `clock` ("wall", the default, or "iterations").

    `max_context` is the serving context (default: the model's). `chat` is drawn for the MODEL's
    context (it leaves the trace rows longer than that out of the draw); the other named workloads
    keep their own length distributions, whatever the model (`orca`'s prompts reach 511 + 63
    tokens, more than `tiny` holds). Beyond that a generated workload is treated like a request
    list: the requests longer than `max_context` raise ValueError, or with `reject_invalid=True`
    are refused, listed in `RunResult.rejected` and counted in `Metrics.n_rejected` (exercise 3:
    refused, not hidden).

    `predictor_sigma` is the noise of the output-length predictor that `order="spf"` sorts by
    (§6.3; None or 0 is the oracle); it draws predictions only for requests without one, and with
    any other order nothing reads a prediction, so giving it is an error rather than a silently
    ignored setting.

    `progress(finished, total)`, if given, is called as the run goes (`Engine.run`).
    """
    seed = check_seed(seed)
    system = check_choice("system", system, SYSTEMS)
    executor = check_choice("executor", executor, EXECUTORS)
    for name, flag in (("chunked_prefill", chunked_prefill), ("reject_invalid", reject_invalid), ("trace", trace)):
        check_flag(name, flag)
    if count_activations is not None:
        check_flag("count_activations", count_activations)
    n_workers = check_int("n_workers", n_workers, 1)
    if max_num_batched_tokens is not None:
        max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
    gpu_settings = dict(tp=tp, pp=pp, attention=attention, flop_efficiency=flop_efficiency,
                        bw_efficiency=bw_efficiency, comm_efficiency=comm_efficiency, overhead_s=overhead_s,
                        seq_overhead_s=seq_overhead_s, count_activations=count_activations, cost_model=cost_model)
    if executor == "cost":
        _refuse({"device": device, "clock": clock}, "executor='cost' prices steps on the paper GPU, "
                "whose clock is simulated and which runs on no torch device")
        n_devices = (1 if tp is None else check_int("tp", tp, 1)) * (1 if pp is None else check_int("pp", pp, 1))
        if n_devices == 1:
            _refuse({"comm_efficiency": comm_efficiency}, "comm_efficiency prices the tensor- and "
                    "pipeline-parallel transfers, and with tp = pp = 1 there are none")
    else:
        _refuse({"gpu": gpu, "mem_fraction": mem_fraction, **gpu_settings},
                "these are settings of the paper GPU (executor='cost'); executor='torch' runs the real "
                "model in this process")
    if n_slots is not None:
        n_slots = check_int("n_slots", n_slots, 1, MAX_SLOTS)
        _refuse({"mem_fraction": mem_fraction}, "mem_fraction sizes the K/V capacity only when n_slots is not "
                "given")
    if max_context is not None:
        max_context = check_int("max_context", max_context, 2, MAX_SLOTS)
    if isinstance(workload, str):
        if workload not in WORKLOADS:
            raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)} "
                             "(or pass a request list, e.g. from workload.from_csv)")
        reqs = None
    else:
        reqs = request_copies(workload)
        _refuse({"rate": rate, "n_requests": n_requests}, "a request list keeps its own arrivals and number "
                "(rescale it with workload.at_rate, or slice it)")
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
    if predictor_sigma is not None:
        check_real("predictor_sigma", predictor_sigma, 0.0, MAX_SIGMA)
    spec = get_model_spec(model)
    if executor == "torch":
        if model not in ("tiny", "mini"):
            raise ValueError(f"executor='torch' runs the project's own presets 'tiny' or 'mini', got {model!r}")
        device = check_device("cpu" if device is None else device)
        clock = check_choice("clock", "wall" if clock is None else clock, ("wall", "iterations"))
    if reqs is None:
        # Chat draws trace rows that fit the MODEL's context; a lower serving `max_context`
        # (exercise 3) then refuses the longer ones (with reject_invalid=True) instead of hiding them.
        extra = {"max_context": spec.max_context} if workload == "chat" else {}
        reqs = make_workload(workload, n_requests=DEFAULT_N_REQUESTS if n_requests is None else n_requests,
                             rate=DEFAULT_RATE if rate is None else rate, seed=seed, **extra)
    if order == "spf":
        missing = [r for r in reqs if r.predicted_output is None]
        if predictor_sigma is not None and not missing:
            raise ValueError(f"predictor_sigma={predictor_sigma!r} draws predictions for requests without "
                             f"predicted_output, but all {len(reqs)} requests carry one: leave it None")
        with_predictions(missing, predictor_sigma or 0.0, seed=derived_seed(seed))

    if executor == "cost":
        from orca_torch.sim.executors import CostModelExecutor
        from orca_torch.sim.hw_model import kv_capacity_tokens

        settings = {k: v for k, v in gpu_settings.items() if v is not None}
        gpu = "h100" if gpu is None else gpu
        ex = CostModelExecutor(model, gpu, **settings)
        if n_slots is None:
            extra = {} if mem_fraction is None else {"mem_fraction": mem_fraction}
            n_slots = kv_capacity_tokens(model, gpu, tp=settings.get("tp", 1), pp=settings.get("pp", 1), **extra)
        mem = make_memory(system, n_slots)
    else:
        from orca_torch.model.orca_model import OrcaModel
        from orca_torch.model.paged_kv_cache import PagedKVManager
        from orca_torch.model.torch_executor import TorchExecutor

        m = OrcaModel(model, seed=seed, device=device)
        with_prompt_ids([r for r in reqs if r.prompt_ids is None], m.spec.vocab, seed=seed)
        if n_slots is None:  # room for every request at once (and for one max-length reservation)
            n_slots = max(sum(r.total_len for r in reqs), spec.max_context)
        mem = make_memory(system, n_slots)
        kv = PagedKVManager.mirroring(mem, m) if isinstance(mem, PagedMemory) else \
            m.new_kv(max(n_slots, sum(r.total_len for r in reqs)))
        ex = TorchExecutor(m, kv, clock=clock)
    engine = (FastEngine if executor == "cost" else Engine)(ex, mem, config, max_context=max_context, trace=trace)
    return engine.run(reqs, on_invalid="reject" if reject_invalid else "raise", progress=progress)


def _check_slo(slo_ttft_s: float, slo_tpot_s: float) -> None:
    check_real("slo_ttft_s", slo_ttft_s, 0.0, lo_open=True, allow_inf=True, unit="seconds")
    check_real("slo_tpot_s", slo_tpot_s, 0.0, lo_open=True, allow_inf=True, unit="seconds")


def simulate(workload: str | Sequence[Request] = "chat", rate: float | None = None, n_requests: int | None = None,
             system: str = "orca-max", model: str = "llama-3-8b", gpu: str | None = None,
             executor: str = "cost", max_bs: int | None = None, seed: int = 0, *,
             slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.05, **options) -> Metrics:
    """Run one workload through one system and return its `Metrics` (options as `run`)."""
    _check_slo(slo_ttft_s, slo_tpot_s)
    res = run(workload, rate, n_requests, system, model, gpu, executor, max_bs, seed, **options)
    return summarize(res, slo_ttft_s, slo_tpot_s)


def goodput(workload: str | Sequence[Request] = "chat", system: str = "orca-max", n_requests: int | None = None,
            *, slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.05, target: float = 0.9,
            lo: float = 0.01, hi: float = 256.0, rel_tol: float = 0.01, seed: int = 0, **options) -> Goodput:
    """Largest arrival rate with SLO attainment >= `target` (lecture §5.3), within `rel_tol`.

    The attainment bisected on is `Metrics.slo_attainment_submitted`, over every SUBMITTED request:
    a request refused at submission (`reject_invalid=True` with a lower `max_context`) counts as a
    miss, so refusing the hardest requests cannot raise the goodput (`Goodput.attainment` says so).

    A named workload (`n_requests` of it, default 600) is regenerated from the seed at every rate
    tried: the same requests, closer together. A request list (a replayed trace) is rescaled to
    each rate by `workload.at_rate`: its arrivals keep their pattern, only closer together or
    further apart. Other options are those of `run`, except `rate`, which the search chooses.
    """
    seed = check_seed(seed)
    _check_slo(slo_ttft_s, slo_tpot_s)
    target = check_real("target", target, 0.0, 1.0, lo_open=True)
    lo = check_real("lo", lo, 0.0, lo_open=True, unit="requests per second")
    hi = check_real("hi", hi, lo, lo_open=True, unit="requests per second")
    rel_tol = check_real("rel_tol", rel_tol, MIN_REL_TOL, 1.0, hi_open=True)
    if "rate" in options:
        raise ValueError(f"rate={options['rate']!r}: goodput searches the rate itself between lo and hi; "
                         "leave rate unset")
    if isinstance(workload, str):
        n = DEFAULT_N_REQUESTS if n_requests is None else n_requests

        def requests_at(rate: float) -> str | list[Request]:
            return workload
    else:
        reqs = request_copies(workload)
        _refuse({"n_requests": n_requests}, "a request list keeps its own number of requests (slice it)")
        at_rate(reqs, lo)  # refuses a list whose arrivals span no time before any run
        n = None

        def requests_at(rate: float) -> str | list[Request]:
            return at_rate(reqs, rate)

    def attainment(rate: float) -> float:
        w = requests_at(rate)
        res = run(w, rate if isinstance(w, str) else None, n, system, seed=seed, **options)
        return summarize(res, slo_ttft_s, slo_tpot_s).slo_attainment_submitted

    g = goodput_search(attainment, target, lo, hi, rel_tol)
    return dataclasses.replace(g, attainment="slo_attainment_submitted")
