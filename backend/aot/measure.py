"""Bytes a partition saves for backward: how partitioners are compared (tests, the demo)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx

from cgtrees.aot import compat
from cgtrees.aot.cost import saved_bytes


def saved_activation_bytes(fw: torch.fx.GraphModule, num_fwd_outputs: int,
                           static_indices: list[int]) -> int:
    """Bytes of the tensors the forward returns for the backward, not counting parameters and
    buffers (they are alive anyway)."""
    placeholders = list(fw.graph.find_nodes(op="placeholder"))
    static = {placeholders[i] for i in static_indices if i < len(placeholders)}
    output = next(iter(fw.graph.find_nodes(op="output")))
    saved = [a for a in output.args[0][num_fwd_outputs:] if isinstance(a, torch.fx.Node)]
    return sum(saved_bytes(n) or 0 for n in set(saved) if n not in static and not compat.is_sym_node(n))


def measure(model: torch.nn.Module, inputs: tuple[Any, ...], partition_fn: Callable) -> int:
    """Trace ``model`` through AOTAutograd with ``partition_fn`` and return its saved bytes."""
    seen: list[int] = []

    def spy(joint, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **kw):
        fw, bw = partition_fn(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                              static_lifetime_input_indices=static_lifetime_input_indices, **kw)
        seen.append(saved_activation_bytes(fw, num_fwd_outputs, static_lifetime_input_indices or []))
        return fw, bw

    torch._dynamo.reset()
    run_partitioned(model, inputs, spy)
    torch._dynamo.reset()
    return sum(seen)


def run_partitioned(model: torch.nn.Module, inputs: tuple[Any, ...], partition_fn: Callable) -> None:
    """One forward and backward of ``model`` through AOTAutograd, partitioned by ``partition_fn``
    (AOTAutograd's protocol), its graphs run as traced: what a partitioner does, without codegen."""
    from cgtrees.aot.decompositions import decomposition_table

    def nop(gm, _):
        return compat.make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return compat.aot_module_simplified(gm, example_inputs, fw_compiler=nop, bw_compiler=nop,
                                            partition_fn=partition_fn, decompositions=decomposition_table())

    torch.compile(model, backend=backend, fullgraph=True)(*inputs).sum().backward()
