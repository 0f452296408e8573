"""Where the training peak goes (a probe, not a test): per phase, for cgtrees and cudagraphs."""

import gc
import sys

import torch
import torch.nn as nn

import cgtrees
import cgtrees.runtime as runtime


def deep_mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers).cuda()


def mib(b):
    return f"{b / 2**20:6.1f}"


def probe(name):
    model = deep_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 1024, device="cuda")
    f = torch.compile(model, backend=name)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for step in range(5):
        torch.cuda.reset_peak_memory_stats()
        out = f(x)
        fwd_peak, after_fwd = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        out.square().mean().backward()
        bwd_peak, after_bwd = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
        del out
        stolen = sum(1 for p in model.parameters() if p.grad is not None and p.grad._base is None)
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_peak, after = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
        print(f"{name:10s} step {step}: fwd peak {mib(fwd_peak)} after {mib(after_fwd)} | bwd peak {mib(bwd_peak)} "
              f"after {mib(after_bwd)} | opt peak {mib(step_peak)} after {mib(after)} | grads w/o base {stolen}")
    if name == "cgtrees":
        print(runtime.describe())
    del f, model, opt
    torch._dynamo.reset()
    cgtrees.reset()


if __name__ == "__main__":
    for name in sys.argv[1:] or ["cudagraphs", "cgtrees"]:
        probe(name)
