"""Latency profiles and fits (lecture §2.2, exercise 2)."""
import math
import warnings
from fractions import Fraction

import numpy as np
import pytest

from clipper.profile import LatencyProfile, fit_line, fit_profile


def test_exercise_2_medium_model():
    p = LatencyProfile(3.0, 0.5)
    assert p.max_batch(20) == 34
    assert p.throughput_qps(34) == pytest.approx(1700.0)
    assert p.latency_ms(34) == pytest.approx(20.0)
    slow = p.scaled(b_factor=2.0)           # (b) interference doubles the per-input cost
    assert slow.latency_ms(34) == pytest.approx(37.0)
    assert slow.max_batch(20) == 17
    heavy = p.scaled(a_factor=2.0)          # a doubled fixed cost: floor((20 - 6) / 0.5)
    assert heavy.latency_ms(34) == pytest.approx(23.0) and heavy.max_batch(20) == 28


def test_max_batch_floor_is_exact_at_the_boundary_and_zero_when_nothing_fits():
    """The floor in B_max = floor((SLO - a) / b) on lines whose quotient is a whole number.

    The 241x is not a finding: the toy profiles (0.72 + 0.02 B and 2.0 + 4.5 B ms, clipper/toy_models.py)
    were chosen so that 964 / 4 reproduces the Clipper paper's ratio at a 20 ms SLO. What this checks is
    the arithmetic of the floor on those chosen lines, not that batching yields 241x.
    """
    assert LatencyProfile(0.72, 0.02).max_batch(20) == 964
    assert LatencyProfile(2.0, 4.5).max_batch(20) == 4
    assert LatencyProfile(0.72, 0.02).max_batch(20) / LatencyProfile(2.0, 4.5).max_batch(20) == 241
    assert LatencyProfile(19.0, 2.0).max_batch(20) == 0


@pytest.mark.parametrize("a, b, slo", [("41.47", "0.8889", "210551273.3275"),   # a large quotient
                                       ("31.89", "0.000003", "32.428338")])      # SLO - a cancels
def test_max_batch_floor_is_exact_where_the_division_rounds_just_below_a_whole_quotient(a, b, slo):
    """Decimal lines whose exact quotient is whole but whose float division lands a few units in the last
    place below it (236867174.99999997): the floor must not lose the last input."""
    exact = math.floor((Fraction(slo) - Fraction(a)) / Fraction(b))
    assert (Fraction(slo) - Fraction(a)) / Fraction(b) == exact
    assert LatencyProfile(float(a), float(b)).max_batch(float(slo)) == exact


def test_mean_fit_recovers_the_line():
    rng = np.random.default_rng(0)
    x = np.repeat(np.arange(1, 41), 20)
    y = 3 + 0.5 * x + rng.normal(0, 0.3, x.size)
    p = fit_profile(x, y)
    assert p.a_ms == pytest.approx(3.0, abs=0.1)
    assert p.b_ms == pytest.approx(0.5, abs=0.01)


def test_quantile_fit_tracks_the_p99_line_of_multiplicative_noise():
    rng = np.random.default_rng(1)
    x = np.repeat(np.arange(1, 61), 100)
    y = (3 + 0.5 * x) * (1 + 0.05 * rng.standard_normal(x.size))
    p99 = fit_profile(x, y, quantile=0.99)
    k = 1 + 0.05 * 2.3263                   # the P99 of the noise factor
    assert p99.a_ms == pytest.approx(3 * k, rel=0.15)
    assert p99.b_ms == pytest.approx(0.5 * k, rel=0.03)
    assert np.mean(y <= p99.latency_ms(x)) == pytest.approx(0.99, abs=0.003)


def test_quantile_fit_is_the_pinball_minimum():
    # the optimum of a 2-parameter quantile regression passes through two data points: enumerate them
    rng = np.random.default_rng(2)
    x = rng.integers(1, 20, 40).astype(float)
    y = (3 + 0.5 * x) * (1 + 0.1 * rng.standard_normal(40))
    q = 0.9

    def loss(a, b):
        r = y - a - b * x
        return np.sum(np.maximum(q * r, (q - 1) * r))
    best = min(loss(y[i] - (y[j] - y[i]) / (x[j] - x[i]) * x[i], (y[j] - y[i]) / (x[j] - x[i]))
               for i in range(40) for j in range(40) if x[i] != x[j])
    assert loss(*fit_line(x, y, q)) == pytest.approx(best, rel=1e-7)


def test_negative_intercept_is_refitted_through_the_origin():
    x = np.array([1, 2, 3, 4.0])
    p = fit_profile(x, 2.0 * x - 0.5)
    assert p.a_ms == 0.0 and p.b_ms == pytest.approx(np.dot(x, 2 * x - 0.5) / np.dot(x, x))
    assert fit_profile(x, 2.0 * x - 0.5, quantile=0.5).a_ms == 0.0


