"""``torch.ops.cgtrees.add_rmsnorm_grouped_mm``: a residual add, the RMSNorm after it and the one-row
GEMVs that read the norm (a Llama layer's q, k and v projections) in one Triton launch;
``torch.ops.cgtrees.add_rmsnorm_mm_silu_mul``: the same prologue before the MLP's gate and up GEMVs
and their SiLU-and-multiply (``gemv_silu_mul``'s epilogue).

A Llama decode step computes ``h = residual + attn_out``, ``n = rmsnorm(h) * weight`` and then
``n @ w.t()`` for q, k and v. Unfused, that is one reduction kernel that writes ``h`` (the residual
stream, read again after the block) and ``n``, then ``grouped_mm`` reads ``n`` back: two launches.
Here every program loads the row (``hidden`` is a few thousand: one block, ``BLOCK_K`` >= K),
computes ``h`` and ``n`` in float32 registers, and multiplies ``n`` by its ``BLOCK_N`` rows of one
weight; program 0 also writes ``h``. Each program reads the row again, from the L2 cache: that is
the price of the launch saved, and ``rmsnorm_gemms`` times both forms on the device to decide.

The prologue rounds where eager does. Eager's bf16 (or fp16) chain rounds the add to bf16, casts
to float32 for ``pow``, ``mean``, ``+ eps``, ``rsqrt`` and the product with ``h``, rounds that to bf16,
and rounds its product with the bf16 weight: ``add_rmsnorm`` does the same roundings in float32
registers (float32 models round nowhere). Triton's interpreter truncates a float32 -> bfloat16 cast,
so there the rounding is done on the bits (``gemv_silu_mul_kernels.rounded``).

Generated modules that call the op import this module, which registers it.
"""

from __future__ import annotations

import torch
import triton

from cgtrees.codegen import interp, pdl

MAX_WEIGHTS = 3
MAX_HIDDEN = 8192  # the row is one block of registers


def _kernels():
    """The kernels' module, imported at the first launch (``gemv_add_rmsnorm_kernels``)."""
    from cgtrees.codegen import gemv_add_rmsnorm_kernels

    return gemv_add_rmsnorm_kernels




def launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
           weights: list[torch.Tensor], outs: list[torch.Tensor], h: torch.Tensor | None, block_n: int,
           warps: int) -> None:
    """``h = x + residual`` (where ``residual`` is given), ``n = rmsnorm(h) * norm_weight`` and
    ``outs[i] = n @ weights[i].t()``: x, residual and h one contiguous row of K, each weight [N_i, K]."""
    k = x.numel()
    ws, ys = list(weights), list(outs)
    ns = [w.shape[0] for w in ws] + [0] * (MAX_WEIGHTS - len(ws))
    ws += [ws[-1]] * (MAX_WEIGHTS - len(ws))
    ys += [ys[-1]] * (MAX_WEIGHTS - len(ys))
    grid = (sum(triton.cdiv(n, block_n) for n in ns),)
    add, early = residual is not None, pdl.on(x.device)
    _kernels().add_rmsnorm_gemv_row_kernel[grid](
        x, residual if add else x, norm_weight, *ws, *ys, h if add else ys[0], *ns, eps, K=k, BLOCK_N=block_n,
        BLOCK_K=triton.next_power_of_2(k), ADD=add, PDL=early, INTERPRET=interp.active(), num_warps=warps,
        launch_pdl=early)


def launch_silu_mul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    w_gate: torch.Tensor, w_up: torch.Tensor, out: torch.Tensor, h: torch.Tensor | None,
                    block_n: int, warps: int) -> None:
    """``h = x + residual`` (where given), ``n = rmsnorm(h) * norm_weight`` and
    ``out = silu(n @ w_gate.t()) * (n @ w_up.t())``: rows as ``launch``'s, the weights [N, K]."""
    k, n = x.numel(), w_gate.shape[0]
    add, early = residual is not None, pdl.on(x.device)
    _kernels().add_rmsnorm_gemv_silu_mul_row_kernel[(triton.cdiv(n, block_n),)](
        x, residual if add else x, norm_weight, w_gate, w_up, out, h if add else out, n, eps, K=k, BLOCK_N=block_n,
        BLOCK_K=triton.next_power_of_2(k), ADD=add, PDL=early, INTERPRET=interp.active(), num_warps=warps,
        launch_pdl=early)


def launch_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       h: torch.Tensor | None, n: torch.Tensor) -> None:
    """The prologue alone, one launch (the unfused form's first)."""
    k = x.numel()
    add = residual is not None
    _kernels().add_rmsnorm_kernel[(1,)](x, residual if add else x, norm_weight, h if add else n, n, eps, K=k,
                                        BLOCK_K=triton.next_power_of_2(k), ADD=add, INTERPRET=interp.active(),
                                        num_warps=8 if k >= 2048 else 4)


def add_rmsnorm_grouped_mm_direct(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                                  weights: list[torch.Tensor], block_n: int, warps: int) -> list[torch.Tensor]:
    """``[n @ w.t() for w in weights]`` of ``n = rmsnorm(x + residual) * norm_weight``, and then
    ``x + residual`` itself where ``residual`` is given (x one row of K, in any shape)."""
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    weights = [w.contiguous() for w in weights]
    outs = [torch.empty((1, w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    h = torch.empty_like(x) if residual is not None else None
    launch(x, residual, norm_weight.contiguous(), eps, weights, outs, h, block_n, warps)
    return outs if h is None else [*outs, h]


add_rmsnorm_grouped_mm = torch.library.custom_op("cgtrees::add_rmsnorm_grouped_mm", add_rmsnorm_grouped_mm_direct,
                                                 mutates_args=())


def add_rmsnorm_mm_silu_mul_direct(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                                   eps: float, w_gate: torch.Tensor, w_up: torch.Tensor, block_n: int,
                                   warps: int) -> list[torch.Tensor]:
    """``silu(n @ w_gate.t()) * (n @ w_up.t())`` of ``n = rmsnorm(x + residual) * norm_weight``, and then
    ``x + residual`` itself where ``residual`` is given (x one row of K, in any shape)."""
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    out = torch.empty((1, w_gate.shape[0]), dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else None
    launch_silu_mul(x, residual, norm_weight.contiguous(), eps, w_gate.contiguous(), w_up.contiguous(), out, h,
                    block_n, warps)
    return [out] if h is None else [out, h]


add_rmsnorm_mm_silu_mul = torch.library.custom_op("cgtrees::add_rmsnorm_mm_silu_mul", add_rmsnorm_mm_silu_mul_direct,
                                                  mutates_args=())


@add_rmsnorm_mm_silu_mul.register_fake
def _(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, w_gate: torch.Tensor,
      w_up: torch.Tensor, block_n: int, warps: int) -> list[torch.Tensor]:
    out = x.new_empty((1, w_gate.shape[0]))
    return [out] if residual is None else [out, x.new_empty(x.shape)]


@add_rmsnorm_grouped_mm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
      weights: list[torch.Tensor], block_n: int, warps: int) -> list[torch.Tensor]:
    outs = [x.new_empty((1, w.shape[0])) for w in weights]
    return outs if residual is None else [*outs, x.new_empty(x.shape)]
