"""The experiment scripts' flags: every bad value fails before anything runs or prints, exit code 2."""
from __future__ import annotations

import argparse
import json
import re
import runpy
import sys
from typing import Callable

import numpy as np
import pytest
import torch

from orca_torch.lab.api import run as api_run
from orca_torch.lab.cli_args import demos_arg, device_arg, seed_arg, torch_preset_arg
from orca_torch.lab.report import Report, run_experiment

from .conftest import EXPERIMENTS, ROOT, load_script


@pytest.mark.parametrize("seed", ["-1", str(2**63), "99999999999999999999999", "1.5", "x"])
@pytest.mark.parametrize("script", EXPERIMENTS, ids=lambda p: p.stem)
def test_every_experiment_refuses_a_seed_outside_the_rule_before_running(script, seed, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--seed", seed, "--quick", "--json"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(script), run_name="__main__")
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""                                            # nothing ran
    assert f"argument --seed: must be an integer with 0 <= seed < 2**63, got '{seed}'" in out.err


def test_seed_flag_accepts_the_whole_range_and_nothing_else(capsys):
    seen = []
    run_experiment("t", lambda args, rep: seen.append(args.seed), argv=["--seed", "7"])
    run_experiment("t", lambda args, rep: seen.append(args.seed), argv=[])
    run_experiment("t", lambda args, rep: seen.append(args.seed), argv=["--seed", str(2**63 - 1)])
    assert seen == [7, 0, 2**63 - 1]
    torch.Generator().manual_seed(seen[-1] + 1)           # a derived seed still fits torch and numpy
    np.random.default_rng(seen[-1] + 1)
    with pytest.raises(argparse.ArgumentTypeError):
        seed_arg(str(2**64))
    with pytest.raises(SystemExit):
        run_experiment("t", lambda args, rep: seen.append(args.seed), argv=["--seed", "1.5"])
    assert "0 <= seed < 2**63, got '1.5'" in capsys.readouterr().err and len(seen) == 3
    last = str(2**63 - 2)
    run_experiment("t", lambda args, rep: seen.append(args.seeds), argv=["--seed", last, "--seeds", "2"],
                   flags=("seeds",))
    with pytest.raises(SystemExit):
        run_experiment("t", lambda args, rep: seen.append(args.seeds), argv=["--seed", last, "--seeds", "3"],
                       flags=("seeds",))
    assert f"--seed {last} with --seeds 3 goes past the last seed" in capsys.readouterr().err and seen[3:] == [2]


@pytest.fixture(scope="module")
def exp01():
    return load_script(ROOT / "experiments" / "01_clipper_real.py")


@pytest.mark.parametrize("device, says", [
    ("bogus", "unknown device 'bogus'; allowed: cpu, cuda or cuda:N"),
    ("meta", "device type 'meta' is not supported here; allowed: cpu, cuda or cuda:N"),
    ("cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}", "asked for, but"),
])
def test_exp01_bad_device_fails_before_any_demo(exp01, device, says, capsys):
    ran = []
    with pytest.raises(SystemExit) as exc:
        run_experiment("01", lambda args, rep: ran.append(1), argv=["--device", device, "--json"], flags=("device",))
    assert exc.value.code == 2 and ran == []
    err = capsys.readouterr().err
    assert "argument --device" in err and says in err
    assert device_arg("cpu") == "cpu"


def test_exp01_profile_json_has_one_shape_whether_or_not_noise_hides_a_slope(exp01, monkeypatch):
    import clipper.torch_models as tm

    sizes = np.repeat([1, 64, 256], 5).astype(float)

    def fake_measure(model_name, batch_sizes, reps, seed):
        # 'mlp' gets latencies that fall with the batch: every fit raises (slope hidden by noise)
        lat = 5.0 - 0.001 * sizes if model_name == "mlp" else 0.2 + 0.01 * sizes
        return tm.MeasuredProfile(model_name, sizes, lat)

    monkeypatch.setattr(tm, "make_model", lambda name, seed, device: name)
    monkeypatch.setattr(tm, "measure_profile", fake_measure)
    profiles = exp01.real_profiles(argparse.Namespace(quick=True, seed=0), Report(as_json=True), "cpu")
    shapes = {name: {key: sorted(p[key]) for key in ("mean", "median", "p90")} for name, p in profiles.items()}
    keys = ["a_ms", "b_ms", "slope_hidden_by_noise"]
    assert all(s == {"mean": keys, "median": keys, "p90": keys} for s in shapes.values())
    hidden, shown = profiles["mlp"]["median"], profiles["token-mlp"]["median"]
    assert hidden == {"a_ms": None, "b_ms": None, "slope_hidden_by_noise": True}
    assert profiles["mlp"]["fixed_share_at_32"] is None
    assert shown["slope_hidden_by_noise"] is False
    assert shown["a_ms"] == pytest.approx(0.2) and shown["b_ms"] == pytest.approx(0.01)
    assert profiles["token-mlp"]["fixed_share_at_32"] == pytest.approx(0.2 / (0.2 + 32 * 0.01))


@pytest.mark.parametrize("value, says", [("", "argument --demos: is empty"),
                                         ("1,,2", "empty demo number in '1,,2'"),
                                         ("9", "no demo 9"), ("x", "got 'x'")])
def test_exp02_bad_demos_fail_before_any_demo(value, says, capsys):
    mod = load_script(ROOT / "experiments" / "02_selective_batching.py")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--json", "--demos", value])
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and says in out.err and "demo numbers in 1..4" in out.err
    assert demos_arg(4)("2,1") == [1, 2]                    # (the script's order)
    with pytest.raises(argparse.ArgumentTypeError, match="'2,1,2' names demo 2 twice; give each once"):
        demos_arg(4)("2,1,2")
    with pytest.raises(argparse.ArgumentTypeError, match="no demo 2; give 1, the script's only demo"):
        demos_arg(1)("2")
    with pytest.raises(SystemExit):
        mod.main(["--threads", "0"])
    assert "argument --threads: must be an integer from 1 to" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mod.main(["--json", "--demos", "3,1,3"])
    out = capsys.readouterr()
    assert out.out == "" and "argument --demos: '3,1,3' names demo 3 twice; give each once" in out.err


# ---- the benchmarks: every bad flag is a one-line usage error before anything is built or measured ---------

BENCH = ROOT / "benchmarks"


def run_script(path, argv, monkeypatch):
    """Run a script as `python path argv...` does, in this process; returns SystemExit's code (0 if none)."""
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        return e.code
    return 0


def usage_error(path, argv, monkeypatch, capsys) -> str:
    code = run_script(path, argv, monkeypatch)
    out = capsys.readouterr()
    assert code == 2 and out.out == "", (argv, out.out[-300:])
    lines = out.err.strip().splitlines()
    assert lines[-1].startswith(f"{path.name}: error: "), lines
    return lines[-1]


@pytest.fixture
def low_memory(monkeypatch):
    """16 GB available, whatever this machine has: the memory checks give the same answer everywhere."""
    import orca_torch.checks as checks

    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 16 * 10**9)


