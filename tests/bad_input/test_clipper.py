"""Clipper's profiles, controllers, queue, selection, cache, stragglers and toy models: numbers
checked by the one rule, flat profiles answered with a cap instead of a division by rounding."""
from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from clipper import (AIMD, BatchController, CachedModel, ControllerTrace, Exp3, Exp4, FixedBatch, LatencyProfile,
                     NoisyLatency, Pick, PredictionCache, QuantileRegression, QueueResult, StragglerEnsemble, ToyModel,
                     answer_at_deadline, fit_line, fit_profile, get_toy_profile, poisson_arrivals, run_closed_loop,
                     simulate_queue)
from clipper.torch_models import Interference, TorchContainer, make_model, measure_profile


@pytest.mark.parametrize("sizes", [[1, 2, 3], [1, 2, 4, 8], [1, 16, 256, 1024]])
@pytest.mark.parametrize("quantile", [None, 0.5, 0.99])
def test_a_flat_profile_is_refused_whatever_the_sizes(sizes, quantile):
    with pytest.raises(ValueError, match=r"latency does not grow with the batch"):
        fit_profile(sizes, [5.0] * len(sizes), quantile=quantile)
    tiny = fit_profile(sizes, [5.0 + 0.01 * s for s in sizes], quantile=quantile)   # a real small slope
    assert tiny.b_ms == pytest.approx(0.01, rel=1e-3) and tiny.max_batch(20) == pytest.approx(1500, abs=2)


def test_a_per_input_cost_within_rounding_of_zero_is_no_profile():
    for make in (lambda: LatencyProfile(5.0, 1e-17), lambda: LatencyProfile(5.0, 0.5).scaled(b_factor=1e-12),
                 lambda: LatencyProfile(0.0, 1e-9)):
        with pytest.raises(ValueError, match=r"cost per input\) .* is within rounding of zero .* cap the batch"):
            make()
    assert LatencyProfile(0.0, 1e-6).max_batch(20) == 20_000_000        # small, but a real per-input cost
    assert LatencyProfile(5.0, 0.5).scaled(b_factor=0.01).max_batch(20) == 3000


def test_quantile_regression_on_a_flat_profile_stays_at_its_cap_and_says_why():
    qr = QuantileRegression(20.0, cap=64, warmup=10, window=50)
    trace = run_closed_loop(qr, lambda i, b: 5.0, 300)
    assert int(trace.batch_sizes.max()) == 64 and qr.estimate == 64
    assert int(trace.batch_sizes[15:].min()) >= 32          # the cap (or its probe) right after warm-up
    assert "no per-input cost visible" in qr.note and "answering with cap=64" in qr.note
    slow = QuantileRegression(20.0, cap=64, warmup=10, window=50)
    for i in range(40):                                        # the fixed cost alone misses the SLO
        slow.observe(1 + i % 4, 25.0)
    assert slow.estimate == 1 and "alone exceeds the SLO" in slow.note
    uncapped = QuantileRegression(20.0, warmup=10, window=50)
    run_closed_loop(uncapped, lambda i, b: 5.0, 300)
    assert uncapped.estimate < 300 and "set a cap to bound it" in uncapped.note  # +1 per refit, not 4e17
    slope = QuantileRegression(20.0, warmup=10, window=50)
    run_closed_loop(slope, lambda i, b: 3.0 + 0.5 * b, 300)
    assert slope.estimate == 34 and slope.note == ""                              # (20 - 3) / 0.5


@pytest.mark.parametrize("seed", [-1, 1.5, True, 2**64])
def test_clipper_seeds_follow_the_one_seed_rule(seed):
    prof = LatencyProfile(3.0, 0.5)
    for call in (lambda: simulate_queue(prof, 100.0, 10, max_batch=4, seed=seed),
                 lambda: ToyModel("m", prof, seed=seed), lambda: Exp3(2, rng=seed),
                 lambda: make_model("mlp", seed=seed)):
        with pytest.raises(ValueError, match=r"(seed|rng) must be an integer with 0 <= (seed|rng) < 2\*\*63"):
            call()


def test_controller_traces_toy_models_and_ensembles_refuse_what_has_no_answer():
    with pytest.raises(ValueError, match=r"batches \[0, 2\) took no time \(every latency is 0\): no rate to report"):
        ControllerTrace(np.array([4, 4]), np.array([0.0, 0.0])).throughput_qps()
    with pytest.raises(ValueError, match=r"\[0, 0\) is empty"):
        ControllerTrace(np.array([], dtype=np.int64), np.array([])).throughput_qps()
    with pytest.raises(ValueError, match="latencies_ms must be finite numbers >= 0"):
        ControllerTrace(np.array([1]), np.array([math.nan]))
    with pytest.raises(ValueError, match=r"must be 1-D and of equal length, got shapes \(2,\) and \(1,\)"):
        ControllerTrace(np.array([1, 2]), np.array([1.0]))
    t = ControllerTrace(np.array([2, 4]), np.array([1.0, 3.0]))
    assert t.throughput_qps() == 1500.0 and t.goodput_qps(2.0) == 500.0 and t.violation_rate(2) == 0.5
    with pytest.raises(ValueError, match="dim must be an integer >= 1, got 2.5"):
        ToyModel("m", LatencyProfile(1, 1), dim=2.5)
    ens = Exp4(2)
    for bad in (math.nan, math.inf, "x", True):
        with pytest.raises(ValueError, match="prediction of model 1 must be a finite number"):
            ens.combine([1.0, bad])
    assert ens.combine([1.0, None]).confidence == 0.5
    assert ens.combine([np.array([1.0, 3.0]), np.array([3.0, 5.0])]).output.tolist() == [2.0, 4.0]


def test_numpy_numbers_are_numbers_and_bools_are_not_anywhere_in_clipper():
    prof = LatencyProfile(np.float64(3), np.int64(1))
    assert (prof.a_ms, prof.b_ms) == (3.0, 1.0) and prof.max_batch(np.float32(20)) == 17
    sel = Exp3(np.int64(3), eta=np.float64(0.1), gamma=np.float32(0.5), rng=np.int64(1))
    sel.update(Pick(np.int64(1), np.float64(0.5)), np.float64(0.5))
    ens = Exp4(np.int8(2), eta=np.int64(1))
    ens.update([np.float32(1.0), None])
    assert ens.weights()[0] < ens.weights()[1]
    assert PredictionCache(np.int64(100)).capacity_bytes == 100
    cache = PredictionCache(100, size_of=lambda v: np.int64(8))
    fut, owner = cache.fetch("m", 1)
    cache.put("m", 1, "y")
    assert owner and fut.result() == "y" and cache.nbytes == 8
    assert simulate_queue(prof, np.int64(100), np.int64(20), max_batch=np.int64(4), n_workers=np.int64(1),
                          seed=np.int64(0)).latencies_ms.size == 20
    assert FixedBatch(np.int64(4)).max_batch == 4 and AIMD(np.int64(20), start=np.int32(3)).max_batch == 3
    bools = [lambda: LatencyProfile(True, 1.0), lambda: LatencyProfile(1.0, True), lambda: sel.update(Pick(True, 0.5), 0.5),
             lambda: sel.update(Pick(0, 0.5), True), lambda: ens.update([True, None]), lambda: Exp3(True),
             lambda: PredictionCache(True), lambda: AIMD(True), lambda: FixedBatch(True),
             lambda: answer_at_deadline(["a", "b"], [1.0, 2.0], [1.0, 1.0], True, ens, 0.0),
             lambda: NoisyLatency(prof, True), lambda: simulate_queue(prof, True, 10, max_batch=2),
             lambda: simulate_queue(prof, 10.0, 10, max_batch=2, delay_ms=True),
             lambda: QuantileRegression(20.0, quantile=True), lambda: AIMD(20.0, backoff=True),
             lambda: prof.max_batch(True), lambda: fit_profile([1, 2], [True, False]),
             lambda: fit_profile([1, 2], [True, 2.0]), lambda: fit_line([True, 2], [1.0, 2.0]),
             lambda: NoisyLatency(prof).sample_ms(True, np.random.default_rng(0))]
    for call in bools:
        with pytest.raises(ValueError, match=r"True \(a bool\)|bools"):
            call()


