"""``python -m cgtrees cache info|clear``."""

from __future__ import annotations

from cgtrees import counters
from cgtrees.cache.store import Store, base_dir
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
                  f"removed {before - left} of {before} entries. Make the directory writable "
                  f"(chmod -R u+w {store.root}), or point CGTREES_CACHE_DIR at another directory.")
            return 1
        return 0
    print(f"cgtrees cache: unknown action {action!r}; use info or clear")
    return 2


def info(config: Config) -> str:
    """Location, entries, bytes, and this process's hit/miss counts."""
    c = counters.snapshot()
    lines = [f"cgtrees cache: {'on' if config.cache else 'off (cache=False / CGTREES_CACHE=0)'}"]
    store = Store.open(config)
    if store is None:
        lines.append(f"location: {base_dir(config)} (not usable: see the warning above)")
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
