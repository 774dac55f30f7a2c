"""The model-container interface: `predict_batch(inputs) -> outputs` (lecture §2.1; Clipper paper §4.3).

Clipper wraps every model, whatever its framework, in a container that answers one call: a list of
inputs in, a list of outputs out, one output per input, in order. Everything above it (the cache,
the batching queue, the controllers, model selection) sees only this call, which is why the same
AIMD steers a toy model with a formula for its latency and a real torch module timed by the clock.
"""
from __future__ import annotations

import time
from typing import Any, Protocol, Sequence, runtime_checkable

from orca_torch.checks import brief, check_instance


@runtime_checkable
class ModelContainer(Protocol):
    """A model behind Clipper's batch prediction interface."""

    name: str

    def predict_batch(self, inputs: Sequence[Any]) -> list[Any]:
        """One output per input, in the same order."""
        ...


def check_name(name: Any) -> str:
    """A model's name: a str, since the prediction cache keys a model's answers by it (and the
    errors and ensemble answers name models by it)."""
    if not isinstance(name, str):
        raise ValueError(f"a model's name is part of its cache keys, so it must be a str, got {brief(name)} "
                         f"({type(name).__name__})")
    return name


def check_inputs(name: str, inputs: Sequence[Any]) -> None:
    """A batch must be a non-empty sequence; an empty batch is a caller's bug, not a no-op."""
    try:
        n = None if isinstance(inputs, (str, bytes)) else len(inputs)
    except TypeError:  # a 0-d array or tensor has __len__ but no length
        n = None
    if n is None:
        raise ValueError(f"{name}: predict_batch takes a sequence of inputs, got {type(inputs).__name__}"
                         f"{' of shape ()' if getattr(inputs, 'shape', None) == () else ''}")
    if n == 0:
        raise ValueError(f"{name}: predict_batch needs at least one input")


def checked_predict(container: ModelContainer, inputs: Sequence[Any]) -> list[Any]:
    """Call `predict_batch` and insist on the contract: one output per input."""
    return _predict(check_instance("container", container, ModelContainer), inputs)


def _predict(container: ModelContainer, inputs: Sequence[Any]) -> list[Any]:
    """`checked_predict` on a container checked at its caller's door (the cache's, the ensemble's:
    a Protocol's isinstance costs tens of microseconds, which a batch's time must not include)."""
    returned = container.predict_batch(inputs)
    try:
        outputs = list(returned)
    except TypeError:
        raise TypeError(f"container {brief(container.name)} returned {type(returned).__name__} from predict_batch; "
                        "the contract is a sequence with one output per input") from None
    if len(outputs) != len(inputs):
        raise ValueError(f"container {brief(container.name)} returned {len(outputs)} outputs for "
                         f"{len(inputs)} inputs; the contract is one output per input")
    return outputs


def timed_predict(container: ModelContainer, inputs: Sequence[Any]) -> tuple[list[Any], float]:
    """Outputs and wall-clock milliseconds of one batch.

    A container with asynchronous execution (CUDA) exposes `synchronize()`; it is called before the
    clock stops so the time covers the work, not just its launch.
    """
    sync = getattr(check_instance("container", container, ModelContainer), "synchronize", None)
    t0 = time.perf_counter()
    outputs = _predict(container, inputs)
    if sync is not None:
        sync()
    return outputs, (time.perf_counter() - t0) * 1000.0
