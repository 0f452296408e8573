"""Boolean attention masks that torch's fused attention would run slowly or not at all, taken out.

**Constant along the keys** (``take_out_row_masks``).
Such a mask (``mask.stride(-1) == 0`` or one column) either passes or blocks each query's row
whole: a row it passes gets the unmasked attention, a row it blocks gets zeros, as
``scaled_dot_product_attention`` gives a row with no key to attend to. So

    sdpa(q, k, v, mask)  ==  where(mask[..., :1], sdpa(q, k, v), 0)

A float mask constant along the keys is left alone: adding one amount to a row's scores changes
its softmax only by rounding, except where the amount is so large (``finfo.min``, as older masks
use) that it absorbs the scores and the row's attention becomes uniform.

Why it matters: transformers 5.17 (the GPU machine's) builds a bidirectional model's mask under
``torch.compile`` as ``q_idx >= 0`` broadcast over the keys (it leaves the mask out in eager, where
it can see that every position attends; 5.24 leaves it out under ``torch.compile`` too). torch's
fused attention kernels refuse a mask whose last stride is not 1, so the trace takes the math path:
float32 matmuls without tensor cores and a softmax over a float32 score matrix per head (BERT-base's
training step, 16 x 512, bf16: 4.5 ms of float32 matmuls in 28.7 on an H200, in Inductor's step as
in ours). Without the mask the trace takes flash attention, as eager does.

**The causal pattern, computed from no input** (``take_out_causal_masks``). transformers 5.17 builds
a decoder's mask under ``torch.compile`` too (GPT-2's, Llama's: ``kv_idx <= q_idx`` from aranges,
``is_causal=False``), where eager passes ``is_causal=True``. cuDNN's attention with a mask is a
slower kernel than its causal one (an H200, bf16, GPT-2's 8 x 12 x 1024 x 64: forward 0.137 ms
against 0.050, forward and backward 0.58 against 0.29; ``probes/probe_sdpa_backends.py``), and
flash attention refuses a mask. A mask none of whose ancestors is a graph input is the same at
every call of the graph, so the pass computes it once, on the device, and where it equals
``tril(ones(L, S))`` broadcast (what ``is_causal=True`` means to torch), the attention takes
``is_causal=True`` and no mask. A mask that reads an input (a padding mask) stays.

Both run on the Dynamo graph before AOTAutograd traces it (``driver._compile_missed``). Left alone: a
mask that varies along the keys (unless causal as above), a float mask, ``is_causal`` with a mask
(an error of torch's own), anything whose fake value is missing.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from cgtrees.aot import compat

SDPA = torch._C._nn.scaled_dot_product_attention  # what F.scaled_dot_product_attention is
_MASK_AT = 3  # sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def take_out_row_masks(gm: torch.fx.GraphModule) -> bool:
    """Rewrite each attention of ``gm`` whose mask is constant along the keys; whether any was."""
    rewritten = [node for node in gm.graph.find_nodes(op="call_function", target=SDPA) if _row_mask(node)]
    for node in rewritten:
        _rewrite(gm.graph, node)
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return bool(rewritten)


def take_out_causal_masks(gm: torch.fx.GraphModule) -> bool:
    """Give each attention of ``gm`` whose boolean mask is computed from no input and is the causal
    pattern ``is_causal=True`` instead; whether any was."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False  # a graph compiled inside a capture: nothing can be computed here to compare
    values: dict[torch.fx.Node, torch.Tensor | None] = {}
    rewritten = []
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        mask = _mask_arg(node)
        if not isinstance(mask, torch.fx.Node) or _causal_arg(node) is not False or not _boolean(mask):
            continue
        if mask not in values:
            values[mask] = _computed(gm, mask)
        if values[mask] is not None and _is_causal_pattern(values[mask], node):
            _make_causal(node)
            rewritten.append(node)
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return bool(rewritten)


_MAX_MASK = 1 << 28  # elements of a mask computed at compile time
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "multinomial", "uniform", "exponential", "geometric", "cauchy",
           "poisson")


