"""What calibration measures, and what both fits share: one measured step (`StepSample`), its checks,
and how far a fitted model is from measured steps (`FitErrors`).

A `StepSample` is one step's `StepTotals` and its median seconds; `measure_steps` (`measure`) makes them
by timing the torch model, `samples_from_rows` from anyone's table of measured steps. The roofline fit
(`roofline_fit`) and the refined one (`refined_fit`) check their samples here and judge themselves by
`FitErrors`. docs/paper-gpu.md ("GPU profiles and calibration") shows where this sits.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from orca_torch.checks import GOT_LIMIT, brief, check_instance, check_items, check_list, check_real
from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.sim.hw_model.roofline import check_totals
from orca_torch.specs import ModelSpec, get_model_spec


# ---- one measured step ---------------------------------------------------------------------------

@dataclass(frozen=True)
class StepSample:
    """One measured step: what it was (`label`), its totals, its median seconds, and (when
    `measure_steps` took it) the shapes of the model it ran."""

    label: str
    totals: StepTotals
    seconds: float
    spec: ModelSpec | None = field(default=None, repr=False, compare=False)


STEP_SECONDS = (1e-12, 1e6)
"""The step times a fit takes: a picosecond to 11 days. Far outside, the fit's columns (FLOPs / seconds)
overflow a float; nothing measured is."""


def _check_seconds(name: str, v) -> float:
    """A step time: a finite number > 0 within `STEP_SECONDS`."""
    secs = check_real(name, v, 0.0, lo_open=True)
    lo, hi = STEP_SECONDS
    if not lo <= secs <= hi:
        raise ValueError(f"{name} must be a step time in [{lo:g}, {hi:g}] s, got {secs!r}")
    return secs


def check_samples(samples: Sequence[StepSample], where: Callable[[int, StepSample], str] =
                  lambda i, s: f"sample {brief(s.label)}") -> list[StepSample]:
    """The samples as a list, each a `StepSample` with a positive finite time, totals a real step could
    have (`hw_model.roofline.check_totals`) and at least one request; numbers stored as plain Python ones.
    An error names the sample by `where(index, sample)`."""
    if isinstance(samples, StepSample):
        raise ValueError("samples must be a list of StepSample items, got one StepSample")
    out = []
    for i, s in enumerate(check_list("samples", samples, "StepSample items")):
        if not isinstance(s, StepSample):
            raise ValueError(f"samples must be StepSample items, got {type(s).__name__}")
        secs = _check_seconds(f"{where(i, s)}: seconds", s.seconds)
        totals = check_totals(s.totals, where(i, s))
        if totals.n_seqs < 1:
            raise ValueError(f"{where(i, s)}: a measured step needs at least one request")
        out.append(s if type(s.seconds) is float and totals is s.totals
                   else dataclasses.replace(s, seconds=secs, totals=totals))
    return out


def describe(mix: Sequence[SeqWork]) -> str:
    """A short label: 'prefill 128 + decode 8 x ctx 256'."""
    mix = check_items("mix", mix, SeqWork)
    parts = []
    for (n_new, n_past), c in Counter((w.n_new, w.n_past) for w in mix).items():
        if n_past == 0:
            parts.append(f"prefill {n_new}" if c == 1 else f"prefill {c} x {n_new}")
        elif n_new == 1:
            parts.append(f"decode {c} x ctx {n_past + 1}")
        else:
            parts.append(f"chunk {c} x {n_new} after {n_past}")
    return " + ".join(parts)


def step_kind(sample: StepSample) -> str:
    """What kind of step `sample` is: "decode" when every request in it adds one token, "prefill"
    when its one request adds several (a prompt, or a chunk of one), "mixed" otherwise (several
    requests, not all decoding). The measured-vs-predicted tables and plots group steps by it."""
    t = check_instance("sample", sample, StepSample).totals
    if t.n_tokens == t.n_seqs:
        return "decode"
    return "prefill" if t.n_seqs == 1 else "mixed"


def samples_from_rows(rows: Sequence[tuple], label: str = "step") -> list[StepSample]:
    """`StepSample`s from (works or totals, seconds) rows: any table of measured steps."""
    rows = check_list("rows", rows, "(SeqWork list or StepTotals, seconds) rows")
    if not isinstance(label, str):
        raise ValueError(f"label must be a str, got {brief(label)} ({type(label).__name__})")
    out = []
    for i, row in enumerate(rows):
        if not (isinstance(row, (tuple, list)) and len(row) == 2):
            raise ValueError(f"row {i} must be (SeqWork list or StepTotals, seconds), got {brief(row)}")
        what, secs = row
        if isinstance(what, StepTotals):
            out.append(StepSample(f"{label} {i}", what, secs))
        elif isinstance(what, (list, tuple)) and what and all(isinstance(w, SeqWork) for w in what):
            out.append(StepSample(describe(list(what)), StepTotals.of(what), secs))
        else:
            raise ValueError(f"row {i}: the step must be a non-empty SeqWork list or a StepTotals, got {brief(what)}")
    return check_samples(out, lambda i, s: f"row {i}")


# ---- what both fits share ------------------------------------------------------------------------

IDENTIFIED_SHIFT = 0.01
"""A fitted rate counts as identified when halving it (a refined card's: `refined_fit`) or doubling
it (`roofline_fit.fit`'s, which one-sided steps bound from below) moves some fitted step's
predicted time by this much: a rate below that sensitivity is one the steps bound from one side only
(its term costs ~nothing on every step, or a max() always picks the other side), and the fit alone
leaves it wherever it stopped: each fit gives instead about the slowest rate the steps allow."""


class FitErrors:
    """How far a fitted model's `predict` is from measured steps: the fitted `samples` by default, or
    held-out ones (shared by `Calibration` and `RefinedFit`)."""

    samples: tuple[StepSample, ...]

    def predict(self, totals: StepTotals | Sequence[SeqWork]) -> float:
        raise NotImplementedError

    def rel_errors(self, samples: Sequence[StepSample] | None = None) -> np.ndarray:
        """(predicted - measured) / measured for `samples` (default: those fitted)."""
        samples = self.samples if samples is None else check_samples(samples)
        return np.array([self.predict(s.totals) / s.seconds - 1.0 for s in samples])

    def median_abs_error(self, samples: Sequence[StepSample] | None = None) -> float:
        """Median |relative error| over `samples` (default: those fitted); NaN for none."""
        e = self.rel_errors(samples)
        return float(np.median(np.abs(e))) if len(e) else math.nan


def samples_model(samples: Sequence[StepSample], model: ModelSpec | str | None, default: str | None) -> ModelSpec:
    """The model the fit prices `samples` on: `model`, else the one `measure_steps` recorded on them, else
    `default`. A sample recorded on another model is refused: its FLOPs and bytes would be counted on
    shapes it never ran."""
    specs = {s.spec for s in samples if s.spec is not None}
    if len(specs) > 1:
        named = sorted(m.name + _differs(m, specs) for m in specs)
        raise ValueError(f"the samples were measured on different models ({', '.join(named)}); "
                         "fit the steps of one model")
    if model is None:
        if not specs and default is None:
            raise ValueError("give model=: the samples do not carry the model they were measured on "
                             "(measure_steps records it; samples built by hand do not)")
        return specs.pop() if specs else get_model_spec(default)
    spec = get_model_spec(model)
    if specs and spec not in specs:
        m = specs.pop()
        raise ValueError(f"model={brief(spec.name)}{_differs(spec, [m])}, but the samples were measured on "
                         f"{m.name}{_differs(m, [spec])}; give that model (or leave model out)")
    return spec


def _differs(spec: ModelSpec, others: Iterable[ModelSpec]) -> str:
    """The fields in which `spec` differs from another spec of its name (' (dtype_bytes=2)': a model
    converted to bfloat16 beside its preset), else nothing: the name alone tells them apart."""
    diff = sorted({f.name for t in others if t.name == spec.name and t != spec for f in dataclasses.fields(spec)
                   if getattr(spec, f.name) != getattr(t, f.name)})
    return f" ({', '.join(f'{k}={brief(getattr(spec, k), GOT_LIMIT)}' for k in diff)})" if diff else ""


def check_fit_context(spec: ModelSpec, samples: Sequence[StepSample]) -> None:
    """Refuse a sample whose requests read more K/V than `spec`'s context allows them (on average)."""
    for s in samples:
        t = s.totals
        if t.kv_read_tokens > t.n_seqs * spec.max_context:
            raise ValueError(f"sample {brief(s.label)}: its {t.n_seqs} request(s) read {t.kv_read_tokens} K/V tokens, "
                             f"beyond {spec.name}'s context of {spec.max_context} tokens each")


def check_enough(samples: Sequence, need: int, n_params: int, which: str = "") -> None:
    """Refuse fewer than `need` distinct steps (`StepSample`s or mixes): a step measured twice is one
    equation, not two, so repeats of a few steps would leave parameters free while seeming enough."""
    n = len({s.totals if isinstance(s, StepSample) else StepTotals.of(s) for s in samples})
    if n < need:
        repeats = f" ({len(samples)} samples, some of the same step)" if n < len(samples) else ""
        raise ValueError(f"need at least {need} measured steps to fit {n_params} parameters{which}, "
                         f"got {n} distinct{repeats}")
