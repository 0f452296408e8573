"""Channels-last convolutions: rewrite an aten graph so that its 4-d convolutions run in NHWC.

cuDNN computes most convolutions in NHWC. Handed NCHW tensors, it converts the activations (and
the weights) to NHWC and the result back, on every call: two or three extra kernels around each
convolution, forward and backward. This pass gives the convolutions channels-last tensors instead,
converted once where they enter the graph; a convolution of channels-last tensors returns a
channels-last result, and the layout then flows through what follows (pointwise ops, batch norm's
decomposed statistics, pooling, views) into the next convolution with no conversion in between.

Run over the joint forward+backward graph before partitioning (so the forward's saved activations
and the backward agree on strides), and over inference graphs. The steps:

1. Decide (``_why_not``): CUDA convolutions of 4-d tensors, static shapes, and convolutions that
   gain from NHWC. The heuristic is Inductor's (``GraphLowering.decide_layout_opt``, measured on
   the torchbench convolutions), restated: no grouped convolution with more than one input channel
   per group (NHWC was up to 31x slower there; depthwise ones gain), no convolution that shrinks its
   channels by 2x or more with a kernel larger than 1x1, not every convolution at 64 channels or
   fewer, and not a graph where convolutions are rare (fewer than one per 300 nodes). In inference
   only grouped convolutions are slower, so there the convolutions' FLOPs weighted by Inductor's
   measured speedups decide.
2. Rewrite (``_Rewriter``), node by node into a new graph, re-propagating ``meta["val"]`` with fake
   tensors where an input's strides changed:
   - a convolution's input, weight (and ``convolution_backward``'s output gradient) are converted to
     channels-last where they are not already (one ``aten.clone(memory_format=channels_last)`` per
     value, shared by all its convolutions);
   - ops whose result does not depend on their inputs' strides (``_FLOWS``: pointwise ops,
     reductions, views, copies, pooling, matrix products) take their inputs as they come; a view
     that the new strides cannot express (``view(N, C*H*W)`` of an NHWC tensor) gets its input
     back in the traced layout;
   - every other op (``as_strided``, custom ops, anything unknown) gets its inputs in the traced
     layout, so it sees exactly the strides it was traced with;
   - graph outputs (user outputs, gradients, mutated buffers) are converted back to the strides
     eager gives (a view where only the strides of size-1 dimensions differ, else a copy). Values
     between the forward and the backward are not outputs here: saved activations stay
     channels-last.
   A value that must be converted back to strides no dense copy has (a strided view returned as an
   output) leaves the graph as it was: the pass is all or nothing.

``mode``: "auto" (the decision above), "off", or "force" (every graph with 4-d convolutions, any
device and size, training or not: how the CPU tests exercise the rewrite, and the GPU tests CUDA
training graphs, which the decision keeps NCHW).
"""

from __future__ import annotations

import enum
import logging
import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx

from cgtrees import counters
from cgtrees.aot import compat
from cgtrees.logs import log_once

aten = torch.ops.aten
log = logging.getLogger("cgtrees.aot.layout")

CHANNELS_LAST = torch.channels_last


class Mode(enum.Enum):
    AUTO = "auto"
    OFF = "off"
    FORCE = "force"


# Inductor's measured NHWC/NCHW time ratios for convolutions in inference (< 1: NHWC is faster).
GROUPED_RATIO, SMALL_RATIO, IN_OUT_RATIO, DEFAULT_RATIO = 1.358, 0.783, 0.725, 0.823
SMALL_CHANNELS = 64
NODES_PER_CONV = 300

_CONV_ARGS = {aten.convolution.default: (0, 1), aten.convolution_backward.default: (0, 1, 2)}


