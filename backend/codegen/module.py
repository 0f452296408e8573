"""Compiled graphs ready to run: what the runtime wraps (``cgtrees.compiled.CompiledModule``).

    KernelModule    a ``CompiledGraph`` imported; its fallback (the same graph through aten)
                    takes over if its code fails
    AtenModule      the aten graph itself, run by FX (a graph codegen gave up on)

Each has ``call(args)`` (args boxed: it clears the list and frees each input at its last use) and
``graph``, what the runtime and the cache read of it; nobody reads a module's source or globals to
learn what it is.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from types import ModuleType
from typing import Any, Callable

import torch
import torch.fx

from cgtrees import counters
from cgtrees.compiled import AtenGraph, CompiledGraph, GraphFacts
from cgtrees.logs import log_once
from cgtrees.runtime import first_calls

log = logging.getLogger("cgtrees.codegen")


class AtenModule:
    """Runs an aten graph directly: a graph codegen gave up on, or one a level-1 entry kept as its
    FX code (``from_boxed``: ``aot.fx_code.load`` executes the code). Its FX code takes the inputs
    boxed, so each is freed at its last use as in a generated module (``gm(*args)`` would hold
    every input until the graph returns: the whole of a backward's saved activations)."""

    def __init__(self, gm: torch.fx.GraphModule | None, facts: GraphFacts | None = None) -> None:
        from cgtrees.codegen import compat

        self.gm = gm
        if gm is not None:
            self.graph = AtenGraph(GraphFacts.of(gm) if facts is None else facts, aten_launches(gm))
            self._boxed = compat.boxed_graph_module(gm)

    @classmethod
    def from_boxed(cls, boxed: Callable[[list[Any]], Any], graph: AtenGraph) -> "AtenModule":
        """The module of a graph known only by its boxed callable (it clears the list it is given)."""
        module = cls(None)
        module.graph, module._boxed = graph, boxed
        return module

    def call(self, args: list[Any]) -> Any:
        if self._boxed is not None:
            return self._boxed(args)  # clears ``args``
        outputs = self.gm(*args)
        args.clear()
        return outputs


def aten_launches(gm: torch.fx.GraphModule) -> int:
    """The aten calls of a graph that launch work: every op but views and tuple items."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and not n.target.is_view)


class KernelModule:
    """A loaded kernel module. ``call(args)`` runs it. If the generated code fails on its first call
    (or a Triton kernel fails to compile on a later call with new shapes: a new specialization),
    the reason and the source path are logged and the graph's aten path runs from then on.

    To rerun a failed call through aten, its inputs must still exist. Where a kernel may compile in
    the call (interpreted, or not every kernel compiled beforehand), the inputs are kept until the
    call returns, which holds every input (a backward's saved activations) for the whole call.
    Where every kernel was compiled before (``kernels_ready``), the first call holds its inputs
    weakly and frees each at its last use, as later calls do: a training step's first backward
    peaks no higher than the next ones. Should it fail all the same (a bug of ours in the generated
    code), it reruns through aten if nothing it freed is gone, and raises saying so otherwise.
    Only the first call of a module with static shapes is guarded at all; a module whose ``call``
    is aten calls already (``graph.fallback`` is None) is not guarded."""

    def __init__(self, graph: CompiledGraph, module: ModuleType, path: str, name: str,
                 mutated: tuple[int, ...] = (), kernels_ready: bool = False) -> None:
        self.graph = graph
        self.module = module
        self.path = path
        self.name = name
        self._run: Callable[[list[Any]], Any] = module.call
        self._mutated = mutated  # the inputs the graph writes into (the driver's ``mutated_inputs``)
        self._verified = graph.fallback is None  # nothing to fall back to: no guard needed
        self._hold_weakly = kernels_ready and not graph.dynamic
        self._ran_once = False
        self.failure: str | None = None  # why the module switched to its aten path, if it did

    @property
    def source(self) -> str:
        return self.graph.source

    def compiled(self) -> CompiledGraph:
        """The graph with the binaries its kernels have compiled so far, for the cache to keep."""
        from cgtrees.codegen import binaries

        return dataclasses.replace(self.graph, binaries=binaries.capture(self.module, self.graph.kernels))

    def call(self, args: list[Any]) -> Any:
        if self._verified:
            return self._run(args)
        saved = [_Weak(a) for a in args] if self._hold_weakly else list(args)
        before = []
        if not self._ran_once:
            first_calls.wait()  # a warm load's library calls, made beforehand, are done
            before = self._before_writes(args)
        try:
            out = self._run(args)
        except Exception as exc:  # noqa: BLE001  (a kernel failure must not reach the user)
            if self._ran_once and not _from_triton(exc):
                raise
            return self._rerun_through_aten(exc, saved, before)
        self._ran_once = True
        self._verified = not self.graph.dynamic  # new shapes compile new kernel specializations: keep guarding
        return out

    def _rerun_through_aten(self, exc: Exception, saved: list[Any], before: list[tuple[int, torch.Tensor]]) -> Any:
        log_once(log, f"kernelfail:{self.path}", "cgtrees codegen: %s: generated code failed (%s: %s); "
                 "source: %s; this graph runs through aten from now on", self.name, type(exc).__name__,
                 str(exc)[:2000], self.path)
        counters.bump("graph_fallbacks")
        self.failure = f"{type(exc).__name__}: {exc}"
        self._run, self._verified = self._aten_path(), True
        if self._hold_weakly:
            saved = [a.get() if isinstance(a, _Weak) else a for a in saved]
            if any(a is _Weak.GONE for a in saved):
                raise RuntimeError(f"cgtrees codegen: {self.name}: generated code failed ({self.failure}) "
                                   f"after freeing inputs nothing else holds, so it cannot rerun through "
                                   f"aten; source: {self.path}") from exc
        for i, value in before:  # what the failed call wrote into an input is undone
            saved[i].copy_(value)
        return self._run(saved)  # an error of the user's own program raises again here

    def _aten_path(self) -> Callable[[list[Any]], Any]:
        """``graph.fallback`` run in the module's namespace (which imports what it calls)."""
        namespace = vars(self.module)
        exec(compile(self.graph.fallback, f"{self.path} (aten path)", "exec"), namespace)  # noqa: S102 - ours
        return namespace["call_aten"]

    def _before_writes(self, args: list[Any]) -> list[tuple[int, torch.Tensor]]:
        """Copies of the inputs the graph writes into, kept through a guarded call: a kernel may
        write one (the copy back of an in-place op, or the write itself) before a later kernel
        fails, and the rerun through aten must start from the input the program passed (an
        accumulation applied twice would double). One copy per mutated input, on the first call
        only: a later guarded call (new shapes of a dynamic module) is not worth a copy of, say, a
        KV cache per call, and its kernels fail to compile, if at all, before the first runs."""
        return [(i, args[i].detach().clone()) for i in self._mutated
                if i < len(args) and isinstance(args[i], torch.Tensor)]


class _Weak:
    """A first call's input, held weakly (a tensor) or as it is (anything else)."""

    GONE = object()
    __slots__ = ("ref", "value")

    def __init__(self, value: Any) -> None:
        self.ref = weakref.ref(value) if isinstance(value, torch.Tensor) else None
        self.value = None if self.ref is not None else value

    def get(self) -> Any:
        if self.ref is None:
            return self.value
        value = self.ref()
        return _Weak.GONE if value is None else value


def _from_triton(exc: BaseException) -> bool:
    """Raised while compiling or launching a Triton kernel (a new specialization, say)."""
    if (type(exc).__module__ or "").startswith("triton"):
        return True
    tb = exc.__traceback__
    while tb is not None:
        if f"{os.sep}triton{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False
