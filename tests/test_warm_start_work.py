"""What a warm process does, counted (issue 53, "a warm start that does little"): a level-1 hit
traces nothing through AOTAutograd (its backward included), generates no kernel module, times no
GEMM, opens the store once per Dynamo graph (making no directory), reads each entry file once, imports neither our
partitioner nor our decompositions, and gives the cold process's numbers bit for bit.

Each side is a fresh process over one cache directory, importing a snapshot of the backend (the key
hashes our source, and the tree may be edited while the tests run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from snapshot_helpers import backend_snapshot
from subprocess_env import clean_env

WORKER = r'''
import collections, json, sys
import torch
import cgtrees.aot.compat as aot_compat
import cgtrees.aot.driver as driver
import cgtrees.aot.rebuild as rebuild
import cgtrees.codegen as codegen
import cgtrees.codegen.gemm_timing as gemm_timing
from cgtrees.cache.store import Store

calls, reads = collections.Counter(), collections.Counter()

def count(owner, name, label):
    real = getattr(owner, name)
    def counted(*a, **k):
        calls[label] += 1
        return real(*a, **k)
    setattr(owner, name, counted)

count(aot_compat, "aot_module_simplified", "aot")  # AOTAutograd's trace, forward and backward
count(driver.Compilers, "backward", "compile_backward")  # a backward compiled (AOTAutograd's or our lazy one)
count(rebuild.LazyBackward, "_compile", "lazy_backward")
count(codegen, "compile_graph", "codegen")
count(gemm_timing, "time_us", "gemm_timing")
real_open, real_read = Store.open.__func__, Store.read
def counted_open(cls, config):
    calls["store_open"] += 1
    return real_open(cls, config)
def counted_read(self, level, digest):
    reads[f"{level}/{digest}"] += 1
    return real_read(self, level, digest)
Store.open, Store.read = classmethod(counted_open), counted_read
import os
real_mkdir, cache_dir = os.mkdir, os.environ["CGTREES_CACHE_DIR"]
def counted_mkdir(path, *a, **k):  # Path.mkdir's too
    if str(path).startswith(cache_dir):
        calls["cache_mkdir"] += 1
    return real_mkdir(path, *a, **k)
os.mkdir = counted_mkdir

from cgtrees.demo import DemoBlock
torch.manual_seed(0)
model, x = DemoBlock(64, 4), torch.randn(2, 24, 64)
compiled = torch.compile(model, backend="cgtrees")
outs = []
for _ in range(3):  # three training steps: the backward runs, and runs again
    model.zero_grad(set_to_none=True)
    out = compiled(x)
    out.square().mean().backward()
    outs.append(out.detach())
torch.save({"outs": outs, "grads": [p.grad for p in model.parameters()]}, sys.argv[1])
from cgtrees import counters
c = counters.snapshot()
print(json.dumps({"calls": dict(calls), "reads": dict(reads),
                  "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                  "imported": [m for m in ("cgtrees.aot.partition", "cgtrees.aot.decompositions") if m in sys.modules],
                  "counters": {k: c.get(k, 0) for k in ("cache_hit_aot", "cache_hit_module", "cache_miss",
                                                         "cache_corrupt")}}))
'''


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return backend_snapshot(tmp_path_factory.mktemp("snapshot"), WORKER)


def _run(snapshot: Path, cache_dir: Path, save: Path) -> dict:
    env = clean_env()
    env.update(CGTREES_CACHE_DIR=str(cache_dir), CGTREES_CPU_PIPELINE="1", PYTHONPATH=str(snapshot))
    proc = subprocess.run([sys.executable, str(snapshot / "worker.py"), str(save)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_and_warm(snapshot, tmp_path_factory) -> tuple[dict, dict, Path]:
    root = tmp_path_factory.mktemp("warm-work")
    cold = _run(snapshot, root / "cache", root / "cold.pt")
    warm = _run(snapshot, root / "cache", root / "warm.pt")
    return cold, warm, root


def test_the_cold_process_compiled_what_the_warm_one_skips(cold_and_warm):
    """The counters below count real work: the cold process did it."""
    cold, _, _ = cold_and_warm
    assert cold["calls"]["aot"] == 1 and cold["calls"]["codegen"] >= 2, cold
    assert cold["calls"]["compile_backward"] == 1 and cold["calls"]["lazy_backward"] == 1, cold
    assert cold["counters"]["cache_miss"] > 0


def test_warm_start_traces_and_generates_nothing(cold_and_warm):
    """No AOTAutograd trace, no backward compiled (neither AOTAutograd's lazy one nor ours), no
    kernel module generated, no GEMM timed: everything comes from the entry."""
    _, warm, _ = cold_and_warm
    assert warm["counters"]["cache_hit_aot"] == warm["graphs"] == 1, warm
    assert warm["counters"]["cache_miss"] == 0 and warm["counters"]["cache_corrupt"] == 0, warm
    for work in ("aot", "compile_backward", "lazy_backward", "codegen", "gemm_timing"):
        assert warm["calls"].get(work, 0) == 0, (work, warm["calls"])


def test_warm_start_opens_the_store_once_per_graph_and_reads_each_entry_once(cold_and_warm):
    _, warm, _ = cold_and_warm
    assert warm["calls"]["store_open"] == warm["graphs"], warm["calls"]
    assert set(warm["reads"].values()) == {1}, warm["reads"]
    levels = collections_of(warm["reads"])
    assert levels == {"aot": 1, "module": warm["counters"]["cache_hit_module"]}, warm["reads"]


def test_warm_start_makes_no_cache_directory(cold_and_warm):
    """The store's directories exist: opening it stats each once and tries to make none."""
    cold, warm, _ = cold_and_warm
    assert cold["calls"]["cache_mkdir"] > 0
    assert warm["calls"].get("cache_mkdir", 0) == 0, warm["calls"]


def test_warm_start_imports_neither_partitioner_nor_decompositions(cold_and_warm):
    """Both are a miss's alone (``aot.driver`` imports them where a graph is partitioned or traced)."""
    cold, warm, _ = cold_and_warm
    assert "cgtrees.aot.partition" in cold["imported"]
    assert warm["imported"] == [], warm["imported"]


def test_warm_start_gives_the_cold_numbers(cold_and_warm):
    _, _, root = cold_and_warm
    cold, warm = torch.load(root / "cold.pt"), torch.load(root / "warm.pt")
    for a, b in zip(cold["outs"] + cold["grads"], warm["outs"] + warm["grads"], strict=True):
        assert torch.equal(a, b)


def collections_of(reads: dict[str, int]) -> dict[str, int]:
    """Entries read, by level."""
    levels: dict[str, int] = {}
    for name in reads:
        level = name.split("/")[0]
        levels[level] = levels.get(level, 0) + 1
    return levels
