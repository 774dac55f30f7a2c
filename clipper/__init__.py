"""Clipper's serving design (lecture §2; Crankshaw et al., NSDI 2017), small and tested.

- `profile`: latency profiles `a + b·B`, the largest batch under an SLO, fits from measurements.
- `controllers`: batch-size controllers behind one interface: `FixedBatch`, `AIMD`, `QuantileRegression`.
- `closed_loop`: a controller driving a saturated model batch after batch.
- `queue_sim`: a batching queue under Poisson arrivals, with and without delayed batching.
- `container`: the `predict_batch(inputs) -> outputs` interface; `toy_models` and `torch_models`
  implement it (torch is imported only by `torch_models`).
- `cache`: the prediction cache (CLOCK, bounded in bytes, in-flight sharing).
- `selection`: Exp3 and Exp4 model selection; `straggler`: answering at the deadline.
"""
from .cache import CachedModel, PredictionCache
from .closed_loop import ControllerTrace, run_closed_loop
from .container import ModelContainer, checked_predict, timed_predict
from .controllers import AIMD, BatchController, FixedBatch, QuantileRegression
from .profile import LatencyProfile, fit_line, fit_profile
from .queue_sim import QueueResult, poisson_arrivals, simulate_queue
from .selection import Exp3, Exp4, Pick
from .straggler import EnsembleAnswer, StragglerEnsemble, answer_at_deadline
from .toy_models import TOY_PROFILES, NoisyLatency, ToyModel, get_toy_profile

__all__ = [
    "AIMD", "BatchController", "CachedModel", "ControllerTrace", "EnsembleAnswer", "Exp3", "Exp4",
    "FixedBatch", "LatencyProfile", "ModelContainer", "NoisyLatency", "Pick", "PredictionCache",
    "QuantileRegression", "QueueResult", "StragglerEnsemble", "TOY_PROFILES", "ToyModel",
    "answer_at_deadline", "checked_predict", "fit_line", "fit_profile", "get_toy_profile",
    "poisson_arrivals", "run_closed_loop", "simulate_queue", "timed_predict",
]
