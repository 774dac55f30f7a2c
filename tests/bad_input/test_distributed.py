"""`python -m orca_torch.distributed` under torchrun: what a group of ranks refuses, and how it says so."""
from __future__ import annotations

import multiprocessing
import pickle
import time

import pytest
import torch

from control_peers import TIMEOUT_S, address, answer_handshake, in_thread, store_group
from orca_torch.distributed import WorkerFailure
from orca_torch.distributed.__main__ import parser, shared_settings
from orca_torch.distributed.launch import handshake, join_torchrun
from orca_torch.distributed.worker import ControlChannel


def test_a_node_started_with_other_shared_flags_is_refused_naming_them():
    """Each node's torchrun is given its own command line. A rank started with another --seed built
    other weights (its tokens silently differed; the run only said tokens_identical: false), and one
    with another --tp or --pp another layout (it hung in its first collective until --timeout, said
    as 'only 1 of 2 workers were ready'). Rank 0 refuses it as it says hello, naming the flags."""
    mine = shared_settings(parser().parse_args(["--pp", "2"]))
    theirs = shared_settings(parser().parse_args(["--pp", "2", "--seed", "5", "--control", "data"]))
    group = store_group(pp=2)
    try:
        rank1, joined = in_thread(join_torchrun, 1, address(group), TIMEOUT_S, theirs)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"^rank 1 was started with --seed 5 --control data but rank 0 with "
                                                r"--seed 0 --control apart: give every node's torchrun the same "
                                                r"--tp, --pp, --model, --seed, --control, --device$"):
            handshake(group, 6 * TIMEOUT_S, settings=mine)
        assert time.monotonic() - t0 < 3 * TIMEOUT_S   # at its hello, not at the handshake's deadline
        rank1.join(TIMEOUT_S)
        # (its own node said it too: it had gone on to join the process group, to fail with a traceback)
        assert isinstance(joined[0], WorkerFailure) and str(joined[0]).startswith(
            "rank 0 refused rank 1: rank 1 was started with --seed 5 --control data but rank 0 with --seed 0")
    finally:
        group.shutdown()


def test_a_node_started_with_the_same_shared_flags_joins():
    settings = shared_settings(parser().parse_args(["--pp", "2", "--requests", "3"]))
    group = store_group(pp=2)
    try:
        rank0, went0 = in_thread(answer_handshake, ControlChannel(address(group), 0))
        rank1, went1 = in_thread(lambda: answer_handshake(join_torchrun(1, address(group), TIMEOUT_S, settings)))
        handshake(group, TIMEOUT_S, settings=settings)
        rank0.join(TIMEOUT_S)
        rank1.join(TIMEOUT_S)
        assert went0 == went1 == ["go"]
    finally:
        group.shutdown()


DEEP = b"\x80\x04" + b"]" * 100_000 + b"a" * 99_999 + b"."      # a list in a list ... 100,000 deep
SHARED = b"\x80\x04]" + b"2\x86" * 64 + b"."                       # (x, x) of (x, x) of ..., 64 deep
ERROR_DEEP = b"\x80\x04\x8c\x05errorK\x01" + DEEP[2:-1] + b"\x87."       # ("error", 1, DEEP's list)
HELLO_SHARED = b"\x80\x04\x8c\x05helloK\x01" + SHARED[2:-1] + b"\x87."  # ("hello", 1, SHARED's tuple)