def test_latency_of_a_list_of_batch_sizes_is_an_array():
    prof = LatencyProfile(3.0, 0.5)
    np.testing.assert_array_equal(prof.latency_ms([1, 2, 4]), [3.5, 4.0, 5.0])
    assert prof.latency_ms(4) == prof.latency_ms(np.int64(4)) == 5.0
    with pytest.raises(ValueError, match=r"batch_size must be an integer in \[1, 9223372036854775807\], or a list"):
        prof.latency_ms([1, 0])


@pytest.mark.parametrize("bad", [math.inf, 2.5, np.float64(4.0), [1, math.inf], np.array([1.0, 2.0])])
def test_a_batch_size_is_a_finite_integer_as_the_controllers_take_it(bad):
    prof = LatencyProfile(3.0, 0.5)
    for call in (prof.latency_ms, lambda b: NoisyLatency(prof).sample_ms(b, np.random.default_rng(0)),
                 lambda b: AIMD(20.0).observe(b, 1.0)):
        with pytest.raises(ValueError, match=r"batch_size must be an integer in \[1, 9223372036854775807\]"):
            call(bad)


class _Echo:
    name = "echo"

    def predict_batch(self, inputs):
        return list(inputs)


def test_a_cache_size_of_is_a_function_and_one_that_raises_leaves_nothing_pending():
    with pytest.raises(ValueError, match=r"size_of must be a function \(value\) -> bytes .*, got 5"):
        PredictionCache(100, size_of=5)
    cache = PredictionCache(100, size_of=len)
    fut, owner = cache.fetch("m", 1)
    with pytest.raises(ValueError, match=r"^size_of must return an integer number of bytes >= 0, but it raised "
                                         r"TypeError: object of type 'int' has no len\(\) for a value of type int$"):
        cache.put("m", 1, 7)
    assert owner and fut.done() and isinstance(fut.exception(), ValueError)   # the waiter hears of it
    fut, owner = cache.fetch("m", 1)                                          # a fresh owner, not a hang
    cache.put("m", 1, "y")
    assert owner and fut.result(timeout=1) == "y"
    echo = CachedModel(_Echo(), PredictionCache(100, size_of=lambda v: 1 if v != "bad" else 1 / 0))
    with pytest.raises(ValueError, match="but it raised ZeroDivisionError"):
        echo.predict_batch(["ok", "bad", "after"])
    assert echo.cache.fetch("echo", "after")[1] and "ok" in echo.predict_batch(["ok"])   # nothing left pending


def test_an_slo_too_large_to_count_its_batch_is_refused_or_capped():
    with pytest.raises(ValueError, match=r"slo_ms 1e\+308 ms is too large for this profile: the batch would "
                                         r"exceed 2\*\*63 - 1 inputs; allowed: slo_ms <= .* about 4.61169e\+18 ms"):
        LatencyProfile(1, 0.5).max_batch(1e308)
    assert LatencyProfile(1, 0.5).max_batch(4.6e18) == 9_200_000_000_000_000_000 < 2**63
    qr = QuantileRegression(1e308, warmup=2, window=5, refit_every=1)
    qr.observe(1, 1.0)
    qr.observe(2, 1.5)
    assert qr.estimate == 2**63 - 1                                  # no OverflowError from inf


def test_a_rate_so_small_its_arrivals_overflow_is_refused():
    with pytest.raises(ValueError, match=r"rate_qps 9.99989e-321 requests per second is too small: the arrival "
                                         r"times of 5 requests overflow a float of milliseconds"):
        simulate_queue(LatencyProfile(1, 0.5), 1e-320, 5, max_batch=2)
    with pytest.raises(ValueError, match="rng must be a Generator, got None"):
        poisson_arrivals(10.0, 5, None)


def test_a_rate_so_small_its_latencies_would_round_away_is_refused():
    """Finite arrivals centuries apart: completion minus arrival rounded to 0 ms for a 3.5 ms batch."""
    with pytest.raises(ValueError, match=r"rate_qps 1e-300 requests per second is too small for this model: the last "
                                         r"of 10 arrivals comes at .* ms, where a float of milliseconds is .* coarse, "
                                         r"too coarse for a batch of one \(3.5 ms\) .* allowed: a rate whose arrivals "
                                         r"stay below about 1.58e\+13 ms"):
        simulate_queue(LatencyProfile(3, 0.5), 1e-300, 10, max_batch=4)
    assert simulate_queue(LatencyProfile(3, 0.5), 1e-9, 10, max_batch=4).latencies_ms.min() > 3


def test_a_delay_so_long_its_latencies_would_round_away_is_refused():
    """A delay of 1e300 ms answered every latency as exactly 1e300 ms: the batch's own 3.5 ms rounded away."""
    with pytest.raises(ValueError, match=r"delay_ms 1e\+300 ms is too long for this model: .* too coarse for a batch "
                                         r"of one \(3.5 ms\), .* allowed: delay_ms up to about 1.58e\+13 ms"):
        simulate_queue(LatencyProfile(3, 0.5), 100.0, 10, max_batch=20, delay_ms=1e300)
    r = simulate_queue(LatencyProfile(3, 0.5), 100.0, 10, max_batch=20, delay_ms=1e12)
    assert r.batch_sizes.tolist() == [10] and r.latencies_ms[0] == pytest.approx(1e12 + 8.0, rel=0, abs=1e-3)


def test_answers_at_the_deadline_need_arrival_times_and_an_exp4():
    for arrival, msg in (([math.nan, 1.0], r"arrival_ms\[0\] must be a number of milliseconds >= 0, got nan"),
                         ([1.0, -math.inf], r"arrival_ms\[1\] must be a number of milliseconds >= 0, got -inf"),
                         ([1.0, "x"], r"arrival_ms\[1\] must be a number .* got 'x' \(str\)"),
                         (None, r"arrival_ms must be a list with one entry per model \(2\), got None")):
        with pytest.raises(ValueError, match=msg):
            answer_at_deadline(["a", "b"], [1.0, 2.0], arrival, 5.0, Exp4(2), 0.0)
    with pytest.raises(ValueError, match="policy must be an Exp4, got None"):
        answer_at_deadline(["a", "b"], [1.0, 2.0], [1.0, 1.0], 5.0, None, 0.0)
    with pytest.raises(ValueError, match="models must be a list of ModelContainer objects, got None"):
        StragglerEnsemble(None, Exp4(2), 5.0, 0.0)
    twins = [ToyModel("linear-svm-like", get_toy_profile("linear-svm-like"), seed=s) for s in (0, 1)]
    with pytest.raises(ValueError, match="two models are named 'linear-svm-like': an answer names the models"):
        StragglerEnsemble(twins, Exp4(2), 5.0, 0.0)
    with pytest.raises(ValueError, match="two models are named 'a'"):
        answer_at_deadline(["a", "a", "c"], [1.0, 2.0, 3.0], [1.0, 50.0, 2.0], 10.0, Exp4(3), -1)


