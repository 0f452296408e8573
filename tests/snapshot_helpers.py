"""What the tests that run workers in fresh processes share: a snapshot of the backend for them to
import (the cache key hashes our source, and the tree may be edited while the tests run), and
pieces of worker source that count what a warm process skipped and keep what the cache said."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Worker source: counts AOTAutograd's traces in ``calls["aot"]`` (a level-1 hit traces none).
COUNT_AOT = '''
import cgtrees.aot.compat as aot_compat
calls = {"aot": 0}
real_aot = aot_compat.aot_module_simplified
def counting_aot(*a, **k):
    calls["aot"] += 1
    return real_aot(*a, **k)
aot_compat.aot_module_simplified = counting_aot
'''


def keep_log(logger: str) -> str:
    """Worker source: every message of ``logger`` at DEBUG (a miss says why) in ``keep.messages``."""
    return f'''
import logging
class Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []
    def emit(self, record):
        self.messages.append(record.getMessage())
keep = Keep()
logging.getLogger({logger!r}).addHandler(keep)
logging.getLogger({logger!r}).setLevel(logging.DEBUG)
'''


def backend_snapshot(root: Path, worker: str | None = None) -> Path:
    """``root`` holding a copy of the backend package (and ``worker.py``, when given)."""
    shutil.copytree(ROOT / "backend", root / "cgtrees", ignore=shutil.ignore_patterns("__pycache__"))
    if worker is not None:
        (root / "worker.py").write_text(worker)
    return root
