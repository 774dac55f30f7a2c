"""The paper GPU: an explicit K/V budget must fit beside the weights, with both numbers said; bools are not
numbers; a step's totals must be a real step's; the microbatch pipeline prices on the roofline only."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.sim.hw_model import (GPUSpec, Partition, RefinedParams, decode_profile,
    decode_totals, get_gpu, kv_capacity_tokens, load_profile, max_batch_within, max_requests, memory_plan,
    pricer, save_profile, step_cost, step_time)
from orca_torch.lab.gpu_calculator import main as hw_main
from orca_torch.sim.hw_model.links import LinkSpec, with_link
from orca_torch.sim.hw_model.microbatch import control_sync_s, decode_iterations_s, iteration_s
from orca_torch.sim.hw_model.roofline import check_totals
from orca_torch.specs import get_model_spec

LLAMA, H100 = "llama-3-8b", "h100"

def test_kv_budget_larger_than_the_card_is_refused_with_both_numbers():
    with pytest.raises(ValueError) as exc:
        memory_plan("llama-3-8b", "h100", kv_budget_bytes=1000 * 2**30)
    msg = str(exc.value)
    assert "1073.74 GB (1000.00 GiB)" in msg and "16.06 GB of weights" in msg and "h100 has 80 GB" in msg
    assert "at most 63.94 GB" in msg
    with pytest.raises(ValueError, match="the weights alone do not fit: raise tp or pp"):
        kv_capacity_tokens("gpt3-175b", "h100", kv_budget_bytes=2**30)


def test_kv_budget_that_exactly_fills_the_card_is_accepted():
    plan = memory_plan("llama-3-8b", "h100")
    room = 80e9 - plan.weight_bytes_per_device
    full = memory_plan("llama-3-8b", "h100", kv_budget_bytes=room)
    assert full.kv_tokens == int(room // get_model_spec("llama-3-8b").kv_bytes_per_token)
    with pytest.raises(ValueError, match=r"does not fit beside .*; allowed: at most 63\.94 GB"):
        memory_plan("llama-3-8b", "h100", kv_budget_bytes=room + 1)
    # under tp=2 each card holds half the weights, so the same budget fits
    assert memory_plan("llama-3-8b", "h100", tp=2, kv_budget_bytes=room + 1).kv_tokens > full.kv_tokens


def cli_error(argv, capsys) -> str:
    """The one-line error `python -m orca_torch.lab.gpu_calculator ARGV` exits 2 with (nothing printed before it)."""
    with pytest.raises(SystemExit) as exc:
        hw_main(argv)
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""
    return out.err


def test_hw_model_cli_exits_2_on_an_impossible_kv_budget(capsys):
    assert "does not fit beside llama-3-8b's 16.06 GB of weights" in cli_error(["--kv-budget-gib", "1000"], capsys)


def test_hw_model_cli_refuses_a_batch_past_2_to_the_53(capsys):
    """A batch of 10**400 decodes ended in a float's OverflowError, traceback and all (its text is quoted
    by its first and last digits)."""
    for batch, quoted in ((str(10**400), f"{'1' + '0' * 36}...{'0' * 38}"), (str(2**53 + 1), str(2**53 + 1))):
        assert f"argument --batch: must be an integer from 0 to 2**53, got '{quoted}'" in cli_error(["--batch", batch],
                                                                                                     capsys)
    assert hw_main(["--batch", str(2**53), "--json"])["step"][0]["batch"] == 2**53


# ---- the capacity and decode-profile helpers say what they take ----------------------------------------------

@pytest.mark.parametrize("call, says", [
    (lambda: kv_capacity_tokens(LLAMA, H100, kv_budget_bytes=-1e9), "kv_budget_bytes must be a finite number of "
                                                                    "bytes > 0, got -1000000000.0"),
    (lambda: kv_capacity_tokens(LLAMA, H100, kv_budget_bytes="1e9"), "kv_budget_bytes must be a finite number"),
    (lambda: kv_capacity_tokens(LLAMA, H100, kv_budget_bytes=float("nan")), "got nan"),
    (lambda: kv_capacity_tokens(LLAMA, H100, mem_unit="gb"), "unknown mem_unit 'gb'; choose one of 'GB', 'GiB'"),
    (lambda: max_requests(LLAMA, H100, 0), "reserve_tokens must be an integer >= 1, got 0"),
    (lambda: max_requests(LLAMA, H100, 1.5), "reserve_tokens must be an integer >= 1, got 1.5"),
    (lambda: decode_profile(LLAMA, H100, 1), "context must be an integer in [2, 8192], got 1"),
    (lambda: decode_profile(LLAMA, H100, 10**6), "context must be an integer in [2, 8192], got 1000000"),
    (lambda: max_batch_within(LLAMA, H100, -1.0, 512), "budget_s must be a finite number of seconds > 0, got -1.0"),
    (lambda: max_batch_within(LLAMA, H100, 0.05, 8193), "context must be an integer in [2, 8192], got 8193"),
    (lambda: max_batch_within(LLAMA, H100, 0.05, 512, limit=0), "limit must be an integer >= 1, got 0"),
    (lambda: max_batch_within(LLAMA, H100, 0.05, 512, limit="x"), "limit must be an integer >= 1, got 'x'"),
])
def test_capacity_and_profile_helpers_refuse_what_they_cannot_price(call, says):
    with pytest.raises(ValueError) as exc:
        call()
    assert says in str(exc.value)


# ---- a bool is not a number -----------------------------------------------------------------------------

@pytest.mark.parametrize("call, says", [
    (lambda: kv_capacity_tokens(LLAMA, H100, True), "mem_fraction must be a finite number in (0, 1], got True (a bool)"),
    (lambda: pricer(LLAMA, H100, flop_efficiency=True), "flop_efficiency must be a finite number in (0, 1], got True"),
    (lambda: pricer(LLAMA, H100, bw_efficiency=True), "bw_efficiency must be a finite number in (0, 1], got True"),
    (lambda: pricer(LLAMA, H100, overhead_s=False), "overhead_s must be a finite number of seconds >= 0, got False"),
    (lambda: pricer(LLAMA, H100, pp=True), "pp must be an integer >= 1, got True (a bool)"),
    (lambda: pricer(LLAMA, H100, cost_model="refined", attention_tile=True), "attention_tile must be an integer >= 1"),
    (lambda: pricer(LLAMA, H100, count_activations=1), "count_activations must be True or False, got 1"),
    (lambda: Partition(get_model_spec(LLAMA), True), "tp must be an integer >= 1, got True (a bool)"),
    (lambda: GPUSpec("x", True, 1e12, 1e9), "GPUSpec.peak_flops must be a finite number > 0, got True"),
    (lambda: GPUSpec("x", 1e12, 1e12, 1e9, gpus_per_node=True), "GPUSpec.gpus_per_node must be an integer >= 1"),
    (lambda: GPUSpec("x", 1e12, 1e12, 1e9, bw_efficiency=True), "GPUSpec.bw_efficiency must be a finite number in"),
    (lambda: GPUSpec("x", 1e12, 1e12, 1e9, nvlink_bw=-1.0), "GPUSpec.nvlink_bw must be a finite number of bytes/s > 0"),
    (lambda: GPUSpec("x", 1e12, 1e12, 1e9, ib_latency_s=-1e-6), "GPUSpec.ib_latency_s must be a finite number of "
                                                                 "seconds >= 0"),
    (lambda: RefinedParams(overlap=True), "RefinedParams.overlap must be a finite number in [1, 64], got True"),
    (lambda: RefinedParams(attention_tile=True), "RefinedParams.attention_tile must be an integer >= 1, got True"),
    (lambda: LinkSpec("l", True, 1e-6), "LinkSpec.bandwidth must be a finite number of bytes/s > 0, got True"),
    (lambda: LinkSpec("l", 1e9, "1"), "LinkSpec.latency_s must be a finite number of seconds >= 0, got '1' (str)"),
])
def test_bools_and_non_numbers_are_refused_by_name(call, says):
    with pytest.raises(ValueError) as e:
        call()
    assert says in str(e.value)


def test_a_bool_never_finds_the_pricer_cached_for_its_integer():
    assert pricer(LLAMA, H100, tp=1).tp == 1     # cached under tp=1, and True == 1 as a key
    with pytest.raises(ValueError, match=r"tp must be an integer >= 1, got True \(a bool\)"):
        pricer(LLAMA, H100, tp=True)
    assert pricer(LLAMA, H100, flop_efficiency=1.0).tp == 1
    with pytest.raises(ValueError, match="flop_efficiency must be a finite number"):
        pricer(LLAMA, H100, flop_efficiency=True)


# ---- priced totals must be a real step's ------------------------------------------------------------------

@pytest.mark.parametrize("totals, says", [
    (StepTotals("1", 2, 3, 3, 3), "StepTotals.n_seqs must be an integer >= 0, got '1' (str)"),
    (StepTotals(True, True, True, True, True), "StepTotals.n_seqs must be an integer >= 0, got True (a bool)"),
    (StepTotals(1, 1, 3, np.bool_(True), 3), "StepTotals.attn_pairs_full must be an integer >= 0, got True (a bool)"),
    (StepTotals(1.5, 2.0, 3, 3, 3), "StepTotals.n_seqs must be an integer >= 0, got 1.5"),
    (StepTotals(1, 2.0, 3, 3, 3), "StepTotals.n_tokens must be an integer >= 0, got 2.0"),
    (StepTotals(1, 1, 10, 5, 50), "n_tokens <= attn_pairs_causal <= attn_pairs_full"),   # causal > full
    (StepTotals(1, 1, 0, 0, 0), "need n_seqs <= n_tokens <= kv_read_tokens"),
    (StepTotals(1, 4, 10, 40, 2), "n_tokens <= attn_pairs_causal"),                        # fewer pairs than tokens
    (StepTotals(0, 0, 5, 5, 5), "every field 0 when n_seqs == 0"),
    (StepTotals(-1, -1, -1, -1, -1), "StepTotals.n_seqs must be an integer >= 0, got -1"),
    (StepTotals(*[10**400] * 5), "StepTotals.n_seqs must be below 2**63, got an integer of 1329 bits"),
    (StepTotals(1, 1, 2**63, 2**63, 2**63), "kv_read_tokens must be below 2**63"),
])
def test_inconsistent_or_non_integer_totals_are_refused(totals, says):
    """`check_totals`: what a calibration sample's totals (`lab.calibration.samples.StepSample`) must pass."""
    with pytest.raises(ValueError) as e:
        check_totals(totals)
    assert says in str(e.value)


