"""`OrcaModel.from_hf` is a faithful Llama: logits and greedy tokens equal transformers' own."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402

from orca_torch.core.batch import SeqWork  # noqa: E402
from orca_torch.core.engine import Engine  # noqa: E402
from orca_torch.core.memory import ReservationMemory  # noqa: E402
from orca_torch.core.paged_memory import PagedMemory  # noqa: E402
from orca_torch.core.request import Request  # noqa: E402
from orca_torch.core.scheduler_config import SchedulerConfig  # noqa: E402
from orca_torch.model.hf_llama import spec_from_hf_config  # noqa: E402
from orca_torch.model.orca_model import OrcaModel, generate_alone, rope_inv_freq  # noqa: E402
from orca_torch.model.paged_kv_cache import PagedKVManager  # noqa: E402
from orca_torch.model.torch_executor import TorchExecutor  # noqa: E402

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    "gqa": dict(num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500_000.0),
    "tied-llama3-rope": dict(num_key_value_heads=1, tie_word_embeddings=True, head_dim=32,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}


def hf_model(name: str, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**BASE, **CONFIGS[name])).eval()


def orca_logits_per_position(model: OrcaModel, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits at positions prefill-1 .. len-1: one prefill, then one decode step per token."""
    kv = model.new_kv(len(ids))
    kv.reserve(0, len(ids))
    out = [model.forward_batch(ids[:prefill], [SeqWork(prefill, 0)], [0], kv)[0]]
    for k in range(prefill, len(ids)):
        out.append(model.forward_batch(ids[k:k + 1], [SeqWork(1, k)], [0], kv)[0])
    return torch.stack(out)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_tokens_equal_transformers(name):
    hf = hf_model(name)
    model = OrcaModel.from_hf(hf)
    s = model.spec
    assert s.tied_embeddings == (name != "gqa")
    assert s.n_params == sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for path in ("split", "fused"):
        model.attention = path
        got = orca_logits_per_position(model, ids, 7)
        assert (got - ref[6:]).abs().max() < 1e-5
    gen = hf.generate(ids[None, :9], max_new_tokens=12, do_sample=False)[0, 9:].tolist()
    assert generate_alone(model, ids[:9].tolist(), 12) == gen


def test_llama3_rope_scaling_is_applied_and_needed():
    """Without the scaling the same weights give other logits: the match above depends on it."""
    hf = hf_model("tied-llama3-rope")
    model = OrcaModel.from_hf(hf)
    assert model.spec.rope_scaling is not None and model.spec.rope_scaling.kind == "llama3"
    unscaled = OrcaModel(replace(model.spec, rope_scaling=None))
    unscaled.load_state_dict(model.state_dict())
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, 6:]
    assert (orca_logits_per_position(model, ids, 7) - ref).abs().max() < 1e-5
    assert (orca_logits_per_position(unscaled, ids, 7) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rotary_tables_round_the_exact_angle_once_where_transformers_drifts_in_float32(name):
    """`rope_inv_freq`'s docstring: our tables are cos and sin of the float64 angle, rounded once;
    transformers' (float32 angles) agree within rounding over the tests' 40 positions and drift from
    them further out (4e-5 by 2,048 positions at head_dim 16 and theta 5e5)."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**BASE, "max_position_embeddings": 2048}, **CONFIGS[name])).eval()
    model = OrcaModel.from_hf(hf)
    pos = torch.arange(2048)
    angles = pos[:, None].double() * rope_inv_freq(model.spec)[None, :]
    assert torch.equal(model.rope_cos, angles.cos().float()) and torch.equal(model.rope_sin, angles.sin().float())
    with torch.no_grad():
        cos, sin = hf.model.rotary_emb(torch.zeros(1), pos[None])
    half = model.spec.head_dim // 2
    for theirs, ours in ((cos[0], model.rope_cos), (sin[0], model.rope_sin)):
        assert torch.equal(theirs[:, :half], theirs[:, half:])
        gap = (theirs[:, :half] - ours).abs()
        assert gap[:40].max() < 4e-6 and gap.max() > 1e-5


def test_partial_rotary_factor_with_the_default_rope_loads_as_transformers_reads_it():
    """Llama's default rope rotates the whole head whatever `partial_rotary_factor` says (the scaled
    kinds honour it, and are refused): the checkpoint loads and its logits are transformers' own."""
    torch.manual_seed(5)
    hf = LlamaForCausalLM(LlamaConfig(**BASE, **CONFIGS["gqa"], partial_rotary_factor=0.5)).eval()
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, 6:]
    assert (orca_logits_per_position(OrcaModel.from_hf(hf), ids, 7) - ref).abs().max() < 1e-5


