"""The Llama-style model: shapes from the ModelSpec, seeding, dtypes and devices, input checking,
the padded reference path and greedy generation (§4.2, §5.1)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from orca_torch.core.batch import SeqWork
from orca_torch.core.request import Request
from orca_torch.model.kv_cache import KVManager
from orca_torch.model.paged_kv_cache import PagedKVManager
from orca_torch.model.orca_model import OrcaModel, generate_alone, rope_inv_freq
from orca_torch.specs import RopeScaling, get_model_spec


@pytest.fixture(scope="module")
def tiny() -> OrcaModel:
    return OrcaModel("tiny", seed=0)


def _prefill_logits(model: OrcaModel, tokens: list[int]) -> torch.Tensor:
    kv = model.new_kv(len(tokens))
    kv.reserve(0, len(tokens))
    return model.forward_batch(torch.tensor(tokens), [SeqWork(len(tokens), 0)], [0], kv)[0]


@pytest.mark.parametrize("name", ["tiny", "mini"])
def test_parameter_count_is_the_specs(name):
    spec = get_model_spec(name)
    model = OrcaModel(name)
    assert sum(p.numel() for p in model.parameters()) == spec.n_params
    assert model.lm_head.weight.data_ptr() != model.embed.data_ptr()          # untied head
    assert model.layers[0].wqkv.shape == (spec.q_dim + 2 * spec.kv_dim, spec.hidden)  # GQA: fewer K/V heads
    if name == "mini":
        assert 12_500_000 < spec.n_params < 13_500_000          # the lecture's ~13M-parameter model


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = OrcaModel("tiny", seed=5), OrcaModel("tiny", seed=5), OrcaModel("tiny", seed=6)
    for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.layers[1].w_down, c.layers[1].w_down)
    state = torch.random.get_rng_state()
    OrcaModel("tiny", seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)     # init uses its own Generator


def test_the_seed_gives_the_same_weights_whatever_torch_default_dtype():
    a = OrcaModel("tiny", seed=5)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        b = OrcaModel("tiny", seed=5)
    finally:
        torch.set_default_dtype(before)
    assert b.dtype == torch.float32
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_seeded_inputs_and_timing_state_whatever_torch_default_dtype(tiny):
    from clipper.torch_models import make_model
    from orca_torch.model.accounting import _decoding_requests

    def drawn():
        kv, past = _decoding_requests(tiny, 3, 4, 9, 2, seed=7)
        return [kv.storage(r)[..., :p, :].clone() for r, p in enumerate(past)], make_model("mlp").example_inputs(4)

    a_kv, a_x = drawn()
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        b_kv, b_x = drawn()
    finally:
        torch.set_default_dtype(before)
    assert b_x.dtype == torch.float32 and torch.equal(a_x, b_x)
    assert len(a_kv) == len(b_kv) and all(torch.equal(x, y) for x, y in zip(a_kv, b_kv))


def test_logits_are_order_one_and_finite(tiny):
    logits = _prefill_logits(tiny, list(range(40)))
    assert torch.isfinite(logits).all()
    assert 0.3 < float(logits.std()) < 3.0


def test_rejects_non_llama_specs_before_allocating():
    with pytest.raises(ValueError, match="Llama-style specs only"):
        OrcaModel("gpt3-175b")
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        OrcaModel("nope")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, float64"):
        OrcaModel("tiny", dtype=torch.int32)


def test_bf16_runs_and_tracks_fp32(tiny):
    bf = OrcaModel("tiny", seed=0, dtype=torch.bfloat16)
    tokens = list(range(3, 30))
    lf, lb = _prefill_logits(tiny, tokens), _prefill_logits(bf, tokens)
    assert lb.dtype == torch.bfloat16 and bf.new_kv(4).dtype == torch.bfloat16
    assert float((lf - lb.float()).abs().max()) < 0.25
    assert torch.corrcoef(torch.stack([lf, lb.float()]))[0, 1] > 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_the_spec_says_the_bytes_of_the_dtype_the_model_holds(tiny, dtype):
    model = OrcaModel("tiny", dtype=dtype)
    s = model.spec
    assert s.dtype_bytes == dtype.itemsize and s == tiny.spec.with_dtype_bytes(dtype.itemsize)
    assert s.weight_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    kv = model.new_kv(8)
    kv.reserve("a", 8)
    assert s.kv_bytes_per_token * 8 == kv.storage("a").nbytes
    model.check_kv(KVManager("tiny", 8, dtype=dtype))          # the preset's K/V store in this dtype is this model's
    assert KVManager("tiny", 8, dtype=dtype).spec == s == PagedKVManager("tiny", 8, dtype=dtype).spec
    assert tiny.spec == get_model_spec("tiny")                  # the default float32 keeps the preset's figures


@pytest.mark.parametrize("dtype, convert", [(torch.bfloat16, lambda m: m.to(torch.bfloat16)),
                                            (torch.float16, lambda m: m.half())])
def test_a_model_converted_after_it_is_built_is_the_one_built_in_that_dtype(dtype, convert):
    built, converted = OrcaModel("tiny", dtype=dtype), convert(OrcaModel("tiny"))
    assert converted.spec == built.spec and converted.spec.dtype_bytes == dtype.itemsize
    assert converted.rope_cos.dtype == torch.float32 and torch.equal(converted.rope_cos, built.rope_cos)
    assert torch.equal(converted.rope_sin, built.rope_sin)
    tokens = list(range(3, 30))
    assert torch.equal(_prefill_logits(converted, tokens), _prefill_logits(built, tokens))
    widened = OrcaModel("tiny", dtype=dtype).float()            # its rotary tables are fp32's again
    assert widened.spec == get_model_spec("tiny") and torch.equal(widened.rope_cos, OrcaModel("tiny").rope_cos)


def test_a_kernel_set_by_hand_stays_when_the_model_is_converted():
    def kernel(*args, **kwargs):
        raise AssertionError("not called")

    model = OrcaModel("tiny")
    model.varlen_kernel = kernel
    assert model.double().varlen_kernel is kernel and model.block_table_kernel is None


def test_a_kernel_replaced_by_hand_stays_and_the_other_follows_the_conversion(monkeypatch):
    import orca_torch.model.orca_model as om

    monkeypatch.setattr(om, "torch_varlen_kernel", lambda device, dtype, *args: (dtype, *args))   # a kernel per dtype
    model = OrcaModel("tiny")
    model.varlen_kernel = mine = (lambda *a, **kw: None)
    model.double()
    assert model.varlen_kernel is mine and model.block_table_kernel == (torch.float64, om.BLOCK_TABLE_ARGS)


def test_share_memory_leaves_the_rotary_tables_shared():
    """`share_memory()` changes no dtype nor device: nothing is rebuilt, so the tables it moved stay shared."""
    model = OrcaModel("tiny").share_memory()
    assert model.rope_cos.is_shared() and model.rope_sin.is_shared()
    assert model.spec == get_model_spec("tiny")


def test_cuda_when_asked(tiny):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            OrcaModel("tiny", device="cuda")
        return
    gpu = OrcaModel("tiny", seed=0, device="cuda")
    tokens = list(range(20))
    assert torch.allclose(_prefill_logits(gpu, tokens).cpu(), _prefill_logits(tiny, tokens), atol=1e-4)
    assert generate_alone(gpu, tokens, 8) == generate_alone(tiny, tokens, 8)


def test_a_bad_step_fails_an_assertion_and_leaves_the_cache_unchanged(tiny):
    """The engine builds every step; a step it could not have built trips an assertion before any
    K/V is written (wrong token count or dtype, an id past the vocabulary, a request twice, a wrong
    n_past, past max_context)."""
    kv = tiny.new_kv(100)
    kv.reserve("a", 50)
    kv.reserve("b", 50)
    tiny.forward_batch(torch.arange(6), [SeqWork(6, 0)], ["a"], kv)
    ids_rule = r"token_ids must be 1-D, sum\(n_new\) integer ids"
    one_each, no_fit = "one SeqWork per request", "do not fit"
    cases = [
        (torch.arange(3), [SeqWork(2, 6)], ["a"], ids_rule + r"; got torch.int64 \(3,\)"),
        (torch.tensor([3.0, 4.0]), [SeqWork(2, 6)], ["a"], ids_rule + "; got torch.float32"),
        (torch.tensor([True, False]), [SeqWork(2, 6)], ["a"], ids_rule + "; got torch.bool"),
        (torch.arange(2), [SeqWork(1, 6), SeqWork(1, 6)], ["a", "a"], one_each),
        (torch.arange(2), [SeqWork(2, 6)], ["a", "b"], one_each),
        (torch.arange(1), [SeqWork(1, 5)], ["a"], no_fit),
        (torch.arange(0), [], [], one_each),
    ]
    for padded in (False, True):
        for ids, works, reqs, says in cases:
            with pytest.raises(AssertionError, match=says):
                tiny(ids, works, reqs, kv, padded=padded)
            assert (kv.length("a"), kv.length("b"), kv.slots_used) == (6, 0, 6)
    for ids, says in (([3, 256], r"from 3 to 256"), (torch.tensor([-1, 4]), r"from -1 to 4")):   # past the vocabulary
        for padded in (False, True):
            with pytest.raises(AssertionError, match=r"token ids must lie in \[0, 256\), got ids " + says):
                tiny(ids, [SeqWork(2, 6)], ["a"], kv, padded=padded)
            assert (kv.length("a"), kv.length("b"), kv.slots_used) == (6, 0, 6)
    big = tiny.new_kv(600)
    big.reserve("x", 512)
    with pytest.raises(AssertionError, match=no_fit):
        tiny.forward_batch(torch.zeros(513, dtype=torch.long), [SeqWork(513, 0)], ["x"], big)
    assert big.length("x") == 0


def test_padded_reference_gives_the_same_logits_and_cache(tiny):
    works = [SeqWork(7, 0), SeqWork(3, 5), SeqWork(1, 20), SeqWork(1, 2)]
    g = torch.Generator().manual_seed(1)
    kvs = []
    for _ in range(2):
        kv = tiny.new_kv(200)
        for r, w in enumerate(works):
            kv.reserve(r, w.n_ctx + 1)
            if w.n_past:
                tiny.forward_batch(torch.arange(w.n_past) % 256, [SeqWork(w.n_past, 0)], [r], kv)
        kvs.append(kv)
    ids = torch.randint(0, 256, (12,), generator=g)
    sel = tiny.forward_batch(ids, works, list(range(4)), kvs[0])
    pad = tiny.forward_padded(ids, works, list(range(4)), kvs[1])
    assert float((sel - pad).abs().max()) < 1e-5
    for r, w in enumerate(works):
        assert kvs[0].length(r) == kvs[1].length(r) == w.n_ctx
        assert torch.allclose(kvs[0].storage(r), kvs[1].storage(r), atol=1e-5)


def test_a_step_longer_than_the_mlp_row_block_matches_the_padded_reference(tiny):
    from orca_torch.model.orca_model import MLP_ROWS

    works = [SeqWork(MLP_ROWS // 2 + 40, 0), SeqWork(MLP_ROWS // 2 + 3, 0), SeqWork(1, 9)]
    assert sum(w.n_new for w in works) > MLP_ROWS                # the MLP runs in two row blocks
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (sum(w.n_new for w in works),), generator=g)
    kvs = []
    for _ in range(2):
        kv = tiny.new_kv(2 * MLP_ROWS)
        for r, w in enumerate(works):
            kv.reserve(r, w.n_ctx)
        tiny.forward_batch(torch.arange(9) % 256, [SeqWork(9, 0)], [2], kv)
        kvs.append(kv)
    sel = tiny.forward_batch(ids, works, [0, 1, 2], kvs[0])
    pad = tiny.forward_padded(ids, works, [0, 1, 2], kvs[1])
    assert float((sel - pad).abs().max()) < 1e-5
    assert torch.equal(sel.argmax(-1), pad.argmax(-1))


def test_causal_and_own_context_only(tiny):
    base = _prefill_logits(tiny, [5, 6, 7, 8])
    assert not torch.allclose(base, _prefill_logits(tiny, [9, 6, 7, 8]))   # the past matters
    kv = tiny.new_kv(20)
    kv.reserve(0, 10)
    kv.reserve(1, 10)
    # a neighbour in the same step, with a different history, does not leak into request 0
    out = tiny.forward_batch(torch.tensor([1, 2, 3, 5, 6, 7, 8]), [SeqWork(3, 0), SeqWork(4, 0)], [1, 0], kv)
    assert float((out[1] - base).abs().max()) < 1e-5


def test_generate_alone_is_deterministic_and_checks_its_arguments(tiny):
    out = generate_alone(tiny, [1, 2, 3], 12)
    assert len(out) == 12 and all(0 <= t < 256 for t in out)
    assert out == generate_alone(tiny, [1, 2, 3], 12)
    assert out[:5] == generate_alone(tiny, [1, 2, 3], 5)
    assert out[0] == int(_prefill_logits(tiny, [1, 2, 3]).argmax())
    assert out[1] == int(_prefill_logits(tiny, [1, 2, 3, out[0]]).argmax())
    with pytest.raises(ValueError, match="at least one token"):
        generate_alone(tiny, [], 3)
    with pytest.raises(ValueError, match="n_new_tokens must be an integer >= 1"):
        generate_alone(tiny, [1], 0)
    with pytest.raises(ValueError, match=r"prompt \(500\) \+ n_new_tokens \(13\) = 513 exceeds max_context 512"):
        generate_alone(tiny, [1] * 500, 13)                     # (512 tokens' K/V, but a request of 513 tokens)
    with pytest.raises(ValueError, match=r"request 0: prompt_len \+ output_len = 500 \+ 13 = 513 exceeds the max"):
        Request(0, 0.0, 500, 13, prompt_ids=[1] * 500).check_context(tiny.spec.max_context)   # as the engine
    assert len(generate_alone(tiny, [1] * 500, 12)) == 12


def test_rotary_frequencies_and_linear_scaling_by_their_definition():
    # RoPE rotates pair i of a head by position * theta^(-2i/d); linear scaling (position
    # interpolation) runs position m as m / factor, so every frequency is divided by the factor
    spec = get_model_spec("tiny")
    d = spec.head_dim
    want = torch.tensor([spec.rope_theta ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    assert torch.allclose(rope_inv_freq(spec), want, rtol=1e-12, atol=0)
    linear = replace(spec, rope_scaling=RopeScaling("linear", 4.0))
    assert torch.allclose(rope_inv_freq(linear), want / 4, rtol=1e-12, atol=0)


def test_residual_branch_outputs_start_scaled_by_the_depth():
    # GPT-2's initialisation: the weights writing into the residual stream (the attention output and
    # the MLP's down projection) are scaled by 1/sqrt(N), N = 2 * n_layers residual branches, on top
    # of 1/sqrt(fan_in); tiny has 2 layers, so 1/2
    model = OrcaModel("tiny", seed=0)
    s = model.spec
    for blk in model.layers:
        assert float(blk.wo.std()) == pytest.approx(0.5 / s.q_dim ** 0.5, rel=0.05)
        assert float(blk.w_down.std()) == pytest.approx(0.5 / s.intermediate ** 0.5, rel=0.05)
        assert float(blk.wqkv.std()) == pytest.approx(1 / s.hidden ** 0.5, rel=0.05)
