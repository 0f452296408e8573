"""The decomposition table: what reaches codegen is torch's core aten op set, minus the composite
normalisations and activations below, which we decompose further so that codegen sees their
pointwise and reduction parts and can fuse them:

- softmax / log_softmax  -> amax, sub, exp, sum, div / log
- layer_norm, batch_norm  -> var_mean (or sum/mean), sub, mul, rsqrt, add
- gelu                    -> erf or tanh, mul, add
- dropout                 -> rand-based mask, mul (the random op itself runs through aten)
- hardtanh / hardsigmoid / hardswish -> clamp, mul, add

- convolution with a bias, on CUDA -> the convolution without it, plus the bias broadcast over the
  batch and spatial dimensions: cuDNN adds a bias with one more aten kernel after the convolution (on
  the H100, 40 kernels and 0.3 ms of convnext_atto's 1.7 ms inference call); our add fuses into the
  convolution's consumers. On CPU the bias stays in the call (mkldnn adds it inside its kernel).
- convolution_backward's bias gradient -> a sum over every dimension but the channels (a fused,
  layout-following reduction of ours), the weight and input gradients staying one aten call: asked
  for the bias gradient too, aten computes it with its own reduction kernel, slow on channels-last
  gradients (on the H100, 0.95 ms of convnext_atto's training step, 40 reductions)

Matrix products (mm, addmm, bmm), convolution and attention stay as single aten ops: codegen
calls the vendor library for them. Attention is taken out of torch's core table on purpose: its
entry for ``_scaled_dot_product_flash_attention_for_cpu`` returns the attention weights where the
op returns the logsumexp, and the backward op then read them as a logsumexp (gradients off by 4x
and more on every transformer trained on CPU). Every entry we keep is checked against eager,
forward and backward, by ``tests/test_grad_sweep.py``.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

aten = torch.ops.aten

EXTRA_DECOMPOSED = (
    aten._softmax,
    aten._log_softmax,
    aten.native_layer_norm,
    aten.native_batch_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
    aten.gelu,
    aten.native_dropout,
    aten.hardtanh,
    aten.hardsigmoid,
    aten.hardswish,
)




def is_attention(op: torch._ops.OpOverload) -> bool:
    """SDPA and its per-backend kernels (flash, efficient, cuDNN, math, CPU flash), forward and backward."""
    name = op.name()
    return name.startswith("aten::_scaled_dot_product") or name.startswith("aten::scaled_dot_product")


def convolution_bias_apart(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """``convolution`` on CUDA with its bias added apart (a broadcast add that codegen fuses);
    NotImplemented (the op as it is) with no bias or on CPU."""
    if bias is None or input.device.type == "cpu":
        return NotImplemented
    out = aten.convolution.default(input, weight, None, stride, padding, dilation, transposed, output_padding,
                                   groups)
    return aten.add.Tensor(out, aten.view.default(bias, [bias.shape[0]] + [1] * (out.dim() - 2)))


def convolution_backward_bias_apart(grad_output, input, weight, bias_sizes, stride, padding, dilation,
                                    transposed, output_padding, groups, output_mask):
    """``convolution_backward`` with its bias gradient (``output_mask[2]``) taken out as a sum of
    ``grad_output`` over the batch and spatial dimensions; NotImplemented (the op as it is) when no
    bias gradient is asked for."""
    if not output_mask[2]:
        return NotImplemented
    grad_bias = aten.sum.dim_IntList(grad_output, [0, *range(2, grad_output.dim())])
    grad_input, grad_weight, _ = aten.convolution_backward.default(
        grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
        [output_mask[0], output_mask[1], False])
    return grad_input, grad_weight, grad_bias


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict[torch._ops.OpOverload, Callable]:
    table = {op: fn for op, fn in core_aten_decompositions().items() if not is_attention(op)}
    table.update(get_decompositions(list(EXTRA_DECOMPOSED)))
    table[aten.convolution.default] = convolution_bias_apart
    table[aten.convolution_backward.default] = convolution_backward_bias_apart
    return table
