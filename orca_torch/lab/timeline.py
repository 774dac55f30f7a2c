"""The lecture's timeline charts: who runs in which iteration (lecture §4.1, code 02 demo 4).

    P = prefill (the step that produces the first token), D = decode, R = recompute (after a
    preemption dropped its K/V: prompt and tokens so far fed again, making the next token),
    · = arrived and waiting (for its first step, or for its next after a preemption or when the
    policy passed it over), ~ = in flight (a pipelined run: its step is still in a later stage),
    - = a seat held by a request that already finished (static batching), blank = not there.

A row is drawn from the steps that produced the request's tokens: a chunked prefill's earlier
chunks produce none, so they show as waiting (·) before its P (a chunked recompute's, before its
R). Telling R from D (a swapped-out request comes back with a decode) takes the run's trace, so a
run with a preempted request is charted only if it kept one (`Engine(..., trace=True)`).

`timeline_chart(result)` draws any run, one column per iteration (step), on any clock: a request's
arrival is given as the first iteration that starts at or after it, so on a seconds clock, or an
iteration clock that jumped over idle time to an arrival, it is still counted in the chart's
columns (on an iteration clock with no idle time it is the arrival time). `demo4()` runs the lecture's
scenario on the real torch model: six requests arriving at iterations 0, 0, 1, 2, 3, 6 with output
lengths 6, 3, 9, 2, 5, 3 (the prefill produces the first token) and max_bs = 3. Continuous
batching finishes in 10 iterations, static batching in 18, and continuous batching's tokens are
exactly those each request produces alone (`generate_alone`): scheduling changes *when* a token is
computed, never *what* it is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orca_torch.checks import brief, check_instance, is_int
from orca_torch.core.engine import Engine
from orca_torch.core.memory import UnlimitedMemory, slots_to_finish
from orca_torch.core.request import Request
from orca_torch.core.run_result import RunResult
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.lab.baselines import static_batching

DEMO4_ARRIVALS = (0, 0, 1, 2, 3, 6)
DEMO4_OUTPUTS = (6, 3, 9, 2, 5, 3)


def timeline_rows(result: RunResult) -> list[str]:
    """One string per request, one character per iteration (see the module docstring)."""
    check_instance("result", result, RunResult)
    fed = _tokens_fed_by_preempted(result)
    start, end = result.step_start, result.step_end
    rows = []
    for i in range(result.n):
        cells = [" "] * result.n_steps
        steps = [int(s) for s in result.steps_of(i)]
        first, last = steps[0], steps[-1]
        for s in range(result.n_steps):
            if s < first and start[s] >= result.arrival_s[i]:
                cells[s] = "·"
            elif s > last and end[s] <= result.release_s[i]:
                cells[s] = "-"
        cells[first] = "P"
        for prev, s in zip(steps, steps[1:]):
            for t in range(prev + 1, s):
                cells[t] = "~" if start[t] < end[prev] else "·"
            recomputed = i in fed and sum(fed[i].get(t, 0) for t in range(prev + 1, s + 1)) > 1
            cells[s] = "R" if recomputed else "D"
        rows.append("".join(cells))
    return rows


def _tokens_fed_by_preempted(result: RunResult) -> dict[int, dict[int, int]]:
    """For each preempted request (by its place in the run), the tokens it was fed in each step it
    ran: a decode feeds one, a recompute the prompt and the tokens so far."""
    preempted = [int(i) for i in np.flatnonzero(result.n_preemptions)]
    if not preempted:
        return {}
    if result.trace is None:
        raise ValueError(f"request {brief(result.requests[preempted[0]].req_id)} was preempted, and whether it came "
                         "back with a recompute or a decode only the run's trace says: chart a run that kept one "
                         "(Engine(..., trace=True))")
    fed = result.fed_steps()
    return {i: dict(fed[i]) for i in preempted}


def timeline_chart(result: RunResult, title: str) -> str:
    """The chart as the lecture prints it: a header of iteration digits, then one row per request, named
    by its id (`r5` for the id 5, as the lecture names them; a text id as it is), with the iteration it
    arrived before and the one that made its last token."""
    rows = timeline_rows(result)
    n_steps = result.n_steps
    arrived = np.searchsorted(result.step_start, result.arrival_s, side="left")
    names = [f"r{r.req_id}" if is_int(r.req_id) else str(r.req_id) for r in result.requests]
    width = max(map(len, names), default=2)          # every label as wide, so the columns stay iterations
    lines = [f"{title} ({n_steps} iterations)",
             " " * (width + 4) + "".join(str(s % 10) for s in range(n_steps))]
    for i, row in enumerate(rows):
        last = int(result.steps_of(i)[-1])
        lines.append(f"  {names[i]:<{width}}  {row}   arrived @{arrived[i]}, last token @{last}")
    return "\n".join(lines)


@dataclass
class Demo4:
    """Demo 4's outcome: both charts, their lengths, and the token check."""

    continuous_chart: str
    static_chart: str
    continuous_iterations: int
    static_iterations: int
    continuous_rows: list[str]
    static_rows: list[str]
    tokens: dict
    tokens_match: bool
    static_tokens_match: bool