# ---- the microbatch pipeline prices on the roofline only -------------------------------------------------

def test_iteration_s_refuses_a_refined_pricer():
    with pytest.raises(ValueError, match=r"pricer must be a roofline StepPricer .*got a RefinedPricer"):
        iteration_s(pricer(LLAMA, H100, cost_model="refined"), decode_totals(2, 10), 1)


def test_step_time_takes_works_like_step_cost():
    works = [SeqWork(1, 10), SeqWork(5)]
    assert step_time(LLAMA, H100, works) == step_cost(LLAMA, H100, works).time_s


@pytest.mark.parametrize("n_new, n_past, says", [(0, 5, "SeqWork.n_new must be an integer >= 1, got 0"),
                                                 (1, -1, "SeqWork.n_past must be an integer >= 0, got -1")])
def test_a_seq_work_feeds_at_least_one_token(n_new, n_past, says):
    with pytest.raises(ValueError) as e:
        SeqWork(n_new, n_past)
    assert says in str(e.value)


@pytest.mark.parametrize("call", [
    lambda: step_cost(LLAMA, H100, [], foo=1),
    lambda: step_time(LLAMA, H100, decode_totals(1, 10), foo=1),
    lambda: max_batch_within(LLAMA, H100, 0.02, 512, foo=1),
    lambda: decode_profile(LLAMA, H100, 512, foo=1),
])
def test_unknown_settings_are_named_with_the_allowed_ones(call):
    with pytest.raises(ValueError, match=r"^unknown setting 'foo'=1; allowed: cost_model, tp, pp, .*seq_overhead_s"):
        call()


