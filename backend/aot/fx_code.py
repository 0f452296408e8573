"""Aten graphs kept as their FX code: a graph that runs through aten in a level-1 function
(``AtenCode``, loaded back as a ``codegen.AtenModule`` by ``load``), and AOTAutograd's backward
graph (``aot.backward_graph``).

The code may use only torch's own globals (``fx_globals``): it is loaded back by ``exec`` with
exactly those, so a graph whose code needs any other (a Python function, a module attribute) is
not kept (Uncacheable).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.fx

from cgtrees.aot.compat import Uncacheable
from cgtrees.codegen import compat as codegen_compat
from cgtrees.codegen.module import AtenModule
from cgtrees.compiled import AtenGraph


def load(code: str, name: str, graph: AtenGraph) -> AtenModule:
    """An aten graph loaded back from its FX code (boxed: ``forward(self, args_list)`` clears the
    list and frees each input at its last use): a CompiledModule like a kernel module."""
    namespace = dict(fx_globals())
    exec(compile(code, f"<cgtrees cached graph {name}>", "exec"), namespace)  # noqa: S102 - our own entry
    return AtenModule.from_boxed(functools.partial(namespace["forward"], None), graph)


def fx_code(gm: torch.fx.GraphModule) -> str:
    """The graph's FX code, taking its inputs boxed."""
    if _reads_attributes(gm):
        raise Uncacheable("aten graph reads module attributes")
    boxed = codegen_compat.boxed_graph_module(gm)
    if boxed is None:
        raise Uncacheable("this torch has no boxed FX code generator")
    code = boxed.graph.python_code(root_module="self")
    check_globals(code.globals, "aten graph code")
    return code.src


def check_globals(used: dict[str, Any], what: str) -> None:
    """Uncacheable unless every global the code uses is one of ``fx_globals``, the same object."""
    allowed = fx_globals()
    for name, value in used.items():
        known = allowed.get(name, _MISSING)
        same = known is value or (isinstance(value, float) and isinstance(known, float)
                                  and (known == value or math.isnan(known) and math.isnan(value)))
        if not same:
            raise Uncacheable(f"{what} needs the global {name!r}")


def _reads_attributes(gm: torch.fx.GraphModule) -> bool:
    return any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes)


_MISSING = object()


def fx_globals() -> dict[str, Any]:
    import torch.fx._pytree as fx_pytree
    import torch.utils._pytree as pytree

    return {"torch": torch, "inf": math.inf, "nan": math.nan, "NoneType": type(None),
            "device": torch.device, "fx_pytree": fx_pytree, "pytree": pytree}
