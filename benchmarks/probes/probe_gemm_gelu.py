"""A Linear followed by exact GELU at real sizes (ViT-B/16's and BERT-base's MLP): cuBLAS ``addmm`` then
the GELU kernel, against one Triton GEMM whose epilogue adds the bias and applies GELU before its store,
over a few tile configurations (pointer loads and TMA descriptors). Issue 55, "Fuse across the matmul".

    python benchmarks/probes/probe_gemm_gelu.py [--out probe.json]

Each figure is ``gemm_timing.time_us``'s (a CUDA graph of back-to-back calls, the best replay), the
way the compiler times forms. ``addmm`` alone is the floor the fused form has to approach.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cgtrees.codegen import gemm_timing

SHAPES = {"vit_b16_fc1": (64 * 197, 768, 3072), "bert_base_fc1": (16 * 512, 768, 3072)}
CONFIGS = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (256, 128, 64, 3, 8), (128, 256, 64, 4, 8),
           (128, 256, 128, 2, 8), (128, 128, 128, 3, 8)]


@triton.jit
def _gelu_exact(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def _tile(tile_id, pids_m, pids_n, GROUP_M: tl.constexpr):
    group = tile_id // (GROUP_M * pids_n)
    first_m = group * GROUP_M
    rows = min(pids_m - first_m, GROUP_M)
    return first_m + (tile_id % (GROUP_M * pids_n)) % rows, (tile_id % (GROUP_M * pids_n)) // rows


@triton.jit
def gemm_gelu_ptr(a_ptr, b_ptr, bias_ptr, out_ptr, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, GELU: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]          # a [M, K] row-major
    b_ptrs = b_ptr + offs_n[None, :] * K + offs_k[:, None]          # w [N, K] row-major, read as [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K // BLOCK_K):
        acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    rows_out = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x = (acc + tl.load(bias_ptr + offs_n)[None, :].to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
    if GELU:
        x = _gelu_exact(x)
    mask = (rows_out[:, None] < M) & (cols_out[None, :] < N)
    tl.store(out_ptr + rows_out[:, None] * N + cols_out[None, :], x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm_gelu_tma(a_desc, b_desc, bias_ptr, out_desc, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, GELU: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K // BLOCK_K):
        a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
    x = (acc + bias[None, :].to(tl.float32)).to(out_desc.dtype).to(tl.float32)
    if GELU:
        x = _gelu_exact(x)
    out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], x.to(out_desc.dtype))


@triton.jit
def _store_half(out_desc, bias_ptr, acc, row, col, N, GELU: tl.constexpr):
    cols = col + tl.arange(0, acc.shape[1])
    bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
    x = (acc + bias[None, :].to(tl.float32)).to(out_desc.dtype).to(tl.float32)
    if GELU:
        x = _gelu_exact(x)
    out_desc.store([row, col], x.to(out_desc.dtype))


@triton.jit
def gemm_gelu_persistent(a_desc, b_desc, bias_ptr, out_desc, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
                         GELU: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr):
    start = tl.program_id(0)
    pids_m, pids_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    tiles = pids_m * pids_n
    k_tiles: tl.constexpr = K // BLOCK_K
    epilogue_id = start - PROGRAMS
    for tile_id in tl.range(start, tiles, PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = _tile(tile_id, pids_m, pids_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        epilogue_id += PROGRAMS
        pid_m, pid_n = _tile(epilogue_id, pids_m, pids_n, GROUP_M)
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        acc0, acc1 = tl.split(halves)
        _store_half(out_desc, bias_ptr, acc0, pid_m * BLOCK_M, pid_n * BLOCK_N, N, GELU)
        _store_half(out_desc, bias_ptr, acc1, pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2, N, GELU)


def fused_persistent(x, w, bias, out, cfg, gelu=True, flatten=True, ws=False):
    from triton.tools.tensor_descriptor import TensorDescriptor
    bm, bn, bk, stages, warps = cfg
    m, k = x.shape
    n = w.shape[0]
    a_d = TensorDescriptor.from_tensor(x, [bm, bk])
    b_d = TensorDescriptor.from_tensor(w, [bn, bk])
    o_d = TensorDescriptor.from_tensor(out, [bm, bn // 2])
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = min(sms, triton.cdiv(m, bm) * triton.cdiv(n, bn))
    return lambda: gemm_gelu_persistent[(programs,)](a_d, b_d, bias, o_d, m, n, K=k, BLOCK_M=bm, BLOCK_N=bn,
                                                      BLOCK_K=bk, GROUP_M=8, PROGRAMS=programs, GELU=gelu,
                                                      FLATTEN=flatten, WS=ws, num_stages=stages, num_warps=warps)


def fused_ptr(x, w, bias, out, cfg, gelu=True):
    bm, bn, bk, stages, warps = cfg
    m, k = x.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    return lambda: gemm_gelu_ptr[grid](x, w, bias, out, m, n, K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                       GELU=gelu, num_stages=stages, num_warps=warps)


def fused_tma(x, w, bias, out, cfg, gelu=True):
    from triton.tools.tensor_descriptor import TensorDescriptor
    bm, bn, bk, stages, warps = cfg
    m, k = x.shape
    n = w.shape[0]
    a_d = TensorDescriptor.from_tensor(x, [bm, bk])
    b_d = TensorDescriptor.from_tensor(w, [bn, bk])
    o_d = TensorDescriptor.from_tensor(out, [bm, bn])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    return lambda: gemm_gelu_tma[grid](a_d, b_d, bias, o_d, m, n, K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                       GROUP_M=8, GELU=gelu, num_stages=stages, num_warps=warps)


def _row(name: str, m: int, k: int, n: int, dev: torch.device) -> dict:
    torch.manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    ref = F.gelu(torch.addmm(bias, x, w.t()))
    scratch = torch.empty_like(out)
    row = {"addmm": gemm_timing.time_us(f"{name}-addmm", dev, lambda: lambda: torch.addmm(bias, x, w.t())),
           "addmm+gelu": gemm_timing.time_us(f"{name}-addmm-gelu", dev,
                                             lambda: lambda: F.gelu(torch.addmm(bias, x, w.t())))}
    row["gelu alone"] = gemm_timing.time_us(f"{name}-gelu", dev, lambda: lambda: F.gelu(out))
    row["copy"] = gemm_timing.time_us(f"{name}-copy", dev, lambda: lambda: scratch.copy_(out))
    forms = (("tma", fused_tma), ("persistent", fused_persistent),
             ("persistent-noflat", lambda *a: fused_persistent(*a, flatten=False)),
             ("persistent-ws", lambda *a: fused_persistent(*a, ws=True)),
             ("persistent-nogelu", lambda *a: fused_persistent(*a, gelu=False)))
    for kind, make in forms:
        for cfg in CONFIGS:
            label = f"{kind} {'x'.join(map(str, cfg[:3]))} s{cfg[3]} w{cfg[4]}"
            try:
                launch = make(x, w, bias, out, cfg)
                launch()
                torch.cuda.synchronize()
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                row[label] = round(gemm_timing.time_us(f"{name}-{label}", dev, lambda launch=launch: launch), 2)
                row[label + " err"] = err
            except Exception as e:  # a configuration that does not fit (shared memory) or compile
                row[label] = f"{type(e).__name__}: {str(e)[:120]}"
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device("cuda")
    results = {"gpu": torch.cuda.get_device_name(), "shapes": {}}
    for name, (m, k, n) in SHAPES.items():
        row = _row(name, m, k, n, dev)
        results["shapes"][name] = row
        best = min((v, k_) for k_, v in row.items() if isinstance(v, float) and k_ not in ("addmm", "addmm+gelu")
                   and not k_.endswith("err") and k_ not in ("gelu alone", "copy") and "nogelu" not in k_)
        print(f"{name} [{m}, {k}] x [{k}, {n}]: addmm {row['addmm']:.1f} us, addmm+gelu {row['addmm+gelu']:.1f} us, "
              f"best fused {best[1]} {best[0]:.1f} us", flush=True)
        for k_, v in row.items():
            print(f"   {k_}: {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
