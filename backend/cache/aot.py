"""Level 1: a Dynamo graph's whole AOT result, so a warm start skips AOT tracing, partitioning and
codegen.

An entry holds, for each aten graph AOTAutograd produced (inference, or forward and backward): its
module record (``modules.module_record``), the GraphContext fields the driver gave it, and the
metadata of its example inputs; plus the runtime plan (``compat.runtime_plan``) our wrapper needs.
A hit loads the modules, wraps each in the runtime again (recording is per process) with the same
context fields and one shared ``pair``, and puts our wrapper around them.

On a miss, a ``Recorder`` rides on the pair: the driver hands it every aten graph it compiles, and
it writes the entry once the last one (the inference graph, or the lazily compiled backward) is
in. A graph found uncacheable leaves a bypass marker, so later processes count a bypass with the
reason instead of a miss and go straight to AOTAutograd.

Precompile (``backend.precompile``) saves the same entry in a file of its own: it puts a ``Kept``
in the Dynamo graph's ``meta[KEEP]``, and ``load`` and the recorder leave there the entry (a hit's
or a new one's) or the reason the graph bypasses this level. With the cache off, the recorder
then still collects the entry, and writes nothing.
"""

from __future__ import annotations

import base64
from typing import Any, Callable, Sequence

import torch
import torch.fx

from backend.cache import compat, events, modules, wrappers
from backend.cache.compat import Uncacheable
from backend.cache.key import CacheKey, make_key
from backend.cache.store import CorruptEntry, Store
from backend.config import Config
from backend.context import GraphContext

LEVEL = "aot"
Wrap = Callable[[Any, list[Any], GraphContext], Callable[[list[Any]], Any]]


KEEP = "cgtrees_keep_aot_entry"


class Kept:
    """What ``load`` and the recorder leave for precompile: the entry, or why there is none."""

    def __init__(self) -> None:
        self.payload: dict[str, Any] | None = None
        self.bypass: str | None = None


def load(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Config, name: str,
         pair: Any, wrap: Wrap) -> Callable[..., Any] | None:
    """The compiled function on a hit; None otherwise (then a recorder rides on ``pair``)."""
    kept: Kept | None = gm.meta.get(KEEP) if isinstance(getattr(gm, "meta", None), dict) else None
    if not config.cache and kept is None:
        return None
    try:
        _check_inputs(gm, example_inputs)
        key = aot_key(gm, example_inputs, config)
    except Uncacheable as exc:
        _bypass(kept, config, name, str(exc))
        return None
    store = modules.open_store(config) if config.cache else None
    if store is None and config.cache:
        events.bypass(LEVEL, name, "no usable cache directory")
        if kept is None:
            return None
    digest = key.digest()
    if store is not None:
        try:
            payload = store.read(LEVEL, digest)
            if payload is not None and "bypass" in payload:
                _bypass(kept, config, name, payload["bypass"])
                return None
            if payload is not None:
                compiled = rebuild(payload, config, name, pair, wrap)
                events.hit(LEVEL, name)
                if kept is not None:
                    kept.payload = payload
                return compiled
        except Exception as exc:  # noqa: BLE001 - a bad entry is recompiled, never fatal
            events.corrupt(LEVEL, name, f"{type(exc).__name__}: {exc}")
            store.remove(LEVEL, digest)
        events.miss(LEVEL, name, explain=lambda: explain_miss(store, key))
    pair.cache_recorder = Recorder(store, key, digest, config, name, len(example_inputs), kept)
    return None


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


def aot_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Config) -> CacheKey:
    static = [i for i, x in enumerate(example_inputs)
              if isinstance(x, torch.nn.Parameter) or getattr(x, "_dynamo_static_input_type", None)]
    context = [
        ("grad_enabled", torch.is_grad_enabled()),
        ("inference_mode", torch.is_inference_mode_enabled()),
        ("deterministic", torch.are_deterministic_algorithms_enabled()),
        ("default_dtype", torch.get_default_dtype()),
        ("functorch_config", compat.functorch_config_text()),
    ]
    return make_key(LEVEL, gm, example_inputs, config, static, context)


