"""The on-disk store: one file per entry, written atomically under a per-entry file lock.

Invariants:
- Location: ``config.cache_dir`` (which also reads ``$CGTREES_CACHE_DIR``), else
  ``$XDG_CACHE_HOME/cgtrees``, else ``~/.cache/cgtrees``; everything lives under ``v<SCHEMA>/``.
- Directories we create get mode 0700. A directory owned by another user, or writable by group or
  others, is never read from or written to: an entry is code that we import.
- An entry is ``MAGIC sha256=<hex> bytes=<n>\\n`` followed by a JSON payload; a reader checks
  magic, length and checksum, and any mismatch is ``CorruptEntry`` (the caller removes it).
- A write goes to a temp file in the entry's directory, is fsynced, then renamed over the entry:
  readers see the old entry, the new one, or none; never a partial one. Concurrent writers of one
  entry serialise on its lock, and the second finds the first's entry and keeps it.
- Any OSError (disk full, read-only directory) makes the write a warning, never a failure.
- With ``config.remote_cache``, a cluster's Redis server is the second tier (``remote.py``): a
  local miss reads it (a hit is written here), a write goes to both, and ``claim`` makes one
  process of the cluster compile an entry while the others wait for it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from filelock import FileLock, Timeout

from cgtrees import counters
from cgtrees.cache import remote as remote_tier
from cgtrees.config import Config
from cgtrees.logs import log_once

SCHEMA = 2  # 2: a level-1 entry holds a typed CompiledFunction (``cgtrees.compiled_function``)
MAGIC = b"cgtrees-cache-entry/1"
LEVELS = ("aot", "module")
LOCK_TIMEOUT_S = 120.0
log = logging.getLogger("cgtrees.cache")


class CorruptEntry(Exception):
    """An entry that is truncated, garbled, fails its checksum, or belongs to another key."""


def write_fix(root: Path, exc: BaseException | None = None) -> str:
    """What to do about a cache directory that refused a write (``exc``) or would."""
    if (getattr(exc, "errno", None) if exc is not None else _mount_errno(root)) == errno.EROFS:
        return (f"{root} is on a read-only file system: set CGTREES_CACHE_DIR to a directory on a writable one "
                "(CGTREES_CACHE=0: no cache)")
    return (f"make {root} writable (chmod -R u+w {root}), or set CGTREES_CACHE_DIR to a writable directory "
            "(CGTREES_CACHE=0: no cache)")


def _mount_errno(root: Path) -> int | None:
    try:
        return errno.EROFS if os.statvfs(root).f_flag & os.ST_RDONLY else None
    except OSError:
        return None


def base_dir(config: Config, environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    if config.cache_dir:
        return Path(config.cache_dir).expanduser()
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]) / "cgtrees"
    return Path.home() / ".cache" / "cgtrees"


def unsafe_reason(path: Path, st: os.stat_result | None = None) -> str | None:
    """Why ``path`` must not be trusted (another owner, or writable by group/others), or None.
    ``st``: its stat, where the caller has it."""
    st = path.stat() if st is None else st
    if st.st_uid != os.getuid():
        return (f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}); "
                f"set CGTREES_CACHE_DIR to a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                f"run chmod 700 {path}, or set CGTREES_CACHE_DIR to a directory of your own")
    return None


@dataclass
class Usage:
    entries: int
    bytes: int


class Store:
    def __init__(self, root: Path, remote: remote_tier.Remote | None = None) -> None:
        self.root = root  # .../cgtrees/v<SCHEMA>
        self.remote = remote  # the cluster's tier behind this directory, if any

    @classmethod
    def open(cls, config: Config) -> "Store | None":
        """The store for ``config``, or None (with a warning) when it cannot be used safely."""
        base = base_dir(config)
        try:
            root = base / f"v{SCHEMA}"
            for path in (base, root, *(root / d for d in (*LEVELS, "locks", "triton"))):
                reason = unsafe_reason(path, _private_dir(path))
                if reason is not None:
                    log_once(log, f"unsafe:{path}", "cgtrees: cache disabled: %s; compiling uncached", reason)
                    return None
        except OSError as exc:
            log_once(log, f"unusable:{base}", "cgtrees: cache directory %s unusable (%s); compiling uncached. "
                     "Set CGTREES_CACHE_DIR to a writable directory, or CGTREES_CACHE=0 to say so", base, exc)
            return None
        return cls(root, remote_tier.connect(config, SCHEMA))

    def path(self, level: str, digest: str) -> Path:
        return self.root / level / f"{digest}.entry"

    def lock(self, digest: str) -> FileLock:
        return FileLock(str(self.root / "locks" / f"{digest}.lock"), timeout=LOCK_TIMEOUT_S)

    # ---- reading -------------------------------------------------------------------------

    def read(self, level: str, digest: str) -> dict[str, Any] | None:
        """The payload, or None when there is no entry (here or, then, on the remote tier, whose
        hit is written here); CorruptEntry when the local entry is bad."""
        path = self.path(level, digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return self._from_remote(level, digest, self.remote.get(level, digest) if self.remote else None)
        payload = decode(data, level, digest)
        try:
            os.utime(path)  # least recently used = oldest mtime
        except OSError:
            pass
        return payload

    def claim(self, level: str, digest: str) -> dict[str, Any] | None:
        """After a miss: None when this process is to compile the entry (then ``write`` or
        ``release``); else the payload another process of the cluster wrote while this one waited."""
        if self.remote is None:
            return None
        return self._from_remote(level, digest, self.remote.claim(level, digest))

    def release(self, level: str, digest: str) -> None:
        """This process will not write the entry it claimed: the others stop waiting for it."""
        if self.remote is not None:
            self.remote.release(level, digest)

    def _from_remote(self, level: str, digest: str, data: bytes | None) -> dict[str, Any] | None:
        """A remote entry (its signature checked) decoded, and kept in the local directory."""
        if data is None:
            return None
        try:
            payload = decode(data, level, digest)
        except CorruptEntry as exc:  # signed with the cluster's key, yet not an entry
            counters.bump("cache_remote_bad")
            log_once(log, "remote-corrupt", "cgtrees: a remote cache entry is bad (%s): ignored and "
                     "compiled here", exc)
            return None
        self._write_local(level, digest, data)
        return payload

    def remove(self, level: str, digest: str, only_bad: bool = True) -> None:
        """Remove a bad entry (under its lock: a writer may be replacing it right now); with
        ``only_bad=False``, a good one too (a level-1 entry whose kernel modules are gone)."""
        path = self.path(level, digest)
        try:
            with self.lock(digest):
                if not only_bad or not _is_good(path, level, digest):
                    path.unlink(missing_ok=True)
        except (OSError, Timeout) as exc:
            log.warning("cgtrees: could not remove bad cache entry %s: %s", path, exc)

    # ---- writing -------------------------------------------------------------------------

    def write(self, level: str, digest: str, payload: dict[str, Any], size_cap_mb: int = 0) -> bool:
        """Write an entry unless a good one is there, and give it to the remote tier; False (with a
        warning) when the local write fails."""
        data = encode({**payload, "level": level, "digest": digest})
        if self.remote is not None:
            self.remote.put(level, digest, data)  # and drops this process's claim on it
        if not self._write_local(level, digest, data):
            return False
        if size_cap_mb > 0:
            self.evict(size_cap_mb << 20)
        return True

    def _write_local(self, level: str, digest: str, data: bytes) -> bool:
        """Write encoded bytes unless a good entry is there; False, warned once, when the write fails."""
        path = self.path(level, digest)
        try:
            with self.lock(digest):
                if not _is_good(path, level, digest):
                    _atomic_write(path, data)
            return True
        except (OSError, Timeout) as exc:
            log_once(log, f"write:{type(exc).__name__}:{getattr(exc, 'errno', '')}",
                     "cgtrees: could not write cache entry %s (%s): not stored, a new process compiles it again. "
                     "Fix: %s", path, exc, write_fix(self.root, exc))
            return False

    def writable(self) -> bool:
        """Whether this process may create entries here (a read-only mount says no, even to root)."""
        return os.access(self.root, os.W_OK)

    def evict(self, cap_bytes: int) -> int:
        """Remove least recently used entries until the store is under ``cap_bytes``."""
        files = []
        for path in self.entry_paths():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        removed = 0
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= cap_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
            removed += 1
        return removed

    # ---- inspecting ----------------------------------------------------------------------

    def entry_paths(self) -> list[Path]:
        return [p for level in LEVELS for p in (self.root / level).glob("*.entry")]

    def usage(self) -> Usage:
        sizes = []
        for path in self.entry_paths():
            try:
                sizes.append(path.stat().st_size)
            except FileNotFoundError:
                pass
        return Usage(len(sizes), sum(sizes))

    def clear(self) -> int:
        """Remove every entry, lock and temp file, and Triton's binaries; returns entries removed."""
        n = len(self.entry_paths())
        for sub in (*LEVELS, "locks"):
            for path in (self.root / sub).iterdir():
                path.unlink(missing_ok=True)
        shutil.rmtree(self.triton_dir(), ignore_errors=True)
        _mkdir_private(self.triton_dir())
        return n

    def triton_dir(self) -> Path:
        return self.root / "triton"


