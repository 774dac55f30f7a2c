"""The batching queue under Poisson arrivals, with and without delayed batching (lecture §2.4)."""
import numpy as np
import pytest

from clipper import AIMD, BatchController, LatencyProfile, NoisyLatency, poisson_arrivals, simulate_queue

HIGH = LatencyProfile(0.6, 0.2)    # 75% of an unbatched call is fixed cost
LOW = LatencyProfile(0.05, 0.75)


def test_poisson_arrivals_have_the_requested_rate_and_are_seeded():
    a = poisson_arrivals(2000.0, 20_000, np.random.default_rng(0))
    assert np.all(np.diff(a) > 0)
    assert 1000 * a.size / a[-1] == pytest.approx(2000, rel=0.03)
    assert np.array_equal(a, poisson_arrivals(2000.0, 20_000, np.random.default_rng(0)))


def test_delay_raises_the_mean_batch_below_capacity_and_saves_busy_time():
    rate = 0.8 * HIGH.throughput_qps(1)
    r0 = simulate_queue(NoisyLatency(HIGH, 0.05), rate, 20_000, max_batch=64, delay_ms=0.0, seed=1)
    r2 = simulate_queue(NoisyLatency(HIGH, 0.05), rate, 20_000, max_batch=64, delay_ms=2.0, seed=1)
    assert r2.mean_batch > 1.8 * r0.mean_batch
    assert r2.busy_fraction < 0.75 * r0.busy_fraction
    # busy time is a*batches + b*requests: it must agree with the batches the run formed
    n = r0.latencies_ms.size
    assert r0.busy_ms.sum() == pytest.approx(HIGH.a_ms * r0.batch_sizes.size + HIGH.b_ms * n, rel=0.02)
    assert r2.mean_latency_ms > r0.mean_latency_ms       # the price is paid in latency


def test_delay_barely_helps_a_low_fixed_cost_model_and_costs_it_latency():
    rate = 0.8 * LOW.throughput_qps(1)
    r0 = simulate_queue(NoisyLatency(LOW, 0.05), rate, 20_000, max_batch=26, delay_ms=0.0, seed=2)
    r2 = simulate_queue(NoisyLatency(LOW, 0.05), rate, 20_000, max_batch=26, delay_ms=2.0, seed=2)
    assert r0.busy_fraction - r2.busy_fraction < 0.05
    assert r2.mean_latency_ms > 1.5 * r0.mean_latency_ms


def test_every_request_is_served_once_and_batches_respect_the_cap():
    r = simulate_queue(HIGH, 3000.0, 5000, max_batch=7, delay_ms=1.0, n_workers=2, seed=3)
    assert r.batch_sizes.sum() == 5000 and r.latencies_ms.size == 5000
    assert r.batch_sizes.max() <= 7 and r.batch_sizes.min() >= 1
    assert np.all(r.latencies_ms >= HIGH.latency_ms(1) - 1e-9)
    assert 0 < r.busy_fraction <= 1


def test_more_workers_cut_latency_under_heavy_load():
    rate = 1.5 * HIGH.throughput_qps(1)
    one = simulate_queue(HIGH, rate, 10_000, max_batch=1, seed=4)
    two = simulate_queue(HIGH, rate, 10_000, max_batch=1, n_workers=2, seed=4)
    assert one.mean_latency_ms > 10 * two.mean_latency_ms   # one unbatched worker is overloaded


def test_workers_beyond_the_requests_never_run_and_cost_no_time():
    """Each batch takes a request, so a run of n requests uses at most n workers; the rest stay idle
    (and are not listed one by one: a million of them must not take seconds)."""
    few = simulate_queue(NoisyLatency(HIGH, 0.05), 5000.0, 20, max_batch=4, n_workers=20, seed=2)
    many = simulate_queue(NoisyLatency(HIGH, 0.05), 5000.0, 20, max_batch=4, n_workers=2_000_000, seed=2)
    assert np.array_equal(few.latencies_ms, many.latencies_ms) and np.array_equal(few.batch_sizes, many.batch_sizes)
    assert many.busy_ms.size == 2_000_000 and many.busy_ms[:20].sum() == few.busy_ms.sum()
    assert many.busy_fraction == pytest.approx(few.busy_fraction / 100_000)
    assert many.horizon_ms == few.horizon_ms


def test_same_seed_same_result_and_a_controller_can_steer_the_queue():
    kw = dict(max_batch=32, delay_ms=0.5, seed=5)
    a = simulate_queue(NoisyLatency(HIGH, 0.05), 2500.0, 5000, **kw)
    b = simulate_queue(NoisyLatency(HIGH, 0.05), 2500.0, 5000, **kw)
    assert np.array_equal(a.latencies_ms, b.latencies_ms)
    ctl = AIMD(2.0, cap=64)
    r = simulate_queue(NoisyLatency(HIGH, 0.05), 4000.0, 20_000, max_batch=ctl, seed=5)
    assert r.batch_sizes.max() <= HIGH.max_batch(2.0) + 3
    assert ctl.max_batch >= 2


