"""The one place codegen touches Triton's private APIs (DESIGN.md, "Versions").

``parallel_compiles(threads)``: a context in which a kernel's warmup hands its compilation to a
thread pool instead of compiling on the spot (Triton's ``AsyncCompileMode``, in
``triton.runtime._async_compile`` since Triton 3.4); leaving the context waits for every compile.
None where this Triton has no such mode: the caller then compiles one kernel after the other.
"""

from __future__ import annotations

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
