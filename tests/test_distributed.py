"""Orca's distributed execution on real worker processes (lecture §4.4, exercise 6): the tokens of
tensor- and pipeline-parallel runs equal one-by-one generation, batches really overlap in the
pipeline, and a worker fault is a clear, bounded error. Two processes per group, the `tiny` preset.

The token equality is exact for pipeline stages (the same sums in the same order) and holds to
rounding for tp=2 in float32, where each all-reduce adds the ranks' partial products in another
order: the logits agree to about 1e-6, too little to change a greedy token of these seeded
workloads. It is not a property of tensor parallelism in bfloat16, where the same reordering can
flip a near-tie (the executor warns)."""
from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import time

import numpy as np
import pytest
import torch

from orca_torch.distributed import DistributedExecutor, ShardLayout, WorkerFailure, stages
from orca_torch.distributed.control import BatchControl, Control, Kind, decode
from orca_torch.core.batch import SeqWork
from orca_torch.core.engine import Engine
from orca_torch.core.memory import ReservationMemory, TokenMemory, UnlimitedMemory
from serving import Lines
from tiny_model import MODEL, alone
from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import MAX_WORKERS, SchedulerConfig

TIMEOUT_S = 20.0        # every wait of a test is bounded by this
# A run stopped by a short step timeout ends within this (in about 2 s): far under the default
# step_timeout_s=60, which it would take were the test's ignored, or a hang.
HUNG_S = 45.0


def make(specs, seed=0):
    """Requests from (arrival, prompt len, output len)."""
    rng = np.random.default_rng(seed)
    return [Request(i, a, p, o, prompt_ids=rng.integers(0, MODEL.spec.vocab, size=p).tolist())
            for i, (a, p, o) in enumerate(specs)]


MIXED = [(0.0, 5, 6), (0.0, 12, 4), (0.0, 3, 9), (0.0, 9, 5), (0.0, 7, 7), (0.0, 16, 3)]
PREEMPT = [(0.0, 10, 8), (0.0, 9, 8), (0.0, 11, 8), (0.0, 6, 5)]


def check_identical(ex, specs, config, memory=None, seed=0):
    reqs = make(specs, seed)
    res = Engine(ex, memory or UnlimitedMemory(), config).run(reqs)
    for r in reqs:
        assert res.output_ids[r.req_id] == alone(r.prompt_ids, r.output_len), f"request {r.req_id}"
    return res


@pytest.fixture(scope="module")
def tp2():
    ex = DistributedExecutor(MODEL, tp=2, step_timeout_s=TIMEOUT_S, launch_timeout_s=60)
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def pp2():
    ex = DistributedExecutor(MODEL, pp=2, step_timeout_s=TIMEOUT_S, launch_timeout_s=60)
    yield ex
    ex.close()


def test_control_messages_round_trip():
    b = BatchControl(7, (3, 4), ((5, 20),), (1, 5), (SeqWork(1, 9), SeqWork(3, 0)), (11, 12, 13, 14),
                     ((0, 2), (1, 30)))
    kind, back = decode(b.encode())
    assert kind is Kind.BATCH and back == b
    with pytest.raises(AssertionError, match="malformed"):
        decode(b.encode()[:-1])                     # the driver's own message: a bug, not input


def test_a_worker_s_handshake_answers_pings_and_refuses_anything_else_before_go():
    """Before "go" the engine sends only clock pings: a batch then came from elsewhere (anyone who
    reaches the control port may push), and was answered as a ping."""
    from orca_torch.distributed.control import Stray
    from orca_torch.distributed.worker import Worker

    class Channel:
        def __init__(self, *incoming):
            self.incoming, self.sent = list(incoming), []

        def recv(self):
            return self.incoming.pop(0)

        def send(self, m):
            self.sent.append(m[:2])

    class Rank:
        rank, channel = 1, Channel("ping", "ping", "go")

    Worker.handshake(Rank)
    assert Rank.channel.sent == [("ready", 1), ("pong", 1), ("pong", 1)]
    batch = BatchControl(0, (), (), (3,), (SeqWork(1, 0),), (5,)).encode()
    Rank.channel = Channel("ping", batch)
    with pytest.raises(Stray, match=r'^a message on the control channel that the engine does not send '
                                    r'before "go": \[1, '):
        Worker.handshake(Rank)
    assert Rank.channel.sent == [("ready", 1), ("pong", 1)]


def test_bad_splits_are_refused_before_any_process_starts():
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"tp=3 does not divide n_heads=4 .* tp may be one of \[1, 2\]"):
        DistributedExecutor(MODEL, tp=3)
    with pytest.raises(ValueError, match="pp=3 does not divide n_layers=2"):
        DistributedExecutor(MODEL, pp=3)
    with pytest.raises(ValueError, match="tp=4 does not divide n_kv_heads=2"):
        ShardLayout(MODEL.spec, tp=4)
    with pytest.raises(ValueError, match="control must be 'apart'"):
        DistributedExecutor(MODEL, pp=2, control="grpc")
    with pytest.raises(ValueError, match=r"n_slots \(K/V slots per worker\) must be an integer >= 1, got 0"):
        DistributedExecutor(MODEL, pp=2, n_slots=0)
    for not_a_model in ("tiny", None):
        with pytest.raises(ValueError, match="model must be an OrcaModel, got"):
            DistributedExecutor(not_a_model)
    assert len(multiprocessing.active_children()) == before


def test_tensor_parallel_tokens_equal_generate_alone(tp2):
    """float32: the all-reduces' other order of summation stays far below these logits' gaps."""
    check_identical(tp2, MIXED, SchedulerConfig(max_bs=4))
    budget = SchedulerConfig(max_bs=3, max_num_batched_tokens=6, chunked_prefill=True)
    check_identical(tp2, MIXED[:4], budget, seed=1)                  # prompt chunks
    res = check_identical(tp2, PREEMPT, SchedulerConfig(max_bs=4), TokenMemory(40), seed=5)
    assert res.n_preemptions.sum() > 0                               # recompute after preemption


def test_pipeline_parallel_tokens_equal_generate_alone(pp2):
    for n_workers in (1, 2):
        check_identical(pp2, MIXED, SchedulerConfig(max_bs=3, n_workers=n_workers))
        budget = SchedulerConfig(max_bs=3, n_workers=n_workers, max_num_batched_tokens=5, chunked_prefill=True)
        check_identical(pp2, MIXED, budget, seed=2)
    res = check_identical(pp2, PREEMPT, SchedulerConfig(max_bs=4), TokenMemory(40), seed=5)
    assert res.n_preemptions.sum() > 0



def _listening(pids: list[int]) -> list[str]:
    """The local addresses (hex, as /proc/net lists them) the processes `pids` listen on."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:          # LISTEN, and theirs
                out.append(f[1].split(":")[0])
    return out


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket tables")
def test_the_workers_listen_on_the_loopback_interface_only(pp2):
    """The rendezvous store too: torch's own listens on every interface, with no authentication."""
    addresses = _listening([p.pid for p in pp2._group.local()])
    assert addresses and set(addresses) <= {"0100007F"}, addresses    # 127.0.0.1

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the workers talk over NCCL)")
def test_a_cuda_worker_over_nccl_makes_the_cpu_s_tokens():
    """One GPU worker (NCCL's process group, the model on the card): the CPU's greedy tokens, pipelined
    and with a preemption too."""
    from orca_torch.model.orca_model import OrcaModel

    with DistributedExecutor(OrcaModel("tiny", seed=0, device="cuda"), step_timeout_s=TIMEOUT_S,
                             launch_timeout_s=120) as ex:
        check_identical(ex, MIXED, SchedulerConfig(max_bs=3))
        check_identical(ex, MIXED, SchedulerConfig(max_bs=3, n_workers=2))
        assert check_identical(ex, MIXED, SchedulerConfig(max_bs=4), TokenMemory(40)).n_preemptions.sum() > 0


def test_the_store_port_is_held_from_its_choice_to_rank_0():
    """The launcher binds the rendezvous port and hands rank 0 the open socket: no other program can
    take the port in between (a port probed free, then bound later by the store, could be)."""
    from orca_torch.distributed.worker import loopback_listener

    listener, init_method = loopback_listener()
    with listener:
        port = listener.getsockname()[1]
        assert init_method == f"tcp://127.0.0.1:{port}"
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass                                        # it listens already


LONG = [(0.0, p, 4) for p in (160, 200, 180, 150, 190, 170, 140, 210)]   # prefills long enough to overlap


def test_two_batches_of_different_requests_are_in_the_pipeline_at_once(pp2):
    members: dict = {}
    submit = pp2.submit

    def spy(batch):
        members[batch.index] = {w.req.req_id for w in batch.works}
        submit(batch)

    pp2.submit = spy
    try:
        for n_workers in (1, 2):
            members.clear()
            check_identical(pp2, LONG, SchedulerConfig(max_bs=4, n_workers=n_workers), seed=3)
            recs = list(pp2.timeline)
            enter = {r.index: r.start_s for r in recs if r.stage == 0}
            leave = {r.index: r.end_s for r in recs if r.stage == 1}
            # batch j entered the first stage before an earlier batch i left the last one
            together = [(i, j) for i in leave for j in enter if i < j and enter[j] < leave[i]]
            if n_workers == 1:
                assert not together and stages.max_in_flight(recs, 2) == 1
                continue
            assert together and stages.max_in_flight(recs, 2) == 2
            for i, j in together:
                assert not members[i] & members[j], f"a request is in batches {i} and {j} at once"
            # the workers' own timestamps: both stages computing at the same time, on different batches
            # (on a busy 2-core machine the OS may run the two stage processes in turn: up to three runs)
            both = stages.overlap(recs, 0, 1)
            for _ in range(2):
                if both:
                    break
                check_identical(pp2, LONG, SchedulerConfig(max_bs=4, n_workers=2), seed=3)
                both = stages.overlap(list(pp2.timeline), 0, 1)
            assert both and all(i != j for i, j, _ in both)
    finally:
        del pp2.submit


