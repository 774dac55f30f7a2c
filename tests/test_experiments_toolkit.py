"""The experiment toolkit (orca_torch/report.py): one flag set, demos, progress on stderr, figures over seeds."""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orca_torch.lab import api
from orca_torch.lab.report import (PaperGPU, Report, jsonable, machine, machine_line, ms, over_seeds, pct,
                                     run_experiment, same_load, spread, spread_rows)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT03 = ROOT / "experiments" / "03_continuous_batching.py"


def _run03(*argv: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, str(SCRIPT03), "--quick", *argv], capture_output=True, text=True,
                         timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out


def test_every_script_reads_as_its_demos():
    for script in sorted((ROOT / "experiments").glob("[0-9][0-9]_*.py")):
        assert len(script.read_text().splitlines()) <= 210, script.name


def _script(path: Path, monkeypatch):
    spec = importlib.util.spec_from_file_location(f"imported_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)      # (a dataclass looks its module up there)
    spec.loader.exec_module(module)
    return module


def test_every_script_has_one_entry_shape(monkeypatch, capsys):
    """Every script says in its docstring's first line what it shows and where in the lecture, and is
    `main(argv=None)` behind its guard: a test or a notebook runs any of them as `main([...])`, which
    prints what the command line prints and returns the figures."""
    monkeypatch.setattr(sys, "path", [str(ROOT), *sys.path])
    for script in sorted((ROOT / "experiments").glob("[0-9][0-9]_*.py")):
        text = script.read_text()
        assert text.endswith('\n\nif __name__ == "__main__":\n    main()\n'), script.name
        module = _script(script, monkeypatch)
        first = module.__doc__.splitlines()[0]
        assert "lecture §" in first or "beyond the lecture" in first, (script.name, first)
        params = inspect.signature(module.main).parameters
        assert list(params) == ["argv"] and params["argv"].default is None, script.name
    clipper = _script(ROOT / "experiments" / "01_clipper_batching.py", monkeypatch)
    figures = clipper.main(["--quick", "--json", "--demos", "1"])
    assert json.loads(capsys.readouterr().out) == jsonable(figures) and "demo1" in figures


def test_a_script_imported_again_leaves_sys_path_as_it_was(monkeypatch):
    """Tests import the scripts in-process, many times over: each puts the repository on sys.path only
    where it is not there already."""
    monkeypatch.setattr(sys, "path", [str(ROOT), *sys.path])
    before = list(sys.path)
    scripts = [*(ROOT / "experiments").glob("[0-9][0-9]_*.py"), ROOT / "benchmarks" / "bench_serve.py",
               ROOT / "examples" / "continuous_batching_live.py"]
    for script in sorted(scripts):
        _script(script, monkeypatch)
        assert sys.path == before, script.name


def test_tables_name_figures_in_words_while_the_json_keeps_its_keys():
    """Code 03's tables name each figure as a reader says it ("Orca (max 8192) at 16 req/s"); the JSON
    keeps the identifiers (`orca_max_at_16`) that code and the docs' checks read."""
    identifier_row = re.compile(r"^[a-z0-9]+(_[a-z0-9]+)+\b", re.M)
    shown = _run03("--demos", "1,2").stdout
    assert not identifier_row.search(shown), identifier_row.search(shown)
    for words in ("static (B=128): TTFT median (s) at 1 req/s", "Orca (max 8192) at 16 req/s", "one-at-a-time "):
        assert words in shown
    e = json.loads(_run03("--demos", "1,2", "--json").stdout)
    assert "static_ttft_median_s_at_1" in e["rate_sweep_lecture_vs_project"]
    assert "orca_max_at_16" in e["rate_sweep_over_seeds"]["slo_attainment"]
    assert "one_at_a_time" in e["goodput_over_seeds"]["goodput_req_s"]
    cost = subprocess.run([sys.executable, str(ROOT / "experiments" / "03_cost_models.py"), "--quick"],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert cost.returncode == 0, cost.stderr
    assert not identifier_row.search(cost.stdout) and "Orca (oracle): goodput req/s, refined" in cost.stdout


IDENTIFIER = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")
LECTURE_TERMS = {"max_bs", "n_workers"}     # the lecture's own names for these knobs
IN_SECONDS = {"01_clipper_batching": [], "02_selective_batching": ["--demos", "1"], "03_continuous_batching": [],
              "03_cost_models": [], "04_knobs": [], "04_scheduling": [], "07_orca_evaluation": [], "08_paged_kv": []}


@pytest.mark.parametrize("name", IN_SECONDS)
def test_every_table_names_its_rows_and_columns_in_words(name: str, monkeypatch, capsys):
    """A student reads the tables: no header or cell is an identifier (`orca_max`, `max_occupied_frac_at_8`,
    `aimd / violation_pct`); the JSON keeps those. Checked on the scripts that run in seconds, each table as
    the script hands it to `Report.section` (compare and over_seeds print through it)."""
    cells, section = [], Report.section

    def recorded(self, key, title, rows, headers="keys", *args, **kwargs):
        rows = list(rows)
        cells.extend([*(headers if headers != "keys" else ()),
                      *(x for row in rows for x in (row if not isinstance(row, dict) else [*row, *row.values()]))])
        return section(self, key, title, rows, headers, *args, **kwargs)

    monkeypatch.setattr(Report, "section", recorded)
    _script(ROOT / "experiments" / f"{name}.py", monkeypatch).main(["--quick", *IN_SECONDS[name]])
    capsys.readouterr()
    assert cells, f"{name} printed no table"
    found = sorted({m.group() for c in cells for m in IDENTIFIER.finditer(str(c))} - LECTURE_TERMS)
    assert not found, f"{name}'s tables name rows or columns by identifiers: {found}"


def test_compare_and_over_seeds_print_labels_but_record_keys(capsys):
    rep = Report()
    rep.compare("c", "C", {"a_b": (1, 2.0), "c_d": (3, 4.0)}, labels={"a_b": "A B"})
    over_seeds(argparse.Namespace(seed=0, seeds=1), rep, "s", "S", {"x_y": 1.0}, lambda seed: {"x_y": 1.0},
               labels={"x_y": "X Y"})
    out = capsys.readouterr().out
    assert "A B " in out and "c_d " in out and "X Y " in out and "a_b" not in out and "x_y" not in out
    assert list(rep.results["c"]) == ["a_b", "c_d"] and list(rep.results["s"]["figures"]) == ["x_y"]


def test_progress_goes_to_stderr_and_never_with_json():
    shown = _run03("--demos", "3")
    assert "overload: 3000 requests at 128 req/s, 2 systems: done in" in shown.stderr
    assert "done in" not in shown.stdout and "Demo 3: overload" in shown.stdout
    quiet = _run03("--demos", "3", "--json")
    assert set(json.loads(quiet.stdout)) == {"workload", "overload_600_requests", "overload_3000_requests",
                                             "overload_600_requests_lecture_vs_project",
                                             "overload_3000_requests_lecture_vs_project"}
    assert "done in" not in quiet.stderr


def test_seeds_give_median_and_range_of_every_headline_figure():
    e = json.loads(_run03("--seeds", "3", "--demos", "1,2", "--json").stdout)
    good = e["goodput_over_seeds"]
    assert good["seeds"] == [0, 1, 2] == e["rate_sweep_over_seeds"]["seeds"]
    assert set(good["goodput_req_s"]) == set(e["goodput_req_s"])
    for system, s in good["goodput_req_s"].items():
        assert len(s["values"]) == 3 and s["min"] <= s["median"] <= s["max"]
        assert s["values"][0] == e["goodput_req_s"][system]          # the single-seed table is seed 0's
        assert s == spread(s["values"])
    cliff = e["rate_sweep_over_seeds"]["slo_attainment"]
    assert set(cliff) == {"orca_max_at_16", "orca_max_at_32", "orca_oracle_at_32"}
    rows = {(r["system"], r["rate_req_s"]): r for r in e["rate_sweep"]}
    for name, s in cliff.items():
        system, rate = name.rsplit("_at_", 1)
        assert s["values"][0] == rows[system, int(rate)]["slo_attainment"]
    m = api.simulate("chat", 32, 600, "orca-max", max_bs=256, seed=2)
    assert cliff["orca_max_at_32"]["values"][2] == m.slo_attainment  # seed 2 is a real, independent run


def test_spread_and_seeds_flag(capsys):
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "values": [3.0, 1.0, 2.0]}
    seen = []
    run_experiment("t", lambda a, r: seen.append(a.seeds), argv=["--quick"], flags=("seeds",))
    run_experiment("t", lambda a, r: seen.append(a.seeds), argv=[], flags=("seeds",))
    run_experiment("t", lambda a, r: seen.append(a.seeds), argv=["--seeds", "5"], flags=("seeds",))
    assert seen == [1, 3, 5]
    for bad in ("0", "x", "101"):
        with pytest.raises(SystemExit):
            run_experiment("t", lambda a, r: seen.append(a.seeds), argv=["--seeds", bad], flags=("seeds",))
        assert f"argument --seeds: must be an integer from 1 to 100, got '{bad}'" in capsys.readouterr().err
    assert seen == [1, 3, 5]


def test_table_cells_and_spread_rows_show_what_their_names_say():
    """ms and pct scale seconds and fractions for a cell; a spread's median of 1, 2, 6 is 2 (their mean
    is 3), shown beside the range; the same load is at least 1 req/s; JSON holds no inf."""
    assert (ms(0.0123), ms(1.23456, 2), pct(0.256), pct(0.5, 0)) == (12.3, 1234.56, 25.6, 50.0)
    s = spread([1.0, 2.0, 6.0])
    assert s["median"] == 2.0
    assert spread_rows({"ttft": s}) == [["ttft", 2.0, "1 - 6", "1 2 6"]]
    # the median to as many significant digits as the range and the seeds: not 0.0 for a TPOT in seconds
    assert spread_rows({"tpot": spread([1.234e-4, 1.2345e-4, 1.25e-4])}) == \
        [["tpot", 0.000123, "0.000123 - 0.000125", "0.000123 0.000123 0.000125"]]
    assert spread_rows({"tok/s": spread([1234.5, 1240.0, 1250.0])})[0][1:3] == [1240.0, "1.23e+03 - 1.25e+03"]
    assert same_load(48.0, 63.24) == 48 and same_load(0.5, 20.0) == 1
    assert jsonable({"up": math.inf, "down": -math.inf}) == {"up": None, "down": None}


def test_over_seeds_runs_each_further_seed_once_and_keeps_each_figure_its_own(capsys):
    """The first seed's figures are the demo's own run; `at_seed` runs once per further seed, and each
    figure's spread holds its own values in seed order, whatever order a seed gives them in."""
    ran = []

    def at_seed(seed: int) -> dict:
        ran.append(seed)
        return {"tok/s": 100.0 * seed, "ttft": seed / 10, "first rate below 90%": None if seed == 6 else seed}

    first = {"ttft": 0.25, "tok/s": 300.0, "first rate below 90%": 8}
    rep = Report()
    got = over_seeds(argparse.Namespace(seed=4, seeds=3), rep, "demo9_over_seeds", "Demo 9: the compared figures",
                     first, at_seed, aside="a side note", under="by_figure", if_missing="nan: none at that seed.")
    assert ran == [5, 6]
    assert list(got) == list(first)
    assert got["ttft"] == spread([0.25, 0.5, 0.6]) and got["tok/s"] == spread([300.0, 500.0, 600.0])
    below = got["first rate below 90%"]["values"]
    assert below[:2] == [8.0, 5.0] and math.isnan(below[2])
    assert rep.results == {"demo9_over_seeds": {"seeds": [4, 5, 6], "by_figure": got}}
    shown = capsys.readouterr().out
    assert "== Demo 9: the compared figures over seeds [4, 5, 6] (a side note)" in shown
    rows = [line for line in shown.splitlines() if line.startswith(tuple(first))]
    assert [row.split("  ")[0] for row in rows] == list(first) and rows[0].endswith("0.25 0.5 0.6")
    assert shown.rstrip().endswith("nan: none at that seed.")
    over_seeds(argparse.Namespace(seed=0, seeds=1), rep, "k", "Demo 9", first, at_seed, if_missing="never shown")
    assert ran == [5, 6] and "never shown" not in capsys.readouterr().out


def test_demos_and_setup(capsys):
    calls = []
    demos = [lambda a, r: calls.append(1), lambda a, r: calls.append(2), lambda a, r: calls.append(3)]
    run_experiment("t", demos, argv=["--demos", "3,1"], setup=lambda a, r: calls.append("setup"))
    assert calls == ["setup", 1, 3]
    with pytest.raises(SystemExit):
        run_experiment("t", demos, argv=["--demos", "4"])
    assert "no demo 4; give comma-separated demo numbers in 1..3" in capsys.readouterr().err

    def profiles(a, r): ...
    def aimd(a, r): ...
    with pytest.raises(SystemExit):
        run_experiment("t", [profiles, aimd], argv=["--help"])
    assert "demo numbers to run, from 1 to 2, e.g. 1,2 (default: all; the description above says what each shows)" \
        in " ".join(capsys.readouterr().out.split())


def test_cost_model_is_passed_only_when_not_the_default(monkeypatch):
    seen = []
    monkeypatch.setattr(api, "run", lambda *a, **kw: seen.append(kw) or "result")
    args = argparse.Namespace(cost_model="roofline")
    assert PaperGPU.from_args(args).run("chat", 1.0, 5, "orca-max", 0) == "result"
    assert "cost_model" not in seen[-1] and seen[-1]["model"] == "llama-3-8b" and seen[-1]["gpu"] == "h100"
    PaperGPU(cost_model="refined").run("chat", 1.0, 5, "orca-max", 0, max_bs=8)
    assert seen[-1]["cost_model"] == "refined" and seen[-1]["max_bs"] == 8


def test_the_goodput_search_line_shows_a_fine_tolerance_as_it_is(monkeypatch, capsys):
    """The tolerance was printed to whole percents: 'to 0%' for 0.001 (the search ran to 0.1%)."""
    monkeypatch.setattr(api, "goodput", lambda *a, **kw: None)
    for tol, shown in ((0.2, "20%"), (0.075, "7.5%"), (0.001, "0.1%"), (2e-6, "0.0002%")):
        PaperGPU().goodput(10, 0, tol, rep=Report())
        assert capsys.readouterr().err.startswith(f"goodput search (10 requests, to {shown}) ...\n")


def test_a_goodput_search_over_a_request_list_keeps_its_number_as_run_does():
    """`n` was required, and passed on as n_requests, which api.goodput refuses for a list ('leave it
    unset', where PaperGPU.goodput had no way to leave it unset)."""
    from orca_torch.core.request import Request

    reqs = [Request(i, 0.5 * i, 200, 20) for i in range(8)]
    g = PaperGPU().goodput(None, 0, 0.2, workload=reqs)
    assert g == api.goodput(reqs, model="llama-3-8b", gpu="h100", rel_tol=0.2)


def test_each_goodput_search_tick_says_whether_the_rate_met_the_target(monkeypatch, capsys):
    """An attainment of 0.899 printed as '90%' beside a 90% target, which reads as met."""
    def search(*a, on_rate, target, **kw):
        for rate, attained in ((4.0, 0.899), (2.0, 0.9), (3.0, 0.95)):
            on_rate(rate, attained)

    monkeypatch.setattr(api, "goodput", search)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)         # (a tick's detail shows on a terminal)
    PaperGPU().goodput(10, 0, 0.2, rep=Report())
    err = capsys.readouterr().err
    assert "4 req/s -> 89.9%, misses the 90% target" in err
    assert "2 req/s -> 90.0%, meets the 90% target" in err and "3 req/s -> 95.0%, meets" in err
    PaperGPU().goodput(10, 0, 0.2, rep=Report(), target=0.95)
    assert "4 req/s -> 89.9%, misses the 95% target" in capsys.readouterr().err