@pytest.mark.parametrize("script, argv, says", [
    ("bench_decode_batching", ["--model", "foo"], "argument --model: unknown model preset 'foo'; known presets: "),
    ("bench_decode_batching", ["--model", "gpt3-13b"], "Llama-style specs only"),
    ("bench_decode_batching", ["--model", "llama-3-8b"],
     "--model llama-3-8b (fp32 weights and K/V) with --requests 64 needs 36.8 GB of memory, but only 16.0 GB"),
    ("bench_decode_batching", ["--requests", "100000000"], "needs 227,"),
    ("bench_decode_batching", ["--requests", "0"], "argument --requests: must be an integer >= 1, got '0'"),
    ("bench_decode_batching", ["--repeats", "x"], "argument --repeats: must be an integer >= 1, got 'x'"),
    ("bench_decode_batching", ["--repeats", "5000"], "--repeats may be at most 1918"),
    ("bench_decode_batching", ["--threads", "0"], "argument --threads: must be an integer from 1 to"),
    ("bench_paged_kv", ["--model", "foo"], "argument --model: unknown model preset 'foo'"),
    ("bench_paged_kv", ["--context", "100000"], "--context 100000 + --repeats 7 decode steps exceed mini's max "
                                                "context 2048"),
    ("bench_paged_kv", ["--context", "2042"], "--context 2042 + --repeats 7 decode steps exceed"),
    ("bench_paged_kv", ["--block-size", "100000"], "--block-size 100000 is larger than mini's max context 2048"),
    ("bench_paged_kv", ["--block-size", "0"], "argument --block-size: must be an integer >= 1, got '0'"),
    ("bench_paged_kv", ["--requests", "1000000"], "with --requests 1000000, --context 256, --block-size 16 needs"),
    ("bench_paged_kv", ["--model", "llama-3-8b"], "only 16.0 GB is available here"),
    ("bench_scale", ["--n", "2000", "--system", "foo"], "argument --system: invalid choice: 'foo'"),
    ("bench_scale", ["--n", "0"], "argument --n: must be an integer >= 1, got '0'"),
    ("bench_scale", ["--rate", "nan"], "argument --rate: must be a finite number > 0, got 'nan'"),
    ("bench_scale", ["--rate", "inf"], "argument --rate: must be a finite number > 0, got 'inf'"),
    ("bench_scale", ["--n", "100000000000000"], "--n 100,000,000,000,000 (at least 1,000 bytes a chat request) "
                                                "needs 100,000,000.0 GB of memory, but only 16.0 GB"),
    ("gpu_profile", ["--gpu", "foo"], "unknown GPU 'foo'; known GPUs: a100-40gb"),
    ("gpu_profile", ["--threads", "1"], "--threads sets the torch threads of --device cpu; with --device cuda it "
                                        "would do nothing: leave it unset"),
    ("gpu_profile", ["--device", "cpu", "--model", "llama-3-8b"],
     "--model llama-3-8b on cpu (fp32 weights and the steps' K/V) needs 102.5 GB of memory, but only 16.0 GB is "
     "available here"),
    ("gpu_profile", ["--device", "cpu", "--model", "tiny", "--quick", "--repeats", "200"],
     "--repeats 200: the mixes' decodes would run past tiny's context 512; --repeats may be at most 95"),
    ("bench_calibration", ["--quick", "--repeats", "100000000"],
     "--repeats 100000000: the mixes' decodes would run past mini's context 2048; --repeats may be at most 383"),
    ("bench_calibration", ["--repeats", "341"], "--repeats may be at most 340"),
    ("bench_simulator", ["--repeat", "0"], "argument --repeat: must be an integer from 1 to 1000"),
    ("bench_simulator", ["--repeat", "-1"], "argument --repeat: must be an integer from 1 to 1000"),
    ("bench_engine", ["--new-tokens", "100000", "--requests", "1"],
     "--new-tokens 100000: prompts of up to 127 tokens plus 100000 new ones exceed the model's max context 256; "
     "--new-tokens may be at most 129"),
    ("bench_engine", ["--new-tokens", "130"], "--new-tokens may be at most 129"),
    ("bench_engine", ["--quick", "--requests", "0"], "argument --requests: must be an integer >= 1, got '0'"),
    ("bench_engine", ["--quick", "--new-tokens", "0"], "argument --new-tokens: must be an integer >= 1, got '0'"),
    ("bench_engine", ["--quick", "--threads", "0"], "argument --threads: comma-separated thread counts"),
    ("bench_engine", ["--threads", "1,x"], "must be an integer from 1 to"),
    ("bench_engine", ["--attention", "split,foo"], "argument --attention: unknown attention path(s) 'foo'"),
    ("bench_engine", ["--attention", "split,split"], "argument --attention: 'split,split' names a path twice"),
    ("bench_engine", ["--threads", "1,1"], "argument --threads: '1,1' names a thread count twice"),
    ("bench_engine", ["--quick", "--json", "--profile"], "--profile prints tables, which would break --json's"),
    ("bench_engine", ["--requests", "10000000"], "--requests 10000000 x (prompt + 48 new tokens) of K/V"),
    ("bench_calibration", ["--repeats", "0"], "argument --repeats: must be an integer >= 1, got '0'"),
    ("bench_calibration", ["--threads", "0"], "argument --threads: must be an integer from 1 to"),
    ("bench_calibration", ["--quick", "--out", "x.txt"], "argument --out: must be a .json file path, got 'x.txt'"),
    ("bench_calibration", ["--out", "p.json", "--no-measure"],
     "--out writes the measured CPU profile, which --no-measure skips; drop one of them"),
    ("bench_calibration", ["--no-measure", "--threads", "1"],
     "--threads set how this CPU is measured, which --no-measure skips; drop it or --no-measure"),
    ("bench_calibration", ["--repeats", "3", "--no-measure", "--threads", "1"],
     "--repeats and --threads set how this CPU is measured, which --no-measure skips; drop them or --no-measure"),
    ("bench_calibration", ["--no-measure", "--quick"],      # (--quick and --seed were taken and did nothing)
     "--quick set how this CPU is measured, which --no-measure skips; drop it or --no-measure"),
    ("bench_calibration", ["--no-measure", "--seed", "0"],
     "--seed set how this CPU is measured, which --no-measure skips; drop it or --no-measure"),
    ("bench_calibration", ["--quick", "--seed", "3", "--no-measure", "--repeats", "2"],
     "--quick, --seed and --repeats set how this CPU is measured, which --no-measure skips; drop them or "
     "--no-measure"),
    ("cuda_check", ["--device", "foo"], "argument --device: invalid choice: 'foo'"),
    ("cuda_check", ["--seed", "-1"], "argument --seed: must be an integer with 0 <= seed < 2**63"),
    ("cuda_check", ["--device", "cpu"], "--device cpu is the script's smoke test: add --tiny"),
    ("bench_scale", ["--n", "3", "--rate", "1e-15"], "error: --rate 1e-15 requests per second is too slow for 3 "
     "requests: their arrivals would span about 2e+15 s"),                  # (the flags typed, not check_rate's names)
    ("bench_scale", ["--n", "3", "--rate", "1e-15"], "; --rate must be at least (n - 1) / 2**32 = "),
    ("bench_serve", ["--seed", "-1"], "argument --seed: must be an integer with 0 <= seed < 2**63"),
    ("bench_serve", ["--kv-slots", "8"], "--kv-slots 8 must hold one request: --isl + --osl = 48 tokens"),
    ("bench_serve", ["--quick-calibration", "--client", "builtin", "--kv-slots", "100"],
     "--kv-slots 100 must hold the calibration load's longest request: 128 + 24 = 152 tokens"),
    ("bench_serve", ["--quick-calibration", "--client", "builtin", "--kv-slots", "1000000000"],
     "--kv-slots 1000000000 (the server's fp32 K/V of mini) needs 8,192.0 GB of memory, but only 16.0 GB"),
    ("bench_serve", ["--rates", "4,inf"], "argument --rates: must be finite numbers > 0 (req/s), got '4,inf'"),
    ("bench_serve", ["--rates", "nan"], "argument --rates: must be finite numbers > 0 (req/s), got 'nan'"),
    ("bench_serve", ["--quick", "--kv-slots", "8"], "unrecognized arguments: --quick"),   # (not --quick-calibration)
    ("bench_scale", ["--n", "3", "--trace"], "unrecognized arguments: --trace"),          # (not --tracemalloc)
    ("bench_engine", ["--quick", "--n", "2"], "unrecognized arguments: --n 2"),           # (not --new-tokens)
    ("bench_serve", ["--rates", "4,1,4.0"], "argument --rates: '4,1,4.0' names a rate twice; give each once"),
    ("bench_serve", ["--rates", "1e-300"], "--rates 1e-300 with --n 32: the requests' arrivals would span about "
     "3.1e+301 s, past the 3600 s a rate's run may take; give rates of at least 0.00861 req/s (--n - 1 over 3600 s)"),
    ("bench_serve", ["--rates", "0.0001", "--n", "2"], "--rates 0.0001 with --n 2: the requests' arrivals would "
     "span about 1e+04 s"),
    ("bench_serve", ["--n", "2000", "--osl", "1000", "--rates", "100"],
     "--n 2000 requests of --osl 1000 tokens, --max-bs 16 at a time, take at least 125,000 steps a rate, past the "
     "100,000 the server's step log keeps"),
    ("bench_serve", ["--slo-tpot", "0"], "argument --slo-tpot: must be a number of seconds > 0, or inf for no bound, "
                                         "got '0'"),
    ("bench_serve", ["--slo-ttft", "nan"], "argument --slo-ttft: must be a number of seconds > 0, or inf for no "
                                           "bound, got 'nan'"),
])
def test_benchmarks_refuse_bad_flags_with_one_line(script, argv, says, low_memory, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert says in usage_error(BENCH / f"{script}.py", argv, monkeypatch, capsys)
    assert list(tmp_path.iterdir()) == []                       # nothing written


def test_bench_serve_refuses_more_requests_than_the_open_file_limit_has_room_for(monkeypatch, capsys):
    """The built-in driver (and AIPerf) send each request at its Poisson time, answered or not, each
    on a connection of its own: --n past what the open-file limit leaves room for is refused before
    the minutes of calibrating; --n at it goes on to the next check (here: no aiperf)."""
    import shutil

    from orca_torch.serve import limits

    monkeypatch.setattr(limits, "connection_room", lambda: 200)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **kw: None)
    says = usage_error(BENCH / "bench_serve.py", ["--n", "201", "--rates", "100"], monkeypatch, capsys)
    assert says.endswith("--n 201 requests may all be in flight at once, each on a connection of its own (the client "
                         "sends each at its Poisson time, whatever has been answered), past the 200 connections this "
                         "process's open-file limit leaves room for (ulimit -n, less 64 files kept for other use): "
                         "give --n of at most 200, or raise the limit")
    assert usage_error(BENCH / "bench_serve.py", ["--n", "200", "--rates", "100", "--client", "aiperf"],
                       monkeypatch, capsys).endswith("aiperf is not on PATH: pip install 'orca-torch[bench]' (or use "
                                                     "--client builtin)")


