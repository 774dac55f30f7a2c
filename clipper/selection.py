"""Model selection from feedback: Exp3 (pick one model) and Exp4 (weighted ensemble) (lecture §2.1).

Clipper's selection layer treats the candidate models of one task as the arms of a bandit and learns
from the feedback applications send back (a loss in [0, 1] per query; Clipper paper §5).

- `Exp3` queries ONE model per request, so it only sees the loss of the model it picked. Its update
  divides that loss by the probability of the pick (an importance weight), which keeps the estimate
  of every model's cumulative loss unbiased even though rarely picked models are rarely observed;
  a `gamma` share of uniform exploration keeps every probability, and so every estimate, bounded.
  The probability is the one the model had when picked (`Pick`): feedback that comes after later
  picks would otherwise be weighed by a chance that was not the pick's.
- `Exp4` queries ALL models and answers with their weighted combination; since every model's loss is
  seen, each weight shrinks by `exp(-eta * loss)` directly. The weight behind the answer doubles as a
  confidence, and when some models miss the deadline (stragglers) the rest are renormalised.

Weights are kept as logs (a long run of losses would underflow a plain product).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from orca_torch.checks import brief, check_fits_in_memory, check_int, check_probability, check_real, check_seed


BYTES_PER_MODEL = 64
"""What the policy's own arrays take per model at their peak, rounded up: the log-weight and numpy's
temporaries in an update, a draw or a combination (shifted and exponentiated weights,
probabilities, a cumulative sum). The lists of predictions or losses a caller passes are its own."""


def _check_n(n_models: int, policy: str) -> int:
    """A model count whose weights fit in memory: refused up front, not by numpy's MemoryError or,
    where memory is overcommitted, by the first update touching pages that are not there."""
    n = check_int("n_models", n_models, 1)
    check_fits_in_memory(f"{policy}(n_models={n:,})", BYTES_PER_MODEL * n)
    return n


MAX_RATE = 1e3
"""The largest learning rate taken: far past any useful one (one loss already decides), and small
enough that a log-weight stays a finite float."""


def _check_rate(name: str, v: float) -> float:
    return check_real(name, v, 0.0, MAX_RATE, lo_open=True)


def _check_loss(loss: float) -> float:
    return check_probability("loss (scale feedback into [0, 1])", loss)


def _normalise(logw: np.ndarray) -> np.ndarray:
    w = np.exp(logw - logw.max())
    return w / w.sum()


@dataclass(frozen=True)
class Pick:
    """A model `Exp3.select` picked and the chance it had then: the feedback for this pick is divided
    by that chance, not by the model's chance when the feedback comes (other picks may have moved it
    since, as in serving, where a request's loss arrives after later requests were routed)."""

    model: int
    probability: float


class Exp3:
    """Adversarial bandit over `n_models`: select one, observe its loss, importance-weighted update."""

    def __init__(self, n_models: int, *, eta: float = 0.05, gamma: float = 0.05,
                 rng: np.random.Generator | int = 0) -> None:
        self.n = _check_n(n_models, "Exp3")
        self.eta = _check_rate("eta", eta)
        # (at least 1e-9: a model's share gamma / n must not round to 0, its update divides by it)
        self.gamma = check_real("gamma (the exploration share)", gamma, 1e-9, 1.0)
        self.rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(check_seed(rng, "rng"))
        self._logw = np.zeros(self.n)

    def probabilities(self) -> np.ndarray:
        return (1.0 - self.gamma) * _normalise(self._logw) + self.gamma / self.n

    def select(self) -> Pick:
        p = self.probabilities()
        m = int(self.rng.choice(self.n, p=p))
        return Pick(m, float(p[m]))

    def update(self, pick: Pick, loss: float) -> None:
        """Feedback for a pick: its model's loss divided by the chance the model had when picked."""
        if not isinstance(pick, Pick):
            raise ValueError(f"pick must be the Pick that select() returned (its model and the chance it had), "
                             f"got {brief(pick)}")
        model = check_int("pick.model (an index)", pick.model, 0, self.n - 1)
        p = check_real("pick.probability (the chance select gave it, at least gamma / n_models)", pick.probability,
                       self.gamma / self.n, 1.0)
        self._logw[model] -= self.eta * _check_loss(loss) / p
        self._logw -= self._logw.max()


def is_per_model_list(v: Any) -> bool:
    """A list, tuple or array read by position, one entry per model: not a str or bytes (characters),
    a dict (read by its keys) nor a 0-d array (an array with no length, len() raises)."""
    if isinstance(v, (str, bytes, Mapping)) or not hasattr(v, "__getitem__"):
        return False
    try:
        len(v)
    except TypeError:
        return False
    return True


def is_number_prediction(v: Any) -> bool:
    """True for what `Exp4.combine` can average: a finite number, or an array of them (no bools)."""
    try:
        a = np.asarray(v)
    except Exception:  # a ragged list, a tensor numpy cannot read
        return False
    return a.dtype != bool and (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)) \
        and bool(np.all(np.isfinite(a)))


