"""The Attention K/V manager: reservation, in-place writes, slot accounting, and its errors (§4.2, §4.3)."""
from __future__ import annotations

import re

import pytest
import torch

from orca_torch.core.batch import SeqWork
from orca_torch.model.kv_cache import KVManager, OutOfSlotsError
from orca_torch.model.orca_model import OrcaModel
from orca_torch.specs import get_model_spec

TINY = get_model_spec("tiny")


@pytest.fixture(scope="module")
def model() -> OrcaModel:
    return OrcaModel("tiny", seed=3)


def _state(kv: KVManager, ids) -> tuple:
    return kv.slots_reserved, kv.slots_used, kv.n_requests, tuple(kv.length(r) if kv.has(r) else None for r in ids)


def test_reserve_commit_free_accounting():
    kv = KVManager(TINY, n_slots=100)
    kv.reserve("a", 30)
    kv.reserve("b", 50)
    assert (kv.slots_reserved, kv.slots_used, kv.slots_free, kv.n_requests) == (80, 0, 20, 2)
    assert kv.storage("a").shape == (TINY.n_layers, 2, TINY.n_kv_heads, 30, TINY.head_dim)
    kv.commit("a", 12)
    kv.commit("b", 1)
    kv.commit("a", 3)
    assert (kv.length("a"), kv.length("b"), kv.capacity("a"), kv.capacity("b")) == (15, 1, 30, 50)
    assert (kv.slots_reserved, kv.slots_used) == (80, 16)
    kv.free("a")
    assert not kv.has("a") and kv.has("b")
    assert (kv.slots_reserved, kv.slots_used, kv.slots_free) == (50, 1, 50)
    kv.reserve("a", 50)                       # a freed id may be admitted again, empty
    assert kv.length("a") == 0 and kv.slots_free == 0


def test_read_returns_views_of_the_stored_tokens():
    kv = KVManager(TINY, n_slots=10)
    kv.reserve(7, 10)
    buf = kv.storage(7)
    buf[1, 0, :, :4] = torch.arange(4.0)[None, :, None]
    kv.commit(7, 4)
    k, v = kv.read(7, 1)
    assert k.shape == v.shape == (TINY.n_kv_heads, 4, TINY.head_dim)
    assert torch.equal(k[0, :, 0], torch.arange(4.0))
    assert k.data_ptr() == buf[1, 0].data_ptr()        # a view, not a copy


def test_over_reserving_n_slots_is_an_error_and_changes_nothing():
    kv = KVManager(TINY, n_slots=64)
    kv.reserve(0, 40)
    before = _state(kv, [0, 1])
    with pytest.raises(OutOfSlotsError, match=r"cannot reserve 25 slots .* only 24 of n_slots=64"):
        kv.reserve(1, 25)
    assert isinstance(OutOfSlotsError("x"), ValueError)
    assert _state(kv, [0, 1]) == before and not kv.has(1)
    kv.reserve(1, 24)
    assert kv.slots_free == 0


def test_an_unknown_request_and_a_double_free_fail_assertions_with_clear_messages():
    kv = KVManager(TINY, n_slots=10)
    with pytest.raises(AssertionError, match="never reserved") as e:
        kv.length("ghost")
    assert str(e.value).startswith("unknown request 'ghost'")
    with pytest.raises(AssertionError, match="holds no reservation"):
        kv.free("ghost")
    kv.reserve("r", 5)
    kv.commit("r", 2)
    kv.free("r")
    with pytest.raises(AssertionError, match="holds no reservation \\(never reserved, or freed already\\)"):
        kv.free("r")
    with pytest.raises(AssertionError,
                       match="^unknown request 'r': never reserved, or freed already; reserve it first$"):
        kv.storage("r")
    assert (kv.slots_reserved, kv.slots_used) == (0, 0)


