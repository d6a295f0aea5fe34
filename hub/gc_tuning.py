"""Garbage-collector settings for the long-lived processes that serve: routers and the control plane."""

from __future__ import annotations

import gc

_tuned = False


def tune_gc() -> None:
    """Fewer, cheaper garbage collections for a process that serves requests or agent streams.

    Each request allocates thousands of short-lived objects, so with CPython's
    default thresholds (700) the collector runs every few requests and, every
    so often, walks the whole heap: measured at 64 connections, that doubled
    the router's p99 (docs/benchmarks.md). A control plane holding a thousand agent
    streams stalled a tick's burst of commands the same way, for up to 0.2 s.
    Objects alive at start-up (modules, settings, the app) are frozen out of
    collections, and the youngest generation is collected every 100,000
    allocations instead.
    """
    global _tuned
    if _tuned:  # once per process: what is frozen is never collected, so freeze only the start-up heap
        return
    _tuned = True
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)
