"""What a run produced: `RunResult`, with a traced run's steps (`TraceStep`) and the requests refused
at submission (`Rejected`). `Engine.result()` builds one, as arrays, when a run is over.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.core.token_steps import TokenRuns


class TraceStep(NamedTuple):
    """One step of a traced run: its index, start and end, and `(req_id, n_new, n_past)` per work."""

    index: int
    start: float
    end: float
    works: list[tuple]


class Rejected(NamedTuple):
    """A request refused at submission (`on_invalid="reject"`), and why: `Engine.check`'s message."""

    req: Request
    why: str


class _TokenStepField:
    """`RunResult.token_step`: holds what it was given, the column or its `TokenRuns`, and reads as
    the column (built from the runs on the first read, and kept in them). Why: a fast run hands
    over runs (a million chat requests: a million runs, where the column is 844 MB), and most
    callers (`metrics.summarize`) read only the runs, so the column is made only for one that
    reads it. A descriptor on the dataclass field, so that the constructor stores either form
    under the field's name and every read of `token_step` comes through `__get__`."""

    def __get__(self, result: RunResult | None, owner: type | None = None) -> np.ndarray:
        if result is None:                      # read on the class, as `dataclass` does for a default: none
            raise AttributeError("token_step")
        held = result.__dict__["token_step"]
        return held.column(result.n_steps) if isinstance(held, TokenRuns) else held

    def __set__(self, result: RunResult, value: np.ndarray | TokenRuns) -> None:
        result.__dict__["token_step"] = value


@dataclass
class RunResult:
    """Everything a run produced; `metrics.summarize` turns it into the lecture's figures.

    `rejected` holds the requests refused at submission, each a `Rejected(req, why)`. Per request
    (in arrival order, the accepted ones): `arrival_s`, `prompt_len`, `output_len`, `release_s` (memory and
    seat given back), `n_preemptions`; tokens flat: request i's tokens were made by the steps
    `token_step[token_offsets[i]:token_offsets[i+1]]`, one small unsigned integer a token
    (`token_steps.step_dtype`). Per step: start, end, sequences, tokens, K/V slots reserved
    (occupied) and used (holding K/V), against `n_slots` (for memory with no limit, the
    `capacity` given to `UnlimitedMemory`, else NaN: no fraction to report). A token's time is
    the end of the step that made it, so `token_times`, `first_token_s` and `last_token_s` are
    derived (`token_times` builds a float array as long as the run's tokens, and a fast run's
    `token_step` builds its column when read: for a very large run, read `token_runs` and
    `step_end`, as the summary does).

    The same token steps come as runs of consecutive steps, `token_runs` (`token_steps.TokenRuns`),
    which is what `metrics.summarize` and the first and last token's steps read. `token_step` may
    be given as the column or as its `TokenRuns` (the fast engine's way: a million requests are a
    million runs where the column is hundreds of millions of slots); each is built from the other
    when first read and kept, so change neither in place (`dataclasses.replace` makes a result
    with another column).

    A simulated pipeline (`n_workers > 1` on a synchronous executor, `pipeline.py`) also keeps when
    each step entered each of the executor's S stages, `stage_start` (shape `(n_steps, S)`); a step
    spends `step_end - stage_start[:, -1]` in each. None for any other run. `output_ids` are the
    tokens a run on the torch model made, per request id (empty on the paper GPU); `output_logprobs`,
    per the same ids, each token's `TokenLogprobs` for a request that asked for them
    (`SamplingParams.logprobs`), None for one that did not.

    Everything here is a copy but `requests`, the run's own `Request` objects, whose state the
    next run of them resets.

    Every time here counts from the first arrival, which is `clock_origin_s` on the requests' own
    clock (their `arrival_s`): a trace replayed with Unix timestamps keeps the precision of its
    step times (a float near 1.7e9 holds nothing finer than 2.4e-7 s). A live run's clock is its
    requests' own (`clock_origin_s` 0): its first arrival is not known when it starts.
    """

    requests: list[Request]
    rejected: list[Rejected]
    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    token_offsets: np.ndarray
    token_step: np.ndarray = _TokenStepField()  # (given as the column, or as its TokenRuns)
    release_s: np.ndarray
    n_preemptions: np.ndarray
    step_start: np.ndarray
    step_end: np.ndarray
    step_n_seqs: np.ndarray
    step_n_tokens: np.ndarray
    step_reserved: np.ndarray
    step_used: np.ndarray
    n_slots: float
    config: SchedulerConfig
    trace: list[TraceStep] | None = field(default=None, repr=False)
    clock_origin_s: float = 0.0
    stage_start: np.ndarray | None = field(default=None, repr=False)
    output_ids: dict = field(default_factory=dict, repr=False)
    output_logprobs: dict = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        return len(self.requests)

    @property
    def n_steps(self) -> int:
        return len(self.step_end)

    @property
    def n_tokens(self) -> int:
        return int(self.token_offsets[-1])

    @property
    def token_times(self) -> np.ndarray:
        """When each token came out: the end of the step that made it."""
        return self.step_end[self.token_step]

    @property
    def token_runs(self) -> TokenRuns:
        """The token steps as runs of consecutive steps: those given, or, for a result given its
        column, found in it on the first read (then held in its place, the column kept in them)."""
        held = self.__dict__["token_step"]
        if not isinstance(held, TokenRuns):
            held = self.__dict__["token_step"] = TokenRuns.of_column(held, self.token_offsets[:-1])
        return held

    @property
    def first_token_step(self) -> np.ndarray:
        """The step that made each request's first token (from `token_runs`: a request's first run)."""
        return self.token_runs.start[self.token_runs.first_runs(self.token_offsets)]

    @property
    def last_token_step(self) -> np.ndarray:
        """The step that made each request's last token: the last step of its last run, the run
        before the one the next request's first slot starts (or before the end)."""
        runs = self.token_runs
        return runs.last[np.searchsorted(runs.slot, self.token_offsets[1:]) - 1]

    @property
    def first_token_s(self) -> np.ndarray:
        return self.step_end[self.first_token_step]

    @property
    def last_token_s(self) -> np.ndarray:
        return self.step_end[self.last_token_step]

    def tokens_of(self, i: int) -> np.ndarray:
        """Times of request i's tokens."""
        return self.step_end[self.steps_of(i)]

    def steps_of(self, i: int) -> np.ndarray:
        """Batch indices that produced request i's tokens."""
        return self.token_step[self.token_offsets[i]:self.token_offsets[i + 1]]

    def fed_steps(self) -> list[list[tuple[int, int]]]:
        """A traced run's works per request (by its place in `requests`): `(step, n_new)` for each
        step it ran in, in step order, `n_new` the tokens that step fed it (the trace alone keeps
        them; a caller refuses a run without one)."""
        assert self.trace is not None, "fed_steps reads the run's trace"
        place = {r.req_id: i for i, r in enumerate(self.requests)}
        fed: list[list[tuple[int, int]]] = [[] for _ in self.requests]
        for step in self.trace:
            for rid, n_new, _ in step.works:
                fed[place[rid]].append((step.index, n_new))
        return fed