def test_a_vote_over_labels_that_are_no_labels_says_so():
    with pytest.raises(ValueError, match=r"labels\[0\] is a list, which cannot be a class label: a label is hashable"):
        Exp4(2).vote([[1], [1]])
    assert Exp4(2).vote([(1, 2), (1, 2)]).output == (1, 2)


@pytest.mark.parametrize("nan", [math.nan, float("nan"), np.float64("nan"), complex("nan")])
def test_a_nan_label_is_refused_not_tallied_apart_where_it_won_ties(nan):
    """A NaN label equals no label, so it was tallied on its own and, first in a tie, answered nan."""
    for labels, i in (([nan, 1.0], 0), ([1.0, nan], 1), ([nan, nan, 1], 0)):
        with pytest.raises(ValueError, match=rf"labels\[{i}\] is .*nan.*, which cannot be a class label: it equals "
                                             r"no label, not even itself.* pass None for a model that gave no label"):
            Exp4(len(labels)).vote(labels)
    assert Exp4(2).vote([None, 1.0]).output == 1.0


@pytest.mark.parametrize("q", [-1, 100.5, 150, math.nan, math.inf, True, "99"])
def test_a_latency_percentile_outside_0_to_100_is_refused_by_name(q):
    """numpy's own 'Percentiles must be in the range [0, 100]' did not say which number was wrong;
    True was read as 1."""
    r = simulate_queue(LatencyProfile(3.0, 0.5), 100.0, 20, max_batch=4)
    with pytest.raises(ValueError, match=r"q \(a percentile\) must be a finite number in \[0, 100\], got "):
        r.latency_pct(q)
    assert r.latency_pct(0) == r.latencies_ms.min() and r.latency_pct(100) == r.latencies_ms.max()


@pytest.mark.parametrize("x, y, says", [
    ([1, 2], [0.0, 1e308], r"latencies in \[0, 1e\+12\] ms, got batch sizes 1\.\.2 and latencies 0\.\.1e\+308"),
    ([1, 1e300], [1.0, 2.0], r"batch sizes must be in \[1, 2\*\*63 - 1\] .* got batch sizes 1\.\.1e\+300"),
    ([0, 2], [1.0, 2.0], r"got batch sizes 0\.\.2"),
    ([1, 2], [-1.0, 2.0], r"latencies -1\.\.2"),
])
def test_a_line_is_fitted_to_measurements_in_range_only(x, y, says):
    """Latencies past 1e12 ms overflowed the quantile search's span (a line of -inf and inf); batch
    sizes past an int64's made its tolerance lose the intercept."""
    for quantile in (None, 0.99):
        with pytest.raises(ValueError, match=says):
            fit_line(x, y, quantile)


@pytest.mark.parametrize("make", [lambda: AIMD(20.0), lambda: FixedBatch(4),
                                  lambda: QuantileRegression(20.0, warmup=2, window=10)])
def test_a_latency_no_line_is_fitted_to_is_refused_before_a_controller_keeps_it(make):
    """A quantile regression kept a latency past 1e12 ms in its window and then failed at every
    refit, whatever it was told after; every controller now refuses it where it is observed."""
    c = make()
    c.observe(1, 3.5)
    with pytest.raises(ValueError, match=r"latency_ms must be a finite number of milliseconds in \[0, 1e\+12\]"):
        c.observe(2, 1e13)
    for b, ms in ((2, 4.0), (1, 3.5), (2, 4.0)):       # nothing kept: it goes on learning
        c.observe(b, ms)
    assert c.max_batch >= 1


def test_clipper_parts_of_the_wrong_kind_get_a_value_error():
    prof = LatencyProfile(3.0, 0.5)
    for call, msg in [
            (lambda: run_closed_loop(None, lambda i, b: 1.0, 5), "controller must be a BatchController, got None"),
            (lambda: run_closed_loop(FixedBatch(2), None, 5), r"execute must be a function \(batch index, batch"),
            (lambda: run_closed_loop(FixedBatch(2), lambda i, b: None, 5),
             r"the latency execute\(0, 2\) returned must be a finite number of milliseconds >= 0, got None"),
            (lambda: NoisyLatency(prof).sample_ms(3, None), "rng must be a Generator, got None"),
            (lambda: get_toy_profile(["x"]), r"unknown toy model \['x'\] \(list\); choose one of 'linear-svm-like'"),
            (lambda: make_model(["x"]), r"unknown torch model \['x'\] \(list\); choose one of 'mlp'"),
            (lambda: make_model("mlp", device="nope"), "unknown device 'nope'; allowed: cpu, cuda or cuda:N"),
            (lambda: Exp4(2).update(None), r"losses must be a list of one loss \(or None\) per model \(2\), got None"),
            (lambda: Exp4(2).combine(None), r"predictions must be a list of one prediction .* got None"),
            (lambda: Interference(max_seconds="x"), "max_seconds must be a finite number of seconds > 0, got 'x'"),
            (lambda: Interference(10**6), r"n_threads must be an integer in \[1, 1024\], got 1000000"),
            (lambda: Interference(1, size=10**7), r"Interference\(1 threads of 10000000 x 10000000 matmuls\) needs "
                                                   r"1,200,000\.0 GB of memory, but only .* is available here")]:
        with pytest.raises(ValueError, match=msg):
            call()
    ens = Exp4(2)
    with pytest.raises(ValueError, match=r"loss \(scale feedback into \[0, 1\]\) must be a finite number in \[0, 1\], "
                                         r"got 'x' \(str\)"):
        ens.update([0.5, "x"])
    assert ens.weights().tolist() == [0.5, 0.5]                      # no weight moved before the bad loss


def test_a_toy_model_says_what_inputs_it_takes_as_a_torch_container_does():
    m = ToyModel("toy", LatencyProfile(3.0, 0.5), dim=2)
    want = "toy: inputs must be vectors of length 2 of finite real numbers, got"
    for inputs, got in (([["a", "b"]], "dtype <U1"), ([["1", "2"]], "dtype <U1"), ([[True, False]], "dtype bool"),
                        ([[1.0, 2.0], [1.0]], "vectors of different lengths"), ([[1.0, math.nan]], "NaN or inf"),
                        ([[1.0, 2.0, 3.0]], r"an array of shape \(1, 3\)")):
        with pytest.raises(ValueError, match=rf"{want} {got}"):
            m.predict_batch(inputs)
    assert m.n_batches == 0 and m.predict_batch([[1, 2], np.array([3.0, 4.0])]) == \
        [float(v) for v in np.array([[1.0, 2.0], [3.0, 4.0]]) @ m.weights]


def test_a_torch_container_says_what_inputs_it_takes():
    m = make_model("mlp")
    want = "mlp: inputs must be vectors of length 128 of finite real numbers"
    for inputs, got in ((["a"], r"\(tensors, arrays or lists\), got items of type str that do not stack"),
                        ([[1.0] * 128, [1.0]], "got items of type list that do not stack"),
                        ([[True] * 128], "got dtype torch.bool"), ([[math.nan] * 128], "got NaN or inf")):
        with pytest.raises(ValueError, match=rf"{want}.*{got}"):
            m.predict_batch(inputs)
    assert m.n_batches == 0 and len(m.predict_batch([np.ones(128, dtype=np.int64)])) == 1
    with pytest.raises(ValueError, match="quantile must be a finite number in"):
        measure_profile(m, [1, 2], quantile="x")


@pytest.mark.parametrize("returned, error, message", [
    (None, TypeError, r"container 'bad' returned NoneType from predict_batch; the contract is a sequence with one"),
    (7, TypeError, r"container 'bad' returned int from predict_batch"),
    ([1], ValueError, r"container 'bad' returned 1 outputs for 2 inputs; the contract is one output per input"),
])
def test_a_container_that_breaks_the_contract_is_named(returned, error, message):
    from clipper import checked_predict, timed_predict

    class Bad:
        name = "bad"

        def predict_batch(self, inputs):
            return returned

    for call in (checked_predict, timed_predict):
        with pytest.raises(error, match=message):
            call(Bad(), ["a", "b"])


