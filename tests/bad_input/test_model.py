"""The torch model and what it stores K/V in: seeds, token ids, the K/V manager and `SeqWork`."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from orca_torch.core.batch import SeqWork
from orca_torch.model.torch_executor import TorchExecutor
from orca_torch.model.kv_cache import KVManager, KVStore
from orca_torch.model.kv_views import StepKV
from orca_torch.model.orca_model import OrcaModel, generate_alone
from orca_torch.model.paged_kv_cache import PagedKVManager
from orca_torch.model.sampling import NonFiniteLogits, SamplingParams
from orca_torch.specs import get_model_spec


@pytest.fixture(scope="module")
def tiny() -> OrcaModel:
    return OrcaModel("tiny", seed=0)


@pytest.mark.parametrize("seed", [-1, 1.5, True, 2**64, 2**63])
def test_model_seed_follows_the_one_seed_rule(seed):
    with pytest.raises(ValueError, match=r"seed must be an integer with 0 <= seed < 2\*\*63"):
        OrcaModel("tiny", seed=seed)


def test_a_model_larger_than_the_memory_available_is_refused_before_it_is_built(monkeypatch):
    import orca_torch.checks as checks

    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 10 * 10**9)
    for dtype, need in (("float32", "32.1 GB"), ("bfloat16", "16.1 GB")):
        with pytest.raises(ValueError, match=rf"OrcaModel 'llama-3-8b' \(8,030,261,248 parameters in torch\.{dtype}, "
                                             rf"rotary tables for max_context=8,192 positions\) "
                                             rf"needs {need} of memory, but only 10\.0 GB is available here"):
            OrcaModel("llama-3-8b", dtype=dtype)
    with pytest.raises(ValueError, match="init_weights must be True or False, got 0"):
        OrcaModel("tiny", init_weights=0)


def test_rotary_tables_too_large_for_the_memory_are_refused_before_they_are_built(monkeypatch):
    import orca_torch.checks as checks

    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 100 * 10**6)
    long = replace(get_model_spec("tiny"), max_context=10**6)       # tiny weights, 10**6 x 8 rotary angles
    with pytest.raises(ValueError, match=r"OrcaModel 'tiny' \(106,816 parameters in torch\.float32, rotary tables for "
                                         r"max_context=1,000,000 positions\) needs 192 MB of memory, but only "
                                         r"100 MB is available here"):
        OrcaModel(long)
    assert OrcaModel("tiny").rope_cos.shape == (512, 8)


def test_an_unknown_preset_is_told_the_presets_the_model_builds():
    """The others (GPT-3, OPT) would be refused next as not Llama-style: the list names only what is taken."""
    with pytest.raises(ValueError) as e:
        OrcaModel("foo")
    assert str(e.value) == ("unknown model preset 'foo'; known presets: llama-3-8b, mini, tiny (the Llama-style "
                            "ones, which the torch model builds)")


def test_step_path_refuses_an_unknown_attention_naming_the_allowed_ones(tiny):
    for bad in ("dense", "Split", 1):
        with pytest.raises(ValueError, match=rf"attention must be one of \('split', 'fused'\), got {bad!r}"):
            tiny.step_path(tiny.new_kv(8), attention=bad)
    assert tiny.step_path(attention="split") == "split" and tiny.step_path() == "split"


def test_kv_manager_refuses_a_reservation_longer_than_the_context_reserving_nothing(tiny):
    kv = tiny.new_kv(2048)
    with pytest.raises(ValueError, match=r"cannot reserve 513 tokens for request 'a': a request holds at most the "
                                         r"model's max_context=512 tokens"):
        kv.reserve("a", 513)
    assert not kv.has("a") and kv.slots_reserved == 0
    kv.reserve("a", 512)
    assert kv.capacity("a") == 512


def test_paged_kv_manager_refuses_more_tokens_than_the_context_allocating_nothing(tiny):
    kv = PagedKVManager(tiny.spec, n_blocks=64, block_size=16)
    kv.add("a")
    with pytest.raises(ValueError, match=r"cannot hold 513 tokens for request 'a': a request holds at most the "
                                         r"model's max_context=512 tokens"):
        kv.ensure("a", 513)
    with pytest.raises(ValueError, match=r"n_tokens must be an integer >= 0, got 2.0"):
        kv.ensure("a", 2.0)
    assert kv.block_table("a") == [] and kv.blocks_free == 64
    kv.ensure("a", 512)
    assert len(kv.block_table("a")) == 32


@pytest.mark.parametrize("paged", [False, True], ids=["reserve", "paged-add"])
@pytest.mark.parametrize("req_id, kind", [(["a"], "list"), ({"a": 1}, "dict"), (("a", ["b"]), "tuple"),
                                          (math.nan, "float")])
def test_kv_managers_refuse_an_id_no_request_could_have_saying_what_is_allowed(tiny, paged, req_id, kind):
    """Called by hand: an unhashable id (or NaN, equal to nothing) is named, not a bare TypeError."""
    kv = PagedKVManager(tiny.spec, n_blocks=8, block_size=16) if paged else tiny.new_kv(64)
    with pytest.raises(ValueError, match=rf"req_id must be hashable and equal to itself \(an int, a str, a tuple, "
                                         rf"\.\.\.\), got .* \({kind}\)"):
        kv.add(req_id) if paged else kv.reserve(req_id, 4)
    assert kv.n_requests == 0


KV_CALLS = {"free": lambda kv, r: kv.free(r), "has": lambda kv, r: kv.has(r), "holds": lambda kv, r: kv.holds(r),
            "length": lambda kv, r: kv.length(r),
            "capacity": lambda kv, r: kv.capacity(r), "commit": lambda kv, r: kv.commit(r, 1),
            "can_append": lambda kv, r: kv.can_append(r, 0, 1)}
CONTIGUOUS_CALLS = {"storage": lambda kv, r: kv.storage(r), "read": lambda kv, r: kv.read(r, 0)}
PAGED_CALLS = {"ensure": lambda kv, r: kv.ensure(r, 4), "swap_out": lambda kv, r: kv.swap_out(r),
               "swap_in": lambda kv, r: kv.swap_in(r), "is_swapped": lambda kv, r: kv.is_swapped(r),
               "block_table": lambda kv, r: kv.block_table(r), "slots": lambda kv, r: kv.slots(r, 0, 1),
               "block_tables": lambda kv, r: kv.block_tables(["a", r])}


@pytest.mark.parametrize("paged, call", [(False, c) for c in {**KV_CALLS, **CONTIGUOUS_CALLS}]
                         + [(True, c) for c in {**KV_CALLS, **PAGED_CALLS}])
def test_every_kv_manager_method_taking_an_id_refuses_an_unhashable_one_as_reserve_does(tiny, paged, call):
    """Every method a user may call with a request id names an unhashable one, not a bare TypeError."""
    kv = PagedKVManager(tiny.spec, n_blocks=8, block_size=16, cpu_blocks=4) if paged else tiny.new_kv(64)
    kv.add("a") if paged else kv.reserve("a", 4)
    with pytest.raises(ValueError, match=r"req_id must be hashable and equal to itself .*got \['b'\] \(list\)"):
        {**KV_CALLS, **CONTIGUOUS_CALLS, **PAGED_CALLS}[call](kv, ["b"])
    assert kv.n_requests == 1 and kv.length("a") == 0

def test_paged_kv_pools_larger_than_the_memory_available_are_refused_before_they_are_built(monkeypatch):
    import orca_torch.checks as checks

    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 100 * 10**6)
    # tiny: 512 bytes of K/V a token in float32, so 16-token blocks of 8 KiB
    with pytest.raises(ValueError, match=r"PagedKVManager 'tiny' \(20,000 blocks \+ 0 CPU blocks of 16 tokens in "
                                         r"torch\.float32\) needs 164 MB of memory, but only 100 MB is available here"):
        PagedKVManager("tiny", 20_000, 16)
    with pytest.raises(ValueError, match=r"\(4 blocks \+ 20,000 CPU blocks of 16 tokens in torch\.float32\) "
                                         r"needs 164 MB"):
        PagedKVManager("tiny", 4, 16, cpu_blocks=20_000)
    assert PagedKVManager("tiny", 10_000, 16, dtype="bfloat16").pool.shape[2] == 10_000     # 41 MB


def test_largest_seed_and_numpy_seeds_build_the_same_model_as_python_ints():
    a, b = OrcaModel("tiny", seed=np.int64(3)), OrcaModel("tiny", seed=3)
    assert torch.equal(a.embed, b.embed)
    top = OrcaModel("tiny", seed=2**63 - 1)
    assert not torch.equal(top.embed, b.embed)


@pytest.mark.parametrize("prompt, says", [([1.7], "got 1.7"), ([1, True], "got True (a bool)"),
                                          (torch.tensor([1.0, 2.0]), "got 1.0"), ([-1], "got -1"),
                                          ([10**6], "got 1000000"), (np.array([2.5]), "got 2.5")])
def test_generate_alone_refuses_ids_that_are_not_integer_tokens(tiny, prompt, says):
    with pytest.raises(ValueError) as e:
        generate_alone(tiny, prompt, 2)
    assert f"a prompt token id must be an integer in [0, {tiny.spec.vocab - 1}]" in str(e.value)
    assert says in str(e.value)


def test_generate_alone_takes_integer_ids_of_any_kind_alike(tiny):
    want = generate_alone(tiny, [1, 2, 3], 3)
    for ids in (np.array([1, 2, 3]), torch.tensor([1, 2, 3], dtype=torch.int32), (np.int64(1), 2, 3)):
        assert generate_alone(tiny, ids, np.int64(3)) == want
    with pytest.raises(ValueError, match="n_new_tokens must be an integer >= 1, got 2.0"):
        generate_alone(tiny, [1], 2.0)


def test_any_integer_dtype_gives_the_long_result(tiny):
    out = []
    for ids in (torch.tensor([3, 4, 5]), torch.tensor([3, 4, 5], dtype=torch.int32), [3, 4, 5],
                np.array([3, 4, 5], dtype=np.int16)):
        kv = tiny.new_kv(3)
        kv.reserve(0, 3)
        out.append(tiny.forward_batch(ids, [SeqWork(3, 0)], [0], kv))
        assert kv.length(0) == 3
    assert all(torch.equal(o, out[0]) for o in out)


def test_kv_manager_takes_numpy_counts_and_refuses_bools_changing_nothing():
    kv = KVManager(get_model_spec("tiny"), np.int64(8))
    assert kv.n_slots == 8 and type(kv.n_slots) is int
    for n in (True, False, 2.0, np.float64(2)):
        with pytest.raises(ValueError, match=r"n_tokens must be an integer >= 1, got"):
            kv.reserve("a", n)
    assert not kv.has("a") and kv.slots_reserved == 0 and kv.n_requests == 0
    with pytest.raises(ValueError, match=r"n_slots must be an integer >= 1, got True \(a bool\)"):
        KVManager(get_model_spec("tiny"), True)
    kv.reserve("a", np.int32(3))
    assert kv.capacity("a") == 3 and kv.slots_reserved == 3 and type(kv.slots_reserved) is int


def test_seqwork_takes_numpy_ints_as_ints_and_refuses_bools_and_floats():
    w = SeqWork(np.int64(3), np.int32(2))
    assert (w.n_new, w.n_past, w.n_ctx) == (3, 2, 5) and type(w.n_new) is int and type(w.n_past) is int
    assert SeqWork(np.int64(3), np.int32(2)) == SeqWork(3, 2)
    for args, says in (((True, 0), r"SeqWork.n_new must be an integer >= 1, got True \(a bool\)"),
                       ((1, False), r"SeqWork.n_past must be an integer >= 0, got False \(a bool\)"),
                       ((2.0, 0), r"SeqWork.n_new must be an integer >= 1, got 2.0"),
                       ((0, 0), r"SeqWork.n_new must be an integer >= 1, got 0")):
        with pytest.raises(ValueError, match=says):
            SeqWork(*args)


def test_the_model_takes_a_dtype_or_its_name_as_from_hf_does():
    assert OrcaModel("tiny", dtype="bfloat16").dtype == torch.bfloat16
    assert OrcaModel("tiny", dtype=torch.float16).dtype == torch.float16
    a, b = OrcaModel("tiny", dtype="float64"), OrcaModel("tiny", dtype=torch.float64)
    assert torch.equal(a.embed, b.embed)
    for bad in ("int8", torch.int32, None, "fp8"):
        with pytest.raises(ValueError, match=r"dtype must be one of float32, bfloat16, float16, float64 "
                                             r"\(a torch dtype or its name\), got"):
            OrcaModel("tiny", dtype=bad)


DEVICES = [("nope", r"unknown device 'nope'; allowed: cpu, cuda or cuda:N"),
           (None, r"device must be 'cpu', 'cuda' or 'cuda:N', got None"),
           (0, r"device must be 'cpu', 'cuda' or 'cuda:N', got 0")]


@pytest.mark.parametrize("device, says", DEVICES)
def test_the_model_refuses_a_bad_device_with_the_allowed_ones(device, says):
    with pytest.raises(ValueError, match=says):
        OrcaModel("tiny", device=device)


def _one_step(model: OrcaModel) -> torch.Tensor:
    kv = model.new_kv(4)
    kv.reserve(0, 2)
    return model.forward_batch([1, 2], [SeqWork(2, 0)], [0], kv)


@pytest.mark.filterwarnings("ignore:Complex modules")      # (torch's, as .to() reads a complex dtype)
@pytest.mark.parametrize("convert, says", [
    (lambda m: m.to(torch.complex64), r"dtype must be one of float32, bfloat16, float16, float64 .*complex64"),
    (lambda m: m.to(torch.float8_e4m3fn), r"dtype must be one of .*got torch\.float8_e4m3fn"),
    (lambda m: m.to("meta"), r"device type 'meta' is not supported here; allowed: cpu, cuda or cuda:N"),
    (lambda m: m.to("meta", torch.float16), r"device type 'meta' is not supported here"),
    (lambda m: m.half(), r"'layers\.1\.w_down' holds a value of magnitude 131072, past torch\.float16's largest "
                         r"\(65504\), which it cannot hold; keep a wider dtype \(bfloat16 or float32\)")],
    ids=["complex", "float8", "meta", "meta-and-float16", "float16-overflowed"])
def test_a_conversion_to_a_dtype_or_device_the_constructor_refuses_is_refused_converting_nothing(convert, says):
    """`.to()` and the like reach the weights without the constructor's checks: a dtype or device it refuses
    would leave a model no K/V store can be made for (its weights rounded for good), and a weight past the
    dtype's range would become inf (NaN logits, as `from_hf` refuses for a checkpoint); so each is refused first."""
    model, kept = OrcaModel("tiny", seed=2), OrcaModel("tiny", seed=2)
    with torch.no_grad():
        for m in (model, kept):
            m.layers[1].w_down[0, 0] = 2.0 ** 17
    with pytest.raises(ValueError, match="OrcaModel cannot be converted, and is left as it was: " + says):
        convert(model)
    assert (model.dtype, model.device, model.spec) == (kept.dtype, kept.device, kept.spec)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), kept.state_dict().values()))
    assert torch.equal(model.rope_cos, kept.rope_cos)
    assert torch.equal(_one_step(model), _one_step(kept))


