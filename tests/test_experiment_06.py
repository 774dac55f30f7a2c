"""Experiment 06 (distributed execution, lecture §4.4) on its --quick form: the figures are there
and say what the run did; timings are the machine's and only checked to be sane, never asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert e06["pipelining_speedup"] > 0 and r1 > 0 and r2 > 0    # measured, so only sane: the load decides


def test_communication_and_control_plane_figures(e06):
    link = e06["link_cpu"]
    assert link["latency_s"] > 0 and link["bandwidth_B_s"] > 0
    for what in ("TP all-reduces, tp=2", "PP transfer, pp=2"):
        c = e06["communication"][what]
        assert c["priced_cpu_link_s"] > c["priced_h100_s"] > 0      # loopback gloo is slower than NVLink
    for cfg in ("pp=2", "pp=2, n_workers=2", "tp=2"):
        d = e06["control_plane"][cfg]
        assert d["apart"]["throughput_tok_s"] > 0 and d["data"]["throughput_tok_s"] > 0
