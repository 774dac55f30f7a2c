"""A memory manager of the caller's through `api` (`memory=`): the run is the one `Engine` makes
stepped one iteration at a time over the same manager, on the paper GPU (where the fast engine
steps a manager it does not know one step a call) and on the torch model, and the project's own
managers given so run as the systems that name them."""
from __future__ import annotations

import numpy as np
import pytest

from orca_torch.core.engine import Engine
from orca_torch.core.memory import ReservationMemory, TokenMemory
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.lab import api
from orca_torch.lab.workload import make_workload
from orca_torch.sim.executors import CostModelExecutor
from memory_managers import HalfReservation


def _same_run(a, b):
    assert np.array_equal(a.token_step, b.token_step) and np.array_equal(a.step_end, b.step_end)
    assert np.array_equal(a.n_preemptions, b.n_preemptions)
    assert np.array_equal(a.step_reserved, b.step_reserved) and np.array_equal(a.step_used, b.step_used)


def test_a_new_memory_manager_on_the_paper_gpu_runs_as_engine_stepped_one_iteration_at_a_time():
    kw = dict(n_requests=150, rate=24.0, seed=3)
    res = api.run("chat", max_bs=64, n_slots=20_000, memory=HalfReservation, **kw)
    stepped = Engine(CostModelExecutor("llama-3-8b", "h100"), HalfReservation(20_000),
                     SchedulerConfig(max_bs=64)).run(make_workload("chat", max_context=8192, **kw))
    _same_run(res, stepped)
    assert res.n_preemptions.sum() > 0          # it ran out and preempted: not Orca's reservation in disguise


def test_a_new_memory_manager_is_sized_by_the_card_when_n_slots_is_not_given():
    from orca_torch.sim.hw_model import kv_capacity_tokens

    res = api.run("chat", 8.0, 60, model="opt-13b", gpu="a100-40gb", memory=HalfReservation)
    stepped = Engine(CostModelExecutor("opt-13b", "a100-40gb"), HalfReservation(kv_capacity_tokens("opt-13b", "a100-40gb")),
                     SchedulerConfig(max_bs=256)).run(make_workload("chat", n_requests=60, rate=8.0, seed=0,
                                                                     max_context=2048))
    _same_run(res, stepped)


@pytest.mark.parametrize("memory, system", [(ReservationMemory, "orca-max"), (TokenMemory, "orca-ondemand"),
                                            (PagedMemory, "paged")])
def test_the_projects_own_manager_given_as_memory_runs_as_the_system_that_names_it(memory, system):
    kw = dict(workload="chat", rate=24.0, n_requests=120, max_bs=32, n_slots=12_000)
    _same_run(api.run(memory=memory, **kw), api.run(system=system, **kw))
    g = dict(n_requests=40, rel_tol=0.2, lo=1.0, hi=64.0, n_slots=12_000)
    assert api.goodput(memory=memory, **g) == api.goodput(system=system, **g)


@pytest.mark.parametrize("memory, system", [(HalfReservation, None), (PagedMemory, "paged")])
def test_a_new_memory_manager_runs_on_the_torch_model(memory, system):
    """The K/V tensors hold every request at once (a paged manager's pool mirrored), whatever the
    manager admits: one that preempts runs to the end."""
    kw = dict(workload=[Request(i, 0.0, 60, 40) for i in range(6)], model="tiny", executor="torch",
              clock="iterations", max_bs=4, n_slots=320)
    res = api.run(memory=memory, **kw)
    assert res.n == 6 and res.n_preemptions.sum() > 0
    if system is not None:
        _same_run(res, api.run(system=system, **kw))