def _check_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """What we know up front we will not rebuild (AOTAutograd tells us the rest)."""
    if type(gm) is not torch.fx.GraphModule and not isinstance(gm, torch.fx.GraphModule):
        raise Uncacheable(f"not a GraphModule ({type(gm).__name__})")
    if next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None:
        raise Uncacheable("graph owns parameters or buffers")
    if compat.autocast_enabled():
        raise Uncacheable("autocast is on")
    if compat.saved_tensors_hooks_inlined():
        raise Uncacheable("saved-tensor hooks are inlined")
    storages = set()
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise Uncacheable(f"input {i} is a {type(x).__name__}, not a tensor (dynamic shapes?)")
        if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.layout != torch.strided:
            raise Uncacheable(f"input {i} is a {type(x).__name__} with layout {x.layout}")
        storage = compat.storage_id(x)
        if storage in storages:
            raise Uncacheable("inputs share storage")
        storages.add(storage)
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and any(not isinstance(s, int) for s in (*value.shape, *value.stride())):
            raise Uncacheable("dynamic shapes")


def rebuild(payload: dict[str, Any], config: Config, name: str, pair: Any, wrap: Wrap) -> Callable[..., Any]:
    plan, parts = payload["plan"], payload["parts"]
    mode = compat.fake_mode()  # one for all parts: making one costs more than the tensors
    calls = {kind: _load_part(part, kind, config, pair, wrap, mode, name) for kind, part in parts.items()}
    if set(calls) == {"inference"}:
        return wrappers.inference_function(calls["inference"], plan)
    if set(calls) == {"forward", "backward"}:
        return wrappers.training_function(calls["forward"], calls["backward"], plan, payload["detach"])
    raise CorruptEntry(f"entry holds graphs {sorted(calls)}")


def _load_part(part: dict[str, Any], kind: str, config: Config, pair: Any, wrap: Wrap,
               mode: Any, name: str) -> Callable[[list[Any]], Any]:
    consts = load_constants(part.get("constants", []))
    # The entry's names are those of the process that wrote it ("g3_forward"): this process
    # names its graphs itself, so two functions never share a name in the runtime.
    _, sep, suffix = part["name"].partition("_")
    ctx = GraphContext(config=config, kind=kind, name=f"{name}_{suffix}" if sep else name,
                       static_input_indices=tuple(part["static_inputs"]),
                       mutated_input_indices=tuple(part["mutated_inputs"]), pair=pair, constants=consts)
    module = modules.load_record(part["module"], ctx)
    if not part["wrapped"]:
        return consts.append(module.call) if consts else module.call
    return wrap(module, compat.fake_tensors(part["inputs"], mode), ctx)


MAX_CONSTANT_BYTES = 1 << 20  # an entry keeps its graphs' constants; larger ones are not kept


def constant_records(consts: Any) -> list[dict[str, Any]]:
    """A graph's lifted constants as JSON records (their bytes in base64)."""
    if not consts:
        return []
    total = sum(t.numel() * t.element_size() for t in consts.tensors)
    if total > MAX_CONSTANT_BYTES:
        raise Uncacheable(f"graph holds {total} bytes of tensor constants (more than {MAX_CONSTANT_BYTES})")
    return [{"name": name, **_tensor_spec(t), "data": base64.b64encode(compat.tensor_bytes(t)).decode()}
            for name, t in zip(consts.names, consts.tensors)]


def load_constants(records: list[dict[str, Any]]) -> Any:
    """The graph's constants; None when it has none (``aot.constants`` imports AOTAutograd, which
    a precompiled function's load otherwise never needs)."""
    if not records:
        return None
    from backend.aot.constants import Constants

    tensors = []
    for r in records:
        dtype = getattr(torch, r["dtype"])
        data = bytearray(base64.b64decode(r["data"]))
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        value = torch.empty_strided(r["size"], r["stride"], dtype=dtype, device=r["device"])
        value.copy_(flat.reshape(r["size"]))
        tensors.append(value)
    return Constants(tuple(r["name"] for r in records), tuple(tensors))


