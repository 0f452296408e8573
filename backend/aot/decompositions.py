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
- nll_loss_forward -> the target's entry of each row as a sum over the row of a one-hot ``where``
  (``nll_loss_picks``), not a ``gather``: codegen reads that sum as the one entry it picks
  (``codegen/one_hot.py``) from the log-softmax's expression, whose statistics it keeps per row, where
  a ``gather`` needs the log-softmax written to memory whole (a float32 per logit).
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

Where no kernel is generated (every tensor on the CPU, without Triton's interpreter: the aten graph
is what runs) the table is empty (``for_inputs``): the graph keeps the ops eager runs (``gelu``, not
its ``tanh``, ``mul`` and ``add``; ``native_layer_norm``, not its ``var_mean``), so a compiled call
costs what eager's does instead of 1.6-1.8x (the demo's block on one CPU thread). AOTAutograd still
traces, functionalizes and partitions it; only the decompositions that serve codegen are left out.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

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


def nll_loss_picks(self, target, weight, reduction, ignore_index):
    """``nll_loss_forward`` (input ``[N, C]`` or ``[C]``, target ``[N]`` or ``[]``) as eager computes
    it: ``-self[n, target[n]] * weight[target[n]]``, 0 where the target is ``ignore_index``, summed
    or averaged over the total weight of the counted rows. The entry is picked by a sum over the
    classes of a one-hot ``where`` whose one-hot is a ``scatter`` of ``True``: codegen checks its
    index is in range (eager raises on a target out of range, as our kernel then does)."""
    channel = 1 if self.dim() == 2 else 0
    valid = target != ignore_index
    safe = torch.where(valid, target, 0).unsqueeze(channel)
    one_hot = torch.zeros_like(self, dtype=torch.bool).scatter(channel, safe, True)
    picked = torch.where(one_hot, self, 0).sum(channel)
    if weight is not None:
        picked = picked * weight[safe.squeeze(channel)]
    result = torch.where(valid, -picked, 0)
    if reduction == 0 and self.dim() == 2:  # 'none'
        return result, self.new_full((), 0.0)
    if weight is not None:
        total = torch.where(valid, weight[safe.squeeze(channel)], 0).sum()
    else:
        total = valid.sum().to(self.dtype)
    result = result.sum()
    return (result / total if reduction == 1 else result), total


def generates_kernels(example_inputs: Sequence[Any], interpret: bool) -> bool:
    """Whether codegen will write kernels for this graph (``codegen._uses_triton``: CUDA tensors, or
    Triton's interpreter)."""
    return interpret or any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)


def for_inputs(example_inputs: Sequence[Any], interpret: bool) -> dict[torch._ops.OpOverload, Callable]:
    """The table for a graph: ours where kernels are generated, else none (what eager would run)."""
    return decomposition_table() if generates_kernels(example_inputs, interpret) else {}


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict[torch._ops.OpOverload, Callable]:
    table = {op: fn for op, fn in core_aten_decompositions().items() if not is_attention(op)}
    table.update(get_decompositions(list(EXTRA_DECOMPOSED)))
    table[aten.convolution.default] = convolution_bias_apart
    table[aten.convolution_backward.default] = convolution_backward_bias_apart
    table[aten.nll_loss_forward.default] = nll_loss_picks
    return table
