"""Model shapes, and the one FLOP/byte formula that both halves of the project use (lecture §1.1, §4.2).

A `ModelSpec` describes a decoder-only transformer by its shapes. From it we *compute* the parameter
count, the weight bytes and the K/V bytes per token (never type them), and the matmul FLOPs and
the memory traffic of one step given as a list of `SeqWork`. The torch model (`model.py`) is built
from a `ModelSpec` and the paper GPU (`hw_model.py`) prices a `ModelSpec`, so the FLOPs the
simulator charges are the FLOPs `torch.utils.flop_counter.FlopCounterMode` sees on the real forward.

Counting conventions (documented once, here):
- Matmul FLOPs are 2·M·N·K, as FlopCounterMode counts them; norms, activations, softmax, rotary and
  residual adds are elementwise and not counted (they are < 1% of a step at every size we model).
- Attention computes the full `n_new × (n_past + n_new)` score rectangle per head (what a masked
  matmul or SDPA executes); `attention="causal"` counts only the pairs the causal mask keeps.
- The LM head runs on one row per work item: the last new token of each request this step.
- Weight bytes per step: every parameter is read once per forward (lecture §1.1: a decode step
  reads all the weights once; this project's `weight_bytes` gives Llama-3-8B's as 16.06 GB).
  K/V read: `n_past + n_new` tokens per request; K/V written: `n_new`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Literal

from orca_torch.checks import brief, check_choice, check_flag, check_instance, check_int, check_real
from orca_torch.core.batch import SeqWork, StepTotals

Attention = Literal["full", "causal"]
ATTENTIONS = ("full", "causal")


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for a longer context than the model was trained on.

    `kind="linear"`: every frequency divided by `factor` (position interpolation).
    `kind="llama3"`: Llama 3.1's rule: wavelengths longer than `original_max_position /
    low_freq_factor` are divided by `factor`, shorter than `original_max_position /
    high_freq_factor` kept, and the band between blended smoothly. Shapes and FLOPs are unchanged.
    """

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        check_choice("RopeScaling.kind", self.kind, ("linear", "llama3"))
        for f in ("factor", "low_freq_factor", "high_freq_factor"):
            object.__setattr__(self, f, check_real(f"RopeScaling.{f}", getattr(self, f), 0.0, lo_open=True))
        object.__setattr__(self, "original_max_position",
                           check_int("RopeScaling.original_max_position", self.original_max_position, 1))
        if self.kind == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor}, {self.high_freq_factor}")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer; every count below is derived from these fields."""

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_context: int
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    tied_embeddings: bool = False
    learned_positions: bool = False
    bias: bool = False
    dtype_bytes: int = 2
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        def store(f: str, v: object) -> None:
            object.__setattr__(self, f, v)

        check_instance("ModelSpec.name", self.name, str)
        for f in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab",
                  "max_context", "dtype_bytes"):
            store(f, check_int(f"ModelSpec.{f}", getattr(self, f), 1))
        for f, allowed in (("mlp", ("swiglu", "gelu")), ("norm", ("rmsnorm", "layernorm"))):
            check_choice(f"ModelSpec.{f}", getattr(self, f), allowed)
        for f in ("tied_embeddings", "learned_positions", "bias"):
            store(f, check_flag(f"ModelSpec.{f}", getattr(self, f)))
        for f in ("rope_theta", "norm_eps"):
            store(f, check_real(f"ModelSpec.{f}", getattr(self, f), 0.0, lo_open=True))
        check_instance("ModelSpec.rope_scaling", self.rope_scaling, RopeScaling, allow_none=True)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    def with_dtype_bytes(self, dtype_bytes: int) -> "ModelSpec":
        return replace(self, dtype_bytes=dtype_bytes)

    # ---- parameter counts -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of the matmuls in one block: Q, K, V, O projections and the MLP."""
        attn = self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim + self.q_dim * self.hidden
        n_mats = 3 if self.mlp == "swiglu" else 2
        return attn + n_mats * self.hidden * self.intermediate

    @property
    def bias_params_per_layer(self) -> int:
        if not self.bias:
            return 0
        n_up = 2 if self.mlp == "swiglu" else 1
        return self.q_dim + 2 * self.kv_dim + self.hidden + n_up * self.intermediate + self.hidden

    @property
    def norm_params(self) -> int:
        """One norm's parameters: a scale, plus a shift for LayerNorm."""
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    @property
    def params_per_layer(self) -> int:
        return self.linear_params_per_layer + self.bias_params_per_layer + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + (self.max_context * self.hidden if self.learned_positions else 0)

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def n_params(self) -> int:
        return (self.n_layers * self.params_per_layer + self.embedding_params + self.lm_head_params
                + self.norm_params)

    @property
    def weight_bytes(self) -> int:
        return self.n_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.n_layers * self.kv_dim * self.dtype_bytes

    # ---- one step ---------------------------------------------------------------------------
    def step_flops(self, works: Iterable[SeqWork] | StepTotals, attention: Attention = "full") -> dict[str, int]:
        """Matmul FLOPs of one forward over `works`, split into linear, attention and LM head (the
        cost models check `attention` when they are built)."""
        t = works if isinstance(works, StepTotals) else StepTotals.of(works)
        assert attention in ATTENTIONS, attention
        pairs = t.attn_pairs_full if attention == "full" else t.attn_pairs_causal
        linear = 2 * t.n_tokens * self.n_layers * self.linear_params_per_layer
        attn = 4 * self.n_layers * self.n_heads * self.head_dim * pairs
        head = 2 * t.n_seqs * self.hidden * self.vocab
        return {"linear": linear, "attention": attn, "lm_head": head, "total": linear + attn + head}

    def step_bytes(self, works: Iterable[SeqWork] | StepTotals) -> dict[str, int]:
        """HBM traffic of one forward: weights once, K/V read per request, K/V written per new token."""
        t = works if isinstance(works, StepTotals) else StepTotals.of(works)
        w = self.weight_bytes if t.n_seqs else 0
        kv_r = t.kv_read_tokens * self.kv_bytes_per_token
        kv_w = t.n_tokens * self.kv_bytes_per_token
        return {"weights": w, "kv_read": kv_r, "kv_write": kv_w, "total": w + kv_r + kv_w}

    # ---- activation traffic (added for the paper GPU, hw_model) ------------------------------
    @property
    def activation_elems_per_token(self) -> int:
        """Elements one token's activations move through all blocks if nothing is fused.

        Every matmul reads its input and writes its output; each norm reads and writes `hidden`;
        each residual add reads two and writes one; the MLP's activation reads its inputs and
        writes its output; attention reads the queries and writes its output (its K/V traffic is
        `kv_read`/`kv_write`). The embedding lookup writes one row. Rotary and softmax are taken
        as fused into attention. An upper bound for traffic a fused engine keeps on chip.
        """
        h, i = self.hidden, self.intermediate
        attn = (h + self.q_dim + 2 * self.kv_dim) + 2 * self.q_dim + (self.q_dim + h)
        mlp = (2 * h + 2 * i) + 3 * i + (i + h) if self.mlp == "swiglu" else (h + i) + 2 * i + (i + h)
        norms_and_residuals = 2 * (2 * h) + 2 * (3 * h)
        return self.n_layers * (attn + mlp + norms_and_residuals) + h

    @property
    def activation_elems_per_seq(self) -> int:
        """Per work item: the final norm and the LM head on its last new token (read h, write vocab)."""
        return 2 * self.hidden + self.hidden + self.vocab

    def step_activation_bytes(self, works: Iterable[SeqWork] | StepTotals) -> int:
        """Unfused activation traffic of one forward over `works` (see `activation_elems_per_token`)."""
        t = works if isinstance(works, StepTotals) else StepTotals.of(works)
        return (t.n_tokens * self.activation_elems_per_token
                + t.n_seqs * self.activation_elems_per_seq) * self.dtype_bytes


