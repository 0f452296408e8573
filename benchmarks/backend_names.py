"""Backend names of the benchmark rows, shared by the runner, the worker and the reports (no torch).

A name ending in ``-ca`` (``cgtrees-ca``, ``inductor-ca``, ``reduce-overhead-ca``) is the backend
before the suffix with the backward pass captured by compiled autograd and compiled by that same
backend and mode (issue 20). Such rows exist for training only.

A name ending in ``-pc`` (``cgtrees-pc``, ``inductor-pc``) is the backend with Dynamo's caching
precompile on (issue 19): the cold process saves Dynamo's guards and bytecode with the backend's
artifacts, and a warm one installs them instead of tracing the frame again. ``cgtrees-pc`` runs
with ``CGTREES_PRECOMPILE_CACHE=1`` in its environment (``worker_env``; cgtrees turns the setting on
and saves the cache at each graph's first call); ``inductor-pc`` sets
``torch._dynamo.config.caching_precompile`` in the worker before torch.compile, and saves the cache
after its first outputs (``worker.py``), as a user of Inductor's path must.

Every variant keeps its own cache directories, named after the full backend name (Dynamo's cache
lives under ``TORCHINDUCTOR_CACHE_DIR``), so its warm rows reuse its own cold run only.
"""

from __future__ import annotations

CA, PC = "-ca", "-pc"
CA_BACKENDS = ("inductor-ca", "reduce-overhead-ca", "cgtrees-ca")
PC_BACKENDS = ("inductor-pc", "cgtrees-pc")
CACHED = {"inductor", "reduce-overhead", "cgtrees"}  # eager and cudagraphs keep no compile cache
# Settings of Dynamo's cache that reach a worker only where its backend names them (a shell's own
# would make a plain row a precompile one).
PRECOMPILE_VARS = ("CGTREES_PRECOMPILE_CACHE", "TORCH_CACHING_PRECOMPILE")


def base(backend: str) -> str:
    """The backend that compiles the forward: ``cgtrees`` for ``cgtrees-ca`` and ``cgtrees-pc``."""
    return backend.removesuffix(CA).removesuffix(PC)


def is_ca(backend: str) -> bool:
    """Whether the backward runs under compiled autograd (training rows only)."""
    return backend.endswith(CA)


def is_pc(backend: str) -> bool:
    """Whether Dynamo's caching precompile is on (a warm process skips Dynamo's trace)."""
    return backend.endswith(PC)


def cached(backend: str) -> bool:
    """Whether the backend keeps a compile cache (so a warm row means something)."""
    return base(backend) in CACHED


def worker_env(backend: str) -> dict[str, str]:
    """Environment variables a worker of ``backend`` needs set (on top of its cache directories)."""
    return {"CGTREES_PRECOMPILE_CACHE": "1"} if backend == "cgtrees-pc" else {}
