"""Compiled autograd's graphs across processes: a cold process compiles the forward and the
backward graphs, a warm one loads them from the cache (``tests/test_compiled_autograd.py`` on the CPU,
``tests/gpu/test_compiled_autograd_cache_gpu.py`` on CUDA). Fresh processes on a snapshot of the
backend: the key hashes our source, and the tree may be edited meanwhile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from snapshot_helpers import COUNT_AOT, backend_snapshot, keep_log
from subprocess_env import clean_env

WORKER = COUNT_AOT + keep_log("cgtrees") + r"""
import copy, json, logging, sys, torch
from cgtrees import counters
from cgtrees.cache.events import BYPASS_SAYS
AOT_BYPASS = " " + BYPASS_SAYS["aot"] + ": "

device, enable, sizes = sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3].split(",")]
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

def loss_of(m, x):
    return (m(x) / 3.0).pow(2).mean()

def step(m, x):
    loss = loss_of(m, x)
    loss.backward()
    return loss.detach()

# "config": torch._dynamo.config.compiled_autograd around the compiled step; "plain": the step's
# forward compiled alone (the same Dynamo graph), its backward run by autograd; "context": the
# model compiled, the backward under compiled_autograd._enable(torch.compile(backend="cgtrees")) with
# its default dynamic=True; "context-static": the same with dynamic=False.
with torch._dynamo.config.patch(compiled_autograd=True):
    compiled = torch.compile(step, backend="cgtrees")
compiled_loss = torch.compile(loss_of, backend="cgtrees")
forward = torch.compile(model, backend="cgtrees")

def ours(x):
    if enable == "config":
        return compiled(model, x)
    if enable == "plain":
        loss = compiled_loss(model, x)
        loss.backward()
        return loss.detach()
    loss = (forward(x) / 3.0).pow(2).mean()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="cgtrees"), dynamic=enable == "context"):
        loss.backward()
    return loss.detach()

error = 0.0
xs = [torch.randn(n, 13, device=device) for n in sizes]
for x, what in zip(xs, ["step", "accumulate", "step", "step", "accumulate", "step"]):
    losses = ours(x), step(ref, x)
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
                  "bypassed": {m.split()[1]: m.split(AOT_BYPASS, 1)[1] for m in keep.messages if AOT_BYPASS in m},
                  "why": [m for m in keep.messages if m.startswith(("cgtrees: cache miss (aot)", "cgtrees: g"))
                          and ("miss" in m or "bypass" in m)]}))
"""



def cold_and_warm(tmp_path: Path, device: str, enable: tuple[str, str] = ("config", "config"),
                  sizes: tuple[str, str] = ("6,6,6,6", "6,6,6,6")) -> tuple[dict, dict]:
    """The worker's results in a cold process, then in a warm one on the same cache: each turns
    compiled autograd on as ``enable`` says ("config", "context", "context-static", or "plain": off) and trains on
    batches of ``sizes`` (comma-separated)."""
    backend_snapshot(tmp_path / "snapshot")
    (tmp_path / "worker.py").write_text(WORKER)
    env = clean_env()
    env.update(CGTREES_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path / "snapshot"))
    runs = []
    for how, batch in zip(enable, sizes):
        proc = subprocess.run([sys.executable, str(tmp_path / "worker.py"), device, how, batch], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return runs[0], runs[1]


def check_both_match_eager(cold: dict, warm: dict, tolerance: float = 1e-5) -> None:
    """Both match eager (largest difference of a loss, gradient or parameter), no graph fell back,
    no entry was bad, and a warm process hits or bypasses level 1 for every graph (the bypasses
    name their reason), tracing only the bypassed ones through AOTAutograd."""
    for run in (cold, warm):
        assert run["error"] < tolerance, run
        assert bool(run["counters"].get("compiled_autograd_graphs", 0)) == bool(run["backward"]), run
        assert run["counters"].get("cache_corrupt", 0) == 0 and run["counters"].get("graph_fallbacks", 0) == 0
    assert "g0" in warm["aot_hits"], warm  # the forward, compiled autograd or not
    assert not warm["aot_misses"], warm
    assert all(reason.strip() for reason in warm["bypassed"].values()), warm
    assert warm["calls"]["aot"] == len(warm["bypassed"]), warm
    assert warm["counters"]["cache_hit_module"] >= len(warm["aot_hits"]), warm  # each hit reads level 2


def check_cold_and_warm(cold: dict, warm: dict, tolerance: float = 1e-5) -> None:
    """``check_both_match_eager``, and under compiled autograd: the warm process loaded the
    forward and every backward graph from level 1 (none traced through AOTAutograd)."""
    check_both_match_eager(cold, warm, tolerance)
    for run in (cold, warm):
        assert run["counters"]["compiled_autograd_graphs"] == len(run["backward"]) >= 2, run
    assert set(cold["backward"]) <= set(cold["aot_misses"]), cold  # compiled and recorded
    assert set(warm["backward"]) <= set(warm["aot_hits"]), warm  # loaded from level 1
    assert set(warm["bypassed"]).isdisjoint(["g0", *warm["backward"]]), warm


def check_other_sizes(cold: dict, warm: dict, tolerance: float = 1e-5) -> None:
    """A warm process that trains on other batch sizes than the cold one: both match eager, no
    graph bypasses level 1 or falls back, the graphs of the cold process's first batch (the forward
    and its backward) hit, and only the graphs that missed (new batch sizes: compiled and written)
    were traced through AOTAutograd."""
    for run in (cold, warm):
        assert run["error"] < tolerance and run["bypassed"] == {}, run
        assert not run["counters"].get("cache_corrupt") and not run["counters"].get("graph_fallbacks"), run
    assert {"g0", warm["backward"][0]} <= set(warm["aot_hits"]), warm
    assert warm["calls"]["aot"] == len(warm["aot_misses"]), warm