# --------------------------------------------------------------------------------------- entry
def optimize(gm: torch.fx.GraphModule, mode: str | Mode = Mode.AUTO, *, inference: bool) -> bool:
    """Rewrite ``gm`` channels-last where its convolutions want it; True when it was rewritten."""
    mode = Mode(mode)
    reason = _why_not(gm.graph, mode, inference)  # 1. does this graph want NHWC?
    if reason is not None:
        log.debug("cgtrees layout: NCHW kept (%s)", reason)
        return False
    try:
        graph = _Rewriter(gm.graph).run()  # 2. a new graph, channels-last, strides re-propagated
    except _KeepLayout as exc:
        log.debug("cgtrees layout: NCHW kept (%s)", exc)
        return False
    except Exception as exc:  # noqa: BLE001  (a bug here must not sink the compile: NCHW is right too)
        log_once(log, f"layout:{type(exc).__name__}:{exc}", "cgtrees layout: rewrite failed (%s: %s); NCHW kept",
                 type(exc).__name__, exc)
        return False
    gm.graph = graph  # 3. swapped in only when whole
    gm.recompile()
    counters.bump("layout_channels_last")
    return True


# ------------------------------------------------------------------------------------ decision
def _convolutions(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is aten.convolution.default]


def _why_not(graph: torch.fx.Graph, mode: Mode, inference: bool) -> str | None:
    """None where the graph should go channels-last, else the reason it stays NCHW."""
    if mode is Mode.OFF:
        return "layout_opt is off"
    convs = _convolutions(graph)
    if not convs:
        return "no convolution"
    metas = [(_val(c.args[0]), _val(c.args[1])) for c in convs]
    if any(x is None or w is None or x.dim() != 4 for x, w in metas):
        return "a convolution that is not 2-d"
    if any(_symbolic(t) for x, w in metas for t in (x, w)):
        return "dynamic shapes"
    on_cuda = any(t.device.type == "cuda" for x, w in metas for t in (x, w))
    if mode is Mode.FORCE:
        return None
    if not on_cuda:
        return "not on CUDA"
    backward = graph.find_nodes(op="call_function", target=aten.convolution_backward.default)
    if len(graph.nodes) >= NODES_PER_CONV * (len(convs) + len(backward)):  # a joint graph counts both
        return "few convolutions for the size of the graph"
    if inference:
        return _inference_verdict(convs)
    if any(_is_grouped(c) for c in convs):
        return "a grouped convolution with several input channels per group"
    if any(_shrinks_channels(c) for c in convs):
        return "a convolution that shrinks its channels"
    if all(_is_small(c) for c in convs):
        return f"every convolution has at most {SMALL_CHANNELS} channels"
    return None


# Training graphs on CUDA take the decision above (Inductor's) since the generated module checks the
# strides of what aten returns (backend/codegen/extern_strides.py: forced before that, cuDNN's
# convolution backward returned other strides than traced and a conv-BN-ReLU's input gradients were
# wrong), pooling is a pointwise kernel over the output's memory order (lower_pool.py) and
# channels-last batch-norm statistics split into enough programs (heuristics.split_reduction).
# Measured on the H100 (2026-11-24, real suite, per training step, channels-last against NCHW):
# resnet18 4.92 against 6.17 ms (reduce-overhead 4.87), convnext_atto 12.47 against 14.10 (11.08),
# mobilenet_v3_small 5.56 against 6.16 (3.93).


def _inference_verdict(convs: list[torch.fx.Node]) -> str | None:
    flops: dict[float, float] = defaultdict(float)
    for c in convs:
        ratio = GROUPED_RATIO if _is_grouped(c) else SMALL_RATIO if _is_small(c) \
            else IN_OUT_RATIO if _shrinks_channels(c) else DEFAULT_RATIO
        flops[ratio] += _flops(c)
    total = sum(flops.values())
    weighted = sum(ratio * f for ratio, f in flops.items())
    return None if weighted <= total else "grouped convolutions dominate (slower in NHWC)"


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _symbolic(t: torch.Tensor) -> bool:
    return any(not isinstance(s, int) for s in (*t.shape, *t.stride()))


def _groups(conv: torch.fx.Node) -> int:
    return conv.args[8] if len(conv.args) > 8 else conv.kwargs.get("groups", 1)


def _is_grouped(conv: torch.fx.Node) -> bool:
    """Grouped with more than one input channel per group (depthwise convolutions are not)."""
    return _groups(conv) > 1 and _val(conv.args[1]).shape[1] > 1


def _shrinks_channels(conv: torch.fx.Node) -> bool:
    out_channels, in_channels, kh, _ = _val(conv.args[1]).shape
    return out_channels * 2 <= in_channels and kh > 1


