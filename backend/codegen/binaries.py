"""Compiled kernels kept with a kernel module, and launched without Triton's JIT.

A generated module launches a kernel as ``kernel[grid](*args, XBLOCK=..., num_warps=...)``. Through
Triton's JIT, a warm start paid 4-7 ms of Python at each kernel's first launch (an H100 host):
building its argument binder, parsing its own source for its cache key, finding that key in
Triton's on-disk cache, reading five files and loading a launcher; over a second for convnet's 177
training kernels, more than the rest of the warm start.

``capture(module)`` takes what Triton compiled for each kernel (binary, metadata, and the argument
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
warm, takes the same path.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Callable

from backend.codegen import compat
from backend.logs import log_once

log = logging.getLogger("backend.codegen")

INT_RANGES = {"i32": (-(2**31), 2**31), "i64": (-(2**63), 2**63), "u64": (0, 2**64)}


class Unusable(Exception):
    """A record this launcher cannot check or load (then its kernel goes through the JIT)."""


# ------------------------------------------------------------------------------------------ capture
def capture(module: ModuleType) -> dict[str, list[dict]]:
    """Every compiled specialisation of every kernel of ``module``, by kernel name."""
    found: dict[str, list[dict]] = {}
    for name, obj in list(vars(module).items()):
        records = []
        if isinstance(obj, CachedKernel):
            records = [b.record for b in obj.binaries]
            obj = obj.jit
        if compat.is_jit_function(obj):
            records += compat.compiled_specialisations(obj)
        if records:
            found[name] = records
    return found


# ------------------------------------------------------------------------------------------ install
def install(module: ModuleType, records: dict[str, list[dict]], name: str) -> int:
    """Put a ``CachedKernel`` in the place of each kernel of ``module`` that ``records`` has
    binaries for; the number of kernels so replaced."""
    installed = 0
    for kernel_name, kernel_records in records.items():
        jit = getattr(module, kernel_name, None)
        if isinstance(jit, CachedKernel):
            jit = jit.jit
        if not compat.is_jit_function(jit):
            continue
        binaries = []
        for record in kernel_records:
            try:
                binaries.append(Binary(jit, record))
            except Exception as exc:  # noqa: BLE001 - the kernel still launches through the JIT
                log_once(log, f"binary:{name}:{kernel_name}", "cgtrees codegen: %s: a stored binary of %s is "
                         "not usable (%s: %s); that kernel launches through Triton's JIT", name, kernel_name,
                         type(exc).__name__, exc)
        if binaries:
            setattr(module, kernel_name, CachedKernel(jit, binaries, name))
            installed += 1
    return installed


class Binary:
    """One compiled specialisation: what it assumes of the arguments, and the loaded binary."""

    def __init__(self, jit: Any, record: dict) -> None:
        names, constexprs = compat.jit_param_names(jit)
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
    first stored binary whose assumptions hold, else goes through the JIT (``jit``)."""

    def __init__(self, jit: Any, binaries: list[Binary], module_name: str) -> None:
        self.jit, self.binaries, self.module_name = jit, binaries, module_name

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
        log_once(log, f"load:{self.module_name}:{self.jit}", "cgtrees codegen: %s: a stored binary of %s could "
                 "not be loaded (%s); it launches through Triton's JIT", self.module_name, self.jit, exc)
        self.binaries = [b for b in self.binaries if b is not binary]

    def __repr__(self) -> str:
        return f"CachedKernel({self.jit!r}, {len(self.binaries)} binaries)"
