"""Straggler mitigation: the answer leaves at the deadline (lecture §2.1)."""
import math
import threading
import time

import numpy as np
import pytest

from clipper import Exp4, StragglerEnsemble, answer_at_deadline


def test_deadline_rule_uses_the_arrived_predictions_or_the_default():
    ens = Exp4(3)
    ens.update([0.0, 0.5, 1.0])
    w = ens.weights()
    a = answer_at_deadline(["a", "b", "c"], [1.0, 2.0, 9.0], [3.0, 8.0, 50.0], 10.0, ens, default=-1.0)
    assert a.used == ("a", "b") and a.missed == ("c",) and not a.is_default
    assert a.output == pytest.approx((w[0] * 1 + w[1] * 2) / (w[0] + w[1]))
    assert a.confidence == pytest.approx(w[0] + w[1])
    late = answer_at_deadline(["a", "b", "c"], [1.0, 2.0, 9.0], [30.0, 80.0, 50.0], 10.0, ens, default=-1.0)
    assert late.is_default and late.output == -1.0 and late.confidence == 0.0 and late.used == ()


def test_a_model_that_never_answered_arrives_at_infinity():
    """An arrival time of inf was refused as not finite, though 'never arrived' is what it says."""
    a = answer_at_deadline(["a", "b"], [1.0, 2.0], [3.0, math.inf], 10.0, Exp4(2), default=-1.0)
    assert a.used == ("a",) and a.missed == ("b",) and a.output == 1.0 and a.confidence == 0.5
    none = answer_at_deadline(["a", "b"], [1.0, 2.0], [math.inf, math.inf], 10.0, Exp4(2), default=-1.0)
    assert none.is_default and none.missed == ("a", "b")


class _Model:
    def __init__(self, name, value, gate=None, fail=False, seconds=0.0):
        self.name, self.value, self.gate, self.fail, self.seconds = name, value, gate, fail, seconds

    def predict_batch(self, inputs):
        time.sleep(self.seconds)
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("model crashed")
        return [self.value for _ in inputs]


def _deadline_after_the_free_calls(monkeypatch, ens):
    """The ensemble's wait for its deadline begins once the calls of its models not held at a closed
    gate are back (up to 10 s): a loaded machine cannot make them late, and a held call still
    misses the deadline."""
    import clipper.straggler as straggler
    real_wait = straggler.wait

    def wait(fs, timeout):
        held = {f for m, calls in zip(ens.models, ens._unanswered)
                if m.gate is not None and not m.gate.is_set() for _, f in calls}
        real_wait([f for f in fs if f not in held], 10)
        return real_wait(fs, timeout)
    monkeypatch.setattr(straggler, "wait", wait)


def test_real_ensemble_answers_at_the_deadline_without_the_straggler(monkeypatch):
    """The straggler's call waits (up to 10 s) for a gate opened only once the answer is back: had
    the answer waited for it, its call would have finished first."""
    straggler = _Counted("straggler", 100.0, threading.Event())
    models = [_Model("fast", 1.0), straggler, _Model("broken", 5.0, fail=True)]
    with StragglerEnsemble(models, Exp4(3), deadline_ms=50.0, default=0.0) as ens:
        _deadline_after_the_free_calls(monkeypatch, ens)
        ans = ens.predict("x")
        assert straggler.calls == 1 and straggler.finished == 0     # it did not wait for the straggler
        straggler.gate.set()
    assert ans.used == ("fast",) and set(ans.missed) == {"straggler", "broken"}
    assert ans.output == 1.0 and not ans.is_default


def test_real_ensemble_falls_back_to_the_default_and_returns_early_when_all_answer():
    gate = threading.Event()
    with StragglerEnsemble([_Model("s1", 1.0, gate), _Model("s2", 2.0, gate)], Exp4(2), 50.0, "default") as ens:
        ans = ens.predict("x")
        gate.set()
    assert ans.is_default and ans.output == "default" and ans.missed == ("s1", "s2")
    with StragglerEnsemble([_Model("a", 1.0), _Model("b", 3.0)], Exp4(2), 60_000.0, 0.0) as ens:
        t0 = time.perf_counter()
        ans = ens.predict("x")
        assert time.perf_counter() - t0 < 30.0        # all answered: no waiting out the 60 s deadline
    assert ans.output == pytest.approx(2.0) and ans.confidence == pytest.approx(1.0)