def test_an_input_with_no_cache_key_registers_nothing_and_says_which_it_is():
    echo = CachedModel(_Echo(), PredictionCache(10_000))
    with pytest.raises(TypeError, match=r"echo: input 1 \(function\) cannot be a cache key .* values pickle can save"):
        echo.predict_batch([1, lambda: 0])
    done = []
    worker = threading.Thread(target=lambda: done.append(echo.predict_batch([1])), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert done == [[1]]                       # answered, not left waiting on a key nobody computes
    with pytest.raises(ValueError, match="model must be a ModelContainer, got None"):
        CachedModel(None, PredictionCache(10))
    with pytest.raises(ValueError, match="cache must be a PredictionCache"):
        CachedModel(_Echo(), {})


def test_arrays_of_python_objects_are_cached_by_value_not_by_address():
    class Sum:
        name = "sum"

        def predict_batch(self, inputs):
            return [float(sum(x)) for x in inputs]

    cm = CachedModel(Sum(), PredictionCache(100_000))
    for i in range(300):                       # freed arrays' memory is reused: addresses repeat
        x = np.empty(1, dtype=object)
        x[0] = i + 0.5
        assert cm.predict_batch([x]) == [i + 0.5]
    same = np.empty(1, dtype=object)
    same[0] = 7.5
    assert cm.cache.fetch("sum", same)[1] is False    # an equal array held elsewhere is a hit


def test_clipper_numbers_stay_within_what_the_machine_counts():
    """A deadline a thread can wait for, a learning rate whose log-weights stay finite, and batch
    sizes an int64 holds, however large the SLO or the step."""
    model = ToyModel("m", LatencyProfile(3.0, 0.5), seed=0)
    with pytest.raises(ValueError, match=r"deadline_ms must be a finite number of milliseconds in \(0, "):
        StragglerEnsemble([model], Exp4(1), 1e300, 0)
    for make in (lambda: Exp3(2, eta=1e308, gamma=0.5), lambda: Exp4(2, eta=1e4)):
        with pytest.raises(ValueError, match=r"eta must be a finite number in \(0, 1000\]"):
            make()
    for gamma in (0, 5e-324):                          # (a model's share gamma / n would round to 0)
        with pytest.raises(ValueError, match=r"gamma \(the exploration share\) must be a finite number in \[1e-09, 1"):
            Exp3(3, gamma=gamma)
    trace = run_closed_loop(AIMD(1e300, increase=2**62), lambda i, b: 1.0, 5)
    assert int(trace.batch_sizes.max()) == 2**63 - 1
    qr = QuantileRegression(1e300, warmup=10, window=50)
    trace = run_closed_loop(qr, lambda i, b: 3.0 + 0.5 * min(b, 100), 300)
    assert qr.estimate == 2**63 - 1 and int(trace.batch_sizes.max()) == 2**63 - 1


def test_exp4_refuses_predictions_of_different_shapes_instead_of_broadcasting():
    for preds, got in (([np.array([1.0, 2.0]), 3.0], r"model 0: \(2,\), model 1: \(\)"),
                       ([np.array([1.0, 2.0]), np.array([1.0, 2.0, 3.0])], r"model 0: \(2,\), model 1: \(3,\)"),
                       ([[1.0, 2.0], None, [[1.0, 2.0]]], r"model 0: \(2,\), model 2: \(1, 2\)")):
        with pytest.raises(ValueError, match=rf"predictions must all have the same shape .* got {got}"):
            Exp4(len(preds)).combine(preds)
    assert Exp4(2).combine([[1.0, 2.0], np.array([3.0, 4.0])]).output.tolist() == [2.0, 3.0]


def test_a_fixed_batch_no_int64_counts_is_refused_like_the_other_controllers_bound_it():
    with pytest.raises(ValueError, match=r"size \(at most 2\*\*63 - 1.*\) must be an integer in \[1, 9223372036854775807\], "
                                         r"got 1180591620717411303424"):
        FixedBatch(2**70)
    trace = run_closed_loop(FixedBatch(2**63 - 1), lambda i, b: 1.0, 2)
    assert trace.batch_sizes.tolist() == [2**63 - 1] * 2


class _Custom(AIMD):
    """A controller whose answer is set by the test."""

    answer = 2.5

    @property
    def max_batch(self):
        return self.answer


@pytest.mark.parametrize("answer, got", [(2.5, "2.5"), (0, "0"), (2**70, "1180591620717411303424"),
                                         (True, r"True \(a bool\)"), (math.nan, "nan"), (None, "None")])
def test_a_custom_controllers_max_batch_is_checked_where_it_is_read(answer, got):
    ctl = _Custom(20.0)
    ctl.answer = answer
    msg = rf"_Custom.max_batch \(the batch the controller allows\) must be an integer in \[1, .*\], got {got}"
    with pytest.raises(ValueError, match=msg):
        run_closed_loop(ctl, lambda i, b: 1.0, 3)
    with pytest.raises(ValueError, match=msg):
        simulate_queue(LatencyProfile(1.0, 0.5), 100.0, 10, max_batch=ctl, delay_ms=1.0)


def test_a_controller_that_overrides_observe_is_refused_where_it_is_defined():
    # observe checks each batch and latency before _observe learns from them; an override skipped
    # that check silently (a NaN latency reached the controller's state)
    with pytest.raises(TypeError, match=r"Mine overrides BatchController.observe, .* write _observe\(batch_size, "
                                        r"latency_ms\) instead"):
        class Mine(BatchController):
            @property
            def max_batch(self):
                return 4

            def observe(self, batch_size, latency_ms):
                return 4

            def _observe(self, batch_size, latency_ms):
                pass


def test_a_zero_dimensional_batch_is_named_not_a_len_error():
    with pytest.raises(ValueError, match=r"mlp: inputs must be vectors of length 128 .*, got shape \(\)"):
        make_model("mlp").predict_batch(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"echo: predict_batch takes a sequence of inputs, got ndarray of shape \(\)"):
        CachedModel(_Echo(), PredictionCache(100)).predict_batch(np.array(1.0))
    with pytest.raises(ValueError, match=r"m: predict_batch takes a sequence of inputs, got Tensor of shape \(\)"):
        ToyModel("m", LatencyProfile(1.0, 0.5)).predict_batch(torch.tensor(1.0))


@pytest.mark.parametrize("window, interference, msg", [
    ((0.5, 3), None, r"window must be two batch indices \(start, stop\), integers with 0 <= start < stop <= "
                     r"n_batches \(5\), got \(0.5, 3\)"),
    ((1, 3.0), None, r"window must be two batch indices .* got \(1, 3.0\)"),
    ((3, 3), None, r"window must be two batch indices .* got \(3, 3\)"),
    ((1, 6), None, r"window must be two batch indices .* got \(1, 6\)"),
    ((1, 2, 3), None, r"window must be two batch indices .* got \(1, 2, 3\)"),
    ("ab", None, r"window must be two batch indices .* got 'ab'"),
    ((1, 3), "threads", r"interference must be an Interference, got 'threads' \(str\)"),
])
def test_run_online_refuses_an_interference_that_could_never_run(window, interference, msg):
    from clipper.torch_models import run_online
    m = make_model("mlp")
    with pytest.raises(ValueError, match=msg):
        run_online(m, AIMD(10, cap=8), 5, interference=interference or Interference(1), window=window)
    assert m.n_batches == 0                                            # refused before any batch ran


def test_run_online_refuses_an_interference_already_running():
    from clipper.torch_models import run_online
    inter = Interference(1, size=16, max_seconds=5.0)
    with inter:
        with pytest.raises(ValueError, match="interference is already running"):
            run_online(make_model("mlp"), AIMD(10, cap=8), 5, interference=inter, window=(1, 3))


@pytest.mark.parametrize("start, stop, predicate, msg", [
    (-3, None, None, r"start must be an integer in \[0, 50\], got -3"),      # no search from the trace's end
    (0, 51, None, r"stop must be an integer in \[0, 50\], got 51"),
    (10, 5, None, r"stop must be an integer in \[10, 50\], got 5"),
    (1.5, None, None, r"start must be an integer in \[0, 50\], got 1.5"),
    (0, None, "late", r"predicate must be a function \(batch size, latency in ms\) -> bool, got 'late' \(str\)"),
])
def test_batches_until_takes_batch_indices_of_the_trace_and_a_function(start, stop, predicate, msg):
    trace = run_closed_loop(FixedBatch(4), lambda i, b: 1.0 + i, 50)
    with pytest.raises(ValueError, match=msg):
        trace.batches_until(predicate or (lambda b, lat: True), start, stop)
    assert trace.batches_until(lambda b, lat: lat > 45.5, 40) == 5 and trace.batches_until(lambda b, lat: True, 50) is None


def test_a_queue_too_large_for_memory_is_refused_up_front(monkeypatch):
    prof = LatencyProfile(3.0, 0.5)
    with pytest.raises(ValueError, match=r"simulate_queue\(n_requests=10, n_workers=1,000,000,000,000,000\) needs "
                                         r"[\d,.]+ GB of memory, but only"):
        simulate_queue(prof, 100.0, 10, max_batch=4, n_workers=10**15)   # (a list of 10**15 idle workers)
    monkeypatch.setattr("orca_torch.checks.available_memory_bytes", lambda: 1_000_000)
    with pytest.raises(ValueError, match=r"simulate_queue\(n_requests=100,000, n_workers=1\) needs 8 MB of memory, "
                                         r"but only 1 MB is available here"):
        simulate_queue(prof, 100.0, 100_000, max_batch=4)
    with pytest.raises(ValueError, match=r"poisson_arrivals of n_requests=100,000 needs 2 MB of memory"):
        poisson_arrivals(100.0, 100_000, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"mlp: 10,000 example inputs of 128 float32s needs 5 MB of memory"):
        make_model("mlp").example_inputs(10_000)
    narrow = TorchContainer("narrow", nn.Linear(10, 1), 10)        # its rows are drawn 16 floats wide
    with pytest.raises(ValueError, match=r"narrow: 20,000 example inputs of 10 float32s needs 1 MB of memory"):
        narrow.example_inputs(20_000)


@pytest.mark.parametrize("policy", [Exp3, Exp4])
def test_a_selection_policy_over_more_models_than_memory_holds_is_refused_up_front(policy, monkeypatch):
    name = policy.__name__
    with pytest.raises(ValueError, match=rf"{name}\(n_models=1,000,000,000,000,000\) needs [\d,.]+ GB of memory, "
                                         r"but only"):
        policy(10**15)                                  # (numpy's MemoryError, or an overcommitted array)
    monkeypatch.setattr("orca_torch.checks.available_memory_bytes", lambda: 1_000_000)
    with pytest.raises(ValueError, match=rf"{name}\(n_models=100,000\) needs 6 MB of memory, but only 1 MB"):
        policy(100_000)
    assert policy(1_000).n == 1_000


def test_a_second_model_under_a_name_the_cache_answers_for_is_refused():
    class Scale:
        def __init__(self, name, k):
            self.name, self.k = name, k

        def predict_batch(self, xs):
            return [self.k * float(x) for x in xs]

    cache = PredictionCache(10_000)
    v1 = Scale("ranker", 1.0)
    assert CachedModel(v1, cache).predict_batch([2.0]) == [2.0]
    with pytest.raises(ValueError, match=r"this cache already answers for another model named 'ranker': its outputs "
                                         r"would be returned for this one; give each model its own name"):
        CachedModel(Scale("ranker", -1.0), cache)     # (it would have answered 2.0, v1's output)
    assert CachedModel(v1, cache).predict_batch([2.0]) == [2.0] and cache.stats.hits == 1   # the same model: fine
    assert CachedModel(Scale("ranker-v2", -1.0), cache).predict_batch([2.0]) == [-2.0]
    with pytest.raises(ValueError, match=r"a model's name is part of its cache keys, so it must be a str, got None"):
        CachedModel(Scale(None, 1.0), cache)


@pytest.mark.parametrize("name, got", [(None, "None"), (5, r"5 \(int\)"), (b"m", r"b'm' \(bytes\)")])
def test_a_container_refuses_a_name_that_is_not_a_str_as_the_cache_would(name, got):
    msg = rf"a model's name is part of its cache keys, so it must be a str, got {got}"
    for make in (lambda: ToyModel(name, LatencyProfile(1.0, 0.5)), lambda: TorchContainer(name, nn.Linear(2, 1), 2)):
        with pytest.raises(ValueError, match=msg):
            make()


def test_profiling_and_online_runs_say_which_container_and_pool_they_take():
    from clipper.torch_models import run_online
    with pytest.raises(ValueError, match=r"container must be a TorchContainer, got 'mlp' \(str\)"):
        run_online("mlp", AIMD(10, cap=8), 5)
    with pytest.raises(ValueError, match=r"container must be a ModelContainer, got 'mlp' \(str\)"):
        measure_profile("mlp", [1, 2])
    toy = ToyModel("toy", LatencyProfile(1.0, 0.5), dim=2)
    with pytest.raises(ValueError, match=r"container ToyModel has no example inputs of its own .* pass inputs="):
        measure_profile(toy, [1, 2])
    assert measure_profile(toy, [1, 2], inputs=[[1.0, 2.0]] * 2, reps=1, warmup=0).batch_sizes.size == 2
    with pytest.raises(ValueError, match=r"measure_profile's inputs for toy: predict_batch takes a sequence of "
                                         r"inputs, got int"):
        measure_profile(toy, [1, 2], inputs=5)
    m = make_model("mlp")
    for bad in (0, -1, 2.5):                 # (0 was taken as "no pool size": a pool of the controller's cap)
        with pytest.raises(ValueError, match=rf"pool_size must be an integer >= 1, got {bad}"):
            run_online(m, FixedBatch(2), 3, pool_size=bad)
    with pytest.raises(ValueError, match=r"above the input pool of 4; give the controller a cap, or run_online a "
                                         r"larger pool_size"):
        run_online(m, FixedBatch(8), 2, pool_size=4)
    assert m.n_batches == 0


@pytest.mark.parametrize("x, y", [(["a", "b"], [1, 2]), ([1, 2], "xy"), ({1: 2}, [1]), (["1", "2"], [3.0, 4.0]),
                                  ([1, 2], ["3", "4.5"]), ([[1], [1, 2]], [1, 2]), ([True, False], [1, 2])])
def test_a_line_fitted_to_what_is_not_numbers_says_so(x, y):
    """numpy's own conversion error named neither argument ('could not convert string to float', or
    'inhomogeneous shape' for a ragged list); strings of digits were converted and fitted."""
    for fit in (fit_line, fit_profile):
        with pytest.raises(ValueError, match=r"batch sizes and latencies must be sequences of numbers \(not bools, "
                                             r"nor strings\), got"):
            fit(x, y)
    with pytest.raises(ValueError, match=r"a line needs measurements at two or more distinct batch sizes, got none"):
        fit_line([], [])    # (numpy's 'zero-size array to reduction operation maximum')


def test_a_prediction_asked_of_what_is_no_container_names_the_container():
    from clipper import checked_predict, timed_predict

    for call in (checked_predict, timed_predict):
        for not_a_container in (None, "model", object()):
            with pytest.raises(ValueError, match=r"container must be a ModelContainer, got"):
                call(not_a_container, ["a"])


def test_per_model_lists_that_are_dicts_or_sets_are_refused_not_read_by_their_keys():
    """A dict was read by its keys: Exp4.update({0: 0.0, 1: 0.0}) charged model 1 a loss of 1, an
    answer at the deadline took predictions {0: 5.0, 1: 6.0} for 0 and 1 (answered 0.5) and arrival
    times {0: 100.0, 1: 1.0} for 0 and 1 ms (both on time); a set of times, which has no order, was
    matched to the models in hash order; combine and vote raised a KeyError unless keyed 0..n-1."""
    ens = Exp4(2)
    for call, name in ((lambda: ens.update({0: 0.0, 1: 0.0}), "losses"),
                       (lambda: ens.combine({0: 5.0, 1: 6.0}), "predictions"),
                       (lambda: ens.combine({"a": 5.0, "b": 6.0}), "predictions"),
                       (lambda: ens.vote({0: "cat", 1: "dog"}), "labels")):
        with pytest.raises(ValueError, match=rf"{name} must be a list of one .* per model \(2\), got \{{"):
            call()
    assert ens.weights().tolist() == [0.5, 0.5]
    for args, name in (((["a", "b"], {0: 5.0, 1: 6.0}, [1.0, 1.0]), "predictions"),
                       ((["a", "b"], [5.0, 6.0], {0: 100.0, 1: 1.0}), "arrival_ms"),
                       ((["a", "b"], [5.0, 6.0], {100.0, 1.0}), "arrival_ms"),
                       (({"a": 0, "b": 1}, [5.0, 6.0], [1.0, 1.0]), "names")):
        with pytest.raises(ValueError, match=rf"{name} must be a list with one entry per model \(2\), got \{{"):
            answer_at_deadline(*args, 10.0, Exp4(2), -1.0)


def test_profiling_and_online_runs_name_a_bad_size_list_controller_or_measure():
    """Each was a TypeError from inside ('NoneType' object is not iterable / not callable, 'cannot
    unpack non-iterable int object'), the last two after the input pool was built."""
    from clipper.torch_models import run_online

    m = make_model("mlp")
    for sizes in (None, 5):
        with pytest.raises(ValueError, match=rf"batch_sizes must be a list of batch sizes, got {sizes}"):
            measure_profile(m, sizes)
    for call, msg in ((lambda: run_online(m, None, 2), "controller must be a BatchController, got None"),
                      (lambda: run_online(m, AIMD(100.0, cap=4), 2, measure=None),
                       r"measure must be a function \(container, inputs\) -> \(outputs, latency in ms\), got None"),
                      (lambda: run_online(m, AIMD(100.0, cap=4), 2, measure=lambda c, x: 5),
                       r"measure must return \(outputs, latency in ms\), got 5 for batch 0")):
        with pytest.raises(ValueError, match=msg):
            call()
    assert m.n_batches == 0


class _Capped(BatchController):
    """A controller of batches of `size` (2) whose `cap` the test sets (run_online sizes its input pool
    by it)."""

    cap = None
    size = 2

    @property
    def max_batch(self):
        return self.size

    def _observe(self, batch_size, latency_ms):
        pass


@pytest.mark.parametrize("cap, got", [(2.5, "2.5"), (0, "0"), ("8", r"'8' \(str\)"), (True, r"True \(a bool\)")])
def test_a_controllers_cap_that_sizes_run_onlines_input_pool_is_named_when_it_is_no_count(cap, got):
    # it was refused as 'n must be an integer >= 1' (example_inputs' n, which the caller never gave),
    # and a cap of 0 silently drew 1024 inputs
    from clipper.torch_models import run_online

    ctl, m = _Capped(), make_model("mlp")
    ctl.cap = cap
    with pytest.raises(ValueError, match=rf"_Capped.cap \(run_online draws up to that many inputs to batch from; or give "
                                         rf"pool_size\) must be an integer >= 1, got {got}$"):
        run_online(m, ctl, 2)
    assert m.n_batches == 0
    assert run_online(m, ctl, 2, pool_size=4).trace.batch_sizes.tolist() == [2, 2]      # pool_size wins
    ctl.cap = None                                                                      # no cap: 1024 inputs
    assert run_online(m, ctl, 2).items_executed == 4
    ctl.size = 1025
    with pytest.raises(ValueError, match="controller asked for a batch of 1025, above the input pool of 1024; "):
        run_online(m, ctl, 2)


@pytest.mark.parametrize("make, bounds, says", [
    (lambda: AIMD(20.0, start=50, cap=10), "min_batch, cap", r"in \[1, 10\], got 50"),
    (lambda: AIMD(20.0, start=2, min_batch=5), "min_batch, cap", r"in \[5, 9223372036854775807\], got 2"),
    (lambda: AIMD(20.0, start=3, min_batch=4, cap=8), "min_batch, cap", r"in \[4, 8\], got 3"),
    # QuantileRegression has no min_batch: its refusal names its own bounds, not the exploring AIMD's
    (lambda: QuantileRegression(20.0, start=50, cap=10), "1, cap", r"in \[1, 10\], got 50"),
    (lambda: QuantileRegression(20.0, start=0), "1, cap", r"in \[1, 9223372036854775807\], got 0")])
def test_a_controllers_start_outside_its_bounds_is_refused_not_moved(make, bounds, says):
    with pytest.raises(ValueError, match=rf"start \(the first max_batch, within \[{bounds}\]\) must be an integer "
                                         rf"{says}"):
        make()
    assert AIMD(20.0, min_batch=5).max_batch == 5           # the default start is min_batch
    assert AIMD(20.0, start=10, cap=10).max_batch == 10
    assert QuantileRegression(20.0, start=4, cap=4).max_batch == 4


def test_a_quantile_regression_window_past_what_a_deque_holds_is_refused_at_the_door():
    # 2**70 reached collections.deque and came back as an OverflowError about a C ssize_t
    with pytest.raises(ValueError, match=r"window \(.*\) must be an integer in \[3, 9223372036854775807\], got "
                                         r"1180591620717411303424"):
        QuantileRegression(20.0, window=2**70)
    assert QuantileRegression(20.0, window=2**63 - 1).window == 2**63 - 1


def test_a_closed_loop_too_long_for_memory_is_refused_before_any_batch(monkeypatch):
    # its trace was allocated up front: numpy's MemoryError (2**40 batches) or "Maximum allowed dimension"
    from orca_torch import checks
    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 16 * 10**9)
    ran = []
    for n in (2**40, 2**70):
        with pytest.raises(ValueError, match=rf"run_closed_loop\(n_batches={n:,}\) needs .* GB of memory, but only "
                                             r"16.0 GB"):
            run_closed_loop(AIMD(20.0), lambda i, b: ran.append(i) or 1.0, n)
    assert ran == [] and len(run_closed_loop(AIMD(20.0), lambda i, b: 1.0, 3).batch_sizes) == 3


