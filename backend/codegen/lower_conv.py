"""Depthwise 2-D convolutions as pointwise kernels over the output, the window unrolled.

A depthwise convolution (``groups`` equal to the input's channels, one input channel per group,
each output channel reading one input channel) is a window sum with a weight per channel and
window element: ``out[n, c, oh, ow] = bias[c] + sum over (kh, kw) of x[n, c // m, ih, iw] *
w[c, 0, kh, kw]``, ``ih = oh * stride - pad + kh * dilation`` (likewise ``iw``), ``m`` the channel
multiplier. That is pooling's geometry (``lower_pool``), so the same window elements are used: each
read only inside the input (zero padding reads nothing), the kernel walking its output in memory
order (on channels-last tensors neighbouring threads read neighbouring channels).

Why generate them: cuDNN builds an execution plan for each configuration at its first call, per
thread, and for channels-last depthwise convolutions that takes 0.15-0.4 s each on an H200 (torch
2.11, cuDNN 9.19; ``benchmarks/probes/probe_conv_first_calls.py``): about 2 s of mobilenet_v3_small's
first inference call, in a warm process as in a cold one. A generated kernel is a stored binary
in a warm process, and its consumers (batch norm's affine, the activation) fuse into it. On
channels-last tensors the weights are first copied channels-innermost (``_weights``).

Everything else (ordinary and grouped convolutions, transposed ones, 1-d and 3-d, windows of more
than ``UNROLL_LIMIT`` elements) stays a library call. The backward (``convolution_backward``) is
not lowered: it stays with aten.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv

from cgtrees.codegen import ir
from cgtrees.codegen.ir import Const, Op
from cgtrees.codegen.lower_pool import FUSE_INPUT_LIMIT, Pool, Window, element, fold, where
from cgtrees.codegen.lowering import LowerCtx, TensorValue, cast, compute_dtype, lowering, meta_size, sym

aten = torch.ops.aten

# Windows of at most this many elements are unrolled (convnext's 7x7); larger ones go to the library.
UNROLL_LIMIT = 49


def _val(a: Any) -> Any:
    return a.meta["val"] if isinstance(a, torch.fx.Node) else a


def _why_not(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    x, w, out = _val(node.args[0]), _val(node.args[1]), node.meta["val"]
    stride, padding, dilation, transposed, _, groups = node.args[3:9]
    if transposed:
        return "a transposed convolution (the library's)"
    if x.dim() != 4:
        return f"a {x.dim() - 2}-d convolution (only 2-d depthwise ones are generated)"
    if not all(isinstance(c, int) for c in (x.shape[1], out.shape[1], w.shape[1])):
        return "a symbolic number of channels"
    if not isinstance(groups, int) or groups == 1 or w.shape[1] != 1 or groups != x.shape[1]:
        return "not a depthwise convolution (the library's)"
    if not x.dtype.is_floating_point:
        return f"a {x.dtype} convolution"
    if not all(isinstance(v, int) for v in (*stride, *padding, *dilation, *w.shape[2:])):
        return "a symbolic kernel size, stride, padding or dilation"
    if w.shape[2] * w.shape[3] > UNROLL_LIMIT:
        return f"a window of more than {UNROLL_LIMIT} elements (the library's)"
    if x.numel() == 0 or out.numel() == 0:
        return "an empty convolution"
    return None


def _geometry(node: torch.fx.Node) -> Pool:
    x, w, out = _val(node.args[0]), _val(node.args[1]), node.meta["val"]
    stride, padding, dilation = (list(v) * (2 // len(v)) for v in node.args[3:6])
    windows = [Window(int(w.shape[2 + i]), stride[i], padding[i], dilation[i], sym(x.shape[2 + i]),
                      sym(out.shape[2 + i])) for i in range(2)]
    return Pool(windows[0], windows[1], 2)


@lowering(aten.convolution.default, can_lower=_why_not)
def _depthwise(ctx: LowerCtx, x: TensorValue, w: TensorValue, bias: TensorValue | None, *args: Any) -> TensorValue:
    """The window's products summed in ``(kh, kw)`` order in the compute type, then the bias."""
    meta = ctx.out_meta()
    acc = compute_dtype(meta.dtype)
    geometry = _geometry(ctx.node)
    s = ir.index_symbols(4)
    multiplier = int(meta.shape[1]) // int(_val(ctx.node.args[0]).shape[1])
    if ir.size_of(x.body) > FUSE_INPUT_LIMIT:
        x = ctx.realize_input(x)
    if multiplier != 1:  # output channel c reads input channel c // m
        channel = {s[1]: FloorDiv(s[1], sympy.Integer(multiplier))}
        x = TensorValue(meta_size(meta), x.dtype, ir.map_indices(x.body, channel))
    w = _weights(ctx, w, meta, geometry)
    terms = []
    for kh in range(geometry.h.kernel):
        for kw in range(geometry.w.kernel):
            e = element(x, geometry, kh, kw, acc)
            weight = cast(ir.map_indices(w.body, {s[0]: s[1], s[1]: sympy.Integer(kh), s[2]: sympy.Integer(kw)}), acc)
            terms.append(where(e.inside, Op("mul", (e.value, weight), acc), Const(0, acc), acc))
    total = fold("add", terms, acc)
    if bias is not None:
        total = Op("add", (total, cast(ir.map_indices(bias.body, {s[0]: s[1]}), acc)), acc)
    return TensorValue(meta_size(meta), meta.dtype, cast(total, meta.dtype))


def _weights(ctx: LowerCtx, w: TensorValue, meta: torch.Tensor, geometry: Pool) -> TensorValue:
    """The weights as ``(C, KH, KW)``: where the output is channels-last, copied to a buffer whose
    channels are adjacent, so that each window element's weights, read by neighbouring threads
    (neighbouring channels), are one coalesced load rather than one transaction per channel (the
    weight tensor keeps a channel's window together). A small kernel of its own, per call."""
    s = ir.index_symbols(4)
    t = ir.index_symbols(3)
    by_channel = ir.map_indices(w.body, {s[0]: t[0], s[1]: sympy.Integer(0), s[2]: t[1], s[3]: t[2]})
    channels, kh, kw = sym(meta.shape[1]), geometry.h.kernel, geometry.w.kernel
    size = (channels, sympy.Integer(kh), sympy.Integer(kw))
    if sym(meta.stride(1)) != 1 or channels == 1:  # NCHW: a warp's threads share a channel's weights
        return TensorValue(size, w.dtype, by_channel)
    layout = ir.Layout(size, (sympy.Integer(1), kw * channels, channels), sympy.Integer(0))
    return ctx.add_reduction(ctx.node.name + "_weights", layout, w.dtype, size, (), None, by_channel)
