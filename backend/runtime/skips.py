"""Reasons, known when a graph is wrapped, why it must run without CUDA graphs (R7).

Invariants: each check looks only at the example inputs and the aten graph; the first reason found
is the one reported. Reasons found later, at run time (a capture that fails, too many shapes, a
static input that keeps moving), live in ``function.py``.

The graph behind a module is read from what the module keeps: an ``AtenModule``'s ``gm``, else the
straight-line aten listing in its source (``call_aten`` of a generated kernel module, ``forward``
of a cached FX module), read as a ``Listing``: its ops (for R7) and the op behind each output (for
R1's message). A module that keeps neither gives an empty listing: no R7 check before capture (a
capture that fails still runs the graph without CUDA graphs) and R1 names "an unknown op".
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from backend.context import GraphContext
from backend.runtime import compat

# Ops that synchronise with the host or produce data-dependent shapes: a capture would fail.
_UNCAPTURABLE = {
    "_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "unique",
    "_unique", "_unique2", "unique_consecutive", "unique_dim", "equal", "is_nonzero",
    "_assert_async", "repeat_interleave", "bincount", "histc",
}


def graph_of(call: Callable[..., Any]) -> torch.fx.GraphModule | None:
    """The aten graph behind a kernel module's ``call``, where the module keeps it."""
    owner = getattr(call, "__self__", None)
    gm = getattr(owner, "gm", None)
    return gm if isinstance(gm, torch.fx.GraphModule) else None


@dataclass
class Listing:
    """What a module's aten listing says: every op it calls, and the op behind each output."""

    ops: list[torch._ops.OpOverload] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


def listing_of(call: Callable[..., Any]) -> Listing | None:
    """The aten listing kept in the source of ``call``'s module (a generated kernel module's
    ``call_aten``, a cached FX module's ``forward``); None where there is none or it cannot be read."""
    owner = getattr(call, "__self__", None)
    source, name = getattr(owner, "source", None), "call_aten"
    if not isinstance(source, str):
        source, name = getattr(owner, "code", None), "forward"
    if not isinstance(source, str):
        return None
    try:
        return _read_listing(source, name)
    except Exception:  # noqa: BLE001 - a listing we cannot read is no listing (as before)
        return None


def _read_listing(source: str, name: str) -> Listing | None:
    lines = source.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"def {name}(")), None)
    if start is None:
        return None
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t"):
        end += 1  # the function ends at the first line that is not indented
    func = ast.parse("\n".join(lines[start:end])).body[0]
    if not isinstance(func, ast.FunctionDef):
        return None
    listing = Listing()
    produced: dict[str, str] = {a.arg: f"input {a.arg}" for a in func.args.args if a.arg != "self"}
    for stmt in func.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
            if isinstance(target, ast.Tuple):  # ``arg0_1, arg1_1, = args``: the inputs
                for elt in target.elts:
                    if isinstance(elt, ast.Name):
                        produced[elt.id] = f"input {elt.id}"
            elif isinstance(target, ast.Name):
                produced[target.id] = _produced_by(value, produced, listing)
        elif isinstance(stmt, ast.Return) and stmt.value is not None:
            results = stmt.value.elts if isinstance(stmt.value, (ast.Tuple, ast.List)) else [stmt.value]
            listing.outputs = [produced.get(r.id, "an unknown op") if isinstance(r, ast.Name) else "a constant"
                               for r in results]
    return listing


def _produced_by(value: ast.expr, produced: dict[str, str], listing: Listing) -> str:
    if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name):
        return produced.get(value.value.id, "an unknown op")  # ``getitem = split[0]``
    if isinstance(value, ast.Call):
        op = _op_of(value.func)
        if op is not None:
            listing.ops.append(op)
            return str(op)
    return "an unknown op"


def _op_of(func: ast.expr) -> torch._ops.OpOverload | None:
    """``aten.op.overload`` or ``torch.ops.ns.op.overload`` as the OpOverload it names."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    parts.append(func.id)
    parts.reverse()
    if parts[0] == "aten" and len(parts) == 3:
        ns, op, overload = parts
    elif parts[:2] == ["torch", "ops"] and len(parts) == 5:
        ns, op, overload = parts[2:]
    else:
        return None
    found = getattr(getattr(getattr(torch.ops, ns), op), overload)
    return found if isinstance(found, torch._ops.OpOverload) else None


def reason_to_skip(example_inputs: list[Any], ctx: GraphContext,
                   gm: torch.fx.GraphModule | None) -> tuple[str | None, int]:
    """(why this graph cannot use CUDA graphs or None, the CUDA device index to use)."""
    tensors = [a for a in example_inputs if isinstance(a, torch.Tensor)]
    if any(t.layout != torch.strided for t in tensors):
        return "sparse (non-strided) tensor inputs", -1
    devices = {t.device for t in tensors}
    if any(d.type == "cpu" for d in devices):
        return "CPU inputs", -1
    if not devices:
        return "no tensor inputs (nothing says which GPU to use)", -1
    if len(devices) > 1:
        return f"inputs on several devices ({', '.join(sorted(map(str, devices)))})", -1
    device = next(iter(devices))
    if device.type != "cuda":
        return f"inputs on {device.type}", -1
    if not compat.supported():
        return f"this torch lacks {', '.join(compat.missing()) or 'CUDA'}", -1
    aliasing = _mutated_aliased_input(example_inputs, ctx)
    if aliasing is not None:
        return aliasing, -1
    if gm is not None:
        op = _uncapturable_op(gm)
        if op is not None:
            return op, -1
    return None, device.index if device.index is not None else torch.cuda.current_device()


def listing_reason(listing: Listing | None) -> str | None:
    """R7 for a module without a graph: the first op of its listing that cannot be captured."""
    for target in listing.ops if listing is not None else ():
        if _uncapturable(target):
            return f"op {target} cannot be captured in a CUDA graph"
    return None


def _mutated_aliased_input(example_inputs: list[Any], ctx: GraphContext) -> str | None:
    """A mutated input that shares memory with another input cannot be copied into its own slot."""
    static = set(ctx.static_input_indices)
    for i in ctx.mutated_input_indices:
        if i in static or i >= len(example_inputs) or not isinstance(example_inputs[i], torch.Tensor):
            continue
        try:
            mine = example_inputs[i].untyped_storage()
        except Exception:  # noqa: BLE001 - fake tensors without storages: nothing to compare
            continue
        for j, other in enumerate(example_inputs):
            if j != i and isinstance(other, torch.Tensor):
                try:
                    if other.untyped_storage()._cdata == mine._cdata:
                        return f"mutation of input {i}, which aliases input {j}"
                except Exception:  # noqa: BLE001
                    continue
    return None


def _uncapturable(target: torch._ops.OpOverload) -> bool:
    unsafe_tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    name = target._schema.name.split("::")[-1]
    return name in _UNCAPTURABLE or (unsafe_tag is not None and unsafe_tag in target.tags)


def _uncapturable_op(gm: torch.fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if _uncapturable(node.target):
            return f"op {node.target} cannot be captured in a CUDA graph"
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dim() > 0:
            return f"op {node.target} produces a CPU tensor"
    return None


def output_ops(gm: torch.fx.GraphModule | None) -> list[str]:
    """For each graph output, the aten op that produced it and the user's source line (for R1)."""
    if gm is None:
        return []
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
        result.append(f"{arg.target}{line}" if arg.op == "call_function" else f"input {arg.name}")
    return result