def engine_tokens(model: OrcaModel, prompts: list[list[int]], n_new: int, paged: bool) -> list[list[int]]:
    """Each prompt's greedy tokens, the prompts served together by the engine (selective batching)."""
    if paged:
        kv, mem = PagedKVManager(model.spec, 16, block_size=16), PagedMemory(256, block_size=16)
    else:
        kv, mem = model.new_kv(256), ReservationMemory(256, "max")
    reqs = [Request(i, float(i), len(p), n_new, max_tokens=len(p) + n_new, prompt_ids=p) for i, p in enumerate(prompts)]
    Engine(TorchExecutor(model, kv, clock="iterations"), mem, SchedulerConfig(max_bs=4)).run(reqs)
    return [r.output_ids for r in reqs]


EQUIVALENT = {      # configs transformers runs as the plain Llama up to max_position_embeddings
    "dynamic-rope": (LlamaForCausalLM, LlamaConfig(**BASE, num_key_value_heads=2, rope_scaling={
        "rope_type": "dynamic", "factor": 4.0})),
    "mistral-no-window": (MistralForCausalLM, MistralConfig(**BASE, num_key_value_heads=1, sliding_window=None)),
    "mistral-window-of-the-context": (MistralForCausalLM, MistralConfig(**BASE, num_key_value_heads=2,
                                                                       sliding_window=128)),
}


@pytest.mark.parametrize("name", list(EQUIVALENT))
def test_a_dynamic_rope_and_a_mistral_without_a_binding_window_load_as_transformers_runs_them(tmp_path, name):
    """Logits to the last position, and greedy tokens alone and batched by the engine (both attention
    paths, flat and paged K/V), equal transformers' own."""
    cls, config = EQUIVALENT[name]
    torch.manual_seed(9)
    cls(config).save_pretrained(tmp_path)
    ref = cls.from_pretrained(tmp_path).eval()
    model = OrcaModel.from_hf(tmp_path)
    ids = torch.randint(0, 300, (128,), generator=torch.Generator().manual_seed(10))
    expected = hf_logits(ref, ids)
    prompts = [ids[:9].tolist(), ids[20:25].tolist(), ids[40:51].tolist()]
    gen = [ref.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p):].tolist() for p in prompts]
    for path in ("split", "fused"):
        model.attention = path
        assert (orca_logits_per_position(model, ids, 64) - expected[63:]).abs().max() < 1e-5
        assert [generate_alone(model, p, 20) for p in prompts] == gen
        for paged in (False, True):
            assert engine_tokens(model, prompts, 20, paged) == gen, (path, paged)


def test_a_mistral_config_leaving_fields_out_reads_as_transformers_reads_it():
    """An absent num_key_value_heads is Mistral's 8 (Llama's: as many as the heads), a null one as many
    as the heads; an absent sliding_window is 4096, which spans a context of 128."""
    cfg = {**MistralConfig(**{**BASE, "num_attention_heads": 16}).to_dict()}
    for key in ("num_key_value_heads", "sliding_window", "head_dim"):
        cfg.pop(key)
    ref = MistralConfig.from_dict(cfg)
    spec = spec_from_hf_config(cfg)
    assert (spec.n_kv_heads, spec.head_dim) == (ref.num_key_value_heads, ref.head_dim) == (8, 4)
    assert ref.sliding_window == 4096
    assert spec_from_hf_config({**cfg, "num_key_value_heads": None}).n_kv_heads == 16


