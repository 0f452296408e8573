"""The persistent cache across processes: warm start, bad entries, unsafe or unwritable
directories, concurrent writers, and the off switch. Each case runs fresh Python processes (the
worker below) against a private cache directory, importing a snapshot of the backend taken once
per session: the key hashes our source, and a tree being edited would make every run a miss."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from snapshot_helpers import backend_snapshot
from subprocess_env import clean_env

from cgtrees.cache.store import SCHEMA

SNAPSHOT: list[Path] = []

WORKER = r'''
import errno, json, os, sys, tempfile, time
import torch

args = json.loads(sys.argv[1])
if args.get("torch_version"):
    torch.__version__ = args["torch_version"]
if args.get("fail"):  # disk full / read-only directory, simulated (tests run as root)
    code = {"full": errno.ENOSPC, "readonly": errno.EROFS}[args["fail"]]
    def fail(*a, **k):
        raise OSError(code, os.strerror(code))
    if args["fail"] == "full":
        os.fsync = fail
    else:
        tempfile.mkstemp = fail

import cgtrees.aot.compat as aot_compat
import cgtrees.aot.partition as partition_module
from cgtrees import counters

calls = {"aot": 0, "partition": 0}
real_aot, real_partition = aot_compat.aot_module_simplified, partition_module.split
def counting_aot(*a, **k):
    calls["aot"] += 1
    return real_aot(*a, **k)
def counting_partition(*a, **k):
    calls["partition"] += 1
    return real_partition(*a, **k)
aot_compat.aot_module_simplified, partition_module.split = counting_aot, counting_partition

torch.manual_seed(0)
if args["model"] == "demo":
    from cgtrees.demo import DemoBlock
    model, x = DemoBlock(128, 4), torch.randn(4, 64, 128)
else:
    nn = torch.nn
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))
    x = torch.randn(8, 16)
compiled = torch.compile(model, backend="cgtrees", options=args.get("options") or None)

start = time.perf_counter()
out = compiled(x)
first_output_s = time.perf_counter() - start
out.square().mean().backward()
first_step_s = time.perf_counter() - start
from torch._dynamo.utils import compile_times  # Dynamo's phases so far: the first step's compile
names, seconds = compile_times(repr="csv", aggregate=True)
phases = dict(zip(names, map(float, seconds)))
dynamo_own_s = phases.get("_compile.compile_inner", 0.0) - phases.get("OutputGraph.call_user_compiler", 0.0)
with torch.no_grad():
    start = time.perf_counter()
    inference = compiled(x)
    inference_s = time.perf_counter() - start
grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad(set_to_none=True)
eager_out = model(x)
eager_out.square().mean().backward()
error_vs_eager = max([(out - eager_out).abs().max().item(), (inference - eager_out).abs().max().item()]
                     + [(g - p.grad).abs().max().item() for g, p in zip(grads, model.parameters())])
for p, g in zip(model.parameters(), grads):
    p.grad = g
if args.get("save"):
    torch.save({"out": out.detach(), "grads": [p.grad for p in model.parameters()], "inference": inference},
               args["save"])
c = counters.snapshot()
keys = [f"cache_{e}{level}" for e in ("hit", "miss", "bypass", "corrupt") for level in ("", "_aot", "_module")]
print(json.dumps({"counters": {k: c.get(k, 0) for k in keys}, "calls": calls,
                  "error_vs_eager": error_vs_eager, "first_output_s": first_output_s,
                  "first_step_s": first_step_s, "inference_s": inference_s,
                  "dynamo_own_s": dynamo_own_s,
                  "frames_traced": torch._dynamo.utils.counters["stats"]["unique_graphs"]}))
'''


@pytest.fixture(scope="module", autouse=True)
def _snapshot(tmp_path_factory):
    SNAPSHOT[:] = [backend_snapshot(tmp_path_factory.mktemp("snapshot"))]
    yield
    SNAPSHOT.clear()


def _env(cache_dir: Path, **extra: str) -> dict[str, str]:
    env = clean_env()
    env.update(CGTREES_CACHE_DIR=str(cache_dir), PYTHONPATH=str(SNAPSHOT[0]), **extra)
    return env


def _start(tmp_path: Path, cache_dir: Path, model: str = "mlp", env: dict[str, str] | None = None,
           **args) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    if not script.exists():
        script.write_text(WORKER)
    return subprocess.Popen([sys.executable, str(script), json.dumps({"model": model, **args})],
                            env=env or _env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    result["stderr"] = err
    return result


def _run(tmp_path: Path, cache_dir: Path, **kw) -> dict:
    return _finish(_start(tmp_path, cache_dir, **kw))


def _entries(cache_dir: Path, level: str = "aot") -> list[Path]:
    return sorted((cache_dir / f"v{SCHEMA}" / level).glob("*.entry"))


def _same_results(a: Path, b: Path) -> None:
    ra, rb = torch.load(a), torch.load(b)
    assert torch.equal(ra["out"], rb["out"])
    assert torch.equal(ra["inference"], rb["inference"])
    for ga, gb in zip(ra["grads"], rb["grads"]):
        assert torch.equal(ga, gb)


@pytest.fixture(scope="module")
def _cold_once(tmp_path_factory):
    root = tmp_path_factory.mktemp("cold")
    cache_dir = root / "cache"
    result = _run(root, cache_dir, save=str(root / "cold.pt"))
    assert result["counters"]["cache_miss_aot"] == 2  # one training graph, one inference graph
    assert len(_entries(cache_dir)) == 2
    return root


@pytest.fixture
def cold(tmp_path, _cold_once):
    """A copy of a cache filled by one cold run of the small model, and that run's results."""
    shutil.copytree(_cold_once / "cache", tmp_path / "cache")
    return tmp_path / "cache", _cold_once / "cold.pt"


