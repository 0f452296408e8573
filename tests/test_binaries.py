"""The checks that decide whether a stored binary may be launched (``cgtrees.codegen.binaries``), on
CPU: what the binary assumes of each argument, and the JIT for everything else. The loading and
launching themselves need a GPU: tests/gpu/test_binaries_gpu.py."""

from __future__ import annotations

import pytest
import torch

from cgtrees.codegen import binaries, compat


class FakeLoaded:
    """Stands in for ``compat.LoadedBinary``: records launches, or fails to load, or is hooked."""

    fail: str | None = None
    hooked = False

    def __init__(self, names, record):
        self.names, self.launches = names, []

    def launch(self, grid, args):
        if FakeLoaded.fail:
            raise compat.LoadFailed(FakeLoaded.fail)
        if FakeLoaded.hooked:
            return False
        self.launches.append((grid, args))
        return True


class constexpr:  # noqa: N801 - stands for tl.constexpr, which is all the launcher reads of an annotation
    pass


def kernel_fn(in_ptr, out_ptr, xnumel, ks, XBLOCK: constexpr):  # noqa: N803 - as generated
    """The parameters of a generated kernel (its body is never run here)."""


class FakeJit:
    """Triton's JIT, as the fallback: records the launches it is given."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((grid, args, meta))


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(compat, "LoadedBinary", FakeLoaded)
    monkeypatch.setattr(FakeLoaded, "fail", None)
    monkeypatch.setattr(FakeLoaded, "hooked", False)
    # Compiled for aligned pointers, xnumel divisible by 16 (an i32), ks == 1 baked in, XBLOCK 128.
    record = {"signature": ["*fp32", "*fp32", "i32", "constexpr", "constexpr"], "constants": [[3, 1], [4, 128]],
              "divisible": [0, 1, 2], "metadata": {"num_warps": 4}, "binary": ""}
    jit = FakeJit()
    return binaries.CachedKernel(kernel_fn, [binaries.Binary(kernel_fn, record)], "test", jit), jit


def launch(kernel, x, out, xnumel=1024, ks=1, **meta):
    kernel[(8,)](x, out, xnumel, ks, **{"XBLOCK": 128, "num_warps": 4, **meta})


def test_arguments_that_fit_launch_the_binary_with_every_parameter(kernel):
    cached, jit = kernel
    x, out = torch.empty(64), torch.empty(64)
    launch(cached, x, out)
    assert cached.binaries[0].loaded.launches == [((8,), (x, out, 1024, 1, 128))]
    assert jit.launches == []


@pytest.mark.parametrize("change", [
    {"misaligned": True}, {"xnumel": 1000}, {"ks": 2}, {"xnumel": 2**31}, {"XBLOCK": 64}, {"num_warps": 8},
    {"num_stages": 2},
])
def test_arguments_the_binary_does_not_assume_go_through_the_jit(kernel, change):
    cached, jit = kernel
    x = torch.empty(65)[1:] if change.pop("misaligned", False) else torch.empty(64)
    launch(cached, x, torch.empty(64), **change)
    assert cached.binaries[0].loaded.launches == []
    assert len(jit.launches) == 1


def test_a_pointer_the_binary_does_not_assume_aligned_may_be_misaligned(kernel):
    """A binary compiled without an assumption runs whatever the argument is."""
    cached, jit = kernel
    cached.binaries[0].aligned = [0]  # out_ptr no longer assumed aligned
    x, out = torch.empty(64), torch.empty(65)[1:]
    launch(cached, x, out)
    assert len(cached.binaries[0].loaded.launches) == 1 and jit.launches == []


def test_a_binary_that_fails_to_load_is_dropped_for_the_jit(kernel, caplog):
    cached, jit = kernel
    FakeLoaded.fail = "needs 300000 bytes of shared memory"
    x, out = torch.empty(64), torch.empty(64)
    launch(cached, x, out)
    assert cached.binaries == [] and len(jit.launches) == 1
    assert "could not be loaded" in caplog.text and "shared memory" in caplog.text
    FakeLoaded.fail = None
    launch(cached, x, out)
    assert len(jit.launches) == 2


def test_a_hooked_launch_goes_through_the_jit(kernel):
    cached, jit = kernel
    FakeLoaded.hooked = True
    launch(cached, torch.empty(64), torch.empty(64))
    assert len(jit.launches) == 1 and len(cached.binaries) == 1


@pytest.mark.parametrize("bad", [
    {"signature": ["*fp32", "*fp32", "fp32", "constexpr", "constexpr"]},  # a float argument: not checked here
    {"signature": ["*fp32", "*fp32", "i32", "constexpr"]},  # not this kernel's parameters
    {"constants": [[3, 1]]},  # XBLOCK's value missing
])
def test_records_the_launcher_cannot_check_are_refused(monkeypatch, bad):
    monkeypatch.setattr(compat, "LoadedBinary", FakeLoaded)
    record = {"signature": ["*fp32", "*fp32", "i32", "constexpr", "constexpr"], "constants": [[3, 1], [4, 128]],
              "divisible": [], "metadata": {"num_warps": 4}, "binary": "", **bad}
    with pytest.raises(binaries.Unusable):
        binaries.Binary(kernel_fn, record)



SOURCE = '''import triton
import triton.language as tl


@triton.jit
def pw_0(in_ptr, out_ptr, xnumel, ks, XBLOCK: tl.constexpr):
    pass


@triton.jit
def pw_1(in_ptr, out_ptr, xnumel, ks, XBLOCK: tl.constexpr):
    pass
'''


def test_a_warm_load_leaves_kernels_with_binaries_undecorated(monkeypatch, tmp_path):
    """``exec_deferred`` runs the source with only the kernels that have records left as plain
    functions (at their own lines), and ``install`` gives each a stand-in; the others keep Triton's
    decorator."""
    import types

    monkeypatch.setattr(compat, "LoadedBinary", FakeLoaded)
    record = {"signature": ["*fp32", "*fp32", "i32", "i32", "constexpr"], "constants": [[4, 128]],
              "divisible": [0, 1], "metadata": {"num_warps": 4}, "binary": ""}
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    module = types.ModuleType("m")
    binaries.exec_deferred(module, SOURCE, str(path), {"pw_0": [record]})
    assert type(module.pw_0) is types.FunctionType
    lines = SOURCE.splitlines()  # the function's lines are those of the file: its decorator, then its def
    first = module.pw_0.__code__.co_firstlineno
    assert lines[first - 1:first + 1] == ["@triton.jit", "def pw_0(in_ptr, out_ptr, xnumel, ks, XBLOCK: tl.constexpr):"]
    assert type(module.pw_1) is not types.FunctionType  # decorated by Triton (JIT or interpreter)
    assert binaries.install(module, {"pw_0": [record]}, "m") == 1
    assert isinstance(module.pw_0, binaries.CachedKernel) and module.pw_0._jit is None
    assert binaries.install(module, {"pw_0": [record]}, "m") == 1 and module.pw_0._jit is None  # again: no JIT
    x = torch.empty(64)
    module.pw_0[(1,)](x, x, 64, 3, XBLOCK=128, num_warps=4)
    assert len(module.pw_0.binaries[0].loaded.launches) == 1 and module.pw_0._jit is None


def test_the_cache_keeps_what_a_module_captures_and_passes_it_back(monkeypatch, caplog):
    import dataclasses
    import json

    from cgtrees import codegen
    from cgtrees.aot.rebuild import load_module
    from cgtrees.cache import modules
    from cgtrees.compiled import CompiledGraph, GraphFacts
    from cgtrees.compiled_function import CompiledPart
    from cgtrees.config import Config

    graph = CompiledGraph("", GraphFacts(), kernels=("pw_0",))
    captured = {"pw_0": [{"binary": "..."}]}

    class Module(codegen.KernelModule):
        def __init__(self, fails: bool) -> None:
            self.graph, self.name, self.fails = graph, "m", fails

        def compiled(self):
            if self.fails:
                raise RuntimeError("no device")
            return dataclasses.replace(self.graph, binaries=captured)

    interpreted = Config(interpret=True)
    assert modules.kept_graph(Module(False), interpreted).binaries == captured
    assert modules.kept_graph(Module(True), interpreted).binaries == {} and "no device" in caplog.text
    seen = {}
    monkeypatch.setattr(codegen, "load", lambda graph, ctx, **kw: seen.update(kw, graph=graph))
    record = CompiledPart("inference", "m", dataclasses.replace(graph, binaries={"pw_0": []}, code={"python": "x"}),
                          ()).as_record()
    load_module(CompiledPart.from_record(json.loads(json.dumps(record))), None)
    assert seen["fresh"] is False and seen["graph"].binaries == {"pw_0": []} and seen["graph"].code == {"python": "x"}
    assert seen["graph"] == graph  # the rest of what it is, as it was kept


@pytest.mark.parametrize("junk", ["junk", [{"signature": 3}], [None], {"binary": ""}])
def test_junk_records_leave_a_deferred_kernel_on_the_jit(monkeypatch, tmp_path, junk, caplog):
    """Records that cannot be read (only a bug could store them: entries are checksummed) still
    give the undecorated kernel its stand-in, which launches through the JIT."""
    import types

    monkeypatch.setattr(compat, "LoadedBinary", FakeLoaded)
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    module = types.ModuleType("m")
    binaries.exec_deferred(module, SOURCE, str(path), {"pw_0": junk})
    assert binaries.install(module, {"pw_0": junk}, f"m{id(junk)}") == 0
    assert isinstance(module.pw_0, binaries.CachedKernel) and module.pw_0.binaries == []
    assert "not usable" in caplog.text


def _deferred_load(tmp_path, code=None):
    import types

    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    module = types.ModuleType("m")
    binaries.exec_deferred(module, SOURCE, str(path), {"pw_0": []}, code)
    return module, path


def test_a_stored_code_object_runs_instead_of_compiling_the_source(monkeypatch, tmp_path):
    """A warm load runs the entry's code object (``code_record``): no compile, the same module as
    from the source, and every function's file is the module's path, where Triton's JIT reads a
    kernel's source when it decorates it later."""
    import inspect
    import types

    code = binaries.code_record(SOURCE, {"pw_0": []})
    monkeypatch.setattr(binaries, "compile", lambda *a, **k: pytest.fail("compiled"), raising=False)
    module, path = _deferred_load(tmp_path, code)
    assert type(module.pw_0) is types.FunctionType and type(module.pw_1) is not types.FunctionType
    assert module.pw_0.__code__.co_filename == str(path)
    assert inspect.getsource(module.pw_0).startswith("@triton.jit\ndef pw_0(")
    monkeypatch.undo()
    fresh, _ = _deferred_load(tmp_path)
    assert module.pw_0.__code__.co_firstlineno == fresh.pw_0.__code__.co_firstlineno