# ---- no price is inf ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("cost_model", ["roofline", "refined"])
def test_overheads_that_overflow_a_float_are_named(cost_model):
    with pytest.raises(ValueError, match=r"would take inf s: overhead_s=1e\+308 \+ seq_overhead_s=1e\+308 x 4 "
                                         r"requests is past the largest float"):
        step_cost(LLAMA, H100, decode_totals(4, 10), cost_model=cost_model, overhead_s=1e308, seq_overhead_s=1e308)
    with pytest.raises(ValueError, match="would take inf s"):
        step_time(LLAMA, H100, decode_totals(4, 10), cost_model=cost_model, overhead_s=1e308, seq_overhead_s=1e308)
    with pytest.raises(ValueError, match="would take inf s"):
        decode_profile(LLAMA, H100, 10, cost_model=cost_model, overhead_s=1e308, seq_overhead_s=1e308)


def test_overflowing_overheads_are_named_by_the_microbatch_pipeline():
    pr = pricer(LLAMA, H100, overhead_s=1e308, seq_overhead_s=1e308)
    with pytest.raises(ValueError, match="would take inf s: overhead_s=1e"):
        iteration_s(pr, decode_totals(4, 10), 2)
    with pytest.raises(ValueError, match="would take inf s: overhead_s=1e"):
        decode_iterations_s(pr, 4, 40, 3, 2)


