"""Level 2: one kernel module per aten graph, keyed by the aten graph, so two Dynamo graphs that
lower to the same aten graph share it and a hit skips codegen.

A lookup and store service beside the pipeline; the driver lists the steps (``aot.driver``):

    key_for(gm, example_inputs, ctx, store) -> ModuleKey | None    None: cache off, or the graph has no key
    lookup(key, gm, example_inputs, ctx) -> module | None    a hit loads the entry's CompiledGraph
    store(key, module, ctx) -> bool                          whether the entry now holds the module

An entry is the module's ``CompiledGraph`` record (``cgtrees.compiled``): its source, its kernels'
compiled binaries and the compiled Python of its source, and what is known of it. A graph that
runs through aten is not stored here. A bad entry is a counted ``corrupt``, removed, and a miss.
A hit takes the facts of the graph at hand (its outputs' source lines are this program's).

A level-1 function refers to this level's entry by its digest (``Level2Ref``), and ``resolve``
reads the entry back in, as precompile saves it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from types import EllipsisType
from typing import Any, Iterator, Sequence

import torch
import torch.fx

from cgtrees import codegen
from cgtrees.cache import events
from cgtrees.cache.compat import Uncacheable
from cgtrees.cache.key import CacheKey, constants_text, make_key
from cgtrees.cache.store import CorruptEntry, Store
from cgtrees.codegen import binaries as codegen_binaries
from cgtrees.compiled import CompiledGraph, CompiledModule, GraphFacts
from cgtrees.compiled_function import Level2Ref
from cgtrees.config import Config
from cgtrees.context import GraphContext

LEVEL = "module"


@dataclass(frozen=True)
class ModuleKey:
    """Where one aten graph's kernel module lives in the store."""

    key: CacheKey
    digest: str
    store: Store


def key_for(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: GraphContext,
            store: Store | None | EllipsisType = ...) -> ModuleKey | None:
    """The graph's entry in ``store`` (``open_store``'s; a call on its own, ``...``, opens it); None
    when the cache is off, or (a counted bypass) cannot hold it."""
    if not ctx.config.cache:
        return None
    if store is ...:
        store = open_store(ctx.config)
    if store is None:
        events.bypass(LEVEL, ctx.name, "no usable cache directory")
        return None
    try:
        key = module_key(gm, example_inputs, ctx)
    except Exception as exc:  # noqa: BLE001 - a graph we cannot key is compiled, uncached
        events.bypass(LEVEL, ctx.name, str(exc) if isinstance(exc, Uncacheable) else f"{type(exc).__name__}: {exc}")
        return None
    return ModuleKey(key, key.digest(), store)


def lookup(key: ModuleKey | None, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
           ctx: GraphContext) -> CompiledModule | None:
    """The stored module (a counted hit), else None (a counted miss; a bad entry is removed)."""
    if key is None:
        return None
    try:
        payload = key.store.read(LEVEL, key.digest)
        if payload is None:  # another process of the cluster may be compiling it: wait for it
            payload = key.store.claim(LEVEL, key.digest)
        module = None if payload is None else _load_entry(payload, gm, example_inputs, ctx)
    except Exception as exc:  # noqa: BLE001 - a bad entry is recompiled, never fatal
        events.corrupt(LEVEL, ctx.name, f"{type(exc).__name__}: {exc}")
        key.store.remove(LEVEL, key.digest)
        module = None
    if module is None:
        events.miss(LEVEL, ctx.name)
    else:
        events.hit(LEVEL, ctx.name)
    return module


def _load_entry(payload: dict[str, Any], gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                ctx: GraphContext) -> CompiledModule:
    graph = CompiledGraph.from_record(payload["graph"]).with_facts(GraphFacts.of(gm))  # this program's lines
    return codegen.load(graph, ctx, fresh=False)


def store(key: ModuleKey | None, module: CompiledModule, ctx: GraphContext) -> bool:
    """Keep a generated module (its source, binaries and compiled code); False when it is not kept
    (no key, a graph that runs through aten, a write that failed)."""
    if key is None:
        return False
    try:
        if not isinstance(module, codegen.KernelModule):
            return False  # a graph that runs through aten
        graph = kept_graph(module, ctx.config)
        return key.store.write(LEVEL, key.digest, {"key": key.key.as_dict(), "graph": graph.as_record()},
                               ctx.config.cache_size_mb)
    finally:
        key.store.release(LEVEL, key.digest)  # written or not: no process of the cluster waits for it