class _Counted(_Model):
    """A `_Model` whose calls it counts, started and finished."""

    def __init__(self, name, value, gate=None):
        super().__init__(name, value, gate)
        self.calls = self.finished = 0

    def predict_batch(self, inputs):
        self.calls += 1
        out = super().predict_batch(inputs)
        self.finished += 1
        return out


def test_a_straggler_is_not_sent_calls_until_it_catches_up(monkeypatch):
    """Queried again and again, the slow model is not sent calls while its oldest is past the
    deadline (its backlog stays bounded), the fast one answers every time; once the slow one has
    caught up it is used again. The slow one's first call waits for a gate, opened after the 20
    queries: no race with the clock but the deadline's own."""
    fast, slow = _Counted("fast", 1.0), _Counted("slow", 9.0, threading.Event())
    with StragglerEnsemble([fast, slow], Exp4(2), deadline_ms=50.0, default="default") as ens:
        _deadline_after_the_free_calls(monkeypatch, ens)
        answers = [ens.predict("x") for _ in range(20)]
        assert all(a.used == ("fast",) and not a.is_default for a in answers)
        assert slow.calls == 1 and fast.calls == 20
        assert len(ens._unanswered[1]) == 1                      # not 20 calls queued behind the first
        slow.gate.set()                                           # it catches up
        ens._unanswered[1][0][1].result(timeout=10)
        assert slow.finished == slow.calls == 1
        assert ens.predict("x").used == ("fast", "slow") and slow.calls == 2


def test_callers_still_waiting_when_the_ensemble_closes_get_an_answer():
    """Model "a" holds its first call until all 8 are queued behind it and the ensemble is closed; the
    deadline (60 s) is far beyond what serving them takes, so a default answer means a call was
    dropped or never ran."""
    from concurrent.futures import ThreadPoolExecutor
    held = _Model("a", 1.0, threading.Event())
    ens = StragglerEnsemble([held, _Model("b", 3.0)], Exp4(2), deadline_ms=60_000.0, default="default")
    with ThreadPoolExecutor(8) as callers:
        pending = [callers.submit(ens.predict, i) for i in range(8)]
        limit = time.monotonic() + 60
        while len(ens._unanswered[0]) < 8:      # "a" answers none before the gate opens
            assert time.monotonic() < limit, "the 8 calls were not all sent"
            time.sleep(0.01)
        ens.close()                             # (the calls queued are still served)
        held.gate.set()
        answers = [p.result(timeout=120) for p in pending]
    assert all(a.used == ("a", "b") and not a.is_default for a in answers)


class _Blocked(_Model):
    """A `_Model` whose calls wait for its `gate`; it counts the calls it starts."""

    def __init__(self, name):
        super().__init__(name, 1.0, gate=threading.Event())
        self.started, self.finished, self.calls = threading.Event(), threading.Event(), 0

    def predict_batch(self, inputs):
        self.calls += 1
        self.started.set()
        out = super().predict_batch(inputs)
        self.finished.set()
        return out


def test_a_call_nobody_waits_for_is_dropped_and_close_does_not_wait_for_a_running_one(monkeypatch):
    """The second call is sent while the first runs (the ensemble's clock stands still, so the first
    is never past the deadline); its caller gives up at the deadline, so it is never run. close()
    returns while the first still runs (the interpreter would wait for that one at exit: a running
    call cannot be interrupted)."""
    import types

    import clipper.straggler as straggler
    monkeypatch.setattr(straggler, "time", types.SimpleNamespace(perf_counter=lambda: 0.0))
    m = _Blocked("slow")
    ens = StragglerEnsemble([m], Exp4(1), deadline_ms=50.0, default="default")
    first = threading.Thread(target=ens.predict, args=("x",))
    first.start()
    assert m.started.wait(10)
    assert ens.predict("y").is_default
    assert [f.cancelled() for _, f in ens._unanswered[0]] == [False, True]     # sent, then dropped
    first.join(10)
    ens.close()
    assert not m.finished.is_set()              # close() returned while the first call still ran
    m.gate.set()
    ens._workers[0].shutdown(wait=True)         # the worker runs what is queued, then ends
    assert m.finished.is_set() and m.calls == 1  # (the second would have run once the first returned)


