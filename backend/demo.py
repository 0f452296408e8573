"""The built-in demo (``python -m cgtrees``): compile a small GPT block, check it against eager,
and print compile time, steady-state time against eager, and what the cache did.

On a CPU there is nothing to accelerate: cgtrees runs each graph as Dynamo captured it (eager's ops;
with ``CGTREES_CPU_PIPELINE=1`` through AOTAutograd and its runtime as aten calls, with
``CGTREES_INTERPRET=1`` its Triton kernels through Triton's interpreter), so the demo says so first
and prints no speed-up figure there: only on CUDA is the per-call ratio a measurement of cgtrees.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from cgtrees import counters


class DemoBlock(nn.Module):
    """One GPT-2 style block: causal attention written out, tanh-GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = torch.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _per_call_us(fn, x: torch.Tensor, device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn(x)
    _sync(device)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn(x)
        _sync(device)
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return sorted(samples)[len(samples) // 2]


def _on_cpu() -> str:
    """What cgtrees runs on a CPU, where it compiles for correctness, not speed."""
    from cgtrees.config import Config

    config = Config.resolve()
    if config.interpret:
        return ("  on CPU with CGTREES_INTERPRET=1, cgtrees runs its generated Triton kernels through Triton's "
                "interpreter: correct, far slower than eager; compiled kernels and CUDA graphs need an NVIDIA GPU")
    if config.cpu_pipeline:
        return ("  on CPU with CGTREES_CPU_PIPELINE=1, cgtrees compiles each graph as on a GPU and runs it as "
                "aten calls: correct, not accelerated; its Triton kernels and CUDA graphs need an NVIDIA GPU")
    return ("  on CPU, cgtrees runs each graph as Dynamo captured it (eager's ops, at eager's speed): its "
            "Triton kernels and CUDA graphs need an NVIDIA GPU; CGTREES_CPU_PIPELINE=1 compiles as on one")


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    d, heads = (768, 12) if device.type == "cuda" else (128, 4)
    shape = (8, 256, d) if device.type == "cuda" else (4, 64, d)
    model = DemoBlock(d, heads).to(device)
    x = torch.randn(*shape, device=device)
    print(f"cgtrees demo on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}: "
          f"GPT block d={d}, heads={heads}, input {tuple(shape)}, torch {torch.__version__}")
    if device.type != "cuda":
        print(_on_cpu())

    compiled = torch.compile(model, backend="cgtrees")
    with torch.no_grad():
        start = time.perf_counter()
        out = compiled(x)
        _sync(device)
        compile_s = time.perf_counter() - start
        ref = model(x)
    err = (out - ref).abs().max().item()
    print(f"inference: compile + first call {compile_s:.2f} s, max |error| vs eager {err:.2e}")

    x_train = x.clone().requires_grad_()
    loss = compiled(x_train).square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    x_ref = x.clone().requires_grad_()
    model(x_ref).square().mean().backward()
    grad_err = max((a - p.grad).abs().max().item() for a, p in zip(grads, model.parameters()))
    print(f"training: max |grad error| vs eager {grad_err:.2e}")

    iters = 50 if device.type == "cuda" else 5
    with torch.no_grad():
        eager_us = _per_call_us(model, x, device, iters)
        ours_us = _per_call_us(compiled, x, device, iters)
    speed = f"{eager_us / ours_us:.2f}x eager" if device.type == "cuda" else "CPU: no speed-up to measure, see above"
    print(f"steady state per call: eager {eager_us:.0f} us, cgtrees {ours_us:.0f} us ({speed})")

    c = counters.snapshot()
    print("cache: " + ", ".join(f"{k}={c[k]}" for k in ("cache_hit", "cache_miss", "cache_bypass", "cache_corrupt")))
    print("counters: " + ", ".join(f"{k}={c[k]}" for k in counters.KEYS if not k.startswith("cache")))
    ok = err < 1e-3 and grad_err < 1e-3 and math.isfinite(err)
    print("demo " + ("OK: matches eager" if ok else "FAILED: does not match eager"))
    return 0 if ok else 1


def draw_tree(out: str, steps: int = 6) -> int:
    """``python -m cgtrees tree``: ``steps`` training steps of the demo's block (a second function,
    its inference under ``no_grad``, every other step), then the picture of the trees at ``out``."""
    from pathlib import Path

    from cgtrees.runtime import picture

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    d, heads, shape = (768, 12, (8, 256, 768)) if device.type == "cuda" else (128, 4, (4, 64, 128))
    model = DemoBlock(d, heads).to(device)
    # on CPU: through the pipeline, so that the runtime has functions to draw (each with its reason)
    compiled = torch.compile(model, backend="cgtrees", options={"cpu_pipeline": device.type != "cuda"})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(steps):
        x = torch.randn(*shape, device=device)
        compiled(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 2:
            with torch.no_grad():
                compiled(x)
    _sync(device)
    written = picture.write(out)
    if device.type != "cuda":
        print("cgtrees tree: on CPU nothing runs in CUDA graphs: the picture shows each function's reason")
    how = "" if written.suffix != ".dot" or Path(out).suffix == ".dot" else \
        " (Graphviz's dot is not installed: DOT text; render it with dot -Tsvg)"
    print(f"cgtrees tree: wrote {written}{how}")
    return 0