def _codegen_ready() -> bool:
    from cgtrees import codegen

    return hasattr(codegen, "generate") and hasattr(codegen, "load")


@pytest.mark.timing
def test_warm_start_skips_aot_and_is_fast(tmp_path):
    """A second process hits both graphs, traces nothing through AOTAutograd, gets the same
    numbers, and the part of its first training step that is ours (everything but Dynamo's own
    tracing of the frame, which no backend can skip) takes at most 30% of the first process's.

    Aten mode: in interpret mode both are dominated by running the interpreted kernels. On this
    2-core machine a whole process runs up to 1.7x slower from one run to the next, so each side
    is timed in three processes and the fastest are compared: three cold starts into three empty
    caches, three warm starts from the first. The whole first step (Dynamo included) is printed:
    Dynamo's trace of the frame (0.3-0.5 s) is in both, and puts that ratio at 0.25-0.37."""
    colds = [_run_demo(tmp_path / f"cold{i}", tmp_path / f"cache{i}") for i in range(3)]
    warms = [_run_demo(tmp_path / f"warm{i}", tmp_path / "cache0") for i in range(3)]
    for first in colds:
        assert first["calls"]["aot"] == 2 and first["calls"]["partition"] == 1
    for second in warms:
        assert second["counters"]["cache_hit_aot"] == 2, second
        assert second["counters"]["cache_miss"] == 0 and second["counters"]["cache_corrupt"] == 0
        assert second["calls"] == {"aot": 0, "partition": 0}  # no AOT tracing, no partitioning
    _same_results(tmp_path / "cold0" / "out.pt", tmp_path / "warm0" / "out.pt")

    def fastest(runs: list[dict], ours: bool = False) -> float:
        return min(r["first_step_s"] - (r["dynamo_own_s"] if ours else 0.0) for r in runs)

    whole, ours = fastest(warms) / fastest(colds), fastest(warms, True) / fastest(colds, True)
    print("DemoBlock first training step (s): cold " + ", ".join(f"{r['first_step_s']:.2f}" for r in colds)
          + "; warm " + ", ".join(f"{r['first_step_s']:.2f}" for r in warms)
          + f"; fastest warm / fastest cold: {whole:.2f} whole, {ours:.2f} without Dynamo's own tracing "
          f"(cold {fastest(colds, True):.2f} s, warm {fastest(warms, True):.2f} s)")
    assert ours <= 0.30