def test_cost_model_flag_takes_the_two_models_and_refuses_others(capsys):
    seen = []
    for name in ("roofline", "refined"):
        run_experiment("t", lambda a, r: seen.append(a.cost_model), argv=["--cost-model", name], flags=("cost_model",))
    assert seen == ["roofline", "refined"]
    with pytest.raises(SystemExit):
        run_experiment("t", lambda a, r: None, argv=["--cost-model", "exact"], flags=("cost_model",))
    assert "unknown cost model 'exact'; allowed: roofline, refined" in capsys.readouterr().err


def test_compare_is_the_one_lecture_beside_project_format(capsys):
    rep = Report()
    rep.compare("k", "title", {"a": (1.6, 0.8973), "b": ("yes", True), "c": (23.6, 23.56, "23.6x")}, digits=2)
    assert rep.results["k"] == {"a": {"lecture": 1.6, "project": 0.8973}, "b": {"lecture": "yes", "project": True},
                                "c": {"lecture": 23.6, "project": 23.56}}
    out = capsys.readouterr().out
    assert "figure" in out and "lecture" in out and "project" in out and "0.9" in out and "23.6x" in out
    Report().compare("k", "title", {"a": (0.1, 0.123456)})        # by default to 4 significant digits
    assert " 0.1235" in capsys.readouterr().out