@pytest.mark.parametrize("call, match", [
    (lambda: step_cost(LLAMA, GPUSpec("x", 5e-324, 5e-324, 1e30), decode_totals(4, 10)),
     r"peak_flops x flop_efficiency on 'x' must be at least 1 FLOP/s, got 4.94066e-324 x 0.7"),
    (lambda: pricer(LLAMA, H100, bw_efficiency=1e-320), r"mem_bw x bw_efficiency on 'h100' must be at least 1 bytes/s"),
    (lambda: pricer(LLAMA, GPUSpec("x", 1e12, 1e12, 1e9, 1e-320, 1e-320, 8), tp=2),
     r"nvlink_bw x comm_efficiency on 'x' must be at least 1 bytes/s"),
    (lambda: pricer(LLAMA, GPUSpec("x", 1e12, 1e12, 1e9, refined=RefinedParams(gemm_bw_ceiling=1e-320)),
                    cost_model="refined"), r"mem_bw x gemm_bw_ceiling on 'x' must be at least 1 bytes/s"),
])
def test_rates_below_one_per_second_are_refused_when_the_pricer_is_built(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_hw_model_cli_refuses_a_bandwidth_no_step_can_be_priced_at(capsys):
    assert "mem_bw x --bw-efficiency on 'h100' must be at least 1 bytes/s" in cli_error(["--bw-efficiency", "1e-320"],
                                                                                      capsys)


# ---- names, units and files --------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: GPUSpec(["a"], 1e12, 1e12, 1e9), r"GPUSpec.name must be a str, got \['a'\] \(list\)"),
    (lambda: GPUSpec(None, 1e12, 1e12, 1e9), "GPUSpec.name must be a str, got None"),
    (lambda: GPUSpec("x", 1e12, 1e12, 1e9, source=3), "GPUSpec.source must be a str, got 3"),
    (lambda: pricer(LLAMA, H100, attention=["full"]), r"attention must be one of full, causal, or None .*got "
                                                      r"\['full'\] \(list\)"),
    (lambda: pricer(LLAMA, H100, attention=np.array(["full", "causal"])), r"attention must be one of full, causal, "
                                                                          r"or None .*got array\(\['full', 'causal'\]"),
    (lambda: pricer(LLAMA, H100, attention=np.array("causal-tiles")), r"attention must be one of full, causal, or None"),
    (lambda: control_sync_s("x"), r"pricer must be a roofline StepPricer .*got a str"),
    (lambda: LinkSpec(None, 1e9, 1e-6), "LinkSpec.name must be a str, got None"),
    (lambda: with_link("h100", "nvlink"), r"link must be a LinkSpec, got 'nvlink' \(str\)"),
])
def test_names_choices_and_parts_are_checked(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_with_link_takes_a_cards_name():
    assert with_link("h100", LinkSpec("l", 1e9, 1e-6)).name == "h100+l-link"


def _profile(tmp_path, edit=None, text=None):
    p = tmp_path / "p.json"
    if text is not None:
        p.write_bytes(text)
    else:
        d = json.loads(save_profile(get_gpu(H100), p).read_text())
        edit(d)
        p.write_text(json.dumps(d))
    return p


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["gpu"].update(name=["a"]), r"p.json': GPUSpec.name must be a str, got \['a'\] \(list\)"),
    (lambda d: d.update(version=True), "p.json': profile version True is not supported"),
])
def test_profile_fields_of_the_wrong_type_are_refused(tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load_profile(_profile(tmp_path, edit))


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["gpu"].update(flop_efficiency=2), r"GPUSpec\.flop_efficiency must be a finite number in \(0, 1\]"),
    (lambda d: d["refined"].update(attention_tile=0), r"RefinedParams\.attention_tile must be an integer >= 1"),
])
def test_the_cli_names_a_bad_profile_field_as_the_file_spells_it(tmp_path, capsys, edit, field):
    """The field shares its name with a flag; the error said `GPUSpec.--flop-efficiency`, a key no file holds."""
    assert re.search(field, cli_error(["--gpu", str(_profile(tmp_path, edit))], capsys))


