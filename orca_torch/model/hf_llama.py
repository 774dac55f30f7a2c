"""Real Llama weights in the project's model: `read_hf` reads a transformers Llama as a `ModelSpec` and
its tensors, and `load_weights` maps them onto `OrcaModel` (`OrcaModel.from_hf` does both)
(lecture §4.2's model, with weights nobody here trained).

A checkpoint is either a `LlamaForCausalLM` (or `MistralForCausalLM`) instance (its config and state
dict are read, nothing else) or a local directory holding `config.json` and `*.safetensors` (read with
`safetensors`, through `model.safetensors.index.json` where there is one; transformers is not imported
and nothing is fetched from a hub). The config's shapes become a `ModelSpec` (GQA heads, head dim, rope
theta and linear / Llama 3 scaling, RMSNorm eps, tied or untied head); a dynamic NTK rope is the plain
one within max_position_embeddings (the longest context the model serves), and a Mistral is a Llama
where its sliding window spans that context. Q/K/V and gate/up are concatenated into the model's fused
matrices. Llama's checkpoints already store Q and K in the half-split rotary order the model uses, so no
permutation is needed.

Where a config contradicts itself or its weights, the model is the one transformers would build: a
legacy `rope_scaling` replaces `rope_parameters` whole, a top-level `original_max_position_embeddings`
overrides a llama3 rope's own, and a config that ties the head keeps a stored head that differs from
the embedding (each with a warning).

What the model cannot compute is refused with a ValueError naming the field: another head than the
causal LM's (`architectures`), biases, an activation other than SiLU, a rope scaling other than linear,
llama3 or dynamic, a sliding window shorter than max_position_embeddings (0 included), another architecture, a
quantized checkpoint (a `quantization_config`, or weights in float8 or another dtype than float32,
bfloat16, float16 or float64), a weight that the dtype asked for would hold as inf (float16's
largest is 65504: 65520 and up round to inf); so is a malformed checkpoint (a config.json that is not a JSON object, a
field missing or of the wrong kind, pickled `*.bin` weights without safetensors, a file safetensors
cannot read, an index that does not match its files, a tensor stored twice, a weight that is not
floating point or not finite, weights of other layers than num_hidden_layers gives, a tensor missing, of
another shape than the config implies or with no place in the model), with the file and the field or
tensor named, before the model is built.
"""
from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from orca_torch.checks import GOT_LIMIT, brief, brief_items, check_flag, check_int, check_real, quoted_path
from orca_torch.model.kv_cache import DTYPES
from orca_torch.specs import ModelSpec, RopeScaling

_IGNORED = ("rotary_emb.inv_freq",)      # a buffer some older checkpoints saved
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"
_INDEX = "model.safetensors.index.json"    # which file holds each tensor of a sharded checkpoint
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


_REQUIRED = object()


@dataclass(frozen=True)
class _TypeDefaults:
    """What transformers' config class of a model type assumes for a field config.json leaves out."""
    n_kv_heads: int | None          # None: as many as the attention heads
    sliding_window: int | None


# Mistral is Llama's network with a sliding window; it loads where the window never binds.
_DEFAULTS = {"llama": _TypeDefaults(None, None), "mistral": _TypeDefaults(8, 4096)}


def _field(c: Mapping[str, Any], key: str, source: str, check, default: Any = _REQUIRED, label: str = ""):
    """`c[key]` passed through `check(name, value)`; a missing or null key is `default`, or an error."""
    label = label or key
    v = c.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ValueError(f"{source} has no {label!r}, which it must give")
        return default
    return check(f"{source}: {label}", v)


def _count(name: str, v: Any) -> int:
    return check_int(name, v, 1)


def _positive(name: str, v: Any) -> float:
    return check_real(name, v, 0.0, lo_open=True)