def _gpt3(name: str, n_layers: int, hidden: int) -> ModelSpec:
    """GPT-3 shapes as Orca evaluated them (OSDI 2022 §6): head dim 128, 4x MLP, max length 2048."""
    return ModelSpec(name=name, n_layers=n_layers, hidden=hidden, n_heads=hidden // 128,
                     n_kv_heads=hidden // 128, head_dim=128, intermediate=4 * hidden, vocab=50257,
                     max_context=2048, mlp="gelu", norm="layernorm", tied_embeddings=True,
                     learned_positions=True, bias=True, dtype_bytes=2)


PRESETS: dict[str, ModelSpec] = {
    "llama-3-8b": ModelSpec(name="llama-3-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8,
                            head_dim=128, intermediate=14336, vocab=128256, max_context=8192),
    "gpt3-13b": _gpt3("gpt3-13b", 40, 5120),
    "gpt3-101b": _gpt3("gpt3-101b", 80, 10240),
    "gpt3-175b": _gpt3("gpt3-175b", 96, 12288),
    "gpt3-341b": _gpt3("gpt3-341b", 120, 15360),
    "opt-13b": ModelSpec(name="opt-13b", n_layers=40, hidden=5120, n_heads=40, n_kv_heads=40,
                         head_dim=128, intermediate=20480, vocab=50272, max_context=2048, mlp="gelu",
                         norm="layernorm", tied_embeddings=True, learned_positions=True, bias=True),
    # The project's own torch presets (fp32 by default): `mini` is the lecture's ~13M-param size.
    "mini": ModelSpec(name="mini", n_layers=8, hidden=256, n_heads=8, n_kv_heads=4, head_dim=32,
                      intermediate=1024, vocab=10240, max_context=2048, dtype_bytes=4,
                      rope_theta=10_000.0),
    "tiny": ModelSpec(name="tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16,
                      intermediate=128, vocab=256, max_context=512, dtype_bytes=4, rope_theta=10_000.0),
}


def get_model_spec(name: str | ModelSpec) -> ModelSpec:
    """Look a preset up by name; a clear error lists the known ones."""
    if isinstance(name, ModelSpec):
        return name
    key = name.lower() if isinstance(name, str) else None
    if key not in PRESETS:
        what = (f"unknown model preset {brief(name)}" if isinstance(name, str) else
                f"model must be a preset name or a ModelSpec, got {brief(name)} ({type(name).__name__})")
        raise ValueError(f"{what}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]
