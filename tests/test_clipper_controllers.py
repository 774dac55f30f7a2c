"""Batch-size controllers (lecture §2.3, exercise 2c) on fake models of known a + b·B."""
import math

import numpy as np
import pytest

from clipper import AIMD, ControllerTrace, FixedBatch, NoisyLatency, QuantileRegression, LatencyProfile, run_closed_loop

MEDIUM = LatencyProfile(3.0, 0.5)


def test_aimd_exercise_2c_exact_sequence():
    slow = LatencyProfile(3.0, 1.0)               # per-input cost doubled: true max 17
    c = AIMD(20, start=17)
    seen = []
    for _ in range(8):
        b = c.max_batch
        seen.append(b)
        c.observe(b, float(slow.latency_ms(b)))
    # 17 ok -> 18 misses (21 ms) -> floor(18 * 0.9) = 16 -> two batches up -> misses again
    assert seen == [17, 18, 16, 17, 18, 16, 17, 18]


def _run(ctl, noise, n, seed=0, b_factor=lambda i: 1.0):
    nl = NoisyLatency(MEDIUM, noise)
    rng = np.random.default_rng(seed)
    return run_closed_loop(ctl, lambda i, b: nl.sample_ms(b, rng, b_factor(i)), n)


def test_a_batch_at_the_slo_exactly_meets_it_in_the_trace_figures():
    """As AIMD counts it, a latency equal to the SLO is within it. Batches of 2, 4 and 6 inputs taking
    1, 2 and 3 ms, an SLO of 2 ms: 12 inputs over 6 ms busy (2,000 a second), 2 + 4 of them on time
    (1,000 a second), one batch in three late."""
    t = ControllerTrace(np.array([2, 4, 6]), np.array([1.0, 2.0, 3.0]))
    assert t.throughput_qps() == pytest.approx(2000.0)
    assert t.goodput_qps(2.0) == pytest.approx(1000.0)
    assert t.violation_rate(2.0) == pytest.approx(1 / 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aimd_settles_within_10_percent_below_the_true_max(seed):
    tr = _run(AIMD(20), 0.03, 600, seed)
    steady = tr.mean_batch(200, 600)
    assert 0.9 * 34 <= steady <= 34.5
    assert tr.batch_sizes[200:].max() <= 34 + 3      # never far above: every miss backs off


def test_aimd_recovers_after_a_step_change_within_bounded_batches():
    tr = _run(AIMD(20), 0.03, 700, 3, b_factor=lambda i: 2.0 if 300 <= i < 500 else 1.0)
    # down: from ~34 to the new max 17 takes a handful of x0.9 backoffs
    first_ok = tr.batches_until(lambda b, lat: lat <= 20, 300)
    assert first_ok is not None and first_ok <= 10
    assert 0.85 * 17 <= tr.mean_batch(350, 500) <= 18
    # up: +1 per batch from ~17 back to 90% of 34 is about 15 batches
    climb = tr.batches_until(lambda b, lat: b >= 0.9 * 34, 500)
    assert climb is not None and climb <= 25


def test_fixed_batch_misses_every_batch_under_interference_and_aimd_does_not():
    f = lambda i: 2.0 if 300 <= i < 500 else 1.0
    fixed = _run(FixedBatch(29), 0.05, 600, 4, f)
    aimd = _run(AIMD(20), 0.05, 600, 4, f)
    assert fixed.violation_rate(20, 300, 500) == 1.0
    assert fixed.violation_rate(20, 0, 300) < 0.02
    assert aimd.violation_rate(20, 300, 500) < 0.6


def test_margin_trades_a_little_throughput_for_far_fewer_misses():
    plain = _run(AIMD(20), 0.05, 1000, 5)
    margin = _run(AIMD(20, margin=0.1), 0.05, 1000, 5)
    assert plain.violation_rate(20) > 0.1             # probing to the edge misses (pitfall 7)
    assert margin.violation_rate(20) < 0.3 * plain.violation_rate(20)
    assert margin.throughput_qps() > 0.95 * plain.throughput_qps()


def test_aimd_grows_only_on_full_batches_unless_told_otherwise():
    c = AIMD(20, start=10)
    c.observe(3, 5.0)
    assert c.max_batch == 10
    c.observe(10, 5.0)
    assert c.max_batch == 11
    loose = AIMD(20, start=10, grow_only_when_full=False)
    loose.observe(3, 5.0)
    assert loose.max_batch == 11
    c.observe(5, 25.0)                                # a half batch that missed backs off from itself
    assert c.max_batch == 4
    capped = AIMD(20, start=5, cap=6)
    for _ in range(5):
        capped.observe(capped.max_batch, 1.0)
    assert capped.max_batch == 6


@pytest.mark.parametrize("noise,seed", [(0.02, 0), (0.05, 1)])
def test_quantile_regression_finds_the_largest_batch_whose_p99_meets_the_slo(noise, seed):
    truth = math.floor((20 / (1 + 2.3263 * noise) - 3) / 0.5)   # P99 of (3 + 0.5B)(1 + noise z) <= 20
    c = QuantileRegression(20, window=300)
    tr = _run(c, noise, 600, seed)
    assert abs(c.estimate - truth) <= 1
    a, b = c.line
    assert a + b * c.estimate <= 20 < a + b * (c.estimate + 1)
    assert tr.violation_rate(20, 300) <= 0.03
    assert tr.batch_sizes[300:].min() < c.estimate    # the probes keep the line identifiable


def test_quantile_regression_backs_off_under_interference():
    c = QuantileRegression(20)
    tr = _run(c, 0.03, 500, 6, lambda i: 2.0 if i >= 300 else 1.0)
    assert c.estimate <= 17
    assert tr.violation_rate(20, 350, 500) < 0.1


def test_quantile_regression_at_a_batch_of_one_probes_two_and_recovers_when_the_model_speeds_up():
    c = QuantileRegression(5.0)                       # 3 + 2B ms: only a batch of 1 meets 5 ms
    tr = run_closed_loop(c, lambda i, b: (3.0 + 2.0 * b) if i < 600 else (1.0 + 0.5 * b), 1000)
    assert set(tr.batch_sizes[300:600].tolist()) == {1, 2}    # 1, and the probe one larger
    assert (tr.batch_sizes[600:] > 2).any() and c.estimate == 8   # (5 - 1) / 0.5


def test_quantile_regression_over_a_window_of_one_batch_size_keeps_its_estimate():
    c = QuantileRegression(20.0, window=10, warmup=2, refit_every=1)
    c.observe(1, 3.5)
    c.observe(4, 5.0)
    before = c.estimate
    for _ in range(20):                               # a light load: every batch a single request
        c.observe(1, 3.5)
    assert c.estimate == before and "batches of 1 only" in c.note


def test_bad_inputs():
    """Each refusal names the setting, what it may be and the value given."""
    for make, says in ((lambda: AIMD(20, backoff=1.0), r"backoff \(Clipper uses 0.9\) must be a finite number in "
                                                       r"\(0, 1\), got 1.0"),
                       (lambda: AIMD(20, margin=1.0), r"margin .* must be a finite number in \[0, 1\), got 1.0"),
                       (lambda: AIMD(0), r"slo_ms must be a finite number of milliseconds > 0, got 0"),
                       (lambda: AIMD(20, increase=0), r"increase must be an integer >= 1, got 0"),
                       (lambda: FixedBatch(0), r"size .* must be an integer in \[1, 9223372036854775807\], got 0"),
                       (lambda: QuantileRegression(20, window=10, warmup=20),
                        r"warmup \(20\) cannot exceed window \(10\)"),
                       (lambda: QuantileRegression(20, quantile=1.5),
                        r"quantile must be a finite number in \(0, 1\), got 1.5")):
        with pytest.raises(ValueError, match=says):
            make()
    c = AIMD(20)
    for latency in (-1.0, math.nan):
        with pytest.raises(ValueError, match=r"latency_ms must be a finite number of milliseconds in \[0, 1e\+12\], "
                                             f"got {latency}"):
            c.observe(1, latency)
    for size in (0, 2**63):
        with pytest.raises(ValueError, match=rf"batch_size must be an integer in \[1, {2**63 - 1}\], got {size}"):
            c.observe(size, 1.0)
    assert c.max_batch == 1                           # nothing half-changed
    with pytest.raises(ValueError, match=r"n_batches must be an integer >= 1, got 0"):
        run_closed_loop(c, lambda i, b: 1.0, 0)


def test_aimd_shared_by_replicas_cuts_once_for_the_batches_in_flight_together():
    # four replicas each took a batch of 32 (the maximum then); all four miss. Each miss says "32 is
    # too big", which one cut to floor(0.9 * 32) = 28 already answers: 28 -> 25 -> 22 -> 19 (x 0.9**4)
    # would make the backoff depend on the number of replicas.
    c = AIMD(20, start=32)
    for _ in range(4):
        c.observe(32, 25.0)
    assert c.max_batch == 28
    c.observe(30, 25.0)           # a miss at 30, above today's 28, still says 27 is the most to try
    assert c.max_batch == 27
    c.observe(27, 25.0)           # a miss at the current maximum cuts as before
    assert c.max_batch == 24


def test_aimd_shared_by_replicas_keeps_the_single_replica_batch():
    # In a queue of 8 replicas under overload the shared maximum stays where one replica's would be
    # (mean 31.6, 1st percentile 27 for one replica, 31.5 and 27 for eight): cutting once per miss,
    # batches in flight included, dragged it to a mean of 29.8 and a 1st percentile of 22.
    from clipper import simulate_queue
    rate = 1.2 * 8 * MEDIUM.throughput_qps(29)
    seen = []

    class Logged(AIMD):
        def _observe(self, b, lat):
            seen.append(self.max_batch)
            super()._observe(b, lat)

    simulate_queue(NoisyLatency(MEDIUM, 0.05), rate, 40_000, max_batch=Logged(20), n_workers=8, seed=1)
    steady = np.array(seen[len(seen) // 4:])
    assert steady.mean() > 30.5 and np.percentile(steady, 1) >= 25


def test_aimd_a_late_miss_above_the_maximum_never_raises_it():
    # a batch of 32 sent before two cuts (32 -> 28 -> 25) reports its miss late: floor(0.9 * 32) = 28
    # would raise today's 25; a miss only ever lowers the maximum
    c = AIMD(20, start=32)
    c.observe(32, 25.0)
    c.observe(28, 25.0)
    assert c.max_batch == 25
    c.observe(32, 25.0)
    assert c.max_batch == 25


def test_aimd_never_cuts_below_min_batch():
    c = AIMD(20, start=5, min_batch=4)
    c.observe(5, 30.0)                                # floor(5 * 0.9) = 4
    assert c.max_batch == 4
    c.observe(4, 30.0)                                # floor(4 * 0.9) = 3, held at min_batch
    assert c.max_batch == 4


def test_quantile_regression_explores_within_its_cap():
    c = QuantileRegression(20.0, cap=4)
    proposals = []
    for _ in range(10):                               # still warming up: AIMD explores, fast batches
        proposals.append(c.max_batch)
        c.observe(proposals[-1], 1.0)
    assert proposals == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4]


def test_quantile_regression_on_a_flat_profile_at_the_slo_answers_the_cap():
    # a batch that takes exactly the SLO meets it (as AIMD counts it): every batch size does, so the cap
    c = QuantileRegression(20.0, warmup=2, window=10, refit_every=1, cap=8)
    c.observe(1, 20.0)
    c.observe(2, 20.0)
    assert c.estimate == 8 and "cap=8" in c.note


def test_quantile_regression_on_a_flat_profile_without_a_cap_grows_by_one_per_refit():
    c = QuantileRegression(20.0, warmup=2, window=10, refit_every=1)
    c.observe(1, 5.0)
    c.observe(2, 5.0)
    seen = [c.estimate]
    for _ in range(3):
        c.observe(c.estimate, 5.0)
        seen.append(c.estimate)
    assert np.diff(seen).tolist() == [1, 1, 1] and "growing by one" in c.note


def _proposals(c: QuantileRegression, n: int) -> list[int]:
    """`c`'s first `n` proposals, each batch answered exactly on MEDIUM's line, 3 + 0.5 B ms."""
    proposals = []
    for _ in range(n):
        proposals.append(c.max_batch)
        c.observe(proposals[-1], float(MEDIUM.latency_ms(proposals[-1])))
    return proposals


def test_quantile_regression_probes_every_probe_every_th_proposal():
    # on the exact line 3 + 0.5 B at a 20.2 ms SLO the estimate is floor(17.2 / 0.5) = 34 from the
    # second batch on; the 10th, 20th and 30th proposals are the probes, at half the estimate
    proposals = _proposals(QuantileRegression(20.2, warmup=2, window=50, refit_every=1), 30)
    assert [k + 1 for k, b in enumerate(proposals[2:], 2) if b != 34] == [10, 20, 30]
    assert proposals[9] == proposals[19] == 17


def test_quantile_regression_on_the_exercise_s_exact_profile_answers_its_batch():
    # lecture exercise 2(a): 3 + 0.5 B ms at a 20 ms SLO gives floor(17 / 0.5) = 34; the quantile line's
    # search ends a few 1e-8 off the slope (33.99999986), which must not floor it to 33
    c = QuantileRegression(20.0, warmup=2, window=50, refit_every=1)
    proposals = _proposals(c, 12)
    a, b = c.line
    assert (a, b) != (3.0, 0.5) and math.floor((20.0 - a) / b) == 33   # (what flooring the fit alone gives)
    assert proposals[2:9] == [34] * 7 and proposals[9] == 17 and proposals[10:] == [34] * 2


def test_quantile_regression_never_proposes_past_its_cap():
    # on the exact line 3 + 0.5 B at a 20 ms SLO the fit alone says 34; a cap of 10 bounds the
    # estimate and every proposal, probes included
    c = QuantileRegression(20.0, warmup=2, window=50, refit_every=1, cap=10)
    proposals = _proposals(c, 30)
    assert c.estimate == 10 and max(proposals) == 10


def test_quantile_regression_at_a_cap_of_one_probes_no_larger_batch():
    # the line 15 B ms at a 20 ms SLO: an estimate of 1, whose probe is a batch of 2 unless the cap is 1
    c = QuantileRegression(20.0, warmup=2, window=10, refit_every=1, probe_every=2, cap=1)
    c.observe(1, 15.0)
    c.observe(2, 30.0)
    proposals = []
    for _ in range(6):
        proposals.append(c.max_batch)
        c.observe(1, 15.0)
    assert c.estimate == 1 and proposals == [1] * 6


def test_a_controller_written_to_the_documented_contract_steers_the_closed_loop_and_the_queue():
    # BatchController's docstring: a max_batch property and _observe; observe checks and calls it
    from clipper import BatchController, simulate_queue

    class HalveOnMiss(BatchController):
        def __init__(self, slo_ms):
            self.slo_ms, self.size, self.seen = slo_ms, 64, []

        @property
        def max_batch(self):
            return self.size

        def _observe(self, batch_size, latency_ms):
            self.seen.append(batch_size)
            if latency_ms > self.slo_ms:
                self.size = max(1, self.size // 2)

    ctl = HalveOnMiss(20.0)
    trace = run_closed_loop(ctl, lambda i, b: MEDIUM.latency_ms(b), 4)
    assert trace.batch_sizes.tolist() == [64, 32, 32, 32] and ctl.seen == [64, 32, 32, 32]    # (35 ms, then 19)
    assert ctl.observe(32, 21.0) == 16
    with pytest.raises(ValueError, match=r"latency_ms must be a finite number"):
        ctl.observe(16, float("nan"))
    queued = HalveOnMiss(20.0)
    r = simulate_queue(MEDIUM, 1000.0, 200, max_batch=queued, seed=0)
    assert r.batch_sizes.max() <= 64 and queued.seen                 # (batches still running at the end unheard)
    assert queued.seen == r.batch_sizes.tolist()[:len(queued.seen)]
