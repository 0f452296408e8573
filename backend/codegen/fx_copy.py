"""A rewrite's working copy of an aten graph: the passes before lowering rewrite a copy and leave the
graph they were handed as it is (the driver may keep it, for a fallback or a later compile)."""

from __future__ import annotations

import torch.fx


def copied(gm: torch.fx.GraphModule) -> tuple[torch.fx.Graph, dict[str, torch.fx.Node]]:
    """A copy of ``gm``'s graph (the nodes' meta shared), and its nodes by their names in ``gm``."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    return graph, {old.name: new for old, new in env.items()}