def test_the_model_names_its_spec_parameter_and_from_hf_checks_before_loading(tmp_path):
    with pytest.raises(ValueError, match=r"spec must be a ModelSpec or str, got None"):
        OrcaModel(None)
    missing = tmp_path / "no-checkpoint"          # the arguments are refused before the path is read
    for kwargs, says in (({"device": "nope"}, "unknown device 'nope'"), ({"dtype": "int8"}, "dtype must be one of"),
                         ({"attention": "dense"}, "attention must be one of")):
        with pytest.raises(ValueError, match=says):
            OrcaModel.from_hf(missing, **kwargs)


@pytest.mark.parametrize("kwargs, says", [
    ({"spec": None}, r"spec must be a ModelSpec or str, got None"),
    ({"spec": "huge"}, r"unknown model preset 'huge'; known presets: .*tiny"),
    ({"device": "nope"}, r"unknown device 'nope'; allowed: cpu, cuda or cuda:N"),
    ({"device": 0}, r"device must be 'cpu', 'cuda' or 'cuda:N', got 0"),
    ({"dtype": "x"}, r"dtype must be one of float32, bfloat16, float16, float64 \(a torch dtype or its name\), got 'x'"),
    ({"dtype": torch.int32}, r"dtype must be one of float32, .*got torch\.int32"),
])
def test_kv_manager_refuses_a_bad_spec_device_or_dtype_when_built(kwargs, says):
    args = {"spec": get_model_spec("tiny"), "n_slots": 8, **kwargs}
    with pytest.raises(ValueError, match=says):
        KVManager(**args)


