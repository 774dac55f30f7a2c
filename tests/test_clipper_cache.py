"""Prediction cache: CLOCK order, byte bound, in-flight sharing (lecture §2.1)."""
import sys
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from clipper import CachedModel, PredictionCache, ToyModel, get_toy_profile
from clipper.cache import nbytes_of
from clipper.torch_models import MODEL_BUILDERS, make_model


class _Echo:
    name = "echo"

    def predict_batch(self, inputs):
        return list(inputs)


def _cache(n_entries: int, entry_bytes: int = 8) -> PredictionCache:
    return PredictionCache(n_entries * entry_bytes, size_of=lambda v: entry_bytes)


def _put(c, x, v="v"):
    fut, owner = c.fetch("m", x)
    assert owner
    c.put("m", x, v)
    return fut


def test_clock_gives_a_referenced_entry_a_second_chance():
    c = _cache(3)
    for x in "ABC":
        _put(c, x)
    assert c.fetch("m", "A")[1] is False           # hit: sets A's reference bit
    _put(c, "D")                                    # hand at A: bit set -> cleared, passed; B evicted
    assert [k in c for k in (c.key("m", x) for x in "ABCD")] == [True, False, True, True]
    _put(c, "E")                                    # ring now C, A(clear), D: C goes
    assert [k in c for k in (c.key("m", x) for x in "ACDE")] == [True, False, True, True]
    _put(c, "F")                                    # A lost its bit last sweep and was not used since
    assert c.key("m", "A") not in c
    assert c.stats.evictions == 3 and c.stats.hits == 1


def test_hits_return_the_stored_value_and_keys_include_the_model():
    c = PredictionCache(1000)
    _put(c, np.arange(4.0), 42.0)
    fut, owner = c.fetch("m", np.arange(4.0))
    assert not owner and fut.result() == 42.0
    assert c.fetch("other-model", np.arange(4.0))[1] is True      # same input, other model: a miss
    assert c.fetch("m", np.arange(4))[1] is True                   # other dtype: another input


def test_in_flight_duplicates_share_one_computation():
    c = PredictionCache(1000)
    f1, o1 = c.fetch("m", "x")
    f2, o2 = c.fetch("m", "x")
    assert (o1, o2) == (True, False) and f1 is f2 and not f1.done()
    c.put("m", "x", 7)
    assert f1.result() == 7 == f2.result()
    assert c.stats.misses == 1 and c.stats.shared == 1


def test_a_waiter_cancelling_the_shared_future_takes_the_answer_from_no_one():
    """A caller that gives up on a shared computation (a deadline, as the ensemble's) cancels its future:
    the owner's put must still reach the other waiters and be stored, not leave a cancelled future
    answering every later lookup with CancelledError."""
    c = PredictionCache(1000)
    owner_future, _ = c.fetch("m", "x")
    waiter_future, _ = c.fetch("m", "x")
    assert waiter_future.cancel() is False
    c.put("m", "x", 7)
    assert owner_future.result(timeout=5) == 7
    later, owner = c.fetch("m", "x")
    assert owner is False and later.result(timeout=5) == 7 and c.stats.hits == 1


@pytest.mark.parametrize("outcome", ["put", "fail"])
def test_a_done_callback_may_use_the_cache(outcome):
    """Futures complete after the cache's lock is released: a done-callback that looks the cache up
    (chaining one answer to the next query) must not wait forever on the lock its put holds."""
    c = PredictionCache(1000)
    fut, _ = c.fetch("m", "x")
    seen = []
    fut.add_done_callback(lambda f: seen.append((c.key("m", "x") in c, c.fetch("m", "y")[1])))
    finish = (lambda: c.put("m", "x", 7)) if outcome == "put" else (lambda: c.fail("m", "x", RuntimeError("no")))
    t = threading.Thread(target=finish, daemon=True)
    t.start()
    t.join(30)          # (a deadlock never ends; the callback takes microseconds)
    assert not t.is_alive() and seen == [(outcome == "put", True)]


def test_pending_entries_are_never_evicted_and_hold_no_bytes():
    c = _cache(2)
    fut, _ = c.fetch("m", "slow")
    for x in "ABC":
        _put(c, x)
    assert not fut.done() and c.nbytes <= 16
    c.put("m", "slow", 1)
    assert c.key("m", "slow") in c and fut.result() == 1 and c.nbytes <= 16


def test_a_value_larger_than_the_cache_is_returned_but_not_stored():
    c = PredictionCache(10, size_of=len)
    fut, _ = c.fetch("m", "x")
    c.put("m", "x", "y" * 11)
    assert fut.result() == "y" * 11 and c.key("m", "x") not in c and c.nbytes == 0
    assert c.stats.too_large == 1


