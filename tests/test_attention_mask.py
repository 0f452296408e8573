"""An attention mask constant along the keys is taken out of the attention (``aot/attention_mask.py``):
the rows it passes get the unmasked attention, the rows it blocks zeros, as torch's attention gives
them; outputs and gradients as eager's. transformers builds such a mask for BERT under
``torch.compile`` (``q_idx >= 0`` broadcast over the keys), and with it torch's fused attention
kernels refuse the mask and the trace takes float32 math attention."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET

from cgtrees.aot.attention_mask import SDPA, take_out_row_masks

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
    torch.testing.assert_close(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)


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
    torch.testing.assert_close(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)
    seen = dict(cgtrees_counters)
    assert seen.get("graph_fallbacks", 0) == 0 and seen.get("kernels_generated", 0) >= 1, seen
