"""Graph constants: tensors an aten graph reads through ``get_attr`` instead of taking as inputs.

AOTAutograd leaves tensors created inside the user's forward (``torch.tensor([])`` in a Hugging
Face KV cache, ``torch.tensor([1., 2.])``) and plain tensor attributes of a module in the aten
graph as attributes of its GraphModule, read by ``get_attr`` nodes. ``lift`` turns each into a
trailing graph input, so every later stage sees only inputs:

    placeholders: the inputs AOTAutograd hands us ... then one per constant, in graph order

- codegen and the cache key see an ordinary input (shape, strides, dtype); the constant's bytes
  go into the cache key (``cache.key.constants_text``: the same graph with other values is another
  entry), and level 1 keeps the bytes with its entry.
- ``Constants.append`` adds the tensors to every call's arguments. They are static inputs to the
  runtime: read in place, never copied into a CUDA graph, their address checked on replay.

Invariant: a lifted graph holds no ``get_attr`` of a tensor; its attributes are deleted, so a
stale copy cannot be read by mistake. ``Constants`` (what every stage is told) lives in
``cgtrees.context``: a level-1 hit or a loaded precompiled function makes it without AOTAutograd.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from cgtrees.context import Constants


def lift(gm: torch.fx.GraphModule) -> Constants:
    """Replace each tensor ``get_attr`` of ``gm`` by a trailing placeholder (in place)."""
    from cgtrees.aot import compat  # AOTAutograd: not imported where a loaded entry only appends constants

    # One placeholder per attribute: a graph may read one attribute through several get_attr nodes
    # (a backward AOTAutograd traced reads a forward constant once per use)
    readers: dict[str, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and isinstance(_attr(gm, n), torch.Tensor):
            readers.setdefault(str(n.target), []).append(n)
    if not readers:
        return Constants()
    placeholders = gm.graph.find_nodes(op="placeholder")
    fake_mode = compat.fake_mode_of(placeholders)
    names, tensors = [], []
    last = placeholders[-1] if placeholders else None
    for target, nodes in readers.items():
        value = _attr(gm, nodes[0])
        insert = gm.graph.inserting_after(last) if last is not None else gm.graph.inserting_before(
            next(iter(gm.graph.nodes)))
        with insert:
            placeholder = gm.graph.placeholder(f"const_{_safe(target)}")
        placeholder.meta["val"] = compat.fake_of(value, fake_mode)
        for node in nodes:
            node.replace_all_uses_with(placeholder)
            gm.graph.erase_node(node)
        _delete_attr(gm, target)
        names.append(target)
        tensors.append(value)
        last = placeholder
    gm.graph.lint()
    gm.recompile()
    return Constants(tuple(names), tuple(tensors))


def _attr(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Any:
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value


def _delete_attr(gm: torch.fx.GraphModule, target: str) -> None:
    *path, leaf = target.split(".")
    owner: Any = gm
    for part in path:
        owner = getattr(owner, part)
    if hasattr(owner, leaf):
        delattr(owner, leaf)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)