def test_failure_reaches_every_waiter_and_forgets_the_key():
    c = PredictionCache(100)
    f1, _ = c.fetch("m", "x")
    f2, _ = c.fetch("m", "x")
    c.fail("m", "x", RuntimeError("boom"))
    for f in (f1, f2):
        with pytest.raises(RuntimeError, match="boom"):
            f.result()
    assert c.fetch("m", "x")[1] is True
    _put(c, "y", "kept")
    stored = c.nbytes
    c.fail("m", "y", RuntimeError("late"))            # a stored value is not thrown away
    assert c.key("m", "y") in c and c.nbytes == stored > 0
    assert c.fetch("m", "y")[0].result() == "kept"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 40), st.booleans()), min_size=1, max_size=80))
def test_bytes_never_exceed_the_capacity(ops):
    c = PredictionCache(64, size_of=lambda v: v[1])
    stored = {}
    for x, size, complete in ops:
        fut, owner = c.fetch("m", x)
        if owner and complete:
            c.put("m", x, (x, size))
            stored[x] = size
        assert c.nbytes <= 64
        assert c.nbytes == sum(s for k, s in stored.items() if c.key("m", k) in c)


def test_a_second_put_of_a_stored_key_keeps_the_stored_value_and_counts_its_bytes_once():
    """Two callers may compute the same input (one that put without fetching first, or a racing one):
    the value stored first stays, the one its waiters got, and its 5 bytes count once, not 5 + 7."""
    c = PredictionCache(100, size_of=len)
    first = _put(c, "x", "first")
    c.put("m", "x", "second!")
    fut, owner = c.fetch("m", "x")
    assert not owner and fut.result(timeout=1) == first.result(timeout=1) == "first"
    assert (c.nbytes, len(c)) == (5, 1)


def test_the_sweep_evicts_past_many_pending_and_referenced_entries():
    n = 100
    c = PredictionCache(n, size_of=lambda v: v)
    for i in range(n):                                # pending and stored entries, alternating on the ring
        c.fetch("m", f"pending {i}")
        c.fetch("m", f"stored {i}")
        c.put("m", f"stored {i}", 1)
    for i in range(n):
        c.fetch("m", f"stored {i}")                   # every stored entry referenced
    c.fetch("m", "new")
    c.put("m", "new", n)
    assert c.nbytes == n and c.key("m", "new") in c and c.stats.evictions == n


def test_a_view_is_counted_with_the_buffer_it_keeps_alive():
    rows = np.zeros((1000, 10))
    assert nbytes_of(rows[0]) == rows.nbytes
    held = [rows[0], rows[1], rows]                   # one buffer, counted once
    assert nbytes_of(held) == rows.nbytes + sys.getsizeof(held)
    t = torch.zeros(1000, 10)
    rows = list(t.unbind(0))
    assert nbytes_of(t[0]) == 40_000 and nbytes_of(rows) == 40_000 + sys.getsizeof(rows)
    assert nbytes_of(t[0].clone()) == 40


def test_a_torch_container_answers_rows_of_their_own():
    m = make_model(next(iter(MODEL_BUILDERS)))
    cm = CachedModel(m, PredictionCache(400))
    out = cm.predict_batch(list(m.example_inputs(1000, seed=1)))
    kept = {e.future.result().untyped_storage().data_ptr(): e.future.result().untyped_storage().nbytes()
            for e in cm.cache._ring.values()}
    assert cm.cache.nbytes == sum(kept.values()) <= 400 and len(out) == 1000


def test_cached_model_runs_each_distinct_input_once():
    model = ToyModel("toy", get_toy_profile("medium"), dim=3)
    cm = CachedModel(model, PredictionCache(10_000))
    x, y = [1.0, 2.0, 3.0], [0.0, 1.0, 0.0]
    out = cm.predict_batch([x, y, x, x])
    assert model.n_items == 2 and out[0] == out[2] == out[3] == model.predict_batch([x])[0]
    cm.predict_batch([y, x])
    assert model.n_items == 3                      # the direct call above; the cache served the rest


