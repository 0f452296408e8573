# ruff: noqa: B023  (each closure is timed before its loop variables change)
"""Decode-shaped kernels on the GPU (issue 45): what cuBLAS and cuDNN give a 1.1B Llama's decode step,
and what a Triton GEMV and a GQA-shaped attention call would give instead.

    python benchmarks/probes/probe_decode_kernels.py [--out probe.json]

Every figure is a kernel's time inside a CUDA graph of ``REPS`` back-to-back calls (graph replay
time / REPS: launch gaps inside a graph count, the host does not), bf16, on TinyLlama's shapes.

1. GEMMs y = x @ W^T for x [M, K], W [N, K] (nn.Linear's layout), M = 1, 8, 32: ``torch.mm`` (cuBLAS)
   against a Triton GEMV (each program owns BLOCK_N rows of W and walks K; M < 16 by broadcast
   and sum, M >= 16 by ``tl.dot``), the best of a few block sizes. q/k/v and gate/up are also
   timed as one GEMM over the concatenated weights (what one kernel reading the input once costs).
2. Attention of one query token against a cache of L (160, 4096) for 32 query heads and 4 KV
   heads: HF's form (K and V expanded to 32 heads and copied, then SDPA) against SDPA on the
   unexpanded cache with the 8 query heads of a group as 8 query rows ([B, 4, 8, 64]: exact when
   each head has one query token), and against ``enable_gqa=True``.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

REPS = 20
HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 2048, 5632, 32000, 32, 4, 64
SHAPES = {  # name -> (N, K)
    "q": (2048, 2048), "k": (256, 2048), "o": (2048, 2048), "gate": (5632, 2048), "down": (2048, 5632),
    "qkv": (2560, 2048), "gate_up": (11264, 2048), "lm_head": (32000, 2048),
}


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w_mask = (rn[:, None] < N) & (rk[None, :] < K)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=w_mask, other=0.0)
        x_mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=x_mask, other=0.0)
        if DOT:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_n: int, block_k: int, warps: int) -> None:
    m, k = x.shape
    n = w.shape[0]
    dot = m >= 16
    block_m = max(16, triton.next_power_of_2(m)) if dot else triton.next_power_of_2(m)
    gemv_kernel[(triton.cdiv(n, block_n),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot,
                                            num_warps=warps)


def graph_us(fn) -> float:
    """Microseconds a call, inside a CUDA graph of REPS calls (median of 5 timed replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    g.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / REPS)
    return sorted(times)[2]


def gemms() -> list[dict]:
    rows = []
    configs = [(bn, bk, w) for bn, bk, w in itertools.product((4, 8, 16, 32, 64), (128, 256, 512), (2, 4, 8))
               if bn * bk <= 16384]
    for (name, (n, k)), m in itertools.product(SHAPES.items(), (1, 8, 32)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        ref = x @ w.t()
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        cublas = graph_us(lambda: torch.mm(x, w.t(), out=y))
        best = (float("inf"), None)
        for bn, bk, warps in configs:
            if m >= 16 and bn < 16:
                continue
            try:
                gemv(x, w, y, bn, bk, warps)
                torch.cuda.synchronize()
                err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
                if err > 2e-2:
                    continue
                us = graph_us(lambda: gemv(x, w, y, bn, bk, warps))
            except Exception as e:  # a config Triton cannot build: skip it
                print(f"  {name} m={m} {bn}x{bk}/{warps}: {type(e).__name__}")
                continue
            best = min(best, (us, (bn, bk, warps)))
        mb = n * k * 2 / 1e6
        row = {"gemm": name, "m": m, "n": n, "k": k, "weight_mb": mb, "cublas_us": cublas, "triton_us": best[0],
               "triton_config": best[1], "cublas_tbs": mb / cublas,
               "triton_tbs": mb / best[0]}
        rows.append(row)
        print(f"{name:8s} m={m:2d} {n:5d}x{k:5d} {mb:6.1f} MB  cublas {cublas:7.2f} us ({row['cublas_tbs']:.2f} TB/s)"
              f"  triton {best[0]:7.2f} us ({row['triton_tbs']:.2f} TB/s) {best[1]}", flush=True)
    return rows


def attention() -> list[dict]:
    rows = []
    group = HEADS // KV_HEADS
    for b, length in itertools.product((1, 8, 32), (160, 4096)):
        q = torch.randn(b, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.zeros(b, 1, 1, length, device="cuda", dtype=torch.bool)
        mask[..., : length - 8] = True

        def expanded():
            ke = k[:, :, None].expand(b, KV_HEADS, group, length, HEAD_DIM).reshape(b, HEADS, length, HEAD_DIM)
            ve = v[:, :, None].expand(b, KV_HEADS, group, length, HEAD_DIM).reshape(b, HEADS, length, HEAD_DIM)
            return F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)

        def grouped():
            out = F.scaled_dot_product_attention(q.view(b, KV_HEADS, group, HEAD_DIM), k, v, attn_mask=mask)
            return out.view(b, HEADS, 1, HEAD_DIM)

        def gqa():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        ref = expanded().float()
        row = {"batch": b, "cache": length}
        for name, fn in (("expanded", expanded), ("grouped", grouped), ("enable_gqa", gqa)):
            try:
                err = float((fn().float() - ref).abs().max() / ref.abs().max())
                row[name] = {"us": graph_us(fn), "rel_err": err}
            except Exception as e:
                row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        rows.append(row)
        print(f"attention b={b:2d} L={length:5d}: " + "  ".join(
            f"{n} {r['us']:.1f} us" if "us" in r else f"{n} {r['error'][:60]}"
            for n, r in row.items() if isinstance(r, dict)), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    a = p.parse_args()
    torch.manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "attention": attention(), "gemms": gemms()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
