"""A warm process makes its modules' library calls beforehand (``cgtrees.runtime.first_calls``): in
a thread started as it loads a level-1 entry, joined before the first call. It must change nothing
but the time: the warm process's outputs and gradients are the cold one's, bit for bit, with
dropout in the model (a warm-up that drew random numbers would move the generator and change the
masks), the generator ends where the cold one's does, and the option turns it off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs CUDA and compiled Triton kernels")

WORKER = r'''
import json, sys, time
import torch
from torch import nn
from torch._dynamo.utils import counters

torch.backends.cudnn.deterministic = True  # cuDNN's weight gradients, the same in both processes
torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Dropout(0.25),
    nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    nn.Linear(32, 10)).cuda()
x = torch.randn(8, 3, 32, 32, device="cuda")
torch.cuda.synchronize()
start = time.perf_counter()
compiled = torch.compile(model, backend="cgtrees")
torch.cuda.manual_seed(1)
outs, grads = [], []
for _ in range(3):
    out = compiled(x)
    out.square().mean().backward()
    outs.append(out.detach().cpu())
    grads.append([p.grad.detach().cpu().clone() for p in model.parameters()])
    for p in model.parameters():
        p.grad = None
torch.cuda.synchronize()
first_step_s = time.perf_counter() - start
from cgtrees.runtime import first_calls
torch.save({"outs": outs, "grads": grads, "rng": torch.cuda.get_rng_state()}, sys.argv[1])
print(json.dumps({"counters": dict(counters["cgtrees"]), "pending": len(first_calls._pending),
                  "first_steps_s": first_step_s}))
'''


def _run(tmp_path: Path, cache: Path, name: str, **env: str) -> dict:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    full = {**os.environ, "CGTREES_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TRITON_CACHE_DIR": str(cache / "triton"), **env}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / f"{name}.pt")], env=full,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


def _same(tmp_path: Path, a: str, b: str) -> None:
    x, y = torch.load(tmp_path / f"{a}.pt"), torch.load(tmp_path / f"{b}.pt")
    for o, p in zip(x["outs"], y["outs"], strict=True):
        torch.testing.assert_close(p, o, rtol=0, atol=0)
    for step_a, step_b in zip(x["grads"], y["grads"], strict=True):
        for g, h in zip(step_a, step_b, strict=True):
            torch.testing.assert_close(h, g, rtol=0, atol=0)
    assert torch.equal(x["rng"], y["rng"]), "the generator moved differently"


def test_warm_process_makes_its_library_calls_beforehand_and_changes_nothing(tmp_path):
    cache = tmp_path / "cache"
    cold = _run(tmp_path, cache, "cold")
    assert cold["counters"].get("first_calls_made", 0) == 0  # nothing loaded: nothing made beforehand
    warm = _run(tmp_path, cache, "warm")
    assert warm["counters"]["cache_hit"] >= 1 and warm["counters"].get("kernels_generated", 0) == 0, warm
    # the forward's convolutions and the classifier's matmul, the backward's too
    assert warm["counters"]["first_calls_made"] >= 4, warm
    assert warm["pending"] == 0
    # the thread's cuBLAS calls find a current CUDA context (else torch warns on stderr)
    assert "no current CUDA context" not in warm["stderr"], warm["stderr"][-2000:]
    _same(tmp_path, "cold", "warm")
    off = _run(tmp_path, cache, "off", CGTREES_WARM_FIRST_CALLS="0")
    assert off["counters"].get("first_calls_made", 0) == 0 and off["counters"]["cache_hit"] >= 1, off
    _same(tmp_path, "cold", "off")
    print(f"\nfirst three training steps: cold {cold['first_steps_s']:.3f} s, warm {warm['first_steps_s']:.3f} s, "
          f"warm without first calls {off['first_steps_s']:.3f} s")


def test_backward_calls_run_on_autograds_device_thread(monkeypatch):
    """cuDNN's plans and cuBLAS's handles are per thread: the calls of a module that runs as a
    backward are made on the thread where autograd runs a CUDA backward, not on the loading one."""
    import threading

    from cgtrees.runtime import first_calls

    for name in ("_pending", "_made"):
        monkeypatch.setattr(first_calls, name, [])
    monkeypatch.setattr(first_calls, "_started", set())
    where, make = [], first_calls._make
    monkeypatch.setattr(first_calls, "_make", lambda spec: (where.append(threading.get_ident()), make(spec))[1])
    spec = {"op": "aten.mm.default", "device": "cuda:0", "kwargs": {},
            "args": [{"tensor": [[7, 13], [13, 1], 0, "float32"]}, {"tensor": [[13, 5], [5, 1], 0, "float32"]}]}
    first_calls.start([], [json.dumps(spec)])
    first_calls.wait()
    assert first_calls._pending == []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            where.append(("real", threading.get_ident()))
            return grad

    Probe.apply(torch.ones(2, device="cuda", requires_grad=True)).sum().backward()
    made, (_, real) = where
    assert made == real and made != threading.get_ident(), where
