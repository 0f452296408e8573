"""Our own runtime wrappers for a level-1 hit: what AOTAutograd would have built around the
compiled graphs, for the common case only (``compat.runtime_plan`` says which, in a ``RuntimePlan``).

Inference: the inference graph over the flat inputs, with grad mode off; an output that is an
input is that input; one that is a view of an input is the module's, which the runtime builds over
the caller's input (never over a graph's input slot), as AOTAutograd's regenerated alias is.
Training: an autograd.Function whose forward runs the forward graph and keeps its extra outputs
(the saved activations) for the backward, and whose backward makes the tangents the layout the
backward graph was traced with, runs the backward graph, and returns one gradient per input. Under
compiled autograd, the Function carries what compiled autograd reads off AOTAutograd's (its
backward graph, its prologue), so compiled autograd inlines that graph as it would AOTAutograd's.

Invariants (as AOTAutograd's): outputs that do not require grad are marked non-differentiable;
saved views are detached; inputs whose gradient the backward never produces are detached before
the call; kept-in-graph input mutations bump the inputs' version counters; a second-order
backward through the graph raises. A symbolic graph's forward returns the sizes its backward
takes after the saved tensors (``ctx.symints``, the backward's first inputs), and the outputs'
and saved tensors' symbolic dimensions are marked on them for Dynamo. A graph compiled under
autocast runs with autocast off (it holds autocast's casts).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from cgtrees.aot import compat
from cgtrees.compiled_function import RuntimePlan, TangentFormat

Boxed = Callable[[list[Any]], Any]


def inference_function(call: Boxed, plan: RuntimePlan) -> Callable[..., Any]:
    """The whole per-call cost of the wrapper, which replaces AOTAutograd's also on a miss. Grad
    mode goes off only when it is on: AOTAutograd also makes an inference graph for inputs that
    require grad when no output does, and an aten call on them would then record history."""
    bump = plan.bump_versions
    grad_enabled, no_grad = torch.is_grad_enabled, torch.no_grad
    input_outputs, dynamic_dims = plan.input_outputs, plan.dynamic_dims
    if plan.disable_amp:
        call = _without_autocast(call)

    def run(*args: Any) -> list[Any]:
        flat = list(args)
        if bump:
            compat.increment_version([flat[i] for i in bump])
        if grad_enabled():
            with no_grad():
                outs = call(flat)
        else:
            outs = call(flat)
        outs = outs if type(outs) is list else list(outs)
        for out, arg in input_outputs:
            outs[out] = args[arg]
        for out, dims in dynamic_dims:
            compat.mark_dynamic_dims(outs[out], dims)
        return outs

    return run


def _without_autocast(call: Boxed) -> Boxed:
    """``call`` with autocast off: a graph compiled under autocast holds its casts already, and an
    aten call in its module must not be cast again (AOTAutograd runs such graphs so too)."""
    def run(args: list[Any]) -> Any:
        with compat.no_autocast(True):
            return call(args)

    return run


def training_function(forward: Boxed, backward: Boxed, plan: RuntimePlan, detach: tuple[int, ...],
                      aot_attributes: dict[str, Any] | None = None) -> Callable[..., Any]:
    """``aot_attributes``: what compiled autograd reads off AOTAutograd's Function
    (``compat.aot_backward_attributes``); without them it traces our backward instead."""
    bump = plan.bump_versions
    if plan.disable_amp:
        forward, backward = _without_autocast(forward), _without_autocast(backward)
    function = _autograd_function(forward, backward, plan)
    for name, value in (aot_attributes or {}).items():
        setattr(function, name, value)

    def run(*args: Any) -> list[Any]:
        flat = list(args)
        for i in detach:
            flat[i] = flat[i].detach()
        if bump:
            compat.increment_version([flat[i] for i in bump])
        with compat.view_replay(), torch.enable_grad():
            outs = function.apply(*flat)
        return list(outs)

    return run


def _autograd_function(forward: Boxed, backward: Boxed, plan: RuntimePlan) -> type:
    num_outputs = plan.num_outputs
    no_vc_check = plan.num_saved_no_vc_check
    num_symints = plan.num_saved_symints  # sizes the backward takes (a symbolic graph's), saved last
    unsafe_views = plan.unsafe_view_outputs
    non_differentiable = plan.non_differentiable_outputs
    dynamic_dims = plan.dynamic_dims
    dynamic_saved = plan.dynamic_saved
    tangents = list(zip(plan.tangent_outputs, plan.tangent_formats))

    class CachedCompiledFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> tuple[Any, ...]:
            outs = list(forward(list(args)))
            end = len(outs) - num_symints
            user, saved, symints = outs[:num_outputs], outs[num_outputs:end], outs[end:]
            saved = [t.detach() if t._is_view() else t for t in saved]
            for i, dims in dynamic_saved:
                compat.mark_dynamic_dims(saved[i], dims)
            split = len(saved) - no_vc_check
            ctx.save_for_backward(*saved[:split])
            ctx.saved_no_vc_check = saved[split:]
            for i in unsafe_views:
                user[i] = torch.ops.aten._unsafe_view(user[i], user[i].shape)
            for i, dims in dynamic_dims:
                compat.mark_dynamic_dims(user[i], dims)
            ctx.mark_non_differentiable(*[user[i] for i in non_differentiable])
            ctx._materialize_non_diff_grads = False
            ctx.symints = tuple(symints)  # the backward's first inputs; compiled autograd checks them against its own
            return tuple(user)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
            if plan.deterministic is False and torch.are_deterministic_algorithms_enabled():
                raise RuntimeError("cgtrees: this backward was compiled without deterministic algorithms, "
                                   "but torch.use_deterministic_algorithms(True) is set now")
            args = [*ctx.symints, *ctx.saved_tensors, *ctx.saved_no_vc_check,
                    *(_as_traced(grads[i], fmt) for i, fmt in tangents)]
            compat.release_saved(ctx)
            if torch.is_grad_enabled() and (plan.any_input_requires_grad or
                                            any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
                return _FirstOrderOnly.apply(lambda: tuple(backward(args)), torch.empty(0, requires_grad=True))
            return tuple(backward(args))

    return CachedCompiledFunction


class _FirstOrderOnly(torch.autograd.Function):
    """Runs a compiled backward under create_graph=True; differentiating it again raises."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[], tuple[Any, ...]], _anchor: torch.Tensor) -> tuple[Any, ...]:
        return run()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> None:
        raise RuntimeError("cgtrees: double backward through a compiled graph is not supported")


def _as_traced(grad: Any, fmt: TangentFormat) -> Any:
    """The tangent in the layout the backward graph was traced with (AOTAutograd does the same)."""
    if not isinstance(grad, torch.Tensor):
        return grad
    if fmt.memory_format is not None:
        memory_format = getattr(torch, fmt.memory_format)
        return grad if grad.is_contiguous(memory_format=memory_format) else grad.contiguous(memory_format=memory_format)
    if tuple(grad.shape) == fmt.size and tuple(grad.stride()) == fmt.stride:
        return grad
    out = torch.empty_strided(fmt.size, fmt.stride, dtype=grad.dtype, device=grad.device)
    out.copy_(grad)
    return out