def test_a_column_of_counts_and_figures_prints_its_counts_as_integers(capsys):
    """Code 05's run table has a step count below times in one column: 124 steps, not 124.000."""
    Report().section("run", "title", [["makespan (s)", 1.52345, "+3%"], ["steps", 124, "-1%"]],
                     ["figure", "real", "error"], floatfmt=".3f")
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].split() == ["makespan", "(s)", "1.523", "+3%"] and lines[-1].split() == ["steps", "124", "-1%"]
    assert lines[-2].index("1.523") + 1 == lines[-1].index("124") + 3       # at the decimal point, as tabulate puts ints
    Report().section("k", "title", [["a", 1, 2.5], ["b", 3, 4.25]], ["x", "n", "v"], floatfmt=".2f")
    assert capsys.readouterr().out.splitlines()[-1].split() == ["b", "3", "4.25"]     # one type a column: as before
    Report().section("k", "title", [["a", 1], ["b", 2.5], ["c", "~2"]], ["x", "v"], floatfmt=".2f")
    assert capsys.readouterr().out.splitlines()[-3].split() == ["a", "1"]             # a column of words: as before


def test_a_column_of_figures_written_as_strings_prints_them_as_written(capsys):
    """Experiment 07's setup table writes each model's weights a GPU to one decimal: 175B's "22.0"
    printed as 22 when the printer read the strings as numbers again. Figures a script wrote print
    as written (aligned at the point), in rows given as lists or as dicts."""
    from orca_torch.lab.orca_evaluation import setup_rows

    Report().section("setup", "title", setup_rows(), ["model", "tp", "pp", "gpus", "GB", "kv", "a", "b", "wire"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("gpt3-175b"))
    assert row.split()[4] == "22.0"
    for rows in ([["a", "1.50", 2], ["b", "10", 3.5]],
                 [{"x": "a", "v": "1.50", "n": 2}, {"x": "b", "v": "10", "n": 3.5}]):
        Report().section("k", "title", rows, ["x", "v", "n"] if isinstance(rows[0], list) else "keys")
        lines = capsys.readouterr().out.splitlines()
        assert lines[-2].split() == ["a", "1.50", "2"] and lines[-1].split() == ["b", "10", "3.5"]
        assert lines[-2].index(".50") == lines[-1].index("10") + 2              # at the decimal point


def test_compare_shows_every_float_to_significant_digits_as_spread_rows_does(capsys):
    """It rounded to decimal places, so an ITL of 1.2346e-4 s showed as 0.0001 (one digit) beside a ratio of
    15.0996 (six), and left a numpy float32 unrounded; integers stay whole."""
    Report().compare("k", "title", {"itl": (1e-4, 1.2346e-4), "ratio": (36.9, 15.09964),
                                    "f32": (0.1, np.float32(0.123456)), "n": (22385, 22385)})
    rows = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()[4:]}
    assert rows == {"itl": "0.0001235", "ratio": "15.1", "f32": "0.1235", "n": "22385"}