@pytest.mark.timing
def test_warm_start_with_dynamo_cache_skips_the_trace_and_is_fast(tmp_path):
    """Issue 19's CPU figure for the transparent path: with ``CGTREES_PRECOMPILE_CACHE=1`` a warm
    process installs Dynamo's saved guards and bytecode instead of tracing the frame, so the whole
    first training step, Dynamo included, is what counts: at most 0.30x the cold one's. Timed as the
    test above (fastest of three processes on each side, aten mode)."""
    def run(name: str, cache: str) -> dict:
        (tmp_path / name).mkdir()
        env = _env(tmp_path / cache, CGTREES_PRECOMPILE_CACHE="1",
                   TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{cache}"))
        return _run(tmp_path / name, tmp_path / cache, model="demo", env=env, save=str(tmp_path / name / "out.pt"))

    colds = [run(f"cold{i}", f"cache{i}") for i in range(3)]
    warms = [run(f"warm{i}", "cache0") for i in range(3)]
    for first in colds:
        assert first["calls"]["aot"] == 2 and first["frames_traced"] == 2  # training, then inference
    for second in warms:
        assert second["calls"] == {"aot": 0, "partition": 0}
        assert second["frames_traced"] == 0, second  # Dynamo's cache installed both graphs: no trace
        assert second["error_vs_eager"] < 1e-5
    _same_results(tmp_path / "cold0" / "out.pt", tmp_path / "warm0" / "out.pt")
    whole = min(r["first_step_s"] for r in warms) / min(r["first_step_s"] for r in colds)
    print("DemoBlock first training step with Dynamo's cache (s): cold "
          + ", ".join(f"{r['first_step_s']:.2f}" for r in colds) + "; warm "
          + ", ".join(f"{r['first_step_s']:.2f}" for r in warms) + f"; fastest warm / fastest cold {whole:.2f}")
    assert whole <= 0.30


def _run_demo(tmp_path: Path, cache_dir: Path) -> dict:
    tmp_path.mkdir()
    return _run(tmp_path, cache_dir, model="demo", save=str(tmp_path / "out.pt"))


@pytest.mark.skipif(not _codegen_ready(), reason="codegen has no generate()/load() yet")
def test_warm_start_with_triton_kernels_through_the_interpreter(tmp_path):
    cache_dir = tmp_path / "cache"
    env = _env(cache_dir, CGTREES_INTERPRET="1")
    first = _run(tmp_path, cache_dir, env=env, save=str(tmp_path / "cold.pt"))
    assert first["counters"]["cache_miss_aot"] == 2 and first["counters"]["cache_miss_module"] == 3
    assert len(_entries(cache_dir, "module")) == 3
    second = _run(tmp_path, cache_dir, env=env, save=str(tmp_path / "warm.pt"))
    assert second["counters"]["cache_hit_aot"] == 2 and second["counters"]["cache_miss"] == 0, second
    assert second["calls"] == {"aot": 0, "partition": 0}
    _same_results(tmp_path / "cold.pt", tmp_path / "warm.pt")


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbled", "checksum", "foreign"])
def test_bad_entry_is_corrupt_removed_and_recompiled(tmp_path, cold, damage):
    cache_dir, cold_results = cold
    entries = _entries(cache_dir)
    target = entries[0]
    data = target.read_bytes()
    if damage == "truncated":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        target.write_bytes(b"")
    elif damage == "garbled":
        target.write_bytes(bytes(reversed(data)))
    elif damage == "checksum":  # same length, one payload byte changed
        i = data.index(b'"parts"') + 2
        target.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1:])
    else:  # a good entry of another key under this key's name
        target.write_bytes(entries[1].read_bytes())
    result = _run(tmp_path, cache_dir, save=str(tmp_path / "again.pt"))
    assert result["counters"]["cache_corrupt_aot"] == 1, result
    assert result["counters"]["cache_hit_aot"] == 1  # the other graph's entry is fine
    _same_results(cold_results, tmp_path / "again.pt")
    # Recompiled and rewritten as a good entry.
    from cgtrees.cache.store import decode

    assert "function" in decode(target.read_bytes(), "aot", target.stem)