def test_bench_serve_takes_any_rate_for_one_request_whose_only_arrival_is_at_t_0(monkeypatch, capsys):
    """The arrivals span (--n - 1) / rate: one request at 0.0001 req/s goes at t = 0 and on to the next
    check (here: no aiperf); the old check took --n / rate, 10,000 s, and refused it."""
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name, *a, **kw: None)
    assert usage_error(BENCH / "bench_serve.py", ["--rates", "0.0001", "--n", "1", "--client", "aiperf"],
                       monkeypatch, capsys).endswith("aiperf is not on PATH: pip install 'orca-torch[bench]' (or use "
                                                     "--client builtin)")


def test_bench_serve_asked_for_aiperf_where_there_is_none_says_how_to_get_it(monkeypatch, capsys):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name, *a, **kw: None)
    assert usage_error(BENCH / "bench_serve.py", ["--client", "aiperf"], monkeypatch, capsys).endswith(
        "aiperf is not on PATH: pip install 'orca-torch[bench]' (or use --client builtin)")


def test_bench_engine_with_hf_counts_transformers_copy_and_cache_in_its_memory_check(low_memory, monkeypatch, capsys):
    """--hf holds the weights and the K/V twice (transformers' model and cache): 10,000 requests fit the
    16 GB once (10.8 GB), not twice; the old check counted the K/V once and began the run."""
    import orca_torch.model.orca_model as orca_model

    monkeypatch.setattr(orca_model, "OrcaModel", _ran)
    says = usage_error(BENCH / "bench_engine.py", ["--hf", "--requests", "10000"], monkeypatch, capsys)
    assert "of K/V and the fp32 weights, twice (transformers' copy and cache) needs 21." in says


def test_bench_engine_asked_for_transformers_where_there_is_none_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)        # (import transformers raises ImportError)
    assert usage_error(BENCH / "bench_engine.py", ["--quick", "--hf"], monkeypatch, capsys).endswith(
        "--hf needs transformers: pip install 'orca-torch[hf]'")


def _ran(*args, **kwargs):
    raise AssertionError("the command line was taken: the benchmark began")


