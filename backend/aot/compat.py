"""Every torch private API the aot stage uses, in one place (torch 2.11 on the GPU, 2.13 in CI)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.fx
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._functorch.partitioners import _extract_fwd_bwd_modules, default_partition
from torch.fx.experimental.proxy_tensor import is_sym_node

__all__ = [
    "aot_module_simplified", "make_boxed_func", "default_partition", "is_sym_node",
    "extract_fwd_bwd_modules", "forward_static_input_indices", "is_primal", "is_tangent",
    "fake_mode_of", "fake_of",
]

_EXTRACT_PARAMS = set(inspect.signature(_extract_fwd_bwd_modules).parameters)


def extract_fwd_bwd_modules(joint: torch.fx.GraphModule, saved_values: list[torch.fx.Node],
                            saved_sym_nodes: list[torch.fx.Node], *, num_fwd_outputs: int,
                            static_nodes: Any = None) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Build the forward and backward modules for a chosen saved set.

    Our partitioner decides *what* is saved; torch's helper builds the two graphs, so the saved
    values keep the order and conventions (version-counter groups, symbol bindings) that
    AOTAutograd's runtime expects in each torch release.
    """
    kwargs: dict[str, Any] = {"num_fwd_outputs": num_fwd_outputs}
    if "static_lifetime_input_nodes" in _EXTRACT_PARAMS and static_nodes is not None:
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


def storage_id(t: torch.Tensor) -> Any:
    """A hashable identity of ``t``'s storage (fake tensors' too): views of one tensor share it."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())
