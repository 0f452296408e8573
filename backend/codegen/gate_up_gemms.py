"""A Llama MLP's ``silu(x @ w_gate.t()) * (x @ w_up.t())`` as one ``cgtrees.mm_silu_mul`` launch, where
timing says so (issue 55, "Fuse across the matmul").

In a decode step the gate and up projections read one input of a few rows, and their products are
read only by the SiLU-and-multiply that feeds the down projection. Unfused, that is cuBLAS twice (or
one ``grouped_mm``, ``shared_input_gemms``) and a pointwise kernel that reads both products back;
fused (``gemv_silu_mul``), one launch that applies the SiLU-and-multiply to its sums before its store.

``rewritten(gm, plan, kind)`` finds, in an inference graph, each ``mul`` of a SiLU of one GEMM's
product and another GEMM's product, both of one input and qualifying as ``shared_input_gemms`` says
(static sizes, at most ``MAX_ROWS`` rows, weights that are graph inputs stored [N, K]), where the
chain between them has no other reader. The SiLU is eager's: ``silu``, or ``g * sigmoid(g)`` in
float32, of a float32 product or of a 16-bit one cast to float32 and back (the decomposed ``silu``
of a bf16 model); the fused kernel rounds where that chain rounds. Each match is timed on the device
both ways, as ``gemm_choice`` times a GEMM's forms: unfused (cuBLAS, and ``grouped_mm`` with each of
its block sizes, then the pointwise kernel) against fused with each of a few block sizes. The fused
form is taken where it beats the best unfused one by more than ``gemm_choice.MARGIN``;
``gemm_decisions=rewrite`` always takes it with its first block sizes (tests), ``keep`` never, and
where nothing can be timed the graph stays as traced. Each choice is a line of the module's header.
Training graphs are left as they are (the op has no backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx

from cgtrees.codegen import fx_copy
from cgtrees.codegen.gemm_choice import MARGIN
from cgtrees.codegen.shared_input_gemms import config_text, configs, operand_bytes, operands, qualifies, weight

if TYPE_CHECKING:
    from cgtrees.codegen.gemm_choice import GemmPlan

aten = torch.ops.aten

# (BLOCK_N, BLOCK_K, warps): one row (two [BLOCK_N, BLOCK_K] float32 tiles a program), a few rows
# without tl.dot (float32), with it
_ONE_ROW_CONFIGS = ((1, 2048, 4), (2, 1024, 4), (1, 1024, 4), (1, 2048, 8), (2, 2048, 8))
_ROW_CONFIGS = ((4, 512, 2), (8, 512, 2), (16, 512, 2))
_DOT_CONFIGS = ((16, 256, 2), (32, 256, 4), (64, 128, 4))
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


@dataclass(frozen=True)
class GateUp:
    """One match: ``out`` is ``silu(gate) * up``; ``chain`` the nodes between the GEMMs and ``out``."""

    gate: torch.fx.Node  # mm(x, w_gate.t())
    up: torch.fx.Node  # mm(x, w_up.t())
    out: torch.fx.Node
    chain: tuple[torch.fx.Node, ...]


def rewritten(gm: torch.fx.GraphModule, plan: "GemmPlan", kind: str) -> torch.fx.GraphModule:
    """``gm``, or a copy of it where the fused form was chosen for some gate/up pair."""
    if kind != "inference":
        return gm
    chosen = [(match, config) for match in _matches(gm.graph) if (config := _choose(match, plan)) is not None]
    if not chosen:
        return gm
    graph, copied = fx_copy.copied(gm)
    for match, config in chosen:
        _rewrite(graph, GateUp(*(copied[n.name] for n in (match.gate, match.up, match.out)),
                               tuple(copied[n.name] for n in match.chain)), config)
    graph.lint()
    return torch.fx.GraphModule(gm, graph)


# ------------------------------------------------------------------------------------------ finding
def _matches(graph: torch.fx.Graph) -> list[GateUp]:
    found = []
    for out in graph.find_nodes(op="call_function", target=aten.mul.Tensor):
        a, b = out.args
        for silu, up in ((a, b), (b, a)):
            match = _match(out, silu, up)
            if match is not None:
                found.append(match)
                break
    return found


def _match(out: torch.fx.Node, silu: object, up: object) -> GateUp | None:
    if not isinstance(silu, torch.fx.Node) or not isinstance(up, torch.fx.Node):
        return None
    gate_side, up_side = _silu_of(silu), _product(up)
    if gate_side is None or up_side is None:
        return None
    (gate, gate_chain), (up_mm, up_chain) = gate_side, up_side
    if gate is up_mm or not qualifies(gate) or not qualifies(up_mm) or gate.args[0] is not up_mm.args[0]:
        return None
    wg, wu = weight(gate).meta["val"], weight(up_mm).meta["val"]
    o = out.meta.get("val")
    if wg.shape != wu.shape or o is None or o.dtype != wg.dtype or not o.is_contiguous() or \
            {tuple(n.meta["val"].shape) for n in (silu, up)} != {tuple(o.shape)}:
        return None
    chain = (*gate_chain, *up_chain)
    inside = {*chain, out}
    if any(user not in inside for n in (gate, up_mm, *chain) for user in n.users):
        return None  # a value of the chain is read elsewhere: it must still be computed
    return GateUp(gate, up_mm, out, chain)


def _silu_of(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(the gate GEMM, the nodes from its product to ``node`` in graph order) where ``node`` is eager's
    SiLU of a GEMM's product, else None."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    chain = [node]
    if val.dtype != torch.float32 and _cast(node) is not None:  # silu in float32, rounded to 16 bits
        inner = _silu_input(node.args[0])
        if inner is None or _cast(inner[0]) != torch.float32 or inner[0].args[0].meta["val"].dtype != val.dtype:
            return None
        chain += [*inner[1], inner[0]]
        product = inner[0].args[0]
    else:  # silu of the product itself: aten.silu (which computes in float32), or g * sigmoid(g) in float32
        inner = _silu_input(node)
        if inner is None or (node.target is not aten.silu.default and val.dtype != torch.float32):
            return None
        chain += inner[1][1:]
        product = inner[0]
    gemm = _product(product)
    if gemm is None:
        return None
    return gemm[0], [*gemm[1], *reversed(chain)]


def _silu_input(node: object) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(g, the SiLU's nodes) where ``node`` is ``silu(g)`` or ``g * sigmoid(g)``."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.target is aten.silu.default:
        return node.args[0], [node]
    if node.target is aten.mul.Tensor:
        a, b = node.args
        for g, s in ((a, b), (b, a)):
            if isinstance(s, torch.fx.Node) and s.target is aten.sigmoid.default and s.args[0] is g:
                return g, [node, s]
    return None


def _cast(node: object) -> torch.dtype | None:
    """The dtype ``node`` casts to where it is a plain ``_to_copy`` (dtype only), else None."""
    if isinstance(node, torch.fx.Node) and node.target is aten._to_copy.default and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]
    return None


def _product(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(the GEMM, [the view of its product] or []) where ``node`` is a GEMM's product or a view of it."""
    if node.target in _VIEWS and isinstance(node.args[0], torch.fx.Node):
        inner = _product(node.args[0])
        return None if inner is None or inner[1] else (inner[0], [node])
    return (node, []) if node.target is aten.mm.default else None


