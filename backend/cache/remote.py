"""The cluster's tier: a Redis server behind the local directory (option ``remote_cache``).

Invariants:
- Behind the local store (``store.Store``): a read looks in the local directory first, then here, and
  a remote hit is written to the local directory; a write goes to both. Both levels live here, and
  with a level-2 entry the compiled kernel binaries it carries.
- Names: ``cgtrees/<schema>/<torch>/<triton>/<our source>/<device>/<level>/<digest>``. The digest is
  the sha256 of the entry's whole key (graph text, inputs, config, versions, device: ``key.py``), so
  an entry's name follows from what it holds, and processes of other versions never meet.
- Trust: an entry is code that the reader imports. Every value is signed with an HMAC-SHA256 of
  ``remote_cache_key`` (the secret the cluster shares) over its name and its bytes; a reader loads
  only values whose signature checks out (and then the local entry's own checksum). Without a key the
  tier is off: nothing is read or written (one warning says so). A value that fails its check (signed
  with another key, truncated, damaged) is ignored, once with a warning, and recompiled.
- One compile per graph: after a miss, ``claim`` takes a lock (``SET NX`` with a time-to-live) or
  waits for the process that holds it to write the entry; the wait ends at the lock's TTL, and then
  this process compiles the graph itself. Writing the entry, or ``release``, drops the lock.
- A server that cannot be reached, is slow (connect and read timeouts of a few hundred ms) or is full
  turns the tier off for the rest of the process with one warning that names the fix; the local
  directory works on. Nothing here ever raises into a compile.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import logging
import threading
import time
import uuid

from cgtrees import counters
from cgtrees.config import Config
from cgtrees.logs import log_once

log = logging.getLogger("cgtrees.cache")

SIGNED = b"cgtrees-remote/1"
CONNECT_TIMEOUT_S = 0.2
READ_TIMEOUT_S = 0.3
LOCK_TTL_S = 60.0  # how long another process waits for the one compiling a graph
POLL_S = 0.05
_RELEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"""