def test_a_refined_run_says_so_and_prices_its_bounds_the_same_way():
    """`--cost-model refined` is named in the titles and the JSON, and the prefill and decode bounds
    beside the runs are priced by it too (the roofline's output names no cost model)."""
    from orca_torch.sim.bounds import prefill_alone_s

    refined = json.loads(_run03("--cost-model", "refined", "--demos", "2,3", "--json").stdout)
    roofline = json.loads(_run03("--demos", "2,3", "--json").stdout)
    assert refined["cost_model"] == "refined" and "cost_model" not in roofline
    assert refined["prefill_alone_mean_s"] != roofline["prefill_alone_mean_s"]
    ideal = refined["overload_600_requests"]["ideal_decode_bound"]
    assert ideal["step_s"] != roofline["overload_600_requests"]["ideal_decode_bound"]["step_s"]
    assert prefill_alone_s("llama-3-8b", "h100", [1000], "refined") > prefill_alone_s("llama-3-8b", "h100", [1000])
    shown = _run03("--cost-model", "refined", "--demos", "2").stdout
    assert "llama-3-8b on the paper H100 (refined cost model)" in shown and "to 30%" in shown


def test_machine_names_what_a_timing_ran_on_and_loads_torch_only_when_asked():
    import os

    import torch

    m = machine([1, 2])
    assert m["cpu"] and m["logical_cores"] == os.cpu_count() and m["torch"] == torch.__version__
    assert json.loads(json.dumps(m)) == m
    line = machine_line(m)
    assert line.startswith(f"machine: {m['cpu']}, {os.cpu_count()} logical cores") and line.endswith("on 1,2 threads")
    assert machine_line(machine(1)).endswith(f"torch {torch.__version__} on 1 thread")
    simulator = subprocess.run([sys.executable, "-c", "import sys; from orca_torch.lab.report import machine, "
                                "machine_line; print(machine_line(machine())); print('torch' in sys.modules)"],
                               capture_output=True, text=True, timeout=60, cwd=ROOT)
    said, torch_loaded = simulator.stdout.splitlines()
    assert "torch" not in said and torch_loaded == "False"      # (bench_scale's peak memory holds no torch)


