"""Llama configs and local checkpoint directories that `from_hf` cannot load (`hf_llama.py`).

Every checkpoint here is written into tmp_path; nothing is fetched from a hub.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

from orca_torch.model.hf_llama import read_checkpoint_dir, spec_from_hf_config  # noqa: E402
from orca_torch.model.orca_model import OrcaModel  # noqa: E402

CONFIG = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
              rope_theta=500_000.0)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def checkpoint(tmp_path, config, tensors=b""):
    """A directory with `config` (written as JSON, or as text if a str) and one safetensors file."""
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tensors:
        (tmp_path / "model.safetensors").write_bytes(tensors)
    else:
        save_file({"model.embed_tokens.weight": torch.zeros(300, 64)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def without(key):
    return {k: v for k, v in CONFIG.items() if k != key}


@pytest.mark.parametrize("config, says", [
    ([1], r"config\.json must be a JSON object \(a dict\), got \[1\] \(list\)"),
    ("{not json", r"config\.json must hold a JSON object .*not valid JSON"),
    (without("num_attention_heads"), r"config\.json has no 'num_attention_heads', which it must give"),
    ({**CONFIG, "num_attention_heads": 0}, r"config\.json: num_attention_heads must be an integer >= 1, got 0"),
    ({**CONFIG, "num_attention_heads": 4.5}, r"config\.json: num_attention_heads must be an integer >= 1, got 4\.5"),
    ({**CONFIG, "hidden_size": True}, r"config\.json: hidden_size must be an integer >= 1, got True \(a bool\)"),
    ({**CONFIG, "head_dim": 0}, r"config\.json: head_dim must be an integer >= 1, got 0"),
    ({**CONFIG, "num_key_value_heads": 0}, r"config\.json: num_key_value_heads must be an integer >= 1, got 0"),
    ({**CONFIG, "num_key_value_heads": 3},
     r"config\.json: num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ({**CONFIG, "rope_theta": "x"}, r"config\.json: rope_theta must be a finite number > 0, got 'x' \(str\)"),
    ({**CONFIG, "rope_theta": -1.0}, r"config\.json: rope_theta must be a finite number > 0, got -1\.0"),
    ({**CONFIG, "rms_norm_eps": "x"}, r"config\.json: rms_norm_eps must be a finite number > 0, got 'x' \(str\)"),
    ({**CONFIG, "tie_word_embeddings": "yes"}, r"config\.json: tie_word_embeddings must be True or False"),
    ({**CONFIG, "rope_scaling": [1]}, r"config\.json: rope_scaling must be a JSON object \(a dict\), got \[1\]"),
    ({**CONFIG, "rope_scaling": {"rope_type": "linear"}}, r"config\.json has no 'rope_scaling\.factor'"),
    ({**CONFIG, "rope_scaling": {"type": "linear", "factor": "2"}},
     r"config\.json: rope_scaling\.factor must be a finite number > 0, got '2' \(str\)"),
    ({**CONFIG, "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}},
     r"config\.json has no 'rope_scaling\.low_freq_factor'"),
    ({**CONFIG, "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 1.5}},
     r"config\.json: rope_scaling\.original_max_position_embeddings must be an integer >= 1, got 1\.5"),
    ({**CONFIG, "rope_scaling": LLAMA3, "original_max_position_embeddings": 0},
     r"config\.json: original_max_position_embeddings must be an integer >= 1, got 0"),
    ({**CONFIG, "rope_scaling": {**LLAMA3, "low_freq_factor": 4.0}},
     r"config\.json: llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor"),
    ({**CONFIG, "rope_parameters": {"rope_type": "linear", "factor": 0}},
     r"config\.json: rope_parameters\.factor must be a finite number > 0, got 0"),
    ({**CONFIG, "rope_scaling": {"rope_type": "dynamic"}}, r"config\.json has no 'rope_scaling\.factor'"),
    ({**CONFIG, "model_type": "mistral", "sliding_window": 64},
     r"config\.json: sliding_window=64 with max_position_embeddings=128: OrcaModel attends to the whole context; "
     r"only a window of at least the context \(or none\) is supported"),
    ({**CONFIG, "model_type": "mistral", "sliding_window": 0},
     r"config\.json: sliding_window=0: transformers reads only null as no window, and fails to run a window of "
     r"0; give null for no window, or a window of at least max_position_embeddings"),
    ({**CONFIG, "architectures": ["LlamaForSequenceClassification"]},
     r"config\.json: architectures=\['LlamaForSequenceClassification'\]: from_hf loads a causal language model "
     r"\(LlamaForCausalLM or MistralForCausalLM\)"),
    ({**CONFIG, "model_type": "qwen2"}, r"config\.json: from_hf loads Llama and Mistral checkpoints \(model_type "
                                        r"'llama' or 'mistral'\), got model_type 'qwen2'"),
])
def test_bad_config_json_names_the_file_and_the_field(tmp_path, config, says):
    with pytest.raises(ValueError, match=says) as e:
        OrcaModel.from_hf(checkpoint(tmp_path, config))
    assert str(tmp_path / "config.json") in str(e.value) and "\n" not in str(e.value)


def test_a_checkpoint_of_pickled_weights_only_is_refused_saying_how_to_load_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    torch.save(llama_tensors(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"holds PyTorch pickle weights \('pytorch_model\.bin'\) and no "
                                         r"\*\.safetensors: "
                                         r"from_hf reads safetensors only .* pass the model to from_hf"):
        OrcaModel.from_hf(tmp_path)


def test_the_pickled_files_of_a_checkpoint_are_named_a_few_of_them(tmp_path):
    """Every `*.bin` file's name went into the refusal: 300 shards of long names made 60,000 characters."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    from orca_torch.checks import brief

    names = [f"{'pytorch_model_shard_of_a_long_name_' * 5}{i:05d}.bin" for i in range(300)]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError) as e:
        OrcaModel.from_hf(tmp_path)
    assert f"pickle weights ({brief(names[0])}, {brief(names[1])}, ...) and no *.safetensors" in str(e.value)
    assert len(str(e.value)) < len(str(tmp_path)) + 600