@pytest.mark.parametrize("repeat", ["1001", str(10**30)])
def test_bench_simulator_refuses_a_repeat_count_that_would_run_for_ever(repeat, monkeypatch, capsys):
    """`--repeat 10**30` was taken, and the benchmark timed its rounds until killed."""
    import orca_torch.lab.report as report

    monkeypatch.setattr(report, "machine", _ran)           # (the first thing it does after parsing)
    assert usage_error(BENCH / "bench_simulator.py", ["--repeat", repeat], monkeypatch, capsys).endswith(
        "argument --repeat: must be an integer from 1 to 1000 (a round times all 9 configurations), "
        f"got '{repeat}'")


def test_the_tokenizer_tool_checks_its_folder_before_writing(tmp_path, capsys):
    from orca_torch.serve.tokenizer import main
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    for out, says in ((str(a_file), "exists and is not a directory"), ("", "is empty; give a directory")):
        with pytest.raises(SystemExit) as e:
            main(["--out", out])
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert [f.name for f in tmp_path.iterdir()] == ["afile"]


def test_gpu_profile_checks_memory_before_building_the_model(monkeypatch, capsys, tmp_path):
    """1 MB available: even the tiny model's fp32 weights and the step grid's K/V are refused, before any
    weight is allocated."""
    import orca_torch.checks as checks

    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 10**6)
    monkeypatch.chdir(tmp_path)
    says = usage_error(BENCH / "gpu_profile.py", ["--device", "cpu", "--model", "tiny", "--quick", "--repeats", "1"],
                       monkeypatch, capsys)
    assert "--model tiny on cpu (fp32 weights and the steps' K/V) needs " in says
    assert says.endswith("of memory, but only 1 MB is available here")


def test_gpu_profile_offers_only_the_presets_it_takes(monkeypatch, capsys):
    """--help lists the presets --model accepts: not the GPT-style ones it refuses as not Llama-style."""
    import re

    from orca_torch.specs import PRESETS

    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])
    with pytest.raises(SystemExit):
        load_script(BENCH / "gpu_profile.py").main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    offered = set(re.search(r"--model MODEL model preset: (.*?) \(default", help_text).group(1).split(", "))
    taken = set()
    for name in PRESETS:
        try:
            taken.add(torch_preset_arg(name))
        except argparse.ArgumentTypeError:
            pass
    assert offered == taken and "llama-3-8b" in taken and len(taken) < len(PRESETS)


@pytest.mark.parametrize("script, pre", [("bench_decode_batching", []), ("bench_paged_kv", []),
                                         ("gpu_profile", ["--device", "cpu"])])
def test_an_unknown_model_is_told_the_presets_the_torch_model_builds(script, pre, monkeypatch, capsys):
    """`--model foo` names what --model takes: the Llama-style presets, not the GPT-style ones it would refuse
    next (the list `--help` of gpu_profile gives)."""
    from orca_torch.specs import PRESETS

    taken = []
    for name in sorted(PRESETS):
        try:
            taken.append(torch_preset_arg(name))
        except argparse.ArgumentTypeError:
            pass
    assert "llama-3-8b" in taken and len(taken) < len(PRESETS)
    says = usage_error(BENCH / f"{script}.py", [*pre, "--model", "foo"], monkeypatch, capsys)
    assert says.endswith(f"argument --model: unknown model preset 'foo'; known presets: {', '.join(taken)} (the "
                         "Llama-style ones, which the torch model builds)")


def test_gpu_profile_checks_the_cards_memory_for_cuda_and_needs_no_host_copy(monkeypatch):
    """On a card the weights are built on the card in their dtype: the bf16 weights and K/V must fit it, and the
    host needs no fp32 copy of them."""
    import orca_torch.checks as checks
    from orca_torch.specs import get_model_spec

    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])
    gpu_profile = load_script(BENCH / "gpu_profile.py")
    spec = get_model_spec("llama-3-8b").with_dtype_bytes(2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (20 * 10**9, 80 * 10**9))
    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 16 * 10**9)     # (less than 32 GB of fp32 weights)
    with pytest.raises(ValueError, match=r"--model llama-3-8b on cuda \(2-byte weights and the steps' K/V\) needs "
                                         r"29\.2 GB of memory, but only 20\.0 GB"):
        gpu_profile.check_memory("llama-3-8b", spec, "cuda", 100_000)
    gpu_profile.check_memory("llama-3-8b", spec, "cuda", 1000)


