"""Common subexpressions: one node for each value the graph computes twice.

Autocast casts a tensor to bf16 once per reader: a layer norm's output read by three projections
is cast three times, a softmax gradient read by two matrix products twice. The joint graph that
AOTAutograd hands a partitioner keeps every copy (torch's own partitioner runs a CSE before its
cut; ours must too), and each copy would become a kernel that reads the full-size input and writes
the full-size cast.

A node is merged into an earlier one that computes the same thing: the same target and the same
arguments (nodes compared after their own merge). Left alone:
- nodes that are not pure: random ops (they must draw twice), ops that write their arguments,
  allocations (``empty``: undefined contents, never the same value);
- values that leave the graph, or share storage with one that does (two outputs that are one
  tensor would alias where eager's are separate: a gradient accumulated into one would change
  the other);
- collectives, and values other than tensors (symbolic sizes: not worth it).
A node that writes its arguments (an input's ``copy_``) starts a new region: a read after it is
never merged into the same read before it.

``eliminate(graph)`` is a pass ``graph -> changed``: the graph is edited in place.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from cgtrees.aot import compat

aten = torch.ops.aten
_ALLOCATIONS = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                          aten.new_empty.default, aten.new_empty_strided.default})


class _Unhashable(Exception):
    """An argument with no value identity (a tensor constant, a callable): the node is left alone."""


def eliminate(graph: torch.fx.Graph) -> bool:
    """Merge every node into an earlier one that computes the same value; True where any was."""
    leaving = _storages_leaving(graph)
    seen: dict[tuple, torch.fx.Node] = {}
    merged, region = False, 0
    for node in list(graph.nodes):
        if _writes(node):
            region += 1
        if not _pure(node) or _storage(node) in leaving:
            continue
        try:
            key = (region, node.target, _key(node.args), _key(node.kwargs))
        except _Unhashable:
            continue
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            merged = True
    return merged


def _pure(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not _tensors(node.meta.get("val")):
        return False
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload) or node.target in _ALLOCATIONS:
        return False
    if node.target.namespace in ("_c10d_functional", "c10d", "c10d_functional"):
        return False
    return not node.target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in node.target.tags


def _writes(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target._schema.is_mutable)


def _tensors(val: Any) -> bool:
    if isinstance(val, (list, tuple)):
        return bool(val) and all(isinstance(v, torch.Tensor) for v in val)
    return isinstance(val, torch.Tensor)


def _key(value: Any) -> Any:
    """``value`` as a hashable key: nodes by identity (already merged), sequences as tuples."""
    if isinstance(value, torch.fx.Node):
        return ("node", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _key(v)) for k, v in sorted(value.items())))
    if isinstance(value, float):
        return ("float", value, str(value))  # 0.0 and -0.0 differ; nan is not equal to itself
    if isinstance(value, torch.Tensor) or callable(value) and not isinstance(value, torch.dtype):
        raise _Unhashable(value)
    try:
        hash(value)
    except TypeError as e:
        raise _Unhashable(value) from e
    return (type(value).__name__, value)


def _storage(node: torch.fx.Node) -> Any:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return compat.storage_id(val)
    except (NotImplementedError, RuntimeError):  # no storage to compare (a subclass, a sparse value)
        return None


def _storages_leaving(graph: torch.fx.Graph) -> set[Any]:
    out = graph.output_node()
    return {s for n in out.all_input_nodes if (s := _storage(n)) is not None}