def test_kv_manager_takes_a_preset_name_and_a_dtype_name(tiny):
    kv = KVManager("tiny", 8, dtype="bfloat16")
    assert kv.spec == tiny.spec.with_dtype_bytes(2) and kv.dtype == torch.bfloat16
    kv.reserve("a", 4)
    assert kv.storage("a").dtype == torch.bfloat16


@pytest.mark.parametrize("prompt", [None, "abc", 3, torch.tensor(3), {"ids": 1}],
                         ids=["none", "str", "int", "0-d-tensor", "dict"])
def test_generate_alone_refuses_a_prompt_that_is_not_a_list_of_ids(tiny, prompt):
    with pytest.raises(ValueError, match=rf"prompt must be a list of token ids in \[0, {tiny.spec.vocab}\), got"):
        generate_alone(tiny, prompt, 2)


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_generate_alone_refuses_logits_that_are_not_finite_as_the_executor_does(bad):
    """Weights that overflowed make logits NaN: argmax would take the NaN for the largest and return its
    token (token 0 for a row of NaN) as if greedy; the reference refuses instead, as a step of the
    executor does."""
    model = OrcaModel("tiny", seed=4)
    with torch.no_grad():
        model.layers[1].w_down[:, 3] = bad
    with pytest.raises(NonFiniteLogits, match=r"a logits row is not finite \(it holds NaN\)"):
        generate_alone(model, [1, 2, 3], 4)