def test_loads_a_saved_checkpoint_directory(tmp_path):
    hf = hf_model("gqa", seed=4)
    hf.save_pretrained(tmp_path)
    from_dir = OrcaModel.from_hf(tmp_path)
    from_obj = OrcaModel.from_hf(hf)
    assert from_dir.spec == replace(from_obj.spec, name=from_dir.spec.name)
    for a, b in zip(from_dir.parameters(), from_obj.parameters()):
        assert torch.equal(a, b)
    ids = [3, 14, 15, 92, 65]
    assert generate_alone(from_dir, ids, 6) == generate_alone(from_obj, ids, 6)


def test_loading_draws_no_random_weights_first(monkeypatch):
    """The checkpoint's weights go into a model built without an init (for Llama-3-8B the random
    init alone was minutes of work and a second copy of the weights)."""
    hf = hf_model("gqa", seed=5)
    want = OrcaModel.from_hf(hf)

    def no_init(self, seed):
        raise AssertionError("from_hf drew random weights")
    monkeypatch.setattr(OrcaModel, "_init_weights", no_init)
    got = OrcaModel.from_hf(hf, dtype="bfloat16")
    assert got.dtype == torch.bfloat16
    for a, b in zip(want.parameters(), got.parameters()):
        assert torch.equal(a.to(torch.bfloat16), b)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0]


def save_with_tensors(hf: LlamaForCausalLM, path, change) -> None:
    """`hf` saved to `path`, then its safetensors file rewritten with `change(tensors)` applied."""
    from safetensors.torch import load_file, save_file

    hf.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def other_head(tensors):
    tensors["lm_head.weight"] = 0.02 * torch.randn(300, 64, generator=torch.Generator().manual_seed(7))


def same_head(tensors):
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()


def head_only(tensors):
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")


@pytest.mark.parametrize("change, tied", [(other_head, False), (same_head, True), (head_only, True)],
                         ids=["own-head", "head-equal-to-embedding", "head-without-embedding"])
def test_a_tied_config_follows_the_stored_head_as_transformers_does(tmp_path, change, tied):
    """tie_word_embeddings=True with an `lm_head.weight` in the checkpoint: transformers ties only a head
    equal to the embedding (or the one tensor there is) and keeps a different one; so does from_hf."""
    save_with_tensors(hf_model("tied-llama3-rope", seed=6), tmp_path, change)
    ref = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert ref.config.tie_word_embeddings
    assert (ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()) == tied
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3))
    expected = hf_logits(ref, ids)
    for source in (tmp_path, ref):
        if tied:
            model = OrcaModel.from_hf(source)
        else:
            with pytest.warns(UserWarning, match=r"tie_word_embeddings=True.*'lm_head\.weight'.*differs from "
                                                 r"'model\.embed_tokens\.weight'"):
                model = OrcaModel.from_hf(source)
        assert model.spec.tied_embeddings == tied
        assert model.spec.n_params == sum(p.numel() for p in ref.parameters())
        assert (orca_logits_per_position(model, ids, 7) - expected[6:]).abs().max() < 1e-5
        gen = ref.generate(ids[None, :9], max_new_tokens=8, do_sample=False)[0, 9:].tolist()
        assert generate_alone(model, ids[:9].tolist(), 8) == gen


ROPE_CONFLICTS = {     # rope_parameters and a legacy rope_scaling in one config, as an older tool may write
    "default-vs-linear": dict(rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
                              rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "theta-at-top-and-type-key": dict(rope_theta=20_000.0, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 500_000.0},
                                      rope_scaling={"type": "linear", "factor": 4.0}),
    "linear-vs-llama3-without-original": dict(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000.0},
        rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    "rope-type-beats-type": dict(rope_parameters={"rope_type": "linear", "factor": 2.0},
                                 rope_scaling={"rope_type": "default", "type": "linear", "factor": 3.0}),
    "empty-rope-scaling": dict(rope_theta=20_000.0, rope_parameters={"rope_type": "linear", "factor": 2.0},
                               rope_scaling={}),
}