def test_a_garbage_safetensors_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        read_checkpoint_dir(checkpoint(tmp_path, CONFIG, tensors=b"garbage"))


@pytest.mark.parametrize("config, says", [
    ({**CONFIG, "num_attention_heads": 0}, r"the Llama config: num_attention_heads must be an integer >= 1"),
    ({**CONFIG, "hidden_size": 2, "num_attention_heads": 4, "num_key_value_heads": 4},
     r"the Llama config: hidden_size \(2\) < num_attention_heads \(4\) and no head_dim given"),
    ("config", r"the Llama config must be a JSON object \(a dict\), got 'config' \(str\)"),
])
def test_spec_from_hf_config_refuses_bad_dicts(config, says):
    with pytest.raises(ValueError, match=says):
        spec_from_hf_config(config)


def test_a_good_config_still_gives_its_spec():
    spec = spec_from_hf_config({**CONFIG, "head_dim": 32, "rope_scaling": LLAMA3})
    assert (spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.rope_theta) == (4, 2, 32, 500_000.0)
    assert spec.rope_scaling.original_max_position == 32 and spec.norm_eps == 1e-5
    assert spec_from_hf_config({**CONFIG, "num_key_value_heads": None, "head_dim": None}).n_kv_heads == 4


# ---- the weights: an index names the files and tensors; duplicates, integers and non-finite values refused ----

def llama_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor a Llama of CONFIG's shapes holds (untied head), seeded."""
    g = torch.Generator().manual_seed(seed)
    h, i, q, kv = 64, 96, 64, 32
    shapes = {"model.embed_tokens.weight": (300, h), "model.norm.weight": (h,), "lm_head.weight": (300, h)}
    for n in range(2):
        p = f"model.layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    return {k: 0.1 * torch.randn(s, generator=g) for k, s in shapes.items()}