def test_level_one_entries_refer_to_level_two(cold):
    """A level-1 entry holds no module source: each generated module is named by the digest of
    the level-2 entry that holds it."""
    from cgtrees.cache.store import decode
    from cgtrees.compiled_function import CompiledFunction, Level2Ref

    cache_dir, _ = cold
    modules = {p.stem for p in _entries(cache_dir, "module")}
    for entry in _entries(cache_dir):
        function = CompiledFunction.from_record(decode(entry.read_bytes(), "aot", entry.stem)["function"])
        assert b'"source"' not in entry.read_bytes()
        refs = [part.module for part in function.parts]
        assert refs and all(isinstance(r, Level2Ref) and r.digest in modules for r in refs), refs


@pytest.mark.parametrize("damage", ["removed", "garbled"])
def test_level_one_hit_without_its_kernel_modules_is_a_miss(tmp_path, cold, damage):
    """Kernel-module entries gone (evicted, removed) or damaged: each level-1 hit that needs one
    becomes a counted miss that recompiles (a damaged module entry also counts as corrupt), never a
    crash or a wrong result; both levels are written again, and the next process hits."""
    cache_dir, cold_results = cold
    n_modules = len(_entries(cache_dir, "module"))
    for entry in _entries(cache_dir, "module"):
        if damage == "removed":
            entry.unlink()
        else:
            entry.write_bytes(bytes(reversed(entry.read_bytes())))
    result = _run(tmp_path, cache_dir, save=str(tmp_path / "again.pt"))
    counters = result["counters"]
    assert counters["cache_miss_aot"] == 2 and counters["cache_hit_aot"] == 0, counters
    assert counters["cache_corrupt_aot"] == 0 and result["calls"]["aot"] == 2
    # each damaged entry is read once (by level 1, or by the recompile's level-2 lookup), then removed
    assert counters["cache_corrupt_module"] == (n_modules if damage == "garbled" else 0), counters
    _same_results(cold_results, tmp_path / "again.pt")
    third = _run(tmp_path, cache_dir, save=str(tmp_path / "third.pt"))
    assert third["counters"]["cache_hit_aot"] == 2 and third["counters"]["cache_miss"] == 0, third["counters"]
    _same_results(cold_results, tmp_path / "third.pt")


def test_other_torch_version_is_a_miss_never_loaded(tmp_path, cold):
    cache_dir, cold_results = cold
    result = _run(tmp_path, cache_dir, torch_version="2.0.0+other", save=str(tmp_path / "other.pt"))
    assert result["counters"]["cache_hit"] == 0 and result["counters"]["cache_miss_aot"] == 2
    assert result["counters"]["cache_corrupt"] == 0
    assert result["calls"]["aot"] == 2
    _same_results(cold_results, tmp_path / "other.pt")
    assert len(_entries(cache_dir)) == 4  # its own entries, beside the first version's


@pytest.mark.parametrize("unsafe", ["group_writable", "other_owner"])
def test_unsafe_directory_is_never_loaded(tmp_path, cold, unsafe):
    cache_dir, cold_results = cold
    if unsafe == "group_writable":
        os.chmod(cache_dir / f"v{SCHEMA}", 0o770)
    else:
        os.chown(cache_dir / f"v{SCHEMA}", os.getuid() + 4242, -1)
    result = _run(tmp_path, cache_dir, save=str(tmp_path / "unsafe.pt"))
    assert result["counters"]["cache_hit"] == 0 and result["calls"]["aot"] == 2
    assert "cache disabled" in result["stderr"]
    _same_results(cold_results, tmp_path / "unsafe.pt")


