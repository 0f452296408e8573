"""Compiled kernels kept with a kernel module, and launched without Triton's JIT.

A generated module launches a kernel as ``kernel[grid](*args, XBLOCK=..., num_warps=...)``. Through
Triton's JIT, a warm start paid 4-7 ms of Python at each kernel's first launch (an H100 host):
building its argument binder, parsing its own source for its cache key, finding that key in
Triton's on-disk cache, reading five files and loading a launcher; over a second for convnet's 177
training kernels, more than the rest of the warm start.

``capture(module, kernels)`` takes what Triton compiled for each kernel (binary, metadata, and the argument
specialisation it was compiled for) as JSON-able records, which the cache keeps with the module's
source. ``install(module, records)`` puts a ``CachedKernel`` in the place of each kernel that has
records: its launch uses a stored binary when the arguments satisfy what that binary assumes, and
Triton's JIT otherwise. What a binary assumes, from Triton's specialisation rules:

- a pointer marked divisible by 16: the tensor's address is 16-byte aligned;
- an int marked divisible by 16: so is the value; an int Triton baked in (a 1): the same value;
- an int passed at run time: it fits the width it was compiled for (i32, i64, u64);
- the constexprs and ``num_warps`` of the call: those it was compiled with.

A check that fails only costs the JIT path (which may compile a new specialisation, as before). A
binary that cannot be loaded on this device is dropped with a warning, and its kernel goes through
the JIT from then on. With a profiler hooked into Triton's launches, every launch goes through the
JIT, so that the profiler sees it.

A freshly compiled module is installed from its own records too, so that every launch, cold or
warm, takes the same path. A binary is launched by torch's static CUDA launcher where it can be
(``compat.StaticLaunch``), so no launcher is built from C source per signature, as Triton's is.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import logging
import marshal
from types import CodeType, ModuleType
from typing import Any, Callable, Sequence

from cgtrees.codegen import compat
from cgtrees.logs import log_once

log = logging.getLogger("cgtrees.codegen")

INT_RANGES = {"i32": (-(2**31), 2**31), "i64": (-(2**63), 2**63), "u64": (0, 2**64)}


class Unusable(Exception):
    """A record this launcher cannot check or load (then its kernel goes through the JIT)."""


# ------------------------------------------------------------------------------------------ capture
def capture(module: ModuleType, kernels: Sequence[str]) -> dict[str, list[dict]]:
    """Every compiled specialisation of each of ``module``'s ``kernels``, by kernel name."""
    found: dict[str, list[dict]] = {}
    namespace = vars(module)
    for name in kernels:
        obj = namespace[name]
        records = []
        if isinstance(obj, CachedKernel):
            records = [b.record for b in obj.binaries]
            obj = obj._jit  # a kernel never launched through the JIT has compiled nothing there
        if compat.is_jit_function(obj):
            known = {r["metadata"]["hash"] for r in records}  # Triton's hash of each compilation
            records += compat.compiled_specialisations(obj, known)
        if records:
            found[name] = records
    return found


# ------------------------------------------------------------------------------------- warm loading
DEFERRED = "cgtrees_deferred_jit"


def exec_deferred(module: ModuleType, source: str, path: str, records: dict[str, list[dict]],
                  code: dict[str, str] | None = None) -> None:
    """Run a module's source with the kernels that have records left as plain functions: Triton's
    ``jit`` reads each kernel's source lines when it decorates it (1 ms a kernel), which a kernel
    launched from its binary never needs. Their ``@triton.jit`` line reads ``@cgtrees_deferred_jit``
    (the same number of lines, so tracebacks point into the file at ``path``, which keeps the
    source as generated); ``install`` then makes each a ``CachedKernel``, which decorates it on
    its first launch through the JIT. ``code`` (``code_record``'s, stored with the entry) spares
    compiling the text again: 12-32 ms a module for GPT-2's training graphs on a CPU core."""
    namespace = vars(module)
    namespace[DEFERRED] = _undecorated
    compiled = _stored_code(code, path)
    if compiled is None:
        compiled = compile(deferred_text(source, records), path, "exec")
    exec(compiled, namespace)  # noqa: S102 - our own generated module


