"""Experiment 06 (distributed execution, lecture §4.4) on its --quick form: the figures are there
and say what the run did; timings are the machine's and only checked to be sane, never asserted."""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from orca_torch.lab.report import Report

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def e06() -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "06_distributed.py"), "--quick", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_every_configuration_gives_the_tokens_of_generation_alone(e06):
    assert e06["tokens_identical"] is True
    assert set(e06["configurations_identical"]) == {"tp=2", "pp=2", "pp=2, n_workers=2", "tp=2 x pp=2, n_workers=2"}
    assert all(e06["configurations_identical"].values())


def test_pipelining_puts_two_batches_in_flight_and_reports_the_speedup(e06):
    p = e06["pipelining"]
    assert p["1"]["max_in_flight"] == 1 and p["2"]["max_in_flight"] == 2
    assert p["1"]["overlap_fraction"] == 0.0            # one batch at a time never overlaps itself
    for nw in ("1", "2"):
        assert all(0.0 < f <= 1.0 for f in p[nw]["busy_fraction"])
    r1, r2 = p["1"]["throughput_tok_s"], p["2"]["throughput_tok_s"]
    assert r1 > 0 and r2 > 0                  # measured, so only sane: the load decides
    assert e06["pipelining_speedup"] == pytest.approx(r2 / r1, rel=1e-12)    # the shown pair's own ratio


def test_communication_and_control_plane_figures(e06):
    link = e06["link_cpu"]
    assert link["latency_s"] > 0 and link["bandwidth_B_s"] > 0
    for what in ("TP all-reduces, tp=2", "PP transfer, pp=2"):
        c = e06["communication"][what]
        assert c["priced_cpu_link_s"] > c["priced_h100_s"] > 0      # loopback gloo is slower than NVLink
    for cfg in ("pp=2", "pp=2, n_workers=2", "tp=2"):
        d = e06["control_plane"][cfg]
        assert d["apart"]["throughput_tok_s"] > 0 and d["data"]["throughput_tok_s"] > 0


def _script():
    """The script as a module, to run one part of it on canned runs."""
    spec = importlib.util.spec_from_file_location("imported_06_distributed", ROOT / "experiments" / "06_distributed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pipelining_note_says_which_run_each_cpu_share_is_of(monkeypatch, capsys):
    """The table gives each stage's CPU share while busy, stage 0 / stage 1; the note's mean of the two
    stages is per run, so it names the run rather than reading as another stage 0 / stage 1 pair."""
    e06_script = _script()
    runs = {1: dict(n_steps=16, throughput_tok_s=900.0, busy_fraction=[0.15, 0.17], overlap_fraction=0.0,
                    max_in_flight=1, round_trip_s=0.004, cpu_share_busy=[0.89, 0.97], worker_cores_used=0.3,
                    busy_s_per_batch=[0.0006, 0.0006], records=[]),
            2: dict(n_steps=16, throughput_tok_s=1200.0, busy_fraction=[0.2, 0.24], overlap_fraction=0.05,
                    max_in_flight=2, round_trip_s=0.005, cpu_share_busy=[0.82, 0.83], worker_cores_used=0.36,
                    busy_s_per_batch=[0.0006, 0.0007], records=[])}
    monkeypatch.setattr(e06_script, "serve", lambda ex, reqs, max_bs, nw: runs[nw])
    monkeypatch.setattr(e06_script.stages, "span", lambda recs: (0.0, 1.0))
    monkeypatch.setattr(e06_script.stages, "chart", lambda recs, n, window: [])
    e06_script.part_b(argparse.Namespace(quick=True), Report(), None, [], 4, 1, None)
    out = capsys.readouterr().out
    assert "89% / 97%" in out and "82% / 83%" in out                                  # the table: stage by stage
    assert "while busy a stage got 93% of a core with n_workers=1 and 82% with n_workers=2" in out


def test_the_control_plane_table_keeps_the_sign_of_the_round_trip_added(monkeypatch, capsys):
    """Data's round trip less apart's is signed (either may be the longer): a '+' the table keeps."""
    e06_script = _script()
    exs = {"pp2": SimpleNamespace(control="apart", layout=SimpleNamespace(pp=2)),
           "tp2": SimpleNamespace(control="apart", layout=SimpleNamespace(pp=1))}
    trip = {"apart": 0.010, "data": 0.0105}
    monkeypatch.setattr(e06_script, "serve", lambda ex, reqs, max_bs, nw: dict(
        throughput_tok_s=100.0 if ex.control == "apart" else 90.0, round_trip_s=trip[ex.control], handoff_s=0.001))
    e06_script.part_d(argparse.Namespace(quick=True), Report(), None, [], 4, 1, exs)
    out = capsys.readouterr().out
    assert out.count("+0.50 ms") == 3 and "+11%" in out
