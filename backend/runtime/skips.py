"""Reasons, known when a graph is wrapped, why it must run without CUDA graphs (R7).

Invariants: each check looks only at the example inputs and the module's ``GraphFacts`` (found in
the aten graph at compile time and kept in cache entries, so every path has them); the first
reason found is the one reported. Reasons found later, at run time (a capture that fails, too
many shapes, a static input that keeps moving), live in ``function.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from backend.codegen.module import GraphFacts
from backend.context import GraphContext
from backend.runtime import compat

CPU_INPUTS = "CPU inputs"


def reason_to_skip(example_inputs: list[Any], ctx: GraphContext, facts: GraphFacts) -> tuple[str | None, int]:
    """(why this graph cannot use CUDA graphs or None, the CUDA device index to use)."""
    tensors = [a for a in example_inputs if isinstance(a, torch.Tensor)]
    if any(t.layout != torch.strided for t in tensors):
        return "sparse (non-strided) tensor inputs", -1
    devices = {t.device for t in tensors}
    if any(d.type == "cpu" for d in devices):
        return CPU_INPUTS, -1
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
    if facts.uncapturable is not None:
        return facts.uncapturable, -1
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
