"""Logging through ``logging.getLogger("cgtrees")``; ``log_once`` for reasons told once per key."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("cgtrees")
_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()


def log_once(logger: logging.Logger, key: str, msg: str, *args: object,
             level: int = logging.WARNING) -> bool:
    """Log ``msg`` the first time ``(logger, key)`` is seen; return whether it was logged."""
    with _lock:
        if (logger.name, key) in _seen:
            return False
        _seen.add((logger.name, key))
    logger.log(level, msg, *args)
    return True


def forget() -> None:
    """Forget what was logged (``reset()``), so a fresh start explains itself again."""
    with _lock:
        _seen.clear()
