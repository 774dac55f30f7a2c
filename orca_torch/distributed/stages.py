"""What the workers' own timestamps say about a run: per-stage busy intervals, busy fraction, how
much the stages overlapped, and a per-stage timeline chart (lecture §4.4's pipelining picture).

`records` are the executor's `StageRecord`s (one per worker per batch). A stage is busy from the
moment its input is in hand (`start_s`) until its output is handed on (`end_s`); its tensor-
parallel ranks work in lockstep, so tp rank 0 speaks for the stage.
"""
from __future__ import annotations

from typing import Sequence

from orca_torch.distributed.executor import StageRecord


def intervals(records: Sequence[StageRecord], stage: int) -> list[tuple[float, float, int]]:
    """`(start, end, batch index)` of one stage, in time order."""
    return sorted((r.start_s, r.end_s, r.index) for r in records if r.stage == stage and r.tp_rank == 0)


def span(records: Sequence[StageRecord]) -> tuple[float, float]:
    """First start to last end over every stage."""
    return min(r.start_s for r in records), max(r.end_s for r in records)


def cpu_share(records: Sequence[StageRecord], stage: int) -> float:
    """CPU time over busy time of a stage: below 1 when its process waited for a core while busy."""
    rs = [r for r in records if r.stage == stage and r.tp_rank == 0]
    busy = sum(r.busy_s for r in rs)
    return sum(r.cpu_s for r in rs) / busy if busy > 0 else 0.0


def busy_fraction(records: Sequence[StageRecord], stage: int) -> float:
    t0, t1 = span(records)
    return sum(e - s for s, e, _ in intervals(records, stage)) / (t1 - t0) if t1 > t0 else 0.0


def overlap(records: Sequence[StageRecord], a: int, b: int) -> list[tuple[int, int, float]]:
    """Every pair (batch on stage a, batch on stage b, seconds both were busy) with a positive overlap."""
    out = []
    for s1, e1, i in intervals(records, a):
        for s2, e2, j in intervals(records, b):
            both = min(e1, e2) - max(s1, s2)
            if both > 0:
                out.append((i, j, both))
    return out


def overlap_s(records: Sequence[StageRecord], a: int, b: int) -> float:
    return sum(x for _, _, x in overlap(records, a, b))


def max_in_flight(records: Sequence[StageRecord], n_stages: int) -> int:
    """The most batches that were inside the pipeline at once (from first-stage start to last-stage end)."""
    first = {i: s for s, _, i in intervals(records, 0)}
    last = {i: e for _, e, i in intervals(records, n_stages - 1)}
    events = sorted([(first[i], 1) for i in first] + [(last[i], -1) for i in last if i in first])
    now = most = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


def chart(records: Sequence[StageRecord], n_stages: int, width: int = 96,
          window: tuple[float, float] | None = None) -> list[str]:
    """One text row per stage: each column a slice of time showing the batch busy there (its index
    mod 10), '.' when idle — pipelining shows as consecutive batches side by side on the stages."""
    t0, t1 = window or span(records)
    dt = (t1 - t0) / width
    rows = []
    for st in range(n_stages):
        cells = ["."] * width
        for s, e, i in intervals(records, st):
            a, b = max(s, t0), min(e, t1)
            if b <= a:
                continue
            for c in range(int((a - t0) / dt), min(width, int((b - t0) / dt) + 1)):
                lo, hi = t0 + c * dt, t0 + (c + 1) * dt
                share = min(hi, b) - max(lo, a)
                if share > 0 and (share >= 0.5 * dt or cells[c] == "."):
                    cells[c] = str(i % 10)
        rows.append(f"stage {st} |{''.join(cells)}|")
    return rows


def handoffs(records: Sequence[StageRecord], a: int, b: int) -> list[float]:
    """Per batch, how long stage `b` started after stage `a` handed the batch on, beyond any time
    stage `b` was still busy with its previous batch: the cost of the handoff itself."""
    out, prev_end = [], None
    handed_on = {i: e for _, e, i in intervals(records, a)}    # batch -> stage a's end
    for s, e, i in intervals(records, b):
        if i in handed_on:
            ready = handed_on[i] if prev_end is None else max(handed_on[i], prev_end)
            out.append(s - ready)
        prev_end = e
    return out