@dataclass(frozen=True)
class Combined:
    """An ensemble answer, the share of the ensemble's weight that produced it, and the models that
    answered (their indices)."""

    output: Any
    confidence: float
    used: tuple[int, ...]


class Exp4:
    """Weighted ensemble over `n_models` (Clipper's Exp4): combine all, update every weight."""

    def __init__(self, n_models: int, *, eta: float = 1.0) -> None:
        self.n = _check_n(n_models, "Exp4")
        self.eta = _check_rate("eta", eta)
        self._logw = np.zeros(self.n)

    def weights(self) -> np.ndarray:
        return _normalise(self._logw)

    def _per_model(self, name: str, v: Sequence[Any], what: str) -> None:
        """A list (or tuple, array) with one entry per model: a dict would be read by its keys."""
        if not is_per_model_list(v):
            raise ValueError(f"{name} must be a list of one {what} (or None) per model ({self.n}), got {brief(v)}")
        if len(v) != self.n:
            raise ValueError(f"expected one {what} (or None for a missing one) per model: {self.n}, got {len(v)}")

    def _available(self, predictions: Sequence[Any], name: str = "predictions", what: str = "prediction") -> list[int]:
        self._per_model(name, predictions, what)
        return [i for i, p in enumerate(predictions) if p is not None]

    def combine(self, predictions: Sequence[Any]) -> Combined:
        """Weighted mean of the numeric predictions that arrived (`None` = missing), renormalised.

        The predictions must share one shape: numpy would broadcast a number over an array into an
        answer no model gave.

        `confidence` is the share of the full ensemble weight that answered.
        """
        used = self._available(predictions)
        if not used:
            raise ValueError("no model answered; the caller must fall back to a default output")
        for i in used:
            if not is_number_prediction(predictions[i]):
                raise ValueError(f"prediction of model {i} must be a finite number (or array of them; None if "
                                 f"missing), got {brief(predictions[i])}")
        shapes = {i: np.shape(predictions[i]) for i in used}
        if len(set(shapes.values())) > 1:
            got = ", ".join(f"model {i}: {sh}" for i, sh in shapes.items())
            raise ValueError(f"predictions must all have the same shape to be averaged (numbers, or arrays of "
                             f"one shape), got {got}")
        wu = self.relative_weights(used)
        out = sum(wi * np.asarray(predictions[i], dtype=float) for wi, i in zip(wu, used))
        return Combined(out if np.ndim(out) else float(out), float(self.weights()[used].sum()), tuple(used))

    def relative_weights(self, used: list[int]) -> np.ndarray:
        """The weights of the models that answered, renormalised among themselves from the log-weights:
        their shares of the whole may all round to 0 beside a model that missed (one 800 losses
        ahead), and dividing those zeros would answer NaN."""
        return _normalise(self._logw[used])

    def vote(self, labels: Sequence[Hashable | None]) -> Combined:
        """Weighted vote over class labels; `confidence` is the weight share behind the winner.

        Labels are compared by Python equality, so 1, 1.0, np.int64(1) and True are one label
        (models of one task answering with a numpy argmax and with a Python int agree); the label
        answered is the winner as the first model voting for it gave it.

        A label that equals no label, itself included (NaN), is refused, as `combine` refuses a NaN
        prediction: it would be tallied apart from every other vote, even another NaN, and could
        still win a tie; a model with no answer passes None."""
        used = self._available(labels, "labels", "label")
        if not used:
            raise ValueError("no model answered; the caller must fall back to a default output")
        for i in used:
            try:
                hash(labels[i])
            except TypeError:
                raise ValueError(f"labels[{i}] is a {type(labels[i]).__name__}, which cannot be a class label: "
                                 "a label is hashable (an int, a str, a tuple); combine numbers with "
                                 "`combine`") from None
            if labels[i] != labels[i]:
                raise ValueError(f"labels[{i}] is {brief(labels[i])}, which cannot be a class label: it equals no "
                                 "label, not even itself, so no other vote could count with it; a label equals "
                                 "itself (an int, a str, a tuple); pass None for a model that gave no label")
        w = self.weights()
        tally: dict[Hashable, list[float]] = {}     # label -> [weight among those that answered, share of all]
        for i, r in zip(used, self.relative_weights(used)):
            t = tally.setdefault(labels[i], [0.0, 0.0])
            t[0] += r
            t[1] += w[i]
        best = max(tally, key=lambda k: tally[k][0])
        return Combined(best, float(tally[best][1]), tuple(used))

    def update(self, losses: Sequence[float | None]) -> None:
        """Every model that answered is charged its own loss; `None` leaves a model's weight alone."""
        self._per_model("losses", losses, "loss")
        checked = [None if loss is None else _check_loss(loss) for loss in losses]  # all before any weight moves
        for i, loss in enumerate(checked):
            if loss is not None:
                self._logw[i] -= self.eta * loss
        self._logw -= self._logw.max()
