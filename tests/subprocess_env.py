"""The environment a test hands a fresh process: the user's, without our settings (``CGTREES_*``) or
Triton's cache directory, so that only what the test sets is in force; but with the pipeline the
CPU suite runs (``CGTREES_CPU_PIPELINE``, set in ``conftest.py``; absent for ``cpu_default`` tests)."""

from __future__ import annotations

import os

KEPT = ("CGTREES_CPU_PIPELINE",)


def clean_env(drop: tuple[str, ...] = ("CGTREES_", "TRITON_CACHE")) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(drop) or k in KEPT}
