"""The level-1 value: what the driver made of one Dynamo graph, typed and frozen.

    aot.recorder      builds a CompiledFunction as AOTAutograd hands the driver its aten graphs
    cache.aot         stores ``as_record(refer_to_level_2=True)`` beside the key, and gives a hit
                      back as ``from_record`` with its kernel modules read in from level 2
    precompile        saves ``as_record()`` (self-contained) in a file of its own
    aot.rebuild       turns one into the callable, in every process the same way

A function holds its parts by AOTAutograd's graph kind (inference, or forward and backward), each
with what the driver told the runtime of that graph (its ``GraphContext`` fields), its example
inputs' metadata, its lifted constants and its module: a ``CompiledGraph``, a graph that runs
through aten as its FX code (``AtenCode``), or a reference to the level-2 entry that holds the
module (``Level2Ref``); then the runtime plan our wrapper needs (``RuntimePlan``, read off
AOTAutograd's metadata at compile time), AOTAutograd's backward graph of a training graph, the
guards a symbolic graph's entry is valid under, and the versions and devices it was made for.
A record is plain JSON; one that does not parse raises ``BadRecord`` (a corrupt entry).
Nothing here imports a stage.
"""

from __future__ import annotations

import base64
import contextlib
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterator, Literal, TypeVar

from cgtrees.compiled import AtenGraph, BadRecord, CompiledGraph, GraphFacts

Kind = Literal["forward", "backward", "inference"]
Dim = int | str  # a size or stride: an int, or a symbolic one as its text ("s0")
T = TypeVar("T")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's metadata: what a part keeps of an example input, a constant or a backward input."""

    size: tuple[Dim, ...]
    stride: tuple[Dim, ...]
    dtype: str  # "float32"
    device: str  # "cuda:0"

    @property
    def symbolic(self) -> bool:
        return any(isinstance(d, str) for d in (*self.size, *self.stride))

    def as_record(self) -> dict[str, Any]:
        return {"size": list(self.size), "stride": list(self.stride), "dtype": self.dtype, "device": self.device}

    @staticmethod
    def from_record(r: Any) -> "TensorSpec":
        return TensorSpec(tuple(map(_dim, r["size"])), tuple(map(_dim, r["stride"])), str(r["dtype"]), str(r["device"]))


@dataclass(frozen=True)
class SizeInput:
    """A size the graph takes as an input (a symbolic graph's): its value, or its symbol's text."""

    value: Dim

    def as_record(self) -> dict[str, Any]:
        return {"size_input": self.value}


InputSpec = TensorSpec | SizeInput


def _input_from_record(r: Any) -> InputSpec:
    return SizeInput(_dim(r["size_input"])) if "size_input" in r else TensorSpec.from_record(r)


@dataclass(frozen=True)
class Constant:
    """A lifted tensor constant: its name, metadata and bytes (row-major)."""

    name: str
    spec: TensorSpec
    data: bytes

    def as_record(self) -> dict[str, Any]:
        return {"name": self.name, **self.spec.as_record(), "data": base64.b64encode(self.data).decode()}

    @staticmethod
    def from_record(r: Any) -> "Constant":
        return Constant(str(r["name"]), TensorSpec.from_record(r), base64.b64decode(r["data"]))


@dataclass(frozen=True)
class AtenCode:
    """A graph that runs through aten, kept as its FX code taking its inputs boxed."""

    source: str
    facts: GraphFacts
    launches: int

    def graph(self) -> AtenGraph:
        return AtenGraph(self.facts, self.launches)


@dataclass(frozen=True)
class Level2Ref:
    """A generated module by the digest of the level-2 entry that holds it, with this program's
    facts of the graph (its outputs' source lines)."""

    digest: str
    facts: GraphFacts


Module = CompiledGraph | AtenCode | Level2Ref


def _module_record(module: Module) -> dict[str, Any]:
    if isinstance(module, CompiledGraph):
        return {"graph": module.as_record()}
    if isinstance(module, AtenCode):
        return {"aten_code": module.source, "facts": module.facts.as_record(), "launches": module.launches}
    return {"level_2": module.digest, "facts": module.facts.as_record()}


def _module_from_record(r: Any) -> Module:
    if "graph" in r:
        return CompiledGraph.from_record(r["graph"])
    if "aten_code" in r:
        return AtenCode(str(r["aten_code"]), GraphFacts.from_record(r["facts"]), int(r["launches"]))
    return Level2Ref(str(r["level_2"]), GraphFacts.from_record(r["facts"]))


