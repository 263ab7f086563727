"""Work over tens of thousands of objects at once without the garbage collector's full passes.

Setting up a model of 100,000 tensors builds hundreds of thousands of Python objects (views,
region descriptors, plan entries) while hundreds of thousands more are alive. CPython's collector
runs a pass every few hundred new objects and a full pass whenever the objects that survived grew
by a quarter, and every full pass walks everything alive: a large part of a subscriber's setup
went to passes that collected nothing (the objects are kept, not garbage; benchmarks/README.md
has the figures).
:func:`paused_gc` holds the collector off for such a piece of work; it runs again when the last
piece ends, and catches up on what it missed then.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
_depth = 0  # pieces of bulk work running now, in every thread
_was_enabled = False  # whether the collector ran before the first of them began


@contextmanager
def paused_gc() -> Iterator[None]:
    """Hold the garbage collector off until this block ends (and every other such block that
    began meanwhile, in any thread). A collector that the caller had disabled stays disabled."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def without_gc(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` runs with the collector paused (:func:`paused_gc`)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with paused_gc():
            return fn(*args, **kwargs)

    return run
