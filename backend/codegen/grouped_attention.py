"""Attention over grouped KV heads reads K and V as they are, not one copy per query head (issue 45).

Grouped-query attention (a 1.1B Llama: 32 query heads share 4 KV heads) reaches SDPA in Hugging
Face's models through ``repeat_kv`` whenever a mask is given, which a static cache always gives:

    unsqueeze(kv, 2) -> expand to [B, Hkv, R, L, D] -> clone -> view [B, Hkv*R, L, D] -> SDPA

so every decode step copies each layer's whole cache R times and the attention reads the copies.
Since torch 2.5, ``scaled_dot_product_attention(q, k, v, ..., enable_gqa=True)`` takes K and V with
Hkv heads. Measured on an H200 (bf16, one query token, R = 8, bool mask, inside a CUDA graph):
batch 1 with a 160-token cache 14.9 -> 9.7 us a layer, a 4096-token cache 54.8 -> 11.4 us, batch
32 with 4096 tokens 1317 -> 46 us (``benchmarks/results/probe-decode-kernels-h200.json``).

``rewritten(gm, plan)`` finds each SDPA call whose K and V are such expansions of the same R, whose
only result used is the attention output (an inference graph's; a training forward's saved
log-sum-exp stays as traced), and without dropout. A float mask that is SDPA's own conversion of a
boolean one (``where(keep, 0, -inf)``, traced into the graph) is given as ``keep``: the same
attention, and ``enable_gqa`` with a float mask may fall back to the math kernel (transformers says
so; an H200 probe with a boolean mask ran 9.7 us where the expanded form took 14.9: not yet timed
with a float one). Two grouped forms can replace the call: ``enable_gqa``, and our
``decode_attention`` (``codegen/decode_attention.py``: a few query rows a KV head, the cache whole or
split into slices) in each configuration of ``_DECODE_CONFIGS``. Which is a timed choice, as a GEMM's
form is (``gemm_choice``): every form runs on the device at compile time, the traced one with its
copies, one call at a time after a kernel that has ended (``gemm_timing``'s ``alone``: back to back,
an early-launched split's combine would hide behind the next call), and the fastest grouped one is
taken where it beats the traced one by more than ``gemm_choice.MARGIN``; ``gemm_decisions=rewrite``
always takes a grouped one (``decode_attention`` where it takes the shapes: tests), ``keep`` never.
Each choice is a line of the module's header. The caller's graph is left as it is (the cache
records it): a rewrite works on a copy.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from cgtrees.codegen import decode_attention, rope
from cgtrees.codegen.gemm_choice import MARGIN, layout_text, random_like, span_bytes

if TYPE_CHECKING:
    from cgtrees.codegen.gemm_choice import GemmPlan

aten = torch.ops.aten

SDPA_OPS = frozenset({
    aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
})
_MASK_ARG = {  # the name each op gives its mask, where it takes one
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
}
_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
TRACED, GQA = "as traced", "enable_gqa"
# decode_attention's (BLOCK_L, warps, positions a program or 0: the whole cache), timed; a split
# only where the cache is longer than its slice
_DECODE_CONFIGS = ((32, 4, 0), (64, 4, 0), (128, 4, 0), (32, 4, 64), (64, 4, 128), (64, 4, 256), (64, 4, 512),
                   (128, 8, 1024))


@dataclass(frozen=True)
class Grouped:
    """One SDPA call over expanded K and V: what ``enable_gqa`` would take instead."""

    node: torch.fx.Node  # the SDPA call
    q: torch.fx.Node
    k: torch.fx.Node  # unexpanded: [B, Hkv, L, D]
    v: torch.fx.Node
    mask: torch.fx.Node | None
    keep: torch.fx.Node | None  # the boolean mask the float one was made of (``where(keep, 0, -inf)``)
    is_causal: bool
    scale: float | None
    groups: int  # R: query heads per KV head
    rope: rope.Rope | None  # q = x * cos + rotate_half(x) * sin, read by nothing else: decode_attention rotates

    def text(self) -> str:
        q, k = self.q.meta["val"], self.k.meta["val"]
        return f"attention q {list(q.shape)} kv {list(k.shape)} x{self.groups} {str(q.dtype).removeprefix('torch.')}"


def rewritten(gm: torch.fx.GraphModule, plan: "GemmPlan") -> torch.fx.GraphModule:
    """``gm``, or a copy of it where a grouped form was chosen for some SDPA call."""
    calls = [n for op in SDPA_OPS for n in gm.graph.find_nodes(op="call_function", target=op)]
    found = [g for g in map(_grouped, calls) if g is not None]
    taken = [(g.node.name, form) for g in found if (form := _choose(g, plan)) != TRACED]
    if not taken:
        return gm
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    copied = {new.name: new for new in env.values()}
    for name, form in taken:
        _rewrite(graph, _grouped(copied[name]), form)
    graph.lint()
    return torch.fx.GraphModule(gm, graph)


# ------------------------------------------------------------------------------------------ matching
def _grouped(node: torch.fx.Node) -> Grouped | None:
    args = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    if args is None:
        return None
    kw = args.kwargs
    if kw.get("dropout_p", 0.0) != 0.0 or kw.get("return_debug_mask", False):
        return None
    if not all(u.target is operator.getitem and (u.args[1] == 0 or not u.users) for u in node.users):
        return None  # a result besides the output is used (a training forward's log-sum-exp)
    k, rk = _unexpanded(kw["key"])
    v, rv = _unexpanded(kw["value"])
    if k is None or v is None or rk != rv:
        return None
    q = kw["query"].meta.get("val")
    if q is None or q.dim() != 4 or q.shape[1] != k.meta["val"].shape[1] * rk:
        return None
    mask = kw.get(_MASK_ARG.get(node.target, ""))
    rotated = rope.match(kw["query"]) if len(kw["query"].users) == 1 else None
    return Grouped(node, kw["query"], k, v, mask, _boolean_source(mask), bool(kw.get("is_causal", False)),
                   kw.get("scale"), rk, rotated)


def _boolean_source(mask: object) -> torch.fx.Node | None:
    """``keep`` where ``mask`` is ``where(keep, 0.0, -inf)`` of a boolean ``keep``: SDPA's own conversion
    of a boolean mask, traced into the graph. SDPA given ``keep`` converts it the same way, and with
    ``enable_gqa`` the backends that take a boolean mask may be faster than with the float one."""
    if not isinstance(mask, torch.fx.Node) or mask.target is not aten.where.self:
        return None
    keep, zero, minus_inf = mask.args
    values = [_scalar(x) for x in (zero, minus_inf)]
    val = keep.meta.get("val") if isinstance(keep, torch.fx.Node) else None
    if val is None or val.dtype != torch.bool or values != [0.0, float("-inf")]:
        return None
    return keep


def _scalar(node: object) -> float | None:
    if isinstance(node, torch.fx.Node) and node.target is aten.scalar_tensor.default:
        return float(node.args[0])
    return None


def _unexpanded(node: torch.fx.Node) -> tuple[torch.fx.Node | None, int]:
    """(kv, R) where ``node`` is view(clone(expand(unsqueeze(kv, 2)))) with kv [B, Hkv, L, D] and
    the expand of dim 2 to R; (None, 0) otherwise."""
    chain = []
    for target in (_VIEWS, {aten.clone.default}, {aten.expand.default}, {aten.unsqueeze.default}):
        if not isinstance(node, torch.fx.Node) or node.target not in target:
            return None, 0
        chain.append(node)
        node = node.args[0]
    view, _, expand, unsqueeze = chain
    kv = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if kv is None or kv.dim() != 4 or unsqueeze.args[1] not in (2, -3):
        return None, 0
    sizes = expand.meta["val"].shape
    b, h, n, d = kv.shape
    groups = sizes[2]
    if not isinstance(groups, int) or tuple(sizes) != (b, h, groups, n, d) or \
            tuple(view.meta["val"].shape) != (b, h * groups, n, d):
        return None, 0
    return node, groups


# ------------------------------------------------------------------------------------------ choosing
def _choose(g: Grouped, plan: "GemmPlan") -> str:
    """The form taken: ``TRACED``, ``GQA`` or a ``decode_attention`` configuration's name."""
    configs = _decode_configs(g)
    decode = [_decode_name(c) for c in configs]
    how, why = plan.other_choice()
    if how != "time":
        taken = (decode or [GQA])[0] if how == "rewrite" else TRACED
        plan.note(g.node.name, g.text(), taken, (), why)
        return taken
    if not _static(g):
        plan.note(g.node.name, g.text(), TRACED, (), "symbolic sizes")
        return TRACED
    forms = {TRACED: _form(g, plan.device, grouped=False), GQA: _form(g, plan.device, grouped=True)}
    forms.update({name: _decode_form(g, plan.device, c) for name, c in zip(decode, configs)})
    timings = plan.time_forms(forms, alone=True)  # a split's combine is not hidden behind the next call
    if timings is None:
        plan.note(g.node.name, g.text(), TRACED, (), "too large to time")
        return TRACED
    best = min(timings, key=timings.get)
    taken = best if timings[best] < timings[TRACED] * (1 - MARGIN) else TRACED
    plan.note(g.node.name, g.text(), taken, tuple(timings.items()))
    return taken


