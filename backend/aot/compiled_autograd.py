"""Compiled autograd's backward graphs, through the same pipeline and runtime as any backward.

Compiled autograd (``torch._dynamo.compiled_autograd``, on through its ``_enable`` context manager
or ``torch._dynamo.config.compiled_autograd``) captures a whole backward pass, hooks and gradient
accumulation included, as one FX graph and hands it to torch.compile; Dynamo traces that graph and
hands it to us. It differs from a graph of the user's code in three ways, each handled here:

- **Its first input is a list** of tensors (activations, parameters, the gradients they hold),
  read inside the graph with ``inputs[i]``. AOTAutograd takes flat tensors and sizes only, so
  ``flatten`` rewrites the graph with one input per element (each ``inputs[i]`` becomes an input),
  and the function we return takes the list as the caller passes it. The caller *steals* the
  list: we empty it before the call, so AOTAutograd may free each tensor at its last use.
- **Accumulation is functional in the graph.** AccumulateGrad's functional form returns the new
  gradient (``old + new``, or ``new`` itself when there was none) and Dynamo assigns ``.grad``
  after the graph returns (``call_accumulate_grad`` sets ``variable.grad`` in torch 2.11 and 2.13;
  older torch emitted ``inductor.accumulate_grad_``, which both now rewrite before we see it).
  Tensor hooks and post-accumulate-grad hooks are traced inline. So AOTAutograd sees, at most,
  in-place writes into inputs (a hook that updates a parameter), which it keeps in the graph.
- **It is a backward that runs with grad mode off**, so AOTAutograd hands us an *inference* graph.
  The runtime must see a backward: its outputs are gradients that survive the end of a generation
  (R4), and it marks that a backward ran (R3: the next forward starts a new step). It runs on the
  thread that called ``backward()`` (compiled autograd turns autograd's worker threads off), which
  is the thread of its forward, so the per-(device, thread) tree manager it finds is its
  forward's: both share one tree and one pool.

**Cached like any graph.** The graph calls compiled autograd's ``ops`` and, for each compiled
forward it meets, a closure that runs that forward's backward prologue: neither has a name that
means the same in every process, so ``name_ops`` gives each the text the cache key shows
(``Level1Hints.target_texts``): torch's own backward formulas (``ops.MulBackward0``) by their name, a
prologue by the canonical text of its trace on the call's example values (what it does is all
AOTAutograd will see of it). A C++ custom autograd Function's op is named ``CppNode<Name><n>``,
numbered in the order a process first meets it, so a key on it could match another process's
different graph: such a graph bypasses the first level with that reason (logged); the second level
(kernel modules, keyed by the aten graph) still hits. A graph with symbolic sizes, as the context
manager makes them by default (``dynamic=True``; ``torch._dynamo.config.compiled_autograd`` follows
``torch.compile``'s ``dynamic``), is keyed like any symbolic graph: its sizes as symbols, the guards
on them kept in the entry (``cache.aot``); a prologue that takes sizes (a symbolic forward's
``ctx.symints``) is traced with them as inputs. A level-1 hit rebuilds the same runtime treatment:
the part runs as a backward, behind the same flattening call.

**The forward's level-1 entry** (``cache.aot``, ``aot.backward_graph``) keeps AOTAutograd's
backward graph and metadata, and the rebuilt forward's autograd.Function carries what compiled
autograd reads off AOTAutograd's (``aot.compat.aot_backward_attributes``): a warm process inlines
the same backward graph, so its capture matches the cold one's and hits level 1 too.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from cgtrees import counters
from cgtrees.aot import compat, driver
from cgtrees.cache.aot import Level1Hints
from cgtrees.config import Config

log = logging.getLogger("cgtrees.aot")


def is_backward_graph(example_inputs: Sequence[Any]) -> bool:
    """Whether Dynamo hands us a compiled-autograd graph (it is traced while that region is on)."""
    return bool(example_inputs) and isinstance(example_inputs[0], list) and compat.in_compiled_autograd()


def compile_backward_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Config,
                           graph_id: int) -> Callable[..., Any]:
    """Flatten the list input, then the driver's steps; precompile keeps no entry of it (its saved
    function would lack the call that takes the list)."""
    name = f"g{graph_id}"
    flat = flatten(gm, example_inputs)  # the list input -> one input per element
    hints = name_ops(flat.gm)  # compiled autograd's calls named for the cache key, or why level 1 cannot key it
    log.info("cgtrees: %s is a compiled-autograd backward (%d list inputs flattened)", name, flat.num_listed)
    # backward(create_graph=True) runs with grad mode on: differentiable, compiled as any graph
    compiled = driver.compile_dynamo_graph(flat.gm, flat.inputs, config, graph_id,
                                           backward=not torch.is_grad_enabled(), hints=hints).call
    counters.bump("compiled_autograd_graphs")  # not before: Dynamo may restart a compile
    return flat.caller(compiled)


# ---------------------------------------------------------------- naming ops for the cache key
def name_ops(gm: torch.fx.GraphModule) -> Level1Hints:
    """The text the cache key shows for each call of compiled autograd's own (by node name), or
    why the first cache level must not key the graph."""
    from cgtrees.aot.compat import Uncacheable

    texts: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        op = compat.compiled_autograd_op(node.target)
        if op is not None and op[1]:
            return Level1Hints(bypass=(
                f"the compiled-autograd graph calls {op[0]}, the backward of a C++ custom autograd Function, "
                "which compiled autograd names per process (numbered in the order it meets them), so its text "
                "is no safe key"))
        if op is not None:
            texts[node.name] = f"compiled_autograd.ops.{op[0]}"
        elif compat.is_aot_backward_prologue(node.target):
            try:
                texts[node.name] = f"aot_backward_prologue{{{_traced_text(node)}}}"
            except Uncacheable as exc:
                return Level1Hints(bypass=str(exc))
            except Exception as exc:  # noqa: BLE001 - the graph still compiles; level 1 is bypassed
                return Level1Hints(bypass=f"an AOT backward prologue could not be traced for the key "
                                                f"({type(exc).__name__}: {exc})")
    return Level1Hints(target_texts=texts)


def _traced_text(node: torch.fx.Node) -> str:
    """The canonical text of ``node``'s call traced on its arguments' example values: all that
    AOTAutograd, tracing the graph on values of the same shapes, will see of it."""
    from cgtrees.aot.compat import Uncacheable
    from cgtrees.cache.key import graph_text

    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    if any(isinstance(leaf, torch.fx.Node) and "example_value" not in leaf.meta for leaf in leaves):
        raise Uncacheable("an argument has no example value")
    values = [leaf.meta["example_value"] if isinstance(leaf, torch.fx.Node) else leaf for leaf in leaves]
    # tensors and sizes are the trace's inputs (a symbolic graph's sizes, the forward's ``ctx.symints``)
    positions = [i for i, v in enumerate(values) if isinstance(v, (torch.Tensor, torch.SymInt))]

    def call(*tensors: torch.Tensor) -> Any:
        filled = list(values)
        for i, t in zip(positions, tensors):
            filled[i] = t
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return node.target(*args, **kwargs)

    traced = compat.trace(call, [values[i] for i in positions])
    return graph_text(traced).replace("\n", "; ")


# ---------------------------------------------------------------- flattening the list input
@dataclass(frozen=True)
class FlatGraph:
    gm: torch.fx.GraphModule  # the graph with one input per list element, then the other inputs
    inputs: list[Any]  # its example inputs
    num_listed: int  # how many of them came from the list
    scalars: tuple[tuple[int, torch.device], ...] = ()  # 0-dim CPU tensors of the list: copied to there
    sizes: tuple[int, ...] = ()  # inputs that carry a size as a tensor's shape: passed as that size

    def caller(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        return ListInputCall(compiled, self.num_listed, self.scalars, self.sizes)


class ListInputCall:
    """Called as Dynamo calls the graph (``(inputs, *rest)``); calls ``compiled(*inputs, *rest)``."""

    def __init__(self, compiled: Callable[..., Any], num_listed: int,
                 scalars: tuple[tuple[int, torch.device], ...], sizes: tuple[int, ...]) -> None:
        self.compiled = compiled
        self.num_listed = num_listed
        self.scalars = scalars
        self.sizes = sizes

    def __call__(self, *args: Any) -> Any:
        listed = args[0]
        if len(listed) != self.num_listed:
            raise RuntimeError(f"cgtrees: a compiled-autograd graph compiled for {self.num_listed} "
                               f"list inputs was called with {len(listed)}")
        flat = [*listed, *args[1:]]
        listed.clear()  # stolen: the caller keeps no reference, so each tensor may die at its last use
        for i, device in self.scalars:
            flat[i] = flat[i].to(device, copy=True, non_blocking=True)
        for i in self.sizes:
            flat[i] = flat[i].size(1)
        return self.compiled(*flat)


def flatten(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> FlatGraph:
    """Replace the first input (a list) by one input per element. ``inputs[i]`` in the graph becomes
    the i-th new input; any other use of the list gets a list of the new inputs."""
    listed = list(example_inputs[0])
    graph = torch.fx.Graph()
    remap: dict[torch.fx.Node, Any] = {}
    graph.output(graph.graph_copy(gm.graph, remap))
    holder = remap[next(iter(gm.graph.find_nodes(op="placeholder")))]
    reads = {user.args[1]: user for user in holder.users if _reads_element(user, holder)}
    fake_mode = compat.fake_mode_of(list(graph.find_nodes(op="placeholder")))
    elements = []
    with graph.inserting_before(holder):
        for i, value in enumerate(listed):
            element = graph.placeholder(f"{holder.name}_{i}")
            if i in reads:
                element.meta.update(reads[i].meta)
            elif isinstance(value, torch.Tensor):
                element.meta["example_value"] = compat.fake_of(value, fake_mode)
            elements.append(element)
    for i, read in reads.items():
        read.replace_all_uses_with(elements[i])
        graph.erase_node(read)
    for user in list(holder.users):  # a use other than inputs[i]: the list rebuilt from its elements
        user.args = torch.fx.map_arg(user.args, lambda n: elements if n is holder else n)
        user.kwargs = torch.fx.map_arg(user.kwargs, lambda n: elements if n is holder else n)
    graph.erase_node(holder)
    scalars = _place_scalars(listed, elements, fake_mode)  # after: their users are the elements' now
    inputs = [*listed, *example_inputs[1:]]
    sizes = _sizes_as_ints(graph, inputs)
    graph.lint()
    flat_gm = torch.fx.GraphModule(gm, graph, class_name="CompiledAutogradBackward")
    return FlatGraph(flat_gm, inputs, len(listed), scalars, sizes)


def _sizes_as_ints(graph: torch.fx.Graph, inputs: list[Any]) -> tuple[int, ...]:
    """Compiled autograd passes each dynamic size ``n`` as an empty CPU tensor of shape (0, n),
    read in the graph only as ``.size(1)``; such an input becomes the size itself (``inputs`` is
    updated). A tensor left there would be a CPU input, keeping the graph out of CUDA graphs (R7)."""
    out = []
    for i, (node, value) in enumerate(zip(graph.find_nodes(op="placeholder"), inputs)):
        if not (isinstance(value, torch.Tensor) and value.dim() == 2 and value.numel() == 0 and node.users):
            continue
        reads = list(node.users)
        if not all(_reads_size_1(user, node) for user in reads):
            continue
        size = reads[0].meta.get("example_value", value.size(1))
        with graph.inserting_before(node):
            replacement = graph.placeholder(f"{node.name}_size")
        replacement.meta["example_value"] = size
        for user in reads:
            user.replace_all_uses_with(replacement)
            graph.erase_node(user)
        graph.erase_node(node)
        inputs[i] = size
        out.append(i)
    return tuple(out)


def _reads_size_1(node: torch.fx.Node, tensor: torch.fx.Node) -> bool:
    if node.op == "call_method" and node.target == "size":
        return node.args == (tensor, 1) and not node.kwargs
    return (node.op == "call_function" and node.target is torch.ops.aten.sym_size.int
            and node.args == (tensor, 1))


def _place_scalars(listed: list[Any], elements: list[torch.fx.Node],
                   fake_mode: Any) -> tuple[tuple[int, torch.device], ...]:
    """Where each 0-dim CPU tensor of the list is passed (``listed`` and the elements' example values
    are updated to match).

    Autograd saves a Python scalar (``loss / 3.0``) as a 0-dim CPU "wrapped number" tensor, which
    AOTAutograd traces as a plain 0-dim tensor; it is passed as one (a copy: no op sees a wrapped
    number the trace did not). In a graph on a GPU it is copied to that GPU where only torch's own
    backward formulas read it (a CPU input would keep the whole graph out of CUDA graphs, R7), as
    Inductor does for its CUDA graphs; a custom Function's backward keeps it on the CPU.
    """
    gpu = next((v.device for v in listed if isinstance(v, torch.Tensor) and v.device.type == "cuda"), None)
    out = []
    for i, (value, element) in enumerate(zip(listed, elements)):
        if not (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() == 0):
            continue
        device = value.device
        if gpu is not None and element.users and all(_reads_on_any_device(u) for u in element.users):
            device = gpu
            listed[i] = value.to(device)
            element.meta["example_value"] = compat.fake_of(listed[i], fake_mode)
        out.append((i, device))
    return tuple(out)


def _reads_on_any_device(node: torch.fx.Node) -> bool:
    """An aten op, or one of torch's own backward formulas (not a custom Function's): the device
    of a 0-dim tensor it reads does not change what it computes."""
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return True
    op = compat.compiled_autograd_op(node.target)
    return op is not None and not op[1]


def _reads_element(node: torch.fx.Node, holder: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2
            and node.args[0] is holder and isinstance(node.args[1], int) and not node.kwargs)