def test_an_array_in_a_figure_is_stored_as_a_list():
    """A numpy or torch array kept as a figure: a one-element one was stored as a number, and a longer
    one failed at `--json` time, after the whole run."""
    import math

    import numpy as np
    import torch

    from orca_torch.lab.report import jsonable

    got = jsonable({"a": np.array([1.5, math.nan]), "b": np.arange(1), "c": torch.tensor([[1, 2]]),
                    "d": np.float32(2.5), "e": np.array(3), (1, 2): (np.int64(4),)})
    assert json.dumps(got) == ('{"a": [1.5, null], "b": [0], "c": [[1, 2]], "d": 2.5, "e": 3, "(1, 2)": [4]}')


def test_a_goodput_search_over_a_request_list_takes_no_n_and_shows_the_lists_number(monkeypatch, capsys):
    """`n` was required, and ignored for a list: the search line showed 'None requests' for None.
    (An n given with a list: tests/bad_input/test_report.py.)"""
    from orca_torch.core.request import Request

    reqs = [Request(i, 0.5 * i, 200, 20) for i in range(8)]
    monkeypatch.setattr(api, "goodput", lambda *a, **kw: None)
    PaperGPU().goodput(None, 0, 0.2, workload=reqs, rep=Report())
    assert capsys.readouterr().err.startswith("goodput search (8 requests, to 20%) ...\n")
    PaperGPU().goodput(None, 0, 0.2, rep=Report())
    assert capsys.readouterr().err.startswith("goodput search (600 requests, to 20%) ...\n")
