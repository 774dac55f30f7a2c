"""How `tp x pp` devices share one model: Orca's intra- and inter-layer parallelism (lecture §4.4).

Megatron-style tensor parallelism inside a layer: Q, O and the MLP matrices are split `tp` ways;
K/V heads are split too, or replicated when there are fewer K/V heads than ranks (GQA); norms are
replicated; biases are taken as split with their matmul (the replicated row-parallel bias is
< 0.01% of a layer). The vocabulary matrices are split `tp` ways (vocab-parallel); learned
positions are replicated.

Pipeline parallelism across layers: `pp` stages of consecutive layers (the first `n_layers % pp`
stages get one more). Stage 0 stores the embedding; the last stage stores the final norm and the
LM head (with tied embeddings and `pp > 1` it keeps its own copy of the embedding, as Megatron
does). Per-step weight *traffic* follows the shared formula (`ModelSpec.step_bytes`: every
parameter read once); its vocabulary part is charged to the last stage, where the LM head reads
the whole matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

from orca_torch.checks import check_int
from orca_torch.specs import ModelSpec


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Partition:
    """One model on `tp x pp` devices: what each device of each stage stores, reads and holds in K/V."""

    model: ModelSpec
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        m = self.model
        for f in ("tp", "pp"):
            object.__setattr__(self, f, check_int(f, getattr(self, f), 1))
        tp, pp = self.tp, self.pp
        if pp > m.n_layers:
            raise ValueError(f"pp={pp} exceeds the {m.n_layers} layers of {m.name}")
        if m.n_heads % tp or m.intermediate % tp:
            raise ValueError(f"tp={tp} must divide n_heads ({m.n_heads}) and intermediate ({m.intermediate}) of "
                             f"{m.name}")
        if m.n_kv_heads % tp and tp % m.n_kv_heads:
            raise ValueError(f"tp={tp} must divide n_kv_heads ({m.n_kv_heads}) or be a multiple of it")

    @property
    def n_devices(self) -> int:
        return self.tp * self.pp

    @property
    def stage_layers(self) -> tuple[int, ...]:
        base, extra = divmod(self.model.n_layers, self.pp)
        return tuple(base + (1 if s < extra else 0) for s in range(self.pp))

    @property
    def kv_heads_per_device(self) -> int:
        return max(1, self.model.n_kv_heads // self.tp)

    @property
    def layer_params_per_device(self) -> int:
        m, tp = self.model, self.tp
        q_o = 2 * m.hidden * m.q_dim
        k_v = 2 * m.hidden * m.kv_dim
        mlp = m.linear_params_per_layer - q_o - k_v
        return ((q_o + mlp) // tp + k_v * self.kv_heads_per_device // m.n_kv_heads
                + _ceil_div(m.bias_params_per_layer, tp) + 2 * m.norm_params)

    @property
    def token_embedding_params_per_device(self) -> int:
        return _ceil_div(self.model.vocab, self.tp) * self.model.hidden

    @property
    def position_params(self) -> int:
        m = self.model
        return m.max_context * m.hidden if m.learned_positions else 0

    def stage_weight_bytes(self, s: int) -> int:
        """Bytes of weights one device of stage `s` stores."""
        m, last = self.model, self.pp - 1
        params = self.stage_layers[s] * self.layer_params_per_device
        if s == 0:
            params += self.token_embedding_params_per_device + self.position_params
        if s == last:
            params += m.norm_params
            if not m.tied_embeddings or self.pp > 1:
                params += self.token_embedding_params_per_device  # LM head (or its tied copy)
        return params * m.dtype_bytes

    def stage_weight_traffic(self, s: int) -> int:
        """Weight bytes one device of stage `s` reads per step; over stages at tp=1 this is `step_bytes`."""
        m = self.model
        params = self.stage_layers[s] * self.layer_params_per_device
        if s == self.pp - 1:
            vocab_mats = (m.embedding_params + m.lm_head_params - self.position_params) // (m.vocab * m.hidden)
            params += (vocab_mats * self.token_embedding_params_per_device + self.position_params
                       + m.norm_params)
        return params * m.dtype_bytes

    def stage_kv_bytes_per_token(self, s: int) -> int:
        """K/V bytes of one token that one device of stage `s` holds."""
        m = self.model
        return 2 * self.stage_layers[s] * self.kv_heads_per_device * m.head_dim * m.dtype_bytes

    @property
    def weight_bytes_per_device(self) -> int:
        """The heaviest stage's per-device weights."""
        return max(self.stage_weight_bytes(s) for s in range(self.pp))

    def kv_share(self, s: int) -> float:
        """Fraction of a token's K/V (as `ModelSpec.kv_bytes_per_token` counts it) one device of stage `s` moves."""
        return self.stage_kv_bytes_per_token(s) / self.model.kv_bytes_per_token
