"""An experiment's helpers refuse what they would misread: an SLO that is not a pair (one number
would leave the other side at a default), no values to spread, a figure without both columns, a
table's name for a figure it has not."""
from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from orca_torch.lab import api
from orca_torch.lab.report import PaperGPU, Report, over_seeds, queued, spread, spread_rows, step_figures


@pytest.mark.parametrize("slo, says", [((1.0,), r"slo must be a pair \(TTFT seconds, TPOT seconds\), .* got \(1.0,\)"),
                                       (1.0, "slo must be a pair"), ("1.0", "slo must be a pair"),
                                       ((1.0, 0.05, 2.0), "slo must be a pair"),
                                       ((0.0, 0.05), "slo_ttft_s must be a number of seconds > 0, got 0.0"),
                                       ((1.0, math.nan), "slo_tpot_s must be a number of seconds > 0, got nan")])
def test_a_paper_gpus_slo_is_a_pair_of_seconds_when_made_and_when_given(slo, says):
    with pytest.raises(ValueError, match=says):
        PaperGPU(slo=slo)
    res = api.run("orca", 8.0, 5)
    with pytest.raises(ValueError, match=says):
        PaperGPU().metrics(res, slo)
    assert PaperGPU(slo=[2.0, math.inf]).metrics(res, np.array([1.0, 0.05])).slo_tpot_s == 0.05


@pytest.mark.parametrize("values", [[], (), "12", None, 3.0])
def test_spread_needs_a_list_of_values(values):
    with pytest.raises(ValueError, match="values must be a non-empty list of numbers"):
        spread(values)


def test_a_nan_seed_makes_the_whole_spread_unknown_in_any_order():
    for values in ([1.0, math.nan], [math.nan, 1.0]):
        s = spread(values)
        assert all(math.isnan(s[k]) for k in ("median", "min", "max"))
    assert spread(np.array([3, 1, 2])) == {"median": 2.0, "min": 1.0, "max": 3.0, "values": [3.0, 1.0, 2.0]}


@pytest.mark.parametrize("figures, says", [({"ttft": (1.0,)}, r"figures\['ttft'\] must be \(lecture, project\)"),
                                           ({"ttft": 1.0}, r"figures\['ttft'\] must be"),
                                           ([("ttft", 1.0, 2.0)], "figures must be a dict of name")])
def test_compare_needs_a_lecture_and_a_project_value_per_figure(figures, says):
    rep = Report(as_json=True)
    with pytest.raises(ValueError, match=says):
        rep.compare("k", "title", figures)
    assert rep.results == {}


@pytest.mark.parametrize("labels, says", [({"ttf": "TTFT s"}, r"labels name figures the table has not: \['ttf'\]; "
                                                               r"its figures are \['ttft'\]"),
                                          ({"ttft": 3}, "labels must be a dict of figure name -> its name in the table"),
                                          (["TTFT s"], "labels must be a dict")])
def test_a_tables_labels_name_only_its_figures(labels, says):
    """A label for a figure the table has not (a typo) would leave that row named by its identifier."""
    rep = Report(as_json=True)
    with pytest.raises(ValueError, match=says):
        rep.compare("k", "title", {"ttft": (1.0, 2.0)}, labels=labels)
    assert rep.results == {}
    runs = []
    with pytest.raises(ValueError, match=says):
        over_seeds(argparse.Namespace(seed=0, seeds=2), rep, "k", "title", {"ttft": 1.0},
                   lambda seed: runs.append(seed) or {"ttft": 1.0}, labels=labels)
    assert runs == [] and rep.results == {}
    with pytest.raises(ValueError, match=says):
        spread_rows({"ttft": spread([1.0])}, labels=labels)


@pytest.mark.parametrize("values", [["a"], [None], [True, False], [1.0, "2"], {1.0: 2.0}, np.array([[1.0, 2.0]])])
def test_spread_refuses_values_that_are_no_numbers_by_name(values):
    with pytest.raises(ValueError, match="values must be a non-empty list of numbers"):
        spread(values)