def test_a_round_trip_starts_before_the_control_message_is_sent(pp2):
    """A batch's round trip holds its whole way through the pipeline, even when the engine's process
    is held up just after sending (stood in for by a pause): it is stamped before the send."""
    send = pp2._send
    pp2._send = lambda msg, mode: (send(msg, mode), time.sleep(0.3))
    try:
        check_identical(pp2, MIXED[:3], SchedulerConfig(max_bs=3))
    finally:
        del pp2._send
    first = {r.index: r.start_s for r in pp2.timeline if r.stage == 0}
    last = {r.index: r.end_s for r in pp2.timeline if r.stage == 1}
    assert pp2.round_trips
    for idx, sent, back in pp2.round_trips:
        assert sent <= first[idx] and last[idx] <= back, (idx, sent, first[idx], last[idx], back)


def test_requests_arriving_later_are_served_on_the_wall_clock(pp2):
    res = check_identical(pp2, [(0.0, 6, 4), (0.15, 5, 3), (0.3, 7, 3)], SchedulerConfig(max_bs=3, n_workers=2))
    assert np.all(res.first_token_s > res.arrival_s)             # no token before its request arrived
    assert res.first_token_s[-1] >= 0.3 and pp2.now() >= 0.3


def test_any_n_workers_is_served_by_the_pipeline_of_pp_stages(pp2):
    """The executor names its stages (pp), so the engine's pipeline keeps a stage's numbers per pp
    stage, not per batch that may be in flight (it sized them by n_workers where the executor gave
    no n_stages)."""
    assert pp2.n_stages == 2
    check_identical(pp2, MIXED[:3], SchedulerConfig(max_bs=3, n_workers=MAX_WORKERS))


def _min_tokens_requests():
    """Requests each told to stop at the token its greedy run makes first, or third, with
    `min_tokens` past it: the stop id is banned until then, so the tokens differ from `alone`."""
    reqs = []
    for r in make(MIXED, seed=3):
        made = alone(r.prompt_ids, r.output_len)
        stop = made[0] if r.req_id % 2 else made[min(2, len(made) - 1)]
        reqs.append(Request(r.req_id, 0.0, r.prompt_len, r.output_len, prompt_ids=r.prompt_ids,
                            min_tokens=r.output_len - 1, stop_token_ids=(stop, (stop + 1) % MODEL.spec.vocab)))
    return reqs


def test_min_tokens_bans_the_stop_ids_as_the_torch_executor_does(tp2, pp2):
    """The distributed executor refused `min_tokens` with stop ids (its vocab-parallel argmax masked
    none): each batch now says which stop ids each work may not make yet, and the rank holding a
    banned id's logit leaves it out, so the tokens are the single process's, pipelined or not."""
    from orca_torch.model.torch_executor import TorchExecutor

    config = SchedulerConfig(max_bs=3, n_workers=2)
    want = Engine(TorchExecutor(MODEL, MODEL.new_kv(4096)), UnlimitedMemory(), config).run(_min_tokens_requests())
    assert any(want.output_ids[r.req_id] != alone(r.prompt_ids, r.output_len) for r in _min_tokens_requests())
    for ex in (tp2, pp2):
        got = Engine(ex, UnlimitedMemory(), config).run(_min_tokens_requests())
        assert got.output_ids == want.output_ids


SAMPLING_RUNS = [(SchedulerConfig(max_bs=3, n_workers=2), UnlimitedMemory),
                 (SchedulerConfig(max_bs=4, max_num_batched_tokens=6, chunked_prefill=True), lambda: TokenMemory(40))]
"""The runs sampled requests are compared in: pipelined, and chunked with preemptions (config, memory)."""


def test_sampled_requests_draw_the_torch_executor_s_tokens(tp2, pp2):
    """The distributed executor refused every sampled request (its last stage made greedy tokens
    only): the last stage now gathers the logits rows of the requests that draw, and the engine's
    process draws from them on each request's own generator, as the torch executor does, so the
    tokens are the single process's, pipelined, chunked or preempted."""
    from orca_torch.model.sampling import SamplingParams

    _pick_as_the_torch_executor(tp2, pp2, [None, SamplingParams(temperature=0.8, seed=11),
                                           SamplingParams(temperature=1.3, top_k=20), SamplingParams(top_p=0.9, seed=5)])


def test_bias_and_penalties_pick_the_torch_executor_s_tokens(tp2, pp2):
    """A request with a logit bias or penalties, greedy or drawn, has its logits row sent back as a
    drawn one's is, and the engine's process picks from it with the request's tokens so far (after
    a preemption too), as the torch executor does: the same tokens, pipelined or tensor-parallel."""
    from orca_torch.model.sampling import SamplingParams

    _pick_as_the_torch_executor(tp2, pp2, [
        None, SamplingParams(temperature=0.0, frequency_penalty=2.0, logit_bias={3: 5.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0),
        SamplingParams(temperature=0.9, seed=5, frequency_penalty=1.0)])


def _pick_as_the_torch_executor(tp2, pp2, params: list) -> None:
    """Requests given `params` in turn (at least three of them making tokens other than greedy's)
    make the torch executor's tokens on `tp2` and `pp2`, pipelined, and chunked with preemptions."""
    from orca_torch.model.torch_executor import TorchExecutor

    def requests():
        return [Request(r.req_id, 0.0, r.prompt_len, r.output_len, prompt_ids=r.prompt_ids,
                        sampling=params[r.req_id % len(params)]) for r in make(PREEMPT + MIXED[:4], seed=4)]

    for config, memory in SAMPLING_RUNS:
        want = Engine(TorchExecutor(MODEL, MODEL.new_kv(4096)), memory(), config).run(requests())
        assert sum(want.output_ids[r.req_id] != alone(r.prompt_ids, r.output_len) for r in requests()) >= 3
        for ex in (tp2, pp2):
            got = Engine(ex, memory(), config).run(requests())
            assert got.output_ids == want.output_ids
    assert got.n_preemptions.sum() > 0


def _logprob_requests():
    """Requests asking for log probabilities, greedy (its token the workers', held short of
    `min_tokens` by a stop id that is its first greedy token: a raw row lists that id first),
    adjusted (its token picked in the engine's process, its row sent back once) and drawn, beside
    one that does not ask."""
    from orca_torch.model.sampling import SamplingParams

    params = [None, SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0, frequency_penalty=2.0, logit_bias={3: 5.0}, logprobs=3),
              SamplingParams(temperature=0.9, seed=5, logprobs=0)]
    reqs = []
    for r in make(PREEMPT + MIXED[:4], seed=4):
        ban = {}
        if r.req_id % 4 == 1:
            ban = {"min_tokens": r.output_len - 1, "stop_token_ids": (alone(r.prompt_ids, r.output_len)[0],)}
        reqs.append(Request(r.req_id, 0.0, r.prompt_len, r.output_len, prompt_ids=r.prompt_ids,
                            sampling=params[r.req_id % 4], **ban))
    return reqs


def test_log_probabilities_are_the_torch_executor_s(tp2, pp2):
    """The distributed executor refused a request asking for log probabilities (its last stage sent
    token ids alone): the raw logits row of each work that asks now comes back, one row where it is
    also picked in the engine's process, and the log probabilities are taken from it as the torch
    executor takes them, before bans, bias and penalties. The same tokens and top ids, and log
    probabilities within 1e-5 (measured: 0 for pp=2 with the engine on one thread, 9.5e-7 for tp=2,
    an ulp of float32), pipelined, chunked or preempted."""
    from orca_torch.model.torch_executor import TorchExecutor

    for config, memory in SAMPLING_RUNS:
        want = Engine(TorchExecutor(MODEL, MODEL.new_kv(4096)), memory(), config).run(_logprob_requests())
        first = [want.output_logprobs[r.req_id][0].top[0][0] for r in _logprob_requests() if r.min_tokens]
        assert first and first == [r.stop_token_ids[0] for r in _logprob_requests() if r.min_tokens]
        for ex in (tp2, pp2):
            got = Engine(ex, memory(), config).run(_logprob_requests())
            assert got.output_ids == want.output_ids
            for rid, lps in want.output_logprobs.items():
                if lps is None:
                    assert got.output_logprobs[rid] is None
                    continue
                for a, b in zip(lps, got.output_logprobs[rid], strict=True):
                    assert (a.token, [t for t, _ in a.top]) == (b.token, [t for t, _ in b.top]), rid
                    assert [b.logprob, *(v for _, v in b.top)] == pytest.approx([a.logprob, *(v for _, v in a.top)],
                                                                                abs=1e-5), rid
    assert got.n_preemptions.sum() > 0


@pytest.mark.parametrize("split", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_logits_that_are_not_finite_fail_the_step_greedy_or_drawn(split):
    """A head row of NaN (weights that overflowed): the vocab-parallel argmax picked the NaN's token
    and a draw one past the vocabulary; the step now fails naming the request, as on one process."""
    from orca_torch.model.orca_model import OrcaModel
    from orca_torch.model.sampling import NonFiniteLogits, SamplingParams

    model = OrcaModel("tiny", seed=0)
    with torch.no_grad():
        model.lm_head.weight[200] = math.nan             # (rank 1's half of the vocabulary under tp=2)
    ex = DistributedExecutor(model, **split, step_timeout_s=TIMEOUT_S, launch_timeout_s=60)
    try:
        for rid, sampling in (("greedy", None), ("drawn", SamplingParams(seed=3))):
            req = Request(rid, 0.0, 4, 3, prompt_ids=[1, 2, 3, 4], sampling=sampling)
            with pytest.raises(NonFiniteLogits, match=f"request '{rid}': its logits row is not finite"):
                Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=2)).run([req])
    finally:
        ex.close()

