"""orca-torch: batching and scheduling for model serving, from Clipper to Orca, in PyTorch.

The layers, each importing only those below it (`tests/test_layers.py` checks it):
- `checks`: the input checks every layer shares; imports nothing of the project.
- `core`: the algorithm (requests, steps, Orca's scheduler, memory managers, the engine, the
  `Executor` interface); imports `checks` only.
- `specs`: model specs and their FLOP/byte formula; imports `core` and `checks`.
- `model` (the torch model and its K/V storage) and `sim` (the paper GPU and the fast simulator):
  each imports `core`, `specs` and `checks`, never the other.
- `lab`: workloads, metrics, the one-call API and the experiment toolkit; imports any layer below.
- `distributed`: Orca's multi-process executor with its command-line entry; imports any layer up
  to `lab`, and nothing imports it.
- `serve`: the live server over the engine and the torch model; imports any layer up to `lab`,
  and nothing imports it.
This module re-exports a few names of `core` and `specs`. seeds/README.md maps the lecture's
sections to the modules; docs/architecture.md walks the layers.
"""
from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.specs import PRESETS, ModelSpec, get_model_spec

__all__ = ["SeqWork", "StepTotals", "ModelSpec", "PRESETS", "get_model_spec"]
