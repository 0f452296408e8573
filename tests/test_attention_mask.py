"""An attention mask constant along the keys is taken out of the attention (``aot/attention_mask.py``):
the rows it passes get the unmasked attention, the rows it blocks zeros, as torch's attention gives
them; outputs and gradients as eager's. transformers builds such a mask for BERT under
``torch.compile`` (``q_idx >= 0`` broadcast over the keys), and with it torch's fused attention
kernels refuse the mask and the trace takes float32 math attention. A causal mask computed from no
input (transformers 5.17's for GPT-2 and Llama under ``torch.compile``) becomes ``is_causal``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET

from cgtrees.aot.attention_mask import SDPA, take_out_causal_masks, take_out_row_masks

B, H, L, S, E = 2, 3, 9, 11, 8  # irregular, so that a broadcast the rewrite gets wrong shows


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sin()


def _qkv() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, n, E, generator=g) for n in (L, S, S)]


def _rows() -> torch.Tensor:
    return torch.tensor([True, False, True, True, True, False, True, True, False])  # L rows, three blocked


MASKS = {
    "bool broadcast over keys": lambda: _rows().view(1, 1, L, 1).expand(B, 1, L, S),
    "bool of one column": lambda: _rows().view(L, 1),
}


def _captured(mask: torch.Tensor) -> torch.fx.GraphModule:
    graphs = []

    def keep(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(attend, backend=keep, fullgraph=True)(*_qkv(), mask)
    return graphs[0]


def _same(got: tuple, want: tuple) -> None:
    """Outputs and the gradients of q, k and v as eager's."""
    torch.testing.assert_close(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)


def _run(fn, mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    qkv = [t.clone().requires_grad_() for t in _qkv()]
    out = fn(*qkv, mask)
    out.square().sum().backward()
    return out, [t.grad for t in qkv]


@pytest.mark.parametrize("name", MASKS)
def test_a_mask_constant_along_the_keys_is_taken_out(name):
    mask = MASKS[name]()
    gm = copy.deepcopy(_captured(mask))
    assert take_out_row_masks(gm), gm.code
    (node,) = gm.graph.find_nodes(op="call_function", target=SDPA)
    assert (node.args + (None,) * 4)[3] is None and node.kwargs.get("attn_mask") is None, gm.code
    got, want = _run(lambda *a: gm(*a)[0], mask), _run(attend, mask)
    assert (want[0][:, :, ~_rows()] == 0).all()  # torch's attention: a blocked row is zeros
    _same(got, want)


@pytest.mark.parametrize("which", ["varies along the keys", "float"])
def test_other_masks_stay(which):
    """A mask that varies along the keys; a float one constant along them (its rows of finfo.min
    absorb the scores: eager's attention there is uniform, not the unmasked one)."""
    if which == "float":
        mask = torch.where(_rows(), 0.0, torch.finfo(torch.float32).min).view(1, 1, L, 1).expand(B, H, L, S)
    else:
        mask = torch.rand(L, S, generator=torch.Generator().manual_seed(1)) < 0.7
    gm = _captured(mask)
    before = gm.code
    assert not take_out_row_masks(gm) and gm.code == before


@pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")
def test_compiled_attention_with_a_row_mask_matches_eager(cgtrees_counters):
    mask = MASKS["bool broadcast over keys"]()
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="cgtrees", fullgraph=True, options={"interpret": True})
    got, want = _run(compiled, mask), _run(attend, mask)
    _same(got, want)
    seen = dict(cgtrees_counters)
    assert seen.get("graph_fallbacks", 0) == 0 and seen.get("kernels_generated", 0) >= 1, seen


# ------------------------------------------------------------------------------------- causal masks
def _causal(q: torch.Tensor, k: torch.Tensor, offset: int = 0, window: int | None = None) -> torch.Tensor:
    """The mask a decoder builds from aranges: key j is seen from query i where j <= i + offset."""
    i, j = torch.arange(q.shape[-2], device=q.device), torch.arange(k.shape[-2], device=q.device)
    keep = j[None, :] <= i[:, None] + offset
    if window is not None:
        keep = keep & (j[None, :] > i[:, None] - window)
    return keep[None, None].expand(q.shape[0], 1, q.shape[-2], k.shape[-2])