@dataclass(frozen=True)
class CompiledPart:
    """One aten graph of the function: its module and what the runtime was told of it."""

    kind: Kind  # AOTAutograd's kind of graph
    name: str  # the ``GraphContext`` name of the process that made it ("g3_forward")
    module: Module
    inputs: tuple[InputSpec, ...]
    constants: tuple[Constant, ...] = ()
    static_inputs: tuple[int, ...] = ()
    mutated_inputs: tuple[int, ...] = ()
    runtime_kind: Kind | None = None  # how the runtime runs it, where that differs (compiled autograd's)
    saved_from: int | None = None
    level_2: str | None = None  # the digest of the level-2 entry that holds its module, if one does

    @property
    def runs_as(self) -> Kind:
        return self.runtime_kind or self.kind

    def as_record(self, refer_to_level_2: bool = False) -> dict[str, Any]:
        module = self.module
        if refer_to_level_2 and self.level_2 is not None and not isinstance(module, Level2Ref):
            module = Level2Ref(self.level_2, module.facts)
        return {"kind": self.kind, "name": self.name, "module": _module_record(module),
                "inputs": [x.as_record() for x in self.inputs], "constants": [c.as_record() for c in self.constants],
                "static_inputs": list(self.static_inputs), "mutated_inputs": list(self.mutated_inputs),
                "runtime_kind": self.runtime_kind, "saved_from": self.saved_from, "level_2": self.level_2}

    @staticmethod
    def from_record(r: Any) -> "CompiledPart":
        with _parsing("a compiled part"):
            return CompiledPart._from_record(r)

    @staticmethod
    def _from_record(r: Any) -> "CompiledPart":
        saved_from = r["saved_from"]
        return CompiledPart(
            kind=_kind(r["kind"]), name=str(r["name"]), module=_module_from_record(r["module"]),
            inputs=tuple(map(_input_from_record, r["inputs"])),
            constants=tuple(map(Constant.from_record, r["constants"])),
            static_inputs=_ints(r["static_inputs"]), mutated_inputs=_ints(r["mutated_inputs"]),
            runtime_kind=None if r["runtime_kind"] is None else _kind(r["runtime_kind"]),
            saved_from=None if saved_from is None else int(saved_from),
            level_2=None if r["level_2"] is None else str(r["level_2"]))


@dataclass(frozen=True)
class TangentFormat:
    """The layout a backward graph was traced with for one tangent: a memory format, else sizes
    and strides."""

    memory_format: str | None = None  # "channels_last"
    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()


