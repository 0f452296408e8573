"""Backend names of the benchmark rows, shared by the runner, the worker and the reports (no torch).

A name ending in ``-ca`` (``cgtrees-ca``, ``inductor-ca``, ``reduce-overhead-ca``) is the backend
before the suffix with the backward pass captured by compiled autograd and compiled by that same
backend and mode (issue 20). Such rows exist for training only; they keep their own cache
directories (named after the full backend name), so their warm rows reuse their own cold runs.
"""

from __future__ import annotations

CA = "-ca"
CA_BACKENDS = ("inductor-ca", "reduce-overhead-ca", "cgtrees-ca")
CACHED = {"inductor", "reduce-overhead", "cgtrees"}  # eager and cudagraphs keep no compile cache


def base(backend: str) -> str:
    """The backend that compiles the forward: ``cgtrees`` for ``cgtrees-ca``."""
    return backend.removesuffix(CA)


def is_ca(backend: str) -> bool:
    """Whether the backward runs under compiled autograd (training rows only)."""
    return backend.endswith(CA)


def cached(backend: str) -> bool:
    """Whether the backend keeps a compile cache (so a warm row means something)."""
    return base(backend) in CACHED
