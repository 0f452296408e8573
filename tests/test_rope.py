"""``codegen/rope.py`` finds Hugging Face's rotary embedding in an aten graph: the traced
``apply_rotary_pos_emb`` matches for q and for k (x, cos, sin and the nodes that compute it); a
rotation by other halves, a product in mixed dtypes or a sum with ``alpha`` does not."""

from __future__ import annotations

import torch
from codegen_helpers import trace

from cgtrees.codegen import rope


def _rotate(x, cos, sin, half):
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _adds(gm):
    return gm.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)


def test_hugging_faces_rotation_matches_for_q_and_k():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(1, 4, 1, 16, dtype=torch.bfloat16), torch.randn(1, 2, 1, 16, dtype=torch.bfloat16)
    cos, sin = torch.randn(1, 1, 16, dtype=torch.bfloat16), torch.randn(1, 1, 16, dtype=torch.bfloat16)
    gm = trace(lambda q, k, cos, sin: apply_rotary_pos_emb(q, k, cos, sin), q, k, cos, sin)
    found = [rope.match(n) for n in _adds(gm)]
    assert [(r.x.name, r.cos.name, r.sin.name, len(r.chain)) for r in found] == [
        ("q_1", "unsqueeze", "unsqueeze_1", 7), ("k_1", "unsqueeze", "unsqueeze_1", 7)]


def test_other_forms_do_not_match():
    x, cos, sin = torch.randn(2, 12), torch.randn(12), torch.randn(12)
    assert rope.match(_adds(trace(lambda x, c, s: _rotate(x, c, s, 6), x, cos, sin))[0]) is not None
    assert rope.match(_adds(trace(lambda x, c, s: _rotate(x, c, s, 4), x, cos, sin))[0]) is None  # not halves
    mixed = trace(lambda x, c, s: _rotate(x, c, s, 6), x.bfloat16(), cos, sin)  # bf16 x by float32 cos
    assert all(rope.match(n) is None for n in _adds(mixed))
    alpha = trace(lambda x, c, s: torch.add(x * c, torch.cat((-x[..., 6:], x[..., :6]), -1) * s, alpha=2), x, cos, sin)
    assert all(rope.match(n) is None for n in _adds(alpha))