@pytest.mark.parametrize("script", ["bench_calibration", "cuda_check"])
def test_an_output_file_is_checked_before_any_measuring(script, monkeypatch, capsys, tmp_path):
    pre = ["--quick"] if script == "bench_calibration" else ["--device", "cpu", "--tiny"]
    (tmp_path / "afile").write_text("")
    cases = [(tmp_path, f"must be a .json file path, got {str(tmp_path)!r}"),
             (tmp_path / "afile" / "x.json", f"{str(tmp_path / 'afile')!r} exists and is not a directory"),
             (tmp_path / "x.txt", "must be a .json file path")]
    for out, says in cases:
        assert says in usage_error(BENCH / f"{script}.py", [*pre, "--out", str(out)], monkeypatch, capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    tmp_path.chmod(0o500)
    try:
        import os
        if not os.access(tmp_path, os.W_OK):                    # root may write anyway
            assert "cannot write" in usage_error(BENCH / f"{script}.py", [*pre, "--out", str(tmp_path / "x.json")],
                                                 monkeypatch, capsys)
    finally:
        tmp_path.chmod(0o700)


def test_bench_engine_explicit_flags_win_over_quick(monkeypatch, capsys):
    code = run_script(BENCH / "bench_engine.py", ["--quick", "--requests", "2", "--new-tokens", "3",
                                                   "--attention", "split", "--json"], monkeypatch)
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["requests"] == 2 and res["new_tokens"] == 3
    assert res["same_tokens"] is None                   # one path at one thread count: nothing compared
    assert [(r["threads"], r["attention"]) for r in res["runs"]] == [(1, "split")]     # --quick's one thread
    assert res["machine"]["torch_threads"] == [1] and res["machine"]["logical_cores"] > 0
    assert all(r["tokens"] == 2 * 3 for r in res["runs"])


@pytest.mark.parametrize("argv, says", [
    ([str(BENCH / "bench_paged_kv.py"), "--model", "foo"], "bench_paged_kv.py: error: argument --model: unknown"),
    ([str(BENCH / "bench_calibration.py"), "--quick", "--out", "/"], "bench_calibration.py: error: argument --out: "),
    ([str(ROOT / "examples" / "serve_llama.py"), str(ROOT / "no such checkpoint")],
     f"serve_llama.py: error: argument path: '{ROOT / 'no such checkpoint'}' does not exist"),
])
def test_a_fresh_process_gets_one_line_and_exit_code_2(argv, says):
    import os
    import subprocess

    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(says)


@pytest.mark.parametrize("value", ["0", "100000", str(2**63), "1.5"])
def test_threads_are_at_most_the_machines_cores(value, capsys):
    import os

    with pytest.raises(SystemExit):
        run_experiment("t", lambda args, rep: None, argv=["--threads", value], flags=("threads",))
    assert f"must be an integer from 1 to {os.cpu_count()} (this machine's cores), got '{value}'" in \
        capsys.readouterr().err
    seen = []
    run_experiment("t", lambda args, rep: seen.append(args.threads), argv=["--threads", str(os.cpu_count())],
                   flags=("threads",))
    assert seen == [os.cpu_count()]


def test_plot_and_trace_paths_are_checked_before_anything_runs(tmp_path, capsys):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    ran = []
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "made.json").mkdir()
    bad = [(["--plot", str(a_file / "sub")], "argument --plot: cannot write into"),
           (["--plot", str(tmp_path / "dangling")], "exists and is not a directory"),
           (["--plot", str(a_file)], "exists and is not a directory"),
           (["--plot", ""], "argument --plot: is empty"),
           (["--trace", str(tmp_path)], "must be a .json file path"),
           (["--trace", ""], "must be a .json file path"),
           (["--trace", str(tmp_path / "03_overload.png")], "must be a .json file path"),   # (not a figure's name)
           (["--trace", str(a_file / "x.json")], "exists and is not a directory"),
           (["--trace", str(tmp_path / "made.json")], "made.json' is a directory; give the name of a file")]
    for argv, says in bad:
        with pytest.raises(SystemExit) as exc:
            run_experiment("t", lambda args, rep: ran.append(1), argv=argv, flags=("plot", "trace"))
        assert exc.value.code == 2 and says in capsys.readouterr().err, argv
    assert ran == []
    deep = tmp_path / "new" / "figs"
    with pytest.raises(SystemExit):                 # refused for another flag: no directory is left behind
        run_experiment("t", lambda args, rep: ran.append(1), argv=["--plot", str(deep), "--seed", "-1"],
                       flags=("plot",))
    assert ran == [] and not (tmp_path / "new").exists()
    run_experiment("t", lambda args, rep: ran.append(args.plot), argv=["--plot", str(deep)], flags=("plot",))
    assert ran == [deep] and not deep.exists()      # made by the first figure written into it
    assert f"--plot {deep}: no figure drawn (the demos run draw none)" in capsys.readouterr().err
    trace = tmp_path / "t" / "run.json"
    run_experiment("t", lambda args, rep: rep.trace(api_run("chat", 8.0, 5, seed=0, trace=True)),
                   argv=["--trace", str(trace)], flags=("trace",))
    assert json.loads(trace.read_text())["otherData"]["n_requests"] == 5


def test_a_trace_needs_the_demo_that_records_it(tmp_path, capsys):
    def one(args, rep):
        pass

    def two(args, rep):
        pass

    with pytest.raises(SystemExit):
        run_experiment("t", [one, two], argv=["--demos", "1", "--trace", str(tmp_path / "t.json")],
                       flags=("trace",), trace_from=two)
    assert "--trace needs demo 2, which --demos 1 leaves out" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="no run was recorded"):   # a script that names no such demo
        run_experiment("t", [one, two], argv=["--trace", str(tmp_path / "t.json")], flags=("trace",))


def _two_demos() -> tuple[list[int], Callable, Callable]:
    """Demos `one` and `two`, which note in `ran` that they ran."""
    ran: list[int] = []

    def one(args, rep):
        ran.append(1)

    def two(args, rep):
        ran.append(2)

    return ran, one, two


def test_a_plot_needs_a_demo_that_draws(tmp_path, capsys):
    ran, one, two = _two_demos()
    with pytest.raises(SystemExit):
        run_experiment("t", [one, two], argv=["--demos", "1", "--plot", str(tmp_path)], flags=("plot",),
                       plots_from=(two,))
    assert "--plot needs demo 2, which --demos 1 leaves out" in capsys.readouterr().err and ran == []
    run_experiment("t", [one, two], argv=["--demos", "1"], flags=("plot",), plots_from=(two,))   # (not given: fine)
    run_experiment("t", [one, two], argv=["--demos", "1", "--plot", str(tmp_path)], flags=("plot",))  # (none named)
    assert ran == [1, 1]


