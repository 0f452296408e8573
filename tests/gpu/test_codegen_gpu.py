"""Codegen on CUDA with real Triton: numerics against eager, fusion, the OpInfo sweep (one dtype
per op, to keep compile time down), 64-bit indexing, and kernel bandwidth against the device's
copy bandwidth (printed; set CGTREES_BENCH_OUT=file.json to keep the numbers)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")

DEV = "cuda"


def _helpers():
    import codegen_helpers

    return codegen_helpers


def close(a, b, **kw):
    torch.testing.assert_close(a, b, **kw)


def test_pointwise_chain_is_one_kernel():
    h = _helpers()

    def f(x, y):
        z = x
        for i in range(5):
            z = torch.sigmoid(z * (i + 1)) + y
        return z

    x, y = torch.randn(1823, 781, device=DEV), torch.randn(781, device=DEV)
    m = h.compile_fn(f, x, y)
    assert h.kernel_count(m) == 1
    close(h.run(m, x, y)[0], f(x, y))


def test_kernels_compile_together_before_the_first_call():
    """load() compiles every kernel its graph's ``precompile`` lists (on a thread pool); the first call then finds
    each one compiled, compiles nothing at a launch, and gets the right numbers."""
    h = _helpers()
    x = torch.randn(640, 300, device=DEV)
    f = lambda x: (torch.softmax(x * 2, -1), torch.tanh(x).sum(0), torch.sigmoid(x).amax(-1) + 1)
    m = h.compile_fn(f, x)
    entries = m.graph.precompile
    assert len(entries) == h.kernel_count(m) >= 2, m.source
    dev = torch.cuda.current_device()
    from cgtrees.codegen.binaries import CachedKernel

    kernels = [vars(m.module)[e.kernel] for e in entries]
    kernels = [k._jit if isinstance(k, CachedKernel) else k for k in kernels]  # launched from a binary: its JIT

    def compiled():  # Triton's per-device cache of compiled specialisations, per kernel
        return {k.fn.__name__: len(k.device_caches[dev][0]) for k in kernels}

    before = compiled()
    assert all(n == 1 for n in before.values()), before
    out = h.run(m, x)
    assert compiled() == before
    for a, b in zip(out, f(x)):
        close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", [(1823, 781), (3, 20000), (8192, 4096)])
def test_softmax_layernorm_one_kernel(shape):
    h = _helpers()
    x = torch.randn(*shape, device=DEV)
    w, b = torch.randn(shape[-1], device=DEV), torch.randn(shape[-1], device=DEV)
    for f in (lambda x, w, b: torch.softmax(x, -1), lambda x, w, b: torch.log_softmax(x, -1),
              lambda x, w, b: F.layer_norm(x, (shape[-1],), w, b)):
        m = h.compile_fn(f, x, w, b)
        assert h.kernel_count(m) == 1, m.source
        close(h.run(m, x, w, b)[0], f(x, w, b), atol=1e-5, rtol=1e-4)


def test_gpt_block_training_matches_eager():
    h = _helpers()
    from models import GPTBlock

    torch.manual_seed(0)
    model = GPTBlock().to(DEV)
    comp = h.Compiler()
    cm = torch.compile(model, backend=comp.backend)
    x = torch.randn(4, 16, 64, device=DEV, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y = cm(x)
    y.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x2)
    ref.sum().backward()
    comp.check()
    close(y, ref, atol=1e-4, rtol=1e-4)
    close(x.grad, x2.grad, atol=1e-4, rtol=1e-4)
    for g, p in zip(grads, model.parameters()):
        close(g, p.grad, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool])
def test_dtypes(dtype):
    h = _helpers()
    if dtype == torch.bool:
        x = torch.rand(37, 19, device=DEV) > 0.5
        f = lambda x: (x & ~x.flip(0).clone(), x.any(-1), x.sum(0))
    elif dtype.is_floating_point:
        x = torch.randn(37, 19, device=DEV).to(dtype)
        f = lambda x: (x * 2 + 1, torch.softmax(x, -1), x.sum(0), x.amax(-1), x.tanh(), x.pow(2.5))
    else:
        x = torch.randint(-50, 50, (37, 19), dtype=dtype, device=DEV)
        f = lambda x: (x * 3 - 7, x // 4, x % 5, x.sum(-1), x.amax(0), x.argmax(-1))
    m = h.compile_fn(f, x)
    for a, b in zip(h.run(m, x), f(x)):
        close(a, b, atol=1e-2, rtol=1e-2, equal_nan=True)


def test_triton_hashes_itself_while_a_cuda_graph_compiles(tmp_path, monkeypatch):
    """The first CUDA graph to reach the backend starts Triton's hash of itself on a thread, so the
    first kernel launch finds it done (tests/test_codegen.py: CPU graphs start nothing). The key
    Triton then uses is the one it computes itself, and it is kept in the file given."""
    import triton.runtime.cache as triton_cache

    from cgtrees import codegen
    from cgtrees.codegen import compat
    from cgtrees.config import Config

    original = getattr(triton_cache.triton_key, "compute", triton_cache.triton_key)
    monkeypatch.setattr(triton_cache, "triton_key", original)  # as if no graph had come before
    monkeypatch.setattr(compat, "_key_thread", None)
    path = tmp_path / "key.json"
    codegen.prepare([torch.randn(3, device=DEV)], Config(), path)
    assert compat._key_thread is not None and compat._key_thread.name == "cgtrees-triton-key"
    compat._key_thread.join(timeout=60)
    shared = triton_cache.triton_key
    assert isinstance(shared, compat.SharedKey)
    assert shared.compute is original and shared.path == path
    assert shared() == original() and shared().startswith(__import__("triton").__version__)
    assert json.loads(path.read_text())["key"] == shared()


def test_a_warm_load_shares_the_key_without_hashing(tmp_path, monkeypatch):
    """A warm load (``compiles=False``) starts no thread: its kernels launch stored binaries. The
    key it puts in place is read back from the file a cold process kept, at a kernel that goes
    through the JIT after all; a later compile starts the hash as a cold process does."""
    import triton.runtime.cache as triton_cache

    from cgtrees import codegen
    from cgtrees.codegen import compat
    from cgtrees.config import Config

    original = getattr(triton_cache.triton_key, "compute", triton_cache.triton_key)
    monkeypatch.setattr(triton_cache, "triton_key", original)
    monkeypatch.setattr(compat, "_key_thread", None)
    path = tmp_path / "key.json"
    path.write_text(json.dumps({"stamp": compat.installed_stamp(), "key": "kept by a cold process"}))
    codegen.prepare([torch.randn(3, device=DEV)], Config(), path, compiles=False)
    assert compat._key_thread is None
    shared = triton_cache.triton_key
    assert isinstance(shared, compat.SharedKey) and shared.value is None  # nothing computed yet
    assert shared() == "kept by a cold process"
    codegen.prepare([torch.randn(3, device=DEV)], Config(), path)  # a miss: the thread, the same key
    assert compat._key_thread is not None
    compat._key_thread.join(timeout=60)
    assert triton_cache.triton_key is shared and shared() == "kept by a cold process"


def test_dynamic_shapes():
    h = _helpers()
    comp = h.Compiler()
    f = torch.compile(lambda x: torch.softmax(x * 2, -1) + 1, backend=comp.backend, dynamic=True)
    for n in (5, 9, 300):
        x = torch.randn(n, 7 + n, device=DEV)
        close(f(x), torch.softmax(x * 2, -1) + 1)
    comp.check()


def test_int64_indexing_past_2_to_the_31():
    h = _helpers()
    n = 2**31 + 1000
    try:
        x = torch.ones(n, dtype=torch.int8, device=DEV)
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory")
    x[-5:] = 3
    m = h.compile_fn(lambda x: x * 2 + 1, x)
    assert "tl.int64" in m.source
    out = h.run(m, x)[0]
    assert out[0].item() == 3 and out[-1].item() == 7 and out[n // 2].item() == 3
    del x, out
    torch.cuda.empty_cache()


@pytest.mark.parametrize("channels_last", [False, True])
def test_pooling_resnet_stem_training_matches_eager(channels_last):
    """conv -> BN -> ReLU -> max pool 3x3/2 (resnet's stem), a residual conv block, avg pool:
    outputs and gradients against eager; the pooling ops are generated kernels, not aten calls."""
    import re

    import torch.nn as nn

    h = _helpers()
    torch.manual_seed(0)

    class Stem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16)
            self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
            self.fc = nn.Linear(16 * 8 * 8, 10)

        def forward(self, x):
            y = F.max_pool2d(F.relu(self.bn(self.conv(x))), 3, 2, 1)
            y = F.relu(self.bn2(self.conv2(y)) + y)
            return self.fc(F.avg_pool2d(y, 2, 2).flatten(1))

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = Stem().to(DEV, memory_format=fmt)
    x = torch.randn(8, 3, 64, 64, device=DEV).to(memory_format=fmt)
    comp = h.Compiler()
    out = torch.compile(model, backend=comp.backend)(x)
    out.square().sum().backward()
    comp.check()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x)
    ref.square().sum().backward()
    close(out, ref, atol=1e-3, rtol=1e-3)
    for g, p in zip(grads, model.parameters()):
        close(g, p.grad, atol=1e-3 * max(p.grad.abs().max().item(), 1.0), rtol=1e-3)
    calls = {c for m in comp.modules for c in re.findall(r"\baten\.[\w.]+",
                                                         m.source.split("\ndef call(")[1].split("\ndef call_aten(")[0])}
    assert not {c for c in calls if "pool" in c}, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_pool_indices_ties_and_nan_match_eager(dtype):
    """CUDA eager's rule too: the first max of a window, the last NaN where it holds one."""
    h = _helpers()
    x = torch.randint(0, 3, (4, 8, 33, 31), device=DEV).to(dtype)
    x[:, :, 5, 7] = float("nan")
    x[:, :, 6, 6] = float("nan")
    f = lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True)  # noqa: E731
    m = h.compile_fn(f, x)
    values, indices = h.run(m, x)
    ref_values, ref_indices = f(x)
    close(values, ref_values, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(indices, ref_indices)


def _opinfo_cases():
    from test_codegen_opinfo import OPS, op_db

    for op in op_db:
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if name not in OPS:
            continue
        supported = op.supported_dtypes(DEV) if torch.cuda.is_available() else set()
        dtype = next((d for d in (torch.float32, torch.int64, torch.bool) if d in supported), None)
        if dtype is not None:
            yield pytest.param(op, dtype, id=f"{name}-{str(dtype)[6:]}")


@pytest.mark.parametrize("op,dtype", list(_opinfo_cases()) if torch.cuda.is_available() else [])
def test_opinfo_cuda(op, dtype):
    from test_codegen_opinfo import check_sample

    check_sample(op, dtype, DEV)


# ----------------------------------------------------------------------------------------- bandwidth
def _graph_time(fn, iters: int = 50) -> float:
    """Seconds per call of ``fn``, replayed from a CUDA graph (no Python overhead in the timing)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters // 10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1000 / iters)
    return best


def _warps_sweep(m, args, moved: float, copy_bw: float) -> dict:
    """The same kernel with other num_warps (data for the block-size heuristic)."""
    import re

    from cgtrees import codegen
    from cgtrees.config import Config
    from cgtrees.context import GraphContext

    out = {}
    for warps in (4, 8, 16):
        source = re.sub(r"num_warps=\d+", f"num_warps={warps}", m.source)
        variant = codegen.load(dataclasses.replace(m.graph, source=source),
                               GraphContext(Config(), "inference", f"warps{warps}"))
        t = _graph_time(lambda variant=variant: variant.call(list(args)))
        out[warps] = round(moved / t / copy_bw, 3)
    return out


def test_bandwidth_against_copy():
    h = _helpers()
    shape = (8192, 4096)
    x, y = torch.randn(*shape, device=DEV), torch.randn(*shape, device=DEV)
    w, b = torch.randn(shape[-1], device=DEV), torch.randn(shape[-1], device=DEV)
    nbytes = x.numel() * 4
    dst = torch.empty_like(x)
    copy_bw = 2 * nbytes / _graph_time(lambda: dst.copy_(x))
    cases = {
        "pointwise gelu(x*y+1)": (lambda x, y: F.gelu(x * y + 1), (x, y), 3 * nbytes),
        "softmax": (lambda x: torch.softmax(x, -1), (x,), 2 * nbytes),
        "layernorm": (lambda x, w, b: F.layer_norm(x, (shape[-1],), w, b), (x, w, b), 2 * nbytes),
        "log_softmax": (lambda x: torch.log_softmax(x, -1), (x,), 2 * nbytes),
    }
    report = {"device": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9}
    for name, (f, args, moved) in cases.items():
        m = h.compile_fn(f, *args)
        assert h.kernel_count(m) == 1
        t = _graph_time(lambda m=m, args=args: m.call(list(args)))
        report[name] = {"us": t * 1e6, "GBps": moved / t / 1e9, "fraction_of_copy": moved / t / copy_bw}
        h.check(m)
        report[name]["by_num_warps"] = _warps_sweep(m, args, moved, copy_bw)
    print("\nBANDWIDTH", json.dumps(report, indent=1))
    if os.environ.get("CGTREES_BENCH_OUT"):
        with open(os.environ["CGTREES_BENCH_OUT"], "w") as fh:
            json.dump(report, fh, indent=1)
    assert report["pointwise gelu(x*y+1)"]["fraction_of_copy"] > 0.5
    assert report["softmax"]["fraction_of_copy"] > 0.5
