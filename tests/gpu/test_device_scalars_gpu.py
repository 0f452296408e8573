"""A CPU 0-d tensor among a CUDA graph's inputs (issue 45: transformers' static cache keeps
``cumulative_length`` on the host until first used, and the older path compiles that prefill): the
graph is generated (no "mixes devices" fallback to aten), captured and replayed, each replay reading
the scalar's current value; a cache hit does the same. A graph that returns the scalar itself still
runs right, without CUDA graphs (a CPU output)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import cgtrees.runtime as runtime

DEV = "cuda"


def stat(key: str) -> int:
    return counters["cgtrees"][key]


def step(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """A position from a host counter: the counter moved to the device, and used with CUDA tensors."""
    pos = torch.arange(x.shape[0], device=x.device) + n.to(x.device)
    return (x * n).sin() + pos[:, None].to(x.dtype)


def _run(f, n: torch.Tensor, calls: int) -> None:
    for i in range(calls):
        x = torch.randn(8, 16, device=DEV)
        n.fill_(i + 3)  # the caller changes the counter between calls, in place
        torch.compiler.cudagraph_mark_step_begin()
        torch.testing.assert_close(f(x, n), step(x, n), msg=lambda m: f"{m}\n{runtime.describe()}")


def test_cpu_scalar_is_generated_and_captured():
    n = torch.tensor(0)  # int64, on the CPU
    f = torch.compile(step, backend="cgtrees", options={"cache": False})
    with torch.no_grad():
        _run(f, n, 6)
    text = runtime.describe()
    assert stat("graph_fallbacks") == 0 and stat("kernels_generated") > 0, dict(counters["cgtrees"])
    assert stat("cudagraph_skips") == 0 and stat("cudagraph_replayed") == 4, text


def test_fresh_cpu_scalar_each_call():
    f = torch.compile(step, backend="cgtrees", options={"cache": False})
    with torch.no_grad():
        for i in range(6):
            x, n = torch.randn(8, 16, device=DEV), torch.tensor(i * 7 - 5)
            torch.compiler.cudagraph_mark_step_begin()
            torch.testing.assert_close(f(x, n), step(x, n))
    assert stat("cudagraph_skips") == 0 and stat("cudagraph_replayed") == 4, runtime.describe()


def test_cache_hit_captures_too():
    n = torch.tensor(0)
    with torch.no_grad():
        _run(torch.compile(step, backend="cgtrees"), n, 3)
        torch._dynamo.reset()
        import cgtrees

        cgtrees.reset()
        counters["cgtrees"].clear()
        _run(torch.compile(step, backend="cgtrees"), n, 5)
    assert stat("cache_hit_aot") == 1, dict(counters["cgtrees"])
    assert stat("cudagraph_skips") == 0 and stat("cudagraph_replayed") == 3, runtime.describe()


@pytest.mark.parametrize("how", ["returned", "item"])
def test_scalar_the_graph_needs_on_the_host_stays_right(how):
    def fn(x, n):
        if how == "returned":
            return x * n, n + 1  # an output on the CPU
        return x * n.item()  # read on the host

    f = torch.compile(fn, backend="cgtrees", options={"cache": False})
    with torch.no_grad():
        for i in range(4):
            x, n = torch.randn(8, device=DEV), torch.tensor(float(i))
            torch.testing.assert_close(f(x, n), fn(x, n))
