"""A residual add, the RMSNorm after it and the one-row GEMVs that read the norm as one launch, where
timing says so (issue 55, "Fuse across the matmul"): a Llama layer's q, k and v projections (one
``grouped_mm``) as ``cgtrees.add_rmsnorm_grouped_mm``, its MLP's gate and up projections with their
SiLU-and-multiply (one ``mm_silu_mul``) as ``cgtrees.add_rmsnorm_mm_silu_mul``, and the model's final
norm with the LM head (a ``grouped_mm`` of one weight) as ``add_rmsnorm_grouped_mm`` again.

Our codegen computes a residual add and the RMSNorm after it in one reduction kernel, which writes
the residual stream ``h`` and the norm ``n``; ``grouped_mm`` then reads ``n``. Fused
(``gemv_add_rmsnorm``), every program of the GEMV computes ``h`` and ``n`` of the row itself and
program 0 writes ``h``: a launch a layer fewer, a row re-read from the L2 cache by every program more.

``rewritten(gm, plan, kind)`` runs after ``shared_input_gemms`` and finds, in an inference graph,
each one-row ``grouped_mm`` (split over K or not: the fused form is not) or ``mm_silu_mul`` whose
input is (a view of) eager's RMSNorm of HF Llama::

    h32 = _to_copy(h, float32)                  # h itself in a float32 model
    n = mul(weight, _to_copy(mul(h32, rsqrt(add(mean(pow(h32, 2), [-1], True), eps))), dtype))

with the norm's weight a graph input of the row's size and dtype, and no reader of the chain
outside it. ``h`` is ``add(x, residual)`` of two rows of one dtype (fused; its other readers read the
op's last output) or any row (normed only). Each match is timed on the device both ways, as
``gemm_choice`` times a GEMM's forms: unfused (the add-and-norm kernel, then ``grouped_mm`` or
``mm_silu_mul`` with the block sizes ``shared_input_gemms`` or ``gate_up_gemms`` chose) against fused
with each of a few block sizes; the fused form is taken where it beats the unfused one by more than
``gemm_choice.MARGIN``.
``gemm_decisions=rewrite`` always takes it with its first block sizes (tests), ``keep`` never, and
where nothing can be timed the graph stays as it was. Each choice is a line of the module's header.
Training graphs are left as they are (the op has no backward).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx

from cgtrees.codegen import fx_copy
from cgtrees.codegen.gemm_choice import MARGIN, random_like, span_bytes
from cgtrees.codegen.shared_input_gemms import operand_bytes, operands

if TYPE_CHECKING:
    from cgtrees.codegen.gemm_choice import GemmPlan

aten = torch.ops.aten

MAX_HIDDEN = 8192  # gemv_add_rmsnorm.MAX_HIDDEN (not imported here: that module registers an op)
# (BLOCK_N, warps): the row is one block of K, so a program's tile is [BLOCK_N, next_pow2(K)]; every
# program computes the row's norm again, so larger blocks (16 warps: no spills at K 2048 on sm_90's
# compiler) do it fewer times
_CONFIGS = ((2, 4), (1, 4), (4, 4), (4, 8), (8, 8), (16, 16))
_SILU_CONFIGS = ((2, 8), (1, 4), (2, 4), (4, 8), (1, 8), (4, 16), (8, 16))  # two weight tiles a program
_GROUPED, _SILU_MUL = "cgtrees.grouped_mm.default", "cgtrees.mm_silu_mul.default"
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class NormedGemms:
    """One match: ``gemms`` (a ``grouped_mm`` or an ``mm_silu_mul``) reads ``rmsnorm(h) * weight``,
    ``chain`` the nodes from ``h`` (not included) to the GEMMs' input; ``h`` is ``x + residual`` where
    ``residual`` is set."""

    gemms: torch.fx.Node
    h: torch.fx.Node
    x: torch.fx.Node
    residual: torch.fx.Node | None
    weight: torch.fx.Node
    eps: float
    chain: tuple[torch.fx.Node, ...]


def rewritten(gm: torch.fx.GraphModule, plan: "GemmPlan", kind: str) -> torch.fx.GraphModule:
    """``gm``, or a copy of it where the fused form was chosen for some normed GEMMs."""
    if kind != "inference":
        return gm
    chosen = [(match, config) for match in _matches(gm.graph) if (config := _choose(match, plan)) is not None]
    if not chosen:
        return gm
    graph, copied = fx_copy.copied(gm)
    for match, config in chosen:  # a rewrite's h (the next match's x) is an item of its op from then on
        residual = copied[match.residual.name] if match.residual is not None else None
        copied[match.h.name] = _rewrite(graph, NormedGemms(
            copied[match.gemms.name], copied[match.h.name], copied[match.x.name], residual, copied[match.weight.name],
            match.eps, tuple(copied[n.name] for n in match.chain)), config)
    graph.lint()
    return torch.fx.GraphModule(gm, graph)


# ------------------------------------------------------------------------------------------ finding
def _matches(graph: torch.fx.Graph) -> list[NormedGemms]:
    found = []
    for gemms in graph.nodes:  # the ops are registered only where an earlier rewrite put them in a graph
        if gemms.op != "call_function" or str(gemms.target) not in (_GROUPED, _SILU_MUL):
            continue
        match = _match(gemms)
        if match is not None:
            found.append(match)
    return found


def _match(gemms: torch.fx.Node) -> NormedGemms | None:
    n = gemms.args[0]
    nv = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    if nv is None or nv.dim() != 2 or nv.shape[0] != 1 or nv.dtype not in _DTYPES:
        return None
    norm = _norm_of(n, nv.dtype)
    if norm is None:
        return None
    h, weight, eps, chain = norm
    hv = h.meta.get("val")
    if not isinstance(hv, torch.Tensor) or hv.numel() != nv.shape[1] or hv.dtype != nv.dtype or \
            not hv.is_contiguous() or nv.shape[1] > MAX_HIDDEN:
        return None
    inside = {*chain, gemms}
    if any(user not in inside for node in chain for user in node.users):
        return None  # a value of the chain is read elsewhere: it must still be computed
    x, residual = h, None
    if h.target is aten.add.Tensor and len(h.args) == 2 and not h.kwargs and \
            all(isinstance(a, torch.fx.Node) and _same_row(a.meta.get("val"), hv) for a in h.args):
        x, residual = h.args
    return NormedGemms(gemms, h, x, residual, weight, eps, tuple(chain))


def _silu_mul(gemms: torch.fx.Node) -> bool:
    return str(gemms.target) == _SILU_MUL


def _weights(gemms: torch.fx.Node) -> list[torch.fx.Node]:
    return list(gemms.args[1:3]) if _silu_mul(gemms) else list(gemms.args[1])


def _same_row(val: object, hv: torch.Tensor) -> bool:
    return isinstance(val, torch.Tensor) and tuple(val.shape) == tuple(hv.shape) and val.dtype == hv.dtype and \
        val.is_contiguous()


def _norm_of(n: torch.fx.Node, dtype: torch.dtype
             ) -> tuple[torch.fx.Node, torch.fx.Node, float, list[torch.fx.Node]] | None:
    """(h, the norm's weight, eps, the chain's nodes in graph order) where ``n`` is (a view of)
    ``weight * rmsnorm(h)`` as HF Llama computes it in ``dtype``, else None. The view may be of a
    slice that keeps everything, or of an alias (the LM head's input: the last token of a decode
    step's one, or all of them)."""
    chain = []
    while len(chain) < 3 and n.op == "call_function" and isinstance(n.args[0], torch.fx.Node) and \
            (n.target in _VIEWS or n.target is aten.alias.default or _whole_slice(n)):
        chain.append(n)
        n = n.args[0]
    if n.target is not aten.mul.Tensor or len(n.args) != 2 or not isinstance(n.meta.get("val"), torch.Tensor):
        return None
    for weight, normed in (n.args, reversed(n.args)):
        if _is_norm_weight(weight, n.meta["val"]) and isinstance(normed, torch.fx.Node):
            break
    else:
        return None
    chain.append(n)
    if dtype != torch.float32:  # the float32 product rounded to 16 bits
        if _cast(normed) != dtype:
            return None
        chain.append(normed)
        normed = normed.args[0]
    inner = _scaled(normed)
    if inner is None:
        return None
    h32, eps, nodes = inner
    chain += nodes
    h = h32
    if dtype != torch.float32:  # h cast to float32
        if _cast(h32) != torch.float32 or h32.args[0].meta["val"].dtype != dtype:
            return None
        chain.append(h32)
        h = h32.args[0]
    return h, weight, eps, list(reversed(chain))


def _whole_slice(node: torch.fx.Node) -> bool:
    """``node`` is a ``slice`` of step 1 whose result is all of its input."""
    if node.target is not aten.slice.Tensor or (len(node.args) > 4 and node.args[4] != 1):
        return False
    source, out = node.args[0].meta.get("val"), node.meta.get("val")
    return isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor) and \
        tuple(out.shape) == tuple(source.shape) and out.stride() == source.stride()