def test_control_through_the_data_plane_gives_the_same_tokens(pp2):
    try:
        pp2.control = "data"
        check_identical(pp2, MIXED, SchedulerConfig(max_bs=3, n_workers=2))
        assert pp2._workers_mode is Control.DATA
    finally:
        pp2.control = "apart"
        pp2.reset()
    assert pp2._workers_mode is Control.APART
    check_identical(pp2, MIXED[:2], SchedulerConfig(max_bs=3))


def _children_of_executor(ex):
    return list(ex._group.procs)


def _stop_at_batch_2(ex, proc) -> None:
    """`proc` (a worker) is frozen (SIGSTOP) as `ex` is handed batch 2: a hung worker."""
    submit = ex.submit

    def submit_then_stop(batch):
        if batch.index == 2:
            os.kill(proc.pid, signal.SIGSTOP)
        submit(batch)

    ex.submit = submit_then_stop


def test_a_killed_worker_is_a_clear_error_and_everything_is_cleaned_up():
    ex = DistributedExecutor(MODEL, pp=2, step_timeout_s=TIMEOUT_S, launch_timeout_s=60)
    try:
        procs = _children_of_executor(ex)
        submit, n = ex.submit, [0]

        def submit_then_kill(batch):
            submit(batch)
            n[0] += 1
            if n[0] == 3:
                os.kill(procs[1].pid, signal.SIGKILL)

        ex.submit = submit_then_kill
        reqs = make(MIXED)
        memory = UnlimitedMemory()
        # (the exit code is the watch's word; the step timeout's says "did not leave the pipeline")
        with pytest.raises(WorkerFailure, match=r"worker rank 1 \(stage 1, tp rank 0\) exited with code -9"):
            Engine(ex, memory, SchedulerConfig(max_bs=3)).run(reqs)
        assert all(p.exitcode is not None for p in procs)              # every worker is gone
        assert not ex.running and not ex._handles and not ex._frees    # K/V handles forgotten
        assert memory.slots_reserved == memory.slots_used == 0         # and the engine's accounting reset
        del ex.submit
        check_identical(ex, MIXED[:3], SchedulerConfig(max_bs=3))      # a fresh group serves the next run
    finally:
        ex.close()


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no forkserver here")
def test_a_killed_forkserver_is_named_not_taken_for_the_workers_end():
    """The forkserver reports its children's ends; killed, it reports none, and multiprocessing gives
    each worker, still running, exit code 255: the engine said 'worker rank 0 exited with code 255'."""
    from multiprocessing import forkserver

    ex = DistributedExecutor(MODEL, pp=2, step_timeout_s=TIMEOUT_S, launch_timeout_s=60)
    try:
        submit, n = ex.submit, [0]

        def submit_then_kill(batch):
            submit(batch)
            n[0] += 1
            if n[0] == 3:
                os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)

        ex.submit = submit_then_kill
        with pytest.raises(WorkerFailure, match=r"worker rank \d \(stage \d, tp rank 0\) is still running, but "
                                                r"multiprocessing's forkserver, which started the workers and reports "
                                                r"their ends, went away \(was it killed\?\)"):
            Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=3)).run(make(MIXED))
        del ex.submit
        check_identical(ex, MIXED[:3], SchedulerConfig(max_bs=3))      # a fresh forkserver starts the next group
    finally:
        ex.close()


def test_a_worker_dead_between_runs_is_named_when_the_next_run_resets_the_group():
    ex = DistributedExecutor(MODEL, pp=2, step_timeout_s=TIMEOUT_S, launch_timeout_s=60)
    try:
        procs = _children_of_executor(ex)
        check_identical(ex, MIXED[:3], SchedulerConfig(max_bs=3))
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(TIMEOUT_S)
        with pytest.raises(WorkerFailure, match=r"could not reset the workers for the next run: worker rank 1 "
                                                r"\(stage 1, tp rank 0\) exited with code -9\n.*the next batch "
                                                r"starts a fresh group") as e:
            Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=3)).run(make(MIXED[:3]))
        assert "worker rank 0" not in str(e.value) and not ex.running
        assert all(p.exitcode is not None for p in procs)
        check_identical(ex, MIXED[:3], SchedulerConfig(max_bs=3))      # a fresh group serves the run after
    finally:
        ex.close()


STAGE_0_HUNG = (r"no report from worker rank 0 \(stage 0, tp rank 0\) \(hung\?\), the first stage without one; "
                r"nor from worker rank 1 \(stage 1, tp rank 0\), likely waiting on stage 0\n")
STAGE_1_HUNG = r"no report from worker rank 1 \(stage 1, tp rank 0\) \(hung\?\)\n"


@pytest.mark.parametrize("control, stopped, named", [("apart", 0, STAGE_0_HUNG), ("data", 0, STAGE_0_HUNG),
                                                     ("data", 1, STAGE_1_HUNG)])
def test_a_hung_worker_is_a_clear_error_within_the_step_timeout_naming_the_stage_that_likely_hung(
        control, stopped, named):
    """The error named every worker without a report, the hung one and those silent behind it alike.
    Through the data plane a stage's report also waited on its next stage taking the control message
    and then the activations, so a hung stage 1 silenced stage 0 too and looked like a hung stage 0."""
    ex = DistributedExecutor(MODEL, pp=2, control=control, step_timeout_s=1.5, launch_timeout_s=60)
    try:
        procs = _children_of_executor(ex)
        _stop_at_batch_2(ex, procs[stopped])
        t0 = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"^batch 2 did not leave the pipeline within step_timeout_s=1.5 s; "
                                                + named):
            Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=3)).run(make(MIXED))
        assert time.monotonic() - t0 < HUNG_S
        assert all(p.exitcode is not None for p in procs)
    finally:
        ex.close()


def test_the_silent_workers_of_the_lowest_stage_are_named_as_the_likely_cause():
    from orca_torch.distributed.executor import no_report

    lay = ShardLayout("tiny", tp=2, pp=2)
    assert no_report(lay, [0, 1, 2, 3], str) == "no report from 0, 1 (hung?), the first stage without one; " \
                                                 "nor from 2, 3, likely waiting on stage 0"
    assert no_report(lay, [1, 2, 3], str) == "no report from 1 (hung?), the first stage without one; " \
                                             "nor from 2, 3, likely waiting on stage 0"
    assert no_report(lay, [2, 3], str) == "no report from 2, 3 (hung?)"
    # with each rank's count of its stage's steps: the tp rank short of a step, not the peer waiting in it
    assert no_report(lay, [0, 1, 2, 3], str, [7, 6, 3, 3]) == (
        "no report from 1 (hung?), which 0 waits for in a tensor-parallel collective, the first stage without "
        "one; nor from 2, 3, likely waiting on stage 0")
    assert no_report(lay, [2, 3], str, [9, 9, 4, 5]) == "no report from 2 (hung?), which 3 waits for in a " \
                                                        "tensor-parallel collective"
    assert no_report(lay, [2, 3], str, [9, 9, 5, 5]) == "no report from 2, 3 (hung?)"   # (both in one collective)


@pytest.mark.parametrize("control, stopped", [("apart", 1), ("apart", 0), ("data", 0)])
def test_a_hung_tensor_parallel_rank_is_named_not_the_peer_waiting_for_it(control, stopped):
    """Both tp ranks of a stage fell silent when one hung (the other waits in their collective), and
    the error named both as hung. Each counts the stage's steps it enters: the one short of its peer's
    is named, and the peer as waiting for it. (Through the data plane rank 0 also hands the control
    message to its stage's other ranks, which wait for it.)"""
    ex = DistributedExecutor(MODEL, tp=2, control=control, step_timeout_s=3.0, launch_timeout_s=60)
    try:
        procs = _children_of_executor(ex)
        _stop_at_batch_2(ex, procs[stopped])
        other = 1 - stopped
        with pytest.raises(WorkerFailure, match=rf"^batch 2 did not leave the pipeline within step_timeout_s=3 s; no "
                                                rf"report from worker rank {stopped} \(stage 0, tp rank {stopped}\) "
                                                rf"\(hung\?\), which worker rank {other} \(stage 0, tp rank {other}\) "
                                                r"waits for in a tensor-parallel collective\n"):
            Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=3)).run(make(MIXED))
        assert all(p.exitcode is not None for p in procs)
    finally:
        ex.close()


def test_ctrl_c_stops_the_workers_at_once_not_after_the_batches_in_flight():
    """A run abandoned by Ctrl-C stopped the workers as close() does: a STOP queued behind the batches
    in flight, then a grace of 5 s, so the interrupt waited for their steps, and for a hung worker
    the whole grace. They are ended at once, by signal, and the interrupt goes through; each reset
    (the run's start, then its abort) forgets the K/V state once (the abort's did it twice: once in
    stopping the workers, then again)."""
    ex = DistributedExecutor(MODEL, pp=2, step_timeout_s=TIMEOUT_S, launch_timeout_s=60)
    try:
        procs = _children_of_executor(ex)

        def interrupted():
            raise KeyboardInterrupt

        clears, clear, reset = [], ex._clear, ex.reset     # the state forgotten by each reset: how many times

        def counted_clear():
            clears[-1] += 1
            clear()

        def counted_reset():
            clears.append(0)
            reset()

        ex.wait, ex._clear, ex.reset = interrupted, counted_clear, counted_reset   # a Ctrl-C while the engine
        with pytest.raises(KeyboardInterrupt):                                     # waits for its first batch
            Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=3)).run(make(MIXED))
        assert clears == [1, 1]
        del ex._clear, ex.reset
        assert procs[0].exitcode == -signal.SIGTERM and not ex.running
        assert procs[1].exitcode in (-signal.SIGTERM, 1)          # (or its recv from the ended rank 0 failed first)
        del ex.wait
        check_identical(ex, MIXED[:3], SchedulerConfig(max_bs=3))      # a fresh group serves the next run
    finally:
        ex.close()


