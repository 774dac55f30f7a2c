"""Real torch models behind the container interface, steered by controllers. No timed assertions:
the machine is shared, so these check behaviour (what ran, what the controller did), not speed."""
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import clipper.container as container_module
from clipper import AIMD, FixedBatch, ModelContainer, timed_predict
from clipper.torch_models import Interference, TorchContainer, make_model, measure_profile, run_online
from orca_torch.model.accounting import torch_threads


def test_containers_implement_predict_batch_one_output_per_input():
    for name in ("mlp", "deep-narrow", "token-mlp"):
        m = make_model(name, seed=0)
        assert isinstance(m, ModelContainer)
        x = m.example_inputs(5, seed=1)
        out = m.predict_batch(x)
        rows = m.predict_batch([x[i] for i in range(5)])       # a list of inputs works the same
        assert len(out) == 5 and torch.allclose(torch.stack(out), torch.stack(rows))
        # batching does not change the answer: each row equals the input alone
        assert torch.allclose(out[3], m.predict_batch(x[3:4])[0], atol=1e-5)
    a, b = make_model("mlp", seed=0), make_model("mlp", seed=0)
    x = a.example_inputs(2)
    assert torch.equal(torch.stack(a.predict_batch(x)), torch.stack(b.predict_batch(x)))


