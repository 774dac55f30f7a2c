"""The iteration-level engine: schedule -> execute -> record, until every request is done (lecture §4.1, §5.1).

`Engine(executor, memory, config).run(requests)` drives Orca's scheduler (`scheduler.py`) with any
executor: the paper GPU (`CostModelExecutor`, a simulated clock) or the real torch model
(`TorchExecutor`, the wall clock, CUDA events, or iterations). It records when every token of every
request came out — in preallocated numpy arrays, not per-token objects — and the occupancy of
each step. Finished requests leave at once and free their memory; when an on-demand memory
manager cannot grow, the scheduler preempts the latest-arrived running request (recompute).

Time model:
- `n_workers = 1`: a batch starts when the previous one ends; a request that arrives during a
  step is seen at the next step (it waits at most one iteration, §4.1).
- `n_workers = P > 1` (Orca's pipelining, §4.4): a batch of duration `d` occupies each of P stages
  for `d / P` (or the executor's `stage_s`); the next batch is injected when the first stage frees,
  as long as fewer than P batches are in flight, and batches leave in order
  (`end = max(start + d, previous end)`). Its tokens exist when it leaves.
- Fast-forward: when a step is a pure decode, the scheduler says how many identical steps may follow
  (until the next finish, or memory runs out) and, unless an arrival could join earlier, the engine
  prices them in one numpy call and records them at once. The timestamps are exactly those of the
  step-by-step loop (the same float additions, in order); this is what makes a 600-request
  simulation take milliseconds (issue 6).

Bad input is refused before anything changes: a request that is malformed, longer than the
context, unsorted in arrival, or whose reservation could never fit raises ValueError (or, with
`on_invalid="reject"`, is marked REJECTED and reported) and the engine stays usable.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from .executor import Executor
from .memory import MemoryManager, occupancy_denominator
from .request import Request, Status
from .scheduler import Batch, Scheduler, SchedulerConfig


@dataclass
class RunResult:
    """Everything a run produced; `metrics.summarize` turns it into the lecture's figures.

    Per request (in arrival order): `arrival_s`, `prompt_len`, `output_len`, `release_s` (memory and
    seat given back), `n_preemptions`; tokens flat: request i's tokens are
    `token_times[token_offsets[i]:token_offsets[i+1]]`, made by batches `token_step[...]`.
    Per step: start, end, sequences, tokens, K/V slots reserved (occupied) and used (holding K/V).
    """

    requests: list[Request]
    rejected: list[tuple[Request, str]]
    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    token_offsets: np.ndarray
    token_times: np.ndarray
    token_step: np.ndarray
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
    trace: list | None = field(default=None, repr=False)

    @property
    def n(self) -> int:
        return len(self.requests)

    @property
    def n_steps(self) -> int:
        return len(self.step_end)

    @property
    def first_token_s(self) -> np.ndarray:
        return self.token_times[self.token_offsets[:-1]]

    @property
    def last_token_s(self) -> np.ndarray:
        return self.token_times[self.token_offsets[1:] - 1]

    def tokens_of(self, i: int) -> np.ndarray:
        """Times of request i's tokens."""
        return self.token_times[self.token_offsets[i]:self.token_offsets[i + 1]]

    def steps_of(self, i: int) -> np.ndarray:
        """Batch indices that produced request i's tokens."""
        return self.token_step[self.token_offsets[i]:self.token_offsets[i + 1]]

    @property
    def output_ids(self) -> dict:
        """Generated token ids per request id (torch executor only)."""
        return {r.req_id: list(r.output_ids or []) for r in self.requests}


