"""The same scheduler on the real torch model: tokens equal one-by-one generation (lecture §4.1, §5.1)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from orca_torch.lab import api
from orca_torch.lab.api import simulate
from orca_torch.lab.baselines import static_batching
from orca_torch.core.engine import Engine
from orca_torch.model.torch_executor import TorchExecutor, ban_stops
from orca_torch.core.memory import ReservationMemory, TokenMemory, UnlimitedMemory
from orca_torch.core.paged_memory import PagedMemory
from orca_torch.model.paged_kv_cache import PagedKVManager
from tiny_model import MODEL, alone
from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.lab.timeline import demo4, format_demo4


def make(specs, seed=0):
    """Requests from (arrival gap, prompt len, output len), prompts drawn from a small pool so that
    the reference generations are shared between examples."""
    rng = np.random.default_rng(seed)
    t, reqs = 0.0, []
    for i, (gap, p, o) in enumerate(specs):
        t += gap
        reqs.append(Request(i, t, p, o, prompt_ids=rng.integers(0, MODEL.spec.vocab, size=p).tolist()))
    return reqs


def run(reqs, config, memory=None, clock="iterations"):
    kv = MODEL.new_kv(sum(r.total_len for r in reqs))
    res = Engine(TorchExecutor(MODEL, kv, clock=clock), memory or UnlimitedMemory(), config,
                 trace=True).run(reqs)
    assert kv.slots_reserved == 0 and kv.n_requests == 0          # every K/V buffer was freed
    return res


@pytest.mark.parametrize("config, memory", [(SchedulerConfig(max_bs=3), UnlimitedMemory),
                                            (SchedulerConfig(max_bs=4), lambda: TokenMemory(24)),
                                            (static_batching(2), lambda: ReservationMemory(200, "oracle"))])
def test_engine_step_is_one_iteration_on_the_torch_executor(config, memory):
    from test_core import step_one_iteration_at_a_time

    reqs = make([(0, 5, 4), (0, 9, 3), (1, 3, 7), (0, 12, 6), (1, 4, 5), (2, 7, 1)])
    ex = TorchExecutor(MODEL, MODEL.new_kv(sum(r.total_len for r in reqs)), clock="iterations")
    mem = memory()
    res = step_one_iteration_at_a_time(Engine(ex, mem, config), reqs)
    assert (res.n_preemptions.sum() > 0) == mem.can_run_out
    for r in reqs:
        assert r.output_ids == alone(r.prompt_ids, r.output_len)
    assert res.n_steps >= 8


def test_demo4_charts_and_identical_tokens():
    d = demo4("tiny", seed=0)
    assert (d.continuous_iterations, d.static_iterations) == (10, 18)
    assert d.continuous_rows == ["PDDDDD    ", "PDD       ", " PDDDDDDDD", "  ·PD     ", "   ··PDDDD",
                                 "      PDD "]
    assert d.static_rows == ["PDDDDD            ", "PDD---            ", " ·····PDDDDDDDD   ",
                             "  ····PD-------   ", "   ···PDDDD----   ", "      ·········PDD"]
    assert d.tokens_match and d.static_tokens_match
    assert [len(v) for v in d.tokens.values()] == [6, 3, 9, 2, 5, 3]
    text = format_demo4(d)
    assert "(10 iterations)" in text and "(18 iterations)" in text and "identical" in text
    assert "  r3    ·PD        arrived @2, last token @4" in text


specs = st.lists(st.tuples(st.sampled_from([0.0, 0.0, 1.0, 2.0]), st.integers(1, 12), st.integers(1, 8)),
                 min_size=1, max_size=6)


@settings(max_examples=20, deadline=None)
@given(s=specs, max_bs=st.integers(1, 4), mode=st.sampled_from(["mixed", "prefill_first", "chunked"]),
       seed=st.integers(0, 3))
def test_continuous_batching_tokens_equal_one_by_one_generation(s, max_bs, mode, seed):
    reqs = make(s, seed)
    if mode == "chunked":
        config = SchedulerConfig(max_bs=max_bs, max_num_batched_tokens=max_bs + 3, chunked_prefill=True)
    else:
        config = SchedulerConfig(max_bs=max_bs, prefill=mode)
    res = run(reqs, config)
    for r in reqs:
        assert res.output_ids[r.req_id] == alone(r.prompt_ids, r.output_len)


def test_preempted_requests_recompute_to_the_same_tokens():
    reqs = make([(0.0, 10, 8), (0.0, 9, 8), (0.0, 11, 8), (1.0, 6, 5)], seed=5)
    res = run(reqs, SchedulerConfig(max_bs=4), TokenMemory(40))
    assert res.n_preemptions.sum() > 0
    for r in reqs:
        assert res.output_ids[r.req_id] == alone(r.prompt_ids, r.output_len)


def test_static_and_reserving_runs_give_the_same_tokens():
    reqs = make([(0.0, 5, 6), (0.0, 7, 3), (1.0, 4, 5), (0.0, 8, 2)], seed=1)
    want = {r.req_id: alone(r.prompt_ids, r.output_len) for r in reqs}
    assert run(reqs, static_batching(2)).output_ids == want
    assert run(reqs, SchedulerConfig(max_bs=3), ReservationMemory(40, "oracle")).output_ids == want
    assert run(reqs, SchedulerConfig(max_bs=2, n_workers=2)).output_ids == want


def test_min_tokens_keeps_a_request_s_stop_ids_from_being_picked():
    """Token 2 is every row's best: a request with fewer tokens than its `min_tokens` gets its best
    token that is none of its stop ids; one past its `min_tokens`, or with no stop ids, gets 2."""
    logits = torch.tensor([[0.0, 1.0, 9.0, 3.0, 5.0]]).repeat(4, 1)
    reqs = [Request(i, 0.0, 1, 4, prompt_ids=[0], min_tokens=m, stop_token_ids=stops)
            for i, (m, stops) in enumerate([(2, (2,)), (2, (2, 4)), (1, (2,)), (3, ())])]
    reqs[2].n_generated = 1
    assert ban_stops(logits, reqs).argmax(dim=-1).tolist() == [4, 3, 2, 2]


@pytest.mark.parametrize("config", [SchedulerConfig(max_bs=3),
                                    SchedulerConfig(max_bs=3, max_num_batched_tokens=6, chunked_prefill=True)])
def test_min_tokens_masks_one_request_s_stop_id_within_a_batch(config):
    """A request whose greedy first token is its stop id, with min_tokens 1, makes another first
    token and goes on greedily from it; the requests batched with it are unchanged."""
    reqs = make([(0.0, 7, 5), (0.0, 9, 4), (0.0, 5, 6)], seed=4)
    first = alone(reqs[0].prompt_ids, 1)[0]
    reqs[0].min_tokens, reqs[0].stop_token_ids = 1, (first,)
    out = run(reqs, config).output_ids
    t = out[0][0]
    assert t != first and out[0] == [t] + alone(reqs[0].prompt_ids + [t], 4)
    for r in reqs[1:]:
        assert out[r.req_id] == alone(r.prompt_ids, r.output_len)


def test_wall_clock_times_real_steps():
    reqs = make([(0.0, 8, 4), (0.0, 5, 3)], seed=2)
    res = run(reqs, SchedulerConfig(max_bs=2), clock="wall")
    d = res.step_end - res.step_start
    assert np.all(d > 0) and np.all(d < 5.0)
    assert np.all(np.diff(res.token_times[:4]) > 0)


def test_the_torch_executor_needs_prompt_tokens():
    kv = MODEL.new_kv(100)
    engine = Engine(TorchExecutor(MODEL, kv), UnlimitedMemory(), SchedulerConfig())
    with pytest.raises(ValueError, match=r"request 0 has no prompt_ids; the torch executor needs tokens \(see "
                                         r"workload.with_prompt_ids\)"):
        engine.run([Request(0, 0.0, 5, 5)])
    with pytest.raises(ValueError, match="prompt ids must lie"):
        engine.run([Request(0, 0.0, 2, 5, prompt_ids=[1, 10**6])])
    with pytest.raises(ValueError, match="unknown clock 'sundial'; choose one of 'wall', 'iterations'"):
        TorchExecutor(MODEL, kv, clock="sundial")
    res = engine.run(make([(0.0, 4, 3)]))          # still usable after the errors
    assert len(res.output_ids[0]) == 3


def test_simulate_on_the_torch_executor():
    reqs = make([(0.0, 6, 4), (0.0, 3, 2), (1.0, 5, 3)], seed=3)
    m = simulate(workload=reqs, system="orca-oracle", model="tiny", executor="torch", max_bs=2,
                 clock="iterations")
    # r0 and r1 share steps 0..1; r1 leaves; r2 (seen at step 1 but no seat) joins at step 2.
    assert (m.n_requests, m.n_steps, m.max_batch) == (3, 5, 2)
    assert m.ttft_max_s == 2.0 and m.itl_max_s == 1.0
    with pytest.raises(ValueError, match="tiny"):
        simulate(n_requests=2, model="llama-3-8b", executor="torch")


@pytest.mark.parametrize("system", ["orca-max", "orca-pow2", "orca-oracle", "orca-ondemand", "paged", "static"])
def test_on_torch_the_default_memory_holds_every_request_at_once(system):
    """Orca (Max) reserves the whole context per request: the default K/V budget on torch still
    admits them all together (the tensors hold only what each stores), as it does every system."""
    reqs = [Request(i, 0.0, 10, 10) for i in range(8)]
    res = api.run(reqs, system=system, executor="torch", model="tiny", clock="iterations")
    assert (res.n_steps, int(res.step_n_seqs.max())) == (10, 8)


@pytest.mark.parametrize("system", ["paged", "paged-swap"])
def test_on_torch_the_default_paged_memory_holds_every_request_at_once_in_whole_blocks(system):
    """Paged memory gives each request whole blocks: 40 requests that store 17 tokens each take two
    blocks of 16 apiece, 1,280 slots, more than their 720 tokens; the default budget holds them all
    together still, with no preemption. 200 prompts of two blocks each fill 400 blocks, and admission
    keeps 1% of the pool free besides: all 200 still start in the first step. A request of 17 tokens
    stores 16 (its last token's K/V never is), one block, as `PagedMemory.check` counts: the default
    pool of 200 of them is their 200 blocks and the 1% kept free (203, 3,248 slots), not two blocks
    apiece (6,480 slots), nor the whole blocks of 17 tokens each (212, 3,392 slots)."""
    reqs = [Request(i, 0.0, 10, 8) for i in range(40)]
    res = api.run(reqs, system=system, executor="torch", model="tiny", clock="iterations")
    assert (int(res.n_preemptions.sum()), res.n_steps, int(res.step_n_seqs.max())) == (0, 8, 40)
    reqs = [Request(i, 0.0, 31, 1) for i in range(200)]
    res = api.run(reqs, system=system, executor="torch", model="tiny", clock="iterations", max_bs=256)
    assert (res.n_steps, int(res.step_n_seqs.max())) == (1, 200)
    reqs = [Request(i, 0.0, 10, 7) for i in range(200)]
    res = api.run(reqs, system=system, executor="torch", model="tiny", clock="iterations", max_bs=256)
    assert (res.n_slots, int(res.n_preemptions.sum()), int(res.step_n_seqs.max())) == (203 * 16, 0, 200)


def test_numpy_prompt_ids_survive_a_recompute_preemption():
    """A numpy array of prompt ids re-fed with the output after a preemption is concatenated,
    not added elementwise (nor refused for mismatched shapes)."""
    rng = np.random.default_rng(0)
    reqs = [Request(i, 0.0, p, 12, prompt_ids=rng.integers(0, MODEL.spec.vocab, size=p))
            for i, p in enumerate((6, 7, 5))]
    engine = Engine(TorchExecutor(MODEL, MODEL.new_kv(256), clock="iterations"), TokenMemory(40),
                    SchedulerConfig(max_bs=4))
    res = engine.run(reqs)
    assert res.n_preemptions.sum() >= 1
    for r in reqs:
        assert r.output_ids == alone(r.prompt_ids.tolist(), 12)


def test_non_integer_prompt_ids_are_refused():
    engine = Engine(TorchExecutor(MODEL, MODEL.new_kv(100)), UnlimitedMemory(), SchedulerConfig())
    with pytest.raises(ValueError, match=r"prompt_ids must be a list of token ids .* got 1.7 at position 0"):
        Request(0, 0.0, 3, 2, prompt_ids=[1.7, 2, 3])
    changed = Request(0, 0.0, 2, 2, prompt_ids=[1, 2])
    changed.prompt_ids = [True, 2]                       # after construction: refused at submission
    with pytest.raises(ValueError, match=r"prompt_ids must be a list of token ids .* got True at position 0"):
        engine.run([changed])


def test_a_request_larger_than_the_kv_store_is_refused_at_the_door_and_a_mismatched_memory_named():
    """The contiguous store reserves prompt + output - 1 per request: one that can never fit is refused
    (or rejected, and the rest served); a memory manager that admits more than the store holds is
    named when the store runs short, not left to the store's own error."""
    reqs = [Request(0, 0.0, 3, 3, prompt_ids=[1, 2, 3]), Request(1, 0.0, 15, 10, prompt_ids=[1] * 15)]
    engine = Engine(TorchExecutor(MODEL, MODEL.new_kv(20), clock="iterations"), UnlimitedMemory())
    res = engine.run(reqs, on_invalid="reject")
    assert res.n == 1 and ("stores up to 24 tokens' K/V (prompt 15 + output 10 - 1), but the K/V store holds "
                           "n_slots=20") in res.rejected[0][1]
    with pytest.raises(ValueError, match="could never run; give the model a larger K/V store"):
        engine.run(reqs)
    both = [Request(0, 0.0, 3, 10, prompt_ids=[1, 2, 3]), Request(1, 0.0, 5, 5, prompt_ids=[1] * 5)]
    with pytest.raises(RuntimeError, match=r"admits more than the K/V store holds; give it the store's size"):
        engine.run(both)
    res = Engine(TorchExecutor(MODEL, MODEL.new_kv(20), clock="iterations"),
                 ReservationMemory(20, policy="oracle")).run(both)
    assert res.n == 2 and res.n_steps > 0



def test_a_request_that_stores_exactly_what_the_kv_store_holds_runs_to_its_own_tokens():
    """Its last token is never fed, so prompt + output - 1 slots hold all it stores, as TokenMemory
    and the paged store count: the contiguous store refused a request of 21 tokens in 20 slots
    (and reserved prompt + output for each), one slot short of what it needs."""
    req = Request(0, 0.0, 5, 16, prompt_ids=[3, 1, 4, 1, 5])
    kv = MODEL.new_kv(20)
    res = Engine(TorchExecutor(MODEL, kv, clock="iterations"), TokenMemory(20)).run([req])
    assert res.n == 1 and req.output_ids == alone([3, 1, 4, 1, 5], 16) and kv.slots_reserved == 0
    with pytest.raises(ValueError, match=r"^request 1 stores up to 21 tokens' K/V \(prompt 5 \+ output 17 - 1\), but "
                                         r"the K/V store holds n_slots=20: it could never run"):
        Engine(TorchExecutor(MODEL, kv, clock="iterations"), UnlimitedMemory()).run(
            [Request(1, 0.0, 5, 17, prompt_ids=[3, 1, 4, 1, 5])])


def test_a_request_larger_than_the_paged_kv_store_is_refused_at_the_door():
    """A paged store holds what a request stores, prompt + output - 1 (the last token's K/V never is)."""
    from orca_torch.model.paged_kv_cache import PagedKVManager
    reqs = [Request(0, 0.0, 3, 2, prompt_ids=[1, 2, 3]), Request(1, 0.0, 25, 10, prompt_ids=list(range(25))),
            Request(2, 0.0, 10, 7, prompt_ids=list(range(10)))]               # 16 tokens: exactly 4 blocks
    engine = Engine(TorchExecutor(MODEL, PagedKVManager(MODEL.spec, 4, 4), clock="iterations"), UnlimitedMemory())
    res = engine.run(reqs, on_invalid="reject")
    assert res.n == 2 and [r.req_id for r, _ in res.rejected] == [1]
    assert "stores up to 34 tokens' K/V (prompt 25 + output 10 - 1), more than the paged K/V store's 4 blocks of 4" \
        in res.rejected[0][1]


@pytest.mark.parametrize("swap", [False, True])
def test_a_paged_memory_that_hands_out_more_blocks_than_the_paged_store_holds_is_named(swap):
    """As with the contiguous store: the mismatch is named, not left to the store's own OutOfBlocksError,
    and the failed run leaves the store empty."""
    from orca_torch.core.paged_memory import PagedMemory
    from orca_torch.model.paged_kv_cache import PagedKVManager
    reqs = [Request(i, 0.0, 10, 10, prompt_ids=list(range(i, i + 10))) for i in range(4)]
    memory = PagedMemory(48, 8, "swap") if swap else PagedMemory(800, 8)      # swap: the store has no CPU pool
    kv = PagedKVManager(MODEL.spec, 6 if swap else 3, 8)
    with pytest.raises(RuntimeError, match=r"hands out more blocks than the paged K/V store holds \(\d blocks of 8 "
                                           r"tokens, 0 CPU blocks\); make the store with PagedKVManager\.mirroring"):
        Engine(TorchExecutor(MODEL, kv, clock="iterations"), memory, SchedulerConfig(max_bs=4)).run(reqs)
    assert kv.n_requests == 0 and kv.blocks_free == kv.n_blocks
    kv = PagedKVManager.mirroring(memory, MODEL)
    Engine(TorchExecutor(MODEL, kv, clock="iterations"), memory, SchedulerConfig(max_bs=4)).run(reqs)
    assert all(r.output_ids == alone(r.prompt_ids, 10) for r in reqs)


def test_bench_engine_says_when_it_ran_one_configuration_and_compared_nothing(monkeypatch, capsys):
    import json
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_engine.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--requests", "1", "--new-tokens", "1", "--threads", "1",
                                      "--attention", "split", "--json"])
    runpy.run_path(str(script), run_name="__main__")
    out = json.loads(capsys.readouterr().out)
    assert len(out["runs"]) == 1 and out["same_tokens"] is None and out["tokens_differ_from_first"] == []