def _text(match: GateUp) -> str:
    x = match.gate.args[0].meta["val"]
    n, k = weight(match.gate).meta["val"].shape
    return f"silu(mm) * mm [{x.shape[0]}, {k}] x gate, up [{n}, {k}] {str(x.dtype).removeprefix('torch.')}"


# ------------------------------------------------------------------------------------------ choosing
def _fused_configs(rows: int, dtype: torch.dtype) -> tuple[tuple[int, int, int], ...]:
    if rows == 1:
        return _ONE_ROW_CONFIGS
    return _DOT_CONFIGS if dtype != torch.float32 else _ROW_CONFIGS


def _fused_text(config: tuple[int, int, int]) -> str:
    return "mm_silu_mul {}x{}/{}".format(*config)


def _choose(match: GateUp, plan: "GemmPlan") -> tuple[int, int, int] | None:
    """The block sizes of the fused form where it is taken, else None."""
    names = f"{match.gate.name}/{match.up.name}/{match.out.name}"
    x, wg, wu = _metas(match)
    fused = _fused_configs(x.shape[0], x.dtype)
    how, why = plan.other_choice()
    if how != "time":
        plan.note(names, _text(match), _fused_text(fused[0]) if how == "rewrite" else "unfused", (), why)
        return fused[0] if how == "rewrite" else None
    forms = {"unfused as traced": _unfused_form(x, wg, wu, None, plan.device)}
    forms.update({f"unfused grouped_mm {config_text(c)}": _unfused_form(x, wg, wu, c, plan.device)
                  for c in configs(x.shape[0], x.dtype)})
    forms.update({_fused_text(c): _fused_form(x, wg, wu, c, plan.device) for c in fused})
    timings = plan.time_forms(forms)
    if timings is None:
        plan.note(names, _text(match), "unfused", (), "too large to time")
        return None
    unfused = min(t for name, t in timings.items() if name.startswith("unfused"))
    best = min((timings[_fused_text(c)], c) for c in fused)
    if best[0] < unfused * (1 - MARGIN):
        plan.note(names, _text(match), _fused_text(best[1]), tuple(timings.items()))
        return best[1]
    plan.note(names, _text(match), "unfused", tuple(timings.items()))
    return None


