"""Clipper's prediction cache: keyed by (model, input), CLOCK eviction, bounded in bytes (lecture §2.1).

Identical queries are common in serving (a popular item, a retry), so the model-abstraction layer
looks every (model, input) pair up before queueing it. Three properties, each tested:

- **CLOCK** approximates LRU without reordering on every hit: entries sit on a ring with a
  reference bit; a hit only sets the bit. To make room the hand sweeps: a set bit is cleared and the
  entry passed over (a second chance), a clear bit is evicted. New entries join just behind the hand,
  so they are examined last. (An `OrderedDict` is the ring: its front is under the hand.)
- **Bounded in bytes**, not entries: outputs differ in size (a dict or list of arrays is counted with
  its contents). A value larger than the whole cache is returned to its waiters but not stored.
- **In-flight sharing**: a miss registers the key as pending before the model runs; a second query
  for the same key while it runs gets the *same* future instead of a second computation. Pending
  entries hold no bytes and are never evicted (the hand passes them). The shared future is marked
  running, so one waiter's `cancel()` cannot take the answer from the others.

Thread-safe (one lock); futures are `concurrent.futures.Future`, completed after the lock is
released, so a done-callback may use the cache.
"""
from __future__ import annotations

import hashlib
import pickle
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from orca_torch.checks import brief, check_callable, check_instance, check_int, is_int

from .container import ModelContainer, _predict, check_inputs, check_name


def input_key(x: Any) -> bytes:
    """A stable digest of an input: its type, then arrays and tensors by dtype, shape and bytes;
    others by pickle (an array of Python objects, whose bytes are addresses, too, and an array
    subclass such as a masked array, whose mask is no part of its bytes).

    The type is part of the key so that a caller never gets back an output computed for another
    kind of input with the same values (a numpy caller handed a tensor's answer)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{type(x).__module__}.{type(x).__qualname__};".encode())
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch
        h.update(f"{x.device};".encode())           # (a model may answer on its input's device)
        t = x.detach().cpu().resolve_conj().resolve_neg()
        try:
            x = t.numpy()
        except TypeError:  # a dtype numpy lacks (bfloat16): its raw bytes, beside its dtype and shape
            import torch  # already loaded: x is a tensor

            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            return h.digest()
    if type(x) is np.ndarray and not x.dtype.hasobject:     # (a subclass may carry more: a mask)
        h.update(str(x.dtype).encode() + str(x.shape).encode())
        h.update(np.ascontiguousarray(x).tobytes())
    else:
        h.update(pickle.dumps(x, protocol=4))
    return h.digest()


def nbytes_of(v: Any) -> int:
    """Bytes a cached output keeps alive: the whole buffer under an array or tensor (a row of a
    batch's output, a view, holds the batch's); a dict, list, tuple or set with everything in it
    (an object or a buffer held twice counted once); anything else by `sys.getsizeof`.

    A container must count its contents, or a model answering with dicts of arrays would fill
    memory while the cache believes it holds a few hundred bytes; and a view its buffer, or rows
    of a large batch would."""
    seen: set = set()

    def size(o: Any) -> int:
        if id(o) in seen:
            return 0
        seen.add(id(o))
        if hasattr(o, "untyped_storage"):          # torch.Tensor, without importing torch
            try:
                storage = o.untyped_storage()
            except (RuntimeError, NotImplementedError):     # no storage of its own (a sparse tensor)
                return int(o.element_size() * o.nelement())
            if ("storage", storage.data_ptr()) in seen:
                return 0
            seen.add(("storage", storage.data_ptr()))
            return int(storage.nbytes())
        if isinstance(o, np.ndarray):
            objects = sum(size(e) for e in o.flat) if o.dtype.hasobject else 0
            base = o
            while isinstance(base.base, np.ndarray):
                base = base.base
            if base is not o:
                if id(base) in seen:
                    return objects
                seen.add(id(base))
            return int(base.nbytes) + objects
        n = int(sys.getsizeof(o))
        if isinstance(o, dict):
            return n + sum(size(k) + size(e) for k, e in o.items())
        if isinstance(o, (list, tuple, set, frozenset)):
            return n + sum(size(e) for e in o)
        return n

    return size(v)


@dataclass
class _Entry:
    future: Future
    nbytes: int = 0
    referenced: bool = False
    pending: bool = True        # until `put` stores the value (its future is completed just after)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    shared: int = 0        # lookups that joined a computation already in flight
    evictions: int = 0
    too_large: int = 0     # values larger than the whole cache, not stored


class PredictionCache:
    """CLOCK cache of model outputs keyed by (model name, input digest), at most `capacity_bytes`."""

    def __init__(self, capacity_bytes: int, size_of: Callable[[Any], int] = nbytes_of) -> None:
        self.capacity_bytes = check_int("capacity_bytes", capacity_bytes, 1)
        self._size_of = check_callable("size_of", size_of, "(value) -> bytes (an int >= 0)")
        self._ring: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._models: dict[str, Any] = {}  # name -> the container a CachedModel answers for
        self.stats = CacheStats()

    def claim_name(self, name: str, model: Any) -> None:
        """Reserve `name` for `model`: answers are keyed by name, so a second, different model of the
        same name would silently be handed the first one's outputs. The same model may claim again."""
        check_name(name)
        with self._lock:
            owner = self._models.setdefault(name, model)
        if owner is not model:
            raise ValueError(f"this cache already answers for another model named {brief(name)}: its outputs would "
                             "be returned for this one; give each model its own name (a version suffix) or "
                             "its own cache")

    @staticmethod
    def key(model: str, x: Any) -> tuple[str, bytes]:
        return (model, input_key(x))

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._ring)

    def keys(self) -> list[Hashable]:
        """Keys in ring order, starting under the hand."""
        with self._lock:
            return list(self._ring)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            e = self._ring.get(key)
            return e is not None and not e.pending

    def fetch(self, model: str, x: Any) -> tuple[Future, bool]:
        """`(future, owner)`: a hit or a shared in-flight future (owner False), or a new pending entry
        whose owner must run the model and call `put` (or `fail`)."""
        return self.fetch_key(self.key(model, x))

    def fetch_key(self, key: Hashable) -> tuple[Future, bool]:
        """`fetch` by a key made with `key(model, x)`."""
        with self._lock:
            e = self._ring.get(key)
            if e is not None:
                if e.pending:
                    self.stats.shared += 1
                else:
                    self.stats.hits += 1
                    e.referenced = True
                return e.future, False
            self.stats.misses += 1
            e = _Entry(Future())
            e.future.set_running_or_notify_cancel()     # (a running future cannot be cancelled)
            self._ring[key] = e
            return e.future, True

    def put(self, model: str, x: Any, value: Any) -> None:
        """Store a computed output and complete every query waiting for it."""
        self.put_key(self.key(model, x), value)

    def put_key(self, key: Hashable, value: Any) -> None:
        """`put` by a key made with `key(model, x)`."""
        cause = None
        try:
            size = self._size_of(value)
        except Exception as exc:
            size, cause = None, exc
        if not (is_int(size) and size >= 0):  # the waiters hear of it too, and the key is forgotten
            got = f"raised {type(cause).__name__}: {cause}" if cause is not None else f"returned {brief(size)}"
            err = ValueError(f"size_of must return an integer number of bytes >= 0, but it {got} "
                             f"for a value of type {type(value).__name__}")
            self.fail_key(key, err)
            raise err from cause
        size = int(size)
        with self._lock:
            e = self._ring.get(key)
            if e is not None and not e.pending:
                return  # already computed (e.g. by a racing put): keep the stored one
            if e is None:
                e = _Entry(Future())
            else:
                del self._ring[key]  # re-inserted below, behind the hand, once it has bytes
            e.pending = False
            if size <= self.capacity_bytes:
                self._evict(self._bytes + size - self.capacity_bytes)
                e.nbytes = size
                self._ring[key] = e
                self._bytes += size
            else:
                self.stats.too_large += 1
        e.future.set_result(value)

    def fail(self, model: str, x: Any, exc: BaseException) -> None:
        """The computation failed: pass the error to every waiter and forget the key."""
        self.fail_key(self.key(model, x), exc)

    def fail_key(self, key: Hashable, exc: BaseException) -> None:
        """`fail` by a key made with `key(model, x)`."""
        with self._lock:
            e = self._ring.get(key)
            if e is None or not e.pending:
                return  # nothing in flight: a stored value stays
            del self._ring[key]
        e.future.set_exception(exc)

    def _evict(self, need: int) -> None:
        """The CLOCK sweep: free at least `need` bytes (lock held)."""
        passes = 0
        while need > 0 and self._ring:
            key, e = next(iter(self._ring.items()))
            if e.pending or e.referenced:
                e.referenced = False
                self._ring.move_to_end(key)  # second chance: the hand moves past it
                passes += 1
                if passes > 2 * len(self._ring):
                    break  # only pending entries left: they hold no bytes
                continue
            del self._ring[key]
            self._bytes -= e.nbytes
            need -= e.nbytes
            self.stats.evictions += 1
            passes = 0                  # (two rounds of the smaller ring: a bit cleared, then a victim)


