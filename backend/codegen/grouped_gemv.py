"""``torch.ops.cgtrees.grouped_mm``: products of one input with up to three weights, one Triton launch.

A decode step multiplies a few rows (batch x new tokens) by weights of thousands of rows: each GEMM
reads its weight once and is bound by memory, and a small one by its launch. cuBLAS runs each as a
kernel of its own at ~5 us however small (an H200, bf16, one row: q 2048 x 2048 in 5.2 us, k and v
2048 x 256 in 5.2 us each), so the q, k and v projections of a layer, which read the same input,
cost 15.5 us where one kernel over the three weights costs 5 (``benchmarks/probes/
probe_decode_kernels.py``). This op computes ``[x @ w.t() for w in weights]`` in one launch: each
program owns ``BLOCK_N`` rows of one weight and walks K, so every weight byte is read once; rows of x
are few, broadcast against the weight tile and summed (under 16 rows, ``DOT`` off) or multiplied by
``tl.dot`` (``DOT`` on: rows padded to 16). ``shared_input_gemms`` decides, by timing against cuBLAS
on the device, where a graph calls it and with which block sizes.

One row (batch 1) has a kernel of its own, ``gemv_row_kernel``: a program keeps a ``[BLOCK_N, BLOCK_K]``
float32 tile of products and sums it once, after its walk over K (no reduction inside the loop), and
``SPLIT_K`` programs share one block of rows, each walking a slice of K. A matrix of few rows and a
long K (the down projection, 2048 x 5632) then has enough programs in flight to keep the memory busy;
the slices' float32 sums go to a workspace that ``split_sum_kernel`` adds up in a second launch.

Generated modules that call it import this module, which registers the op.
"""

from __future__ import annotations

import torch
import triton

from cgtrees.codegen import interp, pdl

MAX_WEIGHTS = 3
SUM_BLOCK = 1024  # split_sum_kernel's elements a program


def _kernels():
    """The kernels' module, imported at the first launch (``grouped_gemv_kernels``)."""
    from cgtrees.codegen import grouped_gemv_kernels

    return grouped_gemv_kernels


def launch(x: torch.Tensor, weights: list[torch.Tensor], outs: list[torch.Tensor], block_n: int, block_k: int,
           warps: int, split_k: int = 1) -> None:
    """``outs[i] = x @ weights[i].t()``; x [M, K] and each weight [N_i, K] row-major. ``split_k`` > 1
    (one row only) has that many programs share a block of rows, their sums added by a second launch."""
    m, k = x.shape
    ws, ys = list(weights), list(outs)
    ns = [w.shape[0] for w in ws] + [0] * (MAX_WEIGHTS - len(ws))
    ws += [ws[-1]] * (MAX_WEIGHTS - len(ws))
    ys += [ys[-1]] * (MAX_WEIGHTS - len(ys))
    blocks = sum(triton.cdiv(n, block_n) for n in ns)
    if m == 1:
        _launch_row(x, ws, ys, ns, blocks, block_n, block_k, warps, split_k)
        return
    if split_k != 1:
        raise ValueError(f"cgtrees grouped_mm: split_k={split_k} needs one row, not {m}")
    # float32 through tl.dot would round to tf32; Triton's interpreter computes a bfloat16 tl.dot
    # wrongly (numpy has no bfloat16), so it takes the other path there
    dot = x.dtype != torch.float32 and not (interp.active() and x.dtype == torch.bfloat16)
    block_m = max(16, triton.next_power_of_2(m)) if dot else triton.next_power_of_2(m)
    _kernels().grouped_gemv_kernel[(blocks,)](x, *ws, *ys, *ns, M=m, K=k, BLOCK_M=block_m, BLOCK_N=block_n,
                                              BLOCK_K=block_k, DOT=dot, num_warps=warps)


def _launch_row(x: torch.Tensor, ws: list[torch.Tensor], ys: list[torch.Tensor], ns: list[int], blocks: int,
                block_n: int, block_k: int, warps: int, split_k: int) -> None:
    k = x.shape[1]
    split_k = max(1, min(split_k, triton.cdiv(k, block_k)))  # no slice without a block of K
    k_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k  # a slice: whole blocks of K
    split_k = triton.cdiv(k, k_split)
    kernels = _kernels()
    part = torch.empty((split_k, sum(ns)), dtype=torch.float32, device=x.device) if split_k > 1 else ys[0]
    early = pdl.on(x.device)
    kernels.gemv_row_kernel[(blocks, split_k)](x, *ws, *ys, part, *ns, K=k, K_SPLIT=k_split, BLOCK_N=block_n,
                                               BLOCK_K=block_k, SPLIT_K=split_k, PDL=early, num_warps=warps,
                                               launch_pdl=early)
    if split_k > 1:
        kernels.split_sum_kernel[(triton.cdiv(sum(ns), SUM_BLOCK),)](part, *ys, *ns, SPLIT_K=split_k, BLOCK=SUM_BLOCK,
                                                                    num_warps=4)


def grouped_mm_direct(x: torch.Tensor, weights: list[torch.Tensor], block_n: int, block_k: int,
                      warps: int, split_k: int) -> list[torch.Tensor]:
    """``[x @ w.t() for w in weights]`` in one launch, or two where ``split_k`` > 1 (x [M, K], each
    weight [N_i, K], row-major)."""
    x = x.contiguous()
    weights = [w.contiguous() for w in weights]
    outs = [torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    launch(x, weights, outs, block_n, block_k, warps, split_k)
    return outs


grouped_mm = torch.library.custom_op("cgtrees::grouped_mm", grouped_mm_direct, mutates_args=())


@grouped_mm.register_fake
def _(x: torch.Tensor, weights: list[torch.Tensor], block_n: int, block_k: int, warps: int,
      split_k: int) -> list[torch.Tensor]:
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]