@pytest.mark.parametrize("name", list(ROPE_CONFLICTS))
def test_conflicting_rope_fields_resolve_as_transformers_does(tmp_path, name):
    """Both fields in config.json: transformers' config standardization decides which rope the model gets;
    from_hf's logits, from the directory and from transformers' instance, equal its own to the last position."""
    hf_model("gqa", seed=8).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        cfg.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **ROPE_CONFLICTS[name]}))
    ref = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 300, (128,), generator=torch.Generator().manual_seed(4))    # up to the last position
    expected = hf_logits(ref, ids)
    conflict = bool(ROPE_CONFLICTS[name]["rope_scaling"])
    for source in (tmp_path, ref):
        if conflict and source is tmp_path:
            with pytest.warns(UserWarning, match=r"gives both rope_parameters and rope_scaling.*rope_scaling"):
                model = OrcaModel.from_hf(source)
        else:
            model = OrcaModel.from_hf(source)
        assert (orca_logits_per_position(model, ids, 64) - expected[63:]).abs().max() < 1e-5, source
    if name == "default-vs-linear":        # the scaling the transformers applies, and its default theta
        spec = OrcaModel.from_hf(ref).spec
        assert (spec.rope_scaling.kind, spec.rope_scaling.factor, spec.rope_theta) == ("linear", 4.0, 10_000.0)


@pytest.mark.parametrize("in_rope", [None, 64], ids=["only-at-the-top", "the-rope-differs"])
def test_a_top_level_original_max_position_embeddings_sets_llama3s_as_transformers_does(tmp_path, in_rope):
    """A config.json with `original_max_position_embeddings` beside a llama3 rope (as Phi-3's tools write it):
    transformers' config standardization puts the top-level value into the rope, over the rope's own; so
    does from_hf (with a warning where the two differ), and its logits equal transformers'."""
    hf_model("gqa", seed=9).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        cfg.pop(key, None)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    if in_rope is not None:
        rope["original_max_position_embeddings"] = in_rope
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_scaling": rope,
                                                      "original_max_position_embeddings": 16}))
    ref = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert ref.config.rope_parameters["original_max_position_embeddings"] == 16
    ids = torch.randint(0, 300, (128,), generator=torch.Generator().manual_seed(5))
    expected = hf_logits(ref, ids)
    for source in (tmp_path, ref):
        if in_rope is not None and source is tmp_path:
            with pytest.warns(UserWarning, match=r"original_max_position_embeddings=16 and rope_scaling\."
                                                 r"original_max_position_embeddings=64.*top-level one is used"):
                model = OrcaModel.from_hf(source)
        else:
            model = OrcaModel.from_hf(source)
        assert model.spec.rope_scaling.original_max_position == 16
        assert (orca_logits_per_position(model, ids, 64) - expected[63:]).abs().max() < 1e-5, source


@pytest.mark.parametrize("change, match", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
    ({"sliding_window": 64}, "sliding_window"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "partial_rotary_factor": 0.5},
     "partial_rotary_factor=0.5 with rope type 'linear'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor=0.25"),
    ({"model_type": "qwen2"}, "model_type 'qwen2'"),
    ({"model_type": "mistral", "sliding_window": 127}, "sliding_window=127 with max_position_embeddings=128"),
    ({"model_type": "mistral", "max_position_embeddings": 8192},      # (transformers' Mistral default window)
     "sliding_window=4096 with max_position_embeddings=8192"),
])
def test_unrepresentable_configs_are_refused(change, match):
    cfg = {**LlamaConfig(**BASE, num_key_value_heads=2).to_dict()}
    cfg.pop("rope_parameters", None)
    cfg.update(change)
    with pytest.raises(ValueError, match=match):
        spec_from_hf_config(cfg)


def test_swish_is_silu_by_its_other_name():
    cfg = {**LlamaConfig(**BASE, num_key_value_heads=2).to_dict()}
    cfg.pop("rope_parameters", None)
    assert spec_from_hf_config({**cfg, "hidden_act": "swish"}) == spec_from_hf_config({**cfg, "hidden_act": "silu"})


def test_bad_paths_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        OrcaModel.from_hf(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="safetensors"):
        OrcaModel.from_hf(tmp_path)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        OrcaModel.from_hf(42)


