"""A Llama layer's residual add and RMSNorm folded into the one-row GEMVs that read the norm, on the
GPU (issue 55): q/k/v (``add_rmsnorm_grouped_mm``) and gate/up with the SiLU-and-multiply
(``add_rmsnorm_mm_silu_mul``) of a 1.1B Llama's decode step (TinyLlama: bf16, hidden 2048, q/k/v
2048|256|256, intermediate 5632), each against its unfused form (the add-and-norm kernel, then
``grouped_mm`` or ``mm_silu_mul``), as ``backend/codegen/rmsnorm_gemms.py`` times them at compile time.

    python benchmarks/probes/probe_add_rmsnorm_gemv.py [--out probe.json]

The two graphs are compiled with ``gemm_decisions=measure``: every form is timed by
``gemm_timing.time_us`` (a CUDA graph of back-to-back calls, the weights rotating through copies
twice the L2 cache), and the header lines of the modules hold the figures; this prints them.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from cgtrees import codegen
from cgtrees.aot.decompositions import decomposition_table
from cgtrees.config import Config
from cgtrees.context import GraphContext

HIDDEN, QKV, INTERMEDIATE, EPS = 2048, (2048, 256, 256), 5632, 1e-5


def rmsnorm(h, weight):
    h32 = h.to(torch.float32)
    return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


def qkv_layer(residual, attn_out, norm_weight, wq, wk, wv):
    h = residual + attn_out
    n = rmsnorm(h, norm_weight).view(-1, HIDDEN)
    return n @ wq.t(), n @ wk.t(), n @ wv.t(), h


def mlp_layer(residual, attn_out, norm_weight, w_gate, w_up, w_down):
    h = residual + attn_out
    n = rmsnorm(h, norm_weight).view(-1, HIDDEN)
    return (F.silu(n @ w_gate.t()) * (n @ w_up.t())) @ w_down.t(), h


def choices(fn, *args) -> list[str]:
    gm = make_fx(fn, decomposition_table=decomposition_table(), tracing_mode="fake")(*args)
    ctx = GraphContext(Config(gemm_decisions="measure"), "inference", fn.__name__)
    return list(codegen.compile_graph(gm, list(args), ctx).graph.gemm_choices)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    a = p.parse_args()
    kw = dict(device="cuda", dtype=torch.bfloat16)
    rows = [torch.randn(1, 1, HIDDEN, **kw), torch.randn(1, 1, HIDDEN, **kw), torch.ones(HIDDEN, **kw)]
    lines = {
        "qkv": choices(qkv_layer, *rows, *(torch.randn(n, HIDDEN, **kw) / 45 for n in QKV)),
        "mlp": choices(mlp_layer, *rows, torch.randn(INTERMEDIATE, HIDDEN, **kw) / 45,
                       torch.randn(INTERMEDIATE, HIDDEN, **kw) / 45, torch.randn(HIDDEN, INTERMEDIATE, **kw) / 75),
    }
    print(torch.cuda.get_device_name())
    for name, cs in lines.items():
        print(f"{name}:")
        for c in cs:
            print(f"  {c}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "choices": lines}, f, indent=1)


if __name__ == "__main__":
    main()
