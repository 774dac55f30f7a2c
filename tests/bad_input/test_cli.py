"""The experiment scripts' flags: every bad value fails before anything runs or prints, exit code 2."""
from __future__ import annotations

import argparse
import runpy
import sys

import numpy as np
import pytest
import torch

from orca_torch.report import Report, demos_arg, device_arg, run_experiment, seed_arg

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
    assert demos_arg(4)("2,1,2") == [1, 2]
    with pytest.raises(SystemExit):
        mod.main(["--threads", "0"])
    assert "argument --threads: must be an integer from 1 to" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "100000", str(2**63), "1.5"])
def test_threads_are_at_most_the_machines_cores(value, capsys):
    import os

    from orca_torch.accounting import torch_threads

    with pytest.raises(SystemExit):
        run_experiment("t", lambda args, rep: None, argv=["--threads", value], flags=("threads",))
    assert f"must be an integer from 1 to {os.cpu_count()} (this machine's cores), got '{value}'" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match=r"n must be an integer from 1 to \d+ \(this machine's cores\)"):
        with torch_threads(int(float(value)) if value != "1.5" else 1.5):
            pass
    seen = []
    run_experiment("t", lambda args, rep: seen.append(args.threads), argv=["--threads", str(os.cpu_count())],
                   flags=("threads",))
    assert seen == [os.cpu_count()]


def test_plot_and_trace_paths_are_checked_before_anything_runs(tmp_path, capsys):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    ran = []
    bad = [(["--plot", str(a_file / "sub")], "argument --plot: cannot write into"),
           (["--plot", str(a_file)], "exists and is not a directory"),
           (["--plot", ""], "argument --plot: is empty"),
           (["--trace", str(tmp_path)], "is not a file name"),
           (["--trace", ""], "is not a file name"),
           (["--trace", str(a_file / "x.json")], "exists and is not a directory")]
    for argv, says in bad:
        with pytest.raises(SystemExit) as exc:
            run_experiment("t", lambda args, rep: ran.append(1), argv=argv, flags=("plot", "trace"))
        assert exc.value.code == 2 and says in capsys.readouterr().err, argv
    assert ran == []
    deep = tmp_path / "new" / "figs"
    run_experiment("t", lambda args, rep: ran.append(args.plot), argv=["--plot", str(deep)], flags=("plot",))
    assert ran == [deep] and deep.is_dir()


def test_a_trace_needs_the_demo_that_records_it(tmp_path, capsys):
    def one(args, rep):
        pass

    def two(args, rep):
        pass

    with pytest.raises(SystemExit):
        run_experiment("t", [one, two], argv=["--demos", "1", "--trace", str(tmp_path / "t.json")],
                       flags=("trace",), trace_from=two)
    assert "--trace needs demo 2 (two), which --demos 1 leaves out" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="no run was recorded"):   # a script that names no such demo
        run_experiment("t", [one, two], argv=["--trace", str(tmp_path / "t.json")], flags=("trace",))


def test_a_reader_that_stops_early_ends_the_script_without_a_traceback():
    import subprocess

    script = EXPERIMENTS[0]
    proc = subprocess.Popen([sys.executable, str(script), "--quick"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    proc.stdout.readline()
    proc.stdout.close()                         # as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "BrokenPipe" not in err

