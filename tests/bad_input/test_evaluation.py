"""Orca's evaluation (`orca_torch.lab.orca_evaluation`) names an unknown model or system, a slowdown, rate or
target that is no positive number, and a curve with no points, instead of failing inside."""
from __future__ import annotations

import math

import numpy as np
import pytest

from orca_torch.lab import orca_evaluation as ev
from orca_torch.sim.executors import CostModelExecutor

UNKNOWN_MODEL = r"unknown model 'foo'; choose one of 'gpt3-13b', 'gpt3-101b', 'gpt3-175b', 'gpt3-341b'"
CURVE = {"system": "Orca", "max_bs": 8, "microbatch": None,
         "points": [{"rate_req_s": 1.0, "throughput_req_s": 1.0, "norm_latency_median_ms": 50.0},
                    {"rate_req_s": 4.0, "throughput_req_s": 3.0, "norm_latency_median_ms": 250.0}]}


@pytest.mark.parametrize("call", [
    lambda: ev.orca_batch_sizes("foo"), lambda: ev.ft_configs("foo"), lambda: ev.make_setup("orca", "foo", 8),
    lambda: ev.microbenchmark(["gpt3-13b", "foo"], [1]), lambda: ev.control_sync_note("foo"),
    lambda: ev.synthetic_curves("foo", True, 0), lambda: ev.model_curves("foo", None, ev.sweep_for(True), [0]),
])
def test_an_unknown_model_is_named(call):
    with pytest.raises(ValueError, match=UNKNOWN_MODEL):
        call()


def test_an_unknown_system_is_named_not_built_as_orca():
    for call in (lambda: ev.make_setup("bogus", "gpt3-13b", 8), lambda: ev.label("bogus", 8),
                 lambda: ev.sweep_for(True).n_at(1.0, "bogus")):
        with pytest.raises(ValueError, match="unknown system 'bogus'; choose one of 'orca', 'ft'"):
            call()
    with pytest.raises(ValueError, match="mbs is FasterTransformer's microbatch size; Orca takes none, got mbs=4"):
        ev.make_setup("orca", "gpt3-13b", 8, 4)
    with pytest.raises(ValueError, match="unknown system 'orca'; choose one of 'Orca', 'FasterTransformer'"):
        ev.best_at({"a": CURVE}, "orca", 100.0)
    with pytest.raises(ValueError, match="curves hold no FasterTransformer curve to pick from"):
        ev.best_at({"a": CURVE}, "FasterTransformer", 100.0)


@pytest.mark.parametrize("s, says", [(0, "got 0"), (-1, "got -1"), (math.inf, "got inf"), (True, r"got True \(a bool\)"),
                                     ("2", r"got '2' \(str\)")])
def test_the_slowdown_is_a_positive_number(s, says):
    with pytest.raises(ValueError, match=r"s \(the slowdown\) must be a finite number > 0, " + says):
        ev.scaled_target_ms(s)
    with pytest.raises(ValueError, match=r"s \(the slowdown\) must be a number the target 190 ms can be divided by"):
        ev.scaled_target_ms(1e-310)
    assert ev.scaled_target_ms(np.float64(2.0)) == ev.scaled_target_ms(2) == 95.0


def test_sweep_rates_and_sizes_are_checked():
    sw = ev.Sweep((0.5, 2.0), 20.0, 10, 300)
    for rate in (math.inf, math.nan, 0, -1.0, True):
        with pytest.raises(ValueError, match="rate must be a finite number of requests per second > 0"):
            sw.n_at(rate)
    assert sw.n_at(1e300) == 300 and sw.n_at(np.float32(0.01)) == 10
    for kw, says in ((dict(rates=()), "rates must be a non-empty list"),
                     (dict(rates=(1.0, math.inf)), r"rates\[1\] must be a finite number of requests per second > 0"),
                     (dict(window_s=0), "window_s must be a finite number of seconds > 0"),
                     (dict(n_min=0), "n_min must be an integer >= 1"),
                     (dict(n_max=5), r"n_max \(at least n_min\) must be an integer >= 10, got 5"),
                     (dict(stop_ms=math.nan), "stop_ms must be a finite number of milliseconds > 0"),
                     (dict(n_min_ft=2.5), "n_min_ft must be an integer >= 1")):
        args = dict(rates=(0.5, 2.0), window_s=20.0, n_min=10, n_max=300) | kw
        with pytest.raises(ValueError, match=says):
            ev.Sweep(**args)


def test_a_curve_without_points_or_a_bad_target_is_named():
    for c in ({"points": []}, {}, None, {"points": [{"throughput_req_s": 1.0}]}):
        with pytest.raises(ValueError, match=r"c must be a curve \(curve's result\) with at least one point"):
            ev.throughput_at(c, 100)
    for t in (0, -5.0, math.nan, True):
        with pytest.raises(ValueError, match="target_ms must be a finite number of milliseconds > 0"):
            ev.throughput_at(CURVE, t)
    assert ev.throughput_at(CURVE, np.int64(150))["req_s"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="seeds must be a non-empty list of seeds"):
        ev.run_point("orca", "gpt3-13b", 8, None, None, 1.0, ev.sweep_for(True), [])
    with pytest.raises(ValueError, match=r"targets\[0\] must be a finite number of milliseconds > 0"):
        ev.curve("orca", "gpt3-13b", 8, None, None, ev.sweep_for(True), [0], targets=(0.0,))


def test_flags_and_engine_lengths_are_checked():
    with pytest.raises(ValueError, match="quick must be True or False, got 'x'"):
        ev.sweep_for("x")
    with pytest.raises(ValueError, match="one_microbatch must be True or False, got 1"):
        ev.ft_configs("gpt3-13b", one_microbatch=1)
    with pytest.raises(ValueError, match=r"batches\[0\] must be an integer >= 1, got 0"):
        ev.microbenchmark(["gpt3-13b"], [0])
    with pytest.raises(ValueError, match="models must be a list of model names, got 'gpt3-13b'"):
        ev.microbenchmark("gpt3-13b", [1])
    ex = CostModelExecutor("gpt3-13b", ev.GPU)
    with pytest.raises(ValueError, match="prompt 2000 \\+ generated 100 = 2100 tokens, beyond the model's context of 2048"):
        ev.engine_time_s(ex, 1, 2000, 100)
    with pytest.raises(ValueError, match="generated must be an integer >= 1, got 0"):
        ev.engine_time_s(ex, 1, 32, 0)


def test_lists_may_be_tuples_ranges_or_arrays_as_before():
    assert ev.Sweep(np.array([1.0, 2.0]), 20.0, 10, 300).rates == (1.0, 2.0)
    assert [c["max_bs"] for c in ev.ft_configs("gpt3-13b", range(1, 3))[0]] == [1, 2]
    assert [c["max_bs"] for c in ev.ft_configs("gpt3-13b", np.array([1, 2]))[0]] == [1, 2]
    with pytest.raises(ValueError, match=r"batch_sizes must be a list of integers >= 1, got 'ab' \(str\)"):
        ev.ft_configs("gpt3-13b", "ab")