def test_a_profile_key_it_does_not_hold_is_refused_not_dropped(tmp_path):
    """A misspelt "refined" was skipped and the card priced with the datasheet's refined constants."""
    p = _profile(tmp_path, lambda d: d.update(refind=d.pop("refined")))
    with pytest.raises(ValueError, match=r"p.json': unknown key\(s\) 'refind'; a profile holds format, version, "
                                         r"gpu, refined, notes$"):
        load_profile(p)


def test_unreadable_profiles_name_the_file_and_field(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"cannot read the GPU profile '.*p.json': not UTF-8 text \(byte 0xff"):
        load_profile(_profile(tmp_path, text=b"\xff{}"))
    huge = _profile(tmp_path, lambda d: d["gpu"].update(peak_flops=0)).read_text()
    p = _profile(tmp_path, text=huge.replace('"peak_flops": 0', '"peak_flops": ' + "1" * 5000).encode())
    with pytest.raises(ValueError, match=r"p.json': gpu.peak_flops must be finite, got inf \(a number past the "
                                         r"largest float\)$"):
        load_profile(p)
    assert "gpu.peak_flops must be finite" in cli_error(["--gpu", str(p)], capsys)
    with pytest.raises(ValueError, match=r"cannot read the GPU profile .*: Is a directory"):
        load_profile(tmp_path)
    with pytest.raises(ValueError, match=r"path must be a file name \(a str or a path\), got 5 \(int\)"):
        load_profile(5)
    with pytest.raises(ValueError, match=r"path is empty; give the GPU profile's \.json file name"):
        load_profile("")   # (Path('') is '.': it was read as the current directory, "'.': Is a directory")


def _nested(depth: int) -> dict:
    """Notes `depth` levels deep: {"k": [{"k": [...]}]}."""
    notes: object = {}
    for level in range(depth - 1, 0, -1):      # (level 1, the outermost, a dict)
        notes = {"k": notes} if level % 2 else [notes]
    return notes


DEEP_NOTES = _nested(100_000)           # (read by recursion, it raised RecursionError, not the refusal)
LOOPED_NOTES: dict = {"fit": []}
LOOPED_NOTES["fit"].append(LOOPED_NOTES)


def test_notes_as_deep_as_allowed_are_saved_and_read_back(tmp_path):
    from orca_torch.sim.hw_model.gpus import NOTES_DEPTH

    notes = _nested(NOTES_DEPTH)
    path = save_profile(get_gpu(H100), tmp_path / "deep.json", notes)
    assert json.loads(path.read_text())["notes"] == notes and load_profile(path) == get_gpu(H100)
    with pytest.raises(ValueError, match=f"notes must nest at most {NOTES_DEPTH} levels"):
        save_profile(get_gpu(H100), tmp_path / "deeper.json", {"k": notes})


def _shared(depth: int) -> list:
    """`[a, a]` nested `depth` deep: `depth` lists, which JSON writes out as 2**depth copies of the innermost."""
    notes: list = [0]
    for _ in range(depth):
        notes = [notes, notes]
    return notes


def test_notes_that_json_would_write_out_past_the_bound_are_refused_counting_each_copy(tmp_path, monkeypatch):
    """60 lists shared as `[a, a]` pass the depth bound, but JSON writes every copy (2**60 values, a
    write that never ends): refused at once, as notes just past the bound are; at the bound they are saved."""
    from orca_torch.sim.hw_model import gpus

    with pytest.raises(ValueError, match=r"notes must hold at most 1,000,000 values as JSON writes them \(a part "
                                         r"held in several places is written in each\), got more than 1,000,000 "
                                         r"within 20 levels"):
        save_profile(get_gpu(H100), tmp_path / "shared.json", {"fit": _shared(60)})
    assert not (tmp_path / "shared.json").exists()
    monkeypatch.setattr(gpus, "NOTES_VALUES", 1 + 2 + 4 + 8 + 8)      # {"fit": _shared(3)} as JSON writes it
    path = save_profile(get_gpu(H100), tmp_path / "at.json", {"fit": _shared(3)})
    assert json.loads(path.read_text())["notes"] == {"fit": _shared(3)}
    with pytest.raises(ValueError, match="notes must hold at most 23 values"):
        save_profile(get_gpu(H100), tmp_path / "past.json", {"fit": _shared(3), "k": 0})