@pytest.mark.parametrize("pushed, says", [
    (b"not a pickle", r"^a message on the control channel that no worker sends \(12 bytes: UnpicklingError: "),
    (b"", r"^a message on the control channel that no worker sends \(0 bytes: EOFError: "),
    (pickle.dumps(("hello", 7, ())), r"^a message on the control channel that no worker sends: \('hello', 7, \(\)\)$"),
    (pickle.dumps(("gone", 1)), r"^a message on the control channel that no worker sends: \('gone', 1\)$"),
    (pickle.dumps(("ready", 1, 0.0)), r"^unexpected control message \('ready', 1, 0.0\) while the workers were "
                                      r"joining$"),
    pytest.param(DEEP, r"^a message on the control channel that no worker sends: \[\[\[\[\[\.\.\.\]\]\]\]\]$",
                 id="deep"),
    pytest.param(pickle.dumps(("done", 1, 10 ** 5000)), r"^a message on the control channel that no worker sends: "
                 r"\('done', 1, <an integer of about 5001 digits>\)$", id="long-int"),
    pytest.param(SHARED, r"^a message on the control channel that no worker sends: \(\(\(\(\(\.\.\.\), \(\.\.\.\)\), ",
                 id="shared"),
    pytest.param(pickle.dumps(("hello", 1, (1,))), r"^a message on the control channel that no worker sends: "
                 r"\('hello', 1, \(1,\)\)$", id="hello-not-pairs"),
    pytest.param(ERROR_DEEP, r"^a message on the control channel that no worker sends: "
                 r"\('error', 1, \[\[\[\[\.\.\.\]\]\]\]\)$", id="error-deep"),
    pytest.param(HELLO_SHARED, r"^a message on the control channel that no worker sends: "
                 r"\('hello', 1, \(\(\(\(\.\.\.\), ", id="hello-shared")])
def test_a_message_no_rank_sends_on_the_control_port_is_refused_naming_it(pushed, says):
    """Anyone who reaches the control port may push onto the engine's queue: what is not a pickle (the
    empty one, which the engine itself pushes only as it shuts down, included), a rank outside the
    group, the end of a process, which only the engine's own watch says, or a rank ready before its
    hello is a misconfigured group, said at once. What arrived is said in brief: a list nested 100,000
    deep (its full repr raised RecursionError, not this failure), an int too long for repr (ValueError),
    and a tuple of 2**64 shared leaves in 132 bytes (its full repr never ended). A kind that a rank
    sends, from a rank of the group, whose fields are not what a rank sends is one too: the engine read
    a hello's settings that were no (flag, value) pairs (TypeError), and printed the traceback of an
    error, which was no string (RecursionError), or hashed the settings (they never hashed)."""
    from orca_torch.distributed.control import TO_ENGINE, join_store

    group = store_group(pp=2)
    try:
        join_store(address(group), TIMEOUT_S).queue_push(TO_ENGINE, pushed)
        with pytest.raises(WorkerFailure, match=says):
            handshake(group, TIMEOUT_S, settings=())
    finally:
        group.shutdown()


CALLED = []


def _called(*args) -> None:
    CALLED.append(args)


class _Calls:
    """Pickled, a call of `_called` as it is read."""

    def __reduce__(self):
        return _called, ("as the message was read",)


def test_a_pickle_that_calls_a_function_is_refused_without_calling_it():
    """A pickle names any function to call as it is read: one pushed onto the engine's queue by anyone
    who reaches the control port ran in the engine's process (os.system ran a shell command there).
    Control messages are plain values, and the engine refuses a pickle that names anything."""
    from orca_torch.distributed.control import TO_ENGINE, join_store

    group = store_group(pp=2)
    try:
        join_store(address(group), TIMEOUT_S).queue_push(TO_ENGINE, pickle.dumps(_Calls()))
        with pytest.raises(WorkerFailure, match=r"^a message on the control channel that no worker sends \(\d+ bytes: "
                                                r"UnpicklingError: it names \S+\._called, and control messages hold "
                                                r"plain values only\)$"):
            handshake(group, TIMEOUT_S, settings=())
    finally:
        group.shutdown()
    assert CALLED == []


@pytest.mark.parametrize("pushed, says", [
    (b"not a pickle", r" \(12 bytes: UnpicklingError: "),
    (pickle.dumps(print), r" \(\d+ bytes: UnpicklingError: it names builtins\.print, and control messages hold "
                          r"plain values only\)$"),
    (pickle.dumps("garbage"), r": 'garbage'$"),
    (pickle.dumps([1, 7, 0, 0, 1, 0, 3, 0, 1]), r": \[1, 7, 0, 0, 1, 0, 3, 0, 1\]$")])     # 3 tokens announced, 1 given
