"""The value handed across the seams: what codegen made of one aten graph.

    codegen.generate(gm, inputs, ctx) -> CompiledGraph    the module text and every fact about it
    codegen.load(graph, ctx) -> KernelModule              a CompiledModule: ``call`` and ``graph``
    cache                                                 keeps ``graph.as_record()`` (binaries in it)
                                                          and gives back ``CompiledGraph.from_record``
    runtime.wrap(module, ...)                             reads ``module.graph.facts``, ``launches`` and
                                                          ``device_scalars`` (CompiledGraph and AtenGraph alike)

Nothing here imports a stage: codegen, the cache and the runtime all import this module, and none
of them reads another's objects with ``getattr`` or reads data back out of a generated module.
A record is plain JSON (the cache's entries and precompile's files hold it); a record that does
not parse raises ``BadRecord``, which the cache counts as a corrupt entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
import torch.fx

# Ops that synchronise with the host or produce data-dependent shapes: a capture would fail.
_UNCAPTURABLE = frozenset({
    "_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "unique",
    "_unique", "_unique2", "unique_consecutive", "unique_dim", "equal", "is_nonzero",
    "_assert_async", "repeat_interleave", "bincount", "histc",
})


class BadRecord(ValueError):
    """A stored record that is not a CompiledGraph (damaged, or written by another format)."""


@dataclass(frozen=True)
class GraphFacts:
    """What the runtime must know of the aten graph, found in it at compile time: why a CUDA graph
    capture would fail (R7), and the op and user source line behind each output (R1's message)."""

    uncapturable: str | None = None
    output_ops: tuple[str, ...] = ()  # per output: "aten.op.overload (file:line: source)"

    def output_op(self, index: int) -> str:
        return self.output_ops[index] if index < len(self.output_ops) else "an unknown op"

    def as_record(self) -> dict[str, Any]:
        return {"uncapturable": self.uncapturable, "output_ops": list(self.output_ops)}

    @staticmethod
    def from_record(record: Any) -> "GraphFacts":
        if not isinstance(record, dict) or not isinstance(record.get("output_ops"), list):
            raise BadRecord("graph facts are not a record")
        reason = record.get("uncapturable")
        return GraphFacts(reason if isinstance(reason, str) else None, tuple(str(o) for o in record["output_ops"]))

    @staticmethod
    def of(gm: torch.fx.GraphModule) -> "GraphFacts":
        return GraphFacts(_uncapturable_op(gm), tuple(_output_ops(gm)))


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel with the argument types of its launch, so that every kernel of a module compiles
    together before the first call (``codegen.precompile``): element types of the pointers, then
    the sizes as ints, and the launch's block sizes and ``num_warps``."""

    kernel: str
    pointers: tuple[str, ...]  # dtype names ("float32")
    sizes: tuple[int, ...]
    meta: tuple[tuple[str, int], ...]

    def as_record(self) -> list[Any]:
        return [self.kernel, list(self.pointers), list(self.sizes), [list(m) for m in self.meta]]

    @staticmethod
    def from_record(record: Any) -> "KernelLaunch":
        kernel, pointers, sizes, meta = record
        return KernelLaunch(str(kernel), tuple(map(str, pointers)), tuple(map(int, sizes)),
                            tuple((str(k), int(v)) for k, v in meta))


@dataclass(frozen=True)
class CompiledGraph:
    """One aten graph as codegen made it. ``source`` is a module that runs on its own: its
    ``call(args)`` takes the inputs boxed (it clears the list and frees each at its last use).
    ``fallback`` is the same graph as straight aten calls (``def call_aten(args)``), which the
    loaded module runs from when a kernel fails; None where ``call`` is aten calls already.
    ``binaries`` and ``code`` are filled once its kernels are compiled (``KernelModule.compiled``)
    and by the cache (the compiled Python of the source), so a warm load compiles nothing."""

    source: str
    facts: GraphFacts
    graph_hash: str | None = None  # the digest of the graph's canonical text (``cache.key.graph_digest``)
    kernels: tuple[str, ...] = ()  # the names of its Triton kernels, in the module's order
    launches: int = 0  # kernels with work and aten calls per call
    precompile: tuple[KernelLaunch, ...] = ()
    library_calls: tuple[str, ...] = ()  # cuBLAS/cuDNN calls a warm load makes beforehand (JSON texts)
    device: str = "cpu"
    dynamic: bool = False  # symbolic sizes: a new size may compile new kernel specialisations
    fallback: str | None = None
    gemm_choices: tuple[str, ...] = ()  # each GEMM's form and the timings behind it (codegen.gemm_choice)
    device_scalars: tuple[int, ...] = ()  # CPU 0-d tensor inputs that ``call`` moves to the device itself
    binaries: dict[str, list[dict]] = field(default_factory=dict, compare=False)
    code: dict[str, str] | None = field(default=None, compare=False)

    def with_facts(self, facts: GraphFacts) -> "CompiledGraph":
        return replace(self, facts=facts)

    def as_record(self) -> dict[str, Any]:
        return {"source": self.source, "facts": self.facts.as_record(), "graph_hash": self.graph_hash,
                "kernels": list(self.kernels), "launches": self.launches,
                "precompile": [k.as_record() for k in self.precompile], "library_calls": list(self.library_calls),
                "device": self.device, "dynamic": self.dynamic, "fallback": self.fallback,
                "gemm_choices": list(self.gemm_choices), "device_scalars": list(self.device_scalars),
                "binaries": self.binaries, "code": self.code}

    @staticmethod
    def from_record(record: Any) -> "CompiledGraph":
        try:
            graph = CompiledGraph(
                source=record["source"], facts=GraphFacts.from_record(record["facts"]),
                graph_hash=record["graph_hash"], kernels=tuple(record["kernels"]), launches=int(record["launches"]),
                precompile=tuple(KernelLaunch.from_record(k) for k in record["precompile"]),
                library_calls=tuple(record["library_calls"]), device=str(record["device"]),
                dynamic=bool(record["dynamic"]), fallback=record["fallback"],
                gemm_choices=tuple(map(str, record.get("gemm_choices", ()))),
                device_scalars=tuple(map(int, record.get("device_scalars", ()))), binaries=record["binaries"],
                code=record["code"])
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRecord(f"not a compiled graph ({type(exc).__name__}: {exc})") from None
        if not isinstance(graph.source, str) or not isinstance(graph.binaries, dict):
            raise BadRecord("not a compiled graph (no source)")
        return graph


class CompiledModule(Protocol):
    """A compiled graph ready to run: a loaded kernel module, or the aten graph itself where
    codegen gave up (``graph.source`` is then None). The runtime wraps one."""

    @property
    def graph(self) -> "CompiledGraph | AtenGraph": ...

    def call(self, args: list[Any]) -> Any: ...


@dataclass(frozen=True)
class AtenGraph:
    """What is known of a graph that runs through aten, not through a generated module."""

    facts: GraphFacts
    launches: int  # the aten calls that launch work
    source: None = None
    device_scalars: tuple[int, ...] = ()  # none: the runtime reads the same fields of both kinds of graph


def has_symbolic_shapes(example_inputs: list) -> bool:
    """Inputs with symbolic sizes: each new size may compile new kernel specialisations."""
    for a in example_inputs:
        if isinstance(a, torch.SymInt):
            return True
        if isinstance(a, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*a.shape, *a.stride())):
            return True
    return False


def uncapturable(target: torch._ops.OpOverload) -> bool:
    unsafe_tag = torch.Tag.__members__.get("cudagraph_unsafe")  # a tag newer torch has
    name = target._schema.name.split("::")[-1]
    return name in _UNCAPTURABLE or (unsafe_tag is not None and unsafe_tag in target.tags)


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