@pytest.mark.parametrize("path, notes, match", [
    ("/proc/x/y.json", None, "cannot write the GPU profile '/proc/x/y.json': No such file or directory"),
    (5, None, r"path must be a file name \(a str or a path\), got 5 \(int\)"),
    ("", None, r"path is empty; give the GPU profile's \.json file name, such as 'profile\.json'$"),
    ("ok.json", {"a": object()}, "notes must hold finite JSON values .*Object of type object is not JSON serializable"),
    ("ok.json", {"a": float("nan")}, "notes must hold finite JSON values"),
    ("ok.json", [1], r"notes must be a dict or None, got \[1\] \(list\)"),
    ("ok.json", {"fit": [{1: 0.5}]}, r"notes must hold str keys only \(JSON would write 1 as \"1\"\), got key 1 \(int\)"),
    ("ok.json", {"a": {None: 1}}, r"notes must hold str keys only \(JSON would write None as \"null\"\), got key None"),
    ("ok.json", {(1, 2): 0},
     r"notes must hold str keys only \(JSON cannot write it as a key\), got key \(1, 2\) \(tuple\)$"),
    ("ok.json", {10**5000: 0}, r"notes must hold str keys only \(JSON cannot write it as a key\), got key <an integer "
                               r"of about 5001 digits> \(int\)$"),
    ("dir.json", None, "cannot write the GPU profile 'dir.json': Is a directory"),
    ("ok.json", DEEP_NOTES, r"notes must nest at most 100 levels of dicts and lists \(JSON's reader takes back no "
                            r"deep nest\); these nest deeper, or hold themselves$"),
    ("ok.json", LOOPED_NOTES, r"notes must nest at most 100 levels .* or hold themselves$"),
])
def test_save_profile_refuses_bad_paths_and_notes(tmp_path, monkeypatch, path, notes, match):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ValueError, match=match):
        save_profile(get_gpu(H100), path, notes)


@pytest.mark.parametrize("gpu", ["h100", {"name": "h100"}, None])
def test_save_profile_takes_a_gpuspec_only(tmp_path, gpu):
    """A card's name raised dataclasses' TypeError 'asdict() should be called on dataclass instances'."""
    with pytest.raises(ValueError, match=r"gpu must be a GPUSpec, got "):
        save_profile(gpu, tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("name", ["h300", "/etc/hosts", "profiles/a100"])
def test_an_unknown_gpu_is_refused_listing_every_kind_of_name_taken(name):
    """A name that is neither a card nor a .json profile: the refusal lists the cards and says a
    profile's path is taken too (the calculator's `--gpu`, `api.simulate(gpu=)`)."""
    with pytest.raises(ValueError) as e:
        get_gpu(name)
    assert str(e.value) == (f"unknown GPU {name!r}; known GPUs: a100-40gb, a100-80gb, h100, h200, cpu, "
                            "or a GPU profile's .json path")


@pytest.mark.parametrize("price", ["step_time", "step_cost"])
@pytest.mark.parametrize("step, says", [
    (None, r"a step is a StepTotals or a list of SeqWork, got None \(NoneType\)"),
    ("x", r"a step is a StepTotals or a list of SeqWork, got 'x' \(str\)"),
    (3.0, r"a step is a StepTotals or a list of SeqWork, got 3.0 \(float\)"),
    ([1, 2], r"works must hold SeqWork objects only; item 0 is 1"),
    (StepTotals(1, 0, 0, 0, 0), r"inconsistent StepTotals\(n_seqs=1, n_tokens=0.*need n_seqs <= n_tokens"),
    (StepTotals(-1, 1, 1, 1, 1), r"StepTotals.n_seqs must be an integer >= 0, got -1"),
])
def test_a_step_priced_at_the_door_is_a_step(price, step, says):
    """`step_time` and `step_cost` take a step from outside: what is not one is refused by name, not
    met by an AttributeError or TypeError from inside the pricer."""
    from orca_torch.sim.hw_model import cost

    with pytest.raises(ValueError, match=says):
        getattr(cost, price)("llama-3-8b", "h100", step)