def test_a_workers_error_reaches_the_engine_with_its_traceback():
    """A worker that fails pushes its traceback onto the engine's queue, then its process ends: the
    engine raises the traceback, not the bare exit code, whichever of the two it sees first."""
    ex = DistributedExecutor(MODEL, step_timeout_s=TIMEOUT_S, launch_timeout_s=60)
    try:
        ex._group.send([0], BatchControl(7, (99,), (), (), (), ()).encode())     # a free of a handle never reserved
        with pytest.raises(WorkerFailure, match=r"^worker rank 0 \(stage 0, tp rank 0\) failed:\nTraceback (?s:.*)"
                                                r"AssertionError: cannot free request 99: it holds no reservation"):
            ex._group.receive(TIMEOUT_S)
    finally:
        ex.close()


class _Ended:
    """A local process's handle as the engine's group sees it: `exitcode` None until it has ended."""

    def __init__(self, code: int, shown_by=None) -> None:
        self.code, self.shown_by, self.joined = code, shown_by, False

    def join(self, timeout_s: float) -> None:
        self.joined = True

    @property
    def exitcode(self) -> int | None:
        return self.code if self.shown_by is None or self.shown_by.joined else None


@pytest.mark.parametrize("code, says", [
    (-signal.SIGKILL, r"^worker rank 1 \(stage 1, tp rank 0\) exited with code -9, a signal's end; then worker rank 0 "
                      r"\(stage 0, tp rank 0\) failed:\nTraceback ...\nRuntimeError: Connection reset by peer$"),
    (1, r"^worker rank 0 \(stage 0, tp rank 0\) failed:\nTraceback ...\nRuntimeError: Connection reset by peer\n"
        r"By then worker rank 1 \(stage 1, tp rank 0\) exited with code 1\.$")])
def test_a_workers_error_names_the_peer_whose_end_caused_it(code, says):
    """A tp rank killed mid-step: its peer's collective fails ('Connection reset by peer') and that
    error could reach the engine before the killed rank's end, which the forkserver reports a moment
    later; the engine then said only the peer's error. It waits for the failing worker's own end
    (which comes after the killed one's) and names the processes ended by then. One a signal ended
    (kill -9) is named first: the message began with its peer's failure and torch's traceback, the
    killed rank only on its last line; a peer that failed itself (exit code 1) is named after."""
    from control_peers import store_group

    group = store_group(pp=2)
    try:
        failing = _Ended(1)
        group.procs = [failing, _Ended(code, shown_by=failing)]
        group.inbox.put(pickle.dumps(("error", 0, "Traceback ...\nRuntimeError: Connection reset by peer")))
        with pytest.raises(WorkerFailure, match=says):
            group.receive(TIMEOUT_S)
    finally:
        group.procs = None
        group.shutdown()


@pytest.mark.parametrize("running, says", [
    (True, "is still running, but multiprocessing's forkserver, which started the workers and reports their ends, "
           "went away (was it killed?)"),
    (False, "exited with code 255")])
def test_exit_code_255_is_the_forkservers_end_only_while_the_worker_is_still_there(running, says):
    """multiprocessing gives 255 where the forkserver could not report a process's end; a worker's own
    exit code 255 comes once the forkserver has reaped it, its process gone."""
    import subprocess

    from control_peers import store_group

    group = store_group(pp=2)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    try:
        worker = _Ended(255)
        worker.pid = os.getpid() if running else gone.pid
        group.procs = [worker, None]
        group.inbox.put(("gone", 0))
        with pytest.raises(WorkerFailure) as e:
            group.receive(TIMEOUT_S)
        assert str(e.value) == f"worker rank 0 (stage 0, tp rank 0) {says}"
    finally:
        group.procs = None
        group.shutdown()


class _Hung:
    """A stand-in for a local worker process that ignores SIGTERM and ends only when killed; each call
    is logged."""

    def __init__(self, rank: int, log: list) -> None:
        self.rank, self.log, self.exitcode = rank, log, None

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout=None) -> None:
        self.log.append(("join", self.rank))

    def terminate(self) -> None:
        self.log.append(("terminate", self.rank))

    def kill(self) -> None:
        self.log.append(("kill", self.rank))
        self.exitcode = -signal.SIGKILL


def test_shutdown_signals_every_hung_worker_before_waiting_for_any():
    """Hung workers are terminated together, then killed together: a forced shutdown of four waits out
    one grace for each signal, not one for each worker."""
    from orca_torch.distributed.launch import WorkerGroup

    log = []
    group = WorkerGroup(ShardLayout(MODEL.spec, tp=2, pp=2), None, [_Hung(r, log) for r in range(4)])
    group.shutdown(grace_s=0.0)
    ranks = range(4)
    assert log == ([("join", r) for r in ranks] + [("terminate", r) for r in ranks] + [("join", r) for r in ranks]
                   + [("kill", r) for r in ranks] + [("join", r) for r in ranks])


WORKER_AFTER_ITS_ENGINE = """
import gc
from orca_torch.distributed import worker
from orca_torch.distributed.control import host_store
from orca_torch.distributed.launch import control_listener
from orca_torch.distributed.shard import ShardLayout
from orca_torch.specs import get_model_spec

def peers_gone(*args):
    raise RuntimeError("the group is gone")

engine = host_store(control_listener(("127.0.0.1", 0)))
channel = worker.ControlChannel((engine.host, engine.port), 1)
channel.connect(20)
del engine
gc.collect()                                # the engine's process is gone, and its store's server with it
worker.init_loopback_group = {init}
cfg = worker.WorkerConfig(ShardLayout(get_model_spec("tiny"), pp=2), None, "tiny", 0, 16, "tcp://127.0.0.1:1",
                          loopback=True, step_timeout_s=20)
worker.worker_main(1, cfg, channel)
"""


def _worker_after_its_engine(init: str):
    """`worker_main` as rank 1 (of a torchrun group, say) whose engine's store has ended; joining the
    process group is `init` (a function of the script's)."""
    import subprocess

    return subprocess.run([sys.executable, "-c", WORKER_AFTER_ITS_ENGINE.format(init=init)], capture_output=True,
                          text=True, timeout=60)


def test_a_worker_whose_engine_is_gone_says_its_error_on_stderr():
    """A worker's error is pushed onto the engine's queue, a push written without an answer: into a store
    whose server has ended with the engine's process, it was lost, and the rank (a remote torchrun
    rank, say) ended with code 1 and nothing in its log. It is said on the rank's stderr."""
    out = _worker_after_its_engine("peers_gone")
    assert out.returncode == 1
    assert "orca_torch.distributed: worker rank 1 failed, and its report could not reach the engine (" in out.stderr
    assert out.stderr.rstrip().endswith("RuntimeError: the group is gone")


def test_a_worker_whose_engine_went_away_without_stopping_it_exits_with_1_saying_so():
    """A worker whose control channel closed before any STOP (its engine's process killed) left
    quietly with exit code 0: a torchrun rank on another node than rank 0, whose agent then reported
    success for a run abandoned mid-way (two torchruns of one rank each, rank 0 SIGKILLed). It says
    so in one line and exits with 1."""
    out = _worker_after_its_engine("lambda *args: None")    # (a pp=2 group of one: its handshake needs no peer)
    assert out.returncode == 1                              # (torch's own log of the broken connection before it)
    assert out.stderr.endswith("\norca_torch.distributed: worker rank 1 is leaving: its engine went away without "
                               "stopping it (its control channel closed)\n"), out.stderr[-2000:]


def test_a_control_send_never_waits_on_a_worker_that_stopped_reading():
    """A stopped or hung worker stops reading; a send over a connection of its own would wait for it
    once the buffer filled. A send is a push that the store's server, in the engine's process, takes
    at once: megabytes to two workers that read nothing return, and arrive whole when they read."""
    from control_peers import address, store_group
    from orca_torch.distributed.worker import ControlChannel

    group = store_group(pp=2)
    try:
        # a batch of megabytes: far past a socket's buffer
        big = BatchControl(0, (), (), (7,), (SeqWork(10**6),), tuple(range(10**6))).encode()
        for _ in range(3):
            group.send(range(2), big)                              # nobody reads yet
        group.send([0], "go")
        reader = ControlChannel(address(group), 0)
        reader.connect(TIMEOUT_S)
        assert [reader.recv(TIMEOUT_S) for _ in range(4)] == [big, big, big, "go"]
    finally:
        group.shutdown()


def test_a_batch_for_a_stopped_worker_is_sent_and_its_wait_names_the_worker_within_the_step_timeout():
    """A long batch for a worker that is stopped (SIGSTOP) and reads nothing: the send returns, and the
    wait for its report gives up at step_timeout_s, naming it."""
    ex = DistributedExecutor(MODEL, step_timeout_s=1.0, launch_timeout_s=60)
    try:
        procs = _children_of_executor(ex)
        os.kill(procs[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"batch 0 did not leave the pipeline within step_timeout_s=1 s; no "
                                                r"report from worker rank 0 \(stage 0, tp rank 0\) \(hung\?\)"):
            Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=8)).run(make([(0.0, 500, 2)] * 8))
        assert time.monotonic() - t0 < HUNG_S
        assert all(p.exitcode is not None for p in procs) and not ex.running
    finally:
        ex.close()


def _rec(index, stage, start, end):
    from orca_torch.distributed import StageRecord
    return StageRecord(index, stage, stage, 0, start, end, 0.0, end - start)


def test_stage_figures_from_timestamps():
    from orca_torch.distributed import stages
    # batch 0 on stage 0 then 1; batch 1 enters stage 0 while batch 0 is on stage 1
    recs = [_rec(0, 0, 0.0, 1.0), _rec(0, 1, 1.5, 2.5), _rec(1, 0, 1.2, 2.0), _rec(1, 1, 2.7, 3.0)]
    assert stages.overlap(recs, 0, 1) == [(1, 0, pytest.approx(0.5))]
    assert stages.max_in_flight(recs, 2) == 2
    assert stages.busy_fraction(recs, 0) == pytest.approx(1.8 / 3.0)
    assert stages.handoffs(recs, 0, 1) == [pytest.approx(0.5), pytest.approx(0.2)]   # 2.7 - max(2.0, 2.5)
    assert stages.chart(recs, 2, width=6) == ["stage 0 |0011..|", "stage 1 |...001|"]


