"""A boolean attention mask that does not vary along the keys is taken out of the attention.

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

Runs on the Dynamo graph before AOTAutograd traces it (``driver._compile_missed``). Left alone: a
mask that varies along the keys, a float mask, ``is_causal`` with a mask (an error of torch's
own), anything whose fake value is missing.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

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