def causal_attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(q, k), dropout_p=0.0).sin()


def _same_length_qkv() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, S, E, generator=g) for _ in range(3)]


def _captured_fn(fn, *inputs) -> torch.fx.GraphModule:
    graphs = []

    def keep(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*inputs)
    return graphs[0]


def _grads(fn, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.square().sum().backward()
    return out, [t.grad for t in leaves]


def test_a_causal_mask_from_aranges_becomes_is_causal():
    qkv = _same_length_qkv()
    gm = copy.deepcopy(_captured_fn(causal_attend, *qkv))
    assert take_out_causal_masks(gm), gm.code
    (node,) = gm.graph.find_nodes(op="call_function", target=SDPA)
    assert node.kwargs.get("attn_mask") is None and node.kwargs.get("is_causal") is True, node.format_node()
    got, want = _grads(lambda *a: gm(*a)[0], qkv), _grads(causal_attend, qkv)
    _same(got, want)


def _padded(q, k, v, keep):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(q, k) & keep[:, None, None, :])


@pytest.mark.parametrize("which", ["reads an input", "a sliding window", "aligned at the bottom right",
                                   "the last key hidden"])
def test_masks_that_are_not_the_causal_pattern_or_not_constant_stay(which):
    """A padding mask (an input) combined with the causal one; a causal window; queries fewer than
    keys, aligned at the last key (HF's, where torch's ``is_causal`` aligns at the first); a
    pattern that differs from the causal one in one place."""
    qkv = _same_length_qkv()
    if which == "reads an input":
        fn, inputs = _padded, (*qkv, torch.ones(B, S, dtype=torch.bool))
    elif which == "a sliding window":
        fn, inputs = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(q, k, window=3)), qkv
    elif which == "aligned at the bottom right":
        q = qkv[0][:, :, :L]
        fn, inputs = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(q, k, S - L)), \
            (q, *qkv[1:])
    else:
        def fn(q, k, v):
            mask = _causal(q, k).clone()
            mask[..., -1, -1] = False
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        inputs = qkv
    gm = _captured_fn(fn, *inputs)
    before = gm.code
    assert not take_out_causal_masks(gm) and gm.code == before


@pytest.mark.parametrize("use_vmap", [False, True])
def test_transformers_causal_mask_becomes_is_causal_where_built_from_indices(use_vmap):
    """transformers' own ``sdpa_mask`` as a decoder calls it under ``torch.compile`` (no skip): built from
    indices the mask is computed and becomes ``is_causal``; built with vmap (its ``_add_batch_dim`` steps
    at levels that only Dynamo's nesting gives) it stays, and vmap's nesting is as it was."""
    masking = pytest.importorskip("transformers.masking_utils")

    def fn(q, k, v):
        mask = masking.sdpa_mask(batch_size=q.shape[0], q_length=q.shape[-2], kv_length=k.shape[-2],
                                 allow_is_causal_skip=False, use_vmap=use_vmap)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    qkv = _same_length_qkv()
    gm = _captured_fn(fn, *qkv)
    level = torch._C._functorch.maybe_current_level()
    assert take_out_causal_masks(gm) is not use_vmap, gm.code
    assert torch._C._functorch.maybe_current_level() == level
    torch.testing.assert_close(gm(*qkv)[0], fn(*qkv))


@pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")
def test_compiled_attention_with_a_causal_mask_matches_eager(cgtrees_counters):
    qkv = _same_length_qkv()
    torch._dynamo.reset()
    compiled = torch.compile(causal_attend, backend="cgtrees", fullgraph=True, options={"interpret": True})
    got, want = _grads(compiled, qkv), _grads(causal_attend, qkv)
    _same(got, want)
    seen = dict(cgtrees_counters)
    assert seen.get("graph_fallbacks", 0) == 0 and seen.get("kernels_generated", 0) >= 1, seen
