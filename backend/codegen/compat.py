"""The one place codegen touches Triton's private APIs (DESIGN.md, "Versions").

``parallel_compiles(threads)``: a context in which a kernel's warmup hands its compilation to a
thread pool instead of compiling on the spot (Triton's ``AsyncCompileMode``, in
``triton.runtime._async_compile`` since Triton 3.4); leaving the context waits for every compile.
None where this Triton has no such mode: the caller then compiles one kernel after the other.

``hash_triton_in_background(remember_in)``: starts Triton's hash of its own sources and library
(``triton.runtime.cache.triton_key``, part of every compiled kernel's cache key) on a thread, after
putting ``SharedKey`` in its place: computed once, and remembered across processes in our cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator


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


def hash_triton_in_background(remember_in: Path | None = None) -> None:
    """Triton hashes its sources and its 500 MB library once per process, at the first kernel it
    compiles or loads from its cache (0.3-0.5 s on an H100: half of a warm start). Started when the
    first CUDA graph reaches the backend, the hash overlaps Dynamo's guard building, our cache load
    and AOTAutograd (hashlib lets go of the GIL on large reads).

    Triton's ``triton_key`` is replaced by a ``SharedKey`` holding the same value: a launch that
    comes before the thread is done waits for it instead of hashing the library a second time, and
    with ``remember_in`` (a file in our private cache directory) a later process reads the key back
    while Triton's installed files are unchanged, and hashes nothing. Best effort: any failure here
    is left for the launch to meet and report."""
    global _key_thread
    if _key_thread is not None:
        return
    try:
        import triton.runtime.cache as triton_cache
    except ImportError:
        return
    current = triton_cache.triton_key
    if not isinstance(current, SharedKey):
        current = triton_cache.triton_key = SharedKey(current, remember_in)

    def run() -> None:
        try:
            current()
        except Exception:  # noqa: BLE001, S110 - the launch computes it again and raises there
            pass

    _key_thread = threading.Thread(target=run, name="cgtrees-triton-key", daemon=True)
    _key_thread.start()


class SharedKey:
    """Stands in for ``triton.runtime.cache.triton_key``: the same value, computed once per process
    (callers wait for a computation under way), and kept in ``path`` next to a stamp of Triton's
    installed files (name, size, mtime, inode of each), so that a process which finds the stamp
    unchanged reads the key instead of hashing 500 MB. A file that cannot be read or written only
    means hashing again."""

    def __init__(self, compute: Callable[[], str], path: Path | None) -> None:
        self.compute, self.path = compute, path
        self.value: str | None = None
        self.lock = threading.Lock()

    def __call__(self) -> str:
        if self.value is None:
            with self.lock:
                if self.value is None:
                    self.value = self._load()
        return self.value

    def _load(self) -> str:
        if self.path is None:
            return self.compute()
        stamp = installed_stamp()
        try:
            saved = json.loads(self.path.read_text())
            if saved["stamp"] == stamp:
                return str(saved["key"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        value = self.compute()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"stamp": stamp, "key": value}))
            os.replace(tmp, self.path)
        except OSError:
            with suppress(OSError):
                tmp.unlink(missing_ok=True)
        return value


def installed_stamp() -> str:
    """A digest of every file of the installed Triton package: path, size, mtime, inode."""
    import triton

    root = Path(triton.__file__).parent
    digest = hashlib.sha256(triton.__version__.encode())
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            digest.update(f"{os.path.relpath(path, root)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}\n".encode())
    return digest.hexdigest()