def test_a_self_contained_record_keeps_the_compiled_code_too(monkeypatch, tmp_path):
    """A level-1 record that holds its module (precompile's file, Dynamo's cache, a store-less
    entry) keeps the code object a warm load runs, as a level-2 entry does: the load compiles no
    source (it compiled 153 kernels' source in a warm convnet start on the H100, 0.06-0.1 s)."""
    import dataclasses

    from cgtrees import codegen
    from cgtrees.aot.recorder import part_module
    from cgtrees.compiled import CompiledGraph, GraphFacts
    from cgtrees.config import Config

    class Module(codegen.KernelModule):
        def __init__(self) -> None:
            self.graph, self.name = CompiledGraph(SOURCE, GraphFacts(), kernels=("pw_0", "pw_1")), "m"

        def compiled(self):
            return dataclasses.replace(self.graph, binaries={"pw_0": []})

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    kept = part_module(gm, Module(), Config())
    assert isinstance(kept, CompiledGraph) and kept.code == binaries.code_record(SOURCE, {"pw_0": []})
    monkeypatch.setattr(binaries, "compile", lambda *a, **k: pytest.fail("compiled"), raising=False)
    module, _ = _deferred_load(tmp_path, kept.code)
    assert callable(module.pw_0)
    interpreted = part_module(gm, Module(), Config(interpret=True))  # kernels load from their source
    assert interpreted.code is None


