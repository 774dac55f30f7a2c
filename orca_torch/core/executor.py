"""The executor interface: what one scheduled iteration costs, and (on torch) what it computes (lecture §5.1).

The engine's step is schedule -> `execute` -> record -> complete; only what `execute` returns
differs between the executors: the paper GPU prices a step from the batch's `StepTotals`
(`sim/executors.py`), the torch model runs it and returns its tokens, greedy or drawn as each
request's `sampling` asks (`model/torch_executor.py`).

An executor may instead be asynchronous (`is_async = True`, e.g. pipelined workers in other
processes): `submit(batch)` returns at once, `wait()` blocks until the OLDEST submitted batch has
left the last stage and returns it with its `StepResult` (batches leave in submission order), and
`now()` is its run clock in seconds since `reset()`. `pipeline.py` drives both kinds. A synchronous
executor under `n_workers > 1` is pipelined in simulation: a batch of duration `d` passes through
its S stages (`n_stages`) in a row, `d / S` in each, and keeps each busy for the larger of
`d / S` and `StepResult.stage_s`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, NamedTuple

from orca_torch.core.batch import Batch
from orca_torch.core.memory import MemoryManager
from orca_torch.core.request import Request


@dataclass(slots=True)
class StepResult:
    """What a step took (`duration_s`, in the run's clock), its tokens in `batch.works`
    order (torch only), how long it keeps each pipeline stage busy (`stage_s`, the slowest stage;
    None, or less than its share of `duration_s`: that share), for asynchronous executors the
    start and end on `now()`'s clock, and (torch only) `logprobs`, one per work: the log
    probabilities of its token for a request that asks for them (`model.sampling.TokenLogprobs`),
    None for the others; None at all where none asks."""

    duration_s: float
    tokens: list[int] | None = None
    stage_s: float | None = None
    start_s: float | None = None
    end_s: float | None = None
    logprobs: list | None = None


class RowsFailed(RuntimeError):
    """A step that ran, but some of its rows made no token (`model.sampling.NonFiniteLogits`: a
    logits row that is not finite). `rows`: each such request's id, with why; `result`: the step as
    it ran for the others (their tokens and log probabilities; the failed rows' entries are
    meaningless), or None where the executor made none. An offline run stops on it, as on any
    error; a live run (`Engine.start_live`) drops the requests of `rows` alone and completes the
    others from `result`, which a synchronous executor gives only where their K/V and draws are
    those of a step that ran without the failed rows."""

    def __init__(self, message: str, rows: Mapping[Hashable, str] | None = None,
                 result: StepResult | None = None) -> None:
        super().__init__(message)
        self.rows = dict(rows or {})
        self.result = result


class Returned(NamedTuple):
    """An asynchronous executor's batch as it leaves the pipeline (`Executor.wait`)."""

    batch: Batch
    result: StepResult


class Executor:
    """The interface the engine uses."""

    is_async = False
    max_context: int | None = None
    n_stages: int | None = None
    """How many pipeline stages run a batch one after another (the paper GPU's `pp`; 1 for a model in
    one process); None (the default, a step-time function's): `n_workers` stages, each `1 / n_workers`
    of a step."""

    def execute(self, batch: Batch) -> StepResult:
        """Synchronous executors: run (or price) `batch` and say what it took; `RowsFailed` where
        some of its requests could make no token (a live run drops those alone)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement execute")

    def submit(self, batch: Batch) -> None:
        """Asynchronous executors: start `batch` and return at once."""
        raise NotImplementedError(f"{type(self).__name__} does not implement submit")

    def wait(self) -> Returned:
        """Asynchronous executors: block until the oldest submitted batch is done, and return it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement wait")

    def now(self) -> float:
        """Asynchronous executors: seconds on the run clock since `reset()`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement now")

    def check(self, req: Request) -> None:
        """Raise ValueError if this executor cannot run `req`."""

    def check_memory(self, memory: MemoryManager) -> None:
        """Raise ValueError if this executor cannot serve with `memory` (the engine asks when it is
        built, so a run never stops at the first step the two disagree on)."""

    def release(self, req: Request) -> None:
        """`req` finished, left (aborted, or its row failed) or was preempted: drop any state held for it."""

    def reset(self) -> None:
        """A run starts."""