def sharded(tmp_path, tensors, index=True):
    """`tensors` split over two files (embedding and head in the second), with an index when `index`."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    second = {"model.embed_tokens.weight", "lm_head.weight"}
    files = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k not in second},
             "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k in second}}
    for name, part in files.items():
        save_file(part, str(tmp_path / name))
    if index:
        weight_map = {k: name for name, part in files.items() for k in part}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


def test_an_index_names_the_files_read_and_a_stray_file_is_left_alone(tmp_path):
    tensors = llama_tensors()
    path = sharded(tmp_path, tensors)
    save_file({"model.embed_tokens.weight": torch.zeros(300, 64)}, str(tmp_path / "zz-stray.safetensors"))
    config, state = read_checkpoint_dir(path)
    assert config == CONFIG and state.keys() == tensors.keys()
    assert all(torch.equal(state[k], v) for k, v in tensors.items())
    model = OrcaModel.from_hf(path)
    assert torch.equal(model.embed, tensors["model.embed_tokens.weight"])


def edit_index(path, change):
    f = path / "model.safetensors.index.json"
    f.write_text(json.dumps(change(json.loads(f.read_text()))))
    return f


@pytest.mark.parametrize("change, says", [
    (lambda ix: {**ix, "weight_map": {**ix["weight_map"], "model.extra.weight": "model-00002-of-00002.safetensors"}},
     r"names 'model\.extra\.weight' in .*model-00002-of-00002\.safetensors, which does not hold it"),
    (lambda ix: {**ix, "weight_map": {**ix["weight_map"], "model.norm.weight": "model-00009.safetensors"}},
     r"maps tensors to 'model-00009\.safetensors', which is not a file in"),
    (lambda ix: {**ix, "weight_map": {**ix["weight_map"], "model.norm.weight": f"model-{'9' * 100}.safetensors"}},
     rf"maps tensors to 'model-{'9' * 100}\.safetensors', which is not a file in"),     # (whole: a file to find)
    (lambda ix: {"weight_map": {k: v for k, v in ix["weight_map"].items() if k != "model.norm.weight"}},
     r"model-00001-of-00002\.safetensors holds 'model\.norm\.weight', which the index .* does not name"),
    (lambda ix: {"weight_map": [1]}, r"model\.safetensors\.index\.json: weight_map must be a JSON object"),
    (lambda ix: {"metadata": {}}, r"model\.safetensors\.index\.json has no 'weight_map'"),
    (lambda ix: {"weight_map": {"model.norm.weight": 3}},
     r"model\.safetensors\.index\.json: weight_map\['model\.norm\.weight'\] must be a file name, got 3"),
    (lambda ix: {"weight_map": {"model.norm.weight": [0] * 100_000}},     # (quoted in a line, not whole)
     r"weight_map\['model\.norm\.weight'\] must be a file name, got \[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \.\.\.\]$"),
])
def test_an_index_that_does_not_match_its_files_is_refused(tmp_path, change, says):
    path = sharded(tmp_path, llama_tensors())
    edit_index(path, change)
    with pytest.raises(ValueError, match=says):
        read_checkpoint_dir(path)


def test_an_index_that_is_not_json_is_named(tmp_path):
    path = sharded(tmp_path, llama_tensors())
    (path / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json must hold a JSON object .*not valid JSON"):
        read_checkpoint_dir(path)


def test_a_tensor_in_two_files_is_refused_naming_both(tmp_path):
    path = sharded(tmp_path, llama_tensors(), index=False)
    save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / "model-extra.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is in both .*model-00001-of-00002\.safetensors and "
                                         r".*model-extra\.safetensors"):
        read_checkpoint_dir(path)
    path = sharded(tmp_path, llama_tensors(), index=True)      # a listed file holding a tensor mapped elsewhere
    save_file({"model.norm.weight": torch.ones(64), "lm_head.weight": torch.ones(300, 64),
               "model.embed_tokens.weight": torch.ones(300, 64)},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is in both .*model-00001-of-00002\.safetensors and "
                                         r".*model-00002-of-00002\.safetensors"):
        read_checkpoint_dir(path)


@pytest.mark.parametrize("bad, says", [
    (torch.ones(64, dtype=torch.int32), r"'model\.norm\.weight' is torch\.int32; a checkpoint's weights must be "
                                        r"floating point"),
    (torch.full((64,), float("nan")), r"'model\.norm\.weight' holds 64 non-finite values \(NaN or inf\)"),
    (torch.tensor([float("inf")] + [1.0] * 63), r"'model\.norm\.weight' holds 1 non-finite value \(NaN or inf\)"),
])
@pytest.mark.parametrize("index", [True, False])
def test_integer_and_non_finite_weights_are_refused_naming_the_tensor_and_file(tmp_path, bad, says, index):
    path = sharded(tmp_path, {**llama_tensors(), "model.norm.weight": bad}, index=index)
    with pytest.raises(ValueError, match=r"model-00001-of-00002\.safetensors: " + says):
        OrcaModel.from_hf(path)


def test_a_state_dict_with_non_finite_weights_is_refused():
    class Instance:       # what from_hf reads of a transformers model: its config and its state dict
        def __init__(self, state):
            self.config = type("Config", (), {"to_dict": lambda _: dict(CONFIG)})()
            self.state_dict = lambda: state

    OrcaModel.from_hf(Instance(llama_tensors()))
    tensors = llama_tensors()
    tensors["lm_head.weight"][5, 7] = float("nan")
    with pytest.raises(ValueError, match=r"the model's state dict: 'lm_head\.weight' holds 1 non-finite value"):
        OrcaModel.from_hf(Instance(tensors))


def test_a_model_whose_weights_are_on_the_meta_device_is_refused_by_name():
    """A transformers model built under `init_empty_weights` (or offloaded by a device_map) holds shapes
    with no values: named and refused, not a torch error about `.item()`."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    with torch.device("meta"):
        empty = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"the model's state dict: 'model\.embed_tokens\.weight' is on the meta "
                                         r"device, a shape with no values .*; load its weights first"):
        OrcaModel.from_hf(empty)