@pytest.mark.parametrize("fail", ["full", "readonly"])
def test_unwritable_cache_compiles_uncached(tmp_path, fail):
    cache_dir = tmp_path / "cache"
    result = _run(tmp_path, cache_dir, fail=fail, save=str(tmp_path / "a.pt"))
    assert "could not write cache entry" in result["stderr"]
    assert _entries(cache_dir) == []
    assert not list((cache_dir / f"v{SCHEMA}" / "aot").glob(".tmp-*"))  # no temp file left behind
    assert result["error_vs_eager"] < 1e-5


@pytest.mark.parametrize("n", [2, 4])
def test_concurrent_cold_processes_leave_one_entry_per_graph(tmp_path, n):
    cache_dir = tmp_path / "cache"
    procs = [_start(tmp_path, cache_dir, save=str(tmp_path / f"r{i}.pt")) for i in range(n)]
    results = [_finish(p) for p in procs]
    assert all(r["counters"]["cache_corrupt"] == 0 for r in results)
    for i in range(1, n):
        _same_results(tmp_path / "r0.pt", tmp_path / f"r{i}.pt")
    entries = _entries(cache_dir)
    assert len(entries) == 2
    from cgtrees.cache.store import decode

    assert all("function" in decode(e.read_bytes()) for e in entries)
    assert not list((cache_dir / f"v{SCHEMA}" / "aot").glob(".tmp-*"))


def test_cache_off_by_option_and_env(tmp_path):
    cache_dir = tmp_path / "cache"
    result = _run(tmp_path, cache_dir, options={"cache": False})
    assert not any(result["counters"].values()), result["counters"]
    result = _run(tmp_path, cache_dir, env=_env(cache_dir, CGTREES_CACHE="0"))
    assert result["counters"]["cache_miss"] == 0 and result["counters"]["cache_hit"] == 0
    assert _entries(cache_dir) == []


def test_cli_info_and_clear(tmp_path, cold):
    cache_dir, _ = cold

    def cli(action: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "cgtrees", "cache", action], env=_env(cache_dir),
                              capture_output=True, text=True, timeout=120, cwd=SNAPSHOT[0])
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    info = cli("info")
    assert f"location: {cache_dir / f'v{SCHEMA}'}" in info
    n = len(_entries(cache_dir)) + len(_entries(cache_dir, "module"))
    assert f"entries: {n} (2 AOT results" in info and "cache_hit=0" in info
    assert f"removed {n} entries" in cli("clear")
    assert "entries: 0" in cli("info")


ALIAS_WORKER = r'''
import json, torch
from torch._dynamo.utils import counters
f = torch.compile(lambda x: (x.view(-1, 4), x.sum()), backend="cgtrees")
x = torch.randn(2, 8, 4)
with torch.no_grad():
    view, total = f(x)
right = torch.equal(view, x.view(-1, 4)) and torch.allclose(total, x.sum())
view.mul_(0)  # a view of the caller's input, as eager's: the write reaches x
print(json.dumps({"right": bool(right), "view_of_x": view._base is x, "writes_through": bool((x == 0).all()),
                  "counters": dict(counters["cgtrees"])}))
'''


def test_an_output_that_is_a_view_of_an_input_hits_the_first_level(tmp_path):
    """Issue 46's first repro: an inference graph returning a view of its input (``x.view(-1, 4)``)
    bypassed the first level ("output 0 aliases an input"), so a warm process traced it again. Its
    output is a view of the caller's input in the cold and the warm process alike (our runtime
    rebuilds such outputs over the caller's input), and the warm process traces nothing."""
    script = tmp_path / "alias.py"
    script.write_text(ALIAS_WORKER)
    cache_dir = tmp_path / "cache"
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script)], env=_env(cache_dir), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    for run in runs:
        assert run["right"] and run["view_of_x"] and run["writes_through"], run
    assert cold["counters"].get("cache_bypass", 0) == 0 and cold["counters"]["cache_miss_aot"] == 1, cold
    assert warm["counters"].get("cache_hit_aot") == 1 and not warm["counters"].get("cache_miss"), warm