def test_exp03_plot_with_only_the_goodput_demo_is_refused_before_running(tmp_path, monkeypatch, capsys):
    script = ROOT / "experiments" / "03_continuous_batching.py"    # (demo 2 redraws demo 1's figure, never alone)
    monkeypatch.setattr(sys, "argv", [str(script), "--quick", "--json", "--demos", "2", "--plot", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == ""
    assert "--plot needs demo 1 or 3, which --demos 2 leaves out" in out.err


def test_seeds_need_a_demo_that_reads_them(capsys):
    ran, one, two = _two_demos()
    with pytest.raises(SystemExit):
        run_experiment("t", [one, two], argv=["--demos", "2", "--seeds", "3"], flags=("seeds",), seeds_from=(one,))
    assert "--seeds needs demo 1, which --demos 2 leaves out" in capsys.readouterr().err and ran == []
    run_experiment("t", [one, two], argv=["--demos", "2"], flags=("seeds",), seeds_from=(one,))   # (not given: fine)
    run_experiment("t", [one, two], argv=["--demos", "1", "--seeds", "2"], flags=("seeds",), seeds_from=(one,))
    assert ran == [2, 1]
    last = str(2**63 - 1)       # the default seeds run past it, but only a demo that reads them may refuse it
    run_experiment("t", [one, two], argv=["--seed", last, "--demos", "2"], flags=("seeds",), seeds_from=(one,))
    with pytest.raises(SystemExit):
        run_experiment("t", [one, two], argv=["--seed", last], flags=("seeds",), seeds_from=(one,))
    assert (f"--seed {last} with --seeds 3 (the default) goes past the last seed: seeds must be an integer with "
            "0 <= seed < 2**63; give --seeds 1 at most, or a smaller --seed") in capsys.readouterr().err
    assert ran == [2, 1, 2]


def test_a_reader_that_stops_early_ends_the_script_without_a_traceback():
    import subprocess

    script = EXPERIMENTS[0]
    proc = subprocess.Popen([sys.executable, str(script), "--quick"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    proc.stdout.readline()
    proc.stdout.close()                         # as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "BrokenPipe" not in err


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("argv", [[str(ROOT / "experiments" / "03_cost_models.py"), "--quick", "--json"],
                                  ["-m", "orca_torch.lab.gpu_calculator"]], ids=["experiment", "calculator"])
def test_a_full_disk_under_stdout_ends_the_command_with_one_line(argv):
    import os
    import subprocess

    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "stopped: No space left on device; what was written is cut short"


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_full_disk_is_one_line_too_for_a_command_that_ends_in_sys_exit():
    """The benchmarks and examples run `sys.exit(main())` inside `quiet_exit`: what stdout still
    buffers must be written (and fail) there, not in the interpreter's flush at exit, which said
    "Exception ignored ... OSError" and exited 120."""
    import os
    import subprocess

    code = "import sys\nfrom orca_torch.lab.report import quiet_exit\nwith quiet_exit():\n    print('a figure')\n" \
           "    sys.exit(0)\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}    # (stdout buffered, as by default)
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=120, env={**env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1 and "Exception ignored" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "stopped: No space left on device; what was written is cut short"


@pytest.mark.parametrize("tool", ["gpu_profile", "gpu_calculator"])
@pytest.mark.parametrize("make, says", [
    (None, "no GPU profile at '{}'"),
    (lambda f: f.mkdir(), "cannot read the GPU profile '{}': Is a directory"),
    (lambda f: f.write_text("{"), "cannot read the GPU profile '{}': not JSON"),
    (lambda f: f.write_text('{"a": 1}'), "'{}' is not an orca-torch GPU profile"),
])
def test_a_bad_gpu_profile_is_refused_naming_the_flag(tool, make, says, monkeypatch, capsys, tmp_path):
    """The file --gpu names is checked by argparse, which names the flag as the tools' other refusals do."""
    path = tmp_path / "p.json"
    if make is not None:
        make(path)
    if tool == "gpu_profile":
        err = usage_error(BENCH / "gpu_profile.py", ["--gpu", str(path)], monkeypatch, capsys)
    else:
        from orca_torch.lab.gpu_calculator import main

        with pytest.raises(SystemExit) as exc:
            main(["--gpu", str(path)])
        out = capsys.readouterr()
        assert exc.value.code == 2 and out.out == ""
        err = out.err.strip().splitlines()[-1]
    assert "error: argument --gpu: " + says.format(path) in err


@pytest.mark.parametrize("flag, value, says", [
    ("--within-ms", "-5", "must be a finite number > 0, got '-5'"),
    ("--within-ms", "nan", "must be a finite number > 0, got 'nan'"),
    ("--mem-fraction", "0", "must be a finite number > 0 and <= 1, got '0'"),
    ("--mem-fraction", "1.5", "must be a finite number > 0 and <= 1, got '1.5'"),
    ("--kv-budget-gib", "-1", "must be a finite number > 0, got '-1'"),
    ("--kv-budget-gib", "inf", "must be a finite number > 0, got 'inf'"),
    ("--flop-efficiency", "0", "must be a finite number > 0 and <= 1, got '0'"),
    ("--bw-efficiency", "2", "must be a finite number > 0 and <= 1, got '2'"),
    ("--attention-tile", "0", "must be an integer >= 1, got '0'"),
    ("--batch", "-1", "must be an integer from 0 to 2**53, got '-1'"),
    ("--prompt", "-1", "must be an integer >= 0, got '-1'"),
    ("--context", "1", "must be an integer >= 2, got '1'"),
    ("--reserve", "0", "must be an integer >= 1, got '0'"),
    ("--overhead-ms", "-1", "must be a finite number of milliseconds >= 0, got '-1'"),
    ("--tp", "0", "must be an integer >= 1, got '0'"),
    ("--pp", "x", "must be an integer >= 1, got 'x'"),
])
def test_gpu_calculator_refuses_bad_numbers_in_argparse(flag, value, says, capsys):
    from orca_torch.lab.gpu_calculator import main

    with pytest.raises(SystemExit) as exc:
        main([flag, value])
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and f"argument {flag}: {says}" in out.err


@pytest.mark.parametrize("argv, says", [
    (["--tp", "3"], "error: --tp 3 must divide n_heads (32) and intermediate (14336) of llama-3-8b"),
    (["--attention-tile", "64"], "got --attention-tile 64"),
    (["--context", "512", "1024", "512"], "error: --context names 512 twice; give each context once"),
    (["--batch", "0", "--prompt", "512", "--context", "512", "8192"],     # (it printed the same prefill twice,
     "error: --context is the decodes' context, but with --batch 0 the step is the --prompt prefill alone: "
     "leave --context out, or give --batch >= 1 (or --within-ms, which reads it)"),   # as at contexts 512 and 8192)
    (["--within-ms", "1e300"], "error: --within-ms 1e+300 fits more than 16,777,216 decodes at context 1024 in a "
                               "step, more than the search counts: give a smaller budget"),     # (it said 1e+297 s)
])
def test_gpu_calculator_says_the_library_s_refusals_in_the_flags_typed(argv, says, capsys):
    from orca_torch.lab.gpu_calculator import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("argv, given", [(["--batch", "1", "256"], "1 256"),
                                         (["--batch=1", "256", "512", "--context", "512"], "1 256 512")])
def test_gpu_calculator_says_batch_takes_one_size_where_argparse_said_only_unrecognized(argv, given, capsys):
    """`--batch 1 256` (as `--context 512 1024` takes several) was refused as 'unrecognized arguments:
    256' alone."""
    from orca_torch.lab.gpu_calculator import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == "" and out.err.startswith("usage:")
    assert (f"error: --batch takes one batch size, got {given}: price each batch size in a run of its own "
            "(--context takes several, a row each; --within-ms finds the largest batch a step time allows)") in out.err
    with pytest.raises(SystemExit):                     # any other stray word: argparse's own refusal
        main(["--batch", "1", "--context", "512", "--foo"])
    assert "error: unrecognized arguments: --foo" in capsys.readouterr().err


def test_gpu_calculator_answers_a_budget_under_a_float_of_seconds_as_one_no_batch_fits(capsys):
    """--within-ms 1e-322 is 0.0 s as a float: it was refused as 'budget_s ... > 0, got 0.0' (seconds)."""
    from orca_torch.lab.gpu_calculator import main

    main(["--within-ms", "1e-322"])
    assert "no batch fits at context 1024 (one sequence alone takes 6.04 ms)" in capsys.readouterr().out


def test_gpu_calculator_says_when_a_step_holds_more_k_v_than_the_card_and_refuses_an_uncountable_budget(capsys):
    from orca_torch.lab.gpu_calculator import main

    main(["--batch", "1000", "--context", "1024", "256"])
    out = capsys.readouterr().out
    assert ("context 1024: the step holds 1,024,000 tokens of K/V, more than the 426,784 the K/V memory holds "
            "(below): it could not run so configured") in out
    assert "context 256:" not in out                    # 256,000 tokens fit
    with pytest.raises(SystemExit):
        main(["--kv-budget-gib", "1e308"])
    assert "--kv-budget-gib 1e+308 is too large to count in bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):                     # two K/V budgets: one would be dropped
        main(["--kv-budget-gib", "10", "--mem-fraction", "0.5"])
    assert "--kv-budget-gib and --mem-fraction both set the K/V budget; give one of them" in capsys.readouterr().err


def test_gpu_calculator_defaults_fit_a_model_with_a_short_context(capsys):
    from orca_torch.lab.gpu_calculator import main

    main(["--model", "tiny", "--json"])                 # tiny holds 512 tokens: the default context is that
    assert [s["context"] for s in json.loads(capsys.readouterr().out)["step"]] == [512]
    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--context", "1024"])
    assert "--context (at most tiny's max context) must be an integer in [2, 512], got 1024" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--model", "llama-3-8b"], "--model llama-3-8b is sized for a GPU: give --device cuda, or --model mini or tiny"),
    (["--device", "cuda"], "argument --device: device='cuda' asked for, but torch.cuda.is_available() is False; use 'cpu'"),
])
def test_experiment_05_refuses_a_gpu_model_or_device_on_a_cpu(argv, says, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert usage_error(ROOT / "experiments" / "05_sim_vs_real.py", argv, monkeypatch, capsys).endswith(says)


SEEDS_REFUSED = [(["--seeds", "0"], "argument --seeds: "),
                 (["--demos", "2", "--seeds", "2"], "--seeds needs demo 1, which"),
                 (["--seed", str(2**63 - 1), "--seeds", "2"],
                  f"--seed {2**63 - 1} with --seeds 2 goes past the last seed")]


@pytest.mark.parametrize("name, extra, says", [(name, *case) for name in ("04_knobs.py", "04_scheduling.py")
                                               for case in SEEDS_REFUSED]
                         + [(name, *case) for name in ("03_cost_models.py", "01_clipper_batching.py")
                            for case in SEEDS_REFUSED if "--demos" not in case[0]]
                         + [("01_clipper_batching.py", ["--demos", "1,4", "--seeds", "2"],
                             "--seeds needs demo 2 or 3, which --demos 1,4 leaves out")])
def test_the_scripts_with_seeds_refuse_bad_seeds_before_running(name, extra, says, monkeypatch, capsys):
    """01_clipper_batching, 03_cost_models and both 04 scripts spread their compared figures over --seeds N;
    a bad N is a usage error (03_cost_models has one demo: no --demos case; 01's demos 2 and 3 read the seeds)."""
    script = ROOT / "experiments" / name
    monkeypatch.setattr(sys, "argv", [str(script), "--quick", "--json", *extra])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == "" and says in out.err


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def _exit_code(call: Callable[[], object]) -> object:
    """`call()`'s SystemExit code (0 if none); a KeyboardInterrupt that gets out fails the test (rather than
    stopping pytest)."""
    try:
        call()
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C came out of the command as a KeyboardInterrupt (a traceback)")
    except SystemExit as e:
        return e.code
    return 0


def test_ctrl_c_ends_an_experiment_with_one_line_and_no_partial_output(tmp_path, capsys):
    """Ctrl-C during a demo: the shell's code for SIGINT, one line on stderr, no traceback, no half JSON
    object on stdout, and no trace file (the run it would record never ended)."""
    def demo(args, rep):
        rep.put("half", 1)
        _interrupt()

    trace = tmp_path / "t.json"
    code = _exit_code(lambda: run_experiment("t", demo, argv=["--json", "--trace", str(trace)], flags=("trace",)))
    out = capsys.readouterr()
    assert code == 130 and out.out == "" and "Traceback" not in out.err
    assert out.err.strip().splitlines()[-1] == ("interrupted (Ctrl-C): stopped before the end; nothing more "
                                                "printed or written")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script, argv", [("bench_simulator", ["--repeat", "1"]),
                                          ("bench_decode_batching", ["--model", "tiny", "--requests", "1",
                                                                     "--repeats", "1"])])
def test_ctrl_c_ends_a_benchmark_with_one_line(script, argv, monkeypatch, capsys):
    """A benchmark stopped by Ctrl-C (here as it prints its machine line) says so in one line, exit code 130."""
    import orca_torch.lab.report as report

    monkeypatch.setattr(report, "machine", _interrupt)
    code = _exit_code(lambda: sys.exit(run_script(BENCH / f"{script}.py", argv, monkeypatch)))
    out = capsys.readouterr()
    assert code == 130 and "Traceback" not in out.err
    assert out.err.strip().splitlines()[-1].startswith("interrupted (Ctrl-C)")


def test_no_tool_takes_a_flag_by_its_first_letters(capsys):
    """A flag one tool has and another lacks is refused there, not run as a longer flag it begins; every
    parser is `cli_args.command_parser`, which turns abbreviations off."""
    import re

    from orca_torch.distributed.__main__ import parser as distributed_parser

    with pytest.raises(SystemExit) as exc:
        distributed_parser().parse_args(["--n", "4"])          # (not --n-workers 4)
    assert exc.value.code == 2 and "error: unrecognized arguments: --n 4" in capsys.readouterr().err
    for path in [*ROOT.glob("orca_torch/**/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py")]:
        if path.name != "cli_args.py":
            assert not re.search(r"ArgumentParser\(", path.read_text()), f"{path}: use cli_args.command_parser"


def test_distributed_refuses_more_batches_in_flight_than_the_scheduler_takes_at_the_flag(capsys):
    """--n-workers took any count, and SchedulerConfig (at most MAX_WORKERS) refused 1025 with a
    traceback only once every rank had joined the group."""
    from orca_torch.core.scheduler_config import MAX_WORKERS
    from orca_torch.distributed.__main__ import parser as distributed_parser

    assert distributed_parser().parse_args(["--n-workers", str(MAX_WORKERS)]).n_workers == MAX_WORKERS
    with pytest.raises(SystemExit) as exc:
        distributed_parser().parse_args(["--n-workers", str(MAX_WORKERS + 1)])
    assert exc.value.code == 2
    assert f"argument --n-workers: must be an integer from 1 to {MAX_WORKERS}, got '{MAX_WORKERS + 1}'" in \
        capsys.readouterr().err


def test_distributed_refuses_an_empty_control_address(capsys):
    """`--control-addr ''` is a mistake, not "the default": it was taken as MASTER_ADDR, unsaid."""
    from orca_torch.distributed.__main__ import parser as distributed_parser

    with pytest.raises(SystemExit) as exc:
        distributed_parser().parse_args(["--control-addr", ""])
    assert exc.value.code == 2 and "argument --control-addr: must be non-empty text, got ''" in capsys.readouterr().err


@pytest.mark.parametrize("module, flag", [("distributed", "--control-addr"), ("serve", "--host")])
def test_a_listening_address_with_a_byte_that_is_no_text_is_refused_by_the_parser(module, flag, capsys):
    """A byte of the command line that is no UTF-8 (kept by Python as a lone surrogate) was taken, and
    the socket module's bind failed on it later with a TypeError traceback ('encoding of hostname failed')."""
    import importlib

    p = importlib.import_module(f"orca_torch.{module}.__main__").parser()
    with pytest.raises(SystemExit) as exc:
        p.parse_args([flag, "host\udcff"])
    assert exc.value.code == 2
    assert f"argument {flag}: must be a host name or address (UTF-8 text), got 'host\\udcff'" in capsys.readouterr().err
    assert getattr(p.parse_args([flag, "localhost"]), flag[2:].replace("-", "_")) == "localhost"


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_path_in_a_directory_that_takes_no_files_says_so(capsys):
    """/proc is there but makes no new file (the OS says ENOENT): the refusal says that, not "No such file"."""
    for argv, says in ((["--plot", "/proc/figs"], "argument --plot: cannot write into '/proc/figs': '/proc' takes no "
                                                   "new files"),
                       (["--trace", "/proc/x.json"], "argument --trace: cannot write into '/proc': '/proc' takes no "
                                                     "new files")):
        with pytest.raises(SystemExit):
            run_experiment("t", lambda args, rep: None, argv=argv, flags=("plot", "trace"))
        assert says in capsys.readouterr().err


def test_a_name_too_long_for_the_file_system_is_a_usage_error(tmp_path, capsys):
    """A path the file system cannot even look up (a name past its limit) is refused in one line, not with
    the OSError's traceback; --plot, --trace and every other output path go through the same check."""
    import os

    long_name = "a" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1)
    for argv in (["--plot", str(tmp_path / long_name)], ["--trace", str(tmp_path / f"{long_name}.json")],
                 ["--plot", str(tmp_path / long_name / "figs")]):
        with pytest.raises(SystemExit) as exc:
            run_experiment("t", lambda args, rep: None, argv=argv, flags=("plot", "trace"))
        assert exc.value.code == 2
        assert f"argument {argv[0]}: cannot write " in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_serve_llama_refuses_a_path_the_file_system_cannot_look_up(tmp_path, capsys):
    import os

    example = load_script(ROOT / "examples" / "serve_llama.py")
    long_path = str(tmp_path / ("a" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1)))
    with pytest.raises(SystemExit) as exc:
        example.main([long_path])
    assert exc.value.code == 2 and "argument path: cannot read " in capsys.readouterr().err