def test_measure_profile_times_each_real_batch_and_fits_its_lines(monkeypatch):
    # a fake clock (no wall time): each predict_batch really runs and advances it by 3 ms + 0.02 ms per
    # input, one timed batch by 40 ms more (a descheduled spell), so the fit must give the line back
    m = make_model("deep-narrow")
    now, seen = [0.0], []
    forward = m.predict_batch

    def predict_batch(inputs):
        seen.append(len(inputs))
        now[0] += (3.0 + 0.02 * len(inputs) + (40.0 if len(seen) == 3 + 7 else 0.0)) / 1000.0
        return forward(inputs)

    monkeypatch.setattr(m, "predict_batch", predict_batch)
    monkeypatch.setattr(container_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    mp = measure_profile(m, [512, 1, 128, 128], reps=5, warmup=1)
    assert seen[:3] == [1, 128, 512]                          # warmup, not timed
    timed = seen[3:]
    assert mp.batch_sizes.tolist() == timed and len(timed) == 15
    assert all(sorted(timed[r:r + 3]) == [1, 128, 512] for r in range(0, 15, 3))   # interleaved, each rep
    assert timed != sorted(timed) and timed != [1, 128, 512] * 5                    # in a seeded order
    assert mp.latencies_ms == pytest.approx([3.0 + 0.02 * b + (40.0 if i == 6 else 0.0) for i, b in enumerate(timed)])
    assert (mp.median.a_ms, mp.median.b_ms) == pytest.approx((3.0, 0.02))          # the spike ignored
    assert mp.mean.a_ms + mp.mean.b_ms * 128 > mp.median.a_ms + mp.median.b_ms * 128  # the mean pulled up
    tail, median = ([p.a_ms + p.b_ms * b for b in (1, 128, 512)] for p in (mp.tail, mp.median))
    assert all(t >= md - 1e-9 for t, md in zip(tail, median))
    assert max(t - md for t, md in zip(tail, median)) > 1.0   # the P90 line feels the spike
    assert m.n_items == (1 + 128 + 512) * (5 + 1)             # every timed batch really ran


def test_run_online_draws_the_inputs_its_batches_reach_not_the_controllers_cap(monkeypatch):
    # AIMD(cap=100000) used to draw 100,000 inputs up front (800 MB for token-mlp); each batch is still
    # the first b of the seeded inputs
    m = make_model("mlp")
    drawn, batches = [], []
    draw = m.example_inputs

    def example_inputs(n, seed=0):
        drawn.append(n)
        return draw(n, seed)

    def injected(container, inputs):
        batches.append(inputs.clone())
        return timed_predict(container, inputs)[0], 1.0

    monkeypatch.setattr(m, "example_inputs", example_inputs)
    run = run_online(m, AIMD(20.0, start=5, cap=100_000), 40, measure=injected, seed=3)
    assert run.trace.batch_sizes.tolist() == list(range(5, 45))
    assert max(drawn) < 2 * 44 and len(drawn) <= 6                    # doubling, not the cap
    assert all(torch.equal(x, draw(len(x), 3)) for x in batches)


def test_example_inputs_are_the_first_of_one_seeded_sequence_at_any_width():
    for in_dim in (1, 10, 17, 64):
        c = TorchContainer("t", nn.Linear(in_dim, 1), in_dim)
        for n, k in ((2, 1), (300, 7), (33, 32)):
            x = c.example_inputs(n, seed=4)
            assert x.shape == (n, in_dim) and torch.equal(x[:k], c.example_inputs(k, seed=4))
        assert not torch.equal(c.example_inputs(3, seed=4), c.example_inputs(3, seed=5))


def test_aimd_batches_are_executed_and_it_reacts_to_observed_latency():
    m = make_model("mlp")
    slow_from = 12

    def injected(container, inputs):                          # run for real, report a synthetic time
        outputs, _ = timed_predict(container, inputs)
        return outputs, 30.0 if len(inputs) > slow_from else 5.0

    run = run_online(m, AIMD(20.0, cap=64), 80, measure=injected)
    tr = run.trace
    assert run.items_executed == tr.batch_sizes.sum() == m.n_items == run.outputs_checked
    assert tr.batch_sizes[:slow_from].tolist() == list(range(1, slow_from + 1))
    assert tr.batch_sizes[20:].max() <= slow_from + 1 and tr.batch_sizes[20:].min() >= 0.9 * slow_from - 1
    # the same run with a latency that never misses grows to the cap
    m2 = make_model("mlp")
    run2 = run_online(m2, AIMD(20.0, cap=64), 80, measure=lambda c, x: (timed_predict(c, x)[0], 1.0))
    assert run2.trace.batch_sizes[-1] == 64


def test_interference_runs_only_in_its_window_and_is_bounded(monkeypatch):
    """The first batch of the window waits until the interference has done a matmul (its tanh is
    watched): a thread the machine is slow to schedule is not taken for one that never ran."""
    m = make_model("mlp")
    inter = Interference(1, size=64, max_seconds=60.0)
    seen, worked, tanh = [], threading.Event(), torch.tanh

    def watched_tanh(x):
        if threading.current_thread().name.startswith("interference-"):
            worked.set()
        return tanh(x)

    monkeypatch.setattr(torch, "tanh", watched_tanh)

    def measure(container, inputs):                           # note whether the threads run
        seen.append(inter.running)
        if inter.running:
            assert worked.wait(60), "the interference did no matmul in 60 s"
        return timed_predict(container, inputs)

    run = run_online(m, FixedBatch(8), 30, interference=inter, window=(10, 20), measure=measure)
    assert seen == [False] * 10 + [True] * 10 + [False] * 10
    assert run.interference_matmuls > 0 and not inter.running
    again = run_online(m, FixedBatch(8), 3, interference=inter, window=(0, 3))
    assert again.interference_matmuls == inter.n_matmuls - run.interference_matmuls   # this run's, not the sum
    short = Interference(1, size=64, max_seconds=0.05)
    short.start()
    short._threads[0].join(60)                                # stops by itself without stop()
    assert not short.running


def test_what_an_interference_thread_raises_is_raised_by_stop(monkeypatch):
    def broken(x):
        raise MemoryError("no room for the product")

    monkeypatch.setattr(torch, "tanh", broken)
    inter = Interference(2, size=8, max_seconds=5.0)
    inter.start()
    for t in inter._threads:                                  # each dies at its first tanh (a stop() sent
        t.join(5)                                             # sooner, on a busy machine, finds none run)
    with pytest.raises(RuntimeError, match=r"an interference thread failed: MemoryError\('no room for the product'\)"):
        inter.stop()
    assert not inter.running
    monkeypatch.undo()
    tanh = torch.tanh

    def one_and_stop(x):                                      # a matmul done, then the threads told to stop:
        inter._stop.set()                                     # no race of stop() against their first one
        return tanh(x)

    monkeypatch.setattr(torch, "tanh", one_and_stop)
    inter.start()                                             # the failure is not raised twice
    for t in inter._threads:
        t.join(5)
    inter.stop()
    assert inter.n_matmuls >= 1


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown torch model 'resnet'; choose one of 'mlp', 'deep-narrow', "
                                         "'token-mlp'"):
        make_model("resnet")
    m = make_model("mlp")
    with pytest.raises(ValueError, match=r"mlp: inputs must be vectors of length 128 of finite real numbers, "
                                         r"got shape \(2, 3\)"):
        m.predict_batch(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="mlp: predict_batch needs at least one input"):
        m.predict_batch([])
    with pytest.raises(ValueError, match="a profile needs two or more distinct batch sizes"):
        measure_profile(m, [4, 4])
    with pytest.raises(ValueError, match="give both an Interference and its window of batches, or neither"):
        run_online(m, FixedBatch(2), 5, window=(1, 2))
    with pytest.raises(AssertionError):       # (its callers' doors check the count: --threads, lab.api)
        with torch_threads(0):
            pass
    with pytest.raises(ValueError, match="controller asked for a batch of 8, above the input pool of 4; give the "
                                         "controller a cap, or run_online a larger pool_size"):
        run_online(m, FixedBatch(8), 2, pool_size=4)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda' asked for, but torch.cuda.is_available\(\) is False"):
            make_model("mlp", device="cuda")