def _scaled(node: torch.fx.Node) -> tuple[torch.fx.Node, float, list[torch.fx.Node]] | None:
    """(h32, eps, the nodes) where ``node`` is ``h32 * rsqrt(mean(h32 ** 2, [-1], True) + eps)``, float32."""
    val = node.meta.get("val")
    if node.target is not aten.mul.Tensor or not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
        return None
    a, b = node.args
    h32, rsqrt = (b, a) if isinstance(a, torch.fx.Node) and a.target is aten.rsqrt.default else (a, b)
    if not isinstance(rsqrt, torch.fx.Node) or rsqrt.target is not aten.rsqrt.default:
        return None
    add = rsqrt.args[0]
    if not isinstance(add, torch.fx.Node) or add.target is not aten.add.Tensor or \
            not isinstance(add.args[1], float) or add.kwargs:
        return None
    mean = add.args[0]
    if not isinstance(mean, torch.fx.Node) or mean.target is not aten.mean.dim or \
            mean.kwargs.get("dtype") is not None or not _last_dim_kept(mean):
        return None
    square = mean.args[0]
    if not isinstance(square, torch.fx.Node) or square.target is not aten.pow.Tensor_Scalar or \
            square.args[0] is not h32 or square.args[1] != 2:
        return None
    return h32, add.args[1], [node, rsqrt, add, mean, square]


