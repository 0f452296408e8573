"""Every torch private API the cache uses, in one place (torch 2.11 on the GPU, 2.13 in CI).

The first cache level replaces AOTAutograd's runtime wrappers with our own, so it must read
AOTAutograd's metadata (``ViewAndMutationMeta``) at compile time. ``runtime_plan`` turns that
metadata into a plain, JSON-able plan for the common case, and raises ``Uncacheable`` with a
reason for everything else: the caller then bypasses the first level. Fields that are missing in
an older torch read as their neutral value.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import logging
import pickle
from typing import Any, Callable, Iterable

import torch
import torch.fx

log = logging.getLogger("cgtrees.cache")

__all__ = [
    "Uncacheable", "fw_metadata", "runtime_plan", "fake_mode", "fake_tensors", "storage_id",
    "increment_version", "view_replay", "saved_tensors_hooks_inlined", "autocast_enabled",
    "tensor_bytes", "pickle_aot_metadata",
    "aot_backward_attributes", "release_saved", "is_fake", "Symbols", "autocast_text", "no_autocast",
    "mark_dynamic_dims", "concrete_int",
]


class Uncacheable(Exception):
    """A graph the first cache level does not rebuild; the message is the reason (logged)."""


def fw_metadata() -> Any:
    """AOTAutograd's ViewAndMutationMeta of the graph being compiled now (None outside AOT)."""
    context = torch._guards.TracingContext.try_get()
    return getattr(context, "fw_metadata", None) if context is not None else None


def _name(enum_value: Any) -> str:
    return getattr(enum_value, "name", str(enum_value))


def _check_common(meta: Any, kind: str) -> None:
    """What the wrapper we rebuild for ``kind`` does not handle: raise Uncacheable with the reason."""
    from torch._functorch._aot_autograd.schemas import PlainTensorMeta

    checks = [
        (any(not isinstance(m, PlainTensorMeta) and not isinstance(m, int) for m in meta.subclass_inp_meta),
         "tensor subclass input"),
        (any(not isinstance(m, PlainTensorMeta) and not isinstance(m, int) for m in meta.subclass_fw_graph_out_meta),
         "tensor subclass output"),
        (bool(getattr(meta, "tokens", None)), "side-effect tokens"),
        (meta.num_intermediate_bases > 0, "outputs alias intermediates"),
        (meta.grad_enabled_mutation is not None, "graph changes grad mode"),
        (bool(getattr(meta, "is_rng_op_functionalized", False)), "functionalized rng"),
        (getattr(meta, "num_graphsafe_rng_states", 0) > 0, "graph-safe rng states"),
    ]
    for bad, reason in checks:
        if bad:
            raise Uncacheable(reason)
    for i, info in enumerate(meta.input_info):
        mutation = _name(info.mutation_type)
        if mutation == "MUTATED_OUT_GRAPH":
            raise Uncacheable(f"input {i} is mutated outside the graph")
        if info.mutates_metadata or info.mutates_storage_metadata:
            raise Uncacheable(f"input {i} has a metadata mutation")
    # Inference outputs that are an input or a view of one: the runtime hands back the caller's input
    # or a view over it (``runtime/node.py``), so our wrapper returns them as AOTAutograd's would.
    plain = ("non_alias", "unsafe_view_alias", *(("is_input", "alias_of_input") if kind == "inference" else ()))
    for i, out in enumerate(meta.output_info):
        if _name(out.output_type) not in plain:
            raise Uncacheable(f"output {i} aliases an input or intermediate ({_name(out.output_type)})")
        if not (isinstance(out.raw_type, type) and issubclass(out.raw_type, torch.Tensor)):
            raise Uncacheable(f"output {i} is not a tensor")


