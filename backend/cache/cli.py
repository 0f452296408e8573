"""``python -m cgtrees cache info|clear``."""

from __future__ import annotations

import logging

from cgtrees import counters
from cgtrees.cache.store import Store, base_dir, write_fix
from cgtrees.config import Config


def main(action: str, config: Config | None = None) -> int:
    config = config or Config.resolve()
    if action == "info":
        print(info(config))
        return 0
    if action == "clear":
        store = Store.open(config)
        if store is None:
            print(f"cgtrees cache: {base_dir(config)} is not usable (see the warning above); nothing cleared")
            return 1
        before = len(store.entry_paths())
        try:
            print(f"cgtrees cache: removed {store.clear()} entries from {store.root}")
        except OSError as e:
            left = len(store.entry_paths())
            print(f"cgtrees cache: could not clear {store.root}: {e.strerror or e} ({e.filename or store.root}); "
                  f"removed {before - left} of {before} entries. Fix: {write_fix(store.root, e)}")
            return 1
        return 0
    print(f"cgtrees cache: unknown action {action!r}; use info or clear")
    return 2


class _Kept(logging.Handler):
    """What ``Store.open`` would warn, kept for ``info`` to say in its own words: it compiles nothing."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _open_quietly(config: Config) -> tuple[Store | None, list[str]]:
    kept, cache_log = _Kept(), logging.getLogger("cgtrees.cache")
    cache_log.addHandler(kept)
    propagate, cache_log.propagate = cache_log.propagate, False
    try:
        return Store.open(config), kept.messages
    finally:
        cache_log.propagate = propagate
        cache_log.removeHandler(kept)


def info(config: Config) -> str:
    """Location, entries, bytes, and this process's hit/miss counts. A directory that cannot be used
    is said in the first line, with why and the fix (``info`` itself compiles nothing)."""
    c = counters.snapshot()
    store, why = _open_quietly(config) if config.cache else (None, [])
    if not config.cache:
        lines = ["cgtrees cache: off (cache=False / CGTREES_CACHE=0)"]
    elif store is None:
        reason = "; ".join(m.removeprefix("cgtrees: ") for m in why) or "it cannot be created"
        lines = [f"cgtrees cache: on, but {base_dir(config)} is not usable, so compiles run uncached: {reason}"]
    elif not store.writable():
        lines = [f"cgtrees cache: on, read-only: its entries are loaded, new ones are not stored. "
                 f"Fix: {write_fix(store.root)}"]
    else:
        lines = ["cgtrees cache: on"]
    if store is None:
        lines.append(f"location: {base_dir(config)}")
    else:
        usage = store.usage()
        levels = {level: len(list((store.root / level).glob("*.entry"))) for level in ("aot", "module")}
        lines += [
            f"location: {store.root}",
            f"entries: {usage.entries} ({levels['aot']} AOT results, {levels['module']} kernel modules)",
            f"bytes: {usage.bytes}",
            f"size cap: {f'{config.cache_size_mb} MB (LRU eviction)' if config.cache_size_mb else 'none'}",
            f"triton binaries: {store.triton_dir()}",
        ]
    lines.append("this process: " + ", ".join(
        f"{k}={c[k]}" for k in ("cache_hit", "cache_miss", "cache_bypass", "cache_corrupt")))
    return "\n".join(lines)
