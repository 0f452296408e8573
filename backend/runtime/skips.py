"""Reasons, known when a graph is wrapped, why it must run without CUDA graphs (R7).

Invariants: each check looks only at the example inputs and the aten graph (when the kernel module
exposes it); the first reason found is the one reported. Reasons found later, at run time (a
capture that fails, too many shapes, a static input that keeps moving), live in ``function.py``.
"""

from __future__ import annotations

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


def _uncapturable_op(gm: torch.fx.GraphModule) -> str | None:
    unsafe_tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = node.target._schema.name.split("::")[-1]
        if name in _UNCAPTURABLE or (unsafe_tag is not None and unsafe_tag in node.target.tags):
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
