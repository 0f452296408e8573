"""``addmm(bias, a, b)`` as ``mm(a, b)`` plus a bias added in the kernel of the product's consumer
(and ``baddbmm`` as ``bmm`` the same way).

Eager (and our aten fallback) runs addmm as one cuBLAS call that adds the bias in the GEMM's
epilogue. Where the product feeds pointwise ops we generate anyway (GELU, a residual add, the next
layer norm's input), calling ``mm`` and adding ``beta * bias`` in the consumer's kernel costs no
launch, and cuBLAS picks its GEMM for ``mm`` alone (on the H100, GPT-2's MLP shapes got a 64x64
tile as addmm and a 256x128 one as mm: ``benchmarks/results/real/analysis.md``). Inductor makes
the same trade (``unfuse_bias_add_to_pointwise`` in its post-grad passes).

An addmm stays one aten call (the lowering's ``can_lower`` says why) where:

- the option ``unfuse_addmm`` is off;
- its dtype is half precision. cuBLAS adds the bias in the float32 accumulator and rounds once;
  unfused, the product rounds to bfloat16/float16 before the add. Inductor keeps these fused
  (``keep_addmm_fused_for_half_dtypes``): the extra rounding compounded through deep models;
- ``alpha`` is 0 (eager then never reads the product: NaN there is ignored) or not a number;
- its result reaches anything but pointwise ops we generate, through views that stay index remaps
  (``lower_views``); an add that fused with nothing would be a launch of its own, so at least one
  pointwise op must read it, and every place the value is computed (each pointwise user, and each
  node read twice) must have one size, so that the scheduler puts them in one kernel;
- the sum, or a view of it, is a graph output: a training forward saves the input of GELU for the
  backward. Unfused, the product is written by the GEMM and the sum again by the kernel (on
  vit_tiny's training step, 96 us of the forward's GELU kernels); the epilogue writes it once.

Where all of that allows it, the two forms are timed on the device and the faster taken
(``gemm_choice.GemmPlan.keeps_addmm``): cuBLAS picks its kernel per call, and on small float32
shapes it gave addmm a gemv-like kernel ten times faster than mm's tile. Where nothing can be
timed (CPU), the addmm stays one call unless ``gemm_decisions=rewrite``.

``beta = 0`` ignores the bias, NaN included, as eager does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from cgtrees.codegen.ir import Op
from cgtrees.codegen.lower_views import split_remap
from cgtrees.codegen.lowering import (
    LOWERINGS,
    LowerCtx,
    TensorValue,
    broadcast,
    cast,
    lowering,
    meta_size,
    reads_values,
    scalar,
    why_not_lowered,
)

aten = torch.ops.aten

UNFUSED_DTYPES = (torch.float32, torch.float64)
# views of a lazy value that remap its index (``lower_views``); reshapes only where they split dimensions
_REMAPS = frozenset({aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
                     aten.permute.default, aten.transpose.int, aten.t.default, aten.expand.default,
                     aten.select.int, aten.slice.Tensor})
_RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
_SIZES = frozenset({aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default})  # read no values


def why_kept(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    """None where ``node`` (an addmm) is lowered as mm plus a fused bias add, else why it is not."""
    if not ctx.unfuse_addmm:
        return "unfuse_addmm is off"
    bias, a, b = node.args[:3]
    dtypes = {x.meta["val"].dtype for x in (node, bias, a, b) if isinstance(x, torch.fx.Node)}
    if len(dtypes) != 1 or not dtypes <= set(UNFUSED_DTYPES):
        return f"dtypes {sorted(map(str, dtypes))}: only float32 and float64 are unfused (in half precision, " \
               "addmm adds the bias before the product rounds)"
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    if not all(isinstance(s, (int, float)) for s in (beta, alpha)) or alpha == 0:
        return f"beta={beta!r}, alpha={alpha!r}"
    return _why_not_fused(node, ctx) or ctx.builder.gemm.keeps_addmm(node)


def _why_not_fused(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    """None where every reader of the sum is a pointwise op we lower (through index-remap views) or
    the output, at least one pointwise op reads it, and all of them compute it at one size."""
    sizes: set[tuple] = set()
    pointwise = 0
    pending = [node]
    while pending:
        value = pending.pop()
        readers = [u for u in value.users if reads_values(u, value)]
        if any(u.op == "output" for u in readers):
            return "its sum is a graph output (saved for the backward, say): unfused, the product " \
                   "and the sum would both be written"
        if len(readers) > 1:
            sizes.add(_size(value))  # written to memory where it is computed
        for user in readers:
            if user.op == "output" or user.target in _SIZES:
                continue
            if user.target in _REMAPS or (user.target in _RESHAPES and
                                          split_remap(_size(value), _size(user)) is not None):
                pending.append(user)
            elif _is_fusible_pointwise(user, ctx):
                pointwise += 1
                sizes.add(_size(user))
            else:
                return f"its product feeds {user.target} (the bias add would fuse with nothing)"
    if pointwise == 0:
        return "no pointwise op reads its product (the bias add would be a kernel of its own)"
    if len(sizes) > 1:
        return f"its sum would be computed at several sizes {sorted(map(str, sizes))} (in several kernels)"
    return None


def _is_fusible_pointwise(user: torch.fx.Node, ctx: LowerCtx) -> bool:
    target = user.target
    return (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
            and target in LOWERINGS and why_not_lowered(user, ctx) is None)


def _size(node: torch.fx.Node) -> tuple:
    return meta_size(node.meta["val"])


PRODUCTS = {aten.addmm.default: aten.mm.default, aten.baddbmm.default: aten.bmm.default}


@lowering(*PRODUCTS, can_lower=why_kept)
def _addmm(ctx: LowerCtx, bias: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> TensorValue:
    node = ctx.node
    target = PRODUCTS[node.target]
    product_meta = target(node.args[1].meta["val"], node.args[2].meta["val"])
    product = ctx.library_call(target, tuple(node.args[1:3]), product_meta, f"_{target.__name__.split('.')[0]}")
    if beta == 0 and alpha == 1:
        return product  # the product's own buffer: nothing to add
    meta = ctx.out_meta()
    size, dtype = meta_size(meta), meta.dtype
    body = product.body
    if alpha != 1:
        body = Op("mul", (body, scalar(alpha, dtype)), dtype)
    if beta != 0:
        addend = broadcast(bias, size, dtype)
        if beta != 1:
            addend = Op("mul", (addend, scalar(beta, dtype)), dtype)
        body = Op("add", (body, addend), dtype)
    return TensorValue(size, dtype, cast(body, dtype))
