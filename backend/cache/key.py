"""The cache key: an explicit object whose fields print one by one, so a miss can be explained.

A key holds exactly what changes the compiled result: the canonical graph text (ops, targets,
arguments, shapes, strides, dtypes, devices; node names replaced by their position, so renaming
does not miss), the graph inputs' metadata, the static-input indices, the config fields marked as
affecting codegen, a hash of our own source files, torch and Triton versions, and the device.
Symbolic shapes print in their symbolic form, an input's too (``make_key``'s ``traced_inputs``): a
key never holds the sizes of the call that compiled a symbolic graph (the guards on them are kept
beside the key, ``cache.aot``).

``graph_text`` is the one canonical text of a graph: the key holds it, and a generated kernel
module's header shows its digest (``graph_digest``) beside the key's. A pass that knows what a call
target without a stable name does (compiled autograd's ops, ``aot.compiled_autograd``) hands its
text in ``target_texts`` (by node name).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from cgtrees.cache.compat import Uncacheable, tensor_bytes
from cgtrees.config import Config


@dataclass(frozen=True)
class CacheKey:
    level: str  # "aot": a Dynamo graph's whole AOT result; "module": one aten graph's kernel module
    graph: str  # canonical graph text
    inputs: tuple[str, ...]  # one line per graph input
    static_inputs: tuple[int, ...]
    context: tuple[tuple[str, str], ...]  # level-specific state: graph kind, grad mode, AOT config...
    codegen: tuple[tuple[str, Any], ...]  # Config.codegen_key()
    backend_source: str
    torch_version: str
    triton_version: str
    device: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return digest_of(self.as_dict())

    def diff(self, other: "CacheKey | dict[str, Any]") -> list[str]:
        """The fields that differ, each with a short account of how."""
        theirs = _jsonable(other if isinstance(other, dict) else other.as_dict())
        out = []
        for name, mine in _jsonable(self.as_dict()).items():
            if theirs.get(name) != mine:
                out.append(f"{name}: {_first_difference(mine, theirs.get(name))}")
        return out

    def describe(self) -> str:
        lines = []
        for name, value in self.as_dict().items():
            text = "\n    ".join(value.splitlines()) if isinstance(value, str) else repr(value)
            lines.append(f"{name}: {text}")
        return "\n".join(lines)


def digest_of(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(_jsonable(fields), sort_keys=True).encode()).hexdigest()


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


def _first_difference(mine: Any, theirs: Any) -> str:
    if isinstance(mine, str) and isinstance(theirs, str):
        a, b = mine.splitlines(), theirs.splitlines()
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"line {i}: {x!r} != {y!r}"
        return f"{len(a)} lines != {len(b)} lines"
    if isinstance(mine, list) and isinstance(theirs, list):
        for i, (x, y) in enumerate(zip(mine, theirs)):
            if x != y:
                return f"item {i}: {x!r} != {y!r}"
        return f"{len(mine)} items != {len(theirs)} items"
    return f"{mine!r} != {theirs!r}"


# ---- the pieces -------------------------------------------------------------------------------

def make_key(level: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Config,
             static_inputs: Sequence[int], context: Sequence[tuple[str, str]],
             target_texts: Mapping[str, str] = MappingProxyType({}),
             traced_inputs: Sequence[Any] | None = None) -> CacheKey:
    """``traced_inputs``: each input's traced value (a Dynamo graph's placeholders'), whose symbolic
    sizes the key shows instead of this call's (None: the inputs' own)."""
    traced = traced_inputs if traced_inputs is not None else [None] * len(example_inputs)
    return CacheKey(
        level=level,
        graph=graph_text(gm, target_texts),
        inputs=tuple(value_text(x, like) for x, like in zip(example_inputs, traced, strict=True)),
        static_inputs=tuple(static_inputs),
        context=tuple((k, str(v)) for k, v in context),
        codegen=config.codegen_key(),
        backend_source=backend_source_hash(),
        torch_version=torch.__version__,
        triton_version=triton_version(),
        device=device_text(example_inputs),
    )


def graph_text(gm: torch.fx.GraphModule, target_texts: Mapping[str, str] = MappingProxyType({})) -> str:
    """One line per node: position, op, target, arguments and value; names never appear.
    ``target_texts``: the text of call targets that have no stable name, by node name.
    Uncacheable when some part has no text that means the same in every process."""
    index: dict[torch.fx.Node, str] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = f"%{i}"
        target = target_texts[node.name] if node.name in target_texts else _target_text(gm, node)
        args = _arg_text(node.args, index)
        kwargs = _arg_text(node.kwargs, index)
        # An output's value follows from its arguments' (and a graph traced back from its code,
        # ``backward_graph``, has none there): left out, so both give one text.
        value = None if node.op == "output" else node.meta.get("val", node.meta.get("example_value"))
        lines.append(f"%{i} = {node.op} {target} {args} {kwargs} : {value_text(value) if value is not None else '-'}")
    return "\n".join(lines)


def graph_digest(gm: torch.fx.GraphModule) -> str:
    """A short digest of ``graph_text`` (a generated module's graph hash)."""
    return text_digest(graph_text(gm))


def text_digest(text: str) -> str:
    """The short digest of a graph's canonical text (a key holds the text: ``CacheKey.graph``)."""
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _target_text(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    target = node.target
    if node.op in ("placeholder", "output"):
        return ""
    if node.op == "call_method":
        return str(target)
    if node.op == "get_attr":
        return f"attr[{_attr_text(getattr(gm, str(target)))}]"
    if node.op == "call_module":
        raise Uncacheable(f"graph calls a module ({target})")
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return str(target)
    return stable_name(target)


def stable_name(target: Any) -> str:
    """``module.qualname`` of a Python call target; a wrapper made inside a function (its qualname
    holds ``<locals>``, as ``F.max_pool2d``'s ``boolean_dispatch`` has) is named by where its module
    publishes it, when that is the same object."""
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if module is None or name is None:
        raise Uncacheable(f"call target {target!r} has no stable name")
    name = _without_pybind11_records(name)
    module = _publishing_module(target, module, name)
    owner = getattr(target, "__self__", None)
    if owner is not None and not isinstance(owner, (types.ModuleType, type)) and not _published(target, module, name):
        raise Uncacheable(f"call target {target!r} is bound to an object: its name does not say what it does")
    if "<" in name:
        public = getattr(target, "__name__", "")
        owner = sys.modules.get(module)
        if not public or owner is None or getattr(owner, public, None) is not target:
            raise Uncacheable(f"call target {target!r} has no stable name")
        name = public
    return f"{module}.{name}"


def _without_pybind11_records(dotted: str) -> str:
    """``dotted`` less its ``pybind11_*`` parts: a pybind11 function record's name, with the C++ ABI
    spelled out in it (``pybind11_detail_function_record_v1_system_libstdcpp_gxx_abi_...``), which
    pybind11 3 puts in ``__module__`` or ``__qualname__`` of a function such as torch 2.11's
    ``torch._C._log_api_usage_once``. It never names the target, and differs between builds."""
    return ".".join(part for part in dotted.split(".") if not part.startswith("pybind11_"))


def _publishing_module(target: Any, module: str, name: str) -> str:
    """``module``, or where it is not a module, the innermost module above it that publishes
    ``target`` under ``name`` (a pybind11 record's name left out first)."""
    module = _without_pybind11_records(module)
    if module in sys.modules:
        return module
    parts = module.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if getattr(sys.modules.get(prefix), name, None) is target:
            return prefix
    return module


def _published(target: Any, module: str, name: str) -> bool:
    """Whether ``target`` is a free function despite its ``__self__``: a pybind11 function
    (``torch._C._log_api_usage_once``) is bound to its function record, which holds no state of the
    caller's; or ``module.name`` is ``target`` itself (a bound method is new at each access)."""
    if "pybind11" in type(getattr(target, "__self__", None)).__name__:
        return True
    return getattr(sys.modules.get(module), name, None) is target


def constants_text(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> str:
    """The lifted constants of an aten graph (``aot.constants``): metadata and a hash of the bytes."""
    lines = []
    for name, value in zip(names, tensors):
        digest = hashlib.sha256(tensor_bytes(value)).hexdigest()[:32]
        lines.append(f"{name}: {value_text(value)} sha256={digest}")
    return "\n".join(lines)


def _attr_text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.numel() * value.element_size() > (1 << 20) or value.device.type == "meta":
            raise Uncacheable("graph holds a large tensor constant")
        return f"{value_text(value)} sha256={hashlib.sha256(tensor_bytes(value)).hexdigest()[:16]}"
    if isinstance(value, torch.fx.GraphModule):
        return "graph{" + graph_text(value).replace("\n", "; ") + "}"
    raise Uncacheable(f"graph holds an attribute of type {type(value).__name__}")


def _arg_text(arg: Any, index: dict[torch.fx.Node, str]) -> str:
    if isinstance(arg, torch.fx.Node):
        return index[arg]
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_arg_text(a, index) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k}={_arg_text(v, index)}" for k, v in sorted(arg.items(), key=str)) + "}"
    if isinstance(arg, slice):
        return f"slice({_arg_text(arg.start, index)}, {_arg_text(arg.stop, index)}, {_arg_text(arg.step, index)})"
    if arg is None or isinstance(arg, (bool, int, str)):
        return repr(arg)
    if isinstance(arg, float):
        return repr(arg) if math.isfinite(arg) else str(arg)
    if isinstance(arg, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(arg)
    if isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"sym({arg})"
    if type(arg).__name__ == "ellipsis":
        return "..."
    raise Uncacheable(f"graph argument of type {type(arg).__name__}")


def value_text(value: Any, like: Any = None) -> str:
    """A tensor's type, dtype, sizes, strides, offset, device and autograd flags; other values' repr.
    ``like``: a traced value of the tensor with symbolic sizes, whose sizes, strides and offset are
    printed instead (so that a key holds a symbolic graph's sizes as symbols, not one call's)."""
    if isinstance(value, torch.Tensor):
        dims = like if isinstance(like, torch.Tensor) else value
        flags = []
        if value.requires_grad:
            flags.append("requires_grad")
        if isinstance(value, torch.nn.Parameter):
            flags.append("parameter")
        static = getattr(value, "_dynamo_static_input_type", None)
        if static is not None:
            flags.append(f"static={static}")
        kind = "" if type(value).__name__ in ("Tensor", "FakeTensor", "Parameter") else f"{type(value).__qualname__} "
        return (f"{kind}{str(value.dtype).removeprefix('torch.')}{list(dims.shape)} stride={list(dims.stride())} "
                f"offset={dims.storage_offset()} {value.device} {' '.join(flags)}").rstrip()
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(value_text(v) for v in value) + ")"
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"sym({value})"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__qualname__


def device_text(example_inputs: Sequence[Any]) -> str:
    devices = sorted({str(x.device) for x in example_inputs if isinstance(x, torch.Tensor)})
    return ",".join(_device_line(name) for name in devices) or "none"


def _device_line(name: str) -> str:
    device = torch.device(name)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{name}:{torch.cuda.get_device_name(device)}:sm{major}{minor}"
    return name


def device_mismatch(saved: str) -> str | None:
    """Why the devices ``device_text`` described in another process are not this process's (a
    missing device, another GPU model or capability), or None when they are."""
    for line in saved.split(","):
        if line in ("none", "cpu"):
            continue
        name = ":".join(line.split(":")[:2]) if line.startswith("cuda:") else line
        try:
            device = torch.device(name)
        except RuntimeError:
            return f"saved for an unknown device {line!r}"
        backend = getattr(torch, device.type, None)
        available = getattr(backend, "is_available", None)
        if available is None or not available():
            return f"saved for {line}; this process has no {device.type} device"
        if device.type == "cuda":
            if (device.index or 0) >= torch.cuda.device_count():
                return f"saved for {line}; this process has no {name}"
            mine = _device_line(name)
            if mine != line:
                return f"saved for {line}; this process has {mine}"
    return None


@functools.lru_cache(maxsize=1)
def backend_source_hash() -> str:
    """Our own source: any change to the backend invalidates every entry."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__
