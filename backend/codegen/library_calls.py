"""The library calls of a generated module's ``call`` (cuBLAS, cuDNN, attention), found when it is
generated, for a warm load to make beforehand (``runtime.first_calls``).

Each is JSON text: the op, the device, and each argument as its call passes it, a tensor as
``{"tensor": [size, stride, offset, dtype]}``. Only calls that are safe on uninitialised memory and
change no state are kept: matmuls, convolutions and attention without dropout (a random op, or
dropout, would advance the generator), floating-point tensor arguments only (an index tensor of
garbage could read out of bounds), static sizes, at most ``MAX_BYTES`` of arguments per call.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

import sympy
import torch

from cgtrees.codegen import ir
from cgtrees.runtime.first_calls import CONVOLUTIONS, numel, op

MAX_BYTES = 256 << 20  # a call's tensor arguments; larger calls are left to the first real call
_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", *CONVOLUTIONS,
        "aten._scaled_dot_product_flash_attention.", "aten._scaled_dot_product_efficient_attention.",
        "aten._scaled_dot_product_cudnn_attention.", "aten.scaled_dot_product_attention.")


class _Skip(Exception):
    """An argument a warm-up call cannot stand in for (a symbolic size, an unknown buffer)."""


def specs(program: ir.Program) -> tuple[str, ...]:
    """The library calls of ``program`` that a warm load may make beforehand, each as JSON text."""
    known = _buffers(program)
    out = []
    for step in program.steps:
        if not isinstance(step, ir.Extern) or not step.target.startswith(_OPS):
            continue
        try:
            spec = {"op": step.target, "device": program.device,
                    "args": [_encode(a, known) for a in step.args],
                    "kwargs": {k: _encode(v, known) for k, v in step.kwargs}}
            if _safe(spec):
                out.append(json.dumps(spec, separators=(",", ":")))
        except (_Skip, AttributeError, ValueError):  # AttributeError: an op this torch lacks
            continue
    return tuple(dict.fromkeys(out))  # a configuration once


def _buffers(program: ir.Program) -> dict[str, tuple[ir.Layout, torch.dtype]]:
    known = {i.name: (i.layout, i.dtype) for i in program.inputs if i.kind == "tensor" and i.dtype is not None}
    for step in program.steps:
        if isinstance(step, ir.Compute):
            known[step.name] = (step.layout, step.dtype)
        elif isinstance(step, ir.Extern) and step.layout is not None and step.dtype is not None:
            known[step.name] = (step.layout, step.dtype)
        elif isinstance(step, ir.Alias) and step.item is None and step.base in known:
            known[step.name] = (step.layout, known[step.base][1])
    return known


def _encode(value: Any, known: dict[str, tuple[ir.Layout, torch.dtype]]) -> Any:
    if isinstance(value, ir.BufRef):
        if value.name not in known:
            raise _Skip(value.name)
        layout, dtype = known[value.name]
        return {"tensor": [[_int(n) for n in layout.size], [_int(s) for s in layout.stride],
                           _int(layout.offset), str(dtype).removeprefix("torch.")]}
    if isinstance(value, (list, tuple)):
        return [_encode(v, known) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, sympy.Basic):
        return _int(value)
    raise _Skip(type(value).__name__)


def _int(value: Any) -> int:
    value = sympy.sympify(value)
    if not value.is_Integer:
        raise _Skip(str(value))
    return int(value)


def _safe(spec: dict[str, Any]) -> bool:
    tensors = list(_tensors([spec["args"], list(spec["kwargs"].values())]))
    if not tensors or any(not getattr(torch, t[3]).is_floating_point for t in tensors):
        return False
    if sum(numel(t) * getattr(torch, t[3]).itemsize for t in tensors) > MAX_BYTES:
        return False
    names = [a.name for a in op(spec["op"])._schema.arguments]
    if "dropout_p" in names:
        i = names.index("dropout_p")
        p = spec["args"][i] if i < len(spec["args"]) else spec["kwargs"].get("dropout_p", 0.0)
        return p == 0
    return True


def _tensors(value: Any) -> Iterable[list]:
    if isinstance(value, dict) and "tensor" in value:
        yield value["tensor"]
    elif isinstance(value, list):
        for v in value:
            yield from _tensors(v)
