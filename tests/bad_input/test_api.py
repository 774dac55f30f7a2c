"""The one-call API: refusals count as misses in goodput, the caller's requests are never changed,
settings that would do nothing are refused, the paper GPU's settings are reachable, and a replayed
trace has a goodput."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from orca_torch.lab import api
from orca_torch.lab.metrics import goodput_search, summarize
from orca_torch.core.request import Request, Status
from orca_torch.lab.workload import at_rate, chat
from orca_torch.sim.hw_model import get_gpu
from memory_managers import HalfReservation


def _state(reqs):
    return [(dataclasses.asdict(r), r.status, r.n_generated) for r in reqs]


# ---- goodput bisects on attainment over SUBMITTED requests -------------------------------------

def test_goodput_counts_refused_requests_as_misses():
    kw = dict(n_requests=80, max_context=2048, reject_invalid=True)
    g = api.goodput(rel_tol=0.05, lo=0.5, hi=64, **kw)
    assert g.attainment == "slo_attainment_submitted"
    rate, att = g.evaluations[-1]
    m = summarize(api.run(rate=rate, **kw))
    assert m.n_rejected > 0 and att == m.slo_attainment_submitted < m.slo_attainment
    served = goodput_search(lambda r: summarize(api.run(rate=r, **kw)).slo_attainment, 0.9, 0.5, 64, 0.05)
    assert att == pytest.approx(m.slo_attainment * m.n_requests / (m.n_requests + m.n_rejected))
    assert g.rate < served.rate          # scoring only the served requests would overstate it


def test_goodput_reports_each_rate_it_tries_and_refuses_a_report_hook_that_is_no_function():
    seen = []
    g = api.goodput("orca", n_requests=20, rel_tol=0.3, lo=0.5, hi=64, on_rate=lambda r, a: seen.append((r, a)))
    assert seen == g.evaluations and len(seen) >= 2
    with pytest.raises(ValueError, match=r"on_rate must be .*\(rate, attainment\) -> None.*got 'print'"):
        api.goodput("orca", n_requests=5, on_rate="print")


# ---- the caller's Request objects are never changed ---------------------------------------------

def test_spf_keeps_the_callers_predictions_and_fills_only_missing_ones():
    reqs = [Request(0, 0.0, 10, 50, predicted_output=1), Request(1, 0.0, 10, 5, predicted_output=1000),
            Request(2, 0.0, 10, 20)]
    before = _state(reqs)
    res = api.run(reqs, system="orca-oracle", order="spf", max_bs=1)
    assert _state(reqs) == before and all(r.status is Status.WAITING for r in reqs)
    first = dict(zip([r.req_id for r in res.requests], res.first_token_s))
    assert first[0] < first[2] < first[1]              # 1 (caller's) < 20 (oracle) < 1000 (caller's)
    assert [r.predicted_output for r in res.requests if r.req_id == 2] == [20.0]
    with pytest.raises(ValueError, match="all 2 requests carry one"):
        api.run(reqs[:2], order="spf", predictor_sigma=0.5)


def test_torch_keeps_the_callers_prompt_ids_and_fills_only_missing_ones():
    reqs = [Request(0, 0.0, 4, 3, prompt_ids=[5, 6, 7, 8]), Request(1, 0.0, 3, 2)]
    before = _state(reqs)
    res = api.run(reqs, system="orca-oracle", model="tiny", executor="torch", clock="iterations")
    assert _state(reqs) == before and reqs[1].prompt_ids is None
    ids = {r.req_id: r.prompt_ids for r in res.requests}
    assert ids[0] == [5, 6, 7, 8] and len(ids[1]) == 3
    again = api.run(reqs, system="orca-oracle", model="tiny", executor="torch", clock="iterations")
    assert again.output_ids == res.output_ids              # the filled-in ids are seeded


def test_run_settings_fill_in_their_own_copies_and_leave_a_list_given_to_engine_as_it_was():
    s = api.RunSettings([Request(0, 0.0, 4, 3), Request(1, 0.0, 3, 2, predicted_output=9.0)], executor="torch",
                        model="tiny", clock="iterations", order="spf")
    ready = s.requests()
    assert all(r.prompt_ids is not None for r in ready) and [r.predicted_output for r in ready] == [3.0, 9.0]
    reqs = [Request(0, 0.0, 4, 3), Request(1, 0.0, 3, 2)]
    before = _state(reqs)
    s.engine(reqs)
    assert _state(reqs) == before


# ---- seeds ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [-1, True, 1.5, "3", None, 2**63, 2**64])
def test_api_refuses_a_seed_outside_the_one_rule(seed):
    for call in (lambda: api.simulate("orca", 1.0, 5, seed=seed), lambda: api.run("chat", 1.0, 5, seed=seed),
                 lambda: api.goodput("orca", n_requests=5, seed=seed),
                 lambda: api.simulate("orca", 1.0, 2, model="tiny", executor="torch", seed=seed)):
        with pytest.raises(ValueError, match=r"seed must be an integer with 0 <= seed < 2\*\*63, got"):
            call()


def test_the_largest_seed_derives_a_second_stream_within_the_rule():
    """spf draws predictions from a second stream (seed + 1, wrapped), which the largest seed must allow."""
    top = 2**63 - 1
    m = api.simulate("orca", 1.0, 5, seed=top, order="spf", predictor_sigma=0.5)
    assert m == api.simulate("orca", 1.0, 5, seed=top, order="spf", predictor_sigma=0.5) and m.n_requests == 5


@pytest.mark.parametrize("model, says", [(None, "got None (NoneType)"), (5, "got 5 (int)"), ("gpt-9", "unknown model")])
def test_a_model_that_is_not_a_preset_name_gets_the_list_of_presets(model, says):
    with pytest.raises(ValueError, match=rf"{re.escape(says)}.*known presets: .*llama-3-8b"):
        api.simulate("orca", 1.0, 5, model=model)


def test_the_largest_seed_runs_on_torch():
    reqs = [Request(0, 0.0, 4, 3), Request(1, 0.5, 3, 2)]
    top = api.run(reqs, model="tiny", executor="torch", clock="iterations", seed=2**63 - 1)
    zero = api.run(reqs, model="tiny", executor="torch", clock="iterations", seed=0)
    assert top.n == 2 and top.output_ids != zero.output_ids   # another model, other prompt ids


# ---- clear errors for missing or wrong objects ---------------------------------------------------

@pytest.mark.parametrize("workload, says", [(None, "workload must be a workload name"), (5, "got 5"),
                                            (Request(0, 0.0, 1, 1), "a list of Request"),
                                            ([Request(0, 0.0, 1, 1), "r"], "item 1 is 'r' (str)"),
                                            ([], "the request list is empty"), ("chats", "unknown workload 'chats'")])
def test_bad_workloads_and_devices_get_a_clear_error(workload, says):
    with pytest.raises(ValueError) as e:
        api.simulate(workload)
    assert says in str(e.value)
    with pytest.raises(ValueError, match="unknown device 'nope'; allowed: cpu, cuda or cuda:N"):
        api.simulate("orca", 1.0, 2, model="tiny", executor="torch", device="nope")
    with pytest.raises(ValueError, match="unknown executor 'fpga'; choose one of 'cost', 'torch'"):
        api.simulate("orca", 1.0, 2, executor="fpga")


# ---- one rule for numbers -------------------------------------------------------------------------

def test_numpy_numbers_work_and_bools_are_refused():
    a = api.simulate("orca", np.int64(8), np.int64(20), max_bs=np.int64(64), slo_ttft_s=np.float64(1.0))
    b = api.simulate("orca", 8.0, 20, max_bs=64)
    assert a == b and a.n_requests == 20
    for kw, says in ((dict(slo_ttft_s=True), r"slo_ttft_s must be a number of seconds > 0, got True \(a bool\)"),
                     (dict(slo_tpot_s=0), r"slo_tpot_s must be a number of seconds > 0, got 0"),
                     (dict(max_bs=True), r"max_bs must be an integer >= 1, got True \(a bool\)"),
                     (dict(n_workers=True), r"n_workers must be an integer in \[1, 1024\], got True"),
                     (dict(n_workers=10**21),
                      r"n_workers must be an integer in \[1, 1024\], got 1000000000000000000000"),
                     (dict(n_slots=2.5), r"n_slots must be an integer in \[1, 2\*\*40\], got 2.5"),
                     (dict(reject_invalid=1), r"reject_invalid must be True or False, got 1"),
                     (dict(chunked_prefill="no"), r"chunked_prefill must be True or False, got 'no'"),
                     (dict(rate=True), r"rate must be a finite number of requests per second > 0, got True"),
                     (dict(n_requests=np.float64(5)), r"n_requests must be an integer >= 1, got 5.0")):
        with pytest.raises(ValueError, match=says):
            api.simulate("orca", **{"rate": 1.0, "n_requests": 5, **kw})
    with pytest.raises(ValueError, match=r"target must be a finite number in \(0, 1\], got True"):
        api.goodput("orca", n_requests=5, target=True)


def test_a_system_given_as_a_numpy_string_runs_and_an_array_of_names_is_refused():
    assert api.simulate("orca", 8.0, 20, system=np.array("orca-pow2")) == api.simulate("orca", 8.0, 20, system="orca-pow2")
    assert isinstance(api.make_memory(np.str_("paged"), 64), api.PagedMemory)
    for system in (np.array(["orca-max", "paged"]), np.array([])):
        with pytest.raises(ValueError, match=r"unknown system .*; choose one of 'orca-max'"):
            api.make_memory(system, 64)


def test_a_progress_or_report_hook_of_the_wrong_arity_is_refused_before_any_run(monkeypatch):
    monkeypatch.setattr(api.FastEngine, "start", lambda *a: pytest.fail("a run started"))
    with pytest.raises(ValueError, match=r"progress must be a function \(finished, total\) or None, called with 2"):
        api.run("orca", 1.0, 3, progress=lambda finished: None)
    monkeypatch.setattr(api, "run", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(ValueError, match=r"on_rate must be a function \(rate, attainment\) -> None or None, called"):
        api.goodput("orca", n_requests=3, on_rate=lambda: None)


# ---- a setting that would do nothing is refused ---------------------------------------------------

def test_a_trace_that_simulate_or_goodput_would_throw_away_is_refused_before_any_run(monkeypatch):
    monkeypatch.setattr(api, "run", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(ValueError, match=r"trace=True keeps every step's batch in the RunResult, which simulate does "
                                         "not return; call run for the trace"):
        api.simulate("orca", 1.0, 3, trace=True)
    with pytest.raises(ValueError, match="which goodput does not return"):
        api.goodput("orca", n_requests=3, trace=True)
    with pytest.raises(ValueError, match="trace must be True or False, got 1"):
        api.simulate("orca", 1.0, 3, trace=1)



def test_settings_the_executor_or_workload_would_ignore_are_refused():
    reqs = chat(n_requests=5, rate=1.0)
    for kw, says in ((dict(clock="wall"), "clock='wall': executor='cost'"),
                     (dict(device="cpu"), "device='cpu': executor='cost'"),
                     (dict(threads=1), "threads=1: executor='cost'"),
                     (dict(workload=reqs, rate=3.0), "rate=3.0: a request list keeps its own arrivals"),
                     (dict(workload=reqs, n_requests=5), "n_requests=5: a request list"),
                     (dict(n_slots=10**6, mem_fraction=0.5), "mem_fraction=0.5: mem_fraction sizes the K/V"),
                     (dict(model="tiny", executor="torch", gpu="a100"), "gpu='a100': these are settings of the "
                                                                         "paper GPU"),
                     (dict(model="tiny", executor="torch", tp=1), "tp=1: these are settings of the paper GPU"),
                     (dict(model="tiny", executor="torch", mem_fraction=0.9), "mem_fraction=0.9"),
                     (dict(order="fcfs", predictor_sigma=0.5), "only applies to order='spf'")):
        with pytest.raises(ValueError, match="leave (it|them|predictor_sigma=None)"):
            api.simulate(**{"workload": "orca", **kw})
        with pytest.raises(ValueError) as e:
            api.simulate(**{"workload": "orca", **kw})
        assert says in str(e.value)
    with pytest.raises(ValueError, match="rate=2.0: goodput searches the rate itself"):
        api.goodput("orca", n_requests=5, rate=2.0)
    with pytest.raises(ValueError, match=r"max_context must be an integer in \[2, 2\*\*40\], got 1.5$"):
        api.simulate("orca", 1.0, 5, max_context=1.5)
    m_oracle = api.simulate("orca", 2.0, 30, order="spf")                  # None: the oracle
    m_zero = api.simulate("orca", 2.0, 30, order="spf", predictor_sigma=0.0)
    assert m_oracle.ttft_mean_s == m_zero.ttft_mean_s and m_zero.n_requests == 30


def test_batches_in_flight_without_pipeline_stages_are_refused():
    for kw, where in ((dict(), "the paper GPU with pp=1 has one"),
                      (dict(model="tiny", executor="torch"), "the torch model in this process has one")):
        with pytest.raises(ValueError, match="n_workers=2: batches in flight need pipeline stages") as e:
            api.simulate("orca", 1.0, 5, n_workers=2, **kw)
        assert where in str(e.value) and "give the paper GPU pp >= 2, or leave n_workers at 1" in str(e.value)
    assert api.simulate("orca", 1.0, 5, n_workers=2, pp=2).n_requests == 5


def test_a_new_policy_is_a_scheduler_subclass():
    from orca_torch.core.scheduler import Scheduler

    class LastInFirstOut(Scheduler):
        def add(self, req):
            super().add(req)
            self.waiting.insert(0, self.waiting.pop())

    assert api.simulate("orca", 8.0, 20, scheduler=LastInFirstOut).n_requests == 20
    with pytest.raises(ValueError, match="scheduler must be a Scheduler subclass .* got 'lifo'"):
        api.simulate("orca", 8.0, 20, scheduler="lifo")


def test_a_torch_run_takes_its_threads_and_gives_the_callers_back():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    try:
        api.run(chat(n_requests=2, rate=1.0, max_context=256), model="tiny", executor="torch", clock="iterations",
                progress=lambda done, total: seen.append(torch.get_num_threads()))
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match=r"threads must be an integer in \[1, "):
        api.simulate("orca", 1.0, 2, model="tiny", executor="torch", threads=0)


def test_attention_on_torch_is_the_models_attention_path():
    """On torch `attention` picks the model's path (split or fused: the same tokens), refused by name
    where the path does not exist (the paper GPU's counting modes included)."""
    from orca_torch.lab.api import RunSettings

    reqs = [Request(i, 0.0, 5, 3) for i in range(3)]
    runs = {a: api.run(reqs, executor="torch", model="tiny", clock="iterations", attention=a) for a in ("split", "fused")}
    assert runs["split"].token_step.tolist() == runs["fused"].token_step.tolist()
    s = RunSettings(reqs, executor="torch", model="tiny", attention="fused")
    assert s.engine(s.requests()).executor.model.attention == "fused"
    for bad in ("causal", "full", 3):
        with pytest.raises(ValueError, match="attention path.*choose one of 'split', 'fused'"):
            api.simulate(reqs, executor="torch", model="tiny", attention=bad)


# ---- the paper GPU's settings are reachable --------------------------------------------------------

def test_paper_gpu_settings_reach_the_pricer():
    base = dict(workload="chat", rate=16.0, n_requests=60, system="orca-oracle")
    ref = api.run(**base)
    d = lambda res: float((res.step_end - res.step_start).sum())  # noqa: E731
    assert d(api.run(**base, attention="causal")) < d(ref)               # the mask halves prefill pairs
    assert d(api.run(**base, flop_efficiency=0.35, bw_efficiency=0.4)) > d(ref)
    slow = api.run(**base, overhead_s=0.01)
    assert float((slow.step_end - slow.step_start).min()) >= 0.01
    assert d(api.run(**base, seq_overhead_s=1e-4)) > d(ref)
    assert d(api.run(**base, count_activations=True)) >= d(ref)
    refined = dict(base, cost_model="refined")      # the tile of 'causal-tiles' attention, the refined default
    assert d(api.run(**refined, attention_tile=16)) != d(api.run(**refined, attention_tile=256))
    assert api.simulate(**base, tp=2).n_requests == 60
    with pytest.raises(ValueError, match=r"bw_efficiency must be a finite number in \(0, 1\], got 2.0"):        # the pricer's own check speaks
        api.run(**base, bw_efficiency=2.0)


def test_paper_gpu_numbers_follow_the_one_rule():
    """numpy numbers simulate as the same Python numbers; a bool is no efficiency or memory share."""
    base = dict(workload="orca", n_requests=20, rate=4)
    assert api.simulate(**base, tp=np.int64(2)) == api.simulate(**base, tp=2)
    bw = np.float32(0.8)
    assert api.simulate(**base, bw_efficiency=bw) == api.simulate(**base, bw_efficiency=float(bw))
    assert api.simulate(**base, mem_fraction=np.float64(0.5)) == api.simulate(**base, mem_fraction=0.5)
    for name in ("mem_fraction", "flop_efficiency", "bw_efficiency"):
        with pytest.raises(ValueError, match=rf"{name} must be a finite number in \(0, 1\], got True \(a bool\)"):
            api.simulate(**base, **{name: True})


def test_cost_model_is_forwarded_only_when_given(monkeypatch):
    seen = []
    real = api.CostModelExecutor

    def spy(model, gpu, **settings):
        seen.append(dict(settings))
        settings.pop("cost_model", None)
        return real(model, gpu, **settings)

    monkeypatch.setattr(api, "CostModelExecutor", spy)
    api.run("orca", 1.0, 5)
    api.run("orca", 1.0, 5, cost_model="refined", pp=2)
    assert seen == [{}, {"pp": 2, "cost_model": "refined"}]


# ---- goodput of a replayed trace --------------------------------------------------------------------

def test_goodput_takes_the_paper_gpus_settings():
    kw = dict(n_requests=60, system="orca-oracle", rel_tol=0.1, lo=0.5, hi=64)
    ref, causal = api.goodput(**kw), api.goodput(**kw, attention="causal")
    for rate, att in causal.evaluations[:2]:
        assert att == summarize(api.run(rate=rate, n_requests=60, system="orca-oracle",
                                        attention="causal")).slo_attainment_submitted
    slow = api.goodput(**kw, overhead_s=0.05)               # 50 ms on every step: far less goodput
    assert slow.rate < ref.rate <= causal.rate
    with pytest.raises(ValueError, match=r"bw_efficiency must be a finite number in \(0, 1\]"):
        api.goodput(**kw, bw_efficiency=0.0)


def test_goodput_of_a_request_list_rescales_its_arrivals():
    reqs = chat(n_requests=60, rate=1.0, seed=3)
    before = _state(reqs)
    g = api.goodput(reqs, rel_tol=0.05, lo=0.5, hi=128)
    assert _state(reqs) == before and 0.5 < g.rate < 128
    for rate, att in g.evaluations[:3]:
        assert att == summarize(api.run(at_rate(reqs, rate))).slo_attainment_submitted
    assert min(a for r, a in g.evaluations if r <= g.rate) >= 0.9
    with pytest.raises(ValueError, match="n_requests=60: a request list keeps its own number"):
        api.goodput(reqs, n_requests=60)
    with pytest.raises(ValueError, match=r"^goodput rescales a request list's arrivals to each rate it tries, and "
                                         r"cannot rescale 2 request\(s\) to a rate: their arrivals span no time$"):
        api.goodput([Request(0, 0.0, 5, 5), Request(1, 0.0, 5, 5)])


@pytest.mark.parametrize("kw, name", [({"target": True}, "target"), ({"lo": True}, "lo"),
                                      ({"rel_tol": True}, "rel_tol"), ({"hi": float("inf")}, "hi"),
                                      ({"target": 1.5}, "target"), ({"lo": 4.0, "hi": 2.0}, "lo < hi")])
def test_goodput_search_refuses_bools_and_bad_bounds(kw, name):
    with pytest.raises(ValueError, match=name):
        goodput_search(lambda r: 1.0, **kw)


def test_goodput_search_refuses_an_attainment_that_is_no_share_and_probes_that_are_no_factors():
    nan_says = r"attainment_at\(256.0\) .* must be a finite number in \[0, 1\], got nan"
    for attainment, says in ((lambda r: float("nan"), nan_says),
                             (lambda r: 2.0, r"in \[0, 1\], got 2.0"), (None, "attainment_at must be a function")):
        with pytest.raises(ValueError, match=says):
            goodput_search(attainment)
    for probes, says in ((5, "probes must be a list of factors"), (["a"], r"probes\[0\] must be a finite number > 0")):
        with pytest.raises(ValueError, match=says):
            goodput_search(lambda r: 1.0, probes=probes)


def test_goodput_search_ends_and_refuses_a_tolerance_it_cannot_bisect_to():
    step = lambda r: 1.0 if r < 3 else 0.0                                   # noqa: E731
    with pytest.raises(ValueError, match=r"rel_tol must be a finite number in \[1e-09, 1\), got 1e-300"):
        goodput_search(step, rel_tol=1e-300)                                 # (1 + 1e-300 == 1: it never ended)
    with pytest.raises(ValueError, match=r"rel_tol must be a finite number in \[1e-09, 1\), got 1e-17"):
        api.goodput("orca", n_requests=20, rel_tol=1e-17)
    g = goodput_search(step, rel_tol=1e-9)
    assert 3 / (1 + 1e-9) <= g.rate < 3 and len(g.evaluations) < 80
    g = goodput_search(step, rel_tol=0.01, probes=(f for f in (0.5, 2.0)))      # a generator is read once
    assert any(r == pytest.approx(g.rate * 0.5) for r, _ in g.evaluations)


def test_goodput_search_bisects_between_bounds_near_the_ends_of_the_float_range():
    step = lambda r: 1.0 if r < 5 else 0.0                                   # noqa: E731
    for lo, hi in ((2.0, 1e308), (1e-320, 1e3)):                 # lo * hi overflows, or underflows to 0
        g = goodput_search(step, lo=lo, hi=hi, probes=())
        assert 5 / 1.01 <= g.rate < 5 and all(lo <= r <= hi for r, _ in g.evaluations)
    tiny = lambda r: 1.0 if r < 1e-310 else 0.0                              # noqa: E731
    for rel_tol in (0.5, 1e-9):
        assert 1e-310 / (1 + rel_tol) <= goodput_search(tiny, lo=5e-324, hi=1e-300, rel_tol=rel_tol).rate < 1e-310


def test_comm_efficiency_without_parallelism_is_refused_as_doing_nothing():
    with pytest.raises(ValueError, match=r"comm_efficiency=0.01: comm_efficiency prices the tensor- and pipeline-"
                                         r"parallel transfers, and with tp = pp = 1 there are none; leave it unset"):
        api.simulate("orca", 2.0, 30, comm_efficiency=0.01)
    slow, fast = (api.simulate("orca", 2.0, 30, tp=2, comm_efficiency=c) for c in (0.05, 1.0))
    assert slow.ttft_mean_s > fast.ttft_mean_s


def test_a_paged_pool_of_any_size_simulates_and_sizes_past_any_machine_are_refused():
    assert api.simulate("orca", 1.0, 5, system="paged", n_slots=10**11).n_requests == 5
    with pytest.raises(ValueError, match=r"n_slots must be an integer in \[1, 2\*\*40\], got"):
        api.simulate("orca", 1.0, 5, system="paged", n_slots=2**70)
    with pytest.raises(ValueError, match=r"predictor_sigma must be a finite number in \[0, 10\], got 1000.0"):
        api.simulate("orca", 1.0, 50, order="spf", predictor_sigma=1000.0)



def test_swapping_on_a_card_without_a_host_link_is_refused_before_any_run():
    """Else a run that never swaps gives figures of swapping on a card that cannot, and one that does
    stops at its first swap, after the work before it."""
    card = dataclasses.replace(get_gpu("h100"), name="no-pcie", host_link_bw=None)
    with pytest.raises(ValueError, match=r"system='paged-swap' swaps K/V over the card's host link, and 'no-pcie' "
                                         r"has none \(GPUSpec.host_link_bw is None\); use system='paged'"):
        api.simulate("orca", 1.0, 5, system="paged-swap", gpu=card, n_slots=10**6)
    assert api.simulate("orca", 1.0, 5, system="paged", gpu=card).n_requests == 5


def test_settings_a_system_or_executor_cannot_take_are_refused_before_any_run():
    for kw, says in ((dict(system="sequential", max_bs=4), "sequential serves one request at a time"),
                     (dict(system="sequential", n_workers=2, pp=2), "got max_bs=1, n_workers=2"),
                     (dict(system="paged", n_workers=3, pp=3), "system='paged' can run out of memory and preempt, "
                                                               "which needs n_workers=1"),
                     (dict(system="sequential", max_bs=True), "max_bs must be an integer >= 1, got True (a bool)"),
                     (dict(system="static", n_workers=2), "static (request-level) batching takes only max_bs"),
                     (dict(system="static", order="spf"), "static (request-level) batching takes only max_bs"),
                     (dict(executor="torch", model="llama-3-8b"), "executor='torch' runs the project's own presets"),
                     (dict(system="orca-fast"), "unknown system 'orca-fast'")):
        with pytest.raises(ValueError) as e:
            api.run("orca", 1.0, 5, **kw)
        assert says in str(e.value)
    with pytest.raises(TypeError, match="unknown option 'max_bss'; the options are order, predictor_sigma, prefill"):
        api.run("orca", 1.0, 5, max_bss=4)
    with pytest.raises(TypeError, match="unknown option 'config'"):          # (a field the settings make)
        api.run("orca", 1.0, 5, config=1)
    with pytest.raises(ValueError, match="unknown system 'bogus'"):
        api.make_memory("bogus", 100)
    for system, static in (("static", False), ("orca-max", True)):
        with pytest.raises(ValueError, match="static is the system's to set"):
            api.make_config(system, 4, static=static)
    assert api.make_config("sequential").max_bs == api.make_config("sequential", 1).max_bs == 1
    assert api.make_config("static", 8).static and api.make_config("static").max_bs == 128


@pytest.mark.parametrize("kw, got", [(dict(max_num_batched_tokens=64), "max_num_batched_tokens=64"),
                                     (dict(chunked_prefill=True), "chunked_prefill=True"),
                                     (dict(max_num_batched_tokens=512, chunked_prefill=True),
                                      "max_num_batched_tokens=512, chunked_prefill=True")])
def test_static_batching_with_a_token_budget_is_refused_as_static_takes_none(kw, got):
    """Not with the budget's own rules (a budget >= max_bs, or one to go with chunked_prefill), which
    the caller would follow only to be refused again: static batching takes no budget at all."""
    with pytest.raises(ValueError) as e:
        api.run("orca", 1.0, 5, system="static", **kw)
    assert str(e.value) == ("static (request-level) batching takes only max_bs: n_workers=1, fcfs, mixed, no token "
                            f"budget (max_num_batched_tokens=None, chunked_prefill=False); got {got}")


@pytest.mark.parametrize("policy", ["Scheduler", "PrefillFirstScheduler"])
def test_a_policy_that_feeds_prompts_whole_refuses_a_prompt_past_the_budget(policy):
    """Given as `scheduler=`, it never cuts a prompt: a prompt past the budget is refused at
    submission, and with reject_invalid=True the others run. The refusal advises chunked_prefill only
    with a policy that chunks or none, as it is refused beside this one (tests/bad_input/test_policy_check.py)."""
    from orca_torch.core import policies

    reqs = [Request(0, 0.0, 50, 5), Request(1, 0.0, 70, 5), Request(2, 0.1, 20, 5)]
    kw = dict(max_bs=4, max_num_batched_tokens=64, scheduler=getattr(policies, policy))
    with pytest.raises(ValueError, match=rf"request 1: a prefill .* of 70 tokens can never fit the step budget "
                                         rf"max_num_batched_tokens=64 \({policy}, given as scheduler=, feeds prompts "
                                         r"whole, and chunked_prefill=True is refused beside it: enable "
                                         r"chunked_prefill with scheduler=ChunkedPrefillScheduler or with "
                                         r"scheduler= left out\)$"):
        api.run(reqs, **kw)
    res = api.run(reqs, reject_invalid=True, **kw)
    assert [r.req_id for r in res.requests] == [0, 2] and [r.req.req_id for r in res.rejected] == [1]
    assert api.run(reqs, **dict(kw, scheduler=policies.ChunkedPrefillScheduler, chunked_prefill=True)).n == 3


def test_a_new_policy_that_feeds_prompts_as_scheduler_does_refuses_a_prompt_past_the_budget_at_submission():
    """A new order alone (`queue_key`) keeps `Scheduler`'s select, admit and prompt_share, which
    never cut a prompt: a prompt past the budget is refused at submission (it stalled the run with a
    RuntimeError that named no setting). A policy that admits its own way is taken at its word (its
    select feeds the rest of a prompt it cut, as ChunkedPrefillScheduler's does)."""
    from orca_torch.core.policies import ChunkedPrefillScheduler
    from orca_torch.core.scheduler import Scheduler

    class LongestPromptFirst(Scheduler):
        def queue_key(self, req):
            return (-req.prompt_len, req.run_index)

    class OwnAdmission(ChunkedPrefillScheduler):
        def prompt_share(self, req, budget):
            return min(req.n_to_feed, budget, 32)

    reqs = [Request(0, 0.0, 50, 5), Request(1, 0.0, 70, 5), Request(2, 0.1, 20, 5)]
    kw = dict(max_bs=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=r"request 1: a prefill .* of 70 tokens can never fit the step budget "
                                         r"max_num_batched_tokens=64 \(LongestPromptFirst, given as scheduler=, feeds "
                                         r"prompts whole \(its admit and prompt_share are Scheduler's\), and "
                                         r"chunked_prefill=True is refused beside it"):
        api.run(reqs, scheduler=LongestPromptFirst, **kw)
    res = api.run(reqs, scheduler=LongestPromptFirst, reject_invalid=True, **kw)
    assert [r.req_id for r in res.requests] == [0, 2] and [r.req.req_id for r in res.rejected] == [1]
    assert api.run(reqs, scheduler=OwnAdmission, chunked_prefill=True, **kw).n == 3


def test_a_new_policy_with_its_own_select_over_schedulers_admission_refuses_a_prompt_past_the_budget():
    """A select of its own that admits through `Scheduler`'s admit and prompt_share (the aging
    example of docs/extending.md, or an order over PrefillFirstScheduler) never cuts a prompt
    either: it stalled the run, every request left waiting, with a RuntimeError that named no setting."""
    import heapq

    from orca_torch.core.policies import PrefillFirstScheduler
    from orca_torch.core.scheduler import Scheduler

    class Reordered(Scheduler):
        def queue_key(self, req):
            return (req.prompt_len,)

        def select(self, batch, ready):
            heapq.heapify(self.waiting)
            super().select(batch, ready)

    class ReorderedPrefillFirst(Reordered, PrefillFirstScheduler):
        pass

    reqs = [Request(0, 0.0, 50, 5), Request(1, 0.0, 70, 5), Request(2, 0.1, 20, 5)]
    kw = dict(max_bs=4, max_num_batched_tokens=64)
    for policy in (Reordered, ReorderedPrefillFirst):
        with pytest.raises(ValueError, match=rf"request 1: a prefill .* of 70 tokens can never fit the step budget "
                                             rf"max_num_batched_tokens=64 \({policy.__name__}, given as scheduler=, "
                                             r"feeds prompts whole \(its admit and prompt_share are Scheduler's\)"):
            api.run(reqs, scheduler=policy, **kw)
        assert api.run(reqs, scheduler=policy, reject_invalid=True, **kw).n == 2


@pytest.mark.parametrize("system, memory", [("paged", "PagedMemory"), ("paged-swap", "PagedMemory"),
                                            ("orca-ondemand", "TokenMemory")])
def test_static_batching_given_as_scheduler_over_memory_that_can_run_out_is_refused_before_the_run(system, memory):
    """It never preempts and frees a batch's memory only at its end: the run stalled, every request
    left waiting, or stopped on an internal assertion (freeing a member a paged pool had preempted)."""
    from orca_torch.core.policies import StaticScheduler

    reqs = [Request(i, 0.0, 100, 50 + 30 * i) for i in range(4)]
    with pytest.raises(ValueError, match=rf"static batching \(StaticScheduler\) keeps a batch's memory until its "
                                         rf"last member finishes and never preempts: .* got {memory}$"):
        api.run(reqs, system=system, n_slots=320, max_bs=4, scheduler=StaticScheduler)
    assert api.run(reqs, system="orca-oracle", n_slots=320, max_bs=4, scheduler=StaticScheduler).n == 4


@pytest.mark.parametrize("knobs, got", [(dict(max_num_batched_tokens=64), "max_num_batched_tokens=64, n_workers=1"),
                                        (dict(n_workers=2, pp=2), "max_num_batched_tokens=None, n_workers=2")])
def test_static_batching_given_as_scheduler_refuses_a_step_budget_and_batches_in_flight(knobs, got):
    """It admits a whole batch at once, prompts whole: under a budget of 64 its first step fed 400
    tokens, and with n_workers=2 the second batch never started (the run equalled n_workers=1)."""
    from orca_torch.core.policies import StaticScheduler

    reqs = [Request(i, 0.0, 100, 5) for i in range(4)]
    with pytest.raises(ValueError, match=rf"StaticScheduler starts a batch only when none is running, whole prompts "
                                         rf"and all, .* it takes max_num_batched_tokens=None and n_workers=1, "
                                         rf"got {got}$"):
        api.run(reqs, max_bs=4, scheduler=StaticScheduler, **knobs)
    assert api.run(reqs, max_bs=4, scheduler=StaticScheduler).step_n_tokens[0] == 400


def test_goodput_refuses_its_bounds_and_seed_before_any_simulation(monkeypatch):
    real, calls = api.Engine.run, []
    monkeypatch.setattr(api.Engine, "run", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    for kw, says in ((dict(lo=-1.0), "lo must be a finite number of requests per second > 0, got -1.0"),
                     (dict(lo=4.0, hi=2.0), "need lo < hi, got lo=4.0, hi=2.0"),
                     (dict(target=0.0), r"target must be a finite number in \(0, 1\], got 0.0"),
                     (dict(seed=-1), r"seed must be an integer with 0 <= seed < 2\*\*63, got -1"),
                     (dict(slo_ttft_s=0.0), "slo_ttft_s must be a number of seconds > 0, got 0.0")):
        with pytest.raises(ValueError, match=says):
            api.goodput("orca", n_requests=5, **kw)
        with pytest.raises(ValueError, match=says):
            api.goodput(chat(n_requests=5, rate=1.0), **kw)
    assert calls == []


@pytest.mark.parametrize("slo, says", [(("abc", 0.05), "slo_ttft_s must be"), ((None, 0.05), "slo_ttft_s must be"),
                                       ((-1.0, 0.05), "slo_ttft_s must be"), ((1.0, float("nan")), "slo_tpot_s must be"),
                                       ((1.0, 0.0), "slo_tpot_s must be")])
def test_summarize_checks_its_slo_as_simulate_does(slo, says):
    res = api.run("orca", 8.0, 5)
    with pytest.raises(ValueError, match=says):
        summarize(res, *slo)
    with pytest.raises(ValueError, match=says):
        api.simulate("orca", 8.0, 5, slo_ttft_s=slo[0], slo_tpot_s=slo[1])
    with pytest.raises(ValueError, match="result must be a RunResult, got None"):
        summarize(None)


def test_goodput_counts_requests_refused_at_submission_as_misses_even_when_all_are():
    g = api.goodput(workload="orca", n_requests=5, max_context=10, reject_invalid=True, lo=1, hi=4)
    assert g.rate == 0.0 and "misses the target at the lower bound" in g.note


def test_a_run_too_large_for_this_machine_is_refused_before_anything_is_drawn():
    from orca_torch.checks import available_memory_bytes

    if available_memory_bytes() is None:
        pytest.skip("this machine does not say how much memory it has")
    with pytest.raises(ValueError, match=r"n_requests=1,000,000,000,000 \(at least 1,000 bytes a request\) needs "
                                         r"1,000,000.0 GB of memory, but only .* is available here"):
        api.simulate("chat", 8.0, 10**12)


def test_a_mem_fraction_too_small_for_the_weights_says_it_can_be_raised():
    """The advice named only tp and pp, though the card itself holds the weights."""
    with pytest.raises(ValueError, match=r"llama-3-8b needs 16.06 GB of weights per device at tp=1, pp=1, but h100 "
                                         r"offers 8.00 GB \(0.1 x 80 GB\); raise tp or pp, or mem_fraction \(the "
                                         r"whole card holds them\)$"):
        api.simulate("chat", 8.0, 5, mem_fraction=0.1)
    with pytest.raises(ValueError, match=r"gpt3-175b needs .* raise tp or pp$"):
        api.simulate("chat", 8.0, 5, model="gpt3-175b", mem_fraction=0.5)


def test_a_numpy_count_too_large_for_this_machine_is_refused_without_wrapping_around(recwarn):
    """np.int32(2**31 - 1) * 1,000 bytes wraps to -1,000 in int32 arithmetic (with an overflow
    warning): the size is counted in Python integers, so the run is refused as with an int."""
    from orca_torch.checks import available_memory_bytes

    if available_memory_bytes() is None:
        pytest.skip("this machine does not say how much memory it has")
    with pytest.raises(ValueError, match=r"n_requests=2,147,483,647 \(at least 1,000 bytes a request\) needs "
                                         r"2,147.5 GB of memory"):
        api.RunSettings(n_requests=np.int32(2**31 - 1))
    assert not recwarn.list


def test_a_chrome_trace_needs_a_run_result_and_a_file_name(tmp_path):
    from orca_torch.lab.chrome_trace import to_chrome_trace
    res = api.run("orca", 8.0, 5)
    for result, path, says in (("x", tmp_path / "t.json", "result must be a RunResult, got 'x'"),
                               (res, 3, "path must be a file name .* got 3"),
                               (res, tmp_path, "is a directory; give a file name")):
        with pytest.raises(ValueError, match=says):
            to_chrome_trace(result, path)
    assert not list(tmp_path.iterdir())
    (tmp_path / "f").write_text("")          # a folder under a file: FileExistsError / NotADirectoryError before
    for path in (tmp_path / "f" / "t.json", tmp_path / "f" / "d" / "t.json"):
        with pytest.raises(ValueError, match=r"cannot write the trace '.*t.json': (File exists|Not a directory)$"):
            to_chrome_trace(res, path)


def test_a_new_memory_manager_is_a_memory_manager_subclass_that_implements_the_rules_and_takes_n_slots():
    from orca_torch.core.memory import MemoryManager, ReservationMemory, TokenMemory

    class NoGrow(MemoryManager):
        def reservation(self, req):
            return req.total_len

    class TwoArguments(ReservationMemory):
        def __init__(self, n_slots, policy):
            super().__init__(n_slots, policy)

    for memory, says in (("paged", "memory must be a MemoryManager subclass .*, got 'paged'"),
                         (TokenMemory(100), "got an instance of TokenMemory: give the class, each run builds its own"),
                         (Request, "memory must be a MemoryManager subclass"),
                         (MemoryManager, "memory=MemoryManager does not implement reservation or grow"),
                         (NoGrow, "memory=NoGrow does not implement grow, which MemoryManager leaves to its"),
                         (TwoArguments, r"memory=TwoArguments is built as TwoArguments\(n_slots\), but its "
                                        r"__init__\(n_slots, policy\) does not take that")):
        with pytest.raises(ValueError, match=says):
            api.simulate("orca", 8.0, 20, memory=memory)
    assert api.simulate("orca", 8.0, 20, memory=HalfReservation).n_requests == 20


@pytest.mark.parametrize("system", [s for s in api.SYSTEMS if s not in api.MEMORY_AGNOSTIC])
def test_a_new_memory_manager_beside_a_system_named_for_its_memory_is_refused(system):
    """Each of these is orca-max with another manager: beside memory= the two would say the same
    thing twice, one of them ignored."""
    with pytest.raises(ValueError, match=rf"system='{system}' differs from 'orca-max' only in its memory manager, "
                                         r"which memory=HalfReservation replaces; beside memory= give system one of "
                                         r"orca-max, static, sequential"):
        api.simulate("orca", 8.0, 20, system=system, memory=HalfReservation)


@pytest.mark.parametrize("knobs, says", [
    (dict(n_workers=2, pp=2), r"a memory manager that can run out \(preemption\) needs n_workers=1"),
    (dict(system="static"), r"static batching \(StaticScheduler\) keeps a batch's memory until its last member "
                            r"finishes and never preempts: .* got HalfReservation")])
def test_a_new_memory_manager_that_can_run_out_is_refused_where_nothing_preempts_before_the_run(knobs, says,
                                                                                               monkeypatch):
    real, calls = api.Engine.run, []
    monkeypatch.setattr(api.Engine, "run", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    with pytest.raises(ValueError, match=says):
        api.goodput("orca", n_requests=20, memory=HalfReservation, **knobs)
    assert calls == []


def test_a_new_memory_manager_that_swaps_is_refused_on_a_card_without_a_host_link():
    from orca_torch.core.paged_memory import PagedMemory

    class Swapping(PagedMemory):
        def __init__(self, n_slots):
            super().__init__(n_slots, preemption="swap")

    card = dataclasses.replace(get_gpu("h100"), name="no-pcie", host_link_bw=None)
    with pytest.raises(ValueError, match=r"Swapping\(preemption='swap'\) swaps K/V over the card's host link, and "
                                         r"'no-pcie' has none"):
        api.simulate("orca", 1.0, 5, gpu=card, n_slots=10**6, memory=Swapping)
    assert api.simulate("orca", 1.0, 5, n_slots=10**6, memory=Swapping).n_requests == 5


@pytest.mark.parametrize("call", [api.run, api.simulate])
def test_run_and_simulate_refuse_a_rate_too_slow_for_the_run_clock(call):
    """At rate=1e-300 (or 1e-15 for 3 requests) the arrivals reach past the range a float clock
    resolves, and the run stopped mid-way with a clock error: such a rate is refused before the run,
    with the slowest rate allowed, (n - 1) / 2**32, which itself runs."""
    from orca_torch.lab.workload import slowest_rate

    for workload, rate, n in (("chat", 1e-300, 20), ("orca", 1e-15, 3), ("orca", 1e-300, None)):
        n_shown = 600 if n is None else n
        with pytest.raises(ValueError) as e:
            call(workload, rate, n)
        assert str(e.value).startswith(f"rate={rate!r} requests per second is too slow for {n_shown} requests")
        assert str(e.value).endswith(f"rate must be at least (n - 1) / 2**32 = {slowest_rate(n_shown)!r} "
                                     "requests per second")
    assert api.run("orca", slowest_rate(3), 3).n == 3


def test_goodput_refuses_bounds_slower_than_the_run_clock_holds():
    """At lo=1e-300 the arrivals reach past the range a float clock resolves, and the run would end in
    a clock error mid-search: such a bound is refused before any run, with the slowest rate allowed,
    (n - 1) / 2**32, which itself runs."""
    from orca_torch.lab.workload import slowest_rate

    seen = []
    for kw, n in ((dict(workload="orca", n_requests=5), 5), (dict(workload="orca"), 600),
                  (dict(workload=chat(n_requests=30, rate=2.0)), 30)):
        for bound in (dict(lo=1e-300), dict(lo=1e-300, hi=1e-299)):
            with pytest.raises(ValueError) as e:
                api.goodput(**kw, **bound, on_rate=lambda r, a: seen.append(r))
            assert str(e.value).startswith(f"lo=1e-300 requests per second is too slow for {n} requests")
            assert str(e.value).endswith(f"must be at least (n - 1) / 2**32 = {(n - 1) / 2**32!r} requests per second")
    assert seen == []
    with pytest.raises(ValueError, match=r"^hi=1e-300 requests per second is too slow for 5 requests"):
        api.goodput("orca", n_requests=5, lo=0.0, hi=1e-300)
    g = api.goodput("orca", n_requests=5, lo=slowest_rate(5), hi=1.0, slo_ttft_s=1e-9)
    assert g.rate == 0.0 and g.evaluations[1] == (slowest_rate(5), 0.0)    # the slowest rate ran to its end