def _static(g: Grouped) -> bool:
    vals = [n.meta.get("val") for n in (g.q, g.k, g.v, g.mask) if n is not None]
    return all(isinstance(x, int) for v in vals for x in (*v.shape, *v.stride()))


def _form(g: Grouped, device: torch.device, grouped: bool) -> tuple[str, Callable[[], Callable[[], None]], int]:
    """The traced form (K and V expanded into copies, then SDPA) or the grouped one, on the traced
    layouts; SDPA picks its backend at run time the way the traced call's backend was picked."""
    q, k, v, mask = _operands(g, boolean=grouped)
    key = (f"sdpa {'gqa' if grouped else 'expanded'} q {layout_text(q)} k {layout_text(k)} v {layout_text(v)} "
           f"mask {layout_text(mask) if mask is not None else None} x{g.groups} causal {g.is_causal} {q.dtype} "
           f"{device}")

    def build() -> Callable[[], None]:
        tq, tk, tv, tmask = _random(device, q, k, v, mask)
        if grouped:
            return lambda: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask, is_causal=g.is_causal,
                                                          scale=g.scale, enable_gqa=True)
        b, h, n, d = tk.shape
        shape = (b, h * g.groups, n, d)

        def expanded() -> None:
            ke = tk.unsqueeze(2).expand(b, h, g.groups, n, d).reshape(shape)
            ve = tv.unsqueeze(2).expand(b, h, g.groups, n, d).reshape(shape)
            F.scaled_dot_product_attention(tq, ke, ve, attn_mask=tmask, is_causal=g.is_causal, scale=g.scale)
        return expanded

    copies = 0 if grouped else 2 * g.groups * span_bytes(k)
    return key, build, span_bytes(q, k, v, mask) + copies