def test_concurrent_queries_for_one_input_compute_it_once():
    gate = threading.Event()

    class Slow:
        name = "slow"
        calls = 0

        def predict_batch(self, inputs):
            Slow.calls += 1
            gate.wait(60)
            return [sum(v) for v in inputs]

    cm = CachedModel(Slow(), PredictionCache(1000))
    results = []
    threads = [threading.Thread(target=lambda: results.append(cm.predict_batch([(1, 2)]))) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    try:
        while cm.cache.stats.misses + cm.cache.stats.shared < 4:
            assert time.monotonic() < deadline, f"the 4 queries did not all reach the cache in 60 s: {cm.cache.stats}"
            threading.Event().wait(0.001)
    finally:
        gate.set()
    for t in threads:
        t.join(5)
    assert Slow.calls == 1 and results == [[3]] * 4


def test_bad_inputs():
    with pytest.raises(ValueError, match="capacity_bytes must be an integer >= 1, got 0"):
        PredictionCache(0)
    c = PredictionCache(10, size_of=lambda v: -1)
    fut, _ = c.fetch("m", "x")
    says = "size_of must return an integer number of bytes >= 0, but it returned -1"
    with pytest.raises(ValueError, match=says):
        c.put("m", "x", 1)
    with pytest.raises(ValueError, match=says):  # the waiters hear of it too: nothing hangs
        fut.result(timeout=1)
    assert c.fetch("m", "x")[1] is True
    with pytest.raises(ValueError, match="^t: predict_batch needs at least one input$"):
        CachedModel(ToyModel("t", get_toy_profile("medium")), c).predict_batch([])


def test_outputs_that_are_containers_are_counted_with_their_contents():
    class Embed:
        name = "embed"

        def predict_batch(self, inputs):
            return [{"emb": np.zeros(10**6)} for _ in inputs]

    cm = CachedModel(Embed(), PredictionCache(100_000))
    for i in range(20):
        cm.predict_batch([i])
    assert cm.cache.nbytes <= 100_000 and len(cm.cache) == 0 and cm.cache.stats.too_large == 20
    big = np.zeros(1000)
    assert nbytes_of({"emb": big}) >= 8000 and nbytes_of((big, np.ones(1000))) >= 16_000
    assert 8000 <= nbytes_of([big, big]) < 16_000                    # one array held twice is stored once
    assert nbytes_of([{"t": torch.zeros(500)}]) >= 2000
    loop = []
    loop.append(loop)
    assert nbytes_of(loop) > 0                                       # a cycle ends


@pytest.mark.parametrize("x", [torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([1 + 2j]).conj(),
                               torch.tensor([1.0, 2.0])._neg_view(), torch.tensor([1 + 2j]).conj().imag,
                               torch.tensor(3.0, dtype=torch.bfloat16)])
def test_tensors_numpy_cannot_read_directly_are_cache_keys(x):
    echo = CachedModel(_Echo(), PredictionCache(10_000))
    assert torch.equal(echo.predict_batch([x])[0], x)
    assert echo.cache.fetch("echo", x.clone())[1] is False               # equal values: a hit
    if x.dtype == torch.bfloat16:
        assert echo.cache.fetch("echo", x.float())[1] is True           # same numbers, other dtype: a miss
        assert echo.cache.fetch("echo", x.reshape(1, -1))[1] is True     # other shape: a miss


class _Sum:
    name = "sum"

    def predict_batch(self, xs):
        return [float(x.sum()) for x in xs]


def test_a_tensor_and_an_array_of_equal_values_are_different_keys():
    echo = CachedModel(_Echo(), PredictionCache(10_000))
    t, a = torch.tensor([1.0, 2.0]), np.array([1.0, 2.0], np.float32)
    assert isinstance(echo.predict_batch([t])[0], torch.Tensor)
    assert isinstance(echo.predict_batch([a])[0], np.ndarray)
    assert echo.cache.stats.misses == 2


def test_masked_arrays_with_other_masks_are_different_keys():
    cm = CachedModel(_Sum(), PredictionCache(10_000))
    values = [1.0, 2.0, 3.0]
    whole, masked = np.ma.masked_array(values, mask=[0, 0, 0]), np.ma.masked_array(values, mask=[1, 0, 0])
    assert cm.predict_batch([whole]) == [6.0]
    assert cm.predict_batch([masked]) == [5.0]                          # not the first one's answer
    assert cm.predict_batch([np.ma.masked_array(values, mask=[1, 0, 0])]) == [5.0]
    assert (cm.cache.stats.misses, cm.cache.stats.hits) == (2, 1)


def test_cached_answers_are_shared_objects():
    cm = CachedModel(_Echo(), PredictionCache(10_000))
    first = cm.predict_batch([[1, 2]])[0]
    assert cm.predict_batch([[1, 2]])[0] is first                     # no copy per hit (read-only, as documented)


def test_arrays_of_equal_bytes_and_shape_but_another_dtype_are_different_keys():
    # zeros of int64 and of float64 are the same 16 bytes; a model may answer them differently
    ints, floats = np.zeros(2, np.int64), np.zeros(2, np.float64)
    assert ints.tobytes() == floats.tobytes()
    assert PredictionCache.key("m", ints) != PredictionCache.key("m", floats)
    echo = CachedModel(_Echo(), PredictionCache(10_000))
    assert echo.predict_batch([ints])[0].dtype == np.int64
    assert echo.predict_batch([floats])[0].dtype == np.float64


def test_a_row_of_a_masked_batch_is_counted_with_the_buffer_it_keeps_alive():
    # a masked array's row is a view of a view (row -> the masked array's data -> the batch)
    batch = np.zeros((1000, 10))
    row = np.ma.masked_array(batch)[0]
    assert nbytes_of(row) == batch.nbytes
