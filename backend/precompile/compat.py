"""Every torch private API that precompile uses, in one place (torch 2.11 on the GPU, 2.13 in CI;
both have the same names): torch's ``SerializableCallable`` and backend artifact types, the settings
that keep AOTAutograd from bundling its own cache entry, and Dynamo's caching precompile, with the
mends of how torch loads a saved Dynamo cache entry (monkey-patches, applied once, only when the
``precompile_cache`` option turns that cache on). Moved here from ``cache/compat.py``: they are not
caching, and each stage keeps its private APIs in a compat module of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import logging
import types
from typing import Any, Iterator

import torch
import torch.fx

log = logging.getLogger("cgtrees.precompile")

__all__ = [
    "SerializableCallable", "precompile_backend_id", "caching_precompile", "plain_aot_settings",
    "BackendArtifact", "record_backend_artifact", "enable_caching_precompile", "save_dynamo_cache",
    "dynamo_names_used", "reserve_dynamo_names",
]


def _serializable_callable() -> type:
    """torch's ABC that ``aot_compile`` checks the backend's result against (``object`` where it
    is missing: then no precompile API calls us)."""
    try:
        from torch._dynamo.aot_compile_types import SerializableCallable
    except ImportError:
        return object
    return SerializableCallable


SerializableCallable = _serializable_callable()


def precompile_backend_id(gm: torch.fx.GraphModule) -> str | None:
    """The name (``__compiled_fn_3``) under which torch will save our result: Dynamo sets it on
    the graph for ``aot_compile`` and for caching precompile; None in a plain compile."""
    value = getattr(gm, "_backend_id", None)
    return value if isinstance(value, str) else None


def caching_precompile() -> bool:
    """Whether Dynamo's own cache (``torch._dynamo.config.caching_precompile``) is on."""
    return bool(getattr(torch._dynamo.config, "caching_precompile", False))


# What torch's precompile paths switch on in AOTAutograd: it would then bundle its own cache entry
# and require Inductor's ``OutputCode`` from our compilers ("expected OutputCode, got function").
_BUNDLING = ("bundled_autograd_cache", "force_autograd_cache", "bypass_autograd_cache_key",
             "strict_autograd_cache")


def plain_aot_settings(non_lazy_backward: bool) -> Any:
    """A context in which AOTAutograd runs our compilers as in a plain compile; with
    ``non_lazy_backward``, the backward is compiled with the forward (a saved function must hold
    both). A no-op context when nothing needs to change."""
    import contextlib

    cfg = torch._functorch.config
    patch = {name: False for name in _BUNDLING if getattr(cfg, name, False)}
    if non_lazy_backward and hasattr(cfg, "force_non_lazy_backward_lowering"):
        patch["force_non_lazy_backward_lowering"] = True
    stack = contextlib.ExitStack()
    if patch:
        stack.enter_context(cfg.patch(patch))
    if caching_precompile():  # AOTAutograd bundles under it too (``should_bundle_autograd_cache``)
        stack.enter_context(torch._dynamo.config.patch(caching_precompile=False))
    return stack


def _backend_artifact() -> type:
    try:
        from torch._dynamo.precompile_context import BackendCacheArtifact
    except ImportError:
        return object
    return BackendCacheArtifact


BackendArtifact = _backend_artifact()


def record_backend_artifact(artifact: Any) -> None:
    """Give Dynamo's precompile context our artifact for one backend id (it saves it with its
    guards and bytecode in ``torch.compiler.save_cache_artifacts``)."""
    from torch._dynamo.precompile_context import PrecompileContext

    PrecompileContext.record_artifact(artifact)


def enable_caching_precompile() -> str | None:
    """Turn Dynamo's caching precompile on; the reason it cannot be, or None."""
    try:
        from torch._dynamo.precompile_context import PrecompileContext
    except ImportError:
        return f"torch {torch.__version__} has no Dynamo precompile context"
    if not (hasattr(torch._dynamo.config, "caching_precompile")
            and hasattr(PrecompileContext, "save_to_dynamo_cache")):
        return f"torch {torch.__version__} has no caching precompile"
    torch._dynamo.config.caching_precompile = True
    _mend_dynamo_cache_loading()
    _quiet_dropped_guard_lines()
    return None


