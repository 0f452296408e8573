"""How ``decode_attention``'s forms time back to back against one at a time (``gemm_timing.time_us``'s
``alone``): a Llama 1.1B layer's decode attention (32 query heads on 4 KV heads, head dim 64, bf16,
a boolean mask), q rotated inside, at batch 1 and 8 over caches of 160 and 4096 positions. With
``--idle S``, batch 1 is also timed alone after S seconds of an idle GPU (as a compile leaves it
between candidates), by the best of 3 replays and by replays until no new best (``gemm_timing``).

    python3 benchmarks/probes/probe_attention_timing.py --idle 1 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from cgtrees.codegen import decode_attention, gemm_timing  # noqa: F401 (registers the op)
from cgtrees.codegen.grouped_attention import _DECODE_CONFIGS, _decode_name


def forms(batch: int, cache: int, idle: float) -> dict:
    g = torch.Generator("cuda").manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(batch, 32, 1, 64, **kw)
    k, v = torch.randn(batch, 4, cache, 64, **kw), torch.randn(batch, 4, cache, 64, **kw)
    keep = torch.ones(batch, 1, 1, cache, dtype=torch.bool, device="cuda")
    cos, sin = torch.randn(batch, 1, 1, 64, **kw), torch.randn(batch, 1, 1, 64, **kw)
    stride = [32 * 64, 64, 32 * 64, 1]
    out = {}
    for config in (c for c in _DECODE_CONFIGS if c[2] < cache):
        def build(config=config):
            return lambda: torch.ops.cgtrees.decode_attention(q, k, v, keep, None, stride, *config, cos, sin)
        key = f"probe b{batch} L{cache} {config}"
        out[_decode_name(config)] = t = {"back to back": gemm_timing.time_us(key, q.device, build),
                                         "alone": gemm_timing.time_us(key, q.device, build, alone=True)}
        if idle and batch == 1:
            for label, replays in (("idle, 3 replays", 3), ("idle, until stable", gemm_timing._MAX_REPLAYS)):
                before, gemm_timing._MAX_REPLAYS = gemm_timing._MAX_REPLAYS, replays
                time.sleep(idle)
                t[label] = gemm_timing.time_us(f"{key} {label}", q.device, build, alone=True)
                gemm_timing._MAX_REPLAYS = before
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="probe-attention-timing.json")
    parser.add_argument("--idle", type=float, default=0.0)
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for batch, cache in ((1, 160), (1, 4096), (8, 160), (8, 4096)):
        result[f"batch {batch}, cache {cache}"] = timed = forms(batch, cache, args.idle)
        for name, t in timed.items():
            print(f"b{batch} L{cache:5d} {name:34s} " + "  ".join(f"{k} {v:6.2f}" for k, v in t.items()))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
