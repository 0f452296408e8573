"""Level 1: a Dynamo graph's whole AOT result, so a warm start skips AOT tracing, partitioning and
codegen.

An entry holds, for each aten graph AOTAutograd produced (inference, or forward and backward): its
module record (``modules.module_record``: a generated module by the digest of its level-2 entry),
the GraphContext fields the driver gave it, and the metadata of its example inputs and constants
(``records``); plus the runtime plan (``compat.runtime_plan``) our wrapper needs. This module only
stores and loads: a hit (``Hit``) is the entry with its kernel modules read in from level 2 (one
that is gone or bad makes the hit a counted miss, and the entry is written again); the driver turns
it into the compiled function (``aot.rebuild``: each module wrapped in the runtime again, since
recording is per process, and our wrapper around them), then accepts it, or rejects it (a counted
corrupt entry, removed and recompiled). Nothing here calls back into the driver.

A compiled-autograd graph (``backward=True``) is traced with grad mode off: its one graph is an
inference graph to AOTAutograd and to our wrapper, and a backward to the runtime (the part's
``runtime_kind``). A graph whose ``Level1Hints`` hold a reason to bypass it bypasses this level.

A graph with symbolic sizes (an automatic-dynamic recompile, compiled autograd's ``dynamic=True``)
is keyed by its sizes as symbols (the placeholders', never the call's), the ShapeEnv's settings
beside them. AOTAutograd and our passes may add guards on those sizes while compiling (a size that
must not be 1, a divisibility), after Dynamo traced the graph: so the entry keeps every guard on
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

On a miss, ``load`` returns a ``Recorder``: the driver hands it every aten graph it compiles, and
it writes the entry once the inference graph is in, or, for a training graph, once AOTAutograd has
returned: then with AOTAutograd's backward graph and metadata (``backward_graph``), which compiled
autograd reads off the forward's Function instead of a compiled backward. A backward compiled later
(lazily, at a plain ``backward()``) replaces that entry by one that holds it; a hit on an entry
without one compiles it from the kept graph at the first ``backward()`` (``aot.rebuild.LazyBackward``). A graph
found uncacheable leaves a bypass marker, so later processes count a bypass with the reason instead
of a miss and go straight to AOTAutograd.

Precompile (``cgtrees.precompile``) saves the same entry in a file of its own: it hands a ``Kept``
in the ``Level1Hints``, and ``load`` and the recorder leave there the entry (a hit's or a new one's,
its modules' sources and binaries in it: the file needs no cache) or the reason the graph bypasses
this level. With the cache off, the recorder then still collects the entry, and writes nothing.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx

from cgtrees.cache import backward_graph, compat, events, modules, records
from cgtrees.cache.compat import Uncacheable
from cgtrees.cache.key import CacheKey, make_key
from cgtrees.cache.store import CorruptEntry, Store
from cgtrees.compiled import CompiledModule
from cgtrees.config import Config
from cgtrees.context import GraphContext
from cgtrees.logs import log_once

log = logging.getLogger("cgtrees.cache")

LEVEL = "aot"


class Kept:
    """What ``load`` and the recorder leave for precompile: the entry, or why there is none."""

    def __init__(self) -> None:
        self.payload: dict[str, Any] | None = None
        self.bypass: str | None = None


@dataclass(frozen=True)
class Level1Hints:
    """What the caller knows of a Dynamo graph that this level must respect."""

    kept: Kept | None = None  # precompile collects the entry here (torch will save the result)
    bypass: str | None = None  # why this level must not key the graph (``aot.compiled_autograd``)
    target_texts: dict[str, str] = field(default_factory=dict)  # the key's text of unnamed call targets


NO_HINTS = Level1Hints()


class Hit:
    """An entry that matches the graph, its kernel modules read in (``resolve``): the driver turns it
    into the compiled function (``aot.rebuild``), then ``accept``s it, or ``reject``s it when that
    fails (a bad entry: counted, removed, and the graph compiled into ``recorder``)."""

    def __init__(self, payload: dict[str, Any], guards: str | None, symbols: compat.Symbols,
                 recorder: "Recorder") -> None:
        self.payload, self.guards, self.symbols, self.recorder = payload, guards, symbols, recorder

    def accept(self) -> None:
        """The rebuilt function is the graph's: Dynamo now guards the frame on the entry's guards too."""
        if self.guards and not self.symbols.install(self.guards):
            raise CorruptEntry("its guards held on the sizes' hints but not on the sizes")
        events.hit(LEVEL, self.recorder.name)
        if self.recorder.kept is not None:
            self.recorder.kept.payload = self.payload

    def reject(self, exc: Exception) -> "Recorder":
        """The entry could not be rebuilt or accepted: the recorder of the one that replaces it."""
        name = self.recorder.name
        events.corrupt(LEVEL, name, f"{type(exc).__name__}: {exc}")
        if self.recorder.store is not None:
            self.recorder.store.remove(LEVEL, self.recorder.digest)
        events.miss(LEVEL, name)
        return self.recorder


@dataclass(frozen=True)
class Found:
    """What ``load`` found: an entry to rebuild (a hit), or the recorder of the entry to write."""

    hit: Hit | None = None
    recorder: "Recorder | None" = None


def load(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Config, name: str,
         hints: Level1Hints, backward: bool = False, store: Store | None = None) -> Found:
    """The matching entry (a hit); else the recorder of a new entry (None where there is none
    to write: the cache is off, or the graph bypasses this level). ``store``: the cache the caller
    opened (``modules.open_store``; None: off or unusable)."""
    kept = hints.kept
    if not config.cache and kept is None:
        return Found()
    try:
        symbols = compat.Symbols(example_inputs)  # before AOTAutograd: the guards it adds come after
        _check_inputs(gm, example_inputs, hints, config, backward, symbols)
        key = aot_key(gm, example_inputs, config, backward, hints, symbols)
    except Uncacheable as exc:
        _bypass(kept, config, name, str(exc))
        return Found()
    if store is None and config.cache:
        events.bypass(LEVEL, name, "no usable cache directory")
        if kept is None:
            return Found()
    digest = key.digest()

    def recorder(slot: str | None) -> Recorder:
        return Recorder(store if slot else None, key, slot or digest, config, name, len(example_inputs),
                        kept, backward, symbols)

    if store is None:
        return Found(recorder=recorder(None))
    failed: list[str] = []  # the guards of this key's entries that this call's sizes fail
    slot: str | None = digest
    try:
        for n in range(MAX_VARIANTS):
            slot = variant_digest(digest, n)
            payload = store.read(LEVEL, slot)
            if payload is None:  # another process of the cluster may be compiling it: wait for it
                payload = store.claim(LEVEL, slot)
            if payload is None:
                break
            if "bypass" in payload:
                _bypass(kept, config, name, payload["bypass"])
                return Found()
            guards = payload.get("guards")
            if guards and not (symbols and symbols.hold(guards)):
                failed.append(guards)
                continue
            return Found(hit=Hit(resolve(payload, store), guards, symbols, recorder(slot)))  # modules from level 2
        else:
            slot = None  # every entry of the key is taken, each by other sizes: this one is not written
        events.miss(LEVEL, name, explain=lambda: _explain_guards(failed) if failed else explain_miss(store, key))
    except modules.MissingModule as exc:  # compiled again, and the entry written again
        why = str(exc)
        events.miss(LEVEL, name, explain=lambda: why)
        store.remove(LEVEL, slot, only_bad=False)
    except Exception as exc:  # noqa: BLE001 - a bad entry is recompiled, never fatal
        events.corrupt(LEVEL, name, f"{type(exc).__name__}: {exc}")
        store.remove(LEVEL, slot)
        events.miss(LEVEL, name)
    return Found(recorder=recorder(slot))


MAX_VARIANTS = 8  # entries of one key (a symbolic graph's), each compiled under other guards on its sizes


def variant_digest(digest: str, n: int) -> str:
    """Where the ``n``-th entry of a key lives: the key's digest itself for the first (every graph
    with static shapes has only that one)."""
    return digest if n == 0 else hashlib.sha256(f"{digest}/{n}".encode()).hexdigest()


def _explain_guards(failed: list[str]) -> str:
    return f"{len(failed)} entries of this key were compiled for other sizes (their guards fail: {failed[0]})"


def _bypass(kept: Kept | None, config: Config, name: str, reason: str) -> None:
    if config.cache:
        events.bypass(LEVEL, name, reason)
    if kept is not None:
        kept.bypass = reason


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


def resolve(payload: dict[str, Any], store: Store | None) -> dict[str, Any]:
    """The entry with every kernel module read in from level 2 (``modules.resolve``): what
    ``rebuild`` and precompile take. MissingModule when one is gone or bad."""
    parts = {kind: {**part, "module": modules.resolve(part["module"], store)}
             for kind, part in payload["parts"].items()}
    return {**payload, "parts": parts}


class Recorder:
    """Collects one Dynamo graph's aten graphs as the driver compiles them, then writes the entry
    (to ``store``, and to ``kept`` for precompile; either may be None). The store's entry refers to
    the kernel modules level 2 holds; the kept one holds them.

    An inference graph's entry is written once it is compiled. A training graph's is written when
    AOTAutograd returns (``finish``), with AOTAutograd's backward graph and metadata
    (``backward_graph``), whether or not the backward is compiled by then; a backward compiled
    later (lazily, at the first plain ``backward()``) replaces that entry by one that holds it too.
    Under compiled autograd the backward is never compiled here: the first entry is the only one.
    """

    def __init__(self, store: Store | None, key: CacheKey, digest: str, config: Config, name: str,
                 num_inputs: int, kept: Kept | None = None, backward: bool = False,
                 symbols: compat.Symbols | None = None) -> None:
        self.store, self.key, self.digest, self.config = store, key, digest, config
        self.name, self.num_inputs, self.kept, self.backward = name, num_inputs, kept, backward
        self.symbols = symbols if symbols else None  # a symbolic graph's sizes: the entry keeps their guards
        self.disable_amp = compat.autocast_enabled()  # read before AOTAutograd, which turns autocast off
        self.parts: dict[str, dict[str, Any]] = {}
        self.kept_modules: dict[str, dict[str, Any]] = {}  # self-contained records, for ``kept``
        self.plan: dict[str, Any] | None = None
        self.detach: list[int] = []
        self.bw_graph: torch.fx.GraphModule | None = None  # AOTAutograd's, from our partition
        self.static_saved: tuple[str, ...] = ()  # its static inputs, by name
        self.meta: Any = None  # AOTAutograd's metadata of the forward (runtime-safe once it returns)
        self.extras: dict[str, Any] = {}  # the backward graph and metadata, once AOTAutograd returns
        self.finished = False  # AOTAutograd has returned
        self.partial = False  # an entry without the compiled backward is written
        self.done = False
        self.bypassed = False  # the graph gave up on level 1 (``_give_up``)

    def release(self) -> None:
        """The compile is over: no process of the cluster waits any longer for an entry this one
        did not write (a written one has dropped its claim already)."""
        if self.store is not None:
            self.store.release(LEVEL, self.digest)

    def keep_backward_graph(self, bw: torch.fx.GraphModule, static_saved: tuple[str, ...]) -> None:
        """AOTAutograd's backward graph as our partition made it, and its static inputs by name."""
        self.bw_graph, self.static_saved = bw, static_saved

    def add(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: GraphContext,
            module: CompiledModule, wrapped: bool, level_2: str | None = None) -> None:
        """``level_2``: the digest of the level-2 entry that holds ``module``, if one does."""
        if self.done:
            return
        kind = "inference" if self.backward else ctx.kind  # AOTAutograd's kind of graph
        try:
            self._add(gm, example_inputs, ctx, kind, module, wrapped, level_2)
        except Uncacheable as exc:
            self._give_up(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - our bug must not fail the compile; it is logged
            self._give_up(f"recording failed ({type(exc).__name__}: {exc})")
            return
        # A symbolic inference graph's entry waits for AOTAutograd to return: its guards are all in then.
        if kind == "inference" and self.symbols is None or (kind == "backward" and self.finished):
            self._write()

    def finish(self) -> None:
        """AOTAutograd has returned: write a training graph's entry, with its backward graph (a
        symbolic inference graph's, now that its guards are all in)."""
        self.finished = True
        if not self.done and "inference" in self.parts:
            self._write()
        if self.done or "forward" not in self.parts:
            return
        try:
            self.extras["backward_graph"] = backward_graph.record(self._backward_graph(), self.static_saved)
            if "backward" not in self.parts:
                self.detach = _inputs_to_detach(self.bw_graph, self.plan)
        except Uncacheable as exc:
            self.extras.clear()
            if "backward" not in self.parts:  # a plain backward may still compile it and write the entry
                log_once(log, f"no-bw-graph:{self.name}", "cgtrees: %s's level-1 entry waits for its backward "
                         "to be compiled (under compiled autograd it never is): %s", self.name, exc,
                         level=logging.INFO)
                return
        except Exception as exc:  # noqa: BLE001 - our bug must not fail the compile; it is logged
            self._give_up(f"recording the backward graph failed ({type(exc).__name__}: {exc})")
            return
        self._keep_metadata()
        self._write()

    def _backward_graph(self) -> torch.fx.GraphModule:
        if self.bw_graph is None:
            raise Uncacheable("AOTAutograd's backward graph did not come through our partition")
        return self.bw_graph

    def _keep_metadata(self) -> None:
        """AOTAutograd's metadata, which compiled autograd reads off the forward's Function."""
        if "backward_graph" not in self.extras:
            return
        try:
            self.extras["aot_metadata"] = compat.pickle_aot_metadata(self.meta)
        except Uncacheable as exc:  # a hit then runs our backward under compiled autograd: other graphs
            log_once(log, f"no-aot-meta:{self.name}", "cgtrees: %s: compiled autograd will not inline the "
                     "backward of its level-1 entry: %s", self.name, exc, level=logging.INFO)

    def _add(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: GraphContext, kind: str,
             module: CompiledModule, wrapped: bool, level_2: str | None) -> None:
        if kind in self.parts:
            raise Uncacheable(f"AOTAutograd compiled a second {kind} graph")
        num_constants = len(ctx.constants) if ctx.constants else 0
        if kind in ("forward", "inference"):
            if len(gm.graph.find_nodes(op="placeholder")) - num_constants != self.num_inputs:
                raise Uncacheable("AOTAutograd deduplicated or merged inputs")
            if kind == "forward" and compat.saved_tensors_hooks_inlined():
                raise Uncacheable("saved-tensor hooks are inlined")
            self.meta = compat.fw_metadata()
            self.plan = compat.runtime_plan(self.meta, kind, self.disable_amp)
        elif self.plan is None:
            raise Uncacheable("backward without a forward")
        else:
            self.detach = _inputs_to_detach(gm, self.plan)
        self.parts[kind] = {
            "name": ctx.name, "static_inputs": list(ctx.static_input_indices),
            "mutated_inputs": list(ctx.mutated_input_indices), "wrapped": wrapped,
            "inputs": [records.input_record(x) for x in example_inputs],
            "module": modules.module_record(gm, module, self.config, level_2 if self.store is not None else None),
            "constants": records.constant_records(ctx.constants),
        }
        if ctx.kind != kind:
            self.parts[kind]["runtime_kind"] = ctx.kind
        if ctx.saved_from is not None:
            self.parts[kind]["saved_from"] = ctx.saved_from
        if self.kept is not None and self.parts[kind]["module"]["format"] == "level-2":
            self.kept_modules[kind] = modules.module_record(gm, module, self.config)

    def _write(self) -> None:
        replace = self.partial  # the entry written without the compiled backward: this one holds it
        self.done = "forward" not in self.parts or "backward" in self.parts
        self.partial = not self.done
        try:
            guards = self.symbols.guards_text() if self.symbols is not None else None
        except Uncacheable as exc:
            self._give_up(str(exc))
            return
        payload = {"key": self.key.as_dict(), "plan": self.plan, "parts": self.parts, "detach": self.detach,
                   **self.extras, **({"guards": guards} if guards else {})}
        if self.kept is not None:
            parts = {kind: {**part, "module": self.kept_modules.get(kind, part["module"])}
                     for kind, part in self.parts.items()}
            self.kept.payload = {**payload, "parts": parts}  # holds the modules: the file needs no cache
        if self.store is not None:
            if replace:
                self.store.remove(LEVEL, self.digest, only_bad=False)
            self.store.write(LEVEL, self.digest, payload, self.config.cache_size_mb)

    def _give_up(self, reason: str) -> None:
        self.done = self.bypassed = True
        _bypass(self.kept, self.config, self.name, reason)
        if self.store is not None:
            self.store.write(LEVEL, self.digest, {"key": self.key.as_dict(), "bypass": reason},
                             self.config.cache_size_mb)


def _inputs_to_detach(bw: torch.fx.GraphModule, plan: dict[str, Any]) -> list[int]:
    """Non-leaf inputs that require grad but get no gradient: AOTAutograd detaches them."""
    output = next(iter(bw.graph.find_nodes(op="output")))
    grads = list(output.args[0])
    if len(grads) != plan["num_inputs"]:
        raise Uncacheable("backward returns extra outputs")
    return [i for i in plan["nonleaf_requiring_grad"] if grads[i] is None]