def _tangent_format(meta: Any) -> dict[str, Any]:
    fmt = getattr(meta, "memory_format", None)
    if fmt is None:
        raise Uncacheable("tangent without a memory format")
    if fmt.memory_format is not None:
        return {"memory_format": str(fmt.memory_format).removeprefix("torch.")}
    if any(not isinstance(s, int) for s in (*fmt.size, *fmt.stride)):  # int() would guard on the size
        raise Uncacheable("a tangent of symbolic size with a non-standard layout")
    return {"size": list(fmt.size), "stride": list(fmt.stride)}


def runtime_plan(meta: Any, kind: str, disable_amp: bool = False) -> dict[str, Any]:
    """The plain facts our runtime wrapper needs (see ``cgtrees.aot.wrappers``). ``disable_amp``:
    autocast was on when the Dynamo graph came (AOTAutograd turns it off before it calls a compiler,
    so ``autocast_enabled()`` must be read before AOTAutograd runs)."""
    if meta is None:
        raise Uncacheable("no AOTAutograd metadata")
    _check_common(meta, kind)
    plan: dict[str, Any] = {
        "num_inputs": len(meta.input_info),
        "num_outputs": len(meta.output_info),
        # Outputs' symbolic dimensions, marked on them as AOTAutograd does, so that Dynamo makes
        # those dimensions dynamic where a later graph reads the output.
        "dynamic_dims": [[i, sorted(out.dynamic_dims)] for i, out in enumerate(meta.output_info)
                         if getattr(out, "dynamic_dims", None)],
        # The graph was compiled with autocast on: it holds autocast's casts, and runs with autocast
        # off (as AOTAutograd runs it), so that aten calls in the module are not cast again.
        "disable_amp": disable_amp,
        # Kept-in-graph mutations autograd must see: AOT bumps their version counters first.
        "bump_versions": [i for i, info in enumerate(meta.input_info)
                          if _name(info.mutation_type) == "MUTATED_IN_GRAPH"
                          and not info.mutations_hidden_from_autograd],
    }
    if kind == "inference":
        # An output that is a view of an input and requires grad (a reshape after a graph break): autograd
        # must see the view, which AOTAutograd's wrapper makes of the caller's input (``x.detach()``
        # requires none; nor does anything traced with grad off, compiled autograd's backward graphs)
        for i, out in enumerate(meta.output_info):
            if _name(out.output_type) == "alias_of_input" and out.requires_grad and torch.is_grad_enabled():
                raise Uncacheable(f"output {i} is a view of input {out.base_idx} that requires grad")
        # An output that is an input (compiled autograd accumulating into a ``.grad`` in place):
        # the caller gets the input itself, as from AOTAutograd.
        plan["input_outputs"] = [[i, out.base_idx] for i, out in enumerate(meta.output_info)
                                 if _name(out.output_type) == "is_input"]
        return plan
    if getattr(meta, "num_opaque_objects_saved_for_bw", 0):
        raise Uncacheable("opaque objects saved for backward")
    if getattr(meta, "indices_of_inputs_that_requires_grad_with_mutations_in_bw", None):
        raise Uncacheable("backward mutates an input that requires grad")
    surviving = [i for i, out in enumerate(meta.output_info)
                 if getattr(out, "requires_grad_for_backward", out.requires_grad)]
    tangent_metas = list(meta.subclass_tangent_meta)
    if len(tangent_metas) != len(surviving):
        raise Uncacheable("tangents do not match differentiable outputs")
    plan.update({
        "unsafe_view_outputs": [i for i, out in enumerate(meta.output_info)
                                if _name(out.output_type) == "unsafe_view_alias"],
        "non_differentiable_outputs": [i for i, out in enumerate(meta.output_info) if not out.requires_grad],
        "tangent_outputs": surviving,
        "tangent_formats": [_tangent_format(m) for m in tangent_metas],
        "num_saved_no_vc_check": int(getattr(meta, "num_tensors_saved_with_no_vc_check", 0) or 0),
        "nonleaf_requiring_grad": [i for i, info in enumerate(meta.input_info)
                                   if info.requires_grad and not info.is_leaf],
        "any_input_requires_grad": any(info.requires_grad for info in meta.input_info),
        "deterministic": meta.deterministic,
        "num_saved_symints": int(getattr(meta, "num_symints_saved_for_bw", 0) or 0),
        # saved tensors' symbolic dimensions (by position among the saved tensors), marked as AOTAutograd does
        "dynamic_saved": [[i, sorted(dims)] for i, dims in
                          sorted((getattr(meta, "dynamic_saved_tensors_idxs", None) or {}).items())],
    })
    return plan


