"""A run as Chrome trace-event JSON, to open in Perfetto (ui.perfetto.dev) or chrome://tracing.

The same format torch's profiler and Vidur export, so a run of this project sits beside theirs.
Two processes in the file:

- "engine": one lane per worker (pipeline stage, lecture §4.4; one lane without pipelining), each
  step a span named by its batch index with its batch size, new tokens, prefills and decodes as
  arguments. A simulated pipeline (`n_workers > 1`) has a lane per stage of its executor, each
  step drawn in each stage when it was there (`RunResult.stage_start`: it waits at a stage the
  batch before it still holds); an asynchronous run (real workers), whose stages' times the result
  does not keep, has a lane per batch in flight (`n_workers`), each step drawn whole, from its
  launch to its return, on lane `step % n_workers` (batches return in order, so a lane's steps
  never overlap).
- "requests": one lane per request, a span from its arrival to its last token (TTFT, TPOT, lengths
  as arguments) and an instant event at its first token.

Times are whole microseconds from the run's clock origin (the first arrival), so that every viewer
reads a step's end and the next step's start as the same instant.

Built from the `RunResult` fields every engine keeps (`step_start`, `step_end`, `step_n_seqs`,
`step_n_tokens`, `arrival_s`, the token times), plus the per-step works of `trace` when the run kept
them (`trace=True`): then a prefill is any work on a request's prompt (a chunk included) and a
decode any other. Without them, a step's prefills are the prompts that made their first token in
it and its decodes the other tokens it made. That reading holds only where every work of the step
made a token (its sequences equal its new tokens, static batching's idle seats aside; a prompt
chunk short of its prompt's end makes none) and, in a run that preempted, no work was a recompute
(which makes a token that is not a first one: the step then feeds more tokens than its whole
prompts and decodes; in a chunked run nothing tells). Elsewhere each count says `UNKNOWN` rather
than a wrong number.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from orca_torch.checks import brief, check_instance, quoted_path
from orca_torch.core.run_result import RunResult

ENGINE_PID, REQUESTS_PID = 1, 2


def _us(seconds: float) -> int:
    return round(float(seconds) * 1e6)


def _span(start: float, end: float) -> dict:
    """`ts` and `dur` of a span in whole microseconds, both from its ends on that grid. Whole numbers
    because every viewer reads them exactly: Perfetto truncates ts * 1000 and dur * 1000 to
    nanoseconds each, a script adds ts + dur as floats, and with fractions either could put a span's
    end past the next one's start on its lane, drawing the next nested inside it."""
    t0, t1 = _us(start), _us(end)
    return {"ts": t0, "dur": t1 - t0}


def _meta(pid: int, tid: int | None, kind: str, name: str) -> dict:
    ev = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    if tid is not None:
        ev["tid"] = tid
    return ev


UNKNOWN = "unknown (run with trace=True)"
"""A step's prefills and decodes in the trace where the run kept no works to count them from."""


class StepPhases(NamedTuple):
    """Per step: its prefills and decodes, and whether they are known (`known` False: the two are 0)."""

    prefills: np.ndarray
    decodes: np.ndarray
    known: np.ndarray


def _step_phases(result: RunResult) -> StepPhases:
    """Each step's prefills and decodes: from the kept works if the run has them, else from token times
    where those tell (see the module docstring)."""
    n_steps = result.n_steps
    works = getattr(result, "trace", None)
    if works is not None and len(works) == n_steps:
        prompt = {r.req_id: r.prompt_len for r in result.requests}
        pre = np.zeros(n_steps, dtype=np.int64)
        dec = np.zeros(n_steps, dtype=np.int64)
        for i, entry in enumerate(works):
            for rid, _n_new, n_past in entry[-1]:
                if n_past < prompt[rid]:
                    pre[i] += 1
                else:
                    dec[i] += 1
        return StepPhases(pre, dec, np.ones(n_steps, dtype=bool))
    made = np.bincount(result.token_step, minlength=n_steps)[:n_steps]
    first = result.token_step[result.token_offsets[:-1]]
    pre = np.bincount(first, minlength=n_steps)[:n_steps]
    dec = made - pre
    if result.config.static and not result.n_preemptions.any():
        known = np.ones(n_steps, dtype=bool)    # whole prompts and decodes only; idle seats are in the seats
    else:
        known = result.step_n_seqs == made
        if result.n_preemptions.any():
            fed = np.bincount(first, weights=result.prompt_len, minlength=n_steps)[:n_steps] + dec
            known &= (result.step_n_tokens == fed) & (not result.config.chunked_prefill)
    return StepPhases(np.where(known, pre, 0), np.where(known, dec, 0), known)