def _decode_configs(g: Grouped) -> list[tuple[int, int, int]]:
    """``decode_attention``'s configurations for this call: none where it does not compute it (a causal
    flag, symbolic sizes, shapes it does not take), a split only where the cache is longer than a slice."""
    q, k, v = (n.meta["val"] for n in (g.q, g.k, g.v))
    if g.is_causal or not _static(g) or not decode_attention.fits(q, k, v):
        return []
    return [c for c in _DECODE_CONFIGS if c[2] < k.shape[2]]


def _decode_name(config: tuple[int, int, int]) -> str:
    block_l, warps, split_l = config
    return f"decode_attention {block_l}/{warps}" + (f" split {split_l}" if split_l else "")


def _decode_form(g: Grouped, device: torch.device, config: tuple[int, int, int]) -> tuple[str, Callable, int]:
    """Our kernel on the traced layouts, the boolean mask where the float one was made of it."""
    q, k, v, mask = _operands(g, boolean=True)
    cos, sin = (g.rope.cos.meta["val"], g.rope.sin.meta["val"]) if g.rope is not None else (None, None)
    key = (f"decode_attention q {layout_text(q)} k {layout_text(k)} v {layout_text(v)} "
           f"mask {layout_text(mask) if mask is not None else None} {mask.dtype if mask is not None else None} "
           f"rope {layout_text(cos) if cos is not None else None} {config} {q.dtype} {device}")

    def build() -> Callable[[], None]:
        tq, tk, tv, tmask = _random(device, q, k, v, mask)
        tcos, tsin = (random_like(cos, device), random_like(sin, device)) if cos is not None else (None, None)
        stride = list(_output(g).stride())
        return lambda: torch.ops.cgtrees.decode_attention(tq, tk, tv, tmask, g.scale, stride, *config, tcos, tsin)

    return key, build, span_bytes(q, k, v, mask, *([cos, sin] if cos is not None else []))