def _metas(match: GateUp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return match.gate.args[0].meta["val"], weight(match.gate).meta["val"], weight(match.up).meta["val"]


def _unfused_form(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, config: tuple[int, int, int, int] | None,
                  device: torch.device) -> tuple[str, Callable, int]:
    """Two products (cuBLAS where ``config`` is None, else one ``grouped_mm``), then the pointwise kernel."""

    def build() -> Callable[[], None]:
        from cgtrees.codegen import gemv_silu_mul, grouped_gemv

        tx, sets, outs = operands(x, [wg, wu], device)
        y = torch.empty_like(outs[0])
        turn = iter(range(1 << 62))

        def run() -> None:
            ws = sets[next(turn) % len(sets)]
            if config is None:
                for w, out in zip(ws, outs):
                    torch.mm(tx, w.t(), out=out)
            else:
                grouped_gemv.launch(tx, ws, outs, *config)
            gemv_silu_mul.launch_silu_mul(outs[0], outs[1], y)
        return run

    how = "mms" if config is None else f"grouped_mm {config}"
    return f"{how} + silu_mul {_shapes(x, wg)} {device} rotating", build, _bytes(x, wg, wu, device)


def _fused_form(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, config: tuple[int, int, int],
                device: torch.device) -> tuple[str, Callable, int]:
    def build() -> Callable[[], None]:
        from cgtrees.codegen import gemv_silu_mul

        tx, sets, outs = operands(x, [wg, wu], device)
        turn = iter(range(1 << 62))
        return lambda: gemv_silu_mul.launch(tx, *sets[next(turn) % len(sets)], outs[0], *config)

    return f"mm_silu_mul {_shapes(x, wg)} {config} {device} rotating", build, _bytes(x, wg, wu, device)


def _shapes(x: torch.Tensor, w: torch.Tensor) -> str:
    return f"{list(x.shape)} x 2 x {list(w.shape)} {x.dtype}"


def _bytes(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, device: torch.device) -> int:
    """What a form allocates: ``shared_input_gemms``'s operands and one more product."""
    return operand_bytes(x, [wg, wu], device) + x.shape[0] * wg.shape[0] * x.element_size()


# ------------------------------------------------------------------------------------------ rewriting
def _rewrite(graph: torch.fx.Graph, match: GateUp, config: tuple[int, int, int]) -> None:
    """One ``cgtrees.mm_silu_mul`` call (viewed to ``out``'s shape) before ``out``; ``out``'s readers read
    it, and ``out``, the chain, the GEMMs and their weights' transposes go."""
    from cgtrees.codegen import gemv_silu_mul  # noqa: F401 - registers the op (its kernels load lazily)

    x = match.gate.args[0]
    with graph.inserting_before(match.out):
        call = graph.call_function(torch.ops.cgtrees.mm_silu_mul.default,
                                   (x, weight(match.gate), weight(match.up), *config))
        call.meta["val"] = match.gate.meta["val"]  # a fresh contiguous [M, N] of x's dtype
        call.meta["stack_trace"] = match.out.meta.get("stack_trace")
        value = call
        if tuple(match.out.meta["val"].shape) != tuple(call.meta["val"].shape):
            value = graph.call_function(aten.view.default, (call, list(match.out.meta["val"].shape)))
            value.meta.update(match.out.meta)
    match.out.replace_all_uses_with(value)
    transposes = [match.gate.args[1], match.up.args[1]]
    for node in (match.out, *reversed(match.chain), match.gate, match.up, *transposes):
        if not node.users:
            graph.erase_node(node)
