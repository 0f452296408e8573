"""The seam between codegen, the cache and the runtime: what a compiled aten graph is.

    GraphFacts      what the runtime must know of the graph, found in the aten graph at compile
                    time and kept in cache entries: why it cannot be captured (R7), the op and
                    user source line behind each output (R1's message), and the library calls
                    its module makes (for a warm load to make beforehand: ``first_calls``)
    CompiledModule  the one interface of every compiled graph: ``call(args) -> outputs`` (args
                    boxed: the module clears the list and frees each input at its last use),
                    ``facts``, ``source`` (None where the graph runs through FX code), ``binaries()``
    AtenModule      the aten graph itself, run by FX (a graph codegen gave up on)
    KernelModule    a loaded generated module; its aten path takes over if its code fails

The runtime wraps a CompiledModule; it never reads a module's source or graph to learn these.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx

from backend import counters
from backend.codegen import first_calls
from backend.logs import log_once

log = logging.getLogger("backend.codegen")

# Ops that synchronise with the host or produce data-dependent shapes: a capture would fail.
_UNCAPTURABLE = frozenset({
    "_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "unique",
    "_unique", "_unique2", "unique_consecutive", "unique_dim", "equal", "is_nonzero",
    "_assert_async", "repeat_interleave", "bincount", "histc",
})


@dataclass(frozen=True)
class GraphFacts:
    uncapturable: str | None = None  # why a CUDA graph capture would fail (R7), if it would
    output_ops: tuple[str, ...] = ()  # per output: "aten.op.overload (file:line: source)"
    library_calls: tuple[str, ...] = ()  # what a warm load makes beforehand (``first_calls.specs``)

    def output_op(self, index: int) -> str:
        return self.output_ops[index] if index < len(self.output_ops) else "an unknown op"

    def as_record(self) -> dict[str, Any]:
        return {"uncapturable": self.uncapturable, "output_ops": list(self.output_ops),
                "library_calls": list(self.library_calls)}

    @staticmethod
    def from_record(record: Any) -> "GraphFacts":
        """An entry's facts; an entry without them (written before they existed) knows nothing."""
        if not isinstance(record, dict):
            return UNKNOWN
        reason = record.get("uncapturable")
        outputs = record.get("output_ops", [])
        return GraphFacts(reason if isinstance(reason, str) else None, tuple(str(o) for o in outputs),
                          library_calls(record.get("library_calls")))


UNKNOWN = GraphFacts()


def library_calls(record: Any) -> tuple[str, ...]:
    """The ``library_calls`` of an entry (none from one written before they existed)."""
    return tuple(c for c in record if isinstance(c, str)) if isinstance(record, list) else ()


def facts_of(gm: torch.fx.GraphModule | None) -> GraphFacts:
    if gm is None:
        return UNKNOWN
    return GraphFacts(_uncapturable_op(gm), tuple(_output_ops(gm)))


def has_symbolic_shapes(example_inputs: list) -> bool:
    """Inputs with symbolic sizes: each new size may compile new kernel specializations."""
    for a in example_inputs:
        if isinstance(a, torch.SymInt):
            return True
        if isinstance(a, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*a.shape, *a.stride())):
            return True
    return False


def _uncapturable_op(gm: torch.fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if uncapturable(node.target):
            return f"op {node.target} cannot be captured in a CUDA graph"
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dim() > 0:
            return f"op {node.target} produces a CPU tensor"
    return None


def uncapturable(target: torch._ops.OpOverload) -> bool:
    unsafe_tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    name = target._schema.name.split("::")[-1]
    return name in _UNCAPTURABLE or (unsafe_tag is not None and unsafe_tag in target.tags)


def _output_ops(gm: torch.fx.GraphModule) -> list[str]:
    output = next(iter(gm.graph.find_nodes(op="output")), None)
    if output is None:
        return []
    result = []
    for arg in output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]:
        if not isinstance(arg, torch.fx.Node):
            result.append("a constant")
            continue
        where = (arg.meta.get("stack_trace") or "").strip().splitlines()
        line = f" ({where[-2].strip()}: {where[-1].strip()})" if len(where) >= 2 else ""
        result.append(f"input {arg.name}" if arg.op == "placeholder" else f"{arg.target}{line}")
    return result


class CompiledModule(Protocol):
    facts: GraphFacts
    source: str | None
    launches: int | None  # kernels and aten calls per call (None: not known)

    def call(self, args: list[Any]) -> Any: ...

    def binaries(self) -> dict[str, list[dict]]: ...


