"""Llama configs and local checkpoint directories that `from_hf` cannot load (`hf_llama.py`).

Every checkpoint here is written into tmp_path; nothing is fetched from a hub.
"""
from __future__ import annotations

import json

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
    (without("num_attention_heads"), r"config\.json has no 'num_attention_heads'; a Llama config must give it"),
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
    ({**CONFIG, "rope_scaling": {**LLAMA3, "low_freq_factor": 4.0}},
     r"config\.json: llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor"),
    ({**CONFIG, "rope_parameters": {"rope_type": "linear", "factor": 0}},
     r"config\.json: rope_parameters\.factor must be a finite number > 0, got 0"),
])
def test_bad_config_json_names_the_file_and_the_field(tmp_path, config, says):
    with pytest.raises(ValueError, match=says) as e:
        OrcaModel.from_hf(checkpoint(tmp_path, config))
    assert str(tmp_path / "config.json") in str(e.value) and "\n" not in str(e.value)


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
