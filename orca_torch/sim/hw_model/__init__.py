"""The paper GPU: what one step of a real-size model costs on a real card (lecture §1, §2.6, §4.4, §5, §6.1).

The simulator's clock and every production-scale figure of the experiments come from here.
- `gpus`: the cards (datasheet peaks, memory, NVLink/InfiniBand), a measured spec of this CPU, and
  a card's spec and refined constants as a JSON profile `get_gpu(path)` loads.
- `layout`: how `tp x pp` devices split a model's weights and K/V (Orca's distributed execution).
- `roofline`: `StepPricer`, a roofline over the shared FLOP/byte formula of `ModelSpec` (the one
  FlopCounterMode checks on the torch model), plus TP/PP communication.
- `cost`: the cost models by name: `pricer(..., cost_model=...)`, `step_cost`, `step_time`.
- `refined`: the refined cost model (`cost_model="refined"`): GEMM efficiency by shape, elementwise
  kernels, gathered embeddings, causal attention by tiles; its constants in `refined_params`.
- `capacity`: the K/V budget of a card in tokens and the requests that fit under a reservation
  (decimal GB or GiB: `mem_unit`).
- `links`: a link between two devices other than a card's own (`LinkSpec`, `with_link`);
  `host_link`: what a K/V swap costs over the card's host link.
- `microbatch`: FasterTransformer's pipeline, microbatches and bubbles (Orca's baseline, §4.5).
Run `python -m orca_torch.lab.gpu_calculator --help` for the calculator.
"""
from orca_torch.sim.hw_model.capacity import (DEFAULT_MEM_FRACTION, DEFAULT_MEM_UNIT, MEM_UNITS, MemoryPlan,
                                              kv_capacity_tokens, max_requests, memory_plan)
from orca_torch.sim.hw_model.cost import (COST_MODELS, decode_profile, decode_totals, max_batch_within, pricer,
                                          step_cost, step_time)
from orca_torch.sim.hw_model.gpus import (BW_EFFICIENCY, COMM_EFFICIENCY, FLOP_EFFICIENCY, GPUS, GPUSpec, card_for,
                                          get_gpu, known_gpus, load_profile, measure_cpu, save_profile)
from orca_torch.sim.hw_model.layout import Partition
from orca_torch.sim.hw_model.refined import RefinedPricer
from orca_torch.sim.hw_model.refined_params import RefinedParams
from orca_torch.sim.hw_model.roofline import STEP_OVERHEAD_S, StageCoefficients, StepCost, StepPricer

__all__ = [
    "GPUSpec", "GPUS", "card_for", "get_gpu", "known_gpus", "measure_cpu",
    "FLOP_EFFICIENCY", "BW_EFFICIENCY", "COMM_EFFICIENCY", "STEP_OVERHEAD_S", "DEFAULT_MEM_FRACTION",
    "Partition", "StageCoefficients", "StepCost", "StepPricer", "pricer", "step_cost", "step_time",
    "decode_totals", "max_batch_within", "decode_profile", "MemoryPlan", "memory_plan", "kv_capacity_tokens", "max_requests",
    "COST_MODELS", "RefinedPricer", "RefinedParams", "load_profile", "save_profile",
    "MEM_UNITS", "DEFAULT_MEM_UNIT",
]
