"""Counting and explaining what the cache did (``cache_hit``, ``cache_miss``, ``cache_bypass``,
``cache_corrupt``). A bypass is a warning: one uncacheable graph makes a warm start nearly as slow
as a cold one, so it must be visible.

Each event also counts per level (``cache_hit_aot``, ``cache_miss_module``, ...)."""

from __future__ import annotations

import logging
from typing import Callable

from cgtrees import counters
from cgtrees.logs import log_once

log = logging.getLogger("cgtrees.cache")


def hit(level: str, name: str) -> None:
    _count("hit", level)
    log.debug("cgtrees: cache hit (%s) for %s", level, name)


def miss(level: str, name: str, explain: Callable[[], str] | None = None) -> None:
    """``explain`` says why (it reads other entries, so it runs only when debug logging is on)."""
    _count("miss", level)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("cgtrees: cache miss (%s) for %s%s", level, name, f": {explain()}" if explain else "")


# What a bypass means to a user, per level: a new process redoes the work the level would have saved.
BYPASS_SAYS = {
    "aot": "will be traced again by a new process (its kernels are cached, the graph is not)",
    "module": "will be compiled again by a new process (its kernels are not cached)",
}


UNCACHED = "no usable cache directory"  # said once, with the fix, where the directory failed (``Store.open``)


def bypass(level: str, name: str, reason: str) -> None:
    """A warning the first time a reason makes a graph bypass a level in this process; every later
    graph with the same reason says so at DEBUG (DDP splits a model into pieces that all bypass
    level 1 for one reason: one line per rank, not one per piece). Without a usable directory
    nothing is cached at any level: ``Store.open`` said so, and each graph says so at DEBUG."""
    _count("bypass", level)
    if reason == UNCACHED:
        log.debug("cgtrees: %s is not cached (%s): a new process compiles it again", name, reason)
        return
    message = "cgtrees: %s " + BYPASS_SAYS[level] + ": %s"
    if not log_once(log, f"bypass:{level}:{reason}", message, name, reason):
        log.debug(message, name, reason)


def corrupt(level: str, name: str, why: str) -> None:
    _count("corrupt", level)
    log.warning("cgtrees: bad %s cache entry for %s (%s): removed, recompiling", level, name, why)


def _count(event: str, level: str) -> None:
    counters.bump(f"cache_{event}")
    counters.bump(f"cache_{event}_{level}")