def kept_graph(module: codegen.KernelModule, config: Config) -> CompiledGraph:
    """What an entry keeps of a generated module: its graph with the binaries its kernels compiled,
    and (compiled, not interpreted) the compiled code a warm start runs instead of its source."""
    try:
        graph = module.compiled()
    except Exception as exc:  # noqa: BLE001 - the entry is still good; its kernels go through the JIT
        events.log.warning("cgtrees cache: the compiled kernels of %s are not kept (%s: %s)",
                           module.name, type(exc).__name__, exc)
        graph = module.graph
    if config.interpret:  # interpreted kernels are loaded from their source (``codegen.load``)
        return graph
    return dataclasses.replace(graph, code=code_record(graph.source, graph.binaries))


def code_record(source: str, binaries: dict[str, list[dict]]) -> dict[str, str] | None:
    """The compiled code a warm start runs instead of compiling ``source`` (``codegen.binaries``);
    None when it cannot be made (the entry is still good: its source is compiled at load)."""
    try:
        return codegen_binaries.code_record(source, binaries)
    except Exception as exc:  # noqa: BLE001
        events.log.warning("cgtrees cache: no compiled code kept for a module (%s: %s)", type(exc).__name__, exc)
        return None


def module_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: GraphContext) -> CacheKey:
    context = [("kind", ctx.kind), ("mutated_inputs", ctx.mutated_input_indices)]
    if ctx.constants:
        context.append(("constants", constants_text(ctx.constants.names, ctx.constants.tensors)))
    return make_key(LEVEL, gm, example_inputs, ctx.config, ctx.static_input_indices, context)


def open_store(config: Config) -> Store | None:
    """The cache of ``config`` (None: off, or unusable, said once), opened once per Dynamo graph
    by the driver and handed to each step."""
    if not config.cache:
        return None
    return Store.open(config)


def triton_key_file(store: Store | None) -> Path | None:
    """Where Triton's hash of its own installation is kept between processes (0.3-0.5 s to compute
    at each start); None when the cache is off or unusable."""
    return None if store is None else store.triton_dir() / "cgtrees-triton-key.json"


@contextlib.contextmanager
def triton_cache_dir(store: Store | None) -> Iterator[None]:
    """Triton's own on-disk cache in our store's directory for the compiles inside, through
    Triton's configuration (``triton.knobs.cache``, put back on the way out): the rest of the
    process keeps its own. A directory the user chose (``TRITON_CACHE_DIR``, or the knob) wins."""
    knobs = _triton_knobs()
    if store is None or knobs is None or os.environ.get("TRITON_CACHE_DIR") or "dir" in vars(knobs.cache):
        yield
        return
    with knobs.cache.scope():
        knobs.cache.dir = str(store.triton_dir())
        yield


def _triton_knobs() -> Any:
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one without knobs (before 3.4): Triton's default directory
        return None
    return knobs if hasattr(knobs, "cache") and hasattr(knobs.cache, "scope") else None


# ---- level 1's references to this level ----------------------------------------------------------

class MissingModule(Exception):
    """A level-1 entry refers to a level-2 entry that is gone or bad (evicted, cleared, damaged)."""


def resolve(ref: Level2Ref, store: Store | None) -> CompiledGraph:
    """The module a level-1 entry refers to, read in from this level, with the referring
    function's facts of its graph. MissingModule when the entry cannot be read."""
    digest = ref.digest
    if store is None:
        raise MissingModule(f"kernel module {digest[:12]} is in a cache this process cannot use")
    try:
        payload = store.read(LEVEL, digest)
    except CorruptEntry as exc:
        events.corrupt(LEVEL, digest[:12], str(exc))
        store.remove(LEVEL, digest)
        raise MissingModule(f"kernel module {digest[:12]}'s entry is bad ({exc})") from None
    if payload is None:
        raise MissingModule(f"kernel module {digest[:12]} is no longer in the cache")
    if not isinstance(payload.get("graph"), dict):
        raise MissingModule(f"kernel module {digest[:12]}'s entry holds no graph")
    events.hit(LEVEL, digest[:12])
    return CompiledGraph.from_record(payload["graph"]).with_facts(ref.facts)
