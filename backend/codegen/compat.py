"""The one place codegen touches Triton's (and torch's) private APIs.

``boxed_graph_module(gm)``: a copy of an aten graph whose code takes its inputs as one list and
clears it (FX's ``_BoxedCodeGen``), so each input is freed at its last use; None where this torch
has no boxed code generator.

``parallel_compiles(threads)``: a context in which a kernel's warmup hands its compilation to a
thread pool instead of compiling on the spot (Triton's ``AsyncCompileMode``, in
``triton.runtime._async_compile`` since Triton 3.4); leaving the context waits for every compile.
None where this Triton has no such mode: the caller then compiles one kernel after the other.

``triton_driver()``: Triton's active driver, made once when two threads ask at the same time.

``hash_triton_in_background(remember_in)``: starts Triton's hash of its own sources and library
(``triton.runtime.cache.triton_key``, part of every compiled kernel's cache key) on a thread, after
putting ``SharedKey`` in its place: computed once, and remembered across processes in our cache;
``share_triton_key(remember_in)`` puts it in place without computing it (a warm load).

``compiled_specialisations(jit)`` and ``LoadedBinary``: a kernel's compiled binaries taken from
Triton's in-process cache as JSON-able records, and one such record loaded and launched without
Triton's JIT (``binaries`` says when and why). The binary is loaded by Triton's driver; it is
launched by torch's static CUDA launcher (``torch._C._StaticCudaLauncher``, what Inductor launches
its kernels with) where torch has one and the kernel needs nothing it lacks (one CTA, no scratch
memory, no tensor descriptors, no programmatic dependent launch), else by Triton's launcher. Triton
makes that launcher per signature from C source that it builds with the host compiler on first use
(about 1.2 s each on the device machine, when its cache directory is empty): a cold process paid
2.5 s of its first call for decode's two signatures.

``refresh_meta(gm)``: every node's meta value computed again from its placeholders' (a graph pass
added nodes), under the fake mode they were traced in; ``real_tensors()``: a context in which
tensors are real even where the compiler was called under a fake mode (timing a GEMM on the device);
``clear_cublas_workspaces()``: drop cuBLAS's workspaces, which torch keeps per handle and stream
(32 MiB each on an H100), after timing on a stream of our own; the runtime does the same around
its recordings; ``gpu_spin(cycles)``: the GPU busy for a while, ahead of a timed launch.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import threading
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Collection, Iterator


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
    current = share_triton_key(remember_in)
    if current is None:
        return

    def run() -> None:
        try:
            current()
        except Exception:  # noqa: BLE001, S110 - the launch computes it again and raises there
            pass

    _key_thread = threading.Thread(target=run, name="cgtrees-triton-key", daemon=True)
    _key_thread.start()


def share_triton_key(remember_in: Path | None = None) -> SharedKey | None:
    """Triton's ``triton_key`` replaced by a ``SharedKey`` (once per process), without computing it:
    what a warm load does, whose kernels launch stored binaries and need no key (a kernel that goes
    through the JIT after all reads it back from ``remember_in``). None without Triton."""
    try:
        import triton.runtime.cache as triton_cache
    except ImportError:
        return None
    current = triton_cache.triton_key
    if not isinstance(current, SharedKey):
        current = triton_cache.triton_key = SharedKey(current, remember_in)
    return current


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


# ---- compiled kernels: taken from Triton's in-process cache, launched without its JIT ----------

def is_jit_function(obj: object) -> bool:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return isinstance(obj, JITFunction)


def compiled_specialisations(jit: object, known: Collection[str] = ()) -> list[dict]:
    """Each specialisation Triton compiled for ``jit`` (on any device) but those whose compile hash
    is ``known``, as JSON-able data: the signature and constants it was compiled for, the argument
    indices it assumed divisible by 16, Triton's metadata and the binary. One Triton cannot
    describe this way is left out."""
    found = []
    for caches in list(jit.device_caches.values()):  # type: ignore[attr-defined]
        for kernel in list(caches[0].values()):
            if hasattr(kernel, "result") or kernel.metadata.hash in known:  # not finalised, or known
                continue
            record = _describe(kernel)
            if record is not None:
                found.append(record)
    return found


def _describe(kernel: object) -> dict | None:
    src, meta = kernel.src, kernel.metadata._asdict()  # type: ignore[attr-defined]
    divisible = []
    for path, attrs in src.attrs.items():
        if len(path) != 1 or attrs not in ([], [["tt.divisibility", 16]]):
            return None
        if attrs:
            divisible.append(path[0])
    constants = []
    for path, value in src.constants.items():
        if len(path) != 1 or not isinstance(value, (int, float, bool, type(None))):
            return None
        constants.append([path[0], value])
    target = meta["target"]
    meta["target"] = {"backend": target.backend, "arch": target.arch, "warp_size": target.warp_size}
    try:
        metadata = json.loads(json.dumps(meta))
    except (TypeError, ValueError):
        return None
    return {"signature": list(src.signature.values()), "constants": constants, "divisible": divisible,
            "metadata": metadata, "binary": base64.b64encode(kernel.kernel).decode()}  # type: ignore[attr-defined]


class _Source:
    """What Triton's launcher reads of a kernel's source: its signature and constants."""

    def __init__(self, names: list[str], record: dict) -> None:
        self.fn = SimpleNamespace(arg_names=names)
        self.signature = dict(zip(names, record["signature"]))
        self.constants = {(i,): value for i, value in record["constants"]}


_driver_lock = threading.Lock()


def triton_driver() -> Any:
    """Triton's active driver, made once when two threads ask for it at the same time (a warm load
    starts it in the thread of ``runtime.first_calls``)."""
    from triton.runtime.driver import driver

    with _driver_lock:
        return driver.active


class LoadFailed(Exception):
    """A stored binary that this device cannot load or run (too much shared memory, say)."""


class LoadedBinary:
    """One stored specialisation, loaded onto each device it is launched on (at its first launch
    there: loading needs the device current). ``launch(grid, args)`` takes every parameter's value,
    constexprs too; it launches nothing and answers False while a profiler hooks Triton's launches.
    Triton's driver is taken at the first launch, not when the module loads (a warm load starts it
    in another thread meanwhile: ``runtime.first_calls``)."""

    def __init__(self, names: list[str], record: dict) -> None:
        from triton import knobs

        self.names, self.record = names, record
        self.driver: Any = None
        self.knobs = knobs.runtime
        self.metadata: tuple | None = None
        self.run: Callable | None = None
        self.static: StaticLaunch | None = None
        self.functions: dict[int, object] = {}

    def launch(self, grid: tuple, args: tuple) -> bool:
        if _hooked(self.knobs.launch_enter_hook) or _hooked(self.knobs.launch_exit_hook):
            return False
        driver = self.driver or self._take_driver()
        device = driver.get_current_device()
        function = self.functions.get(device)
        if function is None:
            function = self.functions[device] = self._load(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = driver.get_current_stream(device)
        static = self.static
        if static is not None:
            static.launch(function, grid[0], g1, g2, static.num_warps, static.shared, static.types,
                          static.arguments(args), stream)
            return True
        self.run(grid[0], g1, g2, stream, function, self.packed, None, None, None, *args)  # type: ignore[misc]
        return True

    def _take_driver(self) -> Any:
        self.driver = triton_driver()
        return self.driver

    def _load(self, device: int) -> object:
        from triton.compiler.compiler import max_shared_mem

        try:
            if self.metadata is None:
                self.metadata, self.packed = _metadata(self.record["metadata"])
                self.binary = base64.b64decode(self.record["binary"])
            meta = self.metadata
            if meta.shared > max_shared_mem(device):
                raise LoadFailed(f"needs {meta.shared} bytes of shared memory, device {device} has "
                                 f"{max_shared_mem(device)}")
            if self.run is None and self.static is None:
                self.static = StaticLaunch.plan(self.record["signature"], meta)
                if self.static is None:
                    self.run = _launcher(self.driver, _Source(self.names, self.record), meta)
            _, function, _, _, max_threads = self.driver.utils.load_binary(meta.name, self.binary, meta.shared,
                                                                            device)
        except LoadFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to load means: use the JIT
            raise LoadFailed(f"{type(exc).__name__}: {exc}") from exc
        threads = meta.num_warps * meta.target.warp_size
        if threads > max_threads:
            raise LoadFailed(f"needs {threads} threads per block, the binary allows {max_threads}")
        return function


class StaticLaunch:
    """How torch's static CUDA launcher launches one kernel: its argument types (one letter each, as
    ``_launch_kernel`` reads them), which of the launch's arguments the binary takes (Triton drops
    the constexprs, a run-time int specialised to 1 among them), and what Triton 3.6 appends (a null
    pointer for each scratch buffer its metadata names, none of them used)."""

    TYPES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H",
             "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "fp64": "d"}

    def __init__(self, launch: Callable, types: str, keep: tuple[int, ...] | None, extra: tuple,
                 num_warps: int, shared: int) -> None:
        self.launch, self.types, self.keep, self.extra = launch, types, keep, extra
        self.num_warps, self.shared = num_warps, shared
        self.taken = len(types) - len(extra)  # of the launch's arguments, where ``keep`` is a slice

    def arguments(self, args: tuple) -> tuple:
        """The launch's arguments as the binary takes them (``args``: every parameter's value)."""
        if self.keep is None:
            return args[:self.taken] + self.extra
        return tuple(args[i] for i in self.keep) + self.extra

    @classmethod
    def plan(cls, signature: list[str], meta: tuple) -> "StaticLaunch | None":
        """None where torch has no static launcher or the kernel needs what it does not do."""
        launch = _static_launch_kernel()
        if launch is None or getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "tensordesc_meta", None):
            return None
        if getattr(meta, "launch_pdl", False) or getattr(meta, "launch_cooperative_grid", False):
            return None
        extra = []
        for field in ("global_scratch_size", "profile_scratch_size"):
            if hasattr(meta, field):
                if getattr(meta, field):
                    return None
                extra.append(None)
        keep, types = [], []
        for i, kind in enumerate(signature):
            if kind == "constexpr":
                continue
            letter = "O" if kind.startswith("*") else cls.TYPES.get(kind)
            if letter is None:
                return None
            keep.append(i)
            types.append(letter)
        together = keep == list(range(len(keep)))  # no constexpr among them: a slice does
        return cls(launch, "".join(types) + "O" * len(extra), None if together else tuple(keep), tuple(extra),
                   meta.num_warps, meta.shared)


@functools.cache
def _static_launch_kernel() -> Callable | None:
    """``torch._C._StaticCudaLauncher._launch_kernel`` (torch 2.8 and later with CUDA), else None."""
    try:
        from torch._C import _StaticCudaLauncher
    except ImportError:
        return None
    return getattr(_StaticCudaLauncher, "_launch_kernel", None)


_metadata_types: dict[tuple, type] = {}
_backends: dict[tuple, object] = {}
_launchers: dict[str, object] = {}
# What Triton 3.6's CudaLauncher reads of a kernel, besides its signature and constants.
LAUNCHER_FIELDS = ("num_ctas", "global_scratch_size", "global_scratch_align", "profile_scratch_size",
                   "profile_scratch_align", "launch_cooperative_grid", "launch_pdl", "tensordesc_meta")


def _metadata(record: dict) -> tuple[tuple, object]:
    """Triton's metadata tuple for a stored record (as Triton reads its own JSON), and its packed
    form for the launcher. The tuple type and the backend are made once, not per kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    meta = dict(record)
    t = meta["target"]
    target = meta["target"] = GPUTarget(t["backend"], t["arch"], t["warp_size"])
    fields = tuple(sorted(meta))
    kind = _metadata_types.get(fields) or _metadata_types.setdefault(fields, namedtuple("KernelMetadata", fields))
    key = (target.backend, target.arch, target.warp_size)
    backend = _backends.get(key) or _backends.setdefault(key, make_backend(target))
    metadata = kind(**meta)
    return metadata, backend.pack_metadata(metadata)  # type: ignore[attr-defined]


