"""The figures: each drawing function writes a real PNG; scripts run without matplotlib unless --plot is asked."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from figure_files import assert_pngs

from orca_torch.lab import plots
from orca_torch.lab.api import run

ROOT = Path(__file__).resolve().parents[1]
NO_MATPLOTLIB = "import sys, runpy; sys.modules['matplotlib'] = None; sys.argv = {argv!r}; " \
                "runpy.run_path({script!r}, run_name='__main__')"


@pytest.fixture(scope="module")
def small_run():
    return run("chat", 8.0, 30, "orca-oracle", max_bs=16, seed=0)


def test_every_drawing_writes_a_png(tmp_path, small_run):
    rng = np.random.default_rng(0)
    plots.aimd_trace(tmp_path / "a.png", rng.integers(1, 40, 200), rng.uniform(5, 25, 200), 20.0, (50, 100), "t")
    plots.timelines(tmp_path / "b.png", {"continuous": ["PDD  ", " ·PD "], "static": ["PDD--", "···PD"]}, "t")
    rows = [{"system": s, "rate_req_s": r, "slo_attainment": a, "ttft_median_s": 0.01 * r, "tpot_median_s": 0.02}
            for s in ("x", "y") for r, a in ((1, 1.0), (8, 0.95), (32, 0.2))]
    plots.rate_sweep(tmp_path / "c.png", rows, {"x": "X", "y": "Y"}, (1.0, 0.05), "t", goodput={"x": 9.0},
                     marks=[(0, 16, 100, "lecture"), (1, 1, 0.012, "lecture", -12)])
    plots.throughput_over_time(tmp_path / "d.png", {"orca": small_run}, "t")
    plots.kv_over_time(tmp_path / "e.png", {"oracle": small_run, "max": small_run}, small_run.n_slots, "t")
    plots.tradeoff(tmp_path / "f.png", {"48 req/s": ([10, 20, 30], [1000, 2000, 2500], [8, 64, 256])},
                   "TPOT (ms)", "tok/s", "t")
    plots.distributions(tmp_path / "g.png", {"a": rng.exponential(1, 300), "b": rng.exponential(2, 300)}, "s", "t")
    plots.predicted_vs_measured(tmp_path / "h.png", [0.01, 0.02, 0.05], [0.011, 0.018, 0.06], "t",
                                groups=["decode", "decode", "prefill"])
    assert_pngs(tmp_path, list("abcdefgh"))


def _without_matplotlib(script: str, *argv: str) -> subprocess.CompletedProcess:
    code = NO_MATPLOTLIB.format(argv=[script, *argv], script=str(ROOT / "experiments" / script))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_scripts_run_without_matplotlib_and_say_how_to_get_it(tmp_path):
    ok = _without_matplotlib("01_clipper_batching.py", "--quick", "--json", "--demos", "1,4")
    assert ok.returncode == 0, ok.stderr
    assert '"demo4"' in ok.stdout
    asked = _without_matplotlib("01_clipper_batching.py", "--quick", "--demos", "1", "--plot", str(tmp_path))
    assert asked.returncode == 2 and asked.stdout == ""
    assert "--plot: needs matplotlib, which is not installed: pip install 'orca-torch[plot]'" in asked.stderr
    assert not list(tmp_path.iterdir())


def test_drawing_leaves_the_callers_pyplot_alone(tmp_path):
    """A notebook's backend and its open figures are the caller's: drawing a figure changes neither."""
    code = ("import matplotlib; matplotlib.use('svg'); import matplotlib.pyplot as plt; fig = plt.figure(); "
            "from orca_torch.lab import plots; plots.distributions({p!r}, {{'a': [1.0, 2.0, 3.0]}}, 's', 't'); "
            "print(matplotlib.get_backend(), plt.get_fignums())").format(p=str(tmp_path / "d.png"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["svg", "[1]"]
    assert_pngs(tmp_path, ["d"])