def test_writing_past_the_reservation_is_not_allowed():
    kv = KVManager(TINY, n_slots=10)
    kv.reserve("r", 4)
    kv.commit("r", 3)
    assert kv.can_append("r", 3, 1) and not kv.can_append("r", 3, 2) and not kv.can_append("r", 2, 1)
    with pytest.raises(AssertionError, match="^" + re.escape(
            "request 'r': committing 2 tokens after 3 exceeds its reservation of 4 (reserve it at least 5 tokens "
            "from the start: a reservation does not grow)") + "$"):
        kv.commit("r", 2)                           # the model commits only what can_append allowed
    with pytest.raises(AssertionError, match="^" + re.escape(
            "request 'r': committing -1 tokens (a commit stores 0 or more)") + "$"):
        kv.commit("r", -1)                          # not an overflow: said as what it is
    assert kv.length("r") == 3 and kv.slots_used == 3


def test_bad_counts_are_value_errors_and_what_the_engine_never_asks_fails_an_assertion():
    with pytest.raises(ValueError, match="n_slots must be an integer >= 1"):
        KVManager(TINY, n_slots=0)
    kv = KVManager(TINY, n_slots=10_000)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="n_tokens must be an integer >= 1"):
            kv.reserve("x", bad)
    with pytest.raises(ValueError, match="at most the model's max_context=512 tokens"):   # reserve is called by hand too
        kv.reserve("x", 513)
    kv.reserve("x", 8)
    with pytest.raises(AssertionError, match="already holds a reservation"):
        kv.reserve("x", 8)


def test_model_writes_in_place_and_never_rewrites_stored_tokens(model):
    kv = model.new_kv(64)
    kv.reserve("r", 40)
    ptr = kv.storage("r").data_ptr()
    model.forward_batch(torch.arange(10), [SeqWork(10, 0)], ["r"], kv)
    first = kv.storage("r")[..., :10, :].clone()
    assert first.abs().sum() > 0
    assert kv.storage("r")[..., 10:, :].abs().sum() == 0      # nothing beyond the stored tokens
    model.forward_batch(torch.arange(5), [SeqWork(5, 10)], ["r"], kv)
    model.forward_batch(torch.tensor([3]), [SeqWork(1, 15)], ["r"], kv)
    assert kv.storage("r").data_ptr() == ptr                   # same buffer: no re-allocation
    assert torch.equal(kv.storage("r")[..., :10, :], first)    # earlier tokens untouched
    assert kv.length("r") == 16 and kv.slots_used == 16 and kv.slots_reserved == 40


def test_a_step_that_would_overflow_one_request_changes_no_request(model):
    kv = model.new_kv(64)
    kv.reserve("a", 20)
    kv.reserve("b", 6)
    model.forward_batch(torch.arange(9), [SeqWork(4, 0), SeqWork(5, 0)], ["a", "b"], kv)
    before = _state(kv, ["a", "b"])
    snapshot = {r: kv.storage(r).clone() for r in ("a", "b")}
    with pytest.raises(AssertionError, match="do not fit"):
        model.forward_batch(torch.arange(5), [SeqWork(3, 4), SeqWork(2, 5)], ["a", "b"], kv)
    with pytest.raises(AssertionError, match="unknown request 'nobody': never reserved"):
        model.forward_batch(torch.arange(2), [SeqWork(1, 4), SeqWork(1, 0)], ["a", "nobody"], kv)
    assert _state(kv, ["a", "b"]) == before
    assert all(torch.equal(kv.storage(r), snapshot[r]) for r in ("a", "b"))


def _holds_id(store, req_id) -> bool:
    """Whether any container the store keeps still names `req_id`."""
    return any(isinstance(v, (dict, set, list)) and req_id in v for v in vars(store).values())


def test_a_freed_request_leaves_no_trace_in_the_store():
    """A server's store lives for millions of requests: what it keeps is what it holds now."""
    kv = KVManager(TINY, n_slots=10)
    kv.reserve("gone", 5)
    kv.free("gone")
    assert not _holds_id(kv, "gone")