def test_a_message_the_engine_does_not_send_on_a_workers_queue_is_named_in_its_failure(pushed, says):
    """Anyone who reaches the control port may push onto a worker's queue too: the worker's failure says
    what arrived (it was an UnpicklingError's traceback, or "'g' is not a valid Kind")."""
    from orca_torch.distributed import DistributedExecutor
    from orca_torch.distributed.control import join_store, to_worker
    from tiny_model import MODEL

    ex = DistributedExecutor(MODEL, step_timeout_s=TIMEOUT_S, launch_timeout_s=60)
    try:
        join_store(address(ex._group), TIMEOUT_S).queue_push(to_worker(0), pushed)
        with pytest.raises(WorkerFailure, match=r"^worker rank 0 \(stage 0, tp rank 0\) failed:\na message on the "
                                                r"control channel that the engine does not send" + says):
            ex._group.receive(TIMEOUT_S)
    finally:
        ex.close()


def test_more_requests_than_rank_0_can_hold_are_refused_before_any_process_group(monkeypatch, capsys):
    """--requests 1000000000 started the group, then failed making the requests with numpy's
    MemoryError traceback (or ran the machine out of memory)."""
    import orca_torch.checks as checks
    from orca_torch.distributed import __main__ as entry

    monkeypatch.setattr(entry, "serve", lambda *a: pytest.fail("serve reached"))
    monkeypatch.setattr(entry, "control_listener", lambda *a: pytest.fail("control port bound"))
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29611").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 16 * 10**9)
    with pytest.raises(SystemExit) as exc:
        entry.main(["--requests", "1000000000"])
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == ""
    assert out.err.strip().splitlines()[-1] == (
        "python -m orca_torch.distributed: error: --requests 1,000,000,000 (at least 1,000 bytes a request, held "
        "by rank 0) needs 1,000.0 GB of memory, but only 16.0 GB is available here")


def test_a_control_address_other_than_loopback_needs_trusted_network(monkeypatch, capsys):
    """With a MASTER_ADDR of the network (or 0.0.0.0), rank 0 opened the control port there, with no
    authentication and not a word. It is refused unless --trusted-network says the network is trusted.
    (The port is not bound here: an unbound socket's address is 0.0.0.0.)"""
    import socket
    from orca_torch.distributed import __main__ as entry

    served = []
    monkeypatch.setattr(entry, "serve", lambda args, cfg, listener: served.append(listener.getsockname()) or 0)
    monkeypatch.setattr(entry, "control_listener", lambda *a: socket.socket())
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="0.0.0.0",
                     MASTER_PORT="29611").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exc:
        entry.main([])
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == "" and served == []
    assert out.err.strip().splitlines()[-1] == (
        "python -m orca_torch.distributed: error: the control channel would listen on 0.0.0.0:29612 "
        "(MASTER_ADDR=0.0.0.0), not a loopback address, and it has no authentication: anyone who reaches the port "
        "could push messages to the engine and the workers; add --trusted-network where every host that can reach "
        "it is trusted (a run over several machines), or keep a one-machine run on loopback "
        "(--control-addr 127.0.0.1)")
    assert entry.main(["--trusted-network"]) == 0 and served == [("0.0.0.0", 0)]


def test_more_threads_per_worker_than_cores_are_refused_before_any_process_starts():
    """threads=100000 started the group, and every worker aborted inside torch.set_num_threads (the
    launch said only 'exited with code -6')."""
    import os

    from orca_torch.distributed import DistributedExecutor
    from tiny_model import MODEL

    before = len(multiprocessing.active_children())
    cores = os.cpu_count() or 1
    with pytest.raises(ValueError, match=rf"^threads must be an integer in \[1, {cores}\], got {100_000}$"):
        DistributedExecutor(MODEL, pp=2, threads=100_000)
    assert len(multiprocessing.active_children()) == before


