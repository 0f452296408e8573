"""Cache keys, the entry format and the store, and the kernel-module level, in process."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import types

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from cgtrees.cache import modules
from cgtrees.cache.key import graph_text, make_key
from cgtrees.cache.store import SCHEMA, CorruptEntry, Store, base_dir, decode, encode
from cgtrees.config import Config
from cgtrees.context import GraphContext


def _graph(rename: str = "") -> torch.fx.GraphModule:
    def f(x, y):
        return torch.relu(x @ y) + 1.0

    gm = torch.fx.symbolic_trace(f)
    for node in gm.graph.nodes:
        if node.op != "output":
            node.name = node.name + rename
    gm.recompile()
    return gm


def _key(gm=None, inputs=None, config=None):
    inputs = inputs if inputs is not None else [torch.randn(4, 8), torch.randn(8, 3)]
    return make_key("module", gm or _graph(), inputs, config or Config(), (1,), [("kind", "inference")])


def test_key_ignores_node_names_but_not_shapes():
    assert graph_text(_graph()) == graph_text(_graph("_renamed"))
    assert _key(_graph()).digest() == _key(_graph("_renamed")).digest()
    other = _key(inputs=[torch.randn(4, 8), torch.randn(8, 5)])
    assert other.digest() != _key().digest()
    assert [d.split(":")[0] for d in _key().diff(other)] == ["inputs"]


def test_key_fields_print_and_diff_names_the_field():
    key = _key()
    text = key.describe()
    for f in dataclasses.fields(key):
        assert f"{f.name}:" in text
    changed = dataclasses.replace(key, torch_version="0.0")
    assert key.diff(changed) == [f"torch_version: line 0: {torch.__version__!r} != '0.0'"]
    assert key.diff(key.as_dict()) == []


def test_key_takes_exactly_the_codegen_fields_of_the_config():
    declared = {f.name for f in dataclasses.fields(Config) if f.metadata["affects_codegen"]}
    assert {name for name, _ in _key().codegen} == declared
    assert _key(config=Config(interpret=True)).digest() != _key().digest()
    assert _key(config=Config(cudagraphs=False)).digest() == _key().digest()  # no effect on code


def test_entry_format_detects_damage():
    data = encode({"level": "module", "digest": "ab", "source": "x = 1"})
    assert decode(data, "module", "ab")["source"] == "x = 1"
    for bad in (b"", data[:-3], data[::-1], data.replace(b"x = 1", b"x = 2")):
        with pytest.raises(CorruptEntry):
            decode(bad, "module", "ab")
    with pytest.raises(CorruptEntry, match="another key"):
        decode(data, "module", "cd")


def test_cache_directory_precedence(tmp_path):
    assert base_dir(Config(cache_dir=str(tmp_path)), {"XDG_CACHE_HOME": "/x"}) == tmp_path
    assert str(base_dir(Config(), {"XDG_CACHE_HOME": "/x"})) == "/x/cgtrees"
    assert str(base_dir(Config(), {})).endswith(".cache/cgtrees")
    assert Config.resolve(environ={"CGTREES_CACHE_DIR": str(tmp_path)}).cache_dir == str(tmp_path)


def test_store_is_private_and_refuses_unsafe_directories(tmp_path, caplog):
    config = Config(cache_dir=str(tmp_path / "c"))
    store = Store.open(config)
    assert store is not None and store.root == tmp_path / "c" / f"v{SCHEMA}"
    assert os.stat(store.root).st_mode & 0o777 == 0o700
    os.chmod(store.root / "aot", 0o777)
    with caplog.at_level(logging.WARNING, logger="cgtrees.cache"):
        assert Store.open(config) is None
    assert "writable by group or others" in caplog.text
    # the remedy, in the user's words (issue 46)
    assert f"chmod 700 {store.root / 'aot'}" in caplog.text and "CGTREES_CACHE_DIR" in caplog.text


def test_an_unusable_cache_directory_says_what_to_set(tmp_path, monkeypatch, caplog):
    """A cache directory that cannot be created (a read-only file system: the OSError is injected,
    root ignores modes) compiles uncached and says which variables to set."""
    from cgtrees import logs
    from cgtrees.cache import store as store_module

    def read_only(path):
        raise OSError(30, "Read-only file system", str(path))

    logs.forget()
    monkeypatch.setattr(store_module, "_mkdir_private", read_only)
    with caplog.at_level(logging.WARNING, logger="cgtrees.cache"):
        assert Store.open(Config(cache_dir=str(tmp_path / "ro"))) is None
    assert "unusable" in caplog.text and "Read-only file system" in caplog.text, caplog.text
    assert "Set CGTREES_CACHE_DIR to a writable directory, or CGTREES_CACHE=0" in caplog.text, caplog.text


def test_store_write_read_evict_clear(tmp_path):
    store = Store.open(Config(cache_dir=str(tmp_path)))
    for i, digest in enumerate(["a1", "b2", "c3"]):
        assert store.write("module", digest, {"source": "x" * 1000})
        os.utime(store.path("module", digest), (i, i))
    store.read("module", "a1")  # a hit makes it the most recently used
    assert store.evict(2500) == 1
    assert sorted(p.stem for p in store.entry_paths()) == ["a1", "c3"]
    assert store.usage().entries == 2
    assert store.clear() == 2 and store.usage().entries == 0


def test_cli_clear_on_a_read_only_cache_says_what_to_do(tmp_path, monkeypatch, capsys):
    """``python -m cgtrees cache clear`` where the entries cannot be removed (a read-only file
    system; root ignores file modes, so the OSError is injected): a message that names the
    directory, what was removed and the remedy, exit 1, not a traceback (issue 46)."""
    from pathlib import Path

    from cgtrees.cache import cli

    config = Config(cache_dir=str(tmp_path))
    store = Store.open(config)
    for digest in ("a1", "b2"):
        assert store.write("module", digest, {"source": "x"})

    def read_only(path, missing_ok=False):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(Path, "unlink", read_only)
    assert cli.main("clear", config) == 1
    out = capsys.readouterr().out
    assert f"could not clear {store.root}: Read-only file system" in out, out
    assert "removed 0 of 2 entries" in out and "is on a read-only file system" in out, out
    assert "CGTREES_CACHE_DIR" in out and "chmod" not in out, out  # no mode makes a read-only mount writable
    monkeypatch.undo()
    assert cli.main("clear", config) == 0
    assert "removed 2 entries" in capsys.readouterr().out


def test_store_write_failure_is_a_warning(tmp_path, monkeypatch, caplog):
    store = Store.open(Config(cache_dir=str(tmp_path)))

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with caplog.at_level(logging.WARNING, logger="cgtrees.cache"):
        assert store.write("module", "d4", {"source": "x"}) is False
    assert "could not write cache entry" in caplog.text
    assert store.usage().entries == 0 and not list((store.root / "module").iterdir())


def test_kernel_module_level_shares_one_aten_graph(tmp_path, cgtrees_counters):
    """Two graphs that differ only in names share one kernel module entry: key, look up, codegen
    and store, as the driver lists them."""
    from cgtrees import codegen

    config = Config(cache_dir=str(tmp_path))
    x, y = torch.randn(4, 8), torch.randn(8, 3)
    results, digests = [], []
    for rename in ("", "_other"):
        gm = make_fx(_graph(rename))(x, y)
        ctx = GraphContext(config=config, kind="inference", name=f"t{rename}")
        key = modules.key_for(gm, [x, y], ctx)
        digests.append(key.digest)
        module = modules.lookup(key, gm, [x, y], ctx)
        if module is None:
            module = codegen.compile_graph(gm, [x, y], dataclasses.replace(ctx, cache_key=key.digest))
            assert modules.store(key, module, ctx)
        results.append(module.call([x, y]))
    assert cgtrees_counters["cache_miss_module"] == 1 and cgtrees_counters["cache_hit_module"] == 1
    assert digests[0] == digests[1]
    assert torch.equal(results[0][0], results[1][0])


def test_module_header_shows_the_graph_text_digest_and_the_key(tmp_path):
    """One canonical graph text: the module's graph hash is the digest of the text the key holds,
    and its header names it and the key's digest (the name of its cache entry), as the driver
    compiles it; without the cache the header says so and still names the graph's digest."""
    from cgtrees.aot.driver import kernel_module
    from cgtrees.cache.key import graph_digest

    x, y = torch.randn(4, 8), torch.randn(8, 3)
    gm = make_fx(_graph())(x, y)
    ctx = GraphContext(config=Config(cache_dir=str(tmp_path)), kind="inference", name="t")
    key = modules.key_for(gm, [x, y], ctx)
    module, _ = kernel_module(gm, [x, y], ctx)
    assert module.graph.graph_hash == graph_digest(gm) == graph_digest(make_fx(_graph("_renamed"))(x, y))
    assert f"# graph hash: {graph_digest(gm)}" in module.source
    assert f"# cache key: {key.digest}" in module.source
    uncached, _ = kernel_module(gm, [x, y], dataclasses.replace(ctx, config=Config(cache=False)))
    assert "# cache key: none (not cached)" in uncached.source and uncached.graph.graph_hash == graph_digest(gm)