class AtenModule:
    """Runs the aten graph directly (a graph codegen gave up on). Its FX code takes the inputs
    boxed, so each is freed at its last use as in a generated module (``gm(*args)`` would hold
    every input until the graph returns: the whole of a backward's saved activations)."""

    source = None

    def __init__(self, gm: torch.fx.GraphModule | None, facts: GraphFacts | None = None) -> None:
        from backend.codegen import compat

        self.gm = gm
        self.facts = facts_of(gm) if facts is None else facts
        self.launches = None if gm is None else _aten_launches(gm)
        self._boxed = None if gm is None else compat.boxed_graph_module(gm)

    def call(self, args: list[Any]) -> Any:
        if self._boxed is not None:
            return self._boxed(args)  # clears ``args``
        outputs = self.gm(*args)
        args.clear()
        return outputs

    def binaries(self) -> dict[str, list[dict]]:
        return {}


class KernelModule:
    """A loaded kernel module. ``call(args)`` runs it. If the generated code fails on its first call
    (or a Triton kernel fails to compile on a later call with new shapes: a new specialization),
    the reason and the source path are logged and the module's aten path runs from then on.

    To rerun a failed call through aten, its inputs must still exist. Where a kernel may compile in
    the call (interpreted, or not every kernel compiled beforehand), the inputs are kept until the
    call returns, which holds every input (a backward's saved activations) for the whole call.
    Where every kernel was compiled before (``kernels_ready``), the first call holds its inputs
    weakly and frees each at its last use, as later calls do: a training step's first backward
    peaks no higher than the next ones. Should it fail all the same (a bug of ours in the generated
    code), it reruns through aten if nothing it freed is gone, and raises saying so otherwise.
    Only the first call of a module with static shapes is guarded at all."""

    def __init__(self, module: Any, source: str, path: str, name: str, facts: GraphFacts = UNKNOWN,
                 dynamic: bool = False, kernels_ready: bool = False) -> None:
        self.module = module
        self.source = source
        self.path = path
        self.name = name
        self.facts = facts
        self.graph_hash = getattr(module, "GRAPH_HASH", None)
        self.launches = getattr(module, "LAUNCHES", None)  # older entries: not known
        self._run = module.call
        self._aten = module.call_aten
        self._mutated = tuple(getattr(module, "MUTATED_INPUTS", ()))  # older entries: none known
        self._verified = module.call is module.call_aten  # nothing to compile: no guard needed
        self._dynamic = dynamic  # new shapes compile new kernel specializations: keep guarding
        self._hold_weakly = kernels_ready and not dynamic
        self._ran_once = False
        self.failure: str | None = None  # why the module switched to its aten path, if it did

    def binaries(self) -> dict[str, list[dict]]:
        """The compiled binaries of its kernels, for the cache to keep with its source."""
        from backend.codegen import binaries

        return binaries.capture(self.module)

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
            log_once(log, f"kernelfail:{self.path}", "cgtrees codegen: %s: generated code failed (%s: %s); "
                     "source: %s; this graph runs through aten from now on", self.name, type(exc).__name__,
                     str(exc)[:2000], self.path)
            counters.bump("graph_fallbacks")
            self.failure = f"{type(exc).__name__}: {exc}"
            self._run, self._verified = self._aten, True
            if self._hold_weakly:
                saved = [a.get() if isinstance(a, _Weak) else a for a in saved]
                if any(a is _Weak.GONE for a in saved):
                    raise RuntimeError(f"cgtrees codegen: {self.name}: generated code failed ({self.failure}) "
                                       f"after freeing inputs nothing else holds, so it cannot rerun through "
                                       f"aten; source: {self.path}") from exc
            for i, value in before:  # what the failed call wrote into an input is undone
                saved[i].copy_(value)
            return self._aten(saved)  # an error of the user's own program raises again here
        self._ran_once = True
        self._verified = not self._dynamic
        return out

    def _before_writes(self, args: list[Any]) -> list[tuple[int, torch.Tensor]]:
        """Copies of the inputs the graph writes into, kept through a guarded call: a kernel may
        write one (the copy back of an in-place op, or the write itself) before a later kernel
        fails, and the rerun through aten must start from the input the program passed (an
        accumulation applied twice would double). One copy per mutated input, on the first call
        only: a later guarded call (new shapes of a dynamic module) is not worth a copy of, say, a
        KV cache per call, and its kernels fail to compile, if at all, before the first runs."""
        return [(i, args[i].detach().clone()) for i in self._mutated
                if i < len(args) and isinstance(args[i], torch.Tensor)]


def _aten_launches(gm: torch.fx.GraphModule) -> int:
    """The aten calls of a graph that launch work: every op but views and tuple items."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and not n.target.is_view)


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