def test_generate_alone_checks_its_model_and_refuses_an_empty_prompt(tiny):
    with pytest.raises(ValueError, match=r"model must be an OrcaModel, got None"):
        generate_alone(None, [1, 2], 2)
    with pytest.raises(ValueError, match=r"prompt must hold at least one token"):
        generate_alone(tiny, np.array([], dtype=np.int64), 2)


def test_the_torch_executor_refuses_a_bad_model_kv_or_clock_when_built(tiny):
    kv = tiny.new_kv(8)
    cases = [((tiny, None), r"kv must be a KVStore, got None"),
             ((None, kv), r"model must be an OrcaModel, got None"),
             ((tiny, KVManager("mini", 8)), r"the KVManager is for 'mini', the model is 'tiny'"),
             ((tiny, KVManager("tiny", 8, dtype=torch.bfloat16)),
              r"the KVManager holds torch\.bfloat16 on cpu, the model runs torch\.float32 on cpu"),
             ((tiny, kv, None), r"unknown clock None; choose one of 'wall', 'iterations'")]
    for args, says in cases:
        with pytest.raises(ValueError, match=says):
            TorchExecutor(*args)
    assert TorchExecutor(tiny, kv, clock="iterations").clock == "iterations"


@pytest.mark.parametrize("paged", [False, True])
def test_the_torch_executor_refuses_an_id_its_store_already_holds_from_a_step_run_by_hand(tiny, paged):
    from orca_torch.core.engine import Engine
    from orca_torch.core.memory import UnlimitedMemory
    from orca_torch.core.request import Request

    kv = PagedKVManager(tiny.spec, 4) if paged else tiny.new_kv(64)
    if paged:
        kv.add("a")
        kv.ensure("a", 5)
    else:
        kv.reserve("a", 16)
    tiny.forward_batch(torch.arange(5), [SeqWork(5, 0)], ["a"], kv)
    engine = Engine(TorchExecutor(tiny, kv, clock="iterations"), UnlimitedMemory())
    reqs = [Request("a", 0.0, 4, 3, prompt_ids=[1, 2, 3, 4])]
    with pytest.raises(ValueError, match=r"request 'a': the K/V store already holds K/V under this id, put there "
                                         r"outside this executor; free it first \(kv.free\('a'\)\)"):
        engine.run(reqs)
    kv.free("a")
    assert engine.run(reqs).output_ids["a"] == generate_alone(tiny, [1, 2, 3, 4], 3)


