"""precompile: torch's ``aot_compile`` / ``save_compiled_function`` / ``load_compiled_function``,
and Dynamo's caching precompile, with ``backend="cgtrees"``.

torch asks the backend's compiled callable for bytes (its ``SerializableCallable`` interface) and,
in a new process, for the callable back from those bytes. Our bytes are the Dynamo graph's level-1 value,
its ``CompiledFunction`` (``cgtrees.compiled_function``: module sources, kernel binaries, the
runtime plan), self-contained, in a checksummed file of our own kind (``store.encode``). Loading
checks that the function was made by this torch, Triton and cgtrees, for devices this process
has, then rebuilds it as a level-1 hit does: no AOTAutograd, no codegen, no Triton compile, the modules wrapped in the
runtime again (CUDA graphs record on the first calls). Parameters are graph inputs, so a loaded
function serves a model whose weights changed.

    compiling(gm)                     api.py compiles each Dynamo graph inside it: under torch's
                                      precompile paths, AOTAutograd runs as in a plain compile
                                      (with the backward compiled at once), and it says to keep
                                      the function (``Level1Hints(keep=True)``)
    serializable(compiled, ...)       what the backend returns there: a ``PrecompiledFunction``
                                      of the driver's ``Compiled`` (the callable and its value)
    PrecompileError                   a graph we cannot save, or bytes we will not load; the
                                      message names why (a mismatch, damage, a level-1 bypass)

Caching precompile (``torch._dynamo.config.caching_precompile``; the ``precompile_cache`` option,
``CGTREES_PRECOMPILE_CACHE=1``, turns it on and saves at each graph's first call): Dynamo saves each
frame's guards and bytecode with one artifact per backend id, and reinstalls them in a later
process without tracing; a guard that fails there compiles afresh. Ours is a ``CachedArtifact``
holding the same bytes; one that is damaged or from another version fails while Dynamo reads its
cache, which Dynamo counts as a miss (``dynamo_cache_error``) and compiles afresh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from cgtrees import counters, runtime
from cgtrees.cache.key import device_mismatch
from cgtrees.compiled_function import CompiledFunction, Origin
from cgtrees.config import Config
from cgtrees.precompile import compat

if TYPE_CHECKING:
    from cgtrees.aot.driver import Compiled

log = logging.getLogger("cgtrees.precompile")

MAGIC = b"cgtrees-precompiled/1"
FORMAT = 2  # 2: the typed CompiledFunction's record
_LOCAL_FIELDS = ("cache_dir", "debug_dir")  # this process's own, never taken from a saved function
_loaded = itertools.count()


class PrecompileError(RuntimeError):
    """A compiled graph that cannot be saved, or saved bytes that cannot be loaded here."""


def use_dynamo_cache() -> None:
    """``CGTREES_PRECOMPILE_CACHE=1``: turn on Dynamo's caching precompile. Called as the backend
    is made, which is when torch.compile looks it up: before Dynamo decides whether this
    torch.compile keeps a cache package, and before it looks the function up in its cache."""
    try:
        wanted = Config.resolve().precompile_cache
    except ValueError:
        return  # a bad value: the first compile raises it
    reason = compat.enable_caching_precompile() if wanted else None
    if reason is not None:
        log.warning("cgtrees: precompile_cache has no effect: %s", reason)
    elif wanted:  # torch's line per dropped guard is hidden (compat); say once what dropping means
        from cgtrees.logs import log_once

        log_once(log, "precompile_cache:guards",
                 "cgtrees: CGTREES_PRECOMPILE_CACHE=1: Dynamo drops the guards it cannot save (object identity, "
                 "closures, dict versions), so a program that swaps a global function, the function a closure "
                 "holds or a module attribute runs the old graph without an error; unset it for such a program "
                 "(README: why the precompile cache is not the default; TORCH_LOGS=+dynamo lists each "
                 "dropped guard)")


@contextlib.contextmanager
def compiling(gm: torch.fx.GraphModule, config: Config) -> Iterator[bool]:
    """Around the compile of one Dynamo graph: whether torch will save the result (aot_compile,
    caching precompile), so that the driver keeps the level-1 value."""
    if config.precompile_cache and not compat.caching_precompile():
        from cgtrees.logs import log_once

        log_once(log, "precompile_cache:late", "cgtrees: precompile_cache=True comes too late in options=: "
                 "Dynamo decides on its cache when torch.compile is called; set CGTREES_PRECOMPILE_CACHE=1 "
                 "in the environment instead")
    keep = compat.precompile_backend_id(gm) is not None
    with compat.plain_aot_settings(non_lazy_backward=keep):
        yield keep


def serializable(compiled: Compiled, config: Config, gm: torch.fx.GraphModule, name: str) -> "PrecompiledFunction":
    fn = PrecompiledFunction(compiled.call, name, compiled.function, compiled.bypass, _saved_config(config))
    backend_id = compat.precompile_backend_id(gm)
    if compat.caching_precompile() and backend_id is not None:
        if compiled.function is None:
            log.warning("cgtrees: %s is not saved in Dynamo's cache (%s); a later process compiles it again",
                        name, fn.why_not())
        else:
            artifact = CachedArtifact(key=backend_id, content=fn.artifact())
            artifact.names_used = compat.dynamo_names_used()  # raised again at each save of ours
            _recorded.append(artifact)
            compat.record_backend_artifact(artifact)
        # Dynamo adds the frame's guards and bytecode once the backend has returned: the first
        # call comes after that.
        fn.save_dynamo_cache = config.precompile_cache
    return fn


class PrecompiledFunction(compat.SerializableCallable):
    """A compiled Dynamo graph that torch can save (``serialize_compile_artifacts``) and load in
    another process (``deserialize_compile_artifacts``). Calls go to the compiled function."""

    def __init__(self, fn: Callable[..., Any], name: str, function: CompiledFunction | None,
                 bypass: str | None, config: dict[str, Any]) -> None:
        self.fn, self.name, self.function, self.bypass, self.config = fn, name, function, bypass, config
        self.save_dynamo_cache = False  # at the first call (the ``precompile_cache`` option)

    def __call__(self, *args: Any) -> Any:
        if self.save_dynamo_cache:
            self.save_dynamo_cache = False
            _save_dynamo_cache(self.name)
        return self.fn(*args)

    def why_not(self) -> str:
        if self.bypass is not None:
            return f"the first cache level does not rebuild it: {self.bypass}"
        return "its compiled graphs were not all recorded (a backward still to compile?)"

    def artifact(self) -> bytes:
        if self.function is None:
            raise PrecompileError(f"cgtrees: cannot save the compiled graph {self.name}: {self.why_not()}")
        from cgtrees.cache.store import encode

        return encode({"format": FORMAT, "name": self.name, "config": self.config,
                       "function": self.function.as_record()}, magic=MAGIC)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "PrecompiledFunction") -> bytes:
        data = fn.artifact()
        counters.bump("precompile_saved")
        return data

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "PrecompiledFunction":
        return load(check(data))


class CachedArtifact(compat.BackendArtifact):
    """Our artifact in Dynamo's cache (caching precompile): ``content`` is the saved bytes. They are
    checked as Dynamo unpickles its entry, so a bad or foreign one is a miss there, never an error
    while Dynamo installs the entry (which it does not recover from). ``names_used``: Dynamo's
    unique names handed out in the saving process (``compat.reserve_dynamo_names``)."""

    names_used = 0
    checked: Saved | None = None  # what ``check`` read at unpickling: not read twice

    def after_deserialization(self) -> "PrecompiledFunction":
        saved, self.checked = self.checked or check(self.content), None
        return load(saved)

    def __reduce__(self) -> tuple[Any, ...]:
        return _restore_artifact, (self.key, self.content, self.names_used)

    def __deepcopy__(self, memo: dict) -> "CachedArtifact":
        return self  # Dynamo's context keeps this object: ``names_used`` is set on it at the save


def _restore_artifact(key: str, content: bytes, names_used: int) -> CachedArtifact:
    saved = check(content)
    _start_first_calls(saved)  # as Dynamo reads its cache, before it installs what it read
    compat.reserve_dynamo_names(names_used)
    artifact = CachedArtifact(key=key, content=content)
    artifact.names_used, artifact.checked = names_used, saved
    return artifact


_recorded: list[CachedArtifact] = []  # this process's, for ``names_used`` at each save


@dataclasses.dataclass(frozen=True)
class Saved:
    """A saved function as ``check`` read it: its name in the saving process, its config, the value."""

    name: str | None
    config: dict[str, Any]
    function: CompiledFunction


def check(data: bytes) -> Saved:
    """The saved function, if this process can load it; else PrecompileError naming why."""
    from cgtrees.cache.store import CorruptEntry, decode

    if not isinstance(data, (bytes, bytearray)):
        raise PrecompileError(f"cgtrees: a saved function is bytes, not {type(data).__name__}")
    try:
        record = decode(bytes(data), magic=MAGIC)
    except CorruptEntry as exc:
        raise PrecompileError(f"cgtrees: the saved function is damaged ({exc}); compile and save it again") from None
    if record.get("format") != FORMAT:
        raise PrecompileError(f"cgtrees: the saved function has format {record.get('format')!r}; "
                              f"this cgtrees reads format {FORMAT}")
    try:
        saved = Saved(record.get("name"), dict(record["config"]), CompiledFunction.from_record(record["function"]))
    except KeyError as exc:
        raise PrecompileError(f"cgtrees: the saved function is damaged (no {exc})") from None
    except (TypeError, ValueError) as exc:
        raise PrecompileError(f"cgtrees: the saved function is damaged ({exc})") from None
    mismatch = _mismatch(saved.function.origin)
    if mismatch is not None:
        raise PrecompileError(f"cgtrees: cannot load the saved function {saved.name}: {mismatch}; "
                              "compile and save it again with this installation")
    return saved


def _start_first_calls(saved: Saved) -> None:
    """The saved modules' library calls, begun in a thread (``runtime.first_calls``); best effort."""
    from cgtrees.aot.rebuild import start_first_calls

    try:
        start_first_calls(saved.function, loaded_config(saved.config))
    except Exception as exc:  # noqa: BLE001 - only time is lost; ``load`` meets what is wrong
        log.debug("cgtrees: no library calls made beforehand (%s: %s)", type(exc).__name__, exc)