# ---- the file format ---------------------------------------------------------------------------

def encode(payload: dict[str, Any], magic: bytes = MAGIC) -> bytes:
    """``magic`` names the kind of file: a cache entry, or a precompiled function (``cgtrees.precompile``)."""
    body = json.dumps(payload, sort_keys=True).encode()
    header = magic + b" sha256=" + hashlib.sha256(body).hexdigest().encode() + b" bytes=" + str(len(body)).encode()
    return header + b"\n" + body


def decode(data: bytes, level: str | None = None, digest: str | None = None,
           magic: bytes = MAGIC) -> dict[str, Any]:
    """The payload of an entry; with ``level`` and ``digest``, also check it is that entry's."""
    header, sep, body = data.partition(b"\n")
    parts = header.split(b" ")
    if not sep or len(parts) != 3 or parts[0] != magic:
        raise CorruptEntry("bad header")
    try:
        want_sha = parts[1].removeprefix(b"sha256=").decode()
        want_len = int(parts[2].removeprefix(b"bytes="))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptEntry(f"bad header ({exc})") from None
    if len(body) != want_len:
        raise CorruptEntry(f"truncated: {len(body)} of {want_len} bytes")
    if hashlib.sha256(body).hexdigest() != want_sha:
        raise CorruptEntry("checksum mismatch")
    try:
        payload = json.loads(body)
    except ValueError as exc:
        raise CorruptEntry(f"bad payload ({exc})") from None
    if not isinstance(payload, dict):
        raise CorruptEntry("bad payload")
    if digest is not None and (payload.get("digest"), payload.get("level")) != (digest, level):
        raise CorruptEntry("entry belongs to another key")
    return payload


def _is_good(path: Path, level: str, digest: str) -> bool:
    try:
        decode(path.read_bytes(), level, digest)
    except (OSError, CorruptEntry):
        return False
    return True


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".entry")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename durable too
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def _private_dir(path: Path) -> os.stat_result:
    """The directory's stat, made (mode 0700) where it is missing. A warm start finds every one:
    one stat each, never a mkdir that fails because the directory exists."""
    try:
        return path.stat()
    except FileNotFoundError:
        _mkdir_private(path)
        return path.stat()


def _mkdir_private(path: Path) -> None:
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        return
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
