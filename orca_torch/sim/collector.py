"""Python's cyclic garbage collector paused while many small objects are made (a speed layer).

A simulated run allocates millions of small tuples and lists and frees them all by reference
counting: it makes no reference cycles. A workload of a million requests, or its copy, is a
million objects that stay. Yet every so many allocations the collector scans the objects it
tracks, and now and then all of them, the long-lived requests included: a quarter of a
1,000,000-request run's time. `cyclic_gc_paused()` turns it off for such a stretch and back on
after, on an error too; a caller who has turned it off keeps it off. The collector is the whole
process's: while `FastEngine.run` goes (`fast_engine.py`), cycles made by the caller's own code (a
step-time function, a progress callback) wait for the run's end to be collected, and other threads
run without the collector too. `step()` called by hand pauses nothing, nor does the core `Engine`.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The collector off inside the block (if it was on), restored after."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