def test_a_toy_model_too_wide_for_memory_is_refused_at_the_door(monkeypatch):
    # its weights were drawn at once: numpy's "Maximum allowed dimension exceeded", or its MemoryError
    from orca_torch import checks
    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 16 * 10**9)
    for dim in (2**40, 2**70):
        with pytest.raises(ValueError, match=rf"ToyModel\(dim={dim:,}\) needs .* GB of memory, but only 16.0 GB"):
            ToyModel("m", LatencyProfile(1.0, 0.5), dim=dim)
    assert ToyModel("m", LatencyProfile(1.0, 0.5), dim=1000).weights.size == 1000


def test_an_aimd_min_batch_past_what_an_int64_counts_is_refused_at_the_door():
    # it was taken, and the first dispatch then failed on the controller's max_batch, not on min_batch
    with pytest.raises(ValueError, match=r"min_batch .* must be an integer in \[1, 9223372036854775807\], got "
                                         r"1180591620717411303424"):
        AIMD(20.0, min_batch=2**70)
    assert AIMD(20.0, min_batch=2**63 - 1).max_batch == 2**63 - 1


@pytest.mark.parametrize("make, bounds", [(AIMD, "min_batch, cap"), (QuantileRegression, "1, cap")])
def test_a_start_past_what_an_int64_counts_is_refused_at_the_door_whatever_the_cap(make, bounds):
    # under a cap of 2**70 a start of 2**70 was taken, and the first dispatch then failed on max_batch
    with pytest.raises(ValueError, match=rf"start \(the first max_batch, within \[{bounds}\]\) must be an "
                                         r"integer in \[1, 9223372036854775807\], got 1180591620717411303424"):
        make(20.0, cap=2**70, start=2**70)
    assert make(20.0, cap=2**70, start=2**63 - 1).max_batch == 2**63 - 1


