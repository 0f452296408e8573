"""Kernels launched from their compiled binaries (``cgtrees.codegen.binaries``), without Triton's
JIT: a fresh module launches its own, a module loaded with stored records (as from the cache)
launches those and compiles or looks up nothing, and what a binary does not fit goes through the
JIT with the right numbers."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import codegen_helpers as h  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs CUDA and compiled Triton kernels")
DEV = "cuda"


def f(x, y):
    return torch.softmax(x * 2, -1) + y, torch.tanh(x).sum(0), torch.sigmoid(x).amax(-1) + 1


def _inputs():
    return torch.randn(640, 300, device=DEV), torch.randn(300, device=DEV)


def _kernels(module):
    from cgtrees.codegen.binaries import CachedKernel

    return {name: obj for name, obj in vars(module.module).items() if isinstance(obj, CachedKernel)}


class _NoJit:
    """Fails a test when a launch goes through Triton's JIT."""

    def __init__(self, jit):
        self.jit = jit

    def __getitem__(self, grid):
        raise AssertionError(f"{self.jit} launched through Triton's JIT")


def _warm_load(m, records, name="warm"):
    """What a cache hit does: load the source, no precompile, the records as stored (JSON)."""
    from cgtrees import codegen
    from cgtrees.context import GraphContext

    ctx = GraphContext(h.config(), "inference", name)
    return codegen.load(dataclasses.replace(m.graph, binaries=json.loads(json.dumps(records))), ctx, fresh=False)


def _jit_specialisations(module):
    dev = torch.cuda.current_device()
    return {name: len(k.jit.device_caches[dev][0]) if dev in k.jit.device_caches else 0
            for name, k in _kernels(module).items()}


def test_a_fresh_module_launches_its_kernels_from_their_binaries():
    x, y = _inputs()
    m = h.compile_fn(f, x, y)
    kernels = _kernels(m)
    assert len(kernels) == h.kernel_count(m) >= 2, m.source
    for k in kernels.values():
        k.jit = _NoJit(k.jit)
    for a, b in zip(h.run(m, x, y), f(x, y)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _loaded(module):
    return [b.loaded for k in _kernels(module).values() for b in k.binaries if b.loaded.functions]


def test_binaries_launch_through_torchs_static_launcher():
    """No launcher is built from C source (Triton's, per signature: about 1.2 s each on a cold
    cache): torch's static CUDA launcher launches every binary, with the right numbers."""
    from cgtrees.codegen import compat

    assert compat._static_launch_kernel() is not None, "this torch has no static CUDA launcher"
    x, y = _inputs()
    m = h.compile_fn(f, x, y)
    for a, b in zip(h.run(m, x, y), f(x, y)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    loaded = _loaded(m)
    assert len(loaded) == h.kernel_count(m)
    assert all(b.static is not None and b.run is None for b in loaded), [(b.static, b.run) for b in loaded]


def test_without_torchs_static_launcher_tritons_launches(monkeypatch):
    from cgtrees.codegen import compat

    monkeypatch.setattr(compat, "_static_launch_kernel", lambda: None)
    x, y = _inputs()
    cold = h.compile_fn(f, x, y)
    warm = _warm_load(cold, cold.compiled().binaries, name="triton_launcher")
    for a, b in zip(h.run(warm, x, y), f(x, y)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    loaded = _loaded(warm)
    assert loaded and all(b.static is None and b.run is not None for b in loaded)


def test_a_warm_load_launches_the_stored_binaries_and_compiles_nothing():
    x, y = _inputs()
    cold = h.compile_fn(f, x, y)
    records = cold.compiled().binaries
    assert set(records) == set(_kernels(cold)), records.keys()
    assert all(len(r) == 1 for r in records.values())
    warm = _warm_load(cold, records)
    kernels = _kernels(warm)
    assert set(kernels) == set(records)
    for a, b in zip(h.run(warm, x, y), f(x, y)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert all(k._jit is None for k in kernels.values())  # never decorated: nothing compiled or looked up
    assert warm.compiled().binaries == records  # what a second store would keep
    with open(warm.path) as file:
        assert file.read() == cold.source  # the file keeps the source as generated


def test_arguments_a_binary_does_not_fit_go_through_the_jit():
    """The binaries assume 16-byte aligned pointers; an input 4 bytes off gets a new specialisation
    from the JIT, and the right numbers; aligned inputs keep using the binary."""
    x, y = _inputs()
    m = h.compile_fn(f, x, y)
    base = torch.randn(x.numel() + 1, device=DEV)
    shifted = base[1:].view_as(x)
    assert shifted.data_ptr() % 16
    before = _jit_specialisations(m)
    for a, b in zip(h.run(m, shifted, y), f(shifted, y)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    after = _jit_specialisations(m)
    grew = [name for name in after if after[name] > before[name]]
    assert grew, (before, after)
    for k in _kernels(m).values():
        k.jit = _NoJit(k.jit)
    for a, b in zip(h.run(m, x, y), f(x, y)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_binary_that_does_not_load_is_dropped_for_the_jit(caplog):
    x, y = _inputs()
    cold = h.compile_fn(f, x, y)
    records = cold.compiled().binaries
    name = sorted(records)[0]
    records[name][0]["binary"] = "bm90IGEgY3ViaW4="  # base64 of "not a cubin"
    warm = _warm_load(cold, records, name="damaged")
    with caplog.at_level(logging.WARNING, logger="cgtrees.codegen"):
        for a, b in zip(h.run(warm, x, y), f(x, y)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert "could not be loaded" in caplog.text
    kernels = _kernels(warm)
    others = [n for n in kernels if n != name]
    assert others and all(kernels[n]._jit is None for n in others)  # still launched from their binaries
    assert kernels[name].binaries == []
    assert len(kernels[name].jit.device_caches[torch.cuda.current_device()][0]) == 1


def test_a_profiler_hook_sees_every_launch():
    """With a launch hook set (Proton does this), launches go through Triton's JIT and its hooks."""
    from triton import knobs

    x, y = _inputs()
    m = h.compile_fn(f, x, y)
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        h.run(m, x, y)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == h.kernel_count(m)
    h.run(m, x, y)
    assert len(seen) == h.kernel_count(m)  # hook removed: back to the binaries, unseen