def test_the_torch_executor_refuses_a_stop_token_id_outside_the_vocabulary(tiny):
    from orca_torch.core.engine import Engine
    from orca_torch.core.memory import UnlimitedMemory
    from orca_torch.core.request import Request

    engine = Engine(TorchExecutor(tiny, tiny.new_kv(64), clock="iterations"), UnlimitedMemory())
    vocab = tiny.spec.vocab
    with pytest.raises(ValueError, match=rf"request 0: stop_token_ids must lie in \[0, {vocab}\), got {vocab}$"):
        engine.run([Request(0, 0.0, 2, 3, prompt_ids=[1, 2], min_tokens=1, stop_token_ids=(5, vocab))])


@pytest.mark.parametrize("sampling", [None, SamplingParams(seed=1)], ids=["greedy", "sampled"])
def test_the_torch_executor_refuses_stop_ids_that_ban_every_token_before_min_tokens(tiny, sampling):
    """Every token banned leaves a row of -inf: its argmax is a stop id after all, and a draw from it
    an id past the vocabulary, which the next step would feed the model."""
    from orca_torch.core.engine import Engine
    from orca_torch.core.memory import UnlimitedMemory
    from orca_torch.core.request import Request

    engine = Engine(TorchExecutor(tiny, tiny.new_kv(64), clock="iterations"), UnlimitedMemory())
    vocab = tiny.spec.vocab
    every = tuple(range(vocab))
    with pytest.raises(ValueError, match=rf"request 0: its stop_token_ids hold every one of the {vocab} token ids, "
                                         r"so none could be made before min_tokens=1; leave a token out"):
        engine.run([Request(0, 0.0, 2, 3, prompt_ids=[1, 2], min_tokens=1, stop_token_ids=every, sampling=sampling)])
    ok = [Request(0, 0.0, 2, 3, prompt_ids=[1, 2], stop_token_ids=every, sampling=sampling),
          Request(1, 0.0, 2, 3, prompt_ids=[1, 2], min_tokens=1, stop_token_ids=every[1:], sampling=sampling)]
    out = engine.run(ok).output_ids
    assert out[1][0] == 0 and all(0 <= t < vocab for t in out[0] + out[1])


def test_the_torch_executor_refuses_an_unseeded_draw_keyed_on_a_req_id_printed_by_its_address(tiny):
    """Its derived seed would be another each run; a seed of its own, or greedy decoding, needs none."""
    from orca_torch.core.engine import Engine
    from orca_torch.core.memory import UnlimitedMemory
    from orca_torch.core.request import Request

    class Client:
        pass

    engine = Engine(TorchExecutor(tiny, tiny.new_kv(64), clock="iterations"), UnlimitedMemory())
    rid = Client()
    with pytest.raises(ValueError, match=r"sampling without a seed draws from a seed derived from its req_id's repr, "
                                         r"and a Client's repr shows a memory address, another each run; give "
                                         r"SamplingParams a seed"):
        engine.run([Request(rid, 0.0, 2, 3, prompt_ids=[1, 2], sampling=SamplingParams())])
    for sampling in (SamplingParams(seed=4), SamplingParams(temperature=0.0), None):
        assert len(engine.run([Request(rid, 0.0, 2, 3, prompt_ids=[1, 2], sampling=sampling)]).output_ids[rid]) == 3
    for inside in (("user", rid), ("user", (1, rid)), frozenset([rid])):      # (were let through)
        with pytest.raises(ValueError, match=r"and a Client's repr \(inside it\) shows a memory address, another "
                                             r"each run; give SamplingParams a seed"):
            engine.run([Request(inside, 0.0, 2, 3, prompt_ids=[1, 2], sampling=SamplingParams())])