def test_an_aimd_cap_below_its_min_batch_is_refused_naming_min_batch():
    with pytest.raises(ValueError, match=r"cap \(at least min_batch\) must be an integer >= 10, got 5"):
        AIMD(20.0, cap=5, min_batch=10)
    with pytest.raises(ValueError, match=r"cap \(at least min_batch\) must be an integer >= 1, got 0"):
        AIMD(20.0, cap=0)


@pytest.mark.parametrize("batch, z, says", [
    (0, 0.0, r"batch_size must be an integer in \[1, 9223372036854775807\], got 0"),
    (2, math.nan, r"z must be finite standard-normal draws .* got nan"),
    (2, -math.inf, r"z must be finite standard-normal draws .* got -inf"),
    (2, True, r"z must be finite standard-normal draws \(numbers, not bools\)"),
    (2, 10**400, r"z must be finite standard-normal draws"),
    ([1, 2], 0.5, r"one per batch size \(shape \(2,\)\), got 0.5")])
def test_a_latency_for_given_draws_takes_one_finite_draw_per_batch(batch, z, says):
    noisy = NoisyLatency(LatencyProfile(3.0, 0.5), 0.05)
    with pytest.raises(ValueError, match=says):
        noisy.with_normal(batch, z)
    assert noisy.with_normal(2, 1.0) == pytest.approx(4.0 * 1.05)


