"""Our partitioner: which forward values the backward gets saved, and which it recomputes.

A min cut over the forward part of the joint graph. Each forward value is a pair of vertices
(in -> out) whose edge costs the bytes it would keep alive; values the backward needs connect to
the sink; values the backward may not recompute (inputs, matrix products, convolutions, random
ops, reductions other than row reductions such as batch norm's statistics: see cost.py) connect to
the source. The cheapest cut is the set of values to save; everything between the
cut and the backward is recomputed there. Parameters cost (almost) nothing to save: they are alive
anyway. A value the cut would recompute that the backward reads in more than one kernel is
written there; where the forward writes it anyway (a residual stream), it is pinned (saved or
recomputed from what is saved after it, never recomputed before it) and the cut is taken again.
Before the cut, ``layout.optimize`` may rewrite the joint graph channels-last (``layout_opt``),
and ``cse.eliminate`` merges values computed twice.

``partition`` is callable with AOTAutograd's ``partition_fn`` protocol; ``split`` returns the same
two graphs with what their compilers need to know of the cut (``Split``), which the driver hands
them itself (nothing rides in the graphs' ``meta``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch.fx

from cgtrees.aot import compat, cse, layout, order
from cgtrees.aot.cost import is_recomputable, is_view, reads_from_memory, saved_bytes, splits_kernels

_SOURCE, _SINK = "__source__", "__sink__"
_MAX_CUTS = 4  # cuts tried, each pinning what the one before would have recomputed across kernels


@dataclass(frozen=True)
class Split:
    """The two graphs of a cut, and what their compilers need to know of it."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    saved_from: int  # the forward's outputs from here on are saved for the backward
    static_saved: tuple[str, ...]  # the backward's inputs (placeholder names) that are static


