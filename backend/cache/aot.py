"""Level 1: a Dynamo graph's whole AOT result, so a warm start skips AOT tracing, partitioning and
codegen.

An entry is the graph's key and its ``CompiledFunction`` (``cgtrees.compiled_function``: for each
aten graph AOTAutograd produced, inference or forward and backward, its module, the GraphContext
fields the driver gave it and the metadata of its example inputs and constants; the typed runtime
plan our wrapper needs; the backward graph; the guards), as ``as_record(refer_to_level_2=True)``
writes it: each generated module by the digest of the level-2 entry that holds it. The driver
builds the value (``aot.recorder``); this module only stores and loads it: a hit (``Hit``) is the
function with its kernel modules read in from level 2 (one that is gone or bad makes the hit a
counted miss, and the entry is written again); the driver turns it into the callable
(``aot.rebuild``: each module wrapped in the runtime again, since recording is per process, and
our wrapper around them), then accepts it, or rejects it (a counted corrupt entry, removed and
recompiled). On a miss, ``load`` gives the ``Slot`` the driver's recorder writes the entry to, or a
bypass marker (a graph found uncacheable: later processes count a bypass with the reason instead of
a miss and go straight to AOTAutograd). Nothing here calls back into the driver. The format is
versioned by ``store.SCHEMA``.

A compiled-autograd graph (``backward=True``) is traced with grad mode off: its one graph is an
inference graph to AOTAutograd and to our wrapper, and a backward to the runtime (the part's
``runtime_kind``). A graph whose ``Level1Hints`` hold a reason to bypass it bypasses this level.

A graph with symbolic sizes (an automatic-dynamic recompile, compiled autograd's ``dynamic=True``)
is keyed by its sizes as symbols (the placeholders', never the call's), the ShapeEnv's settings
beside them. AOTAutograd and our passes may add guards on those sizes while compiling (a size that
must not be 1, a divisibility), after Dynamo traced the graph: so the function keeps every guard on
the graph's size inputs at the end of the compile (``compat.Symbols``); a lookup evaluates them on
the call's sizes, a false guard is a miss, and a hit adds them to the ShapeEnv, so that Dynamo
guards the frame on them as the cold process did, and a size that breaks one recompiles. Entries of
one key compiled under other guards live side by side (``variant_digest``, up to
``MAX_VARIANTS``). A symbolic training graph's entry is written once its backward is compiled: the
backward graph is kept for compiled autograd or a lazy compile as static shapes only. The rebuilt
wrapper hands the forward's saved sizes to the backward and marks symbolic output dimensions as
AOTAutograd does. DDPOptimizer's pieces, whose example activations are fake tensors, are keyed like
any graph (``aot.distributed`` says why a hit needs nothing of DDPOptimizer). Autocast's state is in
the key, and a graph compiled under it runs with autocast off (``aot.wrappers``).

Precompile (``cgtrees.precompile``) saves the same value in a file of its own: it asks for it with
``Level1Hints(keep=True)``; the driver then returns a hit's function, or the recorder's (each part
holding its module: the file needs no cache), or the reason the graph bypasses this level. With
the cache off, ``load`` then still gives a ``Slot`` (without a store: nothing is written).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
import torch.fx

from cgtrees.cache import compat, events, modules
from cgtrees.cache.compat import Uncacheable
from cgtrees.cache.key import CacheKey, make_key
from cgtrees.cache.store import CorruptEntry, Store
from cgtrees.compiled_function import CompiledFunction, CompiledPart, Level2Ref
from cgtrees.config import Config

LEVEL = "aot"


@dataclass(frozen=True)
class Level1Hints:
    """What the caller knows of a Dynamo graph that this level must respect."""

    keep: bool = False  # precompile wants the function (torch will save the result)
    bypass: str | None = None  # why this level must not key the graph (``aot.compiled_autograd``)
    target_texts: dict[str, str] = field(default_factory=dict)  # the key's text of unnamed call targets


NO_HINTS = Level1Hints()


@dataclass(frozen=True, eq=False)
class Slot:
    """Where a miss's entry goes: the graph's key, and the digest it is written under in ``store``
    (None: the function is built for precompile, and nothing is written). ``symbols``: a symbolic
    graph's sizes, whose guards the function keeps."""

    store: Store | None
    key: CacheKey
    digest: str
    config: Config
    name: str
    symbols: compat.Symbols | None = None

    def write(self, function: CompiledFunction, replace: bool = False) -> None:
        """Store the function (``replace``: over the entry written before without its backward)."""
        if self.store is None:
            return
        if replace:
            self.store.remove(LEVEL, self.digest, only_bad=False)
        self.store.write(LEVEL, self.digest, {"key": self.key.as_dict(), "function": function.as_record(True)},
                         self.config.cache_size_mb)

    def bypass(self, reason: str) -> None:
        """The graph gave up on this level: counted, and marked for later processes."""
        _bypass(self.config, self.name, reason)
        if self.store is not None:
            self.store.write(LEVEL, self.digest, {"key": self.key.as_dict(), "bypass": reason},
                             self.config.cache_size_mb)

    def release(self) -> None:
        """The compile is over: no process of the cluster waits any longer for an entry this one
        did not write (a written one has dropped its claim already)."""
        if self.store is not None:
            self.store.release(LEVEL, self.digest)