class CachedModel:
    """A container in front of a container: answers from the cache, runs the model on the misses once.

    Duplicates inside one batch, and queries already in flight from another thread, are computed once.
    Models sharing a cache need names of their own (answers are keyed by name): a second model under
    a name the cache already answers for is refused.

    Answers are shared, not copied: every caller of the same input gets the very object the cache
    holds (copying would cost every hit). Treat them as read-only; a caller that changes one (appends
    to a returned list, writes into a returned array) changes what every later caller gets.
    """

    def __init__(self, model: ModelContainer, cache: PredictionCache) -> None:
        self.model = check_instance("model", model, ModelContainer)
        self.cache = check_instance("cache", cache, PredictionCache)
        cache.claim_name(model.name, model)
        self.name = model.name

    def predict_batch(self, inputs: Sequence[Any]) -> list[Any]:
        check_inputs(self.name, inputs)
        keys = []
        for i, x in enumerate(inputs):          # every key first: an input that has none registers nothing
            try:
                keys.append(self.cache.key(self.name, x))
            except Exception as e:
                raise TypeError(f"{self.name}: input {i} ({type(x).__name__}) cannot be a cache key ({e}); "
                                "inputs must be arrays, tensors or values pickle can save") from e
        futures: list[Future] = []
        todo: list[tuple[Hashable, Any]] = []
        for key, x in zip(keys, inputs):
            fut, owner = self.cache.fetch_key(key)
            futures.append(fut)
            if owner:
                todo.append((key, x))
        if todo:
            try:
                for (key, _), y in zip(todo, _predict(self.model, [x for _, x in todo])):
                    self.cache.put_key(key, y)
            except BaseException as exc:  # a failed model or put: no key of this batch stays pending
                for key, _ in todo:
                    self.cache.fail_key(key, exc)
                raise
        return [f.result() for f in futures]
