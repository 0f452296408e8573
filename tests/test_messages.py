"""Messages a user reads say what is true and name the fix (issue 54, item 3): no usable cache
directory, ``cache info`` on a read-only directory, a write into a read-only cache, and the counters
of a warm run whose graphs all came from the cache (compiled means compiled)."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from cgtrees import logs
from cgtrees.config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read_only(path, *args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system", str(path))  # tests run as root: modes do not stop writes


def test_no_usable_cache_directory_says_so_once_and_nothing_claims_kernels_are_cached(tmp_path, monkeypatch, caplog,
                                                                                     cgtrees_counters):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    monkeypatch.setenv("CGTREES_CACHE_DIR", str(a_file / "cache"))
    logs.forget()
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x.sin() * 2).sum(), backend="cgtrees")
    x = torch.randn(8, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="cgtrees"):
        f(x).backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert "unusable" in warned[0] and "Set CGTREES_CACHE_DIR to a writable directory" in warned[0], warned
    assert "cached" not in warned[0].replace("uncached", ""), warned  # nothing says anything is cached
    assert cgtrees_counters["cache_bypass"] >= 2 and cgtrees_counters["cache_hit"] == 0


def test_cache_info_on_a_read_only_directory_says_it_first_and_compiles_nothing(tmp_path, monkeypatch, caplog):
    from cgtrees.cache import cli
    from cgtrees.cache import store as store_module

    logs.forget()
    monkeypatch.setattr(store_module, "_mkdir_private", _read_only)
    with caplog.at_level(logging.WARNING, logger="cgtrees"):
        text = cli.info(Config(cache_dir=str(tmp_path)))
    first = text.splitlines()[0]
    assert first.startswith(f"cgtrees cache: on, but {tmp_path} is not usable, so compiles run uncached"), first
    assert "Read-only file system" in first and "CGTREES_CACHE_DIR" in first, first
    assert "cgtrees cache: on\n" not in text + "\n"
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # info warns of no compile it does not run
    assert cli.info(Config(cache=False, cache_dir=str(tmp_path))).startswith("cgtrees cache: off")


def _permission_denied(path, *args, **kwargs):
    raise OSError(errno.EACCES, "Permission denied", str(path))


@pytest.mark.parametrize("refusal", [_read_only, _permission_denied])
def test_a_write_into_a_read_only_cache_names_the_fix(tmp_path, monkeypatch, caplog, refusal):
    from cgtrees.cache import store as store_module

    store = store_module.Store.open(Config(cache_dir=str(tmp_path)))
    assert store.write("module", "a1", {"source": "x"})  # a cache with entries, then made read-only
    logs.forget()
    monkeypatch.setattr(store_module, "_atomic_write", refusal)
    with caplog.at_level(logging.WARNING, logger="cgtrees.cache"):
        assert not store.write("module", "b2", {"source": "y"})
    assert store.read("module", "a1") is not None  # what is there is still read
    said = caplog.records[0].getMessage()
    assert "could not write cache entry" in said and "not stored" in said, said
    if refusal is _read_only:  # a mount: no file mode helps
        assert "Read-only file system" in said and f"Fix: {store.root} is on a read-only file system" in said, said
        assert "chmod" not in said, said
    else:
        assert f"Fix: make {store.root} writable (chmod -R u+w {store.root})" in said, said
    assert "CGTREES_CACHE_DIR" in said and "continuing uncached" not in said, said


@pytest.mark.parametrize("read_only_mount", [True, False])
def test_cache_info_on_a_cache_it_can_read_but_not_write_says_so(tmp_path, monkeypatch, read_only_mount):
    """Entries there still load; the first line says new ones are not stored, and the fix that fits."""
    import os as os_module

    from cgtrees.cache import cli
    from cgtrees.cache import store as store_module

    config = Config(cache_dir=str(tmp_path))
    assert store_module.Store.open(config).write("module", "a1", {"source": "x"})
    monkeypatch.setattr(store_module.os, "access", lambda path, mode: mode != os_module.W_OK)
    if read_only_mount:
        monkeypatch.setattr(store_module, "_mount_errno", lambda root: errno.EROFS)
    first, *rest = cli.info(config).splitlines()
    assert first.startswith("cgtrees cache: on, read-only: its entries are loaded, new ones are not stored"), first
    assert ("is on a read-only file system" in first) == read_only_mount, first
    assert ("chmod -R u+w" in first) != read_only_mount, first
    assert any(line.startswith("entries: 1 ") for line in rest), rest


WARM = """
import json, torch
from torch._dynamo.utils import counters
f = torch.compile(lambda x: (x.sin() * 2).sum(), backend="cgtrees")
g = torch.compile(lambda x: x.cos() + 1, backend="cgtrees")
x = torch.randn(8, requires_grad=True)
f(x).backward()
with torch.no_grad():
    g(x)
print(json.dumps(dict(counters["cgtrees"])))
"""


def test_a_warm_run_whose_graphs_all_hit_compiles_none(tmp_path):
    env = {**os.environ, "CGTREES_CACHE_DIR": str(tmp_path)}

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", WARM], env=env, capture_output=True, text=True, timeout=300,
                              cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["graphs_compiled"] == 2 and cold.get("graphs_loaded", 0) == 0, cold
    assert warm["cache_hit_aot"] == 2 and warm.get("graphs_compiled", 0) == 0 and warm["graphs_loaded"] == 2, warm