class Remote:
    """One server, shared by every Store of this process that names it (``connect``)."""

    def __init__(self, url: str, secret: bytes, namespace: str) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url, self.namespace = url, namespace
        self._secret = secret
        self._client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                            socket_timeout=READ_TIMEOUT_S, retry=Retry(NoBackoff(), 0))
        self._errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        self._claims: dict[str, str] = {}  # lock name -> our token
        self.off = False
        atexit.register(self._release_at_exit)  # a process that ends mid-compile keeps no one waiting

    def name(self, level: str, digest: str) -> str:
        return f"{self.namespace}/{level}/{digest}"

    # ---- entries ---------------------------------------------------------------------------

    def get(self, level: str, digest: str) -> bytes | None:
        """The entry's bytes (as the local store keeps them) when the server has it and its
        signature checks out; None otherwise (a miss, a bad value, or the tier is off)."""
        if self.off:
            return None
        name = self.name(level, digest)
        try:
            value = self._client.get(name)
        except self._errors as exc:
            self._turn_off(exc)
            return None
        data = self._verify(name, value) if value is not None else None
        counters.bump("cache_remote_hit" if data is not None else "cache_remote_miss")
        return data

    def put(self, level: str, digest: str, data: bytes) -> None:
        """Keep the entry for the cluster (signed), and drop our lock on it."""
        if self.off:
            return
        name = self.name(level, digest)
        try:
            self._client.set(name, self._sign(name, data))
        except self._errors as exc:
            self._turn_off(exc)
            return
        self.release(level, digest)

    def _sign(self, name: str, data: bytes) -> bytes:
        mac = hmac.new(self._secret, name.encode() + b"\n" + data, hashlib.sha256).hexdigest().encode()
        return SIGNED + b" hmac-sha256=" + mac + b"\n" + data

    def _verify(self, name: str, value: bytes) -> bytes | None:
        header, sep, data = value.partition(b"\n")
        parts = header.split(b" ")
        if sep and len(parts) == 2 and parts[0] == SIGNED and parts[1].startswith(b"hmac-sha256="):
            mac = hmac.new(self._secret, name.encode() + b"\n" + data, hashlib.sha256).hexdigest().encode()
            if hmac.compare_digest(mac, parts[1].removeprefix(b"hmac-sha256=")):
                return data
        counters.bump("cache_remote_bad")
        log_once(log, f"remote-bad:{self.url}",
                 "cgtrees: a remote cache entry at %s failed its signature check (signed with another key, "
                 "truncated or damaged): ignored and compiled here; every process of the cluster must set the "
                 "same CGTREES_REMOTE_CACHE_KEY", self.url)
        return None

    # ---- one compile per graph ---------------------------------------------------------------

    def claim(self, level: str, digest: str) -> bytes | None:
        """After a miss: None when this process is to compile the entry (it holds the lock, or the
        wait ran out, or the tier is off); else the entry another process wrote while we waited."""
        lock = self.name(level, digest) + "/lock"
        token = uuid.uuid4().hex
        deadline = time.monotonic() + LOCK_TTL_S
        waited = False
        while not self.off and time.monotonic() < deadline:
            try:
                if self._client.set(lock, token, nx=True, px=int(LOCK_TTL_S * 1000)):
                    self._claims[lock] = token
                    if not self._client.exists(self.name(level, digest)):
                        return None
                    self.release(level, digest)  # written between our miss and our lock: read it
                    return self.get(level, digest)
                waited, entry = True, 0
                while time.monotonic() < deadline:
                    entry, locked = self._client.exists(self.name(level, digest)), self._client.exists(lock)
                    if entry or not locked:
                        break
                    time.sleep(POLL_S)
            except self._errors as exc:
                self._turn_off(exc)
                return None
            if entry:
                data = self.get(level, digest)
                if data is not None:
                    counters.bump("cache_remote_waited")
                    return data
                return None  # a bad value: compile it here
        if waited and not self.off:
            log.info("cgtrees: waited %.0f s for another process to compile %s entry %s; compiling it here",
                     LOCK_TTL_S, level, digest[:12])
        return None

    def release(self, level: str, digest: str) -> None:
        """Drop our lock on an entry (written, or not to be written)."""
        lock = self.name(level, digest) + "/lock"
        token = self._claims.pop(lock, None)
        if token is None or self.off:
            return
        try:
            self._client.eval(_RELEASE, 1, lock, token)
        except self._errors as exc:
            self._turn_off(exc)

    def _release_at_exit(self) -> None:
        """Best effort and silent: a server gone by now lets the lock expire."""
        for lock, token in list(self._claims.items()):
            try:
                self._client.eval(_RELEASE, 1, lock, token)
            except self._errors:
                return
        self._claims.clear()

    def _turn_off(self, exc: BaseException) -> None:
        self.off = True
        self._claims.clear()
        full = "OOM" in str(exc) or "maxmemory" in str(exc)
        fix = ("raise the server's maxmemory, or set its maxmemory-policy to allkeys-lru" if full else
               "check that the server is up and that CGTREES_REMOTE_CACHE names it, or unset CGTREES_REMOTE_CACHE")
        log_once(log, f"remote-off:{self.url}",
                 "cgtrees: remote cache %s %s (%s: %s); this process uses the local cache only. Fix: %s",
                 self.url, "is full" if full else "is unreachable or too slow", type(exc).__name__, exc, fix)


_REMOTES: dict[tuple[str, str], Remote | None] = {}
_LOCK = threading.Lock()


def connect(config: Config, schema: int) -> Remote | None:
    """The process's client of ``config.remote_cache`` (one per server and key), or None: no server
    named, no key to sign with, or no client installed (each said once)."""
    if not config.remote_cache:
        return None
    with _LOCK:
        ident = (config.remote_cache, config.remote_cache_key)
        if ident not in _REMOTES:
            _REMOTES[ident] = _connect(config, schema)
        return _REMOTES[ident]


def _connect(config: Config, schema: int) -> Remote | None:
    if not config.remote_cache_key:
        log.warning("cgtrees: remote cache %s is not used: its entries are code this process would run, and "
                    "without a key nothing can be checked. Set CGTREES_REMOTE_CACHE_KEY to the secret the "
                    "cluster shares", config.remote_cache)
        return None
    try:
        return Remote(config.remote_cache, config.remote_cache_key.encode(), namespace(schema))
    except ImportError:
        log.warning("cgtrees: remote cache %s is not used: the redis client is not installed (pip install redis)",
                    config.remote_cache)
    except ValueError as exc:  # a URL the client does not take
        log.warning("cgtrees: remote cache %r is not used: %s; write it as redis://host:port/db",
                    config.remote_cache, exc)
    return None


def namespace(schema: int) -> str:
    """What every name of this process starts with: the versions an entry depends on, and the GPU."""
    import torch

    from cgtrees.cache.key import backend_source_hash, triton_version

    return (f"cgtrees/{schema}/torch-{torch.__version__}/triton-{triton_version()}/"
            f"src-{backend_source_hash()[:16]}/{_device()}")


def _device() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name().replace(' ', '_')}-sm{major}{minor}"


def forget() -> None:
    """Drop every client (tests: a server started again on the same port)."""
    with _LOCK:
        _REMOTES.clear()
