"""The metrics' public helpers refuse what they cannot compute by name, and answer a run that served
nothing as the figures say: no window, no gaps (NaN), never a numpy error."""
from __future__ import annotations

import math

import numpy as np
import pytest

from orca_torch.lab import api
from orca_torch.lab.metrics import counted_quantiles, goodput_search, quantiles, steady_throughput


@pytest.mark.parametrize("qs, says", [((-0.1,), r"qs\[0\] \(a quantile\) must be a finite number in \[0, 1\], got -0.1"),
                                      ((0.5, 1.5), r"qs\[1\] .* in \[0, 1\], got 1.5"),
                                      ((math.nan,), r"qs\[0\] .* got nan"), ((math.inf,), r"qs\[0\] .* got inf"),
                                      ((True,), r"got True \(a bool\)"), (0.5, r"qs must be a list of quantiles"),
                                      ("0.5", r"qs must be a list of quantiles")])
def test_a_quantile_outside_0_1_is_refused_not_extrapolated(qs, says):
    x = np.array([1.0, 2.0, 3.0])
    for f in (lambda: quantiles(x, qs), lambda: counted_quantiles(x, np.ones(3, dtype=np.uint32), qs)):
        with pytest.raises(ValueError, match=says):
            f()
    assert x.tolist() == [1.0, 2.0, 3.0]


def test_quantiles_of_nothing_are_nan_and_counts_must_match_the_values():
    assert math.isnan(quantiles(np.array([]), [0.5])[0]) and quantiles(np.array([1.0, 3.0]), []) == []
    assert quantiles(np.array([1.0, 2.0, 3.0]), (np.float64(0.0), 1)) == [1.0, 3.0]
    with pytest.raises(ValueError, match="values and counts must be as long as each other .* got 2 values and 1"):
        counted_quantiles(np.array([1.0, 2.0]), np.array([1]), [0.5])


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


def test_a_negative_count_is_refused_naming_its_value():
    with pytest.raises(ValueError, match=r"counts must be >= 0 \(how often each value appears\), got -1 for values\[1\]"):
        counted_quantiles(np.array([1.0, 5.0, 2.0]), np.array([3, -1, 2]), [0.5])


def test_counts_that_are_not_whole_numbers_are_refused():
    """A count is how often a value appears: 2.5 times is no count (np.repeat refuses it too), and it
    was summed and ranked as if the run had 3.5 gaps."""
    with pytest.raises(ValueError, match=r"counts must be whole numbers \(how often each value appears\), got an "
                                         r"array of float64$"):
        counted_quantiles(np.array([1.0, 5.0]), np.array([2.5, 1.0]), [0.5])


def test_values_with_nan_are_refused_not_given_a_wrong_quantile():
    """np.partition puts NaN last, so the median of 1, NaN, 3, 4 read 3.5: neither numpy's answer (NaN)
    nor the median of the numbers (3). Refused, saying how to leave the NaN out."""
    x = np.array([1.0, math.nan, 3.0, 4.0])
    with pytest.raises(ValueError, match=r"x holds NaN \(1 of its 4 values\): leave them out first, "
                                         r"x\[~np.isnan\(x\)\]"):
        quantiles(x, [0.5])
    with pytest.raises(ValueError, match=r"values holds NaN \(1 of its 4 values\)"):
        counted_quantiles(x, np.ones(4, dtype=np.int64), [0.5])
    assert quantiles(x[~np.isnan(x)], [0.5]) == [3.0]