_GUARDS_LOG = "torch._dynamo.guards"  # where Dynamo names each guard its caching precompile drops


class _DroppedGuardLines(logging.Filter):
    """Hides torch's warning line per guard that caching precompile drops (115 for a 2-layer Llama's
    decode step; our one line says what dropping them means), unless that logger shows debug
    records (``TORCH_LOGS=+dynamo``)."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or "is dropped with caching_precompile" not in str(record.msg):
            return True
        return self.logger.isEnabledFor(logging.DEBUG)


def _quiet_dropped_guard_lines() -> None:
    logger = logging.getLogger(_GUARDS_LOG)
    if not any(isinstance(f, _DroppedGuardLines) for f in logger.filters):
        logger.addFilter(_DroppedGuardLines(logger))


def _mend_dynamo_cache_loading() -> None:
    """Two ways torch's DynamoCache crashed the user's ``torch.compile`` call in a warm process
    (torch 2.13), mended here, once:

    - A guarded parameter that had a ``.grad`` when the entry was saved (a graph compiled after a
      backward: an eval-mode graph, another shape) comes back with ``grad = _Missing(...)``: the
      grad is left out of the guard state, then assigned on load, a TypeError. It is not guarded
      on, so it is loaded as no grad.
    - ``install`` recovers from a RuntimeError (it logs "Failed to load entry from dynamo cache"
      and traces afresh) but from nothing else: any other error while installing a saved entry
      becomes a RuntimeError, so that a bad entry costs a trace, never the program. And the
      recovery only works on a fresh package (``_fresh_package``).

    And the guarded tensors are unpickled in one fake mode, not one each (``_guard_state_tensor``),
    and guard sources pickle only their constructor's fields (``_mend_source_pickling``)."""
    import functools

    from torch._dynamo import guards, package

    _mend_source_pickling()

    pickler = getattr(guards, "GuardsStatePickler", None)
    unpickle = getattr(pickler, "_unpickle_tensor", None)
    if unpickle is not None and not getattr(unpickle, "_cgtrees", False):
        missing = getattr(guards, "_Missing", ())
        shared_mode = _knows_guard_state_tensors(unpickle)

        @functools.wraps(unpickle)
        def unpickle_tensor(cls, *args: Any) -> torch.Tensor:
            if args and isinstance(args[-1], missing):
                args = (*args[:-1], None)
            if shared_mode:
                return _guard_state_tensor(*args)
            return unpickle.__func__(cls, *args)

        unpickle_tensor._cgtrees = True
        pickler._unpickle_tensor = classmethod(unpickle_tensor)
    install = getattr(getattr(package, "CompilePackage", None), "install", None)
    if install is not None and not getattr(install, "_cgtrees", False):
        @functools.wraps(install)
        def install_or_runtime_error(self: Any, backends: Any) -> None:
            try:
                with _collector_paused():
                    install(self, backends)
            except Exception as exc:
                _fresh_package(self)
                if isinstance(exc, RuntimeError):
                    raise
                raise RuntimeError(f"cgtrees: a saved Dynamo cache entry could not be installed "
                                   f"({type(exc).__name__}: {exc}); compiling afresh") from exc

        install_or_runtime_error._cgtrees = True
        package.CompilePackage.install = install_or_runtime_error


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic collector paused while a saved entry is installed: what the install makes
    (Dynamo's unpickled guard state, its guard managers: some 10k objects for GPT-2) all lives on,
    so a collection in it finds nothing of its own, and a full one walks the whole process (0.20-0.25 s
    of GPT-2's warm start on an H200, most of the torch.compile call). Resumed after, where the
    collector counts what it was not asked to see; a user who turned it off keeps it off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _init_fields_reduce(self: Any) -> tuple:
    return (type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.init))


def _mend_source_pickling() -> None:
    """torch 2.11 pickles a guard source with every dataclass field, those its ``__post_init__``
    computes too (``DefaultsSource``'s ``field`` and ``_name``), and its unpickling then calls the
    constructor with too many arguments: a saved entry guarding a function's default (BERT's) never
    loads. torch 2.13 pickles only the constructor's fields; so do the sources here (the same
    pickle on 2.13)."""
    from torch import _guards

    pending, seen = [_guards.Source], set()
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        pending.extend(cls.__subclasses__())
        reduce = inspect.getattr_static(cls, "__reduce__", None)  # torch's own (or inherited)
        if (isinstance(reduce, types.FunctionType) and reduce.__module__ == _guards.__name__
                and dataclasses.is_dataclass(cls) and any(not f.init for f in dataclasses.fields(cls))):
            cls.__reduce__ = _init_fields_reduce


def _fresh_package(package: Any) -> None:
    """A package whose install failed, made new: torch's recovery initializes it again, which
    asserts that it is not yet (torch 2.11 and 2.13: BERT's saved guards failed to unpickle, and
    the recovery's AssertionError crashed the ``torch.compile`` call). What the install put in
    place (globals, precompiled entries) is taken out first."""
    try:
        package.uninstall()
    except Exception as exc:  # noqa: BLE001 - nothing installed yet
        log.debug("cgtrees: uninstalling a failed Dynamo cache entry: %s: %s", type(exc).__name__, exc)
    package.__init__(None)


_GUARD_STATE_TENSOR_ARGS = ("meta_tensor", "device", "pytype", "dispatch_keys_raw", "grad")
_guard_state_mode: Any = None


def _knows_guard_state_tensors(unpickle: Any) -> bool:
    """Whether Dynamo's ``_unpickle_tensor`` takes the arguments ``_guard_state_tensor`` reads."""
    import inspect

    try:
        names = tuple(inspect.signature(unpickle).parameters)
    except (TypeError, ValueError):
        return False
    return names in (_GUARD_STATE_TENSOR_ARGS, _GUARD_STATE_TENSOR_ARGS[:-1])


def _guard_state_tensor(meta_tensor: torch.Tensor, device: torch.device, pytype: type, dispatch_keys_raw: int,
                        grad: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor of a saved entry's guard state, as Dynamo unpickles it (a fake tensor of the saved
    metadata, which guards read and nothing runs on), in one fake mode for the process. Dynamo makes
    a fake mode per tensor, and each records its Python stack: 0.02 s of GPT-2's warm start (H100)."""
    global _guard_state_mode
    from torch._subclasses.fake_tensor import FakeTensorConverter, FakeTensorMode

    if _guard_state_mode is None:
        _guard_state_mode = FakeTensorMode()
    tensor = FakeTensorConverter().from_meta_and_device(
        _guard_state_mode, meta_tensor, device, pytype, torch._C.DispatchKeySet.from_raw_repr(dispatch_keys_raw))
    tensor.grad = grad
    return tensor


def save_dynamo_cache() -> None:
    """Write Dynamo's cache entries (guards, bytecode, our artifacts) for every frame compiled so
    far, as ``torch.compiler.save_cache_artifacts`` does under caching precompile."""
    from torch._dynamo.precompile_context import PrecompileContext

    PrecompileContext.save_to_dynamo_cache()


def _name_counter() -> Any:
    from torch._dynamo import bytecode_transformation

    return getattr(bytecode_transformation, "_unique_id_counter", None)


def dynamo_names_used() -> int:
    """How many unique names (``unique_id``) Dynamo has handed out in this process so far."""
    counter = _name_counter()
    return next(counter) if counter is not None else 0  # takes one more: harmless


def reserve_dynamo_names(n: int) -> None:
    """Never hand out Dynamo's unique names below ``n`` in this process. A frame installed from
    Dynamo's cache puts its globals (``__builtins_dict___0``) in the module under the numbers of the
    process that saved it; a recompile of that frame here (a guard failed) would draw the same
    number and fail ("Name '__builtins_dict___0' already exists in scope", torch 2.11 to 2.13)."""
    counter = _name_counter()
    if counter is None:
        return
    while next(counter) < n:
        pass