# ---- what compiled autograd reads off AOTAutograd's autograd.Function ---------------------------
#
# Compiled autograd treats a Function whose class has ``_aot_id`` as AOTAutograd's: it copies the
# class's backward graph (``_lazy_backward_info``) into its capture, behind a call of the backward
# prologue. torch 2.11 calls ``runtime_wrappers._backward_prologue_functional`` (and its epilogue)
# with the class's ``metadata``, AOTAutograd's ViewAndMutationMeta; torch 2.13 calls the class's
# ``_bw_prologue_fn`` and ``_bw_epilogue_fn``, which AOTAutograd generates from that metadata. Both
# read only the metadata, so a rebuilt forward keeps it (pickled, as AOTAutograd's own cache does,
# once AOTAutograd has made it runtime-safe) and hands compiled autograd exactly what it would.

_aot_ids = itertools.count(1 << 20)  # apart from AOTAutograd's own ids (compiled autograd names nodes by them)


def pickle_aot_metadata(meta: Any) -> str:
    """AOTAutograd's ViewAndMutationMeta of a compiled training graph, for the entry (base64)."""
    if meta is None:
        raise Uncacheable("no AOTAutograd metadata")
    if getattr(meta, "traced_tangents", None):
        raise Uncacheable("AOTAutograd's metadata is not runtime-safe yet")
    try:
        return base64.b64encode(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)).decode()
    except Exception as exc:  # noqa: BLE001 - the entry is written without it
        raise Uncacheable(f"AOTAutograd's metadata cannot be pickled ({type(exc).__name__}: {exc})") from None


def aot_backward_attributes(meta_text: str, bw_module_fn: Callable[[], torch.fx.GraphModule]) -> dict[str, Any]:
    """The class attributes by which compiled autograd takes a rebuilt forward's Function for
    AOTAutograd's (an entry of the same torch version wrote ``meta_text``: the key says so)."""
    from torch._functorch._aot_autograd import runtime_wrappers as rw

    meta = pickle.loads(base64.b64decode(meta_text))  # noqa: S301 - our own entry, in our private directory
    attributes: dict[str, Any] = {
        "_aot_id": next(_aot_ids),
        "metadata": meta,
        "maybe_subclass_metadata": None,
        "num_symints_saved_for_bw": 0,
        "_lazy_backward_info": rw.CachedAutogradLazyBackwardCompileInfo(bw_module_fn),
    }
    if hasattr(rw, "_codegen_backward_prologue"):  # torch 2.13; 2.11 reads ``metadata`` itself
        attributes["_bw_prologue_fn"] = rw._codegen_backward_prologue(meta, None, None)
        attributes["_bw_epilogue_fn"] = rw._codegen_backward_epilogue(meta, None, None)
    return attributes


def fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_tensors(specs: Iterable[dict[str, Any]], mode: Any) -> list[torch.Tensor]:
    """Stand-ins for a graph's example inputs (what AOTAutograd would pass) where it is compiled from a
    record: a lazily compiled backward (a hit wraps its modules without them: ``Examples``)."""
    out = []
    with mode:
        for s in specs:
            out.append(torch.empty_strided(s["size"], s["stride"], dtype=getattr(torch, s["dtype"]),
                                           device=torch.device(s["device"])))
    return out