def test_dtype_by_name_or_torch_dtype_and_a_bad_one_says_what_is_allowed():
    hf = hf_model("gqa")
    assert OrcaModel.from_hf(hf, dtype="bfloat16").dtype == torch.bfloat16
    assert OrcaModel.from_hf(hf, dtype=torch.float16).dtype == torch.float16
    with pytest.raises(ValueError, match=r"one of float32, bfloat16, float16, float64 \(a torch dtype or its name\), got 'fp8'"):
        OrcaModel.from_hf(hf, dtype="fp8")
    with pytest.raises(ValueError, match="got torch.int8"):
        OrcaModel.from_hf(hf, dtype=torch.int8)


def _load_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "serve_llama.py"
    spec = importlib.util.spec_from_file_location("serve_llama", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def word_tokenizer(n_words: int = 297):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(n_words)]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def example_usage_error(example, argv, capsys) -> str:
    """The example's one-line usage error (exit code 2, nothing on stdout) for these arguments."""
    with pytest.raises(SystemExit) as exc:
        example.main(argv)
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == ""
    lines = out.err.strip().splitlines()
    assert ": error: " in lines[-1] and "Traceback" not in out.err
    return lines[-1]


def test_example_serves_prompts_through_the_engine(tmp_path, capsys):
    tok = word_tokenizer()
    hf = hf_model("gqa", seed=5)
    hf.save_pretrained(tmp_path)
    example = _load_example()
    assert "no tokenizer" in example_usage_error(example, [str(tmp_path), "--prompt", "w1 w2"], capsys)
    assert "give the path" in example_usage_error(example, [], capsys)
    tok.save_pretrained(tmp_path)
    prompts = ["w5 w6 w7", "w10 w200 w3 w4 w9"]
    assert example.main([str(tmp_path), "--prompt", prompts[0], "--prompt", prompts[1], "--new-tokens", "6",
                         "--attention", "fused", "--json"]) == 0
    printed = capsys.readouterr()
    out = json.loads(printed.out)
    model = OrcaModel.from_hf(hf)
    assert f": {model.spec.n_params:,} params," in printed.err      # (a test checkpoint's few: not "0M")
    for o, p in zip(out, prompts):
        assert o["prompt"] == p
        assert o["output_ids"] == generate_alone(model, tok(p)["input_ids"], 6)
        upto_eos = o["output_ids"][: (o["output_ids"] + [2]).index(2)]
        assert p + o["completion"] == tok.decode(tok(p)["input_ids"] + upto_eos, skip_special_tokens=True)