def _last_dim_kept(mean: torch.fx.Node) -> bool:
    dims, keepdim = mean.args[1], (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False))
    rank = mean.args[0].meta["val"].dim()
    return keepdim and isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] % rank == rank - 1


def _is_norm_weight(node: object, out: torch.Tensor) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and node.op == "placeholder" and val.dim() == 1 and \
        val.shape[0] == out.shape[-1] and val.dtype == out.dtype and val.stride() == (1,)


def _cast(node: object) -> torch.dtype | None:
    """The dtype ``node`` casts to where it is a plain ``_to_copy`` (dtype only), else None."""
    if isinstance(node, torch.fx.Node) and node.target is aten._to_copy.default and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]
    return None


def _text(match: NormedGemms) -> str:
    k = match.h.meta["val"].numel()
    ws = [w.meta["val"] for w in _weights(match.gemms)]
    what = "rmsnorm(add)" if match.residual is not None else "rmsnorm"
    dtype = str(match.h.meta["val"].dtype).removeprefix("torch.")
    if _silu_mul(match.gemms):
        return f"{what} [1, {k}] x silu(gate) * up [{ws[0].shape[0]}, {k}] {dtype}"
    ns = "|".join(str(w.shape[0]) for w in ws)
    return f"{what} [1, {k}] x {len(ws)} weights [{ns}, {k}] {dtype}"


# ------------------------------------------------------------------------------------------ choosing
def _configs(match: NormedGemms) -> tuple[tuple[int, int], ...]:
    return _SILU_CONFIGS if _silu_mul(match.gemms) else _CONFIGS


def _fused_text(match: NormedGemms, config: tuple[int, int]) -> str:
    op = "add_rmsnorm_mm_silu_mul" if _silu_mul(match.gemms) else "add_rmsnorm_grouped_mm"
    return "{} {}/{}".format(op, *config)


def _choose(match: NormedGemms, plan: "GemmPlan") -> tuple[int, int] | None:
    """The block sizes of the fused form where it is taken, else None."""
    names = f"{match.h.name}/{match.gemms.name}"
    configs = _configs(match)
    how, why = plan.other_choice()
    if how != "time":
        plan.note(names, _text(match), _fused_text(match, configs[0]) if how == "rewrite" else "unfused", (), why)
        return configs[0] if how == "rewrite" else None
    forms = {"unfused": _unfused_form(match, plan.device)}
    forms.update({_fused_text(match, c): _fused_form(match, c, plan.device) for c in configs})
    timings = plan.time_forms(forms)
    if timings is None:
        plan.note(names, _text(match), "unfused", (), "too large to time")
        return None
    best = min((timings[_fused_text(match, c)], c) for c in configs)
    if best[0] < timings["unfused"] * (1 - MARGIN):
        plan.note(names, _text(match), _fused_text(match, best[1]), tuple(timings.items()))
        return best[1]
    plan.note(names, _text(match), "unfused", tuple(timings.items()))
    return None


def _metas(match: NormedGemms) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    return match.h.meta["val"], match.weight.meta["val"], [w.meta["val"] for w in _weights(match.gemms)]


def _row(hv: torch.Tensor) -> torch.Tensor:
    """The GEMMs' input as ``shared_input_gemms.operands`` reads it: [1, K] of h's dtype, no data."""
    return torch.empty((1, hv.numel()), dtype=hv.dtype, device="meta")


def _row_operands(match: NormedGemms, device: torch.device):
    """Random rows x and residual (None where not added), the norm's weight, and h's buffer."""
    hv, nw, _ = _metas(match)
    x = random_like(hv, device)
    residual = random_like(hv, device) if match.residual is not None else None
    h = torch.empty_like(x) if residual is not None else None
    return x, residual, random_like(nw, device), h


