"""The Triton kernels of ``gemv_add_rmsnorm`` (which see), in a module of their own: Triton decides
interpreted or compiled when a function is decorated, and a CPU process turns its interpreter on
(``interp.enable``) after codegen imported ``gemv_add_rmsnorm``, so this module is imported at the
first launch. Each kernel reads pid -> offsets -> mask -> load -> compute -> store; ``add_rmsnorm`` is
the prologue both share, pointwise code on one row held in float32 registers.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from cgtrees.codegen.gemv_silu_mul_kernels import rounded, silu_mul
from cgtrees.codegen.grouped_gemv_kernels import weight_of


@triton.jit
def add_rmsnorm(x_ptr, r_ptr, nw_ptr, rk, in_k, eps, K: tl.constexpr, ADD: tl.constexpr, DTYPE: tl.constexpr,
                INTERPRET: tl.constexpr):
    """(h, n) of one row: ``h = x + r`` (``x`` where not ``ADD``) and ``n = rmsnorm(h) * nw``, float32
    values rounded where eager's ``DTYPE`` chain rounds: the sum, ``h * rsqrt(mean(h^2) + eps)``, the
    product with the norm's weight."""
    h = tl.load(x_ptr + rk, mask=in_k, other=0.0).to(tl.float32)
    if ADD:
        h = rounded(h + tl.load(r_ptr + rk, mask=in_k, other=0.0).to(tl.float32), DTYPE, INTERPRET)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
    nw = tl.load(nw_ptr + rk, mask=in_k, other=0.0).to(tl.float32)
    n = rounded(rounded(h * rstd, DTYPE, INTERPRET) * nw, DTYPE, INTERPRET)
    return h, n


@triton.jit
def add_rmsnorm_gemv_row_kernel(x_ptr, r_ptr, nw_ptr, w0_ptr, w1_ptr, w2_ptr, y0_ptr, y1_ptr, y2_ptr, h_ptr,
                                N0, N1, N2, eps, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                ADD: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr):
    if PDL:  # the next GEMV may start now: it waits for this one's writes (codegen/pdl.py)
        gdc_launch_dependents()
    pid = tl.program_id(0)
    w_ptr, y_ptr, n_rows, block, _ = weight_of(pid, w0_ptr, w1_ptr, w2_ptr, y0_ptr, y1_ptr, y2_ptr, N0, N1, N2,
                                               BLOCK_N)
    rk = tl.arange(0, BLOCK_K)  # the whole row: BLOCK_K >= K
    in_k = rk < K
    rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = rn < n_rows
    w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)  # no writer
    if PDL:  # the row is the previous kernel's: wait for it
        gdc_wait()
    h, n = add_rmsnorm(x_ptr, r_ptr, nw_ptr, rk, in_k, eps, K, ADD, y0_ptr.dtype.element_ty, INTERPRET)
    if ADD:  # the residual stream: program 0 writes it
        tl.store(h_ptr + rk, h.to(h_ptr.dtype.element_ty), mask=in_k & (pid == 0))
    y = tl.sum(w.to(tl.float32) * n[None, :], axis=1)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=in_n)


@triton.jit
def add_rmsnorm_kernel(x_ptr, r_ptr, nw_ptr, h_ptr, n_ptr, eps, K: tl.constexpr, BLOCK_K: tl.constexpr,
                       ADD: tl.constexpr, INTERPRET: tl.constexpr):
    """The prologue alone, one program (the unfused form's first launch, as our codegen's reduction
    kernel computes it)."""
    rk = tl.arange(0, BLOCK_K)
    in_k = rk < K
    h, n = add_rmsnorm(x_ptr, r_ptr, nw_ptr, rk, in_k, eps, K, ADD, n_ptr.dtype.element_ty, INTERPRET)
    if ADD:
        tl.store(h_ptr + rk, h.to(h_ptr.dtype.element_ty), mask=in_k)
    tl.store(n_ptr + rk, n.to(n_ptr.dtype.element_ty), mask=in_k)


@triton.jit
def add_rmsnorm_gemv_silu_mul_row_kernel(x_ptr, r_ptr, nw_ptr, wg_ptr, wu_ptr, y_ptr, h_ptr, N, eps,
                                         K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                         ADD: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr):
    """``silu(n @ w_gate.t()) * (n @ w_up.t())`` of the row's norm ``n`` (a Llama MLP's input)."""
    if PDL:  # the next GEMV may start now: it waits for this one's writes (codegen/pdl.py)
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rk = tl.arange(0, BLOCK_K)  # the whole row: BLOCK_K >= K
    in_k = rk < K
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = rn < N
    mask = in_n[:, None] & in_k[None, :]
    wg = tl.load(wg_ptr + rn[:, None] * K + rk[None, :], mask=mask, other=0.0)  # the graph writes no weight
    wu = tl.load(wu_ptr + rn[:, None] * K + rk[None, :], mask=mask, other=0.0)
    if PDL:  # the row is the previous kernel's: wait for it
        gdc_wait()
    h, n = add_rmsnorm(x_ptr, r_ptr, nw_ptr, rk, in_k, eps, K, ADD, y_ptr.dtype.element_ty, INTERPRET)
    if ADD:  # the residual stream: program 0 writes it
        tl.store(h_ptr + rk, h.to(h_ptr.dtype.element_ty), mask=in_k & (pid == 0))
    gate = tl.sum(wg.to(tl.float32) * n[None, :], axis=1)
    up = tl.sum(wu.to(tl.float32) * n[None, :], axis=1)
    tl.store(y_ptr + rn, silu_mul(gate, up, y_ptr.dtype.element_ty, INTERPRET), mask=in_n)