def _entry_point_error(main, argv, capsys) -> str:
    """The torchrun entry point's one-line usage error (exit code 2, nothing printed, no process started)."""
    before = len(multiprocessing.active_children())
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == "", argv
    assert len(multiprocessing.active_children()) == before
    assert "Traceback" not in out.err
    return out.err.strip().splitlines()[-1]


def test_the_torchrun_entry_point_refuses_what_it_cannot_run(monkeypatch, capsys):
    from orca_torch.distributed.__main__ import main
    monkeypatch.delenv("RANK", raising=False)
    assert "run this under torchrun" in _entry_point_error(main, ["--pp", "2"], capsys)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert "torchrun started 3 processes but tp x pp = 1 x 2 = 2" in _entry_point_error(main, ["--pp", "2"], capsys)
    assert "--pp 3 does not divide n_layers=2" in _entry_point_error(main, ["--pp", "3"], capsys)


def test_the_torchrun_entry_point_ends_a_failure_or_ctrl_c_in_one_line(monkeypatch, capsys):
    from orca_torch.distributed import __main__ as entry

    for raised, code, says in ((WorkerFailure("worker rank 1 exited with code -9"), 1,
                                "orca_torch.distributed: worker rank 1 exited with code -9"),
                               (WorkerFailure("batch 4 did not leave the pipeline within step_timeout_s=5 s"), 1,
                                "orca_torch.distributed: batch 4 did not leave the pipeline within --timeout 5 s"),
                               (KeyboardInterrupt(), 130, "orca_torch.distributed: rank 2 interrupted")):
        def main(argv=None, raised=raised):
            raise raised
        monkeypatch.setattr(entry, "main", main)
        monkeypatch.setenv("RANK", "2")
        assert entry.cli([]) == code
        assert capsys.readouterr().err == says + "\n"


@pytest.mark.parametrize("argv, says", [
    (["--seed", "-1"], "argument --seed: must be an integer with 0 <= seed < 2**63, got '-1'"),
    (["--tp", "3"], "--tp 3 does not divide n_heads=4 of 'tiny'"),
    (["--tp", "0"], "argument --tp: must be an integer >= 1, got '0'"),
    (["--pp", "0"], "argument --pp: must be an integer >= 1, got '0'"),
    (["--pp", "x"], "argument --pp: must be an integer >= 1, got 'x'"),
    (["--max-bs", "-1"], "argument --max-bs: must be an integer >= 1, got '-1'"),
    (["--n-workers", "0"], "argument --n-workers: must be an integer from 1 to 1024, got '0'"),
    (["--n-workers", "1025"], "argument --n-workers: must be an integer from 1 to 1024, got '1025'"),
    (["--requests", "0"], "argument --requests: must be an integer >= 1, got '0'"),
    (["--model", "foo"], "argument --model: unknown model preset 'foo'"),
    (["--model", "gpt3-13b"], "argument --model: OrcaModel builds Llama-style specs only"),
    (["--timeout", "nan"], "argument --timeout: must be a finite number of seconds > 0 and <= 86400, got 'nan'"),
    (["--timeout", "0"], "argument --timeout: must be a finite number of seconds > 0"),
    (["--timeout", "1e300"], "argument --timeout: must be a finite number of seconds > 0 and <= 86400"),
    (["--control-port", "70000"], "argument --control-port: must be an integer from 1 to 65535"),
    (["--control", "grpc"], "argument --control: invalid choice: 'grpc'"),
    (["--pp", "2"], "torchrun started 1 processes but tp x pp = 1 x 2 = 2"),
])
def test_the_torchrun_entry_point_checks_every_flag_before_any_process_group(argv, says, monkeypatch, capsys):
    from orca_torch.distributed import __main__ as entry
    monkeypatch.setattr(entry, "serve", lambda *a: pytest.fail("serve reached"))
    monkeypatch.setattr(entry, "worker_main", lambda *a, **k: pytest.fail("worker reached"))
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29611").items():
        monkeypatch.setenv(k, v)
    assert says in _entry_point_error(entry.main, argv, capsys)


def test_the_torchrun_entry_point_refuses_a_model_that_does_not_fit_and_cuda_it_lacks(monkeypatch, capsys):
    import orca_torch.checks as checks
    from orca_torch.distributed import __main__ as entry
    monkeypatch.setattr(entry, "serve", lambda *a: pytest.fail("serve reached"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 16 * 10**9)
    err = _entry_point_error(entry.main, ["--model", "llama-3-8b"], capsys)
    assert "--model llama-3-8b (fp32 weights, built whole by each of this machine's 1 worker process) " \
           "needs 32.1 GB" in err
    assert "only 16.0 GB is available" in err
    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 40 * 10**9)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")       # one copy fits, but two processes build one each
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = _entry_point_error(entry.main, ["--model", "llama-3-8b", "--pp", "2"], capsys)
    assert "each of this machine's 2 worker processes) needs 64.2 GB" in err
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    if not torch.cuda.is_available():
        assert "--device cuda needs one GPU per local rank (1), but 0 are visible" in \
            _entry_point_error(entry.main, ["--device", "cuda"], capsys)


def test_the_torchrun_entry_point_says_one_line_in_a_fresh_process():
    import subprocess
    import sys

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}
    out = subprocess.run([sys.executable, "-m", "orca_torch.distributed", "--tp", "3"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("python -m orca_torch.distributed: error: --tp 3 does not")


def test_a_main_script_read_from_stdin_is_refused_before_any_worker_starts(tmp_path):
    """Every worker runs the main script again; '<stdin>' is no file: said at once, not as each
    worker's multiprocessing traceback."""
    import subprocess
    import sys

    script = ("from orca_torch.distributed import DistributedExecutor\n"
              "from orca_torch.model.orca_model import OrcaModel\n"
              "if __name__ == '__main__':\n"
              "    DistributedExecutor(OrcaModel('tiny'), tp=1, pp=2)\n")
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "ValueError: the main script is '<stdin>', which the worker processes cannot open: each runs the main "
        "script again (multiprocessing's spawn and forkserver); save it to a file and run `python script.py` "
        "(python -c, a notebook and an interactive session work too)")
    assert "FileNotFoundError" not in out.stderr       # (no worker started to fail)


def test_torchrun_one_node_two_stages():
    """The documented one-machine torchrun command (docs/experiments/06-distributed.md): two fresh
    interpreters as two pipeline stages make the one-by-one tokens. All of it stays on loopback (the
    rendezvous, the control channel, and gloo's pairs, as a local launch keeps them), and nothing of
    the run's process group outlives the test (5-15 s on 2 shared cores)."""
    import json
    import subprocess
    from unittest import mock
    from control_peers import free_port
    from orca_torch.distributed.worker import use_loopback

    with mock.patch.dict(os.environ):           # (this process's environment is left as it was)
        use_loopback()
        env = dict(os.environ)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "orca_torch.distributed",
           "--pp", "2", "--n-workers", "2", "--control-port", str(free_port()), "--timeout", "60"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=120)
    finally:
        _reap_group(p)
    assert p.returncode == 0, err[-2000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["tokens_identical"] and res["pp"] == 2 and res["steps"] > 0


def _shard_logits(shard, x, plan):
    return shard.model.head(x, plan)


def test_shards_in_one_process_compute_the_full_models_step():
    """The shard arithmetic alone, no processes: pp=2 is the same arithmetic (bit for bit); tp=2's
    ranks, run as two threads whose all-reduce sums their partial products, agree to rounding."""
    import threading
    import torch
    from orca_torch.distributed import StageShard

    works = [SeqWork(5, 0), SeqWork(3, 0)]
    ids = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79])
    kv = MODEL.new_kv(64)
    for r in (0, 1):
        kv.reserve(r, 16)
    full = MODEL.forward_batch(ids, works, [0, 1], kv)
    state = MODEL.state_dict()
    ident = lambda t: t  # noqa: E731

    stage = [StageShard(state, ShardLayout(MODEL.spec, pp=2), rank) for rank in (0, 1)]
    kvs = [s.new_kv(64) for s in stage]
    x = None
    for s, k in zip(stage, kvs):
        for r in (0, 1):
            k.reserve(r, 16)
        plan = s.plan(works, [0, 1], k)
        x = s.layers(s.embed(ids, ident) if s.first else x, plan, ident)
    assert torch.equal(_shard_logits(stage[1], x, plan), full)
    assert stage[1].greedy(x, plan, lambda t: t[None])[0].tolist() == full.argmax(-1).tolist()

    lay = ShardLayout(MODEL.spec, tp=2)
    ranks = [StageShard(state, lay, rank) for rank in (0, 1)]
    barrier, slots, out = threading.Barrier(2, timeout=TIMEOUT_S), [None, None], [None, None]

    def collective(j, t, op):
        slots[j] = t.clone()
        barrier.wait()
        res = op(slots)
        barrier.wait()
        return res

    def run(j):
        s, k = ranks[j], ranks[j].new_kv(64)
        for r in (0, 1):
            k.reserve(r, 16)
        plan = s.plan(works, [0, 1], k)
        reduce = lambda t: collective(j, t, lambda xs: xs[0] + xs[1])  # noqa: E731
        gather = lambda t: collective(j, t, torch.stack)               # noqa: E731
        h = s.layers(s.embed(ids, reduce), plan, reduce)
        out[j] = (_shard_logits(s, h, plan), s.greedy(h, plan, gather)[0])

    threads = [threading.Thread(target=run, args=(j,)) for j in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    logits = torch.cat([out[0][0], out[1][0]], dim=-1)        # each rank holds half of the vocabulary
    assert torch.allclose(logits, full, atol=1e-5)
    w, w1 = MODEL.layers[0].wqkv, ranks[1].model.layers[0].wqkv   # rank 1: query heads 2-3, K/V head 1
    assert torch.equal(w1[:32], w[32:64]) and torch.equal(w1[32:48], w[80:96]) and torch.equal(w1[48:], w[112:])
    assert out[0][1].tolist() == out[1][1].tolist() == full.argmax(-1).tolist()


def test_a_link_on_the_paper_gpu_prices_tp_and_pp_with_its_latency_and_bandwidth():
    from orca_torch.sim.hw_model import GPUS, pricer
    from orca_torch.sim.hw_model.links import LinkSpec, with_link

    link = LinkSpec("test", bandwidth=1e9, latency_s=1e-4)
    gpu = with_link(GPUS["h100"], link)
    spec = MODEL.spec
    row = spec.hidden * spec.dtype_bytes                      # one token's activations, bytes
    tp = pricer(spec, gpu, tp=2).stages[0]
    assert tp.tp_fixed == pytest.approx(2 * spec.n_layers * 1e-4)
    assert tp.tp_tok == pytest.approx(2 * spec.n_layers * row / 1e9)      # ring, tp=2: 2(tp-1)/tp = 1
    pp = pricer(spec, gpu, pp=2).stages[0]
    assert (pp.pp_fixed, pp.pp_tok) == (pytest.approx(1e-4), pytest.approx(row / 1e9))
    with pytest.raises(ValueError, match="bandwidth"):
        LinkSpec("bad", 0.0, 1e-4)


def test_torchrun_names_a_control_port_in_use_and_the_flag_that_sets_it():
    """Rank 0 binds its control port before it starts anything: a port in use is one line naming the
    port and the flag, not a traceback (and no worker is left behind)."""
    import socket
    import subprocess
    import sys
    from control_peers import free_port

    master = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}
        for flags, says in (([], f"MASTER_PORT + 1 = {port}"), ([f"--control-port={port}"], f"--control-port {port}")):
            env["MASTER_PORT"] = str(port - 1 if not flags else master)
            out = subprocess.run([sys.executable, "-m", "orca_torch.distributed", "--pp", "2", "--timeout", "20",
                                  *flags], capture_output=True, text=True, timeout=60, env=env)
            assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr, out.stderr[-2000:]
            last = out.stderr.strip().splitlines()[-1]
            assert f"cannot listen for the workers' control connections on 127.0.0.1:{port}" in last, last
            assert "Address already in use" in last and says in last and "and a free port (--control-port)" in last


