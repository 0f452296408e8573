"""The decomposition table: what reaches codegen is torch's core aten op set, minus the composite
normalisations and activations below, which we decompose further so that codegen sees their
pointwise and reduction parts and can fuse them:

- softmax / log_softmax  -> amax, sub, exp, sum, div / log
- layer_norm, batch_norm  -> var_mean (or sum/mean), sub, mul, rsqrt, add
- gelu                    -> erf or tanh, mul, add
- dropout                 -> rand-based mask, mul (the random op itself runs through aten)
- hardtanh / hardsigmoid / hardswish -> clamp, mul, add

Matrix products (mm, addmm, bmm), convolution and attention stay as single aten ops: codegen
calls the vendor library for them.
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


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict[torch._ops.OpOverload, Callable]:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(list(EXTRA_DECOMPOSED)))
    return table
