"""Toy models: a linear scorer with a latency *formula* instead of a clock (lecture §0.5, §2.2).

The profiles are the project's own numbers, chosen so the mechanism shows (the lecture says the same
of its toy models): the medium model is exercise 2's `3 + 0.5·B` ms; the linear-SVM-like and
kernel-SVM-like pair reproduce the Clipper paper's ratio of largest batches at a 20 ms SLO (241x:
964 vs 4 inputs). The pair for delayed batching differs mainly in the share of the fixed cost.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from orca_torch.checks import (brief, check_choice, check_fits_in_memory, check_instance, check_int, check_real,
                               check_seed, is_finite_real)

from .container import check_inputs, check_name
from .profile import LatencyProfile, check_batch_sizes, holds_bool

TOY_PROFILES: dict[str, LatencyProfile] = {
    # one dot product per input: almost all of a batch is the fixed cost
    "linear-svm-like": LatencyProfile(0.72, 0.02, "linear-svm-like"),
    # exercise 2
    "medium": LatencyProfile(3.0, 0.5, "medium"),
    # a row of kernel evaluations per input: the per-input cost dominates
    "kernel-svm-like": LatencyProfile(2.0, 4.5, "kernel-svm-like"),
    # delayed batching (demo 3): 75% of an unbatched call is fixed cost, vs about 6%
    "high-fixed-cost": LatencyProfile(0.6, 0.2, "high-fixed-cost"),
    "low-fixed-cost": LatencyProfile(0.05, 0.75, "low-fixed-cost"),
}


def get_toy_profile(name: str) -> LatencyProfile:
    return TOY_PROFILES[check_choice("toy model", name, TOY_PROFILES)]


@dataclass(frozen=True)
class NoisyLatency:
    """Batch latency `(a + b·b_factor·B) * max(0.01, 1 + noise·z)`, z ~ N(0, 1): ~5% jitter by default.

    `b_factor` models interference from a co-located job: every input costs more (demo 2 doubles it).
    The factor is floored at 1% of the mean, since a draw below `z = -1 / noise` would give a negative
    time. The floor is reached at `z < -0.99 / noise`: at the default 0.05 that is z < -19.8, never
    drawn, but at noise 0.4 it is z < -2.48, some 0.7% of batches, and the jitter's low end is no longer
    normal there.
    """

    profile: LatencyProfile
    noise: float = 0.05

    def __post_init__(self) -> None:
        if not isinstance(self.profile, LatencyProfile):
            raise ValueError(f"profile must be a LatencyProfile, got {type(self.profile).__name__}")
        object.__setattr__(self, "noise", check_real("noise (a relative standard deviation)", self.noise, 0.0,
                                                     0.5, hi_open=True))

    def sample_ms(self, batch_size: int | np.ndarray, rng: np.random.Generator,
                  b_factor: float = 1.0) -> float | np.ndarray:
        b = check_batch_sizes(batch_size)
        b_factor = check_real("b_factor", b_factor, 0.0, lo_open=True)
        check_instance("rng", rng, np.random.Generator)
        z = rng.standard_normal(np.shape(b))
        out = self._finite_latency(b, z, b_factor)
        return float(out) if np.ndim(out) == 0 else out

    def with_normal(self, batch_size: int | np.ndarray, z: float | np.ndarray,
                    b_factor: float = 1.0) -> float | np.ndarray:
        """The latency for given standard-normal draws `z`, one per batch size (lets a simulator draw
        them in bulk). A NaN or infinite draw is refused: it has no latency, only a NaN one."""
        b = check_batch_sizes(batch_size)
        b_factor = check_real("b_factor", b_factor, 0.0, lo_open=True)
        zs = np.float64(z) if is_finite_real(z) else np.asarray(z)
        if zs.dtype.kind not in "iuf" or holds_bool(z) or zs.shape != np.shape(b) or not np.all(np.isfinite(zs)):
            raise ValueError(f"z must be finite standard-normal draws (numbers, not bools), one per batch size "
                             f"(shape {np.shape(b)}), got {brief(z, 80)}")
        return self._finite_latency(b, zs, b_factor)

    def _finite_latency(self, batch_size: int | np.ndarray, z: float | np.ndarray,
                        b_factor: float) -> float | np.ndarray:
        """`_latency` if every latency is a finite float; if not, the arguments that made it overflow."""
        with np.errstate(over="ignore"):    # (an overflow is told below, with its arguments)
            out = self._latency(batch_size, z, b_factor)
        if np.all(np.isfinite(out)):
            return out
        mean = self.profile.a_ms + self.profile.b_ms * b_factor * float(np.max(batch_size))  # (floats: inf, no warning)
        raise ValueError(f"the latency overflows a float: a batch of up to {int(np.max(batch_size))} at b_factor "
                         f"{b_factor:g} has a mean of {mean:.3g} ms, times (1 + {self.noise:g} z) for z up to "
                         f"{float(np.max(np.abs(z))):.3g}; allowed: arguments whose latency stays a finite float "
                         f"(below about 1.8e308 ms)")

    def _latency(self, batch_size: int | np.ndarray, z: float | np.ndarray,
                 b_factor: float = 1.0) -> float | np.ndarray:
        """`with_normal` on arguments checked by the caller (the queue simulator's loop, once per batch)."""
        mean = self.profile.a_ms + self.profile.b_ms * b_factor * batch_size
        return mean * np.maximum(0.01, 1.0 + self.noise * z)


class ToyModel:
    """A seeded linear scorer behind `predict_batch`, with a latency formula for simulations."""

    def __init__(self, name: str, profile: LatencyProfile, dim: int = 8, seed: int = 0,
                 noise: float = 0.05) -> None:
        dim = check_int("dim", dim, 1)
        check_fits_in_memory(f"ToyModel(dim={dim:,})", 8 * dim)     # (its weights, drawn at once)
        seed = check_seed(seed)
        self.name = check_name(name)
        self.latency = NoisyLatency(profile, noise)
        self.weights = np.random.default_rng(seed).standard_normal(dim)
        self.n_batches = 0
        self.n_items = 0

    def predict_batch(self, inputs: Sequence[Any]) -> list[float]:
        """One score per input vector. As `TorchContainer` does, a bool, a string (even "1.5"),
        a ragged batch or a NaN is the caller's mistake, refused rather than scored as a number."""
        check_inputs(self.name, inputs)
        want = f"{self.name}: inputs must be vectors of length {self.weights.size} of finite real numbers"
        try:
            x = np.asarray(inputs)
        except ValueError:          # a ragged batch
            raise ValueError(f"{want}, got vectors of different lengths") from None
        if x.dtype.kind not in "iuf":
            raise ValueError(f"{want}, got dtype {x.dtype}")
        x = x.astype(float)
        if x.ndim != 2 or x.shape[1] != self.weights.size:
            raise ValueError(f"{want}, got an array of shape {x.shape}")
        if not np.isfinite(x).all():
            raise ValueError(f"{want}, got NaN or inf")
        self.n_batches += 1
        self.n_items += len(x)
        return [float(v) for v in x @ self.weights]