@dataclass(frozen=True, eq=False)
class Hit:
    """An entry that matches the graph, its kernel modules read in (``resolve``): the driver turns
    ``function`` into the callable (``aot.rebuild``), then ``accept``s it, or ``reject``s it when
    that fails (a bad entry: counted, removed, and the graph compiled into the slot)."""

    function: CompiledFunction
    symbols: compat.Symbols
    slot: Slot

    def accept(self) -> None:
        """The rebuilt function is the graph's: Dynamo now guards the frame on the entry's guards too."""
        if self.function.guards and not self.symbols.install(self.function.guards):
            raise CorruptEntry("its guards held on the sizes' hints but not on the sizes")
        events.hit(LEVEL, self.slot.name)

    def reject(self, exc: Exception) -> Slot:
        """The entry could not be rebuilt or accepted: the slot of the one that replaces it."""
        events.corrupt(LEVEL, self.slot.name, f"{type(exc).__name__}: {exc}")
        if self.slot.store is not None:
            self.slot.store.remove(LEVEL, self.slot.digest)
        events.miss(LEVEL, self.slot.name)
        return self.slot


@dataclass(frozen=True)
class Found:
    """What ``load`` found: an entry to rebuild (a hit), or the slot of the entry to write, or the
    reason the graph bypasses this level (all None: the cache is off and nothing is kept)."""

    hit: Hit | None = None
    slot: Slot | None = None
    bypass: str | None = None


def load(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Config, name: str,
         hints: Level1Hints, backward: bool = False, store: Store | None = None) -> Found:
    """The matching entry (a hit); else the slot of a new entry (None where there is none to
    write: the cache is off, or the graph bypasses this level). ``store``: the cache the caller
    opened (``modules.open_store``; None: off or unusable)."""
    if not config.cache and not hints.keep:
        return Found()
    try:
        symbols = compat.Symbols(example_inputs)  # before AOTAutograd: the guards it adds come after
        _check_inputs(gm, example_inputs, hints, config, backward, symbols)
        key = aot_key(gm, example_inputs, config, backward, hints, symbols)
    except Uncacheable as exc:
        return Found(bypass=_bypass(config, name, str(exc)))
    if store is None and config.cache:
        events.bypass(LEVEL, name, "no usable cache directory")
        if not hints.keep:
            return Found()
    digest = key.digest()

    def slot_at(at: str | None) -> Slot:
        return Slot(store if at else None, key, at or digest, config, name, symbols if symbols else None)

    if store is None:
        return Found(slot=slot_at(None))
    failed: list[str] = []  # the guards of this key's entries that this call's sizes fail
    at: str | None = digest
    try:
        for n in range(MAX_VARIANTS):
            at = variant_digest(digest, n)
            payload = store.read(LEVEL, at)
            if payload is None:  # another process of the cluster may be compiling it: wait for it
                payload = store.claim(LEVEL, at)
            if payload is None:
                break
            if "bypass" in payload:
                return Found(bypass=_bypass(config, name, payload["bypass"]))
            function = CompiledFunction.from_record(payload["function"])
            if function.guards and not (symbols and symbols.hold(function.guards)):
                failed.append(function.guards)
                continue
            return Found(hit=Hit(resolve(function, store), symbols, slot_at(at)))  # modules from level 2
        else:
            at = None  # every entry of the key is taken, each by other sizes: this one is not written
        events.miss(LEVEL, name, explain=lambda: _explain_guards(failed) if failed else explain_miss(store, key))
    except modules.MissingModule as exc:  # compiled again, and the entry written again
        why = str(exc)
        events.miss(LEVEL, name, explain=lambda: why)
        store.remove(LEVEL, at, only_bad=False)
    except Exception as exc:  # noqa: BLE001 - a bad entry is recompiled, never fatal
        events.corrupt(LEVEL, name, f"{type(exc).__name__}: {exc}")
        store.remove(LEVEL, at)
        events.miss(LEVEL, name)
    return Found(slot=slot_at(at))


MAX_VARIANTS = 8  # entries of one key (a symbolic graph's), each compiled under other guards on its sizes


def variant_digest(digest: str, n: int) -> str:
    """Where the ``n``-th entry of a key lives: the key's digest itself for the first (every graph
    with static shapes has only that one)."""
    return digest if n == 0 else hashlib.sha256(f"{digest}/{n}".encode()).hexdigest()


