"""Reasons, known when a graph is wrapped, why it must run without CUDA graphs (R7).

Invariants: each check looks only at the example inputs (``Examples``) and the module's ``GraphFacts`` (found in
the aten graph at compile time and kept in cache entries, so every path has them); the first
reason found is the one reported. Reasons found later, at run time (a capture that fails, too
many shapes, a static input that keeps moving), live in ``function.py``.
"""

from __future__ import annotations

import torch

from cgtrees.compiled import GraphFacts
from cgtrees.context import GraphContext
from cgtrees.runtime import compat
from cgtrees.runtime.examples import Examples

CPU_INPUTS = "CPU inputs"


def reason_to_skip(examples: Examples, ctx: GraphContext, facts: GraphFacts,
                   device_scalars: tuple[int, ...] = ()) -> tuple[str | None, int]:
    """(why this graph cannot use CUDA graphs or None, the CUDA device index to use).
    ``device_scalars``: the CPU 0-d inputs the module moves to the device itself (the runtime
    copies them into device slots): not CPU inputs, where they are all the CPU tensors."""
    if not examples.strided:
        return "sparse (non-strided) tensor inputs", -1
    devices = examples.devices
    if device_scalars and examples.cpu_tensors == examples.cpu_scalars == len(device_scalars):
        devices = frozenset(d for d in devices if d.type != "cpu")
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
    if examples.aliased is not None:
        return "mutation of input {}, which aliases input {}".format(*examples.aliased), -1
    if facts.uncapturable is not None:
        return facts.uncapturable, -1
    return None, device.index if device.index is not None else torch.cuda.current_device()
