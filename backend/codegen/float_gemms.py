"""A half-precision GEMM whose only reader casts it to float32 writes float32 itself, where timing
says so (issue 55, "Fuse across the matmul").

Under autocast, a weight gradient is a bf16 GEMM whose result is cast to the float32 weight's dtype,
through views::

    mm_8 = mm(permute_12, view_19)                    bf16, [out, in] or [in, out]
    permute_15 = permute(mm_8, [1, 0])                 (views: none or several)
    _to_copy_23 = _to_copy(permute_15, dtype=float32)  the gradient of a float32 weight: an output

cuBLAS can write the product in float32 from its float32 accumulator (``aten.mm.dtype``): the cast
is then not a kernel of its own that reads the bf16 result back and writes it again (Llama 1B's
training step at 4 x 1024 tokens, an H200: 113 weight gradients, their casts 81 kernels and 1.55 ms of
a 60 ms step; the float32 products cost cuBLAS about 0.8 ms more). The rewrite::

    mm_8 = mm.dtype(permute_12, view_19, float32)
    permute_15 = permute(mm_8, [1, 0])                 the cast's readers read this

The float32 result is the accumulator before the bf16 rounding that eager does and then widens
again: closer to the exact product than eager's, by at most that rounding. A cast that preserves
the layout keeps the strides of its input, so the views of the float32 product have the cast's.

``rewritten(gm, plan)`` times both forms on the device at compile time (the product and the cast as
eager ops, against the float32 product) and takes the float32 product where it is faster by more
than ``gemm_choice.MARGIN``; ``gemm_decisions=rewrite`` takes it on CUDA without timing, ``keep``
never. ``aten.mm.dtype`` has no CPU kernel: on a CPU (the interpreter included) the graph stays as
traced. Each choice is a line of the module's header. The graph handed in is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx

from cgtrees.codegen import fx_copy
from cgtrees.codegen.gemm_choice import MARGIN, layout_text, random_like, span_bytes
from cgtrees.codegen.gemm_padding import NotPadded, settle, traced_outputs

if TYPE_CHECKING:
    from cgtrees.codegen.gemm_choice import GemmPlan

aten, prims = torch.ops.aten, torch.ops.prims

TRACED, WIDE = "as traced", "float32 product"
HALVES = (torch.bfloat16, torch.float16)
VIEWS = frozenset({aten.t.default, aten.permute.default, aten.transpose.int, aten.view.default,
                   aten._unsafe_view.default, aten.reshape.default})


@dataclass(frozen=True)
class Cast:
    """A half-precision ``mm`` whose one reader, through ``views``, is a cast to float32."""

    mm: str
    views: tuple[str, ...]
    cast: str


def rewritten(gm: torch.fx.GraphModule, plan: "GemmPlan") -> torch.fx.GraphModule:
    """``gm``, or a copy of it where some GEMMs write float32 themselves; each choice one note."""
    casts = [c for node in gm.graph.find_nodes(op="call_function", target=aten.mm.default)
             if (c := cast_of(node)) is not None]
    if not casts:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    taken = {c.mm: _choose(nodes[c.mm], plan) for c in casts}
    chosen = [c for c in casts if taken[c.mm][0] == WIDE]
    out, why = _rewritten(gm, chosen) if chosen else (gm, "")
    for c in casts:
        how, timings, reason = taken[c.mm]
        if how == WIDE and out is gm:
            how, reason = TRACED, f"not rewritten: {why}"
        plan.note(c.mm, _describe(nodes[c.mm]) + " cast to float32", how, timings, reason)
    return out


def cast_of(mm: torch.fx.Node) -> Cast | None:
    """The cast to float32 that is ``mm``'s one reader through views and leaves the graph (a kernel
    of its own), where ``mm`` is a static 2-d product in bf16 or float16; None otherwise. A cast that
    a kernel reads is not one: that kernel converts the bf16 values it loads, and a float32 product
    would double what it reads (Llama 1B's activation gradients: 1.3 ms a step more in cuBLAS,
    H200, bd4740a)."""
    val = mm.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in HALVES or val.dim() != 2:
        return None
    if not all(isinstance(s, int) for s in val.shape):
        return None
    node, views = mm, []
    while len(node.users) == 1:
        (user,) = node.users
        if user.target in VIEWS and user.args[0] is node:
            node = user
            views.append(user.name)
        elif _widens(user, node) and all(u.op == "output" for u in user.users):
            return Cast(mm.name, tuple(views), user.name)
        else:
            return None
    return None


def _widens(user: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Whether ``user`` casts ``source`` to float32, keeping its layout and device."""
    if user.target is prims.convert_element_type.default:
        return user.args[0] is source and user.args[1:] == (torch.float32,) and not user.kwargs
    if user.target is not aten._to_copy.default or user.args != (source,):
        return False
    kw = dict(user.kwargs)
    if kw.pop("dtype", None) is not torch.float32 or kw.pop("layout", torch.strided) is not torch.strided:
        return False
    if kw.pop("memory_format", torch.preserve_format) is not torch.preserve_format or kw.pop("non_blocking", False):
        return False
    device = kw.pop("device", None)
    return not kw and (device is None or torch.device(device) == source.meta["val"].device)