def _has_ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_torchrun_serves_the_control_channel_on_an_ipv6_address():
    """--control-addr takes any address of this machine, ::1 too: rank 0 bound it as IPv4 and said
    "Address family for hostname not supported", telling the user to give an address of this machine."""
    import json
    import subprocess
    from control_peers import free_port

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-m", "orca_torch.distributed", "--control-addr", "::1", "--requests", "1",
                          "--timeout", "30"], capture_output=True, text=True, timeout=90, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["tokens_identical"]


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_control_address_is_written_in_brackets():
    """A message wrote '::1:PORT', where the address's colons run into the port's."""
    from orca_torch.distributed.launch import join_torchrun

    with socket.create_server(("::1", 0), family=socket.AF_INET6) as s:
        port = s.getsockname()[1]                  # (free again once closed: nobody serves it)
    with pytest.raises(WorkerFailure, match=rf"^rank 1 could not reach the engine's control port \[::1\]:{port} "):
        join_torchrun(1, ("::1", port), 1.0)


def test_a_silent_or_stray_client_on_the_control_port_does_not_hold_the_launch():
    """Anyone can connect to rank 0's control port. A client that says nothing, one that sends bytes
    of another protocol, and a store client that pushes nothing: the store serves each as it comes,
    none is a rank's hello, and the ranks still join and the handshake ends."""
    from control_peers import address, answer_handshake, in_thread, store_group
    from orca_torch.distributed.control import join_store
    from orca_torch.distributed.launch import handshake, join_torchrun
    from orca_torch.distributed.worker import ControlChannel

    settings = (("--pp", 2), ("--seed", 0))
    group = store_group(pp=2)
    try:
        with socket.create_connection(address(group)) as silent, socket.create_connection(address(group)) as other:
            other.sendall(b"\x01GET / HTTP/1.1\r\n")
            stray = join_store(address(group), TIMEOUT_S)
            rank0, went0 = in_thread(answer_handshake, ControlChannel(address(group), 0))
            rank1, went1 = in_thread(lambda: answer_handshake(join_torchrun(1, address(group), TIMEOUT_S, settings)))
            handshake(group, TIMEOUT_S, settings=settings)
            rank0.join(TIMEOUT_S)
            rank1.join(TIMEOUT_S)
            assert went0 == went1 == ["go"] and len(group.clock_offsets) == 2
    finally:
        group.shutdown()


def test_rank_0_gives_up_at_its_timeout_naming_the_ranks_that_never_said_hello():
    from control_peers import address, answer_handshake, in_thread, store_group
    from orca_torch.distributed.launch import handshake
    from orca_torch.distributed.worker import ControlChannel

    group = store_group(pp=2)
    host, port = address(group)
    try:
        with socket.create_connection((host, port)):               # connected, silent
            rank0, went = in_thread(answer_handshake, ControlChannel((host, port), 0))
            with pytest.raises(WorkerFailure, match=rf"^only 1 of 2 workers were ready within launch_timeout_s=1 s; "
                                                    rf"rank 1 never said hello on the control port {host}:{port}; raise "
                                                    rf"launch_timeout_s if they are only slow to start$"):
                handshake(group, 1.0, settings=())
    finally:
        group.shutdown()
    rank0.join(TIMEOUT_S)
    assert went == ["gone"]                                         # the channel closed under the waiting worker


def test_a_launch_that_times_out_names_the_workers_that_were_not_ready():
    """A local worker that never got ready (hung building its shard or joining the group) was not
    named: the launch said only how many were ready."""
    from control_peers import address, answer_handshake, in_thread, store_group
    from orca_torch.distributed.launch import handshake
    from orca_torch.distributed.worker import ControlChannel

    group = store_group(pp=2)
    try:
        rank0, went = in_thread(answer_handshake, ControlChannel(address(group), 0))
        with pytest.raises(WorkerFailure, match=r"^only 1 of 2 workers were ready within launch_timeout_s=1 s; "
                                                r"not ready: worker rank 1 \(stage 1, tp rank 0\) \(each still building.*\); raise "
                                                r"launch_timeout_s if they are only slow to start$"):
            handshake(group, 1.0)
    finally:
        group.shutdown()
    rank0.join(TIMEOUT_S)
    assert went == ["gone"]


def test_a_launch_timeout_names_the_setting_to_raise_in_the_terms_of_its_entry_point():
    """A launch that timed out said how long it waited, not which setting bounds it: the executor's
    launch_timeout_s, or --timeout of `python -m orca_torch.distributed` under torchrun."""
    from orca_torch.distributed.__main__ import flags, parser
    from orca_torch.lab.cli_args import in_flag_terms

    said = "only 1 of 2 workers were ready within launch_timeout_s=1 s; raise launch_timeout_s if they are only slow"
    assert in_flag_terms(said, flags(parser())) == ("only 1 of 2 workers were ready within --timeout 1 s; raise "
                                                    "--timeout if they are only slow")


def test_the_control_port_queues_every_rank_connecting_at_once():
    """All the ranks of a group connect as they start; a queue of one would make the kernel drop the
    third's attempt, to be retried a second or more later."""
    from orca_torch.distributed.launch import control_listener

    with control_listener(("127.0.0.1", 0), 8) as listener:
        ranks = [socket.create_connection(listener.getsockname(), timeout=0.5) for _ in range(7)]   # none accepted yet
        for s in ranks:
            s.close()


def _ended_within(proc, timeout_s: float, why: str) -> int:
    """`proc`'s exit code once it ends within `timeout_s` (else it is killed and the test fails with
    `why`); its stderr pipe is closed either way."""
    import subprocess

    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(why)
    finally:
        proc.stderr.close()