def test_an_unseeded_draw_is_refused_for_any_req_id_whose_repr_shows_an_address(tiny):
    """Only object's own repr was caught: a function, a lambda, a bound method or a value whose repr
    holds one (a dataclass with a function field) printed an address too, and were let through. A
    str that merely says ' at 0x' prints alike each run."""
    import dataclasses
    from typing import Callable

    from orca_torch.core.engine import Engine
    from orca_torch.core.memory import UnlimitedMemory
    from orca_torch.core.request import Request

    @dataclasses.dataclass(frozen=True)
    class Job:
        run: Callable

    def handler():
        pass

    engine = Engine(TorchExecutor(tiny, tiny.new_kv(64), clock="iterations"), UnlimitedMemory())
    for rid, kind, inside in ((handler, "function", ""), (lambda: 0, "function", ""), (engine.run, "method", ""),
                              (Job(handler), "Job", ""), (("user", handler), "function", r" \(inside it\)")):
        with pytest.raises(ValueError, match=rf"and a {kind}'s repr{inside} shows a memory address, another each "
                                             r"run; give SamplingParams a seed"):
            engine.run([Request(rid, 0.0, 2, 3, prompt_ids=[1, 2], sampling=SamplingParams())])
    for rid in ("<job at 0x7f00>", ("user", "at 0x1"), Job(len)):            # (the same text each run)
        assert len(engine.run([Request(rid, 0.0, 2, 3, prompt_ids=[1, 2], sampling=SamplingParams())]).output_ids[rid]) == 3


def test_paged_kv_mirroring_refuses_a_memory_without_blocks_and_a_model_that_is_not_one(tiny):
    from orca_torch.core.memory import ReservationMemory, UnlimitedMemory
    from orca_torch.core.paged_memory import PagedMemory

    for memory in (ReservationMemory(64), UnlimitedMemory(), None):
        with pytest.raises(ValueError, match=r"memory must be a PagedMemory \(the scheduler's block pool\) to mirror, "
                                             r"got \w+; for another memory manager make the K/V store with "
                                             r"model\.new_kv\(n_slots\)"):
            PagedKVManager.mirroring(memory, tiny)
    for model in (None, "tiny", tiny.spec):
        with pytest.raises(ValueError, match=r"model must be an OrcaModel \(whose spec, device and dtype the pool takes\), got "):
            PagedKVManager.mirroring(PagedMemory(64, 4), model)
    kv = PagedKVManager.mirroring(PagedMemory(64, 4, preemption="swap"), tiny)
    assert (kv.n_blocks, kv.block_size, kv.cpu_blocks, kv.dtype) == (16, 4, 16, tiny.dtype)


@pytest.mark.parametrize("attention", ["split", "fused"])
@pytest.mark.parametrize("padded", [False, True])
def test_a_step_on_a_kv_store_of_another_model_or_dtype_is_refused_writing_nothing(tiny, attention, padded):
    tiny.attention = attention
    try:
        for kv, says in ((KVManager("mini", 8), "the KVManager is for 'mini', the model is 'tiny'"),
                         (KVManager("tiny", 8, dtype="bfloat16"), "holds torch.bfloat16 on cpu, the model runs "
                                                                  "torch.float32")):
            kv.reserve("a", 8)
            stored = kv.storage("a").clone()
            with pytest.raises(ValueError, match=says):
                tiny(torch.tensor([1, 2]), [SeqWork(2, 0)], ["a"], kv, padded=padded)
            assert kv.length("a") == 0 and torch.equal(kv.storage("a"), stored)
    finally:
        tiny.attention = "split"


def test_a_kv_store_refusal_names_the_store_the_fields_that_differ_and_how_to_make_the_right_one(tiny):
    for kv, says in ((KVManager(replace(tiny.spec, n_kv_heads=4), 8),
                      r"the KVManager is for another spec named 'tiny': n_kv_heads 4 \(the model's 2\); make it "
                      r"with model\.new_kv\(n_slots\)"),
                     (PagedKVManager(replace(tiny.spec, max_context=1024), 4),
                      r"the PagedKVManager is for another spec named 'tiny': max_context 1024 \(the model's 512\); "
                      r"make it with PagedKVManager\.mirroring\(memory, model\)"),
                     (PagedKVManager("tiny", 4, dtype="bfloat16"),
                      r"the PagedKVManager holds torch\.bfloat16 on cpu, the model runs torch\.float32 on cpu; make "
                      r"it with PagedKVManager\.mirroring\(memory, model\)")):
        with pytest.raises(ValueError, match=says):
            TorchExecutor(tiny, kv)