def test_store_keeps_generated_modules_only(tmp_path):
    """A graph that runs through aten has no source: level 2 keeps nothing for it."""
    from cgtrees import codegen

    x, y = torch.randn(4, 8), torch.randn(8, 3)
    gm = make_fx(_graph())(x, y)
    ctx = GraphContext(config=Config(cache_dir=str(tmp_path)), kind="inference", name="t")
    key = modules.key_for(gm, [x, y], ctx)
    assert not modules.store(key, codegen.AtenModule(gm), ctx)
    assert not modules.store(None, codegen.compile_graph(gm, [x, y], ctx), ctx)
    assert modules.key_for(gm, [x, y], dataclasses.replace(ctx, config=Config(cache=False))) is None


def test_triton_key_is_computed_once_and_remembered_across_processes(tmp_path, monkeypatch):
    """Triton's hash of itself (0.3-0.5 s a process) is computed once however many threads ask, kept
    in our cache with a stamp of Triton's files, read back by a later process while the stamp holds,
    and computed again when the stamp changes or the file is damaged."""
    import threading

    from cgtrees.codegen import compat

    calls = []

    def compute():
        calls.append(1)
        return f"key{len(calls)}"

    path = tmp_path / "triton-key.json"
    first = compat.SharedKey(compute, path)
    threads = [threading.Thread(target=first) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert first() == "key1" and len(calls) == 1 and path.exists()

    def never():
        raise AssertionError("a remembered key must not be computed")

    assert compat.SharedKey(never, path)() == "key1"  # a later process reads it back

    monkeypatch.setattr(compat, "installed_stamp", lambda: "triton upgraded")
    assert compat.SharedKey(compute, path)() == "key2"  # stamp changed: computed again, and kept
    assert compat.SharedKey(never, path)() == "key2"

    for damage in (b"", b"{not json", b'{"key": "x"}'):
        path.write_bytes(damage)
        before = len(calls)
        assert compat.SharedKey(compute, path)() == f"key{before + 1}"  # damaged: computed again
    assert compat.SharedKey(never, path)() == f"key{len(calls)}"  # rewritten after the damage

    def refuse(*_args, **_kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(compat.os, "replace", refuse)
    path.unlink()
    assert compat.SharedKey(compute, path)() == f"key{len(calls)}"  # cannot keep it: still answers
    assert list(tmp_path.iterdir()) == []  # and leaves no temporary file behind
    assert compat.SharedKey(compute, None)() == f"key{len(calls)}"  # no cache: computed, nothing kept


def test_triton_stamp_follows_the_installed_files(tmp_path, monkeypatch):
    """The stamp changes with any file of the Triton package (size or mtime), nothing else."""
    import triton

    from cgtrees.codegen import compat

    fake = tmp_path / "triton"
    (fake / "_C").mkdir(parents=True)
    (fake / "__pycache__").mkdir()
    (fake / "__init__.py").write_text("x = 1\n")
    (fake / "_C" / "libtriton.so").write_bytes(b"\0" * 64)
    monkeypatch.setattr(triton, "__file__", str(fake / "__init__.py"))
    stamp = compat.installed_stamp()
    assert compat.installed_stamp() == stamp
    (fake / "__pycache__" / "x.pyc").write_bytes(b"bytecode")  # Python's byte-code cache is not Triton
    assert compat.installed_stamp() == stamp
    (fake / "_C" / "libtriton.so").write_bytes(b"\1" * 65)
    assert compat.installed_stamp() != stamp


class _Scale:
    def __init__(self, k: float) -> None:
        self.k = k

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


def test_key_refuses_a_call_target_bound_to_an_object():
    """``_Scale(2).apply`` and ``_Scale(3).apply`` have one qualified name and differ: a graph
    calling either has no canonical text (the first cache level bypasses it)."""
    from cgtrees.cache.compat import Uncacheable

    for k in (2.0, 3.0):
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        graph.output(graph.call_function(_Scale(k).apply, (x,)))
        with pytest.raises(Uncacheable, match="bound to an object"):
            graph_text(torch.fx.GraphModule(torch.nn.Module(), graph))


def test_key_names_a_pybind_function_published_on_its_module():
    """``torch._C._log_api_usage_once`` (in HF Llama's graphs) is bound to its pybind11 function
    record, yet it is the one object ``torch._C`` publishes under that name: it has a text."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch._C._log_api_usage_once, ("test",))
    graph.output(x)
    assert "torch._C._log_api_usage_once" in graph_text(torch.fx.GraphModule(torch.nn.Module(), graph))


def test_debug_dir_keeps_the_modules_of_a_level_one_hit(tmp_path, monkeypatch, cgtrees_counters):
    """``CGTREES_DEBUG_DIR`` gets every module with the cache on, also those a level-1 hit reads
    from level 2 (named by their entries' digests)."""
    debug = tmp_path / "debug"
    monkeypatch.setenv("CGTREES_DEBUG_DIR", str(debug))
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh()), torch.randn(3, 8)

    def train_step() -> list[str]:
        torch._dynamo.reset()
        torch.compile(model, backend="cgtrees")(x).sum().backward()
        written = sorted(p.read_text() for p in debug.glob("*.py"))
        for path in debug.glob("*.py"):
            path.unlink()
        return written

    cold = train_step()
    assert len(cold) == 2 and cgtrees_counters["cache_miss_aot"] == 1  # forward and backward
    assert train_step() == cold and cgtrees_counters["cache_hit_aot"] == 1


def test_key_names_a_target_by_the_module_that_publishes_it(monkeypatch):
    """torch 2.11 gives ``torch._C._log_api_usage_once`` the ``__module__`` of its pybind11 function
    record (``torch._C.pybind11_detail_function_record_v1_...``, the C++ ABI spelled out in it): the
    key names it by the module above that publishes it, as torch 2.13 does."""
    from cgtrees.cache.key import stable_name

    def probe():
        pass

    probe.__module__ = "torch._C.pybind11_detail_function_record_v1_system_libstdcpp_gxx_abi_1xxx"
    probe.__qualname__ = "_cgtrees_probe"
    monkeypatch.setattr(torch._C, "_cgtrees_probe", probe, raising=False)
    assert stable_name(probe) == "torch._C._cgtrees_probe"
    # and on the H100's torch 2.11 the record is in sys.modules too (the key then named it)
    monkeypatch.setitem(sys.modules, probe.__module__, types.ModuleType(probe.__module__))
    assert stable_name(probe) == "torch._C._cgtrees_probe"
    # or the record's name leads the qualname
    probe.__module__ = "torch._C"
    probe.__qualname__ = "pybind11_detail_function_record_v1_system_libstdcpp_gxx_abi_1xxx._cgtrees_probe"
    assert stable_name(probe) == "torch._C._cgtrees_probe"
    unpublished = lambda: None  # noqa: E731 - a target nothing publishes keeps its own module
    unpublished.__module__, unpublished.__qualname__ = "torch._C.nowhere", "_cgtrees_absent"
    assert stable_name(unpublished) == "torch._C.nowhere._cgtrees_absent"


def test_a_bypass_reason_warns_once_and_later_graphs_say_so_at_debug(caplog, cgtrees_counters):
    """One warning per reason and level in a process (DDP's pieces all bypass level 1 for one
    reason); every later graph still names itself and the reason at DEBUG, and every bypass counts."""
    from cgtrees import logs
    from cgtrees.cache import events

    logs.forget()
    with caplog.at_level(logging.DEBUG, logger="cgtrees.cache"):
        events.bypass("aot", "g0", "input 0 is a FakeTensor")
        events.bypass("aot", "g1", "input 0 is a FakeTensor")
        events.bypass("aot", "g2", "another reason")
        events.bypass("module", "g3", "input 0 is a FakeTensor")
    said = [(r.levelname, r.getMessage().split()[1]) for r in caplog.records
            if " by a new process " in r.getMessage()]
    assert said == [("WARNING", "g0"), ("DEBUG", "g1"), ("WARNING", "g2"), ("WARNING", "g3")], said
    assert all("input 0 is a FakeTensor" in r.getMessage() for r in caplog.records[:2])
    assert cgtrees_counters["cache_bypass"] == 4 and cgtrees_counters["cache_bypass_aot"] == 3


def test_triton_cache_dir_is_ours_for_our_compiles_only(tmp_path, monkeypatch):
    """Triton's on-disk cache goes beside our entries through Triton's own configuration, inside
    our compile only; the process's setting is back afterwards, and a directory the user chose wins."""
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    store = Store.open(Config(cache_dir=str(tmp_path)))
    before = knobs.cache.dir
    with modules.triton_cache_dir(store):
        assert knobs.cache.dir == str(store.triton_dir())
    assert knobs.cache.dir == before and "TRITON_CACHE_DIR" not in os.environ
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    with modules.triton_cache_dir(store):
        assert knobs.cache.dir == str(tmp_path / "mine")
    with modules.triton_cache_dir(None):
        assert knobs.cache.dir == str(tmp_path / "mine")
