"""Compiled autograd's backward graphs across processes: a cold process compiles them, a warm one
loads them from the cache (``tests/test_compiled_autograd.py`` on the CPU,
``tests/gpu/test_compiled_autograd_cache_gpu.py`` on CUDA). Fresh processes on a snapshot of the
backend: the key hashes our source, and the tree may be edited meanwhile."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import copy, json, logging, sys, torch
import backend.aot.compat as aot_compat
from backend import counters

calls = {"aot": 0}
real_aot = aot_compat.aot_module_simplified
def counting_aot(*a, **k):
    calls["aot"] += 1
    return real_aot(*a, **k)
aot_compat.aot_module_simplified = counting_aot

class Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []
    def emit(self, record):
        self.messages.append(record.getMessage())
keep = Keep()
logging.getLogger("backend").addHandler(keep)
logging.getLogger("backend").setLevel(logging.DEBUG)

device = sys.argv[1]
torch.manual_seed(0)
nn = torch.nn
model = nn.Sequential(nn.Linear(13, 24), nn.Tanh(), nn.Linear(24, 7)).to(device)
ref = copy.deepcopy(model)
def halve(p):
    p.grad.mul_(0.5)
for m in (model, ref):  # hooks are traced into the graph: same code, same key
    m[0].weight.register_hook(lambda g: g * 2.0)
    m[2].bias.register_post_accumulate_grad_hook(halve)
opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]

def step(m, x):
    loss = (m(x) / 3.0).pow(2).mean()
    loss.backward()
    return loss.detach()

with torch._dynamo.config.patch(compiled_autograd=True):
    compiled = torch.compile(step, backend="cgtrees")
error = 0.0
xs = [torch.randn(6, 13, device=device) for _ in range(4)]
for x, what in zip(xs, ["step", "accumulate", "step", "step"]):
    losses = compiled(model, x), step(ref, x)
    error = max([error, (losses[0] - losses[1]).abs().item()]
                + [(p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())])
    if what == "step":
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    error = max([error] + [(p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())])
c = counters.snapshot()
backward = [m.split()[1] for m in keep.messages if "is a compiled-autograd backward" in m]
print(json.dumps({"error": error, "calls": calls, "backward": backward,
                  "counters": {k: v for k, v in c.items()
                               if k.startswith(("cache_", "cudagraph_")) or k.endswith(("_graphs", "_fallbacks"))},
                  "aot_hits": [m.split()[-1] for m in keep.messages if m.startswith("cgtrees: cache hit (aot)")],
                  "aot_misses": [m.split()[5].rstrip(":") for m in keep.messages
                                 if m.startswith("cgtrees: cache miss (aot)")],
                  "why": [m for m in keep.messages if m.startswith(("cgtrees: cache miss (aot)", "cgtrees: g"))
                          and ("miss" in m or "bypass" in m)]}))
"""



def cold_and_warm(tmp_path: Path, device: str) -> tuple[dict, dict]:
    """The worker's results in a cold process, then in a warm one on the same cache."""
    shutil.copytree(ROOT / "backend", tmp_path / "snapshot" / "backend", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "worker.py").write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CGTREES_", "TRITON_CACHE"))}
    env.update(CGTREES_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path / "snapshot"))
    runs = []
    for _ in ("cold", "warm"):
        proc = subprocess.run([sys.executable, str(tmp_path / "worker.py"), device], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return runs[0], runs[1]


def check_cold_and_warm(cold: dict, warm: dict, tolerance: float = 1e-5) -> None:
    """Both match eager (largest difference of a loss, gradient or parameter); the warm process
    loaded every backward graph from level 1 and traced none of them through AOTAutograd."""
    for run in (cold, warm):
        assert run["error"] < tolerance, run
        assert run["counters"]["compiled_autograd_graphs"] == len(run["backward"]) >= 2, run
        assert run["counters"].get("cache_corrupt", 0) == 0 and run["counters"].get("graph_fallbacks", 0) == 0
    assert set(cold["backward"]) <= set(cold["aot_misses"]), cold  # compiled and recorded
    assert set(warm["backward"]) <= set(warm["aot_hits"]), warm  # loaded from level 1 ...
    assert warm["counters"]["cache_hit_module"] >= len(warm["backward"]), warm  # ... reading level 2
    assert warm["calls"]["aot"] == cold["calls"]["aot"] - len(cold["backward"]), (cold, warm)