def _is_small(conv: torch.fx.Node) -> bool:
    out_channels, in_channels, _, _ = _val(conv.args[1]).shape
    return out_channels <= SMALL_CHANNELS and in_channels <= SMALL_CHANNELS


def _flops(conv: torch.fx.Node) -> float:
    """Multiply-adds x 2 of a convolution: every output element sums C_in/groups * kh * kw products."""
    out, w = _val(conv), _val(conv.args[1])
    return 2.0 * out.numel() * w.shape[1] * w.shape[2] * w.shape[3]


# ------------------------------------------------------------------------------------- rewrite
class _KeepLayout(Exception):
    """The rewrite cannot keep its promises for this graph: it stays as it was."""


def _flows(target: Any) -> bool:
    """Whether ``target`` takes its inputs in whatever layout they come (see ``_FLOWS``)."""
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target.overloadpacket in _FLOWS


# Ops whose values do not depend on their inputs' strides (only their results' strides do).
_FLOWS = {
    # views: exact where they succeed, and they fail loudly where strides cannot express them
    aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.t, aten.expand,
    aten.squeeze, aten.unsqueeze, aten.slice, aten.select, aten.alias, aten.detach, aten.split,
    aten.split_with_sizes, aten.unbind,
    # copies and constants shaped like their input
    aten.clone, aten._to_copy, aten.copy, aten.copy_, aten.full_like, aten.zeros_like, aten.ones_like,
    aten.empty_like, aten.cat, aten.constant_pad_nd,
    # reductions
    aten.sum, aten.mean, aten.amax, aten.amin, aten.prod, aten.var, aten.var_mean, aten.std,
    aten.max, aten.min, aten.any, aten.all,
    # normalisation, pooling and library calls that follow their input's layout
    aten.native_batch_norm, aten._native_batch_norm_legit_functional, aten.native_batch_norm_backward,
    aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward, aten.avg_pool2d,
    aten.avg_pool2d_backward, aten._adaptive_avg_pool2d, aten._adaptive_avg_pool2d_backward,
    aten.convolution, aten.convolution_backward, aten.mm, aten.addmm, aten.bmm,
}