def test_a_bad_sampling_seed_is_refused_before_any_process_starts():
    """`seed` seeds the draws of the sampled requests without a seed of their own, as the torch
    executor's does, and is refused as that one is."""
    from orca_torch.distributed import DistributedExecutor
    from tiny_model import MODEL

    before = len(multiprocessing.active_children())
    for bad, got in ((-1, "-1"), (2**63, str(2**63)), (1.5, "1.5")):
        with pytest.raises(ValueError, match=rf"^seed must be an integer with 0 <= seed < 2\*\*63, got {got}$"):
            DistributedExecutor(MODEL, pp=2, seed=bad)
    assert len(multiprocessing.active_children()) == before


def test_an_unknown_link_name_is_a_value_error():
    """get_link('h100') was an AssertionError (and, under python -O, measured the loopback link)."""
    from orca_torch.distributed.measured_link import get_link

    for name in ("h100", None):
        with pytest.raises(ValueError, match=rf"^unknown link {name!r}; known links: cpu "):
            get_link(name)


def test_a_worker_group_of_another_kind_or_layout_is_refused():
    """group=5 was an AttributeError ('int' object has no attribute 'layout'); a group of another
    layout an AssertionError."""
    from orca_torch.distributed import DistributedExecutor, ShardLayout, WorkerGroup
    from tiny_model import MODEL

    with pytest.raises(ValueError, match=r"^group must be a WorkerGroup, got 5$"):
        DistributedExecutor(MODEL, group=5)
    group = WorkerGroup(ShardLayout(MODEL.spec, 1, 2), None)
    with pytest.raises(ValueError, match=r"^the worker group holds tiny \(4-byte weights\) as tp=1 x pp=2, but this "
                                         r"executor was asked for tiny \(4-byte weights\) as tp=1 x pp=1$"):
        DistributedExecutor(MODEL, group=group)


@pytest.mark.parametrize("args, match", [
    (("tiny", None), r"^layout must be a ShardLayout, got 'tiny' \(str\)$"),
    ((None, None), r"^layout must be a ShardLayout, got None$"),
    ((lambda: _layout(), "a store"), r"^store must be a Store or None, got 'a store' \(str\)$"),
    ((lambda: _layout(), None, 5), r"^procs must be a list of one process a rank \(None for a rank started elsewhere\), "
                                   r"2 for tp x pp = 1 x 2, or None, got 5$"),
    ((lambda: _layout(), None, [None]), r"^procs must be a list .* got \[None\]$")])
def test_a_worker_group_of_bad_parts_is_refused_where_it_is_built(args, match):
    """WorkerGroup took anything: a layout given by name was refused by the executor it was handed to
    with an AttributeError ('str' object has no attribute 'spec'), and procs=5 only when the executor
    stopped the group (a TypeError)."""
    from orca_torch.distributed import WorkerGroup

    with pytest.raises(ValueError, match=match):
        WorkerGroup(*(a() if callable(a) else a for a in args))


def _layout():
    from orca_torch.distributed import ShardLayout

    return ShardLayout("tiny", pp=2)


