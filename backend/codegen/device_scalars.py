"""CPU 0-d tensors among a CUDA graph's inputs, moved to the device (issue 45: a counter or a
position that a model keeps on the host, as transformers' static cache keeps ``cumulative_length``
until it is first used).

Such an input would make the graph mix devices, and mixed graphs run through aten. Where every
other tensor of the graph is on one CUDA device, and the scalar's every use is an op whose result
is on that device (an arithmetic op with CUDA tensors, a copy to the device), the scalar is the
same value on the device: its placeholder's value is rewritten to a CUDA 0-d tensor, the generated
``call`` moves the caller's tensor there first (``x.to(DEVICE)``: an 8-byte copy, or nothing when
it is on the device already), and the runtime copies it into a device slot of its own before each
replay, so the graph is captured. Not rewritten: a scalar that the graph returns, mutates, or reads
back on the host (``.item()``), or a graph with other CPU tensors.
"""

from __future__ import annotations

import torch
import torch.fx

MARK = "cgtrees_device_scalar"  # placeholder meta: the caller's CPU scalar, on the device in the graph


def moved(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """Rewrite the graph's CPU scalar inputs to device scalars where that keeps its meaning
    (module docstring); their input positions, or () where none is."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    scalars = [(i, n) for i, n in enumerate(placeholders) if _is_cpu_scalar(n.meta.get("val"))]
    if not scalars:
        return ()
    device = _one_cuda_device(gm, {n for _, n in scalars})
    if device is None or not all(_uses_on(n, device) for _, n in scalars):
        return ()
    for _, node in scalars:
        node.meta["val"] = node.meta["val"].to(device)
        node.meta[MARK] = True
    return tuple(i for i, _ in scalars)


def _is_cpu_scalar(val: object) -> bool:
    return isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dim() == 0


def _tensors(val: object) -> list[torch.Tensor]:
    values = val if isinstance(val, (list, tuple)) else [val]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _one_cuda_device(gm: torch.fx.GraphModule, scalars: set[torch.fx.Node]) -> torch.device | None:
    """The one CUDA device of every tensor in the graph but ``scalars``, or None."""
    devices = {t.device for node in gm.graph.nodes if node not in scalars for t in _tensors(node.meta.get("val"))}
    if len(devices) != 1:
        return None
    device = next(iter(devices))
    return device if device.type == "cuda" else None


def _uses_on(node: torch.fx.Node, device: torch.device) -> bool:
    """Whether every use of ``node`` is an op whose results are all tensors on ``device``."""
    for user in node.users:
        results = user.meta.get("val")
        values = results if isinstance(results, (list, tuple)) else [results]
        if user.op != "call_function" or not values:
            return False
        if not all(isinstance(v, torch.Tensor) and v.device == device for v in values):
            return False
    return True