@dataclass(frozen=True)
class RuntimePlan:
    """What our runtime wrapper (``aot.wrappers``) does around the compiled graphs, read off
    AOTAutograd's metadata at compile time (``aot.compat.runtime_plan``). Pairs are (output or
    saved tensor, its symbolic dimensions), (output, the input it is)."""

    num_inputs: int
    num_outputs: int
    dynamic_dims: tuple[tuple[int, tuple[int, ...]], ...] = ()  # outputs' symbolic dimensions, marked for Dynamo
    disable_amp: bool = False  # compiled under autocast: it runs with autocast off
    bump_versions: tuple[int, ...] = ()  # inputs mutated in the graph that autograd must see
    input_outputs: tuple[tuple[int, int], ...] = ()  # inference: outputs that are inputs
    # training only:
    unsafe_view_outputs: tuple[int, ...] = ()
    non_differentiable_outputs: tuple[int, ...] = ()
    tangent_outputs: tuple[int, ...] = ()
    tangent_formats: tuple[TangentFormat, ...] = ()
    num_saved_no_vc_check: int = 0
    nonleaf_requiring_grad: tuple[int, ...] = ()
    any_input_requires_grad: bool = False
    deterministic: bool | None = None
    num_saved_symints: int = 0  # sizes the backward takes (a symbolic graph's), saved last
    dynamic_saved: tuple[tuple[int, tuple[int, ...]], ...] = ()  # saved tensors' symbolic dimensions

    def as_record(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_record(r: Any) -> "RuntimePlan":
        dims = lambda pairs: tuple((int(i), _ints(d)) for i, d in pairs)  # noqa: E731
        return RuntimePlan(
            num_inputs=int(r["num_inputs"]), num_outputs=int(r["num_outputs"]), dynamic_dims=dims(r["dynamic_dims"]),
            disable_amp=bool(r["disable_amp"]), bump_versions=_ints(r["bump_versions"]),
            input_outputs=tuple((int(o), int(i)) for o, i in r["input_outputs"]),
            unsafe_view_outputs=_ints(r["unsafe_view_outputs"]),
            non_differentiable_outputs=_ints(r["non_differentiable_outputs"]),
            tangent_outputs=_ints(r["tangent_outputs"]),
            tangent_formats=tuple(TangentFormat(f["memory_format"], _ints(f["size"]), _ints(f["stride"]))
                                  for f in r["tangent_formats"]),
            num_saved_no_vc_check=int(r["num_saved_no_vc_check"]),
            nonleaf_requiring_grad=_ints(r["nonleaf_requiring_grad"]),
            any_input_requires_grad=bool(r["any_input_requires_grad"]),
            deterministic=None if r["deterministic"] is None else bool(r["deterministic"]),
            num_saved_symints=int(r["num_saved_symints"]), dynamic_saved=dims(r["dynamic_saved"]))


@dataclass(frozen=True)
class BackwardGraph:
    """AOTAutograd's backward graph of a training graph as our partition left it: its FX code,
    its inputs' metadata and its static inputs (by position). Compiled autograd copies it into its
    capture; a plain ``backward()`` compiles it where the function holds no compiled backward."""

    code: str
    inputs: tuple[TensorSpec, ...]
    static: tuple[int, ...]

    def as_record(self) -> dict[str, Any]:
        return {"code": self.code, "inputs": [s.as_record() for s in self.inputs], "static": list(self.static)}

    @staticmethod
    def from_record(r: Any) -> "BackwardGraph":
        return BackwardGraph(str(r["code"]), tuple(map(TensorSpec.from_record, r["inputs"])), _ints(r["static"]))


@dataclass(frozen=True)
class Origin:
    """What the function was made by and for: a process that differs cannot load it."""

    torch_version: str
    triton_version: str
    backend_source: str  # the hash of our own source
    device: str  # the devices' text (``cache.key.device_text``)


@dataclass(frozen=True)
class CompiledFunction:
    """One Dynamo graph compiled: its parts, the runtime plan, the backward record, the guards."""

    origin: Origin
    plan: RuntimePlan
    parts: tuple[CompiledPart, ...]
    detach: tuple[int, ...] = ()  # non-leaf inputs that require grad but get no gradient: detached
    backward_graph: BackwardGraph | None = None
    aot_metadata: str | None = None  # AOTAutograd's metadata, pickled (base64), for compiled autograd
    guards: str | None = None  # on a symbolic graph's sizes (``cache.compat.Symbols``)

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(p.kind for p in self.parts)

    def part(self, kind: Kind) -> CompiledPart | None:
        return next((p for p in self.parts if p.kind == kind), None)

    def map_parts(self, fn: Callable[[CompiledPart], CompiledPart]) -> "CompiledFunction":
        return replace(self, parts=tuple(map(fn, self.parts)))

    def as_record(self, refer_to_level_2: bool = False) -> dict[str, Any]:
        """Plain JSON; ``refer_to_level_2``: each module that a level-2 entry holds by its digest
        (the cache's entry), else the modules themselves (precompile's file needs no cache)."""
        return {"origin": asdict(self.origin), "plan": self.plan.as_record(),
                "parts": [p.as_record(refer_to_level_2) for p in self.parts], "detach": list(self.detach),
                "backward_graph": None if self.backward_graph is None else self.backward_graph.as_record(),
                "aot_metadata": self.aot_metadata, "guards": self.guards}

    @staticmethod
    def from_record(r: Any) -> "CompiledFunction":
        with _parsing("a compiled function"):
            bw = r["backward_graph"]
            return CompiledFunction(
                origin=Origin(**{k: str(v) for k, v in r["origin"].items()}), plan=RuntimePlan.from_record(r["plan"]),
                parts=tuple(map(CompiledPart.from_record, r["parts"])), detach=_ints(r["detach"]),
                backward_graph=None if bw is None else BackwardGraph.from_record(bw),
                aot_metadata=_optional(r["aot_metadata"], str), guards=_optional(r["guards"], str))


@contextlib.contextmanager
def _parsing(what: str) -> Iterator[None]:
    """A record that does not parse is a BadRecord (the cache counts it a corrupt entry)."""
    try:
        yield
    except BadRecord:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BadRecord(f"not {what} ({type(exc).__name__}: {exc})") from None


def _dim(d: Any) -> Dim:
    return d if isinstance(d, str) else int(d)


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _kind(value: Any) -> Kind:
    if value not in ("forward", "backward", "inference"):
        raise BadRecord(f"unknown graph kind {value!r}")
    return value


def _optional(value: Any, kind: Callable[[Any], T]) -> T | None:
    return None if value is None else kind(value)
