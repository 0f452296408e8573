"""The Triton kernels of ``grouped_gemv`` (which see), in a module of their own: Triton decides
interpreted or compiled when a function is decorated, and a CPU process turns its interpreter on
(``interp.enable``) after codegen imported ``grouped_gemv``, so this module is imported at the first
launch. ``weight_of`` (which weight a program's rows are of) and ``weight_block`` (the one-row kernels'
weight load) are shared with the fused GEMV kernels.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def weight_of(pid, w0_ptr, w1_ptr, w2_ptr, y0_ptr, y1_ptr, y2_ptr, N0, N1, N2, BLOCK_N: tl.constexpr):
    """Which weight program ``pid``'s rows are of (the programs cover the weights' row blocks one
    weight after another): its pointer, its output's, its rows, the block of them, and its first row
    among all the weights'."""
    blocks0 = tl.cdiv(N0, BLOCK_N)
    blocks1 = tl.cdiv(N1, BLOCK_N)
    w_ptr, y_ptr, n, block, first = w0_ptr, y0_ptr, N0, pid, 0
    if pid >= blocks0 + blocks1:
        w_ptr, y_ptr, n, block, first = w2_ptr, y2_ptr, N2, pid - blocks0 - blocks1, N0 + N1
    elif pid >= blocks0:
        w_ptr, y_ptr, n, block, first = w1_ptr, y1_ptr, N1, pid - blocks0, N0
    return w_ptr, y_ptr, n, block, first


@triton.jit
def grouped_gemv_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, y0_ptr, y1_ptr, y2_ptr, N0, N1, N2,
                        M: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    w_ptr, y_ptr, n, block, _ = weight_of(tl.program_id(0), w0_ptr, w1_ptr, w2_ptr, y0_ptr, y1_ptr, y2_ptr,
                                          N0, N1, N2, BLOCK_N)
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


@triton.jit
def weight_block(w_ptr, rn, in_n, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``rn`` (where ``in_n``) of a [N, K] weight, columns ``k0`` on: zeros past K (all zeros at K)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    if K % BLOCK_K == 0:  # a block is in K or past it: a mask of one value keeps loads wide
        in_k = (k0 < K) & (tl.arange(0, BLOCK_K) >= 0)
    else:
        in_k = rk < K
    return tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)


@triton.jit
def gemv_row_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, y0_ptr, y1_ptr, y2_ptr, part_ptr, N0, N1, N2,
                    K: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the next GEMV may start now: it waits for this one's writes (codegen/pdl.py)
        gdc_launch_dependents()
    split = tl.program_id(1)
    w_ptr, y_ptr, n, block, first = weight_of(tl.program_id(0), w0_ptr, w1_ptr, w2_ptr, y0_ptr, y1_ptr, y2_ptr,
                                              N0, N1, N2, BLOCK_N)
    rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
    w = weight_block(w_ptr, rn, rn < n, split * K_SPLIT, K, BLOCK_K)  # the graph writes no weight
    if PDL:  # x is the previous kernel's: wait for it
        gdc_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in range(0, K_SPLIT, BLOCK_K):  # this program's slice of K, a block of weights ahead
        k0 = split * K_SPLIT + step
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w = weight_block(w_ptr, rn, rn < n, tl.where(step + BLOCK_K < K_SPLIT, k0 + BLOCK_K, K), K, BLOCK_K)
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
