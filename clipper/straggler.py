"""Straggler mitigation: answer at the deadline with what has arrived, or a default (lecture §2.1).

An ensemble is as slow as its slowest member. Clipper does not wait for it: at the latency
deadline it combines the predictions that have arrived (Exp4 renormalises their weights, and the
missing weight lowers the answer's confidence); if none has, it returns the application's default
output. The answer is always on time; its quality degrades instead of its latency.

`answer_at_deadline` is the rule on given arrival times (simulations, tests); `StragglerEnsemble`
runs real containers, each on a worker of its own, and stops waiting at the deadline.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Sequence

from orca_torch.checks import check_instance, check_items, check_real

from .container import ModelContainer, checked_predict
from .selection import Exp4


@dataclass(frozen=True)
class EnsembleAnswer:
    output: Any
    confidence: float            # share of the ensemble weight that answered; 0 for the default
    used: tuple[str, ...]        # models whose predictions arrived by the deadline
    missed: tuple[str, ...]      # stragglers (and models that failed)
    is_default: bool


def _check_deadline(deadline_ms: float) -> float:
    return check_real("deadline_ms", deadline_ms, 0.0, lo_open=True, unit="milliseconds")


def _combine(names: Sequence[str], arrived: list[Any], policy: Exp4, default: Any) -> EnsembleAnswer:
    used = tuple(n for n, p in zip(names, arrived) if p is not None)
    missed = tuple(n for n, p in zip(names, arrived) if p is None)
    if not used:
        return EnsembleAnswer(default, 0.0, (), missed, True)
    c = policy.combine(arrived)
    return EnsembleAnswer(c.output, c.confidence, used, missed, False)


def answer_at_deadline(names: Sequence[str], predictions: Sequence[Any], arrival_ms: Sequence[float],
                       deadline_ms: float, policy: Exp4, default: Any) -> EnsembleAnswer:
    """Combine the predictions whose arrival time is within the deadline; the default if none is."""
    deadline_ms = _check_deadline(deadline_ms)
    check_instance("policy", policy, Exp4)
    for what, v in (("names", names), ("predictions", predictions), ("arrival_ms", arrival_ms)):
        if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
            raise ValueError(f"{what} must be a list with one entry per model ({policy.n}), got {v!r}")
    if not (len(names) == len(predictions) == len(arrival_ms) == policy.n):
        raise ValueError(f"names, predictions and arrival_ms need one entry per model ({policy.n}), got "
                         f"{len(names)}, {len(predictions)}, {len(arrival_ms)}")
    times = [check_real(f"arrival_ms[{i}]", t, 0.0, unit="milliseconds") for i, t in enumerate(arrival_ms)]
    arrived = [p if t <= deadline_ms else None for p, t in zip(predictions, times)]
    return _combine(names, arrived, policy, default)


class StragglerEnsemble:
    """Real containers queried in parallel; the answer leaves at `deadline_ms` whatever happened.

    Each container has a worker of its own and serves one call at a time, as a model container
    does: one still busy with an earlier call is not sent the next (it misses it), so a straggler's
    backlog never holds up the others."""

    def __init__(self, models: Sequence[ModelContainer], policy: Exp4, deadline_ms: float,
                 default: Any) -> None:
        models = check_items("models", models, ModelContainer)
        check_instance("policy", policy, Exp4)
        if len(models) != policy.n:
            raise ValueError(f"the policy weighs {policy.n} models but {len(models)} were given")
        self.models = list(models)
        self.policy = policy
        self.deadline_ms = _check_deadline(deadline_ms)
        self.default = default
        self._workers = [ThreadPoolExecutor(1, thread_name_prefix=f"ensemble-{m.name}") for m in self.models]
        self._calls: list[Future | None] = [None] * len(self.models)     # each container's last call
        self._lock = threading.Lock()

    def predict(self, x: Any) -> EnsembleAnswer:
        with self._lock:                        # (a container still busy misses this one)
            sent = [None if c is not None and not c.done() else w.submit(checked_predict, m, [x])
                    for m, w, c in zip(self.models, self._workers, self._calls)]
            self._calls = [s or c for s, c in zip(sent, self._calls)]
        wait([f for f in sent if f is not None], timeout=self.deadline_ms / 1000.0)  # early once all answered
        arrived = [f.result()[0] if f is not None and f.done() and f.exception() is None else None for f in sent]
        return _combine([m.name for m in self.models], arrived, self.policy, self.default)

    def close(self) -> None:
        """Stop accepting work; stragglers still running finish in the background."""
        for w in self._workers:
            w.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "StragglerEnsemble":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
