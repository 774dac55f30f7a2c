"""The named constants of the refined cost model, one set per card (lecture §1.1, §2.6; beyond the lecture).

The lecture's roofline reaches one constant share of peak FLOP/s and of HBM bandwidth. Real kernels
are slower where a step is neither clearly memory- nor compute-bound, run elementwise kernels the
FLOP count ignores, and skip the masked half of causal attention. `RefinedParams` holds the figures
`refined.RefinedPricer` needs for that; every field is a number a measurement can change
(`orca_torch.lab.calibration.refined_fit.fit_refined` fits them from timed steps). Sources of the
defaults:

- `gemm_bw_ceiling` 0.78, `gemm_flop_ceiling` 0.73: published kernel profiles of Llama-3-8B on an
  A100-80GB, where the projections reach about 78% of HBM bandwidth at 1 token and about 73% of
  dense bf16 peak at 4,096 tokens. Taken for every datasheet card (no H100/H200 profile at hand).
- `overlap` 4.0 and `gemm_ramp_tokens` 64: this project's fit to the same A100 profile (decode at
  context 1,400, batch 1/16/64/128, and prefills of 1,155 and 4,096 tokens); see docs/paper-gpu.md.
  `overlap` is p in `t = (t_compute^p + t_memory^p)^(1/p)`: a GEMM near the card's ridge point
  reaches neither ceiling (p -> infinity is the roofline's max). `gemm_ramp_tokens` is the work a
  GEMM loses to filling and draining its tile pipeline, charged as that many extra rows of compute.
  `CPU_GEMM_RAMP_TOKENS` 16, where a fit on a CPU starts (`calibrate.refined_start`): a CPU's
  GEMM kernel works on a few rows at a time, not a GPU tile's 64 or more. From 64, fits of `mini`'s
  quick grid on this project's 2-core VM left the GEMM rate unpinned above the measured card's
  peak in 6 of 12 sittings, where capping it put the held-out error at 50-80%; from 8 or 16 none
  was past 19% (the full grid's fits were alike from 8, 16 or 64).
- `attention_flop_efficiency` 0.45: FlashAttention-2's published forward rates for causal attention
  with head dim 128 on an A100 (roughly 150-200 TFLOP/s of 312 at 1K-16K tokens), rounded down for
  the variable-length batches of serving. `attention_tile` 128: its query/key block size for head
  dim 128; the kernel skips a tile only when the causal mask hides all of it.
- `elementwise_bw_efficiency` 0.78: a streaming kernel reaches what the GEMMs' memory side does.
  `kernel_floor_s` 3 us (with `overlap`, `gemm_ramp_tokens` and `attention_flop_efficiency`
  part of the same fit to the A100 profile): the shortest a dependent GPU kernel takes on the stream (launch to
  completion, a few microseconds on A100/H100); with the traffic it gives the profiled ~0.9 ms of
  norms, rotary, activation and residual adds per Llama-3-8B step at a serving batch.
- `launch_overhead_s` 20 us: one CUDA-graph launch plus the step's input copy, an order of
  magnitude (CUDA-graph replays cost ~10-20 us of host time). `seq_overhead_s` 0: GPU engines batch
  their per-request work; an eager CPU run does not (the calibration fits it).
- `attention` "causal-tiles": the attention kernel the card runs, which the pricer charges by
  default; a profile of the torch model on a CPU says "full" (its masked matmul computes the whole
  rectangle).
- `n_sms`: the datasheet's streaming-multiprocessor count (A100 108, H100/H200 SXM 132); printed
  with a profile for reference, not used in the time.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from orca_torch.checks import brief, check_int, check_real

GEMM_FLOP_CEILING = 0.73
GEMM_BW_CEILING = 0.78
OVERLAP = 4.0
GEMM_RAMP_TOKENS = 64.0
CPU_GEMM_RAMP_TOKENS = 16.0
ATTENTION_FLOP_EFFICIENCY = 0.45
ATTENTION_TILE = 128
ELEMENTWISE_BW_EFFICIENCY = 0.78
KERNEL_FLOOR_S = 3e-6
LAUNCH_OVERHEAD_S = 20e-6
ATTENTION_MODES = ("causal-tiles", "full", "causal")
ELEMENTWISE_KERNELS_PER_LAYER = 7
"""Unfused kernels per transformer block: two norms, rotary, the MLP activation, two residual adds and
the K/V cache write (the write's bytes are attention's K/V traffic; only its floor is charged here)."""

_EFFICIENCIES = ("gemm_flop_ceiling", "gemm_bw_ceiling", "attention_flop_efficiency", "elementwise_bw_efficiency")
_NON_NEGATIVE = ("gemm_ramp_tokens", "kernel_floor_s", "launch_overhead_s", "seq_overhead_s")
_REAL_RANGES = (*((f, 0.0, 1.0, True) for f in _EFFICIENCIES), *((f, 0.0, None, False) for f in _NON_NEGATIVE),
                ("overlap", 1.0, 64.0, False))
"""(field, low, high, low excluded) of each real field; `overlap` 1: compute and memory add up, large: the
roofline's max."""


@dataclass(frozen=True)
class RefinedParams:
    """One card's refined-model constants (see the module docstring for each default's source)."""

    gemm_flop_ceiling: float = GEMM_FLOP_CEILING
    gemm_bw_ceiling: float = GEMM_BW_CEILING
    overlap: float = OVERLAP
    gemm_ramp_tokens: float = GEMM_RAMP_TOKENS
    attention_flop_efficiency: float = ATTENTION_FLOP_EFFICIENCY
    attention_tile: int = ATTENTION_TILE
    elementwise_bw_efficiency: float = ELEMENTWISE_BW_EFFICIENCY
    kernel_floor_s: float = KERNEL_FLOOR_S
    launch_overhead_s: float = LAUNCH_OVERHEAD_S
    seq_overhead_s: float = 0.0
    attention: str = "causal-tiles"
    n_sms: int = 0

    def __post_init__(self) -> None:
        put = lambda f, v: object.__setattr__(self, f, v)  # noqa: E731  (frozen: store the checked value)
        for f, lo, hi, lo_open in _REAL_RANGES:
            put(f, check_real(f"RefinedParams.{f}", getattr(self, f), lo, hi, lo_open=lo_open))
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"RefinedParams.attention must be one of {', '.join(ATTENTION_MODES)}, "
                             f"got {brief(self.attention)}")
        for f, lo in (("attention_tile", 1), ("n_sms", 0)):
            put(f, check_int(f"RefinedParams.{f}", getattr(self, f), lo))

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "RefinedParams":
        """The inverse of `to_dict`; unknown keys are refused by name."""
        known = {f.name for f in fields(RefinedParams)}
        if not isinstance(d, dict):
            raise ValueError(f"refined parameters must be a JSON object, got {type(d).__name__}")
        extra = sorted(set(d) - known)
        if extra:
            raise ValueError(f"unknown refined parameter(s) {', '.join(extra)}; known: {', '.join(sorted(known))}")
        return RefinedParams(**d)