@pytest.mark.parametrize("n_layers, holds", [(1, "0..1"), (3, "0..1"), (2, "0, 2")])
def test_layers_other_than_the_config_gives_are_named_expected_and_found(tmp_path, n_layers, holds):
    tensors = llama_tensors()
    if holds == "0, 2":                           # the config's depth, but a layer misnumbered
        tensors = {k.replace("model.layers.1.", "model.layers.2."): v for k, v in tensors.items()}
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": n_layers}))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        OrcaModel.from_hf(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'config.json'} gives num_hidden_layers={n_layers}, so the weights should be "
                            f"of layers 0..{n_layers - 1}, but the checkpoint holds layers {holds}")


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_a_weight_past_the_asked_dtypes_range_is_refused_not_loaded_as_inf(tmp_path, stored):
    """A float32 or bfloat16 weight of 2**17 loaded as float16 would be inf (its largest is 65504), and the
    model's logits NaN: refused naming the tensor, its value and the range; in a wider dtype it loads."""
    tensors = {k: v.to(stored) for k, v in llama_tensors().items()}
    tensors["model.layers.1.post_attention_layernorm.weight"][5] = -2.0 ** 17
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.post_attention_layernorm\.weight' holds a value of "
                                         r"magnitude 131072, past torch\.float16's largest \(65504\), which it "
                                         r"cannot hold; load the checkpoint in a wider dtype"):
        OrcaModel.from_hf(tmp_path, dtype="float16")
    model = OrcaModel.from_hf(tmp_path, dtype="bfloat16")
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters()) and model.layers[1].mlp_norm[5] == -2.0 ** 17