class _StepLog:
    """Per-step columns, appended cheaply (Python lists for single steps, one tuple per decode run)
    and assembled into numpy arrays once, at the end."""

    def __init__(self) -> None:
        self.n = 0
        self.single: list[tuple] = []   # (index, start, end, n_seqs, n_tokens, reserved, used)
        self.runs: list[tuple] = []     # (index, m, start, ends[0..m-1], k, res0, dres, used0, dused)

    def add(self, start: float, end: float, n_seqs: int, n_tokens: int, reserved: int, used: int) -> None:
        self.single.append((self.n, start, end, n_seqs, n_tokens, reserved, used))
        self.n += 1

    def add_run(self, start: float, ends: np.ndarray, k: int, res0: int, res1: int, used0: int,
                used1: int) -> None:
        """`m = len(ends)` decode steps of `k` sequences, the first starting at `start`."""
        m = len(ends)
        d = m - 1 if m > 1 else 1
        self.runs.append((self.n, m, start, ends, k, res0, (res1 - res0) // d, used0, (used1 - used0) // d))
        self.n += m

    def columns(self) -> tuple[np.ndarray, ...]:
        """start, end (float) and n_seqs, n_tokens, reserved, used (int) per step."""
        n = self.n
        f = np.zeros((2, n))
        i = np.zeros((4, n), dtype=np.int64)
        if self.single:
            s = np.array(self.single, dtype=float)
            idx = s[:, 0].astype(np.int64)
            f[:, idx] = s[:, 1:3].T
            i[:, idx] = s[:, 3:7].T.astype(np.int64)
        if self.runs:
            first = np.array([r[0] for r in self.runs], dtype=np.int64)
            ms = np.array([r[1] for r in self.runs], dtype=np.int64)
            idx = np.repeat(first, ms) + (np.arange(ms.sum()) - np.repeat(np.cumsum(ms) - ms, ms))
            within = idx - np.repeat(first, ms)
            ends = np.concatenate([r[3] for r in self.runs])
            starts = np.empty_like(ends)
            starts[1:] = ends[:-1]
            starts[np.cumsum(ms) - ms] = [r[2] for r in self.runs]
            f[0, idx], f[1, idx] = starts, ends
            k = np.repeat(np.array([r[4] for r in self.runs], dtype=np.int64), ms)
            i[0, idx] = k
            i[1, idx] = k
            for col, j in ((2, 5), (3, 7)):
                base = np.repeat(np.array([r[j] for r in self.runs], dtype=np.int64), ms)
                step = np.repeat(np.array([r[j + 1] for r in self.runs], dtype=np.int64), ms)
                i[col, idx] = base + step * within
        return f[0], f[1], i[0], i[1], i[2], i[3]


class Engine:
    """Drives the scheduler with an executor; `run(requests)` returns a `RunResult`.

    `max_context` is the serving context (default: the model's); the engine hands it to the memory
    manager as the reservation of a request without `max_tokens` (Orca (Max) reserves 8192 for
    Llama-3-8B). `trace=True` keeps every batch's `(req_id, n_new, n_past)` list for tests and charts;
    `fast_forward=False` prices every step one by one (the reference the fast path must equal).
    """

    def __init__(self, executor: Executor, memory: MemoryManager, config: SchedulerConfig | None = None,
                 max_context: int | None = None, trace: bool = False, fast_forward: bool = True) -> None:
        self.config = config or SchedulerConfig()
        model_ctx = executor.max_context
        if max_context is None:
            max_context = model_ctx
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
            raise ValueError(f"max_context must be an integer >= 2 (the executor gives none), got {max_context!r}")
        if model_ctx is not None and max_context > model_ctx:
            raise ValueError(f"max_context {max_context} exceeds the model's context {model_ctx}")
        self.max_context = max_context
        self.executor = executor
        self.memory = memory
        memory.default_max_tokens = max_context
        self.scheduler = Scheduler(self.config, memory)
        self.trace = trace
        self.fast_forward = fast_forward

    # ---- submission --------------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raise ValueError (saying what is wrong) unless `req` can be served by this engine."""
        if not isinstance(req, Request):
            raise ValueError(f"expected a Request, got {type(req).__name__}")
        req.check_context(self.max_context)
        self.memory.check(req)
        cfg = self.config
        if cfg.order == "spf" and req.predicted_output is None:
            raise ValueError(f"request {req.req_id!r} has no predicted_output, which order='spf' needs "
                             "(see workload.with_predictions)")
        b = cfg.max_num_batched_tokens
        if b is not None and not cfg.chunked_prefill:
            need = req.total_len if self.memory.can_run_out else req.prompt_len
            if need > b:
                raise ValueError(f"request {req.req_id!r}: a prefill of {need} tokens can never fit the step "
                                 f"budget max_num_batched_tokens={b} (enable chunked_prefill)")
        self.executor.check(req)

    def _intake(self, requests: Sequence[Request], on_invalid: str) -> tuple[list[Request], list]:
        if on_invalid not in ("raise", "reject"):
            raise ValueError(f"on_invalid must be 'raise' or 'reject', got {on_invalid!r}")
        requests = list(requests)
        if not requests:
            raise ValueError("no requests to run")
        seen: set = set()
        prev = -math.inf
        for r in requests:
            if not isinstance(r, Request):
                raise ValueError(f"expected Request objects, got {type(r).__name__}")
            if r.req_id in seen:
                raise ValueError(f"duplicate req_id {r.req_id!r}")
            seen.add(r.req_id)
            if not math.isfinite(r.arrival_s):
                raise ValueError(f"request {r.req_id!r}: arrival_s must be finite, got {r.arrival_s}")
            if r.arrival_s < prev:
                raise ValueError(f"requests must be sorted by arrival: {r.req_id!r} arrives at {r.arrival_s} "
                                 f"after one at {prev}")
            prev = r.arrival_s
        accepted, rejected = [], []
        for r in requests:
            try:
                self.check(r)
            except ValueError as e:
                if on_invalid == "raise":
                    raise
                rejected.append((r, str(e)))
                continue
            accepted.append(r)
        for r in accepted:
            r.reset()
        for r, _ in rejected:
            r.reset()
            r.status = Status.REJECTED
        return accepted, rejected

    # ---- the run loop --------------------------------------------------------------------------
    def run(self, requests: Sequence[Request], on_invalid: Literal["raise", "reject"] = "raise") -> RunResult:
        """Serve `requests` (sorted by arrival) to completion."""
        reqs, rejected = self._intake(requests, on_invalid)
        sched, ex, mem = self.scheduler, self.executor, self.memory
        P = self.config.n_workers
        ex.reset()
        sched.start(reqs)
        log = _StepLog()
        trace: list | None = [] if self.trace else None
        n = len(reqs)
        arr = [r.arrival_s for r in reqs]
        nxt, t = 0, 0.0
        inflight: deque = deque()
        stage_free = last_end = 0.0
        fast = self.fast_forward and ex.can_fast_forward and P == 1
        try:
            while sched.n_finished < n:
                while inflight and inflight[0][0] <= t:
                    _, b, toks = inflight.popleft()
                    self._complete(b, toks)
                while nxt < n and arr[nxt] <= t:
                    sched.add(reqs[nxt])
                    nxt += 1
                batch = None
                if len(inflight) < P and t >= stage_free:
                    batch = sched.schedule(log.n)
                if batch is None:
                    if sched.n_finished == n:
                        break
                    cands = [inflight[0][0]] if inflight else []
                    if nxt < n:
                        cands.append(arr[nxt])
                    if stage_free > t:
                        cands.append(stage_free)
                    if not cands:
                        raise RuntimeError(f"scheduler stalled with {n - sched.n_finished} unfinished requests "
                                           f"at t={t} (a bug: every request was checked at submission)")
                    t = float(min(cands))
                    continue
                for r in batch.preempted:
                    ex.release(r)
                if batch.totals.n_seqs == 0:
                    continue
                if fast and batch.pure_decode:
                    t = self._decode_run(batch, t, log, trace, arr[nxt] if nxt < n else None)
                    continue
                res = ex.execute(batch)
                d = float(res.duration_s)
                if not (d >= 0 and math.isfinite(d)):
                    raise RuntimeError(f"executor returned a bad step duration {d!r}")
                end = max(t + d, last_end)
                log.add(t, end, batch.totals.n_seqs, batch.totals.n_tokens, mem.slots_reserved, mem.slots_used)
                if trace is not None:
                    trace.append((batch.index, t, end, [(r.req_id, nn, p) for r, nn, p in batch.works()]))
                last_end = end
                if P == 1:
                    t = end
                    self._complete(batch, res.tokens)
                else:
                    inflight.append((end, batch, res.tokens))
                    stage_free = t + (res.stage_s if res.stage_s is not None else d / P)
        except BaseException:
            ex.reset()
            raise
        return self._result(reqs, rejected, log, trace, mem)

    def _decode_run(self, batch: Batch, t: float, log: _StepLog, trace: list | None,
                    next_arrival: float | None) -> float:
        """Record `batch` and as many identical decode steps after it as nothing can interrupt."""
        sched, mem = self.scheduler, self.memory
        ex, k, ctx = self.executor, batch.decode_k, batch.decode_ctx
        m = sched.decode_run_limit(batch) + 1
        join = next_arrival is not None and m > 1 and sched.arrival_may_join()
        if join:  # steps only get longer as contexts grow: no need to price past the arrival
            d0 = ex.step_time(batch.totals)
            if d0 > 0:
                m = min(m, int((next_arrival - t) / d0) + 2)
        ds = ex.decode_durations(k, ctx, m)
        ds[0] += t          # the same float additions as t += d, step by step
        ends = np.cumsum(ds)
        if join:
            m = min(m, int(np.searchsorted(ends, next_arrival, side="left")) + 1)
        res0, used0 = mem.slots_reserved, mem.slots_used
        sched.extend(batch, m - 1)
        log.add_run(t, ends[:m], batch.decode_k, res0, mem.slots_reserved, used0, mem.slots_used)
        if trace is not None:
            works = [(r.req_id, nn, p) for r, nn, p in batch.works()]
            for j in range(m):
                trace.append((batch.index + j, float(ends[j - 1]) if j else t, float(ends[j]),
                              [(rid, nn, p + j) for rid, nn, p in works]))
        self._complete(batch, None)
        return float(ends[m - 1])

    def _complete(self, batch: Batch, tokens: list[int] | None) -> None:
        for r in self.scheduler.complete(batch, tokens):
            self.executor.release(r)

    def _result(self, reqs: list[Request], rejected: list, log: _StepLog, trace: list | None,
                mem: MemoryManager) -> RunResult:
        sched = self.scheduler
        token_step = sched.tokens.batch
        if (token_step < 0).any():
            raise RuntimeError("some tokens were never produced (a bug)")
        if mem.slots_reserved or mem.slots_used:
            raise RuntimeError(f"memory not freed at the end: {mem!r} (a bug)")
        start, end, n_seqs, n_tokens, reserved, used = log.columns()
        return RunResult(
            requests=reqs, rejected=rejected,
            arrival_s=np.array([r.arrival_s for r in reqs]),
            prompt_len=np.array([r.prompt_len for r in reqs], dtype=np.int64),
            output_len=np.array([r.output_len for r in reqs], dtype=np.int64),
            token_offsets=sched.tokens.offsets, token_times=end[token_step], token_step=token_step,
            release_s=np.array([end[sched.release_batch[r.req_id]] for r in reqs]),
            n_preemptions=np.array([r.n_preemptions for r in reqs], dtype=np.int64),
            step_start=start, step_end=end, step_n_seqs=n_seqs, step_n_tokens=n_tokens,
            step_reserved=reserved, step_used=used,
            n_slots=occupancy_denominator(mem), config=self.config, trace=trace)