def test_bench_engine_titles_the_prompt_lengths_it_drew(monkeypatch, capsys):
    """The title said 'prompts 17-127' whatever was drawn: 2 requests have 2 lengths inside that range."""
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_engine.py"
    lens = [r.prompt_len for r in runpy.run_path(str(script))["make_requests"](2, 1, 0)]
    assert (min(lens), max(lens)) != (17, 127)
    monkeypatch.setattr(sys, "argv", [str(script), "--requests", "2", "--new-tokens", "1", "--threads", "1",
                                      "--attention", "split"])
    runpy.run_path(str(script), run_name="__main__")
    assert f"prompts of {min(lens)}-{max(lens)} tokens (drawn from 17-127)," in capsys.readouterr().out


def test_bench_engine_warms_up_each_path_before_timing_it(monkeypatch, capsys):
    """The warm-up ran once a thread count on whichever path the model was left on: the other path's
    first run was timed cold. Every timed run (3 requests) now follows a warm-up (4) of its own path."""
    import runpy
    import sys
    from pathlib import Path

    from orca_torch.core.engine import Engine

    runs, real = [], Engine.run
    monkeypatch.setattr(Engine, "run", lambda self, requests, *a, **kw: runs.append(
        (self.executor.model.attention, len(requests))) or real(self, requests, *a, **kw))
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_engine.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--requests", "3", "--new-tokens", "1", "--threads", "1",
                                      "--attention", "split,fused"])
    runpy.run_path(str(script), run_name="__main__")
    assert runs == [("split", 4), ("split", 3), ("fused", 4), ("fused", 3)]
    assert "greedy tokens identical across paths and thread counts: yes" in capsys.readouterr().out


