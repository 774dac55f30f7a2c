"""Straggler mitigation: the answer leaves at the deadline (lecture §2.1)."""
import threading
import time

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


def test_real_ensemble_answers_at_the_deadline_without_the_straggler():
    gate = threading.Event()
    models = [_Model("fast", 1.0), _Model("straggler", 100.0, gate), _Model("broken", 5.0, fail=True)]
    with StragglerEnsemble(models, Exp4(3), deadline_ms=200.0, default=0.0) as ens:
        t0 = time.perf_counter()
        ans = ens.predict("x")
        waited = time.perf_counter() - t0
        gate.set()
    assert ans.used == ("fast",) and set(ans.missed) == {"straggler", "broken"}
    assert ans.output == 1.0 and not ans.is_default
    assert waited < 5.0                               # it did not wait for the 10 s straggler


def test_real_ensemble_falls_back_to_the_default_and_returns_early_when_all_answer():
    gate = threading.Event()
    with StragglerEnsemble([_Model("s1", 1.0, gate), _Model("s2", 2.0, gate)], Exp4(2), 50.0, "default") as ens:
        ans = ens.predict("x")
        gate.set()
    assert ans.is_default and ans.output == "default" and ans.missed == ("s1", "s2")
    with StragglerEnsemble([_Model("a", 1.0), _Model("b", 3.0)], Exp4(2), 10_000.0, 0.0) as ens:
        t0 = time.perf_counter()
        ans = ens.predict("x")
        assert time.perf_counter() - t0 < 5.0         # all answered: no waiting out the deadline
    assert ans.output == pytest.approx(2.0) and ans.confidence == pytest.approx(1.0)


def test_a_straggler_s_backlog_does_not_hold_up_the_fast_model():
    """Queried again and again, the slow model is not sent calls while its oldest is past the
    deadline: the fast one answers every time, in time."""
    with StragglerEnsemble([_Model("fast", 1.0, seconds=0.001), _Model("slow", 9.0, seconds=1.0)], Exp4(2),
                           deadline_ms=100.0, default="default") as ens:
        answers = [ens.predict("x") for _ in range(20)]
    assert all(a.used == ("fast",) and a.output == 1.0 for a in answers)


def test_callers_in_parallel_are_all_answered_by_containers_that_keep_up():
    """Several threads at once: a container busy for a moment is not a straggler; every call is
    answered by both (each container serves its calls one at a time, in order)."""
    from concurrent.futures import ThreadPoolExecutor
    with StragglerEnsemble([_Model("a", 1.0, seconds=0.01), _Model("b", 3.0, seconds=0.01)], Exp4(2),
                           deadline_ms=2000.0, default="default") as ens:
        with ThreadPoolExecutor(8) as callers:
            answers = list(callers.map(ens.predict, range(80)))
    assert all(a.used == ("a", "b") and not a.is_default for a in answers)
    with pytest.raises(RuntimeError, match="closed"):
        ens.predict("x")


def test_bad_inputs():
    with pytest.raises(ValueError, match="deadline_ms"):
        answer_at_deadline(["a"], [1.0], [1.0], 0.0, Exp4(1), 0.0)
    with pytest.raises(ValueError, match="one entry per model"):
        answer_at_deadline(["a", "b"], [1.0], [1.0], 5.0, Exp4(2), 0.0)
    with pytest.raises(ValueError, match="weighs 2 models"):
        StragglerEnsemble([_Model("a", 1.0)], Exp4(2), 10.0, 0.0)