def _unfused_form(match: NormedGemms, device: torch.device) -> tuple[str, Callable, int]:
    """The add-and-norm kernel, then ``grouped_mm`` or ``mm_silu_mul`` with the block sizes chosen before."""
    hv, nw, ws = _metas(match)
    silu_mul = _silu_mul(match.gemms)
    config = tuple(match.gemms.args[2 + silu_mul:])

    def build() -> Callable[[], None]:
        from cgtrees.codegen import gemv_add_rmsnorm, gemv_silu_mul, grouped_gemv

        x, residual, weight, h = _row_operands(match, device)
        _, sets, outs = operands(_row(hv), ws, device)
        n = torch.empty((1, hv.numel()), dtype=hv.dtype, device=device)
        turn = iter(range(1 << 62))

        def run() -> None:
            gemv_add_rmsnorm.launch_add_rmsnorm(x, residual, weight, match.eps, h, n)
            if silu_mul:
                gemv_silu_mul.launch(n, *sets[next(turn) % len(sets)], outs[0], *config)
            else:
                grouped_gemv.launch(n, sets[next(turn) % len(sets)], outs, *config)
        return run

    how = "mm_silu_mul" if silu_mul else "grouped_mm"
    return f"add_rmsnorm + {how} {config} {_shapes(match)} {device} rotating", build, _bytes(hv, nw, ws, device)


def _fused_form(match: NormedGemms, config: tuple[int, int], device: torch.device) -> tuple[str, Callable, int]:
    hv, nw, ws = _metas(match)

    def build() -> Callable[[], None]:
        from cgtrees.codegen import gemv_add_rmsnorm

        x, residual, weight, h = _row_operands(match, device)
        _, sets, outs = operands(_row(hv), ws, device)
        turn = iter(range(1 << 62))
        if _silu_mul(match.gemms):
            return lambda: gemv_add_rmsnorm.launch_silu_mul(x, residual, weight, match.eps,
                                                            *sets[next(turn) % len(sets)], outs[0], h, *config)
        return lambda: gemv_add_rmsnorm.launch(x, residual, weight, match.eps, sets[next(turn) % len(sets)], outs, h,
                                               *config)

    return f"{_fused_text(match, config)} {_shapes(match)} {device} rotating", build, _bytes(hv, nw, ws, device)


def _shapes(match: NormedGemms) -> str:
    """The timing key's shapes: a form with the add and one without are timed apart."""
    hv, _, ws = _metas(match)
    add = "added" if match.residual is not None else "not added"
    return f"[1, {hv.numel()}] {add} x {[list(w.shape) for w in ws]} {hv.dtype}"


def _bytes(hv: torch.Tensor, nw: torch.Tensor, ws: list[torch.Tensor], device: torch.device) -> int:
    """What a form allocates: ``shared_input_gemms``'s operands, and the rows and the norm's weight."""
    return operand_bytes(_row(hv), ws, device) + 4 * span_bytes(hv) + span_bytes(nw)


# ------------------------------------------------------------------------------------------ rewriting
def _rewrite(graph: torch.fx.Graph, match: NormedGemms, config: tuple[int, int]) -> torch.fx.Node:
    """One fused call right after ``h``; the GEMMs' readers read its products, ``h``'s other readers
    its last output, and the chain, the GEMMs' op and ``h`` go. Returns what stands for ``h`` now."""
    from cgtrees.codegen import gemv_add_rmsnorm  # noqa: F401 - registers the ops (their kernels load lazily)

    gemms, h = match.gemms, match.h
    silu_mul = _silu_mul(gemms)
    op = torch.ops.cgtrees.add_rmsnorm_mm_silu_mul if silu_mul else torch.ops.cgtrees.add_rmsnorm_grouped_mm
    weights = tuple(gemms.args[1:3]) if silu_mul else (gemms.args[1],)
    products = [gemms.meta["val"]] if silu_mul else list(gemms.meta["val"])
    with graph.inserting_after(h):
        call = graph.call_function(op.default, (match.x, match.residual, match.weight, match.eps, *weights, *config))
        call.meta["val"] = [*products, *([h.meta["val"]] if match.residual is not None else [])]
        call.meta["stack_trace"] = gemms.meta.get("stack_trace")
    value = call
    if silu_mul:  # mm_silu_mul's readers read a tensor, the fused op's first item
        with graph.inserting_after(call):
            value = graph.call_function(operator.getitem, (call, 0))
            value.meta.update(gemms.meta)
    gemms.replace_all_uses_with(value)
    for node in (gemms, *reversed(match.chain)):
        graph.erase_node(node)
    if match.residual is None:
        return h
    with graph.inserting_after(value):
        item = graph.call_function(operator.getitem, (call, len(products)))
        item.meta.update(h.meta)
    h.replace_all_uses_with(item)
    graph.erase_node(h)
    return item