def _mapping(v: Any, what: str) -> dict:
    if not isinstance(v, Mapping):
        raise ValueError(f"{what} must be a JSON object (a dict), got {brief(v)} ({type(v).__name__})")
    return dict(v)


def spec_from_hf_config(config: Mapping[str, Any], name: str = "hf-llama", dtype_bytes: int = 4, *,
                        source: str = "the Llama config") -> ModelSpec:
    """A `ModelSpec` from a Llama config dict (`config.json`, or `config.to_dict()`).

    `source` names where the config came from in error messages (e.g. the config.json path).
    """
    c = _mapping(config, source)
    _refuse_quantized(c, source)
    act = c.get("hidden_act", "silu")
    model_type = c.get("model_type")
    if model_type not in _DEFAULTS:
        raise ValueError(f"{source}: from_hf loads Llama and Mistral checkpoints (model_type "
                         f"{' or '.join(map(repr, _DEFAULTS))}), got model_type {brief(model_type)}")
    heads = c.get("architectures")
    if isinstance(heads, list) and heads and not any(isinstance(a, str) and a.endswith("ForCausalLM") for a in heads):
        raise ValueError(f"{source}: architectures={brief(heads, GOT_LIMIT)}: from_hf loads a causal language model "
                         "(LlamaForCausalLM or MistralForCausalLM), whose lm_head gives the next token's logits")
    defaults = _DEFAULTS[model_type]
    max_context = _field(c, "max_position_embeddings", source, _count)
    window = c.get("sliding_window", defaults.sliding_window)
    unsupported = [
        (act not in ("silu", "swish"), f"hidden_act={brief(act)}: OrcaModel's MLP is SwiGLU (SiLU gate); only 'silu' "
                                        "(also named 'swish') is supported"),
        *((_field(c, key, source, check_flag, False),
           f"{key}=True: OrcaModel has no bias terms; only bias-free Llama checkpoints load")
          for key in ("attention_bias", "mlp_bias")),
        (window == 0 and type(window) is int,
         "sliding_window=0: transformers reads only null as no window, and fails to run a window of 0; give null "
         "for no window, or a window of at least max_position_embeddings"),
        (window is not None and not (type(window) is int and (window == 0 or window >= max_context)),
         f"sliding_window={brief(window)} with max_position_embeddings={max_context}: OrcaModel attends to the whole "
         "context; only a window of at least the context (or none) is supported")]
    rope = _mapping(c.get("rope_parameters") or {}, f"{source}: rope_parameters")
    section = "rope_parameters"
    legacy = c.get("rope_scaling")
    if legacy:      # as transformers' config standardization: a legacy rope_scaling replaces rope_parameters whole
        legacy = _mapping(legacy, f"{source}: rope_scaling")
        if rope and rope != legacy:
            warnings.warn(f"{source} gives both rope_parameters and rope_scaling, which differ ({rope} and "
                          f"{legacy}); as transformers does, rope_scaling is used and rope_parameters ignored",
                          UserWarning, stacklevel=2)
        rope, section = legacy, "rope_scaling"
    theta = (_field(rope, "rope_theta", source, _positive, None, f"{section}.rope_theta")
             or _field(c, "rope_theta", source, _positive, 10_000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    unsupported.append((kind not in ("default", "linear", "llama3", "dynamic"),
                        f"rope scaling type {brief(kind)} is not supported; supported: default, linear, llama3, "
                        "dynamic"))
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    unsupported.append((kind != "default" and partial not in (None, 1, 1.0),   # (Llama's default rope ignores it)
                        f"partial_rotary_factor={brief(partial)} with rope type {brief(kind)}: transformers rotates "
                        "only that share of each head, OrcaModel the whole head; only 1.0 is supported"))
    why = next((why for bad, why in unsupported if bad), None)
    if why is not None:
        raise ValueError(f"{source}: {why}")

    def rope_field(key: str, check=_positive, default: Any = _REQUIRED):
        return _field(rope, key, source, check, default, label=f"{section}.{key}")

    scaling: tuple | None = None      # RopeScaling's fields, built below where a bad mix names the file
    if kind == "dynamic":       # dynamic NTK rescales only past max_position_embeddings, which OrcaModel never reaches
        rope_field("factor")
    elif kind == "linear":
        scaling = ("linear", rope_field("factor"))
    elif kind == "llama3":
        original = rope_field("original_max_position_embeddings", _count, None)
        top = _field(c, "original_max_position_embeddings", source, _count, None)
        if top is not None and original not in (None, top):
            warnings.warn(f"{source} gives original_max_position_embeddings={top} and {section}."
                          f"original_max_position_embeddings={original}; as transformers does, the top-level one is "
                          "used", UserWarning, stacklevel=2)
        scaling = ("llama3", rope_field("factor"), rope_field("low_freq_factor"), rope_field("high_freq_factor"),
                   top or original or max_context)
    n_heads = _field(c, "num_attention_heads", source, _count)
    n_kv_heads = _field(c, "num_key_value_heads", source, _count,      # (null: as many as the heads)
                        ("num_key_value_heads" not in c and defaults.n_kv_heads) or n_heads)
    hidden = _field(c, "hidden_size", source, _count)
    head_dim = _field(c, "head_dim", source, _count, hidden // n_heads)
    # said in the config's names, which ModelSpec's own refusal would not use
    if n_heads % n_kv_heads:
        raise ValueError(f"{source}: num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads "
                         f"({n_kv_heads})")
    if head_dim == 0:
        raise ValueError(f"{source}: hidden_size ({hidden}) < num_attention_heads ({n_heads}) and no head_dim "
                         f"given: a head would have 0 dimensions")
    fields = dict(n_layers=_field(c, "num_hidden_layers", source, _count),
                  intermediate=_field(c, "intermediate_size", source, _count),
                  vocab=_field(c, "vocab_size", source, _count),
                  max_context=max_context,
                  tied_embeddings=_field(c, "tie_word_embeddings", source, check_flag, False),
                  norm_eps=_field(c, "rms_norm_eps", source, _positive, 1e-6))
    try:      # what only the fields together rule out, e.g. llama3's low_freq_factor >= high_freq_factor
        return ModelSpec(name=name, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                         dtype_bytes=dtype_bytes, rope_theta=theta,
                         rope_scaling=None if scaling is None else RopeScaling(*scaling), **fields)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _refuse_quantized(c: Mapping[str, Any], source: str) -> None:
    """A config with a `quantization_config` (fp8, GPTQ, AWQ, bitsandbytes...) is refused: its weights
    are not the matrices the model multiplies by (scales, packed integers), and transformers would
    quantize even float weights on load."""
    q = c.get("quantization_config")
    if q:
        method = q.get("quant_method") if isinstance(q, Mapping) else None
        raise ValueError(f"{source}: quantization_config (quant_method {brief(method)}): quantized checkpoints are not "
                         f"supported; from_hf loads unquantized weights ({', '.join(DTYPES)})")


def read_checkpoint_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """`config.json` and the weights of a local checkpoint directory: the files and tensors that
    `model.safetensors.index.json` maps when there is one (as transformers reads a sharded checkpoint),
    else every `*.safetensors` file. A tensor in two files, a tensor the index names that its file does
    not hold (or the reverse), a weight that is not floating point or not finite: refused, with the
    tensor and the file named."""
    path = Path(path)
    cfg, index = path / "config.json", path / _INDEX
    files = sorted(path.glob("*.safetensors"))
    if not path.is_dir():
        raise ValueError(f"{quoted_path(path)} is not a directory; from_hf takes a LlamaForCausalLM or a local "
                         "checkpoint directory (config.json + *.safetensors)")
    pickled = sorted(f.name for f in path.glob("*.bin")) if cfg.is_file() and not (files or index.is_file()) else []
    if pickled:
        raise ValueError(f"{quoted_path(path)} holds PyTorch pickle weights ({brief_items(pickled)}) and no "
                         "*.safetensors: from_hf reads safetensors only (unpickling can run code); load the checkpoint "
                         "with transformers (LlamaForCausalLM.from_pretrained) and pass the model to from_hf, or "
                         "save_pretrained it to write safetensors")
    if not cfg.is_file() or not (files or index.is_file()):
        raise ValueError(f"{quoted_path(path)} needs config.json and at least one *.safetensors file; found "
                         f"{brief(sorted(p.name for p in path.iterdir()), GOT_LIMIT)}")
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError as e:
        raise ImportError("reading a checkpoint directory needs safetensors: pip install 'orca-torch[hf]'") from e
    config = _mapping(_read_json(cfg, "the model's config"), str(cfg))
    _refuse_quantized(config, str(cfg))             # before its tensors, which would be refused less clearly
    mapped = _read_index(index) if index.is_file() else None
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in sorted(mapped) if mapped is not None else files:
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f} is not a readable safetensors file: {e}") from None
        if mapped is not None:
            absent = [k for k in mapped[f] if k not in tensors]
            if absent:
                raise ValueError(f"{index} names {brief(absent[0])} in {f}, which does not hold it")
        for key, t in tensors.items():
            unmapped = mapped is not None and key not in mapped[f]
            elsewhere = origin.get(key) or (next((g for g, keys in mapped.items() if key in keys), None)
                                            if unmapped else None)
            if elsewhere is not None:
                raise ValueError(f"{brief(key)} is in both {elsewhere} and {f}; a checkpoint holds each tensor once"
                                 + (f" ({index} maps it to {elsewhere.name})" if unmapped else ""))
            if unmapped:
                raise ValueError(f"{f} holds {brief(key)}, which the index {index} does not name")
            _check_weight(key, t, str(f))
            state[key], origin[key] = t, f
    return config, state


def _read_json(f: Path, what: str) -> Any:
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except ValueError as e:         # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{f} must hold a JSON object ({what}); it is not valid JSON: {e}") from None


def _read_index(index: Path) -> dict[Path, set[str]]:
    """The files `model.safetensors.index.json` maps tensors to, each with the names it maps there."""
    weight_map = _field(_mapping(_read_json(index, "the weights' index"), str(index)), "weight_map", str(index),
                        lambda name, v: _mapping(v, name))
    files: dict[Path, set[str]] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{index}: weight_map[{brief(key)}] must be a file name, got {brief(name)}")
        f = index.parent / name
        if f not in files and not f.is_file():
            raise ValueError(f"{index} maps tensors to {quoted_path(f.name)}, which is not a file in {index.parent}")
        files.setdefault(f, set()).add(key)
    return files


def _check_weight(key: str, t: torch.Tensor, where: str) -> None:
    """A checkpoint's tensor `key` (read from `where`) is a weight of a dtype the model runs in (not,
    e.g., float8, which torch cannot even test for finite values), with finite values."""
    if t.dtype not in DTYPES.values():
        raise ValueError(f"{where}: {brief(key)} is {t.dtype}; a checkpoint's weights must be floating point, one of "
                         f"{', '.join(DTYPES)} (quantized checkpoints are not supported)")
    if t.is_meta:
        raise ValueError(f"{where}: {brief(key)} is on the meta device, a shape with no values (a model built under "
                         "init_empty_weights, or offloaded by a device_map); load its weights first, or pass the "
                         "checkpoint directory")
    bad = t.numel() - int(torch.isfinite(t).sum())
    if bad:
        raise ValueError(f"{where}: {brief(key)} holds {bad} non-finite value{'s' if bad > 1 else ''} (NaN or inf)")


@dataclass(frozen=True)
class HFCheckpoint:
    """What a transformers Llama holds, read: the `ModelSpec` its config gives, its tensors by
    transformers' names, and the dtype the model is built in. `OrcaModel.from_hf` builds the model
    from `spec` and `dtype` and fills it with `load_weights`."""
    spec: ModelSpec
    state: Mapping[str, torch.Tensor]
    dtype: torch.dtype


def read_hf(model_or_path, dtype: torch.dtype | None = None) -> HFCheckpoint:
    """The spec and tensors of a transformers Llama (instance or local directory), the head tied or
    not as transformers would load it.

    `dtype=None` keeps the checkpoint's dtype (one of `DTYPES`: every weight read is checked,
    `_check_weight`); else one of `DTYPES`, as `OrcaModel.from_hf` checked it before reading.
    """
    if isinstance(model_or_path, (str, Path)):
        config, state = read_checkpoint_dir(model_or_path)
        name = Path(model_or_path).name or "hf-llama"
        source = str(Path(model_or_path) / "config.json")
        where = str(model_or_path)
    elif hasattr(model_or_path, "config") and hasattr(model_or_path, "state_dict"):
        config = model_or_path.config.to_dict()
        state = model_or_path.state_dict()
        for key, t in state.items():
            _check_weight(key, t, "the model's state dict")
        name = config.get("_name_or_path") or "hf-llama"
        source = "the model's config"
        where = "the model's state dict"
    else:
        raise ValueError(f"from_hf takes a transformers LlamaForCausalLM or a checkpoint directory path, got "
                         f"{type(model_or_path).__name__}")
    first = state.get(_EMBED, state.get(_HEAD))
    if first is None:
        raise ValueError(f"the checkpoint has no {_EMBED!r}: not a LlamaForCausalLM state dict")
    dtype = first.dtype if dtype is None else dtype
    spec = spec_from_hf_config(config, name=str(name), dtype_bytes=torch.empty((), dtype=dtype).element_size(),
                               source=source)
    _check_layers(spec, state, source)
    if spec.tied_embeddings:
        spec, state = _tie_as_transformers(spec, state, source)
    _check_tensors(spec, state, where)
    check_range(state, dtype, f"{where}: ", "load the checkpoint in a wider dtype (dtype='bfloat16' or 'float32')")
    return HFCheckpoint(spec, state, dtype)


def check_range(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, where: str, remedy: str) -> None:
    """Every tensor fits in `dtype`: a value past its largest (float16's 65504, say, in a float32 or
    bfloat16 weight) that rounds to inf there (65520 and up; below, it rounds to 65504 as any value
    rounds) would make the model's logits NaN. `where` prefixes the message (the checkpoint),
    `remedy` ends it."""
    top = torch.finfo(dtype).max
    for key in sorted(tensors):
        t = tensors[key]
        if torch.finfo(t.dtype).max > top and t.numel():
            ends = torch.stack(torch.aminmax(t))
            if bool((ends.to(dtype).isinf() & ends.isfinite()).any()):
                raise ValueError(f"{where}{brief(key)} holds a value of magnitude {float(ends.abs().max()):.6g}, "
                                 f"past {dtype}'s largest ({top:.6g}), which it cannot hold; {remedy}")


def _check_layers(spec: ModelSpec, state: Mapping[str, torch.Tensor], source: str) -> None:
    """The checkpoint holds weights of exactly the layers its config gives (0 .. num_hidden_layers - 1):
    config and weights that disagree on the depth are named as such, rather than as the first tensor
    missing or as tensors the model has no place for."""
    found = {int(m.group(1)) for key in state if (m := _LAYER.match(key))}
    if found != set(range(spec.n_layers)):
        raise ValueError(f"{source} gives num_hidden_layers={spec.n_layers}, so the weights should be of layers "
                         f"0..{spec.n_layers - 1}, but the checkpoint holds layers {_runs(found) or '(none)'}")


def _runs(ns) -> str:
    """Integers as sorted runs: {0, 1, 2, 5} -> "0..2, 5"."""
    runs: list[list[int]] = []
    for n in sorted(ns):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def _tie_as_transformers(spec: ModelSpec, state: Mapping[str, torch.Tensor],
                         source: str) -> tuple[ModelSpec, Mapping[str, torch.Tensor]]:
    """The spec and weights of a config that says tie_word_embeddings=True, as transformers loads them: a
    stored head equal to the embedding, or none, is tied; a head stored without an embedding is the embedding
    too; a stored head that differs is kept, untied (with a warning naming both tensors)."""
    if _EMBED not in state:
        return spec, {**state, _EMBED: state[_HEAD]}
    head, embed = state.get(_HEAD), state[_EMBED]
    if head is None or (head.shape == embed.shape and head.dtype == embed.dtype and torch.equal(head, embed)):
        return spec, state
    warnings.warn(f"{source} says tie_word_embeddings=True, but the checkpoint's {_HEAD!r} differs from {_EMBED!r}; "
                  f"as transformers does, the stored head is kept and not tied", UserWarning, stacklevel=4)
    return replace(spec, tied_embeddings=False), state


def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor an `OrcaModel` of `spec` takes from a checkpoint, by transformers' name, with its shape."""
    h = spec.hidden
    shapes = {_EMBED: (spec.vocab, h), "model.norm.weight": (h,)}
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (spec.q_dim, h), p + "self_attn.k_proj.weight": (spec.kv_dim, h),
                   p + "self_attn.v_proj.weight": (spec.kv_dim, h), p + "self_attn.o_proj.weight": (h, spec.q_dim),
                   p + "mlp.gate_proj.weight": (spec.intermediate, h), p + "mlp.up_proj.weight": (spec.intermediate, h),
                   p + "mlp.down_proj.weight": (h, spec.intermediate), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    if not spec.tied_embeddings:
        shapes[_HEAD] = (spec.vocab, h)
    return shapes


def _check_tensors(spec: ModelSpec, state: Mapping[str, torch.Tensor], where: str) -> None:
    """The checkpoint holds every tensor `weight_shapes` names, in its shape, and nothing the model has no
    place for: checked on the tensors read, before the model is built (a large model's memory is not
    taken for a checkpoint that cannot fill it)."""
    shapes = weight_shapes(spec)
    for key, shape in shapes.items():
        t = state.get(key)
        if t is None:
            raise ValueError(f"{where}: the checkpoint has no {key!r}, which a Llama of its config holds")
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: {key!r} has shape {tuple(t.shape)}, the config implies {shape}")
    # A tied model's state dict lists the shared head again; some older checkpoints saved a rotary buffer.
    extra = sorted(k for k in state if k not in shapes and k != _HEAD and not k.endswith(_IGNORED))
    if extra:
        raise ValueError(f"{where}: the checkpoint holds tensors OrcaModel has no place for (e.g. biases): "
                         f"{brief(extra[:5], GOT_LIMIT)}")


def load_weights(model, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a checkpoint's tensors (`read_hf` checked their names and shapes) into `model`, an
    `OrcaModel` built from the checkpoint's spec."""
    s = model.spec
    with torch.no_grad():
        model.embed.copy_(state[_EMBED])
        for i, blk in enumerate(model.layers):
            p = f"model.layers.{i}."
            blk.wqkv.copy_(torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
            blk.wo.copy_(state[p + "self_attn.o_proj.weight"])
            blk.w_gate_up.copy_(torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]))
            blk.w_down.copy_(state[p + "mlp.down_proj.weight"])
            blk.attn_norm.copy_(state[p + "input_layernorm.weight"])
            blk.mlp_norm.copy_(state[p + "post_attention_layernorm.weight"])
        model.final_norm.copy_(state["model.norm.weight"])
        if not s.tied_embeddings:
            model.lm_head.weight.copy_(state[_HEAD])
