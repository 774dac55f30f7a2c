"""Exp3 and Exp4 model selection learning from feedback (lecture §2.1)."""
import numpy as np
import pytest

from clipper import Exp3, Exp4, Pick


def now(sel: Exp3, model: int) -> Pick:
    """A pick of `model` at its chance now (feedback that comes before any other pick)."""
    return Pick(model, float(sel.probabilities()[model]))


def test_exp3_shifts_weight_away_from_a_model_that_starts_failing():
    sel = Exp3(3, eta=0.05, gamma=0.06, rng=np.random.default_rng(0))
    loss_of = lambda t, m: (0.0 if m == 0 else 0.8) if t < 300 else (1.0 if m == 0 else (0.1 if m == 1 else 0.8))
    picks = []
    for t in range(1500):
        pick = sel.select()
        picks.append(pick.model)
        sel.update(pick, loss_of(t, pick.model))
        if t == 299:
            before = sel.probabilities()
    after = sel.probabilities()
    assert before[0] > 0.9                                  # learnt: model 0 is the good one
    assert after[1] > 0.85 and after[0] < 0.05              # then it failed and model 1 took over
    assert np.mean(np.array(picks[1200:]) == 1) > 0.8


def test_both_start_with_every_model_alike():
    # Exp3 and Exp4 start from equal weights: no model is favoured before any feedback
    assert np.allclose(Exp3(4).probabilities(), 0.25, rtol=0, atol=1e-15)
    assert np.allclose(Exp4(3).weights(), 1 / 3, rtol=0, atol=1e-15)


def test_exp3_keeps_exploring_and_importance_weights_rare_picks():
    sel = Exp3(4, eta=0.1, gamma=0.2, rng=1)
    for _ in range(500):
        sel.update(now(sel, 0), 1.0)
    p = sel.probabilities()
    assert p.sum() == pytest.approx(1.0) and p.min() >= 0.2 / 4 - 1e-12
    # the update divides the loss by the chance of the pick: a rare model's one loss weighs 1/p
    sel = Exp3(2, eta=0.1, gamma=0.1, rng=2)
    for _ in range(20):
        sel.update(now(sel, 1), 1.0)
    unmix = lambda p: (p - 0.1 / 2) / (1 - 0.1)
    p = sel.probabilities()
    w = unmix(p)
    sel.update(now(sel, 1), 0.5)
    w2 = unmix(sel.probabilities())
    assert p[1] < 0.1
    assert (w2[1] / w2[0]) / (w[1] / w[0]) == pytest.approx(np.exp(-0.1 * 0.5 / p[1]))


def test_exp3_weighs_late_feedback_by_the_chance_the_pick_had():
    """In serving, a request's loss comes back after later requests were routed: the update divides
    by the chance the model had when picked, which later feedback has moved since."""
    sel = Exp3(2, eta=0.5, gamma=0.1, rng=0)
    first = sel.select()                                # both models at 1/2
    assert first.probability == 0.5
    other = 1 - first.model
    sel.update(now(sel, other), 1.0)                    # feedback on another pick moves the chances
    assert sel.probabilities()[first.model] > 0.5
    unmix = lambda p: (p - 0.1 / 2) / (1 - 0.1)
    w = unmix(sel.probabilities())
    sel.update(first, 1.0)
    w2 = unmix(sel.probabilities())
    ratio = (w2[first.model] / w2[other]) / (w[first.model] / w[other])
    assert ratio == pytest.approx(np.exp(-0.5 * 1.0 / 0.5))    # by the pick's 1/2, not its chance now


def test_exp4_ensemble_learns_the_weights_and_beats_its_worst_member():
    rng = np.random.default_rng(3)
    ens = Exp4(3, eta=0.5)
    bias = np.array([0.05, 1.0, -0.6])
    ens_loss, member_loss = [], np.zeros(3)
    for _ in range(300):
        y = rng.normal()
        preds = [y + b + 0.05 * rng.normal() for b in bias]
        out = ens.combine(preds)
        ens_loss.append(min(1.0, (out.output - y) ** 2))
        losses = [min(1.0, (p - y) ** 2) for p in preds]
        member_loss += losses
        ens.update(losses)
    w = ens.weights()
    assert w[0] > 0.99 and w.sum() == pytest.approx(1.0)
    assert np.mean(ens_loss[-100:]) < 0.02
    assert np.sum(ens_loss) < member_loss[1:].min()


