"""The Triton kernel of ``decode_attention`` (which see), in a module of its own: Triton decides
interpreted or compiled when a function is decorated, and a CPU process turns its interpreter on
(``interp.enable``) after codegen imported ``decode_attention``, so this module is imported at the
first launch. ``decode_attention_kernel`` reads pid -> its query rows -> a walk over its slice of the
cache (scores, mask, an online softmax, the weighted values) -> one store; ``combine_kernel`` adds the
slices up where the cache is split.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from cgtrees.codegen.gemv_silu_mul_kernels import rounded


@triton.jit
def _product(a, b, DOT: tl.constexpr):
    """``a @ b`` of [M, K] and [K, N] in float32: ``tl.dot`` where ``DOT`` (float32 operands in full
    precision, not rounded to tf32), else summed products (the interpreter's form)."""
    if DOT and a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    elif DOT:
        out = tl.dot(a, b)
    else:
        out = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return out


@triton.jit
def decode_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, part_ptr, cos_ptr, sin_ptr, scale,
                            sq_b, sq_h, sq_l, sq_d, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d,
                            sm_b, sm_h, sm_l, sm_k, so_b, so_h, so_l, so_d, sc_b, sc_h, sc_l, sc_d,
                            ss_b, ss_h, ss_l, ss_d,
                            L: tl.constexpr, L_SPLIT: tl.constexpr, SPLITS: tl.constexpr, HKV: tl.constexpr,
                            R: tl.constexpr, LQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_DV: tl.constexpr, MASK: tl.constexpr, ROPE: tl.constexpr, DOT: tl.constexpr,
                            PDL: tl.constexpr, INTERPRET: tl.constexpr):
    """One program a (batch, KV head) and slice of ``L_SPLIT`` cached positions: its R query heads x
    LQ positions are the rows (row = r * LQ + lq), every one of them attends over the same keys and
    values. ``MASK``: 0 none, 1 a boolean keep-mask, 2 a float mask added to the scores. ``ROPE``: q
    is rotated as it is loaded (``codegen/rope.py``), by ``cos`` and ``sin`` laid out as q. With one
    slice the program writes the output; with more, its running maximum, sum and weighted values go
    to the workspace (``part_ptr``: [programs, SPLITS, BLOCK_M, 2 + BLOCK_DV] float32) for
    ``combine_kernel``."""
    if PDL:  # the next kernel may start now; the cache is the previous kernel's: wait for it
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    g = pid % HKV
    rm = tl.arange(0, BLOCK_M)
    in_m = rm < R * LQ
    h = g * R + rm // LQ
    lq = rm % LQ
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    in_q = in_m[:, None] & (rd[None, :] < D)
    q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + lq[:, None] * sq_l + rd[None, :] * sq_d, mask=in_q, other=0.0)
    if ROPE:  # q arrives unrotated: q * cos + rotate_half(q) * sin, rounded where eager rounds
        partner = tl.where(rd < D // 2, rd + D // 2, rd - D // 2)
        swapped = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + lq[:, None] * sq_l + partner[None, :] * sq_d,
                          mask=in_q, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + b * sc_b + h[:, None] * sc_h + lq[:, None] * sc_l + rd[None, :] * sc_d, mask=in_q,
                      other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + b * ss_b + h[:, None] * ss_h + lq[:, None] * ss_l + rd[None, :] * ss_d, mask=in_q,
                      other=0.0).to(tl.float32)
        rotated = tl.where(rd[None, :] < D // 2, -swapped, swapped)
        q = rounded(rounded(q.to(tl.float32) * cos, q.dtype, INTERPRET) + rounded(rotated * sin, q.dtype, INTERPRET),
                    q.dtype, INTERPRET).to(q.dtype)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for step in range(0, L_SPLIT, BLOCK_L):
        rl = split * L_SPLIT + step + tl.arange(0, BLOCK_L)
        in_l = rl < L
        kt = tl.load(k_ptr + b * sk_b + g * sk_h + rl[None, :] * sk_l + rd[:, None] * sk_d,
                     mask=in_l[None, :] & (rd[:, None] < D), other=0.0)  # [BLOCK_D, BLOCK_L]: K transposed
        v = tl.load(v_ptr + b * sv_b + g * sv_h + rl[:, None] * sv_l + rdv[None, :] * sv_d,
                    mask=in_l[:, None] & (rdv[None, :] < DV), other=0.0)  # with K: both reads in flight
        s = _product(q, kt, DOT) * scale
        keep = in_m[:, None] & in_l[None, :]
        m_offs = b * sm_b + h[:, None] * sm_h + lq[:, None] * sm_l + rl[None, :] * sm_k
        if MASK == 1:
            keep = keep & (tl.load(mask_ptr + m_offs, mask=keep, other=0) != 0)
        if MASK == 2:
            s += tl.load(mask_ptr + m_offs, mask=keep, other=0.0).to(tl.float32)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key kept yet: nothing to rescale
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _product(p.to(v.dtype), v, DOT)
        m_i = m_new
    if SPLITS == 1:
        out = acc / l_i[:, None]  # a row with no key kept: 0 / 0, as eager's softmax over -inf gives NaN
        tl.store(o_ptr + b * so_b + h[:, None] * so_h + lq[:, None] * so_l + rdv[None, :] * so_d,
                 out.to(o_ptr.dtype.element_ty), mask=in_m[:, None] & (rdv[None, :] < DV))
    else:
        part = part_ptr + ((pid * SPLITS + split) * BLOCK_M + rm) * (2 + BLOCK_DV)
        tl.store(part, m_i)
        tl.store(part + 1, l_i)
        tl.store(part[:, None] + 2 + rdv[None, :], acc)


@triton.jit
def combine_kernel(part_ptr, o_ptr, so_b, so_h, so_l, so_d, HKV: tl.constexpr, R: tl.constexpr,
                   LQ: tl.constexpr, DV: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr):
    """One query row's partial softmaxes, every slice's at once: each rescaled to the largest running
    maximum, their weighted values and sums added, the one divided by the other."""
    if PDL:  # the slices are the previous kernel's: wait for them
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    row = tl.program_id(1)
    if row < R * LQ:
        b = pid // HKV
        h = (pid % HKV) * R + row // LQ
        lq = row % LQ
        rs = tl.arange(0, BLOCK_S)
        in_s = rs < SPLITS
        rdv = tl.arange(0, BLOCK_DV)
        part = part_ptr + ((pid * SPLITS + rs) * BLOCK_M + row) * (2 + BLOCK_DV)  # [BLOCK_S] slices
        m = tl.load(part, mask=in_s, other=float("-inf"))
        top = tl.max(m, axis=0)
        weight = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))
        total = tl.sum(tl.load(part + 1, mask=in_s, other=0.0) * weight, axis=0)
        acc = tl.load(part[:, None] + 2 + rdv[None, :], mask=in_s[:, None], other=0.0)
        out = tl.sum(acc * weight[:, None], axis=0) / total
        tl.store(o_ptr + b * so_b + h * so_h + lq * so_l + rdv * so_d, out.to(o_ptr.dtype.element_ty), mask=rdv < DV)
