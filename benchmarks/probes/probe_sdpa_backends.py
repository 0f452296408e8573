"""Which of torch's fused attention kernels is fastest, forward and backward, at the real sizes'
attention shapes (issue 55: GPT-2's attention is 4.4 ms of its 20.8 busy ms, cuDNN's, for every
backend). Each backend is forced with ``torch.nn.attention.sdpa_kernel``; CUDA events around 30
calls after 5, bf16.

    python benchmarks/probes/probe_sdpa_backends.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # (batch, heads, tokens, head dim, causal)
    "gpt2_small": (8, 12, 1024, 64, True),
    "bert_base": (16, 12, 512, 64, False),
    "vit_b16": (32, 12, 197, 64, False),
    "llama_1b": (4, 32, 1024, 64, True),
}
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _ms(fn, reps: int = 30) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _row(b: int, h: int, t: int, d: int, causal: bool) -> dict:
    q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for _ in range(3))
    grad = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
    row = {}
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                fwd = _ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                both = _ms(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                                       (q, k, v), grad))
            row[name] = {"forward_ms": round(fwd, 4), "forward_backward_ms": round(both, 4)}
        except RuntimeError as e:
            row[name] = f"{type(e).__name__}: {str(e)[:100]}"
    if causal:  # the same attention with the causal pattern given as a boolean mask (what a traced model may pass)
        mask = torch.ones(t, t, device="cuda", dtype=torch.bool).tril().expand(b, 1, t, t)
        for name in ("cudnn", "flash", "efficient"):
            try:
                with sdpa_kernel([BACKENDS[name]]):
                    fwd = _ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
                    both = _ms(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                                                           (q, k, v), grad))
                row[name + " + bool mask"] = {"forward_ms": round(fwd, 4), "forward_backward_ms": round(both, 4)}
            except RuntimeError as e:
                row[name + " + bool mask"] = f"{type(e).__name__}: {str(e)[:100]}"
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for name, shape in SHAPES.items():
        results["shapes"][name] = row = _row(*shape)
        print(name, shape, json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
