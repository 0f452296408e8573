"""The one place codegen touches Triton's private APIs (DESIGN.md, "Versions").

``parallel_compiles(threads)``: a context in which a kernel's warmup hands its compilation to a
thread pool instead of compiling on the spot (Triton's ``AsyncCompileMode``, in
``triton.runtime._async_compile`` since Triton 3.4); leaving the context waits for every compile.
None where this Triton has no such mode: the caller then compiles one kernel after the other.

``hash_triton_in_background()``: starts Triton's hash of its own sources and library
(``triton.runtime.cache.triton_key``, part of every compiled kernel's cache key) on a thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator


def parallel_compiles_supported() -> bool:
    try:
        from triton.runtime._async_compile import AsyncCompileMode  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def parallel_compiles(threads: int) -> Iterator[None]:
    from triton.runtime._async_compile import AsyncCompileMode

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cgtrees-compile") as pool:
        # ignore_errors: a kernel that fails to compile is left out of Triton's cache, so its launch
        # compiles it again and raises there, where the kernel module handles the failure.
        with AsyncCompileMode(pool, ignore_errors=True):
            yield


_key_thread: threading.Thread | None = None


def hash_triton_in_background() -> None:
    """Triton hashes its sources and its 500 MB library once per process, at the first kernel it
    compiles or loads from its cache (0.33 s on the H200, a quarter of a warm start). Started when
    the first CUDA graph reaches the backend, the hash overlaps Dynamo's guard building, our cache
    load and AOTAutograd (hashlib lets go of the GIL on large reads); the launch then finds it
    cached. Best effort: a failure here is left for the launch to meet and report."""
    global _key_thread
    if _key_thread is not None:
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return

    def run() -> None:
        try:
            triton_key()
        except Exception:  # noqa: BLE001, S110 - the launch computes it again and raises there
            pass

    _key_thread = threading.Thread(target=run, name="cgtrees-triton-key", daemon=True)
    _key_thread.start()