def _output(g: Grouped) -> torch.Tensor:
    """The traced attention output's value (the SDPA call's first result)."""
    return next(u for u in g.node.users if u.args[1] == 0).meta["val"]


def _operands(g: Grouped, boolean: bool) -> tuple[torch.Tensor, ...]:
    """The traced q, k, v and mask values (the boolean mask a float one was made of, where ``boolean``)."""
    mask_node = g.keep if boolean and g.keep is not None else g.mask
    return (*(n.meta["val"] for n in (g.q, g.k, g.v)), mask_node.meta["val"] if mask_node is not None else None)


def _random(device: torch.device, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Tensors laid out as the traced ones, random; a boolean mask keeps everything."""
    tmask = random_like(mask, device) if mask is not None else None
    if tmask is not None and tmask.dtype == torch.bool:
        tmask.fill_(True)
    return (*(random_like(x, device) for x in (q, k, v)), tmask)


# ------------------------------------------------------------------------------------------ rewriting
def _rewrite(graph: torch.fx.Graph, g: Grouped, form: str) -> None:
    """Call ``aten.scaled_dot_product_attention(..., enable_gqa=True)`` (``GQA``) or our
    ``decode_attention`` on the unexpanded K and V in place of ``g.node`` and its output; the
    expansions go where nothing else reads them."""
    out = next(u for u in g.node.users if u.args[1] == 0)
    mask = g.keep if g.keep is not None else g.mask
    with graph.inserting_before(g.node):
        if form == GQA:
            kwargs = {"attn_mask": mask, "dropout_p": 0.0, "is_causal": g.is_causal, "scale": g.scale,
                      "enable_gqa": True}
            call = graph.call_function(aten.scaled_dot_product_attention.default, (g.q, g.k, g.v), kwargs)
        else:
            config = next(c for c in _DECODE_CONFIGS if _decode_name(c) == form)
            q, trig = (g.rope.x, (g.rope.cos, g.rope.sin)) if g.rope is not None else (g.q, (None, None))
            call = graph.call_function(torch.ops.cgtrees.decode_attention.default,
                                       (q, g.k, g.v, mask, g.scale, list(out.meta["val"].stride()), *config, *trig))
    call.meta.update(out.meta)
    call.meta.setdefault("stack_trace", g.node.meta.get("stack_trace"))
    expansions = [g.node.kwargs.get("key"), g.node.kwargs.get("value"), *g.node.args[1:3]]
    for user in list(g.node.users):
        user.replace_all_uses_with(call)  # the output's readers; the other results have none
        graph.erase_node(user)
    graph.erase_node(g.node)
    for node in expansions:
        _erase_chain(graph, node)
    if form != GQA and g.rope is not None:  # the kernel rotates q: the graph's rotation goes
        for node in g.rope.chain:
            if not node.users:
                graph.erase_node(node)
    if g.keep is not None and not g.mask.users:  # the float mask SDPA is no longer given
        scalars = g.mask.args[1:]
        graph.erase_node(g.mask)
        for node in scalars:
            if not node.users:
                graph.erase_node(node)


def _erase_chain(graph: torch.fx.Graph, node: object) -> None:
    """Erase ``node`` and what only it read, down the expansion chain, while nothing else reads them."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and not node.users and \
            node.target in (_VIEWS | {aten.clone.default, aten.expand.default, aten.unsqueeze.default}):
        parent = node.args[0]
        graph.erase_node(node)
        node = parent