def test_bad_inputs():
    for kw, msg in [(dict(rate_qps=0.0), "rate_qps must be a finite number of requests per second > 0, got 0.0"),
                    (dict(delay_ms=-1.0), "delay_ms must be a finite number of milliseconds >= 0, got -1.0"),
                    (dict(n_workers=0), "n_workers must be an integer >= 1, got 0"),
                    (dict(max_batch=0), "max_batch must be an integer >= 1, got 0"),
                    (dict(n_requests=0), "n_requests must be an integer >= 1, got 0")]:
        args = dict(latency=HIGH, rate_qps=100.0, n_requests=10, max_batch=4) | kw
        with pytest.raises(ValueError, match=msg):
            simulate_queue(args.pop("latency"), args.pop("rate_qps"), args.pop("n_requests"), **args)
    with pytest.raises(ValueError, match=r"noise \(a relative standard deviation\) must be a finite number in "
                                         r"\[0, 0.5\), got -0.1"):
        NoisyLatency(HIGH, -0.1)


EXACT = LatencyProfile(1.0, 0.25)   # no jitter: every batch of B takes exactly 1 + 0.25 B ms


def _arrivals(rate, n, seed):
    """The arrivals `simulate_queue` draws: the first of the two streams spawned from its seed."""
    return poisson_arrivals(rate, n, np.random.default_rng(seed).spawn(2)[0])


def test_delayed_batch_leaves_when_it_is_full_and_each_request_counts_from_its_own_arrival():
    # 10 qps, batches of up to 4, a delay no request reaches: each batch waits for its 4th request
    # and leaves at once (the worker finished the previous batch long before)
    arr = _arrivals(10.0, 40, 0)
    assert np.diff(arr[3::4]).min() > 2.0             # (the worker is idle at every dispatch)
    r = simulate_queue(EXACT, 10.0, 40, max_batch=4, delay_ms=1e7, seed=0)
    assert r.batch_sizes.tolist() == [4] * 10
    done = np.repeat(arr[3::4], 4) + EXACT.latency_ms(4)
    assert np.allclose(r.latencies_ms, done - arr, rtol=0, atol=1e-9)
    assert r.horizon_ms == pytest.approx(arr[-1] + 2.0)


def test_delayed_batch_that_cannot_fill_leaves_when_its_oldest_has_waited_the_delay():
    arr = _arrivals(1.0, 20, 1)
    assert np.diff(arr).min() > 10.0                  # (no second request within 5 ms + a batch)
    r = simulate_queue(EXACT, 1.0, 20, max_batch=64, delay_ms=5.0, seed=1)
    assert r.batch_sizes.tolist() == [1] * 20
    assert np.allclose(r.latencies_ms, 5.0 + EXACT.latency_ms(1), rtol=0, atol=1e-9)


class _Counting(BatchController):
    """Batches of 5; notes at each dispatch how many finished batches it has heard of (the read of
    max_batch with which `observe` answers is no dispatch)."""

    def __init__(self):
        self.heard, self.at_dispatch, self._answering = 0, [], False

    @property
    def max_batch(self):
        if not self._answering:
            self.at_dispatch.append(self.heard)
        self._answering = False
        return 5

    def _observe(self, batch_size, latency_ms):
        self.heard += 1
        self._answering = True


def test_the_controller_hears_of_every_batch_finished_by_each_dispatch_and_of_no_other():
    # Light load, two workers: every batch ends long before the next arrival, so the k-th dispatch
    # (of either worker) knows of all k - 1 batches before it.
    assert np.diff(_arrivals(1.0, 10, 2)).min() > 2.0
    light = _Counting()
    simulate_queue(EXACT, 1.0, 10, max_batch=light, n_workers=2, seed=2)
    assert light.at_dispatch == list(range(10))
    # Overload, two workers, batches of 5 filled within microseconds: worker 0 sends batch 1 and
    # worker 1 batch 2 before either finishes (0, 0); worker 0 sends batch 3 the moment batch 1
    # finishes (1: batch 2, sent later, is still running), worker 1 batch 4 when batch 2 finishes (2).
    heavy = _Counting()
    simulate_queue(EXACT, 1e6, 20, max_batch=heavy, delay_ms=1e3, n_workers=2, seed=3)
    assert heavy.at_dispatch == [0, 0, 1, 2]


def test_the_horizon_is_the_last_completion_of_any_worker():
    # light load, two workers taking turns: the run ends when the last request's batch of one does,
    # though the other worker finished earlier
    arr = _arrivals(1.0, 10, 2)
    assert np.diff(arr).min() > 2.0
    r = simulate_queue(EXACT, 1.0, 10, max_batch=5, n_workers=2, seed=2)
    assert (r.busy_ms > 0).all() and r.horizon_ms == pytest.approx(arr[-1] + EXACT.latency_ms(1))


def test_noisy_latency_is_floored_at_one_percent_of_the_mean_where_a_draw_would_make_it_negative():
    # (3 + 0.5 * 4) * max(0.01, 1 + 0.4 z): z = -2 gives 0.2 of the mean, z = -2.5 and -10 the floor
    noisy = NoisyLatency(LatencyProfile(3.0, 0.5), 0.4)
    assert noisy.with_normal(np.array([4, 4, 4]), np.array([-2.0, -2.5, -10.0])) == pytest.approx([1.0, 0.05, 0.05])