def deferred_text(source: str, records: dict[str, list[dict]]) -> str:
    """The source that ``exec_deferred`` runs: kernels with records left undecorated."""
    text = source
    for name in records:
        text = text.replace(f"\n@triton.jit\ndef {name}(", f"\n@{DEFERRED}\ndef {name}(")
    return text


def code_record(source: str, records: dict[str, list[dict]]) -> dict[str, str]:
    """The compiled code of ``deferred_text``, to keep beside an entry's source: marshal's bytes
    (base64), tagged with this interpreter's byte-code magic, which another Python version does
    not read (it compiles the source instead). Made once per text: a cold process that stores a module
    in level 2 and keeps it for precompile asks twice."""
    return dict(_compiled_record(deferred_text(source, records)))  # a copy: the cached one stays as made


@functools.lru_cache(maxsize=8)
def _compiled_record(text: str) -> dict[str, str]:
    code = compile(text, "<cgtrees kernel module>", "exec")
    return {"python": importlib.util.MAGIC_NUMBER.hex(), "marshal": base64.b64encode(marshal.dumps(code)).decode()}


def _stored_code(record: Any, path: str) -> CodeType | None:
    """The stored code object, its file name ``path`` (Triton reads a kernel's source through it
    when the JIT decorates it); None when there is none or it is another interpreter's."""
    if not isinstance(record, dict) or record.get("python") != importlib.util.MAGIC_NUMBER.hex():
        return None
    try:
        code = marshal.loads(base64.b64decode(record["marshal"]))
    except Exception as exc:  # noqa: BLE001 - the source is there: compile it
        log_once(log, "code-record", "cgtrees codegen: a stored code object is unreadable (%s: %s); "
                 "compiling its source", type(exc).__name__, exc)
        return None
    return _renamed(code, path) if isinstance(code, CodeType) else None


def _renamed(code: CodeType, path: str) -> CodeType:
    """``code`` and every code object nested in it with ``co_filename`` set to ``path``."""
    consts = tuple(_renamed(c, path) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=path, co_consts=consts)


def _undecorated(fn: Callable) -> Callable:
    return fn


def install(module: ModuleType, records: dict[str, list[dict]], name: str) -> int:
    """Put a ``CachedKernel`` in the place of each kernel of ``module`` that ``records`` has
    binaries for; the number of kernels that launch from a binary."""
    installed = 0
    namespace = vars(module)
    for kernel_name, kernel_records in records.items():
        obj = namespace.get(kernel_name)
        if isinstance(obj, CachedKernel):
            fn, jit = obj.fn, obj._jit
        elif compat.is_jit_function(obj):
            fn, jit = obj.fn, obj  # type: ignore[union-attr]
        else:
            fn, jit = obj, None  # left undecorated by exec_deferred
        if not hasattr(fn, "__code__"):
            continue
        binaries = []
        for record in kernel_records if isinstance(kernel_records, list) else [kernel_records]:
            try:
                binaries.append(Binary(fn, record))
            except Exception as exc:  # noqa: BLE001 - the kernel still launches through the JIT
                log_once(log, f"binary:{name}:{kernel_name}", "cgtrees codegen: %s: a stored binary of %s is "
                         "not usable (%s: %s); that kernel launches through Triton's JIT", name, kernel_name,
                         type(exc).__name__, exc)
        if binaries or jit is None:  # a deferred kernel always needs its stand-in
            namespace[kernel_name] = CachedKernel(fn, binaries, name, jit)
            installed += bool(binaries)
    return installed


