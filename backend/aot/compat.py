"""Every torch private API the aot stage uses, in one place (torch 2.11 on the GPU, 2.13 in CI).

Besides driving AOTAutograd and our partition, our own runtime wrapper (``aot.wrappers``) replaces
AOTAutograd's, so the driver reads AOTAutograd's metadata (``ViewAndMutationMeta``) at compile
time: ``runtime_plan`` turns it into a typed ``RuntimePlan`` for the common case, and raises
``Uncacheable`` with a reason for everything else (the graph then keeps AOTAutograd's wrappers and
bypasses the first cache level). Fields that are missing in an older torch read as their neutral
value. What the cache itself reads of torch (its key's autocast text, the size guards) is in
``cache.compat``; the few of those the aot stage needs too are imported here from there.
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import itertools
import pickle
from dataclasses import replace
from typing import Any, Callable, Iterable

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import is_sym_node

from cgtrees.cache.compat import (
    Symbols,
    Uncacheable,
    autocast_enabled,
    concrete_int,
    saved_tensors_hooks_inlined,
    storage_id,
    tensor_bytes,
)
from cgtrees.compiled_function import RuntimePlan, TangentFormat, TensorSpec

__all__ = [
    "aot_module_simplified", "make_boxed_func", "is_sym_node",
    "extract_fwd_bwd_modules", "forward_static_input_indices", "is_primal", "is_tangent",
    "fake_mode_of", "fake_of", "Uncacheable", "Symbols", "fw_metadata", "runtime_plan", "pickle_aot_metadata",
    "aot_backward_attributes", "fake_mode", "fake_tensors", "increment_version", "release_saved", "view_replay",
    "autocast_enabled", "no_autocast", "mark_dynamic_dims", "concrete_int", "saved_tensors_hooks_inlined",
    "tensor_bytes", "storage_id",
]

# AOTAutograd's modules are imported where they are used: a level-1 hit and a loaded precompiled
# function run our wrappers (``aot.wrappers``, ``aot.rebuild``) without them.

def aot_module_simplified(*args: Any, **kwargs: Any) -> Any:
    from torch._functorch.aot_autograd import aot_module_simplified as run

    return run(*args, **kwargs)


def make_boxed_func(fn: Callable[..., Any]) -> Callable[..., Any]:
    from torch._functorch.aot_autograd import make_boxed_func as boxed

    return boxed(fn)


def extract_fwd_bwd_modules(joint: torch.fx.GraphModule, saved_values: list[torch.fx.Node],
                            saved_sym_nodes: list[torch.fx.Node], *, num_fwd_outputs: int,
                            static_nodes: Any = None) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Build the forward and backward modules for a chosen saved set.

    Our partitioner decides *what* is saved; torch's helper builds the two graphs, so the saved
    values keep the order and conventions (version-counter groups, symbol bindings) that
    AOTAutograd's runtime expects in each torch release.
    """
    from torch._functorch.partitioners import _extract_fwd_bwd_modules

    kwargs: dict[str, Any] = {"num_fwd_outputs": num_fwd_outputs}
    params = inspect.signature(_extract_fwd_bwd_modules).parameters  # a few microseconds, once a compile
    if "static_lifetime_input_nodes" in params and static_nodes is not None:
        kwargs["static_lifetime_input_nodes"] = static_nodes
    return _extract_fwd_bwd_modules(joint, saved_values, saved_sym_nodes, **kwargs)