def test_exp4_combine_renormalises_over_the_models_that_answered_and_votes():
    ens = Exp4(3, eta=1.0)
    ens.update([0.0, 1.0, 0.5])                       # weights proportional to 1, e^-1, e^-0.5
    w = ens.weights()
    c = ens.combine([1.0, None, 3.0])
    assert c.output == pytest.approx((w[0] * 1 + w[2] * 3) / (w[0] + w[2]))
    assert c.confidence == pytest.approx(w[0] + w[2]) and c.used == (0, 2)
    v = ens.vote(["cat", "dog", "dog"])
    assert v.output == "cat" and v.confidence == pytest.approx(w[0])
    same = Exp4(3).vote([np.int64(1), 1, 2])          # one label, however each model spells it
    assert same.output == 1 and type(same.output) is np.int64 and same.confidence == pytest.approx(2 / 3)
    arr = ens.combine([np.array([1.0, 0.0]), np.array([0.0, 1.0]), None])
    assert arr.output == pytest.approx(np.array([w[0], w[1]]) / (w[0] + w[1]))


def test_exp4_answers_from_the_models_that_answered_when_their_share_rounds_to_zero():
    """800 rounds of loss 1 against 0 leave a model e^-800 of the leader's weight, which rounds to 0:
    when the leader straggles, the others are still weighed among themselves (the answer was NaN,
    and the vote went to whichever label came first)."""
    ens = Exp4(3)
    for _ in range(800):
        ens.update([0.0, 1.0, 0.9])                  # model 2 ends e^80 heavier than model 1
    assert ens.weights()[1] == 0.0
    c = ens.combine([None, 5.0, 1.0])
    assert c.output == pytest.approx(1.0) and c.used == (1, 2) and c.confidence < 1e-300
    assert ens.combine([None, 5.0, None]).output == 5.0
    v = ens.vote([None, "cat", "dog"])
    assert v.output == "dog" and v.confidence == ens.weights()[2]


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"n_models must be an integer >= 1, got 0"):
        Exp3(0)
    with pytest.raises(ValueError, match=r"gamma \(the exploration share\) must be a finite number in \[1e-09, 1\], "
                                         r"got 0.0"):
        Exp3(2, gamma=0.0)
    with pytest.raises(ValueError, match=r"eta must be a finite number in \(0, 1000\], got -1"):
        Exp4(2, eta=-1)
    sel = Exp3(2)
    loss_rule = r"loss \(scale feedback into \[0, 1\]\) must be a finite number in \[0, 1\], got "
    with pytest.raises(ValueError, match=loss_rule + "1.5"):
        sel.update(Pick(0, 0.5), 1.5)
    with pytest.raises(ValueError, match=r"pick.model \(an index\) must be an integer in \[0, 1\], got 2"):
        sel.update(Pick(2, 0.5), 0.5)
    ens = Exp4(2)
    with pytest.raises(ValueError, match=r"expected one prediction \(or None for a missing one\) per model: 2, got 1"):
        ens.combine([1.0])
    with pytest.raises(ValueError, match="no model answered; the caller must fall back to a default output"):
        ens.combine([None, None])
    with pytest.raises(ValueError, match=loss_rule + "-0.1"):
        ens.update([0.5, -0.1])


def test_exp4_scales_each_loss_by_its_learning_rate():
    ens = Exp4(2, eta=0.5)
    ens.update([1.0, 0.0])                            # weights proportional to e^-0.5 and 1
    assert ens.weights()[0] == pytest.approx(np.exp(-0.5) / (1 + np.exp(-0.5)))


def test_exp3_picks_are_fixed_by_its_seed():
    def picks(seed):
        sel, out = Exp3(3, eta=0.2, gamma=0.1, rng=seed), []
        for _ in range(200):
            p = sel.select()
            sel.update(p, 0.9 if p.model == 0 else 0.1)
            out.append(p.model)
        return out
    assert picks(7) == picks(7) and picks(7) != picks(8)
    assert picks(7) == picks(np.random.default_rng(7))       # a seed and a generator made from it agree