def _mismatch(origin: Origin) -> str | None:
    from cgtrees.cache.key import backend_source_hash, triton_version

    mine = {"torch_version": torch.__version__, "triton_version": triton_version(),
            "backend_source": backend_source_hash()}
    what = {"torch_version": "torch", "triton_version": "Triton", "backend_source": "cgtrees (source hash)"}
    for field, value in mine.items():
        if getattr(origin, field) != value:
            return f"it was saved by {what[field]} {getattr(origin, field)}, this process has {value}"
    return device_mismatch(origin.device)


def load(saved: Saved) -> PrecompiledFunction:
    """Rebuild a checked function as a level-1 hit would (no AOTAutograd, no codegen)."""
    from cgtrees import cache, codegen
    from cgtrees.aot.rebuild import rebuild

    config = loaded_config(saved.config)
    name = f"p{next(_loaded)}"
    function = saved.function
    if "cuda" in function.origin.device:  # a kernel that goes through the JIT after all reads Triton's hash back
        key_file = cache.triton_key_file(cache.open_store(config))
        codegen.prepare([torch.empty(0, device="cuda")], config, key_file, compiles=False)
    shared = runtime.SharedTree()  # the loaded forward's tree, for its backward

    def wrap(module: Any, examples: Any, ctx: Any) -> Callable[[list[Any]], Any]:
        return runtime.wrap_module(module, examples, ctx, shared)

    def compile_backward(gm: torch.fx.GraphModule, inputs: list[Any], static_saved: tuple[str, ...]) -> Any:
        from cgtrees.aot import driver  # AOTAutograd's modules: only if a backward is compiled here

        return driver.compile_backward(name, config, shared, gm, inputs, static_saved)

    try:
        fn = rebuild(function, config, name, wrap, compile_backward)
    except Exception as exc:
        raise PrecompileError(f"cgtrees: the saved function {saved.name} could not be rebuilt "
                              f"({type(exc).__name__}: {exc})") from exc
    counters.bump("precompile_loaded")
    log.debug("cgtrees: loaded the saved function %s as %s", saved.name, name)
    return PrecompiledFunction(fn, name, function, None, saved.config)


def _save_dynamo_cache(name: str) -> None:
    used = compat.dynamo_names_used()
    for artifact in _recorded:
        artifact.names_used = used
    try:
        compat.save_dynamo_cache()
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be written is a warning, never a failure
        log.warning("cgtrees: Dynamo's cache could not be saved after %s (%s: %s); a later process compiles "
                    "it again", name, type(exc).__name__, exc)
        return
    log.debug("cgtrees: Dynamo's cache saved at the first call of %s", name)


def loaded_config(saved: dict[str, Any], environ: dict[str, str] | None = None) -> Config:
    """The config a saved function runs under here: as saved (its ``options=`` were given in the
    process that compiled it), except the fields that do not shape generated code and that this
    process sets itself (``CGTREES_<NAME>``), such as ``cudagraphs`` or ``warm_first_calls``."""
    affects = {f.name for f in dataclasses.fields(Config) if f.metadata["affects_codegen"]}
    mine = Config.set_in_environment(environ) - affects
    return Config.resolve(options={k: v for k, v in saved.items() if k not in mine}, environ=environ)


def _saved_config(config: Config) -> dict[str, Any]:
    return {name: value for name, value in config.items() if name not in _LOCAL_FIELDS}
