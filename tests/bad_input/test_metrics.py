"""The metrics refuse what they cannot compute by name (`goodput_search`'s bounds and attainments),
and answer a run that served nothing as the figures say: no window, no gaps (NaN), never a numpy error."""
from __future__ import annotations

import math

import numpy as np
import pytest

from orca_torch.lab import api
from orca_torch.lab.metrics import goodput_search, quantiles, steady_throughput


def test_quantiles_of_nothing_are_nan():
    assert math.isnan(quantiles(np.array([]), [0.5])[0]) and quantiles(np.array([1.0, 3.0]), []) == []
    assert quantiles(np.array([1.0, 2.0, 3.0]), (np.float64(0.0), 1)) == [1.0, 3.0]


def test_a_run_that_served_nothing_has_no_steady_window():
    rejected = api.run("orca", 1.0, 5, max_context=10, reject_invalid=True)
    assert rejected.n == 0
    rate, window = steady_throughput(rejected)
    assert math.isnan(rate) and window == 0.0


def test_an_attainment_that_raises_is_raised_as_it_is_with_the_rate_it_raised_at():
    def attainment(rate: float) -> float:
        if rate < 100:
            raise ZeroDivisionError("the caller's own bug")
        return 0.0

    with pytest.raises(ZeroDivisionError, match="the caller's own bug") as e:
        goodput_search(attainment)
    assert any("raised by attainment_at(0.01) in goodput_search" in n for n in e.value.__notes__)
