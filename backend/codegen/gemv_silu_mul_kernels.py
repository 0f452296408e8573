"""The Triton kernels of ``gemv_silu_mul`` (which see), in a module of their own: Triton decides
interpreted or compiled when a function is decorated, and a CPU process turns its interpreter on
(``interp.enable``) after codegen imported ``gemv_silu_mul``, so this module is imported at the first
launch. Each kernel reads pid -> offsets -> mask -> load -> compute -> store; ``silu_mul`` is the
epilogue, pointwise code on the float32 sums.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from cgtrees.codegen.grouped_gemv_kernels import weight_block


@triton.jit
def rounded(v, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Float32 ``v`` rounded to ``DTYPE`` (to nearest even) and back to float32."""
    if DTYPE == tl.float32:
        out = v
    elif INTERPRET and DTYPE == tl.bfloat16:  # the interpreter's own cast truncates
        bits = v.to(tl.uint32, bitcast=True)
        out = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        out = v.to(DTYPE).to(tl.float32)
    return out


@triton.jit
def silu_mul(gate, up, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """``silu(gate) * up`` of two float32 sums, rounded as eager rounds products of ``DTYPE``."""
    gate = rounded(gate, DTYPE, INTERPRET)
    up = rounded(up, DTYPE, INTERPRET)
    silu = rounded(gate * tl.sigmoid(gate), DTYPE, INTERPRET)
    return rounded(silu * up, DTYPE, INTERPRET).to(DTYPE)


@triton.jit
def gemv_row_silu_mul_kernel(x_ptr, wg_ptr, wu_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, PDL: tl.constexpr, INTERPRET: tl.constexpr):
    if PDL:  # the next GEMV may start now: it waits for this one's writes (codegen/pdl.py)
        gdc_launch_dependents()
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = rn < N
    wg = weight_block(wg_ptr, rn, in_n, 0, K, BLOCK_K)  # the graph writes no weight
    wu = weight_block(wu_ptr, rn, in_n, 0, K, BLOCK_K)
    if PDL:  # x is the previous kernel's: wait for it
        gdc_wait()
    gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # a block of weights ahead
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)[None, :]
        gate += wg.to(tl.float32) * x
        up += wu.to(tl.float32) * x
        wg = weight_block(wg_ptr, rn, in_n, k0 + BLOCK_K, K, BLOCK_K)
        wu = weight_block(wu_ptr, rn, in_n, k0 + BLOCK_K, K, BLOCK_K)
    y = silu_mul(tl.sum(gate, axis=1), tl.sum(up, axis=1), y_ptr.dtype.element_ty, INTERPRET)
    tl.store(y_ptr + rn, y, mask=in_n)


@triton.jit
def gemv_rows_silu_mul_kernel(x_ptr, wg_ptr, wu_ptr, y_ptr, N, M: tl.constexpr, K: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              DOT: tl.constexpr, INTERPRET: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w_mask = (rn[:, None] < N) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        wg = tl.load(wg_ptr + rn[:, None] * K + rk[None, :], mask=w_mask, other=0.0)
        wu = tl.load(wu_ptr + rn[:, None] * K + rk[None, :], mask=w_mask, other=0.0)
        if DOT:
            gate += tl.dot(x, tl.trans(wg))
            up += tl.dot(x, tl.trans(wu))
        else:
            xf = x[:, None, :].to(tl.float32)
            gate += tl.sum(xf * wg[None, :, :].to(tl.float32), axis=2)
            up += tl.sum(xf * wu[None, :, :].to(tl.float32), axis=2)
    y = silu_mul(gate, up, y_ptr.dtype.element_ty, INTERPRET)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def silu_mul_kernel(gate_ptr, up_ptr, y_ptr, numel, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, silu_mul(gate, up, y_ptr.dtype.element_ty, INTERPRET), mask=mask)
