"""orca-torch: batching and scheduling for model serving, from Clipper to Orca, in PyTorch.

See README.md for the front door, seeds/README.md for the map from the lecture to the modules.
"""
from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.specs import PRESETS, ModelSpec, get_model_spec

__all__ = ["SeqWork", "StepTotals", "ModelSpec", "PRESETS", "get_model_spec"]
