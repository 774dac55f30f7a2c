"""Real Llama weights in the project's model: `from_hf` maps a transformers Llama onto `OrcaModel`
(lecture §4.2's model, with weights nobody here trained).

A checkpoint is either a `LlamaForCausalLM` instance (its config and state dict are read, nothing
else) or a local directory holding `config.json` and `*.safetensors` (read with `safetensors`;
transformers is not imported and nothing is fetched from a hub). The config's shapes become a
`ModelSpec` (GQA heads, head dim, rope theta and linear / Llama 3 scaling, RMSNorm eps, tied or
untied head); Q/K/V and gate/up are concatenated into the model's fused matrices. Llama's
checkpoints already store Q and K in the half-split rotary order the model uses, so no permutation
is needed.

What the model cannot compute is refused with a ValueError naming the field: biases, an
activation other than SiLU, a rope scaling other than linear or llama3, a sliding window,
another architecture.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from .specs import ModelSpec, RopeScaling

_IGNORED = ("rotary_emb.inv_freq",)      # a buffer some older checkpoints saved


def spec_from_hf_config(config: Mapping[str, Any], name: str = "hf-llama",
                        dtype_bytes: int = 4) -> ModelSpec:
    """A `ModelSpec` from a Llama config dict (`config.json`, or `config.to_dict()`)."""
    c = dict(config)
    if c.get("model_type") != "llama":
        raise ValueError(f"from_hf loads Llama checkpoints (model_type 'llama'), got model_type "
                         f"{c.get('model_type')!r}")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: OrcaModel's MLP is SwiGLU (SiLU gate); only 'silu' is supported")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise ValueError(f"{key}=True: OrcaModel has no bias terms; only bias-free Llama checkpoints load")
    if c.get("sliding_window") not in (None, 0):
        raise ValueError(f"sliding_window={c['sliding_window']!r}: OrcaModel attends to the whole context; "
                         f"sliding-window attention is not supported")
    rope = dict(c.get("rope_parameters") or {})
    legacy = c.get("rope_scaling")
    if legacy:
        rope = {**legacy, **rope}
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10_000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        scaling = None
    elif kind == "linear":
        scaling = RopeScaling("linear", float(rope["factor"]))
    elif kind == "llama3":
        scaling = RopeScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                              float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    else:
        raise ValueError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3")
    n_heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    head_dim = c.get("head_dim") or hidden // n_heads
    return ModelSpec(name=name, n_layers=int(c["num_hidden_layers"]), hidden=hidden, n_heads=n_heads,
                     n_kv_heads=int(c.get("num_key_value_heads") or n_heads), head_dim=int(head_dim),
                     intermediate=int(c["intermediate_size"]), vocab=int(c["vocab_size"]),
                     max_context=int(c["max_position_embeddings"]),
                     tied_embeddings=bool(c.get("tie_word_embeddings", False)), dtype_bytes=dtype_bytes,
                     rope_theta=theta, norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_scaling=scaling)


def read_checkpoint_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """`config.json` and every `*.safetensors` tensor of a local checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is not a directory; from_hf takes a LlamaForCausalLM or a local "
                         f"checkpoint directory (config.json + *.safetensors)")
    cfg = path / "config.json"
    files = sorted(path.glob("*.safetensors"))
    if not cfg.is_file() or not files:
        raise ValueError(f"{str(path)!r} needs config.json and at least one *.safetensors file; found "
                         f"{sorted(p.name for p in path.iterdir())}")
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ImportError("reading a checkpoint directory needs safetensors: pip install 'orca-torch[hf]'") from e
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return json.loads(cfg.read_text()), state


def from_hf(model_or_path, *, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
            attention: str = "split"):
    """An `OrcaModel` with the weights of a transformers Llama (instance or local directory).

    `dtype=None` keeps the checkpoint's dtype; else float32, bfloat16, float16 or float64 (by name or torch
    dtype).
    """
    from .model import OrcaModel, check_dtype

    if isinstance(model_or_path, (str, Path)):
        config, state = read_checkpoint_dir(model_or_path)
        name = Path(model_or_path).name or "hf-llama"
    elif hasattr(model_or_path, "config") and hasattr(model_or_path, "state_dict"):
        config = model_or_path.config.to_dict()
        state = model_or_path.state_dict()
        name = config.get("_name_or_path") or "hf-llama"
    else:
        raise ValueError(f"from_hf takes a transformers LlamaForCausalLM or a checkpoint directory path, got "
                         f"{type(model_or_path).__name__}")
    if "model.embed_tokens.weight" not in state:
        raise ValueError("the checkpoint has no 'model.embed_tokens.weight': not a LlamaForCausalLM state dict")
    dtype = check_dtype(state["model.embed_tokens.weight"].dtype if dtype is None else dtype,
                        "dtype (None: the checkpoint's)")
    spec = spec_from_hf_config(config, name=str(name), dtype_bytes=torch.empty((), dtype=dtype).element_size())
    model = OrcaModel(spec, seed=0, device=device, dtype=dtype, attention=attention)
    _load_weights(model, state)
    return model


def _load_weights(model, state: Mapping[str, torch.Tensor]) -> None:
    s = model.spec
    used: set[str] = set()

    def take(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in state:
            raise ValueError(f"the checkpoint has no {key!r}")
        t = state[key]
        if tuple(t.shape) != shape:
            raise ValueError(f"{key!r} has shape {tuple(t.shape)}, the config implies {shape}")
        used.add(key)
        return t

    h = s.hidden
    with torch.no_grad():
        model.embed.copy_(take("model.embed_tokens.weight", (s.vocab, h)))
        for i, blk in enumerate(model.layers):
            p = f"model.layers.{i}."
            blk.wqkv.copy_(torch.cat([take(p + "self_attn.q_proj.weight", (s.q_dim, h)),
                                      take(p + "self_attn.k_proj.weight", (s.kv_dim, h)),
                                      take(p + "self_attn.v_proj.weight", (s.kv_dim, h))]))
            blk.wo.copy_(take(p + "self_attn.o_proj.weight", (h, s.q_dim)))
            blk.w_gate_up.copy_(torch.cat([take(p + "mlp.gate_proj.weight", (s.intermediate, h)),
                                           take(p + "mlp.up_proj.weight", (s.intermediate, h))]))
            blk.w_down.copy_(take(p + "mlp.down_proj.weight", (h, s.intermediate)))
            blk.attn_norm.copy_(take(p + "input_layernorm.weight", (h,)))
            blk.mlp_norm.copy_(take(p + "post_attention_layernorm.weight", (h,)))
        model.final_norm.copy_(take("model.norm.weight", (h,)))
        if s.tied_embeddings:
            used.add("lm_head.weight")       # an instance's state dict lists the shared tensor again
        else:
            model.lm_head.weight.copy_(take("lm_head.weight", (s.vocab, h)))
    extra = sorted(k for k in state if k not in used and not k.endswith(_IGNORED))
    if extra:
        raise ValueError(f"the checkpoint holds tensors OrcaModel has no place for (e.g. biases): {extra[:5]}")