def _computed(gm: torch.fx.GraphModule, mask: torch.fx.Node) -> torch.Tensor | None:
    """``mask``'s value where none of its ancestors is a graph input or random (the same at every
    call of the graph), computed on real tensors; else None."""
    chain, todo = set(), [mask]
    while todo:
        node = todo.pop()
        if node in chain:
            continue
        if node.op == "placeholder" or any(word in str(node.target) for word in _RANDOM) or _functorch(node):
            return None
        if node.op not in ("call_function", "call_method"):  # a get_attr may be a buffer the model writes
            return None
        chain.add(node)
        todo.extend(node.all_input_nodes)
    value = mask.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.numel() > _MAX_MASK:
        return None
    if any(_mutates(user) for node in chain for user in node.users if user not in chain):
        return None  # written in place after it was made (``mask[..., i] = False``): not what the chain computes
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node in chain:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[mask])
    try:
        with compat.real_tensors(), torch.no_grad():
            out = torch.fx.GraphModule(gm, graph)()
    except Exception:  # noqa: BLE001 - a mask we cannot compute here stays as it is
        return None
    return out if isinstance(out, torch.Tensor) and out.dtype == torch.bool else None


def _functorch(node: torch.fx.Node) -> bool:
    """Whether ``node`` is one of vmap's steps (``_add_batch_dim`` at a level, ``_remove_batch_dim``):
    outside the nesting that Dynamo's graph opens around them they are not the mask's values."""
    module = getattr(node.target, "__module__", None) or ""
    return module.startswith("torch._C._functorch") or "batch_dim" in str(node.target) or "vmap" in str(node.target)


def _mutates(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write one of its inputs: ``setitem``, an in-place operator (``iand``), an
    in-place method or op (a name ending in ``_``), an ``out=`` argument."""
    if "out" in node.kwargs:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    if getattr(operator, name, None) is node.target:  # ``operator.and_`` is ``&``; ``iand`` is ``&=``
        return name in ("setitem", "delitem") or (name.startswith("i") and (hasattr(operator, name[1:]) or
                                                                  hasattr(operator, name[1:] + "_")))
    return name.endswith("_") and not name.endswith("__")


def _is_causal_pattern(mask: torch.Tensor, node: torch.fx.Node) -> bool:
    q, k = (node.args[i].meta.get("example_value") if isinstance(node.args[i], torch.fx.Node) else None
            for i in (0, 1))
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or mask.dim() < 2:
        return False
    rows, cols = int(q.shape[-2]), int(k.shape[-2])
    if tuple(mask.shape[-2:]) != (rows, cols):
        return False
    causal = torch.ones(rows, cols, dtype=torch.bool, device=mask.device).tril()
    return torch.equal(mask, causal.expand_as(mask))


def _make_causal(node: torch.fx.Node) -> None:
    args, kwargs = list(node.args), dict(node.kwargs)
    for i, (name, value) in ((_MASK_AT, ("attn_mask", None)), (5, ("is_causal", True))):
        if len(args) > i:
            args[i] = value
        else:
            kwargs[name] = value
    node.args, node.kwargs = tuple(args), kwargs


def _causal_arg(node: torch.fx.Node) -> object:
    return node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)


def _boolean(mask: torch.fx.Node) -> bool:
    value = mask.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and value.dtype == torch.bool


def _mask_arg(node: torch.fx.Node) -> object:
    return node.args[_MASK_AT] if len(node.args) > _MASK_AT else node.kwargs.get("attn_mask")


def _row_mask(node: torch.fx.Node) -> bool:
    """Whether ``node``'s mask is a boolean tensor constant along the keys."""
    mask = _mask_arg(node)
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    if not isinstance(mask, torch.fx.Node) or causal is not False:
        return False
    value = mask.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.dim() == 0 \
            or value.dtype != torch.bool:
        return False
    return value.size(-1) == 1 or value.stride(-1) == 0


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    mask = _mask_arg(node)
    with graph.inserting_before(node):
        passes = graph.call_function(operator.getitem, (mask, (Ellipsis, slice(0, 1))))
    if len(node.args) > _MASK_AT:
        node.args = (*node.args[:_MASK_AT], None, *node.args[_MASK_AT + 1:])
    else:
        node.kwargs = {**node.kwargs, "attn_mask": None}
    with graph.inserting_after(node):
        out = graph.call_function(torch.where, (passes, node, 0.0))
    node.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)
