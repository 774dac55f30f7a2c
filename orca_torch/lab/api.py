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
  preempting by recompute, or by swap to a CPU pool as large as the GPU's (over the card's host
  link: on the paper GPU, a card without one is refused);
- `static`: request-level batching, batches of `max_bs` (default 128), see `baselines.py`;
- `sequential`: one request at a time (`max_bs = 1`).

`executor="cost"` prices steps on the paper GPU: `model`, `gpu`, and the settings of
`hw_model.pricer` (`tp`, `pp`, `attention`, `flop_efficiency`, `bw_efficiency`, `comm_efficiency`,
`overhead_s`, `seq_overhead_s`, `count_activations`, `cost_model`, `attention_tile`), passed on only
when given so the pricer's own defaults and checks apply. `executor="torch"` runs the real
`OrcaModel` (preset `tiny` or `mini`) and times it on `device` with `clock`; there `attention` is
the model's attention path, `split` (the default) or `fused`. With `clock="iterations"` every time
counts iterations: the arrivals (`rate` is requests an iteration), the SLOs and the figures named in
seconds. A setting that the chosen executor or workload would ignore is refused with ValueError
rather than silently dropped. The K/V capacity `n_slots` defaults to what the GPU holds
(`hw_model.kv_capacity_tokens`, 90% of memory minus weights) on the paper GPU, and to room for every
request at once on torch (under any reservation; the K/V tensors hold only what each request
stores). Requests refused at submission raise ValueError, or with `reject_invalid=True` are counted
in `Metrics.n_rejected` and as misses in `slo_attainment_submitted` (which `goodput` bisects on),
and left out of every other figure.

A request list is never changed: the run works on copies, and fills in only what is missing
(`predicted_output` for `order="spf"`, `prompt_ids` for the torch executor).