def _rank_1_joining(timeout_s: float):
    """`python -m orca_torch.distributed` as torchrun's rank 1 of a pp=2 group whose rank 0 never
    joins: a rendezvous store and a control channel of this test's; returns the process once it has
    said hello on the control channel and been welcomed (it then joins the process group), and that
    channel's group."""
    import datetime
    import subprocess
    import torch.distributed as dist
    from control_peers import free_port, store_group

    store_port = free_port()
    store = dist.TCPStore("127.0.0.1", store_port, 2, True, timeout=datetime.timedelta(seconds=TIMEOUT_S),
                          wait_for_workers=False)
    group = store_group(pp=2)
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port)}
    proc = subprocess.Popen([sys.executable, "-m", "orca_torch.distributed", "--pp", "2", "--timeout",
                             f"{timeout_s:g}", "--control-port", str(group.store.port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    hello = group.receive(60)
    if hello is None:
        proc.kill()
        proc.wait()
        pytest.fail("rank 1 did not say hello")
    assert hello[:2] == ("hello", 1)
    group.send([1], "welcome")
    return proc, group, store


def test_a_torchrun_rank_whose_group_never_forms_gives_up_at_its_timeout_or_on_ctrl_c():
    """Joining the process group waited a day (the idle wait's bound, given to the group as its
    own): a rank whose peers never came (rank 0 dead, another node never started) hung on, and
    Ctrl-C, which Python cannot raise inside torch's rendezvous, left it to torchrun's SIGKILL 30 s
    later. Now joining gives up at --timeout, naming the rendezvous to rank 0, and Ctrl-C ends it."""
    proc, group, store = _rank_1_joining(2)
    try:
        rc = _ended_within(proc, 60, "rank 1 waited for its group past --timeout")
        assert rc == 1
        with pytest.raises(WorkerFailure, match=r"^worker rank 1 \(stage 1, tp rank 0\) failed:\n(?s:.*)wait timeout "
                                                r"after 2000ms"):
            group.receive(TIMEOUT_S)
    finally:
        group.shutdown()

    proc, group, store = _rank_1_joining(600)
    try:
        time.sleep(0.5)                                 # (any moment: before the group is joined, SIGINT ends it)
        proc.send_signal(signal.SIGINT)
        rc = _ended_within(proc, 60, "Ctrl-C did not end a rank joining its group")
    finally:
        group.shutdown()
    assert rc in (-signal.SIGINT, 130)


@pytest.fixture(scope="module")
def small_pool():
    """One worker with room for 20 tokens of K/V, its sizes given as numpy numbers."""
    ex = DistributedExecutor(MODEL, tp=np.int64(1), pp=np.int32(1), n_slots=np.int64(20), threads=np.int64(1),
                             step_timeout_s=np.float64(TIMEOUT_S), launch_timeout_s=60)
    yield ex
    ex.close()


def test_a_request_larger_than_the_workers_kv_pool_is_refused_at_submission(small_pool):
    ex = small_pool
    sent = []
    submit = ex.submit
    ex.submit = lambda batch: (submit(batch), sent.append(batch.index))       # batches sent to the workers
    try:
        with pytest.raises(ValueError, match=r"request 1 stores up to 21 tokens' K/V \(prompt 12 \+ output 10 - 1\) "
                                             r"on every worker, but each holds n_slots=20"):
            Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=2)).run(make([(0.0, 5, 5), (0.0, 12, 10)]))
        assert sent == [] and ex.running                               # refused before any batch
        # each fits alone, not both at once: the engine's memory admits more than the workers hold
        with pytest.raises(RuntimeError, match=r"batch 0 reserves 22 K/V slots on every worker, but only 20 of "
                           r"n_slots=20 are free: .* \(ReservationMemory\(20, policy='oracle'\)") as exc:
            Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=2)).run(make([(0.0, 6, 6), (0.0, 6, 6)]))
        assert not isinstance(exc.value, WorkerFailure) and ex.running    # the group was not killed
        assert sent == []
        check_identical(ex, [(0.0, 6, 6), (0.0, 6, 6), (0.0, 8, 3)], SchedulerConfig(max_bs=2),
                        ReservationMemory(20, policy="oracle"))               # one at a time: it fits
        assert sent
        check_identical(ex, [(0.0, 12, 9)], SchedulerConfig(max_bs=2))   # 21 tokens store 20: it fills the pool
    finally:
        del ex.submit


def test_numpy_integers_are_taken_for_tp_and_pp(small_pool):
    assert small_pool.layout == ShardLayout(MODEL.spec, 1, 1) and type(small_pool.layout.tp) is int
    lay = ShardLayout(MODEL.spec, tp=np.int64(2), pp=np.int32(2))
    assert lay == ShardLayout(MODEL.spec, 2, 2) and (type(lay.tp), type(lay.pp)) == (int, int)
    with pytest.raises(ValueError, match="pp=3 does not divide n_layers=2"):        # a numpy 3 is a 3
        DistributedExecutor(MODEL, pp=np.int64(3))
    with pytest.raises(ValueError, match=r"tp must be an integer >= 1, got True \(a bool\)"):
        ShardLayout(MODEL.spec, tp=True)
    with pytest.raises(ValueError, match=r"pp must be an integer >= 1, got 2.0"):
        DistributedExecutor(MODEL, pp=2.0)
    with pytest.raises(ValueError, match=r"threads must be an integer in \[1, \d+\], got 0"):
        DistributedExecutor(MODEL, pp=2, threads=np.int64(0))
    with pytest.raises(ValueError, match=r"step_timeout_s must be a finite number of seconds in \(0, 86400\], got inf"):
        DistributedExecutor(MODEL, pp=2, step_timeout_s=np.float64("inf"))   # timedelta would overflow