def test_serve_llama_help_says_the_checkpoint_path_is_needed(capsys):
    """The usage line shows `[path]` (argparse's optional, so that a missing path gets the example's own
    refusal): the path's help said only what the directory holds, not that one must be given."""
    example = load_script(ROOT / "examples" / "serve_llama.py")
    with pytest.raises(SystemExit) as exc:
        example.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 0 and "path needed: a local checkpoint directory (config.json, *.safetensors) with " \
        "its tokenizer files, such as a Llama 3.2 1B or TinyLlama download; nothing is downloaded" in shown


def test_serve_llama_refuses_an_empty_path_rather_than_reading_the_current_directory(tmp_path, monkeypatch, capsys):
    """Path('') is '.': an empty path was taken as the current directory, unsaid ("no tokenizer in '.'")."""
    example = load_script(ROOT / "examples" / "serve_llama.py")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        example.main([""])
    assert exc.value.code == 2
    assert "argument path: is empty; give a local checkpoint directory" in capsys.readouterr().err


@pytest.mark.parametrize("absent", ["httpx", "uvicorn", "fastapi", "tokenizers"])
def test_the_live_example_without_the_serve_extra_says_what_to_install_before_starting_a_server(
        absent, monkeypatch, capsys):
    """Without a module of the `serve` extra the example ended in a traceback: with no httpx only once
    its server was serving, with no uvicorn, fastapi or tokenizers while building it."""
    example = load_script(ROOT / "examples" / "continuous_batching_live.py")
    monkeypatch.setitem(sys.modules, absent, None)      # (import of it halts: as if not installed)
    monkeypatch.setattr(example, "make_server", lambda *a, **k: pytest.fail("a server was built"))
    with pytest.raises(SystemExit) as exc:
        example.main([])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.splitlines()[-1].endswith(
        f"error: this example needs the serve extra, and {absent} cannot be imported: pip install 'orca-torch[serve]'")


