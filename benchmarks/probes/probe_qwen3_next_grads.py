"""Qwen3-Next's ``A_log`` and ``dt_bias`` gradients (tests/hf_helpers.py's tiny model, one training
step) against float64, for eager, for our decomposition table run through aten (``decomp``: no
kernel generated) and for our generated kernels through Triton's interpreter (``ours``), on CPU:

    python benchmarks/probes/probe_qwen3_next_grads.py decomp|core|ours [SEED]

Each figure is the largest error over the float64 gradient's largest magnitude. On 2026-11-28
(torch 2.13 CPU), dt_bias (A_log alike):

| seed | eager | decomp | ours |
|---|---|---|---|
| 0 | 2.7e-06 | 5.7e-06 | 2.0e-05 |
| 1 | 6.8e-06 | 2.2e-06 | 8.7e-06 |
| 2 | 8.8e-06 | 7.1e-06 | 1.2e-05 |
| 3 | 1.5e-06 | 3.6e-06 | 2.0e-06 |

Seed 0's gap is the rounding of two sums with cancellation (over batch and sequence, the gradients of
g = -exp(A_log) * softplus(a + dt_bias)), not a kernel: the same model in float64 through our
kernels, buffer by buffer, puts every buffer of the backward before those two sums within 1.5e-6 of
its largest value, and across seeds ours is 0.9-1.4x eager's error at 1-3.
"""

from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
os.environ.setdefault("CGTREES_CPU_PIPELINE", "1")

import torch  # noqa: E402
from functorch.compile import make_boxed_func  # noqa: E402
from hf_helpers import CASES  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402


def grads(model: torch.nn.Module, inputs: dict, compile_fn=None, dtype=None) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    if dtype is not None:
        model = model.to(dtype)
        for module in model.modules():  # float64 has no grouped_mm: the experts' Python loop
            if hasattr(module, "config"):
                module.config._experts_implementation = "eager"
    fn = compile_fn(model) if compile_fn else model
    fn(**inputs).loss.backward()
    return {n: p.grad.double() for n, p in model.named_parameters()
            if p.grad is not None and ("A_log" in n or "dt_bias" in n)}


def backend(mode: str):
    if mode == "ours":
        options = {"interpret": True, "cache": False}
        return lambda m: torch.compile(m, backend="cgtrees", fullgraph=True, options=options)
    if mode == "decomp":
        from cgtrees.aot.decompositions import decomposition_table

        table = decomposition_table()
    else:
        from torch._decomp import core_aten_decompositions

        table = core_aten_decompositions()
    aot = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), decompositions=table)
    return lambda m: torch.compile(m, backend=aot, fullgraph=True)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "ours"
    case = CASES["qwen3_next"]
    torch.manual_seed(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    model, inputs = case.build().train(), case.inputs()
    exact, eager = grads(model, inputs, dtype=torch.float64), grads(model, inputs)
    got = grads(model, inputs, backend(mode))
    for name, want in exact.items():
        scale = want.abs().max().item()
        print(f"{name:45s} eager {(eager[name] - want).abs().max().item() / scale:.1e}  "
              f"{mode} {(got[name] - want).abs().max().item() / scale:.1e}")


if __name__ == "__main__":
    main()