A new policy is `scheduler=`, a `Scheduler` subclass, and a new memory manager `memory=`, a
`MemoryManager` subclass built for each run as `memory(n_slots)` (docs/extending.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from typing import Any, Callable, Sequence

from orca_torch.checks import (brief, check_callable, check_choice, check_fits_in_memory, check_flag, check_int,
                               check_items, check_real, check_seed, derived_seed, is_int, is_real)
from orca_torch.core.engine import Engine
from orca_torch.core.executor import Executor
from orca_torch.core.memory import (MAX_SLOTS, MemoryManager, ReservationMemory, TokenMemory, UnlimitedMemory,
                                    slots_to_finish)
from orca_torch.core.paged_memory import BLOCK_SIZE, PagedMemory, blocks_to_finish, pool_admitting
from orca_torch.core.policies import check_policy
from orca_torch.core.request import Request
from orca_torch.core.run_result import RunResult
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.lab.baselines import one_at_a_time, static_batching
from orca_torch.lab.metrics import Goodput, Metrics, check_slo, goodput_search, summarize
from orca_torch.lab.workload import (MAX_SIGMA, WORKLOADS, at_rate, fresh_copies, make_workload,
                                     refuse_slower_than_the_clock, with_predictions, with_prompt_ids)
from orca_torch.sim.executors import CostModelExecutor
from orca_torch.sim.fast_engine import FastEngine
from orca_torch.sim.hw_model import kv_capacity_tokens
from orca_torch.sim.hw_model.host_link import check_host_link
from orca_torch.specs import ModelSpec, get_model_spec

SYSTEMS = ("orca-max", "orca-pow2", "orca-oracle", "orca-unlimited", "orca-ondemand", "paged", "paged-swap", "static",
           "sequential")
MEMORY_AGNOSTIC = ("orca-max", "static", "sequential")
"""The systems that `memory=` may go with: iteration-level (`orca-max`, the default, whose
reservation it replaces) and the request-level baselines. The others differ from `orca-max` only
in their memory manager, which `memory=` would replace."""
EXECUTORS = ("cost", "torch")
# The settings of the paper GPU (`hw_model.pricer`), forwarded only when given.
PAPER_GPU_SETTINGS = ("tp", "pp", "attention", "flop_efficiency", "bw_efficiency", "comm_efficiency",
                      "overhead_s", "seq_overhead_s", "count_activations", "cost_model", "attention_tile")
DEFAULT_RATE = 8.0
DEFAULT_N_REQUESTS = 600


def n_requests_or_default(n_requests: Any) -> Any:
    """The requests a named workload draws: `n_requests`, or `DEFAULT_N_REQUESTS` where None (where it
    is drawn, or checked at the door, it must be an integer >= 1)."""
    return DEFAULT_N_REQUESTS if n_requests is None else n_requests


BYTES_PER_REQUEST = 1_000
"""Less than a chat request's share of a run's peak memory on the paper GPU: its `Request`, its
tokens' steps (as runs of steps: no number per token), its share of the step log and of the
summary's per-request arrays. A million chat requests peak near 1.3 GiB, about 1,300 bytes a
request beyond the 0.4 GiB of a quarter million (`benchmarks/bench_scale.py`); the core `Engine`
keeps 4 bytes a token more (rank 0 of `python -m orca_torch.distributed`)."""


def make_memory(system: str, n_slots: int) -> MemoryManager:
    """The memory manager a system uses over `n_slots` K/V slots. `orca-unlimited`, and the
    request-level baselines `static` and `sequential`, run on memory with no limit (`n_slots` is
    only what occupancy is reported against): the lecture's static batching charges its seats'
    time, not their memory (`baselines.fastertransformer_setup` pre-allocates it instead)."""
    system = check_choice("system", system, SYSTEMS)
    if system in ("orca-max", "orca-pow2", "orca-oracle"):
        return ReservationMemory(n_slots, system.split("-")[1])
    if system == "orca-ondemand":
        return TokenMemory(n_slots)
    if system in ("paged", "paged-swap"):
        return PagedMemory(n_slots, preemption="swap" if system == "paged-swap" else "recompute")
    return UnlimitedMemory(n_slots)


def make_config(system: str, max_bs: int | None = None, **knobs) -> SchedulerConfig:
    """Scheduler knobs for a system (`order`, `prefill`, `n_workers`, `max_num_batched_tokens`, ...: §6);
    `SchedulerConfig` checks them, and refuses any but `max_bs` for static batching."""
    system = check_choice("system", system, SYSTEMS)
    if "static" in knobs:
        raise ValueError("static is the system's to set: system='static' is request-level batching, "
                         "every other system iteration-level")
    if system == "static":
        return dataclasses.replace(static_batching(128 if max_bs is None else max_bs), **knobs)
    if system == "sequential":
        config = dataclasses.replace(one_at_a_time(), **knobs, **({} if max_bs is None else {"max_bs": max_bs}))
        if config.max_bs != 1 or config.n_workers != 1:
            raise ValueError(f"sequential serves one request at a time: max_bs=1 and n_workers=1 (pipelined, each "
                             f"batch in flight would hold a request of its own), got max_bs={config.max_bs}, "
                             f"n_workers={config.n_workers}")
        return config
    config = SchedulerConfig(max_bs=256 if max_bs is None else max_bs, **knobs)
    if system in ("orca-ondemand", "paged", "paged-swap") and config.n_workers != 1:
        raise ValueError(f"system={system!r} can run out of memory and preempt, which needs n_workers=1 (a request "
                         f"in flight cannot be evicted), got n_workers={config.n_workers}; pipelining runs with the "
                         "reserving systems (orca-max, orca-pow2, orca-oracle) and orca-unlimited")
    return config


def _workload_requests(workload: Any) -> list[Request]:
    """A workload given as requests: a non-empty list or tuple of `Request` objects (a name is looked up
    elsewhere), or a ValueError saying what a workload may be."""
    if not isinstance(workload, (list, tuple)) or isinstance(workload, Request):
        raise ValueError(f"workload must be a workload name ({', '.join(WORKLOADS)}) or a list of Request "
                         f"objects, got {brief(workload)}")
    reqs = check_items("workload", workload, Request)
    if not reqs:
        raise ValueError("the request list is empty: nothing to run")
    return reqs


def _filled(reqs: list[Request], name: str, fill: Callable[..., list[Request]], *args, **kwargs) -> list[Request]:
    """`reqs` with each request whose field `name` is None replaced by its copy from
    `fill(those, *args, **kwargs)` (`workload.with_predictions`, `with_prompt_ids`: copies, in
    order); `reqs` itself is not changed."""
    copies = iter(fill([r for r in reqs if getattr(r, name) is None], *args, **kwargs))
    return [next(copies) if getattr(r, name) is None else r for r in reqs]


def _refuse(given: dict[str, Any], why: str) -> None:
    """ValueError naming the settings in `given` that are not None, which `why` says do nothing."""
    names = [k for k, v in given.items() if v is not None]
    if names:
        listed = ", ".join(f"{k}={brief(given[k])}" for k in names)
        raise ValueError(f"{listed}: {why}; leave {'it' if len(names) == 1 else 'them'} unset")


@dataclasses.dataclass
class RunSettings:
    """Every setting of `run`, refused when built if it is wrong or would do nothing.

    A named `workload` is drawn with `n_requests` (default 600) at `rate` req/s (default 8; at least
    `workload.slowest_rate(n)`, (n - 1) / 2**32, within which the run's clock holds the arrivals); a request
    list keeps its own arrivals and length, so `rate` and `n_requests` are refused with one
    (rescale it with `workload.at_rate`). `chat` is drawn for the MODEL's context (it leaves the
    trace rows longer than that out of the draw); the other named workloads keep their own length
    distributions, whatever the model (`orca`'s reach 512 + 128 tokens, more than `tiny`
    holds). `max_context` is the serving context (default: the model's); requests longer than it
    raise ValueError, or with `reject_invalid=True` are refused, listed in `RunResult.rejected` and
    counted in `Metrics.n_rejected` (exercise 3: refused, not hidden).

    `executor="cost"`: the paper GPU is `gpu` (default "h100") with `mem_fraction` of its memory for
    weights and K/V (default 0.9; refused when `n_slots` is given), priced with the settings of
    `PAPER_GPU_SETTINGS`. `executor="torch"`: the model (`tiny` or `mini`) runs on `device`
    (default "cpu") timed by `clock` ("wall", the default, or "iterations"), on `threads` torch
    threads (default 1, as the experiments' `--threads`: on a small shared CPU a second thread
    stalls a small model's ops; the caller's setting is restored after).

    `seed` draws a named workload, `order="spf"`'s predictions, and a torch run's weights and
    prompts; a request list on the paper GPU draws nothing, so every seed gives the same run.

    `order`, `prefill`, `n_workers`, `max_num_batched_tokens` and `chunked_prefill` are the
    scheduler's knobs; `scheduler`, a `Scheduler` subclass, is a new policy run with them in place
    of the system's (`Engine`'s `scheduler`; on the paper GPU the fast engine takes a class other
    than the one the knobs name one step a call); `system="static"`, `prefill` or `chunked_prefill`
    that its class would ignore is refused (`policies.check_policy`).
    `memory`, a `MemoryManager` subclass, is a new memory manager built for each run as
    `memory(n_slots)` (the K/V capacity above) in place of the system's: `system` then says only
    how steps are filled, `orca-max` (the default), `static` or `sequential` (`MEMORY_AGNOSTIC`;
    a system named for its memory is refused beside it). On the paper GPU the fast engine steps a
    manager it does not know one step a call, the same run as `Engine`'s; on torch the K/V tensors
    hold every request at once, and `n_slots` defaults to the context for each request (or, for a
    `PagedMemory` subclass, as `paged` sizes it). The engine refuses one that can run out beside
    `n_workers > 1` or `system="static"`, and one that swaps on a card without a host link.
    `n_workers > 1` needs pipeline stages for its batches to be in (the paper GPU's `pp`); with one
    stage (`pp` 1, or the torch model in this process) a batch could only wait for the one before
    it, so it is refused there. `predictor_sigma` is the noise of the output-length predictor that
    `order="spf"` sorts by (§6.3; None or 0 is the oracle); it draws predictions only for requests
    without one, and with any other order nothing reads a prediction, so giving it is an error
    rather than a silently ignored setting.

    The parts a run builds check their own arguments once, where they are built: the knobs in
    `SchedulerConfig`, the paper GPU's settings in `hw_model.pricer`, the torch model's in
    `OrcaModel` and `TorchExecutor`, `max_context` and `trace` in `Engine`.
    """
    workload: str | Sequence[Request] = "chat"
    rate: float | None = None
    n_requests: int | None = None
    system: str = "orca-max"
    model: str = "llama-3-8b"
    gpu: str | None = None
    executor: str = "cost"
    max_bs: int | None = None
    seed: int = 0
    order: str = "fcfs"
    predictor_sigma: float | None = None
    prefill: str = "mixed"
    n_workers: int = 1
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = False
    max_context: int | None = None
    n_slots: int | None = None
    mem_fraction: float | None = None
    tp: int | None = None
    pp: int | None = None
    attention: str | None = None
    flop_efficiency: float | None = None
    bw_efficiency: float | None = None
    comm_efficiency: float | None = None
    overhead_s: float | None = None
    seq_overhead_s: float | None = None
    count_activations: bool | None = None
    cost_model: str | None = None
    attention_tile: int | None = None
    reject_invalid: bool = False
    device: str | None = None
    clock: str | None = None
    threads: int | None = None
    scheduler: type | None = None
    memory: type | None = None
    trace: bool = False
    # Set when built: the scheduler's knobs, the model's spec, the caller's request list (or None).
    config: SchedulerConfig = dataclasses.field(init=False, repr=False)
    spec: ModelSpec = dataclasses.field(init=False, repr=False)
    given: list[Request] | None = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.seed = check_seed(self.seed)
        self.executor = check_choice("executor", self.executor, EXECUTORS)
        self.reject_invalid = check_flag("reject_invalid", self.reject_invalid)
        self.config = make_config(self.system, self.max_bs, order=self.order, prefill=self.prefill,
                                  n_workers=self.n_workers, max_num_batched_tokens=self.max_num_batched_tokens,
                                  chunked_prefill=self.chunked_prefill)
        self.spec = get_model_spec(self.model)
        check_policy(self.scheduler, self.config)
        self._check_memory()
        if self.n_slots is not None:
            self.n_slots = check_int("n_slots", self.n_slots, 1, MAX_SLOTS)
            _refuse({"mem_fraction": self.mem_fraction}, "mem_fraction sizes the K/V capacity only when n_slots "
                    "is not given")
        self._check_executor_settings()
        self._check_workload()
        self._check_predictor()

    def _check_memory(self) -> None:
        """`memory`: None, or a `MemoryManager` subclass that implements the rules, can be built as
        `memory(n_slots)`, and goes with a system that names no memory of its own."""
        cls = self.memory
        if cls is None:
            return
        if not (isinstance(cls, type) and issubclass(cls, MemoryManager)):
            given = (f"an instance of {type(cls).__name__}: give the class, each run builds its own"
                     if isinstance(cls, MemoryManager) else brief(cls))
            raise ValueError(f"memory must be a MemoryManager subclass (built for each run as memory(n_slots)), "
                             f"got {given}")

        def inherits(name: str) -> bool:
            return getattr(cls, name) is getattr(MemoryManager, name)

        # (`reservation` is read by MemoryManager's `try_admit` and `check`; a paged pool has its own)
        needs = (["reservation"] if inherits("try_admit") or inherits("check") else []) + ["grow"]
        missing = [name for name in needs if inherits(name)]
        if missing:
            raise ValueError(f"memory={cls.__name__} does not implement {' or '.join(missing)}, which MemoryManager "
                             "leaves to its subclasses (its docstring holds the contract)")
        try:
            inspect.signature(cls).bind(1)
        except TypeError:
            raise ValueError(f"memory={cls.__name__} is built as {cls.__name__}(n_slots), but its __init__"
                             f"{inspect.signature(cls)} does not take that: give its other arguments defaults "
                             "(in a subclass that sets them)") from None
        if self.system not in MEMORY_AGNOSTIC:
            raise ValueError(f"system={self.system!r} differs from 'orca-max' only in its memory manager, which "
                             f"memory={cls.__name__} replaces; beside memory= give system one of "
                             f"{', '.join(MEMORY_AGNOSTIC)} (how steps are filled), or leave it at 'orca-max'")

    def _check_executor_settings(self) -> None:
        """Refuse what the chosen executor would ignore, and `n_workers > 1` with one pipeline stage."""
        if self.executor == "cost":
            _refuse({"device": self.device, "clock": self.clock, "threads": self.threads}, "executor='cost' "
                    "prices steps on the paper GPU, whose clock is simulated and which runs on no torch device")
            if (self.tp or 1) * (self.pp or 1) == 1:
                _refuse({"comm_efficiency": self.comm_efficiency}, "comm_efficiency prices the tensor- and "
                        "pipeline-parallel transfers, and with tp = pp = 1 there are none")
        else:
            _refuse({"gpu": self.gpu, "mem_fraction": self.mem_fraction,
                     **{k: v for k, v in self._paper_gpu_settings().items() if k != "attention"}},
                    "these are settings of the paper GPU (executor='cost'); executor='torch' runs the real "
                    "model in this process")
            if self.model not in ("tiny", "mini"):
                raise ValueError(f"executor='torch' runs the project's own presets 'tiny' or 'mini', "
                                 f"got {brief(self.model)}")
            if self.attention is not None:
                from orca_torch.model.orca_model import ATTENTION_PATHS     # (torch runs only import torch)

                check_choice("attention (the torch model's attention path)", self.attention, ATTENTION_PATHS)
            if self.threads is not None:
                self.threads = check_int("threads", self.threads, 1, os.cpu_count() or 1)
        stages = (self.pp or 1) if self.executor == "cost" else 1      # (their n_stages, before one is built)
        if self.config.n_workers > 1 and stages == 1:
            where = "the paper GPU with pp=1" if self.executor == "cost" else "the torch model in this process"
            raise ValueError(f"n_workers={self.n_workers}: batches in flight need pipeline stages to be in, and "
                             f"{where} has one, so a batch would only wait for the one before it; give the "
                             "paper GPU pp >= 2, or leave n_workers at 1")

    def _check_workload(self) -> None:
        """A named workload's size, or a request list (kept as `given`) with no `rate` or `n_requests`."""
        if isinstance(self.workload, str):
            self.given = None                   # a name: `make_workload` refuses one it does not know
            need = int(self.n_requests) * BYTES_PER_REQUEST if is_int(self.n_requests) else 0  # (a numpy int wraps)
            if need > 1 << 26:                  # (a smaller run is not worth a read of /proc/meminfo)
                check_fits_in_memory(f"n_requests={self.n_requests:,} (at least {BYTES_PER_REQUEST:,} bytes "
                                     "a request)", need)
        else:
            self.given = _workload_requests(self.workload)
            _refuse({"rate": self.rate, "n_requests": self.n_requests}, "a request list keeps its own arrivals "
                    "and number (rescale it with workload.at_rate, or slice it)")

    def _check_predictor(self) -> None:
        """`predictor_sigma` only where `order="spf"` draws predictions for requests without one."""
        if self.predictor_sigma is not None:
            if self.order != "spf":
                raise ValueError(f"predictor_sigma={brief(self.predictor_sigma)} only applies to order='spf' "
                                 f"(shortest predicted first); with order={brief(self.order)} no prediction is used: "
                                 "leave predictor_sigma=None")
            check_real("predictor_sigma", self.predictor_sigma, 0.0, MAX_SIGMA)
            if self.given is not None and all(r.predicted_output is not None for r in self.given):
                raise ValueError(f"predictor_sigma={self.predictor_sigma!r} draws predictions for requests "
                                 f"without predicted_output, but all {len(self.given)} requests carry one: "
                                 "leave it None")

    def _paper_gpu_settings(self) -> dict[str, Any]:
        """The settings of `PAPER_GPU_SETTINGS`, given or not (None)."""
        return {k: getattr(self, k) for k in PAPER_GPU_SETTINGS}

    def requests(self) -> list[Request]:
        """The requests to run: fresh copies of the given list, or the named workload drawn; what is
        missing filled in: predictions for `order="spf"`, seeded prompt ids for the torch executor."""
        if self.given is not None:
            reqs = fresh_copies(self.given)
        else:
            # Chat draws trace rows that fit the MODEL's context; a lower serving `max_context`
            # (exercise 3) then refuses the longer ones (with reject_invalid=True) instead of hiding them.
            extra = {"max_context": self.spec.max_context} if self.workload == "chat" else {}
            reqs = make_workload(self.workload, seed=self.seed, **extra,
                                 n_requests=n_requests_or_default(self.n_requests),
                                 rate=DEFAULT_RATE if self.rate is None else self.rate)
        if self.order == "spf":
            reqs = _filled(reqs, "predicted_output", with_predictions, self.predictor_sigma or 0.0,
                           seed=derived_seed(self.seed))
        if self.executor == "torch":
            reqs = _filled(reqs, "prompt_ids", with_prompt_ids, self.spec.vocab, seed=self.seed)
        return reqs

    def torch_threads(self) -> contextlib.AbstractContextManager:
        """A torch run's `threads` (default 1) while it lasts; nothing for the paper GPU."""
        if self.executor == "cost":
            return contextlib.nullcontext()
        from orca_torch.model.accounting import torch_threads

        return torch_threads(1 if self.threads is None else self.threads)

    def engine(self, reqs: list[Request]) -> Engine:
        """The engine over the chosen executor and the system's memory for `reqs` (`requests()`, which
        it does not change): the fast engine on the paper GPU, `Engine` on the torch model."""
        if self.executor == "cost":
            ex, mem = self._paper_gpu_parts()
            engine_class = FastEngine
        else:
            ex, mem = self._torch_parts(reqs)
            engine_class = Engine
        return engine_class(ex, mem, self.config, max_context=self.max_context, trace=self.trace,
                            scheduler=self.scheduler)

    def _paper_gpu_parts(self) -> tuple[CostModelExecutor, MemoryManager]:
        """The paper GPU's executor, and the system's memory over the K/V slots the card holds (or `n_slots`)."""
        settings = {k: v for k, v in self._paper_gpu_settings().items() if v is not None}
        gpu = "h100" if self.gpu is None else self.gpu
        ex = CostModelExecutor(self.model, gpu, **settings)
        if self.system == "paged-swap":
            check_host_link(ex.pricer.gpu, "system='paged-swap'", "system='paged' (preempts by recompute)")
        n_slots = self.n_slots
        if n_slots is None:
            extra = {} if self.mem_fraction is None else {"mem_fraction": self.mem_fraction}
            n_slots = kv_capacity_tokens(self.model, gpu, tp=settings.get("tp", 1), pp=settings.get("pp", 1), **extra)
        return ex, self._memory(n_slots)

    def _memory(self, n_slots: int) -> MemoryManager:
        """The run's memory manager over `n_slots`: `memory(n_slots)`, or the system's."""
        return make_memory(self.system, n_slots) if self.memory is None else self.memory(n_slots)

    def _torch_parts(self, reqs: list[Request]) -> tuple[Executor, MemoryManager]:
        """The torch model's executor over K/V tensors, and the system's memory over `n_slots` (by
        default room for every request at once)."""
        from orca_torch.model.orca_model import OrcaModel    # torch is imported for torch runs only
        from orca_torch.model.paged_kv_cache import PagedKVManager
        from orca_torch.model.torch_executor import TorchExecutor

        model = OrcaModel(self.model, seed=self.seed, device="cpu" if self.device is None else self.device,
                          attention="split" if self.attention is None else self.attention)
        need = sum(slots_to_finish(r) for r in reqs)   # what every request stores, all at once
        n_slots = self.n_slots
        if n_slots is None:
            # Room for every request at once, as its system reserves: Max and pow2 (and a `memory=`,
            # whose rule is its own) up to the context each (the K/V tensors hold only what is stored);
            # paged, whole blocks each, and the 1% of the pool that admission keeps free (`PagedMemory`'s
            # watermark).
            own = self.memory
            reserves_context = own is not None or self.system in ("orca-max", "orca-pow2")
            paged = issubclass(own, PagedMemory) if own is not None else self.system in ("paged", "paged-swap")
            n_slots = max(need, len(reqs) * self.spec.max_context if reserves_context else self.spec.max_context)
            if paged:
                blocks = sum(blocks_to_finish(r, BLOCK_SIZE) for r in reqs)
                n_slots = max(n_slots, pool_admitting(blocks) * BLOCK_SIZE)
        mem = self._memory(n_slots)
        kv = PagedKVManager.mirroring(mem, model) if isinstance(mem, PagedMemory) else model.new_kv(max(n_slots, need))
        return TorchExecutor(model, kv, clock="wall" if self.clock is None else self.clock), mem


def run(workload: str | Sequence[Request] = "chat", rate: float | None = None, n_requests: int | None = None,
        system: str = "orca-max", model: str = "llama-3-8b", gpu: str | None = None,
        executor: str = "cost", max_bs: int | None = None, seed: int = 0, *,
        progress: Callable[[int, int], None] | None = None, **options) -> RunResult:
    """Run one workload through one system; returns the raw `RunResult` (see `simulate`).

    `options` are the other fields of `RunSettings`, which says what each does and refuses the wrong
    ones. `progress(finished, total)`, if given, is called every 1024 steps of the run and at its end
    (`Engine.run`).
    """
    _check_options(options)
    settings = RunSettings(workload=workload, rate=rate, n_requests=n_requests, system=system, model=model, gpu=gpu,
                           executor=executor, max_bs=max_bs, seed=seed, **options)
    reqs = settings.requests()
    with settings.torch_threads():
        return settings.engine(reqs).run(reqs, on_invalid="reject" if settings.reject_invalid else "raise",
                                         progress=progress)


def _check_options(options: dict[str, Any]) -> None:
    """TypeError for a name in `options` that is no field of `RunSettings` a caller sets (`run`'s own
    parameters aside), listing those that are."""
    own = inspect.signature(run).parameters
    known = [f.name for f in dataclasses.fields(RunSettings) if f.init and f.name not in own]
    unknown = [k for k in options if k not in known]
    if unknown:
        raise TypeError(f"unknown option {brief(unknown[0])}; the options are {', '.join(known)}")


def simulate(workload: str | Sequence[Request] = "chat", rate: float | None = None, n_requests: int | None = None,
             system: str = "orca-max", model: str = "llama-3-8b", gpu: str | None = None,
             executor: str = "cost", max_bs: int | None = None, seed: int = 0, *,
             slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.05, **options) -> Metrics:
    """Run one workload through one system and return its `Metrics` (options as `run`, but `trace`)."""
    check_slo(slo_ttft_s, slo_tpot_s)
    _refuse_trace(options, "simulate")
    res = run(workload, rate, n_requests, system, model, gpu, executor, max_bs, seed, **options)
    return summarize(res, slo_ttft_s, slo_tpot_s)


def _refuse_trace(options: dict[str, Any], who: str) -> None:
    """ValueError for `trace=True` given to `who`, which returns figures that read no trace: the
    batches it keeps would only cost the run memory."""
    if "trace" in options and check_flag("trace", options["trace"]):
        raise ValueError(f"trace=True keeps every step's batch in the RunResult, which {who} does not return; "
                         "call run for the trace")


def goodput(workload: str | Sequence[Request] = "chat", system: str = "orca-max", n_requests: int | None = None,
            *, slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.05, target: float = 0.9,
            lo: float = 0.01, hi: float = 256.0, rel_tol: float = 0.01, seed: int = 0,
            on_rate: Callable[[float, float], None] | None = None, **options) -> Goodput:
    """Largest arrival rate with SLO attainment >= `target` (lecture §5.3), within `rel_tol`.

    The attainment bisected on is `Metrics.slo_attainment_submitted`, over every SUBMITTED request:
    a request refused at submission (`reject_invalid=True` with a lower `max_context`) counts as a
    miss, so refusing the hardest requests cannot raise the goodput (`Goodput.attainment` says so).

    A named workload (`n_requests` of it, default 600) is regenerated from the seed at every rate
    tried: the same requests, closer together. A request list (a replayed trace) is rescaled to
    each rate by `workload.at_rate`: its arrivals keep their pattern, only closer together or
    further apart. Other options are those of `run`, except `rate`, which the search chooses, and
    `trace`, which no attainment reads. `on_rate(rate, attainment)`, if given, is called after each
    rate is tried (a progress line).

    `lo` and `hi` are at least `workload.slowest_rate(n)` for n requests, (n - 1) / 2**32 req/s: at a
    slower rate the arrivals reach past the range the run's clock resolves (`durations.CLOCK_SPAN_S`).
    `goodput_search` checks `target`, `lo`, `hi` and `rel_tol`, and `run` the seed and the options,
    before anything is simulated.
    """
    check_slo(slo_ttft_s, slo_tpot_s)
    check_callable("on_rate", on_rate, "(rate, attainment) -> None", allow_none=True)
    _refuse_trace(options, "goodput")
    if "rate" in options:
        raise ValueError(f"rate={brief(options['rate'])}: goodput searches the rate itself between lo and hi; "
                         "leave rate unset")
    if isinstance(workload, str):
        n = check_int("n_requests", n_requests_or_default(n_requests), 1)

        def run_at(rate: float) -> RunResult:
            return run(workload, rate, n_requests, system, seed=seed, **options)
    else:
        reqs = fresh_copies(_workload_requests(workload))
        n = len(reqs)
        _refuse({"n_requests": n_requests}, "a request list keeps its own number of requests (slice it)")
        try:                # (before any run)
            at_rate(reqs, 1.0)
        except ValueError as e:
            raise ValueError(f"goodput rescales a request list's arrivals to each rate it tries, and {e}") from None

        def run_at(rate: float) -> RunResult:
            return run(at_rate(reqs, rate), None, None, system, seed=seed, **options)

    for name, bound in (("lo", lo), ("hi", hi)):
        if is_real(bound):                  # (one that is no number is left to goodput_search, which says so)
            refuse_slower_than_the_clock(name, bound, n, allowed="lo and hi")

    def attainment(rate: float) -> float:
        res = run_at(rate)
        # (none served: every request was refused at submission, each a miss)
        attained = summarize(res, slo_ttft_s, slo_tpot_s).slo_attainment_submitted if res.n else 0.0
        if on_rate is not None:
            on_rate(rate, attained)
        return attained

    g = goodput_search(attainment, target, lo, hi, rel_tol)
    return dataclasses.replace(g, attainment="slo_attainment_submitted")