@pytest.mark.parametrize("value, loads_as", [(65519.0, 65504.0), (65520.0, None), (-65519.0, -65504.0)])
def test_a_weight_that_rounds_to_the_dtypes_largest_loads_and_one_that_rounds_to_inf_is_refused(tmp_path, value,
                                                                                                 loads_as):
    """float16 holds up to 65504, and a float32 value below 65520 rounds to it, as every weight is
    rounded: only a value that would become inf is refused."""
    tensors = llama_tensors()
    tensors["model.layers.1.post_attention_layernorm.weight"][5] = value
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    if loads_as is None:
        with pytest.raises(ValueError, match=r"'model\.layers\.1\.post_attention_layernorm\.weight' holds a value "
                                             r"of magnitude 65520, past torch\.float16's largest \(65504\)"):
            OrcaModel.from_hf(tmp_path, dtype="float16")
    else:
        assert OrcaModel.from_hf(tmp_path, dtype="float16").layers[1].mlp_norm[5] == loads_as


def test_float8_weights_are_refused_by_dtype_not_by_a_torch_error(tmp_path):
    """torch cannot test a float8 tensor for finite values; such a weight is named and refused as a dtype."""
    tensors = llama_tensors()
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"model-00001-of-00002\.safetensors: 'model\.layers\.0\.mlp\.up_proj\.weight' "
                                         r"is torch\.float8_e4m3fn; a checkpoint's weights must be floating point, "
                                         r"one of float32, bfloat16, float16, float64 \(quantized checkpoints"):
        OrcaModel.from_hf(sharded(tmp_path, tensors))


@pytest.mark.parametrize("index", [True, False])
def test_a_quantized_checkpoint_is_refused_by_its_config_before_its_tensors(tmp_path, index):
    """Scales and float8 weights of an fp8 checkpoint, or float weights under a quantization_config (which
    transformers would quantize on load): the config's quantization_config is named."""
    tensors = llama_tensors()
    tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(4, 4)
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].to(
        torch.float8_e4m3fn)
    path = sharded(tmp_path, tensors, index=index)
    (path / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": {"quant_method": "fp8"}}))
    says = (r"config\.json: quantization_config \(quant_method 'fp8'\): quantized checkpoints are not supported; "
            r"from_hf loads unquantized weights \(float32, bfloat16, float16, float64\)")
    with pytest.raises(ValueError, match=says):
        OrcaModel.from_hf(path)
    with pytest.raises(ValueError, match=says):
        spec_from_hf_config({**CONFIG, "quantization_config": {"quant_method": "fp8"}}, source="config.json")


def _with(change):
    tensors = llama_tensors()
    change(tensors)
    return tensors


@pytest.mark.parametrize("tensors, says", [
    (_with(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
     r"the checkpoint has no 'model\.layers\.1\.mlp\.up_proj\.weight', which a Llama of its config holds"),
    (_with(lambda t: t.pop("lm_head.weight")), r"the checkpoint has no 'lm_head\.weight'"),
    (_with(lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(97, 64)})),
     r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(97, 64\), the config implies \(96, 64\)"),
    (_with(lambda t: t.update({"model.norm.weight": torch.zeros(64, 1)})),
     r"'model\.norm\.weight' has shape \(64, 1\), the config implies \(64,\)"),
    (_with(lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})),
     r"the checkpoint holds tensors OrcaModel has no place for \(e\.g\. biases\): "
     r"\['model\.layers\.0\.self_attn\.q_proj\.bias'\]"),
])
def test_missing_misshaped_or_extra_tensors_are_refused_naming_the_checkpoint_before_a_model_is_built(
        tmp_path, monkeypatch, tensors, says):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors, str(tmp_path / "model.safetensors"))

    def not_built(*args, **kwargs):
        raise AssertionError("a model was built for a checkpoint that cannot fill it")

    monkeypatch.setattr(OrcaModel, "__init__", not_built)
    with pytest.raises(ValueError, match="^" + re.escape(str(tmp_path)) + ": " + says):
        OrcaModel.from_hf(tmp_path)