def storage_id(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def increment_version(tensors: list[torch.Tensor]) -> None:
    try:
        torch.autograd.graph.increment_version(tensors)
    except TypeError:  # older torch: one tensor at a time
        for t in tensors:
            torch.autograd.graph.increment_version(t)


_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None) or (lambda: True)


def release_saved(ctx: Any) -> None:
    """Drop what the forward saved for a backward that keeps no graph (no ``retain_graph``), as
    AOTAutograd's backward does (``maybe_clear_saved_tensors``) once it has read them: the call's
    arguments then hold the activations alone, so the backward's CUDA graph frees each at its last
    read (the runtime's hand-off) and a warm process peaks where a cold one does."""
    if _keep_graph():
        return
    clear = getattr(ctx, "maybe_clear_saved_tensors", None)
    if clear is not None:
        clear()
    ctx.saved_no_vc_check = ()


class view_replay:  # noqa: N801 - a context manager, named like one
    """AOTAutograd runs a training graph with view replay on (outputs' views regenerate properly)."""

    def __enter__(self) -> None:
        self.prev = torch._C._is_view_replay_enabled()
        if not self.prev:
            torch._C._set_view_replay_enabled(True)

    def __exit__(self, *exc: Any) -> None:
        if torch._C._is_view_replay_enabled() != self.prev:
            torch._C._set_view_replay_enabled(self.prev)


def saved_tensors_hooks_inlined() -> bool:
    """AOTAutograd inlines some saved-tensor hooks into the graphs and disables them at runtime."""
    utils = torch._functorch._aot_autograd.utils
    top = getattr(utils, "top_saved_tensors_hooks", None)
    inlineable = getattr(utils, "saved_tensors_hooks_are_inlineable", None)
    if top is None or inlineable is None:
        return False
    return bool(inlineable(top()))


def autocast_enabled() -> bool:
    return bool(torch._C._is_any_autocast_enabled())


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def autocast_text(devices: Iterable[str] = ()) -> str:
    """Autocast's state, for the key: the device types it is on for (each with its dtype) and
    whether it caches casts; "off" when it is off everywhere (the text of every graph compiled
    without autocast, so their keys do not change when a torch adds a device type)."""
    if not autocast_enabled():
        return "off"
    on = []
    for device in dict.fromkeys((*_AUTOCAST_DEVICES, *devices)):
        try:
            if torch.is_autocast_enabled(device):
                on.append(f"{device}:{str(torch.get_autocast_dtype(device)).removeprefix('torch.')}")
        except (RuntimeError, TypeError, ValueError):  # a device type this torch does not know
            continue
    return " ".join(on) + f" cache={torch.is_autocast_cache_enabled()}"


def no_autocast(off: bool) -> Any:
    """The context AOTAutograd runs a graph compiled under autocast in: autocast off (the graph
    holds its casts already; an aten call in it must not be cast again). A no-op when not ``off``."""
    return torch._C._DisableAutocast() if off else contextlib.nullcontext()


def mark_dynamic_dims(t: Any, dims: Iterable[int]) -> None:
    """Mark ``t``'s dimensions ``dims`` as symbolic where AOTAutograd would (an output's or a saved
    tensor's): Dynamo then treats them as dynamic in a graph that reads ``t``."""
    if not isinstance(t, torch.Tensor):
        return
    known = getattr(t, "_dynamo_propagated_dynamic_indices", None)
    t._dynamo_propagated_dynamic_indices = set(dims) if known is None else known | set(dims)


def concrete_int(s: Any) -> int | None:
    """``s`` as an int where it is one: an int, or a SymInt that a guard specialized (``s0`` replaced
    by 2: Dynamo may pass such a size in a tensor's shape); None for a symbolic size."""
    if isinstance(s, int):
        return s
    if isinstance(s, torch.SymInt):
        return s.node.maybe_as_int()
    return None


