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

Generated modules that call it import this module, which registers the op.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

MAX_WEIGHTS = 3
CONFIGS = ((4, 512, 2), (8, 512, 2), (16, 256, 2), (16, 512, 4), (32, 256, 4), (64, 128, 4))  # BLOCK_N, BLOCK_K, warps


@functools.cache
def _kernel():
    """The kernel, decorated at its first launch: Triton decides interpreted or compiled when a
    function is decorated, and a CPU process turns its interpreter on after codegen imported this
    module (``interp.enable``)."""

    @triton.jit
    def grouped_gemv_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, y0_ptr, y1_ptr, y2_ptr, N0, N1, N2,
                            M: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, DOT: tl.constexpr):
        pid = tl.program_id(0)
        blocks0 = tl.cdiv(N0, BLOCK_N)
        blocks1 = tl.cdiv(N1, BLOCK_N)
        w_ptr, y_ptr, n, block = w0_ptr, y0_ptr, N0, pid  # which weight this program's rows are of
        if pid >= blocks0 + blocks1:
            w_ptr, y_ptr, n, block = w2_ptr, y2_ptr, N2, pid - blocks0 - blocks1
        elif pid >= blocks0:
            w_ptr, y_ptr, n, block = w1_ptr, y1_ptr, N1, pid - blocks0
        rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < n) & (rk[None, :] < K), other=0.0)
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            if DOT:
                acc += tl.dot(x, tl.trans(w))
            else:
                acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        tl.store(y_ptr + rm[:, None] * n + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < n))

    return grouped_gemv_kernel


def launch(x: torch.Tensor, weights: list[torch.Tensor], outs: list[torch.Tensor], block_n: int, block_k: int,
           warps: int) -> None:
    """``outs[i] = x @ weights[i].t()``; x [M, K] and each weight [N_i, K] row-major."""
    m, k = x.shape
    # float32 through tl.dot would round to tf32; Triton's interpreter computes a bfloat16 tl.dot
    # wrongly (numpy has no bfloat16), so it takes the other path there
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    dot = m > 1 and x.dtype != torch.float32 and not (interpreting and x.dtype == torch.bfloat16)
    block_m = max(16, triton.next_power_of_2(m)) if dot else triton.next_power_of_2(m)
    ws, ys = list(weights), list(outs)
    ns = [w.shape[0] for w in ws] + [0] * (MAX_WEIGHTS - len(ws))
    ws += [ws[-1]] * (MAX_WEIGHTS - len(ws))
    ys += [ys[-1]] * (MAX_WEIGHTS - len(ys))
    grid = (sum(triton.cdiv(n, block_n) for n in ns),)
    _kernel()[grid](x, *ws, *ys, *ns, M=m, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot,
                    num_warps=warps)


@torch.library.custom_op("cgtrees::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, weights: list[torch.Tensor], block_n: int, block_k: int,
               warps: int) -> list[torch.Tensor]:
    """``[x @ w.t() for w in weights]`` in one launch (x [M, K], each weight [N_i, K], row-major)."""
    x = x.contiguous()
    weights = [w.contiguous() for w in weights]
    outs = [torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    launch(x, weights, outs, block_n, block_k, warps)
    return outs


@grouped_mm.register_fake
def _(x: torch.Tensor, weights: list[torch.Tensor], block_n: int, block_k: int, warps: int) -> list[torch.Tensor]:
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]