def test_example_prints_a_space_between_a_prompt_of_unknown_words_and_its_continuation(tmp_path, capsys):
    """A prompt the word-level tokenizer does not know is all `<unk>`: the printed text is the prompt,
    a space, then the words generated (decoded alone, they would follow the prompt with no space)."""
    tok = word_tokenizer()
    hf_model("gqa", seed=5).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    prompt = "The capital of France is"
    assert set(tok(prompt)["input_ids"]) == {tok.unk_token_id}
    assert _load_example().main([str(tmp_path), "--prompt", prompt, "--new-tokens", "6", "--json"]) == 0
    ids = json.loads(capsys.readouterr().out)[0]["output_ids"]
    words = tok.decode(ids[: (ids + [2]).index(2)], skip_special_tokens=True)
    assert words                                        # (seed 5 makes words before any end of sequence)
    assert _load_example().main([str(tmp_path), "--prompt", prompt, "--new-tokens", "6"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == f"{prompt} {words}"


def test_example_cuts_a_completion_at_an_end_of_turn_its_generation_config_lists(tmp_path, capsys):
    tok = word_tokenizer()
    hf_model("gqa", seed=5).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    example = _load_example()
    argv = [str(tmp_path), "--prompt", "w5 w6 w7", "--new-tokens", "6", "--json"]
    assert example.main(argv) == 0
    ids = json.loads(capsys.readouterr().out)[0]["output_ids"]
    turn_end = next(t for t in ids[1:] if t != 2 and t != ids[0])   # (a token it makes after its first)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, turn_end]}))
    assert example.main(argv) == 0
    out = json.loads(capsys.readouterr().out)[0]
    assert out["output_ids"] == ids                     # the run is the same; the text stops at the end of turn
    cut = ids[:ids.index(turn_end)]
    assert "w5 w6 w7" + out["completion"] == tok.decode(tok("w5 w6 w7")["input_ids"] + cut, skip_special_tokens=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Four checkpoint directories with a tokenizer: a good one, one with no weights, one with GELU, one whose
    config.json has a field of the wrong type that only transformers reads (its tokenizer loader refuses it)."""
    root = tmp_path_factory.mktemp("ckpt")
    tok, hf = word_tokenizer(), hf_model("gqa", seed=5)
    dirs = {name: root / name for name in ("good", "no-weights", "gelu", "bad-field")}
    for name, d in dirs.items():
        hf.save_pretrained(d)
        tok.save_pretrained(d)
    for f in dirs["no-weights"].glob("*.safetensors"):
        f.unlink()
    cfg = json.loads((dirs["gelu"] / "config.json").read_text())
    (dirs["gelu"] / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    (dirs["bad-field"] / "config.json").write_text(json.dumps({**cfg, "initializer_range": "x"}))
    (root / "a-file").write_text("not a checkpoint")
    return root, dirs


def test_example_refuses_bad_input_with_one_line_before_serving(checkpoints, capsys):
    root, dirs = checkpoints
    example, good = _load_example(), str(dirs["good"])
    cases = [
        ([str(root / "missing")], f"{str(root / 'missing')!r} does not exist"),
        ([str(root / "a-file")], "is not a directory"),
        ([good, "--device", "foo"], "argument --device: unknown device 'foo'"),
        ([good, "--prompt", ""], "argument --prompt: must be non-empty text, got ''"),
        ([good, "--prompt", "   "], "argument --prompt: must be non-empty text"),
        ([good, "--prompt", "w5 \udcff"],         # (a byte of the command line that is no UTF-8, as Python keeps it)
         "argument --prompt: must be a prompt (UTF-8 text), got 'w5 \\udcff'"),
        ([good, "--new-tokens", "0"], "argument --new-tokens: must be an integer >= 1, got '0'"),
        ([good, "--new-tokens", "200", "--prompt", "w1 w2", "--prompt", "w3"],     # (it said no more than this)
         "prompts [0, 1] + 200 new tokens exceed the model's context 128: give --new-tokens 126 at most"),
        ([good, "--new-tokens", "1", "--prompt", "w1", "--prompt", " ".join(["w2"] * 128)],
         "prompts [1] + 1 new token exceed the model's context 128: give prompts of at most 127 tokens (the "
         "longest has 128)"),
        ([str(dirs["no-weights"])], "needs config.json and at least one *.safetensors file"),
        ([str(dirs["gelu"])], "hidden_act='gelu': OrcaModel's MLP is SwiGLU"),
        ([str(dirs["bad-field"])], f"cannot load the tokenizer in {str(dirs['bad-field'])!r}: StrictDataclassField"
         "ValidationError: Validation error for field 'initializer_range': TypeError: Field 'initializer_range' "
         "expected float, got str (value: 'x')"),
    ]
    if not torch.cuda.is_available():
        cases.append(([good, "--device", "cuda"], "torch.cuda.is_available() is False"))
    for argv, says in cases:
        assert says in example_usage_error(example, argv, capsys), argv
    assert example.main([good, "--prompt", "w5", "--new-tokens", "2", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)[0]["output_ids"]) == 2


def test_example_refuses_a_tokenizer_whose_ids_exceed_the_vocabulary(tmp_path, capsys):
    """A tokenizer of 400 words on a model of 300: the ids past 299 are named in the usage error."""
    hf_model("gqa", seed=5).save_pretrained(tmp_path)
    word_tokenizer(397).save_pretrained(tmp_path)
    example = _load_example()
    says = example_usage_error(example, [str(tmp_path), "--prompt", "w5 w6", "--prompt", "w350 w7 w396"], capsys)
    assert says.endswith("prompt 1 has token ids [353, 399] outside the model's vocabulary (ids 0..299); is the "
                         "tokenizer the checkpoint's own?")
    assert example.main([str(tmp_path), "--prompt", "w5 w6", "--new-tokens", "2", "--json"]) == 0