def _launcher(driver: object, source: _Source, meta: tuple) -> object:
    """Triton's launcher for a kernel: a C function made for its signature, built and loaded once
    per process for each signature (kernels of one module share a handful)."""
    key = json.dumps([list(source.signature.values()), sorted(source.constants.items()),
                      [getattr(meta, f, None) for f in LAUNCHER_FIELDS]], default=str)
    launcher = _launchers.get(key)
    if launcher is None:
        launcher = _launchers[key] = driver.launcher_cls(source, meta)  # type: ignore[attr-defined]
    return launcher


def _hooked(hook: object) -> bool:
    """A launch hook is set: a function, or a non-empty chain (Triton 3.6 keeps an empty one)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def boxed_graph_module(gm: object) -> object:
    import torch.fx

    codegen = getattr(torch.fx.graph, "_BoxedCodeGen", None)
    if codegen is None:
        return None
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(codegen())
    return torch.fx.GraphModule(gm, graph)


def refresh_meta(gm: Any) -> None:
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    vals = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode(vals)
    if mode is None:
        raise NotImplementedError("the graph's inputs carry no fake tensors")
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)


def real_tensors() -> Any:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def clear_cublas_workspaces() -> None:
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and not torch.cuda.is_current_stream_capturing():
        clear()


def gpu_spin(cycles: int) -> None:
    """The current stream's GPU spins for about ``cycles`` clock ticks (``torch.cuda._sleep``): work
    queued ahead of a timed launch, so that the host's delay before it is not timed."""
    import torch

    torch.cuda._sleep(cycles)
