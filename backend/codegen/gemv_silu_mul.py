"""``torch.ops.cgtrees.mm_silu_mul``: ``silu(x @ w_gate.t()) * (x @ w_up.t())`` in one Triton launch.

A Llama MLP's gate and up projections read one input, and the only reader of their products is the
SiLU-and-multiply that feeds the down projection. Grouped (``grouped_gemv``), they are one launch
that writes two products of the intermediate size, and a pointwise kernel reads both back to write
a third; here each program owns ``BLOCK_N`` rows of both weights, walks K once for the two, and
applies the SiLU-and-multiply to its two sums before one store: a launch and two round trips of the
products through memory fewer (``gate_up_gemms`` decides, by timing, where a graph calls it).

The epilogue rounds where eager does. Eager's bf16 (or fp16) MLP rounds each product to bf16
(``mm``), computes the SiLU in float32 (``silu`` upcasts, or the graph's explicit ``_to_copy``) and
rounds it to bf16, and rounds the product of the two bf16 values: ``silu_mul`` does the same
roundings, in float32 registers. Triton's interpreter truncates a float32 -> bfloat16 cast, so there
the rounding to nearest even is done on the bits (``ops.py``'s ``to_bf16`` does the same).

Two kernels: ``gemv_row_silu_mul_kernel`` for one row (a ``[BLOCK_N, BLOCK_K]`` float32 tile of
products per weight, summed once after the walk over K, as ``grouped_gemv.gemv_row_kernel``), and
``gemv_rows_silu_mul_kernel`` for a few rows (summed over K at each step, by ``tl.dot`` where
``DOT``). ``silu_mul_kernel`` is the pointwise SiLU-and-multiply alone, the unfused form's second
launch that the fused form is timed against.

Generated modules that call the op import this module, which registers it.
"""

from __future__ import annotations

import torch
import triton

from cgtrees.codegen import interp, pdl

POINTWISE_BLOCK = 1024  # silu_mul_kernel's elements a program


def _kernels():
    """The kernels' module, imported at the first launch (``gemv_silu_mul_kernels``)."""
    from cgtrees.codegen import gemv_silu_mul_kernels

    return gemv_silu_mul_kernels




def launch(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, out: torch.Tensor, block_n: int,
           block_k: int, warps: int) -> None:
    """``out = silu(x @ w_gate.t()) * (x @ w_up.t())``; x [M, K], the weights [N, K], out [M, N], row-major."""
    m, k = x.shape
    n = w_gate.shape[0]
    grid = (triton.cdiv(n, block_n),)
    if m == 1:
        early = pdl.on(x.device)
        _kernels().gemv_row_silu_mul_kernel[grid](x, w_gate, w_up, out, n, K=k, BLOCK_N=block_n, BLOCK_K=block_k,
                                                  PDL=early, INTERPRET=interp.active(), num_warps=warps,
                                                  launch_pdl=early)
        return
    # float32 through tl.dot would round to tf32; the interpreter computes a bfloat16 tl.dot wrongly
    dot = x.dtype != torch.float32 and not (interp.active() and x.dtype == torch.bfloat16)
    block_m = max(16, triton.next_power_of_2(m)) if dot else triton.next_power_of_2(m)
    _kernels().gemv_rows_silu_mul_kernel[grid](x, w_gate, w_up, out, n, M=m, K=k, BLOCK_M=block_m, BLOCK_N=block_n,
                                               BLOCK_K=block_k, DOT=dot, INTERPRET=interp.active(),
                                               num_warps=warps)


def launch_silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    """``out = silu(gate) * up`` of contiguous products, one pointwise launch (the unfused form's)."""
    numel = out.numel()
    grid = (triton.cdiv(numel, POINTWISE_BLOCK),)
    _kernels().silu_mul_kernel[grid](gate, up, out, numel, BLOCK=POINTWISE_BLOCK, INTERPRET=interp.active(),
                                     num_warps=4)


def mm_silu_mul_direct(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, block_n: int, block_k: int,
                       warps: int) -> torch.Tensor:
    """``silu(x @ w_gate.t()) * (x @ w_up.t())`` in one launch (x [M, K], the weights [N, K], row-major),
    rounded as eager rounds it."""
    x, w_gate, w_up = x.contiguous(), w_gate.contiguous(), w_up.contiguous()
    out = torch.empty((x.shape[0], w_gate.shape[0]), dtype=x.dtype, device=x.device)
    launch(x, w_gate, w_up, out, block_n, block_k, warps)
    return out


mm_silu_mul = torch.library.custom_op("cgtrees::mm_silu_mul", mm_silu_mul_direct, mutates_args=())


@mm_silu_mul.register_fake
def _(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, block_n: int, block_k: int,
      warps: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], w_gate.shape[0]))