@pytest.mark.parametrize("bad, match", [
    ({"layout": None}, "layout must be a ShardLayout"),
    ({"n_slots": 0}, "n_slots must be"),
    ({"control": "sideways"}, "sideways"),
    ({"state": None}, r"^state must be a dict, got None$"),
    ({"step_timeout_s": -1}, r"^step_timeout_s must be a finite number of seconds in \(0, 86400\], got -1$"),
    ({"launch_timeout_s": float("nan")}, r"^launch_timeout_s must be a finite number of seconds"),
    ({"device": "tpu"}, r"^unknown device 'tpu'; choose one of 'cpu', 'cuda'$"),
    pytest.param({"device": "cuda"}, r"^tp x pp = 1 workers on cuda need as many GPUs .* but 0 are visible$",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")),
    ({"dtype": "int8"}, r"^dtype must be one of float32, .* got 'int8'$"),
    ({"threads": 0}, r"^threads must be an integer in \[1, "),
    ({"attention": "sideways"}, r"^attention must be one of \('split', 'fused'\), got 'sideways'$")])
def test_launch_local_refuses_what_its_workers_could_not_run_before_any_starts(bad, match):
    """A control given by name that is not one, a layout that is none or no K/V slots: refused here,
    not found by the workers (a control name was taken as `Control.DATA`, and the engine then waited
    out `step_timeout_s` for a control message that would never come). So are the rest of its
    settings: device='tpu' ran the workers on the CPU without a word, a negative step_timeout_s was
    handed to every wait, and threads=0, an unknown attention path or no state were each found by
    every worker, a traceback apiece."""
    from orca_torch.distributed.launch import launch_local
    from orca_torch.distributed.shard import ShardLayout
    from orca_torch.specs import get_model_spec

    kw = {"state": {}, "layout": ShardLayout(get_model_spec("tiny")), "n_slots": 64, "control": "apart", **bad}
    state, layout, before = kw.pop("state"), kw.pop("layout"), len(multiprocessing.active_children())
    with pytest.raises(ValueError, match=match):
        launch_local(state, layout, **kw)
    assert len(multiprocessing.active_children()) == before


def _state(change):
    """The tiny model's state_dict, changed by `change` (a dict -> None)."""
    from tiny_model import MODEL

    state = dict(MODEL.state_dict())
    change(state)
    return state


@pytest.mark.parametrize("change, match", [
    (lambda s: s.pop("layers.1.wo"), r"it lacks 'layers\.1\.wo'$"),
    (lambda s: s.update(extra=torch.zeros(1)), r"it holds keys the model has not: 'extra'$"),
    (lambda s: s.update(final_norm=torch.zeros(32)),
     r"final_norm is a torch\.float32 tensor of shape \[32\], not a floating-point one of shape \[64\]$"),
    (lambda s: s.update(embed=s["embed"].long()), r"embed is a torch\.int64 tensor of shape \[256, 64\]"),
    (lambda s: s.update(final_norm=[1.0] * 64), r"final_norm is \[1\.0, .*\], not a tensor$"),
    (lambda s: s.clear(), r"it lacks 'embed', 'final_norm', 'lm_head\.weight', 'layers\.0\.attn_norm' and 11 more$")])
def test_launch_local_refuses_a_state_that_is_not_the_layouts_model_before_any_worker_starts(change, match):
    """A state with a weight missing, one of another shape or dtype, one that is no tensor, or a key
    the model has not: each worker cut its shard from it and failed with its traceback (a KeyError in
    slice_state, a size mismatch in copy_), or, for an extra key, ran without a word."""
    from orca_torch.distributed.launch import launch_local
    from orca_torch.distributed.shard import ShardLayout
    from tiny_model import MODEL

    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"^state must be the whole 'tiny' model's state_dict \(OrcaModel\.state_dict"
                                         r"\(\), the model the layout splits\): " + match):
        launch_local(_state(change), ShardLayout(MODEL.spec, tp=2), n_slots=64, launch_timeout_s=TIMEOUT_S)
    assert len(multiprocessing.active_children()) == before


def test_a_sampling_that_is_not_sampling_params_is_refused_by_the_distributed_executor():
    """The distributed executor draws as the torch executor does, and refuses what it refuses."""
    from orca_torch.core.request import Request
    from orca_torch.distributed import DistributedExecutor
    from orca_torch.model.sampling import SamplingParams
    from tiny_model import MODEL

    with DistributedExecutor(MODEL, step_timeout_s=TIMEOUT_S, launch_timeout_s=60) as ex:
        with pytest.raises(ValueError, match=r"^request 0: sampling must be a SamplingParams"):
            ex.check(Request(0, 0.0, 2, 3, prompt_ids=[1, 2], sampling={"temperature": 0.7}))
        with pytest.raises(ValueError, match=r"sampling without a seed draws from a seed derived from its "
                                             r"req_id's repr"):
            ex.check(Request(object(), 0.0, 2, 3, prompt_ids=[1, 2], sampling=SamplingParams(temperature=0.7)))
        with pytest.raises(ValueError, match=r"^request 3: logit_bias token ids must lie in \[0, \d+\), got 9999$"):
            ex.check(Request(3, 0.0, 2, 3, prompt_ids=[1, 2], sampling=SamplingParams(logit_bias={9999: 1.0})))
        ex.check(Request(1, 0.0, 2, 3, prompt_ids=[1, 2], sampling=SamplingParams(temperature=0.7)))