def test_the_live_examples_list_of_the_serve_extra_is_pyprojects():
    """The example names the `serve` extra's modules to check them before a server starts; the list
    must be pyproject.toml's, or a module the extra gains goes unchecked."""
    tomllib = pytest.importorskip("tomllib")        # (Python 3.11 on; the project runs on 3.10 too)
    example = load_script(ROOT / "examples" / "continuous_batching_live.py")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    assert list(example.SERVE_EXTRA) == [re.match(r"[A-Za-z0-9_]+", r).group() for r in extra]


@pytest.mark.parametrize("argv, says", [(["--seed", "1", "--quick", "--seed", "2"], "--seed is given twice"),
                                        (["--seed=1", "--seed", "1"], "--seed is given twice"),
                                        (["--plot", "a", "--plot", "b"], "--plot is given twice")])
def test_a_flag_with_a_value_given_twice_is_refused_not_overridden(argv, says, capsys):
    """argparse keeps the last value and drops the first, unsaid; every tool's parser refuses the second."""
    ran = []
    with pytest.raises(SystemExit) as exc:
        run_experiment("t", lambda args, rep: ran.append(1), argv=argv, flags=("plot",))
    assert exc.value.code == 2 and ran == [] and f"error: {says}; give it once" in capsys.readouterr().err
    run_experiment("t", lambda args, rep: ran.append(args.quick), argv=["--quick", "--quick"])   # (no value lost)
    assert ran == [True]


def test_ctrl_c_ends_the_tokenizer_tool_with_one_line(monkeypatch, capsys):
    import warnings

    import orca_torch.lab.cli_args as cli_args

    monkeypatch.setattr(cli_args, "command_parser", _interrupt)     # (Ctrl-C as the tool starts)
    monkeypatch.setattr(sys, "argv", ["tokenizer"])
    with warnings.catch_warnings():                                 # (-m of a module its package imported already)
        warnings.filterwarnings("ignore", ".*found in sys.modules", RuntimeWarning)
        code = _exit_code(lambda: runpy.run_module("orca_torch.serve.tokenizer", run_name="__main__"))
    assert code == 130 and capsys.readouterr().err.strip().startswith("interrupted (Ctrl-C)")


def test_work_that_ctrl_c_stops_is_said_stopped_not_done(capsys):
    rep = Report()
    with pytest.raises(KeyboardInterrupt):
        with rep.progress("sweep", 3) as bar:
            bar("one")
            _interrupt()
    err = capsys.readouterr().err
    assert "sweep: stopped after " in err and ", 1 done" in err and "done in" not in err