class _Rewriter:
    """Copies ``graph`` node by node into a new graph, converting layouts as the module says."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.old = graph
        self.new = torch.fx.Graph(owning_module=graph.owning_module)
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.traced: dict[torch.fx.Node, Any] = {}  # copy of a traced node -> the value it was traced with
        self.to_nhwc: dict[torch.fx.Node, torch.fx.Node] = {}
        self.to_traced: dict[torch.fx.Node, torch.fx.Node] = {}
        self.fake_mode = compat.fake_mode_of(list(graph.find_nodes(op="placeholder")))

    def run(self) -> torch.fx.Graph:
        for node in self.old.nodes:
            if node.op == "call_function":
                self.env[node] = self._call(node)
            elif node.op == "output":
                self.new.output(torch.fx.node.map_arg(node.args[0], lambda n: self._traced_layout(self.env[n])))
            else:
                self.env[node] = self.new.node_copy(node, lambda n: self.env[n])
                self.traced[self.env[node]] = node.meta.get("val")
        self.new.lint()
        return self.new

    def _call(self, node: torch.fx.Node) -> torch.fx.Node:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: self.env[n])
        flows = _flows(node.target)
        if node.target in _CONV_ARGS:
            args = tuple(self._channels_last(a) if i in _CONV_ARGS[node.target] else a for i, a in enumerate(args))
        elif not flows:
            args, kwargs = torch.fx.node.map_arg((args, kwargs), self._traced_layout)
        try:
            return self._emit(node, args, kwargs)
        except Exception as exc:  # noqa: BLE001  (a view the new strides cannot express)
            if not flows:
                raise _KeepLayout(f"{node.name}: {type(exc).__name__}: {exc}") from exc
            args, kwargs = torch.fx.node.map_arg((args, kwargs), self._traced_layout)
            return self._emit(node, args, kwargs)

    def _emit(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> torch.fx.Node:
        """``node`` with these arguments in the new graph; its value recomputed where an input moved."""
        given, traced = _nodes((args, kwargs)), _nodes((node.args, node.kwargs))
        moved = any(not _same_strides(g.meta.get("val"), t.meta.get("val")) for g, t in zip(given, traced))
        val = _fake_run(node.target, args, kwargs, self.fake_mode) if moved else node.meta.get("val")
        new = self.new.create_node("call_function", node.target, args, kwargs, name=node.name)
        new.meta = {**node.meta, "val": val}
        new.meta.pop("tensor_meta", None)  # would hold the traced strides
        self.traced[new] = node.meta.get("val")
        return new

    def _moved(self, node: torch.fx.Node) -> bool:
        """Whether ``node``, the copy of a traced node, now has other strides than it was traced with."""
        return node in self.traced and not _same_strides(node.meta.get("val"), self.traced[node])

    def _channels_last(self, arg: Any) -> Any:
        val = _val(arg)
        if val is None or val.dim() != 4 or val.is_contiguous(memory_format=CHANNELS_LAST):
            return arg
        if arg not in self.to_nhwc:
            self.to_nhwc[arg] = self._convert(arg, CHANNELS_LAST, f"{arg.name}_nhwc")
        return self.to_nhwc[arg]

    def _traced_layout(self, arg: Any) -> Any:
        """``arg`` with the strides it was traced with (a copy where they changed)."""
        if not isinstance(arg, torch.fx.Node) or not self._moved(arg):
            return arg
        if arg not in self.to_traced:
            want = self.traced[arg]
            if not isinstance(want, torch.Tensor):
                raise _KeepLayout(f"{arg.name}: a tuple whose elements' strides changed is used whole")
            copy = self._copy_like(arg, want)
            if tuple(copy.meta["val"].stride()) != tuple(want.stride()):
                raise _KeepLayout(f"{arg.name}: no dense copy has its traced strides {tuple(want.stride())}")
            self.to_traced[arg] = copy
        return self.to_traced[arg]

    def _copy_like(self, arg: torch.fx.Node, want: torch.Tensor) -> torch.fx.Node:
        """``arg`` in ``want``'s dimension order: a view where only strides of size-1 dimensions
        differ (a 1x1 convolution's weight gradient), else a copy: contiguous, channels-last, or any
        other dense order (permute into it, copy contiguous, permute back)."""
        name = f"{arg.name}_{'nchw' if want.dim() == 4 else 'traced'}"
        if _same_memory(arg.meta["val"], want):
            return self._add(aten.as_strided.default, (arg, list(want.shape), list(want.stride())), {}, name)
        if want.is_contiguous():
            return self._convert(arg, torch.contiguous_format, name)
        if want.dim() == 4 and want.is_contiguous(memory_format=CHANNELS_LAST):
            return self._convert(arg, CHANNELS_LAST, name)
        order = sorted(range(want.dim()), key=lambda d: -want.stride(d))
        inverse = sorted(range(want.dim()), key=lambda d: order[d])
        permuted = self._add(aten.permute.default, (arg, order), {}, f"{name}_perm")
        dense = self._convert(permuted, torch.contiguous_format, f"{name}_dense")
        return self._add(aten.permute.default, (dense, inverse), {}, name)

    def _convert(self, arg: torch.fx.Node, memory_format: torch.memory_format, name: str) -> torch.fx.Node:
        return self._add(aten.clone.default, (arg,), {"memory_format": memory_format}, name)

    def _add(self, target: Any, args: tuple, kwargs: dict, name: str) -> torch.fx.Node:
        node = self.new.create_node("call_function", target, args, kwargs, name=name)
        node.meta["val"] = _fake_run(target, args, kwargs, self.fake_mode)
        node.meta.update({k: v for k, v in args[0].meta.items() if k in ("stack_trace", "seq_nr")})
        return node


def _nodes(value: Any) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, lambda n: out.append(n) or n)
    return out


def _fake_run(target: Any, args: tuple, kwargs: dict, fake_mode: Any) -> Any:
    fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta.get("val"))
    with fake_mode:
        return target(*fake_args, **fake_kwargs)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same elements at the same offsets: strides differ at most where a dimension has size 1."""
    return a.shape == b.shape and all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


def _same_strides(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return tuple(a.stride()) == tuple(b.stride())
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_strides(x, y) for x, y in zip(a, b))
    return True