@pytest.mark.parametrize("a_ms, b_ms, which", [(1e13, 0.5, "a_ms"), (3.0, 1e13, "b_ms"), (1e308, 1e308, "a_ms")])
def test_a_profile_slower_than_any_fitted_latency_is_refused_at_the_door(a_ms, b_ms, which):
    # it was taken: latency_ms answered inf, throughput_qps 0.0, and simulate_queue failed on its own result
    with pytest.raises(ValueError, match=rf"LatencyProfile.{which} .* must be a finite number of milliseconds in "
                                         r"[\[(]0, 1e\+12\]"):
        LatencyProfile(a_ms, b_ms)
    top = LatencyProfile(1e12, 1e12)
    assert math.isfinite(top.latency_ms(2**63 - 1)) and top.throughput_qps(2**63 - 1) > 0


def test_a_latency_that_overflows_names_the_batch_and_b_factor_not_only_z():
    # with_normal blamed z ("0.5 is too far from 0") for b_factor's overflow; sample_ms answered inf
    noisy = NoisyLatency(LatencyProfile(3.0, 0.5), 0.05)
    says = r"the latency overflows a float: a batch of up to 10 at b_factor 1e\+308 has a mean of inf ms"
    with pytest.raises(ValueError, match=says):
        noisy.with_normal(10, 0.5, b_factor=1e308)
    with pytest.raises(ValueError, match=says):
        noisy.sample_ms(np.array([1, 10]), np.random.default_rng(0), b_factor=1e308)
    assert noisy.sample_ms(10, np.random.default_rng(0), b_factor=1e300) < 1e302


@pytest.mark.parametrize("lat, sizes, busy, horizon, says", [
    ([], [], [1.0], 1.0, r"latencies_ms must be a non-empty 1-D array of finite numbers >= 0"),
    ([1.0, math.nan], [2], [1.0], 1.0, r"latencies_ms must be"),
    ([1.0, 2.0], [1], [1.0], 1.0, r"batch_sizes must be a 1-D array of integers >= 1 that add up to the 2 requests"),
    ([1.0, 2.0], [2.0], [1.0], 1.0, r"batch_sizes must be"),
    ([1.0], [1], [], 1.0, r"busy_ms must be a non-empty 1-D array of finite numbers >= 0"),
    ([1.0], [1], [1.0], 0.0, r"horizon_ms must be a finite number of milliseconds > 0, got 0.0"),
    ([1.0], [1], [1.0], math.nan, r"horizon_ms must be a finite number of milliseconds > 0, got nan")])
def test_a_queue_result_built_by_hand_is_checked_as_a_controller_trace_is(lat, sizes, busy, horizon, says):
    with pytest.raises(ValueError, match=says):
        QueueResult(np.asarray(lat), np.asarray(sizes), np.asarray(busy), horizon)
    r = QueueResult([1.0, 3.0], [2], [2.0], 4.0)        # lists are taken too
    assert (r.busy_fraction, r.mean_batch, r.throughput_qps, r.mean_latency_ms) == (0.5, 2.0, 500.0, 2.0)


@pytest.mark.parametrize("make", [lambda: LatencyProfile(3.0, 0.5, 5),
                                  lambda: fit_profile([1, 2], [3.5, 4.0], name=None)])
def test_a_profile_name_that_is_not_a_str_is_refused(make):
    with pytest.raises(ValueError, match=r"LatencyProfile.name must be a str \(the model's name, or \"\"\), got"):
        make()
    assert fit_profile([1, 2], [3.5, 4.0], name="medium").name == "medium"


def test_exp3_takes_feedback_for_a_pick_not_a_bare_model_index():
    """The update divides by the chance the model had when picked, which a bare index does not carry;
    a chance select never gives (below its exploration floor gamma / n_models) is refused by name."""
    sel = Exp3(4, gamma=0.2)
    with pytest.raises(ValueError, match=r"pick must be the Pick that select\(\) returned .* got 1"):
        sel.update(1, 0.5)
    for p in (0.0, 0.01, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"pick.probability \(the chance select gave it, at least gamma / "
                                             r"n_models\) must be a finite number in \[0.05, 1\]"):
            sel.update(Pick(1, p), 0.5)
    before = sel.probabilities()
    sel.update(sel.select(), 0.5)
    assert not np.array_equal(before, sel.probabilities())


