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
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from orca_torch.checks import brief, check_instance, check_items, check_real

from .container import ModelContainer, _predict
from .selection import Exp4, is_number_prediction, is_per_model_list


@dataclass(frozen=True)
class EnsembleAnswer:
    """What the ensemble answered at the deadline (`Exp4.combine`'s answer, named by model), or its default."""

    output: Any
    confidence: float            # share of the ensemble weight that answered; 0 for the default
    used: tuple[str, ...]        # models whose predictions arrived by the deadline
    missed: tuple[str, ...]      # stragglers (and models that failed)
    is_default: bool


def _check_deadline(deadline_ms: float) -> float:
    """A deadline a thread can wait for: more than 0 and at most `threading.TIMEOUT_MAX` seconds."""
    return check_real("deadline_ms", deadline_ms, 0.0, threading.TIMEOUT_MAX * 1000.0, lo_open=True,
                      unit="milliseconds")


def _check_distinct(names: Sequence[Any]) -> None:
    """Each model its own name: an answer names the models that answered and missed."""
    for i, n in enumerate(names):
        if n in names[:i]:
            raise ValueError(f"two models are named {brief(n)}: an answer names the models that answered and "
                             "missed, so each needs its own name")


def _combine(names: Sequence[str], arrived: list[Any], policy: Exp4, default: Any) -> EnsembleAnswer:
    used = tuple(n for n, p in zip(names, arrived) if p is not None)
    missed = tuple(n for n, p in zip(names, arrived) if p is None)
    if not used:
        return EnsembleAnswer(default, 0.0, (), missed, True)
    c = policy.combine(arrived)
    return EnsembleAnswer(c.output, c.confidence, used, missed, False)


def answer_at_deadline(names: Sequence[str], predictions: Sequence[Any], arrival_ms: Sequence[float],
                       deadline_ms: float, policy: Exp4, default: Any) -> EnsembleAnswer:
    """Combine the predictions whose arrival time is within the deadline; the default if none is.

    A model that never answered arrives at `math.inf` (or gives None as its prediction)."""
    deadline_ms = _check_deadline(deadline_ms)
    check_instance("policy", policy, Exp4)
    for what, v in (("names", names), ("predictions", predictions), ("arrival_ms", arrival_ms)):
        if not is_per_model_list(v):
            raise ValueError(f"{what} must be a list with one entry per model ({policy.n}), got {brief(v)}")
    if not (len(names) == len(predictions) == len(arrival_ms) == policy.n):
        raise ValueError(f"names, predictions and arrival_ms need one entry per model ({policy.n}), got "
                         f"{len(names)}, {len(predictions)}, {len(arrival_ms)}")
    _check_distinct(list(names))
    times = [check_real(f"arrival_ms[{i}]", t, 0.0, allow_inf=True, unit="milliseconds")
             for i, t in enumerate(arrival_ms)]
    arrived = [p if t <= deadline_ms else None for p, t in zip(predictions, times)]
    return _combine(names, arrived, policy, default)


def _output(call: Future | None) -> Any:
    """A call's prediction, or None when there is none to combine: not sent, not back, failed, or
    not a finite number (NaN, a label): a bad output must not cost the others' answer."""
    if call is None or not call.done() or call.exception() is not None:
        return None
    y = call.result()[0]
    return y if is_number_prediction(y) else None


def _one_shape(arrived: list[Any], policy: Exp4) -> list[Any]:
    """The outputs of the shape the heaviest-weighted model that answered gives; one of another
    shape counts as missed, as a failed one does (`Exp4.combine` cannot average them). The models
    that answered are weighed among themselves, as `combine` weighs them: beside a heavier model
    that missed, their shares of the whole may all round to 0."""
    shapes = [None if y is None else np.shape(y) for y in arrived]
    answered = [i for i, sh in enumerate(shapes) if sh is not None]
    if not answered:
        return arrived
    lead = shapes[answered[int(np.argmax(policy.relative_weights(answered)))]]
    return [y if sh == lead else None for y, sh in zip(arrived, shapes)]


class StragglerEnsemble:
    """Real containers queried in parallel; the answer leaves at `deadline_ms` whatever happened.

    Each container has a worker of its own and serves its calls one at a time, in order, as a
    model container does. One whose oldest unanswered call is older than the deadline is
    straggling: it is not sent the next call (it misses it), so its backlog stays bounded and
    never holds up the others; it is sent calls again once it has caught up. A call whose caller
    has stopped waiting (its deadline passed) is dropped if its container has not started it:
    nobody would read its answer.

    A call a container has started runs to its end: Python cannot interrupt a running call, and
    the interpreter waits at exit for the calls running then (concurrent.futures joins its
    workers at exit by design), so a model that never returns keeps the process from exiting,
    `close()` or not, and a 3 s straggler delays exit by what is left of its call. A model that
    may hang belongs in a process of its own, called with a timeout, as Clipper runs its
    containers."""

    def __init__(self, models: Sequence[ModelContainer], policy: Exp4, deadline_ms: float,
                 default: Any) -> None:
        models = check_items("models", models, ModelContainer)
        check_instance("policy", policy, Exp4)
        if len(models) != policy.n:
            raise ValueError(f"the policy weighs {policy.n} models but {len(models)} were given")
        _check_distinct([m.name for m in models])
        self.models = list(models)
        self.policy = policy
        self.deadline_ms = _check_deadline(deadline_ms)
        self.default = default
        self._workers = [ThreadPoolExecutor(1, thread_name_prefix=f"ensemble-{m.name}") for m in self.models]
        self._unanswered: list[deque[tuple[float, Future]]] = [deque() for _ in self.models]  # (sent at, call)
        self._lock = threading.Lock()
        self._closed = False

    def predict(self, x: Any) -> EnsembleAnswer:
        now, deadline_s = time.perf_counter(), self.deadline_ms / 1000.0
        with self._lock:
            if self._closed:
                raise RuntimeError("the ensemble is closed")
            sent: list[Future | None] = []
            for m, worker, calls in zip(self.models, self._workers, self._unanswered):
                while calls and calls[0][1].done():     # answered calls leave the front, in order
                    calls.popleft()
                if calls and now - calls[0][0] > deadline_s:
                    sent.append(None)           # straggling
                else:
                    calls.append((now, worker.submit(_predict, m, [x])))
                    sent.append(calls[-1][1])
        # (the deadline counts from the call: time spent on the lock or sending is not added to it)
        wait([f for f in sent if f is not None], timeout=max(0.0, now + deadline_s - time.perf_counter()))
        arrived = _one_shape([_output(f) for f in sent], self.policy)
        for f in sent:          # a call not started yet is dropped (one running or done is not)
            if f is not None:
                f.cancel()
        return _combine([m.name for m in self.models], arrived, self.policy, self.default)

    def close(self) -> None:
        """Stop accepting work and return at once; the calls callers still wait for are served
        (they get their answers), the running ones end in the background (see the class
        docstring for what that means at exit)."""
        with self._lock:
            self._closed = True
        for w in self._workers:
            w.shutdown(wait=False)

    def __enter__(self) -> "StragglerEnsemble":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