A_RULE = r"LatencyProfile.a_ms \(fixed cost per batch\) must be a finite number of milliseconds in \[0, 1e\+12\], got "
B_RULE = r"LatencyProfile.b_ms \(cost per input\) must be a finite number of milliseconds in \(0, 1e\+12\], got "


@pytest.mark.parametrize("a, b, says", [(-1.0, 0.5, A_RULE + "-1.0"), (3.0, 0.0, B_RULE + "0.0"),
                                        (3.0, -1.0, B_RULE + "-1.0"), (math.nan, 1.0, A_RULE + "nan"),
                                        (1.0, math.inf, B_RULE + "inf")])
def test_bad_profiles(a, b, says):
    with pytest.raises(ValueError, match=f"^{says}$"):
        LatencyProfile(a, b)


def test_bad_inputs():
    p = LatencyProfile(3, 0.5)
    for slo, got in ((0, "0"), (-5, "-5"), (math.nan, "nan"), ("20", r"'20' \(str\)")):
        with pytest.raises(ValueError, match=r"slo_ms \(the SLO\) must be a finite number of milliseconds > 0, "
                                             f"got {got}$"):
            p.max_batch(slo)
    with pytest.raises(ValueError, match=r"batch_size must be an integer in \[1, 9223372036854775807\], got 0"):
        p.latency_ms(0)
    with pytest.raises(ValueError, match="a line needs measurements at two or more distinct batch sizes"):
        fit_profile([4, 4, 4], [1, 2, 3])
    with pytest.raises(ValueError, match=r"must be 1-D and of equal length, got shapes \(3,\) and \(2,\)"):
        fit_profile([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match=r"quantile must be a finite number in \(0, 1\), got 1.0"):
        fit_profile([1, 2, 3], [1, 2, 3], quantile=1.0)
    with pytest.raises(ValueError, match=r"fitted slope -1 ms/input is not > 0: .*; measure a wider range of sizes"):
        fit_profile([1, 2, 3], [5, 4, 3])


def test_max_batch_floor_holds_where_the_division_rounds_below_the_integer():
    # (20 - 0.1) / 0.1 is 198.99999999999997 in floats; the line's largest batch is 199
    assert LatencyProfile(0.1, 0.1).max_batch(20) == 199
    assert LatencyProfile(0.6, 0.02).max_batch(20) == 970       # 969.9999999999999 in floats


@pytest.mark.parametrize("n,q,seed", [(45, 0.9, 2), (7, 0.5, 0), (5, 0.5, 1)])
def test_quantile_fit_is_the_pinball_minimum_where_the_quantile_falls_between_two_residuals(n, q, seed):
    # q * n = 40.5, 3.5 and 2.5: the best intercept is the 41st (4th, 3rd) smallest residual, not the
    # one below nor the one above
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 20, n).astype(float)
    y = (3 + 0.5 * x) * (1 + 0.1 * rng.standard_normal(n))

    def loss(a, b):
        r = y - a - b * x
        return np.sum(np.maximum(q * r, (q - 1) * r))
    best = min(loss(y[i] - (y[j] - y[i]) / (x[j] - x[i]) * x[i], (y[j] - y[i]) / (x[j] - x[i]))
               for i in range(n) for j in range(n) if x[i] != x[j])
    assert loss(*fit_line(x, y, q)) == pytest.approx(best, rel=1e-7)


@pytest.mark.parametrize("quantile, slope", [(0.5, 11 / 6), (0.9, 15 / 8), (0.2, 7 / 4)])
def test_quantile_refit_through_the_origin_weighs_each_ratio_by_its_batch_size(quantile, slope):
    # through the origin the pinball loss is sum x_i * rho(y_i / x_i - b): the weighted quantile of
    # the ratios 1.5, 1.75, 11/6, 1.875 with weights 1, 2, 3, 4 (cumulative 1, 3, 6, 10): half of 10
    # is first reached at 11/6, 9 at 15/8, 2 at 7/4. (The mean line through the origin is also 11/6
    # here, 55/30: the other quantiles tell the two refits apart.)
    x = np.array([1, 2, 3, 4.0])
    p = fit_profile(x, 2.0 * x - 0.5, quantile=quantile)
    assert p.a_ms == 0.0 and p.b_ms == pytest.approx(slope)


def test_a_profiles_largest_batch_is_worked_out_in_floats_whatever_numpy_type_the_slo_is():
    """max_batch checked the SLO and then computed with the caller's value: a float16 SLO of 65504 ms
    overflowed float16 in (slo - a) / b and escaped as OverflowError (infinity to integer)."""
    prof = LatencyProfile(2.0, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prof.max_batch(np.float16(65504)) == prof.max_batch(65504.0) == 131004
        assert prof.max_batch(np.float32(20.5)) == prof.max_batch(20.5) == 37