def test_bf16_with_tensor_parallelism_warns_that_tokens_may_differ(monkeypatch):
    import warnings
    from orca_torch.model.orca_model import OrcaModel

    monkeypatch.setattr(DistributedExecutor, "_launch", lambda self: None)     # the warning comes first
    bf16 = OrcaModel("tiny", seed=0, dtype="bfloat16")
    with pytest.warns(UserWarning, match=r"tp=2 in torch.bfloat16: .* sum .* another order .* may differ from "
                                         r"one-by-one generation; use float32"):
        DistributedExecutor(bf16, tp=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DistributedExecutor(bf16, pp=2)                                       # stages do the same sums
        DistributedExecutor(MODEL, tp=2)                                      # float32


CTRL_C = '''
import signal

from orca_torch.core.engine import Engine
from orca_torch.core.memory import UnlimitedMemory
from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.distributed import DistributedExecutor
from orca_torch.model.orca_model import OrcaModel

if __name__ == "__main__":
    # As a terminal's foreground process has it: a shell's background job (a CI runner's, say)
    # starts with SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ex = DistributedExecutor(OrcaModel("tiny"), pp=2, step_timeout_s=20, launch_timeout_s=60)
    procs, wait, n = list(ex._group.procs), ex.wait, [0]

    def wait_and_say():
        out = wait()
        n[0] += 1
        if n[0] == 3:
            print("running", flush=True)
        return out

    ex.wait = wait_and_say
    reqs = [Request(i, 0.0, 8, 200, prompt_ids=[(7 * i + j) % 256 for j in range(8)]) for i in range(64)]
    try:
        with ex:
            Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=4, n_workers=2)).run(reqs)
    finally:
        print("workers alive", sum(p.is_alive() for p in procs), flush=True)
'''


def test_ctrl_c_during_a_distributed_run_is_a_keyboard_interrupt(tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it: the workers leave it to the
    engine, which stops them and lets the KeyboardInterrupt through."""
    import subprocess
    import sys

    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C)
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ})
    out, err = Lines(p.stdout), Lines(p.stderr)
    try:
        out.first_with("running")
        os.killpg(p.pid, signal.SIGINT)
        p.wait(TIMEOUT_S + 10)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    out, err = out.text(), err.text()
    said = f"exit code {p.returncode}; stdout {out[-500:]!r}; stderr {err[-3000:]!r}"
    assert "WorkerFailure" not in err and err.strip().endswith("KeyboardInterrupt"), said
    assert p.returncode == -signal.SIGINT and "workers alive 0" in out, said


NO_MAIN_GUARD = '''
from orca_torch.core.engine import Engine
from orca_torch.core.memory import UnlimitedMemory
from orca_torch.core.request import Request
from orca_torch.core.scheduler_config import SchedulerConfig
from orca_torch.distributed import DistributedExecutor
from orca_torch.model.orca_model import OrcaModel

requests = [Request(i, 0.0, 5, 3, prompt_ids=[1, 2, 3, 4, 5]) for i in range(3)]
with DistributedExecutor(OrcaModel("tiny"), pp=2, launch_timeout_s=60) as ex:
    Engine(ex, UnlimitedMemory(), SchedulerConfig(max_bs=4, n_workers=2)).run(requests)
'''


def test_a_script_without_a_main_guard_is_told_what_is_wrong(tmp_path):
    """Workers are started by spawning, which imports the main script again in every worker: without
    `if __name__ == "__main__":` each worker would build its own executor. Say so, and how to fix it."""
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text(NO_MAIN_GUARD)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ})
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert f"{script} builds a DistributedExecutor when imported, outside `if __name__ == \"__main__\":`" in last \
        and "WorkerFailure: worker rank" in last, out.stderr[-3000:]
    assert "put the code that builds the DistributedExecutor and runs the engine under that line" in last
    assert "bootstrapping phase" not in out.stderr                   # multiprocessing's own error is not reached


def test_a_step_timeout_past_half_a_day_reaches_the_workers_within_their_own_bound(monkeypatch):
    """The workers wait twice the engine's bound (its watchdog speaks first), at most a day, the
    bound launch_local takes: a step_timeout_s of 50,000 s was refused there as 100,001 s, a figure
    the caller never gave. Stopped once launch_local has checked its settings: no process starts."""
    from orca_torch.distributed import executor, launch

    class Checked(Exception):
        pass

    def checked():                              # (the first thing launch_local does after its checks)
        raise Checked

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)

    seen, real = {}, launch.launch_local
    monkeypatch.setattr(executor, "launch_local", spy)
    monkeypatch.setattr(launch, "leave_if_importing_main", checked)
    for given, workers in ((30.0, 61.0), (50_000.0, 86_400.0), (86_400.0, 86_400.0)):
        with pytest.raises(Checked):
            DistributedExecutor(MODEL, pp=2, step_timeout_s=given)
        assert seen["step_timeout_s"] == workers


ORPHANS = '''
import time

from orca_torch.distributed import DistributedExecutor, ShardLayout
from orca_torch.distributed.control import host_store
from orca_torch.distributed.launch import control_listener, lifeline, loopback_listener, worker_context
from orca_torch.distributed.worker import ControlChannel, WorkerConfig, worker_main
from orca_torch.model.orca_model import OrcaModel

if __name__ == "__main__":
    ex = DistributedExecutor(OrcaModel("tiny"), pp=2, step_timeout_s=60, launch_timeout_s=60)   # idle workers
    # and one joining a group of two that its peer never joins (it would wait 120 s, gloo longer)
    ctx = worker_context()
    listener, init_method = loopback_listener()
    life_r, life_w = lifeline(ctx)
    cfg = WorkerConfig(ShardLayout("tiny", pp=2), None, "tiny", 0, 4, init_method, loopback=True, step_timeout_s=60)
    store = host_store(control_listener(("127.0.0.1", 0)))
    channel = ControlChannel((store.host, store.port), 0)
    joining = ctx.Process(target=worker_main, args=(0, cfg, channel, False, listener, life_r), daemon=True)
    joining.start()
    print(*[p.pid for p in ex._group.procs], joining.pid, flush=True)
    time.sleep(600)
'''


def _alive_in_group(pgid: int) -> list[str]:
    """The processes of process group `pgid` that are not zombies, as `pid command`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, pg = f.read().rsplit(")", 1)[1].split()[:3]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        if int(pg) == pgid and state != "Z":
            out.append(f"{pid} {cmd}")
    return out


def _kill_leaves_nothing(p: subprocess.Popen, held: str) -> None:
    """SIGKILL `p` (the engine's process, leader of its own group) and check that, within 10 s,
    nothing of its group is left running: its workers must end with it, not wait out their bounds
    (`held`: what they were, for the message)."""
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 10.0
    while _alive_in_group(p.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive_in_group(p.pid), f"left behind ({held}): {_alive_in_group(p.pid)}"


def _reap_group(p: subprocess.Popen) -> None:
    """Whatever the test's end, nothing of `p`'s group outlives it."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


@pytest.mark.skipif(sys.platform != "linux", reason="reads the processes from /proc")
def test_workers_end_at_once_when_the_process_that_started_them_is_killed(tmp_path):
    """A SIGKILL of the engine's process leaves no worker behind: neither idle ones (their control
    channel closes with the engine's process, and their lifeline ends) nor one still joining its group,
    which waited out the group's bound."""
    import subprocess

    script = tmp_path / "orphans.py"
    script.write_text(ORPHANS)
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ})
    out, err = Lines(p.stdout), Lines(p.stderr)
    try:
        pids = [int(pid) for pid in out.first_with("\n").split()]
        assert len(pids) == 3, err.text()[-2000:]
        _kill_leaves_nothing(p, f"workers {pids}")   # (the joining worker would stay 60 s or more)
    finally:
        _reap_group(p)
        out.text(), err.text()
        p.stdout.close()
        p.stderr.close()


def test_a_worker_whose_engine_s_process_ended_exits_with_1_saying_so(capfd):
    """A worker that its lifeline ends (the engine's process gone: here its write end closed, as the
    kernel closes it at a SIGKILL) exited with code 0, as if stopped, and said nothing. It says that
    its engine went away and exits with 1. (A worker that rank 0 under torchrun starts, by spawning.)"""
    import torch.multiprocessing as tmp
    from orca_torch.distributed.control import host_store
    from orca_torch.distributed.launch import control_listener, lifeline
    from orca_torch.distributed.worker import ControlChannel, WorkerConfig, loopback_listener, worker_main

    ctx = tmp.get_context("spawn")
    listener, init_method = loopback_listener()
    life_r, life_w = lifeline(ctx)
    store = host_store(control_listener(("127.0.0.1", 0)))
    cfg = WorkerConfig(ShardLayout(MODEL.spec, pp=2), None, "tiny", 0, 4, init_method, loopback=True,
                       step_timeout_s=60)
    joining = ctx.Process(target=worker_main, daemon=True,     # a group that its peer never joins
                          args=(0, cfg, ControlChannel((store.host, store.port), 0), False, listener, life_r))
    with listener, life_r:
        joining.start()
    life_w.close()
    joining.join(TIMEOUT_S)
    if joining.is_alive():
        joining.kill()
        joining.join()
    assert joining.exitcode == 1
    assert capfd.readouterr().err.endswith("orca_torch.distributed: worker rank 0 is leaving: its engine went away "
                                           "without stopping it (its process ended)\n")


def _joining_late(rank: int, *args) -> None:
    """`worker_main`, rank 1 starting three seconds after rank 0 (a loaded machine, a large shard)."""
    from orca_torch.distributed.worker import worker_main

    if rank == 1:
        time.sleep(3.0)
    worker_main(rank, *args)


def test_a_rank_starting_after_its_peers_within_the_launch_timeout_joins_them(monkeypatch):
    """Joining the group (the control channel, the rendezvous, a stage's tp group) was bounded by the
    workers' step bound: with a step bound of 1 s a rank starting 3 s after its peer failed the launch
    ('DistStoreError: wait timeout after 1000ms', from rank 0) though launch_timeout_s gave them a
    minute. Joining is bounded by launch_timeout_s; the group then serves its requests."""
    from orca_torch.distributed import launch

    monkeypatch.setattr(launch, "worker_main", _joining_late)
    state = {k: v.detach().clone().share_memory_() for k, v in MODEL.state_dict().items()}
    group = launch.launch_local(state, ShardLayout(MODEL.spec, pp=2), n_slots=4096, step_timeout_s=1.0,
                                launch_timeout_s=60)
    with DistributedExecutor(MODEL, pp=2, group=group, step_timeout_s=TIMEOUT_S) as ex:
        check_identical(ex, MIXED[:3], SchedulerConfig(max_bs=3))


def _group_with_a_remote_rank(ctx):
    """Two stages of `tiny` whose workers watch their peers, as under torchrun (`watch_peers`), started
    here; the engine's side holds rank 0's process only, as rank 0 under torchrun does (rank 1 runs
    elsewhere there, and its end is not seen here). Returns the group, handshaken, and both processes."""
    from orca_torch.distributed.control import host_store
    from orca_torch.distributed.launch import WorkerGroup, control_listener, handshake
    from orca_torch.distributed.worker import ControlChannel, WorkerConfig, loopback_listener, worker_main

    layout = ShardLayout(MODEL.spec, pp=2)
    listener, init_method = loopback_listener()
    cfg = WorkerConfig(layout, None, "tiny", 0, 64, init_method, loopback=True, step_timeout_s=TIMEOUT_S,
                       watch_peers=True)
    group = WorkerGroup(layout, host_store(control_listener(("127.0.0.1", 0), 2)), [None, None])
    with listener:
        procs = [ctx.Process(target=worker_main, daemon=True,
                             args=(r, cfg, ControlChannel((group.store.host, group.store.port), r), False,
                                   listener if r == 0 else None)) for r in (0, 1)]
        for p in procs:
            p.start()
    group.procs[0] = procs[0]
    group.listen()
    handshake(group, 60, same_clock=True)
    return group, procs


def test_under_torchrun_the_end_of_another_rank_is_named_at_once():
    """Under torchrun the engine's process sees only its own worker end: rank 1 SIGKILLed while the
    pipeline waited on it (two torchruns of one rank each) was said after --timeout, as "no report
    from worker rank 1 (hung?)". Rank 0's worker watches every other rank's connection (a gloo
    receive that fails when it closes) and says which one is gone, without waiting out a bound."""
    from orca_torch.distributed.launch import worker_context

    group, procs = _group_with_a_remote_rank(worker_context())
    try:
        os.kill(procs[1].pid, signal.SIGKILL)
        with pytest.raises(WorkerFailure, match=r"^worker rank 1 \(stage 1, tp rank 0\) is gone: its connection to "
                                                r"worker rank 0 closed \(its process ended, or its machine went "
                                                r"away\)$"):
            group.receive(TIMEOUT_S)
    finally:
        for p in procs:
            p.kill()
            p.join()
        group.shutdown()


def test_ranks_that_watch_each_other_stop_cleanly():
    """At a STOP each other rank sends rank 0 the receive it watches with (`PeerWatch.goodbye`): every
    rank ends with code 0 and none is reported lost. (Without it, a rank's end at a STOP may read as
    lost, and one clean two-node torchrun run in two printed "terminate called without an active
    exception" on rank 0's node, a receive left pending as the group was destroyed.)"""
    import queue
    from orca_torch.distributed.control import STOP_MESSAGE
    from orca_torch.distributed.launch import worker_context

    group, procs = _group_with_a_remote_rank(worker_context())
    try:
        group.send(range(2), list(STOP_MESSAGE))
        for p in procs:
            p.join(TIMEOUT_S)
        assert [p.exitcode for p in procs] == [0, 0]
        said = []
        try:
            while True:                                     # what reached the engine after the STOP
                item = group.inbox.get(timeout=1.0)
                said.append(item if isinstance(item, tuple) else pickle.loads(item))
        except queue.Empty:
            pass
        assert said == [("gone", 0)]                        # rank 0's end, as the engine's watch sees it; no "lost"
    finally:
        for p in procs:
            p.kill()
            p.join()
        group.shutdown()


LINK_ORPHANS = '''
from orca_torch.distributed.measured_link import measure_loopback

if __name__ == "__main__":
    measure_loopback(repeats=10**8, timeout_s=600)     # (hours of ping-pongs)
'''


def _children(pid: int) -> list[tuple[int, str]]:
    """The live children of `pid`, as (pid, command line)."""
    out = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{child}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(ppid) == pid and state != "Z":
            out.append((int(child), cmd))
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="reads the processes from /proc")
def test_the_link_measurement_s_processes_end_at_once_when_the_process_that_started_them_is_killed(tmp_path):
    """Experiment 06 measures the loopback link with two processes of its own: a SIGKILL of the
    process that started them (a `timeout`, say) ends them too, rather than leaving them to ping-pong on."""
    import subprocess

    script = tmp_path / "link_orphans.py"
    script.write_text(LINK_ORPHANS)
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ})
    err = Lines(p.stderr)
    try:
        deadline, ranks = time.monotonic() + 90, []
        while len(ranks) < 2:
            assert time.monotonic() < deadline and p.poll() is None, err.text()[-2000:]
            time.sleep(0.2)
            servers = [pid for pid, cmd in _children(p.pid) if "forkserver" in cmd]
            ranks = [pid for server in servers for pid, _ in _children(server)]
        _kill_leaves_nothing(p, f"ranks {ranks}")    # (the ping-pongs would go on for hours)
    finally:
        _reap_group(p)
        err.text()
        p.stderr.close()


def test_a_link_measurement_process_that_fails_is_named_at_once(monkeypatch):
    """A ping-pong process of the loopback link's measurement that failed (here at its first size, and
    its peer after it) ended the measurement in a bare EOFError from their closed pipe, naming
    nothing. The end of a failed process is seen as it comes, and named with its exit code."""
    from orca_torch.distributed import measured_link

    monkeypatch.setattr(measured_link, "SIZES", ("not a size",))
    with pytest.raises(RuntimeError, match=r"^the loopback link measurement ended before it was done: rank [01] "
                                           r"exited with code 1(; rank 1 exited with code 1)? \(its error is on "
                                           r"stderr\)$"):
        measured_link._measure.__wrapped__(1, 600.0)
