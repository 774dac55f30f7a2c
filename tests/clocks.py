"""The clock most engine tests run on: every step lasts exactly 1, so times count iterations."""
from __future__ import annotations

import numpy as np

from orca_torch.sim.executors import StepTimeExecutor


def iteration_clock() -> StepTimeExecutor:
    """A step lasts 1, and so does each of a run of decode steps priced at once (`many`), which
    keeps the fast engine on its bulk path."""
    return StepTimeExecutor(lambda t: 1.0, lambda k, c, m: np.ones(m))