def _demo4_requests(vocab: int, seed: int) -> list[Request]:
    """The six requests of demo 4 with seeded random prompts of 4 to 12 tokens (`seed` checked by `demo4`)."""
    rng = np.random.default_rng(seed)
    prompt_lens = tuple(int(x) for x in rng.integers(4, 13, size=len(DEMO4_ARRIVALS)))
    reqs = []
    for i, (a, o, p) in enumerate(zip(DEMO4_ARRIVALS, DEMO4_OUTPUTS, prompt_lens)):
        reqs.append(Request(i, float(a), p, o, prompt_ids=rng.integers(0, vocab, size=p).tolist()))
    return reqs


def demo4(model: str = "tiny", seed: int = 0, max_bs: int = 3, device: str = "cpu") -> Demo4:
    """Run demo 4 on the real torch model (preset `tiny` or `mini`) with an iteration clock."""
    from orca_torch.model.orca_model import OrcaModel, generate_alone
    from orca_torch.model.torch_executor import TorchExecutor

    m = OrcaModel(model, seed=seed, device=device)     # checks the seed
    results = {}
    for name, cfg in (("continuous", SchedulerConfig(max_bs=max_bs)), ("static", static_batching(max_bs))):
        reqs = _demo4_requests(m.spec.vocab, seed)
        kv = m.new_kv(sum(map(slots_to_finish, reqs)))
        engine = Engine(TorchExecutor(m, kv, clock="iterations"), UnlimitedMemory(), cfg)
        results[name] = engine.run(reqs)
    reqs = _demo4_requests(m.spec.vocab, seed)
    reference = {r.req_id: generate_alone(m, r.prompt_ids, r.output_len) for r in reqs}
    cont, stat = results["continuous"], results["static"]
    return Demo4(
        continuous_chart=timeline_chart(cont, "continuous batching (iteration-level scheduling)"),
        static_chart=timeline_chart(stat, "static batching (the whole batch in, the whole batch out)"),
        continuous_iterations=cont.n_steps, static_iterations=stat.n_steps,
        continuous_rows=timeline_rows(cont), static_rows=timeline_rows(stat),
        tokens=cont.output_ids,
        tokens_match=cont.output_ids == reference, static_tokens_match=stat.output_ids == reference)


def format_demo4(d: Demo4) -> str:
    """The two charts and the token check, ready to print."""
    verdict = ("identical to generating each request alone" if d.tokens_match
               else "DIFFERENT from generating each request alone")
    return (f"{d.continuous_chart}\n\n{d.static_chart}\n\n"
            f"continuous batching's tokens: {verdict} "
            f"({sum(len(v) for v in d.tokens.values())} tokens, {len(d.tokens)} requests)")
