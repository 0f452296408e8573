"""torch's precompile API with backend="cgtrees": ``aot_compile`` and ``save_compiled_function`` in
one process, ``torch.compiler.load_compiled_function`` in another, and every bad file a clear
error. Each process imports a snapshot of the backend taken once per module (a saved function
names the cgtrees source it was compiled by, and the tree may be edited while the tests run)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from snapshot_helpers import backend_snapshot
from subprocess_env import clean_env

MAGIC = b"cgtrees-precompiled/1"

WORKER = r'''
import json, sys, time
import torch

args = json.loads(sys.argv[1])
torch._dynamo.config.enable_aot_compile = True

import cgtrees.aot.compat as aot_compat  # imported in both roles, before any timer starts
import cgtrees.codegen as codegen
from cgtrees import counters

calls = {"aot": 0, "generate": 0}
real_aot, real_generate = aot_compat.aot_module_simplified, codegen.generate
def counting_aot(*a, **k):
    calls["aot"] += 1
    return real_aot(*a, **k)
def counting_generate(*a, **k):
    calls["generate"] += 1
    return real_generate(*a, **k)
aot_compat.aot_module_simplified, codegen.generate = counting_aot, counting_generate

nn = torch.nn
torch.manual_seed(0)
device = args.get("device", "cpu")
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8)).to(device)
x = torch.randn(8, 16).to(device)

def step(model, x):
    return model(x)

def infer(model, x):
    return model(x).relu()

def aliasing(x):  # a training graph's output that is a view of an input: the first cache level does not rebuild it
    return x.view(-1), x + 1

def run(fn):
    """Output, gradients and inference output of ``fn`` and of eager, on the current weights."""
    model.zero_grad(set_to_none=True)
    out = fn["step"](model, x)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        inference = fn["infer"](model, x)
    model.zero_grad(set_to_none=True)
    eager = model(x)
    eager.square().mean().backward()
    error = max([(out - eager).abs().max().item(), (inference - eager.relu()).abs().max().item()]
                + [(g - p.grad).abs().max().item() for g, p in zip(grads, model.parameters())])
    return {"out": out.detach(), "grads": grads, "inference": inference}, error

result = {}
if args["role"] == "save":
    start = time.perf_counter()
    fns = {"step": torch.compile(step, fullgraph=True, backend="cgtrees").aot_compile(((model, x), {}))}
    fns["step"](model, x)
    result["compile_first_s"] = time.perf_counter() - start
    with torch.no_grad():
        fns["infer"] = torch.compile(infer, fullgraph=True, backend="cgtrees").aot_compile(((model, x), {}))
    for name, fn in fns.items():
        fn.save_compiled_function(args["dir"] + f"/{name}.bin")
    torch.save(model.state_dict(), args["dir"] + "/weights.pt")
    outputs, result["error_vs_eager"] = run(fns)
    torch.save(outputs, args["dir"] + "/saved.pt")
    bad = torch.compile(aliasing, fullgraph=True, backend="cgtrees").aot_compile(((x.clone().requires_grad_(),), {}))
    try:
        bad.save_compiled_function(args["dir"] + "/aliasing.bin")
        result["aliasing_error"] = None
    except Exception as exc:
        result["aliasing_error"] = f"{type(exc).__name__}: {exc}"
elif args["role"] == "load":
    model.load_state_dict(torch.load(args["dir"] + "/weights.pt", map_location=device))
    start = time.perf_counter()
    with open(args["dir"] + "/step.bin", "rb") as f:
        fns = {"step": torch.compiler.load_compiled_function(f)}
    fns["step"](model, x)
    result["load_first_s"] = time.perf_counter() - start
    with open(args["dir"] + "/infer.bin", "rb") as f:
        fns["infer"] = torch.compiler.load_compiled_function(f)
    outputs, result["error_vs_eager"] = run(fns)
    torch.save(outputs, args["dir"] + "/loaded.pt")
    with torch.no_grad():  # new weights: parameters are inputs of the loaded graphs
        for p in model.parameters():
            p.mul_(-0.5).add_(0.25)
    _, result["error_after_new_weights"] = run(fns)
elif args["role"] == "dynamo":  # plain torch.compile, Dynamo's cache on (CGTREES_PRECOMPILE_CACHE=1)
    from torch._dynamo.utils import counters as torch_counters

    if args.get("break_guards"):  # as torch 2.11 unpickling BERT's guards (DefaultsSource)
        import torch._dynamo.package as package

        def load_guards_state(data):
            raise TypeError("DefaultsSource.__init__() takes from 3 to 4 positional arguments but 6 were given")

        package.load_guards_state = load_guards_state
    compiled = torch.compile(model, backend="cgtrees")
    result["batches"] = []
    for batch in args["batches"]:
        xb = torch.randn(batch, 16).to(device)
        model.zero_grad(set_to_none=True)
        out = compiled(xb)
        out.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        eager = model(xb)
        eager.square().mean().backward()
        error = max([(out - eager).abs().max().item()]
                    + [(g - p.grad).abs().max().item() for g, p in zip(grads, model.parameters())])
        c = counters.snapshot()
        result["batches"].append({"error_vs_eager": error, "graphs_compiled": c["graphs_compiled"],
                                  "precompile_loaded": c.get("precompile_loaded", 0), "aot": calls["aot"],
                                  "dynamo_cache": dict(torch_counters["dynamo_cache"])})
else:  # "bad": each file must fail to load with a clear error
    result["errors"] = {}
    for path in args["files"]:
        try:
            with open(path, "rb") as f:
                torch.compiler.load_compiled_function(f)
            result["errors"][path] = None
        except Exception as exc:
            result["errors"][path] = f"{type(exc).__name__}: {exc}"
c = counters.snapshot()
result["counters"] = {k: c.get(k, 0) for k in ("kernels_generated", "precompile_loaded", "cudagraph_skips",
                                                 "graphs_compiled", "cudagraph_recorded", "cudagraph_replayed")}
result["calls"] = calls
print(json.dumps(result))
'''


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return backend_snapshot(tmp_path_factory.mktemp("snapshot"), WORKER)


def _run(snapshot: Path, cache_dir: Path, interpret: bool, env: dict[str, str] | None = None, **args) -> dict:
    env = {**clean_env(), **(env or {})}
    env.update(CGTREES_CACHE_DIR=str(cache_dir), PYTHONPATH=str(snapshot), CGTREES_INTERPRET="1" if interpret else "0")
    proc = subprocess.run([sys.executable, str(snapshot / "worker.py"), json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved(snapshot, tmp_path_factory):
    """Functions compiled and saved by one process (Triton kernels through the interpreter)."""
    folder = tmp_path_factory.mktemp("saved")
    result = _run(snapshot, folder / "cache", True, role="save", dir=str(folder))
    assert result["error_vs_eager"] < 1e-5
    assert result["calls"]["aot"] == 3 and result["calls"]["generate"] > 0
    return folder, result


def test_loaded_function_matches_eager_without_aot_or_codegen(snapshot, saved, tmp_path):
    folder, _ = saved
    # A new process with an empty cache: all it has is the saved files.
    result = _run(snapshot, tmp_path / "cache", True, role="load", dir=str(folder))
    assert result["calls"] == {"aot": 0, "generate": 0}, result  # no AOT trace, no codegen
    assert result["counters"]["kernels_generated"] == 0 and result["counters"]["graphs_compiled"] == 0
    assert result["counters"]["precompile_loaded"] == 2
    # Each loaded graph went through the runtime (on CPU: one counted skip per function).
    assert result["counters"]["cudagraph_skips"] == 3
    assert result["error_vs_eager"] < 1e-5
    assert result["error_after_new_weights"] < 1e-5
    a, b = torch.load(folder / "saved.pt"), torch.load(folder / "loaded.pt")
    assert torch.equal(a["out"], b["out"]) and torch.equal(a["inference"], b["inference"])
    assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))


def test_graph_level_one_cannot_rebuild_fails_at_save_with_the_reason(saved):
    _, result = saved
    error = result["aliasing_error"]
    assert error is not None and error.startswith("PrecompileError: cgtrees: cannot save")
    assert "output 0 aliases an input or intermediate (alias_of_input)" in error, error


def test_load_is_fast(snapshot, tmp_path):
    """Load and first call against compile and first call, aten mode (no interpreter: on CPU the
    interpreted kernels' run time would dominate both sides). Measured on the 2-core development
    machine: 0.07-0.09. Other processes share those cores, and one process runs up to 1.7x slower
    than the next, so the loads are timed twice and the faster one taken, and the bound is 0.25,
    not the 0.15 target (printed for the record)."""
    first = _run(snapshot, tmp_path / "cache", False, role="save", dir=str(tmp_path))
    loads = [_run(snapshot, tmp_path / f"cache{i}", False, role="load", dir=str(tmp_path)) for i in range(2)]
    for load in loads:
        assert load["calls"] == {"aot": 0, "generate": 0} and load["error_vs_eager"] < 1e-5
    ratio = min(r["load_first_s"] for r in loads) / first["compile_first_s"]
    print(f"precompile: compile + first call {first['compile_first_s']:.3f} s; load + first call "
          + ", ".join(f"{r['load_first_s']:.3f}" for r in loads) + f" s; ratio {ratio:.3f}")
    assert ratio <= 0.25


def _edit(src: Path, dst: Path, old: bytes | None = None, new: bytes | None = None, flip: bool = False) -> Path:
    """A copy of a saved function with our artifact inside it edited in place (same length, so
    torch's pickle around it stays valid): ``old`` replaced by ``new`` with the checksum made to
    match (another version, another device), or one byte flipped without it (damage)."""
    data = src.read_bytes()
    start = data.index(MAGIC)
    header_end = data.index(b"\n", start)
    header = data[start:header_end]
    length = int(header.split(b"bytes=")[1])
    body = data[header_end + 1: header_end + 1 + length]
    if flip:
        i = body.index(b'"source"') + 2
        body = body[:i] + bytes([body[i] ^ 1]) + body[i + 1:]
    else:
        assert len(old) == len(new) and body.count(old) >= 1, (old, body[:300])
        body = body.replace(old, new)
        old_sha = header.split(b"sha256=")[1].split(b" ")[0]
        header = header.replace(old_sha, hashlib.sha256(body).hexdigest().encode())
    dst.write_bytes(data[:start] + header + b"\n" + body + data[header_end + 1 + length:])
    return dst


def test_bad_files_fail_to_load_with_the_reason(snapshot, saved, tmp_path):
    folder, _ = saved
    good = folder / "step.bin"
    torch_version, triton_version = torch.__version__, _triton_version()
    source = re.search(rb'"backend_source": "([0-9a-f]+)"', good.read_bytes()).group(1)
    other_source = bytes(reversed(source))
    cases = {
        "torch": (_edit(good, tmp_path / "torch.bin", f'"torch_version": "{torch_version}"'.encode(),
                        f'"torch_version": "9{torch_version[1:]}"'.encode()),
                  f"saved by torch 9{torch_version[1:]}, this process has {torch_version}"),
        "triton": (_edit(good, tmp_path / "triton.bin", f'"triton_version": "{triton_version}"'.encode(),
                         f'"triton_version": "9{triton_version[1:]}"'.encode()),
                   f"saved by Triton 9{triton_version[1:]}"),
        "cgtrees": (_edit(good, tmp_path / "cgtrees.bin", source, other_source),
                    f"saved by cgtrees (source hash) {other_source.decode()}, this process has {source.decode()}"),
        "device": (_edit(good, tmp_path / "device.bin", b'"device": "cpu", "torch_version"',  # the function's origin
                         b'"device": "xpu", "torch_version"'),
                   "saved for xpu; this process has no xpu device"),
        "damaged": (_edit(good, tmp_path / "damaged.bin", flip=True), "damaged (checksum mismatch)"),
    }
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    garbled = tmp_path / "garbled.bin"
    garbled.write_bytes(bytes(reversed(good.read_bytes())))
    files = [str(path) for path, _ in cases.values()] + [str(truncated), str(garbled)]
    result = _run(snapshot, tmp_path / "cache", True, role="bad", files=files)
    errors = result["errors"]
    for name, (path, expected) in cases.items():
        assert errors[str(path)] is not None and errors[str(path)].startswith("PrecompileError: cgtrees:"), name
        assert expected in errors[str(path)], (name, errors[str(path)])
    # Cut or scrambled around our bytes: torch's own unpickler refuses the file.
    assert errors[str(truncated)] is not None and errors[str(garbled)] is not None
    print("\n".join(f"{Path(p).name}: {e}" for p, e in errors.items()))
    assert result["counters"]["precompile_loaded"] == 0 and result["calls"] == {"aot": 0, "generate": 0}


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def test_dynamo_cache_skips_the_trace_in_a_warm_process(snapshot, tmp_path):
    """``CGTREES_PRECOMPILE_CACHE=1``: a plain torch.compile saves Dynamo's cache (guards, bytecode,
    our artifact) at the first call; a later process installs it without tracing or compiling; a
    guard that fails there compiles afresh; a damaged or foreign artifact is a miss; guards that
    torch fails to load compile afresh."""
    env = {"CGTREES_PRECOMPILE_CACHE": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    cold = _run(snapshot, tmp_path / "cache", False, env=env, role="dynamo", batches=[8])["batches"]
    assert cold[0]["graphs_compiled"] == 1 and cold[0]["dynamo_cache"] == {"dynamo_cache_miss": 1}
    entries = list((tmp_path / "inductor" / "dynamo").glob("*/entry"))
    assert len(entries) == 1
    # A new process with an empty cgtrees cache: Dynamo's cache is all it has.
    warm, other_shape = _run(snapshot, tmp_path / "cache_warm", False, env=env, role="dynamo",
                             batches=[8, 5])["batches"]
    assert warm["dynamo_cache"] == {"dynamo_cache_hit": 1}
    assert warm["graphs_compiled"] == 0 and warm["aot"] == 0 and warm["precompile_loaded"] == 1
    assert warm["error_vs_eager"] < 1e-5
    assert other_shape["graphs_compiled"] == 1 and other_shape["error_vs_eager"] < 1e-5  # guard failed: compiled
    good = entries[0].read_bytes()
    source = re.search(rb'"backend_source": "([0-9a-f]+)"', good).group(1)
    (tmp_path / "good_entry").write_bytes(good)
    for damage in ("damaged", "foreign"):
        if damage == "damaged":
            _edit(tmp_path / "good_entry", entries[0], flip=True)
        else:
            _edit(tmp_path / "good_entry", entries[0], source, bytes(reversed(source)))
        again = _run(snapshot, tmp_path / f"cache_{damage}", False, env=env, role="dynamo", batches=[8])["batches"]
        assert again[0]["dynamo_cache"] == {"dynamo_cache_error": 1}, damage  # Dynamo's miss, counted
        assert again[0]["graphs_compiled"] == 1 and again[0]["error_vs_eager"] < 1e-5, damage
    # Saved guards that torch cannot load (an error inside its install): compiled afresh, no crash.
    entries[0].write_bytes(good)
    broken = _run(snapshot, tmp_path / "cache_broken", False, env=env, role="dynamo", batches=[8],
                  break_guards=True)["batches"]
    assert broken[0]["graphs_compiled"] == 1 and broken[0]["error_vs_eager"] < 1e-5


LEAN = r'''
import json, sys, torch
torch._dynamo.config.enable_aot_compile = True
nn = torch.nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))
x = torch.randn(8, 16)

def step(model, x):  # a tensor made inside: a graph constant, kept in the saved function
    return model(x) * torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])

path = sys.argv[2] + "/lean.bin"
if sys.argv[1] == "save":
    fn = torch.compile(step, fullgraph=True, backend="cgtrees").aot_compile(((model, x), {}))
else:
    with open(path, "rb") as f:
        fn = torch.compiler.load_compiled_function(f)
out = fn(model, x)
out.square().mean().backward()
grads = [p.grad.clone() for p in model.parameters()]
if sys.argv[1] == "save":
    fn.save_compiled_function(path)
    torch.save({"out": out.detach(), "grads": grads}, sys.argv[2] + "/lean_saved.pt")
else:
    saved = torch.load(sys.argv[2] + "/lean_saved.pt")
    assert torch.equal(saved["out"], out.detach())
    assert all(torch.equal(a, b) for a, b in zip(saved["grads"], grads))
print(json.dumps({m: m in sys.modules for m in ("torch._functorch.aot_autograd", "cgtrees.aot.driver")}))
'''


def test_loading_imports_no_aot_autograd(snapshot, tmp_path):
    """A loaded function (its graph holding a constant) runs its forward and backward without
    importing AOTAutograd or our driver (which the compile needs)."""
    script = tmp_path / "lean.py"
    script.write_text(LEAN)
    env = clean_env()
    env.update(PYTHONPATH=str(snapshot), CGTREES_INTERPRET="0")
    results = []
    for role, cache in (("save", "cache"), ("load", "empty_cache")):
        env["CGTREES_CACHE_DIR"] = str(tmp_path / cache)
        proc = subprocess.run([sys.executable, str(script), role, str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    saved, loaded = results
    assert saved == {"torch._functorch.aot_autograd": True, "cgtrees.aot.driver": True}, saved  # the compile's
    assert loaded == {"torch._functorch.aot_autograd": False, "cgtrees.aot.driver": False}, loaded


def test_dynamo_cache_loading_mends_torch_errors(monkeypatch):
    """``compat._mend_dynamo_cache_loading`` (on with the ``precompile_cache`` option): a grad that
    Dynamo's guard state saved as ``_Missing`` loads as none instead of raising a TypeError, and any
    other error installing a saved entry becomes the RuntimeError torch recovers from."""
    from torch._dynamo import guards, package

    from cgtrees.precompile import compat

    def broken_install(self, backends):
        raise TypeError("a torch bug")

    monkeypatch.setattr(package.CompilePackage, "install", broken_install)
    pickler = guards.GuardsStatePickler
    monkeypatch.setattr(pickler, "_unpickle_tensor", pickler.__dict__["_unpickle_tensor"])
    compat._mend_dynamo_cache_loading()
    with pytest.raises(RuntimeError, match="could not be installed .TypeError: a torch bug.; compiling afresh"):
        package.CompilePackage.install(None, {})
    meta = torch.empty(2, 3, device="meta")
    keys = torch._C._dispatch_keys(torch.empty(2, 3)).raw_repr()
    loaded = pickler._unpickle_tensor(meta, torch.device("cpu"), torch.Tensor, keys, guards._Missing("grad"))
    assert loaded.shape == (2, 3) and loaded.grad is None
    compat._mend_dynamo_cache_loading()  # a second call wraps nothing twice
    assert package.CompilePackage.install.__wrapped__ is broken_install


def test_the_collector_is_paused_while_a_saved_entry_installs(monkeypatch):
    """Dynamo's install of a saved entry runs with Python's cyclic collector off (what it makes all
    lives on; a full collection there walked GPT-2's whole process, 0.2 s), and the collector is on
    again after, a failed install too; a program that turned it off keeps it off."""
    import gc

    from torch._dynamo import guards, package

    from cgtrees.precompile import compat

    seen = []

    def install(self, backends):
        seen.append(gc.isenabled())
        if backends.get("fail"):
            raise ValueError("a bad entry")

    monkeypatch.setattr(package.CompilePackage, "install", install)
    pickler = guards.GuardsStatePickler  # mended too: restored after the test, as install is
    monkeypatch.setattr(pickler, "_unpickle_tensor", pickler.__dict__["_unpickle_tensor"])
    compat._mend_dynamo_cache_loading()
    assert gc.isenabled()
    package.CompilePackage.install(None, {})
    assert seen == [False] and gc.isenabled()
    with pytest.raises(RuntimeError, match="a bad entry"):
        package.CompilePackage.install(None, {"fail": True})
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        package.CompilePackage.install(None, {})
        assert seen == [False] * 3 and not gc.isenabled()
    finally:
        gc.enable()


def test_guard_sources_pickle_their_constructor_fields_only(monkeypatch):
    """torch 2.11's sources pickle every dataclass field, ``DefaultsSource``'s computed ``field`` and
    ``_name`` too, and fail to unpickle (a saved entry guarding a default never loaded): mended."""
    import dataclasses
    import pickle

    from torch import _guards
    from torch._dynamo.source import DefaultsSource, LocalSource

    from cgtrees.precompile import compat

    def every_field(self):  # torch 2.11's reduce
        return (self.__class__, tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    every_field.__module__ = _guards.__name__
    monkeypatch.setattr(_guards.Source, "__reduce__", every_field)
    if "__reduce__" in DefaultsSource.__dict__:
        monkeypatch.setattr(DefaultsSource, "__reduce__", every_field)
    source = DefaultsSource(LocalSource("f"), 1)
    with pytest.raises(TypeError, match="positional arguments"):
        pickle.loads(pickle.dumps(source))
    compat._mend_source_pickling()
    loaded = pickle.loads(pickle.dumps(source))
    assert loaded == source and loaded._name == source._name
    assert pickle.loads(pickle.dumps(LocalSource("x"))) == LocalSource("x")


def test_guard_state_tensors_share_one_fake_mode(monkeypatch):
    """The mended ``_unpickle_tensor`` gives the tensors Dynamo's own would (size, strides, dtype,
    device, type, grad), all in one fake mode instead of a new mode each."""
    from torch._dynamo import guards

    from cgtrees.precompile import compat

    pickler = guards.GuardsStatePickler
    original = pickler.__dict__["_unpickle_tensor"]
    monkeypatch.setattr(pickler, "_unpickle_tensor", original)
    compat._mend_dynamo_cache_loading()
    args = []
    for real in (torch.empty(4, 6).t(), torch.nn.Parameter(torch.empty(3, dtype=torch.float64))):
        meta = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta",
                                   requires_grad=real.requires_grad)
        args.append((meta, real.device, type(real), torch._C._dispatch_keys(real).raw_repr(), None))
    ours = [pickler._unpickle_tensor(*a) for a in args]
    theirs = [original.__func__(pickler, *a) for a in args]
    assert ours[0].fake_mode is ours[1].fake_mode
    assert theirs[0].fake_mode is not theirs[1].fake_mode  # what the mending saves
    for a, b in zip(ours, theirs):
        assert (a.shape, a.stride(), a.dtype, a.device, type(a), a.requires_grad, a.grad) == \
               (b.shape, b.stride(), b.dtype, b.device, type(b), b.requires_grad, b.grad)


def test_a_loaded_function_takes_this_processs_runtime_settings():
    """A saved function keeps the options it was compiled with, except those that do not shape its
    code where the loading process sets them (``CGTREES_WARM_FIRST_CALLS=0`` turns the first calls
    off there); one that shapes the code stays as saved, whatever the environment says."""
    from cgtrees.config import Config
    from cgtrees.precompile import _saved_config, loaded_config

    saved = _saved_config(Config.resolve(options={"cudagraphs": False, "max_shapes_per_function": 3},
                                         environ={}))
    environ = {"CGTREES_WARM_FIRST_CALLS": "0", "CGTREES_LAYOUT_OPT": "force", "CGTREES_UNFUSE_ADDMM": "0"}
    here = loaded_config(saved, environ)
    assert here.warm_first_calls is False  # set here: this process's
    assert here.layout_opt == "auto" and here.unfuse_addmm is True  # shape the code: as saved
    assert here.cudagraphs is False and here.max_shapes_per_function == 3  # not set here: as saved
    assert loaded_config(saved, {}) == Config.resolve(options=saved, environ={})


def test_precompile_cache_says_once_what_dropped_guards_mean(tmp_path):
    """Torch names each guard it drops under its caching precompile; we say once what that means
    (a swapped global function runs the old graph: README, why it is not the default)."""
    script = tmp_path / "two.py"
    script.write_text("import torch\n"
                      "for k in (2, 3):\n"
                      "    f = lambda x: x.sin() * k * len(x.shape) if all(s > 0 for s in x.shape) else x\n"
                      "    torch.compile(f, backend='cgtrees')(torch.randn(4))\n")  # all, len: dropped guards
    env = {**clean_env(), "CGTREES_PRECOMPILE_CACHE": "1", "CGTREES_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("CGTREES_PRECOMPILE_CACHE=1: Dynamo drops the guards it cannot save") == 1, done.stderr
    assert "runs the old graph without an error" in done.stderr
    assert "is dropped with caching_precompile" not in done.stderr  # torch's line per guard: ours says it once
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_torchs_dropped_guard_lines_show_when_its_guard_log_is_verbose():
    """The filter hides torch's per-guard warning only: other warnings of that logger pass, and with
    the logger at debug (``TORCH_LOGS=+dynamo``) the per-guard lines pass too."""
    import logging

    from cgtrees.precompile.compat import _GUARDS_LOG, _DroppedGuardLines

    logger = logging.getLogger(_GUARDS_LOG)
    keep = _DroppedGuardLines(logger)

    def record(msg: str, *args: object) -> logging.LogRecord:
        return logger.makeRecord(_GUARDS_LOG, logging.WARNING, __file__, 1, msg, args, None)

    dropped = record("%s guard on %s is dropped with caching_precompile=True.", "ID_MATCH", "G['f']")
    level = logger.level
    try:
        logger.setLevel(logging.WARNING)
        assert not keep.filter(dropped)
        assert keep.filter(record("another guard warning"))
        logger.setLevel(logging.DEBUG)
        assert keep.filter(dropped)
    finally:
        logger.setLevel(level)
