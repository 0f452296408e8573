"""Attention stays one aten op (never decomposed): outputs and gradients equal eager's.

The decomposition of ``_scaled_dot_product_flash_attention_for_cpu`` in torch's core table returns
the attention weights where the op returns its logsumexp; the backward then read them as one and
every transformer trained on CPU got gradients off by 4x to 260x. These tests would have caught it.
"""

import pytest
import torch
import torch.nn.functional as F

from cgtrees.aot.decompositions import decomposition_table, is_attention


def _grads_match(fn, *inputs, atol=1e-5, rtol=1e-4):
    ins = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    ref_ins = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = torch.compile(fn, backend="cgtrees")(*ins)
    ref = fn(*ref_ins)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    weight = torch.randn_like(ref)  # a loss whose gradient is not a multiple of the output
    (out * weight).sum().backward()
    (ref * weight).sum().backward()
    for i, (a, b) in enumerate(zip(ins, ref_ins)):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=atol, rtol=rtol, msg=f"gradient of input {i}")


def test_no_attention_op_is_decomposed():
    assert not [op for op in decomposition_table() if is_attention(op)]


def test_issue_repro_plain_sdpa(cgtrees_counters):
    q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
    _grads_match(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v)
    assert cgtrees_counters["graph_fallbacks"] == 0


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_causal_and_scale(causal):
    q, k, v = (torch.randn(2, 3, 7, 16) for _ in range(3))
    _grads_match(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3), q, k, v)


def test_sdpa_with_mask_and_projection():
    x, w = torch.randn(2, 9, 32), torch.randn(96, 32) * 0.2
    mask = torch.rand(9, 9) > 0.3
    mask |= torch.eye(9, dtype=torch.bool)

    def attend(x, w):
        q, k, v = (x @ w.t()).view(2, 9, 3, 2, 16).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(2, 9, 32).tanh()

    _grads_match(attend, x, w)


def test_sdpa_float_mask_and_grouped_query():
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    bias = torch.randn(5, 5)
    _grads_match(lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b, enable_gqa=True),
                 q, k, v, bias)