def test_callers_in_parallel_are_all_answered_by_containers_that_keep_up():
    """Several threads at once: a container busy for a moment is not a straggler; every call is
    answered by both (each container serves its calls one at a time, in order). The deadline (60 s)
    is far beyond what serving them takes, loaded machine or not."""
    from concurrent.futures import ThreadPoolExecutor
    with StragglerEnsemble([_Model("a", 1.0, seconds=0.01), _Model("b", 3.0, seconds=0.01)], Exp4(2),
                           deadline_ms=60_000.0, default="default") as ens:
        with ThreadPoolExecutor(8) as callers:
            answers = list(callers.map(ens.predict, range(80)))
    assert all(a.used == ("a", "b") and not a.is_default for a in answers)
    with pytest.raises(RuntimeError, match="closed"):
        ens.predict("x")


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"deadline_ms must be a finite number of milliseconds in \(0, [0-9.e+]+\], "
                                         "got 0.0"):
        answer_at_deadline(["a"], [1.0], [1.0], 0.0, Exp4(1), 0.0)
    with pytest.raises(ValueError, match=r"names, predictions and arrival_ms need one entry per model \(2\), "
                                         "got 2, 1, 1"):
        answer_at_deadline(["a", "b"], [1.0], [1.0], 5.0, Exp4(2), 0.0)
    with pytest.raises(ValueError, match="the policy weighs 2 models but 1 were given"):
        StragglerEnsemble([_Model("a", 1.0)], Exp4(2), 10.0, 0.0)


def test_a_model_answering_nan_or_a_label_counts_as_failed_and_the_others_answer():
    models = [_Model("good", 2.0), _Model("nan", math.nan), _Model("label", "cat"), _Model("inf", [1.0, math.inf])]
    with StragglerEnsemble(models, Exp4(4), deadline_ms=60_000.0, default="default") as ens:
        ans = ens.predict("x")
    assert ans.used == ("good",) and ans.missed == ("nan", "label", "inf")
    assert ans.output == 2.0 and ans.confidence == pytest.approx(0.25) and not ans.is_default
    with StragglerEnsemble([_Model("nan", math.nan), _Model("label", "cat")], Exp4(2), 60_000.0, "default") as ens:
        ans = ens.predict("x")
    assert ans.is_default and ans.output == "default" and ans.missed == ("nan", "label")


def test_a_model_answering_another_shape_counts_as_missed_beside_the_heaviest():
    policy = Exp4(3)
    policy.update([0.0, 1.0, 1.0])              # "pair" weighs the most: its shape is the answer's
    models = [_Model("pair", [1.0, 2.0]), _Model("scalar", 3.0), _Model("pair2", [3.0, 4.0])]
    with StragglerEnsemble(models, policy, deadline_ms=60_000.0, default="default") as ens:
        ans = ens.predict("x")
    assert ans.used == ("pair", "pair2") and ans.missed == ("scalar",) and np.shape(ans.output) == (2,)


def test_the_answer_s_shape_is_the_heaviest_answering_model_s_when_their_shares_round_to_zero():
    """Both answering models trail the failed leader by 760 and 800 losses: their weights round to 0
    beside it, yet "scalar" (e^40 heavier than "pair") gives the shape, not whichever came first."""
    policy = Exp4(3)
    for _ in range(800):
        policy.update([0.0, 1.0, 0.95])
    assert policy.weights()[1] == policy.weights()[2] == 0.0
    models = [_Model("lead", 0.0, fail=True), _Model("pair", [1.0, 2.0]), _Model("scalar", 3.0)]
    with StragglerEnsemble(models, policy, deadline_ms=60_000.0, default="default") as ens:
        ans = ens.predict("x")
    assert ans.used == ("scalar",) and ans.missed == ("lead", "pair") and ans.output == 3.0


def test_a_prediction_arriving_at_the_deadline_itself_is_in_time():
    a = answer_at_deadline(["a", "b"], [1.0, 3.0], [10.0, 10.000001], 10.0, Exp4(2), default=-1.0)
    assert a.used == ("a",) and a.missed == ("b",) and a.output == 1.0


def test_the_wait_ends_at_the_deadline_counted_from_the_call_not_from_the_sending(monkeypatch):
    """A call that spent 8 ms of its 10 ms on the lock and sending waits 2 ms more, not 10 (a fake clock)."""
    import types

    import clipper.straggler as straggler
    clock = iter([100.0])
    monkeypatch.setattr(straggler, "time", types.SimpleNamespace(perf_counter=lambda: next(clock, 100.008)))
    timeouts = []
    real_wait = straggler.wait
    monkeypatch.setattr(straggler, "wait", lambda fs, timeout: timeouts.append(timeout) or real_wait(fs, timeout))
    with StragglerEnsemble([_Model("a", 1.0)], Exp4(1), deadline_ms=10.0, default=0.0) as ens:
        assert ens.predict("x").output == 1.0
    assert timeouts == [pytest.approx(0.002)]
