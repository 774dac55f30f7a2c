"""Real torch models behind the container interface, steered by controllers. No timed assertions:
the machine is shared, so these check behaviour (what ran, what the controller did), not speed."""
import threading

import pytest
import torch

from clipper import AIMD, FixedBatch, ModelContainer, timed_predict
from clipper.torch_models import Interference, make_model, measure_profile, run_online
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


def test_measured_profile_has_a_positive_fixed_cost_and_slope():
    # deep-narrow: 32 layers of dispatch per batch (a clear `a`), 512 inputs per big batch (a clear `b`);
    # the median line ignores the odd descheduled batch of a shared machine
    m = make_model("deep-narrow")
    with torch_threads(1):
        mp = measure_profile(m, [1, 128, 512], reps=5, warmup=1)
    assert mp.median.a_ms > 0 and mp.median.b_ms > 0
    assert mp.tail.b_ms > 0 and mp.mean.b_ms > 0
    assert sorted(set(mp.batch_sizes.tolist())) == [1, 128, 512] and mp.latencies_ms.size == 15
    assert m.n_items == (1 + 128 + 512) * (5 + 1)             # every timed batch really ran


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
    inter.start()                                             # the failure is not raised twice
    inter.stop()
    assert inter.n_matmuls > 0


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown torch model"):
        make_model("resnet")
    m = make_model("mlp")
    with pytest.raises(ValueError, match="vectors of length 128"):
        m.predict_batch(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="at least one input"):
        m.predict_batch([])
    with pytest.raises(ValueError, match="two or more distinct"):
        measure_profile(m, [4, 4])
    with pytest.raises(ValueError, match="both an Interference"):
        run_online(m, FixedBatch(2), 5, window=(1, 2))
    with pytest.raises(ValueError, match="n must be"):
        with torch_threads(0):
            pass
    with pytest.raises(ValueError, match="input pool"):
        run_online(m, FixedBatch(8), 2, pool_size=4)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda' asked for, but torch.cuda.is_available\(\) is False"):
            make_model("mlp", device="cuda")