# -------------------------------------------------------------------------------------------- choice
def _choose(mm: torch.fx.Node, plan: "GemmPlan") -> tuple[str, tuple[tuple[str, float], ...], str]:
    how, why = plan.other_choice()
    if plan.device.type != "cuda":
        return TRACED, (), "aten.mm.dtype runs on CUDA only"
    if how != "time":
        return (WIDE if how == "rewrite" else TRACED), (), why
    a, b = (x.meta["val"] for x in mm.args[:2])
    try:
        timings = plan.time_forms({TRACED: _traced_form(a, b, plan.device), WIDE: _wide_form(a, b, plan.device)})
    except RuntimeError as exc:  # a float32 product cuBLAS does not run for these operands: keep the cast
        return TRACED, (), f"float32 product failed: {str(exc).splitlines()[0][:100]}"
    if timings is None:
        return TRACED, (), "too large to time"
    taken = WIDE if timings[WIDE] < timings[TRACED] * (1 - MARGIN) else TRACED
    return taken, tuple(timings.items()), "timed"


def _describe(mm: torch.fx.Node) -> str:
    a, b = (x.meta["val"] for x in mm.args[:2])
    return f"mm {list(a.shape)} x {list(b.shape)} {a.dtype}"


def _traced_form(a: torch.Tensor, b: torch.Tensor, device: torch.device
                 ) -> tuple[str, Callable[[], Callable[[], None]], int]:
    """The product in ``a``'s dtype, then a copy of it to float32 (the cast keeps the layout: a
    copy in memory order)."""
    m, n = int(a.shape[0]), int(b.shape[1])
    key = f"mm then cast {layout_text(a)} x {layout_text(b)} {a.dtype} {device}"

    def build() -> Callable[[], None]:
        ta, tb = random_like(a, device), random_like(b, device)
        c = torch.empty(m, n, dtype=a.dtype, device=device)
        wide = torch.empty(m, n, dtype=torch.float32, device=device)

        def run() -> None:
            torch.mm(ta, tb, out=c)
            wide.copy_(c)
        return run

    return key, build, span_bytes(a, b) + m * n * (a.element_size() + 4)


def _wide_form(a: torch.Tensor, b: torch.Tensor, device: torch.device
               ) -> tuple[str, Callable[[], Callable[[], None]], int]:
    m, n = int(a.shape[0]), int(b.shape[1])
    key = f"mm to float32 {layout_text(a)} x {layout_text(b)} {a.dtype} {device}"

    def build() -> Callable[[], None]:
        ta, tb = random_like(a, device), random_like(b, device)
        wide = torch.empty(m, n, dtype=torch.float32, device=device)
        return lambda: aten.mm.dtype_out(ta, tb, torch.float32, out=wide)

    return key, build, span_bytes(a, b) + m * n * 4


# ------------------------------------------------------------------------------------------- rewrite
def _rewritten(gm: torch.fx.GraphModule, casts: list[Cast]) -> tuple[torch.fx.GraphModule, str]:
    """A copy of ``gm`` with each of ``casts`` a float32 product; ``gm`` and why, where a graph output's
    layout could not be kept."""
    graph, copied = fx_copy.copied(gm)
    traced = traced_outputs(graph)
    for c in casts:
        mm, cast = copied[c.mm], copied[c.cast]
        mm.target, mm.args = aten.mm.dtype, (*mm.args[:2], torch.float32)
        cast.replace_all_uses_with(copied[c.views[-1]] if c.views else mm)
        graph.erase_node(cast)
    out = torch.fx.GraphModule(gm, graph)
    try:
        settle(out, traced)
        return out, ""
    except (NotPadded, RuntimeError, ValueError) as exc:
        return gm, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