def _explain_guards(failed: list[str]) -> str:
    return f"{len(failed)} entries of this key were compiled for other sizes (their guards fail: {failed[0]})"


def _bypass(config: Config, name: str, reason: str) -> str:
    if config.cache:
        events.bypass(LEVEL, name, reason)
    return reason


def explain_miss(store: Store, key: CacheKey) -> str:
    """Which key fields differ from the nearest entry of the same level (for a debug log)."""
    best: list[str] | None = None
    for path in store.entry_paths():
        try:
            payload = store.read(key.level, path.stem)
        except CorruptEntry:
            continue
        if payload is not None and "key" in payload:
            diff = key.diff(payload["key"])
            if best is None or len(diff) < len(best):
                best = diff
    return "no entries to compare with" if best is None else "nearest entry differs in " + "; ".join(best)


def aot_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Config,
            backward: bool = False, hints: Level1Hints = NO_HINTS,
            symbols: compat.Symbols | None = None) -> CacheKey:
    """The key of a Dynamo graph. A symbolic graph's shows its inputs' symbolic sizes (its
    placeholders'), never the sizes of the call that compiles it: those are checked against the
    guards its entry keeps (``compat.Symbols``)."""
    static = [i for i, x in enumerate(example_inputs)
              if isinstance(x, torch.nn.Parameter) or getattr(x, "_dynamo_static_input_type", None)]
    devices = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    context = [
        ("grad_enabled", torch.is_grad_enabled()),
        ("inference_mode", torch.is_inference_mode_enabled()),
        ("deterministic", torch.are_deterministic_algorithms_enabled()),
        ("default_dtype", torch.get_default_dtype()),
        ("autocast", compat.autocast_text(sorted(devices))),  # AOTAutograd traces autocast's casts in
        ("functorch_config", compat.functorch_config_text()),
        ("compiled_autograd", backward),
    ]
    traced = None
    if symbols:  # what the ShapeEnv decides by its settings (0/1 specialization, duck sizing) is not in the text
        context.append(("shape_env", symbols.settings_text()))
        traced = [node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder")]
    return make_key(LEVEL, gm, example_inputs, config, static, context, hints.target_texts, traced)


def _check_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], hints: Level1Hints,
                  config: Config, backward: bool, symbols: compat.Symbols) -> None:
    """What we know up front we will not rebuild (AOTAutograd tells us the rest). Inputs may be
    sizes (a symbolic graph's) and fake tensors (DDPOptimizer's pieces' activations)."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise Uncacheable(f"not a GraphModule ({type(gm).__name__})")
    if hints.bypass:
        raise Uncacheable(hints.bypass)
    if next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None:
        raise Uncacheable("graph owns parameters or buffers")
    if compat.saved_tensors_hooks_inlined():
        raise Uncacheable("saved-tensor hooks are inlined")
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        raise Uncacheable(f"{len(example_inputs)} inputs for {len(placeholders)} placeholders")
    storages: dict[Any, int] = {}
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.SymInt) and x.node.has_hint() or type(x) is int:
            continue
        if not isinstance(x, torch.Tensor):
            raise Uncacheable(f"input {i} is a {type(x).__name__}, not a tensor or a size")
        if type(x) not in (torch.Tensor, torch.nn.Parameter) and not compat.is_fake(x) or x.layout != torch.strided:
            raise Uncacheable(f"input {i} is a {type(x).__name__} with layout {x.layout}")
        storage = compat.storage_id(x)
        if storage in storages:
            raise Uncacheable(f"inputs {storages[storage]} and {i} share storage")
        storages[storage] = i
    symbolic = [i for i, node in enumerate(placeholders) if _symbolic(node.meta.get("example_value"))]
    if symbolic and not symbols:
        raise Uncacheable(f"input {symbolic[0]} has symbolic sizes, but the graph takes no size input")
    if symbolic and config.batch_buckets and not backward:
        raise Uncacheable("batch buckets are planned as the graph compiles, and level 1 keeps no plan")


def _symbolic(value: Any) -> bool:
    """A size, or a tensor with a size, stride or offset, that is symbolic."""
    if isinstance(value, torch.Tensor):
        return any(compat.concrete_int(s) is None for s in (*value.shape, *value.stride(), value.storage_offset()))
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) and compat.concrete_int(value) is None


def resolve(function: CompiledFunction, store: Store | None) -> CompiledFunction:
    """The function with every kernel module read in from level 2 (``modules.resolve``): what
    ``rebuild`` and precompile take. MissingModule when one is gone or bad."""
    def read_in(part: CompiledPart) -> CompiledPart:
        if not isinstance(part.module, Level2Ref):
            return part
        return replace(part, module=modules.resolve(part.module, store), level_2=part.module.digest)

    return function.map_parts(read_in)