def _trace_events(result: RunResult) -> list[dict]:
    """The trace events of one run (see the module docstring)."""
    entered = getattr(result, "stage_start", None)
    n_workers = max(1, int(getattr(result.config, "n_workers", 1)))
    lanes = n_workers if entered is None else entered.shape[1]
    events = [_meta(ENGINE_PID, None, "process_name", "engine"), _meta(REQUESTS_PID, None, "process_name", "requests")]
    name = "stage" if entered is not None else "in flight"
    for k in range(lanes):
        events.append(_meta(ENGINE_PID, k, "thread_name", f"{name} {k}" if lanes > 1 else "worker"))
    pre, dec, known = _step_phases(result)
    for i in range(result.n_steps):
        start, end = float(result.step_start[i]), float(result.step_end[i])
        if entered is None:
            spans = {i % n_workers: (start, end)}
        else:
            d = end - float(entered[i, -1])
            spans = {k: (float(s), float(s) + d) for k, s in enumerate(entered[i])}
        args = {"batch_size": int(result.step_n_seqs[i]), "tokens": int(result.step_n_tokens[i]),
                **({"prefills": int(pre[i]), "decodes": int(dec[i])} if known[i] else
                   {"prefills": UNKNOWN, "decodes": UNKNOWN})}
        for k, (t0, t1) in spans.items():
            events.append({"ph": "X", "pid": ENGINE_PID, "tid": k, "name": f"step {i}", "cat": "step",
                           **_span(t0, t1), "args": args})
    first, last = result.first_token_s, result.last_token_s
    for i, req in enumerate(result.requests):
        a, f, z = float(result.arrival_s[i]), float(first[i]), float(last[i])
        n_out = int(result.token_offsets[i + 1] - result.token_offsets[i])
        tpot = (z - f) / (n_out - 1) if n_out > 1 else None
        events.append(_meta(REQUESTS_PID, i, "thread_name", f"request {req.req_id}"))
        events.append({"ph": "X", "pid": REQUESTS_PID, "tid": i, "name": f"request {req.req_id}", "cat": "request",
                       **_span(a, z),
                       "args": {"prompt_len": int(result.prompt_len[i]), "output_len": int(result.output_len[i]),
                                "ttft_s": f - a, "tpot_s": tpot}})
        events.append({"ph": "i", "s": "t", "pid": REQUESTS_PID, "tid": i, "name": "first token", "cat": "token",
                       "ts": _us(f)})
    return events


def to_chrome_trace(result: RunResult, path: str | Path) -> Path:
    """Write `result` (a `RunResult`) to `path` as Chrome trace-event JSON; returns the path."""
    check_instance("result", result, RunResult)
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"path must be a file name (a str or a Path), got {brief(path)}")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"path {quoted_path(path)} is a directory; give a file name, "
                         f"e.g. {quoted_path(path / 'trace.json')}")
    doc = {"traceEvents": _trace_events(result), "displayTimeUnit": "ms",
           "otherData": {"source": "orca-torch", "n_requests": result.n, "n_steps": result.n_steps,
                         "n_workers": int(getattr(result.config, "n_workers", 1))}}
    try:  # (a folder under a file, or one not writable: said as the trace it is, not as an OSError)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc))
    except OSError as e:
        raise ValueError(f"cannot write the trace {quoted_path(path)}: {e.strerror or e}") from None
    return path