def test_a_numpy_duration_is_no_number_and_a_narrow_float_is_compared_without_overflow():
    """numpy files timedelta64 under its integers, so a duration passed the number checks and escaped
    as numpy's UFuncTypeError from the bound's comparison; a float16 latency of 65504 was compared
    with the 30-year bound cast to float16, an overflow warning."""
    prof, td = LatencyProfile(2.0, 0.5), np.timedelta64(5)
    for call in (lambda: AIMD(td), lambda: AIMD(20.0, margin=td), lambda: AIMD(20.0).observe(1, td),
                 lambda: QuantileRegression(20.0, refit_every=td), lambda: LatencyProfile(td, 0.5),
                 lambda: simulate_queue(prof, 100.0, 20, max_batch=4, delay_ms=td),
                 lambda: simulate_queue(prof, 100.0, 20, max_batch=4, seed=td), lambda: Exp3(3, gamma=td)):
        with pytest.raises(ValueError, match=r"got 5 \(timedelta64\)"):
            call()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctl = AIMD(20.0)
        assert ctl.observe(1, np.float16(65504)) == 1
        assert answer_at_deadline(["a"], [1.0], [1.0], np.float16(65504), Exp4(1), 0.0).output == 1.0


def test_a_zero_dimensional_array_is_no_per_model_list():
    """A 0-d array has __len__ and __getitem__ but no length, so it passed the per-model list check
    and escaped as numpy's TypeError 'len() of unsized object'."""
    ens = Exp4(1)
    for call, name in ((lambda: ens.update(np.array(0.5)), "losses"), (lambda: ens.combine(np.array(3.0)), "predictions"),
                       (lambda: ens.vote(np.array("cat")), "labels")):
        with pytest.raises(ValueError, match=rf"{name} must be a list of one .* per model \(1\), got array\("):
            call()
    for args, name in (((np.array("a"), [5.0], [1.0]), "names"), ((["a"], np.array(5.0), [1.0]), "predictions"),
                       ((["a"], [5.0], np.array(True)), "arrival_ms")):
        with pytest.raises(ValueError, match=rf"{name} must be a list with one entry per model \(1\), got array\("):
            answer_at_deadline(*args, 10.0, Exp4(1), -1.0)


@pytest.mark.parametrize("x, y", [([1, 2, 10**400], [1.0, 2.0, 3.0]), ([1, 2, 3], [1.0, 2.0, 10**400])])
def test_a_measurement_past_any_float_is_refused_as_not_finite(x, y):
    """An int no float holds made the conversion of the measurements escape as OverflowError."""
    for fit in (lambda: fit_line(x, y, 0.5), lambda: fit_line(x, y), lambda: fit_profile(x, y)):
        with pytest.raises(ValueError, match="batch sizes and latencies must be finite numbers"):
            fit()


@pytest.mark.parametrize("latencies", [["1", "2"], [True, False], [True, 2.0], {}, 1 + 0j, [1.0, 10**400]])
def test_a_controller_trace_built_by_hand_takes_latencies_that_are_numbers_only(latencies):
    """Latencies were converted with float(): strings and bools became numbers silently, a dict or a
    complex escaped as TypeError, an int past any float as OverflowError."""
    with pytest.raises(ValueError, match="latencies_ms must be finite numbers >= 0"):
        ControllerTrace(np.array([1, 2]), latencies)


_PROFILE = LatencyProfile(3.0, 0.5)
_TRACE = ControllerTrace(np.array([2]), np.array([4.0]))


@pytest.mark.parametrize("call, msg", [
    # an SLO that is no positive time, at every door that takes one
    *[(make, rf"slo_ms( \(the SLO\))? must be a finite number of milliseconds > 0, got {got}")
      for slo, got in ((-1.0, "-1.0"), (0.0, "0.0"), (math.nan, "nan"))
      for make in (lambda slo=slo: AIMD(slo), lambda slo=slo: QuantileRegression(slo),
                   lambda slo=slo: _PROFILE.max_batch(slo), lambda slo=slo: _TRACE.goodput_qps(slo),
                   lambda slo=slo: _TRACE.violation_rate(slo))],
    # a profile from no measurements, or from one batch size
    (lambda: fit_profile([], []), "a line needs measurements at two or more distinct batch sizes, got none"),
    (lambda: fit_line([4, 4], [1.0, 2.0], 0.99), "a line needs measurements at two or more distinct batch sizes"),
    # an arrival rate of 0, below 0 or NaN
    *[(make, rf"rate_qps must be a finite number of requests per second > 0, got {got}")
      for rate, got in ((0, "0"), (-5.0, "-5.0"), (math.nan, "nan"))
      for make in (lambda rate=rate: poisson_arrivals(rate, 3, np.random.default_rng(0)),
                   lambda rate=rate: simulate_queue(_PROFILE, rate, 3, max_batch=2))],
    # an arrival time that is NaN or before time 0
    (lambda: answer_at_deadline(["a", "b"], [1.0, 2.0], [math.nan, 1.0], 10.0, Exp4(2), 0.0),
     r"arrival_ms\[0\] must be a number of milliseconds >= 0, got nan"),
    (lambda: answer_at_deadline(["a", "b"], [1.0, 2.0], [1.0, -1.0], 10.0, Exp4(2), 0.0),
     r"arrival_ms\[1\] must be a number of milliseconds >= 0, got -1.0"),
    # a cache that holds nothing
    (lambda: PredictionCache(0), "capacity_bytes must be an integer >= 1, got 0"),
    (lambda: PredictionCache(-1), "capacity_bytes must be an integer >= 1, got -1"),
    # selection over no models, or with none answering
    (lambda: Exp3(0), "n_models must be an integer >= 1, got 0"),
    (lambda: Exp4(0), "n_models must be an integer >= 1, got 0"),
    (lambda: Exp4(2).combine([None, None]), "no model answered; the caller must fall back to a default output"),
    (lambda: Exp4(2).vote([None, None]), "no model answered; the caller must fall back to a default output"),
    # latency noise that is no relative standard deviation below 0.5
    *[(lambda noise=noise: NoisyLatency(_PROFILE, noise),
       rf"noise \(a relative standard deviation\) must be a finite number in \[0, 0.5\), got {got}")
      for noise, got in ((-0.1, "-0.1"), (0.5, "0.5"), (math.nan, "nan"))]])
def test_what_the_clipper_doors_refuse_most_often_is_named(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


@pytest.mark.parametrize("call, says", [
    (lambda: _PROFILE.latency_ms([True, 2]), r"batch_size must be an integer in \[1, 9223372036854775807\], or a list"),
    (lambda: _PROFILE.latency_ms([[1, 2], [True, 3]]), r"or a list or array of them \(not bools\), got \[\[1, 2\], "),
    (lambda: NoisyLatency(_PROFILE).sample_ms([2, True], np.random.default_rng(0)), r"\(not bools\), got \[2, True\]"),
    (lambda: NoisyLatency(_PROFILE).with_normal([1, 2], [True, 0.0]), r"z must be finite standard-normal draws "
                                                                       r"\(numbers, not bools\)"),
    (lambda: ControllerTrace([True, 2], [1.0, 1.0]), r"batch_sizes must be integers >= 1 \(not bools\)"),
    (lambda: QueueResult([1.0, 1.0, 1.0], [True, 2], [1.0], 5.0),
     r"batch_sizes must be a 1-D array of integers >= 1 that add up to the 3 requests \(not bools\), got \[True, 2\]"),
    (lambda: QueueResult([True, 1.0], [2], [1.0], 5.0), r"latencies_ms must be a non-empty 1-D array of finite "
                                                         r"numbers >= 0 \(one per request; not bools, nor strings\)"),
    (lambda: QueueResult([1.0, 1.0], [2], [True, 1.0], 5.0), r"busy_ms must be a non-empty 1-D array of finite numbers "
                                                             r">= 0 \(one per worker; not bools")])
def test_a_bool_among_numbers_is_refused_as_a_bool_alone_is(call, says):
    """numpy reads [True, 2] as the integers [1, 2]: a bool alone was refused at these doors, one
    beside numbers was taken as a batch of 1 (or a draw, a latency, a busy time of 1)."""
    with pytest.raises(ValueError, match=says):
        call()