@pytest.mark.parametrize("bad", ["another_python", "garbled", "not_a_record"])
def test_a_stored_code_object_this_interpreter_cannot_use_compiles_the_source(tmp_path, bad, caplog):
    import types

    code = binaries.code_record(SOURCE, {"pw_0": []})
    code = {"another_python": {**code, "python": "0d0d0a0a"}, "garbled": {**code, "marshal": "AAAA"},
            "not_a_record": "junk"}[bad]
    module, path = _deferred_load(tmp_path, code)
    assert type(module.pw_0) is types.FunctionType and module.pw_0.__code__.co_filename == str(path)
    assert ("unreadable" in caplog.text) == (bad == "garbled")


def _meta(**fields):
    base = {"num_warps": 4, "shared": 1024, "num_ctas": 1, "global_scratch_size": 0, "profile_scratch_size": 0,
            "launch_pdl": False, "launch_cooperative_grid": False, "tensordesc_meta": None}
    return __import__("types").SimpleNamespace(**{**base, **fields})


def test_torchs_static_launcher_gets_the_binary_s_arguments_only(monkeypatch):
    """The static launch plan: one letter per argument the binary takes; constexprs (an int
    specialised to 1 among the run-time ones, then the constexpr parameters) are left out, and a
    null pointer goes in for each of Triton 3.6's scratch buffers."""
    calls = []
    monkeypatch.setattr(compat, "_static_launch_kernel", lambda: lambda *a: calls.append(a))
    signature = ["*fp32", "i32", "constexpr", "*fp16", "i64", "constexpr", "constexpr"]
    plan = compat.StaticLaunch.plan(signature, _meta())
    assert plan.types == "OiOlOO" and plan.num_warps == 4 and plan.shared == 1024
    a, b = torch.empty(1), torch.empty(1)
    args = (a, 7, 1, b, 2**40, 128, True)  # every parameter's value, as ``LoadedBinary.launch`` gets them
    assert plan.arguments(args) == (a, 7, b, 2**40, None, None)
    # no constexpr among the run-time arguments: a slice
    plan = compat.StaticLaunch.plan(["*fp32", "*fp32", "i32", "constexpr"], _meta(profile_scratch_size=0))
    assert plan.keep is None and plan.arguments((a, b, 5, 64)) == (a, b, 5, None, None)
    assert compat.StaticLaunch.plan(["*fp32"], _meta()).arguments((a,)) == (a, None, None)


@pytest.mark.parametrize("field", [{"num_ctas": 2}, {"global_scratch_size": 256}, {"profile_scratch_size": 8},
                                   {"launch_pdl": True}, {"launch_cooperative_grid": True},
                                   {"tensordesc_meta": [{"block": [16]}]}])
def test_what_torchs_static_launcher_cannot_do_keeps_tritons_launcher(monkeypatch, field):
    monkeypatch.setattr(compat, "_static_launch_kernel", lambda: lambda *a: None)
    assert compat.StaticLaunch.plan(["*fp32", "i32"], _meta()) is not None
    assert compat.StaticLaunch.plan(["*fp32", "i32"], _meta(**field)) is None
    assert compat.StaticLaunch.plan(["*fp32", "nvTmaDesc"], _meta()) is None  # a type it has no letter for
    monkeypatch.setattr(compat, "_static_launch_kernel", lambda: None)  # a torch without it
    assert compat.StaticLaunch.plan(["*fp32", "i32"], _meta()) is None
