"""The benchmark's modules (``benchmarks/``, not a package) for its tests."""

from __future__ import annotations

import os
import sys
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported by its bare name as the benchmark's modules import each other."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)
