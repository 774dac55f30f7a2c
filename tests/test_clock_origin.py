"""The run's clock counts from the first arrival and keeps every step's duration: arrivals far from 0
(a trace with Unix timestamps) give the same latencies as the same requests shifted to start at 0,
and a run whose clock would swallow a step (`t + d == t`) is refused, on the step-by-step engine,
the fast engine and the pricer's summed decode runs alike."""
from __future__ import annotations

import math

import numpy as np
import pytest

from orca_torch.core.durations import check_clock
from orca_torch.core.engine import Engine
from orca_torch.core.memory import ReservationMemory
from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.lab import api
from orca_torch.sim.decode_runs import SHORT_RUN, step_ends
from orca_torch.sim.executors import CostModelExecutor
from orca_torch.sim.fast_engine import FastEngine
from orca_torch.sim.hw_model import pricer

LOST = "ends when it starts.*closer together"


def _requests(base: float, n: int = 6) -> list[Request]:
    return [Request(i, base + i, 10, 5) for i in range(n)]


def _run(model: str, reqs: list[Request], fast: bool, n_workers: int = 1):
    eng = (FastEngine if fast else Engine)(CostModelExecutor(model, "h100", pp=n_workers),
                                           ReservationMemory(100_000, "max"),
                                           SchedulerConfig(max_bs=8, n_workers=n_workers), max_context=64)
    return eng.run(reqs)


@pytest.mark.parametrize("base", [1.7e9, 1e12, 1e15])
@pytest.mark.parametrize("model", ["tiny", "llama-3-8b"])
def test_unix_epoch_arrivals_give_the_shifted_latencies(base, model):
    """On the paper GPU `tiny` steps last ~1.6e-7 s, less than a float near 1.7e9 holds (2.4e-7)."""
    far, near = api.simulate(_requests(base), model=model), api.simulate(_requests(0.0), model=model)
    assert far == near
    assert far.ttft_mean_s > 0 and far.tpot_mean_s > 0


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("n_workers", [1, 2])
def test_the_engine_counts_from_the_first_arrival(fast, n_workers):
    reqs = _requests(1.7e9)
    far = _run("tiny", reqs, fast, n_workers)
    near = _run("tiny", _requests(0.0), fast, n_workers)
    assert far.clock_origin_s == 1.7e9 and near.clock_origin_s == 0.0
    np.testing.assert_array_equal(far.arrival_s, np.arange(6.0))
    for key in ("step_start", "step_end", "release_s", "first_token_s", "last_token_s"):
        np.testing.assert_array_equal(getattr(far, key), getattr(near, key))
    assert far.first_token_s[0] > 0
    assert [r.arrival_s for r in reqs] == [1.7e9 + i for i in range(6)]       # the caller's requests untouched


def test_a_late_first_arrival_shifts_nothing_else():
    """The first arrival at 5 s: times count from it, latencies unchanged (steps here are exact in
    both clocks, so the step boundaries are the same numbers, 5 apart)."""
    a = _run("llama-3-8b", _requests(5.0), True)
    b = _run("llama-3-8b", _requests(0.0), True)
    assert a.clock_origin_s == 5.0
    np.testing.assert_allclose(a.first_token_s - a.arrival_s, b.first_token_s - b.arrival_s, rtol=1e-12)


def test_a_step_lost_against_the_clock_is_refused():
    """Arrivals a request list keeps, 1e300 s apart (a rate that slow is refused before the run:
    tests/bad_input/test_api.py)."""
    spread_out = [Request(0, 0.0, 10, 5), Request(1, 1e300, 10, 5)]
    for fast in (False, True):
        with pytest.raises(ValueError, match=LOST):
            _run("llama-3-8b", [Request(r.req_id, r.arrival_s, 10, 5) for r in spread_out], fast)
    eng = Engine(CostModelExecutor("tiny", "h100"), ReservationMemory(1000, "max"), max_context=64)
    with pytest.raises(ValueError, match=LOST):
        eng.run(spread_out)
    assert eng.memory.slots_reserved == 0                       # the failed run left nothing behind
    assert eng.run(_requests(0.0, 2)).n == 2                   # and the engine serves the next run


def test_check_clock():
    check_clock(1.0 + 1e-3, 1e-3, 1.0)
    check_clock(1e300, 0.0, 1e300)                              # a step of no time is no loss
    with pytest.raises(ValueError, match=LOST):
        check_clock(1e300, 1e-3, 1e300)
    with pytest.raises(RuntimeError, match="overflows"):
        check_clock(math.inf, 1e308, 1.7e308)


@pytest.mark.parametrize("m", [3, SHORT_RUN + 10])
@pytest.mark.parametrize("start", [1.7e308, 0.0])             # the first step crosses it, or the second
def test_a_run_summed_past_the_largest_float_names_the_step_that_crossed_it(m, start):
    ds = [1e308] * m                                            # every duration finite: the clock overflows
    with pytest.raises(RuntimeError, match=r"the run's clock overflows: a step of 1e\+308 s ends past"):
        step_ends(ds, m, start, None)


@pytest.mark.parametrize("m", [3, SHORT_RUN + 10])
def test_summed_decode_runs_refuse_a_lost_step(m):
    ds = [1e-3] * m
    assert step_ends(ds, m, 1.0, None)[-1] == pytest.approx(1.0 + m * 1e-3)
    assert list(step_ends([0.0] * m, m, 1e300, None)) == [1e300] * m
    with pytest.raises(ValueError, match=LOST):
        step_ends(ds, m, 1e300, None)
    with pytest.raises(ValueError, match=LOST):                 # the first step kept, the second lost
        step_ends([1.0] + [1e-3] * (m - 1), m, 2.0 ** 44, None)  # (the ulp there is 2 ** -8)
    assert step_ends([1.0] * m, m, 2.0 ** 44, None)[-1] == 2.0 ** 44 + m


@pytest.mark.parametrize("m", [4, SHORT_RUN + 10])
def test_the_pricers_decode_run_refuses_a_lost_step(m):
    p = pricer("llama-3-8b", "h100")
    ends = p.decode_run_ends(8, 800, m, 1.0)
    assert list(ends) == list(step_ends(p.decode_run_times(8, 800, m), m, 1.0, None))
    with pytest.raises(ValueError, match=LOST):
        p.decode_run_ends(8, 800, m, 1e300)
    d0 = float(p.decode_run_times(8, 800, 1)[0])
    t = 2.0 ** math.ceil(math.log2(d0 * 2 ** 53)) - 4 * d0     # the first steps fit, the clock then doubles its ulp
    with pytest.raises(ValueError, match=LOST):
        p.decode_run_ends(8, 800, m, t)