class Recorder:
    """Collects one Dynamo graph's aten graphs as the driver compiles them, then writes the entry
    (to ``store``, and to ``kept`` for precompile; either may be None)."""

    def __init__(self, store: Store | None, key: CacheKey, digest: str, config: Config, name: str,
                 num_inputs: int, kept: Kept | None = None) -> None:
        self.store, self.key, self.digest, self.config = store, key, digest, config
        self.name, self.num_inputs, self.kept = name, num_inputs, kept
        self.parts: dict[str, dict[str, Any]] = {}
        self.plan: dict[str, Any] | None = None
        self.detach: list[int] = []
        self.done = False

    def add(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: GraphContext,
            module: Any, wrapped: bool) -> None:
        if self.done:
            return
        try:
            self._add(gm, example_inputs, ctx, module, wrapped)
        except Uncacheable as exc:
            self._give_up(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - our bug must not fail the compile; it is logged
            self._give_up(f"recording failed ({type(exc).__name__}: {exc})")
            return
        if ctx.kind in ("inference", "backward"):
            self._write()

    def _add(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: GraphContext,
             module: Any, wrapped: bool) -> None:
        if ctx.kind in self.parts:
            raise Uncacheable(f"AOTAutograd compiled a second {ctx.kind} graph")
        num_constants = len(ctx.constants) if ctx.constants else 0
        if ctx.kind in ("forward", "inference"):
            if len(gm.graph.find_nodes(op="placeholder")) - num_constants != self.num_inputs:
                raise Uncacheable("AOTAutograd deduplicated or merged inputs")
            if ctx.kind == "forward" and compat.saved_tensors_hooks_inlined():
                raise Uncacheable("saved-tensor hooks are inlined")
            self.plan = compat.runtime_plan(compat.fw_metadata(), ctx.kind)
        elif self.plan is None:
            raise Uncacheable("backward without a forward")
        else:
            self.detach = _inputs_to_detach(gm, self.plan)
        self.parts[ctx.kind] = {
            "name": ctx.name, "static_inputs": list(ctx.static_input_indices),
            "mutated_inputs": list(ctx.mutated_input_indices), "wrapped": wrapped,
            "inputs": [_tensor_spec(x) for x in example_inputs],
            "module": modules.module_record(gm, module),
            "constants": constant_records(ctx.constants),
        }

    def _write(self) -> None:
        self.done = True
        payload = {"key": self.key.as_dict(), "plan": self.plan, "parts": self.parts, "detach": self.detach}
        if self.kept is not None:
            self.kept.payload = payload
        if self.store is not None:
            self.store.write(LEVEL, self.digest, payload, self.config.cache_size_mb)

    def _give_up(self, reason: str) -> None:
        self.done = True
        _bypass(self.kept, self.config, self.name, reason)
        if self.store is not None:
            self.store.write(LEVEL, self.digest, {"key": self.key.as_dict(), "bypass": reason},
                             self.config.cache_size_mb)


def record(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: GraphContext, module: Any,
           wrapped: bool) -> None:
    recorder = getattr(ctx.pair, "cache_recorder", None)
    if recorder is not None:
        recorder.add(gm, example_inputs, ctx, module, wrapped)


def _inputs_to_detach(bw: torch.fx.GraphModule, plan: dict[str, Any]) -> list[int]:
    """Non-leaf inputs that require grad but get no gradient: AOTAutograd detaches them."""
    output = next(iter(bw.graph.find_nodes(op="output")))
    grads = list(output.args[0])
    if len(grads) != plan["num_inputs"]:
        raise Uncacheable("backward returns extra outputs")
    return [i for i in plan["nonleaf_requiring_grad"] if grads[i] is None]


def _tensor_spec(x: Any) -> dict[str, Any]:
    if not isinstance(x, torch.Tensor) or any(not isinstance(s, int) for s in (*x.shape, *x.stride())):
        raise Uncacheable("a graph input is not a static-shape tensor")
    return {"size": list(x.shape), "stride": list(x.stride()),
            "dtype": str(x.dtype).removeprefix("torch."), "device": str(x.device)}
