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

import functools

import torch
import triton
import triton.language as tl

from cgtrees.codegen import interp

MAX_WEIGHTS = 3
SUM_BLOCK = 1024  # split_sum_kernel's elements a program


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


@functools.cache
def _row_kernels():
    """``gemv_row_kernel`` and ``split_sum_kernel``, decorated at their first launch (as ``_kernel``)."""

    @triton.jit
    def gemv_row_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, y0_ptr, y1_ptr, y2_ptr, part_ptr, N0, N1, N2,
                        K: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        blocks0 = tl.cdiv(N0, BLOCK_N)
        blocks1 = tl.cdiv(N1, BLOCK_N)
        w_ptr, y_ptr, n, block, first = w0_ptr, y0_ptr, N0, pid, 0  # which weight this program's rows are of
        if pid >= blocks0 + blocks1:
            w_ptr, y_ptr, n, block, first = w2_ptr, y2_ptr, N2, pid - blocks0 - blocks1, N0 + N1
        elif pid >= blocks0:
            w_ptr, y_ptr, n, block, first = w1_ptr, y1_ptr, N1, pid - blocks0, N0
        rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for step in range(0, K_SPLIT, BLOCK_K):  # this program's slice of K
            k0 = split * K_SPLIT + step
            rk = k0 + tl.arange(0, BLOCK_K)
            if K % BLOCK_K == 0:  # a block is in K or past it: a mask of one value keeps loads wide
                in_k = (k0 < K) & (tl.arange(0, BLOCK_K) >= 0)
            else:
                in_k = rk < K
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < n) & in_k[None, :], other=0.0)
            x = tl.load(x_ptr + rk, mask=in_k, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if SPLIT_K == 1:
            tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < n)
        else:  # the workspace holds [SPLIT_K, N0 + N1 + N2] sums: the weights' rows one after another
            tl.store(part_ptr + split * (N0 + N1 + N2) + first + rn, y, mask=rn < n)

    @triton.jit
    def split_sum_kernel(part_ptr, y0_ptr, y1_ptr, y2_ptr, N0, N1, N2, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        total = N0 + N1 + N2
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for split in range(SPLIT_K):
            acc += tl.load(part_ptr + split * total + offs, mask=offs < total, other=0.0)
        tl.store(y0_ptr + offs, acc.to(y0_ptr.dtype.element_ty), mask=offs < N0)
        tl.store(y1_ptr + (offs - N0), acc.to(y1_ptr.dtype.element_ty), mask=(offs >= N0) & (offs < N0 + N1))
        tl.store(y2_ptr + (offs - N0 - N1), acc.to(y2_ptr.dtype.element_ty), mask=(offs >= N0 + N1) & (offs < total))

    return gemv_row_kernel, split_sum_kernel


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
    _kernel()[(blocks,)](x, *ws, *ys, *ns, M=m, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot,
                         num_warps=warps)


def _launch_row(x: torch.Tensor, ws: list[torch.Tensor], ys: list[torch.Tensor], ns: list[int], blocks: int,
                block_n: int, block_k: int, warps: int, split_k: int) -> None:
    k = x.shape[1]
    split_k = max(1, min(split_k, triton.cdiv(k, block_k)))  # no slice without a block of K
    k_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k  # a slice: whole blocks of K
    split_k = triton.cdiv(k, k_split)
    row, split_sum = _row_kernels()
    part = torch.empty((split_k, sum(ns)), dtype=torch.float32, device=x.device) if split_k > 1 else ys[0]
    row[(blocks, split_k)](x, *ws, *ys, part, *ns, K=k, K_SPLIT=k_split, BLOCK_N=block_n, BLOCK_K=block_k,
                           SPLIT_K=split_k, num_warps=warps)
    if split_k > 1:
        split_sum[(triton.cdiv(sum(ns), SUM_BLOCK),)](part, *ys, *ns, SPLIT_K=split_k, BLOCK=SUM_BLOCK, num_warps=4)


@torch.library.custom_op("cgtrees::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, weights: list[torch.Tensor], block_n: int, block_k: int,
               warps: int, split_k: int) -> list[torch.Tensor]:
    """``[x @ w.t() for w in weights]`` in one launch, or two where ``split_k`` > 1 (x [M, K], each
    weight [N_i, K], row-major)."""
    x = x.contiguous()
    weights = [w.contiguous() for w in weights]
    outs = [torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    launch(x, weights, outs, block_n, block_k, warps, split_k)
    return outs


@grouped_mm.register_fake
def _(x: torch.Tensor, weights: list[torch.Tensor], block_n: int, block_k: int, warps: int,
      split_k: int) -> list[torch.Tensor]:
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]
