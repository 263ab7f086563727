"""Run by every Python process the tests start (tests/conftest.py puts this folder first on
``PYTHONPATH``): the garbage collector's passes come after ``FIRST_PASS`` new objects instead of
CPython's 700.

The tests start hundreds of Python processes (peers, servers, benchmarks, vLLM's engines and
workers, Ray's workers), and most of each one's CPU goes to importing torch, vLLM or Ray: millions
of objects, all kept. With CPython's thresholds a pass runs every 700 of them and a full pass
each time the survivors grew by a quarter, each walking everything alive; in a profile of the
whole suite those passes were a large share of the CPU of both cores, finding almost nothing to
collect. What a process keeps and frees is unchanged: cycles are collected as before, later."""

from __future__ import annotations

import gc

#: new objects (allocations less deallocations) before the youngest generation's pass
FIRST_PASS = 100_000

gc.set_threshold(FIRST_PASS, *gc.get_threshold()[1:])
