"""codegen: lower one aten graph to a kernel module with ``call(args) -> outputs``.

Placeholder until the Triton codegen lands: the aten graph runs as it is.
"""

from __future__ import annotations

from typing import Any

import torch.fx

from backend.context import GraphContext


class AtenModule:
    """Runs the aten graph directly (CPU without the interpreter, or a graph codegen gave up on)."""

    source = None

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm

    def call(self, args: list[Any]) -> Any:
        outputs = self.gm(*args)
        args.clear()
        return outputs


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], ctx: GraphContext) -> AtenModule:
    return AtenModule(gm)