class _NoViewKV(KVStore):
    """A store of one's own that stores K/V but leaves out `step_view`."""

    def length(self, req_id):
        return 0

    def capacity(self, req_id):
        return 8


class _OwnKV(_NoViewKV):
    """A store of one's own the model can run on (its view: the built-in one)."""

    def step_view(self, req_ids, past, sizes):
        return StepKV(self, req_ids, past, sizes)


def test_a_kv_store_that_leaves_out_what_the_model_calls_is_refused_at_the_door(tiny):
    class Bare(KVStore):
        pass

    for kv, says in ((object(), r"kv must be a KVStore, got <object object at .*> \(object\)"),
                     (Bare("tiny", "cpu", "float32"),
                      r"the Bare does not define length, capacity, step_view, which the model calls on a K/V store "
                      r"\(KVStore\.MODEL_CALLS; docs/extending\.md, \"A K/V store\"\)"),
                     (_NoViewKV("tiny", "cpu", "float32"), r"the _NoViewKV does not define step_view, which"),
                     (_OwnKV.__new__(_OwnKV), r"the _OwnKV has no spec, dtype or device: its constructor must call "
                                              r"super\(\)\.__init__\(spec, device, dtype\) \(KVStore's\) first")):
        with pytest.raises(ValueError, match=says):
            tiny.forward_batch(torch.tensor([1]), [SeqWork(1, 0)], ["a"], kv)
        with pytest.raises(ValueError, match=says):
            TorchExecutor(tiny, kv)
    with pytest.raises(ValueError, match=r"the _OwnKV is for 'mini', the model is 'tiny'; make it with _OwnKV given "
                                         r"the model's spec, device and dtype"):
        tiny.check_kv(_OwnKV("mini", "cpu", "float32"))


class _HalfRoomKV(_OwnKV):
    """A store of one's own that says what it holds and frees it, but makes no room."""

    def holds(self, req_id):
        return False

    def free(self, req_id):
        pass


def test_the_torch_executor_refuses_a_store_that_leaves_out_what_it_calls_naming_what_is_missing(tiny):
    """It refused any store not a KVManager or a PagedKVManager, whatever it defined; it asks now for
    the calls it makes (`KVStore.EXECUTOR_CALLS`), so a store of one's own makes room its own way."""
    for kv, missing in ((_OwnKV("tiny", "cpu", "float32"), "holds, check_fits, make_room, free"),
                        (_HalfRoomKV("tiny", "cpu", "float32"), "check_fits, make_room")):
        tiny.check_kv(kv)                                   # the model runs on it
        with pytest.raises(ValueError, match=rf"^the {type(kv).__name__} does not define {missing}, which the torch "
                                             r"executor calls on a K/V store to make room for each step and give it "
                                             r"back \(KVStore\.EXECUTOR_CALLS; docs/extending\.md, \"A K/V store\"\)$"):
            TorchExecutor(tiny, kv)