def is_primal(node: torch.fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" not in str(node.target) and "bwd_seed" not in str(node.target)


def is_tangent(node: torch.fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" in str(node.target)


def forward_static_input_indices() -> tuple[int, ...]:
    """Static inputs (parameters, buffers, marked static) of the graph being compiled now."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    return tuple(getattr(meta, "static_input_indices", ()) or ())


def boxed(fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """Mark ``fn(args: list)`` as taking its inputs boxed (AOTAutograd may then free them early);
    marked in place where ``fn`` takes attributes (a runtime ``GraphFunction``: no extra frame on
    every call), else through a wrapper."""
    try:
        fn._boxed_call = True  # type: ignore[attr-defined]
        return fn
    except AttributeError:
        pass

    def call(args: list[Any]) -> Any:
        return fn(args)

    call._boxed_call = True  # type: ignore[attr-defined]
    return call


def fake_mode_of(placeholders: list[torch.fx.Node]) -> Any:
    """The fake mode the graph was traced under (from its inputs' values), else the active one,
    else a new one."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    for node in placeholders:
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode
    return detect_fake_mode() or FakeTensorMode(allow_non_fake_inputs=True)


def fake_of(value: torch.Tensor, mode: Any) -> torch.Tensor:
    """A fake tensor with ``value``'s metadata, for a lifted constant's placeholder."""
    return mode.from_tensor(value, static_shapes=True)


def in_compiled_autograd() -> bool:
    """Whether compiled autograd is tracing or running a backward graph now (it is when Dynamo
    traces that graph and hands it to us; torch 2.11 and 2.13 keep the flag in this module)."""
    from torch._dynamo import compiled_autograd

    return bool(getattr(compiled_autograd, "in_compiled_autograd_region", False))


def compiled_autograd_op(target: Any) -> tuple[str, bool] | None:
    """``(name, is a custom Function's)`` for one of compiled autograd's ``ops`` (the name of a
    custom Function's, ``CppNode<Name><n>``, is numbered per process); None for any other target.
    Any other op is one of torch's own backward formulas: it runs aten ops only."""
    from torch._dynamo import compiled_autograd

    op_type = getattr(compiled_autograd, "Op", None)
    if op_type is None or not isinstance(target, op_type):
        return None
    return str(target.__name__), bool(getattr(target, "is_custom_function", True))


def is_aot_backward_prologue(target: Any) -> bool:
    """Compiled autograd's call of an AOTAutograd backward's prologue: a closure made for each
    backward it traces, over its forward's metadata (torch 2.11 and 2.13 name it so)."""
    name = getattr(target, "__qualname__", "")
    return isinstance(name, str) and name.endswith("proxy_call_aot_backward.<locals>.call_aot_bwd_prologue")


def trace(fn: Callable[..., Any], args: list[Any]) -> torch.fx.GraphModule:
    """``fn``'s aten graph on ``args`` (fake tensors stay in their own fake mode)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


def count_aot_autograd_compile() -> None:
    """Bump ``counters["aot_autograd"]["total"]``, as torch's ``aot_autograd`` backend wrapper does
    (we call ``aot_module_simplified`` ourselves): DDPOptimizer reads it (``aot.distributed``)."""
    from torch._dynamo.utils import counters

    counters["aot_autograd"]["total"] += 1


def ddp_optimizer_piece() -> int | None:
    """The index of the DDPOptimizer piece being compiled now, or None. Under DDP, Dynamo splits a
    graph at the bucket boundaries and hands each piece to the backend while a ``TracingContext``
    carries ``ddp_optimizer_ctx`` (torch 2.11 and 2.13); ``curr_bucket`` counts the pieces done."""
    context = torch._guards.TracingContext.try_get()
    ddp = getattr(context, "ddp_optimizer_ctx", None) if context is not None else None
    return None if ddp is None else int(ddp.curr_bucket) + 1


# ---- AOTAutograd's metadata, for our runtime wrapper ---------------------------------------------

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


def _tangent_format(meta: Any) -> TangentFormat:
    fmt = getattr(meta, "memory_format", None)
    if fmt is None:
        raise Uncacheable("tangent without a memory format")
    if fmt.memory_format is not None:
        return TangentFormat(memory_format=str(fmt.memory_format).removeprefix("torch."))
    if any(not isinstance(s, int) for s in (*fmt.size, *fmt.stride)):  # int() would guard on the size
        raise Uncacheable("a tangent of symbolic size with a non-standard layout")
    return TangentFormat(size=tuple(fmt.size), stride=tuple(fmt.stride))


def runtime_plan(meta: Any, kind: str, disable_amp: bool = False) -> RuntimePlan:
    """The plain facts our runtime wrapper needs (see ``cgtrees.aot.wrappers``), for the common
    case only: Uncacheable with the reason for anything else. ``disable_amp``: autocast was on when
    the Dynamo graph came (AOTAutograd turns it off before it calls a compiler, so
    ``autocast_enabled()`` must be read before AOTAutograd runs)."""
    if meta is None:
        raise Uncacheable("no AOTAutograd metadata")
    _check_common(meta, kind)
    outputs, inputs = meta.output_info, meta.input_info
    plan = RuntimePlan(
        num_inputs=len(inputs),
        num_outputs=len(outputs),
        # Outputs' symbolic dimensions, marked on them as AOTAutograd does, so that Dynamo makes
        # those dimensions dynamic where a later graph reads the output.
        dynamic_dims=tuple((i, tuple(sorted(out.dynamic_dims))) for i, out in enumerate(outputs)
                           if getattr(out, "dynamic_dims", None)),
        # The graph was compiled with autocast on: it holds autocast's casts, and runs with autocast
        # off (as AOTAutograd runs it), so that aten calls in the module are not cast again.
        disable_amp=disable_amp,
        # Kept-in-graph mutations autograd must see: AOT bumps their version counters first.
        bump_versions=tuple(i for i, info in enumerate(inputs) if _name(info.mutation_type) == "MUTATED_IN_GRAPH"
                            and not info.mutations_hidden_from_autograd),
    )
    if kind == "inference":
        # An output that is a view of an input and requires grad (a reshape after a graph break): autograd
        # must see the view, which AOTAutograd's wrapper makes of the caller's input (``x.detach()``
        # requires none; nor does anything traced with grad off, compiled autograd's backward graphs)
        for i, out in enumerate(outputs):
            if _name(out.output_type) == "alias_of_input" and out.requires_grad and torch.is_grad_enabled():
                raise Uncacheable(f"output {i} is a view of input {out.base_idx} that requires grad")
        # An output that is an input (compiled autograd accumulating into a ``.grad`` in place):
        # the caller gets the input itself, as from AOTAutograd.
        return replace(plan, input_outputs=tuple((i, out.base_idx) for i, out in enumerate(outputs)
                                                 if _name(out.output_type) == "is_input"))
    if getattr(meta, "num_opaque_objects_saved_for_bw", 0):
        raise Uncacheable("opaque objects saved for backward")
    if getattr(meta, "indices_of_inputs_that_requires_grad_with_mutations_in_bw", None):
        raise Uncacheable("backward mutates an input that requires grad")
    surviving = tuple(i for i, out in enumerate(outputs)
                      if getattr(out, "requires_grad_for_backward", out.requires_grad))
    tangent_metas = list(meta.subclass_tangent_meta)
    if len(tangent_metas) != len(surviving):
        raise Uncacheable("tangents do not match differentiable outputs")
    return replace(
        plan,
        unsafe_view_outputs=tuple(i for i, out in enumerate(outputs) if _name(out.output_type) == "unsafe_view_alias"),
        non_differentiable_outputs=tuple(i for i, out in enumerate(outputs) if not out.requires_grad),
        tangent_outputs=surviving,
        tangent_formats=tuple(_tangent_format(m) for m in tangent_metas),
        num_saved_no_vc_check=int(getattr(meta, "num_tensors_saved_with_no_vc_check", 0) or 0),
        nonleaf_requiring_grad=tuple(i for i, info in enumerate(inputs) if info.requires_grad and not info.is_leaf),
        any_input_requires_grad=any(info.requires_grad for info in inputs),
        deterministic=meta.deterministic,
        num_saved_symints=int(getattr(meta, "num_symints_saved_for_bw", 0) or 0),
        # saved tensors' symbolic dimensions (by position among the saved tensors), marked as AOTAutograd does
        dynamic_saved=tuple((i, tuple(sorted(dims))) for i, dims in
                            sorted((getattr(meta, "dynamic_saved_tensors_idxs", None) or {}).items())),
    )


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


def real_tensors() -> Any:
    """A context in which tensors made are real, where a fake mode is active (a graph's constants
    computed at compile time)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_tensors(specs: Iterable[TensorSpec], mode: Any) -> list[torch.Tensor]:
    """Stand-ins for a graph's example inputs (what AOTAutograd would pass) where it is compiled from a
    record: a lazily compiled backward (a hit wraps its modules without them: ``Examples``)."""
    out = []
    with mode:
        for s in specs:
            out.append(torch.empty_strided(s.size, s.stride, dtype=getattr(torch, s.dtype),
                                           device=torch.device(s.device)))
    return out


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
