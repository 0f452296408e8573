"""Cache keys, the entry format and the store, and the kernel-module level, in process."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from backend.cache import modules
from backend.cache.key import graph_text, make_key
from backend.cache.store import CorruptEntry, Store, base_dir, decode, encode
from backend.config import Config
from backend.context import GraphContext


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
    assert store is not None and store.root == tmp_path / "c" / "v1"
    assert os.stat(store.root).st_mode & 0o777 == 0o700
    os.chmod(store.root / "aot", 0o777)
    with caplog.at_level(logging.WARNING, logger="backend.cache"):
        assert Store.open(config) is None
    assert "writable by group or others" in caplog.text


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


def test_store_write_failure_is_a_warning(tmp_path, monkeypatch, caplog):
    store = Store.open(Config(cache_dir=str(tmp_path)))

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with caplog.at_level(logging.WARNING, logger="backend.cache"):
        assert store.write("module", "d4", {"source": "x"}) is False
    assert "could not write cache entry" in caplog.text
    assert store.usage().entries == 0 and not list((store.root / "module").iterdir())


@pytest.mark.skipif(not hasattr(modules.codegen, "generate"), reason="codegen has no generate() yet")
def test_kernel_module_level_shares_one_aten_graph(tmp_path, cgtrees_counters):
    """Two graphs that differ only in names share one kernel module entry."""
    config = Config(cache_dir=str(tmp_path))
    x, y = torch.randn(4, 8), torch.randn(8, 3)
    results = []
    for rename in ("", "_other"):
        gm = make_fx(_graph(rename))(x, y)
        ctx = GraphContext(config=config, kind="inference", name=f"t{rename}")
        module = modules.compile_module(gm, [x, y], ctx)
        results.append(module.call([x, y]))
    assert cgtrees_counters["cache_miss_module"] == 1 and cgtrees_counters["cache_hit_module"] == 1
    assert torch.equal(results[0][0], results[1][0])