def is_fake(x: Any) -> bool:
    """A fake tensor (DDPOptimizer hands its pieces' example activations as fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


# ---- symbolic shapes: the guards a level-1 entry is valid under -----------------------------------
#
# A graph with symbolic sizes is compiled for every size its ShapeEnv's guards allow. AOTAutograd
# and our passes add guards of their own while compiling it (a size that must not be 0 or 1, a
# divisibility), after Dynamo traced the graph and before it reads the guards off the ShapeEnv.
# So an entry keeps, besides its key, the guards on its graph's size inputs at the end of the
# compile (``ShapeEnv.produce_guards_expression``, Python over ``L['t0']``, ``L['t1']``, ...); a
# lookup evaluates them on this call's sizes (a false one is a miss), and a hit adds them to the
# ShapeEnv, so Dynamo guards on them as it would have after compiling.

class Symbols:
    """A Dynamo graph's size inputs (the SymInt example inputs that are one backed symbol each, in
    input order: Dynamo lifts every symbol of a tensor's sizes as such an input) and their ShapeEnv."""

    def __init__(self, example_inputs: Iterable[Any]) -> None:
        self.symints = [x for x in example_inputs if isinstance(x, torch.SymInt) and x.node.has_hint()]
        self.shape_env = self.symints[0].node.shape_env if self.symints else None
        self.start = len(self.shape_env.guards) if self.shape_env is not None else 0
        # the symbols now: a guard of the compile may specialize one (``Eq(s0, 13)`` replaces s0 by 13)
        self.names = {symbol for s in self.symints for symbol in s.node.expr.free_symbols}

    def __bool__(self) -> bool:
        return self.shape_env is not None

    def settings_text(self) -> str:
        """The ShapeEnv's settings (0/1 specialization, duck sizing, ...): for the key."""
        return repr(getattr(self.shape_env, "settings", None))

    def guards_text(self) -> str | None:
        """The guards on the size inputs now, as Python (None: none). Uncacheable where a guard
        added since ``__init__`` (while compiling) reads a symbol that is not a size input: it could
        not be checked on a later call's sizes."""
        env = self.shape_env
        for guard in env.guards[self.start:]:
            if not guard.expr.free_symbols <= self.names:
                raise Uncacheable(f"the compile added the guard {guard.expr}, on sizes that are not graph inputs")
        try:
            return env.produce_guards_expression(self.symints, guards=env.get_pruned_guards(self.symints))
        except Exception as exc:  # noqa: BLE001 - the graph is compiled, not cached at this level
            raise Uncacheable(f"its guards could not be written ({type(exc).__name__}: {exc})") from None

    def hold(self, text: str) -> bool:
        """Whether the guards ``text`` hold for the sizes of this call (their hints); adds no guard."""
        try:
            return bool(self.shape_env.evaluate_guards_expression(text, [int(s.node.hint) for s in self.symints]))
        except Exception:  # noqa: BLE001 - guards of another torch or graph: not this call's entry
            return False

    def install(self, text: str) -> bool:
        """Add the guards ``text`` to the ShapeEnv (evaluated on the symbols themselves): Dynamo
        then guards the frame on them, as after a compile that added them."""
        return bool(self.shape_env.evaluate_guards_expression(text, self.symints))


def functorch_config_text() -> str:
    """AOTAutograd's settings (they change the graphs it hands us)."""
    cfg = torch._functorch.config
    getter = getattr(cfg, "get_config_copy", None)
    items = getter() if getter is not None else {}
    # Callables print their address, which changes every process: key on their name only.
    return repr(sorted((k, getattr(v, "__qualname__", None) or repr(v)) for k, v in items.items()
                       if not k.startswith("_")))


def tensor_bytes(value: torch.Tensor) -> bytes:
    """The bytes of a real tensor in row-major order, also while a fake mode is active (inside
    AOTAutograd, where a plain ``.cpu()`` would be dispatched to the fake mode and fail)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        if flat.dtype.is_complex:
            flat = torch.view_as_real(flat).reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