def partition(joint_module: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any,
              ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """AOTAutograd's ``partition_fn``: the forward and backward graphs of ``split``."""
    cut = split(joint_module, joint_inputs, **kwargs)
    return cut.forward, cut.backward


def split(joint_module: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
          static_lifetime_input_indices: list[int] | None = None, layout_opt: str = "auto", **_: Any) -> Split:
    # 0. Channels-last convolutions, decided on the joint graph so both halves agree (layout.py);
    #    then one node per value computed twice (autocast's casts, one per reader: cse.py).
    layout.optimize(joint_module, layout_opt, inference=False)
    if cse.eliminate(joint_module.graph):
        joint_module.recompile()
    graph = joint_module.graph
    # 1. Which nodes belong to the backward (they depend on a tangent) and which the backward reads.
    backward = _tangent_dependent(graph)
    needed = _needed_by_backward(graph, backward, num_fwd_outputs)
    # 2. The primals whose lifetime is static (parameters, buffers): saving them costs nothing.
    primals = [n for n in graph.nodes if compat.is_primal(n)]
    static = {primals[i] for i in (static_lifetime_input_indices or []) if i < len(primals)}
    # 3. The min cut decides the saved set; a value it would have the backward recompute and write
    #    there (read across its kernels) is saved instead where the forward writes it anyway.
    written = _written_anyway(graph, backward, num_fwd_outputs)
    pinned: set[torch.fx.Node] = set()
    for _ in range(_MAX_CUTS):
        saved = _min_cut(graph, backward, needed, static, written, pinned)
        spread = _written_below(_spread_in_backward(graph, backward, set(saved)), written, set(saved)) - pinned
        if not spread:
            break
        pinned |= spread
    # 4. Torch's helper builds the two modules in the order AOTAutograd's runtime expects.
    saved_values = [n for n in saved if not compat.is_sym_node(n)]
    saved_syms = [n for n in saved if compat.is_sym_node(n)]
    fw, bw = compat.extract_fwd_bwd_modules(joint_module, saved_values, saved_syms,
                                            num_fwd_outputs=num_fwd_outputs, static_nodes=static or None)
    order.place(fw, bw, num_fwd_outputs)  # what crossed the cut, where it fuses (order.py)
    # 5. After the user's outputs, what the backward reads; which of those are static.
    return Split(fw, bw, num_fwd_outputs, tuple(n.name for n in saved_values if n in static))


def _tangent_dependent(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The backward's nodes. Not the output node: its forward outputs are no backward's input."""
    out: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output":
            continue
        if compat.is_tangent(node) or any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _needed_by_backward(graph: torch.fx.Graph, backward: set[torch.fx.Node],
                        num_fwd_outputs: int) -> set[torch.fx.Node]:
    """Forward values read by backward nodes, or returned as gradients directly."""
    output = next(iter(graph.find_nodes(op="output")))
    grads = [a for a in torch.fx.node.map_arg(output.args[0], lambda n: n)[num_fwd_outputs:]
             if isinstance(a, torch.fx.Node)]
    needed = {g for g in grads if g not in backward}
    for node in backward:
        needed.update(a for a in node.all_input_nodes if a not in backward)
    return needed


def _written_anyway(graph: torch.fx.Graph, backward: set[torch.fx.Node], num_fwd_outputs: int) -> set[torch.fx.Node]:
    """Forward values that exist in memory whether saved or not: inputs, what library calls
    return or read (cost.reads_from_memory), the forward's outputs, values read on both sides of
    a library call (a residual stream: a kernel boundary lies between its readers), and views of
    these. Saving one of them costs memory only; saving another costs a write in the forward too.
    Readers that only the backward needs do not count: they run in the forward only where the cut
    saves them, and then beside their inputs (``order.hoist``)."""
    output = next(iter(graph.find_nodes(op="output")))
    out = {a for a in output.args[0][:num_fwd_outputs] if isinstance(a, torch.fx.Node)}
    runs = order.ancestors(out)  # what the forward computes for its own outputs
    calls = 0  # library calls so far, in program order
    segment: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        if node in backward or node.op == "output":
            continue
        segment[node] = calls  # a node that splits kernels reads its inputs before the boundary it makes
        if node.op == "placeholder" or not is_recomputable(node):
            out.add(node)
            calls += splits_kernels(node)
        out.update(reads_from_memory(node))
    for node, at in segment.items():
        if any(segment.get(user, at) > at for user in node.users if user in runs):
            out.add(node)
    for node in graph.nodes:
        if is_view(node) and node.all_input_nodes and node.all_input_nodes[0] in out:
            out.add(node)
    return out


def _spread_in_backward(graph: torch.fx.Graph, backward: set[torch.fx.Node],
                        saved: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Forward values that the backward would recompute (not saved) and read in more than one of
    its kernels (library calls between the readers): codegen writes such a value where it is
    first computed and reads it back later. A residual stream recomputed from its per-layer
    increments is one: the last layer's backward needs the whole sum first, so its first kernel
    writes every layer's partial sum, which the forward had written already."""
    segment: dict[torch.fx.Node, int] = {}
    calls = 0
    for node in graph.nodes:
        if node in backward:
            segment[node] = calls
            calls += splits_kernels(node)
    recomputed: dict[torch.fx.Node, set[int]] = {}  # value -> the backward kernels (segments) that read it
    for node in reversed(graph.nodes):
        if node in backward or node in saved or node.op in ("placeholder", "output"):
            continue
        reads = {segment[u] for u in node.users if u in segment}
        reads |= {min(recomputed[u]) for u in node.users if recomputed.get(u)}
        if reads:
            recomputed[node] = reads
    return {n for n, reads in recomputed.items() if len(reads) > 1 and not is_view(n)}


def _written_below(spread: set[torch.fx.Node], written: set[torch.fx.Node],
                   saved: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The values written anyway nearest above each of ``spread`` on its recompute: itself where
    it is one (a pre-norm residual stream), else those it is recomputed from (a post-norm
    network's normalized value is recomputed from the norm's output of the layer below)."""
    out: set[torch.fx.Node] = set()
    todo, seen = list(spread), set(spread)
    while todo:
        node = todo.pop()
        if node in written:
            out.add(node)
            continue
        for value in node.all_input_nodes:
            if value not in seen and value not in saved and value.op != "placeholder":
                seen.add(value)
                todo.append(value)
    return out


def _min_cut(graph: torch.fx.Graph, backward: set[torch.fx.Node], needed: set[torch.fx.Node],
             static: set[torch.fx.Node], written: set[torch.fx.Node],
             pinned: set[torch.fx.Node] = frozenset()) -> list[torch.fx.Node]:
    if not needed:
        return []
    net = nx.DiGraph()
    forward = [n for n in graph.nodes if n not in backward and n.op != "output"]
    # What a backward library call reads is saved, not recomputed (cost.reads_from_memory).
    materialized = {v for n in backward for v in reads_from_memory(n) if v not in backward and not is_view(v)}
    for node in forward:
        size = saved_bytes(node)
        if size is None:
            net.add_edge(("in", node), ("out", node))  # no capacity: infinite, cannot be saved
        else:
            # Static inputs cost ~nothing; a tiny epsilon per value prefers fewer saved values; a
            # value the forward would not write otherwise costs a quarter more (a tie, such as
            # GELU's input against its derivative, goes to what a library call wrote already).
            cost = 4 * size if node in written else 5 * size
            net.add_edge(("in", node), ("out", node), capacity=1 if node in static else cost + 1)
        if node.op == "placeholder" or not is_recomputable(node) or node in materialized or node in pinned:
            net.add_edge(_SOURCE, ("in", node))
        if node in needed:
            net.add_edge(("out", node), _SINK)
        for user in node.users:
            if user not in backward and user.op != "output":
                net.add_edge(("out", node), ("in", user))
    _, (reachable, _) = nx.minimum_cut(net, _SOURCE, _SINK)
    return [n for n in forward if ("in", n) in reachable and ("out", n) not in reachable]