def test_bench_engine_s_transformers_rows_run_the_same_weights_batch_and_tokens(monkeypatch, capsys):
    """--hf: transformers' generate on the engine's weights, all the requests in one batch and the same new
    tokens each, at every thread count; its greedy tokens are the engine's."""
    import json
    import runpy
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_engine.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--requests", "3", "--new-tokens", "4", "--threads", "1",
                                      "--attention", "fused", "--hf", "--json"])
    runpy.run_path(str(script), run_name="__main__")
    out = json.loads(capsys.readouterr().out)
    engine, hf = out["runs"]
    assert hf["attention"] == "transformers" and (hf["threads"], hf["tokens"], hf["n_steps"]) == (1, 12, 4)
    assert hf["useful_flops"] == engine["useful_flops"] and out["same_tokens"] is True


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_reset_frees_what_it_holds_when_some_k_v_was_freed_by_hand(paged):
    """A request's K/V freed by hand mid-run: the next reset still frees every other request's K/V
    and drops all its state (named in a warning), so the executor serves the next run."""
    reqs = make([(0, 5, 6), (0, 4, 6), (0, 6, 6)])
    memory = PagedMemory(64, block_size=4) if paged else UnlimitedMemory()
    kv = PagedKVManager.mirroring(memory, MODEL) if paged else MODEL.new_kv(sum(r.total_len for r in reqs))
    executor = TorchExecutor(MODEL, kv, clock="iterations")
    engine = Engine(executor, memory, SchedulerConfig(max_bs=3))
    engine.start(reqs)
    engine.step()
    engine.step()
    assert kv.n_requests == 3
    kv.free(1)
    with pytest.warns(UserWarning, match=r"K/V this executor put in the store under 1 was freed outside it"):
        executor.reset()
    assert kv.n_requests == 0
    fresh = make([(0, 5, 6), (0, 4, 6)], seed=1)
    assert engine.run(fresh).output_ids == {r.req_id: alone(r.prompt_ids, 6) for r in fresh}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_request_whose_k_v_was_freed_by_hand_leaves_a_live_run_with_a_warning(paged):
    """Aborting it frees nothing more (its K/V is gone already, as release wants): a warning names
    it and the run goes on, the others' tokens as they would be alone."""
    reqs = make([(0, 5, 6), (0, 4, 6), (0, 6, 6)])
    memory = PagedMemory(64, block_size=4) if paged else UnlimitedMemory()
    kv = PagedKVManager.mirroring(memory, MODEL) if paged else MODEL.new_kv(sum(r.total_len for r in reqs))
    engine = Engine(TorchExecutor(MODEL, kv, clock="iterations"), memory, SchedulerConfig(max_bs=3))
    engine.start_live()
    for r in reqs:
        engine.add(r)
    engine.step()
    kv.free(1)
    with pytest.warns(UserWarning, match=r"K/V this executor put in the store under 1 was freed outside it \(kv\.free "
                                         r"by hand\)$"):
        engine.abort(reqs[1])
    while not engine.done:
        engine.step()
    assert [r.output_ids == alone(r.prompt_ids, 6) for r in reqs] == [True, False, True] and kv.n_requests == 0