@pytest.mark.parametrize("kw, says", [({"gpu": 3}, r"gpu must be a card's name or a GPU profile's .json path, got 3"),
                                      ({"gpu": "h1000"}, "unknown GPU 'h1000'"),
                                      ({"model": "llama-9"}, "unknown model preset 'llama-9'"),
                                      ({"cost_model": "rooflin"}, "unknown cost_model 'rooflin'; choose one of"),
                                      ({"cost_model": 3}, "unknown cost_model 3")])
def test_a_paper_gpu_refuses_a_card_model_or_cost_model_it_has_not_when_made(kw, says):
    with pytest.raises(ValueError, match=says):
        PaperGPU(**kw)


def test_a_paper_gpu_takes_a_profile_as_a_path_as_the_api_does(tmp_path):
    from orca_torch.sim.hw_model import get_gpu, save_profile

    path = tmp_path / "card.json"
    save_profile(get_gpu("a100-80gb"), path)
    assert PaperGPU(gpu=path).gpu == str(path)
    assert PaperGPU(gpu=path).title == "llama-3-8b on the paper A100-80GB"      # the card, not its path upper-cased


def test_a_paper_gpus_goodput_leaves_a_bad_tolerance_to_the_api_to_name():
    with pytest.raises(ValueError, match=r"rel_tol must be a finite number in \[1e-09, 1\), got '5%' \(str\)"):
        PaperGPU().goodput(10, 0, "5%")


def test_a_paper_gpus_run_and_goodput_refuse_a_rate_or_an_n_with_a_request_list():
    """Both were passed over in silence: the run kept the list's own arrivals and number. They are
    api's refusals, passed on."""
    from orca_torch.core.request import Request

    reqs = [Request(i, 0.5 * i, 200, 20) for i in range(8)]
    keeps = r"a request list keeps its own arrivals and number \(rescale it with workload\.at_rate, or slice it\)"
    with pytest.raises(ValueError, match=rf"^n_requests=9: {keeps}; leave it unset$"):
        PaperGPU().run(reqs, None, 9)
    with pytest.raises(ValueError, match=rf"^rate=16\.0, n_requests=8: {keeps}; leave them unset$"):
        PaperGPU().run(reqs, 16.0, 8)
    with pytest.raises(ValueError, match=r"^n_requests=9: a request list keeps its own number of requests \(slice "
                                         r"it\); leave it unset"):
        PaperGPU().goodput(9, 0, 0.2, workload=reqs)
    assert len(PaperGPU().run(reqs, None, None).arrival_s) == 8


@pytest.mark.parametrize("figure", [queued, step_figures])
def test_step_figures_refuse_what_is_no_run(figure):
    with pytest.raises(ValueError, match="res must be a RunResult, got None"):
        figure(None)


def test_queued_refuses_a_chunked_run_without_its_trace_by_saying_so():
    """A chunked prompt's first token comes steps after its admission, which only the trace records."""
    from orca_torch.core.request import Request

    res = api.run([Request(0, 0.0, 40, 2)], max_bs=2, chunked_prefill=True, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match=r"a run with chunked_prefill makes a prompt's first token steps after the "
                                         r"one that admitted it, .* run it with trace=True"):
        queued(res)


def test_step_figures_refuse_a_run_of_no_step_by_saying_so():
    """A run whose every request was refused at submission made no step: no largest step to report
    (it was numpy's 'zero-size array to reduction operation maximum')."""
    from orca_torch.core.request import Request

    res = api.run([Request(0, 0.0, 100, 100)], max_context=64, reject_invalid=True)
    with pytest.raises(ValueError, match=r"the run made no step \(1 request\(s\) refused at submission\): "
                                         "it has no largest step"):
        step_figures(res)