def parameters(fn: Callable) -> tuple[list[str], set[str]]:
    """A kernel function's parameter names, and those annotated ``tl.constexpr``."""
    code = fn.__code__
    names = list(code.co_varnames[:code.co_argcount])
    annotations = getattr(fn, "__annotations__", {})

    def constexpr(a: Any) -> bool:
        return "constexpr" in (a if isinstance(a, str) else getattr(a, "__name__", ""))

    return names, {n for n in names if constexpr(annotations.get(n))}


class Binary:
    """One compiled specialisation: what it assumes of the arguments, and the loaded binary."""

    def __init__(self, fn: Callable, record: dict) -> None:
        names, constexprs = parameters(fn)
        n_args = next((i for i, n in enumerate(names) if n in constexprs), len(names))
        if any(n not in constexprs for n in names[n_args:]):
            raise Unusable("a constexpr parameter comes before a run-time one")
        signature = record["signature"]
        constants = {int(i): v for i, v in record["constants"]}
        if len(signature) != len(names) or any(i not in constants for i in range(n_args, len(names))):
            raise Unusable("the record does not match the kernel's parameters")
        self.record = record
        self.n_args = n_args
        self.const_values = tuple(constants[i] for i in range(n_args, len(names)))
        self.meta = {**{names[i]: constants[i] for i in range(n_args, len(names))},
                     "num_warps": record["metadata"]["num_warps"]}
        divisible = set(record["divisible"])
        self.aligned = [i for i in sorted(divisible) if signature[i].startswith("*")]
        self.div16 = [i for i in sorted(divisible) if not signature[i].startswith("*")]
        self.baked: list[tuple[int, Any]] = []
        self.ranges: list[tuple[int, int, int]] = []
        for i, kind in enumerate(signature[:n_args]):
            if kind == "constexpr":
                self.baked.append((i, constants[i]))
            elif kind in INT_RANGES:
                self.ranges.append((i, *INT_RANGES[kind]))
            elif not kind.startswith("*"):
                raise Unusable(f"argument {names[i]} has type {kind}")
        self.loaded = compat.LoadedBinary(names, record)

    def accepts(self, args: tuple, meta: dict) -> bool:
        if len(args) != self.n_args or meta != self.meta:
            return False
        for i in self.aligned:
            if args[i].data_ptr() % 16:
                return False
        for i in self.div16:
            if args[i] % 16:
                return False
        for i, value in self.baked:
            if type(args[i]) is not type(value) or args[i] != value:
                return False
        for i, low, high in self.ranges:
            if type(args[i]) is not int or not low <= args[i] < high:
                return False
        return True


class CachedKernel:
    """Stands in for a Triton kernel in its module: ``kernel[grid](*args, **meta)`` launches the
    first stored binary whose assumptions hold, else goes through Triton's JIT (``jit``, made from
    the kernel's function ``fn`` when first needed)."""

    def __init__(self, fn: Callable, binaries: list[Binary], module_name: str, jit: Any = None) -> None:
        self.fn, self.binaries, self.module_name, self._jit = fn, binaries, module_name, jit

    @property
    def jit(self) -> Any:
        if self._jit is None:
            import triton

            self._jit = triton.jit(self.fn)
        return self._jit

    @jit.setter
    def jit(self, value: Any) -> None:
        self._jit = value

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid: tuple, args: tuple, meta: dict) -> None:
        for binary in self.binaries:
            if binary.accepts(args, meta):
                try:
                    if binary.loaded.launch(grid, (*args, *binary.const_values)):
                        return
                except compat.LoadFailed as exc:
                    self._drop(binary, exc)
                break
        self.jit[grid](*args, **meta)

    def _drop(self, binary: Binary, exc: Exception) -> None:
        log_once(log, f"load:{self.module_name}:{self.fn.__name__}", "cgtrees codegen: %s: a stored binary of "
                 "%s could not be loaded (%s); it launches through Triton's JIT", self.module_name,
                 self.fn.__name__, exc)
        self.binaries = [b for b in self.binaries if b is not binary]

    def __repr__(self) -> str:
        return f"CachedKernel({self.fn.__name__}, {len(self.binaries)} binaries)"