@pytest.mark.parametrize("field, value, says", [
    ("temperature", -0.5, "temperature must be a finite number >= 0, got -0.5"),
    ("temperature", math.nan, "temperature must be a finite number >= 0, got nan"),
    ("temperature", "1", "temperature must be a finite number >= 0, got '1' \\(str\\)"),
    ("top_p", 0, r"top_p must be a finite number in \(0, 1\], got 0"),
    ("top_p", 1.5, r"top_p must be a finite number in \(0, 1\], got 1.5"),
    ("top_k", 0, "top_k must be an integer >= 1, or None for all tokens, got 0"),
    ("top_k", 2.0, "top_k must be an integer >= 1, or None for all tokens, got 2.0"),
    ("top_k", True, "top_k must be an integer >= 1, or None for all tokens, got True"),
    ("seed", -1, r"seed must be an integer with 0 <= seed < 2\*\*63, got -1"),
    ("seed", "7", r"seed must be an integer with 0 <= seed < 2\*\*63, got '7' \(str\)"),
    ("logprobs", -1, r"logprobs must be an integer >= 0 \(how many most likely tokens to return beside each token "
                     r"made\), or None for none, got -1"),
    ("logprobs", True, r"logprobs must be an integer >= 0 .*, got True"),
    ("presence_penalty", 2.5, r"presence_penalty must be a finite number in \[-2, 2\], got 2.5"),
    ("frequency_penalty", -3, r"frequency_penalty must be a finite number in \[-2, 2\], got -3"),
    ("frequency_penalty", math.inf, r"frequency_penalty must be a finite number in \[-2, 2\], got inf"),
    ("repetition_penalty", 0, r"repetition_penalty must be a finite number in \[1e-06, 1e\+06\], got 0"),
    ("repetition_penalty", None, r"repetition_penalty must be a finite number in \[1e-06, 1e\+06\], got None"),
    ("repetition_penalty", 1e-300, r"repetition_penalty must be a finite number in \[1e-06, 1e\+06\], got 1e-300"),
    ("repetition_penalty", 1e300, r"repetition_penalty must be a finite number in \[1e-06, 1e\+06\], got 1e\+300"),
    ("logit_bias", {3: 150}, r"logit_bias\[3\] must be a finite number in \[-100, 100\], got 150"),
    ("logit_bias", {-1: 1.0}, r"logit_bias must map token ids \(integers >= 0\) to biases \(numbers in \[-100, "
                              r"100\]\): a dict, or \(id, bias\) pairs; got the key -1"),
    ("logit_bias", {"5": 1.0}, r"logit_bias must map token ids .*; got the key '5'"),
    ("logit_bias", [5, 1.0], r"logit_bias must map token ids .*; got \[5, 1.0\]"),
    ("logit_bias", ((5, 1.0), (5, 2.0)), r"logit_bias must map token ids .*; a token id is given twice in "
                                         r"\(\(5, 1.0\), \(5, 2.0\)\)"),
    ("logit_bias", (([5], 1.0),), r"logit_bias must map token ids .*; got the key \[5\]"),   # (no hash to compare)
    ("logit_bias", ((5, 1.0), (5.0, 2.0)), r"logit_bias must map token ids .*; got the key 5.0"),
])
def test_sampling_params_refuse_what_no_draw_can_use_saying_what_is_allowed(field, value, says):
    from orca_torch.model.sampling import SamplingParams

    with pytest.raises(ValueError, match=f"^{says}$"):
        SamplingParams(**{field: value})


def test_the_torch_executor_refuses_sampling_that_is_no_sampling_params(tiny):
    from orca_torch.core.engine import Engine
    from orca_torch.core.memory import UnlimitedMemory
    from orca_torch.core.request import Request

    engine = Engine(TorchExecutor(tiny, tiny.new_kv(64), clock="iterations"), UnlimitedMemory())
    with pytest.raises(ValueError, match=r"^request 0: sampling must be a SamplingParams \(orca_torch.model.sampling\) "
                                         r"or None for greedy decoding, got dict$"):
        engine.run([Request(0, 0.0, 2, 3, prompt_ids=[1, 2], sampling={"temperature": 1.0})])
    from orca_torch.model.sampling import SamplingParams

    with pytest.raises(ValueError, match=rf"^request 1: logit_bias token ids must lie in \[0, {tiny.spec.vocab}\), "
                                         rf"got {tiny.spec.vocab}$"):
        engine.run([Request(1, 0.0, 2, 3, prompt_ids=[1, 2],
                            sampling=SamplingParams(logit_bias={1: 2.0, tiny.spec.vocab: 1.0}))])
    with pytest.raises(ValueError, match=r"^seed must be an integer with 0 <= seed < 2\*\*63, got -1$"):
        TorchExecutor(tiny, tiny.new_kv(64), seed=-1)


class _OwnPagedView(PagedKVManager):
    """A paged store whose steps go through a view of its own, which has no `block_table_layout`."""

    def step_view(self, req_ids, past, sizes):
        return StepKV(self, req_ids, past, sizes)


class _OwnPagedViewSaysSo(_OwnPagedView):
    serves_block_tables = False


def test_a_paged_store_with_a_view_of_its_own_says_whether_it_serves_block_tables_when_built(tiny):
    """It inherited `serves_block_tables` True for blocks of 256 tokens, and a step on a GPU's
    block-table kernel failed on the view's missing `block_table_layout`, deep in the forward."""
    with pytest.raises(ValueError, match=r"^_OwnPagedView defines its own step_view, but serves_block_tables is "
                                         r"PagedKVManager's, True for block_size=256 \(a multiple of 256\): a "
                                         r"block-table kernel would be handed the view's block_table_layout\(\), .*"
                                         r"say in _OwnPagedView whether its view serves block tables"):
        _OwnPagedView(tiny.spec, n_blocks=2, block_size=256)
    assert not _OwnPagedView(tiny.spec, n_blocks=2, block_size=16).serves_block_tables     # (the kernel's not asked)
    assert not _OwnPagedViewSaysSo(tiny.spec, n_blocks=2, block_size=256).serves_block_tables
    assert PagedKVManager(tiny.spec, n_blocks=2, block_size=256).serves_block_tables
