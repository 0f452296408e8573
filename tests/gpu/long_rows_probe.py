"""Times a cross-entropy's forward and backward and a softmax over long rows, at a language model's
real size (8192 x 50257 logits), kernel by kernel, for the backends named on the command line.

    python tests/gpu/long_rows_probe.py cgtrees inductor eager   # each: compile, check, time

``cgtrees-by-elements`` is cgtrees with the loss's gradient as a flat pointwise kernel (what
``scheduler._by_rows`` replaced), to see what walking rows and columns is worth; ``cgtrees@RxW``
loops over long rows ``R`` columns at a time with ``W`` warps. Per-kernel times
are the profiler's device times per call; ``step`` is the median of 5 windows of 10 calls (CUDA
events), graphs off for every backend. Not a test: a probe whose figures the issue quotes.
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F

ROWS, VOCAB = 8192, 50257


def compiled(fn, name: str):
    torch._dynamo.reset()
    if name == "eager":
        return fn
    if name == "inductor":
        return torch.compile(fn)
    if name == "cgtrees-by-elements":
        from cgtrees.codegen import scheduler

        scheduler._by_rows = lambda ranges, members: ()
    if name.startswith("cgtrees@"):  # cgtrees@2048x16: looped row kernels of RBLOCK 2048, 16 warps
        _loop_blocks(*map(int, name[len("cgtrees@"):].split("x")))
    return torch.compile(fn, backend="cgtrees", options={"cudagraphs": False, "cache": False})


def _loop_blocks(rblock: int, warps: int) -> None:
    from cgtrees.codegen import heuristics

    original = getattr(heuristics, "_probe_original", heuristics.reduction)
    heuristics._probe_original = original

    def reduction(xnumel, rnumel, inner, interpret):
        cfg = original(xnumel, rnumel, inner, interpret)
        return cfg if cfg.persistent or not inner else heuristics.Config(cfg.xblock, rblock, warps, False)

    heuristics.reduction = reduction


def per_kernel(step, calls: int = 10) -> list[tuple[float, str]]:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    rows = [(e.device_time_total / calls / 1000, e.key) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, reverse=True)


def step_ms(step) -> float:
    for _ in range(3):
        step()
    windows = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            step()
        end.record()
        torch.cuda.synchronize()
        windows.append(start.elapsed_time(end) / 10)
    return statistics.median(windows)


def report(what: str, name: str, step) -> None:
    print(f"== {what} [{name}] step {step_ms(step):.3f} ms")
    for ms, kernel in per_kernel(step)[:8]:
        print(f"   {ms:8.3f} ms  {kernel[:110]}")


def cross_entropy(name: str) -> None:
    x = (torch.randn(ROWS, VOCAB, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, VOCAB, (ROWS,), device="cuda")
    t[::16] = -100
    fn = compiled(lambda x, t: F.cross_entropy(x.float(), t), name)
    loss = fn(x, t)
    loss.backward()
    got = x.grad
    x.grad = None
    ref = F.cross_entropy(x.float(), t)
    ref.backward()
    print(f"-- cross-entropy [{name}]: loss {loss.item():.6f} (eager {ref.item():.6f}), "
          f"grad max diff {(got.float() - x.grad.float()).abs().max().item():.3e}")
    x.grad = None

    def step() -> None:
        fn(x, t).backward()
        x.grad = None

    report("cross-entropy forward+backward, 8192x50257 bf16 -> float32", name, step)


def softmax(name: str) -> None:
    x = torch.randn(ROWS, VOCAB, device="cuda") * 3
    fn = compiled(lambda x: torch.softmax(x, -1), name)
    diff = (fn(x) - torch.softmax(x, -1)).abs().max().item()
    print(f"-- softmax [{name}]: max diff {diff:.3e}")
    report("softmax forward, 8192x50257 float32", name, lambda: fn(x))


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    for backend in sys.argv[1:]:
        cross_entropy(backend)
        softmax(backend)
